"""Shared pieces of the benchmarks: workloads from held-out code, timing, result files.

Benchmarks are not tests: they are run on purpose, write JSON (and plots) under bench/results/,
and print a table. Compare figures within one run (the machines are shared and noisy).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODELS = Path(os.environ.get("SPECDECODE_MODELS", ROOT / "models"))


def code_prompts(tokenizer, num: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`num` windows of `prompt_len` tokens from held-out standard-library files (never trained on),
    each starting at the beginning of a line."""
    from bench.eval_models import heldout_documents

    docs = [d for d in heldout_documents(MODELS, tokenizer) if len(d) > prompt_len + 256]
    nl = set(tokenizer.encode("\n", add_special_tokens=False))
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < num:
        d = rng.choice(docs)
        starts = [i + 1 for i, t in enumerate(d[: len(d) - prompt_len - 256]) if t in nl]
        if starts:
            off = rng.choice(starts)
            prompts.append(d[off : off + prompt_len])
    return prompts


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def machine_info() -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_results(name: str, results: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
