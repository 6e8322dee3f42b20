"""`--moe-backend cpu`: misses run on the CPU in place, from the host pool; nothing is filled on a miss.

The slot cache still serves hits (experts streamed there by a long prefill stay resident)."""
from __future__ import annotations

from engine.experts.offload import OffloadBackend


class CpuBackend(OffloadBackend):
    name = "cpu"
    tops_up = False
    runs_cpu_share = True

    def split(self, m: int, busy: int = 0, per: float = 1.0, tail: bool = False) -> int:
        return 0

    def ahead_fills(self, expected: float, likely: int, per: float = 1.0, behind: int = 0) -> int:
        return 0  # nothing is filled

    def cpu_share(self) -> float:
        return 1.0
