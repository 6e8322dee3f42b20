"""Host syncs inside a stretch of engine work, counted by the engine line that made each (CUDA's sync debug mode).

    with SyncSites() as syncs:
        model.forward(...)
    syncs.sites()   # [(site 'dir/file.py:line function', syncs)], most first

Each synchronizing CUDA call torch reports (torch.cuda.set_sync_debug_mode("warn")) is counted at the innermost
frame of the engine outside engine/bench on the Python stack at that moment: an intended read-back (a layer's
routing, a CPU job's input) and one that waits for the device without meaning to show alike, each at its line.
"""
from __future__ import annotations

import traceback
import warnings
from collections import Counter

import torch


def engine_site(stack) -> str:
    """'dir/file.py:line function' of the innermost frame of `stack` (outermost first, traceback.extract_stack)
    in the engine outside engine/bench; the innermost frame when there is none."""
    def path(f) -> str:
        return f.filename.replace("\\", "/")

    frames = [f for f in stack if "/engine/" in path(f) and "/engine/bench/" not in path(f)] or list(stack)
    f = frames[-1]
    return f"{'/'.join(path(f).split('/')[-2:])}:{f.lineno} {f.name}"


class SyncSites:
    """Counts the host syncs of the work inside it by engine_site (on CUDA; elsewhere nothing syncs)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._catch = None

    def __enter__(self) -> "SyncSites":
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._catch = warnings.catch_warnings()  # restores the filters and showwarning on exit
            self._catch.__enter__()
            warnings.simplefilter("always")  # every sync, not the first of each line
            warnings.showwarning = self.saw
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> bool:
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._catch.__exit__(*exc)
            self._catch = None
        return False

    def saw(self, message, category, filename, lineno, file=None, line=None) -> None:
        """warnings.showwarning while inside: a sync's warning counts at its engine line; others are dropped."""
        if "synchroniz" in str(message):
            self.counts[engine_site(traceback.extract_stack()[:-1])] += 1

    def sites(self) -> list[tuple[str, int]]:
        return self.counts.most_common()
