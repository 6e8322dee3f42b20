"""Send recorded requests to a server and measure each on the client side. Torch-free.

TTFT is send -> the first content, thinking or tool delta of a stream; a non-streaming request has no first
delta, so its TTFT is the total time (ttft_kind "total"). Tokens come from the API's usage fields:
prompt, cached (the prefix-cache hit) and prefilled = prompt - cached (what the engine ran through the model).
The edit point, class and resume point come from the server's x-killick-edit-point / -edit-class / -resume-at
headers when it sends them; with them, the cached tokens that came from another session (shared: all of a
session's first request's, those past the edit point on a later one; proxy/policy/turns.from_other_sessions).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

import aiohttp

from proxy.policy.turns import from_other_sessions
from proxy.replay.log import Entry, request_body, request_headers
from proxy.replay.scripted import FORCE_RESPONSE_HEADER, encode_header
from proxy.sse import read_lines

DELTA_EVENTS = {"content_block_delta"}  # Anthropic; Responses: any *.delta event


@dataclass
class Result:
    index: int
    session: str
    turn: int  # 1-based request number within its session
    path: str
    status: int
    stream: bool
    forced: bool
    ttft_s: float
    ttft_kind: str  # "first delta" or "total" (non-streaming)
    total_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    output_tokens: int = 0
    decode_tok_s: float = 0.0
    edit_point: int | None = None
    edit_class: str | None = None
    resume_at: int | None = None  # the planner's checkpoint at or before the edit point
    kind: str | None = None
    error: str | None = None
    shared_tokens: int | None = None  # of the cached tokens, those from another session (needs the headers)

    def to_json(self) -> dict:
        return asdict(self)


class _Clock:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def delta(self) -> None:
        now = time.perf_counter()
        self.first = self.first if self.first is not None else now
        self.last = now


async def send(session: aiohttp.ClientSession, base_url: str, entry: Entry, turn: int,
               unforced_max_tokens: int = 32, timeout_s: float = 1800.0, stream: bool = False) -> Result:
    """stream=True sends non-streaming requests as streams, so their TTFT is a first delta too."""
    headers = request_headers(entry)
    stream = stream or entry.stream
    reply = entry.reply()
    if reply is not None:
        headers[FORCE_RESPONSE_HEADER] = encode_header(reply)
    body = request_body(entry, unforced_max_tokens, stream)
    clock, usage = _Clock(), {}
    async with session.post(base_url.rstrip("/") + entry.path, json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            text = await resp.text()
            return _result(entry, turn, resp, reply is not None, clock, {}, stream, error=text[:300])
        if stream:
            usage = await _read_stream(resp, entry.path.split("?")[0], clock)
        else:
            usage = _usage(entry.path.split("?")[0], await resp.json())
            clock.first = clock.last = time.perf_counter()
        return _result(entry, turn, resp, reply is not None, clock, usage, stream)


async def _read_stream(resp: aiohttp.ClientResponse, api: str, clock: _Clock) -> dict:
    usage: dict = {}
    async for line in read_lines(resp):
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except json.JSONDecodeError:
            continue
        if _is_delta(api, event):
            clock.delta()
        usage = _stream_usage(api, event) or usage
    return usage


def _is_delta(api: str, event: dict) -> bool:
    if api == "/v1/messages":
        return event.get("type") in DELTA_EVENTS
    if api == "/v1/responses":
        return str(event.get("type", "")).endswith(".delta")
    delta = (event.get("choices") or [{}])[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def _stream_usage(api: str, event: dict) -> dict:
    if api == "/v1/messages":
        if event.get("type") == "message_delta":
            return _usage(api, {"usage": event.get("usage") or {}})
        return {}
    if api == "/v1/responses":
        done = event.get("type") in ("response.completed", "response.incomplete")  # incomplete: max tokens hit
        return _usage(api, event["response"]) if done else {}
    return _usage(api, event) if event.get("usage") else {}


def _usage(api: str, body: dict) -> dict:
    """(prompt, cached, output) tokens from any API's usage object."""
    u = body.get("usage") or {}
    if api == "/v1/messages":
        cached = int(u.get("cache_read_input_tokens") or 0)
        return {"prompt": int(u.get("input_tokens") or 0) + cached, "cached": cached,
                "output": int(u.get("output_tokens") or 0)}
    if api == "/v1/responses":
        return {"prompt": int(u.get("input_tokens") or 0),
                "cached": int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0),
                "output": int(u.get("output_tokens") or 0)}
    return {"prompt": int(u.get("prompt_tokens") or 0),
            "cached": int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
            "output": int(u.get("completion_tokens") or 0)}


def _result(entry: Entry, turn: int, resp, forced: bool, clock: _Clock, usage: dict, stream: bool,
            error: str | None = None) -> Result:
    end = time.perf_counter()
    first = clock.first if clock.first is not None else end
    out = int(usage.get("output", 0))
    span = (clock.last or first) - first
    edit, resume = resp.headers.get("x-killick-edit-point"), resp.headers.get("x-killick-resume-at")
    edit_class, cached = resp.headers.get("x-killick-edit-class"), int(usage.get("cached", 0))
    shared = from_other_sessions(cached, int(edit), edit_class) if edit is not None and edit_class else None
    return Result(
        entry.index, entry.session, turn, entry.path.split("?")[0], resp.status, stream, forced,
        ttft_s=first - clock.start, ttft_kind="first delta" if stream else "total", total_s=end - clock.start,
        prompt_tokens=int(usage.get("prompt", 0)), cached_tokens=cached,
        prefilled_tokens=int(usage.get("prompt", 0)) - cached, output_tokens=out,
        decode_tok_s=(out - 1) / span if stream and span > 0 and out > 1 else 0.0,
        edit_point=int(edit) if edit is not None else None, edit_class=edit_class,
        resume_at=int(resume) if resume is not None else None,
        kind=resp.headers.get("x-killick-turn-kind"), error=error, shared_tokens=shared)


class Replayed(list):
    """The Results of one replay in request order, with `wall_s` (the first send to the last answer) and
    `engine`: what the server's engine counters (GET /v1/killick/stats; {} where not served) grew by during it,
    so a server that answered other requests before is not counted for them."""

    wall_s: float = 0.0
    engine: dict = {}


async def replay(base_url: str, entries: list[Entry], unforced_max_tokens: int = 32,
                 timeout_s: float = 1800.0, stream: bool = False, concurrent: bool = False,
                 api_key: str | None = None) -> Replayed:
    """Send every entry in order, one at a time (concurrent: each recorded session's requests in order, all
    sessions side by side from the same moment, like agents started together); turns are numbered per
    recorded session. A session is (recording file, session key): two recordings may both hold an "anon-1".
    api_key: the server's --api-key, sent as a bearer token (recordings hold no keys)."""
    turns: dict[tuple[str, str], int] = {}
    numbered = []
    for entry in entries:
        key = (entry.source, entry.session)
        turns[key] = turns.get(key, 0) + 1
        numbered.append((entry, turns[key]))
    results: dict[int, Result] = {}
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=auth) as session:
        before = await engine_stats(session, base_url)

        async def run(queue: list) -> None:
            for entry, turn in queue:
                results[entry.index] = await send(session, base_url, entry, turn, unforced_max_tokens, timeout_s,
                                                  stream)

        start = time.perf_counter()
        try:
            if concurrent:
                sessions = [[(e, t) for e, t in numbered if (e.source, e.session) == k] for k in turns]
                await asyncio.gather(*(run(queue) for queue in sessions))
            else:
                await run(numbered)
        except (aiohttp.ClientConnectionError, aiohttp.InvalidURL) as exc:
            raise ValueError(f"cannot reach {base_url} ({exc or type(exc).__name__}); is the server "
                             "running there?") from None
        out = Replayed(results[e.index] for e, _ in numbered)
        out.wall_s = time.perf_counter() - start
        out.engine = counters_since(before, await engine_stats(session, base_url))
    return out


def counters_since(before: dict, after: dict) -> dict:
    """The numeric counters of `after` less their values in `before` (one missing there counts from 0); text
    values as `after` has them."""
    return {k: v - before.get(k, 0) if isinstance(v, (int, float)) and isinstance(before.get(k, 0), (int, float))
            else v for k, v in after.items()}


async def engine_stats(session: aiohttp.ClientSession, base_url: str) -> dict:
    """The engine's scalar counters from /v1/killick/stats ({} when the server does not answer it)."""
    try:
        async with session.get(base_url.rstrip("/") + "/v1/killick/stats") as resp:
            data = await resp.json() if resp.status == 200 else {}
    except (aiohttp.ClientError, ValueError):
        return {}
    engine = data.get("engine") if isinstance(data, dict) else None
    return {k: v for k, v in (engine or {}).items() if isinstance(v, (int, float, str))}
