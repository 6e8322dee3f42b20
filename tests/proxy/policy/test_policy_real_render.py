"""The cache policy on the real renderer and shipped tokenizer: edit points in real tokens, where prefill
resumes after each kind of edit, and normaliser invariance of the actual prompt ids."""
import json

import pytest

render_mod = pytest.importorskip("proxy.prompt.render")
tokenizer_mod = pytest.importorskip("proxy.prompt.tokenizer")

from harness_adapters import detect_adapter  # noqa: E402
from harness_adapters.normalize import normalize  # noqa: E402
from proxy.conversation import Conversation, Message, TextPart, ToolSpec  # noqa: E402
from proxy.policy.cache_policy import CachePolicy  # noqa: E402
from tests.proxy.fake_render import assistant, engine_usage, system, tool, user  # noqa: E402

TOOLS = (ToolSpec("bash", "run a shell command", json.dumps({"type": "object", "properties": {
    "cmd": {"type": "string"}}})),)


@pytest.fixture(scope="module")
def renderer():
    return render_mod.ChatRenderer(tokenizer_mod.load_tokenizer(None))


def generated(renderer, conv: Conversation, reply: Message) -> list[int]:
    """What the model emits for `reply`: the tokens after the generation prompt, through <|im_end|>."""
    prompt = renderer.render(conv).text
    full = renderer.render(Conversation(conv.messages + (reply,), conv.tools), add_generation_prompt=False).text
    assert full.startswith(prompt)
    text = full[len(prompt):]
    return renderer.tokenizer.encode(text[: text.rindex("<|im_end|>") + len("<|im_end|>")])


def play(policy, renderer, conv, reply, request=None, headers=None):
    request, headers = request or {}, headers or {}
    adapter = detect_adapter(request, headers)
    conv = normalize(conv, adapter)
    rendered = renderer.render(conv)
    turn = policy.admit_turn(policy.plan_turn(request, headers, conv, rendered, adapter))
    ids = generated(renderer, conv, reply)
    return turn, policy.finish_turn(turn, ids, engine_usage(turn, ids))


def call(k):
    return (("bash", json.dumps({"cmd": f"ls dir{k}"}), f"c{k}"),)


def test_agent_loop_appends_and_resumes_at_the_generation_end(renderer):
    policy = CachePolicy()
    msgs = (system("You are a coding agent."), user("list every directory"))
    for k in range(5):
        reply = assistant(f"Listing dir{k}.", thinking=f"Next I look at dir{k}.", calls=call(k))
        turn, rec = play(policy, renderer, Conversation(msgs, TOOLS), reply, headers={"x-session-id": "loop"})
        if k:
            assert rec.edit_class == "append"
            assert rec.anchor_used == rec.edit_point  # nothing before the new tool result is prefilled again
        msgs += (reply, tool(f"file{k}.py\nfile{k}b.py"))


def test_openclaw_tail_replacement_resumes_one_token_before_the_edit(renderer):
    policy = CachePolicy()
    marker = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
    history = (system("You are OpenClaw, a personal agent."), user("check the build"))
    for k in range(4):
        conv = Conversation(history + (user(f"{marker}\nclock=12:0{k}\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"),), TOOLS)
        reply = assistant("", thinking=f"step {k}", calls=call(k))
        turn, rec = play(policy, renderer, conv, reply, headers={"user-agent": "openclaw/2026.9"})
        if k:
            assert rec.edit_class == "tail_replacement"
            assert rec.anchor_used == rec.edit_point  # anchored after <|im_start|>: the role token differs
        history += (reply, tool(f"ok {k}"))


def test_claude_code_model_switch_resumes_at_the_model_line(renderer):
    """The environment block names the model; /model and the 1M-context switch rewrite that line in place, in
    the system turn before ~20k tokens of tools: the planner anchored the line's value while it was new."""
    policy = CachePolicy()
    request = {"metadata": {"user_id": json.dumps({"session_id": "cc-model"})}}
    headers = {"user-agent": "claude-cli/2.1.197"}

    def env(model):
        return system("You are Claude Code.\n# Environment\n - Platform: linux\n - You are powered by the model "
                      f"named {model}.\n - Assistant knowledge cutoff is January 2026.\n\ngitStatus: (clean)")

    msgs = (user("fix calc.py"),)
    models = ["Opus 4.8 (1M context). The exact model ID is claude-opus-4-8[1m]",  # as recorded (2.1.197)
              "Opus 4.8. The exact model ID is claude-opus-4-8",  # 1M context off (the turn after /compact)
              "Sonnet 5. The exact model ID is claude-sonnet-5"]  # /model sonnet
    for k, model in enumerate(models):
        reply = assistant("", thinking=f"t{k}", calls=call(k))
        turn, rec = play(policy, renderer, Conversation((env(model),) + msgs, TOOLS), reply, request, headers)
        msgs += (reply, tool(f"ok {k}"))
        if k:
            assert rec.edit_class == "system_changed"
            assert rec.edit_point > 0 and rec.anchor_used == rec.edit_point, (model, rec.edit_point, rec.anchor_used)


def test_opencode_prune_resumes_at_the_cleared_output(renderer):
    policy = CachePolicy()
    headers = {"user-agent": "opencode/1.18.2", "x-session-id": "ses_1"}
    msgs = (system("You are opencode, an interactive CLI tool."), user("read the sources"))
    for k in range(5):
        reply = assistant("", thinking=f"read {k}", calls=call(k))
        play(policy, renderer, Conversation(msgs, TOOLS), reply, headers=headers)
        msgs += (reply, tool(f"def f{k}():\n    return {k}\n" * 10))
    pruned = msgs[:3] + (tool("[Old tool result content cleared]"),) + msgs[4:]
    turn, rec = play(policy, renderer, Conversation(pruned, TOOLS), assistant("done"), headers=headers)
    assert rec.edit_class == "tool_output_elision"
    response = next(s for s in turn.segments if s.kind == "tool_response" and s.message_index == 3)
    text = next(s for s in turn.segments if s.kind == "body" and response.start < s.start < response.end)
    assert rec.anchor_used == text.start  # anchored after "<tool_response>\n", where the cleared text begins
    assert rec.edit_point - rec.anchor_used <= 1


def test_reasoning_not_sent_back_is_thinking_stripped_at_the_prompt_end(renderer):
    policy = CachePolicy()
    conv = Conversation((system("s"), user("why?")), TOOLS)
    first, _ = play(policy, renderer, conv, assistant("Because.", thinking="Let me think hard."),
                    headers={"session-id": "t"})
    turn, rec = play(policy, renderer, Conversation(conv.messages + (assistant("Because."), user("ok")), TOOLS),
                     assistant("fine"), headers={"session-id": "t"})
    assert rec.edit_class == "thinking_stripped"
    assert rec.anchor_used == len(first.prompt_ids) - 1  # "<think>\n" + "\n</think>" re-tokenised
    assert rec.edit_point - rec.anchor_used <= 1


def test_billing_line_and_json_key_order_do_not_change_prompt_ids(renderer):
    def conv(hexes, args):
        bill = f"x-anthropic-billing-header: cc_version=2.1.3.{hexes}; cc_entrypoint=cli;"
        return Conversation((Message("system", (TextPart(bill), TextPart("You are Claude Code."))),
                             user("go"), assistant("", calls=(("bash", args, "toolu_1"),)), tool("x")), TOOLS)

    adapter = detect_adapter({}, {"user-agent": "claude-cli/2.1.3"})
    a = renderer.render(normalize(conv("a1f", '{"cmd": "ls", "cwd": "/"}'), adapter))
    b = renderer.render(normalize(conv("7c0", '{"cwd":"/","cmd":"ls"}'), adapter))
    assert a.ids == b.ids
    assert "billing" not in a.text


def test_swe_agent_observation_elision_and_claude_code_compaction(renderer):
    policy = CachePolicy()
    headers = {"user-agent": "mini-swe-agent/2.4"}
    msgs = (system("You are a helpful assistant that can interact multiple times with a computer shell."),
            user("<pr_description>fix it</pr_description>"))
    for k in range(7):
        reply = assistant(f"THOUGHT: look {k}\n```bash\nls {k}\n```")
        play(policy, renderer, Conversation(msgs), reply, headers=headers)
        msgs += (reply, user(f"<returncode>0</returncode>\n<output>\n{'line' * 40} {k}\n</output>"))
    short = user("Old environment output: (1 lines omitted)")
    edited = Conversation(msgs[:3] + (short,) + msgs[4:])
    turn, rec = play(policy, renderer, edited, assistant("done"), headers=headers)
    assert rec.edit_class == "tool_output_elision"
    observation = next(s for s in turn.segments if s.kind == "body" and s.message_index == 3)
    assert rec.anchor_used == observation.start  # anchored after "<|im_start|>user\n" while it was new
    assert rec.edit_point - rec.anchor_used <= 1

    request = {"metadata": {"user_id": json.dumps({"session_id": "cc"})}}
    cc_headers = {"user-agent": "claude-cli/2.1.3"}
    cc = (system("You are Claude Code."), user("build it"))
    for k in range(3):
        reply = assistant("", thinking=f"t{k}", calls=call(k))
        play(policy, renderer, Conversation(cc, TOOLS), reply, request, cc_headers)
        cc += (reply, tool(f"ok {k}"))
    compacted = Conversation((cc[0], user("This session is being continued from a previous conversation that ran "
                                          "out of context. Summary: built steps 0-2.")), TOOLS)
    turn, rec = play(policy, renderer, compacted, assistant("next"), request, cc_headers)
    summary = next(s.start for s in turn.segments if s.kind == "body" and s.message_index == 1)
    assert (turn.session_key, rec.edit_class, rec.anchor_used) == ("cc", "compaction", summary)
    assert rec.edit_point - rec.anchor_used <= 1  # the summary replaced the first message's text


def test_string_and_block_content_give_the_same_prompt_ids(renderer):
    blocks = Conversation((Message("user", (TextPart("Fix "), TextPart("the bug"))),), TOOLS)
    plain = Conversation((user("Fix the bug"),), TOOLS)
    assert renderer.render(normalize(blocks)).ids == renderer.render(normalize(plain)).ids
