"""Static per-sequence state for the fast path: one pool of slots, each a row of every layer's state tensor.

    pool = StatePool(model, slots=6, capacity=32768)
    state = pool.new_state()        # a SequenceState on a free slot (None when every slot is taken)
    state.release()                 # the slot goes back (also when the state is garbage collected)

Per attention layer a K and a V slab [S+1, kv, cap, D]; per DeltaNet layer conv [S+1, C, K-1] (model dtype)
and recurrent [S+1, Hv, dk, dv] (fp32). Row S is scratch: padded rows of a decode batch write there.
Kernels address a sequence by its slot; the eager path sees the same memory through SlotKV / SlotLinear,
which behave like KVCache / LinearState except that they never reallocate.
S = slots, kv = KV heads, cap = tokens per slot, D = head dim, C = conv channels.
"""
from __future__ import annotations

import weakref

import torch

from engine.models.state import KVCache, LinearState, SequenceState, StateCheckpoint


class SlotKV(KVCache):
    """KV of one attention layer for one sequence: views of its slot's slab rows [kv, cap, D]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v, self.length = k, v, 0

    def _grow(self, capacity: int) -> None:
        raise ValueError(f"a sequence reached {capacity} tokens but its KV slot holds {self.k.shape[1]}; "
                         f"start the engine with a larger --context-length")


class _CopiedIn:
    """An attribute backed by a fixed tensor view: assigning a tensor copies it into the view."""

    def __set_name__(self, owner, name: str) -> None:
        self.field = "_" + name

    def __get__(self, obj, owner=None) -> torch.Tensor:
        return getattr(obj, self.field)

    def __set__(self, obj, value: torch.Tensor) -> None:
        view = getattr(obj, self.field)
        if value.data_ptr() != view.data_ptr():
            view.copy_(value)


class SlotLinear(LinearState):
    """conv [C, K-1] and recurrent [Hv, dk, dv] views of one slot; assigning a tensor copies it in."""

    conv = _CopiedIn()
    recurrent = _CopiedIn()

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self._conv, self._recurrent = conv, recurrent
        self.checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class SlotState(SequenceState):
    """A SequenceState whose layers live in slot `slot` of a StatePool."""

    def __init__(self, layers: list, slot: int, release):
        super().__init__(layers)
        self.slot = slot
        self._kv = [layer for layer in layers if isinstance(layer, SlotKV)]
        self._release = weakref.finalize(self, release, slot)

    def release(self) -> None:
        self._release()

    def advance(self, n: int) -> None:
        """n tokens were written by the kernels: the state and every KV view move on."""
        self.length += n
        for kv in self._kv:
            kv.length += n


class StatePool:
    def __init__(self, model, slots: int, capacity: int):
        if slots < 1 or capacity < 1:
            raise ValueError(f"a state pool needs at least one slot and one token, got {slots} x {capacity}")
        cfg, dev, dt = model.config, model.device, model.dtype
        self.slots, self.capacity, self.device = slots, capacity, dev
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: (k, v) slabs or (conv, rec)
        for layer in model.layers:
            if layer.is_attention:
                shape = (slots + 1, cfg.num_kv_heads, capacity, cfg.head_dim)
                self.layers.append((torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)))
            else:
                conv = torch.zeros(slots + 1, cfg.conv_dim, cfg.conv_kernel - 1, dtype=dt, device=dev)
                rec = torch.zeros(slots + 1, cfg.linear_num_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim,
                                  dtype=torch.float32, device=dev)
                self.layers.append((conv, rec))
        self.is_attention = [layer.is_attention for layer in model.layers]
        self._free = list(range(slots - 1, -1, -1))

    @property
    def scratch(self) -> int:
        return self.slots

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)

    def new_state(self) -> SlotState | None:
        if not self._free:
            return None
        slot = self._free.pop()
        layers = []
        for attn, (a, b) in zip(self.is_attention, self.layers):
            if attn:
                layers.append(SlotKV(a[slot], b[slot]))
            else:
                a[slot].zero_()
                b[slot].zero_()
                layers.append(SlotLinear(a[slot], b[slot]))
        return SlotState(layers, slot, self._give_back)

    def restore(self, ckpt: StateCheckpoint) -> SlotState | None:
        """A slot state holding `ckpt` (None when no slot is free or it does not fit a slot)."""
        if ckpt.length > self.capacity:
            return None
        state = self.new_state()
        if state is None:
            return None
        for attn, layer, snap in zip(self.is_attention, state.layers, ckpt.layers):
            if attn:
                k, v = snap
                layer.k[:, : ckpt.length].copy_(k)
                layer.v[:, : ckpt.length].copy_(v)
                layer.length = ckpt.length
            else:
                layer.conv, layer.recurrent = snap
        state.length = ckpt.length
        return state

    def _give_back(self, slot: int) -> None:
        self._free.append(slot)
