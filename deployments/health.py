"""Health per pool: whether each pool of the application answers, and the answers the gRPC health
service (`grpc.health.v1.Health`, Check and Watch) and HTTP `GET /health` give from it.

Pools: "decode" is the engine deployment in both modes (co-located replicas prefill and decode;
disaggregated, it is the decode pool), "prefill" the prefill pool (mode: disaggregated) and
"drafter" the drafter pool (speculative.placement: remote); a pool the application does not run is
no name here. The service as a whole ("" or "specdecode.v1.SpecDecode") is SERVING while the
decode pool answers: without the prefill or drafter pool requests are still served (prefilled by
a decode replica, decoded without drafts), so those pools make it degraded, not down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

from deployments.common import HEALTH_TIMEOUT_S
from deployments.errors import ClientError

logger = logging.getLogger("ray.serve")

SERVICE_NAME = "specdecode.v1.SpecDecode"
WHOLE_SERVICE = ("", SERVICE_NAME)  # "": the server as a whole; both answer for the decode pool
DECODE, PREFILL, DRAFTER = "decode", "prefill", "drafter"
HEALTH_WATCH_INTERVAL_S = 5.0
HEALTH_MAX_AGE_S = 1.0  # a pool's answer this recent is shared, not asked again
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
# What a probe that got no answer raises: the ingress's refusal (decode), the deadline, a lost or
# failing replica, Serve's backpressure or a deployment with no replica.
PROBE_FAILURES = (ClientError, TimeoutError, RayError, RayServeException)

Probe = Callable[[], Awaitable[Any]]


@dataclass(frozen=True)
class PoolState:
    """One pool's answer: `answer` is what its probe returned (the decode pool's: a ModelInfo);
    `reason` says why it is not serving."""

    is_serving: bool
    answer: Any = None
    reason: str = ""


@dataclass(frozen=True)
class HealthReport:
    """Every pool's state, as `GET /health` tells it."""

    pools: dict[str, PoolState]

    @property
    def status(self) -> str:
        """"ok" when every pool answers, "degraded" when the decode pool does and another does
        not, "unavailable" when the decode pool does not."""
        if not self.pools[DECODE].is_serving:
            return "unavailable"
        return "ok" if all(p.is_serving for p in self.pools.values()) else "degraded"

    @property
    def degraded_pools(self) -> list[str]:
        return [name for name, p in self.pools.items() if not p.is_serving]

    def body(self) -> dict:
        """{"status", "pools": {name: "ok" | "unavailable"}, "degraded": [names]}, with the model
        and the replica that answered while the decode pool answers."""
        body: dict[str, Any] = {
            "status": self.status,
            "pools": {name: "ok" if p.is_serving else "unavailable" for name, p in self.pools.items()},
            "degraded": self.degraded_pools,
        }
        info = self.pools[DECODE].answer
        if info is not None:
            body |= {"model": info.model, "replica_id": info.replica_id}
        return body


class PoolHealth:
    """Probes each pool with a cheap call, shared: every caller asking within HEALTH_MAX_AGE_S of a
    pool's last answer (or while its probe runs) gets that answer, so many watchers or probing
    load balancers cost a pool one call a second at most, not one each. A probe is bounded by
    HEALTH_TIMEOUT_S, and a caller cancelled does not cancel the others' probe."""

    def __init__(self, decode: Probe, prefill_pool: Any = None, drafter_pool: Any = None) -> None:
        """`decode`: the ingress's ModelInfo call (it retries a lost replica on another); the pools'
        deployment handles, where the application runs them."""
        self.probes: dict[str, Probe] = {DECODE: decode}
        if prefill_pool is not None:
            self.probes[PREFILL] = prefill_pool.model_info.remote
        if drafter_pool is not None:
            self.probes[DRAFTER] = drafter_pool.ping.remote
        self._tasks: dict[str, asyncio.Future] = {}
        self._answered_at = dict.fromkeys(self.probes, 0.0)
        self.num_probes = dict.fromkeys(self.probes, 0)

    @property
    def services(self) -> tuple[str, ...]:
        """The names a health check may ask for."""
        return (*WHOLE_SERVICE, *self.probes)

    async def check(self, service: str) -> int:
        """SERVING or NOT_SERVING: `service`'s pool's state (the decode pool's for the whole
        service); ClientError(NOT_FOUND) naming what is served for a name not served here."""
        if service not in self.services:
            raise ClientError(grpc.StatusCode.NOT_FOUND, self._unknown(service))
        state = await self.pool(DECODE if service in WHOLE_SERVICE else service)
        return SERVING if state.is_serving else NOT_SERVING

    async def watch(self, service: str) -> AsyncIterator[int]:
        """The status now, then each change (checked every HEALTH_WATCH_INTERVAL_S) until the
        caller stops; SERVICE_UNKNOWN once for a name not served here, as the protocol says."""
        last = None
        while True:
            status = await self.check(service) if service in self.services else SERVICE_UNKNOWN
            if status != last:
                last = status
                yield status
            await asyncio.sleep(HEALTH_WATCH_INTERVAL_S)

    async def report(self) -> HealthReport:
        """Every pool's state (their probes run at once)."""
        states = await asyncio.gather(*(self.pool(name) for name in self.probes))
        return HealthReport(dict(zip(self.probes, states, strict=True)))

    async def pool(self, name: str) -> PoolState:
        """`name`'s state, from the probe every caller within HEALTH_MAX_AGE_S shares."""
        task = self._tasks.get(name)
        if task is None or (task.done() and time.monotonic() - self._answered_at[name] >= HEALTH_MAX_AGE_S):
            task = self._tasks[name] = asyncio.ensure_future(self._probe(name))
        return await asyncio.shield(task)  # a caller cancelled does not cancel the others' probe

    async def _probe(self, name: str) -> PoolState:
        self.num_probes[name] += 1
        try:
            answer = await asyncio.wait_for(_awaited(self.probes[name]), HEALTH_TIMEOUT_S)
        except PROBE_FAILURES as e:
            reason = e.details if isinstance(e, ClientError) else (
                f"no {name} replica answered within {HEALTH_TIMEOUT_S:g} s" if isinstance(e, TimeoutError)
                else f"the {name} pool failed the health probe ({type(e).__name__})")
            logger.warning("health: the %s pool is not serving: %s", name, reason)
            return PoolState(False, reason=reason)
        finally:
            self._answered_at[name] = time.monotonic()  # when this answer was had: it is shared until it ages
        return PoolState(True, answer)

    def _unknown(self, service: str) -> str:
        served = ", ".join(repr(s) for s in self.services)
        return f"service {service!r} is not served here; ask for one of {served} ('': the server as a whole)"


async def _awaited(probe: Probe) -> Any:
    return await probe()
