"""What every harness adapter is: detection, normalisation extras, side-request kinds, truncation rules
(rules.py). Torch-free and aiohttp-free: headers are any str -> str mapping.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

from harness_adapters.rules import Compaction, rules_of
from proxy.conversation import Conversation


class Adapter(Protocol):
    name: str
    rules: tuple

    def detect(self, request: Mapping[str, Any], headers: Mapping[str, str],
               conv: Optional[Conversation] = None) -> bool: ...

    def normalize(self, conv: Conversation) -> Conversation: ...

    def side_request_kind(self, conv: Conversation) -> Optional[str]: ...

    def starts_from_summary(self, conv: Conversation) -> bool: ...


def header(headers: Mapping[str, str], name: str) -> Optional[str]:
    """Case-insensitive header lookup over any mapping (aiohttp's CIMultiDict or a plain dict)."""
    value = headers.get(name)
    if value is not None:
        return value
    low = name.lower()
    return next((v for k, v in headers.items() if k.lower() == low), None)


def _block_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


def request_system_text(request: Mapping[str, Any]) -> str:
    """System text of a raw request in any of the three APIs (Anthropic system, chat/Responses roles)."""
    texts = [_block_text(request.get("system")), _block_text(request.get("instructions"))]
    for item in list(request.get("messages") or []) + list(_as_list(request.get("input"))):
        if isinstance(item, dict) and item.get("role") in ("system", "developer"):
            texts.append(_block_text(item.get("content")))
    return "\n".join(t for t in texts if t)


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def conversation_text(conv: Conversation, roles: tuple[str, ...] = ("system",)) -> str:
    return "\n".join(m.text for m in conv.messages if m.role in roles)


class BaseAdapter:
    """Detection by User-Agent prefix, header presence or system-prompt signature; rules as data.

    Subclasses set the class attributes; `title_without_tools` says that this harness's main traffic
    always carries tools, so a tool-less request is a side request (short: title generation).
    """

    name = "base"
    rules: tuple = ()
    user_agent_contains: tuple[str, ...] = ()
    headers_present: tuple[str, ...] = ()
    system_contains: tuple[str, ...] = ()
    title_markers: tuple[str, ...] = ()
    title_without_tools = False
    title_max_chars = 4000

    def detect(self, request: Mapping[str, Any], headers: Mapping[str, str],
               conv: Optional[Conversation] = None) -> bool:
        """From the raw request, or from its parsed Conversation (`conv`) where the raw one is not at hand."""
        agent = (header(headers, "user-agent") or "").lower()
        if any(s.lower() in agent for s in self.user_agent_contains):
            return True
        if any(header(headers, h) is not None for h in self.headers_present):
            return True
        system = request_system_text(request) + ("\n" + conversation_text(conv) if conv is not None else "")
        return any(s in system for s in self.system_contains)

    def normalize(self, conv: Conversation) -> Conversation:
        return conv

    def side_request_kind(self, conv: Conversation) -> Optional[str]:
        """'compaction', 'title' or 'side' for a harness's side requests, None for the main conversation."""
        users = [m for m in conv.messages if m.role == "user"]
        last_user = users[-1].text if users else ""
        where = last_user + "\n" + conversation_text(conv)
        for rule in rules_of(self.rules, Compaction):
            if any(m in where for m in rule.request_markers):
                return "compaction"
        if any(m in conversation_text(conv) for m in self.title_markers):
            return "title"
        if self.title_without_tools and not conv.tools:  # e.g. Claude Code's topic / bash-prefix checks
            return "title" if self._short(conv) else "side"
        return None

    def starts_from_summary(self, conv: Conversation) -> bool:
        """Whether the history was rebuilt from a compaction summary (a Compaction rule's history marker in
        its first user message): it continues an earlier conversation rather than starting one."""
        first = next((m.text for m in conv.messages if m.role == "user"), "")
        return any(marker in first for rule in rules_of(self.rules, Compaction) for marker in rule.history_markers)

    def _short(self, conv: Conversation) -> bool:
        talk = [m for m in conv.messages if m.role != "system"]
        return len(talk) <= 2 and sum(len(m.text) for m in talk) <= self.title_max_chars
