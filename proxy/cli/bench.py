"""`killick bench bw` (B_P, B_H, STREAM; writes this machine's profile) and `killick bench decode`
(the expert hierarchy on a synthetic model shape). Torch is imported only when a benchmark runs."""
from __future__ import annotations

import argparse

from engine.bench.args import add_bw_arguments, add_decode_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    add_bw_arguments(sub.add_parser("bw", help="PCIe, CPU expert kernel and host read bandwidth -> profile"))
    add_decode_arguments(sub.add_parser("decode", help="decode/prefill tok/s per expert backend, synthetic shape"))


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "bw":
        from engine.bench import bw

        return bw.run_args(args)
    from engine.bench import decode

    return decode.run_args(args)
