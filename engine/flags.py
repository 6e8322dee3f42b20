"""Flags the engine's commands share, checked where they are parsed: a value that cannot work is one usage line
naming the flag and what it takes, before any model loads (torch is imported only when a device is checked)."""
from __future__ import annotations

import argparse

SYNTH_SIZES = ("tiny", "demo", "qwen3.6-35b-a3b")  # --synthetic of the whole-model benches (engine/synth.py)
EXPERT_SHAPES = ("qwen3.6-35b-a3b",)  # --synthetic of the expert benches (engine/experts/synthetic.py SHAPES)
CPU_JOINS = ("device", "host")  # --cpu-join: where a prompt's CPU expert outputs join its layer (experts/cpu_jobs.py)


def device_arg(text: str) -> str:
    """An argparse type: cpu, cuda or cuda:N that this torch and machine can run on."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "this torch has no CUDA (a CPU build)" if torch.version.cuda is None else "no GPU is visible"
            raise argparse.ArgumentTypeError(f"{text}: {build}; use --device cpu, or a CUDA build of torch on a "
                                             "machine with an NVIDIA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} GPU(s), "
                                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return text


def default_device() -> str:
    """cuda when this torch sees a GPU, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def moe_slots_arg(text: str) -> str:
    """An argparse type: `--moe-slots` N (at least 1) or P% (in (0, 100])."""
    from engine.experts.policy import slots_spec

    try:
        return slots_spec(text)
    except ValueError as exc:  # argparse names the flag (bench decode calls it --slots)
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--moe-slots ")) from None


def at_least(low: int):
    """An argparse type: an integer >= low (a bad value is one usage line naming it)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def add_dtype_argument(g) -> None:
    """--dtype of the commands that run a checkpoint as serve does (serve, replay, generate): float32 unless said."""
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (default float32; bfloat16 on a GPU halves the memory)")


def add_cpu_expert_arguments(g) -> None:
    """The CPU expert runner's worker counts, tile setting and join (cpu / hybrid), as `killick serve` and the
    benchmarks that run the whole engine (bench model, profile_decode) take them."""
    g.add_argument("--expert-threads", type=at_least(1),
                   help="CPU threads running experts for cpu/hybrid (default: every core on a CPU engine; on "
                        "CUDA half the cores: host DRAM bounds the experts, and the engine thread keeps a core)")
    g.add_argument("--prompt-expert-threads", type=at_least(1),
                   help="CPU threads running a prompt's experts for cpu/hybrid (a layer call of 32 tokens or more: "
                        "several tokens an expert, compute-bound kernels that more cores speed up; default: on "
                        "CUDA every physical core but three, else --expert-threads)")
    g.add_argument("--expert-tile-tokens", type=at_least(0),
                   help="a layer call whose CPU experts average this many tokens or more runs on the CPU's matrix "
                        "tiles (AMX-BF16: 16 tokens a pass over an expert's weights, where the vector kernels take "
                        "4); 0: never (default: 5 where the CPU has AMX)")
    g.add_argument("--cpu-join", default="device", choices=CPU_JOINS,
                   help="where a prompt's CPU experts (cpu/hybrid on CUDA) join the layer's output: device (the "
                        "GPU waits for the job's flag while the host queues the layers after; default: the faster in "
                        "seven of eleven alternated H100 runs of 256-token extends, docs/PERF.md) or host (the host "
                        "waits for the job, then queues the rest)")
