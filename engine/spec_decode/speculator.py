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
  decode step's measured time is compared with the curve's prediction, separately for steps with
  and without drafts and per batch-size bucket (`StepCalibration`), and the decision scales each
  side by its own measured ratio.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import math
import statistics
import time

import torch

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec_decode.proposers.base import BucketedMedians, Draft, ProposeContext, Proposer

logger = logging.getLogger("engine")

PROBE_EVERY = 8  # a request whose drafts stopped paying retries k=1 this often
PROBE_CATCH_UP_ROWS = 16  # a step's probe drafts for requests with at most this many rows to catch up
# A step whose drafts do not pay (cap 0) leaves the next OFF_RECHECK - 1 steps of the same decoding
# requests without drafts unweighed: nothing the decision reads changes without verifications
# but the calibration, slowly (the per-request k and cap weighing took ~0.4 ms of a 17 ms step at
# 16 requests); a probe step, or another set of requests, weighs again.
OFF_RECHECK = 8
PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before the engine's first verification
PRIOR_TRIALS = 2.0  # weight of that prior (and of position j-1's rate for position j), in trials
REQUEST_PRIOR_TRIALS = 4.0  # weight of the engine-wide rate in a request's own estimate
# A step speculates only if its predicted tokens/s beat not speculating by this factor: the
# predicted time of a step with drafts runs 2-5% short of the measured one (bench, batch 16), so
# a smaller predicted gain is a coin flip that costs the variance of speculating.
MIN_GAIN = 1.03
# With several requests, a step with drafts is predicted at least as slow, relative to the
# start-up curve, as the same batch's steps without (the on-side ratio floored at the off side's).
# The calibrated ratios cover pure decode steps; what a batch's speculation also costs is not in
# them: the drafter's catch-up over every admitted prompt, the steps that verify next to a
# prefill. At 16 sustained requests (stop 34) decode steps without drafts measured 1.5x the curve
# and with drafts 1.05x, so speculation looked 35% faster and ran 15-20% slower (560-590 vs
# 660-710 tokens/s) until the floor. One request's steps keep their own ratios (the batch-1 k).
FLOOR_ON_AT_OFF = True
GLOBAL_DECAY = 1.0 / 256  # engine-wide counts forget with a horizon of ~256 verifications
TREE_PROBE_EVERY = 16  # with adaptive trees, a step drafts trees this often even where chains pay more,
TREE_PROBE_WITHIN = 0.8  # if the trees' predicted tokens/s is at least this fraction of the chain's
# Trees predicted below TREE_PROBE_WITHIN of the chain are not priced again for the same decoding
# requests until the next TREE_PROBE_EVERY step (pricing them was ~0.2 ms of Python a batch-1 step).
# Draft nodes per floored tree assumed before the first one is verified (weight PRIOR_TRIALS):
# optimistic, as TREE_PRIOR_ACCEPTED is (a floor keeps a few confident nodes).
FLOORED_PRIOR_NODES = 5.0
# Floored trees priced far below chains are probed every TREE_PROBE_EVERY steps until
# FLOORED_PROBE_TRIALS of them are measured, then every TREE_FAR_PROBE_EVERY steps (a probe of a
# tree that does not pay costs its step's difference; measured, it need not be paid often).
FLOORED_PROBE_TRIALS = 8
TREE_FAR_PROBE_EVERY = 128
TREE_PRIOR_ACCEPTED = 3.0  # accepted drafts per tree verification assumed before the first one
# P(a node's j-th drafted child is accepted | its earlier children were not), j >= 2, assumed
# before the first tree verification measures it (weight PRIOR_TRIALS): optimistic enough that
# the first trees are drafted wide and measured, as TREE_PRIOR_ACCEPTED is for their depth.
SIBLING_PRIOR = 0.3
# Decisions read each deeper position's rate (2, 3, ...) as its mean plus this many standard errors.
# Position j is verified only on steps that drafted at least j tokens, which the policy itself
# chooses: on its posterior mean alone, one early rejection at position 2 (its rate then 0.54 for
# the shipped EAGLE-3 head, 0.60 for the MTP layer; 0.78-0.84 once measured) stopped every later
# step from drafting 2, so the estimate was never corrected and the policy verified one draft per
# step for the rest of the run.
POSITION_CONFIDENCE_Z = 1.0
PROFILE_ROUNDS = 3  # the start-up step-cost profile times each point this often, interleaved
POINT_SAMPLES = 3  # a (side, batch bucket, tokens per request) point's own calibration counts from this many steps
POINT_WINDOW = 16  # the steps a point keeps (the last ones)
POINT_HORIZON = 256  # a point forgets its steps older than this many steps of its batch bucket (both sides)
# ... this many with several requests: a batch's steps come in bursts of one side (its policy stays on
# or off for many steps), and its first steps after the prompts' prefill run slow (1.5-3x the
# curve). At 16 sustained requests of sampled text (stop 38) the only steps without drafts were
# the run's first 9, at 2.6-3.1x the curve; the policy, pricing a step without drafts from them at
# 20 ms where it took 8.5, speculated every step after and ran 0.82-0.84x no speculation.
BATCH_POINT_HORIZON = 64
# While a batch of several requests speculates, one step in this many goes without drafts if the
# batch's point without drafts has fewer than POINT_SAMPLES recent steps (within
# BATCH_POINT_HORIZON), so that the cost the decision compares against stays measured.
OFF_PROBE_EVERY = 16
# With several requests, a step's predicted tokens/s with drafts is scaled by how the batch's recent
# steps with drafts measured against their prediction: the median, over its last REALIZED_WINDOW
# decode steps with drafts (from REALIZED_MIN of them), of (tokens made / (the step's time + the
# drafting that made its drafts)) / (the tokens/s `best_chain` predicted for it), within
# REALIZED_CLAMP. The prediction leaves out the drafter's bookkeeping of the verified rows and
# the policy's own time (3.7-3.8 ms of drafting at 16 requests x 2 drafts where the drafting
# rounds said 2.4) and reads acceptance optimistically (`POSITION_CONFIDENCE_Z`): at 16 sustained
# requests of sampled text (stop 38) it predicted 8% over no drafts where the steps ran 7% under.
REALIZED_WINDOW = 16
REALIZED_MIN = 4
REALIZED_CLAMP = (0.5, 1.5)
# The host's speed is read from a bucket's last DRIFT_WINDOW steps at measured points (their median
# residual): a burst of a few slow steps (the first steps after a prefill run 1.5x) moves it little,
# a slowdown that lasts shifts every point of the bucket within ~DRIFT_WINDOW / 2 steps.
DRIFT_WINDOW = 9
# One request decoding: a step this often drafts one more (or one fewer) than the best k while that
# k's point has fewer than POINT_SAMPLES steps, and every EXPLORE_REFRESH steps regardless, so that
# the policy's k follows measured steps rather than the start-up curve's shape (`StepCalibration`).
EXPLORE_EVERY = 4
# A step that would start speculating for requests whose drafter must first catch up over many rows
# (their prompts, or the rows left while speculation was off) pays that catch-up once: the decision
# spreads it over the steps the requests are expected to go on (their tokens left / expected tokens
# a step), at most this many. 16 requests at once: with it unweighed, a step 79 of 96 turned drafts
# on for all 16 (an 87 ms catch-up over 3,300 rows) to speculate for 3 steps; the run lost 10%.
CATCH_UP_HORIZON = 64
EXPLORE_REFRESH = 64


def probe_interval(num_decoding: int) -> int:
    """Steps between the probes of a step whose drafts do not pay (one draft per request): 32 up
    to 7 requests, then 32 per 4 requests (128 at 16). A probe's cost grows with the batch (every
    request's verification, and an EAGLE head's catch-up over the rows it skipped): at 16 requests,
    one every 32 steps cost the engine 2-7% in interleaved runs (16 at once: 454 vs 464 and 427 vs
    460 tokens/s without probes)."""
    return 4 * PROBE_EVERY * max(1, num_decoding // 4)


class StepCostModel:
    """Target step time as a function of (requests in the step, tokens in the step), measured
    once at start-up on a grid of batch sizes x tokens per request, interpolated linearly.

    Batch size matters on its own: each request attends over its own context, so 16 requests
    verifying 5 tokens cost more than one request with 80 tokens.
    """

    def __init__(self, batch_sizes: list[int], tokens_per_request: list[int], times: list[list[float]]) -> None:
        self.batch_sizes, self.tokens_per_request, self.times = batch_sizes, tokens_per_request, times

    def _row(self, i: int, q: float) -> float:
        qs, ts = self.tokens_per_request, self.times[i]
        if q <= qs[0]:
            return ts[0]
        if q >= qs[-1]:
            return ts[-1] * q / qs[-1]
        j = bisect.bisect_left(qs, q)
        return ts[j - 1] + (q - qs[j - 1]) / (qs[j] - qs[j - 1]) * (ts[j] - ts[j - 1])

    def __call__(self, num_requests: int, num_tokens: int) -> float:
        b = self.batch_sizes
        q = num_tokens / max(num_requests, 1)
        if num_requests <= b[0]:
            return self._row(0, q)
        if num_requests >= b[-1]:
            return self._row(len(b) - 1, q) * num_requests / b[-1]
        i = bisect.bisect_left(b, num_requests)
        frac = (num_requests - b[i - 1]) / (b[i] - b[i - 1])
        return self._row(i - 1, q) + frac * (self._row(i, q) - self._row(i - 1, q))

    def as_dict(self) -> dict:
        return {f"{b}x{q}": self.times[i][j] for i, b in enumerate(self.batch_sizes)
                for j, q in enumerate(self.tokens_per_request)}


def monotone(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators: each run that
    decreases is replaced by its mean, merging backwards while the means still decrease)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


class StepCalibration:
    """Measured step time / the cost model's prediction, for decode steps with drafts ("on"),
    without ("off") and with token trees ("tree": a tree's verification also pays its mask and
    per-token attention tables), split into the host's current speed (`drift`) and each point's
    shape: a point is (side, batch-size bucket, tokens per request rounded).

    A step's log ratio is modelled as drift(bucket, now) + shape(point) + noise. The drift of a
    bucket is the median of its last DRIFT_WINDOW residuals (a step's log ratio less its point's
    shape, from measured points only); a step is stored at its point as its log ratio less the
    drift at the time, and a point's shape is the median of its last POINT_WINDOW such values,
    used once it holds POINT_SAMPLES of them. `ratio` answers exp(drift now + shape). So a host
    that slows down for a while moves every point of the bucket together, measured or not: only
    relative costs decide k, and they stay as measured. (Until stop 37 each point kept its raw
    ratios: a second of a slowed host, 2.4-2.8x the curve, measured while k = 4-6 were drafted,
    stayed with those points after the host recovered, and since the policy no longer drafted them
    nothing corrected them: k = 2 for the next ~140 steps, 1.42x where fixed k = 5 made 1.88x.)

    Why points: the start-up curve's shape is itself a measurement on a shared host, and it
    varies between engines of the same models (in one process, three profiles of the shipped
    target at batch 1: one token 3.8-4.3 ms, five tokens 5.2-5.5 ms, two tokens from 1.0x to 1.17x
    one), so a policy reading the curve alone drafted 2-3 in one engine where another drafted 5.
    Each step is compared with the curve at its own point only, and the drift is estimated from
    residuals against each step's own point, so it does not move with the mix of k the policy
    drafts. (Until stop 35 a point kept each step's ratio relative to its side's median at the time,
    a median that mixes every k drafted: in a run of EAGLE-3 at batch 1 it read the 6-token point
    1.21x and the 7-token point 0.88x their measured steps, and the policy drafted 6 where 5 paid
    more.) A point forgets steps older than POINT_HORIZON steps of its bucket, both sides counted
    (BATCH_POINT_HORIZON with several requests; a shape can change too: contexts grow, and a
    point's first steps can carry a transient the drift did not see yet), and a point left with
    fewer than POINT_SAMPLES reads as unmeasured (the policy explores it again,
    `Speculator._explore`; a batch's point without drafts is probed, `OFF_PROBE_EVERY`). An unmeasured point reads its side's
    median shape (`BucketedMedians` of the drift-free ratios) times the drift; a side with no
    sample yet borrows another's (tree: on, then off; on: off; off: on); with none at all the
    shape is 1."""

    FALLBACK = {False: (False, True), True: (True, False), "tree": ("tree", True, False)}

    def __init__(self) -> None:
        self.sides = {False: BucketedMedians(), True: BucketedMedians(), "tree": BucketedMedians()}
        # point -> its last POINT_WINDOW (step count of its side and bucket, log ratio less the drift)
        self.points: dict[tuple, collections.deque[tuple[int, float]]] = {}
        self.clock: collections.Counter = collections.Counter()  # steps added per bucket (both sides)
        self.residuals = [collections.deque(maxlen=DRIFT_WINDOW) for _ in BucketedMedians.BUCKETS]
        self._drift: list[float | None] = [None] * len(BucketedMedians.BUCKETS)  # median of residuals, cached
        self._shapes: dict[tuple, float | None] = {}  # each point's shape until the next step (a step asks ~12)

    @staticmethod
    def _point(num_requests: int, speculating: bool | str, num_tokens: int) -> tuple:
        return speculating, BucketedMedians._bucket(num_requests), round(num_tokens / max(num_requests, 1))

    def drift(self, num_requests: int) -> float:
        """The bucket's log drift: the median of its recent residuals (0 before any)."""
        i = BucketedMedians._bucket(num_requests)
        if self._drift[i] is None:
            self._drift[i] = statistics.median(self.residuals[i]) if self.residuals[i] else 0.0
        return self._drift[i]

    def _shape(self, key: tuple) -> float | None:
        """The point's log shape: the median of its recent drift-free values, None while it holds
        fewer than POINT_SAMPLES."""
        if key not in self._shapes:
            recent = self._recent(key)
            self._shapes[key] = statistics.median(recent) if len(recent) >= POINT_SAMPLES else None
        return self._shapes[key]

    def add(self, num_requests: int, speculating: bool | str, ratio: float, num_tokens: int | None = None) -> None:
        bucket = BucketedMedians._bucket(num_requests)
        log_ratio = math.log(max(ratio, 1e-9))
        drift = self.drift(num_requests)
        key = None if num_tokens is None else self._point(num_requests, speculating, num_tokens)
        shape = None if key is None else self._shape(key)
        if shape is not None:
            self.residuals[bucket].append(log_ratio - shape)
        self.sides[speculating].add(num_requests, math.exp(log_ratio - drift))
        self.clock[bucket] += 1
        self._shapes.clear()
        self._drift[bucket] = None
        if key is not None:
            self.points.setdefault(key, collections.deque(maxlen=POINT_WINDOW)).append((self.clock[bucket], log_ratio - drift))

    def _recent(self, key: tuple) -> list[float]:
        """The point's drift-free log ratios from the last POINT_HORIZON steps of its bucket
        (BATCH_POINT_HORIZON for buckets of several requests)."""
        bucket = key[1]
        now = self.clock[bucket]
        horizon = POINT_HORIZON if BucketedMedians.BUCKETS[bucket] == 1 else BATCH_POINT_HORIZON
        return [r for t, r in self.points.get(key, ()) if now - t < horizon]

    def samples(self, num_requests: int, speculating: bool | str, num_tokens: int) -> int:
        """Steps measured at the point of (num_requests, num_tokens) on this side."""
        return len(self._recent(self._point(num_requests, speculating, num_tokens)))

    def ratio(self, num_requests: int, speculating: bool | str, num_tokens: int | None = None,
              borrow: bool = True) -> float:
        """exp(the bucket's drift now + the point's shape) when num_tokens is given and its point
        measured, else the drift times the side's median shape (without `borrow`: only this
        batch-size bucket's measurements count, else the shape is 1)."""
        drift = self.drift(num_requests)
        if num_tokens is not None:
            shape = self._shape(self._point(num_requests, speculating, num_tokens))
            if shape is not None:
                return math.exp(drift + shape)
        for side in self.FALLBACK[speculating]:
            measured = self.sides[side].median(num_requests, borrow)
            if measured is not None:
                return math.exp(drift) * measured
        return math.exp(drift)

    def as_dict(self) -> dict:
        names = {False: "off", True: "on", "tree": "tree"}
        out = {f"{names[k]}@{b}": math.exp(self.drift(b)) * m for k, side in self.sides.items() for b, m in side.as_dict().items()}
        out.update({f"drift@{b}": math.exp(self.drift(b)) for i, b in enumerate(BucketedMedians.BUCKETS) if self.residuals[i]})
        for side, bucket, q in sorted(self.points, key=lambda key: (str(key[0]), key[1:])):
            if len(self._recent((side, bucket, q))) >= POINT_SAMPLES:
                n = BucketedMedians.BUCKETS[bucket]
                out[f"{names[side]}@{n}x{q}"] = self.ratio(n, side, n * q)
        return out


class AcceptanceModel:
    """Predicts how many drafts of a request the target will accept.

    Engine-wide, it keeps the conditional acceptance rate of each draft position j (accepted at j
    given that j-1 was accepted), as counts that decay over ~256 verifications; drafters differ
    here (Medusa head j is much weaker than head 1, a draft model less so). Per request, it keeps
    decayed counts of accepted and rejected drafts (decay `acceptance_ema_alpha` per
    verification), shrunk toward the engine-wide rate with REQUEST_PRIOR_TRIALS pseudo-trials.

    P(draft j accepted) = prod_{l <= j} min(1, rho * g_l), where g_l is the engine-wide rate at
    position l and rho = the request's rate / the engine-wide per-token rate (how much easier this
    request's text is than average). The rates decisions read (`accept_probs`) are optimistic for
    positions 2 and deeper: g_l plus POSITION_CONFIDENCE_Z standard errors of its (decayed,
    shrunk) count, but no more than g_{l-1} (its prior: a deeper position is assumed as good as
    the one before until measured otherwise), so that a position drafted too rarely to be known
    gets drafted and measured, while one measured often enough is taken at its mean. Position 1
    is measured by every speculating step and is read at its mean (it alone decides whether a
    step speculates at all). Shrinkage matters: a raw per-request EMA of a few Bernoulli
    trials, used to pick who speculates, overestimates acceptance (measured: Medusa at batch 16 on
    random text predicted 0.46, realized 0.27), and a fixed prior for new requests is wrong for
    text the drafter rarely guesses.
    """

    def __init__(self, request_decay: float, max_positions: int = 16) -> None:
        self.request_decay = request_decay
        self.success = [0.0] * max_positions
        self.trials = [0.0] * max_positions
        # (g_1..g_max, their optimistic values, per-token rate), recomputed after each observe
        self._engine_wide: tuple[list[float], list[float], float] | None = None

    def observe(self, request: Request, num_draft: int, num_accepted: int) -> None:
        self._engine_wide = None
        keep = 1.0 - GLOBAL_DECAY
        for j in range(min(num_draft, len(self.trials))):  # position j + 1 was reached iff n >= j
            self.success[j] *= keep
            self.trials[j] *= keep
            if num_accepted >= j:
                self.trials[j] += 1.0
                self.success[j] += float(num_accepted > j)
        # per request: n successes and, if n < k, one failure (a truncated geometric observation)
        failures = 1.0 if num_accepted < num_draft else 0.0
        s, t = request.acceptance_counts
        keep = 1.0 - self.request_decay
        request.acceptance_counts = (keep * s + num_accepted, keep * t + num_accepted + failures)

    def _engine(self) -> tuple[list[float], list[float], float]:
        """Every position's rate, its optimistic value and the per-token rate, computed once per
        change (each step asks for them once per decoding request)."""
        if self._engine_wide is None:
            rates, upper, prev = [], [], PRIOR_ACCEPTANCE
            for j, (s, t) in enumerate(zip(self.success, self.trials, strict=True)):
                g = (s + PRIOR_TRIALS * prev) / (t + PRIOR_TRIALS)
                bonus = POSITION_CONFIDENCE_Z * math.sqrt(g * (1.0 - g) / (t + PRIOR_TRIALS))
                upper.append(max(g, min(g + bonus, prev)) if j else g)
                rates.append(g)
                prev = g
            rate = (sum(self.success) + PRIOR_TRIALS * PRIOR_ACCEPTANCE) / (sum(self.trials) + PRIOR_TRIALS)
            self._engine_wide = (rates, upper, rate)
        return self._engine_wide

    def position_rates(self, k: int) -> list[float]:
        """g_1..g_k: each position's rate, shrunk toward the previous position's (or the prior);
        positions beyond those tracked repeat the last one."""
        rates = self._engine()[0]
        return rates[:k] + rates[-1:] * max(0, k - len(rates))

    def optimistic_rates(self, k: int) -> list[float]:
        """`position_rates`, positions 2.. raised by up to POSITION_CONFIDENCE_Z standard errors
        (at most to the previous position's rate)."""
        upper = self._engine()[1]
        return upper[:k] + upper[-1:] * max(0, k - len(upper))

    def engine_rate(self) -> float:
        """Engine-wide per-token acceptance (successes over trials, all positions)."""
        return self._engine()[2]

    def request_rate(self, request: Request) -> float:
        s, t = request.acceptance_counts
        return (s + REQUEST_PRIOR_TRIALS * self.engine_rate()) / (t + REQUEST_PRIOR_TRIALS)

    def accept_probs(self, request: Request, k: int) -> list[float]:
        """P(draft j accepted) for j = 1..k, as decisions read it (`optimistic_rates`)."""
        rho = self.request_rate(request) / max(self.engine_rate(), 1e-6)
        out, p = [], 1.0
        for g in self.optimistic_rates(k):
            p *= min(1.0, rho * g)
            out.append(p)
        return out

    def expected_tokens(self, request: Request, k: int) -> float:
        """Expected tokens from one verification with k drafts (accepted drafts + 1)."""
        return 1.0 + sum(self.accept_probs(request, k))


class TreeAcceptance:
    """Accepted drafts per tree verification, engine-wide, as counts that decay like
    `AcceptanceModel`'s (~256 verifications), shrunk toward a prior of TREE_PRIOR_ACCEPTED with
    PRIOR_TRIALS pseudo-verifications (an optimistic prior: the first trees are tried, then
    measured); and the draft nodes per tree (a value floor, `Speculator.tree_floor`, drafts fewer
    than the plan's; a tree the floor left empty counts as a verification of 0 nodes, 0 accepted)."""

    def __init__(self, prior_nodes: float | None = None) -> None:
        self.accepted = 0.0
        self.trials = 0.0
        self.nodes = 0.0
        self.prior_nodes = prior_nodes

    def observe(self, num_accepted: int, num_nodes: int) -> None:
        keep = 1.0 - GLOBAL_DECAY
        self.accepted = keep * self.accepted + num_accepted
        self.trials = keep * self.trials + 1.0
        self.nodes = keep * self.nodes + num_nodes

    def mean(self) -> float:
        return (self.accepted + PRIOR_TRIALS * TREE_PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

    def mean_nodes(self, planned: float) -> float:
        """Draft nodes per tree, shrunk like `mean` toward the prior given at construction, or
        toward `planned` (the plan's node count) without one; at most `planned`."""
        prior = planned if self.prior_nodes is None else min(self.prior_nodes, planned)
        return min(planned, (self.nodes + PRIOR_TRIALS * prior) / (self.trials + PRIOR_TRIALS))


class SiblingAcceptance:
    """How often a tree node's later children save a step, engine-wide: for rank j >= 1 (the
    node's (j+1)-th drafted child: the drafter's (j+1)-th most probable token for a greedy request,
    its (j+1)-th draw for a sampled one), the rate at which it is accepted when the node was
    reached and its children of rank < j were not, as counts that decay like `AcceptanceModel`'s,
    shrunk toward SIBLING_PRIOR with PRIOR_TRIALS pseudo-trials. Measured from every tree
    verification along the accepted path (`observe`), so at every reached node, not only the root.

    Example: a root with children (5, 6, 7) and the target's tokens [7, ...]: rank 1 (6) was tried
    and rejected, rank 2 (7) tried and accepted; then the walk goes on from 7's children."""

    MAX_RANK = 8

    def __init__(self) -> None:
        self.hits = [0.0] * self.MAX_RANK
        self.trials = [0.0] * self.MAX_RANK

    def observe(self, tree, tokens: list[int]) -> None:
        """A verified tree (`DraftTree`) and the tokens the verification produced: the accepted
        path's tokens, then the bonus token (at a leaf) or the correction token (at a node whose
        children were all rejected: it may equal a child's token when sampled, and is no hit)."""
        keep = 1.0 - GLOBAL_DECAY
        self.hits = [keep * h for h in self.hits]
        self.trials = [keep * t for t in self.trials]
        node = 0
        for token in tokens[:-1]:
            kids = tree.children[node]
            match = [c for c in kids if tree.token_ids[c] == token]
            if not match:  # (not a path of this tree)
                return
            rank = kids.index(match[0])
            for j in range(1, min(rank + 1, self.MAX_RANK)):  # ranks 1..rank were tried, the last one hit
                self.trials[j] += 1.0
                self.hits[j] += j == rank
            node = match[0]
        for j in range(1, min(len(tree.children[node]), self.MAX_RANK)):  # every child rejected
            self.trials[j] += 1.0

    def rate(self, rank: int) -> float:
        """P(the child of this rank is accepted | its node reached, the lower ranks not), rank >= 1."""
        return (self.hits[rank] + PRIOR_TRIALS * SIBLING_PRIOR) / (self.trials[rank] + PRIOR_TRIALS)


def top_chain_observation(tree, tokens: list[int]) -> tuple[int, int]:
    """The chain observation a verified tree holds: its path of first children from the root (the
    drafter's top draft at each depth after its top drafts: the chain a chain step would have
    drafted, as deep as the tree follows it) and how many of those drafts the verification's
    tokens accepted, as (drafted, accepted) for `AcceptanceModel.observe`. Without it a policy
    that picks trees stops measuring chains: the chain estimate it compares trees against stays
    wherever it was when trees won (a censoring trap).

    Example: a root with children (5, 6), 5 -> 7: the chain is (5, 7); tokens [5, 7, 2] accept
    both, [5, 3] one, [6, ...] none (the first child rejected)."""
    drafted, node = 0, 0
    while tree.children[node]:
        node = tree.children[node][0]
        drafted += 1
    accepted, node = 0, 0
    for token in tokens[:-1]:
        kids = tree.children[node]
        if not kids or tree.token_ids[kids[0]] != token:
            break
        node = kids[0]
        accepted += 1
    return drafted, accepted


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
        self.tree_acceptance = TreeAcceptance()  # trees drafted without a value floor
        self.floored_acceptance = TreeAcceptance(FLOORED_PRIOR_NODES)  # greedy trees under one (`floors`)
        self.sibling_acceptance = SiblingAcceptance()
        self.tree_rounds = BucketedMedians()  # seconds of a tree drafting round, by batch size
        self.num_steps_off = 0
        self.num_steps_on = 0
        self._off: tuple[int, tuple[str, ...]] | None = None  # (step to weigh again, the requests) after cap 0
        self.num_explored = 0  # steps of one request whose k was a neighbour of the best (`_explore`)
        self.num_off_probes = 0  # steps a speculating batch went without drafts to measure them (OFF_PROBE_EVERY)
        # realized / predicted tokens per second of a batch's decode steps with drafts, by batch bucket
        self.realized = [collections.deque(maxlen=REALIZED_WINDOW) for _ in BucketedMedians.BUCKETS]
        self._prediction: tuple[int, float] | None = None  # (requests, tokens/s) predicted for the next step
        self._last_execute_s = 0.0  # the last step's time before drafting (`observe_step_time`)
        self._last_draft_s = 0.0  # the last `propose_for_step`'s time (observing and drafting)
        self._chain_rate: float | None = None  # the last `best_cap`'s predicted tokens/s
        # (step index, decoding ids, ks, best_chain over the ks > 0): the chain decision
        # `_trees_pay` made for the step, reused when chains win it
        self._chain_memo: tuple | None = None
        self._trees_far: tuple | None = None  # (step, decoding ids): trees priced far below chains
        self._last_off_probe = 0  # (none in the first OFF_PROBE_EVERY steps: nothing is measured yet)
        self.num_tree_steps = 0  # steps whose drafts were trees (also counted in num_steps_on)
        # the tree widths the adaptive policy planned (per request, at each trees-or-chains decision)
        self.width_counts: collections.Counter[int] = collections.Counter()
        self.adaptive_floor = 0.0  # the policy's tree_min_prob for the step (`_trees_pay`)

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
    @torch.inference_mode()
    def profile(self, runner, max_num_seqs: int, max_tokens: int) -> StepCostModel:
        """Time the target on B requests x q tokens each (B = 1, 4, 16; q = 1 .. 9: one token, or
        k + 1 for k = 1 .. 8, and with trees 12 and 16 up to tree_nodes + 1; q = 6 and 8 since stop 34: the CPU's packed products take up to 6
        rows per pass over the weights, so 7 tokens cost a step over 6 that the line from 5 to 7
        put at 6, and the policy, paying it for k = 5, drafted 4 or 6), each over 128 tokens of context, using free
        KV blocks (each request its own since stop 37). The points are timed in PROFILE_ROUNDS rounds, every point once per round, and
        each keeps its fastest round (the least disturbed by other work on the host): a burst of
        noise then costs one round of every point rather than all the samples of one (timed back
        to back, 3 per point, one noisy point made 2 drafts look 1.4x a one-token step and the
        policy drafted 2-3 where 5 paid 36% more). Then made non-decreasing in q, so noise
        cannot invert the curve."""
        from engine.model_runner import SeqChunk

        bs = runner.block_size
        num_blocks = runner.kv_caches[0][0].shape[0]
        batch_sizes = [b for b in (1, 4, 16) if b <= max_num_seqs] or [1]
        per_request = [1, 2, 3, 4, 5, 6, 7, 8, 9]
        if self.config.uses_tree:  # trees verify more: measured, not extrapolated (`StepCostModel`)
            per_request += [q for q in (12, 16) if q <= self.config.tree_nodes + 1]
        fits = [(b, q) for b in batch_sizes for q in per_request if b * q <= max_tokens]
        best: dict[tuple[int, int], float] = {}
        for rnd in range(PROFILE_ROUNDS + 1):  # (round 0 untimed: first calls of each shape)
            for b, q in fits:
                ctx = min(128, num_blocks * bs - q)
                nb = -(-(ctx + q) // bs)
                # each request its own blocks where the pool has room (else shared: timing only),
                # so that attention reads b contexts as a real step does: over shared blocks it
                # found them in cache, and 16 requests' 2-token steps were priced ~1.4x too low
                chunks = [SeqChunk([0] * q, ctx, list(range(i * nb, (i + 1) * nb)) if b * nb <= num_blocks
                                   else list(range(nb))) for i in range(b)]
                t0 = time.perf_counter()
                _, h = runner.forward(chunks)  # the path (and row invariance) steps take
                runner.logits(h, runner.tile_rows(chunks))
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                if rnd:
                    best[b, q] = min(best.get((b, q), math.inf), time.perf_counter() - t0)
        times: list[list[float]] = []
        for b in batch_sizes:
            row: list[float] = []
            for q in per_request:  # past max_tokens: the last fitting point, scaled by tokens
                row.append(best[b, q] if (b, q) in best else (row[-1] * q / per_request[len(row) - 1] if row else 0.0))
            for j in range(len(row) - 2, -1, -1):
                row[j] = min(row[j], row[j + 1])
            times.append(row)
        self.cost = StepCostModel(batch_sizes, per_request, times)
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
            speculating = any(s.spec_token_ids for s in sched.scheduled)
            if any(s.spec_tree is not None for s in sched.scheduled):
                speculating = "tree"
            self.calibration.add(len(sched.scheduled), speculating, seconds / predicted, sched.num_batched_tokens)

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
        median of a few noisy steps, and stop 34 measured k = 5's above k = 4's and k = 6's, so
        the policy drafted 4 or 6 and averaged 1.72x where a fixed k = 5 made 1.98x). The same for
        every request of a step, so made once per step (`step_index`)."""
        cached = self._k_times_cache
        if step_index is None or cached is None or cached[0] != step_index or len(cached[1]) <= k_max:
            cal = self.calibration
            times = monotone([cal.ratio(1, False, 1, borrow=False) * self.cost(1, 1)] + [
                cal.ratio(1, True, 1 + k, borrow=False) * self.cost(1, 1 + k) + self.proposer.step_cost(1, k)
                for k in range(1, k_max + 1)])
            if step_index is None:
                return times
            self._k_times_cache = cached = (step_index, times)
        return cached[1]

    def _best_k(self, probs: list[float], k_max: int, step_index: int | None = None) -> int:
        """The k <= k_max that maximizes this request's expected tokens per second alone:
        (1 + P(draft 1 accepted) + ... + P(drafts 1..k accepted)) / (the target's step over
        1 + k tokens + drafting k), on the calibrated curve (`_k_times`). (A linear verify cost,
        the curve's mean slope from 1 to 9 tokens, overpriced the first drafts where the curve is
        flat and stepped: where 5 drafts paid most, it drafted 2-3.)"""
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
        off = cal.ratio(num_decoding, False, num_decoding)
        realized = self.realized_ratio(num_decoding)
        best_c, best_rate = 0, MIN_GAIN * num_decoding / (off * self.cost(num_decoding, num_decoding))
        probs = [self.acceptance.accept_probs(r, k) for r, k in zip(requests, ks, strict=True)]
        floor = off if FLOOR_ON_AT_OFF and num_decoding > 1 else 0.0
        debt = self.catch_up_debt(requests, ks)
        left = [r.sampling_params.max_tokens - r.num_output_tokens for r in requests]
        for c in range(1, max(ks) + 1):
            capped = [min(k, c) for k in ks]
            num_tokens = num_decoding + sum(capped)
            on = max(floor, cal.ratio(num_decoding, True, num_tokens))
            time_s = on * self.cost(num_decoding, num_tokens) + self.proposer.step_cost(len(ks), c)
            if debt:  # spread over the steps these requests are expected to go on speculating
                steps = statistics.mean(n / (1.0 + sum(p[:k])) for n, p, k in zip(left, probs, capped, strict=True))
                time_s += debt / min(CATCH_UP_HORIZON, max(1.0, steps))
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
            self.tree_model(s.request).observe(len(tokens) - 1, len(s.spec_token_ids))
            self.sibling_acceptance.observe(s.spec_tree, tokens)
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
            if (step_index < until and step_index % probe_interval(len(decoding)) != 0
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
            rate = self._chain_rate
            probe = cap == 0 and step_index % probe_interval(len(decoding)) == 0
            if probe:
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
                  and self.calibration.samples(len(decoding), False, len(decoding)) < POINT_SAMPLES):
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
            if max(1, self.config.min_speculative_tokens) <= j <= self.max_k(request) and (refresh or self.calibration.samples(1, True, 1 + j) < POINT_SAMPLES):
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
        """(nodes, levels, width) of the tree request r would draft (before the step's token
        budget).

        Without `adaptive`: the configured tree_nodes, tree_depth (levels capped like a chain's k
        by `max_k`) and tree_width. With it, sized per request from its own acceptance model
        (`AcceptanceModel.accept_probs`: a_1, the chance its drafter's top token is accepted, and
        the chance its top-1 chain reaches each depth, a lower bound for a tree's):
        - width: ranks j = 1.. of each expanded node's children are drafted while the chance the
          rank-j child is the one accepted at a reached node, (1 - a_1) * prod_{0<i<j}(1 - s_i) * s_j
          with s_i the engine-wide sibling rates (`SiblingAcceptance`), times the mean chance of
          reaching the tree's levels, beats the cost of verifying one more token (as a fraction
          of a one-token step): a request whose top drafts are nearly always right drafts a
          narrow tree (width 1: a chain), one whose top drafts often miss a wide one;
        - levels: as many as pay for themselves at that width, each costing its width's verified
          tokens and one drafting forward (`_level_cost`); at least one (`_trees_pay` already
          chose trees for the step);
        - nodes: at most width per level and tree_nodes in all.
        A request whose trees take the value floor (`floors`: greedy, adaptive, no tree_min_prob
        set) plans the configured tree: the floor prunes it to the nodes worth verifying, from
        the drafter's own confidence at this step, which the acceptance models only average."""
        width = self.config.tree_width
        depth = self.max_k(r, self.config.tree_depth)
        nodes = min(self.config.tree_nodes, self.max_model_len - r.num_tokens - 1)
        if self.config.adaptive and self.cost is not None and depth > 1 and not self.floors(r):
            reach = self.acceptance.accept_probs(r, depth)
            token_cost = self._verify_token_cost()
            level_cost = self._level_cost(width, token_cost)
            levels = max(1, sum(p > level_cost for p in reach))
            mean_reach = sum([1.0, *reach[: levels - 1]]) / levels
            miss = 1.0 - reach[0]  # the top child rejected
            width = 1
            for j in range(1, self.config.tree_width):
                s_j = self.sibling_acceptance.rate(j)
                if mean_reach * miss * s_j <= token_cost:
                    break
                width += 1
                miss *= 1.0 - s_j
            level_cost = self._level_cost(width, token_cost)
            depth = max(1, sum(p > level_cost for p in reach))
            nodes = min(nodes, width * depth)
        return nodes, min(depth, nodes), width

    def _verify_token_cost(self) -> float:
        """One more verified token at batch 1, as a fraction of a one-token target step."""
        base = self.cost(1, 1)
        return (self.cost(1, 9) - base) / 8 / base

    def _level_cost(self, width: int, token_cost: float | None = None) -> float:
        """Cost of one more tree level (`width` more verified tokens and one drafting forward),
        as a fraction of a one-token target step (`token_cost`: `_verify_token_cost()`)."""
        if token_cost is None:
            token_cost = self._verify_token_cost()
        return width * token_cost + self.proposer.step_cost(1, 1) / self.cost(1, 1)

    def _trees_may_pay(self, decoding: list[Request], step_index: int) -> bool:
        """`_trees_pay`, except that trees it priced below TREE_PROBE_WITHIN of the best chain for
        the same decoding requests are not priced again before the next TREE_PROBE_EVERY step."""
        far = self._trees_far
        if (far is not None and step_index % TREE_PROBE_EVERY and step_index - far[0] < TREE_PROBE_EVERY
                and far[1] == tuple(r.request_id for r in decoding)):
            return False
        return self._trees_pay(decoding, step_index)

    def _trees_pay(self, decoding: list[Request], step_index: int) -> bool:
        """The adaptive choice between trees and chains (`SpeculativeConfig.tree_nodes` with
        `adaptive`): trees for this step's decoding requests iff their predicted tokens/s beat the
        best chain cap's (`best_chain`, which also covers no drafts), or every TREE_PROBE_EVERY
        steps while their predicted rate is within TREE_PROBE_WITHIN of the chain's (a probe keeps
        the tree's acceptance and costs measured; a hopeless tree, e.g. at a large batch, is not
        probed; floored ones priced far below are, every TREE_PROBE_EVERY steps until
        FLOORED_PROBE_TRIALS are measured, then every TREE_FAR_PROBE_EVERY).

        Trees: tokens = sum over requests of 1 + E[accepted] (`TreeAcceptance`, scaled by how
        much easier the request's text is than average, at most its depth); time = the target
        step over every request's root and nodes (the cost model times the tree side's measured
        calibration) + the tree drafting rounds' measured time at this batch size. A request that
        sets its own num_speculative_tokens drafts a chain either way, and so does one whose plan
        has width 1 (a tree of one child per node is a chain: it is predicted as one, from its
        chain acceptance); with no request wider than 1, chains decide. Floored trees (`floors`)
        are predicted from their own measured acceptance and node count (`floored_acceptance`),
        their drafting at about as many levels as nodes; this call also sets the step's floor
        (`adaptive_floor`), and where it is >= 1 no node can pay: no trees."""
        if self.cost is None:
            return True
        trees = [r for r in decoding if r.sampling_params.num_speculative_tokens is None]
        plans = [(r, *self._tree_plan(r)) for r in trees]
        self.width_counts.update(w for *_, w in plans)
        plans = [(r, n, d, w) for r, n, d, w in plans if n > 0 and d > 0]
        wide = [(r, n, d) for r, n, d, w in plans if w > 1]
        narrow = [(r, n) for r, n, _, w in plans if w == 1]
        if not wide:  # (every plan a chain: priced again at the next TREE_PROBE_EVERY step)
            self._trees_far = (step_index, tuple(r.request_id for r in decoding))
            return False
        b = len(decoding)
        engine_rate = max(self.acceptance.engine_rate(), 1e-6)
        tokens = b + sum(min(d, self.tree_model(r).mean() * self.acceptance.request_rate(r) / engine_rate)
                         for r, _, d in wide) + sum(sum(self.acceptance.accept_probs(r, n)) for r, n in narrow)
        # a floor drafts fewer nodes than planned: the measured nodes per tree
        verified = b + sum(self.tree_model(r).mean_nodes(n) for r, n, _ in wide) + sum(n for _, n in narrow)
        tree_ratio = self.calibration.ratio(b, "tree")
        # (a floored tree drafts levels while a node is above the floor: about as many as its nodes)
        levels = max(min(d, max(1, round(self.tree_model(r).mean_nodes(n)))) if self.floors(r) else d
                     for r, n, d in wide)
        time_s = (tree_ratio * self.cost(b, verified)
                  + self.tree_draft_time(len(wide), levels)
                  + (self.proposer.step_cost(len(narrow), max(n for _, n in narrow)) if narrow else 0.0))
        # rows the drafter must catch up first (left while speculation was off), spread over the
        # steps these requests are expected to go on, as `best_chain` does
        debt = self.catch_up_debt([r for r, *_ in wide], [d for *_, d in wide])
        if debt:
            per_step = max(1.0, tokens / b)
            steps = statistics.mean((r.sampling_params.max_tokens - r.num_output_tokens) / per_step for r, *_ in wide)
            time_s += debt / min(CATCH_UP_HORIZON, max(1.0, steps))
        ks = [self.choose_k(r, step_index) for r in decoding]
        chain_ks = [(r, k) for r, k in zip(decoding, ks, strict=True) if k > 0]
        chain = None
        if chain_ks:
            chain = self.best_chain(b, [r for r, _ in chain_ks], [k for _, k in chain_ks])
            chain_rate = chain[1]
        else:
            chain_rate = b / (self.calibration.ratio(b, False) * self.cost(b, b))
        self._chain_memo = (step_index, tuple(r.request_id for r in decoding), ks, chain)
        tree_rate = tokens / time_s
        floored = all(self.floors(r) for r, *_ in wide)
        if self.floors_trees and self.config.tree_min_prob is None:
            # a node is worth drafting iff the tokens it is expected to add (its calibrated path
            # probability) beat what its time would make at the best rate predicted (trees,
            # chains or no drafts): its verified token (the batch's marginal cost here) and its
            # share of a drafting level. At >= 1 no node can pay.
            lo, hi = max(b, verified - 4), verified + 4
            token_s = tree_ratio * (self.cost(b, hi) - self.cost(b, lo)) / (hi - lo)
            node_s = token_s + self.proposer.step_cost(1, 1) / max(w for *_, w in plans if w > 1)
            self.adaptive_floor = max(0.0, max(tree_rate, chain_rate) * node_s)
            if floored and self.adaptive_floor >= 1.0:
                self._trees_far = (step_index, tuple(r.request_id for r in decoding))
                return False
        far = tree_rate <= TREE_PROBE_WITHIN * chain_rate
        self._trees_far = (step_index, tuple(r.request_id for r in decoding)) if far else None
        # (floored trees are probed even when priced far below, while some node could pay and no
        # catch-up is owed: the floor keeps them small where verifying costs, so a probe is
        # cheap, and their acceptance cannot be measured otherwise; once measured, rarely)
        if not far:
            probe = step_index % TREE_PROBE_EVERY == 0
        else:
            measured = self.floored_acceptance.trials >= FLOORED_PROBE_TRIALS
            probe = floored and not debt and step_index % (TREE_FAR_PROBE_EVERY if measured else TREE_PROBE_EVERY) == 0
        return tree_rate > chain_rate or probe

    @property
    def floors_trees(self) -> bool:
        """Whether greedy trees take a value floor: a configured `tree_min_prob` > 0, or the
        adaptive policy's (None) on a drafter with probabilities (not n-gram lookup)."""
        p = self.config.tree_min_prob
        if p is None:
            return self.config.adaptive and self.proposer.method != "ngram"
        return p > 0

    def floors(self, request: Request) -> bool:
        """Whether `request`'s trees take the value floor: greedy, where `floors_trees`."""
        return self.floors_trees and request.sampling_params.is_greedy

    def tree_model(self, request: Request) -> TreeAcceptance:
        """The acceptance model of `request`'s trees: floored ones apart (they are smaller)."""
        return self.floored_acceptance if self.floors(request) else self.tree_acceptance

    def tree_floor(self) -> float:
        """The greedy trees' value floor for this step, as a log-probability
        (`ProposeContext.tree_min_logprob`): log of the configured `tree_min_prob`, or of the
        adaptive policy's floor (`_trees_pay`); -inf for none."""
        p = self.config.tree_min_prob
        if p is None:
            p = self.adaptive_floor if self.config.adaptive else 0.0
        return math.log(p) if p > 0 else float("-inf")

    def tree_draft_time(self, num_requests: int, depth: int) -> float:
        """Seconds of a tree drafting round: measured per batch size (the median of the rounds
        timed so far), else the proposer's chain estimate for `depth` forwards."""
        measured = self.tree_rounds.median(num_requests)
        return measured if measured is not None else self.proposer.step_cost(num_requests, depth)

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
            context = dataclasses.replace(context, tree_min_logprob=self.tree_floor())
            made = self.proposer.propose_trees([r for r, _, _, _ in trees], [n for _, n, _, _ in trees],
                                               [d for _, _, d, _ in trees], context, [w for *_, w in trees])
            self.tree_rounds.add(len(trees), time.perf_counter() - t0)
            self.num_tree_steps += 1
            for (r, *_), d in zip(trees, made, strict=True):
                if not d.token_ids:  # the floor kept no node: a verification of nothing
                    self.tree_model(r).observe(0, 0)
            drafts.update((r.request_id, d) for (r, *_), d in zip(trees, made, strict=True))
        return {rid: d for rid, d in drafts.items() if d.token_ids}
