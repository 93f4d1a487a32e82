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

The proposer is a one-module `FeatureLayerProposer`: buffering, catch-up, the drafting loops,
handoff and KV coverage are that class's. What EAGLE-3 adds: a request buffers g (fc's output,
H wide, computed once per committed row), not the aux rows; on the CPU row kernels a decode
step's aux rows wait unprojected until the request's buffer is read (`DEFER_BYTES`); a round
whose catch-up the fused kernels take drafts in one kernel call (`cpu_kernels.draft_chain`,
`draft_tree`); its matrices may be quantized (eagle3_packing.py). Between steps a request holds
at most `max_buffered_rows` rows, deferred ones included: max(16, k + 1) while it is prefilled to
be handed over, else the lazy bound (feature_buffers.lazy_buffer_rows: up to LAZY_BUFFER_ROWS,
at least max(16, k + 1)); past it the midlayer runs over all its rows but the last.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CheckpointError, DrafterMismatchError, UnsupportedModelError
from engine.model_runner import ROW_KERNEL_MAX_TOKENS
from engine.models.llama import ArchConfig, apply_rope, linear, rope_cos_sin
from engine.models.loader import load_safetensors
from engine.request import Request
from engine.spec_decode.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    may_draft,
    model_name,
    penalized,
    weights_digest,
)
from engine.spec_decode.proposers.draft_vocab import DraftLMHead
from engine.spec_decode.proposers.eagle3_packing import (
    HeadPacking,
    Packed,
    head_matrices,
    pack_head,
    quant_layout,
    resolve_draft_weights,
)
from engine.spec_decode.proposers.feature_buffers import HiddenRows, committed_ranges
from engine.spec_decode.proposers.feature_layer import FeatureLayerProposer
from engine.spec_decode.proposers.tree_drafting import kernel_tree_args, kernel_tree_drafts, sampling_rows
from kernels.torch_attn import rows_kernel_inputs

# Elements up to which the midlayer's forwards, and rounds drafted in one kernel call, run the
# fused CPU kernels (a catch-up of several requests included; more go through torch's path), as
# the target's steps do (`Eagle3Proposer.fused_max_rows`: the runner's bound where larger).
FUSED_MAX_ROWS = ROW_KERNEL_MAX_TOKENS
# On the CPU row kernels, a decode step's auxiliary rows wait in `Eagle3Proposer._deferred` (the
# step's tensor and each request's range of it), unprojected, until the request's buffer is read
# (its draft, a probe of it, its handoff, a prefill chunk of it) or the waiting steps reach the
# buffer bound (`max_buffered_rows`) or hold more than DEFER_BYTES; then fc runs over the waiting
# rows of the requests read (all of them at the bound) at once and each appends its rows once.
# While speculation is off a step then costs no fc and no per-request append, and the rows of a
# request that finishes before drafting again are never projected.
DEFER_BYTES = 16 << 20

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


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
        `weights`: packed matrices as `row_weights` (default) or their quantized copies
        (eagle3_packing.py). Returns the output features [T, H] float32."""
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


def read_vocab_map(model_dir: str, w: dict, draft_vocab: int, vocab: int) -> torch.Tensor | None:
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


def load_head(model_dir: str, arch: ArchConfig, norm_before_residual: bool, fc_in: int, draft_vocab: int):
    """The head's modules from its checkpoint, every published tensor checked by name and shape
    and none left unused: (fc, midlayer, final norm, LM head [N, H], its own embedding or None,
    the target token id of each draft id or None (`read_vocab_map`))."""
    hidden, vocab = arch.hidden_size, arch.vocab_size
    w = load_safetensors(model_dir)
    fc = nn.Linear(fc_in, hidden, bias=False)
    layer = Eagle3Layer(arch, norm_before_residual)
    norm = nn.Parameter(torch.ones(hidden))
    lm_head = torch.empty(draft_vocab, hidden)
    embed = torch.empty(vocab, hidden) if "embed_tokens.weight" in w else None
    L, a = layer, arch
    expected = {  # published key -> (destination, shape)
        "fc.weight": (fc.weight, None),
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
        "norm.weight": (norm, None),
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
    token_ids = read_vocab_map(model_dir, w, draft_vocab, vocab)
    unknown = sorted(k for k in w if k not in expected and k not in ("d2t", "t2d") and "rotary_emb" not in k)
    if unknown:
        raise CheckpointError(f"EAGLE-3 checkpoint {model_dir!r} has tensors this head does not use: {unknown[:5]}")
    with torch.no_grad():
        for key, (dest, _) in expected.items():
            if dest is not None:
                dest.copy_(w[key])
        L.qkv_proj.weight.copy_(torch.cat([w[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkv"]))
        L.gate_up_proj.weight.copy_(torch.cat([w["midlayer.mlp.gate_proj.weight"], w["midlayer.mlp.up_proj.weight"]]))
    return fc, layer, norm, lm_head, embed, token_ids


class Eagle3Proposer(FeatureLayerProposer):
    """The midlayer as the one module of a `FeatureLayerProposer` (`layers[0]`, also `layer`)."""

    method = "eagle3"
    name = "EAGLE-3"
    needs_hidden_states = False  # (it reads `aux_hidden_states`)

    def __init__(self, model_dir: str, runner, num_speculative_tokens: int = 1, tree_width: int = 4,
                 draft_weights: str = "model") -> None:
        super().__init__(runner, num_speculative_tokens, tree_width)
        # (the step's aux tensor, [(request, first position, first row, rows)]) of waiting steps
        self._deferred: list[tuple[torch.Tensor, list[tuple[Request, int, int, int]]]] = []
        cfg = read_eagle3_config(model_dir)
        t = runner.arch
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
        fc, layer, norm, lm_head, embed, token_ids = load_head(
            model_dir, self.arch, bool(cfg.get("norm_before_residual", False)),
            len(self.aux_layer_ids) * target_hidden, draft_vocab,
        )
        self.fc = fc.to(self.device, self.dtype).eval().requires_grad_(False)
        layer = layer.to(self.device, self.dtype).eval().requires_grad_(False)
        self.norm = norm.detach().to(self.device, self.dtype)
        if embed is not None:
            self.embed_tokens = nn.Embedding.from_pretrained(embed.to(self.device, self.dtype), freeze=True)
        elif hidden != t.hidden_size:
            raise DrafterMismatchError(
                f"EAGLE-3 head {model_dir!r} has no embed_tokens.weight and its hidden size {hidden} differs "
                f"from the target's {t.hidden_size}, so it cannot use the target's embedding"
            )
        else:
            self.embed_tokens = runner.model.embed_tokens  # shared with the target, in place
        self.heads = [Eagle3LMHead(
            lm_head.to(self.device, self.dtype), None if token_ids is None else token_ids.to(self.device), vocab
        )]
        self.layers = [layer]
        self.feature_size = hidden  # the buffers hold fc's output
        from transformers import LlamaConfig

        a = self.arch
        hf = LlamaConfig(
            hidden_size=a.num_heads * a.head_dim, num_attention_heads=a.num_heads, head_dim=a.head_dim,
            rope_theta=cfg.get("rope_theta", 10000.0), rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=a.max_position_embeddings,
        )
        self.rope_offset = 0
        self.rope_cos, self.rope_sin = rope_cos_sin(hf, runner.model.rope_cos.shape[0] + 1, self.dtype, self.device)
        self.fused_max_rows = max(FUSED_MAX_ROWS, runner.row_kernel_max_tokens)  # (the target's row-step bound)
        self.draft_weights = resolve_draft_weights(
            draft_weights, self.row_kernel, self.dtype, [w.shape[1] for w in head_matrices(layer, self.head, self.fc.weight)]
        )
        named = [(f"fc.{n}", p) for n, p in self.fc.named_parameters()]
        named += [(f"midlayer.{n}", p) for n, p in layer.named_parameters()]
        named += [("lm_head.weight", self.head.weight), (f"aux_layer_ids={self.aux_layer_ids}", self.norm)]
        if self.draft_weights != "model":  # other drafts and features than the checkpoint's dtype gives
            named.append((f"draft_weights={quant_layout(self.draft_weights)}", self.norm))
        self._finish_init(DrafterIdentity(model_name(model_dir), weights_digest(named), draft_vocab))
        # fc over a step's committed rows through the packed kernel where the fused path takes
        # them (a few rows: its fixed cost is below torch's); over a prompt's rows too where torch
        # emulates bf16 (then `_finish_init` packed the midlayer's catch-up matmuls as well)
        self.fc_packed_all = False
        self.packing: HeadPacking | None = None  # the matrices the row kernels take
        if self.row_kernel:
            from kernels import cpu_kernels

            self.rope_f32 = rope_cos_sin(hf, runner.model.rope_cos.shape[0] + 1, torch.float32, self.device)
            self.fc_packed_all = self.dtype == torch.bfloat16 and cpu_kernels.emulated_bf16()
            self.packing = pack_head(layer, self.head, self.fc.weight, self.draft_weights)
        self._own_embedding = embed is not None
        self._chain_norms: dict[str, torch.Tensor] | None = None  # float32 norms of draft_chain
        self.row_kernel_chain = self.row_kernel  # rounds in one call of cpu_kernels.draft_chain / draft_tree

    @property
    def layer(self) -> Eagle3Layer:
        """The midlayer."""
        return self.layers[0]

    @property
    def packed_fc(self) -> torch.Tensor:
        """fc's matrix packed for the row kernels, in the head's dtype."""
        return self.packing.full[2]

    def _packing(self, rows: int) -> Packed:
        """(midlayer weights for rows_layer, LM head, fc) packed for products of `rows` rows."""
        return self.packing.for_rows(rows)

    @property
    def num_parameters(self) -> int:
        own = sum(p.numel() for m in (self.fc, self.layer) for p in m.parameters()) + self.norm.numel()
        embed = self.embed_tokens.weight.numel() if self._own_embedding else 0
        return own + embed + self.head.num_parameters

    def modules(self):
        return [self.fc, self.layer] + ([self.embed_tokens] if self._own_embedding else [])

    def buffer_bytes(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Buffered features between steps, plus one step's committed rows and their aux input."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return super().buffer_bytes(max_num_seqs, max_num_batched_tokens) + max_num_batched_tokens * self.fc.in_features * size

    # --- the midlayer -----------------------------------------------------------------------------
    def _run_module(self, m: int, embeds: torch.Tensor, feats: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    attn_metadata, fused: bool) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[0]
        if fused:  # float32 activations through the midlayer, one kernel call
            out = self.layer.forward_rows(embeds, feats, cos, sin, k_cache, v_cache, attn_metadata,
                                          self._packing(embeds.shape[0])[0])
            return out.to(self.dtype)
        return self.layer(embeds, feats.to(embeds.dtype), cos, sin, k_cache, v_cache, attn_metadata, self.backend)

    def _head_input(self, m: int, feats: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(feats, (self.arch.hidden_size,), self.norm, self.arch.rms_norm_eps)

    # --- buffering: fc's output, decode steps' deferred -------------------------------------------
    def _committed_rows(self, runner_out) -> torch.Tensor:
        """fc over the step's every aux row (rejected drafts' too: fewer ops than gathering the rest)."""
        aux = runner_out.aux_hidden_states
        if self.row_kernel and (self.fc_packed_all or aux.shape[0] <= self.fused_max_rows):
            from kernels import cpu_kernels

            return cpu_kernels.packed_linear(aux, self._packing(aux.shape[0])[2], self.arch.hidden_size, None)
        return self.fc(aux)  # one product for the step

    @torch.inference_mode()
    def observe_step(self, sched, runner_out) -> None:
        """As `FeatureLayerProposer.observe_step`, over fc's output; on the CPU row kernels a decode
        step's aux rows wait unprojected instead (DEFER_BYTES)."""
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
        super().observe_step(sched, runner_out)

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
        self._buffer(committed)

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

    def free_request(self, request_id: str) -> None:
        """Forget a request, its deferred rows too (without projecting anyone's)."""
        if self._deferred:
            self._deferred = [(aux, [e for e in entries if e[0].request_id != request_id]) for aux, entries in self._deferred]
        super().free_request(request_id)

    # --- drafting: a long catch-up on its own, rounds in one kernel call ------------------------------
    def _states_to_draft(self, requests: list[Request], k_max: int, t_start: float
                         ) -> tuple[list[HiddenRows], float]:
        """The requests' buffered rows, after running a long catch-up (after a prompt, or
        speculation off) on its own: one past the fused kernels' rows, or, with quantized
        drafting weights, one past their rows (on the bfloat16 ones) when the drafting itself
        stays within them. A catch-up beyond k_max + 1 rows per request (a prompt's or a paused
        request's) is a one-off, not a round's cost: its time is recorded as a debt the policy
        weighs (`record_catch_up`) and the round's time starts after it."""
        states = self._check_states(requests)
        rows = sum(st.rows.shape[0] for st in states)
        if rows > self.fused_max_rows or len(requests) <= self._quant_max_rows() < rows:
            longest = max(st.rows.shape[0] for st in states)
            self._catch_up_all_but_last(requests, states)
            states = self._check_states(requests)
            if longest > k_max + 1:
                now = time.perf_counter()
                self.record_catch_up(rows - sum(st.rows.shape[0] for st in states), now - t_start)
                t_start = now
        return states, t_start

    def _quant_max_rows(self) -> int:
        """Products of up to this many rows take the quantized copies (0: there are none)."""
        return 0 if self.packing is None else self.packing.quant_max_rows

    def _add_round(self, requests: list[Request], seconds: float, forwards: int, catch_up: int, rows: int,
                   k_max: int) -> None:
        """A round that also caught up over a long stretch (a prompt's rows, where it ran in the
        same call) records that part, its time beyond a steady round of as many drafts, as a
        catch-up (`record_catch_up`)."""
        if catch_up > k_max + 1:
            steady = self.timer.round_seconds(len(requests), forwards)
            self.record_catch_up(rows - len(requests), max(0.0, seconds - steady))
        super()._add_round(requests, seconds, forwards, catch_up, rows, k_max)

    def _in_one_call(self, states: list[HiddenRows]) -> bool:
        """Whether the fused kernels draft this round, catch-up included, in one call."""
        return self.row_kernel_chain and sum(st.rows.shape[0] for st in states) <= self.fused_max_rows

    def _draft_chains(self, requests: list[Request], states: list[HiddenRows], num_tokens: list[int],
                      t_start: float, context: ProposeContext) -> list[Draft]:
        if self._in_one_call(states) and not penalized(requests, context):
            return self._draft_chain_kernel(requests, states, num_tokens, t_start, context)
        return super()._draft_chains(requests, states, num_tokens, t_start, context)

    def _grow_trees(self, requests: list[Request], states: list[HiddenRows], num_nodes: list[int],
                    depths: list[int], widths: list[int], t_start: float, context: ProposeContext) -> list[Draft]:
        if self._in_one_call(states) and not penalized(requests, context):
            return self._draft_tree_kernel(requests, states, num_nodes, depths, widths, t_start, context)
        return super()._grow_trees(requests, states, num_nodes, depths, widths, t_start, context)

    def _kernel_elements(self, requests: list[Request], states: list[HiddenRows]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The catch-up elements (g_j, token j + 1) of every request's buffered positions j, as
        `cpu_kernels.draft_chain` / `draft_tree` take them: features [N0, H] float32, token ids,
        positions and owner [N0] int64, block tables [R, W] int64; the norms they take made once."""
        if self._chain_norms is None:
            self._chain_norms = {
                "in_ln": self.layer.input_layernorm.detach().float().contiguous(),
                "hidden_norm": self.layer.hidden_norm.detach().float().contiguous(),
                "final_norm": self.norm.detach().float().contiguous(),
            }
        feats = torch.cat([st.rows for st in states]).float().contiguous()
        token_ids = [r.token_at(j + 1) for r, st in zip(requests, states, strict=True) for j in range(st.start, st.end)]
        positions = [j for st in states for j in range(st.start, st.end)]
        owner = [b for b, st in enumerate(states) for _ in range(st.start, st.end)]
        width = max(len(r.block_ids) for r in requests)
        tables = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in requests], dtype=torch.int64)
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64)
        return feats, as_tensor(token_ids), as_tensor(positions), as_tensor(owner), tables

    def _caught_up(self, requests: list[Request], states: list[HiddenRows]) -> None:
        """After a kernel call that ran the midlayer over the requests' buffered elements: their
        buffers are empty, their KV final up to n - 1."""
        for r, st in zip(requests, states, strict=True):
            self._states[r.request_id] = HiddenRows(st.end, st.rows[:0].clone())
        self._cover(requests)

    def _draft_chain_kernel(self, requests: list[Request], states: list[HiddenRows], num_tokens: list[int],
                            t_start: float, context: ProposeContext) -> list[Draft]:
        """`propose` on the fused CPU path: the catch-up forward and every draft in one kernel
        call (`cpu_kernels.draft_chain`: the same midlayer kernel, norms and LM head as the Python
        loop, without a round trip per draft). Greedy requests take the argmax (the loop's drafts
        unless float32 rounding of a norm flips a near-tie, which changes only what is proposed,
        never the verified output); sampled ones draw from the filtered distribution over the
        draft vocabulary with one uniform per draft from their generators, and their q comes back
        with the drafts (rejection sampling needs only that the drafts were drawn from it)."""
        from engine.sampler import draw_uniforms
        from kernels import cpu_kernels

        feats, token_ids, positions, owner, tables = self._kernel_elements(requests, states)
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
            feats, token_ids, positions, owner, tables,
            torch.tensor(num_tokens, dtype=torch.int64), self.embed_tokens.weight, self._chain_norms,
            self.layer.norm_before_residual, *self._packing(token_ids.shape[0])[:2], self.head.size,
            self.head.token_ids, self.rope_f32, k_cache, v_cache, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.rms_norm_eps, cfg.head_dim**-0.5, self.dtype == torch.bfloat16,
            sampling, uniforms,
        )
        drafts = drafts.tolist()
        self._caught_up(requests, states)
        self._add_round(requests, time.perf_counter() - t_start, max(num_tokens),
                        max(st.rows.shape[0] for st in states), token_ids.shape[0], max(num_tokens))
        out = []
        for b, (d, k, g) in enumerate(zip(drafts, num_tokens, greedy, strict=True)):
            out.append(Draft(d[:k], None if g else self.head.to_vocab(q[b, :k])))
        return out

    def _draft_tree_kernel(self, requests: list[Request], states: list[HiddenRows], num_nodes: list[int],
                           depths: list[int], widths: list[int], t_start: float, context: ProposeContext
                           ) -> list[Draft]:
        """`propose_trees` on the fused CPU path: the catch-up forward and every level of the
        dynamic trees in one kernel call (`cpu_kernels.draft_tree`: the same midlayer kernel,
        norms and LM head, the same slots, positions and attention as the level loop of
        `grow_trees`, the same ranking at `tree_temperature` for greedy requests and the same
        draws, from the same uniforms (`TreeUniforms`), for sampled ones), without a Python round
        trip per level. Greedy trees equal the loop's unless float32 rounding flips a near-tie of
        the ranking (the kernel's float32 norms sum in another order than torch's, which can move
        a bfloat16 rounding after them: a deep tree's last-ranked node can differ), which changes
        only what is proposed, never the verified output; a sampled node comes back with the q it
        was drawn from."""
        from kernels import cpu_kernels

        feats, token_ids, positions, owner, _ = self._kernel_elements(requests, states)
        tables, depths_t, widths_t, nodes_t, sampling, uniforms = kernel_tree_args(
            requests, depths, widths, num_nodes, context.generators_for(requests))
        k_cache, v_cache = self.kv_caches[0]
        cfg = self.arch
        out = cpu_kernels.draft_tree(
            feats, token_ids, positions, owner, tables,
            depths_t, widths_t, nodes_t, self.tree_temperature, context.tree_min_logprob, self.embed_tokens.weight,
            self._chain_norms,
            self.layer.norm_before_residual, *self._packing(token_ids.shape[0])[:2], self.head.size, self.head.token_ids,
            self.rope_f32, k_cache, v_cache, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.rms_norm_eps,
            cfg.head_dim**-0.5, self.dtype == torch.bfloat16, sampling, uniforms,
        )
        self._caught_up(requests, states)
        self.timer.add_round(len(requests), time.perf_counter() - t_start, max(depths),
                             max(st.rows.shape[0] for st in states), max(depths), chain=False)
        return kernel_tree_drafts(requests, self.head, out)
