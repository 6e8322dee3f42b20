"""The thinking budget's meter in upstream mode (proxy/upstream/budget.py): the thinking counted in the proxy's
tokens, cut only where the whole text has reached the budget, never once anything else was written."""
from proxy.conversation import Conversation, Message, TextPart, ThinkingPart
from proxy.prompt.output_parser import TextDelta, ThinkingDelta
from proxy.prompt.tokenizer import load_tokenizer
from proxy.upstream.budget import ThinkingMeter, past_thinking


def test_the_meter_counts_the_whole_thinking_not_its_pieces():
    tok = load_tokenizer(None)
    assert ThinkingMeter.of(tok, None) is None
    meter = ThinkingMeter.of(tok, 3)
    assert len(tok.encode("hel")) + len(tok.encode("lo")) == 3 and len(tok.encode("hello")) == 2
    assert meter.add(ThinkingDelta("hel")) is False and meter.add(ThinkingDelta("lo")) is False  # 3 apart, 2 whole
    assert meter.tokens == 2 and not meter.reached
    assert meter.add(ThinkingDelta(" world")) is True and meter.reached
    assert meter.text == "hello world" and meter.tokens == len(tok.encode("hello world")) >= 3
    assert meter.add(ThinkingDelta(" more")) is False  # reported once


def test_thinking_ended_by_text_is_never_cut():
    meter = ThinkingMeter.of(load_tokenizer(None), 2)
    assert meter.add(ThinkingDelta("a")) is False and meter.add(TextDelta("answer")) is False
    assert meter.add(ThinkingDelta("b c d e f g")) is False and not meter.reached


def test_the_continuation_leaves_the_thinking_as_the_assistants_open_turn():
    conv = Conversation((Message("user", (TextPart("hi"),)),), enable_thinking=True)
    cont = past_thinking(conv, "so far")
    assert cont.messages[:-1] == conv.messages and cont.messages[-1] == Message("assistant", (ThinkingPart("so far"),))
    assert cont.continue_last and not cont.enable_thinking
