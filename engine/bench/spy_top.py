"""Per-thread tables of a sampling profile in collapsed-stack form (py-spy `record --format raw --threads`).

    python -m engine.bench.spy_top spy.txt [--top 14]

Each line of the input is `thread (id): name;frame;frame... count`. For each thread, most sampled first: its
samples, the frames it was sampled in most (self) and the frames on its stack most often (inclusive). With
py-spy's --gil the samples are the GIL holder's, so a thread's share is its share of the GIL.
"""
from __future__ import annotations

import argparse
from collections import Counter, defaultdict


def tables(lines) -> list[tuple[str, int, Counter, Counter]]:
    """-> (thread, samples, self counts, inclusive counts) per thread, most sampled first."""
    total: Counter = Counter()
    own: dict[str, Counter] = defaultdict(Counter)
    incl: dict[str, Counter] = defaultdict(Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        thread = frames[0].split(":", 1)[-1].strip() or frames[0]
        total[thread] += n
        if len(frames) > 1:
            own[thread][frames[-1]] += n
            for frame in set(frames[1:]):  # a recursive frame counts once a sample
                incl[thread][frame] += n
    return [(t, n, own[t], incl[t]) for t, n in total.most_common()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.spy_top", description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args(argv)
    with open(args.path) as f:
        rows = tables(f)
    if not rows:
        print(f"{args.path}: no samples")
        return 1
    for thread, n, own, incl in rows:
        print(f"== {thread}: {n} samples")
        for label, counts in (("self", own), ("inclusive", incl)):
            print(f"  {label}:")
            for frame, c in counts.most_common(args.top):
                print(f"  {c:7d} {frame[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
