"""CPU expert execution: the native SwiGLU kernels (native/_cpu_experts) behind a checked torch API.

For each task (gate_up, down, token, weight):   y[token] += weight * down @ (silu(g) * u),
where [g; u] = gate_up @ x[token].  Shapes: H = hidden, I = expert intermediate, T = tokens.
  gate_up [2I, H]  rows 0..I-1 gate, I..2I-1 up (HF's fused gate_up_proj[e]); down [H, I]; both row-major
  with unit inner stride, bf16 or fp32 (one dtype and one row stride per call);
  x [T, H] (any float dtype; fp32 is passed through), y [T, H] fp32, accumulated into.
Tasks on the same expert share one pass over its weights (up to 4 tokens a pass). An expert stored as one
contiguous block (gate_up then down, the host pool's layout) is split with `cpu_tasks.split_expert_block`. The
tasks' types, checks and torch paths live in cpu_tasks.py.

Without the extension (no compiler at install time) the same API runs on torch, with one warning.
"""
from __future__ import annotations

import functools
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Sequence

import torch

from engine.experts.cpu_tasks import (FORMATS, CpuFuture, ExpertTable, RoutedIO, Task, as_lists, check_tasks,
                                      check_xy, fp32_rows, torch_experts)

try:
    from native import _cpu_experts as _native
except ImportError:  # not built: torch fallback
    _native = None

_warned = False
PREFETCH_BYTES = 512  # software prefetch distance along each weight row stream (default walk)
PREFETCH_HINTS = {"t0": 3, "t1": 2, "t2": 1, "nta": 0}  # -> __builtin_prefetch locality (native/src/kernels.h)
# A call whose tasks average this many tokens an expert or more runs on the tile path where the ISA has one
# (AMX: up to 16 tokens in one pass over an expert's weights; the vector kernels take 4 a pass and run
# compute-bound past that, docs/PERF.md eighteenth session).
TILE_TOKENS = 5


@functools.lru_cache(maxsize=1)
def default_walk() -> tuple[int, int, int, str]:
    """(row_block, prefetch_bytes, claim_rows, prefetch_hint) that measured best on this CPU (docs/PERF.md):
    AMD Zen wants several long sequential streams per core (the four-stream walk: both halves of a claim's
    gate and up rows, four experts' down rows; 64-row claims); four short rows side by side are its worst walk
    (kernel/read 0.57). Before AVX-512 (the 2-core EPYC 7001 dev box) its software prefetches, 512 B ahead as
    prefetchnta, read one token an expert at 1.05-1.07x the rate of prefetcht0 at 1 and 2 workers (kernel/read
    0.95-1.00 against 0.86-0.95), with no loss at 4 or 8 tokens. A Zen with AVX-512 (a 2-core Zen 4 dev box)
    runs best with none: one token an expert at the same rate (B_H 22.3 / 29.0 GB/s without, 21.9 / 29.7 with,
    at 1 / 2 workers, medians of five alternated runs), eight tokens an expert, where its AVX-512 BF16 kernels
    are compute-bound, 1.25x faster (15.9 against 12.7 GB/s at 2 workers, three alternated pairs). The GPU box's
    Xeon streams four rows side by side best (the two-stream walk measured no better there), with 32-row claims
    and prefetcht0 (prefetchnta read 0.58-0.66 of the read rate there)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            return walk_for(fh.read())
    except OSError:
        return walk_for("")


def walk_for(cpuinfo: str) -> tuple[int, int, int, str]:
    """default_walk's choice for a CPU described by this /proc/cpuinfo text."""
    lines = cpuinfo.splitlines()
    amd = any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in lines)
    avx512 = any(line.startswith("flags") and "avx512f" in line.split() for line in lines)
    if amd:
        return (3, 0 if avx512 else PREFETCH_BYTES, 64, "nta")
    return (0, PREFETCH_BYTES, 32, "t0")


def native_available() -> bool:
    return _native is not None


def supported_isas() -> list[str]:
    """ISAs the native kernels can use here, best first (empty without the extension)."""
    return list(_native.supported_isas()) if _native else []


def physical_cores() -> int:
    if _native:
        return max(1, len(_native.physical_cpus()))
    import os
    return max(1, (os.cpu_count() or 2) // 2)


def _warn_fallback_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("killick native CPU kernels are not built (no compiler at install?); "
                      "CPU experts run on torch and will be several times slower", RuntimeWarning, stacklevel=3)


class CpuExpertRunner:
    """Runs routed experts on the CPU. One batch in flight at a time; submit() returns at once.

    threads: worker count (default: physical cores - 1, at least 1); isa: force a kernel path
    ('amx', 'avx512bf16', 'avx512', 'avx2', 'scalar'; default the best supported); backend: 'auto', 'native'
    or 'torch'; pin: one worker per physical core; spin_us: how long idle workers spin before parking;
    row_block: kernel walk order (0: four rows side by side, 1: one row at a time, 2: two row streams side by
    side: an expert's gate and up rows, then two experts' down rows; 3: four streams: both halves of the gate
    and up rows, four experts' down rows); prefetch_bytes:
    software prefetch distance (0: off). None: what measured best on this CPU vendor (default_walk).
    claim_rows: rows a worker claims at a time (1-64; shorter claims end each phase more evenly, longer
    ones stream longer runs). None: default_walk's. guided: claims shrink from claim_rows to least_rows
    (1-64, default 8: two four-row blocks) as each phase runs out, so the workers finish a phase together
    (False: every claim is claim_rows long).
    prefetch_hint: which software prefetch instruction ('t0': into L1, 't1', 't2', 'nta'); None: default_walk's.
    caller_joins: the calling thread is worker 0 and runs its share inside wait(), so a job finishes only
    once waited on (done() stays False until then); None: when threads >= the physical cores, where no core
    is left for a parked caller to wake on.
    tile_tokens: a call whose tasks average this many tokens an expert or more (bf16 weights, hidden and
    intermediate sizes multiples of 32) runs on the ISA's tile path, up to 16 tokens a pass over an expert's
    weights; 0: never. None: TILE_TOKENS where the ISA is 'amx', else 0 ('scalar' has a reference tile path,
    for tests).
    """

    def __init__(self, threads: int | None = None, isa: str | None = None, backend: str = "auto",
                 pin: bool = True, spin_us: int = 2000, prefetch_bytes: int | None = None,
                 row_block: int | None = None, claim_rows: int | None = None, guided: bool = True,
                 prefetch_hint: str | None = None, caller_joins: bool | None = None, least_rows: int = 8,
                 tile_tokens: int | None = None):
        walk = default_walk()
        row_block = walk[0] if row_block is None else row_block
        prefetch_bytes = walk[1] if prefetch_bytes is None else prefetch_bytes
        claim_rows = walk[2] if claim_rows is None else claim_rows
        prefetch_hint = walk[3] if prefetch_hint is None else prefetch_hint
        if row_block not in (0, 1, 2, 3):
            raise ValueError(f"row_block must be 0, 1, 2 or 3, not {row_block!r}")
        if not 1 <= least_rows <= 64:
            raise ValueError(f"least_rows must be 1-64, not {least_rows!r}")
        if prefetch_hint not in PREFETCH_HINTS:
            raise ValueError(f"prefetch_hint must be one of {sorted(PREFETCH_HINTS)}, not {prefetch_hint!r}")
        if tile_tokens is not None and (type(tile_tokens) is not int or tile_tokens < 0):
            raise ValueError(f"tile_tokens must be an int >= 0 (0: never), not {tile_tokens!r}")
        if backend not in ("auto", "native", "torch"):
            raise ValueError(f"backend must be 'auto', 'native' or 'torch', not {backend!r}")
        if backend == "native" and _native is None:
            raise ValueError("backend='native' asked for, but native/_cpu_experts is not built "
                             "(pip install needs a C++17 compiler)")
        if threads is None:
            threads = max(1, physical_cores() - 1)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads, self.prefetch_bytes, self.row_block = int(threads), int(prefetch_bytes), int(row_block)
        self.claim_rows, self.guided, self.prefetch_hint = int(claim_rows), bool(guided), prefetch_hint
        self.least_rows = int(least_rows)
        self._lock = threading.Lock()
        self._pending: CpuFuture | None = None
        self._jobs = self._posted_x = None  # post_gather's native GatherJobs, made on first use; the x it reads
        if backend == "torch" or _native is None:
            if backend == "auto":
                _warn_fallback_once()
            self.backend, self.isa, self.caller_joins, self.tile_tokens = "torch", "torch", False, 0
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts")
            return
        isas = supported_isas()
        if isa is not None and isa not in isas:
            raise ValueError(f"ISA {isa!r} is not available here; choose one of {isas}")
        self.backend, self.isa = "native", isa or isas[0]
        self._pool = _native.Runner(self.threads, pin, spin_us, -1 if caller_joins is None else int(caller_joins))
        self.caller_joins = self._pool.caller_joins
        self._pool.isa = self.isa
        self._pool.prefetch_bytes = self.prefetch_bytes
        self._pool.row_block = self.row_block
        self._pool.claim_rows = self.claim_rows
        self._pool.guided = self.guided
        self._pool.least_claim = self.least_rows
        self._pool.prefetch_hint = PREFETCH_HINTS[prefetch_hint]
        if tile_tokens is None:
            tile_tokens = TILE_TOKENS if self.isa == "amx" else 0
        self.tile_tokens = tile_tokens if self._pool.has_tiles else 0
        self._pool.tile_tokens = self.tile_tokens

    @property
    def last_call_tiles(self) -> bool:
        """Did the last call take the tile path?"""
        return self.backend == "native" and self._pool.last_tiles

    def run(self, tasks: Sequence[Task], x: torch.Tensor, y: torch.Tensor) -> None:
        self.submit(tasks, x, y).wait()

    def submit(self, tasks: Sequence[Task], x: torch.Tensor, y: torch.Tensor) -> CpuFuture:
        """Starts y[token] += w * expert(x[token]) for every task; call .wait() before reading y."""
        hidden, inter, dtype = check_tasks(tasks, x, y)
        with self._lock:
            if self._pending is not None:
                self._pending.wait()
            if self.backend == "torch":
                self._pending = self._submit_torch(tasks, x, y)
            else:
                self._pending = self._submit_native(tasks, x, y, hidden, inter, dtype)
            return self._pending

    def run_routed(self, table: ExpertTable, experts, tokens, weights, x: torch.Tensor, y: torch.Tensor) -> None:
        """submit_routed(...).wait(), in one native call (see run_io)."""
        self.run_io(table, experts, tokens, weights, RoutedIO(fp32_rows(x), y))

    def run_io(self, table: ExpertTable, experts, tokens, weights, io: "RoutedIO") -> None:
        """run_routed on buffers checked once (RoutedIO): y[token] += ... for io.x and io.y. A decode loop's
        MoE layers call this back to back: submit and wait are one native call, and the dozen torch attribute
        reads of run_routed's checks are skipped — each slow, with the caller's code and data evicted by the
        previous call's streaming (on the dev box the wrapper cost 70-90 us a call through run_routed, 35-55
        through run_io)."""
        if table.hidden != io.hidden:
            raise ValueError(f"the buffers have hidden size {io.hidden}, the expert table {table.hidden}")
        if self.backend == "torch":
            self.submit_routed(table, experts, tokens, weights, io.x, io.y).wait()
            return
        if type(experts) is not list or type(tokens) is not list or type(weights) is not list:
            experts, tokens, weights = as_lists(experts, tokens, weights)
        self._submit_table(table, experts, tokens, weights, io.ptrs, None)

    def run_gather(self, table: ExpertTable, experts: list, rows: list, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = expert experts[i](x[rows[i]]), overwritten, in one native call: the engine's CPU path
        (cpu_runner.run_on_cpu). x [T, H] and out [n, H]: CPU, f32 or bf16, unit inner stride; experts, rows:
        lists of ints. Native only. Few torch calls on purpose: it runs every MoE layer, each time with the
        caller's code and data evicted by the previous call's streaming (see run_io)."""
        x, io = self._gather_io(table, experts, x, out)
        with self._routed_call():
            self._pool.run_gather(table._native, experts, rows, *io)

    def post_gather(self, table: ExpertTable, experts: Sequence[int], rows: Sequence[int], x: torch.Tensor,
                    out: torch.Tensor, flag: torch.Tensor | None = None, seq: int = 0) -> None:
        """run_gather's job started, not waited for: the pool's workers take it at once and the caller goes on (a
        prompt's CPU job with no Python thread between: cpu_jobs.CpuJobs). experts and rows: lists or int64 numpy
        arrays (taken as they are, no conversion pair by pair). The worker that ends it stores seq into
        flag (int64 [1], page-locked on CUDA for mailbox_triton.wait_flag) there and then, and wait_gather()
        returns. x and out are read and written until then: the caller keeps them. Native only; one such job at a
        time (a second waits for the first), and until its flag is up the runner's other calls, from any thread,
        wait for it rather than queue a job in front of the flag."""
        x, io = self._gather_io(table, experts, x, out)
        if flag is not None and (flag.dtype != torch.int64 or not flag.is_cpu or flag.numel() != 1):
            raise ValueError("post_gather: flag is an int64 [1] tensor in host memory")
        with self._routed_call():
            if self._jobs is None:
                self._jobs = _native.GatherJobs(self._pool)
            self._jobs.post(table._native, experts, rows, *io, 0 if flag is None else flag.data_ptr(), seq)
        self._posted_x = x  # read by the job: kept until the next one

    def wait_gather(self) -> tuple[float, float]:
        """-> (when the last post_gather's job began, on time.perf_counter's clock; seconds it ran), once done."""
        started_ns, seconds = self._jobs.wait()
        return started_ns * 1e-9, seconds

    def _gather_io(self, table: ExpertTable, experts: list, x: torch.Tensor, out: torch.Tensor):
        """run_gather's arguments checked -> (x with unit inner stride, the native calls' x and out arguments:
        x's address, format, row stride and rows, out's address, format and row stride)."""
        fx, fo = FORMATS.get(x.dtype), FORMATS.get(out.dtype)
        (T, hidden), sx, so = x.shape, x.stride(), out.stride()
        if self.backend != "native" or fx is None or fo is None or so[1] != 1:
            raise ValueError("run_gather needs the native runner, x and out in f32 or bf16, out with unit inner "
                             "stride")
        if sx[1] != 1:
            x = x.contiguous()
            sx = x.stride()
        if hidden != table.hidden or not (x.is_cpu and out.is_cpu) or tuple(out.shape) != (len(experts), hidden):
            raise ValueError(f"run_gather: x [T, {table.hidden}] and out [{len(experts)}, {table.hidden}] on the "
                             f"CPU, got {tuple(x.shape)} and {tuple(out.shape)}")
        return x, (x.data_ptr(), fx, sx[0], T, out.data_ptr(), fo, so[0])

    def submit_routed(self, table: ExpertTable, experts, tokens, weights, x: torch.Tensor,
                      y: torch.Tensor) -> CpuFuture:
        """The per-layer fast path: task i is (table expert experts[i], token tokens[i], weight weights[i]).
        experts/tokens/weights are int/float sequences or 1-D tensors (e.g. a MoE layer's misses)."""
        experts, tokens, weights = as_lists(experts, tokens, weights)
        T, hidden = check_xy(x, y)
        if hidden != table.hidden:
            raise ValueError(f"x has hidden size {hidden}, the expert table {table.hidden}")
        if self.backend == "torch":
            try:
                tasks = table.tasks(experts, tokens, weights)
                bad = [t for t in tokens if not 0 <= t < T]
            except TypeError as exc:
                raise ValueError(f"bad routed task list: {exc}") from exc
            if bad:
                raise ValueError(f"task tokens {bad} are outside x's {T} rows")
            with self._lock:
                if self._pending is not None:
                    self._pending.wait()
                self._pending = self._submit_torch(tasks, x, y)
                return self._pending
        xf = fp32_rows(x)
        return self._submit_table(table, experts, tokens, weights,
                                  (xf.data_ptr(), xf.stride(0), y.data_ptr(), y.stride(0), T), (table, xf, y))

    def _submit_table(self, table, experts, tokens, weights, xy: tuple, keep: tuple | None) -> CpuFuture | None:
        """Native: the tasks (lists) on the table, x/y as (x_ptr, x_stride, y_ptr, y_stride, T). keep None: the
        result is waited for inside the same native call; else returns a future that keeps `keep` alive until
        waited on."""
        with self._routed_call():
            self._pool.submit_table(table._native, experts, tokens, weights, *xy, keep is None)
            if keep is not None:
                self._pending = CpuFuture(self._pool.wait, keep, self._pool.done)
            return self._pending

    @contextmanager
    def _routed_call(self):
        """A native call on a routed task list: the runner's lock held and its last submitted job waited for; a
        pybind TypeError (ids not ints; out-of-range ids raise ValueError already) raised as a ValueError."""
        with self._lock:
            if self._pending is not None:
                self._pending.wait()
                self._pending = None
            try:
                yield
            except TypeError as exc:
                raise ValueError(f"bad routed task list: {exc}") from exc

    def _submit_torch(self, tasks, x, y) -> CpuFuture:
        fut: Future = self._executor.submit(torch_experts, tasks, x, y)
        return CpuFuture(fut.result, (), fut.done)

    def wait(self) -> None:
        with self._lock:
            if self._pending is not None:
                self._pending.wait()
                self._pending = None

    def _submit_native(self, tasks, x, y, hidden, inter, dtype) -> CpuFuture:
        xf = fp32_rows(x)
        gu0, dn0 = (tasks[0][0], tasks[0][1]) if tasks else (None, None)
        self._pool.submit_moe(
            FORMATS[dtype], hidden, inter, gu0.stride(0) if tasks else hidden, dn0.stride(0) if tasks else inter,
            [t[0].data_ptr() for t in tasks], [t[1].data_ptr() for t in tasks],
            [int(t[2]) for t in tasks], [float(t[3]) for t in tasks],
            xf.data_ptr(), xf.stride(0), y.data_ptr(), y.stride(0), x.shape[0])
        return CpuFuture(self._pool.wait, (tasks, xf, y), self._pool.done)

    def set_profile(self, on: bool) -> None:
        """Native only: timestamp every worker's phases of the jobs from here on, or stop (a few clock reads per
        worker and job); either way the sums start again from zero."""
        if self.backend != "native":
            raise ValueError("profiling needs the native extension")
        self.wait()
        self._pool.set_profile(bool(on))

    def profile(self) -> dict:
        """Core-seconds of the profiled jobs since set_profile(True), by where they went: per job and worker,
        submit until wait() returns = dispatch (until the worker starts) + run (inside the kernels; by phase in
        run_phase_s) + barrier (between phases) + tail (waiting for the last worker) + wake (last worker done
        until wait() returns). jobs: how many; wall_s: their sum, threads x (submit to return) each."""
        if self.backend != "native":
            raise ValueError("profiling needs the native extension")
        return dict(self._pool.profile())

    @property
    def cpus(self) -> list[int]:
        """The CPUs the workers are pinned to, in worker order (empty: not pinned; the torch fallback)."""
        return list(self._pool.cpus) if self.backend == "native" else []

    def read_bandwidth_pass(self, buf: torch.Tensor, streams: int = 1, chunk_bytes: int = 0) -> int:
        """One read of a contiguous CPU tensor on this runner's threads (native only); returns the XOR of its
        8-byte words. chunk_bytes 0: each worker reads its own contiguous part (STREAM's static split); else
        the workers claim pieces of chunk_bytes (a multiple of 64) in turn, so a slow core holds up no one.
        streams=1: front to back; 2 or 4: that many equal pieces of a part (or chunk) side by side."""
        if self.backend != "native":
            raise ValueError("the read kernel needs the native extension")
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("the read buffer must be a contiguous CPU tensor")
        return self._pool.read(buf.data_ptr(), buf.numel() * buf.element_size(), streams, chunk_bytes)
