"""Where a disaggregated request's prompt is prefilled: in the prefill pool or by the decode
replica itself, decided per request from predicted time to first token (as DistServe, Splitwise
and Dynamo's conditional disaggregation decide it).

    remote TTFT = (prompt tokens the pool still has to prefill + this prompt) / the pool's rate
    local TTFT  = (prompt tokens queued on the decode replica + this prompt) / its rate now

"Still has to prefill": the prompts sent there without a first token yet, less what the pool has
done of those it is working on (each of the oldest, one per replica, at its replica's share of
the rate since it reached the pool or the pool's last first token, whichever came later).

The pool's rate is the sum of its replicas' measured prefill rates (each replica reports its
engine's fitted rate with every prefill it finishes); the decode replica's rate is its own
engine's, cut to what stall-free chunking leaves for prefill while streams decode (each step
holds at most the tokens that keep it within the TPOT budget). The first token of a remote prefill
comes from the prefill replica, so the handoff is not part of its TTFT.

Decision, for a prompt with at least `min_prompt_tokens` uncached tokens (shorter ones and prefix
-cache hits are prefilled locally: a handoff costs more than they do):
- the pool failed a call recently (backoff): local;
- the decode replica is past its own capacity (its streams' tokens alone fill a step of the TPOT
  budget, or requests wait there for room): remote, whatever the predictions say; a prefill
  there would only lengthen the queue of streams and handoffs the replica already cannot serve
  in time, and the pool is where prefill capacity is added;
- both predictions within the TTFT budget: remote (the decode replica keeps its time for decoding);
- both past it: remote (the request misses its budget either way; prefilling it here would only
  take the decode replica's steps from its streams, and measured past the knee that cost more
  goodput than it saved: bench/results/amd-zen2/pd.json);
- otherwise the side within it (a decode replica takes prefill work while the pool is saturated,
  in chunks that keep its streams within their TPOT budget); without a budget, the smaller
  prediction.
Unknown rates (nothing measured yet) are taken to be equal on both sides (same engine settings).

Standard library only: the ingress and the replicas both use it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

# A replica's rate counts toward the pool's for this long after its last report: a replica gone
# (downscaled, dead) stops counting within it.
REPLICA_RATE_TTL_S = 120.0
RATE_EWMA_ALPHA = 0.3  # weight of a replica's newest rate report


@dataclass(frozen=True)
class PoolEstimate:
    """What the ingress knows of the prefill pool when it asks a decode replica to place a
    request: prompt tokens sent to the pool and not yet prefilled, the pool's total rate (None:
    not measured yet), and whether it is backing off after a failure."""

    queued_tokens: int
    tokens_per_s: float | None
    num_replicas: int
    backing_off: bool = False


@dataclass(frozen=True)
class LocalEstimate:
    """A decode replica's own prefill capacity right now (read on its engine thread)."""

    uncached_tokens: int  # of this prompt, after the prefix cache
    queued_tokens: int  # prompt tokens already waiting in its engine
    tokens_per_s: float | None  # its prefill rate with the streams it runs now (None: unknown)
    saturated: bool = False  # past its own capacity: no room beside its streams, or requests waiting


@dataclass(frozen=True)
class Placement:
    where: str  # "remote" | "local"
    reason: str  # no_pool | short | backoff | decode_saturated | unmeasured | within_budget | over_budget
    #   | local_faster | remote_faster
    remote_ttft_s: float | None = None
    local_ttft_s: float | None = None


def predicted_ttft_s(queued_tokens: int, tokens: int, tokens_per_s: float | None) -> float | None:
    return None if not tokens_per_s else (queued_tokens + tokens) / tokens_per_s


def place(local: LocalEstimate, pool: PoolEstimate | None, min_prompt_tokens: int,
          ttft_budget_s: float | None) -> Placement:
    """Where to prefill (module docstring)."""
    if pool is None:
        return Placement("local", "no_pool")
    if local.uncached_tokens < min_prompt_tokens:
        return Placement("local", "short")
    if pool.backing_off:
        return Placement("local", "backoff")
    remote_rate = pool.tokens_per_s or local.tokens_per_s
    local_rate = local.tokens_per_s or remote_rate
    remote = predicted_ttft_s(pool.queued_tokens, local.uncached_tokens, remote_rate)
    mine = predicted_ttft_s(local.queued_tokens, local.uncached_tokens, local_rate)
    if local.saturated:
        return Placement("remote", "decode_saturated", remote, mine)
    if remote is None or mine is None:  # nothing measured on either side yet
        return Placement("remote", "unmeasured", remote, mine)
    if ttft_budget_s is not None and remote <= ttft_budget_s and mine <= ttft_budget_s:
        return Placement("remote", "within_budget", remote, mine)
    if ttft_budget_s is not None and remote > ttft_budget_s and mine > ttft_budget_s:
        return Placement("remote", "over_budget", remote, mine)
    if mine < remote:
        return Placement("local", "local_faster", remote, mine)
    return Placement("remote", "remote_faster", remote, mine)


@dataclass
class _ReplicaRate:
    tokens_per_s: float
    seen_at: float


@dataclass
class PrefillPoolTracker:
    """The ingress's view of the prefill pool: the prompt tokens it sent there that have no first
    token yet, and each replica's prefill rate as the replicas report it. One ingress sees the
    requests it routes; several ingress replicas each see their share of the traffic and of the
    queue, so the prediction holds as long as they share the load evenly."""

    ttl_s: float = REPLICA_RATE_TTL_S
    _pending: dict[int, tuple[int, float]] = field(default_factory=dict)  # ticket -> (prompt tokens, sent at)
    _rates: dict[str, _ReplicaRate] = field(default_factory=dict)  # replica id -> its rate
    _tickets: itertools.count = field(default_factory=itertools.count)
    _last_done_at: float = float("-inf")  # when the pool last gave a first token

    def sent(self, tokens: int, now: float | None = None) -> int:
        """A prompt of `tokens` uncached tokens was sent to the pool; returns its ticket."""
        ticket = next(self._tickets)
        self._pending[ticket] = (tokens, time.monotonic() if now is None else now)
        return ticket

    def done(self, ticket: int, now: float | None = None) -> None:
        """Its first token came (or the call ended): it no longer waits in the pool."""
        if self._pending.pop(ticket, None) is not None:
            self._last_done_at = time.monotonic() if now is None else now

    def remaining_tokens(self, tokens_per_s: float | None, num_replicas: int, now: float) -> int:
        """The pending prompts' tokens less what the pool has prefilled of those in progress: the
        oldest `num_replicas`, each at its share of `tokens_per_s` since it reached the pool or the
        pool's last first token, whichever is later (module docstring)."""
        total = 0.0
        for i, (tokens, sent_at) in enumerate(self._pending.values()):
            if tokens_per_s and i < num_replicas:
                started = max(sent_at, self._last_done_at)
                tokens = max(0.0, tokens - tokens_per_s / num_replicas * max(0.0, now - started))
            total += tokens
        return round(total)

    def report(self, replica_id: str, tokens_per_s: float | None, now: float | None = None) -> None:
        """A prefill replica's measured rate (from its `PrefillResult`)."""
        if not tokens_per_s or tokens_per_s <= 0:
            return
        now = time.monotonic() if now is None else now
        old = self._rates.get(replica_id)
        rate = tokens_per_s if old is None else (1 - RATE_EWMA_ALPHA) * old.tokens_per_s + RATE_EWMA_ALPHA * tokens_per_s
        self._rates[replica_id] = _ReplicaRate(rate, now)

    @property
    def queued_tokens(self) -> int:
        """The pending prompts' tokens, none of their progress taken off."""
        return sum(tokens for tokens, _ in self._pending.values())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def estimate(self, backing_off: bool = False, now: float | None = None) -> PoolEstimate:
        now = time.monotonic() if now is None else now
        live = [r.tokens_per_s for r in self._rates.values() if now - r.seen_at <= self.ttl_s]
        rate = sum(live) if live else None
        return PoolEstimate(self.remaining_tokens(rate, max(1, len(live)), now), rate, len(live), backing_off)
