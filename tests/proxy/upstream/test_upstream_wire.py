"""What upstream mode sends and reads, network-free: the chat body, the chunks, the settings."""
import json

import pytest

from engine.api import SamplingParams
from proxy.apis.anthropic.schema import MessagesRequest
from proxy.apis.anthropic.schema import to_conversation as anthropic_conversation
from proxy.apis.chat.schema import ChatRequest, to_conversation
from proxy.apis.chat.schema import gen_params as chat_gen_params
from proxy.generation import GenParams
from proxy.prompt.output_parser import TextDelta, ThinkingDelta, ToolCall, ToolCallDelta, ToolCallStart
from proxy.prompt.render import ChatRenderer
from proxy.prompt.tokenizer import load_tokenizer
from proxy.upstream.config import UpstreamConfig, base_url, parse_model_map
from proxy.upstream.wire import ChunkReader, chat_body

TOOL = {"name": "bash", "description": "Run",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
ANTHROPIC = {"model": "claude-x", "max_tokens": 50, "tools": [TOOL], "system": [{"type": "text", "text": "Be brief."}],
             "messages": [
                 {"role": "user", "content": [{"type": "text", "text": "List"}, {"type": "text", "text": " files."}]},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "Use ls.", "signature": "x"},
                     {"type": "text", "text": "Listing."},
                     {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls"}}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"},
                     {"type": "text", "text": "And now?"}]}]}


def test_the_body_renders_the_same_prompt_on_the_upstream():
    """A killick upstream parses the chat body back into the same Conversation, so it renders the same tokens:
    the prompt the proxy planned is the prompt the upstream caches."""
    conv = anthropic_conversation(MessagesRequest.model_validate(ANTHROPIC))
    params = GenParams(50, SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3, frequency_penalty=0.25,
                                          presence_penalty=-0.5), parse_tools=True, max_tool_calls=1)
    body = chat_body(conv, params, 50, "qwen")
    again = to_conversation(ChatRequest.model_validate(json.loads(json.dumps(body))))
    renderer = ChatRenderer(load_tokenizer(None))
    assert renderer.render(again).ids == renderer.render(conv).ids
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert body["messages"][3]["tool_call_id"] == body["messages"][2]["tool_calls"][0]["id"] == "toolu_1"
    assert (body["model"], body["temperature"], body["top_p"], body["top_k"], body["seed"]) == ("qwen", 0.7, 0.9, 20, 3)
    assert (body["frequency_penalty"], body["presence_penalty"]) == (0.25, -0.5)
    assert chat_gen_params(ChatRequest.model_validate(body)).sampling == params.sampling  # read back as sent
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["parallel_tool_calls"] is False and "tool_choice" not in body
    off = chat_body(conv.__class__(conv.messages, conv.tools, enable_thinking=False), GenParams(5, parse_tools=False),
                    5, "m")
    assert off["chat_template_kwargs"] == {"enable_thinking": False} and off["tool_choice"] == "none"
    assert "frequency_penalty" not in off and "presence_penalty" not in off  # 0: off, as an upstream reads nothing


def _chunk(delta=None, finish=None, usage=None):
    out = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if delta or finish else []}
    if usage:
        out["usage"] = usage
    return out


def test_chunks_become_output_events_with_the_upstream_usage():
    reader = ChunkReader(GenParams(None))
    items = []
    for c in [_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "Think"}),
              _chunk({"content": "\n\nHere"}), _chunk({"content": " it is."}),
              _chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "bash", "arguments": ""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"cmd":'}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "ls"}'}}]}),
              _chunk({"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "bash", "arguments": "{}"}}]}),
              _chunk(finish="tool_calls"),
              _chunk(usage={"prompt_tokens": 90, "completion_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 80}})]:
        items += reader.feed(c)
    items += reader.close()
    assert items == [ThinkingDelta("Think"), TextDelta("Here"), TextDelta(" it is."),
                     ToolCall(0, "bash", '{"cmd": "ls"}'), ToolCall(1, "bash", "{}")]
    assert reader.finish == "tool_calls"
    assert (reader.usage.prompt_tokens, reader.usage.output_tokens, reader.usage.cached_tokens) == (90, 12, 80)


def _read(reader, chunks):
    items = []
    for c in chunks:
        items += reader.feed(c)
    return items + reader.close()


THOUGHT_AS_CONTENT = [_chunk({"content": "Need"}), _chunk({"content": " ls.</th"}),
                      _chunk({"content": "ink>\n\nHere"}), _chunk({"content": " it is."}), _chunk(finish="stop")]


def test_thinking_sent_as_content_is_split_at_its_close_where_the_prompt_opened_it():
    """A replica without a reasoning parser (vLLM, SGLang started without one) sends the thinking a prompt opened
    as content up to a bare </think>. Known to ("content") the reader streams it as thinking at once; not yet
    known ("unknown") it holds the content back until the close shows, then says so (shown); a reasoning field
    first, or no close before the end, and the content is the answer, as before."""
    known = ChunkReader(GenParams(None), opens_think=True, reasoning="content")
    first = known.feed(THOUGHT_AS_CONTENT[0])
    assert first == [ThinkingDelta("Need")]  # streamed as it comes
    assert first + _read(known, THOUGHT_AS_CONTENT[1:]) == [ThinkingDelta("Need"), ThinkingDelta(" ls."),
                                                            TextDelta("Here"), TextDelta(" it is.")]
    learning = ChunkReader(GenParams(None), opens_think=True, reasoning="unknown")
    assert learning.feed(THOUGHT_AS_CONTENT[0]) == [] and learning.feed(THOUGHT_AS_CONTENT[1]) == []  # held back
    assert learning.feed(THOUGHT_AS_CONTENT[2]) == [ThinkingDelta("Need ls."), TextDelta("Here")]
    assert _read(learning, THOUGHT_AS_CONTENT[3:]) == [TextDelta(" it is.")] and learning.shown == "content"
    parsed = ChunkReader(GenParams(None), opens_think=True, reasoning="unknown")
    items = _read(parsed, [_chunk({"reasoning_content": "Need ls."}), _chunk({"content": "Here"}),
                           _chunk(finish="stop")])
    assert items == [ThinkingDelta("Need ls."), TextDelta("Here")] and parsed.shown == "parsed"
    plain = ChunkReader(GenParams(None), opens_think=True, reasoning="unknown")  # no thinking at all: text at the end
    assert plain.feed(_chunk({"content": "Hi"})) == [] and plain.close() == [TextDelta("Hi")]
    assert plain.shown is None
    calling = ChunkReader(GenParams(None), opens_think=True, reasoning="unknown")  # ... or before a structured call
    items = _read(calling, [_chunk({"content": "Listing."}),
                            _chunk({"tool_calls": [{"index": 0, "function": {"name": "bash", "arguments": "{}"}}]})])
    assert items == [TextDelta("Listing."), ToolCall(0, "bash", "{}")] and calling.shown is None
    changed = ChunkReader(GenParams(None), opens_think=True, reasoning="content")  # the replica has a parser now
    items = _read(changed, [_chunk({"reasoning_content": "Need ls."}), _chunk({"content": "Here"})])
    assert items == [ThinkingDelta("Need ls."), TextDelta("Here")] and changed.shown == "parsed"
    for reader in (ChunkReader(GenParams(None)), ChunkReader(GenParams(None), opens_think=False, reasoning="content")):
        # the parsed default, or a prompt that does not open the thinking: content is the answer, at once
        assert reader.feed(THOUGHT_AS_CONTENT[0]) == [TextDelta("Need")] and reader.shown is None


def test_stop_sequences_unparsed_tool_calls_and_bad_arguments():
    reader = ChunkReader(GenParams(None, stop_sequences=("END",)))
    items = reader.feed(_chunk({"content": "one EN"})) + reader.feed(_chunk({"content": "D two"}))
    assert items == [TextDelta("one")] and reader.ended and reader.parser.stopped == "END"
    raw = ChunkReader(GenParams(None))  # an upstream that left the model's tool-call text as content
    items = raw.feed(_chunk({"content": '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'}))
    # parsed from text, the call streams as the engine's does: start, argument deltas, the whole call
    assert items + raw.close() == [ToolCallStart(0, "bash"), ToolCallDelta(0, '{"cmd": "ls"}'),
                                   ToolCall(0, "bash", '{"cmd": "ls"}', streamed=True)]
    bad = ChunkReader(GenParams(None))
    bad.feed(_chunk({"tool_calls": [{"index": 0, "function": {"name": "bash", "arguments": "[1,"}}]}))
    assert [type(i) for i in bad.close()] == [TextDelta]  # malformed: shown as text, as the engine's parser does
    err = ChunkReader(GenParams(None))
    assert err.feed({"error": {"message": "boom"}}) == [] and err.error == "boom"


def test_settings_from_flags_and_file(tmp_path):
    assert base_url("http://h:8000/v1/") == "http://h:8000" and base_url(" https://h/p ") == "https://h/p"
    with pytest.raises(ValueError, match="http"):
        base_url("h:8000")
    cfg = UpstreamConfig(("http://a:1",), parse_model_map(["claude-*=qwen", "gpt-5=qwen-big"]), default_model="up")
    assert [cfg.upstream_model(m) for m in ("claude-opus-4", "gpt-5", "other")] == ["qwen", "qwen-big", "up"]
    assert UpstreamConfig(("http://a:1",), parse_model_map(["only"])).upstream_model("x") == "only"
    with pytest.raises(ValueError, match="PATTERN=NAME"):
        parse_model_map(["=x"])
    f = tmp_path / "up.toml"
    f.write_text('upstreams = ["http://a:1/v1", "http://b:1"]\nrouting = "round-robin"\nread_timeout = 30\n'
                 'reasoning = "content"\n[models]\n"claude-*" = "qwen"\n')
    cfg = UpstreamConfig.load(f, routing=None, api_key="k")
    assert cfg.urls == ("http://a:1", "http://b:1") and cfg.routing == "round-robin" and cfg.read_timeout_s == 30
    assert cfg.upstream_model("claude-3") == "qwen" and cfg.api_key == "k" and cfg.reasoning == "content"
    assert UpstreamConfig.load(f, reasoning="auto").reasoning == "auto"  # the flag wins
    assert UpstreamConfig(("http://a:1",)).reasoning == "parsed"
    with pytest.raises(ValueError, match=r"--upstream-reasoning \(reasoning\) must be one of parsed, content, auto"):
        UpstreamConfig(("http://a:1",), reasoning="think")
    f.write_text('upstream = ["http://a:1"]\n')
    with pytest.raises(ValueError, match="unknown key 'upstream'"):
        UpstreamConfig.load(f)
    with pytest.raises(ValueError, match="at least one replica"):
        UpstreamConfig(())
    with pytest.raises(ValueError, match=r"--upstream-timeout \(read_timeout\) must be > 0 seconds, got 0"):
        UpstreamConfig(("http://a:1",), read_timeout_s=0)  # the flag's name, and the file's key


def test_serve_flags_build_an_upstream_app(tmp_path):
    from proxy.cli import build_parser
    from proxy.cli.serve import build_app
    from proxy.context import CTX
    from proxy.upstream.bench import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "up.json").write_text(json.dumps({"upstreams": [dead], "models": {"*": "qwen"}}))
    parse = build_parser(only="serve").parse_args
    app = build_app(parse(["serve", "--upstream-config", str(tmp_path / "up.json"), "--routing", "round-robin",
                           "--context-length", "4096", "--allow-forced-responses"]))
    pool = app[CTX].core
    assert pool.config.urls == (dead,) and pool.config.routing == "round-robin" and app[CTX].context_length == 4096
    assert pool.config.upstream_model("claude-x") == "qwen" and pool.config.forward_headers
    with pytest.raises(ValueError, match="--script"):
        build_app(parse(["serve", "--upstream", dead, "--script", "s.json"]))
