"""OpenCode (1.x): OpenAI chat SSE, `opencode/…` User-Agent, `x-session-id` header.

Append-only and re-sends reasoning_content; with compaction.prune it replaces old tool outputs (beyond
~40k tokens of recent ones, so a count is only an estimate) by a fixed placeholder. Compaction is a separate
summariser request; the title request is a parallel tool-less one with a title-generator system prompt.
"""
from __future__ import annotations

from harness_adapters.base import BaseAdapter
from harness_adapters.rules import MODEL_LINE, MODEL_NAME, Compaction, ElideToolOutputsBeyondN, VolatileText

PRUNE_PLACEHOLDER = "[Old tool result content cleared]"


class OpenCodeAdapter(BaseAdapter):
    name = "opencode"
    user_agent_contains = ("opencode/",)
    system_contains = ("You are opencode", "You are OpenCode")
    title_markers = ("You are a title generator",)
    title_without_tools = True
    rules = (
        ElideToolOutputsBeyondN(n=4, placeholder=PRUNE_PLACEHOLDER),
        Compaction(request_markers=("You are a helpful AI assistant tasked with summarizing conversations",)),
        MODEL_LINE,  # /models switches model mid-session
        MODEL_NAME,  # "named demo. The exact model ID is killick/demo" (recorded 1.18.33): "the model demo."
        VolatileText(pattern=r"Today's date: (\S)"),  # in the system prompt's <env> block
        # the <env> block (working directory, git repo or not, platform, date) moves after the tools as a whole,
        # with the line that introduces it (anchored at a line's start: rules.py refuses a pattern that opens with
        # a run, which a long line of a tool's output would make quadratic)
        VolatileText(pattern=r"(?m)^[^\n]*\n<env>\n  Working directory: (\S)(?s:.*?)</env>"),
    )
