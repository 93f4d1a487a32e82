"""The contract between the engine and its paged attention backends: the per-step metadata, the
``AttentionBackend`` protocol, and the metadata building every backend shares. The backends
(:mod:`kernels.torch_attn`, :mod:`kernels.triton_attn`) import this module; it imports none of them.

Contract
--------
Each engine step runs a *varlen flat batch*: B requests, request b contributing ``q_len_b >= 1``
query tokens (a prefill chunk, one decode token, or k+1 speculative verification tokens) that
attend causally to the request's whole context, stored in a paged KV cache.

KV cache, per layer::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (contiguous)

Context position ``p`` of request ``b`` lives at the flat *slot*
``block_tables[b][p // block_size] * block_size + p % block_size``; slot ``s`` is row
``k_cache.view(-1, num_kv_heads, head_dim)[s]``.
Worked example: block_size=16, block_tables[b] = [7, 2] -> p=3 is slot 7*16+3 = 115,
p=20 is slot 2*16+4 = 36.

Query token ``i`` (0 <= i < q_len_b) of request b sits at context position
``seq_len_b - q_len_b + i`` and attends to positions ``0..seq_len_b - q_len_b + i`` (causal).
Its K/V must already be in the cache (``write_kv`` first, then ``attention``).
GQA: query head h reads kv head ``h // (num_heads // num_kv_heads)``.

Tree speculation: ``build_metadata(..., tree_masks=...)`` takes, per request, None (causal) or a
bool ``[m, m]`` mask over a token tree at the request's last m positions (``seq_len - m ..``, its
root first): tree token i sees the context before the tree and tree token j iff ``mask[i, j]``.
The mask must be lower triangular with a True diagonal and a True first column (every node sees
the root), so no query row is ever fully masked, and m <= MAX_TREE_TOKENS (64: a row is one int64
of bits). Usually the whole tree is query tokens (m <= q_len; earlier query tokens of the request
stay causal). A *partial* tree has m > q_len: its first m - q_len nodes' K/V are already in the
cache (written by an earlier step at those positions) and the request's q_len query tokens are its
last nodes, rows m - q_len .. m - 1 of the mask (tree drafting feeds each level's new nodes only).
Worked example: q_len=3, seq_len=10, mask [[1,0],[1,1]] over the last 2 tokens -> tokens at
positions 8 and 9 both see 0..7 and 8; 9 also sees itself; token 7 (causal) sees 0..7. Partial:
q_len=1, seq_len=10, mask [[1,0,0],[1,1,0],[1,0,1]] -> the one query token (position 9, node 2)
sees 0..7 (node 0 at 7) and itself, not position 8 (node 1, a sibling).

Per step, the engine calls ``backend.build_metadata(...)`` once and shares the result between
all layers; per layer it calls ``write_kv`` then ``attention``.  ``slot_mapping`` entries of -1
mean "do not write" (padding tokens).

Backends: ``"torch"`` (CPU path and the oracle, :mod:`kernels.torch_attn`) and ``"triton"``
(GPU, :mod:`kernels.triton_attn`); :func:`kernels.get_attention_backend` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

MAX_TREE_TOKENS = 64  # tree-masked query tokens per request (one int64 of mask bits per token)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "build_common_metadata",
    "pack_tree_masks",
    "MAX_TREE_TOKENS",
    "validate_step_inputs",
]


@dataclass
class AttentionMetadata:
    """Per-step attention metadata, built once by a backend and shared by every layer."""

    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query offsets (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's query tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (padding entries unused)
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each query token's K/V (-1 = skip)
    max_query_len: int
    max_seq_len: int
    extras: dict = field(default_factory=dict)  # backend-specific precomputed tensors
    # Tree masks (None when every request is causal), see ``pack_tree_masks``:
    tree_lens: torch.Tensor | None = None  # [B] int32, m_b: trailing positions under the mask (0: none)
    tree_mask_offsets: torch.Tensor | None = None  # [B] int32, request b's first row in tree_mask
    tree_mask: torch.Tensor | None = None  # [sum m_b] int64, bit j of row i: tree token i sees tree token j

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@runtime_checkable
class AttentionBackend(Protocol):
    """What the model runner needs from an attention implementation."""

    name: str
    # Whether `build_metadata(..., row_exact=...)` makes each query token's output independent of
    # the other tokens of the step, bit for bit (the engine's exact modes ask for it where it is).
    supports_row_exact: bool = False

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device,
        tree_masks: list[torch.Tensor | None] | None = None,
        row_exact: str | None = None,  # "kernel" or "sdpa" (backends with supports_row_exact)
    ) -> AttentionMetadata: ...

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> None: ...

    def attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


def validate_step_inputs(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    block_size: int,
) -> None:
    """Raise ValueError when the per-step inputs of ``build_metadata`` are inconsistent."""
    n = len(query_lens)
    if n == 0:
        raise ValueError("build_metadata needs at least one request (query_lens is empty)")
    if len(seq_lens) != n or len(block_tables) != n:
        raise ValueError(
            f"query_lens ({n}), seq_lens ({len(seq_lens)}) and block_tables ({len(block_tables)}) "
            "must have one entry per request"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for b, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 1 <= q <= s:
            raise ValueError(f"request {b}: need 1 <= query_len <= seq_len, got query_len={q}, seq_len={s}")
        if len(bt) * block_size < s:
            raise ValueError(
                f"request {b}: block table has {len(bt)} blocks of {block_size} slots, "
                f"too few for seq_len={s}"
            )
    if len(slot_mapping) != sum(query_lens):
        raise ValueError(
            f"slot_mapping has {len(slot_mapping)} entries, expected sum(query_lens)={sum(query_lens)}"
        )


def build_common_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device | str,
    min_blocks: int = 0,
    tree_masks: list[torch.Tensor | None] | None = None,
) -> AttentionMetadata:
    """Validate the step inputs and build the backend-independent part of the metadata.

    ``block_tables`` rows are right-padded with 0 to ``max(max row length, ceil(max_seq_len /
    block_size), min_blocks)`` columns. ``extras`` is left empty for the backend to fill.
    Example: query_lens=[1, 3], seq_lens=[5, 3] -> query_start_loc=[0, 1, 4].
    ``tree_masks``: see the module docstring; packed by ``pack_tree_masks``.
    """
    validate_step_inputs(query_lens, seq_lens, block_tables, slot_mapping, block_size)
    packed = pack_tree_masks(query_lens, tree_masks, seq_lens) if tree_masks is not None else None
    max_s = max(seq_lens)
    width = max(max(len(bt) for bt in block_tables), -(-max_s // block_size), min_blocks, 1)
    padded = [list(bt) + [0] * (width - len(bt)) for bt in block_tables]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    device = torch.device(device)
    lens, offsets, mask = (None, None, None) if packed is None else (t.to(device) for t in packed)
    return AttentionMetadata(
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max_s,
        extras={},
        tree_lens=lens,
        tree_mask_offsets=offsets,
        tree_mask=mask,
    )


def pack_tree_masks(
    query_lens: list[int], tree_masks: list[torch.Tensor | None], seq_lens: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Validate per-request tree masks and pack them, on the CPU: (tree_lens [B] int32,
    tree_mask_offsets [B] int32, tree_mask [sum m] int64), or None when every entry is None.
    Request b's rows are tree_mask[offsets[b] : offsets[b] + m_b]; bit j of a row is mask[i, j].
    A partial tree (m_b > query_lens[b], see the module docstring) needs m_b <= seq_lens[b].
    Example: masks [None, [[1,0],[1,1]]] -> lens [0, 2], offsets [0, 0], tree_mask [0b01, 0b11].
    """
    if len(tree_masks) != len(query_lens):
        raise ValueError(f"tree_masks has {len(tree_masks)} entries, expected one per request ({len(query_lens)})")
    if all(m is None for m in tree_masks):
        return None
    lens, offsets, rows = [], [], []
    for b, (m, q) in enumerate(zip(tree_masks, query_lens, strict=True)):
        offsets.append(sum(lens))
        if m is None:
            lens.append(0)
            continue
        n = m.shape[0]
        longest = min(MAX_TREE_TOKENS, q if seq_lens is None else seq_lens[b])
        if m.dim() != 2 or m.shape[1] != n or not 1 <= n <= longest:
            raise ValueError(f"request {b}: tree mask must be [m, m] with 1 <= m <= {longest} (query_len {q}, "
                             f"seq_len {None if seq_lens is None else seq_lens[b]}, at most {MAX_TREE_TOKENS}), "
                             f"got {tuple(m.shape)}")
        m = m.to(device="cpu", dtype=torch.bool)
        if not (m.diagonal().all() and m[:, 0].all() and not m.triu(1).any()):
            raise ValueError(f"request {b}: tree mask must be lower triangular with a True diagonal and first column")
        lens.append(n)
        rows.append((m.long() << torch.arange(n)).sum(dim=1))  # bit 63 wraps to the sign bit, as wanted
    return torch.tensor(lens, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32), torch.cat(rows)
