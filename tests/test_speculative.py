"""Speculative decoding is lossless: greedy output equals non-speculative greedy output token for
token (fp32), and sampled output follows the target's exact distribution."""

import pytest
import torch
import transformers
from helpers import assert_no_leaked_blocks, save_perturbed_copy, save_tiny_model
from test_engine import PROMPTS, run_staggered

from engine import LLM, LLMEngine, SamplingParams, SpeculativeConfig
from engine.sampler import probs_from_logits
from engine.spec_decode.rejection_sampler import rejection_sample

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
ARRIVALS = [0, 0, 1, 3, 3, 5, 8, 13, 14]
# Prompts with repetition, so n-gram lookup finds matches, next to the shared ones.
SPEC_PROMPTS = PROMPTS + [[4, 5, 6, 7] * 6, [11, 12, 13, 11, 12, 13, 11, 12]]
SPEC_ARRIVALS = ARRIVALS + [2, 6]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = save_tiny_model(str(root / "target"), "llama")
    close = save_perturbed_copy(target, str(root / "close"), noise=0.02)
    other = save_tiny_model(str(root / "other"), "llama", seed=7, num_hidden_layers=1)
    return {"target": target, "close": close, "other": other}


@pytest.fixture(scope="module")
def baseline(models):
    engine = LLMEngine(models["target"], dtype="float32", device="cpu")
    outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    return [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))]


CASES = [
    ("ngram", None, k, adaptive) for k in (1, 3, 8) for adaptive in (False, True)
] + [
    ("draft", "close", k, adaptive) for k in (1, 2, 4, 5, 8) for adaptive in (False, True)
] + [("draft", "other", 4, False), ("draft", "target", 6, False)]


@pytest.mark.parametrize("method,drafter,k,adaptive", CASES)
def test_greedy_output_equals_non_speculative(models, baseline, method, drafter, k, adaptive):
    spec = SpeculativeConfig(method=method, model=models.get(drafter), num_speculative_tokens=k, adaptive=adaptive)
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=64)
    outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    assert [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))] == baseline
    if not adaptive and drafter in ("close", "target"):
        stats = engine.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        assert max(stats.drafted_by_position and [len(stats.drafted_by_position)]) <= k


@pytest.mark.parametrize("method,drafter", [("ngram", None), ("draft", "close")])
def test_greedy_equivalence_under_preemption(models, baseline, method, drafter):
    spec = SpeculativeConfig(method=method, model=models.get(drafter), num_speculative_tokens=4, adaptive=False)
    bytes_per_token = 2 * 2 * 2 * 16 * 4 * (2 if drafter else 1)
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", block_size=4, speculative=spec,
                       kv_cache_memory_bytes=18 * 4 * bytes_per_token, max_model_len=60)
    prompts = [p[:30] for p in SPEC_PROMPTS]
    outs = run_staggered(engine, prompts, GREEDY, SPEC_ARRIVALS)
    assert engine.scheduler.num_preemptions > 0
    ref = LLMEngine(models["target"], dtype="float32", device="cpu")
    expected = run_staggered(ref, prompts, GREEDY, SPEC_ARRIVALS)
    assert outs == expected
    assert_no_leaked_blocks(engine)


def test_per_request_speculation_control(models):
    spec = SpeculativeConfig(method="draft", model=models["target"], num_speculative_tokens=6, adaptive=False)
    llm = LLM(models["target"], dtype="float32", device="cpu", speculative=spec)
    off, capped, default = llm.generate(
        [PROMPTS[2]] * 3,
        [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=False),
         SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, num_speculative_tokens=2),
         GREEDY],
    )
    assert off.spec_stats["num_draft_tokens"] == 0
    assert capped.spec_stats["num_draft_tokens"] > 0 and len(capped.spec_stats["drafted_by_position"]) == 2
    assert len(default.spec_stats["drafted_by_position"]) == 6
    assert off.token_ids == capped.token_ids == default.token_ids[:20]


def test_adaptive_turns_speculation_off_for_useless_drafter(models):
    """A drafter that never agrees drives the acceptance EMA down until k reaches 0 (with
    occasional probes), so few drafts are wasted."""
    spec = SpeculativeConfig(method="draft", model=models["other"], num_speculative_tokens=8, adaptive=True)
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec)
    run_staggered(engine, [PROMPTS[2]], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), [0])
    stats = engine.spec_stats
    assert stats.num_draft_tokens < 0.5 * 8 * 60


# --- rejection sampler unit tests -------------------------------------------------------


def test_rejection_sampler_greedy():
    drafts = torch.tensor([3, 1, 2, 5, 5])
    argmax = torch.tensor([3, 1, 4, 9, 5, 5, 7])  # req0: k=3 rows 0..3 ; req1: k=2 rows 4..6
    out = rejection_sample([3, 2], drafts, argmax, None, None, [True, True], [None, None])
    assert out == [[3, 1, 4], [5, 5, 7]]


def test_rejection_sampler_hand_made_distributions():
    """p = [.5,.5,0], q = one-hot(0), draft 0: accept w.p. 0.5, else the residual is one-hot(1)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    counts = {}
    for _ in range(4000):
        out = tuple(rejection_sample([1], torch.tensor([0]), None, p, q, [False], [g])[0])
        counts[out] = counts.get(out, 0) + 1
    assert set(counts) <= {(1,), (0, 0), (0, 1), (0, 2)}
    assert abs(counts[(1,)] / 4000 - 0.5) < 0.04
    assert abs(counts.get((0, 2), 0) / 4000 - 0.35) < 0.04  # accepted, then bonus from p[1]
    # q == p: always accept
    same = rejection_sample([1], torch.tensor([1]), None, p, p[:1].clone(), [False], [g])[0]
    assert same[0] == 1 and len(same) == 2


# --- distribution test ------------------------------------------------------------------

VOCAB = 3
NUM_NEW = 4
NUM_SAMPLES = 3000


def _exact_distribution(model_dir, prompt, params, num_new: int = NUM_NEW):
    """P(x1..xn | prompt) for every 3^n continuation (n = num_new, 4: 81 of them), from
    transformers logits + our filter."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = torch.cartesian_prod(*[torch.arange(VOCAB)] * num_new)  # [81, 4]
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = ref(ids).logits[:, len(prompt) - 1 : -1]  # [81, 4, V]
    n = logits.shape[0] * num_new
    probs = probs_from_logits(logits.reshape(n, VOCAB), torch.full((n,), params.temperature),
                              torch.full((n,), params.top_k), torch.full((n,), params.top_p)).view(-1, num_new, VOCAB)
    per_pos = probs.gather(2, seqs.unsqueeze(-1)).squeeze(-1)
    return {tuple(s.tolist()): float(pr) for s, pr in zip(seqs, per_pos.prod(dim=1), strict=True)}


def _chi_square_p_value(counts: dict, expected: dict, n: int) -> float:
    # pool cells with expected count < 5 into one (standard chi-square validity rule)
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for key, p in expected.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            pooled_obs += o
            pooled_exp += e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    assert not set(counts) - set(expected)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)))


def _sample_counts(target, spec, params, prompt):
    torch.manual_seed(1234)
    llm = LLM(target, dtype="float32", device="cpu", speculative=spec, max_num_seqs=512)
    outs = llm.generate([prompt] * NUM_SAMPLES, params)
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert_no_leaked_blocks(llm.engine)
    return counts, llm.engine.spec_stats


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab3")
    target = save_tiny_model(str(root / "t"), "llama", vocab_size=VOCAB)
    drafter = save_tiny_model(str(root / "d"), "llama", vocab_size=VOCAB, seed=5, num_hidden_layers=1)
    return target, drafter


@pytest.mark.parametrize("method,params", [
    ("draft", SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True)),
    ("draft", SamplingParams(max_tokens=NUM_NEW, temperature=0.8, top_k=2, top_p=0.9, ignore_eos=True)),
    ("ngram", SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True)),
])
def test_sampled_distribution_matches_target(small_vocab, method, params):
    """Chi-square goodness of fit of 3000 speculative samples of (x1..x4) against the target's exact
    joint distribution (81 cells, small cells pooled). The test fails when p < 1e-4, so a correct
    sampler fails with probability 1e-4 per run (the seed is fixed, so the run is reproducible)."""
    target, drafter = small_vocab
    prompt = [0, 1, 2, 1, 0, 1, 2, 1, 0]
    spec = SpeculativeConfig(method=method, model=drafter if method == "draft" else None,
                             num_speculative_tokens=3, adaptive=False)
    counts, stats = _sample_counts(target, spec, params, prompt)
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p = _chi_square_p_value(counts, _exact_distribution(target, prompt, params), NUM_SAMPLES)
    assert p > 1e-4, f"speculative samples do not follow the target distribution (p={p:.2e})"


def test_broken_sampler_is_detected(small_vocab, monkeypatch):
    """The same test catches a sampler that always accepts drafts."""
    import engine.model_runner as mr

    def always_accept(num_draft, draft_ids, argmax, tp, dp, greedy, gens):
        out, d0, t0 = [], 0, 0
        for k in num_draft:
            bonus = torch.multinomial(tp[t0 + k], 1).item()
            out.append(draft_ids[d0 : d0 + k].tolist() + [bonus])
            d0, t0 = d0 + k, t0 + k + 1
        return out

    monkeypatch.setattr(mr, "rejection_sample", always_accept)
    target, drafter = small_vocab
    prompt = [0, 1, 2, 1, 0, 1, 2, 1, 0]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True)
    spec = SpeculativeConfig(method="draft", model=drafter, num_speculative_tokens=3, adaptive=False)
    counts, _ = _sample_counts(target, spec, params, prompt)
    p = _chi_square_p_value(counts, _exact_distribution(target, prompt, params), NUM_SAMPLES)
    assert p < 1e-4


def test_bf16_agreement_and_divergence_at_near_ties(models):
    """In bf16 a verification batch (k+1 query tokens) rounds differently from a one-token step,
    so speculative greedy output may diverge from non-speculative output. Report the agreement
    rate, and check that every first divergence is at a near-tie of the target's logits (both
    tokens within 0.1 of the top logit in an fp32 reference)."""
    spec = SpeculativeConfig(method="draft", model=models["close"], num_speculative_tokens=4, adaptive=False)
    plain = LLM(models["target"], dtype="bfloat16", device="cpu").generate(SPEC_PROMPTS, GREEDY)
    fast = LLM(models["target"], dtype="bfloat16", device="cpu", speculative=spec).generate(SPEC_PROMPTS, GREEDY)
    ref = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    same = 0
    for prompt, a, b in zip(SPEC_PROMPTS, plain, fast, strict=True):
        if a.token_ids == b.token_ids:
            same += 1
            continue
        i = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + a.token_ids[:i]])).logits[0, -1]
        top = logits.max()
        assert top - logits[a.token_ids[i]] < 0.1 and top - logits[b.token_ids[i]] < 0.1, (
            f"divergence at a clear winner: {logits[a.token_ids[i]]:.3f} vs {logits[b.token_ids[i]]:.3f}, top {top:.3f}"
        )
    print(f"bf16 greedy agreement, speculative vs not: {same}/{len(SPEC_PROMPTS)} prompts identical")


def test_drafting_cost_ignores_prompt_catch_up_rounds():
    """A drafter's first round after a prefill also processes the whole prompt; that one-off cost
    must not become the per-step estimate the adaptive policy uses."""
    from engine.spec_decode.proposers.base import StepTimer

    timer = StepTimer(1e-3)
    timer.add_round(16, seconds=0.8, num_forwards=4, catch_up=128, k_max=4)  # after a 128-token prefill
    assert timer.seconds(16) == 1e-3  # nothing measured yet: the initial guess
    timer.add_round(16, seconds=0.012, num_forwards=4, catch_up=5, k_max=4)  # steady state: accepted + bonus
    assert timer.seconds(16) == pytest.approx(0.003)
    timer.add_round(16, seconds=0.4, num_forwards=2, catch_up=40, k_max=4)  # resumed after speculation was off
    assert timer.seconds(16) == pytest.approx(0.003)


def test_drafting_rounds_are_priced_by_their_length_not_by_the_mean_forward():
    """Rounds of a fused chain cost 0.37 ms + 0.19 ms per draft after the first (the shipped
    EAGLE-3 head at batch 1). The mean per forward (0.26 ms at 5 drafts) prices 5 drafts right,
    but 1 draft at 0.26 ms where it costs 0.37, and each further draft at 0.26 where it costs
    0.19. The round model reads each measured length as measured and prices an unmeasured one
    from its measured neighbours' slope, never above the mean per forward. Trees' rounds count
    per forward only."""
    from engine.spec_decode.proposers.base import ROUND_SAMPLES, StepTimer

    cost = {k: 0.37e-3 + 0.19e-3 * (k - 1) for k in range(1, 9)}
    timer = StepTimer(1e-3)
    assert timer.round_seconds(1, 5) == pytest.approx(5e-3)  # nothing measured: 5 x the initial guess
    for _ in range(ROUND_SAMPLES):
        timer.add_round(1, seconds=cost[5], num_forwards=5, catch_up=6, k_max=5)
    per = cost[5] / 5
    assert timer.round_seconds(1, 5) == pytest.approx(cost[5])
    assert timer.round_seconds(1, 6) == pytest.approx(cost[5] + per)  # one length measured: the mean slope
    for _ in range(ROUND_SAMPLES):
        timer.add_round(1, seconds=cost[4], num_forwards=4, catch_up=5, k_max=4)
    assert timer.round_seconds(1, 4) == pytest.approx(cost[4])
    for k in (2, 3, 6, 7):  # extrapolated at the measured slope, 0.19 ms
        assert timer.round_seconds(1, k) == pytest.approx(cost[k]), k
    assert timer.round_seconds(1, 1) == pytest.approx(max(cost[1], timer.seconds(1)))
    assert timer.round_seconds(16, 5) == pytest.approx(5 * timer.seconds(16))  # another batch bucket: unmeasured
    timer.add_round(1, seconds=0.05, num_forwards=3, catch_up=2, k_max=3, chain=False)  # a tree round
    assert timer.round_seconds(1, 3) == pytest.approx(cost[3])


def test_a_larger_batchs_unmeasured_drafting_is_priced_per_request():
    """Rounds measured at batch 1 only: a batch of n is priced n times a request's (each request's
    catch-up, attention and bookkeeping; borrowed as is, 16 requests' rounds were priced at 1/6-1/9
    of their measured 1.4-2.1 ms); once its own bucket is measured, its own median; a smaller
    batch borrows a larger one's as is."""
    from engine.spec_decode.proposers.base import StepTimer

    timer = StepTimer(1e-3)
    for _ in range(3):
        timer.add_round(1, seconds=0.5e-3, num_forwards=2, catch_up=3, k_max=2)
    assert timer.seconds(1) == pytest.approx(0.25e-3)
    assert timer.seconds(16) == pytest.approx(16 * 0.25e-3) and timer.seconds(5) == pytest.approx(5 * 0.25e-3)
    assert timer.round_seconds(16, 2) == pytest.approx(2 * 16 * 0.25e-3)
    timer.add_round(16, seconds=3e-3, num_forwards=2, catch_up=3, k_max=2)
    assert timer.seconds(16) == pytest.approx(1.5e-3) and timer.seconds(20) == pytest.approx(1.5e-3)
    assert timer.seconds(8) == pytest.approx(1.5e-3)  # (the nearest measured: 16's, on a tie the larger)


def test_adaptive_drafting_cost_is_steady_state_after_long_prompts(models):
    """End to end: after prompts of 40 tokens the drafter's estimate reflects its per-token rounds
    (a prompt-sized catch-up round would be several times more per forward)."""
    spec = SpeculativeConfig(method="draft", model=models["close"], num_speculative_tokens=3, adaptive=False)
    llm = LLM(models["target"], dtype="float32", device="cpu", speculative=spec)
    llm.generate([list(range(1, 41))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert llm.engine.spec_stats.num_verify_steps == 1  # exactly one drafting round ran...
    timer = llm.engine.speculator.proposer.timer
    assert timer.seconds(1) == timer.initial_s  # ...the prompt's catch-up round: not recorded
    llm.generate([list(range(1, 41))], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert any(len(d) for d in timer.medians.samples)
