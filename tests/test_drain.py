"""Graceful drain: an engine replica that Serve removes (a downscale, a redeploy) lets its streams
run on for the drain window, then hands each one still running over (`Handover`), and the ingress
resumes it on another replica after the tokens the client already has. No client sees an error,
every greedy stream equals the undisturbed run, and the handovers leave the budget for lost
replicas (MAX_RESUMPTIONS) untouched.

Without Ray: the ingress's resumption loop over scripted replicas, and an engine replica's drain
(its Serve shutdown flag stubbed). On the shared Serve: a downscale 2 -> 1 driven by the
autoscaler (a test policy), a redeploy that replaces every replica, streams that finish within the
window, and the same downscale with the drain turned off, which shows what Serve does without it:
it waits for the streams until `graceful_shutdown_timeout_s`, then kills the replica, and the
streams still running there are cut (the ingress can only resume them as lost).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from helpers import assert_no_leaked_blocks, save_tiny_model
from test_faults_serve import slow_server_class as faults_slow_server_class
from test_serve_grpc import app_args, collect, save_char_tokenizer

from deployments import tracing as tr
from deployments.common import Accepted, Handover, Resume
from deployments.drain import HANDOVER_MARGIN_S, drain_window_s
from protos.specdecode.v1 import specdecode_pb2 as pb

PROMPT = [5, 9, 17, 33, 5, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = save_tiny_model(str(tmp_path_factory.mktemp("drain") / "m"), "llama", max_position_embeddings=4096)
    save_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference_llm(model: str):
    from engine import LLM

    return LLM(model, device="cpu", dtype="float32")


def greedy(llm, prompt: list[int], max_tokens: int) -> list[int]:
    from engine import SamplingParams

    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0].token_ids


# --- the window -------------------------------------------------------------------------------
def test_the_window_ends_before_serve_kills_the_replica() -> None:
    assert drain_window_s(10.0, 30.0) == 10.0
    assert drain_window_s(60.0, 30.0) == 30.0 - HANDOVER_MARGIN_S
    assert drain_window_s(10.0, 1.0) == 0.0  # a grace shorter than the margin: hand over at once
    assert drain_window_s(10.0, None) == 10.0  # outside Serve


def test_abort_ends_a_stream_whose_handoff_waits_for_room(model) -> None:
    """`AsyncLLM.abort` (what a drain hands a stream over with) also ends a stream whose handoff
    waits for a free sequence slot, with finish_reason "abort", and the handoff is never imported."""
    from engine import AsyncLLM, LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefill = LLMEngine(model, device="cpu", dtype="float32")
    prefill.add_request("p", PROMPT, params, export_after_prefill=True)
    handoffs = {}
    while prefill.has_unfinished_requests():
        prefill.step()
        handoffs.update(prefill.take_handoffs())
    llm = AsyncLLM(model, device="cpu", dtype="float32", max_num_seqs=1)

    async def main():
        busy = llm.generate([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True), "busy")
        await busy.__anext__()  # it holds the only slot
        waiting = llm.generate(PROMPT, params, "w", handoff=handoffs["p"])
        reader = asyncio.ensure_future(anext(waiting))
        await asyncio.sleep(0.2)
        assert not reader.done()
        llm.abort("w")
        last = await asyncio.wait_for(reader, 10)
        llm.abort("busy")
        [o async for o in busy]
        return last

    try:
        last = asyncio.run(main())
        assert last.finished and last.finish_reason == "abort" and not last.delta_token_ids
        asyncio.run(llm.wait_idle())
        assert_no_leaked_blocks(llm.engine)
        assert not llm._pending_imports
    finally:
        llm.shutdown()


# --- the ingress, without Ray -----------------------------------------------------------------
class ScriptedResponse:
    """A handle call's streaming response: the items of one scripted replica (an exception in
    the script is raised where it stands)."""

    def __init__(self, items: list) -> None:
        self.items = iter(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        item = next(self.items, StopAsyncIteration)
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedEngine:
    """The engine deployment's handle: each `generate` call goes to the next scripted replica;
    the `Resume` each call carried is kept."""

    def __init__(self, scripts: list[list]) -> None:
        self.scripts = list(scripts)
        self.resumes: list[Resume | None] = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args, **kwargs) -> ScriptedResponse:
        self.resumes.append(next((a for a in (*args, *kwargs.values()) if isinstance(a, Resume)), None))
        return ScriptedResponse(self.scripts.pop(0))


def message(ids: list[int], last: bool = False) -> pb.GenerateResponse:
    m = pb.GenerateResponse(token_ids=ids, text="".join(chr(64 + i) for i in ids))
    if last:
        m.finish_reason = pb.FINISH_REASON_LENGTH
    return m


def ingress_over(engine: ScriptedEngine, model: str, monkeypatch):
    """The ingress's own methods over `engine` (its constructor, without Serve)."""
    from deployments import ingress as ingress_module
    from deployments.config import AppConfig

    monkeypatch.setattr(ingress_module, "RETRY_BACKOFF_S", 0.0)
    cls = ingress_module.SpecDecodeIngress.__mro__[1]  # the class under Serve's ASGI wrapper
    ingress = object.__new__(cls)
    cls.__init__(ingress, engine, AppConfig.from_dict({**app_args(model, None), "replica_wait_timeout_s": 5}))
    return ingress


def run_generate(ingress) -> list[pb.GenerateResponse]:
    async def main() -> list[pb.GenerateResponse]:
        return [m async for m in ingress.generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1])), "r", [])]

    return asyncio.run(main())


def test_handovers_resume_the_stream_and_leave_the_budget_for_lost_replicas(model, monkeypatch) -> None:
    """Two replicas hand the stream over (drains), then two are lost mid-stream: MAX_RESUMPTIONS
    (2) still covers the losses, and the client gets every token once, in order."""
    import ray

    from deployments import ingress as ingress_module

    assert ingress_module.MAX_RESUMPTIONS == 2
    lost = ray.exceptions.RayActorError()
    engine = ScriptedEngine([
        [Accepted("a"), message([1, 2]), message([3]), Handover()],
        [Accepted("b"), message([4]), Handover()],
        [Accepted("c"), message([5, 6]), lost],
        [Accepted("d"), message([7]), lost],
        [Accepted("e"), message([8, 9], last=True)],
    ])
    ingress = ingress_over(engine, model, monkeypatch)
    out = run_generate(ingress)
    assert [t for m in out for t in m.token_ids] == list(range(1, 10))
    assert [r.token_ids if r else None for r in engine.resumes] == [None, [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6],
                                                                    [1, 2, 3, 4, 5, 6, 7]]
    assert engine.resumes[2].num_chars == 4  # the characters the client was sent
    assert ingress.resumptions == {"drain": 2, "engine": 2}


def test_a_request_handed_over_before_its_first_token_starts_afresh(model, monkeypatch) -> None:
    """A replica that was already draining when the request reached it hands it over before it
    ran: the next replica gets the request itself (no `Resume`)."""
    engine = ScriptedEngine([[Accepted("a"), Handover()], [Accepted("b"), message([1, 2], last=True)]])
    ingress = ingress_over(engine, model, monkeypatch)
    assert [t for m in run_generate(ingress) for t in m.token_ids] == [1, 2]
    assert engine.resumes == [None, None]
    assert ingress.resumptions == {"drain": 1}


def test_handovers_are_bounded(model, monkeypatch) -> None:
    from deployments import ingress as ingress_module
    from deployments.errors import ClientError

    n = ingress_module.MAX_HANDOVERS
    engine = ScriptedEngine([[Accepted(str(i)), message([i]), Handover()] for i in range(n + 1)])
    ingress = ingress_over(engine, model, monkeypatch)
    with pytest.raises(ClientError, match=f"handed over {n} times") as e:
        run_generate(ingress)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_resumption_waits_for_a_replica_with_room(model, monkeypatch) -> None:
    """The stream's replica is lost and the others are full at first: the ingress waits for
    room (bounded) instead of ending the stream, and the client gets every token once."""
    import ray

    from deployments.errors import ClientError

    full = ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "replica full; retry later")
    engine = ScriptedEngine([
        [Accepted("a"), message([1, 2]), ray.exceptions.RayActorError()],
        [full], [full],
        [Accepted("b"), message([3, 4], last=True)],
    ])
    ingress = ingress_over(engine, model, monkeypatch)
    assert [t for m in run_generate(ingress) for t in m.token_ids] == [1, 2, 3, 4]
    assert [r.token_ids if r else None for r in engine.resumes] == [None, [1, 2], [1, 2], [1, 2]]
    assert ingress.resumptions == {"engine": 1}


def test_waiting_for_room_is_bounded(model, monkeypatch) -> None:
    import ray

    from deployments import ingress as ingress_module
    from deployments.errors import ClientError

    monkeypatch.setattr(ingress_module, "RESUME_FULL_WAIT_S", 0.05)
    full = ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "replica full; retry later")
    engine = ScriptedEngine([[Accepted("a"), message([1]), ray.exceptions.RayActorError()]] + [[full]] * 10**6)
    ingress = ingress_over(engine, model, monkeypatch)
    with pytest.raises(ClientError, match="no replica had room to go on with this request") as e:
        run_generate(ingress)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "output is incomplete" in e.value.details


# --- an engine replica's drain, without Ray ---------------------------------------------------
def test_a_draining_replica_hands_long_streams_over_and_lets_short_ones_finish(model, reference_llm, tmp_path) -> None:
    """Serve begins removing the replica (its flag stubbed) while a long and a short stream run:
    the short one finishes within the window, the long one ends with `Handover` after a prefix of
    its greedy tokens, and a request that comes after the drain began is handed over before it
    runs. Another replica resumes the long one from what was sent: the undisturbed output, and
    its trace says it was resumed, why and after how many tokens."""
    from deployments.config import AppConfig
    from deployments.replica import SpecDecodeServer

    config = AppConfig.from_dict({**app_args(model, None), "drain_timeout_s": 2.5})
    spans = tmp_path / "spans.jsonl"
    traced = AppConfig.from_dict({**app_args(model, None), "tracing": {"exporter": "file", "file": str(spans)}})
    server, other = SpecDecodeServer(config), SpecDecodeServer(traced)
    removing = threading.Event()
    server.drain.is_shutting_down = removing.is_set
    server.drain.grace_s = lambda: 30.0
    step = server.llm.engine.execute_step

    def slow_step():  # noqa: ANN202 - execute_step's result
        time.sleep(0.02)
        return step()

    server.llm.engine.execute_step = slow_step
    long_tokens, short_tokens = 400, 20

    def request(max_tokens: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), max_tokens=max_tokens, temperature=0.0,
                                  ignore_eos=True)

    async def consume(stream, first: asyncio.Event) -> list:
        items = []
        async for item in stream:
            items.append(item)
            if isinstance(item, pb.GenerateResponse):
                first.set()
        return items

    async def main():
        firsts = [asyncio.Event(), asyncio.Event()]
        long = asyncio.ensure_future(consume(server.generate(request(long_tokens), "long"), firsts[0]))
        short = asyncio.ensure_future(consume(server.generate(request(short_tokens), "short"), firsts[1]))
        for first in firsts:
            await asyncio.wait_for(first.wait(), 60)
        removing.set()
        await asyncio.sleep(0.6)  # the watch has seen the flag
        late = [item async for item in server.generate(request(4), "late")]
        return await asyncio.wait_for(long, 60), await asyncio.wait_for(short, 60), late

    try:
        long_items, short_items, late = asyncio.run(main())
        assert late[0] == Accepted("") and isinstance(late[1], Handover) and len(late) == 2
        short_ids = [t for m in short_items[1:] for t in m.token_ids]
        assert short_ids == greedy(reference_llm, PROMPT, short_tokens)
        assert isinstance(long_items[-1], Handover)
        sent = [m for m in long_items[1:-1]]
        sent_ids = [t for m in sent for t in m.token_ids]
        whole = greedy(reference_llm, PROMPT, long_tokens)
        assert 0 < len(sent_ids) < long_tokens and sent_ids == whole[: len(sent_ids)]
        assert server.drain.num_handed_over == 2 and not server.drain.streams

        async def resumed() -> list:
            resume = Resume(sent_ids, sum(len(m.text) for m in sent), "drain", 1)
            return [item async for item in other.generate(request(long_tokens), "long", resume=resume)]

        rest = asyncio.run(resumed())
        assert sent_ids + [t for m in rest[1:] for t in m.token_ids] == whole
        text = "".join(m.text for m in sent) + "".join(m.text for m in rest[1:])
        assert text == reference_llm.tokenizer.decode(whole, skip_special_tokens=True)
        assert other.tracing.force_flush(10)
        (span,) = [line for line in map(json.loads, spans.read_text().splitlines()) if line["name"] == tr.REQUEST_SPAN]
        resumed = {tr.ATTR_RESUMED_REASON: "drain", tr.ATTR_RESUMED_TOKENS: len(sent_ids), tr.ATTR_RESUMED_ORDINAL: 1}
        assert span["events"][0]["name"] == tr.RESUMED_EVENT and span["events"][0]["attributes"] == resumed
        assert resumed.items() <= span["attributes"].items()
        for s in (server, other):
            asyncio.run(s.llm.wait_idle())
            assert_no_leaked_blocks(s.llm.engine)
    finally:
        server.llm.shutdown()
        other.llm.shutdown()


# --- on Serve ----------------------------------------------------------------------------------
STEP_S = 0.05  # each engine step of the test's replicas sleeps this long: N tokens last >= N * STEP_S
GRACE_S = 6.0  # their graceful_shutdown_timeout_s
DRAIN_S = 1.5  # args.drain_timeout_s
LONG_TOKENS = 240  # >= 12 s: outlives the window, and the grace
SHORT_TOKENS = 24  # >= 1.2 s: well within a 20 s window
PROMPTS = [[9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19], [20, 21, 22], [23]]
HANDED_OVER = "handed over by a replica being removed"  # what the ingress logs for each handover
LOST = "replica lost after"  # ... and for each stream cut by a lost replica


def slow_server_class(step_s: float, drain: bool = True) -> type:
    """The faults tests' slow SpecDecodeServer; with `drain` False it never sees Serve's shutdown
    flag (Serve's own behaviour). Made in a function so that Ray pickles it by value."""
    server = faults_slow_server_class(step_s, 0.0)
    if drain:
        return server

    class NoDrainServer(server):
        def __init__(self, config) -> None:  # noqa: ANN001 - AppConfig
            super().__init__(config)
            self.drain.is_shutting_down = lambda: False

    return NoDrainServer


class SwitchPolicy:
    """An autoscaling policy that wants 2 replicas until the file `flag` exists, then 1 (Serve
    pickles it by value: the controller need not import this module)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __call__(self, ctx) -> tuple[int, dict]:  # noqa: ANN001 - AutoscalingContext
        import os

        return (1 if os.path.exists(self.flag) else 2), {}


@dataclass
class Served:
    port: int
    model: str
    llm: object  # engine.LLM: the greedy reference

    def deploy(self, app: str, overrides: dict, drain: bool = True, **args) -> None:
        from ray import serve

        from deployments.app import bind_app
        from deployments.client import SpecDecodeClient
        from deployments.config import AppConfig

        config = AppConfig.from_dict({**app_args(self.model, None), "max_num_seqs": 8, "max_queued_requests": 8,
                                      "replica_wait_timeout_s": 60, "drain_timeout_s": DRAIN_S, **args})
        options = {"ray_actor_options": {"num_cpus": 0}, "graceful_shutdown_timeout_s": GRACE_S,
                   "graceful_shutdown_wait_loop_s": 0.5, **overrides}
        serve.run(bind_app(config, options, engine_cls=slow_server_class(STEP_S, drain)), name=app,
                  route_prefix=f"/{app}")
        with SpecDecodeClient(f"127.0.0.1:{self.port}", application=app, timeout=60) as client:
            client.wait_ready(60)

    def streams(self, app: str, max_tokens: int) -> Streams:
        return Streams(self, app, max_tokens)


class Streams:
    """Greedy streams of PROMPTS, one thread each, started at once; `wait_started` returns once
    every one has its first message."""

    def __init__(self, served: Served, app: str, max_tokens: int) -> None:
        self.served, self.app, self.max_tokens = served, app, max_tokens
        self.results: list[object] = [None] * len(PROMPTS)
        self.started = [threading.Event() for _ in PROMPTS]
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(PROMPTS))]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        from deployments.client import SpecDecodeClient

        try:
            with SpecDecodeClient(f"127.0.0.1:{self.served.port}", application=self.app, timeout=180) as client:
                ids, text, last = [], "", None
                for m in client.generate(PROMPTS[i], max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True):
                    ids.extend(m.token_ids)
                    text += m.text
                    last = m
                    self.started[i].set()
                self.results[i] = (ids, text, last.usage.completion_tokens)
        except grpc.RpcError as e:
            self.results[i] = e
        finally:
            self.started[i].set()

    def wait_started(self) -> None:
        for e in self.started:
            assert e.wait(120)

    def check(self) -> None:
        """Every stream ended without an error, with the undisturbed greedy tokens and text."""
        for t in self.threads:
            t.join(180)
        tokenizer = self.served.llm.tokenizer
        for prompt, result in zip(PROMPTS, self.results, strict=True):
            assert not isinstance(result, grpc.RpcError), (result.code(), result.details())
            want = greedy(self.served.llm, prompt, self.max_tokens)
            ids, text, completion = result
            assert ids == want and text == tokenizer.decode(want, skip_special_tokens=True)
            assert completion == len(want)


@pytest.fixture(scope="module")
def served(model, reference_llm, serve_instance) -> Iterator[Served]:
    yield Served(serve_instance.grpc_port, model, reference_llm)


def resumed(app: str) -> dict[str, int]:
    """The app's ingress's resumptions by reason (drain, engine)."""
    from ray import serve

    from deployments.config import INGRESS_DEPLOYMENT_NAME

    handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT_NAME, app_name=app)
    return handle.resumption_counts.remote().result(timeout_s=30)


def serve_log_count(text: str) -> int:
    """How often `text` appears in the Serve logs of this Ray session (every replica's file; a
    replaced ingress's too)."""
    import glob
    import os

    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    count = 0
    for path in glob.glob(os.path.join(session, "logs", "serve", "*.log")):
        with open(path, "rb") as f:
            count += f.read().decode(errors="replace").count(text)
    return count


def engine_replicas(app: str) -> dict[str, int]:
    from ray import serve

    from deployments.config import DEPLOYMENT_NAME

    return dict(serve.status().applications[app].deployments[DEPLOYMENT_NAME].replica_states)


def wait_replicas(app: str, running: int, timeout: float = 120) -> float:
    """Wait until exactly `running` engine replicas exist, all RUNNING; return how long it took."""
    start = time.monotonic()
    while engine_replicas(app) != {"RUNNING": running}:
        assert time.monotonic() - start < timeout, f"{app}: {engine_replicas(app)} after {timeout} s"
        time.sleep(0.2)
    return time.monotonic() - start


def warm_router(served: Served, app: str) -> None:
    """A few small requests: the ingress's router learns every replica."""
    from deployments.client import SpecDecodeClient

    with SpecDecodeClient(f"127.0.0.1:{served.port}", application=app, timeout=60) as client:
        for _ in range(6):
            collect(client.generate([1], max_tokens=1))


def autoscaled(flag: Path) -> dict:
    return {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "initial_replicas": 2, "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0,
        "policy": {"policy_function": SwitchPolicy, "policy_kwargs": {"flag": str(flag)}},
    }}


def test_autoscaler_downscale_hands_long_streams_over(served: Served, serve_instance, tmp_path) -> None:
    """The autoscaler takes the deployment from 2 replicas to 1 while six long greedy streams run
    on both: the removed replica hands its streams over when the window ends, and every client
    gets the undisturbed output with no error; no stream was cut (none resumed as lost)."""
    app, flag = "drain-downscale", tmp_path / "one"
    with serve_instance.apps(app):
        served.deploy(app, autoscaled(flag))
        wait_replicas(app, 2)
        warm_router(served, app)
        streams = served.streams(app, LONG_TOKENS)
        streams.wait_started()
        flag.touch()
        streams.check()
        counts = resumed(app)
        assert counts.get("drain", 0) >= 1 and "engine" not in counts, counts
        wait_replicas(app, 1, timeout=GRACE_S + 30)


def test_redeploy_replacing_every_replica_fails_no_stream(served: Served, serve_instance) -> None:
    """A redeploy (a new version with num_replicas 1) replaces both replicas while six long greedy
    streams run: Serve stops each old replica, which hands its streams over (possibly to the other
    old one, which drains later), and every client gets the undisturbed output with no error."""
    app = "drain-redeploy"
    with serve_instance.apps(app):
        served.deploy(app, {"num_replicas": 2})
        warm_router(served, app)
        handed, lost = serve_log_count(HANDED_OVER), serve_log_count(LOST)
        streams = served.streams(app, LONG_TOKENS)
        streams.wait_started()
        served.deploy(app, {"num_replicas": 1})
        streams.check()
        wait_replicas(app, 1, timeout=GRACE_S + 30)
        # the old ingress, replaced too, resumed them: its counts are in its log, not in the new one
        deadline = time.monotonic() + 15  # a log line reaches its file within a few seconds
        while serve_log_count(HANDED_OVER) == handed and time.monotonic() < deadline:
            time.sleep(0.5)
        assert serve_log_count(HANDED_OVER) > handed and serve_log_count(LOST) == lost


def test_streams_that_finish_within_the_window_are_not_handed_over(served: Served, serve_instance, tmp_path) -> None:
    """Short streams on a replica the autoscaler removes, with a 20 s window: they finish there
    (nothing handed over), and the replica is gone long before its 30 s grace: its drain waits
    for its streams, not for the window."""
    app, flag = "drain-short", tmp_path / "one"
    with serve_instance.apps(app):
        served.deploy(app, {**autoscaled(flag), "graceful_shutdown_timeout_s": 30.0}, drain_timeout_s=20.0)
        wait_replicas(app, 2)
        warm_router(served, app)
        streams = served.streams(app, SHORT_TOKENS)
        streams.wait_started()
        flag.touch()
        streams.check()
        took = wait_replicas(app, 1, timeout=60)
        assert resumed(app) == {}
        assert took < 20.0, f"the removed replica took {took:.1f} s to go"


def test_without_the_drain_serve_cuts_long_streams_at_its_grace(served: Served, serve_instance, tmp_path) -> None:
    """What Serve does alone (the replicas here never see its shutdown flag): the removed replica
    keeps its streams until graceful_shutdown_timeout_s, then Serve kills it mid-stream; the
    ingress can only resume those streams as lost (reason engine), on the budget meant for faults."""
    app, flag = "drain-off", tmp_path / "one"
    with serve_instance.apps(app):
        served.deploy(app, autoscaled(flag), drain=False)
        wait_replicas(app, 2)
        warm_router(served, app)
        streams = served.streams(app, LONG_TOKENS)
        streams.wait_started()
        flag.touch()
        streams.check()  # mid-stream failover covers the cut, as for a crash
        counts = resumed(app)
        assert counts.get("engine", 0) >= 1 and "drain" not in counts, counts
