"""Benchmarks: commands that measure and print a table (and write JSON). Nothing in the runtime imports them.

    args.py     their command-line options, torch-free (`killick --help` stays light)
    bw.py       `killick bench bw`: B_P, B_H, STREAM; saves the profile the split reads (engine/experts/profile.py)
    decode.py   `killick bench decode`: decode / prefill tok/s per expert backend on a synthetic shape
    route.py    the decode step's routing bookkeeping, Triton kernel against the host path (CUDA)
    cpu.py      `python -m engine.bench.cpu`: the native CPU expert kernels against the read bandwidth
    model.py    `killick bench model`: the whole engine (scheduler -> runner -> model) beside its HBM bound
    serve.py    `python -m engine.bench.serve`: TTFT and decode rate of streamed requests to `killick serve`
    profile_decode.py  a decode step's kernels under torch.profiler (CUDA)
    peers/      llama.cpp built, converted and benched on the GPU box; killick / llama.cpp per row
    gpu_session.sh  one GPU-box session for the expert hierarchy: tests/gpu, bench bw, bench decode
    gpu_engine.sh   one GPU-box session for the engine: fast-path tests, bench model, the llama.cpp peer, serve
"""
