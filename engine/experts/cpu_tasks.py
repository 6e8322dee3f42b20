"""The CPU expert runner's data: tasks, one layer's expert table, staged activations, their checks, and the
torch paths (the fallback and the float64 reference) that the native kernels (cpu_kernels.py) are compared with.

For each task (gate_up, down, token, weight):   y[token] += weight * down @ (silu(g) * u),
where [g; u] = gate_up @ x[token] (cpu_kernels.py has the shapes and layouts).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

try:
    from native import _cpu_experts as _native
except ImportError:  # not built: tables carry no native handle
    _native = None

Task = tuple[torch.Tensor, torch.Tensor, int, float]  # (gate_up [2I, H], down [H, I], token, weight)

FORMATS = {torch.float32: 0, torch.bfloat16: 1}


def split_expert_block(block: torch.Tensor, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (gate_up [2I, H], down [H, I]) of one contiguous expert block [3 * I * H] (gate_up then down)."""
    if block.dim() != 1 or block.numel() != 3 * inter * hidden or not block.is_contiguous():
        raise ValueError(f"an expert block must be a contiguous 1-D tensor of 3*I*H = {3 * inter * hidden} "
                         f"elements, got shape {tuple(block.shape)}")
    n = 2 * inter * hidden
    return block[:n].view(2 * inter, hidden), block[n:].view(hidden, inter)


class CpuFuture:
    """Completion handle of one submitted batch; keeps the tensors alive until it is waited on."""

    def __init__(self, waiter, keep: tuple, poll=None):
        self._waiter, self._keep, self._poll, self._done = waiter, keep, poll, False

    def wait(self) -> None:
        if not self._done:
            self._waiter()
            self._done, self._keep = True, ()

    def done(self) -> bool:
        """True once the work finished (wait() still has to be called to release the tensors). With a runner whose
        caller joins (CpuExpertRunner.caller_joins) the work finishes only inside wait()."""
        return self._done or (self._poll is not None and self._poll())


class ExpertTable:
    """One MoE layer's experts, validated once: gate_up [E, 2I, H], down [E, H, I] (bf16 or fp32, unit inner
    stride; e.g. ExpertWeights.stacked(layer)). from_blocks() takes the host pool's [E, 3*I*H] blocks."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
            raise ValueError(f"an expert table needs gate_up [E, 2I, H] and down [E, H, I]; got "
                             f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
        self.num_experts, two_i, self.hidden = gate_up.shape
        self.inter = two_i // 2
        if tuple(down.shape[1:]) != (self.hidden, self.inter) or two_i % 2:
            raise ValueError(f"down must be [E, H, I] = [E, {self.hidden}, {self.inter}], got {tuple(down.shape)}")
        if gate_up.dtype not in FORMATS or down.dtype != gate_up.dtype:
            raise ValueError(f"expert weights must be bf16 or fp32, one dtype (got {gate_up.dtype}/{down.dtype})")
        on_cpu = gate_up.device.type == "cpu" and down.device.type == "cpu"
        if gate_up.stride(2) != 1 or down.stride(2) != 1 or not on_cpu:
            raise ValueError("expert weights must be CPU tensors with unit inner stride")
        self.gate_up, self.down, self.dtype = gate_up, down, gate_up.dtype
        self._native = None if _native is None else _native.Table(
            FORMATS[self.dtype], self.hidden, self.inter, gate_up.data_ptr(), gate_up.stride(0), gate_up.stride(1),
            down.data_ptr(), down.stride(0), down.stride(1), self.num_experts)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, hidden: int, inter: int) -> "ExpertTable":
        if blocks.dim() != 2 or blocks.shape[1] != 3 * inter * hidden or blocks.stride(1) != 1:
            raise ValueError(f"expert blocks must be [E, 3*I*H] = [E, {3 * inter * hidden}] with unit inner "
                             f"stride, got {tuple(blocks.shape)}")
        n = 2 * inter * hidden
        return cls(blocks[:, :n].unflatten(1, (2 * inter, hidden)), blocks[:, n:].unflatten(1, (hidden, inter)))

    def tasks(self, experts, tokens, weights) -> list[Task]:
        bad = [e for e in experts if not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} are outside the table's {self.num_experts} experts")
        return [(self.gate_up[e], self.down[e], t, w) for e, t, w in zip(experts, tokens, weights)]


class RoutedIO:
    """Activations x [T, H] and output y [T, H], both CPU float32 with unit inner stride, checked once for
    CpuExpertRunner.run_io: the staging buffers of a decode loop that calls the runner every MoE layer. They
    must keep their storage, shape and strides while in use (no resize_/set_ on them); tokens index their
    rows."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.rows, self.hidden = check_xy(x, y)
        if x.dtype != torch.float32 or x.stride(1) != 1:
            raise ValueError(f"RoutedIO needs x in float32 with unit inner stride, got {x.dtype}, "
                             f"strides {tuple(x.stride())}")
        self.x, self.y = x, y
        self.ptrs = (x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), self.rows)  # submit_table's x..T


def fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: float32 rows with unit inner stride (a copy only when it is not already);
    anything but [T, H] passes through for check_xy / RoutedIO to name."""
    if x.dim() != 2 or (x.dtype == torch.float32 and x.stride(1) == 1):
        return x
    return x.float().contiguous()


def as_lists(*columns):
    """Task columns as lists (1-D tensors converted); all one length."""
    out = [v.tolist() if isinstance(v, torch.Tensor) else v for v in columns]
    if len({len(v) for v in out}) > 1:
        raise ValueError("experts, tokens and weights must have one entry per task")
    return out


def check_xy(x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """Checks the activations and the output; returns (T, H). Few torch calls: it runs on every MoE layer."""
    shape = x.shape
    if len(shape) != 2 or shape != y.shape:
        raise ValueError(f"x and y must both be [T, H]; got {tuple(shape)} and {tuple(y.shape)}")
    if y.dtype != torch.float32 or y.stride(1) != 1 or not (x.is_cpu and y.is_cpu):
        raise ValueError("y must be a CPU float32 tensor with unit inner stride (it is accumulated into), "
                         "x a CPU tensor")
    return shape[0], shape[1]


def check_tasks(tasks: Sequence[Task], x: torch.Tensor, y: torch.Tensor) -> tuple[int, int, torch.dtype]:
    """Validates a batch; returns (H, I, weight dtype). Raises ValueError with what to fix."""
    T, H = check_xy(x, y)
    if not tasks:
        return H, 0, torch.float32
    gu0, dn0 = tasks[0][0], tasks[0][1]
    inter = gu0.shape[0] // 2
    for gu, dn, tok, _ in tasks:
        if gu.dtype not in FORMATS or dn.dtype != gu.dtype or gu.dtype != gu0.dtype:
            raise ValueError(f"expert weights must all be bf16 or all fp32 (got {gu.dtype}/{dn.dtype})")
        if tuple(gu.shape) != (2 * inter, H) or tuple(dn.shape) != (H, inter):
            raise ValueError(f"expert shapes must be gate_up [2I, H] = [{2 * inter}, {H}] and down [H, I] = "
                             f"[{H}, {inter}]; got {tuple(gu.shape)} and {tuple(dn.shape)}")
        if gu.stride() != gu0.stride() or dn.stride() != dn0.stride() or gu.stride(1) != 1 or dn.stride(1) != 1:
            raise ValueError("expert weights need unit inner stride and one row stride per call "
                             "(use .contiguous() or views of one fused tensor)")
        if gu.device.type != "cpu" or dn.device.type != "cpu":
            raise ValueError("expert weights for the CPU runner must live in host memory")
        if not 0 <= int(tok) < T:
            raise ValueError(f"task token {tok} is outside x's {T} rows")
    return H, inter, gu0.dtype


def torch_experts(tasks: Sequence[Task], x: torch.Tensor, y: torch.Tensor) -> None:
    """The fallback and the speed baseline: same grouping as the kernels, torch matmuls in weight dtype."""
    by_expert: dict[int, list[tuple[int, float]]] = {}
    weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for gu, dn, tok, w in tasks:
        key = gu.data_ptr()
        by_expert.setdefault(key, []).append((int(tok), float(w)))
        weights[key] = (gu, dn)
    for key, routed in by_expert.items():
        gu, dn = weights[key]
        toks = torch.tensor([t for t, _ in routed])
        ws = torch.tensor([w for _, w in routed], dtype=torch.float32)
        g, u = F.linear(x[toks].to(gu.dtype), gu).float().chunk(2, dim=-1)  # [n, I] each
        out = F.linear((F.silu(g) * u).to(dn.dtype), dn).float()             # [n, H]
        y.index_add_(0, toks, out * ws[:, None])


def reference_experts(tasks: Sequence[Task], x: torch.Tensor) -> torch.Tensor:
    """float64 reference for tests: returns the [T, H] sum the runner adds to y."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for gu, dn, tok, w in tasks:
        g, u = (gu.double() @ x[int(tok)].double()).chunk(2)
        out[int(tok)] += float(w) * (dn.double() @ (F.silu(g) * u))
    return out
