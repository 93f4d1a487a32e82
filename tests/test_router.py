"""The engine-load request router with fake replicas and their routing stats (no Ray running).

Replicas are `RunningReplica`s that report fixed `routing_stats` and answer queue-length probes from
a counter. Ranking is checked directly (`choose_replicas`) and through Serve's own routing loop
(`_choose_replica_for_request`: FIFO queue, probes, skipping full replicas, backoff).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest, RunningReplica

from deployments.router import EngineLoadRouter, PrefixKey, routing_stats
from engine.block_manager import prefix_block_hashes

DEPLOYMENT = DeploymentID(name="SpecDecode", app_name="specdecode")
MAX_ONGOING = 8


class FakeReplica(RunningReplica):
    """A replica as the router sees it: an id, routing stats, a capacity and a queue length."""

    def __init__(self, name: str, stats: dict[str, float] | None = None, queue_len: int = 0) -> None:
        self._id = ReplicaID(name, deployment_id=DEPLOYMENT)
        self.stats = stats
        self.queue_len = queue_len
        self.num_probes = 0

    @property
    def replica_id(self) -> ReplicaID:
        return self._id

    @property
    def routing_stats(self) -> dict[str, Any]:
        return self.stats or {}

    @property
    def max_ongoing_requests(self) -> int:
        return MAX_ONGOING

    @property
    def multiplexed_model_ids(self) -> set[str]:
        return set()

    @property
    def node_id(self) -> str:
        return "node"

    @property
    def availability_zone(self) -> str | None:
        return None

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.num_probes += 1
        return self.queue_len


def engine(
    queued_tokens: int = 0, kv: float = 0.0, running: int = 0, waiting: int = 0, age_s: float = 0.0,
    cached: list[int] = (), block_size: int = 16,
) -> dict:
    """Routing stats as a replica reports them (via deployments.router.routing_stats), its prefix
    cache holding the blocks hashed `cached`."""
    stats = {"num_running": running, "num_waiting": waiting, "queued_tokens": queued_tokens,
             "num_blocks": 1000, "num_used_blocks": int(kv * 1000)}
    return routing_stats(stats, now=time.time() - age_s, prefix_hashes=cached, block_size=block_size)


def make_router(**kwargs: Any) -> EngineLoadRouter:
    router = EngineLoadRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    return router


def pending(key: PrefixKey | None = None) -> PendingRequest:
    """A request to route (its future needs a running event loop), with its prompt's key."""
    kwargs = {} if key is None else {"prefix_key": key}
    return PendingRequest(args=[], kwargs=kwargs, metadata=RequestMetadata(request_id="r", internal_request_id="r"))


async def choose(
    router: EngineLoadRouter, replicas: list[FakeReplica], key: PrefixKey | None = None,
) -> tuple[list[list[RunningReplica]], PendingRequest]:
    request = pending(key)
    return await router.choose_replicas(replicas, request), request


def first_choice(router: EngineLoadRouter, replicas: list[FakeReplica], key: PrefixKey | None = None) -> str:
    ranks, _ = asyncio.run(choose(router, replicas, key))
    assert all(len(rank) == 1 for rank in ranks) and len(ranks) == len(replicas)
    return ranks[0][0].replica_id.unique_id


def test_routing_stats_are_what_the_replica_reports() -> None:
    stats = routing_stats({"num_running": 2, "num_waiting": 1, "queued_tokens": 300, "num_blocks": 200,
                           "num_used_blocks": 50, "spec": {}}, now=12.5)
    assert stats == {"queued_tokens": 300.0, "kv_usage": 0.25, "num_running": 2.0, "num_waiting": 1.0, "time": 12.5,
                     "block_size": 0, "prefix_hashes": []}
    stats = routing_stats({}, now=1.0, prefix_hashes=(7, 8), block_size=16)
    assert stats["prefix_hashes"] == [7, 8] and stats["block_size"] == 16


def test_prefers_fewer_queued_tokens_and_less_kv() -> None:
    router = make_router()
    busy = FakeReplica("busy", engine(queued_tokens=4096, running=2))
    idle = FakeReplica("idle", engine(queued_tokens=0, running=2))
    assert first_choice(router, [busy, idle]) == "idle"
    full_kv = FakeReplica("full-kv", engine(kv=0.9, running=2))
    light_kv = FakeReplica("light-kv", engine(kv=0.2, running=2))
    assert first_choice(router, [full_kv, light_kv]) == "light-kv"


def test_engine_load_outweighs_in_flight_count_alone() -> None:
    """Power-of-two would pick the replica with fewer requests in flight; this one sees that its
    engine has a long prompt backlog and a fuller KV cache."""
    router = make_router()
    few_but_heavy = FakeReplica("few-long-prompts", engine(queued_tokens=6000, kv=0.7, running=1, waiting=1))
    many_but_light = FakeReplica("many-short", engine(queued_tokens=0, kv=0.1, running=4))
    router.replica_queue_len_cache.update(few_but_heavy.replica_id, 2)
    router.replica_queue_len_cache.update(many_but_light.replica_id, 4)
    assert first_choice(router, [few_but_heavy, many_but_light]) == "many-short"
    # score = ongoing / 8 + kv + queued_tokens / 2048
    assert router.load_score(few_but_heavy) == pytest.approx(2 / 8 + 0.7 + 6000 / 2048)
    assert router.load_score(many_but_light) == pytest.approx(4 / 8 + 0.1)


def test_in_flight_count_comes_from_the_routers_own_view_when_fresher() -> None:
    """Stats lag by up to the stats period; the router's queue-length cache counts every send, so
    a burst spreads out instead of piling onto the replica that looked idle a second ago."""
    router = make_router()
    a, b = FakeReplica("a", engine()), FakeReplica("b", engine())
    router.replica_queue_len_cache.update(a.replica_id, 3)
    assert first_choice(router, [a, b]) == "b"
    assert router.load_score(b) == 0.0
    # Without a cached count, the replica's reported running + waiting stand in.
    c = FakeReplica("c", engine(running=4, waiting=2))
    assert router.load_score(c) == pytest.approx(6 / 8)


def test_stale_or_missing_stats_count_as_unknown() -> None:
    router = make_router(stats_stale_s=5.0)
    stale = FakeReplica("stale", engine(queued_tokens=50_000, kv=1.0, age_s=60.0))
    assert router.load_score(stale) == 0.0  # ignored: judged by in-flight requests alone
    new = FakeReplica("new", None)  # has not reported yet
    loaded = FakeReplica("loaded", engine(queued_tokens=1000))
    assert first_choice(router, [loaded, new]) == "new"


def test_ties_are_broken_at_random() -> None:
    router = make_router()
    replicas = [FakeReplica(name, engine(running=1)) for name in ("a", "b", "c")]
    firsts = Counter(first_choice(router, replicas) for _ in range(300))
    assert set(firsts) == {"a", "b", "c"}
    assert min(firsts.values()) > 50  # each ~100 of 300; P(some < 50) is below 1e-6


def test_asks_serve_to_back_off_and_handles_no_candidates() -> None:
    ranks, request = asyncio.run(choose(make_router(), []))
    assert ranks == []
    assert request.routing_context.should_backoff  # no narrower first pass to retry at once


def test_kwargs_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown"):
        make_router(queue_weight=1.0)
    with pytest.raises(ValueError, match="queued_tokens_scale: must be > 0, got 0"):
        make_router(queued_tokens_scale=0)
    with pytest.raises(ValueError, match="kv_weight"):
        make_router(kv_weight=-1)
    router = make_router(queued_tokens_scale=100.0, kv_weight=0.0)
    heavy = FakeReplica("heavy", engine(queued_tokens=300, kv=0.9))
    assert router.load_score(heavy) == pytest.approx(3.0)


def test_serves_routing_loop_takes_the_least_loaded_replica_with_room() -> None:
    """Through Serve's own machinery: the best-ranked replica is chosen unless it is full
    (max_ongoing_requests reached), then the next one."""

    async def route(replicas: list[FakeReplica]) -> str:
        router = make_router()
        router.update_replicas(replicas)
        chosen = await asyncio.wait_for(router._choose_replica_for_request(pending()), timeout=10)
        return chosen.replica_id.unique_id

    light = FakeReplica("light", engine(queued_tokens=0, kv=0.1))
    heavy = FakeReplica("heavy", engine(queued_tokens=8000, kv=0.8))
    assert asyncio.run(route([heavy, light])) == "light"
    full = FakeReplica("light-but-full", engine(queued_tokens=0, kv=0.1), queue_len=MAX_ONGOING)
    medium = FakeReplica("medium", engine(queued_tokens=2000, kv=0.3))
    assert asyncio.run(route([full, medium, heavy])) == "medium"


# --- prefix-aware routing -------------------------------------------------------------------------
PROMPT = list(range(1000, 1000 + 16 * 64 + 5))  # 64 full blocks a hit could cover
KEY = PrefixKey(16, tuple(prefix_block_hashes(PROMPT, 16)))


def test_prefers_the_replica_that_holds_the_prompt() -> None:
    router = make_router()
    holder = FakeReplica("holder", engine(running=2, cached=list(KEY.hashes)))
    other = FakeReplica("other", engine(running=2, cached=[]))
    assert all(first_choice(router, [other, holder], KEY) == "holder" for _ in range(20))
    # the longer cached prefix wins: half the prompt against a quarter of it
    half = FakeReplica("half", engine(running=2, cached=list(KEY.hashes[:32])))
    quarter = FakeReplica("quarter", engine(running=2, cached=list(KEY.hashes[:16])))
    assert all(first_choice(router, [quarter, half], KEY) == "half" for _ in range(20))
    # a block held out of order is no hit: the match is the leading run of blocks
    gap = FakeReplica("gap", engine(running=2, cached=list(KEY.hashes[1:])))
    assert router.cached_blocks(gap, KEY, time.time()) == 0
    # without a key, or with prefix_weight 0, the cache does not count: ties go either way
    assert {first_choice(router, [other, holder]) for _ in range(60)} == {"holder", "other"}
    load_only = make_router(prefix_weight=0.0)
    assert {first_choice(load_only, [other, holder], KEY) for _ in range(60)} == {"holder", "other"}


def test_the_cache_credit_is_weighed_against_load() -> None:
    """1,024 cached tokens weigh as half a full batch's prefill backlog (scale 2048): they beat a
    smaller backlog on the other replica, not a larger one."""
    router = make_router()
    holder = FakeReplica("holder", engine(queued_tokens=800, cached=list(KEY.hashes)))
    other = FakeReplica("other", engine(queued_tokens=0))
    assert first_choice(router, [other, holder], KEY) == "holder"
    swamped = FakeReplica("swamped", engine(queued_tokens=1400, cached=list(KEY.hashes)))
    assert first_choice(router, [other, swamped], KEY) == "other"


def test_imbalance_is_bounded() -> None:
    """A replica with more than max_imbalance requests in flight beyond the least busy gets no
    credit for its cache, however long the prompt."""
    long_prompt = list(range(16 * 1000 + 1))
    key = PrefixKey(16, tuple(prefix_block_hashes(long_prompt, 16)))  # 16k cached tokens: a huge credit
    router = make_router(max_imbalance=2)
    router.replica_queue_len_cache.update(ReplicaID("idle", deployment_id=DEPLOYMENT), 0)
    idle = FakeReplica("idle", engine())
    for in_flight, expected in ((2, "holder"), (3, "idle")):
        holder = FakeReplica("holder", engine(cached=list(key.hashes)))
        router.replica_queue_len_cache.update(holder.replica_id, in_flight)
        assert first_choice(router, [idle, holder], key) == expected, in_flight


def test_other_block_sizes_and_stale_reports_give_no_credit() -> None:
    router = make_router()
    other = FakeReplica("other", engine())  # as loaded as a replica with stale stats (unknown: 0)
    wrong_size = FakeReplica("wrong-size", engine(running=1, cached=list(KEY.hashes), block_size=32))
    assert router.cached_blocks(wrong_size, KEY, time.time()) == 0
    stale = FakeReplica("stale", engine(running=1, cached=list(KEY.hashes), age_s=120))
    assert router.cached_blocks(stale, KEY, time.time()) == 0
    assert {first_choice(router, [other, stale], KEY) for _ in range(60)} == {"other", "stale"}


def test_a_prompt_routed_counts_as_cached_there_until_reports_take_over() -> None:
    """The next turn of a conversation follows the first before the replica has reported it; the
    router forgets what it routed after routed_ttl_s."""
    router = make_router(routed_ttl_s=5.0)
    a = FakeReplica("a", engine(running=1))
    b = FakeReplica("b", engine(running=1))

    async def route_to_b() -> None:  # a PendingRequest needs a running event loop
        router.on_request_routed(pending(KEY), b.replica_id, None)

    asyncio.run(route_to_b())
    turn2 = PrefixKey(16, tuple(prefix_block_hashes(PROMPT + list(range(200)), 16)))
    assert all(first_choice(router, [a, b], turn2) == "b" for _ in range(20))
    routed = router._routed[b.replica_id]
    for h in routed:
        routed[h] -= 6.0  # routed 6 s ago
    assert router.cached_blocks(b, turn2, time.time()) == 0
    router.on_replica_actor_died(b.replica_id)
    assert b.replica_id not in router._routed


def test_new_kwargs_are_checked() -> None:
    for bad, match in (({"prefix_weight": -1}, "prefix_weight"), ({"max_imbalance": 1.5}, "max_imbalance"),
                       ({"routed_ttl_s": -1}, "routed_ttl_s")):
        with pytest.raises(ValueError, match=match):
            make_router(**bad)
