"""Flags the engine's commands share, checked where they are parsed: a value that cannot work is one usage line
naming the flag and what it takes, before any model loads (torch is imported only when a device is checked)."""
from __future__ import annotations

import argparse

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
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
