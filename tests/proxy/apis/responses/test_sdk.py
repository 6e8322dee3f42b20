"""Background responses and truncation through the official `openai` SDK, against the real renderer and
EngineCore on a synthetic checkpoint (random weights: long answers are forced through the test hook); a queued
stream's keep-alives against the protocol-only stand-in, whose queue and prefill take as long as asked."""
import asyncio

import openai
import pytest

from conftest import FORCED

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


async def until_ended(client, response_id: str):
    for _ in range(1000):
        got = await client.responses.retrieve(response_id)
        if got.status in TERMINAL:
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"{response_id} still {got.status}")


async def test_background_create_poll_and_cancel(serve, sdk):
    base, core, _ = await serve()
    client = sdk.openai(base, max_retries=0)
    created = await client.responses.create(model="gpt-5", input="Say hi.", background=True, max_output_tokens=16,
                                            extra_headers={FORCED: "Hi there."}, reasoning={"effort": "none"})
    assert created.background is True and created.status in ("queued", "in_progress")
    done = await until_ended(client, created.id)
    assert done.status == "completed" and done.output_text == "Hi there." and done.usage.output_tokens > 0
    assert done.model_dump(exclude={"status", "output", "usage"}) == \
        created.model_dump(exclude={"status", "output", "usage"})

    long = await client.responses.create(model="gpt-5", input="Write a lot.", background=True,
                                         max_output_tokens=3000, extra_headers={FORCED: " ".join(["word"] * 1500)})
    cancelled = await client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.usage is None
    assert (await client.responses.retrieve(long.id)).model_dump() == cancelled.model_dump()
    assert (await client.responses.cancel(long.id)).model_dump() == cancelled.model_dump()
    assert (await client.responses.cancel(done.id)).model_dump() == done.model_dump()
    for _ in range(100):  # the aborted request leaves the engine
        if not core.stats().get("active"):
            break
        await asyncio.sleep(0.02)
    assert not core.stats().get("active")
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_never_made")
    with pytest.raises(openai.BadRequestError, match="store"):
        await client.responses.create(model="gpt-5", input="x", background=True, store=False)


async def test_background_stream_through_the_sdk(serve, sdk):
    base, _, _ = await serve()
    client = sdk.openai(base, max_retries=0)
    stream = await client.responses.create(model="gpt-5", input="Say hi.", background=True, stream=True,
                                           max_output_tokens=16, extra_headers={FORCED: "Hi there."},
                                           reasoning={"effort": "none"})
    kinds, final = [], None
    async for event in stream:
        kinds.append(event.type)
        final = getattr(event, "response", final)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert final.output_text == "Hi there."
    assert (await client.responses.retrieve(final.id)).model_dump() == final.model_dump()


async def test_a_background_stream_resumes_through_the_sdk(serve, sdk):
    base, _, _ = await serve()
    client = sdk.openai(base, max_retries=0)
    text = " ".join(["word"] * 40)
    stream = await client.responses.create(model="gpt-5", input="Write a lot.", background=True, stream=True,
                                           max_output_tokens=200, extra_headers={FORCED: text},
                                           reasoning={"effort": "none"})
    async for event in stream:  # the client's connection breaks after the fourth event
        if event.type == "response.created":
            response_id = event.response.id
        if event.sequence_number == 3:
            break
    await stream.close()
    resumed = await client.responses.retrieve(response_id, stream=True, starting_after=3)
    events = [event async for event in resumed]
    assert [e.sequence_number for e in events] == list(range(4, 4 + len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text
    with pytest.raises(openai.BadRequestError, match="starting_after"):
        await client.responses.retrieve(response_id, stream=True, extra_query={"starting_after": "-1"})


async def test_truncation_through_the_sdk(serve, sdk):
    base, _, _ = await serve(context_length=512)
    client = sdk.openai(base, max_retries=0)
    history = []
    for i in range(12):
        history += [{"role": "user", "content": f"Question {i}: " + "tell me more " * 8},
                    {"role": "assistant", "content": f"Answer {i}: " + "here is more " * 8}]
    history.append({"role": "user", "content": "The last question."})
    with pytest.raises(openai.BadRequestError, match="prompt is too long"):
        await client.responses.create(model="gpt-5", input=history, max_output_tokens=32)
    answer = await client.responses.create(model="gpt-5", input=history, max_output_tokens=32, truncation="auto",
                                           instructions="Be brief.", extra_headers={FORCED: "Fine."})
    assert answer.truncation == "auto" and answer.status == "completed"
    assert 512 // 2 < answer.usage.input_tokens <= 512 - 32


async def test_a_background_streams_keep_alives_parse_in_the_sdk(aiohttp_server, fake_stack, sdk):
    """The keep-alives of a queued, then prefilling background stream (response.queued, response.in_progress
    again) are events the SDK knows: typed, numbered in order, the stream ending completed."""
    app, core = fake_stack(keepalive_s=0.05)
    core.queue_s, core.prefill_s = 0.3, 0.3
    server = await aiohttp_server(app)
    client = sdk.openai(str(server.make_url("")).rstrip("/"), max_retries=0)
    stream = await client.responses.create(model="m", input="hi", background=True, stream=True)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    queued = [e for e in events if isinstance(e, openai.types.responses.ResponseQueuedEvent)]
    assert len(queued) >= 3 and all(e.response.status == "queued" for e in queued)
    assert events[-1].type == "response.completed" and events[-1].response.output
