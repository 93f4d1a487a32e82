"""Plain-torch paged attention backend: the CPU path and the oracle for every other backend.

Contract: see :mod:`kernels.attention_api` (``AttentionBackend``). Summary:

* ``build_metadata`` (once per step) splits the requests into groups (``extras["groups"]``) so
  that padding every request of a group to the group's longest query wastes at most 2x: a
  128-token prefill chunk next to 15 decodes would otherwise pad all 16 requests to 128 query
  rows, most of the step's work spent on padding. Requests are sorted by query length
  and a new group starts when ``(n + 1) * q > 2 * (tokens + q)``; pure decode, uniform
  verification and a lone prefill stay one group. Each group's dict holds, on ``device``:

  - ``token_idx`` ``[group tokens]`` int64: the group's flat token indices (None when one group
    holds the whole step, so no gather/scatter of queries is needed).

  - ``gather_idx``  ``[B * nblk]`` int64, ``nblk = ceil(max_seq_len / block_size)``: the
    block ids of each request (``block_tables[:, :nblk]``, unused entries 0). Gathering whole blocks
    (one ``index_select`` on ``k_cache``) is ~2x faster on CPU than gathering per-slot rows. The
    gathered ``[B, nblk * block_size, Hkv, D]`` is sliced (a view) to the key axis of length
    ``S = max_seq_len``: key position p of request b is row p of
    ``k_cache[block_tables[b, :nblk]].view(-1, Hkv, D)``.
  - ``attn_mask``   ``[B, 1, max_query_len, S]`` bool (True = attend), or None when every
    query may see every gathered key (pure decode with equal seq_lens, e.g. any B=1 decode).
    Causal + valid context. Padded query rows (i >= q_len_b) copy the last real row, so no row is
    all-False and SDPA never produces NaN there.
  - ``pad_idx``     ``[group tokens]`` int64: flat query token -> ``b * max_query_len + i``,
    or None when all q_len are equal (pure decode / uniform verification: padding is a reshape).
  Tree masks (``build_metadata(..., tree_masks=...)``, see :mod:`kernels.attention_api`): request
  b's block ``attn_mask[b, 0, q_b - m_b : q_b, seq_b - m_b : seq_b]`` is its tree mask instead of
  causal.
  With ``row_exact="kernel"`` the row kernel gets the causal tables and each token's tree row
  (``tree_rows``: its root's position and mask row);
  with ``row_exact="sdpa"`` a tree token's group has ``slot_idx`` (its slots, gathered like a
  one-token step's blocks) instead of ``gather_idx``.
  (B, S and max_query_len are the group's.) For the whole step: ``extras["write_idx"]`` /
  ``extras["write_slots"]``: tokens whose slot is not -1 and their slots (``write_idx`` is None
  when no slot is -1).

* ``write_kv`` scatters ``key``/``value`` rows into the flat cache with ``index_copy_``.
* ``attention``, per group: gathers ``[B, S, Hkv, D]`` K/V with one ``index_select`` each, pads
  the queries to ``[B, max_query_len, H, D]`` (a view when q_lens are uniform) and calls
  ``scaled_dot_product_attention`` once; group outputs are scattered back to token order. A
  group with a query of >= ``PREFILL_KERNEL_MIN_QUERY`` tokens and no tree (``"prefill"``: its
  query_start_loc, seq_lens and block tables) goes to ``cpu_kernels.prefill_attention`` instead
  when query and caches are bfloat16 and the CPU has AVX512-BF16 (faster, with bfloat16
  products as SDPA's flash kernel takes them).

Unused cache slots are read (then masked out), so caches must hold finite values there
(allocate them with ``torch.zeros``; stale data from freed blocks is fine): SDPA turns a masked
NaN/inf key into a NaN row.

Worked example (one group; block_size=4): requests with query_lens=[1, 3], seq_lens=[6, 3],
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

import kernels.cpu_kernels as cpu_kernels
from kernels.attention_api import AttentionMetadata, build_common_metadata

__all__ = ["TorchAttentionBackend", "rows_kernel_inputs", "slot_tables"]


PAD_LIMIT = 2  # a group's padded query rows may be at most this many times its real tokens
# A group whose longest query has at least this many tokens (a prompt's chunk) and no tree runs
# cpu_kernels.prefill_attention where the model is bfloat16 and the CPU has AVX512-BF16.
PREFILL_KERNEL_MIN_QUERY = 16


def group_requests(query_lens: list[int]) -> list[list[int]]:
    """Request indices per group, each group in request order. Example: [1, 4, 37, 1, 5] ->
    [[0, 1, 3, 4], [2]] (the 37-token chunk alone; the rest pad to 5 rows: 20 <= 2 * 11)."""
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for b in sorted(range(len(query_lens)), key=lambda b: query_lens[b]):
        q = query_lens[b]
        if current and (len(current) + 1) * q > PAD_LIMIT * (tokens + q):
            groups.append(sorted(current))
            current, tokens = [], 0
        current.append(b)
        tokens += q
    groups.append(sorted(current))
    return groups


def slot_tables(query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int,
                tree_masks: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot tables [T, L] int64 (0-padded), context lengths [T] int64) for the row kernel over a
    cache viewed with one slot per block: row t lists, in position order, the slots token t
    attends to. A causal token at position p: the slots of positions 0..p. Token j of a tree
    over request b's last m positions (the root at position r = seq_len - m; a partial tree's
    first m - q nodes are not query tokens): positions 0..r-1,
    then r + i for each node i that mask row j sees (its ancestors and itself, in index order,
    so in depth order). Example: block_size 4, block table [3, 5], seq_len 7, a tree with
    parents (-1, 0, 0) over positions 4..6: token 6 (node 2) -> slots of positions 0-4 and 6 =
    [12, 13, 14, 15, 20, 22], length 6."""
    offsets = torch.arange(block_size, dtype=torch.int64)
    rows: list[torch.Tensor] = []
    for b, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        nblk = -(-s // block_size)
        slots = (block_tables[b, :nblk].to(torch.int64)[:, None] * block_size + offsets).flatten()[:s]  # [s]
        tree = tree_masks[b]
        m = 0 if tree is None else tree.shape[0]
        for i in range(q):
            j = i - (q - m)  # row in the tree mask (< 0: a causal token)
            if j < 0:
                rows.append(slots[: s - q + i + 1])
            else:
                seen = tree[j].to(device="cpu", dtype=torch.bool).nonzero().flatten()
                rows.append(torch.cat([slots[: s - m], slots[s - m :][seen]]))
    lens = [len(r) for r in rows]
    table = torch.zeros(len(rows), max(lens), dtype=torch.int64)
    for t, r in enumerate(rows):
        table[t, : len(r)] = r
    return table, torch.tensor(lens, dtype=torch.int64)


def tree_rows(query_lens: list[int], seq_lens: list[int], md: AttentionMetadata) -> torch.Tensor:
    """[T, 2] int64 per query token, as kernels.cpu_kernels.rows_attention takes token trees:
    (root position, the packed mask row `pack_tree_masks` made) for a tree token, (-1, 0) for a
    causal one. Example: a request of 3 query tokens, its last 2 a tree with rows 0b01, 0b11
    over positions 5, 6 -> [(-1, 0), (5, 1), (5, 3)]."""
    lens, offsets, masks = md.tree_lens.tolist(), md.tree_mask_offsets.tolist(), md.tree_mask.tolist()
    rows = []
    for b, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        m = lens[b]
        for i in range(q):
            j = i - (q - m)  # row in the tree mask (< 0: a causal token)
            rows.append((s - m, masks[offsets[b] + j]) if m and j >= 0 else (-1, 0))
    return torch.tensor(rows, dtype=torch.int64)


def rows_kernel_inputs(metadata: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(k_cache, v_cache, block tables, context lengths, token trees or None) for
    kernels.cpu_kernels.rows_attention / rows_layer from metadata built with row_exact="kernel"."""
    tables, lens = metadata.extras["rows_kernel"]
    return k_cache, v_cache, tables, lens, metadata.extras.get("rows_kernel_tree")


class TorchAttentionBackend:
    """Gather + SDPA paged attention. Stateless; one instance can serve every layer and step."""

    name = "torch"
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
        """`row_exact` makes a token's output independent of the other tokens of the step (the
        drafts verified with it, other requests), bit for bit: "sdpa" makes every query token a
        group of its own, attending to exactly its own keys with no mask (the very SDPA call a
        one-token decode step of that request makes at that position; one call per token);
        "kernel" runs kernels.cpu_kernels.rows_attention over all tokens at once (CPU only).
        `tree_masks`: see :mod:`kernels.attention_api`. With "kernel", a step with a tree gives the
        kernel the causal block tables and lengths and each tree token's root position and mask row
        (`tree_rows`): the tile kernel masks the unseen nodes, the others read slot tables the
        kernel makes from them; with "sdpa", a tree token's group gathers the K/V rows of those
        slots (its context and ancestors in position order) into the layout a one-token step's
        block gather has, and runs the same unmasked SDPA call. Either way a tree token's output
        is exactly the one-token step's of its accepted path (once that path's KV is in place),
        except on the tile kernel (bfloat16 caches on AMX), where a node off the chain positions
        sums its positions in other lanes than that step: equal within rounding, not bit for bit."""
        md = build_common_metadata(query_lens, seq_lens, block_tables, slot_mapping, block_size, "cpu",
                                   tree_masks=tree_masks)
        if md.tree_lens is None:
            tree_masks = None
        device = torch.device(device)
        starts = md.query_start_loc.tolist()
        rows_kernel = None
        if row_exact == "kernel":
            owner = [b for b, q in enumerate(query_lens) for _ in range(q)]
            lens = [seq_lens[b] - query_lens[b] + i + 1 for b, q in enumerate(query_lens) for i in range(q)]
            width = md.block_tables.shape[1]  # (from the lists: a few tensor ops less per step)
            padded = [list(bt) + [0] * (width - len(bt)) for bt in block_tables]
            rows_kernel = (torch.tensor([padded[b] for b in owner], dtype=torch.int64),
                           torch.tensor(lens, dtype=torch.int64))
            groups = []
        elif row_exact == "sdpa":
            owner = [b for b, q in enumerate(query_lens) for _ in range(q)]
            rows = [1] * len(owner)
            row_seq = [seq_lens[b] - query_lens[b] + i + 1 for b, q in enumerate(query_lens) for i in range(q)]
            row_tables = md.block_tables[owner]
            groups = [self._group([t], rows, row_seq, list(range(len(owner))), row_tables, block_size, device,
                                  whole=len(owner) == 1) for t in range(len(owner))]
            if tree_masks is not None:  # a tree token: its own slots (context, ancestors, itself)
                slots, lens = slot_tables(query_lens, seq_lens, md.block_tables, block_size, tree_masks)
                in_tree = [i >= q - (0 if tree_masks[b] is None else tree_masks[b].shape[0])
                           for b, q in enumerate(query_lens) for i in range(q)]
                for t, tree_token in enumerate(in_tree):
                    if tree_token:
                        n = int(lens[t])
                        padded = -(-n // block_size) * block_size  # the one-token step's gathered length
                        gather = torch.zeros(padded, dtype=torch.int64)  # (padding: slot 0, sliced off)
                        gather[:n] = slots[t, :n]
                        groups[t].update(max_seq_len=n, gathered_len=padded, gather_idx=None,
                                         slot_idx=gather.to(device))
        else:
            member_lists = group_requests(query_lens)
            groups = [
                self._group(members, query_lens, seq_lens, starts, md.block_tables, block_size, device,
                            whole=len(member_lists) == 1, tree_masks=tree_masks)
                for members in member_lists
            ]

        slots = md.slot_mapping
        if min(slot_mapping) < 0:
            write_idx = torch.nonzero(slots >= 0).flatten()  # [num_written]
            write_slots = slots[write_idx]
            write_idx = write_idx.to(device)
        else:
            write_idx, write_slots = None, slots

        if device.type != "cpu":
            md.query_start_loc = md.query_start_loc.to(device)
            md.seq_lens = md.seq_lens.to(device)
            md.block_tables = md.block_tables.to(device)
            md.slot_mapping = md.slot_mapping.to(device)
            for name in ("tree_lens", "tree_mask_offsets", "tree_mask"):
                if getattr(md, name) is not None:
                    setattr(md, name, getattr(md, name).to(device))
        md.extras = {
            "block_size": block_size,
            "groups": groups,
            "rows_kernel": rows_kernel,  # (block tables [T, nblk], causal context lengths [T]) or None
            # token trees for the row kernel: (root position, mask row) per token (`tree_rows`)
            "rows_kernel_tree": tree_rows(query_lens, seq_lens, md) if row_exact == "kernel" and tree_masks else None,
            "write_idx": write_idx,  # [num_written] or None
            "write_slots": write_slots.to(device),  # [num_written]
        }
        return md

    @staticmethod
    def _group(members: list[int], query_lens: list[int], seq_lens: list[int], starts: list[int],
               block_tables: torch.Tensor, block_size: int, device: torch.device, whole: bool,
               tree_masks: list[torch.Tensor | None] | None = None) -> dict:
        qlens_l = [query_lens[b] for b in members]
        seqs_l = [seq_lens[b] for b in members]
        max_q, max_s = max(qlens_l), max(seqs_l)
        # Block-granular gather index [B, nblk]: the padded key axis has S = nblk * block_size
        # positions; position p of request b is row p of k_cache[block_tables[b]].view(S, Hkv, D).
        # Unused table entries are 0 (any real block; those positions are masked out).
        nblk = -(-max_s // block_size)
        gather = block_tables[members, :nblk].to(torch.int64)  # [B, nblk]

        # Mask: query row i of request b sits at position seq_b - q_b + i; padded rows (i >= q_b)
        # are clamped to the last real row (position seq_b - 1) so they never see zero keys.
        # Key p is visible iff p <= that position (this also excludes p >= seq_b padding).
        trees = [] if tree_masks is None else [tree_masks[b] for b in members]
        has_tree = any(t is not None and t.shape[0] > 1 for t in trees)
        # Prefills from position 0, all of one length (a new prompt's only chunk): plain causal
        # attention, which SDPA's CPU flash kernel computes without the blocks above the diagonal
        # (faster than through the mask, with the same bits).
        causal = max_q > 1 and min(qlens_l) == max_q == max_s == min(seqs_l) and not has_tree
        if causal or (max_q == 1 and min(seqs_l) == max_s and not has_tree):
            # each query is the last position and all S gathered keys are real (a one-token query
            # of a partial tree is masked: it sees its ancestors, not the nodes cached before it)
            mask = None
        else:
            seq = torch.tensor(seqs_l, dtype=torch.int64)  # [B]
            qlens = torch.tensor(qlens_l, dtype=torch.int64)  # [B]
            i = torch.arange(max_q, dtype=torch.int64)  # [Lq]
            pos = torch.arange(max_s, dtype=torch.int64)  # [S]
            qpos = seq[:, None] - qlens[:, None] + torch.minimum(i[None, :], qlens[:, None] - 1)  # [B, Lq]
            mask = (pos[None, None, :] <= qpos[:, :, None]).unsqueeze(1)  # [B, 1, Lq, S]
            for i, b in enumerate(members):
                tree = None if tree_masks is None else tree_masks[b]
                if tree is not None and tree.shape[0] > 1:  # (one token: the same as causal)
                    m, q, s = tree.shape[0], query_lens[b], seq_lens[b]
                    r = min(m, q)  # the tree's query rows: its last r nodes (a partial tree: r = q < m)
                    mask[i, 0, q - r : q, s - m : s] = tree[m - r :].to(device="cpu", dtype=torch.bool)

        pad_idx = None
        if min(qlens_l) != max_q:
            # the group's token j of request i -> padded row i * max_q + j
            pad_idx = torch.cat([torch.arange(q, dtype=torch.int64) + i * max_q for i, q in enumerate(qlens_l)])
        prefill = None
        if max_q >= PREFILL_KERNEL_MIN_QUERY and not has_tree and device.type == "cpu":
            # cpu_kernels.prefill_attention's inputs, in the group's token order
            cu = [0]
            for q in qlens_l:
                cu.append(cu[-1] + q)
            prefill = (torch.tensor(cu, dtype=torch.int64), torch.tensor(seqs_l, dtype=torch.int64), gather)
        token_idx = None
        if not whole:
            token_idx = torch.cat([torch.arange(starts[b], starts[b] + query_lens[b], dtype=torch.int64) for b in members])
        return {
            "num_reqs": len(members),
            "max_query_len": max_q,
            "max_seq_len": max_s,
            "gathered_len": nblk * block_size,  # positions gathered per request (>= S)
            "gather_idx": gather.reshape(-1).to(device),  # [B * nblk] block ids
            "attn_mask": None if mask is None else mask.to(device),  # [B, 1, Lq, S] bool
            "causal": causal,  # no mask: every query row i attends to keys 0..i
            "packed_masks": {},  # G -> [B, 1, Lq * G, S], filled lazily by attention()
            "pad_idx": None if pad_idx is None else pad_idx.to(device),  # [group tokens]
            "token_idx": None if token_idx is None else token_idx.to(device),  # [group tokens]
            "prefill": prefill,  # (query_start_loc, seq_lens, block tables) for prefill_attention, or None
        }

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
        num_tokens, h, _ = query.shape
        hkv = k_cache.shape[2]
        if h % hkv != 0:
            raise ValueError(f"num_heads ({h}) must be a multiple of num_kv_heads ({hkv})")
        if num_tokens != metadata.slot_mapping.shape[0]:
            raise ValueError(
                f"query has {num_tokens} tokens, metadata expects {metadata.slot_mapping.shape[0]}"
            )
        if metadata.extras.get("rows_kernel") is not None:
            k, v, tables, lens, tree = rows_kernel_inputs(metadata, k_cache, v_cache)
            return cpu_kernels.rows_attention(query, k, v, tables, lens, scale, tree)
        groups = metadata.extras["groups"]
        if len(groups) == 1:
            return _group_attention(query, k_cache, v_cache, groups[0], scale)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        for g in groups:
            idx = g["token_idx"]
            out.index_copy_(0, idx, _group_attention(query.index_select(0, idx), k_cache, v_cache, g, scale))
        return out


def _group_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: dict,
                     scale: float) -> torch.Tensor:
    """SDPA over one group's requests; query [group tokens, H, D] -> same shape."""
    _, h, d = query.shape
    hkv = k_cache.shape[2]
    prefill = g.get("prefill")
    if (prefill is not None and query.dtype == k_cache.dtype == torch.bfloat16 and d % 16 == 0
            and cpu_kernels.prefill_attention_available()):
        return cpu_kernels.prefill_attention(query, k_cache, v_cache, *prefill, scale)
    gq = h // hkv
    b, lq, s = g["num_reqs"], g["max_query_len"], g["max_seq_len"]
    gidx, s_pad = g["gather_idx"], g["gathered_len"]
    if gidx is None:  # a tree token's own slots (row_exact "sdpa"), in the block gather's layout
        k_cache, v_cache, gidx = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d), g["slot_idx"]
    k = k_cache.index_select(0, gidx).view(b, s_pad, hkv, d)[:, :s].transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache.index_select(0, gidx).view(b, s_pad, hkv, d)[:, :s].transpose(1, 2)  # [B, Hkv, S, D]

    if g.get("causal"):  # [B, H, L, D] against [B, Hkv, L, D]: no mask, no GQA packing
        q = query.reshape(b, lq, h, d).transpose(1, 2)  # a view unless query is non-contiguous
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gq > 1)
        return out.transpose(1, 2).reshape(b * lq, h, d)

    # GQA packing: the G query heads sharing a kv head go on SDPA's length axis, row l * G + g
    # of [B, Hkv, Lq * G, D] is query token l, head kvh * G + g. K/V are never repeated
    # (faster on CPU than enable_gqa=True or repeat_interleave, esp. in bf16).
    pad_idx = g["pad_idx"]
    if pad_idx is None:
        q = query.reshape(b, lq, hkv, gq, d)  # a view unless query is non-contiguous
    else:
        q = query.new_zeros(b * lq, h, d).index_copy_(0, pad_idx, query).view(b, lq, hkv, gq, d)
    q = q.transpose(1, 2).reshape(b, hkv, lq * gq, d)  # a view when lq == 1
    mask = g["attn_mask"]  # [B, 1, Lq, S] or None
    if mask is not None and lq > 1 and gq > 1:
        packed = g["packed_masks"].get(gq)
        if packed is None:
            packed = mask.unsqueeze(3).expand(b, 1, lq, gq, s).reshape(b, 1, lq * gq, s)
            g["packed_masks"][gq] = packed
        mask = packed
    # (lq == 1: [B, 1, 1, S] broadcasts over the G rows.)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, Lq*G, D]
    out = out.view(b, hkv, lq, gq, d).transpose(1, 2).reshape(b * lq, h, d)  # [B*Lq, H, D]
    if pad_idx is not None:
        out = out.index_select(0, pad_idx)
    return out
