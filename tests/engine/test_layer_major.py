"""Layer-major forwards: each layer runs over the whole batch in pieces before the next layer starts. The result
equals the one-pass forward up to fp32 rounding (projections and the chunked delta rule see other row
counts), checkpoints on and between piece boundaries included; with an expert cache a prompt streams the
expert pool once instead of once per chunk."""
import pytest
import torch

from engine import Engine
from engine.build import EngineOptions, build_core
from engine.experts.policy import BandwidthEstimate
from engine.experts.registry import experts_factory
from engine.loader import load_checkpoint

PROMPT = [(11 * i + 5) % 250 for i in range(37)]


def run(model, items, piece):
    """items: [(ids, checkpoint positions)] -> (logits per item [T_i, V], the states)."""
    model.piece_tokens = piece
    states = []
    for ids, cps in items:
        st = model.new_state()
        st.checkpoint_positions = cps
        states.append(st)
    out = model.forward([(ids, st) for (ids, _), st in zip(items, states)], logits="all")
    return out, states


def same_state(a, b):
    for x, y in zip(a.snapshot() if hasattr(a, "snapshot") else a, b.snapshot() if hasattr(b, "snapshot") else b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_pieces_equal_one_pass_with_checkpoints_on_and_off_the_boundaries(checkpoints, arch):
    model = Engine.from_pretrained(checkpoints[arch, "fused"]).model
    # two sequences in one batch (rows 0-36 and 37-56): pieces of 8 rows cut both, one piece holds both;
    # checkpoints at 8 and 16 fall on piece ends, 13 and 5 inside pieces
    items = [(PROMPT, (8, 13, 16)), (PROMPT[:20], (5,))]
    whole, s_whole = run(model, items, None)
    pieces, s_pieces = run(model, items, 8)
    for a, b in zip(whole, pieces):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for sa, sb in zip(s_whole, s_pieces):
        assert sa.length == sb.length
        for pos in sa.checkpoint_positions:
            for la, lb in zip(sa.at(pos).layers, sb.at(pos).layers):
                same_state(la, lb)
        for la, lb in zip(sa.layers, sb.layers):
            same_state(la, lb)
    # both states decode on identically
    nxt = [([int(lg[-1].argmax())], st) for lg, st in zip(whole, s_whole)]
    nxt2 = [([int(lg[-1].argmax())], st) for lg, st in zip(pieces, s_pieces)]
    for a, b in zip(model.forward(nxt), model.forward(nxt2)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    model.piece_tokens = None


def offload_engine(path, slots, stream="auto"):
    est = BandwidthEstimate(bp=1e9, bh=2e9, frozen=True)
    return Engine.from_pretrained(path, experts=experts_factory("offload", slots=slots, estimate=est,
                                                                stream_prefill=stream), expert_device="cpu")


def test_a_prompt_streams_the_expert_pool_once(checkpoints, engine_for):
    """Two layer buffers (2E slots) for four MoE layers: chunk by chunk, every chunk streams every layer
    again; layer-major, each layer is streamed once for the whole prompt. Output unchanged."""
    path = checkpoints["qwen3_5_moe", "fused"]
    experts = load_checkpoint(path)[2]
    prompt = [(7 * i + 3) % 250 for i in range(96)]
    ref = engine_for("qwen3_5_moe").generate(prompt, 6)
    fills = {}
    for piece in (None, 32):
        eng = offload_engine(path, 2 * experts.num_experts, stream="on")
        eng.model.piece_tokens = piece
        state = eng.model.new_state()
        chunks = [prompt] if piece else [prompt[a:a + 32] for a in range(0, len(prompt), 32)]
        for c in chunks:
            eng.model.forward([(c, state)])
        st = eng.model.experts.stats()
        fills[piece] = st["total"]["fills"]
        assert st["streamed_forwards"] == len(chunks)
        assert eng.generate(prompt, 6) == ref
        eng.model.experts.close()
    pool_experts = len(experts.layers) * experts.num_experts
    assert fills[32] <= pool_experts < fills[None]  # once, against three times
    assert fills[None] >= 2 * pool_experts


def test_engine_prefills_a_long_prompt_in_one_layer_major_forward(checkpoints, engine_for):
    path = checkpoints["qwen3_5_moe", "fused"]
    eng = offload_engine(path, 3)
    assert eng.model.piece_tokens is not None
    prompt = [(5 * i + 1) % 250 for i in range(1200)]  # more than one piece of 512
    assert eng.generate(prompt, 4) == engine_for("qwen3_5_moe").generate(prompt, 4)
    eng.model.experts.close()


def test_serving_gives_a_slot_backend_whole_prompts(checkpoints):
    path = checkpoints["qwen3_5_moe", "fused"]
    core = build_core(path, EngineOptions(moe_backend="offload", moe_slots="50%", prefix_cache=False,
                                          context_length=4096, max_step_tokens=64))
    assert core.scheduler.step_budget == 4096 and core.runner.model.piece_tokens == 64
    core.runner.model.experts.close()
    core = build_core(path, EngineOptions(moe_backend="offload", moe_slots="50%", prefix_cache=False,
                                          context_length=4096, max_step_tokens=64, max_prefill_tokens=256))
    assert core.scheduler.step_budget == 256 and core.runner.model.piece_tokens == 64
    core.runner.model.experts.close()
    fused = build_core(path, EngineOptions(moe_backend="fused", prefix_cache=False, context_length=4096,
                                           max_step_tokens=64))
    assert fused.scheduler.step_budget == 64 and fused.runner.model.piece_tokens is None


def test_prefill_budget_below_the_step_is_refused():
    with pytest.raises(ValueError, match="--max-prefill-tokens"):
        EngineOptions(max_step_tokens=512, max_prefill_tokens=100)


def test_last_rows_are_each_sequences_last():
    """A prompt batch's head reads each sequence's last row: one sequence's as a slice of h, several through an
    index (on CUDA from page-locked memory, so queuing the head waits for nothing)."""
    from engine.models.pieces import last_rows

    h = torch.arange(40.0).reshape(10, 4)
    assert torch.equal(last_rows(h, [0], [10]), h[9:10]) and last_rows(h, [0], [10]).data_ptr() == h[9].data_ptr()
    assert torch.equal(last_rows(h, [0, 3, 4], [3, 1, 6]), h[[2, 3, 9]])
