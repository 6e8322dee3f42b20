"""Run experts on the CPU straight from the host pool: the one function the backends call.

Until the native kernels land (engine/experts/cpu_kernels.py, branch `native`) this is a torch CPU path;
swapping is the single assignment `run_on_cpu = ...` at the bottom of this file.
"""
from __future__ import annotations

import torch

from engine.experts.compute import expert_mlp
from engine.experts.layout import ExpertLayout, split_block


def _torch_run_on_cpu(x: torch.Tensor, jobs, layout: ExpertLayout, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (CPU); jobs = [(pos LongTensor [n_e], block [numel])] -> (pos [N], y [N, H]) on the CPU."""
    outs, poss = [], []
    for pos, block in jobs:
        gate_up, down = split_block(block, layout)
        outs.append(expert_mlp(x[pos // top_k], gate_up, down))
        poss.append(pos)
    if not outs:
        return torch.empty(0, dtype=torch.long), x.new_empty(0, x.shape[1])
    return torch.cat(poss), torch.cat(outs)


run_on_cpu = _torch_run_on_cpu
