"""What Ray Serve + gRPC add to latency: TTFT and TPOT at batch 1, served vs in-process.

    python -m bench.bench_serve [--model models/target --drafter models/drafter --method draft -k 4]
        [--num-requests 20 --max-tokens 64] [--no-speculation] [--out bench/results/serve.json]

Loads the same engine config twice on this machine: `engine.AsyncLLM` in this process, and the
SpecDecode deployment on an embedded Ray Serve, called through its gRPC proxy with
`deployments.client`. Requests alternate between the two (same prompt back to back, the idle
engine sleeping) so that other load on the machine hits both alike. Requests are sequential
(batch 1), greedy and ignore EOS (fixed length).
TTFT: request sent -> first token received. TPOT: (last token - first token) / (tokens - 1).
Medians over --num-requests after --warmup requests, for speculation on (if a drafter is
configured) and off (per request). Goal: Serve+gRPC add < 10 ms to TTFT and < 15% to TPOT.
Writes JSON to --out and prints a table.
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
from pathlib import Path

from deployments.config import AppConfig, ConfigError, missing_models, resolve_path

PROMPTS = [
    "def fib(n):",
    "import os\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "def binary_search(items, target):",
    "for i in range(10):",
]
TTFT_GOAL_MS = 10.0
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


class Served:
    """The SpecDecode deployment on an embedded Ray Serve, called through its gRPC proxy."""

    def __init__(self, config: AppConfig, port: int | None) -> None:
        import ray
        from ray import serve

        from deployments.app import bind_app
        from deployments.client import SpecDecodeClient

        port = port or free_port()
        ray.init(address="local", num_cpus=config.num_cpus, include_dashboard=False, log_to_driver=False)
        serve.start(
            http_options={"host": "127.0.0.1", "port": free_port()},
            grpc_options={"port": port, "grpc_servicer_functions": [
                "deployments.servicer.add_SpecDecodeServicer_to_server"]},
        )
        serve.run(bind_app(config), name="bench", route_prefix="/bench")
        self.client = SpecDecodeClient(f"127.0.0.1:{port}", timeout=600)
        self.client.wait_ready()

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

    def unary_round_trip_ms(self, n: int = 30) -> float:
        """Median GetModelInfo round trip: client -> gRPC proxy -> replica -> back, with no
        engine step in it (a snapshot of the engine's stats): the floor Serve + gRPC add to a
        request's first response."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.client.model_info()
            times.append(time.perf_counter() - t0)
            time.sleep(0.02)
        return statistics.median(times) * 1e3

    def close(self) -> None:
        import ray
        from ray import serve

        self.client.close()
        serve.shutdown()
        ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pairs(in_process: InProcess, served: Served, args: argparse.Namespace, modes: list[str]) -> dict:
    """Alternate in-process and served requests (same prompt back to back) so that load from
    elsewhere on the machine hits both paths alike; the idle engine of the other path sleeps."""
    results = {}
    for mode in modes:
        a: list[Sample] = []
        b: list[Sample] = []
        for i, prompt in enumerate(prompts_for(in_process.has_tokenizer, args.warmup + args.num_requests)):
            first, second = (in_process, served) if i % 2 == 0 else (served, in_process)
            for runner in (first, second):
                time.sleep(args.pause)  # let the other path's OpenMP threads go back to sleep
                s = runner.request(prompt, args.max_tokens, mode == "spec")
                (a if runner is in_process else b).append(s)
        a, b = a[args.warmup :], b[args.warmup :]
        results[mode] = {
            "in_process": summarize(a),
            "serve_grpc": summarize(b),
            "ttft_added_ms_paired_median": statistics.median((y.ttft_s - x.ttft_s) * 1e3 for x, y in zip(a, b, strict=True)),
            "tpot_added_fraction_paired_median": statistics.median(y.tpot_s / x.tpot_s - 1 for x, y in zip(a, b, strict=True)),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/target")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (default: the method's shipped one)")
    p.add_argument("--method", default="draft", help="draft, ngram, eagle or mtp")
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
    p.add_argument("--out", default="bench/results/serve.json")
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
            results = run_pairs(in_process, served, args, modes)
            unary_ms = served.unary_round_trip_ms()
        finally:
            served.close()
    finally:
        in_process.close()

    rows = []
    for mode in modes:
        r = results[mode]
        a, b = r["in_process"], r["serve_grpc"]
        ttft_added = b["ttft_ms_median"] - a["ttft_ms_median"]
        tpot_added = b["tpot_ms_median"] / a["tpot_ms_median"] - 1.0
        rows.append({
            "mode": mode, **r,
            "ttft_added_ms": ttft_added,
            "tpot_added_fraction": tpot_added,
            "meets_ttft_goal": ttft_added < TTFT_GOAL_MS,
            "meets_tpot_goal": tpot_added < TPOT_GOAL,
        })
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
        "schedule": "alternating in-process / served requests, same prompt back to back",
        "goals": {"ttft_added_ms_below": TTFT_GOAL_MS, "tpot_added_fraction_below": TPOT_GOAL},
        "results": rows,
        "unary_round_trip_ms_median": unary_ms,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n{'mode':<8} {'path':<14} {'TTFT ms':>9} {'TPOT ms':>9}")
    for row in rows:
        for path in ("in_process", "serve_grpc"):
            r = row[path]
            print(f"{row['mode']:<8} {path:<14} {r['ttft_ms_median']:>9.2f} {r['tpot_ms_median']:>9.2f}")
        ok = lambda flag: "ok" if flag else "MISSED"  # noqa: E731
        print(f"{row['mode']:<8} {'added':<14} {row['ttft_added_ms']:>+9.2f} {row['tpot_added_fraction']:>+9.1%}"
              f"   (goals: < {TTFT_GOAL_MS:.0f} ms {ok(row['meets_ttft_goal'])}, "
              f"< {TPOT_GOAL:.0%} {ok(row['meets_tpot_goal'])})")
        b = row["serve_grpc"]
        print(f"{row['mode']:<8} {'  in replica':<14} {b['server_side_ttft_ms_median']:>9.2f} "
              f"{b['server_side_tpot_ms_median']:>9.2f}   (engine timings inside the replica)")
        print(f"{row['mode']:<8} {'added, paired':<14} {row['ttft_added_ms_paired_median']:>+9.2f} "
              f"{row['tpot_added_fraction_paired_median']:>+9.1%}   (median of per-prompt differences)")
    print(f"GetModelInfo round trip through Serve + gRPC (no engine step): {unary_ms:.2f} ms median")
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
