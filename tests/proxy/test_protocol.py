"""Protocol details with a stand-in engine (timing and shapes only; end-to-end behaviour is test_e2e.py)."""
import asyncio
import json
import re

import aiohttp
import anthropic
import openai
import pytest

from conftest import FORCED

TOOL_CALL = 'I will look.\\n<tool_call>\\n{"name": "bash", "arguments": {"cmd": "ls"}}\\n</tool_call>'


async def _server(aiohttp_server, fake_stack, **kw):
    app, core = fake_stack(**kw)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), core


def _events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


async def test_anthropic_keepalive_during_slow_prefill_is_an_empty_thinking_delta(aiohttp_client, fake_stack):
    """Claude Code's idle timeout skips pings: once message_start is out, a keep-alive of an answer that starts in
    thinking opens the thinking block and sends it empty deltas; the model's thinking then streams into that
    block, and the message is what it would have been with no wait."""
    app, core = fake_stack(prefill_s=1.0, keepalive_s=0.2)
    client = await aiohttp_client(app)
    resp = await client.post("/v1/messages", headers={FORCED: "Hm.\\n</think>\\n\\nok"}, json={
        "model": "m", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    events = _events(await resp.text())
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert events[2]["content_block"]["type"] == "thinking" and events[2]["index"] == 0
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    empties = [d for d in deltas if d == {"type": "thinking_delta", "thinking": ""}]
    assert len(empties) >= 4 and deltas[:len(empties)] == empties  # 1 s of prefill at 0.2 s, then the thinking
    assert "".join(d.get("thinking", "") for d in deltas) == "Hm."
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")] and kinds.count("ping") == 1
    assert kinds[-2:] == ["message_delta", "message_stop"]


async def test_an_empty_thinking_block_a_keep_alive_opened_changes_nothing_downstream(aiohttp_server, fake_stack,
                                                                                     sdk):
    """The SDK's message after keep-alive deltas equals the one with no wait; where the model then thought
    nothing, the block stays empty, and sent back in the next turn's history it counts as no thinking at all."""
    messages = [{"role": "user", "content": "hi"}]
    got = []
    for prefill_s in (0.0, 0.5):
        base, core = await _server(aiohttp_server, fake_stack, prefill_s=prefill_s, keepalive_s=0.1)
        client = sdk.anthropic(base, default_headers={FORCED: "Hm.\\n</think>\\n\\nok"})
        async with client.messages.stream(model="m", max_tokens=50, messages=messages) as stream:
            got.append((await stream.get_final_message()).content)
    assert got[0] == got[1] and [b.type for b in got[1]] == ["thinking", "text"]
    client = sdk.anthropic(base, default_headers={FORCED: "\\n</think>\\n\\nok"})
    async with client.messages.stream(model="m", max_tokens=50, messages=messages) as stream:
        empty = (await stream.get_final_message()).content
    assert [(b.type, getattr(b, "thinking", None)) for b in empty] == [("thinking", ""), ("text", None)]
    later = [{"role": "user", "content": "and?"}]
    counts = []
    for content in ([b.model_dump(exclude_none=True) for b in empty], [{"type": "text", "text": "ok"}]):
        history = messages + [{"role": "assistant", "content": content}] + later
        counts.append((await client.messages.count_tokens(model="m", messages=history)).input_tokens)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("thinking", [{"type": "disabled"}, None])
async def test_anthropic_keepalive_is_a_ping_where_no_block_can_take_it(aiohttp_client, fake_stack, thinking):
    """Thinking off: no block is opened for a keep-alive (an empty text block would be content), so it is a ping.
    Queued past QUEUED_START_S: message_start goes out before the admission (the whole prompt as input), then the
    keep-alives are the thinking block's empty deltas."""
    from proxy.apis.anthropic import handlers

    app, core = fake_stack(prefill_s=0.6, keepalive_s=0.1)
    client = await aiohttp_client(app)
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if thinking:
        body["thinking"] = thinking
    else:
        core.queue_s, handlers.QUEUED_START_S = 0.6, 0.25
    try:
        events = _events(await (await client.post("/v1/messages", json=body)).text())
    finally:
        handlers.QUEUED_START_S = 60.0
    kinds = [e["type"] for e in events]
    first_block = kinds.index("content_block_start")
    if thinking:
        assert kinds[0] == "message_start" and kinds[:first_block].count("ping") >= 4
        assert events[first_block]["content_block"]["type"] == "text"
    else:
        usage = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        assert kinds[0] == "ping" and "message_start" in kinds[:kinds.index("content_block_start")]
        assert usage["cache_read_input_tokens"] == 0 and usage["input_tokens"] > 0  # before the admission
        assert events[first_block]["content_block"]["type"] == "thinking"
        assert kinds.count("content_block_delta") >= 8  # queued 0.35 s more and prefilling 0.6 s, at 0.1 s
    assert kinds[-2:] == ["message_delta", "message_stop"]


async def test_chat_keepalive_comments_during_slow_prefill(aiohttp_client, fake_stack):
    app, core = fake_stack(prefill_s=1.0, keepalive_s=0.2)
    client = await aiohttp_client(app)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    text = await (await client.post("/v1/chat/completions", json=body)).text()
    assert text.count(": keep-alive\n\n") >= 4
    assert core.active == 0


async def test_responses_keepalive_is_an_in_progress_event(aiohttp_server, fake_stack, sdk):
    """Codex's stream idle timer (300 s by default) counts SSE events, not comments: a Responses stream's
    keep-alive is `response.in_progress` again, numbered in order, with the output items finished so far; the
    SDK's final response is the one a stream with no wait gives."""
    base, core = await _server(aiohttp_server, fake_stack, prefill_s=1.0, keepalive_s=0.2)
    async with aiohttp.ClientSession() as s:
        text = await (await s.post(base + "/v1/responses", json={"model": "m", "stream": True, "input": "hi"})).text()
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    kinds = [e["type"] for e in events]
    assert ": keep-alive" not in text and kinds[0] == "response.created"
    assert kinds.count("response.in_progress") >= 5 and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["response"]["status"] == "in_progress" for e in events if e["type"] == "response.in_progress")
    got = []
    for prefill_s in (1.0, 0.0):
        core.prefill_s = prefill_s
        async with sdk.openai(base).responses.stream(model="m", input="hi") as stream:
            final = await stream.get_final_response()
        got.append((final.status, final.output_text, [o.type for o in final.output]))
    assert got[0] == got[1] and got[0][0] == "completed"
    assert core.active == 0


async def test_client_disconnect_aborts_the_engine_request(aiohttp_server, fake_stack, sdk):
    base, core = await _server(aiohttp_server, fake_stack, prefill_s=30.0, keepalive_s=0.1)
    client = sdk.openai(base, api_key="x", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    for _ in range(50):
        if core.active == 0:
            break
        await asyncio.sleep(0.05)
    assert core.active == 0 and len(core.aborted) == 1


async def test_abandoned_request_is_499_in_log_recording_and_metrics(aiohttp_server, fake_stack, sdk, tmp_path,
                                                                     caplog):
    import logging

    from proxy.replay.record import Recorder

    base, core = await _server(aiohttp_server, fake_stack, prefill_s=30.0, keepalive_s=0.1, access_log=True,
                               observer=Recorder(tmp_path))
    client = sdk.openai(base, api_key="x", max_retries=0, timeout=0.5)
    with caplog.at_level(logging.INFO, logger="killick.access"):
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        for _ in range(50):
            if list(tmp_path.glob("*.jsonl")):
                break
            await asyncio.sleep(0.05)
        (line,) = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
        assert line["status"] == 499                              # the client left: not a server error
        assert "POST /v1/chat/completions 499" in caplog.text
        core.prefill_s = 0.0
        ok = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                  extra_headers={FORCED: "hello"}, timeout=30)
    (logged,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/chat/completions 200")]
    u = ok.usage
    cached = u.prompt_tokens_details.cached_tokens
    assert f"prompt={u.prompt_tokens} cached={cached} prefilled={u.prompt_tokens - cached} out=" in logged
    assert "ttft=" in logged and logged.endswith("ms")
    # the server's own times since arrival: the request made (prep), the engine's first token in the proxy
    # (tok1), the first output event (first), all of it; "hello" comes out with its first token (held=1)
    times = dict(re.findall(r" (prep|tok1|first)=(\d+)ms", logged))
    total = int(logged.rsplit(" ", 1)[1][:-2])
    assert set(times) == {"prep", "tok1", "first"}
    assert int(times["prep"]) <= int(times["tok1"]) <= int(times["first"]) <= total
    parts = dict(re.findall(r"[ (](render|plan)=(\d+)ms", logged))  # of prep: render + tokenize, then plan
    assert set(parts) == {"render", "plan"} and sum(map(int, parts.values())) <= int(times["prep"]) + 1
    assert " held=1 " in logged


async def test_the_access_line_of_a_request_failed_before_any_output_has_no_ttft(aiohttp_client, fake_stack,
                                                                                  caplog):
    """An engine (or every upstream replica) that fails before any output: the line says `error` beside the prompt
    tokens, not a TTFT or a prefill that never came; one failing mid-answer keeps its figures."""
    import logging

    app, core = fake_stack(access_log=True)
    client = await aiohttp_client(app)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with caplog.at_level(logging.INFO, logger="killick.access"):
        core.fail_admit = True
        assert (await client.post("/v1/chat/completions", json=body)).status == 500
        core.fail_next = True
        assert (await client.post("/v1/chat/completions", json=body)).status == 500
    before, mid = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/chat/completions")]
    assert re.fullmatch(r"POST /v1/chat/completions 500 prompt=\d+ error \d+ms", before), before
    assert int(re.search(r" out=(\d+) ", mid)[1]) > 0 and " ttft=" in mid and " error" not in mid


@pytest.mark.parametrize("agent,leave_after,hinted", [("claude-cli/2.1.197 (external, cli)", 1.3, True),
                                                      ("claude-cli/2.1.197 (external, cli)", 0.05, False),
                                                      ("OpenAI/Python 1.99", 1.3, False)])
async def test_claude_code_giving_up_a_silent_stream_is_a_warning_naming_the_fix(aiohttp_server, fake_stack,
                                                                                  monkeypatch, caplog, agent,
                                                                                  leave_after, hinted):
    """A Claude Code client that leaves a streamed request after its idle limit (here 1 s for 300) with no
    output sent yet (a long prefill: pings do not count for it) gets a warning naming `killick launch claude` and
    CLAUDE_STREAM_IDLE_TIMEOUT_MS; one leaving sooner, or another client, does not."""
    import logging

    from proxy import app as app_module

    monkeypatch.setattr(app_module, "CLAUDE_IDLE_ABORT_S", 1.0)
    app, core = fake_stack(prefill_s=5.0, keepalive_s=0.05)
    server = await aiohttp_server(app)
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with caplog.at_level(logging.WARNING, logger="killick.proxy"):
        async with aiohttp.ClientSession() as session:
            resp = await session.post(server.make_url("/v1/messages"), json=body, headers={"User-Agent": agent})
            assert (await resp.content.readline()).startswith(b"event: message_start")
            await asyncio.sleep(leave_after)
            resp.close()
        for _ in range(100):
            if core.aborted:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
    warned = [r.getMessage() for r in caplog.records if "Claude Code gave up" in r.getMessage()]
    assert core.aborted and len(warned) == int(hinted)
    if hinted:
        assert "killick launch claude" in warned[0] and "CLAUDE_STREAM_IDLE_TIMEOUT_MS=3600000" in warned[0]


async def test_access_log_counts_tokens_held_back_before_the_first_output(aiohttp_server, fake_stack, sdk, caplog):
    """The first output event leaves with the sixth token of "</think>\\n\\n<toolbox" (the thinking block's end
    and the blank line make no event, "<" and "<t" may open a tool call) and the access line says so (held=6),
    beside the first token's time, five 10 ms steps before it."""
    import logging

    base, core = await _server(aiohttp_server, fake_stack, step_s=0.01, access_log=True)
    client = sdk.openai(base, api_key="x", max_retries=0)
    with caplog.at_level(logging.INFO, logger="killick.access"):
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                      stream=True, extra_headers={FORCED: "</think>\\n\\n<toolbox"})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "<toolbox"
    (logged,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/chat/completions 200")]
    tok1, first = (int(v) for v in re.findall(r" (?:tok1|first)=(\d+)ms", logged))
    assert " held=6 " in logged and tok1 + 40 <= first


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 400, "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "m", "stream": False, "input": "hi"}),
])
@pytest.mark.parametrize("hang_up_after", [0.0, 0.5])
async def test_a_client_gone_mid_answer_is_no_server_error(aiohttp_server, fake_stack, caplog, path, body,
                                                           hang_up_after):
    """Hanging up before the server reads the request, or while the answer streams (a write fails) or is
    prepared whole (the next output event notices), aborts the engine request without an ERROR in the log."""
    base, core = await _server(aiohttp_server, fake_stack, prefill_s=0.3, step_s=0.05, keepalive_s=0.05)
    reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
    raw = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n{FORCED}: {'word ' * 300}\r\n\r\n".encode() + raw)
    await writer.drain()
    await asyncio.sleep(hang_up_after)  # 0.5: past the prefill, the answer is coming
    writer.transport.abort()
    for _ in range(100):
        if core.active == 0:
            break
        await asyncio.sleep(0.05)
    assert core.active == 0 and {r.request_id for r in core.requests} == set(core.aborted)  # none ran on
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_full_queue_answers_429_in_each_shape(aiohttp_client, fake_stack):
    app, core = fake_stack(prefill_s=2.0, keepalive_s=0.1)
    client = await aiohttp_client(app)
    msg = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    busy = [asyncio.ensure_future(client.post("/v1/messages", json=msg)) for _ in range(4)]
    await asyncio.sleep(0.2)
    resp = await client.post("/v1/messages", json=msg)
    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1 and "x-should-retry" not in resp.headers
    assert (await resp.json())["error"]["type"] == "rate_limit_error"
    resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": msg["messages"]})
    assert resp.status == 429 and (await resp.json())["error"]["code"] == "rate_limit_exceeded"
    assert int(resp.headers["Retry-After"]) >= 1
    for r in await asyncio.gather(*busy):
        assert r.status == 200


async def test_api_key_bearer_and_x_api_key(aiohttp_server, fake_stack, sdk):
    base, _ = await _server(aiohttp_server, fake_stack, api_key="sekrit")
    good_a = sdk.anthropic(base, api_key="sekrit", max_retries=0)
    await good_a.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    good_o = sdk.openai(base, api_key="sekrit", max_retries=0)
    await good_o.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError) as err:
        await sdk.anthropic(base, api_key="bad", max_retries=0).messages.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        await sdk.openai(base, api_key="bad", max_retries=0).models.list()


async def test_a_refusal_the_same_request_meets_again_says_not_to_retry(aiohttp_client, fake_stack):
    """x-should-retry: false, as Anthropic's API sends it, on a 4xx a retry cannot change: without it Claude Code
    retries a wrong key's 401 with backoff for minutes before it says anything."""
    app, _ = fake_stack(api_key="k", context_length=64)
    client = await aiohttp_client(app)
    msg = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    key = {"x-api-key": "k"}
    for path, body, headers, status in (
            ("/v1/messages", msg, {"x-api-key": "wrong"}, 401),
            ("/v1/chat/completions", msg, {"Authorization": "Bearer wrong"}, 401),
            ("/v1/messages", {**msg, "max_tokens": "x"}, key, 400),
            ("/v1/messages", {**msg, "messages": [{"role": "user", "content": "word " * 100}]}, key, 400),
            ("/v1/nope", msg, key, 404)):
        resp = await client.post(path, json=body, headers=headers)
        assert resp.status == status and resp.headers.get("x-should-retry") == "false", (path, status)


async def test_health_is_open_but_everything_else_needs_the_key(aiohttp_client, fake_stack):
    app, _ = fake_stack(api_key="k")
    client = await aiohttp_client(app)
    assert (await client.get("/health")).status == 200
    assert (await client.head("/")).status == 401
    assert (await client.head("/", headers={"x-api-key": "k"})).status == 200
    assert (await client.get("/metrics", headers={"Authorization": "Bearer k"})).status == 200


async def test_bearer_scheme_in_any_case_and_key_bytes_that_are_not_utf8(aiohttp_client, fake_stack, monkeypatch):
    app, _ = fake_stack(api_key="k")
    client = await aiohttp_client(app)
    for auth in ("Bearer k", "bearer k", "BEARER  k"):
        assert (await client.get("/v1/models", headers={"Authorization": auth})).status == 200
    for bad in ("Bearer kk", "Basic k", "bearerk"):
        assert (await client.get("/v1/models", headers={"Authorization": bad})).status == 401
    # a 0xFF byte in the key header: refused, not a 500
    resp = await client.get("/v1/models", headers={"x-api-key": b"\xffk".decode("latin-1")})
    assert resp.status == 401


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "user": "a\r\nX-Evil: 1\x00b", "messages": [{"role": "user",
                                                                                       "content": "hi"}]}),
    ("/v1/responses", {"model": "m", "prompt_cache_key": "k\r\n\x00é", "input": "hi"}),
    ("/v1/messages", {"model": "m", "max_tokens": 3, "metadata": {"user_id": "u\n\r\x00"}, "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_control_characters_in_session_ids_do_not_break_the_answer(aiohttp_client, fake_stack, path, body):
    from proxy.policy.cache_policy import PolicyPlanner

    app, core = fake_stack(planner=PolicyPlanner())
    client = await aiohttp_client(app)
    resp = await client.post(path, json=body)
    assert resp.status == 200 and await resp.read()
    session = resp.headers["x-killick-session"]
    assert session.isprintable() and session.isascii() and "%00" in session  # percent-encoded, not dropped
    assert "X-Evil" not in resp.headers


async def test_stop_sequence_ends_the_answer(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    body = {"model": "m", "max_tokens": 50, "stop_sequences": ["END"], "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/messages", json=body, headers={FORCED: "one two END three"})
    out = await resp.json()
    assert out["stop_reason"] == "stop_sequence" and out["stop_sequence"] == "END"
    assert out["content"] == [{"type": "text", "text": "one two"}]
    assert core.aborted  # the engine stopped generating at the stop sequence


async def test_previous_response_id_and_store_false(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    first = await (await client.post("/v1/responses", json={"model": "m", "input": "first question"},
                                     headers={FORCED: "first answer"})).json()
    second = await client.post("/v1/responses", json={"model": "m", "input": "second",
                                                      "previous_response_id": first["id"], "store": False})
    assert second.status == 200
    prompt = core.tok.decode(core.requests[-1].prompt_ids)
    assert "first question" in prompt and "first answer" in prompt and "second" in prompt
    unstored = (await second.json())["id"]
    third = await client.post("/v1/responses", json={"model": "m", "input": "x", "previous_response_id": unstored})
    assert third.status == 400
    assert (await third.json())["error"]["param"] == "previous_response_id"


async def test_encrypted_reasoning_round_trips(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    out = await (await client.post(
        "/v1/responses", json={"model": "m", "input": "q", "store": False, "include": ["reasoning.encrypted_content"]},
        headers={FORCED: "secret plan\\n</think>\\n\\nanswer"})).json()
    reasoning = out["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]
    reasoning.pop("content")  # an agent may send back only the opaque part
    follow = [{"role": "user", "content": "q"}, reasoning, out["output"][1], {"role": "user", "content": "next"}]
    assert (await client.post("/v1/responses", json={"model": "m", "input": follow})).status == 200
    assert "secret plan" in core.tok.decode(core.requests[-1].prompt_ids)


async def test_models_root_and_metrics(aiohttp_client, fake_stack):
    app, _ = fake_stack(context_length=1234)
    client = await aiohttp_client(app)
    assert (await client.head("/")).status == 200
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["context_length"] == 1234
    assert models["data"][0]["max_input_tokens"] == models["data"][0]["max_tokens"] == 1233
    await client.post("/v1/chat/completions", json={"model": "gpt-5", "messages": [{"role": "user", "content": "q"}]})
    text = await (await client.get("/metrics")).text()
    assert 'killick_requests_total{api="chat",status="200"} 1' in text
    assert "killick_ttft_seconds_count 1" in text and "killick_engine_cache_hits 1" in text
    assert "killick_prepare_seconds_count 1" in text and "killick_first_output_seconds_count 1" in text
    assert "killick_first_token_seconds_count 1" in text
    sums = {k: float(v) for k, v in re.findall(r"^killick_(prepare|first_token|first_output)_seconds_sum (\S+)$",
                                               text, re.M)}
    assert 0 < sums["prepare"] <= sums["first_token"] <= sums["first_output"]


async def test_tool_call_streams_in_every_api(aiohttp_server, fake_stack, sdk):
    base, _ = await _server(aiohttp_server, fake_stack)
    headers = {FORCED: TOOL_CALL}
    a = sdk.anthropic(base, default_headers=headers)
    async with a.messages.stream(model="m", max_tokens=200, messages=[{"role": "user", "content": "hi"}],
                                 thinking={"type": "disabled"},
                                 tools=[{"name": "bash", "input_schema": {"type": "object"}}]) as s:
        msg = await s.get_final_message()
    assert msg.stop_reason == "tool_use" and msg.content[-1].input == {"cmd": "ls"}
    o = sdk.openai(base, default_headers=headers)
    chunks = [c async for c in await o.chat.completions.create(
        model="m", stream=True, messages=[{"role": "user", "content": "hi"}], reasoning_effort="none",
        tools=[{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}])]
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert calls[0].id and calls[0].function.name == "bash" and len(calls) > 2   # id + name, then pieces
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"cmd": "ls"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    async with o.responses.stream(model="m", input="hi", reasoning={"effort": "none"},
                                  tools=[{"type": "function", "name": "bash", "parameters": {"type": "object"}}]) as s:
        final = await s.get_final_response()
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"cmd": "ls"}


async def test_responses_custom_tool_round_trip(aiohttp_client, fake_stack):
    """Codex's freeform tools (type "custom"): called with raw input, results come back as custom items."""
    app, core = fake_stack()
    client = await aiohttp_client(app)
    patch = '<tool_call>\\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}\\n</tool_call>'
    tools = [{"type": "custom", "name": "apply_patch", "description": "edit files", "format": {"type": "text"}}]
    out = await (await client.post("/v1/responses", json={"model": "m", "input": "fix it", "tools": tools,
                                                          "reasoning": {"effort": "none"}},
                                   headers={FORCED: patch})).json()
    call = out["output"][0]
    assert call["type"] == "custom_tool_call" and call["input"] == "*** Begin Patch"
    follow = [{"role": "user", "content": "fix it"}, call,
              {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done!"}]
    resp = await client.post("/v1/responses", json={"model": "m", "input": follow, "tools": tools})
    assert resp.status == 200
    prompt = core.tok.decode(core.requests[-1].prompt_ids)
    assert '"input": "*** Begin Patch"' in prompt and "Done!" in prompt


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
async def test_tool_call_arguments_stream_while_they_are_written(aiohttp_client, fake_stack, path):
    app, core = fake_stack(step_s=0.01, keepalive_s=5.0)
    client = await aiohttp_client(app)
    text = "x" * 100
    call = '<tool_call>\\n{"name": "write", "arguments": {"text": "' + text + '"}}\\n</tool_call>'
    body = {"/v1/messages": {"max_tokens": 500, "thinking": {"type": "disabled"},
                             "tools": [{"name": "write", "input_schema": {"type": "object"}}],
                             "messages": [{"role": "user", "content": "hi"}]},
            "/v1/chat/completions": {"reasoning_effort": "none", "messages": [{"role": "user", "content": "hi"}],
                                     "tools": [{"type": "function", "function": {"name": "write"}}]},
            "/v1/responses": {"reasoning": {"effort": "none"}, "input": "hi",
                              "tools": [{"type": "function", "name": "write"}]}}[path]
    resp = await client.post(path, headers={FORCED: call}, json={"model": "m", "stream": True, **body})
    pieces, arrived = [], []
    async for raw in resp.content:  # one decoded character per 10 ms: pieces arrive spread over ~1 s
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        data = json.loads(line[6:])
        piece = (data.get("delta", {}).get("partial_json") if data.get("type") == "content_block_delta" else
                 data.get("delta") if data.get("type") == "response.function_call_arguments.delta" else
                 next((tc["function"].get("arguments") for c in data.get("choices", ())
                       for tc in c["delta"].get("tool_calls", ())), None))
        if piece:
            pieces.append(piece)
            arrived.append(asyncio.get_running_loop().time())
    assert json.loads("".join(pieces)) == {"text": text}
    assert len(pieces) > 50 and arrived[-1] - arrived[0] > 0.5   # incremental, not one delta at the end


class RecordingPlanner:
    """Checks the seam's calls and order; the real policy is proxy/policy/cache_policy.PolicyPlanner."""

    def __init__(self):
        self.calls = []

    def normalize(self, conv, headers, request=None):
        self.calls.append(("normalize", request["model"]))
        return conv

    def __call__(self, conv, rendered, headers, request=None):
        self.calls.append(("plan", len(rendered.ids)))
        from proxy.policy.planner import Plan
        return Plan((3, len(rendered.ids) - 1), headers.get("x-session-id"))

    def admit(self, turn):
        self.calls.append(("admit", turn.session_key))
        return turn

    def finish(self, turn, output_ids, usage=None):
        self.calls.append(("finish", turn.session_key, len(output_ids), usage.output_tokens))

    def stats(self):
        return {"sessions": 1, "turns": {"append": 2}}


async def test_planner_seam_normalize_plan_admit_finish(aiohttp_client, fake_stack):
    from proxy.app import create_app
    from proxy_fakes import ChatMLRenderer

    _, core = fake_stack()
    planner = RecordingPlanner()
    app = create_app(core, core.tok, ChatMLRenderer(core.tok), context_length=4096, planner=planner)
    client = await aiohttp_client(app)
    resp = await client.post("/v1/chat/completions", headers={"x-session-id": "s1"},
                             json={"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200
    n = len(core.requests[-1].prompt_ids)
    assert core.requests[-1].checkpoint_positions == (3, n - 1) and core.requests[-1].session_key == "s1"
    assert planner.calls == [("normalize", "gpt-5"), ("plan", n), ("admit", "s1"), ("finish", "s1", 3, 3)]  # "ok" + EOS
    text = await (await client.get("/metrics")).text()
    assert "killick_policy_sessions 1" in text and "killick_policy_turns_append 2" in text


async def test_a_failing_planner_costs_no_answer(aiohttp_client, fake_stack, caplog):
    class Broken(RecordingPlanner):
        def __call__(self, conv, rendered, headers, request=None):
            raise KeyError("bug")

    app, core = fake_stack(planner=Broken())
    client = await aiohttp_client(app)
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 3,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200 and core.requests[-1].checkpoint_positions == ()
    assert "cache policy failed to plan" in caplog.text


async def test_parallel_tool_calls_false_stops_after_the_first_call(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    two = ('<tool_call>\\n{"name": "bash", "arguments": {"cmd": "ls"}}\\n</tool_call>\\n'
           '<tool_call>\\n{"name": "bash", "arguments": {"cmd": "pwd"}}\\n</tool_call>')
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    body = {"model": "m", "tools": tools, "reasoning_effort": "none", "messages": [{"role": "user", "content": "q"}]}
    out = await (await client.post("/v1/chat/completions", headers={FORCED: two}, json=body)).json()
    assert len(out["choices"][0]["message"]["tool_calls"]) == 2
    out = await (await client.post("/v1/chat/completions", headers={FORCED: two},
                                   json={**body, "parallel_tool_calls": False})).json()
    calls = out["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"cmd": "ls"}]
    assert out["choices"][0]["finish_reason"] == "tool_calls" and len(core.aborted) == 1
