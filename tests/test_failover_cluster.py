"""No stream lost, across nodes and placements: a real replica process SIGKILLed mid-stream on a
multi-node `ray.cluster_utils.Cluster` (one raylet and object store per node, as in
tests/test_disaggregated.py), with several greedy streams in flight. Every client gets the whole
output of an undisturbed run (the target alone, token for token, text included), usage counted
once, and no error:
- prefill/decode (`PD`): a decode replica killed mid-stream (its streams go on on the other), the
  prefill replica killed after the first token went out (the decode side prefills after it);
- drafter pool (`POOL`): an engine replica killed while it drafts remotely (its streams go on on
  another, drafting in the pool there), a drafter replica killed (steps go without drafts until
  the consistent-hash ring moves the engine to the other drafter: no stream is even resumed);
- faults during failover: the replica a stream was resumed on dies too (it goes on on a third),
  every engine replica gone (a bounded, specific UNAVAILABLE), clients that cancel while their
  streams are being resumed;
- `python -m loadtest.chaos --kill` against `POOL`: no stream failed.
After each, every surviving engine replica holds no request, no KV block and no per-request state
(`check_no_leaks` on its engine thread), and drafter replicas hold no session past its TTL.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from helpers import SERVICERS, free_port
from test_disaggregated import THRESHOLD, K, app_config, pool_stats, reference
from test_faults_serve import wait_running
from test_serve_grpc import collect, save_char_tokenizer

from deployments.client import SpecDecodeClient, make_request
from deployments.config import DEPLOYMENT_NAME, DRAFTER_DEPLOYMENT_NAME, PREFILL_DEPLOYMENT_NAME
from loadtest.chaos import replica_handles

pytestmark = pytest.mark.slow

PD, POOL = "pd-failover", "pool-failover"
STEP_S = 0.05  # every engine step sleeps this long: a stream is still running when its replica is killed
STALL = "stall"  # request ids the prefill replica holds STALL_S s after their first token (before the handoff)
STALL_S = 60.0
RESTART_S = 60.0  # an engine replica started while the module's marker file exists waits (this long at most)
WAIT_S = 8.0  # POOL's replica_wait_timeout_s: the bound on a resumption that finds no replica
DRAFTER_TTL_S = 2.0  # the drafter pool forgets a session idle this long
GREEDY = dict(temperature=0.0, ignore_eos=True)


@dataclass
class Served:
    port: int
    target: str
    slow_restart: str  # the marker file: engine replicas started while it exists wait RESTART_S

    def client(self, app: str, timeout: float | None = 120) -> SpecDecodeClient:
        return SpecDecodeClient(f"127.0.0.1:{self.port}", application=app, timeout=timeout)


def replica_classes(step_s: float, marker: str, restart_s: float, stall: str, stall_s: float) -> tuple[type, type]:
    """The engine replica (slow steps; slow start while `marker` exists) and the prefill replica
    (holds `stall`* requests after their first token). Built here so that Ray pickles them by value."""
    import asyncio

    from deployments.common import PrefillResult
    from deployments.replica import SpecDecodeServer

    class Engine(SpecDecodeServer):
        def __init__(self, config, drafter_pool=None, **role) -> None:  # noqa: ANN001, ANN003 - AppConfig, a handle
            deadline = time.monotonic() + restart_s
            while os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.1)
            super().__init__(config, drafter_pool, **role)
            execute_step = self.llm.engine.execute_step

            def slow_step():  # noqa: ANN202 - execute_step's result
                time.sleep(step_s)
                return execute_step()

            self.llm.engine.execute_step = slow_step

    class Prefill(SpecDecodeServer):
        async def prefill(self, prompt, params, label, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            async for item in super().prefill(prompt, params, label, *args, **kwargs):
                if isinstance(item, PrefillResult) and label.startswith(stall):
                    await asyncio.sleep(stall_s)
                yield item

    return Engine, Prefill


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    import ray
    from helpers import save_perturbed_copy, save_tiny_model
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import bind_app
    from deployments.config import AppConfig

    root = tmp_path_factory.mktemp("failover_models")
    target = save_tiny_model(str(root / "target"), "llama", max_position_embeddings=1024)
    save_char_tokenizer(target)
    drafter = save_perturbed_copy(target, str(root / "drafter"), noise=0.02)
    marker = str(root / "slow_restart")
    engine_cls, prefill_cls = replica_classes(STEP_S, marker, RESTART_S, STALL, STALL_S)
    # the head (Serve's controller, proxy, ingresses; POOL's engines) and one node per pool
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"engine": 10},
                                                            "object_store_memory": 80 << 20})
    for pool in ("prefill", "decode", "drafter"):
        cluster.add_node(num_cpus=1, resources={pool: 10}, object_store_memory=80 << 20)
    port = free_port()
    ray.init(address=cluster.address, log_to_driver=False)

    def on(resource: str, num_replicas: int) -> dict:
        return {"num_replicas": num_replicas, "ray_actor_options": {"num_cpus": 0, "resources": {resource: 1}},
                "health_check_period_s": 1}

    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()},
                    grpc_options={"port": port, "grpc_servicer_functions": SERVICERS})
        pd = app_config(target, drafter, transport="object_store")
        pool = AppConfig.from_dict({
            "model": target, "device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_queued_requests": 16,
            "max_prompt_tokens": 200, "max_tokens": 400, "default_max_tokens": 16, "num_cpus": 1,
            "replica_wait_timeout_s": WAIT_S,
            "speculative": {"method": "draft", "model": drafter, "num_speculative_tokens": K, "adaptive": False,
                            "placement": "remote"},
            "drafter_pool": {"timeout_s": 1.0, "session_ttl_s": DRAFTER_TTL_S},
        })
        serve.run_many([
            serve.RunTarget(bind_app(pd, on("decode", 2), engine_cls=engine_cls, prefill_overrides=on("prefill", 1),
                                     prefill_cls=prefill_cls), name=PD, route_prefix=f"/{PD}"),
            serve.RunTarget(bind_app(pool, on("engine", 3), engine_cls=engine_cls,
                                     drafter_overrides=on("drafter", 2)), name=POOL, route_prefix=f"/{POOL}"),
        ])
        for app in (PD, POOL):
            with SpecDecodeClient(f"127.0.0.1:{port}", application=app) as client:
                client.wait_ready(120)
        yield Served(port, target, marker)
    finally:
        if os.path.exists(marker):
            os.remove(marker)
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def target_alone(served: Served):
    from engine import LLM

    return LLM(served.target, device="cpu", dtype="float32", speculative=None)


# --- replicas, from the test process -----------------------------------------------------------
def on_replica(actor, fn: Callable, timeout: float = 60):  # noqa: ANN201 - what fn returns
    """`fn(the replica's deployment object)` run in the replica's process (`fn`: a lambda or a
    nested function, which Ray pickles by value)."""
    import ray

    def call(replica_actor, fn):  # noqa: ANN001, ANN202
        return fn(replica_actor._replica_impl._user_callable_wrapper.user_callable)

    return ray.get(actor.__ray_call__.remote(call, fn), timeout=timeout)


def pid_of(actor) -> int:
    return on_replica(actor, lambda _: os.getpid())


def num_running(actor) -> int:
    return on_replica(actor, lambda server: server.llm.stats().get("num_running", 0))


def busiest(actors: list, timeout: float = 30) -> object:
    """The engine replica with the most running requests, once one has any (a replica's counts
    are as of its last step, which may still be under way after the step's first token went out)."""
    deadline = time.monotonic() + timeout
    while max(counts := [num_running(a) for a in actors]) == 0:
        assert time.monotonic() < deadline, "no engine replica runs a request"
        time.sleep(0.02)
    return actors[counts.index(max(counts))]


def resumed(app: str) -> int:
    """Streams the app's ingress resumed after a lost replica."""
    from ray import serve

    from deployments.config import INGRESS_DEPLOYMENT_NAME

    handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT_NAME, app_name=app)
    return handle.resumption_counts.remote().result(timeout_s=30).get("engine", 0)


def assert_engines_clean(actors: list, timeout: float = 60) -> None:
    """Each engine replica, once its requests are done, holds no request and no KV block, and no
    per-request state (`check_no_leaks`), checked on its engine thread (as
    helpers.assert_no_leaked_blocks, which cannot travel to the replica by value)."""

    def check(server):  # noqa: ANN001, ANN202
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        def on_engine_thread(engine):  # noqa: ANN001, ANN202
            live = engine.live_requests()
            engine.block_manager.check_invariants(live)
            engine.check_no_leaks()
            return len(live), engine.block_manager.num_blocks - engine.block_manager.num_free_blocks

        with ThreadPoolExecutor(1) as pool:  # a loop of its own: the replica's is not this thread's
            return pool.submit(asyncio.run, server.llm.call(on_engine_thread, server.llm.engine)).result(30)

    for actor in actors:
        deadline = time.monotonic() + timeout
        while (held := on_replica(actor, check)) != (0, 0):
            assert time.monotonic() < deadline, f"requests, blocks still held: {held}"
            time.sleep(0.2)


def assert_drafters_clean(actors: list) -> None:
    """Each drafter replica holds no session and no block once DRAFTER_TTL_S has passed (the
    sessions of an engine replica that died go with the TTL)."""
    from engine.spec_decode.remote import DraftBatch

    time.sleep(DRAFTER_TTL_S + 0.5)
    for actor in actors:
        stats = on_replica(actor, lambda server: (server.service.draft(DraftBatch((), ())), server.service.stats())[1])
        assert (stats["sessions"], stats["used_blocks"]) == (0, 0), stats


def warm(served: Served, app: str, n: int = 6) -> None:
    """A few requests, so that the ingress's router knows every replica."""
    with served.client(app, timeout=60) as client:
        for i in range(n):
            collect(client.generate([1 + i], max_tokens=1))


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 97) for _ in range(n)]


# --- streams through a fault -------------------------------------------------------------------
def streams(served: Served, app: str, prompts: list[list[int]], params: dict, during: Callable[[list], None],
            request_ids: list[str] | None = None) -> list:
    """`prompts` as concurrent streams; once each has its first message, `during(their gRPC
    calls)` runs (it may cancel them). Each stream's (token ids, text, completion tokens, prompt
    tokens), or its grpc.RpcError."""
    results: list[object] = [None] * len(prompts)
    calls: list[object] = [None] * len(prompts)
    started = [threading.Event() for _ in prompts]

    def run(i: int) -> None:
        with served.client(app) as client:
            request = make_request(prompts[i], request_id=request_ids[i] if request_ids else "", **params)
            calls[i] = client.stub.Generate(request, timeout=120, metadata=client.metadata)
            ids, text, last = [], "", None
            try:
                for m in calls[i]:
                    ids, text, last = ids + list(m.token_ids), text + m.text, m
                    started[i].set()
                results[i] = (ids, text, last.usage.completion_tokens, last.usage.prompt_tokens)
            except grpc.RpcError as e:
                results[i] = e
            finally:
                started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120)
    during(calls)
    for t in threads:
        t.join(180)
    return results


def assert_undisturbed(results: list, prompts: list[list[int]], params: dict, llm) -> None:  # noqa: ANN001
    for result, prompt in zip(results, prompts, strict=True):
        assert not isinstance(result, grpc.RpcError), (result.code(), result.details())
        ids, text, completion, prompt_tokens = result
        want = reference(llm, prompt, **params)
        assert ids == want and text == llm.tokenizer.decode(want, skip_special_tokens=True)
        assert (completion, prompt_tokens) == (len(want), len(prompt))


def kill_the_busiest_under_streams(served: Served, app: str, actors: list, prompts: list[list[int]], params: dict,
                                   llm) -> object:  # noqa: ANN001
    """Streams of `prompts`; once each has its first message, the replica of `actors` running the
    most of them is killed. Every stream must end undisturbed, some resumed; the killed replica."""
    before = resumed(app)
    victim = []
    results = streams(served, app, prompts, params, lambda _: victim.append(sigkill_busiest(actors)))
    assert_undisturbed(results, prompts, params, llm)
    assert resumed(app) > before
    return victim[0]


def sigkill(actor) -> None:
    os.kill(pid_of(actor), signal.SIGKILL)


def sigkill_busiest(actors: list) -> object:
    victim = busiest(actors)
    sigkill(victim)
    return victim


# --- prefill/decode -----------------------------------------------------------------------------
def test_decode_replica_killed_mid_stream(served: Served, target_alone) -> None:
    """Four streams (two prefilled in the prefill pool, two by the decode replica) on two decode
    replicas; the busier one is killed: its streams go on on the other."""
    prompts = [prompt_of(1, THRESHOLD + 20), prompt_of(2, THRESHOLD + 30), prompt_of(3, 8), prompt_of(4, 12)]
    params = dict(max_tokens=48, **GREEDY)
    warm(served, PD)
    decode = replica_handles(PD, DEPLOYMENT_NAME)
    victim = kill_the_busiest_under_streams(served, PD, decode, prompts, params, target_alone)
    assert_engines_clean([a for a in decode if a is not victim] + replica_handles(PD, PREFILL_DEPLOYMENT_NAME))
    assert pool_stats(PD)["inflight_prefills"] == 0


def test_prefill_replica_killed_after_the_first_token(served: Served, target_alone) -> None:
    """Four long prompts in the prefill pool, held there after their first token went to the
    client; the prefill replica is killed: each stream goes on from a decode replica's prefill of
    the prompt and the token sent (a fallback, not a resumption)."""
    wait_running(PD, 2)
    prompts = [prompt_of(10 + i, THRESHOLD + 10 + 5 * i) for i in range(4)]
    params = dict(max_tokens=32, **GREEDY)
    (prefill,) = replica_handles(PD, PREFILL_DEPLOYMENT_NAME)
    decode = replica_handles(PD, DEPLOYMENT_NAME)

    def fallbacks() -> int:
        return sum(on_replica(a, lambda server: server.fallbacks.get("no_handoff", 0)) for a in decode)

    before = fallbacks()
    results = streams(served, PD, prompts, params, lambda _: sigkill(prefill), [f"{STALL}-{i}" for i in range(4)])
    assert_undisturbed(results, prompts, params, target_alone)
    assert fallbacks() == before + 4
    assert_engines_clean(decode)
    assert pool_stats(PD)["inflight_prefills"] == 0


def test_clients_cancel_while_their_streams_are_resumed(served: Served, target_alone) -> None:
    """A decode replica is killed under four streams, and every client cancels as soon as the
    ingress has begun resuming one: nothing is left running or held on the surviving replicas,
    and the service goes on serving."""
    wait_running(PD, 2)
    wait_running(PD, 1, deployment=PREFILL_DEPLOYMENT_NAME)
    warm(served, PD)
    decode = replica_handles(PD, DEPLOYMENT_NAME)
    prompts = [prompt_of(20 + i, 6 + i) for i in range(4)]
    before = resumed(PD)
    victim = []

    def kill_then_cancel(calls: list) -> None:
        victim.append(sigkill_busiest(decode))
        deadline = time.monotonic() + 30
        while resumed(PD) == before:
            assert time.monotonic() < deadline, "no stream was resumed"
            time.sleep(0.02)
        for call in calls:
            call.cancel()

    results = streams(served, PD, prompts, dict(max_tokens=64, **GREEDY), kill_then_cancel)
    assert all(not isinstance(r, grpc.RpcError) or r.code() == grpc.StatusCode.CANCELLED for r in results), results
    assert_engines_clean([a for a in decode if a is not victim[0]] + replica_handles(PD, PREFILL_DEPLOYMENT_NAME))
    assert pool_stats(PD)["inflight_prefills"] == 0
    params = dict(max_tokens=16, **GREEDY)
    with served.client(PD) as client:
        assert collect(client.generate(prompts[0], **params))[0] == reference(target_alone, prompts[0], **params)


# --- the drafter pool ---------------------------------------------------------------------------
def remote_drafting(actors: list, key: str) -> int:
    return sum(on_replica(a, lambda server: server.llm.stats()["remote_drafting"].get(key, 0)) for a in actors)


def noticed(engines: list) -> int:
    """Steps the engines drafted without the pool (a failed call) or resent a context to another
    drafter replica (an `unknown` answer): how they notice a lost drafter replica."""
    return remote_drafting(engines, "failures") + remote_drafting(engines, "unknown")


def test_engine_replica_killed_while_drafting_remotely(served: Served, target_alone) -> None:
    """Four streams drafting in the pool on three engine replicas; the busiest is killed: its
    streams go on on the others, which draft in the pool for them, and the pool forgets the dead
    replica's sessions."""
    prompts = [prompt_of(30 + i, 20 + 3 * i) for i in range(4)]
    params = dict(max_tokens=60, **GREEDY)
    warm(served, POOL)
    engines = replica_handles(POOL, DEPLOYMENT_NAME)
    victim = kill_the_busiest_under_streams(served, POOL, engines, prompts, params, target_alone)
    survivors = [a for a in engines if a is not victim]
    assert remote_drafting(survivors, "drafts") > 0
    assert_engines_clean(survivors)
    assert_drafters_clean(replica_handles(POOL, DRAFTER_DEPLOYMENT_NAME))


def test_drafter_replica_killed_mid_stream(served: Served, target_alone) -> None:
    """Four streams; the drafter replica holding their sessions is killed: the engines' steps go
    without drafts (failed calls) until the pool's router moves them to the other drafter replica
    (which answers `unknown` once and is sent the whole context), tokens unchanged, and no stream
    needs resuming."""
    wait_running(POOL, 3)
    warm(served, POOL)
    prompts = [prompt_of(40 + i, 18 + 2 * i) for i in range(4)]
    params = dict(max_tokens=80, **GREEDY)
    engines = replica_handles(POOL, DEPLOYMENT_NAME)
    drafters = replica_handles(POOL, DRAFTER_DEPLOYMENT_NAME)
    sessions = [on_replica(d, lambda server: server.service.stats()["sessions"]) for d in drafters]
    before_resumed, before_noticed = resumed(POOL), noticed(engines)
    victim = []

    def kill_busiest_drafter(_: list) -> None:
        held = [on_replica(d, lambda server: server.service.stats()["sessions"]) for d in drafters]
        assert max(held) > 0, (sessions, held)
        victim.append(drafters[held.index(max(held))])
        sigkill(victim[0])

    results = streams(served, POOL, prompts, params, kill_busiest_drafter)
    assert_undisturbed(results, prompts, params, target_alone)
    assert resumed(POOL) == before_resumed
    assert noticed(engines) > before_noticed
    assert_engines_clean(engines)
    assert_drafters_clean([d for d in drafters if d is not victim[0]])


def test_replica_lost_during_a_resumption_goes_on_on_a_third(served: Served, target_alone) -> None:
    """A stream's replica is killed, then the replica it was resumed on: it goes on on the third
    engine replica, with the undisturbed output."""
    wait_running(POOL, 3)
    wait_running(POOL, 2, deployment=DRAFTER_DEPLOYMENT_NAME)
    warm(served, POOL)
    engines = replica_handles(POOL, DEPLOYMENT_NAME)
    prompts = [prompt_of(50, 24)]
    params = dict(max_tokens=160, **GREEDY)
    before = resumed(POOL)
    killed = []

    def kill_twice(_: list) -> None:
        first = sigkill_busiest(engines)
        killed.append(first)
        killed.append(sigkill_busiest([a for a in engines if a is not first]))  # where it was resumed

    results = streams(served, POOL, prompts, params, kill_twice)
    assert_undisturbed(results, prompts, params, target_alone)
    assert resumed(POOL) == before + 2
    assert_engines_clean([a for a in engines if a not in killed])


def test_chaos_kill_reports_every_stream_completed(served: Served) -> None:
    """`python -m loadtest.chaos --kill` against the drafter-pool application: the engine replica
    serving the most of its streams is killed, and the report counts each stream completed or
    resumed (none failed), every one equal to its undisturbed output."""
    from loadtest.chaos import run_kill

    wait_running(POOL, 3)
    warm(served, POOL)
    with served.client(POOL) as client:
        report = run_kill(client, POOL, num_streams=4, max_tokens=60, seed=3)
    assert report["ok"], report
    assert report["streams"]["failed"] == 0 and report["streams"]["resumed"] >= 1, report
    assert sum(report["streams"].values()) == 4 and report["mismatched"] == 0, report


def test_every_engine_replica_gone_is_a_bounded_unavailable(served: Served) -> None:
    """Every engine replica is killed under three streams, and none comes back within the wait
    bound: each client gets UNAVAILABLE saying how far its stream got, within the bound (a
    replica at a time: MAX_ATTEMPTS waits of WAIT_S at most), never a hang or Ray's internals.
    (Last: the application has no engine replica for a while afterwards.)"""
    from deployments.ingress import MAX_ATTEMPTS

    wait_running(POOL, 3)
    wait_running(POOL, 2, deployment=DRAFTER_DEPLOYMENT_NAME)
    warm(served, POOL)
    engines = replica_handles(POOL, DEPLOYMENT_NAME)
    prompts = [prompt_of(60 + i, 10 + i) for i in range(3)]
    killed_at: list[float] = []
    ended_at: list[float] = []

    def kill_all(_: list) -> None:
        open(served.slow_restart, "w").close()
        pids = [pid_of(a) for a in engines]
        killed_at.append(time.monotonic())
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    try:
        results = streams(served, POOL, prompts, dict(max_tokens=300, **GREEDY), kill_all)
        ended_at.append(time.monotonic())
    finally:
        if os.path.exists(served.slow_restart):
            os.remove(served.slow_restart)  # the replicas may come back now
    for result in results:
        assert isinstance(result, grpc.RpcError), "a stream finished with every replica dead"
        assert result.code() == grpc.StatusCode.UNAVAILABLE, (result.code(), result.details())
        details = result.details()
        assert "stopped after" in details and "no other took it over" in details, details
        assert "actor" not in details.lower() and "Traceback" not in details, details
    assert ended_at[0] - killed_at[0] < MAX_ATTEMPTS * (WAIT_S + 1) + 5, ended_at[0] - killed_at[0]
    assert_drafters_clean(replica_handles(POOL, DRAFTER_DEPLOYMENT_NAME))
