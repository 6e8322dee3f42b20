"""One request's trip through the engine, shared by every API front-end.

    prepare(): render -> check the context -> plan -> GenerateRequest   (errors are ApiErrors, before any byte)
    generate(): submit -> stream -> detokenize -> parse -> OutputEvents, KEEPALIVE ticks, then Finished

Front-ends only translate Conversation in and OutputEvents out; this module owns admission (429),
keep-alive timing, stop sequences and aborting the engine request when the client goes away.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Literal, Mapping, Union

from engine.api import GenerateRequest, SamplingParams, TokenEvent, Usage
from proxy.context import ServerContext
from proxy.conversation import Conversation
from proxy.errors import ApiError
from proxy.output_parser import OutputEvent, OutputParser, ToolCall, generation_opens_think

log = logging.getLogger("killick.proxy")

FORCED_OUTPUT_HEADER = "x-killick-forced-output"
Finish = Literal["stop", "length", "tool_calls", "stop_sequence", "abort", "error"]


@dataclass(frozen=True)
class GenParams:
    max_tokens: int | None  # None: the server default, always clipped to what the context has left
    sampling: SamplingParams = SamplingParams()
    stop_sequences: tuple[str, ...] = ()
    parse_tools: bool = True


class Keepalive:
    """Yielded when nothing was sent for keepalive_s: the front-end writes its API's keep-alive."""


KEEPALIVE = Keepalive()


@dataclass(frozen=True)
class Finished:
    finish: Finish
    usage: Usage
    reasoning_tokens: int = 0
    stop_sequence: str | None = None
    error: str | None = None


GenItem = Union[OutputEvent, Keepalive, Finished]


@dataclass
class Prepared:
    conv: Conversation
    params: GenParams
    prompt_text: str
    request: GenerateRequest


def prepare(ctx: ServerContext, conv: Conversation, params: GenParams, headers: Mapping[str, str]) -> Prepared:
    rendered = render(ctx, conv)
    n = len(rendered.ids)
    if n >= ctx.context_length:
        raise ApiError(400, f"prompt is too long: {n} tokens > {ctx.context_length - 1} maximum",
                       param="messages", code="context_length_exceeded")
    max_new = min(params.max_tokens or ctx.default_max_tokens, ctx.context_length - n)
    plan = ctx.planner(conv, rendered, headers)
    request = GenerateRequest(
        prompt_ids=list(rendered.ids), max_new_tokens=max_new, sampling=params.sampling,
        stop_ids=frozenset(ctx.tokenizer.eos_ids), checkpoint_positions=tuple(plan.checkpoint_positions),
        session_key=plan.session_key, forced_output_ids=_forced_output(ctx, headers))
    return Prepared(conv, params, rendered.text, request)


def render(ctx: ServerContext, conv: Conversation):
    try:
        return ctx.renderer.render(conv, add_generation_prompt=True)
    except ValueError as exc:  # the template refuses this conversation: the agent's input is at fault
        raise ApiError(400, f"cannot render this conversation: {exc}", param="messages") from None


def _forced_output(ctx: ServerContext, headers: Mapping[str, str]) -> list[int] | None:
    """Test hook (create_app(test_hooks=True) only): the engine emits this text's tokens, then EOS."""
    text = headers.get(FORCED_OUTPUT_HEADER)
    if not ctx.test_hooks or text is None:
        return None
    text = text.encode("latin-1").decode("utf-8").replace("\\n", "\n")
    return list(ctx.tokenizer.encode(text)) + [min(ctx.tokenizer.eos_ids)]


def admit(ctx: ServerContext) -> None:
    if ctx.in_flight >= ctx.max_in_flight:
        raise ApiError(429, f"server busy: {ctx.in_flight} requests running or queued "
                            f"(limit {ctx.max_in_flight}); retry shortly", code="rate_limit_exceeded")


async def generate(ctx: ServerContext, prep: Prepared) -> AsyncIterator[GenItem]:
    """Run prep.request; always ends with one Finished. Closing the iterator early aborts the request."""
    req, params = prep.request, prep.params
    parser = OutputParser(thinking_open=generation_opens_think(prep.prompt_text),
                          parse_tools=params.parse_tools, stop_sequences=params.stop_sequences)
    decoder = new_decoder(ctx.tokenizer)
    events: asyncio.Queue = asyncio.Queue()
    pump = asyncio.create_task(_pump(ctx, req, events))
    ctx.in_flight += 1
    loop, last_sent, reasoning, output_seen = asyncio.get_running_loop(), 0.0, 0, 0
    last_sent = loop.time()
    final: TokenEvent | None = None
    try:
        while final is None:
            wait = max(0.0, last_sent + ctx.keepalive_s - loop.time())
            try:
                ev = await asyncio.wait_for(events.get(), wait)
            except asyncio.TimeoutError:
                last_sent = loop.time()
                yield KEEPALIVE
                continue
            ids = [t for t in ev.token_ids if t not in req.stop_ids]
            output_seen += len(ev.token_ids)
            reasoning += len(ids) if parser.mode == "think" else 0
            out = parser.feed(decoder.feed(ids)) if ids else []
            if ev.final:
                out += parser.feed(decoder.flush()) + parser.finish()
                final = ev
            elif parser.stopped is not None:
                final = await _stop_early(ctx, req, events)
            for item in out:
                yield item
            last_sent = loop.time() if out else last_sent
        finished = _finished(final, parser, reasoning, req, output_seen)
        ctx.metrics.observe_usage(finished.usage)
        yield finished
    finally:
        ctx.in_flight -= 1
        if final is None:  # the client went away (or the front-end failed): free the engine's state
            req.abort.abort()
            ctx.core.abort(req.request_id)
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)


async def _pump(ctx: ServerContext, req: GenerateRequest, events: asyncio.Queue) -> None:
    try:
        async for ev in ctx.core.stream(req):
            events.put_nowait(ev)
    except Exception as exc:  # noqa: BLE001 - an engine failure ends this request, not the server
        log.exception("engine failed on %s", req.request_id)
        events.put_nowait(TokenEvent(req.request_id, finish_reason="error", error=f"engine failure: {exc}"))


async def _stop_early(ctx: ServerContext, req: GenerateRequest, events: asyncio.Queue) -> TokenEvent:
    """A stop sequence matched: abort the engine request and wait (briefly) for its final usage."""
    req.abort.abort()
    ctx.core.abort(req.request_id)
    async def final() -> TokenEvent:
        while not (ev := await events.get()).final:
            pass
        return ev

    try:
        return await asyncio.wait_for(final(), 5.0)
    except asyncio.TimeoutError:
        return TokenEvent(req.request_id, finish_reason="abort")


def _finished(ev: TokenEvent, parser: OutputParser, reasoning: int, req: GenerateRequest,
              output_seen: int) -> Finished:
    usage = ev.usage or Usage(prompt_tokens=len(req.prompt_ids), output_tokens=output_seen, reused_tokens=0,
                              prefilled_tokens=len(req.prompt_ids))
    if parser.stopped is not None:
        return Finished("stop_sequence", usage, reasoning, stop_sequence=parser.stopped)
    finish: Finish = ev.finish_reason or "error"
    if finish == "stop" and parser.tool_calls:
        finish = "tool_calls"
    return Finished(finish, usage, reasoning, error=ev.error)


def new_decoder(tokenizer):
    """Streaming detokenizer: feed(ids) -> newly complete text; flush() -> the rest."""
    return tokenizer.incremental_decoder()


def collect(blocks: list, item: OutputEvent) -> None:
    """Accumulate output events into blocks for a non-streaming answer: adjacent deltas of a kind merge."""
    if isinstance(item, ToolCall):
        blocks.append(item)
    elif blocks and type(blocks[-1]) is type(item):
        blocks[-1] = type(item)(blocks[-1].text + item.text)
    else:
        blocks.append(item)


def client_gone(request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
