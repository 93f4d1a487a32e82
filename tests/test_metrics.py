"""Replica metrics with a fake metrics backend (no Ray cluster), and the Grafana dashboard.

The fake backend checks what Ray's metrics check (tag keys declared, counters only go up, bucket
boundaries positive) and records every call. Step records and finished requests go in; what the
flush pushes must be the counts, rates and latencies they imply. One test drives a real AsyncLLM
with n-gram speculation. The dashboard may only query metrics the module defines, by the names
Prometheus shows them under (`ray_` prefix; histograms as _bucket/_sum/_count), with their labels.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import save_tiny_model

from deployments import metrics as mm
from engine.llm_engine import StepRecord
from engine.outputs import RequestOutput

DASHBOARD = Path(__file__).resolve().parent.parent / "deployments" / "grafana_dashboard.json"


class FakeMetric:
    def __init__(self, kind: str, name: str, description: str = "", tag_keys: tuple = (),
                 boundaries: list | None = None) -> None:
        if kind == "histogram" and (not boundaries or min(boundaries) <= 0):
            raise ValueError(f"{name}: boundaries must be positive, got {boundaries}")
        self.kind, self.name, self.description = kind, name, description
        self.tag_keys, self.boundaries = tuple(tag_keys or ()), boundaries
        self.calls: list[tuple[float, dict]] = []

    def _record(self, value: float, tags: dict | None) -> None:
        tags = dict(tags or {})
        if set(tags) != set(self.tag_keys):
            raise ValueError(f"{self.name}: tags {sorted(tags)} != declared {sorted(self.tag_keys)}")
        self.calls.append((value, tags))

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        if value <= 0:
            raise ValueError(f"{self.name}: value must be > 0, got {value}")  # as Ray's Counter
        self._record(value, tags)

    def set(self, value: float, tags: dict | None = None) -> None:
        self._record(value, tags)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self._record(value, tags)

    def total(self, **tags: str) -> float:
        return sum(v for v, t in self.calls if all(t.get(k) == x for k, x in tags.items()))

    def last(self) -> float | None:
        return self.calls[-1][0] if self.calls else None


class FakeBackend:
    """Counter/Gauge/Histogram with ray.serve.metrics' signatures."""

    def __init__(self) -> None:
        self.made: dict[str, FakeMetric] = {}

    def _make(self, kind: str, name: str, **kwargs: Any) -> FakeMetric:
        assert name not in self.made, f"{name} made twice"
        self.made[name] = FakeMetric(kind, name, **kwargs)
        return self.made[name]

    def Counter(self, name: str, description: str = "", tag_keys: tuple = ()) -> FakeMetric:  # noqa: N802
        return self._make("counter", name, description=description, tag_keys=tag_keys)

    def Gauge(self, name: str, description: str = "", tag_keys: tuple = ()) -> FakeMetric:  # noqa: N802
        return self._make("gauge", name, description=description, tag_keys=tag_keys)

    def Histogram(self, name: str, description: str = "", boundaries: list | None = None,  # noqa: N802
                  tag_keys: tuple = ()) -> FakeMetric:
        return self._make("histogram", name, description=description, boundaries=boundaries, tag_keys=tag_keys)


def step(index: int, accepted: dict[str, tuple[int, int]], duration: float = 0.010, draft: float = 0.001,
         verify: float = 0.006, sample: float = 0.001) -> StepRecord:
    ids = list(accepted) or ["r0"]
    return StepRecord(
        step_index=index, start_time=time.time(), duration_s=duration, num_batched_tokens=sum(1 + d for d, _ in accepted.values()),
        num_requests=len(ids), request_ids=ids, num_spec_requests=sum(1 for d, _ in accepted.values() if d),
        draft_time_s=draft, verify_time_s=verify, sample_time_s=sample,
        accepted={r: v for r, v in accepted.items() if v[0]},
    )


def stats(running: int = 2, waiting: int = 3, used: int = 10, free: int = 90, preemptions: int = 0) -> dict:
    return {"num_running": running, "num_waiting": waiting, "num_used_blocks": used, "num_free_blocks": free,
            "num_preemptions": preemptions}


@pytest.fixture
def fake() -> tuple[mm.ReplicaMetrics, dict[str, FakeMetric]]:
    backend = FakeBackend()
    return mm.ReplicaMetrics(backend, num_speculative_tokens=4), backend.made


# --- definitions -------------------------------------------------------------------------------
def test_definitions_are_valid_prometheus_metrics() -> None:
    names = [m.name for m in mm.METRICS + mm.POOL_METRICS]
    assert len(names) == len(set(names))
    for m in mm.METRICS + mm.POOL_METRICS:
        assert re.fullmatch(r"specdecode_[a-z0-9_]+", m.name), m.name
        assert m.kind in ("counter", "gauge", "histogram") and m.description
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert not set(m.tag_keys) & set(mm.SERVE_TAGS), m.name
        if m.kind == "histogram":
            assert m.name.endswith(("_seconds", "_bytes")) and list(m.boundaries) == sorted(set(m.boundaries)) and m.boundaries[0] > 0
    assert mm.METRICS_BY_NAME["specdecode_time_to_first_token_seconds"].prometheus_names == (
        "ray_specdecode_time_to_first_token_seconds_bucket", "ray_specdecode_time_to_first_token_seconds_sum",
        "ray_specdecode_time_to_first_token_seconds_count")


def test_backend_gets_every_definition(fake) -> None:
    _, made = fake
    assert set(made) == set(mm.METRICS_BY_NAME)
    for name, metric in made.items():
        d = mm.METRICS_BY_NAME[name]
        assert (metric.kind, metric.tag_keys, metric.description) == (d.kind, d.tag_keys, d.description)
        assert (metric.boundaries or []) == list(d.boundaries)
    assert made["specdecode_spec_enabled"].last() == 1 and made["specdecode_spec_k_max"].last() == 4


def test_labels_by_metric() -> None:
    tags = {m.name: m.tag_keys for m in mm.METRICS if m.tag_keys}
    assert tags == {
        "specdecode_time_to_first_token_seconds": ("speculation",),
        "specdecode_time_per_output_token_seconds": ("speculation",),
        "specdecode_e2e_request_latency_seconds": ("speculation",),
        "specdecode_requests_finished_total": ("finish_reason",),
        "specdecode_spec_drafted_by_position_total": ("position",),
        "specdecode_spec_accepted_by_position_total": ("position",),
        "specdecode_engine_step_seconds_total": ("phase",),
        "specdecode_prefills_total": ("where",),
        "specdecode_placements_total": ("where", "reason"),
        "specdecode_predicted_ttft_seconds": ("where",),
        "specdecode_remote_drafter_rounds_total": ("result",),
    }


def test_ray_backend_accepts_the_definitions() -> None:
    """ray.serve.metrics works outside a replica (no tags added, nothing exported)."""
    metrics = mm.ReplicaMetrics(num_speculative_tokens=2)
    metrics.on_step(step(0, {"a": (2, 1)}))
    metrics.flush(stats())


# --- steps, requests, engine stats -------------------------------------------------------------
def test_steps_become_speculation_counters_and_window_gauges(fake) -> None:
    metrics, made = fake
    metrics.on_step(step(0, {"a": (0, 0)}))  # a prefill: no drafts
    metrics.on_step(step(1, {"a": (4, 4), "b": (4, 1)}))
    metrics.on_step(step(2, {"a": (3, 0), "b": (2, 2)}))
    metrics.flush(stats())
    assert made["specdecode_spec_draft_tokens_total"].total() == 13
    assert made["specdecode_spec_accepted_tokens_total"].total() == 7
    assert made["specdecode_spec_verify_steps_total"].total() == 4
    drafted, accepted = made["specdecode_spec_drafted_by_position_total"], made["specdecode_spec_accepted_by_position_total"]
    assert [drafted.total(position=str(i)) for i in range(4)] == [4, 4, 3, 2]
    assert [accepted.total(position=str(i)) for i in range(4)] == [3, 2, 1, 1]
    assert made["specdecode_spec_acceptance_rate"].last() == pytest.approx(7 / 13)
    assert made["specdecode_spec_mean_accepted_length"].last() == pytest.approx((7 + 4) / 4)
    assert made["specdecode_spec_k"].last() == pytest.approx(13 / 4)
    assert made["specdecode_spec_active_ratio"].last() == pytest.approx(2 / 3)
    assert made["specdecode_engine_steps_total"].total() == 3
    phases = made["specdecode_engine_step_seconds_total"]
    assert {p: phases.total(phase=p) for p in mm.PHASES} == pytest.approx(
        {"draft": 0.003, "verify": 0.018, "sample": 0.003, "other": 0.006})


def test_tree_verifications_count_nodes_and_positions_by_depth(fake) -> None:
    """A tree of 6 nodes and depth 3 with 2 accepted: 6 draft tokens, positions 0..2 drafted once
    (its depths), 0..1 accepted; the tree counters next to a chain's."""
    metrics, made = fake
    record = step(1, {"t": (6, 2), "c": (2, 1)})
    record.trees = {"t": 3}
    metrics.on_step(record)
    metrics.flush(stats())
    assert made["specdecode_spec_draft_tokens_total"].total() == 8
    assert made["specdecode_spec_tree_verify_steps_total"].total() == 1
    assert made["specdecode_spec_tree_nodes_total"].total() == 6
    assert made["specdecode_spec_tree_accepted_tokens_total"].total() == 2
    drafted, accepted = made["specdecode_spec_drafted_by_position_total"], made["specdecode_spec_accepted_by_position_total"]
    assert [drafted.total(position=str(i)) for i in range(3)] == [2, 2, 1]
    assert [accepted.total(position=str(i)) for i in range(2)] == [2, 1]


def test_an_idle_flush_keeps_window_gauges_and_never_counts_zero(fake) -> None:
    metrics, made = fake
    metrics.on_step(step(0, {"a": (4, 2)}))
    metrics.flush(stats())
    before = {name: len(m.calls) for name, m in made.items()}
    metrics.flush(stats())  # nothing happened: only the engine-state gauges are set again
    changed = {name for name, m in made.items() if len(m.calls) != before[name]}
    assert changed == {"specdecode_num_requests_running", "specdecode_num_requests_waiting",
                       "specdecode_kv_blocks_used", "specdecode_kv_blocks_free"}
    assert made["specdecode_spec_acceptance_rate"].last() == 0.5


def test_engine_stats_become_queue_kv_and_preemption_metrics(fake) -> None:
    metrics, made = fake
    metrics.flush(stats(running=4, waiting=7, used=30, free=70, preemptions=2))
    metrics.flush(stats(running=1, waiting=0, used=5, free=95, preemptions=5))
    assert made["specdecode_num_requests_waiting"].calls[-2:] == [(7, {}), (0, {})]
    assert made["specdecode_num_requests_running"].last() == 1
    assert (made["specdecode_kv_blocks_used"].last(), made["specdecode_kv_blocks_free"].last()) == (5, 95)
    assert made["specdecode_preemptions_total"].total() == 5


def test_remote_drafting_counts_become_counters(fake) -> None:
    """An engine that drafts in a drafter pool: its proposer's running counts (engine stats)
    become counters of what happened between flushes."""
    metrics, made = fake
    for rounds, failures, skipped, unknown, ahead in ((10, 1, 6, 2, 3), (25, 4, 30, 2, 9)):
        st = stats(running=1, waiting=0, used=5, free=95, preemptions=0)
        st["remote_drafting"] = {"rounds": rounds, "failures": failures, "skipped": skipped, "unknown": unknown,
                                 "ahead": ahead, "drafts": 4 * rounds}
        metrics.flush(st)
    rounds = made["specdecode_remote_drafter_rounds_total"]
    assert rounds.total(result="ok") == 25 and rounds.total(result="failed") == 4
    assert rounds.total(result="skipped") == 30
    assert made["specdecode_remote_drafter_unknown_total"].total() == 2
    assert made["specdecode_remote_drafter_ahead_drafts_total"].total() == 9


def test_pool_counts_become_counters_gauges_and_round_times() -> None:
    """A drafter-pool replica's running counts become counters of what changed between flushes;
    sessions and KV blocks are gauges; each round's time is observed once."""
    backend = FakeBackend()
    pool = mm.DrafterPoolMetrics(backend)
    assert set(backend.made) == set(mm.POOL_METRICS_BY_NAME)
    counts = dict.fromkeys(mm.POOL_COUNTERS, 0)
    for batches, rounds, sessions in ((6, 4, 3), (10, 5, 1), (10, 5, 0)):
        counts.update(batches=batches, rounds=rounds, calls=2 * batches, drafted=8 * batches, unknown=1,
                      catch_up_tokens=100, evicted=rounds - 4, ahead_hits=0)
        pool.observe_round(0.002)
        pool.flush({**counts, "sessions": sessions, "used_blocks": 2 * sessions, "num_blocks": 64})
    made = backend.made
    assert made["specdecode_drafter_pool_engine_calls_total"].calls == [(6, {}), (4, {})]  # nothing at the idle flush
    assert made["specdecode_drafter_pool_rounds_total"].total() == 5
    assert made["specdecode_drafter_pool_request_calls_total"].total() == 20
    assert made["specdecode_drafter_pool_drafts_total"].total() == 80
    assert made["specdecode_drafter_pool_unknown_total"].total() == 1
    assert made["specdecode_drafter_pool_catch_up_tokens_total"].total() == 100
    assert made["specdecode_drafter_pool_evicted_sessions_total"].total() == 1
    assert made["specdecode_drafter_pool_ahead_hits_total"].calls == []
    assert [v for v, _ in made["specdecode_drafter_pool_sessions"].calls] == [3, 1, 0]
    assert made["specdecode_drafter_pool_kv_blocks_used"].last() == 0
    assert len(made["specdecode_drafter_pool_round_seconds"].calls) == 3


def test_a_pool_replica_feeds_its_metrics(tmp_path) -> None:
    """A `SpecDrafterServer` (no Serve: what its batch method runs, on a plain event loop) given
    three engine replicas' calls as Serve's batching would (two merged into one round, then one
    alone): its metrics count the calls, the rounds, the requests, drafts and catch-up tokens, and
    time every round."""
    from helpers import save_perturbed_copy

    from deployments.config import AppConfig
    from deployments.drafter import SpecDrafterServer
    from engine.spec_decode.remote import DraftBatch, DraftCall

    target = save_tiny_model(str(tmp_path / "target"), "llama")
    drafter = save_perturbed_copy(target, str(tmp_path / "drafter"), noise=0.02)
    config = AppConfig.from_dict({"model": target, "device": "cpu", "dtype": "float32",
                                  "speculative": {"method": "draft", "model": drafter, "placement": "remote"}})
    server = SpecDrafterServer(config)
    server.metrics.shutdown()  # the Ray backend's, flushing on its own thread: a fake one instead
    backend = FakeBackend()
    server.metrics = mm.DrafterPoolMetrics(backend)
    prompts = [[3 + i, 5, 7, 11, 13][: 3 + i] for i in range(3)]

    batches = [DraftBatch((DraftCall(f"e{i}-r", 0, tuple(p), 3),)) for i, p in enumerate(prompts)]

    async def calls() -> list:
        return await server.merged_round(batches[:2]) + await server.merged_round(batches[2:])

    replies = asyncio.run(calls())
    assert [len(r.replies) for r in replies] == [1, 1, 1]
    assert [len(r.replies[0].token_ids) for r in replies] == [3, 3, 3]
    server.metrics.flush(server._stats())
    made = backend.made
    assert made["specdecode_drafter_pool_engine_calls_total"].total() == 3
    assert made["specdecode_drafter_pool_rounds_total"].total() == 2
    assert len(made["specdecode_drafter_pool_round_seconds"].calls) == 2
    assert made["specdecode_drafter_pool_request_calls_total"].total() == 3
    assert made["specdecode_drafter_pool_drafts_total"].total() == 9
    assert made["specdecode_drafter_pool_catch_up_tokens_total"].total() == sum(map(len, prompts))
    assert made["specdecode_drafter_pool_sessions"].last() == 3
    server.worker.shutdown(wait=True)


def test_finished_requests_observe_latency_histograms(fake) -> None:
    metrics, made = fake

    def finished(n: int, ttft: float, e2e: float, reason: str) -> RequestOutput:
        return RequestOutput("r", None, [1, 2, 3], list(range(n)), "", [], "", True, reason,
                             metrics={"ttft_s": ttft, "e2e_s": e2e}, num_cached_tokens=2 if n > 1 else 0)

    metrics.on_request_finished(finished(11, 0.05, 0.55, "length"), speculating=True)
    metrics.on_request_finished(finished(1, 0.02, 0.02, "stop"), speculating=False)
    metrics.flush()
    assert made["specdecode_time_to_first_token_seconds"].calls == [(0.05, {"speculation": "on"}),
                                                                    (0.02, {"speculation": "off"})]
    # TPOT: (e2e - ttft) / (tokens - 1); a one-token request has none.
    assert made["specdecode_time_per_output_token_seconds"].calls == [(pytest.approx(0.05), {"speculation": "on"})]
    assert [v for v, _ in made["specdecode_e2e_request_latency_seconds"].calls] == [0.55, 0.02]
    assert made["specdecode_requests_finished_total"].total(finish_reason="length") == 1
    assert made["specdecode_requests_finished_total"].total(finish_reason="stop") == 1
    assert made["specdecode_generation_tokens_total"].total() == 12
    assert made["specdecode_prompt_tokens_total"].total() == 6
    assert made["specdecode_prompt_tokens_cached_total"].total() == 2


def test_a_real_engine_feeds_the_metrics(tmp_path) -> None:
    from engine import AsyncLLM, SamplingParams, SpeculativeConfig

    model = save_tiny_model(str(tmp_path / "model"), "llama")
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    llm = AsyncLLM(model, device="cpu", dtype="float32", num_threads=1, speculative=spec)
    backend = FakeBackend()
    metrics = mm.ReplicaMetrics(backend, num_speculative_tokens=4, flush_interval_s=0.05).start(llm)
    made = backend.made
    try:
        async def run() -> Any:
            async for out in llm.generate([5, 6, 7, 8] * 6, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)):
                if out.finished:
                    metrics.on_request_finished(out, speculating=True)
                    return out

        out = asyncio.run(run())
        deadline = time.monotonic() + 10
        while made["specdecode_time_to_first_token_seconds"].last() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        metrics.shutdown()
        llm.shutdown()
    assert metrics.on_step not in llm.engine.step_listeners
    spec_stats = out.spec_stats
    assert spec_stats["num_draft_tokens"] > 0
    assert made["specdecode_spec_draft_tokens_total"].total() == spec_stats["num_draft_tokens"]
    assert made["specdecode_spec_accepted_tokens_total"].total() == spec_stats["num_accepted_tokens"]
    assert made["specdecode_spec_verify_steps_total"].total() == spec_stats["num_verify_steps"]
    by_position = made["specdecode_spec_accepted_by_position_total"]
    assert [by_position.total(position=str(i)) for i in range(4)] == spec_stats["accepted_by_position"]
    assert made["specdecode_time_to_first_token_seconds"].last() == out.metrics["ttft_s"]
    assert made["specdecode_generation_tokens_total"].total() == 32
    assert made["specdecode_kv_blocks_free"].last() is not None


# --- the Grafana dashboard ---------------------------------------------------------------------
def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))
    return out


def _exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def test_dashboard_queries_only_metrics_the_module_defines() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard)
    assert exprs
    referenced = {name for e in exprs for name in re.findall(r"\bray_[a-zA-Z0-9_]+", e)}
    assert referenced <= mm.PROMETHEUS_NAMES, referenced - mm.PROMETHEUS_NAMES
    # ... and shows every one of them.
    every = mm.METRICS + mm.POOL_METRICS + mm.INGRESS_METRICS
    shown = {m.name for m in every if set(m.prometheus_names) & referenced}
    assert shown == {m.name for m in every}, {m.name for m in every} - shown
    # Labels used in selectors and `by (...)` exist: ours, Serve's, or a histogram's `le`.
    known = {k for m in every for k in m.tag_keys} | set(mm.SERVE_TAGS) | {"le"}
    for e in exprs:
        labels = {x.strip() for group in re.findall(r"by \(([^)]*)\)", e) for x in group.split(",")}
        labels |= set(re.findall(r"[{,]\s*([a-z_]+)\s*=~?", e))
        assert labels <= known, (e, labels - known)


def test_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = _panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"])
        for t in p["targets"]:
            assert set(re.findall(r"\$([a-z_]+)", t["expr"])) - {"__rate_interval"} <= variables
            # a legend names labels as {{label}}, labels the query keeps
            legend = t.get("legendFormat", "")
            assert "{{{" not in legend and "}}}" not in legend, legend
            for label in re.findall(r"\{\{\s*([^}]*?)\s*\}\}", legend):
                kept = {x.strip() for group in re.findall(r"by \(([^)]*)\)", t["expr"]) for x in group.split(",")}
                assert label in kept | {"replica"} or "by (" not in t["expr"], (legend, t["expr"])
