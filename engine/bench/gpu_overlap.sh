#!/usr/bin/env bash
# One GPU-box call: overlapped decode against one step at a time (`--no-overlap`), same process kind, same
# machine, whole engine (`python -m engine.bench.model`, decode rows only, `--prefill 0`), in this order:
#   1. tests/engine/test_overlap.py on CUDA (tokens, usage and cache entries as one step at a time)
#   2. 8 layers at the Qwen3.6-35B-A3B widths, every expert resident: batch 1 and 4, overlapped / not
#   3. the same, 37.5% of the experts in device slots (offload, mapped decode): batch 1, overlapped / not
#   4. all 40 layers, resident: batch 1 and 8, overlapped / not (the 70 GB of weights drawn on the device, ~2
#      minutes a run), then the first 8-layer run again (the spread between two runs of one kind), while the
#      deadline leaves time (about 9 minutes in all on a fresh machine: TEST=0 skips step 1)
# TEMPERATURE=1 decodes sampled, as an agent's requests (default 0: greedy).
# Run from the repo root on the GPU box with .whl/ (fla-core, pydantic and its deps):
#     OUT=/some/dir [PACK=FILE] bash engine/bench/gpu_overlap.sh
# Results under $OUT: summary.txt (each run's table, its rc and the second it ended), <run>.{txt,json,log},
# pytest_overlap.log.
DEADLINE=${DEADLINE:-560}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
S="$OUT/summary.txt"
T=${TEMPERATURE:-0}

if [ "${TEST:-1}" != 0 ]; then
    timeout "$(upto 120)" $PY -m pytest -q -p no:cacheprovider tests/engine/test_overlap.py > "$OUT/pytest_overlap.log" 2>&1
    status pytest_overlap $?
    tail -3 "$OUT/pytest_overlap.log" >> "$S"
fi

run() {  # name, seconds it may take, bench model arguments...
    local name=$1 limit=$2
    shift 2
    [ "$(left)" -gt 30 ] || { status "${name} skipped, deadline" 0; return; }
    timeout -s ABRT "$(upto "$limit")" $PY -X faulthandler -m engine.bench.model --synthetic qwen3.6-35b-a3b \
        --steps 64 --prefill 0 --temperature "$T" "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.log"
    status "$name" $?
    grep -v "^\[" "$OUT/$name.txt" >> "$S"
}
run L8_overlap 110 --layers 8 --batches 1,4
run L8_one_at_a_time 110 --layers 8 --batches 1,4 --no-overlap
run L8_offload_overlap 120 --layers 8 --batches 1 --moe-backend offload --moe-slots 37.5%
run L8_offload_one_at_a_time 120 --layers 8 --batches 1 --moe-backend offload --moe-slots 37.5% --no-overlap
run L40_overlap 200 --batches 1,8 --steps 32
run L40_one_at_a_time 200 --batches 1,8 --steps 32 --no-overlap
run L8_overlap_again 110 --layers 8 --batches 1,4
date -u >> "$S"
cat "$S"
exit 0
