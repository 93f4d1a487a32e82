"""SLO gates of a load test, on plain numbers (the locustfile feeds them locust's stats; no locust
import here, so tests can check them without gevent's monkey-patching).

A run fails when no request completed, when more than max_fail_ratio of the requests failed, or
when the p95 of an entry (TTFT, TPOT, E2E) exceeds its limit (a limit <= 0 is no gate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

TTFT, TPOT, E2E = "TTFT", "TPOT", "E2E"  # the locustfile's entry names; E2E carries the failures


@dataclass(frozen=True)
class EntrySummary:
    num_requests: int  # failures included
    num_failures: int
    p95_ms: float

    @property
    def fail_ratio(self) -> float:
        return self.num_failures / self.num_requests if self.num_requests else 0.0


def slo_problems(
    entries: Mapping[str, EntrySummary],
    limits_ms: Mapping[str, float],
    max_fail_ratio: float = 0.0,
    errors: Sequence[str] = (),
) -> list[str]:
    """Every gate the run failed, one line each (empty: passed). `errors` describe the failures."""
    e2e = entries.get(E2E)
    if e2e is None or e2e.num_requests == 0:
        return ["no request completed"]
    problems = []
    if e2e.fail_ratio > max_fail_ratio:
        detail = f": {'; '.join(errors)}" if errors else ""
        problems.append(f"{e2e.num_failures} of {e2e.num_requests} requests failed (> {max_fail_ratio:.1%}){detail}")
    for name, limit in limits_ms.items():
        if limit <= 0:
            continue
        entry = entries.get(name)
        successes = entry.num_requests - entry.num_failures if entry else 0
        if entry is None or successes <= 0:
            problems.append(f"{name}: no measurements to check against the {limit:g} ms SLO")
        elif entry.p95_ms > limit:
            problems.append(f"{name}: p95 {entry.p95_ms:g} ms > SLO {limit:g} ms")
    return problems
