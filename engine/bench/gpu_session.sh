#!/usr/bin/env bash
# One GPU-box session for the expert hierarchy: tests/gpu, `bench bw`, then the synthetic
# Qwen3.6-35B-A3B benchmark (slot cache 37% of the pool, CPU path at 6 and 16 threads), in ~8 minutes.
# Run from the repo root on the GPU box (torch 2.11+ with CUDA, no internet):
#     OUT=/some/dir bash engine/bench/gpu_session.sh
# Everything lands under $OUT: *.log per step, bench_bw.json, bench_decode.json, summary.txt.
# A failing or timed-out step is logged and the session continues with the next one.
set -x
set -o pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PY:-python}
export XDG_CACHE_HOME="$OUT/cache"   # the bench bw profile goes with the results
export PYTHONUNBUFFERED=1
status() { echo "$1 rc=$2" | tee -a "$OUT/summary.txt"; }

{ date -u; nvidia-smi; nproc; free -g; git rev-parse HEAD; git status --short | head -20
  $PY -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  $PY -c "import triton; print('triton', triton.__version__)"; } > "$OUT/env.log" 2>&1

# Budget: 90 + 100 + 50 + 240 s = 8 min at most (typically ~4).
# 0. the native CPU expert kernels, if this tree has them and they are not built yet (<= 90 s)
if [ -f native/build.py ] && ! ls native/_cpu_experts*.so >/dev/null 2>&1; then
    timeout 240 $PY setup.py build_ext --inplace -j "$(nproc)" > "$OUT/build_native.log" 2>&1
    status build_native $?
fi
$PY -c "from engine.experts import cpu_runner; print('cpu runner:', cpu_runner.run_on_cpu.__name__)" \
    2>&1 | tee -a "$OUT/summary.txt"

# 1. GPU tests: route kernel vs reference, slot backends on CUDA == fused, engine on CUDA (<= 100 s)
timeout 100 $PY -m pytest -q -p no:cacheprovider tests/gpu --junitxml="$OUT/pytest_gpu.xml" \
    > "$OUT/pytest_gpu.log" 2>&1
status pytest_gpu $?

# 2. bench bw: B_P, B_H at 1..16 threads, STREAM read (<= 50 s)
timeout 50 $PY -m engine.bench.bw --threads 1,2,4,6,8,12,16 --experts 64 --stream-mib 2048 \
    --json "$OUT/bench_bw.json" > "$OUT/bench_bw.log" 2>&1
status bench_bw $?

# 3. synthetic 64 GB pool built once; decode (offload/cpu/hybrid at 6 and 16 threads, fused ceiling) and
#    8k prefill with and without double buffering, zipf routing, routing bookkeeping cost (<= 240 s; the
#    pool fill alone is ~60-70 s; bench_decode.json is rewritten after every configuration)
timeout 240 $PY -m engine.bench.decode --synthetic qwen3.6-35b-a3b --slots 37% --threads 6,16 \
    --routing uniform,zipf --steps 32 --warmup 30 --prefill-tokens 8192 --json "$OUT/bench_decode.json" \
    > "$OUT/bench_decode.txt" 2> "$OUT/bench_decode.log"
status bench_decode $?

cat "$OUT/bench_decode.txt" >> "$OUT/summary.txt" 2>/dev/null
date -u >> "$OUT/summary.txt"
exit 0
