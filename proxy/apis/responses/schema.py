"""OpenAI Responses requests: pydantic at the edge, then into a Conversation.

Input items: message (roles user / assistant / system / developer; `type` may be omitted), function_call,
function_call_output, custom_tool_call(+_output) (Codex's freeform tools), reasoning (text from content,
summary, or our own encrypted_content). Assistant-side items in a row (reasoning, message, calls) form one
assistant turn; a call's `namespace` names it as the model was offered it (tools.py). Tools: function, custom
and namespace (tools.py); other types (web_search, local_shell...) are ignored.
"""
from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from engine.api import SamplingParams
from proxy.apis.anthropic.schema import omitted
from proxy.apis.chat.schema import canonical_arguments
from proxy.apis.responses.tools import OfferedTool, flat_name, offered_tools
from proxy.conversation import (
    Conversation, Message, Part, TextPart, ThinkingPart, ToolCallPart, ToolResultPart, canonical_json,
)
from proxy.errors import ASK_FOR_JSON, ASK_FOR_TOOL, ApiError, not_enforceable, not_served
from proxy.generation import GenParams

ENCRYPTED_PREFIX = "killick:v1:"  # our reasoning round-trips through encrypted_content (store:false agents)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextContent(_Model):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"]
    text: str = ""
    refusal: str = ""


class MediaContent(_Model):
    type: Literal["input_image", "input_file", "input_audio"]


ContentPart = Annotated[Union[TextContent, MediaContent], Field(discriminator="type")]


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    namespace: Optional[str] = None
    arguments: str


class CustomToolCallItem(_Model):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    namespace: Optional[str] = None
    input: str


class CallOutputItem(_Model):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    summary: list[TextContent] = []
    content: Optional[list[TextContent]] = None
    encrypted_content: Optional[str] = None


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return "function_call_output" if kind == "custom_tool_call_output" else kind
    return None


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[CustomToolCallItem, Tag("custom_tool_call")],
          Annotated[CallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_tag),
]


class ResponsesTool(_Model):
    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict] = None
    tools: Optional[list[ResponsesTool]] = None  # a namespace's function / custom tools


class ReasoningConfig(_Model):
    effort: Optional[str] = None
    summary: Optional[str] = None


class ResponsesRequest(_Model):
    model: str
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning: Optional[ReasoningConfig] = None
    include: Optional[list[str]] = None
    prompt_cache_key: Optional[str] = None
    metadata: Optional[dict] = None
    text: Optional[dict] = None
    conversation: Union[str, dict, None] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0)
    truncation: Optional[Literal["auto", "disabled"]] = None  # None: disabled
    background: Optional[bool] = None


def check_supported(req: ResponsesRequest) -> None:
    if req.background and not req.store:
        raise ApiError(400, "background: a background response is read back with GET /v1/responses/{id}, so it "
                            "needs store: true", param="background")
    if req.conversation is not None:
        raise not_served("conversation", "the Conversations API",
                         "send the history in `input` or chain responses with previous_response_id")
    if req.top_logprobs:
        raise not_served("top_logprobs", "log probabilities")
    if "message.output_text.logprobs" in (req.include or ()):
        raise not_served("include", "log probabilities (message.output_text.logprobs)")
    choice = req.tool_choice
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") not in ("auto", "none")):
        raise not_enforceable("tool_choice", "forcing a tool call", ASK_FOR_TOOL)
    fmt = (req.text or {}).get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise not_enforceable("text.format", f"{fmt.get('type')!r} (JSON output)", ASK_FOR_JSON)


def input_messages(req: ResponsesRequest) -> tuple[Message, ...]:
    """The request's own input as messages (without instructions or the previous response)."""
    if isinstance(req.input, str):
        return (Message("user", (TextPart(req.input),)),)
    out: list[Message] = []
    turn: list[Part] = []  # the assistant turn being gathered
    for item in req.input:
        part = _assistant_part(item)
        if part is not None:
            turn.append(part)
            continue
        if turn:
            out.append(Message("assistant", tuple(turn)))
            turn = []
        if isinstance(item, MessageItem) and item.role != "assistant":
            role = "system" if item.role == "developer" else item.role
            out.append(Message(role, (TextPart(_text(item.content)),)))
        elif isinstance(item, CallOutputItem):
            out.append(Message("tool", (ToolResultPart(_text(item.output), item.call_id),)))
    if turn:
        out.append(Message("assistant", tuple(turn)))
    return tuple(out)


def _assistant_part(item) -> Part | None:
    if isinstance(item, MessageItem) and item.role == "assistant":
        return TextPart(_text(item.content))
    if isinstance(item, FunctionCallItem):
        return ToolCallPart(flat_name(item.namespace, item.name), canonical_arguments(item.arguments), item.call_id)
    if isinstance(item, CustomToolCallItem):
        return ToolCallPart(flat_name(item.namespace, item.name), canonical_json({"input": item.input}), item.call_id)
    if isinstance(item, ReasoningItem):
        return ThinkingPart(reasoning_text(item))
    return None


def reasoning_text(item: ReasoningItem) -> str:
    if item.content:
        return "".join(c.text for c in item.content)
    if item.encrypted_content and item.encrypted_content.startswith(ENCRYPTED_PREFIX):
        try:
            return base64.b64decode(item.encrypted_content[len(ENCRYPTED_PREFIX):], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            pass
    return "\n\n".join(s.text for s in item.summary)


def encrypt_reasoning(text: str) -> str:
    """Not encryption: an opaque-looking round trip so store:false agents hand our reasoning back."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode("utf-8")).decode("ascii")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, TextContent):
            texts.append(part.text or part.refusal)
        else:
            texts.append(omitted(part.type))
    return "\n".join(texts)


def to_conversation(req: ResponsesRequest, previous: tuple[Message, ...],
                    tools: dict[str, OfferedTool] | None = None) -> Conversation:
    system = (Message("system", (TextPart(req.instructions),)),) if req.instructions else ()
    messages = system + previous + tuple(input_messages(req))
    thinking_on = not (req.reasoning and req.reasoning.effort == "none")
    extras = {"session_hint": req.prompt_cache_key} if req.prompt_cache_key else {}
    specs = tuple(t.spec for t in (offered_tools(req.tools) if tools is None else tools).values())
    return Conversation(messages, specs, enable_thinking=thinking_on, extras=extras)


def gen_params(req: ResponsesRequest) -> GenParams:
    sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p)
    parse_tools = bool(req.tools) and req.tool_choice != "none"
    one_call = 1 if req.parallel_tool_calls is False else None
    return GenParams(req.max_output_tokens, sampling, (), parse_tools, one_call, truncate=req.truncation == "auto")
