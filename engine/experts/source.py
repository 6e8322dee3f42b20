"""ExpertWeights: the routed experts as the loader found them, the one source every expert backend reads.

    source.layers                      # MoE layer indices (decoder layer numbers), ascending
    source.num_experts, source.hidden_size, source.intermediate_size, source.dtype, source.device
    source.gate_up(layer, e) -> [2I, H]   gate rows first, then up rows (the fused checkpoint layout)
    source.down(layer, e)    -> [H, I]
    source.stacked(layer)    -> (gate_up [E, 2I, H], down [E, H, I])   the whole layer, no copy

All results are views into the loaded tensors; fused and per-expert checkpoints give identical sources
(the loader stacks per-expert tensors into the fused layout once, at load time).
"""
from __future__ import annotations

import torch


class ExpertWeights:
    def __init__(self, gate_up: dict[int, torch.Tensor], down: dict[int, torch.Tensor]):
        if gate_up.keys() != down.keys() or not gate_up:
            raise ValueError("ExpertWeights needs gate_up and down tensors for the same, non-empty set of layers")
        self._gate_up, self._down = gate_up, down
        first = next(iter(gate_up.values()))  # [E, 2I, H]
        self.layers = tuple(sorted(gate_up))
        self.num_experts, two_i, self.hidden_size = first.shape
        self.intermediate_size = two_i // 2
        self.dtype, self.device = first.dtype, first.device

    def gate_up(self, layer: int, expert: int) -> torch.Tensor:
        return self._gate_up[layer][expert]

    def down(self, layer: int, expert: int) -> torch.Tensor:
        return self._down[layer][expert]

    def stacked(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gate_up[layer], self._down[layer]

    def rebind(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Point a layer at other tensors of the same values (a view into a larger stack, say)."""
        if gate_up.shape != self._gate_up[layer].shape or down.shape != self._down[layer].shape:
            raise ValueError(f"rebind: layer {layer} keeps its shapes")
        self._gate_up[layer], self._down[layer] = gate_up, down

    def expert_nbytes(self) -> int:
        """Bytes of one (layer, expert): what a cache slot must hold."""
        return 3 * self.hidden_size * self.intermediate_size * self.dtype.itemsize
