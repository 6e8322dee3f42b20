"""Where a thread sat still: its stack sampled from a helper thread, and the garbage collector's pauses, over a
stretch of work (profile_decode's timed extends).

    with Stalls(threading.get_ident(), every_s=0.0005) as st:
        work()
    for stall in st.stalls(min_s=0.0015):   # runs of samples with the same stack, longest first
        print(stall.start, stall.seconds, stall.where)
    st.collections                          # (generation, start, seconds) of each collection meanwhile

A stall is a run of consecutive samples whose innermost frames did not change: a native call the thread waited in
(a device sync, a lock, a launch the driver held back) or one long Python line. Its time is from the first sample
to the last, so a stall under one period is not seen. The sampler takes the GIL once a period, which a thread
running Python gives up at its next check; the work runs somewhat slower under it. Times are perf_counter's.
"""
from __future__ import annotations

import gc
import sys
import threading
import time
from typing import NamedTuple

FRAMES = 4  # innermost frames kept per sample: the call and what called it


class Stall(NamedTuple):
    start: float  # perf_counter of the first sample in it
    seconds: float  # to the last
    where: tuple[str, ...]  # innermost first: "file.py:line function"


class Collection(NamedTuple):
    generation: int
    start: float
    seconds: float


def frames_of(frame, depth: int = FRAMES) -> tuple[str, ...]:
    """A frame's stack, innermost first, `depth` deep, as "dir/file.py:line function"."""
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{'/'.join(code.co_filename.split('/')[-2:])}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(out)


class Stalls:
    def __init__(self, thread_id: int, every_s: float = 0.0005) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.thread_id, self.every_s = thread_id, every_s
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self.collections: list[Collection] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gc_start = 0.0

    def __enter__(self) -> "Stalls":
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._sample, name="stall-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._on_gc)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            frame = sys._current_frames().get(self.thread_id)
            self.samples.append((time.perf_counter(), frames_of(frame) if frame is not None else ()))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collections.append(Collection(info["generation"], self._gc_start,
                                               time.perf_counter() - self._gc_start))

    def stalls(self, min_s: float = 0.0015) -> list[Stall]:
        """Runs of consecutive samples with one stack lasting min_s or more, longest first."""
        return stall_runs(self.samples, min_s)


def stall_runs(samples: list[tuple[float, tuple[str, ...]]], min_s: float) -> list[Stall]:
    """Runs of consecutive (time, stack) samples with one stack lasting min_s or more, longest first."""
    out, i = [], 0
    while i < len(samples):
        j = i
        while j + 1 < len(samples) and samples[j + 1][1] == samples[i][1]:
            j += 1
        t0, t1 = samples[i][0], samples[j][0]
        if t1 - t0 >= min_s and samples[i][1]:
            out.append(Stall(t0, t1 - t0, samples[i][1]))
        i = j + 1
    return sorted(out, key=lambda s: -s.seconds)
