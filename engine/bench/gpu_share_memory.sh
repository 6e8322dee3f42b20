#!/usr/bin/env bash
# One GPU-box call: does a hybrid decode that starts from the kept CPU share (graph_cpu.CpuShare keeps where its
# search settled or stands after KEEP_STEPS steps: profile.ShareMemory, in $XDG_CACHE_HOME/killick) beat one that
# starts from the rates' balance,
# over a short run (the search's first steps are where the two differ)?
#   1. the native CPU kernels (the CPU share runs on them)
#   2. settle: one run with a long warm-up in a cache directory of its own, so that its search settles or runs
#      past KEEP_STEPS and keeps its best share there (its JSON's graph_cpu.settled says it did)
#   3. ROUNDS (default 3) pairs of short runs, alternated: cold (a fresh, empty cache directory each: the search
#      starts at the rates' balance) and warm (the settle run's directory: it starts at the kept share)
# Neither side has a `bench bw` profile (both cache directories are new), so the cold start is the rates'
# balance without the STREAM figure, as on a machine that never ran `bench bw`.
#     OUT=/some/dir [PACK=FILE] [ROUNDS=N] [ARGS="bench model arguments"] bash engine/bench/gpu_share_memory.sh
# Results under $OUT: summary.txt (each run's decode row and its search's start, best and kept shares),
# {settle,cold<r>,warm<r>}.{txt,json,log}, ab.txt (python -m engine.bench.ab: cold as old, warm as new).
DEADLINE=${DEADLINE:-540}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
S="$OUT/summary.txt"
ARGS=${ARGS:-"--synthetic qwen3.6-35b-a3b --layers 8 --moe-backend hybrid --moe-slots 37.5% --prefill 0 --batches 1"}
build_native
KEEP=$(mktemp -d)
run() {  # name, cache directory, further bench model arguments
    local name=$1 dir=$2
    shift 2
    [ "$(left)" -gt 40 ] || { status "$name skipped, deadline" 0; return; }
    XDG_CACHE_HOME=$dir timeout -s ABRT "$(upto 150)" $PY -X faulthandler -m engine.bench.model $ARGS "$@" \
        --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.log"
    status "$name" $?
    grep -E "^decode_b|CPU share inside" "$OUT/$name.txt" | sed "s/^/$name: /" >> "$S"
}
run settle "$KEEP" --warmup 400 --steps 200
for r in $(seq 1 "${ROUNDS:-3}"); do
    run "cold$r" "$(mktemp -d)" --steps 96
    run "warm$r" "$KEEP" --steps 96
done
old=$(ls "$OUT"/cold*.json 2>/dev/null); new=$(ls "$OUT"/warm*.json 2>/dev/null)
if [ -n "$old" ] && [ -n "$new" ]; then
    $PY -m engine.bench.ab --old $old --new $new --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
    cat "$OUT/ab.txt" >> "$S"
else
    echo "no pair of cold and warm runs" >> "$S"
fi
date -u >> "$S"
cat "$S"
exit 0
