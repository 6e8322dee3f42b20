"""The serving core: one scheduler thread that owns the model runner; callers submit from any thread.

The step reads like the contract says: schedule -> run (prepare, forward, sample inside the runner) ->
publish. While every running sequence decodes, the next decode step is queued before this one's tokens are
read (the runner's chain, fed on the device), so publishing and scheduling overlap the device's work. An
asyncio server never blocks on the model: `stream()` hops events onto the caller's loop.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol

from engine.api import FinishReason, GenerateRequest, TokenEvent, Usage
from engine.scheduler import Scheduler, Sequence, Status, Work

log = logging.getLogger("killick.engine")
EventSink = Callable[[TokenEvent], None]


class Runner(Protocol):
    """What the core needs from the model side (engine/runner.py is the torch implementation)."""

    context_length: int
    cache: object | None  # the prefix cache (None: none; requests sharing a prefix in flight then never wait)

    def validate(self, req: GenerateRequest) -> None: ...  # ValueError if the request can never run

    def admit(self, seq: Sequence) -> None: ...  # restore the cached prefix: sets num_computed, reused

    def readmit(self, seq: Sequence) -> None: ...  # nothing computed yet: restore the (longer) cached prefix

    def step(self, work: list[Work]) -> list[int | None]: ...  # one forward; a token per sampling item

    # Optional (engine/runner.py has them): `launch(work)` queues a step and returns an object with `work` and
    # `tokens()`; `chain(launched, work)` queues the decode step after it from its tokens still on the device;
    # `overlap` (bool) says whether the core should chain (where the device runs a step while the host goes
    # on). A runner with `step` alone runs each step to its end.

    def release(self, seq: Sequence) -> None: ...  # cache what is worth keeping, free the rest

    def stats(self) -> dict: ...
    # optional: def idle(self) -> bool  (bounded background work while nothing runs or waits; True: more to do)
    # optional: def close(self) -> None  (stop's: end the runner's worker threads; again, or used later, is fine)


class EngineCore:
    """share_prefill_min: a request admitted while another one prefills a prefix they share waits for that
    prefill when it spares at least this many tokens (Scheduler.follow), then takes the prefix from the
    cache; only with a prefix cache. Counted in totals: shared_prefill_waits, shared_prefill_tokens."""

    def __init__(self, runner: Runner, max_running: int = 4, max_step_tokens: int = 512,
                 max_waiting: int = 64, share_prefill_min: int = 256, max_prefill_tokens: int | None = None) -> None:
        self.runner = runner
        share = share_prefill_min if getattr(runner, "cache", None) is not None else 0
        self.scheduler = Scheduler(max_running, max_step_tokens, max_waiting, share, max_prefill_tokens)
        self._sinks: dict[str, EventSink] = {}
        self._inbox: deque[Sequence] = deque()
        self._calls: deque[tuple[Callable[[], object], threading.Event, list]] = deque()
        self._aborts: set[str] = set()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.totals = {"requests": 0, "finished": 0, "aborted": 0, "errors": 0, "prompt_tokens": 0,
                       "reused_tokens": 0, "prefilled_tokens": 0, "output_tokens": 0,
                       "shared_prefill_waits": 0, "shared_prefill_tokens": 0,
                       # back-to-back decode steps (every item one token past its prompt): seconds from one's
                       # end to the next one's, and of those in the runner (forward, sampling, its device
                       # wait); the rest is the engine thread's own (scheduling, publishing, the GIL)
                       "decode_steps": 0, "decode_step_seconds": 0.0, "decode_runner_seconds": 0.0}
        self._decode_end: float | None = None  # when the last decode step ended, if nothing came between
        self._ahead = None  # a decode step queued after the last one published, its tokens not read yet
        # the runner's background work for idle time (ModelRunner.idle: the expert cache's refresh), called
        # while no request runs or waits, outside the lock, until it says it is done; due again after a step
        self._idle_work = getattr(runner, "idle", None)
        self._idle_due = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "EngineCore":
        """Start the engine thread. What the process holds by then (the model, its kernels and graphs, every
        module) is frozen out of the garbage collector's later passes: a full pass walks all of it (110-120 ms
        over the 168k objects of a tiny model's engine on the dev box) inside whichever step it falls in.
        Objects still free by their reference counts; stop() unfreezes."""
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._loop, name="killick-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the engine thread after its current step, then close the runner's own threads (its CPU expert
        workers), which would otherwise outlive the engine, idle. Again: nothing more happens. A runner used
        by a later core starts them again when it needs them."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        gc.unfreeze()  # (start's freeze)
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():  # still inside a step: its workers are in use
                log.warning("the engine thread did not stop within 30 s; its CPU workers stay open")
                return
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "EngineCore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- caller side (any thread) ---------------------------------------------------------------
    def submit(self, req: GenerateRequest, on_event: EventSink) -> None:
        """Queue a request. ValueError: it can never run; OverflowError: the queue is full (try later)."""
        self.runner.validate(req)
        limit = self.runner.context_length
        if len(req.prompt_ids) + max(req.max_new_tokens, 0) > limit:
            raise ValueError(f"prompt is too long: {len(req.prompt_ids)} prompt tokens + "
                             f"{req.max_new_tokens} new tokens > {limit} context tokens")
        with self._lock:
            if len(self._inbox) + len(self.scheduler.waiting) >= self.scheduler.max_waiting:
                raise OverflowError(f"queue full: {self.scheduler.max_waiting} requests already waiting")
            self._sinks[req.request_id] = on_event
            self._inbox.append(Sequence.from_request(req))
            self.totals["requests"] += 1
            self._lock.notify_all()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
            self._lock.notify_all()

    def call(self, fn: Callable[[], object], timeout: float = 60.0) -> object:
        """Run fn on the engine thread at a safe point between steps (reconfiguration, cache control)."""
        done, box = threading.Event(), []
        with self._lock:
            self._calls.append((fn, done, box))
            self._lock.notify_all()
        if not done.wait(timeout):
            raise TimeoutError("engine did not reach a safe point in time")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def stream(self, req: GenerateRequest) -> "TokenStream":
        """Submit now (submit's ValueError / OverflowError are raised here) and read the events on the
        running loop: `async for ev in core.stream(req)`. Closing the stream early aborts the request."""
        return TokenStream(self, req)

    def stats(self) -> dict:
        with self._lock:
            active = len(self.scheduler.running)
            queued = len(self.scheduler.waiting) + len(self._inbox)
        return {"active": active, "queued": queued, **self.totals, **self.runner.stats()}

    # -- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            idle = False
            with self._lock:
                while (not self._stopping and not self._inbox and not self._calls and self.scheduler.idle
                       and self._ahead is None):
                    self._decode_end = None  # an idle wait is no part of a decode step
                    if self._idle_due:
                        idle = True
                        break
                    self._lock.wait(0.5)
                if self._stopping:
                    break
            if idle:  # one bounded piece (a few ms: what a request arriving now waits), then look again
                more = _try(self._idle_work)
                if isinstance(more, BaseException):
                    log.warning("idle work failed, not retried until the next request: %r", more)
                    more = False
                self._idle_due = bool(more)
                continue
            with self._lock:
                inbox, self._inbox = list(self._inbox), deque()
                calls, self._calls = list(self._calls), deque()
                aborts, self._aborts = self._aborts, set()
            if calls and self._ahead is not None:
                self._step(chain=False)  # a call runs between steps: the step in flight is published first
            for fn, done, box in calls:
                box.append(_try(fn))
                done.set()
            for seq in inbox:
                self.scheduler.waiting.append(seq)
            self._apply_aborts(aborts)
            if not self.scheduler.idle or self._ahead is not None:
                self._step()
                self._idle_due = self._idle_work is not None
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(seq, "abort", error=None)

    def _apply_aborts(self, aborts: set[str]) -> None:
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id in aborts or seq.req.abort.aborted:
                self._finish(seq, "abort")

    def _step(self, chain: bool = True) -> None:
        """One step's tokens published: the step queued last time (chained), else one scheduled and launched
        now. Before its tokens are read, the decode step after it is queued (chain) where nothing else could
        run instead (_chain), so the device runs that one while this thread publishes."""
        launched, self._ahead = self._ahead, None
        began = time.perf_counter()
        if launched is None:
            for seq in self.scheduler.admit():
                self._admit(seq, self.runner.admit)
            for seq in self.scheduler.ready_followers():  # the prefill they waited for put their prefix in the cache
                before = seq.num_computed
                if self._admit(seq, self.runner.readmit):
                    self.totals["shared_prefill_tokens"] += max(0, seq.num_computed - before)
            work = self.scheduler.schedule()
            if not work:
                return
            began = time.perf_counter()
            launched = self._run(lambda: self._launch(work), work)
            if launched is None:
                return
        work = launched.work
        decode = all(w.end - w.start == 1 and w.start >= w.seq.num_prompt for w in work)
        if decode and chain:
            self._ahead = self._chain(launched)
        tokens = self._run(launched.tokens, work)
        if tokens is None:
            return
        ended = time.perf_counter()
        if decode and self._decode_end is not None:
            self.totals["decode_steps"] += 1
            self.totals["decode_step_seconds"] += ended - self._decode_end
            self.totals["decode_runner_seconds"] += ended - began
        self._decode_end = ended if decode else None
        for item, token in zip(work, tokens):
            if item.seq.status is Status.RUNNING:  # not ended (stop, abort) while its step was in flight
                self._publish(item, token)

    def _launch(self, work: list[Work]):
        launch = getattr(self.runner, "launch", None)
        return launch(work) if launch is not None else _Done(work, self.runner.step(work))

    def _run(self, fn: Callable[[], object], work: list[Work]):
        """fn() (a launch, or reading a step's tokens); if it fails, every running sequence of `work` ends
        with the error (and a step queued after it is dropped) -> None."""
        try:
            return fn()
        except Exception as exc:
            self._decode_end, self._ahead = None, None
            log.exception("engine step failed")
            for item in work:
                if item.seq.status is Status.RUNNING:
                    self._finish(item.seq, "error", error=f"engine error: {exc}")
            return None

    def _chain(self, launched):
        """Queue the decode step after `launched` from its tokens on the device, before the host reads them,
        when that step is certain to be the next one but for sequences its tokens end (stop tokens: their row
        is dropped): every running sequence decodes, greedy or sampled, none waits or may have an output forced
        (a script, the end of thinking past its budget: Sequence.forced_soon), nothing else is asked of
        the engine, and no waiting request could be admitted (with every running slot taken, one waits for a
        slot a step longer when a sequence stops). A sequence whose token is its last (max_new_tokens) is left
        out. -> the launched step."""
        chain = getattr(self.runner, "chain", None)
        if chain is None or not getattr(self.runner, "overlap", False):
            return None
        sched, work = self.scheduler, launched.work
        admissible = sched.waiting and len(sched.running) < sched.max_running  # (a full batch keeps its pace)
        if (self._inbox or self._calls or self._aborts or admissible or len(work) != len(sched.running)
                or any(w.seq.forced_soon() or w.seq.req.abort.aborted or not w.samples for w in work)):
            return None
        nxt = [Work(w.seq, w.end, w.end + 1) for w in work if w.seq.num_output + 1 < w.seq.req.max_new_tokens]
        if not nxt:
            return None
        return self._run(lambda: chain(launched, nxt), nxt)

    def _admit(self, seq: Sequence, restore: Callable[[Sequence], None]) -> bool:
        """Restore seq's cached prefix, then let it wait for a prefill in flight it shares, or tell its caller
        what it reuses (TokenEvent.reused_tokens: settled, since it waits for nothing). False: it failed."""
        try:
            restore(seq)
        except Exception as exc:  # a broken cache entry must not take the engine down
            log.exception("admit failed")
            self._finish(seq, "error", error=f"engine error while restoring the prefix: {exc}")
            return False
        if self.scheduler.follow(seq):  # its reuse grows once the leader's prefill is cached: told then
            self.totals["shared_prefill_waits"] += 1
        else:
            self._emit(seq, TokenEvent(seq.request_id, reused_tokens=seq.reused))
        return True

    def _publish(self, item: Work, token: int | None) -> None:
        seq = item.seq
        reason = self.scheduler.advance(item, token)
        emitted = () if token is None or (reason == "stop" and seq.req.forced_output_ids is None) else (token,)
        if reason is not None:
            self._finish(seq, reason, last=emitted)
        elif emitted:
            self._emit(seq, TokenEvent(seq.request_id, emitted))
        elif seq.prefilling:
            self._emit(seq, TokenEvent(seq.request_id, prefilled_so_far=seq.num_computed))

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None, last=()) -> None:
        self.scheduler.remove(seq, reason)
        try:
            self.runner.release(seq)
        except Exception:
            log.exception("release failed")
        usage = self._usage(seq)
        key = {"abort": "aborted", "error": "errors"}.get(reason, "finished")
        self.totals[key] += 1
        for name in ("prompt_tokens", "reused_tokens", "prefilled_tokens", "output_tokens"):
            self.totals[name] += getattr(usage, name)
        self._emit(seq, TokenEvent(seq.request_id, tuple(last), reason, usage, error))
        with self._lock:
            self._sinks.pop(seq.request_id, None)

    def _usage(self, seq: Sequence) -> Usage:
        now = time.monotonic()
        t_admit = seq.t_admit or now
        t_first = seq.t_first_token or now
        return Usage(
            prompt_tokens=seq.num_prompt, output_tokens=seq.num_output, reused_tokens=seq.reused,
            prefilled_tokens=max(0, min(seq.num_computed, seq.num_prompt) - seq.reused),
            cache_tier=seq.cache_tier, queue_s=t_admit - seq.t_submit, ttft_s=t_first - seq.t_submit,
            prefill_s=(seq.t_prefill_done or now) - t_admit, decode_s=now - t_first if seq.t_first_token else 0.0,
            checkpoints_kept=tuple(sorted(set(seq.checkpoints_kept))), stop_token=seq.stop_token)

    def _emit(self, seq: Sequence, ev: TokenEvent) -> None:
        sink = self._sinks.get(seq.request_id)
        if sink is None:
            return
        try:
            sink(ev)
        except Exception:  # a consumer that fails must not stop the engine
            log.exception("event sink failed for %s", seq.request_id)


def _deliver(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, ev: TokenEvent) -> None:
    """An event onto the caller's loop, from the engine thread; a closed loop (the server stopped while a step
    ran) has nobody left to read it."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, ev)
    except RuntimeError:
        if not loop.is_closed():
            raise


class TokenStream:
    """One submitted request's events, moved from the engine thread onto the caller's event loop.

    Iterating ends after the final event. `abort()` asks the engine to stop the request (once; its final
    event still arrives); `aclose()` aborts unless the final event was read. Waiting for the next event may be
    cancelled (asyncio.wait_for) without losing one.
    """

    def __init__(self, core: "EngineCore", req: GenerateRequest) -> None:
        loop = asyncio.get_running_loop()
        self.req, self._core = req, core
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.finished = self._aborted = False
        core.submit(req, functools.partial(_deliver, loop, self._events))

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        ev = await self._events.get()
        self.finished = ev.final
        return ev

    def abort(self) -> None:
        if not (self.finished or self._aborted):
            self._aborted = True
            self._core.abort(self.req.request_id)

    async def aclose(self) -> None:
        self.abort()


class _Done:
    """A step a runner without launch() ran to its end: its tokens, known."""

    def __init__(self, work: list[Work], tokens: list[int | None]) -> None:
        self.work, self._tokens = work, tokens

    def tokens(self) -> list[int | None]:
        return self._tokens


def _try(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except BaseException as exc:  # handed back to the caller of EngineCore.call
        return exc
