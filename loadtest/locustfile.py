"""Locust load test of the SpecDecode gRPC service: users stream `Generate` back to back.

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --host localhost:9000 \\
        --workload mix --slo-ttft-ms 2000 --slo-tpot-ms 200
    (or `make loadtest` / `python -m loadtest.run`, which adds shapes, CSVs and a plot)

Each request is reported as three locust entries (request type "grpc"): TTFT (time to the first
output token), TPOT (time per output token after the first) and E2E (the whole stream; failures
are reported here, with the gRPC status). At exit, p95s over the SLO flags and any failure set a
non-zero exit code (loadtest/slo.py). Load shapes: loadtest/shapes/ (a second -f file).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

from deployments.client import SpecDecodeClient
from loadtest.slo import E2E, TPOT, TTFT, EntrySummary, slo_problems
from loadtest.workloads import SAMPLING, WORKLOADS, adapt, load_prompts, pick_kind

grpc_gevent.init_gevent()  # before any channel: gRPC's I/O cooperates with locust's greenlets

logger = logging.getLogger("loadtest")
REQUEST_TYPE = "grpc"
SLO_FLAGS = {TTFT: "slo_ttft_ms", TPOT: "slo_tpot_ms", E2E: "slo_e2e_ms"}


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("SpecDecode", "workload and SLO gates (loadtest/locustfile.py)")
    group.add_argument("--workload", choices=WORKLOADS, default="mix", help="code, text or mix (default: mix)")
    group.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default: 64)")
    group.add_argument("--prompts-file", default="", help="JSON from loadtest.workloads.build_prompts (default: built-in)")
    group.add_argument("--application", default="", help="Serve application name (only when several apps run)")
    group.add_argument("--request-timeout-s", type=float, default=120.0, help="deadline of each request (default: 120)")
    group.add_argument("--slo-ttft-ms", type=float, default=0.0, help="fail if p95 TTFT exceeds this (0: no gate)")
    group.add_argument("--slo-tpot-ms", type=float, default=0.0, help="fail if p95 TPOT exceeds this (0: no gate)")
    group.add_argument("--slo-e2e-ms", type=float, default=0.0, help="fail if p95 end-to-end exceeds this (0: no gate)")
    group.add_argument("--max-fail-ratio", type=float, default=0.0, help="fail above this share of failed requests (default: 0)")


class SpecDecodeUser(User):
    """One client: a gRPC channel, streaming one completion after another."""

    wait_time = constant(0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.workload: str = getattr(opts, "workload", "mix")
        self.max_tokens: int = getattr(opts, "max_tokens", 64)
        self.rng = random.Random()
        self.prompts = load_prompts(getattr(opts, "prompts_file", ""))
        self.client = SpecDecodeClient(
            self.host or "localhost:9000", application=getattr(opts, "application", "") or None,
            timeout=getattr(opts, "request_timeout_s", 120.0),
        )
        limits_info = self.client.wait_ready(timeout=60)
        self.has_tokenizer = limits_info.has_tokenizer
        self.vocab_size = limits_info.limits.vocab_size
        self.max_prompt_tokens = limits_info.limits.max_prompt_tokens

    def on_stop(self) -> None:
        self.client.close()

    @task
    def generate(self) -> None:
        kind = pick_kind(self.workload, self.rng)
        prompt = adapt(self.rng.choice(self.prompts[kind]), has_tokenizer=self.has_tokenizer,
                       vocab_size=self.vocab_size, max_prompt_tokens=self.max_prompt_tokens)
        fire = self.environment.events.request.fire
        start = time.perf_counter()
        first: float | None = None
        num_tokens = 0
        try:
            for chunk in self.client.generate(prompt, max_tokens=self.max_tokens, **SAMPLING[kind]):
                if chunk.token_ids:
                    if first is None:
                        first = time.perf_counter()
                        fire(request_type=REQUEST_TYPE, name=TTFT, response_time=(first - start) * 1e3,
                             response_length=len(chunk.token_ids), exception=None, context={"workload": kind})
                    num_tokens += len(chunk.token_ids)
        except grpc.RpcError as e:
            fire(request_type=REQUEST_TYPE, name=E2E, response_time=(time.perf_counter() - start) * 1e3,
                 response_length=num_tokens, exception=RuntimeError(f"{e.code().name}: {e.details()}"),
                 context={"workload": kind})
            return
        end = time.perf_counter()
        if first is not None and num_tokens > 1:
            fire(request_type=REQUEST_TYPE, name=TPOT, response_time=(end - first) * 1e3 / (num_tokens - 1),
                 response_length=num_tokens, exception=None, context={"workload": kind})
        fire(request_type=REQUEST_TYPE, name=E2E, response_time=(end - start) * 1e3, response_length=num_tokens,
             exception=None, context={"workload": kind})


def summaries(environment: Environment) -> dict[str, EntrySummary]:
    """Each entry's counts and p95 (ms), from locust's stats."""
    out = {}
    for name in (TTFT, TPOT, E2E):
        entry = environment.stats.entries.get((name, REQUEST_TYPE))
        if entry is not None:
            p95 = entry.get_response_time_percentile(0.95) if entry.num_requests > entry.num_failures else 0.0
            out[name] = EntrySummary(entry.num_requests, entry.num_failures, float(p95 or 0.0))
    return out


@events.quitting.add_listener
def check_slos(environment: Environment, **kwargs: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or environment.parsed_options is None:
        return
    opts = environment.parsed_options
    limits = {name: getattr(opts, flag, 0.0) or 0.0 for name, flag in SLO_FLAGS.items()}
    errors = [f"{e.occurrences} x {e.error}" for e in environment.stats.errors.values()]
    problems = slo_problems(summaries(environment), limits, getattr(opts, "max_fail_ratio", 0.0), errors)
    for problem in problems:
        logger.error("SLO gate failed: %s", problem)
    if not problems:
        logger.info("SLO gates passed")
    environment.process_exit_code = 1 if problems else 0
