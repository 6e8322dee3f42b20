"""This machine's expert-bandwidth profile: what `killick bench bw` measured, read back when a model loads.

The fill/CPU split (policy.py) and `--moe-backend auto` plan with B_P and B_H; `killick bench bw`
(engine/bench/bw.py) measures them once per machine and expert format and saves them here:
$XDG_CACHE_HOME/killick (or ~/.cache/killick), one JSON file per (expert format, GPU name, thread count).
`load_profile` returns None for any other machine or format, so a copied cache directory never misleads the
planner.

Beside it, the hybrid decode's settled CPU shares (graph_cpu.CpuShare): per batch size, the share its search
(policy.ShareSearch) last settled at, for one (expert format, GPU, CPU threads, layers, device slots, model);
the next process's search starts there instead of at the rates' balance, which lay 0.1-0.3 below the shares
the search settles at on the H200 box (docs/PERF.md, twenty-first and twenty-second sessions).
"""
from __future__ import annotations

import hashlib
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


def share_key(layout: ExpertLayout, dtype: torch.dtype, threads: int, layers: int, slots: int,
              model: str = "") -> dict:
    """What a settled CPU share holds for: this machine and expert format (machine_key), the CPU expert
    threads, the model's cache layers and device slots (the misses a step has) and `model`, a tag of its
    weights (FastModel: its first cache layer's router; models of one shape route differently)."""
    return {**machine_key(layout, dtype, threads), "layers": layers, "slots": slots, "model": model}


def share_path(key: dict) -> Path:
    tag = hashlib.sha1(key["model"].encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9.-]+", "_",
                  f"share-{key['format']}-{key['gpu']}-t{key['threads']}-l{key['layers']}-s{key['slots']}-{tag}")
    return cache_dir() / f"{name}.json"


def load_shares(key: dict) -> dict[int, float]:
    """{batch size: settled share} saved for `key`; {} where none was, or the file is another key's or broken."""
    try:
        doc = json.loads(share_path(key).read_text())
        if doc.get("key") != key:
            return {}
        return {int(rows): float(share) for rows, share in doc["shares"].items() if 0.0 <= float(share) <= 1.0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def save_shares(key: dict, shares: dict[int, float]) -> Path:
    """Write {batch size: share} for `key` (whole, through a temporary file: a reader never sees half of it).
    Raises OSError where the cache directory cannot be written."""
    path = share_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "shares": {str(r): round(v, 4) for r, v in sorted(shares.items())}},
                              indent=1))
    os.replace(tmp, path)
    return path


class ShareMemory:
    """The settled CPU shares of one key (share_key; None: nothing read or kept), for graph_cpu.CpuShare."""

    def __init__(self, key: dict | None) -> None:
        self.key = key
        self.shares = load_shares(key) if key is not None else {}
        self.error: str | None = None  # why the last write failed (then no more are tried)

    def start(self, rows: int, running: dict[int, float], default: float) -> float:
        """Where a batch size's search starts: its own settled share, else the best of the nearest batch size
        searching in this process (`running`), else the nearest settled one, else `default`."""
        if rows in self.shares:
            return self.shares[rows]
        for table in (running, self.shares):
            if table:
                return table[min(table, key=lambda r: abs(r - rows))]
        return default

    def settle(self, rows: int, share: float) -> bool:
        """A batch size's search settled at `share`: kept for this process and written for the next. -> whether
        it was written (False without a key, or once a write has failed: `error` says why)."""
        self.shares[rows] = share
        if self.key is None or self.error is not None:
            return False
        try:
            save_shares(self.key, self.shares)
        except OSError as exc:
            self.error = f"{cache_dir()}: {exc}"
            return False
        return True
