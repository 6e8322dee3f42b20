"""A request's way to the engine, before any byte of the answer: normalise -> render -> check the context ->
plan, in a planning thread (ServerContext.planning, off the event loop), then the GenerateRequest
(proxy.generation.Prepared). Errors are ApiErrors. Shared by every API front-end, count_tokens too."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, NamedTuple

from aiohttp import web

from engine.api import GenerateRequest, ThinkingBudget
from proxy.context import ServerContext
from proxy.conversation import Conversation, Message, TextPart, ThinkingPart, ToolCallPart, ToolResultPart
from proxy.errors import ApiError
from proxy.generation import ARRIVED, TURN, GenParams, Prepared, Turn
from proxy.policy.planner import Plan
from proxy.prompt.output_parser import THINK_CLOSE, THINK_OPEN, generation_opens_think
from proxy.prompt.truncation import fit

if TYPE_CHECKING:
    from proxy.prompt.render import Rendered

log = logging.getLogger("killick.proxy")


class Planned(NamedTuple):
    """What the planning thread hands back for one request."""

    conv: Conversation  # normalised
    rendered: Rendered
    plan: Plan
    render_s: float  # rendering and tokenizing
    plan_s: float  # the planner's call


async def prepare(ctx: ServerContext, request: web.Request, conv: Conversation, params: GenParams,
                  body: Mapping) -> Prepared:
    """normalise -> render -> check the context -> plan (in ctx.planning) -> GenerateRequest."""
    headers = request.headers
    planned = await off_loop(ctx, _plan_request, ctx, conv, headers, body, answer_room(ctx, params))
    conv, rendered, plan = planned.conv, planned.rendered, planned.plan
    n = len(rendered.ids)
    max_new = min(params.max_tokens or ctx.default_max_tokens, ctx.context_length - n)
    forced = ctx.replies.reply_ids(ctx, conv, rendered.text, headers, plan) if ctx.replies is not None else None
    if forced is not None:
        max_new = max(max_new, min(len(forced), ctx.context_length - n))  # a replay is not cut short
    gen_request = GenerateRequest(
        prompt_ids=list(rendered.ids), max_new_tokens=max_new, sampling=params.sampling,
        stop_ids=frozenset(ctx.tokenizer.eos_ids), checkpoint_positions=tuple(plan.checkpoint_positions),
        session_key=plan.session_key, forced_output_ids=forced,
        thinking_budget=_thinking_budget(ctx, params.thinking_budget, rendered.text))
    arrived = request.get(ARRIVED)
    turn = request[TURN] = Turn(plan, arrived=arrived,
                                prepare_s=None if arrived is None else time.monotonic() - arrived,
                                render_s=planned.render_s, plan_s=planned.plan_s)
    return Prepared(conv, params, rendered.text, gen_request, turn, str(body.get("model") or ""), headers)


def _thinking_budget(ctx: ServerContext, tokens: int | None, prompt_text: str) -> ThinkingBudget | None:
    """The engine closes the thinking at the budget by writing `</think>` itself; it counts from the output's
    start where the generation prompt opened the thinking, else from the model's own `<think>`."""
    if tokens is None:
        return None
    opens = () if generation_opens_think(prompt_text) else tuple(ctx.tokenizer.encode(THINK_OPEN))
    return ThinkingBudget(tokens, tuple(ctx.tokenizer.encode(THINK_CLOSE)), opens)


async def off_loop(ctx: ServerContext, fn: Callable, *args):
    """fn(*args) in a planning thread: the CPU work of a request, which grows with its prompt, never stalls the
    event loop (every other request's stream, keep-alives, /health) however large the request."""
    return await asyncio.get_running_loop().run_in_executor(ctx.planning, fn, *args)


def _plan_request(ctx: ServerContext, conv: Conversation, headers: Mapping[str, str], body: Mapping,
                  room: int | None) -> Planned:
    """normalise -> render -> check the context -> plan, in a planning thread. The planner is thread-safe: two
    requests of one session planned at once take its lock in turn; each gets its turn number only once the engine
    takes it (Generation: planner.admit)."""
    conv = normalize(ctx, conv, headers, body)
    t0 = time.monotonic()
    conv, rendered = _render_fitting(ctx, conv, room)
    t1 = time.monotonic()
    plan = _plan(ctx, conv, rendered, headers, body)
    return Planned(conv, rendered, plan, t1 - t0, time.monotonic() - t1)


def answer_room(ctx: ServerContext, params: GenParams) -> int | None:
    """With truncation (params.truncate), the tokens of the context a prompt leaves its answer: what the request
    asks for (else the server's default), at most half the context. None: no truncation."""
    if not params.truncate:
        return None
    return min(params.max_tokens or ctx.default_max_tokens, ctx.context_length // 2)


def _render_fitting(ctx: ServerContext, conv: Conversation, room: int | None) -> tuple[Conversation, Rendered]:
    """The conversation and its prompt, refused (too_long) where it cannot fit the context. With `room`
    (truncation): less its oldest messages (proxy/prompt/truncation.py) where it would leave the answer fewer
    than `room` tokens; what truncation keeps is served wherever it fits at all."""
    if room is None:
        return conv, _within_context(ctx, _render_if_it_fits(ctx, conv))
    try:
        conv, rendered = _truncated(ctx, conv, ctx.context_length - room + 1)
        return conv, _within_context(ctx, rendered)
    except ApiError as err:
        if err.code != TOO_LONG:
            raise
        raise ApiError(400, err.message + KEPT_NOTE, param=err.param, code=TOO_LONG) from None


def _within_context(ctx: ServerContext, rendered: Rendered) -> Rendered:
    n = len(rendered.ids)
    if n >= ctx.context_length:
        raise too_long(ctx, f"{n} tokens")
    return rendered


KEPT_NOTE = "; truncation keeps the instructions, the last user message and the last input item"


def _truncated(ctx: ServerContext, conv: Conversation, limit: int) -> tuple[Conversation, Rendered]:
    """conv whole where its prompt stays under `limit` tokens, else less its oldest messages (truncation.fit)."""
    try:
        rendered = _render_if_it_fits(ctx, conv, limit)
        if len(rendered.ids) < limit:
            return conv, rendered
    except ApiError as err:
        if err.code != TOO_LONG:
            raise
    return fit(conv, limit, functools.partial(_render_if_it_fits, ctx), functools.partial(_text_tokens, ctx))


def _text_tokens(ctx: ServerContext, messages: Iterable[Message], most: int) -> int:
    """The tokens of the messages' text, counted exactly below `most` (where the cheap bound stays below it)."""
    texts = list(_message_texts(messages))
    at_least = ctx.tokenizer.tokens_at_least(texts, most)
    return at_least if at_least >= most else sum(len(ctx.tokenizer.encode(t)) for t in texts)


def normalize(ctx: ServerContext, conv: Conversation, headers: Mapping[str, str], body: Mapping) -> Conversation:
    try:
        return ctx.planner.normalize(conv, headers, body)
    except Exception:  # noqa: BLE001 - a policy bug must not cost the agent its answer
        log.exception("cache policy failed to normalise a request; serving it as sent")
        return conv


def _plan(ctx: ServerContext, conv: Conversation, rendered, headers: Mapping[str, str], body: Mapping) -> Plan:
    try:
        return ctx.planner(conv, rendered, headers, body)
    except Exception:  # noqa: BLE001 - without a plan the engine still serves (its own checkpoints only)
        log.exception("cache policy failed to plan a request; serving it without anchors")
        return Plan()


async def prompt_tokens(ctx: ServerContext, conv: Conversation, headers: Mapping[str, str], body: Mapping) -> int:
    """The tokens conv's prompt holds (count_tokens): normalised and rendered off the event loop, as prepare()
    does. A prompt longer than the context is counted too: the endpoint is there to learn a prompt's size before
    sending it, and an agent over the context asks how far over; past COUNT_CONTEXTS contexts it is refused
    before all of it is tokenized."""
    limit = COUNT_CONTEXTS * ctx.context_length

    def count() -> int:
        return len(_render_if_it_fits(ctx, normalize(ctx, conv, headers, body), limit).ids)

    return await off_loop(ctx, count)


# count_tokens counts prompts up to this many contexts (a planning thread tokenizes all of it: at the Qwen3.6
# context, 2M tokens)
COUNT_CONTEXTS = 8


def _render_if_it_fits(ctx: ServerContext, conv: Conversation, limit: int | None = None):
    """The rendered prompt, refused (too_long) where it holds at least `limit` tokens (default: the context)
    by a count that stops there."""
    limit = limit or ctx.context_length
    at_least = ctx.tokenizer.tokens_at_least(_texts(conv), limit)
    if at_least >= limit:
        raise too_long(ctx, f"at least {at_least} tokens", limit)
    try:
        return ctx.renderer.render(conv, add_generation_prompt=True)
    except ValueError as exc:  # the template refuses this conversation: the agent's input is at fault
        raise ApiError(400, f"cannot render this conversation: {exc}", param="messages") from None


TOO_LONG = "context_length_exceeded"


def too_long(ctx: ServerContext, size: str, limit: int | None = None) -> ApiError:
    """The prompt of `size` does not fit below `limit` tokens (default: the context, which keeps one for the
    answer)."""
    return ApiError(400, f"prompt is too long: {size} > {(limit or ctx.context_length) - 1} maximum", param="messages",
                    code=TOO_LONG)


def _texts(conv: Conversation) -> Iterator[str]:
    """Every text of the conversation that the prompt will hold."""
    yield from _message_texts(conv.messages)
    for tool in conv.tools:
        yield from (tool.name, tool.description, tool.parameters_json)


def _message_texts(messages: Iterable[Message]) -> Iterator[str]:
    for message in messages:
        for part in message.parts:
            if isinstance(part, (TextPart, ThinkingPart)):
                yield part.text
            elif isinstance(part, ToolCallPart):
                yield part.arguments
            elif isinstance(part, ToolResultPart):
                yield part.content
