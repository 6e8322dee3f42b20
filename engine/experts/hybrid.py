"""`--moe-backend hybrid`: of a layer call's m misses, q are filled and run on the device while the other
m - q run on the CPU concurrently; the partial sums are added (FreeToken).

q comes from policy.SplitPolicy: the balanced split q = round(m * B_P / (B_P + B_H)) at the rates both paths
reach together, or every miss one way when a path alone is predicted faster, by the fills and CPU runs this
backend measures (seeded from the estimate, i.e. the bench profile). `estimate.frozen = True` keeps the rates,
so the split is a fixed function of m. `stats()["split"]` counts the choices taken and the explorations, with the
rates and the touched / predicted experts of routed prompt calls that its copies ahead plan by (TouchRatio)."""
from __future__ import annotations

from engine.experts.offload import OffloadBackend
from engine.experts.policy import SplitPolicy


class HybridBackend(OffloadBackend):
    name = "hybrid"
    uses_handoff = True
    runs_cpu_share = True

    def __init__(self, pool, num_slots: int, device="cpu", **kw) -> None:
        super().__init__(pool, num_slots, device, **kw)
        self.policy = SplitPolicy(self.estimate, pool.expert_bytes)

    def split(self, m: int, busy: int = 0, per: float = 1.0) -> int:
        # with copies ahead the copy engine runs through the layer's handoff, and the CPU waits it out
        return self.policy.choose(m, busy, self.handoff if busy else 0.0, per).q

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
        return {**super().stats(), "split": {**self.policy.stats(), "touch_ratio": dict(self.touch_ratio.values)}}
