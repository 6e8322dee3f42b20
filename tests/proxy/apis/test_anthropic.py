"""The Anthropic Messages API against the stand-in engine (tests/proxy/proxy_fakes.py SlowCore): when
message_start goes out and what its usage says, an engine failure before the request is admitted, and the
thinking budget's rules."""
import json

import pytest

from engine.api import ThinkingBudget

MSG = [{"role": "user", "content": "hi"}]


async def _events(resp) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a response."""
    out = []
    for block in (await resp.text()).split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_message_start_waits_for_admission_and_carries_the_cache_split(aiohttp_client, fake_stack):
    """Queued: pings keep the stream alive; message_start comes once the engine has admitted the request, with
    the prompt split into new input and cache reads as message_delta confirms at the end."""
    app, core = fake_stack(keepalive_s=0.1)
    core.queue_s = 0.5
    client = await aiohttp_client(app)
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "stream": True, "messages": MSG})
    events = await _events(resp)
    names = [name for name, _ in events]
    start = names.index("message_start")
    assert start >= 3 and set(names[:start]) == {"ping"}, names
    assert names[start + 1] == "ping" and names[-2:] == ["message_delta", "message_stop"]
    prompt = len(core.requests[-1].prompt_ids)
    split = {"input_tokens": prompt - prompt // 2, "cache_read_input_tokens": prompt // 2}
    usage = events[start][1]["message"]["usage"]
    assert usage == {**split, "cache_creation_input_tokens": 0, "output_tokens": 0}
    final = events[names.index("message_delta")][1]["usage"]
    assert {k: final[k] for k in split} == split and final["output_tokens"] > 0


async def test_an_engine_failure_before_admission_is_an_error_in_the_apis_shape(aiohttp_client, fake_stack):
    """Nothing sent yet: the failure is the whole answer (a 500 with Anthropic's error body). Pings sent while
    queued: an `error` event ends the stream, with no message_start before it."""
    app, core = fake_stack(keepalive_s=0.1)
    client = await aiohttp_client(app)
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": MSG}
    core.fail_admit = True
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 500
    assert (await resp.json())["error"] == {"type": "api_error",
                                            "message": "generation failed: cannot restore the prefix"}
    core.fail_admit, core.queue_s = True, 0.35
    resp = await client.post("/v1/messages", json=body)
    events = await _events(resp)
    assert resp.status == 200 and [name for name, _ in events][-1] == "error"
    assert {name for name, _ in events[:-1]} == {"ping"}
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "cannot restore the prefix"}}
    core.queue_s = 0.0
    assert (await client.post("/v1/messages", json=body)).status == 200


@pytest.mark.parametrize("thinking,needle", [
    ({"type": "enabled"}, "field required"),
    ({"type": "enabled", "budget_tokens": 1023}, "must be at least 1024, got 1023"),
    ({"type": "enabled", "budget_tokens": 2048}, "must be less than max_tokens (2048 >= 2048)"),
    ({"type": "disabled", "budget_tokens": 1024}, "thinking of type 'disabled' takes no budget"),
    ({"type": "adaptive", "budget_tokens": 1024}, "thinking of type 'adaptive' takes no budget"),
])
async def test_a_thinking_budget_anthropic_would_refuse_is_a_400_naming_it(aiohttp_client, fake_stack, thinking,
                                                                          needle):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 2048, "messages": MSG,
                                                   "thinking": thinking})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith("thinking.budget_tokens: ") and needle in error["message"]
    if thinking["type"] != "enabled" or "budget_tokens" not in thinking or thinking["budget_tokens"] < 1024:
        resp = await client.post("/v1/messages/count_tokens", json={"model": "m", "messages": MSG,
                                                                    "thinking": thinking})
        assert resp.status == 400 and needle in (await resp.json())["error"]["message"]
    assert not core.requests


async def test_the_thinking_budget_goes_to_the_engine_with_the_think_end_marker(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    for thinking, budget in [({"type": "enabled", "budget_tokens": 1024}, ThinkingBudget(1024, close_ids=(4,))),
                             ({"type": "adaptive"}, None), ({"type": "disabled"}, None), (None, None)]:
        body = {"model": "m", "max_tokens": 1025, "messages": MSG, **({"thinking": thinking} if thinking else {})}
        assert (await client.post("/v1/messages", json=body)).status == 200
        assert core.requests[-1].thinking_budget == budget  # (the stand-in tokenizer's </think> is id 4)
