"""Scripted assistant turns emitted through the real engine by forced decoding.

A script (JSON, or YAML when PyYAML is installed) is a list of turns; the proxy renders the chosen turn into the
exact token ids the model would produce after the generation prompt and passes them as forced_output_ids, so
prefill and every decode step still run on the model (timings and cache behaviour are real):

    {"vars":  {"workdir": "/tmp/sandbox"},            # {workdir} in any argument string is replaced
     "title": "Sandbox tour",                          # side request without tools (title generation)
     "summary": "Summary: we listed and edited ...",   # compaction requests
     "final": "All steps are done.",                   # after the last turn (the script always ends)
     "turns": [
       {"thinking": "List the files first.",
        "tool": [{"name": "Bash", "arguments": {"command": "ls"}},          # first declared name wins
                 {"name": ["bash", "exec"], "arguments": {"command": "ls"}},
                 {"name": "bash", "sole": true, "arguments": {...}}]},     # sole: only if it is the one tool
       {"text": "Done.", "thinking": "..."}]}

Turn i answers the i-th assistant message since the last real user message (a user message with text and no
tool results; OpenClaw's trailing internal-context message does not count). A turn whose tools are all
undeclared answers with its text, or else the final text (which ends the run); so does a request whose last
real user message carries the script's own compaction summary. The same shape, {"thinking", "text", "tool_calls":
[{"name", "arguments"}]}, is what replay forces through the `x-killick-force-response` header.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from proxy.conversation import Conversation, Message, TextPart, ThinkingPart, ToolCallPart, ToolResultPart
from proxy.conversation import canonical_json

FORCE_RESPONSE_HEADER = "x-killick-force-response"
OPENCLAW_INTERNAL = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
MAX_TURNS = 200


@dataclass(frozen=True)
class Reply:
    """One assistant message to force: thinking, then text, then tool calls (name, arguments JSON text)."""

    thinking: str = ""
    text: str = ""
    tool_calls: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict:
        return {"thinking": self.thinking, "text": self.text,
                "tool_calls": [{"name": n, "arguments": json.loads(a)} for n, a in self.tool_calls]}

    @classmethod
    def from_json(cls, data: Mapping) -> "Reply":
        calls = []
        for call in data.get("tool_calls") or ():
            args = call.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            calls.append((str(call["name"]), canonical_json(args)))
        return cls(str(data.get("thinking") or ""), str(data.get("text") or ""), tuple(calls))


def encode_header(reply: Reply) -> str:
    """Header-safe form of a reply (base64url of compact JSON)."""
    raw = json.dumps(reply.to_json(), separators=(",", ":"), ensure_ascii=False).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_header(value: str) -> Reply:
    try:
        return Reply.from_json(json.loads(base64.urlsafe_b64decode(value.encode())))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{FORCE_RESPONSE_HEADER}: not a base64url JSON reply ({exc})") from None


class Script:
    def __init__(self, data: Mapping[str, Any]):
        turns = data.get("turns")
        if not isinstance(turns, list) or not turns or len(turns) > MAX_TURNS:
            raise ValueError(f"a script needs 'turns': a list of 1..{MAX_TURNS} turn objects")
        for i, turn in enumerate(turns):
            check_turn(turn, f"turns[{i}]")
        self.turns = turns
        self.vars = {str(k): str(v) for k, v in (data.get("vars") or {}).items()}
        self.title = str(data.get("title") or "Scripted session")
        self.summary = _fill(str(data.get("summary") or "Summary: the scripted steps ran; nothing is left to do."),
                             self.vars)
        self.final = str(data.get("final") or "All scripted steps are done.")

    @classmethod
    def load(cls, path: str | Path, **vars: str) -> "Script":
        data = _parse(Path(path))
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a script is an object with 'turns'")
        try:
            return cls({**data, "vars": {**(data.get("vars") or {}), **vars}})
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def reply(self, conv: Conversation, side_kind: str | None = None) -> Reply:
        """The scripted answer to this request."""
        if side_kind == "compaction":
            return Reply(text=self.summary)
        if not conv.tools or side_kind == "title":
            return Reply(text=self.title)
        index = assistant_turns_since_user(conv)
        if index >= len(self.turns) or self._after_own_summary(conv):  # the steps are over: never loop
            return Reply(text=self.final)
        turn = self.turns[index]
        call = self._tool_call(turn.get("tool") or [], conv)
        text = str(turn.get("text") or ("" if call else self.final))
        return Reply(str(turn.get("thinking") or ""), text, (call,) if call else ())

    def _after_own_summary(self, conv: Conversation) -> bool:
        """The harness compacted and the last prompt is our summary (Codex auto-compaction): the steps
        were done before it. Starting them over would grow the context into the next compaction, forever."""
        users = [m for m in conv.messages if is_real_user(m)]
        return bool(users) and self.summary in users[-1].text

    def _tool_call(self, options, conv: Conversation) -> tuple[str, str] | None:
        """The first option naming a declared tool exactly; failing that, the first matching case-blind."""
        declared = [t.name for t in conv.tools]
        options = [o for o in (options if isinstance(options, list) else [options])
                   if not (o.get("sole") and len(declared) != 1)]
        for same in (str.__eq__, lambda a, b: a.lower() == b.lower()):
            for option in options:
                names = option.get("name")
                names = [names] if isinstance(names, str) else list(names or ())
                match = next((d for n in names for d in declared if same(d, n)), None)
                if match is not None:
                    return match, canonical_json(_fill(option.get("arguments") or {}, self.vars))
        return None


def _parse(path: Path):
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml  # optional: JSON scripts need nothing

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); a script is JSON, or YAML named *.yaml") from None


TURN_KEYS = {"thinking", "text", "tool"}


def check_turn(turn, where: str) -> None:
    """ValueError naming the field when a turn is not {"thinking"?: str, "text"?: str, "tool"?: option(s)},
    an option being {"name": str | [str], "arguments"?: object, "sole"?: bool}."""
    if not isinstance(turn, dict) or set(turn) - TURN_KEYS:
        raise ValueError(f"{where} must be an object with some of {sorted(TURN_KEYS)}, got {turn!r}")
    for key in ("thinking", "text"):
        if not isinstance(turn.get(key, ""), str):
            raise ValueError(f"{where}.{key} must be a string")
    options = turn.get("tool") or []
    for j, option in enumerate(options if isinstance(options, list) else [options]):
        at = f"{where}.tool[{j}]" if isinstance(options, list) else f"{where}.tool"
        names = option.get("name") if isinstance(option, dict) else None
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"{at} must be an object whose 'name' is a tool name or a list of them, got {option!r}")
        if not isinstance(option.get("arguments", {}), dict) or not isinstance(option.get("sole", False), bool):
            raise ValueError(f"{at}: 'arguments' must be an object and 'sole' true or false")


def _fill(value, vars: Mapping[str, str]):
    if isinstance(value, str):
        for k, v in vars.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, list):
        return [_fill(v, vars) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, vars) for k, v in value.items()}
    return value


def is_real_user(message: Message) -> bool:
    if message.role != "user" or any(isinstance(p, ToolResultPart) for p in message.parts):
        return False
    text = message.text.strip()
    return bool(text) and not text.startswith(OPENCLAW_INTERNAL)


def assistant_turns_since_user(conv: Conversation) -> int:
    last = max((i for i, m in enumerate(conv.messages) if is_real_user(m)), default=-1)
    return sum(1 for m in conv.messages[last + 1:] if m.role == "assistant")


def forced_ids(renderer, tokenizer, conv: Conversation, prompt_text: str, reply: Reply) -> list[int]:
    """Token ids of `reply` as the model would write them after the generation prompt, ending at <|im_end|>.

    The chat template renders the conversation with the reply appended; the text after `prompt_text` is what
    the model writes. Templates that re-shape the last turn fall back to the plain Qwen layout, as does a
    conversation whose last message the reply goes on from (continue_last: the reply writes on in that turn).
    """
    if conv.continue_last:
        return list(tokenizer.encode(_plain_layout(reply, prompt_text)))
    parts = ([ThinkingPart(reply.thinking)] if reply.thinking else []) + \
            ([TextPart(reply.text)] if reply.text else []) + \
            [ToolCallPart(n, a, f"call_{i}") for i, (n, a) in enumerate(reply.tool_calls)]
    full = replace(conv, messages=conv.messages + (Message("assistant", tuple(parts) or (TextPart(""),)),))
    text = renderer.render(full, add_generation_prompt=False).text
    if text.startswith(prompt_text) and "<|im_end|>" in text[len(prompt_text):]:
        tail = text[len(prompt_text):]
    else:
        tail = _plain_layout(reply, prompt_text)
    tail = tail[:tail.rindex("<|im_end|>") + len("<|im_end|>")]
    return list(tokenizer.encode(tail))


def _plain_layout(reply: Reply, prompt_text: str) -> str:
    think_open = prompt_text.rstrip().endswith("<think>")
    think = f"{reply.thinking}\n</think>\n\n" if think_open else ""
    calls = "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in reply.tool_calls)
    return think + reply.text + ("\n\n" if reply.text and calls else "") + calls + "<|im_end|>"
