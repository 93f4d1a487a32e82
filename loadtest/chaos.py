"""Chaos against a running SpecDecode service: a storm of hostile clients, then (optionally) a
replica kill, then what leaked and how long recovery took.

    python -m loadtest.chaos [--target localhost:9000] [--application specdecode] [--storm 150]
        [--concurrency 8] [--kill] [--kill-streams 4] [--kill-tokens 512] [--ray-address auto]
        [--seed 0] [--json out.json]

Storm: `--storm` requests from `--concurrency` threads, each one of: a stream cancelled after a
random number of messages, a stream with a short deadline, a client that closes its channel
mid-stream, a bad request from the fuzz corpus (`BAD`), undecodable bytes, a request id reused by
two concurrent streams. Expected: bad inputs get INVALID_ARGUMENT or FAILED_PRECONDITION, good
requests succeed or end as the client chose (CANCELLED / DEADLINE_EXCEEDED), and any request may
get RESOURCE_EXHAUSTED when the storm fills Serve's queue; nothing else.
Afterwards the replica must go back to holding no request and no KV block ("leaks"), and a
greedy request must return the same tokens as before the storm.

Kill (`--kill`, needs the Ray cluster: `--ray-address`): starts `--kill-streams` long greedy
streams and, once each has its first message, SIGKILLs the process of the engine replica
(`SpecDecode` deployment) serving the most of them. The ingress resumes those streams on another
replica, so every stream must complete; it reports each stream as completed, resumed or failed,
checks each completed stream's tokens against the same request sent again undisturbed, and times
the recovery (new requests refused meanwhile). The deployment needs two engine replicas or more:
with one, a lost stream has nowhere to go on. Exits 1 when a stream failed, a completed one
differs from its undisturbed output, or anything else unexpected happened.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from deployments.client import SpecDecodeClient, make_request
from deployments.config import DEPLOYMENT_NAME
from protos.specdecode.v1 import specdecode_pb2 as pb

GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
PROBE_PROMPT = [5, 17, 33, 8]
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
# Documented answers to load, expected for any request in a storm: the queue is full, retry later.
BACKPRESSURE = grpc.StatusCode.RESOURCE_EXHAUSTED
BAD = [
    pb.GenerateRequest(prompt=""),
    pb.GenerateRequest(),
    pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])),
    pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[-1])),
    pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[2**31 - 1])),
    pb.GenerateRequest(prompt="a", max_tokens=0),
    pb.GenerateRequest(prompt="a", max_tokens=2**31 - 1),
    pb.GenerateRequest(prompt="a", temperature=float("nan")),
    pb.GenerateRequest(prompt="a", temperature=float("inf")),
    pb.GenerateRequest(prompt="a", temperature=-1.0),
    pb.GenerateRequest(prompt="a", top_p=0.0),
    pb.GenerateRequest(prompt="a", top_p=float("nan")),
    pb.GenerateRequest(prompt="a", top_k=-1),
    pb.GenerateRequest(prompt="a", top_k=2**31 - 1),
    pb.GenerateRequest(prompt="a", seed=-5),
    pb.GenerateRequest(prompt="a", stop=[""]),
    pb.GenerateRequest(prompt="a", stop=["x"] * 10_000),
    pb.GenerateRequest(prompt="a", stop_token_ids=[-3]),
    pb.GenerateRequest(prompt="a", speculation=9),  # type: ignore[arg-type]
    pb.GenerateRequest(prompt="a", max_speculative_tokens=2**32 - 1),
    pb.GenerateRequest(prompt="x" * (4 << 20)),
]


class Storm:
    def __init__(self, client: SpecDecodeClient, application: str, vocab_size: int, rng: random.Random) -> None:
        self.client = client
        self.application = application
        self.vocab = vocab_size
        self.rng = rng
        self.outcomes: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()

    def record(self, kind: str, outcome: str, ok: bool) -> None:
        with self.lock:
            self.outcomes[f"{kind}: {outcome}"] += 1
            if not ok:
                self.unexpected.append(f"{kind}: {outcome}")

    def prompt(self) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 32))]

    def one(self, i: int) -> None:
        kind = self.rng.choice(["cancel", "deadline", "close", "bad", "bytes", "reuse"])
        try:
            getattr(self, f"_{kind}")(i)
        except grpc.RpcError as e:
            self.record(kind, e.code().name, e.code() == BACKPRESSURE)
        except Exception as e:  # noqa: BLE001 - reported, the storm goes on
            self.record(kind, f"{type(e).__name__}: {e}", False)

    def _cancel(self, i: int) -> None:
        call = self.client.stub.Generate(make_request(self.prompt(), max_tokens=400, ignore_eos=True),
                                         timeout=60, metadata=self.client.metadata)
        for _ in range(self.rng.randint(0, 5)):
            next(call)
        call.cancel()
        self.record("cancel", "cancelled", True)

    def _deadline(self, i: int) -> None:
        call = self.client.stub.Generate(make_request(self.prompt(), max_tokens=400, ignore_eos=True),
                                         timeout=self.rng.uniform(0.01, 0.5), metadata=self.client.metadata)
        try:
            for _ in call:
                pass
            self.record("deadline", "finished in time", True)
        except grpc.RpcError as e:
            self.record("deadline", e.code().name, e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, BACKPRESSURE))

    def _close(self, i: int) -> None:
        with SpecDecodeClient(self.client.target, application=self.application) as own:
            call = own.stub.Generate(make_request(self.prompt(), max_tokens=400, ignore_eos=True),
                                     timeout=60, metadata=own.metadata)
            next(call)
        self.record("close", "channel closed", True)

    def _bad(self, i: int) -> None:
        request = self.rng.choice(BAD)
        try:
            for _ in self.client.stream(request, timeout=60):
                pass
            self.record("bad", "accepted", False)
        except grpc.RpcError as e:
            self.record("bad", e.code().name, e.code() in CLIENT_CODES or e.code() == BACKPRESSURE)

    def _bytes(self, i: int) -> None:
        junk = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 64)))
        method = self.client.channel.unary_stream("/specdecode.v1.SpecDecode/Generate", request_serializer=None,
                                                  response_deserializer=pb.GenerateResponse.FromString)
        try:
            for _ in method(junk, metadata=self.client.metadata, timeout=60):
                pass
            self.record("bytes", "OK (the bytes parsed)", True)
        except grpc.RpcError as e:
            self.record("bytes", e.code().name, e.code() in CLIENT_CODES or e.code() == BACKPRESSURE)

    def _reuse(self, i: int) -> None:
        rid = f"chaos-{i % 3}"
        first = self.client.stub.Generate(make_request(self.prompt(), max_tokens=48, ignore_eos=True, request_id=rid),
                                          timeout=60, metadata=self.client.metadata)
        next(first)
        first.cancel()
        tokens = sum(len(m.token_ids) for m in self.client.generate(self.prompt(), max_tokens=8, ignore_eos=True,
                                                                    request_id=rid))
        self.record("reuse", f"{tokens} tokens", tokens == 8)


def idle_usage(client: SpecDecodeClient, timeout: float) -> pb.EngineUsage:
    deadline = time.monotonic() + timeout
    while True:
        usage = client.model_info().usage
        if (usage.num_running, usage.num_waiting, usage.num_used_blocks) == (0, 0, 0) or time.monotonic() > deadline:
            return usage
        time.sleep(0.1)


def greedy(client: SpecDecodeClient) -> list[int]:
    return [t for m in client.generate(PROBE_PROMPT, **GREEDY) for t in m.token_ids]


def run_storm(client: SpecDecodeClient, application: str, n: int, concurrency: int, seed: int) -> dict:
    info = client.model_info()
    before = greedy(client)
    storm = Storm(client, application, info.limits.vocab_size, random.Random(seed))
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(storm.one, range(n)))
    elapsed = time.monotonic() - start
    usage = idle_usage(client, 60)
    after = greedy(client)
    leaks = {"num_running": usage.num_running, "num_waiting": usage.num_waiting,
             "num_used_blocks": usage.num_used_blocks}
    return {"requests": n, "seconds": round(elapsed, 1), "outcomes": dict(storm.outcomes),
            "unexpected": storm.unexpected, "leaks_after_idle": leaks, "greedy_unchanged": before == after,
            "ok": not storm.unexpected and not any(leaks.values()) and before == after}


def replica_handles(application: str, deployment: str = DEPLOYMENT_NAME) -> list:
    """Actor handles of the replicas of one of the application's deployments (by default its
    engine replicas; Serve names them SERVE_REPLICA::app#deployment#...)."""
    import ray

    names = [e["name"] if isinstance(e, dict) else e for e in ray.util.list_named_actors(all_namespaces=True)]
    return [ray.get_actor(n, namespace="serve") for n in names
            if n.startswith(f"SERVE_REPLICA::{application}#{deployment}#")]


def _sigkill_self(_replica) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run_kill(client: SpecDecodeClient, application: str, num_streams: int = 4, max_tokens: int = 512,
             seed: int = 0) -> dict:
    """Greedy streams; once each has its first message, the engine replica serving the most of
    them SIGKILLs itself (on whatever node it runs; Ray must be initialized). Each stream must
    complete: "completed", "resumed" (the ingress resumed it on another replica) or "failed",
    and a completed stream's tokens must equal the same request's undisturbed output (sent again
    once the service has recovered)."""
    import ray
    from ray import serve

    from deployments.config import INGRESS_DEPLOYMENT_NAME

    replicas = replica_handles(application)
    if not replicas:
        return {"ok": False, "error": f"no engine replica of {application!r} found"}
    info = client.model_info()
    rng = random.Random(seed)
    prompts = [[rng.randrange(info.limits.vocab_size) for _ in range(rng.randint(2, 16))] for _ in range(num_streams)]
    max_tokens = max(1, min(max_tokens, info.limits.max_tokens, info.limits.max_model_len - 16))
    params = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    labels = [f"chaos-kill-{seed}-{i}-{random.getrandbits(32):08x}" for i in range(num_streams)]
    tokens: list[list[int]] = [[] for _ in range(num_streams)]
    errors: list[str | None] = [None] * num_streams
    started = [threading.Event() for _ in range(num_streams)]
    unexpected: list[str] = []

    def stream(i: int) -> None:
        try:
            for m in client.generate(prompts[i], request_id=labels[i], timeout=600, **params):
                tokens[i].extend(m.token_ids)
                started[i].set()
        except grpc.RpcError as e:
            errors[i] = f"{e.code().name}: {e.details()}"
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(120)
    ongoing = ray.get([r.get_num_ongoing_requests.remote() for r in replicas], timeout=60)
    victim = ongoing.index(max(ongoing))
    replicas[victim].__ray_call__.remote(_sigkill_self)
    killed = time.monotonic()
    refused, recovery = 0, None
    while recovery is None and time.monotonic() - killed < 300:
        try:
            greedy(client)
            recovery = time.monotonic() - killed
        except grpc.RpcError as e:
            refused += 1
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                unexpected.append(f"a new request got {e.code().name}: {e.details()}")
            time.sleep(0.2)
    for t in threads:
        t.join(600)
    ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT_NAME, app_name=application)
    resumed = set(ingress.resumed_requests.remote().result(timeout_s=60))
    with ThreadPoolExecutor(num_streams) as pool:  # the undisturbed output of each request
        undisturbed = list(pool.map(lambda p: [t for m in client.generate(p, timeout=600, **params)
                                               for t in m.token_ids], prompts))
    per_stream = []
    for i in range(num_streams):
        outcome = "failed" if errors[i] else "resumed" if labels[i] in resumed else "completed"
        entry = {"request_id": labels[i], "outcome": outcome, "tokens": len(tokens[i])}
        if errors[i]:
            entry["error"] = errors[i]
        else:
            entry["equals_undisturbed"] = tokens[i] == undisturbed[i]
        per_stream.append(entry)
    counts = Counter(e["outcome"] for e in per_stream)
    mismatched = sum(1 for e in per_stream if e.get("equals_undisturbed") is False)
    return {"replicas_before": len(replicas), "killed_replica_streams": ongoing[victim],
            "streams": {k: counts.get(k, 0) for k in ("completed", "resumed", "failed")},
            "mismatched": mismatched, "per_stream": per_stream, "new_requests_refused": refused,
            "recovery_s": None if recovery is None else round(recovery, 2), "unexpected": unexpected,
            "ok": recovery is not None and counts.get("failed", 0) == 0 and not mismatched and not unexpected}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="localhost:9000")
    p.add_argument("--application", default="specdecode", help="Serve application name (gRPC metadata)")
    p.add_argument("--storm", type=int, default=150, help="hostile requests to send (0: none)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kill", action="store_true", help="SIGKILL an engine replica mid-stream (needs Ray access)")
    p.add_argument("--kill-streams", type=int, default=4, help="greedy streams in flight when the replica is killed")
    p.add_argument("--kill-tokens", type=int, default=512, help="max_tokens of each (long enough to be in flight)")
    p.add_argument("--ray-address", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    report: dict = {}
    with SpecDecodeClient(args.target, application=args.application, timeout=120) as client:
        client.wait_ready(60)
        if args.storm:
            report["storm"] = run_storm(client, args.application, args.storm, args.concurrency, args.seed)
        if args.kill:
            import ray

            ray.init(address=args.ray_address, logging_level="ERROR", log_to_driver=False)
            report["kill"] = run_kill(client, args.application, args.kill_streams, args.kill_tokens, args.seed)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(part.get("ok") for part in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
