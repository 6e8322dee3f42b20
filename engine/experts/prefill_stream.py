"""Prefill: stream whole layers through two layer-sized buffers, or serve only the routed experts.

A long extend routes to nearly every expert of every layer, so each MoE layer's experts are copied in
full while the previous layer computes: the copy stream loads layer l+1 into the least recently used
slots while layer l (locked) runs. Two layer-sized windows of the slot pool alternate (it needs 2E slots);
with room for W >= 3 windows the first W - 2 layers keep one each, so a prompt leaves the first layers
resident: the next prompt reads them in place, and a routed extend fills each later layer into the slots of
a layer it already ran (OffloadBackend.keep_bonus) instead of evicting layers still to run.
A short extend (a tool result) touches few experts; the ordinary per-expert path (fill or CPU-run) then
moves far fewer bytes. The choice compares predicted bytes / bandwidth of the two, not a token threshold;
which experts a prompt will touch comes from the slot table's heat (recent routing), not from uniform routing.
"""
from __future__ import annotations

import numpy as np


# a CPU expert kernel reads each weight once per call; above this many tokens per expert it turns
# compute-bound and its time grows with the tokens (roughly: machine flops / DRAM bandwidth, bf16)
CPU_BALANCE_TOKENS = 16
# routing probabilities from the slot table's heat start from this many uses of every expert (a uniform
# prior that a few tokens of history cannot outweigh; a decode's hundreds of tokens do)
PRIOR_USES = 1.0
STREAM_MODES = ("auto", "on", "off")
# a prompt's resident expert that a layer still to run will read is worth, to the forward's fills, the heat that read
# will add (its expected tokens, weighed as the prompt's: lru.prompt_use_weights) plus this many uses for the refill
# its eviction would cost. Without it an early layer's fills took the coldest slots anywhere, often a later
# layer's residents, which that layer then filled again (a 256-token extend after a streamed 8k prompt hit 0.02-0.10
# of its experts, H200 box, docs/PERF.md fourteenth session); with those residents simply taken last (bd24a6f), a
# cold one that a later layer may read outranked a decode's popular expert of an earlier layer
REFILL_USES = 1.0
# ...and counts this many times over: a layer's routing counts vary by more than one use between experts (under uniform
# routing an 8k prompt's heat left residents of a later layer colder than some experts an earlier layer had just read,
# and their fills took a third of the later layers' residents); several times colder, a later layer's resident goes
# first (a 64-token prompt's rare expert against a decode's popular one)
KEEP_RATIO = 2.0
# the residents routed_fills counts as kept for a later layer: touched with at least this probability
LIKELY_READ = 0.5
# the share of B_P each path's copies reach (H200 box, 8 layers at the Qwen3.6-35B-A3B widths, 37.5% in slots,
# docs/PERF.md): a streamed layer is one copy, and an 8k prompt streamed the pool at 0.93-0.96 of it; the routed
# path copies each layer's experts only once its routing is back on the host, and a 256-token extend's fills
# moved at 0.81-0.85 of it (1,229-2,041 experts in 174.5-297.6 ms). Priced at B_P alike, the two tied where
# the routed path moved nearly every expert, and it ran 17% slower than the stream it was chosen over.
STREAM_EFFICIENCY = 0.95
ROUTED_EFFICIENCY = 0.83


def expected_touched(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Fraction of a layer's experts routed to by at least one of T tokens (uniform routing)."""
    return 1.0 - (1.0 - top_k / num_experts) ** num_tokens


def pick_probability(heat: np.ndarray, top_k: int, prior: float = PRIOR_USES) -> np.ndarray:
    """[..., E]: the probability that one token routes to each expert of a layer (a row of heat).

    heat [..., E]: the layer's recent uses (the slot table's heat in units of one use now). A token picks top_k
    distinct experts, expert e with probability proportional to w_e = heat_e + prior and at most 1 (the mass
    above 1 goes to the others: the probabilities sum to top_k). With no history that is uniform routing."""
    w = np.asarray(heat, dtype=np.float64) + prior
    free = np.ones(w.shape, dtype=bool)
    p = np.zeros_like(w)
    for _ in range(top_k + 1):  # each pass caps at least one more expert of a row at 1, or settles
        left = top_k - (~free).sum(-1, keepdims=True)
        share = left * w * free / (w * free).sum(-1, keepdims=True)
        over = share > 1
        p = np.where(free, share, 1.0)
        if not over.any():
            break
        free &= ~over
    return np.minimum(p, 1.0)


def touched(heat: np.ndarray, num_tokens: int, top_k: int, prior: float = PRIOR_USES) -> np.ndarray:
    """[..., E]: the probability that T tokens route to each expert of a layer at least once (pick_probability
    per token). With no history that is uniform routing (expected_touched); under skew the cold experts, the
    ones usually missing, are touched less often than uniform routing would say."""
    return touch_of(pick_probability(heat, top_k, prior), num_tokens)


def touch_of(pick: np.ndarray, num_tokens: int) -> np.ndarray:
    """[..., E]: the probability that num_tokens tokens route to each expert at least once, from each one's per
    token (pick_probability's)."""
    return 1.0 - (1.0 - pick) ** num_tokens


def row_sums(warm: np.ndarray, touch: np.ndarray) -> tuple[list[int], list[float], list[float]]:
    """warm [L, E] (in a slot), touch [L, E] (touched by the forward's tokens) -> per row: the experts missing, the
    touched ones among them (their probabilities summed) and the residents likely read (touch >= LIKELY_READ)."""
    missing = (~warm).sum(1).tolist()
    cold_hit = np.where(warm, 0.0, touch).sum(1).tolist()
    likely = (warm & (touch >= LIKELY_READ)).sum(1).astype(np.float64).tolist()
    return missing, cold_hit, likely


def routed_fills(touched_missing: list[float], likely_resident: list[float], num_slots: int,
                 cpu_share: float = 0.0) -> float:
    """Experts the per-expert path copies (or, the cpu_share of the misses, runs on the CPU) in one prompt
    forward: the touched misses, and the residents those fills evict before their own layer runs.

    Layers run in order (the lists' order). likely_resident[l]: residents of layer l the prompt will likely
    read; a fill takes one of them only once the unlocked slots no hotter are taken (OffloadBackend.keep_bonus;
    counted here as only when no other is left), and after a layer has run its slots are free to take. So
    residents are lost only where one layer's fills outnumber the slots that are not kept: the first layer's,
    after a streamed prompt that left the slots full of layers still to run. CPU runs take no slot."""
    lost = 0.0
    for i, m in enumerate(touched_missing):
        later = max(0.0, sum(likely_resident[i + 1:]) - lost)
        spare = num_slots - later - likely_resident[i]  # not kept, and not this layer's hits
        lost += min(max(0.0, (1 - cpu_share) * m - spare), later)
    return sum(touched_missing) + lost


def should_stream(*, num_tokens: int, top_k: int, num_experts: int, missing: list[int], routed: float,
                  expert_bytes: int, bp: float, bh: float, cpu_share: float, device_flops: float,
                  streamed: float | None = None) -> bool:
    """True when streaming every layer whole beats serving only the routed experts.

    missing = non-resident experts per MoE layer; routed = experts the per-expert path would move or run
    on the CPU (routed_fills); cpu_share = fraction of them the backend runs on the CPU (0 offload, 1 cpu,
    else the hybrid split); streamed = experts the stream copies (default every layer whole: the layers kept
    in place in their windows copy only what is missing there, SlotCache.stream_copies). Streaming copies
    every layer whole (one copy a layer: the resident experts cross PCIe again), but queues them all at once
    so copies hide behind compute. The per-expert path copies only what it routes to, each layer's once its
    routing is back on the host, so its copies add to the compute."""
    if sum(missing) == 0:
        return False
    layers = len(missing)
    streamed = layers * num_experts if streamed is None else streamed
    per_expert_tokens = num_tokens * top_k / num_experts
    cpu_slowdown = max(1.0, per_expert_tokens / CPU_BALANCE_TOKENS)
    # fills and CPU runs proceed concurrently: the slower share sets the time
    serve = routed * expert_bytes * max((1 - cpu_share) / (bp * ROUTED_EFFICIENCY), cpu_share * cpu_slowdown / bh)
    # 2 flops per weight element and routed token; a block has expert_bytes / 2 elements at bf16
    compute = layers * num_tokens * top_k * expert_bytes / device_flops
    stream = streamed * expert_bytes / (bp * STREAM_EFFICIENCY)
    return max(stream, compute) <= serve + compute


class PrefillStreamer:
    """Double-buffered layer streaming for one forward; owned by a slot backend.

    Each streamed layer goes whole into a window of E consecutive slots in one copy (SlotCache.stream_layer),
    and its copy is issued when the layer before it starts (its first piece), behind that layer's own copy
    on the copy stream: the copies run back to back while the compute follows one layer behind. The window
    is one that no slot of the running layer sits in; its last readers (the layer before the running one)
    are all queued by then, and the copy waits for them on the device. Issued after the running layer's last
    piece instead (as this did), the copy started only once that layer's pieces had run: each piece reads
    its routing back to the host, which waits for the piece's compute, so the copies and the compute added
    up (H200 box, 8k prompt: 0.37-0.40 s against 0.24 s of copies, docs/PERF.md issue 17); issued at the
    first piece as ~200 copy calls of scattered slots, the host blocked in the driver at PCIe pace."""

    def __init__(self, backend, mode: str = "auto") -> None:
        if mode not in ("auto", "on"):
            raise ValueError(f"a prefill streamer streams 'auto' (when predicted faster) or 'on', not {mode!r}")
        self.b = backend
        self.mode = mode
        self.active = False
        self.reserved: list[int] = []  # slots of the next layer, kept locked while this one runs
        self._prefetched: set[int] = set()
        self._current: int | None = None  # the layer before_layer last prepared in this forward
        # layer -> its slot per expert as a device table [E + 1] (entry E = -1: what id -1, routed nowhere, looks
        # up), for the backend to look a prompt's routing up on the device (SlotCache.lookup_table)
        self.tables: dict[int, object] = {}
        self.streamed_forwards = 0

    def begin(self, num_tokens: int, top_k: int, touch: np.ndarray | None, decode: bool = False) -> None:
        """A forward of num_tokens begins: stream it or not. touch [L, E]: each expert's probability of being
        touched by the forward's tokens (`touched` of the slot table's heat, OffloadBackend.begin_forward's); None
        only for a forward that never streams (one token, or decode). decode: its tokens are one a sequence (a
        batched decode step), which never streams, whatever the mode: no prompt in it."""
        cache, pool = self.b.cache, self.b.pool
        e = pool.num_experts
        self.active, self.reserved, self._prefetched, self._current = False, [], set(), None
        self.tables = {}
        if cache.num_slots < 2 * e or num_tokens <= 1 or decode:
            return
        self.active = self.mode == "on" or self._predicted_faster(num_tokens, top_k, touch)
        self.streamed_forwards += self.active
        if self.active:
            # the first layer's copy now, not at its first piece: that one follows the piece's mixer (~9 ms of an
            # 8k prompt on the H200 box) with the copy engine idle; kept locked (reserved) until that piece ran
            self.reserved = self._prefetch(pool.layers[0], after=None)

    def _predicted_faster(self, num_tokens: int, top_k: int, touch: np.ndarray) -> bool:
        """Whether streaming this forward's layers is predicted faster than routing them (should_stream): every
        extend asks, at its first layer call, while the device waits for the host, so the per-layer sums are made
        for all rows at once."""
        cache, pool, est = self.b.cache, self.b.pool, self.b.estimate
        t, w = cache.table, cache.windows()
        missing, cold_hit, likely = row_sums(t.resident >= 0, touch)  # (rows in pool.layers' order: pool.row)
        # the first w - 2 layers stream into windows kept from the forward before (window_for)
        kept = pool.layers[: w - 2] if w >= 3 else []
        streamed = sum(cache.stream_copies(layer, w - 1 - i) for i, layer in enumerate(kept)) \
            + pool.num_experts * (len(pool.layers) - len(kept))
        share = self.b.cpu_share()
        routed = routed_fills(cold_hit, likely, cache.num_slots, share)
        return should_stream(num_tokens=num_tokens, top_k=top_k, num_experts=pool.num_experts, missing=missing,
                             routed=routed, expert_bytes=pool.expert_bytes, bp=est.bp, bh=est.bh, cpu_share=share,
                             device_flops=self.b.device_flops, streamed=streamed)

    def before_layer(self, layer: int) -> None:
        """Make `layer` fully resident (its copy normally issued when the layer before it started) and issue
        the next layer's copy; a later piece of the same layer (layer-major forward) finds it done."""
        cache = self.b.cache
        if layer == self._current:
            # its copy was waited for at the first piece; waiting again would wait for the next layer's too
            return
        self._current = layer
        if layer not in self._prefetched:
            self._prefetch(layer, after=None)  # the forward's first layer: after everything queued so far
        cache.ready()  # the compute stream waits for this layer's copy, not for the one issued next
        layers, i = self.b.pool.layers, self.b.pool.row[layer]
        # the next layer's window is one the layer before this one used: its compute is all queued now
        self.reserved = self._prefetch(layers[i + 1], after=cache.mark()) if i + 1 < len(layers) else []

    def window_for(self, layer: int) -> int | None:
        """The window `layer` streams into. With W >= 3 windows the first W - 2 layers of the forward keep one
        each (layer i window W - 1 - i) and the rest alternate in windows 0 and 1, so a streamed prompt leaves
        the first layers wholly resident: the next prompt reads them where they are (no copy), and a routed
        extend after it fills each later layer into slots of a layer it already ran, where one that left the
        last layers resident had the first layers' fills evict layers still to run (OffloadBackend.keep_bonus).
        Among the candidates: one without a locked slot (the running layer's, this layer's reserved ones),
        holding the fewest experts of other layers, then the one used least recently. None when every
        window has a locked slot."""
        t, e = self.b.cache.table, self.b.pool.num_experts
        row, w = self.b.pool.row[layer], self.b.cache.windows()
        if w >= 3 and row < w - 2 and not t.locked[(w - 1 - row) * e: (w - row) * e].any():
            return w - 1 - row
        best, pick = None, None
        for k in range(2 if w >= 3 else w):
            span = slice(k * e, (k + 1) * e)
            if t.locked[span].any():
                continue
            owner = t.owner[span]
            key = (int(((owner >= 0) & (owner // e != row)).sum()), int(t.stamp[span].max()), k)
            if best is None or key < best:
                best, pick = key, k
        return pick

    def kept_windows(self) -> np.ndarray:
        """Slots of the windows the first W - 2 layers keep from one streamed prompt to the next (window_for;
        none with fewer than 3 windows): moving anything else in there makes the next streamed prompt copy
        those layers whole again."""
        w, e = self.b.cache.windows(), self.b.pool.num_experts
        return np.arange(2 * e, w * e) if w >= 3 else np.arange(0)

    def _prefetch(self, layer: int, after=None) -> list[int]:
        cache, e = self.b.cache, self.b.pool.num_experts
        st = self.b.stats_[layer]
        window = self.window_for(layer)
        if window is None:  # not in the planned flow (every window in use): fill the misses into free slots
            slots = cache.lookup(layer, range(e))
            cache.table.lock(slots[slots >= 0])
            admitted = cache.admit(layer, [x for x in range(e) if slots[x] < 0], coalesce=True, after=after)
            st.fills += len(admitted)
            st.bytes_moved += len(admitted) * self.b.pool.expert_bytes
            where = cache.lookup(layer, range(e))  # (admit may have found too few slots)
            if (where >= 0).all():  # else the layer's missing experts run as misses (no device lookup table)
                self.tables[layer] = cache.lookup_table(where)
        else:
            where, copied, self.tables[layer], nbytes = cache.stream_layer(layer, window, after=after)
            cache.table.lock(where)
            st.fills += copied
            st.bytes_moved += nbytes  # the whole layer crosses PCIe, unless its window kept it
        self._prefetched.add(layer)
        return where[where >= 0].tolist()
