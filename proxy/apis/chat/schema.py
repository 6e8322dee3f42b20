"""OpenAI Chat Completions requests: pydantic at the edge, then into a Conversation.

Accepts what real agents send: `developer` role (as system), `reasoning_content` (or `reasoning`) on
assistant messages, `max_completion_tokens`, content as string or parts, `chat_template_kwargs`
(enable_thinking) and `reasoning_effort: "none"` to switch thinking off. Images become a text placeholder.
`continue_final_message` (vLLM's and SGLang's) continues a final assistant message instead of answering it.
`frequency_penalty` / `presence_penalty` (OpenAI's range, -2..2) reach the engine's sampling.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.api import SamplingParams
from proxy.apis.anthropic.schema import omitted
from proxy.body import MAX_DEPTH, check_json
from proxy.conversation import (
    Conversation, Message, Part, TextPart, ThinkingPart, ToolCallPart, ToolResultPart, ToolSpec, canonical_json,
)
from proxy.errors import ASK_FOR_JSON, ASK_FOR_TOOL, ApiError, not_enforceable, not_served
from proxy.generation import GenParams


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextContent(_Model):
    type: Literal["text"]
    text: str


class ImageContent(_Model):
    type: Literal["image_url", "input_audio", "file"]


Content = Union[str, list[Annotated[Union[TextContent, ImageContent], Field(discriminator="type")]], None]


class FunctionCall(_Model):
    name: str
    arguments: str = ""


class ToolCallIn(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None


class FunctionDef(_Model):
    name: str = Field(min_length=1)
    description: str = ""
    parameters: Optional[dict] = None


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: dict


class StreamOptions(_Model):
    include_usage: bool = False


class ChatRequest(_Model):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    seed: Optional[int] = Field(default=None, ge=-2**63, lt=2**64)  # what a torch generator takes
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    stop: Union[str, list[str], None] = None
    n: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[ToolDef]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0)
    logit_bias: Optional[dict] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict] = None
    # vLLM's and SGLang's: the last message, the assistant's, left open for the answer to go on from
    continue_final_message: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    user: Optional[str] = None
    response_format: Optional[dict] = None


def check_supported(req: ChatRequest) -> None:
    if req.n is not None and req.n > 1:
        raise ApiError(400, "n: only n=1 is supported (one completion per request)", param="n")
    if req.logprobs:
        raise ApiError(400, "logprobs: log probabilities are not supported", param="logprobs")
    if req.top_logprobs:
        raise not_served("top_logprobs", "log probabilities")
    if req.logit_bias:
        raise not_served("logit_bias", "biasing tokens", "say what to avoid in the prompt")
    if req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice):
        raise not_enforceable("tool_choice", "forcing a tool call", ASK_FOR_TOOL)
    if (req.response_format or {}).get("type", "text") != "text":
        raise not_enforceable("response_format", f"{req.response_format.get('type')!r} (JSON output)", ASK_FOR_JSON)


def to_conversation(req: ChatRequest) -> Conversation:
    messages = tuple(_convert_message(m) for m in req.messages)
    tools = tuple(ToolSpec(t.function.name, t.function.description,
                           canonical_json(t.function.parameters or {"type": "object", "properties": {}}))
                  for t in req.tools or ())
    kwargs = req.chat_template_kwargs or {}
    thinking_on = kwargs.get("enable_thinking", True) is not False and req.reasoning_effort not in ("none",)
    extras = {"session_hint": req.user} if req.user else {}
    continues = _continues(req, messages)
    return Conversation(messages, tools, enable_thinking=thinking_on and not continues, extras=extras,
                        continue_last=continues)


def _continues(req: ChatRequest, messages: tuple[Message, ...]) -> bool:
    """continue_final_message (as vLLM and SGLang take it): the last message, the assistant's text or reasoning, is
    left open and the answer goes on from it (its continuation alone comes back), with no generation prompt after
    it; add_generation_prompt false goes with it and alone is not served."""
    if not req.continue_final_message:
        if req.add_generation_prompt is False:
            raise ApiError(400, "add_generation_prompt: false is served only with continue_final_message: true (a "
                           "final assistant message the answer goes on from)", param="add_generation_prompt")
        return False
    if req.add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true: leave "
                       "add_generation_prompt out or false", param="add_generation_prompt")
    last = messages[-1]
    if last.role != "assistant":
        raise ApiError(400, "continue_final_message: the last message must be the assistant's, which the answer "
                       "goes on from", param="messages")
    if any(isinstance(p, ToolCallPart) for p in last.parts):
        raise ApiError(400, "continue_final_message: the final assistant message may hold content and reasoning, "
                       "not tool calls", param=f"messages.{len(messages) - 1}.tool_calls")
    return True


def gen_params(req: ChatRequest) -> GenParams:
    sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p,
                              top_k=max(req.top_k or 0, 0), seed=req.seed,
                              frequency_penalty=req.frequency_penalty or 0.0,
                              presence_penalty=req.presence_penalty or 0.0)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    parse_tools = bool(req.tools) and req.tool_choice != "none"
    one_call = 1 if req.parallel_tool_calls is False else None
    return GenParams(req.max_completion_tokens or req.max_tokens, sampling, stop, parse_tools, one_call)


def content_text(content: Content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if isinstance(part, TextContent):
            texts.append(part.text)
        else:
            texts.append(omitted(part.type))
    return "\n".join(texts)


def _convert_message(msg: ChatMessage) -> Message:
    text = content_text(msg.content)
    if msg.role == "tool":
        return Message("tool", (ToolResultPart(text, msg.tool_call_id or ""),))
    if msg.role != "assistant":
        return Message("system" if msg.role == "developer" else msg.role, (TextPart(text),))
    parts: list[Part] = []
    reasoning = msg.reasoning_content or msg.reasoning
    if reasoning:
        parts.append(ThinkingPart(reasoning))
    if text:
        parts.append(TextPart(text))
    parts += [ToolCallPart(c.function.name, canonical_arguments(c.function.arguments), c.id)
              for c in msg.tool_calls or ()]
    return Message("assistant", tuple(parts))


def canonical_arguments(arguments: str) -> str:
    """Tool-call arguments as canonical JSON when they parse; as sent otherwise (the model wrote them).
    JSON nested deeper than a request may be, or holding a lone surrogate, is a 400."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:  # not JSON, or an integer of thousands of digits
        return arguments
    except RecursionError:
        raise ApiError(400, f"tool call arguments: JSON nested deeper than {MAX_DEPTH} levels") from None
    check_json(value, where="tool call arguments")
    return canonical_json(value)


def written_arguments(arguments: str) -> str:
    """canonical_arguments of arguments the model wrote (a response's tool call): what a request may not hold (JSON
    too deep, a lone surrogate) stays as written, since the model's output is never the client's error."""
    try:
        return canonical_arguments(arguments)
    except ApiError:
        return arguments
