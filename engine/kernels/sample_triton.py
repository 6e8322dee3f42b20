"""A decode step's rows of temperature alone sampled in two launches (torch's divide, softmax, Exp(1) noise,
clamp, divide and argmax are seven: ~80 us a step beside a 750 us greedy step on the H200, docs/PERF.md).

The race: token i wins argmax_i(logits_i / T - log E_i) with E_i ~ Exp(1) independent, which is
argmax_i(p_i / E_i) for p = softmax(logits / T) (sampling._race): token i with probability p_i. Uniforms come
from Philox (tl.rand) keyed by a seed the caller draws on the host, so nothing waits for the device. Launch 1
races each block of BLOCK_V tokens of each row; launch 2 keeps each row's best block. Imported on CUDA (and
by the kernel tests under Triton's interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import cdiv, next_pow2

BLOCK_V = 4096  # tokens a program races (a 248k vocabulary: 61 programs a row)
NOISE_MIN = 1e-20  # the smallest Exp(1) draw, as sampling.NOISE_MIN (a draw of 0 would win whatever its token)


@triton.jit(do_not_specialize=["seed"])
def _race_blocks_kernel(logits_ptr, stride, V, inv_t, seed, best_ptr, where_ptr, NB, NOISE_MIN: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=inside, other=float("-inf")).to(tl.float32)
    noise = tl.maximum(-tl.log(tl.rand(seed, row * V + offs)), NOISE_MIN)  # Exp(1), never 0
    score = tl.where(inside, x * inv_t - tl.log(noise), float("-inf"))
    tl.store(best_ptr + row * NB + block, tl.max(score, axis=0))
    tl.store(where_ptr + row * NB + block, block * BLOCK + tl.argmax(score, axis=0))


@triton.jit
def _race_pick_kernel(best_ptr, where_ptr, out_ptr, NB, BLOCK_NB: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_NB)
    best = tl.load(best_ptr + row * NB + offs, mask=offs < NB, other=float("-inf"))
    tl.store(out_ptr + row, tl.load(where_ptr + row * NB + tl.argmax(best, axis=0)).to(tl.int64))


def race_rows(logits: torch.Tensor, temperature: float, seed: int, block: int = BLOCK_V) -> torch.Tensor:
    """logits [n, V] (rows of unit stride) -> int64 [n]: each row's token drawn from softmax(logits / T),
    queued on the device, nothing read back. seed: Philox's key (a new one for every call)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not temperature > 0:
        raise ValueError("race_rows: logits must be [n, V] with unit stride along V, temperature > 0")
    n, V = logits.shape
    nb = cdiv(V, block)
    best = torch.empty(n, nb, dtype=torch.float32, device=logits.device)
    where = torch.empty(n, nb, dtype=torch.int32, device=logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    _race_blocks_kernel[(n, nb)](logits, logits.stride(0), V, 1.0 / temperature, seed, best, where, nb,
                                 NOISE_MIN=NOISE_MIN, BLOCK=block)
    _race_pick_kernel[(n,)](best, where, out, nb, BLOCK_NB=next_pow2(max(nb, 2)))
    return out
