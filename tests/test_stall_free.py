"""Stall-free chunked prefill: the step cost fit (engine/step_cost.py), the scheduler's prefill cap
beside decoding streams (`decode_step_budget_s`), and the engine's outputs, which chunking must
not change. Scheduler and engine checks read a fake cost model, so no assertion depends on timing."""

from __future__ import annotations

import random

import pytest
from helpers import assert_no_leaked_blocks, save_tiny_model

from engine import LLMEngine, SamplingParams
from engine.block_manager import KVBlockManager
from engine.config import SchedulerConfig
from engine.request import Request
from engine.scheduler import UNFITTED_PREFILL_CHUNK, Scheduler, is_decoding_stream
from engine.step_cost import StepCostModel

FIXED_S, PER_TOKEN_S = 0.02, 1e-4
SIZES = [1, 2, 3, 4, 6, 8, 40, 100, 256, 700, 1500]


def feed(model: StepCostModel, rng: random.Random, n: int, fixed_s: float, per_token_s: float,
         sizes=SIZES, noise: float = 0.03) -> None:
    for _ in range(n):
        tokens = rng.choice(sizes)
        model.observe(tokens, (fixed_s + per_token_s * tokens) * (1 + rng.uniform(-noise, noise)))


# --- the step cost fit ----------------------------------------------------------------------
def test_fit_recovers_a_known_line():
    model = StepCostModel()
    feed(model, random.Random(0), 400, FIXED_S, PER_TOKEN_S)
    assert model.fixed_s == pytest.approx(FIXED_S, rel=0.1)
    assert model.per_token_s == pytest.approx(PER_TOKEN_S, rel=0.05)
    assert model.prefill_tokens_per_s() == pytest.approx(1 / PER_TOKEN_S, rel=0.05)
    assert model.predict_s(1000) == pytest.approx(FIXED_S + 1000 * PER_TOKEN_S, rel=0.05)
    # 0.05 s holds (0.05 - 0.02) / 1e-4 = 300 tokens; less than the fixed cost holds none
    assert model.tokens_within(0.05) == pytest.approx(300, rel=0.1)
    assert model.tokens_within(0.001) == 0


def test_no_fit_before_steps_of_clearly_different_sizes():
    model = StepCostModel()
    feed(model, random.Random(1), 200, FIXED_S, PER_TOKEN_S, sizes=[1, 2, 4, 5, 8])  # decode steps only
    assert model.tokens_within(0.05) is None
    assert model.prefill_tokens_per_s() is None and model.fixed_s is None and model.predict_s(10) is None
    model.observe(300, FIXED_S + 300 * PER_TOKEN_S)  # one prefill step gives the slope
    assert model.tokens_within(0.05) is not None
    assert model.per_token_s == pytest.approx(PER_TOKEN_S, rel=0.1)


def test_slope_stays_positive_and_errs_toward_smaller_steps():
    """Noise that makes larger steps look faster gives no slope <= 0: the largest size's seconds
    per token, through the origin, a cost per token above the truth."""
    model = StepCostModel()
    for _ in range(5):
        model.observe(1, 0.050)
        model.observe(40, 0.048)
    assert model.per_token_s == pytest.approx(0.048 / 40)
    assert model.fixed_s == 0.0
    assert model.tokens_within(0.048) == 40


def test_a_pause_does_not_wreck_the_fit():
    model = StepCostModel()
    rng = random.Random(2)
    feed(model, rng, 300, FIXED_S, PER_TOKEN_S)
    before = (model.fixed_s, model.per_token_s)
    model.observe(1, 2.0)  # a 2 s garbage-collection pause in a decode step
    model.observe(700, 3.0)
    assert model.fixed_s == pytest.approx(before[0], rel=0.1)
    assert model.per_token_s == pytest.approx(before[1], rel=0.1)


def test_fit_follows_a_change_of_speed():
    model = StepCostModel()
    rng = random.Random(3)
    feed(model, rng, 300, FIXED_S, PER_TOKEN_S)
    feed(model, rng, 600, 2 * FIXED_S, 3 * PER_TOKEN_S)  # the host slowed down
    assert model.fixed_s == pytest.approx(2 * FIXED_S, rel=0.15)
    assert model.per_token_s == pytest.approx(3 * PER_TOKEN_S, rel=0.1)


@pytest.mark.parametrize("num_tokens,seconds", [(0, 0.1), (-3, 0.1), (1.5, 0.1), (4, -0.1), (4, float("nan"))])
def test_observe_refuses_impossible_steps(num_tokens, seconds):
    with pytest.raises(ValueError):
        StepCostModel().observe(num_tokens, seconds)


@pytest.mark.parametrize("budget", [0, -0.1, True, "0.1", float("inf")])
def test_config_refuses_a_budget_that_is_not_positive(budget):
    with pytest.raises(ValueError, match="decode_step_budget_s"):
        SchedulerConfig(decode_step_budget_s=budget)


# --- the scheduler's prefill cap ------------------------------------------------------------
class FakeCost:
    """`tokens_within` gives a fixed answer and counts the calls."""

    def __init__(self, within: int | None) -> None:
        self.within = within
        self.num_calls = 0
        self.asked: list[float] = []  # the seconds of each call

    def tokens_within(self, seconds: float) -> int | None:
        self.num_calls += 1
        self.asked.append(seconds)
        return self.within


BLOCK = 4
PARAMS = SamplingParams(max_tokens=50, temperature=0.0)


def make_scheduler(within: int | None, budget: float | None = 0.05, lookahead: int = 3,
                   max_num_batched_tokens: int = 2048, idle_step_budget_s: float | None = None) -> Scheduler:
    bm = KVBlockManager(1000, BLOCK, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, max_model_len=2000,
                     num_lookahead_tokens=lookahead, decode_step_budget_s=budget, step_cost=FakeCost(within),
                     idle_step_budget_s=idle_step_budget_s)


def add_decoding(sched: Scheduler, request_id: str, drafts: list[int] = ()) -> Request:
    """A request past its prompt (its prefill and first token done), with `drafts` to verify."""
    request = Request(request_id, [1] * 10, PARAMS)
    sched.add_request(request)
    commit(sched, sched.schedule())
    assert is_decoding_stream(request)
    request.spec_token_ids = list(drafts)
    return request


def commit(sched: Scheduler, out) -> None:
    """Each request that reaches its last token samples token 7 (its drafts rejected)."""
    sched.update_from_output(out, [[7] if s.needs_sample else [] for s in out.scheduled])


def tokens_of(out, request: Request) -> tuple[int, int]:
    (s,) = [s for s in out.scheduled if s.request is request]
    return s.num_new_tokens, len(s.spec_token_ids)


def test_cap_applies_only_while_something_decodes():
    sched = make_scheduler(within=100)
    alone = Request("alone", [2] * 600, PARAMS)
    sched.add_request(alone)
    assert tokens_of(sched.schedule(), alone) == (600, 0)  # nothing to stall: the whole prompt
    assert sched.step_cost.num_calls == 0

    sched = make_scheduler(within=100)
    d = add_decoding(sched, "d")
    long = Request("long", [2] * 600, PARAMS)
    sched.add_request(long)
    out = sched.schedule()
    assert tokens_of(out, d) == (1, 0)
    assert tokens_of(out, long) == (99, 0)
    assert out.num_batched_tokens == 100


def test_idle_step_budget_cuts_a_prompt_with_nothing_decoding_too():
    """A decode replica's engine: a stream imported during a step waits for all of it, so a
    long prompt goes in chunks of the idle budget even before anything decodes there."""
    sched = make_scheduler(within=100, idle_step_budget_s=0.5)
    alone = Request("alone", [2] * 600, PARAMS)
    sched.add_request(alone)
    out = sched.schedule()
    assert tokens_of(out, alone) == (100, 0)
    commit(sched, out)
    assert tokens_of(sched.schedule(), alone) == (100, 0)  # every chunk, until it decodes


def test_the_step_budget_is_the_tpot_one_while_a_stream_decodes_else_the_idle_one():
    sched = make_scheduler(within=100, idle_step_budget_s=0.5)
    assert sched.step_budget_s() == 0.5  # nothing decodes
    sched.prefill_token_cap()
    assert sched.step_cost.asked[-1] == 0.5
    add_decoding(sched, "d")
    assert sched.step_budget_s() == pytest.approx(0.05)
    assert make_scheduler(within=100).step_budget_s() is None
    assert make_scheduler(within=100, budget=None, idle_step_budget_s=0.5).step_budget_s() is None


def test_decoding_requests_keep_their_token_and_drafts():
    sched = make_scheduler(within=50)
    d1 = add_decoding(sched, "d1")
    d2 = add_decoding(sched, "d2", [4, 4])
    d1.spec_token_ids = [3, 3, 3]  # (a step commits or drops drafts: set after d2's step)
    long = Request("long", [2] * 600, PARAMS)
    sched.add_request(long)
    out = sched.schedule()
    assert tokens_of(out, d1) == (1, 3) and tokens_of(out, d2) == (1, 2)
    assert tokens_of(out, long) == (50 - 4 - 3, 0)


def test_cap_is_shared_by_running_prompts_and_new_ones_oldest_first():
    """A prompt still prefilling takes its chunk before a newly admitted one; the cap covers both."""
    sched = make_scheduler(within=60)
    d = add_decoding(sched, "d")
    first = Request("first", [2] * 100, PARAMS)
    sched.add_request(first)
    out = sched.schedule()
    assert tokens_of(out, d) == (1, 0) and tokens_of(out, first) == (59, 0)
    commit(sched, out)
    second = Request("second", [5] * 300, PARAMS)
    sched.add_request(second)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [d, first, second]
    assert tokens_of(out, d) == (1, 0)
    assert tokens_of(out, first) == (41, 0)  # the rest of its prompt
    assert tokens_of(out, second) == (59 - 41, 0)


def test_a_short_prompt_goes_before_the_rest_of_a_long_one():
    """Under the cap, a prompt shorter than what a running prompt has left to prefill takes its
    tokens first (it would otherwise wait for the whole long prompt); the long one gets the rest."""
    sched = make_scheduler(within=60)
    d = add_decoding(sched, "d")
    long = Request("long", [2] * 500, PARAMS)
    sched.add_request(long)
    commit(sched, sched.schedule())  # 59 of its 500 tokens
    short = Request("short", [5] * 20, PARAMS)
    sched.add_request(short)
    out = sched.schedule()
    assert tokens_of(out, d) == (1, 0)
    assert tokens_of(out, short) == (20, 0)  # all of it, this step
    assert tokens_of(out, long) == (59 - 20, 0)
    commit(sched, out)
    assert short.num_output_tokens == 1 and long.num_output_tokens == 0
    too_long = Request("too_long", [5] * 450, PARAMS)  # not shorter than the 402 tokens long has left
    sched.add_request(too_long)
    out = sched.schedule()
    assert tokens_of(out, long)[0] > 0 and too_long not in [s.request for s in out.scheduled]


def test_cap_never_goes_below_one_block_and_falls_back_before_a_fit():
    sched = make_scheduler(within=0)  # a step's fixed cost already exceeds the budget
    add_decoding(sched, "d", [3, 3])
    long = Request("long", [2] * 600, PARAMS)
    sched.add_request(long)
    assert tokens_of(sched.schedule(), long) == (BLOCK, 0)

    sched = make_scheduler(within=None)  # no fit yet
    add_decoding(sched, "d", [3, 3])
    long = Request("long", [2] * 600, PARAMS)
    sched.add_request(long)
    assert tokens_of(sched.schedule(), long) == (UNFITTED_PREFILL_CHUNK, 0)


def test_cap_leaves_the_decoding_tokens_room_in_max_num_batched_tokens():
    sched = make_scheduler(within=10_000, max_num_batched_tokens=200)
    d = add_decoding(sched, "d", [3, 3, 3])
    long = Request("long", [2] * 600, PARAMS)
    sched.add_request(long)
    out = sched.schedule()
    assert tokens_of(out, d) == (1, 3) and tokens_of(out, long) == (196, 0)


def test_without_a_budget_prefill_takes_the_whole_step_budget():
    sched = make_scheduler(within=50, budget=None)
    d = add_decoding(sched, "d", [3, 3, 3])
    long = Request("long", [2] * 3000, PARAMS)
    sched.add_request(long)
    out = sched.schedule()
    assert tokens_of(out, d) == (1, 3) and tokens_of(out, long) == (2048 - 4, 0)
    assert sched.step_cost.num_calls == 0


def test_scheduler_refuses_a_budget_without_a_cost_model():
    with pytest.raises(ValueError, match="step_cost"):
        Scheduler(KVBlockManager(10, 4), 4, 64, 40, decode_step_budget_s=0.05)


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_respect_the_cap_and_never_leak(seed):
    """Random arrivals, drafts, aborts and a small pool (preemption): every step's prefill tokens
    stay within the cap whenever a request decodes, every request finishes, no block leaks."""
    rng = random.Random(seed)
    num_blocks = rng.randint(20, 60)
    bm = KVBlockManager(num_blocks, BLOCK, rng.random() < 0.5)
    lookahead = rng.choice([0, 3])
    max_model_len = num_blocks * BLOCK - lookahead
    within = rng.choice([None, 0, 5, 30, 500])
    sched = Scheduler(bm, max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(8, 120),
                      max_model_len=max_model_len, num_lookahead_tokens=lookahead, decode_step_budget_s=0.05,
                      step_cost=FakeCost(within))
    num_requests, added, step = rng.randint(1, 10), 0, 0
    arrivals = sorted(rng.randint(0, 40) for _ in range(num_requests))
    while added < num_requests or sched.has_unfinished_requests():
        while added < num_requests and arrivals[added] <= step:
            prompt = [rng.randrange(7) for _ in range(rng.randint(1, max_model_len - 1))]
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0)
            sched.add_request(Request(f"r{added}", prompt, params, eos_token_ids=(6,)))
            added += 1
        if sched.running and rng.random() < 0.05:
            sched.abort_request(rng.choice(sched.running).request_id)
        for r in sched.running:
            if lookahead and r.is_decoding and rng.random() < 0.7:
                r.spec_token_ids = [rng.randrange(7) for _ in range(max(0, min(lookahead, max_model_len - r.num_tokens - 1)))]
        cap = sched.prefill_token_cap()
        out = sched.schedule()
        decoding = {s.request.request_id for s in out.scheduled if is_decoding_stream(s.request)}
        num_prefill = sum(s.num_scheduled_tokens for s in out.scheduled if s.request.request_id not in decoding)
        if cap is not None:
            assert num_prefill <= cap
        sampled = []
        for s in out.scheduled:
            accepted = s.spec_token_ids[: rng.randint(0, len(s.spec_token_ids))]
            sampled.append(accepted + [rng.randrange(7)] if s.needs_sample else [])
        sched.update_from_output(out, sampled)
        bm.check_invariants(list(sched.requests.values()))
        step += 1
        assert step < 5000, "scheduler made no progress"
    assert bm.num_free_blocks == num_blocks


# --- the engine -----------------------------------------------------------------------------
SHORT = [5, 9, 13, 2, 77, 31, 8, 40]
LONG = [(7 * i + 3) % 97 for i in range(430)]
SHORT_PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
LONG_PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CAP_TOKENS = 64  # what the fake cost model says fits the budget
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("stall_free_llama")), "llama", max_position_embeddings=512)


def make_engine(model_dir: str, **kwargs) -> LLMEngine:
    return LLMEngine(model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE, max_model_len=512, **kwargs)


def run_alone(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(model_dir)
    engine.add_request("x", prompt, params)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert_no_leaked_blocks(engine)
    return tokens


def run_long_beside_stream(engine: LLMEngine) -> tuple[dict[str, list[int]], list]:
    """`short` decodes; after 3 of its steps `long` arrives. Returns each one's tokens and the
    steps' records."""
    records = []
    engine.step_listeners.append(records.append)
    tokens = {"short": [], "long": []}
    engine.add_request("short", SHORT, SHORT_PARAMS)
    step = 0
    while engine.has_unfinished_requests():
        if step == 3:
            engine.add_request("long", LONG, LONG_PARAMS)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        assert_no_leaked_blocks(engine)
        step += 1
    return tokens, records


@pytest.fixture(scope="module")
def alone(model_dir):
    return {"short": run_alone(model_dir, SHORT, SHORT_PARAMS), "long": run_alone(model_dir, LONG, LONG_PARAMS)}


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}],
                         ids=["plain", "ngram"])
def test_long_prompt_is_chunked_beside_a_stream_with_the_same_outputs(model_dir, alone, speculative):
    capped = make_engine(model_dir, decode_step_budget_s=0.05, speculative=speculative)
    capped.scheduler.step_cost = FakeCost(CAP_TOKENS)
    tokens, records = run_long_beside_stream(capped)
    long_steps = [r for r in records if "long" in r.num_scheduled_tokens and "long" in r.prefill_request_ids]
    assert len(long_steps) >= len(LONG) // CAP_TOKENS
    for r in long_steps:
        short_tokens = r.num_scheduled_tokens.get("short", 0)
        if short_tokens:  # `short` decoded beside this chunk: the step holds the cap
            assert r.num_batched_tokens <= max(CAP_TOKENS, short_tokens + BLOCK_SIZE)
    assert tokens == alone

    plain = make_engine(model_dir, speculative=speculative)
    plain_tokens, plain_records = run_long_beside_stream(plain)
    assert max(r.num_scheduled_tokens.get("long", 0) for r in plain_records) == len(LONG)  # one stalling step
    assert plain_tokens == alone


def test_engine_fits_its_step_cost_and_reports_it(model_dir, alone):
    engine = make_engine(model_dir, decode_step_budget_s=0.05)
    stats = engine.stats()
    assert stats["prefill_tokens_per_s"] is None and stats["step_fixed_s"] is None
    tokens, records = run_long_beside_stream(engine)
    assert tokens == alone
    assert engine.step_cost.num_observations == len(records)  # one per step that ran the model
    stats = engine.stats()
    assert stats["prefill_tokens_per_s"] > 0 and stats["step_fixed_s"] >= 0
    assert stats["queued_tokens"] == 0 and stats["num_running"] == 0
