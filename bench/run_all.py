"""`make bench`: every benchmark in one go (about 25-40 minutes on a 2-core CPU), each writing
bench/results/<host>/<bench>.json, then bench/results/README.md regenerated.

    python -m bench.run_all [--sweep]
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sweep", action="store_true", help="also the k = 1..8 sweep of every drafter")
    args = ap.parse_args(argv)
    steps = [
        ["bench/eval_models.py"],
        ["-m", "bench.bench_engine"],
        ["-m", "bench.bench_spec", *(["--sweep"] if args.sweep else [])],
        ["-m", "bench.bench_serve"],
        ["-m", "bench.bench_pd"],
        ["-m", "bench.bench_remote_drafter"],
        ["-m", "bench.results_index"],
    ]
    failed = 0
    for step in steps:
        print(f"== {' '.join(step)}", flush=True)
        failed |= subprocess.call([sys.executable, *step]) != 0
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
