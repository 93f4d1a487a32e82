"""Engine hardening: drafting only for the requests a step scheduled, proposers that change nothing
when a forward fails, drafts that fit the token budget, per-request state kept by the component
that uses it (and freed), bounded hidden-state buffers, leak checks that fail when state leaks,
the inverse-CDF sampler's top end, and what a seed guarantees. Greedy checks are exact (fp32)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers import assert_no_leaked_blocks, save_perturbed_copy, save_tiny_heads, save_tiny_model
from test_eagle_mtp import _reference_drafts
from test_engine import PROMPTS, run_staggered
from test_speculative import GREEDY, SPEC_ARRIVALS, SPEC_PROMPTS

from engine import LLM, LLMEngine, SamplingParams, SpeculativeConfig
from engine.block_manager import KVBlockManager
from engine.request import Request, RequestStatus
from engine.sampler import sample_from_probs
from engine.scheduler import Scheduler
from engine.spec_decode.proposers.feature_buffers import LAZY_BUFFER_ROWS

METHODS = ["draft", "eagle", "medusa", "ngram"]
SHORT_PROMPTS = [[1, 2, 3], [5, 6], [7, 8, 9, 10], [11]]
SHORT = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    target = save_tiny_model(str(root / "target"), "llama")
    close = save_perturbed_copy(target, str(root / "close"), noise=0.02)
    eagle, medusa = save_tiny_heads(str(root), target)
    return {"target": target, "draft": close, "eagle": eagle, "medusa": medusa, "ngram": None}


def spec_config(models, method: str, k: int = 4, adaptive: bool = False) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, model=models[method], num_speculative_tokens=k, adaptive=adaptive)


def generate(models, prompts, params, **kwargs) -> list[list[int]]:
    llm = LLM(models["target"], dtype="float32", device="cpu", **kwargs)
    outs = llm.generate(prompts, params)
    assert_no_leaked_blocks(llm.engine)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def baselines(models):
    engine = LLMEngine(models["target"], dtype="float32", device="cpu")
    staggered = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    return {
        "short": generate(models, SHORT_PROMPTS, SHORT, max_num_batched_tokens=6),
        "staggered": [staggered[f"r{i}"] for i in range(len(SPEC_PROMPTS))],
    }


# --- 1. drafting only for the requests a step scheduled --------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_small_token_budget_equals_non_speculative(models, baselines, method):
    """Four requests drafting k=4 in a 6-token budget (the configuration that crashed the draft
    model and Medusa proposers): exact greedy output, and the drafts were verified."""
    llm = LLM(models["target"], dtype="float32", device="cpu", max_num_batched_tokens=6,
              speculative=spec_config(models, method))
    outs = llm.generate(SHORT_PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == baselines["short"]
    assert_no_leaked_blocks(llm.engine)
    if method != "ngram":
        assert llm.engine.spec_stats.num_draft_tokens > 0


def leave_out_one_decoding_request(engine: LLMEngine) -> list[str]:
    """Every other step, take the newest decoding request out of the step after scheduling it, as
    a scheduler whose budget runs out before it does. Returns the ids left out, step by step."""
    real = engine.scheduler.schedule
    calls = itertools.count()
    left_out: list[str] = []

    def schedule():
        out = real()
        decoding = [s for s in out.scheduled if s.request.num_output_tokens and s.num_new_tokens == 1]
        if next(calls) % 2 and len(decoding) > 1:
            out.scheduled.remove(decoding[-1])
            left_out.append(decoding[-1].request.request_id)
        return out

    engine.scheduler.schedule = schedule
    return left_out


@pytest.mark.parametrize("method", METHODS)
def test_requests_left_out_of_a_step_do_not_draft(models, baselines, method):
    """A running, decoding request that a step leaves out committed nothing new: it keeps the
    drafts it has (still valid) and its proposer is not asked again (the draft model raised
    `query_len=0`, Medusa an IndexError)."""
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec_config(models, method))
    left_out = leave_out_one_decoding_request(engine)
    outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    assert [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))] == baselines["staggered"]
    assert len(left_out) > 10


# --- 2. a failed drafting forward changes nothing ---------------------------------------------


def fail_once(monkeypatch, obj, name: str, on_call: int) -> list[int]:
    """Make obj.name raise RuntimeError on its `on_call`-th call (1-based), once."""
    real = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call:
            raise RuntimeError("injected drafting failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


def inject_drafting_failure(monkeypatch, proposer, on_call: int) -> list[int]:
    """Fail the proposer after its per-request state would have been advanced by the old code:
    the draft model and EAGLE in a forward after the round's first, Medusa in its sampling."""
    if proposer.method in ("draft", "eagle"):
        return fail_once(monkeypatch, proposer, "_forward", on_call)
    if proposer.method == "medusa":
        import engine.spec_decode.proposers.medusa as medusa_module

        return fail_once(monkeypatch, medusa_module, "sample_drafts", on_call)
    return fail_once(monkeypatch, proposer, "propose", on_call)


def reference_drafts(models, method: str, tokens: list[int], k: int) -> list[int]:
    if method in ("eagle", "medusa"):
        return _reference_drafts(models, method, tokens, k)
    drafter = transformers.AutoModelForCausalLM.from_pretrained(models["draft"], dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = drafter.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                               eos_token_id=None, pad_token_id=None)
    return out[0, len(tokens):].tolist()


@pytest.mark.parametrize("method", ["draft", "eagle", "medusa"])
def test_failed_drafting_forward_leaves_proposer_state_unchanged(models, method, monkeypatch, caplog):
    """Drafting fails after the point where the old code had already advanced the request's
    state (the draft model's and EAGLE's second forward, Medusa's sampling): the engine logs one
    ERROR with the traceback, the request goes on without drafts, its proposer state is what it
    was before the round, and its next drafts equal the reference heads' / drafter's drafts."""
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec_config(models, method))
    proposer = engine.speculator.proposer
    engine.add_request("r", PROMPTS[2], GREEDY)
    engine.step()  # prefill, then the first drafts
    r = engine.scheduler.requests["r"]
    n_drafted = r.num_tokens
    assert r.spec_token_ids
    inject_drafting_failure(monkeypatch, proposer, on_call=1 if method == "medusa" else 2)
    with caplog.at_level(logging.ERROR, logger="engine"):
        engine.step()  # verifies, buffers the committed rows; drafting fails
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None and "injected" in caplog.text
    assert r.spec_token_ids == [] and "r" not in engine.runner.draft_probs
    state = proposer.states["r"]
    if method == "draft":
        assert state.num_computed == n_drafted  # not advanced by the failed round
    elif method == "eagle":
        assert (state.start, state.end) == (n_drafted - 1, r.num_tokens - 1)  # rows kept
    else:
        assert state.start == r.num_tokens - 2
    assert_no_leaked_blocks(engine)
    engine.step()  # a step without drafts, then drafting from the kept state
    assert r.spec_token_ids == reference_drafts(models, method, r.all_token_ids, 4)
    assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("method", METHODS)
def test_engine_keeps_serving_after_a_drafting_failure(models, baselines, method, monkeypatch, caplog):
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec_config(models, method))
    inject_drafting_failure(monkeypatch, engine.speculator.proposer, on_call=7)
    with caplog.at_level(logging.ERROR, logger="engine"):
        outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    assert [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))] == baselines["staggered"]
    assert len([rec for rec in caplog.records if rec.levelno >= logging.ERROR]) == 1
    assert engine.spec_stats.num_draft_tokens > 0


# --- 3. drafts fit the token budget ----------------------------------------------------------


def decoding_request(i: int, num_drafts: int) -> Request:
    r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0))
    r.output_token_ids = [4]
    r.num_computed_tokens = r.num_tokens - 1
    r.status = RequestStatus.RUNNING
    r.spec_token_ids = [7] * num_drafts
    return r


def test_scheduler_cuts_drafts_to_leave_one_token_for_each_running_request():
    """Budget 6, four decoding requests with 4 drafts each: the oldest verifies 2 drafts, the
    others none, and every request makes progress (before: the oldest took 5 tokens, the next 1,
    the last two were left out)."""
    bm = KVBlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6, max_model_len=64, num_lookahead_tokens=4)
    for i in range(4):
        r = decoding_request(i, 4)
        assert bm.allocate_slots(r, r.num_tokens, 0)
        sched.requests[r.request_id] = r
        sched.running.append(r)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens, len(s.spec_token_ids)) for s in out.scheduled] == [
        ("r0", 1, 2), ("r1", 1, 0), ("r2", 1, 0), ("r3", 1, 0)
    ]
    assert [len(r.spec_token_ids) for r in sched.running] == [2, 0, 0, 0]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_every_running_request_is_scheduled_and_drafts_fit(models, method):
    """With drafts, no running request is left out of a step, and the drafts made for the next
    step fit its budget next to one token per running request."""
    budget = 6
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", max_num_batched_tokens=budget,
                       speculative=spec_config(models, method))
    real = engine.scheduler.schedule

    def schedule():
        running = [r.request_id for r in engine.scheduler.running]
        out = real()
        scheduled = {s.request.request_id for s in out.scheduled}
        assert set(running) - set(out.preempted_request_ids) <= scheduled
        return out

    engine.scheduler.schedule = schedule
    for i, p in enumerate(SPEC_PROMPTS[:6]):
        engine.add_request(f"r{i}", p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        assert len(running) + sum(len(r.spec_token_ids) for r in running) <= budget
        assert_no_leaked_blocks(engine)


# --- 4. per-request tensors live with their components, keyed by request id ------------------


def test_requests_hold_no_tensors_and_state_is_freed(models):
    """Seeded sampled and greedy requests under EAGLE: the Request objects hold plain data only;
    generators and draft distributions sit in the runner, hidden rows in the proposer, by id."""
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec_config(models, "eagle"))
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)] + [GREEDY]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", SPEC_PROMPTS[i], p)
    seen_probs = False
    while engine.has_unfinished_requests():
        engine.step()
        for r in engine.live_requests():
            for name, value in vars(r).items():
                assert not isinstance(value, torch.Tensor | torch.Generator | dict), (name, type(value))
        seen_probs |= bool(engine.runner.draft_probs)
        assert_no_leaked_blocks(engine)
    assert seen_probs and not engine.runner.generators and not engine.speculator.proposer.states


@pytest.mark.parametrize("method", METHODS)
def test_preemption_resets_drafter_state_and_keeps_the_generator(models, method):
    """A preempted request starts over: its drafts, draft distributions and proposer state go at
    once (the engine reads `preempted_request_ids`); its generator stays, so a seeded request's
    tokens do not depend on whether it was preempted (no speculation for it: see SamplingParams)."""
    bytes_per_token = 2 * 2 * 2 * 16 * 4 + {"draft": 2 * 2 * 2 * 16 * 4, "eagle": 2 * 2 * 16 * 4}.get(method, 0)
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", block_size=4, max_model_len=60,
                       kv_cache_memory_bytes=18 * 4 * bytes_per_token, speculative=spec_config(models, method))
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True, speculative=False)
    real = engine.scheduler.schedule
    preempted: list[str] = []

    def schedule():
        out = real()
        preempted.extend(out.preempted_request_ids)
        return out

    engine.scheduler.schedule = schedule
    prompts = [p[:30] for p in SPEC_PROMPTS]
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, seeded if i == 2 else GREEDY)
        outs[f"r{i}"] = []
    while engine.has_unfinished_requests():
        n = len(preempted)
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        for rid in preempted[n:]:
            r = engine.scheduler.requests[rid]
            assert r.status == RequestStatus.PREEMPTED and not r.spec_token_ids
            assert rid not in engine.speculator.proposer.states and rid not in engine.runner.draft_probs
        assert_no_leaked_blocks(engine)
    assert "r2" in preempted  # the seeded request among them
    plain = LLM(models["target"], dtype="float32", device="cpu")
    expected = plain.generate(prompts, [seeded if i == 2 else GREEDY for i in range(len(prompts))])
    assert [outs[f"r{i}"] for i in range(len(prompts))] == [o.token_ids for o in expected]


# --- 5. bounded hidden-state buffers ---------------------------------------------------------

LONG_POSITIONS = 2048


@pytest.fixture(scope="module")
def long_models(tmp_path_factory):
    """A tiny target (and heads) with 2048 positions, for requests of ~2k tokens."""
    import helpers

    root = tmp_path_factory.mktemp("long")
    target = save_tiny_model(str(root / "target"), "llama", max_position_embeddings=LONG_POSITIONS)
    eagle, medusa = save_tiny_heads(str(root), target, max_position_embeddings=LONG_POSITIONS)
    assert helpers.TINY["max_position_embeddings"] == 512
    return {"target": target, "eagle": eagle, "medusa": medusa}


LONG_PROMPT = [(7 * i + 3) % 97 for i in range(300)]
LONG_NEW = 1700


@pytest.fixture(scope="module")
def long_baseline(long_models):
    llm = LLM(long_models["target"], dtype="float32", device="cpu", max_num_batched_tokens=256)
    return llm.generate([LONG_PROMPT], SamplingParams(max_tokens=LONG_NEW, temperature=0.0, ignore_eos=True))[0].token_ids


def buffered_rows(proposer) -> dict[str, int]:
    return {rid: st.rows.shape[0] for rid, st in proposer.states.items()}


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_non_speculative_request_buffers_no_hidden_rows(long_models, long_baseline, method):
    """A 2000-token request with speculative=False in a speculating engine: its proposer keeps
    nothing for it at any step (it never drafts), and its output is the target's."""
    spec = SpeculativeConfig(method=method, model=long_models[method], num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(long_models["target"], dtype="float32", device="cpu", max_num_batched_tokens=256,
                       speculative=spec)
    params = SamplingParams(max_tokens=LONG_NEW, temperature=0.0, ignore_eos=True, speculative=False)
    engine.add_request("r", LONG_PROMPT, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        assert not engine.speculator.proposer.states
    assert tokens == long_baseline
    assert engine.spec_stats.num_draft_tokens == 0


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.slow  # make test-fast skips it
def test_hidden_rows_stay_bounded_while_speculation_is_off(long_models, long_baseline, method, monkeypatch):
    """The adaptive policy keeps speculation off for ~1950 steps (forced): the request's buffered
    rows never exceed the bound (EAGLE runs its layer over them each time they reach the lazy
    bound, extending its own KV; Medusa keeps one row). Turned back on, the drafts equal the reference heads' drafts over the
    whole context, so the EAGLE KV filled meanwhile is right; output equals the target's."""
    spec = SpeculativeConfig(method=method, model=long_models[method], num_speculative_tokens=4, adaptive=True)
    engine = LLMEngine(long_models["target"], dtype="float32", device="cpu", max_num_batched_tokens=256,
                       speculative=spec)
    proposer = engine.speculator.proposer
    bound = proposer.max_buffered_rows if method == "eagle" else 1
    assert method == "medusa" or bound == LAZY_BUFFER_ROWS
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 0)
    engine.add_request("r", LONG_PROMPT, SamplingParams(max_tokens=LONG_NEW, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    most = 0

    def step() -> None:
        nonlocal most
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        rows = buffered_rows(proposer)
        most = max([most, *rows.values()])
        assert all(n <= bound for n in rows.values()), rows
        assert_no_leaked_blocks(engine)

    r = engine.scheduler.requests["r"]
    while r.num_output_tokens < LONG_NEW - 40:
        step()
    assert engine.spec_stats.num_draft_tokens == 0 and most == bound
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 4)
    monkeypatch.setattr(engine.speculator, "best_cap", lambda num_decoding, requests, ks: max(ks))
    step()
    assert r.spec_token_ids == _reference_drafts(long_models, method, r.all_token_ids, 4)
    while engine.has_unfinished_requests():
        step()
    assert tokens == long_baseline
    assert engine.spec_stats.num_draft_tokens > 0


def test_eagle_reuses_a_cached_prefix_only_where_its_layer_ran(models):
    """The EAGLE-1 layer (a chain drafter) as EAGLE-3's midlayer (test_eagle3): blocks written
    by a request that did not speculate are recomputed by a drafting one, which then leaves
    blocks that later drafting requests reuse; outputs equal the target alone's."""
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec_config(models, "eagle"))
    target = LLMEngine(models["target"], dtype="float32", device="cpu")
    prompt = [(3 * i + 1) % 90 + 2 for i in range(40)]

    def run(eng, rid, tokens, params):
        eng.add_request(rid, tokens, params)
        r, out = eng.scheduler.requests[rid], []
        while eng.has_unfinished_requests():
            out += [t for o in eng.step() for t in o.new_token_ids]
        assert_no_leaked_blocks(eng)
        return r, out

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a, _ = run(engine, "a", prompt + [7], SamplingParams(max_tokens=4, temperature=0.0, speculative=False))
    b, b_out = run(engine, "b", prompt + [8], greedy)
    c, c_out = run(engine, "c", prompt + [9], greedy)
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 32)
    assert engine.spec_stats.num_draft_tokens > 0
    assert b_out == run(target, "b", prompt + [8], greedy)[1] and c_out == run(target, "c", prompt + [9], greedy)[1]


def test_automatic_kv_sizing_leaves_room_for_the_hidden_row_buffers(models, monkeypatch):
    """On the CPU the pool holds what max_num_seqs full-length requests need, the drafter's
    buffers (at most max_model_len rows a request) beside it, all within CPU_DEFAULT_KV_BYTES."""
    import engine.llm_engine as llm_engine

    def engines():
        plain = LLMEngine(models["target"], dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256)
        eagle = LLMEngine(models["target"], dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256,
                          speculative=spec_config(models, "eagle"))
        return plain, eagle

    plain, eagle = engines()  # the default is far above what 4 x 256 tokens need: it does not bind
    proposer = eagle.speculator.proposer
    assert proposer.max_buffered_rows == 256  # the lazy bound, capped at max_model_len
    buffers = proposer.buffer_bytes(4, 2048)
    assert buffers == (4 * proposer.max_buffered_rows + 2048) * 64 * 4
    want = 4 * 256 * eagle.kv_bytes_per_token
    assert eagle.num_blocks == want // (eagle.kv_bytes_per_token * 16)
    assert plain.num_blocks == 4 * 256 // 16
    cap = buffers + want // 2
    monkeypatch.setattr(llm_engine, "CPU_DEFAULT_KV_BYTES", cap)  # now it does, with the buffers beside the pool
    plain, eagle = engines()
    assert eagle.num_blocks == (cap - buffers) // (eagle.kv_bytes_per_token * 16) == 4 * 256 // 16 // 2
    assert plain.num_blocks == 4 * 256 // 16


# --- 6. leak checks, aborts on failure, the sampler's top end, seeds -------------------------


@pytest.mark.parametrize("method", METHODS)
def test_leak_check_fails_on_stray_state(models, method):
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec_config(models, method))
    run_staggered(engine, SPEC_PROMPTS[:3], GREEDY, [0, 0, 1])
    proposer = engine.speculator.proposer
    proposer.states["gone"] = SimpleNamespace(rows=torch.zeros(1, 64))
    with pytest.raises(AssertionError, match="gone"):
        assert_no_leaked_blocks(engine)
    del proposer.states["gone"]
    engine.runner.generators["gone"] = torch.Generator()
    with pytest.raises(AssertionError, match="generators .*gone"):
        assert_no_leaked_blocks(engine)
    del engine.runner.generators["gone"]
    engine.runner.draft_probs["gone"] = torch.zeros(1, 97)
    with pytest.raises(AssertionError, match="draft probabilities .*gone"):
        assert_no_leaked_blocks(engine)
    del engine.runner.draft_probs["gone"]
    assert_no_leaked_blocks(engine)


def test_leak_check_fails_on_an_overfull_buffer(models):
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec_config(models, "eagle"))
    engine.add_request("r", PROMPTS[2], GREEDY)
    engine.step()
    proposer = engine.speculator.proposer
    state = proposer.states["r"]
    state.rows = torch.zeros(proposer.max_buffered_rows + 1, 64)
    with pytest.raises(AssertionError, match=f"buffers more than {proposer.max_buffered_rows} rows"):
        assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("method", [None, "draft", "eagle"])
def test_generate_aborts_its_requests_when_a_step_fails(models, baselines, method, monkeypatch):
    speculative = spec_config(models, method) if method else None
    llm = LLM(models["target"], dtype="float32", device="cpu", max_num_batched_tokens=6, speculative=speculative)
    fail_once(monkeypatch, llm.engine.runner, "execute", on_call=5)
    params = [SamplingParams(max_tokens=20, temperature=0.7, seed=1, ignore_eos=True), SHORT, SHORT, SHORT]
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(SHORT_PROMPTS, params)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaked_blocks(llm.engine)
    assert [o.token_ids for o in llm.generate(SHORT_PROMPTS, SHORT)] == baselines["short"]
    assert_no_leaked_blocks(llm.engine)


def test_inverse_cdf_never_picks_a_zero_probability_token(monkeypatch):
    """u * total reaching the total (u rounded to 1) once picked the last token of the
    vocabulary even at probability 0; it must pick the last token with nonzero probability."""
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for u in (1.0, 1.0 - 2**-24):
        monkeypatch.setattr(torch, "rand", lambda n, u=u, **kw: torch.full((n,), u))
        assert sample_from_probs(probs, [None] * 3).tolist() == [1, 2, 3]
        assert sample_from_probs(probs, [torch.Generator()] * 3).tolist() == [1, 2, 3]
    monkeypatch.undo()
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(512, 40, generator=g) * (torch.rand(512, 40, generator=g) < 0.3)
    rows[:, 0] += 1e-3
    for _ in range(20):
        picked = sample_from_probs(rows, [None] * 512)
        assert (rows[torch.arange(512), picked] > 0).all()


SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=1234, ignore_eos=True)
OTHERS = [SamplingParams(max_tokens=24, temperature=0.9, ignore_eos=True), GREEDY,
          SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)]


def seeded_run(models, with_others: bool, speculative=None, request_speculates: bool = True) -> list[int]:
    """The seeded request's tokens, alone or after three other requests (staggered)."""
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=speculative)
    params = SEEDED if request_speculates else dataclasses.replace(SEEDED, speculative=False)
    prompts = [SPEC_PROMPTS[4]] + (SPEC_PROMPTS[:3] if with_others else [])
    all_params = [params] + (OTHERS if with_others else [])
    arrivals = [2, 0, 1, 2] if with_others else [0]
    outs = {}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], all_params[i])
            outs[f"r{i}"] = []
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        step += 1
    assert_no_leaked_blocks(engine)
    return outs["r0"]


def test_seed_reproducible_whatever_else_is_batched_without_speculation(models):
    """What SamplingParams promises for `seed`: without speculation (no speculative engine, or
    speculative=False on the request) the seeded request's tokens do not depend on the batch;
    with speculation they repeat when the same requests run the same way."""
    alone = seeded_run(models, with_others=False)
    assert seeded_run(models, with_others=True) == alone
    draft = spec_config(models, "draft")
    assert seeded_run(models, True, draft, request_speculates=False) == alone
    assert seeded_run(models, False, draft, request_speculates=False) == alone
    assert seeded_run(models, True, draft) == seeded_run(models, True, draft)
