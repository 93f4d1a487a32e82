"""Tree speculation foundations: token trees, EAGLE-2 dynamic construction, the multi-candidate
rejection sampler (greedy walk, chains, exact target distribution), tree-mask attention in the
torch backend and the Triton kernel (interpreter, in a subprocess as in test_kernels.py).
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import Case, make_case, run_triton_interpreter
from test_rejection_batched import _extend_and_count, generators_for, random_step
from test_speculative import _chi_square_p_value

import engine.spec_decode.rejection_sampler as rs
from engine.spec_decode.rejection_sampler import rejection_sample, tree_rejection_sample
from engine.spec_decode.tree import (
    DraftTree,
    TreeLevel,
    accepted_kv_moves,
    build_dynamic_trees,
    chain_tree,
    expand_level,
    first_level,
    move_kv,
    select_frontier,
    tree_attention_mask,
    tree_positions,
)
from kernels import get_attention_backend, triton_available


def random_tree(rng: random.Random, num_nodes: int, vocab: int = 50) -> DraftTree:
    """Random parents (each node under an earlier one), random tokens."""
    parents = [-1] + [rng.randrange(i) for i in range(1, num_nodes)]
    return DraftTree(tuple(rng.randrange(vocab) for _ in range(num_nodes)), tuple(parents), (0.0,) * num_nodes)


# --- trees, masks, positions, KV moves ---------------------------------------------------------


def test_tree_structure_and_mask():
    tree = DraftTree((5, 6, 7, 8), (-1, 0, 0, 1), (0.0, -0.1, -0.5, -0.7))
    assert tree.depths == (0, 1, 1, 2) and tree.children == ((1, 2), (3,), (), ())
    assert tree.path_to(3) == [1, 3] and tree.path_to(0) == []
    assert tree_attention_mask(tree).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree_positions(tree, 10) == [10, 11, 11, 12]
    chain = chain_tree(4, [9, 9, 2])
    assert chain.parents == (-1, 0, 1, 2) and chain.token_ids == (4, 9, 9, 2)
    assert torch.equal(tree_attention_mask(chain), torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="parent must be"):
        DraftTree((1, 2, 3), (-1, 2, 0), (0.0,) * 3)
    with pytest.raises(ValueError, match="root"):
        DraftTree((1, 2), (0, 0), (0.0,) * 2)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40))
def test_mask_rows_are_ancestors_and_self(seed, n):
    tree = random_tree(random.Random(seed), n)
    mask = tree_attention_mask(tree)
    for i in range(n):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == {0, *tree.path_to(i)}


def test_accepted_kv_moves_example():
    assert accepted_kv_moves([2, 5], 10, [0, 1, 2, 3], 4) == ([12, 15], [11, 12])
    assert accepted_kv_moves([1, 2, 3], 10, [0, 1, 2, 3], 4) == ([], [])  # a chain needs no moves
    assert accepted_kv_moves([3], 6, [7, 2, 9], 4) == ([9 * 4 + 1], [2 * 4 + 3])  # index 9 -> 7


@pytest.mark.parametrize("kernel", [True, False])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 30), root=st.integers(0, 20), block_size=st.sampled_from([1, 4, 16]))
def test_move_kv_commits_the_accepted_path(kernel, seed, n, root, block_size):
    """Node i's KV sits at sequence index root + i; after the moves, index root + j holds the
    path's depth-j node, for every layer and for K and V; through the CPU kernel's one call
    (`cpu_kernels.move_slots`) and through torch's copies."""
    from unittest import mock

    from kernels import cpu_kernels

    if kernel and not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    rng = random.Random(seed)
    tree = random_tree(rng, n)
    path, node = [], 0
    while tree.children[node] and rng.random() < 0.8:
        node = rng.choice(tree.children[node])
        path.append(node)
    num_blocks = -(-(root + n) // block_size) + 2
    table = rng.sample(range(num_blocks), num_blocks)
    caches = [(torch.full((num_blocks, block_size, 1, 2), -1.0), torch.full((num_blocks, block_size, 1, 2), -1.0))
              for _ in range(2)]
    slot = [table[p // block_size] * block_size + p % block_size for p in range(root + n)]
    for layer, (k, v) in enumerate(caches):
        for i in range(n):
            k.view(-1, 1, 2)[slot[root + i]] = i + 100 * layer
            v.view(-1, 1, 2)[slot[root + i]] = -i - 100 * layer
    with mock.patch.object(cpu_kernels, "available", return_value=kernel):
        move_kv(caches, *accepted_kv_moves(path, root, table, block_size))
    for layer, (k, v) in enumerate(caches):
        for j, node in enumerate([0, *path]):
            assert (k.view(-1, 1, 2)[slot[root + j]] == node + 100 * layer).all()
            assert (v.view(-1, 1, 2)[slot[root + j]] == -node - 100 * layer).all()


# --- EAGLE-2 dynamic trees ----------------------------------------------------------------------


def test_sampled_rows_expand_the_first_draws_first():
    """select_frontier: greedy rows by cumulative log-probability; sampled rows by fewest non-first
    draws, then log-probability (an undrawn -inf candidate last of all: it takes no finite one's
    place, even one of more deviations)."""
    level = TreeLevel(torch.tensor([[-1, -1, -1]] * 2), torch.tensor([[4, 5, 6]] * 2),
                      torch.tensor([[-0.1, -2.0, -0.5], [-0.1, float("-inf"), -0.5]]))
    deviations = torch.tensor([[1, 0, 1], [1, 0, 1]])
    assert select_frontier(level, 1).tolist() == [[0], [0]]
    assert select_frontier(level, 1, deviations, torch.tensor([True, False])).tolist() == [[1], [0]]
    assert select_frontier(level, 2, deviations, torch.tensor([True, True])).tolist() == [[0, 1], [0, 2]]


def test_dynamic_tree_docstring_example():
    level0 = first_level(torch.tensor([[7, 8]]), torch.tensor([[-0.1, -2.0]]))
    frontier = select_frontier(level0, 1)
    assert frontier.tolist() == [[0]]
    level1 = expand_level(level0, frontier, torch.tensor([[[9, 4]]]), torch.tensor([[[-0.4, -2.9]]]))
    (tree,) = build_dynamic_trees([3], [level0, level1], [3])
    assert tree.token_ids == (3, 7, 8, 9) and tree.parents == (-1, 0, 0, 1) and tree.source_ids == (-1, 0, 1, 2)
    assert tree.cum_logprobs == pytest.approx((0.0, -0.1, -2.0, -0.5))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), num_reqs=st.integers(1, 3), top_k=st.integers(1, 4), width=st.integers(1, 4),
       depth=st.integers(1, 4), vocab=st.integers(4, 12), ties=st.booleans(),
       floor=st.sampled_from([None, -0.5, -1.5, -3.0]))
def test_dynamic_trees_keep_the_most_probable_nodes(seed, num_reqs, top_k, width, depth, vocab, ties, floor):
    """Against a brute-force ranking of the whole candidate pool: per request the kept nodes are
    exactly the num_nodes best by cumulative log-prob (ties: earlier in the pool) of those at or
    above the floor (`min_logprob`, when given), they form a valid tree whose parents and
    cumulative log-probs are the pool's, and the tree has that many nodes + 1. `ties` rounds
    log-probs so that many are equal (even 0)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    top_k = min(top_k, vocab)

    def topk(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.randn(num_reqs, n, vocab, generator=gen).log_softmax(-1)
        if ties:
            logp = (logp * 2).round() / 2
        lp, ids = logp.topk(top_k, dim=-1)
        return ids, lp

    ids, lp = topk(1)
    levels = [first_level(ids[:, 0], lp[:, 0])]
    for _ in range(depth - 1):
        frontier = select_frontier(levels[-1], width)
        ids, lp = topk(frontier.shape[1])
        levels.append(expand_level(levels[-1], frontier, ids, lp))
    num_nodes = [rng.randint(1, 20) for _ in range(num_reqs)]
    roots = [rng.randrange(vocab) for _ in range(num_reqs)]
    trees = (build_dynamic_trees(roots, levels, num_nodes) if floor is None
             else build_dynamic_trees(roots, levels, num_nodes, min_logprob=floor))

    for r, tree in enumerate(trees):
        pool, level_start = [], [0]  # pool: (cum, token, parent's pool id, depth)
        for d, lv in enumerate(levels):
            level_start.append(level_start[-1] + lv.token_ids.shape[1])
            for c in range(lv.token_ids.shape[1]):
                parent = -1 if d == 0 else level_start[d - 1] + int(lv.parent_ids[r, c])
                pool.append((float(lv.cum_logprobs[r, c]), int(lv.token_ids[r, c]), parent, d + 1))
        above = [i for i in range(len(pool)) if floor is None or pool[i][0] >= floor]
        best = sorted(above, key=lambda i: (-pool[i][0], i))[: num_nodes[r]]
        assert tree.num_nodes == len(best) + 1
        assert tree.token_ids[0] == roots[r]
        assert sorted(tree.source_ids[1:]) == sorted(best)
        node_of = {src: i for i, src in enumerate(tree.source_ids)}
        for i in range(1, tree.num_nodes):
            cum, token, parent, d = pool[tree.source_ids[i]]
            assert tree.token_ids[i] == token and tree.depths[i] == d
            assert tree.parents[i] == node_of[parent]  # the parent was kept (-1 -> the root)
            assert tree.cum_logprobs[i] == pytest.approx(cum)
            assert cum <= tree.cum_logprobs[tree.parents[i]] + 1e-6


# --- tree rejection sampling --------------------------------------------------------------------


def greedy_walk(tree: DraftTree, argmax: list[int]) -> tuple[list[int], list[int]]:
    """Reference: follow the first child whose token is the target's argmax."""
    node, nodes = 0, []
    while True:
        nxt = next((c for c in tree.children[node] if tree.token_ids[c] == argmax[node]), None)
        if nxt is None:
            return nodes, [tree.token_ids[i] for i in nodes] + [argmax[node]]
        nodes.append(nxt)
        node = nxt


def flatten(trees: list[DraftTree]) -> tuple[list[int], list[int], torch.Tensor]:
    return ([t.num_nodes for t in trees], [p for t in trees for p in t.parents],
            torch.tensor([x for t in trees for x in t.token_ids]))


@pytest.mark.parametrize("host_walk", [False, True])
def test_greedy_walks_the_tree_by_argmax(host_walk):
    """Both greedy walks (the batched tensor one a GPU takes, the host one a CPU step takes)
    against the reference walk."""
    rng = random.Random(0)
    for _ in range(100):
        vocab = rng.randint(2, 6)  # small: many children match the argmax
        trees = [random_tree(rng, rng.randint(1, 12), vocab) for _ in range(rng.randint(1, 5))]
        num_nodes, parents, tokens = flatten(trees)
        argmax = torch.randint(0, vocab, (sum(num_nodes),))
        out = tree_rejection_sample(num_nodes, parents, tokens, argmax, None, None, [True] * len(trees),
                                    [None] * len(trees), host_walk=host_walk)
        start = 0
        for tree, acc in zip(trees, out, strict=True):
            nodes, toks = greedy_walk(tree, argmax[start : start + tree.num_nodes].tolist())
            assert (acc.node_ids, acc.token_ids) == (nodes, toks)
            start += tree.num_nodes


def chain_inputs(ks, drafts, target, draft):
    """The chain step of `random_step` as trees: node rows = target rows; q rows shifted by one."""
    parents = [p for k in ks for p in range(-1, k)]
    tokens, q, d0 = [], torch.zeros(target.shape), 0
    for r, k in enumerate(ks):
        tokens += [0, *drafts[d0 : d0 + k].tolist()]
        if k:
            q[d0 + r + 1 : d0 + r + 1 + k] = draft[d0 : d0 + k]
        d0 += k
    return [k + 1 for k in ks], parents, torch.tensor(tokens), q


@pytest.mark.parametrize("host_walk", [False, True])
def test_chains_as_trees_match_the_chain_sampler(host_walk):
    """With the same seeds, chains given as trees (q rows per node) get the very tokens of
    `rejection_sample`, in mixed greedy/sampled batches, through both walks."""
    rng = random.Random(2)
    for _ in range(60):
        ks, drafts, argmax, target, draft, greedy, seeds = random_step(rng, vocab=30)
        expected = rejection_sample(ks, drafts, argmax, target, draft, greedy, generators_for(seeds))
        num_nodes, parents, tokens, q = chain_inputs(ks, drafts, target, draft)
        out = tree_rejection_sample(num_nodes, parents, tokens, argmax, target, q, greedy, generators_for(seeds),
                                    host_walk=host_walk)
        assert [a.token_ids for a in out] == expected
        assert all(a.node_ids == list(range(1, len(a.token_ids))) for a in out)


@pytest.mark.parametrize("host_walk", [False, True])
def test_seeded_tree_request_does_not_depend_on_the_batch(host_walk):
    rng = random.Random(4)
    vocab = 6
    trees = [random_tree(rng, rng.randint(1, 10), vocab) for _ in range(6)]
    num_nodes, parents, tokens = flatten(trees)
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(sum(num_nodes), vocab, generator=gen).softmax(-1)
    draft = torch.randn(sum(num_nodes), vocab, generator=gen).softmax(-1)
    greedy = [False, True, False, False, True, False]
    for q in (draft, None):
        together = tree_rejection_sample(num_nodes, parents, tokens, target.argmax(-1), target, q, greedy,
                                         [torch.Generator().manual_seed(s) for s in range(6)], host_walk=host_walk)
        start = 0
        for r, tree in enumerate(trees):
            rows = slice(start, start + tree.num_nodes)
            alone = tree_rejection_sample([tree.num_nodes], list(tree.parents), tokens[rows], target[rows].argmax(-1),
                                          target[rows], None if q is None else q[rows], [greedy[r]],
                                          [torch.Generator().manual_seed(r)], host_walk=host_walk)
            assert alone == [together[r]]
            start += tree.num_nodes


def test_host_walk_equals_the_tensor_walk():
    """The host walk a CPU step takes and the batched tensor walk a GPU takes give the same
    outputs from the same seeds: random trees (repeated tokens among siblings included) in mixed
    greedy / sampled batches, children with their own q rows and one-hot (deterministic) ones."""
    rng = random.Random(7)
    compared = sampled_paths = 0
    for _ in range(80):
        vocab = rng.randint(3, 8)
        trees = [random_tree(rng, rng.randint(1, 14), vocab) for _ in range(rng.randint(1, 6))]
        num_nodes, parents, tokens = flatten(trees)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        target = torch.randn(sum(num_nodes), vocab, generator=gen).mul(2).softmax(-1)
        draft = torch.randn(sum(num_nodes), vocab, generator=gen).mul(2).softmax(-1)
        greedy = [rng.random() < 0.3 for _ in trees]
        seeds = [rng.randrange(1000) for _ in trees]
        for q in (draft, None):
            walks = [tree_rejection_sample(num_nodes, parents, tokens, target.argmax(-1), target, q, greedy,
                                           generators_for(seeds), host_walk=host) for host in (False, True)]
            assert walks[0] == walks[1]
            compared += len(trees)
            sampled_paths += sum(len(a.node_ids) for a, g in zip(walks[0], greedy, strict=True) if not g)
    assert compared > 300 and sampled_paths > 100  # sampled walks that accepted nodes were compared


VOCAB, M1, M2, NUM_SAMPLES = 4, 3, 2, 20000


def draft_children(q: torch.Tensor, m: int, scheme: str, gen: torch.Generator):
    """m children per row of q [N, V]: tokens [N, m] and the q each was drawn from [N, m, V]
    (None for "top-k": deterministic). "iid": with replacement; "without": without replacement
    (child j's q is q without children 0..j-1, renormalized); "top-k": the m most probable."""
    if scheme == "top-k":
        return q.topk(m, dim=-1).indices, None
    tokens = torch.multinomial(q, m, replacement=scheme == "iid", generator=gen)
    rows = q.unsqueeze(1).repeat(1, m, 1)  # [N, m, V]
    if scheme == "without":
        for j in range(1, m):
            rows[:, j].scatter_(1, tokens[:, :j], 0.0)
        rows = rows / rows.sum(-1, keepdim=True)
    return tokens, rows


def tree_sampler_p_value(scheme: str, seed: int = 0, host_walk: bool | None = None) -> float:
    """NUM_SAMPLES requests, each a fresh 2-level tree (M1 children of the root, M2 under each)
    drafted from q by `scheme` over a VOCAB-token vocabulary, verified in one call, unseeded.
    The committed tokens, completed to 3 with exact target samples, against the exact joint
    target distribution p1(x1) p2(x2 | x1) p3(x3 | x1, x2) over 4^3 = 64 cells: the chi-square
    p-value (small cells pooled, as in test_speculative)."""
    n, v = NUM_SAMPLES, VOCAB
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    p1, p2, p3 = (torch.randn(*[v] * d, generator=gen).mul(1.5).softmax(-1) for d in (1, 2, 3))
    q1, q2 = (torch.randn(*[v] * d, generator=gen).softmax(-1) for d in (1, 2))
    x1, q_x1 = draft_children(q1.expand(n, v), M1, scheme, gen)  # [n, M1]
    x2, q_x2 = draft_children(q2[x1.reshape(-1)], M2, scheme, gen)  # [n * M1, M2]
    x2 = x2.view(n, M1 * M2)
    parent_tok = x1.repeat_interleave(M2, dim=1)  # [n, M1 * M2] each depth-2 node's parent token
    nodes = 1 + M1 + M1 * M2
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), x1, x2], dim=1).reshape(-1)
    target = torch.cat([p1.expand(n, 1, v), p2[x1], p3[parent_tok, x2]], dim=1).reshape(-1, v)
    draft = None
    if q_x1 is not None:
        draft = torch.cat([torch.zeros(n, 1, v), q_x1, q_x2.view(n, M1 * M2, v)], dim=1).reshape(-1, v)
    parents = [-1] + [0] * M1 + [1 + a for a in range(M1) for _ in range(M2)]
    out = tree_rejection_sample([nodes] * n, parents * n, tokens, None, target, draft, [False] * n, [None] * n,
                                host_walk=host_walk)
    counts = _extend_and_count([a.token_ids for a in out], [p1, p2, p3], gen)
    exact = {(a, b, c): float(p1[a] * p2[a, b] * p3[a, b, c]) for a in range(v) for b in range(v) for c in range(v)}
    return _chi_square_p_value(counts, exact, n)


@pytest.mark.parametrize("host_walk", [False, True])
@pytest.mark.parametrize("scheme", ["iid", "without", "top-k"])
@pytest.mark.slow  # make test-fast skips it
def test_tree_sampler_follows_the_target_distribution(scheme, host_walk):
    """`tree_sampler_p_value` for each drafting scheme and each walk (the batched tensor one, the
    host one). A correct sampler fails when p < 1e-6: false-failure probability 1e-6 per case
    (the seeds are fixed, so runs are reproducible)."""
    assert tree_sampler_p_value(scheme, host_walk=host_walk) > 1e-6


@pytest.mark.parametrize("host_walk", [False, True])
@pytest.mark.parametrize("scheme", ["iid", "top-k"])
@pytest.mark.slow  # make test-fast skips it
def test_wrong_residual_is_detected(scheme, host_walk, monkeypatch):
    """Negative control: the same statistic catches a sampler that keeps p after rejecting a
    child instead of normalize(max(0, p - q)), in either walk."""
    monkeypatch.setattr(rs, "residual_distribution", lambda p, q, rows=None: p)
    assert tree_sampler_p_value(scheme, host_walk=host_walk) < 1e-6


@pytest.mark.parametrize("host_walk", [False, True])
def test_tree_sampler_input_errors(host_walk):
    tokens = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="parent must be"):
        tree_rejection_sample([3], [-1, 0, 2], tokens, tokens, None, None, [True], [None], host_walk=host_walk)
    with pytest.raises(ValueError, match="root"):
        tree_rejection_sample([2, 1], [-1, 0, 0], tokens, tokens, None, None, [True, True], [None, None],
                              host_walk=host_walk)
    with pytest.raises(ValueError, match="sum\\(num_nodes\\)"):
        tree_rejection_sample([2], [-1, 0, 0], tokens, tokens, None, None, [True], [None], host_walk=host_walk)
    with pytest.raises(ValueError, match="target_probs"):
        tree_rejection_sample([3], [-1, 0, 0], tokens, None, None, None, [False], [None])


# --- tree-mask attention ------------------------------------------------------------------------


# name -> (query_lens, seq_lens, tree sizes (0: causal), H, Hkv, D, block_size). A decode next to
# verify trees, a tree after causal query tokens of the same request, a tree from position 0.
TREE_CASES: dict[str, tuple] = {
    "verify_gqa_bs16": ([1, 6, 9, 4], [20, 30, 40, 4], [0, 6, 7, 4], 8, 2, 16, 16),
    "verify_mha_bs4": ([5, 3, 12], [5, 40, 18], [5, 3, 12], 4, 4, 16, 4),
    "verify_mqa_bs1": ([8, 1], [19, 7], [8, 0], 4, 1, 32, 1),
    "verify_64_nodes": ([64, 3], [90, 10], [64, 0], 4, 2, 16, 16),  # bit 63 of the Triton rows
    # partial trees (tree drafting's levels): the last q of m nodes are queries, the rest cached
    "partial_levels_bs4": ([4, 1, 3, 2], [30, 12, 9, 17], [9, 5, 3, 0], 8, 2, 16, 4),
    "partial_64_nodes": ([8, 1], [70, 64], [64, 64], 4, 2, 16, 16),
    # one new node per request at equal lengths (a tree level of width 1): not a plain decode
    "partial_one_query": ([1, 1], [12, 12], [4, 3], 4, 2, 16, 4),
}


def tree_case(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Case, list]:
    ql, sl, sizes, h, hkv, d, bs = TREE_CASES[name]
    rng = random.Random(seed)
    masks = [tree_attention_mask(random_tree(rng, m)) if m else None for m in sizes]
    return make_case(ql, sl, h, hkv, d, bs, seed=seed, dtype=dtype), masks


def naive_tree_attention(case: Case, tree_masks: list) -> torch.Tensor:  # [num_tokens, H, D] fp32
    """Dense reference: per request and head, explicit softmax over the context (pre-step cache +
    this step's keys) under causal + tree visibility."""
    h, d = case.query.shape[1:]
    hkv = case.k_cache.shape[2]
    bs = case.block_size
    k_flat, v_flat = case.k_cache.reshape(-1, hkv, d).float(), case.v_cache.reshape(-1, hkv, d).float()
    outs, t = [], 0
    for q, s, bt, tree in zip(case.query_lens, case.seq_lens, case.block_tables, tree_masks, strict=True):
        ctx = s - q
        slots = [bt[p // bs] * bs + p % bs for p in range(ctx)]
        k = torch.cat([k_flat[slots], case.key[t : t + q].float()])  # [s, Hkv, D]
        v = torch.cat([v_flat[slots], case.value[t : t + q].float()])
        visible = torch.ones(q, s, dtype=torch.bool, device=k.device).tril(ctx)  # [q, s] causal
        if tree is not None:
            m = tree.shape[0]
            r = min(m, q)  # query rows under the tree: its last r nodes (the others are cached)
            visible[q - r :, s - m :] = tree[m - r :]
        qq = case.query[t : t + q].float()
        out = torch.empty(q, h, d, device=k.device)
        for head in range(h):
            kvh = head // (h // hkv)
            scores = (qq[:, head] @ k[:, kvh].T * case.scale).masked_fill(~visible, float("-inf"))
            out[:, head] = scores.softmax(-1) @ v[:, kvh]
        outs.append(out)
        t += q
    return torch.cat(outs)


def run_with_trees(backend: str, case: Case, tree_masks: list | None, row_exact: str | None = None,
                   caches: list | None = None, device: str = "cpu") -> torch.Tensor:
    """The backend's attention output for the case's step (caches: a list that receives the
    (k, v) caches after the step's KV write); the case's tensors must be on `device`."""
    be = get_attention_backend(device, backend)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    extra = {"row_exact": row_exact} if row_exact else {}
    md = be.build_metadata(case.query_lens, case.seq_lens, case.block_tables, case.slot_mapping, case.block_size,
                           torch.device(device), tree_masks=tree_masks, **extra)
    be.write_kv(case.key, case.value, kc, vc, md)
    if caches is not None:
        caches.append((kc, vc))
    return be.attention(case.query, kc, vc, md, case.scale)


def one_token_step_mismatches(backend: str, case: Case, masks: list, out: torch.Tensor, kc: torch.Tensor,
                              vc: torch.Tensor, row_exact: str, device: str = "cpu") -> tuple[int, list[int]]:
    """(tokens checked, tokens whose output differs): each query token's attention output `out`
    against the backend's one-token decode step at the end of its path, bit for bit (a tree
    token's path: its context, then its ancestors and itself in depth order, moved into
    consecutive positions as after acceptance; a causal token's: its context)."""
    be = get_attention_backend(device, backend)
    bs, (hkv, d) = case.block_size, kc.shape[2:]
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    t, checked, bad = 0, 0, []
    for q, s, table, tree in zip(case.query_lens, case.seq_lens, case.block_tables, masks, strict=True):
        slots = [table[p // bs] * bs + p % bs for p in range(s)]
        m = 0 if tree is None else tree.shape[0]
        for i in range(q):
            j = i - (q - m)
            if j < 0:
                path = slots[: s - q + i + 1]
            else:
                path = slots[: s - m] + [slots[s - m + a] for a in tree[j].nonzero().flatten().tolist()]
            nblk = -(-len(path) // bs)
            ref_k = torch.zeros(nblk * bs, hkv, d, dtype=kc.dtype, device=kc.device)  # the path in consecutive slots
            ref_v = torch.zeros_like(ref_k)
            ref_k[: len(path)], ref_v[: len(path)] = flat_k[path], flat_v[path]
            one = be.build_metadata([1], [len(path)], [list(range(nblk))], [len(path) - 1], bs,
                                    torch.device(device), row_exact=row_exact)
            ref = be.attention(case.query[t + i : t + i + 1], ref_k.view(nblk, bs, hkv, d),
                               ref_v.view(nblk, bs, hkv, d), one, case.scale)
            checked += 1
            if not torch.equal(out[t + i : t + i + 1], ref):
                bad.append(t + i)
        t += q
    return checked, bad


@pytest.mark.parametrize("name", sorted(TREE_CASES))
def test_torch_tree_attention_matches_dense_reference(name):
    case, masks = tree_case(name)
    torch.testing.assert_close(run_with_trees("torch", case, masks), naive_tree_attention(case, masks),
                               atol=2e-5, rtol=2e-5)


def test_torch_default_path_is_unchanged():
    """No trees (None, or every entry None) and chain masks (causal) give the default output bit
    for bit."""
    case, masks = tree_case("verify_gqa_bs16")
    plain = run_with_trees("torch", case, None)
    assert torch.equal(run_with_trees("torch", case, [None] * len(masks)), plain)
    chains = [None if m is None else torch.ones_like(m).tril() for m in masks]
    assert torch.equal(run_with_trees("torch", case, chains), plain)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_torch_tree_attention_random_batches(seed, data):
    rng = random.Random(seed)
    num_reqs = data.draw(st.integers(1, 4))
    query_lens = [data.draw(st.integers(1, 9)) for _ in range(num_reqs)]
    seq_lens = [q + data.draw(st.integers(0, 30)) for q in query_lens]
    sizes = [data.draw(st.integers(0, min(s, q + 6))) for q, s in zip(query_lens, seq_lens, strict=True)]
    h, hkv = data.draw(st.sampled_from([(4, 4), (4, 2), (6, 3)]))
    case = make_case(query_lens, seq_lens, h, hkv, 8, data.draw(st.sampled_from([1, 4, 16])), seed=seed)
    masks = [tree_attention_mask(random_tree(rng, m)) if m else None for m in sizes]
    torch.testing.assert_close(run_with_trees("torch", case, masks), naive_tree_attention(case, masks),
                               atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("name", ["verify_gqa_bs16", "verify_mha_bs4", "partial_levels_bs4"])
def test_sdpa_row_exact_tree_token_equals_its_one_token_step(name):
    """row_exact="sdpa" (the torch backend's exact modes without the CPU kernels): in bfloat16,
    each tree token's attention output is bit for bit the one-token decode step's at the end of
    its path (its context, then its ancestors and itself in depth order, moved into consecutive
    positions as after acceptance), so trees keep greedy text exact there too."""
    case, masks = tree_case(name, seed=3, dtype=torch.bfloat16)
    caches = []
    out = run_with_trees("torch", case, masks, row_exact="sdpa", caches=caches)
    checked, bad = one_token_step_mismatches("torch", case, masks, out, *caches[0], row_exact="sdpa")
    assert checked >= 3 and not bad, (name, bad)
    # and the tree tokens still see what the dense reference says (not merely their own slots)
    torch.testing.assert_close(out.float(), naive_tree_attention(case, masks), atol=2e-2, rtol=2e-2)


def test_tree_mask_validation():
    be = get_attention_backend("cpu", "torch")
    args = ([3], [5], [[0, 1]], [2, 3, 4], 4, "cpu")
    with pytest.raises(ValueError, match="lower triangular"):
        be.build_metadata(*args, tree_masks=[torch.ones(3, 3, dtype=torch.bool)])
    with pytest.raises(ValueError, match="lower triangular"):  # node 2 does not see the root
        be.build_metadata(*args, tree_masks=[torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)])
    with pytest.raises(ValueError, match="seq_len 5"):  # a tree longer than the sequence
        be.build_metadata(*args, tree_masks=[torch.ones(6, 6, dtype=torch.bool).tril()])
    md = be.build_metadata(*args, tree_masks=[torch.ones(5, 5, dtype=torch.bool).tril()])  # partial: 2 cached
    assert md.tree_lens.tolist() == [5]
    md = be.build_metadata(*args, tree_masks=[torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)])
    assert md.tree_lens.tolist() == [2] and md.tree_mask_offsets.tolist() == [0]
    assert md.tree_mask.tolist() == [0b01, 0b11]
    with pytest.raises(ValueError, match="64"):
        be.build_metadata([65], [65], [[0, 1, 2, 3, 4]], list(range(65)), 16, "cpu",
                          tree_masks=[torch.ones(65, 65, dtype=torch.bool).tril()])


# (case name, dtype name) run by the interpreter subprocess
INTERPRET_TREE_CASES = [(name, "float32") for name in sorted(TREE_CASES)] + [("verify_gqa_bs16", "bfloat16")]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


INTERPRET_PARTS = ("kernels", "engine")  # run side by side, one subprocess each


def _interpret_main(parts: tuple[str, ...] = INTERPRET_PARTS) -> None:
    """Subprocess entry (TRITON_INTERPRET=1 set): part "kernels": per case, the Triton kernel's
    max error vs the dense reference (and for the first, whether chain masks reproduce the causal
    kernel exactly); part "engine": the engine with trees on the Triton backend."""
    results = {}
    if "engine" in parts:
        results["engine"] = _triton_engine_trees()
    if "kernels" not in parts:
        print("RESULTS " + json.dumps(results))
        return
    for name, dtype_name in INTERPRET_TREE_CASES:
        case, masks = tree_case(name, dtype=_DTYPES[dtype_name])
        out = run_with_trees("triton", case, masks)
        results[f"{name}/{dtype_name}"] = {
            "max_err": float((out.float() - naive_tree_attention(case, masks)).abs().max()),
            "nan": bool(torch.isnan(out).any()),
        }
        caches = []
        rows = run_with_trees("triton", case, masks, row_exact="kernel", caches=caches)
        checked, bad = one_token_step_mismatches("triton", case, masks, rows, *caches[0], row_exact="kernel")
        results[f"rows/{name}/{dtype_name}"] = {
            "max_err": float((rows.float() - naive_tree_attention(case, masks)).abs().max()),
            "nan": bool(torch.isnan(rows).any()), "checked": checked, "bad": bad,
        }
    case, masks = tree_case(INTERPRET_TREE_CASES[0][0])
    chains = [None if m is None else torch.ones_like(m).tril() for m in masks]
    results["chain_equal"] = bool(torch.equal(run_with_trees("triton", case, chains), run_with_trees("triton", case, None)))
    print("RESULTS " + json.dumps(results))


def _triton_engine_trees(device: str = "cpu") -> dict:
    """The engine on the Triton backend (interpreted on the CPU, compiled on CUDA), bf16,
    exact="pad": greedy text with tree speculation vs without, and how many attention calls went
    through the row-exact kernel."""
    import tempfile

    from helpers import save_perturbed_copy, save_tiny_model

    import kernels.triton_attn as triton_attn
    from engine import LLMEngine, SamplingParams, SpeculativeConfig

    calls = {"rows": 0}
    rows_attention = triton_attn.rows_attention

    def counted(*args, **kwargs):
        calls["rows"] += 1
        return rows_attention(*args, **kwargs)

    triton_attn.rows_attention = counted
    root = tempfile.mkdtemp()
    target = save_tiny_model(os.path.join(root, "target"), "llama")
    close = save_perturbed_copy(target, os.path.join(root, "close"), noise=0.05)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[(5 * i + j * j) % 60 + 2 for j in range(7 + 3 * i)] for i in range(2)]

    def run(spec) -> dict:
        engine = LLMEngine(target, dtype="bfloat16", device=device, attention_backend="triton", exact="pad",
                           kv_cache_memory_bytes=32 << 20,
                           speculative=spec)
        outs: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return outs

    try:
        plain = run(None)
        trees = run(SpeculativeConfig(method="draft", model=close, adaptive=False, tree_nodes=6, tree_width=2,
                                      tree_depth=3))
    finally:
        triton_attn.rows_attention = rows_attention
    return {"equal": plain == trees, "rows_calls": calls["rows"]}


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    if not triton_available():
        pytest.skip("triton not importable")
    return run_triton_interpreter(os.path.abspath(__file__), parts=INTERPRET_PARTS)


@pytest.mark.parametrize("name,dtype_name", INTERPRET_TREE_CASES)
@pytest.mark.slow  # make test-fast skips it
def test_triton_tree_attention_in_interpreter(interpreter_results, name, dtype_name):
    r = interpreter_results[f"{name}/{dtype_name}"]
    assert not r["nan"]
    assert r["max_err"] <= {"float32": 1e-4, "bfloat16": 3e-2}[dtype_name], r


@pytest.mark.parametrize("name,dtype_name", INTERPRET_TREE_CASES)
@pytest.mark.slow  # make test-fast skips it
def test_triton_row_exact_attention_in_interpreter(interpreter_results, name, dtype_name):
    """The Triton backend's row-exact mode (`rows_attention`): the dense reference's output, and
    every tree token's output bit for bit the one-token step's at the end of its path (through
    the same kernel), bfloat16 included."""
    r = interpreter_results[f"rows/{name}/{dtype_name}"]
    assert not r["nan"] and r["max_err"] <= {"float32": 1e-4, "bfloat16": 3e-2}[dtype_name], r
    assert r["checked"] >= 1 and not r["bad"], r


def test_triton_engine_trees_equal_target_in_bf16(interpreter_results):
    """The engine on the Triton backend (interpreted), bfloat16, exact="pad": tree speculation's
    greedy text equals no speculation, its steps' attention through the row-exact kernel."""
    r = interpreter_results["engine"]
    assert r["equal"] and r["rows_calls"] > 0, r


# ---- the same on a GPU, compiled (skipped without one) -------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,dtype_name", INTERPRET_TREE_CASES)
def test_triton_tree_attention_compiled_cuda(name, dtype_name):
    """Tree-mask attention of the compiled Triton kernel vs the dense reference, and the row-exact
    kernel's tree tokens bit for bit their one-token steps (as the interpreter shows above)."""
    case, masks = tree_case(name, dtype=_DTYPES[dtype_name])
    case = case.to("cuda")
    out = run_with_trees("triton", case, masks, device="cuda")
    tol = {"float32": 1e-4, "bfloat16": 3e-2}[dtype_name]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), naive_tree_attention(case, masks), atol=tol, rtol=tol)
    caches = []
    rows = run_with_trees("triton", case, masks, row_exact="kernel", caches=caches, device="cuda")
    torch.testing.assert_close(rows.float(), naive_tree_attention(case, masks), atol=tol, rtol=tol)
    checked, bad = one_token_step_mismatches("triton", case, masks, rows, *caches[0], row_exact="kernel",
                                             device="cuda")
    assert checked >= 1 and not bad, (name, bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_engine_trees_equal_target_in_bf16_on_cuda():
    r = _triton_engine_trees("cuda")
    assert r["equal"] and r["rows_calls"] > 0, r


def test_triton_chain_masks_are_the_causal_kernel(interpreter_results):
    """Chain (lower-triangular) masks through the HAS_TREE kernel: bit for bit the causal one."""
    assert interpreter_results["chain_equal"]


if __name__ == "__main__" and "--interpret-check" in sys.argv:
    _interpret_main(tuple(sys.argv[sys.argv.index("--interpret-check") + 1 :]) or INTERPRET_PARTS)
