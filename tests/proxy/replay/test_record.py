"""`serve --record`: only authenticated requests are written, into files only their owner can read; a background
response's line holds the response it ended with."""
import asyncio
import json
import logging
import stat

from proxy.app import create_app
from conftest import FORCED
from proxy.replay.record import Recorder
from proxy.replay.sources import OutputHeader
from proxy_fakes import CharTokenizer, ChatMLRenderer, SlowCore

MSG = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


def _app(directory, api_key="k"):
    tok = CharTokenizer()
    return create_app(SlowCore(tok), tok, ChatMLRenderer(tok), context_length=4096, api_key=api_key,
                      observer=Recorder(directory))


def _lines(directory):
    return [json.loads(line) for f in sorted(directory.iterdir()) for line in f.read_text().splitlines()]


async def test_requests_that_fail_auth_are_not_recorded(aiohttp_client, tmp_path):
    rec = tmp_path / "rec"
    client = await aiohttp_client(_app(rec))
    junk = {**MSG, "messages": [{"role": "user", "content": "x" * 100_000}]}
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer nope"}):
        assert (await client.post("/v1/messages", json=junk, headers=headers)).status == 401
    assert _lines(rec) == []
    assert (await client.post("/v1/messages", json=MSG, headers={"x-api-key": "k"})).status == 200
    bad = await client.post("/v1/chat/completions", data=b"{nope", headers={"x-api-key": "k",
                                                                           "Content-Type": "application/json"})
    assert bad.status == 400
    lines = _lines(rec)
    assert [(line["status"], line["body"]) for line in lines] == [(200, MSG), (400, None)]
    assert {k.lower(): v for k, v in lines[0]["headers"].items()}["x-api-key"] == "<redacted>"


async def test_recordings_are_owner_only(aiohttp_client, tmp_path, caplog):
    rec = tmp_path / "new" / "rec"
    client = await aiohttp_client(_app(rec, api_key=None))
    assert (await client.post("/v1/messages", json=MSG)).status == 200
    assert stat.S_IMODE(rec.stat().st_mode) == 0o700
    assert [stat.S_IMODE(f.stat().st_mode) for f in rec.iterdir()] == [0o600]
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    with caplog.at_level(logging.WARNING, logger="killick.record"):
        Recorder(shared)
    assert "other users" in caplog.text and stat.S_IMODE(shared.stat().st_mode) == 0o755  # told, not changed


def _background_app(directory):
    tok = CharTokenizer()
    return create_app(SlowCore(tok, step_s=0.02), tok, ChatMLRenderer(tok), context_length=4096,
                      observer=Recorder(directory), replies=OutputHeader())


async def _recorded(directory, count=1) -> list[dict]:
    for _ in range(300):  # the line is written by a task that waited for the job's end
        if len(_lines(directory)) >= count:
            return _lines(directory)
        await asyncio.sleep(0.01)
    raise AssertionError(f"no line recorded in {directory}")


async def test_a_background_create_is_recorded_with_the_response_it_ended_with(aiohttp_client, tmp_path):
    rec = tmp_path / "rec"
    client = await aiohttp_client(_background_app(rec))
    body = {"model": "m", "input": "hi", "background": True, "reasoning": {"effort": "none"}}
    created = await (await client.post("/v1/responses", json=body, headers={FORCED: "a background answer"})).json()
    assert created["status"] == "queued" and _lines(rec) == []  # not yet: the job runs
    (line,) = await _recorded(rec)
    done = await (await client.get(f"/v1/responses/{created['id']}")).json()
    assert done["status"] == "completed" and line["response"] == done and line["status"] == 200
    assert line["body"] == body and line["metrics"]["output_tokens"] == done["usage"]["output_tokens"] > 0


async def test_a_background_response_still_running_at_shutdown_is_recorded_cancelled(aiohttp_client, tmp_path):
    rec = tmp_path / "rec"
    client = await aiohttp_client(_background_app(rec))
    created = await (await client.post("/v1/responses", headers={FORCED: "x" * 500}, json={
        "model": "m", "input": "hi", "background": True})).json()
    await client.close()  # the app's cleanup cancels the job, then waits for its recording
    (line,) = _lines(rec)
    assert line["response"]["id"] == created["id"] and line["response"]["status"] == "cancelled"
