"""The fast path on CUDA: graph replay equals direct launch bit for bit, bf16 stays close to the eager path,
fla's chunked rule equals the torch reference, and the serving loop gives the same greedy tokens with
graphs as without."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.api import GenerateRequest
from engine.models import load_model
from engine.synth import synth_checkpoint
from tests.gpu.core_util import run_through_core

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("fast") / "demo", arch="qwen3_5_moe", size="demo", seed=3)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def greedy_through_core(model, reqs: list[list[int]], new: int) -> list[list[int]]:
    return run_through_core(model, [GenerateRequest(p, new) for p in reqs], "bfloat16")


def test_graph_replay_equals_direct_launch(demo_ckpt):
    graphed = load_model(demo_ckpt, device="cuda", dtype="bfloat16")
    graphed.enable_fast(slots=4, capacity=256, graphs=True)
    direct = load_model(demo_ckpt, device="cuda", dtype="bfloat16")
    direct.enable_fast(slots=4, capacity=256, graphs=False)
    reqs = prompts(3, 20, graphed.config.vocab_size, seed=1)  # 3 sequences: the 4-bucket with one padding row
    sa = [graphed.new_state() for _ in range(3)]
    sb = [direct.new_state() for _ in range(3)]
    graphed.forward([(torch.tensor(p), s) for p, s in zip(reqs, sa)])
    direct.forward([(torch.tensor(p), s) for p, s in zip(reqs, sb)])
    for step in range(3):
        toks = [torch.tensor([7 + step + i]) for i in range(3)]
        la = torch.cat(graphed.forward(list(zip(toks, sa))))
        lb = torch.cat(direct.forward(list(zip(toks, sb))))
        assert torch.equal(la, lb), (step, rel(la, lb))
    for s in sa + sb:
        s.release()
    a = greedy_through_core(graphed, reqs, 24)
    b = greedy_through_core(direct, reqs, 24)
    assert a == b
    assert graphed.decode_steps.replays > 0 and direct.decode_steps.replays == 0


def test_mixer_graphs_give_the_layers_as_they_come_bit_for_bit(demo_ckpt):
    """One sequence's prompt and extends (each run one bucket's DeltaNet layers, token_graphs.BucketedMixer):
    replayed graphs, the same launches direct, and the layers as they come (no bucketed mixer) give the same
    logits and slot states, bit for bit."""
    pytest.importorskip("fla")
    models = []
    for graphs, mixer in ((True, True), (False, True), (True, False)):
        model = load_model(demo_ckpt, device="cuda", dtype="bfloat16")
        model.enable_fast(slots=2, capacity=512, graphs=graphs)
        if not mixer:
            model.fast.prompt_mixer = None
        models.append(model)
    states = [m.new_state() for m in models]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    for n in (20, 7, 256, 100, 2):
        toks = torch.randint(0, models[0].config.vocab_size, (n,), generator=g)
        out = [m.forward([(toks, s)], logits="all")[0] for m, s in zip(models, states)]
        assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2]), n
    for layers in zip(*(m.fast.pool.layers for m in models)):
        assert all(torch.equal(a[0], layers[0][0]) and torch.equal(a[1], layers[0][1]) for a in layers)
    assert models[0].fast.bucket_modes()["mixer"] == {64: "graph", 128: "graph", 256: "graph"}
    assert models[1].fast.bucket_modes()["mixer"] == {64: "direct", 128: "direct", 256: "direct"}


def test_seam_topk_equals_the_routing_launch(demo_ckpt, monkeypatch):
    """Decode steps of 2-16 tokens routed in the add+norm+router launch (fast.SEAM_TOPK: its programs hand a
    row's logits to the one that finishes it) give what route_topk's own launch gives, bit for bit, graphed."""
    out = {}
    for seam in (False, True):
        monkeypatch.setattr("engine.models.fast.SEAM_TOPK", seam)
        model = load_model(demo_ckpt, device="cuda", dtype="bfloat16")
        model.enable_fast(slots=8, capacity=256, graphs=True)
        reqs = prompts(5, 20, model.config.vocab_size, seed=3)
        states = [model.new_state() for _ in reqs]
        model.forward([(torch.tensor(p), s) for p, s in zip(reqs, states)])
        logits = [torch.cat(model.forward([(torch.tensor([11 + step + i]), s) for i, s in enumerate(states)]))
                  for step in range(3)]
        for s in states:
            s.release()
        out[seam] = logits, greedy_through_core(model, reqs, 24)
    assert all(torch.equal(a, b) for a, b in zip(out[False][0], out[True][0]))
    assert out[False][1] == out[True][1]


def test_bf16_fast_no_less_accurate_than_eager(demo_ckpt):
    """Against fp32, the bf16 fast path (fp32 sums and norms inside its kernels) errs no more than bf16 eager."""
    ids = prompts(1, 300, 8192, seed=2)[0]
    ref = Engine.from_pretrained(demo_ckpt, device="cuda", dtype="float32", fast=False).score(ids)
    eager = Engine.from_pretrained(demo_ckpt, device="cuda", dtype="bfloat16", fast=False).score(ids)
    fast = Engine.from_pretrained(demo_ckpt, device="cuda", dtype="bfloat16", fast=True).score(ids)
    e_eager, e_fast = rel(eager, ref), rel(fast, ref)
    assert e_fast < 1.5 * e_eager + 1e-3, (e_fast, e_eager)


def test_fp32_fast_matches_eager_on_cuda(demo_ckpt):
    eager = Engine.from_pretrained(demo_ckpt, device="cuda", dtype="float32", fast=False)
    fast = Engine.from_pretrained(demo_ckpt, device="cuda", dtype="float32", fast=True)
    ids = prompts(1, 200, eager.config.vocab_size, seed=4)[0]
    assert rel(fast.score(ids), eager.score(ids)) < 1e-4
    assert fast.generate(ids[:50], 16) == eager.generate(ids[:50], 16)


def rule_inputs(T: int, g: torch.Generator, Hk: int = 4, Hv: int = 8, dk: int = 128, dv: int = 128):
    """Random q, k, v (bf16), log decay g, beta and a state for the chunked rule on CUDA."""
    q = torch.randn(T, Hk, dk, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(T, Hk, dk, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(T, Hv, dv, device="cuda", generator=g, dtype=torch.bfloat16)
    gl = -torch.rand(T, Hv, device="cuda", generator=g) * 0.5
    beta = torch.rand(T, Hv, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, gl, beta, torch.randn(Hv, dk, dv, device="cuda", generator=g) * 0.1


def test_fla_chunked_rule_matches_reference():
    pytest.importorskip("fla")
    from engine.kernels.delta_rule_fla import chunked_gated_delta_rule_fla
    from engine.layers.delta_rule import chunked_gated_delta_rule

    q, k, v, gl, beta, s0 = rule_inputs(333, torch.Generator(device="cuda").manual_seed(5))
    o_ref, s_ref = chunked_gated_delta_rule(q.float(), k.float(), v.float(), gl, beta.float(), s0)
    o, s = chunked_gated_delta_rule_fla(q, k, v, gl, beta, s0)
    assert rel(o, o_ref) < 2e-2 and rel(s, s_ref) < 2e-2


def test_rule_graphs_equal_the_padded_rule_launched_directly():
    """The chunked rule over runs padded to token buckets: replayed graphs equal the same shapes launched
    directly bit for bit, across buckets, repeated buckets (a shorter run after a longer one in the same bucket)
    and runs past the last bucket; and stay close to fla over the run as it comes."""
    pytest.importorskip("fla")
    from engine.kernels.delta_rule_fla import chunked_gated_delta_rule_fla as fla
    from engine.models.token_graphs import BucketedRule

    graphed, direct = BucketedRule(fla, capture=True), BucketedRule(fla, capture=False)
    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator(device="cuda").manual_seed(seed)
    for T in (256, 200, 256, 1, 64, 100, 700, 1500):
        q, k, v, gl, beta, s0 = rule_inputs(T, g)
        o1, s1 = graphed(q, k, v, gl, beta, s0)
        o2, s2 = direct(q, k, v, gl, beta, s0)
        o3, s3 = fla(q, k, v, gl, beta, s0)
        assert torch.equal(o1, o2) and torch.equal(s1, s2), (T, seed)
        assert rel(o1, o3) < 1e-2 and rel(s1, s3) < 1e-2, (T, seed)  # (fla may tune other tiles for T)
    assert graphed.modes() == {64: "graph", 128: "graph", 256: "graph", 1024: "graph"}


def test_route_graphs_equal_the_padded_routing_launched_directly():
    """An expert-cache layer's routing of a prompt's rows (router, top-k, shared expert): replayed graphs equal
    the same bucket shapes launched directly bit for bit, layer by layer, and route the real rows as route_cached
    does alone."""
    from engine.models.fast import route_cached
    from engine.models.fused import CachedMoE
    from engine.models.token_graphs import BucketedRoute

    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, E, Is = 2048, 256, 512
    layers = [CachedMoE(torch.randn(E + 1, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02, 8, True,
                        None, i, torch.randn(2 * Is, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
                        torch.randn(H, Is, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
              for i in range(2)]
    graphed, direct = BucketedRoute(route_cached, capture=True), BucketedRoute(route_cached, capture=False)
    for T in (256, 200, 256, 64, 1500):
        h = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
        for mlp in layers:
            a, b, alone = graphed(mlp, h), direct(mlp, h), route_cached(mlp, h, None)
            assert torch.equal(a.ids, b.ids) and torch.equal(a.w, b.w) and torch.equal(a.shared, b.shared), (T, seed)
            assert (a.ids == alone.ids).float().mean() > 0.99 and rel(a.shared, alone.shared) < 1e-2, (T, seed)
    assert graphed.modes() == {64: "graph", 256: "graph"}


def test_last_rows_of_several_sequences_queue_without_a_host_sync():
    """Several sequences' last rows through an index copied from page-locked memory: the same rows, and no
    synchronizing call (CUDA's sync debug mode raises on one)."""
    from engine.models.pieces import last_rows

    h = torch.randn(10, 4, device="cuda")
    torch.cuda._sleep(10_000_000)  # queued work the index must not wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = last_rows(h, [0, 3, 4], [3, 1, 6])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(rows, h[[2, 3, 9]])
