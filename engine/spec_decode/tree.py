"""Token trees for tree speculation: plain-data trees, EAGLE-2 dynamic construction, masks,
positions, and the KV moves that commit an accepted path.

A request's tree has n + 1 nodes; node 0 is the root (the last committed token, whose KV the
verify step computes like a chain's first query token) and every other node's parent has a
smaller index, so the verify step feeds the nodes in index order as n + 1 query tokens at
sequence indices p0 .. p0 + n (p0: the root's position) and writes their KV into those slots.
Node i attends to the committed prefix and its own ancestors and itself (`tree_attention_mask`)
and is rotated at position p0 + depth(i) (`tree_positions`). After verification the accepted
path (a_1, .., a_L), a_j at depth j, is committed by moving the KV of slot p0 + a_j to slot
p0 + j (`accepted_kv_moves`); a chain is the tree whose node i has parent i - 1 (no moves).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "DraftTree",
    "TreeLevel",
    "accepted_kv_moves",
    "build_dynamic_trees",
    "build_sampled_trees",
    "chain_tree",
    "expand_level",
    "first_level",
    "move_kv",
    "select_frontier",
    "select_frontiers",
    "tree_attention_mask",
    "tree_positions",
]


@dataclass(frozen=True)
class DraftTree:
    """One request's token tree; node 0 is the root.

    token_ids[i]: node i's token (token_ids[0]: the last committed token). parents[i]: its
    parent's index (< i; parents[0] = -1). cum_logprobs[i]: the draft's log-probability of the
    path root -> i (0 at the root). source_ids[i]: where node i came from in the candidate pool
    of `build_dynamic_trees` (-1 for the root), so the drafter can find its rows; None otherwise.
    Example: parents (-1, 0, 0, 1) -> depths (0, 1, 1, 2), children of 0: [1, 2].
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    cum_logprobs: tuple[float, ...]
    source_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("a tree has at least its root (token_ids is empty)")
        lengths = (len(self.parents), len(self.cum_logprobs), n if self.source_ids is None else len(self.source_ids))
        if lengths != (n, n, n):
            raise ValueError(f"token_ids ({n}), parents, cum_logprobs and source_ids lengths differ: {lengths}")
        if self.parents[0] != -1:
            raise ValueError(f"node 0 is the root: parents[0] must be -1, got {self.parents[0]}")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent must be in [0, {i - 1}], got {p}")

    @property
    def num_nodes(self) -> int:
        """Nodes including the root (the verify step's query tokens)."""
        return len(self.token_ids)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[i]: node i's children in index order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    def truncated(self, num_drafts: int) -> DraftTree:
        """The tree of its root and first `num_drafts` draft nodes (index order keeps every
        parent), as the scheduler cuts drafts to fit a step's token budget."""
        n = min(num_drafts, self.num_nodes - 1) + 1
        if n == self.num_nodes:
            return self
        return DraftTree(self.token_ids[:n], self.parents[:n], self.cum_logprobs[:n],
                         None if self.source_ids is None else self.source_ids[:n])

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def chain_tree(root_token_id: int, draft_token_ids: list[int]) -> DraftTree:
    """A chain of k drafts as a tree: node i's parent is i - 1."""
    n = len(draft_token_ids) + 1
    return DraftTree((root_token_id, *draft_token_ids), tuple(range(-1, n - 1)), (0.0,) * n)


def tree_attention_mask(tree: DraftTree) -> torch.Tensor:
    """[n+1, n+1] bool on the CPU: row i is True at node i's ancestors and itself (the root
    included), the mask the verify step uses over the tree's query tokens. Example: parents
    (-1, 0, 0, 1) -> rows [1000], [1100], [1010], [1101]."""
    n = tree.num_nodes
    rows = [0] * n  # bit j of rows[i]: node i sees node j
    for i in range(n):
        rows[i] = (rows[tree.parents[i]] if i else 0) | (1 << i)
    bits = torch.tensor([[(r >> j) & 1 for j in range(n)] for r in rows], dtype=torch.bool)
    return bits


def tree_positions(tree: DraftTree, root_position: int) -> list[int]:
    """RoPE position of each node: the root's plus the node's depth."""
    return [root_position + d for d in tree.depths]


def accepted_kv_moves(accepted_node_ids: list[int], root_position: int, block_table: list[int],
                      block_size: int) -> tuple[list[int], list[int]]:
    """(source slots, destination slots) that commit an accepted path's KV.

    The verify step wrote node i's KV at sequence index root_position + i; accepted node a_j
    (depth j = its place in the path, 1-based) belongs at root_position + j. Nodes already in
    place are skipped. Reading every source before writing (as `move_kv` does) is always safe.
    Example: path [2, 5], root_position 10, block_size 4, block_table [0, 1, 2, 3] -> indices
    12 -> 11 and 15 -> 12 -> ([12, 15], [11, 12]).
    """
    src, dst = [], []
    for depth, node in enumerate(accepted_node_ids, start=1):
        if node != depth:
            for out, pos in ((src, root_position + node), (dst, root_position + depth)):
                out.append(block_table[pos // block_size] * block_size + pos % block_size)
    return src, dst


def move_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src_slots: list[int], dst_slots: list[int]) -> None:
    """Copy the KV rows of `src_slots` onto `dst_slots` in every layer's paged cache
    ([num_blocks, block_size, num_kv_heads, head_dim]); all sources are read first."""
    if not src_slots:
        return
    device = kv_caches[0][0].device
    if device.type == "cpu" and all(c.is_contiguous() for layer in kv_caches for c in layer):
        from kernels import cpu_kernels

        if cpu_kernels.available():  # one call for every cache (the same copies)
            cpu_kernels.move_slots([c for layer in kv_caches for c in layer], src_slots, dst_slots)
            return
    src = torch.tensor(src_slots, dtype=torch.long, device=device)
    dst = torch.tensor(dst_slots, dtype=torch.long, device=device)
    for cache in (c for layer in kv_caches for c in layer):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, dst, flat.index_select(0, src))


# --- EAGLE-2 dynamic trees ------------------------------------------------------------------


@dataclass(frozen=True)
class TreeLevel:
    """The candidates of one depth for R requests (the same count C for each request).

    parent_ids [R, C] int64: index of each candidate's parent among the previous level's
    candidates (-1: a child of the root). token_ids [R, C] int64. cum_logprobs [R, C] float32:
    the draft's log-probability of the path from the root to the candidate.
    """

    parent_ids: torch.Tensor
    token_ids: torch.Tensor
    cum_logprobs: torch.Tensor


def first_level(topk_token_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> TreeLevel:
    """The root's top-k children: topk_token_ids / topk_logprobs [R, k] from the drafter's
    distribution after the root."""
    return TreeLevel(torch.full_like(topk_token_ids, -1), topk_token_ids, topk_logprobs.float().clamp_max(0.0))


def select_frontier(level: TreeLevel, width: int, deviations: torch.Tensor | None = None,
                    by_deviation: torch.Tensor | None = None) -> torch.Tensor:
    """[R, min(width, C)] int64: the level's candidates with the highest cumulative
    log-probability (the nodes to expand next), ties broken by index, in index order. Rows with
    `by_deviation` [R] bool rank by fewest `deviations` [R, C] (non-first draws on the path)
    first, then by cumulative log-probability (sampled trees: the first draws' chain is always
    expanded; an undrawn -inf candidate ranks last)."""
    width = min(width, level.cum_logprobs.shape[1])
    return select_frontiers(level, torch.full((level.cum_logprobs.shape[0],), width), deviations, by_deviation)[0]


def select_frontiers(level: TreeLevel, widths: torch.Tensor, deviations: torch.Tensor | None = None,
                     by_deviation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_frontier` with a width per request, widths [R] int64: (frontier [R, F], run [R, F]
    bool), F = min(max(widths), C). Row r's frontier is its F best candidates in index order; run
    marks its widths[r] best of them that were drafted (finite cumulative log-probability): the
    nodes to expand (undrawn candidates rank last, so a row's run nodes are its widths[r] best
    drafted ones whatever the other rows' widths). Example: cum log-probs [[-0.1, -2.0, -0.5]], widths [1] with F = 2 from
    another row -> frontier [[0, 2]], run [[True, False]]."""
    width = min(int(widths.max()), level.cum_logprobs.shape[1])
    score = level.cum_logprobs
    if by_deviation is not None and deviations is not None and bool(by_deviation.any()):
        # cum log-probs are in (-inf, 0]: one deviation outweighs any finite difference of them;
        # an undrawn (-inf) candidate ranks last of all, so it takes no node's place (nor does it
        # depend on how many such slots the batch's widths pad a level with)
        ranked = (score.clamp_min(-1e4) - 2e4 * deviations.to(score.dtype)).masked_fill(torch.isinf(score), float("-inf"))
        score = torch.where(by_deviation.unsqueeze(1), ranked, score)
    order = torch.sort(-score, dim=1, stable=True).indices[:, :width]  # [R, F], best first
    run = (torch.arange(width, device=order.device) < widths.to(order.device).unsqueeze(1)) & torch.isfinite(
        level.cum_logprobs.gather(1, order))
    frontier, by_index = order.sort(dim=1)
    return frontier, run.gather(1, by_index)


def expand_level(level: TreeLevel, frontier: torch.Tensor, topk_token_ids: torch.Tensor,
                 topk_logprobs: torch.Tensor) -> TreeLevel:
    """The next level: the top-k children of each frontier node.

    frontier [R, F] (from `select_frontier`); topk_token_ids / topk_logprobs [R, F, k]: the
    drafter's top-k after each frontier node. Candidate f * k + j is child j of frontier[:, f].
    Log-probabilities are clamped to <= 0, so a child never outranks its parent.
    """
    r, f, k = topk_token_ids.shape
    parent_cum = level.cum_logprobs.gather(1, frontier)  # [R, F]
    cum = parent_cum.unsqueeze(2) + topk_logprobs.float().clamp_max(0.0)  # [R, F, k]
    parents = frontier.unsqueeze(2).expand(r, f, k)
    return TreeLevel(parents.reshape(r, f * k), topk_token_ids.reshape(r, f * k), cum.reshape(r, f * k))


def _candidate_pool(levels: list[TreeLevel]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The levels' candidates concatenated (level 0 first), each [R, P]: the pool index of each
    candidate's parent (-1: the root), its token, its cumulative draft log-probability."""
    offsets = [0]
    for lv in levels:
        offsets.append(offsets[-1] + lv.token_ids.shape[1])
    pool_parent = torch.cat(
        [levels[0].parent_ids] + [lv.parent_ids + offsets[d] for d, lv in enumerate(levels[1:])], dim=1
    )
    return (pool_parent, torch.cat([lv.token_ids for lv in levels], dim=1),
            torch.cat([lv.cum_logprobs for lv in levels], dim=1))


def build_dynamic_trees(root_token_ids: list[int], levels: list[TreeLevel], num_nodes: list[int],
                        min_logprob: float = float("-inf")) -> list[DraftTree]:
    """EAGLE-2 reranking: per request, the num_nodes[r] candidates of all levels with the highest
    cumulative draft log-probability (ties: the earlier level, then the lower index), as a tree
    of num_nodes[r] + 1 nodes (fewer when the levels hold fewer drafted candidates: one with
    cum log-prob -inf was not drafted, e.g. a child past its request's tree width, and fewer when
    fewer have a cum log-prob >= min_logprob: the value floor, `ProposeContext.tree_min_logprob`).

    The kept set is closed under parents (a child's cum log-prob is at most its parent's and the
    parent comes first on ties), so it is a valid tree; nodes are ordered by level then index.
    The candidate pool is the levels' candidates concatenated (level 0 first): a node's
    `source_ids` entry is its index there. One host sync for the whole batch.
    Example: level 0 tokens [7, 8] (cum -0.1, -2.0), level 1 = children of candidate 0, tokens
    [9, 4] (cum -0.5, -3.0), num_nodes 3 -> pool ranks 7, 9, 8 -> nodes (root, 7, 8, 9),
    parents (-1, 0, 0, 1).
    """
    if not levels:
        return [DraftTree((t,), (-1,), (0.0,)) for t in root_token_ids]
    pool_parent, pool_tokens, pool_cum = _candidate_pool(levels)
    num_reqs, pool = pool_tokens.shape
    width = min(max(num_nodes), pool)
    kept = torch.sort(-pool_cum, dim=1, stable=True).indices[:, :width].sort(dim=1).values  # [R, W]
    # pool index -> node index (1-based; 0 = root), for remapping parents
    node_of = torch.zeros(num_reqs, pool + 1, dtype=torch.long, device=pool_tokens.device)
    node_of[:, 1:].scatter_(1, kept, torch.arange(1, width + 1, device=pool_tokens.device).expand(num_reqs, width))
    parents = node_of.gather(1, pool_parent.gather(1, kept) + 1)  # [R, W]
    table = torch.stack([kept.double(), pool_tokens.gather(1, kept).double(), parents.double(),
                         pool_cum.gather(1, kept).double()])  # [4, R, W]
    kept_l, tokens_l, parents_l, cum_l = table.tolist()
    trees = []
    for r, root in enumerate(root_token_ids):
        # keep the request's best num_nodes[r]: those of rank < num_nodes[r] in cum order. The
        # W columns are in pool order, so drop the lowest-ranked ones: re-rank on the host.
        n = min(num_nodes[r], width)
        drafted = [j for j in range(width) if cum_l[r][j] != float("-inf") and cum_l[r][j] >= min_logprob]
        rank = sorted(drafted, key=lambda j: (-cum_l[r][j], kept_l[r][j]))[:n]
        cols = sorted(rank)
        remap = {0: 0} | {j + 1: i + 1 for i, j in enumerate(cols)}
        trees.append(DraftTree(
            (root, *(int(tokens_l[r][j]) for j in cols)),
            (-1, *(remap[int(parents_l[r][j])] for j in cols)),
            (0.0, *(cum_l[r][j] for j in cols)),
            (-1, *(int(kept_l[r][j]) for j in cols)),
        ))
    return trees


def build_sampled_trees(root_token_ids: list[int], levels: list[TreeLevel], num_nodes: list[int]) -> list[DraftTree]:
    """Trees of sampled candidates: per request, its first num_nodes[r] candidates with a finite
    cumulative log-probability in *deviation order* (fewest non-first draws on the path from the
    root, then the shallower, then pool order), with no reranking by value; nodes are then
    numbered in pool order (level by level, so every parent comes first).

    For drafts drawn from the drafter's q, a candidate may not be kept or dropped by its own
    value (the rejection sampler needs each child distributed as the q given for it): the order
    depends only on where a candidate sits (its depth and the draw index of each node on its
    path), it keeps every node's children as a prefix of its draws (child j has one deviation
    more than child j - 1 when j = 1, as many when j > 1, and comes after it in pool order), and
    whether a candidate is kept depends only on the candidates before it. The first-drawn child
    of each node forms the leading chain, so a tree of N nodes is as deep as a chain of its depth
    (level order would make it wide and shallow). A candidate with cum log-prob -inf was not
    drawn (its parent's q ran out of tokens, or its parent was not drawn); the kept set is closed
    under parents (a parent has no more deviations, is shallower, and comes first).
    `source_ids` as in `build_dynamic_trees`.
    Example: level 0 tokens [7, 8] (cum -0.1, -2.0), level 1 = children of candidate 1, tokens
    [9, 4] (cum -2.5, -inf), num_nodes 3 -> deviation order 7 (0), then 8 and 9 (1 each; 8 is
    shallower) -> nodes (root, 7, 8, 9), parents (-1, 0, 0, 2).
    """
    if not levels:
        return [DraftTree((t,), (-1,), (0.0,)) for t in root_token_ids]
    pool_parent, pool_tokens, pool_cum = _candidate_pool(levels)
    parents_l, tokens_l, cum_l = torch.stack([pool_parent.double(), pool_tokens.double(), pool_cum.double()]).tolist()
    depth_of = [d for d, lv in enumerate(levels) for _ in range(lv.token_ids.shape[1])]
    trees = []
    for r, root in enumerate(root_token_ids):
        parents = [int(p) for p in parents_l[r]]
        deviations, seen = [], {}
        for parent in parents:
            sibling = seen.get(parent, 0)  # this candidate's draw index among its parent's children
            seen[parent] = sibling + 1
            deviations.append((deviations[parent] if parent >= 0 else 0) + (sibling > 0))
        order = sorted(range(len(parents)), key=lambda j: (deviations[j], depth_of[j], j))
        kept: set[int] = set()
        for j in order:
            if len(kept) >= num_nodes[r]:
                break
            if cum_l[r][j] == float("-inf") or (parents[j] >= 0 and parents[j] not in kept):
                continue
            kept.add(j)
        node_of = {-1: 0}  # pool index -> node index
        tokens, tree_parents, cums, sources = [root], [-1], [0.0], [-1]
        for j in sorted(kept):
            node_of[j] = len(tokens)
            tokens.append(int(tokens_l[r][j]))
            tree_parents.append(node_of[parents[j]])
            cums.append(cum_l[r][j])
            sources.append(j)
        trees.append(DraftTree(tuple(tokens), tuple(tree_parents), tuple(cums), tuple(sources)))
    return trees
