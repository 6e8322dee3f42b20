"""Slot backends on CUDA: pinned pool, copy-stream fills, CPU runs concurrent with the device; greedy output
equals the CUDA fused reference for every backend and slot count."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import Engine
from engine.experts.offload import OffloadBackend
from engine.experts.policy import BandwidthEstimate
from engine.experts.registry import experts_factory
from engine.synth import synth_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = [(7 * i + 3) % 250 for i in range(40)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("gpu-experts") / "tiny", arch="qwen3_5_moe", seed=0)


@pytest.mark.parametrize("backend", ["offload", "cpu", "hybrid"])
def test_cuda_backends_match_fused(ckpt, backend):
    ref = Engine.from_pretrained(ckpt, device="cuda").generate(PROMPT, 10)
    for slots in (1, 7, 16, 32):
        est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
        eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                     experts=experts_factory(backend, device="cuda", slots=slots, estimate=est))
        assert eng.generate(PROMPT, 10) == ref, f"{backend} with {slots} slots"
        b = eng.model.experts
        assert b.pool.pinned, "the host pool should be pinned after filling on a CUDA machine"
        assert b.cache.buf.is_cuda and b.cache.copy_stream is not None
        b.close()


def test_running_estimate_moves_without_freeze(ckpt):
    est = BandwidthEstimate(bp=1e9, bh=2e9, min_bytes=0)  # a balanced split: both paths get work
    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                 experts=experts_factory("hybrid", device="cuda", slots=4, estimate=est))
    eng.generate(PROMPT, 10)
    assert est.bp != 1e9 and est.bh != 2e9
    eng.model.experts.close()


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_cuda_layer_major_prompt_matches_fused(ckpt, backend):
    """A prompt of several pieces in one layer-major forward: the pool streams once, the output is the
    fused reference's."""
    prompt = [(13 * i + 1) % 250 for i in range(1100)]
    ref = Engine.from_pretrained(ckpt, device="cuda").generate(prompt, 6)
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                 experts=experts_factory(backend, device="cuda", slots=16, estimate=est))
    assert eng.model.piece_tokens is not None
    b = eng.model.experts
    assert eng.generate(prompt, 1) == ref[:1]  # the prompt alone (its first token comes from the prefill)
    pool_experts = len(b.pool.layers) * b.pool.num_experts
    assert b.stats()["total"]["fills"] <= pool_experts  # the pool streamed once, not once a piece
    assert eng.generate(prompt, 6) == ref  # decode after the cached prompt
    b.close()


def test_cuda_routing_sent_back_before_the_head_counts_as_read_at_the_end(ckpt, monkeypatch):
    """A layer-major prompt sends its unread layers' routing to the host (page-locked, behind an event) before its
    head is queued: the slot table and stats count what one read-back at the forward's end counts."""
    prompt = [(13 * i + 1) % 250 for i in range(1100)]
    send_back, sent = OffloadBackend.send_back, []

    def counted(self):
        send_back(self)
        sent.append(len(self._sent))

    seen = []
    for early in (True, False):
        monkeypatch.setattr(OffloadBackend, "send_back", counted if early else (lambda self: None))
        est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
        eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                     experts=experts_factory("offload", device="cuda", slots=16, estimate=est))
        eng.generate(prompt, 1)
        b = eng.model.experts
        t = b.cache.table
        seen.append((t.heat.copy(), t.stamp.copy(), b.stats()["layers"]))
        assert not b._sent and not b._unsettled
        b.close()
    assert sent and sent[-1] == 1  # the prompt's unread calls went back in one copy
    (heat, stamp, stats), (heat2, stamp2, stats2) = seen
    assert heat.any() and np.array_equal(heat, heat2) and np.array_equal(stamp, stamp2) and stats == stats2


@pytest.mark.parametrize("stream", ["on", "off"])
def test_cuda_prompts_after_prompts_match_fused(ckpt, stream):
    """Room for three layers' windows: streamed prompts keep the first layer in place for the next one (which
    copies only what decode moved out of its window), routed ones fill into the slots of layers already run;
    every prompt and the decode after it is the fused reference's."""
    first = [(13 * i + 1) % 250 for i in range(1100)]
    second = [(11 * i + 5) % 250 for i in range(1100)]
    extend = first + [(3 * i + 2) % 250 for i in range(40)]
    fused = Engine.from_pretrained(ckpt, device="cuda")
    refs = [fused.generate(p, 6) for p in (first, second, extend)]
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                 experts=experts_factory("offload", device="cuda", slots=24, estimate=est,
                                                         stream_prefill=stream))
    assert eng.model.experts.cache.windows() == 3
    assert [eng.generate(p, 6) for p in (first, second, extend)] == refs
    eng.model.experts.close()


@pytest.mark.parametrize("backend,decode", [("offload", "host"), ("hybrid", "host"), ("offload", "mapped"),
                                            ("hybrid", "mapped")])
def test_graphed_decode_matches_direct_launch(ckpt, backend, decode):
    """With an expert cache a decode step replays one graph (mapped: misses read in place) or one graph per
    stretch between the cache's layers (host): the same logits as the same step launched directly, bit for
    bit where every expert runs on the device (offload; hybrid runs a share of the misses on the CPU, host
    or mapped, and that share follows the cache's state and the step times, which the graphs' warm-up
    steps move), batch 2 then 1."""
    def engine(graphs: bool):
        est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
        eng = Engine.from_pretrained(ckpt, device="cuda", fast=False, expert_device="cpu",
                                     experts=experts_factory(backend, device="cuda", slots=6, estimate=est,
                                                             decode=decode))
        eng.model.enable_fast(slots=3, capacity=128, graphs=graphs)
        return eng

    direct, graphed = engine(False), engine(True)
    assert graphed.model.decode_steps.capture and not direct.model.decode_steps.capture
    states = {e: [e.model.new_state() for _ in range(2)] for e in (direct, graphed)}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (n,), generator=g) for n in (17, 9)]
    for e in (direct, graphed):
        e.model.forward(list(zip(prompts, states[e])))
    for step in range(6):
        n = 2 if step < 4 else 1
        toks = [torch.randint(0, 250, (1,), generator=g) for _ in range(n)]
        a = direct.model.forward(list(zip(toks, states[direct][:n])))
        b = graphed.model.forward(list(zip(toks, states[graphed][:n])))
        for x, y in zip(a, b):
            if backend == "offload":
                assert torch.equal(x, y), f"step {step}"
            else:
                assert x.argmax() == y.argmax() and (x - y).abs().max() <= 2e-2 * x.abs().max(), f"step {step}"
    bucket = graphed.model.decode_steps._buckets[2]
    if decode == "mapped":
        assert bucket.graph is not None and not bucket.segments
        assert graphed.model.experts.stats()["total"]["direct_reads"] > 0
    else:
        assert len(bucket.segments) == len(graphed.model.config.moe_layers) + 1
    for e in (direct, graphed):
        e.model.experts.close()


def test_lookup_table_is_not_overwritten_by_compute_still_queued(ckpt):
    """SlotCache.lookup_table writes a layer's slot table on the copy stream for the compute stream to read:
    its memory must not be a block the compute stream freed while a queued kernel still writes it (the
    allocator hands such a block back to its own stream at once). A freed tensor whose fill waits behind a
    sleep is the bait; the table must read what was written, after the compute stream waits for the copies."""
    import numpy as np

    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                 experts=experts_factory("offload", device="cuda", slots=16,
                                                         estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)))
    cache = eng.model.experts.cache
    E = eng.model.experts.pool.num_experts
    for i in range(8):
        slots = np.roll(np.arange(E, dtype=np.int64)[::-1], i)  # a new table each time (the same one is kept)
        bait = torch.empty(E + 1, dtype=torch.int32, device="cuda")
        torch.cuda._sleep(20_000_000)  # ~10 ms of the compute stream before the bait's fill runs
        bait.fill_(-7)
        del bait  # freed while its fill is queued: the compute stream may reuse the block at once
        table = cache.lookup_table(slots)
        cache.ready()
        assert table.tolist() == slots.tolist() + [-1]
    eng.model.experts.close()


def test_lookup_tables_are_kept_by_content(ckpt):
    """The same slots give the same device table back (no upload), other slots another; LOOKUPS_KEPT tables are
    kept, the least recently handed out goes first; every table reads what it was made from."""
    import numpy as np

    from engine.experts.slot_cache import LOOKUPS_KEPT

    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                 experts=experts_factory("offload", device="cuda", slots=16,
                                                         estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)))
    cache = eng.model.experts.cache
    E = eng.model.experts.pool.num_experts
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    tables = [rng.integers(-1, 16, E) for _ in range(LOOKUPS_KEPT + 1)]
    first = cache.lookup_table(tables[0])
    assert cache.lookup_table(tables[0].copy()) is first
    made = [cache.lookup_table(t) for t in tables[1:]]  # the first is pushed out by the last
    cache.ready()
    assert len({id(t) for t in made}) == LOOKUPS_KEPT and all(t is not first for t in made)
    for t, want in zip([first] + made, tables):
        assert t.tolist() == want.tolist() + [-1]
    assert cache.lookup_table(tables[1]) is made[0]
    again = cache.lookup_table(tables[0])
    cache.ready()
    assert again is not first and again.tolist() == tables[0].tolist() + [-1]
    eng.model.experts.close()


def test_every_copy_batch_is_timed_and_counted_as_backlog_until_done(ckpt):
    """Each copy batch on the copy stream is timed (take_fill_timings reads every finished one, in order, not
    only the last) and counts in copy_backlog while in flight: a batch queued behind a ~10 ms sleep of the copy
    stream is backlog, and none is once the stream has drained."""
    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                 experts=experts_factory("offload", device="cuda", slots=16,
                                                         estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)))
    cache = eng.model.experts.cache
    layer = eng.model.experts.pool.layers[0]
    torch.cuda.synchronize()
    cache.take_fill_timings()
    with torch.cuda.stream(cache.copy_stream):
        torch.cuda._sleep(20_000_000)
    missing = [int(e) for e in (cache.table.resident[cache.pool.row[layer]] < 0).nonzero()[0][:3]]
    assert cache.admit(layer, missing[:2]) and cache.admit(layer, missing[2:])
    nbytes = cache.pool.expert_bytes
    assert cache.copy_backlog(1e3) == pytest.approx(3 * nbytes, rel=1e-3)  # at 1 KB/s nearly all still to move
    torch.cuda.synchronize()
    assert cache.copy_backlog(1e3) == 0
    timings = cache.take_fill_timings()
    assert [t.nbytes for t in timings] == [2 * nbytes, nbytes] and all(t.seconds > 0 for t in timings)
    eng.model.experts.close()


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_cuda_idle_refresh_keeps_greedy_output(ckpt, backend):
    """The idle refresh on CUDA (copies on the copy stream, waited for): the next request, graphed decode
    included, reads the moved experts from their new slots and its greedy tokens equal the fused reference's."""
    ref = Engine.from_pretrained(ckpt, device="cuda").generate(PROMPT, 10)
    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu", experts=experts_factory(
        backend, device="cuda", slots=16, estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True),
        slot_policy="lru", refresh="on"))
    assert eng.generate(PROMPT, 10) == ref
    b, moved = eng.model.experts, 0
    for _ in range(100):
        n = b.refresh()
        moved += n
        if n == 0:
            break
    assert moved > 0
    assert eng.generate(PROMPT, 10) == ref
    b.close()


def test_read_beside_copy_measures_both_rates(ckpt):
    """bench model's extend floor: the cores' read rate while copies to the device run, and the copies' rate."""
    from engine.bench.traffic import host_read_rate, read_beside_copy

    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                 experts=experts_factory("offload", device="cuda", slots=8))
    pool = eng.model.experts.pool
    both = read_beside_copy(pool, chunk_mib=64, chunks=8)
    assert both is not None and both.read > 1e9 and both.copy > 1e9
    assert both.read < 2 * host_read_rate(pool)
    eng.model.experts.close()


@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize("backend", ["cpu", "hybrid"])
def test_cuda_prompts_with_cpu_jobs_joined_on_the_device_or_host_match_fused(ckpt, backend, join, monkeypatch):
    """cpu_jobs.JOIN_ON_DEVICE (the default): routed prompts (streaming off) whose CPU jobs the device waits for
    (wait_flag) while the host queues the layers after, and (--cpu-join host) whose jobs the host waits for:
    greedy output equals the fused reference's, the prompts' calls are logged `joined` or `routed`, and no wait
    was given up. Their rows' copies for the jobs were queued before the routing's read-back (CpuJobs.stage)."""
    from engine.experts import cpu_jobs

    monkeypatch.setattr(cpu_jobs, "JOIN_ON_DEVICE", join)
    staged, stage = [], cpu_jobs.CpuJobs.stage
    monkeypatch.setattr(cpu_jobs.CpuJobs, "stage", lambda self, x: staged.append(x.shape[0]) or stage(self, x))
    prompts = [[(13 * i + 1) % 250 for i in range(300)], [(11 * i + 5) % 250 for i in range(300)]]
    fused = Engine.from_pretrained(ckpt, device="cuda")
    refs = [fused.generate(p, 6) for p in prompts]
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    eng = Engine.from_pretrained(ckpt, device="cuda", expert_device="cpu",
                                 experts=experts_factory(backend, device="cuda", slots=8, estimate=est,
                                                         stream_prefill="off"))
    b = eng.model.experts
    b.call_log = []
    assert [eng.generate(p, 6) for p in prompts] == refs
    with_cpu = [c for c in b.call_log if c.cpu]  # (a decode step's calls are `routed` either way)
    assert with_cpu and all(c.cpu_ms > 0 for c in with_cpu)
    assert any(c.kind == "joined" for c in with_cpu) == join
    assert staged and min(staged) >= cpu_jobs.PROMPT_TOKENS  # the prompts' rows copied before their routing
    assert b.cpu_jobs._err is None or int(b.cpu_jobs._err[0]) == 0
    b.close()


def test_unread_buckets_replay_what_the_runs_as_they_come_give():
    """A wholly resident layer's experts over prompt runs padded to token buckets (SlotRunner.unread with
    prompt_graphs): replayed graphs, the same launches direct and the runs as they come give the same rows, bit for
    bit, across buckets and a shorter run after a longer one."""
    from engine.experts.host_pool import pool_from_source
    from engine.experts.source import ExpertWeights

    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    E, H, I, K = 16, 256, 128, 8
    src = ExpertWeights({0: (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()},
                        {0: (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()})
    backends = []
    for capture in (True, False, None):
        b = OffloadBackend(pool_from_source(src), E, "cuda", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True),
                           stream_prefill="off")
        b.cache.admit(0, list(range(E)))
        if capture is not None:
            b.prompt_graphs(capture)
        backends.append(b)
    tables = [b.cache.lookup_table(b.cache.table.resident[0]) for b in backends]
    for b in backends:
        b.cache.ready()  # the slots' copies and the table's upload, before the compute stream reads them
    for T in (200, 40, 256, 100, 37):
        x = torch.randn(T, H, generator=g).bfloat16().cuda()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
        w = torch.softmax(torch.randn(T, K, generator=g), -1).bfloat16().cuda()
        rows = [b.runner.unread(x, ids, w, t) for b, t in zip(backends, tables)]
        assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2]), (T, seed)
    assert backends[0].runner.unread_modes() == {64: "graph", 128: "graph", 256: "graph"}
    assert backends[1].runner.unread_modes() == {64: "direct", 128: "direct", 256: "direct"}
    for b in backends:
        b.close()
