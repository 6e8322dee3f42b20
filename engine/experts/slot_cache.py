"""One pool of device slots shared by all MoE layers; a slot holds one (layer, expert) block.

S = slots, numel = elements per expert block (block_layout.py). The bookkeeping is `lru.SlotTable`; this file
owns the device buffer [S, numel] and the copy stream. On CPU the "device" buffer is a separate CPU tensor
and a fill is a plain copy, so every piece of bookkeeping runs in CI exactly as on a GPU.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import NamedTuple

import numpy as np
import torch

from engine.experts.aligned import Tiered, pick_aligned
from engine.experts.block_layout import split_block
from engine.experts.host_pool import HostPool
from engine.experts.lru import SlotTable


class FillTiming(NamedTuple):
    nbytes: int
    seconds: float
    with_cpu: bool  # CPU expert runs were in flight alongside (both read host DRAM)


class CopyBatch(NamedTuple):
    """One batch of copies on the copy stream, kept until its timing is read (take_fill_timings)."""

    start: object  # CUDA event before it; None on a CPU device, whose copies ran in line
    end: object  # CUDA event after it; on a CPU device the seconds it took
    nbytes: int
    with_cpu: bool
    ready: float | None  # host time the stream is taken to start it (CUDA): issued, or the batches before it done


# copy batches SlotCache keeps until read (take_fill_timings, at a routed layer call); older ones drop unread. A
# mapped decode's admissions are read at the next prompt, at most this many of them (~2-5 us of host time each)
MAX_TIMED_COPIES = 64


def copy_backlog(batches, rate: float, now: float) -> float:
    """Bytes the copy stream still has to move of `batches` [(host time it may start, bytes)], FIFO and not yet
    done, at `rate` bytes/s: each starts then or when the one before it ends, whichever is later. At least every
    batch after the first: one stream runs them in turn, so none of them has started while the first runs (a
    rate taken too high must not clear a backlog the batches' events still show)."""
    total = float(sum(n for _, n in batches))
    if rate <= 0 or not batches:
        return total
    end = -float("inf")
    for ready, nbytes in batches:
        end = max(end, ready) + nbytes / rate
    return min(total, max(total - batches[0][1], (end - now) * rate))


def copy_runs(experts: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first expert, first slot, count) per run where both step by one: one copy each. A prefill stream
    issued 256 copies a layer, and at ~70 us of host time apiece once the copy queue is deep (H200 box)
    they, not PCIe, set the layer's pace. Many pairs (an extend's first copies ahead, ~140-256, inside its first
    layer call) are sorted and split by numpy: 256 pairs in one run took the loop 193 us of the dev box, numpy 60."""
    if len(experts) < NUMPY_RUNS:
        return copy_runs_loop(experts, slots)
    e, s = np.asarray(experts, dtype=np.int64), np.asarray(slots, dtype=np.int64)
    order = np.lexsort((s, e))  # (by expert, then slot: sorted pairs)
    e, s = e[order], s[order]
    start = np.ones(len(e), dtype=bool)
    start[1:] = (np.diff(e) != 1) | (np.diff(s) != 1)
    at = np.flatnonzero(start)
    return list(zip(e[at].tolist(), s[at].tolist(), np.diff(np.append(at, len(e))).tolist()))


def copy_runs_loop(experts: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """copy_runs one pair at a time (the way for a few pairs, and the reference)."""
    runs: list[tuple[int, int, int]] = []
    for e, s in sorted(zip(experts, slots)):
        if runs and runs[-1][0] + runs[-1][2] == e and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs


def window_runs(todo: np.ndarray) -> int:
    """len(copy_runs(todo, base + todo)) for ascending experts `todo` copied to the same offsets of a window:
    one run per stretch of consecutive ids, counted without building the runs (_copy builds them once)."""
    return int(len(todo) > 0) + int((np.diff(todo) != 1).sum())


# copy_runs of this many pairs or more go through numpy (fewer: numpy's fixed cost is the larger)
NUMPY_RUNS = 64
# More fills than this in one layer call (a prompt's tokens routing to most of a layer) choose and pair their slots
# so runs of both copy at once (SlotCache.admit's coalesce, aligned.py); decode's few fills keep theirs.
COALESCE_FILLS = 16
# a layer mostly in place in its streaming window copies the experts missing there in at most this many copies
# (runs of consecutive slots); more, and it copies the whole layer in one (stream_layer)
PARTIAL_RUNS = 8
# device lookup tables kept by content (lookup_table): a forward's wholly resident and streamed layers' (each
# prompt streamed into the same windows makes the same tables)
LOOKUPS_KEPT = 32


class SlotCache:
    def __init__(self, pool: HostPool, num_slots: int, device: torch.device | str, policy: str = "lru") -> None:
        self.pool, self.device = pool, torch.device(device)
        total = pool.num_experts * len(pool.layers)
        if not 1 <= num_slots <= total:
            raise ValueError(f"--moe-slots must be between 1 and {total} (all experts), got {num_slots}")
        self.table = SlotTable(len(pool.layers), pool.num_experts, num_slots, policy)
        self.buf = self._alloc(num_slots)  # [S, numel]
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        # the copy batches not yet read (take_fill_timings), oldest first. Every one on CUDA: a routed prompt's
        # copies ahead are still in flight at the next layer call, and timing only the last batch once done times
        # only those that end early (the split then takes the copy engine for faster than it runs). On a CPU
        # device only the last: the backend ran its experts after it (_fill_run_s). with_cpu is kept with the
        # batch because on CUDA its timing is read a layer call or more after it was issued
        self._copies: deque[CopyBatch] = deque(maxlen=MAX_TIMED_COPIES)
        # bytes/s the owner takes the copy stream to run at (0: unknown): from it, when the stream will have done
        # what it has been given (_drained), so a batch queued behind others counts as starting after them
        self.copy_rate = 0.0
        self._drained = 0.0  # host time
        self.placements = 0  # calls that copied experts into slots (a mapped decode checks it, mapped.py)
        self.copy_calls = 0  # copies issued, one a run of consecutive experts into consecutive slots (_copy_rows)
        self._buf_rows: tuple | None = None  # self.buf's slots as views, made at the first copy (_copy_rows)
        self._host_rows: dict[int, tuple] = {}  # pool row -> (its host blocks' address, their views)
        # device lookup tables by their content (lookup_table): a wholly resident layer's is the same call after call
        self._lookups: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    def _alloc(self, n: int) -> torch.Tensor:
        try:
            return torch.empty(n, self.pool.layout.numel, dtype=self.pool.dtype, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise ValueError(f"{n} expert slots ({n * self.pool.expert_bytes / 2**30:.1f} GiB) do not fit "
                             "on the device: ask for fewer slots or a smaller KV budget") from exc

    def weights(self, slot: int):
        """(gate_up [2I, H], down [H, I]) views of one slot."""
        return split_block(self.buf[slot], self.pool.layout)

    def all_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [S, 2I, H], down [S, H, I]) views of every slot: expert i of them is slot i (the grouped
        expert kernels read them in place, an expert stride of one block)."""
        lay = self.pool.layout
        gu = lay.gate_up_numel
        return self.buf[:, :gu].view(-1, 2 * lay.inter, lay.hidden), self.buf[:, gu:].view(-1, lay.hidden, lay.inter)

    def lookup(self, layer: int, experts) -> np.ndarray:
        return self.table.lookup(self.pool.row[layer], experts)

    def admit(self, layer: int, experts: list[int], lo: int = 0, hi: int | None = None, *,
              with_cpu: bool = False, coalesce: bool = False, after=None, bonus=None) -> list[int]:
        """Copy as many of `experts` (of `layer`) as unlocked slots in [lo, hi) allow; lock and return
        their slots (a prefix of `experts`). On CUDA the copies run on the copy stream; call `ready()`.
        with_cpu: CPU expert runs go on alongside these copies (reported back by `take_fill_timings`).
        coalesce: choose among the victims about as cold as the last one needed and pair them so that runs copy
        at once (aligned.pick_aligned) — for many experts at once; otherwise the first victim goes to the first
        expert (fills come hottest first, and under lru that decides which of them a tie evicts next). after: a
        CUDA event after the last work that read any victim (default: everything queued on the compute stream so
        far). bonus: heat each slot is still to gain (SlotTable.victims)."""
        if coalesce:
            return self.admit_tiered(layer, Tiered(np.asarray(experts, dtype=np.int64), len(experts)), len(experts),
                                     lo, hi, with_cpu=with_cpu, after=after, bonus=bonus)[1]
        victims = self.table.victims(len(experts), lo, hi, bonus)
        if not len(victims):
            return []
        victims = victims.tolist()
        self.place(layer, list(experts[: len(victims)]), victims, with_cpu=with_cpu, after=after)
        self.table.lock(victims)
        return victims

    def admit_tiered(self, layer: int, experts: Tiered, n: int, lo: int = 0, hi: int | None = None, *,
                     with_cpu: bool = False, after=None, bonus=None) -> tuple[list[int], list[int]]:
        """admit for n of `experts` (its must ones first, any of its tier after) into victims chosen and paired
        by aligned.pick_aligned among the slots SlotTable.victim_tier gives: as few copy runs as the choice
        allows. -> (the experts placed, their slots), locked; fewer when fewer slots are unlocked."""
        victims = self.table.victim_tier(n, lo, hi, bonus)
        if not len(victims.items) or n <= 0:
            return [], []
        placed, slots = pick_aligned(experts, victims, n, self.pool.num_experts)
        self.place(layer, placed, slots, with_cpu=with_cpu, after=after)
        self.table.lock(slots)
        return placed, slots

    def place(self, layer: int, experts: list[int], slots: list[int], *, with_cpu: bool = False, after=None):
        """Copy `experts` of `layer` into `slots` (pairwise) and record them there; on CUDA on the copy stream,
        after the work queued so far on the compute stream (which may still read the victims), or only after
        the event `after` when the caller knows the victims' last readers came before it. -> a CUDA event
        after the copies (None on a CPU device: they are done)."""
        done = self._copy(layer, experts, slots, with_cpu, after)
        self.table.assign_many(slots, self.pool.row[layer], experts)
        return done

    def windows(self) -> int:
        """How many whole layers fit side by side: window k is slots [k E, (k + 1) E), expert e at k E + e."""
        return self.num_slots // self.pool.num_experts

    def stream_layer(self, layer: int, window: int, *, after=None) -> tuple[np.ndarray, int, torch.Tensor, int]:
        """Make every expert of `layer` resident for a streamed prefill with ONE copy: the whole layer of the
        host pool into window `window` (expert e to slot window * E + e). Whatever the window held is evicted;
        the layer's experts resident in another window move into this one (so the layer then reads one window
        and nothing else of any window, and the next layer may take any other); those resident past the last
        window stay where they are, and their copies in the window are left unowned. One copy call a layer
        where coalesced victims took ~200 (scattered slots), whose issue blocked the host at PCIe pace once
        the copy queue was deep: it moves the whole layer, 1/(1 - resident share) times the bytes of the misses
        alone. A window that holds the layer in place already (kept from the forward before,
        PrefillStreamer.window_for) copies only the experts not in place, in at most PARTIAL_RUNS copies
        (else the whole layer), or nothing. -> (the layer's slot per expert [E], experts made resident, the same
        slots as a device lookup table [E + 1] int32 whose entry E is -1, uploaded ahead of the layer's copy:
        lookup_table, the bytes copied)."""
        e_count, row, t = self.pool.num_experts, self.pool.row[layer], self.table
        base = window * e_count
        if not 0 <= window < self.windows() or t.locked[base: base + e_count].any():
            raise ValueError(f"window {window} of the expert slots is out of range or still in use")
        stay, todo, whole = self._stream_plan(layer, window)
        copy = np.arange(e_count) if whole else todo
        t.release(np.arange(base, base + e_count) if whole else base + todo)  # every slot the copy writes
        for e in np.flatnonzero(~stay).tolist() if whole else todo.tolist():
            t.assign(base + e, row, e)
        slots = t.resident[row].copy()
        table = self.lookup_table(slots)
        if len(copy):
            self._copy(layer, copy.tolist(), (base + copy).tolist(), False, after)
        return slots, len(todo), table, len(copy) * self.pool.expert_bytes

    def _stream_plan(self, layer: int, window: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """stream_layer's plan: (the layer's experts that stay past the windows [E] bool, the experts to make
        resident in the window, whether the whole layer is copied)."""
        e_count, row, t = self.pool.num_experts, self.pool.row[layer], self.table
        base = window * e_count
        stay = t.resident[row] >= self.windows() * e_count
        placed = t.owner[base: base + e_count] == row * e_count + np.arange(e_count)
        todo = np.flatnonzero(~placed & ~stay)
        return stay, todo, window_runs(todo) > PARTIAL_RUNS

    def stream_copies(self, layer: int, window: int) -> int:
        """Experts stream_layer(layer, window) would copy now."""
        _, todo, whole = self._stream_plan(layer, window)
        return self.pool.num_experts if whole else len(todo)

    def lookup_table(self, slots: np.ndarray) -> torch.Tensor:
        """slots [E] (a layer's slot per expert, -1 for none) as an int32 device table [E + 1] whose entry E
        is -1 (what routing id -1, a padding pair, looks up), for pairs to find their slots on the device.
        On CUDA it goes on the copy stream, ahead of the copies issued after it: on the compute stream the
        1 KB copy queued on the copy engine behind the next layer's stream and held that layer's compute
        until the whole 1.6 GB had crossed (H200 box, 2026-12-02: compute and copies ran one after the other).
        The LOOKUPS_KEPT last tables are kept by content and handed out again (never written after their upload)."""
        host = np.append(slots, -1).astype(np.int32)
        if self.copy_stream is None:
            return torch.from_numpy(host)
        key = host.tobytes()
        kept = self._lookups.get(key)
        if kept is not None:  # uploaded earlier and never written since: no pinned buffer, copy or stream switch
            self._lookups.move_to_end(key)
            kept.record_stream(torch.cuda.current_stream(self.device))  # (a reader on another stream than before)
            return kept
        reader = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            # allocated on the stream that writes it: a block the compute stream freed may still be written by
            # its queued kernels (the allocator hands it back to that stream at once), and a copy on another
            # stream into it raced them (a 256-token extend read a garbage table, H200 box, 2026-12-02)
            out = torch.empty(host.shape, dtype=torch.int32, device=self.device)
            out.copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        out.record_stream(reader)  # not handed out again before the compute stream's read of it
        self._lookups[key] = out
        if len(self._lookups) > LOOKUPS_KEPT:
            self._lookups.popitem(last=False)  # (freed behind the reads queued so far: record_stream)
        return out

    def _copy(self, layer: int, experts, slots, with_cpu: bool, after) -> torch.cuda.Event | None:
        """The bytes of `place`: experts of `layer` into slots, in copy_runs; -> an event after them (CUDA)."""
        host = self.pool.wait_layer(layer)
        self.placements += 1
        if self.copy_stream is None:
            t0 = time.perf_counter()
            self._copy_rows(self.pool.row[layer], host, list(experts), list(slots), non_blocking=False)
            self._copies.clear()
            self._copies.append(CopyBatch(None, time.perf_counter() - t0, len(slots) * self.pool.expert_bytes,
                                          with_cpu, None))
            return None
        return self._copy_async(self.pool.row[layer], host, list(experts), list(slots), with_cpu, after)

    def _copy_async(self, row: int, host: torch.Tensor, experts: list[int], slots: list[int], with_cpu: bool,
                    after=None) -> torch.cuda.Event:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # a victim may still be read by kernels queued earlier on the compute stream
        self.copy_stream.wait_event(self.mark() if after is None else after)
        with torch.cuda.stream(self.copy_stream):
            start.record()
            self._copy_rows(row, host, experts, slots, non_blocking=True)
            end.record()
        nbytes, now = len(slots) * self.pool.expert_bytes, time.perf_counter()
        # behind the batches still in flight (the stream runs them in turn: the last one done, all are)
        ready = max(now, self._drained) if self._copies and self._in_flight(self._copies[-1]) else now
        self._drained = ready + nbytes / self.copy_rate if self.copy_rate > 0 else now
        self._copies.append(CopyBatch(start, end, nbytes, with_cpu, ready))
        return end

    def _copy_rows(self, row: int, host: torch.Tensor, experts: list[int], slots: list[int],
                   non_blocking: bool) -> None:
        """host[e] -> buf[s] for each pair (host: pool row `row`'s blocks), a copy a run (copy_runs), queued by one
        torch call whose loop runs in C++ with the GIL let go (torch._foreach_copy_). A copy_ a run from Python
        cost the engine thread ~20 us each (the H200 box: 2.3 ms in an extend's first layer while it issued 124
        copies ahead, the next layer not yet queued). The slots' and blocks' views are made once."""
        runs = copy_runs(experts, slots)
        if not runs:
            return
        self.copy_calls += len(runs)
        if self._buf_rows is None:
            self._buf_rows = self.buf.unbind(0)
        kept = self._host_rows.get(row)
        if kept is None or kept[0] != host.data_ptr():
            kept = self._host_rows[row] = (host.data_ptr(), host.unbind(0))
        slot_rows, host_rows = self._buf_rows, kept[1]
        dst = [slot_rows[s] if n == 1 else self.buf[s: s + n] for _, s, n in runs]
        src = [host_rows[e] if n == 1 else host[e: e + n] for e, _, n in runs]
        torch._foreach_copy_(dst, src, non_blocking=non_blocking)

    def mark(self):
        """A CUDA event after the compute queued so far, for `after=` of a later fill (None on a CPU device,
        whose copies run in line)."""
        if self.copy_stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def ready(self) -> None:
        """Make the compute stream wait for the fills issued so far (no host sync)."""
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def last_copy_end(self):
        """The CUDA event after the copies issued last, while they may be in flight (None on a CPU device, or
        once their timing has been taken)."""
        return self._copies[-1].end if self._copies and self._copies[-1].start is not None else None

    def take_fill_timings(self) -> list[FillTiming]:
        """The timings of the copy batches finished since the last call, oldest first, without blocking (on CUDA
        the stream runs them in order: reading stops at the first still in flight)."""
        out = []
        while self._copies and not self._in_flight(self._copies[0]):
            c = self._copies.popleft()
            out.append(FillTiming(c.nbytes, c.end if c.start is None else c.start.elapsed_time(c.end) / 1e3,
                                  c.with_cpu))
        return out

    def copy_backlog(self, rate: float) -> float:
        """Bytes the copy stream is estimated still to move of the batches issued so far (copy_backlog at `rate`
        bytes/s from when each was taken to start; 0 on a CPU device, whose copies run in line). Left unread:
        their timings wait for take_fill_timings."""
        pending = [(c.ready, c.nbytes) for c in self._copies if self._in_flight(c)]
        return copy_backlog(pending, rate, time.perf_counter()) if pending else 0.0

    @staticmethod
    def _in_flight(c: CopyBatch) -> bool:
        return c.start is not None and not c.end.query()

    def resident_count(self, layer: int) -> int:
        return self.table.resident_count(self.pool.row[layer])

    def resize(self, num_slots: int) -> None:
        """Change the slot count at a scheduler safe point; keeps the most recently used residents.

        Impossible sizes raise ValueError before anything is freed; the host pool is never touched."""
        total = self.pool.num_experts * len(self.pool.layers)
        if not 1 <= num_slots <= total:
            raise ValueError(f"the expert cache can hold 1..{total} slots, got {num_slots}")
        if self.table.locked.any():
            raise ValueError("resize the expert cache between steps, not while a step holds slots")
        moves = self.table.plan_resize(num_slots)
        self.ready()  # pending fills land before their slots move
        new = self._alloc(num_slots)  # may raise ValueError: nothing changed yet
        if moves:
            old_idx = torch.tensor([m[0] for m in moves], device=self.device)
            new[torch.tensor([m[1] for m in moves], device=self.device)] = self.buf[old_idx]
        self.buf, self._buf_rows = new, None
        self.table.apply_resize(num_slots, moves)
