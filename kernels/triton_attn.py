"""Triton paged attention backend (GPU): KV-cache write + unified prefill/verify/decode attention.

Contract: see :mod:`kernels.attention_api` (``AttentionBackend``); results match
:mod:`kernels.torch_attn` (the oracle) up to floating-point reassociation.

Kernels
-------
``_write_kv_kernel`` (reshape_and_cache): grid ``(num_tokens,)``. Token t with slot
``s = slot_mapping[t]`` writes ``key[t]`` (``[Hkv, D]``) to ``k_cache[s // block_size, s % block_size]``
(same for value); ``s == -1`` is skipped. Example: block_size=16, s=115 -> block 7, offset 3.

``_paged_attn_kernel``: grid ``(B, cdiv(max_query_len, BLOCK_Q), num_kv_heads)``. One program
handles BLOCK_Q consecutive query tokens of one request and *all* G = H / Hkv query heads that
share one kv head, packed as the rows of a ``[BLOCK_M, D]`` tile, ``BLOCK_M = BLOCK_Q * G_PAD``
(``G_PAD = next_pow2(G)``): row r is query token ``q_block * BLOCK_Q + r // G_PAD``, head
``kvh * G + r % G_PAD`` (rows with ``r % G_PAD >= G`` or token ``>= q_len`` are padding: computed,
never stored). So each K/V tile is loaded once per kv head, and decode (q_len=1) still fills
the 16-row minimum of ``tl.dot`` with useful heads when G is large.
Example: G=4 (G_PAD=4), BLOCK_Q=4 -> BLOCK_M=16; row 9 = token q_block*4 + 2, head kvh*4 + 1.

The program walks the request's context in tiles of BLOCK_N positions up to the last position
its rows can see (``ctx_len + min(q_first + BLOCK_Q, q_len) - 1``, ``ctx_len = seq_len - q_len``),
finds each position's slot through the block table (``block_tables[b, p // block_size] *
block_size + p % block_size``; any block_size works, including 1), and accumulates an online
softmax in fp32 (exp2 with ``scale * log2(e)`` folded in). Causal rule: query token i sees
position p iff ``p <= ctx_len + i``. Position 0 is visible to every row, so no row is ever fully
masked (no NaN), padded rows included.

Tree masks (``HAS_TREE``, a constexpr: the causal kernel is compiled without any of it): request
b's last ``m = tree_lens[b]`` query tokens (positions ``seq_len - m ..``) see a position p among
those m only if bit ``p - (seq_len - m)`` of their row ``tree_mask[tree_mask_offsets[b] + i]``
(int64, m <= 64) is set; each row is loaded once, before the walk over the context. The mask's
first column is all True (every node sees the root), so position 0 stays visible. Example:
seq_len 10, m 3, query token at position 9 (tree row 2), key 8 -> bit 1 of tree_mask[off + 2].
A partial tree (m > q_len: its first nodes are cached, see :mod:`kernels.attention_api`) needs
nothing else: query token i is tree row ``i - (q_len - m) >= m - q_len``, the same formula.

``_rows_attn_kernel`` (the exact modes' row-exact attention, ``rows_attention``): grid
``(num_tokens, num_kv_heads)``. One program per query token and kv head (its G heads as the rows
of a ``[max(16, G_PAD), D]`` tile) walks exactly the keys that token sees, in position order, in
tiles of BLOCK_N from its first: positions ``0 .. ctx_len - 1`` through its request's block table,
then ``num_extra`` keys at explicit slots (a tree token's ancestors and itself, in depth order;
``rows_attention_inputs``), with no mask but the key count. Its output depends only on its query
and those keys in that order, so a token verified next to others (drafts, other requests, tree
siblings) gets, bit for bit, what the one-token step at the end of its accepted path gets through
this kernel: the same compiled kernel (no step-dependent constexpr) doing the same float
operations on the same values. The engine's exact modes run every step of at most EXACT_ROWS
tokens through it (one-token steps included), so greedy text with and without speculation, chains
and trees, matches on GPUs as it does on the CPU kernels (checked in the interpreter; compiled for
sm_80/sm_90 by :mod:`kernels.triton_aot`; bit identity on a real GPU is untested).

Under the interpreter, 16-bit inputs are upcast to fp32 before ``tl.dot`` (the interpreter's
16-bit dot is wrong in triton 3.9); compiled GPU runs use native 16-bit dots with fp32 accumulation.

The module imports triton at import time; set ``TRITON_INTERPRET=1`` *before* importing it to run
the kernels on CPU tensors through the Triton interpreter (tests do this in a subprocess).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_api import AttentionMetadata, build_common_metadata

__all__ = ["TritonAttentionBackend", "paged_attention", "rows_attention", "rows_attention_inputs", "write_kv_cache"]

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, Hkv, D]
    value_ptr,  # [num_tokens, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    src_k = key_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    dst_k = k_cache_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_tile(q, k, v, visible, m_i, l_i, acc, scale_log2e, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax: q [M, D] against keys k / values v [N, D] where `visible`
    [M, N] (or [1, N]); returns the updated running max m_i [M], sum l_i [M] and output acc [M, D]
    (fp32, exp2 with scale * log2(e) folded in). Every row must see a key in its first tile."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [M, N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attn_kernel(
    q_ptr,  # [num_tokens, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [num_tokens, H, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    tree_lens_ptr,  # [B] int32 (HAS_TREE only)
    tree_offsets_ptr,  # [B] int32 (HAS_TREE only)
    tree_mask_ptr,  # [sum m] int64 bit rows (HAS_TREE only)
    scale_log2e,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size
    G: tl.constexpr,  # query heads per kv head
    G_PAD: tl.constexpr,  # next_pow2(G)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * G_PAD rows
    BLOCK_N: tl.constexpr,  # context positions per tile
    BLOCK_D: tl.constexpr,  # next_pow2(head_dim)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else "tf32" (ignored for 16-bit)
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter on CPU: its 16-bit tl.dot is wrong)
    HAS_TREE: tl.constexpr,  # some request's last query tokens carry a tree mask
):
    b = tl.program_id(0)
    q_block = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len
    q_first = q_block * BLOCK_Q
    if q_first >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    qi = q_first + rows // G_PAD  # [BLOCK_M] query index within the request
    g = rows % G_PAD
    row_valid = (qi < q_len) & (g < G)
    head = kvh * G + g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    q_off = (q_start + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx_len + qi  # [BLOCK_M] context position of each row's query token
    last_pos = ctx_len + tl.minimum(q_first + BLOCK_Q, q_len) - 1  # last position any real row sees
    if HAS_TREE:
        tree_len = tl.load(tree_lens_ptr + b)
        tree_start = seq_len - tree_len  # first position under the tree mask
        tree_row = qi - (q_len - tree_len)  # [BLOCK_M] row in the request's tree mask (< 0: causal)
        in_tree_q = row_valid & (tree_row >= 0)  # [BLOCK_M]
        tree_bits = tl.load(tree_mask_ptr + tl.load(tree_offsets_ptr + b) + tree_row, mask=in_tree_q, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt

    for start in range(0, last_pos + 1, BLOCK_N):
        kpos = start + offs_n  # [BLOCK_N]
        kmask = kpos <= last_pos
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        within = kpos % BLOCK_SIZE
        ld_mask = kmask[:, None] & d_mask[None, :]
        k_off = blk * stride_kb + within * stride_ks + kvh * stride_kh  # [BLOCK_N]
        k = tl.load(
            k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=ld_mask, other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k = k.to(tl.float32)
        visible = (kpos[None, :] <= q_pos[:, None]) & kmask[None, :]  # (position 0: visible to every row)
        if HAS_TREE:
            if start + BLOCK_N > tree_start:  # (scalar) the tile reaches the tree's tokens
                tree_col = tl.minimum(tl.maximum(kpos - tree_start, 0), 63).to(tl.int64)  # [BLOCK_N]
                tree_bit = (tree_bits[:, None] >> tree_col[None, :]) & 1
                visible = visible & ((tree_bit != 0) | (kpos < tree_start)[None, :])
        v_off = blk * stride_vb + within * stride_vs + kvh * stride_vh
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=ld_mask, other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            v = v.to(tl.float32)
        m_i, l_i, acc = _softmax_tile(q, k, v, visible, m_i, l_i, acc, scale_log2e, DOT_PRECISION)

    acc = acc / l_i[:, None]
    o_off = (q_start + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


@triton.jit
def _rows_attn_kernel(
    q_ptr,  # [num_tokens, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [num_tokens, H, D]
    block_tables_ptr,  # [B, max_blocks] int32
    owner_ptr,  # [T] int32: the request (block-table row) of each query token
    ctx_lens_ptr,  # [T] int32: positions 0.. of the token's context read through its block table
    num_extra_ptr,  # [T] int32: then this many keys at explicit slots (a tree token's ancestors)
    extra_slots_ptr,  # [T, MAX_EXTRA] int64
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    MAX_EXTRA: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,  # max(16, next_pow2(G)) rows: the G heads of one kv head, then padding
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < G
    head = kvh * G + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_off = t * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    ctx_len = tl.load(ctx_lens_ptr + t)
    n = ctx_len + tl.load(num_extra_ptr + t)
    bt_row = block_tables_ptr + tl.load(owner_ptr + t).to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, n, BLOCK_N):
        kpos = start + offs_n  # [BLOCK_N] the token's i-th key
        kmask = kpos < n
        in_ctx = kpos < ctx_len
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask & in_ctx, other=0).to(tl.int64)
        extra = tl.load(extra_slots_ptr + t * MAX_EXTRA + (kpos - ctx_len), mask=kmask & (kpos >= ctx_len), other=0)
        slot = tl.where(in_ctx, blk * BLOCK_SIZE + kpos % BLOCK_SIZE, extra)
        ld_mask = kmask[:, None] & d_mask[None, :]
        k_off = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=ld_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k = k.to(tl.float32)
        v_off = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs + kvh * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=ld_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        # (every token sees at least one key)
        m_i, l_i, acc = _softmax_tile(q, k, v, kmask[None, :], m_i, l_i, acc, scale_log2e, DOT_PRECISION)

    acc = acc / l_i[:, None]
    o_off = t * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


MAX_TREE_KEYS = 64  # a tree token's explicit keys (its ancestors and itself): the tree mask's limit


def rows_attention_inputs(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                          tree_masks: list[torch.Tensor | None] | None, device) -> tuple[torch.Tensor, ...]:
    """(owner [T] int32, ctx_lens [T] int32, num_extra [T] int32, extra_slots [T, MAX_TREE_KEYS]
    int64) for `rows_attention`: what each query token attends to, in position order. A causal
    token at position p: positions 0..p through its block table. Token j of a tree over request
    b's last m positions (the root at r = seq_len - m): positions 0..r-1 through the block table,
    then the slots of positions r + i for each node i its mask row sees (ancestors and itself, in
    depth order). Example: block_size 4, table [3, 5], seq_len 7, a tree (-1, 0, 0) over
    positions 4..6: token 6 (node 2) -> ctx_len 4, extras [slot(4), slot(6)] = [20, 22]."""
    owner, ctx, num_extra, extra = [], [], [], []
    for b, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        tree = None if tree_masks is None else tree_masks[b]
        m = 0 if tree is None else tree.shape[0]
        for i in range(q):
            owner.append(b)
            j = i - (q - m)  # row in the tree mask (< 0: a causal token)
            if j < 0:
                ctx.append(s - q + i + 1)
                num_extra.append(0)
                extra.append([])
            else:
                seen = tree[j].to(device="cpu", dtype=torch.bool).nonzero().flatten().tolist()
                pos = [s - m + a for a in seen]
                ctx.append(s - m)
                num_extra.append(len(pos))
                extra.append([block_tables[b][p // block_size] * block_size + p % block_size for p in pos])
    slots = torch.zeros(len(owner), MAX_TREE_KEYS, dtype=torch.int64)
    for t, e in enumerate(extra):
        slots[t, : len(e)] = torch.tensor(e, dtype=torch.int64)
    as_i32 = [torch.tensor(x, dtype=torch.int32).to(device) for x in (owner, ctx, num_extra)]
    return (*as_i32, slots.to(device))


def rows_attention(
    query: torch.Tensor,  # [num_tokens, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    rows: tuple[torch.Tensor, ...],  # rows_attention_inputs
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-exact paged attention: one program per query token (and kv head) over exactly the keys
    it sees, in position order, tile by tile from its first; no mask but its key count. A token's
    output then depends only on those keys and its query: a tree token gets, bit for bit, what the
    one-token step at the end of its accepted path gets through this kernel (the same compiled
    kernel reads the same keys in the same order), and so does a token verified next to others."""
    query = _last_dim_contiguous(query)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if query.shape[0] == 0:
        return out
    grid, args, constexprs = _rows_attn_launch(query, k_cache, v_cache, out, block_tables, rows, scale,
                                               is_compiled=query.device.type == "cuda")
    _rows_attn_kernel[grid](*args, **constexprs)
    return out


def _rows_attn_launch(query, k_cache, v_cache, out, block_tables, rows, scale, is_compiled: bool):
    """Grid, runtime arguments and constexprs of one ``_rows_attn_kernel`` launch (also used by
    :mod:`kernels.triton_aot`)."""
    num_tokens, h, d = query.shape
    hkv = k_cache.shape[2]
    if h % hkv != 0:
        raise ValueError(f"num_heads ({h}) must be a multiple of num_kv_heads ({hkv})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache must have a contiguous last (head_dim) axis")
    owner, ctx_lens, num_extra, extra_slots = rows
    g = h // hkv
    args = (
        query, k_cache, v_cache, out, block_tables, owner, ctx_lens, num_extra, extra_slots, scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), d,
    )
    constexprs = dict(
        BLOCK_SIZE=k_cache.shape[1],
        MAX_EXTRA=MAX_TREE_KEYS,
        G=g,
        BLOCK_M=max(16, triton.next_power_of_2(g)),
        BLOCK_N=32,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST=not is_compiled and query.dtype != torch.float32,
    )
    return (num_tokens, hkv), args, constexprs


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, Hkv, D]
    value: torch.Tensor,  # [num_tokens, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Scatter key/value rows into the paged caches in place (reshape_and_cache)."""
    if key.shape[0] == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache must have a contiguous last (head_dim) axis")
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    grid, args, constexprs = _write_kv_launch(key, value, k_cache, v_cache, slot_mapping)
    _write_kv_kernel[grid](*args, **constexprs)


def _write_kv_launch(
    key: torch.Tensor,  # [num_tokens, Hkv, D], last dim contiguous
    value: torch.Tensor,  # [num_tokens, Hkv, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> tuple[tuple[int], tuple, dict]:
    """Grid, runtime arguments and constexprs of one ``_write_kv_kernel`` launch (also used by
    :mod:`kernels.triton_aot` to compile exactly what the engine launches)."""
    num_tokens, hkv, d = key.shape
    args = (
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        hkv,
        d,
    )
    constexprs = dict(
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d),
    )
    return (num_tokens,), args, constexprs


def _launch_config(max_query_len: int, g_pad: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): 16 rows for decode-like steps, 64 when there are more query rows."""
    rows = 16 if max_query_len * g_pad <= 16 else 64
    block_q = max(1, rows // g_pad)
    return block_q, block_q * g_pad


def paged_attention(
    query: torch.Tensor,  # [num_tokens, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, H, D]
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [num_tokens, H, D]
    """Varlen causal paged attention over the whole context of each request (see module doc).
    ``tree``: (tree_lens, tree_mask_offsets, tree_mask) as in ``AttentionMetadata``, or None."""
    num_tokens, h, d = query.shape
    hkv = k_cache.shape[2]
    if h % hkv != 0:
        raise ValueError(f"num_heads ({h}) must be a multiple of num_kv_heads ({hkv})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache must have a contiguous last (head_dim) axis")
    query = _last_dim_contiguous(query)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    grid, args, constexprs = _paged_attn_launch(
        query,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        max_query_len,
        scale,
        is_compiled=query.device.type == "cuda",
        tree=tree,
    )
    _paged_attn_kernel[grid](*args, **constexprs)
    return out


def _paged_attn_launch(
    query: torch.Tensor,  # [num_tokens, H, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    out: torch.Tensor,  # [num_tokens, H, D]
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    max_query_len: int,
    scale: float,
    is_compiled: bool,
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[tuple[int, int, int], tuple, dict]:
    """Grid, runtime arguments and constexprs of one ``_paged_attn_kernel`` launch (also used by
    :mod:`kernels.triton_aot`). ``is_compiled``: a CUDA run, not the interpreter. Without a
    ``tree`` the tree pointers are placeholders (``seq_lens``) the kernel never reads."""
    tree_lens, tree_offsets, tree_mask = (seq_lens, seq_lens, seq_lens) if tree is None else tree
    h, d = query.shape[1:]
    hkv = k_cache.shape[2]
    g = h // hkv
    g_pad = triton.next_power_of_2(g)
    block_q, block_m = _launch_config(max_query_len, g_pad)
    num_reqs = seq_lens.shape[0]
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), hkv)
    args = (
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        tree_lens,
        tree_offsets,
        tree_mask,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        d,
    )
    constexprs = dict(
        BLOCK_SIZE=k_cache.shape[1],
        G=g,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=32,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # Under TRITON_INTERPRET=1 (CPU tensors) tl.dot on bf16/fp16 returns garbage in triton 3.9,
        # so the interpreter path does its dots in fp32; compiled GPU runs keep 16-bit dots.
        UPCAST=not is_compiled and query.dtype != torch.float32,
        HAS_TREE=tree is not None,
    )
    return grid, args, constexprs


class TritonAttentionBackend:
    """Triton kernels behind the ``AttentionBackend`` interface. Stateless."""

    name = "triton"
    supports_row_exact = True

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device,
        tree_masks: list[torch.Tensor | None] | None = None,
        row_exact: str | None = None,
    ) -> AttentionMetadata:
        """`row_exact` (any mode the engine asks for: "kernel", "sdpa"): attention through
        `rows_attention`, each token over exactly its own keys in position order, so a token's
        output is the one-token step's of its (accepted) path, bit for bit."""
        md = build_common_metadata(query_lens, seq_lens, block_tables, slot_mapping, block_size, device,
                                   tree_masks=tree_masks)
        md.extras = {"block_size": block_size}
        if row_exact:
            masks = None if md.tree_lens is None else tree_masks
            md.extras["rows"] = rows_attention_inputs(query_lens, seq_lens, block_tables, block_size, masks, device)
        return md

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, Hkv, D]
        value: torch.Tensor,  # [num_tokens, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> None:
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)

    def attention(
        self,
        query: torch.Tensor,  # [num_tokens, H, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, H, D]
        if "rows" in metadata.extras:
            return rows_attention(query, k_cache, v_cache, metadata.block_tables, metadata.extras["rows"], scale)
        return paged_attention(
            query,
            k_cache,
            v_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            scale,
            tree=None if metadata.tree_lens is None
            else (metadata.tree_lens, metadata.tree_mask_offsets, metadata.tree_mask),
        )
