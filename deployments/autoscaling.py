"""SLO autoscaling: replicas report windowed p95 TTFT/TPOT and engine load; a Serve policy sizes the
deployment so that both p95s stay under their targets.

Replica side: `LatencyTracker` (fed by `SpecDecodeServer.generate`) and `replica_autoscaling_stats`
build the dict `record_autoscaling_stats` returns (names in `METRIC_*`). Controller side:
`SLOAutoscalingPolicy(**policy_kwargs)` is called by Serve with an `AutoscalingContext` each tick
and returns (desired replicas, policy state); Serve then applies its up/down delays and min/max.
This module imports only the standard library and Ray: Serve pickles it by value into the
controller, where the rest of the project may not be importable.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

logger = logging.getLogger("ray.serve")

SLO_POLICY_PATH = "deployments.autoscaling:SLOAutoscalingPolicy"

# Names of the metrics a replica reports (record_autoscaling_stats and record_routing_stats).
METRIC_TTFT_P95_MS = "ttft_p95_ms"
METRIC_TPOT_P95_MS = "tpot_p95_ms"
METRIC_NUM_SAMPLES = "num_latency_samples"
METRIC_E2E_MEAN_MS = "e2e_mean_ms"  # mean duration of the requests finished in the window
METRIC_NUM_RUNNING = "num_running"
METRIC_NUM_WAITING = "num_waiting"
METRIC_QUEUED_TOKENS = "queued_tokens"
METRIC_KV_USAGE = "kv_usage"

# Policy-state keys (Serve keeps the dict between ticks next to its own delay counters).
STATE_CAPACITY = "slo_capacity_per_replica"  # ongoing requests per replica at the last violation
STATE_CAPACITY_TIME = "slo_capacity_time"
STATE_DECISION = "slo_last_decision"  # "kind:replicas:code" of the last logged decision
STATE_LOGGED_AT = "slo_logged_at"  # when a hold was last logged (holds: at most every HOLD_LOG_S)
HOLD_LOG_S = 10.0
STATE_NUM_RUNNING = "slo_num_running"  # running replicas at the last tick ...
STATE_GREW_AT = "slo_grew_at"  # ... and when that number last went up (new replicas came up)

MAX_SAMPLES = 20_000  # per series, so a flood of short requests cannot grow memory without bound


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]) of `values`; 0.0 when empty.

    Example: 20 values, q=95 -> rank ceil(0.95 * 20) = 19 -> the 19th smallest (index 18).
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class _Live:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


@dataclass(frozen=True)
class LatencySnapshot:
    """p95s over the window, in seconds, how many samples each came from, and the mean duration
    (arrival to last token) of the requests that finished in the window."""

    ttft_p95_s: float
    tpot_p95_s: float
    num_ttft_samples: int
    num_tpot_samples: int
    e2e_mean_s: float = 0.0


class LatencyTracker:
    """Windowed p95 time-to-first-token and time-per-output-token of one replica's requests.

    Finished measurements are kept for `window_s`. Requests still in flight count too, so an
    overload shows before its requests finish: one waiting for its first token contributes its age
    (a lower bound of its TTFT), one streaming with n >= 2 tokens its TPOT so far,
    (now - first token) / (n - 1). TPOT of a finished request: (last - first token) / (n - 1).
    Not thread-safe: call it from the replica's event loop only.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s: must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self.live: dict[str, _Live] = {}
        self.ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (time, seconds)
        self.tpot: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self.e2e: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def start(self, request_id: str) -> None:
        self.live[request_id] = _Live(arrival=self.clock())

    def on_tokens(self, request_id: str, num_tokens: int) -> None:
        """`num_tokens` more output tokens of `request_id` reached the client (0 is ignored)."""
        req = self.live.get(request_id)
        if req is None or num_tokens <= 0:
            return
        now = self.clock()
        if req.first_token is None:
            req.first_token = now
            self.ttft.append((now, now - req.arrival))
        req.num_tokens += num_tokens
        req.last_token = now

    def finish(self, request_id: str) -> None:
        """The request ended (finished, failed or cancelled): keep its TPOT, forget the rest."""
        req = self.live.pop(request_id, None)
        if req is None or req.first_token is None or req.last_token is None:
            return
        self.e2e.append((req.last_token, req.last_token - req.arrival))
        if req.num_tokens >= 2:
            self.tpot.append((req.last_token, (req.last_token - req.first_token) / (req.num_tokens - 1)))

    def snapshot(self) -> LatencySnapshot:
        now = self.clock()
        horizon = now - self.window_s
        for series in (self.ttft, self.tpot, self.e2e):
            while series and series[0][0] < horizon:
                series.popleft()
        ttft = [v for _, v in self.ttft]
        tpot = [v for _, v in self.tpot]
        for req in list(self.live.values()):
            if req.first_token is None:
                ttft.append(now - req.arrival)
            elif req.num_tokens >= 2:
                tpot.append((now - req.first_token) / (req.num_tokens - 1))
        e2e_mean = sum(v for _, v in self.e2e) / len(self.e2e) if self.e2e else 0.0
        return LatencySnapshot(percentile(ttft, 95), percentile(tpot, 95), len(ttft), len(tpot), e2e_mean)


def replica_autoscaling_stats(engine_stats: Mapping[str, Any], latency: LatencySnapshot) -> dict[str, float]:
    """What a replica reports: p95s in ms, sample count, engine queue and KV-cache use (0..1)."""
    num_blocks = engine_stats.get("num_blocks") or 0
    return {
        METRIC_TTFT_P95_MS: latency.ttft_p95_s * 1e3,
        METRIC_TPOT_P95_MS: latency.tpot_p95_s * 1e3,
        METRIC_NUM_SAMPLES: float(max(latency.num_ttft_samples, latency.num_tpot_samples)),
        METRIC_E2E_MEAN_MS: latency.e2e_mean_s * 1e3,
        METRIC_NUM_RUNNING: float(engine_stats.get("num_running", 0)),
        METRIC_NUM_WAITING: float(engine_stats.get("num_waiting", 0)),
        METRIC_QUEUED_TOKENS: float(engine_stats.get("queued_tokens", 0)),
        METRIC_KV_USAGE: engine_stats.get("num_used_blocks", 0) / num_blocks if num_blocks else 0.0,
    }


# --- the policy -------------------------------------------------------------------------------
# name: (lower bound, lower bound excluded, upper bound or None); every field is checked.
_SIGNALS = ("ttft_p95_ms", "tpot_p95_ms", "kv_usage_high")  # each may be null: not this pool's signal
_BOUNDS: dict[str, tuple[float, bool, float | None]] = {
    "ttft_p95_ms": (0.0, True, None),
    "tpot_p95_ms": (0.0, True, None),
    "target_utilization": (0.0, True, 1.0),
    "scale_down_below": (0.0, True, 1.0),
    "max_upscale_ratio": (1.0, False, None),
    "upscale_cooldown_s": (0.0, False, None),
    "downscale_load_margin": (0.0, True, 1.0),
    "kv_usage_high": (0.0, True, 1.0),
    "min_latency_samples": (1, False, None),
    "capacity_memory_s": (0.0, False, None),
}


@dataclass(frozen=True)
class SLOPolicyConfig:
    """The `policy_kwargs` of SLOAutoscalingPolicy: SLO targets and how hard to chase them.

    ttft_p95_ms, tpot_p95_ms: the SLO (p95 time to first token, p95 time per output token); null
      (None) leaves that signal out of the pressure: in disaggregated mode the prefill pool scales
      on TTFT only and the decode pool on TPOT and KV use.
    target_utilization: a scale-up aims for pressure (latency / SLO) this high, leaving headroom.
    scale_down_below: pressure must be under this (and nothing queued) to consider removing one.
    max_upscale_ratio: one decision multiplies the replica count by at most this.
    upscale_cooldown_s: after a scale-up decision, and after new replicas come up, wait this long
      before the next scale-up (>= the replicas' metrics_window_s + look_back_period_s, so the
      p95s no longer hold the overload that the last scale-up answered).
    downscale_load_margin: remove a replica only if the load per remaining replica stays under
      this fraction of the load per replica seen at the last violation (the learned capacity).
    kv_usage_high: KV-cache use (0..1) that counts as pressure 1.0 (preemptions come next); null
      leaves KV use out.
    min_latency_samples: fewer samples than this in the window do not trigger a scale-up.
    capacity_memory_s: how long the learned capacity is trusted.
    """

    ttft_p95_ms: float | None = 1000.0
    tpot_p95_ms: float | None = 100.0
    target_utilization: float = 0.7
    scale_down_below: float = 0.5
    max_upscale_ratio: float = 2.0
    upscale_cooldown_s: float = 30.0
    downscale_load_margin: float = 0.7
    kv_usage_high: float | None = 0.9
    min_latency_samples: int = 8
    capacity_memory_s: float = 1800.0

    def __post_init__(self) -> None:
        errors = self.check({f.name: getattr(self, f.name) for f in fields(self)})
        if errors:
            raise ValueError("\n".join(errors))

    @classmethod
    def check(cls, kwargs: Any, where: str = "policy_kwargs") -> list[str]:
        """Every problem with `kwargs`, one `path: message` line each (empty when valid)."""
        if not isinstance(kwargs, Mapping):
            return [f"{where}: must be a mapping, got {type(kwargs).__name__}"]
        allowed = [f.name for f in fields(cls)]
        errors = [f"{where}.{k}: unknown field; allowed fields: {', '.join(allowed)}" for k in kwargs if k not in allowed]
        for name, (lo, lo_open, hi) in _BOUNDS.items():
            if name not in kwargs or (name in _SIGNALS and kwargs[name] is None):
                continue
            value = kwargs[name]
            integral = isinstance(lo, int) and not isinstance(lo, bool)
            wanted = (int,) if integral else (int, float)
            if isinstance(value, bool) or not isinstance(value, wanted) or not math.isfinite(value):
                errors.append(f"{where}.{name}: must be {'an integer' if integral else 'a number'}, got {value!r}")
                continue
            low_ok = value > lo if lo_open else value >= lo
            if not low_ok or (hi is not None and value > hi):
                span = f"{'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f"{'>' if lo_open else '>='} {lo}"
                errors.append(f"{where}.{name}: must be {'in ' if hi is not None else ''}{span}, got {value}")
        if not errors and all(kwargs.get(name, getattr(cls, name)) is None for name in _SIGNALS):
            errors.append(f"{where}: {', '.join(_SIGNALS)} are all null; keep at least one signal to scale on")
        if not errors:
            down = kwargs.get("scale_down_below", cls.scale_down_below)
            target = kwargs.get("target_utilization", cls.target_utilization)
            if down > target:
                errors.append(
                    f"{where}.scale_down_below: must be <= target_utilization ({target}) so that a scale-down "
                    f"cannot undo a scale-up at the same load, got {down}"
                )
        return errors

    @classmethod
    def from_kwargs(cls, kwargs: Any, where: str = "policy_kwargs") -> SLOPolicyConfig:
        errors = cls.check(kwargs, where)
        if errors:
            raise ValueError("\n".join(errors))
        return cls(**kwargs)


@dataclass(frozen=True)
class Figures:
    """What one decision was based on (deployment-wide, from the replicas' windowed reports)."""

    num_replicas: int
    ttft_p95_ms: float  # sample-weighted mean of the replicas' p95s, plus queue_wait_ms
    queue_wait_ms: float  # estimated wait at Serve's handles before a replica takes a request
    tpot_p95_ms: float
    num_samples: float
    kv_usage: float  # the fullest replica's
    num_waiting: float  # in the engines' queues
    num_queued: float  # at Serve's handles, not yet on a replica
    num_ongoing: float  # Serve's total: running on replicas + queued at handles
    pressure: float  # max(TTFT/SLO, TPOT/SLO, KV/high); > 1 is a violation

    def describe(self, config: SLOPolicyConfig) -> str:
        def slo(value: float | None, unit: str = "") -> str:
            return "ignored" if value is None else f"{value:g}{unit}"

        return (
            f"pressure {self.pressure:.2f} = max(TTFT p95 {self.ttft_p95_ms:.1f} (queue {self.queue_wait_ms:.0f})"
            f"/{slo(config.ttft_p95_ms, ' ms')}, "
            f"TPOT p95 {self.tpot_p95_ms:.1f}/{slo(config.tpot_p95_ms, ' ms')}, "
            f"KV {self.kv_usage:.2f}/{slo(config.kv_usage_high)}) "
            f"from {self.num_samples:.0f} samples; {self.num_ongoing:.1f} ongoing, {self.num_waiting:.1f} waiting in "
            f"engines, {self.num_queued:.1f} queued at handles, {self.num_replicas} replicas"
        )


@dataclass(frozen=True)
class Decision:
    kind: str  # "up", "down" or "hold"
    num_replicas: int
    code: str  # why, in one stable word (what the log de-duplicates on)
    reason: str  # why, with the numbers
    figures: Figures | None = None


def _ratio(value: float, slo: float | None) -> float:
    """A signal's pressure: value / SLO, 0 for a signal the pool does not scale on (SLO null)."""
    return 0.0 if slo is None else value / slo


def _weighted_mean(values: Mapping[Any, float], weights: Mapping[Any, float]) -> float:
    total = sum(w for r, w in weights.items() if w > 0 and r in values)
    if total <= 0:
        return 0.0
    return sum(values[r] * w for r, w in weights.items() if w > 0 and r in values) / total


class SLOAutoscalingPolicy:
    """Serve autoscaling policy (`autoscaling_config.policy.policy_function`) keeping p95 TTFT and
    p95 TPOT under the SLO in `policy_kwargs` (see SLOPolicyConfig).

    pressure = max(ttft_p95 / ttft_slo, tpot_p95 / tpot_slo, kv_usage / kv_usage_high), where the
    p95s are the replicas' (sample-weighted), TTFT plus the estimated wait at Serve's handles
    (`figures`), and kv_usage the fullest replica's.
    * pressure > 1 with load on the replicas: up to n' = clamp(ceil(n * pressure / target_utilization),
      n + 1, ceil(n * max_upscale_ratio)), then nothing more for upscale_cooldown_s; the load per
      replica at the violation is remembered as the replicas' capacity. While replicas are still
      starting (running < target), hold the target.
    * pressure < scale_down_below, nothing waiting, and the load fits on n - 1 replicas (ongoing /
      (n - 1) <= downscale_load_margin * capacity, or without a remembered capacity
      pressure * n / (n - 1) <= target_utilization): down by one.
    * otherwise hold. Serve then applies upscale_delay_s / downscale_delay_s and min/max.
    """

    def __init__(self, **policy_kwargs: Any) -> None:
        self.config = SLOPolicyConfig.from_kwargs(policy_kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        decision = self.decide(ctx, state)
        self.log(ctx, decision, state)
        return decision.num_replicas, state

    def log(self, ctx: Any, decision: Decision, state: dict[str, Any]) -> None:
        """Log a decision with its figures when it differs from the last one logged: every scale-up
        and scale-down, and holds at most every HOLD_LOG_S (Serve calls the policy ~10 times a s)."""
        key = f"{decision.kind}:{decision.num_replicas}:{decision.code}"
        if state.get(STATE_DECISION) == key:
            return
        now = ctx.current_time if ctx.current_time is not None else time.time()
        if decision.kind == "hold":
            if now - state.get(STATE_LOGGED_AT, -math.inf) < HOLD_LOG_S:
                return
            state[STATE_LOGGED_AT] = now
        state[STATE_DECISION] = key
        figures = f"; {decision.figures.describe(self.config)}" if decision.figures else ""
        logger.info(
            "SLO autoscaling %s: %s %d -> %d (%s)%s", ctx.deployment_name, decision.kind,
            ctx.current_num_replicas, decision.num_replicas, decision.reason, figures,
        )

    def figures(self, ctx: Any, latency_min_samples: int = 1) -> Figures:
        """Deployment-wide figures; latencies count only with >= `latency_min_samples` samples.

        Replicas measure TTFT from when they get a request; requests queued at Serve's handles
        (all replicas at max_ongoing_requests) wait longer. By Little's law the replicas finish
        on_replicas / e2e_mean requests a second, so a queue of q waits about
        q * e2e_mean / on_replicas; that is added to the TTFT p95.
        """
        metrics = ctx.aggregated_metrics or {}
        samples = metrics.get(METRIC_NUM_SAMPLES, {})
        num_samples = float(sum(samples.values()))
        num_queued = float(ctx.total_queued_requests or 0.0)
        num_waiting = float(sum(metrics.get(METRIC_NUM_WAITING, {}).values()))
        on_replicas = float(sum(metrics.get(METRIC_NUM_RUNNING, {}).values())) + num_waiting
        e2e_mean = _weighted_mean(metrics.get(METRIC_E2E_MEAN_MS, {}), samples)
        queue_wait = num_queued * e2e_mean / max(1.0, on_replicas)
        ttft = _weighted_mean(metrics.get(METRIC_TTFT_P95_MS, {}), samples) + queue_wait
        tpot = _weighted_mean(metrics.get(METRIC_TPOT_P95_MS, {}), samples)
        kv = max(metrics.get(METRIC_KV_USAGE, {}).values(), default=0.0)
        cfg = self.config
        latency = 0.0
        if num_samples >= latency_min_samples:
            latency = max(_ratio(ttft, cfg.ttft_p95_ms), _ratio(tpot, cfg.tpot_p95_ms))
        return Figures(
            num_replicas=ctx.current_num_replicas,
            ttft_p95_ms=ttft,
            queue_wait_ms=queue_wait,
            tpot_p95_ms=tpot,
            num_samples=num_samples,
            kv_usage=kv,
            num_waiting=num_waiting,
            num_queued=num_queued,
            num_ongoing=float(ctx.total_num_requests or 0.0),
            pressure=max(latency, _ratio(kv, cfg.kv_usage_high)),
        )

    def decide(self, ctx: Any, state: dict[str, Any]) -> Decision:
        """The decision for this tick; updates `state` (the remembered capacity) in place."""
        cfg = self.config
        n, target = ctx.current_num_replicas, ctx.target_num_replicas
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        now = ctx.current_time if ctx.current_time is not None else time.time()
        if 0 < state.get(STATE_NUM_RUNNING, 0) < n:  # replicas added to running ones (not a cold start)
            state[STATE_GREW_AT] = now
        state[STATE_NUM_RUNNING] = n
        if n == 0:
            return Decision("hold", max(target, lo), "no-replica", "no running replica")
        capacity = state.get(STATE_CAPACITY)
        if capacity is not None and now - state.get(STATE_CAPACITY_TIME, now) > cfg.capacity_memory_s:
            capacity = None
            state.pop(STATE_CAPACITY, None)
            state.pop(STATE_CAPACITY_TIME, None)
        if target > n:
            return Decision("hold", target, "starting", f"waiting for {target - n} starting replica(s)")

        up = self.figures(ctx, cfg.min_latency_samples)
        loaded = up.num_ongoing > 0 or up.num_waiting > 0
        if up.pressure > 1.0 and loaded:
            per_replica = up.num_ongoing / n
            if per_replica > 0:
                state[STATE_CAPACITY] = per_replica if capacity is None else min(capacity, per_replica)
                state[STATE_CAPACITY_TIME] = now
            if n >= hi:
                return Decision("hold", n, "at-max", f"SLO violated but already at max_replicas {hi}", up)
            # Cool down from the later of the last scale-up decision and the last replica coming up
            # (a slow start can outlast the cooldown; its p95s still hold the overload).
            ups = [t for t in (ctx.last_scale_up_time, state.get(STATE_GREW_AT)) if t is not None]
            last_up = max(ups, default=None)
            if last_up is not None and now - last_up < cfg.upscale_cooldown_s:
                return Decision(
                    "hold", n, "cooldown", f"SLO violated; cooling down {cfg.upscale_cooldown_s - (now - last_up):.1f} s more "
                    "after the last scale-up", up,
                )
            ratio = min(up.pressure / cfg.target_utilization, cfg.max_upscale_ratio)
            desired = min(max(math.ceil(n * ratio), n + 1), hi)
            return Decision(
                "up", desired, "violation", f"SLO violated: {n} x min({up.pressure:.2f} / {cfg.target_utilization:g}, "
                f"{cfg.max_upscale_ratio:g}) -> {desired}", up,
            )

        # Scale-down sees latencies however few their samples (the cautious side).
        down = self.figures(ctx, 1)
        if n <= lo:
            return Decision("hold", n, "at-min", "at min_replicas", down)
        if down.pressure >= cfg.scale_down_below:
            return Decision("hold", n, "pressure", f"pressure not under scale_down_below {cfg.scale_down_below:g}", down)
        if down.num_waiting + down.num_queued >= 0.5:
            return Decision("hold", n, "queue", "requests are waiting", down)
        m = n - 1
        capacity = state.get(STATE_CAPACITY)
        if capacity is not None:
            limit = cfg.downscale_load_margin * capacity
            if down.num_ongoing / m > limit:
                return Decision(
                    "hold", n, "capacity", f"{down.num_ongoing:.1f} ongoing would exceed {limit:.1f}/replica on {m} "
                    f"(capacity {capacity:.1f}/replica at the last violation)", down,
                )
            return Decision("down", m, "capacity", f"load fits {m} replica(s) at <= {limit:.1f}/replica", down)
        projected = down.pressure * n / m
        if projected > cfg.target_utilization:
            return Decision("hold", n, "projection", f"projected pressure on {m} replica(s) {projected:.2f} > target", down)
        return Decision("down", m, "projection", f"projected pressure on {m} replica(s) {projected:.2f}", down)
