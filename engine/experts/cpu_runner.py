"""Run experts on the CPU straight from the host pool: the one function the backends call.

run_on_cpu(x, host, jobs, layout, top_k, table=None, out=None, prompt=False): host is one layer's blocks [E, numel]
(HostPool .wait_layer), jobs = [(positions LongTensor [n_e], expert id)], or Pairs (the same as two flat arrays, one
entry a (token, k) pair: what a prompt's layer call builds, Routing.pairs). With the native kernels
(engine/experts/cpu_kernels.py, extension built) they run the experts on a table of the layer (layer_table: build it
once per layer and pass it, so a decode step's call checks nothing per expert); otherwise a torch CPU path does. The
choice is the single assignment at the bottom of this file. out: a buffer [>= N, H] of x's dtype (e.g. page-locked,
for the device to read in place) the outputs are written into; its first N rows come back. prompt: the call runs a
prompt's experts (several tokens each), on the prompt_threads() runner.

The native runner's worker count is its own setting (set_threads), not torch's intra-op thread count read on
every call: the engine's torch threads and the expert workers are separate pools, and asking torch each call
cost ~10 us with cold caches. Until set, it is torch.get_num_threads() at first use.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.experts.block_layout import ExpertLayout, split_block
from engine.experts.compute import expert_mlp


Result = tuple[torch.Tensor, torch.Tensor]  # (positions [N], outputs [N, H])


class Pairs(NamedTuple):
    """A CPU job as flat arrays, expert by expert: pair i is flat position pos[i] (token pos[i] // top_k) run by
    expert experts[i]. A prompt's layer call has ~2,000 pairs: a tensor an expert and lists built pair by pair in
    the job cost 0.18 ms more a call of 140 experts on the dev box, in the CPU's time between layers."""

    pos: np.ndarray  # [N] int64
    experts: np.ndarray  # [N] int64

    def jobs(self) -> list:
        """The same as [(positions LongTensor [n_e], expert id)], one entry an expert."""
        cut = np.flatnonzero(np.diff(self.experts)) + 1
        return [(torch.from_numpy(p), int(e[0])) for p, e in zip(np.split(self.pos, cut), np.split(self.experts, cut))
                if len(p)]


def _torch_run_on_cpu(x: torch.Tensor, host: torch.Tensor, jobs, layout: ExpertLayout, top_k: int,
                      table=None, out: torch.Tensor | None = None, prompt: bool = False, entered=None) -> Result:
    """x [T, H] (CPU); jobs = [(pos LongTensor [n_e], expert id)] or Pairs -> (pos [N], y [N, H]) on the CPU.
    entered: set as the work starts (its torch ops let other threads run)."""
    if entered is not None:
        entered.set()
    if isinstance(jobs, Pairs):
        jobs = jobs.jobs()
    outs, poss = [], []
    for pos, e in jobs:
        gate_up, down = split_block(host[e], layout)
        outs.append(expert_mlp(x[pos // top_k], gate_up, down))
        poss.append(pos)
    if not outs:
        return torch.empty(0, dtype=torch.long), x.new_empty(0, x.shape[1])
    y = torch.cat(outs)
    if out is not None:
        y = out[: len(y)].copy_(y)
    return torch.cat(poss), y


_runners: dict = {}
_threads: list = [None]  # set_threads' count; None: torch.get_num_threads() at the next call
_prompt_threads: list = [None]  # set_prompt_threads' count; None: expert_threads()
_tile_tokens: list = [None]  # set_tile_tokens' setting; None: the runner's default (cpu_kernels.TILE_TOKENS on AMX)


def set_threads(threads: int | None) -> None:
    """Worker count of the native runner run_on_cpu uses from now on (None: torch's thread count, read once at
    the next call). Benchmarks sweep it; an engine sets it once."""
    if threads is not None and threads < 1:
        raise ValueError(f"CPU expert threads must be >= 1, got {threads}")
    _threads[0] = threads


def expert_threads() -> int:
    if _threads[0] is None:
        _threads[0] = torch.get_num_threads()
    return _threads[0]


def set_prompt_threads(threads: int | None) -> None:
    """Worker count for a prompt's CPU experts (run_on_cpu(..., prompt=True); None: expert_threads()). Each
    of a prompt's experts takes several tokens and the kernels run compute-bound there (H200 box's Xeon, 8
    tokens an expert: 16 workers 1.6x the rate of 8), where a decode step's one token an expert is bound by host
    DRAM, which half the cores already read at full rate."""
    if threads is not None and threads < 1:
        raise ValueError(f"CPU expert threads must be >= 1, got {threads}")
    _prompt_threads[0] = threads


def prompt_threads() -> int:
    return _prompt_threads[0] or expert_threads()


def job_threads(prompt: bool) -> int:
    """Workers of a layer call's CPU job: prompt_threads() for a prompt's, else expert_threads()."""
    return prompt_threads() if prompt else _threads[0] or expert_threads()


def set_tile_tokens(tokens: int | None) -> None:
    """Layer calls whose experts average this many tokens or more run on the CPU's tile path where it has
    one (CpuExpertRunner tile_tokens; 0: never; None: the runner's default). Runners made before are dropped."""
    if tokens is not None and tokens < 0:
        raise ValueError(f"CPU expert tile tokens must be >= 0, got {tokens}")
    if tokens != _tile_tokens[0]:
        _tile_tokens[0] = tokens
        _runners.clear()


def layer_table(host: torch.Tensor, layout: ExpertLayout):
    """The native kernels' table of one layer's blocks [E, numel] (checked once; keep it with the layer), or
    None without the extension or for a dtype the kernels do not take (the torch path runs those)."""
    if cpu_kernels is None or not cpu_kernels.native_available() or host.dtype not in (torch.bfloat16,
                                                                                     torch.float32):
        return None
    return cpu_kernels.ExpertTable.from_blocks(host, layout.hidden, layout.inter)


def _native_run_on_cpu(x: torch.Tensor, host: torch.Tensor, jobs, layout: ExpertLayout, top_k: int,
                       table=None, out: torch.Tensor | None = None, prompt: bool = False, entered=None) -> Result:
    """Same contract on the native runner, one native call (CpuExpertRunner.run_gather: the job reads x's rows and
    writes the outputs in their own formats). A handful of torch calls on purpose: each costs 20-100 us with caches
    emptied by the previous call's streaming (dev box: 400-530 us a call of 8 experts outside the kernels before,
    170-300 after; docs/PERF.md Issue 17). The runner has expert_threads() workers, prompt_threads() with
    prompt=True. entered: set just before the native call, which lets go of the GIL (a caller waiting on it
    holds the GIL back until this thread no longer needs it: CpuJobs)."""
    if not len(jobs) or isinstance(jobs, Pairs) and not len(jobs.pos):
        if entered is not None:
            entered.set()
        return torch.empty(0, dtype=torch.long), x.new_empty(0, x.shape[1])
    table = table if table is not None else layer_table(host, layout)
    if table is None:
        return _torch_run_on_cpu(x, host, jobs, layout, top_k, out=out, entered=entered)
    if isinstance(jobs, Pairs):
        pos, flat, experts = torch.from_numpy(jobs.pos), jobs.pos, jobs.experts.tolist()
        rows = (flat // top_k).tolist()
    else:
        pos = torch.cat([p for p, _ in jobs]) if len(jobs) > 1 else jobs[0][0]  # [N]
        flat = pos.tolist()
        experts = [e for _, e in jobs] if len(flat) == len(jobs) else [e for p, e in jobs for _ in range(len(p))]
        rows = [q // top_k for q in flat]
    native = x.dtype in GATHER_DTYPES  # else (fp16) through f32, two more torch calls
    if native and out is not None:
        y = out[: len(flat)]  # [N, H], overwritten
    else:
        y = torch.empty(len(flat), layout.hidden, dtype=x.dtype if native else torch.float32)
    runner, x_in = native_runner(job_threads(prompt)), x if native else x.float()
    if entered is not None:
        entered.set()
    runner.run_gather(table, experts, rows, x_in, y)
    if not native:
        y = y.to(x.dtype) if out is None else out[: len(flat)].copy_(y)
    return pos, y


GATHER_DTYPES = (torch.bfloat16, torch.float32)  # activation dtypes run_gather reads and writes


def native_runner(threads: int):
    """The native CpuExpertRunner with `threads` workers (one per count, reused), or None without it."""
    if cpu_kernels is None or not cpu_kernels.native_available():
        return None
    if threads not in _runners:
        _runners[threads] = cpu_kernels.CpuExpertRunner(threads=threads, tile_tokens=_tile_tokens[0])
    return _runners[threads]


try:
    from engine.experts import cpu_kernels
except ImportError:  # the native branch is not merged yet
    cpu_kernels = None

NATIVE = cpu_kernels is not None and cpu_kernels.native_available()  # the extension is built and loads
run_on_cpu = _native_run_on_cpu if NATIVE else _torch_run_on_cpu
