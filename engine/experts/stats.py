"""Per-layer and total expert-cache counters for engine stats. Torch-free."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

FIELDS = ("hits", "misses", "fills", "cpu_runs", "cpu_seconds", "bytes_moved", "direct_reads", "bytes_read",
          "guesses", "guesses_right", "bytes_guessed", "ahead", "ahead_used", "refreshed")


@dataclass
class LayerStats:
    hits: int = 0  # (step, expert) pairs found resident
    misses: int = 0  # (step, expert) pairs not resident when routed
    fills: int = 0  # experts copied host -> slot (misses filled and streamed prefill layers)
    cpu_runs: int = 0  # (step, expert) pairs run on the CPU from the host pool
    cpu_seconds: float = 0.0  # how long a layer call's CPU jobs ran (not a mapped decode's share in its graph)
    bytes_moved: int = 0  # host -> device bytes copied into slots
    direct_reads: int = 0  # (token, expert) pairs whose weights a mapped decode read in place from the host pool
    bytes_read: int = 0  # host bytes those in-place reads took over PCIe (a right guess's gate/up among them)
    guesses: int = 0  # steps whose likely expert a mapped decode prefetched before the layer's routing was known
    guesses_right: int = 0  # of those, the steps that then routed to it
    bytes_guessed: int = 0  # host bytes the guesses copied (a wrong one's are PCIe traffic the misses did not need)
    ahead: int = 0  # experts a routed prompt copied in before the layer's routing was known (counted in fills)
    ahead_used: int = 0  # of those, the ones the layer then routed to (the others are fills it did not need)
    refreshed: int = 0  # experts idle time moved into slots (OffloadBackend.refresh; counted in fills)

    def add(self, other: "LayerStats") -> None:
        for f in FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))


class ExpertStats:
    def __init__(self, layers) -> None:
        self.layers = {int(layer): LayerStats() for layer in layers}

    def __getitem__(self, layer: int) -> LayerStats:
        return self.layers[layer]

    def total(self) -> LayerStats:
        out = LayerStats()
        for s in self.layers.values():
            out.add(s)
        return out

    def as_dict(self) -> dict:
        def row(s: LayerStats) -> dict:
            d = asdict(s)
            d["hit_rate"] = s.hits / (s.hits + s.misses) if s.hits + s.misses else 0.0
            return d

        return {"total": row(self.total()), "layers": {k: row(v) for k, v in self.layers.items()}}

    def reset(self) -> None:
        for k in self.layers:
            self.layers[k] = LayerStats()


class LayerCall(NamedTuple):
    """One MoE layer call of an expert cache, as OffloadBackend.call_log records it (profile_decode --extend):
    its plan and where the host's time went, in ms from the call's start."""

    layer: int
    # "routed" (its routing read back: fills and CPU runs planned), "joined" (routed, its CPU job joined on the
    # device: the cpu fields filled in when collected) or "unread" (every expert in a slot)
    kind: str
    hits: int  # -1: not read back (unread)
    misses: int
    fills: int  # of the misses, copied in now
    cpu: int  # of the misses, run on the CPU
    ahead: int  # the next layer's experts copied in while this one runs
    behind: int  # experts' worth of copies still in flight that this call's plan counted (SlotCache.copy_backlog)
    handoff_ms: float  # the CPU's idle time per call the split counted (hybrid)
    at: float  # perf_counter seconds when the call started
    routed_ms: float  # when the routing was back on the host
    cpu_start_ms: float  # when the CPU job started (-1: none)
    cpu_ms: float  # its run
    cpu_wait_ms: float  # the engine thread's wait for it
    end_ms: float  # when the call returned
    # when its split was made, the CPU job about to start; an unread call's: when its begin (a forward's first
    # call: the deferred one) and its slot table were done, its experts about to be queued
    planned_ms: float = -1.0
    # when the engine thread took the CPU job's result in (-1: none); a joined job's: in the next routed call, once
    # that call's own job was posted
    woke_ms: float = -1.0
    ran_ms: float = -1.0  # when the device's hits and fills were queued (an unread call's: its experts)
    queued_ms: float = -1.0  # when the next layer's copies ahead were queued too
    # a prompt's last routed layer: how long after its CPU job ended its fills landed (negative: the device waited
    # that long for the job; hybrid.TailClock), in ms; nan: not measured
    tail_ms: float = float("nan")
    copies: int = -1  # copy calls the layer call issued (SlotCache.copy_calls: one a run; -1: not counted)


class CpuWait(NamedTuple):
    """A routed layer call's CPU job as the engine thread saw it (the call log's; None without one)."""

    started: float | None  # perf_counter when the job began
    seconds: float | None  # its run
    waited: float | None  # the engine thread's wait for its result
    woke: float | None  # perf_counter when the engine thread had it
    joined: bool = False  # joined on the device, not waited for: the rest is filled in when it is collected


NO_CPU = CpuWait(None, None, None, None)
