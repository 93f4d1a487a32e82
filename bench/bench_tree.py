"""Chains vs token trees, side by side in one run, on the shipped target and drafters (bf16, CPU).

For each tree-capable shipped drafter (the draft model, the EAGLE head): fixed chains of k = 5
and 8, the adaptive chain (k <= 6, the default), fixed dynamic trees (nodes / width / depth; at
the drafter's calibrated ranking temperature, one at T = 1, EAGLE-2's plain ranking, one with a
value floor, `tree_min_prob`, and a width-1 tree with one: a chain cut by confidence) and the
adaptive choice between trees, chains and no drafts (`SpeculativeConfig.tree_nodes` with
adaptive=True; with the policy's floor, the default, and without), next to no speculation. Loads: batch 1 (the prompts one at a time), 4 and 16
concurrent (submitted together); workloads: held-out code, greedy, and the same prompts sampled
at temperature 1 (unpredictable). Every configuration is loaded first; repetitions interleave
them (order reversed every other one); rows report medians and the median per-repetition ratio
to the adaptive chain of the same drafter. Per row: tokens/s, mean accepted length (tokens per
verification), the share of verifications that were trees, and per speculating step the
target's verify time (forward + sampling) and the drafting time.

    python -m bench.bench_tree [--repeats 3] [--prompts 4] [--new-tokens 96]

Writes bench/results/<host>/<--name>.json and its plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import bench.bench_spec as bench_spec
from bench.bench_spec import METHODS, params_for
from bench.common import MODELS, code_prompts, machine_info, result_path, table, timed, write_results
from engine import LLM, SamplingParams, SpeculativeConfig

# name -> (nodes, width, depth, tree_temperature: None = the drafter's calibration, 1.0 = EAGLE-2's
# plain ranking, tree_min_prob: the value floor, 0 = none). 15 nodes: with the root, 16 verified
# tokens, one AMX tile of rows (a 17th token takes a second tile).
# Width 1 with a floor: a chain cut where its calibrated confidence falls below the floor.
TREES = {"tree 15/2/10": (15, 2, 10, None, 0.0), "tree 15/2/10, T=1": (15, 2, 10, 1.0, 0.0),
         "tree 24/2/12": (24, 2, 12, None, 0.0), "tree 16/4/6": (16, 4, 6, None, 0.0),
         "tree 15/2/10, floor 0.3": (15, 2, 10, None, 0.3), "chain cut at 0.3 (15/1/15)": (15, 1, 15, None, 0.3)}
LOADS = {"batch 1": 1, "4 concurrent": 4, "16 concurrent": 16}


def configs(methods: list[str]) -> dict[str, tuple[str | None, dict]]:
    """name -> (method, SpeculativeConfig keyword arguments)."""
    out: dict[str, tuple[str | None, dict]] = {"no speculation": (None, {})}
    for m in methods:
        out[f"{m}, chain k=5"] = (m, dict(num_speculative_tokens=5, adaptive=False))
        out[f"{m}, chain k=8"] = (m, dict(num_speculative_tokens=8, adaptive=False))
        out[f"{m}, adaptive chain"] = (m, dict(num_speculative_tokens=6, adaptive=True))
        for name, (n, w, d, t, f) in TREES.items():
            out[f"{m}, {name}"] = (m, dict(num_speculative_tokens=d, adaptive=False, tree_nodes=n, tree_width=w,
                                          tree_depth=d, tree_temperature=t, tree_min_prob=f))
        # the policy chooses trees, chains or no drafts each step; greedy trees take its value
        # floor (the default), or, with tree_min_prob=0, are sized by its acceptance models
        out[f"{m}, adaptive tree 15/2/10 or chain"] = (m, dict(num_speculative_tokens=8, adaptive=True, tree_nodes=15,
                                                               tree_width=2, tree_depth=10))
        out[f"{m}, adaptive tree 15/2/10 or chain, no floor"] = (
            m, dict(num_speculative_tokens=8, adaptive=True, tree_nodes=15, tree_width=2, tree_depth=10,
                    tree_min_prob=0.0))
    return out


def make(method: str | None, kw: dict, max_num_seqs: int) -> LLM:
    spec = SpeculativeConfig(method=method, model=METHODS[method], **kw) if method else None
    return LLM(str(MODELS / "target"), dtype="bfloat16", device=bench_spec.DEVICE, speculative=spec, max_num_seqs=max_num_seqs,
               enable_prefix_caching=False, kv_cache_memory_bytes=96 << 20)


def run(llm: LLM, prompts, workload: str, new_tokens: int, concurrent: bool) -> dict:
    before = llm.engine.spec_stats.as_dict()
    if concurrent:
        _, total = timed(lambda: llm.generate(prompts, [params_for(workload, new_tokens, i) for i in range(len(prompts))]))
    else:
        total = 0.0
        for i, p in enumerate(prompts):
            total += timed(lambda p=p, i=i: llm.generate([p], params_for(workload, new_tokens, i)))[1]
    after = llm.engine.spec_stats.as_dict()
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    steps = d["num_verify_steps"]
    return {
        "tokens_per_s": len(prompts) * new_tokens / total,
        "mean_accepted_length": (d["num_accepted_tokens"] + steps) / steps if steps else None,
        "tree_share": d["num_tree_steps"] / steps if steps else None,
        "nodes_per_tree": d["num_tree_nodes"] / d["num_tree_steps"] if d["num_tree_steps"] else None,
        "verify_ms_per_step": 1e3 * d["verify_time_s"] / steps if steps else None,
        "draft_ms_per_step": 1e3 * d["draft_time_s"] / steps if steps else None,
    }


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(len(workloads), len(LOADS), figsize=(5 * len(LOADS), 4.2 * len(workloads)), squeeze=False)
    for i, w in enumerate(workloads):
        for j, load in enumerate(LOADS):
            sub = [r for r in rows if r["workload"] == w and r["load"] == load]
            ax = axes[i][j]
            colors = ["#9e9e9e" if r["system"] == "no speculation" else "#1f78b4" if "chain" in r["system"]
                      and "tree" not in r["system"] else "#33a02c" for r in sub]
            ax.barh([r["system"] for r in sub], [r["tokens_per_s"] for r in sub], color=colors)
            ax.invert_yaxis()
            ax.set_title(f"{w}, {load}", fontsize=10)
            ax.set_xlabel("tokens/s")
            ax.tick_params(axis="y", labelsize=7, labelleft=j == 0)
    fig.suptitle("Chains (blue) vs trees (green), shipped target + drafters, bf16, 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="draft,eagle3,mtp")
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--prompts-from", default=None,
                    help="token-id prompts from a JSON file (`bench.bench_gpu pack`): its batch-1 set and the "
                         "first n of its concurrent set")
    ap.add_argument("--name", default="spec_tree")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the configurations whose name has "
                    "one (no speculation and each drafter's adaptive chain, the references, always run)")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from bench/results/<host>/<name>.json")
    args = ap.parse_args(argv)
    if args.replot:
        out = json.loads(result_path(args.name).read_text())
        plot(out["rows"], result_path(args.name, ".png"))
        return out
    torch.set_num_threads(args.threads)
    bench_spec.DEVICE = args.device
    loads = [load for load in args.loads.split(",") if load]
    if args.prompts_from is not None:
        sets = json.loads(Path(args.prompts_from).read_text())
        prompts = {load: sets["prompts"] if LOADS[load] == 1 else sets["batch"][: LOADS[load]] for load in loads}
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(MODELS / "target"))
        # (code_prompts draws in order: the first n of seed 2's 16 are its n)
        prompts = {load: code_prompts(tokenizer, args.prompts if LOADS[load] == 1 else LOADS[load], args.prompt_len,
                                      seed=1 if LOADS[load] == 1 else 2) for load in loads}
    cfgs = configs([m for m in args.methods.split(",") if m])
    if args.only:
        keep = [s for s in args.only.split(",") if s]
        cfgs = {n: c for n, c in cfgs.items()
                if n == "no speculation" or n.endswith("adaptive chain") or any(s in n for s in keep)}
    llms = {}
    for name, (method, kw) in cfgs.items():
        llms[name] = make(method, kw, max(LOADS[load] for load in loads))
        llms[name].generate([prompts[loads[0]][0]], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        print(f"loaded {name}", flush=True)
    runs: dict = {}
    order = list(cfgs)
    for rep in range(args.repeats):
        for name in (order if rep % 2 == 0 else order[::-1]):
            for workload in ("code", "unpredictable"):
                for load in loads:
                    r = run(llms[name], prompts[load], workload, args.new_tokens, concurrent=LOADS[load] > 1)
                    runs.setdefault((name, workload, load), []).append(r)
        print(f"repetition {rep + 1}/{args.repeats} done", flush=True)
    rows = []
    for (name, workload, load), results in runs.items():
        method = cfgs[name][0]
        ref = runs[(f"{method}, adaptive chain" if method else name, workload, load)]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results, ref, strict=True)]
        base = runs[("no speculation", workload, load)]
        row = {"system": name, "workload": workload, "load": load, "repeats": len(results),
               "ratio_vs_adaptive_chain": statistics.median(ratios),
               "ratio_vs_no_spec": statistics.median(r["tokens_per_s"] / b["tokens_per_s"]
                                                     for r, b in zip(results, base, strict=True))}
        for key in results[0]:
            vals = [r[key] for r in results if r[key] is not None]
            row[key] = statistics.median(vals) if vals else None
        rows.append(row)
    cols = ["system", "workload", "load", "tokens_per_s", "ratio_vs_no_spec", "ratio_vs_adaptive_chain",
            "mean_accepted_length", "tree_share", "verify_ms_per_step", "draft_ms_per_step"]
    print(table(rows, cols))
    # the adaptive tree configurations: the widths the policy planned (over every run) and the
    # engine-wide sibling rates it measured (P(rank-j child accepted | lower ranks not), j = 1..3)
    policy = {}
    for name, llm in llms.items():
        sp = llm.engine.speculator
        if sp is not None and sp.config.uses_tree and sp.config.adaptive:
            policy[name] = {"planned_widths": dict(sorted(sp.trees.width_counts.items())),
                            "sibling_rates": [round(sp.trees.sibling_acceptance.rate(j), 3) for j in range(1, 4)],
                            "tree_steps": sp.num_tree_steps, "steps_on": sp.num_steps_on,
                            "last_floor": round(sp.trees.adaptive_floor, 3) if sp.trees.floors_trees else None,
                            "floored_accepted_per_tree": round(sp.trees.floored_acceptance.mean(), 2),
                            "floored_nodes_per_tree": round(sp.trees.floored_acceptance.mean_nodes(15), 2)}
            print(name, policy[name])
    png = result_path(args.name, ".png")
    plot(rows, png)
    out = {"machine": machine_info(), "args": vars(args), "rows": rows, "policy": policy, "plot": str(png)}
    print(write_results(args.name, out))
    return out


if __name__ == "__main__":
    main()
