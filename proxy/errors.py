"""Errors are part of the API: every endpoint answers in its own API's error shape with the right status.

Anthropic: {"type": "error", "error": {"type": ..., "message": ...}}
OpenAI:    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
The flavour is chosen by route (/v1/messages* is Anthropic, everything else OpenAI-shaped).
"""
from __future__ import annotations

import logging

import pydantic
from aiohttp import web

log = logging.getLogger("killick.proxy")
STREAM_STARTED = web.RequestKey("killick_stream_started", bool)  # set once SSE headers are sent
CLIENT_CLOSED = 499  # nginx's status for a request the client gave up on
RETRY_MAY_HELP = (408, 409, 429)  # a body that stopped arriving, a conflict, a full queue: the same request may pass

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request the server refuses; `param` names the offending field (dotted path) where there is one;
    `headers` go out with the answer (Retry-After on a 429)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


ASK_FOR_TOOL = "let the model choose (tool_choice auto) and ask for the tool in the prompt"
ASK_FOR_JSON = "ask for JSON in the prompt and parse the text"


def not_enforceable(param: str, what: str, instead: str) -> ApiError:
    """A 400 for a request that asks for output the engine cannot guarantee: killick has no constrained
    decoding, and answering as if it had would hand the agent output that breaks the promise."""
    return ApiError(400, f"{param}: {what} is not supported (killick has no constrained decoding); {instead}",
                    param=param, code="unsupported_parameter")


def not_served(param: str, what: str, instead: str = "") -> ApiError:
    """A 400 for a feature killick does not serve where ignoring it would change what the answer means."""
    return ApiError(400, f"{param}: {what} is not supported by killick" + (f"; {instead}" if instead else ""),
                    param=param, code="unsupported_parameter")


def anthropic_body(err: ApiError) -> dict:
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def openai_body(err: ApiError) -> dict:
    kind = _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, err: ApiError) -> dict:
    return anthropic_body(err) if is_anthropic_path(path) else openai_body(err)


def error_response(path: str, err: ApiError) -> web.Response:
    """The error in the route's shape. A 4xx the same request would meet again says so, as Anthropic's API does
    (x-should-retry: false): the SDKs and Claude Code retry on it otherwise (a wrong key, for minutes)."""
    headers = dict(err.headers)
    if 400 <= err.status < 500 and err.status not in RETRY_MAY_HELP:
        headers["x-should-retry"] = "false"
    return web.json_response(error_body(path, err), status=err.status, headers=headers)


def from_validation(exc: pydantic.ValidationError) -> ApiError:
    """The first validation problem as a 400 that names the field, e.g. `messages.0.content: ...`. A field that
    may be a string or a list of blocks fails in each branch: of the first field's problems, the deepest says
    what is wrong (`messages.0.content.0.tool_result.tool_use_id: field required`, not that the list is not a
    string)."""
    errors = exc.errors(include_url=False)
    field = _field(errors[0])
    first = max((e for e in errors if _field(e)[:len(field)] == field), key=lambda e: len(e["loc"]))
    loc = ".".join(_field(first))
    what = first["msg"]
    if first["type"] == "missing":
        what = "field required"
    return ApiError(400, f"{loc}: {what}" if loc else what, param=loc or None)


_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-plain"}


def _field(error) -> list[str]:
    return [str(p) for p in error["loc"] if not _is_union_label(p)]


def _is_union_label(part) -> bool:
    """pydantic puts union member names ('str', 'list[...]', 'TextBlock') into error locations; drop them."""
    return isinstance(part, str) and (part in _TYPE_LABELS or "[" in part or part[:1].isupper())


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn every failure into the route's error shape; a bug answers 500 and the server keeps serving."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(request.path, err)
    except pydantic.ValidationError as exc:
        return error_response(request.path, from_validation(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(request.path, ApiError(413, f"request body too large: {exc.text}"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.status != 404 else f"no route for {request.method} {request.path}"
        return error_response(request.path, ApiError(exc.status, message))
    except ConnectionResetError:  # the client went away (a write found the connection closing)
        return web.Response(status=CLIENT_CLOSED, reason="Client Closed Request")  # goes nowhere, logs nothing
    except Exception:  # noqa: BLE001 - the server must keep serving
        if request.get(STREAM_STARTED):
            raise  # headers are out: aiohttp closes the connection, the agent sees a cut stream
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(request.path, ApiError(500, "internal server error (see the server log)"))
