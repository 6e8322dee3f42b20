"""`killick model synth`: write a small seeded random checkpoint in a real Hugging Face layout."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    s = sub.add_parser("synth", help="write a seeded random checkpoint (qwen3_5_moe or qwen3_moe)")
    s.add_argument("out", help="output directory")
    s.add_argument("--arch", default="qwen3_5_moe", choices=["qwen3_5_moe", "qwen3_moe"],
                   help="qwen3_5_moe: DeltaNet + gated attention + MoE (default); qwen3_moe: attention + MoE")
    s.add_argument("--layout", default="fused", choices=["fused", "per_expert"],
                   help="experts stored fused ([E,2I,H] / [E,H,I], as released) or one tensor per expert")
    s.add_argument("--size", default="tiny", choices=["tiny", "demo"],
                   help="tiny: 4 layers, 8 experts (default); demo: the embedded demo model's 8 layers, 16 experts")
    s.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    s.add_argument("--router-zipf", type=float, default=None, metavar="A",
                   help="skew the routers so expert popularity follows a Zipf law of exponent A (default: off)")
    s.add_argument("--no-tokenizer", action="store_true", help="do not copy the shipped tokenizer")
    s.add_argument("--force", action="store_true",
                   help="write into OUT though it holds files (a checkpoint there is overwritten)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: give a new or empty directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not args.force:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(f"{out} is not empty ({shown}): give a new or empty directory, or --force to write over "
                         "what is there")
    from engine.demo import SHIPPED_TOKENIZER
    from engine.synth import synth_checkpoint

    tok = None if args.no_tokenizer else SHIPPED_TOKENIZER
    vocab = None
    if tok is not None:
        from proxy.prompt.tokenizer import load_tokenizer

        vocab = load_tokenizer(None).vocab_size
    out = synth_checkpoint(args.out, arch=args.arch, layout=args.layout, size=args.size, seed=args.seed,
                           vocab_size=vocab, tokenizer=tok, router_zipf=args.router_zipf)
    print(f"wrote {args.arch} ({args.layout}, {args.size}, seed {args.seed}) to {out}")
    return 0
