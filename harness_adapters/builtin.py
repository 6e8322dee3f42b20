"""The built-in adapters, in detection order (generic, which always matches, is kept apart)."""
from __future__ import annotations

from harness_adapters.claude_code import ClaudeCodeAdapter
from harness_adapters.codex import CodexAdapter
from harness_adapters.openclaw import OpenClawAdapter
from harness_adapters.opencode import OpenCodeAdapter
from harness_adapters.swe_agent import SweAgentAdapter


def builtin_adapters() -> list:
    """Distinctive User-Agents first; OpenClaw before swe_agent (both may come through generic clients)."""
    return [ClaudeCodeAdapter(), CodexAdapter(), OpenCodeAdapter(), OpenClawAdapter(), SweAgentAdapter()]
