"""The LoadTestShape the step and spike shapes share: users from a schedule, locust's -u/-r/-t."""

from __future__ import annotations

from locust import LoadTestShape

from loadtest.shapes import DEFAULT_DURATION_S


class ScheduledShape(LoadTestShape):
    """users_at(t, peak, duration) users at t seconds; stops after -t (default 60 s)."""

    abstract = True
    use_common_options = True

    def users_at(self, t: float, peak: int, duration_s: float) -> int:
        raise NotImplementedError

    def spawn_rate_at(self, t: float, peak: int, spawn_rate: float) -> float:
        return spawn_rate

    def tick(self) -> tuple[int, float] | None:
        opts = self.runner.environment.parsed_options
        duration = float(opts.run_time or DEFAULT_DURATION_S)
        t = self.get_run_time()
        if t >= duration:
            return None
        peak = max(1, int(opts.num_users or 1))
        rate = float(opts.spawn_rate or peak)
        return self.users_at(t, peak, duration), self.spawn_rate_at(t, peak, rate)
