"""Routing realism: Zipf-skewed synthetic routers (engine/experts/zipf.py, engine.synth router_zipf) and the
hit-rate simulation of the LRU slot cache against llama.cpp's static placement (engine/experts/placement.py)."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.bench import routing
from engine.experts import placement, zipf
from engine.experts.host_pool import pool_from_source
from engine.experts.offload import OffloadBackend
from engine.experts.source import ExpertWeights
from engine.models import load_model
from engine.synth import synth_checkpoint


def tensors_of(model_dir) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("E,K,a", [(8, 2, 1.0), (16, 4, 0.7), (256, 8, 1.0)])
def test_popularity_law_is_capped_and_sums_to_k(E, K, a):
    p = zipf.zipf_popularity(E, K, a)
    assert p.sum() == pytest.approx(K) and p.max() <= zipf.CAP + 1e-12
    assert (np.diff(p) <= 1e-12).all()  # most popular first
    free = p < zipf.CAP
    ratios = p[free][1:] / p[free][:-1]  # past the cap: exactly r^-a
    r = np.arange(1, E + 1)[free]
    np.testing.assert_allclose(ratios, (r[1:] / r[:-1]) ** -a)
    with pytest.raises(ValueError, match="half"):
        zipf.zipf_popularity(8, 5, 1.0)


@pytest.mark.parametrize("E,K,a", [(16, 4, 1.0), (64, 4, 0.6)])
def test_scales_make_iid_normal_logits_follow_the_law(E, K, a):
    s = np.asarray(zipf.router_scales(E, K, a))
    assert zipf.router_scales(E, K, a) == tuple(s)  # deterministic
    g = np.random.default_rng(123).standard_normal((100_000, E))  # a fresh sample, not the calibration's
    top = np.argpartition(-(g * s), K - 1, axis=1)[:, :K]
    have = np.bincount(top.ravel(), minlength=E) / g.shape[0]
    np.testing.assert_allclose(have, zipf.zipf_popularity(E, K, a), rtol=0.08)


def test_layer_ranks_are_seeded_permutations():
    a, b = zipf.layer_ranks(16, 0, 0), zipf.layer_ranks(16, 0, 1)
    assert sorted(a.tolist()) == list(range(16)) and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, zipf.layer_ranks(16, 0, 0))
    assert not np.array_equal(a, zipf.layer_ranks(16, 1, 0))


def test_zipf_off_is_byte_identical_and_on_scales_only_router_rows(tmp_path, checkpoints):
    base = checkpoints["qwen3_5_moe", "fused"]
    for a in (None, 0, 0.0):
        out = synth_checkpoint(tmp_path / f"off{a}", arch="qwen3_5_moe", layout="fused", seed=0, router_zipf=a)
        for f in base.glob("*"):
            assert (out / f.name).read_bytes() == f.read_bytes(), (a, f.name)
    skewed = tensors_of(synth_checkpoint(tmp_path / "z1", seed=0, router_zipf=1.0))
    plain = tensors_of(base)
    routers = {k for k in plain if k.endswith("mlp.gate.weight")}
    assert routers and skewed.keys() == plain.keys()
    for k in plain:
        if k not in routers:
            assert torch.equal(skewed[k], plain[k]), k
    layer = 2
    name = f"model.language_model.layers.{layer}.mlp.gate.weight"
    scales = torch.as_tensor(zipf.layer_row_scales(8, 2, 1.0, 0, layer), dtype=torch.float32)
    assert torch.equal(skewed[name], (plain[name].float() * scales[:, None]).to(torch.bfloat16))
    with pytest.raises(ValueError, match="at most half"):
        synth_checkpoint(tmp_path / "bad", seed=0, router_zipf=-1.0)


@pytest.fixture(scope="module")
def demo_traces(tmp_path_factory):
    """Routing of 768 random tokens through the demo-size checkpoint written with a = 0 and a = 1."""
    out = {}
    for a in (0.0, 1.0):
        ckpt = synth_checkpoint(tmp_path_factory.mktemp(f"zipf{a}"), size="demo", seed=3, router_zipf=a)
        out[a] = routing.record(load_model(ckpt, device="cpu", dtype=torch.float32), 768, seed=5)
    return out


def test_skewed_checkpoint_routes_by_the_law(demo_traces):
    E, K = 16, 4
    on = routing.skew_summary(demo_traces[1.0], E, K, 1.0, seed=3)
    assert on["fit_a"] == pytest.approx(1.0, abs=0.25)  # measured in the model, not in the router model
    assert on["rel_err"] < 0.3 and on["top1_share"] > 0.4
    off = routing.skew_summary(demo_traces[0.0], E, K, 0.0, seed=3)
    assert off["rel_err"] < 0.3 and off["top1_share"] < on["top1_share"]


def test_static_placement_ignores_skew_and_the_slot_cache_gains_from_it(demo_traces):
    rows = {a: routing.rates(tr, 16, [0.25], warmup=128)[0] for a, tr in demo_traces.items()}
    for row in rows.values():
        assert row["n_cpu_moe"] == 6 and row["slots"] == 2 * 16 and row["static"] == pytest.approx(0.25)
    assert rows[1.0]["lru"] > rows[0.0]["lru"] + 0.03
    assert rows[1.0]["top"] > rows[0.0]["top"]
    # lfu keeps the popular experts: past llama.cpp and LRU once routing is skewed, near the oracle
    assert rows[1.0]["lfu"] > max(rows[1.0]["lru"], rows[1.0]["static"]) + 0.05
    assert rows[1.0]["lfu"] > 0.85 * rows[1.0]["top"]
    # the mapped decode keeps the popular experts too, and under skew moves fewer bytes than it routes
    assert rows[1.0]["mapped"] > rows[1.0]["static"] + 0.05 and rows[1.0]["mapped"] > 0.85 * rows[1.0]["top"]
    assert rows[1.0]["mapped_pcie"] < 1 - rows[1.0]["static"]


def test_iid_routes_follow_the_law_the_router_is_calibrated_to():
    """bench routing --iid: K distinct experts a token, each layer's popular experts its seeded ones, the
    popularity by rank the Zipf law's (the real shape's statistics without running the model)."""
    E, K, L, T = 64, 4, 2, 3000
    trace = routing.iid_trace(E, K, L, T, 1.0, seed=7)
    assert trace.shape == (T, L, K) and all(len(set(r)) == K for r in trace.reshape(-1, K).tolist())
    on = routing.skew_summary(trace, E, K, 1.0, seed=7)
    assert on["fit_a"] == pytest.approx(1.0, abs=0.1) and on["rel_err"] < 0.15
    assert routing.skew_summary(routing.iid_trace(E, K, L, T, 0.0, seed=7), E, K, 0.0, seed=7)["rel_err"] < 0.15


def test_equal_memory_matches_llama_cpp_layer_counts():
    assert placement.equal_memory(8, 0.37) == 5  # the peer comparison's -ncmoe 5 of 8
    assert placement.equal_memory(40, 0.0) == 40 and placement.equal_memory(40, 1.0) == 0
    with pytest.raises(ValueError):
        placement.equal_memory(8, 1.5)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_slot_simulation_counts_what_the_offload_backend_counts(policy):
    """The simulation drives lru.SlotTable as OffloadBackend does: same hits on the same trace."""
    L, E, H, I, K, T = 3, 12, 8, 4, 3, 40
    g = torch.Generator().manual_seed(0)
    src = ExpertWeights({l: torch.randn(E, 2 * I, H, generator=g) for l in range(L)},
                        {l: torch.randn(E, H, I, generator=g) for l in range(L)})
    p = torch.tensor(1.0 / np.arange(1, E + 1))
    trace = np.stack([[torch.multinomial(p, K, generator=g).numpy() for _ in range(L)] for _ in range(T)])
    for slots in (K, 7, 20):
        b = OffloadBackend(pool_from_source(src), slots, "cpu", stream_prefill=False, slot_policy=policy)
        for t in range(T):
            for layer in range(L):
                b.forward(layer, torch.randn(1, H), torch.as_tensor(trace[t, layer])[None], torch.ones(1, K) / K)
        hits, routed = placement.slot_hits(trace, E, slots, policy=policy)
        assert (hits, routed) == (b.stats()["total"]["hits"], b.stats()["total"]["hits"] + b.stats()["total"]["misses"])
    assert placement.static_hits(trace, 1) == (2 * T * K, L * T * K)
    top, routed = placement.top_experts_hits(trace, E, 5)
    counts = np.bincount((np.arange(L)[None, :, None] * E + trace).ravel())
    assert routed == L * T * K and top == np.sort(counts)[-5:].sum()


def test_mapped_simulation_counts_what_the_mapped_decode_counts():
    """placement.mapped_hits keeps the table by admission.py as MappedExperts does: the same hits, misses and
    fills on the same trace (a one-token step a time, its routes taken in at the next step's end; on a CPU
    device an admitted expert is readable at the step after that, on CUDA one step later, while its copy
    runs)."""
    from engine.experts.mapped import MappedExperts

    L, E, H, I, K, T = 3, 12, 8, 4, 3, 60
    g = torch.Generator().manual_seed(1)
    src = ExpertWeights({l: torch.randn(E, 2 * I, H, generator=g) for l in range(L)},
                        {l: torch.randn(E, H, I, generator=g) for l in range(L)})
    p = torch.tensor(1.0 / np.arange(1, E + 1) ** 1.2)
    trace = np.stack([[torch.multinomial(p, K, generator=g).numpy() for _ in range(L)] for _ in range(T)])
    for slots in (4, 9, 20):
        b = OffloadBackend(pool_from_source(src), slots, "cpu", stream_prefill=False, slot_policy="lfu")
        m = MappedExperts(b)
        for t in range(T):
            m.begin()
            m.end(torch.as_tensor(trace[t])[:, None, :].int(), 1)
        m.observe_last()
        hits, routed, fills = placement.mapped_hits(trace, E, slots, in_flight=False)
        total = b.stats()["total"]
        assert (hits, routed, fills) == (total["hits"], total["hits"] + total["misses"], total["fills"])
        assert fills > 0 and hits > 0


def test_a_mapped_admission_is_read_from_its_slot_once_its_copy_landed():
    """One expert used every step, a free slot: admitted from step 0's routes, which are taken in while step 1
    runs; read from the slot at step 2 when the copy is in line (CPU), at step 3 when it runs beside step 2
    (CUDA); one fill either way. Taken in before the next step (lag 0) it would serve a step earlier."""
    trace = np.full((5, 1, 1), 5)
    assert placement.mapped_hits(trace, 8, 2, in_flight=False) == (3, 5, 1)
    assert placement.mapped_hits(trace, 8, 2) == (2, 5, 1)
    assert placement.mapped_hits(trace, 8, 2, lag=0, in_flight=False) == (4, 5, 1)
    assert placement.mapped_hits(trace, 8, 2, lag=0) == (3, 5, 1)
