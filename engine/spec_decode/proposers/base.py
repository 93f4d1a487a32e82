"""The `Proposer` base class every drafter extends, and what it returns.

A proposer gets the requests that will verify drafts next step and a k for each, and returns
k draft token ids per request, with the draft distribution q [k, vocab] when the request samples
(so the rejection sampler stays exact) or None when drafts are deterministic (greedy requests,
n-gram lookup). Proposers never commit anything: their own caches only keep accepted positions.

Per-request state lives in the proposer, keyed by request id (`states`), as one small dataclass
per request (draft-model progress, buffered hidden rows, an n-gram index), so that it can be freed,
checked for leaks and handed from one engine to another (`export_state` / `import_state`, and the
paged `kv_caches` the engine copies block by block; see engine/handoff.py). A proposer changes a request's
state only after the forward that could fail has succeeded: a failed `propose` leaves every state
as it was, and the request can draft again next step.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from engine.penalties import Penalties
from engine.request import Request
from engine.sampler import probs_from_logits, sample_from_probs
from engine.spec_decode.tree import DraftTree

ROUND_SAMPLES = 3  # a drafting round length's own median counts from this many rounds (StepTimer)
ROUND_WINDOW = 16  # the rounds of each length it keeps (the last ones)


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] float32, or None if deterministic
    # A token tree whose nodes 1.. are token_ids (and probs rows) in index order (node 0: the
    # request's last token); None for a chain.
    tree: DraftTree | None = None


@dataclass
class ProposeContext:
    """What a proposer gets besides the requests: the generators of seeded requests, by request id
    (they belong to the model runner: the target's sampling draws from the same generator), and
    the step's floor on greedy tree nodes: a node is drafted only if its cumulative draft
    log-probability at the tree temperature is at least tree_min_logprob (`Speculator`: the
    configured `tree_min_prob`, or the adaptive policy's; -inf: EAGLE-2's fixed node count); and
    the runner's penalties, which chains draft under (engine/penalties.py; None: not applied)."""

    generators: dict[str, torch.Generator]
    tree_min_logprob: float = float("-inf")
    penalties: Penalties | None = None

    def generators_for(self, requests: list[Request]) -> list[torch.Generator | None]:
        return [self.generators.get(r.request_id) for r in requests]


@dataclass(frozen=True)
class DrafterIdentity:
    """What a handoff's importer must share with its exporter's drafter (engine/handoff.py)."""

    model: str | None = None  # the drafter checkpoint's folder name; None without a model
    digest: str | None = None  # `weights_digest` of its weights
    draft_vocab_size: int | None = None  # rows of its LM head (the draft vocabulary)


def weights_digest(named_tensors) -> str:
    """A short hash of (name, shape, dtype) of each tensor: which architecture and layout, not the
    values (hashing every weight would cost a pass over the checkpoint at start-up)."""
    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda nt: nt[0]):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def model_name(model_dir: str) -> str:
    return os.path.basename(os.path.normpath(model_dir))


def may_draft(request: Request) -> bool:
    """False for a request that asked never to speculate (its proposer state is never needed)."""
    params = request.sampling_params
    return params.speculative and params.num_speculative_tokens != 0


class Proposer:
    """A drafter. Subclasses implement `propose` and `step_cost`; the rest have defaults.

    method: the `SpeculativeConfig.method` it implements. max_k: the most drafts it can make per
    request and step. propose_is_free: drafting costs microseconds, so the speculator looks up
    drafts before deciding whether a step verifies them (n-gram lookup). needs_hidden_states: it
    reads the target's final-norm hidden states, handed to `observe_step` after every step.
    aux_layer_ids: the target's layer boundaries whose residual stream it reads (EAGLE-3; see
    `CausalLM.aux_layer_ids`), handed to `observe_step` as `aux_hidden_states`; () for none.
    supports_tree: it implements `propose_trees` (SpeculativeConfig.tree_nodes).
    tree_temperature: the temperature at which its greedy trees rank candidates
    (`tree_drafting`; `make_proposer` sets it from SpeculativeConfig.tree_temperature).
    """

    method: str = ""
    max_k: int = 16
    propose_is_free: bool = False
    needs_hidden_states: bool = False
    aux_layer_ids: tuple[int, ...] = ()
    supports_tree: bool = False
    tree_temperature: float = 1.0

    def __init__(self) -> None:
        self.states: dict[str, object] = {}  # request id -> this proposer's per-request state
        # The proposer's paged KV cache, per layer (k, v) [num_blocks, block_size, kv_heads,
        # head_dim], indexed by the target's block tables; empty when it has none.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def identity(self) -> DrafterIdentity:
        """What a handoff's importer must share with this drafter (none for a model-free one)."""
        return DrafterIdentity()

    def export_state(self, request_id: str):
        """A request's state, with its tensors on the CPU, for a handoff to another engine; None
        when there is nothing to hand over (the importer then starts the request without one)."""
        return None

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        """Take in a state from `export_state` for a request whose first `num_computed_tokens`
        tokens have target KV. Raises ValueError for a state that does not fit, changing nothing."""
        if state is not None:
            raise ValueError(f"{self.method} proposer keeps no per-request state to import, got {type(state).__name__}")

    kv_arch = None  # the ArchConfig of the proposer's own paged-KV layers; None: it keeps no KV

    # a feature drafter's record of the blocks its KV covers (feature_buffers.DrafterKVCoverage); None:
    # the proposer's KV, if any, is filled from tokens alone (a draft model recomputes a request's
    # prompt), so a cached prefix serves it as is
    kv_coverage = None
    feature_kv = False  # make `kv_coverage` at init_kv_cache

    def capture_step_graph(self, max_positions: int, capture: bool = True) -> bool:
        """Run the drafter's own small forwards as a CUDA graph where it can (engine/step_graph.py;
        after `init_kv_cache`). Whether it does: here never."""
        return False

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the proposer's own paged KV cache (same block tables as the target's), if any:
        `kv_arch`'s layers."""
        if self.feature_kv:
            from engine.spec_decode.proposers.feature_buffers import DrafterKVCoverage

            self.kv_coverage = DrafterKVCoverage(num_blocks, block_size)
        if self.kv_arch is not None:
            from engine.model_runner import allocate_kv_cache

            self.block_size = block_size
            self.kv_caches = allocate_kv_cache(self.kv_arch, num_blocks, block_size, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        """Bytes of the proposer's KV cache per token of the shared block pool."""
        if self.kv_arch is None:
            return 0
        from engine.model_runner import kv_bytes_per_token

        return kv_bytes_per_token(self.kv_arch, self.dtype)

    def buffer_bytes(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """The most bytes the proposer's per-request buffers (other than KV) can hold at once."""
        return 0

    def configure_buffers(self, max_num_seqs: int, max_model_len: int) -> None:
        """Size the per-request buffers for an engine of `max_num_seqs` requests of up to
        `max_model_len` tokens (before `buffer_bytes`): the layer drafters' lazy bound
        (feature_buffers.LAZY_BUFFER_ROWS)."""

    def pending_rows(self, request: Request) -> int:
        """Positions the drafter would catch up over before its next draft for `request` (its
        buffered rows): what drafting it once costs beyond a steady round."""
        rows = getattr(self._state(request.request_id), "rows", None)  # (a feature drafter's HiddenRows)
        return 0 if rows is None else rows.shape[0]

    def pending_rows_of(self, requests: list[Request]) -> list[int]:
        """`pending_rows` of each request."""
        return [self.pending_rows(r) for r in requests]

    # seconds a buffered row cost the drafter's last long catch-ups (`record_catch_up`)
    _catch_up_row_s: deque | None = None

    def record_catch_up(self, rows: int, seconds: float) -> None:
        """Note a catch-up over `rows` buffered rows (a prompt's, or those left while speculation
        was off) that took `seconds`; `catch_up_seconds` prices the next ones by it."""
        if rows > 0:
            if self._catch_up_row_s is None:
                self._catch_up_row_s = deque(maxlen=ROUND_WINDOW)
            self._catch_up_row_s.append(seconds / rows)

    def catch_up_seconds(self, rows: int) -> float:
        """What catching up over `rows` buffered rows would take: rows x the median seconds a row
        of the recorded catch-ups (0 before one is recorded, and for proposers that record none)."""
        if not rows or not self._catch_up_row_s:
            return 0.0
        return rows * statistics.median(self._catch_up_row_s)

    def observe_step(self, sched, runner_out) -> None:
        """Called after every step with its `SchedulerOutput` and `ModelRunnerOutput`, before any
        drafting; the proposers that read the target's hidden states keep what they need here."""

    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        raise NotImplementedError

    def propose_trees(self, requests: list[Request], num_nodes: list[int], max_depths: list[int],
                      context: ProposeContext, widths: list[int] | None = None) -> list[Draft]:
        """A token tree per request (`Draft.tree`), of at most num_nodes[r] draft nodes and
        max_depths[r] levels (max_depths[r] >= 1), at most widths[r] children per node (capped
        by the proposer's tree_width; None: tree_width for all). Only where `supports_tree`."""
        raise NotImplementedError(f"{self.method} proposer drafts chains only")

    def step_cost(self, num_requests: int, k: int) -> float:
        """Estimated drafting time for `num_requests` requests at k tokens, in seconds."""
        raise NotImplementedError

    def free_request(self, request_id: str) -> None:
        """Forget a request (finished, aborted, or preempted: it then starts over)."""
        self.states.pop(request_id, None)
        if self.kv_coverage is not None:
            self.kv_coverage.forget(request_id)

    def _cover(self, requests) -> None:
        """Record in `kv_coverage` the blocks whose final elements the drafter now holds for
        these requests (a feature drafter: `_kv_done`)."""
        if self.kv_coverage is not None:
            for r in requests:
                state = self._state(r.request_id)
                if state is not None:
                    self.kv_coverage.mark(r, self._kv_done(state))

    def _state(self, request_id: str):
        """A request's state as the proposer reads it internally (`states.get`)."""
        return self.states.get(request_id)

    def _kv_done(self, state) -> int:
        """Positions below which the drafter's KV holds a request's final elements."""
        raise NotImplementedError

    def check_no_leaks(self, live_ids: set[str]) -> None:
        """Raise AssertionError if state is kept for a request that is not live, or a buffer
        exceeds its bound."""
        stray = sorted(set(self.states) - live_ids)
        if stray:
            raise AssertionError(f"{self.method} proposer keeps state for requests that are not live: {stray[:5]}")
        stray = sorted(set(self.kv_coverage.marked) - live_ids) if self.kv_coverage is not None else []
        if stray:
            raise AssertionError(f"{self.method} proposer keeps KV coverage for requests that are not live: {stray[:5]}")


class BucketedMedians:
    """The last `maxlen` samples per batch-size bucket (1, 2-3, 4-7, 8-15, 16+) and their median,
    so that one step slowed by other work on the host moves no estimate. A bucket with no sample
    borrows the nearest measured one (the larger on a tie)."""

    BUCKETS = (1, 2, 4, 8, 16)

    def __init__(self, maxlen: int = 32) -> None:
        self.samples: list[deque[float]] = [deque(maxlen=maxlen) for _ in self.BUCKETS]
        self._medians: dict[tuple[int, bool], float | None] = {}  # `median`'s answers until the next add

    @classmethod
    def _bucket(cls, num_requests: int) -> int:
        return bisect.bisect_right(cls.BUCKETS, max(num_requests, 1)) - 1

    def add(self, num_requests: int, value: float) -> None:
        self.samples[self._bucket(num_requests)].append(value)
        self._medians.clear()

    def median(self, num_requests: int, borrow: bool = True) -> float | None:
        """The median of the nearest measured bucket (without `borrow`: of its own bucket), or None
        when nothing is measured."""
        near = self.nearest(num_requests, borrow)
        return None if near is None else near[1]

    def nearest(self, num_requests: int, borrow: bool = True) -> tuple[int, float] | None:
        """(the smallest batch size of the nearest measured bucket, its median), as `median`."""
        i = self._bucket(num_requests)
        key = (i, borrow)
        if key not in self._medians:
            measured = [j for j, d in enumerate(self.samples) if d and (borrow or j == i)]
            j = min(measured, key=lambda j: (abs(j - i), -j)) if measured else None
            self._medians[key] = None if j is None else (self.BUCKETS[j], statistics.median(self.samples[j]))
        return self._medians[key]

    def as_dict(self) -> dict[int, float]:
        return {b: statistics.median(d) for b, d in zip(self.BUCKETS, self.samples, strict=True) if d}


class StepTimer:
    """Running estimate of a drafting round for a batch of n requests: `BucketedMedians` of the
    time per forward of measured rounds (`seconds`, `initial_s` until the first is measured), and
    the round time per number of forwards (`round_seconds`).

    A round is not a forward times k: the first forward also catches up over the accepted tokens
    and reads the drafter's weights back from DRAM (the target's step evicted them), the others
    find them in cache. So a further draft costs less than the first, and the mean per forward
    would overprice long chains and underprice short ones: rounds are also kept by their number
    of drafts (`round_seconds`)."""

    def __init__(self, initial_s: float) -> None:
        self.initial_s = initial_s
        self.medians = BucketedMedians()
        # (batch bucket, drafts) -> the last ROUND_WINDOW chain rounds' seconds
        self.rounds: dict[tuple[int, int], deque[float]] = {}
        self._round_medians: dict[tuple[int, int], float] | None = None

    def add(self, num_requests: int, seconds: float) -> None:
        self.medians.add(num_requests, seconds)

    def add_round(self, num_requests: int, seconds: float, num_forwards: int, catch_up: int, k_max: int,
                  chain: bool = True) -> None:
        """Record a drafting round of `num_forwards` forwards whose first forward also caught up
        over `catch_up` committed tokens (of one request, at most). Steady-state rounds catch up
        over at most k_max + 1 tokens (accepted drafts + the bonus token); a round after a prefill
        or after speculation was off catches up over a whole prompt or more, a one-off cost that
        must not become the per-step estimate (at a large batch it would switch speculation off
        and, with speculation off, never be measured again). `chain`: a round of chains of at
        most k_max drafts, also kept by k_max (`round_seconds`); a tree round counts per forward
        only."""
        if num_forwards and catch_up <= k_max + 1:
            self.add(num_requests, seconds / num_forwards)
            if chain:
                key = (BucketedMedians._bucket(num_requests), k_max)
                self.rounds.setdefault(key, deque(maxlen=ROUND_WINDOW)).append(seconds)
                self._round_medians = None

    def seconds(self, num_requests: int = 1) -> float:
        """The time per forward for num_requests requests: the median of its batch bucket; where
        only smaller batches were measured, the nearest one's scaled by the requests (n / its
        size); a larger batch's as is; `initial_s` before any. (A forward over more requests
        takes longer: a small batch's time, borrowed as is, would underprice a large batch's
        drafting.)"""
        near = self.medians.nearest(num_requests)
        if near is None:
            return self.initial_s
        size, measured = near
        if BucketedMedians._bucket(size) == BucketedMedians._bucket(num_requests):
            return measured
        return measured * max(1.0, num_requests / size)

    def round_seconds(self, num_requests: int, forwards: int) -> float:
        """A round of chains of at most `forwards` drafts (a chain drafter: one forward each) for
        num_requests requests: the median of such rounds where ROUND_SAMPLES were measured (in the
        batch bucket); else from the nearest measured one, each draft more or fewer costing the
        slope between it and the measured round nearest to it (at most the time per forward), or
        the time per forward; with none measured, forwards x the time per forward."""
        if forwards <= 0:
            return 0.0
        if self._round_medians is None:
            self._round_medians = {key: statistics.median(d) for key, d in self.rounds.items()
                                   if len(d) >= ROUND_SAMPLES}
        bucket = BucketedMedians._bucket(num_requests)
        measured = {f: t for (b, f), t in self._round_medians.items() if b == bucket}
        per = self.seconds(num_requests)
        if forwards in measured:
            return measured[forwards]
        if not measured:
            return per * forwards
        near = min(measured, key=lambda f: (abs(f - forwards), f))
        slope = per
        others = [f for f in measured if f != near]
        if others:
            other = min(others, key=lambda f: (abs(f - near), f))
            slope = min(per, max(0.0, (measured[other] - measured[near]) / (other - near)))
        return max(per, measured[near] + (forwards - near) * slope)


def penalized(requests: list[Request], context: ProposeContext) -> bool:
    """Whether some request drafts under logit processors (`sample_drafts`, `tree_children`): the
    fused drafting kernels, which apply none, must not draft this round."""
    return context.penalties is not None and any(r.sampling_params.has_logit_processors for r in requests)


def sample_drafts(
    logits: torch.Tensor,
    requests: list[Request],
    token_ids: torch.Tensor | None = None,
    vocab_size: int = 0,
    generators: list[torch.Generator | None] | None = None,
    penalties: Penalties | None = None,
    drafted: list[list[int]] | None = None,
) -> tuple[list[int], torch.Tensor | None]:
    """One draft token per row, with the same penalties, temperature, top-k and top-p as the
    target will use (`penalties`: the runner's, row i drafted after `drafted[i]`).

    logits [n, V'] over the vocabulary, or over a draft vocabulary when `token_ids` [V'] gives
    the target token id of each column (then `vocab_size` is the target's vocabulary size);
    requests[i] owns row i. Greedy rows take the argmax; sampled rows draw from the filtered
    distribution with generators[i] (a seeded request's own; None: the global one). Returns
    (target token ids, probs [n, vocab] over the target's whole vocabulary, zero outside the
    draft vocabulary, or None when every row is greedy).
    """
    if penalties is not None:
        penalties.apply_to_drafts(logits, requests, drafted, token_ids)
    greedy = [r.sampling_params.is_greedy for r in requests]
    argmax = logits.argmax(dim=-1)
    if all(greedy):
        picked = argmax if token_ids is None else token_ids[argmax]
        return picked.tolist(), None
    params = [r.sampling_params for r in requests]
    device = logits.device
    probs = probs_from_logits(
        logits.float(),
        torch.tensor([max(p.temperature, 1e-5) for p in params], device=device),
        torch.tensor([p.top_k for p in params], device=device),
        torch.tensor([p.top_p for p in params], device=device),
    )
    sampled = sample_from_probs(probs, generators or [None] * len(requests))
    picked = torch.where(torch.tensor(greedy, device=device), argmax, sampled)
    if token_ids is not None:
        picked = token_ids[picked]
        probs = probs.new_zeros(probs.shape[0], vocab_size).index_copy_(1, token_ids, probs)
    return picked.tolist(), probs
