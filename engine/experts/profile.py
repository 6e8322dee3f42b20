"""This machine's expert-bandwidth profile: what `killick bench bw` measured, read back when a model loads.

The fill/CPU split (policy.py) and `--moe-backend auto` plan with B_P and B_H; `killick bench bw`
(engine/bench/bw.py) measures them once per machine and expert format and saves them here:
$XDG_CACHE_HOME/killick (or ~/.cache/killick), one JSON file per (expert format, GPU name, thread count).
`load_profile` returns None for any other machine or format, so a copied cache directory never misleads the
planner.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from engine.experts.block_layout import ExpertLayout


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "killick"


def machine_key(layout: ExpertLayout, dtype: torch.dtype, threads: int) -> dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-only"
    fmt = f"{str(dtype).removeprefix('torch.')}-h{layout.hidden}-i{layout.inter}"
    return {"format": fmt, "gpu": gpu, "threads": threads}


def profile_path(key: dict) -> Path:
    name = re.sub(r"[^A-Za-z0-9.-]+", "_", f"bw-{key['format']}-{key['gpu']}-t{key['threads']}")
    return cache_dir() / f"{name}.json"


def load_profile(layout: ExpertLayout, dtype: torch.dtype, threads: int) -> dict | None:
    key = machine_key(layout, dtype, threads)
    path = profile_path(key)
    try:
        prof = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return prof if prof.get("key") == key else None  # another machine's or format's: ignored


def save_profile(prof: dict) -> Path:
    path = profile_path(prof["key"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof, indent=1))
    return path
