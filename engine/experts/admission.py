"""The mapped decode's cache keeping, torch-free: what a step's routes count, which misses move into slots.

A mapped decode (engine/experts/mapped.py) reads a missing expert in place over PCIe; copying it into a slot
costs the bytes of one such read and evicts a resident. So after each step the hottest misses are paired with
the slots the policy evicts first, and a pair is taken while the slot is free or the miss is hotter than the
slot's expert by `ratio`: under uniform routing almost nothing moves, under skewed routing the popular experts
move in and stay. The engine (MappedExperts) and the simulation (placement.mapped_hits) both call these two
functions, so `bench routing` predicts what the engine does.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine.experts.lru import SlotTable

ADMIT_RATIO = 2.0  # a missed expert replaces a resident one when its heat is this many times the victim's
MAX_FILLS = 8  # experts admitted per step at most (about 1 ms of PCIe at the Qwen3.6-35B-A3B width)
CPU_RUN = -3  # a `seen` entry for an expert the CPU ran (hybrid, graph_cpu.py): moe_pairs_triton.LOC_CPU


class LayerStep(NamedTuple):
    hits: int  # distinct experts the kernels found in slots
    misses: int  # distinct experts not in slots (read in place, or run by the CPU)
    reads: int  # (token, expert) pairs read in place: a batch reads a missing expert once per token routed to it
    candidates: list  # (heat, row, expert) of misses that may move into a slot
    cpu: int = 0  # (token, expert) pairs the CPU ran instead (entries CPU_RUN)


def observe_layer(table: SlotTable, row: int, ids: np.ndarray, seen: np.ndarray) -> LayerStep:
    """One MoE layer of a step: ids = its routed expert ids (any shape; ids < 0 are padding), seen [E] = the
    slot each expert was read from (< 0: in place; CPU_RUN: run by the CPU), as the kernels saw the table.
    Ticks the table and notes the use (heat), touches the hits."""
    ids = ids.ravel()
    ids = ids[(ids >= 0) & (ids < len(seen))]
    if not len(ids):
        return LayerStep(0, 0, 0, [])
    experts, counts = np.unique(ids, return_counts=True)
    table.tick()
    table.note_use(row, experts)
    where = seen[experts]
    hit = where >= 0
    table.touch(where[hit])
    missed = experts[~hit]
    missed = missed[table.resident[row, missed] < 0]  # not already on its way into a slot
    cpu = int(counts[where == CPU_RUN].sum())
    return LayerStep(int(hit.sum()), int((~hit).sum()), int(counts[~hit].sum()) - cpu,
                     [(table.heat[row, e], row, int(e)) for e in missed], cpu)


def admissions(table: SlotTable, candidates: list, max_fills: int | None = None,
               ratio: float | None = None) -> list[tuple[int, int, int]]:
    """(row, expert, slot) to copy: the hottest candidates against the policy's first victims, while it pays.
    Does not change the table (the caller assigns what it copies). None: MAX_FILLS / ADMIT_RATIO."""
    max_fills = MAX_FILLS if max_fills is None else max_fills
    ratio = ADMIT_RATIO if ratio is None else ratio
    candidates = sorted(candidates, reverse=True)[:max_fills]
    victims = table.victims(len(candidates)).tolist()
    chosen = []
    for (heat, row, e), s in zip(candidates, victims):
        if table.owner[s] >= 0 and heat <= ratio * table.slot_heat[s]:
            break  # victims come coldest first, candidates hottest first: no later pair pays either
        chosen.append((row, e, s))
    return chosen


def visible(table: SlotTable, in_flight) -> np.ndarray:
    """[L, E] int32: each expert's slot as the kernels may read it, -1 where it is not resident or its copy
    (row, expert, slot) in `in_flight` has not landed."""
    res = table.resident
    out = np.where(res >= 0, res, -1).astype(np.int32)
    for row, e, s in in_flight:
        if out[row, e] == s:
            out[row, e] = -1
    return out
