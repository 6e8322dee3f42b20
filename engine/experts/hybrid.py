"""`--moe-backend hybrid`: of a step's m misses, q* are filled and run on the device while the other
m - q* run on the CPU concurrently; the partial sums are added (FreeToken).

q* comes from the running B_P / B_H estimate (policy.BandwidthEstimate), seeded from the bench profile;
`estimate.frozen = True` keeps the profile's split."""
from __future__ import annotations

from engine.experts.offload import OffloadBackend
from engine.experts.policy import q_star


class HybridBackend(OffloadBackend):
    name = "hybrid"

    def split(self, m: int) -> int:
        return self.estimate.q(m)

    def cpu_share(self) -> float:
        m = 64  # share at a representative miss count
        return 1.0 - q_star(m, self.estimate.bp, self.estimate.bh) / m
