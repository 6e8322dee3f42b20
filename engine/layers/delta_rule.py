"""The gated delta rule (Gated DeltaNet's state update), one sequence at a time, in fp32.

Per value head, with state S [dk, dv], decay g_t <= 0 (log space), learning rate beta_t in (0, 1):
    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t
q and k are L2-normalised, q also scaled by dk^-1/2. Decode uses the recurrence as written; prefill the
chunked form, which solves each chunk's C deltas with one triangular system:
    (I + A) U = beta V - beta exp(G) K S0,   A_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i),  G = cumsum(g)
    O = exp(G) Q S0 + (Q K^T * exp(G_i - G_j))_{j<=i} U,   S_C = exp(G_C) S0 + (K exp(G_C - G))^T U
Shapes: T tokens, Hk key heads, Hv value heads (Hv a multiple of Hk), dk / dv head dims, C chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepare(q, k, v, g, beta):
    """-> q, k [Hv, T, dk] normalised, v [Hv, T, dv], g, beta [Hv, T], all fp32."""
    rep = v.shape[1] // q.shape[1]  # each key head serves `rep` consecutive value heads
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    return q, _l2norm(k), v, g.t().float(), beta.t().float()


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv] fp32 -> (o [T, Hv, dv], state)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = (state * k[:, t, :, None]).sum(1)  # [Hv, dv]: what the state already returns for k_t
        delta = (v[:, t] - predicted) * beta[:, t, None]  # [Hv, dv]
        state = state + k[:, t, :, None] * delta[:, None, :]
        outs.append((state * q[:, t, :, None]).sum(1))
    return torch.stack(outs, dim=0).to(out_dtype), state


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Same contract as recurrent_gated_delta_rule; O(T/C) sequential steps instead of O(T)."""
    out_dtype, T = v.dtype, q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (-T) % chunk  # padded tokens have k = v = 0, beta = 0, g = 0: they leave the state alone
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    H, n = q.shape[0], (T + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))  # [H, n, C, d]
    G = g.reshape(H, n, chunk).cumsum(-1)  # [H, n, C]
    beta = beta.reshape(H, n, chunk, 1)

    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # j > i
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(future, float("-inf")).exp()  # [H, n, C, C]
    A = (beta * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower: earlier tokens only
    system = A + torch.eye(chunk, device=q.device)
    u_base = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
    u_state = torch.linalg.solve_triangular(system, beta * G.exp()[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()  # [H, n]

    outs = []
    for c in range(n):
        u = u_base[:, c] - u_state[:, c] @ state  # [H, C, dv]
        outs.append(q_decayed[:, c] @ state + scores[:, c] @ u)
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    o = torch.cat(outs, dim=1)[:, :T]  # [H, T, dv]
    return o.transpose(0, 1).to(out_dtype), state
