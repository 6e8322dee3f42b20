"""`killick bench bw` (B_P, B_H, STREAM; writes this machine's profile), `killick bench decode` (the expert
hierarchy on a synthetic model shape), `killick bench model` (the whole engine, beside its HBM bound),
`killick bench routing` (LRU hit rate vs llama.cpp's static placement on a skewed synthetic router) and
`killick bench upstream` (recordings through the proxy in front of replicas: session affinity vs round-robin).
Torch is imported only when a benchmark runs."""
from __future__ import annotations

import argparse

from engine.bench.args import add_bw_arguments, add_decode_arguments, add_model_arguments, add_routing_arguments
from proxy.cli import check_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    add_bw_arguments(sub.add_parser("bw", help="PCIe, CPU expert kernel and host read bandwidth -> profile"))
    add_decode_arguments(sub.add_parser("decode", help="decode/prefill tok/s per expert backend, synthetic shape"))
    add_model_arguments(sub.add_parser("model", help="the whole engine: decode b1/4/8, 8k prefill, extend TTFT"))
    add_routing_arguments(sub.add_parser("routing", help="expert hit rate on a skewed synthetic router: LRU slot "
                                                         "cache vs llama.cpp --n-cpu-moe at equal GPU memory"))
    from proxy.upstream import bench as upstream

    upstream.add_arguments(sub.add_parser("upstream", help="recordings as concurrent sessions through replicas: "
                                                           "cached fraction and TTFT, affinity vs round-robin"))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "json", None):
        check_output(args.json, "--json")
    if args.bench_command == "bw":
        from engine.bench import bw

        return bw.run_args(args)
    if args.bench_command == "upstream":
        from proxy.upstream import bench as upstream

        return upstream.run_args(args)
    if args.bench_command == "model":
        from engine.bench import model

        return model.run_args(args)
    if args.bench_command == "routing":
        from engine.bench import routing

        return routing.run_args(args)
    from engine.bench import decode

    return decode.run_args(args)
