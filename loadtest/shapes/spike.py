"""Spike load: a quarter of -u users, all -u from 40% to 60% of -t, then back (loadtest/shapes).
The spike arrives at once (every user spawned within a second), whatever -r says."""

from __future__ import annotations

from loadtest.shapes import spike_users
from loadtest.shapes.base import ScheduledShape


class SpikeLoadShape(ScheduledShape):
    def users_at(self, t: float, peak: int, duration_s: float) -> int:
        return spike_users(t, peak, duration_s)

    def spawn_rate_at(self, t: float, peak: int, spawn_rate: float) -> float:
        return max(spawn_rate, float(peak))
