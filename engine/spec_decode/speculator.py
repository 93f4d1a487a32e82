"""Speculation control: which requests draft next step, with how many tokens, and whether the step
speculates at all.

- Per request: k is capped by the request's own setting (`SamplingParams.speculative`,
  `num_speculative_tokens`), by the tokens it may still produce and by the model length. With
  `adaptive`, k is the value that maximizes the request's expected tokens per second: each
  draft accepted with the probability `AcceptanceModel` predicts for this request at that
  position, against the target's step time over 1 + k tokens (the start-up curve) plus drafting
  k.
- Per step: speculation is a latency play. Using the target's step time vs tokens-per-step curve
  measured at start-up, the step speculates only if expected tokens per second beat not
  speculating; large batches that already saturate the device run without drafts.
- Calibration: the start-up curve times the target's forward alone. A real step also samples,
  verifies and keeps books, and that costs more per token when it verifies drafts. So every
  decode step's measured time is compared with the curve's prediction, per `StepMode` and
  batch-size bucket (`StepCalibration`), and the decision scales each mode by its own ratio.
- Trees (`SpeculativeConfig.tree_nodes`): sized and priced against chains by `TreePolicy`.

The measurements live in cost_model.py and acceptance.py, the tree pricing in tree_policy.py; this
module drives the proposer with them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec_decode.acceptance import AcceptanceModel, top_chain_observation
from engine.spec_decode.cost_model import (
    POINT_SAMPLES,
    StepCalibration,
    StepCostModel,
    StepMode,
    monotone,
    profile_step_cost,
    spread_catch_up,
)
from engine.spec_decode.proposers.base import BucketedMedians, Draft, ProposeContext, Proposer
from engine.spec_decode.tree_policy import TreePolicy

logger = logging.getLogger("engine")

PROBE_EVERY = 8  # a request whose drafts stopped paying retries k=1 this often
PROBE_CATCH_UP_ROWS = 16  # a step's probe drafts for requests with at most this many rows to catch up
# A probe after which the policy still finds that drafts do not pay doubles the steps to the next
# probe, up to 2**PROBE_BACKOFF_MAX times `probe_interval`; any decision to speculate restores
# the interval. A probe is not free: a layer drafter first catches up over every row its request
# left un-run, and where the host multiplies the head's rows rather than streaming its weights (a
# CPU) that costs a few percent of a target step per row, so probes that keep confirming "off"
# cost a few percent of all decode time (measured on AVX2 with SmolLM2's EAGLE-3 head: ~5%).
PROBE_BACKOFF_MAX = 3
# A step whose drafts do not pay (cap 0) leaves the next OFF_RECHECK - 1 steps of the same decoding
# requests without drafts unweighed: without verifications nothing the decision reads changes but
# the calibration, slowly, and weighing every request's k and the cap is a noticeable share of a
# step; a probe step, or another set of requests, weighs again.
OFF_RECHECK = 8
# A step speculates only if its predicted tokens/s beat not speculating by this factor: the
# predicted time of a step with drafts runs a few percent short of the measured one, so a smaller
# predicted gain is a coin flip that costs the variance of speculating.
MIN_GAIN = 1.03
# With several requests, a step with drafts is predicted at least as slow, relative to the
# start-up curve, as the same batch's steps without (the chain mode's ratio floored at the plain
# mode's). The calibrated ratios cover pure decode steps; what a batch's speculation also costs is
# not in them (the drafter's catch-up over every admitted prompt, the steps that verify next to a
# prefill), so steps with drafts can measure cheaper against the curve than steps without while
# the batch runs slower with them. One request's steps keep their own ratios (the batch-1 k).
FLOOR_ON_AT_OFF = True
# While a batch of several requests speculates, one step in this many goes without drafts if the
# batch's point without drafts has fewer than POINT_SAMPLES recent steps (within
# BATCH_POINT_HORIZON), so that the cost the decision compares against stays measured.
OFF_PROBE_EVERY = 16
# With several requests, a step's predicted tokens/s with drafts is scaled by how the batch's recent
# steps with drafts measured against their prediction: the median, over its last REALIZED_WINDOW
# decode steps with drafts (from REALIZED_MIN of them), of (tokens made / (the step's time + the
# drafting that made its drafts)) / (the tokens/s `best_chain` predicted for it), within
# REALIZED_CLAMP. The prediction leaves out the drafter's bookkeeping of the verified rows and
# the policy's own time, and reads acceptance optimistically (`POSITION_CONFIDENCE_Z`), so with a
# batch it can predict a gain where the steps run slower.
REALIZED_WINDOW = 16
REALIZED_MIN = 4
REALIZED_CLAMP = (0.5, 1.5)
# One request decoding: a step this often drafts one more (or one fewer) than the best k while that
# k's point has fewer than POINT_SAMPLES steps, and every EXPLORE_REFRESH steps regardless, so that
# the policy's k follows measured steps rather than the start-up curve's shape (`StepCalibration`).
EXPLORE_EVERY = 4
EXPLORE_REFRESH = 64


def probe_interval(num_decoding: int) -> int:
    """Steps between the probes of a step whose drafts do not pay (one draft per request): 32 up
    to 7 requests, then 32 per 4 requests (128 at 16). A probe's cost grows with the batch (every
    request's verification, and an EAGLE head's catch-up over the rows it skipped), so a batch
    probes less often."""
    return 4 * PROBE_EVERY * max(1, num_decoding // 4)


class ProbeBackoff:
    """How far apart probes are (PROBE_BACKOFF_MAX): the doublings earned by probes that did
    not turn speculation on since drafts last paid, and the probe waiting for the decision that
    judges it (the next `best_cap` weighed)."""

    def __init__(self) -> None:
        self.doublings = 0
        self.pending = False  # a probe ran and no decision has judged it yet
        self.num_probes = 0

    def interval(self, num_decoding: int) -> int:
        return probe_interval(num_decoding) << self.doublings

    def probed(self) -> None:
        self.pending = True
        self.num_probes += 1

    def judge(self, cap: int) -> None:
        """A chain decision: speculating (cap > 0) restores the interval; not speculating right
        after a probe doubles it."""
        if cap > 0:
            self.doublings = 0
        elif self.pending:
            self.doublings = min(PROBE_BACKOFF_MAX, self.doublings + 1)
        self.pending = False


class Speculator:
    """The speculation policy and the proposer it drives. Per request it keeps nothing but the
    proposer's states (the acceptance counts are plain data on the `Request`)."""

    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if config.uses_tree and not proposer.supports_tree:
            raise ValueError(f"the {proposer.method!r} proposer drafts chains only (trees: a draft model, an EAGLE-1 "
                             "or EAGLE-3 head, native MTP, n-gram lookup); set tree_nodes=0")
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = 0
        self.cost: StepCostModel | None = None
        self.calibration = StepCalibration()
        self._k_times_cache: tuple[int, list[float]] | None = None  # (step index, `_k_times`)
        self.acceptance = AcceptanceModel(config.acceptance_ema_alpha)
        self.trees = TreePolicy(config, proposer)
        self.num_steps_off = 0
        self.num_steps_on = 0
        self._off: tuple[int, tuple[str, ...]] | None = None  # (step to weigh again, the requests) after cap 0
        self.num_explored = 0  # steps of one request whose k was a neighbour of the best (`_explore`)
        self.num_off_probes = 0  # steps a speculating batch went without drafts to measure them (OFF_PROBE_EVERY)
        self.probes = ProbeBackoff()
        # realized / predicted tokens per second of a batch's decode steps with drafts, by batch bucket
        self.realized = [collections.deque(maxlen=REALIZED_WINDOW) for _ in BucketedMedians.BUCKETS]
        self._prediction: tuple[int, float] | None = None  # (requests, tokens/s) predicted for the next step
        self._last_execute_s = 0.0  # the last step's time before drafting (`observe_step_time`)
        self._last_draft_s = 0.0  # the last `propose_for_step`'s time (observing and drafting)
        self._chain_rate: float | None = None  # the last `best_cap`'s predicted tokens/s
        # (step index, decoding ids, ks, best_chain over the ks > 0): the chain decision
        # `_trees_pay` made for the step, reused when chains win it
        self._chain_memo: tuple | None = None
        self._last_off_probe = 0  # (none in the first OFF_PROBE_EVERY steps: nothing is measured yet)
        self.num_tree_steps = 0  # steps whose drafts were trees (also counted in num_steps_on)

    # --- delegation -------------------------------------------------------------------------
    @property
    def method(self) -> str:
        return self.config.method

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.proposer.init_kv_cache(num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return self.proposer.kv_bytes_per_token()

    def buffer_bytes(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        return self.proposer.buffer_bytes(max_num_seqs, max_num_batched_tokens)

    def free_request(self, request_id: str) -> None:
        """Forget a finished, aborted or preempted request."""
        self.proposer.free_request(request_id)

    def usable_prefix(self, request: Request, cached_blocks: list[int]) -> list[int]:
        """The leading blocks of a request's cached prefix it may reuse: all of them, except
        that a request that may draft with a feature drafter stops at the first block whose
        drafter KV was never filled (feature_buffers.DrafterKVCoverage) and recomputes from there."""
        return self.usable_blocks(request.sampling_params.speculative, cached_blocks)

    def usable_blocks(self, speculative: bool, cached_blocks: list[int]) -> list[int]:
        """`usable_prefix` for a request that may draft (`speculative`) or not."""
        coverage = self.proposer.kv_coverage
        if coverage is None or not cached_blocks or not speculative:
            return cached_blocks
        return coverage.prefix(cached_blocks)

    # --- handoff (engine/handoff.py) ----------------------------------------------------------
    @property
    def kv_caches(self) -> list:
        """The proposer's paged KV cache (empty when it has none)."""
        return self.proposer.kv_caches

    def identity(self):
        return self.proposer.identity()

    def export_state(self, request_id: str):
        return self.proposer.export_state(request_id)

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        self.proposer.import_state(request_id, state, num_computed_tokens)

    def check_no_leaks(self, live: list[Request]) -> None:
        """Raise AssertionError if per-request state outlives its request or a buffer exceeds its
        bound."""
        self.proposer.check_no_leaks({r.request_id for r in live})

    # --- cost model -------------------------------------------------------------------------
    def profile(self, runner, max_num_seqs: int, max_tokens: int) -> StepCostModel:
        """Time the target's steps on a grid of batch sizes x tokens per request
        (`profile_step_cost`; with trees up to tree_nodes + 1 tokens) and use them from now on."""
        max_tree_tokens = self.config.tree_nodes + 1 if self.config.uses_tree else None
        self.cost = profile_step_cost(runner, max_num_seqs, max_tokens, max_tree_tokens)
        logger.info("target step time (requests x tokens each): %s",
                    {k: f"{v * 1e3:.2f}ms" for k, v in self.cost.as_dict().items()})
        return self.cost

    def observe_step_time(self, sched, seconds: float) -> None:
        """Calibrate with one step's measured time (schedule, forward, sample/verify, commit).
        Steps that prefill are skipped: the curve is for decode steps."""
        self._last_execute_s = seconds
        if self.cost is None or not sched.scheduled or any(s.num_new_tokens > 1 for s in sched.scheduled):
            return
        predicted = self.cost(len(sched.scheduled), sched.num_batched_tokens)
        if predicted > 0:
            mode = StepMode.PLAIN
            if any(s.spec_token_ids for s in sched.scheduled):
                mode = StepMode.CHAIN
            if any(s.spec_tree is not None for s in sched.scheduled):
                mode = StepMode.TREE
            self.calibration.add(len(sched.scheduled), mode, seconds / predicted, sched.num_batched_tokens)

    # --- per-request k ----------------------------------------------------------------------
    def update_acceptance(self, request: Request, num_draft: int, num_accepted: int) -> None:
        self.acceptance.observe(request, num_draft, num_accepted)

    def max_k(self, request: Request, limit: int | None = None) -> int:
        """The most drafts (a tree: levels) `request` may verify next step: `limit` (default
        num_speculative_tokens) capped by its own setting, the tokens it may still produce, the
        model length and its blocks."""
        params = request.sampling_params
        if not params.speculative:
            return 0
        k = min(self.config.num_speculative_tokens if limit is None else limit, self.proposer.max_k)
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        k = min(k, params.max_tokens - request.num_output_tokens - 1)  # don't draft past the end
        k = min(k, self.max_model_len - request.num_tokens - 1)
        k = min(k, len(request.block_ids) * self.block_size - request.num_tokens + 1)
        return max(k, 0)

    def choose_k(self, request: Request, step_index: int) -> int:
        k_max = self.max_k(request)
        if k_max == 0 or not self.config.adaptive or self.cost is None:
            return k_max
        k = self._best_k(self.acceptance.accept_probs(request, k_max), k_max, step_index)
        if k == 0 and step_index % PROBE_EVERY == 0:
            k = 1
        return max(k, min(self.config.min_speculative_tokens, k_max)) if k else 0

    def _k_times(self, k_max: int, step_index: int | None) -> list[float]:
        """[the target's one-token step] + [its step over 1 + k tokens + drafting k, k = 1..], a
        request alone: the start-up curve scaled by batch 1's measured calibration, per point where
        measured (`StepCalibration`; none from other batch sizes), made non-decreasing in k
        (`monotone`: a step of more tokens and drafts never costs less; each point's ratio is a
        median of a few noisy steps, and a point measured above both its neighbours would make the
        policy skip the k between them). The same for every request of a step, so made once per
        step (`step_index`)."""
        cached = self._k_times_cache
        if step_index is None or cached is None or cached[0] != step_index or len(cached[1]) <= k_max:
            cal = self.calibration
            times = monotone([cal.ratio(1, StepMode.PLAIN, 1, borrow=False) * self.cost(1, 1)] + [
                cal.ratio(1, StepMode.CHAIN, 1 + k, borrow=False) * self.cost(1, 1 + k) + self.proposer.step_cost(1, k)
                for k in range(1, k_max + 1)])
            if step_index is None:
                return times
            self._k_times_cache = cached = (step_index, times)
        return cached[1]

    def _best_k(self, probs: list[float], k_max: int, step_index: int | None = None) -> int:
        """The k <= k_max that maximizes this request's expected tokens per second alone:
        (1 + P(draft 1 accepted) + ... + P(drafts 1..k accepted)) / (the target's step over
        1 + k tokens + drafting k), on the calibrated curve (`_k_times`): the curve is flat and
        stepped, so a linear verify cost (its mean slope) would overprice the first drafts."""
        times = self._k_times(k_max, step_index)
        best_k, best_rate, tokens = 0, 1.0 / times[0], 1.0
        for k in range(1, k_max + 1):
            tokens += probs[k - 1]
            rate = tokens / times[k]
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def catch_up_debt(self, requests: list[Request], ks: list[int]) -> float:
        """Seconds the drafter would spend catching up before these requests' first drafts: their
        buffered rows beyond a steady round's (k + 1 each: a prompt's, or those left while
        speculation was off), priced by the drafter's recorded catch-ups (`catch_up_seconds`)."""
        rows = self.proposer.pending_rows_of(requests)
        return self.proposer.catch_up_seconds(sum(max(0, n - k - 1) for n, k in zip(rows, ks, strict=True)))

    def best_cap(self, num_decoding: int, requests: list[Request], ks: list[int]) -> int:
        cap, self._chain_rate = self.best_chain(num_decoding, requests, ks)
        return cap

    def best_chain(self, num_decoding: int, requests: list[Request], ks: list[int]) -> tuple[int, float]:
        """The uniform cap c on k (0 = no drafts this step) that maximizes expected tokens/s.

        Rate(c) = (non-speculating tokens + sum_i E[tokens of request i | min(k_i, c) drafts]) /
        (target time for num_decoding + sum_i min(k_i, c) tokens + drafting time at c), the
        target times scaled by the measured calibration of steps without (c = 0) and with drafts
        (per point where measured; with several requests at least the former, FLOOR_ON_AT_OFF);
        a c > 0 must beat c = 0 by MIN_GAIN.
        """
        if self.cost is None:
            return max(ks), 0.0
        cal = self.calibration
        off = cal.ratio(num_decoding, StepMode.PLAIN, num_decoding)
        realized = self.realized_ratio(num_decoding)
        best_c, best_rate = 0, MIN_GAIN * num_decoding / (off * self.cost(num_decoding, num_decoding))
        probs = [self.acceptance.accept_probs(r, k) for r, k in zip(requests, ks, strict=True)]
        floor = off if FLOOR_ON_AT_OFF and num_decoding > 1 else 0.0
        debt = self.catch_up_debt(requests, ks)
        left = [r.sampling_params.max_tokens - r.num_output_tokens for r in requests]
        for c in range(1, max(ks) + 1):
            capped = [min(k, c) for k in ks]
            num_tokens = num_decoding + sum(capped)
            on = max(floor, cal.ratio(num_decoding, StepMode.CHAIN, num_tokens))
            time_s = on * self.cost(num_decoding, num_tokens) + self.proposer.step_cost(len(ks), c)
            if debt:  # spread over the steps these requests are expected to go on speculating
                steps = statistics.mean(n / (1.0 + sum(p[:k])) for n, p, k in zip(left, probs, capped, strict=True))
                time_s += spread_catch_up(debt, steps)
            tokens = num_decoding + sum(sum(p[:k]) for p, k in zip(probs, capped, strict=True))
            if realized * tokens / time_s > best_rate:
                best_c, best_rate = c, realized * tokens / time_s
        return best_c, best_rate

    def realized_ratio(self, num_decoding: int) -> float:
        """How a batch's recent decode steps with drafts measured against their predicted tokens/s
        (REALIZED_WINDOW); 1 for one request (its k has its own calibration and exploration) and
        before REALIZED_MIN such steps."""
        recent = self.realized[BucketedMedians._bucket(num_decoding)]
        if num_decoding <= 1 or len(recent) < REALIZED_MIN:
            return 1.0
        return min(max(statistics.median(recent), REALIZED_CLAMP[0]), REALIZED_CLAMP[1])

    def _observe_realized(self, sched, runner_out) -> None:
        """Compare the step just run with the tokens/s predicted when its drafts were decided
        (`_prediction`): a decode step of the same requests with drafts, its time before drafting
        plus the drafting that made them."""
        prediction, self._prediction = self._prediction, None
        if prediction is None or not sched.scheduled or any(s.num_new_tokens > 1 for s in sched.scheduled):
            return
        num_requests, rate = prediction
        if len(sched.scheduled) != num_requests or not any(s.spec_token_ids for s in sched.scheduled):
            return
        seconds = self._last_execute_s + self._last_draft_s
        tokens = sum(len(t) for t in runner_out.sampled_token_ids)
        if seconds > 0 and rate > 0:
            self.realized[BucketedMedians._bucket(num_requests)].append(tokens / seconds / rate)

    # --- the per-step entry point -----------------------------------------------------------
    def observe_verifications(self, sched, runner_out) -> None:
        """Learn from the step's verifications: a chain's accepted count (`AcceptanceModel`); a
        tree's accepted count (`TreeAcceptance`), its siblings' hits (`SiblingAcceptance`) and
        its top-1 chain's accepted count (`top_chain_observation`, so that chains stay measured
        while trees are chosen)."""
        for s, tokens in zip(sched.scheduled, runner_out.sampled_token_ids, strict=True):
            if not (s.spec_token_ids and tokens):
                continue
            if s.spec_tree is None:
                self.update_acceptance(s.request, len(s.spec_token_ids), len(tokens) - 1)
                continue
            self.trees.tree_model(s.request).observe(len(tokens) - 1, len(s.spec_token_ids))
            self.trees.sibling_acceptance.observe(s.spec_tree, tokens)
            drafted, accepted = top_chain_observation(s.spec_tree, tokens)
            if drafted:
                self.update_acceptance(s.request, drafted, accepted)

    def propose_for_step(
        self, running: list[Request], sched, runner_out, step_index: int, context: ProposeContext
    ) -> dict[str, Draft]:
        """Drafts to verify next step, by request id (only non-empty ones).

        Only requests this step scheduled that are still running and decoding draft: a running
        request left out of the step committed nothing new, so the proposer has nothing new to
        draft from (the drafts it may hold are still valid and wait for their step). The drafts
        of all running requests together fit in the next step's token budget next to one token
        for each running request, in scheduling order, so the scheduler verifies what was drafted.
        """
        t_start = time.perf_counter()
        try:
            return self._propose_for_step(running, sched, runner_out, step_index, context)
        finally:
            self._last_draft_s = time.perf_counter() - t_start

    def _propose_for_step(self, running: list[Request], sched, runner_out, step_index: int,
                          context: ProposeContext) -> dict[str, Draft]:
        self._observe_realized(sched, runner_out)
        self.proposer.observe_step(sched, runner_out)
        self.observe_verifications(sched, runner_out)
        scheduled_ids = {s.request.request_id for s in sched.scheduled}
        decoding = [r for r in running if r.request_id in scheduled_ids and r.is_decoding]
        if not decoding:
            return {}
        if self.config.uses_tree and (not self.config.adaptive or self._trees_may_pay(decoding, step_index)):
            return self._propose_trees(running, decoding, scheduled_ids, context)
        if self._off is not None:
            until, ids = self._off
            if (step_index < until and step_index % self.probes.interval(len(decoding)) != 0
                    and ids == tuple(r.request_id for r in decoding)):
                self.num_steps_off += 1
                return {}
            self._off = None
        memo, self._chain_memo = self._chain_memo, None
        if memo is not None and memo[:2] != (step_index, tuple(r.request_id for r in decoding)):
            memo = None
        ks = memo[2] if memo is not None else [self.choose_k(r, step_index) for r in decoding]
        candidates = [(r, k) for r, k in zip(decoding, ks, strict=True) if k > 0]
        drafts = None
        if candidates and self.proposer.propose_is_free:
            # n-gram lookup costs microseconds: look first, then decide on what was found
            # (most requests of unpredictable text find no match and would draft nothing).
            drafts = self.proposer.propose([r for r, _ in candidates], [k for _, k in candidates], context)
            found = [(r, len(d.token_ids), d) for (r, _), d in zip(candidates, drafts, strict=True) if d.token_ids]
            candidates = [(r, k) for r, k, _ in found]
            drafts = [d for _, _, d in found]
        if candidates and self.config.adaptive:
            self._chain_rate = None
            if memo is not None and memo[3] is not None and not self.proposer.propose_is_free:
                cap, self._chain_rate = memo[3]  # (the same requests and ks: `_trees_pay`'s)
            else:
                cap = self.best_cap(len(decoding), [r for r, _ in candidates], [k for _, k in candidates])
            self.probes.judge(cap)
            rate = self._chain_rate
            probe = cap == 0 and step_index % self.probes.interval(len(decoding)) == 0
            if probe:
                self.probes.probed()
                cap = 1  # a rare probe keeps the acceptance and drafting-cost estimates fresh
                keep = self._cheap_probes([r for r, _ in candidates])
                candidates = [candidates[i] for i in keep]
                drafts = None if drafts is None else [drafts[i] for i in keep]
            if cap == 0:
                candidates, drafts = [], None
                self.num_steps_off += 1
                if not self.proposer.propose_is_free:  # (a lookup's finds change from step to step)
                    self._off = (step_index + OFF_RECHECK, tuple(r.request_id for r in decoding))
            elif (len(decoding) > 1 and not probe and step_index - self._last_off_probe >= OFF_PROBE_EVERY
                  and self.calibration.samples(len(decoding), StepMode.PLAIN, len(decoding)) < POINT_SAMPLES):
                # a step without drafts, so that the batch's cost without them stays measured
                self._last_off_probe = step_index
                self.num_off_probes += 1
                candidates, drafts = [], None
            elif len(decoding) == 1 and not probe and not self.proposer.propose_is_free:
                r = decoding[0]
                k = self._explore(r, cap, step_index)
                self.num_explored += k != cap
                candidates = [(r, k)]
            else:
                candidates = [(r, min(k, cap)) for r, k in candidates]
                if len(decoding) > 1 and not probe and rate is not None:
                    # (scaled by the realized ratio already: what it measures is the unscaled one)
                    self._prediction = (len(decoding), rate / self.realized_ratio(len(decoding)))
        if candidates and self.max_num_batched_tokens is not None:
            pending = sum(len(r.spec_token_ids) for r in running if r.request_id not in scheduled_ids)
            room = self.max_num_batched_tokens - len(running) - pending
            fitted = []
            for r, k in candidates:
                fitted.append((r, max(0, min(k, room))))
                room -= fitted[-1][1]
            candidates = fitted
        if drafts is not None:
            drafts = [Draft(d.token_ids[:k], None if d.probs is None else d.probs[:k])
                      for d, (_, k) in zip(drafts, candidates, strict=True)]
        keep = [i for i, (_, k) in enumerate(candidates) if k > 0]
        candidates = [candidates[i] for i in keep]
        if not candidates:
            return {}
        self.num_steps_on += 1
        requests = [r for r, _ in candidates]
        if drafts is None:
            drafts = self.proposer.propose(requests, [k for _, k in candidates], context)
        else:
            drafts = [drafts[i] for i in keep]
        return {r.request_id: d for r, d in zip(requests, drafts, strict=True) if d.token_ids}

    def _explore(self, request: Request, k: int, step_index: int) -> int:
        """The k a lone decoding request drafts this step, given the policy's best k: a neighbour
        (k + 1, then k - 1) whose calibration point has fewer than POINT_SAMPLES steps, every
        EXPLORE_EVERY steps (every EXPLORE_REFRESH steps regardless of its samples, k + 1 and
        k - 1 in turn); else k. A neighbour that measures faster than the start-up curve said
        becomes the best k, and its own neighbour is measured next."""
        if step_index % EXPLORE_EVERY:
            return k
        refresh = step_index % EXPLORE_REFRESH == 0
        order = (k - 1, k + 1) if refresh and (step_index // EXPLORE_REFRESH) % 2 else (k + 1, k - 1)
        for j in order:
            if max(1, self.config.min_speculative_tokens) <= j <= self.max_k(request) and (refresh or self.calibration.samples(1, StepMode.CHAIN, 1 + j) < POINT_SAMPLES):
                return j
        return k

    def _cheap_probes(self, requests: list[Request]) -> list[int]:
        """Indices of the requests a probe drafts for: those whose drafter is caught up to within
        PROBE_CATCH_UP_ROWS positions, or else the one closest. While speculation is off a layer
        drafter's rows wait un-run (feature_buffers.LAZY_BUFFER_ROWS); a probe of every request would
        run them all at once, a stall of the whole batch to refresh an estimate."""
        pending = self.proposer.pending_rows_of(requests)
        keep = [i for i, p in enumerate(pending) if p <= PROBE_CATCH_UP_ROWS]
        return keep or [min(range(len(requests)), key=pending.__getitem__)]

    def _tree_plan(self, r: Request) -> tuple[int, int, int]:
        """(nodes, levels, width) of the tree r would draft (before the step's token budget):
        `TreePolicy.plan` within tree_depth levels (capped like a chain's k by `max_k`) and
        tree_nodes nodes (capped by the model length)."""
        max_nodes = min(self.config.tree_nodes, self.max_model_len - r.num_tokens - 1)
        return self.trees.plan(r, self.max_k(r, self.config.tree_depth), max_nodes, self.cost, self.acceptance)

    def _trees_may_pay(self, decoding: list[Request], step_index: int) -> bool:
        """`_trees_pay`, except that trees priced far below the best chain for the same decoding
        requests are not priced again before the next probe step (`TreePolicy.priced_far`)."""
        if self.trees.priced_far(step_index, tuple(r.request_id for r in decoding)):
            return False
        return self._trees_pay(decoding, step_index)

    def _trees_pay(self, decoding: list[Request], step_index: int) -> bool:
        """The adaptive choice between trees and chains (`SpeculativeConfig.tree_nodes` with
        `adaptive`) for this step's decoding requests: their trees' predicted tokens/s
        (`TreePolicy.price`) against the best chain cap's (`best_chain`, which also covers no
        drafts), decided by `TreePolicy.decide` (probes and the greedy trees' floor included). A
        request that sets its own num_speculative_tokens drafts a chain either way; with no
        request planned wider than 1, chains decide. The chain decision is kept for the step
        (`_chain_memo`)."""
        if self.cost is None:
            return True
        request_ids = tuple(r.request_id for r in decoding)
        plans = [(r, *self._tree_plan(r)) for r in decoding if r.sampling_params.num_speculative_tokens is None]
        b = len(decoding)
        price = self.trees.price(plans, b, self.cost, self.calibration, self.acceptance, self.catch_up_debt)
        if price is None:  # (every plan a chain: priced again at the next probe step)
            self.trees.far = (step_index, request_ids)
            return False
        ks = [self.choose_k(r, step_index) for r in decoding]
        chain_ks = [(r, k) for r, k in zip(decoding, ks, strict=True) if k > 0]
        chain = None
        if chain_ks:
            chain = self.best_chain(b, [r for r, _ in chain_ks], [k for _, k in chain_ks])
            chain_rate = chain[1]
        else:
            chain_rate = b / (self.calibration.ratio(b, StepMode.PLAIN) * self.cost(b, b))
        self._chain_memo = (step_index, request_ids, ks, chain)
        return self.trees.decide(price, chain_rate, step_index, request_ids, self.cost)

    def _propose_trees(self, running: list[Request], decoding: list[Request], scheduled_ids: set[str],
                       context: ProposeContext) -> dict[str, Draft]:
        """Tree speculation (`SpeculativeConfig.tree_nodes`): every decoding request that may
        speculate drafts a tree of up to tree_nodes nodes and tree_depth levels (levels capped
        like a chain's k by `max_k`), except a request that sets its own
        `num_speculative_tokens`, which drafts a chain of that many. Drafts are cut to the
        model length and to the step's token budget in scheduling order, as chains are. With
        `adaptive`, `_trees_pay` decided that trees beat chains (and no drafts) this step, and
        each request's tree is sized by its own acceptance (`_tree_plan`); a request planned at
        width 1 drafts that plan as a chain."""
        room = None
        if self.max_num_batched_tokens is not None:
            pending = sum(len(r.spec_token_ids) for r in running if r.request_id not in scheduled_ids)
            room = self.max_num_batched_tokens - len(running) - pending
        trees: list[tuple[Request, int, int, int]] = []  # (request, nodes, levels, width)
        chains: list[tuple[Request, int]] = []  # (request, k)
        for r in decoding:
            is_chain = r.sampling_params.num_speculative_tokens is not None
            width = 1
            if is_chain:
                depth = self.max_k(r)
                nodes = min(depth, self.max_model_len - r.num_tokens - 1)
            else:
                nodes, depth, width = self._tree_plan(r)
                # the policy's width-1 tree is a chain: drafted as one (`_trees_pay` predicted it so)
                is_chain = self.config.adaptive and width == 1
            if room is not None:
                nodes = min(nodes, room)
            if depth <= 0 or nodes <= 0:
                continue
            if room is not None:
                room -= nodes
            if is_chain:
                chains.append((r, nodes))
            else:
                trees.append((r, nodes, min(depth, nodes), width))
        if not trees and not chains:
            return {}
        self.num_steps_on += 1
        drafts: dict[str, Draft] = {}
        if chains:
            made = self.proposer.propose([r for r, _ in chains], [k for _, k in chains], context)
            drafts.update((r.request_id, d) for (r, _), d in zip(chains, made, strict=True))
        if trees:
            t0 = time.perf_counter()
            context = dataclasses.replace(context, tree_min_logprob=self.trees.tree_floor())
            made = self.proposer.propose_trees([r for r, _, _, _ in trees], [n for _, n, _, _ in trees],
                                               [d for _, _, d, _ in trees], context, [w for *_, w in trees])
            self.trees.tree_rounds.add(len(trees), time.perf_counter() - t0)
            self.num_tree_steps += 1
            for (r, *_), d in zip(trees, made, strict=True):
                if not d.token_ids:  # the floor kept no node: a verification of nothing
                    self.trees.tree_model(r).observe(0, 0)
            drafts.update((r.request_id, d) for (r, *_), d in zip(trees, made, strict=True))
        return {rid: d for rid, d in drafts.items() if d.token_ids}
