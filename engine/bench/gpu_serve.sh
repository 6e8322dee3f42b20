#!/usr/bin/env bash
# One GPU-box call for issue 20's serve line: `killick serve` against `bench model` on the same checkpoint, and
# where serve's extra time goes. About 4 minutes on a fresh machine (most of it loading and compiling):
#   1. the 8-layer Qwen3.6-35B-A3B-width checkpoint drawn on the device with the shipped tokenizer
#   2. `bench model --model CKPT --batches 1 --prefill 8215 --prefill-runs 5 --text-prompts --prompt 8192`: the
#      engine alone (TTFT of the same prompt size and text, the median of five prompts: text prompts of one
#      length spread 0.100-0.200 s; decode after a prompt as long as serve's, attending over as many keys)
#   3. `killick serve` on it, one request to compile, then `python -m engine.bench.serve` (client TTFT, the
#      server's arrival-to-submit, the engine's TTFT, its first token in the proxy and the first output event,
#      decode rate), each run with prompts the server has not seen (--seed): twice, each under
#      py-spy when its wheel is in .whl/ (`pip download py-spy --no-deps --only-binary=:all: --platform
#      manylinux2014_x86_64 -d .whl`): first the threads that run (spy_active.txt), then only the thread that
#      holds the GIL (spy_gil.txt): whether the engine thread and the event loop wait for each other
# Run from the repo root on the GPU box with .whl/ (fla-core, pydantic and its deps; py-spy optional):
#     OUT=/some/dir bash engine/bench/gpu_serve.sh
#     TEMPERATURE=1 ...  both sides decode sampled, as an agent's requests (no sampling fields: temperature 1)
# Results under $OUT: summary.txt, bench_model.{txt,json}, serve_{1,2}.json, serve.log (access lines with
# prep= and first=), client.log (the HTTP client's errors: the server's log would overwrite them),
# spy_{active,gil}.txt (collapsed stacks) and their per-thread tables spy_*_top.txt.
# Do not pipe this script into another command on the box: the server it starts is killed at the end, but a
# reader waiting on its output would hold the call until its limit.
DEADLINE=${DEADLINE:-420}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
S="$OUT/summary.txt"
CKPT=${CKPT:-/tmp/killick-serve-ckpt}
PORT=${PORT:-18431}
WORDS=${SERVE_WORDS:-1850}  # ~8,216 tokens with the shipped tokenizer

timeout "$(upto 120)" $PY -c "from engine.synth import synth_checkpoint; synth_checkpoint('$CKPT', \
size='qwen3.6-35b-a3b', tokenizer='fixtures/tokenizer', layers=8, device='cuda')" > "$OUT/ckpt.log" 2>&1
status checkpoint $?
T=${TEMPERATURE:-0}  # sampling temperature of both sides' decode (agents that send none get 1.0)
timeout "$(upto 100)" $PY -m engine.bench.model --model "$CKPT" --batches 1 --prefill 8215 --prefill-runs 5 \
    --text-prompts \
    --prompt 8192 --temperature "$T" --json "$OUT/bench_model.json" > "$OUT/bench_model.txt" 2> "$OUT/bench_model.log"
status bench_model $?
cat "$OUT/bench_model.txt" >> "$S"

$PY -m proxy.cli serve --model "$CKPT" --device cuda --dtype bfloat16 --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 1 150); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
timeout "$(upto 60)" $PY -m engine.bench.serve --url "http://127.0.0.1:$PORT" --prompt-words "$WORDS" \
    --max-tokens 128 --runs 1 --seed 9 > /dev/null 2>> "$OUT/client.log"  # compiles this size's kernels
# (128 tokens: the synthetic model's first 5-90 tokens may all be held back by the output parser, and a
# reply with no content fails the client)
status serve_warm $?
SPY=$(command -v py-spy || ls /tmp/site/bin/py-spy 2>/dev/null)
for run in 1 2; do
    kind=$([ $run = 1 ] && echo active || echo gil)
    flag=$([ $run = 2 ] && echo --gil)
    SPYPID=""
    if [ -n "$SPY" ]; then
        timeout 60 "$SPY" record -p "$SERVE" -d 15 -r 250 --format raw --threads --nonblocking $flag \
            -o "$OUT/spy_$kind.txt" > "$OUT/spy_$kind.log" 2>&1 &
        SPYPID=$!
        sleep 1
    fi
    timeout "$(upto 90)" $PY -m engine.bench.serve --url "http://127.0.0.1:$PORT" --prompt-words "$WORDS" \
        --max-tokens 256 --runs 4 --seed $run --temperature "$T" --json "$OUT/serve_$run.json" >> "$S" 2>> "$OUT/client.log"
    status "serve_$run" $?
    if [ -n "$SPYPID" ]; then
        wait "$SPYPID"
        $PY -m engine.bench.spy_top "$OUT/spy_$kind.txt" > "$OUT/spy_${kind}_top.txt" 2>&1
        head -40 "$OUT/spy_${kind}_top.txt" >> "$S"
    fi
done
kill "$SERVE"
grep "access" "$OUT/serve.log" | grep POST | tail -9 >> "$S"
date -u >> "$S"
cat "$S"
exit 0
