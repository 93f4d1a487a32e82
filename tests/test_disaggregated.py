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
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from test_serve_grpc import SERVICER, collect, free_port, save_char_tokenizer

from deployments.client import SpecDecodeClient, make_request

pytestmark = pytest.mark.slow

APP = "pd"
THRESHOLD = 24  # prompts with at least this many uncached tokens are prefilled remotely
K = 3


@dataclass
class Served:
    port: int
    target: str
    drafter: str

    def client(self, timeout: float | None = 120) -> SpecDecodeClient:
        return SpecDecodeClient(f"127.0.0.1:{self.port}", application=APP, timeout=timeout)


def app_config(target: str, drafter: str):
    from deployments.config import AppConfig

    return AppConfig.from_dict({
        "model": target, "device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_queued_requests": 16,
        "max_prompt_tokens": 200, "max_tokens": 400, "default_max_tokens": 16, "num_cpus": 1,
        "speculative": {"method": "draft", "model": drafter, "num_speculative_tokens": K, "adaptive": False},
        "mode": "disaggregated", "disaggregation": {"min_prompt_tokens": THRESHOLD},
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
    drafter = save_perturbed_copy(target, str(root / "drafter"), noise=0.02)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
    cluster.add_node(num_cpus=1, resources={"prefill": 1}, object_store_memory=80 << 20)
    cluster.add_node(num_cpus=1, resources={"decode": 1}, object_store_memory=80 << 20)
    port = free_port()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()},
                    grpc_options={"port": port, "grpc_servicer_functions": [SERVICER]})
        config = app_config(target, drafter)
        decode = {"ray_actor_options": {"num_cpus": 0.5, "resources": {"decode": 1}}}
        prefill = {"ray_actor_options": {"num_cpus": 0.5, "resources": {"prefill": 1}}}
        serve.run(bind_app(config, decode, prefill_overrides=prefill), name=APP, route_prefix=f"/{APP}")
        with SpecDecodeClient(f"127.0.0.1:{port}", application=APP) as client:
            client.wait_ready(120)
        yield Served(port, target, drafter)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


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


def both_pools_idle(timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        usages = [handle(name).model_info.remote().result(timeout_s=30).usage for name in ("SpecDecode", "SpecDecodePrefill")]
        if all((u.num_running, u.num_waiting, u.num_used_blocks) == (0, 0, 0) for u in usages):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_pools_run_on_separate_nodes(served: Served) -> None:
    import ray

    def node_of(name: str) -> str:
        names = [e["name"] if isinstance(e, dict) else e for e in ray.util.list_named_actors(all_namespaces=True)]
        [actor] = [n for n in names if n.startswith(f"SERVE_REPLICA::{APP}#{name}#")]
        replica = ray.get_actor(actor, namespace="serve")
        return ray.get(replica.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))

    assert node_of("SpecDecodePrefill") != node_of("SpecDecode")


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


def test_seeded_sampled_request_equals_colocated(served: Served, colocated) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 10)]
    params = dict(max_tokens=30, temperature=0.8, seed=1234, ignore_eos=True)
    with served.client() as client:
        ids, _, _ = collect(client.generate(prompt, **params))
    assert ids == reference(colocated, prompt, **params)


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
    counts = prefill_counts()
    assert counts.get("remote", 0) > 0


def dying_prefill_class() -> type:
    """A prefill replica whose process exits right after sending the first message: the handoff
    never arrives (by value for Ray)."""
    from deployments.app import PrefillResult, SpecDecodeServer

    class DyingPrefill(SpecDecodeServer):
        async def prefill(self, prompt, params, label, trace_metadata=None):  # noqa: ANN001, ANN201
            async for item in super().prefill(prompt, params, label, trace_metadata):
                if isinstance(item, PrefillResult):
                    import os

                    os._exit(1)
                yield item

    return DyingPrefill


def test_lost_prefill_replica_falls_back_to_a_local_prefill(served: Served, colocated) -> None:
    """The prefill replica dies after the client got the first token and before the decode side
    has the handoff: the decode replica prefills locally (after the tokens already sent), the
    client sees the co-located tokens and no error, and the fallback is counted."""
    from ray import serve

    from deployments.app import bind_app

    app = "pd-dying"
    config = app_config(served.target, served.drafter)
    zero = {"ray_actor_options": {"num_cpus": 0}}
    serve.run(bind_app(config, zero, prefill_overrides=zero, prefill_cls=dying_prefill_class()),
              name=app, route_prefix=f"/{app}")
    rng = random.Random(11)
    prompt = [rng.randrange(3, 97) for _ in range(THRESHOLD + 20)]
    params = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    try:
        with SpecDecodeClient(f"127.0.0.1:{served.port}", application=app, timeout=120) as client:
            client.wait_ready(120)
            ids, _, last = collect(client.generate(prompt, **params))
        assert ids == reference(colocated, prompt, **params)
        assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == 30
        counts = serve.get_deployment_handle("SpecDecode", app_name=app).prefill_counts.remote().result(timeout_s=30)
        assert counts.get("fallback", 0) == 1, counts
    finally:
        serve.delete(app)
