"""Prefix cache, engine side: a radix tree over token ids whose nodes hold opaque KV payloads and
recurrent-state checkpoints, kept in two memory tiers (device, host) under byte budgets.

Torch-free on purpose: payloads are objects the model runner supplies (see docs/CONTRACTS.md, "engine prefix
cache"); this package only decides what to keep, where, and for how long.

    cache = PrefixCache(device_budget=8 << 30, require_checkpoint=True)
    m = cache.acquire(prompt_ids, max_position=len(prompt_ids) - 1)  # match + lock + promote host hits
    ... build the sequence state from m.node_path payloads up to m.position, prefill the rest ...
    cache.insert(prompt_ids + out_ids, upto, kv=slice_kv, checkpoints={pos: ckpt, ...})
    cache.release(m)
"""
from engine.cache.radix import Match, Node, RadixTree
from engine.cache.tiers import PrefixCache, default_host_budget

__all__ = ["Match", "Node", "PrefixCache", "RadixTree", "default_host_budget"]
