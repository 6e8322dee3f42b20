"""Layer-major forwards: a batch's rows cut into pieces that each layer runs in turn before the next layer.

    for a, b in row_pieces(N, piece):                          # [(0, piece), (piece, 2 * piece), ...]
        spans = piece_spans(states, offsets, lengths, layer, a, b)  # each sequence's rows in [a, b)
    with one_expert_pass(experts, N, top_k) as layers_done:    # an expert cache plans for all N tokens
        ...; layers_done(); head                               # the cache's counting overlaps the head
    last_rows(h, offsets, lengths)                             # each sequence's last row, no host sync

An expert cache streams its pool once per forward; a layer-major forward of a whole prompt therefore moves it
once per prompt, while activations and attention stay piece-sized. N = rows of the batch.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.experts.registry import is_expert_cache
from engine.models.state import Span


def row_pieces(n: int, piece: int | None) -> list[tuple[int, int]]:
    """Row ranges [a, b) of a batch of n rows, `piece` rows each (the last one shorter); one range without."""
    if not piece or n <= piece:
        return [(0, n)]
    return [(a, min(a + piece, n)) for a in range(0, n, piece)]


def piece_rows(states: list, offsets: list[int], lengths: list[int], a: int, b: int) -> list[tuple]:
    """(state, offset in the piece, rows, first position) of each sequence with rows in [a, b): offsets relative
    to a, positions moved on by the sequence's rows in earlier pieces."""
    rows = []
    for off, n, st in zip(offsets, lengths, states):
        lo, hi = max(off, a), min(off + n, b)
        if lo < hi:
            rows.append((st, lo - a, hi - lo, st.length + lo - off))
    return rows


def piece_spans(states: list, offsets: list[int], lengths: list[int], index: int, a: int, b: int) -> list[Span]:
    """The Span of each sequence with rows in [a, b), as layer `index` sees the piece (piece_rows)."""
    return [Span(off, n, pos, st.layers[index], st.checkpoint_positions)
            for st, off, n, pos in piece_rows(states, offsets, lengths, a, b)]


@contextmanager
def one_expert_pass(experts, num_tokens: int, top_k: int, span: int = 1):
    """Tell an expert cache that one forward of num_tokens tokens runs through its layers now, however many
    pieces each layer takes (it plans layer streaming for the whole batch); span: the longest sequence's
    tokens (how much time the forward stands for, for the cache's heat); the cache plans at its first layer call
    (begin_forward's defer), while the device runs the layers queued before. Backends without a cache (fused)
    need no notice. Yields layers_done(): called after the last layer is queued, the cache starts the read-back of
    the routing it counts at the end, so the work queued after it (the head) runs while the host counts."""
    if not is_expert_cache(experts):
        yield _nothing
        return
    experts.begin_forward(num_tokens, top_k, hold=True, span=span, defer=True)
    try:
        yield experts.send_back
    finally:
        experts.end_forward()


def _nothing() -> None:
    return None


def last_rows(h: torch.Tensor, offsets: list[int], lengths: list[int]) -> torch.Tensor:
    """Each sequence's last row of h [N, ...] -> [sequences, ...], queued without waiting for the device: one
    sequence's is a slice, several take their index from page-locked memory (an index copied from pageable memory
    waits for all the device's queued work first: after a prompt's layers, their whole time before the head)."""
    ends = [off + n - 1 for off, n in zip(offsets, lengths)]
    if len(ends) == 1:
        return h[ends[0]: ends[0] + 1]
    index = torch.tensor(ends, dtype=torch.long)
    if h.is_cuda:
        index = index.pin_memory().to(h.device, non_blocking=True)
    return h.index_select(0, index)
