"""Run experts on the CPU straight from the host pool: the one function the backends call.

run_on_cpu(x, host, jobs, layout, top_k, table=None): host is one layer's blocks [E, numel] (HostPool
.wait_layer), jobs = [(positions LongTensor [n_e], expert id)]. With the native kernels
(engine/experts/cpu_kernels.py, extension built) they run the experts on a table of the layer (layer_table:
build it once per layer and pass it, so a decode step's call checks nothing per expert); otherwise a torch
CPU path does. The choice is the single assignment at the bottom of this file.
"""
from __future__ import annotations

import torch

from engine.experts.block_layout import ExpertLayout, split_block
from engine.experts.compute import expert_mlp


Result = tuple[torch.Tensor, torch.Tensor]  # (positions [N], outputs [N, H])


def _torch_run_on_cpu(x: torch.Tensor, host: torch.Tensor, jobs, layout: ExpertLayout, top_k: int,
                      table=None) -> Result:
    """x [T, H] (CPU); jobs = [(pos LongTensor [n_e], expert id)] -> (pos [N], y [N, H]) on the CPU."""
    outs, poss = [], []
    for pos, e in jobs:
        gate_up, down = split_block(host[e], layout)
        outs.append(expert_mlp(x[pos // top_k], gate_up, down))
        poss.append(pos)
    if not outs:
        return torch.empty(0, dtype=torch.long), x.new_empty(0, x.shape[1])
    return torch.cat(poss), torch.cat(outs)


_runners: dict = {}


def layer_table(host: torch.Tensor, layout: ExpertLayout):
    """The native kernels' table of one layer's blocks [E, numel] (checked once; keep it with the layer), or
    None without the extension or for a dtype the kernels do not take (the torch path runs those)."""
    if cpu_kernels is None or not cpu_kernels.native_available() or host.dtype not in (torch.bfloat16,
                                                                                     torch.float32):
        return None
    return cpu_kernels.ExpertTable.from_blocks(host, layout.hidden, layout.inter)


def _native_run_on_cpu(x: torch.Tensor, host: torch.Tensor, jobs, layout: ExpertLayout, top_k: int,
                       table=None) -> Result:
    """Same contract on the native runner: one x row per routed position, weight 1 (combine weights later).
    The runner's thread count follows torch.get_num_threads(), so `bench bw` can sweep it."""
    if not jobs:
        return torch.empty(0, dtype=torch.long), x.new_empty(0, x.shape[1])
    table = table if table is not None else layer_table(host, layout)
    if table is None:
        return _torch_run_on_cpu(x, host, jobs, layout, top_k)
    pos = torch.cat([p for p, _ in jobs])  # [N]
    # index_select, not x[...]: advanced indexing runs an OpenMP region whose threads then spin on the cores
    # the native workers stream on (dev box: 3.3 -> 7.4 ms a call of 8 experts; docs/PERF.md)
    rows = torch.index_select(x, 0, pos // top_k)  # [N, H]
    experts = [e for p, e in jobs for _ in range(len(p))]
    y = torch.zeros(rows.shape, dtype=torch.float32)  # [N, H], accumulated into
    n = len(experts)
    native_runner(torch.get_num_threads()).run_routed(table, experts, list(range(n)), [1.0] * n, rows, y)
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
