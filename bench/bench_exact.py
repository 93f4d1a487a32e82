"""What exact speculation costs, and what it buys: the engine's `exact` modes side by side.

    python -m bench.bench_exact [--prompts 4] [--max-tokens 64] [--reps 2] [--dtype auto]
        [--methods eagle3,draft] [--modes off,rows,pad,batch_invariant[,rows-widen]] [--concurrent 16]
        [--out PATH]

Shipped target and drafters, one torch thread, held-out code prompts, greedy. For each mode
(off, rows, pad, batch_invariant; `auto` is reported as the mode it picked) and each drafter
(plus no speculation): batch-1 decode tokens/s (median over prompts x reps, every configuration
loaded first and runs interleaved), and whether the greedy text with speculation equals the
text without it (same mode) on every prompt. Then --concurrent requests at once (throughput, no
speculation and the first drafter; median of --reps interleaved rounds) for off,
batch_invariant and rows, and whether the latter two's texts equal their batch-1 texts (rows:
steps of <= ROW_KERNEL_MAX_TOKENS tokens through the CPU kernels; 16 requests verifying 4 drafts
each make 80). Writes bench/results/<host>/exact.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import MODELS, code_prompts, machine_info, median, write_results

DRAFTERS = {"draft": "drafter", "eagle3": "eagle3-head", "mtp": None, "ngram": None}
MODES = ("off", "rows", "pad", "batch_invariant")


# "rows-widen": `rows` with bfloat16 weights packed for the widen-then-FMA products even where the
# CPU has AVX512-BF16 (SPECDECODE_CPU_BF16_DOT=0 while the engine loads and packs), to compare the
# two CPU product paths in one interleaved run.
WIDEN = "rows-widen"


def make(method: str | None, mode: str, dtype: str):
    import os

    from engine import LLM, SamplingParams, SpeculativeConfig
    from kernels import cpu_kernels

    spec = None
    if method is not None:
        folder = DRAFTERS[method]
        spec = SpeculativeConfig(method=method, model=str(MODELS / folder) if folder else None,
                                 num_speculative_tokens=4, adaptive=False)
    if mode != WIDEN:
        return LLM(str(MODELS / "target"), device="cpu", dtype=dtype, speculative=spec, exact=mode, num_threads=1)
    before = os.environ.get(cpu_kernels.ENV_BF16_DOT)
    os.environ[cpu_kernels.ENV_BF16_DOT] = "0"
    try:
        llm = LLM(str(MODELS / "target"), device="cpu", dtype=dtype, speculative=spec, exact="rows", num_threads=1)
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # packs lazily
    finally:
        if before is None:
            os.environ.pop(cpu_kernels.ENV_BF16_DOT)
        else:
            os.environ[cpu_kernels.ENV_BF16_DOT] = before
    return llm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", default="eagle3,draft")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"exact modes to compare (off first; {WIDEN}: rows without the AVX512-BF16 products)")
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--out", default=None, help="result JSON (default: bench/results/<host>/exact.json)")
    args = p.parse_args(argv)
    from engine import SamplingParams

    torch.set_num_threads(1)
    methods = [None, *[m for m in args.methods.split(",") if m]]
    auto = make(None, "auto", args.dtype)
    picked = auto.engine.runner.exact
    dtype = str(auto.engine.dtype).removeprefix("torch.")
    prompts = code_prompts(auto.tokenizer, args.prompts, args.prompt_len, seed=1)
    del auto
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    modes = [m for m in args.modes.split(",") if m]
    if modes[0] != "off":
        p.error("--modes must start with off (the baseline)")
    llms = {(m, mode): make(m, mode, args.dtype) for mode in modes for m in methods}
    texts: dict = {}
    tps: dict = {key: [] for key in llms}
    for _ in range(args.reps):
        for i, prompt in enumerate(prompts):
            for key, llm in llms.items():
                t0 = time.perf_counter()
                out = llm.generate([prompt], params)[0]
                tps[key].append(len(out.token_ids) / (time.perf_counter() - t0))
                texts[key, i] = out.token_ids
    rows = []
    for m, mode in llms:
        same = sum(texts[(m, mode), i] == texts[(None, mode), i] for i in range(len(prompts)))
        rows.append({"method": m or "none", "mode": mode, "tokens_per_s": median(tps[m, mode]),
                     "greedy_equal_to_no_spec": f"{same}/{len(prompts)}",
                     "speedup_vs_off_same_method": None})
    base = {r["method"]: r["tokens_per_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        r["speedup_vs_off_same_method"] = r["tokens_per_s"] / base[r["method"]]

    # --concurrent requests at once, --reps interleaved rounds over the configurations (median)
    batch = [prompts[i % len(prompts)] for i in range(args.concurrent)]
    keys = [(m, mode) for m in methods[:2] for mode in ("off", "batch_invariant", "rows", WIDEN) if mode in modes]
    conc_tps: dict = {key: [] for key in keys}
    conc_outs: dict = {}
    for _ in range(args.reps):
        for key in keys:
            t0 = time.perf_counter()
            outs = llms[key].generate(batch, params)
            conc_tps[key].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
            conc_outs[key] = outs
    concurrent = []
    for (m, mode), outs in conc_outs.items():
        row = {"method": m or "none", "mode": mode, "requests": len(batch), "tokens_per_s": median(conc_tps[m, mode]),
               "tokens_per_s_reps": conc_tps[m, mode]}
        if mode != "off":
            row["equal_to_batch1"] = f"{sum(o.token_ids == texts[(m, mode), i % len(prompts)] for i, o in enumerate(outs))}/{len(outs)}"
        concurrent.append(row)

    report = {"benchmark": "exact", "machine": machine_info(), "dtype": dtype, "auto_picked": picked,
              "args": vars(args), "batch1": rows, "concurrent": concurrent}
    path = write_results("exact", report, args.out)
    print(f"dtype {dtype}; exact=auto picks {picked!r} here; batch 1, {args.max_tokens} greedy tokens, "
          f"{len(prompts)} prompts x {args.reps} reps")
    print(f"{'drafter':<8}{'mode':<17}{'tokens/s':>10}{'vs off':>8}{'text = no spec':>16}")
    for r in rows:
        print(f"{r['method']:<8}{r['mode']:<17}{r['tokens_per_s']:>10.1f}{r['speedup_vs_off_same_method']:>8.2f}"
              f"{r['greedy_equal_to_no_spec']:>16}")
    for r in concurrent:
        print(f"{args.concurrent} concurrent, {r['method']}, {r['mode']}: {r['tokens_per_s']:.1f} tokens/s"
              + (f", texts equal to batch 1: {r['equal_to_batch1']}" if "equal_to_batch1" in r else ""))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
