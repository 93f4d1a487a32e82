"""Structured output under speculation on the default model: a JSON-extraction workload.

    python -m bench.bench_structured [--prompts 8] [--max-tokens 192] [--concurrency 16] [--reps 3]
        [--dtype auto] [--quantization auto] [--configs ...] [--out PATH]

Each of the first --prompts held-out chat prompts (models/chat_heldout_prompts.json, never trained
on) is asked to be answered as a JSON object of SCHEMA (a topic, an answer, keywords and a
difficulty), with `structured_output` json_schema, greedy, on SmolLM2-135M-Instruct from its GGUF
as `make serve` loads it (--dtype; --quantization, default auto as served: the GGUF's blocks as
stored; ``gguf_a8`` multiplies its Q4 blocks with int8 activations). Configurations (CONFIGS): no speculation,
n-gram and the shipped EAGLE-3 head, adaptive, each constrained; the same with `logprobs` (5
alternatives); and no speculation and n-gram unconstrained (what structure costs or gains).

- **batch 1**: prompts one at a time; ``decode_tok_s`` = (tokens - 1) / (e2e - TTFT) summed over
  the prompts; ``mean_accepted_length`` = (accepted drafts + verify steps) / verify steps.
- **concurrent**: --concurrency prompts at once (cycled); ``tok_s`` = tokens / wall time.
- **grammar share**: in the concurrent run, the seconds spent in the grammar's work on the engine
  thread (GrammarStates.prepare: masks for each sampled row and the drafts' walk; commit: the
  state advanced over committed tokens; the masks applied to the logits) over the run's wall time.
- ``complete``: the share of outputs that ended by themselves (the grammar complete, or the end
  of turn), not at --max-tokens; ``valid``: every complete constrained output parses and
  validates against SCHEMA (jsonschema);
  ``exact``: its tokens equal the first configuration's with the same constraint, every run.
Every repetition runs every configuration (order reversed every other one); rows are medians.
Writes bench/results/<host>/structured.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jsonschema

from bench.common import machine_info, table, timed, write_results
from engine import LLM, SamplingParams, SpeculativeConfig, StructuredOutput

MODELS = Path(__file__).resolve().parent.parent / "models"
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 60},
        "answer": {"type": "string", "maxLength": 400},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
        "difficulty": {"enum": ["beginner", "intermediate", "advanced"]},
    },
    "required": ["topic", "answer", "keywords", "difficulty"],
    "additionalProperties": False,
}
ASK = ("\n\nReply with a JSON object only: \"topic\" (a few words), \"answer\" (one or two sentences), "
       "\"keywords\" (up to four) and \"difficulty\" (beginner, intermediate or advanced).")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 5}
# name -> (speculative config or None, constrained, logprobs)
CONFIGS = {
    "none": (None, True, None),
    "ngram": (NGRAM, True, None),
    "eagle3": (EAGLE3, True, None),
    "none +logprobs": (None, True, 5),
    "ngram +logprobs": (NGRAM, True, 5),
    "none unconstrained": (None, False, None),
    "ngram unconstrained": (NGRAM, False, None),
}


class GrammarClock:
    """Seconds the engine spends in the grammar's work (module docstring), while installed."""

    def __init__(self, llm: LLM) -> None:
        import engine.model_runner as model_runner

        self.seconds = 0.0
        self.grammars = llm.engine.grammars
        self.model_runner = model_runner
        self.saved = (self.grammars.prepare, self.grammars.commit, model_runner.constrain_to_grammars)

    def _timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return run

    def __enter__(self) -> GrammarClock:
        prepare, commit, constrain = self.saved
        self.grammars.prepare, self.grammars.commit = self._timed(prepare), self._timed(commit)
        self.model_runner.constrain_to_grammars = self._timed(constrain)
        return self

    def __exit__(self, *exc) -> None:
        self.grammars.prepare, self.grammars.commit, self.model_runner.constrain_to_grammars = self.saved


def params(constrained: bool, logprobs: int | None, max_tokens: int) -> SamplingParams:
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA)) if constrained else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=structured, logprobs=logprobs)


def spec_counts(llm: LLM) -> tuple[int, int]:
    if llm.engine.speculator is None:
        return 0, 0
    s = llm.engine.spec_stats.as_dict()
    return s["num_accepted_tokens"], s["num_verify_steps"]


def run_batch1(llm: LLM, prompts, sp: SamplingParams) -> dict:
    acc0, steps0 = spec_counts(llm)
    outs, decode_s, decode_n = [], 0.0, 0
    for p in prompts:
        (out,) = llm.generate([p], sp)
        outs.append(out)
        decode_n += len(out.token_ids) - 1
        decode_s += out.metrics["e2e_s"] - out.metrics["ttft_s"]
    acc1, steps1 = spec_counts(llm)
    steps = steps1 - steps0
    return {"decode_tok_s": decode_n / decode_s, "tokens": sum(len(o.token_ids) for o in outs),
            "mean_accepted_length": (acc1 - acc0 + steps) / steps if steps else None,
            "outputs": [o.token_ids for o in outs], "texts": [o.text for o in outs],
            "finished": [o.finish_reason == "stop" for o in outs]}


def run_concurrent(llm: LLM, prompts, sp: SamplingParams) -> dict:
    with GrammarClock(llm) as clock:
        outs, wall = timed(lambda: llm.generate(prompts, sp))
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / wall, "tokens": tokens, "grammar_share": clock.seconds / wall,
            "outputs": [o.token_ids for o in outs], "texts": [o.text for o in outs],
            "finished": [o.finish_reason == "stop" for o in outs]}


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the target (default: the fetched SmolLM2 GGUF)")
    ap.add_argument("--eagle3", default=str(MODELS / "eagle3-smollm2"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto", help="the engine's `quantization` (auto, gguf, gguf_a8, none)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from models.fetch import fetch

        args.model = str(fetch("smollm2"))
    names = args.configs.split(",")
    llms = {}
    for name in names:
        spec, _, _ = CONFIGS[name]
        sc = spec and SpeculativeConfig(model=args.eagle3 if spec["method"] == "eagle3" else None, **spec)
        # no prefix cache: every repetition prefills its prompts again, as the first did
        llms[name] = LLM(args.model, dtype=args.dtype, speculative=sc, max_num_seqs=args.concurrency,
                         enable_prefix_caching=False, max_model_len=2048, quantization=args.quantization)
    questions = json.loads((MODELS / "chat_heldout_prompts.json").read_text())["prompts"][: args.prompts]
    tokenizer = llms[names[0]].tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q + ASK}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in questions]
    many = [prompts[i % len(prompts)] for i in range(args.concurrency)]
    for name in names:  # warm-up: kernels, the compiled grammar and the adaptive policy's first estimates
        _, constrained, logprobs = CONFIGS[name]
        llms[name].generate(prompts[:2], params(constrained, logprobs, 32))
    runs: dict[str, dict[str, list]] = {n: {"b1": [], "conc": []} for n in names}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            _, constrained, logprobs = CONFIGS[name]
            sp = params(constrained, logprobs, args.max_tokens)
            runs[name]["b1"].append(run_batch1(llms[name], prompts, sp))
            runs[name]["conc"].append(run_concurrent(llms[name], many, sp))
            print(f"rep {rep} {name}: b1 {runs[name]['b1'][-1]['decode_tok_s']:.1f} tok/s, {args.concurrency} "
                  f"concurrent {runs[name]['conc'][-1]['tok_s']:.1f} tok/s", flush=True)
    med = statistics.median
    rows = []
    conc = f"conc{args.concurrency}"
    for name in names:
        _, constrained, logprobs = CONFIGS[name]
        first = next(n for n in names if CONFIGS[n][1] == constrained)
        b1, cc = runs[name]["b1"], runs[name]["conc"]
        row = {
            "config": name,
            "batch1_decode_tok_s": round(med(r["decode_tok_s"] for r in b1), 2),
            f"{conc}_tok_s": round(med(r["tok_s"] for r in cc), 2),
            "mean_accepted_length": (round(med(r["mean_accepted_length"] for r in b1), 3)
                                     if b1[0]["mean_accepted_length"] is not None else None),
            "tokens_batch1": b1[0]["tokens"],
            f"grammar_share_{conc}": round(med(r["grammar_share"] for r in cc), 4) if constrained else None,
            "complete": round(statistics.mean(f for r in b1 + cc for f in r["finished"]), 3),
            "valid": (all(valid(t) for r in b1 + cc for t, f in zip(r["texts"], r["finished"], strict=True) if f)
                      if constrained else None),
            "exact": (all(r["outputs"] == runs[first]["b1"][0]["outputs"] for r in b1)
                      and all(r["outputs"] == runs[first]["conc"][0]["outputs"] for r in cc)),
        }
        base = "none" if constrained else "none unconstrained"
        if base in runs:
            row["batch1_speedup"] = round(row["batch1_decode_tok_s"] / med(r["decode_tok_s"] for r in runs[base]["b1"]), 3)
            row[f"{conc}_speedup"] = round(row[f"{conc}_tok_s"] / med(r["tok_s"] for r in runs[base]["conc"]), 3)
        if logprobs is not None and name.replace(" +logprobs", "") in runs:
            off = runs[name.replace(" +logprobs", "")]
            row["logprobs_batch1_vs_off"] = round(row["batch1_decode_tok_s"] / med(r["decode_tok_s"] for r in off["b1"]), 3)
            row[f"logprobs_{conc}_vs_off"] = round(row[f"{conc}_tok_s"] / med(r["tok_s"] for r in off["conc"]), 3)
        rows.append(row)
    cols = ["config", "batch1_decode_tok_s", "batch1_speedup", "mean_accepted_length", f"{conc}_tok_s",
            f"{conc}_speedup", f"grammar_share_{conc}", "logprobs_batch1_vs_off", f"logprobs_{conc}_vs_off", "complete", "valid",
            "exact"]
    print(table(rows, cols))
    results = {"machine": machine_info(), "model": os.path.basename(args.model), "eagle3": args.eagle3,
               "dtype": args.dtype, "quantization": args.quantization, "schema": SCHEMA, "prompts": len(prompts), "max_tokens": args.max_tokens,
               "concurrency": args.concurrency, "reps": args.reps, "rows": rows,
               "example": runs[names[0]]["b1"][0]["texts"][0]}
    print("wrote", write_results("structured", results, args.out))
    return results


if __name__ == "__main__":
    main()
