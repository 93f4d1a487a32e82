"""Engine-load request router: send each request to the replica whose engine is least loaded.

Replicas report their engine's load through Serve's `record_routing_stats` hook (queued prompt
tokens waiting for prefill, KV-cache use, running/waiting requests; `routing_stats` below), which
the controller pulls every `request_routing_stats_period_s` and broadcasts to every router. Those
figures lag by up to that period, so the score also counts the router's own up-to-date view of
in-flight requests per replica (Serve's queue-length cache, bumped on every send):

    score = ongoing / max_ongoing_requests + kv_weight * kv_usage + queued_tokens / queued_tokens_scale

Lowest score first; ties are broken at random. Configure with `request_router_config:
{request_router_class: deployments.router:EngineLoadRouter, request_router_kwargs: {...}}`. Like
the autoscaling policy, this module imports only the standard library and Ray (Serve pickles it).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
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


def routing_stats(engine_stats: Mapping[str, Any], now: float | None = None) -> dict[str, float]:
    """What a replica returns from `record_routing_stats`: its engine's load right now."""
    num_blocks = engine_stats.get("num_blocks") or 0
    return {
        STAT_QUEUED_TOKENS: float(engine_stats.get("queued_tokens", 0)),
        STAT_KV_USAGE: engine_stats.get("num_used_blocks", 0) / num_blocks if num_blocks else 0.0,
        STAT_NUM_RUNNING: float(engine_stats.get("num_running", 0)),
        STAT_NUM_WAITING: float(engine_stats.get("num_waiting", 0)),
        STAT_TIME: time.time() if now is None else now,
    }


class EngineLoadRouter(FIFOMixin, RequestRouter):
    """Ranks all candidate replicas by engine load (module docstring); Serve tries them in order
    and skips any whose `max_ongoing_requests` is reached."""

    # Defaults of `initialize_state` (Serve always calls it, with request_router_kwargs).
    queued_tokens_scale: float = 2048.0
    kv_weight: float = 1.0
    stats_stale_s: float = 30.0

    def initialize_state(
        self,
        queued_tokens_scale: float = 2048.0,
        kv_weight: float = 1.0,
        stats_stale_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        """`request_router_kwargs`: queued_tokens_scale is the prefill backlog (tokens) that weighs
        as much as a full batch; kv_weight scales KV-cache use (0..1); stats older than
        stats_stale_s are ignored (the replica is then judged by its in-flight count alone)."""
        if kwargs:
            raise ValueError(
                f"request_router_kwargs: unknown {sorted(kwargs)}; allowed: queued_tokens_scale, kv_weight, stats_stale_s"
            )
        if not queued_tokens_scale > 0:
            raise ValueError(f"request_router_kwargs.queued_tokens_scale: must be > 0, got {queued_tokens_scale}")
        if not kv_weight >= 0:
            raise ValueError(f"request_router_kwargs.kv_weight: must be >= 0, got {kv_weight}")
        if not stats_stale_s > 0:
            raise ValueError(f"request_router_kwargs.stats_stale_s: must be > 0, got {stats_stale_s}")
        self.queued_tokens_scale = float(queued_tokens_scale)
        self.kv_weight = float(kv_weight)
        self.stats_stale_s = float(stats_stale_s)

    def fresh_stats(self, replica: RunningReplica, now: float) -> Mapping[str, Any]:
        """The replica's routing stats, or {} if it has reported none recently."""
        stats = replica.routing_stats or {}
        measured = stats.get(STAT_TIME)
        if measured is None or now - measured > self.stats_stale_s:
            return {}
        return stats

    def load_score(self, replica: RunningReplica, now: float | None = None) -> float:
        """Lower is better; see the module docstring."""
        stats = self.fresh_stats(replica, time.time() if now is None else now)
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        if ongoing is None:
            ongoing = stats.get(STAT_NUM_RUNNING, 0.0) + stats.get(STAT_NUM_WAITING, 0.0)
        score = ongoing / max(1, replica.max_ongoing_requests)
        score += self.kv_weight * stats.get(STAT_KV_USAGE, 0.0)
        score += stats.get(STAT_QUEUED_TOKENS, 0.0) / self.queued_tokens_scale
        return score

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate, least loaded first, one per rank (so Serve takes the first that has
        room rather than re-sorting a rank by in-flight count)."""
        if pending_request is not None:
            # We always offer every replica, so there is no narrower first pass to retry without
            # waiting: when all are full, back off (Serve's retry loop would spin otherwise).
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        now = time.time()
        shuffled = list(candidate_replicas)
        random.shuffle(shuffled)
        ranked = sorted(shuffled, key=lambda r: self.load_score(r, now))
        return [[r] for r in ranked]
