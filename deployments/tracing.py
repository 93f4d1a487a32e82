"""OpenTelemetry tracing of requests, from the gRPC call or HTTP request through Serve into the
engine's steps.

Off unless configured (the app's `tracing:` args or OTEL_TRACES_EXPORTER): `setup_tracing` then
returns None, so no step listener is registered and no span is made. On, each request gets a
`specdecode.request` span (its parent: the caller's W3C `traceparent`) with the children
`specdecode.queue`, `specdecode.prefill` and one `specdecode.decode` per engine step that served
it, carrying that step's draft / verify / sample times and the tokens this request drafted and had
accepted. Each engine step is one `engine.step` span, linked to the requests it served (not copied
into each of their traces). Spans go to OTLP (the standard OTEL_EXPORTER_OTLP_* variables), the
console, or, by default, a JSON-lines file that `python -m deployments.where_time_goes` reads.

Times: a step runs schedule -> target forward (verifies the drafts made at the end of the previous
step) -> rejection sampling -> commit -> drafting for the next step. A step span's `*_s`
attributes split its own interval, so a request's queue + step spans + serving overhead (the gaps
between them) add up to its wall time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, set_span_in_context

from deployments.config import TRACE_EXPORTERS, TracingArgs, resolve_path

if TYPE_CHECKING:
    from engine import AsyncLLM
    from engine.llm_engine import LLMEngine, StepRecord

logger = logging.getLogger("ray.serve")

# --- configuration: OpenTelemetry's variables, plus the file exporter's path ----------------------
ENV_EXPORTER = "OTEL_TRACES_EXPORTER"  # file | otlp | console | none (comma-separated for several)
ENV_SAMPLER = "OTEL_TRACES_SAMPLER"
ENV_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
ENV_SDK_DISABLED = "OTEL_SDK_DISABLED"
ENV_FILE = "SPECDECODE_TRACES_FILE"  # the file exporter's path (no OpenTelemetry variable exists)
DEFAULT_FILE = "traces/spans.jsonl"  # relative paths: cwd if it exists there, else the repo root
DEFAULT_SERVICE_NAME = "specdecode"
SAMPLERS = (
    "always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
    "parentbased_traceidratio",
)
INSTRUMENTATION_NAME = "specdecode"
RPC_SERVICE = "specdecode.v1.SpecDecode"

# --- span names and attribute keys (where_time_goes and the tests read these) -------------------
REQUEST_SPAN = "specdecode.request"
QUEUE_SPAN = "specdecode.queue"
PREFILL_SPAN = "specdecode.prefill"
DECODE_SPAN = "specdecode.decode"
STEP_SPAN = "engine.step"
FIRST_TOKEN_EVENT = "first_token"
RESUMED_EVENT = "resumed"  # a request span's first event when it continues a stream begun elsewhere
# Prefill/decode disaggregation: a decode replica's request whose prompt the prefill pool
# prefilled. Its children: the prefill replica's request span (role prefill), the handoff (put by
# the prefill replica -> read by the decode replica) and the decode replica's request span (role
# decode; a local fallback prefill included).
DISAGG_SPAN = "specdecode.disaggregated"
HANDOFF_SPAN = "specdecode.handoff"

ATTR_REQUEST_ID = "specdecode.request_id"
ATTR_CLIENT_REQUEST_ID = "specdecode.client_request_id"
# On a queue span after the first: engine steps ran without the request (it was preempted and
# now recomputes, or the step's token budget left it out) and it waited.
ATTR_SKIPPED_STEPS = "specdecode.queue.skipped_steps"
ATTR_PREEMPTED = "specdecode.preempted"  # ... and it comes back with a prefill (recompute)
ATTR_CANCELLED = "specdecode.cancelled"
ATTR_NUM_PROMPT_TOKENS = "specdecode.num_prompt_tokens"
ATTR_NUM_OUTPUT_TOKENS = "specdecode.num_output_tokens"
ATTR_NUM_CACHED_TOKENS = "specdecode.num_cached_tokens"
ATTR_FINISH_REASON = "specdecode.finish_reason"
ATTR_TTFT_S = "specdecode.ttft_s"
ATTR_SPECULATIVE = "specdecode.speculative"
ATTR_SPEC_PREFIX = "specdecode.spec."  # + num_draft_tokens, acceptance_rate, ... (request totals)
# + queue_s, prefill_s, draft_s, verify_s, sample_s, engine_other_s, overhead_s (outside any step)
ATTR_TIME_PREFIX = "specdecode.time."
ATTR_NUM_STEPS = "specdecode.num_steps"  # engine steps that served the request
ATTR_ROLE = "specdecode.role"  # request spans in disaggregated mode: prefill | decode
ATTR_RESUMED_REASON = "specdecode.resumed.reason"  # engine (its replica was lost) | drain (handed over)
ATTR_RESUMED_TOKENS = "specdecode.resumed.num_tokens"  # tokens the client had before this replica took over
ATTR_RESUMED_ORDINAL = "specdecode.resumed.ordinal"  # 1 for a request's first resumption, 2 for its second ...
ATTR_HANDOFF_BYTES = "specdecode.handoff.bytes"
ATTR_HANDOFF_TRANSPORT = "specdecode.handoff.transport"  # object_store | nixl
ATTR_PREFILLED = "specdecode.prefilled"  # on a disaggregated span: remote | fallback | pool (it decoded there)
# where a disaggregated request's prompt was placed, why, and the predicted times to first token
ATTR_PLACEMENT = "specdecode.placement"  # remote | local
ATTR_PLACEMENT_REASON = "specdecode.placement.reason"
ATTR_PREDICTED_REMOTE_TTFT_S = "specdecode.placement.predicted_remote_ttft_s"
ATTR_PREDICTED_LOCAL_TTFT_S = "specdecode.placement.predicted_local_ttft_s"
# Step attributes: on `engine.step` and copied onto each request's prefill/decode span.
ATTR_STEP_INDEX = "engine.step.index"
ATTR_STEP_NUM_REQUESTS = "engine.step.num_requests"
ATTR_STEP_NUM_SPEC_REQUESTS = "engine.step.num_spec_requests"
ATTR_STEP_NUM_BATCHED_TOKENS = "engine.step.num_batched_tokens"
ATTR_DRAFT_S = "engine.step.draft_s"  # drafting at the end of the step, for the next step
ATTR_VERIFY_S = "engine.step.verify_s"  # target forward: verifies this step's drafts
ATTR_SAMPLE_S = "engine.step.sample_s"  # (rejection) sampling
ATTR_OTHER_S = "engine.step.other_s"  # the rest: scheduling, input preparation, commit
# A request's share of a step: on its prefill/decode span and on the step's link to it.
ATTR_NUM_SCHEDULED_TOKENS = "specdecode.step.num_scheduled_tokens"
ATTR_SHARE = "specdecode.step.share"  # its scheduled tokens / the step's batched tokens
ATTR_NUM_DRAFTED = "specdecode.step.num_drafted"  # draft tokens verified for it in this step
ATTR_NUM_ACCEPTED = "specdecode.step.num_accepted"  # of which accepted
ATTR_TREE_DEPTH = "specdecode.step.tree_depth"  # its drafts were a token tree of this depth (0: a chain)
ATTR_STEP_NUM_TREE_DRAFTS = "engine.step.num_tree_drafts"  # requests whose drafting (draft_s) made trees


@dataclass(frozen=True)
class TracingSettings:
    """Resolved tracing settings. `sampling_ratio` None: the sampler OTEL_TRACES_SAMPLER names."""

    exporters: tuple[str, ...]
    file: str
    sampling_ratio: float | None = None


def resolve_settings(args: TracingArgs | None, environ: Mapping[str, str] = os.environ) -> TracingSettings | None:
    """Settings from the app's `tracing:` args over the environment; None when tracing is off.

    Off when OTEL_SDK_DISABLED=true, or when neither the args nor OTEL_TRACES_EXPORTER ask for it,
    or when the exporter is `none`. Args fields left null fall back to the variables.
    """
    if environ.get(ENV_SDK_DISABLED, "").strip().lower() == "true":
        return None
    env_exporter = environ.get(ENV_EXPORTER, "").strip()
    if args is None and not env_exporter:
        return None
    if args is not None and args.exporter:
        source, value = "tracing.exporter", args.exporter
    else:
        source, value = ENV_EXPORTER, env_exporter or "file"
    names = tuple(n.strip().lower() for n in value.split(",") if n.strip())
    bad = [n for n in names if n not in TRACE_EXPORTERS]
    if bad:
        raise ValueError(f"{source}: unknown exporter(s) {bad}; use one or more of {', '.join(TRACE_EXPORTERS)}")
    exporters = tuple(n for n in names if n != "none")
    if not exporters:
        return None
    path = (args.file if args is not None and args.file else None) or environ.get(ENV_FILE) or DEFAULT_FILE
    return TracingSettings(exporters, resolve_path(path), args.sampling_ratio if args is not None else None)


def sampler_from_env(environ: Mapping[str, str] = os.environ) -> sampling.Sampler:
    """The sampler OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG name (parentbased_always_on if unset)."""
    name = environ.get(ENV_SAMPLER, "parentbased_always_on").strip().lower()
    if name not in SAMPLERS:
        raise ValueError(f"{ENV_SAMPLER}: unknown sampler {name!r}; use one of {', '.join(SAMPLERS)}")
    fixed = {
        "always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
        "parentbased_always_on": sampling.DEFAULT_ON, "parentbased_always_off": sampling.DEFAULT_OFF,
    }
    if name in fixed:
        return fixed[name]
    raw = environ.get(ENV_SAMPLER_ARG, "1.0")
    try:
        ratio = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_SAMPLER_ARG}: must be a number in [0, 1], got {raw!r}") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{ENV_SAMPLER_ARG}: must be in [0, 1], got {ratio}")
    return sampling.TraceIdRatioBased(ratio) if name == "traceidratio" else sampling.ParentBasedTraceIdRatio(ratio)


class StepLinkSampler(sampling.Sampler):
    """`base`, except that an `engine.step` root span is sampled exactly when a request it links
    to is: steps are traced for the requests that are, whatever the ratio."""

    def __init__(self, base: sampling.Sampler) -> None:
        self.base = base

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,  # noqa: ANN001
                      trace_state=None) -> sampling.SamplingResult:
        if name == STEP_SPAN and links:
            sampled = any(link.context.trace_flags.sampled for link in links)
            decision = sampling.Decision.RECORD_AND_SAMPLE if sampled else sampling.Decision.DROP
            return sampling.SamplingResult(decision, attributes)
        return self.base.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"StepLinkSampler{{{self.base.get_description()}}}"


def make_exporter(name: str, settings: TracingSettings, environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """One span exporter: `otlp` (OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL in `environ` picks grpc or
    http/protobuf; the OTLP exporter itself reads the endpoint, headers, TLS and timeout from the
    process's OTEL_EXPORTER_OTLP_* variables), `console` (stdout) or `file` (JSON lines)."""
    if name == "file":
        return JsonLinesSpanExporter(settings.file)
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"unknown exporter {name!r}; use one of {', '.join(TRACE_EXPORTERS)}")
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter
        except ImportError:
            raise ValueError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs opentelemetry-exporter-otlp-proto-http "
                "(not installed); install it or use grpc"
            ) from None
        return HTTPExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: must be grpc or http/protobuf, got {protocol!r}")


def make_tracer_provider(settings: TracingSettings, environ: Mapping[str, str] = os.environ) -> TracerProvider:
    """A TracerProvider of our own (not the global one, which Ray Serve's tracing may set): the
    resource from OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES (service name `specdecode` if
    unset), the sampler, and one batch processor per exporter."""
    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    if settings.sampling_ratio is not None:
        base = sampling.ParentBasedTraceIdRatio(settings.sampling_ratio)
    else:
        base = sampler_from_env(environ)
    provider = TracerProvider(sampler=StepLinkSampler(base), resource=resource)
    for name in settings.exporters:
        provider.add_span_processor(BatchSpanProcessor(make_exporter(name, settings, environ)))
    return provider


# --- the file exporter ---------------------------------------------------------------------------
def span_to_dict(span: ReadableSpan) -> dict:
    """One finished span as a JSON-able dict (a line of the file exporter's output)."""
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}",
             "attributes": dict(link.attributes or {})}
            for link in span.links
        ],
        "resource": dict(span.resource.attributes),
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span to a file. Each batch is one `write` to a file opened with
    O_APPEND, so several replica processes on one host can share the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":"), default=str) + "\n" for s in spans)
        buf = data.encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            while buf:
                buf = buf[os.write(self._fd, buf):]
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# --- per-request state and the step listener ------------------------------------------------------
@dataclass
class _Traced:
    """A traced request: its span, the context its children hang from, where it is in time."""

    span: Span
    context: Context
    start_ns: int
    last_end_ns: int | None = None  # end of the last step that served it
    last_step_index: int = -1
    first_token_ns: int | None = None
    times: dict[str, float] = field(default_factory=dict)  # seconds per phase, summed over its steps
    num_steps: int = 0


class RequestTracer:
    """Spans for requests served by one engine. `attach(engine)` registers the step listener (it
    runs on the engine thread); `trace(stream, request_id, parent=...)` wraps an AsyncLLM output
    stream in the request's span (on the event loop).

    Making spans costs tens of microseconds each, so neither thread makes them: the listener only
    queues the step record (a few microseconds) and a builder thread makes the step spans, with
    their recorded timestamps, and ends request spans, in the order things happened.
    """

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTATION_NAME)
        self._live: dict[str, _Traced] = {}
        self._engine: LLMEngine | None = None
        self._root = Context()  # steps start traces of their own
        self._work: queue.SimpleQueue = queue.SimpleQueue()  # (function, args); (None, ()) stops
        self._builder = threading.Thread(target=self._build, name="trace-builder", daemon=True)
        self._builder.start()

    # --- wiring ---------------------------------------------------------------------------------
    def attach(self, engine: LLMEngine) -> None:
        self._engine = engine
        engine.step_listeners.append(self.on_step)

    def detach(self) -> None:
        if self._engine is not None and self.on_step in self._engine.step_listeners:
            self._engine.step_listeners.remove(self.on_step)
        self._engine = None

    def shutdown(self) -> None:
        """Detach, make the spans still queued, and export what is buffered."""
        self.detach()
        self._work.put((None, ()))
        self._builder.join(timeout=10)
        self.provider.shutdown()

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Make the queued spans and export them; True if all was done within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        done = threading.Event()
        self._work.put((done.set, ()))
        if not done.wait(timeout_s):
            return False
        return self.provider.force_flush(max(1, int((deadline - time.monotonic()) * 1000)))

    def _build(self) -> None:
        while True:
            fn, args = self._work.get()
            if fn is None:
                return
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a bad span must not end the builder
                logger.exception("tracing: making spans failed")

    # --- parents --------------------------------------------------------------------------------
    @staticmethod
    def parent_context(grpc_context: Any = None) -> Context | None:
        """The parent for a request's span: the current span if one is active (Ray Serve's own
        tracing, when enabled, runs the method inside its replica span), else the W3C
        `traceparent`/`tracestate` the client sent as gRPC metadata, else None (a new trace)."""
        if trace.get_current_span().get_span_context().is_valid:
            return otel_context.get_current()
        metadata = getattr(grpc_context, "invocation_metadata", None)
        if metadata is None:
            return None
        carrier = {k: v for k, v in metadata() if k in ("traceparent", "tracestate")}
        if "traceparent" not in carrier:
            return None
        ctx = propagate.extract(carrier)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    # --- disaggregated requests (a decode replica's event loop) ----------------------------------
    def start_disaggregated(self, parent: Context | None, attributes: Mapping[str, Any]) -> Span:
        """The span of a request prefilled by the prefill pool; end it when the request ends."""
        return self.tracer.start_span(DISAGG_SPAN, context=parent, kind=SpanKind.SERVER, attributes=attributes)

    @staticmethod
    def metadata(span: Span) -> list[tuple[str, str]]:
        """W3C trace headers naming `span` as the parent (for the prefill call and the decode run)."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=set_span_in_context(span))
        return list(carrier.items())

    def handoff(self, parent: Context | None, start_ns: int, end_ns: int, attributes: Mapping[str, Any],
                error: str | None = None) -> None:
        """The handoff's transfer as a child of `parent` (the disaggregated request's span): from
        the prefill replica's put to the decode replica's read (the import into the decode
        engine's blocks is its queue time)."""
        span = self.tracer.start_span(HANDOFF_SPAN, context=parent, start_time=start_ns,
                                      attributes=attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(start_ns, end_ns))

    # --- per request (event loop) ---------------------------------------------------------------
    async def trace(
        self,
        stream: AsyncIterator[Any],
        request_id: str,
        *,
        parent: Context | None = None,
        server: bool = False,
        attributes: Mapping[str, Any] | None = None,
        events: Sequence[tuple[str, Mapping[str, Any]]] = (),
    ) -> AsyncIterator[Any]:
        """Yield `stream`'s RequestOutputs inside the request's span, which starts with `events`
        (name, attributes). Registers the request before the stream starts (so the engine's first
        step sees it) and closes the stream on exit."""
        kind = SpanKind.SERVER if server else SpanKind.INTERNAL
        attrs = {ATTR_REQUEST_ID: request_id, **(attributes or {})}
        span = self.tracer.start_span(REQUEST_SPAN, context=parent, kind=kind, attributes=attrs)
        for name, event_attributes in events:
            span.add_event(name, dict(event_attributes))
        if not span.is_recording():  # not sampled: pass through
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    yield out
            return
        traced = _Traced(span, set_span_in_context(span), time.time_ns())
        self._live[request_id] = traced
        last = None
        try:
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    if traced.first_token_ns is None and out.delta_token_ids:
                        traced.first_token_ns = time.time_ns()
                        span.add_event(FIRST_TOKEN_EVENT, timestamp=traced.first_token_ns)
                    last = out
                    yield out
        except GeneratorExit:
            span.set_attribute(ATTR_CANCELLED, True)
            raise
        except asyncio.CancelledError:
            span.set_attribute(ATTR_CANCELLED, True)
            raise
        except Exception as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        finally:
            self._live.pop(request_id, None)
            final = _final_attributes(last) if last is not None else {}
            self._work.put((self._end_request, (traced, final, time.time_ns())))

    # --- per step: queued on the engine thread, spans made on the builder thread -----------------
    def on_step(self, record: StepRecord) -> None:
        live = self._live
        if not live:
            return
        traced = [(rid, t) for rid in record.request_ids if (t := live.get(rid)) is not None]
        if traced:
            self._work.put((self._step_spans, (record, traced)))

    def _end_request(self, t: _Traced, final: dict, end_ns: int) -> None:
        t.span.set_attributes(final)
        wall_s = (end_ns - (t.span.start_time or t.start_ns)) / 1e9
        times = {**t.times, "overhead": max(0.0, wall_s - sum(t.times.values()))}
        t.span.set_attributes({ATTR_TIME_PREFIX + k + "_s": v for k, v in times.items()})
        t.span.set_attribute(ATTR_NUM_STEPS, t.num_steps)
        t.span.end(end_time=end_ns)

    def _step_spans(self, record: StepRecord, traced: list[tuple[str, _Traced]]) -> None:
        start_ns = int(record.start_time * 1e9)
        end_ns = start_ns + int(record.duration_s * 1e9)
        other_s = max(0.0, record.duration_s - record.draft_time_s - record.verify_time_s - record.sample_time_s)
        step_attrs = {
            ATTR_STEP_INDEX: record.step_index,
            ATTR_STEP_NUM_REQUESTS: record.num_requests,
            ATTR_STEP_NUM_SPEC_REQUESTS: record.num_spec_requests,
            ATTR_STEP_NUM_BATCHED_TOKENS: record.num_batched_tokens,
            ATTR_DRAFT_S: record.draft_time_s,
            ATTR_VERIFY_S: record.verify_time_s,
            ATTR_SAMPLE_S: record.sample_time_s,
            ATTR_OTHER_S: other_s,
            ATTR_STEP_NUM_TREE_DRAFTS: record.num_tree_drafts,
        }
        shares = {}
        for rid, _ in traced:
            n = record.num_scheduled_tokens.get(rid, 0)
            drafted, accepted = record.accepted.get(rid, (0, 0))
            shares[rid] = {
                ATTR_REQUEST_ID: rid,
                ATTR_NUM_SCHEDULED_TOKENS: n,
                ATTR_SHARE: n / record.num_batched_tokens if record.num_batched_tokens else 0.0,
                ATTR_NUM_DRAFTED: drafted,
                ATTR_NUM_ACCEPTED: accepted,
                ATTR_TREE_DEPTH: record.trees.get(rid, 0),
            }
        links = [Link(t.span.get_span_context(), shares[rid]) for rid, t in traced]
        step = self.tracer.start_span(STEP_SPAN, context=self._root, links=links, start_time=start_ns,
                                      attributes=step_attrs)
        step.end(end_time=end_ns)
        to_step = [Link(step.get_span_context())]
        prefill = record.prefill_request_ids
        for rid, t in traced:
            is_prefill = rid in prefill
            times = t.times
            if t.last_end_ns is None:
                self._child(QUEUE_SPAN, t, t.start_ns, start_ns, {})
                times["queue"] = times.get("queue", 0.0) + (start_ns - t.start_ns) / 1e9
            elif record.step_index > t.last_step_index + 1:  # steps ran without it: it waited
                skipped = record.step_index - t.last_step_index - 1
                self._child(QUEUE_SPAN, t, t.last_end_ns, start_ns, {ATTR_SKIPPED_STEPS: skipped,
                                                                      ATTR_PREEMPTED: is_prefill})
                times["queue"] = times.get("queue", 0.0) + (start_ns - t.last_end_ns) / 1e9
            if is_prefill:
                times["prefill"] = times.get("prefill", 0.0) + record.duration_s
            else:
                for phase, seconds in (("draft", record.draft_time_s), ("verify", record.verify_time_s),
                                       ("sample", record.sample_time_s), ("engine_other", other_s)):
                    times[phase] = times.get(phase, 0.0) + seconds
            t.num_steps += 1
            self._child(PREFILL_SPAN if is_prefill else DECODE_SPAN, t, start_ns, end_ns,
                        {**step_attrs, **shares[rid]}, to_step)
            t.last_end_ns = end_ns
            t.last_step_index = record.step_index

    def _child(self, name: str, t: _Traced, start_ns: int, end_ns: int, attrs: dict, links: list | None = None) -> None:
        span = self.tracer.start_span(name, context=t.context, start_time=start_ns, attributes=attrs, links=links)
        span.end(end_time=max(start_ns, end_ns))


def _final_attributes(out: Any) -> dict:
    """Request totals from its last RequestOutput."""
    m = out.metrics
    attrs: dict[str, Any] = {
        ATTR_NUM_PROMPT_TOKENS: len(out.prompt_token_ids),
        ATTR_NUM_OUTPUT_TOKENS: len(out.token_ids),
        ATTR_NUM_CACHED_TOKENS: out.num_cached_tokens,
        "gen_ai.usage.input_tokens": len(out.prompt_token_ids),
        "gen_ai.usage.output_tokens": len(out.token_ids),
    }
    if out.finish_reason is not None:
        attrs[ATTR_FINISH_REASON] = out.finish_reason
        attrs["gen_ai.response.finish_reasons"] = (out.finish_reason,)
    if m.get("ttft_s") is not None:
        attrs[ATTR_TTFT_S] = m["ttft_s"]
    for key, value in (m.get("spec") or {}).items():
        # Per-request draft/verify times are not kept by the engine; the step spans carry them.
        if isinstance(value, int | float) and not isinstance(value, bool) and not key.endswith("_time_s"):
            attrs[ATTR_SPEC_PREFIX + key] = value
    return attrs


def grpc_span_attributes(method: str, replica_id: str, params: Any, speculating: bool, client_request_id: str = "") -> dict:
    """Attributes of a request span opened by a gRPC method, or by an HTTP route (`method` starting
    with "/", e.g. "/v1/completions"): OpenTelemetry RPC or HTTP, and GenAI names. The span's
    `specdecode.request_id` is the engine's id; the client's own id is a label."""
    if method.startswith("/"):
        attrs: dict[str, Any] = {"http.request.method": "POST", "http.route": method}
    else:
        attrs = {"rpc.system": "grpc", "rpc.service": RPC_SERVICE, "rpc.method": method}
    attrs.update({
        ATTR_SPECULATIVE: bool(speculating),
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
    })
    if replica_id:
        attrs["specdecode.replica_id"] = replica_id
    if client_request_id:
        attrs[ATTR_CLIENT_REQUEST_ID] = client_request_id
    return attrs


def resumed_attributes(resume: Any) -> dict[str, Any]:
    """A resumed request's span attributes (a `deployments.common.Resume`); also its event's."""
    return {ATTR_RESUMED_REASON: resume.reason, ATTR_RESUMED_TOKENS: len(resume.token_ids),
            ATTR_RESUMED_ORDINAL: resume.ordinal}


def placement_attributes(placement: Any) -> dict[str, Any]:
    """Span attributes of a `deployments.placement.Placement`: where, why, predicted TTFTs."""
    attributes = {ATTR_PLACEMENT: placement.where, ATTR_PLACEMENT_REASON: placement.reason}
    if placement.remote_ttft_s is not None:
        attributes[ATTR_PREDICTED_REMOTE_TTFT_S] = placement.remote_ttft_s
    if placement.local_ttft_s is not None:
        attributes[ATTR_PREDICTED_LOCAL_TTFT_S] = placement.local_ttft_s
    return attributes


def setup_tracing(args: TracingArgs | None, llm: AsyncLLM | None, environ: Mapping[str, str] = os.environ) -> RequestTracer | None:
    """The replica's tracer, attached to `llm`'s engine (the ingress's: to none); None (and
    nothing registered) when off."""
    settings = resolve_settings(args, environ)
    if settings is None:
        return None
    tracer = RequestTracer(make_tracer_provider(settings, environ))
    if llm is not None:
        tracer.attach(llm.engine)
    logger.info("tracing on: exporters %s%s", ",".join(settings.exporters),
                f", file {settings.file}" if "file" in settings.exporters else "")
    return tracer
