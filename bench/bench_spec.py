"""Speculative decoding benchmark, in one run, on the shipped target and drafters (bf16, this CPU).

Workloads: held-out code completion, greedy (predictable), and the same prompts sampled at
temperature 1.0 (unpredictable). Peers on the same weights and prompts: our engine without
speculation, transformers `generate`, transformers assisted generation
(`generate(assistant_model=drafter)`), and our engine with each drafter (draft, ngram, eagle3, mtp).
Part 1: adaptive speculation, each model drafter over its shipped draft vocabulary, plus (batch
1, code) the same drafter over the whole vocabulary, under three loads: batch 1 (one request at a
time), 16 at once (16 requests submitted together; the run ends with its slowest request), and 16
sustained (64 requests through 16 slots: a finished request's slot takes the next one, as under
steady load). Every configuration is loaded and warmed up first (`--warm-up` untimed requests on
other held-out prompts), then the loads run `--repeats` times with the
configurations interleaved (order reversed every other repetition); a row reports the median
tokens/s and the median of the per-repetition ratios to no speculation, so drift of the shared
host hits both sides of a ratio alike. tokens/s counts each run end to end, prompts' prefill
included (speculation does not speed prefill up); `tpot_ms` is the median request's time per output
token after its first (prefill excluded) and `tpot_ratio_vs_no_spec` no speculation's over it, the
decoding speed-up alone. Part 2 (`--sweep`): each
method at fixed k = 1..8 (per-request cap), batch 1 and 16 concurrent, both workloads; PNGs of
tokens/s vs k and accepted length vs k.

    python -m bench.bench_spec [--sweep] [--prompts 4] [--new-tokens 96]

Writes bench/results/<host>/<--name>.json (and the sweep's <--sweep-name>.json) with the plots beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from bench.common import MODELS, code_prompts, machine_info, result_path, table, timed, write_results
from engine import LLM, SamplingParams, SpeculativeConfig

METHODS = {
    "draft": str(MODELS / "drafter"),
    "ngram": None,
    "eagle3": str(MODELS / "eagle3-head"),
    # the shipped target carries its MTP layer in its own checkpoint: no drafter folder
    "mtp": str(MODELS / "target"),
    # not shipped (EAGLE-3 and MTP replaced them): measured when `python -m training eagle` /
    # `medusa` has written the folder
    "eagle": str(MODELS / "eagle-head"),
    "medusa": str(MODELS / "medusa-heads"),
}


# where every system runs: "cpu" (the default), or "cuda" (--device)
DEVICE = "cpu"


def params_for(workload: str, new_tokens: int, seed: int, k: int | None = None) -> SamplingParams:
    if workload == "code":
        return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
    return SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=seed, ignore_eos=True, num_speculative_tokens=k)


def run_ours(llm: LLM, prompts, workload: str, new_tokens: int, concurrent: bool, k: int | None = None) -> dict:
    """Tokens/s and speculation stats of one configuration over the prompts: one at a time, or
    all submitted together (the engine runs up to max_num_seqs of them at once)."""
    before = llm.engine.spec_stats.as_dict()
    if concurrent:
        sps = [params_for(workload, new_tokens, i, k) for i in range(len(prompts))]
        outs, total = timed(lambda: llm.generate(prompts, sps))
    else:
        total, outs = 0.0, []
        for i, p in enumerate(prompts):
            out, dt = timed(lambda p=p, i=i: llm.generate([p], params_for(workload, new_tokens, i, k)))
            total, outs = total + dt, outs + out
    # time per output token after the first, per request (its prefill and queueing excluded)
    tpots = [(o.metrics["e2e_s"] - o.metrics["ttft_s"]) / (len(o.token_ids) - 1) for o in outs]
    after = llm.engine.spec_stats.as_dict()
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    steps = after["num_verify_steps"] - before["num_verify_steps"]
    draft_time = after["draft_time_s"] - before["draft_time_s"]
    tokens = len(prompts) * new_tokens
    per_stream = min(len(prompts), llm.engine.scheduler_config.max_num_seqs) if concurrent else 1
    return {
        "tokens_per_s": tokens / total,
        "ms_per_token_per_stream": 1e3 * total * per_stream / tokens,
        "tpot_ms": 1e3 * statistics.median(tpots),
        "mean_accepted_length": (accepted + steps) / steps if steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_time_per_draft_token_ms": 1e3 * draft_time / drafted if drafted else None,
    }


def run_hf(target_dir: str, prompts, workload: str, new_tokens: int, assistant_dir: str | None) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    assistant = (AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.bfloat16).to(DEVICE).eval()
                 if assistant_dir else None)
    total = 0.0
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=DEVICE)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        if workload == "code":
            kw["do_sample"] = False
        else:
            kw.update(do_sample=True, temperature=1.0, top_k=0)
            torch.manual_seed(i)
        if assistant is not None:
            kw["assistant_model"] = assistant
        with torch.inference_mode():
            _, dt = timed(lambda ids=ids, kw=kw: model.generate(ids, **kw))
        total += dt
    return {"tokens_per_s": len(prompts) * new_tokens / total, "ms_per_token_per_stream": 1e3 * total / new_tokens / len(prompts)}


def make_llm(method: str | None, k: int, adaptive: bool, max_num_seqs: int, draft_vocab_size: int | None = None,
             draft_weights: str = "auto") -> LLM:
    """draft_vocab_size None: each drafter's shipped draft_vocab.json default; 0: whole vocabulary.
    draft_weights: SpeculativeConfig.draft_weights (auto: an EAGLE-3 head's int8 where it runs)."""
    spec = None
    target = str(MODELS / "target")
    if method == "mtp":
        target = METHODS["mtp"]
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=k, adaptive=adaptive,
                                 draft_vocab_size=draft_vocab_size)
    elif method is not None:
        spec = SpeculativeConfig(method=method, model=METHODS[method], num_speculative_tokens=k, adaptive=adaptive,
                                 draft_vocab_size=draft_vocab_size if method != "ngram" else None,
                                 draft_weights=draft_weights)
    # No prefix caching: the sweep runs the same prompts once per k, and cached prompts would skip
    # the prefill in every run after the first (flattering them against the baseline). A fixed
    # 256 MiB KV pool (about 10k tokens) so that every configuration fits in memory at once.
    return LLM(target, dtype="bfloat16", device=DEVICE, speculative=spec, max_num_seqs=max_num_seqs,
               enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20)


def draft_vocab_of(llm: LLM) -> int | None:
    head = getattr(llm.engine.speculator.proposer, "head", None) if llm.engine.speculator else None
    return head.size if head is not None else None


def with_step_fraction(row: dict, target_step_ms: float | None) -> dict:
    """Add the target's batch-1 step time (start-up profile) and each draft token's cost relative to it."""
    row["target_step_ms"] = target_step_ms
    d = row.get("draft_time_per_draft_token_ms")
    row["draft_token_over_target_step"] = d / target_step_ms if d is not None and target_step_ms else None
    return row


LOADS = ("batch 1", "16 at once", "16 sustained")


def warm_up(llm: LLM, warm_prompts, new_tokens: int) -> None:
    """Each configuration's warm-up, untimed: the first calls of each shape, and the adaptive
    policy's first steps, as a server has them behind it once it has served a few requests (the
    drafter's per-length round times, the calibration of its steps, each draft position's
    acceptance; without them the first timed repetition would pay for the policy's first steps,
    drafted at a small k before anything is measured). Held-out prompts other than the measured
    ones, code then sampled text, one at a time."""
    for i, p in enumerate(warm_prompts):
        llm.generate([p], params_for("code" if i % 2 == 0 else "unpredictable", new_tokens, 1000 + i))


def part1(prompts, batch_prompts, sustained_prompts, new_tokens: int, k: int, methods: list[str],
          ablate_draft_vocab: bool, repeats: int, warm_prompts=()) -> list[dict]:
    configs = [(m, None) for m in [None, *methods]]
    if ablate_draft_vocab:
        # (n-gram lookup has no LM head; an EAGLE-3 checkpoint's d2t fixes its draft vocabulary)
        configs += [(m, 0) for m in methods if m not in ("ngram", "eagle3")]
    llms, names, step_ms = {}, {}, {}
    for method, dv in configs:
        llm = make_llm(method, k, adaptive=True, max_num_seqs=len(batch_prompts), draft_vocab_size=dv)
        warm_up(llm, warm_prompts or prompts[:1], new_tokens)
        vocab = draft_vocab_of(llm)
        name = f"ours, {method or 'no speculation'}" + (f" (adaptive, k<={k}" if method else "")
        if method:
            name += (f", draft vocab {vocab})" if vocab is not None and dv is None else ", whole vocab)" if dv == 0 else ")")
        llms[method, dv], names[method, dv] = llm, name
        step_ms[method, dv] = 1e3 * llm.engine.speculator.cost(1, 1) if method and llm.engine.speculator.cost is not None else None
    rows = []
    for workload in ("code", "unpredictable"):
        runs: dict = {}
        for rep in range(repeats):
            for cfg in (configs if rep % 2 == 0 else configs[::-1]):
                if cfg[1] == 0 and workload != "code":
                    continue  # the whole-vocabulary ablation: code, batch 1 only
                llm = llms[cfg]
                runs.setdefault((cfg, LOADS[0]), []).append(run_ours(llm, prompts, workload, new_tokens, concurrent=False))
                if cfg[1] == 0:
                    continue
                runs.setdefault((cfg, LOADS[1]), []).append(run_ours(llm, batch_prompts, workload, new_tokens, concurrent=True))
                runs.setdefault((cfg, LOADS[2]), []).append(run_ours(llm, sustained_prompts, workload, new_tokens, concurrent=True))
            print(f"{workload}: repetition {rep + 1}/{repeats} done", flush=True)
        for (cfg, load), results in runs.items():
            base = runs[((None, None), load)]
            ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results, base, strict=True)]
            # decoding alone: no speculation's time per output token over this one's (prefill excluded)
            tpot_ratios = [b["tpot_ms"] / r["tpot_ms"] for r, b in zip(results, base, strict=True)]
            row = {"workload": workload, "load": load, "batch": 1 if load == LOADS[0] else len(batch_prompts),
                   "system": names[cfg], "repeats": len(results), "ratio_vs_no_spec": statistics.median(ratios),
                   "ratio_min": min(ratios), "ratio_max": max(ratios),
                   # per repetition: the ratio and no speculation's time per output token (a
                   # shared host's memory speed drifts within minutes, and the ratio with it)
                   "ratios": [round(x, 3) for x in ratios],
                   "no_spec_tpot_ms": [round(b["tpot_ms"], 3) for b in base],
                   "tpot_ratio_vs_no_spec": statistics.median(tpot_ratios)}
            for key in results[0]:
                vals = [r[key] for r in results if r[key] is not None]
                row[key] = statistics.median(vals) if vals else None
            rows.append(with_step_fraction(row, step_ms[cfg]))
        for name, assistant in (("transformers generate", None), ("transformers assisted (drafter)", METHODS["draft"])):
            r = run_hf(str(MODELS / "target"), prompts, workload, new_tokens, assistant)
            ours = next(x for x in rows if x["workload"] == workload and x["load"] == LOADS[0] and x["system"] == names[None, None])
            rows.append({"workload": workload, "load": LOADS[0], "batch": 1, "system": name, "repeats": 1,
                         "ratio_vs_no_spec": r["tokens_per_s"] / ours["tokens_per_s"], **r})
    return rows


def sweep(prompts, batch_prompts, new_tokens: int, methods: list[str], ks=range(1, 9),
          batch1_only: bool = False) -> list[dict]:
    rows = []
    base = make_llm(None, 1, adaptive=False, max_num_seqs=32)
    loads = ((False, prompts),) if batch1_only else ((False, prompts), (True, batch_prompts))
    for workload in ("code", "unpredictable"):
        for concurrent, ps in loads:
            r = run_ours(base, ps, workload, new_tokens, concurrent)
            rows.append({"method": "off", "k": 0, "workload": workload, "batch": len(ps) if concurrent else 1, **r})
    for method in methods:
        llm = make_llm(method, 8, adaptive=False, max_num_seqs=32)
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
        for workload in ("code", "unpredictable"):
            for k in ks:
                for concurrent, ps in loads:
                    r = run_ours(llm, ps, workload, new_tokens, concurrent, k=k)
                    rows.append({"method": method, "k": k, "workload": workload,
                                 "batch": len(ps) if concurrent else 1, **r})
                b1 = rows[-len(loads)]
                print(f"sweep {method} {workload} k={k}: {b1['tokens_per_s']:.1f} tok/s (b1), "
                      f"accepted {b1['mean_accepted_length']}", flush=True)
    return rows


def plot_sweep(rows: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, fname, ylabel in (("tokens_per_s", "spec_tokens_per_s_vs_k.png", "tokens/s"),
                                  ("mean_accepted_length", "spec_accepted_length_vs_k.png", "mean accepted length")):
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
        for ax, (workload, batch) in zip(axes.flat, [("code", 1), ("code", 16), ("unpredictable", 1), ("unpredictable", 16)], strict=True):
            for method in sorted({r["method"] for r in rows if r["method"] != "off"}):
                pts = [(r["k"], r[metric]) for r in rows if r["method"] == method and r["workload"] == workload
                       and (r["batch"] == 1) == (batch == 1) and r[metric] is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            if metric == "tokens_per_s":
                off = [r[metric] for r in rows if r["method"] == "off" and r["workload"] == workload and (r["batch"] == 1) == (batch == 1)]
                if off:
                    ax.axhline(off[0], color="gray", linestyle="--", label="no speculation")
            ax.set_title(f"{workload}, batch {batch if batch == 1 else 'concurrent'}")
            ax.set_xlabel("k (draft tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes.flat[0].legend()
        fig.tight_layout()
        path = result_path(fname.removesuffix(".png"), ".png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(str(path))
    return paths


def plot_part1(rows: list[dict], name: str = "spec") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, workload in zip(axes, ("code", "unpredictable"), strict=True):
        sel = [r for r in rows if r["workload"] == workload and r.get("load", "batch 1") == "batch 1"]
        ax.barh([r["system"] for r in sel], [r["tokens_per_s"] for r in sel], color="tab:blue")
        ax.set_title(f"{workload}, batch 1 (tokens/s, higher is better)")
        ax.invert_yaxis()
    fig.tight_layout()
    path = result_path(f"{name}_batch1", ".png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def bench_prompts(tokenizer, num: int, concurrency: int, sustained: int, warm: int, prompt_len: int) -> tuple:
    """Part 1's prompt sets: batch 1, 16 at once, sustained, warm-up (held-out code, fixed seeds)."""
    return tuple(code_prompts(tokenizer, n, prompt_len, seed=seed)
                 for n, seed in ((num, 1), (concurrency, 2), (sustained, 3), (warm, 4)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sustained-requests", type=int, default=64,
                    help="requests of the sustained load, run through --concurrency slots")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions of part 1 (medians reported)")
    ap.add_argument("--warm-up", type=int, default=4,
                    help="untimed requests each configuration of part 1 serves first (`warm_up`)")
    ap.add_argument("-k", type=int, default=6, help="k cap for the adaptive runs of part 1")
    ap.add_argument("--methods", default="draft,ngram,eagle3,mtp")
    ap.add_argument("--sweep", action="store_true", help="also run the k = 1..8 sweep (part 2)")
    ap.add_argument("--sweep-ks", default="1,2,3,4,5,6,7,8", help="the sweep's k values")
    ap.add_argument("--sweep-batch1-only", action="store_true", help="the sweep without its 16-concurrent runs")
    ap.add_argument("--sweep-name", default="spec_sweep",
                    help="results file of the sweep (a partial sweep, other than the default, draws no plots)")
    ap.add_argument("--skip-part1", action="store_true")
    ap.add_argument("--name", default="spec", help="part 1's results: bench/results/<host>/<name>.json")
    ap.add_argument("--no-ablation", action="store_true",
                    help="skip the batch-1 code rows of each model drafter over the whole vocabulary")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every system measured (1: steady on a shared 2-core host)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--prompts-from", default=None,
                    help="a JSON file of token-id prompts ({prompts, batch, sustained, warm}, as "
                         "`bench.bench_gpu pack` writes) instead of windows of the held-out files")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = args.device
    methods = [m for m in args.methods.split(",") if m and (METHODS[m] is None or os.path.isdir(METHODS[m]))]
    from transformers import AutoTokenizer

    if args.prompts_from is not None:
        sets = json.loads(Path(args.prompts_from).read_text())
        prompts, batch_prompts, sustained_prompts, warm_prompts = (sets[k] for k in ("prompts", "batch", "sustained", "warm"))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(MODELS / "target"))
        prompts, batch_prompts, sustained_prompts, warm_prompts = bench_prompts(
            tokenizer, args.prompts, args.concurrency, args.sustained_requests, args.warm_up, args.prompt_len)
    results: dict = {"machine": machine_info(), "args": vars(args)}
    if not args.skip_part1:
        rows = part1(prompts, batch_prompts, sustained_prompts, args.new_tokens, args.k, methods,
                     not args.no_ablation, args.repeats, warm_prompts)
        results["part1"] = rows
        results["part1_plot"] = plot_part1(rows, args.name)
        print(table(rows, ["workload", "load", "system", "tokens_per_s", "ratio_vs_no_spec", "tpot_ms", "tpot_ratio_vs_no_spec",
                           "mean_accepted_length", "acceptance_rate", "draft_token_over_target_step"]))
        write_results(args.name, results)
    if args.sweep:
        ks = [int(k) for k in args.sweep_ks.split(",")]
        srows = sweep(prompts, batch_prompts, args.new_tokens, methods, ks, args.sweep_batch1_only)
        full = ks == list(range(1, 9)) and not args.sweep_batch1_only
        write_results(args.sweep_name, {"machine": results["machine"], "args": vars(args), "sweep": srows,
                                        "sweep_plots": plot_sweep(srows) if full else []})
    return results


if __name__ == "__main__":
    main()
