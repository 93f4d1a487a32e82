"""Engine-load request router: send each request to the replica whose engine is least loaded,
preferring the replica whose prefix cache already holds the request's prompt.

Replicas report their engine's load through Serve's `record_routing_stats` hook (queued prompt
tokens waiting for prefill, KV-cache use, running/waiting requests, and the chain hashes of the
blocks their prefix cache holds; `routing_stats` below), which the controller pulls every
`request_routing_stats_period_s` and broadcasts to every router. Those figures lag by up to that
period, so the score also counts the router's own up-to-date view of in-flight requests per
replica (Serve's queue-length cache, bumped on every send), and the prompts it routed since:

    score = ongoing / max_ongoing_requests + kv_weight * kv_usage + queued_tokens / queued_tokens_scale
            + prefix_weight * uncached_tokens / queued_tokens_scale

where uncached_tokens are the request's prompt tokens outside the replica's prefix cache: a
prompt the replica holds is prefill work it need not do, counted in the same units as its
prefill backlog. The request names its prompt's block hashes in a `PrefixKey` (the ingress
computes it with the engine's hash, `engine.block_manager.prefix_block_hashes`). The preference
is bounded: a replica with more than `max_imbalance` requests in flight beyond the least busy
candidate gets no credit for its cache, so the turns of a busy conversation cannot pile up on
one replica.

Lowest score first; ties are broken at random. Configure with `request_router_config:
{request_router_class: deployments.router:EngineLoadRouter, request_router_kwargs: {...}}`. Like
the autoscaling policy, this module imports only the standard library and Ray (Serve pickles it).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

logger = logging.getLogger("ray.serve")

ROUTER_PATH = "deployments.router:EngineLoadRouter"

# Keys of the routing stats a replica reports (see `routing_stats`).
STAT_QUEUED_TOKENS = "queued_tokens"
STAT_KV_USAGE = "kv_usage"
STAT_NUM_RUNNING = "num_running"
STAT_NUM_WAITING = "num_waiting"
STAT_TIME = "time"  # time.time() when measured; older than stats_stale_s means unknown
STAT_BLOCK_SIZE = "block_size"  # tokens per KV block (the prefix hashes' unit)
STAT_PREFIX_HASHES = "prefix_hashes"  # chain hashes of the blocks the prefix cache holds
MAX_REPORTED_HASHES = 16384  # the most recently cached blocks a replica reports (~150 KB pickled)


@dataclass(frozen=True)
class PrefixKey:
    """A request's prompt as the router matches it against prefix caches: the chain hashes of its
    full blocks of `block_size` tokens, first block first."""

    block_size: int
    hashes: tuple[int, ...]


def routing_stats(
    engine_stats: Mapping[str, Any], now: float | None = None,
    prefix_hashes: Sequence[int] = (), block_size: int = 0,
) -> dict[str, Any]:
    """What a replica returns from `record_routing_stats`: its engine's load right now, and the
    blocks its prefix cache holds (`KVBlockManager.cached_hashes`)."""
    num_blocks = engine_stats.get("num_blocks") or 0
    return {
        STAT_QUEUED_TOKENS: float(engine_stats.get("queued_tokens", 0)),
        STAT_KV_USAGE: engine_stats.get("num_used_blocks", 0) / num_blocks if num_blocks else 0.0,
        STAT_NUM_RUNNING: float(engine_stats.get("num_running", 0)),
        STAT_NUM_WAITING: float(engine_stats.get("num_waiting", 0)),
        STAT_TIME: time.time() if now is None else now,
        STAT_BLOCK_SIZE: block_size,
        STAT_PREFIX_HASHES: list(prefix_hashes),
    }


def prefix_key(pending_request: Any) -> PrefixKey | None:
    """The `PrefixKey` a request carries (the `prefix_key` keyword argument), if any."""
    if pending_request is None:
        return None
    key = (pending_request.kwargs or {}).get("prefix_key")
    # By its fields, not its class: Serve may load this module by value, a class of its own.
    if isinstance(getattr(key, "hashes", None), tuple) and key.hashes and isinstance(key.block_size, int):
        return key
    return None


class EngineLoadRouter(FIFOMixin, RequestRouter):
    """Ranks all candidate replicas by engine load and prefix-cache reuse (module docstring);
    Serve tries them in order and skips any whose `max_ongoing_requests` is reached."""

    # Defaults of `initialize_state` (Serve always calls it, with request_router_kwargs).
    queued_tokens_scale: float = 2048.0
    kv_weight: float = 1.0
    stats_stale_s: float = 30.0
    prefix_weight: float = 1.0
    max_imbalance: int = 4
    routed_ttl_s: float = 10.0

    def initialize_state(
        self,
        queued_tokens_scale: float = 2048.0,
        kv_weight: float = 1.0,
        stats_stale_s: float = 30.0,
        prefix_weight: float = 1.0,
        max_imbalance: int = 4,
        routed_ttl_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        """`request_router_kwargs`: queued_tokens_scale is the prefill backlog (tokens) that weighs
        as much as a full batch; kv_weight scales KV-cache use (0..1); stats older than
        stats_stale_s are ignored (the replica is then judged by its in-flight count alone);
        prefix_weight scales the credit for prompt tokens a replica holds in its prefix cache (0:
        load only); a replica with more than max_imbalance requests in flight beyond the least
        busy candidate gets no such credit; a prompt this router sent to a replica counts as
        cached there for routed_ttl_s (until the replica's own report shows it)."""
        allowed = "queued_tokens_scale, kv_weight, stats_stale_s, prefix_weight, max_imbalance, routed_ttl_s"
        if kwargs:
            raise ValueError(f"request_router_kwargs: unknown {sorted(kwargs)}; allowed: {allowed}")
        if not queued_tokens_scale > 0:
            raise ValueError(f"request_router_kwargs.queued_tokens_scale: must be > 0, got {queued_tokens_scale}")
        if not kv_weight >= 0:
            raise ValueError(f"request_router_kwargs.kv_weight: must be >= 0, got {kv_weight}")
        if not stats_stale_s > 0:
            raise ValueError(f"request_router_kwargs.stats_stale_s: must be > 0, got {stats_stale_s}")
        if not prefix_weight >= 0:
            raise ValueError(f"request_router_kwargs.prefix_weight: must be >= 0, got {prefix_weight}")
        if not (isinstance(max_imbalance, int) and max_imbalance >= 0):
            raise ValueError(f"request_router_kwargs.max_imbalance: must be an integer >= 0, got {max_imbalance!r}")
        if not routed_ttl_s >= 0:
            raise ValueError(f"request_router_kwargs.routed_ttl_s: must be >= 0, got {routed_ttl_s}")
        self.queued_tokens_scale = float(queued_tokens_scale)
        self.kv_weight = float(kv_weight)
        self.stats_stale_s = float(stats_stale_s)
        self.prefix_weight = float(prefix_weight)
        self.max_imbalance = max_imbalance
        self.routed_ttl_s = float(routed_ttl_s)
        # per replica: (the report's time, its block size, its hashes as a set), built once a report
        self._reported: dict[Any, tuple[float, int, frozenset[int]]] = {}
        # per replica: hash -> when this router last sent a prompt with that block there
        self._routed: dict[Any, dict[int, float]] = {}

    def fresh_stats(self, replica: RunningReplica, now: float) -> Mapping[str, Any]:
        """The replica's routing stats, or {} if it has reported none recently."""
        stats = replica.routing_stats or {}
        measured = stats.get(STAT_TIME)
        if measured is None or now - measured > self.stats_stale_s:
            return {}
        return stats

    def ongoing(self, replica: RunningReplica, stats: Mapping[str, Any]) -> float:
        """Requests in flight on the replica: the router's own count, else the replica's report."""
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        if ongoing is None:
            ongoing = stats.get(STAT_NUM_RUNNING, 0.0) + stats.get(STAT_NUM_WAITING, 0.0)
        return ongoing

    def load_score(self, replica: RunningReplica, now: float | None = None) -> float:
        """The load part of the score (module docstring); lower is better."""
        stats = self.fresh_stats(replica, time.time() if now is None else now)
        score = self.ongoing(replica, stats) / max(1, replica.max_ongoing_requests)
        score += self.kv_weight * stats.get(STAT_KV_USAGE, 0.0)
        score += stats.get(STAT_QUEUED_TOKENS, 0.0) / self.queued_tokens_scale
        return score

    def cached_blocks(self, replica: RunningReplica, key: PrefixKey, now: float) -> int:
        """How many of the key's leading blocks the replica holds: in its last report, or sent
        there by this router within routed_ttl_s."""
        stats = self.fresh_stats(replica, now)
        reported: frozenset[int] = frozenset()
        if stats.get(STAT_BLOCK_SIZE) == key.block_size:
            measured = stats[STAT_TIME]
            seen = self._reported.get(replica.replica_id)
            if seen is None or seen[0] != measured:
                seen = (measured, key.block_size, frozenset(stats.get(STAT_PREFIX_HASHES, ())))
                self._reported[replica.replica_id] = seen
            reported = seen[2]
        routed = self._routed.get(replica.replica_id, {})
        n = 0
        for h in key.hashes:
            if h in reported or now - routed.get(h, -1e18) <= self.routed_ttl_s:
                n += 1
            else:
                break
        return n

    def scores(self, candidates: list[RunningReplica], key: PrefixKey | None, now: float) -> dict[Any, float]:
        """Each candidate's score (module docstring), by replica id."""
        scores = {r.replica_id: self.load_score(r, now) for r in candidates}
        if key is None or self.prefix_weight == 0:
            return scores
        ongoing = {r.replica_id: self.ongoing(r, self.fresh_stats(r, now)) for r in candidates}
        least = min(ongoing.values())
        for r in candidates:
            cached = self.cached_blocks(r, key, now) if ongoing[r.replica_id] <= least + self.max_imbalance else 0
            uncached = (len(key.hashes) - cached) * key.block_size
            scores[r.replica_id] += self.prefix_weight * uncached / self.queued_tokens_scale
        return scores

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate, best first, one per rank (so Serve takes the first that has room
        rather than re-sorting a rank by in-flight count)."""
        if pending_request is not None:
            # We always offer every replica, so there is no narrower first pass to retry without
            # waiting: when all are full, back off (Serve's retry loop would spin otherwise).
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        now = time.time()
        scores = self.scores(candidate_replicas, prefix_key(pending_request), now)
        shuffled = list(candidate_replicas)
        random.shuffle(shuffled)
        ranked = sorted(shuffled, key=lambda r: scores[r.replica_id])
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        """The replica will hold the request's prompt: count it as cached there until its report
        says so (the next few turns of a conversation can come before that report)."""
        key = prefix_key(pending_request)
        if key is None or self.prefix_weight == 0:
            return
        now = time.time()
        routed = self._routed.setdefault(replica_id, {})
        for h in key.hashes:
            routed[h] = now
        if len(routed) > 4 * MAX_REPORTED_HASHES:  # forget what has aged out
            self._routed[replica_id] = {h: at for h, at in routed.items() if now - at <= self.routed_ttl_s}

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._reported.pop(replica_id, None)
        self._routed.pop(replica_id, None)
