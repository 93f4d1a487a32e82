"""Remote drafting (engine/spec_decode/remote.py): a draft model in a drafter pool of its own keeps
speculation lossless (greedy output = the target alone, sampled output = the target's exact
distribution), drafts what the co-located draft model drafts, survives a pool that forgets, fails
or serves another model, and drafts ahead while the target verifies."""

import time

import pytest
import torch
from helpers import assert_no_leaked_blocks, save_perturbed_copy, save_tiny_model
from test_engine import run_staggered
from test_speculative import (
    GREEDY,
    NUM_SAMPLES,
    SPEC_ARRIVALS,
    SPEC_PROMPTS,
    _chi_square_p_value,
    _exact_distribution,
    small_vocab,  # noqa: F401 - the fixture (a target and a drafter over 3 tokens)
)

from engine import LLM, LLMEngine, SamplingParams, SpeculativeConfig
from engine.spec_decode.remote import DraftBatch, DraftBatchReply, DraftCall, DraftService, LocalDrafterClient


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    target = save_tiny_model(str(root / "target"), "llama")
    close = save_perturbed_copy(target, str(root / "close"), noise=0.02)
    return {"target": target, "close": close}


@pytest.fixture(scope="module")
def baseline(models):
    engine = LLMEngine(models["target"], dtype="float32", device="cpu")
    outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    return [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))]


def remote_engine(models, drafter="close", k=4, adaptive=False, draft_ahead=True, client=None, service=None, **kw):
    service = service or DraftService(models[drafter], dtype="float32", device="cpu", draft_ahead=draft_ahead)
    client = client or LocalDrafterClient(service)
    spec = SpeculativeConfig(method="draft", model=models[drafter], num_speculative_tokens=k, adaptive=adaptive)
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=64,
                       remote_drafter=client, **kw)
    return engine, service


def run(engine):
    outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    return [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))]


@pytest.mark.parametrize("k,adaptive,draft_ahead", [(2, False, False), (4, False, True), (5, True, True)])
def test_greedy_output_equals_the_target_alone(models, baseline, k, adaptive, draft_ahead):
    engine, service = remote_engine(models, k=k, adaptive=adaptive, draft_ahead=draft_ahead)
    assert run(engine) == baseline
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(engine)
    # every finished request's session was closed at the pool
    assert service.stats()["sessions"] == 0 and service.stats()["used_blocks"] == 0


def test_drafts_are_the_colocated_draft_models(models):
    """Without drafting ahead the pool drafts exactly what the co-located draft model drafts
    (fp32, greedy): the same drafts proposed and accepted at every position."""
    spec = SpeculativeConfig(method="draft", model=models["close"], num_speculative_tokens=4, adaptive=False)
    co = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=64)
    run(co)
    engine, _ = remote_engine(models, k=4, draft_ahead=False)
    run(engine)
    a, b = co.spec_stats, engine.spec_stats
    assert (b.drafted_by_position, b.accepted_by_position) == (a.drafted_by_position, a.accepted_by_position)


def test_greedy_output_under_preemption_and_an_evicting_pool(models):
    """Preemption on the target (its request starts over: a new session) and a pool of 40
    positions whose KV holds about one request's session (it evicts the least recently used; a call for an evicted
    session comes back `unknown`, and the target resends its whole context)."""
    service = DraftService(models["close"], dtype="float32", device="cpu", kv_cache_memory_bytes=1,
                           block_size=4, max_model_len=40, max_k=4)  # the fewest blocks: 52 slots
    assert service.num_blocks * 4 == 52
    bytes_per_token = 2 * 2 * 2 * 16 * 4
    engine, _ = remote_engine(models, service=service, block_size=4, kv_cache_memory_bytes=18 * 4 * bytes_per_token,
                              max_model_len=60)
    prompts = [p[:30] for p in SPEC_PROMPTS]
    outs = run_staggered(engine, prompts, GREEDY, SPEC_ARRIVALS)
    assert engine.scheduler.num_preemptions > 0
    expected = run_staggered(LLMEngine(models["target"], dtype="float32", device="cpu"), prompts, GREEDY, SPEC_ARRIVALS)
    assert outs == expected
    counts = service.stats()
    assert counts["evicted"] > 0 and counts["too_long"] > 0  # and contexts past its 40 positions got no drafts
    assert engine.speculator.proposer.counts["unknown"] == counts["unknown"]
    assert engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(engine)


class FlakyClient:
    """Fails every `every`-th call (a lost replica or a timeout), else passes it on."""

    def __init__(self, inner, every=3, error=TimeoutError):
        self.inner, self.every, self.error, self.calls = inner, every, error, 0

    def draft(self, batch):
        self.calls += 1
        if self.calls % self.every == 0:
            raise self.error("drafter pool replica lost")
        return self.inner.draft(batch)


def test_a_failing_pool_costs_drafts_never_tokens(models, baseline):
    service = DraftService(models["close"], dtype="float32", device="cpu")
    client = FlakyClient(LocalDrafterClient(service))
    engine, _ = remote_engine(models, client=client, service=service)
    engine.speculator.proposer.backoff.first_s = 0.0  # call again at once after each failure
    assert run(engine) == baseline
    counts = engine.speculator.proposer.counts
    assert counts["failures"] > 0 and counts["rounds"] > 0 and engine.spec_stats.num_accepted_tokens > 0
    assert counts["skipped"] == 0
    # a pool that never answers: no drafts at all, the same tokens
    engine, _ = remote_engine(models, client=FlakyClient(None, every=1, error=ConnectionError))
    assert run(engine) == baseline
    assert engine.spec_stats.num_draft_tokens == 0


def test_a_pool_that_is_gone_costs_one_timeout_then_the_engine_backs_off(models, baseline):
    """A pool that answers nothing (each call waits its timeout, then fails): the engine calls it
    once, then leaves it alone for the backoff and decodes at the target's own speed, tokens
    unchanged; while calls keep failing the backoff doubles up to its cap; the first call that
    succeeds ends it and drafting resumes."""

    class Gone:
        def __init__(self, inner) -> None:
            self.inner, self.gone, self.calls = inner, True, 0

        def draft(self, batch):
            self.calls += 1
            if self.gone:
                time.sleep(0.02)  # the engine's wait for drafts, drafter_pool.timeout_s
                raise TimeoutError("no answer from the drafter pool")
            return self.inner.draft(batch)

    service = DraftService(models["close"], dtype="float32", device="cpu")
    client = Gone(LocalDrafterClient(service))
    engine, _ = remote_engine(models, client=client, service=service)
    proposer = engine.speculator.proposer
    proposer.backoff.first_s, proposer.backoff.max_s = 600.0, 1200.0  # the whole run inside the first backoff
    assert run(engine) == baseline
    assert client.calls == 1 and proposer.counts["failures"] == 1 and proposer.counts["skipped"] > 10
    assert engine.spec_stats.num_draft_tokens == 0
    # calls that keep failing double the wait, up to the cap
    waits = []
    for _ in range(3):
        proposer.backoff.until = 0.0  # the wait is over
        assert run(engine) == baseline
        waits.append(proposer.backoff.wait_s)
    assert waits == [1200.0, 1200.0, 1200.0] and client.calls == 4
    proposer.backoff.first_s, proposer.backoff.max_s, proposer.backoff.wait_s = 1.0, 8.0, 0.0
    for expected in (1.0, 2.0, 4.0, 8.0, 8.0):
        proposer.backoff.until = 0.0
        assert run(engine) == baseline
        assert proposer.backoff.wait_s == expected
    # the pool is back: the next call after the wait succeeds, drafting resumes, the backoff ends
    client.gone, proposer.backoff.until = False, 0.0
    assert run(engine) == baseline
    assert proposer.backoff.wait_s == 0.0 and engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(engine)


def test_a_pool_serving_another_model_is_not_used(models, baseline, tmp_path):
    other = save_tiny_model(str(tmp_path / "other"), "llama", seed=3, vocab_size=64)
    service = DraftService(other, dtype="float32", device="cpu")
    engine, _ = remote_engine(models, client=LocalDrafterClient(service), service=service)
    assert run(engine) == baseline
    proposer = engine.speculator.proposer
    assert proposer.disabled and "vocab_size" in proposer.disabled
    assert engine.spec_stats.num_draft_tokens == 0


def test_drafting_ahead_serves_accepted_rounds(models):
    """A drafter identical to the target has every draft accepted and guesses the bonus token:
    nearly every round after the first is served from the drafts made ahead."""
    service = DraftService(models["target"], dtype="float32", device="cpu", draft_ahead=True)
    engine, _ = remote_engine(models, drafter="target", service=service, k=3)
    engine.add_request("a", SPEC_PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    counts = engine.speculator.proposer.counts
    hits = service.stats()["ahead_hits"]
    assert counts["rounds"] >= 8 and hits >= counts["rounds"] - 2, (counts, hits)
    # the engine used every draft made ahead (3 a round but near the end)
    assert 3 * hits - 3 <= counts["ahead"] <= 3 * hits and counts["ahead"] <= counts["drafts"]


def test_drafts_made_ahead_equal_drafts_made_on_demand(models):
    """Seeded sampled drafts at a context do not depend on whether they were drafted ahead:
    the same calls to a pool with and without draft_ahead give the same tokens and q."""
    ahead = DraftService(models["close"], dtype="float32", device="cpu", draft_ahead=True)
    plain = DraftService(models["close"], dtype="float32", device="cpu", draft_ahead=False)
    prompt = tuple(SPEC_PROMPTS[1])
    first = {}
    for name, svc in (("ahead", ahead), ("plain", plain)):
        r = svc.draft(DraftBatch((DraftCall("s", 0, prompt, 3, 0.9, 0, 1.0, seed=11),))).replies[0]
        first[name] = r
    assert first["ahead"].token_ids == first["plain"].token_ids
    torch.testing.assert_close(first["ahead"].probs, first["plain"].probs)
    assert ahead.draft_ahead_round() == 1
    # the target accepted all three and its bonus token was the drafter's fourth draft: a hit
    guess = ahead.sessions["s"].assumed[len(prompt):]
    assert guess[:3] == first["ahead"].token_ids and len(guess) == 4
    replies = {}
    for name, svc in (("ahead", ahead), ("plain", plain)):
        replies[name] = svc.draft(DraftBatch((DraftCall("s", len(prompt), tuple(guess), 3, 0.9, 0, 1.0, seed=11),)))
    a, p = replies["ahead"].replies[0], replies["plain"].replies[0]
    assert a.ahead and not p.ahead and a.catch_up == 0
    assert a.token_ids == p.token_ids
    torch.testing.assert_close(a.probs, p.probs)


def test_unknown_sessions_and_restarts(models):
    """A call that does not start where the pool's session ends is answered `unknown`; a call
    from 0 replaces a session that holds other tokens; closed and expired sessions free blocks."""
    svc = DraftService(models["close"], dtype="float32", device="cpu", draft_ahead=False, session_ttl_s=60.0)
    prompt = tuple(SPEC_PROMPTS[0])
    assert svc.draft(DraftBatch((DraftCall("s", 5, prompt, 2),))).replies[0].unknown  # never seen
    first = svc.draft(DraftBatch((DraftCall("s", 0, prompt, 2),))).replies[0]
    assert len(first.token_ids) == 2 and first.catch_up == len(prompt)
    assert svc.draft(DraftBatch((DraftCall("s", len(prompt) + 1, (3,), 2),))).replies[0].unknown  # a gap
    # the first draft accepted, then a bonus token: the KV written for the first draft is kept
    accepted = (first.token_ids[0], 7)
    nxt = svc.draft(DraftBatch((DraftCall("s", len(prompt), accepted, 2),))).replies[0]
    assert not nxt.unknown and nxt.catch_up == 1
    # the first draft rejected: the KV of the rejected draft is recomputed
    rejected = ((nxt.token_ids[0] + 1) % 64, 7)
    after = svc.draft(DraftBatch((DraftCall("s", len(prompt) + 2, rejected, 2),))).replies[0]
    assert after.catch_up == 2
    # resent from 0 with the same tokens and more: the session (and its KV) is kept
    context = prompt + accepted + rejected
    again = svc.draft(DraftBatch((DraftCall("s", 0, context + (4,), 2),))).replies[0]
    assert again.catch_up == 1
    # another request under the same name: replaced, caught up from scratch
    other = tuple(SPEC_PROMPTS[2])
    assert svc.draft(DraftBatch((DraftCall("s", 0, other, 2),))).replies[0].catch_up == len(other)
    assert svc.stats()["sessions"] == 1 and svc.stats()["used_blocks"] > 0
    svc.draft(DraftBatch((), closed=("s",)))
    assert svc.stats()["sessions"] == 0 and svc.stats()["used_blocks"] == 0
    svc.draft(DraftBatch((DraftCall("t", 0, prompt, 2),)))
    svc.sessions["t"].last_used -= 61.0  # idle past session_ttl_s: expired at the next call
    svc.draft(DraftBatch((DraftCall("u", 0, prompt, 2),)))
    assert set(svc.sessions) == {"u"} and svc.stats()["evicted"] == 1


NUM_NEW = 6  # long enough for a round after a fully accepted one (a draft made ahead can be used)


class WrongQ:
    """Hands the target uniform q rows instead of the distributions the drafts came from."""

    def __init__(self, inner):
        self.inner = inner

    def draft(self, batch):
        answer = self.inner.draft(batch)
        for r in answer.replies:
            if r.probs is not None:
                r.probs = torch.full_like(r.probs, 1.0 / r.probs.shape[-1])
        return DraftBatchReply(answer.replies, answer.identity, answer.vocab_size)


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.slow  # make test-fast skips it
def test_sampled_distribution_matches_target(small_vocab, broken):  # noqa: F811 - the imported fixture
    """Chi-square goodness of fit of 3000 samples of (x1..x6), drafted remotely (ahead too: some
    rounds' drafts were made ahead) against the target's exact joint distribution (729 cells,
    small ones pooled; as test_speculative, a correct sampler fails with probability 1e-4 per
    run; fixed seeds). Negative control: the target given uniform q rows instead of the drafts'."""
    target, drafter = small_vocab
    prompt = [0, 1, 2, 1, 0, 1, 2, 1, 0]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True)
    torch.manual_seed(1234)
    service = DraftService(drafter, dtype="float32", device="cpu", draft_ahead=True)
    client = LocalDrafterClient(service, draft_ahead_in_background=False)
    spec = SpeculativeConfig(method="draft", model=drafter, num_speculative_tokens=2, adaptive=False)
    llm = LLM(target, dtype="float32", device="cpu", speculative=spec, max_num_seqs=512,
              remote_drafter=WrongQ(client) if broken else client)
    outs = llm.generate([prompt] * NUM_SAMPLES, params)
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert service.stats()["ahead_hits"] > 0
    p = _chi_square_p_value(counts, _exact_distribution(target, prompt, params, NUM_NEW), NUM_SAMPLES)
    if broken:
        assert p < 1e-4, f"wrong q rows went unnoticed (p={p:.2e})"
    else:
        assert p > 1e-4, f"remotely drafted samples do not follow the target distribution (p={p:.2e})"


def test_a_request_whose_guesses_fail_stops_being_drafted_ahead(models):
    """The pool guesses every request's bonus token, but drafts its next round ahead only while
    its guesses hold often enough (`ahead_worth`): an engine that never accepts every draft soon
    gets no drafts made ahead (the guesses go on being checked)."""
    svc = DraftService(models["close"], dtype="float32", device="cpu", draft_ahead=True)
    context = list(SPEC_PROMPTS[3])
    reply = svc.draft(DraftBatch((DraftCall("s", 0, tuple(context), 3),))).replies[0]
    made = []
    for _ in range(8):
        made.append(svc.draft_ahead_round())
        s = svc.sessions["s"]
        assert s.assumed is not None and s.assumed[: len(context) + 3] == context + reply.token_ids
        # the target rejected the first draft: it committed another token instead
        tail = ((reply.token_ids[0] + 1) % 64,)
        reply = svc.draft(DraftBatch((DraftCall("s", len(context), tail, 3),))).replies[0]
        assert not reply.ahead and len(reply.token_ids) == 3
        context += list(tail)
    assert made[0] == 1 and made[-1] == 0
    assert svc.sessions["s"].tries > 5 and svc.sessions["s"].hits == 0


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, seed=1234, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_a_handoff_between_engines_that_share_a_pool(models, baseline, params):
    """Prefill/decode disaggregation with both engines drafting in one pool: the prefill side's
    first drafts (and their q) travel in the handoff, the decode side's first call to the pool is
    a new session (the whole context), and the tokens equal one engine's with the same pool."""
    from test_handoff import PROMPT, decode, prefill

    service = DraftService(models["close"], dtype="float32", device="cpu")

    def engine():
        return remote_engine(models, service=service)[0]

    one = engine()
    one.add_request("c", PROMPT, params)
    expected: dict[str, list[int]] = {}
    while one.has_unfinished_requests():
        for out in one.step():
            expected.setdefault("c", []).extend(out.new_token_ids)
    h, _ = prefill(engine(), params)
    assert h.spec_token_ids and h.proposer_state is None and h.drafter_kv is None
    assert (h.draft_probs is not None) == (not params.is_greedy)
    b = engine()
    tokens, log = decode(b, h)
    assert tokens == expected["c"]
    assert log and log[0][0] == len(h.spec_token_ids)  # the decode side verified the prefill side's drafts
    assert b.speculator.proposer.counts["rounds"] > 0
    assert service.stats()["sessions"] == 0


def test_aborted_and_finished_requests_close_their_sessions(models):
    """A request aborted mid-stream has its session closed at the pool with the next call; when
    the engine is left with nothing that drafts remotely, it closes the rest at once."""
    engine, service = remote_engine(models)
    engine.add_request("a", SPEC_PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.add_request("b", SPEC_PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    prefix = engine.speculator.proposer.prefix
    assert set(service.sessions) == {prefix + "a", prefix + "b"}
    engine.abort_request("a")
    engine.step()
    assert set(service.sessions) == {prefix + "b"}
    engine.abort_request("b")
    assert service.stats()["sessions"] == 0 and service.stats()["used_blocks"] == 0
    assert not engine.speculator.proposer.known


def test_serve_client_cancels_a_call_it_stopped_waiting_for():
    """`ServeDrafterClient` (the engine replica's handle to the pool): a call past
    `drafter_pool.timeout_s` raises TimeoutError to the engine (that step goes without drafts) and
    is cancelled at the pool, which need not draft for it; an answered call is not cancelled."""
    from deployments.drafter import ServeDrafterClient

    class Response:
        def __init__(self, late: bool) -> None:
            self.late, self.cancelled, self.waited = late, False, None

        def result(self, timeout_s=None):
            self.waited = timeout_s
            if self.late:
                raise TimeoutError("no answer in time")
            return "drafts"

        def cancel(self) -> None:
            self.cancelled = True

    class Handle:
        def __init__(self) -> None:
            self.responses, self.session_id, self.draft = [], None, self

        def options(self, session_id):
            self.session_id = session_id
            return self

        def remote(self, batch):
            self.responses.append(Response(late=batch == "late"))
            return self.responses[-1]

    handle = Handle()
    client = ServeDrafterClient(handle, "engine-replica-1", timeout_s=0.25)
    assert handle.session_id == "engine-replica-1"
    assert client.draft("on time") == "drafts"
    with pytest.raises(TimeoutError):
        client.draft("late")
    assert [(r.waited, r.cancelled) for r in handle.responses] == [(0.25, False), (0.25, True)]


@pytest.mark.parametrize("penalized_pool", [True, False])
def test_the_pool_drafts_under_the_request_penalties(models, monkeypatch, penalized_pool):
    """A pool whose draft model is the target itself drafts the penalized target's greedy
    tokens, so every draft is accepted; a pool that drafts without the penalties (the calls
    carry none) is often refused. The output equals the target alone either way."""
    from engine.spec_decode import remote

    if not penalized_pool:
        monkeypatch.setattr(remote.DraftPenalties, "of", staticmethod(lambda request: None))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, min_tokens=3, presence_penalty=0.7,
                            frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={17: 2.5, 33: -1.0})
    prompts = [[5, 9, 17, 33] * 3 + [5, 9], [4, 5, 6, 7] * 6]
    alone = LLM(models["target"], dtype="float32", device="cpu").generate(prompts, params)
    service = DraftService(models["target"], dtype="float32", device="cpu", draft_ahead=False)
    spec = SpeculativeConfig(method="draft", model=models["target"], num_speculative_tokens=4, adaptive=False)
    llm = LLM(models["target"], dtype="float32", device="cpu", speculative=spec,
              remote_drafter=LocalDrafterClient(service))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 20
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    assert rate == 1.0 if penalized_pool else rate < 0.8, rate
    assert_no_leaked_blocks(llm.engine)
