"""How much of a decode's expert traffic the GPU holds: killick's slot cache against llama.cpp's static
placement at equal GPU memory, simulated on a routing trace. Torch-free (numpy).

trace: int array [T, L, K], the K expert ids each of T tokens routes to in each of L MoE layers, in decode
order (a prefill over a stream routes exactly as decoding it token by token would). E = experts per layer.
Hit rate = routed (token, layer, expert) triples served from GPU memory / all of them.

- The slot cache (`slot_hits`): one pool of `slots` slots shared by all layers, lru.SlotTable's policy (lru or
  lfu) exactly as OffloadBackend.forward drives it at batch 1 with every miss filled (offload): per layer step
  tick, note the routed experts' use, look up, touch and lock the hits, take the policy's victims for the
  misses (hottest miss first), unlock.
- llama.cpp `--n-cpu-moe N` (`static_hits`): the experts of the first N layers stay in host memory, every other
  layer's experts are on the GPU (common/arg.cpp: tensor overrides for blocks 0..N-1). Its GPU memory is
  (L - N) * E experts, so `equal_memory` gives the LRU that many slots. Skew cannot help it: a layer is all in
  or all out, so its hit rate is (L - N) / L whatever the routing.
- The mapped decode (`mapped_hits`): the same table kept by admission.py's rules as MappedExperts keeps it —
  misses read in place, the hottest moved into a slot only over a clearly colder resident, an admitted
  expert readable two steps after the one that routed to it (its routes are taken in while the next step
  runs, its copy lands while the one after runs). Also counts the fills:
  a mapped decode's PCIe bytes are its in-place reads plus its fills.
- `top_experts_hits`: an oracle that keeps the `slots` most used (layer, expert) pairs of the trace itself
  resident; no engine can place experts knowing the future, and llama.cpp cannot place single experts at all
  (a layer's experts are one tensor). It bounds what any static per-expert placement could reach.
"""
from __future__ import annotations

import numpy as np

from engine.experts import admission
from engine.experts.lru import HALF_LIFE, SlotTable


def equal_memory(num_layers: int, gpu_fraction: float) -> int:
    """llama.cpp's --n-cpu-moe N whose GPU expert memory is nearest `gpu_fraction` of all experts."""
    if not 0 <= gpu_fraction <= 1:
        raise ValueError(f"the GPU expert fraction must be between 0 and 1, got {gpu_fraction}")
    return num_layers - int(round(gpu_fraction * num_layers))


def _check(trace: np.ndarray, warmup: int) -> np.ndarray:
    trace = np.asarray(trace, dtype=np.int64)
    if trace.ndim != 3:
        raise ValueError(f"a routing trace is [tokens, layers, top-k], got shape {trace.shape}")
    if not 0 <= warmup < trace.shape[0]:
        raise ValueError(f"warm-up must leave tokens to count: {warmup} of {trace.shape[0]}")
    return trace


def slot_hits(trace, num_experts: int, slots: int, warmup: int = 0, policy: str = "lru",
              half_life: float = HALF_LIFE) -> tuple[int, int]:
    """(hits, routed) of the slot cache over trace[warmup:], the cache warmed by trace[:warmup]."""
    trace = _check(trace, warmup)
    T, L, _ = trace.shape
    table = SlotTable(L, num_experts, slots, policy, half_life)
    hits = routed = 0
    for t in range(T):
        for layer in range(L):
            experts = np.unique(trace[t, layer])
            table.tick()
            table.note_use(layer, experts)
            found = table.lookup(layer, experts)
            hit = found >= 0
            table.touch(found[hit])
            table.lock(found[hit])
            want = experts[~hit]
            want = want[np.argsort(-table.heat[layer, want], kind="stable")]  # hottest first, as the backend fills
            victims = table.victims(len(want))
            if len(victims) < len(want):
                raise ValueError(f"{slots} slots cannot hold one layer step's {len(want)} missing experts")
            for e, s in zip(want.tolist(), victims.tolist()):
                table.assign(s, layer, e)
            table.lock(victims)
            table.unlock_all()
            if t >= warmup:
                hits += int(hit.sum())
                routed += len(experts)
    return hits, routed


def mapped_hits(trace, num_experts: int, slots: int, warmup: int = 0, policy: str = "lfu",
                half_life: float = HALF_LIFE, lag: int = 1, in_flight: bool = True) -> tuple[int, int, int]:
    """(hits, routed, fills) of the mapped decode over trace[warmup:], warmed by trace[:warmup], batch 1.

    lag: steps between a step and the one whose table first holds its admissions. MappedExperts takes a
    step's routes in (and admits) while the next step runs (1); that next step still reads the victims from
    their slots. in_flight: an admission's copy runs beside the step after it was made (CUDA), which reads
    the newcomer in place; False: a CPU device copies in line."""
    trace = _check(trace, warmup)
    T, L, _ = trace.shape
    table = SlotTable(L, num_experts, slots, policy, half_life)
    hits = routed = fills = 0
    pushed = [admission.visible(table, [])] * (lag + 1)  # the tables of the next lag + 1 steps, oldest first
    for t in range(T):
        seen = pushed.pop(0)
        candidates, step_hits, step_routed = [], 0, 0
        for layer in range(L):
            step = admission.observe_layer(table, layer, trace[t, layer], seen[layer])
            candidates += step.candidates
            step_hits += step.hits
            step_routed += step.hits + step.misses
        admitted = admission.admissions(table, candidates)
        for row, e, s in admitted:
            table.assign(s, row, e)
        pushed.append(admission.visible(table, admitted if in_flight else []))
        if t >= warmup:
            hits, routed, fills = hits + step_hits, routed + step_routed, fills + len(admitted)
    return hits, routed, fills


def static_hits(trace, cpu_layers: int, warmup: int = 0) -> tuple[int, int]:
    """(hits, routed) over trace[warmup:] with llama.cpp's --n-cpu-moe cpu_layers: layers 0..N-1 on the CPU."""
    trace = _check(trace, warmup)[warmup:]
    per_layer = np.array([sum(len(np.unique(step)) for step in trace[:, layer]) for layer in range(trace.shape[1])])
    return int(per_layer[cpu_layers:].sum()), int(per_layer.sum())


def top_experts_hits(trace, num_experts: int, slots: int, warmup: int = 0) -> tuple[int, int]:
    """(hits, routed) over trace[warmup:] with its own `slots` most used (layer, expert) pairs resident."""
    trace = _check(trace, warmup)[warmup:]
    T, L, K = trace.shape
    flat = (np.arange(L)[None, :, None] * num_experts + trace).reshape(-1)  # layer * E + expert
    counts = np.bincount(flat, minlength=L * num_experts)
    return int(np.sort(counts)[::-1][:slots].sum()), int(counts.sum())


def popularity(trace, num_experts: int) -> np.ndarray:
    """[L, E] fraction of tokens that route to each expert of each layer."""
    trace = _check(trace, 0)
    T, L, _ = trace.shape
    out = np.zeros((L, num_experts))
    for layer in range(L):
        out[layer] = np.bincount(trace[:, layer].reshape(-1), minlength=num_experts) / T
    return out


def zipf_fit(popularity_by_rank: np.ndarray, first: int = 0) -> float:
    """The exponent a of p ∝ rank^-a fitted (least squares in log-log) to popularity sorted by the intended rank
    (most popular first), from rank index `first` on (skip the capped head); experts never chosen are left out."""
    p = np.asarray(popularity_by_rank, dtype=np.float64)[first:]
    r = np.arange(first + 1, first + 1 + len(p), dtype=np.float64)
    keep = p > 0
    if keep.sum() < 2:
        raise ValueError("a Zipf fit needs at least two experts that were chosen")
    slope = np.polyfit(np.log(r[keep]), np.log(p[keep]), 1)[0]
    return float(-slope)
