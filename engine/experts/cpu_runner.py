"""Run experts on the CPU straight from the host pool: the one function the backends call.

With the native kernels (engine/experts/cpu_kernels.py, branch `native`, extension built) they run the
experts; otherwise a torch CPU path does. The choice is the single assignment at the bottom of this file.
"""
from __future__ import annotations

import torch

from engine.experts.compute import expert_mlp
from engine.experts.layout import ExpertLayout, split_block


Result = tuple[torch.Tensor, torch.Tensor]  # (positions [N], outputs [N, H])


def _torch_run_on_cpu(x: torch.Tensor, jobs, layout: ExpertLayout, top_k: int) -> Result:
    """x [T, H] (CPU); jobs = [(pos LongTensor [n_e], block [numel])] -> (pos [N], y [N, H]) on the CPU."""
    outs, poss = [], []
    for pos, block in jobs:
        gate_up, down = split_block(block, layout)
        outs.append(expert_mlp(x[pos // top_k], gate_up, down))
        poss.append(pos)
    if not outs:
        return torch.empty(0, dtype=torch.long), x.new_empty(0, x.shape[1])
    return torch.cat(poss), torch.cat(outs)


_runners: dict = {}


def _native_run_on_cpu(x: torch.Tensor, jobs, layout: ExpertLayout, top_k: int) -> Result:
    """Same contract on the native runner: one x row per routed position, weight 1 (combine weights later).
    The runner's thread count follows torch.get_num_threads(), so `bench bw` can sweep it."""
    if not jobs:
        return torch.empty(0, dtype=torch.long), x.new_empty(0, x.shape[1])
    pos = torch.cat([p for p, _ in jobs])  # [N]
    rows = x[pos // top_k]  # [N, H]
    tasks, r = [], 0
    for p, block in jobs:
        gate_up, down = split_block(block, layout)
        tasks += [(gate_up, down, r + j, 1.0) for j in range(len(p))]
        r += len(p)
    y = torch.zeros(rows.shape, dtype=torch.float32)  # [N, H], accumulated into
    native_runner(torch.get_num_threads()).run(tasks, rows, y)
    return pos, y.to(x.dtype)


def native_runner(threads: int):
    """The native CpuExpertRunner with `threads` workers (one per count, reused), or None without it."""
    if cpu_kernels is None or not cpu_kernels.native_available():
        return None
    if threads not in _runners:
        _runners[threads] = cpu_kernels.CpuExpertRunner(threads=threads)
    return _runners[threads]


try:
    from engine.experts import cpu_kernels
except ImportError:  # the native branch is not merged yet
    cpu_kernels = None

run_on_cpu = (_native_run_on_cpu if cpu_kernels is not None and cpu_kernels.native_available()
              else _torch_run_on_cpu)
