"""The ingress: the `specdecode.v1.SpecDecode` methods Serve's gRPC proxy calls and the OpenAI-style
HTTP API Serve's HTTP proxy calls (`deployments/openai_api.py`), in front of the engine replicas
(`deployments/replica.py`), which it calls through a deployment handle. Both protocols go through
`generate` and `model_info`: one path for validation, limits, retries, statuses and cancels.

Why a deployment of its own: Serve's proxy turns a replica that dies mid-stream into INTERNAL with
Ray's internals in the details, and waits without bound while no replica exists; neither can be
changed from a replica. The ingress owns the client's stream, so it can:
- retry a request whose replica was lost before any message reached the client, on another
  replica (up to MAX_ATTEMPTS), transparently;
- resume a stream whose replica was lost after messages went out, on another replica (up to
  MAX_RESUMPTIONS): it prefills the prompt and the tokens the client already has, and the
  stream goes on with no token repeated or missing (greedy output as if nothing happened);
- resume, the same way, a stream that a replica being removed (downscale, redeploy) hands over
  when its drain window ends (deployments/drain.py), on a budget of its own (MAX_HANDOVERS);
- answer UNAVAILABLE with a plain message when that fails too (the client has part of the
  output and must retry), or when no engine replica accepted the request within
  `replica_wait_timeout_s` (none running, or all full and Serve queued it);
- map refusals the engine replica yields (`ClientError`) and Serve's backpressure to their status.
It holds no model and reserves no CPU: it relays messages (`bench/bench_serve.py` measures the
hop's cost). Cancelling the client's stream cancels the engine request through the handle.

In disaggregated mode it also orchestrates, as Ray Serve LLM's prefill/decode proxy does: a decode
replica translates the request and places its prefill (deployments/placement.py, fed with what
the ingress knows of the prefill pool); a prompt placed in the pool is sent there, its first
message relayed, and its handoff given to the decode replica the router picks at that moment
(`resume`). A request waiting for the pool holds no decode replica's slot, so short prompts never
queue behind long ones there. A pool that fails a call is left alone for a while (backoff: long
prompts are prefilled by the decode replicas), and the request is prefilled by a decode replica
after the tokens already sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.grpc_util import RayServegRPCContext

from deployments import tracing as t
from deployments.common import (
    HEALTH_TIMEOUT_S,
    MAX_REQUEST_ID_CHARS,
    REPLICA_LOST,
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
from deployments.errors import ClientError, install_log_filter
from deployments.health import PoolHealth
from deployments.placement import PoolEstimate, PrefillPoolTracker
from deployments.prefix_key import PrefixKeys
from deployments.router import PrefixKey
from deployments.servicer import MalformedRequest
from engine.block_manager import prefix_block_hashes
from engine.config import CacheConfig
from protos.specdecode.v1 import specdecode_pb2 as pb

logger = logging.getLogger("ray.serve")

MAX_ATTEMPTS = 3  # a request that streamed nothing is tried on this many replicas at most
MAX_RESUMPTIONS = 2  # a stream whose replica is lost mid-stream goes on elsewhere at most this often
# A stream handed over by a replica being removed (deployments/drain.py) goes on elsewhere at most
# this often: a separate budget, so that a drain never uses up what a lost replica would need.
MAX_HANDOVERS = 8
RESUMED_LABELS_KEPT = 1024  # the labels of this many resumed streams are kept (`resumed_requests`)
RETRY_BACKOFF_S = 0.2  # before a retry, so Serve's router can learn that the replica is gone
# A resumption that finds every replica full waits for room this long (backing off up to
# FULL_BACKOFF_MAX_S between tries) before the stream ends with RESOURCE_EXHAUSTED: the client has
# part of its answer, and a pause costs it less than starting over.
RESUME_FULL_WAIT_S = 30.0
FULL_BACKOFF_MAX_S = 2.0
TRACE_KEYS = ("traceparent", "tracestate")
# After the prefill pool fails a call, long prompts are prefilled by the decode replicas for this
# long, doubled while calls keep failing (engine.backoff.Backoff): a stuck prefill replica would
# otherwise cost each long prompt replica_wait_timeout_s before its local prefill.
PREFILL_BACKOFF_FIRST_S = 5.0
PREFILL_BACKOFF_MAX_S = 60.0


@serve.ingress()  # the HTTP app comes from __serve_build_asgi_app__, built after __init__
class SpecDecodeIngress:
    def __init__(self, engine, config: AppConfig, prefill_pool=None, drafter_pool=None) -> None:
        from deployments.tracing import setup_tracing
        from engine.backoff import Backoff

        install_log_filter()
        self.engine = engine
        self.stream = engine.options(stream=True)
        self.wait_s = config.replica_wait_timeout_s
        self.config = config
        # mode: disaggregated: the prefill pool, what this ingress sent there, and its backoff
        self.prefill_pool = prefill_pool.options(stream=True) if prefill_pool is not None else None
        self.pool = PrefillPoolTracker()
        self.pool_backoff = Backoff(PREFILL_BACKOFF_FIRST_S, PREFILL_BACKOFF_MAX_S)
        self.pool_failures = 0
        self.prefix_keys = PrefixKeys(resolve_path(config.tokenizer or config.model), CacheConfig.block_size)
        self.prefix_keys.start_loading()
        self.tracing = setup_tracing(config.tracing, None) if prefill_pool is not None else None
        self.resumptions: dict[str, int] = {}  # streams resumed on another replica, by reason (resumption_counts)
        self.resumed_labels: deque[str] = deque(maxlen=RESUMED_LABELS_KEPT)  # of the last ones (resumed_requests)
        try:
            from deployments.metrics import IngressMetrics

            self.metrics: IngressMetrics | None = IngressMetrics()
        except Exception:  # noqa: BLE001 - outside a Serve replica (direct construction in tests)
            self.metrics = None
        self.health = PoolHealth(lambda: self.model_info(HEALTH_TIMEOUT_S), prefill_pool, drafter_pool)

    def __serve_build_asgi_app__(self):  # noqa: N807 - Serve's hook name
        """The OpenAI-compatible HTTP API (Serve's HTTP proxy), over `generate` and `model_info`."""
        from deployments.openai_api import build_http_app

        return build_http_app(self)

    # --- gRPC methods (Serve's gRPC proxy) ------------------------------------------------------
    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest | MalformedRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if isinstance(request, MalformedRequest):
                raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
            label = request.request_id or grpc_context.request_id() or uuid.uuid4().hex
            trace = [(k, v) for k, v in grpc_context.invocation_metadata() if k in TRACE_KEYS]
            async for message in self.generate(request, label, trace):
                yield message
        except ClientError as e:
            _set_status(grpc_context, e)
            raise

    async def GetModelInfo(  # noqa: N802 - gRPC method name
        self, request: pb.GetModelInfoRequest | MalformedRequest, grpc_context: RayServegRPCContext
    ) -> pb.ModelInfo:
        try:
            if isinstance(request, MalformedRequest):
                raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
            return await self.model_info()
        except ClientError as e:
            _set_status(grpc_context, e)
            raise

    # --- grpc.health.v1.Health (deployments.servicer.add_HealthServicer_to_server) --------------------
    async def Check(self, request, grpc_context: RayServegRPCContext):  # noqa: N802 - gRPC method name
        """SERVING or NOT_SERVING per pool or for the whole service (`deployments/health.py`; status
        OK: the health protocol's answer); NOT_FOUND for a service this server does not run."""
        try:
            if isinstance(request, MalformedRequest):
                raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
            return health_pb2.HealthCheckResponse(status=await self.health.check(request.service))
        except ClientError as e:
            _set_status(grpc_context, e)
            raise

    async def Watch(self, request, grpc_context: RayServegRPCContext):  # noqa: N802 - gRPC method name
        """The status now, then each change until the client hangs up (`PoolHealth.watch`)."""
        try:
            if isinstance(request, MalformedRequest):
                raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
            async for status in self.health.watch(request.service):
                yield health_pb2.HealthCheckResponse(status=status)
        except ClientError as e:
            _set_status(grpc_context, e)
            raise

    # --- the one path under both protocols --------------------------------------------------------
    async def generate(
        self, request: pb.GenerateRequest, label: str, trace: list[tuple[str, str]],
        messages: list[dict[str, str]] | None = None, route: str = "Generate",
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The response messages of one request from an engine replica (chat `messages` replace
        the prompt; `route` names the gRPC method or HTTP route for its trace); a refusal or
        failure raises `ClientError`. A replica lost before the first message is retried; one lost
        after is resumed on another with what the client was sent (`Resume`), and so is a stream
        that a replica being removed hands over (`Handover`) when its drain window ends."""
        if len(label) > MAX_REQUEST_ID_CHARS or not label.isprintable():
            control = "" if label.isprintable() else ", with a control character"
            raise ClientError(grpc.StatusCode.INVALID_ARGUMENT, (
                f"request_id: {len(label)} characters{control}; give at most {MAX_REQUEST_ID_CHARS} printable "
                "characters (a label for logs and traces)"))
        sent = _Sent()
        resume: Resume | None = None
        key = await self.prefix_keys.key(request, messages)  # where the prompt is cached (routing)
        resumable = not (request.HasField("n") and request.n > 1) and not (request.HasField("best_of")
                                                                          and request.best_of > 1)
        resumptions = handovers = full_tries = 0
        full_since: float | None = None  # when this resumption was first refused for want of room
        while True:
            try:
                async for message in self._attempt(request, label, trace, messages, route, resume, sent, key):
                    sent.add(message)
                    yield message
                return
            except ClientError as e:
                if resume is not None and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    now = time.monotonic()
                    full_since = now if full_since is None else full_since
                    if now - full_since < RESUME_FULL_WAIT_S:
                        full_tries += 1
                        await asyncio.sleep(min(FULL_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** min(full_tries, 8)))
                        continue
                    raise ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                        f"no replica had room to go on with this request for {RESUME_FULL_WAIT_S:g} s after "
                        f"{sent.num_messages} messages ({e.details}); the output is incomplete: retry the whole "
                        "request later")) from None
                if resume is None or e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                raise ClientError(grpc.StatusCode.UNAVAILABLE, (
                    f"the replica serving this request stopped after {sent.num_messages} messages and no other "
                    f"took it over ({e.details}); the output is incomplete: retry the whole request")) from None
            except _LostMidStream as lost:
                if not resumable or resumptions == MAX_RESUMPTIONS:
                    raise _replica_lost(label, sent.num_messages, lost.attempts, lost.error) from None
                resumptions += 1
                reason, backoff_s = lost.where, RETRY_BACKOFF_S
                logger.warning("request %r: %s replica lost after %d tokens (%s); resuming on another replica "
                               "(resumption %d of %d)", label, lost.where, len(sent.token_ids),
                               type(lost.error).__name__, resumptions, MAX_RESUMPTIONS)
            except _HandedOver as handed:
                if handovers == MAX_HANDOVERS:
                    raise ClientError(grpc.StatusCode.UNAVAILABLE, (
                        f"the request was handed over {handovers} times by replicas being removed; the output is "
                        "incomplete: retry the whole request")) from None
                handovers += 1
                # Serve stopped routing to that replica when its drain began, so a stream that ran
                # there goes on at once; one it refused on arrival waits for the router to learn.
                reason, backoff_s = "drain", 0.0 if handed.num_sent else RETRY_BACKOFF_S
                logger.info("request %r: handed over by a replica being removed after %d tokens; resuming on "
                            "another replica (handover %d of %d)", label, len(sent.token_ids), handovers,
                            MAX_HANDOVERS)
            self.resumptions[reason] = self.resumptions.get(reason, 0) + 1
            self.resumed_labels.append(label)
            if self.metrics is not None:
                self.metrics.resumed(reason)
            if sent.num_messages or resume is not None:
                resume = Resume(list(sent.token_ids), sent.num_chars, reason, resumptions + handovers)
            full_since, full_tries = None, 0
            await asyncio.sleep(backoff_s)

    async def _attempt(
        self, request: pb.GenerateRequest, label: str, trace: list[tuple[str, str]],
        messages: list[dict[str, str]] | None, route: str, resume: Resume | None, sent: _Sent,
        key: PrefixKey | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One go at the request (or at its rest, after `resume`): a replica lost before this go
        sent anything is retried on another; one lost after raises _LostMidStream."""
        num_sent = 0
        elsewhere = None
        pool = self.pool_estimate() if resume is None else None  # a resumption is prefilled where it lands
        for attempt in range(1, MAX_ATTEMPTS + 1):
            response = self.stream.generate.remote(request, label, trace, messages, route, pool, resume,
                                                   prefix_key=key)
            try:
                async for message in self._relay(response):
                    if isinstance(message, PrefillElsewhere):
                        elsewhere = message
                        break
                    if isinstance(message, Handover):
                        raise _HandedOver(num_sent)
                    num_sent += 1
                    yield message
                break
            except REPLICA_LOST as e:
                if num_sent:
                    raise _LostMidStream(e, attempt, "engine") from None
                if attempt == MAX_ATTEMPTS:
                    raise _replica_lost(label, sent.num_messages, attempt, e) from None
                logger.warning("request %r: replica lost before its first message (%s); retrying "
                               "on another replica (attempt %d of %d)", label, type(e).__name__,
                               attempt + 1, MAX_ATTEMPTS)
                await asyncio.sleep(RETRY_BACKOFF_S * attempt)
        if elsewhere is not None:
            async for message in self._prefill_elsewhere(elsewhere, label, trace, route):
                yield message

    # --- disaggregated mode -------------------------------------------------------------------
    def pool_estimate(self) -> PoolEstimate | None:
        """What a decode replica is told of the prefill pool (None: there is none)."""
        if self.prefill_pool is None:
            return None
        return self.pool.estimate(backing_off=self.pool_backoff.active())

    async def resumed_requests(self) -> list[str]:
        """The request ids (labels) of the last RESUMED_LABELS_KEPT streams resumed, oldest first,
        once per resumption (`python -m loadtest.chaos --kill` tells resumed streams apart)."""
        return list(self.resumed_labels)

    async def resumption_counts(self) -> dict[str, int]:
        """Streams this ingress resumed on another replica, by reason: "engine" (their replica was
        lost mid-stream), "drain" (handed over by a replica being removed)."""
        return dict(self.resumptions)

    async def prefix_routing_ready(self) -> bool:
        """Whether requests carry their prompt's `PrefixKey` yet (the tokenizer has loaded)."""
        return self.prefix_keys.ready

    async def pool_stats(self) -> dict:
        """The prefill pool as this ingress sees it: prompts (and their tokens) sent there without
        a first token yet, its measured rate, calls that failed, whether it is backed off."""
        estimate = self.pool.estimate(backing_off=self.pool_backoff.active())
        return {"inflight_prefills": self.pool.num_pending, "queued_tokens": estimate.queued_tokens,
                "tokens_per_s": estimate.tokens_per_s, "num_replicas": estimate.num_replicas,
                "failures": self.pool_failures, "backing_off": estimate.backing_off}

    async def _prefill_elsewhere(
        self, elsewhere: PrefillElsewhere, label: str, trace: list[tuple[str, str]], route: str,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """A request a decode replica placed in the prefill pool: the pool's first message(s),
        then the rest from a decode replica's `resume` with the handoff (or every message from the
        prefill replica, when it decodes the request itself); a pool that fails (lost, refused,
        stuck) leaves it to a decode replica's local prefill after what was sent. Several
        completions: the pool prefills the first (`completion_params`), with index 0; when they
        are ranked (best_of > n) its messages are held for the decode replica's ranking."""
        span = None
        if self.tracing is not None:  # one span over prefill pool, handoff and decode
            parent = self.tracing.parent_context(_Metadata(trace))
            attributes = t.grpc_span_attributes(route, "", elsewhere.params, elsewhere.speculating, label)
            attributes.update(t.placement_attributes(elsewhere.placement))
            attributes[t.ATTR_NUM_PROMPT_TOKENS] = len(elsewhere.prompt)
            span = self.tracing.start_disaggregated(parent, attributes)
            trace = self.tracing.metadata(span)
        key = PrefixKey(CacheConfig.block_size, tuple(prefix_block_hashes(elsewhere.prompt, CacheConfig.block_size)))
        n, best_of = elsewhere.num_completions
        params = completion_params(elsewhere.params, 0, best_of > n) if best_of > 1 else elsewhere.params
        prefill_call = self.prefill_pool.prefill.remote(elsewhere.prompt, params, label, trace, prefix_key=key,
                                                        tools=elsewhere.tools, may_decode=best_of == 1)
        ticket = self.pool.sent(elsewhere.uncached_tokens)
        sent = _Sent()
        held: list[pb.GenerateResponse] = []  # the first completion's, for the ranking (best_of > n)
        finished = False
        result: PrefillResult | None = None
        try:
            try:
                async for item in self._pool_messages(prefill_call, label):
                    if isinstance(item, PrefillResult):
                        result = item
                        self.pool.report(item.replica_id, item.prefill_tokens_per_s)
                        break
                    if isinstance(item, Prefilled):  # the prefill replica decodes it too
                        if span is not None:
                            span.set_attribute(t.ATTR_PREFILLED, item.where)
                        continue
                    self.pool.done(ticket)  # its prompt no longer waits in the pool
                    if best_of > 1:
                        item.index = 0
                    if best_of > n:
                        held.append(item)
                    else:
                        yield item
                    sent.add(item)
                    if item.finish_reason:  # it finished (on its first token, or decoded there)
                        if best_of == 1:
                            return
                        finished = True
                        break
            finally:
                self.pool.done(ticket)
            async for item in self._resume(elsewhere, label, trace, result, sent, prefill_call, span, held, finished):
                yield item
        finally:
            prefill_call.cancel()  # its replica drops its reference to the handoff
            if result is not None:
                result.handoff.clear()
            if span is not None:
                span.end()

    async def _pool_messages(self, call, label: str) -> AsyncIterator[pb.GenerateResponse | PrefillResult]:
        """The prefill pool's messages; nothing more when its replica is lost, stuck or refuses
        (the pool is then backed off); a refusal of the request itself is raised."""
        try:
            first = await asyncio.wait_for(call.__anext__(), self.wait_s)
            self.pool_backoff.succeeded()  # the pool answered (a refusal of the request included)
            if isinstance(first, ClientError):
                if first.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise first
                return
            async for item in call:
                if isinstance(item, ClientError):
                    if item.code == grpc.StatusCode.INVALID_ARGUMENT:
                        raise item
                    return
                yield item
        except (TimeoutError, StopAsyncIteration, *REPLICA_LOST) as e:
            self.pool_failures += 1
            wait = self.pool_backoff.failed()
            logger.warning("request %r: prefill pool failed (%s); long prompts are prefilled by the decode "
                           "replicas for %.0f s", label, type(e).__name__, wait)

    async def _resume(
        self, elsewhere: PrefillElsewhere, label: str, trace: list[tuple[str, str]], result: PrefillResult | None,
        sent: _Sent, prefill_call, span, held: list[pb.GenerateResponse], first_finished: bool,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's messages after `sent` from a decode replica (picked now, by load and KV
        room), retried on another while that replica sent nothing (the handoff stays readable
        until the prefill call closes)."""
        num_sent = 0
        for attempt in range(1, MAX_ATTEMPTS + 1):
            response = self.stream.resume.remote(elsewhere.prompt, elsewhere.params, label, trace, result,
                                                 sent.token_ids, elsewhere.speculating, tools=elsewhere.tools,
                                                 num_sent_chars=sent.num_chars,
                                                 num_completions=elsewhere.num_completions, held=held,
                                                 first_finished=first_finished)
            try:
                async for item in self._relay(response):
                    if isinstance(item, HandoffRead):
                        prefill_call.cancel()  # the decode replica has it (or it is lost)
                        if result is not None:
                            result.handoff.clear()  # nor does this ingress hold it any longer
                        continue
                    if isinstance(item, Prefilled):
                        if span is not None:
                            span.set_attribute(t.ATTR_PREFILLED, item.where)
                        continue
                    if isinstance(item, Handover):
                        raise _HandedOver(num_sent)
                    num_sent += 1
                    yield item
                return
            except REPLICA_LOST as e:
                if num_sent or attempt == MAX_ATTEMPTS:
                    raise _LostMidStream(e, attempt, "engine") from None
                logger.warning("request %r: decode replica lost before resuming (%s); retrying (attempt %d of %d)",
                               label, type(e).__name__, attempt + 1, MAX_ATTEMPTS)
                await asyncio.sleep(RETRY_BACKOFF_S * attempt)

    async def model_info(self, wait_s: float | None = None) -> pb.ModelInfo:
        """An engine replica's ModelInfo (retried on another replica when one is lost);
        ClientError(UNAVAILABLE) when none answers within `wait_s` (default: the wait bound)."""
        wait_s = self.wait_s if wait_s is None else wait_s
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return await asyncio.wait_for(self.engine.model_info.remote(), wait_s)
            except TimeoutError:
                raise ClientError(grpc.StatusCode.UNAVAILABLE,
                                  f"no engine replica answered within {wait_s:g} s; retry later") from None
            except REPLICA_LOST as e:
                if attempt == MAX_ATTEMPTS:
                    raise _replica_lost("GetModelInfo", 0, attempt, e) from None
                await asyncio.sleep(RETRY_BACKOFF_S * attempt)
        raise AssertionError("unreachable")

    async def _relay(self, response) -> AsyncIterator[pb.GenerateResponse]:
        """The engine replica's messages: the first item (Accepted or a refusal) within the wait
        bound, then every message until the last; a yielded ClientError is raised."""
        finished = False
        try:
            try:
                first = await asyncio.wait_for(response.__anext__(), self.wait_s)
            except TimeoutError:
                raise ClientError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no engine replica accepted the request within {self.wait_s:g} s (none is running, or all "
                    "are full); retry later",
                ) from None
            except BackPressureError as e:
                raise ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the service is full: {e.message}; retry later") from None
            if isinstance(first, ClientError):
                finished = True
                raise first
            assert isinstance(first, Accepted), f"unexpected first item {first!r}"
            async for item in response:
                if isinstance(item, ClientError):
                    finished = True
                    raise item
                yield item
            finished = True
        finally:
            if not finished:
                response.cancel()


class _Sent:
    """What a client's stream has been sent so far (for a resumption)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.num_chars = 0
        self.num_messages = 0

    def add(self, message: pb.GenerateResponse) -> None:
        self.token_ids.extend(message.token_ids)
        self.num_chars += len(message.text)
        self.num_messages += 1


class _LostMidStream(Exception):
    """The replica serving a stream was lost after the stream got messages from it."""

    def __init__(self, error: BaseException, attempts: int, where: str) -> None:
        super().__init__(str(error))
        self.error, self.attempts, self.where = error, attempts, where


class _HandedOver(Exception):
    """The replica serving a stream is being removed and gave the stream up (`Handover`) after
    `num_sent` messages of this go."""

    def __init__(self, num_sent: int) -> None:
        super().__init__(f"handed over after {num_sent} messages")
        self.num_sent = num_sent


class _Metadata:
    """Trace headers shaped like the gRPC context `RequestTracer.parent_context` reads."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = pairs

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.pairs


def _replica_lost(label: str, num_sent: int, attempts: int, e: BaseException) -> ClientError:
    logger.warning("request %r: replica lost after %d messages, attempt %d (%s)", label, num_sent, attempts,
                   type(e).__name__)
    if num_sent:
        details = (f"the replica serving this request stopped after {num_sent} messages; the output is "
                   "incomplete: retry the whole request")
    else:
        details = f"the request's replica stopped {attempts} times before answering; retry later"
    return ClientError(grpc.StatusCode.UNAVAILABLE, details)


def _set_status(grpc_context: RayServegRPCContext, e: ClientError) -> None:
    grpc_context.set_code(e.code)
    grpc_context.set_details(e.details)
