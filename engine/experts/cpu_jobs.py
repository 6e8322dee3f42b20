"""A slot backend's CPU share of one layer call: its missing experts run from the host pool while the device runs
the rest, their outputs then placed into the layer's rows (OffloadBackend.forward). The job is posted to the native
runner, its pool's workers on it as start() returns (CpuExpertRunner.post_gather); without the extension, or for a
pool or activations its kernels do not take, a Python worker thread runs it (cpu_runner.run_on_cpu).

    jobs = CpuJobs(pool, device, zero_copy)
    jobs.stage(x)                                        # optional, before the routing's read-back (CUDA)
    pending = jobs.start(layer, x, routing, on_cpu)      # None without CPU work; else .result() -> CpuResult
    done = pending.result()
    jobs.place(y, done)                                  # y [T*K, H] at done.pos <- done.vals

or, joined on the device (`raise_flag`: the host goes on queuing the layers after while the job runs):

    pending = jobs.start(layer, x, routing, on_cpu, raise_flag=True)
    jobs.join_on_device(y)                               # queued: wait for the job's flag, then scatter its rows
    jobs.defer(pending, on_done)
    ...
    jobs.collect()                                       # later: on_done(its result), or its error raised
    jobs.collect(hold=True); ...; jobs.observe_held()    # or its error now, on_done at observe_held()

T = tokens, K = experts per token, H = hidden. A native job, or one with zero_copy (CUDA, grouped kernels), writes
its positions and outputs into buffers kept for the next call, page-locked on CUDA; with zero_copy the device
reads them in place (mailbox_triton.scatter_rows), else they are copied to it. A job started with raise_flag
writes there too, then raises a page-locked flag the device waits on (mailbox_triton.wait_flag) before reading
them.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from engine.experts.compute import Routing
from engine.experts.cpu_runner import GATHER_DTYPES, Pairs, job_threads, layer_table, native_runner, run_on_cpu
from engine.experts.host_pool import HostPool

# a layer call of at least this many tokens (a prompt's) runs its CPU experts on cpu_runner.prompt_threads()
PROMPT_TOKENS = 32
# whether such a call with the grouped kernels joins its CPU job on the device (raise_flag), the host queuing the
# layers after while the job runs, instead of waiting for it (the host's work between one job's end and the next
# job's start, ~3 ms a layer, then overlaps the job). H100 boxes, 256-token extends after an 8k prompt, Zipf 1.0,
# alternated processes: 85.8 / 90.2 ms against the host's 112.0 / 96.8 (docs/PERF.md thirty-eighth session); seven
# of eleven such pairs over three sessions, though only three of six on the thirty-ninth's two boxes (medians 86.2
# against 83.2 ms): within the boxes' noise there. EngineOptions.cpu_join (serve and the benches' --cpu-join) sets
# it through set_join_on_device()
JOIN_ON_DEVICE = True


def set_join_on_device(on: bool) -> None:
    global JOIN_ON_DEVICE
    JOIN_ON_DEVICE = bool(on)


class CpuResult(NamedTuple):
    """A layer call's CPU share, done."""

    pos: torch.Tensor  # [N] int64: the (token, k) positions of y it ran
    vals: torch.Tensor  # [N, H]: their outputs
    seconds: float  # how long it ran
    started: float  # perf_counter when it began
    pinned: bool  # pos and vals are the page-locked buffers the device reads in place (zero_copy)


class CpuJobs:
    def __init__(self, pool: HostPool, device: torch.device, zero_copy: bool) -> None:
        self.pool, self.device, self.zero_copy = pool, device, zero_copy
        self._worker: ThreadPoolExecutor | None = None  # started by the first job, ended by close()
        self._tables: dict = {}  # layer -> cpu_runner.layer_table of its host blocks, built on first use
        self._out: dict = {}  # dtype -> (positions [cap] int64, outputs [cap, H]), page-locked on CUDA
        self._x_host: dict = {}  # dtype -> [cap, H] page-locked: a CUDA call's rows for its job (_host_rows)
        self._scatter_done = None  # CUDA event after the last scatter_rows, their reader
        # raise_flag's: the flag (page-locked int64 [1]: the last job done), the device's give-up flag, the last
        # job's number, and the outputs join_on_device reads: (positions, outputs, rows)
        self._flag = self._err = None
        self._seq = 0
        self._flagged = None
        self._deferred = None  # a joined job to collect: (its Future, on_done)
        self._held = None  # a collected job's (on_done, result), for observe_held()
        self._staged = None  # stage()'s (x, (rows, event))
        self._posted = None  # the runner the last _post went to

    def start(self, layer: int, x: torch.Tensor, routing: Routing, on_cpu: list[int],
              raise_flag: bool = False) -> "Future | PostedJob | None":
        """Run Routing.experts[i] for i in on_cpu on the CPU over their tokens of x [T, H] (a prompt's layer call,
        PROMPT_TOKENS or more, on the prompt runner). raise_flag: its outputs are joined on the device
        (join_on_device), the flag raised as the job ends, failed or not."""
        if not on_cpu:
            return None
        host = self.pool.wait_layer(layer)
        if layer not in self._tables:
            self._tables[layer] = layer_table(host, self.pool.layout)
        jobs = Pairs(*routing.pairs(on_cpu))
        table = self._tables[layer]
        runner = native_runner(job_threads(x.shape[0] >= PROMPT_TOKENS)) \
            if table is not None and x.dtype in GATHER_DTYPES else None
        out = self._buffers(x.dtype, len(jobs.pos), x.shape[0] * routing.top_k) \
            if self.zero_copy or raise_flag or runner is not None else None
        seq = self._next_flag(out, len(jobs.pos)) if raise_flag else None
        staged, self._staged = self._staged, None
        rows, copied = staged[1] if staged is not None and staged[0] is x else self._host_rows(x)
        if runner is not None:
            return self._post(runner, rows, jobs, routing.top_k, table, out, copied, seq,
                              self.device.type == "cuda" and (self.zero_copy or raise_flag))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="experts-cpu")
        entered = threading.Event()
        pending = self._worker.submit(self._run, rows, host, jobs, routing.top_k, self._tables[layer], out,
                                      x.shape[0] >= PROMPT_TOKENS, copied, entered, seq)
        # until the job is in its native call, which needs no GIL: the worker's Python before it got the GIL back
        # from this thread, busy queueing the device's work, only at the interpreter's switch interval (5 ms) (on
        # the H100 box a job started 0.9-1.4 ms after its layer's routing; the planning between takes ~0.3 ms on
        # the dev box)
        entered.wait()
        return pending

    def _post(self, runner, rows: torch.Tensor, jobs: Pairs, top_k: int, table, out, copied, seq: int | None,
              in_place: bool) -> "PostedJob":
        """start()'s job posted to the native runner (CpuExpertRunner.post_gather), into out's rows: the
        pool's workers are on it as this returns, with no Python thread to wake and hand the GIL to between
        (that hand-over took most of the ~0.3 ms from the plan to the job's start on the H100 box). in_place: the
        device reads out's rows where they are (CpuResult.pinned)."""
        n = len(jobs.pos)
        pos, vals = out[0][:n], out[1][:n]
        pos.copy_(torch.from_numpy(jobs.pos))
        if copied is not None:
            copied.synchronize()  # (done already where stage() queued the copy: the routing's read-back waited)
        runner.post_gather(table, jobs.experts, jobs.pos // top_k, rows, vals,
                           self._flag if seq is not None else None, seq or 0)
        self._posted = runner
        return PostedJob(runner, pos, vals, in_place)

    def stage(self, x: torch.Tensor) -> None:
        """x's rows' copy for the next start() of x, queued now on CUDA: before the routing's read-back
        (OffloadBackend.forward), which waits for the stream, so the job finds them there and the host queued
        them while it waited for the device, not between the routing and the job (~0.09 ms of the engine
        thread's a layer call on the H100 box)."""
        self._staged = (x, self._host_rows(x)) if x.device.type == "cuda" else None

    def _host_rows(self, x: torch.Tensor):
        """-> (x's rows where the job reads them, the CUDA event after their copy or None). On CUDA a copy into
        page-locked memory queued on the stream, which the job waits for (a pageable copy held the engine thread
        until done, at half the rate); the buffer is reused: the last call's job was waited for, or its join
        (join_on_device's wait, queued before this copy on the same stream) holds the copy until it has ended."""
        if x.device.type != "cuda":
            return x.to("cpu"), None
        T, H = x.shape
        rows = self._grow_rows(x.dtype, T, H)[:T]
        rows.copy_(x, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return rows, copied

    def _next_flag(self, out, rows: int) -> int:
        """The number the next raise_flag job raises the flag to, its outputs kept for join_on_device."""
        if self._flag is None:  # page-locked on CUDA: the device reads the flag and writes err in place
            pin = self.device.type == "cuda"
            with torch.inference_mode(False):  # normal tensors: the job's worker, outside inference mode, writes
                self._flag = torch.zeros(1, dtype=torch.long, pin_memory=pin)
                self._err = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self._seq += 1
        self._flagged = (out[0][:rows], out[1][:rows], self._seq)
        return self._seq

    def join_on_device(self, y: torch.Tensor, timed: bool = False):
        """Queue on y's stream: wait until the last raise_flag job is done, then y [T*K, H] at its positions <-
        its outputs, read in place. The host goes on at once. timed (CUDA): -> timing events (before, after) the
        wait, whose elapsed time is how long the device waited for the job; else None."""
        from engine.kernels.mailbox_triton import scatter_rows, wait_flag

        pos, vals, seq = self._flagged
        waits = None
        if timed and self.device.type == "cuda":
            waits = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            waits[0].record()
        wait_flag(self._flag, seq, self._err)
        if waits is not None:
            waits[1].record()
        scatter_rows(y, pos, vals)
        if self.device.type == "cuda":
            self._scatter_done = torch.cuda.Event()
            self._scatter_done.record()
        return waits

    def defer(self, pending: Future, on_done) -> None:
        """A raise_flag job joined on the device: collect() takes its result later and hands it to on_done."""
        self.collect()
        self._deferred = (pending, on_done)

    def collect(self, hold: bool = False) -> None:
        """The deferred job's result (waited for: by the time the device has read its outputs, which a later
        routing's read-back implies, it is there), handed to its on_done; with `hold`, kept for observe_held()
        instead. Its error raises here, as does the device's wait given up before the job was done (the layer's
        output read unwritten rows). Nothing without one."""
        self.observe_held()
        if self._deferred is None:
            return
        (pending, on_done), self._deferred = self._deferred, None
        done = pending.result()
        if int(self._err[0]):  # (page-locked on CUDA: read in place, once the device is past the wait)
            self._err.zero_()
            raise RuntimeError(f"the device gave up waiting for a CPU expert job after {done.seconds:.1f} s: that "
                               "layer's output is wrong; the request fails")
        if hold:
            self._held = (on_done, done)
        else:
            on_done(done)

    def observe_held(self) -> None:
        """on_done of the result collect(hold=True) kept, if any: a routed call takes the last job's result before
        its plan and hands it on once its own job is posted, so the rates it observes (~0.25 ms of the engine
        thread between the routing and the job on the H100 box) run while the CPU works."""
        held, self._held = self._held, None
        if held is not None:
            held[0](held[1])

    def drop(self) -> None:
        """The deferred job, if any, waited for and forgotten, its outcome with it (its forward has failed), as is a
        result collect(hold=True) kept."""
        self._held = None
        if self._deferred is not None:
            pending, self._deferred = self._deferred[0], None
            pending.exception()  # waits; the job's error, if any, goes with it

    def place(self, y: torch.Tensor, done: CpuResult) -> None:
        """y [T*K, H] at done.pos <- done.vals: read in place from page-locked memory by a kernel on CUDA, else
        copied."""
        if done.pinned:
            from engine.kernels.mailbox_triton import scatter_rows

            scatter_rows(y, done.pos, done.vals)
            self._scatter_done = torch.cuda.Event()
            self._scatter_done.record()
        else:
            y[done.pos.to(self.device)] = done.vals.to(self.device, y.dtype)

    def close(self) -> None:
        """End the worker thread (after its job) and wait for a job posted to the native runner, which writes this
        object's buffers; the next start() makes a new worker. Again: nothing happens."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self._posted is not None:  # its job writes this object's buffers until done
            self._posted.wait_gather()
            self._posted = None
        self._deferred = self._staged = self._held = None
        self._tables.clear()

    def _run(self, x_cpu: torch.Tensor, host: torch.Tensor, jobs: Pairs, top_k: int, table, out=None,
             prompt: bool = False, copied=None, entered: threading.Event | None = None,
             seq: int | None = None) -> CpuResult:
        """Into `out` (positions, outputs: _buffers') when given. In inference mode, as the engine's thread that
        made `out` (a worker thread starts outside it, and writing an inference tensor there raises). prompt: a
        prompt's layer call (cpu_runner.prompt_threads); copied: the event after x_cpu's copy (_host_rows);
        entered: set once the job no longer needs the GIL (or has failed); seq: the flag raised at the end, once
        the outputs are in out's rows (raise_flag)."""
        try:
            if copied is not None:
                copied.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                pos, vals = run_on_cpu(x_cpu, host, jobs, self.pool.layout, top_k, table,
                                       out=None if out is None else out[1], prompt=prompt, entered=entered)
                if out is not None:
                    pos = out[0][: len(pos)].copy_(pos)
                    if seq is not None and vals.data_ptr() != out[1].data_ptr():
                        vals = out[1][: len(vals)].copy_(vals)
        finally:
            if entered is not None:
                entered.set()
            if seq is not None:
                self._flag[0] = seq
        # whether the outputs landed in out's rows, page-locked on CUDA (a path that cannot write there returns
        # its own)
        pinned = out is not None and self.device.type == "cuda" and vals.data_ptr() == out[1].data_ptr()
        return CpuResult(pos, vals, time.perf_counter() - t0, t0, pinned)

    def _buffers(self, dtype: torch.dtype, rows: int, bound: int):
        """(positions [>= rows] int64, outputs [>= rows, H]) for a job to write, page-locked on CUDA; the last
        scatter_rows that read them has run (normally long since: the routing's read-back waited for it). Grown
        to hold `bound` rows (every pair of the call: however the split goes, no later call of its size grows
        them): page-locking a grown buffer held the engine thread 3.2-4.2 ms between a split and its job, in
        the first timed extend of a process whose CPU share passed its warm-up's (H100 and H200 boxes, docs/PERF.md
        forty-sixth session)."""
        if self._scatter_done is not None:
            self._scatter_done.synchronize()
        buf = self._out.get(dtype)
        return buf if buf is not None and buf[0].shape[0] >= rows else self._grow_out(dtype, max(rows, bound))

    def reserve(self, tokens: int, top_k: int, dtype: torch.dtype) -> None:
        """Size now, outside any request (the engine's warm-up), the buffers a prompt call of `tokens` tokens
        routed to top_k experts each can need: the job's outputs (_buffers) and, on CUDA, the call's rows
        (_host_rows). Grown inside a layer call instead, their page-locking held the engine thread there: 3.0 ms
        in a process's first 256-token extend (H100 box, docs/PERF.md forty-seventh session), more for a longer
        prompt's. The warm-up's own prompts need not grow them: a cold hybrid split may fill every miss."""
        self._buffers(dtype, tokens * top_k, tokens * top_k)
        if self.device.type == "cuda":
            self._grow_rows(dtype, tokens, self.pool.layout.hidden)

    def _grow_out(self, dtype: torch.dtype, rows: int):
        """_buffers' pair, replaced by one of _capacity(rows) rows."""
        cap, pin = _capacity(rows), self.device.type == "cuda"
        buf = self._out[dtype] = (torch.empty(cap, dtype=torch.long, pin_memory=pin),
                                  torch.empty(cap, self.pool.layout.hidden, dtype=dtype, pin_memory=pin))
        return buf

    def _grow_rows(self, dtype: torch.dtype, tokens: int, hidden: int) -> torch.Tensor:
        """_host_rows' page-locked buffer [>= tokens, hidden], replaced when smaller (or of another width)."""
        buf = self._x_host.get(dtype)
        if buf is None or buf.shape[0] < tokens or buf.shape[1] != hidden:
            buf = self._x_host[dtype] = torch.empty(_capacity(tokens), hidden, dtype=dtype, pin_memory=True)
        return buf


class PostedJob(NamedTuple):
    """A job posted to a native runner (CpuJobs._post), its result waited for as a Future's."""

    runner: object  # cpu_kernels.CpuExpertRunner
    pos: torch.Tensor
    vals: torch.Tensor
    pinned: bool

    def result(self) -> CpuResult:
        started, seconds = self.runner.wait_gather()
        return CpuResult(self.pos, self.vals, seconds, started, self.pinned)

    def exception(self) -> BaseException | None:
        try:
            self.result()
        except Exception as exc:
            return exc
        return None


def _capacity(rows: int) -> int:
    """Rows of a reused buffer that must hold `rows`: the next power of two, at least 1024 (few regrowths)."""
    return 1 << max(10, (rows - 1).bit_length())
