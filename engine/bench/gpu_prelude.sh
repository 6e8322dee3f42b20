# Sourced by the GPU-box scripts (gpu_engine.sh, gpu_experts.sh): $OUT, $PY, status(), left(), the offline
# wheels of .whl/ on PYTHONPATH, what the machine is in $OUT/env.log, and with PACK=FILE a tarball of $OUT
# refreshed every 15 s (a call that returns only a few files, or is cut off at its limit, still brings back
# everything written so far).
set -x
set -o pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
# DEADLINE: seconds this script may run in all; left() is what remains of it, and each step's timeout is the
# smaller of its own and that, so the last step ends before the call's limit instead of being cut mid-write.
DEADLINE=${DEADLINE:-100000}
left() { echo $(( DEADLINE - SECONDS )); }
upto() { local l; l=$(left); echo $(( $1 < l ? $1 : (l > 1 ? l : 1) )); }
status() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a "$OUT/summary.txt"; }
pack() { [ -n "${PACK:-}" ] && tar czf "$PACK.part" -C "$OUT" . 2>/dev/null && mv -f "$PACK.part" "$PACK"; true; }
if [ -n "${PACK:-}" ]; then
    # the loop ends with the script: left running (it holds the script's stdout), a call piping the script into
    # `tail` waited for it until its time limit (2026-12-03: 250 device seconds after the script had finished)
    ( while sleep 15; do pack; done ) > /dev/null 2>&1 &
    PACKER=$!
    trap 'kill $PACKER 2>/dev/null; pack' EXIT
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# build_native: the CPU expert kernels for this Python, unless they import already. Without them hybrid's CPU share
# and bench bw run torch's path (the fourteenth session's hybrid rows did: a third of the native CPU rate). In
# parallel: one file at a time it ran past 90 s on the box (2026-12-01).
build_native() {
    $PY -c "from native import _cpu_experts" 2>/dev/null && return 0
    timeout "$(upto 240)" $PY setup.py build_ext --inplace -j "$(nproc)" > "$OUT/build_native.log" 2>&1
    status build_native $?
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; nproc; git log -1 --format=%h
  $PY -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"; } > "$OUT/env.log" 2>&1
