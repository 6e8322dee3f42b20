"""A GPU-box script run on this machine: the box's python replaced by a stand-in (a bash script each test file
composes with stand_in) that answers each benchmark process with a recorded `bench model` result, in a checkout of
its own with the engine package linked in (no box cache and no native build there, so the script copies nothing
into this checkout)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs/perf/2026-12-06-h100-s61-call2-default1"  # a box's bench model .json and .txt
# the stand-in's answer to a `bench model` process (a case branch's body): its arguments, directory and the native
# build beside it logged, the run numbered FAIL_RUN failing as a CUDA error would, else the recorded result written
# where --json says and printed
ANSWER_MODEL = """    echo "$args" >> "$CALLS"
    pwd >> "$CALLS.cwd"
    cat native/_cpu_experts*.so >> "$CALLS.native" 2>/dev/null
    [ "$(wc -l < "$CALLS")" = "${FAIL_RUN:-0}" ] && { echo "CUDA error" >&2; exit 3; }
    while [ $# -gt 0 ]; do [ "$1" = "--json" ] && out=$2; shift; done
    cp "$RECORDED.json" "$out"; cat "$RECORDED.txt" ;;"""


def stand_in(script: str, tables: str, *branches: str) -> str:
    """The box's python as `script` calls it: the torch-free module `tables` (python -m ...) run by this Python,
    `bench model` answered with ANSWER_MODEL, then the case branches given (`  *"pattern"*) commands ;;`), anything
    else a success."""
    return "\n".join(["#!/usr/bin/env bash", f"# python on the GPU box, as {script} calls it", 'args="$*"',
                      'case "$args" in', f'  *"-m {tables}"*) exec "$REAL_PY" "$@" ;;',
                      '  *"-m engine.bench.model"*)', ANSWER_MODEL, *branches, "  *) exit 0 ;;", "esac", ""])


def stand_in_box(tmp_path: Path, stand_in: str) -> tuple[Path, dict]:
    """-> (tmp_path, the environment a script runs in): PY the stand-in, REAL_PY this Python (for the torch-free
    tables), RECORDED, CALLS (where the stand-in logs its calls) and OUT under tmp_path."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "engine").symlink_to(ROOT / "engine")
    py = tmp_path / "python"
    py.write_text(stand_in)
    py.chmod(0o755)
    env = {**os.environ, "PY": str(py), "REAL_PY": sys.executable, "RECORDED": str(RECORDED),
           "CALLS": str(tmp_path / "calls.txt"), "OUT": str(tmp_path / "out"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PATH": os.environ.get("PATH", "")}
    return tmp_path, env


def run_script(box: tuple[Path, dict], script: str, **extra: str) -> subprocess.CompletedProcess:
    """Run engine/bench/<script> in the box's checkout with extra environment."""
    tmp, env = box
    return subprocess.run(["bash", f"engine/bench/{script}"], cwd=tmp / "repo", env={**env, **extra},
                          capture_output=True, text=True, timeout=120)
