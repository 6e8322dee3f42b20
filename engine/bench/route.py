"""Cost of one MoE layer's decode bookkeeping: the Triton routing kernel (CUDA) against the host path the
backends use today (device->host routing copy, grouping, SlotTable lookup / victims / assign), and the whole
host side of OffloadBackend.forward. Part of `killick bench decode` (decode.py): it says how much of a decode
step is bookkeeping rather than bytes."""
from __future__ import annotations

import time

import torch

from engine.experts.compute import Routing
from engine.experts.lru import SlotTable
from engine.experts.policy import q_star


def _routes(shape, device, steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(shape.experts, generator=g)[:shape.top_k].view(1, -1).to(device)
            for _ in range(steps)]  # [1, K] each: batch-1 decode


def host_us(shape, slots: int, device, steps: int = 400, ratio: float = 0.8) -> float:
    """Microseconds per layer step of the host bookkeeping, D2H copy of the routing included."""
    table, routes = SlotTable(shape.layers, shape.experts, slots), _routes(shape, device, steps)
    t0 = time.perf_counter()
    for i, ids in enumerate(routes):
        layer, r = i % shape.layers, Routing.of(ids)
        table.tick()
        s = table.lookup(layer, r.experts)
        table.touch(s[s >= 0])
        table.lock(s[s >= 0])
        miss = [e for e, x in zip(r.experts, s) if x < 0]
        victims = table.victims(q_star(len(miss), ratio, 1.0)).tolist()
        for e, v in zip(miss, victims):
            table.assign(v, layer, e)
        table.unlock_all()
    return (time.perf_counter() - t0) / steps * 1e6


def kernel_us(shape, slots: int, device, steps: int = 400, ratio: float = 0.8) -> float:
    """Microseconds per layer step of the Triton routing kernel (launches queued back to back)."""
    from engine.kernels.route_triton import route_triton

    resident = torch.full((shape.layers, shape.experts), -1, dtype=torch.int32, device=device)
    owner = torch.full((slots,), -1, dtype=torch.int32, device=device)
    stamp = torch.full((slots,), -1, dtype=torch.int64, device=device)
    routes = _routes(shape, device, steps)
    route_triton(routes[0], resident, owner, stamp, 0, 1, ratio)  # compile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, ids in enumerate(routes):
        route_triton(ids, resident, owner, stamp, i % shape.layers, i + 2, ratio)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e6


def backend_us(shape, slots: int, device, pool, steps: int = 400) -> float:
    """Microseconds per layer step of everything OffloadBackend.forward does on the host at batch 1 (routing
    copy, grouping, lfu table, fills issued, combine), its device expert launches replaced by nothing."""
    from engine.experts.offload import OffloadBackend
    from engine.experts.policy import BandwidthEstimate

    b = OffloadBackend(pool, slots, device, estimate=BandwidthEstimate(frozen=True), stream_prefill=False,
                       grouped=True, slot_policy="lfu")
    b.runner.run_grouped = lambda *args: None
    routes = _routes(shape, device, steps)
    x = torch.randn(1, shape.hidden, device=device).to(shape.torch_dtype)
    w = torch.full((1, shape.top_k), 1.0 / shape.top_k, device=device, dtype=shape.torch_dtype)
    try:
        for i, ids in enumerate(routes[:40]):  # warm: the table full, the estimate's first samples in
            b.forward(pool.layers[i % len(pool.layers)], x, ids, w)
        t0 = time.perf_counter()
        for i, ids in enumerate(routes):
            b.forward(pool.layers[i % len(pool.layers)], x, ids, w)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e6
    finally:
        b.close()
