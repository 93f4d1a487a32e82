"""The published chat model (SmolLM2-135M-Instruct from its GGUF) on held-out chat prompts: no
speculation, n-gram and the EAGLE-3 head, batch 1 and concurrent, against transformers `generate`.

    python -m bench.bench_chat [--model GGUF] [--eagle3 models/eagle3-smollm2] [--prompts 12]
        [--max-tokens 128] [--concurrency 16] [--reps 3] [--dtype bfloat16] [--quantization gguf,none]
        [--sweep-k 1,2,3,4,5,6,7,8] [--no-hf]

Prompts: the first ``--prompts`` of ``models/chat_heldout_prompts.json`` (never trained on; made by
`python -m training chat-data`), rendered by the model's chat template. Greedy; a response ends at
the model's end-of-turn token or at ``--max-tokens``, so every configuration produces the same
tokens (checked: ``exact`` per row) and does the same work.

- **batch 1**: prompts one at a time. ``decode_tok_s`` = (tokens - 1) / (e2e - TTFT) summed over
  the prompts (the prefill and first token left out); ``e2e_tok_s`` = tokens / wall time.
- **concurrent**: all ``--concurrency`` prompts submitted at once (cycled from the held-out list
  if it has fewer); ``tok_s`` = tokens / wall time.
- ``mean_accepted_length``: (accepted drafts + verify steps) / verify steps, batch 1.
- transformers: `generate` on the model transformers loads from the same GGUF (dequantized, in
  ``--dtype``), batch 1, greedy, at most the engine's token count per prompt (max_new_tokens; it
  stops at the end-of-turn token too); tokens / wall time (its prefill included, as ``e2e_tok_s``).

``--quantization gguf,none``: every configuration twice, on the GGUF's Q4_1/Q8_0 blocks as stored
and on every weight dequantized to ``--dtype``; ``batch1_vs_none_none`` is each row's batch-1
decode rate over the dequantized model's without speculation. ``exact`` compares a row with the
first configuration of its own quantization (the two weight sets may part at a near tie).

``--sweep-k``: the EAGLE-3 head alone at each fixed k, batch 1, once (acceptance is a count, not
a timing; its tokens/s are one pass, not medians).

Every repetition runs every configuration (order reversed every other one); rows are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench.common import MODELS, machine_info, table, timed, write_results
from engine import LLM, SamplingParams, SpeculativeConfig

CONFIGS = {
    "none": None,
    "ngram k<=4 adaptive": {"method": "ngram", "num_speculative_tokens": 4},
    "eagle3 k=5": {"method": "eagle3", "num_speculative_tokens": 5, "adaptive": False},
    "eagle3 k<=5 adaptive": {"method": "eagle3", "num_speculative_tokens": 5},
    # the head's copies: draft_weights "auto" above; int8; its bfloat16 weights as stored
    "eagle3 k=5 int8 head": {"method": "eagle3", "num_speculative_tokens": 5, "adaptive": False,
                             "draft_weights": "int8"},
    "eagle3 k=5 bf16 head": {"method": "eagle3", "num_speculative_tokens": 5, "adaptive": False,
                             "draft_weights": "model"},
    "eagle3 k=2": {"method": "eagle3", "num_speculative_tokens": 2, "adaptive": False},
}


def label(config: str, quantization: str, quantizations: list[str]) -> str:
    """A row's name: the configuration, and its quantization where several are compared."""
    return config if len(quantizations) == 1 else f"{config} [{quantization}]"


def chat_prompts(llm: LLM, num: int) -> list[list[int]]:
    prompts = json.loads((MODELS / "chat_heldout_prompts.json").read_text())["prompts"][:num]
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for p in prompts]


def spec_counts(llm: LLM) -> tuple[int, int]:
    if llm.engine.speculator is None:
        return 0, 0
    s = llm.engine.spec_stats.as_dict()
    return s["num_accepted_tokens"], s["num_verify_steps"]


def run_batch1(llm: LLM, prompts, max_tokens: int) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    acc0, steps0 = spec_counts(llm)
    outs, wall, decode_s, decode_n, tokens = [], 0.0, 0.0, 0, 0
    for p in prompts:
        (out,), dt = timed(lambda p=p: llm.generate([p], sp))
        outs.append(out.token_ids)
        wall += dt
        tokens += len(out.token_ids)
        decode_n += len(out.token_ids) - 1
        decode_s += out.metrics["e2e_s"] - out.metrics["ttft_s"]
    acc1, steps1 = spec_counts(llm)
    steps = steps1 - steps0
    return {"decode_tok_s": decode_n / decode_s, "e2e_tok_s": tokens / wall, "tokens": tokens,
            "mean_accepted_length": (acc1 - acc0 + steps) / steps if steps else None, "outputs": outs}


def run_concurrent(llm: LLM, prompts, max_tokens: int) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs, wall = timed(lambda: llm.generate(prompts, sp))
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / wall, "tokens": tokens, "outputs": [o.token_ids for o in outs]}


def sweep_k(model: str, eagle3: str, dtype: str, prompts, max_tokens: int, ks: list[int]) -> list[dict]:
    """Mean accepted length and batch-1 decode tokens/s of the EAGLE-3 head at each fixed k (one
    engine drafting up to max(ks), each request's k set by `SamplingParams.num_speculative_tokens`)."""
    spec = SpeculativeConfig(method="eagle3", model=eagle3, num_speculative_tokens=max(ks), adaptive=False)
    llm = LLM(model, dtype=dtype, speculative=spec, enable_prefix_caching=False, max_model_len=2048)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=32))
    rows = []
    for k in ks:
        acc0, steps0 = spec_counts(llm)
        decode_s, decode_n = 0.0, 0
        for p in prompts:
            (out,) = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=k))
            decode_n += len(out.token_ids) - 1
            decode_s += out.metrics["e2e_s"] - out.metrics["ttft_s"]
        acc1, steps1 = spec_counts(llm)
        steps = steps1 - steps0
        rows.append({"k": k, "mean_accepted_length": round((acc1 - acc0 + steps) / steps, 3),
                     "acceptance_rate": round((acc1 - acc0) / (k * steps), 3),
                     "batch1_decode_tok_s": round(decode_n / decode_s, 2)})
        print(f"k={k}: {rows[-1]}", flush=True)
    return rows


def run_hf(model_path: str, prompts, lengths: list[int], dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(os.path.abspath(model_path))
    kwargs = {"gguf_file": name} if name.endswith(".gguf") else {}
    model = AutoModelForCausalLM.from_pretrained(folder if kwargs else model_path, dtype=getattr(torch, dtype),
                                                 **kwargs).eval()
    wall, outs = 0.0, []
    for p, n in zip(prompts, lengths, strict=True):
        ids = torch.tensor([p])
        with torch.inference_mode():
            r, dt = timed(lambda ids=ids, n=n: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                              max_new_tokens=n, pad_token_id=0))
        wall += dt
        outs.append(r[0, len(p):].tolist())
    return {"e2e_tok_s": sum(len(o) for o in outs) / wall, "outputs": outs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the target (default: the fetched SmolLM2 GGUF)")
    ap.add_argument("--eagle3", default=str(MODELS / "eagle3-smollm2"))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--sweep-k", default="", help="comma-separated k: the EAGLE-3 head's acceptance per k (batch 1)")
    ap.add_argument("--quantization", default="auto",
                    help="comma-separated engine `quantization` values, each crossed with --configs (e.g. gguf,none: "
                         "the GGUF's blocks as stored, and every weight dequantized to --dtype)")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="leave transformers out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from models.fetch import fetch

        args.model = str(fetch("smollm2"))
    quantizations = args.quantization.split(",")
    names = [label(c, q, quantizations) for q in quantizations for c in args.configs.split(",")]
    llms = {}
    for q in quantizations:
        for config in args.configs.split(","):
            spec = CONFIGS[config] and SpeculativeConfig(
                model=args.eagle3 if CONFIGS[config]["method"] == "eagle3" else None, **CONFIGS[config])
            # no prefix cache: every repetition prefills its prompts again, as the first did
            llms[label(config, q, quantizations)] = LLM(
                args.model, dtype=args.dtype, speculative=spec, max_num_seqs=args.concurrency,
                enable_prefix_caching=False, max_model_len=2048, quantization=q)
    prompts = chat_prompts(llms[names[0]], args.prompts)
    many = [prompts[i % len(prompts)] for i in range(args.concurrency)]
    for llm in llms.values():  # warm-up: kernels, graphs and the adaptive policy's first estimates
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=32))
    runs: dict[str, dict[str, list]] = {n: {"b1": [], "conc": []} for n in names}
    hf_runs = []
    for rep in range(args.reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            runs[name]["b1"].append(run_batch1(llms[name], prompts, args.max_tokens))
            runs[name]["conc"].append(run_concurrent(llms[name], many, args.max_tokens))
            print(f"rep {rep} {name}: b1 {runs[name]['b1'][-1]['decode_tok_s']:.1f} tok/s, "
                  f"{args.concurrency} concurrent {runs[name]['conc'][-1]['tok_s']:.1f} tok/s", flush=True)
        if args.hf:
            lengths = [len(o) for o in runs[names[0]]["b1"][-1]["outputs"]]
            hf_runs.append(run_hf(args.model, prompts, lengths, args.dtype))
            print(f"rep {rep} transformers: {hf_runs[-1]['e2e_tok_s']:.1f} tok/s", flush=True)
    med = statistics.median
    rows = []
    for name in names:
        # exact: the same tokens as this quantization's first configuration (the weights differ
        # between quantizations: their greedy outputs may part at a near tie)
        q = next(q for q in quantizations if name.endswith(label("", q, quantizations)))
        first = next(n for n in names if n.endswith(label("", q, quantizations)))
        ref_b1, ref_conc = runs[first]["b1"][0]["outputs"], runs[first]["conc"][0]["outputs"]
        base = runs.get(label("none", q, quantizations))
        b1, conc = runs[name]["b1"], runs[name]["conc"]
        row = {
            "config": name,
            "batch1_decode_tok_s": round(med(r["decode_tok_s"] for r in b1), 2),
            "batch1_e2e_tok_s": round(med(r["e2e_tok_s"] for r in b1), 2),
            f"conc{args.concurrency}_tok_s": round(med(r["tok_s"] for r in conc), 2),
            "mean_accepted_length": (round(med(r["mean_accepted_length"] for r in b1), 3)
                                     if b1[0]["mean_accepted_length"] is not None else None),
            "tokens_batch1": b1[0]["tokens"],
            "exact": all(r["outputs"] == ref_b1 for r in b1) and all(r["outputs"] == ref_conc for r in conc),
        }
        if base is not None:
            row["batch1_speedup"] = round(row["batch1_decode_tok_s"] / med(r["decode_tok_s"] for r in base["b1"]), 3)
            row[f"conc{args.concurrency}_speedup"] = round(
                row[f"conc{args.concurrency}_tok_s"] / med(r["tok_s"] for r in base["conc"]), 3)
        plain = runs.get(label("none", quantizations[-1], quantizations))
        if len(quantizations) > 1 and plain is not None:
            row[f"batch1_vs_none_{quantizations[-1]}"] = round(
                row["batch1_decode_tok_s"] / med(r["decode_tok_s"] for r in plain["b1"]), 3)
        rows.append(row)
    ref_b1 = runs[names[0]]["b1"][0]["outputs"]
    if hf_runs:
        rows.append({"config": f"transformers generate ({args.dtype})",
                     "batch1_e2e_tok_s": round(med(r["e2e_tok_s"] for r in hf_runs), 2),
                     "exact": all(r["outputs"] == ref_b1 for r in hf_runs)})
    cols = ["config", "batch1_decode_tok_s", "batch1_e2e_tok_s", "batch1_speedup", f"conc{args.concurrency}_tok_s",
            f"conc{args.concurrency}_speedup", "mean_accepted_length", "exact"]
    if len(quantizations) > 1:
        cols.insert(4, f"batch1_vs_none_{quantizations[-1]}")
    print(table(rows, cols))
    results = {"machine": machine_info(), "model": os.path.basename(args.model), "eagle3": args.eagle3,
               "dtype": args.dtype, "quantization": quantizations, "prompts": len(prompts), "max_tokens": args.max_tokens,
               "concurrency": args.concurrency, "reps": args.reps, "rows": rows}
    if args.sweep_k:
        results["eagle3_per_k"] = sweep_k(args.model, args.eagle3, args.dtype, prompts, args.max_tokens,
                                          [int(k) for k in args.sweep_k.split(",")])
        print(table(results["eagle3_per_k"], ["k", "mean_accepted_length", "acceptance_rate", "batch1_decode_tok_s"]))
    print("wrote", write_results("chat", results, args.out))
    return results


if __name__ == "__main__":
    main()
