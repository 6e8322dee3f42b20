"""The stable layout's rewrite before the move: lines naming the model name the served one (ModelName rules,
harness_adapters/layout.py)."""
import pytest

from harness_adapters import ModelName
from harness_adapters.claude_code import ClaudeCodeAdapter
from harness_adapters.layout import name_served_model
from harness_adapters.opencode import OpenCodeAdapter
from harness_adapters.openclaw import OpenClawAdapter
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
