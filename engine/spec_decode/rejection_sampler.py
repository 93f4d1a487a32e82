"""Rejection sampling for speculative decoding: pure functions over flat tensors, batched over the
whole step (the only per-request tensor work is one draw per seeded request; one host sync, at
the end).

Chains (`rejection_sample`): greedy requests accept draft tokens while they equal the target's
argmax. Sampled requests follow Leviathan et al. / Chen et al.: draft token d at position i is
accepted with probability min(1, p_i(d) / q_i(d)); on the first rejection a token is drawn from
normalize(max(0, p_i - q_i)) and the rest are discarded; if all k drafts are accepted, a bonus
token is drawn from p_k. The result is distributed exactly as the target's own samples.

Layout: request r owns k_r draft rows (in `draft_token_ids`/`draft_probs`) and k_r + 1 target rows
(in `target_probs`/`target_argmax`), laid out request after request. Example: k = [2, 0, 3] ->
target rows [0,1,2 | 3 | 4,5,6,7], draft rows [0,1 | - | 2,3,4]; draft row j of request r is
target row j + r.

Trees (`tree_rejection_sample`): SpecInfer's multi-candidate rejection sampling; see there.

Random draws: a sampled request draws k + 1 uniforms (a tree: n + 1), in one call on its own
generator when it has one (so a seeded request's tokens do not depend on the batch); u[i] tests
draft i and u[k] picks the recovered/bonus token by inverse CDF. Greedy requests draw nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.sampler import draw_uniforms, inverse_cdf_sample


def rejection_sample(
    num_draft_tokens: list[int],
    draft_token_ids: torch.Tensor,
    target_argmax: torch.Tensor | None,
    target_probs: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    is_greedy: list[bool],
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    """Accepted draft tokens plus one recovered/bonus token, per request.

    num_draft_tokens: k_r per request. draft_token_ids [sum k] int64.
    target_argmax [sum (k+1)] int64 (needed when any request is greedy).
    target_probs [sum (k+1), vocab] float32 and draft_probs [sum k, vocab] float32 (needed when
    any request samples; rows of greedy requests are ignored). A draft that is deterministic
    (n-gram lookup) passes a one-hot row as its q.

    Each request's number of accepted drafts is the index of its first rejected draft (k when
    none is), one segmented min over the draft rows: scatter_reduce(amin) of "index if rejected
    else kmax", starting from k. Example: k = [3, 1], accepts [1, 0, 1 | 1] -> candidates
    [3, 1, 3 | 3] -> accepted [min(3, 3, 1, 3), min(1, 3)] = [1, 1].
    """
    num_reqs = len(num_draft_tokens)
    if num_reqs == 0:
        return []
    any_greedy, any_sampled = _step_kinds(is_greedy, target_argmax, target_probs)
    device = draft_token_ids.device
    num_drafts = sum(num_draft_tokens)
    if not any_sampled:  # all greedy: the same one host sync, then a walk over two short lists
        flat = torch.cat([draft_token_ids, target_argmax]).tolist()  # (cheaper than ten small tensor ops)
        out, d0, t0 = [], 0, num_drafts
        for n in num_draft_tokens:
            a = 0
            while a < n and flat[d0 + a] == flat[t0 + a]:
                a += 1
            out.append(flat[d0 : d0 + a] + [flat[t0 + a]])
            d0, t0 = d0 + n, t0 + n + 1
        return out
    if any_sampled and num_drafts and draft_probs is None:
        raise ValueError("draft_probs is needed when a sampled request has drafts")
    # index vectors, built on the host and moved in one transfer
    first_target = [0, *accumulate(n + 1 for n in num_draft_tokens)]
    owner = [r for r, n in enumerate(num_draft_tokens) for _ in range(n)]
    index = torch.tensor(
        [*num_draft_tokens, *first_target[:-1], *(t - r for r, t in enumerate(first_target[:-1])),
         *owner, *(j + r for j, r in enumerate(owner)), *(i for n in num_draft_tokens for i in range(n))],
        dtype=torch.long, device=device,
    )
    k, first_target_t, first_draft, owner_t, target_row, local = index.split([num_reqs] * 3 + [num_drafts] * 3)
    greedy = torch.tensor(is_greedy, dtype=torch.bool, device=device) if any_greedy and any_sampled else None
    if any_sampled:
        u = _draw_in_layout([n + 1 for n in num_draft_tokens], is_greedy, generators, device)  # [sum (k+1)]

    if num_drafts:
        if any_sampled:
            p_d = torch.take(target_probs, target_row * target_probs.shape[1] + draft_token_ids)  # [D]
            q_d = draft_probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)  # [D]
            accept = u.index_select(0, target_row) * q_d < p_d  # accept iff u < p/q (q > 0: d was drawn from q)
        if any_greedy:
            matches = draft_token_ids == target_argmax.index_select(0, target_row)
            accept = matches if greedy is None else torch.where(greedy.index_select(0, owner_t), matches, accept)
        candidates = local.masked_fill(accept, max(num_draft_tokens))  # [D]
        num_accepted = k.scatter_reduce(0, owner_t, candidates, "amin")  # [R]
    else:
        num_accepted = k

    final_row = first_target_t + num_accepted  # [R] target row of the recovered/bonus token
    final = target_argmax.index_select(0, final_row) if any_greedy else None
    if any_sampled:
        p = target_probs.index_select(0, final_row)  # [R, vocab]
        if num_drafts:
            # rejected at draft row first_draft + num_accepted: sample from the residual there
            q = draft_probs.index_select(0, (first_draft + num_accepted).clamp_(max=num_drafts - 1))  # [R, vocab]
            p = residual_distribution(p, q, num_accepted < k)
        sampled = inverse_cdf_sample(p, u.index_select(0, first_target_t + k))
        final = sampled if greedy is None else torch.where(greedy, final, sampled)
    flat = torch.cat([num_accepted, final, draft_token_ids]).tolist()  # the one host sync
    out, d0 = [], 2 * num_reqs
    for r, n in enumerate(num_draft_tokens):
        out.append(flat[d0 : d0 + flat[r]] + [flat[num_reqs + r]])
        d0 += n
    return out


def residual_distribution(p: torch.Tensor, q: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """normalize(max(0, p - q)) in the rows where `rows` [n] (bool) is True (all rows when None),
    p elsewhere; p, q [n, vocab]. A row where p == q leaves no mass (the rejection that leads
    here had probability 0) and gives p back."""
    residual = (p - q).clamp_min_(0.0)
    total = residual.sum(dim=-1, keepdim=True)  # [n, 1]
    use = total > 0 if rows is None else (total > 0) & rows.unsqueeze(1)
    return torch.where(use, residual.div_(total), p)


def _step_kinds(is_greedy: list[bool], target_argmax, target_probs) -> tuple[bool, bool]:
    """(any greedy request, any sampled request), once the target inputs they need are there."""
    any_greedy, any_sampled = any(is_greedy), not all(is_greedy)
    if any_greedy and target_argmax is None:
        raise ValueError("target_argmax is needed when any request is greedy")
    if any_sampled and target_probs is None:
        raise ValueError("target_probs is needed when any request samples")
    return any_greedy, any_sampled


@dataclass(frozen=True)
class VerifiedPath:
    """One request's verified tree: the accepted draft nodes (root's child first, node indices
    of the request's tree) and the tokens to commit: theirs, then the recovered/bonus token."""

    node_ids: list[int]
    token_ids: list[int]


def tree_rejection_sample(
    num_nodes: list[int],
    parent_ids: list[int],
    node_token_ids: torch.Tensor,
    target_argmax: torch.Tensor | None,
    target_probs: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    is_greedy: list[bool],
    generators: list[torch.Generator | None],
    host_walk: bool | None = None,
) -> list[VerifiedPath]:
    """Walk each request's token tree from its root, accepting one child per level.

    num_nodes: n_r + 1 per request (root included). parent_ids [sum num_nodes] (host list):
    each node's parent as an index within its request's tree (-1 at the root, node 0; parents
    before children, as `DraftTree`). node_token_ids [sum num_nodes] int64 (root entries unused).
    target_argmax [sum num_nodes] / target_probs [sum num_nodes, vocab]: the target after each
    node's path (node layout, request after request, like chain target rows). draft_probs
    [sum num_nodes, vocab]: row i is the distribution node i was drawn from (root rows unused),
    or None for deterministic drafts (EAGLE-2's top-k: q is one-hot at the node's token).

    Greedy: at each node, accept the first child whose token is the target's argmax; the final
    token is the argmax at the last accepted node. Sampled (SpecInfer, Miao et al. 2023, Alg. 2;
    Sequoia for drafts without replacement): at node v with target residual p (first p_v), try
    the children c_1..c_m in index order: accept c_j with probability min(1, p(c_j) / q_j(c_j));
    on rejection p <- normalize(max(0, p - q_j)). The first accepted child becomes v (p <- its
    p_v); if all are rejected (or v is a leaf) the final token is drawn from p. This is exactly
    the target's distribution whenever each child c_j was drawn from the q_j given for it, which
    may depend on its earlier siblings: i.i.d. children of one q (SpecInfer: each row = q), or
    children drawn without replacement (Sequoia: q_j = q with c_1..c_{j-1} removed,
    renormalized), or deterministic distinct children (q_j one-hot: p <- p without c_j).

    Random draws: request r draws num_nodes[r] uniforms in one call (its generator's, if any):
    node i >= 1 is tested with u[i - 1] and the final token uses u[n_r], so a chain tree with
    draft_probs consumes and uses them exactly as `rejection_sample` does: same tokens.

    Batched: one round per depth over all requests at once. Greedy and deterministic drafts test
    all children of the current nodes together: with one-hot q the residual after rejecting
    c_1..c_{j-1} is p without them, so c_j is accepted iff u_j * (P - S_j) < p(c_j), where P is
    p's mass and S_j the mass of the distinct earlier siblings (a repeated token has mass 0).
    Example: p = [.5, .3, .2], children tokens (0, 2), u = (.6, .5): child 1 rejected (.6 > .5),
    child 2: .5 * (1 - .5) = .25 > .2 rejected; final token from [0, 1, 0]. Drafts with a
    distribution try the children one after the other (the residual is not linear in q).
    One host sync at the end. On the CPU (host_walk None), or with host_walk=True: the same walk
    on the host, request by request (`_walk_host`: the same outputs; the per-depth tensor ops
    cost more than the walk there).
    """
    num_reqs = len(num_nodes)
    if num_reqs == 0:
        return []
    any_greedy, any_sampled = _step_kinds(is_greedy, target_argmax, target_probs)
    device = node_token_ids.device
    total = sum(num_nodes)
    if len(parent_ids) != total or node_token_ids.shape[0] != total:
        raise ValueError(f"parent_ids ({len(parent_ids)}) and node_token_ids ({node_token_ids.shape[0]}) "
                         f"need sum(num_nodes)={total} entries")
    if host_walk if host_walk is not None else device.type == "cpu":
        return _walk_host(num_nodes, parent_ids, node_token_ids, target_argmax, target_probs, draft_probs, is_greedy,
                          generators)
    children, widths = _children_table(num_nodes, parent_ids)  # [total, M] global ids (-1: none)
    children = children.to(device)
    starts = torch.tensor([0, *accumulate(num_nodes)][:-1], dtype=torch.long, device=device)  # [R] root ids
    greedy = torch.tensor(is_greedy, dtype=torch.bool, device=device) if any_greedy and any_sampled else None

    cur = starts  # [R] global id of each request's current node
    alive = torch.ones(num_reqs, dtype=torch.bool, device=device)
    path = torch.full((num_reqs, max(len(widths), 1)), -1, dtype=torch.long, device=device)  # [R, depth]
    if any_sampled:
        u = _draw_in_layout(num_nodes, is_greedy, generators, device)  # [total]
        # node g (global id) is tested with u[g - 1]; request r's last draw, at the next root's
        # id - 1, picks its final token
        u_final = u.index_select(0, starts + torch.tensor(num_nodes, device=device) - 1)  # [R]
        p = target_probs.index_select(0, cur)  # [R, vocab] the target residual at the current node
    for depth, width in enumerate(widths):
        kids = children.index_select(0, cur)[:, :width]  # [R, W] (W: most children of a depth-d node)
        valid = (kids >= 0) & alive.unsqueeze(1)
        kids = kids.clamp_min(0)
        tokens = node_token_ids[kids]  # [R, W]
        if any_sampled:
            u_kids = u[kids - 1]  # [R, W]
            if draft_probs is None:
                accept, rejected_p = _try_deterministic(p, tokens, valid, u_kids)
            else:
                accept, rejected_p = _try_in_turn(p, draft_probs, kids, tokens, valid, u_kids)
        if any_greedy:
            matches = tokens == target_argmax.index_select(0, cur).unsqueeze(1)
            accept = matches if greedy is None else torch.where(greedy.unsqueeze(1), matches, accept)
        accept &= valid
        any_accepted = accept.any(dim=1)  # [R]
        first = accept.long().argmax(dim=1, keepdim=True)  # [R, 1] the first accepted child
        cur = torch.where(any_accepted, kids.gather(1, first).squeeze(1), cur)
        path[:, depth] = torch.where(any_accepted, cur - starts, -1)
        alive &= any_accepted
        if any_sampled:
            p = torch.where(any_accepted.unsqueeze(1), target_probs.index_select(0, cur), rejected_p)

    final = target_argmax.index_select(0, cur) if any_greedy else None
    if any_sampled:
        sampled = inverse_cdf_sample(p, u_final)
        final = sampled if greedy is None else torch.where(greedy, final, sampled)
    path_tokens = node_token_ids[(path + starts.unsqueeze(1)).clamp(min=0, max=total - 1)]  # [R, depth]
    table = torch.cat([path, path_tokens, final.unsqueeze(1)], dim=1).tolist()  # the one host sync
    depth = path.shape[1]
    out = []
    for row in table:
        n = next((d for d in range(depth) if row[d] < 0), depth)
        out.append(VerifiedPath(row[:n], row[depth : depth + n] + [row[-1]]))
    return out


def _walk_host(num_nodes: list[int], parent_ids: list[int], node_token_ids: torch.Tensor,
               target_argmax: torch.Tensor | None, target_probs: torch.Tensor | None,
               draft_probs: torch.Tensor | None, is_greedy: list[bool],
               generators: list[torch.Generator | None]) -> list[VerifiedPath]:
    """`tree_rejection_sample` walked on the host (CPU tensors), request by request, after one
    sync of the tokens and argmaxes: the same walk, the same uniforms, the same float32
    arithmetic. Greedy: the first child (index order) whose token is the target's argmax at the
    current node, until none is, then the argmax there. Sampled: each child's test u * q(c) < p(c)
    on float32 scalars (as the tensor walk's float32 products), the residual after a rejection
    and the final draw by the tensor walk's own functions on the request's one row
    (`residual_distribution`, `inverse_cdf_sample`; deterministic drafts: `_try_deterministic`),
    so the outputs are the tensor walk's (tested); what it saves is the per-depth tensor ops over
    the whole batch (~20 a depth). Trees are
    checked as `_children_table` checks them."""
    rows = [node_token_ids] + ([target_argmax.to(node_token_ids.dtype)] if target_argmax is not None else [])
    flat = torch.stack(rows).tolist()
    tokens, argmax = flat[0], (flat[1] if target_argmax is not None else None)
    sampled = not all(is_greedy)
    if sampled:
        u_t = _draw_in_layout(num_nodes, is_greedy, generators, node_token_ids.device)
        u, p_np = u_t.numpy(), target_probs.numpy()
        q_np = None if draft_probs is None else draft_probs.numpy()
    out, start = [], 0
    for r, n in enumerate(num_nodes):
        if n < 1:
            raise ValueError(f"every tree has at least its root: num_nodes must be >= 1, got {n}")
        parents = parent_ids[start : start + n]
        if parents[0] != -1:
            raise ValueError(f"node {start} is a root: its parent must be -1, got {parents[0]}")
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise ValueError(f"node {i} of the tree at {start}: parent must be in [0, {i - 1}], got {parents[i]}")
            children[parents[i]].append(i)
        cur, path = 0, []
        if is_greedy[r]:
            while True:
                want = argmax[start + cur]
                nxt = next((c for c in children[cur] if tokens[start + c] == want), None)
                if nxt is None:
                    break
                path.append(nxt)
                cur = nxt
            final = argmax[start + cur]
        else:
            p = None  # the residual at the current node (None: its target row, untouched)
            while children[cur]:
                kids = children[cur]
                nxt = None
                if q_np is None:  # one-hot q: every child together, as the tensor walk
                    row = target_probs[start + cur : start + cur + 1] if p is None else p
                    g = [start + c for c in kids]
                    accept, p = _try_deterministic(row, torch.tensor([[tokens[i] for i in g]]),
                                                   torch.ones(1, len(g), dtype=torch.bool), u_t[[i - 1 for i in g]][None])
                    hit = accept[0].tolist()
                    nxt = next((c for c, a in zip(kids, hit, strict=True) if a), None)
                else:
                    for c in kids:
                        tok, g = tokens[start + c], start + c
                        p_tok = p_np[start + cur, tok] if p is None else p[0, tok].item()
                        if u[g - 1] * q_np[g, tok] < p_tok:  # float32 * float32, compared in float32
                            nxt = c
                            break
                        row = target_probs[start + cur : start + cur + 1] if p is None else p
                        p = residual_distribution(row, draft_probs[g : g + 1])
                if nxt is None:
                    break
                path.append(nxt)
                cur, p = nxt, None
            row = target_probs[start + cur : start + cur + 1] if p is None else p
            final = int(inverse_cdf_sample(row, u_t[start + n - 1 : start + n])[0])
        out.append(VerifiedPath(path, [tokens[start + c] for c in path] + [final]))
        start += n
    return out


def _try_deterministic(p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                       u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Children with one-hot q, all at once: (accept [R, W], the residual [R, vocab] after
    rejecting every valid child). p [R, vocab]; tokens, valid, u [R, W]."""
    width = tokens.shape[1]
    earlier = torch.ones(width, width, dtype=torch.bool, device=p.device).tril_(-1)  # [j, i]: i < j
    repeated = ((tokens.unsqueeze(2) == tokens.unsqueeze(1)) & earlier & valid.unsqueeze(1)).any(dim=2)  # [R, W]
    mass = p.gather(1, tokens).masked_fill_(repeated | ~valid, 0.0)  # [R, W]
    before = mass.cumsum(dim=1) - mass  # [R, W] S_j
    accept = u * (p.sum(dim=1, keepdim=True) - before) < mass
    removed = torch.zeros_like(p).scatter_add_(1, tokens, valid.to(p.dtype)) > 0  # [R, vocab]
    return accept, residual_distribution(p, p * removed, valid.any(dim=1))


def _try_in_turn(p: torch.Tensor, draft_probs: torch.Tensor, kids: torch.Tensor, tokens: torch.Tensor,
                 valid: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Children with their own q rows, one after the other: (accept [R, W] (True at most at the
    first accepted child), the residual [R, vocab] once every tried child was rejected)."""
    accept = torch.zeros_like(valid)
    for j in range(tokens.shape[1]):
        trying = valid[:, j] & ~accept.any(dim=1)  # [R]
        q = draft_probs.index_select(0, kids[:, j])  # [R, vocab]
        tok = tokens[:, j : j + 1]  # [R, 1]
        ok = u[:, j] * q.gather(1, tok).squeeze(1) < p.gather(1, tok).squeeze(1)
        accept[:, j] = ok & trying
        p = residual_distribution(p, q, trying & ~ok)
    return accept, p


def _draw_in_layout(counts: list[int], is_greedy: list[bool], generators: list[torch.Generator | None],
                    device: torch.device) -> torch.Tensor:
    """[sum counts] uniforms, counts[r] at request r's rows; greedy requests draw nothing (their
    rows hold 0). Example: counts [2, 1], is_greedy [True, False] -> [0, 0, u]."""
    drawn = draw_uniforms([0 if g else c for c, g in zip(counts, is_greedy, strict=True)], generators, device)
    if not any(is_greedy):
        return drawn
    starts = [0, *accumulate(counts)]
    rows = [i for r, g in enumerate(is_greedy) if not g for i in range(starts[r], starts[r + 1])]
    return torch.zeros(starts[-1], device=device).index_copy_(0, torch.tensor(rows, device=device), drawn)


def _children_table(num_nodes: list[int], parent_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """([sum num_nodes, max children] int64 global child ids in index order, -1 padded; per depth
    d, the most children a depth-d node has, up to the deepest parent), on the CPU. Example:
    num_nodes [4], parents [-1, 0, 0, 1] -> [[1, 2], [3, -1], [-1, -1], [-1, -1]], widths [2, 1].
    """
    if min(num_nodes) < 1:
        raise ValueError(f"every tree has at least its root: num_nodes must be >= 1, got {min(num_nodes)}")
    total = len(parent_ids)
    local = torch.tensor(parent_ids, dtype=torch.long)  # [total]
    sizes = torch.tensor(num_nodes, dtype=torch.long)
    start = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)  # [total] each node's root id
    index = torch.arange(total) - start  # [total] index within the tree
    bad = torch.nonzero(torch.where(index == 0, local != -1, (local < 0) | (local >= index))).flatten()
    if bad.numel():
        g = int(bad[0])
        if index[g] == 0:
            raise ValueError(f"node {g} is a root: its parent must be -1, got {parent_ids[g]}")
        raise ValueError(f"node {int(index[g])} of the tree at {int(start[g])}: parent must be in "
                         f"[0, {int(index[g]) - 1}], got {parent_ids[g]}")
    is_child = index > 0
    child = torch.nonzero(is_child).flatten()  # [C] in index order
    parent = (local + start)[child]  # [C] global parent ids
    depth = torch.zeros(total, dtype=torch.long)
    while True:  # parents come first: depth settles after (max depth) passes
        new = torch.zeros_like(depth).index_copy_(0, child, depth[parent] + 1)
        if torch.equal(new, depth):
            break
        depth = new
    counts = torch.bincount(parent, minlength=total)  # [total] children per node
    width = max(1, int(counts.max()))
    order = torch.sort(parent, stable=True).indices  # children grouped by parent, index order kept
    rank = torch.empty_like(order)
    rank[order] = torch.arange(child.numel()) - (torch.cumsum(counts, 0) - counts)[parent[order]]
    table = torch.full((total, width), -1, dtype=torch.long)
    table[parent, rank] = child
    widths = torch.zeros(int(depth.max()), dtype=torch.long)
    widths.scatter_reduce_(0, depth[counts > 0], counts[counts > 0], "amax")
    return table, widths.tolist()
