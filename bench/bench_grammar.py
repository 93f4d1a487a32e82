"""llguidance against xgrammar on the served model's tokenizer: what choosing the grammar library
for structured output rests on.

    python -m bench.bench_grammar [--tokenizer models/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--repeats 5] [--out PATH]

For each library (xgrammar only where it imports: it is not a dependency; `pip install --no-deps
--target DIR xgrammar apache-tvm-ffi` and PYTHONPATH=DIR to include it):
- tokenizer: building the library's view of the vocabulary (once per engine);
- compile: a grammar from scratch, for three JSON schemas (flat, nested with arrays and enums,
  wide with 24 properties), a regex and a Lark grammar (once per distinct grammar: both cache);
- mask: the per-token cost while generating: the next-token mask at every position of a
  valid output (the schema's example, tokenized), then the token accepted; what a decode step
  pays per constrained request, on the engine thread (the median over positions and repeats);
- draft walk: a speculative step's masks for a chain of 4 drafts (accept 4, 5 masks, roll back 4).
Medians over --repeats runs, one process, interleaved library by library. Writes
bench/results/<host>/grammar.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

FLAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {
        "enum": ["admin", "dev", "ops"]}}}, "required": ["id", "tags"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}}}, "required": ["user", "items"]}
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "number", "null"]} for i in range(24)},
        "required": [f"field_{i}" for i in range(24)]}
EXAMPLES = {
    "flat": (FLAT, {"name": "Ada Lovelace", "age": 36, "ok": True}),
    "nested": (NESTED, {"user": {"id": 7, "tags": ["dev", "ops"]},
                        "items": [{"sku": "ABC-1234", "qty": 2}, {"sku": "XYZ-0001", "qty": 10}]}),
    "wide": (WIDE, {f"field_{i}": (f"v{i}" if i % 3 == 0 else i * 1.5 if i % 3 == 1 else None) for i in range(24)}),
}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/'


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        from engine.structured_output import ll_tokenizer

        self.tok = ll_tokenizer(tokenizer)

    def compile(self, kind: str, spec: str):
        from llguidance import LLMatcher

        grammar = {"json": lambda s: LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False}),
                   "regex": LLMatcher.grammar_from_regex, "lark": LLMatcher.grammar_from_lark}[kind](spec)
        matcher = LLMatcher(self.tok, grammar)
        matcher.compute_bitmask()  # llguidance builds lazily: the first mask is part of compiling
        matcher.reset()
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def mask(self, matcher) -> None:
        matcher.compute_bitmask()

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, self.info.vocab_size)

    def compile(self, kind: str, spec: str):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
        return c.compile_regex(spec) if kind == "regex" else c.compile_grammar(self.xgr.Grammar.from_ebnf(
            'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=16)

    def mask(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)


def measure(lib, tokenizer, repeats: int) -> dict:
    out: dict = {}
    for name, (schema, example) in EXAMPLES.items():
        spec = json.dumps(schema)
        compiles, masks, walks = [], [], []
        text = json.dumps(example, separators=(",", ":"))
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
        for _ in range(repeats):
            compiled, seconds = timed(lib.compile, "json", spec)
            compiles.append(seconds)
            m = lib.matcher(compiled)
            for t in tokens:
                _, seconds = timed(lib.mask, m)
                masks.append(seconds)
                lib.accept(m, t)
            m = lib.matcher(compiled)
            for i in range(0, len(tokens) - 5, 5):  # a 4-draft chain at every 5th position
                t0 = time.perf_counter()
                for t in tokens[i : i + 4]:
                    lib.mask(m)
                    lib.accept(m, t)
                lib.mask(m)
                lib.rollback(m, 4)
                walks.append(time.perf_counter() - t0)
                for t in tokens[i : i + 5]:
                    lib.accept(m, t)
        out[f"json_{name}"] = {"compile_ms": statistics.median(compiles) * 1e3, "mask_us": statistics.median(masks) * 1e6,
                               "draft_walk_us": statistics.median(walks) * 1e6, "tokens": len(tokens)}
    for kind, spec in (("regex", REGEX), ("lark", LARK)):
        out[kind] = {"compile_ms": statistics.median(timed(lib.compile, kind, spec)[1] for _ in range(repeats)) * 1e3}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default="models/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from bench.common import write_results
    from deployments.config import resolve_path
    from engine.llm import load_tokenizer

    tokenizer = load_tokenizer(resolve_path(args.tokenizer))
    libs = [LLGuidance]
    try:
        import xgrammar  # noqa: F401

        libs.append(XGrammar)
    except ImportError:
        print("xgrammar is not importable: llguidance alone", file=sys.stderr)
    report = {"benchmark": "grammar_libraries", "tokenizer": args.tokenizer, "vocab": len(tokenizer),
              "repeats": args.repeats, "results": {}}
    for cls in libs:
        lib, seconds = timed(cls, tokenizer)
        report["results"][cls.name] = {"tokenizer_s": seconds, **measure(lib, tokenizer, args.repeats)}
    print("| library | tokenizer (s) | grammar | compile (ms) | mask per token (µs) | 4-draft walk (µs) |")
    print("|---|---|---|---|---|---|")
    for name, r in report["results"].items():
        for grammar, g in r.items():
            if isinstance(g, dict):
                print(f"| {name} | {r['tokenizer_s']:.2f} | {grammar} | {g['compile_ms']:.1f} | "
                      f"{g.get('mask_us', float('nan')):.0f} | {g.get('draft_walk_us', float('nan')):.0f} |")
    out = write_results("grammar", report, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
