"""Chaos against a running SpecDecode service: a storm of hostile clients, then (optionally) a
replica kill, then what leaked and how long recovery took.

    python -m loadtest.chaos [--target localhost:9000] [--application specdecode] [--storm 150]
        [--concurrency 8] [--kill] [--ray-address auto] [--seed 0] [--json out.json]

Storm: `--storm` requests from `--concurrency` threads, each one of: a stream cancelled after a
random number of messages, a stream with a short deadline, a client that closes its channel
mid-stream, a bad request from the fuzz corpus (`BAD`), undecodable bytes, a request id reused by
two concurrent streams. Expected: bad inputs get INVALID_ARGUMENT or FAILED_PRECONDITION, good
requests succeed or end as the client chose (CANCELLED / DEADLINE_EXCEEDED), and any request may
get RESOURCE_EXHAUSTED when the storm fills Serve's queue; nothing else.
Afterwards the replica must go back to holding no request and no KV block ("leaks"), and a
greedy request must return the same tokens as before the storm.

Kill (`--kill`, needs the Ray cluster: `--ray-address`): starts long streams, SIGKILLs the process
of one engine replica (`SpecDecode` deployment), and reports what the in-flight clients got
(UNAVAILABLE, or a transparent retry for those that had received nothing), how long new requests
failed, and the time until a request succeeds again. Exits 1 when anything unexpected happened.
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


def engine_replica_handles(application: str) -> list:
    """Actor handles of the application's engine replicas (Serve names them SERVE_REPLICA::app#...)."""
    import ray

    names = [e["name"] if isinstance(e, dict) else e for e in ray.util.list_named_actors(all_namespaces=True)]
    return [ray.get_actor(n, namespace="serve") for n in names if n.startswith(f"SERVE_REPLICA::{application}#SpecDecode#")]


def _sigkill_self(_replica) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run_kill(client: SpecDecodeClient, application: str, ray_address: str, num_streams: int = 4) -> dict:
    """Long streams, then one engine replica SIGKILLs itself (on whatever node it runs)."""
    import ray

    ray.init(address=ray_address, logging_level="ERROR", log_to_driver=False)
    replicas = engine_replica_handles(application)
    if not replicas:
        return {"ok": False, "error": f"no engine replica of {application!r} found"}
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    max_tokens = min(2000, client.model_info().limits.max_tokens)  # long enough to be in flight

    def note(key: str) -> None:
        with lock:
            outcomes[key] += 1

    def stream(i: int) -> None:
        received = 0
        try:
            for m in client.generate([10 + i, 11], max_tokens=max_tokens, ignore_eos=True, timeout=300):
                received += len(m.token_ids)
            note("completed")
        except grpc.RpcError as e:
            note(f"{e.code().name} after {'some' if received else 'no'} tokens")
            if e.code() != grpc.StatusCode.UNAVAILABLE or "actor" in (e.details() or "").lower():
                note(f"unexpected: {e.code().name}: {e.details()}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    replicas[0].__ray_call__.remote(_sigkill_self)
    killed = time.monotonic()
    refused, recovery = 0, None
    while recovery is None and time.monotonic() - killed < 300:
        try:
            greedy(client)
            recovery = time.monotonic() - killed
        except grpc.RpcError as e:
            refused += 1
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                note(f"unexpected for a new request: {e.code().name}")
            time.sleep(0.2)
    for t in threads:
        t.join(300)
    return {"replicas_before": len(replicas), "in_flight": dict(outcomes), "new_requests_refused": refused,
            "recovery_s": None if recovery is None else round(recovery, 2),
            "ok": recovery is not None and not any(k.startswith("unexpected") for k in outcomes)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="localhost:9000")
    p.add_argument("--application", default="specdecode", help="Serve application name (gRPC metadata)")
    p.add_argument("--storm", type=int, default=150, help="hostile requests to send (0: none)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kill", action="store_true", help="SIGKILL an engine replica mid-stream (needs Ray access)")
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
            report["kill"] = run_kill(client, args.application, args.ray_address)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(part.get("ok") for part in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
