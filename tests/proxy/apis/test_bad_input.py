"""The bad-input suite (engine/bench/bad_input.py) in CI: a sample of every category against the real stack
(tokenizer, renderer, engine on a tiny synthetic model) - no 5xx, no cut connection, each refusal in its
route's shape, /health fine after each. The whole sweep: `python -m engine.bench.bad_input`."""
import os

import pytest

import proxy.body
from engine.bench import bad_input
from tests.proxy.real_stack import real_app, synth_model_dir

PER_CATEGORY = int(os.environ.get("KILLICK_BAD_INPUT_SAMPLE", "30"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return synth_model_dir(tmp_path_factory)


async def test_bad_input_sample(aiohttp_server, model_dir, monkeypatch):
    monkeypatch.setattr(proxy.body, "BODY_IDLE_S", 1.0)  # the lying Content-Length cases wait this long
    app, core, _ = real_app(model_dir, context_length=512, api_key=bad_input.KEY)
    server = await aiohttp_server(app)
    cases = bad_input.sample(bad_input.all_cases(), PER_CATEGORY, seed=0, costly=False)
    outcomes = await bad_input.sweep(str(server.make_url("")), cases, timeout_s=60, key=bad_input.KEY)
    print(bad_input.table(outcomes))
    assert len(outcomes) >= 100 and {o.category for o in outcomes} == {
        "types", "sizes", "nesting", "encodings", "headers", "methods", "json", "regressions"}
    assert [f"{o.category}/{o.name} {o.path}: {o.problem}" for o in outcomes if o.problem] == []
    assert sum(o.status is not None and 400 <= o.status < 500 for o in outcomes) > len(outcomes) // 2
    assert core.stats()["active"] == 0
