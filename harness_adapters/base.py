"""What every harness adapter is: detection, normalisation extras, side-request kinds, truncation rules.

Truncation rules are data (pydantic, since users write them in config files): they say where a harness
will cut its history on later turns, so the anchor planner can keep a checkpoint just before each cut and
the diff can name the edit. Torch-free and aiohttp-free: headers are any str -> str mapping.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Mapping, Optional, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.conversation import Conversation


class _Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StripThinkingExceptLatestN(_Rule):
    """Reasoning blocks of all but the latest n assistant messages are dropped on later turns."""

    kind: Literal["strip_thinking_except_latest_n"] = "strip_thinking_except_latest_n"
    n: int = Field(1, ge=0)


class ElideToolOutputsBeyondN(_Rule):
    """Tool outputs older than the latest n are replaced by `placeholder` (OpenCode's prune)."""

    kind: Literal["elide_tool_outputs_beyond_n"] = "elide_tool_outputs_beyond_n"
    n: int = Field(ge=0)
    placeholder: str = Field(min_length=1)


class ElideObservationsExceptLastN(_Rule):
    """Observation messages (user or tool) but the last n are shortened (SWE-agent history processors)."""

    kind: Literal["elide_observations_except_last_n"] = "elide_observations_except_last_n"
    n: int = Field(ge=0)
    placeholder: str = ""  # the start of the shortened text, when known


class ReplaceTrailingMessage(_Rule):
    """The request's last message carries `marker` and the next request replaces it (OpenClaw)."""

    kind: Literal["replace_trailing_message"] = "replace_trailing_message"
    marker: str = Field(min_length=1)


class Compaction(_Rule):
    """The harness summarises and restarts its history.

    request_markers: text in the summary request's system prompt or last user message (a side request of
        its own, which must not overwrite the main conversation's state).
    history_markers: text in the rebuilt history (its first user message carries the summary).
    """

    kind: Literal["compaction"] = "compaction"
    request_markers: tuple[str, ...] = ()
    history_markers: tuple[str, ...] = ()


class VolatileText(_Rule):
    """Text a later turn rewrites in place, e.g. the environment lines of a system prompt (the model name
    Claude Code writes changes with /model, the 1M-context switch and compaction). Every match of
    `pattern` (a Python regex) in the rendered prompt is a future cut at the start of each of its groups,
    or of the match when it has none: the checkpoint goes on the last token boundary at or before it."""

    kind: Literal["volatile_text"] = "volatile_text"
    pattern: str = Field(min_length=1)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"pattern is not a valid regular expression: {exc}") from None
        return value


# The model line Claude Code and OpenCode write into their system prompts; it changes when the user switches
# model mid-session (the name: group 1) and, for Claude Code, with the 1M-context switch: "Opus 4.8 (1M
# context). The exact model ID is claude-opus-4-8[1m]." vs "Opus 4.8. The exact ..." (group 2).
MODEL_LINE = VolatileText(pattern=r"You are powered by the model(?: named)? (\S)[^\n]*?( \(|\. )")

Rule = Annotated[
    Union[StripThinkingExceptLatestN, ElideToolOutputsBeyondN, ElideObservationsExceptLastN,
          ReplaceTrailingMessage, Compaction, VolatileText],
    Field(discriminator="kind"),
]


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
        for rule in self.rules:
            if isinstance(rule, Compaction) and any(m in where for m in rule.request_markers):
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
        return any(marker in first for rule in self.rules if isinstance(rule, Compaction)
                   for marker in rule.history_markers)

    def _short(self, conv: Conversation) -> bool:
        talk = [m for m in conv.messages if m.role != "system"]
        return len(talk) <= 2 and sum(len(m.text) for m in talk) <= self.title_max_chars
