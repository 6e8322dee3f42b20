#!/usr/bin/env bash
# One GPU-box call: `bench model` rows of two trees of the engine alternated on one machine (old, new, old, new,
# ...), so a change is measured against what it changed within one call, machine and load:
#   OLD=REV      the old tree is `git archive REV engine` of this checkout's .git; on the box that .git is the
#                session's starting point, so a commit made since is not in it: then
#   OLD_TREE=DIR a directory carried with the call (untracked in the repo root) holding the old engine/
#   ARMS         "name: bench model arguments | name: arguments | ..." (beside $MODEL_ARGS --batches 1), e.g.
#                ARMS="uoff: --moe-backend offload --moe-slots 37.5% | zoff: --moe-backend offload --moe-slots 37.5% --router-zipf 1.0"
#   MODEL_ARGS   default "--synthetic qwen3.6-35b-a3b --layers 8"; ROUNDS runs of each arm per tree (default 1)
# The first bench model process on a fresh machine compiles and autotunes the Triton kernels (one ran past 80 s,
# 2026-12-03): WARM=1 (default) runs a short unrecorded one first. The native CPU kernels are built first
# (build_native) and serve both trees.
#     OLD=8bb1d35 ARMS="..." OUT=/some/dir [PACK=FILE] bash engine/bench/gpu_ab.sh
# Results under $OUT: summary.txt (each run's rc and the second it ended), <arm>_{old,new}<round>.{txt,json,log},
# ab_<arm>.txt (python -m engine.bench.ab: each row old, new, new / old), all of them in summary.txt.
DEADLINE=${DEADLINE:-540}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
S="$OUT/summary.txt"
MODEL_ARGS=${MODEL_ARGS:-"--synthetic qwen3.6-35b-a3b --layers 8"}
ROOT=$PWD
old_tree gpu_ab ||
    { echo "gpu_ab: set OLD=REV or OLD_TREE=DIR (the tree to compare this one with)" | tee -a "$S"; exit 2; }
[ -n "${ARMS:-}" ] || { echo "gpu_ab: set ARMS=\"name: bench model arguments | ...\"" | tee -a "$S"; exit 2; }
build_native
old_native

bench() {  # name, directory, arguments...
    local name=$1 dir=$2
    shift 2
    [ "$(left)" -gt 30 ] || { status "$name skipped, deadline" 0; return; }
    ( cd "$dir" && timeout -s ABRT "$(upto ${BENCH_S:-120})" $PY -X faulthandler -m engine.bench.model $MODEL_ARGS \
        --batches 1 "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.log" )
    status "$name" $?
}
if [ "${WARM:-1}" != 0 ]; then  # compiles and autotunes the kernels both trees use; not recorded
    bench warm "$ROOT" --prefill 0 --steps 8 --moe-backend offload --moe-slots 37.5%
fi
arm_run() {  # name, side (old1, new1, ...), arguments: from the old tree or this one
    local name=$1 side=$2
    shift 2
    local dir=$ROOT
    [ "${side#old}" != "$side" ] && dir=$OLD_DIR
    bench "${name}_$side" "$dir" "$@"
}
arms_ab "${ROUNDS:-1}" old new ""
date -u >> "$S"
cat "$S"
exit 0
