"""Backing off a remote service after a failure (the drafter pool, the prefill pool)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Backoff:
    """After a failed call, leave the service alone for `first_s`; while calls keep failing, for
    twice as long each time, up to `max_s`; the first call that succeeds ends it. A service that
    is gone or stuck then costs one failed call (its timeout) per wait instead of one per use.
    `first_s` 0: no waiting at all."""

    first_s: float
    max_s: float
    wait_s: float = 0.0  # the current wait (0: the last call succeeded)
    until: float = 0.0  # time.monotonic() before which no call is made

    def active(self) -> bool:
        """Whether calls should be left out now."""
        return self.wait_s > 0 and time.monotonic() < self.until

    def failed(self) -> float:
        """A call failed: start (or double) the wait; returns it."""
        self.wait_s = min(max(2 * self.wait_s, self.first_s), self.max_s)
        self.until = time.monotonic() + self.wait_s
        return self.wait_s

    def succeeded(self) -> None:
        self.wait_s = 0.0
