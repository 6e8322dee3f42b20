"""The GPU routing step's torch reference makes the same decisions as the host bookkeeping the
backends use today (SlotTable + q*), so wiring the Triton kernel in cannot change what is cached."""
import numpy as np
import torch

from engine.experts.lru import SlotTable
from engine.experts.policy import q_star
from engine.kernels.route_ref import route_ref


def host_step(table: SlotTable, layer: int, ids: torch.Tensor, ratio: float):
    """What OffloadBackend.forward decides, written out over the host table."""
    experts, counts = torch.unique(ids, return_counts=True)
    experts, counts = experts.tolist(), counts.tolist()
    table.tick()
    slots = table.lookup(layer, experts)
    hits = [i for i, s in enumerate(slots) if s >= 0]
    misses = sorted((i for i, s in enumerate(slots) if s < 0), key=lambda i: -counts[i])
    table.touch(slots[hits])
    table.lock(slots[hits])
    q = q_star(len(misses), ratio, 1.0)
    victims = table.victims(q).tolist()
    fills = [experts[i] for i in misses[:len(victims)]]
    for e, s in zip(fills, victims):
        table.assign(s, layer, e)
    table.unlock_all()
    return fills, victims


def test_route_ref_equals_host_bookkeeping():
    g = torch.Generator().manual_seed(0)
    num_layers, num_experts, num_slots, top_k = 4, 16, 11, 3
    table = SlotTable(num_layers, num_experts, num_slots)
    resident = torch.full((num_layers, num_experts), -1, dtype=torch.int32)
    owner = torch.full((num_slots,), -1, dtype=torch.int32)
    stamp = torch.full((num_slots,), -1, dtype=torch.int64)
    for step in range(200):
        layer = step % num_layers
        tokens = 1 + step % 3
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
        ratio = [0.0, 0.25, 0.5, 1.0][step % 4]
        fills, victims = host_step(table, layer, ids, ratio)
        _, fill_e, fill_s, cpu_mask, counts = route_ref(ids, resident, owner, stamp, layer, table.clock, ratio)
        q = int(counts[1])
        assert fill_e[:q].tolist() == fills and fill_s[:q].tolist() == victims
        assert np.array_equal(resident.numpy(), table.resident)
        assert np.array_equal(owner.numpy(), table.owner)
        assert np.array_equal(stamp.numpy(), table.stamp)
