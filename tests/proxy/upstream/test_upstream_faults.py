"""Replicas that misbehave, in front of which the proxy still answers in the API's shape and keeps its books:
a chunk not in the OpenAI shape is the replica's failure (the next one answers, or the status says none did),
an agent that leaves before a replica's headers leaves nothing in flight, and a replica that comes up after the
proxy says what it serves then."""
import asyncio

import aiohttp
import pytest
from aiohttp import web

from proxy.upstream.bench import free_port

MESSAGE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
GOOD = b'data: {"choices":[{"index":0,"delta":{"content":"fine"},"finish_reason":"stop"}]}\n\n'


def replica(mode: str, asked: list | None = None) -> web.Application:
    """A replica that answers as `mode` says; the models its requests name go to `asked`."""
    async def health(request):
        return web.json_response({"status": "ok"})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model",
                                                              "context_length": 4096}]})

    async def chat(request):
        if asked is not None:
            asked.append((await request.json())["model"])
        if mode == "busy":
            return web.json_response({"error": {"message": "busy"}}, status=429)
        if mode == "slow":
            await asyncio.sleep(3)  # before its headers, as a replica that sends them after the prefill
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":"oops"}]}\n\n' if mode == "malformed" else GOOD)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def _urls(aiohttp_server, *modes):
    return [str((await aiohttp_server(replica(m))).make_url("")).rstrip("/") for m in modes]


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
    assert pool.stats()["active"] == 0


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
