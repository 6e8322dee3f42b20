"""mini-swe-agent and SWE-agent: OpenAI chat through litellm, non-streaming, usually one `bash` tool.

mini-swe-agent is append-only. SWE-agent's history processors (last_n_observations) shorten every
observation but the last n to an "Old environment output" line: an elision inside history.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from harness_adapters.base import BaseAdapter, header
from harness_adapters.rules import ElideObservationsExceptLastN
from proxy.conversation import Conversation

OLD_OBSERVATION = "Old environment output:"
TASK_MARKERS = ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "Please solve this issue")


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
        # mini-swe-agent 2.x through litellm sends the OpenAI SDK's `OpenAI/Python x.y` agent: its task
        # prompt is the signature (recorded in fixtures/sessions/mini-swe-agent.jsonl.gz)
        return only_bash and ("litellm" in agent or _task_signature(_first_user_text(request, conv)))


def _task_signature(text: str) -> bool:
    return any(marker in text for marker in TASK_MARKERS)


def _first_user_text(request: Mapping[str, Any], conv: Optional[Conversation]) -> str:
    if conv is not None:
        return next((m.text for m in conv.messages if m.role == "user"), "")
    for item in request.get("messages") or ():
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            return content if isinstance(content, str) else ""
    return ""


def _only_bash_tool(request: Mapping[str, Any]) -> bool:
    tools = request.get("tools")
    if not isinstance(tools, list) or len(tools) != 1 or not isinstance(tools[0], dict):
        return False
    fn = tools[0].get("function", tools[0])
    return isinstance(fn, dict) and fn.get("name") == "bash"
