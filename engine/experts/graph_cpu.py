"""The CPU's share of a mapped decode step (hybrid backend): some missing experts run on the CPU from the host
pool while the device reads the others over PCIe, inside the step's one CUDA graph.

A graphed step has no host code between its layers, so the device and a native thread hand off through a
mailbox in page-locked host memory (kernels: engine/kernels/mailbox_triton.py; thread: native Mailbox in
native/src/job_threads.h). MappedExperts marks a share of each layer's non-resident experts LOC_CPU in the
location table (device copy for the kernels, host copy for the thread): the expert kernels skip those pairs,
the thread runs them while the device runs the rest, and the join kernel scales their rows into the layer's
output. The pool's two readers, PCIe and the CPU cores, then share the layer's misses instead of PCIe
taking them all (both read the same host DRAM; the split that balances them is nearer m*B_H/(B_P+B_H) than
the paper's q*).

Which experts: a fixed random order per layer (seeded), the first `share` of the experts in it (among those
not in a slot): under uniform routing the CPU gets that share of the misses. The share starts from the
measured rates (BandwidthEstimate.cpu_share: PCIe at 0.9 of B_P, the kernels' in-place rate, the CPU at what
the host's DRAM leaves beside it) and follows the measured step time (policy.ShareSearch: a hill climb on
paired steps). Where the search settles, and where its best stands every KEEP_STEPS steps of a batch size (with
the box's step noise it may climb for hundreds of steps without settling), the share is kept in this machine's
profile directory (profile.py: save_shares), per batch size, and a later process with the same model, slots and
threads starts there.
The wait kernel's spins say how often the device waited for the CPU (stats); the best share has it wait a
little in most steps, so that is not the signal.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.experts import profile
from engine.experts.policy import ShareSearch
from engine.kernels.moe_pairs_triton import LOC_CPU

log = logging.getLogger("killick.experts")

WAIT_SPINS = 16  # spins (~1 us each on the GPU box) over a step's layers that count as waiting (stats)
MAX_SHARE = 0.9
# a batch size's best share is kept every this many of its steps, settled or not: on the H200 box a 600-step run
# (8 layers, b1) climbed from the rates' 0.47 to 0.83 in 16 moves without resting once (both sides losing at the
# smallest stride, which the step noise rarely allows), ran 335 tok/s against 280-290 for short runs from 0.47,
# and kept nothing (docs/PERF.md, twenty-fourth session). A move needs at least 12 pairs of steps (48 steps).
KEEP_STEPS = 256


def available(backend, dtype: torch.dtype) -> str | None:
    """None if the CPU share can run here, else why not (one line for the log)."""
    from engine.experts import cpu_runner

    if backend.name != "hybrid":
        return "not a hybrid backend"
    if not cpu_runner.NATIVE:
        return "the native CPU kernels are not built"
    if dtype not in (torch.bfloat16, torch.float32) or backend.pool.dtype not in (torch.bfloat16, torch.float32):
        return f"the CPU kernels take bf16 or fp32 (activations {dtype}, pool {backend.pool.dtype})"
    return None


class CpuShare:
    def __init__(self, backend, n_max: int, kp: int, dtype: torch.dtype, share: float | None = None,
                 seed: int = 0, tag: str = "") -> None:
        from engine.experts import cpu_kernels, cpu_runner, cpu_tasks

        pool = backend.pool
        self.L, self.E, H = len(pool.layers), pool.num_experts, pool.layout.hidden
        self.n_max = n_max  # publish checks a step's rows against it
        cuda = backend.device.type == "cuda"

        def host(*shape, dtype):  # page-locked on CUDA: the kernels address it through the mapping
            return torch.zeros(shape, dtype=dtype, pin_memory=cuda)

        self.posted, self.done = host(1, dtype=torch.int64), host(1, dtype=torch.int64)
        self.err, self.meta = host(1, dtype=torch.int32), host(2, dtype=torch.int32)
        self.spins = host(self.L, dtype=torch.int32)  # per layer row: the wait kernel's spins this step
        self.ids = host(n_max * kp, dtype=torch.int32)
        self.x = host(n_max, H, dtype=dtype)
        self.out = host(n_max * kp, H, dtype=torch.float32)
        self.seq = torch.zeros(1, dtype=torch.int64, device=backend.device)
        self.loc = torch.full((self.L, self.E + 1), -1, dtype=torch.int32)  # the thread's copy of the table
        # order[row, e]: expert e's place in its layer's random order (the first `share` of it is the CPU's)
        rng = np.random.default_rng(seed)
        self.order = rng.permuted(np.broadcast_to(np.arange(self.E), (self.L, self.E)), axis=1)
        self.start = share if share is not None else backend.estimate.cpu_share()
        self.searches: dict[int, ShareSearch] = {}  # per batch size: its best share differs (misses per layer)
        self.starts: dict[int, float] = {}  # where each batch size's search started (stats: a benchmark says it)
        self.adapt = share is None
        self.waited_steps = self.steps = 0
        self._began: float | None = None
        runner = cpu_runner.native_runner(cpu_runner.expert_threads())
        # settled shares of earlier processes on this machine and model shape (profile.ShareMemory)
        self.memory = profile.ShareMemory(profile.share_key(pool.layout, pool.dtype, runner.threads, self.L,
                                                            backend.cache.num_slots, tag) if self.adapt else None)
        self._rests: dict[int, int] = {}  # per batch size: the search's settlements already kept
        self._unkept: dict[int, int] = {}  # per batch size: its steps since its best was last kept
        self._backend = backend  # its cache's slot count is the key's (a resize changes it)
        self._warned = False  # about a share that could not be written
        self.share = self.memory.start(1, {}, self.start) if self.adapt else self.start
        self.tables = [cpu_runner.layer_table(pool.wait_layer(layer), pool.layout) for layer in pool.layers]
        fmt = cpu_tasks.FORMATS
        self.box = cpu_kernels._native.Mailbox(
            runner._pool, [t._native for t in self.tables], self.posted.data_ptr(), self.done.data_ptr(),
            self.meta.data_ptr(), self.ids.data_ptr(), self.x.data_ptr(), fmt[dtype], self.out.data_ptr(),
            fmt[torch.float32], H, kp, n_max, self.loc.data_ptr(), self.E)
        self._runner = runner  # the thread uses its pool: keep it
        self.box.start()
        if not self.adapt:
            origin = "fixed"
        elif self.memory.shares:
            origin = "settled before here: " + ", ".join(f"b{r} {v:.2f}" for r, v in sorted(self.memory.shares.items()))
        else:
            origin = f"the rates' balance {self.start:.2f}"
        log.info("hybrid decode: the CPU runs a %.0f%% share of the missing experts inside the step's graph "
                 "(%d threads; start: %s)", 100 * self.share, runner.threads, origin)

    def mark(self, table: np.ndarray) -> np.ndarray:
        """table [L, E] (slot or -1) -> the same with the CPU's share of the non-resident experts LOC_CPU; the
        thread's copy follows (it reads it only while a step runs, and a step runs after this)."""
        cpu = (table < 0) & (self.order < int(round(self.share * self.E)))
        out = np.where(cpu, LOC_CPU, table).astype(np.int32)
        self.loc.numpy()[:, : self.E] = out
        return out

    def after_step(self, rows: int) -> None:
        """At the next step's begin (the last step, of `rows` sequences, finished): check the thread answered,
        count whether the device waited for it, and give the step's time to the share's search."""
        now = time.perf_counter()
        if int(self.err[0]):
            self.err[0] = 0
            raise RuntimeError("the CPU expert thread did not answer a decode step in time (native Mailbox); "
                               "restart the server or run --moe-backend offload")
        self.steps += 1
        self.waited_steps += int(self.spins.sum()) > WAIT_SPINS
        if self.adapt and self._began is not None:
            search = self._search(rows)
            search.observe(now - self._began, rows)
            self._unkept[rows] = self._unkept.get(rows, 0) + 1
            settled = search.rests > self._rests.get(rows, 0)
            # it settled, or has run long enough for its best to beat where the next process would start
            if settled or (self._unkept[rows] >= KEEP_STEPS and self.memory.shares.get(rows) != search.best):
                self._rests[rows], self._unkept[rows] = search.rests, 0
                slots = self._backend.cache.num_slots
                if self.memory.key is not None and self.memory.key["slots"] != slots:  # resized (ctl cache)
                    self.memory = profile.ShareMemory(dict(self.memory.key, slots=slots))
                self.memory.settle(rows, search.best)
                if self.memory.error is not None and not self._warned:
                    self._warned = True
                    log.warning("hybrid decode: the settled CPU share cannot be kept (%s); each start searches "
                                "anew", self.memory.error)
        self._began = now

    def before_step(self, rows: int) -> None:
        """Before a step of `rows` sequences (before the table is pushed): that batch size's share."""
        if self.adapt:
            self.share = self._search(rows).share

    def _search(self, rows: int) -> ShareSearch:
        """A batch size's search, made on its first step where profile.ShareMemory.start says."""
        if rows not in self.searches:
            running = {r: sr.best for r, sr in self.searches.items()}
            self.starts[rows] = self.memory.start(rows, running, self.start)
            self.searches[rows] = ShareSearch(self.starts[rows], hi=MAX_SHARE)
        return self.searches[rows]

    def stats(self) -> dict:
        st = dict(self.box.stats())
        st.update(share=self.share, steps=self.steps, waited_steps=self.waited_steps,
                  best={rows: round(sr.best, 3) for rows, sr in sorted(self.searches.items())},
                  start={rows: round(v, 3) for rows, v in sorted(self.starts.items())},
                  settled={rows: round(v, 3) for rows, v in sorted(self.memory.shares.items())},
                  moves=sum(sr.moves for sr in self.searches.values()))
        return st

    def close(self) -> None:
        """End the thread (it polls every 50 us while idle); wake() starts it again."""
        self.box.stop()

    def wake(self) -> None:
        """Before a step: the thread runs (a stopped engine closed it, and a later one uses this backend)."""
        if not self.box.running:
            self.box.start()
