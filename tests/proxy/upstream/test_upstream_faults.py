"""Replicas that misbehave, in front of which the proxy still answers in the API's shape and keeps its books:
a chunk not in the OpenAI shape is the replica's failure (the next one answers, or the status says none did),
an agent that leaves before a replica's headers leaves nothing in flight, a replica that comes up after the
proxy says what it serves then, and a replica that stalls loses its requests as soon as its health check fails
while one that is slow but healthy keeps them, as does one whose health check fails while it streams."""
import asyncio
import json
from typing import NamedTuple

import aiohttp
import pytest
from aiohttp import web

from proxy.cli.ctl import _render_stats
from proxy.upstream.bench import free_port

MESSAGE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
GOOD = b'data: {"choices":[{"index":0,"delta":{"content":"fine"},"finish_reason":"stop"}]}\n\n'
PART = b'data: {"choices":[{"index":0,"delta":{"content":"Hello, "},"finish_reason":null}]}\n\n'
SLOW_S = 1.0  # a "slow" replica's silences: several health intervals, far below the read timeout
WORDS = [f"w{i} " for i in range(16)]  # a "generating" replica's answer, one word every TICK_S
TICK_S = 0.1
PROMPT = aiohttp.ClientTimeout(total=5)  # far below the read timeout (600 s): only the health check ends a stall


def replica(mode: str, asked: list | None = None, hung_up: asyncio.Event | None = None) -> web.Application:
    """A replica that answers as `mode` says; the models its requests name go to `asked`. "hang" stops before
    its headers and "hang-mid" after its first chunk, as a stopped process: from then on its /health does not
    answer either; `hung_up` is set when the proxy closes the stalled connection. "slow" is healthy but silent
    for SLOW_S before its headers and again mid-answer, as a server that sends no keep-alives. "generating" streams
    WORDS, and while it does its /health answers after SLOW_S, as a loaded server's. "thinks" thinks past any
    thinking budget and refuses to continue a turn. "no-parser" sends its thinking as content, up to </think>,
    as a server without a reasoning parser does where the prompt opened the thinking."""
    hung, generating = asyncio.Event(), asyncio.Event()

    async def hang():  # inside an answer
        hung.set()
        try:
            await asyncio.sleep(3600)  # until the peer hangs up (the test server cancels the handler)
        finally:
            if hung_up is not None:
                hung_up.set()

    def refused():
        return web.json_response({"error": {"message": "invalid API key"}}, status=401)

    async def health(request):
        if hung.is_set():
            await asyncio.sleep(3600)  # until the health check gives up and hangs up
        if generating.is_set():
            await asyncio.sleep(SLOW_S)  # past the health check's timeout
        return web.json_response({"status": "ok"})

    async def models(request):
        if mode == "keyed":
            return refused()
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model",
                                                              "context_length": 4096}]})

    async def chat(request):
        body = await request.json()
        if asked is not None:
            asked.append(body["model"])
        if mode == "thinks" and body.get("continue_final_message"):  # a server that cannot continue a turn
            return web.json_response({"error": {"message": "continue_final_message is not supported"}}, status=400)
        if mode == "keyed":  # a replica started with --api-key: killick serve was not given it
            return refused()
        if mode == "busy":
            return web.json_response({"error": {"message": "busy"}}, status=429)
        if mode == "hang":
            await hang()
        if mode == "slow":
            await asyncio.sleep(SLOW_S)  # before its headers, as a replica that sends them after the prefill
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "thinks":  # thinking without end, a token a chunk
            for _ in range(1100):
                await resp.write(b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"7"}}]}\n\n')
        if mode in ("hang-mid", "slow"):
            await resp.write(PART)
            await (hang() if mode == "hang-mid" else asyncio.sleep(SLOW_S))
        if mode == "no-parser":
            for piece in ("Need", " ls.</th", "ink>\n\n"):
                await resp.write(_chunk(piece))
        if mode == "generating":
            generating.set()
            try:
                for word in WORDS:
                    await resp.write(_chunk(word))
                    await asyncio.sleep(TICK_S)
            finally:
                generating.clear()
        await resp.write(b'data: {"choices":[{"index":0,"delta":"oops"}]}\n\n' if mode == "malformed" else GOOD)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _chunk(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                               "finish_reason": None}]}).encode() + b"\n\n"


async def _url(aiohttp_server, app: web.Application) -> str:
    return str((await aiohttp_server(app)).make_url("")).rstrip("/")


async def _urls(aiohttp_server, *modes):
    return [await _url(aiohttp_server, replica(m)) for m in modes]


@pytest.mark.parametrize("modes, status, kind", [(("malformed", "busy"), 429, "rate_limit_error"),
                                                 (("malformed",), 503, "overloaded_error"),
                                                 (("malformed", "good"), 200, None)])
async def test_a_chunk_not_in_the_openai_shape_fails_that_replica_over(aiohttp_server, upstream_front, modes, status,
                                                                       kind):
    base, pool = await upstream_front(await _urls(aiohttp_server, *modes), routing="round-robin")
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/messages", json=MESSAGE) as r:
            body = await r.json()
    assert r.status == status, body
    if kind:
        assert body["error"]["type"] == kind and "no upstream replica answered" in body["error"]["message"]
    else:
        assert body["content"][0]["text"] == "fine"
    stats = pool.stats()
    assert stats["active"] == 0 and stats["failures"] == len(modes) - (status == 200)
    assert stats["retries"] == len(modes) - 1  # each move to another replica; none once no replica is left


async def test_a_replica_that_cannot_continue_after_the_thinking_budget_ends_the_answer_with_an_error(
        aiohttp_server, upstream_front):
    """The thinking reached thinking.budget_tokens, and the replica refused to continue the turn after it (a 400 to
    continue_final_message): the streamed answer ends with an error event naming why, after the thinking it had;
    the replica is not marked down (it answered) and nothing stays in flight."""
    base, pool = await upstream_front([await _url(aiohttp_server, replica("thinks"))])
    ask = {**MESSAGE, "max_tokens": 2048, "stream": True, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/messages", json=ask) as r:
            assert r.status == 200
            text = await r.text()
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    thought = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    assert thought == "7" * 1024
    assert events[-1]["type"] == "error" and "continue_final_message is not supported" in events[-1]["error"]["message"]
    stats = pool.stats()
    assert stats["active"] == 0 and stats["failures"] == 0 and all(r["healthy"] for r in stats["replicas"])


@pytest.mark.parametrize("reasoning", ["content", "auto", "parsed"])
async def test_a_replica_without_a_reasoning_parser_has_its_thinking_split_as_configured(aiohttp_server,
                                                                                         upstream_front, reasoning):
    """--upstream-reasoning content (or auto, learned from the first answer) splits the thinking a replica without
    a reasoning parser sends as content at its </think>: the agent gets a thinking block and the answer, streamed
    or not; parsed (the default) passes the content on as the answer, as the replica wrote it."""
    url = await _url(aiohttp_server, replica("no-parser"))
    base, pool = await upstream_front([url], reasoning=reasoning)
    ask = {**MESSAGE, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/messages", json=ask) as r:
            body = await r.json()
        async with s.post(base + "/v1/messages", json={**ask, "stream": True}) as r:
            events = [json.loads(line[5:]) for line in (await r.text()).splitlines() if line.startswith("data:")]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    streamed = ("".join(d.get("thinking", "") for d in deltas), "".join(d.get("text", "") for d in deltas))
    if reasoning == "parsed":
        assert [b["type"] for b in body["content"]] == ["text"] and "</think>" in body["content"][0]["text"]
        assert streamed[0] == "" and "</think>" in streamed[1]
    else:
        assert [(b["type"], b.get("thinking", b.get("text"))) for b in body["content"]] == [
            ("thinking", "Need ls."), ("text", "fine")]
        assert streamed == ("Need ls.", "fine")
        assert body["usage"]["output_tokens"] > 0
    found = "content" if reasoning != "parsed" else "parsed"
    assert pool.stats()["reasoning"] == {url: found}
    rendered = _render_stats({"engine": pool.stats(), "policy": {}}).splitlines()  # `killick ctl stats`
    assert any(line.startswith(url) and line.split()[-1] == found for line in rendered)


@pytest.mark.parametrize("fault", ["refused", "busy"])
async def test_a_replica_that_fails_at_connect_time_counts_a_failure_and_a_retry(aiohttp_server, upstream_front,
                                                                                 fault):
    """A replica refused at connect (its process gone, the health check not there yet) or answering 429: the
    request goes to the next replica, and the counters say so, on /metrics too."""
    bad_server = await aiohttp_server(replica("good" if fault == "refused" else "busy"))
    bad = str(bad_server.make_url("")).rstrip("/")
    good = await _url(aiohttp_server, replica("good"))
    base, pool = await upstream_front([bad, good], health_interval_s=60)
    key = next(k for k in (f"s{i}" for i in range(1000)) if pool.router.order(k)[0].url == bad)
    if fault == "refused":
        await asyncio.sleep(0.3)  # the health check's first round passed; the next one is a minute away
        await bad_server.close()
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/messages", json=MESSAGE, headers={"x-session-id": key}) as r:
            assert r.status == 200 and (await r.json())["content"][0]["text"] == "fine"
        async with s.get(base + "/metrics") as r:
            metrics = await r.text()
    stats = pool.stats()
    assert (stats["requests"], stats["failures"], stats["retries"], stats["active"]) == (2, 1, 1, 0)
    assert "killick_engine_retries 1" in metrics.splitlines() and "killick_engine_failures 1" in metrics.splitlines()
    assert "up, failures 1, retries 1, session moves 0" in _render_stats({"engine": stats, "policy": {}})


async def test_an_agent_that_leaves_before_the_replicas_headers_leaves_nothing_in_flight(aiohttp_server,
                                                                                          upstream_front):
    base, pool = await upstream_front(await _urls(aiohttp_server, "slow"))
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            with pytest.raises(asyncio.TimeoutError):
                await s.post(base + "/v1/messages", json=MESSAGE, timeout=aiohttp.ClientTimeout(total=0.3))
    for _ in range(50):  # the front sees each hang-up as its handler is cancelled
        if pool.stats()["active"] == 0:
            break
        await asyncio.sleep(0.1)
    assert pool.stats()["active"] == 0 and pool.stats()["replicas"][0]["in_flight"] == 0


async def test_what_no_replica_said_at_start_comes_from_the_first_one_up(aiohttp_server, upstream_front):
    """Started before its replica (vLLM refuses model names it does not serve): once one is up its model is what
    requests name, and /v1/models shows its name and window."""
    from proxy.upstream.pool import Unknown

    port = free_port()
    base, pool = await upstream_front([f"http://127.0.0.1:{port}"], unknown=Unknown(True, True, True))
    asked = []
    await aiohttp_server(replica("good", asked), port=port)
    for _ in range(50):
        if pool.config.default_model:
            break
        await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", json={"model": "gpt-x", "messages": [
                {"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "fine"
        async with s.get(base + "/v1/models") as r:
            entry = (await r.json())["data"][0]
    assert asked == ["fake"] and entry["id"] == "fake" and entry["context_length"] == 4096


STREAMS = {  # each API's streamed request, and the message of the error event that ends a stream (else None)
    "anthropic": ("/v1/messages", {**MESSAGE, "stream": True},
                  lambda ev: ev.get("type") == "error" and ev["error"]["message"]),
    "chat": ("/v1/chat/completions", {**MESSAGE, "stream": True}, lambda ev: "error" in ev and ev["error"]["message"]),
    "responses": ("/v1/responses", {"model": "m", "stream": True, "input": "hi"},
                  lambda ev: ev.get("type") == "response.failed" and ev["response"]["error"]["message"]),
}


@pytest.fixture
def quick_health(monkeypatch):
    """A health check gives up on a replica after 0.5 s (5 s in service): a stalled replica is down sooner."""
    monkeypatch.setattr("proxy.upstream.pool.HEALTH_TIMEOUT_S", 0.5)


class Pair(NamedTuple):
    """The proxy in front of a replica of some mode and a good one, and a session whose first choice is the
    former."""

    base: str
    pool: object  # the app's UpstreamPool
    first: str  # URL of the replica of that mode
    good: str
    key: str  # the session (x-session-id)
    hung_up: asyncio.Event  # set when the proxy closes a stalled connection there


async def _pair(aiohttp_server, upstream_front, mode: str) -> Pair:
    hung_up = asyncio.Event()
    first = await _url(aiohttp_server, replica(mode, hung_up=hung_up))
    good = await _url(aiohttp_server, replica("good"))
    base, pool = await upstream_front([first, good], health_interval_s=0.2)
    key = next(k for k in (f"s{i}" for i in range(1000)) if pool.router.order(k)[0].url == first)
    return Pair(base, pool, first, good, key, hung_up)


def _route(pool, key: str) -> dict:
    return next(s for s in pool.stats()["recent_sessions"] if s["session"] == key)


async def test_a_replica_that_stalls_before_its_headers_hands_the_request_on_when_its_health_check_fails(
        aiohttp_server, upstream_front, quick_health):
    t = await _pair(aiohttp_server, upstream_front, "hang")
    async with aiohttp.ClientSession(timeout=PROMPT) as s:
        async with s.post(t.base + "/v1/messages", json=MESSAGE, headers={"x-session-id": t.key}) as r:
            body = await r.json()
    assert r.status == 200 and body["content"][0]["text"] == "fine"
    await asyncio.wait_for(t.hung_up.wait(), 1)  # the proxy closed the stalled connection
    stats = t.pool.stats()
    assert (stats["active"], stats["failures"], stats["replicas_up"]) == (0, 1, 1) and not t.pool.calls
    assert [r["in_flight"] for r in stats["replicas"]] == [0, 0] and _route(t.pool, t.key)["replica"] == t.good


@pytest.mark.parametrize("api", STREAMS)
async def test_a_replica_that_stalls_mid_answer_ends_the_stream_in_the_apis_shape_when_its_health_check_fails(
        aiohttp_server, upstream_front, quick_health, api):
    path, body, error_of = STREAMS[api]
    t = await _pair(aiohttp_server, upstream_front, "hang-mid")
    async with aiohttp.ClientSession(timeout=PROMPT) as s:
        async with s.post(t.base + path, json=body, headers={"x-session-id": t.key}) as r:
            events = [json.loads(line[5:]) async for line in r.content if line.startswith(b"data: {")]
        errors = [m for m in map(error_of, events) if m]
        assert r.status == 200 and "Hello" in json.dumps(events[:-1]) and errors == [error_of(events[-1])]
        assert f"upstream {t.first} failed mid-answer (marked down, health check: timed out)" in errors[0]
        await asyncio.wait_for(t.hung_up.wait(), 1)
        assert t.pool.stats()["active"] == 0 and not t.pool.calls
        async with s.post(t.base + "/v1/messages", json=MESSAGE, headers={"x-session-id": t.key}) as r:
            assert (await r.json())["content"][0]["text"] == "fine"  # the session goes on elsewhere
    assert (_route(t.pool, t.key)["replica"], _route(t.pool, t.key)["moves"]) == (t.good, 1)
    assert t.pool.stats()["active"] == 0


async def test_a_replica_that_is_slow_but_healthy_keeps_its_request(aiohttp_server, upstream_front, quick_health):
    """Silent for several health intervals before its headers and again mid-answer (a long prefill on a server
    without keep-alives) while its health check passes: the whole answer comes from it."""
    base, pool = await upstream_front(await _urls(aiohttp_server, "slow"), health_interval_s=0.2)
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/messages", json=MESSAGE) as r:
            body = await r.json()
    assert r.status == 200 and body["content"][0]["text"] == "Hello, fine", body
    stats = pool.stats()
    assert (stats["active"], stats["failures"], stats["retries"], stats["replicas_up"]) == (0, 0, 0, 1)


async def test_a_replica_whose_health_check_times_out_while_it_streams_finishes_the_answer(
        aiohttp_server, upstream_front, quick_health):
    """Busy generating, its /health answers after the check gave up: the replica is out of rotation for new
    requests, and the answer it is streaming is neither cut nor failed over: the agent gets all of it."""
    path, body, error_of = STREAMS["anthropic"]
    t = await _pair(aiohttp_server, upstream_front, "generating")
    busy = next(r for r in t.pool.router.replicas if r.url == t.first)
    events, seen_down = [], False
    async with aiohttp.ClientSession(timeout=PROMPT) as s:
        async with s.post(t.base + path, json=body, headers={"x-session-id": t.key}) as r:
            async for line in r.content:
                seen_down = seen_down or not busy.healthy
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[5:]))
    text = "".join(ev["delta"].get("text", "") for ev in events if ev["type"] == "content_block_delta")
    assert r.status == 200 and not [m for m in map(error_of, events) if m], events
    assert text == "".join(WORDS) + "fine" and events[-1]["type"] == "message_stop"
    assert seen_down  # the health check timed out while the answer streamed
    stats = t.pool.stats()
    assert (stats["active"], stats["failures"], stats["retries"]) == (0, 0, 0) and not t.pool.calls
    assert (_route(t.pool, t.key)["replica"], _route(t.pool, t.key)["moves"]) == (t.first, 0)


async def test_a_replica_that_refuses_killicks_key_names_the_flag_that_gives_it(aiohttp_server, upstream_front,
                                                                                caplog):
    """Not the agent's key: a 401 from the replica tells the agent to start serve with --upstream-api-key, as a 502
    (the gateway's fault) that a retry does not change, and serve says so at start."""
    from proxy.upstream.app import discover
    from proxy.upstream.config import UpstreamConfig

    (url,) = await _urls(aiohttp_server, "keyed")
    assert await asyncio.to_thread(discover, UpstreamConfig((url,))) == (None, None)
    assert f"{url} refused killick's key (HTTP 401)" in caplog.text and "--upstream-api-key" in caplog.text
    base, pool = await upstream_front([url])
    async with aiohttp.ClientSession() as s:
        for path, body in (("/v1/messages", MESSAGE), ("/v1/chat/completions", MESSAGE)):
            async with s.post(base + path, json=body) as r:
                error = (await r.json())["error"]
                assert r.status == 502 and r.headers["x-should-retry"] == "false", error
                assert "--upstream-api-key" in error["message"] and "invalid API key" in error["message"]
    assert pool.stats()["active"] == 0 and pool.stats()["replicas"][0]["in_flight"] == 0
