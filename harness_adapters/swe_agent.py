"""mini-swe-agent and SWE-agent: OpenAI chat through litellm, non-streaming, usually one `bash` tool.

mini-swe-agent is append-only. SWE-agent's history processors (last_n_observations) shorten every
observation but the last n to an "Old environment output" line: an elision inside history.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from harness_adapters.base import BaseAdapter, ElideObservationsExceptLastN, header
from proxy.conversation import Conversation

OLD_OBSERVATION = "Old environment output:"


class SweAgentAdapter(BaseAdapter):
    name = "swe_agent"
    user_agent_contains = ("mini-swe-agent", "swe-agent")
    system_contains = ("interact multiple times with a computer shell", "SWE-agent")
    rules = (ElideObservationsExceptLastN(n=5, placeholder=OLD_OBSERVATION),)

    def detect(self, request: Mapping[str, Any], headers: Mapping[str, str],
               conv: Optional[Conversation] = None) -> bool:
        if super().detect(request, headers, conv):
            return True
        agent = (header(headers, "user-agent") or "").lower()
        only_bash = _only_bash_tool(request) or (conv is not None and [t.name for t in conv.tools] == ["bash"])
        return "litellm" in agent and only_bash


def _only_bash_tool(request: Mapping[str, Any]) -> bool:
    tools = request.get("tools")
    if not isinstance(tools, list) or len(tools) != 1 or not isinstance(tools[0], dict):
        return False
    fn = tools[0].get("function", tools[0])
    return isinstance(fn, dict) and fn.get("name") == "bash"
