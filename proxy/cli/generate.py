"""`killick generate`: complete one prompt in-process and print the completion (no server)."""
from __future__ import annotations

import argparse
import sys

from engine.flags import add_dtype_argument, device_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (default: the demo model)")
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens to generate (default 64)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=None,
                   help="makes sampling repeatable (default: none, each run draws anew)")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N] (default cpu)")
    add_dtype_argument(p)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if not args.prompt:
        raise ValueError("--prompt is empty: give the text to complete")
    from engine import Engine
    from engine.demo import resolve_model
    from proxy.prompt.tokenizer import load_tokenizer

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    if args.raw:
        ids = tok.encode(args.prompt)
    else:
        from proxy.conversation import Conversation, Message, TextPart
        from proxy.prompt.render import ChatRenderer

        conv = Conversation((Message("user", (TextPart(args.prompt),)),), enable_thinking=False)
        ids = ChatRenderer(tok).render(conv).ids
    eng = Engine.from_pretrained(path, device=args.device, dtype=args.dtype)
    out = eng.generate(ids, max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, seed=args.seed, stop_ids=tuple(tok.eos_ids))
    sys.stdout.write(tok.decode(out) + "\n")
    return 0
