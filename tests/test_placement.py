"""The placement of a disaggregated request's prefill (deployments/placement.py): the decision
follows the predicted times to first token fed to it, and the ingress's view of the prefill pool
follows what was sent there and what its replicas report."""

from __future__ import annotations

import pytest

from deployments.placement import LocalEstimate, PoolEstimate, PrefillPoolTracker, place

MIN = 256  # disaggregation.min_prompt_tokens
BUDGET = 4.0  # slo.ttft_ms / 1000


def pool(queued: int = 0, rate: float | None = 1000.0, replicas: int = 1, backing_off: bool = False) -> PoolEstimate:
    return PoolEstimate(queued, rate, replicas, backing_off)


def test_short_prompts_and_cache_hits_stay_local() -> None:
    p = place(LocalEstimate(MIN - 1, 0, 1000.0), pool(), MIN, BUDGET)
    assert (p.where, p.reason) == ("local", "short")
    assert place(LocalEstimate(5000, 0, 1000.0), None, MIN, BUDGET).reason == "no_pool"


def test_within_budget_on_both_sides_goes_to_the_pool() -> None:
    """Even when the idle decode replica would be a little faster: it keeps its time for decoding."""
    p = place(LocalEstimate(1500, 0, 1000.0), pool(queued=500), MIN, BUDGET)
    assert (p.where, p.reason) == ("remote", "within_budget")
    assert p.remote_ttft_s == pytest.approx(2.0) and p.local_ttft_s == pytest.approx(1.5)


def test_a_saturated_pool_sends_long_prompts_to_the_faster_decode_replica() -> None:
    """The pool's queue (10k tokens at 1000 tok/s: 11.5 s) is past the budget; the decode replica,
    prefilling in chunks beside its streams at 400 tok/s, would have the first token in 3.75 s."""
    p = place(LocalEstimate(1500, 0, 400.0), pool(queued=10_000), MIN, BUDGET)
    assert (p.where, p.reason) == ("local", "local_faster")
    assert p.remote_ttft_s == pytest.approx(11.5) and p.local_ttft_s == pytest.approx(3.75)


def test_past_the_budget_everywhere_the_pool_takes_it() -> None:
    """Both sides past the budget: the pool, even where the decode replica predicts sooner (the
    request misses either way; its prefill would only slow the decode replica's streams)."""
    busy_local = LocalEstimate(1500, 20_000, 400.0)  # 53.75 s here
    p = place(busy_local, pool(queued=10_000), MIN, BUDGET)  # 11.5 s there
    assert (p.where, p.reason) == ("remote", "over_budget")
    sooner_here = LocalEstimate(1500, 2_000, 400.0)  # 8.75 s here, 11.5 s there
    p = place(sooner_here, pool(queued=10_000), MIN, BUDGET)
    assert (p.where, p.reason) == ("remote", "over_budget") and p.local_ttft_s < p.remote_ttft_s
    p = place(LocalEstimate(1500, 0, 1000.0), pool(queued=10_000), MIN, BUDGET)  # within it only here
    assert (p.where, p.reason) == ("local", "local_faster")


def test_more_pool_replicas_mean_a_higher_rate() -> None:
    one = place(LocalEstimate(1500, 0, 400.0), pool(queued=6000, rate=1000.0), MIN, BUDGET)
    two = place(LocalEstimate(1500, 0, 400.0), pool(queued=6000, rate=2000.0, replicas=2), MIN, BUDGET)
    assert (one.where, two.where) == ("local", "remote")


def test_backoff_and_unmeasured_rates() -> None:
    assert place(LocalEstimate(1500, 0, 1000.0), pool(backing_off=True), MIN, BUDGET).reason == "backoff"
    # nothing measured anywhere yet: the pool (that is how its rate gets measured)
    p = place(LocalEstimate(1500, 0, None), pool(rate=None), MIN, BUDGET)
    assert (p.where, p.reason) == ("remote", "unmeasured")
    # the pool unmeasured: taken to prefill as fast as this replica does
    p = place(LocalEstimate(1500, 0, 500.0), pool(queued=3000, rate=None), MIN, BUDGET)
    assert p.remote_ttft_s == pytest.approx(9.0) and p.where == "local"


def test_without_a_budget_the_faster_side_wins() -> None:
    assert place(LocalEstimate(1500, 0, 1000.0), pool(queued=500), MIN, None).where == "local"
    assert place(LocalEstimate(1500, 0, 1000.0), pool(queued=0, rate=2000.0), MIN, None).where == "remote"


def test_tracker_counts_what_the_pool_still_has_to_prefill() -> None:
    tracker = PrefillPoolTracker()
    a, b = tracker.sent(1500), tracker.sent(700)
    assert (tracker.queued_tokens, tracker.num_pending) == (2200, 2)
    tracker.done(a)
    tracker.done(a)  # twice: no effect
    assert tracker.estimate().queued_tokens == 700
    tracker.done(b)
    assert tracker.estimate() == PoolEstimate(0, None, 0, False)


def test_the_pool_queue_counts_off_what_the_pool_has_prefilled_since() -> None:
    """At 1000 tokens/s: a 1500-token prompt sent at t=0 has 500 left at t=1; one sent at 0.5
    waits behind it untouched; once the first one's first token comes (t=1.5), the second is
    prefilled from then on."""
    tracker = PrefillPoolTracker()
    tracker.report("r1", 1000.0, now=0.0)
    a = tracker.sent(1500, now=0.0)
    tracker.sent(1500, now=0.5)
    assert tracker.estimate(now=1.0).queued_tokens == 500 + 1500
    assert tracker.estimate(now=9.0).queued_tokens == 1500  # late, but not prefilled twice
    tracker.done(a, now=1.5)
    assert tracker.estimate(now=2.0).queued_tokens == 1000
    assert tracker.queued_tokens == 1500  # what pool_stats shows: the tokens sent, no progress
    two = PrefillPoolTracker()
    two.report("r1", 1000.0, now=0.0)
    two.report("r2", 1000.0, now=0.0)
    for t in (0.0, 0.0, 0.0):
        two.sent(1000, now=t)
    assert two.estimate(now=0.5).queued_tokens == 500 + 500 + 1000  # two in progress, one waiting


def test_tracker_sums_live_replicas_rates_and_forgets_silent_ones() -> None:
    tracker = PrefillPoolTracker(ttl_s=60.0)
    tracker.report("r1", 1000.0, now=0.0)
    tracker.report("r2", 800.0, now=10.0)
    tracker.report("r3", None, now=10.0)  # no measurement yet: ignored
    est = tracker.estimate(now=20.0)
    assert (est.tokens_per_s, est.num_replicas) == (1800.0, 2)
    est = tracker.estimate(now=65.0)  # r1 silent for 65 s: gone (downscaled or dead)
    assert (est.tokens_per_s, est.num_replicas) == (800.0, 1)
    tracker.report("r2", 400.0, now=66.0)  # a slower host: the rate moves toward it
    assert 400.0 < tracker.estimate(now=66.0).tokens_per_s < 800.0
    assert tracker.estimate(backing_off=True, now=66.0).backing_off


def test_a_decode_replica_past_its_capacity_never_takes_a_prefill() -> None:
    """Even where it predicts the sooner first token (the pool's queue is long), a decode replica
    whose streams fill its steps, or where requests wait, sends the prompt to the pool."""
    saturated = LocalEstimate(1500, 0, 400.0, saturated=True)
    p = place(saturated, pool(queued=10_000), MIN, BUDGET)
    assert (p.where, p.reason) == ("remote", "decode_saturated")
    assert p.local_ttft_s == pytest.approx(3.75) and p.local_ttft_s < p.remote_ttft_s
    assert place(LocalEstimate(1500, 0, 400.0), pool(queued=10_000), MIN, BUDGET).where == "local"
    # what still comes first: short prompts and a pool backing off
    assert place(LocalEstimate(MIN - 1, 0, 400.0, saturated=True), pool(), MIN, BUDGET).reason == "short"
    assert place(saturated, pool(backing_off=True), MIN, BUDGET).reason == "backoff"


def fake_engine(num_waiting: int, running_tokens: list[int], within: int | None, rate: float = 1000.0,
                idle_step_budget_s: float | None = None):
    """What `local_estimate` reads of an engine: its stats, its step-cost fit's tokens within a
    budget, its running requests' tokens a step (1 + drafts each)."""
    from types import SimpleNamespace

    running = [SimpleNamespace(spec_token_ids=[0] * (n - 1)) for n in running_tokens]
    return SimpleNamespace(
        num_cached_prompt_tokens=lambda prompt, params: 0,
        stats=lambda: {"prefill_tokens_per_s": rate, "num_running": len(running), "num_waiting": num_waiting,
                       "queued_tokens": 300 * num_waiting},
        step_cost=SimpleNamespace(tokens_within=lambda seconds: within if within is None else round(within * seconds / 0.1)),
        scheduler=SimpleNamespace(running=running, step_budget_s=lambda: 0.1 if running else idle_step_budget_s))


def test_the_local_estimate_says_when_the_decode_replica_is_past_its_capacity() -> None:
    from deployments.replica import local_estimate

    prompt = list(range(1500))
    room = local_estimate(fake_engine(0, [5] * 10, within=100), prompt, None)
    assert not room.saturated and room.tokens_per_s == pytest.approx((100 - 50) / 0.1)
    full = local_estimate(fake_engine(0, [5] * 20, within=100), prompt, None)  # 100 decode tokens a step
    assert full.saturated
    waiting = local_estimate(fake_engine(2, [5] * 2, within=100), prompt, None)
    assert waiting.saturated and waiting.queued_tokens == 600
    assert not local_estimate(fake_engine(0, [], within=None), prompt, None).saturated
    assert local_estimate(fake_engine(0, [], within=100), prompt, None).tokens_per_s == 1000.0
    # a decode replica's idle steps take 0.5 s at most: 500 tokens of them, a 4x longer chunk than beside streams
    idle = local_estimate(fake_engine(0, [], within=100, rate=2000.0, idle_step_budget_s=0.5), prompt, None)
    assert idle.tokens_per_s == pytest.approx(500 / 0.5) and not idle.saturated


def test_a_prefill_replica_decodes_a_prompt_only_with_nothing_else_to_prefill_and_room() -> None:
    """`decodes_here`: below `pool_max_streams` streams, none of them still prefilling, and no
    request waiting; otherwise the prompt is handed over (the pool keeps its prefill rate)."""
    from types import SimpleNamespace

    from deployments.replica import decodes_here

    def engine(outputs: list[int], num_waiting: int = 0):
        running = [SimpleNamespace(output_token_ids=[7] * n) for n in outputs]
        return SimpleNamespace(scheduler=SimpleNamespace(running=running, waiting=[object()] * num_waiting))

    assert decodes_here(engine([]), 2)
    assert decodes_here(engine([3]), 2)
    assert not decodes_here(engine([3, 9]), 2)  # as many streams as allowed
    assert not decodes_here(engine([3, 0]), 3)  # one still being prefilled
    assert not decodes_here(engine([], num_waiting=1), 2)
