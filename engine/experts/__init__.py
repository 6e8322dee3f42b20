"""Routed experts: where they live and where they run (the expert memory hierarchy).

    source.py          ExpertWeights: the experts as the loader found them (model branch)
    fused.py           all experts resident on the model's device: the reference backend
    registry.py        --moe-backend fused|offload|cpu|hybrid|auto -> experts_factory (torch-free)
    host_pool.py       every expert in host RAM, one block per (layer, expert) (block_layout.py); pinned
    safetensors_fill.py  fill that pool straight from the checkpoint files
    lru.py, policy.py, stats.py   slot bookkeeping, the fill/CPU split and B_P/B_H estimates, counters (torch-free)
    slot_cache.py      the device slot pool shared by all MoE layers, copy stream, resize
    offload.py, cpu.py, hybrid.py   the slot backends (they differ only in how many misses they fill)
    device_runs.py, counting.py, cpu_collect.py, lookahead.py, handoff.py, refresh.py
                       OffloadBackend's parts, one mixin each
    prefill_stream.py  long extends stream whole layers, one copy each, through windows of E slots
    compute.py, cpu_runner.py   the shared expert math; CPU execution (native kernels when built)
    profile.py         this machine's measured B_P / B_H (written by `killick bench bw`, engine/bench/)
    synthetic.py       synthetic model shapes and pools for tests and benchmarks
"""
