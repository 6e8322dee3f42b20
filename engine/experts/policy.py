"""How many missing experts to copy to the device (q*), the running bandwidth estimate, and `auto`.

Torch-free. B_P = pinned host->device expert bandwidth, B_H = host-side expert kernel bandwidth (bytes/s).
FreeToken's rule q* = round(m * B_P / B_H): with B_P >= B_H every miss is filled (offload); on a laptop
(B_P 12, B_H 48 GB/s) a quarter is. A pure time balance would give m * B_P / (B_P + B_H); the paper's form
leans towards fills, which also warm the cache for the next step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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

    def observe_fill(self, nbytes: int, seconds: float) -> None:
        self.bp = self._update(self.bp, nbytes, seconds)

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        self.bh = self._update(self.bh, nbytes, seconds)

    def _update(self, current: float, nbytes: int, seconds: float) -> float:
        if self.frozen or nbytes < self.min_bytes or seconds <= 0:
            return current
        return (1 - self.alpha) * current + self.alpha * (nbytes / seconds)

    def q(self, m: int) -> int:
        return q_star(m, self.bp, self.bh)


def choose_backend(*, dense: bool, pool_bytes: int, free_bytes: int, profile: dict | None) -> str:
    """`--moe-backend auto`: dense -> fused; experts fit -> fused; else offload, hybrid if the CPU pays.

    The CPU pays when, by this machine's bench profile, q* would send some misses of a full decode step
    to the CPU (B_H > B_P: the split then shortens miss service by up to B_H / B_P); without a profile
    we stay on offload, the safe choice."""
    if dense or pool_bytes <= free_bytes:
        return "fused"
    if profile and profile.get("bp") and profile.get("bh") and q_star(64, profile["bp"], profile["bh"]) < 64:
        return "hybrid"
    return "offload"


def slots_from_spec(spec: str | int | None, *, total_experts: int, expert_bytes: int,
                    free_bytes: int) -> int:
    """Slot count from `--moe-slots N`, `N%` of all experts, or None (all the memory left, capped)."""
    if spec is None:
        n = free_bytes // expert_bytes
    elif isinstance(spec, str) and spec.endswith("%"):
        pct = float(spec[:-1])
        if not 0 < pct <= 100:
            raise ValueError(f"--moe-slots percentage must be in (0, 100], got {spec}")
        n = int(round(total_experts * pct / 100))
    else:
        n = int(spec)
    if n < 1:
        raise ValueError(f"the expert cache needs at least 1 slot ({expert_bytes} bytes each); "
                         f"got {n}: free device memory or lower the KV budget")
    return min(n, total_experts)
