"""The drafter pool (`speculative.placement: remote`): `SpecDrafter`, draft-model replicas shared
by the engine replicas, and the client an engine replica drafts through.

Each `SpecDrafterServer` wraps one `engine.spec_decode.remote.DraftService`. Its `draft` method is a
Serve batch method: the calls of several engine replicas that arrive together become one round of
the draft model. The draft model runs in one worker thread, so the replica's event loop keeps
taking calls; between calls (nothing waiting) the same thread drafts ahead for the sessions the
last answers left an assumption for.

`ServeDrafterClient` is what an engine replica's `RemoteDrafterProposer` calls from the engine
thread: one handle call per step, waited on for at most `drafter_pool.timeout_s`. Its handle
carries the engine replica's id as the Serve session id, and the pool routes with Ray's
`ConsistentHashRouter`, so each engine replica's calls go to the same pool replica (whose
sessions hold that replica's requests) while it lives; when it is gone the ring moves them to
another, which answers `unknown` once and is sent the whole context.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from deployments.common import apply_overrides, replica_resources
from deployments.config import AppConfig, default_torch_threads, resolve_path

logger = logging.getLogger("ray.serve")

# Ray's consistent-hash router over the Serve session id (ray/serve/experimental/)
AFFINITY_ROUTER = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"


class SpecDrafterServer:
    """One drafter-pool replica: the draft model and its sessions (module docstring)."""

    def __init__(self, config: AppConfig) -> None:
        from engine.spec_decode.remote import DraftService

        pool = config.drafter_pool
        threads = pool.torch_threads or default_torch_threads(pool.num_cpus)
        self.service = DraftService(
            resolve_path(config.speculative.model), device=config.device, dtype=config.dtype,
            max_model_len=config.max_model_len, kv_cache_memory_bytes=pool.kv_cache_memory_bytes,
            draft_ahead=pool.draft_ahead, session_ttl_s=pool.session_ttl_s, num_threads=threads,
        )
        self.draft.set_max_batch_size(pool.max_batch_size)
        self.draft.set_batch_wait_timeout_s(pool.batch_wait_timeout_s)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")
        self.waiting = 0  # draft calls waiting for the worker: drafting ahead yields to them
        self.batches = 0  # DraftBatches received (one per engine replica and step)
        self.rounds = 0  # rounds run: one per `draft` batch, however many DraftBatches it merged
        self.metrics = self._start_metrics()
        logger.info("SpecDrafter replica ready: %s on %s, %d torch threads, draft_ahead %s",
                    config.speculative.model, self.service.device, threads, pool.draft_ahead)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.0)
    async def draft(self, batches: list[Any]) -> list[Any]:
        """One round for the `DraftBatch`es of every engine replica that called meanwhile."""
        return await self.merged_round(batches)

    async def merged_round(self, batches: list[Any]) -> list[Any]:
        """The `DraftBatch`es of several engine replicas drafted in one round of the model (on
        the worker thread); each engine replica's answer."""
        from engine.spec_decode.remote import DraftBatch, DraftBatchReply

        merged = DraftBatch(tuple(c for b in batches for c in b.calls), tuple(n for b in batches for n in b.closed))
        self.batches += len(batches)
        self.rounds += 1
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            answer = await loop.run_in_executor(self.worker, self._timed_round, merged)
        finally:
            self.waiting -= 1
        if self.service.draft_ahead:
            loop.run_in_executor(self.worker, self._draft_ahead)
        out, i = [], 0
        for b in batches:
            out.append(DraftBatchReply(answer.replies[i : i + len(b.calls)], answer.identity, answer.vocab_size))
            i += len(b.calls)
        return out

    def _timed_round(self, batch: Any) -> Any:
        start = time.perf_counter()
        answer = self.service.draft(batch)
        self.metrics.observe_round(time.perf_counter() - start)
        return answer

    def _start_metrics(self) -> Any:
        """This replica's Prometheus metrics (deployments.metrics.POOL_METRICS), flushed from
        `_stats()` every 2 s."""
        from deployments.metrics import DrafterPoolMetrics

        return DrafterPoolMetrics().start(self._stats)

    def _stats(self) -> dict:
        return {"batches": self.batches, "rounds": self.rounds, **self.service.stats()}

    def _draft_ahead(self) -> None:
        if self.waiting == 0:  # a call that waits for the worker goes first
            self.service.draft_ahead_round()

    async def stats(self) -> dict:
        """Counts of this replica's calls, drafts, drafts made ahead and used, `unknown` answers,
        evictions, sessions, blocks; `batches` (DraftBatches received) and `rounds` (rounds run:
        fewer than `batches` when calls of several engine replicas were merged); `replica`: its id."""
        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica (direct construction)
            replica = ""
        return {"replica": replica, **self._stats()}

    async def ping(self) -> bool:
        """True while this replica's event loop runs: the ingress's health probe of the pool
        (`stats` would wait for a draft round to release the service's lock)."""
        return True

    def __del__(self) -> None:
        if getattr(self, "metrics", None) is not None:
            self.metrics.shutdown()
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown(wait=False, cancel_futures=True)


class ServeDrafterClient:
    """An engine replica's client of the drafter pool (module docstring). `draft` blocks the
    calling thread (the engine's), never an event loop."""

    def __init__(self, handle: Any, session_id: str, timeout_s: float) -> None:
        self.handle = handle.options(session_id=session_id)
        self.timeout_s = timeout_s

    def draft(self, batch: Any) -> Any:
        response = self.handle.draft.remote(batch)
        try:
            return response.result(timeout_s=self.timeout_s)
        except TimeoutError:
            response.cancel()  # the step went on without these drafts: the pool need not make them
            raise


def drafter_options(config: AppConfig, overrides: dict | None = None) -> dict:
    """Serve options for the drafter pool: `drafter_pool.num_cpus` CPUs (one GPU where the
    engine replicas take GPUs), sticky routing by engine replica, then the config file's
    `deployments:` overrides (num_replicas, autoscaling_config, ...)."""
    resources = replica_resources(config)
    if "num_gpus" not in resources:
        resources = {"num_cpus": config.drafter_pool.num_cpus}
    options: dict[str, Any] = {
        "ray_actor_options": resources,
        "max_ongoing_requests": 256,  # one call per engine replica and step: the pool batches them
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 10,
        "request_router_config": {"request_router_class": AFFINITY_ROUTER},
    }
    return apply_overrides(options, overrides)
