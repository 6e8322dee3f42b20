"""Request bodies: JSON only, bounded in bytes, time and nesting; every refusal in the route's error shape."""
import asyncio
import json

import pytest

import proxy.body
from test_errors import anthropic_error, openai_error

MSG = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/messages": {"model": "m", "max_tokens": 3, "messages": MSG},
    "/v1/messages/count_tokens": {"model": "m", "messages": MSG},
    "/v1/chat/completions": {"model": "m", "max_tokens": 3, "messages": MSG},
    "/v1/responses": {"model": "m", "max_output_tokens": 3, "input": "hi"},
}
SHAPES = {path: anthropic_error if path.startswith("/v1/messages") else openai_error for path in BODIES}


def _shape(path, body):
    return SHAPES[path](body)


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
async def test_a_body_that_is_not_declared_json_is_415(aiohttp_client, fake_stack, path, content_type):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    headers = {"Content-Type": content_type} if content_type else {"Content-Type": ""}
    resp = await client.post(path, data=json.dumps(BODIES[path]), headers=headers)
    assert resp.status == 415 and "application/json" in _shape(path, await resp.json())["message"]
    assert core.requests == []


@pytest.mark.parametrize("path", BODIES)
async def test_json_variants_are_accepted(aiohttp_client, fake_stack, path):
    client = await aiohttp_client(fake_stack()[0])
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        resp = await client.post(path, data=json.dumps(BODIES[path]), headers={"Content-Type": content_type})
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 3, "system": "\udfff", "messages": MSG}),
    ("/v1/messages", {"model": "\ud800", "max_tokens": 3, "stream": True, "messages": MSG}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/chat/completions", {"model": "\ud800", "stream": True, "messages": MSG}),
    ("/v1/responses", {"model": "m", "input": "\ud800"}),
    ("/v1/responses", {"model": "m", "instructions": "\ud800", "input": "x"}),
    ("/v1/responses", {"model": "m", "input": "x", "metadata": {"\ud800": "key"}}),
])
async def test_lone_surrogates_are_400_before_anything_runs(aiohttp_client, fake_stack, path, body):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    resp = await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "surrogate" in _shape(path, await resp.json())["message"]
    assert core.requests == []
    ok = await client.post(path, json=BODIES[path])  # a surrogate pair is fine
    assert ok.status == 200


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("raw", [
    b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b', "messages": []}',
    b'{"model": "m", "x": ' + b"[" * 100 + b"]" * 100 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
])
async def test_huge_numbers_and_deep_nesting_are_400(aiohttp_client, fake_stack, path, raw):
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400 and _shape(path, await resp.json())["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 990 + "]" * 990}}]}, *MSG]}),
    ("/v1/responses", {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                 "arguments": '{"a": "\\ud800"}'}, "x"]}),
    ("/v1/chat/completions", {"model": "m", "seed": 2**64, "messages": MSG}),
])
async def test_arguments_and_seeds_out_of_range_are_400(aiohttp_client, fake_stack, path, body):
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post(path, json=body)
    assert resp.status == 400, await resp.text()
    ok = {**body, "seed": 2**64 - 1} if "seed" in body else None
    if ok:
        assert (await client.post(path, json=ok)).status == 200


async def test_too_large_is_413_before_the_body_is_read(aiohttp_client, fake_stack, monkeypatch):
    monkeypatch.setattr(proxy.body, "MAX_BODY", 1000)
    client = await aiohttp_client(fake_stack()[0])
    big = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x" * 2000}]}
    resp = await client.post("/v1/messages", json=big)
    assert resp.status == 413 and anthropic_error(await resp.json())["type"] == "request_too_large"

    async def chunked():  # no Content-Length: counted while read
        for _ in range(3):
            yield b" " * 600

    resp = await client.post("/v1/chat/completions", data=chunked(), headers={"Content-Type": "application/json"})
    assert resp.status == 413 and openai_error(await resp.json())["message"].startswith("request body too large")
    assert (await client.get("/health")).status == 200


async def test_a_body_that_stops_arriving_is_408(aiohttp_server, fake_stack, monkeypatch):
    monkeypatch.setattr(proxy.body, "BODY_IDLE_S", 0.3)
    server = await aiohttp_server(fake_stack()[0])
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{}")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 408")
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_client_that_hangs_up_mid_body_is_no_server_error(aiohttp_server, fake_stack, caplog):
    server = await aiohttp_server(fake_stack()[0])
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"mo")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    await writer.wait_closed()
    for _ in range(50):  # the server notices the hang-up on its own time
        await asyncio.sleep(0.02)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
