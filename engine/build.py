"""One place that turns options into a running engine: model + prefix cache + runner + serving core.

`killick serve`, `demo` and `replay` all build through here, so their engine flags mean the same thing.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from engine.flags import CPU_JOINS, add_cpu_expert_arguments, add_dtype_argument, device_arg, moe_slots_arg
from engine.serving import EngineCore

log = logging.getLogger("killick.engine")
DEFAULT_CONTEXT = 32768  # a model whose config declares no window
STATE_SHARE = 0.25  # of the device's free memory (CPU: MemAvailable) that the sequences' state may take


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: str = "float32"
    max_running: int = 4
    max_queue: int = 64
    max_step_tokens: int | None = None  # None: 512 on CPU, 2048 on CUDA (see step_tokens)
    context_length: int | None = None
    prefix_cache: bool = True
    cache_device_mb: int | None = None  # None: a share of free device memory (CPU: of free RAM)
    cache_host_mb: int | None = None  # None: half of MemAvailable
    moe_backend: str = "auto"  # fused | offload | cpu | hybrid | auto (engine/experts/registry.py)
    moe_slots: str | None = None  # N, N% of all experts, or None: all the device memory left
    max_prefill_tokens: int | None = None  # None: the context with an expert cache, else max_step_tokens
    expert_threads: int | None = None  # CPU expert workers (cpu/hybrid); None: see expert_threads()
    prompt_expert_threads: int | None = None  # the same for a prompt's experts; None: expert_threads
    expert_tile_tokens: int | None = None  # CPU experts' tile path from this many tokens an expert; None: ISA's
    cpu_join: str = "device"  # where a prompt's CPU expert outputs join the layer: device | host (cpu_jobs.py)
    slot_policy: str = "lfu"  # which expert slot a fill evicts: lfu (popularity, decayed) or lru
    moe_decode: str = "auto"  # fast-path decode through the expert cache: mapped | host | auto (offload.py)
    moe_prefetch: str = "auto"  # on: a mapped decode copies each layer's likely expert in while its mixer runs
    moe_lookahead: str = "auto"  # on: a routed prompt copies the next layer's likely misses while a layer runs
    moe_refresh: str = "auto"  # on: idle time moves the hottest experts not in a slot into the coldest slots
    fast_path: bool = True  # CUDA: Triton kernels, static state slots, decode steps as CUDA graphs
    overlap: bool = True  # CUDA: queue the next decode step from the last one's tokens still on the device
    # (False: each step's tokens read first; the CPU never overlaps, a queued step runs at once there)

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"--max-running must be at least 1, got {self.max_running}")
        if self.max_queue < 1:  # every request waits there, however briefly, before the engine takes it
            raise ValueError(f"--max-queue must be at least 1 (requests wait there until the engine takes them), "
                             f"got {self.max_queue}")
        if self.max_step_tokens is not None and self.max_step_tokens < self.max_running:
            raise ValueError("--max-step-tokens must be at least --max-running")
        if (self.max_prefill_tokens is not None and self.max_step_tokens is not None
                and self.max_prefill_tokens < self.max_step_tokens):
            raise ValueError(f"--max-prefill-tokens ({self.max_prefill_tokens}) must be at least "
                             f"--max-step-tokens ({self.max_step_tokens})")
        for name in ("context_length", "cache_device_mb", "cache_host_mb", "max_prefill_tokens", "expert_threads",
                     "prompt_expert_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.expert_tile_tokens is not None and self.expert_tile_tokens < 0:
            raise ValueError(f"--expert-tile-tokens must be >= 0 (0: never), got {self.expert_tile_tokens}")
        if self.cpu_join not in CPU_JOINS:
            raise ValueError(f"--cpu-join must be {' or '.join(CPU_JOINS)}, got {self.cpu_join!r}")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N] (default cpu)")
    add_dtype_argument(g)
    g.add_argument("--max-running", type=int, default=4, help="requests decoded together (default 4)")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for the engine (default 64); more answer 429")
    g.add_argument("--max-step-tokens", type=int,
                   help="tokens per engine step, i.e. the prefill chunk (default 512 on CPU, 2048 on CUDA); a "
                        "prompt's tail of up to an eighth of it rides with the chunk before")
    g.add_argument("--max-prefill-tokens", type=int,
                   help="prompt tokens one step may take, each layer running over them in --max-step-tokens "
                        "pieces before the next layer (layer-major). Default: the whole context with an expert "
                        "cache (offload/cpu/hybrid: the expert pool then streams once per prompt instead of "
                        "once per chunk), else --max-step-tokens")
    g.add_argument("--context-length", type=int,
                   help="tokens per request, prompt + output (default: what the model's config declares, "
                        f"max_position_embeddings, or {DEFAULT_CONTEXT} when it says nothing; lowered so the "
                        f"state of --max-running + 1 sequences fits in {STATE_SHARE * 100:.0f}%% of free memory)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="re-prefill every prompt from scratch (for comparisons)")
    g.add_argument("--cache-device-mb", type=int, help="prefix cache budget on the device (MiB)")
    g.add_argument("--cache-host-mb", type=int, help="prefix cache budget in host RAM (MiB; default half of free)")
    g.add_argument("--moe-backend", default="auto", choices=["auto", "fused", "offload", "cpu", "hybrid"],
                   help="where routed experts run: fused (all on the device), offload (misses copied into "
                        "device slots), cpu (misses run on the CPU), hybrid (q* split); auto picks (default)")
    g.add_argument("--eager", dest="fast_path", action="store_false",
                   help="CUDA: run the eager reference path instead of the fast one (kernels, CUDA graphs)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="CUDA: read each decode step's tokens before the next step is queued (for comparisons; by "
                        "default the next step starts from the tokens still on the device, so the host's work "
                        "between steps runs while the device computes)")
    g.add_argument("--moe-slots", type=moe_slots_arg, metavar="N|P%",
                   help="device expert slots for offload/cpu/hybrid (and auto: then an expert cache of that size): a "
                        "count or a percentage of all experts (default: the device memory left after the state "
                        "slots and a prefill step's room)")
    g.add_argument("--slot-policy", default="lfu", choices=["lfu", "lru"],
                   help="which cached expert a fill evicts: lfu, the least used lately (uses halve in weight every "
                        "256 tokens), or lru, the least recently used (default lfu: at batch 1 the layers cycle and "
                        "LRU evicts popular experts between their uses; docs/PERF.md, bench routing)")
    g.add_argument("--moe-decode", default="auto", choices=["auto", "mapped", "host"],
                   help="how the fast path decodes through the expert cache: mapped (the kernels read missing "
                        "experts in place from the pinned host pool over PCIe; a step is one CUDA graph), host (the "
                        "host copies misses into slots or runs them on the CPU, layer by layer) or auto (mapped, "
                        "but host for --moe-backend cpu; default)")
    g.add_argument("--moe-prefetch", default="auto", choices=["auto", "on", "off"],
                   help="with a mapped decode: at the end of each layer guess the next layer's likely expert (its "
                        "router on the hidden state so far) and copy part of its gate/up weights to the device "
                        "while the next layer's attention runs, when the PCIe link would idle (default auto: on "
                        "for a mapped decode on CUDA; H200: 86%% of guesses right, decode 1-2%% faster, "
                        "docs/PERF.md)")
    g.add_argument("--moe-lookahead", default="auto", choices=["auto", "on", "off"],
                   help="a prompt served expert by expert (not streamed whole) copies the next layer's likely "
                        "missing experts (touched with probability >= 0.9 by the cache's recent routing) while a "
                        "layer runs, into slots of experts the prompt will likely not read, so PCIe does not "
                        "wait for each layer's routing (default auto: on CUDA; H200, 256-token extends: 1.07-1.08x, "
                        "docs/PERF.md; counted as fills and as `ahead` / `ahead_used` in the expert stats)")
    g.add_argument("--moe-refresh", default="auto", choices=["auto", "on", "off"],
                   help="while no request runs or waits, move the hottest experts not in a slot (by the cache's "
                        "recent routing) into the coldest slots, 16 at a time (~2 ms each on PCIe gen5: what a "
                        "request arriving meanwhile waits at most): a long prompt streamed through the slots leaves "
                        "whole layers there, and an agent's next turn routes to every layer's hottest experts "
                        "(default auto: on CUDA; counted as fills and as `refreshed` in the expert stats)")
    add_cpu_expert_arguments(g)


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(**{k: getattr(args, k) for k in EngineOptions.__dataclass_fields__ if hasattr(args, k)})


def default_device_budget(device) -> int:
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.25)
    from engine.cache.tiers import default_host_budget

    return min(2 << 30, default_host_budget(0.1))


def build_core(model_dir: Path, opts: EngineOptions = EngineOptions(), model=None) -> EngineCore:
    """Load the model (unless given) and return a started-on-demand EngineCore (call .start())."""
    from engine.cache.store import PrefixStore
    from engine.models import load_model
    from engine.runner import ModelRunner

    context = context_length(model_dir, opts, model.config if model is not None else None)
    if model is None:
        model = load_model(model_dir, device=opts.device, dtype=opts.dtype, **_expert_args(model_dir, opts, context))
    if opts.fast_path and model.device.type == "cuda" and model.fast is None:
        _enable_fast(model, opts.max_running, context, step_tokens(opts, model.device))
    cache = None
    if opts.prefix_cache:
        dev = opts.cache_device_mb << 20 if opts.cache_device_mb else default_device_budget(model.device)
        host = opts.cache_host_mb << 20 if opts.cache_host_mb else None
        cache = PrefixStore(model, device_budget=dev, host_budget=host)
    runner = ModelRunner(model, context_length=context, cache=cache, overlap=None if opts.overlap else False)
    step = step_tokens(opts, model.device)
    prefill = prefill_tokens(opts, model, step, context)
    model.piece_tokens = step if prefill > step else None
    return EngineCore(runner, max_running=opts.max_running, max_step_tokens=step, max_waiting=opts.max_queue,
                      max_prefill_tokens=prefill)


def context_window(declared: int, per_token: int, per_sequence: int, sequences: int,
                   budget: int) -> tuple[int, str]:
    """Tokens per request: what the model declares (0: DEFAULT_CONTEXT), lowered (to a multiple of 1024) until
    `sequences` sequences of that length fit in `budget` bytes; and why, as a sentence for the log.
    per_token: KV bytes per token of one sequence; per_sequence: its fixed (recurrent) state."""
    wanted = declared or DEFAULT_CONTEXT
    source = f"the model's max_position_embeddings ({declared})" if declared else \
        f"the default {DEFAULT_CONTEXT} (the model's config declares no max_position_embeddings)"
    room = max(0, budget // max(1, sequences) - per_sequence) // max(1, per_token)
    gib = budget / 2**30
    if room >= wanted:
        return wanted, f"{source}; the state of {sequences} sequences fits in {gib:.1f} GiB"
    fitted = max(1024, room // 1024 * 1024)
    return fitted, (f"lowered from {source}: the state of {sequences} sequences of {wanted} tokens "
                    f"({per_token} bytes a token) would not fit in {gib:.1f} GiB; --context-length sets it")


def context_length(model_dir: Path, opts: EngineOptions, cfg=None) -> int:
    """--context-length, else context_window() for this model (its config, or `cfg` when the model is
    already built), device and dtype; logged with its reason."""
    import torch

    from engine.config import load_config

    if opts.context_length:
        log.debug("context length %d tokens: as --context-length asks", opts.context_length)
        return opts.context_length
    cfg = cfg or load_config(model_dir)
    per_token, per_sequence = state_bytes(cfg, getattr(torch, opts.dtype).itemsize)
    device = torch.device(opts.device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        from engine.cache.tiers import default_host_budget

        free = default_host_budget(1.0)
    tokens, why = context_window(cfg.max_positions, per_token, per_sequence, opts.max_running + 1,
                                 int(free * STATE_SHARE))
    log.info("context length %d tokens: %s", tokens, why)
    return tokens


def state_bytes(cfg, itemsize: int) -> tuple[int, int]:
    """(KV bytes per token, fixed recurrent-state bytes) of one sequence of this model (engine/models/slots.py)."""
    attention = sum(1 for t in cfg.layer_types if t == "full_attention")
    linear = cfg.num_layers - attention
    per_token = attention * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    per_sequence = linear * (cfg.conv_dim * max(0, cfg.conv_kernel - 1) * itemsize  # conv: model dtype
                             + cfg.linear_num_v_heads * cfg.linear_k_head_dim * cfg.linear_v_head_dim * 4)  # fp32
    return per_token, per_sequence


# a prefill step's transient device tensors a token, per unit of hidden size (projections, the experts' rows,
# fla's chunk states, the token graphs' buffers, the allocator's slack), and their least
ACTIVATION_BYTES_PER_HIDDEN = 128
ACTIVATION_FLOOR = 1 << 30


def device_reserve(cfg, opts: EngineOptions, device, context: int, itemsize: int) -> int:
    """Device bytes an expert cache leaves free when it takes "the memory left" (--moe-slots unset), on CUDA:
    the fast path's state slots (max_running + 1 of `context` tokens), and room for a prefill step's transient
    tensors (without it a model larger than the device fills it with slots and runs out of memory at its first
    prompt)."""
    if device.type != "cuda":
        return 0
    per_token, per_sequence = state_bytes(cfg, itemsize)
    states = (opts.max_running + 1) * ((context + 1) * per_token + per_sequence) if opts.fast_path else 0
    step = step_tokens(opts, device)
    return states + max(ACTIVATION_FLOOR, step * cfg.hidden_size * ACTIVATION_BYTES_PER_HIDDEN)


def step_tokens(opts: EngineOptions, device) -> int:
    """Tokens per engine step: a GPU runs long prefill chunks at the same cost per token as short ones."""
    if opts.max_step_tokens is not None:
        return opts.max_step_tokens
    return max(opts.max_running, 2048 if device.type == "cuda" else 512)


def prefill_tokens(opts: EngineOptions, model, step: int, context: int) -> int:
    """Prompt tokens per step: --max-prefill-tokens, else the whole context when an expert cache would stream
    its pool once per step (a layer-major step moves it once per prompt), else one step's tokens."""
    if opts.max_prefill_tokens is not None:
        return max(step, opts.max_prefill_tokens)
    from engine.experts.registry import is_expert_cache

    if is_expert_cache(model.experts):
        return max(step, context)
    return step


def _enable_fast(model, max_running: int, context: int, chunk: int) -> None:
    """The fast path with a slot for each running request (+1 for a turn being cached while the next
    starts); where it cannot serve the model the engine says why and stays eager."""
    from engine.models.fast_support import fast_unsupported

    reason = fast_unsupported(model)
    if reason is not None:
        log.warning("eager engine path: %s", reason)
        return
    model.enable_fast(slots=max_running + 1, capacity=context + 1)
    decode = "launched directly"
    if model.decode_steps.capture:
        decode = "as CUDA graphs"
        if model.fast.mapped is not None:
            decode = "as CUDA graphs, missing experts read in place from the host pool (--moe-decode mapped)"
        elif model.fast.cached_experts:
            decode = "as CUDA graphs between the expert cache's layers (it picks fills and CPU runs on the host)"
    log.info("fast engine path: %d state slots of %d tokens (%.1f GiB), decode %s", max_running + 1, context + 1,
             model.fast.pool.nbytes / 2**30, decode)
    started = time.monotonic()
    model.warm_up(chunk)
    log.info("fast engine path warmed up in %.1f s (kernels compiled, decode graphs captured)",
             time.monotonic() - started)


def _expert_args(model_dir: Path, opts: EngineOptions, context: int) -> dict:
    """load_model keywords for the chosen expert backend ('auto' settled here, before any weight loads).
    On CUDA the fast path's state slots and a prefill step's transient tensors are kept out of the slot cache
    (device_reserve)."""
    import torch

    from engine.config import load_config
    from engine.experts.registry import experts_factory, resolve, warn_unused_slots

    from engine.experts.profile import load_profile
    from engine.experts.block_layout import ExpertLayout

    cfg = load_config(model_dir)
    dtype = getattr(torch, opts.dtype)
    layout = ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size, dtype.itemsize)
    moe_layers = len(cfg.moe_layers)
    pool_bytes = moe_layers * cfg.num_experts * layout.nbytes
    device = torch.device(opts.device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else pool_bytes
    # `killick bench bw` on this machine says whether CPU execution pays (auto -> hybrid); none: offload
    threads = expert_threads(opts, device)
    profile = load_profile(layout, dtype, threads)
    name = resolve(opts.moe_backend, dense=moe_layers == 0, pool_bytes=pool_bytes, free_bytes=free, profile=profile,
                   slots=opts.moe_slots, expert_bytes=layout.nbytes)
    if name == "fused":
        warn_unused_slots(opts.moe_backend, opts.moe_slots)
        return {}
    progress = _pool_progress if pool_bytes > 1 << 30 else None  # a 64 GB pool takes a minute or more
    reserve = device_reserve(cfg, opts, device, context, dtype.itemsize)
    from engine.experts import cpu_runner

    set_expert_threads(opts, device)
    log.info("%s experts: %d CPU expert threads (%d for a prompt)", name, threads, cpu_runner.prompt_threads())
    return {"experts": experts_factory(name, device=opts.device, slots=opts.moe_slots, progress=progress,
                                       reserve_bytes=reserve, profile=profile or {},
                                       slot_policy=opts.slot_policy, decode=opts.moe_decode,
                                       prefetch=opts.moe_prefetch, lookahead=opts.moe_lookahead,
                                       refresh=opts.moe_refresh),
            "expert_device": "cpu"}


# cores a prompt's CPU experts leave on CUDA: the engine thread (routing read-backs, the split, the copies' issue),
# the job's waiting thread (it spins through the job) and one for the rest (the CUDA driver's threads, the mapped
# decode's mailbox thread). H100 box, 16 cores, 256-token extends after an 8k prompt (docs/PERF.md thirty-third
# session): 13 workers 100.5 / 94.2 ms against 14's 102.5 / 102.5 (uniform, ten extends averaging 97.7 against
# 107.2) and 132.7 against 136.1-141.3 (Zipf 1.0); 15 and 16 workers 117.5 and 119.7 against 111.2.
PROMPT_SPARE_CORES = 3


def expert_threads(opts: EngineOptions, device) -> int:
    """--expert-threads, else torch's thread count on a CPU engine (its own thread waits for the experts),
    and on CUDA half the cores this process may use (at most all but two): the experts are bound by host
    DRAM, which half the cores already read at full rate, and the engine thread and a hybrid decode's mailbox
    thread each keep a core busy; a worker that shares a core stalls every phase of the pool (H200 box: 15
    workers 113 tok/s, 8 workers 177 tok/s, hybrid decode at 8 layers; bench bw B_H 61.6 GB/s at 8 threads,
    53.9 at 16)."""
    import os

    import torch

    if opts.expert_threads is not None:
        return opts.expert_threads
    if device.type != "cuda":
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores - 2, cores // 2))


def set_expert_threads(opts: EngineOptions, device) -> None:
    """The CPU expert runner's worker counts from `opts` (expert_threads, prompt_expert_threads), its tile
    setting (expert_tile_tokens) and where a prompt's CPU experts join (cpu_join), as serve and bench model use
    them."""
    from engine.experts import cpu_jobs, cpu_runner

    cpu_runner.set_threads(expert_threads(opts, device))
    cpu_runner.set_prompt_threads(prompt_expert_threads(opts, device))
    cpu_runner.set_tile_tokens(opts.expert_tile_tokens)
    cpu_jobs.set_join_on_device(opts.cpu_join == "device")


def prompt_expert_threads(opts: EngineOptions, device) -> int:
    """--prompt-expert-threads, else on CUDA every physical core but PROMPT_SPARE_CORES (at least expert_threads):
    a prompt's CPU experts take several tokens each and the kernels run compute-bound, where more workers help
    (H200 box, hybrid, 256-token extend after an 8k prompt at 37.5% in slots: 14 workers 136.8 ms against
    147.5-156.5 with 8 under uniform routing; docs/PERF.md eighteenth session), up to the cores the engine's other
    threads need. Elsewhere expert_threads."""
    import os

    if opts.prompt_expert_threads is not None:
        return opts.prompt_expert_threads
    threads = expert_threads(opts, device)
    if device.type != "cuda":
        return threads
    from engine.experts.cpu_kernels import physical_cores

    return max(threads, min(physical_cores(), len(os.sched_getaffinity(0))) - PROMPT_SPARE_CORES)


def _pool_progress(p) -> None:
    log.info("loading %s", p.line())
