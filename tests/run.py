"""`make test`: the suite as two pytest processes side by side, the modules on Ray
(tests/conftest.py RAY_MODULES: they mostly wait on replicas, timers and subprocesses) in one,
the rest (which mostly compute) in the other at a lower CPU priority; each one's report is
printed when both are done.

    python tests/run.py [pytest options...]     e.g. -m "not slow"

Exit status 0 only if both pass (a process that selects no tests passes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TESTS_COLLECTED = 5


def main(argv: list[str]) -> int:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import RAY_MODULES

    ray_files = [f"tests/{name}.py" for name in sorted(RAY_MODULES)]
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv]
    # The Ray tests start clusters, replicas and subprocesses on a deadline; the others, niced,
    # take the CPU that leaves.
    parts = {"tests on Ray": base + ray_files,
             "the other tests": ["nice", "-n", "10", *base, *[f"--ignore={f}" for f in ray_files]]}
    start = time.monotonic()
    runs = {}
    for name, cmd in parts.items():
        log = tempfile.TemporaryFile("w+")
        runs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True), log)
    codes = {}
    for name, (proc, log) in runs.items():
        codes[name] = proc.wait()
        log.seek(0)
        print(f"\n======== {name} (exit {codes[name]}) ========", flush=True)
        sys.stdout.write(log.read())
    ok = all(code in (0, NO_TESTS_COLLECTED) for code in codes.values())
    print(f"\n{'passed' if ok else 'FAILED'}: {', '.join(f'{n} exit {c}' for n, c in codes.items())}; "
          f"{time.monotonic() - start:.0f} s of tests", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
