"""One request's trip through the engine, shared by every API front-end.

    prepare():  normalise -> render -> check the context -> plan (these in a planning thread, off the event
                loop) -> GenerateRequest (errors are ApiErrors, before any byte): proxy/preparing.py
    Generation: submit -> stream -> detokenize -> parse -> Admitted, OutputEvents, KEEPALIVE ticks, then Finished

Front-ends only translate Conversation in and OutputEvents out; this module owns admission (429),
keep-alive timing, stop sequences and aborting the engine request when the client goes away.
The backend is the app's `core`: the in-process EngineCore streams token ids, which Generation decodes and
parses; a backend with `answer(ctx, prep)` (an AnswerSource: proxy/upstream's pool of OpenAI-compatible
servers) yields the output events and the Finished itself. Either way the front-ends see the same items.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Literal, Mapping, Protocol, Union

from aiohttp import web

from engine.api import GenerateRequest, SamplingParams, TokenEvent, Usage
from proxy.context import ServerContext
from proxy.conversation import Conversation
from proxy.errors import ApiError
from proxy.policy.planner import Plan
from proxy.prompt.output_parser import (OutputEvent, OutputParser, ToolCall, ToolCallDelta,
                                       ToolCallStart, generation_opens_think)

if TYPE_CHECKING:
    from engine.serving import TokenStream

log = logging.getLogger("killick.proxy")

Finish = Literal["stop", "length", "tool_calls", "stop_sequence", "abort", "error"]
RETRY_AFTER_S = 1  # a full queue drains in about a turn


@dataclass(frozen=True)
class GenParams:
    max_tokens: int | None  # None: the server default, always clipped to what the context has left
    sampling: SamplingParams = SamplingParams()
    stop_sequences: tuple[str, ...] = ()
    parse_tools: bool = True
    max_tool_calls: int | None = None  # 1: the agent disabled parallel tool calls
    thinking_budget: int | None = None  # the most output tokens of thinking (Anthropic thinking.budget_tokens)
    truncate: bool = False  # drop the oldest messages rather than refuse a prompt too long (Responses truncation)


class Keepalive:
    """Yielded when nothing was sent for keepalive_s: the front-end writes its API's keep-alive."""


KEEPALIVE = Keepalive()


@dataclass(frozen=True)
class Admitted:
    """Yielded once, before any output, when the engine has admitted the request and settled what its prefix
    cache gives it (the final usage repeats it): a front-end may announce the prompt's split now (Anthropic's
    message_start). An AnswerSource's answer has none."""

    prompt_tokens: int
    reused_tokens: int


@dataclass(frozen=True)
class Finished:
    finish: Finish
    usage: Usage
    reasoning_tokens: int = 0
    stop_sequence: str | None = None
    error: str | None = None
    output_ids: tuple[int, ...] = ()  # what the model wrote, as token ids (the cache policy's diff reads them)
    error_status: int = 500  # a non-streaming answer's HTTP status for the error (upstream: 429 / 503 when no
    # replica answered, a replica's own 4xx)


GenItem = Union[OutputEvent, Keepalive, Admitted, Finished]


class ReplySource(Protocol):
    """An answer that replaces sampling (create_app(replies=...); proxy/replay/sources.py): the token ids the
    engine must emit for this request, or None to let the model sample. Forced ids still run every decode
    step on the model, so timings and cache behaviour stay real."""

    def reply_ids(self, ctx: ServerContext, conv: Conversation, prompt_text: str, headers: Mapping[str, str],
                  plan: Plan) -> list[int] | None: ...


class AnswerSource(Protocol):
    """A backend that answers a prepared request with output events itself, ending with one Finished
    (proxy/upstream: OpenAI-compatible servers parse the model's output). Refusals before any byte are ApiErrors
    raised by answer(); leaving early closes the iterator."""

    async def answer(self, ctx: ServerContext, prep: "Prepared") -> AsyncIterator[OutputEvent | Finished]: ...


@dataclass
class Turn:
    """What one API request did, filled in as it goes: read by the x-killick-* response headers and by a
    TurnObserver (create_app(observer=...), the recorder) once the request is over."""

    plan: Plan
    finished: Finished | None = None  # set by Generation
    response: Callable[[], dict] | None = None  # set by the front-end: builds the body it answered with
    # set by a background response (its answer goes on after the request): set once it has ended, and the
    # observer hears of the request then, so a recording holds the response as it ended
    ended: asyncio.Event | None = None
    # seconds since the request reached the server (ARRIVED): its GenerateRequest made (read, normalised,
    # rendered, tokenized, planned), the engine's first token in the proxy, and its first output event out of
    # the detokenizer and parser (which hold back half a character, and text that may open a tool call or a
    # thinking block); with the engine's TTFT they split the client's. held: output tokens that had come when
    # the first output event left (1: none held back)
    arrived: float | None = None
    prepare_s: float | None = None
    render_s: float | None = None  # of prepare_s: rendering and tokenizing, then planning (in a planning thread)
    plan_s: float | None = None
    first_token_s: float | None = None
    first_output_s: float | None = None
    held: int | None = None


TURN = web.RequestKey("killick_turn", Turn)
ARRIVED = web.RequestKey("killick_arrived", float)  # time.monotonic() when the request reached the server


@dataclass
class Prepared:
    conv: Conversation
    params: GenParams
    prompt_text: str
    request: GenerateRequest
    turn: Turn  # turn.plan goes back to planner.admit(), then planner.finish()
    model: str = ""  # the model the agent asked for (an upstream maps it to one of its own)
    headers: Mapping[str, str] = field(default_factory=dict)  # the agent's request headers


class Generation:
    """A submitted request. `async with Generation(ctx, prep) as gen: async for item in gen: ...`

    Entering submits (a full engine queue is a 429 here, before any byte is sent) and, once the backend took
    the request, has the planner number its turn (planner.admit: a refused request takes none); the items end
    with one Finished; leaving early (client gone, a write failed) aborts the engine request and frees its state.
    """

    def __init__(self, ctx: ServerContext, prep: Prepared):
        self.ctx, self.prep, self.req = ctx, prep, prep.request
        self.parser = OutputParser(thinking_open=generation_opens_think(prep.prompt_text),
                                   parse_tools=prep.params.parse_tools, stop_sequences=prep.params.stop_sequences,
                                   max_tool_calls=prep.params.max_tool_calls, continues=prep.conv.continue_last)
        self.turn = prep.turn
        self.decoder = ctx.tokenizer.incremental_decoder()
        self.blocks: list = []  # the output so far, merged as a non-streaming answer would hold it
        self.stream: TokenStream | None = None
        self.source: AsyncIterator[Admitted | OutputEvent | Finished] | None = None
        self._iter: AsyncIterator[GenItem] | None = None
        self._tokens_out: int | None = None  # output tokens from the engine so far (None: no engine stream)

    async def __aenter__(self) -> "Generation":
        answer = getattr(self.ctx.core, "answer", None)
        if answer is not None:  # an AnswerSource
            self.source = await answer(self.ctx, self.prep)
        else:
            try:
                self.stream = self.ctx.core.stream(self.req)
            except OverflowError as exc:
                raise ApiError(429, f"server busy: {exc}; retry shortly", code="rate_limit_exceeded",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            except ValueError as exc:  # the engine says this request can never run
                raise ApiError(400, str(exc)) from None
            self.source = self._engine_items()
        self._admit()
        self.ctx.in_flight += 1
        return self

    async def __aexit__(self, *exc) -> None:
        self.ctx.in_flight -= 1
        if self._iter is not None:
            await self._iter.aclose()
        await self.source.aclose()
        if self.stream is not None:
            await self.stream.aclose()  # aborts the engine request unless its final event came

    def __aiter__(self) -> AsyncIterator[GenItem]:
        self._iter = self._items()
        return self._iter

    async def _items(self) -> AsyncIterator[GenItem]:
        """The source's items as they come, a KEEPALIVE whenever nothing was sent for keepalive_s (queued,
        prefilling, or decoding a buffered tool call), then the Finished once the turn is booked."""
        loop, next_item = asyncio.get_running_loop(), None
        last_sent = loop.time()
        try:
            while True:
                next_item = next_item or asyncio.ensure_future(anext(self.source))
                done, _ = await asyncio.wait((next_item,), timeout=max(0.0, last_sent + self.ctx.keepalive_s
                                                                             - loop.time()))
                if not done:
                    last_sent = loop.time()
                    yield KEEPALIVE
                    continue
                item, next_item = next_item.result(), None
                if isinstance(item, Finished):
                    break
                if isinstance(item, Admitted):
                    yield item
                    continue
                collect(self.blocks, item)
                if self.turn.first_output_s is None and self.turn.arrived is not None:
                    self.turn.first_output_s = time.monotonic() - self.turn.arrived
                    self.turn.held = self._tokens_out
                yield item
                last_sent = loop.time()
        finally:
            if next_item is not None:  # left early: stop the pending read before the source is closed
                next_item.cancel()
                with suppress(asyncio.CancelledError, StopAsyncIteration):
                    await next_item
        self.ctx.metrics.observe_usage(item.usage)
        turn = self.turn
        self.ctx.metrics.observe_turn(prepare_s=turn.prepare_s, first_token_s=turn.first_token_s,
                                      first_output_s=turn.first_output_s)
        self._finish_turn(item)
        self.turn.finished = item
        yield item

    async def _engine_items(self) -> AsyncIterator[Admitted | OutputEvent | Finished]:
        """The engine's token events: its admission, the tokens detokenized and parsed into output events, then
        the Finished."""
        parser, stop_ids = self.parser, self.req.stop_ids
        reasoning, output_ids = 0, []
        final: TokenEvent | None = None
        while final is None:
            ev = await anext(self.stream)
            if ev.reused_tokens is not None:
                yield Admitted(len(self.req.prompt_ids), ev.reused_tokens)
            ids = [t for t in ev.token_ids if t not in stop_ids]
            output_ids += ev.token_ids
            self._tokens_out = len(output_ids)
            if ev.token_ids and self.turn.first_token_s is None and self.turn.arrived is not None:
                self.turn.first_token_s = time.monotonic() - self.turn.arrived
            reasoning += len(ids) if parser.mode == "think" else 0
            out = parser.feed(self.decoder.push(ids)) if ids else []
            if ev.final:
                out += parser.feed(self.decoder.flush()) + parser.finish()
                final = ev
            elif parser.ended:
                final = await self._stop_early()
            for item in out:
                yield item
        yield _finished(final, parser, reasoning, self.req, output_ids)

    def _admit(self) -> None:
        """The engine (or an upstream) took the request: now it is one of its session's turns."""
        try:
            self.turn.plan = self.ctx.planner.admit(self.turn.plan)
        except Exception:  # noqa: BLE001 - bookkeeping must never cost the agent its answer
            log.exception("cache policy failed to admit %s", self.req.request_id)

    def _finish_turn(self, finished: Finished) -> None:
        try:
            self.ctx.planner.finish(self.turn.plan, finished.output_ids, finished.usage)
        except Exception:  # noqa: BLE001 - bookkeeping must never cost the agent its answer
            log.exception("cache policy failed to record %s", self.req.request_id)

    async def _stop_early(self) -> TokenEvent:
        """The parser needs no more output: abort the engine request and wait (briefly) for its final usage."""
        self.stream.abort()

        async def final() -> TokenEvent:
            async for ev in self.stream:
                if ev.final:
                    return ev
            raise RuntimeError("the engine stream ended without a final event")

        try:
            return await asyncio.wait_for(final(), 5.0)
        except asyncio.TimeoutError:
            return TokenEvent(self.req.request_id, finish_reason="abort")


def _finished(ev: TokenEvent, parser: OutputParser, reasoning: int, req: GenerateRequest,
              output_ids: list[int]) -> Finished:
    usage = ev.usage or Usage(prompt_tokens=len(req.prompt_ids), output_tokens=len(output_ids), reused_tokens=0,
                              prefilled_tokens=len(req.prompt_ids))
    if parser.stopped is not None:
        return Finished("stop_sequence", usage, reasoning, stop_sequence=parser.stopped, output_ids=tuple(output_ids))
    finish: Finish = ev.finish_reason or "error"
    if parser.ended or (finish == "stop" and parser.tool_calls):
        finish = "tool_calls"
    return Finished(finish, usage, reasoning, error=ev.error, output_ids=tuple(output_ids))



def check_failed(fin: Finished) -> Finished:
    """A non-streaming answer cannot carry an engine failure in-band: it becomes a 500 in the API's shape."""
    if fin.finish == "error":
        raise ApiError(fin.error_status, f"generation failed: {fin.error or 'engine error'}",
                       code="rate_limit_exceeded" if fin.error_status == 429 else None)
    return fin


def collect(blocks: list, item: OutputEvent) -> None:
    """Accumulate output events into blocks for a non-streaming answer: adjacent deltas of a kind merge; a
    tool call is its final ToolCall (the pieces it streamed as are left out)."""
    if isinstance(item, (ToolCallStart, ToolCallDelta)):
        return
    if isinstance(item, ToolCall):
        blocks.append(item)
    elif blocks and type(blocks[-1]) is type(item):
        blocks[-1] = type(item)(blocks[-1].text + item.text)
    else:
        blocks.append(item)


async def run_to_finish(request, gen: "Generation", feed) -> Finished:
    """Drive a non-streaming generation: output events go to feed(item); every item (keep-alives too)
    checks that the client is still there; the engine's failure becomes a 500 (check_failed)."""
    async for item in gen:
        if isinstance(item, Finished):
            return check_failed(item)
        if client_gone(request):
            raise ConnectionResetError("client went away")
        if not isinstance(item, (Keepalive, Admitted)):
            feed(item)
    raise RuntimeError("generation ended without a Finished event")


async def answer_whole(request, gen: "Generation", build: Callable[[list, Finished], dict]) -> web.Response:
    """A non-streaming answer: the output merged into blocks, then the API's body `build(blocks, finished)`,
    which the turn keeps for its observer."""
    blocks: list = []
    fin = await run_to_finish(request, gen, lambda item: collect(blocks, item))
    body = build(blocks, fin)
    gen.turn.response = lambda: body
    return web.json_response(body)


def client_gone(request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
