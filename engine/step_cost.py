"""What an engine step costs: seconds = fixed_s + per_token_s * tokens, fitted online.

Pure Python. The engine feeds one observation per step (the target tokens it scheduled, drafts
included, and the step's wall time, drafting included: what a decoding stream waits between two
tokens); the scheduler asks how many tokens a step may hold within a time (`tokens_within`).

Observations are kept per size class (tokens in [2^c, 2^(c+1))), each an exponentially weighted
mean, and the line is a weighted least-squares fit through the classes' means. One forgetting
factor over all steps would forget the slope during a long run of decode-only steps, which all
have about the same size; per class, each size forgets only through newer steps of its own size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of a new step in its class's mean once the class has seen 1/ALPHA steps (before that,
# a plain average): a class follows about its last 10 steps, so it tracks a host whose speed drifts.
ALPHA = 0.1
# A step counts at most this many mean absolute deviations away from its class's mean, so a
# one-off pause (garbage collection, another process) moves the mean by at most ALPHA * CLIP_Z
# deviations, while a lasting change of speed widens the deviation by a factor 1 + ALPHA *
# (CLIP_Z - 1) per step and is followed within about 20 steps.
CLIP_Z = 3.0
# The deviation is at least this fraction of the mean: steps of identical duration must not
# shrink the clip to nothing and freeze the class.
MIN_RELATIVE_DEVIATION = 0.05
# The fit is trusted once the classes' mean sizes span at least this many tokens: steps that all
# decode one token per request give a time but no slope.
MIN_SPREAD_TOKENS = 32


@dataclass
class _SizeClass:
    """Decayed statistics of the steps of one size class."""

    num_observations: int
    mean_tokens: float
    mean_s: float
    deviation_s: float  # mean absolute deviation of the (clipped) times from mean_s

    def add(self, num_tokens: int, seconds: float) -> None:
        self.num_observations += 1
        alpha = max(ALPHA, 1.0 / self.num_observations)
        limit = CLIP_Z * max(self.deviation_s, MIN_RELATIVE_DEVIATION * self.mean_s)
        residual = min(max(seconds - self.mean_s, -limit), limit)
        self.mean_tokens += alpha * (num_tokens - self.mean_tokens)
        self.mean_s += alpha * residual
        self.deviation_s += alpha * (abs(residual) - self.deviation_s)

    @property
    def weight(self) -> float:
        """Observations behind the mean, capped at the decayed mean's effective count."""
        return min(self.num_observations, 1.0 / ALPHA)


class StepCostModel:
    """Online fit of a step's wall time against the tokens it computes. `fixed_s` and
    `per_token_s` are None until the fit is trusted (steps of clearly different sizes seen);
    then per_token_s > 0 and fixed_s >= 0."""

    def __init__(self) -> None:
        self._classes: dict[int, _SizeClass] = {}
        self.num_observations = 0
        self.fixed_s: float | None = None
        self.per_token_s: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step that computed `num_tokens` target tokens (drafts included) in `seconds`."""
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        size_class = num_tokens.bit_length() - 1  # 1 -> 0, 2..3 -> 1, 4..7 -> 2, ...
        known = self._classes.get(size_class)
        if known is None:
            self._classes[size_class] = _SizeClass(1, float(num_tokens), seconds, MIN_RELATIVE_DEVIATION * seconds)
        else:
            known.add(num_tokens, seconds)
        self.num_observations += 1
        self.fixed_s, self.per_token_s = self._fit() or (None, None)

    def _fit(self) -> tuple[float, float] | None:
        """(fixed_s, per_token_s) by weighted least squares through the classes' means, or None
        while their sizes span fewer than MIN_SPREAD_TOKENS tokens. A slope that comes out <= 0
        (noise between close sizes) is replaced by the largest class's seconds per token through
        the origin, which overestimates the cost of a token and so errs toward smaller steps."""
        classes = list(self._classes.values())
        sizes = [c.mean_tokens for c in classes]
        if len(classes) < 2 or max(sizes) - min(sizes) < MIN_SPREAD_TOKENS:
            return None
        total = sum(c.weight for c in classes)
        mean_x = sum(c.weight * c.mean_tokens for c in classes) / total
        mean_y = sum(c.weight * c.mean_s for c in classes) / total
        sxx = sum(c.weight * (c.mean_tokens - mean_x) ** 2 for c in classes)
        sxy = sum(c.weight * (c.mean_tokens - mean_x) * (c.mean_s - mean_y) for c in classes)
        slope = sxy / sxx
        if slope <= 0:
            largest = max(classes, key=lambda c: c.mean_tokens)
            slope = largest.mean_s / largest.mean_tokens
            return (0.0, slope) if slope > 0 else None
        return max(0.0, mean_y - slope * mean_x), slope

    def predict_s(self, num_tokens: int) -> float | None:
        """Predicted seconds of a step of `num_tokens` tokens, or None before the fit is trusted."""
        if self.per_token_s is None:
            return None
        return self.fixed_s + self.per_token_s * num_tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may compute and still take at most `seconds` (0 when even an
        empty step's fixed cost exceeds it), or None before the fit is trusted."""
        if self.per_token_s is None:
            return None
        return max(0, math.floor((seconds - self.fixed_s) / self.per_token_s))

    def prefill_tokens_per_s(self) -> float | None:
        """Tokens a step adds per second of its time (1 / per_token_s), or None before the fit
        is trusted."""
        return None if self.per_token_s is None else 1.0 / self.per_token_s
