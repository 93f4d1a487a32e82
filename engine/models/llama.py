"""One decoder implementation for Llama-family checkpoints over a paged KV cache.

Covers Llama (incl. Llama 3 rope scaling), Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm), tied
or untied embeddings, GQA. Weights keep Hugging Face names on load; q/k/v and gate/up are fused
into one matmul each. The model sees a flat varlen batch: `input_ids` [num_tokens], `positions`
[num_tokens], and attention metadata describing which request each token belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModelError
from kernels import cpu_kernels
from kernels.torch_attn import rows_kernel_inputs

NO_TREE = torch.empty(0, dtype=torch.int64)  # RowsStack's token trees argument: none

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ArchConfig:
    """The fields of a Hugging Face config this decoder needs, normalized across families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    sliding_window: int | None

    @classmethod
    def from_hf(cls, hf_config) -> ArchConfig:
        archs = list(getattr(hf_config, "architectures", None) or [])
        model_type = getattr(hf_config, "model_type", None)
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not known and model_type not in SUPPORTED_ARCHITECTURES.values():
            raise UnsupportedModelError(
                f"unsupported architecture {archs or model_type!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[known[0]] if known else model_type
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; supported: 'silu'")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        sliding = getattr(hf_config, "sliding_window", None)
        if family == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            sliding = None
        return cls(
            model_type=family,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            o_bias=family != "qwen2" and bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=hf_config.max_position_embeddings,
            sliding_window=sliding,
        )


def rope_cos_sin(hf_config, max_positions: int, dtype: torch.dtype, device: torch.device):
    """cos/sin tables [max_positions, head_dim] from transformers' own rope init (any scaling type
    that does not depend on the sequence length: default, linear, llama3, yarn, longrope)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise UnsupportedModelError("rope_type 'dynamic' changes with sequence length; not supported")
    with torch.device("cpu"):
        rotary = LlamaRotaryEmbedding(hf_config)
    inv_freq = rotary.inv_freq.float()  # [head_dim // 2]
    factors = getattr(hf_config, "rope_freq_factors", None)  # a GGUF's rope_freqs: divisors per frequency
    if factors is not None:
        inv_freq = inv_freq / factors
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = float(rotary.attention_scaling)
    return (emb.cos() * scale).to(device=device, dtype=dtype), (emb.sin() * scale).to(device=device, dtype=dtype)


ROW_KERNEL = -1  # `tile_rows` value: the row-invariant CPU kernel (kernels/cpu_kernels.py)


def linear(mod: nn.Linear, x: torch.Tensor, tile_rows: int = 0, packed: torch.Tensor | None = None) -> torch.Tensor:
    """`mod(x)` for x [n, in]. BLAS picks its kernel, and so its rounding, by the number of rows
    (MKL fp32 here: 1 | 2-3 | >= 4 rows round differently; oneDNN bf16 on AMX likewise) but
    computes the rows of one call alike, wherever they sit. `tile_rows` > 0 makes a row's result
    independent of n: the rows go through products of exactly `tile_rows` rows each (the last
    tile padded with zero rows); `tile_rows` 1 is one row-vector product per row; ROW_KERNEL is
    kernels.cpu_kernels.rows_linear, row-invariant by construction (one pass over the weights)."""
    if packed is not None:
        # bfloat16 weights on a CPU without native bfloat16 products (torch emulates them, several
        # times slower): the packed kernel (`packed`: cpu_kernels.pack_rows of mod.weight) serves any
        # rows, and any `tile_rows` (its rows never depend on the others: no tiles needed).
        return cpu_kernels.packed_linear(x, packed, mod.weight.shape[0], mod.bias)
    if tile_rows == ROW_KERNEL:
        return cpu_kernels.rows_linear(x, mod.weight, mod.bias)
    n = x.shape[0]
    if tile_rows <= 0 or (tile_rows == 1 and n == 1):
        return F.linear(x, mod.weight, mod.bias)
    if tile_rows == 1:
        return torch.cat([F.linear(x[i : i + 1], mod.weight, mod.bias) for i in range(n)])
    padded = -(-n // tile_rows) * tile_rows
    if padded != n:
        x = F.pad(x, (0, 0, 0, padded - n))
    if padded == tile_rows:
        return F.linear(x, mod.weight, mod.bias)[:n]
    return torch.cat([F.linear(x[i : i + tile_rows], mod.weight, mod.bias) for i in range(0, padded, tile_rows)])[:n]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [num_tokens, heads, head_dim]; cos/sin [num_tokens, 1, head_dim] (rotate-half layout)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP. `input_norm=False` drops the first RMSNorm (EAGLE-1's
    draft layer has none)."""

    def __init__(self, cfg: ArchConfig, input_norm: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_norm = input_norm
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self._row_weights: dict | None = None
        # Matrices the checkpoint stores quantized, packed as stored for the row kernels
        # (`use_stored_matrices`); `row_weights` packs the others from the module's weights
        self.stored_matrices: dict[str, torch.Tensor] = {}
        # Every matmul of `forward` through the packed weights (`use_packed_matmuls`)
        self.packed_matmuls = False

    def use_packed_matmuls(self) -> None:
        """Run `forward`'s matmuls (prefill, long steps) through the packed CPU kernel too: for
        bfloat16 weights on a CPU without native bfloat16 products, where torch emulates them."""
        self.row_weights()
        self.packed_matmuls = True

    def row_weights(self) -> dict:
        """The layer's tensors as `cpu_kernels.rows_layer` takes them: matrices packed
        (`cpu_kernels.pack_rows`, or the checkpoint's quantized blocks in `stored_matrices`),
        norms and biases in float32 (copies made once, on first use after loading;
        `forget_row_weights` drops them when the weights change). The packed matrices are a
        second copy of the layer's weights in memory."""
        if self._row_weights is None:
            def f32(t):
                return None if t is None else t.detach().float().contiguous()

            def packed(key: str, mod: nn.Linear) -> torch.Tensor:
                stored = self.stored_matrices.get(key)
                return stored if stored is not None else cpu_kernels.pack_rows(mod.weight)

            self._row_weights = {
                "in_norm": f32(self.input_layernorm) if self.input_norm else None,
                "post_norm": f32(self.post_attention_layernorm),
                "w_qkv": packed("w_qkv", self.qkv_proj), "b_qkv": f32(self.qkv_proj.bias),
                "w_o": packed("w_o", self.o_proj), "b_o": f32(self.o_proj.bias),
                "q_norm": f32(self.q_norm) if self.cfg.qk_norm else None,
                "k_norm": f32(self.k_norm) if self.cfg.qk_norm else None,
                "w_gate_up": packed("w_gate_up", self.gate_up_proj),
                "b_gate_up": f32(self.gate_up_proj.bias),
                "w_down": packed("w_down", self.down_proj), "b_down": f32(self.down_proj.bias),
            }
        return self._row_weights

    def forget_row_weights(self) -> None:
        self._row_weights = None
        self.stored_matrices = {}
        self.packed_matmuls = False

    def forward_rows(self, x, residual, cos, sin, k_cache, v_cache, attn_metadata):
        """`forward` through the fused row-invariant CPU kernel (one call): x, residual float32
        [T, hidden]; cos/sin float32 [T, head_dim]; metadata built with row_exact="kernel"."""
        cfg = self.cfg
        k_cache, v_cache, tables, lens, tree = rows_kernel_inputs(attn_metadata, k_cache, v_cache)
        return cpu_kernels.rows_layer(x, residual, cos, sin, self.row_weights(), k_cache, v_cache,
                                      attn_metadata.slot_mapping, tables, lens, cfg.num_heads, cfg.num_kv_heads,
                                      cfg.intermediate_size, cfg.rms_norm_eps, cfg.head_dim**-0.5, tree=tree)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, attn_metadata, backend, tile_rows: int = 0):
        # x, residual [num_tokens, hidden]; returns the same pair (pre-norm residual stream).
        # tile_rows: see `linear`.
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        if residual is None:
            residual = x
        else:
            residual = residual + x
        h = F.rms_norm(residual, (cfg.hidden_size,), self.input_layernorm, eps) if self.input_norm else residual
        pw = self._row_weights if self.packed_matmuls else None
        qkv = linear(self.qkv_proj, h, tile_rows, pw and pw["w_qkv"])
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = F.rms_norm(q, (cfg.head_dim,), self.q_norm, eps)
            k = F.rms_norm(k, (cfg.head_dim,), self.k_norm, eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        backend.write_kv(k, v, k_cache, v_cache, attn_metadata)
        o = backend.attention(q, k_cache, v_cache, attn_metadata, cfg.head_dim**-0.5)
        x = linear(self.o_proj, o.reshape(n, self.q_size), tile_rows, pw and pw["w_o"])
        residual = residual + x
        h = F.rms_norm(residual, (cfg.hidden_size,), self.post_attention_layernorm, eps)
        gate, up = linear(self.gate_up_proj, h, tile_rows, pw and pw["w_gate_up"]).chunk(2, dim=-1)
        return linear(self.down_proj, F.silu(gate) * up, tile_rows, pw and pw["w_down"]), residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head. `forward` returns final-norm hidden states."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.rope_f32: tuple[torch.Tensor, torch.Tensor] | None = None  # for the fused row path
        self._norm_f32: torch.Tensor | None = None
        self._rows_stack = None  # (caches key, cpu_kernels.RowsStack)
        self.fused_ends = True  # `_forward_rows` from token ids in one call (False: torch ops around it)
        self._packed_lm_head: torch.Tensor | None = None
        # EAGLE-3's auxiliary features: `forward` also keeps the residual stream at these layer
        # boundaries (b: the input of decoder layer b = the output of layer b - 1, HF's
        # `hidden_states[b]`; b = num_layers: the last layer's output before the final norm),
        # concatenated in this order into `aux_hidden_states` [num_tokens, len(ids) * hidden].
        # Empty: nothing is kept (no extra work).
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def set_rope(self, cos: torch.Tensor, sin: torch.Tensor, cos_f32: torch.Tensor | None = None,
                 sin_f32: torch.Tensor | None = None) -> None:
        """cos/sin tables [max_positions, head_dim] in the model's dtype, and in float32 for the
        fused row path (`forward` with ROW_KERNEL; default: the given tables widened)."""
        self.rope_cos, self.rope_sin = cos, sin
        self.rope_f32 = (cos.float() if cos_f32 is None else cos_f32, sin.float() if sin_f32 is None else sin_f32)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, backend, inputs_embeds=None, tile_rows: int = 0):
        # input_ids [num_tokens] -> hidden [num_tokens, hidden] after the final norm; tile_rows:
        # every matmul in tiles of that many rows (see `linear`)
        if tile_rows == ROW_KERNEL and attn_metadata.extras.get("rows_kernel") is not None:
            return self._forward_rows(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos = self.rope_cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.rope_sin[positions].unsqueeze(1)
        residual = None
        aux_ids, aux = self.aux_layer_ids, []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if aux_ids and i in aux_ids:
                aux.append(x if residual is None else residual + x)
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, attn_metadata, backend, tile_rows)
        if aux_ids:
            self._keep_aux(aux, residual + x)
        return F.rms_norm(residual + x, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)

    def _keep_aux(self, aux: list[torch.Tensor], last: torch.Tensor) -> None:
        """aux: the kept boundaries below num_layers in layer order; last: the last layer's output."""
        if len(self.layers) in self.aux_layer_ids:
            aux.append(last)
        self.aux_hidden_states = torch.cat(aux, dim=-1).to(self.norm.dtype)

    def _forward_rows(self, input_ids, positions, kv_caches, attn_metadata, inputs_embeds=None):
        """`forward` for a step of a few tokens through `cpu_kernels.rows_layer`: activations in
        float32 from the embedding to the final norm, every token computed as it would be alone,
        all layers in one call (`rows_stack`); returns the hidden rows in the model's dtype. From
        token ids, the embedding, rope rows and final norm run in that call too
        (`RowsStack.forward_tokens`)."""
        cfg = self.cfg
        tables, lens = attn_metadata.extras["rows_kernel"]
        tree = attn_metadata.extras.get("rows_kernel_tree")
        tree = NO_TREE if tree is None else tree
        stack = self.rows_stack(kv_caches)
        if inputs_embeds is None and self.fused_ends:
            hidden, aux = stack.forward_tokens(input_ids, positions, attn_metadata.slot_mapping, tables, lens, False, tree)
            if self.aux_layer_ids:
                self.aux_hidden_states = aux
            return hidden
        x = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds).float()
        cos, sin = self.rope_f32[0][positions], self.rope_f32[1][positions]
        last, aux = stack.forward(x, cos, sin, attn_metadata.slot_mapping, tables, lens, False, tree)
        if self.aux_layer_ids:
            self.aux_hidden_states = torch.cat(aux, dim=-1).to(self.norm.dtype)
        hidden = F.rms_norm(last, (cfg.hidden_size,), self._norm_f32, cfg.rms_norm_eps)
        return hidden.to(self.norm.dtype)

    def rows_stack(self, kv_caches):
        """The layers' `row_weights`, these KV caches and the model's ends (embedding, rope tables,
        final norm) handed to the C++ stack once (`cpu_kernels.RowsStack`), remade when the
        caches, the packed weights or the rope tables change."""
        key = (tuple((k.data_ptr(), v.data_ptr(), k.shape) for k, v in kv_caches), self.rope_f32[0].data_ptr())
        if self._rows_stack is None or self._rows_stack[0] != key:
            cfg = self.cfg
            stack = cpu_kernels.rows_stack([layer.row_weights() for layer in self.layers], kv_caches, cfg.num_heads,
                                           cfg.num_kv_heads, cfg.intermediate_size, cfg.rms_norm_eps,
                                           cfg.head_dim**-0.5, sorted(self.aux_layer_ids))
            if self._norm_f32 is None:
                self._norm_f32 = self.norm.detach().float()
            stack.set_ends(self.embed_tokens.weight.detach().contiguous(), self.rope_f32[0].contiguous(),
                           self.rope_f32[1].contiguous(), self._norm_f32, self.norm.dtype == torch.bfloat16)
            self._rows_stack = (key, stack)
        return self._rows_stack[1]

    def prepare_rows(self) -> None:
        """Make the fused row path's packed weights now (at load) rather than in the first step;
        where torch emulates bfloat16 products (`cpu_kernels.emulated_bf16`), every matmul of the
        model then uses them (prefill included: torch's emulated products are several times slower)."""
        packed_all = self.norm.dtype == torch.bfloat16 and cpu_kernels.emulated_bf16()
        for layer in self.layers:
            layer.row_weights()
            if packed_all:
                layer.use_packed_matmuls()
        self.packed_lm_head()
        # every packed matrix in one buffer on 2 MiB pages (cpu_kernels.on_huge_pages): a step
        # streams them all, and on 4 KiB pages it took a TLB miss every 4 KiB
        keys = ("w_qkv", "w_o", "w_gate_up", "w_down")
        moved = iter(cpu_kernels.on_huge_pages([layer._row_weights[k] for layer in self.layers for k in keys]
                                               + [self._packed_lm_head]))
        for layer in self.layers:
            layer._row_weights.update((k, next(moved)) for k in keys)
        self._packed_lm_head = next(moved)
        self._rows_stack = None  # (it holds the layers' tensors)

    def use_stored_matrices(self, layers: list[dict[str, torch.Tensor]], lm_head: torch.Tensor | None) -> None:
        """Give the row kernels the checkpoint's quantized matrices as stored (per layer, packed
        by `cpu_kernels.pack_rows_gguf`, keyed as `DecoderLayer.row_weights`; the LM head or None)
        in place of packing the dequantized weights: fewer bytes a step streams. The modules keep
        the dequantized weights for the torch path."""
        if len(layers) != len(self.layers):
            raise ValueError(f"stored matrices for {len(layers)} layers, the model has {len(self.layers)}")
        self.forget_row_weights()
        for layer, stored in zip(self.layers, layers, strict=True):
            layer.stored_matrices = dict(stored)
        self._packed_lm_head = lm_head

    def packed_lm_head(self) -> torch.Tensor:
        """The LM head packed for `cpu_kernels.packed_linear` (made once)."""
        if self._packed_lm_head is None:
            self._packed_lm_head = cpu_kernels.pack_rows(self.lm_head.weight)
        return self._packed_lm_head

    def forget_row_weights(self) -> None:
        """Drop the copies the fused row path made (after the weights change)."""
        self._norm_f32 = self._packed_lm_head = self._rows_stack = None
        for layer in self.layers:
            layer.forget_row_weights()

    def compute_logits_rows(self, hidden: torch.Tensor, rows: list[int], tile_rows: int = 0) -> torch.Tensor:
        """`compute_logits(hidden[rows], tile_rows)`; through the packed kernel in one call where
        that is the path (the same bits)."""
        if tile_rows == ROW_KERNEL or (self.layers and self.layers[0].packed_matmuls):
            return cpu_kernels.packed_linear_rows(hidden, rows, self.packed_lm_head(), self.cfg.vocab_size)
        return self.compute_logits(hidden[torch.tensor(rows, device=hidden.device)], tile_rows)

    def compute_logits(self, hidden: torch.Tensor, tile_rows: int = 0) -> torch.Tensor:
        # hidden [n, hidden] -> logits [n, vocab] in float32
        if tile_rows == ROW_KERNEL:
            return cpu_kernels.packed_linear(hidden.float(), self.packed_lm_head(), self.cfg.vocab_size, None)
        if self.layers and self.layers[0].packed_matmuls:
            return cpu_kernels.packed_linear(hidden.float(), self.packed_lm_head(), self.cfg.vocab_size, None)
        return linear(self.lm_head, hidden, tile_rows).float()

    # --- weight loading (Hugging Face names) ------------------------------------------------
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Missing or unknown names raise."""
        cfg = self.cfg
        used: set[str] = set()
        self.forget_row_weights()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise UnsupportedModelError(f"checkpoint lacks tensor {name!r}")
            used.add(name)
            return weights[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise UnsupportedModelError(
                    f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)

        put(self.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm, take("model.norm.weight"), "model.norm.weight")
        if not cfg.tie_word_embeddings:
            put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        elif "lm_head.weight" in weights:
            used.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.input_layernorm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(layer.post_attention_layernorm, take(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm")
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            put(layer.qkv_proj.weight, qkv, p + "self_attn.qkv")
            if cfg.qkv_bias:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
                put(layer.qkv_proj.bias, bias, p + "self_attn.qkv bias")
            put(layer.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if cfg.o_bias:
                put(layer.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
            if cfg.qk_norm:
                put(layer.q_norm, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
                put(layer.k_norm, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
            put(layer.gate_up_proj.weight, gate_up, p + "mlp.gate_up")
            if cfg.mlp_bias:
                b = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")], dim=0)
                put(layer.gate_up_proj.bias, b, p + "mlp.gate_up bias")
            put(layer.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
            if cfg.mlp_bias:
                put(layer.down_proj.bias, take(p + "mlp.down_proj.bias"), p + "mlp.down_proj.bias")
        unknown = sorted(k for k in weights if k not in used and "rotary_emb" not in k)
        if unknown:
            raise UnsupportedModelError(f"checkpoint has tensors this decoder does not use: {unknown[:5]}")
