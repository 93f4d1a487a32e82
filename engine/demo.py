"""`make demo`: ask SmolLM2-135M-Instruct a question (rendered by its chat template), with and
without speculation; `make demo-code`: the project's code model completes a Python prompt.

    python -m engine.demo ["Why is the sky blue?"] [--model PATH] [--method ngram|eagle3] [-k 4] [--max-tokens 96]
    python -m engine.demo --code ["def fib(n):"] [--method eagle3] [--no-token-healing]

Code completion heals the prompt's last token: a prompt ending in a newline would otherwise end
with a lone newline token (the tokenizer merges a newline with the next line's indentation),
which the model continues at column 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from engine import LLM, SamplingParams, SpeculativeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# method -> shipped checkpoint for the code model (None: no model, or, for mtp, the MTP layers in
# the target's own checkpoint)
CODE_DRAFTERS = {"draft": "models/drafter", "eagle3": "models/eagle3-head", "mtp": None, "ngram": None}
# method -> shipped drafter for SmolLM2-135M-Instruct (no smaller SmolLM2 to draft with, no MTP layers)
CHAT_DRAFTERS = {"eagle3": "models/eagle3-smollm2", "ngram": None}
QUESTION = "Explain in three sentences why the sky is blue."
CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default=None, help="the question (chat) or the code to complete (--code)")
    ap.add_argument("--code", action="store_true", help="the code model (models/target) completes a prompt")
    ap.add_argument("--model", default=None, help="a checkpoint directory or GGUF file")
    ap.add_argument("--method", default=None, choices=sorted(CODE_DRAFTERS),
                    help="the drafter (default: ngram for chat, which also has eagle3; eagle3 for code)")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-token-healing", dest="token_healing", action="store_false",
                    help="complete a code prompt as tokenized (no healing of its last token)")
    args = ap.parse_args(argv)
    method = args.method or ("eagle3" if args.code else "ngram")
    if args.code:
        model = args.model or os.path.join(ROOT, "models/target")
        drafter = CODE_DRAFTERS[method] and os.path.join(ROOT, CODE_DRAFTERS[method])
    else:
        if args.model is None:
            from models.fetch import fetch

            args.model = str(fetch("smollm2"))
        if method not in CHAT_DRAFTERS:
            print(f"--method {method}: no {method} drafter ships for the chat model; use "
                  f"{' or '.join(sorted(CHAT_DRAFTERS))}", file=sys.stderr)
            return 2
        model, drafter = args.model, CHAT_DRAFTERS[method] and os.path.join(ROOT, CHAT_DRAFTERS[method])
    if not os.path.exists(model):
        print(f"no model at {model}; the shipped models are in git (models/), SmolLM2 comes with "
              "`python -m models fetch smollm2`", file=sys.stderr)
        return 1
    spec = SpeculativeConfig(method=method, model=drafter, num_speculative_tokens=args.k)
    for name, kwargs in (("no speculation", {}), (f"speculative ({method}, k<={args.k})", {"speculative": spec})):
        llm = LLM(model, **kwargs)
        if args.code:
            prompt = args.prompt or CODE_PROMPT
            shown = prompt
            sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, token_healing=args.token_healing)
        else:
            question = args.prompt or QUESTION
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                       add_generation_prompt=True)
            shown = f"user: {question}\nassistant: "
            sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp)[0]
        dt = time.perf_counter() - t0
        print(f"=== {name}: {len(out.token_ids)} tokens in {dt:.2f}s ({len(out.token_ids) / dt:.1f} tokens/s)")
        print(shown + out.text)
        if out.spec_stats:
            s = out.spec_stats
            print(f"--- drafted {s['num_draft_tokens']}, accepted {s['num_accepted_tokens']} "
                  f"({s['acceptance_rate']:.0%}), mean accepted length {s['mean_accepted_length']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
