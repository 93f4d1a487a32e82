"""Shared pieces of the benchmarks: workloads from held-out code, timing, result files.

Benchmarks are not tests: they are run on purpose, write `bench/results/<host>/<bench>.json`
(and plots beside it) through `write_results`, which stamps each file with where and from what it
was measured, and print a table. Compare figures within one run on one host class.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODELS = Path(os.environ.get("SPECDECODE_MODELS", ROOT / "models"))


def heldout_documents(models_dir: Path, tokenizer) -> list[list[int]]:
    """Token ids (``<|bos|> ... <|endoftext|>``) of every held-out file."""
    from training import data

    root = data.stdlib_root()
    files = data.read_file_list(models_dir / "heldout_files.txt")
    docs = []
    for rel in files:
        ids = tokenizer(data.read_text(root, rel))["input_ids"]
        docs.append([*ids, data.EOS_ID])
    return docs


def code_prompts(tokenizer, num: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`num` windows of `prompt_len` tokens from held-out standard-library files (never trained on),
    each starting at the beginning of a line."""
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


# The CPU features the kernels dispatch on (kernels/): what makes two CPU hosts comparable.
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8")


def cpu_info(cpuinfo: str | None = None) -> dict:
    """Vendor, model name, family/model numbers and the `CPU_FLAGS` this CPU has, from
    /proc/cpuinfo (or the text given); empty fields where the platform has none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # the first processor's block is enough
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "vendor": fields.get("vendor_id", ""),
        "model_name": fields.get("model name", "") or platform.processor(),
        "family": int(fields["cpu family"]) if fields.get("cpu family", "").isdigit() else None,
        "model": int(fields["model"]) if fields.get("model", "").isdigit() else None,
        "flags": [f for f in CPU_FLAGS if f in flags],
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


def host_class(cpu: dict | None = None, gpu: str | None = None) -> str:
    """The name results are filed under: the GPU's (`nvidia-h200`) when one was used, else the CPU
    class whose kernels run (`intel-amx`, `intel-avx512`, `intel-avx2`, `amd-zen4`, `amd-zen3`,
    `amd-zen5`, `amd-zen2`), else the CPU's model name made a slug.

        host_class({"vendor": "AuthenticAMD", "family": 25, "flags": ["avx2", "avx512f"]}) == "amd-zen4"
        host_class(gpu="NVIDIA H100 80GB HBM3") == "nvidia-h100"
    """
    if gpu:
        return "-".join(_slug(gpu).split("-")[:2])
    cpu = cpu_info() if cpu is None else cpu
    flags = set(cpu.get("flags", ()))
    vendor = cpu.get("vendor", "")
    if vendor == "GenuineIntel":
        if "amx_tile" in flags:
            return "intel-amx"
        if "avx512f" in flags:
            return "intel-avx512"
        if "avx2" in flags:
            return "intel-avx2"
    if vendor == "AuthenticAMD":
        # Family 25 (0x19) is Zen 3 and Zen 4; of the two only Zen 4 has AVX-512.
        zen = {23: "zen2", 25: "zen4" if "avx512f" in flags else "zen3", 26: "zen5"}.get(cpu.get("family"))
        if zen:
            return f"amd-{zen}"
    return _slug(cpu.get("model_name", "")) or _slug(platform.machine()) or "unknown"


def used_gpu() -> str | None:
    """The CUDA device's name if this process used one (a bench on `--device cuda`), else None."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.get_device_name()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this process, as typed: `python -m bench.bench_spec --repeats 5`."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and not spec.name.endswith("__main__"):
        head = ["python", "-m", spec.name]
    else:
        script = Path(argv[0]) if argv else Path("python")
        head = ["python", str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else str(script)]
    return shlex.join([*head, *argv[1:]])


def provenance(gpu: str | None = None) -> dict:
    """What a result was measured on and from: commit (and whether tracked files outside
    bench/results/ had changes), UTC date, host class, CPU model and flags, cores, GPU, torch,
    and the command line."""
    cpu = cpu_info()
    gpu = gpu or used_gpu()
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": host_class(cpu, gpu),
        "cpu": cpu["model_name"],
        "cpu_flags": cpu["flags"],
        "cores": os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "command": command_line(),
    }


def result_path(name: str, suffix: str = ".json", gpu: str | None = None) -> Path:
    """`bench/results/<host>/<name><suffix>`: where a bench files a result (or its plot) here."""
    folder = RESULTS / host_class(gpu=gpu or used_gpu())
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}{suffix}"


def write_results(name: str, results: dict, out: str | Path | None = None) -> Path:
    """Write `results` with a `provenance` stamp to `out`, by default `result_path(name)`; every
    bench writes its JSON through here."""
    path = Path(out) if out else result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**results, "provenance": provenance()}, indent=2) + "\n")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
