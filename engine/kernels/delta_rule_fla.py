"""The chunked gated delta rule through fla-core's Triton kernels (CUDA only; imported lazily).

Same contract as engine/layers/delta_rule.chunked_gated_delta_rule, the torch reference it is tested
against: q, k [T, Hk, dk]; v [T, Hv, dv]; g (log decay), beta [T, Hv]; state [Hv, dk, dv] fp32
-> (o [T, Hv, dv] in v's dtype, new state fp32). fla normalises q and k itself (use_qk_l2norm_in_kernel)
and maps value head i to key head i // (Hv / Hk), as the reference does; it computes in TF32 inside.
"""
from __future__ import annotations

import importlib.util
import warnings

import torch


def available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("fla") is not None


def _kernel():
    with warnings.catch_warnings():  # fla warns on import about optional packages it does not need here
        warnings.simplefilter("ignore")
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule


def chunked_gated_delta_rule_fla(q, k, v, g, beta, state):
    chunk_gated_delta_rule = _kernel()

    def run():
        return chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None].to(v.dtype),
                                      scale=q.shape[-1] ** -0.5, initial_state=state[None].float(),
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)

    try:
        o, final = run()
    except RuntimeError as exc:
        # Triton 3.6 now and then fails to compile one of fla's autotuning candidates (chunk_gated_delta_rule_
        # fwd_kernel_h_blockdim64, "PassManager::run failed"; seen twice on the GPU box, 2026-12-01) and its
        # autotuner does not skip it; the same shapes compiled in the next process (whether they do on a
        # retry in the same process is not yet seen). Once more, then give up.
        if "PassManager::run failed" not in str(exc):
            raise
        warnings.warn("fla's delta-rule kernel failed to compile once (Triton); retrying", RuntimeWarning)
        o, final = run()
    return o[0], final[0]
