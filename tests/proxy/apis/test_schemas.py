"""What each API's schema accepts, refuses and warns about, without a server."""
import logging

from engine.api import SamplingParams
from proxy.apis.chat.schema import ChatRequest, gen_params
from proxy.apis.responses.schema import ResponsesRequest
from proxy.apis.responses.tools import offered_tools

MSG = [{"role": "user", "content": "hi"}]


def test_unserved_tool_types_are_warned_about_once(caplog):
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [
        {"type": "shell_of_this_test"}, {"type": "function", "name": "ls", "parameters": {"type": "object"}}]})
    with caplog.at_level(logging.WARNING, logger="killick.proxy"):
        for _ in range(3):  # Codex sends the same tools with every request
            assert list(offered_tools(req.tools)) == ["ls"]
    assert caplog.text.count("'shell_of_this_test' is not served") == 1


def test_chat_penalties_reach_the_sampling_parameters():
    def sampling(**fields) -> SamplingParams:
        return gen_params(ChatRequest.model_validate({"model": "m", "messages": MSG, **fields})).sampling

    got = sampling(temperature=0, frequency_penalty=0.5, presence_penalty=-2)
    assert (got.frequency_penalty, got.presence_penalty) == (0.5, -2.0) and got.penalized
    assert not sampling(temperature=0).penalized
    assert sampling(temperature=0, frequency_penalty=None, presence_penalty=0) == SamplingParams()


async def test_chat_penalties_travel_to_the_engine_request(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": MSG, "frequency_penalty": 1,
                                                           "presence_penalty": 0.5})
    assert resp.status == 200, await resp.text()
    sampling = core.requests[-1].sampling
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (1.0, 0.5)
