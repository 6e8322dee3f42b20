"""The model-runner contract: batched forward over sequences, per-sequence state, checkpoint / restore."""
from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import ARCHS
from tests.engine.util import prompt

TOL = 1e-4  # same engine, different batching: only summation order differs


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_of_three_sequences_equals_each_alone(arch, engine_for):
    model = engine_for(arch).model
    seqs = [prompt(n, seed=10 + n) for n in (5, 70, 17)]
    alone = [model.forward([(s, model.new_state())], logits="all")[0] for s in seqs]
    batched = model.forward([(s, model.new_state()) for s in seqs], logits="all")
    for a, b in zip(alone, batched):
        torch.testing.assert_close(b, a, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_batch_mixed_with_a_prefill_chunk(arch, engine_for):
    """Three decoding sequences and one prefilling one in the same forward, as the scheduler batches them."""
    model = engine_for(arch).model
    prompts = [prompt(n, seed=20 + n) for n in (9, 30, 3)]
    solo, batch = [model.new_state() for _ in prompts], [model.new_state() for _ in prompts]
    for p, a, b in zip(prompts, solo, batch):
        model.forward([(p, a)]), model.forward([(p, b)])
    late = prompt(40, seed=29)
    late_solo, late_batch = model.new_state(), model.new_state()
    for step in range(3):
        tokens = [torch.tensor([7 + step + i]) for i in range(3)]
        chunk = late[step * 13 : step * 13 + 13]
        expected = [model.forward([(t, s)])[0] for t, s in zip(tokens, solo)]
        expected.append(model.forward([(chunk, late_solo)], logits="last")[0])
        got = model.forward([*zip(tokens, batch), (chunk, late_batch)], logits="last")
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, atol=TOL, rtol=0)
    assert [s.length for s in batch] == [10 + 2, 33, 6] and late_batch.length == 39


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_restore_continues_identically(arch, engine_for):
    model = engine_for(arch).model
    ids = prompt(100, seed=31)
    state = model.new_state()
    model.forward([(ids[:70], state)])
    ckpt = state.checkpoint()
    assert ckpt.length == 70 and ckpt.nbytes > 0
    straight = model.forward([(ids[70:], state)], logits="all")[0]
    for restored in (model.restore(ckpt), model.restore(ckpt.to("cpu"))):  # a checkpoint can be reused
        assert restored.length == 70
        resumed = model.forward([(ids[70:], restored)], logits="all")[0]
        assert torch.equal(resumed, straight)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("positions", [(1,), (37,), (3, 4, 64, 69), (13, 50)])
def test_checkpoints_inside_a_chunk_snapshot_what_a_chunk_ending_there_would(arch, positions, engine_for):
    """One pass with the recurrence split at the checkpoint positions against a chunk ending at each of
    them: same recurrent and conv state, same KV prefix, and a restore from either continues alike."""
    model = engine_for(arch).model
    ids = prompt(100, seed=33 + sum(positions))
    state = model.new_state()
    model.forward([(ids[:5], state)])
    state.checkpoint_positions = tuple(5 + m for m in positions)
    model.forward([(ids[5:75], state)], logits="all")
    for m in state.checkpoint_positions:
        fast = state.at(m).checkpoint()
        slow_state = model.new_state()
        model.forward([(ids[:m], slow_state)])
        slow = slow_state.checkpoint()
        assert fast.length == slow.length == m
        for a, b in zip(fast.layers, slow.layers):
            for x, y in zip(a, b):
                assert x.shape == y.shape  # a 70-token pass vs an m-token one: matmul blocking differs
                torch.testing.assert_close(x, y, atol=5 * TOL, rtol=TOL)
        tail = ids[m:m + 20]
        torch.testing.assert_close(model.forward([(tail, model.restore(fast))], logits="all")[0],
                                   model.forward([(tail, slow_state)], logits="all")[0], atol=5 * TOL, rtol=TOL)
    state.drop_checkpoints()
    assert state.checkpoint_positions == () and all(not getattr(layer, "checkpoints", {}) for layer in state.layers)


def test_checkpoint_holds_recurrent_state_and_kv_up_to_length(engine_for):
    model = engine_for("qwen3_5_moe").model
    cfg, state = model.config, model.new_state()
    model.forward([(prompt(70, seed=32), state)])
    ckpt = state.checkpoint()
    kv = [layer for layer, t in zip(ckpt.layers, cfg.layer_types) if t == "full_attention"]
    linear = [layer for layer, t in zip(ckpt.layers, cfg.layer_types) if t == "linear_attention"]
    assert all(k.shape == (cfg.num_kv_heads, 70, cfg.head_dim) for k, _ in kv)  # KV[:length], not the buffer
    assert all(conv.shape == (cfg.conv_dim, cfg.conv_kernel - 1) for conv, _ in linear)
    assert all(rec.dtype == torch.float32 and rec.abs().sum() > 0 for _, rec in linear)
    per_token_kv = 2 * len(kv) * cfg.num_kv_heads * cfg.head_dim * 4
    fixed = sum(c.numel() * 4 + r.numel() * 4 for c, r in linear)
    assert ckpt.nbytes == 70 * per_token_kv + fixed


def test_kv_cache_grows_without_losing_entries(engine_for):
    model = engine_for("qwen3_moe").model
    state = model.new_state()
    ids = prompt(200, seed=33)
    for start in range(0, 200, 50):
        model.forward([(ids[start : start + 50], state)])
    kv = state.layers[0]
    assert kv.length == 200 and kv.k.shape[1] >= 200
    fresh = model.new_state()
    model.forward([(ids, fresh)])
    torch.testing.assert_close(kv.keys(), fresh.layers[0].keys(), atol=1e-5, rtol=0)


def test_engine_score_generate_and_stop_ids(engine_for):
    eng = engine_for("qwen3_5_moe")
    ids = prompt(12, seed=40)
    logits = eng.score(ids)
    assert logits.shape == (12, eng.config.vocab_size) and logits.dtype == torch.float32
    tokens = eng.generate(ids, max_new_tokens=8)
    assert len(tokens) == 8
    stopped = eng.generate(ids, max_new_tokens=8, stop_ids=(tokens[2],))
    assert stopped == tokens[: tokens.index(tokens[2]) + 1]
    assert eng.generate(ids, max_new_tokens=0) == []


def test_forward_rejects_bad_requests(engine_for):
    model = engine_for("qwen3_moe").model
    with pytest.raises(ValueError, match="logits"):
        model.forward([(prompt(3), model.new_state())], logits="first")
    with pytest.raises(ValueError, match="at least one"):
        model.forward([])
    with pytest.raises(ValueError, match="at least one token"):
        model.forward([(torch.tensor([], dtype=torch.long), model.new_state())])
    with pytest.raises(ValueError, match="token ids"):
        engine_for("qwen3_moe").score([0, 10_000])


def test_expert_backend_reports_stats(engine_for):
    backend = engine_for("qwen3_moe").model.experts
    engine_for("qwen3_moe").score(prompt(5))
    stats = backend.stats()
    assert stats["backend"] == "fused" and stats["total"]["hits"] > 0 and stats["total"]["misses"] == 0
    assert set(stats["layers"]) == {0, 2}  # layer 1 of the tiny qwen3_moe is a dense MLP


def test_experts_can_live_on_another_device_than_the_model(checkpoints):
    from engine.models import load_model

    model = load_model(checkpoints["qwen3_moe", "fused"], device="meta", expert_device="cpu")
    assert model.embed.device.type == "meta" and model.experts.source.device.type == "cpu"
