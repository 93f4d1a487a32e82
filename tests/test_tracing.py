"""Request tracing against a real OTLP receiver on loopback, and the where-time-goes report.

The receiver is the OTLP trace service (opentelemetry-proto's TraceServiceServicer) over grpcio;
the exporter finds it through OTEL_EXPORTER_OTLP_ENDPOINT. An AsyncLLM with n-gram speculation
on a small random model serves a repetitive prompt; its exported span tree must have the queue,
prefill and per-step spans with their attributes, engine steps must be linked rather than copied,
and the spans must add up to the request's wall time within 10%. One test goes end to end
through Ray Serve's gRPC proxy: the client's traceparent must reach the replica's spans.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from helpers import save_tiny_model
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from deployments import tracing as tr
from deployments.config import TracingArgs
from engine import AsyncLLM, SamplingParams, SpeculativeConfig

PROMPT = [5, 6, 7, 8] * 6  # repetitive: n-gram lookup finds drafts
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
SPEC_TOTALS = ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps")


# --- a real OTLP receiver --------------------------------------------------------------------
@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
        batch = []
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    batch.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex() or None,
                        s.start_time_unix_nano, s.end_time_unix_nano, _attrs(s.attributes),
                        [(link.trace_id.hex(), link.span_id.hex(), _attrs(link.attributes)) for link in s.links],
                        [e.name for e in s.events], resource,
                    ))
        with self.lock:
            self.spans.extend(batch)
        return trace_service_pb2.ExportTraceServiceResponse()

    def take(self) -> list[Span]:
        with self.lock:
            spans, self.spans = self.spans, []
        return spans


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # Wide enough that a step (~1-3 ms on one CPU thread) dwarfs the engine loop's per-step work.
    return save_tiny_model(str(tmp_path_factory.mktemp("traced_model")), "llama", hidden_size=256,
                           intermediate_size=512)


@pytest.fixture(scope="module")
def llm(model: str) -> Iterator[AsyncLLM]:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    engine = AsyncLLM(model, device="cpu", dtype="float32", num_threads=1, speculative=spec)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def otlp_tracer(receiver: tuple[Receiver, int], llm: AsyncLLM) -> Iterator[tr.RequestTracer]:
    """A tracer exporting over OTLP/gRPC to the receiver, configured by the standard variables."""
    _, port = receiver
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        mp.setenv("OTEL_TRACES_EXPORTER", "otlp")
        mp.delenv("OTEL_SERVICE_NAME", raising=False)
        mp.delenv("OTEL_TRACES_SAMPLER", raising=False)
        tracer = tr.setup_tracing(None, llm)
        assert tracer is not None
    yield tracer
    tracer.shutdown()


async def _consume(tracer: tr.RequestTracer, llm: AsyncLLM, rid: str, parent: Any = None) -> tuple[Any, float]:
    start = time.perf_counter()
    last = None
    async for out in tracer.trace(llm.generate(PROMPT, PARAMS, request_id=rid), rid, parent=parent):
        last = out
    return last, time.perf_counter() - start


def _exported(receiver: Receiver, tracer: tr.RequestTracer, want_requests: int) -> list[Span]:
    """Flush, then wait for the receiver to hold `want_requests` request spans."""
    assert tracer.force_flush(10)
    spans: list[Span] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans += receiver.take()
        if sum(s.name == tr.REQUEST_SPAN for s in spans) >= want_requests:
            return spans
        time.sleep(0.05)
    raise AssertionError(f"receiver got {len(spans)} spans, not {want_requests} requests")


class FakeGrpcContext:
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata


# --- the span tree of one speculative request ------------------------------------------------
def test_speculative_request_span_tree_over_otlp(receiver, llm: AsyncLLM, otlp_tracer: tr.RequestTracer) -> None:
    parent = otlp_tracer.parent_context(FakeGrpcContext([("traceparent", TRACEPARENT), ("application", "x")]))
    last, wall_s = asyncio.run(_consume(otlp_tracer, llm, "spec-1", parent))
    spans = _exported(receiver[0], otlp_tracer, 1)

    (req,) = [s for s in spans if s.name == tr.REQUEST_SPAN]
    assert (req.trace_id, req.parent_span_id) == (TRACE_ID, PARENT_SPAN_ID)  # W3C parent honoured
    assert req.resource["service.name"] == tr.DEFAULT_SERVICE_NAME
    a = req.attributes
    assert a[tr.ATTR_REQUEST_ID] == "spec-1" and a[tr.ATTR_FINISH_REASON] == "length"
    assert a[tr.ATTR_NUM_OUTPUT_TOKENS] == PARAMS.max_tokens and a[tr.ATTR_NUM_PROMPT_TOKENS] == len(PROMPT)
    assert 0 < a[tr.ATTR_TTFT_S] < req.duration_s and tr.FIRST_TOKEN_EVENT in req.events
    for key in SPEC_TOTALS:
        assert a[tr.ATTR_SPEC_PREFIX + key] == last.spec_stats[key]

    children = sorted((s for s in spans if s.parent_span_id == req.span_id), key=lambda s: s.start_ns)
    assert all(c.trace_id == TRACE_ID for c in children)
    names = [c.name for c in children]
    assert names[0] == tr.QUEUE_SPAN and names.count(tr.QUEUE_SPAN) == 1
    assert names[1] == tr.PREFILL_SPAN and set(names[2:]) == {tr.DECODE_SPAN}
    steps = children[1:]
    assert a[tr.ATTR_NUM_STEPS] == len(steps)

    # Every verification step: draft / verify / sample times, drafted and accepted tokens.
    verifications = [s for s in steps if s.attributes[tr.ATTR_NUM_DRAFTED] > 0]
    assert verifications and any(s.attributes[tr.ATTR_NUM_ACCEPTED] > 0 for s in verifications)
    for s in steps:
        sa = s.attributes
        phases = [sa[tr.ATTR_DRAFT_S], sa[tr.ATTR_VERIFY_S], sa[tr.ATTR_SAMPLE_S], sa[tr.ATTR_OTHER_S]]
        assert min(phases) >= 0 and sa[tr.ATTR_VERIFY_S] > 0
        assert sum(phases) == pytest.approx(s.duration_s, abs=2e-6)
        assert 0 <= sa[tr.ATTR_NUM_ACCEPTED] <= sa[tr.ATTR_NUM_DRAFTED]
        assert sa[tr.ATTR_NUM_SCHEDULED_TOKENS] == (len(PROMPT) if s.name == tr.PREFILL_SPAN else 1 + sa[tr.ATTR_NUM_DRAFTED])
    assert sum(s.attributes[tr.ATTR_NUM_DRAFTED] for s in steps) == last.spec_stats["num_draft_tokens"]
    assert sum(s.attributes[tr.ATTR_NUM_ACCEPTED] for s in steps) == last.spec_stats["num_accepted_tokens"]
    assert len(verifications) == last.spec_stats["num_verify_steps"]

    # One engine.step span per step, in its own trace, linked to the request; each request-side
    # step span links back to it and carries its index.
    step_spans = {s.span_id: s for s in spans if s.name == tr.STEP_SPAN}
    assert len(step_spans) == len(steps)
    for s in steps:
        ((_, linked_id, _),) = s.links
        step = step_spans[linked_id]
        assert step.trace_id != TRACE_ID and step.parent_span_id is None
        assert step.attributes[tr.ATTR_STEP_INDEX] == s.attributes[tr.ATTR_STEP_INDEX]
        assert (step.start_ns, step.end_ns) == (s.start_ns, s.end_ns)
        assert [(tid, sid) for tid, sid, _ in step.links] == [(TRACE_ID, req.span_id)]

    # Durations add up to the wall time the caller measured, within 10%: queue + prefill + draft +
    # verify + sample + other engine work + serving overhead, the last being the gaps between the
    # spans (none negative: the spans never overlap and lie inside the request's).
    edges = [req.start_ns, *(x for c in children for x in (c.start_ns, c.end_ns)), req.end_ns]
    gaps = [(b - a) / 1e9 for a, b in zip(edges[::2], edges[1::2], strict=True)]
    assert min(gaps) > -1e-6
    decode = [s.attributes for s in steps if s.name == tr.DECODE_SPAN]
    parts = {
        "queue": children[0].duration_s,
        "prefill": sum(s.duration_s for s in steps if s.name == tr.PREFILL_SPAN),
        **{key: sum(d[key] for d in decode) for key in (tr.ATTR_DRAFT_S, tr.ATTR_VERIFY_S, tr.ATTR_SAMPLE_S,
                                                         tr.ATTR_OTHER_S)},
        "overhead": sum(gaps),
    }
    assert sum(parts.values()) == pytest.approx(wall_s, rel=0.1)
    assert req.duration_s == pytest.approx(wall_s, rel=0.1)
    assert a[tr.ATTR_TIME_PREFIX + "overhead_s"] == pytest.approx(parts["overhead"], abs=1e-4)
    assert a[tr.ATTR_TIME_PREFIX + "verify_s"] == pytest.approx(parts[tr.ATTR_VERIFY_S], rel=1e-6)


def test_a_step_serving_two_requests_is_one_span_linked_to_both(
    receiver, llm: AsyncLLM, otlp_tracer: tr.RequestTracer
) -> None:
    async def both() -> None:
        await asyncio.gather(_consume(otlp_tracer, llm, "pair-a"), _consume(otlp_tracer, llm, "pair-b"))

    asyncio.run(both())
    spans = _exported(receiver[0], otlp_tracer, 2)
    reqs = {s.attributes[tr.ATTR_REQUEST_ID]: s for s in spans if s.name == tr.REQUEST_SPAN}
    assert set(reqs) == {"pair-a", "pair-b"} and reqs["pair-a"].trace_id != reqs["pair-b"].trace_id
    steps = [s for s in spans if s.name == tr.STEP_SPAN]
    indexes = [s.attributes[tr.ATTR_STEP_INDEX] for s in steps]
    assert len(indexes) == len(set(indexes))  # never duplicated
    shared = [s for s in steps if len(s.links) == 2]
    assert shared, "the two requests never shared a step"
    for step in shared:
        assert {sid for _, sid, _ in step.links} == {reqs["pair-a"].span_id, reqs["pair-b"].span_id}
        assert step.attributes[tr.ATTR_STEP_NUM_REQUESTS] == 2
        mine = [s for s in spans if s.links and s.links[0][1] == step.span_id]
        assert {s.parent_span_id for s in mine} == {reqs["pair-a"].span_id, reqs["pair-b"].span_id}
        shares = [s.attributes[tr.ATTR_SHARE] for s in mine]
        assert sum(shares) == pytest.approx(1.0)
        assert sum(s.attributes[tr.ATTR_NUM_SCHEDULED_TOKENS] for s in mine) == step.attributes[
            tr.ATTR_STEP_NUM_BATCHED_TOKENS]


def test_a_request_left_out_of_steps_gets_a_queue_span() -> None:
    """Synthetic steps: `a` prefills, decodes, is preempted (step 2 runs without it), recomputes."""
    from opentelemetry.sdk.trace import TracerProvider, sampling
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.llm_engine import StepRecord
    from engine.outputs import RequestOutput

    memory = InMemorySpanExporter()
    provider = TracerProvider(sampler=tr.StepLinkSampler(sampling.ALWAYS_ON))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = tr.RequestTracer(provider)
    t0 = time.time()
    plan = [(["a"], ["a"], {"a": 8}), (["a"], [], {"a": 3}), (["b"], ["b"], {"b": 8}), (["a"], ["a"], {"a": 9}),
            (["a"], [], {"a": 1})]

    async def stream() -> Any:
        for i, (ids, prefill, tokens) in enumerate(plan):
            drafted = {r: (n - 1, 1) for r, n in tokens.items() if r not in prefill}
            tracer.on_step(StepRecord(i, t0 + 0.01 * (i + 1), 0.005, sum(tokens.values()), len(ids), ids,
                                      len(drafted), 0.001, 0.002, 0.001, drafted, prefill, tokens))
        yield RequestOutput("a", None, [1] * 8, [3, 4, 5], "", [3], "", True, "length", metrics={})

    async def consume() -> None:
        async for _ in tracer.trace(stream(), "a"):
            pass

    asyncio.run(consume())
    tracer.shutdown()
    spans = memory.get_finished_spans()
    names = [s.name for s in sorted((s for s in spans if s.name != tr.STEP_SPAN), key=lambda s: s.start_time)]
    assert names == [tr.REQUEST_SPAN, tr.QUEUE_SPAN, tr.PREFILL_SPAN, tr.DECODE_SPAN, tr.QUEUE_SPAN,
                     tr.PREFILL_SPAN, tr.DECODE_SPAN]
    requeued = sorted((s for s in spans if s.name == tr.QUEUE_SPAN), key=lambda s: s.start_time)[1]
    assert requeued.attributes[tr.ATTR_SKIPPED_STEPS] == 1 and requeued.attributes[tr.ATTR_PREEMPTED]
    assert requeued.end_time - requeued.start_time == pytest.approx(0.015e9, abs=1e3)  # step 1 end -> step 3
    assert sorted(s.attributes[tr.ATTR_STEP_INDEX] for s in spans if s.name == tr.STEP_SPAN) == [0, 1, 3, 4]
    (req,) = [s for s in spans if s.name == tr.REQUEST_SPAN]
    assert req.attributes[tr.ATTR_NUM_STEPS] == 4
    assert req.attributes[tr.ATTR_TIME_PREFIX + "prefill_s"] == pytest.approx(0.010)


# --- off, unsampled, settings ----------------------------------------------------------------
def test_tracing_off_registers_nothing(llm: AsyncLLM) -> None:
    before = list(llm.engine.step_listeners)
    assert tr.setup_tracing(None, llm, environ={}) is None
    assert tr.setup_tracing(TracingArgs(exporter="none"), llm, environ={}) is None
    assert tr.setup_tracing(None, llm, environ={"OTEL_TRACES_EXPORTER": "none"}) is None
    assert tr.setup_tracing(TracingArgs(), llm, environ={"OTEL_SDK_DISABLED": "true"}) is None
    assert llm.engine.step_listeners == before


def test_unsampled_requests_make_no_spans(tmp_path, llm: AsyncLLM) -> None:
    path = tmp_path / "spans.jsonl"
    tracer = tr.setup_tracing(TracingArgs(exporter="file", file=str(path), sampling_ratio=0.0), llm, environ={})
    try:
        seen: list[int] = []
        llm.engine.step_listeners.append(lambda record: seen.append(len(tracer._live)))
        asyncio.run(_consume(tracer, llm, "unsampled"))
        llm.engine.step_listeners.pop()
        assert seen and not any(seen)  # never registered, so the listener does no work
    finally:
        tracer.shutdown()
    assert path.read_text() == ""


@pytest.mark.parametrize("args,env,want", [
    (None, {}, None),
    (None, {"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
    (None, {"OTEL_TRACES_EXPORTER": "otlp, file"}, ("otlp", "file")),
    (TracingArgs(), {}, ("file",)),
    (TracingArgs(), {"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
    (TracingArgs(exporter="otlp"), {"OTEL_TRACES_EXPORTER": "console"}, ("otlp",)),
    (TracingArgs(exporter="none"), {"OTEL_TRACES_EXPORTER": "otlp"}, None),
    (None, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}, None),
])
def test_settings_follow_args_then_otel_variables(args, env, want) -> None:
    settings = tr.resolve_settings(args, env)
    assert (settings.exporters if settings else None) == want


def test_settings_file_and_ratio(tmp_path) -> None:
    env = {"SPECDECODE_TRACES_FILE": str(tmp_path / "env.jsonl")}
    assert tr.resolve_settings(TracingArgs(), env).file == str(tmp_path / "env.jsonl")
    s = tr.resolve_settings(TracingArgs(file=str(tmp_path / "a.jsonl"), sampling_ratio=0.25), env)
    assert (s.file, s.sampling_ratio) == (str(tmp_path / "a.jsonl"), 0.25)
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER: unknown exporter"):
        tr.resolve_settings(None, {"OTEL_TRACES_EXPORTER": "jaeger"})


def test_sampler_from_env() -> None:
    assert "TraceIdRatioBased{0.25}" in tr.sampler_from_env(
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}).get_description()
    assert tr.sampler_from_env({}).get_description().startswith("ParentBased{root:AlwaysOnSampler")
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
        tr.sampler_from_env({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"})
    with pytest.raises(ValueError, match="unknown sampler"):
        tr.sampler_from_env({"OTEL_TRACES_SAMPLER": "sometimes"})


def test_parent_context_from_metadata() -> None:
    from opentelemetry import trace

    ctx = tr.RequestTracer.parent_context(FakeGrpcContext([("traceparent", TRACEPARENT)]))
    assert f"{trace.get_current_span(ctx).get_span_context().trace_id:032x}" == TRACE_ID
    assert tr.RequestTracer.parent_context(FakeGrpcContext([("application", "x")])) is None
    assert tr.RequestTracer.parent_context(FakeGrpcContext([("traceparent", "garbage")])) is None
    assert tr.RequestTracer.parent_context(None) is None


# --- the file exporter and the report ---------------------------------------------------------
def test_file_exporter_feeds_where_time_goes(tmp_path, llm: AsyncLLM, capsys) -> None:
    from deployments import where_time_goes as wtg

    path, png = tmp_path / "spans.jsonl", tmp_path / "report.png"
    tracer = tr.setup_tracing(TracingArgs(exporter="file", file=str(path)), llm, environ={})
    try:
        async def two() -> None:
            await asyncio.gather(_consume(tracer, llm, "file-a"), _consume(tracer, llm, "file-b"))

        asyncio.run(two())
    finally:
        tracer.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert {"name", "trace_id", "span_id", "parent_span_id", "start_time_unix_nano", "attributes", "links"} <= set(lines[0])

    bds = wtg.breakdowns(wtg.load_spans([path]))
    assert [b.request_id for b in sorted(bds, key=lambda b: b.request_id)] == ["file-a", "file-b"]
    for b in bds:
        assert b.accounted_s == pytest.approx(b.wall_s, rel=1e-6)
        assert b.parts["prefill"] > 0 and b.parts["verify"] > 0 and b.verifications
    summary = wtg.acceptance_summary(bds)
    assert summary["num_verify_steps"] == sum(len(b.verifications) for b in bds)

    assert wtg.main([str(path), "--out", str(png), "--request", "file-b"]) == 0
    out = capsys.readouterr().out
    for word in (*wtg.CATEGORIES, "acceptance", "file-a", "timeline: request file-b"):
        assert word in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert wtg.main([str(tmp_path / "missing.jsonl")]) == 2


def test_tree_steps_are_their_own_phases_in_where_time_goes(tmp_path, model: str) -> None:
    """An engine drafting token trees (the target as its own draft model): its steps carry the
    tree depth and tree-drafting count, and where_time_goes books them as tree_draft and
    tree_verify instead of draft and verify."""
    from deployments import where_time_goes as wtg

    spec = SpeculativeConfig(method="draft", model=model, adaptive=False, tree_nodes=6, tree_width=2, tree_depth=3)
    tree_llm = AsyncLLM(model, device="cpu", dtype="float32", num_threads=1, speculative=spec)
    path = tmp_path / "spans.jsonl"
    tracer = tr.setup_tracing(TracingArgs(exporter="file", file=str(path)), tree_llm, environ={})
    try:
        asyncio.run(_consume(tracer, tree_llm, "tree-a"))
    finally:
        tracer.shutdown()
        tree_llm.shutdown()
    (b,) = wtg.breakdowns(wtg.load_spans([path]))
    assert b.parts["tree_verify"] > 0 and b.parts["tree_draft"] > 0
    assert b.parts["verify"] == 0 and b.accounted_s == pytest.approx(b.wall_s, rel=1e-6)
    assert any(s.tree_depth > 0 for s in b.steps)


# --- end to end through Ray Serve's gRPC proxy -------------------------------------------------
@pytest.mark.slow
def test_client_traceparent_reaches_replica_spans_through_serve(tmp_path, model: str, serve_instance) -> None:
    from ray import serve

    from deployments.app import build_app
    from deployments.client import SpecDecodeClient

    spans_file = tmp_path / "serve_spans.jsonl"
    args = {
        "model": model, "device": "cpu", "dtype": "float32", "num_cpus": 1, "max_num_seqs": 2,
        "speculative": {"method": "ngram", "model": None, "num_speculative_tokens": 4, "adaptive": False},
        "tracing": {"exporter": "file", "file": str(spans_file)},
    }
    port = serve_instance.grpc_port
    with serve_instance.apps("traced"):  # the shared Serve exports spans within 0.1 s (conftest)
        serve.run(build_app(args), name="traced", route_prefix="/traced")
        with SpecDecodeClient(f"127.0.0.1:{port}", application="traced", timeout=60) as client:
            client.wait_ready(60)
            chunks = list(client.generate(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True,
                                          request_id="e2e-1", traceparent=TRACEPARENT))
        assert sum(len(c.token_ids) for c in chunks) == 24
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and f'"{tr.REQUEST_SPAN}"' not in _read(spans_file):
            time.sleep(0.2)
    lines = [json.loads(line) for line in _read(spans_file).splitlines()]
    (req,) = [s for s in lines if s["name"] == tr.REQUEST_SPAN]
    assert (req["trace_id"], req["parent_span_id"], req["kind"]) == (TRACE_ID, PARENT_SPAN_ID, "SERVER")
    assert req["attributes"]["rpc.method"] == "Generate" and req["attributes"][tr.ATTR_CLIENT_REQUEST_ID] == "e2e-1"
    mine = [s for s in lines if s["trace_id"] == TRACE_ID]
    assert {s["name"] for s in mine} == {tr.REQUEST_SPAN, tr.QUEUE_SPAN, tr.PREFILL_SPAN, tr.DECODE_SPAN}


def _read(path) -> str:
    return path.read_text() if path.exists() else ""
