"""The fast path (fused weights, Triton kernels, slot states) against the eager reference on fresh random
prompts: logits, checkpoints inside a chunk, restore, greedy output, pool exhaustion, the serving loop.

Runs on CUDA, and on the CPU under Triton's interpreter (slow: prompts stay short). fp32 throughout, so
the two paths agree to rounding.
"""
from __future__ import annotations

import os

import pytest
import torch

from engine import Engine
from engine.kernels.deltanet_triton import TAIL_TOKENS, rule_tail

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_moe"])
def pair(request, checkpoints):
    ckpt = checkpoints[request.param, "fused"]
    eager = Engine.from_pretrained(ckpt, device=DEV, fast=False)
    fast = Engine.from_pretrained(ckpt, device=DEV, fast=False)
    fast.model.enable_fast(slots=3, capacity=64, graphs=False)
    return eager.model, fast.model


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seam", [False, True])
def test_batched_prefill_then_decode_matches_eager(pair, seam, monkeypatch):
    """seam: a decode step of 2 tokens routes each row in the add+norm+router launch (fast.SEAM_TOPK)."""
    monkeypatch.setattr("engine.models.fast.SEAM_TOPK", seam)
    eager, fast = pair
    a, b = prompt(13, 1), prompt(7, 2)
    se = [eager.new_state(), eager.new_state()]
    sf = [fast.new_state(), fast.new_state()]
    assert all(s.slot is not None for s in sf)
    ref = eager.forward([(a, se[0]), (b, se[1])], logits="all")
    got = fast.forward([(a, sf[0]), (b, sf[1])], logits="all")
    for r, g in zip(ref, got):
        assert g.shape == r.shape and rel(g, r) < TOL
    for step in range(2):  # one token each: the decode kernels
        toks = [prompt(1, 10 + step), prompt(1, 20 + step)]
        ref = eager.forward([(toks[0], se[0]), (toks[1], se[1])])
        got = fast.forward([(toks[0], sf[0]), (toks[1], sf[1])])
        assert all(rel(g, r) < TOL for g, r in zip(got, ref)), step
    mixed_ref = eager.forward([(prompt(1, 30), se[0]), (prompt(5, 31), se[1])])  # a decode and a chunk
    mixed = fast.forward([(prompt(1, 30), sf[0]), (prompt(5, 31), sf[1])])
    assert all(rel(g, r) < TOL for g, r in zip(mixed, mixed_ref))
    assert [s.length for s in sf] == [s.length for s in se] == [16, 14]


@pytest.mark.parametrize("tail", [0, TAIL_TOKENS, 7])
def test_checkpoints_inside_a_chunk_and_restore(pair, tail):
    """tail: the last `tail` tokens from the first checkpoint among them through the one-launch tail rule
    (CUDA's default; on the CPU only in this test). 64: from 6 on, the state at 11 kept by it; 7: 0-6 and
    6-11 piecewise, 11-16 by it."""
    eager, fast = pair
    nets = [layer.mixer for layer in fast.layers if not layer.is_attention]
    if tail and not nets:
        pytest.skip("no DeltaNet layer")
    kept = [(net.tail_rule, net.tail_tokens) for net in nets]
    runs = []

    def counted(*args):
        runs.append(args[-1])  # its marks
        return rule_tail(*args)

    for net in nets:
        net.tail_rule, net.tail_tokens = (counted, tail) if tail else (None, 0)
    try:
        _checkpoints_inside_a_chunk_and_restore(eager, fast)
        assert runs == {0: [], TAIL_TOKENS: [[5]] * len(nets), 7: [[]] * len(nets)}[tail]
    finally:
        for net, (rule, tokens) in zip(nets, kept):
            net.tail_rule, net.tail_tokens = rule, tokens


def _checkpoints_inside_a_chunk_and_restore(eager, fast):
    ids = prompt(20, 3)
    state = fast.new_state()
    state.checkpoint_positions = (6, 11)
    fast.forward([(ids[:16], state)])
    for p in state.checkpoint_positions:
        ck = state.at(p).checkpoint()
        slow = eager.new_state()
        eager.forward([(ids[:p], slow)])
        for x, y in zip(ck.layers, slow.checkpoint().layers):
            for u, v in zip(x, y):
                assert u.shape == v.shape and rel(u, v) < TOL
        restored = fast.restore(ck)
        assert restored.slot is not None and restored.length == p
        tail = ids[p : p + 4]
        assert rel(fast.forward([(tail, restored)], logits="all")[0],
                   eager.forward([(tail, slow)], logits="all")[0]) < TOL
        restored.release()
    state.release()


def test_pool_exhaustion_falls_back_to_eager_states(pair):
    eager, fast = pair
    held = [fast.new_state() for _ in range(fast.fast.pool.free)]
    extra = fast.new_state()
    assert not hasattr(extra, "slot")  # no slot left: an ordinary state, the eager path
    ids = prompt(9, 4)
    assert rel(fast.forward([(ids, extra)])[0], eager.forward([(ids, eager.new_state())])[0]) < TOL
    for s in held:
        s.release()
    assert fast.fast.pool.free == fast.fast.pool.slots
    del extra
    too_long = fast.new_state(tokens=65)
    assert not hasattr(too_long, "slot")  # longer than a slot holds


def test_greedy_generation_is_identical(checkpoints):
    ckpt = checkpoints["qwen3_5_moe", "fused"]
    ids = prompt(10, 5)
    ref = Engine.from_pretrained(ckpt, device=DEV, fast=False).generate(ids, max_new_tokens=6)
    assert Engine.from_pretrained(ckpt, device=DEV, fast=True).generate(ids, max_new_tokens=6) == ref


def test_slot_goes_back_when_the_state_is_dropped(pair):
    _, fast = pair
    free = fast.fast.pool.free
    state = fast.new_state()
    assert fast.fast.pool.free == free - 1
    del state
    assert fast.fast.pool.free == free


def test_warm_up_leaves_the_pool_as_it_found_it(pair):
    eager, fast = pair
    if fast.config.arch != "qwen3_5_moe":
        pytest.skip("one architecture is enough (slow under the interpreter)")
    free = fast.fast.pool.free
    fast.warm_up(chunk=8)
    assert fast.fast.pool.free == free
    ids = prompt(9, 6)  # and the slots it used serve fresh sequences exactly
    assert rel(fast.forward([(ids, fast.new_state())])[0], eager.forward([(ids, eager.new_state())])[0]) < TOL


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_fast_path_with_an_expert_cache_matches_eager(checkpoints, backend):
    """Routed experts in an expert cache (a quarter of them on the device) run by the host (--moe-decode
    host): the fast kernels around it, decode launched directly (no padding rows reach the cache), prefill
    layer-major in pieces with a checkpoint on a piece boundary; logits as the eager path's, greedy tokens
    the same."""
    from engine.experts.policy import BandwidthEstimate
    from engine.experts.registry import experts_factory

    ckpt = checkpoints["qwen3_5_moe", "fused"]

    def engine(fast: bool):
        est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
        eng = Engine.from_pretrained(ckpt, device=DEV, fast=False, expert_device="cpu",
                                     experts=experts_factory(backend, device=DEV, slots=8, estimate=est,
                                                             decode="host"))
        if fast:
            eng.model.enable_fast(slots=3, capacity=64)
        eng.model.piece_tokens = 8
        return eng

    eager, fast = engine(False), engine(True)
    assert fast.model.fast.cached_experts and fast.model.decode_steps.capture == (DEV == "cuda")
    a, b = prompt(21, 11), prompt(5, 12)
    se, sf = [eager.model.new_state() for _ in range(2)], [fast.model.new_state() for _ in range(2)]
    for s in (*se, *sf):
        s.checkpoint_positions = (8, 13)
    ref = eager.model.forward([(a, se[0]), (b, se[1])], logits="all")
    got = fast.model.forward([(a, sf[0]), (b, sf[1])], logits="all")
    assert all(rel(g, r) < TOL for g, r in zip(got, ref))
    for pos in (8, 13):
        for le, lf in zip(se[0].at(pos).layers, sf[0].at(pos).layers):
            assert all(rel(x, y) < TOL for x, y in zip(lf.snapshot(), le.snapshot()) if y.norm() > 0)
    for step in range(3):  # batch 2, then 1: buckets without padding
        items = [(prompt(1, 40 + step), s) for s in (sf if step < 2 else sf[:1])]
        ref_items = [(t, s) for (t, _), s in zip(items, se)]
        assert all(rel(g, r) < TOL for g, r in zip(fast.model.forward(items), eager.model.forward(ref_items)))
    # on CUDA each bucket replays graphs between the cache's layers; a capture that failed would say "direct"
    assert fast.model.decode_steps.modes() == {n: "segments" if DEV == "cuda" else "direct" for n in (1, 2)}
    ids = prompt(12, 7)
    assert fast.generate(ids, max_new_tokens=5) == eager.generate(ids, max_new_tokens=5)
    for eng in (eager, fast):
        eng.model.experts.close()


def _fast_engine(ckpt, decode: str | None = None, prefetch: bool = False):
    """The fast path on the checkpoint: every expert resident (decode None), or through a 5-slot offload
    cache decoding `decode` (mapped | host), with or without --moe-prefetch."""
    from engine.experts.policy import BandwidthEstimate
    from engine.experts.registry import experts_factory

    kw = {}
    if decode is not None:
        est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
        kw = dict(expert_device="cpu", experts=experts_factory("offload", device=DEV, slots=5, estimate=est,
                                                               decode=decode, prefetch=prefetch))
    eng = Engine.from_pretrained(ckpt, device=DEV, fast=False, **kw)
    eng.model.enable_fast(slots=3, capacity=64)
    return eng


def test_mapped_decode_reads_misses_in_place_and_keeps_greedy_output(checkpoints):
    """--moe-decode mapped: the decode kernels read each missing expert in place from the host pool and the
    step is one graph (on CUDA); greedy tokens equal the host-run cache's and the fused engine's, misses
    are counted as in-place reads, free slots are filled between steps."""
    ckpt = checkpoints["qwen3_5_moe", "fused"]
    fused, mapped, host = _fast_engine(ckpt), _fast_engine(ckpt, "mapped"), _fast_engine(ckpt, "host")
    assert mapped.model.fast.mapped is not None and host.model.fast.mapped is None
    ids = prompt(12, 9)
    want = fused.generate(ids, max_new_tokens=6)
    assert mapped.generate(ids, max_new_tokens=6) == want == host.generate(ids, max_new_tokens=6)
    st = mapped.model.experts.stats()["total"]
    assert st["direct_reads"] > 0 and st["bytes_read"] == st["direct_reads"] * mapped.model.experts.pool.expert_bytes
    assert st["hits"] + st["misses"] > 0
    if DEV == "cuda":
        assert set(mapped.model.decode_steps.modes().values()) == {"graph"}
    for eng in (mapped, host):
        eng.model.experts.close()


def test_mapped_decode_prefetch_keeps_greedy_output_and_counts_its_guesses(checkpoints):
    """--moe-prefetch on: every cache layer but the first has its likely expert's gate/up copied in before its
    routing is known, on a side stream on CUDA (the step still one graph); greedy tokens equal the fused
    engine's and the mapped decode's without prefetch, each guess and its bytes are counted, and the
    misses' in-place traffic is the same as without prefetch."""
    ckpt = checkpoints["qwen3_5_moe", "fused"]
    fused, plain = _fast_engine(ckpt), _fast_engine(ckpt, "mapped")
    pre = _fast_engine(ckpt, "mapped", prefetch=True)
    ids = prompt(12, 9)
    want = fused.generate(ids, max_new_tokens=8)
    assert plain.generate(ids, max_new_tokens=8) == want
    assert pre.generate(ids, max_new_tokens=8) == want
    experts = pre.model.experts
    stats = experts.stats()
    first, *rest = experts.pool.layers
    st, lay = stats["total"], experts.pool.layout
    assert stats["layers"][first]["guesses"] == 0 and all(stats["layers"][x]["guesses"] > 0 for x in rest)
    assert 0 < st["guesses_right"] <= st["guesses"]  # the staged weights were read, and gave the same tokens
    assert st["bytes_guessed"] == st["guesses"] * lay.gate_up_numel * experts.pool.dtype.itemsize
    plain_st = plain.model.experts.stats()["total"]
    assert plain_st["guesses"] == 0 and plain_st["direct_reads"] == st["direct_reads"]
    if DEV == "cuda":
        assert set(pre.model.decode_steps.modes().values()) == {"graph"}
    for eng in (plain, pre):
        eng.model.experts.close()


def test_warm_up_fits_its_prompts_in_a_short_context(checkpoints):
    """Serving with a context shorter than a prefill step: the warm-up's prompts are cut to a slot's tokens
    (they ran past the KV slab: an illegal memory access on the GPU box with a 200-token context)."""
    eng = Engine.from_pretrained(checkpoints["qwen3_5_moe", "fused"], device=DEV, fast=False)
    eng.model.enable_fast(slots=2, capacity=24)
    eng.model.warm_up(2048)
    ids = prompt(8, 5)
    assert eng.generate(ids, max_new_tokens=3) == Engine.from_pretrained(
        checkpoints["qwen3_5_moe", "fused"], device=DEV, fast=False).generate(ids, max_new_tokens=3)


def test_hybrid_mapped_decode_runs_a_cpu_share_inside_the_step(checkpoints):
    """hybrid + mapped decode: a share of the misses is marked LOC_CPU, the expert kernels skip those pairs
    and the native thread runs them from the host pool between the publish and join kernels (the whole step
    still one graph on CUDA); greedy tokens equal the fused engine's and the offload engine's, and the CPU
    pairs are counted as CPU runs, not in-place reads."""
    from engine.experts import cpu_runner
    from engine.experts.policy import BandwidthEstimate
    from engine.experts.registry import experts_factory

    if not cpu_runner.NATIVE:
        pytest.skip("the CPU share runs on the native kernels")
    ckpt = checkpoints["qwen3_5_moe", "fused"]

    def engine(backend: str | None, share=None):
        kw = {}
        if backend is not None:  # B_H tiny: the prompt's misses are all filled, CPU runs come from decode alone
            est = BandwidthEstimate(bp=1e9, bh=1e3, frozen=True)
            kw = dict(expert_device="cpu", experts=experts_factory(backend, device=DEV, slots=5, estimate=est,
                                                                   decode="mapped"))
        eng = Engine.from_pretrained(ckpt, device=DEV, fast=False, **kw)
        eng.model.enable_fast(slots=3, capacity=64)
        if share is not None:
            eng.model.fast.mapped.cpu.share, eng.model.fast.mapped.cpu.adapt = share, False
        return eng

    fused, offload, hybrid = engine(None), engine("offload"), engine("hybrid", share=0.6)
    cpu = hybrid.model.fast.mapped.cpu
    assert cpu is not None and offload.model.fast.mapped.cpu is None
    ids = prompt(12, 9)
    want = fused.generate(ids, max_new_tokens=6)
    assert hybrid.generate(ids, max_new_tokens=6) == want == offload.generate(ids, max_new_tokens=6)
    hybrid.model.fast.mapped.observe_last()  # the last step's routes (a step's end takes in the one before)
    hybrid.model.fast.mapped.begin()  # and its time
    st, box = hybrid.model.experts.stats()["total"], cpu.stats()
    assert st["cpu_runs"] > 0 and st["direct_reads"] > 0  # both paths took misses
    assert box["pairs"] == st["cpu_runs"] and box["publishes"] >= box["layers_run"] > 0
    assert int(cpu.err[0]) == 0
    cpu.adapt, steps = True, cpu.steps  # the share by measured step time, per batch size: greedy unchanged
    assert hybrid.generate(ids, max_new_tokens=6) == want
    hybrid.model.fast.mapped.begin()
    assert list(cpu.searches) == [1] and cpu.steps - steps == 5  # five decode steps of one sequence
    if DEV == "cuda":
        assert set(hybrid.model.decode_steps.modes().values()) == {"graph"}
    for eng in (offload, hybrid):
        eng.model.experts.close()
    assert not cpu.box.running


def test_hybrid_decode_keeps_its_settled_share_for_the_next_start(checkpoints, tmp_path, monkeypatch, caplog):
    """A hybrid mapped decode whose share search settles, or has run KEEP_STEPS steps, writes its best share to the
    profile directory; the next engine on the same machine, model and slots starts its search there (and says
    so), one with other slots does not; the key carries the model's router fingerprint."""
    import logging

    from engine.experts import cpu_runner
    from engine.experts.graph_cpu import KEEP_STEPS
    from engine.experts.policy import BandwidthEstimate
    from engine.experts.registry import experts_factory
    from engine.runner import ModelRunner

    if not cpu_runner.NATIVE:
        pytest.skip("the CPU share runs on the native kernels")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ckpt = checkpoints["qwen3_5_moe", "fused"]

    def engine(slots: int):
        est = BandwidthEstimate(bp=1e9, bh=1e3, frozen=True)
        eng = Engine.from_pretrained(ckpt, device=DEV, fast=False, expert_device="cpu",
                                     experts=experts_factory("hybrid", device=DEV, slots=slots, estimate=est,
                                                             decode="mapped"))
        eng.model.enable_fast(slots=3, capacity=64)
        return eng

    first = engine(5)
    cpu = first.model.fast.mapped.cpu
    assert cpu.adapt and cpu.memory.shares == {} and cpu.memory.key["model"].startswith("router ")
    search = cpu._search(1)
    observe, search.observe = search.observe, lambda seconds, rows: search.share  # the search held still
    search.best = 0.58  # climbed there without settling (the box's step noise rarely lets it rest)
    cpu.after_step(1)  # the first step starts the clock
    for _ in range(KEEP_STEPS - 1):
        cpu.after_step(1)
    assert cpu.stats()["settled"] == {}
    cpu.after_step(1)  # KEEP_STEPS steps: its best is kept though it never rested
    assert cpu.stats()["settled"] == {1: 0.58}
    search.observe = observe
    search.best = 0.66  # as if it had climbed on
    while search.rests == 0:  # equal step times: both sides lose down to the smallest step, then it rests
        search.observe(1.0, rows=1)
    cpu.after_step(1)  # the engine's hook sees the settlement and keeps it
    assert cpu.stats()["settled"] == {1: 0.66}
    ModelRunner(first.model).reconfigure(moe_slots=4)  # `ctl cache --moe 4`: later shares kept under 4 slots
    assert first.model.fast.mapped.cpu is cpu
    search.rests += 1
    cpu.after_step(1)
    assert cpu.memory.key["slots"] == 4 and cpu.memory.shares == {1: 0.66}
    first.model.experts.close()
    with caplog.at_level(logging.INFO, logger="killick.experts"):
        second = engine(5)
    assert second.model.fast.mapped.cpu.memory.shares == {1: 0.66}
    assert second.model.fast.mapped.cpu._search(1).best == 0.66
    assert second.model.fast.mapped.cpu.stats()["start"] == {1: 0.66}
    assert "settled before here: b1 0.66" in caplog.text
    ids = prompt(12, 9)
    fused = Engine.from_pretrained(ckpt, device=DEV, fast=False)
    assert second.generate(ids, max_new_tokens=4) == fused.generate(ids, max_new_tokens=4)  # greedy unchanged
    other = engine(6)
    assert other.model.fast.mapped.cpu.memory.shares == {}
    for eng in (second, other):
        eng.model.experts.close()


def test_resizing_the_cache_under_a_mapped_decode(checkpoints):
    """`ctl cache --moe N` between steps: the slots are reallocated, the decode buckets (whose graphs read
    them in place) are dropped and the location table is rebuilt; greedy output stays the fused engine's."""
    from engine.experts.policy import BandwidthEstimate
    from engine.experts.registry import experts_factory
    from engine.runner import ModelRunner

    ckpt = checkpoints["qwen3_5_moe", "fused"]
    fused = Engine.from_pretrained(ckpt, device=DEV, fast=False)
    fused.model.enable_fast(slots=3, capacity=64)
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    eng = Engine.from_pretrained(ckpt, device=DEV, fast=False, expert_device="cpu",
                                 experts=experts_factory("offload", device=DEV, slots=6, estimate=est))
    eng.model.enable_fast(slots=3, capacity=64)
    ids = prompt(10, 3)
    want = fused.generate(ids, max_new_tokens=6)
    assert eng.generate(ids, max_new_tokens=3) == want[:3]
    ModelRunner(eng.model).reconfigure(moe_slots=2)
    assert eng.model.decode_steps._buckets == {} and eng.model.experts.cache.num_slots == 2
    assert eng.generate(ids, max_new_tokens=6) == want
    m = eng.model.fast.mapped
    assert 0 < int((m.loc[:, : m.E] >= 0).sum()) <= 2
    eng.model.experts.close()
