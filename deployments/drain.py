"""An engine replica's graceful drain: once Serve starts removing the replica (a downscale, a
redeploy), its streams run on for the drain window; each one still running then ends with
`Handover` (deployments/common.py) and the ingress resumes it on another replica after the tokens
the client already has. Serve stops routing here as the removal starts; a request that still
arrives after the window is handed over before it runs. The window ends HANDOVER_MARGIN_S before
Serve's kill deadline (`graceful_shutdown_timeout_s`), so no stream is ever cut by the kill, and
the replica exits as soon as its last stream is finished or handed over.

Serve tells user code nothing when the drain begins (`__del__` runs only after it, once no
request is left): `serve_is_shutting_down` reads the flag Serve's replica sets then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger("ray.serve")

# Streams are handed over at least this long before Serve kills the replica: the Handover items
# need a moment to reach the ingress, and the drain loop to see that nothing is left.
HANDOVER_MARGIN_S = 2.0
POLL_S = 0.25  # how often a replica looks at Serve's shutdown flag


def serve_is_shutting_down() -> Callable[[], bool] | None:
    """A reader of the flag Serve 2.60's replica sets when its graceful shutdown begins
    (`Replica._shutting_down`, ray/serve/_private/replica.py, there for "replica subclass
    implementations"); None outside a Serve replica or where Ray no longer has it (then streams
    run until Serve kills the replica, and the ingress resumes them as lost)."""
    import ray

    try:
        worker = ray._private.worker.global_worker
        actor = worker.actors.get(worker.actor_id)
    except Exception:  # noqa: BLE001 - not in a Ray worker, or Ray keeps its actors elsewhere now
        return None
    replica = getattr(actor, "_replica_impl", None)
    if not isinstance(getattr(replica, "_shutting_down", None), bool):
        return None
    return lambda: replica._shutting_down


def serve_grace_s() -> float | None:
    """This replica's `graceful_shutdown_timeout_s` as Serve has it now (None outside a replica)."""
    from ray import serve

    try:
        return float(serve.get_replica_context()._deployment_config.graceful_shutdown_timeout_s)
    except Exception:  # noqa: BLE001 - outside a Serve replica (direct construction in tests)
        return None


def drain_window_s(drain_timeout_s: float, grace_s: float | None) -> float:
    """How long a draining replica lets its streams run: `drain_timeout_s`, cut so that the
    handover comes HANDOVER_MARGIN_S before Serve's kill (grace 30 s, margin 2 s: at most 28 s)."""
    if grace_s is None:
        return drain_timeout_s
    return max(0.0, min(drain_timeout_s, grace_s - HANDOVER_MARGIN_S))


class Drain:
    """The streams of one replica that can be handed over (engine request ids), and the watch
    on Serve's shutdown flag that hands them over when the window ends: `abort(request_id)`
    ends an engine request's stream (finish_reason "abort"), and its consumer, seeing
    `is_handed_over`, yields `Handover` instead of a last message."""

    def __init__(self, drain_timeout_s: float, abort: Callable[[str], None],
                 is_shutting_down: Callable[[], bool] | None = None,
                 grace_s: Callable[[], float | None] = serve_grace_s) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.abort = abort
        self.is_shutting_down = is_shutting_down
        self.grace_s = grace_s
        self.streams: set[str] = set()
        self.handed_over: set[str] = set()
        self.draining = False  # Serve is removing this replica: it takes no new stream
        self.num_handed_over = 0
        self._watch: asyncio.Task | None = None

    def watch(self) -> None:
        """Start watching Serve's flag (once, on the replica's event loop)."""
        if self._watch is None:
            if self.is_shutting_down is None:
                self.is_shutting_down = serve_is_shutting_down()
                if self.is_shutting_down is None:
                    logger.warning("drain: Serve's shutdown flag is not readable here; streams run until the "
                                   "replica is killed, and the ingress resumes them as lost")
                    self._watch = asyncio.get_running_loop().create_future()  # nothing to watch: never again
                    return
            self._watch = asyncio.ensure_future(self._run())

    def admit(self, request_id: str) -> bool:
        """Take a stream in; False once the drain has begun (a request Serve routed here just
        before it stopped routing here is handed over before it runs)."""
        if self.draining:
            self.num_handed_over += 1
            return False
        self.streams.add(request_id)
        return True

    def release(self, request_id: str) -> None:
        """The stream ended (finished, cancelled or handed over)."""
        self.streams.discard(request_id)
        self.handed_over.discard(request_id)

    def is_handed_over(self, request_id: str) -> bool:
        return request_id in self.handed_over

    def hand_over(self) -> int:
        """End every stream here now (each ends with `Handover`); later ones are refused."""
        self.draining = True
        streams = self.streams - self.handed_over
        for request_id in streams:
            self.handed_over.add(request_id)
            self.abort(request_id)
        self.num_handed_over += len(streams)
        return len(streams)

    async def _run(self) -> None:
        assert self.is_shutting_down is not None
        while not self.is_shutting_down():
            await asyncio.sleep(POLL_S)
        grace_s = self.grace_s()
        window_s = drain_window_s(self.drain_timeout_s, grace_s)
        logger.info("drain: Serve is removing this replica (graceful_shutdown_timeout_s %s); %d streams run on for "
                    "%.1f s, then go to another replica", grace_s, len(self.streams), window_s)
        self.draining = True
        await asyncio.sleep(window_s)
        num = self.hand_over()
        if num:
            logger.info("drain: %d streams handed over to other replicas", num)
