"""Fill the host pool straight from a checkpoint's safetensors, one layer at a time.

The model loader hands backends an ExpertWeights source that holds every expert in memory; for a pool
larger than half the host RAM that copy cannot coexist with the pool. Load the model with
`expert_device="meta"` (shapes only) and let `experts_factory(..., checkpoint=DIR)` fill the pool here:
peak memory is the pool plus one layer. Fused (`mlp.experts.gate_up_proj` [E, 2I, H]) and per-expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) layouts give the same bytes.
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from engine.config import load_config
from engine.experts.block_layout import ExpertLayout
from engine.experts.host_pool import FillFn, HostPool
from engine.loader import CheckpointReader
from engine.weight_names import fused_expert_shapes, per_expert_shapes


def checkpoint_fill(model_dir, dtype: torch.dtype, stack: ExitStack) -> FillFn:
    """A FillFn reading layer `layer`'s experts from `model_dir` (handles live as long as `stack`)."""
    cfg = load_config(Path(model_dir))
    reader = CheckpointReader(Path(model_dir), stack, torch.device("cpu"), dtype)

    def fill(layer: int, buf: torch.Tensor) -> None:  # buf [E, numel]
        (gu_name, gu_shape), (d_name, d_shape) = fused_expert_shapes(cfg, layer).items()
        gu = gu_shape[1] * gu_shape[2]
        if reader.has(gu_name):
            buf[:, :gu].view(gu_shape).copy_(reader.get(gu_name, gu_shape))
            buf[:, gu:].view(d_shape).copy_(reader.get(d_name, d_shape))
            return
        for e in range(cfg.num_experts):
            (g_name, g_shape), (u_name, u_shape), (dn_name, dn_shape) = per_expert_shapes(cfg, layer, e).items()
            half = gu // 2
            buf[e, :half].view(g_shape).copy_(reader.get(g_name, g_shape))
            buf[e, half:gu].view(u_shape).copy_(reader.get(u_name, u_shape))
            buf[e, gu:].view(dn_shape).copy_(reader.get(dn_name, dn_shape))

    return fill


def pool_from_checkpoint(model_dir, source, **load_kw) -> HostPool:
    """Pool shaped like `source` (any device, "meta" included) filled from the files in `model_dir`."""
    layout = ExpertLayout(source.hidden_size, source.intermediate_size, source.dtype.itemsize)
    pool = HostPool(source.layers, source.num_experts, layout, source.dtype)
    stack = ExitStack()
    fill = checkpoint_fill(model_dir, source.dtype, stack)

    def fill_then_close(layer: int, buf: torch.Tensor) -> None:
        try:
            fill(layer, buf)
        except BaseException:
            stack.close()
            raise
        if layer == pool.layers[-1]:
            stack.close()

    return pool.load(fill_then_close, **load_kw)
