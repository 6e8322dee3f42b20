"""Bad input answered in each API's own error shape, with the status and the field named."""
import random

import anthropic
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


def anthropic_error(body):
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def openai_error(body):
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("path,shape", [
    ("/v1/messages", anthropic_error), ("/v1/messages/count_tokens", anthropic_error),
    ("/v1/chat/completions", openai_error), ("/v1/responses", openai_error)])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", "\"caf\xe9\"".encode("latin-1")])
async def test_malformed_bodies_are_400_in_shape(aiohttp_client, fake_stack, path, shape, raw):
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert "JSON" in shape(await resp.json())["message"]


@pytest.mark.parametrize("path,body,field", [
    ("/v1/messages", {"model": "m", "messages": MSG}, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": "5", "messages": MSG}, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages.0.content"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": MSG, "temperature": 3}, "temperature"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages.0.content.0.tool_result.tool_use_id: field required"),  # the list's problem, not "not a string"
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "n": 2}, "n"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/chat/completions", {"model": "m", "messages": MSG, "frequency_penalty": "high"}, "frequency_penalty"),
    ("/v1/responses", {"model": "m", "input": [{"type": "teleport"}]}, "input"),
    ("/v1/responses", {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "input.0"),
    ("/v1/responses", {"model": "m", "input": "x", "max_output_tokens": -1}, "max_output_tokens"),
])
async def test_invalid_fields_are_named(aiohttp_client, fake_stack, path, body, field):
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post(path, json=body)
    assert resp.status == 400
    data = await resp.json()
    message = data["error"]["message"]
    assert message.startswith(field), message
    if "choices" not in data and path != "/v1/messages":
        assert data["error"]["param"].startswith(field)


@pytest.mark.parametrize("path,extra,param,allowed", [
    ("/v1/responses", {"conversation": "conv_1"}, "conversation", {"conversation": None}),
    ("/v1/responses", {"conversation": {"id": "conv_1"}}, "conversation", {"conversation": None}),
    ("/v1/responses", {"top_logprobs": 2}, "top_logprobs", {"top_logprobs": 0}),
    ("/v1/responses", {"include": ["message.output_text.logprobs"]}, "include",
     {"include": ["reasoning.encrypted_content"]}),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", {"top_logprobs": 0}),
    ("/v1/chat/completions", {"logit_bias": {"15": -100}}, "logit_bias", {"logit_bias": {}}),
])
async def test_features_not_served_are_refused_not_ignored(aiohttp_client, fake_stack, path, extra, param, allowed):
    """Ignoring these would change the answer's meaning: a conversation's history left out, log probabilities
    asked for and silently missing, tokens meant to be banned still written."""
    base = {"/v1/chat/completions": {"model": "m", "messages": MSG}, "/v1/responses": {"model": "m", "input": "hi"}}
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post(path, json={**base[path], **extra})
    assert resp.status == 400
    error = openai_error(await resp.json())
    assert error["message"].startswith(f"{param}: ") and (error["param"], error["code"]) == (
        param, "unsupported_parameter")
    assert (await client.post(path, json={**base[path], **allowed})).status == 200


TOOLS = {"anthropic": [{"name": "ls", "input_schema": {"type": "object"}}],
         "chat": [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}],
         "responses": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/messages", {"tools": TOOLS["anthropic"], "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/messages", {"tools": TOOLS["anthropic"], "tool_choice": {"type": "tool", "name": "ls"}}, "tool_choice"),
    ("/v1/messages", {"output_format": {"type": "json_schema", "schema": SCHEMA}}, "output_format"),
    ("/v1/messages", {"output_config": {"effort": "high", "format": {"type": "json_schema", "schema": SCHEMA}}},
     "output_config.format"),
    ("/v1/chat/completions", {"tools": TOOLS["chat"], "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS["chat"], "tool_choice": {"type": "function", "function": {"name": "ls"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format"),
    ("/v1/responses", {"tools": TOOLS["responses"], "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"tools": TOOLS["responses"], "tool_choice": {"type": "function", "name": "ls"}}, "tool_choice"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}}, "text.format"),
])
async def test_output_we_cannot_enforce_is_refused_in_shape(aiohttp_client, fake_stack, path, extra, param):
    base = {"/v1/messages": {"model": "m", "max_tokens": 5, "messages": MSG},
            "/v1/chat/completions": {"model": "m", "messages": MSG},
            "/v1/responses": {"model": "m", "input": "hi"}}[path]
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post(path, json={**base, **extra})
    assert resp.status == 400
    body = await resp.json()
    error = anthropic_error(body) if path == "/v1/messages" else openai_error(body)
    assert error["message"].startswith(f"{param}: ") and "no constrained decoding" in error["message"]
    if path != "/v1/messages":
        assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    for allowed in ({"tool_choice": {"type": "auto"}} if path == "/v1/messages" else {"tool_choice": "auto"},
                    {"output_config": {"effort": "high"}} if path == "/v1/messages" else
                    {"response_format": {"type": "text"}} if path == "/v1/chat/completions" else
                    {"text": {"format": {"type": "text"}}}):
        assert (await client.post(path, json={**base, **allowed})).status == 200


async def test_prompt_too_long_in_both_shapes(aiohttp_server, fake_stack, sdk):
    server = await aiohttp_server(fake_stack(context_length=64)[0])
    base = str(server.make_url("")).rstrip("/")
    long = [{"role": "user", "content": "word " * 100}]
    with pytest.raises(anthropic.BadRequestError) as err:
        await sdk.anthropic(base, max_retries=0).messages.create(model="m", max_tokens=5, messages=long)
    assert "prompt is too long" in err.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:
        await sdk.openai(base, max_retries=0).chat.completions.create(model="m", messages=long)
    assert err.value.code == "context_length_exceeded"


async def test_unknown_routes_and_methods(aiohttp_client, fake_stack):
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post("/v1/nope", json={})
    assert resp.status == 404 and "/v1/nope" in openai_error(await resp.json())["message"]
    resp = await client.post("/v1/messages/batches", json={})
    assert resp.status == 404 and anthropic_error(await resp.json())["type"] == "not_found_error"
    resp = await client.get("/v1/chat/completions")
    assert resp.status == 405 and openai_error(await resp.json())
    assert (await client.get("/health")).status == 200


async def test_images_become_a_placeholder_not_an_error(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    content = [{"type": "text", "text": "look"}, {"type": "image", "source": {"type": "base64", "data": "AA=="}}]
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 3,
                                                   "messages": [{"role": "user", "content": content}]})
    assert resp.status == 200
    assert "[image omitted" in core.tok.decode(core.requests[-1].prompt_ids)


@pytest.mark.parametrize("path,part,kind", [
    ("/v1/messages", {"type": "document", "source": {"type": "base64", "data": "AA=="}}, "document"),
    ("/v1/chat/completions", {"type": "file", "file": {"file_data": "AA=="}}, "file"),
    ("/v1/chat/completions", {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}, "audio"),
    ("/v1/responses", {"type": "input_file", "file_data": "AA=="}, "file"),
    ("/v1/responses", {"type": "input_image", "image_url": "data:image/png;base64,AA=="}, "image"),
])
async def test_the_placeholder_names_what_was_left_out(aiohttp_client, fake_stack, caplog, path, part, kind):
    """The model is told a file or a recording was left out, not an image; the log says which part."""
    app, core = fake_stack()
    client = await aiohttp_client(app)
    text = {"type": "input_text" if path == "/v1/responses" else "text", "text": "look"}
    message = {"role": "user", "content": [text, part]}
    body = {"model": "m", "input": [message]} if path == "/v1/responses" else {
        "model": "m", "max_tokens": 3, "messages": [message]}
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    prompt = core.tok.decode(core.requests[-1].prompt_ids)
    assert f"[{kind} omitted: this model reads text only]" in prompt and (kind == "image") == ("[image" in prompt)
    warnings = [r.getMessage() for r in caplog.records if "placeholder" in r.getMessage()]
    assert warnings == [f"a {part['type']} part ({kind}) was replaced by a text placeholder: the model reads text "
                        "only"]  # once, though the Responses store keeps the input too


async def test_a_plain_text_document_is_read_not_replaced(aiohttp_client, fake_stack, caplog):
    """Anthropic's plain-text document (source type text) is text the model reads; in a tool result too."""
    app, core = fake_stack()
    client = await aiohttp_client(app)
    doc = {"type": "document", "title": "notes", "source": {"type": "text", "media_type": "text/plain",
                                                             "data": "the word is plum"}}
    messages = [{"role": "user", "content": [doc, {"type": "text", "text": "which word?"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{**doc, "source": {**doc["source"], "data": "pear"}}]}]}]
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": messages})
    assert resp.status == 200, await resp.text()
    prompt = core.tok.decode(core.requests[-1].prompt_ids)
    assert "the word is plum" in prompt and "pear" in prompt and "omitted" not in prompt
    assert "placeholder" not in caplog.text


async def test_agent_extras_are_accepted(aiohttp_client, fake_stack):
    """Fields real agents send that we do not use: accepted and ignored."""
    client = await aiohttp_client(fake_stack()[0])
    resp = await client.post("/v1/messages?beta=true", json={
        "model": "claude-opus-4-8", "max_tokens": 2048, "metadata": {"user_id": "u_session"},
        "context_management": {"edits": []}, "output_config": {"effort": "high"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0.abc;",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "system", "content": "inline system"},
                     {"role": "user", "content": [{"type": "text", "text": "q",
                                                   "cache_control": {"type": "ephemeral"}}]},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                                       {"type": "redacted_thinking", "data": "zz"},
                                                       {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                        "input": {"command": "ls"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "a.py"}]}]}]})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/responses", json={
        "model": "gpt-5", "store": False, "prompt_cache_key": "s1", "client_metadata": {"x": 1},
        "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "high", "summary": "auto"},
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
                  {"role": "user", "content": "q"},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-foreign"},
                  {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{\"cmd\": [\"ls\"]}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "a.py"}],
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False},
                  {"type": "web_search"}]})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/chat/completions", json={
        "model": "m", "max_completion_tokens": 5, "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "d"},
                     {"role": "user", "content": [{"type": "text", "text": "q"}]},
                     {"role": "assistant", "content": None, "reasoning_content": "r",
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "bash", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "out"}]})
    assert resp.status == 200, await resp.text()


async def test_engine_failure_is_a_500_or_an_in_band_error_and_the_server_survives(aiohttp_client, fake_stack):
    app, core = fake_stack()
    client = await aiohttp_client(app)
    body = {"model": "m", "max_tokens": 5, "messages": MSG}
    core.fail_next = True
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 500 and "boom" in anthropic_error(await resp.json())["message"]
    core.fail_next = True
    resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": MSG})
    assert resp.status == 500 and openai_error(await resp.json())["type"] == "server_error"
    core.fail_next = True
    text = await (await client.post("/v1/messages", json={**body, "stream": True})).text()
    assert "event: error" in text and "message_stop" not in text
    core.fail_next = True
    text = await (await client.post("/v1/responses", json={"model": "m", "input": "q", "stream": True})).text()
    assert "event: response.failed" in text
    assert (await client.post("/v1/messages", json=body)).status == 200


async def test_a_write_to_a_closed_connection_is_not_a_server_error(aiohttp_client, fake_stack, caplog):
    """A client that hangs up while its answer is written makes the write raise; that is the client's doing:
    no ERROR traceback in the log (a soak's hanging-up clients produced two in 773), counted as 499."""
    from aiohttp.client_exceptions import ClientConnectionResetError

    app, _ = fake_stack()

    async def gone(request):
        raise ClientConnectionResetError("Cannot write to closing transport")

    app.router.add_post("/v1/chat/completions/gone", gone)
    client = await aiohttp_client(app)
    resp = await client.post("/v1/chat/completions/gone", json={})
    assert resp.status == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_count_tokens_counts_past_the_context_up_to_its_own_bound(aiohttp_client, fake_stack):
    """A prompt longer than the context is a 400 for /v1/messages but counted by count_tokens (an agent over the
    context asks how far over), up to COUNT_CONTEXTS contexts; past that a 400 too, in Anthropic's shape."""
    from proxy.preparing import COUNT_CONTEXTS

    client = await aiohttp_client(fake_stack(context_length=64)[0])
    words = random.Random().randint(15, 90)  # (the stand-in tokenizer: a token a character)
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * words}]}
    resp = await client.post("/v1/messages/count_tokens", json=body)
    assert resp.status == 200, await resp.text()
    counted = (await resp.json())["input_tokens"]
    assert 64 < counted < COUNT_CONTEXTS * 64
    assert (await client.post("/v1/messages", json={**body, "max_tokens": 5})).status == 400
    body["messages"][0]["content"] = "word " * (COUNT_CONTEXTS * 64)
    resp = await client.post("/v1/messages/count_tokens", json=body)
    assert resp.status == 400 and "prompt is too long" in anthropic_error(await resp.json())["message"]
