"""The embedded demo model: a tiny hybrid checkpoint generated deterministically on first use.

It lives in the user's cache dir (`$KILLICK_CACHE`, else `$XDG_CACHE_HOME/killick`, else ~/.cache/killick)
with the shipped tokenizer, so every command works with no `--model` and no download.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "demo-qwen3_5_moe-v2"  # a new name whenever the generated checkpoint changes
SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"


def cache_dir() -> Path:
    if os.environ.get("KILLICK_CACHE"):
        return Path(os.environ["KILLICK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "killick"


def demo_model_dir() -> Path:
    """Path of the demo checkpoint, generating it (atomically) if it is not there yet."""
    target = cache_dir() / DEMO_NAME
    if (target / "config.json").is_file():
        return target
    from engine.synth import synth_checkpoint  # torch: only when we really generate

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=DEMO_NAME + ".", dir=target.parent))
    try:
        synth_checkpoint(tmp, arch="qwen3_5_moe", layout="fused", size="demo", seed=0, tokenizer=SHIPPED_TOKENIZER)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(path: str | None) -> Path:
    """`--model` if given (must exist), else the demo checkpoint."""
    if path is None:
        return demo_model_dir()
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "is a file, not a directory" if p.exists() else "does not exist"
        raise ValueError(f"model directory {p} {what}; pass --model DIR with a Hugging Face checkpoint "
                         f"(config.json + *.safetensors) or leave --model out to use the demo model")
    return p
