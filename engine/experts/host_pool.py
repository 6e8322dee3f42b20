"""Every routed expert of every MoE layer in host RAM, in its final layout: the source of truth.

L = MoE layers, E = experts per layer. Layer row i is one contiguous tensor [E, numel] (block_layout.py);
block (layer, e) is row e of it. Layers are filled one after another (optionally in a background thread)
and each is pinned right after it is filled: pinning empty memory would fault and zero it for nothing.
If pinning fails the pool stays pageable (slower copies) and says so once.

Each layer lives in anonymous memory advised to transparent huge pages (2 MB) where the kernel offers them:
the mapped decode's expert kernels read missing experts in place over PCIe, a tile's rows 4 KB apart, and on
4 KB pages they read at 0.75 of the copy engines' rate; on huge pages at 0.93 (H200 box, bench mapped,
2026-12-01). The CPU experts walk the same rows and gain fewer TLB misses.
"""
from __future__ import annotations

import mmap
import threading
import weakref
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.experts.block_layout import ExpertLayout, split_block

FillFn = Callable[[int, torch.Tensor], None]  # (layer id, layer buffer [E, numel]) -> fills it in place


@dataclass(frozen=True)
class LoadProgress:
    done_bytes: int
    total_bytes: int
    seconds: float

    @property
    def rate(self) -> float:  # bytes/s
        return self.done_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta(self) -> float:
        return (self.total_bytes - self.done_bytes) / self.rate if self.rate > 0 else float("inf")

    def line(self) -> str:
        return (f"experts {self.done_bytes / 1e9:.1f}/{self.total_bytes / 1e9:.1f} GB "
                f"{self.rate / 1e9:.2f} GB/s ETA {self.eta:.0f}s")


class HostPool:
    def __init__(self, layers: Sequence[int], num_experts: int, layout: ExpertLayout,
                 dtype: torch.dtype, *, hugepages: bool = True) -> None:
        self.layers = [int(x) for x in layers]
        self.hugepages = hugepages
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts, self.layout, self.dtype = num_experts, layout, dtype
        self.buffers: list[torch.Tensor | None] = [None] * len(self.layers)
        self.pinned = False
        self._registered: list[int] = []
        self._ready = [threading.Event() for _ in self.layers]
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def expert_bytes(self) -> int:
        return self.layout.nbytes

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.num_experts * len(self.layers)

    def load(self, fill: FillFn, *, pin: bool = True, background: bool = False,
             progress: Callable[[LoadProgress], None] | None = None) -> "HostPool":
        """Fill (then pin) layer by layer; with background=True return at once, `wait_layer` blocks."""
        args = (fill, pin and torch.cuda.is_available(), progress)
        if not background:
            self._load_all(*args)
            return self
        self._thread = threading.Thread(target=self._load_all, args=args, name="host-pool", daemon=True)
        self._thread.start()
        return self

    def _load_all(self, fill: FillFn, pin: bool, progress) -> None:
        t0, per_layer = time.perf_counter(), self.expert_bytes * self.num_experts
        self.pinned = pin
        try:
            for i, layer in enumerate(self.layers):
                buf = host_buffer((self.num_experts, self.layout.numel), self.dtype, self.hugepages)  # [E, numel]
                fill(layer, buf)
                if self.pinned:
                    self.pinned = self._pin(buf)
                self.buffers[i] = buf
                self._ready[i].set()
                if progress:
                    progress(LoadProgress((i + 1) * per_layer, self.nbytes, time.perf_counter() - t0))
        except BaseException as exc:  # surfaced by wait_layer in the thread that needs the layer
            self._error = exc
            for ev in self._ready:
                ev.set()

    def _pin(self, buf: torch.Tensor) -> bool:
        """Page-lock and map an already filled buffer in place (cudaHostRegister); False (and one warning) on
        failure."""
        nbytes = buf.numel() * buf.element_size()
        # portable | mapped: every context's copies, and the expert kernels reading misses in place (mapped.py)
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 3)
        if int(err) == 0:
            # unregister when the buffer dies, even without close(): a freed-but-registered range makes the
            # next pool that gets the same addresses fail with cudaErrorHostMemoryAlreadyRegistered
            self._registered.append(weakref.finalize(buf, _unregister, buf.data_ptr()))
            return True
        warnings.warn(f"pinning the expert pool failed (cudaError {int(err)}); continuing with pageable "
                      "memory: host->device copies will be slower (raise the memlock limit to fix)",
                      RuntimeWarning, stacklevel=2)
        return False

    def wait_layer(self, layer: int) -> torch.Tensor:
        """Layer buffer [E, numel], waiting for the background loader if needed."""
        i = self.row[layer]
        self._ready[i].wait()
        if self._error is not None:
            raise RuntimeError("loading the expert pool failed") from self._error
        return self.buffers[i]

    def layer_ready(self, layer: int) -> bool:
        """Whether the background loader has filled `layer` (wait_layer would not block)."""
        return self._ready[self.row[layer]].is_set()

    def wait(self) -> "HostPool":
        for layer in self.layers:
            self.wait_layer(layer)
        return self

    def block(self, layer: int, expert: int) -> torch.Tensor:
        return self.wait_layer(layer)[expert]

    def weights(self, layer: int, expert: int):
        """(gate_up [2I, H], down [H, I]) views of block (layer, expert)."""
        return split_block(self.block(layer, expert), self.layout)

    def huge_bytes(self) -> int:
        """Bytes of the loaded layers that sit in transparent huge pages (from /proc/self/smaps: the mappings
        that hold the buffers; 0 where the kernel does not say)."""
        spans = self._spans()
        total, ours = 0, False  # ours: the mapping whose lines follow holds part of a buffer
        try:
            with open("/proc/self/smaps") as fh:
                for line in fh:
                    extent = mapping_extent(line)
                    if extent is not None:
                        ours = holds(extent, spans)
                    elif ours and line.startswith("AnonHugePages:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            return 0
        return min(total, self.nbytes)

    def _spans(self) -> list[tuple[int, int]]:
        """[start, end) addresses of the loaded layers' buffers."""
        return [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in self.buffers if b is not None]

    def bytes_by_node(self) -> dict[int, int]:
        """Bytes of the loaded layers' pages on each NUMA node, of the pages touched so far (from /proc/self/maps and
        numa_maps: the mappings that hold the buffers; {} where the kernel does not say). Both a fill's DMA and
        the CPU's expert runs read them: pages on a node away from the GPU or from the workers' cores read slower."""
        spans = self._spans()
        try:
            with open("/proc/self/maps") as fh:
                maps = fh.read()
            with open("/proc/self/numa_maps") as fh:
                numa_maps = fh.read()
        except OSError:
            return {}
        return bytes_by_node(spans, maps, numa_maps)

    def close(self) -> None:
        """Unpin (the pool normally lives as long as the process)."""
        if self._thread is not None:
            self._thread.join()
        for fin in self._registered:
            fin()
        self._registered.clear()


HUGE = 2 << 20


def host_buffer(shape: Sequence[int], dtype: torch.dtype, hugepages: bool = True) -> torch.Tensor:
    """An uninitialised host tensor; with hugepages, in anonymous memory aligned to 2 MB and advised to
    transparent huge pages before anything touches it (a no-op where THP is off: plain pages, same data)."""
    n = 1
    for d in shape:
        n *= int(d)
    size = torch.empty(0, dtype=dtype).element_size()
    if not hugepages or not hasattr(mmap, "MADV_HUGEPAGE") or n * size < HUGE:
        return torch.empty(*shape, dtype=dtype)
    mm = mmap.mmap(-1, n * size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping as long as any view of it lives
    skip = -base.data_ptr() % HUGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, skip, n * size)
    except OSError:  # a kernel without THP: plain pages
        pass
    return base[skip:skip + n * size].view(dtype).view(*shape)


def mapping_extent(line: str) -> tuple[int, int] | None:
    """The [start, end) addresses of a mapping's line of /proc/<pid>/maps or smaps; None for any other line (smaps'
    fields, named with a colon)."""
    head = line.split(None, 1)[0] if line.strip() else ""
    if "-" not in head or ":" in head:
        return None
    a, b = (int(x, 16) for x in head.split("-"))
    return a, b


def holds(extent: tuple[int, int], spans: Sequence[tuple[int, int]]) -> bool:
    """Whether the mapping [a, b) holds part of any [start, end) of spans."""
    a, b = extent
    return any(a < e and s < b for s, e in spans)


def bytes_by_node(spans: Sequence[tuple[int, int]], maps: str, numa_maps: str) -> dict[int, int]:
    """Bytes on each NUMA node of the mappings that overlap any [start, end) of spans: maps is /proc/<pid>/maps'
    text (each mapping's extent), numa_maps /proc/<pid>/numa_maps' (per mapping, by its start address, N<node>=<pages>
    of kernelpagesize_kB each)."""
    ends = dict(extent for extent in map(mapping_extent, maps.splitlines()) if extent is not None)
    out: dict[int, int] = {}
    for line in numa_maps.splitlines():
        parts = line.split()
        if not parts:
            continue
        a = int(parts[0], 16)
        b = ends.get(a)
        if b is None or not holds((a, b), spans):
            continue
        page_kb, pages = 4, {}
        for part in parts[1:]:
            key, _, value = part.partition("=")
            if key == "kernelpagesize_kB":
                page_kb = int(value)
            elif key[:1] == "N" and key[1:].isdigit():
                pages[int(key[1:])] = int(value)
        for node, n in pages.items():
            out[node] = out.get(node, 0) + n * page_kb * 1024
    return out


def anon_huge_kb() -> int:
    """This process's anonymous memory in transparent huge pages, kB (0 where the kernel does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return 0


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def source_fill(source) -> FillFn:
    """Fill from an ExpertWeights source (engine/experts/source.py), one whole layer per copy."""

    def fill(layer: int, buf: torch.Tensor) -> None:
        gate_up, down = source.stacked(layer)  # [E, 2I, H], [E, H, I]
        gu = gate_up[0].numel()
        buf[:, :gu].view(gate_up.shape).copy_(gate_up)
        buf[:, gu:].view(down.shape).copy_(down)

    return fill


def pool_from_source(source, **load_kw) -> HostPool:
    """Build and fill a pool from the model's ExpertWeights (fused and per-expert checkpoints alike)."""
    layout = ExpertLayout(hidden=source.hidden_size, inter=source.intermediate_size,
                          itemsize=source.dtype.itemsize)
    pool = HostPool(source.layers, source.num_experts, layout, source.dtype)
    return pool.load(source_fill(source), **load_kw)
