"""Anthropic Messages requests: pydantic at the edge, then into a Conversation.

Unknown fields (context_management, output_config, cache_control, citations...) are ignored. Images and
documents are not understood by the text-only models killick serves: they become a short text placeholder
and the server logs a warning (an agent session survives a pasted screenshot; the model is told).
"""
from __future__ import annotations

import logging
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.api import SamplingParams
from proxy.conversation import (
    Conversation, Message, Part, TextPart, ThinkingPart, ToolCallPart, ToolResultPart, ToolSpec, canonical_json,
)
from proxy.errors import ASK_FOR_JSON, ASK_FOR_TOOL, ApiError, not_enforceable
from proxy.generation import GenParams

log = logging.getLogger("killick.proxy")
MIN_THINKING_BUDGET = 1024  # Anthropic's least thinking.budget_tokens
MEDIA_KINDS = {"image": "image", "image_url": "image", "input_image": "image", "document": "document",
               "file": "file", "input_file": "file", "input_audio": "audio"}  # a part's type -> what it holds


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ImageBlock(_Model):
    type: Literal["image"]


class TextSource(_Model):
    type: Literal["text"]
    data: str


class DocumentBlock(_Model):
    type: Literal["document"]
    source: Union[TextSource, dict, None] = None  # a PDF's or a file's source is left unread


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


ResultContent = Annotated[Union[TextBlock, ImageBlock, DocumentBlock], Field(discriminator="type")]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[ResultContent], None] = None
    is_error: bool = False


Block = Annotated[
    Union[TextBlock, ImageBlock, DocumentBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock],
    Field(discriminator="type"),
]


class AnthropicMessage(_Model):
    role: Literal["user", "assistant", "system"]  # Claude Code sends role "system" inside messages
    content: Union[str, list[Block]]


class Tool(_Model):
    name: str = Field(min_length=1)
    description: str = ""
    input_schema: Optional[dict] = None
    type: Optional[str] = None  # server tools ("web_search_2025...") have a type and no schema: skipped


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class CountTokensRequest(_Model):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    metadata: Optional[dict] = None
    output_format: Optional[dict] = None
    output_config: Optional[dict] = None  # Claude Code sends {"effort": ...}: accepted, nothing to do


def check_supported(req: MessagesRequest) -> None:
    if req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        raise not_enforceable("tool_choice", f"tool_choice {req.tool_choice.type!r} (forcing a tool call)",
                              ASK_FOR_TOOL)
    fmt = req.output_format or (req.output_config or {}).get("format")
    if fmt:
        where = "output_format" if req.output_format else "output_config.format"
        raise not_enforceable(where, "structured output (JSON schema)", ASK_FOR_JSON)


def to_conversation(req: CountTokensRequest) -> Conversation:
    check_thinking(req)
    messages: list[Message] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n\n".join(b.text for b in req.system)
        messages.append(Message("system", (TextPart(system),)))
    for msg in req.messages:
        messages += _convert_message(msg)
    tools = tuple(ToolSpec(t.name, t.description, canonical_json(t.input_schema or {"type": "object"}))
                  for t in req.tools or () if t.input_schema is not None or t.type in (None, "custom"))
    thinking_on = req.thinking is None or req.thinking.type != "disabled"
    user_id = (getattr(req, "metadata", None) or {}).get("user_id")
    extras = {"session_hint": user_id} if isinstance(user_id, str) else {}
    prefill = _prefill(req, messages)
    return Conversation(tuple(messages), tools, enable_thinking=thinking_on and not prefill, extras=extras,
                        continue_last=prefill)


def check_thinking(req: CountTokensRequest) -> None:
    """Anthropic's rules for `thinking`: type enabled takes budget_tokens, at least 1024 and, in a Messages request,
    less than max_tokens, which the thinking shares with the answer; disabled and adaptive take none."""
    thinking, where = req.thinking, "thinking.budget_tokens"
    if thinking is None:
        return
    budget = thinking.budget_tokens
    if thinking.type != "enabled":
        if budget is not None:
            raise ApiError(400, f"{where}: thinking of type {thinking.type!r} takes no budget; send it with type "
                           "'enabled'", param=where)
        return
    if budget is None:
        raise ApiError(400, f"{where}: field required with thinking type 'enabled'", param=where)
    if budget < MIN_THINKING_BUDGET:
        raise ApiError(400, f"{where}: must be at least {MIN_THINKING_BUDGET}, got {budget}", param=where)
    max_tokens = getattr(req, "max_tokens", None)
    if max_tokens is not None and budget >= max_tokens:
        raise ApiError(400, f"{where}: must be less than max_tokens ({budget} >= {max_tokens}): the thinking and the "
                       "answer share max_tokens", param=where)


def _prefill(req: CountTokensRequest, messages: list[Message]) -> bool:
    """A last message of the assistant's is text the answer goes on from (its continuation alone comes back),
    as Anthropic's API does; like it, refused with thinking enabled or with trailing whitespace, and it holds
    text alone."""
    if not messages or messages[-1].role != "assistant" or len(messages) < 2:
        return False
    last, where = messages[-1], f"messages.{len(req.messages) - 1}.content"
    if req.thinking is not None and req.thinking.type == "enabled":
        raise ApiError(400, "an assistant message at the end (a prefill) cannot be combined with thinking: "
                       "end with a user message, or turn thinking off", param="messages")
    if any(not isinstance(p, TextPart) for p in last.parts) or not last.text:
        raise ApiError(400, "the final assistant message (a prefill) may hold text alone: end with a user message "
                       "to send tool results or thinking", param=where)
    if last.text != last.text.rstrip():
        raise ApiError(400, "final assistant content cannot end with trailing whitespace", param=where)
    return True


def gen_params(req: MessagesRequest) -> GenParams:
    sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0)
    choice = req.tool_choice
    parse_tools = bool(req.tools) and not (choice and choice.type == "none")
    one_call = 1 if choice and choice.disable_parallel_tool_use else None
    budget = req.thinking.budget_tokens if req.thinking and req.thinking.type == "enabled" else None
    return GenParams(req.max_tokens, sampling, tuple(req.stop_sequences or ()), parse_tools, one_call, budget)


def _convert_message(msg: AnthropicMessage) -> list[Message]:
    """One Anthropic message; a user turn's tool_result blocks become separate 'tool' messages, in order."""
    if isinstance(msg.content, str):
        return [Message(msg.role, (TextPart(msg.content),))]
    out: list[Message] = []
    run: list[Part] = []
    for block in msg.content:
        if isinstance(block, ToolResultBlock):
            if run:
                out.append(Message(msg.role, tuple(run)))
                run = []
            out.append(Message("tool", (_tool_result(block),)))
        elif (part := _convert_block(block)) is not None:
            run.append(part)
    if run or not out:
        out.append(Message(msg.role, tuple(run)))
    return out


def _convert_block(block) -> Part | None:
    if isinstance(block, TextBlock):
        return TextPart(block.text)
    if isinstance(block, ThinkingBlock):  # an empty one (a keep-alive opened it, then the model thought nothing)
        return ThinkingPart(block.thinking) if block.thinking else None  # is no thinking: the prompt stays the same
    if isinstance(block, ToolUseBlock):
        return ToolCallPart(block.name, canonical_json(block.input), block.id)
    if isinstance(block, RedactedThinkingBlock):
        return None  # encrypted by another provider: nothing a local model can read
    return TextPart(_media_text(block))


def _tool_result(block: ToolResultBlock) -> ToolResultPart:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        text = "\n".join(b.text if isinstance(b, TextBlock) else _media_text(b) for b in block.content)
    return ToolResultPart(text, block.tool_use_id, block.is_error)


def _media_text(block) -> str:
    """A plain-text document's own text; an image or any other document a placeholder."""
    if isinstance(block, DocumentBlock) and isinstance(block.source, TextSource):
        return block.source.data
    return omitted(block.type)


def omitted(part_type: str) -> str:
    """The text an image, document, file or audio part of any API becomes, naming what the model misses."""
    kind = MEDIA_KINDS.get(part_type, "attachment")
    log.warning("a %s part (%s) was replaced by a text placeholder: the model reads text only", part_type, kind)
    return f"[{kind} omitted: this model reads text only]"
