"""Benchmarks: commands that measure and print a table (and write JSON). Nothing in the runtime imports them.

    args.py     their command-line options, torch-free (`killick --help` stays light)
    bw.py       `killick bench bw`: B_P, B_H, STREAM; saves the profile q* reads (engine/experts/profile.py)
    decode.py   `killick bench decode`: decode / prefill tok/s per expert backend on a synthetic shape
    route.py    the decode step's routing bookkeeping, Triton kernel against the host path (CUDA)
    cpu.py      `python -m engine.bench.cpu`: the native CPU expert kernels against the read bandwidth
    gpu_session.sh  one GPU-box session: tests/gpu, bench bw, bench decode
"""
