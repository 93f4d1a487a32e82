#!/bin/bash
# The prepared device call: the GPU checks a CPU host cannot make, in sections, most needed first:
#   pytest  the GPU tests of the step graphs and tree kernels (compiled Triton)       <= 150 s
#   trees   trees where verification is flat in tokens: EAGLE-3 trees vs chains,
#           batch 1 and 16 concurrent, the adaptive chain as reference                <= 220 s
#   graphs  the engine's CUDA graphs: timings with and without (bench/bench_gpu.py)  <= 230 s
#   exact   every drafter's greedy text with graphs on equals the target alone       <= 120 s
# One call may run 600 s: `SECTIONS="pytest trees" bash bench/gpu_check.sh` first (timeout_s
# 420), then `SECTIONS="graphs exact"` if device time is left. Needs `python -m bench.bench_gpu
# pack --out gpupack` first (the models as int8, prompts; git-ignored, so the device call carries
# it: carry ["gpupack"]; the tracked models/ and bench/results/ exceed the 64 MiB a call takes:
# untrack them for the call, `git rm --cached -r -q models bench/results` with both in
# .git/info/exclude, and `git reset -q` after). Writes under $OUT.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
SECTIONS=${SECTIONS:-pytest trees graphs exact}
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi -L; python3 -c 'import torch, triton, transformers, sys; print(sys.version, torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'; } > $OUT/env.txt 2>&1
python3 -m bench.bench_gpu unpack --pack gpupack --out /tmp/gpum > $OUT/unpack.log 2>&1 || { el unpack failed; cat $OUT/unpack.log; }
export SPECDECODE_MODELS=/tmp/gpum
for section in $SECTIONS; do
  el "$section"
  case $section in
    pytest)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" -m gpu tests/test_step_graph.py tests/test_tree.py > $OUT/pytest.log 2>&1
      el "pytest rc=$?"
      grep -E "passed|failed|FAILED|Error|assert" $OUT/pytest.log | head -20 ;;
    trees)
      timeout 220 python3 -m bench.bench_tree --device cuda --methods eagle3 --loads "batch 1,16 concurrent" --repeats 2 \
        --only "chain k=5,tree 15/2/10,adaptive tree" --prompts-from gpupack/prompts.json --name gpu_tree > $OUT/tree.log 2>&1
      el "trees rc=$?"
      cp bench/results/nvidia-*/gpu_tree.json bench/results/nvidia-*/gpu_tree.png $OUT/ 2>/dev/null
      grep "^|" $OUT/tree.log | head -16 | cut -c1-300 ;;
    graphs)
      timeout 230 python3 -m bench.bench_gpu graphs --prompts gpupack/prompts.json --out $OUT/graphs.json --repeats 3 > $OUT/graphs.log 2>&1
      el "graphs rc=$?"
      grep -v "^repetition" $OUT/graphs.log | tail -8 | cut -c1-600 ;;
    exact)
      timeout 120 python3 -m bench.bench_gpu exact --prompts gpupack/prompts.json --out $OUT/exact.json --new-tokens 48 > $OUT/exact.log 2>&1
      el "exact rc=$?"
      tail -8 $OUT/exact.log | cut -c1-300 ;;
    *) el "unknown section $section (pytest, trees, graphs, exact)" ;;
  esac
done
el done
