"""The expert cache's traffic in a benchmark (engine/bench/model.py, profile_decode.py): counters around each row
and the bounds an expert cache's rows are measured against (the pool at B_P, the host DRAM's read rate)."""
from __future__ import annotations

import os
import time
from typing import NamedTuple

from engine.experts.registry import is_expert_cache
from engine.experts.stats import FIELDS


class ExpertTraffic:
    """The expert cache's counters around each row (nothing for all-resident experts), and the prefill's
    streaming bound: the pool's bytes at B_P measured in this process (pinned host -> device on CUDA,
    host -> host on CPU, where a fill is a copy), and the host DRAM's read rate over the pool (every core,
    STREAM-style): an extend's misses are read from it once each, by a fill's DMA or by the CPU, so their bytes
    at that rate are its floor whatever the split. measure_bp=False: the counters alone (no bounds)."""

    def __init__(self, model, measure_bp: bool = True) -> None:
        self.backend = getattr(model, "experts", None)
        self.cached = is_expert_cache(self.backend)
        self.streamer = getattr(self.backend, "streamer", None)  # None: prompts move their routed experts alone
        self.bp = self.host_read = None
        self.beside: BesideCopy | None = None  # the host's read rate while copies to the device run
        if self.cached:
            from engine.bench.bw import measure_bp as bp_of, measure_copy

            pool = self.backend.pool
            self.pool_bytes = pool.expert_bytes * pool.num_experts * len(pool.layers)
            if measure_bp:
                self.bp = bp_of(pool.layout, pool.dtype) or measure_copy(pool.layout, pool.dtype)
                self.host_read = host_read_rate(pool)
                self.beside = read_beside_copy(pool)

    def placement(self) -> str:
        """As engine/bench/peers/compare.py pairs rows: `resident`, else `ncmoeN` for the llama.cpp run that
        keeps the same share of experts on the GPU ((L-N)/L of them, N rounded), `cpu` for none."""
        if not self.cached:
            return "resident"
        layers = len(self.backend.pool.layers)
        n = round(layers * (1 - self.share()))
        return "cpu" if n >= layers else f"ncmoe{n}"

    def share(self) -> float:
        pool = self.backend.pool
        return self.backend.cache.num_slots / (pool.num_experts * len(pool.layers))

    def header(self) -> dict:
        if not self.cached:
            return {}
        beside = {"read_beside_copy_gbs": self.beside.read / 1e9, "copy_beside_read_gbs": self.beside.copy / 1e9} \
            if self.beside else {}
        return {"bp_gbs": self.bp / 1e9, "host_read_gbs": (self.host_read or 0) / 1e9, **beside,
                "pool_bytes": self.pool_bytes,
                "variant": self.backend.name,
                "slot_policy": self.backend.cache.table.policy,
                "prefill_stream": "off" if self.streamer is None else self.streamer.mode,
                "prefetch": "on" if getattr(self.backend, "prefetch", False) else "off",
                "lookahead": "on" if getattr(self.backend, "lookahead", False) else "off",
                "decode_path": "mapped" if self.backend.mapped is not None else "host",
                "cpu_experts": _cpu_path(), "pool_huge": self.backend.pool.huge_bytes() / self.pool_bytes,
                **numa_placement(self.backend.pool),
                "experts_on_gpu": f"{self.share():.1%}", "slots": self.backend.cache.num_slots}

    def split(self) -> dict:
        """hybrid: the split policy at the end of the run (choices taken per arm, explorations, the rates each
        path was measured at, alone and together, bytes/s) — why it sent what it sent to the CPU."""
        stats = self.backend.stats() if self.cached else {}
        out = {"split": stats["split"]} if "split" in stats else {}
        mapped = getattr(self.backend, "mapped", None) if self.cached else None
        if mapped is not None and mapped.cpu is not None:
            out["graph_cpu"] = mapped.cpu.stats()
        return out

    def choices(self) -> dict:
        """hybrid: the split's choices so far ({"arms": {arm: calls}, "explored": calls}); else {}."""
        split = self.backend.stats().get("split") if self.cached else None
        return {"arms": dict(split["arms"]), "explored": split["explored"]} if split else {}

    def extend_run(self, mark: dict | None, chose: dict) -> dict:
        """What one extend's expert cache did since `mark` (taken as it arrived) and `chose` (choices() then):
        fills, CPU runs and the rate its CPU jobs read their experts at (cpu_gbs: a slow one says the host's
        cores or DRAM were busy then), copies ahead (and those read), and with hybrid the split's choices and
        explorations, so extends of one process that differ in time can be told apart."""
        if mark is None:
            return {}
        ex = self.since(mark)["experts"]
        out = {k: ex[k] for k in ("fills", "cpu_runs", "ahead", "ahead_used")}
        if ex["cpu_seconds"] > 0:
            out["cpu_gbs"] = ex["cpu_runs"] * self.backend.pool.expert_bytes / ex["cpu_seconds"] / 1e9
        if chose:
            now = self.choices()
            out["arms"] = {a: n - chose["arms"].get(a, 0) for a, n in now["arms"].items()}
            out["explored"] = now["explored"] - chose["explored"]
        return out

    def row_keys(self) -> dict:
        """Per row: the backend (compare.py's variant) and the share of experts the slots hold."""
        return {"variant": self.backend.name, "experts_on_gpu": f"{self.share():.1%}"} if self.cached else {}

    def mark(self) -> dict | None:
        if not self.cached:
            return None
        return dict(self.backend.stats()["total"], streamed=self.streamer.streamed_forwards if self.streamer else 0)

    def since(self, mark: dict | None, upto: dict | None = None) -> dict:
        """Expert counters moved from `mark` to `upto` (default: now), how many pools' worth of bytes, and
        how many forwards streamed whole layers (the others moved their routed experts alone). The idle
        refresh's copies (--moe-refresh: between requests, so also just after the row's last one) are the
        requests' own traffic in no row: counted as `refreshed` alone, not in fills or bytes_moved."""
        if mark is None:
            return {}
        now = upto or self.mark()
        moved = {k: now[k] - mark[k] for k in FIELDS}
        moved["fills"] -= moved["refreshed"]
        moved["bytes_moved"] -= moved["refreshed"] * self.backend.pool.expert_bytes
        return {"experts": moved, "pool_passes": moved["bytes_moved"] / self.pool_bytes,
                "streamed_forwards": now["streamed"] - mark["streamed"]}

    def fill_bound(self, start: dict | None, end: dict | None, steps: int, batch: int, step_s: float) -> dict:
        """Decode against its PCIe traffic alone: the bytes the timed steps filled into slots or read in place
        (a mapped decode), per step, at B_P (the offload bound; with hybrid the CPU's share is not in it, so it
        is a floor, not the bound). A mapped decode counts a step's traffic while the next step runs: the
        window is one step late, the same number of steps."""
        if start is None or end is None:
            return {}
        per_step = sum(end[k] - start[k] for k in ("bytes_moved", "bytes_read")) / steps
        if per_step <= 0:
            return {"fill_bytes_per_step": 0.0}
        bound = batch * self.bp / per_step
        return {"fill_bytes_per_step": per_step, "fill_bound_tok_s": bound, "of_fill_bound": (batch / step_s) / bound}

    def stream_bound(self, seconds: float) -> dict:
        """A prompt's seconds against streaming the whole pool once at B_P (of_stream_bound > 1: faster)."""
        if not self.cached:
            return {}
        bound = self.pool_bytes / self.bp
        return {"stream_bound_s": bound, "of_stream_bound": bound / seconds}

    def dram_bound(self, moved: dict, seconds: float) -> dict:
        """A routed prompt's seconds against its misses' bytes (filled or run on the CPU, each read from host
        DRAM once) at the host's read rate (the cores' own, `dram_bound_s`), and at what the cores and the copy
        engine read together (`both_bound_s`, CUDA): the floor for those misses however they are split, where
        the cores alone do not reach what the DRAM gives (the H200 box: 100 GB/s, where fills and CPU runs
        together were measured at ~140)."""
        if not self.cached or not self.host_read or "experts" not in moved:
            return {}
        ex = moved["experts"]
        nbytes = (ex["fills"] + ex["cpu_runs"]) * self.backend.pool.expert_bytes
        out = {"host_read_gbs": self.host_read / 1e9, "dram_bound_s": nbytes / self.host_read,
               "of_dram_bound": nbytes / self.host_read / seconds}
        if self.beside:
            both = self.beside.read + self.beside.copy
            out.update(both_bound_s=nbytes / both, of_both_bound=nbytes / both / seconds)
        return out


def host_read_rate(pool, passes: int = 3) -> float | None:
    """Bytes/s of the best of `passes` reads over up to 2 GiB of the host pool on every core (the native read
    pass, else a torch sum): the ceiling a fill's DMA and the CPU's expert runs share. None: nothing to read."""
    rows = _read_rows(pool)
    if not rows:
        return None
    runner = _read_runner()
    best = 0.0
    for _ in range(passes):
        t0 = time.perf_counter()
        for r in rows:
            runner.read_bandwidth_pass(r) if runner is not None else r.sum()
        best = max(best, sum(r.numel() * r.element_size() for r in rows) / (time.perf_counter() - t0))
    return best


def _read_rows(pool, limit: int = 2 << 30) -> list:
    """The host pool's layer rows, in order, up to the first `limit` bytes: what the read rates read."""
    rows = []
    for layer in pool.layers:
        rows.append(pool.wait_layer(layer))
        if sum(r.numel() * r.element_size() for r in rows) >= limit:
            break
    return rows


def _read_runner():
    """The native read pass on every core (None without the native kernels)."""
    from engine.experts.cpu_runner import native_runner

    return native_runner(os.cpu_count() or 1)


class BesideCopy(NamedTuple):
    """Bytes/s the cores read the host pool at while copies from host to device run, and those copies' rate."""

    read: float
    copy: float


def read_beside_copy(pool, chunk_mib: int = 256, chunks: int = 24) -> BesideCopy | None:
    """The host's read rate (host_read_rate's pass, every core) while a copy stream moves `chunks` pinned chunks
    to the device, and the copies' rate meanwhile: both read host DRAM, so their sum is what an extend's fills
    and CPU runs can reach together. The read passes repeat until the copies end (their rate over that span:
    the copies run beside the reads throughout). None off CUDA or without the native read pass."""
    import torch

    runner = _read_runner()
    if runner is None or not torch.cuda.is_available() or not pool.layers:
        return None
    rows = _read_rows(pool)
    src = torch.ones(chunk_mib << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(chunk_mib << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    for _ in range(2):  # the first round warms the copy path and the read pass up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for _ in range(chunks):
                dst.copy_(src, non_blocking=True)
            end.record()
        read, t0 = 0, time.perf_counter()
        while not end.query():
            for r in rows:
                runner.read_bandwidth_pass(r)
                read += r.numel() * r.element_size()
        seconds = time.perf_counter() - t0
        end.synchronize()
    del dst
    return BesideCopy(read / seconds, chunks * src.numel() / (start.elapsed_time(end) / 1e3))


def numa_placement(pool, root: str = "/sys") -> dict:
    """Where the host pool's pages and the GPUs sit among the host's NUMA nodes: `numa_nodes` (the count),
    `pool_by_node` ({node: share of the pool's touched pages}) and `gpu_numa_nodes` (each NVIDIA device's node by
    sysfs, -1 where it names none). A process whose pool sits away from the GPU or the expert workers' cores reads
    it slower, by its fills and by its CPU runs alike. root: where sysfs is (tests)."""
    nodes = [d for d in _listdir(f"{root}/devices/system/node") if d.startswith("node") and d[4:].isdigit()]
    gpus = []
    for dev in sorted(_listdir(f"{root}/bus/pci/devices")):
        base = f"{root}/bus/pci/devices/{dev}"
        if _read(f"{base}/vendor") == "0x10de" and _read(f"{base}/class").startswith("0x03"):
            node = _read(f"{base}/numa_node")
            gpus.append(int(node) if node.lstrip("-").isdigit() else -1)
    placed = pool.bytes_by_node()
    total = sum(placed.values())
    return {"numa_nodes": len(nodes), "gpu_numa_nodes": gpus,
            "pool_by_node": {node: n / total for node, n in sorted(placed.items())} if total else {}}


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _cpu_path() -> str:
    """How misses run on the CPU in this process (cpu / hybrid): the native kernels, or torch where the
    extension is not built (several times slower: a hybrid row on the torch path says little)."""
    from engine.experts import cpu_runner

    path = "torch (native kernels not built)"
    if cpu_runner.NATIVE:
        runner = cpu_runner.native_runner(cpu_runner.prompt_threads())
        tiles = f", tiles from {runner.tile_tokens} tokens an expert" if runner.tile_tokens else ""
        path = f"native ({runner.isa}{tiles})"
    prompt = cpu_runner.prompt_threads()
    return f"{path} with {cpu_runner.expert_threads()} threads" + (f" ({prompt} for a prompt)" if prompt !=
                                                                    cpu_runner.expert_threads() else "")
