"""Codex CLI: OpenAI Responses SSE, `codex_…` User-Agent / originator, `session-id` + `prompt_cache_key`.

Append-only including reasoning items; client_metadata changes every request (never parsed into the
prompt). Compaction asks for a handoff summary, then rebuilds history with a summary prefix.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from harness_adapters.base import BaseAdapter, header
from harness_adapters.rules import Compaction, VolatileText
from proxy.conversation import Conversation


class CodexAdapter(BaseAdapter):
    name = "codex"
    user_agent_contains = ("codex_", "codex-cli", "codex/")
    system_contains = ("You are Codex", "running in the Codex CLI")
    rules = (
        Compaction(
            request_markers=("You are performing a CONTEXT CHECKPOINT COMPACTION",),
            history_markers=("Another language model started to solve this problem",),
        ),
        VolatileText(pattern=r"<current_date>(\S)"),  # <environment_context>, re-sent when it changes
    )

    def detect(self, request: Mapping[str, Any], headers: Mapping[str, str],
               conv: Optional[Conversation] = None) -> bool:
        return super().detect(request, headers, conv) or (header(headers, "originator") or "").startswith("codex")
