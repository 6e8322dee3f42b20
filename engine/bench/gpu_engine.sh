#!/usr/bin/env bash
# One GPU-box call for the engine: CUDA tests of the fast path, then `bench model` on the synthetic
# Qwen3.6-35B-A3B shape at 8 layers and at its full 40 layers, weights drawn on the device (~6 minutes).
# Run from the repo root on the GPU box (torch 2.11+ with CUDA, no internet):
#     OUT=/some/dir bash engine/bench/gpu_engine.sh
# fla-core travels as a wheel in .whl/ (gitignored; `pip download --no-deps fla-core==0.6.0 -d .whl`).
# Everything lands under $OUT: *.log per step, bench_model_*.json, summary.txt. A failing step is logged and
# the session goes on with the next one.
set -x
set -o pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
status() { echo "$1 rc=$2" | tee -a "$OUT/summary.txt"; }

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; nproc; git rev-parse HEAD
  $PY -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
  $PY -c "import fla; print('fla', fla.__version__)"; } > "$OUT/env.log" 2>&1

STAGES=${STAGES:-tests,bench8,bench40}
if [[ $STAGES == *tests* ]]; then
    timeout ${TEST_S:-200} $PY -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_fast_path.py \
        tests/gpu/test_fast_cuda.py tests/gpu/test_engine_cuda.py tests/gpu/test_route_triton.py \
        --junitxml="$OUT/pytest_gpu.xml" > "$OUT/pytest_gpu.log" 2>&1
    status pytest_gpu $?
    tail -5 "$OUT/pytest_gpu.log" >> "$OUT/summary.txt"
fi
if [[ $STAGES == *bench8* ]]; then
    timeout ${BENCH8_S:-150} $PY -m engine.bench.model --synthetic qwen3.6-35b-a3b --layers 8 ${BENCH_ARGS:-} \
        --json "$OUT/bench_model_8.json" > "$OUT/bench_model_8.txt" 2> "$OUT/bench_model_8.log"
    status bench_model_8 $?
    cat "$OUT/bench_model_8.txt" >> "$OUT/summary.txt"
fi
if [[ $STAGES == *bench40* ]]; then
    timeout ${BENCH40_S:-200} $PY -m engine.bench.model --synthetic qwen3.6-35b-a3b ${BENCH_ARGS:-} \
        --json "$OUT/bench_model_40.json" > "$OUT/bench_model_40.txt" 2> "$OUT/bench_model_40.log"
    status bench_model_40 $?
    cat "$OUT/bench_model_40.txt" >> "$OUT/summary.txt"
fi
date -u >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit 0
