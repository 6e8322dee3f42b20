"""OpenClaw: OpenAI chat SSE; every request ends with an internal-context user message the next one replaces.

Tool-call ids are rewritten between requests (ids never reach the prompt, so nothing to do for them).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from harness_adapters.base import BaseAdapter
from harness_adapters.rules import ModelName, ReplaceTrailingMessage, VolatileText
from proxy.conversation import Conversation

INTERNAL_CONTEXT_MARKER = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"


class OpenClawAdapter(BaseAdapter):
    name = "openclaw"
    user_agent_contains = ("openclaw",)
    system_contains = ("OpenClaw",)
    rules = (ReplaceTrailingMessage(marker=INTERNAL_CONTEXT_MARKER),
             VolatileText(pattern=r"\nCurrent date: (\S)"),  # the system prompt's "Temporal Context"
             # OpenClaw marks the rest of its system prompt dynamic (date, runtime, model identity)
             VolatileText(pattern=r"<!-- openclaw:attempt:DYNAMIC -->", moves="to_end"),
             # "Current model identity: killick/demo-qwen3_5_moe-v1. If asked what model you are, answer ..."
             ModelName(pattern=r"(?<=Current model identity: )[^\s]+?(?=\.?\s)", replacement="{model}"))

    def detect(self, request: Mapping[str, Any], headers: Mapping[str, str],
               conv: Optional[Conversation] = None) -> bool:
        if super().detect(request, headers, conv):
            return True
        if conv is not None and conv.messages and INTERNAL_CONTEXT_MARKER in conv.messages[-1].text:
            return True
        messages = request.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        content = last.get("content") if isinstance(last, dict) else None
        return INTERNAL_CONTEXT_MARKER in str(content or "")
