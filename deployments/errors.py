"""Client-facing errors of the gRPC service and how they are logged.

`ClientError` is a refusal with its gRPC status: the engine replica yields it (it never raises it,
so Ray Serve logs no traceback there) and the ingress raises it after setting the status code on
the gRPC context, which is the only way Serve's proxy sends a non-OK status. Serve then logs the
raised exception with a traceback twice (the ingress replica's "Request failed." and the proxy's
"Request failed with user-set gRPC status code"). `QuietClientErrors`, a logging filter on Serve's
logger, turns the ingress's record into one WARNING line (INFO for a client's cancel) and drops
the proxy's (its access log line already names the status). Tracebacks stay for every other
exception: those are faults of ours or of the cluster.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

SERVE_LOGGER = "ray.serve"
# Statuses that mean "the client asked for something this service will not do": one WARNING line.
CLIENT_STATUSES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
})


class ClientError(Exception):
    """A request the service refuses or cannot finish, with the status and details to send back.

    Both are kept as names and text (`code_name`), so the exception pickles across Ray."""

    def __init__(self, code: grpc.StatusCode | str, details: str) -> None:
        name = code.name if isinstance(code, grpc.StatusCode) else code
        super().__init__(name, details)
        self.code_name = name
        self.details = details

    @property
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode[self.code_name]

    def __str__(self) -> str:
        return f"{self.code_name}: {self.details}"


def _client_error_in(exc: BaseException | None) -> ClientError | None:
    """The ClientError behind `exc`: itself, Serve's gRPCStatusError wrapper of it, or a cause."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ClientError):
            return exc
        exc = getattr(exc, "original_exception", None) or exc.__cause__ or getattr(exc, "cause", None)
        seen += 1
    return None


class QuietClientErrors(logging.Filter):
    """Rewrite Serve's traceback records of client errors and cancels as one line each, or drop
    them (`drop=True`: the proxy, whose access log already has the status)."""

    def __init__(self, drop: bool = False) -> None:
        super().__init__()
        self.drop = drop

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        exc = record.exc_info[1]
        if isinstance(exc, asyncio.CancelledError):
            level, text = logging.INFO, "request cancelled by the client"
        else:
            err = _client_error_in(exc)
            if err is None or err.code not in CLIENT_STATUSES:
                return True
            level = logging.INFO if err.code == grpc.StatusCode.CANCELLED else logging.WARNING
            text = f"request refused: {err}"
        if self.drop:
            return False
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.msg, record.args = text, None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def install_log_filter(drop: bool = False) -> None:
    """Add `QuietClientErrors` to Serve's logger in this process (once)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, QuietClientErrors) for f in logger.filters):
        logger.addFilter(QuietClientErrors(drop))
