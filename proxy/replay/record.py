"""`killick serve --record DIR`: one JSON line per API request, appended to a file per cache session.

    {"ts", "method", "path", "headers", "body", "status", "response", "metrics"}

headers: as received, credentials redacted; response: the final assembled response in the API's shape (for a
stream, the body a non-streaming call would have returned; tool-call ids differ from the streamed ones);
metrics: prompt / reused / prefilled tokens, TTFT and decode tok/s from the engine, and the cache policy's
session, turn kind, edit point and edit class. The file is DIR/<session key, sanitised>.jsonl; requests the
policy gives no session to go to DIR/no-session.jsonl. `killick replay` reads these lines back.

The generation pipeline reports into a per-request slot held in a context variable, so handlers stay as
they are: Generation notes its plan, blocks and Finished; each front-end notes its assembled response.
"""
from __future__ import annotations

import contextvars
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

log = logging.getLogger("killick.record")
REDACTED = "<redacted>"
SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization"}
NOT_RECORDED = {"x-killick-force-response", "x-killick-forced-output"}
RECORDED_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")


@dataclass
class Slot:
    """What one request's pipeline reports while it runs."""

    turn: Any = None  # the planner's plan (TurnPlan with .record, or the default Plan)
    finished: Any = None  # proxy.generation.Finished
    response: Callable[[], dict] | None = None  # builds the assembled response on demand
    extra: dict = field(default_factory=dict)


_CURRENT: contextvars.ContextVar[Slot | None] = contextvars.ContextVar("killick_record_slot", default=None)


def current() -> Slot | None:
    return _CURRENT.get()


def note_response(build: Callable[[], dict]) -> None:
    """Front-ends call this with a builder of their final body; it runs only when recording."""
    slot = _CURRENT.get()
    if slot is not None:
        slot.response = build


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


def metrics(slot: Slot) -> dict:
    out: dict = {}
    fin = slot.finished
    if fin is not None:
        u = fin.usage
        out.update(prompt_tokens=u.prompt_tokens, reused_tokens=u.reused_tokens,
                   prefilled_tokens=u.prefilled_tokens, output_tokens=u.output_tokens, cache_tier=u.cache_tier,
                   ttft_s=round(u.ttft_s, 6), prefill_s=round(u.prefill_s, 6),
                   decode_tok_s=round(u.decode_tok_s, 3), finish=fin.finish)
    record = getattr(slot.turn, "record", None)
    if record is not None:
        out.update(session=record.session_key, harness=record.harness, turn_index=record.turn_index,
                   kind=record.request_kind, edit_point=record.edit_point, edit_class=record.edit_class,
                   anchor_used=record.anchor_used, expected_reprefill=record.expected_reprefill)
    else:
        out["session"] = getattr(slot.turn, "session_key", None)
    return out


class Recorder:
    """Appends lines under `directory`; thread-safe (one lock, files opened per write)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, line: dict) -> Path:
        path = self.dir / session_file_name(line.get("metrics", {}).get("session"))
        text = json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock, path.open("a", encoding="utf-8") as fh:
            fh.write(text)
        return path


SLOT = web.RequestKey("killick_record_slot", Slot)  # the slot again, for on_response_prepare
PLAN_HEADERS = {"x-killick-session": "session", "x-killick-turn-kind": "kind",
                "x-killick-edit-point": "edit_point", "x-killick-edit-class": "edit_class",
                "x-killick-resume-at": "anchor_used"}


def slot_middleware(recorder: Recorder | None):
    """Opens the per-request slot the pipeline reports into; writes the line when recording."""

    @web.middleware
    async def slot(request: web.Request, handler):
        if request.method != "POST" or request.path not in RECORDED_PATHS:
            return await handler(request)
        slot, ts = Slot(), time.time()
        request[SLOT] = slot
        token = _CURRENT.set(slot)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            _CURRENT.reset(token)
            if recorder is not None:
                await _write(recorder, request, slot, ts, status)

    return slot


async def plan_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the plan is made before any byte, so even a stream carries its edit point
    (x-killick-edit-point / -edit-class / -resume-at / -session / -turn-kind) for clients such as replay."""
    slot = request.get(SLOT)
    if slot is None or slot.turn is None:
        return
    found = metrics(slot)
    for name, key in PLAN_HEADERS.items():
        if found.get(key) is not None:
            response.headers[name] = str(found[key])


async def _write(recorder: Recorder, request: web.Request, slot: Slot, ts: float, status: int) -> None:
    try:
        recorder.write(await _line(request, slot, ts, status))
    except Exception:  # noqa: BLE001 - a recording must never fail the request
        log.exception("could not record %s %s", request.method, request.path)


async def _line(request: web.Request, slot: Slot, ts: float, status: int) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw.decode("utf-8", "replace")
    response = None
    if slot.response is not None:
        try:
            response = slot.response()
        except Exception as exc:  # noqa: BLE001 - a recording must never fail the request
            response = {"killick_record_error": str(exc)}
    return {"ts": round(ts, 6), "method": request.method, "path": request.path_qs, "headers": redact(request.headers),
            "body": body, "status": status, "response": response, "metrics": metrics(slot)}
