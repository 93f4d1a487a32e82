"""Growing EAGLE-2 dynamic draft trees, level by level, for any drafter that can run new tree
nodes through its layers (the draft model, EAGLE-1, EAGLE-3, native MTP).

`grow_trees` owns the level loop; the drafter gives it what its head reads after the root and
a callback that runs one level's new nodes. Each request has its own width w (the adaptive
policy's, at most the configured tree_width; 1 makes a chain): level 1 is the root's w
children; level d + 1 the w children of each of level d's w most probable candidates (by
cumulative draft log-probability: `select_frontiers`; for a sampled request, fewest non-first
draws first, so the first draws' chain is always expanded). Those frontier nodes are
*expanded*: appended, per request, to a tree of the root and every node expanded so far, and
only they run through the drafter (a partial tree, see `engine.model_runner.SeqChunk`): their
KV lands in the slots after the earlier ones', each sees the committed context, its ancestors
and itself. So a level costs one forward over w rows per request, whatever the depth.

Greedy requests keep the num_nodes[r] best candidates of their first max_depths[r] levels
(EAGLE-2's reranking, `build_dynamic_trees`): top-k drafts are deterministic given the drafter,
so they need no q (one-hot q: exact). "Best" is by the draft's cumulative log-probability at the
drafter's tree temperature T (`SpeculativeConfig.tree_temperature`): a greedy request accepts a
node when it is the target's argmax, and a head trained on the target's temperature-1
distribution is right far more often than its probabilities say (the shipped EAGLE-3 head: its top
token is the target's 80% of the time, at a mean probability of 0.27), so EAGLE-2's plain ranking (T = 1)
undervalues the deep nodes of the likely path against shallow siblings. T is a calibration
(temperature scaling against the target's argmax, `bench.tree_ceiling --calibrate`, stored as
the drafter folder's tree_calibration.json); it moves which nodes are drafted, never what is
accepted. Sampled requests draw each node's children from q without
replacement and keep their first num_nodes[r] candidates in deviation order (the first-drawn
children's chain first, then paths with one later draw, ...) with no reranking by value
(`build_sampled_trees`: a reranking by value would bias the rejection sampler), each node with
the q it was drawn from (Draft.probs, node order).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from engine.penalties import Penalties
from engine.request import Request
from engine.sampler import draw_uniforms, inverse_cdf_sample, probs_from_logits
from engine.spec_decode.proposers.base import Draft
from engine.spec_decode.proposers.draft_vocab import DraftLMHead
from engine.spec_decode.tree import (
    DraftTree,
    TreeLevel,
    build_dynamic_trees,
    build_sampled_trees,
    expand_level,
    first_level,
    select_frontiers,
)

# a drafter folder's calibration of its greedy trees' ranking (`read_tree_temperature`)
CALIBRATION_FILE = "tree_calibration.json"

# (ids [n, k] target token ids, log-probabilities [n, k] float32, q rows [n, k, vocab] or None)
Children = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def read_tree_temperature(model_dir: str | None) -> float:
    """The greedy tree temperature a drafter folder ships (its tree_calibration.json's
    "greedy_temperature"), or 1.0 (EAGLE-2's ranking) where it ships none."""
    import json
    from pathlib import Path

    path = Path(model_dir) / CALIBRATION_FILE if model_dir else None
    if path is None or not path.is_file():
        return 1.0
    t = json.loads(path.read_text()).get("greedy_temperature")
    if not isinstance(t, (int, float)) or not 0 < t < float("inf"):
        raise ValueError(f"{path}: greedy_temperature must be a number > 0, got {t!r}")
    return float(t)


def tree_children(head: DraftLMHead, hidden: torch.Tensor, requests: list[Request],
                  uniforms: torch.Tensor | None, k: int, widths: list[int] | None = None,
                  temperature: float = 1.0, penalties: Penalties | None = None,
                  paths: list[list[int]] | None = None) -> Children:
    """k children of each row of hidden [n, H] (requests[i]: row i's), through `head` (over its
    draft vocabulary; ids come back as target token ids). widths[i] < k: row i's children past
    its first widths[i] get log-probability -inf (not drafted: no candidates). With `penalties`,
    the logits of row i are first processed as the target's row after the committed output and
    the tokens `paths[i]` (the node's path below the root: engine/penalties.py).

    Greedy rows: the draft's k most probable tokens, with their log-probabilities at
    `temperature` (the ranking: module docstring). Sampled rows:
    k draws without replacement from q, the draft's distribution filtered as the target's
    (temperature, top-k, top-p): child j from q without children 1..j-1, renormalized (the
    row given for it), by inverse CDF with uniforms[i, j] ([n, >= k] float32; None when every
    row is greedy); the log-probability is log q of the child; a child drawn after q ran
    out of tokens gets -inf (it is no candidate).
    """
    logits = head(hidden)  # [n, V'] float32 over the draft vocabulary
    if penalties is not None:
        penalties.apply_to_drafts(logits, requests, paths, head.token_ids)
    device = logits.device
    k = min(k, logits.shape[-1])
    lp, ids = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1).topk(k, dim=-1)
    q_rows = None
    greedy = [r.sampling_params.is_greedy for r in requests]
    if not all(greedy):
        params = [r.sampling_params for r in requests]
        q = probs_from_logits(
            logits,
            torch.tensor([max(p.temperature, 1e-5) for p in params], device=device),
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
        )  # [n, V']
        log_q = q.log()
        drawn_ids, drawn_lp, rows = [], [], []
        for j in range(k):
            mass = q.sum(dim=-1, keepdim=True)  # [n, 1]
            valid = mass.squeeze(1) > 0
            q_j = q / mass.clamp_min(1e-30)
            # (past a row's width: any token, masked to -inf below)
            token = inverse_cdf_sample(q_j, uniforms[:, j])
            drawn_ids.append(token)
            drawn_lp.append(log_q.gather(1, token.unsqueeze(1)).squeeze(1).masked_fill(~valid, float("-inf")))
            rows.append(q_j)
            q = q.scatter(1, token.unsqueeze(1), 0.0)
        sampled = ~torch.tensor(greedy, device=device).unsqueeze(1)  # [n, 1]
        ids = torch.where(sampled, torch.stack(drawn_ids, dim=1), ids)
        lp = torch.where(sampled, torch.stack(drawn_lp, dim=1), lp)
        q_rows = torch.stack(rows, dim=1)  # [n, k, V']
        if head.token_ids is not None:
            q_rows = q_rows.new_zeros(*q_rows.shape[:2], head.vocab_size).index_copy_(2, head.token_ids, q_rows)
    lp = lp.float()
    if widths is not None and min(widths) < k:
        past = torch.arange(k, device=device) >= torch.tensor(widths, device=device).unsqueeze(1)
        lp = lp.masked_fill(past, float("-inf"))
    return (ids if head.token_ids is None else head.token_ids[ids]), lp, q_rows


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the root's child down to `node` in an expanded tree (root: index 0)."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


class TreeUniforms:
    """The uniforms of a step's sampled trees, drawn up front: request r (sampled, width w,
    depth d) draws tree_uniform_count(w, d) from its generator (`draw_uniforms`: a seeded
    request's draws depend only on its seed and history), and its level's expanded nodes read
    them in a fixed order: level by level, and within a level, the child's rank j, then the node's
    place t among the c nodes the request expands there: child j of node t reads
    the level's offset + j * c + t, and the next level starts w * c later (the root's level: c =
    1). `cpu_kernels.draft_tree` reads them in the same order, so both draw the same trees.
    Example: w = 2, a root level then a level of 2 nodes: the root's children read 0, 1; node 0's
    children 2 and 4, node 1's 3 and 5."""

    def __init__(self, requests: list[Request], widths: list[int], depths: list[int],
                 generators: list[torch.Generator | None], device: torch.device) -> None:
        self.sampled = [not r.sampling_params.is_greedy for r in requests]
        self.widths = widths
        counts = [tree_uniform_count(w, d) if s else 0 for w, d, s in zip(widths, depths, self.sampled, strict=True)]
        self.flat = None
        if any(counts):  # (index 0: a zero for greedy rows and children past a width)
            self.flat = torch.cat([torch.zeros(1, device=device), draw_uniforms(counts, generators, device)])
        self.starts = [1 + sum(counts[:i]) for i in range(len(counts))]
        self.offsets = list(self.starts)  # where each request's next level starts
        self.device = device

    def by_request(self) -> torch.Tensor | None:
        """[R, max count] float32: each request's uniforms (zeros past its count), as
        `cpu_kernels.draft_tree` takes them; None when every request is greedy."""
        if self.flat is None:
            return None
        ends = self.starts[1:] + [self.flat.numel()]
        out = torch.zeros(len(self.starts), max(e - s for s, e in zip(self.starts, ends, strict=True)), device=self.device)
        for i, (s, e) in enumerate(zip(self.starts, ends, strict=True)):
            out[i, : e - s] = self.flat[s:e]
        return out

    def level(self, rows: list[int], k: int) -> torch.Tensor | None:
        """[len(rows), k] float32: the uniforms of the children of one level's expanded nodes
        (rows: each node's request, request by request), advancing each request's offset."""
        if self.flat is None:
            return None
        per = collections.Counter(rows)
        place: dict[int, int] = {}
        idx = []
        for i in rows:
            t = place[i] = place.get(i, -1) + 1
            c, s, w = per[i], self.offsets[i], self.widths[i]
            idx.extend(s + j * c + t if self.sampled[i] and j < w else 0 for j in range(k))
        for i, c in per.items():
            self.offsets[i] += self.widths[i] * c if self.sampled[i] else 0
        return self.flat[torch.tensor(idx, device=self.device)].view(len(rows), k)


def tree_uniform_count(width: int, depth: int) -> int:
    """Uniforms a sampled tree of `width` and `depth` levels may read (`TreeUniforms`): width
    for the root's children, width * width for each later level (at most width expanded nodes
    of width children)."""
    return width + (depth - 1) * width * width


def grow_trees(
    requests: list[Request],
    num_nodes: list[int],
    depths: list[int],
    widths: list[int],
    heads: DraftLMHead | list[DraftLMHead],
    root_hidden: torch.Tensor,
    generators: list[torch.Generator | None],
    run_level: Callable[[list[int], list[DraftTree], list[int]], torch.Tensor],
    temperature: float = 1.0,
    min_logprob: float = float("-inf"),
    penalties: Penalties | None = None,
) -> tuple[list[Draft], int]:
    """Draft one tree per request (module docstring); returns the drafts and the forwards run.

    widths[r]: request r's children per expanded node and nodes expanded per level (the adaptive
    policy's, `Speculator._tree_plan`; at most the proposer's tree_width). heads: the LM head
    that drafts the children of depth-d nodes is heads[min(d, len(heads) - 1)] (one head, or one
    per native MTP module). root_hidden [R, H]: what heads[0] reads after each root (its children
    come from `tree_children`). run_level(active, trees, counts): run the last counts[j] nodes of
    trees[j] (the tree of requests[active[j]]: its root and every node expanded so far, in
    expansion order; the new nodes all at one depth d) through the drafter and return what the
    depth-d head reads after each of them ([sum(counts), H], request by request). temperature:
    the greedy trees' ranking temperature (the drafter's `tree_temperature`); min_logprob: their
    floor (`build_dynamic_trees`; sampled trees take none: keeping a draw by its value would bias
    the rejection sampler); penalties: the runner's, each node's children drafted under them after
    its path (`tree_children`). depths[r] >= 1
    levels per request; the caller caps them by the scratch slots the request's blocks hold (the
    root and 1 + widths[r] * (depth - 1) expanded nodes' KV after it, at most: `scratch_depths`).

    Example, width 2, depth 3: the root's children are level 1 (2 candidates); run_level runs the
    2 best of them (tree: root + 2 nodes) -> level 2 (4 candidates); then the 2 best of those
    (tree: root + 4 nodes, 2 new) -> level 3. The greedy tree keeps the num_nodes best of all 8.
    A request of width 1 in the same batch drafts a chain: 1 candidate per level, 1 node run.
    """
    num_reqs = len(requests)
    heads = heads if isinstance(heads, list) else [heads]
    device = root_hidden.device
    draws = TreeUniforms(requests, widths, depths, generators, device)
    ids, lp, q_rows = tree_children(heads[0], root_hidden, requests, draws.level(list(range(num_reqs)), max(widths)),
                                    max(widths), widths, temperature, penalties, [[] for _ in requests])
    k = ids.shape[1]  # children per node: the widest request's (at most the draft vocabulary)
    width_t = torch.tensor(widths, device=device)
    levels = [first_level(ids, lp)]
    sampled_rows = torch.tensor([not r.sampling_params.is_greedy for r in requests], device=device)
    # per candidate: non-first draws on its path (sampled trees expand and keep by it)
    deviations = (torch.arange(k, device=device) > 0).long().expand(num_reqs, -1)
    level_q = [q_rows]  # per level: [R, C, vocab], or None when every request is greedy
    # per request: the expanded nodes so far (tokens, parents in that list; 0 = the root) and,
    # per level, candidate index -> its place in that list
    expanded = [([r.last_token_id], [-1]) for r in requests]
    place: list[list[dict[int, int]]] = [[] for _ in requests]
    num_forwards = 0
    for d in range(1, max(depths)):
        level = levels[-1]
        deep = torch.tensor([depth > d for depth in depths], device=device)
        frontier, run = select_frontiers(level, torch.where(deep, width_t, 0), deviations, sampled_rows)  # [R, F]
        f = frontier.shape[1]
        table = torch.stack([frontier, level.parent_ids.gather(1, frontier),
                             level.token_ids.gather(1, frontier), run.long()]).tolist()  # [4, R, F]
        active, trees, counts, slots = [], [], [], []  # slots: flat index r * F + j of each run node
        for i in range(num_reqs):
            tokens, parents = expanded[i]
            here = {}
            for j in range(f):
                if not table[3][i][j]:
                    continue
                parent = table[1][i][j]
                here[table[0][i][j]] = len(tokens)
                parents.append(0 if parent < 0 else place[i][-1][parent])
                tokens.append(table[2][i][j])
                slots.append(i * f + j)
            place[i].append(here)
            if here:
                active.append(i)
                counts.append(len(here))
                trees.append(DraftTree(tuple(tokens), tuple(parents), (0.0,) * len(tokens)))
        all_ids = torch.zeros(num_reqs * f, k, dtype=torch.long, device=device)
        all_lp = torch.full((num_reqs * f, k), float("-inf"), device=device)  # nodes not run: no children
        all_q = None
        if active:
            hidden = run_level(active, trees, counts)
            num_forwards += 1
            rows = [i for i, c in zip(active, counts, strict=True) for _ in range(c)]
            head = heads[min(d, len(heads) - 1)]
            paths = None
            if penalties is not None:  # each run node's tokens below the root, in run order
                paths = [_path(*expanded[i], node) for i in active for node in sorted(place[i][-1].values())]
            ids, lp, q_rows = tree_children(head, hidden, [requests[i] for i in rows], draws.level(rows, k),
                                            k, [widths[i] for i in rows], temperature, penalties, paths)
            at = torch.tensor(slots, device=device)
            all_ids.index_copy_(0, at, ids)
            all_lp.index_copy_(0, at, lp)
            if q_rows is not None:
                all_q = q_rows.new_zeros(num_reqs * f, k, q_rows.shape[-1]).index_copy_(0, at, q_rows)
        levels.append(expand_level(level, frontier, all_ids.view(num_reqs, f, k), all_lp.view(num_reqs, f, k)))
        deviations = (deviations.gather(1, frontier).unsqueeze(2)
                      + (torch.arange(k, device=device) > 0).long()).reshape(num_reqs, f * k)
        if level_q[0] is not None:
            vocab = level_q[0].shape[-1]
            level_q.append(all_q.view(num_reqs, f * k, vocab) if all_q is not None
                           else level_q[0].new_zeros(num_reqs, f * k, vocab))
        else:
            level_q.append(None)
    built: list[DraftTree | None] = [None] * num_reqs
    sampled = [not r.sampling_params.is_greedy for r in requests]
    for depth, is_sampled in sorted({(dd, s) for dd, s in zip(depths, sampled, strict=True)}):
        group = [i for i, (dd, s) in enumerate(zip(depths, sampled, strict=True)) if (dd, s) == (depth, is_sampled)]
        rows_t = torch.tensor(group, device=device)
        sliced = [TreeLevel(lv.parent_ids.index_select(0, rows_t), lv.token_ids.index_select(0, rows_t),
                            lv.cum_logprobs.index_select(0, rows_t)) for lv in levels[:depth]]
        roots, caps = [requests[i].last_token_id for i in group], [num_nodes[i] for i in group]
        made = build_sampled_trees(roots, sliced, caps) if is_sampled else build_dynamic_trees(roots, sliced, caps,
                                                                                              min_logprob)
        for i, tree in zip(group, made, strict=True):
            built[i] = tree
    probs: list[torch.Tensor | None] = [None] * num_reqs
    if any(sampled):
        # pool rows: level 0's candidates first, as `source_ids` index them
        pool_q = torch.cat(level_q, dim=1)  # [R, P, vocab]
        for i, tree in enumerate(built):
            if sampled[i] and tree.num_nodes > 1:
                probs[i] = pool_q[i].index_select(0, torch.tensor(tree.source_ids[1:], device=device))
    return [Draft(list(t.token_ids[1:]), q, t) for t, q in zip(built, probs, strict=True)], num_forwards


def scratch_depths(requests: list[Request], max_depths: list[int], widths: list[int], block_size: int,
                   root_offset: int = 1) -> list[int]:
    """max_depths capped so that the expanded nodes fit in the slots the requests' blocks hold
    after the root (at sequence index num_tokens - root_offset): 1 + widths[r] * (depth - 1)
    nodes in all, the root included."""
    return [
        max(1, min(d, 1 + (len(r.block_ids) * block_size - r.num_tokens + root_offset - 1) // w))
        for r, d, w in zip(requests, max_depths, widths, strict=True)
    ]


def tree_widths(widths: list[int] | None, num_requests: int, tree_width: int) -> list[int]:
    """Each request's tree width: the policy's (`Speculator._tree_plan`) capped by the drafter's
    configured tree_width, or tree_width for all when the caller gives none."""
    if widths is None:
        return [tree_width] * num_requests
    if len(widths) != num_requests or min(widths, default=1) < 1:
        raise ValueError(f"tree widths must be >= 1, one per request ({num_requests}), got {widths}")
    return [min(w, tree_width) for w in widths]


def sampling_rows(requests: list[Request]) -> torch.Tensor:
    """[R, 3] float32 (temperature, top_k, top_p) per request, as `cpu_kernels.draft_chain`,
    `draft_tree` and `stack_tree` take them: (0, 0, 1) for a greedy one."""
    return torch.tensor([[0.0, 0.0, 1.0] if r.sampling_params.is_greedy else
                         [max(r.sampling_params.temperature, 1e-5), r.sampling_params.top_k, r.sampling_params.top_p]
                         for r in requests], dtype=torch.float32)


def kernel_tree_args(requests: list[Request], depths: list[int], widths: list[int], num_nodes: list[int],
                     generators: list[torch.Generator | None]) -> tuple:
    """The arguments of the one-call tree kernels (`cpu_kernels.draft_tree`, `stack_tree`) beside
    the drafter's: (block tables [R, W], depths, widths, num_nodes [R] int64, sampling, uniforms:
    None for a step of greedy requests, else `sampling_rows` and the step's `TreeUniforms`)."""
    width = max(len(r.block_ids) for r in requests)
    tables = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in requests], dtype=torch.int64)
    sampling = uniforms = None
    if not all(r.sampling_params.is_greedy for r in requests):
        sampling = sampling_rows(requests)
        uniforms = TreeUniforms(requests, widths, depths, generators, torch.device("cpu")).by_request()
    sizes = [torch.tensor(v, dtype=torch.int64) for v in (depths, widths, num_nodes)]
    return tables, *sizes, sampling, uniforms


def kernel_tree_drafts(requests: list[Request], head: DraftLMHead, out: tuple) -> list[Draft]:
    """The drafts of a one-call tree kernel's output (tokens, parents, cum log-probs, counts,
    probs): each request's tree, and for a sampled one each node's q over the whole vocabulary
    (`DraftLMHead.to_vocab`)."""
    tokens, parents, cums, counts, q = out
    drafts = []
    for b, (t, p, c, n) in enumerate(zip(tokens.tolist(), parents.tolist(), cums.tolist(), counts.tolist(),
                                         strict=True)):
        tree = DraftTree(tuple(t[:n]), tuple(p[:n]), tuple(c[:n]))
        probs = None if requests[b].sampling_params.is_greedy or n == 1 else head.to_vocab(q[b, : n - 1])
        drafts.append(Draft(list(tree.token_ids[1:]), probs, tree))
    return drafts
