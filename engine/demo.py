"""`make demo`: complete a Python prompt with the shipped target, with and without speculation.

    python -m engine.demo ["def fib(n):"] [--method eagle3] [-k 4] [--max-tokens 96] [--no-token-healing]

Token healing is on: a prompt ending in a newline would otherwise end with a lone newline token
(the tokenizer merges a newline with the next line's indentation), which the model continues at
column 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from engine import LLM, SamplingParams, SpeculativeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# method -> shipped checkpoint (None: no model, or, for mtp, the MTP layers in the target's own checkpoint)
DRAFTERS = {"draft": "models/drafter", "eagle3": "models/eagle3-head", "mtp": None, "ngram": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    ap.add_argument("--model", default=os.path.join(ROOT, "models/target"))
    ap.add_argument("--method", default="eagle3", choices=sorted(DRAFTERS))
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-token-healing", dest="token_healing", action="store_false",
                    help="complete the prompt as tokenized (no healing of its last token)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.model):
        print(f"no model at {args.model}; the shipped models are in git (models/); their training commands are in models/*/README.md", file=sys.stderr)
        return 1
    drafter = DRAFTERS[args.method]
    spec = SpeculativeConfig(method=args.method, model=drafter and os.path.join(ROOT, drafter), num_speculative_tokens=args.k)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, token_healing=args.token_healing)
    for name, kwargs in (("no speculation", {}), (f"speculative ({args.method}, k<={args.k})", {"speculative": spec})):
        llm = LLM(args.model, **kwargs)
        llm.generate([args.prompt], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        t0 = time.perf_counter()
        out = llm.generate([args.prompt], sp)[0]
        dt = time.perf_counter() - t0
        print(f"=== {name}: {len(out.token_ids)} tokens in {dt:.2f}s ({len(out.token_ids) / dt:.1f} tokens/s)")
        print(args.prompt + out.text)
        if out.spec_stats:
            s = out.spec_stats
            print(f"--- drafted {s['num_draft_tokens']}, accepted {s['num_accepted_tokens']} "
                  f"({s['acceptance_rate']:.0%}), mean accepted length {s['mean_accepted_length']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
