"""Claude Code (2.x): Anthropic Messages, `claude-cli/…` User-Agent, billing line as first system block.

Traffic facts (recorded in fixtures/sessions/claude.jsonl.gz): cache_control moves every turn (dropped by
parsing), thinking blocks are re-sent, `metadata.user_id` carries the session id, `/compact` sends a summary
request then starts a new history whose first user message carries the summary, and a tool-less title side
request. The system prompt's environment block names the model, and that line changes within a session
(see MODEL_LINE) and between `--continue` runs with another `--model` (MODEL_NAME: the stable layout names
the served model instead).
"""
from __future__ import annotations

import json
from dataclasses import replace

from harness_adapters.base import BaseAdapter
from harness_adapters.normalize import BILLING_LINE, is_billing_line
from harness_adapters.rules import MODEL_LINE, MODEL_NAME, Compaction, ModelName, VolatileText
from proxy.conversation import Conversation, Message, TextPart, ToolCallPart, canonical_json


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
        MODEL_LINE,  # recorded 2.1.197: "Opus 4.8 (1M context)" in the main turns, "Opus 4.8" after /compact
        MODEL_NAME,
        # the Bash tool's commit trailer names the model too; this is Claude Code's own form for a model it does
        # not know (recorded 2.1.197 with --model killick-other)
        ModelName(pattern=r"Co-Authored-By: Claude [^<\n]*<", replacement="Co-Authored-By: Claude <"),
        # the memory section's first line names a folder per working directory (the rest of the section, ~500
        # tokens of instructions, stays shared); the environment section (working directory, git repo or not,
        # platform, the model line and its knowledge cutoff) moves after the tools as a whole
        VolatileText(pattern=r"You have a persistent file-based memory at `(\S)"),
        VolatileText(pattern=r"# Environment\n[^\n]*\n - Primary working directory: (\S)[^\n]*(?:\n - [^\n]*)*"),
        # taken when the conversation starts, `--continue` takes a new one in its new process: the snapshot is the
        # block's own sections (branch, main branch, status, recent commits), whatever may follow it
        VolatileText(pattern=r"\ngitStatus: [^\n]*(?:\n\n(?:Current branch|Main branch|Status:|Recent commits:)"
                             r"[^\n]*(?:\n[^\n]+)*)*", moves="to_end", snapshot=True),
        # the Bash tool's description names the model too ("Co-Authored-By: Claude Opus 4.8 (1M context)"): it
        # stays in the tool definitions, but a model switch cuts there (recorded 2.1.197, after /compact)
        VolatileText(pattern=r"Co-Authored-By: Claude (\S)[^<\n]*?( \(| <)", moves="none"),
    )

    def normalize(self, conv: Conversation) -> Conversation:
        """Billing lines in any system block (the base normaliser only looks at the first one; only the line
        goes: the Anthropic front-end joins the system blocks into one text, the prompt follows it), and
        tool-call arguments Claude Code filled in with their schema defaults when it re-sent the history."""
        defaults = _schema_defaults(conv)

        def clean(msg: Message) -> Message:
            if msg.role == "assistant" and defaults:
                parts = tuple(_without_defaults(p, defaults) for p in msg.parts)
                return msg if parts == msg.parts else Message("assistant", parts)
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


def _schema_defaults(conv: Conversation) -> dict[str, dict]:
    """tool name -> {argument: declared default} (Edit: replace_all false, recorded 2.1.197)."""
    out = {}
    for tool in conv.tools:
        props = tool.parameters.get("properties") or {}
        found = {k: v["default"] for k, v in props.items() if isinstance(v, dict) and "default" in v}
        if found:
            out[tool.name] = found
    return out


def _without_defaults(part, defaults: dict[str, dict]):
    """The model wrote `Edit{file_path, old_string, new_string}`; Claude Code re-sends it with
    `"replace_all": false` added. Dropping arguments equal to their declared default restores the model's
    form, so the re-sent reply matches the generated tokens (an append, not reply_rerendered)."""
    if not isinstance(part, ToolCallPart) or part.name not in defaults:
        return part
    args = json.loads(part.arguments)
    if not isinstance(args, dict):
        return part
    kept = {k: v for k, v in args.items() if not (k in defaults[part.name] and defaults[part.name][k] == v)}
    return part if kept == args else replace(part, arguments=canonical_json(kept))
