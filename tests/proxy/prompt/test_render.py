import dataclasses
import json
import shutil

import pytest

from proxy.conversation import (Conversation, Message, TextPart, ThinkingPart, ToolCallPart, ToolResultPart,
                                ToolSpec, canonical_json)
from proxy.prompt.render import ChatRenderer, template_messages, template_tools
from proxy.prompt.tokenizer import SHIPPED_DIR, load_tokenizer

TOK = load_tokenizer(None)
BASH = ToolSpec("bash", "Run a shell command", canonical_json(
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}))


def msg(role, *parts):
    return Message(role, tuple(TextPart(p) if isinstance(p, str) else p for p in parts))


def call(cmd, cid):
    return ToolCallPart("bash", canonical_json({"command": cmd}), cid)


def agent_conv(enable_thinking=True):
    return Conversation(messages=(
        msg("system", "You are a coding agent."),
        msg("user", "List the files."),
        msg("assistant", ThinkingPart("I will run ls and pwd."), call("ls", "c1"), call("pwd", "c2")),
        msg("tool", ToolResultPart("a.py\nb.py", "c1")),
        msg("tool", ToolResultPart("/work", "c2")),
        msg("assistant", ThinkingPart("Two files."), "There are two files: a.py and b.py."),
        msg("user", "Thanks! Now count lines."),
    ), tools=(BASH,), enable_thinking=enable_thinking)


EXPECTED = (
    '<|im_start|>system\nYou are a coding agent.\n\n# Tools\n\nYou can call the functions whose signatures are '
    'listed below, one JSON object per line, inside <tools></tools>:\n<tools>\n'
    '{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": '
    '{"properties": {"command": {"type": "string"}}, "required": ["command"], "type": "object"}}}\n</tools>\n\n'
    'To call functions, write one JSON object per call with the function name and its arguments, each inside '
    '<tool_call></tool_call>:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    '</tool_call><|im_end|>\n'
    '<|im_start|>user\nList the files.<|im_end|>\n'
    '<|im_start|>assistant\n<think>\nI will run ls and pwd.\n</think>\n\n'
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\na.py\nb.py\n</tool_response>\n<tool_response>\n/work\n</tool_response>'
    '<|im_end|>\n'
    '<|im_start|>assistant\n<think>\nTwo files.\n</think>\n\nThere are two files: a.py and b.py.<|im_end|>\n'
    '<|im_start|>user\nThanks! Now count lines.<|im_end|>\n'
    '<|im_start|>assistant\n<think>\n'
)


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer(TOK)


def piece(r, seg):
    return TOK.decode(r.ids[seg.start:seg.end])


def test_exact_text_and_ids(renderer):
    r = renderer.render(agent_conv())
    assert r.text == EXPECTED
    assert r.ids == TOK.encode(EXPECTED)


def test_thinking_off_closes_the_think_block(renderer):
    r = renderer.render(agent_conv(enable_thinking=False))
    assert r.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r.text[:-len("<think>\n\n</think>\n\n")] == EXPECTED[:-len("<think>\n")]
    assert piece(r, r.of_kind("generation_prompt")[0]) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_no_generation_prompt(renderer):
    r = renderer.render(agent_conv(), add_generation_prompt=False)
    assert r.text == EXPECTED[:-len("<|im_start|>assistant\n<think>\n")]
    assert not r.of_kind("generation_prompt")


def test_message_segments_tile_the_prompt(renderer):
    r = renderer.render(agent_conv())
    messages = r.of_kind("message")
    assert [s.message_index for s in messages] == list(range(7))
    assert messages[0].start == 0
    assert all(a.end == b.start for a, b in zip(messages, messages[1:]))
    assert messages[-1].end == r.of_kind("generation_prompt")[0].start
    assert r.of_kind("generation_prompt")[0].end == len(r.ids)
    texts = [piece(r, s) for s in messages]
    assert texts[1] == "<|im_start|>user\nList the files.<|im_end|>\n"
    assert texts[2].startswith("<|im_start|>assistant\n<think>\n") and texts[2].endswith("</tool_call><|im_end|>\n")
    assert texts[3] == "<|im_start|>user\n<tool_response>\na.py\nb.py\n</tool_response>"
    assert texts[4] == "\n<tool_response>\n/work\n</tool_response><|im_end|>\n"
    whole_turns = [t for i, t in enumerate(texts) if i not in (3, 4)]
    assert all(t.startswith("<|im_start|>") and t.endswith("<|im_end|>\n") for t in whole_turns)


def test_inner_segments_point_at_their_tokens(renderer):
    r = renderer.render(agent_conv())
    system, = r.of_kind("system")
    assert system.message_index == 0 and piece(r, system).endswith("</tool_call><|im_end|>\n")
    tools, = r.of_kind("tools")
    assert piece(r, tools).startswith('<tools>\n{"type": "function"') and piece(r, tools).endswith("</tools>")
    thinks = r.of_kind("think")
    assert [piece(r, s) for s in thinks] == ["<think>\nI will run ls and pwd.\n</think>",
                                             "<think>\nTwo files.\n</think>"]
    assert [s.message_index for s in thinks] == [2, 5]
    calls = r.of_kind("tool_call")
    assert [piece(r, s) for s in calls] == [
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
        '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>']
    results = r.of_kind("tool_response")
    assert [(piece(r, s), s.message_index) for s in results] == [
        ("<tool_response>\na.py\nb.py\n</tool_response>", 3), ("<tool_response>\n/work\n</tool_response>", 4)]
    for s in thinks + calls + results:  # each starts and ends on its special token
        assert r.ids[s.start] == TOK.token_id({"think": "<think>", "tool_call": "<tool_call>",
                                               "tool_response": "<tool_response>"}[s.kind])


def test_body_segments_start_where_the_text_of_a_block_begins(renderer):
    """Where a harness rewrites a block (clears a tool output, replaces a message's text, adds a tool, extends
    the system prompt), its text differs from here on: the anchor planner checkpoints these starts/ends."""
    r = renderer.render(agent_conv())
    bodies = {(piece(r, s), s.message_index) for s in r.of_kind("body")}
    system_text = next(piece(r, s) for s in r.of_kind("body") if s.message_index == 0)
    assert system_text.startswith("You are a coding agent.") and "# Tools" not in system_text  # ".\n\n" is one token
    assert ("List the files.<|im_end|>\n", 1) in bodies  # after "<|im_start|>user\n"
    assert ("a.py\nb.py\n", 3) in bodies and ("/work\n", 4) in bodies  # inside <tool_response>\n ... </tool_response>
    tools_body, = [s for s in r.of_kind("body") if piece(r, s).startswith('{"type": "function"')]
    assert renderer.tokenizer.decode(r.ids[tools_body.end:tools_body.end + 1]).startswith("</")  # </tools> next


@pytest.mark.parametrize("thinking", [True, False])
def test_appending_a_turn_keeps_the_earlier_ids_as_prefix(renderer, thinking):
    conv = agent_conv(thinking)
    prompt = renderer.render(conv)
    reasoning = "Use wc." if thinking else ""
    reply = msg("assistant", ThinkingPart(reasoning), call("wc -l *.py", "c3"))
    after_reply = Conversation(conv.messages + (reply,), conv.tools, thinking)
    done = renderer.render(after_reply, add_generation_prompt=False)
    nxt = renderer.render(Conversation(after_reply.messages + (msg("tool", ToolResultPart("3 a.py", "c3")),),
                                       conv.tools, thinking))
    assert nxt.ids[:len(done.ids)] == done.ids
    assert done.ids[:len(prompt.ids)] == prompt.ids  # the prompt + the model's reply is what gets re-sent
    generated = done.text[len(prompt.text):]
    assert prompt.ids + TOK.encode(generated) == done.ids
    assert nxt.of_kind("message")[:7] == prompt.of_kind("message")


def test_tool_results_inside_one_message_and_user_parts(renderer):
    conv = Conversation(messages=(
        msg("user", "go"),
        msg("assistant", call("ls", "a"), call("pwd", "b")),
        msg("user", ToolResultPart("x", "a"), ToolResultPart("y", "b"), "and then?"),
    ))
    r = renderer.render(conv)
    assert "<|im_start|>user\n<tool_response>\nx\n</tool_response>\n<tool_response>\ny\n</tool_response>" \
           "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n" in r.text
    last = r.of_kind("message")[-1]
    assert last.message_index == 2 and piece(r, last).startswith("<|im_start|>user\n<tool_response>")
    assert piece(r, last).endswith("and then?<|im_end|>\n")
    assert [s.message_index for s in r.of_kind("tool_response")] == [2, 2]
    assert "<|im_start|>system" not in r.text and not r.of_kind("system")


def test_tools_without_system_message(renderer):
    conv = Conversation(messages=(msg("user", "hi"),), tools=(BASH,))
    r = renderer.render(conv)
    system, = r.of_kind("system")
    first, = r.of_kind("message")
    assert system.message_index is None and system.end == first.start
    assert piece(r, first) == "<|im_start|>user\nhi<|im_end|>\n"


def test_template_messages_shape():
    msgs, owners = template_messages(agent_conv())
    calls = [{"type": "function", "function": {"name": "bash", "arguments": {"command": c}}} for c in ("ls", "pwd")]
    assert msgs[2] == {"role": "assistant", "content": "", "reasoning_content": "I will run ls and pwd.",
                       "tool_calls": calls}
    assert msgs[3] == {"role": "tool", "content": "a.py\nb.py"} and owners == list(range(7))
    assert template_tools(agent_conv())[0]["function"]["parameters"]["required"] == ["command"]


def test_arguments_that_are_not_json_are_emitted_as_is(renderer):
    conv = Conversation(messages=(msg("user", "x"), msg("assistant", ToolCallPart("bash", "{broken", "c"))))
    assert '{"name": "bash", "arguments": {broken}\n</tool_call>' in renderer.render(conv).text


def test_matches_transformers_apply_chat_template():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(SHIPPED_DIR))
    conv = agent_conv()
    msgs, _ = template_messages(conv)
    for thinking in (True, False):
        text = hf.apply_chat_template(msgs, tools=template_tools(conv), tokenize=False, add_generation_prompt=True,
                                      enable_thinking=thinking, chat_template=TOK.chat_template)
        ours = ChatRenderer(TOK).render(Conversation(conv.messages, conv.tools, thinking))
        assert text == ours.text
        assert hf.encode(text, add_special_tokens=False) == ours.ids


QWEN_LIKE = (  # a ChatML template of another shape: no think blocks, tool results as role "tool" turns
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_model_dir_template_is_honoured(tmp_path):
    shutil.copy(SHIPPED_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_LIKE}))
    r = ChatRenderer(load_tokenizer(tmp_path)).render(agent_conv())
    assert r.text.startswith("<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\n")
    assert "<think>" not in r.text
    messages = r.of_kind("message")
    assert len(messages) == 7 and all(piece(r, s).startswith("<|im_start|>") for s in messages)
    assert piece(r, messages[4]) == "<|im_start|>tool\n/work<|im_end|>\n"
    assert len(r.of_kind("tool_call")) == 2 and len(r.of_kind("tool_response")) == 0


def test_non_chatml_template_uses_prefix_renders():
    r = ChatRenderer(TOK, template=PLAIN).render(agent_conv())
    texts = [piece(r, s) for s in r.of_kind("message")]
    assert texts[0] == "[system] You are a coding agent.\n" and texts[1] == "[user] List the files.\n"
    assert texts[6] == "[user] Thanks! Now count lines.\n"
    assert piece(r, r.of_kind("generation_prompt")[0]) == "[assistant] "


def test_template_errors_are_value_errors():
    with pytest.raises(ValueError, match="does not compile"):
        ChatRenderer(TOK, template="{% for %}")
    with pytest.raises(ValueError, match="unsupported message role"):
        ChatRenderer(TOK).render(Conversation(messages=(msg("developer", "x"),)))


def test_system_message_later_in_the_conversation(renderer):
    conv = Conversation(messages=(msg("user", "a"), msg("assistant", "Sure."), msg("system", "note"), msg("user", "b")),
                        enable_thinking=False)
    r = renderer.render(conv)
    assert ("<|im_start|>assistant\n<think>\n\n</think>\n\nSure.<|im_end|>\n"
            "<|im_start|>system\nnote<|im_end|>\n") in r.text
    assert not r.of_kind("system")  # only a leading system message is the system turn
    assert [piece(r, s) for s in r.of_kind("message")][2] == "<|im_start|>system\nnote<|im_end|>\n"


def test_empty_conversation_is_just_the_generation_prompt(renderer):
    r = renderer.render(Conversation(messages=()))
    assert r.text == "<|im_start|>assistant\n<think>\n"
    assert [s.kind for s in r.segments] == ["generation_prompt"]


DROPS_OLD_REASONING = (  # like Qwen3's own templates: reasoning only after the last user message
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 > ns.last %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_template_that_rewrites_history_still_segments_exactly():
    conv = Conversation(messages=(msg("user", "a"), msg("assistant", ThinkingPart("r1"), "x"), msg("user", "b"),
                                  msg("assistant", ThinkingPart("r2"), "y")))
    r = ChatRenderer(TOK, template=DROPS_OLD_REASONING).render(conv, add_generation_prompt=False)
    assert [piece(r, s) for s in r.of_kind("message")] == [
        "<|im_start|>user\na<|im_end|>\n", "<|im_start|>assistant\nx<|im_end|>\n", "<|im_start|>user\nb<|im_end|>\n",
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\ny<|im_end|>\n"]
    assert [(piece(r, s), s.message_index) for s in r.of_kind("think")] == [("<think>\nr2\n</think>", 3)]


def test_volatile_system_lines_end_the_system_turn_after_the_tools(renderer):
    from dataclasses import replace

    conv = replace(agent_conv(), volatile="Working directory: /work\nToday: Monday")
    r = renderer.render(conv)
    head, tail = EXPECTED.split("</tool_call><|im_end|>\n", 1)
    assert r.text == head + "</tool_call>\n\nWorking directory: /work\nToday: Monday<|im_end|>\n" + tail
    (volatile,) = r.of_kind("volatile")
    assert piece(r, volatile) == "Working directory: /work\nToday: Monday" and volatile.message_index == 0
    assert r.of_kind("tools")[0].end < volatile.start and volatile.end < r.of_kind("system")[0].end
    before = renderer.render(agent_conv())
    assert [piece(r, s) for s in r.of_kind("message")][1:] == [piece(before, s) for s in before.of_kind("message")][1:]
    plain = ChatRenderer(TOK, template=PLAIN).render(conv)  # no ChatML system turn: the system text ends with them
    assert plain.text.startswith("[system] You are a coding agent.\n\nWorking directory: /work\nToday: Monday\n")
    with pytest.raises(ValueError, match="first system message"):
        renderer.render(replace(conv, messages=conv.messages[1:]))


def test_a_continued_last_message_is_left_open(renderer):
    """Anthropic's prefill: the assistant's last message rendered up to its text's end, its segments clipped there,
    no generation prompt after it."""
    conv = Conversation((Message("user", (TextPart("Say it."),)), Message("assistant", (TextPart("The answer"),))),
                        enable_thinking=False, continue_last=True)
    r = renderer.render(conv)
    assert r.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer") and r.ids == TOK.encode(r.text)
    assert not r.of_kind("generation_prompt")
    last = r.of_kind("message")[-1]
    assert last.message_index == 1 and last.end == len(r.ids)
    assert piece(r, last).startswith("<|im_start|>assistant\n")
    whole = renderer.render(dataclasses.replace(conv, continue_last=False), add_generation_prompt=False)
    assert whole.text.startswith(r.text) and whole.text[len(r.text):].startswith("<|im_end|>")
    with pytest.raises(ValueError, match="only an assistant message"):
        renderer.render(Conversation((Message("user", (TextPart("Say it."),)),), continue_last=True))
