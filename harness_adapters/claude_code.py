"""Claude Code (2.x): Anthropic Messages, `claude-cli/…` User-Agent, billing line as first system block.

Traffic facts (DESIGN.md): cache_control moves every turn (dropped by parsing), thinking blocks are re-sent,
`metadata.user_id` carries the session id, `/compact` sends a summary request then starts a new history
whose first user message carries the summary, and a tool-less title side request.
"""
from __future__ import annotations

from dataclasses import replace

from harness_adapters.base import BaseAdapter, Compaction
from proxy.conversation import Conversation, Message, TextPart
from proxy.normalize import BILLING_LINE, is_billing_line


class ClaudeCodeAdapter(BaseAdapter):
    name = "claude_code"
    user_agent_contains = ("claude-cli/",)
    system_contains = ("x-anthropic-billing-header:", "You are Claude Code")
    title_without_tools = True
    rules = (
        Compaction(
            request_markers=("Your task is to create a detailed summary of the",),  # full and partial compact
            history_markers=("This session is being continued from a previous conversation",),
        ),
    )

    def normalize(self, conv: Conversation) -> Conversation:
        """Billing lines in any system block (the base normaliser only looks at the first one). Only the line
        goes: the Anthropic front-end joins the system blocks into one text, the prompt itself follows it."""
        def clean(msg: Message) -> Message:
            if msg.role != "system":
                return msg
            parts = tuple(_without_billing(p) for p in msg.parts)
            parts = tuple(p for p in parts if not (isinstance(p, TextPart) and not p.text))
            return msg if parts == msg.parts else Message("system", parts)

        msgs = tuple(clean(m) for m in conv.messages)
        return replace(conv, messages=tuple(m for m in msgs if m.parts))


def _without_billing(part):
    if not isinstance(part, TextPart) or not is_billing_line(part.text):
        return part
    return TextPart(BILLING_LINE.sub("", part.text, count=1))
