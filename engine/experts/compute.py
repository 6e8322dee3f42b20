"""The expert math every backend shares, so where an expert runs never changes the output.

T = tokens, K = experts per token, H = hidden, I = expert intermediate, n = tokens routed to one expert.
Each backend writes expert outputs into y [T*K, H] at the (token, k) positions routed to that expert;
`combine` then sums over k in a fixed order, so hits, fills and CPU runs add up bit-identically.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.layers.mlp import swiglu_fused as expert_mlp  # x [n, H], gate_up [2I, H], down [H, I] -> [n, H]


class Routing:
    """Routed experts of one layer step, grouped on the host (positions are flat t * K + k, on CPU).

    Grouped with numpy: at decode sizes each torch op on a small CPU tensor costs more than the work, and a
    backend calls this once per MoE layer per step. An expert's positions are a view made when asked for
    (the grouped device kernels never ask)."""

    __slots__ = ("top_k", "experts", "counts", "unrouted", "_order", "_starts")

    def __init__(self, top_k: int, experts: np.ndarray, counts: np.ndarray, order: np.ndarray,
                 starts: np.ndarray, unrouted: int = 0) -> None:
        self.top_k = top_k
        self.experts = experts  # [n] int64: the distinct experts, ascending
        self.counts = counts  # [n] int64: (token, k) pairs per expert
        self.unrouted = unrouted  # pairs with id -1 (a padding row's): no expert, their rows of y read zero
        self._order, self._starts = order, starts

    def position(self, i: int) -> torch.Tensor:
        """LongTensor [n] of the flat positions routed to experts[i] (a view of the sort order)."""
        a = self._starts[i]
        return torch.from_numpy(self._order[a: a + self.counts[i]])

    @staticmethod
    def of(topk_ids: torch.Tensor) -> "Routing":
        flat = topk_ids.reshape(-1).to("cpu", torch.long).numpy()  # [T*K]
        # stable: each expert's positions in order; as int16 (ids < 32768) numpy sorts by radix, ~4x faster
        order = np.argsort(flat.astype(np.int16) if len(flat) and flat.max() < 1 << 15 else flat, kind="stable")
        ids = flat[order]
        cut = np.flatnonzero(np.diff(ids)) + 1
        starts = np.concatenate(([0], cut)) if len(ids) else cut
        counts = np.diff(np.concatenate((starts, [len(ids)])))
        experts = ids[starts]
        unrouted = 0
        if len(experts) and experts[0] < 0:  # sorted first; an expert id of its own would index the last expert
            unrouted = int(counts[0])
            experts, starts, counts = experts[1:], starts[1:], counts[1:]
        return Routing(topk_ids.shape[1], experts, counts, order, starts, unrouted)

    def pairs(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(flat positions [N] int64, expert id of each [N] int64) of experts[i] for i in `indices`, expert by
        expert: a CPU job's pairs in two arrays (cpu_runner.Pairs), with no tensor an expert."""
        indices = np.asarray(indices, dtype=np.int64)
        counts = self.counts[indices]
        # pair j of the run: the expert's first place in the sort order, plus j less the pairs before its expert
        ends = np.cumsum(counts)
        at = np.repeat(self._starts[indices] - (ends - counts), counts) + np.arange(ends[-1] if len(ends) else 0)
        return self._order[at].astype(np.int64, copy=False), np.repeat(self.experts[indices], counts)

    def rows(self, e_index: int) -> torch.Tensor:
        return self.position(e_index) // self.top_k  # token of each routed position


def run_expert(y: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, top_k: int, gate_up, down) -> None:
    """y [T*K, H] at pos <- expert(x[token of pos]); pos already on x's device."""
    y[pos] = expert_mlp(x[pos // top_k], gate_up, down).to(y.dtype)


def combine(y: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """y [T*K, H], topk_w [T, K] -> [T, H]: weighted sum over k in fp32, in k order. On CUDA one Triton launch
    (engine/kernels/combine_triton.py) for torch's five, each queued by the host in every layer call."""
    if y.is_cuda:
        from engine.kernels.combine_triton import combine_rows

        return combine_rows(y, topk_w)
    t, k = topk_w.shape
    out = y.view(t, k, -1).float() * topk_w.float().unsqueeze(-1)
    return out.sum(dim=1).to(y.dtype)
