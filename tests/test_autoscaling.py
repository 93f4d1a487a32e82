"""The SLO autoscaling policy and the replica-side latency tracker, without Ray running.

The policy gets real `ray.serve.config.AutoscalingContext`s and is built the way Serve's controller
builds it (`AutoscalingPolicy` -> `_resolve_policy_callable` -> `_apply_autoscaling_config`, which adds
Serve's up/down delays). The closed-loop tests drive it against a simulated deployment whose p95
TPOT grows with the load per replica and lags like the replicas' windowed p95s, on a fake clock.
"""

from __future__ import annotations

import copy
import logging
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve import autoscaling_policy as serve_autoscaling_policy
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from deployments.autoscaling import (
    METRIC_E2E_MEAN_MS,
    METRIC_KV_USAGE,
    METRIC_NUM_RUNNING,
    METRIC_NUM_SAMPLES,
    METRIC_NUM_WAITING,
    METRIC_TPOT_P95_MS,
    METRIC_TTFT_P95_MS,
    SLO_POLICY_PATH,
    STATE_CAPACITY,
    LatencyTracker,
    SLOAutoscalingPolicy,
    SLOPolicyConfig,
    percentile,
    replica_autoscaling_stats,
)
from deployments.config import ConfigError, load_serve_config, validate_serve_config

DEPLOYMENT = DeploymentID(name="SpecDecode", app_name="specdecode")
SLO = {"ttft_p95_ms": 1000.0, "tpot_p95_ms": 100.0}


def replicas(n: int) -> list[ReplicaID]:
    return [ReplicaID(f"r{i}", deployment_id=DEPLOYMENT) for i in range(n)]


def context(
    n: int,
    *,
    target: int | None = None,
    ttft_ms: float = 100.0,
    tpot_ms: float = 20.0,
    samples: float = 50.0,
    kv: float = 0.1,
    waiting: float = 0.0,
    running: float | None = None,
    e2e_ms: float = 1000.0,
    ongoing: float = 4.0,
    queued: float = 0.0,
    state: dict | None = None,
    now: float = 10_000.0,
    last_up: float | None = None,
    lo: int = 1,
    hi: int = 8,
    config: AutoscalingConfig | None = None,
) -> AutoscalingContext:
    """A real AutoscalingContext as the controller builds it, every replica reporting the same."""
    ids = replicas(n)
    metrics = {
        METRIC_TTFT_P95_MS: dict.fromkeys(ids, ttft_ms),
        METRIC_TPOT_P95_MS: dict.fromkeys(ids, tpot_ms),
        METRIC_NUM_SAMPLES: dict.fromkeys(ids, samples / max(n, 1)),
        METRIC_KV_USAGE: dict.fromkeys(ids, kv),
        METRIC_NUM_WAITING: dict.fromkeys(ids, waiting / max(n, 1)),
        METRIC_NUM_RUNNING: dict.fromkeys(ids, (ongoing - queued if running is None else running) / max(n, 1)),
        METRIC_E2E_MEAN_MS: dict.fromkeys(ids, e2e_ms),
    }
    return AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name=DEPLOYMENT.name,
        app_name=DEPLOYMENT.app_name,
        current_num_replicas=n,
        target_num_replicas=n if target is None else target,
        running_replicas=ids,
        total_num_requests=ongoing,
        total_queued_requests=queued,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
        policy_state={} if state is None else state,
        last_scale_up_time=last_up,
        last_scale_down_time=None,
        current_time=now,
        config=config or AutoscalingConfig(min_replicas=lo, max_replicas=hi),
    )


def policy(**kwargs: Any) -> SLOAutoscalingPolicy:
    return SLOAutoscalingPolicy(**{**SLO, **kwargs})


# --- config -----------------------------------------------------------------------------------
def test_config_defaults_and_messages() -> None:
    assert SLOPolicyConfig() == SLOPolicyConfig.from_kwargs({})
    errors = SLOPolicyConfig.check({"tpot_p95_ms": 0, "target_utilization": 1.5, "min_latency_samples": 2.5, "x": 1})
    assert "policy_kwargs.x: unknown field; allowed fields: ttft_p95_ms, tpot_p95_ms" in errors[0]
    assert "policy_kwargs.tpot_p95_ms: must be > 0.0, got 0" in errors
    assert "policy_kwargs.target_utilization: must be in (0.0, 1.0], got 1.5" in errors
    assert "policy_kwargs.min_latency_samples: must be an integer, got 2.5" in errors
    assert "scale_down_below: must be <= target_utilization (0.4)" in SLOPolicyConfig.check({"target_utilization": 0.4})[0]
    with pytest.raises(ValueError, match="ttft_p95_ms: must be a number"):
        SLOAutoscalingPolicy(ttft_p95_ms="fast")
    with pytest.raises(ValueError, match="unknown field"):
        SLOAutoscalingPolicy(tpot_ms=50)


def test_serve_builds_the_policy_from_the_shipped_config() -> None:
    """The class is instantiated once with policy_kwargs, as the controller does."""
    [deployment] = [d for d in load_serve_config()["applications"][0]["deployments"] if "autoscaling_config" in d]
    block = deployment["autoscaling_config"]
    built = _resolve_policy_callable(AutoscalingConfig(**block).policy)
    assert isinstance(built, SLOAutoscalingPolicy)
    assert built.config == SLOPolicyConfig(**block["policy"]["policy_kwargs"])
    assert block["policy"]["policy_function"] == SLO_POLICY_PATH


def test_project_validator_checks_policy_kwargs() -> None:
    config = copy.deepcopy(load_serve_config())
    block = config["applications"][0]["deployments"][0]["autoscaling_config"]
    block["policy"]["policy_kwargs"] = {"tpot_p95_ms": -1, "ttft": 5}
    with pytest.raises(ConfigError) as info:
        validate_serve_config(config)
    where = "applications[0].deployments[0].autoscaling_config.policy.policy_kwargs"
    assert f"{where}.tpot_p95_ms: must be > 0.0, got -1" in str(info.value)
    assert f"{where}.ttft: unknown field" in str(info.value)


# --- single decisions -------------------------------------------------------------------------
def test_violation_scales_up_proportionally_and_remembers_capacity() -> None:
    p = policy()
    # TPOT p95 130/100 -> pressure 1.3 -> ceil(2 * 1.3 / 0.7) = 4.
    n, state = p(context(2, tpot_ms=130.0, ongoing=24.0))
    assert n == 4
    assert state[STATE_CAPACITY] == 12.0
    # Just over the SLO still adds at least one replica; far over it at most doubles.
    assert p(context(3, tpot_ms=101.0, ongoing=24.0))[0] == 5
    assert p(context(3, tpot_ms=105.0, ongoing=24.0, hi=100))[0] == 5  # ceil(3 * 1.05 / 0.7) = 5
    assert p(context(3, tpot_ms=900.0, ongoing=24.0, hi=100))[0] == 6
    assert p(context(3, ttft_ms=3000.0, ongoing=24.0, hi=100))[0] == 6  # TTFT counts the same way
    assert p(context(2, kv=0.99, ongoing=24.0))[0] == 4  # KV nearly full: pressure 1.1


def test_a_null_slo_leaves_that_signal_out() -> None:
    """Disaggregated pools: the prefill pool ignores TPOT, the decode pool TTFT (null in
    policy_kwargs); KV use can be left out too; all three null is refused."""
    prefill = SLOAutoscalingPolicy(ttft_p95_ms=1000, tpot_p95_ms=None)
    decode = SLOAutoscalingPolicy(ttft_p95_ms=None, tpot_p95_ms=100, kv_usage_high=0.9)
    slow_decode = context(2, tpot_ms=900.0, ongoing=24.0)
    slow_prefill = context(2, ttft_ms=9000.0, ongoing=24.0)
    assert prefill(slow_decode)[0] <= 2 and decode(slow_decode)[0] == 4  # <= 2: it may even scale down
    assert prefill(slow_prefill)[0] == 4 and decode(slow_prefill)[0] <= 2
    assert "TPOT p95 900.0/ignored" in prefill.figures(slow_decode).describe(prefill.config)
    assert SLOAutoscalingPolicy(kv_usage_high=None)(context(2, kv=0.99, ongoing=24.0))[0] <= 2
    assert "are all null" in SLOPolicyConfig.check({"ttft_p95_ms": None, "tpot_p95_ms": None, "kv_usage_high": None})[0]
    assert SLOPolicyConfig.check({"min_latency_samples": None}) == ["policy_kwargs.min_latency_samples: must be an integer, got None"]


def test_requests_queued_at_handles_count_toward_ttft() -> None:
    """Replicas at max_ongoing_requests: 16 run (2 s each), 24 more wait at Serve's handles. The
    replicas' own TTFT p95 is fine, but by Little's law the queue waits 24 * 2000 / 16 = 3000 ms."""
    p = policy()
    ctx = context(2, ttft_ms=100.0, tpot_ms=20.0, ongoing=40.0, queued=24.0, e2e_ms=2000.0)
    figures = p.figures(ctx)
    assert figures.queue_wait_ms == pytest.approx(3000.0)
    assert figures.ttft_p95_ms == pytest.approx(3100.0) and figures.pressure == pytest.approx(3.1)
    assert p(ctx)[0] == 4
    assert p.figures(context(2, ongoing=16.0, queued=0.0, e2e_ms=2000.0)).queue_wait_ms == 0.0


def test_scale_up_respects_max_cooldown_samples_and_starting_replicas() -> None:
    p = policy(upscale_cooldown_s=30, min_latency_samples=10)
    assert p(context(3, tpot_ms=300.0, hi=4))[0] == 4
    assert p(context(4, tpot_ms=300.0, hi=4))[0] == 4  # at max: hold
    assert p(context(2, tpot_ms=300.0, now=100.0, last_up=80.0))[0] == 2  # cooling down
    assert p(context(2, tpot_ms=300.0, now=100.0, last_up=60.0))[0] == 4
    assert p(context(2, tpot_ms=300.0, samples=5))[0] == 2  # too few samples to act on
    assert p(context(2, target=4, tpot_ms=300.0))[0] == 4  # replicas still starting: hold target
    assert p(context(2, tpot_ms=300.0, ongoing=0.0))[0] == 2  # old p95s, no load left: nothing to fix


def test_cooldown_also_counts_from_when_new_replicas_came_up() -> None:
    p = policy(upscale_cooldown_s=30)
    _, state = p(context(1, tpot_ms=50.0, now=0.0))
    _, state = p(context(2, tpot_ms=50.0, now=100.0, state=state, last_up=10.0))  # came up at t=100
    assert p(context(2, tpot_ms=300.0, now=120.0, state=state, last_up=10.0))[0] == 2
    assert p(context(2, tpot_ms=300.0, now=131.0, state=state, last_up=10.0))[0] == 4


def test_scale_down_needs_low_pressure_no_queue_and_a_fit() -> None:
    p = policy()
    assert p(context(3, tpot_ms=20.0, ongoing=2.0))[0] == 2  # projected 0.2 * 3 / 2 = 0.3
    assert p(context(3, tpot_ms=20.0, ongoing=2.0, waiting=2.0))[0] == 3  # engines have a queue
    assert p(context(3, tpot_ms=20.0, ongoing=2.0, queued=1.0, e2e_ms=100.0))[0] == 3  # handles have a queue
    assert p(context(3, tpot_ms=60.0, ongoing=2.0))[0] == 3  # 0.6 >= scale_down_below
    assert p(context(2, tpot_ms=40.0, ongoing=2.0))[0] == 2  # projected 0.4 * 2 / 1 = 0.8 > 0.7
    assert p(context(1, tpot_ms=1.0, ongoing=0.0))[0] == 1  # min_replicas
    assert p(context(3, tpot_ms=1.0, ongoing=0.0, lo=3))[0] == 3
    assert p(context(4, tpot_ms=1.0, ongoing=0.0))[0] == 3  # one at a time
    # Few samples still count against scaling down (the cautious side).
    assert p(context(3, tpot_ms=90.0, samples=1, ongoing=2.0))[0] == 3


def test_scale_down_uses_the_capacity_seen_at_the_last_violation() -> None:
    p = policy(capacity_memory_s=600)
    _, state = p(context(1, tpot_ms=150.0, ongoing=10.0, now=0.0))  # violated at 10/replica
    assert state[STATE_CAPACITY] == 10.0
    # Two replicas, same load, latencies now low: one replica would carry 10 > 0.7 * 10 -> hold.
    assert p(context(2, tpot_ms=30.0, ongoing=10.0, now=100.0, state=dict(state)))[0] == 2
    assert p(context(2, tpot_ms=30.0, ongoing=7.0, now=100.0, state=dict(state)))[0] == 1
    # Forgotten after capacity_memory_s: back to the projection (0.3 * 2 = 0.6 <= 0.7).
    n, later = p(context(2, tpot_ms=30.0, ongoing=10.0, now=700.0, state=dict(state)))
    assert n == 1 and STATE_CAPACITY not in later


def test_decisions_are_logged_with_their_figures(caplog: pytest.LogCaptureFixture) -> None:
    p = policy()
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        _, state = p(context(2, tpot_ms=130.0, ttft_ms=200.0, ongoing=24.0))
        p(context(2, tpot_ms=130.0, ttft_ms=200.0, ongoing=24.0, state=state))  # same decision: quiet
    (record,) = [r for r in caplog.records if "SLO autoscaling" in r.getMessage()]
    message = record.getMessage()
    assert record.name == "ray.serve"
    assert "SpecDecode: up 2 -> 4" in message
    assert "2 x min(1.30 / 0.7, 2) -> 4" in message
    assert "TPOT p95 130.0/100 ms" in message and "TTFT p95 200.0 (queue 0)/1000 ms" in message
    assert "24.0 ongoing" in message


# --- closed loop ------------------------------------------------------------------------------
@dataclass
class SimulatedDeployment:
    """p95 TPOT = base + ms_per_request * (load / replicas), reported as the worst of the last
    `window_s` seconds (the replicas' windowed p95s lag); replicas take `start_s` to come up.
    At 20 + 5 * load/replica ms and a 100 ms SLO, one replica holds 16 concurrent requests."""

    base_ms: float = 20.0
    ms_per_request: float = 5.0
    window_s: int = 20
    start_s: int = 15
    noise: float = 0.0
    running: int = 1
    starting: list[int] = field(default_factory=list)  # times at which starting replicas run
    history: deque = field(default_factory=lambda: deque(maxlen=20))
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def tpot_ms(self, load: float) -> float:
        jitter = 1.0 + self.rng.uniform(-self.noise, self.noise)
        return (self.base_ms + self.ms_per_request * load / self.running) * jitter

    def observe(self, load: float) -> float:
        self.history.append(self.tpot_ms(load))
        return max(self.history)


def run_closed_loop(
    load: Callable[[int], float],
    seconds: int,
    *,
    lo: int = 1,
    hi: int = 8,
    upscale_delay_s: float = 5.0,
    downscale_delay_s: float = 60.0,
    policy_kwargs: dict | None = None,
    plant: SimulatedDeployment | None = None,
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[int, int, float]]:
    """(time, running replicas, reported p95 TPOT) each simulated second, with Serve's own
    wrapper (scaling factors, delays) around the policy and its min/max bounds after it."""
    now = [0.0]

    class FakeTime:
        @staticmethod
        def time() -> float:
            return now[0]

    monkeypatch.setattr(serve_autoscaling_policy, "time", FakeTime)
    config = AutoscalingConfig(
        min_replicas=lo, max_replicas=hi, upscale_delay_s=upscale_delay_s, downscale_delay_s=downscale_delay_s,
        policy=AutoscalingPolicy(policy_function=SLO_POLICY_PATH, policy_kwargs={**SLO, **(policy_kwargs or {})}),
    )
    wrapped = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    sim = plant or SimulatedDeployment()
    sim.running = lo
    target, state, last_up = lo, {}, None
    trace = []
    for t in range(seconds):
        now[0] = float(t)
        while sim.starting and sim.starting[0] <= t:
            sim.starting.pop(0)
            sim.running += 1
        offered = load(t)
        tpot = sim.observe(offered)
        ctx = context(
            sim.running, target=target, tpot_ms=tpot, ttft_ms=50.0, ongoing=offered, state=state,
            now=float(t), last_up=last_up, lo=lo, hi=hi, config=config,
        )
        decision, state = wrapped(ctx)
        decision = max(lo, min(hi, decision))  # DeploymentAutoscalingState.apply_bounds
        if decision > target:
            last_up = float(t)
            sim.starting += [t + sim.start_s] * (decision - target)
        elif decision < target:
            sim.starting = sim.starting[: max(0, len(sim.starting) - (target - decision))]
            sim.running = min(sim.running, decision)
        target = decision
        trace.append((t, sim.running, tpot))
    return trace


def changes(trace: list[tuple[int, int, float]], start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """(time, new replica count) for every change of the running count in [start, end)."""
    out = []
    for (_, before, _), (t, after, _) in zip(trace, trace[1:], strict=False):
        if start <= t < (end if end is not None else math.inf) and after != before:
            out.append((t, after))
    return out


def test_step_load_scales_up_fast_then_holds_then_scales_down_slowly(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 concurrent requests, then 60 from t=100 to t=400, then 8 again.
    def load(t: int) -> float:
        return 60.0 if 100 <= t < 400 else 8.0

    trace = run_closed_loop(load, 800, monkeypatch=monkeypatch, policy_kwargs={"upscale_cooldown_s": 30})
    by_time = {t: (n, tpot) for t, n, tpot in trace}
    assert by_time[99][0] == 1 and by_time[99][1] < 100  # 8 requests fit on one replica
    # Fast: 1 -> 2 -> 4 within two cooldowns plus start-up; back under the SLO soon after.
    ups = changes(trace, 100, 400)
    assert [n for _, n in ups] == [2, 4], ups
    assert ups[-1][0] <= 100 + 2 * (30 + 15) + 10
    settled = ups[-1][0] + 25  # the lagging p95 window has moved past the overload
    assert all(tpot < 100 for t, _, tpot in trace if settled <= t < 400)
    assert changes(trace, ups[-1][0] + 1, 400) == []  # no flapping under the steady load
    # Slow: one replica at a time, each after the downscale delay, down to min_replicas.
    downs = changes(trace, 400)
    assert [n for _, n in downs] == [3, 2, 1], downs
    assert downs[0][0] >= 400 + 60
    assert all(b - a >= 60 for (a, _), (b, _) in zip(downs, downs[1:], strict=False))
    assert all(tpot < 100 for t, _, tpot in trace if t >= 400 + 25)


def test_noisy_steady_load_does_not_flap(monkeypatch: pytest.MonkeyPatch) -> None:
    """40 requests with +-15% latency noise: it settles once and stays, though pressure wanders."""
    plant = SimulatedDeployment(noise=0.15)
    trace = run_closed_loop(lambda t: 40.0, 1200, monkeypatch=monkeypatch, plant=plant,
                            downscale_delay_s=30.0, policy_kwargs={"upscale_cooldown_s": 30})
    moves = changes(trace)
    assert moves and all(n > 1 for _, n in moves)
    assert moves[-1][0] < 200, moves  # settled within the first minutes ...
    assert len(moves) <= 3, moves  # ... after a few steps up, none down
    assert all(tpot < 100 * 1.15 for t, _, tpot in trace if t > moves[-1][0] + 25)


def test_bounds_hold_under_overload_and_idleness(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = run_closed_loop(lambda t: 200.0 if t < 300 else 0.0, 800, lo=2, hi=3,
                            downscale_delay_s=30.0, monkeypatch=monkeypatch)
    counts = [n for _, n, _ in trace]
    assert min(counts) == 2 and max(counts) == 3
    assert counts[299] == 3 and counts[-1] == 2


# --- the replica side -------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_percentile_nearest_rank() -> None:
    assert percentile([], 95) == 0.0
    values = [float(v) for v in range(1, 21)]  # 1..20
    assert percentile(values, 95) == 19.0  # rank ceil(0.95 * 20) = 19
    assert percentile(values, 100) == 20.0
    assert percentile([5.0], 95) == 5.0


def test_tracker_measures_ttft_and_tpot_over_the_window() -> None:
    clock = Clock()
    tracker = LatencyTracker(window_s=10.0, clock=clock)
    tracker.start("a")
    clock.now = 0.5
    tracker.on_tokens("a", 1)  # TTFT 0.5 s
    clock.now = 0.9
    tracker.on_tokens("a", 2)  # speculative step: two tokens at once
    clock.now = 1.1
    tracker.on_tokens("a", 1)
    tracker.on_tokens("a", 0)  # an empty chunk changes nothing
    tracker.finish("a")  # 4 tokens, 0.6 s after the first: TPOT 0.2 s
    snap = tracker.snapshot()
    assert snap.ttft_p95_s == pytest.approx(0.5) and snap.tpot_p95_s == pytest.approx(0.2)
    assert snap.e2e_mean_s == pytest.approx(1.1)
    assert (snap.num_ttft_samples, snap.num_tpot_samples) == (1, 1)
    clock.now = 11.2  # both samples leave the window
    assert tracker.snapshot() == type(snap)(0.0, 0.0, 0, 0, 0.0)


def test_tracker_counts_requests_in_flight() -> None:
    """An overload shows before the slow requests finish: waiting ones add their age as TTFT,
    streaming ones their TPOT so far; a request with one token (or none) adds no TPOT."""
    clock = Clock()
    tracker = LatencyTracker(window_s=60.0, clock=clock)
    tracker.start("waiting")
    tracker.start("streaming")
    tracker.start("single")
    clock.now = 0.1
    tracker.on_tokens("streaming", 1)
    tracker.on_tokens("single", 1)
    clock.now = 0.5
    tracker.on_tokens("streaming", 1)
    clock.now = 3.1
    snap = tracker.snapshot()
    assert snap.ttft_p95_s == pytest.approx(3.1)  # "waiting" has waited 3.1 s so far
    assert snap.tpot_p95_s == pytest.approx(3.0)  # "streaming": 3.0 s since its first token, 2 tokens
    tracker.finish("single")
    tracker.finish("waiting")  # cancelled before its first token: no TPOT, its age is gone
    tracker.finish("unknown")
    assert tracker.snapshot().num_tpot_samples == 1
    with pytest.raises(ValueError, match="window_s"):
        LatencyTracker(window_s=0)


def test_replica_stats_are_a_flat_dict_of_numbers() -> None:
    clock = Clock()
    tracker = LatencyTracker(window_s=10.0, clock=clock)
    engine = {"num_running": 3, "num_waiting": 2, "num_blocks": 100, "num_used_blocks": 25, "queued_tokens": 700,
              "num_free_blocks": 75, "num_preemptions": 0, "spec": {"acceptance_rate": 0.5}}
    stats = replica_autoscaling_stats(engine, tracker.snapshot())
    assert all(isinstance(v, float) for v in stats.values())  # Serve drops non-numeric reports
    assert stats[METRIC_KV_USAGE] == 0.25 and stats[METRIC_NUM_WAITING] == 2.0
    assert stats["queued_tokens"] == 700.0 and stats["num_running"] == 3.0
    assert replica_autoscaling_stats({"num_blocks": 0}, tracker.snapshot())[METRIC_KV_USAGE] == 0.0
