"""`--moe-backend offload`: misses are copied into device slots and run there. Also the base of `cpu`
and `hybrid`, which differ only in how many of a step's m misses they fill (`split`).

T = tokens, K = experts per token, H = hidden. Per MoE layer and step:
route (host grouping) -> hits run from their slots; of the m misses, split(m) are filled (copy stream)
and run on the device, the rest run on the CPU concurrently from the host pool -> outputs land in
y [T*K, H] by (token, k) position -> `compute.combine` sums over k. The device's share runs in device_runs.py
(DeviceRuns: hits while the copies land, then the fills; a layer with every expert in a slot without reading its
routing back), the CPU share in cpu_jobs.py (collected, or joined on the device, in cpu_collect.py: CpuCollect);
a routed prompt's copies ahead of the next layer are planned in
lookahead.py (CopiesAhead), the CPU's idle time between its jobs is timed in handoff.py (HandoffClock, CallTiming),
what each call adds to the heat and the stats is counted in counting.py (CallCounting, settle() for the calls
that did not read their routing back), and idle time's refresh of the slots is refresh.py's (IdleRefresh).
"""
from __future__ import annotations

import importlib.util
import time
from typing import NamedTuple

import numpy as np
import torch

from engine.experts.compute import Routing, combine
from engine.experts.counting import CallCounting
from engine.experts import cpu_jobs
from engine.experts.cpu_collect import CpuCollect
from engine.experts.cpu_jobs import PROMPT_TOKENS, CpuJobs
from engine.experts.device_runs import DeviceRuns
from engine.experts.handoff import CallTiming, HandoffClock
from engine.experts.host_pool import HostPool
from engine.experts.lookahead import LOOKAHEAD_MODES, CopiesAhead, TouchRatio
from engine.experts.policy import BandwidthEstimate
from engine.experts.prefill_stream import REFILL_USES, STREAM_MODES, PrefillStreamer, pick_probability, touch_of
from engine.experts.refresh import REFRESH_MODES, IdleRefresh
from engine.experts.slot_cache import SlotCache
from engine.experts.slot_runner import SlotRunner
from engine.experts.stats import ExpertStats, LayerCall

# how a fast path decodes through the cache: mapped (misses read in place, one graph a step), host (each cache
# layer's fills and CPU runs decided by the host between graphs), auto (mapped unless the backend is cpu)
DECODE_MODES = ("auto", "mapped", "host")
# whether a mapped decode prefetches each layer's likely expert (mapped.py): auto = on CUDA with a mapped decode
# (H200 box, 8 layers at 37.5% in slots: offload 1.013x and hybrid 1.019x decode b1, Zipf routing even; docs/PERF.md)
PREFETCH_MODES = ("auto", "on", "off")


class CallPlan(NamedTuple):
    """Where a routed layer call's experts run (OffloadBackend._plan_call), as indices into its Routing.experts."""

    hits: list[int]  # in a slot, run from it
    hit_slots: np.ndarray  # [len(hits)] their slots
    misses: list[int]  # not in a slot: the most tokens first, then the hottest
    fills: list[int]  # the misses copied into slots and run on the device (the first split() of them)
    on_cpu: list[int]  # the other misses, run on the CPU from the host pool
    ahead: tuple | None  # (the next MoE layer, its experts to copy in while this one runs) or None
    behind: int  # experts' worth of copies still in flight that the plan counted (_behind)
    tail: bool = False  # a prompt's last routed layer: nothing copied ahead, every later layer wholly resident


class OffloadBackend(CopiesAhead, IdleRefresh, CallTiming, DeviceRuns, CallCounting, CpuCollect):
    name = "offload"
    uses_handoff = False  # whether split / ahead_fills read self.handoff (the CPU's idle time per layer call)
    runs_cpu_share = False  # whether a layer call may run some of its misses on the CPU (cpu_jobs.py)
    tops_up = True  # whether a nearly resident layer's last missing experts are copied ahead (lookahead.TOP_UP_S)

    def __init__(self, pool: HostPool, num_slots: int, device: torch.device | str = "cpu", *,
                 estimate: BandwidthEstimate | None = None, stream_prefill: bool | str = True,
                 slot_policy: str = "lru", grouped: bool | None = None, decode: str = "auto",
                 prefetch: bool | str = False, lookahead: bool | str = "auto",
                 refresh: bool | str = "auto") -> None:
        self.pool, self.device = pool, torch.device(device)
        self.cache = SlotCache(pool, num_slots, self.device, slot_policy)
        self.runner = SlotRunner(self.cache)  # the experts in slots, run in place
        self.stats_ = ExpertStats(pool.layers)
        self.estimate = estimate or BandwidthEstimate()
        # prompts stream whole layers: auto (True) when predicted faster, on always, off (False) never
        mode = _mode(stream_prefill, STREAM_MODES, "--prefill-stream", true="auto")
        self.streamer = PrefillStreamer(self, mode) if mode != "off" else None
        self._fill_run_s = 0.0  # CPU device: seconds the experts of the last fill round took to run
        # a prompt's compute for the prefill choice, as flop/s of its routed experts alone: an 8k prompt through
        # 8 resident layers at the Qwen3.6-35B-A3B widths took 88 ms on the H200 (2 x 8 x 8192 x 8 x 3.1M
        # weights of routed experts: ~4e13/s with attention, DeltaNet and the rest of the layer counted in)
        self.device_flops = 4e13 if self.device.type == "cuda" else 5e10
        self._held = False  # a forward announced by begin_forward(hold=True) runs until end_forward
        self._deferred = None  # begin_forward(defer=True)'s (num_tokens, top_k, span), until the first layer call
        self._unsettled: list[tuple] = []  # streamed layer calls not yet counted: (layer, topk_ids, moment, span)
        self._sent: list[tuple] = []  # ... whose routing is on its way to the host (send_back): (calls, host, event)
        self._span = 1  # the longest sequence's tokens in the running forward (begin_forward)
        # [L, E]: heat a routed prompt forward will add to each expert, plus a refill (begin_forward)
        self._ahead = None
        self._touch = None  # [L, E]: the probability a routed prompt forward's tokens touch each expert (begin_forward)
        self._pick = None  # [L, E]: ... that one of its tokens routes to each (pick_probability)
        self.touch_ratio = TouchRatio()  # distinct experts a routed prompt call touches / the heat's prediction
        self._looked: dict[int, np.ndarray] = {}  # layer -> experts copied in ahead of its routing, not yet counted
        self._seen: dict[int, int] = {}  # pool row -> tokens its calls have run in this forward
        self._tokens = self._top_k = 0  # tokens and experts per token of the forward (begin_forward)
        self._set_modes(lookahead, refresh, decode, prefetch)
        # the CPU's idle time per routed prompt layer call besides its runs (handoff.py), CUDA events on the device
        self.handoff_clock = HandoffClock(_timing_event if self.device.type == "cuda" else None)
        # device experts in one launch pair of the grouped Triton kernels, reading the slots in place (default
        # on CUDA); else one expert at a time through torch (the reference, and the path on a CPU device)
        self.grouped = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None \
            if grouped is None else grouped
        # CUDA: a routed prompt's CPU outputs and their positions go to page-locked buffers that the device reads
        # in place (mailbox_triton.scatter_rows); an H2D copy of them queued behind the copies ahead
        self.cpu_jobs = CpuJobs(pool, self.device, zero_copy=self.grouped and self.device.type == "cuda")
        self.mapped = None  # MappedExperts, made by mapped_decode() for a fast path
        self.call_log: list[LayerCall] | None = None  # a list: every layer call appends its LayerCall
        self._copies_in = 0  # the cache's copy calls as the running layer call began
        self.tail = None  # hybrid.TailClock: how late a prompt's last routed layer's fills land (hybrid's split)

    def _set_modes(self, lookahead: bool | str, refresh: bool | str, decode: str, prefetch: bool | str) -> None:
        """--moe-lookahead, --moe-refresh, --moe-decode and --moe-prefetch, checked (ValueError) and resolved for
        this device and backend."""
        lookahead = _mode(lookahead, LOOKAHEAD_MODES, "--moe-lookahead")
        # auto: where copies overlap compute (CUDA); on a CPU device a fill is a copy in line, nothing to overlap
        self.lookahead = lookahead == "on" or (lookahead == "auto" and self.device.type == "cuda")
        refresh = _mode(refresh, REFRESH_MODES, "--moe-refresh")
        # auto: on CUDA, whose copies run on the copy engine; a CPU engine's idle time is its cores'
        self.refresh_idle = refresh == "on" or (refresh == "auto" and self.device.type == "cuda")
        self.decode_mode = _mode(decode, DECODE_MODES, "--moe-decode")
        prefetch = _mode(prefetch, PREFETCH_MODES, "--moe-prefetch")
        host_decode = decode == "host" or (decode == "auto" and self.name == "cpu")
        if prefetch == "on" and host_decode:
            raise ValueError("--moe-prefetch on works inside the mapped decode, and this one decodes on the host "
                             f"(--moe-backend {self.name}, --moe-decode {decode}): use --moe-decode mapped or drop "
                             "--moe-prefetch")
        # a mapped decode copies each layer's likely expert in ahead (mapped.py); auto where it overlaps PCIe
        self.prefetch = prefetch == "on" or (prefetch == "auto" and not host_decode and self.device.type == "cuda")

    # --- policy hooks, overridden by cpu / hybrid
    def split(self, m: int, busy: int = 0, per: float = 1.0, tail: bool = False) -> int:
        """How many of m misses to fill (the rest run on the CPU); busy: experts the copy stream moves besides
        (the next layer's, copied ahead, and earlier copies still in flight: _behind); per: (token, expert) pairs
        per miss (a CPU run's rate depends on it); tail: a prompt's last routed layer (CallPlan.tail)."""
        return m

    def ahead_fills(self, expected: float, likely: int, per: float = 1.0, behind: int = 0) -> int:
        """How many of the next layer's `likely` misses (expected: its misses the heat predicts) to copy in
        ahead of its routing, behind `behind` experts' worth of copies still in flight: all of them here (every
        miss is filled)."""
        return likely

    def cpu_share(self) -> float:
        return 0.0

    def reserve(self, tokens: int, top_k: int, dtype: torch.dtype) -> None:
        """Outside any request (the engine's warm-up): the buffers of the CPU's share of a prompt call of up to
        `tokens` tokens sized now (CpuJobs.reserve), for a backend that runs one."""
        if self.runs_cpu_share:
            self.cpu_jobs.reserve(tokens, top_k, dtype)

    def prompt_graphs(self, capture: bool) -> None:
        """A fast path's prompts: a wholly resident layer's run padded to a token bucket, one CUDA graph a bucket
        when capture (SlotRunner.unread)."""
        self.runner.prompt_graphs(capture)

    def observe(self, path: str, nbytes: int, seconds: float, together: bool, per: float = 1.0) -> None:
        """The time the fill path ("fill") or the CPU path ("cpu") took for nbytes of experts; together:
        the other path ran alongside; per: (token, expert) pairs per expert. Only hybrid chooses by it."""

    def mapped_decode(self):
        """For a fast path's decode: MappedExperts (mapped.py; the step's kernels read misses in place from the
        host pool, the step one graph) or None (the host runs this cache's layers between graphs). auto: mapped
        where the kernels can read the pool — pinned on CUDA (any pool on a CPU device) — unless this backend
        runs misses on the CPU by design (cpu)."""
        mode = self.decode_mode
        if mode == "auto":
            mode = "host" if self.name == "cpu" else "mapped"
        if mode == "host":
            return None
        self.pool.wait()
        if self.device.type == "cuda" and not self.pool.pinned:
            if self.decode_mode == "mapped":
                raise ValueError("--moe-decode mapped reads experts in place from page-locked host memory, and "
                                 "pinning the expert pool failed: raise the memlock limit or use --moe-decode host")
            return None
        if self.mapped is None:
            from engine.experts.mapped import MappedExperts

            self.mapped = MappedExperts(self)
        return self.mapped

    # --- the seam
    def begin_forward(self, num_tokens: int, top_k: int, hold: bool = False, span: int | None = None,
                      defer: bool = False) -> None:
        """Once per forward, before its layers: picks layer streaming or not for all its tokens. Without
        it `forward` begins a forward at the first MoE layer itself (one call per layer); `hold=True`
        keeps this one until `end_forward`, for a model that runs a layer in several pieces. span: the
        longest sequence's tokens in this forward (a prompt's length; 1: decode tokens, one a sequence, which
        never stream; None: not said, as 1 but for streaming): the cache's heat ages by them and weighs each
        expert by the tokens routed to it (lru.prompt_use_weights). defer (held forwards): the work is done at
        the forward's first layer call instead, so the device runs the layers queued before it (the embedding,
        the first layer's mixer) while the host plans; nothing of the cache changes in between."""
        if defer:
            if not hold:
                raise ValueError("begin_forward(defer=True) is for a held forward (hold=True)")
            self.cpu_jobs.drop()
            self._deferred, self._held = (num_tokens, top_k, span), True
            return
        self._deferred = None
        decode, span = span == 1, span or 1
        self.cpu_jobs.drop()  # a joined CPU job of a forward that failed before its end_forward
        self._held = hold
        self.settle()
        t = self.cache.table
        # [L, E] per token, from the heat before this prompt fades it: the streamer's choice and a routed prompt's
        # fills both predict by it
        q = pick_probability(t.heat / t.moment()[1], top_k) if num_tokens > 1 and (
            span > 1 or (self.streamer is not None and not decode)) else None
        touch = None if q is None else touch_of(q, num_tokens)  # (~0.15 ms at [8, 256]: made once)
        if self.streamer is not None:
            self.streamer.begin(num_tokens, top_k, touch, decode=decode)
        self._ahead = self._touch = self._pick = None
        self.handoff_clock.begin()
        self.handoff_clock.read_gaps()  # the last forward's, done by now
        self._looked, self._seen, self._tokens, self._top_k = {}, {}, num_tokens, top_k
        if span > 1 and not (self.streamer is not None and self.streamer.active):
            self._pick, self._touch = q, touch
            self._ahead = self._use_weights(num_tokens * q, span) + REFILL_USES * self._touch
        self._span = max(1, int(span))
        self.cache.table.tokens_passed(self._span - 1)
        if self._looking_ahead():
            # the first MoE layer's likely misses copy in while the layers before its experts run (after a
            # streamed prompt the slots hold the last layers' and the first's experts: the copy engine else
            # waits for the first routing to start on the second layer's)
            first = self._plan_row(0, self._behind())
            if first is not None:
                self._copy_ahead(first[0], first[1], with_cpu=False, after=None, then=False)

    def end_forward(self) -> None:
        self._deferred = None  # a held forward that ran no layer call
        self.cpu_jobs.collect()  # the last CPU job joined on the device, its rate counted while the forward's on
        self._held = False
        # the forward's copies timed now, while the device runs its last layers (settle waits for them next): else
        # the next forward's first layer call took them in, before it queued anything
        self._observe_fill()
        self.settle()  # before _looked goes: a resident layer's copies ahead are counted there
        self._ahead = self._touch = self._pick = None
        self._looked = {}

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids [T, K], topk_w [T, K] -> [T, H] (routed experts only)."""
        t_in = time.perf_counter()
        self._copies_in = self.cache.copy_calls  # (the call log counts the copies the call issues)
        streaming = self._enter_call(layer, x, topk_ids)
        slots = self._unread_slots(layer, x, streaming)
        if slots is not None:
            return self._forward_unread(layer, x, topk_ids, topk_w, slots, t_in)
        early = None
        if not streaming:
            self._mark_enter(layer)
            early = self._ahead_inputs(layer)  # while the device computes the routing
            if x.shape[0] >= PROMPT_TOKENS and self.cpu_share() > 0:
                self.cpu_jobs.stage(x)
        routing = Routing.of(topk_ids)
        routed_at = time.perf_counter()
        self.handoff_clock.read_gaps()  # the routing's read-back waited for the device: earlier gaps' are done
        # a CPU job joined on the device, whose outputs this routing read: taken now, its rate counted once this
        # call's own job is under way (the plan below splits by the rates of the jobs before it)
        self.cpu_jobs.collect(hold=True)
        plan = self._plan_call(layer, routing, streaming, early)
        y = (x.new_zeros if routing.unrouted else x.new_empty)(x.shape[0] * routing.top_k, x.shape[1])  # [T*K, H]
        planned = time.perf_counter()
        join = cpu_jobs.JOIN_ON_DEVICE and self.grouped and self._held and x.shape[0] >= PROMPT_TOKENS
        pending = self.cpu_jobs.start(layer, x, routing, plan.on_cpu, raise_flag=join)
        self.cpu_jobs.observe_held()  # (after the CPU's job is under way, as the counts alone)
        self._count_looked(layer, routing.experts)
        self._observe_touch(layer, routing.experts, x.shape[0])
        ran, probe = self._queue_device(layer, x, y, routing, topk_ids, plan, pending is not None, streaming)
        queued = time.perf_counter()
        cpu = self._join_cpu(layer, pending, y, routing, plan, routed_at, probe) if join and pending is not None \
            else self._collect_cpu(layer, pending, y, routing, plan, routed_at)
        self._unlock()
        self._count(layer, len(plan.hits), len(plan.misses), len(plan.fills), len(plan.on_cpu))
        out = combine(y, topk_w)
        self._mark_exit(layer)
        if self.call_log is not None:
            self._log_call(layer, "joined" if cpu.joined else "routed", t_in, len(plan.hits), len(plan.misses),
                           len(plan.fills), len(plan.on_cpu), len(self._looked.get(plan.ahead[0], ())) if plan.ahead
                           else 0, plan.behind, routed_at, cpu.started, cpu.seconds, cpu.waited, planned, cpu.woke,
                           ran, queued)
        return out

    # --- a layer call's steps, in forward's order
    def _enter_call(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> bool:
        """A layer call begins (and the forward, at its first MoE layer unless begin_forward held it): the fill
        timings taken in, the slot table's clock ticked, a streamed layer's copy waited for or the tokens of a
        routed one's pieces counted (CopiesAhead._more_pieces). -> whether the forward streams."""
        if self._deferred is not None:
            self.begin_forward(*self._deferred[:2], hold=True, span=self._deferred[2])
        elif layer == self.pool.layers[0] and not self._held:  # the first MoE layer sees all its tokens
            self.begin_forward(x.shape[0], topk_ids.shape[1])
        self._observe_fill()
        self.cache.table.tick()
        streaming = self.streamer is not None and self.streamer.active
        if streaming:
            self.streamer.before_layer(layer)  # waits for this layer's copy, issues the next layer's
        else:
            row = self.pool.row[layer]
            self._seen[row] = self._seen.get(row, 0) + x.shape[0]
        return streaming

    def _unread_slots(self, layer: int, x: torch.Tensor, streaming: bool) -> torch.Tensor | None:
        """The layer's expert -> slot table [E + 1] when every expert of it is in a slot and the grouped kernels
        run x, for a call that leaves its routing on the device (DeviceRuns._forward_unread): a streamed layer's,
        or a routed prompt's wholly resident layer's (then made ready on the compute stream); else None."""
        if streaming:
            tables = self.streamer.tables
            return tables[layer] if self.grouped and x.dtype == self.pool.dtype and layer in tables else None
        table, row = self.cache.table, self.pool.row[layer]
        if self.grouped and x.dtype == self.pool.dtype and (table.resident[row] >= 0).all():
            slots = self.cache.lookup_table(table.resident[row])
            self.cache.ready()  # the table, and the last layer's copies ahead into some of these slots
            return slots
        return None

    def _plan_call(self, layer: int, routing: Routing, streaming: bool, early=None) -> CallPlan:
        """A routed call's plan: its heat noted, its hits touched and locked for the call, its misses ordered and
        split (split(); a streamed layer's all filled) and the next layer's copies ahead (none while streaming;
        early: their _ahead_inputs, made before the routing came back)."""
        table, row = self.cache.table, self.pool.row[layer]
        table.note_use(row, routing.experts, weights=self._use_weights(routing.counts, self._span))
        slots = self.cache.lookup(layer, routing.experts)
        hit = np.flatnonzero(slots >= 0)
        # fills take the misses with the most tokens, then the hottest (the ones a slot will serve again);
        # the CPU runs the rest from the host pool
        heat = table.heat[row]
        miss = np.flatnonzero(slots < 0)
        miss = miss[np.lexsort((-heat[routing.experts[miss]], -routing.counts[miss]))]
        hit_slots = slots[hit]
        table.touch(hit_slots)
        table.lock(hit_slots)
        # copies still in flight: this call's fills and the next layer's copies ahead queue behind them
        behind = self._behind() if not streaming and (len(miss) or self._looking_ahead()) else 0
        ahead = None if streaming else self._ahead_plan(layer, behind, early)
        per = float(routing.counts[miss].mean()) if len(miss) else 1.0
        # a prompt's last routed layer: nothing to copy ahead, and no later layer misses an expert
        tail = not streaming and self._held and self._span > 1 and not (ahead and len(ahead[1])) \
            and bool((table.resident[row + 1:] >= 0).all())
        q = len(miss) if streaming else self.split(len(miss), busy=(len(ahead[1]) if ahead else 0) + behind, per=per,
                                                   tail=tail)
        misses = miss.tolist()
        if ahead:  # the fills of this layer take spare slots first; their slots count again after its kernels
            ahead = ahead[0], ahead[1][: ahead[2]]
        return CallPlan(hit.tolist(), hit_slots, misses, misses[:q], misses[q:], ahead, behind, tail)

    def _queue_device(self, layer: int, x: torch.Tensor, y: torch.Tensor, routing: Routing, topk_ids: torch.Tensor,
                      plan: CallPlan, with_cpu: bool, streaming: bool):
        """The device's share of a routed call, queued while its CPU job runs: hits and fills into y
        (DeviceRuns._run_device), then the next layer's copies ahead. -> (perf_counter between the two, the fills'
        end event of a tail call the tail clock times, else None)."""
        read = self.cache.mark() if plan.ahead else None  # the last reader of an unlocked slot is queued before this...
        if not streaming:
            # hits may sit in slots that copies still in flight fill (the last layer's copies ahead). Waited for
            # only now: the routing's and the CPU's inputs' read-backs queued before it do not wait behind them
            # (the box, 2026-12-03: a layer's routing came back 2.6-4.9 ms late, after the copies ahead)
            self.cache.ready()
        in_rounds = self._run_device(layer, x, y, routing, plan.hit_slots.tolist(), plan.hits, plan.fills, with_cpu,
                                     topk_ids)
        probe = None
        if plan.tail and self.tail is not None and not self.estimate.frozen:
            probe = self.cache.last_copy_end() if plan.fills and with_cpu and not in_rounds else None
            if probe is None:  # (nothing to time: the clock forgets some of its lag)
                self.tail.forget()
        ran = time.perf_counter()
        if plan.ahead and len(plan.ahead[1]):  # ...unless this layer's fills went in rounds, reusing their slots
            self._copy_ahead(*plan.ahead, with_cpu=with_cpu, after=None if in_rounds else read, then=not in_rounds)
        return ran, probe

    def _unlock(self) -> None:
        self.cache.table.unlock_all()
        if self.streamer is not None and self.streamer.active and self.streamer.reserved:
            self.cache.table.lock(self.streamer.reserved)

    def _observe_fill(self) -> None:
        for timing in self.cache.take_fill_timings():  # on CUDA, copies of earlier calls
            self.estimate.observe_fill(timing.nbytes, timing.seconds)
            # the fill path: copies, and on a CPU "device" also running the filled experts, on the same cores
            # and in line (on CUDA a decode fill is its copy; the expert kernels queue behind it)
            self.observe("fill", timing.nbytes, timing.seconds + self._fill_run_s, together=timing.with_cpu)
        self.cache.copy_rate = self.fill_rate()  # when the copies issued from now on will have run

    def fill_rate(self) -> float:
        """Bytes/s the copy engine is taken to move experts at while the CPU runs beside it (the estimate's B_P
        here; hybrid's split policy measures its own)."""
        return self.estimate.bp

    def _behind(self) -> int:
        """Experts' worth of earlier copies the copy stream is still moving (SlotCache.copy_backlog): a layer
        call's fills and the next layer's copies ahead queue behind them, and the next layers' routing waits for
        those (H200 box, an extend's last routed layer: ~9 ms behind copies ahead that ran slower than the split
        had counted; modelled in tests/engine/test_experts_split_policy.py)."""
        return round(self.cache.copy_backlog(self.fill_rate()) / self.pool.expert_bytes)

    # --- control and reporting
    def stats(self) -> dict:
        # (no settle() here: any thread may ask, /metrics included; a streamed forward is counted at its end)
        out = self.stats_.as_dict()
        out.update(backend=self.name, slots=self.cache.num_slots, bp=self.estimate.bp, bh=self.estimate.bh,
                   streamed_forwards=self.streamer.streamed_forwards if self.streamer else 0)
        return out

    def resize(self, num_slots: int) -> None:
        """New slot count at a scheduler safe point (between steps); ValueError if impossible."""
        self.cache.resize(num_slots)
        if self.mapped is not None:
            self.mapped.reset()
        if self.streamer is not None:
            self.streamer.active, self.streamer.reserved = False, []

    def close(self) -> None:
        """End the CPU share's threads (EngineCore.stop); they start again when a later step needs them."""
        if self.mapped is not None and self.mapped.cpu is not None:
            self.mapped.cpu.close()
        self.cpu_jobs.close()


def _mode(value, modes: tuple[str, ...], flag: str, true: str = "on") -> str:
    """An option given as one of `modes` or as a bool (True: `true`, False: "off"); else ValueError naming
    `flag` and what it takes."""
    mode = (true if value else "off") if isinstance(value, bool) else value
    if mode not in modes:
        raise ValueError(f"{flag} must be one of {', '.join(modes)}, got {value!r}")
    return mode


def _timing_event() -> torch.cuda.Event:
    """A timing event recorded now on the current CUDA stream (HandoffClock's)."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
