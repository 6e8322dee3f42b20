"""Truncation rules: how a harness edits its history on later turns, as data.

Pydantic models, since users write them in config files (user_rules.py). They say where a harness will cut,
so the anchor planner keeps a checkpoint just before each cut (proxy/policy/anchors.py, RULE_CUTS: one
entry per kind) and the diff can name the edit. Two kinds also shape the stable-first layout
(harness_adapters/layout.py): VolatileText (what moves after the tools) and ModelName (the harness's naming
of the model, rewritten to the served model's). Code that needs the rules of one kind asks `rules_of`.
"""
from __future__ import annotations

import re
from typing import Annotated, Iterable, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StripThinkingExceptLatestN(_Rule):
    """Reasoning blocks of all but the latest n assistant messages are dropped on later turns."""

    kind: Literal["strip_thinking_except_latest_n"] = "strip_thinking_except_latest_n"
    n: int = Field(1, ge=0)


class ElideToolOutputsBeyondN(_Rule):
    """Tool outputs older than the latest n are replaced by `placeholder` (OpenCode's prune)."""

    kind: Literal["elide_tool_outputs_beyond_n"] = "elide_tool_outputs_beyond_n"
    n: int = Field(ge=0)
    placeholder: str = Field(min_length=1)


class ElideObservationsExceptLastN(_Rule):
    """Observation messages (user or tool) but the last n are shortened (SWE-agent history processors)."""

    kind: Literal["elide_observations_except_last_n"] = "elide_observations_except_last_n"
    n: int = Field(ge=0)
    placeholder: str = ""  # the start of the shortened text, when known


class ReplaceTrailingMessage(_Rule):
    """The request's last message carries `marker` and the next request replaces it (OpenClaw)."""

    kind: Literal["replace_trailing_message"] = "replace_trailing_message"
    marker: str = Field(min_length=1)


class Compaction(_Rule):
    """The harness summarises and restarts its history.

    request_markers: text in the summary request's system prompt or last user message (a side request of
        its own, which must not overwrite the main conversation's state).
    history_markers: text in the rebuilt history (its first user message carries the summary).
    """

    kind: Literal["compaction"] = "compaction"
    request_markers: tuple[str, ...] = ()
    history_markers: tuple[str, ...] = ()


class VolatileText(_Rule):
    """Text a later turn or another conversation rewrites, e.g. the environment lines of a system prompt (the
    model name Claude Code writes changes with /model, the 1M-context switch and compaction; the working
    directory and git status differ between conversations). Every match of `pattern` (a Python regex) in
    the rendered prompt is a future cut at the start of each of its groups, or of the match when it has
    none: the checkpoint goes on the last token boundary at or before it.

    `moves` says what the stable-first layout (harness_adapters/layout.py) takes out of the system text and
    writes after the tool definitions: the lines the match touches ("line"), everything from its first line
    to the end of the system text ("to_end"), or nothing ("none").

    `snapshot`: the harness takes this text once, when a conversation starts, and says so (Claude Code's
    gitStatus: "a snapshot in time, and will not update during the conversation"), but takes it again when
    it resumes the conversation in a new process (`--continue`). With the stable-first layout a resumed
    conversation keeps the text of its first request (harness_adapters/snapshots.py), as the harness itself
    would have had it never restarted, so the history after it stays cached. The snapshot is what the
    pattern matches (not what `moves` takes with it), so the pattern covers the whole snapshot and no more."""

    kind: Literal["volatile_text"] = "volatile_text"
    pattern: str = Field(min_length=1)
    moves: Literal["line", "to_end", "none"] = "line"
    snapshot: bool = False

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        return _regex(value)


class ModelName(_Rule):
    """Text in which the harness names the model it believes it talks to: the alias the user picked (Claude
    Code's environment line "You are powered by the model named Opus 4.8. The exact model ID is
    claude-opus-4-8.", the co-author line of its Bash tool). killick serves one model whatever the alias, so
    with the stable-first layout every match of `pattern` in the system text and the tool descriptions
    becomes `replacement`, in which "{model}" stands for the name of the model killick serves: the model is
    told its own name, and another alias (`--continue --model X`, /model) no longer changes the prompt. A
    replacement naming {model} applies only where killick knows the model it serves (not with --upstream)."""

    kind: Literal["model_name"] = "model_name"
    pattern: str = Field(min_length=1)
    replacement: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        return _regex(value)

    def rewrite(self, text: str, model: str | None) -> str:
        """text with every match replaced, or text itself when the replacement needs a model not known."""
        if "{model}" in self.replacement and not model:
            return text
        out = self.replacement.replace("{model}", model or "")
        return re.sub(self.pattern, lambda _: out, text)


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"pattern is not a valid regular expression: {exc}") from None
    if _opens_with_a_run(value):
        raise ValueError(f"pattern {value!r} opens with an unbounded repeat: on a long line without a match it is "
                         "tried again at every character (a prompt's tool output of minified JSON stalls the "
                         "server); open it with literal text, or anchor it: (?m)^ for a line's start")
    return value


def _opens_with_a_run(pattern: str) -> bool:
    """Whether a match of `pattern` can start with an unbounded repeat (x*, x+, x{n,}), before any literal or
    anchor: the search then scans ahead from every position of a run the repeat takes, quadratic in its length."""
    try:
        from re import _parser as parser
    except ImportError:  # Python 3.10
        import sre_parse as parser
    repeats = tuple(getattr(parser, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                    if hasattr(parser, name))

    def opens(items) -> bool:
        if not len(items):
            return False
        op, arg = items[0]
        if op is parser.SUBPATTERN:
            return opens(arg[-1])
        if op is parser.BRANCH:
            return any(opens(branch) for branch in arg[1])
        return op in repeats and arg[1] == parser.MAXREPEAT

    return opens(parser.parse(pattern))


# The model line Claude Code and OpenCode write into their system prompts; it changes when the user switches
# model mid-session (the name: group 1) and, for Claude Code, with the 1M-context switch: "Opus 4.8 (1M
# context). The exact model ID is claude-opus-4-8[1m]." vs "Opus 4.8. The exact ..." (group 2).
MODEL_LINE = VolatileText(pattern=r"You are powered by the model(?: named)? (\S)[^\n]*?( \(|\. )")
# The same line in the served model's name, in the form Claude Code writes for a model it does not know.
MODEL_NAME = ModelName(pattern=r"You are powered by the model[^\n]*",
                       replacement="You are powered by the model {model}.")

Rule = Annotated[
    Union[StripThinkingExceptLatestN, ElideToolOutputsBeyondN, ElideObservationsExceptLastN,
          ReplaceTrailingMessage, Compaction, VolatileText, ModelName],
    Field(discriminator="kind"),
]


R = TypeVar("R", bound=_Rule)


def rules_of(rules: Iterable, kind: type[R]) -> list[R]:
    """The rules of one kind, in their order (selected by the `kind` field every rule carries)."""
    wanted = kind.model_fields["kind"].default
    return [r for r in rules if r.kind == wanted]
