"""The normalised conversation every API front-end parses into, and the renderer and cache policy read.

Torch-free, frozen. Whatever an API calls things (Anthropic content blocks, OpenAI chat messages, Responses
input items), after parsing a request is a Conversation: the ids, cache markers and metadata the agent sent
are not part of it, so they can never change the rendered prompt.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal, Union

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ThinkingPart:
    """Model reasoning (Anthropic thinking, OpenAI reasoning_content, Responses reasoning summary)."""

    text: str


@dataclass(frozen=True)
class ToolCallPart:
    name: str
    arguments: str  # canonical JSON text (see canonical_json); the renderer re-emits it as-is
    call_id: str = ""  # ids are kept to pair results with calls; they are never rendered


@dataclass(frozen=True)
class ToolResultPart:
    content: str
    call_id: str = ""
    is_error: bool = False


Part = Union[TextPart, ThinkingPart, ToolCallPart, ToolResultPart]


@dataclass(frozen=True)
class Message:
    role: Role
    parts: tuple[Part, ...]

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters_json: str  # canonical JSON text of the JSON schema

    @property
    def parameters(self) -> dict:
        return json.loads(self.parameters_json)


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    # Whether the generation prompt opens a <think> block (thinking enabled) or closes it empty.
    enable_thinking: bool = True
    extras: dict = field(default_factory=dict, compare=False, hash=False)  # adapter notes, never rendered
    # System text that differs between conversations of one harness (working directory, date, git status,
    # model line), taken out of the first system message by the stable-first layout: the renderer writes it
    # at the end of the system turn, after the tool definitions, so everything before it is shared.
    volatile: str = ""
    # The last message is an assistant's text the model goes on writing (Anthropic's prefill): rendered open,
    # with no generation prompt after it.
    continue_last: bool = False


def canonical_json(value) -> str:
    """JSON with sorted keys and fixed separators: key order in the agent's request never changes tokens."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))
