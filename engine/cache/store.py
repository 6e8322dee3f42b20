"""Torch side of the prefix cache: the payloads PrefixCache stores, and the runner's view of it.

An edge's KV payload holds keys/values of every attention layer for its token range; a checkpoint payload
holds the recurrent state (conv + delta-rule state of every DeltaNet layer) at one position, no KV - so a
session checkpointed at every turn stores its KV once. A = attention layers, kv = KV heads, D = head dim.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.cache.tiers import PrefixCache
from engine.models.state import KVCache, SequenceState, StateCheckpoint

MAX_PINNED_SESSIONS = 16


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available() and t.is_cuda)
    out.copy_(t)
    return out


class _Tensors:
    """A tuple of per-layer tensor tuples in one tier (the shared body of both payload kinds)."""

    def __init__(self, layers: tuple[tuple[torch.Tensor, ...], ...], tier: str, device: torch.device) -> None:
        self.layers, self.tier, self.device = layers, tier, device
        self.nbytes = sum(t.numel() * t.element_size() for layer in layers for t in layer)

    def _moved(self, fn, tier: str):
        return type(self)(tuple(tuple(fn(t) for t in layer) for layer in self.layers), tier, self.device)

    def to_host(self):
        return self._moved(_host_copy, "host")

    def to_device(self):
        return self._moved(lambda t: t.to(self.device, non_blocking=False, copy=True), "device")

    def release(self) -> None:
        self.layers = ()


class KVPayload(_Tensors):
    """layers: per attention layer (k, v), each [kv, n, D] for the edge's n positions."""

    def split(self, n: int) -> tuple["KVPayload", "KVPayload"]:
        head = tuple((k[:, :n].clone(), v[:, :n].clone()) for k, v in self.layers)
        tail = tuple((k[:, n:].clone(), v[:, n:].clone()) for k, v in self.layers)
        return KVPayload(head, self.tier, self.device), KVPayload(tail, self.tier, self.device)


class CheckpointPayload(_Tensors):
    """layers: per DeltaNet layer (conv [C, K-1], recurrent [Hv, dk, dv] fp32)."""


class PrefixStore:
    """What the runner calls: acquire a cached prefix at admission, insert states, release at the end."""

    def __init__(self, model, device_budget: int, host_budget: int | None = None) -> None:
        self.model = model
        self.device = model.device
        self.attn = [i for i, layer in enumerate(model.layers) if layer.is_attention]
        self.linear = [i for i, layer in enumerate(model.layers) if not layer.is_attention]
        self.cache = PrefixCache(device_budget, host_budget, require_checkpoint=bool(self.linear))
        self._sessions: OrderedDict[str, None] = OrderedDict()

    # -- runner side --------------------------------------------------------------------------
    def acquire(self, tokens: list[int]):
        """-> (match, restored state or None). Ask for at most len(tokens) - 1 so one token is prefilled."""
        m = self.cache.acquire(tokens, max_position=len(tokens) - 1)
        if m.position == 0:
            return m, None
        return m, self.model.restore(self._assemble(m))

    def release(self, m) -> None:
        self.cache.release(m)

    def insert(self, tokens: list[int], state: SequenceState, session_key: str | None = None) -> None:
        """Cache state (which covers exactly `tokens`) with a checkpoint at its end."""
        n = state.length
        assert n == len(tokens), "state and tokens disagree"  # internal invariant, not user input
        ckpt = {n: self._checkpoint(state)} if self.linear else {}
        node = self.cache.insert(tokens, n, kv=lambda s, e: self._kv(state, s, e), checkpoints=ckpt)
        if session_key is not None and node is not None and node.alive:  # too big for both tiers: gone already
            self._pin(session_key, node)

    def set_budgets(self, device: int | None = None, host: int | None = None) -> None:
        """New byte budgets for the two tiers (None: unchanged), evicting down to them (PrefixCache.set_budgets)."""
        self.cache.set_budgets(device=device, host=host)

    def stats(self) -> dict:
        return {f"cache_{k}": v for k, v in self.cache.stats().items()}

    # -- payloads -----------------------------------------------------------------------------
    def _kv(self, state: SequenceState, start: int, end: int) -> KVPayload:
        layers = []
        for i in self.attn:
            kv: KVCache = state.layers[i]
            layers.append((kv.keys()[:, start:end].clone(), kv.values()[:, start:end].clone()))
        return KVPayload(tuple(layers), "device", self.device)

    def _checkpoint(self, state: SequenceState) -> CheckpointPayload:
        return CheckpointPayload(tuple(state.layers[i].snapshot() for i in self.linear), "device", self.device)

    def _assemble(self, m) -> StateCheckpoint:
        """Concatenate the path's KV cut at m.position; recurrent state from the deepest checkpoint."""
        path, p = m.node_path, m.position
        layers: list[tuple[torch.Tensor, ...]] = [()] * len(self.model.layers)
        for j, i in enumerate(self.attn):
            ks, vs = [], []
            for node in path:
                take = min(node.end, p) - node.start
                if take <= 0:
                    break
                k, v = node.kv.layers[j]
                ks.append(k[:, :take])
                vs.append(v[:, :take])
            layers[i] = (torch.cat(ks, dim=1), torch.cat(vs, dim=1))
        if self.linear:
            for j, i in enumerate(self.linear):
                layers[i] = m.node.ckpt.layers[j]
        return StateCheckpoint(p, tuple(layers))

    def _pin(self, session_key: str, node) -> None:
        """Keep a session's newest path while its agent runs tools; oldest sessions lose their pin first."""
        self.cache.unpin(session_key)
        self.cache.pin(session_key, node.path())
        self._sessions[session_key] = None
        self._sessions.move_to_end(session_key)
        while len(self._sessions) > MAX_PINNED_SESSIONS:
            old, _ = self._sessions.popitem(last=False)
            self.cache.unpin(old)
