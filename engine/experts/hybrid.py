"""`--moe-backend hybrid`: of a layer call's m misses, q are filled and run on the device while the other
m - q run on the CPU concurrently; the partial sums are added (FreeToken).

q comes from policy.SplitPolicy: the balanced split q = round(m * B_P / (B_P + B_H)) at the rates both paths
reach together, or every miss one way when a path alone is predicted faster, by the fills and CPU runs this
backend measures (seeded from the estimate, i.e. the bench profile). `estimate.frozen = True` keeps the rates,
so the split is a fixed function of m. `stats()["split"]` counts the choices taken and the explorations, with the
rates and the touched / predicted experts of routed prompt calls that its copies ahead plan by (TouchRatio).

A prompt's last routed layer (no copies ahead after it: every later layer holds all its experts) ends the CPU's
work in the forward, and the layers after it run once both its paths are done; its rates are the ones the layers
before it measured, where copies ahead also run through the CPU's idle handoffs. Its split learns from the device
how much later its fills landed than its CPU job ended (TailClock). A profile had read that layer's fills as
landing ~3 ms after the job; the clock's own measure on the box found them within 1.5 ms of it, settling at -0.4 ms
(H100 box, docs/PERF.md forty-seventh and forty-eighth sessions)."""
from __future__ import annotations

from engine.experts.offload import OffloadBackend
from engine.experts.policy import SplitPolicy

TAIL_GAIN = 0.5  # of a measured lag, the share the next last routed layer's split counts in addition
TAIL_BOUND = 0.02  # seconds: the lag counted, either way, at most
TAIL_FORGET = 0.1  # of the lag counted, the share a tail call that measured none forgets


class TailClock:
    """The seconds a prompt's last routed layer's fills land after its CPU job ends (negative: before), as its
    split is to count them (SplitPolicy's fill_lag). Each measured lag adds TAIL_GAIN of itself, so the count
    climbs to the lag the rates leave and stays there as the lag it measures goes to zero (within TAIL_BOUND)."""

    def __init__(self, gain: float = TAIL_GAIN, bound: float = TAIL_BOUND) -> None:
        self.gain, self.bound = gain, bound
        self.lag = 0.0  # counted by the next such split
        self.samples = 0
        self.last = 0.0  # the last lag measured

    def observe(self, lag: float) -> None:
        """The fills landed `lag` seconds after the CPU job ended (negative: the device waited for the job)."""
        self.last, self.samples = lag, self.samples + 1
        self.lag = min(self.bound, max(-self.bound, self.lag + self.gain * lag))

    def forget(self) -> None:
        """Such a layer ran without a lag to measure (no fills beside a CPU job): the count shrinks by TAIL_FORGET of
        itself, so one that sent every miss one way comes back to a split, in time, and is measured again."""
        self.lag *= 1.0 - TAIL_FORGET

    def stats(self) -> dict:
        return {"lag_ms": self.lag * 1e3, "last_ms": self.last * 1e3, "samples": self.samples}


class HybridBackend(OffloadBackend):
    name = "hybrid"
    uses_handoff = True
    runs_cpu_share = True

    def __init__(self, pool, num_slots: int, device="cpu", **kw) -> None:
        super().__init__(pool, num_slots, device, **kw)
        self.policy = SplitPolicy(self.estimate, pool.expert_bytes)
        self.tail = TailClock()

    def split(self, m: int, busy: int = 0, per: float = 1.0, tail: bool = False) -> int:
        # with copies ahead the copy engine runs through the layer's handoff, and the CPU waits it out
        return self.policy.choose(m, busy, self.handoff if busy else 0.0, per, self.tail.lag if tail else 0.0).q

    def ahead_fills(self, expected: float, likely: int, per: float = 1.0, behind: int = 0) -> int:
        """The fill share of the next layer's expected misses, the CPU's handoff and the copies still in flight
        counted: copied ahead, they leave that layer's CPU the rest, and this layer's split counts them as the
        copy stream's (split's busy)."""
        return min(likely, self.policy.best(round(expected), busy=behind, cpu_extra=self.handoff, per=per).q)

    def fill_rate(self) -> float:
        return self.policy.fill_rate()

    def cpu_share(self) -> float:
        return self.policy.cpu_share()

    def observe(self, path: str, nbytes: int, seconds: float, together: bool, per: float = 1.0) -> None:
        super().observe(path, nbytes, seconds, together, per)
        self.policy.observe(path, nbytes, seconds, together, per)

    def stats(self) -> dict:
        return {**super().stats(), "split": {**self.policy.stats(), "touch_ratio": dict(self.touch_ratio.values),
                                             "tail": self.tail.stats()}}
