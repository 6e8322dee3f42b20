"""How many of a layer's missing experts to copy to the device, the bandwidth estimates, and `auto`.

Torch-free. B_P = pinned host->device expert bandwidth, B_H = host-side expert kernel bandwidth (bytes/s).
Fills and CPU runs of one MoE layer proceed at once, so the split of m misses that makes both end together
fills q = round(m * B_P / (B_P + B_H)) (`q_balanced`). Both paths read the same host DRAM, so each is slower
while the other runs; the hybrid backend's `SplitPolicy` keeps the rates each path reached alone and
alongside the other, predicts the miss-service time of the balanced split, of filling every miss and of
running every miss on the CPU, and takes the fastest: the two solo choices guard against a split that
contention makes slower than either path alone. FreeToken's rule q* = round(m * B_P / B_H) (`q_star`)
fills every miss once B_P >= B_H; the GPU routing kernel (kernels/route_ref.py) takes its `ratio` form,
which expresses the balanced split too (ratio = B_P / (B_P + B_H)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

DEFAULT_BP = 25e9  # bytes/s; replaced by the bench profile or the running estimate
DEFAULT_BH = 20e9


def q_star(m: int, bp: float, bh: float) -> int:
    """q* = round(m * B_P / B_H) clamped to [0, m] (halves up)."""
    if m <= 0:
        return 0
    if bh <= 0 or bp == float("inf"):
        return m
    return max(0, min(m, math.floor(m * bp / bh + 0.5)))  # halves round up, as in the GPU kernel


@dataclass
class BandwidthEstimate:
    """EMA of B_P and B_H from measured fills and CPU runs of recent steps; `frozen` keeps the profile."""

    bp: float = DEFAULT_BP
    bh: float = DEFAULT_BH
    alpha: float = 0.2
    frozen: bool = False
    min_bytes: int = 1 << 20  # samples smaller than this are latency, not bandwidth
    stream: float = 0.0  # the host's STREAM read rate from the bench profile (0: not measured)

    def observe_fill(self, nbytes: int, seconds: float) -> None:
        self.bp = self._update(self.bp, nbytes, seconds)

    def observe_cpu(self, nbytes: int, seconds: float, weight: float = 1.0) -> None:
        """weight: the sample's share of a full one (a run of n experts: n / FULL_SAMPLE_EXPERTS, capped at 1), as
        SplitPolicy's rates weigh it: a run of a few experts is mostly its fixed cost, not B_H."""
        self.bh = self._update(self.bh, nbytes, seconds, weight)

    def _update(self, current: float, nbytes: int, seconds: float, weight: float = 1.0) -> float:
        if self.frozen or nbytes < self.min_bytes or seconds <= 0 or weight <= 0:
            return current
        w = self.alpha * min(1.0, weight)
        return (1 - w) * current + w * (nbytes / seconds)

    def q(self, m: int) -> int:
        return q_star(m, self.bp, self.bh)

    def cpu_share(self, read_ratio: float = 0.9) -> float:
        """The share of misses the CPU should take when it runs beside in-place PCIe reads (graph_cpu.py): the
        two paths' rates balanced, PCIe at read_ratio of B_P (the kernels' in-place rate) and the CPU at what
        the host's DRAM leaves it beside that (STREAM - PCIe, where the profile measured STREAM). On the H200
        box: B_H 61.6, B_P 53.2, STREAM 86.7 GB/s -> 0.45; the measured best was 0.40 (0.56 without STREAM)."""
        pcie = read_ratio * self.bp
        cpu = self.bh if self.stream <= 0 else max(0.1 * self.bh, min(self.bh, self.stream - pcie))
        return cpu / (cpu + pcie) if cpu + pcie > 0 else 0.0


def q_balanced(m: int, bp: float, bh: float, head: float = 0.0) -> int:
    """round((m + head) * B_P / (B_P + B_H) - head) in [0, m]: the fills of m misses and the CPU's runs of the rest
    end together, where the fill path has `head` experts' worth of work besides them (copies ahead, a lag at B_P:
    a float, negative where the fills land sooner). Every miss to the fills where B_P is infinite or neither path
    has a rate."""
    if m <= 0:
        return 0
    if bp == float("inf") or bp + bh <= 0:
        return m
    return max(0, min(m, math.floor((m + head) * bp / (bp + bh) - head + 0.5)))  # halves up, as q_star


class Choice(NamedTuple):
    """One layer call's split: fill q of its m misses, the rest on the CPU."""

    arm: str  # "split" (both paths at once), "fill" (every miss), "cpu" (every miss); "none": no misses
    q: int
    seconds: float  # predicted miss-service time
    explored: bool = False  # taken to re-measure it, not because it was predicted fastest


@dataclass
class Rate:
    """A running bytes/s: the seed until the first sample, then an EMA of weight `alpha` per call, so a
    sample after k calls without one weighs 1 - (1 - alpha)^k: a rate measured only now and then (a choice
    being explored) follows the machine within a few samples. Early on the weight is at least 1/samples
    (a mean of the samples: one measurement outweighs the profile). A sample of `weight` < 1 (a small run,
    mostly its fixed cost) moves the rate that much less and counts as that fraction of a sample."""

    value: float
    alpha: float
    samples: float = 0.0  # the samples' weights
    last: int = 0  # call number of the last sample

    def add(self, nbytes: int, seconds: float, call: int, weight: float = 1.0) -> None:
        if nbytes <= 0 or seconds <= 0 or weight <= 0:
            return
        stale = 1.0 - (1.0 - self.alpha) ** max(1, call - self.last)
        w = min(1.0, weight) * max(stale, 1.0 / (self.samples + 1))
        self.value = (1 - w) * self.value + w * nbytes / seconds
        self.samples, self.last = self.samples + min(1.0, weight), call


ARMS = ("split", "fill", "cpu")
CPU_SHARE_M = 64  # the miss count cpu_share() reports for (a full decode step of a large MoE layer)
# A CPU run's rate depends on the (token, expert) pairs each expert takes: one a decode token, reading the
# weights bounds it; a prompt's ~8 (uniform routing, 256 tokens, top 8 of 256) make it compute-bound (H200 box:
# 28-31 GB/s where decode-sized runs read 46). The CPU path keeps one rate per bucket of pairs per expert:
# 1, 2-3, 4-7, 8-15, 16+; fills move bytes whatever the tokens.
PER_BUCKETS = 5
# A run of fewer experts than this is mostly its fixed cost, not its rate (a CPU job of 1-3 experts on the box's
# 14 workers ran at 2.5 GB/s where 60 experts ran at 42): its sample weighs n / FULL_SAMPLE_EXPERTS of a full one,
# so the few misses of a prompt's last layers do not drag down the rate its large layer calls split by.
FULL_SAMPLE_EXPERTS = 16


def sample_weight(nbytes: int, expert_bytes: int) -> float:
    """A run of nbytes of experts as a rate sample: n experts weigh n / FULL_SAMPLE_EXPERTS of a full one (the
    rates take at most one)."""
    return nbytes / (FULL_SAMPLE_EXPERTS * expert_bytes)


def per_bucket(per: float) -> int:
    """The bucket of `per` (token, expert) pairs per expert (bucket k: 2^k to 2^(k+1) - 1; the last open)."""
    return min(PER_BUCKETS - 1, int(math.log2(max(1.0, per))))


class SplitPolicy:
    """Per MoE layer call, the fill/CPU split of m misses with the shortest predicted miss-service time.

    "split" fills q_balanced(m) at the rates both paths reached while running together; "fill" and "cpu"
    send every miss one way at the rate that path reached alone. Every rate starts at the estimate's
    B_P or B_H (no contention assumed until measured) and follows the fills and CPU runs the backend
    reports. So that the rates of choices not taken stay current, a call with at least `explore_min` misses
    takes, instead of the fastest, a choice taken fewer than `explore_first` times or left untaken for
    `explore_every` calls times its predicted slowdown (`_due`; the one used longest ago if several are).
    A frozen estimate freezes the rates and stops exploring: the split is then a fixed function of m."""

    def __init__(self, estimate: BandwidthEstimate, expert_bytes: int, *, explore_every: int = 64,
                 explore_min: int = 4, explore_first: int = 3) -> None:
        self.estimate, self.expert_bytes = estimate, expert_bytes
        self.explore_every, self.explore_min, self.explore_first = explore_every, explore_min, explore_first
        # (path, together) -> rate; path "fill" or "cpu", together: the other path ran alongside
        seeds = {"fill": estimate.bp, "cpu": estimate.bh}
        self.rates = {(path, t): Rate(seed, estimate.alpha) for path, seed in seeds.items() for t in (False, True)}
        # ("cpu", together, bucket) for buckets >= 1 (bucket 0 is ("cpu", together)), made at first use
        self._per_rates: dict[tuple[str, bool, int], Rate] = {}
        self.counts = dict.fromkeys(ARMS, 0)
        self.explored = 0
        self._last_used = dict.fromkeys(ARMS, 0)  # decision number an arm was last taken at
        self._decisions = 0

    def _rate(self, path: str, together: bool, per: float = 1.0) -> Rate:
        """The Rate a sample of `path` (alone or together) for runs of `per` pairs per expert goes to (CPU: by
        per_bucket; a bucket starts at _value's rate for it)."""
        b = per_bucket(per) if path == "cpu" else 0
        if b == 0:
            return self.rates[path, together]
        rate = self._per_rates.get((path, together, b))
        if rate is None:
            rate = self._per_rates[path, together, b] = Rate(self._value(path, together, per), self.estimate.alpha)
        return rate

    def _value(self, path: str, together: bool, per: float = 1.0) -> float:
        """The rate a choice predicts by: the bucket's own once it holds a full sample, else the current rate of
        the nearest lower bucket that does. (A copy of it taken when the bucket is made goes stale: an extend's
        CPU runs of ~7 pairs an expert feed the 4-7 bucket while its copies ahead are planned at 8.)"""
        for b in range(per_bucket(per) if path == "cpu" else 0, 0, -1):
            rate = self._per_rates.get((path, together, b))
            if rate is not None and rate.samples >= 1:
                return rate.value
        return self.rates[path, together].value

    def options(self, m: int, busy: int = 0, cpu_extra: float = 0.0, per: float = 1.0,
                fill_lag: float = 0.0) -> list[Choice]:
        """The choices for m >= 1 misses with their predicted seconds; "split" only where both paths get work.
        busy: experts the fill path copies besides (a routed prompt's next layer, copied ahead while this one
        runs): they add to the fills' time, and with them "cpu" runs alongside the copies. cpu_extra: seconds
        the CPU path loses per call besides its runs (with copies ahead the copy engine works through a layer's
        handoff, the routing's return and the next attention, while the CPU waits for its next input). per:
        (token, expert) pairs per missed expert (the CPU's rate for that many, PER_BUCKETS). fill_lag: seconds
        the fills are taken to land later than their rate says (negative: sooner; hybrid.TailClock)."""
        fill, cpu = self._value("fill", False), self._value("cpu", False, per)
        bp, bh = self._value("fill", True), self._value("cpu", True, per)

        def on_cpu(n: int, rate: float) -> float:
            return self._seconds(n, rate) + cpu_extra if n else 0.0

        def filled(n: int, rate: float) -> float:
            return max(0.0, self._seconds(n, rate) + fill_lag)

        alone_cpu = on_cpu(m, cpu) if not busy else max(on_cpu(m, bh), self._seconds(busy, bp))
        out = [Choice("fill", m, filled(m + busy, fill)), Choice("cpu", 0, alone_cpu)]
        extra = round(cpu_extra * bh / self.expert_bytes) if cpu_extra > 0 else 0  # the handoff in experts
        lag = fill_lag * bp / self.expert_bytes if 0 < bp < math.inf else 0.0  # the lag in experts at B_P
        q = q_balanced(m + extra, bp, bh, head=busy + lag)  # the fills' work besides their own: busy and the lag
        if 0 < q < m:
            out.insert(0, Choice("split", q, max(filled(q + busy, bp), on_cpu(m - q, bh))))
        return out

    def best(self, m: int, busy: int = 0, cpu_extra: float = 0.0, per: float = 1.0,
             fill_lag: float = 0.0) -> Choice:
        """The fastest predicted choice for m misses; no side effects."""
        if m <= 0:
            return Choice("none", 0, 0.0)
        return _fastest(self.options(m, busy, cpu_extra, per, fill_lag))

    def choose(self, m: int, busy: int = 0, cpu_extra: float = 0.0, per: float = 1.0,
               fill_lag: float = 0.0) -> Choice:
        """The split for this call's m misses (busy, cpu_extra, fill_lag: as in options): the fastest predicted, or
        on schedule one due for re-measuring."""
        if m <= 0:
            return Choice("none", 0, 0.0)
        options = self.options(m, busy, cpu_extra, per, fill_lag)
        pick = _fastest(options)
        due = self._due(options, pick) if m >= self.explore_min and not self.estimate.frozen else []
        if due:
            pick = min(due, key=lambda c: self._last_used[c.arm])._replace(explored=True)
            self.explored += 1
        self._decisions += 1
        self._last_used[pick.arm] = self._decisions
        self.counts[pick.arm] += 1
        return pick

    def _due(self, options: list[Choice], best: Choice) -> list[Choice]:
        """Choices taken fewer than `explore_first` times (the profile may be far off, and a path's first
        call pays one-time costs), or untaken for explore_every x (their predicted time / the best's) calls.
        Re-measuring one then costs under 1 / explore_every of the calls' time however slow it is, and a
        choice predicted 8x slower is still re-measured every 8 * explore_every calls: a path that got
        faster is found."""
        if best.seconds <= 0:
            return []
        return [c for c in options if c.arm != best.arm and (self.counts[c.arm] < self.explore_first or
                self._decisions - self._last_used[c.arm] >= self.explore_every * c.seconds / best.seconds)]

    def observe(self, path: str, nbytes: int, seconds: float, together: bool, per: float = 1.0) -> None:
        """A measured fill ("fill") or CPU run ("cpu") of nbytes; together: the other path ran alongside; per:
        (token, expert) pairs per expert of a CPU run."""
        if not self.estimate.frozen:
            self._rate(path, together, per).add(nbytes, seconds, self._decisions,
                                                sample_weight(nbytes, self.expert_bytes))

    def fill_rate(self) -> float:
        """Bytes/s the fills reach while the CPU runs beside them."""
        return self._value("fill", True)

    def cpu_share(self, m: int = CPU_SHARE_M) -> float:
        """Fraction of m misses the current rates would run on the CPU."""
        return 1.0 - self.best(m).q / m

    def stats(self) -> dict:
        rates = {f"{path}_{'together' if t else 'alone'}": r.value for (path, t), r in self.rates.items()}
        rates.update({f"{path}_{'together' if t else 'alone'}_per{2 ** b}": r.value
                      for (path, t, b), r in sorted(self._per_rates.items()) if r.samples})
        return {"arms": dict(self.counts), "explored": self.explored, "rates": rates}

    def _seconds(self, n: int, rate: float) -> float:
        return n * self.expert_bytes / rate if rate > 0 else math.inf


HYBRID_MIN_BH = 0.5  # B_H / B_P from which `auto` picks hybrid


def _fastest(options: list[Choice]) -> Choice:
    return min(options, key=lambda c: c.seconds)  # ties: the earlier option (split, then fill)


def choose_backend(*, dense: bool, pool_bytes: int, free_bytes: int, profile: dict | None) -> str:
    """`--moe-backend auto`: dense -> fused; experts fit -> fused; else offload, hybrid if the CPU pays.

    Fills and CPU runs proceed at once, so a balanced split serves misses (B_P + B_H) / B_P times faster
    than filling them all, before contention. The CPU pays, by this machine's bench profile, from
    B_H >= B_P / 2 (1.5x before contention): both paths read the same host DRAM, a miss run on the CPU
    leaves the cache as cold for the next step as it found it, and re-measuring the choices not taken
    costs a few slow layer calls, so a smaller gain is not worth leaving offload for. Without a profile
    we stay on offload, the safe choice."""
    if dense or pool_bytes <= free_bytes:
        return "fused"
    if profile and profile.get("bp") and profile.get("bh") and profile["bh"] >= HYBRID_MIN_BH * profile["bp"]:
        return "hybrid"
    return "offload"


def slots_spec(text: str) -> str:
    """`--moe-slots` as given, checked: a count of at least 1 or a percentage in (0, 100] (ValueError naming the
    flag and the forms it takes)."""
    body = text[:-1] if text.endswith("%") else text
    try:
        value = float(body) if text.endswith("%") else int(body)
    except ValueError:
        value = None
    if value is None or (text.endswith("%") and not 0 < value <= 100) or (not text.endswith("%") and value < 1):
        raise ValueError(f"--moe-slots takes a count of at least 1 or a share of the experts in (0, 100]% "
                         f"(e.g. 37.5%), got {text!r}")
    return text


def slots_from_spec(spec: str | int | None, *, total_experts: int, expert_bytes: int,
                    free_bytes: int) -> int:
    """Slot count from `--moe-slots N`, `N%` of all experts (at least one slot), or None (all the memory left,
    capped)."""
    if spec is None:
        n = free_bytes // expert_bytes
        if n < 1:
            raise ValueError(f"the expert cache needs at least 1 slot ({expert_bytes} bytes each) and the device has "
                             f"{free_bytes} bytes left: free device memory or lower the KV budget")
    elif isinstance(spec, str) and spec.endswith("%"):
        n = max(1, int(round(total_experts * float(slots_spec(spec)[:-1]) / 100)))
    else:
        n = int(spec)
        if n < 1:
            raise ValueError(f"--moe-slots needs at least 1 slot, got {spec} (or give a share of the experts: 37.5%)")
    return min(n, total_experts)


class ShareSearch:
    """The CPU's share of a graphed decode step's misses (graph_cpu.py), by the measured step time.

    Inside one CUDA graph the host cannot time the two paths separately, only whole steps; the step is
    fastest where the CPU's share finishes about when the device's does, which contention for the host's
    DRAM and the device's fixed per-layer work move away from B_H / (B_H + B_P). Step times drift by more than
    the differences between nearby shares (H200 box, 8 layers, b1: one share pinned per run, 277-341 tok/s
    in no order across shares 0.45-0.80; a climb on medians of 8-step windows ended anywhere in 0.30-0.67), so
    the search compares in pairs: it runs the best share and a probe `step` away in turn, step by step, in
    the order best, probe, probe, best (a drift weighs on both alike), and after `pairs` pairs (`coarse_pairs`
    while the step is longer than `min_step`; by default as many: with 4 the box's short runs lost 8-9% at b1
    and b4 to early moves on noise, docs/PERF.md twenty-second session) takes the median of the probe's
    relative difference. Faster by more than `margin`: the probe becomes the best and the climb goes on that
    way, its step doubling back up to the first. Else it turns; with both sides tried it halves its step
    (down to `min_step`), and once both sides failed at the smallest step it rests at the best for `rest`
    steps, then probes again from the first step (near a far optimum a short step's difference hides under
    the margin), so it keeps tracking as the cache warms or the load changes at a small cost. Simulated with
    the box's slopes (as tests/engine/test_experts_split_policy.py; 300 seeds, optima 0.3-0.8, starts
    0.05-0.8, 1,200 steps): with 2% noise a step, within 0.04 of the optimum, 1.3% of the step time lost to
    probing over the last 300 steps; with 8%, within 0.16 (4 coarse pairs: up to 0.48, some runs stuck). A
    pair whose slower step took over `outlier` times the faster (a prefill in between) is left out; a step of
    a different batch size starts the comparison over at the best."""

    def __init__(self, start: float, *, lo: float = 0.0, hi: float = 0.9, step: float = 0.08,
                 min_step: float = 0.03, pairs: int = 12, coarse_pairs: int | None = None, margin: float = 0.01,
                 rest: int = 160, outlier: float = 3.0) -> None:
        if pairs < 1 or not 0 < min_step <= step:
            raise ValueError("ShareSearch: pairs >= 1 and 0 < min_step <= step")
        self.lo, self.hi = lo, hi
        self.best = min(hi, max(lo, start))
        self.step, self.min_step, self.max_step = step, min_step, step
        self.pairs, self.margin, self.rest, self.outlier = pairs, margin, rest, outlier
        self.coarse_pairs = pairs if coarse_pairs is None else coarse_pairs
        # the first probe goes below the start: the rates' balance, which contention can leave too high (H200
        # box, 8 threads: 0.40 best from a start of 0.45); with 16 threads the optimum lay above it (0.65-0.85
        # from 0.47): one comparison's cost either way
        self.direction = -1
        self.moves = 0
        self.rests = 0  # times it settled (both sides lost at the smallest step): its best is then worth keeping
        self._rows: int | None = None
        self._failed = 0  # sides that lost at this step size
        self._resting = 0
        self._begin()

    @property
    def share(self) -> float:
        """The share the next step runs at."""
        return self.probe if self.probe is not None and self._k % 4 in (1, 2) else self.best

    def observe(self, seconds: float, rows: int) -> float:
        """One decode step of `rows` sequences took `seconds` (at the share this gave for it); -> the share for
        the next step."""
        if rows != self._rows:
            self._rows = rows
            self._begin()
            return self.share
        if self.probe is None:
            self._resting -= 1
            if self._resting <= 0:  # probe again from the longest stride: a far optimum shows there
                self.step = self.max_step
                self._begin()
            return self.share
        pos, self._k = self._k % 4, self._k + 1
        if pos in (0, 2):
            self._first = seconds
        else:
            best, probe = (self._first, seconds) if pos == 1 else (seconds, self._first)
            if max(best, probe) <= self.outlier * min(best, probe):
                self._diffs.append(probe / best - 1)
            if len(self._diffs) >= (self.pairs if self.step <= self.min_step else self.coarse_pairs):
                self._decide(sorted(self._diffs)[len(self._diffs) // 2])
        return self.share

    def _decide(self, diff: float) -> None:
        if diff < -self.margin:  # the probe is faster: move there, and on the same way in longer strides
            self.best, self._failed = self.probe, 0
            self.moves += 1
            self.step = min(self.max_step, 2 * self.step)
        else:
            self.direction, self._failed = -self.direction, self._failed + 1
            if self._failed >= 2:
                self._failed = 0
                if self.step > self.min_step:
                    self.step = max(self.min_step, self.step / 2)
                else:
                    self._rest()
        self._begin()

    def _rest(self) -> None:
        self._resting = self.rest
        self.rests += 1

    def _begin(self) -> None:
        """A fresh comparison of the best and the next probe (none while resting or with nowhere to go)."""
        self._k, self._first, self._diffs = 0, 0.0, []
        self.probe = None if self._resting > 0 else self._next()
        if self.probe is None and self._resting <= 0:
            self._rest()

    def _next(self) -> float | None:
        for d in (self.direction, -self.direction):
            nxt = round(min(self.hi, max(self.lo, self.best + d * self.step)), 4)
            if nxt != self.best:
                self.direction = d
                return nxt
        return None
