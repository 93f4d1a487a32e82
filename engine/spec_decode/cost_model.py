"""What a target step costs: the step time over (requests in the step, tokens in the step),
profiled once at start-up (`profile_step_cost`, `StepCostModel`), and its online calibration
against the decode steps the engine measures, per step mode (`StepMode`, `StepCalibration`).

It measures; the speculation policy (speculator.py, tree_policy.py) decides from it.
"""

from __future__ import annotations

import bisect
import collections
import enum
import math
import statistics
import time

import torch

from engine.spec_decode.proposers.base import BucketedMedians

PROFILE_ROUNDS = 3  # the start-up step-cost profile times each point this often, interleaved
POINT_SAMPLES = 3  # a (mode, batch bucket, tokens per request) point's own calibration counts from this many steps
POINT_WINDOW = 16  # the steps a point keeps (the last ones)
POINT_HORIZON = 256  # a point forgets its steps older than this many steps of its batch bucket (every mode)
# ... this many with several requests: a batch's steps come in bursts of one mode (its policy stays
# on or off for many steps) and its first steps after the prompts' prefill run slow, so a point
# measured only then would price its mode for the rest of the run.
BATCH_POINT_HORIZON = 64
# The host's speed is read from a bucket's last DRIFT_WINDOW steps at measured points (their median
# residual): a burst of a few slow steps (such as the first steps after a prefill) moves it little,
# a slowdown that lasts shifts every point of the bucket within ~DRIFT_WINDOW / 2 steps.
DRIFT_WINDOW = 9
# A step that would start speculating for requests whose drafter must first catch up over many rows
# (their prompts, or the rows left while speculation was off) pays that catch-up once: the decision
# spreads it over the steps the requests are expected to go on, at most this many, so that a batch
# near its end does not pay a catch-up over thousands of rows to speculate for a few steps.
CATCH_UP_HORIZON = 64


class StepMode(enum.Enum):
    """What a decode step verifies: nothing but one token per request, chains of drafts, or token
    trees (whose verification also pays a mask and per-token attention tables). The value is the
    mode's label in calibration reports."""

    PLAIN = "off"
    CHAIN = "on"
    TREE = "tree"


def spread_catch_up(debt_s: float, num_steps: float) -> float:
    """The share of a catch-up of `debt_s` seconds one step pays, spread over the `num_steps`
    steps the requests are expected to go on speculating (at least 1, at most CATCH_UP_HORIZON)."""
    return debt_s / min(CATCH_UP_HORIZON, max(1.0, num_steps))


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


@torch.inference_mode()
def profile_step_cost(runner, max_num_seqs: int, max_tokens: int, max_tree_tokens: int | None = None) -> StepCostModel:
    """Time the target on B requests x q tokens each (B = 1, 4, 16; q = 1 .. 9: one token, or
    k + 1 for k = 1 .. 8; with trees (`max_tree_tokens`: tree_nodes + 1) also 12 and 16 up to
    it), each over 128 tokens of context. Every q up to 9 is measured, not interpolated: the CPU's
    packed products take up to 6 rows per pass over the weights, so the curve steps between 6 and
    7 tokens, where a line between farther points would misprice the drafts around it.

    The points are timed in PROFILE_ROUNDS rounds, every point once per round (after an untimed
    round of first calls), and each keeps its fastest round (the least disturbed by other work on
    the host): a burst of noise then costs one round of every point rather than all the samples
    of one. Then made non-decreasing in q, so noise cannot invert the curve."""
    from engine.model_runner import SeqChunk

    bs = runner.block_size
    num_blocks = runner.kv_caches[0][0].shape[0]
    batch_sizes = [b for b in (1, 4, 16) if b <= max_num_seqs] or [1]
    per_request = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    if max_tree_tokens is not None:  # trees verify more: measured, not extrapolated
        per_request += [q for q in (12, 16) if q <= max_tree_tokens]
    fits = [(b, q) for b in batch_sizes for q in per_request if b * q <= max_tokens]
    best: dict[tuple[int, int], float] = {}
    for rnd in range(PROFILE_ROUNDS + 1):  # (round 0 untimed: first calls of each shape)
        for b, q in fits:
            ctx = min(128, num_blocks * bs - q)
            nb = -(-(ctx + q) // bs)
            # each request its own blocks where the pool has room (else shared: timing only), so
            # that attention reads b contexts as a real step does: over shared blocks it finds
            # them in cache and prices the step too low
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
    return StepCostModel(batch_sizes, per_request, times)


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
    """Measured step time / the cost model's prediction, per `StepMode` (a tree's verification
    also pays its mask and per-token attention tables), split into the host's current speed
    (`drift`) and each point's shape: a point is (mode, batch-size bucket, tokens per request
    rounded).

    A step's log ratio is modelled as drift(bucket, now) + shape(point) + noise. The drift of a
    bucket is the median of its last DRIFT_WINDOW residuals (a step's log ratio less its point's
    shape, from measured points only); a step is stored at its point as its log ratio less the
    drift at the time, and a point's shape is the median of its last POINT_WINDOW such values,
    used once it holds POINT_SAMPLES of them. `ratio` answers exp(drift now + shape). So a host
    that slows down for a while moves every point of the bucket together, measured or not: only
    relative costs decide k, and they stay as measured. A point that kept its raw ratios would
    keep a slowdown measured while it was drafted, and nothing would correct it once the policy
    stopped drafting it.

    Why points: the start-up curve's shape is itself a measurement on a shared host, and it
    varies between engines of the same models, so a policy reading the curve alone drafts
    differently in each. Each step is compared with the curve at its own point only, and the
    drift is estimated from residuals against each step's own point, so it does not move with the
    mix of k the policy drafts (a ratio relative to its mode's median would: that median mixes
    every k drafted). A point forgets steps older than POINT_HORIZON steps of its bucket, every
    mode counted (BATCH_POINT_HORIZON with several requests; a shape can change too: contexts
    grow, and a point's first steps can carry a transient the drift did not see yet), and a point
    left with fewer than POINT_SAMPLES reads as unmeasured (the policy explores it again,
    `Speculator._explore`; a batch's point without drafts is probed, `OFF_PROBE_EVERY`). An
    unmeasured point reads its mode's median shape (`BucketedMedians` of the drift-free ratios)
    times the drift; a mode with no sample yet borrows another's (tree: chain, then plain;
    chain: plain; plain: chain); with none at all the shape is 1."""

    FALLBACK = {
        StepMode.PLAIN: (StepMode.PLAIN, StepMode.CHAIN),
        StepMode.CHAIN: (StepMode.CHAIN, StepMode.PLAIN),
        StepMode.TREE: (StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN),
    }

    def __init__(self) -> None:
        self.modes = {mode: BucketedMedians() for mode in StepMode}
        # point -> its last POINT_WINDOW (step count of its bucket, log ratio less the drift)
        self.points: dict[tuple, collections.deque[tuple[int, float]]] = {}
        self.clock: collections.Counter = collections.Counter()  # steps added per bucket (every mode)
        self.residuals = [collections.deque(maxlen=DRIFT_WINDOW) for _ in BucketedMedians.BUCKETS]
        self._drift: list[float | None] = [None] * len(BucketedMedians.BUCKETS)  # median of residuals, cached
        self._shapes: dict[tuple, float | None] = {}  # each point's shape until the next step (a step asks ~12)

    @staticmethod
    def _point(num_requests: int, mode: StepMode, num_tokens: int) -> tuple:
        return mode, BucketedMedians._bucket(num_requests), round(num_tokens / max(num_requests, 1))

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

    def add(self, num_requests: int, mode: StepMode, ratio: float, num_tokens: int | None = None) -> None:
        bucket = BucketedMedians._bucket(num_requests)
        log_ratio = math.log(max(ratio, 1e-9))
        drift = self.drift(num_requests)
        key = None if num_tokens is None else self._point(num_requests, mode, num_tokens)
        shape = None if key is None else self._shape(key)
        if shape is not None:
            self.residuals[bucket].append(log_ratio - shape)
        self.modes[mode].add(num_requests, math.exp(log_ratio - drift))
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

    def samples(self, num_requests: int, mode: StepMode, num_tokens: int) -> int:
        """Steps measured at the point of (num_requests, num_tokens) in this mode."""
        return len(self._recent(self._point(num_requests, mode, num_tokens)))

    def ratio(self, num_requests: int, mode: StepMode, num_tokens: int | None = None, borrow: bool = True) -> float:
        """exp(the bucket's drift now + the point's shape) when num_tokens is given and its point
        measured, else the drift times the mode's median shape (without `borrow`: only this
        batch-size bucket's measurements count, else the shape is 1)."""
        drift = self.drift(num_requests)
        if num_tokens is not None:
            shape = self._shape(self._point(num_requests, mode, num_tokens))
            if shape is not None:
                return math.exp(drift + shape)
        for fallback in self.FALLBACK[mode]:
            measured = self.modes[fallback].median(num_requests, borrow)
            if measured is not None:
                return math.exp(drift) * measured
        return math.exp(drift)

    def as_dict(self) -> dict:
        out = {f"{mode.value}@{b}": math.exp(self.drift(b)) * m
               for mode, medians in self.modes.items() for b, m in medians.as_dict().items()}
        out.update({f"drift@{b}": math.exp(self.drift(b)) for i, b in enumerate(BucketedMedians.BUCKETS) if self.residuals[i]})
        for mode, bucket, q in sorted(self.points, key=lambda key: (key[0].value, key[1:])):
            if len(self._recent((mode, bucket, q))) >= POINT_SAMPLES:
                n = BucketedMedians.BUCKETS[bucket]
                out[f"{mode.value}@{n}x{q}"] = self.ratio(n, mode, n * q)
        return out
