"""Server-sent events: one writer for all three APIs, and the line reader their clients use.

Anthropic names its events (`event: message_start`); OpenAI chat sends bare `data:` lines ending with
`data: [DONE]`; Responses names them too. Keep-alives are Anthropic `ping` events or SSE comment lines.
`read_lines(resp)` splits an aiohttp client response into lines (replay's client, upstream mode).
"""
from __future__ import annotations

import json

from aiohttp import web

from proxy.errors import STREAM_STARTED

_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}


def _dumps(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def frame(data: dict, name: str | None = None) -> bytes:
    """One event as it goes on the wire (SSEWriter.write sends it): framed once, it can be sent to many."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {_dumps(data)}\n\n".encode("utf-8")


class SSEWriter:
    def __init__(self, request: web.Request, headers: dict[str, str] | None = None):
        self.request = request
        self.response = web.StreamResponse(status=200, headers={**_HEADERS, **(headers or {})})
        self.started = False

    async def start(self) -> None:
        if not self.started:
            self.request[STREAM_STARTED] = True
            await self.response.prepare(self.request)
            self.started = True

    async def event(self, data: dict, name: str | None = None) -> None:
        await self.write(frame(data, name))

    async def data_line(self, text: str) -> None:
        await self.write(f"data: {text}\n\n".encode("utf-8"))

    async def comment(self, text: str = "keep-alive") -> None:
        await self.write(f": {text}\n\n".encode("utf-8"))

    async def finish(self) -> web.StreamResponse:
        await self.start()
        await self.response.write_eof()
        return self.response

    async def write(self, framed: bytes) -> None:
        await self.start()
        await self.response.write(framed)


async def read_lines(resp):
    """The lines of an aiohttp client response, of any length (a final Responses event carries the whole
    response), stripped."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace").strip()
    if buf:
        yield buf.decode("utf-8", "replace").strip()
