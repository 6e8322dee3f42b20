"""The Response object: the fields fixed when it is created (head), then the state it ends in.

Statuses: queued and in_progress (a background response, while it runs), then completed, incomplete (the
output ran into max_output_tokens), failed (with `error`) or cancelled (a background response, usage null).
Usage carries `input_tokens_details.cached_tokens` and `output_tokens_details.reasoning_tokens`.
"""
from __future__ import annotations

import time
import uuid

from proxy.apis.responses.output import OutputItems
from proxy.apis.responses.schema import ResponsesRequest
from proxy.generation import Finished

TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                   "failed": "response.failed"}


def head(req: ResponsesRequest) -> dict:
    """The response object's fields that do not change while it is generated."""
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}", "object": "response", "created_at": int(time.time()),
        "model": req.model, "instructions": req.instructions, "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls is not False, "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "store": req.store,
        "reasoning": (req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None}),
        "text": {"format": {"type": "text"}}, "truncation": req.truncation or "disabled",
        "background": req.background is True, "metadata": req.metadata or {}, "error": None,
        "incomplete_details": None,
    }


def usage_json(fin: Finished) -> dict:
    u = fin.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.reused_tokens},
            "output_tokens": u.output_tokens, "output_tokens_details": {"reasoning_tokens": fin.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.output_tokens}


def pending(fixed: dict, status: str, out: OutputItems) -> dict:
    """A response still being generated: the output items finished so far, no usage yet."""
    return {**fixed, "status": status, "output": list(out.items), "usage": None}


def state_event(fixed: dict, status: str, out: OutputItems) -> tuple[str, dict]:
    """response.queued / response.in_progress with the response as it stands: sent as a response starts or is
    admitted, and again as its keep-alive (an event, not an SSE comment: Codex's stream idle timer counts events
    alone), in the foreground stream and a background job's alike."""
    return f"response.{status}", {"response": pending(fixed, status, out)}


def final(fixed: dict, out: OutputItems, fin: Finished) -> dict:
    status = {"length": "incomplete", "error": "failed"}.get(fin.finish, "completed")
    body = {**fixed, "status": status, "output": out.items, "usage": usage_json(fin)}
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    if status == "failed":
        body["error"] = {"code": "server_error", "message": fin.error or "engine error"}
    return body


def ended(fixed: dict, out: OutputItems, status: str, error: str | None = None) -> dict:
    """A background response that ended without the engine's Finished: cancelled, or failed by the server."""
    body = {**fixed, "status": status, "output": out.items, "usage": None}
    if error is not None:
        body["error"] = {"code": "server_error", "message": error}
    return body
