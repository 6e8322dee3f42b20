"""What the expert backend tests share: a small seeded MoE (layers 0, 2, 3 of E experts; layer 1 dense), its
per-token reference, random routing, the slot table's invariants, and deeper pools for a prompt's placement.
The fixtures `src` and `pool` are imported by the modules that use them."""
import numpy as np
import pytest
import torch

from engine.experts.compute import expert_mlp
from engine.experts.host_pool import pool_from_source
from engine.experts.source import ExpertWeights

L_IDS, E, H, I, K = [0, 2, 3], 8, 16, 12, 3  # MoE layers 0, 2, 3 (layer 1 dense)


def make_source(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    gate_up = {l: (torch.randn(E, 2 * I, H, generator=g) * 0.3).to(dtype) for l in L_IDS}  # [E, 2I, H]
    down = {l: (torch.randn(E, H, I, generator=g) * 0.3).to(dtype) for l in L_IDS}  # [E, H, I]
    return ExpertWeights(gate_up, down)


def reference(src, layer, x, ids, w):
    """Every expert on every token, masked by the routing weights."""
    out = torch.zeros_like(x)
    for e in range(E):
        we = (w * (ids == e)).sum(1, keepdim=True)  # [T, 1]
        out += we * expert_mlp(x, src.gate_up(layer, e), src.down(layer, e))
    return out


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return torch.randn(T, H, generator=g), ids, w


@pytest.fixture(scope="module")
def src():
    return make_source()


@pytest.fixture(scope="module")
def pool(src):
    return pool_from_source(src)


def check_table(backend):
    t = backend.cache.table
    for s, o in enumerate(t.owner):
        if o >= 0:
            assert t.resident[o // E, o % E] == s
    assert (np.bincount(t.resident[t.resident >= 0], minlength=t.num_slots) <= 1).all()
    assert not t.locked.any() or backend.streamer.active


def deep_pool(layers=6, seed=5):
    """-> (source, host pool) of `layers` MoE layers 0.. of E experts, every layer routed."""
    g = torch.Generator().manual_seed(seed)
    src = ExpertWeights({l: torch.randn(E, 2 * I, H, generator=g) * 0.3 for l in range(layers)},
                        {l: torch.randn(E, H, I, generator=g) * 0.3 for l in range(layers)})
    return src, pool_from_source(src)


def check_prompt(b, src, layers, x, ids, w, msg=None):
    """One held prompt forward of x's tokens through backend b's `layers`, each layer's output against the
    reference's over the source `src`."""
    b.begin_forward(x.shape[0], K, hold=True, span=x.shape[0])
    for layer in layers:
        torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w), rtol=1e-5,
                                   atol=1e-5, msg=msg)
    b.end_forward()


def run_prompt(b, layers, T, seed):
    """One held prompt forward of T tokens through backend b's `layers`, random routing of `seed`."""
    x, ids, w = routing(T, seed)
    b.begin_forward(T, K, hold=True, span=T)
    for layer in layers:
        b.forward(layer, x, ids, w)
    b.end_forward()
