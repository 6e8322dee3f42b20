"""Background responses: the create call answers queued, GET follows the job to its end, cancel ends it (the
engine request aborted), the app's cleanup ends what still runs; a streamed one's events can be followed again
(GET with stream=true) while it runs and for a while after; bad requests are answered in OpenAI's shape."""
import asyncio
import json
from types import SimpleNamespace

from conftest import FORCED
from proxy.apis.responses.background import BACKGROUND, BackgroundJobs, EndedStream, EndedStreams
from proxy.apis.responses.store import RESPONSES
from proxy.context import CTX

TERMINAL = ("completed", "incomplete", "failed", "cancelled")
LONG = " ".join(["a long answer"] * 20)


async def poll(client, response_id: str, until=TERMINAL) -> dict:
    for _ in range(500):
        got = await (await client.get(f"/v1/responses/{response_id}")).json()
        if got["status"] in until:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"{response_id} never reached {until}: {got['status']}")


async def running_job(aiohttp_client, fake_stack):
    """(app, core, client, the created response) with a long background answer under way (in_progress)."""
    app, core = fake_stack(step_s=0.05)
    client = await aiohttp_client(app)
    created = await (await client.post("/v1/responses", headers={FORCED: LONG}, json={
        "model": "m", "input": "hi", "background": True})).json()
    await poll(client, created["id"], ("in_progress",))
    return app, core, client, created


async def streamed_job(client) -> str:
    """The id of a long background response created with stream: true, whose creating client left at once."""
    async with client.post("/v1/responses", headers={FORCED: LONG}, json={
            "model": "m", "input": "hi", "background": True, "stream": True}) as left:
        first = await left.content.readline()
        assert first.startswith(b"event: response.created")
        return json.loads((await left.content.readline())[len(b"data: "):])["response"]["id"]


async def resumed(client, response_id: str, after: int | None = None) -> list[dict]:
    """The events GET ...?stream=true[&starting_after=after] streams, to the end."""
    query = "stream=true" + ("" if after is None else f"&starting_after={after}")
    resp = await client.get(f"/v1/responses/{response_id}?{query}")
    assert resp.status == 200 and resp.content_type == "text/event-stream", await resp.text()
    return sse_events(await resp.text())


async def retired(app) -> None:
    """Until no job runs (an ended job leaves the running ones once its task is done)."""
    for _ in range(500):
        if len(app[BACKGROUND]) == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(app[BACKGROUND])} jobs still running")


async def error(resp, status: int) -> dict:
    """The OpenAI error object of a refusal with that status."""
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]


async def test_queued_at_once_then_completed_with_output_and_usage(aiohttp_client, fake_stack):
    app, core = fake_stack(step_s=0.01)
    client = await aiohttp_client(app)
    resp = await client.post("/v1/responses", headers={FORCED: LONG},
                             json={"model": "m", "input": "hi", "background": True, "max_output_tokens": 500})
    created = await resp.json()
    assert resp.status == 200 and created["status"] == "queued" and created["background"] is True
    assert created["output"] == [] and created["usage"] is None
    running = await poll(client, created["id"], ("in_progress",) + TERMINAL)
    assert running["status"] == "in_progress", "the job was admitted while tokens still came"
    done = await poll(client, created["id"])
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == LONG
    assert done["usage"]["output_tokens"] > 0 and done["error"] is None
    assert {k: v for k, v in done.items() if k not in ("status", "output", "usage")} == \
        {k: v for k, v in created.items() if k not in ("status", "output", "usage")}
    assert len(app[BACKGROUND]) == 0 and app[RESPONSES].get(created["id"]).response == done
    follow = await client.post("/v1/responses", json={"model": "m", "input": "more",
                                                      "previous_response_id": done["id"]})
    assert follow.status == 200
    assert LONG in core.tok.decode(core.requests[-1].prompt_ids)  # the background answer is in the history


async def test_the_access_line_of_a_background_create_comes_as_it_ends_with_its_usage(aiohttp_client, fake_stack,
                                                                                       caplog):
    """`killick serve`'s access line for a background create is logged when the response ends, saying so and how
    it ended, with the engine's tokens and TTFT, timed from the create call; a foreground one is logged at once."""
    import logging

    app, core = fake_stack(step_s=0.01, access_log=True)
    client = await aiohttp_client(app)
    with caplog.at_level(logging.INFO, logger="killick.access"):
        created = await (await client.post("/v1/responses", headers={FORCED: LONG}, json={
            "model": "m", "input": "hi", "background": True})).json()
        assert not [r for r in caplog.records if r.getMessage().startswith("POST /v1/responses")]
        done = await poll(client, created["id"])
        await retired(app)
        for _ in range(100):
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/responses")]
            if lines:
                break
            await asyncio.sleep(0.01)
    (line,) = lines
    u = done["usage"]
    assert line.startswith("POST /v1/responses 200 background completed prompt=") and line.endswith("ms")
    assert f"prompt={u['input_tokens']} " in line and f" out={u['output_tokens']} " in line and " ttft=" in line
    assert int(line.rsplit(" ", 1)[1][:-2]) >= 10 * u["output_tokens"] * 0.9  # from the create call: every step


async def test_cancel_aborts_the_engine_request_and_is_idempotent(aiohttp_client, fake_stack):
    app, core, client, created = await running_job(aiohttp_client, fake_stack)
    resp = await client.post(f"/v1/responses/{created['id']}/cancel")
    cancelled = await resp.json()
    assert resp.status == 200 and cancelled["status"] == "cancelled" and cancelled["usage"] is None
    assert core.requests[-1].request_id in core.aborted and app[CTX].in_flight == 0
    again = await client.post(f"/v1/responses/{created['id']}/cancel")
    assert again.status == 200 and await again.json() == cancelled
    assert await (await client.get(f"/v1/responses/{created['id']}")).json() == cancelled
    ok = await client.post("/v1/responses", json={"model": "m", "input": "still serving"})
    assert ok.status == 200 and (await ok.json())["status"] == "completed"


async def test_cancelling_a_finished_response_returns_it_unchanged(aiohttp_client, fake_stack):
    client = await aiohttp_client(fake_stack()[0])
    created = await (await client.post("/v1/responses", json={"model": "m", "input": "hi", "background": True})).json()
    done = await poll(client, created["id"])
    resp = await client.post(f"/v1/responses/{created['id']}/cancel")
    assert resp.status == 200 and await resp.json() == done and done["status"] == "completed"


async def test_bad_requests_are_answered_in_openais_shape(aiohttp_client, fake_stack):
    client = await aiohttp_client(fake_stack()[0])
    unknown = await error(await client.post("/v1/responses/resp_nope/cancel"), 404)
    assert "resp_nope" in unknown["message"] and unknown["type"] == "invalid_request_error"
    unstored = await error(await client.post("/v1/responses", json={
        "model": "m", "input": "hi", "background": True, "store": False}), 400)
    assert unstored["param"] == "background"
    for bad in ("yes", 1, [True]):
        resp = await client.post("/v1/responses", json={"model": "m", "input": "hi", "background": bad})
        err = await error(resp, 400)
        assert err["param"] == "background"
    foreground = await (await client.post("/v1/responses", json={"model": "m", "input": "hi"})).json()
    assert foreground["background"] is False
    err = await error(await client.post(f"/v1/responses/{foreground['id']}/cancel"), 400)
    assert "background" in err["message"]


async def test_an_engine_failure_ends_failed_with_an_error_object(aiohttp_client, fake_stack):
    app, core = fake_stack()
    core.fail_next = True
    client = await aiohttp_client(app)
    created = await (await client.post("/v1/responses", json={"model": "m", "input": "hi", "background": True})).json()
    failed = await poll(client, created["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "boom" in failed["error"]["message"]


async def test_a_running_job_is_no_previous_response_yet_and_limits_are_429(aiohttp_client, fake_stack):
    app, core = fake_stack(step_s=0.05)
    app[BACKGROUND] = BackgroundJobs(capacity=1)
    client = await aiohttp_client(app)
    created = await (await client.post("/v1/responses", headers={FORCED: LONG}, json={
        "model": "m", "input": "hi", "background": True})).json()
    chained = await client.post("/v1/responses", json={"model": "m", "input": "x",
                                                       "previous_response_id": created["id"]})
    assert chained.status == 400 and (await chained.json())["error"]["param"] == "previous_response_id"
    full = await client.post("/v1/responses", json={"model": "m", "input": "hi", "background": True})
    assert full.status == 429 and full.headers["Retry-After"] == "1"
    await client.post(f"/v1/responses/{created['id']}/cancel")
    again = await client.post("/v1/responses", json={"model": "m", "input": "hi", "background": True})
    assert again.status == 200


async def test_a_full_engine_queue_is_429_before_any_job(aiohttp_client, fake_stack):
    app, core = fake_stack(step_s=0.05)
    client = await aiohttp_client(app)
    statuses = []
    for _ in range(core.max_running + core.max_waiting + 1):
        resp = await client.post("/v1/responses", headers={FORCED: LONG}, json={"model": "m", "input": "hi",
                                                                               "background": True})
        statuses.append(resp.status)
        await asyncio.sleep(0.05)  # the stand-in engine counts a request once its task has started
    assert statuses[-1] == 429 and statuses[:-1] == [200] * (len(statuses) - 1)
    assert len(app[BACKGROUND]) == core.max_running + core.max_waiting


async def test_the_apps_cleanup_cancels_what_still_runs(aiohttp_client, fake_stack):
    app, core, client, created = await running_job(aiohttp_client, fake_stack)
    await client.close()
    assert core.requests[-1].request_id in core.aborted and len(app[BACKGROUND]) == 0
    assert app[RESPONSES].get(created["id"]).response["status"] == "cancelled"


async def test_streamed_background_follows_the_job_and_outlives_its_client(aiohttp_client, fake_stack):
    app, core = fake_stack(step_s=0.01)
    client = await aiohttp_client(app)
    resp = await client.post("/v1/responses", headers={FORCED: LONG}, json={
        "model": "m", "input": "hi", "background": True, "stream": True, "max_output_tokens": 500})
    events = sse_events(await resp.text())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[0]["response"]["status"] == "queued"
    assert events[1]["type"] == "response.in_progress" and events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == LONG
    assert await (await client.get(f"/v1/responses/{final['id']}")).json() == final
    response_id = await streamed_job(client)
    done = await poll(client, response_id)  # the client left; the job did not
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == LONG


async def test_cancelling_a_streamed_job_ends_its_stream_with_an_error_event(aiohttp_client, fake_stack):
    app, core = fake_stack(step_s=0.05)
    client = await aiohttp_client(app)
    async with client.post("/v1/responses", headers={FORCED: LONG}, json={
            "model": "m", "input": "hi", "background": True, "stream": True}) as resp:
        await resp.content.readline()
        response_id = json.loads((await resp.content.readline())[len(b"data: "):])["response"]["id"]
        cancelled = await (await client.post(f"/v1/responses/{response_id}/cancel")).json()
        events = sse_events((await resp.read()).decode())
    assert cancelled["status"] == "cancelled"
    assert events[-1]["type"] == "error" and events[-1]["code"] == "response_cancelled"


async def test_a_queued_streamed_job_keeps_its_stream_alive_with_events(aiohttp_client, fake_stack):
    """While queued (and while a prefill runs) the job's stream gets response.queued (response.in_progress) again
    each keepalive_s: events, numbered in order and kept for a follower that resumes, since a client's idle timer
    may count events alone (Codex's does). The response is the one a job without a wait gives."""
    app, core = fake_stack(keepalive_s=0.05)
    client = await aiohttp_client(app)
    body = {"model": "m", "input": "hi", "background": True, "stream": True}
    plain = sse_events(await (await client.post("/v1/responses", json=body)).text())
    core.queue_s, core.prefill_s = 0.3, 0.3
    events = sse_events(await (await client.post("/v1/responses", json=body)).text())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    queued = [e for e in events if e["type"] == "response.queued"]
    assert len(queued) >= 3 and all(e["response"]["status"] == "queued" for e in queued)
    assert kinds.count("response.in_progress") >= 3 and kinds[-1] == "response.completed"
    assert max(kinds.index(k) for k in kinds if k == "response.queued") < kinds.index("response.in_progress")
    def unnamed(response):  # (ids and times differ between two responses)
        out = [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]
        return {**{k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at")}, "output": out}

    assert unnamed(events[-1]["response"]) == unnamed(plain[-1]["response"])
    resumed = sse_events(await (await client.get(f"/v1/responses/{events[0]['response']['id']}",
                                                 params={"stream": "true", "starting_after": "1"})).text())
    assert resumed == events[2:]


async def test_a_bug_in_a_job_fails_that_response_alone(aiohttp_client, fake_stack, monkeypatch, caplog):
    from proxy.apis.responses.output import OutputItems

    client = await aiohttp_client(fake_stack()[0])

    def broken(self, event):
        raise RuntimeError("a bug")

    monkeypatch.setattr(OutputItems, "feed", broken)
    created = await (await client.post("/v1/responses", json={"model": "m", "input": "hi", "background": True})).json()
    failed = await poll(client, created["id"])
    monkeypatch.undo()
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error" and failed["usage"] is None
    assert "a bug" in caplog.text and "a bug" not in failed["error"]["message"]
    ok = await client.post("/v1/responses", json={"model": "m", "input": "hi"})
    assert ok.status == 200 and (await ok.json())["status"] == "completed"


async def test_deleting_a_running_job_cancels_it_first(aiohttp_client, fake_stack):
    app, core, client, created = await running_job(aiohttp_client, fake_stack)
    gone = await client.delete(f"/v1/responses/{created['id']}")
    assert gone.status == 200 and (await gone.json())["deleted"] is True
    assert core.requests[-1].request_id in core.aborted and len(app[BACKGROUND]) == 0
    assert (await client.get(f"/v1/responses/{created['id']}")).status == 404


async def test_a_stream_resumes_mid_run_after_a_sequence_number_with_several_followers(aiohttp_client, fake_stack):
    app, core = fake_stack(step_s=0.01)
    client = await aiohttp_client(app)
    response_id = await streamed_job(client)
    await poll(client, response_id, ("in_progress",))
    job = app[BACKGROUND].get(response_id)
    ahead = len(job.events) + 20  # not emitted yet: its follower waits for what comes after it
    whole, tail, live = await asyncio.gather(resumed(client, response_id), resumed(client, response_id, 2),
                                             resumed(client, response_id, ahead))
    assert [e["sequence_number"] for e in whole] == list(range(len(whole))) and len(whole) > ahead + 1
    assert tail == whole[3:] and live == whole[ahead + 1:]
    assert whole[0]["type"] == "response.created" and whole[-1]["type"] == "response.completed"
    assert whole[-1]["response"]["output"][0]["content"][0]["text"] == LONG


async def test_a_stream_resumes_after_the_end_until_its_events_are_dropped(aiohttp_client, fake_stack):
    app, core = fake_stack()
    app[BACKGROUND] = BackgroundJobs(ended=EndedStreams(capacity=2))
    client = await aiohttp_client(app)

    async def streamed() -> list[dict]:
        resp = await client.post("/v1/responses", json={"model": "m", "input": "hi", "background": True,
                                                        "stream": True})
        return sse_events(await resp.text())

    first = await streamed()
    first_id = first[0]["response"]["id"]
    await retired(app)
    kept = app[BACKGROUND].ended.get(first_id)  # its events and end, not the job with the request's prompt
    assert isinstance(kept, EndedStream) and kept.final["status"] == "completed"
    assert await resumed(client, first_id, len(first) - 3) == first[-2:]
    assert await resumed(client, first_id) == first and await resumed(client, first_id, len(first) + 5) == []
    second, third = await streamed(), await streamed()
    await retired(app)
    dropped = await error(await client.get(f"/v1/responses/{first_id}?stream=true"), 400)
    assert "no longer kept" in dropped["message"] and dropped["param"] == "stream"
    assert (await client.get(f"/v1/responses/{first_id}")).status == 200  # still stored
    assert await resumed(client, third[0]["response"]["id"], 0) == third[1:]
    second_id = second[0]["response"]["id"]
    assert (await client.delete(f"/v1/responses/{second_id}")).status == 200
    assert app[BACKGROUND].ended.get(second_id) is None
    await error(await client.get(f"/v1/responses/{second_id}?stream=true"), 404)


def test_ended_streams_keep_their_bounds():
    ended = EndedStreams(capacity=3, max_bytes=100)

    def put(name: str, size: int) -> None:
        ended.put(SimpleNamespace(fixed={"id": name}, event_bytes=size))

    for name in "abcd":
        put(name, 10)
    assert [ended.get(n) is not None for n in "abcd"] == [False, True, True, True] and ended.held_bytes == 30
    put("e", 80)  # over both bounds: the earliest go until 100 bytes
    assert [n for n in "bcde" if ended.get(n)] == ["c", "d", "e"] and ended.held_bytes == 100
    put("f", 500)  # larger than the bound: kept alone
    assert len(ended) == 1 and ended.get("f") and ended.held_bytes == 500
    ended.forget("f")
    assert len(ended) == 0 and ended.held_bytes == 0


async def test_resuming_what_keeps_no_events_is_a_400_that_says_why(aiohttp_client, fake_stack):
    app, core, client, created = await running_job(aiohttp_client, fake_stack)
    url = f"/v1/responses/{created['id']}"
    unstreamed = await error(await client.get(f"{url}?stream=true"), 400)
    assert "without stream: true" in unstreamed["message"] and unstreamed["param"] == "stream"
    for bad in ("x", "-1", "1.5", "", "\u00b2"):
        err = await error(await client.get(url, params={"stream": "true", "starting_after": bad}), 400)
        assert err["param"] == "starting_after"
    assert (await error(await client.get(f"{url}?stream=maybe"), 400))["param"] == "stream"
    await error(await client.get("/v1/responses/resp_nope?stream=true&starting_after=3"), 404)
    foreground = await (await client.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})).text()
    foreground_id = sse_events(foreground)[0]["response"]["id"]
    err = await error(await client.get(f"/v1/responses/{foreground_id}?stream=true"), 400)
    assert "only background responses created with stream: true" in err["message"]
    await client.post(f"{url}/cancel")
    ended = await error(await client.get(f"{url}?stream=true"), 400)
    assert "no longer kept" in ended["message"] and "without stream" in ended["message"]
