"""Reading recordings back for `killick replay`. Torch-free.

A recording is JSON lines (plain or .gz), one request each: `method`, `path`, `headers`, `body` are required;
`ts`, `response` and `metrics` (what `killick serve --record` adds) are optional and any other field is
ignored. Several files (or a directory of them) are merged in `ts` order, so sessions stay interleaved as
they were recorded. A file that cannot be read or a field of the wrong type is a ValueError naming the file
and line; a request whose recorded body is not a JSON object (the server refused it) is skipped with a warning.
"""
from __future__ import annotations

import gzip
import json
import logging
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from proxy.apis.responses.tools import flat_name
from proxy.replay.scripted import Reply

log = logging.getLogger("killick.replay")
API_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
# Not forwarded: transport headers (the client sets its own), credentials (redacted anyway), our own hooks.
DROP_HEADERS = {"host", "content-length", "content-type", "connection", "transfer-encoding", "accept-encoding",
                "authorization", "x-api-key", "api-key", "proxy-authorization", "cookie", "x-killick-force-response",
                "x-killick-forced-output"}


@dataclass(frozen=True)
class Entry:
    index: int  # position in the merged recording
    session: str
    ts: float | None
    method: str
    path: str
    headers: dict
    body: dict
    response: Any = None
    metrics: dict = field(default_factory=dict)
    source: str = ""  # the recording it came from (file name without .jsonl; its path where two share a name)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def reply(self) -> Reply | None:
        """The recorded answer, to force on replay (None: none recorded, the model generates)."""
        try:
            return reply_from_response(self.path, self.response)
        except (AttributeError, TypeError, KeyError) as exc:
            raise ValueError(f"recorded request {self.index + 1} ({self.path}): its response is not in the "
                             f"API's shape ({exc!r})") from None


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.iterdir() if f.name.endswith((".jsonl", ".jsonl.gz")))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such recording (give .jsonl / .jsonl.gz files or a directory)")
    if not out:
        raise ValueError("no recordings found: give .jsonl / .jsonl.gz files or a directory holding them")
    return out


def load(paths: Iterable[str | Path]) -> list[Entry]:
    """All API requests of the given recordings, merged in recorded order. A recording is named by its file name
    (by its path where two share one); a session key two recordings both hold (every mini-swe-agent recording has
    an "anon-1") is told apart by the recording's name before it."""
    files = _files(paths)
    stems = [path.name.split(".jsonl")[0] for path in files]
    sources = [stem if stems.count(stem) == 1 else str(path) for stem, path in zip(stems, files)]
    raw: list[tuple[float, int, int, dict, str]] = []
    for file_no, (path, source) in enumerate(zip(files, sources)):
        raw += [(float(obj.get("ts") or 0.0), file_no, line_no, obj, source) for line_no, obj in _lines(path)]
    raw.sort(key=lambda r: (r[0], r[1], r[2]))
    kept = []
    for obj, source in ((r[3], r[4]) for r in raw):
        if obj["method"].upper() != "POST" or obj["path"].split("?")[0] not in API_PATHS:
            continue
        if not isinstance(obj["body"], dict):
            log.warning("skipped a recorded %s whose body is not a JSON object", obj["path"])
            continue
        metrics = obj.get("metrics") if isinstance(obj.get("metrics"), dict) else {}
        kept.append((obj, metrics, source, str(metrics.get("session") or source)))
    holders: dict[str, set[str]] = {}
    for _, _, source, session in kept:
        holders.setdefault(session, set()).add(source)
    return [Entry(i, session if len(holders[session]) == 1 else f"{source}:{session}", obj.get("ts"), "POST",
                  obj["path"], dict(obj.get("headers") or {}), dict(obj["body"]), obj.get("response"), metrics,
                  source)
            for i, (obj, metrics, source, session) in enumerate(kept)]


def no_requests(what: str) -> ValueError:
    """The error for recordings that hold no API request: `what` names them and says "hold(s)"."""
    return ValueError(f"{what} no API requests (POST {', '.join(API_PATHS)})")


def first_turns(entries: list[Entry], n: int) -> list[Entry]:
    """The first n requests of each session, in the recorded order (indexes renumbered)."""
    seen: dict[str, int] = {}
    kept = []
    for e in entries:
        seen[e.session] = seen.get(e.session, 0) + 1
        if seen[e.session] <= n:
            kept.append(replace(e, index=len(kept)))
    return kept


def conversation(entry: Entry):
    """The Conversation the API front-end parses this request into, before normalisation (a recording carries
    whole histories: no previous_response_id to look up)."""
    api = entry.path.split("?")[0]
    if api == "/v1/messages":
        from proxy.apis.anthropic.schema import MessagesRequest, to_conversation

        return to_conversation(MessagesRequest.model_validate(entry.body))
    if api == "/v1/chat/completions":
        from proxy.apis.chat.schema import ChatRequest, to_conversation

        return to_conversation(ChatRequest.model_validate(entry.body))
    from proxy.apis.responses.schema import ResponsesRequest, to_conversation

    return to_conversation(ResponsesRequest.model_validate(entry.body), ())


_TYPES = {"method": str, "path": str, "headers": dict, "ts": (int, float), "metrics": dict}


def _lines(path: Path):
    """(line number, request object) of one file; what cannot be read is one ValueError naming the file. A line
    cut off (no newline after it, or a newline a later write added: a crash mid-write) that is not JSON is left
    out with a warning."""
    try:
        with _open(path) as fh:
            lines = list(fh)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:  # not gzip, truncated, not UTF-8
        raise ValueError(f"{path}: cannot read this recording ({exc})") from None
    for line_no, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{line_no + 1}"
        try:
            yield line_no, _request(line, where)
        except ValueError as exc:
            if not str(exc).startswith(f"{where}: not JSON") or not _cut_off(line):
                raise
            log.warning("%s: a line cut off mid-write, left out", where)


def _cut_off(line: str) -> bool:
    """A recorded line that stops before its object closes: JSON that a complete object would extend."""
    try:
        json.loads(line)
    except json.JSONDecodeError as exc:  # a string running to the end, or the text ending where more must follow
        return exc.msg.startswith("Unterminated string") or exc.pos >= len(line.rstrip()) - 1
    return False


def _request(line: str, where: str) -> dict:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict) or not {"method", "path", "body"} <= obj.keys():
        raise ValueError(f"{where}: a line needs method, path, headers and body")
    for key, kind in _TYPES.items():
        if obj.get(key) is not None and (not isinstance(obj[key], kind) or isinstance(obj[key], bool)):
            raise ValueError(f"{where}: {key} must be a {getattr(kind, '__name__', 'number')}, "
                             f"got {type(obj[key]).__name__}")
    return obj


def request_headers(entry: Entry) -> dict:
    return {k: str(v) for k, v in entry.headers.items() if k.lower() not in DROP_HEADERS}


def request_body(entry: Entry, unforced_max_tokens: int, stream: bool = False) -> dict:
    """The recorded body; chat streams ask for usage; unforced requests are capped (random weights ramble).
    stream=True sends a non-streaming request as a stream (same prompt, same answer) to time its first delta."""
    body = dict(entry.body)
    api = entry.path.split("?")[0]
    if stream:
        body["stream"] = True
    if api == "/v1/chat/completions" and body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if entry.reply() is None:
        key = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens"}.get(api)
        key = key or ("max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")
        body[key] = min(int(body.get(key) or unforced_max_tokens), unforced_max_tokens)
    return body


def reply_from_response(path: str, response: Any) -> Reply | None:
    """The assistant message of a recorded response, in any of the three APIs' final shapes."""
    if not isinstance(response, dict):
        return None
    api = path.split("?")[0]
    if api == "/v1/messages" and isinstance(response.get("content"), list):
        return _from_anthropic(response["content"])
    if api == "/v1/chat/completions" and response.get("choices"):
        return _from_chat(response["choices"][0].get("message") or {})
    if api == "/v1/responses" and isinstance(response.get("output"), list):
        return _from_responses(response["output"])
    return None


def _from_anthropic(blocks: list) -> Reply:
    thinking = "".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking")
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
    calls = [{"name": b["name"], "arguments": b.get("input") or {}} for b in blocks if b.get("type") == "tool_use"]
    return Reply.from_json({"thinking": thinking, "text": text, "tool_calls": calls})


def _from_chat(message: dict) -> Reply:
    calls = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments") or "{}"}
             for c in message.get("tool_calls") or ()]
    return Reply.from_json({"thinking": message.get("reasoning_content") or "", "text": message.get("content") or "",
                            "tool_calls": calls})


def _from_responses(items: list) -> Reply:
    """A namespaced call is replayed under the name the model was offered it (tools.py)."""
    thinking, text, calls = [], [], []
    for item in items:
        kind = item.get("type")
        if kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            thinking += [p.get("text", "") for p in parts[:1]]
        elif kind == "message":
            text += [c.get("text", "") for c in item.get("content") or () if "text" in c]
        elif kind == "function_call":
            calls.append({"name": flat_name(item.get("namespace"), item["name"]),
                          "arguments": item.get("arguments") or "{}"})
        elif kind == "custom_tool_call":
            calls.append({"name": flat_name(item.get("namespace"), item["name"]),
                          "arguments": {"input": item.get("input", "")}})
    return Reply.from_json({"thinking": "".join(thinking), "text": "".join(text), "tool_calls": calls})
