"""Co-located vs prefill/decode-disaggregated serving on the same CPUs, open-loop load, over
prompt mixes and arrival rates.

    python -m bench.bench_pd [--mixes 0.1,0.3,0.5] [--rates 1,2,3,4,5] [--duration 60]
        [--seeds 0] [--max-tokens 96] [--slo-ttft-ms 4000 --slo-tpot-ms 50] [--method eagle3]
        [--configs colocated,disaggregated] [--out PATH]

Each configuration runs on its own embedded Ray Serve with 2 CPUs (one at a time, the same host),
its replicas scheduling to the SLO the run measures against (`slo: {ttft_ms, tpot_ms}` from
--slo-*: stall-free chunked prefill in every placement within the TPOT budget, the placement's
TTFT budget), as a deployment given that SLO would be configured:
- colocated: 2 engine replicas x 1 CPU (each prefills and decodes its own requests);
- colocated_unchunked: the same without stall-free chunking (`slo.tpot_ms: null`: a long
  prompt is prefilled in one step, stalling the replica's streams for all of it);
- disaggregated: 1 prefill replica x 1 CPU + 1 decode replica x 1 CPU; each long prompt's
  prefill placed by predicted TTFT (deployments/placement.py: the pool while both sides are
  within the budget, else the faster side) and handed over with the drafter's state;
- disaggregated_pool_decodes (ablation): the same, a prefill replica with nothing else to
  prefill decoding the request itself while it runs fewer than 2 streams (`pool_max_streams`);
- disaggregated_always_remote: the same with every long prompt sent to the pool (a TTFT budget
  no prediction exceeds), to show what the placement buys;
- disaggregated_nixl: the handoff by NIXL through Ray Direct Transport;
- disaggregated_no_drafter_state (ablation): the handoff carries the target's KV only.
Speculation is on (--method, adaptive), the ingress in front as in `make serve`.
Load: open-loop Poisson arrivals at each rate for --duration seconds; in each mix that fraction
of the prompts are 1000-1900 tokens of held-out code, the rest ~200; every prompt starts with a
unique line and each (mix, rate) sends its own prompts, so no prefix-cache hits; greedy,
--max-tokens new tokens (EOS ignored). Seeds and the SLO are fixed before the run (arguments).
Per request: TTFT, TPOT ((last - first token) / (n - 1)), inter-token gaps, the longest stall.
Goodput: requests per second meeting both SLOs (--slo-*), and over a grid of TTFT x TPOT SLOs
(`goodput_grid`, so that no one SLO choice decides the comparison); per mix, the highest rate at
which >= 90% of requests met the SLO (DistServe's goodput). Placements and handoffs come from the
decode replicas. Writes bench/results/<host>/pd.json (or --out), a PNG next to it, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def num_prompts(rate: float, duration: float) -> int:
    """Prompts for one cell: more than its Poisson arrivals will be (no prompt is sent twice)."""
    return int(rate * duration * 1.5) + 30
CONFIGS = ("colocated", "colocated_unchunked", "disaggregated", "disaggregated_pool_decodes",
           "disaggregated_always_remote", "disaggregated_nixl", "disaggregated_no_drafter_state")
LONG_TOKENS = (1000, 1900)  # a long prompt's length, uniform (the model's limit is 2048 with the output)


@dataclass
class Result:
    kind: str  # long | short
    arrival: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    acceptance: float = 0.0
    num_draft: int = 0

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def build_prompts(n: int, long_fraction: float, seed: int) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    from bench.common import code_prompts

    tok = AutoTokenizer.from_pretrained(str(REPO_ROOT / "models" / "target"))
    rng = random.Random(seed)
    longs = code_prompts(tok, n, LONG_TOKENS[1], seed=seed)
    shorts = code_prompts(tok, n, 200, seed=seed + 1)
    out = []
    for i in range(n):
        kind = "long" if rng.random() < long_fraction else "short"
        body = longs[i] if kind == "long" else shorts[i]
        unique = tok.encode(f"# request {seed}-{i}: {rng.getrandbits(40):x}\n", add_special_tokens=False)
        body = body[: rng.randint(*LONG_TOKENS)] if kind == "long" else body
        out.append((kind, unique + body))
    return out


def prompt_seed(seed: int, mix: float, rate: float) -> int:
    """The prompt sample of `seed` for (mix, rate): its own, independent of the other cells run."""
    return seed * 100_003 + round(mix * 1000) * 7919 + round(rate * 1000)


def start(config_name: str, port: int, method: str = "eagle3", min_prompt_tokens: int = 256,
          slo_ms: tuple[float, float] = (4000.0, 50.0)):
    import ray
    from ray import serve

    from bench.bench_serve import free_port as free_port_for_bench
    from deployments.app import bind_app
    from deployments.config import AppConfig

    args = {"max_num_seqs": 16, "max_queued_requests": 256, "max_prompt_tokens": 1940, "max_tokens": 512,
            "num_cpus": 1, "replica_wait_timeout_s": 600, "speculative": {"method": method},
            "slo": {"ttft_ms": slo_ms[0], "tpot_ms": slo_ms[1]}}
    if config_name == "colocated_unchunked":
        args["slo"]["tpot_ms"] = None
    if config_name.startswith("disaggregated"):
        args["mode"] = "disaggregated"
        args["disaggregation"] = {"min_prompt_tokens": min_prompt_tokens,
                                  "with_drafter_state": config_name != "disaggregated_no_drafter_state",
                                  "transport": "nixl" if config_name.endswith("nixl") else "auto",
                                  "pool_max_streams": 2 if config_name == "disaggregated_pool_decodes" else 0}
        if config_name == "disaggregated_always_remote":
            args["slo"]["ttft_ms"] = 3.6e6
    config = AppConfig.from_dict(args)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port_for_bench()},
                grpc_options={"port": port, "grpc_servicer_functions": [
                    "deployments.servicer.add_SpecDecodeServicer_to_server"]})
    engine = {"ray_actor_options": {"num_cpus": 1}, "num_replicas": 2 if config_name.startswith("colocated") else 1}
    prefill = {"ray_actor_options": {"num_cpus": 1}, "num_replicas": 1}
    serve.run(bind_app(config, engine, prefill_overrides=prefill), name="pd", route_prefix="/pd")


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def run_load(port: int, prompts, rate: float, duration: float, max_tokens: int, seed: int,
             offset: int = 0) -> list[Result]:
    """Poisson arrivals at `rate` for `duration` s of prompts[offset], prompts[offset + 1], ..."""
    from deployments.client import SpecDecodeClient

    rng = random.Random(seed)
    results: list[Result] = []
    threads = []
    t0 = time.perf_counter()
    next_at = 0.0
    i = 0
    while next_at < duration:
        delay = t0 + next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        kind, ids = prompts[(offset + i) % len(prompts)]
        r = Result(kind, time.perf_counter())
        results.append(r)

        def go(r: Result = r, ids: list[int] = ids) -> None:
            try:
                with SpecDecodeClient(f"127.0.0.1:{port}", application="pd", timeout=900) as client:
                    for m in client.generate(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                        now = time.perf_counter()
                        r.token_times.extend([now] * len(m.token_ids))
                        if m.finish_reason:
                            r.acceptance = m.speculation.acceptance_rate
                            r.num_draft = m.speculation.num_draft_tokens
            except Exception as e:  # noqa: BLE001 - recorded
                r.error = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=go)
        t.start()
        threads.append(t)
        i += 1
        next_at += rng.expovariate(rate)
    for t in threads:
        t.join(1800)
    return results


SLO_GRID_TTFT_S = (2.0, 4.0, 8.0)
SLO_GRID_TPOT_MS = (30, 50, 80, 120)


def goodput(ok: list[Result], duration: float, slo_ttft: float, slo_tpot: float) -> float:
    """Requests per second that met both SLOs (a one-token request meets any TPOT SLO)."""
    return sum(1 for r in ok if r.ttft <= slo_ttft and (r.tpot or 0) <= slo_tpot) / duration


def summarize(results: list[Result], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    gaps = [g for r in ok for g in r.gaps]
    stalls = [max(r.gaps) for r in ok if r.gaps]
    drafted = [r for r in ok if r.num_draft]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "ttft_s": {"p50": pct(ttft, 50), "p95": pct(ttft, 95), "p99": pct(ttft, 99)},
        "ttft_long_p50_s": pct([r.ttft for r in ok if r.kind == "long"], 50),
        "ttft_short_p50_s": pct([r.ttft for r in ok if r.kind == "short"], 50),
        "tpot_s": {"p50": pct(tpot, 50), "p95": pct(tpot, 95), "p99": pct(tpot, 99)},
        "itl_s": {"p99": pct(gaps, 99), "p99.9": pct(gaps, 99.9)},
        "longest_stall_s": {"p50": pct(stalls, 50), "p95": pct(stalls, 95), "max": max(stalls, default=float("nan"))},
        "goodput_rps": goodput(ok, duration, slo_ttft, slo_tpot),
        "goodput_fraction": goodput(ok, duration, slo_ttft, slo_tpot) * duration / max(1, len(results)),
        "goodput_grid": {f"ttft<={a:g}s,tpot<={b}ms": goodput(ok, duration, a, b / 1e3)
                         for a in SLO_GRID_TTFT_S for b in SLO_GRID_TPOT_MS},
        "acceptance_mean": statistics.mean(r.acceptance for r in drafted) if drafted else 0.0,
        # each request: kind, arrival (s after the first), TTFT (s), TPOT (ms), longest stall (s)
        "per_request": [[r.kind, round(r.arrival - results[0].arrival, 3), r.ttft and round(r.ttft, 3),
                         r.tpot and round(r.tpot * 1e3, 2), r.gaps and round(max(r.gaps), 3), r.error]
                        for r in results],
    }


def handoff_stats() -> dict:
    """How the decode replica's requests were prefilled, and how many the prefill replica decoded
    itself (`pool_decoded`: it had room, so no handoff)."""
    from ray import serve

    try:
        out = serve.get_deployment_handle("SpecDecode", app_name="pd").prefill_counts.remote().result(timeout_s=30)
        pool = serve.get_deployment_handle("SpecDecodePrefill", app_name="pd").prefill_counts.remote().result(
            timeout_s=30)
        out["pool_decoded"] = pool.get("pool_decoded", 0)
        return out
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": str(e)}


def cell(key: str) -> tuple[str, float, float]:
    """A result key `config@mix@rate` as (config, mix, rate)."""
    config, mix, rate = key.split("@")
    return config, float(mix), float(rate)


def plot(report: dict, path: Path) -> None:
    """Per mix (rows): TTFT p95, TPOT p99, longest stall p95 and goodput against the arrival rate,
    one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    mixes = sorted({cell(k)[1] for k in results})
    configs = [c for c in CONFIGS if any(cell(k)[0] == c for k in results)]
    panels = [("TTFT p95 (s)", lambda r: r["ttft_s"]["p95"]), ("TPOT p99 (ms)", lambda r: r["tpot_s"]["p99"] * 1e3),
              ("longest stall p95 (s)", lambda r: r["longest_stall_s"]["p95"]),
              ("goodput (requests/s)", lambda r: r["goodput_rps"])]
    fig, axes = plt.subplots(len(mixes), len(panels), figsize=(4 * len(panels), 3.0 * len(mixes)), squeeze=False)
    for row, mix in zip(axes, mixes, strict=True):
        for ax, (title, value) in zip(row, panels, strict=True):
            for c in configs:
                points = sorted((cell(k)[2], value(r)) for k, r in results.items() if cell(k)[:2] == (c, mix))
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=c.replace("_", " "))
            ax.set_title(f"{title}, {mix:.0%} long", fontsize=9)
            ax.set_xlabel("arrival rate (requests/s)", fontsize=8)
            if "TTFT" in title:
                ax.set_yscale("log")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("co-located (2 x 1 CPU) vs prefill/decode (1 + 1 CPU), Poisson arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(report: dict, slo: tuple[float, float]) -> dict:
    """Print every cell and, per mix, the highest rate at which each configuration served >= 90%
    of its requests within the SLO and how disaggregated compares with co-located at each rate;
    returns {"max_rate_90pct": {mix: {config: rate}}, "vs_colocated": {mix: {rate: ratios}}}."""
    results = report["results"]
    grid = f"ttft<={slo[0]:g}s,tpot<={round(slo[1] * 1e3)}ms"
    print(f"| long share | rate | placement | TTFT p95 (s) | TPOT p50 / p99 (ms) | longest stall p95 (s) | "
          f"goodput {slo[0]:g} s / {slo[1] * 1e3:.0f} ms (share) | placed remote / local | acceptance |")
    print("|---|---|---|---|---|---|---|---|---|")
    best: dict[str, dict[str, float]] = {}
    for key in sorted(results, key=lambda k: (cell(k)[1], cell(k)[2], CONFIGS.index(cell(k)[0]))):
        r = results[key]
        config, mix, rate = cell(key)
        share = r["goodput_grid"][grid] * r["duration_s"] / max(1, r["requests"])
        if share >= 0.9:
            best.setdefault(f"{mix:g}", {})[config] = max(best.get(f"{mix:g}", {}).get(config, 0.0), rate)
        prefills = r.get("prefills", {})
        placed = (f"{prefills.get('remote', 0)} / {sum(v for k, v in prefills.items() if k.startswith('local_'))}"
                  if prefills else "-")
        print(f"| {mix:.0%} | {rate:g}/s | {config.replace('_', ' ')} | {r['ttft_s']['p95']:.2f} | "
              f"{r['tpot_s']['p50'] * 1e3:.0f} / {r['tpot_s']['p99'] * 1e3:.0f} | {r['longest_stall_s']['p95']:.2f} | "
              f"{r['goodput_grid'][grid]:.2f} ({share:.0%}) | {placed} | {r['acceptance_mean']:.2f} |")
    ratios: dict[str, dict[str, dict]] = {}
    for key, r in results.items():
        config, mix, rate = cell(key)
        base = results.get(f"colocated@{mix:g}@{rate:g}")
        if config != "disaggregated" or base is None:
            continue
        ratios.setdefault(f"{mix:g}", {})[f"{rate:g}"] = {
            "ttft_p95_ratio": r["ttft_s"]["p95"] / base["ttft_s"]["p95"],
            "tpot_p99_ratio": r["tpot_s"]["p99"] / base["tpot_s"]["p99"],
            "goodput_ratio": r["goodput_grid"][grid] / base["goodput_grid"][grid] if base["goodput_grid"][grid] else None,
        }
    print("highest rate with >= 90% of requests within the SLO, per long share:", best)
    print("disaggregated / co-located, per long share and rate:", json.dumps(ratios, indent=1))
    return {"max_rate_90pct": best, "vs_colocated": ratios}


def merge(sources: list[str], out: str | None, slo: tuple[float, float]) -> dict:
    """Combine the results of several runs (`FILE` or `FILE:config,config` to take some of its
    configurations; a cell may come from one file only), print the table, write `out` (default:
    bench/results/<host>/pd.json) and its plot."""
    merged = {"benchmark": "pd_vs_colocated", "merged_from": sources, "results": {}}
    for source in sources:
        path, _, only = source.partition(":")
        report = json.loads(Path(path).read_text())
        merged.setdefault("args", report["args"])
        for key, summary in report["results"].items():
            if only and cell(key)[0] not in only.split(","):
                continue
            if key in merged["results"]:
                raise SystemExit(f"{key} is in more than one of {sources}")
            merged["results"][key] = summary
    merged.update(table(merged, slo))
    from bench.common import write_results

    out = write_results("pd", merged, out)
    plot(merged, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--merge", nargs="+", metavar="FILE[:CONFIGS]",
                   help="combine earlier runs' results into --out (no load is sent)")
    p.add_argument("--mixes", default="0.1,0.3,0.5", help="shares of long prompts, one load per share")
    p.add_argument("--rates", default="1,2,3,4,5", help="arrival rates, requests/s")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--configs", default="colocated,disaggregated")
    p.add_argument("--method", default="eagle3", help="the drafter of every configuration (speculative.method)")
    p.add_argument("--min-prompt-tokens", type=int, default=256,
                   help="disaggregation.min_prompt_tokens: shorter prompts are prefilled by the decode replica")
    p.add_argument("--seeds", default="0", help="arrival/prompt samples, each run in every cell; the "
                   "results pool them, `per_seed` keeps each")
    p.add_argument("--out", default=None, help="result JSON (default: bench/results/<host>/pd.json)")
    args = p.parse_args(argv)
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    if args.merge:
        merge(args.merge, args.out, slo)
        return 0
    mixes = [float(m) for m in args.mixes.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    from bench.bench_serve import free_port as free_port_for_bench

    seeds = [int(x) for x in args.seeds.split(",")]
    # Each (seed, mix, rate) its own prompts, the same whatever else a run has (so runs of one
    # configuration at a time compare), none shared between cells (no cache hits).
    prompts = {(seed, mix, rate): build_prompts(num_prompts(rate, args.duration), mix, prompt_seed(seed, mix, rate))
               for seed in seeds for mix in mixes for rate in rates}
    report = {"benchmark": "pd_vs_colocated", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
              "args": vars(args), "results": {}}
    for name in configs:
        port = free_port_for_bench()
        start(name, port, args.method, args.min_prompt_tokens, (args.slo_ttft_ms, args.slo_tpot_ms))
        try:
            for mix in mixes:
                for rate in rates:
                    pooled, per_seed = [], {}
                    for seed in seeds:
                        results = run_load(port, prompts[(seed, mix, rate)], rate, args.duration, args.max_tokens, seed)
                        pooled += results
                        per_seed[seed] = summarize(results, args.duration, *slo)
                        brief = {k: v for k, v in per_seed[seed].items() if k not in ("per_request", "goodput_grid")}
                        print(f"{name} @ {mix:.0%} long, {rate}/s, seed {seed}: {json.dumps(brief)}", flush=True)
                        time.sleep(5)
                    summary = summarize(pooled, args.duration * len(seeds), *slo)
                    summary.pop("per_request")  # (in per_seed)
                    summary["per_seed"] = per_seed
                    summary["duration_s"] = args.duration * len(seeds)
                    if name.startswith("disaggregated"):
                        summary["prefills"] = handoff_stats()  # cumulative over this configuration's cells
                        ms, ttft_long = summary["prefills"].get("handoff_ms_median"), summary.get("ttft_long_p50_s")
                        if ms is not None and ttft_long:
                            summary["handoff_share_of_long_ttft"] = ms / 1e3 / ttft_long
                    report["results"][f"{name}@{mix:g}@{rate:g}"] = summary
                    write_partial(report, args.out)
        finally:
            stop()
    report.update(table(report, slo))
    from bench.common import write_results

    out = write_results("pd", report, args.out)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def write_partial(report: dict, out: str | None) -> None:
    """The cells so far, in runs/ (git-ignored; named after --out when given): a long run that stops
    early keeps them, and no partial file lands among the checked-in results."""
    from bench.common import write_results

    name = "pd_partial.json" if out is None else f"{Path(out).stem}_partial.json"
    write_results("pd_partial", report, REPO_ROOT / "runs" / name)


if __name__ == "__main__":
    sys.exit(main())
