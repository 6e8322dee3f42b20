"""Command-line options of the expert benchmarks, torch-free so `killick --help` stays light.

`killick bench bw` / `killick bench decode` (proxy/cli/bench.py) and the modules' own `main(argv)`
share these definitions."""
from __future__ import annotations

import argparse

from engine.flags import (EXPERT_SHAPES, SYNTH_SIZES, add_cpu_expert_arguments, at_least, device_arg,
                          moe_slots_arg)

DEFAULT_SHAPE = "qwen3.6-35b-a3b"


def add_bw_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--synthetic", default=DEFAULT_SHAPE, choices=EXPERT_SHAPES,
                    help="expert format (shape and dtype) to measure")
    ap.add_argument("--small", action="store_true", help="scaled-down shape: a seconds-long smoke run")
    ap.add_argument("--threads", type=_counts, default=None,
                    help="comma-separated CPU thread counts (default 1..cores)")
    ap.add_argument("--experts", type=at_least(1), default=256,
                    help="expert blocks in the pool B_H draws 8 a call from (default 256: one layer)")
    ap.add_argument("--stream-mib", type=at_least(1), default=1024,
                    help="the pool holds at least this many MiB (far above the LLC); STREAM reads the same pool")
    ap.add_argument("--seconds", type=_positive, default=0.5, help="length of each B_H and STREAM window")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="alternated B_H / STREAM windows per thread count")
    ap.add_argument("--json", default=None, help="also write the profile here")


def add_decode_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--synthetic", default=DEFAULT_SHAPE, choices=EXPERT_SHAPES,
                    help="model shape of the synthetic expert pool")
    ap.add_argument("--small", action="store_true", help="scaled-down shape for a CPU smoke test")
    ap.add_argument("--device", type=device_arg, default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--slots", type=moe_slots_arg, default="37%", help="slot count or percentage of all experts")
    ap.add_argument("--threads", type=_counts, default=None,
                    help="CPU threads for the CPU expert path; a list (6,16) repeats the cpu/hybrid runs (default: "
                         "6, at most this machine's cores)")
    ap.add_argument("--backends", type=_names(SLOT_BACKENDS), default=list(SLOT_BACKENDS),
                    help=f"comma-separated, of {','.join(SLOT_BACKENDS)} (default all)")
    ap.add_argument("--steps", type=at_least(1), default=32, help="timed decode steps a run (default 32)")
    ap.add_argument("--warmup", type=at_least(0), default=40,
                    help="untimed decode steps before each slot run (none in the all-resident row), at most "
                         "2 x slots / (top-k x layers) + 2 (default 40)")
    ap.add_argument("--prefill-tokens", type=at_least(0), default=8192,
                    help="prompt of the two prefill rows, streamed and on demand (default 8192)")
    ap.add_argument("--warm-prefill", type=at_least(0), default=1024,
                    help="prompt tokens prefilled before each decode run (0: start from an empty cache)")
    ap.add_argument("--routing", default="uniform", help="uniform and/or zipf, comma-separated")
    ap.add_argument("--freeze", action="store_true",
                    help="keep the fill/CPU split at the measured profile (no running rates, no exploring)")
    ap.add_argument("--slot-policy", default="lfu", choices=["lfu", "lru"],
                    help="which cached expert a fill evicts (default lfu, as serve)")
    ap.add_argument("--json", default=None, help="also write every run's figures here")


def split_decode_lists(args: argparse.Namespace) -> argparse.Namespace:
    """Comma lists -> lists (threads: 6 unless given, at most the cores); ValueError on a bad routing name."""
    import os

    args.threads = args.threads or [min(6, len(os.sched_getaffinity(0)))]
    args.routing = args.routing.split(",")
    if not set(args.routing) <= {"uniform", "zipf"}:
        raise ValueError(f"--routing takes uniform and/or zipf, got {','.join(args.routing)}")
    return args


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """`killick bench model`: the whole engine on a checkpoint or a synthetic model of real widths."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (default: a synthetic model, see --synthetic)")
    src.add_argument("--synthetic", default="qwen3.6-35b-a3b", choices=SYNTH_SIZES,
                     help="synthetic size (default qwen3.6-35b-a3b)")
    p.add_argument("--layers", type=at_least(1), help="decoder layers of the synthetic model (default: all)")
    p.add_argument("--router-zipf", type=_positive, default=None,
                   help="synthetic model only: routers skewed so expert popularity follows a Zipf law of this "
                        "exponent (the weights `llama_cpp.sh --router-zipf` converts; default: off)")
    p.add_argument("--device", type=device_arg, default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights and activations (default bfloat16)")
    p.add_argument("--batches", type=_counts, default=[1, 4, 8], help="decode batch sizes (default 1,4,8)")
    p.add_argument("--steps", type=at_least(1), default=64, help="timed decode steps per batch size (default 64)")
    p.add_argument("--warmup", type=at_least(1), default=8,
                   help="decode steps before timing, at least 1: the first token is the prompt's (default 8)")
    p.add_argument("--prompt", type=at_least(1), default=64, help="prompt tokens of each decode request (default 64)")
    p.add_argument("--prefill", type=at_least(0), default=8192,
                   help="tokens of the long prompt (default 8192; 0: skip)")
    p.add_argument("--prefill-runs", type=at_least(1), default=3,
                   help="fresh long prompts timed after a warm-up one (and two extends of it); the row is their "
                        "median (default 3)")
    p.add_argument("--extend", type=at_least(1), default=256,
                   help="tokens appended after the cached prompt (default 256)")
    p.add_argument("--extend-runs", type=at_least(1), default=1,
                   help="extends timed, each after a long prompt of its own (the first after the last timed one, "
                        "the others after an untimed one); the row is their median (default 1)")
    p.add_argument("--extend-idle-ms", type=_at_least_zero, default=0.0,
                   help="milliseconds the engine idles between the cached prompt's end and the extend's arrival, as "
                        "an agent's tool call between two turns (idle time the expert cache's --moe-refresh uses; "
                        "default 0: back to back)")
    p.add_argument("--text-prompts", action="store_true",
                   help="prompts of the text `python -m engine.bench.serve` sends, tokenized with the checkpoint's "
                        "tokenizer (--model DIR), instead of uniform random ids: experts routed as a serve "
                        "request's are, for comparing the two (default: random ids)")
    p.add_argument("--max-step-tokens", type=at_least(1),
                   help="prefill chunk (default: the serve default for the device)")
    p.add_argument("--eager", action="store_true", help="the eager reference path instead of the fast one")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="read each decode step's tokens before queuing the next (as serve --no-overlap)")
    p.add_argument("--temperature", type=_at_least_zero, default=0.0,
                   help="decode requests sample at this temperature (default 0: greedy; agents that send no "
                        "sampling fields get 1.0 from the APIs)")
    p.add_argument("--moe-backend", default="fused", choices=["fused", "offload", "cpu", "hybrid"],
                   help="where routed experts run (default fused: all on the device); the others keep the experts "
                        "in a host-RAM pool with --moe-slots of them cached on the device, as serve does")
    p.add_argument("--moe-slots", type=moe_slots_arg, metavar="N|P%",
                   help="device expert slots for offload/cpu/hybrid (default: the memory left)")
    p.add_argument("--max-prefill-tokens", type=at_least(1),
                   help="prompt tokens per step (default as serve: the whole context with an expert cache)")
    p.add_argument("--prefill-stream", default="auto", choices=["auto", "on", "off"],
                   help="with an expert cache: auto (as serve) streams whole layers through the slots when "
                        "prefill_stream.should_stream predicts it faster than moving the routed experts alone; on "
                        "streams every prompt, off moves only the routed experts for every prompt (to measure "
                        "that choice)")
    p.add_argument("--slot-policy", default="lfu", choices=["lfu", "lru"],
                   help="which cached expert a fill evicts (default lfu, as serve)")
    p.add_argument("--moe-prefetch", default="auto", choices=["auto", "on", "off"],
                   help="with a mapped decode: prefetch each layer's likely expert while its attention runs (as "
                        "serve's --moe-prefetch; default auto: on for a mapped decode on CUDA)")
    p.add_argument("--moe-lookahead", default="auto", choices=["auto", "on", "off"],
                   help="a routed prompt copies the next layer's likely missing experts while a layer runs (as "
                        "serve's --moe-lookahead; default auto: on CUDA)")
    p.add_argument("--moe-refresh", default="auto", choices=["auto", "on", "off"],
                   help="idle time moves the hottest experts not in a slot in (as serve's --moe-refresh; default "
                        "auto: on CUDA)")
    p.add_argument("--moe-decode", default="auto", choices=["auto", "mapped", "host"],
                   help="how decode goes through the expert cache (as serve; default auto)")
    add_cpu_expert_arguments(p)
    p.add_argument("--cpu-share", type=_share,
                   help="hybrid mapped decode: this share of the non-resident experts runs on the CPU, fixed "
                        "(default: searched for the shortest measured step, per batch size)")
    p.add_argument("--rule-tiles", type=_rule_tiles, metavar="NORM,BLOCK_V,WARPS",
                   help="the decode step's DeltaNet rule in these tiles (as `python -m engine.bench.tiles --only "
                        "rule` names them, e.g. last,32,4; NORM fused, launch or last; default: the engine's)")
    p.add_argument("--skinny-tiles", type=_skinny_tiles, metavar="CLASS=BN,BK,WARPS,STAGES[/...]",
                   help="decode projections of a width class (narrow: up to 4,096 outputs, wide, head: the "
                        "vocabulary's) in these tiles, as `python -m engine.bench.tiles --only projections` names "
                        "them, e.g. head=32,128,4,6 (default: the engine's)")
    p.add_argument("--seam-topk", action="store_true",
                   help="decode steps of 2-16 tokens route each row in the add+norm+router launch (one launch a MoE "
                        "layer fewer; off by default until run on a GPU: engine/models/fast.py SEAM_TOPK)")
    p.add_argument("--json", help="write the results here")


def set_expert_threads_from(args: argparse.Namespace) -> None:
    """The CPU expert runner set up from add_cpu_expert_arguments' options on args.device, as serve sets it
    (engine/build.py): a benchmark that leaves it at torch's thread count runs a prompt's CPU experts on every
    core, beside the engine's own threads."""
    import torch

    from engine.build import EngineOptions, set_expert_threads

    set_expert_threads(EngineOptions(device=args.device, expert_threads=args.expert_threads,
                                     prompt_expert_threads=args.prompt_expert_threads,
                                     expert_tile_tokens=args.expert_tile_tokens, cpu_join=args.cpu_join),
                       torch.device(args.device))


def _rule_tiles(text: str):
    """An argparse type: NORM,BLOCK_V,WARPS -> RuleTiles (a bad value is one usage line naming it)."""
    from engine.kernels.deltanet_triton import RULE_NORMS, RuleTiles

    parts = text.split(",")
    if len(parts) != 3 or parts[0] not in RULE_NORMS or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        raise argparse.ArgumentTypeError(f"expected NORM,BLOCK_V,WARPS with NORM one of {', '.join(RULE_NORMS)} "
                                         f"and two positive integers, got {text!r}")
    return RuleTiles(parts[0], int(parts[1]), int(parts[2]))


def _skinny_tiles(text: str) -> dict:
    """An argparse type: CLASS=BN,BK,WARPS,STAGES joined by "/" -> {class: tiles} (a bad value is one usage line
    naming it)."""
    from engine.kernels.linear_triton import SKINNY_TILES

    out = {}
    for part in text.split("/"):
        name, _, tiles = part.partition("=")
        values = tiles.split(",")
        if name not in SKINNY_TILES or name in out or len(values) != 4 \
                or not all(v.isdigit() and int(v) > 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected CLASS=BN,BK,WARPS,STAGES (CLASS one of "
                                             f"{', '.join(SKINNY_TILES)}, once each, four positive integers) joined "
                                             f"by '/', got {text!r}")
        out[name] = tuple(int(v) for v in values)
    return out


SLOT_BACKENDS = ("offload", "cpu", "hybrid")


def _counts(text: str) -> list[int]:
    """An argparse type: comma-separated integers of at least 1 (thread counts)."""
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts of at least 1 (e.g. 6,16), got {text!r}")
    return values


def _names(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated subset of `allowed`."""
    def parse(text: str) -> list[str]:
        names = text.split(",")
        if not names or not set(names) <= set(allowed):
            raise argparse.ArgumentTypeError(f"expected some of {','.join(allowed)}, got {text!r}")
        return names
    return parse


def _number(holds, wants: str):
    """An argparse type: a number for which holds(value) is true, else one usage line saying what it wants."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")  # holds nothing
        if not holds(value):
            raise argparse.ArgumentTypeError(f"expected {wants}, got {text!r}")
        return value
    return parse


_positive = _number(lambda v: v > 0, "a number above 0")
_at_least_zero = _number(lambda v: v >= 0, "a number of 0 or more")
_share = _number(lambda v: 0 <= v <= 1, "a share from 0 to 1")


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    """`killick bench routing`: slot-cache hit rates vs llama.cpp's static placement on a skewed synthetic model."""
    p.add_argument("--synthetic", default="demo", choices=SYNTH_SIZES, help="synthetic size (default demo)")
    p.add_argument("--layers", type=at_least(1), help="decoder layers (default: the size's own)")
    p.add_argument("--router-zipf", type=_floats, default=[0.0, 1.0],
                   help="Zipf exponents of the router skew, comma-separated; 0 is today's checkpoint (default 0,1)")
    p.add_argument("--gpu-fraction", type=_floats, default=[0.25, 0.37, 0.5],
                   help="GPU expert memory as fractions of all experts (default 0.25,0.37,0.5)")
    p.add_argument("--tokens", type=at_least(1), default=1024, help="random tokens routed (default 1024)")
    p.add_argument("--warmup", type=at_least(0), default=256, help="tokens before hit rates are counted (default 256)")
    p.add_argument("--device", type=device_arg, default="cpu", help="where the model runs (default cpu)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--seed", type=int, default=0, help="weights seed; the token stream uses seed + 1")
    p.add_argument("--half-life", type=float, default=256.0,
                   help="tokens after which the lfu policy weighs a use half (default 256, the engine's)")
    p.add_argument("--iid", action="store_true",
                   help="draw each token's routes from the Zipf law at the size's expert count and top-k instead of "
                        "running the model (the real shape in seconds; no correlation between tokens)")
    p.add_argument("--json", help="write the results here")


def print_and_save(res: dict, print_table, json_path: str | None) -> int:
    """A benchmark's last step: its table on stdout, its result as JSON where --json asked for it."""
    print_table(res)
    if json_path:
        import json

        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0
