"""The adaptive speculation policy against fixed draft lengths, batch 1, interleaved.

    python -m bench.bench_adaptive [--method eagle3] [--ks 3,5] [--cap 6] [--prompts 4]
        [--new-tokens 96] [--reps 3] [--name adaptive]

The shipped target and drafter (bench_spec's configuration: bf16, one torch thread, no prefix
caching), held-out code prompts, greedy: no speculation, the adaptive policy (k <= --cap) and each
fixed k of --ks, every engine loaded first, then --reps rounds over the prompts in alternating
order. Reports tokens/s (median of the rounds, with prefill, as bench_spec's batch-1 figure),
each over no speculation, and the mean accepted length. The policy should come close to the best
fixed k without knowing it in advance; a large gap means its cost model or acceptance estimates
are off (the start-up profile's curve is written out with the results).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.bench_spec import make_llm
from bench.common import code_prompts, machine_info, write_results
from engine import SamplingParams


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--ks", default="3,5", help="fixed draft lengths to compare")
    ap.add_argument("--cap", type=int, default=6, help="the adaptive policy's k cap")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="adaptive", help="results: bench/results/<host>/<name>.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    configs = {"no speculation": (None, 1, False), f"adaptive (k <= {args.cap})": (args.method, args.cap, True)}
    configs |= {f"k = {k}": (args.method, k, False) for k in (int(x) for x in args.ks.split(",") if x)}
    llms = {name: make_llm(m, k, adaptive, 1) for name, (m, k, adaptive) in configs.items()}
    base = llms["no speculation"]
    prompts = code_prompts(base.tokenizer, args.prompts, 128, seed=1)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    rates: dict[str, list[float]] = {n: [] for n in llms}
    accepted: dict[str, list[float]] = {n: [] for n in llms}
    texts: dict[str, list[list[int]]] = {}
    for rep in range(args.reps):
        for name in (list(llms) if rep % 2 == 0 else list(llms)[::-1]):
            t0, tokens, outs = time.perf_counter(), 0, []
            for p in prompts:
                out = llms[name].generate([p], params)[0]
                tokens += len(out.token_ids)
                outs.append(out.token_ids)
                if configs[name][0] is not None and out.spec_stats:
                    accepted[name].append(out.spec_stats["mean_accepted_length"])
            rates[name].append(tokens / (time.perf_counter() - t0))
            texts.setdefault(name, outs)
        print(f"round {rep + 1}/{args.reps} done", flush=True)
    none = statistics.median(rates["no speculation"])
    rows = [{"system": n, "tokens_per_s": statistics.median(r), "vs_no_spec": statistics.median(r) / none,
             "min": min(r), "max": max(r),
             "mean_accepted_length": statistics.mean(accepted[n]) if accepted[n] else None,
             "text_equals_no_spec": texts[n] == texts["no speculation"]} for n, r in rates.items()]
    for r in rows:
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"{r['system']:<22}{r['tokens_per_s']:>9.1f} tokens/s {r['vs_no_spec']:>6.2f}x  "
              f"accepted length {mal:>5}  same text: {r['text_equals_no_spec']}")
    speculator = llms[f"adaptive (k <= {args.cap})"].engine.speculator
    results = {"benchmark": "adaptive", "machine": machine_info(), "args": vars(args), "rows": rows,
               "startup_step_ms": {k: v * 1e3 for k, v in speculator.cost.as_dict().items()},
               "calibration": speculator.calibration.as_dict()}
    print(f"wrote {write_results(args.name, results)}")
    return results


if __name__ == "__main__":
    main()
