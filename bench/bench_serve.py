"""What Ray Serve + gRPC (or HTTP) add to latency: TTFT and TPOT at batch 1, served vs in-process.

    python -m bench.bench_serve [--model models/target --drafter models/drafter --method draft -k 4]
        [--num-requests 20 --max-tokens 64] [--no-speculation] [--out PATH]

Loads the same engine config three times on this machine: `engine.AsyncLLM` in this process;
the SpecDecode application on an embedded Ray Serve (gRPC proxy -> ingress -> engine replica),
called through its gRPC proxy with `deployments.client`; and, on the same Serve, a "direct"
application whose engine replica answers the proxy itself (no ingress: it measures the ingress
hop); and the SpecDecode application again through
Serve's HTTP proxy, streaming the OpenAI-compatible `/v1/completions` (server-sent events; HTTP
proxy -> ingress -> engine replica). Requests rotate between the four (same prompt back to back,
the idle engines sleeping) so that other load on the machine hits all alike. Requests are
sequential (batch 1), greedy and ignore EOS (fixed length).
TTFT: request sent -> first token received. TPOT: (last token - first token) / (tokens - 1).
Medians over --num-requests after --warmup requests, for speculation on (if a drafter is
configured) and off (per request). Goal: Serve+gRPC add < 10 ms to TTFT and < 15% to TPOT.
Writes bench/results/<host>/serve.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

from deployments.config import AppConfig, ConfigError, missing_models, resolve_path

PROMPTS = [
    "def fib(n):",
    "import os\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "def binary_search(items, target):",
    "for i in range(10):",
]
TTFT_GOAL_MS = 10.0
SERVED_PATHS = ("serve_grpc", "serve_grpc_direct", "serve_http")
TPOT_GOAL = 0.15


@dataclass
class Sample:
    ttft_s: float
    tpot_s: float
    num_tokens: int
    # Served only: the same two measured inside the replica (engine arrival -> first / last token).
    server_ttft_s: float | None = None
    server_tpot_s: float | None = None


def summarize(samples: list[Sample]) -> dict:
    return {
        "ttft_ms_median": statistics.median(s.ttft_s for s in samples) * 1e3,
        "tpot_ms_median": statistics.median(s.tpot_s for s in samples) * 1e3,
        "ttft_ms": [round(s.ttft_s * 1e3, 3) for s in samples],
        "tpot_ms": [round(s.tpot_s * 1e3, 3) for s in samples],
        "num_tokens": [s.num_tokens for s in samples],
        **({
            "server_side_ttft_ms_median": statistics.median(s.server_ttft_s for s in samples) * 1e3,
            "server_side_tpot_ms_median": statistics.median(s.server_tpot_s for s in samples) * 1e3,
        } if all(s.server_tpot_s is not None for s in samples) else {}),
    }


def sample(start: float, first: float | None, last: float, num_tokens: int) -> Sample:
    if first is None or num_tokens < 2:
        raise RuntimeError(f"a benchmark request produced {num_tokens} tokens; need >= 2 (raise --max-tokens)")
    return Sample(first - start, (last - first) / (num_tokens - 1), num_tokens)


def prompts_for(has_tokenizer: bool, n: int) -> list[str | list[int]]:
    if has_tokenizer:
        return [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    return [[(7 * i + j) % 90 + 3 for j in range(8)] for i in range(n)]


class InProcess:
    """engine.AsyncLLM in this process, driven one request at a time on a private event loop."""

    def __init__(self, config: AppConfig) -> None:
        from engine import AsyncLLM

        # The replica's engine settings, torch threads included (engine_kwargs resolves them on
        # this host exactly as the replica does on its own).
        self.llm = AsyncLLM(resolve_path(config.model), **config.engine_kwargs())
        self.has_tokenizer = self.llm.tokenizer is not None
        self.loop = asyncio.new_event_loop()

    def request(self, prompt: str | list[int], max_tokens: int, speculative: bool) -> Sample:
        from engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, speculative=speculative)

        async def run() -> Sample:
            start = time.perf_counter()
            first, n = None, 0
            async for out in self.llm.generate(prompt, params):
                if out.delta_token_ids and first is None:
                    first = time.perf_counter()
                n += len(out.delta_token_ids)
            return sample(start, first, time.perf_counter(), n)

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.llm.shutdown()
        self.loop.close()


def direct_server_class() -> type:
    """The engine replica answering Serve's proxy itself, with no ingress in front (what the
    ingress hop is measured against): `Generate` relays `generate`'s messages. Bench only."""
    from deployments.common import Accepted
    from deployments.errors import ClientError
    from deployments.replica import SpecDecodeServer

    class DirectServer(SpecDecodeServer):
        async def Generate(self, request, grpc_context):  # noqa: N802 - gRPC method name
            async for item in self.generate(request, request.request_id or "bench"):
                if isinstance(item, ClientError):
                    grpc_context.set_code(item.code)
                    grpc_context.set_details(item.details)
                    raise item
                if not isinstance(item, Accepted):
                    yield item

        async def GetModelInfo(self, request, grpc_context=None):  # noqa: N802 - gRPC method name
            return await super().GetModelInfo(request)

    return DirectServer


class Served:
    """Both served applications on one embedded Ray Serve, called through its gRPC proxy."""

    def __init__(self, config: AppConfig, port: int | None) -> None:
        import ray
        from ray import serve

        from deployments.app import bind_app, deployment_options
        from deployments.client import SpecDecodeClient
        from deployments.config import DEPLOYMENT_NAME

        port = port or free_port()
        self.http_port = free_port()
        ray.init(address="local", num_cpus=config.num_cpus, include_dashboard=False, log_to_driver=False)
        serve.start(
            http_options={"host": "127.0.0.1", "port": self.http_port},
            grpc_options={"port": port, "grpc_servicer_functions": [
                "deployments.servicer.add_SpecDecodeServicer_to_server"]},
        )
        # Two engine replicas on one host: neither reserves the CPUs (their torch threads are
        # set by the config, as for the in-process engine).
        shared = {"ray_actor_options": {"num_cpus": 0}}
        serve.run(bind_app(config, shared), name="bench", route_prefix="/bench")
        direct = serve.deployment(direct_server_class(), name=DEPLOYMENT_NAME)
        serve.run(direct.options(**deployment_options(config, shared)).bind(config), name="bench-direct",
                  route_prefix="/bench-direct")
        self.client = SpecDecodeClient(f"127.0.0.1:{port}", application="bench", timeout=600)
        self.direct = SpecDecodeClient(f"127.0.0.1:{port}", application="bench-direct", timeout=600)
        self.client.wait_ready()
        self.direct.wait_ready()

    def runner(self, direct: bool):
        return _ServedPath(self, self.direct if direct else self.client)

    def http_runner(self):
        return _HttpPath(f"http://127.0.0.1:{self.http_port}/bench", self.client.model_info().model)

    def unary_round_trip_ms(self, client, n: int = 30) -> float:
        """Median GetModelInfo round trip: client -> gRPC proxy -> (ingress ->) replica -> back,
        with no engine step in it (a snapshot of the engine's stats): the floor Serve + gRPC add
        to a request's first response."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            client.model_info()
            times.append(time.perf_counter() - t0)
            time.sleep(0.02)
        return statistics.median(times) * 1e3

    def http_round_trip_ms(self, n: int = 30) -> float:
        """Median GET /v1/models round trip (an engine replica's ModelInfo, as GetModelInfo)."""
        import requests

        times = []
        with requests.Session() as session:
            for _ in range(n):
                t0 = time.perf_counter()
                session.get(f"http://127.0.0.1:{self.http_port}/bench/v1/models", timeout=60).raise_for_status()
                times.append(time.perf_counter() - t0)
                time.sleep(0.02)
        return statistics.median(times) * 1e3

    def close(self) -> None:
        import ray
        from ray import serve

        self.client.close()
        self.direct.close()
        serve.shutdown()
        ray.shutdown()


class _ServedPath:
    def __init__(self, served: Served, client) -> None:
        self.served, self.client = served, client

    def request(self, prompt: str | list[int], max_tokens: int, speculative: bool) -> Sample:
        start = time.perf_counter()
        first, n = None, 0
        for chunk in self.client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                          speculation="default" if speculative else "off"):
            if chunk.token_ids and first is None:
                first = time.perf_counter()
            n += len(chunk.token_ids)
            last = chunk
        result = sample(start, first, time.perf_counter(), n)
        result.server_ttft_s = last.timing.ttft_s
        result.server_tpot_s = (last.timing.e2e_s - last.timing.ttft_s) / (n - 1)
        return result


class _HttpPath:
    """Streamed `/v1/completions` through Serve's HTTP proxy (one keep-alive session)."""

    def __init__(self, base_url: str, model: str) -> None:
        import requests

        self.url, self.model = f"{base_url}/v1/completions", model
        self.session = requests.Session()

    def request(self, prompt: str | list[int], max_tokens: int, speculative: bool) -> Sample:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "specdecode": {"ignore_eos": True, "return_token_ids": True,
                               "speculation": "default" if speculative else "off"}}
        start = time.perf_counter()
        first, n, final = None, 0, None
        with self.session.post(self.url, json=body, stream=True, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[len(b"data: "):])
                num = sum(len(c.get("token_ids", [])) for c in event["choices"])
                if num and first is None:
                    first = time.perf_counter()
                n += num
                final = event.get("specdecode", final)
        result = sample(start, first, time.perf_counter(), n)
        timing = final["timing"]
        result.server_ttft_s = timing["ttft_s"]
        result.server_tpot_s = (timing["e2e_s"] - timing["ttft_s"]) / (n - 1)
        return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rotation(in_process: InProcess, served: Served, args: argparse.Namespace, modes: list[str]) -> dict:
    """Rotate in-process, served (ingress), served-direct and HTTP requests (same prompt back to
    back) so that load from elsewhere on the machine hits all paths alike; idle engines sleep."""
    paths = {"in_process": in_process, "serve_grpc": served.runner(direct=False),
             "serve_grpc_direct": served.runner(direct=True), "serve_http": served.http_runner()}
    names = list(paths)
    results = {}
    for mode in modes:
        samples: dict[str, list[Sample]] = {name: [] for name in names}
        for i, prompt in enumerate(prompts_for(in_process.has_tokenizer, args.warmup + args.num_requests)):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                time.sleep(args.pause)  # let the other paths' OpenMP threads go back to sleep
                samples[name].append(paths[name].request(prompt, args.max_tokens, mode == "spec"))
        samples = {name: s[args.warmup :] for name, s in samples.items()}
        a = samples["in_process"]
        results[mode] = {name: summarize(s) for name, s in samples.items()}
        for name in SERVED_PATHS:
            b = samples[name]
            results[mode][f"{name}_ttft_added_ms_paired_median"] = statistics.median(
                (y.ttft_s - x.ttft_s) * 1e3 for x, y in zip(a, b, strict=True))
            results[mode][f"{name}_tpot_added_fraction_paired_median"] = statistics.median(
                y.tpot_s / x.tpot_s - 1 for x, y in zip(a, b, strict=True))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/target")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (default: the method's shipped one)")
    p.add_argument("--method", default="draft", help="draft, ngram, eagle, eagle3, medusa or mtp")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--no-speculation", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1, help="CPUs for the engine (both runs)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default: a free one)")
    p.add_argument("--pause", type=float, default=0.2, help="seconds of idle before each request")
    p.add_argument("--out", default=None, help="result JSON (default: bench/results/<host>/serve.json)")
    args = p.parse_args(argv)

    spec = None
    if not args.no_speculation:
        spec = {"method": args.method, "num_speculative_tokens": args.k}
        if args.drafter is not None:
            spec["model"] = args.drafter
    try:
        config = AppConfig.from_dict({
            "model": args.model, "speculative": spec, "device": args.device, "dtype": args.dtype,
            "max_num_seqs": 4, "num_cpus": args.num_cpus, "max_tokens": args.max_tokens,
            "default_max_tokens": min(128, args.max_tokens),
        }, "bench")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    missing = missing_models(config)
    if missing:
        print(f"error: model directory not found: {', '.join(missing)}; train the shipped models first "
              "(python -m training --help) or pass --model/--drafter", file=sys.stderr)
        return 2
    modes = ["spec", "nospec"] if config.speculative is not None else ["nospec"]

    import torch

    if config.device != "cpu" and torch.cuda.is_available() and config.kv_cache_memory_bytes is None:
        # Both engines share the accelerator: give each a fixed KV pool instead of "what is left".
        config = replace(config, kv_cache_memory_bytes=4 << 30)
    print(f"{config.model}, drafter {config.speculative}: {args.num_requests} requests x {args.max_tokens} tokens, "
          "in-process AsyncLLM and Ray Serve + gRPC alternating")
    load_before = os.getloadavg()
    in_process = InProcess(config)
    try:
        served = Served(config, args.port)
        try:
            results = run_rotation(in_process, served, args, modes)
            unary_ms = served.unary_round_trip_ms(served.client)
            unary_direct_ms = served.unary_round_trip_ms(served.direct)
            unary_http_ms = served.http_round_trip_ms()
        finally:
            served.close()
    finally:
        in_process.close()

    rows = []
    for mode in modes:
        r = results[mode]
        a = r["in_process"]
        row = {"mode": mode, **r}
        for name in SERVED_PATHS:
            b = r[name]
            row[f"{name}_ttft_added_ms"] = b["ttft_ms_median"] - a["ttft_ms_median"]
            row[f"{name}_tpot_added_fraction"] = b["tpot_ms_median"] / a["tpot_ms_median"] - 1.0
        row["meets_ttft_goal"] = row["serve_grpc_ttft_added_ms"] < TTFT_GOAL_MS
        row["meets_tpot_goal"] = row["serve_grpc_tpot_added_fraction"] < TPOT_GOAL
        rows.append(row)
    report = {
        "benchmark": "serve_overhead_batch1",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            # Other work on the machine inflates both paths, the served one (more processes) more.
            "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg(),
        },
        "config": asdict(config),
        "torch_threads": config.engine_kwargs()["num_threads"],
        "num_requests": args.num_requests,
        "warmup": args.warmup,
        "max_tokens": args.max_tokens,
        "schedule": "in-process / served (ingress) / served direct / HTTP rotating, same prompt back to back",
        "goals": {"ttft_added_ms_below": TTFT_GOAL_MS, "tpot_added_fraction_below": TPOT_GOAL},
        "results": rows,
        "unary_round_trip_ms_median": unary_ms,
        "unary_round_trip_direct_ms_median": unary_direct_ms,
        "unary_round_trip_http_ms_median": unary_http_ms,
    }
    from bench.common import write_results

    out = write_results("serve", report, args.out)

    print(f"\n{'mode':<8} {'path':<18} {'TTFT ms':>9} {'TPOT ms':>9}")
    ok = lambda flag: "ok" if flag else "MISSED"  # noqa: E731
    for row in rows:
        for path in ("in_process", *SERVED_PATHS):
            r = row[path]
            print(f"{row['mode']:<8} {path:<18} {r['ttft_ms_median']:>9.2f} {r['tpot_ms_median']:>9.2f}")
        for name in SERVED_PATHS:
            label = {"serve_grpc": "added, ingress", "serve_grpc_direct": "added, direct", "serve_http": "added, HTTP"}[name]
            print(f"{row['mode']:<8} {label:<18} "
                  f"{row[name + '_ttft_added_ms']:>+9.2f} {row[name + '_tpot_added_fraction']:>+9.1%}   "
                  f"(paired: {row[name + '_ttft_added_ms_paired_median']:+.2f} ms, "
                  f"{row[name + '_tpot_added_fraction_paired_median']:+.1%})")
        print(f"{row['mode']:<8} goals (ingress path): < {TTFT_GOAL_MS:.0f} ms {ok(row['meets_ttft_goal'])}, "
              f"< {TPOT_GOAL:.0%} {ok(row['meets_tpot_goal'])}")
        b = row["serve_grpc"]
        print(f"{row['mode']:<8} {'  in replica':<18} {b['server_side_ttft_ms_median']:>9.2f} "
              f"{b['server_side_tpot_ms_median']:>9.2f}   (engine timings inside the replica)")
    print(f"GetModelInfo round trip (no engine step): {unary_ms:.2f} ms with the ingress, "
          f"{unary_direct_ms:.2f} ms direct; GET /v1/models over HTTP {unary_http_ms:.2f} ms")
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
