"""Responses `truncation`: validated and echoed; "auto" drops the oldest messages (never the instructions, the
last user message or the last input item) so the prompt leaves the answer room, "disabled" keeps the 400."""
from proxy.conversation import Conversation, Message, TextPart, ToolResultPart
from proxy.prompt.truncation import droppable, fit, without
from proxy_fakes import CharTokenizer, ChatMLRenderer

TOK = CharTokenizer()


def msg(role: str, text: str) -> Message:
    part = ToolResultPart(text, "c") if role == "tool" else TextPart(text)
    return Message(role, (part,))


def test_droppable_spans_keep_the_system_part_the_last_user_message_and_the_last_item():
    roles = ["system", "user", "assistant", "tool", "tool", "user", "assistant", "tool", "assistant", "tool"]
    spans = droppable([msg(r, "x") for r in roles])
    # the call and its two results go together; 5 is the last user message, 8-9 the last item
    assert spans == [(1, 2), (2, 5), (6, 8)]
    assert droppable([msg("system", "s"), msg("user", "only")]) == []


def test_fit_drops_the_fewest_oldest_spans_that_leave_the_prompt_under_the_limit():
    messages = [msg("system", "rules")] + [msg(r, f"{r} turn {i} " + "x" * 30) for i in range(5)
                                            for r in ("user", "assistant")] + [msg("user", "now")]
    conv = Conversation(tuple(messages))
    render = ChatMLRenderer(TOK).render

    def cost(ms, most):
        return sum(len(m.text) for m in ms)

    for limit in (120, 200, 300, 500):
        kept, prompt = fit(conv, limit, render, cost)
        assert len(prompt.ids) < limit and prompt.ids == render(kept).ids
        assert kept.messages[0] == messages[0] and kept.messages[-1] == messages[-1]
        assert kept.messages[1:] == tuple(messages[-len(kept.messages) + 1:])  # the newest, in order
        spans = droppable(conv.messages)
        dropped = len(conv.messages) - len(kept.messages)
        if dropped:  # one span fewer dropped would not fit
            n = next(k for k in range(len(spans) + 1) if without(conv, spans[:k]) == kept)
            assert len(render(without(conv, spans[:n - 1])).ids) >= limit
    bare, _ = fit(conv, 10, render, cost)  # nothing droppable is left where even that is too long
    assert bare.messages == (messages[0], messages[-1])


def _long_input(turns: int = 6) -> list[dict]:
    items = []
    for i in range(turns):
        items += [{"role": "user", "content": f"question {i} " + "q" * 30},
                  {"role": "assistant", "content": f"answer {i} " + "a" * 30}]
    return items + [{"role": "user", "content": "the last question"}]


async def test_disabled_refuses_and_auto_drops_the_oldest_turns(aiohttp_client, fake_stack):
    app, core = fake_stack(context_length=300)
    client = await aiohttp_client(app)
    body = {"model": "m", "instructions": "be brief", "input": _long_input(), "max_output_tokens": 50}
    for refused in ({**body}, {**body, "truncation": "disabled"}, {**body, "truncation": None}):
        resp = await client.post("/v1/responses", json=refused)
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    resp = await client.post("/v1/responses", json={**body, "truncation": "auto"})
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["truncation"] == "auto" and answer["status"] == "completed"
    prompt = TOK.decode(core.requests[-1].prompt_ids)
    assert prompt.startswith("<|im_start|>system\nbe brief<|im_end|>") and "the last question" in prompt
    assert "question 0" not in prompt and "answer 5" in prompt  # the oldest went, the newest stayed
    assert len(core.requests[-1].prompt_ids) <= 300 - 50 and core.requests[-1].max_new_tokens >= 50
    assert answer["usage"]["input_tokens"] == len(core.requests[-1].prompt_ids)


async def test_auto_leaves_a_conversation_that_fits_as_it_is(aiohttp_client, fake_stack):
    app, core = fake_stack(context_length=4096)
    client = await aiohttp_client(app)
    for truncation in ("auto", "disabled"):
        resp = await client.post("/v1/responses", json={"model": "m", "input": _long_input(), "truncation": truncation})
        assert resp.status == 200 and (await resp.json())["truncation"] == truncation
    auto, disabled = core.requests[-2:]
    assert auto.prompt_ids == disabled.prompt_ids and "question 0" in TOK.decode(auto.prompt_ids)


async def test_auto_refuses_what_it_may_not_drop_and_bad_values_are_400(aiohttp_client, fake_stack):
    client = await aiohttp_client(fake_stack(context_length=300)[0])
    resp = await client.post("/v1/responses", json={"model": "m", "input": _long_input() + [
        {"role": "user", "content": "z" * 400}], "truncation": "auto"})
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["code"] == "context_length_exceeded" and "truncation keeps" in err["message"]
    for bad in ("middle", "AUTO", 1, True):
        resp = await client.post("/v1/responses", json={"model": "m", "input": "hi", "truncation": bad})
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["param"] == "truncation" and err["type"] == "invalid_request_error"
    ok = await client.post("/v1/responses", json={"model": "m", "input": "hi"})
    assert ok.status == 200 and (await ok.json())["truncation"] == "disabled"


async def test_a_chain_past_the_context_goes_on_with_auto(aiohttp_client, fake_stack):
    """previous_response_id keeps the whole conversation; each turn is truncated afresh."""
    app, core = fake_stack(context_length=300)
    client = await aiohttp_client(app)
    previous = None
    for i in range(8):
        resp = await client.post("/v1/responses", json={
            "model": "m", "input": f"turn {i} " + "t" * 40, "previous_response_id": previous,
            "truncation": "auto", "max_output_tokens": 20})
        assert resp.status == 200, await resp.text()
        previous = (await resp.json())["id"]
    prompt = TOK.decode(core.requests[-1].prompt_ids)
    assert "turn 7" in prompt and "turn 0" not in prompt and len(core.requests[-1].prompt_ids) <= 280


async def test_auto_serves_what_it_keeps_where_it_fits_the_context_with_less_room(aiohttp_client, fake_stack):
    app, core = fake_stack(context_length=300)
    client = await aiohttp_client(app)
    last = {"role": "user", "content": "z" * 240}  # with the instructions: under the context, over 300 - 50
    resp = await client.post("/v1/responses", json={"model": "m", "instructions": "be brief", "truncation": "auto",
                                                    "input": _long_input() + [last], "max_output_tokens": 50})
    assert resp.status == 200, await resp.text()
    prompt = TOK.decode(core.requests[-1].prompt_ids)
    assert "question" not in prompt and "answer" not in prompt and "z" * 240 in prompt
    assert 250 < len(core.requests[-1].prompt_ids) < 300
