"""Scripted agent sessions for the cache acceptance tests: one per edit kind, shaped like the harness's traffic.

A script maps turn k (0-based) to the request the harness would send: (path, headers, body). Each turn's
history holds the SCRIPTED assistant turns (what the harness parsed and re-sends), never the model's reply:
the tiny model's weights are random, so what it generates is garbage the agent would not have produced.
"""
from __future__ import annotations

import json

TURNS = 10
MAX_TOKENS = 3
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
TOOLS_C = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                             "parameters": SCHEMA}}]
OPENCLAW_MARKER = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
PRUNED = "[Old tool result content cleared]"
CC_USER = "user_4f2a_account__session_5f1c2e9a-7b3d-4c1e-9a0f-2d6b8e4c1a77"
STRIPPING_HARNESS = {"harnesses": [{"name": "lean-agent", "user_agent_contains": ["lean-agent/"], "rules": [
    {"kind": "strip_thinking_except_latest_n", "n": 1}]}]}


def listing(k: int) -> str:
    return "\n".join(f"src/pkg{k}/module_{j}.py  {100 + 7 * j} lines" for j in range(5))


def chat_call(k: int) -> dict:
    return {"id": f"call_{k}", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"cmd": f"ls src/pkg{k}"})}}


def chat_body(messages: list, **extra) -> dict:
    return {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def chat_tool_turns(k: int, reasoning=lambda j: f"I should look at pkg{j} next.", output=listing) -> list:
    """Assistant tool call + tool result for every earlier turn j < k."""
    out = []
    for j in range(k):
        msg = {"role": "assistant", "content": "", "tool_calls": [chat_call(j)]}
        if reasoning(j):
            msg["reasoning_content"] = reasoning(j)
        out += [msg, {"role": "tool", "tool_call_id": f"call_{j}", "content": output(j)}]
    return out


def mini_swe_agent(k: int):
    """mini-swe-agent: chat through litellm, no tools, append-only; actions in ```bash blocks."""
    msgs = [{"role": "system", "content": "You are a helpful assistant that can interact multiple times with a "
                                          "computer shell to solve programming tasks."},
            {"role": "user", "content": "Please solve this issue: the parser drops trailing commas."}]
    for j in range(k):
        msgs += [{"role": "assistant", "content": f"THOUGHT: inspect pkg{j}.\n\n```bash\nls src/pkg{j}\n```"},
                 {"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{listing(j)}\n</output>"}]
    return "/v1/chat/completions", {"User-Agent": "mini-swe-agent/1.17.3"}, chat_body(msgs)


def openclaw(k: int):
    """OpenClaw: every request ends with an internal-context user message that the next one replaces."""
    msgs = [{"role": "system", "content": "You are OpenClaw, a personal agent on the user's machine."},
            {"role": "user", "content": "Check why the nightly build failed."}]
    msgs += chat_tool_turns(k)
    msgs.append({"role": "user", "content": f"{OPENCLAW_MARKER}\nturn={k} clock=03:{10 + k:02d} "
                                            f"cwd=/srv/build\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"})
    return "/v1/chat/completions", {"User-Agent": "openclaw/2026.9.1"}, chat_body(msgs, tools=TOOLS_C)


def opencode_prune(k: int):
    """OpenCode with compaction.prune: from turn 4 on, one more old tool output is cleared every turn."""
    msgs = [{"role": "system", "content": "You are opencode, an interactive CLI tool that helps users."},
            {"role": "user", "content": "Read the sources and summarise each package."}]
    msgs += chat_tool_turns(k, output=lambda j: PRUNED if j <= k - 4 else listing(j))
    headers = {"User-Agent": "opencode/1.0.150", "x-session-id": "ses_7c1f00ab"}
    return "/v1/chat/completions", headers, chat_body(msgs, tools=TOOLS_C)


def thinking_stripped(k: int):
    """A harness (declared in a rules file) that re-sends only the latest assistant turn's reasoning."""
    msgs = [{"role": "system", "content": "You are a lean coding agent."},
            {"role": "user", "content": "Find the flaky test."}]
    msgs += chat_tool_turns(k, reasoning=lambda j: f"Thinking about pkg{j}: run its tests." if j == k - 1 else "")
    return "/v1/chat/completions", {"User-Agent": "lean-agent/0.3"}, chat_body(msgs, tools=TOOLS_C)


def anthropic_tools(k: int) -> list:
    """Claude Code's tools: an MCP server connects at turn 3 and another at turn 6 (appended)."""
    names = ["Bash"] + (["mcp__github__search"] if k >= 3 else []) + (["mcp__jira__issue"] if k >= 6 else [])
    return [{"name": n, "description": f"The {n} tool", "input_schema": SCHEMA} for n in names]


def claude_code_system(k: int, billing: str) -> list:
    """From turn 8 an output-style block follows the prompt (the user switched /output-style)."""
    style = [{"type": "text", "text": "Output style: explanatory. Explain each change."}] if k >= 8 else []
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3.{billing}; cc_entrypoint=cli;"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "<env>\nWorking directory: /home/u/proj\ngitStatus: clean\n</env>"}] + style


def anthropic_turns(k: int, first_user: str) -> list:
    msgs = [{"role": "user", "content": first_user}]
    for j in range(k):
        msgs += [{"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"Look at pkg{j}.", "signature": f"sig{j}"},
            {"type": "tool_use", "id": f"toolu_{j}", "name": "Bash", "input": {"cmd": f"ls src/pkg{j}"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{j}",
                                          "content": listing(j)}]}]
    return msgs


def claude_code_headers() -> dict:
    return {"User-Agent": "claude-cli/2.1.3 (external, cli)", "anthropic-version": "2023-06-01"}


def claude_code_system_tools(k: int):
    """Claude Code, append-only history, but its tools (turns 3, 6) and system prompt (turn 8) change."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": MAX_TOKENS, "temperature": 0,
            "system": claude_code_system(k, f"{k:03x}"), "tools": anthropic_tools(k),
            "metadata": {"user_id": CC_USER}, "messages": anthropic_turns(k, "Fix the parser bug.")}
    return "/v1/messages", claude_code_headers(), body


SUMMARY = "Your task is to create a detailed summary of the conversation so far."
CONTINUED = ("This session is being continued from a previous conversation that ran out of context. "
             "The conversation is summarized below:\nPackages pkg0..pkg3 were listed; the bug is in pkg2.")


def claude_code_compact(k: int):
    """Claude Code /compact: turns 0-4 append, 5 asks for the summary, 6-9 restart from it and append."""
    if k <= 4:
        messages = anthropic_turns(k, "Fix the parser bug.")
    elif k == 5:
        messages = anthropic_turns(4, "Fix the parser bug.") + [{"role": "user", "content": SUMMARY}]
    else:
        messages = anthropic_turns(k - 6, CONTINUED)
    body = {"model": "claude-sonnet-4-5", "max_tokens": MAX_TOKENS, "temperature": 0,
            "system": claude_code_system(0, "a1b"), "tools": anthropic_tools(0),
            "metadata": {"user_id": CC_USER}, "messages": messages}
    return "/v1/messages", claude_code_headers(), body


SCRIPTS = {
    "append": mini_swe_agent,
    "tail_replacement": openclaw,
    "tool_output_elision": opencode_prune,
    "thinking_stripped": thinking_stripped,
    "system_tools_changed": claude_code_system_tools,
    "compaction": claude_code_compact,
}
