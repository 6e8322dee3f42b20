"""compute.Routing.of (numpy grouping) against a plain per-expert reference, on fresh random routing."""
import random

import numpy as np
import torch

from engine.experts.compute import Routing


def reference(ids: torch.Tensor):
    flat = ids.reshape(-1).tolist()
    experts = sorted({e for e in flat if e >= 0})
    return experts, [[p for p, e in enumerate(flat) if e == x] for x in experts], sum(e < 0 for e in flat)


def test_routing_groups_pairs_by_expert_in_position_order():
    rng = random.Random()
    for _ in range(300):
        T, E = rng.randint(1, 40), rng.choice([4, 16, 256])
        K = rng.randint(1, min(8, E))
        ids = torch.stack([torch.tensor(rng.sample(range(E), K)) for _ in range(T)])
        if rng.random() < 0.5:  # padding rows and lone pairs routed nowhere
            ids[torch.rand(T, K) < 0.2] = -1
        r = Routing.of(ids)
        experts, positions, unrouted = reference(ids)
        assert r.experts.tolist() == experts and r.unrouted == unrouted and r.top_k == K
        assert r.counts.tolist() == [len(p) for p in positions]
        assert r.experts.dtype == r.counts.dtype == np.int64
        for i, want in enumerate(positions):
            assert r.position(i).tolist() == want and r.position(i).dtype == torch.long
            assert r.rows(i).tolist() == [p // K for p in want]
        # a CPU job's pairs: any subset of the experts, in the order asked for
        pick = rng.sample(range(len(experts)), rng.randint(0, len(experts)))
        pos, ids_of = r.pairs(pick)
        assert pos.tolist() == [p for i in pick for p in positions[i]]
        assert ids_of.tolist() == [experts[i] for i in pick for _ in positions[i]]
        assert pos.dtype == ids_of.dtype == np.int64


def test_routing_of_nothing_routed():
    r = Routing.of(torch.full((3, 2), -1))
    assert r.experts.tolist() == [] and r.counts.tolist() == [] and r.unrouted == 6
    pos, ids_of = r.pairs([])
    assert len(pos) == len(ids_of) == 0 and pos.dtype == ids_of.dtype == np.int64
