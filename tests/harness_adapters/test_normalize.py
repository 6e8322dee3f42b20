"""Normaliser: what never belongs in the prompt does not change the render; meaning is never touched."""
from dataclasses import replace

from harness_adapters.claude_code import ClaudeCodeAdapter
from harness_adapters.normalize import is_billing_line, normalize, strip_volatile
from proxy.conversation import Conversation, Message, TextPart, ThinkingPart, ToolCallPart, ToolSpec
from tests.proxy.fake_render import render, user

BILL_A = "x-anthropic-billing-header: cc_version=2.1.3.a1f; cc_entrypoint=cli;"
BILL_B = "x-anthropic-billing-header: cc_version=2.1.3.7c0; cc_entrypoint=cli;"
CC_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude."


def cc_conv(bill: str, joined: bool) -> Conversation:
    parts = (TextPart(bill + "\n" + CC_SYSTEM),) if joined else (TextPart(bill), TextPart(CC_SYSTEM))
    return Conversation((Message("system", parts), user("hello")))


def test_billing_line_dropped_whether_a_block_or_a_line():
    expected = Conversation((Message("system", (TextPart(CC_SYSTEM),)), user("hello")))
    for bill in (BILL_A, BILL_B):
        for joined in (True, False):
            assert normalize(cc_conv(bill, joined)) == expected
    assert render(normalize(cc_conv(BILL_A, True))).ids == render(normalize(cc_conv(BILL_B, False))).ids


def test_billing_line_only_system_message_disappears():
    conv = Conversation((Message("system", (TextPart(BILL_A),)), user("hi")))
    assert normalize(conv).messages == (user("hi"),)


def test_billing_text_elsewhere_is_kept():
    quoted = Conversation((Message("system", (TextPart("sys"),)), user(BILL_A)))
    assert normalize(quoted) == quoted
    later = Conversation((Message("system", (TextPart("sys\n" + BILL_A),)), user("x")))
    assert normalize(later) == later
    assert is_billing_line(BILL_A) and not is_billing_line("sys\n" + BILL_A)


def test_claude_code_adapter_drops_billing_blocks_in_any_system_message():
    conv = Conversation((Message("system", (TextPart(CC_SYSTEM), TextPart(BILL_B))), user("hi")))
    out = normalize(conv, ClaudeCodeAdapter())
    assert out.messages[0] == Message("system", (TextPart(CC_SYSTEM),))


def test_string_vs_list_of_text_parts_render_the_same():
    as_string = Conversation((user("part one, part two"),))
    as_blocks = Conversation((Message("user", (TextPart("part one, "), TextPart(""), TextPart("part two"))),))
    assert normalize(as_string) == normalize(as_blocks)
    assert render(normalize(as_blocks)).ids == render(as_string).ids


def test_text_parts_around_other_parts_stay_in_order():
    msg = Message("assistant", (ThinkingPart("t"), TextPart("a"), TextPart("b"),
                                ToolCallPart("f", "{}"), TextPart("c")))
    out = normalize(Conversation((msg,))).messages[0]
    assert out.parts == (ThinkingPart("t"), TextPart("ab"), ToolCallPart("f", "{}"), TextPart("c"))


def test_json_key_order_in_tool_arguments_and_schemas():
    def conv(args: str, schema: str) -> Conversation:
        call = Message("assistant", (ToolCallPart("edit", args, "id-1"),))
        return Conversation((user("go"), call), (ToolSpec("edit", "edit", schema),))

    a = normalize(conv('{"path": "a.py", "line": 3}', '{"type": "object", "required": ["path"]}'))
    b = normalize(conv('{"line":3,"path":"a.py"}', '{"required":["path"],"type":"object"}'))
    assert a == b
    assert render(a).ids == render(b).ids
    broken = normalize(conv('{"path": ', "{}"))  # not JSON: kept verbatim, never guessed at
    assert broken.messages[1].parts[0].arguments == '{"path": '


def test_ids_whitespace_and_extras_are_not_touched_or_rendered():
    conv = Conversation((user("  indented\n\ncode  "),), extras={"harness": "x"})
    out = normalize(conv)
    assert out.messages[0].text == "  indented\n\ncode  "
    assert out.extras == {"harness": "x"}
    with_id = Conversation((Message("assistant", (ToolCallPart("f", "{}", "call_A"),)),))
    other_id = Conversation((Message("assistant", (ToolCallPart("f", "{}", "call_B"),)),))
    assert render(normalize(with_id)).ids == render(normalize(other_id)).ids


def test_normalize_is_idempotent():
    conv = replace(cc_conv(BILL_A, False), tools=(ToolSpec("t", "d", '{"b": 1, "a": 2}'),))
    once = normalize(conv, ClaudeCodeAdapter())
    assert normalize(once, ClaudeCodeAdapter()) == once


def test_strip_volatile_drops_request_noise_at_every_depth():
    a = {"model": "m", "metadata": {"user_id": "u1"}, "client_metadata": {"x": 1},
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                    "cache_control": {"type": "ephemeral"}}]}]}
    b = {"messages": [{"content": [{"text": "hi", "type": "text"}], "role": "user"}], "model": "m",
         "metadata": {"user_id": "u2"}, "prompt_cache_key": "k"}
    assert strip_volatile(a) == strip_volatile(b)
    assert list(strip_volatile(a)) == ["messages", "model"]
