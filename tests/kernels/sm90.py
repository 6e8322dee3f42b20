"""Compile the kernels a CPU test run launched for the GPU box (sm_90), without a GPU.

Triton's interpreter runs a kernel's Python, not its compiler: a kernel it runs correctly can still fail to
compile (2026-12-05: a name rebound to a value of another type inside an `if`, which the compiler refuses,
broke every fast-path test on the box and passed every CPU test). `recording()` notes each launch under the
interpreter (kernel, argument types, constexpr values, warps, stages); `compile_all()` compiles each distinct
one with the real compiler for sm_90 in a fresh process (the interpreter's environment variable rewrites
every kernel at import), ptxas included, which needs no device. PDL is compiled on, as the box runs it.
tests/conftest.py does both around every test module that runs under the interpreter.

    python -m tests.kernels.sm90 < launches.json    # prints one line per kernel that does not compile
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys

import torch

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
           torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(1 << 31) <= value < (1 << 31) else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def _launch(fn, arg_names: list[str], args: tuple, kwargs: dict) -> dict:
    """One launch as JSON: where the kernel lives, its signature, constexprs and launch options."""
    params = inspect.signature(fn).parameters
    values = dict(zip(arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k in params})
    signature, constexprs = {}, {}
    for name, p in params.items():
        if "constexpr" in str(p.annotation):
            value = values.get(name, p.default)
            constexprs[name] = True if name == "PDL" else value
            signature[name] = "constexpr"
        else:
            signature[name] = _arg_type(values[name])
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
            "num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3)}


@contextlib.contextmanager
def recording(into: dict):
    """Inside: every interpreted launch of a kernel under engine/ lands in `into` (key: its JSON)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def noting(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("engine."):
            launch = _launch(self.fn, self.arg_names, args, kwargs)
            into.setdefault(json.dumps(launch, sort_keys=True), launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = noting
    try:
        yield into
    finally:
        InterpretedFunction.run = run


def compile_all(launches: list[dict], timeout: float = 600) -> list[str]:
    """The launches' kernels compiled for sm_90 in a fresh process -> one line per failure (empty: all do)."""
    if not launches:
        return []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.sm90"], input=json.dumps(launches), text=True,
                          capture_output=True, env=env, timeout=timeout, cwd=_repo_root())
    if done.returncode != 0:
        return [f"the sm_90 compile process failed ({done.returncode}): {done.stderr[-2000:]}"]
    return [line for line in done.stdout.splitlines() if line.strip()]


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile(launches: list[dict]) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    failures = []
    for launch in launches:
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        src = ASTSource(fn=kernel, signature=launch["signature"], constexprs=launch["constexprs"])
        try:
            triton.compile(src, target=target, options={"num_warps": launch["num_warps"],
                                                        "num_stages": launch["num_stages"]})
        except Exception as e:  # noqa: BLE001 - every compiler error is the finding
            what = ", ".join(f"{k}={v}" for k, v in launch["constexprs"].items())
            first = str(e).strip().splitlines()
            failures.append(f"{launch['module']}.{launch['name']} ({what}): {type(e).__name__}: "
                            + " | ".join(first[-3:]))
    return failures


if __name__ == "__main__":
    for line in _compile(json.load(sys.stdin)):
        print(line)
