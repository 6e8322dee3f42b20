"""Copies ahead (the next layer's likely misses copied while a routed prompt's layer runs), layers that run
without their routing coming back, and the idle refresh of the slots."""
import numpy as np
import pytest
import torch

from engine.experts import lookahead
from engine.experts.compute import expert_mlp
from engine.experts.cpu import CpuBackend
from engine.experts.host_pool import pool_from_source
from engine.experts.hybrid import HybridBackend
from engine.experts.offload import OffloadBackend
from engine.experts.policy import BandwidthEstimate
from engine.experts.source import ExpertWeights

from tests.engine.backends_util import E, H, I, K, L_IDS, check_prompt, check_table, deep_pool, reference, routing
from tests.engine.backends_util import pool, src  # noqa: F401 (pytest fixtures)


@pytest.fixture(autouse=True)
def likely_misses_alone(monkeypatch):
    """These tests' experts are a few KB, copied in microseconds: every layer would be topped up whole (its
    unlikely misses too, lookahead.TOP_UP_S), so the copies of likely misses alone are tested with the top-up
    off, and the top-up by a test that sets its time."""
    monkeypatch.setattr(lookahead, "TOP_UP_S", 0.0)


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_a_routed_prompt_copies_the_next_layers_likely_misses_ahead(cls):
    """--moe-lookahead on: while a layer of a routed prompt runs, the next layer's likely misses are copied
    into slots no layer still to run holds (here the one free layer of slots, then the slots of the layers
    already run), so the layers between the resident first and last two find them in place. Outputs equal the
    reference's with and without it; the residents of the last two layers are never taken; every copy ahead is
    counted as a fill and as `ahead`, the ones the layer then read as `ahead_used`. The call log (profile_decode
    --extend) has each layer call's plan: its misses filled or run on the CPU (none in the wholly resident
    layers), the copies ahead as the stats count them."""
    src, deep = deep_pool()
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    got = {}
    for look in ("off", "on"):
        b = cls(deep, 4 * E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", lookahead=look)
        b.call_log = []
        for layer in (0, 4, 5):
            b.cache.admit(layer, list(range(E)))
            b.cache.table.unlock_all()
        kept = {s: b.cache.table.owner[s] for s in range(4 * E) if b.cache.table.owner[s] // E in (4, 5)}
        x, ids, w = routing(40, seed=3)
        b.begin_forward(40, K, hold=True, span=40)
        for layer in range(6):
            y = b.forward(layer, x, ids, w)
            torch.testing.assert_close(y, reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5)
            assert all(b.cache.table.owner[s] == o for s, o in kept.items())
        b.end_forward()
        got[look] = b.stats()["total"]
        calls = b.call_log
        assert [c.layer for c in calls] == list(range(6))
        routed = [c for c in calls if c.kind == "routed"]  # all (the unread path is the grouped kernels')
        assert len(routed) == 6 and [c.misses for c in calls if c.layer in (0, 4, 5)] == [0, 0, 0]
        assert all(c.fills + c.cpu == c.misses and 0 <= c.routed_ms <= c.end_ms for c in routed)
        assert sum(c.misses for c in routed) == got[look]["misses"]
        assert sum(c.cpu for c in routed) == got[look]["cpu_runs"]
        assert all((c.cpu_start_ms >= c.routed_ms) == (c.cpu > 0) for c in routed)
        for c in routed:  # the split, then the job, then its result on the engine thread
            assert c.routed_ms <= c.planned_ms <= c.end_ms
            if c.cpu:
                assert c.planned_ms <= c.cpu_start_ms and c.cpu_start_ms + c.cpu_ms <= c.woke_ms <= c.end_ms
            else:
                assert c.woke_ms == -1.0
        assert sum(c.ahead for c in calls) == got[look]["ahead"]
        assert all(c.behind == 0 for c in calls)  # a CPU device copies in line: nothing is ever in flight
        check_table(b)
        b.close()
    off, on = got["off"], got["on"]
    assert off["ahead"] == 0
    assert on["ahead"] > 0 and on["ahead_used"] == on["ahead"]  # every expert is routed to: no wrong copy
    assert on["fills"] >= on["ahead"] and on["hits"] > off["hits"]
    if cls is OffloadBackend:  # every miss is filled either way; ahead of its layer they are hits there
        assert on["ahead"] == 3 * E and on["fills"] == off["fills"] == 3 * E and on["misses"] == 0
    else:  # the copies ahead take the fill share; the CPU runs the rest
        assert on["cpu_runs"] > 0 and on["misses"] + on["ahead"] == off["misses"]


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_a_wholly_resident_layer_runs_without_its_routing_and_the_next_layers_copies_take_its_slots(
        cls, monkeypatch):
    """Grouped (the CUDA path, here under Triton's interpreter): in a routed prompt a layer with every expert in a
    slot (layers 0, 4 and 5, as a streamed prompt leaves them, and any its copies ahead made so) never reads its
    routing back (the host queues the next layer meanwhile; it is counted at settle). Either path: the copies
    ahead of the next layer may take the running layer's slots, queued after its kernels: with every slot full,
    layer 1's likely misses are copied ahead during layer 0, where its locked hits left no room before. Outputs
    equal the reference's and one expert at a time's (the torch path, which reads every layer's routing back);
    hits, misses and ahead_used are counted as before."""
    pytest.importorskip("triton")
    from engine.experts import compute

    src, deep = deep_pool()
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    read_back, of = [], compute.Routing.of
    monkeypatch.setattr(compute.Routing, "of", staticmethod(lambda ids: read_back.append(ids.shape) or of(ids)))
    seed = int(torch.randint(1 << 30, ()))
    got = {}
    for grouped in (True, False):
        b = cls(deep, 3 * E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", lookahead="on",
                grouped=grouped)
        b.call_log = []
        for layer in (0, 4, 5):
            b.cache.admit(layer, list(range(E)))
            b.cache.table.unlock_all()
        kept = {s: b.cache.table.owner[s] for s in range(3 * E) if b.cache.table.owner[s] // E in (4, 5)}
        x, ids, w = routing(40, seed=seed)  # 120 picks of 8 experts: every expert is routed to
        read_back.clear()
        b.begin_forward(40, K, hold=True, span=40)
        outs, resident = [], []
        for layer in range(6):
            resident.append(bool((b.cache.table.resident[layer] >= 0).all()))
            outs.append(b.forward(layer, x, ids, w))
            torch.testing.assert_close(outs[-1], reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5,
                                       msg=f"seed {seed}")
            assert all(b.cache.table.owner[s] == o for s, o in kept.items())  # later layers' residents stay
        b.end_forward()
        got[grouped] = outs
        st = b.stats()["layers"]
        for layer in (0, 4, 5):
            assert st[layer]["hits"] == E and st[layer]["misses"] == 0
        # layer 1's likely misses were copied ahead into layer 0's slots (no other slot was free)
        assert st[1]["ahead"] > 0 and st[1]["ahead_used"] == st[1]["ahead"]
        if grouped:  # (offload copies all of a layer's misses ahead, so every layer finds itself resident)
            assert resident[0] and resident[4] and resident[5]
            assert len(read_back) == resident.count(False)
            assert [c.kind == "unread" for c in b.call_log] == resident  # the call log says which ran unread
            assert b.call_log[0].ahead == st[1]["ahead"] and b.call_log[0].hits == -1
        else:
            assert len(read_back) == 6
        check_table(b)
        b.close()
    for a, z in zip(got[True], got[False]):
        torch.testing.assert_close(a, z, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_no_copies_ahead_are_planned_for_a_wholly_resident_layer(cls, monkeypatch):
    """A layer holding every one of its experts has nothing to copy in: its copies-ahead plan is None and its
    inputs are never made (the layers of a prompt after its last routed one are queued with the device waiting
    for them), while the other layers' plans are made as before; outputs equal the reference's."""
    src, deep = deep_pool()
    made, planned = [], []
    row_inputs, plan_row = lookahead.CopiesAhead._row_inputs, lookahead.CopiesAhead._plan_row
    monkeypatch.setattr(lookahead.CopiesAhead, "_row_inputs", lambda self, i: made.append(i) or row_inputs(self, i))

    def plan(self, i, behind, inputs=None):
        whole = i < len(self.pool.layers) and bool((self.cache.table.resident[i] >= 0).all())
        got = plan_row(self, i, behind, inputs)
        planned.append((i, whole, got))
        return got

    monkeypatch.setattr(lookahead.CopiesAhead, "_plan_row", plan)
    b = cls(deep, 3 * E, "cpu", estimate=BandwidthEstimate(bp=1e9, bh=2e9, frozen=True), stream_prefill="off",
            slot_policy="lfu", lookahead="on")
    for layer in (0, 4, 5):
        b.cache.admit(layer, list(range(E)))
        b.cache.table.unlock_all()
    x, ids, w = routing(40, seed=int(torch.randint(1 << 30, ())))
    b.begin_forward(40, K, hold=True, span=40)
    for layer in range(6):
        torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w), rtol=1e-5,
                                   atol=1e-5)
    b.end_forward()
    b.close()
    whole = {i for i, w_, _ in planned if w_}
    assert {0, 4, 5} <= whole  # the forward's first row at its start, the last two as the rows before them ran
    assert all(got is None for i, w_, got in planned if w_)
    assert not whole & set(made)
    assert any(got is not None for _, w_, got in planned if not w_)  # the others still copy ahead


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend, CpuBackend])
def test_a_nearly_resident_layers_last_misses_are_copied_ahead_when_they_fit_the_top_up_time(cls, monkeypatch):
    """Layer 2 holds 6 of its 8 experts; the heat calls the other two unlikely, and the prompt routes to them.
    When the two copy in within TOP_UP_S at the fill rate they are copied ahead during layer 1 (counted as
    `ahead`, and used), so layer 2 is wholly resident when called and misses nothing; when they take longer,
    only likely misses are copied and layer 2 misses both. The cpu backend never fills. Outputs equal the
    reference's either way."""
    src, deep = deep_pool(layers=3)
    est = BandwidthEstimate(bp=1e9, bh=1e9, frozen=True)
    two = 2 * deep.expert_bytes / est.bp  # seconds to copy both at the fill rate
    seed = int(torch.randint(1 << 30, ()))
    x, ids, w = routing(40, seed=seed)  # 120 picks of 8 experts: every expert is routed to
    for top_up in (1.5 * two, 0.75 * two):
        monkeypatch.setattr(lookahead, "TOP_UP_S", top_up)
        b = cls(deep, 3 * E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", lookahead="on")
        t = b.cache.table
        b.cache.admit(0, list(range(E)))
        b.cache.admit(2, list(range(E - 2)))
        t.unlock_all()
        for row in range(3):
            t.note_use(row, np.arange(E - 2), weights=np.full(E - 2, 1000.0))  # experts 6, 7: no heat
        b.begin_forward(40, K, hold=True, span=40)
        for layer in range(3):
            whole = bool((t.resident[2] >= 0).all())
            torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                       rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
        b.end_forward()
        st = b.stats()["layers"][2]
        topped = top_up > two and cls is not CpuBackend
        assert whole == topped
        assert (st["misses"], st["ahead"], st["ahead_used"]) == ((0, 2, 2) if topped else (2, 0, 0)), seed
        assert st["fills"] + st["cpu_runs"] == 2  # copied ahead, or filled or run on the CPU as layer 2 runs
        if cls is CpuBackend:
            assert st["fills"] == 0
        elif topped or cls is OffloadBackend:  # (hybrid's split shares layer 2's own misses with the CPU)
            assert st["fills"] == 2
        check_table(b)
        b.close()


def test_the_cpus_handoff_moves_hybrids_copies_ahead_and_its_split_to_the_copy_engine(pool):
    """With copies ahead the copy engine works through a layer's handoff while the CPU waits: the longer the
    handoff (measured per routed prompt layer call, medians of recent samples), the more of the next layer's
    misses hybrid copies ahead and the fewer of this layer's it runs on the CPU; a routed prompt with CPU work
    measures it."""
    est = BandwidthEstimate(bp=50e9, bh=50e9, frozen=True)
    b = HybridBackend(pool, 3, "cpu", estimate=est, stream_prefill="off", lookahead="on")
    ahead, fills = [], []
    for h in (0.0, 0.002, 0.004, 0.05):
        b.handoff_clock.seconds = h
        ahead.append(b.ahead_fills(200.0, 1000))
        # a layer whose copies ahead came (200 - ahead[-1] misses left) copying the next one's: all on the CPU
        assert b.split(200 - ahead[-1], busy=ahead[-1]) == 0 or ahead[-1] == 200
        fills.append(b.split(200, busy=50))
    assert ahead[0] == 100 and ahead == sorted(ahead) and ahead[-1] == 200  # half, then more, then all
    assert fills == sorted(fills) and fills[-1] > fills[0]
    b.handoff_clock.seconds = 0.0
    x, ids, w = routing(40, seed=3)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in L_IDS:
        b.forward(layer, x, ids, w)
    b.end_forward()
    assert b.stats()["total"]["cpu_runs"] > 0 and b.handoff > 0
    b.close()


class _SteppedEvents:
    """Timing events each `step` seconds after the last, done at once (a device that has caught up)."""

    def __init__(self, step):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return _Done(self.t)


class _Done:
    def __init__(self, t):
        self.t = t

    def query(self):
        return True

    def elapsed_time(self, later):  # ms, as torch.cuda.Event
        return (later.t - self.t) * 1e3


def test_wholly_resident_layers_time_the_handoff_so_a_long_first_estimate_goes():
    """Grouped (here under Triton's interpreter): once a long handoff estimate has the copy engine take every
    miss ahead, every layer of a routed prompt runs resident and plans no CPU job. Their gaps still reach the
    estimate, so the short ones that follow replace a long first one (a compile between two layers) within two
    forwards, and the split goes back to the CPU."""
    pytest.importorskip("triton")
    from engine.experts.handoff import HandoffClock

    src, deep = deep_pool()
    est = BandwidthEstimate(bp=50e9, bh=50e9, frozen=True)
    b = HybridBackend(deep, 6 * E, "cpu", estimate=est, stream_prefill="off", lookahead="on", grouped=True)
    for layer in range(6):
        b.cache.admit(layer, list(range(E)))
        b.cache.table.unlock_all()
    # the host's clock stands still: under Triton's interpreter it takes past HandoffClock's stall bound between
    # two layers, and the device's gaps here are the stepped events'
    b.handoff_clock = HandoffClock(events := _SteppedEvents(0.325), now=lambda: 0.0)
    x, ids, w = routing(40, seed=int(torch.randint(1 << 30, ())))
    ahead = []  # of 200 expected misses of a next layer, those copied ahead
    for step in (0.325, 1e-7, 1e-7):  # (1e-7 s: 0.1 us, about two of these tiny experts at 50 GB/s)
        events.step = step
        b.call_log = []
        check_prompt(b, src, range(6), x, ids, w)
        assert [c.kind for c in b.call_log] == ["unread"] * 6
        # each logs where its host time went: begun, experts queued, copies ahead queued, returned
        assert all(0 <= c.planned_ms <= c.ran_ms <= c.queued_ms <= c.end_ms for c in b.call_log)
        assert b.handoff == pytest.approx(step)  # (the host's part: no routed call, none)
        ahead.append(b.ahead_fills(200.0, 1000))
    assert ahead[0] == 200 and ahead[-1] < 200  # the CPU takes a share again
    b.close()


def test_a_wrong_copy_ahead_shows_as_ahead_not_used():
    """The heat says layer 1's experts 0-3 are hot; the prompt routes elsewhere: they are copied ahead and
    counted as ahead, not ahead_used, and the outputs still equal the reference's."""
    src, deep = deep_pool(layers=2)
    b = OffloadBackend(deep, 2 * E, "cpu", stream_prefill="off", slot_policy="lfu", lookahead="on")
    b.cache.table.note_use(1, np.arange(4), weights=np.full(4, 1000.0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] + 4 for _ in range(40)])  # experts 4-7 only
    w = torch.softmax(torch.randn(40, K, generator=g), -1)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in range(2):
        torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                   rtol=1e-5, atol=1e-5)
    b.end_forward()
    st = b.stats()["layers"][1]
    assert st["ahead"] == 4 and st["ahead_used"] == 0 and st["fills"] == 8  # 4 wrong copies, then the 4 misses
    check_table(b)
    b.close()


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_the_first_layers_likely_misses_copy_in_at_the_forwards_start(cls):
    """begin_forward of a routed prompt with lookahead copies the first MoE layer's likely misses (its hot
    experts, not resident) before any layer runs: counted as that layer's fills and `ahead`, read as hits
    there (ahead_used, no miss); outputs equal the reference's. Without lookahead nothing moves before."""
    src, deep = deep_pool(layers=2)
    est = BandwidthEstimate(bp=1e9, bh=1e9, frozen=True)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(40)])  # experts 0-3 only
    w = torch.softmax(torch.randn(40, K, generator=g), -1)
    for look in ("off", "on"):
        b = cls(deep, 2 * E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", lookahead=look)
        b.cache.table.note_use(0, np.arange(4), weights=np.full(4, 1000.0))
        b.begin_forward(40, K, hold=True, span=40)
        before = b.stats()["layers"][0]
        for layer in range(2):
            torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                       rtol=1e-5, atol=1e-5)
        b.end_forward()
        st = b.stats()["layers"][0]
        if look == "on":
            assert before["ahead"] == before["fills"] > 0
            assert st["ahead_used"] == st["ahead"] == before["ahead"] and st["hits"] >= st["ahead"]
            if cls is OffloadBackend:
                assert st["ahead"] == 4 and st["misses"] == 0
        else:
            assert before["fills"] == 0 and st["ahead"] == 0 and st["misses"] == 4
        check_table(b)
        b.close()


def test_a_copy_ahead_takes_cold_residents_and_those_of_a_layer_done():
    """All slots full (layers 0 and 2): the copy ahead for layer 1's likely experts 0-3 takes slots whose
    experts the prompt will likely not read, here layer 0's untouched ones once its only piece ran and layer
    2's cold ones, never layer 2's hot ones. Outputs equal the reference's."""
    src, deep = deep_pool(layers=3)
    b = OffloadBackend(deep, 2 * E, "cpu", stream_prefill="off", slot_policy="lfu", lookahead="on")
    t = b.cache.table
    for layer in (0, 2):
        b.cache.admit(layer, list(range(E)))
        t.unlock_all()
    for row in range(3):
        t.note_use(row, np.arange(4), weights=np.full(4, 1000.0))
    hot2 = {int(t.resident[2, e]) for e in range(4)}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(40)])  # experts 0-3 only
    w = torch.softmax(torch.randn(40, K, generator=g), -1)
    b.begin_forward(40, K, hold=True, span=40)
    for layer in range(3):
        torch.testing.assert_close(b.forward(layer, x, ids, w), reference(src, layer, x, ids, w),
                                   rtol=1e-5, atol=1e-5)
        assert all(t.owner[s] // E == 2 for s in hot2)
    b.end_forward()
    st = b.stats()["layers"]
    assert st[1]["ahead"] == st[1]["ahead_used"] == 4 and st[1]["misses"] == 0 and st[2]["misses"] == 0
    check_table(b)
    b.close()


@pytest.mark.parametrize("cls", [OffloadBackend, HybridBackend])
def test_idle_refresh_moves_the_hottest_experts_into_the_coldest_slots(cls):
    """OffloadBackend.refresh (idle time): slots full of layer 0's cold experts, the heat says layer 1's experts
    0-3 are hot: 2 calls of budget 2 move them in (into layer 0's coldest slots), a third finds nothing to move;
    each is counted as a fill and as `refreshed`; the copies hold the pool's weights (a prompt then finds
    them as hits and its output is the reference's). A newcomer only slightly hotter than every resident
    (under REFRESH_RATIO) stays out; with refresh off nothing moves."""
    src, deep = deep_pool(layers=2)
    est = BandwidthEstimate(bp=1e9, bh=1e9, frozen=True)
    b = cls(deep, E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", refresh="on")
    t = b.cache.table
    b.cache.admit(0, list(range(E)))
    t.unlock_all()
    t.note_use(0, np.arange(E), weights=np.arange(1.0, E + 1))  # layer 0's expert e: heat e + 1
    t.note_use(1, np.arange(4), weights=np.full(4, 1000.0))
    assert [b.refresh(2), b.refresh(2), b.refresh(2)] == [2, 2, 0]
    assert (t.resident[1, :4] >= 0).all() and (t.resident[0, :4] < 0).all() and (t.resident[0, 4:] >= 0).all()
    st = b.stats()["layers"][1]
    assert st["refreshed"] == st["fills"] == 4 and b.stats()["layers"][0]["refreshed"] == 0
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(40)])  # experts 0-3 only
    w = torch.softmax(torch.randn(40, K, generator=g), -1)
    b.begin_forward(40, K, hold=True, span=40)
    torch.testing.assert_close(b.forward(1, x, ids, w), reference(src, 1, x, ids, w), rtol=1e-5, atol=1e-5)
    b.end_forward()
    assert b.stats()["layers"][1]["misses"] == 0
    check_table(b)
    b.close()
    for refresh, hot in (("on", 1.2 * E), ("off", 1000.0)):  # 1.2 x the hottest resident's heat: under 1.25
        b = cls(deep, E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", refresh=refresh)
        b.cache.admit(0, list(range(E)))
        b.cache.table.unlock_all()
        b.cache.table.note_use(0, np.arange(E), weights=np.full(E, float(E)))
        b.cache.table.note_use(1, np.arange(4), weights=np.full(4, hot))
        assert b.refresh() == 0 and b.stats()["total"]["refreshed"] == 0 and (b.cache.table.resident[1] < 0).all()
        b.close()


def test_the_refresh_mode_is_checked():
    with pytest.raises(ValueError, match="--moe-refresh must be one of auto, on, off"):
        OffloadBackend(deep_pool(layers=1)[1], E, "cpu", refresh="sometimes")


def test_idle_refresh_leaves_the_windows_a_streamed_prompt_keeps():
    """With 3 windows a streamed prompt keeps window 2 for its first layer (PrefillStreamer.window_for): the
    refresh never takes a slot there, however cold its experts, so the next streamed prompt still finds that
    layer in place; the hot experts go to windows 0 and 1."""
    src, deep = deep_pool(layers=4)
    b = OffloadBackend(deep, 3 * E, "cpu", stream_prefill="auto", slot_policy="lfu", refresh="on")
    t = b.cache.table
    b.cache.place(0, list(range(E)), list(range(2 * E, 3 * E)))  # layer 0 in its kept window, cold
    b.cache.place(1, list(range(E)), list(range(E)))
    b.cache.place(2, list(range(E)), list(range(E, 2 * E)))
    t.note_use(0, np.arange(E), weights=np.full(E, 1.0))
    t.note_use(1, np.arange(E), weights=np.full(E, 5.0))
    t.note_use(2, np.arange(E), weights=np.full(E, 5.0))
    t.note_use(3, np.arange(E), weights=np.full(E, 100.0))
    assert b.refresh(2 * E) == E and (t.resident[3] >= 0).all() and b.refresh() == 0
    assert (t.resident[3] < 2 * E).all() and (t.resident[0] == np.arange(2 * E, 3 * E)).all()
    assert not t.locked.any()
    check_table(b)
    b.close()


def test_idle_refresh_never_waits_for_the_pools_loader():
    """A layer the background loader has not filled yet is left out of the refresh (it would block the engine
    thread, and a request arriving meanwhile, until the load): its experts move once the layer is loaded."""
    import threading

    src, deep = deep_pool(layers=2)
    b = OffloadBackend(deep, E, "cpu", stream_prefill="off", slot_policy="lfu", refresh="on")
    b.cache.table.note_use(1, np.arange(4), weights=np.full(4, 100.0))
    deep._ready[1].clear()  # as while the loader is still on layer 1
    try:
        moved = []
        worker = threading.Thread(target=lambda: moved.append(b.refresh()))
        worker.start()
        worker.join(5)
        assert not worker.is_alive() and moved == [0] and not deep.layer_ready(1)
    finally:
        deep._ready[1].set()
    assert b.refresh() == 4 and (b.cache.table.resident[1, :4] >= 0).all()
    b.close()


def test_an_unread_layer_counts_its_routing_as_it_was_when_called():
    """A wholly resident layer's routing is counted at settle(), after the call: a caller that writes the next
    piece's routing into the same tensor meanwhile (the fast path's bucket graphs do) changes nothing there."""
    pytest.importorskip("triton")
    src, deep = deep_pool(layers=2)
    b = OffloadBackend(deep, 2 * E, "cpu", stream_prefill="off", slot_policy="lfu", lookahead="off", grouped=True)
    b.cache.admit(0, list(range(E)))
    b.cache.table.unlock_all()
    x, ids, w = routing(6, seed=int(torch.randint(1 << 30, ())))
    routed, kept = sorted(set(ids.reshape(-1).tolist())), ids.clone()
    b.begin_forward(6, K, hold=True, span=6)
    out = b.forward(0, x, ids, w)
    ids.fill_(0)  # the caller's buffer, reused before the forward ends
    b.end_forward()
    torch.testing.assert_close(out, reference(src, 0, x, kept, w), rtol=1e-5, atol=1e-5)
    assert b.stats()["layers"][0]["hits"] == len(routed)
    heat = b.cache.table.heat[b.pool.row[0]]
    assert np.flatnonzero(heat).tolist() == routed
    b.close()


@pytest.mark.parametrize("cls", [HybridBackend, CpuBackend])
def test_a_prompts_cpu_job_joined_on_the_device_gives_the_host_joins_outputs(cls, monkeypatch):
    """cpu_jobs.JOIN_ON_DEVICE (grouped kernels, here under Triton's interpreter): a held prompt's routed layer
    call queues the wait for its CPU job's flag and the scatter of its rows, and returns without waiting for the
    job; the job is collected at the next routed call or end_forward. Outputs equal the reference's; the cpu
    backend's counts equal the host join's; the call log marks those calls `joined`, with the job's run filled in
    once collected. A job that fails fails the forward (at its start or its collection), and the next forward
    runs."""
    pytest.importorskip("triton")
    from engine.experts import cpu_jobs, cpu_kernels, cpu_runner

    src, deep = deep_pool()
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    seed = int(torch.randint(1 << 30, ()))
    x, ids, w = routing(40, seed=seed)  # 40 tokens: a prompt's call (cpu_jobs.PROMPT_TOKENS)

    def forward(b):  # in inference mode, as the engine runs: the job's worker writes the flag outside it
        with torch.inference_mode():
            b.begin_forward(40, K, hold=True, span=40)
            outs = [b.forward(layer, x, ids, w) for layer in range(6)]
            b.end_forward()
        return outs

    got = {}
    for join in (False, True):
        monkeypatch.setattr(cpu_jobs, "JOIN_ON_DEVICE", join)
        b = cls(deep, 2 * E, "cpu", estimate=est, stream_prefill="off", slot_policy="lfu", lookahead="on",
                grouped=True)
        b.call_log = []
        for layer, y in enumerate(forward(b)):
            torch.testing.assert_close(y, reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5,
                                       msg=f"seed {seed}")
        got[join] = {k: v for k, v in b.stats()["total"].items() if k != "cpu_seconds"}  # counts, not times
        with_cpu = [c for c in b.call_log if c.cpu]
        assert with_cpu and all(c.kind == ("joined" if join else "routed") for c in with_cpu)
        assert all(c.cpu_ms > 0 and 0 <= c.cpu_start_ms <= c.woke_ms for c in with_cpu)
        if join:
            assert all(c.cpu_wait_ms == 0 for c in with_cpu)
            assert (b.cpu_jobs._posted is not None) == cpu_runner.NATIVE  # posted to the native runner

            def fail(*a, **k):
                raise RuntimeError("a job that fails")

            with monkeypatch.context() as m:
                m.setattr(cpu_jobs, "run_on_cpu", fail)  # a job on the Python thread
                m.setattr(cpu_kernels.CpuExpertRunner, "post_gather", fail)  # or posted to the native runner
                with pytest.raises(RuntimeError, match="a job that fails"):
                    forward(b)
            for layer, y in enumerate(forward(b)):  # the next forward: the failed one's job is gone
                torch.testing.assert_close(y, reference(src, layer, x, ids, w), rtol=1e-5, atol=1e-5)
        check_table(b)
        b.close()
    if cls is CpuBackend:
        assert got[True] == got[False]


def test_a_prompt_whose_tokens_cluster_plans_hybrids_copies_ahead_for_the_misses_it_touches():
    """Tokens that pick alike touch fewer distinct experts than the heat's independent picks predict; each routed
    prompt call's touched / predicted (among the experts not near-certain: 8 tokens of top 3 of 8 touch each with
    p = 0.98) moves lookahead.TouchRatio, which scales the next layers' expected misses that hybrid's copies ahead
    take their fill share of. Independent routing leaves it near 1; outputs are the reference's either way."""
    src, deep = deep_pool()
    est = BandwidthEstimate(bp=1e9, bh=1e9, frozen=True)
    x, ids, w = routing(8, seed=3)
    for clustered, want in ((False, (0.8, 1.2)), (True, (lookahead.TOUCH_RANGE[0], 0.6))):
        b = HybridBackend(deep, 2 * E, "cpu", estimate=est, stream_prefill="off", lookahead="on")
        call_ids = torch.tensor([[0, 1, 2]] * 8) if clustered else ids
        b.begin_forward(8, K, hold=True, span=8)
        for layer in range(6):
            torch.testing.assert_close(b.forward(layer, x, call_ids, w), reference(src, layer, x, call_ids, w),
                                       rtol=1e-5, atol=1e-5)
        b.end_forward()
        assert list(b.touch_ratio.values) == [8], b.touch_ratio.values  # calls of 8 tokens
        learned = b.touch_ratio.of(8)
        assert want[0] <= learned <= want[1] and b.touch_ratio.of(1000) == learned, (clustered, learned)
        b.close()
        b = HybridBackend(deep, 2 * E, "cpu", estimate=est, stream_prefill="off", lookahead="on")
        b.begin_forward(8, K, hold=True, span=8)  # no heat, no residents: every expert a likely miss
        planned = {}
        for ratio in (1.0, learned):
            b.touch_ratio.values = {8: ratio}
            plan = b._plan_row(3, 0)
            planned[ratio] = 0 if plan is None else len(plan[1])
        b.end_forward()
        assert planned[1.0] == E // 2  # the balance of equal rates: half of the ~7.8 expected misses
        assert (planned[learned] < planned[1.0]) == clustered, planned
        b.close()
    b = HybridBackend(deep, 2 * E, "cpu", estimate=est, stream_prefill="off", lookahead="on")
    b.begin_forward(40, K, hold=True, span=40)  # 40 tokens touch each expert with p > TOUCH_CERTAIN: nothing learned
    x, _, w = routing(40, seed=4)
    b.forward(0, x, torch.tensor([[0, 1, 2]] * 40), w)
    b.end_forward()
    assert b.touch_ratio.values == {} and b.touch_ratio.of(40) == 1.0
    b.close()


def test_hybrids_copies_ahead_price_the_cpus_share_at_the_pairs_of_the_experts_they_leave_it():
    """Under skew the copies ahead take the hot experts and leave the CPU the cold ones, touched by a token or two:
    the CPU's rate is taken for their pairs per expert (policy.PER_BUCKETS), not the layer's mean. Uniform heat
    leaves both the same."""
    _, deep = deep_pool()
    est = BandwidthEstimate(bp=1e9, bh=1e9, frozen=True)
    for skew in (False, True):
        b = HybridBackend(deep, 2 * E, "cpu", estimate=est, stream_prefill="off", lookahead="on")
        if skew:
            b.cache.table.heat[:] = 40.0 / np.arange(1, E + 1) ** 2  # uses now, hottest first in every layer
        asked, plain = [], b.ahead_fills
        b.ahead_fills = lambda expected, likely, per=1.0, behind=0: asked.append(per) or plain(expected, likely, per,
                                                                                                  behind)
        b.begin_forward(40, K, hold=True, span=40)
        asked.clear()
        b._plan_row(3, 0)
        b.end_forward()
        assert len(asked) == 2, asked  # the layer's mean, then the rest's once the copies are chosen
        assert (asked[1] < 0.8 * asked[0]) == skew and asked[1] <= asked[0] * 1.0001, asked
        b.close()


def test_the_touch_ratio_is_kept_per_size_of_call_and_bounded():
    """TouchRatio: an EMA per power of two of a call's tokens, clamped to TOUCH_RANGE; a size not seen takes the
    nearest seen (the larger on a tie), 1 before any call."""
    r = lookahead.TouchRatio()
    assert r.of(256) == 1.0
    r.observe(256, 100, 200.0)  # 0.5 from 1: one step of TOUCH_ALPHA
    assert r.of(300) == pytest.approx(1 - lookahead.TOUCH_ALPHA * 0.5) and list(r.values) == [256]
    for _ in range(60):
        r.observe(300, 0, 200.0)  # below the range: held at its floor
        r.observe(4000, 250, 250.0)
    assert r.of(256) == pytest.approx(lookahead.TOUCH_RANGE[0]) and r.of(4096) == pytest.approx(1.0)
    assert r.of(16) == r.of(256) and r.of(1 << 20) == r.of(4096)
    assert r.of(1024) == r.of(4096) and r.of(512) == r.of(256)  # nearest; 1024 is as near to 4096 as to 256
    r.observe(256, 10, 0.0)  # nothing predicted: nothing learned
    assert r.of(256) == pytest.approx(lookahead.TOUCH_RANGE[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_copies_ahead_planned_from_inputs_made_before_the_routing_came_back_equal_those_made_after(seed,
                                                                                                  monkeypatch):
    """forward makes the next layer's _ahead_inputs before the routing's read-back, where the host waits for the
    device; the copies ahead planned from them are the ones planned wholly after it (the layer's heat noted, its
    hits locked, the copies in flight counted), in every routed layer call of skewed prompts, fresh routings."""
    experts, top_k, layers = 32, 4, 5
    g = torch.Generator().manual_seed(seed)
    src = ExpertWeights({i: torch.randn(experts, 2 * I, H, generator=g) * 0.3 for i in range(layers)},
                        {i: torch.randn(experts, H, I, generator=g) * 0.3 for i in range(layers)})
    b = HybridBackend(pool_from_source(src), layers * experts * 3 // 10, "cpu",
                      estimate=BandwidthEstimate(bp=1e9, bh=1e9, frozen=True), stream_prefill="off",
                      slot_policy="lfu", lookahead="on")
    pairs, plan_row = [], lookahead.CopiesAhead._plan_row

    def both(self, i, behind, inputs=None):
        got = plan_row(self, i, behind, inputs)
        if inputs is not None:
            pairs.append((got, plan_row(self, i, behind)))
        return got

    monkeypatch.setattr(lookahead.CopiesAhead, "_plan_row", both)
    zipf = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    for prompt in range(4):
        T = 24 + 8 * prompt
        b.begin_forward(T, top_k, hold=True, span=T)
        for layer in range(layers):
            perm = torch.randperm(experts, generator=g)  # each layer's hot experts its own
            ids = perm[torch.multinomial(zipf.expand(T, -1), top_k, generator=g)]
            w = torch.softmax(torch.randn(T, top_k, generator=g), -1)
            x = torch.randn(T, H, generator=g)
            want = sum((w * (ids == e)).sum(1, keepdim=True) * expert_mlp(x, src.gate_up(layer, e),
                                                                          src.down(layer, e)) for e in range(experts))
            torch.testing.assert_close(b.forward(layer, x, ids, w), want, rtol=1e-5, atol=1e-5)
        b.end_forward()
    b.close()
    planned = [p for p in pairs if p[1] is not None]
    assert len(pairs) >= 3 * (layers - 1) and planned, pairs  # every routed call but the last layer's
    for got, want in pairs:
        assert (got is None) == (want is None)
        if got is not None:
            assert got[0] == want[0] and got[2] == want[2] and np.array_equal(got[1], want[1])
