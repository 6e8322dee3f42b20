"""SplitPolicy on a simulated machine: hidden true rates, slower while both paths run (torch-free)."""
import os
import random
from dataclasses import dataclass

import pytest

from engine.experts.hybrid import TailClock
from engine.experts.policy import FULL_SAMPLE_EXPERTS, BandwidthEstimate, SplitPolicy, q_balanced
from engine.experts.slot_cache import copy_backlog

EB = 6 << 20  # bytes of one expert


@dataclass
class Machine:
    """True fill (bp) and CPU (bh) rates alone; while both paths run each reaches `contention` of its rate."""

    bp: float
    bh: float
    contention: float

    def run(self, q: int, m: int) -> tuple[float, float]:
        """Seconds the fills and the CPU runs of a call that fills q of m misses take."""
        c = self.contention if 0 < q < m else 1.0
        return q * EB / (self.bp * c), (m - q) * EB / (self.bh * c)

    def seconds(self, q: int, m: int) -> float:
        return max(self.run(q, m))


def drive(policy: SplitPolicy, machine: Machine, ms) -> list:
    """Run layer calls with m misses each; fill timings arrive one call late, as on CUDA, tagged at issue."""
    pending, out = None, []
    for m in ms:
        c = policy.choose(m)
        fill_s, cpu_s = machine.run(c.q, m)
        together = 0 < c.q < m
        if pending is not None:
            policy.observe("fill", *pending)
            pending = None
        if c.q:
            pending = (c.q * EB, fill_s, together)
        if c.q < m:
            policy.observe("cpu", (m - c.q) * EB, cpu_s, together)
        out.append((m, c))
    return out


def make(bp=10e9, bh=10e9, **kw) -> SplitPolicy:
    return SplitPolicy(BandwidthEstimate(bp=bp, bh=bh), EB, **kw)


def test_converges_to_the_balanced_split():
    machine = Machine(bp=20e9, bh=10e9, contention=0.9)
    policy = make(bp=25e9, bh=5e9)  # a profile off by 25% and 2x
    calls = drive(policy, machine, [24] * 400)
    balanced = q_balanced(24, 18e9, 9e9)  # 16: both paths end together at the contended rates
    assert balanced == 16
    assert all(c.q == balanced for _, c in calls[-200:] if not c.explored)
    assert policy.best(24).q == balanced
    assert policy.rates["fill", True].value == pytest.approx(18e9)
    assert policy.rates["cpu", False].value == pytest.approx(10e9)  # measured by exploring "cpu"


MACHINES = {
    "split pays": Machine(bp=20e9, bh=10e9, contention=0.9),
    "contention: fill alone": Machine(bp=20e9, bh=10e9, contention=0.5),
    "fast CPU: cpu alone": Machine(bp=5e9, bh=40e9, contention=0.6),
    "laptop": Machine(bp=12e9, bh=48e9, contention=0.85),
    "equal paths": Machine(bp=25e9, bh=25e9, contention=0.7),
}


@pytest.mark.parametrize("name", MACHINES)
def test_never_slower_than_the_better_single_path(name):
    machine = MACHINES[name]
    rng = random.Random(0)
    calls = drive(make(), machine, [rng.randint(0, 40) for _ in range(1500)])
    for m, c in calls[300:]:
        if c.explored or m == 0:
            continue
        solo = min(machine.seconds(m, m), machine.seconds(0, m))
        assert machine.seconds(c.q, m) <= solo * (1 + 1e-9), (m, c)


def test_explores_the_arms_not_taken_on_schedule():
    """An untaken choice is re-measured after explore_every calls times its predicted slowdown."""
    machine = Machine(bp=20e9, bh=10e9, contention=0.95)  # the split pays: fill 1.4x, cpu 2.8x slower
    policy = make(bp=20e9, bh=10e9, explore_every=8, explore_min=4)
    calls = drive(policy, machine, [16] * 200)
    best = machine.seconds(policy.best(16).q, 16)
    for arm, q in (("fill", 16), ("cpu", 0)):
        at = [i for i, (_, c) in enumerate(calls) if c.explored and c.arm == arm]
        assert at[2] < 6  # each taken explore_first = 3 times at once: the profile may be far off
        wait = 8 * machine.seconds(q, 16) / best
        gaps = [b - a for a, b in zip(at[2:], at[3:])]
        assert len(gaps) >= 200 // (wait + 3) - 3 and all(wait < g <= wait + 3 for g in gaps), arm
    assert policy.stats()["explored"] == sum(c.explored for _, c in calls) > 0
    tax = sum(machine.seconds(c.q, m) for m, c in calls) / (len(calls) * best) - 1
    assert 0 < tax < 2 / 8  # each untaken choice costs under 1 / explore_every of the time
    calls = drive(make(bp=20e9, bh=10e9, explore_every=8, explore_min=4), machine, [16, 2] * 100)
    assert all(m == 16 for m, c in calls if c.explored)  # fewer than explore_min misses: never explored


def test_exploring_finds_a_path_that_got_faster():
    policy = make(bp=20e9, bh=5e9, explore_every=16)
    drive(policy, Machine(bp=20e9, bh=5e9, contention=0.5), [32] * 200)
    assert policy.best(32).arm == "fill"
    drive(policy, Machine(bp=20e9, bh=60e9, contention=0.5), [32] * 200)  # another job left the CPU
    assert policy.best(32).arm == "cpu"


def test_no_misses_and_one_miss():
    policy = make(bp=10e9, bh=20e9, explore_every=1)
    none = policy.choose(0)
    assert (none.q, none.arm) == (0, "none")
    one = [policy.choose(1) for _ in range(5)]
    assert all(c.q == 0 and c.arm == "cpu" and not c.explored for c in one)  # no split of one miss
    assert policy.stats()["arms"] == {"split": 0, "fill": 0, "cpu": 5} and policy.explored == 0
    assert 0.0 <= policy.cpu_share() <= 1.0


def test_frozen_estimate_gives_a_fixed_split():
    policy = SplitPolicy(BandwidthEstimate(bp=1e9, bh=2e9, frozen=True), EB, explore_every=2)
    first = [policy.choose(m).q for m in range(41)]
    drive(policy, Machine(bp=50e9, bh=1e9, contention=0.3), [24] * 50)
    assert [policy.choose(m).q for m in range(41)] == first and policy.explored == 0
    assert first[9] == 3 and first[30] == 10  # a third filled: both paths end together
    assert first[1] == 0  # one miss: the CPU alone (2 GB/s) beats the fill (1 GB/s)
    assert policy.cpu_share() == pytest.approx(1 - 21 / 64)


def box_step(best: float, share: float) -> float:
    """A hybrid step's seconds at a CPU share: slowest when either path is left with too much (the H200 box's
    slopes, 8 layers, batch 1)."""
    return 4.76e-3 + (4.7e-3 * (best - share) if share < best else 2.3e-3 * (share - best))


@pytest.mark.parametrize("start", [0.05, 0.47, 0.8])
def test_share_search_finds_the_fastest_share_under_noise_and_drift(start):
    """ShareSearch (a graphed hybrid step's CPU share) climbs to the share with the shortest step time from
    either side, through 2% noise, prefill-sized outliers and a machine whose speed drifts by +-15% and
    jumps by 10% (larger than the differences between nearby shares), then stays near it at a small cost
    (300 seeds, starts and optima, 2% noise: at most 2.5% of the step time lost to probing, 1.3% on average;
    notes in ShareSearch)."""
    import math

    from engine.experts.policy import ShareSearch

    rng = random.Random(int(start * 100))
    best = 0.37
    search = ShareSearch(start)
    share, seen = search.share, []
    for k in range(1200):
        speed = (1 + 0.15 * math.sin(k / 40)) * (1.1 if k > 600 else 1.0)
        t = box_step(best, share) * speed
        share = search.observe(40 * t if rng.random() < 0.02 else t * (1 + 0.02 * rng.gauss(0, 1)), rows=1)
        seen.append(share)
    assert abs(search.best - best) <= 0.06 and search.moves >= 1
    late = seen[-300:]
    assert all(abs(s - best) <= 0.1 for s in late)  # probes only near the best
    lost = sum(box_step(best, s) for s in late) / (len(late) * box_step(best, best)) - 1
    assert lost < 0.03  # its probes and rests cost little against staying at the best
    assert search.observe(1.0, rows=4) == search.best  # another batch size: a fresh comparison at the best


def test_share_search_is_not_moved_by_a_steady_drift():
    """Shares that cost the same on a machine getting faster step by step: the order best, probe, probe,
    best gives the drift to each side alike, so the search stays (pairs always in the same order would see
    every probe 1% faster and walk off)."""
    from engine.experts.policy import ShareSearch

    search = ShareSearch(0.5)
    for k in range(400):
        search.observe(4e-3 * 0.99 ** k, rows=1)
    assert search.moves == 0 and search.best == 0.5


def test_share_search_pairs_the_steps_it_times():
    """The first step of a batch size is left out (it may carry a graph's capture); then best, probe, probe,
    best; a pair over the outlier ratio is dropped; a decision after `pairs` pairs."""
    from engine.experts.policy import ShareSearch

    search = ShareSearch(0.5, step=0.1, min_step=0.1, pairs=2, rest=3)
    assert search.observe(9.0, rows=1) == 0.5  # left out: the comparison starts at the best
    got = [search.observe(t, rows=1) for t in (1.0, 0.9, 0.9, 1.0)]  # probe 0.4 (downwards first) 10% faster
    assert got[:3] == [0.4, 0.4, 0.5]
    assert search.best == 0.4 and search.moves == 1 and got[3] == 0.4  # moved; the next comparison at 0.4
    assert [search.observe(t, rows=1) for t in (1.0, 5.0, 1.0, 1.0)] == [0.3, 0.3, 0.4, 0.4]  # 5x: dropped
    assert search.moves == 1 and search.probe == 0.3  # one pair counted so far: no decision yet
    search.observe(1.0, rows=1), search.observe(1.0, rows=1)  # an equal pair: 0.3 fails; the other side next
    assert search.best == 0.4 and search.probe == 0.5
    for _ in range(4):
        search.observe(1.0, rows=1)  # 0.5 fails too, at the smallest step: rest at the best
    assert search.probe is None and [search.observe(1.0, rows=1) for _ in range(3)] == [0.4, 0.4, 0.4]
    assert search.probe is not None  # rested: probing again


def test_share_search_counts_its_settlements():
    """`rests` counts the times the search settled (both sides lost at its smallest step): what a hybrid
    decode keeps for the next process (graph_cpu.CpuShare, profile.ShareMemory)."""
    from engine.experts.policy import ShareSearch

    search = ShareSearch(0.5, step=0.1, min_step=0.1, pairs=1, rest=2)
    search.observe(1.0, rows=1)  # a batch size's first step is left out
    for n in range(1, 20):  # equal times: 0.4 fails, then 0.6 fails: settled at 0.5
        search.observe(1.0, rows=1)
        if search.rests:
            break
    assert n == 4 and search.rests == 1 and search.probe is None and search.best == 0.5  # two pairs of two steps
    for _ in range(2 + 4):  # the rest, then both sides fail again
        search.observe(1.0, rows=1)
    assert search.rests == 2 and search.best == 0.5 and search.moves == 0


def test_share_search_decides_sooner_on_long_strides_and_reprobes_from_them():
    """With coarse_pairs, while its step is longer than the smallest, fewer pairs decide; after a rest it
    probes again from its first step."""
    from engine.experts.policy import ShareSearch

    assert ShareSearch(0.5, pairs=6).coarse_pairs == 6  # by default every stride takes all the pairs
    search = ShareSearch(0.5, step=0.2, min_step=0.05, pairs=6, coarse_pairs=2, rest=2)
    search.observe(1.0, rows=1)
    for t in (1.0, 0.9, 0.9, 1.0):  # two pairs at step 0.2: the probe 0.3 wins
        search.observe(t, rows=1)
    assert search.best == 0.3 and search.moves == 1
    for _ in range(500):  # equal times: every probe fails and the step halves, down to the rest
        if search.probe is None:
            break
        search.observe(1.0, rows=1)
    assert search.probe is None and search.step == 0.05 and search.best == 0.3
    search.observe(1.0, rows=1), search.observe(1.0, rows=1)  # the rest
    assert search.step == 0.2 and search.probe in (0.1, 0.5)


def test_cpu_share_leaves_the_cpu_what_dram_has_beside_pcie():
    """The in-graph CPU share's starting point: rates balanced, PCIe at 0.9 of B_P, the CPU capped by what
    STREAM leaves beside PCIe (H200 box figures: 0.45, where 0.40 measured best; 0.56 without STREAM)."""
    box = BandwidthEstimate(bp=53.2e9, bh=61.6e9, stream=86.7e9)
    assert 0.43 < box.cpu_share() < 0.46
    assert 0.55 < BandwidthEstimate(bp=53.2e9, bh=61.6e9).cpu_share() < 0.57
    assert BandwidthEstimate(bp=53.2e9, bh=61.6e9, stream=1e12).cpu_share() == \
        BandwidthEstimate(bp=53.2e9, bh=61.6e9).cpu_share()  # plenty of DRAM: B_H itself
    starved = BandwidthEstimate(bp=53.2e9, bh=61.6e9, stream=40e9).cpu_share()
    assert 0 < starved < 0.15  # PCIe alone fills DRAM: the CPU keeps a floor of a tenth of B_H


@pytest.mark.parametrize("seed", range(5))
def test_busy_copies_move_the_split_to_the_cpu(seed):
    """busy: experts the copy stream moves besides this call's fills (the next layer's, copied ahead). The
    split's predicted time is within one expert of the best integer split of max((q + busy) / B_P, (m - q) /
    B_H) at the together rates, never worse than either path alone with the copies counted, and it fills
    fewer the more the copy stream carries; busy=0 is the plain balanced split."""
    rnd = random.Random(seed)
    for _ in range(200):
        bp, bh = rnd.uniform(5e9, 60e9), rnd.uniform(5e9, 60e9)
        p = SplitPolicy(BandwidthEstimate(bp=bp, bh=bh, frozen=True), EB)
        m, busy = rnd.randint(1, 200), rnd.randint(0, 200)
        best = min(max((q + busy) * EB / bp, (m - q) * EB / bh) for q in range(m + 1))
        c = p.best(m, busy)
        assert c.seconds <= best + EB / min(bp, bh) + 1e-12
        assert c.seconds == pytest.approx(max((c.q + busy) * EB / bp, (m - c.q) * EB / bh))
        assert c.q <= p.best(m, 0).q
        if busy == 0:
            assert c.q in (0, m, q_balanced(m, bp, bh))
        extra = rnd.uniform(0, 0.01)  # seconds the CPU path loses a call besides its runs
        best = min(max((q + busy) * EB / bp, (m - q) * EB / bh + (extra if q < m else 0.0)) for q in range(m + 1))
        c = p.best(m, busy, extra)
        assert c.seconds <= best + EB / min(bp, bh) + 1e-12
        assert c.q >= p.best(m, busy).q

def test_cpu_rates_are_kept_per_pairs_per_expert():
    """A prompt's CPU runs take several tokens per expert and run slower per byte than a decode's one: their
    rate is learned apart (PER_BUCKETS), so it moves the split for prompts-sized runs only. A bucket without a
    full sample predicts by the nearest lower one's rate as it is now (an extend plans its copies ahead at 8
    pairs an expert and runs its CPU share at ~7); stats name the measured ones."""
    p = make(bp=10e9, bh=10e9)
    full = FULL_SAMPLE_EXPERTS * EB
    for _ in range(5):
        p.observe("cpu", full, full / 10e9, True, per=1.0)
        p.observe("fill", full, full / 10e9, True)
    assert p.best(64, per=8.0).q == p.best(64, per=1.0).q == q_balanced(64, 10e9, 10e9)  # as the one below
    for _ in range(5):
        p.observe("cpu", full, full / 4e9, True, per=9.0)  # 8-15 pairs per expert: 4 GB/s
    assert p.best(64, per=12.0).q == q_balanced(64, 10e9, 4e9) > p.best(64, per=1.0).q
    assert p.best(64, per=1.0).q == q_balanced(64, 10e9, 10e9)  # the decode-sized rate is untouched
    assert p.best(64, per=40.0).q == q_balanced(64, 10e9, 4e9)  # 16+: as 8-15
    for _ in range(20):
        p.observe("cpu", full, full / 8e9, True, per=9.0)  # 8-15 gets faster: 16+, never measured, follows
    assert p.best(64, per=40.0).q == p.best(64, per=12.0).q == q_balanced(64, 10e9, 8e9)
    rates = p.stats()["rates"]
    assert rates["cpu_together_per8"] == pytest.approx(8e9, rel=0.02) and "cpu_together_per16" not in rates


def test_a_small_run_moves_the_rate_by_its_share_of_a_full_sample():
    """A run of a few experts is mostly its fixed cost (the box: one expert on the CPU at 2.5 GB/s where 60 ran
    at 42): it weighs n / FULL_SAMPLE_EXPERTS of a sample, so the few misses of a prompt's last layers leave the
    rate its large layer calls split by nearly as it was."""
    p = make(bp=10e9, bh=10e9)
    full = FULL_SAMPLE_EXPERTS * EB
    for _ in range(5):
        p.observe("cpu", full, full / 10e9, True)
    for _ in range(5):
        p.observe("cpu", EB, EB / 1e9, True)  # one expert a run, ten times slower
    small = p.stats()["rates"]["cpu_together"]
    for _ in range(5):
        p.observe("cpu", full, full / 1e9, True)  # the same rate in full-size runs
    assert 9e9 < small and p.stats()["rates"]["cpu_together"] < 5e9


def extend_model(r_true: float, r_est: float, backlog: bool, cpu: float = 14.1, handoff_ms: float = 4.3,
                 tail: TailClock | None = None, joined: bool = False) -> float:
    """ms a uniform hybrid extend takes in a model of the H200 box's (s45 layer-call log, 8 layers at 37.5% in
    slots after a streamed prompt: 0, 6, 7 resident, 1-5 routed with 256 misses each): copies run one after the
    other at r_true experts/ms, the CPU at `cpu`, which waits handoff_ms between its jobs (the routing's return
    1.1 ms before its job, 0.6 + 2.3 ms after it to the next layer's routing, 0.3 for that), each layer's hits
    (its copies ahead) and fills land before the next routing. The split and the copies ahead come from
    SplitPolicy at r_est; with `backlog` they count the copies still in flight (slot_cache.copy_backlog, each
    batch taken to start where the ones before it end at r_est, as SlotCache chains them). With `tail`, the last
    routed layer's split counts that clock's lag and the clock measures its fills against its CPU job; `joined`:
    the device joins the last CPU job (cpu_jobs.JOIN_ON_DEVICE), so layers 6 and 7 follow the later of its end
    and its layer's fills, not the host's handoff."""
    eb = 6291456
    pol = SplitPolicy(BandwidthEstimate(bp=r_est * eb * 1e3, bh=cpu * eb * 1e3, frozen=True), eb)
    extra = handoff_ms / 1e3
    copies, free, drained = [], 0.0, 0.0  # (taken to start, experts, true end); when the stream is done, truly
    # and as SlotCache predicts it

    def copy(now, n):
        nonlocal free, drained
        ready = max(now, drained) if free > now else now
        free, drained = max(now, free) + n / r_true, ready + n / r_est
        copies.append((ready, n, free))
        return free

    def behind(now):
        pending = [(ready * 1e-3, n * eb) for ready, n, end in copies if end > now]
        return round(copy_backlog(pending, r_est * eb * 1e3, now * 1e-3) / eb) if backlog and pending else 0

    lands = {1: copy(0.0, min(256, pol.best(256, busy=behind(0.0), cpu_extra=extra, per=8).q))}
    ahead = {1: copies[-1][1]}
    done, t = 1.0, 3.0  # layer 0 (resident) computed; the engine reaches layer 1
    for layer in range(1, 6):
        now = max(t + 0.3, done) + 1.1  # routing back, then the host's plan
        late = behind(now)
        nxt = 0 if layer == 5 else min(256, pol.best(256, busy=late, cpu_extra=extra, per=8).q)
        m = 256 - ahead[layer]
        lag = tail.lag if tail is not None and layer == 5 else 0.0
        q = pol.choose(m, nxt + late, extra if nxt + late else 0.0, 8, fill_lag=lag).q
        cpu_end = now + (m - q) / cpu
        filled = copy(now, q) if q else now
        if tail is not None and layer == 5:
            tail.observe((filled - cpu_end) / 1e3) if 0 < q < m else tail.forget()
        if nxt:
            lands[layer + 1], ahead[layer + 1] = copy(now, nxt), nxt
        done, t = max(cpu_end, filled, lands[layer]) + 0.2, cpu_end + 2.9
    return (done if joined else max(t + 0.3, done)) + 3.0  # layers 6 and 7, resident


def test_counting_the_copies_in_flight_shortens_a_modelled_extend():
    """In the model of the box's extend (extend_model; 86.6 ms where the box took 86.3 at e171818's rates), copies
    ahead planned as if the copy engine were free fall a layer behind, and the last routed layer's fills wait
    ~15 ms behind them; counting the copies in flight moves work to the CPU early. Faster where the split takes
    the copies for faster than they run (the box: 52 GB/s assumed, ~48 run), and never slower with the rate
    right, over copy rates from 5.5 to 9 experts/ms (35-57 GB/s)."""
    without, with_ = extend_model(7.63, 8.27, backlog=False), extend_model(7.63, 8.27, backlog=True)
    assert without == pytest.approx(86.6, abs=1.0) and with_ < 0.95 * without
    for r in (5.5, 6.4, 7.63, 8.27, 9.0):
        assert extend_model(r, r, backlog=True) <= extend_model(r, r, backlog=False) + 0.5


def test_a_fill_lag_moves_the_split_by_the_experts_it_is_worth():
    """fill_lag: seconds the fills land later than their rate says (the tail clock's). The split fills fewer the
    later they land and more with a negative lag; its predicted time is the later of the lagged fills and the
    CPU's runs, within one expert of the best integer split; a zero lag is the plain split."""
    rnd = random.Random(int.from_bytes(os.urandom(4), "little"))
    for _ in range(300):
        bp, bh = rnd.uniform(5e9, 60e9), rnd.uniform(5e9, 60e9)
        p = SplitPolicy(BandwidthEstimate(bp=bp, bh=bh, frozen=True), EB)
        m, busy, a = rnd.randint(2, 256), rnd.randint(0, 50), rnd.uniform(0.0, 0.01)
        assert p.options(m, busy, fill_lag=0.0) == p.options(m, busy)
        q = {}
        for lag in (-a, 0.0, a):
            split = [c for c in p.options(m, busy, fill_lag=lag) if c.arm == "split"]
            if not split:
                continue
            c, q[lag] = split[0], split[0].q

            def fill_s(n):
                return max(0.0, (n + busy) * EB / bp + lag)
            assert c.seconds == pytest.approx(max(fill_s(c.q), (m - c.q) * EB / bh))
            assert c.seconds <= min(max(fill_s(n), (m - n) * EB / bh) for n in range(1, m)) + EB / min(bp, bh)
        if len(q) == 3:
            assert q[-a] >= q[0.0] >= q[a]


def test_the_tail_clock_lands_the_last_routed_layers_fills_with_its_cpu_job():
    """In the model of the box's extend with the last CPU job joined on the device, the last routed layer's
    fills landed after its CPU job wherever the copies run slower than the split takes them (and, the rates
    right, where the split counts the CPU's handoff that this layer does not wait out); the clock's lag moves
    that split within a few extends: faster by 1.5-10 ms there, and never slower where the fills were on time,
    its measured lag then within 0.2 ms of zero. A call that sends every miss one way forgets some of the lag."""
    for r_true, r_est, gain in ((5.5, 8.27, 5.0), (7.0, 8.27, 5.0), (7.63, 8.27, 2.5), (9.0, 9.0, 1.5),
                                (8.27, 8.27, 0.0), (9.0, 8.27, 0.0), (5.5, 5.5, 0.0)):
        plain = extend_model(r_true, r_est, backlog=True, joined=True)
        clock = TailClock()
        times = [extend_model(r_true, r_est, backlog=True, tail=clock, joined=True) for _ in range(8)]
        assert max(times[4:]) <= plain - gain + 0.3, (r_true, r_est, times)
        if gain == 0.0:
            assert abs(clock.last) < 2e-4 and abs(clock.lag) < 1e-3
    clock = TailClock()
    clock.observe(0.004)
    assert clock.lag == pytest.approx(0.002) and clock.last == 0.004 and clock.samples == 1
    clock.observe(1.0)
    assert clock.lag == clock.bound  # at most TAIL_BOUND either way
    clock.forget()
    assert clock.lag == pytest.approx(0.9 * clock.bound)
