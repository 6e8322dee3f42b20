"""The expert math every backend shares, so where an expert runs never changes the output.

T = tokens, K = experts per token, H = hidden, I = expert intermediate, n = tokens routed to one expert.
Each backend writes expert outputs into y [T*K, H] at the (token, k) positions routed to that expert;
`combine` then sums over k in a fixed order, so hits, fills and CPU runs add up bit-identically.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.mlp import swiglu_fused as expert_mlp  # x [n, H], gate_up [2I, H], down [H, I] -> [n, H]


@dataclass
class Routing:
    """Routed experts of one layer step, grouped on the host (positions are flat t * K + k, on CPU)."""

    top_k: int
    experts: list[int]  # distinct experts, ascending
    counts: list[int]  # (token, k) pairs per expert
    positions: list[torch.Tensor]  # LongTensor [n_e] per expert
    unrouted: int = 0  # pairs with id -1 (a padding row's): no expert, their rows of y must read zero

    @staticmethod
    def of(topk_ids: torch.Tensor) -> "Routing":
        flat = topk_ids.reshape(-1).to("cpu", torch.long)  # [T*K]
        order = torch.argsort(flat, stable=True)
        uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
        experts, counts = uniq.tolist(), counts.tolist()
        positions = list(torch.split(order, counts))
        unrouted = 0
        if experts and experts[0] < 0:  # sorted first; an expert id of its own would index the last expert
            unrouted = counts[0]
            experts, counts, positions = experts[1:], counts[1:], positions[1:]
        return Routing(topk_ids.shape[1], experts, counts, positions, unrouted)

    def rows(self, e_index: int) -> torch.Tensor:
        return self.positions[e_index] // self.top_k  # token of each routed position


def run_expert(y: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, top_k: int, gate_up, down) -> None:
    """y [T*K, H] at pos <- expert(x[token of pos]); pos already on x's device."""
    y[pos] = expert_mlp(x[pos // top_k], gate_up, down).to(y.dtype)


def combine(y: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """y [T*K, H], topk_w [T, K] -> [T, H]: weighted sum over k in fp32, in k order."""
    t, k = topk_w.shape
    out = y.view(t, k, -1).float() * topk_w.float().unsqueeze(-1)
    return out.sum(dim=1).to(y.dtype)
