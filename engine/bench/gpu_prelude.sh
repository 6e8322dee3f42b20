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
pack() { [ -n "${PACK:-}" ] && tar czf "$PACK.part" --exclude="./box-cache*.tgz" -C "$OUT" . 2>/dev/null &&
         mv -f "$PACK.part" "$PACK"; true; }
# What a fresh machine spends before the first measurement, kept from one call for the next: the native CPU
# kernels' build (75-91 s on the box) and Triton's compiled kernels with their autotuning results (the first
# process compiles and autotunes them all: past 80 s). A call that carries .box-cache.tgz and
# .box-cache-triton.tgz (repo root, ignored by git: copy them there from the last call's $OUT) starts with both;
# every call leaves them in $OUT, the native build and the Triton cache in a file each (a file comes back from
# $OUT only up to 16 MiB, which the two together can pass); the Triton one only while it stays under BOX_CACHE_MIB
# (default 15). The native build is reused only while native/src and setup.py hash the same;
# Triton keys its own cache.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/killick-triton-cache} TRITON_CACHE_AUTOTUNING=1
NATIVE_HASH=$(cat setup.py native/build.py native/src/* 2>/dev/null | sha1sum | cut -c1-16)
for f in .box-cache.tgz .box-cache-triton.tgz; do
    [ -f "$f" ] || continue
    mkdir -p "$TRITON_CACHE_DIR" /tmp/killick-box-cache
    tar xzf "$f" -C /tmp/killick-box-cache 2>/dev/null
done
[ -d /tmp/killick-box-cache/triton ] && cp -rn /tmp/killick-box-cache/triton/. "$TRITON_CACHE_DIR"/
if [ "$(cat /tmp/killick-box-cache/native/hash 2>/dev/null)" = "$NATIVE_HASH" ]; then
    cp /tmp/killick-box-cache/native/*.so native/ 2>/dev/null
fi
box_cache() {  # $OUT/box-cache.tgz and box-cache-triton.tgz: this machine's native build and Triton cache
    local d=/tmp/killick-box-cache-out
    rm -rf "$d" && mkdir -p "$d/native"
    cp native/_cpu_experts*.so "$d/native/" 2>/dev/null && echo "$NATIVE_HASH" > "$d/native/hash"
    tar czf "$OUT/box-cache.tgz" -C "$d" native 2>/dev/null
    if [ -d "$TRITON_CACHE_DIR" ]; then
        cp -r "$TRITON_CACHE_DIR" "$d/triton"
        tar czf "$OUT/box-cache-triton.tgz" -C "$d" triton 2>/dev/null
        local size; size=$(stat -c %s "$OUT/box-cache-triton.tgz" 2>/dev/null || echo 0)
        if [ "$size" -gt $(( ${BOX_CACHE_MIB:-15} << 20 )) ]; then
            rm -f "$OUT/box-cache-triton.tgz"  # would not come back
        fi
    fi
    rm -rf "$d"
}
if [ -n "${PACK:-}" ]; then
    # the loop ends with the script: left running (it holds the script's stdout), a call piping the script into
    # `tail` waited for it until its time limit (2026-12-03: 250 device seconds after the script had finished)
    ( while sleep 15; do pack; done ) > /dev/null 2>&1 &
    PACKER=$!
    trap 'kill $PACKER 2>/dev/null; box_cache; pack' EXIT
else
    trap 'box_cache' EXIT
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# build_native: the CPU expert kernels for this Python, unless they import already. Without them hybrid's CPU share
# and bench bw run torch's path (the fourteenth session's hybrid rows did: a third of the native CPU rate). In
# parallel: one file at a time it ran past 90 s on the box (2026-12-01).
build_native() {
    $PY -c "from native import _cpu_experts" 2>/dev/null && { status "build_native (kept)" 0; return 0; }
    timeout "$(upto 240)" $PY setup.py build_ext --inplace -j "$(nproc)" > "$OUT/build_native.log" 2>&1
    status build_native $?
}
# old_tree NAME: for a call that measures this tree against an earlier one, OLD_DIR (a new directory) holding the
# earlier engine/: `git archive $OLD engine` of this checkout's .git (on the box that .git is the session's starting
# point, so a commit made since is not in it), or a carried OLD_TREE=DIR's. Neither set: returns 1; a tree that
# cannot be had: exits 2, saying so (NAME: the script's). old_native: this tree's native loader and build into
# OLD_DIR's native/ (after build_native), which serve both trees.
old_tree() {
    [ -n "${OLD_TREE:-}${OLD:-}" ] || return 1
    OLD_DIR=$(mktemp -d)
    if [ -n "${OLD_TREE:-}" ]; then
        cp -r "$OLD_TREE/engine" "$OLD_DIR/" ||
            { echo "$1: OLD_TREE=$OLD_TREE holds no engine/" | tee -a "$OUT/summary.txt"; exit 2; }
    else
        git archive "$OLD" engine | tar -x -C "$OLD_DIR" || {
            echo "$1: $OLD is not in this checkout's .git (on the box: the session's starting point); carry the" \
                 "old tree and pass OLD_TREE=DIR" | tee -a "$OUT/summary.txt"; exit 2; }
    fi
}
old_native() { mkdir -p "$OLD_DIR/native" && cp native/*.py native/_cpu_experts*.so "$OLD_DIR/native/" 2>/dev/null; }
# arms_ab ROUNDS A B HEADER: the arms of ARMS ("name: bench model arguments | ...") in ROUNDS rounds, each arm
# run by the script's arm_run NAME SIDE ARGUMENTS... as side A then side B (SIDE: A or B and the round's number),
# then each arm's ab_table, A against B, under "== NAME" and HEADER
arms_ab() {
    local r arm name args
    IFS='|' read -ra arms <<< "$ARMS"
    for r in $(seq 1 "$1"); do
        for arm in "${arms[@]}"; do
            name=$(echo "${arm%%:*}" | tr -d ' ')
            read -ra args <<< "${arm#*:}"
            arm_run "$name" "$2$r" "${args[@]}"
            arm_run "$name" "$3$r" "${args[@]}"
        done
    done
    for arm in "${arms[@]}"; do
        name=$(echo "${arm%%:*}" | tr -d ' ')
        ab_table "$name" "$2" "$3" "== $name$4"
    done
}
# ab_table NAME OLD NEW HEADER: `python -m engine.bench.ab` of $OUT/NAME_OLD*.json against $OUT/NAME_NEW*.json (bench
# model runs of two arms) into $OUT/ab_NAME.{txt,json} under the line HEADER, appended to the summary
ab_table() {
    local old new
    old=$(ls "$OUT/$1_$2"*.json 2>/dev/null); new=$(ls "$OUT/$1_$3"*.json 2>/dev/null)
    [ -n "$old" ] && [ -n "$new" ] || { echo "$1: no pair of results" >> "$OUT/summary.txt"; return; }
    echo "$4" > "$OUT/ab_$1.txt"
    $PY -m engine.bench.ab --old $old --new $new --json "$OUT/ab_$1.json" \
        >> "$OUT/ab_$1.txt" 2>&1
    cat "$OUT/ab_$1.txt" >> "$OUT/summary.txt"
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; nproc; git log -1 --format=%h
  $PY -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"; } > "$OUT/env.log" 2>&1
