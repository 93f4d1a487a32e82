"""The batched rejection sampler against the per-request loop it replaced.

`per_request_reference` is the sampler as it was (one request at a time, drawing k uniforms and
then one more from the request's generator). The batched one draws the same k + 1 uniforms in one
call, so with seeded generators both give the same tokens, greedy or sampled, in any batch. With
the default generator (unseeded requests) the draws are shared differently, so there the test
is one of distribution.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_speculative import _chi_square_p_value

from engine.sampler import draw_uniforms, sample_from_probs
from engine.spec_decode.rejection_sampler import rejection_sample


def per_request_reference(num_draft_tokens, draft_token_ids, target_argmax, target_probs, draft_probs,
                          is_greedy, generators) -> list[list[int]]:
    """The rejection sampler before batching (same layout and semantics)."""
    drafts = draft_token_ids.tolist()
    argmax = target_argmax.tolist() if target_argmax is not None else None
    out, t0, d0 = [], 0, 0
    for r, k in enumerate(num_draft_tokens):
        if is_greedy[r]:
            accepted = []
            for i in range(k):
                if drafts[d0 + i] != argmax[t0 + i]:
                    break
                accepted.append(drafts[d0 + i])
            accepted.append(argmax[t0 + len(accepted)])
        else:
            p, q = target_probs[t0 : t0 + k + 1], draft_probs[d0 : d0 + k] if k else None
            n = 0
            if k:
                ids = draft_token_ids[d0 : d0 + k]
                u = torch.rand(k, generator=generators[r])
                accept = (u * q[torch.arange(k), ids] < p[torch.arange(k), ids]).tolist()
                while n < k and accept[n]:
                    n += 1
            if n < k:
                residual = (p[n] - q[n]).clamp_min(0.0)
                dist = residual / residual.sum() if residual.sum() > 0 else p[n]
            else:
                dist = p[k]
            accepted = drafts[d0 : d0 + n] + [int(sample_from_probs(dist.unsqueeze(0), [generators[r]]).item())]
        out.append(accepted)
        t0, d0 = t0 + k + 1, d0 + k
    return out


def random_step(rng: random.Random, vocab: int, max_reqs: int = 6, max_k: int = 5, p_greedy: float = 0.3):
    """A step's inputs: random k per request (0 included), drafts drawn from q (so some are
    accepted), greedy drafts that follow the target's argmax for a random number of tokens."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    num_reqs = rng.randint(1, max_reqs)
    ks = [rng.randint(0, max_k) for _ in range(num_reqs)]
    greedy = [rng.random() < p_greedy for _ in range(num_reqs)]
    target = (torch.randn(sum(ks) + num_reqs, vocab, generator=gen) * 2).softmax(-1)
    draft = (target[[j + r for r, k in enumerate(ks) for j in range(sum(ks[:r]), sum(ks[:r]) + k)]].log()
             + torch.randn(sum(ks), vocab, generator=gen)).softmax(-1)
    drafts = torch.multinomial(draft, 1, generator=gen).squeeze(1) if sum(ks) else torch.zeros(0, dtype=torch.long)
    argmax = target.argmax(-1)
    d0 = 0
    for r, k in enumerate(ks):
        if greedy[r]:
            follow = rng.randint(0, k)
            t0 = d0 + r
            drafts[d0 : d0 + follow] = argmax[t0 : t0 + follow]
        d0 += k
    seeds = [rng.randrange(2**31) for _ in range(num_reqs)]
    return ks, drafts, argmax, target, (draft if sum(ks) else None), greedy, seeds


def generators_for(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_batched_equals_per_request_with_seeds():
    """Mixed batches (greedy and sampled, k from 0 to 5): the very same tokens."""
    rng = random.Random(0)
    for _ in range(200):
        ks, drafts, argmax, target, draft, greedy, seeds = random_step(rng, vocab=40)
        expected = per_request_reference(ks, drafts, argmax, target, draft, greedy, generators_for(seeds))
        assert rejection_sample(ks, drafts, argmax, target, draft, greedy, generators_for(seeds)) == expected


def test_greedy_only_needs_no_probabilities():
    drafts = torch.tensor([3, 1, 2, 5, 5])
    argmax = torch.tensor([3, 1, 4, 9, 5, 5, 7, 8])  # k=3 rows 0..3; k=2 rows 4..6; k=0 row 7
    out = rejection_sample([3, 2, 0], drafts, argmax, None, None, [True] * 3, [None] * 3)
    assert out == [[3, 1, 4], [5, 5, 7], [8]]
    assert rejection_sample([], drafts[:0], argmax[:0], None, None, [], []) == []


def test_seeded_request_does_not_depend_on_the_batch():
    """A seeded request's tokens are the same alone and next to other requests (seeded or not),
    and drawing for greedy requests never touches their generators."""
    rng = random.Random(1)
    for _ in range(30):
        ks, drafts, argmax, target, draft, greedy, seeds = random_step(rng, vocab=30, p_greedy=0.4)
        gens = [g if rng.random() < 0.6 else None for g in generators_for(seeds)]
        together = rejection_sample(ks, drafts, argmax, target, draft, greedy, gens)
        t0 = d0 = 0
        for r, k in enumerate(ks):
            if gens[r] is not None or greedy[r]:
                alone = rejection_sample([k], drafts[d0 : d0 + k], argmax[t0 : t0 + k + 1], target[t0 : t0 + k + 1],
                                         draft[d0 : d0 + k] if k else None, [greedy[r]], generators_for([seeds[r]]))
                assert alone[0] == together[r]
            t0, d0 = t0 + k + 1, d0 + k


def unseeded_batch_p_value() -> float:
    """8000 unseeded requests in one call (one shared draw), each with k = 2 drafts drawn from
    q: the committed tokens, extended to 3 with exact target samples, against the exact joint
    target distribution over 4^3 = 64 cells: the chi-square p-value (small cells pooled)."""
    vocab, k, n = 4, 2, 8000
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    p1 = torch.randn(vocab, generator=gen).softmax(-1)
    p2 = torch.randn(vocab, vocab, generator=gen).softmax(-1)  # p(x2 | x1)
    p3 = torch.randn(vocab, vocab, vocab, generator=gen).softmax(-1)  # p(x3 | x1, x2)
    q1 = torch.randn(vocab, generator=gen).softmax(-1)
    q2 = torch.randn(vocab, vocab, generator=gen).softmax(-1)
    x1 = torch.multinomial(q1.expand(n, vocab), 1, generator=gen).squeeze(1)
    x2 = torch.multinomial(q2[x1], 1, generator=gen).squeeze(1)
    target = torch.stack([p1.expand(n, vocab), p2[x1], p3[x1, x2]], dim=1).reshape(-1, vocab)
    draft = torch.stack([q1.expand(n, vocab), q2[x1]], dim=1).reshape(-1, vocab)
    drafts = torch.stack([x1, x2], dim=1).reshape(-1)
    out = rejection_sample([k] * n, drafts, None, target, draft, [False] * n, [None] * n)
    counts = _extend_and_count(out, [p1, p2, p3], gen)
    exact = {(a, b, c): float(p1[a] * p2[a, b] * p3[a, b, c])
             for a in range(vocab) for b in range(vocab) for c in range(vocab)}
    return _chi_square_p_value(counts, exact, n)


def test_unseeded_batch_follows_the_target_distribution():
    """`unseeded_batch_p_value`; a correct sampler fails when p < 1e-6: false-failure
    probability 1e-6 (the seed is fixed, so the run is reproducible)."""
    assert unseeded_batch_p_value() > 1e-6


def test_wrong_residual_is_detected(monkeypatch):
    """Negative control: the same statistic catches a sampler that, after a rejection, samples
    from p instead of normalize(max(0, p - q))."""
    import engine.spec_decode.rejection_sampler as rs

    monkeypatch.setattr(rs, "residual_distribution", lambda p, q, rows=None: p)
    assert unseeded_batch_p_value() < 1e-6


def _extend_and_count(outputs: list[list[int]], tables: list[torch.Tensor], gen: torch.Generator) -> dict:
    """Complete each output to len(tables) tokens with exact samples of the target tables
    (tables[i][x_1..x_i] is p(x_{i+1} | x_1..x_i)); count the tuples."""
    n = len(tables)
    seqs = torch.tensor([t[:n] + [-1] * (n - len(t)) for t in outputs])  # [N, n], -1: to sample
    for i, table in enumerate(tables):
        rows = torch.nonzero(seqs[:, i] < 0).flatten()
        if rows.numel():
            probs = table[tuple(seqs[rows, :i].T)] if i else table.expand(rows.numel(), -1)
            seqs[rows, i] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    keys, counts = torch.unique(seqs, dim=0, return_counts=True)
    return {tuple(k): c for k, c in zip(keys.tolist(), counts.tolist(), strict=True)}


def test_input_errors_are_specific():
    drafts = torch.tensor([1])
    with pytest.raises(ValueError, match="target_argmax"):
        rejection_sample([1], drafts, None, torch.rand(2, 4), torch.rand(1, 4), [True], [None])
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample([1], drafts, torch.tensor([1, 2]), None, None, [False], [None])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample([1], drafts, None, torch.rand(2, 4), None, [False], [None])


def test_draw_uniforms_keeps_each_generator_to_its_request():
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    u = draw_uniforms([2, 0, 3, 1], [a, b, None, a], "cpu")
    assert u.shape == (6,)
    ref_a = torch.rand(3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(u[:2], ref_a[:2]) and torch.equal(u[5:], ref_a[2:])
    assert torch.equal(b.get_state(), torch.Generator().manual_seed(6).get_state())  # count 0: untouched
    assert ((u[2:5] >= 0) & (u[2:5] < 1)).all()
