"""Plain-torch paged attention backend: the CPU path and the oracle for every other backend.

Contract: see :mod:`kernels` (``AttentionBackend``). Summary:

* ``build_metadata`` (once per step) precomputes, on ``device``:

  - ``extras["gather_idx"]``  ``[B * nblk]`` int64, ``nblk = ceil(max_seq_len / block_size)``: the
    block ids of each request (``block_tables[:, :nblk]``, unused entries 0). Gathering whole blocks
    (one ``index_select`` on ``k_cache``) is ~2x faster on CPU than gathering per-slot rows. The
    gathered ``[B, nblk * block_size, Hkv, D]`` is sliced (a view) to the key axis of length
    ``S = max_seq_len``: key position p of request b is row p of
    ``k_cache[block_tables[b, :nblk]].view(-1, Hkv, D)``.
  - ``extras["attn_mask"]``   ``[B, 1, max_query_len, S]`` bool (True = attend), or None when every
    query may see every gathered key (pure decode with equal seq_lens, e.g. any B=1 decode).
    Causal + valid context. Padded query rows (i >= q_len_b) copy the last real row, so no row is
    all-False and SDPA never produces NaN there.
  - ``extras["pad_idx"]``     ``[num_tokens]`` int64: flat query token -> ``b * max_query_len + i``,
    or None when all q_len are equal (pure decode / uniform verification: padding is a reshape).
  - ``extras["write_idx"]`` / ``extras["write_slots"]``: tokens whose slot is not -1 and their slots
    (``write_idx`` is None when no slot is -1).

* ``write_kv`` scatters ``key``/``value`` rows into the flat cache with ``index_copy_``.
* ``attention`` gathers ``[B, S, Hkv, D]`` K/V with one ``index_select`` each, pads the queries to
  ``[B, max_query_len, H, D]`` (a view when q_lens are uniform) and calls
  ``scaled_dot_product_attention`` once.

Unused cache slots are read (then masked out), so caches must hold finite values there
(allocate them with ``torch.zeros``; stale data from freed blocks is fine): SDPA turns a masked
NaN/inf key into a NaN row.

Worked example (block_size=4): requests with query_lens=[1, 3], seq_lens=[6, 3],
block_tables=[[5, 1], [2]] -> nblk=2, S=6
  gather_idx = [5, 1, 2, 0]  (request 1's second block is padding -> block 0, masked out)
  key position p=4 of request 0 -> row 4 of k_cache[[5, 1]].view(8, Hkv, D) = slot 1*4+0 = 4
  query positions: b0 -> [5], b1 -> [0, 1, 2]; pad_idx = [0, 3, 4, 5] (max_query_len=3)
  attn_mask[b0] rows: [1 1 1 1 1 1] x3 (rows 1, 2 are padding copies of row 0)
  attn_mask[b1] rows: [1 0 0 0 0 0], [1 1 0 0 0 0], [1 1 1 0 0 0]

GQA: the G = H / Hkv query heads of one kv head are packed on SDPA's query-length axis
(``[B, Hkv, Lq * G, D]``, row ``l * G + g``), so K/V are never repeated; the mask is expanded to
match once per step and cached in ``extras["packed_masks"]``. On CPU this beats
``enable_gqa=True`` (which falls back to a slow path in bf16) and ``repeat_interleave``.

Works for float32, bfloat16 and float16 (SDPA accumulates in fp32 on CPU for reduced dtypes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import AttentionMetadata, build_common_metadata

__all__ = ["TorchAttentionBackend"]


class TorchAttentionBackend:
    """Gather + SDPA paged attention. Stateless; one instance can serve every layer and step."""

    name = "torch"

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        md = build_common_metadata(query_lens, seq_lens, block_tables, slot_mapping, block_size, "cpu")
        num_reqs = len(query_lens)
        max_q, max_s = md.max_query_len, md.max_seq_len
        device = torch.device(device)

        # Block-granular gather index [B, nblk]: the padded key axis has S = nblk * block_size
        # positions; position p of request b is row p of k_cache[block_tables[b]].view(S, Hkv, D).
        # Unused table entries are 0 (any real block; those positions are masked out).
        nblk = -(-max_s // block_size)
        s_pad = nblk * block_size
        gather = md.block_tables[:, :nblk].to(torch.int64)  # [B, nblk]
        pos = torch.arange(max_s, dtype=torch.int64)  # [S]; the gathered [B, s_pad] is sliced to S
        seq = md.seq_lens.to(torch.int64)  # [B]

        # Mask: query row i of request b sits at position seq_b - q_b + i; padded rows (i >= q_b)
        # are clamped to the last real row (position seq_b - 1) so they never see zero keys.
        # Key p is visible iff p <= that position (this also excludes p >= seq_b padding).
        uniform_q = min(query_lens) == max_q
        if max_q == 1 and min(seq_lens) == max_s:
            mask = None  # each query is the last position and all S gathered keys are real
        else:
            qlens = torch.tensor(query_lens, dtype=torch.int64)  # [B]
            i = torch.arange(max_q, dtype=torch.int64)  # [Lq]
            qpos = seq[:, None] - qlens[:, None] + torch.minimum(i[None, :], qlens[:, None] - 1)  # [B, Lq]
            mask = (pos[None, None, :] <= qpos[:, :, None]).unsqueeze(1)  # [B, 1, Lq, S]

        pad_idx = None
        if not uniform_q:
            # token t = query_start_loc[b] + i -> padded row b * max_q + i
            pad_idx = torch.cat(
                [torch.arange(q, dtype=torch.int64) + b * max_q for b, q in enumerate(query_lens)]
            )

        slots = md.slot_mapping
        if min(slot_mapping) < 0:
            write_idx = torch.nonzero(slots >= 0).flatten()  # [num_written]
            write_slots = slots[write_idx]
            write_idx = write_idx.to(device)
        else:
            write_idx, write_slots = None, slots

        md.query_start_loc = md.query_start_loc.to(device)
        md.seq_lens = md.seq_lens.to(device)
        md.block_tables = md.block_tables.to(device)
        md.slot_mapping = md.slot_mapping.to(device)
        md.extras = {
            "num_reqs": num_reqs,
            "block_size": block_size,
            "gathered_len": s_pad,  # nblk * block_size positions gathered per request (>= S)
            "gather_idx": gather.reshape(-1).to(device),  # [B * nblk] block ids
            "attn_mask": None if mask is None else mask.to(device),  # [B, 1, Lq, S] bool
            "packed_masks": {},  # G -> [B, 1, Lq * G, S], filled lazily by attention()
            "pad_idx": None if pad_idx is None else pad_idx.to(device),  # [num_tokens]
            "write_idx": write_idx,  # [num_written] or None
            "write_slots": write_slots.to(device),  # [num_written]
        }
        return md

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> None:
        ex = metadata.extras
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        slots = ex["write_slots"]
        widx = ex["write_idx"]
        if widx is not None:
            key = key.index_select(0, widx)
            value = value.index_select(0, widx)
        k_cache.view(-1, hkv, d).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, slots, value.to(v_cache.dtype))

    def attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ex = metadata.extras
        num_tokens, h, d = query.shape
        hkv = k_cache.shape[2]
        if h % hkv != 0:
            raise ValueError(f"num_heads ({h}) must be a multiple of num_kv_heads ({hkv})")
        if num_tokens != metadata.slot_mapping.shape[0]:
            raise ValueError(
                f"query has {num_tokens} tokens, metadata expects {metadata.slot_mapping.shape[0]}"
            )
        g = h // hkv
        b, lq, s = ex["num_reqs"], metadata.max_query_len, metadata.max_seq_len
        gidx, s_pad = ex["gather_idx"], ex["gathered_len"]
        k = k_cache.index_select(0, gidx).view(b, s_pad, hkv, d)[:, :s].transpose(1, 2)  # [B, Hkv, S, D]
        v = v_cache.index_select(0, gidx).view(b, s_pad, hkv, d)[:, :s].transpose(1, 2)  # [B, Hkv, S, D]

        # GQA packing: the G query heads sharing a kv head go on SDPA's length axis, row l * G + g
        # of [B, Hkv, Lq * G, D] is query token l, head kvh * G + g. K/V are never repeated
        # (measured faster on CPU than enable_gqa=True or repeat_interleave, esp. in bf16).
        pad_idx = ex["pad_idx"]
        if pad_idx is None:
            q = query.reshape(b, lq, hkv, g, d)  # a view unless query is non-contiguous
        else:
            q = query.new_zeros(b * lq, h, d).index_copy_(0, pad_idx, query).view(b, lq, hkv, g, d)
        q = q.transpose(1, 2).reshape(b, hkv, lq * g, d)  # a view when lq == 1
        mask = ex["attn_mask"]  # [B, 1, Lq, S] or None
        if mask is not None and lq > 1 and g > 1:
            packed = ex["packed_masks"].get(g)
            if packed is None:
                packed = mask.unsqueeze(3).expand(b, 1, lq, g, s).reshape(b, 1, lq * g, s)
                ex["packed_masks"][g] = packed
            mask = packed
        # (lq == 1: [B, 1, 1, S] broadcasts over the G rows.)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, Lq*G, D]
        out = out.view(b, hkv, lq, g, d).transpose(1, 2).reshape(b * lq, h, d)  # [B*Lq, H, D]
        if pad_idx is not None:
            out = out.index_select(0, pad_idx)
        return out
