"""Health per pool (deployments/health.py) through the ingress's Check and Watch and the HTTP
`/health`, over stand-in deployment handles (no Ray): each pool's status, a dead prefill or drafter
pool degrading the service but not taking it down, a dead decode pool taking it down, names the
application does not run, and one probe per pool shared by every caller within HEALTH_MAX_AGE_S.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2
from ray.serve.exceptions import ReplicaUnavailableError

import deployments.health as health_module
import deployments.ingress as ingress_module
from deployments.config import AppConfig
from deployments.errors import ClientError
from deployments.health import PoolHealth
from deployments.openai_api import build_http_app
from protos.specdecode.v1 import specdecode_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
ask = health_pb2.HealthCheckRequest


class Pool:
    """A deployment handle's shape: `pool.<method>.remote()` is awaitable. While `up` it answers;
    otherwise it hangs (a stuck replica) or, with `lost`, raises as a handle to a lost replica does."""

    def __init__(self, method: str, answer: object = True) -> None:
        self.up, self.lost, self.answer, self.calls = True, False, answer, 0
        setattr(self, method, self)

    def remote(self):
        self.calls += 1

        async def answer() -> object:
            if self.lost:
                raise ReplicaUnavailableError("replica-1")
            while not self.up:
                await asyncio.sleep(0.01)
            return self.answer
        return answer()


class Context:
    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        self.details = details


@pytest.fixture(autouse=True)
def fast_health(monkeypatch) -> None:
    monkeypatch.setattr(health_module, "HEALTH_TIMEOUT_S", 0.2)
    monkeypatch.setattr(health_module, "HEALTH_WATCH_INTERVAL_S", 0.05)
    monkeypatch.setattr(health_module, "HEALTH_MAX_AGE_S", 0.1)


def make_ingress(prefill: Pool | None = None, drafter: Pool | None = None):
    """The ingress's methods over stand-in handles, without Serve; its PoolHealth wired as
    `SpecDecodeIngress.__init__` wires it."""
    ingress = object.__new__(ingress_module.SpecDecodeIngress)
    ingress.engine, ingress.wait_s = Pool("model_info", pb.ModelInfo(model="m", replica_id="r1")), 30.0
    ingress.config = AppConfig.from_dict({})
    ingress.health = PoolHealth(lambda: ingress.model_info(health_module.HEALTH_TIMEOUT_S), prefill, drafter)
    return ingress


async def check(ingress, service: str) -> int:
    return (await ingress.Check(ask(service=service), Context())).status


async def http_health(ingress) -> tuple[int, dict]:
    """GET /health of the ingress's HTTP app (its route called directly: no HTTP client needed)."""
    route = next(r for r in build_http_app(ingress).routes if getattr(r, "path", None) == "/health")
    response = await route.endpoint()
    return response.status_code, json.loads(response.body)


def test_each_pool_answers_for_itself_and_the_decode_pool_for_the_service() -> None:
    prefill, drafter = Pool("model_info", pb.ModelInfo(model="m")), Pool("ping")
    ingress = make_ingress(prefill, drafter)

    async def main() -> None:
        for service in ("", "specdecode.v1.SpecDecode", "decode", "prefill", "drafter"):
            assert await check(ingress, service) == SERVING, service
        assert await http_health(ingress) == (200, {
            "status": "ok", "pools": {"decode": "ok", "prefill": "ok", "drafter": "ok"}, "degraded": [],
            "model": "m", "replica_id": "r1"})

        # a stuck prefill pool (no answer within HEALTH_TIMEOUT_S) and a lost drafter pool: the
        # service still serves (both have fallbacks), those pools do not
        prefill.up, drafter.lost = False, True
        await asyncio.sleep(0.15)  # the answers above have aged
        for service in ("", "specdecode.v1.SpecDecode", "decode"):
            assert await check(ingress, service) == SERVING, service
        assert await check(ingress, "prefill") == NOT_SERVING
        assert await check(ingress, "drafter") == NOT_SERVING
        status, body = await http_health(ingress)
        assert status == 200 and body["status"] == "degraded" and body["degraded"] == ["prefill", "drafter"]
        assert body["pools"] == {"decode": "ok", "prefill": "unavailable", "drafter": "unavailable"}

        # only the drafter pool back: still degraded, by the prefill pool alone
        drafter.lost = False
        await asyncio.sleep(0.15)
        assert await check(ingress, "drafter") == SERVING
        assert (await http_health(ingress))[1]["degraded"] == ["prefill"]

    asyncio.run(main())


def test_a_dead_decode_pool_takes_the_service_down() -> None:
    prefill, drafter = Pool("model_info", pb.ModelInfo(model="m")), Pool("ping")
    ingress = make_ingress(prefill, drafter)
    ingress.engine.up = False

    async def main() -> None:
        for service in ("", "specdecode.v1.SpecDecode", "decode"):
            assert await check(ingress, service) == NOT_SERVING, service
        assert await check(ingress, "prefill") == SERVING and await check(ingress, "drafter") == SERVING
        status, body = await http_health(ingress)
        assert status == 503 and body["status"] == "unavailable" and body["degraded"] == ["decode"]
        assert body["pools"] == {"decode": "unavailable", "prefill": "ok", "drafter": "ok"}
        # the error body every other 503 of the API has, saying why
        assert body["error"]["code"] == "UNAVAILABLE" and "decode replica answered within" in body["error"]["message"]
        assert "model" not in body

    asyncio.run(main())


def test_a_pool_the_application_does_not_run_is_not_found() -> None:
    """Co-located without a drafter pool: "decode" is served, "prefill" and "drafter" are not
    (Check: NOT_FOUND naming what is; Watch: SERVICE_UNKNOWN, as the protocol says)."""
    ingress = make_ingress()

    async def main() -> None:
        assert await check(ingress, "decode") == SERVING
        for service in ("prefill", "drafter", "nope.v1.Nope", "engine"):
            context = Context()
            with pytest.raises(ClientError) as e:
                await ingress.Check(ask(service=service), context)
            assert context.code == grpc.StatusCode.NOT_FOUND and e.value.code == grpc.StatusCode.NOT_FOUND
            assert repr(service) in context.details
            assert "ask for one of '', 'specdecode.v1.SpecDecode', 'decode' (" in context.details
            watch = ingress.Watch(ask(service=service), Context())
            assert (await anext(watch)).status == SERVICE_UNKNOWN
            await watch.aclose()
        assert await http_health(ingress) == (200, {
            "status": "ok", "pools": {"decode": "ok"}, "degraded": [], "model": "m", "replica_id": "r1"})

    asyncio.run(main())


def test_health_follows_whether_an_engine_replica_answers() -> None:
    """Check and Watch NOT_SERVING while no engine replica answers within HEALTH_TIMEOUT_S, SERVING
    once one does, Watch sending each change and only changes."""
    ingress = make_ingress()
    ingress.engine.up = False

    async def main() -> None:
        assert await check(ingress, "") == NOT_SERVING
        watch = ingress.Watch(ask(service="specdecode.v1.SpecDecode"), Context())
        assert (await anext(watch)).status == NOT_SERVING
        waiting = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.6)  # several checks, all NOT_SERVING: nothing sent
        assert not waiting.done()
        ingress.engine.up = True
        assert (await asyncio.wait_for(waiting, 5)).status == SERVING
        await watch.aclose()
        assert await check(ingress, "") == SERVING

    asyncio.run(main())


def test_every_caller_within_the_max_age_shares_one_probe_per_pool() -> None:
    """50 callers at once (watchers, probing load balancers, HTTP and gRPC) cost each pool one
    call; a caller cancelled does not cancel the probe the others wait for; an answer older than
    HEALTH_MAX_AGE_S is asked again."""
    prefill, drafter = Pool("model_info", pb.ModelInfo(model="m")), Pool("ping")
    ingress = make_ingress(prefill, drafter)
    pools = {"decode": ingress.engine, "prefill": prefill, "drafter": drafter}

    async def main() -> None:
        for pool in pools.values():
            pool.up = False  # the probes stay in flight while the callers arrive
        services = ("", "specdecode.v1.SpecDecode", "decode", "prefill", "drafter")
        callers = [asyncio.ensure_future(check(ingress, services[i % len(services)])) for i in range(40)]
        callers += [asyncio.ensure_future(http_health(ingress)) for _ in range(10)]
        await asyncio.sleep(0.05)
        callers[0].cancel()
        for pool in pools.values():
            pool.up = True
        answers = await asyncio.gather(*callers[1:])
        assert set(answers[:39]) == {SERVING} and all(a[1]["status"] == "ok" for a in answers[39:])
        assert {name: pool.calls for name, pool in pools.items()} == {"decode": 1, "prefill": 1, "drafter": 1}
        assert ingress.health.num_probes == {"decode": 1, "prefill": 1, "drafter": 1}
        await asyncio.gather(*(check(ingress, "prefill") for _ in range(10)))  # within the max age: shared
        assert prefill.calls == 1
        await asyncio.sleep(0.15)
        await asyncio.gather(*(check(ingress, "prefill") for _ in range(10)))
        assert prefill.calls == 2 and ingress.engine.calls == 1  # only the pool asked for is probed

    asyncio.run(main())
