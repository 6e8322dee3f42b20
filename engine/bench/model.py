"""`killick bench model`: the whole engine as serving runs it (EngineCore -> scheduler -> runner -> model),
on a checkpoint directory or a synthetic model of a real model's widths drawn on the device.

    killick bench model --synthetic qwen3.6-35b-a3b --layers 8 --json out.json
    killick bench model --model DIR --device cuda --dtype bfloat16      (or python -m engine.bench.model)

Rows: decode at each batch size (concurrent requests through the real scheduler, greedy, steady state),
prefill of one long prompt, and the time to first token of a short extend after that prompt is cached.
Beside each decode row, an in-process bound: the bytes one decode step must move (non-expert weights,
the experts a batch routes to under uniform routing, or under the Zipf law a synthetic router was scaled to with
--router-zipf, the KV it attends over, each sequence's DeltaNet state read and written) at the device-to-device
copy rate measured in the same process. Prints a table; --json writes it (engine/bench/peers/compare.py reads it).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import numpy as np
import torch

from engine.bench.args import set_expert_threads_from
from engine.bench.report import batch_scaling
from engine.bench.traffic import ExpertTraffic


def hbm_rate(device, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (the median of reps)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return nbytes / sorted(times)[len(times) // 2]


def step_bytes(cfg, itemsize: int, batch: int, context: int, popularity=None) -> dict:
    """Bytes one decode step of `batch` sequences at `context` tokens must move, by part (from the config:
    every projection, router and shared expert read once, the lm_head once, the experts the batch routes to, the
    KV of every sequence, and every sequence's DeltaNet state, read and written: the fp32 recurrent state and the
    conv window in the model's dtype). popularity: [E] each expert's chance to be among a token's top-k (summing
    to top-k; a synthetic router's Zipf law, zipf.zipf_popularity), else uniform: a layer's distinct experts are
    sum over e of 1 - (1 - p_e)^batch."""
    H = cfg.hidden_size
    weights = 0
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            q = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
            weights += (q + 2 * cfg.num_kv_heads * cfg.head_dim) * H + cfg.num_heads * cfg.head_dim * H
        else:
            values = cfg.linear_num_v_heads * cfg.linear_v_head_dim
            weights += (cfg.conv_dim + values + 2 * cfg.linear_num_v_heads) * H + values * H
        if layer in cfg.dense_layers:
            weights += 3 * cfg.intermediate_size * H
        else:
            weights += cfg.num_experts * H + (H + 3 * cfg.shared_expert_intermediate_size * H
                                              if cfg.shared_expert_intermediate_size else 0)
    E, K = cfg.num_experts, cfg.top_k
    p = np.full(E, K / E) if popularity is None else np.asarray(popularity, dtype=np.float64)
    active = float((1 - (1 - p) ** batch).sum())  # expected distinct experts a layer
    experts = active * 3 * cfg.moe_intermediate_size * H * len(cfg.moe_layers)
    attn_layers = sum(1 for t in cfg.layer_types if t == "full_attention")
    kv = attn_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * 2
    out = {"weights": weights, "lm_head": cfg.vocab_size * H, "experts": experts, "kv": kv}
    out = {k: v * itemsize for k, v in out.items()}
    linear_layers = len(cfg.layer_types) - attn_layers
    recurrent = cfg.linear_num_v_heads * cfg.linear_k_head_dim * cfg.linear_v_head_dim * 4
    conv = cfg.conv_dim * (cfg.conv_kernel - 1) * itemsize
    out["state"] = 2 * linear_layers * batch * (recurrent + conv)
    out["total"] = sum(out.values())
    return out


class Collector:
    """Token timestamps per request, taken on the engine thread as events are published."""

    def __init__(self, probe=None, at: tuple[int, ...] = ()) -> None:
        self.times: dict[str, list[float]] = {}
        self.probe, self.at = probe, at  # probe() taken when the first request's token count reaches each of at
        self.probed: dict[int, object] = {}
        self.final: dict[str, object] = {}
        self.done = threading.Event()
        self.pending = 0
        self.order: list[str] = []  # request ids in submission order

    def sink(self, rid: str):
        self.times[rid] = []
        self.pending += 1
        first = len(self.times) == 1

        def on_event(ev) -> None:
            if ev.token_ids:
                had = len(self.times[rid])
                self.times[rid].extend([time.perf_counter()] * len(ev.token_ids))
                if first and self.probe is not None:
                    for n in self.at:
                        if had < n <= len(self.times[rid]):
                            self.probed[n] = self.probe()
            if ev.final:
                self.final[rid] = ev
                self.pending -= 1
                if self.pending == 0:
                    self.done.set()

        return on_event


def run_requests(core, prompts: list[list[int]], new_tokens: int, timeout: float = 600.0,
                 col: Collector | None = None, temperature: float = 0.0) -> Collector:
    from engine.api import GenerateRequest, SamplingParams

    col = col or Collector()
    reqs = [GenerateRequest(p, new_tokens, sampling=SamplingParams(temperature)) for p in prompts]
    for r in reqs:
        core.submit(r, col.sink(r.request_id))
    if not col.done.wait(timeout):
        raise TimeoutError(f"{len(prompts)} requests did not finish in {timeout} s")
    for r in reqs:
        ev = col.final[r.request_id]
        if ev.finish_reason == "error":
            raise RuntimeError(ev.error)
    col.order = [r.request_id for r in reqs]
    return col


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Prompts:
    """Prompt ids of n tokens from a seed: uniform random ids, or (a tokenizer given) the first n tokens of the
    text `engine.bench.serve` sends, whose repeated words route the experts unevenly, as a chat prompt does."""

    def __init__(self, vocab: int, tokenizer=None):
        self.vocab, self.tokenizer = vocab, tokenizer

    @classmethod
    def of_text(cls, vocab: int, model_dir: str) -> "Prompts":
        from pathlib import Path

        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"--text-prompts: no tokenizer.json in {model_dir}; give a checkpoint with one")
        return cls(vocab, Tokenizer.from_file(str(path)))

    def __call__(self, n: int, seed: int) -> list[int]:
        if self.tokenizer is None:
            return random_prompt(n, self.vocab, seed)
        from engine.bench.serve import prompt_text

        words = n // 3 + 8
        while True:
            ids = self.tokenizer.encode(prompt_text(words, seed), add_special_tokens=False).ids
            if len(ids) >= n:
                return ids[:n]
            words *= 2


def bench_decode(core, prompt, batch: int, args, seed: int, probe=None) -> tuple[float, tuple, dict]:
    """-> (seconds per decode step of `batch` concurrent requests (request 0's tokens after the warm-up),
    probe() at the first and the last timed token, or Nones without a probe, the engine thread's split of a
    decode step over the timed requests: engine.bench.serve.decode_split, as serve's /metrics give it). The
    probe runs on the engine thread as the token is published, so it sees the counters of exactly the timed
    steps."""
    from engine.bench.serve import decode_split

    prompts = [prompt(args.prompt, seed + i) for i in range(batch)]
    run_requests(core, prompts, args.warmup, temperature=args.temperature)  # compiles, captures the graph
    ends = (args.warmup, args.warmup + args.steps)
    # one token past the window: a request's last token is published after the engine caches the turn (one
    # more forward step, runner._cache_turn), which must not land in the timed steps
    before = core.stats()
    col = run_requests(core, [prompt(args.prompt, seed + 100 + i) for i in range(batch)],
                       args.warmup + args.steps + 1, col=Collector(probe, ends), temperature=args.temperature)
    after = core.stats()
    split = decode_split(*(after[k] - before[k] for k in ("decode_steps", "decode_step_seconds",
                                                           "decode_runner_seconds")))
    t = col.times[col.order[0]]
    return (t[ends[1] - 1] - t[ends[0] - 1]) / args.steps, (col.probed.get(ends[0]), col.probed.get(ends[1])), split


class PrefillRuns(NamedTuple):
    """What bench_prefill measured: the long prompt's seconds (the median of --prefill-runs fresh prompts) and
    each run's; each extend's TTFT (--extend-runs, each after a cached prompt of its own) and what its expert
    cache did (ExpertTraffic.extend_run); the tokens the last extend reused; the expert counters before the last
    timed prompt, after it, after the last extend's prompt and when that extend arrived (--extend-idle-ms
    later)."""
    prefill_s: float
    runs_s: list
    ttfts: list
    extend_runs: list
    reused: int
    before: dict | None
    between: dict | None
    ended: dict | None
    arrival: dict | None


def bench_prefill(core, draw, args, seed: int, cache: ExpertTraffic) -> PrefillRuns:
    """The long prompt and the extends after it (PrefillRuns), after an untimed prompt of the same size and two
    extends of it."""
    warm = draw(args.prefill, seed)
    run_requests(core, [warm], 1)  # warm-up at the same size...
    # ...and two extends of it, each as long as a timed one (the context holds one): the paths an extend takes
    # (routed layer calls; the hybrid split explores each arm three times before it trusts its rates, a layer
    # call each) warm up too, not in the timed extends
    for i in range(2):
        run_requests(core, [warm + draw(args.extend, seed + 50 + i)], 1)
    times = []
    for i in range(max(1, args.prefill_runs)):  # one run alone varied by 25% between machines (H200 box)
        before = cache.mark()
        prompt = draw(args.prefill, seed + 1 + 3 * i)
        first = run_requests(core, [prompt], 1)
        times.append(first.final[first.order[0]].usage.ttft_s)
    prefill_s = statistics.median(times)
    between = cache.mark()
    ttfts, extend_runs = [], []
    for j in range(max(1, args.extend_runs)):
        if j:  # each further extend after a fresh long prompt of its own, not timed
            prompt = draw(args.prefill, seed + 100 + j)
            run_requests(core, [prompt], 1)
        ended = cache.mark()
        if args.extend_idle_ms > 0:
            time.sleep(args.extend_idle_ms / 1e3)
        arrival, chose = cache.mark(), cache.choices()
        ext = run_requests(core, [prompt + draw(args.extend, seed + 2 + j)], 1)
        usage = ext.final[ext.order[0]].usage
        ttfts.append(usage.ttft_s)
        extend_runs.append({"ms": usage.ttft_s * 1e3, **cache.extend_run(arrival, chose)})
    return PrefillRuns(prefill_s, times, ttfts, extend_runs, usage.reused_tokens, before, between, ended, arrival)


def build(args):
    from engine.build import EngineOptions, build_core
    from engine.experts.registry import experts_factory
    from engine.models import load_model, parse_dtype
    from engine.synth import synth_model

    dtype = parse_dtype(args.dtype)
    zipf = args.router_zipf
    cached = args.moe_backend != "fused"
    if cached:
        set_expert_threads_from(args)
    where = dict(experts=experts_factory(args.moe_backend, device=args.device, slots=args.moe_slots,
                                         slot_policy=args.slot_policy, decode=args.moe_decode,
                                         prefetch=args.moe_prefetch, lookahead=args.moe_lookahead,
                                         refresh=args.moe_refresh, stream_prefill=args.prefill_stream),
                 expert_device="cpu") if cached else {}
    if args.model:
        if zipf:
            raise ValueError("--router-zipf skews a synthetic model's routers; a checkpoint routes as it was trained")
        model = load_model(args.model, device=args.device, dtype=dtype, **where)
        name = args.model
    else:
        model, _ = synth_model(args.synthetic, args.layers, device=args.device, dtype=dtype, router_zipf=zipf,
                               **where)
        name = f"synthetic {args.synthetic}, {model.config.num_layers} layers" + (
            f", router Zipf a={zipf}" if zipf else "")
    batches = args.batches
    context = args.prefill + args.extend + 64 if args.prefill else args.prompt + args.warmup + args.steps + 64
    given = {k: getattr(args, k) for k in ("max_step_tokens", "max_prefill_tokens") if getattr(args, k)}
    opts = EngineOptions(device=args.device, dtype=args.dtype, max_running=max(batches), context_length=context,
                         fast_path=not args.eager, overlap=args.overlap, **given)
    return build_core(None, opts, model=model).start(), model, name, batches, context


def run(args) -> dict:
    if args.text_prompts and not args.model:
        raise ValueError("--text-prompts tokenizes text with a checkpoint's tokenizer: give --model DIR")
    if args.device is None:
        from engine.flags import default_device

        args.device = default_device()
    from engine.kernels.deltanet_triton import set_rule_tiles
    from engine.kernels.linear_triton import set_skinny_tiles
    from engine.models import fast

    from engine.experts import cpu_jobs

    seam, join = fast.SEAM_TOPK, cpu_jobs.JOIN_ON_DEVICE  # (--cpu-join sets the join as serve does, in _run)
    set_rule_tiles(args.rule_tiles)
    set_skinny_tiles(args.skinny_tiles)
    fast.set_seam_topk(args.seam_topk or seam)
    try:
        res = _run(args)
    finally:
        set_rule_tiles(None)
        set_skinny_tiles(None)
        fast.set_seam_topk(seam)
        cpu_jobs.set_join_on_device(join)
    if args.rule_tiles is not None:
        res["rule_tiles"] = list(args.rule_tiles)
    if args.skinny_tiles is not None:
        res["skinny_tiles"] = {k: list(v) for k, v in args.skinny_tiles.items()}
    return dict(res, seam_topk=args.seam_topk or seam, cpu_join=args.cpu_join if args.moe_backend != "fused" else None)


def _run(args) -> dict:
    core, model, name, batches, context = build(args)
    if args.cpu_share is not None:
        cpu = model.fast.mapped.cpu if model.fast is not None and model.fast.mapped is not None else None
        if cpu is None:
            raise ValueError("--cpu-share sets the CPU share of a hybrid mapped decode; this run has none "
                             "(--moe-backend hybrid, CUDA or CPU with the native kernels built)")
        cpu.share, cpu.adapt = args.cpu_share, False
    vocab = model.config.vocab_size
    draw = Prompts.of_text(vocab, args.model) if args.text_prompts else Prompts(vocab)
    rate = hbm_rate(model.device) if model.device.type == "cuda" else float("nan")
    popularity = None  # the decode bound's routing: uniform, or the law a synthetic router was scaled to
    if args.router_zipf and model.config.num_experts:
        from engine.experts.zipf import zipf_popularity

        popularity = zipf_popularity(model.config.num_experts, model.config.top_k, args.router_zipf)
    cache = ExpertTraffic(model)
    placement = cache.placement()
    rows = []
    began = time.perf_counter()

    def done(name: str) -> None:  # progress on stderr, so a run cut off at its timeout still says how far it got
        print(f"[bench model] {name} done at {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)

    done("build")
    try:
        for b in batches:
            step, (start, end), split = bench_decode(core, draw, b, args, seed=1000 * b,
                                                     probe=cache.mark if cache.cached else None)
            need = step_bytes(model.config, model.dtype.itemsize, b, args.prompt + args.warmup + args.steps // 2,
                              popularity)
            bound = b * rate / need["total"]
            rows.append({"name": f"decode_b{b}", "placement": placement, "tok_s": b / step, "ms_per_step": step * 1e3,
                         "bound_tok_s": bound, "of_bound": (b / step) / bound, "step_bytes": need, **split,
                         **cache.since(start, upto=end), **cache.fill_bound(start, end, args.steps, b, step),
                         **cache.row_keys()})
            done(f"decode_b{b}")
        if args.prefill:
            pr = bench_prefill(core, draw, args, seed=7, cache=cache)
            ttft = statistics.median(pr.ttfts)
            rows.append({"name": f"prefill_{args.prefill}", "placement": placement,
                         "tok_s": args.prefill / pr.prefill_s, "seconds": pr.prefill_s, "runs_s": pr.runs_s,
                         **cache.since(pr.before, upto=pr.between), **cache.stream_bound(pr.prefill_s),
                         **cache.row_keys()})
            moved = cache.since(pr.arrival)
            idle = cache.since(pr.ended, upto=pr.arrival).get("experts", {})
            rows.append({"name": f"extend_{args.extend}", "placement": placement, "ttft_ms": ttft * 1e3,
                         "reused_tokens": pr.reused, "tok_s": args.extend / ttft,
                         "runs_ms": [t * 1e3 for t in pr.ttfts], "extend_runs": pr.extend_runs,
                         "idle_ms": args.extend_idle_ms,
                         "idle_refreshed": idle.get("refreshed", 0), **moved,
                         **cache.stream_bound(ttft), **cache.dram_bound(moved, ttft), **cache.row_keys()})
            done("prefill and extend")
    finally:
        core.stop()
    return {"what": "whole engine: EngineCore -> scheduler -> ModelRunner -> Model", "model": name,
            **cache.split(), "path": "fast" if model.fast is not None else "eager",
            "decode_buckets": model.decode_steps.modes() if model.fast is not None else {},
            "prompt_buckets": model.fast.bucket_modes() if model.fast is not None else {},
            # fla-core's kernels, else the torch rule: ~1.5 ms of host time a DeltaNet layer of a prompt (H200 box)
            "prompt_rule": ("fla-core" if model.fast.chunked_rule is not None else "torch")
            if model.fast is not None else None,
            "overlap": core.runner.overlap, "temperature": args.temperature,
            "device": _device_name(model.device), "dtype": args.dtype,
            "prompts": "text (engine.bench.serve's)" if args.text_prompts else "random ids",
            "hbm_copy_gbs": rate / 1e9, "context": context, "placement": placement, **cache.header(),
            "batch_scaling": batch_scaling(rows, rate), "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
            "rows": rows}


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_args(args) -> int:
    from engine.bench.args import print_and_save
    from engine.bench.report import print_table

    return print_and_save(run(args), print_table, args.json)


def main(argv=None) -> int:
    from engine.bench.args import add_model_arguments

    p = argparse.ArgumentParser(prog="killick bench model", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
