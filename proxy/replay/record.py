"""`killick serve --record DIR`: one JSON line per API request, appended to a file per cache session.

    {"ts", "method", "path", "headers", "body", "status", "response", "metrics"}

headers: as received, credentials redacted; response: the final assembled response in the API's shape (for a
stream, the body a non-streaming call would have returned; tool-call ids differ from the streamed ones);
metrics: prompt / reused / prefilled tokens, TTFT and decode tok/s from the engine, the reused tokens that
came from another session (shared_tokens, None without the cache policy), and the cache policy's session,
turn kind, edit point and edit class. The file is DIR/<session key, sanitised>.jsonl; requests the
policy gives no session to go to DIR/no-session.jsonl. `killick replay` reads these lines back.

The Recorder is the app's TurnObserver (create_app(observer=Recorder(DIR))): the app calls turn_done() once
per authenticated API request with the request's Turn (proxy/generation.py: plan, Finished, the answer's body)
or None when it was refused before planning; body is null where the request's body was not a JSON object. A
background Responses create is recorded once its response has ended, with that response (not the queued one
the call answered) and the engine's figures.
Recordings hold whole conversations: files are created readable by their owner only (0600), and so is DIR
when the recorder creates it (an existing DIR open to others gets a warning).
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
from pathlib import Path

from aiohttp import web

from proxy.body import JSON_BODY
from proxy.generation import Turn
from proxy.replay.scripted import FORCE_RESPONSE_HEADER
from proxy.replay.sources import OUTPUT_HEADER

log = logging.getLogger("killick.record")
REDACTED = "<redacted>"
SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization"}
NOT_RECORDED = {FORCE_RESPONSE_HEADER, OUTPUT_HEADER}  # the replies the request asked for


def redact(headers) -> dict:
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if low in NOT_RECORDED:
            continue
        out[name] = REDACTED if low in SECRET_HEADERS else value
    return out


def session_file_name(key: str | None) -> str:
    if not key:
        return "no-session.jsonl"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._")[:96] + ".jsonl"


def metrics(turn: Turn | None) -> dict:
    """The engine's figures for the turn, then the plan's (proxy/policy/planner.Plan.fields)."""
    out: dict = {}
    fin = turn.finished if turn is not None else None
    if fin is not None:
        u = fin.usage
        out.update(prompt_tokens=u.prompt_tokens, reused_tokens=u.reused_tokens,
                   shared_tokens=turn.plan.shared_tokens(u),
                   prefilled_tokens=u.prefilled_tokens, output_tokens=u.output_tokens, cache_tier=u.cache_tier,
                   ttft_s=round(u.ttft_s, 6), prefill_s=round(u.prefill_s, 6),
                   decode_tok_s=round(u.decode_tok_s, 3), finish=fin.finish)
    out.update(turn.plan.fields() if turn is not None else {"session": None})
    return out


class Recorder:
    """Appends lines under `directory`; thread-safe (one lock, files opened per write)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if self.dir.is_dir():
            if self.dir.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                log.warning("recording into %s, which other users can open; its files are kept owner-only",
                            self.dir)
        else:
            self.dir.mkdir(parents=True, mode=0o700)
        self._lock = threading.Lock()

    def write(self, line: dict) -> Path:
        path = self.dir / session_file_name(line.get("metrics", {}).get("session"))
        text = json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock, open(os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600), "a+",
                              encoding="utf-8", errors="backslashreplace") as fh:
            if fh.tell() and _last_byte(fh) != "\n":  # a line cut off (a crash mid-write) stays a line of its own
                text = "\n" + text
            fh.write(text)
        return path

    async def turn_done(self, request: web.Request, turn: Turn | None, status: int, started: float) -> None:
        try:
            self.write(request_line(request, turn, status, started))
        except Exception:  # noqa: BLE001 - a recording must never fail the request
            log.exception("could not record %s %s", request.method, request.path)


def _last_byte(fh) -> str:
    """The last character of a file open for appending (its position at the end)."""
    end = fh.tell()
    fh.buffer.seek(end - 1)
    last = fh.buffer.read(1).decode("latin-1")
    fh.seek(end)
    return last


def request_line(request: web.Request, turn: Turn | None, status: int, started: float) -> dict:
    response = None
    if turn is not None and turn.response is not None:
        try:
            response = turn.response()
        except Exception as exc:  # noqa: BLE001 - a recording must never fail the request
            response = {"killick_record_error": str(exc)}
    return {"ts": round(started, 6), "method": request.method, "path": request.path_qs,
            "headers": redact(request.headers), "body": request.get(JSON_BODY), "status": status,
            "response": response, "metrics": metrics(turn)}
