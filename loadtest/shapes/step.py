"""Step load: -u users reached in four equal steps over the -t duration (loadtest/shapes)."""

from __future__ import annotations

from loadtest.shapes import step_users
from loadtest.shapes.base import ScheduledShape


class StepLoadShape(ScheduledShape):
    def users_at(self, t: float, peak: int, duration_s: float) -> int:
        return step_users(t, peak, duration_s)
