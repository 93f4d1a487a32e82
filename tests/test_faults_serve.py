"""Faults of clients and of the cluster, against a real Ray Serve (the `make serve` shape: gRPC
proxy -> ingress -> engine replica) with a tiny random model.

Each test is the regression test of a failure found by trying the service as a hostile client
and as a failing cluster: a reused request id, an 8 MB text prompt, undecodable request bytes,
non-finite and out-of-range fields, huge stop lists, tracebacks in the logs for client errors,
and a replica killed with SIGKILL (in-flight streams are retried or resumed on the other replica,
or get UNAVAILABLE when every replica died; while no replica exists requests fail fast; the
deployment recovers; across nodes and pools: tests/test_failover_cluster.py). After each, the
replica must hold no KV block and keep serving.
"""

from __future__ import annotations

import asyncio
import glob
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_grpc import (
    GREEDY,
    app_args,
    collect,
    is_idle,
    rpc_error,
    save_char_tokenizer,
    wait_no_blocks,
)

from deployments.client import SpecDecodeClient, make_request
from protos.specdecode.v1 import specdecode_pb2 as pb

APP = "faults"
SLOW_APP = "faults-slow"
SLOW_STEP_S = 0.4  # the slow app's engine sleeps this long before each step
SLOW_START_S = 6.0  # ... and this long in its constructor (a restart leaves no replica meanwhile)
WAIT_S = 3.0  # the slow app's replica_wait_timeout_s


# --- AsyncLLM: request ids (no Ray) -----------------------------------------------------------
def test_async_llm_reused_id_after_cancel_never_gets_old_tokens(tiny_llama: str) -> None:
    """Stream 1 is closed after its first output; stream 2 reuses the id at once. The id stays
    reserved until the engine thread has aborted stream 1, so stream 2 is refused ("in use") or
    runs, and when it runs it gets exactly its own tokens (before the fix it often received
    stream 1's first two). The server never reuses ids: it gives each request a fresh one."""
    from engine import LLM, AsyncLLM, InvalidRequestError, SamplingParams

    llm = AsyncLLM(tiny_llama, device="cpu", dtype="float32")
    ref = LLM(tiny_llama, device="cpu", dtype="float32")
    second = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = ref.generate([[7, 8, 9]], second)[0].token_ids

    async def run() -> list[list[int]]:
        got = []
        for _ in range(10):
            first = llm.generate([1, 2, 3], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), "R")
            await first.__anext__()
            await first.aclose()
            while True:
                try:
                    outs = [o async for o in llm.generate([7, 8, 9], second, "R")]
                    break
                except InvalidRequestError as e:
                    assert "already in use" in str(e)
                    await asyncio.sleep(0.001)
            got.append(outs[-1].token_ids)
        await llm.wait_idle()
        return got

    try:
        for ids in asyncio.run(run()):
            assert ids == expected
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_async_llm_abort_ends_the_stream(tiny_llama: str) -> None:
    """`AsyncLLM.abort` frees the request and ends its stream with finish_reason "abort"."""
    from engine import AsyncLLM, SamplingParams

    llm = AsyncLLM(tiny_llama, device="cpu", dtype="float32")

    async def run():
        stream = llm.generate([1, 2], SamplingParams(max_tokens=400, ignore_eos=True), "A")
        await stream.__anext__()
        llm.abort("A")
        return [o async for o in stream][-1]

    try:
        last = asyncio.run(asyncio.wait_for(run(), 30))
        assert last.finished and last.finish_reason == "abort"
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


# --- one Serve for the module ----------------------------------------------------------------
def slow_server_class(step_s: float, start_s: float) -> type:
    """SpecDecodeServer whose constructor and engine steps are slow (by value for Ray)."""
    from deployments.replica import SpecDecodeServer

    class SlowServer(SpecDecodeServer):
        def __init__(self, config) -> None:  # noqa: ANN001 - AppConfig
            time.sleep(start_s)
            super().__init__(config)
            execute_step = self.llm.engine.execute_step

            def slow_step():  # noqa: ANN202 - execute_step's result
                time.sleep(step_s)
                return execute_step()

            self.llm.engine.execute_step = slow_step

    return SlowServer


@dataclass
class Served:
    port: int
    model: str
    llm: object  # engine.LLM reference

    def client(self, app: str = APP, timeout: float | None = 60) -> SpecDecodeClient:
        return SpecDecodeClient(f"127.0.0.1:{self.port}", application=app, timeout=timeout)


@pytest.fixture(scope="module")
def served(tmp_path_factory, serve_instance) -> Iterator[Served]:
    from helpers import save_tiny_model
    from ray import serve

    from deployments.app import bind_app, build_app
    from deployments.config import AppConfig
    from engine import LLM

    model = save_tiny_model(str(tmp_path_factory.mktemp("faults_model")), "llama", max_position_embeddings=4096)
    save_char_tokenizer(model)
    port = serve_instance.grpc_port
    mark_serve_logs()
    with serve_instance.apps(APP, SLOW_APP):
        slow = AppConfig.from_dict({**app_args(model, None), "replica_wait_timeout_s": WAIT_S, "num_cpus": 1,
                                    "max_queued_requests": 16})
        slow_engine = {"ray_actor_options": {"num_cpus": 0}, "num_replicas": 2}
        # both applications at once: the slow one's replicas start while the other's do
        serve.run_many([
            serve.RunTarget(build_app(app_args(model, None)), name=APP, route_prefix=f"/{APP}"),
            serve.RunTarget(bind_app(slow, slow_engine, engine_cls=slow_server_class(SLOW_STEP_S, SLOW_START_S)),
                            name=SLOW_APP, route_prefix=f"/{SLOW_APP}"),
        ])
        with SpecDecodeClient(f"127.0.0.1:{port}", application=APP) as client:
            client.wait_ready(60)
        with SpecDecodeClient(f"127.0.0.1:{port}", application=SLOW_APP, timeout=60) as client:
            client.wait_ready(60)
            for _ in range(4):  # the ingress's router learns both replicas
                collect(client.generate([1], max_tokens=1))
        yield Served(port, model, LLM(model, device="cpu", dtype="float32"))


def reference(served: Served, prompt, **params) -> list[int]:
    from engine import SamplingParams

    return served.llm.generate(prompt, SamplingParams(**params))[0].token_ids


_LOGS_FROM: dict[str, int] = {}  # where this module's part of each Serve log file starts


def _serve_log_files() -> list[str]:
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    return glob.glob(os.path.join(session, "logs", "serve", "*.log"))


def mark_serve_logs() -> None:
    _LOGS_FROM.clear()
    _LOGS_FROM.update({path: os.path.getsize(path) for path in _serve_log_files()})


def serve_logs() -> str:
    """What Serve logged since this module deployed its apps (the Ray session is shared)."""
    text = []
    for path in _serve_log_files():
        with open(path, "rb") as f:
            f.seek(_LOGS_FROM.get(path, 0))
            text.append(f.read().decode(errors="replace"))
    return "\n".join(text)


# --- request ids -----------------------------------------------------------------------------
def test_reused_request_id_after_cancel_gets_only_its_own_tokens(served: Served) -> None:
    expected = reference(served, [7, 8, 9], max_tokens=8, temperature=0.0, ignore_eos=True)
    with served.client() as client:
        for _ in range(10):
            first = client.stub.Generate(make_request([1, 2, 3], max_tokens=48, temperature=0.0, ignore_eos=True,
                                                      request_id="R"), timeout=60, metadata=client.metadata)
            next(first)
            first.cancel()
            ids, _, last = collect(client.generate([7, 8, 9], max_tokens=8, temperature=0.0, ignore_eos=True,
                                                   request_id="R"))
            assert ids == expected and last.usage.completion_tokens == 8 and last.request_id == "R"
        assert is_idle(wait_no_blocks(client, 10))


# --- prompt size -----------------------------------------------------------------------------
def test_huge_text_prompt_is_refused_without_stalling_other_streams(served: Served) -> None:
    """An 8 MB text prompt is refused before tokenization; an 8-token request sent meanwhile gets
    its first token within 2 s (before the fix: 6-7 s, the replica's event loop tokenizing; the
    8 MB message itself crosses the proxy on the same 2 cores: 0.2-0.6 s measured)."""
    huge = "x" * (8 << 20)
    errors: list[grpc.RpcError] = []

    def send_huge() -> None:
        with served.client() as c:
            errors.append(rpc_error(lambda: list(c.stream(make_request(huge)))))

    with served.client() as client:
        client.generate([1, 2], max_tokens=2)  # warm
        collect(client.generate([1, 2], max_tokens=2))
        t = threading.Thread(target=send_huge)
        t.start()
        time.sleep(0.1)
        start = time.monotonic()
        stream = client.generate([4, 5, 6], max_tokens=8, temperature=0.0, ignore_eos=True)
        next(stream)
        ttft = time.monotonic() - start
        list(stream)
        t.join(60)
    assert errors and errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "characters" in errors[0].details()
    assert ttft < 2.0, f"first token after {ttft:.2f} s next to an 8 MB prompt"


# --- malformed and extreme requests ----------------------------------------------------------
@pytest.mark.parametrize("method,message", [
    ("/specdecode.v1.SpecDecode/Generate", "specdecode.v1.GenerateRequest"),
    ("/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest"),
    ("/grpc.health.v1.Health/Watch", "grpc.health.v1.HealthCheckRequest"),
])
def test_undecodable_bytes_are_invalid_argument(served: Served, method: str, message: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            list(call(b"\xff\xff\xff\xff", metadata=[("application", APP)], timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    assert f"not a valid {message}" in info.value.details()


EXTREME = {
    "temperature +inf": dict(temperature=math.inf),
    "temperature -inf": dict(temperature=-math.inf),
    "temperature nan": dict(temperature=math.nan),
    "temperature huge": dict(temperature=1e300),
    "top_p nan": dict(top_p=math.nan),
    "top_p inf": dict(top_p=math.inf),
    "top_p above 1": dict(top_p=1.5),
    "top_k int32 max": dict(top_k=2**31 - 1),
    "top_k negative": dict(top_k=-(2**31)),
    "seed negative": dict(seed=-1),
    "max_tokens int32 max": dict(max_tokens=2**31 - 1),
    "max_tokens negative": dict(max_tokens=-5),
    "max_speculative_tokens uint32 max": dict(max_speculative_tokens=2**32 - 1),
    "10k stop strings": dict(stop=["ab"] * 10_000),
    "1 MB stop string": dict(stop=["x" * (1 << 20)]),
    "100k stop token ids": dict(stop_token_ids=[3] * 100_000),
    "stop token id negative": dict(stop_token_ids=[-7]),
    "request_id 100k characters": dict(request_id="x" * 100_000),  # echoed in every message before
    "request_id with a newline": dict(request_id="ok\nERROR forged log line"),
}


@pytest.mark.parametrize("name", list(EXTREME))
def test_extreme_field_is_invalid_argument(served: Served, name: str) -> None:
    with served.client() as client:
        err = rpc_error(lambda: list(client.stream(pb.GenerateRequest(prompt="ab", **EXTREME[name]))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.code(), err.details())
    assert err.details() and "Traceback" not in err.details() and len(err.details()) < 1000


_int32 = st.integers(-(2**31), 2**31 - 1)
_double = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 1e-300, -0.0]))
fields = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(_int32, st.integers(1, 8)),
    "temperature": _double, "top_p": _double, "top_k": _int32,
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(max_size=300), max_size=20),
    "stop_token_ids": st.lists(_int32, max_size=300),
    "ignore_eos": st.booleans(),
    "speculation": st.integers(0, 5),
    "max_speculative_tokens": st.integers(0, 2**32 - 1),
    "request_id": st.text(max_size=64),
})
prompts = st.one_of(
    st.builds(lambda t: {"prompt": t}, st.text(max_size=200)),
    st.builds(lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)}, st.lists(_int32, max_size=80)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=prompts, extra=fields)
def test_fuzzed_requests_get_a_clean_status(served: Served, prompt: dict, extra: dict) -> None:
    """Random requests over every field's whole proto range: each is served or refused with a
    client status and a plain message; never INTERNAL or UNKNOWN."""
    extra = {**extra, "max_tokens": min(extra.get("max_tokens", 4), 8) if extra.get("max_tokens", 4) > 0 else extra["max_tokens"]}
    request = pb.GenerateRequest(**prompt, **extra)
    with served.client(timeout=60) as client:
        try:
            collect(client.stream(request))
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), (
                e.code(), e.details(), request)
            assert "Traceback" not in e.details()


def test_still_serving_after_bad_inputs_with_no_blocks_held(served: Served) -> None:
    prompt = [5, 17, 33, 8]
    with served.client() as client:
        ids, _, _ = collect(client.generate(prompt, **GREEDY))
        assert ids == reference(served, prompt, **GREEDY)
        assert is_idle(wait_no_blocks(client, 10))


# --- logs ------------------------------------------------------------------------------------
def test_client_error_is_one_warning_line_and_cancel_logs_no_error(served: Served) -> None:
    marker = "-1.2578125"  # a temperature no other test sends
    with served.client() as client:
        err = rpc_error(lambda: list(client.stream(pb.GenerateRequest(prompt="ab", temperature=float(marker)))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        call = client.stub.Generate(make_request([1, 2], max_tokens=400, ignore_eos=True), timeout=60,
                                    metadata=client.metadata)
        next(call)
        call.cancel()
        assert is_idle(wait_no_blocks(client, 10))
    time.sleep(1.0)  # log files are flushed by Ray's handlers
    logs = serve_logs()
    refused = [line for line in logs.splitlines() if marker in line]
    assert len(refused) == 1 and refused[0].startswith("WARNING"), refused
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 500 : logs.index("Traceback") + 1500]
    bad = [line for line in logs.splitlines() if line.startswith("ERROR") or "unexpected error" in line]
    assert not bad, bad


# --- replica loss ----------------------------------------------------------------------------
def engine_replica_pids(app: str, expected: int, timeout: float = 60) -> list[int]:
    """PIDs of the app's engine replica actors, via Ray's `__ray_call__`."""
    import ray

    from deployments.config import DEPLOYMENT_NAME

    deadline = time.monotonic() + timeout
    while True:
        wait_running(app, expected)
        pids = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"] if isinstance(entry, dict) else entry
            if name.startswith(f"SERVE_REPLICA::{app}#{DEPLOYMENT_NAME}#"):
                try:
                    handle = ray.get_actor(name, namespace="serve")
                    pids.append(ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=10))
                except (ray.exceptions.RayError, ValueError):
                    continue  # a replica that is going away
        if len(pids) == expected:
            return pids
        assert time.monotonic() < deadline, f"found {pids}, expected {expected} engine replicas"
        time.sleep(0.5)


def wait_running(app: str, expected: int, timeout: float = 90, deployment: str | None = None) -> None:
    """Wait until exactly `expected` replicas of the app's `deployment` (default: the engine's) run."""
    from ray import serve

    from deployments.config import DEPLOYMENT_NAME

    deployment = deployment or DEPLOYMENT_NAME
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dep = serve.status().applications[app].deployments[deployment]
        if dep.replica_states.get("RUNNING") == expected and sum(dep.replica_states.values()) == expected:
            return
        time.sleep(0.2)
    raise AssertionError(f"{app}: {expected} {deployment} replicas were not running within {timeout} s")


def wait_serving(served: Served, app: str, timeout: float = 60) -> float:
    """Send small requests until one succeeds; return how long that took (recovery time)."""
    start = time.monotonic()
    while True:
        try:
            with served.client(app, timeout=30) as client:
                collect(client.generate([1], max_tokens=1))
            return time.monotonic() - start
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
            assert time.monotonic() - start < timeout, f"{app} did not recover within {timeout} s"
            time.sleep(0.2)


def test_replica_lost_before_first_message_is_retried_transparently(served: Served) -> None:
    """Four requests wait for their first (slow) step on two replicas; one replica is killed
    with SIGKILL. Those it held had streamed nothing, so the ingress retries them on the other
    replica: every client gets exactly its greedy tokens, none sees an error."""
    prompts = [[9, 10, 11], [12, 13], [14, 15, 16, 17], [18]]
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = [reference(served, p, **params) for p in prompts]
    results: list[object] = [None] * len(prompts)

    def run(i: int) -> None:
        with served.client(SLOW_APP, timeout=120) as client:
            try:
                results[i] = collect(client.generate(prompts[i], **params))[0]
            except grpc.RpcError as e:
                results[i] = e

    victim = engine_replica_pids(SLOW_APP, 2)[0]
    wait_serving(served, SLOW_APP)
    before = serve_logs().count("retrying on another replica")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    start = time.monotonic()
    for t in threads:
        t.start()
        time.sleep(0.03)
    time.sleep(max(0.0, start + 0.6 * SLOW_STEP_S - time.monotonic()))  # accepted, no first step yet
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert results == expected, results
    time.sleep(1.0)
    assert serve_logs().count("retrying on another replica") > before
    wait_running(SLOW_APP, 2)


def test_replica_lost_mid_stream_is_resumed_on_another(served: Served) -> None:
    """Four greedy streams on two replicas, each with tokens already sent; one replica is killed
    with SIGKILL. The ingress resumes its streams on the other (prompt + the tokens sent
    prefilled there): every client gets exactly the undisturbed greedy output, text included,
    usage counted once, and no error."""
    prompts = [[9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19]]  # what one replica can hold at once
    params = dict(max_tokens=14, temperature=0.0, ignore_eos=True)
    expected = [reference(served, p, **params) for p in prompts]
    results: list[object] = [None] * len(prompts)
    started = [threading.Event() for _ in prompts]

    def run(i: int) -> None:
        with served.client(SLOW_APP, timeout=120) as client:
            try:
                ids, text, last = [], "", None
                for m in client.generate(prompts[i], **params):
                    ids.extend(m.token_ids)
                    text += m.text
                    last = m
                    started[i].set()
                results[i] = (ids, text, last.usage.completion_tokens, last.usage.prompt_tokens)
            except grpc.RpcError as e:
                results[i] = e
                started[i].set()

    victim = engine_replica_pids(SLOW_APP, 2)[0]
    wait_serving(served, SLOW_APP)
    with served.client(SLOW_APP, timeout=60) as client:  # the ingress's router learns both replicas
        for _ in range(4):
            collect(client.generate([1], max_tokens=1))
    before = serve_logs().count("resuming on another replica")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(60)
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(120)
    tokenizer = served.llm.tokenizer
    for result, want, prompt in zip(results, expected, prompts, strict=True):
        assert not isinstance(result, grpc.RpcError), (result.code(), result.details())
        ids, text, completion, prompt_tokens = result
        assert ids == want and text == tokenizer.decode(want, skip_special_tokens=True)
        assert (completion, prompt_tokens) == (len(want), len(prompt))
    deadline = time.monotonic() + 15  # the ingress's log reaches the file within a few seconds
    while serve_logs().count("resuming on another replica") <= before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert serve_logs().count("resuming on another replica") > before  # the victim served some of them
    wait_running(SLOW_APP, 2)


def test_replica_lost_mid_stream_is_unavailable_and_no_replica_fails_fast(served: Served) -> None:
    """A stream that has sent tokens when its replicas die ends with UNAVAILABLE and a plain
    message (no Ray internals); while no replica exists (the new ones take SLOW_START_S to
    start) a new request fails within the wait bound with UNAVAILABLE; then service recovers."""
    pids = engine_replica_pids(SLOW_APP, 2)
    wait_serving(served, SLOW_APP)
    with served.client(SLOW_APP, timeout=120) as client, served.client(SLOW_APP, timeout=120) as other:
        stream = client.generate([1, 2, 3], max_tokens=400, temperature=0.0, ignore_eos=True)
        next(stream)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        lost = rpc_error(lambda: list(stream))
        start = time.monotonic()
        none = rpc_error(lambda: list(other.generate([1], max_tokens=2)))
        waited = time.monotonic() - start
    assert lost.code() == grpc.StatusCode.UNAVAILABLE, (lost.code(), lost.details())
    assert "stopped after" in lost.details() and "actor" not in lost.details().lower()
    assert none.code() == grpc.StatusCode.UNAVAILABLE, (none.code(), none.details())
    assert waited < WAIT_S + 3, waited
    wait_running(SLOW_APP, 2)
    wait_serving(served, SLOW_APP)
    prompt = [9, 10, 11]
    with served.client(SLOW_APP, timeout=60) as client:
        ids = collect(client.generate(prompt, max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        assert ids == reference(served, prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
        assert is_idle(wait_no_blocks(client, 10))


# --- the chaos tool --------------------------------------------------------------------------
def test_chaos_storm_reports_no_leaks_and_unchanged_output(served: Served) -> None:
    """`python -m loadtest.chaos`'s storm against this deployment: random cancels, deadlines,
    closed channels, bad requests, junk bytes and reused ids; then no block held, same tokens."""
    from loadtest.chaos import run_storm

    with served.client(timeout=120) as client:
        report = run_storm(client, APP, n=40, concurrency=4, seed=1)
    assert report["ok"], report
    assert sum(report["outcomes"].values()) == 40
