"""Byte layout of one expert block, shared by the host pool, the device slots and the native CPU kernels.

One block per (layer, expert), `numel = 3 * I * H` elements of the model dtype, row-major, no padding:

    elements [0, 2*I*H)        gate_up  [2I, H]   rows 0..I-1 = gate_proj, rows I..2I-1 = up_proj
    elements [2*I*H, 3*I*H)    down     [H, I]

    y = down @ (silu(gate_up[:I] @ x) * (gate_up[I:] @ x))        x: [H] -> y: [H]

The host pool stores a layer as one contiguous [E, numel] tensor, so block (l, e) starts at byte
e * numel * itemsize of layer l's buffer. A device slot is one such block.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    hidden: int  # H
    inter: int  # I (per-expert intermediate size)
    itemsize: int  # bytes per element (2 for bf16/fp16, 4 for fp32)

    @property
    def gate_up_numel(self) -> int:
        return 2 * self.inter * self.hidden

    @property
    def numel(self) -> int:
        return 3 * self.inter * self.hidden

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def split_block(block, layout: ExpertLayout):
    """Views (gate_up [2I, H], down [H, I]) of one flat block tensor [numel]."""
    gu = layout.gate_up_numel
    return (block[:gu].view(2 * layout.inter, layout.hidden),
            block[gu:].view(layout.hidden, layout.inter))
