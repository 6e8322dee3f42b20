"""A prompt's experts in the slots: whole layers streamed double-buffered, the windows the first layers keep for
the next prompt, a routed prompt's fills into the slots of the layers it has run."""
import numpy as np
import pytest
import torch

from engine.experts.compute import expert_mlp
from engine.experts.cpu import CpuBackend
from engine.experts.hybrid import HybridBackend
from engine.experts.lru import prompt_use_weights
from engine.experts.offload import OffloadBackend
from engine.experts.policy import BandwidthEstimate
from engine.experts.prefill_stream import LIKELY_READ, routed_fills

from tests.engine.backends_util import (E, K, L_IDS, check_table, deep_pool, reference, routing,
                                       run_prompt)
from tests.engine.backends_util import pool, src  # noqa: F401 (pytest fixtures)


@pytest.mark.parametrize("slots,resident", [(2 * E, [0, E, E]), (3 * E, [E, E, E])])
def test_long_prefill_double_buffers_whole_layers(pool, slots, resident):
    """Layer l+1 streams into the LRU slots while l runs: with 2E slots two buffers alternate, with room
    to spare the streamed layers stay resident for the decode that follows."""
    b = OffloadBackend(pool, slots, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True))
    x, ids, w = routing(40, seed=1)
    for layer in L_IDS:
        b.forward(layer, x, ids, w)
    assert b.streamer.active
    assert [b.cache.resident_count(layer) for layer in L_IDS] == resident
    st = b.stats()
    assert all(st["layers"][layer]["fills"] == E and st["layers"][layer]["misses"] == 0 for layer in L_IDS)
    b.close()


def test_the_next_layer_streams_from_the_first_piece_of_this_one(pool):
    """A layer-major prompt runs each layer in pieces: the first layer's copy is issued when the forward begins,
    the next layer's when this layer starts
    (behind this layer's own copy; issued after its last piece it waited for the pieces' host round trips,
    and copies and compute added up), into a window this layer does not use, and every piece's output is as
    if it ran alone. Grouped (the CUDA path, here under Triton's interpreter): a streamed layer's pieces look
    their slots up on the device, so nothing but the streamer waits for copies."""
    pytest.importorskip("triton")
    b = OffloadBackend(pool, 2 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True), grouped=True)
    events, prefetch = [], b.streamer._prefetch

    def traced(layer, after=None):
        events.append(("copy", layer))
        slots = prefetch(layer, after)
        events.append(("window", sorted(slots) == list(range(min(slots), min(slots) + E))))
        return slots

    b.streamer._prefetch = traced
    ready = b.cache.ready
    b.cache.ready = lambda: events.append(("ready",)) or ready()
    x, ids, w = routing(40, seed=2)
    b.begin_forward(40, K, hold=True)
    for layer in L_IDS:
        for a, z in ((0, 24), (24, 40)):
            events.append(("piece", layer))
            y = b.forward(layer, x[a:z], ids[a:z], w[a:z])
            src = b.pool
            ref = torch.zeros_like(y)
            for t in range(z - a):
                for k in range(K):
                    e = int(ids[a + t, k])
                    ref[t] += w[a + t, k] * expert_mlp(x[a + t], *src.weights(layer, e))
            assert torch.allclose(y, ref, atol=1e-5)
    b.end_forward()
    assert b.streamer.streamed_forwards == 1
    ok, ready = ("window", True), ("ready",)
    # the compute waits for a layer's copy once, before the next layer's is issued: a later piece waiting
    # again would wait for the next layer's copy too (the compute stream waits for the whole copy stream)
    # the first layer's copy goes at begin_forward, before its first piece's mixer
    assert events == [("copy", 0), ok, ("piece", 0), ready, ("copy", 2), ok, ("piece", 0), ("piece", 2), ready,
                      ("copy", 3), ok, ("piece", 2), ("piece", 3), ready, ("piece", 3)]
    b.close()


@pytest.mark.parametrize("stream", ["on", "off"])
def test_a_prompt_leaves_its_popular_experts_the_hottest(pool, stream):
    """A prompt's layer call weighs each expert by the tokens routed to it (streamed or not): after a skewed
    prompt the experts it used most are the hottest, and the decode history before it has faded by its length.
    Counted one use per distinct expert, a long prompt left every expert it touched equally hot."""
    b = OffloadBackend(pool, 2 * E, "cpu", stream_prefill=stream, slot_policy="lfu")
    t = b.cache.table
    b.begin_forward(1, K)  # a decode token routed to experts 5, 6, 7
    for layer in L_IDS:
        x, _, w = routing(1, seed=layer)
        b.forward(layer, x, torch.tensor([[5, 6, 7]]), w)
    b.end_forward()
    T = 200
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.tensor([0, 1, 2]) if i % 4 else torch.randperm(E, generator=g)[:K] for i in range(T)])
    x, _, w = routing(T, seed=9)
    b.begin_forward(T, K, hold=True, span=T)
    for layer in L_IDS:
        b.forward(layer, x, ids, w)
    b.end_forward()
    assert b.streamer is None or b.streamer.streamed_forwards == (stream == "on")
    for layer in L_IDS:
        heat = t.heat[pool.row[layer]] / t._inc
        counts = np.bincount(ids.reshape(-1).numpy(), minlength=E)
        assert set(np.argsort(-heat)[:3]) == {0, 1, 2}
        want = prompt_use_weights(counts, T, half_life=t.half_life)
        # (up to the layer ticks after the call's own; 5-7 also carry the faded decode use)
        np.testing.assert_allclose(heat[:5], want[:5], rtol=5e-3)
        assert heat[5] - want[5] < 2.0 ** (-(T - 1) / t.half_life) * 1.01


def test_streaming_on_streams_prompts_not_a_batched_decode_step(pool):
    """--prefill-stream on: every forward a prompt is in streams whole layers; a decode step of several
    sequences (span 1: a token each) routes its experts as any decode step does."""
    b = OffloadBackend(pool, 2 * E, "cpu", stream_prefill="on", slot_policy="lfu")
    x, ids, w = routing(4, seed=5)
    for span, streams in ((1, False), (4, True), (None, True)):  # None: the caller does not say (as a prompt)
        b.begin_forward(4, K, hold=True, span=span)
        assert b.streamer.active == streams, span
        for layer in L_IDS:
            b.forward(layer, x, ids, w)
        b.end_forward()
    assert b.streamer.streamed_forwards == 2
    b.close()


def test_bad_streaming_and_prefetch_options_name_the_fix(pool):
    with pytest.raises(ValueError, match="--prefill-stream must be one of auto, on, off"):
        OffloadBackend(pool, 2 * E, "cpu", stream_prefill="always")
    for cls, decode in ((OffloadBackend, "host"), (CpuBackend, "auto")):
        with pytest.raises(ValueError, match="--moe-prefetch on works inside the mapped decode"):
            cls(pool, 2 * E, "cpu", decode=decode, prefetch=True)
    b = HybridBackend(pool, 2 * E, "cpu", decode="auto", prefetch=True)  # mapped by default: accepted
    assert b.prefetch and b.streamer.mode == "auto"
    b.close()
    with pytest.raises(ValueError, match="--moe-prefetch must be one of auto, on, off"):
        OffloadBackend(pool, 2 * E, "cpu", prefetch="always")
    with pytest.raises(ValueError, match="--moe-lookahead must be one of auto, on, off, got 'ahead'"):
        OffloadBackend(pool, 2 * E, "cpu", lookahead="ahead")
    with pytest.raises(ValueError, match="--moe-decode must be one of auto, mapped, host, got True"):
        OffloadBackend(pool, 2 * E, "cpu", decode=True)
    b = OffloadBackend(pool, 2 * E, "cpu", stream_prefill=False, lookahead=True, refresh=False)
    assert b.streamer is None and b.lookahead and not b.refresh_idle
    b.close()
    # auto (the default): on where a mapped decode overlaps PCIe (CUDA), never with a host decode, off on a CPU
    for cls, decode, device in ((OffloadBackend, "auto", "cpu"), (OffloadBackend, "host", "cuda"),
                                (CpuBackend, "auto", "cuda"), (HybridBackend, "mapped", "cuda")):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        b = cls(pool, 2 * E, device, decode=decode, prefetch="auto")
        assert b.prefetch == (device == "cuda" and decode != "host" and cls is not CpuBackend)
        b.close()


def test_a_streamed_prompt_keeps_its_first_layers_in_place_for_the_next():
    """With room for W >= 3 layers, the first W - 2 layers of a streamed prompt keep their windows: the next
    streamed prompt copies every layer but those, and its output is the reference's."""
    src, deep = deep_pool()
    layers = list(range(6))
    b = OffloadBackend(deep, 3 * E, "cpu", stream_prefill="on", slot_policy="lfu")
    run_prompt(b, layers, 40, seed=1)
    assert b.cache.lookup(0, range(E)).tolist() == list(range(2 * E, 3 * E))  # layer 0 in window 2
    # the stream's price counts what it will copy: nothing of layer 0, a few experts once some left its window
    assert b.cache.stream_copies(0, 2) == 0 and b.cache.stream_copies(1, 0) == E
    b.cache.table.release([2 * E + 3, 2 * E + 4])
    assert b.cache.stream_copies(0, 2) == 2
    before = b.stats()["total"]["bytes_moved"]
    x, ids, w = routing(40, seed=2)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in layers:
        y = b.forward(layer, x, ids, w)
        torch.testing.assert_close(y, reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5)
    b.end_forward()
    assert b.stats()["total"]["bytes_moved"] - before == (5 * E + 2) * deep.expert_bytes
    check_table(b)
    b.close()


@pytest.mark.parametrize("layout", ["first and last two", "last three"])
@pytest.mark.parametrize("keep", [True, False])
def test_a_routed_prompt_fills_into_the_slots_of_layers_it_has_run(layout, keep, monkeypatch):
    """A routed prompt's fills leave the residents of layers still to run alone while slots no hotter remain
    (OffloadBackend.keep_bonus): with the first layer and the last two resident, a prompt touching every
    expert fills only the three layers between; with the last three resident, the first layer's fills must
    take a later layer's residents. routed_fills predicts both; without the bonus the first layer's fills took
    residents either way. Outputs equal the reference's."""
    if not keep:
        monkeypatch.setattr(OffloadBackend, "keep_bonus", lambda self, layer: None)
    src, deep = deep_pool()
    layers = list(range(6))
    b = OffloadBackend(deep, 3 * E, "cpu", stream_prefill="off", slot_policy="lfu")
    kept = [0, 4, 5] if layout == "first and last two" else [3, 4, 5]
    for layer in kept:
        b.cache.admit(layer, list(range(E)))
        b.cache.table.unlock_all()
    before = b.stats()["total"]
    x, ids, w = routing(40, seed=3)
    assert len(set(ids.reshape(-1).tolist())) == E  # every expert touched (the same routing in every layer)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in layers:
        torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                   rtol=1e-5, atol=1e-5)
    b.end_forward()
    fills = b.stats()["total"]["fills"] - before["fills"]
    missing = [0 if layer in kept else E for layer in layers]
    model = routed_fills(missing, [E - m for m in missing], 3 * E)
    if keep:
        assert fills == model == (3 * E if layout == "first and last two" else 4 * E)
    else:
        assert fills > model
    check_table(b)
    b.close()


@pytest.mark.parametrize("done_heat,taken", [(1.0, 0), (1000.0, 2)])
def test_a_later_layers_resident_goes_first_only_against_a_far_hotter_slot(done_heat, taken):
    """keep_bonus: while layer 1 of a routed prompt fills, a resident of layer 2 (still to run, all but one of its
    experts in slots) counts KEEP_RATIO x its heat at the forward's end; layer 0's slots (already run) count their
    heat. As hot as layer 2's, layer 0's slots go first; a thousand times hotter (a decode's popular experts),
    layer 2's go first."""
    src, deep = deep_pool(layers=3)
    b = OffloadBackend(deep, 2 * E - 1, "cpu", stream_prefill="off", slot_policy="lfu")
    t = b.cache.table
    for layer, heat, held in ((0, done_heat, E), (2, 1.0, E - 1)):
        b.cache.admit(layer, list(range(held)))
        t.unlock_all()
        t.note_use(layer, np.arange(E), weights=np.full(E, heat))
    b.begin_forward(40, K, hold=True, span=40)
    victims = t.victims(E - 1, bonus=b.keep_bonus(1))
    assert set((t.owner[victims] // E).tolist()) == {taken}
    b.end_forward()
    b.close()


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_the_slots_of_a_later_layer_holding_all_its_experts_go_last(policy):
    """keep_bonus: layers 2 and 3 (still to run) hold every one of their experts, so each runs without reading its
    routing back; a fill of layer 1 takes layer 0's slots first however much hotter they are (a thousand times
    here) and though half of layer 2's experts are cold (the prompt will likely not read them), then the farthest
    whole layer's (3), the next layer's last. Copies ahead (_kept) never take them, the cold ones included."""
    src, deep = deep_pool(layers=4)
    b = OffloadBackend(deep, 3 * E, "cpu", stream_prefill="off", slot_policy=policy, lookahead="on")
    t = b.cache.table
    for layer, heat, used in ((0, 1000.0, E), (2, 1000.0, E // 2), (3, 1.0, E)):
        b.cache.admit(layer, list(range(E)))
        t.unlock_all()
        t.note_use(layer, np.arange(used), weights=np.full(used, heat))
    b.begin_forward(40, K, hold=True, span=40)
    assert (b._touch[2, E // 2:] < LIKELY_READ).all()
    victims = t.victims(E + 3, bonus=b.keep_bonus(1))
    assert (t.owner[victims[:E]] // E == 0).all()
    if policy == "lfu":  # (lru takes the slots with a bonus last, in its own order)
        assert (t.owner[victims[E:]] // E == 3).all()
    kept = b._kept(1)
    assert kept[t.resident[2]].all() and kept[t.resident[3]].all() and not kept[t.resident[0]].any()
    b.end_forward()
    b.close()


def test_routing_sent_back_before_the_end_counts_as_read_at_the_end(pool):
    """send_back() after some of a streamed forward's layers (a prompt calls it after its last, before its head)
    counts the same as settle() reading every call back at the forward's end: heat, recency and stats equal, and
    nothing left to count after end_forward."""
    pytest.importorskip("triton")
    x, ids, w = routing(40, seed=3)
    seen = []
    for sent_after in ((), (L_IDS[0], L_IDS[-1])):
        b = OffloadBackend(pool, 2 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True), grouped=True)
        b.begin_forward(40, K, hold=True, span=40)
        for layer in L_IDS:
            for a, z in ((0, 24), (24, 40)):
                b.forward(layer, x[a:z], ids[a:z], w[a:z])
            if layer in sent_after:
                b.send_back()
                assert not b._unsettled and b._sent
        assert b._unsettled or b._sent
        b.end_forward()
        assert not b._unsettled and not b._sent
        t = b.cache.table
        seen.append((t.heat.copy(), t.stamp.copy(), b.stats()["layers"]))
        check_table(b)
        b.close()
    (heat, stamp, stats), (heat2, stamp2, stats2) = seen
    assert heat.any() and np.array_equal(heat, heat2) and np.array_equal(stamp, stamp2) and stats == stats2


@pytest.mark.parametrize("cls,kw", [(OffloadBackend, dict(stream_prefill="on")),
                                    (HybridBackend, dict(stream_prefill="off", lookahead="on"))])
def test_a_deferred_begin_plans_at_the_first_layer_call_as_one_made_upfront(cls, kw):
    """begin_forward(defer=True) (a prompt's one_expert_pass: the device runs the embedding and the first
    mixer while the host plans) leaves the cache as it is until the forward's first layer call, then decides as
    a begin made before the layers would have: a streamed prompt and a routed hybrid one with copies ahead give
    the same outputs, layer calls, stats and slot table either way. A deferred forward that ran no layer call
    ends with nothing of it left for the next; defer without hold is refused."""
    src, deep = deep_pool()
    x, ids, w = routing(40, seed=7)
    seen = []
    for defer in (False, True):
        b = cls(deep, 3 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True), slot_policy="lfu", **kw)
        run_prompt(b, range(6), 40, seed=1)  # heat and residents for the forward under test to plan by
        b.begin_forward(40, K, hold=True, span=40, defer=True)
        b.end_forward()  # a forward that failed before its first layer call: nothing of it stays
        t = b.cache.table
        before = (t.clock, t.heat.copy(), t.owner.copy())
        b.call_log = []
        b.begin_forward(40, K, hold=True, span=40, defer=defer)
        if defer:  # the slot table as it was: its clock not advanced by the prompt's tokens, no copy issued
            assert t.clock == before[0] and np.array_equal(t.heat, before[1]) and np.array_equal(t.owner, before[2])
        else:
            assert t.clock > before[0]
        outs = []
        for layer in range(6):
            for a, z in ((0, 24), (24, 40)):
                outs.append(b.forward(layer, x[a:z], ids[a:z], w[a:z]))
            torch.testing.assert_close(torch.cat(outs[-2:]), reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5)
        b.end_forward()
        calls = [(c.layer, c.kind, c.misses, c.fills, c.cpu, c.ahead) for c in b.call_log]
        stats = {layer: {k: v for k, v in st.items() if k != "cpu_seconds"}  # (a time)
                 for layer, st in b.stats()["layers"].items()}
        seen.append((torch.cat(outs), calls, stats, t.heat.copy(), t.owner.copy(), t.clock))
        check_table(b)
        b.close()
    (y0, calls0, stats0, heat0, owner0, clock0), (y1, calls1, stats1, heat1, owner1, clock1) = seen
    assert torch.equal(y0, y1) and calls0 == calls1 and stats0 == stats1 and clock0 == clock1
    assert np.array_equal(heat0, heat1) and np.array_equal(owner0, owner1)
    assert stats0[0]["fills"] > 0 or any(c[4] for c in calls0)
    with pytest.raises(ValueError, match="hold=True"):
        b.begin_forward(40, K, defer=True)
