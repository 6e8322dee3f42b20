"""Background responses (`background: true`): the create call answers at once with the response queued, and its
generation runs in a task the app owns (BackgroundJobs, closed by the app's cleanup).

GET /v1/responses/{id} reads a running job's state (queued, then in_progress with the output items finished so
far), then the store's once it has ended; cancel ends a running job (the engine request is aborted) and answers
it cancelled. A job that ends records its response in the store, as a foreground one does. With `stream: true`
the create call follows the job's events as they come; the client leaving ends its stream, not the job. Such a
job keeps its events, so GET with `stream=true` can follow it again from any sequence number (follow), while it
runs and for a while after it ended (EndedStreams).
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from contextlib import AsyncExitStack
from typing import Awaitable, Callable, NamedTuple

from aiohttp import web

from proxy.apis.responses.output import OutputItems
from proxy.apis.responses.response import TERMINAL_EVENTS, ended, final, pending, state_event
from proxy.apis.responses.store import MB
from proxy.errors import ApiError
from proxy.generation import Admitted, Finished, Generation, Keepalive
from proxy.sse import SSEWriter, frame

log = logging.getLogger("killick.proxy")
MAX_JOBS = 256  # background responses running at once: as many as the store keeps
ENDED_STREAMS, ENDED_STREAMS_MB = 32, 64  # the ended streamed jobs whose events are kept, and their memory bound
CANCELLED = {"type": "error", "code": "response_cancelled", "message": "the response was cancelled", "param": None}


class Job:
    """One background response. Its events are kept only where it was created with `stream: true`: each framed
    for SSE as it is emitted, its index in `events` its sequence_number."""

    def __init__(self, fixed: dict, out: OutputItems, remember: Callable[[dict], None], follow: bool,
                 stack: AsyncExitStack, gen: Generation):
        self.fixed, self.out, self.remember = fixed, out, remember
        self.stack, self.gen = stack, gen  # gen was entered (submitted) by the create call; the stack leaves it
        self.status = "queued"
        self.final: dict | None = None  # the response as it ended
        self.ended = asyncio.Event()  # set once final is (what the recorder waits for: Turn.ended)
        self.events: list[bytes] | None = [] if follow else None
        self.event_bytes = 0  # the size of events, framed
        self.tick = asyncio.Event()  # set (then replaced) whenever an event is added
        self.task: asyncio.Task | None = None
        self._emit("response.created", {"response": self.state()})

    def state(self) -> dict:
        return self.final if self.final is not None else pending(self.fixed, self.status, self.out)

    async def cancel(self) -> dict:
        """Ends the job (a finished one is left as it ended) and answers its response."""
        self.task.cancel()
        await asyncio.wait((self.task,))  # not cancelled with the caller: the job ends either way
        await self.stopped()
        return self.state()

    async def stopped(self) -> None:
        """After its task: a task cancelled before its first step never ran run(), so the generation is closed
        (and the job marked cancelled) here; for any other task this changes nothing."""
        await self.stack.aclose()
        self._end(lambda: ended(self.fixed, self.out, "cancelled"))

    async def run(self) -> None:
        """The task. Leaving the stack closes the generation, which aborts the engine request unless it
        finished."""
        try:
            async with self.stack:
                await self._generate(self.gen)
        except asyncio.CancelledError:
            self._end(lambda: ended(self.fixed, self.out, "cancelled"))
            raise
        except Exception:  # noqa: BLE001 - one response's bug must not reach the app or other requests
            log.exception("background response %s failed", self.fixed["id"])
            self._end(lambda: ended(self.fixed, self.out, "failed", "internal server error (see the server log)"))

    async def _generate(self, gen: Generation) -> None:
        async for item in gen:
            if isinstance(item, Keepalive):  # numbered and kept like the other events
                self._emit(*state_event(self.fixed, self.status, self.out))
                continue
            if self.status == "queued":  # admitted (an upstream's answer says so with its first output)
                self.status = "in_progress"
                self._emit(*state_event(self.fixed, self.status, self.out))
            if isinstance(item, Finished):
                self._end(lambda: final(self.fixed, self.out, item))
                return
            if not isinstance(item, Admitted):
                for kind, payload in self.out.feed(item):
                    self._emit(kind, payload)

    def _end(self, build: Callable[[], dict]) -> None:
        """The job's last state, build() once the open output item is closed: kept in the store, and the last
        event a stream of it gets (a cancelled one ends with an error event: Responses has no cancelled one)."""
        if self.final is not None:  # a cancel that came while the finished job closed its generation
            return
        try:
            for kind, payload in self.out.close():
                self._emit(kind, payload)
        except Exception:  # noqa: BLE001 - the job must still end, with the items that did close
            log.exception("background response %s: closing its output failed", self.fixed["id"])
        self.final = build()
        self.ended.set()  # before anything here may raise; its waiters run once this has returned
        self.remember(self.final)
        status = self.final["status"]
        if status == "cancelled":
            self._emit("error", CANCELLED)
        else:
            self._emit(TERMINAL_EVENTS[status], {"response": self.final})

    def _emit(self, kind: str, payload: dict) -> None:
        if self.events is not None:
            framed = frame({"type": kind, "sequence_number": len(self.events), **payload}, kind)
            self.events.append(framed)
            self.event_bytes += len(framed)
            self.tick.set()
            self.tick = asyncio.Event()


class EndedStream(NamedTuple):
    """What follow() reads of a streamed job that has ended."""

    fixed: dict
    events: list[bytes]
    event_bytes: int
    final: dict | None
    tick: asyncio.Event


class EndedStreams:
    """The streamed jobs that ended last, kept for their events: a client whose stream broke just before the end
    can still read its tail. At most `capacity` jobs and `max_bytes` of events (Job.event_bytes as each ended),
    the one that ended first dropped first until both hold; the job that ended last is kept whatever its size
    (it held that memory while it ran)."""

    def __init__(self, capacity: int = ENDED_STREAMS, max_bytes: int = ENDED_STREAMS_MB * MB):
        self.capacity, self.max_bytes = capacity, max_bytes
        self.held_bytes = 0
        self._jobs: OrderedDict[str, tuple[EndedStream, int]] = OrderedDict()  # with its event_bytes when put

    def put(self, job: EndedStream | Job) -> None:
        self._jobs[job.fixed["id"]] = (job, job.event_bytes)
        self.held_bytes += job.event_bytes
        while len(self._jobs) > 1 and (len(self._jobs) > self.capacity or self.held_bytes > self.max_bytes):
            self.held_bytes -= self._jobs.popitem(last=False)[1][1]

    def get(self, response_id: str) -> EndedStream | Job | None:
        kept = self._jobs.get(response_id)
        return kept[0] if kept is not None else None

    def forget(self, response_id: str) -> None:
        kept = self._jobs.pop(response_id, None)
        if kept is not None:
            self.held_bytes -= kept[1]

    def __len__(self) -> int:
        return len(self._jobs)


class BackgroundJobs:
    """The app's running background responses, by id, and the streamed ones that ended last (`ended`)."""

    def __init__(self, capacity: int = MAX_JOBS, ended: EndedStreams | None = None):
        self.capacity = capacity
        self.ended = ended if ended is not None else EndedStreams()
        self._jobs: dict[str, Job] = {}
        self._reports: set[asyncio.Task] = set()  # after_end's, waiting for their jobs

    def get(self, response_id: str) -> Job | None:
        return self._jobs.get(response_id)

    def streamed(self, response_id: str) -> Job | EndedStream | None:
        """The job whose events a stream can follow: running (events None where it keeps none), or a streamed
        one that ended lately."""
        return self._jobs.get(response_id) or self.ended.get(response_id)

    def check_room(self) -> None:
        if len(self._jobs) >= self.capacity:
            raise ApiError(429, f"{len(self._jobs)} background responses are running, the most this server runs; "
                                "retry when one has ended", code="rate_limit_exceeded", headers={"Retry-After": "1"})

    def start(self, job: Job) -> None:
        response_id = job.fixed["id"]
        self._jobs[response_id] = job
        job.task = asyncio.get_running_loop().create_task(job.run(), name=f"killick-{response_id}")
        job.task.add_done_callback(lambda _: self._retire(job))

    def _retire(self, job: Job) -> None:
        self._jobs.pop(job.fixed["id"], None)
        if job.events is not None:
            # its events and end alone (the job holds the request's prompt and history too), once it has its end: a
            # job cancelled before it ran gets it from stopped(), after this
            self.ended.put(job if job.final is None else
                           EndedStream(job.fixed, job.events, job.event_bytes, job.final, job.tick))

    def after_end(self, ended: asyncio.Event, report: Callable[[], Awaitable[None]]) -> None:
        """report() once a job has ended (`ended`: its Job.ended), in a task close() waits for."""
        async def wait() -> None:
            await ended.wait()
            try:
                await report()
            except Exception:  # noqa: BLE001 - nobody awaits this task to hear of it
                log.exception("reporting a background response failed")

        task = asyncio.get_running_loop().create_task(wait())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def close(self) -> None:
        """Cancels every running job and waits for them (their engine requests aborted), then for the reports
        waiting on them."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.task.cancel()
        await asyncio.gather(*(job.task for job in jobs), return_exceptions=True)
        for job in jobs:
            await job.stopped()
        await asyncio.gather(*self._reports)

    def __len__(self) -> int:
        return len(self._jobs)


BACKGROUND = web.AppKey("killick_background", BackgroundJobs)  # one per app (create_app)


async def background_lifetime(app: web.Application):
    """app.cleanup_ctx: the app's background responses end with it (cancelled, their engine requests aborted)."""
    yield
    await app[BACKGROUND].close()


async def follow(request: web.Request, job: Job | EndedStream, keepalive_s: float,
                 after: int = -1) -> web.StreamResponse:
    """The job's events as SSE, those whose sequence_number is over `after`, until it ends (the job's keep-alives
    among them: response.queued or response.in_progress again); a keep-alive comment when nothing came for
    keepalive_s. Any number of streams may follow one job, each at its own pace."""
    sse = SSEWriter(request)
    sent = after + 1
    while True:
        tick = job.tick  # taken before reading: an event added while we write sets it
        while sent < len(job.events):
            await sse.write(job.events[sent])
            sent += 1
        if job.final is not None:
            return await sse.finish()
        try:
            await asyncio.wait_for(tick.wait(), keepalive_s)
        except asyncio.TimeoutError:
            await sse.comment("keep-alive")
