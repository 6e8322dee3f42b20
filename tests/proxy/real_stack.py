"""The real stack for end-to-end tests: shipped tokenizer, the real renderer, EngineCore + ModelRunner on a
seeded synthetic checkpoint (random weights: output is garbage unless forced via the test hook)."""
from __future__ import annotations

import pytest

# One bash tool in each API's shape.
TOOLS_A = [{"name": "bash", "description": "Run a shell command",
            "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]
TOOLS_C = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                             "parameters": TOOLS_A[0]["input_schema"]}}]
TOOLS_R = [{"type": "function", "name": "bash", "description": "Run a shell command",
            "parameters": TOOLS_A[0]["input_schema"]}]


def synth_model_dir(tmp_path_factory):
    synth = pytest.importorskip("engine.synth")
    from engine.demo import SHIPPED_TOKENIZER
    from proxy.prompt.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("tiny-model")
    vocab = load_tokenizer(None).vocab_size
    return synth.synth_checkpoint(out, size="tiny", seed=0, vocab_size=vocab, tokenizer=SHIPPED_TOKENIZER)


def real_app(model_dir, *, context_length=4096, keepalive_s=5.0, max_running=2, max_waiting=8, api_key=None,
             planner=None, **engine_options):
    from engine.build import EngineOptions, build_core
    from proxy.prompt.tokenizer import load_tokenizer
    from proxy.app import create_app
    from proxy.prompt.render import ChatRenderer
    from proxy.replay.sources import OutputHeader

    tok = load_tokenizer(model_dir)
    engine_options = {"cache_device_mb": 64, "cache_host_mb": 64, **engine_options}
    opts = EngineOptions(max_running=max_running, max_queue=max_waiting, context_length=context_length,
                         **engine_options)
    core = build_core(model_dir, opts)
    app = create_app(core, tok, ChatRenderer(tok), model_name="tiny", api_key=api_key, keepalive_s=keepalive_s,
                     planner=planner, replies=OutputHeader())
    return app, core, tok
