# Sourced by the GPU-box scripts (gpu_engine.sh, gpu_experts.sh): $OUT, $PY, status(), the offline wheels of
# .whl/ on PYTHONPATH, and what the machine is in $OUT/env.log.
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
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; nproc; git log -1 --format=%h
  $PY -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"; } > "$OUT/env.log" 2>&1
