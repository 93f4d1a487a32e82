#!/bin/bash
# One device call (written in stop 39, not run yet: no GPU was lent): the CUDA graphs of the engine's
# steps -- GPU tests, timings with and
# without graphs, exactness of every drafter with graphs on (bench/bench_gpu.py). Needs
# `python -m bench.bench_gpu pack --out gpupack` first (the models as int8, prompts; git-ignored,
# so the device call carries it: carry ["gpupack"]; the tracked models/ and bench/results/ exceed
# the 64 MiB a call takes: untrack them for the call, `git rm --cached -r -q models bench/results`
# with both in .git/info/exclude, and `git reset -q` after), then on the device:
# bash bench/gpu_check.sh (writes under $OUT; ~5 of its 15 minutes).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi -L; python3 -c 'import torch, triton, transformers, sys; print(sys.version, torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'; } > $OUT/env.txt 2>&1
python3 -m bench.bench_gpu unpack --pack gpupack --out /tmp/gpum > $OUT/unpack.log 2>&1 || { el unpack failed; cat $OUT/unpack.log; }
export SPECDECODE_MODELS=/tmp/gpum
el pytest
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" -m gpu tests/test_step_graph.py tests/test_tree.py > $OUT/pytest.log 2>&1; el "pytest rc=$?"
grep -E "passed|failed|FAILED|Error|assert" $OUT/pytest.log | head -20
el graphs
timeout 230 python3 -m bench.bench_gpu graphs --prompts gpupack/prompts.json --out $OUT/graphs.json --repeats 3 > $OUT/graphs.log 2>&1; el "graphs rc=$?"
grep -v "^repetition" $OUT/graphs.log | tail -8 | cut -c1-600
el exact
timeout 120 python3 -m bench.bench_gpu exact --prompts gpupack/prompts.json --out $OUT/exact.json --new-tokens 48 > $OUT/exact.log 2>&1; el "exact rc=$?"
tail -8 $OUT/exact.log | cut -c1-300
el done
