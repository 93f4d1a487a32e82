"""FCFS continuous-batching scheduler with chunked prefill, preemption and lookahead slots.

Pure Python, no torch. There is no prefill or decode phase: each step every running request's
computed tokens catch up toward its total (prompt + outputs + pending draft tokens) under a
per-step token budget. Draft tokens are just more tokens to compute; blocks for up to
`num_lookahead_tokens` of them are reserved ahead, and a rejected draft is simply never committed
(`num_computed_tokens` only advances over accepted tokens). A request's drafts only use budget
left after one token for each running request behind it, so drafts never crowd a running request
out of a step (its drafts are cut to fit instead). When blocks run out, the newest running
request is preempted by recompute and resumes later with identical output; the engine frees
what other components keep for it (`SchedulerOutput.preempted_request_ids`).
With `decode_step_budget_s`, while any running request decodes, the prefill tokens of a step
(chunks of running prompts and newly admitted ones) are capped so that the step, decoding
requests' tokens and drafts included, fits that time by the engine's measured step cost: long
prompts are prefilled over several steps and the decoding streams keep their pace. With
`idle_step_budget_s`, steps where nothing decodes yet are capped to that (longer) time: a stream
imported during a step waits for it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.block_manager import KVBlockManager
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.spec_decode.tree import DraftTree
    from engine.step_cost import StepCostModel

# Prefill tokens per step beside decoding streams until the step cost is fitted (it needs steps
# of clearly different sizes): a chunk this size takes a few decode steps' time on a CPU and far
# less on a GPU, so streams slow down but do not stall while the first measurements come in.
UNFITTED_PREFILL_CHUNK = 256


def is_decoding_stream(request: Request) -> bool:
    """Past its prompt with every token but the last computed (an imported handoff too): this
    step makes its next token, and its stream waits on the step."""
    return request.num_output_tokens > 0 and request.is_decoding


@dataclass
class ScheduledRequest:
    """One request's share of a step: `num_new_tokens` regular tokens then its draft tokens.

    A tree's drafts are its nodes 1..n in index order; its root is the last regular token."""

    request: Request
    num_new_tokens: int  # regular (not draft) tokens to compute this step
    spec_token_ids: list[int]  # draft tokens to verify this step (empty when not speculating)
    spec_tree: DraftTree | None = None  # the tree they form, or None for a chain
    # structured output: the tokens each sampled row may take [drafts + 1, vocab] (bool), set by
    # the engine before the step runs (engine/structured_output.py); None: unconstrained
    allowed: Any = None

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_new_tokens + len(self.spec_token_ids)

    @property
    def needs_sample(self) -> bool:
        """The chunk reaches the request's last token, so this step produces new token(s)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepResult:
    """What `update_from_output` reports per request touched this step."""

    request: Request
    new_token_ids: list[int]


class Scheduler:
    def __init__(
        self,
        block_manager: KVBlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        decode_step_budget_s: float | None = None,
        step_cost: StepCostModel | None = None,
        idle_step_budget_s: float | None = None,
    ) -> None:
        """`decode_step_budget_s` (SchedulerConfig) needs `step_cost`, the engine's measured step
        cost (its `tokens_within(seconds)` is all the scheduler reads); `idle_step_budget_s` caps
        steps with nothing decoding."""
        if decode_step_budget_s is not None and step_cost is None:
            raise ValueError("decode_step_budget_s needs a step_cost model (engine.step_cost.StepCostModel)")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.decode_step_budget_s = decode_step_budget_s
        self.idle_step_budget_s = idle_step_budget_s
        self.step_cost = step_cost
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # (request, its cached prefix's blocks) -> the leading ones it reuses (the speculator's
        # `usable_prefix`: a feature drafter needs its own KV in them); None: all of them
        self.prefix_filter = None

    # --- request lifecycle ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request at once and free its blocks. Unknown or finished ids are ignored."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a live request now with `status` (an abort, or a handoff to another engine) and
        free its blocks. Returns it, or None for an unknown or finished id."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return request

    def add_running(self, request: Request) -> None:
        """Take in a request that already holds its blocks and computed tokens (a handoff
        imported from another engine) as the newest running request: the next step continues it.
        The caller checked `can_run_another` and allocated its blocks."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not self.can_run_another():
            raise ValueError(f"{len(self.running)} requests already running (max_num_seqs {self.max_num_seqs})")
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.requests[request.request_id] = request
        self.running.append(request)

    def can_run_another(self) -> bool:
        """A sequence slot is free for one more running request."""
        return len(self.running) < self.max_num_seqs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.block_manager.free(request)
        request.spec_token_ids = []
        request.spec_tree = None
        self.requests.pop(request.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- scheduling -------------------------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.spec_tree = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def step_budget_s(self, decoding: list[Request] | None = None) -> float | None:
        """The time the next step may take: `decode_step_budget_s` while a stream decodes,
        `idle_step_budget_s` with none (None: no bound)."""
        if self.decode_step_budget_s is None:
            return None
        if decoding is None:
            decoding = [r for r in self.running if is_decoding_stream(r)]
        return self.decode_step_budget_s if decoding else self.idle_step_budget_s

    def prefill_token_cap(self) -> int | None:
        """The most prefill tokens the next step may hold beside the decoding requests, or None
        for no cap (no `decode_step_budget_s`, or nothing decodes and no `idle_step_budget_s`).
        The decoding requests' tokens (one each plus its drafts) are counted first: the cap is
        what the step cost fits in the budget after them, also within `max_num_batched_tokens`,
        and at least one KV block, so prefill always progresses."""
        if self.decode_step_budget_s is None:
            return None
        decoding = [r for r in self.running if is_decoding_stream(r)]
        if not decoding and self.idle_step_budget_s is None:
            return None
        num_decode_tokens = sum(1 + len(r.spec_token_ids) for r in decoding)
        within = self.step_cost.tokens_within(self.step_budget_s(decoding))
        cap = UNFITTED_PREFILL_CHUNK if within is None else within - num_decode_tokens
        cap = min(cap, self.max_num_batched_tokens - num_decode_tokens)
        return max(self.block_manager.block_size, cap)

    def _reserved_for_waiting(self, prefill_left: int | None) -> int:
        """Of a capped step's prefill tokens, those kept for waiting prompts (first come first
        served) that are shorter than every prompt still prefilling: a short prompt that arrives
        during a long one's chunked prefill goes before the rest of it, rather than waiting for all
        of it (shortest remaining first, which shortens the mean time to first token)."""
        if prefill_left is None or not self.waiting:
            return 0
        left = [r.num_tokens - r.num_computed_tokens for r in self.running if not is_decoding_stream(r)]
        if not left:
            return 0
        reserved, slots = 0, self.max_num_seqs - len(self.running)
        for request in self.waiting:
            if slots == 0 or request.num_tokens >= min(left) or reserved + request.num_tokens > prefill_left:
                break
            reserved += request.num_tokens
            slots -= 1
        return reserved

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        prefill_left = self.prefill_token_cap()  # None: prefill is limited by `budget` only
        reserved = self._reserved_for_waiting(prefill_left)
        if reserved:
            prefill_left -= reserved
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        bm = self.block_manager

        # 1) Running requests, oldest first. On a block shortage preempt the newest. Drafts come
        #    after one token for each running request behind this one (the drafts are cut to fit).
        #    Prompts still prefilling take their chunks from `prefill_left` too; one left without
        #    any this step waits, and the requests behind it go on.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget)
            is_prefill = prefill_left is not None and not is_decoding_stream(request)
            if is_prefill:
                num_new = min(num_new, prefill_left)
                if num_new == 0:
                    i += 1
                    continue
            spec: list[int] = []
            if num_new == remaining:
                num_behind = len(self.running) - i - 1
                spec = request.spec_token_ids[: max(0, budget - num_new - num_behind)]
            request.spec_token_ids = list(spec)
            # a tree's first nodes in index order are a tree (every parent comes first)
            tree = request.spec_tree.truncated(len(spec)) if request.spec_tree is not None and spec else None
            request.spec_tree = tree
            while not bm.allocate_slots(request, num_new + len(spec), self.num_lookahead_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status == RequestStatus.PREEMPTED:
                break
            scheduled.append(ScheduledRequest(request, num_new, list(spec), tree))
            budget -= num_new + len(spec)
            if is_prefill:
                prefill_left -= num_new
            i += 1

        # 2) Waiting requests, FCFS, while budget, prefill cap, sequence slots and blocks allow.
        if reserved:
            prefill_left += reserved
        while (self.waiting and budget > 0 and (prefill_left is None or prefill_left > 0)
               and len(self.running) < self.max_num_seqs and not preempted):
            request = self.waiting[0]
            cached = bm.find_cached_prefix(request)
            if self.prefix_filter is not None:
                cached = self.prefix_filter(request, cached)
            num_computed = len(cached) * bm.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if prefill_left is not None:
                num_new = min(num_new, prefill_left)
            if not bm.allocate_slots(request, num_new, self.num_lookahead_tokens, cached_blocks=cached):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new, []))
            budget -= num_new
            if prefill_left is not None:
                prefill_left -= num_new
        return SchedulerOutput(scheduled, preempted)

    # --- commit -----------------------------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: list[list[int]]
    ) -> list[StepResult]:
        """Commit the verified tokens of each scheduled request and finish those that stop.

        `sampled_token_ids[i]` is empty for a prefill chunk that does not reach the end, else
        the accepted draft tokens (of a tree: its accepted path's, whose KV the model runner has
        moved into place) followed by one bonus/recovered token (1..k+1 tokens).
        """
        results: list[StepResult] = []
        now = time.monotonic()
        for sched, tokens in zip(output.scheduled, sampled_token_ids, strict=True):
            request = sched.request
            if request.is_finished:  # aborted while the step ran
                continue
            num_spec = len(sched.spec_token_ids)
            if not tokens:
                request.num_computed_tokens += sched.num_new_tokens
                self.block_manager.commit_full_blocks(request)
                continue
            num_accepted = len(tokens) - 1
            request.num_computed_tokens += sched.num_new_tokens + num_accepted
            if num_spec:
                request.spec_stats.record(num_spec, num_accepted,
                                          None if sched.spec_tree is None else max(sched.spec_tree.depths))
            request.spec_token_ids = []
            request.spec_tree = None
            new_tokens: list[int] = []
            status = None
            for token in tokens:
                request.output_token_ids.append(token)
                new_tokens.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    break
            if request.first_token_time is None:
                request.first_token_time = now
            self.block_manager.commit_full_blocks(request)
            results.append(StepResult(request, new_tokens))
            if status is not None:
                self._finish(request, status)
        return results

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
