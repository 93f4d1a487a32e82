"""Prometheus metrics of one replica, through `ray.serve.metrics` (Ray exports them with a `ray_` prefix).

`METRICS` is the one list of what an engine replica exports, `POOL_METRICS` what a drafter-pool
replica exports (deployments/drafter.py); the Grafana dashboard
(deployments/grafana_dashboard.json) may reference only these. The engine-thread step listener
and the per-request hook only add to plain Python totals under a lock; a flush thread pushes them
to Ray every `flush_interval_s` together with the engine's queue depth and KV block counts, so
the engine loop never calls into Ray. Serve adds the deployment/replica/application tags.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import AsyncLLM
    from engine.llm_engine import StepRecord
    from engine.outputs import RequestOutput

logger = logging.getLogger("ray.serve")

PROMETHEUS_PREFIX = "ray_"
DEFAULT_BACKEND = "ray.serve.metrics"
DEFAULT_FLUSH_INTERVAL_S = 2.0
SERVE_TAGS = ("deployment", "replica", "application")  # Serve adds these; ours must not clash
PHASES = ("draft", "verify", "sample", "other")

TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                  0.2, 0.3, 0.5, 1.0, 2.5)
HANDOFF_BYTES_BUCKETS = tuple(float(1 << n) for n in range(12, 34, 2))  # 4 KiB .. 8 GiB
PREDICTED_TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
HANDOFF_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ROUND_BUCKETS_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class MetricDef:
    """One exported metric. Counter names end in `_total` (what Prometheus shows for them)."""

    kind: str  # counter | gauge | histogram
    name: str
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    @property
    def prometheus_names(self) -> tuple[str, ...]:
        """The series names Prometheus scrapes for it."""
        base = PROMETHEUS_PREFIX + self.name
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


def _c(name: str, description: str, *tags: str) -> MetricDef:
    return MetricDef("counter", name, description, tags)


def _g(name: str, description: str, *tags: str) -> MetricDef:
    return MetricDef("gauge", name, description, tags)


def _h(name: str, description: str, boundaries: tuple[float, ...], *tags: str) -> MetricDef:
    return MetricDef("histogram", name, description, tags, boundaries)


METRICS: tuple[MetricDef, ...] = (
    # Latency, per finished request; `speculation` is on/off for that request.
    _h("specdecode_time_to_first_token_seconds", "Time from arrival at the replica to the first token.",
       TTFT_BUCKETS_S, "speculation"),
    _h("specdecode_time_per_output_token_seconds", "Mean time per output token after the first (TPOT).",
       TPOT_BUCKETS_S, "speculation"),
    _h("specdecode_e2e_request_latency_seconds", "Time from arrival at the replica to the last token.",
       E2E_BUCKETS_S, "speculation"),
    _c("specdecode_requests_finished_total", "Requests finished, by finish reason.", "finish_reason"),
    _c("specdecode_prompt_tokens_total", "Prompt tokens of finished requests."),
    _c("specdecode_prompt_tokens_cached_total", "Prompt tokens of finished requests found in the prefix cache "
       "(not computed again); over specdecode_prompt_tokens_total: the prefix-cache hit rate."),
    _c("specdecode_generation_tokens_total", "Output tokens of finished requests."),
    # Speculation: rate(accepted) / rate(draft) is the acceptance rate over any window.
    _c("specdecode_spec_draft_tokens_total", "Draft tokens verified by the target."),
    _c("specdecode_spec_accepted_tokens_total", "Draft tokens accepted."),
    _c("specdecode_spec_verify_steps_total", "Verifications (one per speculating request per step)."),
    _c("specdecode_spec_drafted_by_position_total",
       "Draft tokens verified at each draft position (a tree: once per depth it reaches).", "position"),
    _c("specdecode_spec_accepted_by_position_total",
       "Draft tokens accepted at each draft position (a tree: its accepted path's depths).", "position"),
    _c("specdecode_spec_tree_verify_steps_total", "Verifications of a token tree (also in verify_steps_total)."),
    _c("specdecode_spec_tree_nodes_total", "Draft nodes of verified token trees (also in draft_tokens_total)."),
    _c("specdecode_spec_tree_accepted_tokens_total", "Tree nodes accepted: the accepted paths' lengths."),
    _g("specdecode_spec_acceptance_rate", "Accepted / drafted tokens over the last flush interval with drafts."),
    _g("specdecode_spec_mean_accepted_length",
       "Tokens per verification (accepted + 1) over the last flush interval with drafts."),
    _g("specdecode_spec_enabled", "1 if the replica has a drafter, else 0."),
    _g("specdecode_spec_active_ratio",
       "Share of engine steps that verified drafts over the last flush interval with steps (0: speculation off)."),
    _g("specdecode_spec_k", "Mean draft tokens per verification over the last flush interval (the k in use)."),
    _g("specdecode_spec_k_max", "Configured num_speculative_tokens (0 without a drafter)."),
    # Engine.
    _c("specdecode_engine_steps_total", "Engine steps."),
    _c("specdecode_engine_step_seconds_total", "Engine step time by phase (draft, verify, sample, other).", "phase"),
    _g("specdecode_num_requests_running", "Requests in the engine's running batch."),
    _g("specdecode_num_requests_waiting", "Requests waiting in the engine's queue."),
    _g("specdecode_kv_blocks_used", "KV cache blocks in use."),
    _g("specdecode_kv_blocks_free", "KV cache blocks free."),
    _c("specdecode_preemptions_total", "Requests preempted (their KV freed, recomputed later)."),
    # Prefill/decode disaggregation (decode replicas): handoffs imported, and how each prefill went.
    _h("specdecode_handoff_bytes", "Bytes of a handoff (target KV + drafter state) imported by a decode replica.",
       HANDOFF_BYTES_BUCKETS),
    _h("specdecode_handoff_seconds", "Time from the prefill replica's last message to the decode replica "
       "holding the handoff (transfer through Ray's object store).", HANDOFF_SECONDS_BUCKETS),
    _c("specdecode_prefills_total", "Prefills of decode replicas' requests by where they ran: remote (prefill "
       "pool), local (short prompt or prefix-cache hit), local_faster (a long prompt predicted to reach its first token "
       "sooner here than in the prefill pool), local_backoff (a long prompt shortly after the prefill pool failed a "
       "call), fallback (the handoff was lost or could not be imported: prefilled locally); on a prefill replica, "
       "pool_decoded (it decoded the request itself: disaggregation.pool_max_streams).", "where"),
    _c("specdecode_placements_total", "Placement decisions of a decode replica (deployments/placement.py) by where "
       "the prompt went (remote, local) and why (short, backoff, decode_saturated, unmeasured, within_budget, "
       "over_budget, local_faster, remote_faster).", "where", "reason"),
    _h("specdecode_predicted_ttft_seconds", "Predicted time to first token of each long prompt placed, in the "
       "prefill pool (remote) and on the decode replica (local), whichever it went to.", PREDICTED_TTFT_BUCKETS_S,
       "where"),
    # The drafter pool (speculative.placement: remote): this engine replica's calls to it.
    _c("specdecode_remote_drafter_rounds_total", "Steps' calls to the drafter pool by result: ok; failed "
       "(that step had no drafts: the pool replica was lost, slow past drafter_pool.timeout_s, or erred); skipped "
       "(no call: a recent one failed, the engine backs off).", "result"),
    _c("specdecode_remote_drafter_unknown_total", "Requests the drafter pool did not hold at their call "
       "(forgotten, or another pool replica): that step had no drafts for them, their whole context is resent."),
    _c("specdecode_remote_drafter_ahead_drafts_total", "Drafts the pool had made ahead (while the target verified) "
       "and the engine used."),
)
# A drafter-pool replica (deployments/drafter.py): what it did for the engine replicas routed to it.
POOL_METRICS: tuple[MetricDef, ...] = (
    _c("specdecode_drafter_pool_engine_calls_total", "Calls received from engine replicas (one per engine step "
       "with requests drafting remotely)."),
    _c("specdecode_drafter_pool_rounds_total", "Rounds of the draft model run for those calls: fewer than the calls "
       "when calls of several engine replicas were merged into one round."),
    _c("specdecode_drafter_pool_request_calls_total", "Requests drafted for, summed over the calls."),
    _c("specdecode_drafter_pool_drafts_total", "Draft tokens answered."),
    _c("specdecode_drafter_pool_unknown_total", "Requests answered `unknown` (a session this replica did not hold "
       "at the call's start: forgotten, or routed here from another replica); the engine resends their context."),
    _c("specdecode_drafter_pool_catch_up_tokens_total", "Tokens the draft model ran over before drafting (new "
       "prompts, resent contexts): the pool's prefill work."),
    _c("specdecode_drafter_pool_evicted_sessions_total", "Sessions forgotten before the engine closed them: idle "
       "past drafter_pool.session_ttl_s, or least recently used when the replica's KV blocks ran out."),
    _c("specdecode_drafter_pool_ahead_hits_total", "Requests answered with drafts made ahead, while the target "
       "verified (drafter_pool.draft_ahead)."),
    _g("specdecode_drafter_pool_sessions", "Sessions (engine requests) the replica holds."),
    _g("specdecode_drafter_pool_kv_blocks_used", "Draft-model KV blocks in use, of the replica's pool."),
    _h("specdecode_drafter_pool_round_seconds", "Time of one round, from the worker taking it to its answer.",
       ROUND_BUCKETS_S),
)
# DraftService / SpecDrafterServer stats key -> the counter it feeds
POOL_COUNTERS = {"batches": "specdecode_drafter_pool_engine_calls_total", "rounds": "specdecode_drafter_pool_rounds_total",
                 "calls": "specdecode_drafter_pool_request_calls_total", "drafted": "specdecode_drafter_pool_drafts_total",
                 "unknown": "specdecode_drafter_pool_unknown_total",
                 "catch_up_tokens": "specdecode_drafter_pool_catch_up_tokens_total",
                 "evicted": "specdecode_drafter_pool_evicted_sessions_total",
                 "ahead_hits": "specdecode_drafter_pool_ahead_hits_total"}
# The ingress (deployments/ingress.py): what it does for the clients' streams.
INGRESS_METRICS: tuple[MetricDef, ...] = (
    _c("specdecode_resumed_total", "Streams resumed on another engine replica mid-stream (the client's stream "
       "went on), by reason: engine (their co-located or decode replica was lost; a prefill replica lost after the "
       "first token is covered by the decode replica's local prefill instead) or drain (handed over by a replica "
       "being removed, at the end of its drain window).", "reason"),
)
METRICS_BY_NAME = {m.name: m for m in METRICS}
POOL_METRICS_BY_NAME = {m.name: m for m in POOL_METRICS}
PROMETHEUS_NAMES = frozenset(n for m in METRICS + POOL_METRICS + INGRESS_METRICS for n in m.prometheus_names)
_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass
class _Totals:
    """What happened since the last flush (plain Python; filled on the engine/event-loop threads)."""

    num_steps: int = 0
    num_spec_steps: int = 0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    num_tree_steps: int = 0
    num_tree_nodes: int = 0
    num_tree_accepted: int = 0
    # (speculation "on"/"off", ttft_s, tpot_s or None, e2e_s, finish_reason, prompt tokens, output tokens)
    finished: list[tuple[str, float | None, float | None, float | None, str, int, int, int]] = field(default_factory=list)
    handoffs: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)
    prefills: dict[str, int] = field(default_factory=dict)  # where -> count
    placements: dict[tuple[str, str], int] = field(default_factory=dict)  # (where, reason) -> count
    predicted_ttft: list[tuple[str, float]] = field(default_factory=list)  # (remote | local, seconds)


class _Flushing:
    """A daemon thread that calls `self.flush(stats_fn())` every `flush_interval_s`."""

    flush_interval_s: float
    _stop: threading.Event
    _thread: threading.Thread | None

    def _start_flushing(self, stats_fn: Any, name: str) -> None:
        def run() -> None:
            while not self._stop.wait(self.flush_interval_s):
                try:
                    self.flush(stats_fn())
                except Exception:  # noqa: BLE001 - a failed flush must not end the metrics thread
                    logger.exception("%s flush failed", name)

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def _stop_flushing(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def flush(self, stats: Any) -> None:
        raise NotImplementedError


def _backend(backend: Any, flush_interval_s: float) -> Any:
    if flush_interval_s <= 0:
        raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
    return backend if backend is not None else importlib.import_module(DEFAULT_BACKEND)


class ReplicaMetrics(_Flushing):
    """The replica's metrics. `backend` provides Counter/Gauge/Histogram with Ray's signatures
    (default `ray.serve.metrics`; tests pass a fake). `start(llm)` hooks it to an AsyncLLM."""

    def __init__(self, backend: Any = None, *, num_speculative_tokens: int = 0,
                 flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S) -> None:
        backend = _backend(backend, flush_interval_s)
        self.metrics: dict[str, Any] = {m.name: _make(backend, m) for m in METRICS}
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._totals = _Totals()
        self._last_preemptions = 0  # the engine's count at the last flush
        self._last_remote: dict[str, int] = {}  # the remote drafter's counts at the last flush
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._llm: AsyncLLM | None = None
        self.metrics["specdecode_spec_enabled"].set(1 if num_speculative_tokens else 0)
        self.metrics["specdecode_spec_k_max"].set(num_speculative_tokens)

    # --- wiring ---------------------------------------------------------------------------------
    def start(self, llm: AsyncLLM) -> ReplicaMetrics:
        """Listen to `llm`'s engine steps and flush every flush_interval_s on a daemon thread."""
        self._llm = llm
        llm.engine.step_listeners.append(self.on_step)
        self._start_flushing(llm.stats, "replica-metrics")
        return self

    def shutdown(self) -> None:
        """Stop listening and flushing (what accumulated since the last flush is dropped)."""
        if self._llm is not None and self.on_step in self._llm.engine.step_listeners:
            self._llm.engine.step_listeners.remove(self.on_step)
        self._stop_flushing()

    # --- hooks ----------------------------------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        """Step listener (engine thread)."""
        other = max(0.0, record.duration_s - record.draft_time_s - record.verify_time_s - record.sample_time_s)
        with self._lock:
            t = self._totals
            t.num_steps += 1
            t.phase_s["draft"] += record.draft_time_s
            t.phase_s["verify"] += record.verify_time_s
            t.phase_s["sample"] += record.sample_time_s
            t.phase_s["other"] += other
            if record.num_spec_requests:
                t.num_spec_steps += 1
            for rid, (drafted, accepted) in record.accepted.items():
                t.num_draft_tokens += drafted
                t.num_accepted_tokens += accepted
                t.num_verify_steps += 1
                if rid in record.trees:  # positions are depths
                    t.num_tree_steps += 1
                    t.num_tree_nodes += drafted
                    t.num_tree_accepted += accepted
                    drafted = record.trees[rid]
                while len(t.drafted_by_position) < drafted:
                    t.drafted_by_position.append(0)
                    t.accepted_by_position.append(0)
                for i in range(drafted):
                    t.drafted_by_position[i] += 1
                for i in range(accepted):
                    t.accepted_by_position[i] += 1

    def on_request_finished(self, out: RequestOutput, speculating: bool) -> None:
        """A request's last RequestOutput (event loop): its TTFT, TPOT and end-to-end latency."""
        m = out.metrics
        ttft, e2e = m.get("ttft_s"), m.get("e2e_s")
        num_out = len(out.token_ids)
        tpot = (e2e - ttft) / (num_out - 1) if ttft is not None and e2e is not None and num_out > 1 else None
        row = ("on" if speculating else "off", ttft, tpot, e2e, out.finish_reason or "unknown",
               len(out.prompt_token_ids), num_out, out.num_cached_tokens)
        with self._lock:
            self._totals.finished.append(row)

    def on_placement(self, placement: Any) -> None:
        """A decode replica placed a request's prefill (a `deployments.placement.Placement`)."""
        with self._lock:
            key = (placement.where, placement.reason)
            self._totals.placements[key] = self._totals.placements.get(key, 0) + 1
            for where, seconds in (("remote", placement.remote_ttft_s), ("local", placement.local_ttft_s)):
                if seconds is not None:
                    self._totals.predicted_ttft.append((where, seconds))

    def on_prefill(self, where: str, num_bytes: int = 0, seconds: float | None = None) -> None:
        """A decode replica's request was prefilled `where` (remote; local: a short prompt or a
        cache hit; local_faster: a long one predicted faster here than in the pool; local_backoff:
        a long one shortly after the pool failed a call; fallback: the remote prefill or its
        handoff failed); a remote
        one's handoff had `num_bytes` and took `seconds` to arrive (event loop)."""
        with self._lock:
            self._totals.prefills[where] = self._totals.prefills.get(where, 0) + 1
            if seconds is not None:
                self._totals.handoffs.append((num_bytes, seconds))

    # --- export ---------------------------------------------------------------------------------
    def flush(self, stats: dict | None = None) -> None:
        """Push what accumulated since the last flush; `stats` is `AsyncLLM.stats()` (queue, KV)."""
        with self._lock:
            t, self._totals = self._totals, _Totals()
        m = self.metrics
        for spec, ttft, tpot, e2e, reason, num_prompt, num_out, num_cached in t.finished:
            tags = {"speculation": spec}
            if ttft is not None:
                m["specdecode_time_to_first_token_seconds"].observe(ttft, tags)
            if tpot is not None:
                m["specdecode_time_per_output_token_seconds"].observe(tpot, tags)
            if e2e is not None:
                m["specdecode_e2e_request_latency_seconds"].observe(e2e, tags)
            m["specdecode_requests_finished_total"].inc(1, {"finish_reason": reason})
            _inc(m["specdecode_prompt_tokens_total"], num_prompt)
            _inc(m["specdecode_prompt_tokens_cached_total"], num_cached)
            _inc(m["specdecode_generation_tokens_total"], num_out)
        for num_bytes, seconds in t.handoffs:
            m["specdecode_handoff_bytes"].observe(num_bytes)
            m["specdecode_handoff_seconds"].observe(seconds)
        for where, n in t.prefills.items():
            m["specdecode_prefills_total"].inc(n, {"where": where})
        for (where, reason), n in t.placements.items():
            m["specdecode_placements_total"].inc(n, {"where": where, "reason": reason})
        for where, seconds in t.predicted_ttft:
            m["specdecode_predicted_ttft_seconds"].observe(seconds, {"where": where})
        _inc(m["specdecode_engine_steps_total"], t.num_steps)
        for phase, seconds in t.phase_s.items():
            _inc(m["specdecode_engine_step_seconds_total"], seconds, {"phase": phase})
        _inc(m["specdecode_spec_draft_tokens_total"], t.num_draft_tokens)
        _inc(m["specdecode_spec_accepted_tokens_total"], t.num_accepted_tokens)
        _inc(m["specdecode_spec_verify_steps_total"], t.num_verify_steps)
        _inc(m["specdecode_spec_tree_verify_steps_total"], t.num_tree_steps)
        _inc(m["specdecode_spec_tree_nodes_total"], t.num_tree_nodes)
        _inc(m["specdecode_spec_tree_accepted_tokens_total"], t.num_tree_accepted)
        for i, n in enumerate(t.drafted_by_position):
            _inc(m["specdecode_spec_drafted_by_position_total"], n, {"position": str(i)})
        for i, n in enumerate(t.accepted_by_position):
            _inc(m["specdecode_spec_accepted_by_position_total"], n, {"position": str(i)})
        if t.num_steps:
            m["specdecode_spec_active_ratio"].set(t.num_spec_steps / t.num_steps)
        if t.num_verify_steps:
            m["specdecode_spec_acceptance_rate"].set(t.num_accepted_tokens / t.num_draft_tokens)
            m["specdecode_spec_mean_accepted_length"].set((t.num_accepted_tokens + t.num_verify_steps) / t.num_verify_steps)
            m["specdecode_spec_k"].set(t.num_draft_tokens / t.num_verify_steps)
        if stats:
            m["specdecode_num_requests_running"].set(stats["num_running"])
            m["specdecode_num_requests_waiting"].set(stats["num_waiting"])
            m["specdecode_kv_blocks_used"].set(stats["num_used_blocks"])
            m["specdecode_kv_blocks_free"].set(stats["num_free_blocks"])
            _inc(m["specdecode_preemptions_total"], stats["num_preemptions"] - self._last_preemptions)
            self._last_preemptions = stats["num_preemptions"]
            remote = stats.get("remote_drafting") or {}
            if remote:
                d = {key: remote[key] - self._last_remote.get(key, 0) for key in remote}
                _inc(m["specdecode_remote_drafter_rounds_total"], d["rounds"], {"result": "ok"})
                _inc(m["specdecode_remote_drafter_rounds_total"], d["failures"], {"result": "failed"})
                _inc(m["specdecode_remote_drafter_rounds_total"], d.get("skipped", 0), {"result": "skipped"})
                _inc(m["specdecode_remote_drafter_unknown_total"], d["unknown"])
                _inc(m["specdecode_remote_drafter_ahead_drafts_total"], d["ahead"])
                self._last_remote = remote


class DrafterPoolMetrics(_Flushing):
    """A drafter-pool replica's metrics (`POOL_METRICS`): counters from the replica's running
    counts (`SpecDrafterServer.stats()`: what changed since the last flush), its sessions and KV
    blocks, and the time of each round (`observe_round`, from the event loop)."""

    def __init__(self, backend: Any = None, flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S) -> None:
        backend = _backend(backend, flush_interval_s)
        self.metrics: dict[str, Any] = {m.name: _make(backend, m) for m in POOL_METRICS}
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._rounds_s: list[float] = []
        self._last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, stats_fn: Any) -> DrafterPoolMetrics:
        """Flush `stats_fn()` (the replica's stats dict) every flush_interval_s on a daemon thread."""
        self._start_flushing(stats_fn, "drafter-pool-metrics")
        return self

    def shutdown(self) -> None:
        self._stop_flushing()

    def observe_round(self, seconds: float) -> None:
        with self._lock:
            self._rounds_s.append(seconds)

    def flush(self, stats: dict) -> None:
        with self._lock:
            rounds, self._rounds_s = self._rounds_s, []
        m = self.metrics
        for key, name in POOL_COUNTERS.items():
            _inc(m[name], stats[key] - self._last.get(key, 0))
        self._last = {key: stats[key] for key in POOL_COUNTERS}
        m["specdecode_drafter_pool_sessions"].set(stats["sessions"])
        m["specdecode_drafter_pool_kv_blocks_used"].set(stats["used_blocks"])
        for seconds in rounds:
            m["specdecode_drafter_pool_round_seconds"].observe(seconds)


class IngressMetrics:
    """The ingress's metrics (`INGRESS_METRICS`), counted as things happen (event loop)."""

    def __init__(self, backend: Any = None) -> None:
        backend = backend if backend is not None else importlib.import_module(DEFAULT_BACKEND)
        self.metrics: dict[str, Any] = {m.name: _make(backend, m) for m in INGRESS_METRICS}

    def resumed(self, reason: str) -> None:
        self.metrics["specdecode_resumed_total"].inc(1, {"reason": reason})


def _inc(counter: Any, value: float, tags: dict[str, str] | None = None) -> None:
    """Ray's Counter.inc refuses values <= 0; nothing happened then anyway."""
    if value > 0:
        counter.inc(value, tags)


def _make(backend: Any, m: MetricDef) -> Any:
    if not _NAME_RE.match(m.name):
        raise ValueError(f"metric name {m.name!r} is not a valid Prometheus name")
    if m.kind == "counter":
        return backend.Counter(m.name, description=m.description, tag_keys=m.tag_keys)
    if m.kind == "gauge":
        return backend.Gauge(m.name, description=m.description, tag_keys=m.tag_keys)
    if m.kind == "histogram":
        return backend.Histogram(m.name, description=m.description, boundaries=list(m.boundaries),
                                 tag_keys=m.tag_keys)
    raise ValueError(f"metric {m.name}: kind must be counter, gauge or histogram, got {m.kind!r}")


def start_replica_metrics(llm: AsyncLLM, num_speculative_tokens: int, backend: Any = None) -> ReplicaMetrics:
    """The replica's metrics, listening to `llm` and flushing to Ray (see ReplicaMetrics)."""
    return ReplicaMetrics(backend, num_speculative_tokens=num_speculative_tokens).start(llm)
