"""Row-invariant CPU kernels for decode and verification steps (C++ in kernels/csrc/: the
products, attention, the decoder layer, drafting; kernels/csrc/cpu_kernels.h describes them).

`packed_linear` (over weights packed once by `pack_rows`; `rows_linear` packs per call),
`rows_attention` and `rows_layer` (one whole decoder layer) compute each row (query token) in one
fixed order that depends on the shapes of one row only, so a token's result is bit-identical
whether its step computes it alone or next to other tokens (the drafts it is verified with,
other requests); and they read each weight once per call, so a few rows cost little more than
one. Compiled on first use with torch.utils.cpp_extension (g++, -O3 -mavx2 -mfma -fopenmp) into
build/torch_extensions/ of this checkout (a minute or two, once; an edit of any source or of the
header rebuilds what it touches). `available()` is False on a
CPU without AVX2/FMA, or when the compiler fails (the reason is logged once); callers then use
the torch path. Where the CPU has AVX512-BF16, bfloat16 weights are packed for its dot-product
instructions (`dot_bf16_available`, `pack_rows`): activations rounded to bfloat16, twice the
multiply-adds per instruction, the same row invariance (other bits than the AVX2 path).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# The translation units; torch keys its build on their contents, and ninja's dependency files
# rebuild the ones that include an edited header.
SOURCES = sorted(CSRC.glob("*.cpp"))
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
BUILD_DIR = Path(__file__).resolve().parents[1] / "build" / "torch_extensions"
ENV_DISABLE = "SPECDECODE_CPU_KERNELS"  # "0": never build or use them
ENV_BF16_DOT = "SPECDECODE_CPU_BF16_DOT"  # "0": no AVX512-BF16 products even where the CPU has them
ENV_AMX = "SPECDECODE_CPU_AMX"  # "0": the dp-packed products on AVX512-BF16 even where the CPU has AMX
ENV_AMX_ATTENTION = "SPECDECODE_CPU_AMX_ATTENTION"  # "0": rows attention by dot products even where AMX tiles can run it
ENV_HUGE_PAGES = "SPECDECODE_HUGE_PAGES"  # "0": packed weights and KV caches on ordinary pages
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_supports_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def emulated_bf16() -> bool:
    """True on a CPU whose bfloat16 matmuls torch emulates (no AVX512-BF16 or AMX-BF16: several
    times slower than float32), where the packed kernels serve bfloat16 weights better, prefill
    included."""
    return available() and not ({"avx512_bf16", "amx_bf16"} & cpu_flags())


@functools.cache
def _module():
    if os.environ.get(ENV_DISABLE, "1") == "0":
        logger.info("CPU row kernels disabled (%s=0)", ENV_DISABLE)
        return None
    if not cpu_supports_avx2_fma():
        logger.info("CPU row kernels unavailable: the CPU lacks AVX2/FMA")
        return None
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    try:
        mod = load(
            name="specdecode_cpu_kernels",
            sources=[str(s) for s in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(BUILD_DIR),
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, no headers...: the torch path serves
        logger.warning("CPU row kernels unavailable (build failed: %s); using the torch path", e)
        return None
    if os.environ.get(ENV_AMX, "1") == "0":
        mod.set_amx(False)
    if os.environ.get(ENV_AMX_ATTENTION, "1") == "0":
        mod.set_amx_attention(False)
    return mod


def available() -> bool:
    return _module() is not None


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (any float dtype) @ weight.T + bias -> [M, N] in x's dtype; weight float32 or
    bfloat16 [N, K]; computed in float32."""
    b = bias.float() if bias is not None else torch.empty(0)
    return _module().rows_linear(x.float(), weight, b).to(x.dtype)


def rows_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                   tree: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, H, D] -> [T, H, D] in query's dtype: each token over the first ctx_lens[t]
    positions of its own block table row (block_tables [T, max_blocks] int64). bfloat16 caches
    on a CPU with AVX512-BF16 (`dot_bf16_available`): bfloat16 products (`dot_attention`).
    `tree` [T, 2] int64 (`tree_rows`): token t with tree[t] = (base, bits), base >= 0, is node
    ctx_lens[t] - 1 - base of a token tree whose root is at position base, and sees the positions
    before base and base + j for each bit j of bits (its ancestors and itself); (-1, 0): causal."""
    return _module().rows_attention(query.float(), k_cache, v_cache, block_tables, ctx_lens, scale,
                                    dot_bf16_available(), _EMPTY_I64 if tree is None else tree).to(query.dtype)


_EMPTY_I64 = torch.empty(0, dtype=torch.int64)


def wide_attention(on: bool) -> bool:
    """Use the 512-bit attention kernel where the CPU has AVX-512 (the default; the same bits as the
    256-bit one, which tests compare it with). Returns the previous setting (False, and nothing
    to switch, where the kernels are not built)."""
    mod = _module()
    return mod.set_wide_attention(on) if mod is not None else False


def dot_attention(on: bool) -> bool:
    """Let bfloat16 caches' attention run on AVX512-BF16 dot products (csrc/attention.cpp
    `attention_rows_dp`: q and the softmax weights rounded to bfloat16, as torch's bfloat16
    attention takes them) where the CPU has them; off, the float32 kernels (`wide_attention`).
    On by default unless `SPECDECODE_CPU_BF16_DOT` is "0". Returns the previous setting."""
    mod = _module()
    return mod.set_dot_attention(on) if mod is not None else False


def amx_attention(on: bool) -> bool:
    """Let bfloat16 caches' rows attention run on AMX tiles where it can (csrc/attention.cpp
    `attention_rows_amx`: an AMX CPU with the tile products on (`amx_products`) and
    `dot_attention` on, head_dim 64, 128 or 256, at most 16 query heads per kv head, blocks of a
    multiple of 16 positions); off, `attention_rows_dp`.
    On by default unless `SPECDECODE_CPU_AMX_ATTENTION` is "0". Other bits than the dot-product
    kernel: never switch while an engine runs. Returns the previous setting."""
    mod = _module()
    return mod.set_amx_attention(on) if mod is not None else False


def amx_available() -> bool:
    """True where the dp-packed products (`dot_bf16_available`) run on AMX tiles (csrc/products.cpp
    `linear_amx`: a CPU with AMX-BF16 whose kernel grants the tile state, and `SPECDECODE_CPU_AMX`
    not "0"): a step of 1-16 rows then costs about one row's weight stream."""
    return dot_bf16_available() and bool(_module().amx_on())


def amx_products(on: bool) -> bool:
    """Run the dp-packed products (K a multiple of 32) on AMX tiles where the CPU has them (on by
    default unless `SPECDECODE_CPU_AMX` is "0"). Other bits than the AVX512-BF16 path: never
    switch while an engine runs. Returns the previous setting (False where nothing is built)."""
    mod = _module()
    return mod.set_amx(on) if mod is not None else False


def int8_available() -> bool:
    """True where a drafter's weights can be packed as int8 (`pack_rows_int8`: AVX512-VNNI)."""
    return available() and bool(_module().has_vnni())


def pack_rows_int8(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 or bfloat16 -> int8 with one scale per row, packed for the int8
    products (csrc/products.cpp `linear_i8`: 16-bit activations, exact int32 sums; half the bytes of
    bfloat16, lossy by ~1e-3 of a product's scale). Every function that takes packed weights takes
    these; for drafters only (the target's products stay exact)."""
    return _module().pack_rows_int8(weight.detach())


def pack_rows_int4(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 or bfloat16, K a multiple of 32 -> int4 with a bfloat16 scale per row
    and group of 32 k, packed for the int4 products (csrc/products.cpp `linear_i4`: 16-bit activations,
    exact int32 sums per group; 4.5 bits a weight, a quarter of bfloat16's bytes). Lossy (~9% of
    a matrix's norm): for drafters only, as pack_rows_int8. Every function that takes packed
    weights takes these (uint8)."""
    return _module().pack_rows_int4(weight.detach())


# GGML tensor types (a GGUF file's `tensor_type`) whose blocks the GGUF products read as stored.
GGUF_PACKED_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
GGUF_Q4_RECORD = 1280  # bytes of a packed Q4 record (64 rows x 32 k: csrc/gguf_products.cpp)


def gguf_available() -> bool:
    """True where a GGUF file's Q4_0/Q4_1/Q8_0 matrices can be served as stored (`pack_rows_gguf`):
    the row kernels run and the CPU has F16C (every AVX2 CPU this project has met)."""
    return available() and "f16c" in cpu_flags()


def pack_rows_gguf(raw: torch.Tensor, tensor_type: str, k: int) -> torch.Tensor:
    """A GGUF tensor's raw blocks, raw [N, K / 32 * block bytes] uint8 (Q4_0: 18 bytes a block,
    Q4_1: 20, Q8_0: 34), -> packed for the GGUF products (csrc/gguf_products.cpp: the weights
    dequantized in registers, 16-bit activations per group of 32, exact int32 sums; within float
    rounding of the dequantized matrix's products). 5 bits a weight for Q4_0/Q4_1, 8.5 for Q8_0.
    Every function that takes packed weights takes these (uint8)."""
    if tensor_type not in GGUF_PACKED_TYPES:
        raise ValueError(f"pack_rows_gguf takes {', '.join(GGUF_PACKED_TYPES)} blocks, got {tensor_type!r}")
    return _module().pack_rows_gguf(raw.contiguous(), GGUF_PACKED_TYPES[tensor_type], k)


def gguf_wide(on: bool) -> bool:
    """Run the GGUF products' 512-bit kernel where the CPU has AVX512-VNNI (default) or always the
    256-bit one (the same bits; for tests); returns the previous setting."""
    return bool(_module().set_gguf_avx512(on))


def gguf_int8_activations(packed: torch.Tensor) -> torch.Tensor:
    """GGUF-packed Q4_0/Q4_1 weights (`pack_rows_gguf`) marked to be multiplied with activations
    quantized to int8 per half group of 16 inputs, much as llama.cpp's AVX2 products take them
    (`vpmaddubsw`: twice the multiply-adds an instruction of the int16 default; the 256-bit
    kernel on every CPU): the same bytes viewed as int8. int16 activations keep the products
    within float rounding of the dequantized model; int8 moves them by up to half a step, 0.4% of
    each half group's largest activation. Q8_0 weights are returned as they are (their int8
    products would make no more multiply-adds an instruction)."""
    if packed.dtype == torch.uint8 and packed.dim() == 3 and packed.shape[2] == GGUF_Q4_RECORD:
        return packed.view(torch.int8)
    return packed


def has_avx512() -> bool:
    return available() and _module().has_avx512()


def dot_bf16_available() -> bool:
    """True where bfloat16 weights are packed for AVX512-BF16 dot-product instructions
    (`vdpbf16ps`, csrc/products.cpp `linear_dp`): a CPU with AVX512-BF16 and `SPECDECODE_CPU_BF16_DOT`
    not "0". Those products round the activations to bfloat16 (as torch's bfloat16 products do)
    and do twice the multiply-adds per instruction of the widen-then-FMA path."""
    return available() and os.environ.get(ENV_BF16_DOT, "1") != "0" and bool(_module().has_dot_bf16())


def pack_rows(weight: torch.Tensor, dot_bf16: bool | None = None) -> torch.Tensor:
    """weight [N, K] float32 or bfloat16 -> a copy in the packed layout of `packed_linear` and
    `rows_layer` (each block of 4 rows in the order the kernel reads it; [ceil(N / 4) * 4, K]);
    `dot_bf16` (default: bfloat16 weights where `dot_bf16_available()`) the AVX512-BF16 layout
    (blocks of 64 outputs, pairs of K; [ceil(N / 64), 64 * ceil(K / 2) * 2]), which the kernels
    tell apart by its shape."""
    if dot_bf16 is None:
        dot_bf16 = weight.dtype == torch.bfloat16 and dot_bf16_available()
    return _module().pack_rows(weight.detach(), dot_bf16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`rows_linear(x, weight, bias)` with `packed = pack_rows(weight)`, n = weight.shape[0]:
    bit-identical results, read as one stream (faster); [M, n] in x's dtype."""
    b = torch.empty(0) if bias is None else bias.float().contiguous()
    return _module().packed_linear(x.float(), packed, n, b).to(x.dtype)


def packed_linear_rows(x: torch.Tensor, rows: list[int], packed: torch.Tensor, n: int) -> torch.Tensor:
    """`packed_linear(x[rows].float(), packed, n, None)` in one call (the same bits): x [T, K]
    float32 or bfloat16 -> [len(rows), n] float32."""
    return _module().packed_linear_rows(x.contiguous(), rows, packed, n)


def rows_layer(x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               weights: dict[str, torch.Tensor | None], k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor, block_tables: torch.Tensor, ctx_lens: torch.Tensor,
               num_heads: int, num_kv_heads: int, intermediate_size: int, eps: float,
               scale: float, attn_in: torch.Tensor | None = None,
               tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm decoder layer for a few tokens in one call (csrc/decoder_layer.cpp `rows_layer`): x,
    residual [T, E] float32 (residual None for the first layer); cos/sin [T, head_dim] float32
    rows of each token's position; `weights` holds w_qkv, w_o, w_gate_up, w_down (`pack_rows`
    of the float32 or bfloat16 matrices; gate/up fused as [gate; up]) and in_norm (None: no
    input norm), post_norm, q_norm, k_norm, b_qkv, b_o, b_gate_up, b_down (float32 or None).
    Writes the tokens' K/V at `slots` (-1: skipped) and returns (mlp output, residual) [T, E]
    float32. `attn_in` [T, K] float32 (optional, with in_norm None): what q/k/v read instead of
    the normed residual stream, w_qkv then packed from [qkv, K] (EAGLE-3's midlayer). `tree`:
    token trees as `rows_attention` takes them."""
    empty = torch.empty(0)

    def opt(name: str) -> torch.Tensor:
        t = weights.get(name)
        return empty if t is None else t

    return _module().rows_layer(
        x, empty if residual is None else residual, cos, sin, opt("in_norm"), weights["post_norm"],
        weights["w_qkv"], opt("b_qkv"), weights["w_o"], opt("b_o"), opt("q_norm"), opt("k_norm"),
        weights["w_gate_up"], opt("b_gate_up"), weights["w_down"], opt("b_down"),
        k_cache, v_cache, slots, block_tables, ctx_lens, num_heads, num_kv_heads, intermediate_size, eps, scale,
        empty if attn_in is None else attn_in, _EMPTY_I64 if tree is None else tree,
    )


ROW_WEIGHT_ORDER = ("in_norm", "post_norm", "w_qkv", "b_qkv", "w_o", "b_o", "q_norm", "k_norm", "w_gate_up",
                    "b_gate_up", "w_down", "b_down")  # rows_layer's tensor arguments


def rows_stack(layer_weights: list[dict[str, torch.Tensor | None]], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               num_heads: int, num_kv_heads: int, intermediate_size: int, eps: float, scale: float,
               aux_layer_ids: list[int]):
    """A C++ stack of decoder layers (csrc/decoder_layer.cpp `RowsStack`) holding each layer's `rows_layer`
    weights (dicts as `rows_layer` takes them) and KV caches: `.forward(x, cos, sin, slots,
    block_tables, ctx_lens, slot_rows, tree)` runs them all in one call (the same bits as one
    `rows_layer` call per layer) and returns (the last residual stream before the final norm,
    [the residual stream entering each layer of `aux_layer_ids`, in layer order; the number of
    layers: the last one])."""
    empty = torch.empty(0)
    weights = [[empty if w.get(k) is None else w[k] for k in ROW_WEIGHT_ORDER] for w in layer_weights]
    return _module().RowsStack(weights, [k for k, _ in kv_caches], [v for _, v in kv_caches], num_heads,
                               num_kv_heads, intermediate_size, eps, scale, list(aux_layer_ids))

def draft_chain(feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, owner: torch.Tensor,
                block_tables: torch.Tensor, num_drafts: torch.Tensor, embed: torch.Tensor,
                norms: dict[str, torch.Tensor], norm_before_residual: bool, weights: dict[str, torch.Tensor | None],
                lm_head: torch.Tensor, n_draft: int, token_ids: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                intermediate_size: int, eps: float, scale: float, round_bf16: bool,
                sampling: torch.Tensor | None = None,
                uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chain drafting of an EAGLE-3 head in one call (csrc/drafting.cpp `draft_chain`): the midlayer's
    catch-up forward over feats [N0, H] float32 (elements with tokens, positions and owner
    request [N0] int64, each request's rows together), then num_drafts[b] drafts per request, each
    forward after the first on (own output feature, token just drafted). `norms`: in_ln,
    hidden_norm, final_norm (float32 [H]); `weights`: the midlayer's `rows_layer` weights
    (post_norm, w_qkv, w_o, w_gate_up, w_down); lm_head packed over n_draft rows, column i being
    target token token_ids[i] (None: i). Greedy (argmax) unless `sampling` [R, 3] float32 gives a
    request's (temperature > 0, top_k, top_p): its drafts are then drawn from the filtered
    distribution over the draft vocabulary (engine.sampler.probs_from_logits) by inverse CDF with
    uniforms[b, step] ([R, >= max(num_drafts)] float32 in [0, 1)). Returns (drafts
    [R, max(num_drafts)] int64, -1 past a request's count; with `sampling`, each draft's
    distribution q [R, max(num_drafts), n_draft] float32, zeros for greedy requests, else None)."""
    empty = torch.empty(0, dtype=torch.int64)
    nothing = torch.empty(0, dtype=torch.float32)
    drafts, probs = _module().draft_chain(
        feats, tokens, positions, owner, block_tables, num_drafts, embed, norms["in_ln"], norms["hidden_norm"],
        norms["final_norm"], norm_before_residual, weights["post_norm"], weights["w_qkv"], weights["w_o"],
        weights["w_gate_up"], weights["w_down"], lm_head, n_draft, empty if token_ids is None else token_ids,
        rope[0], rope[1], k_cache, v_cache, num_heads, num_kv_heads, intermediate_size, eps, scale, round_bf16,
        nothing if sampling is None else sampling, nothing if uniforms is None else uniforms,
    )
    return drafts, (probs if sampling is not None else None)


def move_slots(caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Copy the rows at slots `src` onto slots `dst` of each paged cache ([blocks, block_size,
    ...], contiguous), every source read first (csrc/drafting.cpp `move_slots`)."""
    _module().move_slots(caches, torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))


def draft_tree(feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, owner: torch.Tensor,
               block_tables: torch.Tensor, depths: torch.Tensor, widths: torch.Tensor, num_nodes: torch.Tensor,
               temperature: float, min_logprob: float, embed: torch.Tensor, norms: dict[str, torch.Tensor], norm_before_residual: bool,
               weights: dict[str, torch.Tensor | None], lm_head: torch.Tensor, n_draft: int,
               token_ids: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
               v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, intermediate_size: int, eps: float,
               scale: float, round_bf16: bool, sampling: torch.Tensor | None = None,
               uniforms: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dynamic trees of an EAGLE-3 head in one call (csrc/drafting.cpp `draft_tree`: the catch-up
    forward as `draft_chain`'s, then every level of `tree_drafting.grow_trees`). Greedy requests:
    candidates ranked by log_softmax(logits / temperature), kept only at a cumulative
    log-probability >= min_logprob (-inf keeps EAGLE-2's num_nodes best). Requests whose
    `sampling` row [R, 3] float32 (temperature > 0, top_k, top_p) is set draw their children
    without replacement from the filtered draft distribution, reading uniforms [R, U] float32 in
    `tree_drafting.TreeUniforms`' order (its `by_request()`), and keep their nodes in deviation
    order (`build_sampled_trees`). depths, widths, num_nodes [R] int64.
    Returns (tokens, parents [R, N + 1] int64, cum_logprobs [R, N + 1] float32, counts [R] int64,
    probs [R, N, n_draft] float32 or None): request b's tree is the first counts[b] entries, node 0
    its root, and node i + 1's q (sampled requests) probs[b, i]; N = max(num_nodes)."""
    empty = torch.empty(0, dtype=torch.int64)
    nothing = torch.empty(0, dtype=torch.float32)
    tokens, parents, cums, counts, probs = _module().draft_tree(
        feats, tokens, positions, owner, block_tables, depths, widths, num_nodes, temperature, min_logprob, embed,
        norms["in_ln"], norms["hidden_norm"], norms["final_norm"], norm_before_residual, weights["post_norm"],
        weights["w_qkv"], weights["w_o"], weights["w_gate_up"], weights["w_down"], lm_head, n_draft,
        empty if token_ids is None else token_ids, rope[0], rope[1], k_cache, v_cache, num_heads, num_kv_heads,
        intermediate_size, eps, scale, round_bf16, nothing if sampling is None else sampling,
        nothing if uniforms is None else uniforms,
    )
    return tokens, parents, cums, counts, (probs if sampling is not None else None)


def stack_tree(stack, tokens: torch.Tensor, positions: torch.Tensor, owner: torch.Tensor, block_tables: torch.Tensor,
               depths: torch.Tensor, widths: torch.Tensor, num_nodes: torch.Tensor, temperature: float,
               min_logprob: float, lm_head: torch.Tensor, n_draft: int, token_ids: torch.Tensor | None,
               sampling: torch.Tensor | None = None, uniforms: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`draft_tree` for a draft model (csrc/drafting.cpp `stack_tree`): `stack` its layers
    (`rows_stack` with `set_ends`), its catch-up elements tokens at positions ([N0] int64, owner
    request, each request's rows together), lm_head packed (`pack_rows`) over n_draft rows, column
    i being target token token_ids[i] (None: i). The same trees, levels and outputs as
    `draft_tree`'s (an element is its token: no features)."""
    empty = torch.empty(0, dtype=torch.int64)
    nothing = torch.empty(0, dtype=torch.float32)
    tokens, parents, cums, counts, probs = _module().stack_tree(
        stack, tokens, positions, owner, block_tables, depths, widths, num_nodes, temperature, min_logprob, lm_head,
        n_draft, empty if token_ids is None else token_ids, nothing if sampling is None else sampling,
        nothing if uniforms is None else uniforms,
    )
    return tokens, parents, cums, counts, (probs if sampling is not None else None)


def feature_tree(stack, root_feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 block_tables: torch.Tensor, depths: torch.Tensor, widths: torch.Tensor, num_nodes: torch.Tensor,
                 temperature: float, min_logprob: float, embed: torch.Tensor, parts: dict, lm_head: torch.Tensor,
                 n_draft: int, token_ids: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                 rope_offset: int, round_bf16: bool, sampling: torch.Tensor | None = None,
                 uniforms: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`draft_tree` for a one-module feature drafter (csrc/drafting.cpp `feature_tree`: native MTP
    with one module, EAGLE-1): `stack` the module's decoder layer (`rows_stack` of one layer),
    root_feats [R, E] float32 each request's module output at its root (its last final element:
    token tokens[b] at position positions[b], [R] int64); an element (parent's output feature g,
    token t) runs the layer on proj(cat(token_norm(embed[t]), hidden_norm(g))) (+ proj_bias; the
    halves swapped when hidden_first; a norm None: none) at rope row position + rope_offset; its
    output feature is the residual stream (out_norm'd when norm_after), and the head reads
    out_norm(feature) when out_norm is set and not norm_after, else the feature. `parts`:
    token_norm, hidden_norm, out_norm (float32 [E] or None), proj (pack_rows of [E, 2E]),
    proj_bias (or None), hidden_first, norm_after. round_bf16: features and head inputs in
    bfloat16, as a bfloat16 model's torch path holds them. The same trees and outputs as
    `draft_tree`'s."""
    empty = torch.empty(0, dtype=torch.int64)
    nothing = torch.empty(0, dtype=torch.float32)

    def vec(t: torch.Tensor | None) -> torch.Tensor:
        return nothing if t is None else t.detach().float().contiguous()

    tokens, parents, cums, counts, probs = _module().feature_tree(
        stack, root_feats, tokens, positions, block_tables, depths, widths, num_nodes, temperature, min_logprob,
        embed, vec(parts["token_norm"]), vec(parts["hidden_norm"]), parts["hidden_first"], parts["proj"],
        vec(parts["proj_bias"]), vec(parts["out_norm"]), parts["norm_after"], lm_head, n_draft,
        empty if token_ids is None else token_ids, rope[0].contiguous(), rope[1].contiguous(), rope_offset,
        round_bf16, nothing if sampling is None else sampling, nothing if uniforms is None else uniforms,
    )
    return tokens, parents, cums, counts, (probs if sampling is not None else None)


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, int]:
    """An untouched uint8 buffer with a 2 MiB-aligned region of `nbytes` marked
    MADV_HUGEPAGE (Linux transparent huge pages, honoured where THP is `madvise` or `always`),
    and that region's offset in it. A decode step streams every weight once: on 4 KiB pages that
    is a TLB miss every 4 KiB (~20k per token for an 80 MB model); on 2 MiB pages, 40. Elsewhere
    (other OS, SPECDECODE_HUGE_PAGES=0, madvise refused) the buffer is ordinary memory."""
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = (-buf.data_ptr()) % HUGE_PAGE
    if sys.platform.startswith("linux") and os.environ.get(ENV_HUGE_PAGES, "1") != "0" and nbytes:
        length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # within the buffer: offset + length <= nbytes + HUGE_PAGE
        if _libc().madvise(buf.data_ptr() + offset, length, MADV_HUGEPAGE) != 0:
            logger.info("madvise(MADV_HUGEPAGE) refused (errno %d): ordinary pages", ctypes.get_errno())
    return buf, offset


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (contiguous, any dtypes) laid out in one `huge_page_buffer`, each at a
    64-byte-aligned offset; the copies keep the buffer alive. Same values, same shapes."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += -(-n // 64) * 64
    buf, base = huge_page_buffer(total)
    out = []
    for t, start, n in zip(tensors, starts, sizes, strict=True):
        view = buf[base + start : base + start + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


def prefill_attention_available() -> bool:
    """True where `prefill_attention` runs: the kernels built, a CPU with AVX512-BF16 (and
    `SPECDECODE_CPU_BF16_DOT` not "0")."""
    return dot_bf16_available()


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal paged attention (csrc/attention.cpp `prefill_attention`) of a step's query tokens,
    bfloat16 query [T, H, D] and caches -> [T, H, D] bfloat16: request b's tokens are
    query[query_start_loc[b]:query_start_loc[b + 1]], token i at position seq_lens[b] - q_len + i,
    over the keys at positions up to its own (block_tables [B, max_blocks]; all int64). The
    products in bfloat16 with float32 sums, as torch's flash attention computes bfloat16; a
    token's result depends on its position and the cache only (not on the chunking or the other
    requests of the step)."""
    return _module().prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
