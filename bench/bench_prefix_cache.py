"""A feature drafter behind a prefix-cache hit: mean accepted length and tokens/s (prefill
included) of EAGLE-3 requests whose prompt's blocks were written by an earlier request, against
the same request on a fresh engine. The earlier request either speculated (its drafter ran over
the prompt) or did not (`speculative=False`: its drafter never ran there). The engine recomputes
blocks its drafter has no KV for (`Speculator.usable_prefix`), and its covered copies take over
the cache entry, so the request after it (`third`) reuses them; the "every cached block" rows
turn that filter off, reusing every block and drafting over missing drafter KV, to show what it
buys. Greedy, k = 5 fixed, bf16, prefix caching on; held-out code prompts of `--prompt-len`
tokens; a fresh engine per prompt and scenario. Writes bench/results/<host>/prefix_cache_drafter.json
(or `--out`).

    python -m bench.bench_prefix_cache
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import MODELS, code_prompts, machine_info, table, write_results
from engine import LLM, SamplingParams, SpeculativeConfig

SCENARIOS = {"fresh engine": None, "after a speculating request": True, "after a non-speculating request": False}


def make_llm(filter_prefix: bool) -> LLM:
    spec = SpeculativeConfig(method="eagle3", model=str(MODELS / "eagle3-head"), num_speculative_tokens=5,
                             adaptive=False)
    llm = LLM(str(MODELS / "target"), dtype="bfloat16", device="cpu", speculative=spec, max_num_seqs=4,
              enable_prefix_caching=True, kv_cache_memory_bytes=256 << 20)
    if not filter_prefix:  # every cached block reused, whether the drafter has KV for it or not
        llm.engine.scheduler.prefix_filter = None
    return llm


def second_request(llm: LLM, prompt: list[int], new_tokens: int) -> dict:
    records = []
    llm.engine.step_listeners.append(records.append)
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))[0]
    seconds = time.perf_counter() - t0
    llm.engine.step_listeners.remove(records.append)
    accepted = [a for r in records for a in r.accepted.values()]
    return {"accepted_length": sum(n + 1 for _, n in accepted) / max(len(accepted), 1),
            "cached_tokens": out.num_cached_tokens, "seconds": seconds, "tokens": len(out.token_ids)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=None, help="result JSON (default: bench/results/<host>/prefix_cache_drafter.json)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    prompts = code_prompts(tok, args.prompts, args.prompt_len, seed=args.seed)
    rows = []
    for filter_prefix in (False, True):
        for name, first_speculates in SCENARIOS.items():
            runs, third = [], []
            for p in prompts:
                llm = make_llm(filter_prefix)
                if first_speculates is not None:  # the same prompt, another last token: its blocks are cached
                    llm.generate([p + [11]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                            speculative=first_speculates))
                runs.append(second_request(llm, p + [12], args.new_tokens))
                third.append(second_request(llm, p + [13], args.new_tokens))
            rows.append({
                "prefix reuse": "drafter-covered blocks only" if filter_prefix else "every cached block",
                "scenario": name,
                "mean_accepted_length": statistics.mean(r["accepted_length"] for r in runs),
                "cached_tokens": statistics.mean(r["cached_tokens"] for r in runs),
                "tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs),
                "third_accepted_length": statistics.mean(r["accepted_length"] for r in third),
                "third_cached_tokens": statistics.mean(r["cached_tokens"] for r in third),
                "third_tokens_per_s": sum(r["tokens"] for r in third) / sum(r["seconds"] for r in third),
            })
            print(rows[-1], flush=True)
    print(table(rows, ["prefix reuse", "scenario", "mean_accepted_length", "cached_tokens", "tokens_per_s",
                       "third_accepted_length", "third_cached_tokens", "third_tokens_per_s"]))
    result = {"machine": machine_info(), "args": vars(args), "rows": rows}
    print(f"wrote {write_results('prefix_cache_drafter', result, args.out)}")
    return result


if __name__ == "__main__":
    main()
