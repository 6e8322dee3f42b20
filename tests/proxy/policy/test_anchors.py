"""Anchor planner: candidates from segment boundaries, rule-predicted cuts first, budget respected."""
import pytest

from harness_adapters import (Compaction, ElideObservationsExceptLastN, ElideToolOutputsBeyondN,
                              ReplaceTrailingMessage, StripThinkingExceptLatestN)
from proxy.conversation import Conversation, ToolSpec
from proxy.policy.anchors import (IMMINENT_CUT, IMPLICIT_PER_TURN, PREDICTED_CUT, AnchorBudget, candidates,
                                  past_opening_token, plan_anchors, predicted_cuts, resume_position)
from tests.proxy.fake_render import assistant, render, system, tool, user

TOOLS = (ToolSpec("bash", "run", "{}"),)
SYS = system("You are an agent.")
CALL = (("bash", '{"cmd": "ls"}', "c"),)


def agent_conv(turns: int) -> Conversation:
    msgs = (SYS, user("task"))
    for k in range(turns):
        msgs += (assistant(f"step {k}", thinking=f"think {k}", calls=CALL), tool(f"output {k}"))
    return Conversation(msgs, TOOLS)


def starts(r, kind):
    return [s.start for s in r.segments if s.kind == kind]


def test_candidates_cover_every_boundary_kind():
    r = render(agent_conv(2))
    kinds = {c.kind for c in candidates(r)}
    assert kinds == {"prefix_end", "message_start", "before_last_token", "generation_prompt_start", "think_start",
                     "think_end", "tool_call_end", "tool_response_start", "tool_response_end"}
    system_end = next(s.end for s in r.segments if s.kind == "system")
    assert any(c.kind == "prefix_end" and c.pos == system_end for c in candidates(r))
    assert all(0 < c.pos <= len(r.ids) for c in candidates(r))


def test_default_plan_is_every_turn_boundary_after_resume_point():
    r = render(agent_conv(3))
    plan = plan_anchors(r)
    msg_starts = sorted({past_opening_token(r, s.start) for s in r.segments if s.kind == "message" and s.start > 0})
    system_end = next(s.end for s in r.segments if s.kind == "system")
    gen = next(s.start for s in r.segments if s.kind == "generation_prompt")
    gen_start = past_opening_token(r, gen)  # where a new message would go: after its "<"
    assert set(plan.checkpoint_positions) == set(msg_starts) | {system_end, gen_start, len(r.ids) - 1}
    later = plan_anchors(r, start=msg_starts[3])
    assert later.checkpoint_positions == tuple(p for p in msg_starts if p > msg_starts[3]) + (gen_start,
                                                                                             len(r.ids) - 1)


def test_trailing_message_rule_predicts_the_cut_at_the_last_message():
    marker = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
    conv = Conversation(agent_conv(1).messages + (user(marker + " ctx"),), TOOLS)
    r = render(conv)
    last = past_opening_token(r, max(s.start for s in r.segments if s.kind == "message"))  # after "<"
    assert last == max(s.start for s in r.segments if s.kind == "message") + 1
    cuts = predicted_cuts(r, (ReplaceTrailingMessage(marker=marker),), conv)
    assert cuts == {last: ("replace_trailing_message", IMMINENT_CUT)}
    plan = plan_anchors(r, (ReplaceTrailingMessage(marker=marker),), conv=conv, budget=AnchorBudget(max_count=3))
    assert plan.checkpoint_positions == (last,)  # the one slot left after the engine's two goes to the cut
    assert plan.reasons[last] == "replace_trailing_message"
    no_marker = Conversation(agent_conv(1).messages + (user("plain"),), TOOLS)
    assert predicted_cuts(render(no_marker), (ReplaceTrailingMessage(marker=marker),), no_marker) == {}


def test_elision_and_thinking_rules_mark_every_live_block_and_the_next_cut():
    conv = agent_conv(4)
    r = render(conv)
    responses, thinks = starts(r, "tool_response"), starts(r, "think")
    rule = ElideToolOutputsBeyondN(n=2, placeholder="[x]")
    cuts = predicted_cuts(r, (rule,), conv)
    assert set(cuts) == set(responses)
    assert [p for p, (_, prio) in cuts.items() if prio == IMMINENT_CUT] == [responses[-2]]
    assert predicted_cuts(r, (StripThinkingExceptLatestN(n=1),), conv)[thinks[-1]] == (
        "strip_thinking_except_latest_n", IMMINENT_CUT)
    assert all(prio == PREDICTED_CUT for _, prio in
               predicted_cuts(r, (ElideToolOutputsBeyondN(n=9, placeholder="[x]"),), conv).values())
    elided = Conversation(conv.messages[:3] + (tool("[x]"),) + conv.messages[4:], TOOLS)
    assert responses[0] not in predicted_cuts(render(elided), (rule,), elided)  # already cut: no anchor needed


def test_observation_rule_uses_user_messages_after_the_task():
    a = assistant("```bash\nls\n```")
    conv = Conversation((SYS, user("task"), a, user("obs 1"), a, user("obs 2"), a, user("obs 3")))
    r = render(conv)
    msg = {s.message_index: s.start for s in r.segments if s.kind == "message"}
    assert predicted_cuts(r, (ElideObservationsExceptLastN(n=2),), conv) == {
        msg[3]: ("elide_observations_except_last_n", PREDICTED_CUT),
        msg[5]: ("elide_observations_except_last_n", IMMINENT_CUT),
        msg[7]: ("elide_observations_except_last_n", PREDICTED_CUT)}


def test_compaction_rule_keeps_the_shared_prefix():
    r = render(agent_conv(2))
    system_end = next(s.end for s in r.segments if s.kind == "system")
    plan = plan_anchors(r, (Compaction(),), budget=AnchorBudget(max_count=3))
    assert plan.checkpoint_positions == (system_end,)
    assert plan.reasons[system_end] == "compaction"


def test_budget_by_count_and_bytes_keeps_highest_priority_then_latest():
    r = render(agent_conv(6))
    msg_starts = sorted({past_opening_token(r, s.start) for s in r.segments if s.kind == "message" and s.start > 0})
    system_end = next(s.end for s in r.segments if s.kind == "system")
    plan = plan_anchors(r, budget=AnchorBudget(max_count=6))
    assert len(plan.checkpoint_positions) == 6 - IMPLICIT_PER_TURN
    gen_start = past_opening_token(r, next(s.start for s in r.segments if s.kind == "generation_prompt"))
    assert plan.checkpoint_positions == tuple(sorted([system_end] + msg_starts[-1:] + [gen_start, len(r.ids) - 1]))
    by_bytes = AnchorBudget(max_count=100, max_bytes=5 * 63_000_000, bytes_per_checkpoint=63_000_000)
    assert by_bytes.cap == 5
    assert len(plan_anchors(r, budget=by_bytes).checkpoint_positions) == 3


def test_existing_anchors_kept_or_released_under_budget():
    r = render(agent_conv(5))
    msg_starts = sorted({past_opening_token(r, s.start) for s in r.segments if s.kind == "message" and s.start > 0})
    resume = msg_starts[6]
    old = tuple(msg_starts[1:7])
    plan = plan_anchors(r, start=resume, existing=old + (len(r.ids) + 50,), budget=AnchorBudget(max_count=6))
    assert set(plan.keep) | set(plan.release) == set(old)  # positions past the resume point are not "existing"
    assert len(plan.keep) + len(plan.checkpoint_positions) == 4
    assert all(p > resume for p in plan.checkpoint_positions)
    assert max(plan.release) < min(plan.keep + plan.checkpoint_positions)


def test_resume_position_and_budget_validation():
    assert resume_position((10, 50, 90), 60) == 50
    assert resume_position((10, 50), 5) == 0
    assert resume_position((10, 50), 50) == 50
    with pytest.raises(ValueError, match="max_count"):
        AnchorBudget(max_count=1)
    assert PREDICTED_CUT > 2


def test_long_session_never_holds_more_anchors_than_its_budget():
    from harness_adapters.opencode import OpenCodeAdapter
    from proxy.policy.cache_policy import CachePolicy
    from tests.proxy.fake_render import play

    budget = AnchorBudget(max_count=8, max_bytes=8 * 1000, bytes_per_checkpoint=1000)
    policy = CachePolicy(budget=budget)
    msgs = (SYS, user("task"))
    for k in range(40):
        reply = assistant(f"s{k}", thinking=f"t{k}", calls=CALL)
        turn, rec = play(policy, OpenCodeAdapter(), Conversation(msgs, TOOLS), reply, headers={"x-session-id": "long"})
        state = policy.store.get("long")
        assert len(state.checkpoint_positions) <= budget.cap
        if k:
            assert (rec.edit_class, rec.anchor_used) == ("append", rec.edit_point)
        msgs += (reply, tool(f"out {k}"))


def test_volatile_text_rule_anchors_the_last_boundary_at_or_before_each_match():
    from harness_adapters import VolatileText
    from proxy.policy.anchors import volatile_positions
    from proxy.prompt.render import ChatRenderer
    from proxy.prompt.tokenizer import load_tokenizer

    r = ChatRenderer(load_tokenizer(None)).render(Conversation(
        (system("Env:\n - Today's date: Sun Nov 29 2026\n - model: a"), user("hi")), TOOLS))
    rule = VolatileText(pattern=r"Today's date: (\S)")
    value = r.text.index("Sun Nov")
    (pos,) = volatile_positions(r, rule.pattern)
    assert pos == r.boundary_at_or_before(value)
    assert r.token_starts[pos] <= value and all(s < value for s in r.token_starts[:pos])
    assert predicted_cuts(r, (rule,), None) == {pos: ("volatile_text", PREDICTED_CUT)}
    assert pos in plan_anchors(r, (rule,)).checkpoint_positions
    whole = r.text.index(" - model")  # no group: the match's own start
    assert volatile_positions(r, r"\n - model") == [r.boundary_at_or_before(whole - 1)]
    assert volatile_positions(render(agent_conv(1)), rule.pattern) == []  # test doubles carry no offsets


def test_volatile_text_rule_rejects_a_bad_pattern():
    from harness_adapters import VolatileText

    with pytest.raises(ValueError, match="regular expression"):
        VolatileText(pattern="model (")
