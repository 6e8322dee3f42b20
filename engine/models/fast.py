"""The fast path of the decoder: fused projections, Triton kernels, per-sequence state in a StatePool.

    fast = FastPath(model, pool)
    fast.forward(items, logits)                    # like Model.forward; every state is a slot state
    fast.decode(ids, slots, positions, valid)      # one token per sequence, static shapes, no host sync:
                                                   # what a CUDA graph captures (engine/models/graphs.py)

A decode step per layer: add+norm, one projection (a skinny Triton kernel, as every decode projection), the mixer's
kernels (qk-norm/RoPE/KV store + split attention, or conv step + delta rule with its gated norm), the o/out
projection, add+norm with the router's logits in the same launch, then two expert kernels: for one token the first
routes each pair's token itself, for 2-16 a routing launch (or, with SEAM_TOPK, the add+norm's launch: its last
block of logits) routes each row and each expert is read once for all its pairs; the next add+norm sums the
experts' rows into the residual. With an expert cache a step is segments of device work around each MoE layer's
routed experts, which the cache runs on the host's schedule (decode_segments). Prefill chunks run the same
projections with the prefill attention kernel, the DeltaNet gates, conv and gated norm one launch each, the chunked
delta rule (fla's kernels on CUDA) and experts grouped per expert; a short run's rule (for one sequence without
checkpoints inside it, the DeltaNet layer's whole work between its projections) and, with an expert cache, its
routing are padded to a token bucket and replayed as graphs (token_graphs.py).
N = tokens, B = sequences, H = hidden, V = vocab, KP = expert pairs per token.
"""
from __future__ import annotations

import contextlib
import functools

from collections.abc import Generator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.experts.registry import is_expert_cache
from engine.kernels.attention_triton import (decode_attention, decode_splits, prefill_attention, prefill_block,
                                             prefill_tiles, qk_rope_store)
from engine.kernels.deltanet_prefill_triton import conv_prefill, prefill_gates
from engine.kernels.deltanet_triton import TAIL_TOKENS, conv_step, gated_norm, rule_step
from engine.kernels.linear_triton import SKINNY_ROWS, skinny_linear
from engine.kernels.mailbox_triton import join, publish
from engine.kernels.moe_pairs_triton import (GROUP_PAIRS, PAIR_ROWS, ROUTE_GROUP_TOKENS, blocks_for, group_blocks,
                                             route_topk)
from engine.kernels.moe_triton import run_experts, run_experts_routed
from engine.kernels.norm_triton import SeamRoute, add_rms_norm, add_rms_norm_guess, add_rms_norm_router
from engine.layers.mlp import swiglu_fused
from engine.layers.moe import MoE
from engine.models.fused import (CachedMoE, FusedAttention, FusedMoE, fuse_attention, fuse_cached_moe, fuse_deltanet,
                                 fuse_moe)
from engine.models.pieces import last_rows, one_expert_pass, piece_rows, piece_spans, row_pieces
from engine.models.token_graphs import BucketedMixer, BucketedRoute, BucketedRule

# Decode steps of 2-16 tokens route each row in the add+norm+router launch (its program that finishes a row's
# logits runs the top-k), one launch a MoE layer fewer. Off until it has run on a GPU: its programs hand data to
# each other within a launch (launch.last_to_finish), an ordering Triton's interpreter and the sm_90 PTX read
# here do not prove; tests/gpu/test_fast_cuda.py runs it both ways. set_seam_topk() switches it.
SEAM_TOPK = False


def set_seam_topk(on: bool) -> None:
    global SEAM_TOPK
    SEAM_TOPK = bool(on)


class FastPath:
    def __init__(self, model, pool, chunked_rule=None, tail_rule=None, capture: bool = False):
        """capture: a prompt's short runs (token_graphs.py) replay CUDA graphs, else launch the same shapes."""
        cfg = model.config
        self.model, self.pool, self.cfg = model, pool, cfg
        self.prompt_route = BucketedRoute(route_cached, capture)  # an expert-cache layer's routing of a prompt
        self.use_rule(chunked_rule)
        self.mixers, self.mlps = [], []
        # an expert cache keeps the routed experts (host pool + device slots): its layers route here and run
        # the experts through it; a decode step is graphs between those layers (graphs.py)
        self.cached_experts = is_expert_cache(model.experts)
        if self.cached_experts and hasattr(model.experts, "prompt_graphs"):  # a prompt's wholly resident layers:
            model.experts.prompt_graphs(capture)  # their experts one graph a bucket too
        # mapped decode (engine/experts/mapped.py): the cache's missing experts read in place by the kernels,
        # the step one graph; None: the host runs each cache layer's experts between graphs (segments)
        self.mapped = model.experts.mapped_decode() \
            if self.cached_experts and model.experts.pool.dtype == model.dtype else None
        self.routes: torch.Tensor | None = None  # mapped: the last step's routes [L, N, KP] int32
        fuse_mlp = fuse_cached_moe if self.cached_experts else fuse_moe
        for layer in model.layers:
            mixer = fuse_attention(layer.mixer, cfg) if layer.is_attention else fuse_deltanet(layer.mixer, cfg)
            self.mixers.append(mixer)
            self.mlps.append(fuse_mlp(layer.mlp, cfg) if isinstance(layer.mlp, MoE) else layer.mlp)
            if not layer.is_attention:
                layer.mixer.prefill_conv = functools.partial(conv_prefill, conv_w=mixer.conv_w)
                if tail_rule is not None:
                    layer.mixer.tail_rule, layer.mixer.tail_tokens = tail_rule, TAIL_TOKENS
        # mapped with prefetch: each cache layer's likely expert copied in on this stream while its mixer runs
        self._guess_stream = None
        if self.mapped is not None and self.mapped.prefetch and model.device.type == "cuda":
            self._guess_stream = torch.cuda.Stream(model.device)
        if self.mapped is not None:
            first = next(m for m in self.mlps if isinstance(m, CachedMoE))
            self._route_width = first.top_k + self.mapped.folds(first)  # KP of a step's routes
            # hybrid: the CPU's share of the misses runs inside the step (engine/experts/graph_cpu.py); the
            # router's fingerprint keeps one model's settled share from another's of the same shape
            router = first.router_w.float()
            tag = f"router {router.abs().sum().item():.6e} {router.sum().item():.6e}"
            self.mapped.enable_cpu(pool.slots + 1, self._route_width, model.dtype, tag=tag)  # <= slots + 1 rows
        norms = [layer.input_norm for layer in model.layers] + [model.final_norm]
        self.norms = [(layer.post_norm, norms[i + 1]) for i, layer in enumerate(model.layers)]
        self.splits = decode_splits(pool.capacity)

    def use_rule(self, rule, mixer: bool = True) -> None:
        """rule: a prompt's chunked DeltaNet rule for every DeltaNet layer (None: the eager layers' own). Where it is
        a BucketedRule and `mixer`, a prompt's DeltaNet layers of one short run take the bucketed mixer over its
        rule between their projections (same capture and buckets)."""
        self.chunked_rule = rule
        if rule is not None:
            for layer in self.model.layers:
                if not layer.is_attention:
                    layer.mixer.chunked_rule = rule
        bucketed = mixer and isinstance(rule, BucketedRule)
        self.prompt_mixer = BucketedMixer(rule.rule, rule.capture, rule.buckets) if bucketed else None

    def bucket_modes(self) -> dict[str, dict[int, str]]:
        """How a prompt's short runs went by token bucket so far (token_graphs.py: graph or direct): the chunked
        delta rule's (when it is a BucketedRule), the DeltaNet layers' (mixer), the expert-cache layers' routing and
        their wholly resident layers' experts (unread: SlotRunner.unread)."""
        rule = self.chunked_rule.modes() if isinstance(self.chunked_rule, BucketedRule) else {}
        mixer = self.prompt_mixer.modes() if self.prompt_mixer is not None else {}
        runner = getattr(self.model.experts, "runner", None) if self.cached_experts else None
        unread = runner.unread_modes() if runner is not None else {}
        return {name: modes for name, modes in (("rule", rule), ("route", self.prompt_route.modes()),
                                                ("mixer", mixer), ("unread", unread)) if modes}

    # -- one token per sequence -----------------------------------------------------------------------
    def decode(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B] int64, slots / positions [B] int32 (device) -> logits [B, V] fp32. valid [B] int8: 0
        marks padding rows (their slot is the pool's scratch row; they route to no expert)."""
        if self.mapped is not None:
            self.mapped.begin(ids.shape[0])
        logits = self.decode_step(ids, slots, positions, valid)
        if self.mapped is not None:
            self.mapped.end(self.routes, ids.shape[0])
        return logits

    def decode_step(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                    valid: torch.Tensor | None = None) -> torch.Tensor:
        """decode's device work alone: what one graph captures (the host's part of an expert cache runs
        inside it, between its layers; a mapped cache's runs around it, in decode)."""
        segments, y = self.decode_segments(ids, slots, positions, valid), None
        try:
            while True:
                y = segments.send(y).run()
        except StopIteration as done:
            return done.value

    def decode_segments(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                        valid: torch.Tensor | None = None) -> Generator["ExpertCall", torch.Tensor, torch.Tensor]:
        """The decode step in segments of device work: at each expert-cache layer it yields an ExpertCall (the
        routed experts' inputs, whose fills and CPU runs the host decides) and takes back their output [B, H];
        it returns the logits. Without an expert cache it yields nothing. Each segment can be a CUDA graph
        (graphs.py): the host then runs only the cache's part of each layer."""
        model, zc, eps = self.model, self.cfg.zero_centered_norm, self.cfg.rms_norm_eps
        x = F.embedding(ids, model.embed)
        x, h = add_rms_norm(x, None, model.layers[0].input_norm, eps, zc)
        if self.mapped is not None:
            self.routes = torch.empty(self.mapped.L, ids.shape[0], self._route_width, dtype=torch.int32,
                                      device=ids.device)
        guess = None  # the prefetch for the next cache layer, issued at the end of the layer before it
        joins: list = []  # what the guess stream reads, kept until the step waits for that stream (below)
        for i, layer in enumerate(model.layers):
            m, state = self.mixers[i], self.pool.layers[i]
            if isinstance(m, FusedAttention):
                proj = _decode_linear(h, m.qkv_w)
                q = torch.empty(h.shape[0], m.consts.heads, m.consts.head_dim, dtype=h.dtype, device=h.device)
                qk_rope_store(proj, q, state[0], state[1], slots, positions, m.consts)
                mix = _decode_linear(decode_attention(q, proj, state[0], state[1], slots, positions, m.consts,
                                                 splits=self.splits), m.o_w)
            else:
                proj = _decode_linear(h, m.in_w)
                qkv = conv_step(proj, state[0], slots, m.conv_w)
                mix = _decode_linear(rule_step(qkv, proj, state[1], slots, m.consts), m.out_w)
            if isinstance(self.mlps[i], CachedMoE) and self.mapped is not None:
                x, rows = self._decode_mapped(self.mlps[i], x, mix, self.norms[i][0], valid, guess)
                guess = None
            elif isinstance(self.mlps[i], CachedMoE):
                x, h = add_rms_norm(x, mix, self.norms[i][0], eps, zc)
                call = route_cached(self.mlps[i], h, valid)
                rows = call.finish((yield call))
            else:
                x, rows = self._decode_mlp(i, x, mix, valid)
            nxt = self.mlps[i + 1] if i + 1 < len(self.mlps) else None
            if self.mapped is not None and isinstance(nxt, CachedMoE) and self.mapped.staged(nxt.layer):
                # the seam computes the next layer's guess too: the pick and the copy follow on the guess stream
                x, h, logits = add_rms_norm_guess(x, rows, self.norms[i][1], eps, zc, self.norms[i + 1][0],
                                                  nxt.router_w[: self.mapped.E])
                guess = self._guess(i + 1, logits, valid)
                joins.append(guess[1])
            else:
                x, h = add_rms_norm(x, rows, self.norms[i][1], eps, zc)
        if any(joins):  # the last copies ran beside the layers' kernels: the step ends with both streams done
            torch.cuda.current_stream(h.device).wait_stream(self._guess_stream)
        return _decode_linear(h, model.lm_head, torch.float32)

    def _guess(self, j: int, logits: torch.Tensor, valid: torch.Tensor | None):
        """logits [N, E] fp32: layer j's router on the residual entering it (its mixer not yet added), from the
        seam before it (norm_triton.add_rms_norm_guess). The likely expert they give is copied in for its
        gate/up kernel (MappedExperts.stage): on the guess stream beside the mixer on CUDA, inline elsewhere.
        -> (event after the pick, which the layer's experts wait for, or None; the tensors the guess stream
        reads, kept until the step waits for that stream). The layer's experts do not wait for the copy: a
        staged tile waits for its rows inside the gate/up kernel, so a copy longer than the mixer no longer
        holds the whole layer back (H200 box, offload decode b1: the mixer leaves ~37 us, the guess and a 2 MB
        copy took ~60)."""
        mlp = self.mlps[j]
        if valid is None:
            valid = torch.ones(logits.shape[0], dtype=torch.int8, device=logits.device)
        side = self._guess_stream
        picked = None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(logits.device))
            picked = torch.cuda.Event()
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # launches without PDL (a programmatic edge across streams would hang): the pick, then the copy
            after_pick = None if picked is None else (lambda: picked.record(side))
            self.mapped.stage(mlp.layer, logits, valid, picked=after_pick)
        if side is None:
            return None, ()
        return picked, (logits, valid)  # the main stream must not reuse their blocks while this reads them

    def _decode_mlp(self, i: int, x: torch.Tensor, mix: torch.Tensor, valid: torch.Tensor | None):
        """The post-mixer add+norm and the MLP of one decode step -> (residual, rows to add to it)."""
        mlp, post = self.mlps[i], self.norms[i][0]
        zc, eps = self.cfg.zero_centered_norm, self.cfg.rms_norm_eps
        N = x.shape[0]
        if isinstance(mlp, FusedMoE) and mlp.shared is None:
            kp = mlp.top_k + mlp.shared_folded
            if N * kp < GROUP_PAIRS:
                if valid is None:
                    valid = torch.ones(N, dtype=torch.int8, device=x.device)
                ids = torch.empty(N, kp, dtype=torch.int32, device=x.device)
                w = torch.empty(N, kp, dtype=torch.float32, device=x.device)
                if SEAM_TOPK and ROUTE_GROUP_TOKENS <= N <= PAIR_ROWS:  # routed in the seam, experts read once
                    route = SeamRoute(mlp.top_k, mlp.norm_topk, mlp.shared_folded, valid, ids, w)
                    x, h, _ = add_rms_norm_router(x, mix, post, eps, zc, mlp.router_w, route=route)
                    return x, run_experts(h, mlp.gate_up, mlp.down, ids, w, group_blocks(ids))
                x, h, logits = add_rms_norm_router(x, mix, post, eps, zc, mlp.router_w)
                return x, run_experts_routed(h, mlp.gate_up, mlp.down, logits, mlp.top_k, mlp.norm_topk,
                                             mlp.shared_folded, valid, ids, w)
        x, h = add_rms_norm(x, mix, post, eps, zc)
        return x, self._mlp(i, h, valid)

    def _decode_mapped(self, mlp: CachedMoE, x, mix, post, valid, guess=None):
        """A cache layer's MoE inside the step's graph: routing in the gate/up kernel, each expert read from
        its slot or in place from the host pool (MappedExperts' table), the shared expert as pair K when its
        width is the routed ones' (else beside them). The pairs' ids land in the step's routes. guess: _guess's
        prefetch for this layer, which its experts wait for."""
        m, zc, eps = self.mapped, self.cfg.zero_centered_norm, self.cfg.rms_norm_eps
        x, h, logits = add_rms_norm_router(x, mix, post, eps, zc, mlp.router_w)
        N, E = x.shape[0], m.E
        if valid is None:
            valid = torch.ones(N, dtype=torch.int8, device=x.device)
        fold = m.folds(mlp)
        emap = m.layer_map(mlp.layer, *((mlp.shared_gate_up, mlp.shared_down) if fold else ()))
        ids = self.routes[m.row(mlp.layer)]  # [N, KP]
        w = torch.empty(ids.shape, dtype=torch.float32, device=x.device)
        gate_up, down = m.b.cache.all_weights()
        route = logits if fold or mlp.shared_gate_up is None else logits[:, :E]
        box = m.cpu
        if box is not None:  # the CPU starts on its pairs now, the kernels below skip them
            publish(box, m.row(mlp.layer), h, route, valid, mlp.top_k, mlp.norm_topk, fold)
        if guess is not None and guess[0] is not None:
            torch.cuda.current_stream(x.device).wait_event(guess[0])
        rows = run_experts_routed(h, gate_up, down, route, mlp.top_k, mlp.norm_topk, fold, valid, ids, w,
                                  mapped=emap)
        if box is not None:
            join(box, m.row(mlp.layer), rows, ids, w, emap.loc)
        if mlp.shared_gate_up is not None and not fold:
            gate = torch.sigmoid(logits[:, E:].float()).to(h.dtype)
            rows = torch.cat([rows, (gate * swiglu_fused(h, mlp.shared_gate_up, mlp.shared_down))[:, None]], dim=1)
        return x, rows

    # -- any batch of slot states ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, items: list, logits: str = "last") -> list[torch.Tensor]:
        """items: [(token ids LongTensor[T_i], SlotState)] -> per item logits [1, V] or [T_i, V] (fp32)."""
        dev = self.model.device
        ids = [torch.as_tensor(t, dtype=torch.long, device=dev).reshape(-1) for t, _ in items]
        lengths = [t.numel() for t in ids]
        states = [st for _, st in items]
        slots_tok = [st.slot for st, n in zip(states, lengths) for _ in range(n)]
        pos_tok = [p for st, n in zip(states, lengths) for p in range(st.length, st.length + n)]
        meta = torch.tensor([slots_tok, pos_tok], dtype=torch.int32).to(dev, non_blocking=True)
        tokens = ids[0] if len(ids) == 1 else torch.cat(ids)  # (one sequence, an extend: no copy to queue)
        one_each = all(n == 1 for n in lengths)
        if one_each:
            out = self.decode(tokens, meta[0], meta[1])
        else:
            out = self._prefill(tokens, meta[0], meta[1], lengths, states, logits)
        for st, n in zip(states, lengths):
            st.advance(n)
        return list(out.split(1 if one_each or logits == "last" else lengths))

    def _prefill(self, tokens, slots, positions, lengths, states, logits):
        """Every layer over the batch, in pieces of model.piece_tokens rows (layer-major) when it has more."""
        model, zc, eps = self.model, self.cfg.zero_centered_norm, self.cfg.rms_norm_eps
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        pieces = row_pieces(tokens.shape[0], model.piece_tokens)
        block = prefill_block(self.cfg.head_dim)[0]
        tiles = []  # per piece, from each sequence's (offset in the piece, rows, first position, slot)
        for a, b in pieces:
            rows = [(off, n, pos, st.slot) for st, off, n, pos in piece_rows(states, offsets, lengths, a, b)]
            tiles.append(prefill_tiles(rows, block, model.device))
        x = F.embedding(tokens, model.embed)
        x, h = add_rms_norm(x, None, model.layers[0].input_norm, eps, zc)
        with one_expert_pass(model.experts, tokens.shape[0], self.cfg.top_k, max(lengths)) as layers_done:
            for i in range(len(model.layers)):
                for (a, b), piece_tiles in zip(pieces, tiles):
                    spans = piece_spans(states, offsets, lengths, i, a, b)
                    # the piece's result goes straight into its rows of x and h: no copy a piece
                    self._prefill_layer(i, x[a:b], h[a:b], slots[a:b], positions[a:b], piece_tiles, spans,
                                        into=(x[a:b], h[a:b]))
            layers_done()
            if logits == "last":
                h = last_rows(h, offsets, lengths)
            return F.linear(h, model.lm_head).float()  # (queued before the cache's counting at the pass's end)

    def _prefill_layer(self, i, x, h, slots, positions, tiles, spans, into):
        """Layer i over rows x (residual) / h (its normed input): the residual and the next layer's normed input
        written into the pair `into` (it may be x and h themselves: both are read before)."""
        m, zc, eps = self.mixers[i], self.cfg.zero_centered_norm, self.cfg.rms_norm_eps
        if isinstance(m, FusedAttention):
            k, v = self.pool.layers[i]
            proj = F.linear(h, m.qkv_w)
            q = torch.empty(h.shape[0], m.consts.heads, m.consts.head_dim, dtype=h.dtype, device=h.device)
            qk_rope_store(proj, q, k, v, slots, positions, m.consts)
            mix = F.linear(prefill_attention(q, proj, k, v, tiles, m.consts), m.o_w)
        else:
            mix = self._deltanet_prefill(i, m, h, spans)
        post, nxt = self.norms[i]
        x, h = add_rms_norm(x, mix, post, eps, zc)
        return add_rms_norm(x, self._mlp(i, h, None), nxt, eps, zc, out=into)

    def _deltanet_prefill(self, i, m, h, spans):
        """Layer i's: the eager layer's per-sequence conv + chunked rule (with checkpoints), on one fused projection;
        the gates, the conv (the layer's prefill_conv) and the gated norm one launch each (a dozen torch ops apiece
        in the eager layer's). One short run without checkpoints: the work between the projections bucketed
        (token_graphs.BucketedMixer), one graph replay."""
        c = m.consts
        C = 2 * c.key_heads * c.key_dim + c.value_heads * c.value_dim
        values = c.value_heads * c.value_dim
        proj = F.linear(h, m.in_w)
        if self.prompt_mixer is not None and len(spans) == 1:
            normed = self.prompt_mixer(i, m, proj, spans[0])
            if normed is not None:
                return F.linear(normed, m.out_w)
        net = self.model.layers[i].mixer
        beta, g = prefill_gates(proj, C + values, C + values + c.value_heads, c.neg_A, c.dt_bias)
        out = torch.empty(h.shape[0], c.value_heads, c.value_dim, dtype=h.dtype, device=h.device)
        for span in spans:
            net.run_sequence(proj[:, :C], g, beta, span, out)
        return F.linear(gated_norm(out.view(h.shape[0], values), proj, C, c), m.out_w)

    def _mlp(self, i: int, h: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """-> rows to add to the residual: [N, KP, H] expert outputs (already weighted), or [N, 1, H]."""
        mlp = self.mlps[i]
        if isinstance(mlp, CachedMoE):  # route on the device, the routed experts through the cache
            call = self.prompt_route(mlp, h) if valid is None else route_cached(mlp, h, valid)
            return call.finish(call.run())
        if not isinstance(mlp, FusedMoE):
            return mlp(h)[:, None]
        ids, w = route_topk(F.linear(h, mlp.router_w), mlp.top_k, mlp.norm_topk, mlp.shared_folded, valid)
        y = run_experts(h, mlp.gate_up, mlp.down, ids, w, blocks_for(ids, mlp.gate_up.shape[0]))
        if mlp.shared is not None:
            shared = torch.sigmoid(F.linear(h, mlp.shared_gate_w)) * mlp.shared(h)
            y = torch.cat([y, shared[:, None]], dim=1)
        return y


class ExpertCall(NamedTuple):
    """One expert-cache layer's routed experts: run() them through the cache (on the host's schedule), then
    finish() adds the gated shared expert, computed on the device beforehand."""
    mlp: CachedMoE
    h: torch.Tensor  # [N, H]
    ids: torch.Tensor  # [N, K] int64
    w: torch.Tensor  # [N, K] in h's dtype
    shared: torch.Tensor | None  # [N, H] gated shared expert output

    def run(self) -> torch.Tensor:
        return self.mlp.backend.forward(self.mlp.layer, self.h, self.ids, self.w)  # [N, H]

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """-> [N, 1, H] rows to add to the residual."""
        return (y if self.shared is None else y + self.shared)[:, None]


def route_cached(mlp: CachedMoE, h: torch.Tensor, valid: torch.Tensor | None) -> ExpertCall:
    """Route on the device and compute the gated shared expert; valid: padding rows must not reach the cache
    (None: all real)."""
    has_shared = mlp.shared_gate_up is not None
    ids, w = route_topk(F.linear(h, mlp.router_w), mlp.top_k, mlp.norm_topk, has_shared, valid)
    K = mlp.top_k
    shared = w[:, K:].to(h.dtype) * swiglu_fused(h, mlp.shared_gate_up, mlp.shared_down) if has_shared else None
    return ExpertCall(mlp, h, ids[:, :K].long(), w[:, :K].to(h.dtype), shared)


def _decode_linear(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A decode step's projection: the skinny kernel reads w as fast as cuBLAS or faster for a few rows, in
    one launch where cuBLAS splits K and reduces in a second, and chains with its neighbours' launches
    (engine/kernels/launch.py; engine/bench/tiles.py, docs/PERF.md issue 20)."""
    if x.shape[0] <= SKINNY_ROWS and x.is_contiguous() and x.dtype == w.dtype and w.is_contiguous():
        return skinny_linear(x, w, dtype=dtype)
    y = F.linear(x, w)
    return y if dtype is None else y.to(dtype)
