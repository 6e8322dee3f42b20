#!/usr/bin/env bash
# One GPU-box call for the extend line: a 256-token extend after a cached 8k prompt (8 layers at the
# Qwen3.6-35B-A3B widths, 37.5% of the experts in device slots, hybrid, Zipf 1.0 routers unless ZIPF says), each
# process a fresh cache with its own B_P, as many processes as RUNS (default 6) and DEADLINE (seconds, default 420)
# allow; then profile_decode's extend (where its time goes) if 60 s are left; then the table of every process
# against the line (engine/bench/extend_table.py: table.md, table.json).
# Run from the repo root on the GPU box with .whl/ (fla-core, einops) and, from an earlier call, .box-cache.tgz
# and .box-cache-triton.tgz (gpu_prelude.sh):
#     OUT=/some/dir bash engine/bench/gpu_extend.sh
#     TESTS=1 ...       first the CUDA expert, kernel and mailbox tests, the prompt's last rows', the bucketed
#                       mixer's graphs and the native runner's (~60 s)
# Before the extends, engine/bench/host_python.py: how much slower the engine thread's Python runs beside the
# CPU's expert workers (host_python.{txt,json}); engine/bench/mixer_host.py: a DeltaNet layer call's host time with
# and without the bucketed mixer (mixer_host.{txt,json}).
#     ARGS="..." ...    more bench model flags for every process (an arm: --extend-idle-ms 300, --cpu-join host)
#     PROFILE_ARGS="..." more profile_decode flags (--extend-runs 8: more timed extends, each with its stalls)
#     PACK=FILE ...     also keeps FILE, a tarball of OUT, fresh every 15 s (see gpu_prelude.sh)
#     ZIPF=A ...        the routers' Zipf exponent (default 1.0); ZIPF= (empty) routes uniformly
#     OFFLOAD=1 ...     after the extends, one offload process: its decode against its fills' bound (offload.*)
#     OLD_NATIVE=FILE   an A/B of a native change on one machine: the processes alternate between the native build
#                       in FILE (an earlier call's box-cache.tgz: old{N}.*) and this tree's (run{N}.*), old first,
#                       and each arm gets its table (old_table.{md,json} beside table.{md,json})
#     OLD=REV | OLD_TREE=DIR  the same for a change of the engine's Python: the old processes run the engine/ of REV
#                       (this checkout's .git: on the box, commits up to the session's start) or of a carried DIR,
#                       with this tree's native build (gpu_prelude.sh's old_tree)
# Results under $OUT: summary.txt (each step with its rc and the second it ended, the extend lines, the table),
# run{N}.{txt,json,log}, profile.{txt,json}, table.{md,json}, pytest.txt.
DEADLINE=${DEADLINE:-420}
ZIPF=${ZIPF-1.0}
source engine/bench/gpu_prelude.sh
S="$OUT/summary.txt"
build_native
nvidia-smi -L >> "$S"
OUT=$(cd "$OUT" && pwd)  # (the old tree's processes run from another directory)
old_tree gpu_extend && old_native
if [ -n "${OLD_NATIVE:-}" ]; then  # both builds kept aside; native/ holds this tree's except while an old run runs
    rm -rf /tmp/ab-native && mkdir -p /tmp/ab-native/new && tar xzf "$OLD_NATIVE" -C /tmp/ab-native &&
        ls /tmp/ab-native/native/_cpu_experts*.so > /dev/null && cp native/_cpu_experts*.so /tmp/ab-native/new/ ||
        { echo "gpu_extend: OLD_NATIVE=$OLD_NATIVE holds no native build" | tee -a "$S"; exit 2; }
fi
if [ -n "${TESTS:-}" ]; then
    timeout "$(upto 150)" $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_experts_cuda.py \
        tests/kernels/test_moe.py tests/kernels/test_mailbox.py tests/native/test_runner_api.py \
        "tests/gpu/test_fast_cuda.py::test_last_rows_of_several_sequences_queue_without_a_host_sync" \
        "tests/gpu/test_fast_cuda.py::test_mixer_graphs_give_the_layers_as_they_come_bit_for_bit" \
        > "$OUT/pytest.txt" 2>&1
    status pytest $?; tail -1 "$OUT/pytest.txt" >> "$S"
fi
# the engine thread's Python idle against beside the prompt workers' read pass (and pinned): ~10 s
timeout "$(upto 40)" $PY -m engine.bench.host_python --json "$OUT/host_python.json" > "$OUT/host_python.txt" 2>&1
status host_python $?; cat "$OUT/host_python.txt" >> "$S"
# a DeltaNet layer call's host time with the bucketed mixer's graph and with the launches as they come: ~30 s
timeout "$(upto 90)" $PY -m engine.bench.mixer_host --json "$OUT/mixer_host.json" > "$OUT/mixer_host.txt" 2>&1
status mixer_host $?; cat "$OUT/mixer_host.txt" >> "$S"
EXT="--synthetic qwen3.6-35b-a3b --layers 8 --batches 1 --moe-slots 37.5% --moe-backend hybrid --steps 8 --warmup 8
     --prefill-runs 1 --extend-runs 5 ${ZIPF:+--router-zipf $ZIPF}"
# a process takes ~25-35 s once the kernels are compiled; the first on a box without the Triton cache compiles and
# autotunes them all (past 80 s more)
limit=90; [ -f .box-cache-triton.tgz ] || limit=200
for i in $(seq 1 "${RUNS:-6}"); do
    [ "$(left)" -gt 100 ] || break
    name=run$i tree=.
    if [ -n "${OLD_NATIVE:-}${OLD_DIR:-}" ] && [ $((i % 2)) = 1 ]; then
        name=old$i
        [ -n "${OLD_NATIVE:-}" ] && cp /tmp/ab-native/native/_cpu_experts*.so native/
        [ -n "${OLD_DIR:-}" ] && tree=$OLD_DIR
    fi
    # shellcheck disable=SC2086  # the flags split on purpose
    (cd "$tree" && XDG_CACHE_HOME=$(mktemp -d) timeout -s ABRT "$(upto $limit)" $PY -X faulthandler \
        -m engine.bench.model $EXT ${ARGS:-} --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.log")
    status "$name" $?
    [ -n "${OLD_NATIVE:-}" ] && cp /tmp/ab-native/new/_cpu_experts*.so native/
    limit=90
    grep -E "extend_256 " "$OUT/$name.txt" | cut -c1-190 | sed "s/^/$name: /" >> "$S"
done
# OFFLOAD=1: one offload process too (uniform routing unless ZIPF says): its decode row against the bound of its
# fills at B_P, the line the extend is held to in the same run (issue 17)
if [ -n "${OFFLOAD:-}" ] && [ "$(left)" -gt 70 ]; then
    timeout -s ABRT "$(upto 70)" $PY -X faulthandler -m engine.bench.model --synthetic qwen3.6-35b-a3b --layers 8 \
        --batches 1 --moe-slots 37.5% --moe-backend offload --steps 48 ${ZIPF:+--router-zipf $ZIPF} \
        --json "$OUT/offload.json" > "$OUT/offload.txt" 2> "$OUT/offload.log"
    status offload $?; grep -E "^decode_b1 |^extend_256 " "$OUT/offload.txt" | cut -c1-250 >> "$S"
fi
if [ "$(left)" -gt 60 ]; then
    timeout -s ABRT "$(upto 80)" $PY -X faulthandler -m engine.bench.profile_decode --layers 8 --moe-backend hybrid \
        --moe-slots 37.5% ${ZIPF:+--router-zipf $ZIPF} --prefill 8192 --extend 256 ${PROFILE_ARGS:-} \
        --json "$OUT/profile.json" \
        > "$OUT/profile.txt" 2> "$OUT/profile.log"
    status profile $?
fi
ls "$OUT"/run*.json > /dev/null 2>&1 && $PY -m engine.bench.extend_table "$OUT"/run*.json --json "$OUT/table.json" \
    > "$OUT/table.md" && cat "$OUT/table.md" >> "$S"
ls "$OUT"/old*.json > /dev/null 2>&1 && $PY -m engine.bench.extend_table "$OUT"/old*.json \
    --json "$OUT/old_table.json" > "$OUT/old_table.md" &&
    { echo "old${OLD_DIR:+ tree}${OLD_NATIVE:+ native}:"; cat "$OUT/old_table.md"; } >> "$S"
date -u >> "$S"
exit 0
