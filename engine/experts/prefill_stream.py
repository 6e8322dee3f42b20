"""Prefill: stream whole layers through two layer-sized buffers, or serve only the routed experts.

A long extend routes to nearly every expert of every layer, so each MoE layer's experts are copied in
full while the previous layer computes: the copy stream loads layer l+1 into the least recently used
slots while layer l (locked) runs. With a full cache those LRU slots are exactly the buffer layer l-1
used, so two layer-sized buffers of the slot pool alternate (it needs 2E slots); with free slots the
streamed layers simply stay resident, and decode after a long prompt starts with a warm cache.
A short extend (a tool result) touches few experts; the ordinary per-expert path (fill or CPU-run) then
moves far fewer bytes. The choice compares predicted bytes / bandwidth of the two, not a token threshold.
"""
from __future__ import annotations

# a CPU expert kernel reads each weight once per call; above this many tokens per expert it turns
# compute-bound and its time grows with the tokens (roughly: machine flops / DRAM bandwidth, bf16)
CPU_BALANCE_TOKENS = 16


def expected_touched(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Fraction of a layer's experts routed to by at least one of T tokens (uniform routing)."""
    return 1.0 - (1.0 - top_k / num_experts) ** num_tokens


def should_stream(*, num_tokens: int, top_k: int, num_experts: int, missing: list[int], expert_bytes: int,
                  bp: float, bh: float, cpu_share: float, device_flops: float) -> bool:
    """True when streaming every missing expert beats serving only the routed ones.

    missing = non-resident experts per MoE layer; cpu_share = fraction of misses the backend runs on
    the CPU (0 offload, 1 cpu, else the hybrid split). The per-expert path copies a layer's experts only
    once routing is known, so its copies add to the compute; streaming hides one behind the other."""
    total_missing = sum(missing)
    if total_missing == 0:
        return False
    routed = total_missing * expected_touched(num_tokens, top_k, num_experts) * expert_bytes
    per_expert_tokens = num_tokens * top_k / num_experts
    cpu_slowdown = max(1.0, per_expert_tokens / CPU_BALANCE_TOKENS)
    # fills and CPU runs proceed concurrently: the slower share sets the time
    serve = routed * max((1 - cpu_share) / bp, cpu_share * cpu_slowdown / bh)
    # 2 flops per weight element and routed token; a block has expert_bytes / 2 elements at bf16
    compute = len(missing) * num_tokens * top_k * expert_bytes / device_flops
    return max(total_missing * expert_bytes / bp, compute) <= serve + compute


class PrefillStreamer:
    """Double-buffered layer streaming for one forward; owned by a slot backend."""

    def __init__(self, backend) -> None:
        self.b = backend
        self.active = False
        self.reserved: list[int] = []  # slots of the next layer, kept locked while this one runs
        self._prefetched: set[int] = set()
        self._current: int | None = None  # the layer before_layer last prepared in this forward
        self._tokens, self._left = 0, {}
        self._fence = None  # CUDA event: the compute before the layer just finished (see after_piece)
        self.streamed_forwards = 0

    def begin(self, num_tokens: int, top_k: int) -> None:
        cache, pool = self.b.cache, self.b.pool
        e = pool.num_experts
        self.active, self.reserved, self._prefetched, self._current = False, [], set(), None
        self._tokens, self._left = num_tokens, {}  # the forward's tokens; per layer, those not through it yet
        if cache.num_slots < 2 * e or num_tokens <= 1:
            return
        missing = [e - cache.resident_count(layer) for layer in pool.layers]
        est = self.b.estimate
        self.active = should_stream(num_tokens=num_tokens, top_k=top_k, num_experts=e, missing=missing,
                                    expert_bytes=pool.expert_bytes, bp=est.bp, bh=est.bh,
                                    cpu_share=self.b.cpu_share(), device_flops=self.b.device_flops)
        self.streamed_forwards += self.active
        self._fence = self.b.cache.mark() if self.active else None  # every read of a slot before this forward

    def before_layer(self, layer: int) -> None:
        """Make `layer` fully resident (normally streamed while the previous layer ran); a later piece of the
        same layer (layer-major forward) finds it done."""
        if layer == self._current:
            self.b.cache.ready()
            return
        self._current = layer
        if layer not in self._prefetched:
            self._prefetch(layer)
        self.b.cache.ready()  # the compute stream waits for this layer, not for the one issued next

    def after_piece(self, layer: int, rows: int) -> None:
        """A piece of `rows` tokens of `layer` has queued its experts: after the layer's last piece, start
        streaming the next layer. Issued behind all of this layer's compute, the copies run beside it; issued
        before it (at the layer's first piece, as this did), the host blocks in the driver on the deep copy
        queue, at PCIe pace, with the layer's compute not yet queued, and the two add up (H200 box, 8k prompt:
        0.42 s against 0.25 s of copies; docs/PERF.md issue 17)."""
        left = self._left.get(layer, self._tokens) - rows
        self._left[layer] = left
        if left > 0:
            return
        layers = self.b.pool.layers
        i = self.b.pool.row[layer]
        done = self.b.cache.mark()
        # the victims (the layer before this one, or older) were last read before the previous mark: the
        # copies need not wait for this layer's compute, which they are meant to run beside
        self.reserved = self._prefetch(layers[i + 1], after=self._fence) if i + 1 < len(layers) else []
        self._fence = done

    def _prefetch(self, layer: int, after=None) -> list[int]:
        cache, e = self.b.cache, self.b.pool.num_experts
        slots = cache.lookup(layer, range(e))
        cache.table.lock(slots[slots >= 0])  # its own residents stay where they are
        missing = [x for x in range(e) if slots[x] < 0]
        # free slots, else the layer streamed two steps ago
        admitted = cache.admit(layer, missing, coalesce=True, after=after)
        st = self.b.stats_[layer]
        st.fills += len(admitted)
        st.bytes_moved += len(admitted) * self.b.pool.expert_bytes
        self._prefetched.add(layer)
        return slots[slots >= 0].tolist() + admitted
