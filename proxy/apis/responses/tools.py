"""Responses tools: what the model is offered, and which API item a call to each name goes out as.

`function` and `custom` tools are offered under their own names (a custom tool as a function with one string
parameter `input`). A `namespace` (`{"type": "namespace", "name": N, "description": D, "tools": [...]}`: Codex's
sub-agent tools `multi_agent_v1`, MCP servers) offers each of its function / custom tools to the model as
`N__name`, the flat name Codex itself uses where a namespace cannot be kept apart (trailing `_` of N and leading
`_` of the name dropped, so `mcp__srv__` + `ls` is `mcp__srv__ls`), its description led by D. A call to that name
goes out as a function_call / custom_tool_call item with `namespace: N` and `name: name`, and such an item in a
later request's input renders back under the same flat name, so the turn's tokens do not change.

A flat name that a plain tool or an earlier namespaced one already has is not offered (warned about once); other
tool types, at the top or inside a namespace, are ignored with a warning once per server.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Optional, Protocol, Sequence

from proxy.conversation import ToolSpec, canonical_json
from proxy.errors import ApiError

log = logging.getLogger("killick.proxy")
CUSTOM_TOOL_SCHEMA = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
NAMESPACE_DELIMITER = "__"
SERVED = ("function", "custom")


class ToolEntry(Protocol):
    """A request's tool as the schema parsed it (schema.ResponsesTool)."""

    type: str
    name: Optional[str]
    description: Optional[str]
    parameters: Optional[dict]
    tools: Optional[list]


class OfferedTool(NamedTuple):
    spec: ToolSpec  # spec.name: the name the model sees and calls
    name: str  # the name in the API's call items
    namespace: Optional[str]
    custom: bool


def flat_name(namespace: Optional[str], name: str) -> str:
    """The name the model sees for `name` inside `namespace` (the name itself outside one)."""
    if not namespace:
        return name
    return namespace.rstrip("_") + NAMESPACE_DELIMITER + name.lstrip("_")


def offered_tools(tools: Optional[Sequence[ToolEntry]]) -> dict[str, OfferedTool]:
    """Every tool the model is offered, by the name it calls it, in the order the prompt lists them."""
    tools = tools or ()
    plain = {t.name for t in tools if t.type in SERVED and t.name}
    offered: dict[str, OfferedTool] = {}
    for i, t in enumerate(tools):
        if t.type == "namespace":
            for tool in _namespace_tools(i, t):
                if tool.spec.name in plain or tool.spec.name in offered:
                    _warn_once(f"tool {tool.spec.name!r} of namespace {tool.namespace!r} is not offered: another "
                               "tool already has that name")
                else:
                    offered[tool.spec.name] = tool
        elif t.type in SERVED and t.name:
            offered[t.name] = _offer(t, None, "")
        elif t.type not in SERVED:  # agents send the same tools every request: say it once per server
            _warn_once(f"tool type {t.type!r} is not served by killick: ignored")
    return offered


def _namespace_tools(index: int, ns: ToolEntry) -> list[OfferedTool]:
    where = f"tools[{index}]"
    if not ns.name:
        raise ApiError(400, f"{where}.name: a namespace tool needs a name (its tools are called by it)",
                       param=f"{where}.name")
    if ns.tools is None:
        raise ApiError(400, f"{where}.tools: a namespace tool needs its list of function / custom tools",
                       param=f"{where}.tools")
    out = []
    for t in ns.tools:
        if t.type in SERVED and t.name:
            out.append(_offer(t, ns.name, ns.description or ""))
        elif t.type not in SERVED:
            _warn_once(f"tool type {t.type!r} inside namespace {ns.name!r} is not served by killick: ignored")
    return out


def _offer(t: ToolEntry, namespace: Optional[str], lead: str) -> OfferedTool:
    custom = t.type == "custom"
    schema = CUSTOM_TOOL_SCHEMA if custom else t.parameters
    description = "\n\n".join(d for d in (lead.strip(), t.description or "") if d)
    spec = ToolSpec(flat_name(namespace, t.name), description, canonical_json(schema or {"type": "object"}))
    return OfferedTool(spec, t.name, namespace, custom)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s (said once)", message)
