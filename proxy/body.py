"""Request bodies as every POST endpoint reads them: JSON only, bounded in bytes, time and nesting.

    body = await read_json_object(request)      # a dict, or an ApiError in the route's shape

- The Content-Type must be JSON (`application/json` or a `+json` type), else 415: a web page can make a
  browser send a text/plain or form body to a loopback server without asking first; a JSON body it cannot.
- At most MAX_BODY bytes (Anthropic's own limit): a larger Content-Length is a 413 before a byte is read.
- A body that stops arriving for BODY_IDLE_S is a 408, so a client that declares more than it sends cannot
  hold its connection.
- Integers longer than Python converts (4,300 digits), nesting deeper than MAX_DEPTH and lone UTF-16
  surrogates (text that cannot be encoded, neither for the model nor back out as UTF-8) are 400s.
The parsed body stays on the request under JSON_BODY (the recorder writes it).
"""
from __future__ import annotations

import asyncio
import json
import re

from aiohttp import web

from proxy.errors import ApiError

MAX_BODY = 32 * 2**20
BODY_IDLE_S = 30.0
MAX_DEPTH = 64  # agents' deepest JSON (tool schemas inside a request) is about 10 levels
JSON_BODY = web.RequestKey("killick_json_body", dict)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json_object(request: web.Request) -> dict:
    """The request body as a JSON object, or a 4xx that says what is wrong with it."""
    if not is_json_type(request.content_type):
        raise ApiError(415, f"Content-Type must be application/json, got {request.content_type}")
    raw = await read_bounded(request)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, a 5,000-digit integer
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    check_json(body, surrogates=_SURROGATE_ESCAPE.search(raw) is not None)
    request[JSON_BODY] = body
    return body


def is_json_type(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


async def read_bounded(request: web.Request) -> bytes:
    """At most MAX_BODY bytes, each part arriving within BODY_IDLE_S of the one before."""
    declared = request.content_length
    if declared is not None and declared > MAX_BODY:
        raise ApiError(413, f"request body too large: {declared} bytes > {MAX_BODY} maximum")
    chunks, size = [], 0
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), BODY_IDLE_S)
        except asyncio.TimeoutError:
            raise ApiError(408, f"request body: nothing arrived for {BODY_IDLE_S:g} s "
                                f"({size} of {declared if declared is not None else '?'} bytes read)") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"request body too large: more than {MAX_BODY} bytes")
        chunks.append(chunk)


def check_json(value, *, surrogates: bool = True, max_depth: int = MAX_DEPTH, where: str = "request body") -> None:
    """400 if `value` nests deeper than max_depth or (surrogates=True) holds a lone surrogate anywhere.
    Iterative, one iterator a level: memory grows with the depth, not the size."""
    stack = [iter((value,))]
    while stack:
        for node in stack[-1]:
            if isinstance(node, str):
                if surrogates and _SURROGATE.search(node):
                    raise _surrogate_error(where, node)
            elif isinstance(node, (dict, list)):
                if len(stack) > max_depth:
                    raise ApiError(400, f"{where}: JSON nested deeper than {max_depth} levels")
                if isinstance(node, dict) and surrogates:
                    for key in node:
                        if _SURROGATE.search(key):
                            raise _surrogate_error(where, key)
                stack.append(iter(node.values() if isinstance(node, dict) else node))
                break
        else:
            stack.pop()


def _surrogate_error(where: str, text: str) -> ApiError:
    at = _SURROGATE.search(text).start()
    return ApiError(400, f"{where}: text holds a lone UTF-16 surrogate ({text[max(0, at - 8):at + 8]!r}); "
                         "send valid Unicode")
