"""The packed CPU matmul (kernels/cpu_rows.cpp `packed_linear`) against another version of the
same source, interleaved, on the shipped target's matrix shapes: the time of x[M, K] @ w.T for
M rows (1: a decode step, 5 / 9: a verification of 4 / 8 drafts, 16: 16 concurrent requests,
128 / 512: prefill chunks) and the multiply-adds per second. Both versions must give the same
bits (checked). Example, against the kernel before a change:

    git show 80ab678:kernels/cpu_rows.cpp > /tmp/cpu_rows_before.cpp
    python -m bench.bench_kernels --baseline /tmp/cpu_rows_before.cpp --out bench/results/kernels.json

Timings: per configuration `--reps` interleaved rounds (baseline, current, baseline, ...) of
`--calls` calls each; the medians are reported. One thread unless --threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from bench.common import RESULTS, machine_info, table

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "cpu_rows.cpp"
SHAPES = ((2816, 512), (1024, 512), (512, 1408))  # gate+up, q/k/v, down of the shipped target
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def build(name: str, source: Path):
    out = Path("build") / "bench_kernels" / name
    out.mkdir(parents=True, exist_ok=True)
    return load(name=f"bench_rows_{name}", sources=[str(source)], extra_cflags=FLAGS, build_directory=str(out))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="another cpu_rows.cpp to compare against (optional)")
    ap.add_argument("--rows", default="1,5,9,16,128,512")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "kernels.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    mods = {"current": build("current", SOURCE)}
    if args.baseline:
        mods["baseline"] = build("baseline", args.baseline)
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype in args.dtypes.split(","):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g).to(getattr(torch, dtype))
            packed = {name: m.pack_rows(w) for name, m in mods.items()}
            for m_rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m_rows, k, generator=g)
                outs = {name: mods[name].packed_linear(x, packed[name], n, torch.empty(0)) for name in mods}
                if "baseline" in outs:
                    assert torch.equal(outs["current"], outs["baseline"]), (dtype, n, k, m_rows)
                calls = max(1, args.calls * 16 // max(m_rows, 16))
                times: dict[str, list[float]] = {name: [] for name in mods}
                for rep in range(args.reps):
                    for name in (list(mods) if rep % 2 == 0 else list(mods)[::-1]):
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            mods[name].packed_linear(x, packed[name], n, torch.empty(0))
                        times[name].append((time.perf_counter() - t0) / calls)
                row = {"dtype": dtype, "shape": f"{n}x{k}", "rows": m_rows}
                for name, ts in times.items():
                    row[f"{name}_us"] = 1e6 * statistics.median(ts)
                    row[f"{name}_gmac_s"] = n * k * m_rows / statistics.median(ts) / 1e9
                if "baseline" in times:
                    row["speedup"] = row["baseline_us"] / row["current_us"]
                rows.append(row)
                print(row, flush=True)
    cols = ["dtype", "shape", "rows", "current_us", "current_gmac_s"]
    if args.baseline:
        cols += ["baseline_us", "baseline_gmac_s", "speedup"]
    print(table(rows, cols))
    results = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
