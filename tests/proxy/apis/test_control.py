"""`/v1/killick/*` and `killick ctl`: stats, and resizing caches on a live server without a reload."""
import pytest

from tests.proxy.real_stack import real_app, synth_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return synth_model_dir(tmp_path_factory)


async def test_resize_expert_and_kv_budgets_at_runtime(aiohttp_client, model_dir):
    app, core, _ = real_app(model_dir, moe_backend="hybrid", moe_slots="50%")
    client = await aiohttp_client(app)
    before = await (await client.get("/v1/killick/stats")).json()
    cfg = core.runner.model.config
    assert before["engine"]["experts"]["slots"] == len(cfg.moe_layers) * cfg.num_experts // 2
    r = await client.post("/v1/killick/cache", json={"moe_slots": 3, "kv_tokens": 1024, "prefix_host_mb": 8})
    assert r.status == 200, await r.text()
    after = (await r.json())["engine"]
    assert after["experts"]["slots"] == 3 and after["context_length"] == 1024
    assert after["cache_host_budget"] == 8 << 20
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["context_length"] == 1024
    # the server keeps serving after the resize
    chat = await client.post("/v1/chat/completions", json={"model": "x", "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status == 200


@pytest.mark.parametrize("body, needle", [({"moe_slots": 10**6}, "slots"), ({"moe_slots": -1}, "positive"),
                                          ({"bogus": 1}, "moe_slots"), ([], "moe_slots")])
async def test_impossible_sizes_are_refused_before_anything_changes(aiohttp_client, model_dir, body, needle):
    app, core, _ = real_app(model_dir, moe_backend="offload", moe_slots="50%")
    client = await aiohttp_client(app)
    slots = (await (await client.get("/v1/killick/stats")).json())["engine"]["experts"]["slots"]
    r = await client.post("/v1/killick/cache", json=body)
    assert r.status == 400 and needle in (await r.json())["error"]["message"]
    stats = await (await client.get("/v1/killick/stats")).json()
    assert stats["engine"]["experts"]["slots"] == slots


async def test_fused_engine_explains_there_is_no_expert_cache(aiohttp_client, model_dir):
    app, core, _ = real_app(model_dir, moe_backend="fused")
    client = await aiohttp_client(app)
    r = await client.post("/v1/killick/cache", json={"moe_slots": 2})
    assert r.status == 400 and "fused" in (await r.json())["error"]["message"]


async def test_ctl_stats_shows_the_last_turns_of_each_session(aiohttp_client, model_dir):
    from proxy.cli.ctl import _render_stats
    from proxy.policy.cache_policy import PolicyPlanner

    app, core, _ = real_app(model_dir, planner=PolicyPlanner())
    client = await aiohttp_client(app)
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hi"}]
    for k in range(2):
        r = await client.post("/v1/chat/completions", headers={"x-session-id": "s1"},
                              json={"model": "x", "max_tokens": 3, "temperature": 0, "messages": messages})
        answer = (await r.json())["choices"][0]["message"]
        messages += [{"role": "assistant", "content": answer["content"] or "",
                      "reasoning_content": answer.get("reasoning_content") or ""},
                     {"role": "user", "content": f"and {k}?"}]
    stats = await (await client.get("/v1/killick/stats")).json()
    first, second = stats["policy"]["recent_turns"]
    assert (first["turn"], first["edit_class"], second["turn"]) == (1, "first", 2)
    assert second["cached"] > 0 and second["prefilled"] == second["prompt"] - second["cached"]
    text = _render_stats(stats)
    assert "last turns of each session" in text and "None" not in text
    assert f"policy expected_reprefill_tokens  {stats['policy']['expected_reprefill_tokens']}" in text
    row = next(line for line in text.splitlines() if line.split()[:2] == [second["session"], "2"])
    assert row.split()[-3:-1] == [str(second["cached"]), str(second["prefilled"])]
