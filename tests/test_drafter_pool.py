"""The drafter pool (`speculative.placement: remote`) end to end, on a two-node Ray cluster on
this machine: two engine replicas on one node share one `SpecDrafter` replica on another, so
every step's drafts cross nodes. Greedy output equals the target alone token for token, both
engine replicas' requests draft in the pool, a seeded sampled request repeats itself, and a lost
drafter replica costs drafts, never tokens or the request.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from helpers import SERVICERS, free_port
from test_serve_grpc import collect, save_char_tokenizer

from deployments.client import SpecDecodeClient

pytestmark = pytest.mark.slow

APP = "pool"
K = 3


@dataclass
class Served:
    port: int
    target: str
    drafter: str

    def client(self, timeout: float | None = 120) -> SpecDecodeClient:
        return SpecDecodeClient(f"127.0.0.1:{self.port}", application=APP, timeout=timeout)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    import ray
    from helpers import save_perturbed_copy, save_tiny_model
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import bind_app
    from deployments.config import AppConfig

    root = tmp_path_factory.mktemp("pool_models")
    target = save_tiny_model(str(root / "target"), "llama", max_position_embeddings=1024)
    save_char_tokenizer(target)
    drafter = save_perturbed_copy(target, str(root / "drafter"), noise=0.02)
    # two nodes: the head (Serve's controller and proxies, the engine replicas) and the pool's
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"engine": 10},
                                                            "object_store_memory": 80 << 20})
    cluster.add_node(num_cpus=1, resources={"drafter": 10}, object_store_memory=80 << 20)
    port = free_port()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()},
                    grpc_options={"port": port, "grpc_servicer_functions": SERVICERS})
        config = AppConfig.from_dict({
            "model": target, "device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_queued_requests": 16,
            "max_prompt_tokens": 200, "max_tokens": 400, "default_max_tokens": 16, "num_cpus": 1,
            "speculative": {"method": "draft", "model": drafter, "num_speculative_tokens": K, "adaptive": False,
                            "placement": "remote"},
            "drafter_pool": {"timeout_s": 1.0, "draft_ahead": True},  # the replica drafts ahead between calls
        })
        engines = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.4, "resources": {"engine": 1}}}
        # a killed pool replica is noticed within a second (Serve's default health check: every 10 s)
        pool = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.4, "resources": {"drafter": 1}},
                "health_check_period_s": 1}
        serve.run(bind_app(config, engines, drafter_overrides=pool), name=APP, route_prefix=f"/{APP}")
        with SpecDecodeClient(f"127.0.0.1:{port}", application=APP) as client:
            client.wait_ready(120)
        yield Served(port, target, drafter)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def target_alone(served: Served):
    from engine import LLM

    return LLM(served.target, device="cpu", dtype="float32", speculative=None)


def reference(llm, prompt, **params) -> list[int]:
    from engine import SamplingParams

    return llm.generate([prompt], SamplingParams(**params))[0].token_ids


def replica_actors(name: str) -> list:
    import ray

    names = [e["name"] if isinstance(e, dict) else e for e in ray.util.list_named_actors(all_namespaces=True)]
    return [ray.get_actor(n, namespace="serve") for n in names if n.startswith(f"SERVE_REPLICA::{APP}#{name}#")]


def node_of(actor) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def pool_stats() -> dict[str, dict]:
    """Each drafter replica's stats, by replica id (asked with varied session ids, which the
    consistent-hash router spreads over the replicas, until both answered)."""
    from ray import serve

    handle = serve.get_deployment_handle("SpecDrafter", app_name=APP)
    seen: dict[str, dict] = {}
    for i in range(200):
        stats = handle.options(session_id=f"probe-{i}").stats.remote().result(timeout_s=30)
        seen[stats["replica"]] = stats
        if len(seen) == 2:
            break
    assert len(seen) == 2
    return seen


def pool_total(key: str) -> int:
    return sum(s[key] for s in pool_stats().values())


def proposer_counts() -> list[dict]:
    """Each engine replica's remote-drafting counts (rounds, failures, skipped, unknown, ahead, drafts),
    asked until both replicas answered (the router picks one per call)."""
    from ray import serve

    handle = serve.get_deployment_handle("SpecDecode", app_name=APP)
    seen: dict[str, dict] = {}
    for _ in range(60):
        counts = handle.remote_drafting.remote().result(timeout_s=30)
        seen[counts["replica"]] = counts
        if len(seen) == 2:
            break
    assert len(seen) == 2
    return list(seen.values())


def prompt_of(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 97) for _ in range(n)]


def test_the_pool_runs_on_its_own_node(served: Served) -> None:
    engines, drafters = replica_actors("SpecDecode"), replica_actors("SpecDrafter")
    assert len(engines) == len(drafters) == 2
    assert {node_of(e) for e in engines} == {node_of(engines[0])}
    assert node_of(engines[0]) not in {node_of(d) for d in drafters}


def test_health_answers_for_the_drafter_pool(served: Served) -> None:
    """grpc.health.v1 names the pools this app runs: "decode" and "drafter" SERVING (the ingress
    probes the pool through the handle bind_app gives it), "prefill" NOT_FOUND (co-located)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "decode", "drafter"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="prefill"), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'drafter'" in e.value.details()


def test_greedy_equals_the_target_alone_from_both_engine_replicas(served: Served, target_alone) -> None:
    """Eight concurrent requests (both engine replicas serve some): every one gives the target's
    own greedy tokens, with drafts from the pool accepted; each engine replica's calls stay with
    one pool replica (the consistent-hash router: no call ever reached a replica that did not
    hold its session, which random routing over two replicas would do at once); the pool then
    holds no session."""
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    before = pool_stats()
    results: dict[int, tuple] = {}

    def one(i: int) -> None:
        with served.client() as client:
            results[i] = collect(client.generate(prompt_of(i), **params))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(8):
        ids, _, last = results[i]
        assert ids == reference(target_alone, prompt_of(i), **params)
        assert last.speculation.num_draft_tokens > 0 and last.speculation.num_accepted_tokens > 0
    after = pool_stats()
    assert sum(a["calls"] for a in after.values()) > sum(b["calls"] for b in before.values())
    assert sum(a["drafted"] for a in after.values()) > sum(b["drafted"] for b in before.values())
    assert sum(a["unknown"] for a in after.values()) == 0
    deadline = time.monotonic() + 10
    while pool_total("sessions") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pool_total("sessions") == 0 and pool_total("used_blocks") == 0


def _draft_sequence(handle, tag: str, seed: int, steps: int, barrier: threading.Barrier | None = None) -> list:
    """One caller's session through `steps` calls of the pool (greedy, k = 3): the first sends the
    prompt, each next one the first draft of the last answer as the committed token; its drafts."""
    from engine.spec_decode.remote import DraftBatch, DraftCall

    committed, sent, drafts = prompt_of(seed, 30), 0, []
    for _ in range(steps):
        call = DraftCall(f"{tag}-{seed}", sent, tuple(committed[sent:]), K)
        if barrier is not None:
            barrier.wait(30)
        (reply,) = handle.draft.remote(DraftBatch((call,))).result(timeout_s=30).replies
        assert not reply.unknown
        drafts.append(list(reply.token_ids))
        sent = len(committed)
        committed.append(reply.token_ids[0])
    handle.draft.remote(DraftBatch((), (f"{tag}-{seed}",))).result(timeout_s=30)
    return drafts


def test_one_pool_replica_merges_several_callers_calls_into_one_round(served: Served) -> None:
    """Four callers (as four engine replicas) routed to one pool replica, calling at the same
    moments: Serve's batching runs their calls in fewer rounds than calls, and each caller gets
    the drafts it gets when it calls alone."""
    from ray import serve

    handle = serve.get_deployment_handle("SpecDrafter", app_name=APP).options(session_id="one-replica")
    alone = {seed: _draft_sequence(handle, "alone", seed, 8) for seed in range(4)}
    before = handle.stats.remote().result(timeout_s=30)
    barrier = threading.Barrier(4)
    merged: dict[int, list] = {}

    def caller(seed: int) -> None:
        merged[seed] = _draft_sequence(handle, "merged", seed, 8, barrier)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = handle.stats.remote().result(timeout_s=30)
    assert after["replica"] == before["replica"]
    assert merged == alone
    batches, rounds = after["batches"] - before["batches"], after["rounds"] - before["rounds"]
    assert batches == 4 * 9  # 8 calls and a close per caller
    assert rounds < batches, (rounds, batches)


def test_seeded_sampled_request_repeats(served: Served) -> None:
    """A seeded request's drafts at a context come from (seed, position) alone, drafted ahead or
    not, so a healthy pool gives the same tokens each time."""
    params = dict(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        with served.client() as client:
            runs.append(collect(client.generate(prompt_of(99), **params))[0])
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_a_lost_drafter_replica_costs_drafts_not_tokens(served: Served, target_alone) -> None:
    """Both drafter replicas die mid-stream: the request finishes with the target's own tokens
    (steps without drafts meanwhile, the engine backing off after failed calls), Serve starts new
    pool replicas, and later requests draft there again."""
    import ray

    params = dict(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompt = prompt_of(5)
    drafters = replica_actors("SpecDrafter")
    with served.client() as client:
        stream = client.generate(prompt, **params)
        first = next(stream)
        for drafter in drafters:
            ray.kill(drafter, no_restart=True)
        ids, _, last = collect(stream)
    assert list(first.token_ids) + ids == reference(target_alone, prompt, **params)
    assert last.usage.completion_tokens == 120
    assert sum(c["failures"] for c in proposer_counts()) > 0  # steps went without drafts meanwhile
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if pool_stats() is not None:
                break
        except Exception:  # noqa: BLE001 - the new replica is not up yet
            time.sleep(1.0)
    # the engine replicas left the pool alone after the failures (backing off, at most 8 s): later
    # requests get their drafts again once a call after the wait succeeds
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    deadline = time.monotonic() + 30
    while True:
        with served.client() as client:
            ids, _, last = collect(client.generate(prompt_of(6), **params))
        assert ids == reference(target_alone, prompt_of(6), **params)
        if last.speculation.num_draft_tokens > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert last.speculation.num_draft_tokens > 0
    new = replica_actors("SpecDrafter")
    assert len(new) == 2 and not {a._actor_id for a in new} & {a._actor_id for a in drafters}
