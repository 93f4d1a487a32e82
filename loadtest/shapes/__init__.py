"""Load shapes for loadtest/locustfile.py, one per file so that locust picks the one given with -f:

    locust -f loadtest/locustfile.py,loadtest/shapes/step.py ...

Both read locust's own -u (peak users), -r (spawn rate) and -t (duration, default 60 s) and stop
at the end of the duration. The schedules are plain functions here (no locust import, so tests
can check them without gevent's monkey-patching); the LoadTestShape classes are in base.py,
step.py and spike.py.
"""

from __future__ import annotations

import math

DEFAULT_DURATION_S = 60.0


def step_users(t: float, peak: int, duration_s: float, steps: int = 4) -> int:
    """Staircase to `peak` in `steps` equal steps, e.g. peak 8, 4 steps over 60 s:
    2 users for 0-15 s, 4 for 15-30 s, 6 for 30-45 s, 8 for 45-60 s."""
    step = min(steps - 1, int(t / (duration_s / steps)))
    return max(1, math.ceil(peak * (step + 1) / steps))


def spike_users(t: float, peak: int, duration_s: float) -> int:
    """A quarter of `peak` (at least 1), `peak` from 40% to 60% of the duration, then back."""
    baseline = max(1, peak // 4)
    return peak if 0.4 * duration_s <= t < 0.6 * duration_s else baseline
