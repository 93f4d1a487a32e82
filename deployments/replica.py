"""The engine replica: one `engine.AsyncLLM` (target + drafter on one device) as a Ray Serve
deployment, called by the ingress (`deployments/ingress.py`: gRPC and OpenAI-style HTTP) through a
deployment handle; in disaggregated mode the same class is the prefill pool's (`prefill`) and the
decode pool's (`generate`, which may answer that the prompt is to be prefilled elsewhere, and
`resume`, which continues a request from its handoff).

It translates a `GenerateRequest` (from gRPC, or built from an HTTP request by
`deployments/openai_api.py`; chat messages rendered by the tokenizer's chat template) into token
ids and `SamplingParams` (text is tokenized in a worker thread, after a length check that needs no
tokenizer), validating every field against this deployment's limits; streams the engine's outputs
back as `GenerateResponse`s; and reports refusals as a yielded `ClientError` instead of raising (an
exception raised here is logged by Serve with a traceback, and a refusal is not a fault). Each
engine request gets a fresh id of the server's own; the client's `request_id` is a label for the
response, logs and traces, so reusing one can never touch another request. Cancelling the stream
(client cancel, deadline) cancels the generator, which aborts the engine request and frees its KV
blocks. `deployments/app.py` binds it into the Serve application.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpc
import ray
from ray import serve

from deployments import tracing as t
from deployments.autoscaling import LatencyTracker, replica_autoscaling_stats
from deployments.common import (
    Accepted,
    HandoffRead,
    Handover,
    Prefilled,
    PrefillElsewhere,
    PrefillResult,
    Resume,
    completion_params,
)
from deployments.config import AppConfig, resolve_path
from deployments.drafter import ServeDrafterClient
from deployments.drain import Drain
from deployments.errors import ClientError
from deployments.handoff_transport import get_handoff, put_handoff, resolve_transport
from deployments.metrics import start_replica_metrics
from deployments.placement import LocalEstimate, Placement, PoolEstimate, place
from deployments.router import MAX_REPORTED_HASHES, PrefixKey, routing_stats
from deployments.tools import (
    Tool,
    ToolError,
    call_grammar,
    check_choice,
    parse_calls,
    parse_tools,
    render_chat,
)
from deployments.tracing import grpc_span_attributes, setup_tracing
from protos.specdecode.v1 import specdecode_pb2 as pb

logger = logging.getLogger("ray.serve")

HEALTH_CHECK_TIMEOUT_S = 30.0
# The longest step a decode replica takes while nothing decodes there (a local prefill): a
# handoff arriving meanwhile waits for the step, its first token already sent. Long enough that
# a local prefill loses little to per-step costs (steps of the TPOT budget made it 2x slower).
HANDOFF_STALL_S = 0.5
# Limits on fields the proto leaves unbounded (each is named in the error a client gets).
MAX_TEMPERATURE = 100.0  # beyond it every distribution is uniform noise to float32
MAX_SPECULATIVE_TOKENS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TEMPLATE_ERROR_CHARS = 200
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


def local_estimate(engine: Any, prompt: list[int], params: Any) -> LocalEstimate:
    """This engine's prefill capacity for `prompt` now (run on the engine thread, between steps):
    its tokens outside the prefix cache as this request would use it (a drafting request
    recomputes blocks whose drafter KV was never filled; not counted as a prefix-cache query),
    the prompt tokens already waiting, its prefill rate: the measured one, cut to the chunk that
    the scheduler's step budget (`Scheduler.step_budget_s`: the TPOT budget while streams decode,
    the idle step budget if any with none) leaves beside the streams' tokens, and whether it is
    past its own capacity (requests wait here, or its streams' tokens alone fill such a step)."""
    uncached = len(prompt) - engine.num_cached_prompt_tokens(prompt, params)
    stats = engine.stats()
    rate = stats.get("prefill_tokens_per_s")
    saturated = stats["num_waiting"] > 0  # requests wait for a slot or KV here
    budget_s = engine.scheduler.step_budget_s()
    within = engine.step_cost.tokens_within(budget_s) if budget_s else None
    if within is not None:
        decode_tokens = sum(1 + len(r.spec_token_ids) for r in engine.scheduler.running)
        saturated = saturated or (decode_tokens > 0 and decode_tokens >= within)
        if rate:
            rate = min(rate, max(1, within - decode_tokens) / budget_s)
    return LocalEstimate(uncached, stats["queued_tokens"], rate, saturated)


def decodes_here(engine: Any, max_streams: int) -> bool:
    """Whether a prefill replica decodes a prompt it is given itself rather than handing it over
    (run on its engine thread): nothing else waits or is being prefilled here, and it runs fewer
    than `max_streams` streams. A later prompt sent here is prefilled beside those streams in
    stall-free chunks, so the pool keeps most of its rate."""
    scheduler = engine.scheduler
    if scheduler.waiting or len(scheduler.running) >= max_streams:
        return False
    return all(r.output_token_ids for r in scheduler.running)


class TraceMetadata:
    """The caller's W3C trace headers, shaped like the gRPC context `parent_context` reads, the
    method or HTTP route the request came in by, and where its prompt was placed (span attributes)."""

    def __init__(self, pairs: list[tuple[str, str]], route: str = "Generate", placement: Placement | None = None) -> None:
        self.pairs = pairs
        self.route = route
        self.placement = placement

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.pairs


class SpecDecodeServer:
    """One engine replica: an AsyncLLM (target + drafter on one device) behind `generate`.
    `role` "decode" (the decode pool of a disaggregated app) keeps steps with nothing decoding
    within HANDOFF_STALL_S: handoffs arrive with their first token already sent, and one arriving
    during a whole long prompt's step would stall for all of it."""

    def __init__(self, config: AppConfig, drafter_pool: Any = None, role: str = "engine") -> None:
        from engine import AsyncLLM

        self.config = config
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica (direct construction in tests)
            self.replica_id = ""
        # mode: disaggregated: where this decode replica's requests were prefilled (remote, local,
        # local_faster, local_backoff, fallback) and why remote prefills fell back (no_handoff,
        # lost, refused)
        self.prefills: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        self.transports: dict[str, int] = {}  # handoffs received, by transport
        self.handoffs: deque[tuple[int, float]] = deque(maxlen=1000)  # (bytes, seconds) of the last ones
        engine_kwargs = config.engine_kwargs()
        if role == "decode" and engine_kwargs["decode_step_budget_s"]:
            engine_kwargs["idle_step_budget_s"] = max(HANDOFF_STALL_S, engine_kwargs["decode_step_budget_s"])
        # speculative.placement: remote: the draft model drafts in the drafter pool (deployments/drafter.py)
        self.drafter_pool = drafter_pool
        remote = {}
        if drafter_pool is not None:
            affinity = self.replica_id or uuid.uuid4().hex
            remote["remote_drafter"] = ServeDrafterClient(drafter_pool, affinity, config.drafter_pool.timeout_s)
        self.llm = AsyncLLM(resolve_path(config.model), **engine_kwargs, **remote)
        self.drain = Drain(config.drain_timeout_s, self.llm.abort)  # hands streams over when Serve removes it
        engine = self.llm.engine
        self.transport = resolve_transport(config.disaggregation.transport, engine.device.type)  # of its handoffs
        engine.export_kv_on_device = self.transport == "nixl"  # NIXL moves GPU memory itself
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.max_prompt_tokens = min(config.max_prompt_tokens or engine.max_model_len - 1, engine.max_model_len - 1)
        self.has_drafter = config.speculative is not None
        self.latency = LatencyTracker(config.metrics_window_s)  # p95s for the SLO autoscaling policy
        # Prometheus metrics always; tracing only when configured (else None: nothing registered).
        k = config.speculative.num_speculative_tokens if config.speculative else 0
        self.metrics = start_replica_metrics(self.llm, k)
        self.tracing = setup_tracing(config.tracing, self.llm)
        logger.info(
            "SpecDecode replica ready: %s, drafter %s, max_model_len %d, max_prompt_tokens %d, "
            "%d torch threads on %s",
            config.model, config.speculative, self.max_model_len, self.max_prompt_tokens,
            engine_kwargs["num_threads"], self.llm.engine.device,
        )

    # --- called by the ingress ----------------------------------------------------------------
    async def generate(
        self, request: pb.GenerateRequest, label: str, trace_metadata: list[tuple[str, str]] | None = None,
        messages: list[dict[str, str]] | None = None, route: str = "Generate", pool: PoolEstimate | None = None,
        resume: Resume | None = None, prefix_key: PrefixKey | None = None,
    ) -> AsyncIterator[Accepted | ClientError | PrefillElsewhere | pb.GenerateResponse]:
        """`Accepted`, then the response messages; or one `ClientError` (and nothing else) when the
        request is refused or the engine fails it. `label` is the client's id for the request.
        `messages` (chat, HTTP only) replaces the request's prompt: the tokenizer's chat template
        renders them. `route` is the gRPC method or HTTP route it came by (for its trace).
        In disaggregated mode the ingress passes what it knows of the prefill pool (`pool`); a
        prompt that is to be prefilled there (deployments/placement.py) gets `Accepted` and a
        `PrefillElsewhere`, and nothing more: the ingress brings it back to `resume` with its
        handoff, so it holds no slot here while it waits for the pool. With `resume` (its replica
        was lost mid-stream) the request goes on after the tokens the client already has: they are
        prefilled here with the prompt, and a seeded request's generator starts again from its
        seed at that point. `prefix_key` is the router's (deployments/router.py; unused here)."""
        try:
            n, best_of = num_completions(request)
            prompt, params = await self.translate(request, messages)
        except ClientError as e:  # logged once, by the ingress
            yield e
            return
        speculating = self.has_drafter and params.speculative and params.num_speculative_tokens != 0
        trace = TraceMetadata(trace_metadata or [], route)
        tools, choice = request_tools(request)
        calling = tools if choice != "none" else None  # calls are parsed from the output
        yield Accepted(self.replica_id)
        if resume is not None:
            async for item in self._run(prompt, params, label, trace, speculating, tools=calling, resume=resume,
                                        drainable=True):
                yield item
            return
        if pool is not None and self.config.mode == "disaggregated":
            if len(prompt) < self.config.disaggregation.min_prompt_tokens:  # short whatever is cached
                local = LocalEstimate(len(prompt), 0, None)  # no call into the engine thread (it waits for a step)
            else:
                local = await self.llm.call(local_estimate, self.llm.engine, prompt, params)
            ttft_budget_s = self.config.slo.ttft_ms / 1e3 if self.config.slo.ttft_ms else None
            placement = place(local, pool, self.config.disaggregation.min_prompt_tokens, ttft_budget_s)
            self.metrics.on_placement(placement)
            if placement.where == "remote":
                yield PrefillElsewhere(prompt, params, placement, local.uncached_tokens, speculating, calling,
                                       (n, best_of))
                return
            self._count_prefill({"local_faster": "local_faster", "backoff": "local_backoff"}.get(placement.reason, "local"))
            trace.placement = placement
        if best_of > 1:  # several completions: the prompt's blocks shared between them
            async for item in self._run_completions(prompt, params, n, best_of, label, trace, speculating, calling):
                yield item
            return
        async for item in self._run(prompt, params, label, trace, speculating, tools=calling, drainable=True):
            yield item

    async def _run_completions(
        self, prompt: list[int], params: Any, n: int, best_of: int, label: str, trace: TraceMetadata,
        speculating: bool, tools: list[Tool] | None = None, first_stream: AsyncIterator | None = None,
        held: list[pb.GenerateResponse] | None = None,
    ) -> AsyncIterator[ClientError | HandoffRead | Prefilled | pb.GenerateResponse]:
        """`best_of` completions of one prompt, each an engine request of its own
        (`completion_params`): the first is prefilled alone, the others start once it has its
        first token, so their prompt's full blocks come from the prefix cache. With best_of == n
        their messages go out as they come, each with its `index`; otherwise all are kept, and
        the n with the highest cumulative log-probability go out at the end, re-indexed in that
        order. `first_stream` (a request the prefill pool prefilled: `resume`) replaces the first
        completion's engine request; its control items (`HandoffRead`, `Prefilled`) pass through,
        and `held` are the messages of it the pool made and the client has not been sent."""
        ranking = best_of > n

        def completion(i: int) -> AsyncIterator[ClientError | pb.GenerateResponse]:
            return self._run(prompt, completion_params(params, i, ranking), label, trace, speculating, tools=tools)

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator, first: Any = None) -> None:
            try:
                if first is not None:
                    queue.put_nowait((i, first))
                async for item in stream:
                    queue.put_nowait((i, item))
            finally:
                await stream.aclose()  # aborts its engine request when it has not finished
                queue.put_nowait((i, None))

        first_stream = first_stream if first_stream is not None else completion(0)
        tasks: list[asyncio.Task] = []
        try:
            first = await anext(first_stream, None)
            while isinstance(first, HandoffRead | Prefilled):  # for the ingress, before any message
                yield first
                first = await anext(first_stream, None)
            if isinstance(first, ClientError):
                yield first
                return
            tasks.append(asyncio.ensure_future(pump(0, first_stream, first)))
            tasks += [asyncio.ensure_future(pump(i, completion(i))) for i in range(1, best_of)]
            kept: dict[int, list[pb.GenerateResponse]] = {i: [] for i in range(best_of)}
            kept[0] += held or []
            running = best_of
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, ClientError):
                    yield item
                    return
                item.index = i
                if ranking:
                    kept[i].append(item)
                else:
                    yield item
            if ranking:
                def cumulative(i: int) -> float:
                    return sum(lp.logprob for m in kept[i] for lp in m.logprobs)

                for index, i in enumerate(sorted(kept, key=cumulative, reverse=True)[:n]):
                    for m in kept[i]:
                        m.index = index
                        if params.logprobs is None:
                            del m.logprobs[:]
                        yield m
        finally:
            for task in tasks:
                task.cancel()
            if not tasks:
                await first_stream.aclose()

    async def resume(
        self, prompt: list[int], params: Any, label: str, trace_metadata: list[tuple[str, str]] | None,
        result: PrefillResult | None, sent: list[int], speculating: bool, tools: list[Tool] | None = None,
        num_sent_chars: int = 0, num_completions: tuple[int, int] = (1, 1),
        held: list[pb.GenerateResponse] | None = None, first_finished: bool = False,
    ) -> AsyncIterator[Accepted | ClientError | HandoffRead | Prefilled | pb.GenerateResponse]:
        """Continue a request the prefill pool prefilled (called by the ingress once its handoff
        is ready; the client already has `sent`): `Accepted`, `HandoffRead` once the handoff is
        here (its prefill call can close), `Prefilled`, then the messages after `sent`. A lost
        handoff, a refused import or none at all (`result` None: the pool failed) is prefilled
        here after the tokens already sent (`fallback`; `num_sent_chars` characters of their text):
        they count toward max_tokens, penalties and the grammar as the request's own output, so
        the client never sees the difference. With `tools`, the last message carries the calls
        parsed from the whole output.

        Several completions (`num_completions` (n, best_of), best_of > 1): the pool prefilled the
        first (`sent` and `num_sent_chars` are its own); it goes on from the handoff here (or it
        finished in the pool: `first_finished`), and the others start once it has, their prompt's
        blocks shared with it (`_run_completions`). `held`: the first completion's messages from
        the pool that the ingress kept back for the ranking (best_of > n)."""
        yield Accepted(self.replica_id)
        trace = TraceMetadata(trace_metadata or [])
        n, best_of = num_completions
        if best_of == 1:
            async for item in self._continue(prompt, params, label, trace, result, sent, speculating, tools,
                                             num_sent_chars, drainable=True):
                yield item
            return
        first = self._continue(prompt, completion_params(params, 0, best_of > n), label, trace, result, sent,
                               speculating, tools, num_sent_chars, finished=first_finished)
        async for item in self._run_completions(prompt, params, n, best_of, label, trace, speculating, tools,
                                                first_stream=first, held=held):
            yield item

    async def _continue(
        self, prompt: list[int], params: Any, label: str, trace: TraceMetadata, result: PrefillResult | None,
        sent: list[int], speculating: bool, tools: list[Tool] | None, num_sent_chars: int, *,
        drainable: bool = False, finished: bool = False,
    ) -> AsyncIterator[ClientError | HandoffRead | Prefilled | Handover | pb.GenerateResponse]:
        """`resume`'s one engine request: from the handoff, or a local prefill after `sent`;
        nothing when it already `finished` in the pool."""
        fetched = await self._fetch_handoff(result, label) if result is not None and result.handoff else None
        if result is not None:
            result.handoff.clear()  # drop the ObjectRef: the owner frees the handoff when its call closes
            yield HandoffRead(fetched is not None)
            if self.tracing is not None:
                self.tracing.handoff(self.tracing.parent_context(trace), int(result.sent_at * 1e9), time.time_ns(), {
                    t.ATTR_HANDOFF_BYTES: result.num_bytes, t.ATTR_HANDOFF_TRANSPORT: result.transport,
                }, error=None if fetched is not None else "handoff lost")
        if finished:
            return
        if fetched is not None:
            handoff, seconds = fetched
            fetched = None
            stream = self._run(prompt, params, label, trace, speculating, handoff=handoff,
                               num_emitted_chars=result.num_emitted_chars, tools=tools, drainable=drainable)
            handoff = None
            first = True
            async for item in stream:
                if first and isinstance(item, ClientError):
                    # Not imported (e.g. a prefill pool serving another model): nothing of it
                    # reached the client, so prefill here instead of failing the request.
                    logger.error("request %r: handoff not imported (%s: %s); prefilling locally",
                                 label, item.code_name, item.details)
                    reason = "refused"
                    break
                if first:
                    self._count_prefill("remote", result.num_bytes, seconds)
                    self.transports[result.transport] = self.transports.get(result.transport, 0) + 1
                    yield Prefilled("remote")
                    first = False
                yield item
            else:
                return
        else:
            reason = "lost" if result is not None else "no_handoff"
            logger.warning("request %r: %s; prefilling locally", label,
                           "handoff lost" if result is not None else "no handoff from the prefill pool")
        self._count_prefill("fallback")
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        yield Prefilled("fallback", reason)
        async for item in self._run(prompt, params, label, trace, speculating, already_sent=sent,
                                    num_emitted_chars=num_sent_chars, tools=tools, drainable=drainable):
            yield item

    async def prefill(
        self, prompt: list[int], params: Any, label: str, trace_metadata: list[tuple[str, str]] | None = None,
        prefix_key: PrefixKey | None = None, tools: list[Tool] | None = None, may_decode: bool = True,
    ) -> AsyncIterator[Accepted | ClientError | pb.GenerateResponse | PrefillResult]:
        """The prefill pool's method (called by the ingress): `Accepted`, the first message(s),
        then a `PrefillResult` whose handoff (target KV, drafter state, first drafts; in Ray's
        object store, owned by this replica) a decode replica imports; this replica holds its
        reference until the ingress closes the call. A request that finishes on its first token
        ends with its last message instead. A replica with nothing else to prefill and fewer than
        `disaggregation.pool_max_streams` streams decodes the request itself (`decodes_here`):
        `Prefilled("pool")`, then every message. With `tools`, a request that finishes here ends
        with the calls parsed from its output. `may_decode` False (the first of several
        completions, whose handoff the others share) always hands over. `prefix_key` is the
        router's (unused here)."""
        speculating = self.has_drafter and params.speculative and params.num_speculative_tokens != 0
        yield Accepted(self.replica_id)
        max_streams = self.config.disaggregation.pool_max_streams
        whole = may_decode and bool(max_streams) and await self.llm.call(decodes_here, self.llm.engine, max_streams)
        if whole:
            self._count_prefill("pool_decoded")
            yield Prefilled("pool")
        async for item in self._run(prompt, params, label, TraceMetadata(trace_metadata or []), speculating,
                                    export=not whole, tools=tools):
            yield item

    async def _run(
        self, prompt: list[int], params: Any, label: str, trace: TraceMetadata, speculating: bool, *,
        export: bool = False, handoff: Any = None, num_emitted_chars: int = 0, already_sent: list[int] | None = None,
        tools: list[Tool] | None = None, resume: Resume | None = None, drainable: bool = False,
    ) -> AsyncIterator[ClientError | pb.GenerateResponse | PrefillResult | Handover]:
        """Run one engine request and yield its messages; engine errors become a `ClientError`.
        With `tools`, the last message carries the calls parsed from the output. A `drainable`
        stream (one the ingress can resume elsewhere) ends with `Handover` when this replica's
        drain hands it over, or at once when the drain has begun before it."""
        from engine import EngineDeadError, EngineError, EngineOverloadedError, InvalidRequestError
        from engine.errors import HandoffMismatchError

        request_id = uuid.uuid4().hex  # the engine's id: never the client's
        role = "prefill" if export else "decode" if handoff is not None or already_sent else None
        self.latency.start(request_id)
        try:
            if drainable:
                self.drain.watch()
                if not self.drain.admit(request_id):
                    yield Handover()
                    return
            if resume is not None:
                num_emitted_chars = resume.num_chars
            stream = self.llm.generate(prompt, params, request_id=request_id, export_after_prefill=export,
                                       handoff=handoff, num_emitted_chars=num_emitted_chars,
                                       with_drafter_state=self.config.disaggregation.with_drafter_state,
                                       output_token_ids=resume.token_ids if resume is not None else already_sent)
            handoff = None  # the engine copies it into its own blocks; do not hold it for the whole stream
            if self.tracing is not None:
                attributes = grpc_span_attributes(trace.route, self.replica_id, params, speculating, label)
                if role is not None:
                    attributes[t.ATTR_ROLE] = role
                if trace.placement is not None:
                    attributes.update(t.placement_attributes(trace.placement))
                events = []
                if resume is not None:  # it goes on from another replica: say why, and from where
                    attributes.update(t.resumed_attributes(resume))
                    events.append((t.RESUMED_EVENT, t.resumed_attributes(resume)))
                parent = self.tracing.parent_context(trace)
                stream = self.tracing.trace(stream, request_id, parent=parent, server=True, attributes=attributes,
                                            events=events)
            async for out in stream:
                self.latency.on_tokens(request_id, len(out.delta_token_ids))
                if out.handoff is not None:  # owned by this replica; freed when the decode side drops it
                    ref = put_handoff(out.handoff, self.transport)
                    rate = self.llm.stats().get("prefill_tokens_per_s")
                    yield PrefillResult([ref], self.transport, out.handoff.num_bytes, len(out.text), time.time(),
                                        self.replica_id, rate)
                    # Keep this replica's own reference until the decode replica has read the
                    # handoff and closed the call (which cancels it here), at most twice its fetch
                    # timeout: Ray can free an object whose reference a generator yielded inside
                    # another object once the producer's local reference is gone, before the
                    # consumer's borrow is registered (ray-project/ray#58080), and the decode side
                    # then finds it lost.
                    await asyncio.sleep(2 * self.config.replica_wait_timeout_s)
                    return
                if out.finish_reason == "abort" and self.drain.is_handed_over(request_id):
                    yield Handover()  # its last text (held back) comes from the replica that resumes it
                    return
                if out.finished:
                    self.metrics.on_request_finished(out, speculating)
                message = self.to_response(out, label, speculating, self.llm.tokenizer)
                if tools and out.finished:
                    _, calls = parse_calls(out.text, tools)
                    if calls:
                        message.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
                        message.finish_reason = pb.FINISH_REASON_TOOL_CALLS
                yield message
        except InvalidRequestError as e:
            yield ClientError(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineOverloadedError as e:
            yield ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"replica full: {e}; retry later")
        except HandoffMismatchError as e:  # the caller (`generate`) prefills locally instead
            yield ClientError(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except EngineDeadError as e:
            logger.error("request %r failed: engine stopped: %s", label, e)
            yield ClientError(grpc.StatusCode.UNAVAILABLE, "the engine on this replica stopped; retry the request")
        except EngineError as e:
            logger.error("request %r failed: engine error: %s", label, e)
            yield ClientError(grpc.StatusCode.INTERNAL, f"engine error: {e}")
        finally:
            self.latency.finish(request_id)
            self.drain.release(request_id)

    # --- disaggregation ----------------------------------------------------------------------
    def _count_prefill(self, where: str, num_bytes: int = 0, seconds: float | None = None) -> None:
        self.prefills[where] = self.prefills.get(where, 0) + 1
        if seconds is not None:
            self.handoffs.append((num_bytes, seconds))
        self.metrics.on_prefill(where, num_bytes, seconds)

    async def _fetch_handoff(self, result: PrefillResult, label: str) -> tuple[Any, float] | None:
        """The handoff (by the transport its prefill replica chose) and the seconds since the
        prefill replica published it (None when it is lost: its owner died)."""
        try:
            handoff = await get_handoff(result.handoff[0], self.config.replica_wait_timeout_s)
        except (TimeoutError, ray.exceptions.RayError) as e:
            logger.warning("request %r: handoff lost (%s)", label, type(e).__name__)
            return None
        return handoff, max(0.0, time.time() - result.sent_at)

    async def remote_drafting(self) -> dict[str, Any]:
        """This replica's drafting in the drafter pool (speculative.placement: remote): rounds,
        failures (steps without drafts: a lost, slow or mismatched pool), skipped (steps that left
        the pool alone after a failure), `unknown` answers, drafts and those made ahead; {} when it
        drafts locally."""
        spec = self.llm.engine.speculator
        if spec is None or not getattr(spec.proposer, "remote", False):
            return {}
        return {"replica": self.replica_id, "disabled": spec.proposer.disabled, **spec.proposer.counts}

    async def prefill_counts(self) -> dict[str, float]:
        """How this decode replica's requests were prefilled (remote; local: short or cached;
        local_faster: long, but predicted faster here than in the pool; local_backoff: long, while
        the pool backs off after a failure; fallback), by which transport its handoffs came
        (`via_nixl`, `via_object_store`), why fallbacks happened (`fallback_no_handoff`,
        `fallback_lost`, `fallback_refused`) and the handoffs' median size and transfer time
        (tests and bench/bench_pd.py)."""
        out: dict[str, float] = dict(self.prefills)
        out.update({f"via_{name}": n for name, n in self.transports.items()})
        out.update({f"fallback_{why}": n for why, n in self.fallbacks.items()})
        if self.handoffs:
            out["handoff_mb_median"] = statistics.median(b for b, _ in self.handoffs) / 1e6
            out["handoff_ms_median"] = statistics.median(s for _, s in self.handoffs) * 1e3
        return out

    async def model_info(self) -> pb.ModelInfo:
        return await self.GetModelInfo(pb.GetModelInfoRequest())

    async def GetModelInfo(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:  # noqa: N802 - gRPC name
        cfg, engine = self.config, self.llm.engine
        stats = await self.llm.call(engine.stats)
        spec = cfg.speculative
        return pb.ModelInfo(
            model=cfg.model_id,
            drafter_method=spec.method if spec else "",
            drafter_model=(spec.model or "") if spec else "",
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            adaptive=spec.adaptive if spec else False,
            has_tokenizer=self.llm.tokenizer is not None,
            has_chat_template=bool(getattr(self.llm.tokenizer, "chat_template", None)),
            device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."),
            limits=pb.Limits(
                max_model_len=self.max_model_len,
                max_prompt_tokens=self.max_prompt_tokens,
                max_tokens=cfg.max_tokens,
                default_max_tokens=cfg.default_max_tokens,
                max_num_seqs=cfg.max_num_seqs,
                max_queued_requests=cfg.max_queued_requests,
                vocab_size=self.vocab_size,
            ),
            usage=pb.EngineUsage(
                num_blocks=stats["num_blocks"],
                num_used_blocks=stats["num_used_blocks"],
                num_free_blocks=stats["num_free_blocks"],
                num_running=stats["num_running"],
                num_waiting=stats["num_waiting"],
                num_preemptions=stats["num_preemptions"],
                speculation=_spec_stats(stats.get("spec", {}), enabled=spec is not None),
            ),
            replica_id=self.replica_id,
        )

    # --- Serve hooks ------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine thread must answer a no-op
        call between two steps within HEALTH_CHECK_TIMEOUT_S."""
        try:
            await asyncio.wait_for(self.llm.call(_noop), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"the engine loop did not answer within {HEALTH_CHECK_TIMEOUT_S} s") from None

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve autoscaling metrics for deployments.autoscaling.SLOAutoscalingPolicy: windowed
        p95 TTFT/TPOT, engine queue and KV-cache use (cheap: a snapshot, no engine call). Async
        so that it runs on the event loop that updates the latency tracker (Serve runs sync
        methods in a thread pool)."""
        return replica_autoscaling_stats(self.llm.stats(), self.latency.snapshot())

    async def record_routing_stats(self) -> dict[str, Any]:
        """Engine load and the prefix cache's blocks for deployments.router.EngineLoadRouter (the
        hashes are read on the engine thread, between steps)."""
        hashes = await self.llm.call(_cached_hashes, self.llm.engine)
        return routing_stats(self.llm.stats(), prefix_hashes=hashes, block_size=self.llm.engine.block_manager.block_size)

    def __del__(self) -> None:
        for hook in (getattr(self, "metrics", None), getattr(self, "tracing", None)):
            if hook is not None:
                hook.shutdown()
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()

    # --- translation ------------------------------------------------------------------------
    async def translate(
        self, request: pb.GenerateRequest, messages: list[dict[str, str]] | None = None
    ) -> tuple[list[int], Any]:
        """Prompt token ids and SamplingParams for a request (its prompt, or chat `messages`);
        ClientError if it is bad. Every field is checked before the prompt is tokenized, and the
        prompt's length before that. A text prompt with `token_healing` comes back healed (the
        params then carry the first-token constraint); token ids and chat messages are not."""
        from engine import InvalidRequestError, SamplingParams

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        kind = request.WhichOneof("input")
        if kind == "chat" and messages is None:
            messages, kind = [chat_message(m) for m in request.chat.messages], None
        if kind is None and messages is None:
            raise ClientError(invalid, "prompt: set `prompt` (text), `prompt_token_ids` or `chat`")
        if kind is not None and messages is not None:
            raise ClientError(invalid, "messages: a chat request has no prompt of its own")
        tools, choice = request_tools(request)
        if tools and messages is None:
            raise ClientError(invalid, "tools: only with chat messages")
        kwargs = self.sampling_kwargs(request)
        grammar = call_grammar(tools, choice)
        if grammar is not None:
            if "structured_output" in kwargs:
                raise ClientError(invalid, f"tool_choice: {choice} constrains the output; leave structured_output unset")
            from engine import StructuredOutput

            kwargs["structured_output"] = StructuredOutput("grammar", grammar)
        try:
            params = SamplingParams(**kwargs)
        except InvalidRequestError as e:
            raise ClientError(invalid, str(e)) from None
        if messages is not None:
            ids = await self.encode_chat(messages, tools)
        elif kind == "prompt":
            if not request.prompt:
                raise ClientError(invalid, "prompt: is empty; give at least one character")
            try:
                _, ids = await self.llm.encode_async(request.prompt, self.max_prompt_tokens)
            except InvalidRequestError as e:
                raise ClientError(invalid, f"prompt: {e}") from None
            ids, params = await self.llm.heal_async(request.prompt, ids, params)  # with token_healing
        else:
            ids = list(request.prompt_token_ids.ids)
            if not ids:
                raise ClientError(invalid, "prompt_token_ids: is empty; give at least one token id")
            if len(ids) > self.max_prompt_tokens:
                raise ClientError(
                    invalid, f"prompt: has {len(ids)} tokens; this deployment accepts at most {self.max_prompt_tokens}"
                )
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ClientError(
                    invalid, f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size - 1}]"
                )
        if len(ids) > self.max_prompt_tokens:
            raise ClientError(
                invalid, f"prompt: has {len(ids)} tokens; this deployment accepts at most {self.max_prompt_tokens}"
            )
        return ids, params

    async def encode_chat(self, messages: list[dict], tools: list[Tool] | None = None) -> list[int]:
        """Token ids of chat `messages` ({"role", "content"} each) rendered by the tokenizer's chat
        template with the assistant's turn opened, in a worker thread; ClientError when the model
        has no chat template, the text cannot fit, or the template refuses the messages."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        tokenizer = self.llm.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ClientError(invalid, f"messages: the model {self.config.model_id!r} has no chat template; send a "
                                       "prompt to /v1/completions instead")
        if not messages:
            raise ClientError(invalid, "messages: is empty; give at least one message")
        num_chars = sum(len(m["content"]) for m in messages)
        limit = self.llm.max_prompt_chars(self.max_prompt_tokens)
        if num_chars > limit:
            raise ClientError(invalid, f"messages: have {num_chars} characters; at most {self.max_prompt_tokens} "
                                       f"tokens are accepted, which no text over {limit} characters fits in")

        from jinja2.exceptions import TemplateError

        try:
            ids = await asyncio.to_thread(render_chat, tokenizer, messages, tools or [])
        except (TemplateError, ValueError, TypeError, KeyError) as e:  # e.g. the template's raise_exception
            raise ClientError(invalid, f"messages: the model's chat template refused them: "
                                       f"{str(e)[:MAX_TEMPLATE_ERROR_CHARS]}") from None
        if not ids:
            raise ClientError(invalid, "messages: the chat template rendered them as no tokens")
        return ids

    def sampling_kwargs(self, request: pb.GenerateRequest) -> dict[str, Any]:
        """SamplingParams keyword arguments from the request's fields, each range-checked here (the
        proto's ranges are wider than the engine's: int64 seeds, infinite doubles, long lists)."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        cfg = self.config
        max_tokens = request.max_tokens if request.HasField("max_tokens") else cfg.default_max_tokens
        if max_tokens > cfg.max_tokens:
            raise ClientError(invalid, f"max_tokens: {max_tokens} exceeds this deployment's cap of {cfg.max_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(request, name)
            if request.HasField(name) and not math.isfinite(value):
                raise ClientError(invalid, f"{name}: must be a finite number, got {value!r}")
        if request.HasField("temperature") and request.temperature > MAX_TEMPERATURE:
            raise ClientError(invalid, f"temperature: must be in [0, {MAX_TEMPERATURE}], got {request.temperature!r}")
        if request.HasField("top_k") and request.top_k > self.vocab_size:
            raise ClientError(invalid, f"top_k: must be in [0, {self.vocab_size}] (0 = off), got {request.top_k}")
        if request.HasField("seed") and request.seed < 0:
            raise ClientError(invalid, f"seed: must be in [0, {2**63 - 1}], got {request.seed}")
        mode = request.speculation
        if mode not in pb.SpeculationMode.values():
            names = ", ".join(pb.SpeculationMode.keys())
            raise ClientError(invalid, f"speculation: unknown mode {mode}; use one of {names}")
        if mode == pb.SPECULATION_MODE_ON and not self.has_drafter:
            raise ClientError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "speculation: ON, but this deployment has no drafter; use DEFAULT or OFF",
            )
        if request.HasField("max_speculative_tokens") and request.max_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ClientError(invalid, f"max_speculative_tokens: must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                                       f"got {request.max_speculative_tokens}")
        stops = list(request.stop)
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ClientError(invalid, f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                                       f"characters, got {len(stops)} (longest {max(map(len, stops))})")
        stop_ids = list(request.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ClientError(invalid, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(stop_ids)}")
        bad = [t for t in stop_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ClientError(invalid, f"stop_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size - 1}]")
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": stops or None,
            "stop_token_ids": stop_ids,
            "ignore_eos": request.ignore_eos,
            "speculative": mode != pb.SPECULATION_MODE_OFF,
            "token_healing": request.token_healing,
        }
        for name in ("temperature", "top_p", "top_k", "seed"):
            if request.HasField(name):
                kwargs[name] = getattr(request, name)
        if request.HasField("max_speculative_tokens"):
            kwargs["num_speculative_tokens"] = request.max_speculative_tokens
        if request.HasField("logprobs"):
            from engine.sampling_params import MAX_LOGPROBS

            if request.logprobs > MAX_LOGPROBS:
                raise ClientError(invalid, f"logprobs: must be in [0, {MAX_LOGPROBS}], got {request.logprobs}")
            kwargs["logprobs"] = request.logprobs
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if request.HasField(name):
                if not math.isfinite(getattr(request, name)):
                    raise ClientError(invalid, f"{name}: must be a finite number, got {getattr(request, name)!r}")
                kwargs[name] = getattr(request, name)
        if request.logit_bias:
            kwargs["logit_bias"] = dict(request.logit_bias)
        if request.HasField("min_tokens"):
            kwargs["min_tokens"] = request.min_tokens
        if request.HasField("structured_output"):
            kwargs["structured_output"] = structured_output(request.structured_output)
        return kwargs

    @staticmethod
    def to_response(out: Any, label: str, speculating: bool, tokenizer=None) -> pb.GenerateResponse:
        """One engine RequestOutput as a stream message (the last one carries the totals)."""
        msg = pb.GenerateResponse(request_id=label, token_ids=out.delta_token_ids, text=out.delta_text)
        if out.delta_logprobs:
            msg.logprobs.extend(token_logprob_messages(out.delta_logprobs, tokenizer))
        if out.finished:
            m = out.metrics
            msg.finish_reason = _FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
            msg.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=m.get("num_prompt_tokens", len(out.prompt_token_ids)),
                    completion_tokens=m.get("num_output_tokens", len(out.token_ids)),
                    cached_prompt_tokens=out.num_cached_tokens,
                )
            )
            msg.speculation.CopyFrom(_spec_stats(m.get("spec", {}), enabled=speculating))
            msg.timing.CopyFrom(pb.Timing(ttft_s=m.get("ttft_s") or 0.0, e2e_s=m.get("e2e_s") or 0.0))
        return msg


MAX_COMPLETIONS = 16  # n and best_of


def chat_message(m: pb.ChatMessage) -> dict:
    """A ChatMessage as the chat template takes it (tool calls: {"name", "arguments"} each)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def request_tools(request: pb.GenerateRequest) -> tuple[list[Tool], str]:
    """The request's tools and tool_choice (none, auto, required, or a tool's name); ClientError
    when they are bad."""
    try:
        tools = parse_tools([(t.name, t.description, t.parameters) for t in request.tools])
        kind = request.tool_choice.WhichOneof("choice")
        choice = request.tool_choice.function if kind == "function" else kind or ("auto" if tools else "none")
        check_choice(choice, tools)
    except ToolError as e:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    return tools, choice


def num_completions(request: pb.GenerateRequest) -> tuple[int, int]:
    """(n, best_of) of a request (1, 1 when unset); ClientError outside 1 <= n <= best_of <= 16."""
    n = request.n if request.HasField("n") else 1
    best_of = request.best_of if request.HasField("best_of") else n
    if not 1 <= n <= MAX_COMPLETIONS:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, f"n: must be in [1, {MAX_COMPLETIONS}], got {n}")
    if not n <= best_of <= MAX_COMPLETIONS:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"best_of: must be in [n ({n}), {MAX_COMPLETIONS}], got {best_of}")
    return n, best_of


def structured_output(message: pb.StructuredOutput) -> Any:
    """A request's StructuredOutput message as the engine's (ClientError when it is empty or bad:
    a schema that is not JSON; a grammar that does not compile is refused by the engine)."""
    from engine import InvalidRequestError, StructuredOutput

    kind = message.WhichOneof("kind")
    if kind is None:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, "structured_output: set one of json_schema, json_object, "
                                                            "regex, grammar")
    if kind == "json_object" and not message.json_object:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, "structured_output.json_object: set it to true")
    try:
        return StructuredOutput(kind, "" if kind == "json_object" else getattr(message, kind))
    except InvalidRequestError as e:
        raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def token_logprob_messages(logprobs: list, tokenizer) -> list[pb.TokenLogprob]:
    """engine TokenLogprobs as TokenLogprob messages, with each token's text and bytes."""
    from engine.token_bytes import token_piece

    def message(token_id: int, logprob: float) -> pb.TokenLogprob:
        text, raw = token_piece(tokenizer, token_id) if tokenizer is not None else ("", b"")
        return pb.TokenLogprob(token_id=token_id, token=text, token_bytes=raw, logprob=logprob)

    out = []
    for lp in logprobs:
        m = message(lp.token_id, lp.logprob)
        m.top_logprobs.extend(message(t, v) for t, v in lp.top)
        out.append(m)
    return out


def _cached_hashes(engine: Any) -> list[int]:
    return engine.block_manager.cached_hashes(MAX_REPORTED_HASHES)


def _noop() -> None:
    return None


def _spec_stats(spec: dict, enabled: bool) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        enabled=enabled,
        num_draft_tokens=spec.get("num_draft_tokens", 0),
        num_accepted_tokens=spec.get("num_accepted_tokens", 0),
        num_verify_steps=spec.get("num_verify_steps", 0),
        acceptance_rate=spec.get("acceptance_rate", 0.0),
        mean_accepted_length=spec.get("mean_accepted_length", 0.0),
        draft_time_s=spec.get("draft_time_s", 0.0),
        verify_time_s=spec.get("verify_time_s", 0.0),
    )
