"""Prefill/decode disaggregation end to end, on a real multi-node Ray cluster on this machine.

`ray.cluster_utils.Cluster` starts a head node and two worker nodes, each with its own raylet and
object store; the prefill pool is pinned to one (custom resource `prefill`) and the decode pool
to the other (`decode`), so every handoff's KV crosses object stores through Ray's own transfer.
The client is the unchanged `deployments.client`. Greedy output must equal a co-located engine
token for token (long prompts prefilled remotely, short ones locally), a seeded sampled request
too, and after a storm of cancels neither pool may hold a KV block.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from helpers import SERVICERS, free_port
from test_serve_grpc import collect, save_char_tokenizer
from test_serve_http import CHAT_TEMPLATE, TIME_TOOL

from deployments.client import SpecDecodeClient, make_request
from deployments.handoff_transport import nixl_available

pytestmark = pytest.mark.slow

APP = "pd"
THRESHOLD = 24  # prompts with at least this many uncached tokens are prefilled remotely
K = 3
VARIANT = "pd-objects"  # the second application: Ray's object stores as the transport, and faults
DIE, MISMATCH = "die-after-first-token", "claim-another-model"  # request ids its prefill pool misbehaves on
SLOW = "slow-prefill"  # ... or takes SLOW_S seconds longer on (the variant allows 1 remote prefill in flight)
SLOW_S = 4.0


@dataclass
class Served:
    port: int
    target: str
    drafter: str
    spans: dict  # pool -> the JSON-lines file its replica exports spans to

    def client(self, timeout: float | None = 120) -> SpecDecodeClient:
        return SpecDecodeClient(f"127.0.0.1:{self.port}", application=APP, timeout=timeout)


def app_config(target: str, drafter: str, tracing: dict | None = None, **disaggregation):
    from deployments.config import AppConfig

    return AppConfig.from_dict({
        **({"tracing": tracing} if tracing else {}),
        "model": target, "device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_queued_requests": 16,
        "max_prompt_tokens": 600, "max_tokens": 400, "default_max_tokens": 16, "num_cpus": 1,
        "speculative": {"method": "draft", "model": drafter, "num_speculative_tokens": K, "adaptive": False},
        "mode": "disaggregated", "disaggregation": {"min_prompt_tokens": THRESHOLD, **disaggregation},
    })


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    import ray
    from helpers import save_perturbed_copy, save_tiny_model
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import bind_app

    root = tmp_path_factory.mktemp("pd_models")
    target = save_tiny_model(str(root / "target"), "llama", max_position_embeddings=1024)
    save_char_tokenizer(target)
    save_chat_template(target)
    drafter = save_perturbed_copy(target, str(root / "drafter"), noise=0.02)
    spans = {pool: str(root / f"{pool}_spans.jsonl") for pool in ("prefill", "decode", "ingress")}
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # spans exported within 0.1 s (the raylets' workers inherit it)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
    cluster.add_node(num_cpus=1, resources={"prefill": 10}, object_store_memory=80 << 20)
    cluster.add_node(num_cpus=1, resources={"decode": 10}, object_store_memory=80 << 20)
    port = free_port()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()},
                    grpc_options={"port": port, "grpc_servicer_functions": SERVICERS})
        config = app_config(target, drafter, tracing={"exporter": "file"},  # the file: per pool, below
                            transport="nixl" if nixl_available() else "object_store")

        def pool(name: str) -> dict:
            env = {"SPECDECODE_TRACES_FILE": spans[name]}
            return {"ray_actor_options": {"num_cpus": 0.5, "resources": {name: 1}, "runtime_env": {"env_vars": env}}}

        decode, prefill = pool("decode"), pool("prefill")
        ingress = {"ray_actor_options": {"num_cpus": 0, "runtime_env": {
            "env_vars": {"SPECDECODE_TRACES_FILE": spans["ingress"]}}}}
        # Both applications at once (their replicas start side by side), and before any handoff
        # has gone by nixl: its agents' polling threads slow everything started after it here.
        serve.run_many([serve.RunTarget(bind_app(config, decode, ingress, prefill_overrides=prefill), name=APP,
                                        route_prefix=f"/{APP}"),
                        variant_target(target, drafter)])
        for app in (APP, VARIANT):
            with SpecDecodeClient(f"127.0.0.1:{port}", application=app) as client:
                client.wait_ready(120)
        yield Served(port, target, drafter, spans)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        mp.undo()


def save_chat_template(path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def colocated(served: Served):
    """The reference: one co-located engine with the same models and speculation."""
    from engine import LLM, SpeculativeConfig

    spec = SpeculativeConfig(method="draft", model=served.drafter, num_speculative_tokens=K, adaptive=False)
    return LLM(served.target, device="cpu", dtype="float32", speculative=spec)


def reference(llm, prompt, **params) -> list[int]:
    from engine import SamplingParams

    return llm.generate([prompt], SamplingParams(**params))[0].token_ids


def handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, app_name=APP)


def prefill_counts() -> dict[str, int]:
    return handle("SpecDecode").prefill_counts.remote().result(timeout_s=30)


def count_changes(before: dict, after: dict) -> dict[str, int]:
    """The counts (of `prefill_counts`) that changed from `before` to `after`, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int) and v != before.get(k, 0)}


def send_counted(served: Served, app: str, request) -> tuple[list, dict[str, int]]:
    """Stream `request` to application `app`: (its messages, the counts of the decode replica's
    `prefill_counts` it changed)."""
    from ray import serve

    decode = serve.get_deployment_handle("SpecDecode", app_name=app)
    with SpecDecodeClient(f"127.0.0.1:{served.port}", application=app, timeout=120) as client:
        client.wait_ready(120)
        before = decode.prefill_counts.remote().result(timeout_s=30)
        chunks = list(client.stream(request))
    return chunks, count_changes(before, decode.prefill_counts.remote().result(timeout_s=30))


def pool_stats(app: str = APP) -> dict:
    from ray import serve

    return serve.get_deployment_handle("SpecDecodeIngress", app_name=app).pool_stats.remote().result(timeout_s=30)


def both_pools_idle(timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        usages = [handle(name).model_info.remote().result(timeout_s=30).usage for name in ("SpecDecode", "SpecDecodePrefill")]
        if all((u.num_running, u.num_waiting, u.num_used_blocks) == (0, 0, 0) for u in usages):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def replica_actor(name: str, app: str = APP):
    import ray

    names = [e["name"] if isinstance(e, dict) else e for e in ray.util.list_named_actors(all_namespaces=True)]
    [actor] = [n for n in names if n.startswith(f"SERVE_REPLICA::{app}#{name}#")]
    return ray.get_actor(actor, namespace="serve")


def direct_transport_objects_held(app: str = APP) -> int:
    """Ray Direct Transport objects (handoffs put with nixl) the prefill replica still holds.
    Reads Ray's RDT store (private API of Ray 2.60: `rdt_manager._rdt_store._rdt_store`)."""
    import ray

    def held(_self) -> int:
        from ray._private.worker import global_worker

        store = global_worker.rdt_manager._rdt_store._rdt_store
        return sum(len(q) for q in store.values())

    return ray.get(replica_actor("SpecDecodePrefill", app).__ray_call__.remote(held))


def test_pools_run_on_separate_nodes(served: Served) -> None:
    import ray

    def node_of(name: str) -> str:
        replica = replica_actor(name)
        return ray.get(replica.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))

    assert node_of("SpecDecodePrefill") != node_of("SpecDecode")


def test_only_the_decode_pool_budgets_steps_with_nothing_decoding(served: Served) -> None:
    """Handoffs reach the decode replica mid-step, so its steps stay within HANDOFF_STALL_S even
    before anything decodes there; the prefill replica prefills whole prompts when idle."""
    import ray

    from deployments.replica import HANDOFF_STALL_S

    def budget(name: str) -> float | None:
        return ray.get(replica_actor(name).__ray_call__.remote(
            lambda self: self._replica_impl._user_callable_wrapper.user_callable.llm.engine.scheduler.idle_step_budget_s))

    assert budget("SpecDecode") == HANDOFF_STALL_S and budget("SpecDecodePrefill") is None


@pytest.mark.parametrize("length", [THRESHOLD + 40, THRESHOLD // 2])
def test_greedy_equals_colocated_remote_and_local_prefill(served: Served, colocated, length: int) -> None:
    """Long prompts go through the prefill pool (handoff of KV + drafter state), short ones are
    prefilled by the decode replica; both give the co-located engine's tokens."""
    rng = random.Random(length)
    prompt = [rng.randrange(3, 97) for _ in range(length)]
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    before = prefill_counts()
    with served.client() as client:
        ids, _, last = collect(client.generate(prompt, **params))
    assert ids == reference(colocated, prompt, **params)
    assert last.usage.prompt_tokens == length and last.usage.completion_tokens == 40
    after = prefill_counts()
    where = "remote" if length >= THRESHOLD else "local"
    assert after.get(where, 0) == before.get(where, 0) + 1, (before, after)
    assert last.speculation.num_draft_tokens > 0
    assert both_pools_idle()


@pytest.mark.skipif(not nixl_available(), reason="the nixl package is not installed")
def test_handoffs_travel_by_ray_direct_transport(served: Served) -> None:
    """transport nixl: the KV crosses nodes by Ray Direct Transport (NIXL), and the prefill
    replica frees its copy once the decode replica has it."""
    counts = prefill_counts()
    if not counts.get("remote"):
        rng = random.Random(5)
        with served.client() as client:
            collect(client.generate([rng.randrange(3, 97) for _ in range(THRESHOLD + 5)], max_tokens=4))
        counts = prefill_counts()
    assert counts.get("via_nixl", 0) == counts["remote"] > 0 and "via_object_store" not in counts, counts
    deadline = time.monotonic() + 10
    while direct_transport_objects_held() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert direct_transport_objects_held() == 0


def test_prefill_replica_holds_its_handoff_until_the_call_is_closed(served: Served) -> None:
    """The prefill replica keeps its own reference to a handoff it put until the decode side
    closes the call (Ray can otherwise free an object whose reference a generator yielded before
    the consumer's borrow is registered, ray-project/ray#58080): after the `PrefillResult` the
    call stays open, the handoff can still be read from this (third) node, and closing the call
    ends it."""
    import asyncio

    import ray
    from ray.serve.exceptions import RequestCancelledError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from deployments.common import PrefillResult
    from engine import SamplingParams

    rng = random.Random(8)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 10)]
    pool = handle("SpecDecodePrefill").options(stream=True)

    async def run() -> None:
        call = pool.prefill.remote(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "hold")
        result = None
        async for item in call:
            if isinstance(item, PrefillResult):
                result = item
                break
        assert result is not None
        following = asyncio.ensure_future(call.__anext__())
        done, _ = await asyncio.wait({following}, timeout=1.0)
        assert not done  # still open: the replica holds its reference
        # Read by a task on the head node, not by this process: a nixl handoff's `ray.get` starts
        # a NIXL agent (UCX) in the reader, and in the pytest process UCX's memory hooks later
        # crashed protoc (grpcio-tools, tests/test_protos.py) with a segmentation fault.
        head = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        read = ray.remote(num_cpus=0, scheduling_strategy=head)(
            lambda refs: list(ray.get(refs[0], timeout=30).prompt_token_ids))
        assert await asyncio.to_thread(ray.get, read.remote(result.handoff), timeout=60) == prompt
        result.handoff.clear()
        call.cancel()
        with pytest.raises((RequestCancelledError, asyncio.CancelledError)):
            await asyncio.wait_for(following, 30)

    asyncio.run(run())
    assert both_pools_idle()
    assert not [m for m in sys.modules if m.split(".")[0] == "nixl"], "this process loaded nixl"


def test_one_trace_spans_prefill_handoff_and_decode(served: Served) -> None:
    """A remotely prefilled request is one trace under the client's traceparent: the ingress's
    `specdecode.disaggregated` span (with the placement: where, why, predicted TTFTs) holds the
    prefill replica's request span (exported on the prefill node), the handoff (bytes, transport)
    and the decode replica's request span; and where_time_goes shows the handoff as a phase of
    that one request."""
    import json

    from deployments import tracing as tr
    from deployments import where_time_goes as wtg

    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    rng = random.Random(21)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 25)]
    with served.client() as client:
        ids, _, _ = collect(client.generate(prompt, max_tokens=20, temperature=0.0, ignore_eos=True,
                                            traceparent=f"00-{trace_id}-{parent_id}-01"))
    assert len(ids) == 20

    def mine() -> list[dict]:
        lines = []
        for path in served.spans.values():
            try:
                with open(path) as f:
                    lines += [json.loads(x) for x in f if x.strip()]
            except FileNotFoundError:
                pass
        return [s for s in lines if s["trace_id"] == trace_id]

    deadline = time.monotonic() + 20
    while len([s for s in mine() if s["name"] in (tr.REQUEST_SPAN, tr.DISAGG_SPAN)]) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    spans = mine()
    (top,) = [s for s in spans if s["name"] == tr.DISAGG_SPAN]
    assert top["parent_span_id"] == parent_id and top["attributes"][tr.ATTR_PREFILLED] == "remote"
    assert top["attributes"][tr.ATTR_PLACEMENT] == "remote"
    assert top["attributes"][tr.ATTR_PLACEMENT_REASON] in ("unmeasured", "within_budget", "remote_faster")
    children = [s for s in spans if s["parent_span_id"] == top["span_id"]]
    roles = sorted(s["attributes"].get(tr.ATTR_ROLE, "") for s in children if s["name"] == tr.REQUEST_SPAN)
    assert roles == ["decode", "prefill"]
    (handoff,) = [s for s in children if s["name"] == tr.HANDOFF_SPAN]
    assert handoff["attributes"][tr.ATTR_HANDOFF_BYTES] > 0
    assert handoff["attributes"][tr.ATTR_HANDOFF_TRANSPORT] == ("nixl" if nixl_available() else "object_store")
    with open(served.spans["prefill"]) as f:  # the prefill replica's span came from the other node
        assert any(json.loads(x)["trace_id"] == trace_id for x in f if x.strip())

    records = [wtg._from_line(s) for s in spans]
    (b,) = wtg.breakdowns(records)
    assert b.parts["handoff"] > 0 and b.parts["prefill"] > 0 and b.parts["verify"] > 0
    assert b.accounted_s == pytest.approx(b.wall_s, rel=1e-6)
    assert [s.kind for s in b.steps].count("handoff") == 1 and b.num_output_tokens == 20


def test_seeded_sampled_request_equals_colocated(served: Served, colocated) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 10)]
    params = dict(max_tokens=30, temperature=0.8, seed=1234, ignore_eos=True)
    with served.client() as client:
        ids, _, _ = collect(client.generate(prompt, **params))
    assert ids == reference(colocated, prompt, **params)


def test_structured_output_penalties_and_logprobs_travel_in_the_handoff(served: Served, colocated) -> None:
    """A remotely prefilled request with a grammar, penalties and logprobs: the decode replica
    replays the grammar over the first token and counts it in the penalties, so the tokens and
    log-probabilities equal the co-located engine's."""
    from engine import SamplingParams, StructuredOutput

    rng = random.Random(17)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 12)]
    regex = "[a-e]{4}-[0-9]{3}(-[a-e]+)?"
    params = dict(max_tokens=30, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={40: 1.5})
    before = prefill_counts()
    with served.client() as client:
        chunks = list(client.generate(prompt, logprobs=2, structured_output={"regex": regex}, **params))
    ids = [t for c in chunks for t in c.token_ids]
    assert prefill_counts().get("remote", 0) == before.get("remote", 0) + 1
    (ref,) = colocated.generate([prompt], SamplingParams(logprobs=2, structured_output=StructuredOutput("regex", regex),
                                                         **params))
    assert ids == ref.token_ids
    assert [lp.logprob for c in chunks for lp in c.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs],
                                                                             abs=1e-5)
    assert __import__("re").fullmatch(regex, "".join(c.text for c in chunks))


def tool_request(content: str, request_id: str = ""):
    """A greedy chat request that must call `get_time` (a call constrained to its schema)."""
    import json

    from deployments.client import make_request

    request = make_request([{"role": "user", "content": content}], max_tokens=160, temperature=0.0,
                           request_id=request_id)
    fn = TIME_TOOL["function"]
    request.tools.add(name=fn["name"], description=fn["description"], parameters=json.dumps(fn["parameters"]))
    request.tool_choice.function = fn["name"]
    return request


def reference_call(llm, content: str) -> tuple[list[int], list[tuple[str, str]]]:
    """The co-located engine's tokens and parsed calls for `tool_request(content)`."""
    import json

    from deployments.tools import call_grammar, parse_calls, parse_tools, render_chat
    from engine import SamplingParams, StructuredOutput

    fn = TIME_TOOL["function"]
    tools = parse_tools([(fn["name"], fn["description"], json.dumps(fn["parameters"]))])
    prompt = render_chat(llm.tokenizer, [{"role": "user", "content": content}], tools)
    grammar = StructuredOutput("grammar", call_grammar(tools, fn["name"]))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=160, temperature=0.0, structured_output=grammar))
    return out.token_ids, [(c.name, c.arguments) for c in parse_calls(out.text, tools)[1]]


@pytest.mark.parametrize("app", [APP, VARIANT])
def test_tool_calls_travel_through_the_prefill_pool(served: Served, colocated, app: str) -> None:
    """A chat request with tools and a long prompt is prefilled by the prefill pool: the decode
    replica replays the call grammar over the first token and parses the calls from the whole
    output, so the tokens and `tool_calls` equal the co-located engine's. On `VARIANT` the
    decode engine refuses the handoff (`MISMATCH`) and prefills locally after the first token:
    the calls are parsed from the text of the tokens already sent as well."""
    import json

    import jsonschema

    from protos.specdecode.v1 import specdecode_pb2 as pb

    content = "what time is it in zone 3? answer with the tool, please."
    assert len(content) >= THRESHOLD
    chunks, changed = send_counted(served, app, tool_request(content, MISMATCH if app == VARIANT else ""))
    if app == APP:
        assert changed.get("remote") == 1 and not changed.get("fallback"), changed
    else:
        assert changed == {"fallback": 1, "fallback_refused": 1}, changed
    ids, calls = reference_call(colocated, content)
    assert [t for c in chunks for t in c.token_ids] == ids
    last = chunks[-1]
    assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert [(c.name, c.arguments) for c in last.tool_calls] == calls and calls
    jsonschema.validate(json.loads(calls[0][1]), TIME_TOOL["function"]["parameters"])


def test_several_completions_share_the_prefill_pools_handoff(served: Served, colocated) -> None:
    """n = 3 (seeded, sampled) with a long prompt: the pool prefills the first completion, the
    decode replica goes on from its handoff and starts the other two on the prompt's blocks it
    brought (their full blocks from the prefix cache); completion i equals a lone co-located
    request seeded seed + i. best_of = 3, n = 2: the pool's first message is held for the
    ranking, and the two candidates with the highest cumulative log-probability come out, in that
    order, as the co-located engine ranks them."""
    from engine.config import CacheConfig

    rng = random.Random(23)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 40)]
    params = dict(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    before = prefill_counts()
    with served.client() as client:
        chunks = list(client.generate(prompt, n=3, **params))
    changed = count_changes(before, prefill_counts())
    assert changed.get("remote") == 1 and not changed.get("local") and not changed.get("fallback"), changed
    for i in range(3):
        ids = [t for c in chunks if c.index == i for t in c.token_ids]
        assert ids == reference(colocated, prompt, **{**params, "seed": 11 + i}), i
    lasts = {c.index: c for c in chunks if c.HasField("usage")}
    shared = (len(prompt) - 1) // CacheConfig.block_size * CacheConfig.block_size  # its last token is computed
    assert [lasts[i].usage.cached_prompt_tokens for i in (1, 2)] == [shared, shared]

    from engine import SamplingParams

    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    with served.client() as client:
        chunks = list(client.generate(prompt, n=2, best_of=3, seed=5, **params))
    alone = [colocated.generate([prompt], SamplingParams(seed=5 + i, logprobs=0, **params))[0] for i in range(3)]
    ranked = sorted(alone, key=lambda out: sum(lp.logprob for lp in out.logprobs), reverse=True)[:2]
    assert [[t for c in chunks if c.index == i for t in c.token_ids] for i in (0, 1)] == [out.token_ids for out in ranked]
    assert not any(c.logprobs for c in chunks)  # kept for the ranking only: none were asked for


def test_several_completions_survive_a_refused_handoff_and_a_cancel(served: Served, colocated) -> None:
    """n = 2 on `VARIANT` with a handoff the decode engine refuses (`MISMATCH`): the first
    completion is prefilled by the decode replica after its first token, the second beside it,
    and each equals the co-located greedy output (greedy: a seeded generator cannot be carried
    over without its handoff, so a sampled fallback starts it again from its seed, as
    docs/serving.md says). Then n = 3 cancelled after its first message leaves no request and
    no KV block on either pool."""

    rng = random.Random(29)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 20)]
    params = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    chunks, changed = send_counted(served, VARIANT, make_request(prompt, n=2, request_id=MISMATCH, **params))
    assert changed == {"fallback": 1, "fallback_refused": 1}, changed
    expected = reference(colocated, prompt, **params)
    assert [[t for c in chunks if c.index == i for t in c.token_ids] for i in range(2)] == [expected, expected]
    with served.client() as client:
        stream = client.generate(prompt, n=3, **{**params, "max_tokens": 200, "temperature": 1.0, "seed": 3})
        next(iter(stream))
        stream.close()
    assert both_pools_idle(30)


def test_text_prompt_streams_the_same_text(served: Served, colocated) -> None:
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    assert len(prompt) >= THRESHOLD  # one character per token with this tokenizer
    params = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    with served.client() as client:
        ids, text, _ = collect(client.generate(prompt, **params))
    from engine import SamplingParams

    out = colocated.generate([prompt], SamplingParams(**params))[0]
    assert (ids, text) == (out.token_ids, out.text)


def test_cancel_storm_leaves_no_blocks_on_either_pool(served: Served) -> None:
    """Cancels and deadlines at random points (queued for prefill, during prefill, in transfer,
    decoding) free the blocks on both pools; the handoff objects go with the requests."""
    rng = random.Random(3)

    def one(i: int) -> None:
        prompt = [rng.randrange(3, 97) for _ in range(rng.choice([THRESHOLD // 2, THRESHOLD + 30, 150]))]
        with served.client() as client:
            call = client.stub.Generate(make_request(prompt, max_tokens=300, ignore_eos=True),
                                        timeout=rng.uniform(0.05, 1.5), metadata=client.metadata)
            try:
                for _ in range(rng.randint(0, 6)):
                    next(call)
                call.cancel()
            except (grpc.RpcError, StopIteration):
                pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for i, t in enumerate(threads):
        t.start()
        if i % 4 == 3:
            time.sleep(0.2)
    for t in threads:
        t.join(120)
    assert both_pools_idle(30)
    if nixl_available():
        deadline = time.monotonic() + 10  # the owner frees a handoff once the decode side dropped it
        while direct_transport_objects_held() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert direct_transport_objects_held() == 0
    assert prefill_counts().get("remote", 0) > 0
    deadline = time.monotonic() + 10
    while pool_stats()["inflight_prefills"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool_stats()["inflight_prefills"] == 0  # every cancelled remote prefill left the ingress's count


def variant_target(target: str, drafter: str):
    """The second pd application (`VARIANT`): Ray's object stores as the transport (pools pinned
    to their nodes), and a prefill pool that misbehaves on two request ids: it exits before its
    handoff arrives (`DIE`), or its handoff claims another target checkpoint, as if the prefill
    pool were deployed with a different model (`MISMATCH`: the decode engine refuses it). One
    application for the three cases, so that the suite starts two replicas, not six."""
    import asyncio
    import dataclasses

    import ray
    from ray import serve

    from deployments.app import bind_app
    from deployments.common import PrefillResult
    from deployments.replica import SpecDecodeServer

    die, mismatch, slow, slow_s = DIE, MISMATCH, SLOW, SLOW_S  # travel with the class (pickled by value)

    class FaultyPrefill(SpecDecodeServer):
        async def prefill(self, prompt, params, label, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            if label == slow:
                await asyncio.sleep(slow_s)
            async for item in super().prefill(prompt, params, label, *args, **kwargs):
                if isinstance(item, PrefillResult) and label == die:
                    import os

                    os._exit(1)
                if isinstance(item, PrefillResult) and label == mismatch:
                    handoff = await asyncio.to_thread(ray.get, item.handoff[0])
                    compat = dataclasses.replace(handoff.compat, model_digest="another-model")
                    item = dataclasses.replace(item, handoff=[ray.put(dataclasses.replace(handoff, compat=compat))])
                yield item

    config = app_config(target, drafter, transport="object_store")
    decode = {"ray_actor_options": {"num_cpus": 0, "resources": {"decode": 1}}}
    prefill = {"ray_actor_options": {"num_cpus": 0, "resources": {"prefill": 1}}}
    return serve.RunTarget(bind_app(config, decode, prefill_overrides=prefill, prefill_cls=FaultyPrefill),
                           name=VARIANT, route_prefix=f"/{VARIANT}")


def run_variant(served: Served, colocated, seed: int, request_id: str = "") -> tuple[list[int], object, dict]:
    """Send one greedy request long enough for the prefill pool to the `VARIANT` application,
    check its tokens against the co-located engine: (token ids, last message, the counts by
    which this request changed the decode replica's prefill counts)."""

    rng = random.Random(seed)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 20)]
    params = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    chunks, changed = send_counted(served, VARIANT, make_request(prompt, request_id=request_id, **params))
    ids, _, last = collect(iter(chunks))
    assert ids == reference(colocated, prompt, **params)
    assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == 30
    return ids, last, changed


def test_object_store_transport_gives_the_same_tokens(served: Served, colocated) -> None:
    """transport object_store: the handoff goes through Ray's object stores (node to node)."""
    _, _, counts = run_variant(served, colocated, 13)
    assert counts == {"remote": 1, "via_object_store": 1}, counts


def test_requests_waiting_for_the_prefill_pool_hold_no_decode_slot(served: Served, colocated) -> None:
    """As many long prompts as the decode replica has slots (max_num_seqs 4) wait on a prefill
    pool slowed by SLOW_S s; a short prompt sent meanwhile is prefilled and finished by the decode
    replica at once (it would queue behind them if they held its slots), and every request gets
    the co-located tokens."""
    from ray import serve

    decode = serve.get_deployment_handle("SpecDecode", app_name=VARIANT)
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    rng = random.Random(31)
    slow_prompts = [[rng.randrange(3, 97) for _ in range(THRESHOLD + 15)] for _ in range(4)]
    short_prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD // 2)]
    got: dict[str, tuple[list[int], float]] = {}

    def send(name: str, prompt: list[int], request_id: str = "") -> None:
        with SpecDecodeClient(f"127.0.0.1:{served.port}", application=VARIANT, timeout=120) as client:
            ids, _, _ = collect(client.generate(prompt, request_id=request_id, **params))
            got[name] = (ids, time.monotonic())

    with SpecDecodeClient(f"127.0.0.1:{served.port}", application=VARIANT, timeout=120) as client:
        client.wait_ready(120)
    before = decode.prefill_counts.remote().result(timeout_s=30)
    slow = [threading.Thread(target=send, args=(f"slow{i}", p, SLOW)) for i, p in enumerate(slow_prompts)]
    for thread in slow:
        thread.start()
    time.sleep(1.0)  # the slow requests are waiting on the prefill pool
    assert pool_stats(VARIANT)["inflight_prefills"] == 4
    sent_at = time.monotonic()
    send("short", short_prompt)
    short_s = got["short"][1] - sent_at
    for thread in slow:
        thread.join(120)
    assert short_s < SLOW_S - 1.0, short_s
    assert all(got["short"][1] < got[f"slow{i}"][1] for i in range(4))
    assert got["short"][0] == reference(colocated, short_prompt, **params)
    for i, prompt in enumerate(slow_prompts):
        assert got[f"slow{i}"][0] == reference(colocated, prompt, **params)
    after = decode.prefill_counts.remote().result(timeout_s=30)
    changed = count_changes(before, after)
    assert changed == {"remote": 4, "via_object_store": 4, "local": 1}, changed


def test_refused_import_falls_back_to_a_local_prefill(served: Served, colocated) -> None:
    """A handoff the decode engine cannot import (HandoffMismatchError) is not the client's
    problem: the decode replica prefills locally after the first token, the client gets the
    co-located tokens and no error, and the fallback (not a remote prefill) is counted."""
    _, _, counts = run_variant(served, colocated, 12, MISMATCH)
    assert counts == {"fallback": 1, "fallback_refused": 1}, counts


def test_lost_prefill_replica_falls_back_to_a_local_prefill(served: Served, colocated) -> None:
    """The prefill replica dies after the client got the first token and before the decode side
    has the handoff: a decode replica prefills locally (after the tokens already sent), the
    client sees the co-located tokens and no error, and the fallback is counted. The ingress then
    backs off the pool: the next long prompt is prefilled by the decode replica at once
    (`local_backoff`) instead of trying the pool again. (Last: the prefill replica is gone
    afterwards.)"""
    _, _, counts = run_variant(served, colocated, 11, DIE)
    assert counts == {"fallback": 1, "fallback_no_handoff": 1}, counts
    _, _, counts = run_variant(served, colocated, 14)  # a new prompt, within PREFILL_BACKOFF_FIRST_S of the failure
    assert counts == {"local_backoff": 1}, counts


def test_an_idle_prefill_replica_decodes_what_it_prefills(served: Served, colocated) -> None:
    """`pool_max_streams` 1 (an application of its own): a long prompt sent to an idle prefill
    pool is decoded there, without a handoff, and equals co-located; of three sent at once, those
    that find the prefill replica busy are handed over as usual; a prefill replica lost while it
    decodes a stream leaves the rest to a decode replica's local prefill after the tokens already
    sent (the client sees the co-located tokens and no error)."""
    from ray import serve

    from deployments.app import bind_app
    from deployments.replica import SpecDecodeServer

    app, die = "pd-pool-decodes", "die-while-decoding"

    class DyingPrefill(SpecDecodeServer):
        async def prefill(self, prompt, params, label, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            num_messages = 0
            async for item in super().prefill(prompt, params, label, *args, **kwargs):
                yield item
                num_messages += hasattr(item, "token_ids")
                if label == die and num_messages == 5:
                    import os

                    os._exit(1)

    config = app_config(served.target, served.drafter, transport="object_store", pool_max_streams=1)
    decode = {"ray_actor_options": {"num_cpus": 0, "resources": {"decode": 1}}}
    prefill = {"ray_actor_options": {"num_cpus": 0, "resources": {"prefill": 1}}}
    serve.run(bind_app(config, decode, prefill_overrides=prefill, prefill_cls=DyingPrefill), name=app,
              route_prefix=f"/{app}")
    try:
        def counts(name: str) -> dict:
            return serve.get_deployment_handle(name, app_name=app).prefill_counts.remote().result(timeout_s=30)

        params = dict(max_tokens=200, temperature=0.0, ignore_eos=True)
        rng = random.Random(41)
        prompts = [[rng.randrange(3, 97) for _ in range(THRESHOLD + 30)] for _ in range(6)]
        got: dict[int, list[int]] = {}

        def send(i: int, request_id: str = "") -> None:
            with SpecDecodeClient(f"127.0.0.1:{served.port}", application=app, timeout=120) as client:
                got[i] = collect(client.generate(prompts[i], request_id=request_id, **params))[0]

        with SpecDecodeClient(f"127.0.0.1:{served.port}", application=app, timeout=120) as client:
            client.wait_ready(120)
        send(0)
        assert got[0] == reference(colocated, prompts[0], **params)
        assert counts("SpecDecodePrefill").get("pool_decoded") == 1
        assert not counts("SpecDecode").get("remote")  # no handoff
        with SpecDecodeClient(f"127.0.0.1:{served.port}", application=app, timeout=120) as client:
            chunks = list(client.generate(prompts[5], n=2, **params))
        assert [t for c in chunks if c.index == 0 for t in c.token_ids] == reference(colocated, prompts[5], **params)
        assert counts("SpecDecodePrefill").get("pool_decoded") == 1  # the first of two is handed over: both share it
        assert counts("SpecDecode").get("remote") == 1

        threads = [threading.Thread(target=send, args=(i,)) for i in (1, 2, 3)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join(120)
        for i in (1, 2, 3):
            assert got[i] == reference(colocated, prompts[i], **params), i
        pool_decoded, remote = counts("SpecDecodePrefill").get("pool_decoded", 0) - 1, counts("SpecDecode").get("remote", 0) - 1
        assert pool_decoded + remote == 3 and remote >= 1, (pool_decoded, remote)

        before = counts("SpecDecode")
        send(4, die)  # the prefill replica is idle again, so it decodes this one, and dies doing it
        assert got[4] == reference(colocated, prompts[4], **params)
        after = counts("SpecDecode")
        assert after.get("fallback_no_handoff", 0) == before.get("fallback_no_handoff", 0) + 1, (before, after)
    finally:
        serve.delete(app)
