"""EAGLE-3 proposer: a published EAGLE-3 head (SpecForge / the EAGLE repo) on the target's
auxiliary features, loaded from the layout vLLM and SGLang read.

The target keeps the residual stream at three layer boundaries (low, mid, high: `aux_layer_ids`,
see `CausalLM.aux_layer_ids`) in the same forward as its step. For a committed position j the
head's input feature is g_j = fc(cat(a_j^low, a_j^mid, a_j^high)) (3 * target hidden -> hidden).
Element j pairs a feature g_j with token j+1 (embedding e), at RoPE position j and at position j
of the head's own one-layer paged KV cache (the target's block tables). The midlayer:

    x   = cat(input_layernorm(e), hidden_norm(g))         # [2H]: q/k/v take 2H inputs
    r   = g + o_proj(attention(x))                          # (norm_before_residual: hidden_norm(g) + ...)
    out = r + mlp(post_attention_layernorm(r))              # the element's output feature
    logits = lm_head(norm(out))                             # over the draft vocabulary [N]

and a draft id i is target token i + d2t[i]. Drafting runs the midlayer autoregressively on its
own features (the paper's training-time test): the output feature of element j and the token it
drafted form element j+1. Sampled drafts carry q over the target's whole vocabulary (zero
outside the N mapped tokens), so rejection sampling stays exact.

As in eagle.py (same structure): the head's KV only keeps committed elements; a request buffers
the features g of the positions the midlayer has not run over yet (`HiddenRows`, at most
max(16, k + 1)); a request that does not draft has the midlayer run over all but its last row
once it holds more; `speculative=False` requests keep none. The buffered features are fc's
output (H wide, not 3 * target hidden), computed once per committed row in `observe_step`.
"""

from __future__ import annotations

import collections
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CheckpointError, DrafterMismatchError, UnsupportedModelError
from engine.model_runner import (
    ROW_KERNEL_MAX_TOKENS,
    SeqChunk,
    build_forward_batch,
    last_rows,
)
from engine.models.llama import ArchConfig, apply_rope, linear, rope_cos_sin
from engine.models.loader import load_safetensors
from engine.request import Request
from engine.spec_decode.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    may_draft,
    model_name,
    weights_digest,
)
from engine.spec_decode.proposers.draft_vocab import DraftLMHead
from engine.spec_decode.proposers.feature_buffers import (
    HiddenRows,
    buffer_rows,
    catch_up_rows,
    committed_hidden,
    committed_ranges,
    import_hidden_rows,
    lazy_buffer_rows,
)
from engine.spec_decode.proposers.tree_drafting import kernel_tree_args, kernel_tree_drafts, sampling_rows
from kernels.torch_attn import rows_kernel_inputs

# Rows (elements) up to which the midlayer's forwards and drafting chains run the fused CPU kernels
# (the catch-up of several requests included; more go through torch's path): as the target's
# steps (stop 31: 16 concurrent requests 932 -> 982 tokens/s with the cap at 128 instead of 16).
FUSED_MAX_ROWS = ROW_KERNEL_MAX_TOKENS
# On the CPU row kernels, a decode step's auxiliary rows wait in `Eagle3Proposer._deferred` (the
# step's tensor and each request's range of it), unprojected, until the request's buffer is read
# (its draft, a probe of it, its handoff, a prefill chunk of it) or the waiting steps pass the
# buffer bound (`max_buffered_rows`) or DEFER_BYTES; then fc runs over the waiting rows of the
# requests read (all of them at the bound) at once and each appends its rows once. While
# speculation is off (a batch too large to gain) a step then costs no fc (1/44 of the shipped
# target's products a token) and no per-request append (~0.5 ms a step at 16 requests), and the
# rows of a request that finishes before drafting again are never projected.
DEFER_BYTES = 16 << 20
# Products of up to this many rows take a quantized head's int8 or int4 copies (SpeculativeConfig.draft_weights)
# where the bfloat16 ones run on AMX tiles; more rows take the bfloat16 ones.
QUANT_MAX_ROWS = 8
# what draft_weights='auto' packs a bfloat16 head as where the CPU row kernels run it
AUTO_DRAFT_WEIGHTS = "int4"

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE3_BUFFER_ROWS = 16  # the steady bound of a request's buffered feature rows (k + 1 if larger)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The boundaries EAGLE-3's reference picks when a checkpoint names none (vLLM and SGLang
    alike): the inputs of decoder layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def resolve_aux_layer_ids(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The layer boundaries (`CausalLM.aux_layer_ids`: b = the input of decoder layer b, HF's
    `hidden_states[b]`) whose residual stream feeds fc, in fc's input order.

    Checkpoints name them in `eagle_config.eagle_aux_hidden_state_layer_ids` (or at the top level)
    under two conventions: SpecForge's "output of layer X", whose default list starts at 1
    ([1, L//2 - 1, L - 4]), and "input of layer X" ([2, L//2, L - 3], the reference default).
    vLLM reads every list as inputs; SGLang adds 1 when a list starts at 1 (sglang#25454), which
    agrees with vLLM on every other list. We read them as SGLang does: a list whose first id is 1
    names layer outputs. Absent: `default_aux_layer_ids`.
    """
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    if ids is None:
        ids = default_aux_layer_ids(num_layers)
    elif not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids):
        raise UnsupportedModelError(f"eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {ids!r}")
    elif ids[0] == 1:
        ids = [i + 1 for i in ids]
    ids = tuple(ids)
    if list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > num_layers:
        raise DrafterMismatchError(
            f"EAGLE-3 auxiliary layer boundaries {ids} must be increasing and within [0, {num_layers}] "
            f"(the target has {num_layers} layers)"
        )
    return ids


class Eagle3LMHead(DraftLMHead):
    """The head's own LM head [N, H] over its draft vocabulary; column i is target token
    token_ids[i] (None: the draft vocabulary is the target's, in order)."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> None:
        self.packed = None
        self.packed_few = None
        self.weight, self.token_ids, self.vocab_size = weight, token_ids, vocab_size

    @property
    def num_parameters(self) -> int:
        return self.weight.numel()


class Eagle3Layer(nn.Module):
    """The midlayer: a Llama decoder layer whose q/k/v read [input_layernorm(embedding),
    hidden_norm(feature)] (2H), with its residual stream started at the feature."""

    def __init__(self, cfg: ArchConfig, norm_before_residual: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm_before_residual = norm_before_residual
        h = cfg.hidden_size
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Linear(2 * h, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        # Every matmul of `forward` through the packed weights (`use_packed_matmuls`)
        self.packed_matmuls = False

    def use_packed_matmuls(self) -> None:
        """Run `forward`'s matmuls (a catch-up over a prompt's rows) through the packed CPU kernel
        too: for bfloat16 weights on a CPU without native bfloat16 products, where torch emulates
        them (`DecoderLayer.use_packed_matmuls`)."""
        self.row_weights()
        self.packed_matmuls = True

    def forward(self, embeds, feats, cos, sin, k_cache, v_cache, attn_metadata, backend) -> torch.Tensor:
        # embeds, feats [T, H]; cos/sin [T, 1, head_dim] -> output features [T, H] (pre-norm)
        cfg = self.cfg
        pw = self._row_weights if self.packed_matmuls else None
        eps = cfg.rms_norm_eps
        normed = F.rms_norm(feats, (cfg.hidden_size,), self.hidden_norm, eps)
        residual = normed if self.norm_before_residual else feats
        x = torch.cat([F.rms_norm(embeds, (cfg.hidden_size,), self.input_layernorm, eps), normed], dim=-1)
        n = x.shape[0]
        q, k, v = linear(self.qkv_proj, x, 0, pw and pw["w_qkv"]).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        backend.write_kv(k, v.view(n, cfg.num_kv_heads, cfg.head_dim), k_cache, v_cache, attn_metadata)
        o = backend.attention(q, k_cache, v_cache, attn_metadata, cfg.head_dim**-0.5)
        residual = residual + linear(self.o_proj, o.reshape(n, self.q_size), 0, pw and pw["w_o"])
        h = F.rms_norm(residual, (cfg.hidden_size,), self.post_attention_layernorm, eps)
        gate, up = linear(self.gate_up_proj, h, 0, pw and pw["w_gate_up"]).chunk(2, dim=-1)
        return residual + linear(self.down_proj, F.silu(gate) * up, 0, pw and pw["w_down"])

    def row_weights(self) -> dict:
        """The midlayer's tensors as `cpu_kernels.rows_layer` takes them (matrices packed once:
        a second copy of the head's weights in memory)."""
        if getattr(self, "_row_weights", None) is None:
            from kernels import cpu_kernels

            self._row_weights = {
                "in_norm": None, "post_norm": self.post_attention_layernorm.detach().float().contiguous(),
                "w_qkv": cpu_kernels.pack_rows(self.qkv_proj.weight), "w_o": cpu_kernels.pack_rows(self.o_proj.weight),
                "w_gate_up": cpu_kernels.pack_rows(self.gate_up_proj.weight),
                "w_down": cpu_kernels.pack_rows(self.down_proj.weight),
            }
        return self._row_weights

    def forward_rows(self, embeds, feats, cos, sin, k_cache, v_cache, attn_metadata, weights: dict | None = None
                     ) -> torch.Tensor:
        """`forward` through the fused CPU row kernel (one call after the two input norms):
        float32 activations, cos/sin float32 [T, head_dim]; metadata built with row_exact="kernel";
        `weights`: packed matrices as `row_weights` (default) or their int8 copies.
        Returns the output features [T, H] float32."""
        from kernels import cpu_kernels

        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        feats = feats.float()
        normed = F.rms_norm(feats, (cfg.hidden_size,), self.hidden_norm.float(), eps)
        x_in = torch.cat([F.rms_norm(embeds.float(), (cfg.hidden_size,), self.input_layernorm.float(), eps), normed], -1)
        k_cache, v_cache, tables, lens, tree = rows_kernel_inputs(attn_metadata, k_cache, v_cache)
        out, residual = cpu_kernels.rows_layer(
            normed if self.norm_before_residual else feats, None, cos, sin, weights or self.row_weights(), k_cache, v_cache,
            attn_metadata.slot_mapping, tables, lens, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, eps,
            cfg.head_dim**-0.5, attn_in=x_in, tree=tree,
        )
        return residual + out


def read_eagle3_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"drafter directory {model_dir!r} has no config.json")
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if not set(archs) & set(EAGLE3_ARCHITECTURES):
        raise DrafterMismatchError(
            f"{model_dir!r} is not an EAGLE-3 checkpoint (architectures={archs}; expected one of {EAGLE3_ARCHITECTURES})"
        )
    for field in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if field not in cfg:
            raise CheckpointError(f"{path}: EAGLE-3 config lacks {field!r}")
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False:
        raise UnsupportedModelError(f"{path}: use_aux_hidden_state=false (an EAGLE-1-style head) is not EAGLE-3")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise UnsupportedModelError(f"{path}: {flag}=true is not supported for EAGLE-3 heads")
    return cfg


def resolve_draft_weights(draft_weights: str, row_kernel: bool, dtype: torch.dtype) -> str:
    """SpeculativeConfig.draft_weights -> "int4", "int8" or "model" for an EAGLE-3 head: "auto" is
    AUTO_DRAFT_WEIGHTS for a bfloat16 head on the CPU row kernels where the CPU has AVX512-VNNI
    (the proposer takes int8 instead where a matrix is not a multiple of 32 wide); "int8" and
    "int4" there only."""
    from kernels import cpu_kernels

    can = row_kernel and cpu_kernels.int8_available()
    if draft_weights in ("int8", "int4") and not can:
        raise ValueError(
            f"draft_weights={draft_weights!r} needs the CPU row kernels (the engine's row path) on a CPU with "
            "AVX512-VNNI; use 'model' or 'auto' here"
        )
    if draft_weights == "auto":
        return AUTO_DRAFT_WEIGHTS if can and dtype == torch.bfloat16 else "model"
    return draft_weights


class Eagle3Proposer(Proposer):
    method = "eagle3"
    supports_tree = True
    feature_kv = True

    def __init__(self, model_dir: str, runner, num_speculative_tokens: int = 1, tree_width: int = 4,
                 draft_weights: str = "model") -> None:
        # (the step's aux tensor, [(request, first position, first row, rows)]) of waiting steps
        self._deferred: list[tuple[torch.Tensor, list[tuple[Request, int, int, int]]]] = []
        super().__init__()
        self.tree_width = tree_width  # children per expanded node, and nodes expanded per level
        self.states: dict[str, HiddenRows] = {}
        # rows a request may buffer: steady_rows while it is handed over after its prefill, the
        # lazy bound (`configure_buffers`) otherwise
        self.steady_rows = self.max_buffered_rows = max(EAGLE3_BUFFER_ROWS, num_speculative_tokens + 1)
        cfg = read_eagle3_config(model_dir)
        t = runner.arch
        self.device, self.dtype = runner.device, runner.dtype
        hidden = cfg["hidden_size"]
        target_hidden = cfg.get("target_hidden_size") or hidden
        vocab = cfg["vocab_size"]
        draft_vocab = cfg.get("draft_vocab_size") or vocab
        problems = []
        if target_hidden != t.hidden_size:
            problems.append(f"target_hidden_size {target_hidden} vs the target's hidden size {t.hidden_size}")
        if vocab != t.vocab_size:
            problems.append(f"vocab_size {vocab} vs the target's {t.vocab_size}")
        if problems:
            raise DrafterMismatchError(f"EAGLE-3 head {model_dir!r} does not match target {runner.model_dir!r}: " + "; ".join(problems))
        self.aux_layer_ids = resolve_aux_layer_ids(cfg, t.num_layers)
        num_heads = cfg["num_attention_heads"]
        self.arch = ArchConfig(
            model_type="eagle3", vocab_size=vocab, hidden_size=hidden, num_layers=1, num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads, intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_word_embeddings=False, qkv_bias=False, o_bias=False,
            mlp_bias=False, qk_norm=False, max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            sliding_window=None,
        )
        w = load_safetensors(model_dir)
        self.fc = nn.Linear(len(self.aux_layer_ids) * target_hidden, hidden, bias=False)
        self.layer = Eagle3Layer(self.arch, bool(cfg.get("norm_before_residual", False)))
        self.norm = nn.Parameter(torch.ones(hidden))
        lm_head = torch.empty(draft_vocab, hidden)
        embed = torch.empty(vocab, hidden) if "embed_tokens.weight" in w else None
        L, a = self.layer, self.arch
        expected = {  # published key -> (destination, shape)
            "fc.weight": (self.fc.weight, None),
            "midlayer.input_layernorm.weight": (L.input_layernorm, None),
            "midlayer.hidden_norm.weight": (L.hidden_norm, None),
            "midlayer.self_attn.q_proj.weight": (None, (L.q_size, 2 * hidden)),
            "midlayer.self_attn.k_proj.weight": (None, (L.kv_size, 2 * hidden)),
            "midlayer.self_attn.v_proj.weight": (None, (L.kv_size, 2 * hidden)),
            "midlayer.self_attn.o_proj.weight": (L.o_proj.weight, None),
            "midlayer.post_attention_layernorm.weight": (L.post_attention_layernorm, None),
            "midlayer.mlp.gate_proj.weight": (None, (a.intermediate_size, hidden)),
            "midlayer.mlp.up_proj.weight": (None, (a.intermediate_size, hidden)),
            "midlayer.mlp.down_proj.weight": (L.down_proj.weight, None),
            "norm.weight": (self.norm, None),
            "lm_head.weight": (lm_head, None),
        }
        if embed is not None:
            expected["embed_tokens.weight"] = (embed, None)
        for key, (dest, shape) in expected.items():
            if key not in w:
                raise CheckpointError(f"EAGLE-3 checkpoint {model_dir!r} lacks tensor {key!r}")
            want = tuple(dest.shape) if dest is not None else shape
            if tuple(w[key].shape) != want:
                raise CheckpointError(
                    f"EAGLE-3 checkpoint {model_dir!r}: tensor {key!r} has shape {tuple(w[key].shape)}, expected {want}"
                )
        token_ids = self._read_vocab_map(model_dir, w, draft_vocab, vocab)
        unknown = sorted(k for k in w if k not in expected and k not in ("d2t", "t2d") and "rotary_emb" not in k)
        if unknown:
            raise CheckpointError(f"EAGLE-3 checkpoint {model_dir!r} has tensors this head does not use: {unknown[:5]}")
        with torch.no_grad():
            for key, (dest, _) in expected.items():
                if dest is not None:
                    dest.copy_(w[key])
            L.qkv_proj.weight.copy_(torch.cat([w[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkv"]))
            L.gate_up_proj.weight.copy_(torch.cat([w["midlayer.mlp.gate_proj.weight"], w["midlayer.mlp.up_proj.weight"]]))
        self.fc = self.fc.to(self.device, self.dtype).eval().requires_grad_(False)
        self.layer = self.layer.to(self.device, self.dtype).eval().requires_grad_(False)
        self.norm = self.norm.detach().to(self.device, self.dtype)
        if embed is not None:
            self.embed_tokens = nn.Embedding.from_pretrained(embed.to(self.device, self.dtype), freeze=True)
        elif hidden != t.hidden_size:
            raise DrafterMismatchError(
                f"EAGLE-3 head {model_dir!r} has no embed_tokens.weight and its hidden size {hidden} differs "
                f"from the target's {t.hidden_size}, so it cannot use the target's embedding"
            )
        else:
            self.embed_tokens = runner.model.embed_tokens  # shared with the target, in place
        self.head = Eagle3LMHead(
            lm_head.to(self.device, self.dtype), None if token_ids is None else token_ids.to(self.device), vocab
        )
        from transformers import LlamaConfig

        hf = LlamaConfig(
            hidden_size=a.num_heads * a.head_dim, num_attention_heads=a.num_heads, head_dim=a.head_dim,
            rope_theta=cfg.get("rope_theta", 10000.0), rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=a.max_position_embeddings,
        )
        self.rope_cos, self.rope_sin = rope_cos_sin(hf, runner.model.rope_cos.shape[0] + 1, self.dtype, self.device)
        # Small steps through the fused CPU row path (kernels/cpu_rows.cpp) where the target's runs.
        self.row_kernel = runner.row_kernel
        self.fused_max_rows = max(FUSED_MAX_ROWS, runner.row_kernel_max_tokens)  # (the target's row-step bound)
        self.draft_weights = resolve_draft_weights(draft_weights, self.row_kernel, self.dtype)
        self._quant: tuple[dict, torch.Tensor, torch.Tensor] | None = None  # (midlayer, LM head, fc) as int8 or int4
        self.quant_max_rows = 0  # products of up to this many rows take the quantized copies
        if self.row_kernel:
            from kernels import cpu_kernels

            self.rope_f32 = rope_cos_sin(hf, runner.model.rope_cos.shape[0] + 1, torch.float32, self.device)
            self.layer.row_weights()
            self.head.use_row_kernel()
            # fc over each step's committed rows through the packed kernel (a few rows: faster than
            # torch's product, whose fixed cost was ~0.3 ms of each step here); fc over a prompt's
            # rows and the midlayer's catch-up too where torch emulates bf16
            self.fc_packed_all = self.dtype == torch.bfloat16 and cpu_kernels.emulated_bf16()
            self.packed_fc = cpu_kernels.pack_rows(self.fc.weight)
            if self.fc_packed_all:
                self.layer.use_packed_matmuls()
            # the head's packed matrices on 2 MiB pages, as the target's (CausalLM.prepare_rows)
            rw, keys = self.layer.row_weights(), ("w_qkv", "w_o", "w_gate_up", "w_down")
            *mats, self.head.packed, self.packed_fc = cpu_kernels.on_huge_pages(
                [rw[k] for k in keys] + [self.head.packed, self.packed_fc])
            rw.update(zip(keys, mats, strict=True))
            if self.draft_weights in ("int8", "int4"):  # quantized copies for the few-row products
                L = self.layer
                mats_in = (L.qkv_proj.weight, L.o_proj.weight, L.gate_up_proj.weight, L.down_proj.weight,
                           self.head.weight, self.fc.weight)
                if self.draft_weights == "int4" and any(w.shape[1] % 32 for w in mats_in):
                    if draft_weights == "auto":
                        self.draft_weights = "int8"
                    else:
                        raise ValueError(
                            f"draft_weights='int4' needs every matrix of the head to be a multiple of 32 wide, got "
                            f"{tuple(w.shape[1] for w in mats_in)}; use 'int8'"
                        )
                pack = cpu_kernels.pack_rows_int8 if self.draft_weights == "int8" else cpu_kernels.pack_rows_int4
                *mats, head_i8, fc_i8 = cpu_kernels.on_huge_pages([pack(w) for w in mats_in])
                self._quant = ({**rw, **dict(zip(keys, mats, strict=True))}, head_i8, fc_i8)
                # past a few rows the int8 products are bound by their multiply-adds, the bfloat16
                # ones on AMX tiles are not (a prompt's catch-up: 7.9 vs 4.8 ms for 128 rows)
                self.quant_max_rows = QUANT_MAX_ROWS if cpu_kernels.amx_available() else 1 << 30
                self.head.packed_few = (self.quant_max_rows, head_i8)  # (the Python loop's logits too)
        self.backend = runner.backend
        self.block_size = 0
        self.step_graph = None  # `capture_step_graph`
        self.timer = StepTimer(5e-4)  # one autoregressive step of the head
        named = [(f"fc.{n}", p) for n, p in self.fc.named_parameters()]
        named += [(f"midlayer.{n}", p) for n, p in self.layer.named_parameters()]
        named += [("lm_head.weight", self.head.weight), (f"aux_layer_ids={self.aux_layer_ids}", self.norm)]
        if self.draft_weights != "model":  # other drafts and features than the checkpoint's dtype gives
            named.append((f"draft_weights={self.draft_weights}", self.norm))
        self._identity = DrafterIdentity(model_name(model_dir), weights_digest(named), draft_vocab)
        self._own_embedding = embed is not None
        self._chain_norms: dict[str, torch.Tensor] | None = None  # float32 norms of draft_chain
        self.row_kernel_chain = self.row_kernel  # chains through cpu_kernels.draft_chain

    @staticmethod
    def _read_vocab_map(model_dir: str, w: dict, draft_vocab: int, vocab: int) -> torch.Tensor | None:
        """Target token id of each draft id (arange(N) + d2t), checked against t2d when present;
        None when the draft vocabulary is the target's own, in order."""
        d2t = w.get("d2t")
        if d2t is None:
            if draft_vocab != vocab:
                raise CheckpointError(
                    f"EAGLE-3 checkpoint {model_dir!r} lacks tensor 'd2t' (its draft_vocab_size {draft_vocab} "
                    f"differs from the vocabulary's {vocab})"
                )
            return None
        if tuple(d2t.shape) != (draft_vocab,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise CheckpointError(
                f"EAGLE-3 checkpoint {model_dir!r}: tensor 'd2t' has shape {tuple(d2t.shape)} and dtype {d2t.dtype}, "
                f"expected ({draft_vocab},) integer offsets"
            )
        token_ids = torch.arange(draft_vocab) + d2t.long()
        if token_ids.min() < 0 or token_ids.max() >= vocab or token_ids.unique().numel() != draft_vocab:
            raise CheckpointError(
                f"EAGLE-3 checkpoint {model_dir!r}: tensor 'd2t' maps draft ids to target ids outside [0, {vocab}) "
                "or to the same id twice"
            )
        t2d = w.get("t2d")
        if t2d is not None:
            if tuple(t2d.shape) != (vocab,):
                raise CheckpointError(
                    f"EAGLE-3 checkpoint {model_dir!r}: tensor 't2d' has shape {tuple(t2d.shape)}, expected ({vocab},)"
                )
            if int(t2d.bool().sum()) != draft_vocab or not bool(t2d.bool()[token_ids].all()):
                raise CheckpointError(f"EAGLE-3 checkpoint {model_dir!r}: tensors 't2d' and 'd2t' disagree")
        if torch.equal(token_ids, torch.arange(vocab)):
            return None
        return token_ids

    def identity(self) -> DrafterIdentity:
        return self._identity

    @property
    def states(self) -> dict[str, HiddenRows]:
        """Each request's buffered features, every deferred row appended first (DEFER_BYTES)."""
        if self._deferred:
            self._flush_deferred()
        return self._states

    @states.setter
    def states(self, value: dict[str, HiddenRows]) -> None:
        self._states = value

    def _state(self, request_id: str) -> HiddenRows | None:
        return self._states.get(request_id)

    def pending_rows(self, request: Request) -> int:
        """Its buffered rows and its deferred ones (counted, not projected)."""
        return self.pending_rows_of([request])[0]

    def pending_rows_of(self, requests: list[Request]) -> list[int]:
        """`pending_rows` of each request, the deferred entries counted in one pass."""
        deferred: collections.Counter = collections.Counter()
        for _, entries in self._deferred:
            for r, _, _, n in entries:
                deferred[r.request_id] += n
        return [(0 if (st := self._states.get(r.request_id)) is None else st.rows.shape[0]) + deferred[r.request_id]
                for r in requests]

    @torch.inference_mode()
    def _flush_deferred(self, only: set[str] | None = None) -> None:
        """fc over the deferred rows of the requests in `only` (None: all) at once (the packed
        kernel: each row's bits as in a step of its own), then each request's rows appended in one
        piece and the buffers bounded, as `observe_step` does for a step."""
        from kernels import cpu_kernels

        if not self._deferred:
            return
        pending, kept = self._deferred, []
        if only is not None:
            for aux, entries in pending:
                rest = [e for e in entries if e[0].request_id not in only]
                if rest:
                    kept.append((aux, rest))
        groups: dict[str, tuple[Request, int, list[torch.Tensor]]] = {}
        for aux, entries in pending:
            for r, start, lo, n in entries:
                if r.is_finished or (only is not None and r.request_id not in only):
                    continue
                group = groups.setdefault(r.request_id, (r, start, []))
                if start != group[1] + sum(t.shape[0] for t in group[2]):
                    raise RuntimeError(f"EAGLE-3: request {r.request_id!r}'s deferred rows are not contiguous")
                group[2].append(aux[lo : lo + n])
        if not groups:
            self._deferred = kept
            return
        rows = torch.cat([t for _, _, ts in groups.values() for t in ts])
        feats = cpu_kernels.packed_linear(rows, self._packing(rows.shape[0])[2], self.arch.hidden_size, None)
        self._deferred = kept  # (from here on the rows are the buffers')
        committed, at = [], 0
        for r, start, ts in groups.values():
            n = sum(t.shape[0] for t in ts)
            committed.append((r, start, feats[at : at + n]))
            at += n
        buffer_rows(self._states, committed, self._bound, self._forward, "EAGLE-3", self.max_buffered_rows + 1)
        self._cover(r for r, _, _ in committed)

    def free_request(self, request_id: str) -> None:
        """Forget a request, its deferred rows too (without projecting anyone's)."""
        if self._deferred:
            self._deferred = [(aux, [e for e in entries if e[0].request_id != request_id]) for aux, entries in self._deferred]
        self._states.pop(request_id, None)
        if self.kv_coverage is not None:
            self.kv_coverage.forget(request_id)

    def export_state(self, request_id: str) -> HiddenRows | None:
        """The buffered features (on the CPU) of the positions the midlayer has not run over yet;
        its KV of the others travels as the handoff's `drafter_kv`."""
        self._flush_deferred({request_id})
        state = self._states.get(request_id)
        return None if state is None else state.to("cpu")

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        if state is None:
            return
        self._states[request_id] = import_hidden_rows(
            "EAGLE-3", state, self.arch.hidden_size, num_computed_tokens, self.device, self.dtype
        )

    @property
    def num_parameters(self) -> int:
        own = sum(p.numel() for m in (self.fc, self.layer) for p in m.parameters()) + self.norm.numel()
        embed = self.embed_tokens.weight.numel() if self._own_embedding else 0
        return own + embed + self.head.num_parameters

    def modules(self):
        return [self.fc, self.layer] + ([self.embed_tokens] if self._own_embedding else [])

    @property
    def kv_arch(self):
        return self.arch

    def buffer_bytes(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Buffered features between steps, plus one step's committed rows (and their aux input)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        buffered = (max_num_seqs * self.max_buffered_rows + max_num_batched_tokens) * self.arch.hidden_size
        return (buffered + max_num_batched_tokens * self.fc.in_features) * size

    def configure_buffers(self, max_num_seqs: int, max_model_len: int) -> None:
        size = torch.empty((), dtype=self.dtype).element_size()
        self.max_buffered_rows = lazy_buffer_rows(self.steady_rows, max_num_seqs, self.arch.hidden_size * size, max_model_len)

    def _kv_done(self, state: HiddenRows) -> int:
        return state.start

    def _bound(self, request: Request) -> int:
        return self.steady_rows if request.export_after_prefill else self.max_buffered_rows

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.timer.round_seconds(num_requests, k)

    @torch.inference_mode()
    def observe_step(self, sched, runner_out) -> None:
        """Buffer fc(aux) of each drafting-capable request's newly committed positions, then bound
        the buffers: run the midlayer over the rows of every request holding more than its bound
        (`max_buffered_rows`, feature_buffers.LAZY_BUFFER_ROWS), all but the last."""
        aux = runner_out.aux_hidden_states
        if not any(may_draft(s.request) and not s.request.is_finished for s in sched.scheduled):
            return
        if (self.row_kernel and (self.fc_packed_all or aux.shape[0] <= self.fused_max_rows)
                and all(s.num_new_tokens == 1 for s in sched.scheduled)):
            # a decode step: its rows wait (DEFER_BYTES); a draft this step reads them at once
            self._deferred.append((aux, [e for e in committed_ranges(sched, runner_out) if may_draft(e[0])]))
            held = sum(a.numel() for a, _ in self._deferred) * aux.element_size()
            if len(self._deferred) >= self.max_buffered_rows or held > DEFER_BYTES:
                self._flush_deferred()
            return
        # fc over the step's every row (rejected drafts' too: fewer ops than gathering the rest)
        if self.row_kernel and (self.fc_packed_all or aux.shape[0] <= self.fused_max_rows):
            from kernels import cpu_kernels

            feats = cpu_kernels.packed_linear(aux, self._packing(aux.shape[0])[2], self.arch.hidden_size, None)
        else:
            feats = self.fc(aux)  # one product for the step
        committed = [c for c in committed_hidden(sched, runner_out, feats) if may_draft(c[0])]
        if self._deferred:  # (their earlier rows first)
            self._flush_deferred({r.request_id for r, _, _ in committed})
        buffer_rows(self._states, committed, self._bound, self._forward, "EAGLE-3", self.max_buffered_rows + 1)
        self._cover(r for r, _, _ in committed)

    def check_no_leaks(self, live_ids: set[str]) -> None:
        super().check_no_leaks(live_ids)
        over = {rid: st.rows.shape[0] for rid, st in self.states.items() if st.rows.shape[0] > self.max_buffered_rows}
        if over:
            raise AssertionError(f"EAGLE-3 buffers more than {self.max_buffered_rows} feature rows: {over}")

    def _packing(self, rows: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """(midlayer weights for rows_layer, LM head, fc) packed for products of `rows` rows: the
        int8 copies up to `int8_max_rows`, else the checkpoint dtype's."""
        if self._quant is not None and rows <= self.quant_max_rows:
            return self._quant
        return self.layer.row_weights(), self.head.packed, self.packed_fc

    def capture_step_graph(self, max_positions: int, capture: bool = True) -> bool:
        """The midlayer's forwards of up to STEP_GRAPH_TOKENS (16) elements (a round's catch-up, each
        draft, each tree level) as one CUDA graph (engine/step_graph.py) on the Triton backend;
        not where the CPU's fused path runs them. `capture=False`: the same static buffers run
        eagerly (tests, under Triton's interpreter)."""
        from engine.step_graph import can_capture, make_step_graph

        if not can_capture(self.row_kernel, self.backend, self.device, capture):
            return False
        k_cache, v_cache = self.kv_caches[0]

        def forward(g) -> torch.Tensor:
            cos, sin = self.rope_cos[g.positions].unsqueeze(1), self.rope_sin[g.positions].unsqueeze(1)
            return self.layer(self.embed_tokens(g.input_ids), g.floats["features"], cos, sin, k_cache, v_cache,
                              g.metadata, self.backend)

        self.step_graph = make_step_graph("EAGLE-3's forwards", forward, self.backend, self.block_size, max_positions,
                                          self.device, capture, {"features": (self.arch.hidden_size, self.dtype)})
        return self.step_graph is not None

    def _forward(self, chunks: list[SeqChunk], token_ids: list[int], features: torch.Tensor,
                 num_last: int | list[int] = 1) -> torch.Tensor:
        """Run the midlayer on elements (features[i], token_ids[i]) at the cache positions of
        `chunks` (RoPE position = cache position, by depth in a tree); returns each chunk's last
        `num_last` (or num_last[b]) output features [sum, H], chunk after chunk."""
        fused = self.row_kernel and len(token_ids) <= self.fused_max_rows
        if not fused and self.step_graph is not None and self.step_graph.fits(chunks):
            batch, (out,) = self.step_graph.run(chunks, build_forward_batch, token_ids,
                                                {"features": features.to(self.dtype)})
            return out[torch.tensor(last_rows(batch.cu_query_lens, num_last), device=self.device)]
        batch = build_forward_batch(chunks, self.block_size, self.backend, self.device,
                                    row_exact="kernel" if fused else None)
        embeds = self.embed_tokens(torch.tensor(token_ids, device=self.device))
        k_cache, v_cache = self.kv_caches[0]
        last = torch.tensor(last_rows(batch.cu_query_lens, num_last), device=self.device)
        if fused:  # float32 activations through the midlayer, one kernel call
            cos, sin = self.rope_f32[0][batch.positions], self.rope_f32[1][batch.positions]
            out = self.layer.forward_rows(embeds, features, cos, sin, k_cache, v_cache, batch.attn_metadata,
                                          self._packing(len(token_ids))[0])
            return out[last].to(self.dtype)
        cos, sin = self.rope_cos[batch.positions].unsqueeze(1), self.rope_sin[batch.positions].unsqueeze(1)
        out = self.layer(embeds, features.to(embeds.dtype), cos, sin, k_cache, v_cache, batch.attn_metadata, self.backend)
        return out[last]

    def _normed(self, feats: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(feats, (self.arch.hidden_size,), self.norm, self.arch.rms_norm_eps)

    def _sample(self, feats: torch.Tensor, requests: list[Request], generators) -> tuple[list[int], torch.Tensor | None]:
        return self.head.sample(self._normed(feats), requests, generators)

    def _catch_up_chunks(self, requests: list[Request]) -> tuple[list[SeqChunk], list[int], torch.Tensor]:
        """The elements (g_j, token j + 1) of every request's buffered positions j in [start, n - 1)."""
        feats_in: list[torch.Tensor] = []
        chunks, elem_tokens = [], []
        for r in requests:
            n = r.num_tokens
            state = self._states.get(r.request_id)
            if state is None or state.end != n - 1 or state.start == state.end:
                raise RuntimeError(
                    f"EAGLE-3: request {r.request_id!r} cannot draft: it needs the features up to position "
                    f"{n - 2}, it buffers {None if state is None else (state.start, state.end)}"
                )
            chunks.append(SeqChunk([0] * state.rows.shape[0], state.start, r.block_ids))
            elem_tokens.extend(r.token_at(j + 1) for j in range(state.start, n - 1))
            feats_in.append(state.rows)
        return chunks, elem_tokens, torch.cat(feats_in)

    @torch.inference_mode()
    def propose_trees(self, requests: list[Request], num_nodes: list[int], max_depths: list[int],
                      context: ProposeContext, widths: list[int] | None = None) -> list[Draft]:
        """Dynamic trees (`tree_drafting.grow_trees`) of the midlayer, as `FeatureLayerProposer`'s: the
        catch-up's last output (position n - 2) gives the root's children; a node's element pairs
        its parent's output feature with its token, at slot n - 2 + its index in the expanded
        tree and RoPE position by depth; each level runs its new nodes only (a partial tree)."""
        from engine.spec_decode.proposers.tree_drafting import grow_trees, scratch_depths, tree_widths

        self._flush_deferred({r.request_id for r in requests})
        t_start = time.perf_counter()
        widths = tree_widths(widths, len(requests), self.tree_width)
        depths = scratch_depths(requests, max_depths, widths, self.block_size, root_offset=2)
        chunks, elem_tokens, feats_in, t_start = self._long_catch_up_first(requests, max(depths), t_start)
        if self.row_kernel_chain and len(elem_tokens) <= self.fused_max_rows:
            return self._propose_tree_kernel(requests, num_nodes, depths, widths, chunks, elem_tokens, feats_in, t_start,
                                             context)
        last = self._forward(chunks, elem_tokens, feats_in)  # [R, H]
        outputs = list(last.unsqueeze(1))  # per request: the output of each expanded node (the root's first)

        def run_level(active: list[int], trees: list, counts: list[int]) -> torch.Tensor:
            level_chunks, tokens, feats = [], [], []
            for i, t, f in zip(active, trees, counts, strict=True):
                r = requests[i]
                level_chunks.append(SeqChunk([0] * f, r.num_tokens - 2 + t.num_nodes - f, r.block_ids, t))
                tokens.extend(t.token_ids[-f:])
                feats.append(outputs[i][list(t.parents[-f:])])
            out = self._forward(level_chunks, tokens, torch.cat(feats), num_last=counts)  # [sum(counts), H]
            for i, o in zip(active, out.split(counts), strict=True):
                outputs[i] = torch.cat([outputs[i], o])
            return self._normed(out)

        drafts, num_forwards = grow_trees(requests, num_nodes, depths, widths, self.head, self._normed(last),
                                          context.generators_for(requests), run_level,
                                          self.tree_temperature, context.tree_min_logprob)
        for r in requests:  # every forward succeeded: the buffered elements are in the midlayer's KV
            self._states[r.request_id] = HiddenRows(r.num_tokens - 1, self._states[r.request_id].rows[:0].clone())
        self._cover(requests)
        catch_up = max(len(c.token_ids) for c in chunks)
        self.timer.add_round(len(requests), time.perf_counter() - t_start, num_forwards + 1, catch_up, max(depths), chain=False)
        return drafts

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        self._flush_deferred({r.request_id for r in requests})  # (their rows first; not timed as drafting)
        t_start = time.perf_counter()
        chunks, elem_tokens, feats_in, t_start = self._long_catch_up_first(requests, max(num_tokens), t_start)
        if self.row_kernel_chain and len(elem_tokens) <= self.fused_max_rows:
            return self._propose_chain_kernel(requests, num_tokens, chunks, elem_tokens, feats_in, t_start, context)
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        first_chunks = chunks
        generators = context.generators_for(requests)
        feats = self._forward(chunks, elem_tokens, feats_in)
        active = list(range(len(requests)))
        step = 0
        while True:
            picked, p = self._sample(feats, [requests[i] for i in active], [generators[i] for i in active])
            for j, i in enumerate(active):
                tokens[i].append(picked[j])
                if p is not None:
                    probs[i].append(p[j])
            keep = [j for j, i in enumerate(active) if len(tokens[i]) < num_tokens[i]]
            if not keep:
                break
            active = [active[j] for j in keep]
            feats = feats[keep]
            step += 1
            # element (own output feature, drafted token) at position n - 2 + step
            chunks = [SeqChunk([0], requests[i].num_tokens - 2 + step, requests[i].block_ids) for i in active]
            feats = self._forward(chunks, [tokens[i][-1] for i in active], feats)
        for r in requests:  # every forward succeeded: the buffered elements are in the midlayer's KV
            self._states[r.request_id] = HiddenRows(r.num_tokens - 1, self._states[r.request_id].rows[:0].clone())
        self._cover(requests)
        catch_up = max(len(c.token_ids) for c in first_chunks)
        self._add_round(requests, time.perf_counter() - t_start, step + 1, catch_up,
                        sum(len(c.token_ids) for c in first_chunks), max(num_tokens))
        return [
            Draft(t, torch.stack(pr) if pr and not r.sampling_params.is_greedy else None)
            for t, pr, r in zip(tokens, probs, requests, strict=True)
        ]

    def _long_catch_up_first(self, requests: list[Request], k_max: int, t_start: float
                             ) -> tuple[list[SeqChunk], list[int], torch.Tensor, float]:
        """The catch-up elements (`_catch_up_chunks`) after running a long catch-up (after a
        prompt, or speculation off) on its own: one past the fused kernels' rows, or, with
        quantized drafting weights, one past their rows (on the bfloat16 ones) when the drafting
        itself stays within them. Returns them and the round's start time: a catch-up beyond
        k_max + 1 rows per request (a prompt's or a paused request's) is a one-off, not a round's
        cost; the policy weighs it as a debt (`record_catch_up`)."""
        chunks, elem_tokens, feats_in = self._catch_up_chunks(requests)
        if len(elem_tokens) > self.fused_max_rows or len(requests) <= self.quant_max_rows < len(elem_tokens):
            rows, longest = len(elem_tokens), max(len(c.token_ids) for c in chunks)
            catch_up_rows(self._states, [(r, self._states[r.request_id]) for r in requests], self._forward)
            chunks, elem_tokens, feats_in = self._catch_up_chunks(requests)
            if longest > k_max + 1:
                now = time.perf_counter()
                self.record_catch_up(rows - len(elem_tokens), now - t_start)
                t_start = now
        return chunks, elem_tokens, feats_in, t_start

    def _add_round(self, requests: list[Request], seconds: float, forwards: int, catch_up: int, rows: int,
                   k_max: int) -> None:
        """Record a drafting round (`StepTimer.add_round`); one that also caught up over a long
        stretch (a prompt's rows, where it ran in the same call) records that part, its time
        beyond a steady round of as many drafts, as a catch-up (`record_catch_up`)."""
        if catch_up > k_max + 1:
            steady = self.timer.round_seconds(len(requests), forwards)
            self.record_catch_up(rows - len(requests), max(0.0, seconds - steady))
        self.timer.add_round(len(requests), seconds, forwards, catch_up, k_max)

    def _propose_chain_kernel(self, requests: list[Request], num_tokens: list[int], chunks: list[SeqChunk],
                              elem_tokens: list[int], feats_in: torch.Tensor, t_start: float,
                              context: ProposeContext) -> list[Draft]:
        """`propose` on the fused CPU path: the catch-up forward and every draft in one kernel
        call (`cpu_kernels.draft_chain`: the same midlayer kernel, norms and LM head as the loop
        above, without a Python round trip per draft). Greedy requests take the argmax (the loop's
        drafts unless float32 rounding of a norm flips a near-tie, which changes only what is
        proposed, never the verified output); sampled ones draw from the filtered distribution over
        the draft vocabulary with one uniform per draft from their generators, and their q comes
        back with the drafts (rejection sampling needs only that the drafts were drawn from it)."""
        from engine.sampler import draw_uniforms
        from kernels import cpu_kernels

        positions, owner, tables = self._kernel_elements(requests, chunks)
        k_cache, v_cache = self.kv_caches[0]
        cfg = self.arch
        greedy = [r.sampling_params.is_greedy for r in requests]
        sampling = uniforms = None
        if not all(greedy):
            sampling = sampling_rows(requests)
            counts = [0 if g else k for g, k in zip(greedy, num_tokens, strict=True)]
            flat = draw_uniforms(counts, context.generators_for(requests), "cpu")
            uniforms = torch.zeros(len(requests), max(num_tokens))
            uniforms[[b for b, c in enumerate(counts) for _ in range(c)], [j for c in counts for j in range(c)]] = flat
        drafts, q = cpu_kernels.draft_chain(
            feats_in.float().contiguous(), torch.tensor(elem_tokens, dtype=torch.int64), positions, owner, tables,
            torch.tensor(num_tokens, dtype=torch.int64), self.embed_tokens.weight, self._chain_norms,
            self.layer.norm_before_residual, *self._packing(len(elem_tokens))[:2], self.head.size,
            self.head.token_ids, self.rope_f32, k_cache, v_cache, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.rms_norm_eps, cfg.head_dim**-0.5, self.dtype == torch.bfloat16,
            sampling, uniforms,
        )
        drafts = drafts.tolist()
        for r in requests:  # the call succeeded: the buffered elements are in the midlayer's KV
            self._states[r.request_id] = HiddenRows(r.num_tokens - 1, self._states[r.request_id].rows[:0].clone())
        self._cover(requests)
        self._add_round(requests, time.perf_counter() - t_start, max(num_tokens),
                        max(len(c.token_ids) for c in chunks), len(elem_tokens), max(num_tokens))
        out = []
        for b, (d, k, g) in enumerate(zip(drafts, num_tokens, greedy, strict=True)):
            out.append(Draft(d[:k], None if g else self.head.to_vocab(q[b, :k])))
        return out

    def _kernel_elements(self, requests: list[Request], chunks: list[SeqChunk]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, owner [N0] int64, block tables [R, W] int64) of the catch-up elements of
        `chunks` for `cpu_kernels.draft_chain` / `draft_tree`; the norms they take made once."""
        if self._chain_norms is None:
            self._chain_norms = {
                "in_ln": self.layer.input_layernorm.detach().float().contiguous(),
                "hidden_norm": self.layer.hidden_norm.detach().float().contiguous(),
                "final_norm": self.norm.detach().float().contiguous(),
            }
        positions = [c.start + i for c in chunks for i in range(len(c.token_ids))]
        owner = [b for b, c in enumerate(chunks) for _ in c.token_ids]
        width = max(len(r.block_ids) for r in requests)
        tables = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in requests], dtype=torch.int64)
        return torch.tensor(positions, dtype=torch.int64), torch.tensor(owner, dtype=torch.int64), tables

    def _propose_tree_kernel(self, requests: list[Request], num_nodes: list[int], depths: list[int],
                             widths: list[int], chunks: list[SeqChunk], elem_tokens: list[int],
                             feats_in: torch.Tensor, t_start: float, context: ProposeContext) -> list[Draft]:
        """`propose_trees` on the fused CPU path: the catch-up forward and every level of the
        dynamic trees in one kernel call (`cpu_kernels.draft_tree`: the same midlayer kernel,
        norms and LM head, the same slots, positions and attention as the level loop of
        `grow_trees`, the same ranking at `tree_temperature` for greedy requests and the same
        draws, from the same uniforms (`TreeUniforms`), for sampled ones), without a Python round
        trip per level. Greedy trees equal the loop's unless float32 rounding flips a near-tie of
        the ranking (the kernel's float32 norms sum in another order than torch's, which can move
        a bfloat16 rounding after them; on the shipped head 3 of 31 rounds of 24-node trees
        differed, in their last-ranked node), which changes only what is proposed, never the
        verified output; a sampled node comes back with the q it was drawn from."""
        from kernels import cpu_kernels

        positions, owner, _ = self._kernel_elements(requests, chunks)
        tables, depths_t, widths_t, nodes_t, sampling, uniforms = kernel_tree_args(
            requests, depths, widths, num_nodes, context.generators_for(requests))
        k_cache, v_cache = self.kv_caches[0]
        cfg = self.arch
        out = cpu_kernels.draft_tree(
            feats_in.float().contiguous(), torch.tensor(elem_tokens, dtype=torch.int64), positions, owner, tables,
            depths_t, widths_t, nodes_t, self.tree_temperature, context.tree_min_logprob, self.embed_tokens.weight,
            self._chain_norms,
            self.layer.norm_before_residual, *self._packing(len(elem_tokens))[:2], self.head.size, self.head.token_ids,
            self.rope_f32, k_cache, v_cache, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.rms_norm_eps,
            cfg.head_dim**-0.5, self.dtype == torch.bfloat16, sampling, uniforms,
        )
        for r in requests:  # the call succeeded: the buffered elements are in the midlayer's KV
            self._states[r.request_id] = HiddenRows(r.num_tokens - 1, self._states[r.request_id].rows[:0].clone())
        self._cover(requests)
        self.timer.add_round(len(requests), time.perf_counter() - t_start, max(depths),
                             max(len(c.token_ids) for c in chunks), max(depths), chain=False)
        return kernel_tree_drafts(requests, self.head, out)
