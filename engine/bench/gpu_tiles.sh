#!/usr/bin/env bash
# One GPU-box call for the decode projections' tiles on this GPU: `python -m engine.bench.tiles --only projections
# --batch 1` (every candidate over weights read from HBM), the best tiles of each width class over a decode step's
# worth of its projections, then `bench model` decode rows alternated between the engine's own tiles ("own") and
# that choice ("swept", --skinny-tiles), so the whole step says what the kernels' sweep is worth:
#   ARMS        "name: bench model arguments | ..." (beside $MODEL_ARGS --batches 1 --prefill 0), default every
#               expert resident and offload with 37.5% in slots (uniform routing)
#   MODEL_ARGS  default "--synthetic qwen3.6-35b-a3b --layers 8 --steps 64"; ROUNDS rounds of own then swept
#               (default 2)
#   TESTS=1     first the CUDA expert, kernel and mailbox tests (as gpu_extend.sh's)
#     OUT=/some/dir [PACK=FILE] bash engine/bench/gpu_tiles.sh
# Results under $OUT: summary.txt (each step's rc and the second it ended), tiles.{txt,json},
# <arm>_{own,swept}<round>.{txt,json,log}, ab_<arm>.txt (python -m engine.bench.ab: own as old, swept as new).
DEADLINE=${DEADLINE:-540}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
S="$OUT/summary.txt"
MODEL_ARGS=${MODEL_ARGS:-"--synthetic qwen3.6-35b-a3b --layers 8 --steps 64"}
ARMS=${ARMS:-"res: --moe-backend fused | uoff: --moe-backend offload --moe-slots 37.5%"}
build_native
nvidia-smi -L >> "$S"
if [ -n "${TESTS:-}" ]; then
    timeout "$(upto 150)" $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_experts_cuda.py \
        tests/kernels/test_moe.py tests/kernels/test_mailbox.py tests/kernels/test_linear.py \
        tests/native/test_runner_api.py > "$OUT/pytest.txt" 2>&1
    status pytest $?; tail -1 "$OUT/pytest.txt" >> "$S"
fi
timeout "$(upto 120)" $PY -m engine.bench.tiles --only projections --batch 1 --json "$OUT/tiles.json" \
    > "$OUT/tiles.txt" 2>&1
status tiles $?
grep -E "^HBM|^best|--skinny-tiles" "$OUT/tiles.txt" >> "$S"
SWEPT=$(grep -oE -- "--skinny-tiles [^ ]+" "$OUT/tiles.txt" | head -1 | cut -d' ' -f2)
[ -n "$SWEPT" ] || { echo "gpu_tiles: the sweep chose no tiles" | tee -a "$S"; exit 2; }

bench() {  # name, arguments...
    local name=$1
    shift
    [ "$(left)" -gt 30 ] || { status "$name skipped, deadline" 0; return; }
    timeout -s ABRT "$(upto ${BENCH_S:-90})" $PY -X faulthandler -m engine.bench.model $MODEL_ARGS --batches 1 \
        --prefill 0 "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.log"
    status "$name" $?
}
arm_run() {  # name, side (own1, swept1, ...), arguments: the swept side with the sweep's tiles
    local name=$1 side=$2
    shift 2
    [ "${side#swept}" != "$side" ] && set -- "$@" --skinny-tiles "$SWEPT"
    bench "${name}_$side" "$@"
}
arms_ab "${ROUNDS:-2}" own swept " (old: the engine's tiles, new: --skinny-tiles $SWEPT)"
date -u >> "$S"
cat "$S"
exit 0
