"""Co-located vs prefill/decode-disaggregated serving on the same CPUs, open-loop load.

    python -m bench.bench_pd [--rates 0.3,0.8] [--duration 60] [--seeds 0,1] [--long-fraction 0.3]
        [--max-tokens 96] [--slo-ttft-ms 4000 --slo-tpot-ms 120] [--method draft]
        [--min-prompt-tokens 512] [--out PATH]

Each configuration runs on its own embedded Ray Serve with 2 CPUs (one at a time, the same host):
- colocated: 2 engine replicas x 1 CPU (each prefills and decodes its own requests);
- disaggregated: 1 prefill replica x 1 CPU + 1 decode replica x 1 CPU (long prompts are
  prefilled by the prefill replica and handed over with the drafter's state), the handoff by
  the default transport (`auto`: Ray's object store on CPUs);
- disaggregated_load_aware: the same with `max_inflight_prefills: N` (--max-inflight-prefills, 1:
  a long prompt arriving while the decode replica waits on N remote prefills, and prefills no such
  prompt itself already, is prefilled by the decode replica);
- disaggregated_nixl: the same, the handoff by NIXL through Ray Direct Transport;
- disaggregated_no_drafter_state (ablation): the handoff carries the target's KV only (default
  transport).
Speculation is on (the shipped drafter, adaptive), the ingress in front as in `make serve`.
Load: open-loop Poisson arrivals at each rate for --duration seconds; --long-fraction of the
prompts are 1.4-1.6k tokens of held-out code, the rest ~200; every prompt starts with a unique
line and each rate sends its own prompts, so no prefix-cache hits; greedy, --max-tokens new tokens (EOS ignored).
Per request: TTFT, TPOT ((last - first token) / (n - 1)), inter-token gaps, the longest stall.
Goodput: requests per second meeting both SLOs (--slo-*), and over a grid of TTFT x TPOT SLOs
(`goodput_grid`, so that no one SLO choice decides the comparison). Handoff bytes and ms come from
the decode replicas. Writes bench/results/<host>/pd.json (or --out), a PNG next to it, and prints a table.
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
PROMPTS_PER_RATE = 150  # more than any rate's arrivals in --duration: no prompt is sent twice in a run
CONFIGS = ("colocated", "disaggregated", "disaggregated_load_aware", "disaggregated_nixl",
           "disaggregated_no_drafter_state")


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
    longs = code_prompts(tok, n, 1500, seed=seed)
    shorts = code_prompts(tok, n, 200, seed=seed + 1)
    out = []
    for i in range(n):
        kind = "long" if rng.random() < long_fraction else "short"
        body = longs[i] if kind == "long" else shorts[i]
        unique = tok.encode(f"# request {seed}-{i}: {rng.getrandbits(40):x}\n", add_special_tokens=False)
        body = body[: rng.randint(len(body) - 100, len(body))] if kind == "long" else body
        out.append((kind, unique + body))
    return out


def prompt_seed(seed: int, rate: float) -> int:
    """The prompt sample of `seed` at `rate`: its own per rate, independent of the other rates run."""
    return seed * 100_003 + round(rate * 1000)


def start(config_name: str, port: int, method: str = "draft", min_prompt_tokens: int = 512, max_inflight_prefills: int = 1):
    import ray
    from ray import serve

    from bench.bench_serve import free_port as free_port_for_bench
    from deployments.app import bind_app
    from deployments.config import AppConfig

    args = {"max_num_seqs": 8, "max_queued_requests": 256, "max_prompt_tokens": 1900, "max_tokens": 512,
            "num_cpus": 1, "replica_wait_timeout_s": 600, "speculative": {"method": method}}
    if config_name.startswith("disaggregated"):
        args["mode"] = "disaggregated"
        args["disaggregation"] = {"min_prompt_tokens": min_prompt_tokens,
                                  "with_drafter_state": config_name != "disaggregated_no_drafter_state",
                                  "transport": "nixl" if config_name.endswith("nixl") else "auto",
                                  "max_inflight_prefills": max_inflight_prefills if config_name.endswith("load_aware") else None}
    config = AppConfig.from_dict(args)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port_for_bench()},
                grpc_options={"port": port, "grpc_servicer_functions": [
                    "deployments.servicer.add_SpecDecodeServicer_to_server"]})
    engine = {"ray_actor_options": {"num_cpus": 1}, "num_replicas": 2 if config_name == "colocated" else 1}
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
    from ray import serve

    try:
        return serve.get_deployment_handle("SpecDecode", app_name="pd").prefill_counts.remote().result(timeout_s=30)
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": str(e)}


def plot(report: dict, path: Path) -> None:
    """TPOT p99, longest-stall p95 and TTFT p95 per configuration and arrival rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    configs = [c for c in CONFIGS if any(k.startswith(c + "@") for k in results)]
    rates = sorted({float(k.split("@")[1]) for k in results})
    panels = [("TPOT p99 (s)", lambda r: r["tpot_s"]["p99"]), ("longest stall p95 (s)", lambda r: r["longest_stall_s"]["p95"]),
              ("TTFT p95 (s)", lambda r: r["ttft_s"]["p95"]), ("goodput (requests/s)", lambda r: r["goodput_rps"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    width = 0.8 / max(1, len(configs))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for i, c in enumerate(configs):
            ys = [value(results[f"{c}@{r}"]) if f"{c}@{r}" in results else 0 for r in rates]
            ax.bar([j + i * width for j in range(len(rates))], ys, width, label=c.replace("_", " "))
        ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(rates))], [f"{r}/s" for r in rates])
        ax.set_title(title)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("co-located (2 x 1 CPU) vs prefill/decode (1 + 1 CPU), Poisson arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(sources: list[str], out: str | None, slo: tuple[float, float]) -> dict:
    """Combine the results of several runs (`FILE` or `FILE:config,config` to take some of its
    configurations; a configuration at a rate may come from one file only), print a table per
    configuration and rate, and the highest rate at which each configuration served >= 90% of its
    requests within the SLO (goodput as DistServe defines it). Writes `out` (default:
    bench/results/<host>/pd.json) and its plot."""
    merged = {"benchmark": "pd_vs_colocated", "merged_from": sources, "results": {}}
    for source in sources:
        path, _, only = source.partition(":")
        report = json.loads(Path(path).read_text())
        merged.setdefault("args", report["args"])
        for key, summary in report["results"].items():
            if only and key.split("@")[0] not in only.split(","):
                continue
            if key in merged["results"]:
                raise SystemExit(f"{key} is in more than one of {sources}")
            merged["results"][key] = summary
    grid = f"ttft<={slo[0]:g}s,tpot<={round(slo[1] * 1e3)}ms"
    rows, best = [], {}
    for key in sorted(merged["results"], key=lambda k: (CONFIGS.index(k.split("@")[0]), float(k.split("@")[1]))):
        r = merged["results"][key]
        config, rate = key.split("@")
        shares = [seed["goodput_grid"][grid] * seed.get("duration", merged["args"]["duration"]) / max(1, seed["requests"])
                  for seed in r["per_seed"].values()]
        share = r["goodput_grid"][grid] * merged["args"]["duration"] * len(r["per_seed"]) / max(1, r["requests"])
        if share >= 0.9:
            best[config] = max(best.get(config, 0.0), float(rate))
        tpot = " / ".join(f"{r['tpot_s'][q] * 1e3:.0f}" for q in ("p50", "p95", "p99"))
        per_seed = ", ".join(f"{x:.0%}" for x in shares)
        loose = r["goodput_grid"][f"ttft<={slo[0]:g}s,tpot<=120ms"]
        rows.append(f"| {rate}/s | {config.replace('_', ' ')} | {r['ttft_s']['p95']:.2f} | {tpot} | "
                    f"{r['goodput_grid'][grid]:.2f} ({share:.0%}; seeds {per_seed}) | {loose:.2f} | "
                    f"{r['acceptance_mean']:.2f} |")
    print(f"| rate | placement | TTFT p95 (s) | TPOT p50 / p95 / p99 (ms) | goodput {slo[0]:g} s / "
          f"{slo[1] * 1e3:.0f} ms (share; per seed) | goodput {slo[0]:g} s / 120 ms | acceptance |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("highest rate with >= 90% of requests within the SLO:", best)
    merged["max_rate_90pct"] = best
    from bench.common import write_results

    out = write_results("pd", merged, out)
    plot(merged, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--merge", nargs="+", metavar="FILE[:CONFIGS]",
                   help="combine earlier runs' results into --out (no load is sent)")
    p.add_argument("--rates", default="0.3,0.8", help="arrival rates, requests/s")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--long-fraction", type=float, default=0.3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=120.0)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--method", default="draft", help="the drafter of every configuration (speculative.method)")
    p.add_argument("--min-prompt-tokens", type=int, default=512,
                   help="disaggregation.min_prompt_tokens: shorter prompts are prefilled by the decode replica")
    p.add_argument("--max-inflight-prefills", type=int, default=1,
                   help="disaggregated_load_aware: disaggregation.max_inflight_prefills")
    p.add_argument("--seeds", default="0", help="arrival/prompt samples, each run at every rate; the "
                   "results pool them (Poisson samples of a minute differ a lot), `per_seed` keeps each")
    p.add_argument("--out", default=None, help="result JSON (default: bench/results/<host>/pd.json)")
    args = p.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out, (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))
        return 0
    rates = [float(r) for r in args.rates.split(",")]
    configs = args.configs.split(",")
    from bench.bench_serve import free_port as free_port_for_bench

    seeds = [int(x) for x in args.seeds.split(",")]
    # Each (seed, rate) its own prompts, the same whatever other rates or configurations a run has
    # (so runs of one configuration at a time compare), none shared between rates (no cache hits).
    prompts = {(seed, rate): build_prompts(PROMPTS_PER_RATE, args.long_fraction, prompt_seed(seed, rate))
               for seed in seeds for rate in rates}
    report = {"benchmark": "pd_vs_colocated", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
              "args": vars(args), "results": {}}
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    for name in configs:
        port = free_port_for_bench()
        start(name, port, args.method, args.min_prompt_tokens, args.max_inflight_prefills)
        try:
            for rate in rates:
                pooled, per_seed = [], {}
                for seed in seeds:
                    # each rate its own prompts: a prompt seen at an earlier rate would hit the cache
                    results = run_load(port, prompts[(seed, rate)], rate, args.duration, args.max_tokens, seed)
                    pooled += results
                    per_seed[seed] = summarize(results, args.duration, *slo)
                    print(f"{name} @ {rate}/s, seed {seed}: {json.dumps({k: v for k, v in per_seed[seed].items() if k != 'per_request'})}",
                          flush=True)
                    time.sleep(5)
                summary = summarize(pooled, args.duration * len(seeds), *slo)
                summary.pop("per_request")  # (in per_seed)
                summary["per_seed"] = per_seed
                if name != "colocated":
                    summary["prefills"] = handoff_stats()  # cumulative over this config's rates
                    ms, ttft_long = summary["prefills"].get("handoff_ms_median"), summary.get("ttft_long_p50_s")
                    if ms is not None and ttft_long:
                        summary["handoff_share_of_long_ttft"] = ms / 1e3 / ttft_long
                report["results"][f"{name}@{rate}"] = summary
        finally:
            stop()
    from bench.common import write_results

    out = write_results("pd", report, args.out)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
