"""Locust load test of the SpecDecode service, over gRPC or the OpenAI-compatible HTTP API: users
stream completions (chat turns for the chat workload) back to back.

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --host localhost:9000 \\
        --workload mix --slo-ttft-ms 2000 --slo-tpot-ms 200
    locust -f loadtest/locustfile.py --headless ... --protocol http --host http://localhost:8000/specdecode
    (or `make loadtest` / `python -m loadtest.run [--protocol http]`, which adds shapes, CSVs and a plot)

Each request is reported as three locust entries (request type "grpc" or "http"): TTFT (time to
the first output token), TPOT (time per output token after the first) and E2E (the whole stream;
failures are reported here, with the gRPC status or the HTTP status and error message). Both
protocols send the same prompts and sampling and are timed the same way (over HTTP: streamed
`/v1/completions`, or `/v1/chat/completions` for chat, with `specdecode.return_token_ids`, so
tokens are counted, not guessed). At exit, p95s over the SLO flags and any failure set a non-zero
exit code (loadtest/slo.py); a chat workload against a model that cannot serve chat ends before
any user starts, with exit code 2. Load shapes: loadtest/shapes/ (a second -f file).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
import requests
from locust import User, constant, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

from deployments.client import SpecDecodeClient
from loadtest.slo import E2E, TPOT, TTFT, EntrySummary, slo_problems
from loadtest.workloads import SAMPLING, WORKLOADS, adapt, chat_messages, load_prompts, pick_kind

grpc_gevent.init_gevent()  # before any channel: gRPC's I/O cooperates with locust's greenlets

logger = logging.getLogger("loadtest")
PROTOCOLS = ("grpc", "http")
DEFAULT_HOSTS = {"grpc": "localhost:9000", "http": "http://localhost:8000/specdecode"}
NO_CHAT_EXIT_CODE = 2  # as `python -m loadtest.run` for a target that cannot run the test at all
SLO_FLAGS = {TTFT: "slo_ttft_ms", TPOT: "slo_tpot_ms", E2E: "slo_e2e_ms"}


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("SpecDecode", "workload and SLO gates (loadtest/locustfile.py)")
    group.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                       help="grpc (--host HOST:9000) or http (--host http://HOST:8000/ROUTE_PREFIX) (default: grpc)")
    group.add_argument("--workload", choices=WORKLOADS, default="mix", help="code, text, chat or mix (default: mix)")
    group.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default: 64)")
    group.add_argument("--prompts-file", default="", help="JSON from loadtest.workloads.build_prompts (default: built-in)")
    group.add_argument("--application", default="", help="Serve application name, gRPC (only when several apps run)")
    group.add_argument("--request-timeout-s", type=float, default=120.0, help="deadline of each request (default: 120)")
    group.add_argument("--slo-ttft-ms", type=float, default=0.0, help="fail if p95 TTFT exceeds this (0: no gate)")
    group.add_argument("--slo-tpot-ms", type=float, default=0.0, help="fail if p95 TPOT exceeds this (0: no gate)")
    group.add_argument("--slo-e2e-ms", type=float, default=0.0, help="fail if p95 end-to-end exceeds this (0: no gate)")
    group.add_argument("--max-fail-ratio", type=float, default=0.0, help="fail above this share of failed requests (default: 0)")


class RequestFailed(Exception):
    """A request the service refused or failed: the status and the server's message."""


class GrpcStreams:
    """Completions and chat turns over gRPC (`deployments.client`)."""

    def __init__(self, host: str, application: str | None, timeout: float) -> None:
        self.client = SpecDecodeClient(host, application=application, timeout=timeout)
        info = self.client.wait_ready(timeout=60)
        self.model = info.model
        self.has_tokenizer = info.has_tokenizer
        self.has_chat_template = info.has_chat_template
        self.vocab_size = info.limits.vocab_size
        self.max_prompt_tokens = info.limits.max_prompt_tokens

    def stream(self, prompt: str | list[int], max_tokens: int, sampling: dict) -> Iterator[int]:
        """The number of tokens of each message, in order."""
        return self._count(self.client.generate(prompt, max_tokens=max_tokens, **sampling))

    def stream_chat(self, messages: list[dict[str, str]], max_tokens: int, sampling: dict) -> Iterator[int]:
        return self._count(self.client.chat(messages, max_tokens=max_tokens, **sampling))

    @staticmethod
    def _count(chunks: Iterator[Any]) -> Iterator[int]:
        try:
            for chunk in chunks:
                yield len(chunk.token_ids)
        except grpc.RpcError as e:
            raise RequestFailed(f"{e.code().name}: {e.details()}") from None

    def chat_problem(self) -> str | None:
        """Why the target cannot serve chat requests (None: it can)."""
        if self.has_chat_template:
            return None
        return f"the model {self.model!r} has no chat template (GetModelInfo: has_chat_template false)"

    def close(self) -> None:
        self.client.close()


class HttpStreams:
    """Streamed completions and chat turns over the OpenAI-compatible HTTP API
    (`deployments/openai_api.py`)."""

    def __init__(self, base_url: str, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        deadline = time.monotonic() + 60
        while True:
            try:
                response = self.session.get(f"{self.base_url}/v1/models", timeout=10)
                response.raise_for_status()
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        (model,) = response.json()["data"]
        self.model = model["id"]
        self.has_tokenizer = model["specdecode"]["has_tokenizer"]
        self.has_chat_template = model["specdecode"]["has_chat_template"]
        self.vocab_size = model["specdecode"]["vocab_size"]
        self.max_prompt_tokens = model["specdecode"]["max_prompt_tokens"]

    def stream(self, prompt: str | list[int], max_tokens: int, sampling: dict) -> Iterator[int]:
        return self._events("/v1/completions", {"prompt": prompt}, max_tokens, sampling)

    def stream_chat(self, messages: list[dict[str, str]], max_tokens: int, sampling: dict) -> Iterator[int]:
        return self._events("/v1/chat/completions", {"messages": messages}, max_tokens, sampling)

    def _events(self, route: str, inputs: dict, max_tokens: int, sampling: dict) -> Iterator[int]:
        """The number of tokens of each streamed chunk, in order."""
        body = {"model": self.model, **inputs, "max_tokens": max_tokens, "stream": True, **sampling,
                "specdecode": {"return_token_ids": True}}
        try:
            with self.session.post(f"{self.base_url}{route}", json=body, stream=True,
                                   timeout=self.timeout) as response:
                if response.status_code != 200:
                    raise RequestFailed(f"HTTP {response.status_code}: {_error_message(response.text)}")
                for line in response.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: "):]
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise RequestFailed(f"stream error: {event['error'].get('message')}")
                    for choice in event.get("choices", []):
                        yield len(choice.get("token_ids", []))
        except requests.RequestException as e:
            raise RequestFailed(f"{type(e).__name__}: {e}") from None
        raise RequestFailed("the stream ended without data: [DONE]")

    def chat_problem(self) -> str | None:
        """Why the target cannot serve chat requests (None: it can)."""
        if self.has_chat_template:
            return None
        return f"the model {self.model!r} has no chat template (/v1/models: specdecode.has_chat_template false)"

    def close(self) -> None:
        self.session.close()


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]


def open_client(opts: Any, host: str | None) -> GrpcStreams | HttpStreams:
    """The client of the protocol `opts` names, ready (it has the served model's info)."""
    protocol = getattr(opts, "protocol", "grpc")
    host = host or DEFAULT_HOSTS[protocol]
    timeout = getattr(opts, "request_timeout_s", 120.0)
    if protocol == "http":
        return HttpStreams(host, timeout)
    return GrpcStreams(host, getattr(opts, "application", "") or None, timeout)


@events.init.add_listener
def check_chat_workload(environment: Environment, **kwargs: Any) -> None:
    """A chat workload needs a model with a chat template. Checked once, before any user starts,
    so that a model without one ends the run with the reason (and NO_CHAT_EXIT_CODE) rather than
    with one failed request per user. Workers leave it to the master."""
    opts = environment.parsed_options
    if opts is None or getattr(opts, "workload", "mix") != "chat" or isinstance(environment.runner, WorkerRunner):
        return
    client = open_client(opts, environment.host)
    try:
        problem = client.chat_problem()
    finally:
        client.close()
    if problem:
        logger.error("the chat workload cannot run against %s: %s (the code, text and mix workloads need no chat "
                     "template)", environment.host or DEFAULT_HOSTS[getattr(opts, "protocol", "grpc")], problem)
        sys.exit(NO_CHAT_EXIT_CODE)


class SpecDecodeUser(User):
    """One client: a gRPC channel or an HTTP session, streaming one completion (or chat turn)
    after another."""

    wait_time = constant(0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.protocol: str = getattr(opts, "protocol", "grpc")
        self.workload: str = getattr(opts, "workload", "mix")
        self.max_tokens: int = getattr(opts, "max_tokens", 64)
        self.rng = random.Random()
        self.prompts = load_prompts(getattr(opts, "prompts_file", ""), self.workload)
        self.client = open_client(opts, self.host)

    def on_stop(self) -> None:
        self.client.close()

    @task
    def generate(self) -> None:
        kind = pick_kind(self.workload, self.rng)
        prompt = self.rng.choice(self.prompts[kind])
        if kind == "chat":
            counts = self.client.stream_chat(chat_messages(prompt), self.max_tokens, SAMPLING[kind])
        else:
            counts = self.client.stream(adapt(prompt, model=self.client.model, has_tokenizer=self.client.has_tokenizer,
                                              vocab_size=self.client.vocab_size,
                                              max_prompt_tokens=self.client.max_prompt_tokens),
                                        self.max_tokens, SAMPLING[kind])
        fire = self.environment.events.request.fire
        start = time.perf_counter()  # the request goes out when `counts` is first iterated
        first: float | None = None
        num_tokens = 0
        try:
            for n in counts:
                if n:
                    if first is None:
                        first = time.perf_counter()
                        fire(request_type=self.protocol, name=TTFT, response_time=(first - start) * 1e3,
                             response_length=n, exception=None, context={"workload": kind})
                    num_tokens += n
        except RequestFailed as e:
            fire(request_type=self.protocol, name=E2E, response_time=(time.perf_counter() - start) * 1e3,
                 response_length=num_tokens, exception=e, context={"workload": kind})
            return
        end = time.perf_counter()
        if first is not None and num_tokens > 1:
            fire(request_type=self.protocol, name=TPOT, response_time=(end - first) * 1e3 / (num_tokens - 1),
                 response_length=num_tokens, exception=None, context={"workload": kind})
        fire(request_type=self.protocol, name=E2E, response_time=(end - start) * 1e3, response_length=num_tokens,
             exception=None, context={"workload": kind})


def summaries(environment: Environment, request_type: str = "grpc") -> dict[str, EntrySummary]:
    """Each entry's counts and p95 (ms), from locust's stats."""
    out = {}
    for name in (TTFT, TPOT, E2E):
        entry = environment.stats.entries.get((name, request_type))
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
    problems = slo_problems(summaries(environment, getattr(opts, "protocol", "grpc")), limits, getattr(opts, "max_fail_ratio", 0.0), errors)
    for problem in problems:
        logger.error("SLO gate failed: %s", problem)
    if not problems:
        logger.info("SLO gates passed")
    environment.process_exit_code = 1 if problems else 0
