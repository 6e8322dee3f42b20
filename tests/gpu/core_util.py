"""Requests served together by an EngineCore on CUDA, for the GPU tests that compare two ways to run a model."""
from __future__ import annotations

import threading

from engine.api import GenerateRequest
from engine.build import EngineOptions, build_core


def run_through_core(model, reqs: list[GenerateRequest], dtype: str, **options) -> list[list[int]]:
    """Each request's output token ids, the requests submitted at once to a core over `model` (CUDA, 4 running,
    a 512-token context, EngineOptions' `options` besides); the core is stopped after."""
    opts = EngineOptions(device="cuda", dtype=dtype, max_running=4, context_length=512, **options)
    core = build_core(None, opts, model=model).start()
    out: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    pending, done = [len(reqs)], threading.Event()
    try:
        for i, r in enumerate(reqs):
            def sink(ev, i=i):
                out[i].extend(ev.token_ids)
                if ev.final:
                    pending[0] -= 1
                    if not pending[0]:
                        done.set()

            core.submit(r, sink)
        assert done.wait(120)
    finally:
        core.stop()
    return [out[i] for i in range(len(reqs))]
