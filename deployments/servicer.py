"""The servicer function Serve's gRPC proxy registers `specdecode.v1.SpecDecode` with.

The proxy parses each request with the deserializer the servicer function registers, before any
code of ours runs: with the generated one, bytes that are not a valid message raise inside the
proxy and the client gets UNKNOWN. This function registers the same service and methods, with
deserializers that hand undecodable bytes on as a `MalformedRequest`, which the ingress answers
with INVALID_ARGUMENT. The proxy imports this module, so it is also where the proxy process gets
the logging filter that keeps client errors to one line (`deployments.errors`).

Client cancels: Serve 2.60's proxy cancels the request behind a stream only when the client's
cancel lands while the proxy awaits the next message. One that lands while gRPC writes a message
to the client is lost (measured: 2-3 of 20 cancels made right after a read): the request runs to
max_tokens and, when the abandoned handler is finalized, Serve logs "Request failed due to
unexpected error" (GeneratorExit). So each stream's handler runs in a task of its own, which the
RPC's end cancels; that task is then always awaiting the replica, the path on which Serve cancels
the request. Serve's code in that task may still touch the gRPC context after the RPC ended,
which crashes the process inside gRPC, so it gets a `_LiveContext`: the real context while the
RPC lives, a snapshot (reads) and no-ops (writes) after.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from deployments.errors import install_log_filter
from protos.specdecode.v1 import specdecode_pb2 as pb
from protos.specdecode.v1 import specdecode_pb2_grpc as pb_grpc

MAX_ERROR_CHARS = 200


@dataclass(frozen=True)
class MalformedRequest:
    """Request bytes that did not parse as `message_type`."""

    message_type: str
    num_bytes: int
    error: str

    def describe(self) -> str:
        return (f"request: {self.num_bytes} bytes that are not a valid {self.message_type} message "
                f"({self.error[:MAX_ERROR_CHARS]}); check that the client uses specdecode.v1's proto")


def lenient(message_cls):
    """A deserializer for `message_cls` that returns a MalformedRequest instead of raising."""
    name = message_cls.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError, TypeError) as e:
            return MalformedRequest(name, len(data), f"{type(e).__name__}: {e}")

    return parse


class _LenientServer:
    """Passes the generated handlers to `server` with lenient request deserializers."""

    def __init__(self, server, deserializers: dict) -> None:
        self.server = server
        self.deserializers = deserializers

    def _patch(self, handlers: dict) -> dict:
        return {name: h._replace(request_deserializer=self.deserializers[name]) if name in self.deserializers else h
                for name, h in handlers.items()}

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        import grpc

        patched = []
        for handler in generic_handlers:
            methods = getattr(handler, "_method_handlers", None)
            if methods is None:
                patched.append(handler)
                continue
            service = handler.service_name()
            short = {m.rsplit("/", 1)[-1]: h for m, h in methods.items()}
            patched.append(grpc.method_handlers_generic_handler(service, self._patch(short)))
        self.server.add_generic_rpc_handlers(tuple(patched))

    def add_registered_method_handlers(self, service_name: str, handlers: dict) -> None:
        add = getattr(self.server, "add_registered_method_handlers", None)
        if add is not None:
            add(service_name, self._patch(handlers))


class _LiveContext:
    """A gRPC servicer context that is safe to use after its RPC ended: until then every call goes
    to the real context; after, reads answer from a snapshot taken at the start and writes do
    nothing (there is no call left to write to)."""

    def __init__(self, context) -> None:
        self._context = context
        self._done = False
        self._peer = context.peer()
        self._metadata = context.invocation_metadata()
        context.add_done_callback(self._on_done)

    def _on_done(self, _context) -> None:
        self._done = True

    def peer(self):
        return self._peer

    def invocation_metadata(self):
        return self._metadata

    def __getattr__(self, name: str):
        if self._done:
            if name.startswith(("set_", "abort", "send_", "write")):
                return lambda *args, **kwargs: None
            if name in ("code", "details", "trailing_metadata", "time_remaining"):
                return lambda: None
            raise RuntimeError(f"gRPC context.{name}() after the RPC ended")
        return getattr(self._context, name)


_END = object()


def cancel_on_rpc_end(stream_handler):
    """Run a server-streaming handler in a task of its own, cancelled when the RPC ends (client
    cancel, deadline), whatever it is doing then; its messages reach gRPC through a queue."""

    async def unary_stream(request, context):
        live = _LiveContext(context)
        queue: asyncio.Queue = asyncio.Queue()

        async def feed() -> None:
            try:
                async for message in stream_handler(request, live):
                    queue.put_nowait(message)
            except BaseException as e:  # noqa: BLE001 - handed to the gRPC task below
                queue.put_nowait(e)
                if isinstance(e, asyncio.CancelledError):
                    raise
            else:
                queue.put_nowait(_END)

        task = asyncio.create_task(feed())
        context.add_done_callback(lambda _context: task.cancel())
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()

    return unary_stream


def _with_cancel_on_rpc_end(factory):
    """Serve's `service_handler_factory`, with its server-streaming handlers wrapped."""

    def make(service_method: str, streaming_type):
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        return cancel_on_rpc_end(handler) if getattr(streaming_type, "name", "") == "UNARY_STREAM" else handler

    return make


def _add_leniently(add, servicer, server, deserializers: dict) -> None:
    """Call a generated `add_*Servicer_to_server` with lenient deserializers and, on Serve's proxy
    server, streams whose client cancel always reaches the request."""
    install_log_filter(drop=True)  # the proxy: the ingress logs each client error once
    factory = getattr(server, "service_handler_factory", None)
    if factory is not None:
        server.service_handler_factory = _with_cancel_on_rpc_end(factory)
    try:
        add(servicer, _LenientServer(server, deserializers))
    finally:
        if factory is not None:
            server.service_handler_factory = factory


def add_SpecDecodeServicer_to_server(servicer, server) -> None:  # noqa: N802 - gRPC's naming
    """`specdecode_pb2_grpc.add_SpecDecodeServicer_to_server`, leniently (see `_add_leniently`)."""
    deserializers = {"Generate": lenient(pb.GenerateRequest), "GetModelInfo": lenient(pb.GetModelInfoRequest)}
    _add_leniently(pb_grpc.add_SpecDecodeServicer_to_server, servicer, server, deserializers)


def add_HealthServicer_to_server(servicer, server) -> None:  # noqa: N802 - gRPC's naming
    """The standard gRPC health service (`grpc.health.v1.Health`: Check and Watch), answered by the
    ingress (`SpecDecodeIngress.Check`/`Watch`) from whether an engine replica answers: what
    Kubernetes' `grpc` probes, grpc-health-probe, Envoy and cloud load balancers ask."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deserializers = {m: lenient(health_pb2.HealthCheckRequest) for m in ("Check", "Watch")}
    _add_leniently(health_pb2_grpc.add_HealthServicer_to_server, servicer, server, deserializers)
