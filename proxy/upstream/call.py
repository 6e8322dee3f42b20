"""One request's trip through the upstream pool (proxy/upstream/pool.py): the replicas it may try, the one answering,
the chat completions chunks read back as OutputEvents, a Finished with the upstream's usage.

    call = UpstreamCall(pool, ctx, prep)
    await call.connect()        # POST to the replicas in the router's order until one answers 200 (else ApiError)
    async for item in call: ...  # OutputEvents, then one Finished; call.aclose() releases replica and connection

A failure before the first output event goes to the next replica; after it, the answer ends with an error. A
thinking budget (Anthropic thinking.budget_tokens) is kept by cutting the answer where its thinking reached it
and asking the same replica to continue the turn after the thinking (proxy/upstream/budget.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Optional

import aiohttp

from engine.api import Usage
from proxy.errors import ApiError
from proxy.generation import Finished, Prepared
from proxy.prompt.output_parser import OutputEvent, TextDelta, ThinkingDelta, ToolCall, generation_opens_think
from proxy.replay.scripted import Reply, forced_ids
from proxy.sse import read_lines
from proxy.upstream.budget import ThinkingMeter, past_thinking
from proxy.upstream.config import refused_key
from proxy.upstream.routing import Replica
from proxy.upstream.wire import ChunkReader, chat_body

if TYPE_CHECKING:
    from proxy.upstream.pool import UpstreamPool

log = logging.getLogger("killick.upstream")
SESSION_HEADER = "x-session-id"  # the proxy's session key, so a killick upstream keeps the same session
NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class UpstreamCall:
    """One request's trip: the replicas it may try, the one answering now, what came back. Iterated for its
    items; aclose() releases the replica and the connection even when the items were never read."""

    def __init__(self, pool: UpstreamPool, ctx, prep: Prepared):
        self.pool, self.router, self.ctx, self.prep = pool, pool.router, ctx, prep
        self.key = prep.turn.plan.session_key
        self.body = chat_body(prep.conv, prep.params, prep.request.max_new_tokens,
                              pool.config.upstream_model(prep.model))
        self.headers = {**pool._auth(), **({SESSION_HEADER: self.key} if self.key else {}),
                        **{h: prep.headers[h] for h in pool.config.forward_headers if h in prep.headers}}
        self.todo = self.router.order(self.key)
        self.tried: list[str] = []
        self.busy = False  # some replica answered 429
        self.replica: Optional[Replica] = None  # where the request is in flight (asked, or answering)
        self.resp: Optional[aiohttp.ClientResponse] = None
        self.cut_why: Optional[str] = None  # why cut() ended the wait at self.replica
        self._waiting: Optional[asyncio.Timeout] = None  # while the replica's headers are awaited
        self.heard = -math.inf  # time.monotonic() of the last bytes from self.replica (its health check reads it)
        self.t0 = time.perf_counter()
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.past: Optional[ThinkingMeter] = None  # the thinking, where the answer was cut at its budget
        self.broke: Optional[str] = None  # why the last leg's stream broke before its end (_leg)
        self._items = self.items()

    def __aiter__(self) -> "UpstreamCall":
        return self

    async def __anext__(self) -> OutputEvent | Finished:
        return await anext(self._items)

    async def aclose(self) -> None:
        await self._items.aclose()
        self._close()

    async def connect(self) -> None:
        """POST to the next replica in order until one answers 200; an ApiError if none does."""
        while self.todo:
            self._start(self.todo.pop(0))
            url = self.replica.url
            try:
                resp, message = await self._post(self.body)
            except NET_ERRORS as exc:
                self._failed(self.cut_why or describe(exc), down=True)
                continue
            except BaseException:  # cancelled (the agent went away before the replica's headers): not in flight
                self._leave()
                raise
            if resp.status == 200:
                self.resp, self.heard = resp, time.monotonic()
                self.router.answered(self.key, self.replica)
                return
            resp.release()
            if resp.status in (401, 403):  # killick's key, not the agent's: the gateway is at fault
                self._leave()
                raise ApiError(502, f"{refused_key(url, resp.status)}; it said: {message}",
                               headers={"x-should-retry": "false"})
            if resp.status < 500 and resp.status != 429:  # the request itself is at fault: no other replica helps
                self._leave()
                raise ApiError(resp.status, f"upstream {url}: {message}")
            self.busy = self.busy or resp.status == 429
            self._failed(f"HTTP {resp.status}: {message}", down=resp.status in (502, 503, 504))
        status, what = (429, "busy") if self.busy else (503, "unreachable or failing")
        raise ApiError(status, f"no upstream replica answered ({what}): {'; '.join(self.tried)}",
                       code="rate_limit_exceeded" if self.busy else None)

    async def _post(self, body: dict) -> tuple[aiohttp.ClientResponse, Optional[str]]:
        """body POSTed to self.replica's chat completions -> (its response, the error message it sent; None on a
        200). The wait has no deadline of its own: cut() sets one, and it raises as a network failure does."""
        try:
            async with asyncio.timeout(None) as self._waiting:
                resp = await self.pool.http.post(self.replica.url + "/v1/chat/completions", json=body,
                                                 headers=self.headers)
                return resp, None if resp.status == 200 else _error_message(await resp.text())
        finally:
            self._waiting = None

    def _start(self, replica: Replica) -> None:
        """In flight at `replica` from here on: its load, and cut() when its health check fails. After a replica
        failed (refused, cut, 5xx, 429, a stream broken before its first output) this is a retry."""
        self.router.retries += bool(self.tried)
        self.router.started(replica, self.key)
        self.replica, self.cut_why, self.heard = replica, None, -math.inf
        self.pool.calls.add(self)

    def _leave(self, usage: Optional[Usage] = None) -> None:
        """No longer in flight at self.replica; a complete answer's usage is booked there."""
        self.router.finished(self.key, self.replica, usage.prompt_tokens if usage else 0,
                             usage.reused_tokens if usage else 0, ok=usage is not None)
        self.replica = None
        self.pool.calls.discard(self)

    def cut(self, why: str) -> None:
        """The replica's health check failed while it sent nothing: stop waiting for its headers or its next
        chunk now. The failure then goes the usual way: the next replica while nothing went to the agent, else an
        error in the API's shape."""
        self.cut_why = why
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.reschedule(asyncio.get_running_loop().time())  # the POST ends with a TimeoutError
        if self.resp is not None:
            self.resp.close()  # the pending read ends with a ClientConnectionError

    def _failed(self, why: str, down: bool) -> None:
        replica = self.replica
        self.tried.append(f"{replica.url}: {why}")
        self._leave()
        self.router.failed(replica, why, down=down)
        log.warning("upstream %s failed (%s)%s", replica.url, why, "; trying the next" if self.todo else "")

    async def items(self) -> AsyncIterator[OutputEvent | Finished]:
        reply = _ReplyParts()
        meter = ThinkingMeter.of(self.ctx.tokenizer, self.prep.params.thinking_budget)
        try:
            while True:
                reader = self._reader()
                async for item in self._leg(reader, reply, meter):
                    yield item
                failure = self.broke
                if failure is None or reply.started:
                    break
                self._failed(failure, down=True)  # nothing went to the agent yet: the next replica answers instead
                self.resp = self._close_response()
                try:
                    await self.connect()
                except ApiError as err:
                    yield self._error(err.message, reader, status=err.status)
                    return
            if failure is None and meter is not None and meter.reached:
                self.past = meter
                try:
                    reader, failure = await self._after_thinking(meter)
                except ApiError as err:
                    yield self._error(err.message, reader, reply, status=err.status)
                    return
                if failure is None:
                    async for item in self._leg(reader, reply, None):
                        yield item
                    failure = self.broke
            for item in reader.close():
                reply.add(item, self)
                yield item
            yield self._finished(reader, failure, reply)
        finally:
            self._close()

    def _reader(self) -> ChunkReader:
        """The first leg's reader at this replica: whether the prompt opens the thinking, and where the replica was
        seen to send it (Replica.reasoning)."""
        conv = self.prep.conv
        opens = conv.enable_thinking and not conv.continue_last and generation_opens_think(self.prep.prompt_text)
        return ChunkReader(self.prep.params, continues=conv.continue_last, opens_think=opens,
                           reasoning=self.replica.reasoning)

    async def _leg(self, reader: ChunkReader, reply: "_ReplyParts",
                   meter: Optional[ThinkingMeter]) -> AsyncIterator[OutputEvent]:
        """One upstream answer's items, booked in reply; self.broke then says why its stream broke before its end
        (None: it did not). It ends early where the thinking reached the budget."""
        self.broke = None
        chunks = self._chunks(reader)
        try:
            async for item in chunks:
                if isinstance(item, _Failure):  # always the last item
                    self.broke = item.why
                    return
                reply.add(item, self)
                yield item
                if meter is not None and meter.add(item):
                    return
        finally:
            await chunks.aclose()

    async def _after_thinking(self, meter: ThinkingMeter) -> tuple[ChunkReader, Optional[str]]:
        """The answer cut where its thinking reached the budget (closing it stops the upstream), then the same
        replica asked to go on after the thinking, closed: (the continuation's reader, why the connection failed or
        None); an ApiError (502) where the replica refused the continuation."""
        self.resp = self._close_response()
        prep = self.prep
        body = chat_body(past_thinking(prep.conv, meter.text), prep.params,
                         max(1, prep.request.max_new_tokens - meter.tokens), self.body["model"])
        reader = ChunkReader(prep.params, continues=True)
        try:
            resp, message = await self._post(body)
        except NET_ERRORS as exc:
            return reader, self.cut_why or describe(exc)
        if message is not None:
            resp.release()
            raise ApiError(502, f"upstream {self.replica.url} refused to continue the answer after its thinking "
                                f"budget (HTTP {resp.status}: {message})")
        self.resp, self.heard = resp, time.monotonic()
        return reader, None

    async def _chunks(self, reader: ChunkReader) -> AsyncIterator[OutputEvent | "_Failure"]:
        """Output events as the SSE chunks arrive; a _Failure last when the stream broke before its end."""
        done = False
        try:
            async for line in read_lines(self.resp):
                self.heard = time.monotonic()
                if not line.startswith("data:"):
                    continue  # keep-alive comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    continue
                try:
                    items = list(reader.feed(chunk)) if isinstance(chunk, dict) else []
                except (TypeError, ValueError, AttributeError, KeyError) as exc:  # fields not in the API's types
                    yield _Failure(f"a chunk not in the OpenAI shape ({type(exc).__name__}: {exc})")
                    return
                for item in items:
                    yield item
                if reader.ended or reader.error:
                    return
        except NET_ERRORS as exc:
            yield _Failure(self.cut_why or describe(exc))
            return
        if not done and reader.finish is None:
            yield _Failure("the stream ended before its last chunk")

    def _finished(self, reader: ChunkReader, failure: Optional[str], reply: "_ReplyParts") -> Finished:
        if failure is not None:  # output was already out: this answer cannot be completed elsewhere
            self.router.failed(self.replica, failure, down=True)
            return self._error(f"upstream {self.replica.url} failed mid-answer ({failure}); the answer is incomplete",
                               reader, reply)
        if reader.error is not None:
            return self._error(f"upstream {self.replica.url}: {reader.error}", reader, reply)
        if reader.shown is not None:  # the answer showed where this replica sends the thinking
            self.replica.reasoning = reader.shown
        usage = self._usage(reader, reply)
        self._leave(usage)
        parser = reader.parser
        finish = reader.finish or "stop"
        if parser.stopped is not None:
            finish = "stop_sequence"
        elif reply.calls and (finish == "stop" or reader.ended):
            finish = "tool_calls"
        reasoning = reader.usage.reasoning_tokens if reader.usage and reader.usage.reasoning_tokens is not None \
            else reader.reasoning_chunks or self._tokens(reply.thinking)
        if self.past is not None:  # the thinking was the first answer's, cut at the budget
            reasoning = self.past.tokens
        return Finished(finish, usage, reasoning, stop_sequence=parser.stopped, output_ids=self._output_ids(reply))

    def _error(self, message: str, reader: ChunkReader, reply: Optional["_ReplyParts"] = None,
               status: int = 500) -> Finished:
        if self.replica is not None:
            self._leave()
        return Finished("error", self._usage(reader, reply or _ReplyParts()), error=message, error_status=status)

    def _usage(self, reader: ChunkReader, reply: "_ReplyParts") -> Usage:
        """The upstream's figures (its tokenizer, its cache); the proxy's own count where it sends none."""
        u = reader.usage
        prompt = u.prompt_tokens if u and self.past is None else len(self.prep.request.prompt_ids)
        cached = min(u.cached_tokens, prompt) if u else 0
        first = self.first if self.first is not None else time.perf_counter()
        output = u.output_tokens if u else reply.events
        if self.past is not None:  # cut at the thinking budget: the continuation's prompt held the thinking
            output = self.past.tokens + (u.output_tokens if u else 0)
        return Usage(prompt_tokens=prompt, output_tokens=output,
                     reused_tokens=cached, prefilled_tokens=prompt - cached, ttft_s=first - self.t0,
                     prefill_s=first - self.t0, decode_s=(self.last or first) - first)

    def _tokens(self, pieces: list[str]) -> int:
        """The proxy's token count of text (the thinking a replica sent as content, when it counts none)."""
        return len(self.ctx.tokenizer.encode("".join(pieces))) if pieces else 0

    def _output_ids(self, reply: "_ReplyParts") -> tuple[int, ...]:
        """The answer as the chat template writes it, in the proxy's tokens: the cache policy's diff of the next
        turn compares against it (the upstream's own ids are not in its OpenAI answer)."""
        try:
            return tuple(forced_ids(self.ctx.renderer, self.ctx.tokenizer, self.prep.conv, self.prep.prompt_text,
                                    reply.reply()))
        except Exception:  # noqa: BLE001 - bookkeeping must never cost the agent its answer
            log.exception("could not render the upstream's answer for the cache policy")
            return ()

    def _close(self) -> None:
        self.resp = self._close_response()
        if self.replica is not None:  # left early (the client went away)
            self._leave()

    def _close_response(self) -> None:
        if self.resp is not None:
            self.resp.close()  # an unfinished answer: closing the connection stops the upstream's generation
        return None


@dataclass(frozen=True)
class _Failure:
    why: str


class _ReplyParts:
    """The answer so far, kept to book it with the cache policy; `started` once anything went to the agent."""

    def __init__(self):
        self.thinking, self.text, self.calls, self.events = [], [], [], 0

    @property
    def started(self) -> bool:
        return self.events > 0

    def add(self, item: OutputEvent, call: UpstreamCall) -> None:
        now = time.perf_counter()
        call.first = call.first if call.first is not None else now
        call.last = now
        self.events += 1
        if isinstance(item, ThinkingDelta):
            self.thinking.append(item.text)
        elif isinstance(item, TextDelta):
            self.text.append(item.text)
        elif isinstance(item, ToolCall):
            self.calls.append((item.name, item.arguments))

    def reply(self) -> Reply:
        return Reply(thinking="".join(self.thinking), text="".join(self.text), tool_calls=tuple(self.calls))


def describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_message(text: str) -> str:
    """The message inside an OpenAI- or Anthropic-shaped error body, else the body's start."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:300] or "(empty body)"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    return text.strip()[:300]
