"""Properties of the policy functions over generated conversations (hypothesis, small example counts)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from harness_adapters.normalize import normalize
from proxy.conversation import Conversation, Message, TextPart, ThinkingPart, ToolCallPart, ToolResultPart
from proxy.policy.anchors import IMPLICIT_PER_TURN, AnchorBudget, plan_anchors
from proxy.policy.diff import PreviousTurn, diff_turn
from tests.proxy.fake_render import render, reply_ids

text = st.text(alphabet="ab {}\":\n", max_size=12)
json_args = st.dictionaries(st.sampled_from("xyz"), st.integers(0, 9), max_size=3).map(
    lambda d: "{" + ", ".join(f'"{k}": {v}' for k, v in d.items()) + "}")
part = st.one_of(text.map(TextPart), text.map(ThinkingPart), json_args.map(lambda a: ToolCallPart("f", a)),
                 text.map(ToolResultPart))
message = st.builds(Message, st.sampled_from(["system", "user", "assistant", "tool"]),
                    st.lists(part, max_size=4).map(tuple))
conversation = st.builds(Conversation, st.lists(message, max_size=6).map(tuple))


@settings(max_examples=60, deadline=None)
@given(conversation)
def test_normalize_is_idempotent(conv):
    once = normalize(conv)
    assert normalize(once) == once


def agent_turns(k: int) -> tuple:
    msgs = (Message("system", (TextPart("sys"),)), Message("user", (TextPart("task"),)))
    for i in range(k):
        msgs += (Message("assistant", (ThinkingPart(f"t{i}"), ToolCallPart("f", "{}"))),
                 Message("tool", (ToolResultPart(f"out {i}"),)))
    return msgs


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 3), st.integers(2, 8), st.data())
def test_appending_a_generated_reply_and_new_messages_is_an_append(k, extra, cap, data):
    msgs = agent_turns(k)
    reply = Message("assistant", (TextPart(f"reply {extra}"),))
    conv = Conversation(msgs)
    r = render(conv)
    prev = PreviousTurn(tuple(r.ids), tuple(reply_ids(reply)), r.segments, conv)
    new = Conversation(msgs + (reply,) + agent_turns(extra)[1:])
    edit = diff_turn(prev, render(new), new)
    assert (edit.edit_class, edit.edit_point) == ("append", len(prev.ids))
    start = data.draw(st.integers(0, len(r.ids)))
    existing = data.draw(st.lists(st.integers(1, len(r.ids)), max_size=6))
    plan = plan_anchors(r, start=start, existing=existing, budget=AnchorBudget(max_count=cap))
    assert all(start < p < len(r.ids) for p in plan.checkpoint_positions)
    assert list(plan.checkpoint_positions) == sorted(set(plan.checkpoint_positions))
    assert len(plan.keep) + len(plan.checkpoint_positions) <= cap - IMPLICIT_PER_TURN
    assert set(plan.keep) | set(plan.release) == {p for p in existing if p <= start}
