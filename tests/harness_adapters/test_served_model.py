"""The stable layout's two rewrites before the move: lines naming the model name the served one (ModelName
rules, harness_adapters/layout.py), and a resumed conversation keeps its first snapshot lines
(VolatileText.snapshot, harness_adapters/snapshots.py)."""
import json
import re

import pytest

from harness_adapters import ModelName, VolatileText, load_registry
from harness_adapters.claude_code import ClaudeCodeAdapter
from harness_adapters.layout import name_served_model, stable_first
from harness_adapters.opencode import OpenCodeAdapter
from harness_adapters.openclaw import OpenClawAdapter
from harness_adapters.snapshots import Snapshots
from proxy.conversation import Conversation, Message, TextPart, ToolSpec
from proxy.policy.planner import HarnessNormalizer
from tests.proxy.fake_render import assistant, user

ENV = ("You are an agent.\n\n# Environment\nYou have been invoked in the following environment: \n"
       " - Primary working directory: /home/u/a\n - Is a git repository: true\n"
       " - You are powered by the model {line}\n - The most recent Claude models are ...\n\n# Tone\nBe brief.\n\n"
       "gitStatus: This is the git status at the start of the conversation.\n\nStatus:\n{status}\n\n"
       "Recent commits:\naf2f200 init")
BASH = ToolSpec("Bash", "Run a command.\nCo-Authored-By: Claude {trailer} <noreply@anthropic.com>\nEnd.", "{}")


def conv(line="named Opus 4.8 (1M context). The exact model ID is claude-opus-4-8[1m].", status="(clean)",
         trailer="Opus 4.8 (1M context)", history=()) -> Conversation:
    tool = ToolSpec(BASH.name, BASH.description.format(trailer=trailer).replace("Claude  <", "Claude <"), "{}")
    system = Message("system", (TextPart(ENV.format(line=line, status=status)),))
    return Conversation((system, user("Fix the bug in calc.py")) + tuple(history), tools=(tool,))


def test_claude_code_names_the_served_model_in_its_own_form_for_an_unknown_one():
    out = name_served_model(conv(), ClaudeCodeAdapter.rules, "demo-qwen")
    assert " - You are powered by the model demo-qwen.\n - The most recent" in out.messages[0].text
    assert "Co-Authored-By: Claude <noreply@anthropic.com>\nEnd." in out.tools[0].description
    assert out.messages[1:] == conv().messages[1:]
    # what Claude Code writes when pointed at killick under the served name is left as it is
    served = conv(line="demo-qwen.", trailer="")
    assert name_served_model(served, ClaudeCodeAdapter.rules, "demo-qwen") == served


def test_any_alias_renders_the_same_prompt():
    aliases = [conv(), conv(line="named Opus 4.8. The exact model ID is claude-opus-4-8.", trailer="Opus 4.8"),
               conv(line="killick-other.", trailer="")]
    harness = HarnessNormalizer(served_model="demo-qwen")
    outs = [harness.normalize(c, {"user-agent": "claude-cli/2.1.197"}) for c in aliases]
    assert all(o == outs[0] for o in outs) and all(o.volatile == outs[0].volatile for o in outs)
    assert "You are powered by the model demo-qwen." in outs[0].volatile
    template = HarnessNormalizer(layout="template", served_model="demo-qwen")
    assert template.normalize(aliases[0], {"user-agent": "claude-cli/2.1.197"}) == aliases[0]


def test_without_a_served_model_only_the_rules_that_need_none_apply():
    out = name_served_model(conv(), ClaudeCodeAdapter.rules, None)
    assert "the model named Opus 4.8 (1M context)" in out.messages[0].text
    assert "Co-Authored-By: Claude <noreply" in out.tools[0].description


def test_opencode_and_openclaw_lines():
    opencode = Conversation((Message("system", (TextPart(
        "Be brief.\nYou are powered by the model named demo. The exact model ID is killick/demo\n<env>\n"),)),))
    out = name_served_model(opencode, OpenCodeAdapter.rules, "served")
    assert out.messages[0].text == "Be brief.\nYou are powered by the model served.\n<env>\n"
    openclaw = Conversation((Message("system", (TextPart(
        "## Runtime\nCurrent model identity: killick/demo-1.5. If asked what model you are, answer.\n"),)),))
    out = name_served_model(openclaw, OpenClawAdapter.rules, "served")
    assert out.messages[0].text == "## Runtime\nCurrent model identity: served. If asked what model you are, answer.\n"


def test_model_name_rule_validates_its_pattern():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        ModelName(pattern="(", replacement="x")
    assert ModelName(pattern="M: \\S+", replacement="M: {model}").rewrite("a M: x b M: y", "s") == "a M: s b M: s"


@pytest.mark.parametrize("pattern", [r"[^\n]*\n<env>", r"(\S+) ok", r"(?:a|.*b)", r"(?s:.*?)</env>", r"\s+x"])
def test_a_pattern_that_opens_with_a_run_is_refused(pattern):
    """A search for such a pattern scans ahead from every character of a run it can take: a tool output's
    100k-character line of minified JSON took 3.6 s of the event loop with OpenCode's <env> rule written so."""
    for rule in (lambda: VolatileText(pattern=pattern), lambda: ModelName(pattern=pattern, replacement="x")):
        with pytest.raises(ValueError, match=r"opens with an unbounded repeat.*\(\?m\)\^"):
            rule()


def test_patterns_that_open_with_text_or_an_anchor_are_taken():
    for pattern in (r"(?m)^[^\n]*\n<env>", r"x[^\n]*", r"a{2,5}", r"(?<=id: )\S+", r"\b\w+ model"):
        assert VolatileText(pattern=pattern).pattern == pattern
    # OpenCode's <env> rule, anchored: the block with the line that introduces it, after a long line of JSON
    (env,) = [r for r in OpenCodeAdapter.rules if "<env>" in getattr(r, "pattern", "")]
    head = "{" + '"k": 1, ' * 20_000 + "\nHere is the environment:\n"
    text = head + "<env>\n  Working directory: /w\n</env>\nafter"
    assert [m.span() for m in re.finditer(env.pattern, text)] == [(len(head) - 25, len(text) - 6)]


# --- snapshots ----------------------------------------------------------------------------------------------

SNAP = [r for r in ClaudeCodeAdapter.rules if getattr(r, "snapshot", False)]
TURN = (assistant("Looking."), user("ok"))


def status(c: Conversation) -> str:
    return c.messages[0].text.split("Status:\n")[1].split("\n")[0]


def admitted(snaps: Snapshots, c: Conversation, session) -> Conversation:
    """keep(), then commit() as the request's admission does."""
    out = snaps.keep(c, SNAP, session)
    snaps.commit(out.extras.get("snapshot"))
    return out


def test_a_resumed_conversation_keeps_the_snapshot_it_started_with():
    snaps = Snapshots()
    assert status(admitted(snaps, conv(), "s1")) == "(clean)"  # the first request sets it
    assert status(admitted(snaps, conv(history=TURN), "s1")) == "(clean)"
    resumed = admitted(snaps, conv(status="M calc.py", history=TURN * 2), "s1")  # --continue: a new snapshot
    assert resumed == conv(status="(clean)", history=TURN * 2)
    # another session, a sub-agent (own first message) and a request naming no session keep what they send
    assert status(admitted(snaps, conv(status="M calc.py", history=TURN), "s2")) == "M calc.py"
    sub = conv(status="M calc.py", history=TURN)
    sub = Conversation((sub.messages[0], user("Explore the repo")) + TURN, tools=sub.tools)
    assert status(admitted(snaps, sub, "s1")) == "M calc.py"
    assert status(admitted(snaps, conv(status="M calc.py", history=TURN), None)) == "M calc.py"
    # a request without an assistant message starts the conversation again: its snapshot wins from then on
    assert status(admitted(snaps, conv(status="D x.py"), "s1")) == "D x.py"
    assert status(admitted(snaps, conv(status="M calc.py", history=TURN), "s1")) == "D x.py"


def test_only_the_snapshot_is_kept_not_what_follows_it():
    snaps = Snapshots()
    admitted(snaps, conv(), "s1")
    later = conv(status="M calc.py", history=TURN)
    styled = Message("system", (TextPart(later.messages[0].text + "\n\nOutput style: explanatory."),))
    out = admitted(snaps, Conversation((styled,) + later.messages[1:], tools=later.tools), "s1")
    assert out.messages[0].text == conv().messages[0].text + "\n\nOutput style: explanatory."


def test_snapshots_are_bounded_and_a_forgotten_conversation_keeps_what_it_sends():
    snaps = Snapshots(capacity=2)
    for sid in ("s1", "s2", "s3"):
        admitted(snaps, conv(), sid)
    assert status(admitted(snaps, conv(status="M calc.py", history=TURN), "s1")) == "M calc.py"
    assert status(admitted(snaps, conv(status="M calc.py", history=TURN), "s3")) == "(clean)"


def test_a_snapshot_is_kept_only_once_its_request_is_admitted():
    """A first request refused after planning (or only counted) sets nothing: the next one of its conversation
    keeps its own; two first requests admitted in turn: the later start wins; a resumed request this server has
    not seen sets it unless one admitted meanwhile did."""
    snaps = Snapshots()
    snaps.keep(conv(status="D refused.py"), SNAP, "s1")  # planned, never admitted
    assert status(admitted(snaps, conv(status="M calc.py", history=TURN), "s1")) == "M calc.py"
    assert status(admitted(snaps, conv(status="A new.py", history=TURN * 2), "s1")) == "M calc.py"
    early, late = snaps.keep(conv(status="A a.py"), SNAP, "s2"), snaps.keep(conv(status="A b.py"), SNAP, "s2")
    snaps.commit(early.extras["snapshot"])
    snaps.commit(late.extras["snapshot"])
    assert status(admitted(snaps, conv(status="x", history=TURN), "s2")) == "A b.py"
    one, other = (snaps.keep(conv(status=st, history=TURN), SNAP, "s3") for st in ("M one.py", "M other.py"))
    snaps.commit(other.extras["snapshot"])
    snaps.commit(one.extras["snapshot"])
    assert status(admitted(snaps, conv(status="x", history=TURN), "s3")) == "M other.py"


def test_the_normalizer_keeps_snapshots_per_session_hint_in_the_stable_layout_only():
    headers = {"user-agent": "claude-cli/2.1.197"}
    body = {"metadata": {"user_id": json.dumps({"session_id": "0b8c2a9e-5d1f-4c7a-9e3b-2f6d8a1c4e7b"})}}
    stable, template = HarnessNormalizer(served_model="demo"), HarnessNormalizer(layout="template")
    for harness in (stable, template):
        harness.snapshots.commit(harness.normalize(conv(), headers, body).extras.get("snapshot"))
    resumed = conv(status="M calc.py", line="killick-other.", trailer="", history=TURN)
    out = stable.normalize(resumed, headers, body)
    first = stable.normalize(conv(history=TURN), headers, body)
    assert (out, out.volatile) == (first, first.volatile)
    assert template.normalize(resumed, headers, body) == resumed


def test_a_user_rules_file_declares_model_names_and_snapshots(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"harnesses": [{"name": "my-agent", "system_contains": ["You are my-agent"], "rules": [
        {"kind": "model_name", "pattern": "Model: [^\\n]*", "replacement": "Model: {model}"},
        {"kind": "volatile_text", "pattern": "\\nRepo: ", "moves": "to_end", "snapshot": True}]}]}))
    system = "You are my-agent.\nModel: gpt-x\nBe brief.\nRepo: clean"
    adapter = load_registry(path).detect({}, {}, Conversation((Message("system", (TextPart(system),)),)))
    assert adapter.name == "my-agent"
    assert adapter.rules[1] == VolatileText(pattern="\\nRepo: ", moves="to_end", snapshot=True)
    c = Conversation((Message("system", (TextPart(system),)), user("go")))
    out = stable_first(name_served_model(c, adapter.rules, "served"), adapter.rules)
    assert (out.messages[0].text, out.volatile) == ("You are my-agent.\nModel: served\nBe brief.", "Repo: clean")
