"""The adaptive speculation policy's parts: the acceptance model, the step-time calibration and
the per-step decision. Small synthetic inputs with known answers; the end-to-end effect is
measured by bench/bench_spec.py, not asserted here."""

from __future__ import annotations

import collections
import itertools
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams, SpeculativeConfig
from engine.request import Request
from engine.spec_decode.acceptance import AcceptanceModel
from engine.spec_decode.cost_model import POINT_SAMPLES, StepCalibration, StepCostModel, StepMode, monotone
from engine.spec_decode.proposers.base import Draft, ProposeContext, Proposer
from engine.spec_decode.speculator import MIN_GAIN, Speculator


def request(i: int = 0) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0))


def test_position_rates_learn_each_position():
    """Position 1 accepted 80% of the time, position 2 (given 1) 25%: the model learns both
    conditional rates instead of assuming alpha^j."""
    rng = random.Random(0)
    model = AcceptanceModel(request_decay=0.1)
    r = request()
    for _ in range(3000):
        n = 0 if rng.random() > 0.8 else (1 if rng.random() > 0.25 else 2)
        model.observe(r, 2, n)
    g1, g2 = model.position_rates(2)
    assert g1 == pytest.approx(0.8, abs=0.06) and g2 == pytest.approx(0.25, abs=0.08)
    # a position never drafted falls back to the previous position's rate
    assert model.position_rates(3)[2] == pytest.approx(g2, abs=1e-6)


def test_new_request_starts_at_the_engine_rate_and_one_lucky_draft_moves_it_little():
    model = AcceptanceModel(request_decay=0.1)
    others = [request(i) for i in range(1, 9)]
    for i in range(400):  # the engine's drafts are accepted 30% of the time
        model.observe(others[i % 8], 1, int(i % 10 < 3))
    engine_rate = model.engine_rate()
    assert engine_rate == pytest.approx(0.3, abs=0.05)
    fresh = request()
    assert model.request_rate(fresh) == pytest.approx(engine_rate)
    model.observe(fresh, 1, 1)
    # a raw EMA (alpha 0.3, prior 0.7) would jump to 0.79; shrinkage keeps it near the engine
    assert model.request_rate(fresh) < engine_rate + 0.25 < 0.79
    assert model.expected_tokens(fresh, 1) == pytest.approx(1 + model.accept_probs(fresh, 1)[0])


def test_request_rate_follows_a_request_that_is_consistently_easier():
    model = AcceptanceModel(request_decay=0.1)
    hard, easy = request(1), request(2)
    for _ in range(200):
        model.observe(hard, 4, 0)
        model.observe(easy, 4, 4)
    assert model.request_rate(easy) > 0.8 > 0.3 > model.request_rate(hard)
    assert model.expected_tokens(easy, 4) > 2 * model.expected_tokens(hard, 4)


def test_one_early_rejection_at_a_deep_position_does_not_stop_the_policy_drafting_deeper():
    """Position 2 is measured only on steps that draft 2 tokens, which the policy chooses. Drafts
    are accepted 90% of the time at every position, but the one step that drafted 2 saw its second
    draft rejected: on the posterior mean (0.6 for position 2) drafting 2 does not pay, so it would
    never be measured again. Read optimistically (mean + one standard error), it drafts 2, and
    once position 2 is measured its true rate decides: 90% keeps it at 2 or more, 10% brings it
    back to 1."""
    # A target step costs 1.0 for 1-2 tokens, 1.2 for 3 and 0.1 more per token after; a draft
    # token 0.15 of a step: a second draft pays iff its acceptance (given the first's) > 0.64.
    spec = speculator_with([1.0, 1.0, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8], draft_s=0.15)
    r = request()
    rng = random.Random(1)
    spec.acceptance.observe(r, 2, 1)
    for _ in range(300):
        spec.acceptance.observe(r, 1, int(rng.random() < 0.9))
    assert spec.acceptance.position_rates(2)[1] < 0.7  # the mean after the one rejection
    assert spec.best_cap(1, [r], [4]) >= 2

    def run(rate: float) -> int:
        for _ in range(300):  # the policy's own choices decide which positions get measured
            cap = spec.best_cap(1, [r], [4])
            accepted = 0
            while accepted < cap and rng.random() < rate:
                accepted += 1
            spec.acceptance.observe(r, cap, accepted)
        return spec.best_cap(1, [r], [4])

    assert run(0.9) >= 2
    assert spec.acceptance.position_rates(2)[1] == pytest.approx(0.9, abs=0.08)
    assert run(0.1) <= 1  # the deep positions turn bad: measured, and no longer drafted


def test_calibration_medians_borrowing_and_buckets():
    cal = StepCalibration()
    assert cal.ratio(16, StepMode.CHAIN) == 1.0  # nothing measured
    for x in (1.2, 1.3, 9.0):  # one outlier step
        cal.add(16, StepMode.PLAIN, x)
    assert cal.ratio(16, StepMode.PLAIN) == pytest.approx(1.3)
    assert cal.ratio(16, StepMode.CHAIN) == pytest.approx(1.3)  # borrowed from the other side
    cal.add(16, StepMode.CHAIN, 1.5)
    assert cal.ratio(16, StepMode.CHAIN) == pytest.approx(1.5)
    assert cal.ratio(1, StepMode.PLAIN) == pytest.approx(1.3)  # nearest measured bucket


class FixedCostProposer:
    method = "draft"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.seconds * k

    pending = 0  # buffered rows of every request
    row_s = 0.0  # a row's catch-up

    def pending_rows_of(self, requests) -> list[int]:
        return [self.pending] * len(requests)

    def catch_up_seconds(self, rows: int) -> float:
        return rows * self.row_s


def speculator_with(step_s: list[float], draft_s: float = 0.0) -> Speculator:
    """A linear cost model: one request's step takes step_s[q - 1] for q tokens."""
    spec = Speculator(SpeculativeConfig(method="draft", model="unused"), FixedCostProposer(draft_s), 1000)
    qs = [1, 2, 3, 5, 9]
    spec.cost = StepCostModel([1], qs, [[step_s[q - 1] for q in qs]])
    return spec


class ClockRunner:
    """A runner for `Speculator.profile` on a fake clock: a step of b requests x q tokens takes
    1 + 0.1 (q - 1) ms per request, except the `burst` calls in a row from call `burst_at`, which
    take 3x (other work on the host). Its first call of each shape takes 2x (first-call costs)."""

    block_size = 16
    device = SimpleNamespace(type="cpu")

    def __init__(self, clock: list[float], burst_at: int, burst: int) -> None:
        self.kv_caches = [(SimpleNamespace(shape=(64,)), None)]
        self.clock, self.burst_at, self.burst, self.calls, self.seen = clock, burst_at, burst, 0, set()

    def forward(self, chunks):
        b, q = len(chunks), len(chunks[0].token_ids)
        ms = b * (1.0 + 0.1 * (q - 1))
        if (b, q) not in self.seen:
            self.seen.add((b, q))
            ms *= 2
        if self.burst_at <= self.calls < self.burst_at + self.burst:
            ms *= 3
        self.calls += 1
        self.clock[0] += ms / 1000
        return None, None

    def logits(self, hidden, tile):
        return None

    def tile_rows(self, chunks):
        return 0


@pytest.mark.parametrize("burst_at", [0, 3, 8, 20])
def test_the_startup_profile_is_not_bent_by_a_burst_of_noise(monkeypatch, burst_at):
    """A burst of 3 slow calls in a row (as many as one point's samples would take back to back),
    and the first call of each shape, leave the profiled curve at the true step times: the points are
    timed in interleaved rounds (plus an untimed first round) and each keeps its fastest."""
    import engine.spec_decode.cost_model as cost_model

    clock = [0.0]
    monkeypatch.setattr(cost_model, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    spec = Speculator(SpeculativeConfig(method="draft", model="unused"), FixedCostProposer(0.0), 1000)
    cost = spec.profile(ClockRunner(clock, burst_at, 3), max_num_seqs=1, max_tokens=2048)
    for q in cost.tokens_per_request:
        assert cost(1, q) == pytest.approx((1.0 + 0.1 * (q - 1)) / 1000)


def test_best_cap_speculates_only_for_a_clear_gain():
    # Verifying costs 10% more per extra token; drafts accepted with probability p.
    spec = speculator_with([1.0 + 0.1 * i for i in range(9)])
    r = request()
    for p, want_on in ((0.05, False), (0.12, False), (0.5, True)):
        spec.acceptance = AcceptanceModel(0.3)
        for i in range(2000):
            spec.acceptance.observe(r, 1, int(i % 100 < 100 * p))
        gain = spec.acceptance.expected_tokens(r, 1) / 1.1
        cap = spec.best_cap(1, [r], [1])
        assert (cap > 0) == want_on, (p, gain, cap)
        if not want_on:
            assert gain < MIN_GAIN


def test_best_cap_uses_measured_calibration():
    """Steps with drafts measured 40% slower than the model says turn a predicted gain into a loss."""
    spec = speculator_with([1.0 + 0.1 * i for i in range(9)])
    r = request()
    for i in range(1000):
        spec.acceptance.observe(r, 1, int(i % 10 < 4))  # 40%: 1.4 / 1.1 = 1.27x predicted
    assert spec.best_cap(1, [r], [1]) == 1
    for _ in range(8):
        spec.calibration.add(1, StepMode.PLAIN, 1.0)
        spec.calibration.add(1, StepMode.CHAIN, 1.4)
    assert spec.best_cap(1, [r], [1]) == 0


@pytest.mark.parametrize("floor", [True, False])
def test_a_batch_does_not_speculate_on_steps_with_drafts_measured_cheaper_than_steps_without(monkeypatch, floor):
    """16 requests whose decode steps without drafts measured 1.5x the curve and with drafts
    1.05x (a sustained load where speculating runs slower): with several requests a
    step with drafts is taken as at least as slow as the curve says steps without are
    (FLOOR_ON_AT_OFF), so the batch stays off; without the floor (the control) it speculates. One
    request keeps its own ratios."""
    from engine.spec_decode import speculator as spm

    monkeypatch.setattr(spm, "FLOOR_ON_AT_OFF", floor)
    spec = Speculator(SpeculativeConfig(method="draft", model="unused"), FixedCostProposer(0.0), 1000)
    qs = [1, 2, 3, 5, 9]
    spec.cost = StepCostModel([1, 16], qs, [[1.0 + 0.1 * (q - 1) for q in qs], [10.0 + 8.5 * (q - 1) for q in qs]])
    rs = [request(i) for i in range(16)]
    for i in range(1000):
        for r in rs:
            spec.acceptance.observe(r, 1, int(i % 10 < 8))  # 80% at position 1
    for _ in range(8):
        spec.calibration.add(16, StepMode.PLAIN, 1.5, 16)
        spec.calibration.add(16, StepMode.CHAIN, 1.05, 32)
        spec.calibration.add(1, StepMode.PLAIN, 1.5, 1)
        spec.calibration.add(1, StepMode.CHAIN, 1.05, 2)
    # raw: 16 * 1.8 tokens / (18.5 * 1.05) beats 16 / (10 * 1.5); floored: / (18.5 * 1.5) does not
    assert (spec.best_cap(16, rs, [1] * 16) == 0) == floor
    assert spec.best_cap(1, rs[:1], [1]) == 1


def test_a_catch_up_debt_is_weighed_over_the_steps_left():
    """16 requests whose drafts pay 15% a step (1 draft, accepted 80%; the step of 32 tokens 1.5x
    the step of 16), each with 200 buffered rows its drafter must first run (a catch-up of 3,200
    rows at 25 us: 80 ms). With 90 tokens left each (~50 steps at 1.8 tokens), 1.6 ms a step of
    debt still leaves a gain: speculate. With 10 left (~6 steps), 14 ms a step does not: stay off.
    Rows within a steady round (k + 1) are no debt; without a recorded catch-up cost there is none
    (the decision without debt)."""
    spec = Speculator(SpeculativeConfig(method="draft", model="unused"), FixedCostProposer(0.0), 1000)
    qs = [1, 2, 3, 5, 9]
    spec.cost = StepCostModel([16], qs, [[0.010 + 0.005 * (q - 1) for q in qs]])
    rs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0)) for i in range(16)]
    for i in range(1000):
        for r in rs:
            spec.acceptance.observe(r, 1, int(i % 10 < 8))
    spec.proposer.pending, spec.proposer.row_s = 200, 25e-6
    for r in rs:
        r.output_token_ids = [5] * 10  # 90 left
    assert spec.catch_up_debt(rs, [1] * 16) == pytest.approx(16 * 198 * 25e-6)
    assert spec.best_cap(16, rs, [1] * 16) == 1
    for r in rs:
        r.output_token_ids = [5] * 90  # 10 left
    assert spec.best_cap(16, rs, [1] * 16) == 0
    spec.proposer.pending = 2  # a steady round's rows
    assert spec.catch_up_debt(rs, [1] * 16) == 0.0 and spec.best_cap(16, rs, [1] * 16) == 1
    spec.proposer.pending, spec.proposer.row_s = 200, 0.0  # nothing recorded: no debt
    assert spec.best_cap(16, rs, [1] * 16) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.1, 100.0), min_size=1, max_size=12))
def test_monotone_is_the_least_squares_non_decreasing_fit(values):
    """Pool adjacent violators: non-decreasing, the same sum, unchanged where already sorted, and
    no worse in squared error than the running maximum (another non-decreasing fit)."""
    fit = monotone(values)
    assert len(fit) == len(values)
    assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(fit))
    assert sum(fit) == pytest.approx(sum(values))
    if values == sorted(values):
        assert fit == pytest.approx(values)
    running = [max(values[: i + 1]) for i in range(len(values))]
    err = sum((f - v) ** 2 for f, v in zip(fit, values, strict=True))
    assert err <= sum((r - v) ** 2 for r, v in zip(running, values, strict=True)) + 1e-9
    assert monotone([3.0, 1.0, 2.0, 5.0, 4.0]) == pytest.approx([2.0, 2.0, 2.0, 4.5, 4.5])


def test_a_lone_request_step_times_never_fall_with_more_drafts():
    """A point measured slow among faster neighbours (k = 5 above k = 4 and 6: noisy medians)
    does not make its neighbours look cheaper than it: the times per k are non-decreasing."""
    spec = speculator_with([1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4])
    for _ in range(8):
        for tokens, ratio in ((1, 1.0), (2, 1.0), (5, 1.0), (6, 1.5), (7, 1.0)):
            spec.calibration.add(1, StepMode.CHAIN if tokens > 1 else StepMode.PLAIN, ratio, tokens)
    times = spec._k_times(6, None)
    assert all(a <= b for a, b in itertools.pairwise(times)), times


class LookupProposer(Proposer):
    """Pretends to be n-gram lookup: drafts only for requests listed in `found`."""

    method = "ngram"
    propose_is_free = True

    def __init__(self, found: set[str]) -> None:
        super().__init__()
        self.found = found
        self.calls: list[list[str]] = []

    def step_cost(self, num_requests: int, k: int) -> float:
        return 0.0

    def propose(self, requests, num_tokens, context):
        self.calls.append([r.request_id for r in requests])
        return [Draft([7] * k if r.request_id in self.found else []) for r, k in zip(requests, num_tokens, strict=True)]


def test_free_proposer_looks_up_before_deciding():
    """Requests whose lookup finds nothing are not counted as speculating when the step decides."""
    proposer = LookupProposer({"r1"})
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3), proposer, 1000)
    spec.cost = StepCostModel([1, 4], [1, 2, 3, 5, 9], [[1.0, 1.01, 1.02, 1.04, 1.08]] * 2)
    seen = []
    real_best_cap = spec.best_cap

    def spy(n, requests, ks):
        seen.append(([r.request_id for r in requests], ks))
        return real_best_cap(n, requests, ks)

    spec.best_cap = spy
    requests = [request(i) for i in range(3)]
    for r in requests:
        r.block_ids = [0, 1, 2, 3]
        r.num_computed_tokens = r.num_tokens - 1  # decoding
    spec.init_kv_cache(64, 16)
    sched = SimpleNamespace(scheduled=[SimpleNamespace(request=r, spec_token_ids=[]) for r in requests])
    drafts = spec.propose_for_step(requests, sched, SimpleNamespace(sampled_token_ids=[[]] * 3), 1, ProposeContext({}))
    assert proposer.calls == [["r0", "r1", "r2"]]  # looked up once, for every candidate
    assert seen == [(["r1"], [3])]
    assert {rid: d.token_ids for rid, d in drafts.items()} == {"r1": [7, 7, 7]}


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    cuts=st.lists(st.integers(1, 60), max_size=6),
    n_min=st.integers(1, 2),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
    count=st.integers(1, 3),
)
def test_ngram_index_equals_the_scan(tokens, cuts, n_min, extra, k, count):
    """The incremental n-gram index proposes exactly what the reference scan proposes, at every
    length a request grows through (small alphabet: many matches, overlaps and ties): the latest
    match's continuation, and (trees) the `count` latest ones."""
    from engine.spec_decode.proposers.ngram import NgramIndex, ngram_lookup, ngram_lookup_many

    index = NgramIndex(n_min, n_min + extra, keep=count)
    for cut in sorted({min(c, len(tokens)) for c in cuts} | {len(tokens)}):
        prefix = tokens[:cut]
        assert index.lookup(prefix, k) == ngram_lookup(prefix, n_min, n_min + extra, k)
        assert index.lookup_many(prefix, k, count) == ngram_lookup_many(prefix, n_min, n_min + extra, k, count)


def test_choose_k_maximizes_tokens_per_second_on_the_measured_curve():
    """Verifying is flat up to 5 tokens and steep after (as a CPU's products are until a second
    pass over the weights); each draft is accepted with probability 0.85 given the one before, a
    draft costs 0.05 of a step; k <= 8. The best k is 4 (expected 3.70 tokens in 1.26 steps'
    time: 2.94 per step; k = 3: 2.67, k = 5: 2.31); a linear verify cost (the curve's mean slope,
    0.25 of a step per token) would draft 7, deep into the steep part. With free verification
    every draft up to the cap pays."""
    def spec_on(step_s: list[float]) -> Speculator:
        spec = Speculator(SpeculativeConfig(method="draft", model="unused", num_speculative_tokens=8),
                          FixedCostProposer(0.05), 1000)
        qs = [1, 2, 3, 4, 5, 7, 9]
        spec.cost = StepCostModel([1], qs, [[step_s[q - 1] for q in qs]])
        return spec

    probs = [0.85**j for j in range(1, 9)]
    assert spec_on([1.0, 1.0, 1.02, 1.04, 1.06, 1.5, 2.0, 2.5, 3.0])._best_k(probs, 8) == 4
    assert spec_on([1.0] * 9)._best_k(probs, 8) == 8
    assert spec_on([1.0] + [6.0] * 8)._best_k(probs, 8) == 0  # verification costs more than drafts bring


def test_probes_of_a_batch_whose_drafts_do_not_pay_thin_out_as_it_grows():
    """One probe every 32 steps up to 7 requests, 32 per 4 requests beyond (a probe verifies a draft
    of every request)."""
    from engine.spec_decode.speculator import probe_interval

    assert [probe_interval(b) for b in (1, 4, 7, 8, 16, 64)] == [32, 32, 32, 64, 128, 512]


def test_probes_that_keep_finding_no_gain_thin_out_and_one_that_finds_it_restores_them(tmp_path, monkeypatch):
    """A probe after which the drafts still do not pay doubles the steps to the next probe, up to
    2**PROBE_BACKOFF_MAX times `probe_interval` (here 4: probes at 0, 8, 16, 32, 64, 96); once
    they pay, every step speculates, and once they stop paying the interval is back to 4."""
    from helpers import save_tiny_model

    import engine.spec_decode.speculator as speculator_mod
    from engine import LLMEngine

    assert speculator_mod.PROBE_BACKOFF_MAX == 3
    target = save_tiny_model(str(tmp_path / "t"), "llama")
    engine = LLMEngine(target, dtype="float32", device="cpu",
                       speculative=SpeculativeConfig(method="draft", model=target, num_speculative_tokens=3))
    pays = [False]
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 3)
    monkeypatch.setattr(engine.speculator, "best_cap", lambda num_decoding, requests, ks: 3 if pays[0] else 0)
    monkeypatch.setattr(speculator_mod, "probe_interval", lambda num_decoding: 4)
    verified = []  # steps that verified drafts: a decision at the step before drafted them
    engine.step_listeners.append(lambda record: record.num_spec_requests and verified.append(record.step_index))
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))

    def run_to(step_index: int) -> None:
        while engine.step_index < step_index and engine.has_unfinished_requests():
            engine.step()
        assert engine.step_index == step_index

    run_to(90)
    assert [s - 1 for s in verified] == [0, 8, 16, 32, 64]
    assert engine.speculator.probes.doublings == 3
    pays[0] = True  # the next weighing (at 96, a probe step) finds a gain: every step from it drafts
    run_to(100)
    assert [s - 1 for s in verified][5:] == [96, 97, 98]
    assert engine.speculator.probes.doublings == 0
    pays[0] = False  # no gain again (from 100 on): a probe at once (100), then thinning out again
    run_to(125)
    assert [s - 1 for s in verified][8:] == [99, 100, 104, 112]


@pytest.mark.parametrize("recheck", [1, 8])
def test_a_step_without_drafts_is_weighed_again_after_off_recheck_steps(tmp_path, monkeypatch, recheck):
    """After a step whose drafts do not pay, the same decoding requests go without drafts for
    OFF_RECHECK - 1 steps without weighing them again; a new request (another set) weighs at
    once."""
    from helpers import save_tiny_model

    import engine.spec_decode.speculator as speculator_mod
    from engine import LLMEngine, SpeculativeConfig

    monkeypatch.setattr(speculator_mod, "OFF_RECHECK", recheck)
    target = save_tiny_model(str(tmp_path / "t"), "llama")
    engine = LLMEngine(target, dtype="float32", device="cpu",
                       speculative=SpeculativeConfig(method="draft", model=target, num_speculative_tokens=3))
    weighed = []
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 3)  # alone, drafts would pay
    monkeypatch.setattr(engine.speculator, "best_cap", lambda num_decoding, requests, ks: weighed.append(
        engine.step_index) or 0)
    monkeypatch.setattr(speculator_mod, "probe_interval", lambda num_decoding: 1000)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4], params)
    engine.add_request("b", [5, 6, 7], params)
    for _ in range(20):
        engine.step()
    if recheck == 1:
        assert len(weighed) == 20
    else:
        # step 0 probes (0 % probe_interval: a cap forced to 1 opens no window), then every 8th
        assert weighed == [0, 1, 9, 17]
    n = len(weighed)
    engine.add_request("c", [8, 9], params)
    engine.step()  # c's prefill gives its first token: a, b, c decode now, another set, weighed at once
    assert len(weighed) == n + 1 and weighed[-1] == engine.step_index - 1
    assert engine.spec_stats.num_draft_tokens <= 2  # step 0's probe (0 % probe_interval), one draft each


def test_a_probe_drafts_only_for_requests_caught_up_or_the_closest_one():
    """While speculation is off a layer drafter's rows wait (feature_buffers.LAZY_BUFFER_ROWS): a probe
    drafts for the requests with at most PROBE_CATCH_UP_ROWS to catch up, or, if none, for the
    one with the fewest, never running every request's wait at once."""
    from engine.spec_decode.speculator import PROBE_CATCH_UP_ROWS

    spec = speculator_with([1.0] * 9)
    waiting = {"a": 200, "b": PROBE_CATCH_UP_ROWS, "c": 3, "d": 90}
    spec.proposer.pending_rows_of = lambda rs: [waiting[r.request_id] for r in rs]
    reqs = [Request(rid, [1, 2, 3], SamplingParams()) for rid in waiting]
    assert spec._cheap_probes(reqs) == [1, 2]
    waiting.update(b=40, c=30)
    assert spec._cheap_probes(reqs) == [2]


def test_calibration_points_take_over_from_their_side_once_measured():
    """A (side, batch bucket, tokens per request) point's own median is used from POINT_SAMPLES
    steps on; before that the side's; without `borrow`, another bucket's measurements do not count."""

    cal = StepCalibration()
    for _ in range(4):
        cal.add(1, StepMode.CHAIN, 1.2, num_tokens=3)
    assert cal.ratio(1, StepMode.CHAIN, 3) == pytest.approx(1.2)
    for _ in range(POINT_SAMPLES):
        assert cal.ratio(1, StepMode.CHAIN, 6) == pytest.approx(1.2)  # the side's median until the point has enough
        cal.add(1, StepMode.CHAIN, 0.7, num_tokens=6)
    assert cal.samples(1, StepMode.CHAIN, 6) == POINT_SAMPLES
    assert cal.ratio(1, StepMode.CHAIN, 6) == pytest.approx(0.7)
    assert cal.ratio(1, StepMode.CHAIN, 3) == pytest.approx(1.2)
    assert cal.ratio(16, StepMode.CHAIN, 32) == pytest.approx(cal.ratio(1, StepMode.CHAIN))  # borrowed from batch 1's side
    assert cal.ratio(16, StepMode.CHAIN, 32, borrow=False) == 1.0
    # 16 requests with 32 tokens in the step: 2 tokens a request, a point of its own
    for _ in range(POINT_SAMPLES):
        cal.add(16, StepMode.CHAIN, 1.5, num_tokens=32)
    assert cal.ratio(16, StepMode.CHAIN, 31) == pytest.approx(1.5) and cal.ratio(1, StepMode.CHAIN, 2) == pytest.approx(1.2)
    assert cal.as_dict()["on@1x6"] == pytest.approx(0.7) and cal.as_dict()["on@16x2"] == pytest.approx(1.5)


class ChainDrafter(Proposer):
    method = "draft"

    def step_cost(self, num_requests: int, k: int) -> float:
        return 0.02 * k

    def propose(self, requests, num_tokens, context):
        return [Draft([7] * k) for k in num_tokens]


TRUE_STEP_S = [1.0, 1.05, 1.1, 1.15, 1.2, 1.8, 2.4, 3.0, 3.6]  # q tokens: one request's step, as measured


def lone_request_ks(profile: list[float], true: list[float], host=lambda step: 1.0, steps: int = 400,
                    accept: float = 0.85) -> tuple[Speculator, list[int]]:
    """One request decoding alone through the adaptive policy for `steps` steps: the start-up
    curve says `profile`, a step of q tokens takes true[q - 1] x host(step) (plus up to 1% noise),
    each draft is accepted with probability `accept` given the one before, a draft costs 0.02.
    Returns the speculator and the k drafted at each step."""
    spec = Speculator(SpeculativeConfig(method="draft", model="unused", num_speculative_tokens=8),
                      ChainDrafter(), 100_000)
    spec.cost = StepCostModel([1], list(range(1, 10)), [profile])
    spec.init_kv_cache(10_000, 16)
    r = Request("r0", [1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0.0))
    r.block_ids = list(range(1000))
    r.num_computed_tokens = r.num_tokens - 1
    rng = random.Random(0)
    drafts: list[int] = []
    ks = []
    for step in range(1, steps):
        accepted = 0
        while accepted < len(drafts) and rng.random() < accept:
            accepted += 1
        s = SimpleNamespace(request=r, spec_token_ids=drafts, spec_tree=None, num_new_tokens=1)
        sched = SimpleNamespace(scheduled=[s], num_batched_tokens=1 + len(drafts))
        spec.observe_step_time(sched, (true[len(drafts)] + 0.01 * rng.random()) * host(step))
        out = spec.propose_for_step([r], sched, SimpleNamespace(sampled_token_ids=[[0] * (accepted + 1)]), step,
                                    ProposeContext({}))
        drafts = list(out["r0"].token_ids) if "r0" in out else []
        ks.append(len(drafts))
    return spec, ks


@pytest.mark.parametrize("explore", [True, False])
def test_a_lone_request_drafts_the_k_its_measured_steps_favour(monkeypatch, explore):
    """The start-up curve overprices steps of 4 tokens and more by 1.6x (a profile disturbed on a
    shared host): on it, the best k is 2. The steps as measured (each draft accepted with
    probability 0.85 given the one before, a draft 0.02 s) make 4 the best (2.90 tokens a second
    vs 2.26 at k = 2). Exploring a neighbour of the best k while its point is unmeasured climbs
    there; without exploring, the policy stays at 2 (the negative control)."""
    import engine.spec_decode.speculator as speculator_mod

    if not explore:
        monkeypatch.setattr(speculator_mod, "EXPLORE_EVERY", 10**9)
        monkeypatch.setattr(speculator_mod, "EXPLORE_REFRESH", 10**9)
    profile = [t * (1.6 if q >= 4 else 1.0) for q, t in enumerate(TRUE_STEP_S, 1)]
    spec, ks = lone_request_ks(profile, TRUE_STEP_S)
    common = max(set(ks[-200:]), key=ks[-200:].count)
    if explore:
        assert common == 4, sorted(collections.Counter(ks[-200:]).items())
        assert spec.num_explored <= 200 // speculator_mod.EXPLORE_EVERY  # a neighbour, at most every 4th step
    else:
        assert common == 2 and spec.num_explored == 0


@pytest.mark.parametrize("drift", [True, False])
def test_a_host_slowed_for_a_while_does_not_leave_the_policy_drafting_less(monkeypatch, drift):
    """The start-up curve is right (k = 4 pays most), but the host runs 2.5x slower for 60 steps
    while the policy drafts 4: the points it measures then read slow while the others keep their
    earlier, fast steps, so k falls. With the host's speed read as a drift shared by every point,
    the slowdown moves them all and k stays (or comes back) at 4 once the host recovers. Negative
    control: without the drift (DRIFT_WINDOW = 0, each point its raw ratios) the
    points measured slow keep their ratios and the policy drafts less than 4 after the recovery."""
    import engine.spec_decode.cost_model as cost_model

    if not drift:
        monkeypatch.setattr(cost_model, "DRIFT_WINDOW", 0)
    spec, ks = lone_request_ks(TRUE_STEP_S, TRUE_STEP_S, host=lambda step: 2.5 if 100 <= step < 160 else 1.0)
    after = ks[200:]
    common = max(set(after), key=after.count)
    if drift:
        assert common == 4, sorted(collections.Counter(after).items())
        assert spec.calibration.ratio(1, StepMode.CHAIN, 5) == pytest.approx(1.0, abs=0.05)
    else:
        assert common < 4, sorted(collections.Counter(after).items())


def test_a_points_ratio_does_not_move_with_the_mix_of_other_points():
    """Steps of 3 tokens measure 1.0x the curve and steps of 6 tokens 1.25x, first one 6-token
    step in four, then three in four (the policy's k changed, the host did not). Each point reads
    its own steps: 1.0 and 1.25 throughout. (Read relative to the mode's median at the time, the
    6-token point would come out 1.25 / 1.0 * 1.25 = 1.56x once the mix changed.)"""
    cal = StepCalibration()
    for i in range(32):
        six = i % 4 == 3
        cal.add(1, StepMode.CHAIN, 1.25 if six else 1.0, num_tokens=6 if six else 3)
    assert cal.ratio(1, StepMode.CHAIN, 6) == pytest.approx(1.25) and cal.ratio(1, StepMode.CHAIN, 3) == pytest.approx(1.0)
    for i in range(32):
        six = i % 4 != 3
        cal.add(1, StepMode.CHAIN, 1.25 if six else 1.0, num_tokens=6 if six else 3)
    assert cal.ratio(1, StepMode.CHAIN, 6) == pytest.approx(1.25) and cal.ratio(1, StepMode.CHAIN, 3) == pytest.approx(1.0)


def test_a_point_not_measured_for_a_while_is_forgotten_and_explored_again():
    """Steps of 6 tokens measured at 0.8 while the host was fast; then the host slows by 1.5x and
    only 3-token steps run. Within POINT_HORIZON steps the 6-token point keeps its shape and
    follows the host (0.8 x 1.5); after it, it reads as unmeasured (its side's median shape, 1.0,
    times the host's level now, 1.5) and counts no samples, so a lone request explores it again."""
    from engine.spec_decode.cost_model import POINT_HORIZON

    cal = StepCalibration()
    for i in range(24):
        cal.add(1, StepMode.CHAIN, 0.8 if i % 4 == 3 else 1.0, num_tokens=6 if i % 4 == 3 else 3)
    for _ in range(POINT_HORIZON - 24):  # (the first 6-token step, the 4th, is POINT_HORIZON - 4 steps ago)
        cal.add(1, StepMode.CHAIN, 1.5, num_tokens=3)
    assert cal.ratio(1, StepMode.CHAIN, 6) == pytest.approx(1.2) and cal.samples(1, StepMode.CHAIN, 6) == 6
    for _ in range(16):  # 4 of the 6 fall past the horizon
        cal.add(1, StepMode.CHAIN, 1.5, num_tokens=3)
    assert cal.samples(1, StepMode.CHAIN, 6) < POINT_SAMPLES
    assert cal.ratio(1, StepMode.CHAIN, 6) == pytest.approx(1.5)
    # other batch buckets keep their own clocks (and drifts)
    for _ in range(3):
        cal.add(16, StepMode.PLAIN, 1.1, num_tokens=16)
    for _ in range(2 * POINT_HORIZON):
        cal.add(1, StepMode.CHAIN, 1.5, num_tokens=3)
    assert cal.ratio(16, StepMode.PLAIN, 16) == pytest.approx(1.1)



class PricedChainDrafter(ChainDrafter):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.seconds * k


def batch_speculator(acceptance: float = 0.65, priced_s: float = 0.0005) -> tuple[Speculator, list[Request]]:
    """16 decoding requests whose first drafts are accepted `acceptance` of the time; the curve:
    16 requests take 10 ms a step with one token each, 15 ms with two; one draft each is priced
    at `priced_s`. At 65%: ~26 tokens in 15.5 ms against 16 in 10, a predicted gain of ~4%."""
    spec = Speculator(SpeculativeConfig(method="draft", model="unused", num_speculative_tokens=1),
                      PricedChainDrafter(priced_s), 1 << 20)
    qs = [1, 2, 3, 5, 9]
    # (one request alone: its step of 2 tokens 1.05x its step of 1, so that each request's k is 1)
    spec.cost = StepCostModel([1, 16], qs, [[0.001 * (1 + 0.05 * (q - 1)) for q in qs],
                                            [0.010 * (1 + 0.5 * (q - 1)) for q in qs]])
    spec.init_kv_cache(64, 16)
    rs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1 << 20, temperature=0.0)) for i in range(16)]
    rng = random.Random(0)
    for r in rs:
        r.block_ids = [0, 1, 2, 3]
        r.num_computed_tokens = r.num_tokens - 1  # decoding
        for _ in range(200):
            spec.acceptance.observe(r, 1, int(rng.random() < acceptance))
    for _ in range(POINT_SAMPLES):  # both sides measured as the curve says
        spec.calibration.add(16, StepMode.PLAIN, 1.0, 16)
        spec.calibration.add(16, StepMode.CHAIN, 1.0, 32)
    return spec, rs


@pytest.mark.parametrize("measured", [True, False])
def test_a_batch_whose_steps_with_drafts_run_under_their_prediction_stops_drafting(measured):
    """The batch's drafting takes 2.5 ms where it is priced at 0.5 (the drafter's bookkeeping of
    the verified rows, the policy's own time): its steps with drafts make 26 tokens in 17.5 ms,
    ~0.9x the tokens/s predicted, and lose to 16 tokens in 10 ms. Once REALIZED_MIN such steps
    are measured (`_observe_realized`: tokens / (the step's time + the drafting that made its
    drafts) against the prediction), the batch stops drafting; without them (the control) it
    drafts."""
    from engine.spec_decode.speculator import REALIZED_MIN

    spec, rs = batch_speculator()
    cap = spec.best_cap(16, rs, [1] * 16)
    assert cap == 1
    predicted = spec._chain_rate
    if measured:
        for _ in range(REALIZED_MIN):
            spec._prediction = (16, predicted)
            spec._last_execute_s, spec._last_draft_s = 0.015, 0.0025
            sched = SimpleNamespace(scheduled=[SimpleNamespace(request=r, spec_token_ids=[7], num_new_tokens=1)
                                               for r in rs])
            sampled = [[7, 7]] * 10 + [[7]] * 6  # 26 tokens
            spec._observe_realized(sched, SimpleNamespace(sampled_token_ids=sampled))
        assert spec.realized_ratio(16) == pytest.approx(26 / 0.0175 / predicted)
        assert spec.realized_ratio(1) == 1.0  # one request: its own calibration and exploration
    assert (spec.best_cap(16, rs, [1] * 16) == 0) == measured


def test_a_batch_measures_its_steps_without_drafts_again():
    """The batch's only steps without drafts ran during a transient (2.7x the curve, the first
    steps after its prompts' prefill) and it then speculated: within BATCH_POINT_HORIZON steps of
    the bucket that point expires, and while it holds fewer than POINT_SAMPLES recent steps a
    speculating batch goes without drafts once every OFF_PROBE_EVERY steps; three such steps at
    the curve bring its price back (not the transient's)."""
    from engine.spec_decode.cost_model import BATCH_POINT_HORIZON
    from engine.spec_decode.speculator import OFF_PROBE_EVERY

    spec, rs = batch_speculator(acceptance=0.9)
    spec.calibration = StepCalibration()
    for _ in range(9):
        spec.calibration.add(16, StepMode.PLAIN, 2.7, 16)
    for _ in range(BATCH_POINT_HORIZON):
        spec.calibration.add(16, StepMode.CHAIN, 1.0, 32)
    assert spec.calibration.samples(16, StepMode.PLAIN, 16) == 0
    sched = SimpleNamespace(scheduled=[SimpleNamespace(request=r, spec_token_ids=[7], num_new_tokens=1,
                                                       spec_tree=None) for r in rs])
    out = SimpleNamespace(sampled_token_ids=[[7, 7]] * 16)
    drafted = [bool(spec.propose_for_step(rs, sched, out, step, ProposeContext({}))) for step in range(1, 3 * OFF_PROBE_EVERY + 1)]
    probes = [i + 1 for i, d in enumerate(drafted) if not d]
    assert probes == [OFF_PROBE_EVERY, 2 * OFF_PROBE_EVERY, 3 * OFF_PROBE_EVERY] and spec.num_off_probes == 3
    for _ in range(POINT_SAMPLES):  # the probes' steps, measured at the curve
        spec.calibration.add(16, StepMode.PLAIN, 1.0, 16)
    assert spec.calibration.ratio(16, StepMode.PLAIN, 16) == pytest.approx(1.0)
    assert not spec.propose_for_step(rs, sched, out, 4 * OFF_PROBE_EVERY, ProposeContext({})) == {}
