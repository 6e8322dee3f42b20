"""Zipf-skewed expert popularity for synthetic checkpoints: the router row scales that make top-k routing
follow a Zipf law. Torch-free (numpy), deterministic.

E = experts of a layer, K = experts per token, a = the law's exponent.
Popularity p_e = the fraction of tokens that route to expert e (it sums to K over a layer). The law asked for:
p ∝ rank^-a, capped at CAP = 1/2 with what the cap cuts spread over the others in the same proportions, so it
still sums to K (`zipf_popularity`; K must be at most E/2).

Router model: logits l_e = s_e * g_e with g_e iid N(0, 1) per token. That is what random router rows give: for any
one input x, the w_e . x of independently drawn rows are iid normal over e; scaling row e by s_e widens its logit's
spread, so it wins a top-k place more often. Scaling alone cannot push an expert past 1/2 of the tokens (a zero-mean
logit is negative half the time, and a Qwen router has no bias), hence the cap. `router_scales` finds s (by rank) by
damped Newton steps on a seeded sample of g, with each expert's chance of a top-k place taken given the others'
logits (smooth, so few samples do). It depends only on (E, K, a): every layer shares it, each with its own seeded
order of experts (`layer_ranks`). Real router inputs are not isotropic (a common direction in the hidden state gives
each expert a fixed offset), so a model's measured popularity follows the law only approximately; `killick bench
routing` measures it.
"""
from __future__ import annotations

import functools
import math

import numpy as np

_SAMPLES = 4096
_ITERATIONS = 60  # at most; 10-15 reach _TOLERANCE at E = 256
_TOLERANCE = 0.01  # largest relative error of any expert's chance on the calibration sample
CAP = 0.5  # the most a scaled zero-mean logit can win: P(g > 0)
_REACH = 0.49  # a capped expert's target in the calibration: reachable with a finite scale


def zipf_popularity(num_experts: int, top_k: int, a: float) -> np.ndarray:
    """[E] target popularity by rank (rank 1 first): K * r^-a / sum r^-a, capped at CAP, re-spread."""
    if not 0 < top_k <= num_experts * CAP:
        raise ValueError(f"a Zipf router needs top-k between 1 and half the {num_experts} experts, got {top_k}")
    if a < 0:
        raise ValueError(f"the Zipf exponent must be >= 0, got {a}")
    w = np.arange(1, num_experts + 1, dtype=np.float64) ** -a
    capped = np.zeros(num_experts, dtype=bool)
    for _ in range(num_experts):  # each pass caps at least one more expert or stops
        free = ~capped
        p = np.where(capped, CAP, w * (top_k - CAP * capped.sum()) / w[free].sum())
        over = free & (p > CAP)
        if not over.any():
            return p
        capped |= over
    return np.full(num_experts, CAP)


def _normal_sf(z: np.ndarray) -> np.ndarray:
    """P(N(0,1) > z), via erfc (numpy has none; math.erfc per element would be slow)."""
    return 0.5 * _erfc(z / math.sqrt(2.0))


def _erfc(x: np.ndarray) -> np.ndarray:
    """Numerical Recipes' erfc (Chebyshev fit, relative error < 1.2e-7 everywhere)."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851973 + t * (-0.82215223 + t * 0.17087277)))))))))
    r = t * np.exp(poly)
    return np.where(x >= 0, r, 2.0 - r)


def topk_chance(log_scales: np.ndarray, top_k: int, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([E] P(expert e takes one of the top_k places), [E] its derivative in e's own log-scale) when logits are
    exp(log_scales) * g, g [n, E] a sample of iid N(0, 1). Per sample, e's logit must beat the top_k-th largest
    of the others' (the top_k-th largest of all when e is outside the top k, else the (top_k+1)-th): e wins
    with P(g_e > bar / s_e), averaged over the sample (smooth in the scales, so a few thousand samples do)."""
    s = np.exp(log_scales)
    logits = g * s  # [n, E]
    part = -np.partition(-logits, (top_k - 1, top_k), axis=1)  # descending at top_k-1 and top_k
    kth, next_ = part[:, top_k - 1:top_k], part[:, top_k:top_k + 1]  # [n, 1] each
    z = np.where(logits >= kth, next_, kth) / s  # [n, E]: the others' top_k-th largest, in units of s_e
    density = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return _normal_sf(z).mean(axis=0), (density * z).mean(axis=0)


@functools.lru_cache(maxsize=32)
def router_scales(num_experts: int, top_k: int, a: float) -> tuple[float, ...]:
    """Router row scale by rank (rank 1, the most popular, first; geometric mean 1) that makes top-k routing of
    iid normal logits follow zipf_popularity(E, K, a): damped Newton steps on each expert's own log-scale, on
    one seeded sample, so the same (E, K, a) always gives the same scales."""
    target = np.minimum(zipf_popularity(num_experts, top_k, a), _REACH)
    if a == 0:
        return tuple([1.0] * num_experts)
    g = np.random.default_rng(0x5EED).standard_normal((_SAMPLES, num_experts))
    u = np.zeros(num_experts)
    for _ in range(_ITERATIONS):
        have, slope = topk_chance(u, top_k, g)
        if np.max(np.abs(have - target) / target) < _TOLERANCE:
            break
        step = (target - have) / np.maximum(slope, 1e-12)
        u = u + np.clip(0.7 * step, -0.5, 0.5)
        u = np.clip(u - u.mean(), -12.0, 12.0)
    return tuple(float(v) for v in np.exp(u))


def layer_ranks(num_experts: int, seed: int, layer: int) -> np.ndarray:
    """[E] the popularity rank (0 = most popular) of each expert of one layer: a seeded order per layer, so
    the popular experts differ between layers as in real models."""
    return np.random.default_rng([0x21FF, seed, layer]).permutation(num_experts)


def layer_row_scales(num_experts: int, top_k: int, a: float, seed: int, layer: int) -> np.ndarray:
    """[E] the scale of each router row (by expert id) of one layer."""
    return np.asarray(router_scales(num_experts, top_k, float(a)))[layer_ranks(num_experts, seed, layer)]
