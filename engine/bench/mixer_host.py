"""The engine thread's time in a prompt's DeltaNet layer call of one short run (an extend's), with the bucketed mixer
(token_graphs.BucketedMixer: the work between the projections one graph a layer and bucket) and without it (the
gates, conv and gated norm launched as they come around the rule's own graph). An extend's first CPU job waits
for the host to queue its first layers, its end for the host to queue its last ones (docs/PERF.md issue 17), so
this is host time on the critical path. A part of the engine (FastPath._deltanet_prefill), not the engine.

    python -m engine.bench.mixer_host [--tokens 256] [--runs 20] [--layers 2] [--json out.json]

Each run is one extend of --tokens tokens on each arm's own sequence, the arms in turn; per DeltaNet layer call the
host's wall time (perf_counter around the call, no device sync inside it), and, from one more counted run, the
torch ops, Triton launches and graph replays it queued. On CUDA a synthetic model at Qwen3.6-35B-A3B widths (every
expert resident: the MoE layers do not matter here), graphs captured as serving does, fla-core's rule; it needs
CUDA (the tests run run() on the tiny shape under Triton's interpreter, which checks the script, not the time). The
logits of the two arms are compared on each run: they must be equal bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from engine.bench.args import print_and_save

ARMS = ("mixer", "as they come")


class _Counts:
    """Torch ops (a dispatch mode), Triton launches and CUDA graph replays queued while on."""

    def __init__(self):
        self.ops = self.launches = self.replays = 0

    @contextlib.contextmanager
    def on(self):
        import triton.runtime.jit as jit
        from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

        counts = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts.ops += 1
                return func(*args, **(kwargs or {}))

        kept = []
        for cls, name, attr in ((jit.JITFunction, "run", "launches"), (torch.cuda.CUDAGraph, "replay", "replays")):
            fn = getattr(cls, name)
            kept.append((cls, name, fn))

            def counted(*args, _fn=fn, _attr=attr, **kwargs):
                setattr(counts, _attr, getattr(counts, _attr) + 1)
                return _fn(*args, **kwargs)
            setattr(cls, name, counted)
        try:
            import triton.runtime.interpreter as interp

            fn = interp.InterpretedFunction.run
            kept.append((interp.InterpretedFunction, "run", fn))

            def interpreted(*args, _fn=fn, **kwargs):
                counts.launches += 1
                with _pop_mode_temporarily():  # the interpreter's own torch calls are not the host's queue
                    return _fn(*args, **kwargs)
            interp.InterpretedFunction.run = interpreted
        except (ImportError, AttributeError):
            pass
        mode = Ops()
        try:
            with mode:
                yield self
        finally:
            for cls, name, fn in kept:
                setattr(cls, name, fn)


def _model(layers: int):
    from engine.synth import synth_model

    if torch.cuda.is_available():
        model, _ = synth_model("qwen3.6-35b-a3b", layers=layers, device="cuda")
        return model, True
    model, _ = synth_model("tiny", layers=layers, device="cpu", dtype=torch.float32)
    return model, False


def run(tokens: int, runs: int, layers: int) -> dict:
    model, cuda = _model(layers)
    model.enable_fast(slots=2, capacity=tokens * (runs + 3) + 16, graphs=cuda)
    fast = model.fast
    if fast.prompt_mixer is None:
        if cuda:
            raise RuntimeError("no bucketed mixer on this model: fla-core is missing or the model is fp32")
        from engine.layers.delta_rule import chunked_gated_delta_rule
        from engine.models.token_graphs import BucketedRule

        fast.use_rule(BucketedRule(chunked_gated_delta_rule, capture=False))
    mixer, plain = fast.prompt_mixer, fast._deltanet_prefill
    walls = {arm: [] for arm in ARMS}
    counted = {arm: _Counts() for arm in ARMS}
    now = {"arm": ARMS[0], "counts": None}

    def timed(*args, **kwargs):
        if now["counts"] is not None:
            with now["counts"].on():
                return plain(*args, **kwargs)
        t0 = time.perf_counter()
        out = plain(*args, **kwargs)
        walls[now["arm"]].append(time.perf_counter() - t0)
        return out

    fast._deltanet_prefill = timed
    states = {arm: model.new_state() for arm in ARMS}
    g = torch.Generator().manual_seed(0)
    equal = True
    try:
        for k in range(runs + 2):  # the first: a prompt (the graphs captured), the last counted
            toks = torch.randint(0, model.config.vocab_size, (tokens,), generator=g)
            out = {}
            for arm in ARMS:
                fast.prompt_mixer = mixer if arm == "mixer" else None
                now["arm"], now["counts"] = arm, counted[arm] if k == runs + 1 else None
                out[arm] = model.forward([(toks, states[arm])])[0]
            if k == 0:
                for v in walls.values():
                    v.clear()
            equal = equal and torch.equal(out[ARMS[0]], out[ARMS[1]])
    finally:
        fast._deltanet_prefill, fast.prompt_mixer = plain, mixer
    calls = runs * sum(1 for layer in model.layers if not layer.is_attention)
    res = {"what": "part of the engine: FastPath._deltanet_prefill's host time, one sequence's run (no device sync)",
           "device": torch.cuda.get_device_name() if cuda else "cpu (Triton's interpreter: checks the script)",
           "tokens": tokens, "runs": runs, "layers": layers, "calls_timed": calls, "logits_equal": equal,
           "modes": fast.bucket_modes(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    per = calls // runs  # DeltaNet layer calls a run
    for arm in ARMS:
        c = counted[arm]
        res[arm] = {"median_us": statistics.median(walls[arm]) * 1e6, "mean_us": statistics.fmean(walls[arm]) * 1e6,
                    "torch_ops": c.ops / per, "triton_launches": c.launches / per, "graph_replays": c.replays / per}
    return res


def _table(res: dict) -> None:
    print(f"{res['what']}; {res['device']}; {res['tokens']}-token runs, {res['calls_timed']} layer calls an arm")
    print(f"{'arm':<14}{'median us':>11}{'mean us':>10}{'torch ops':>11}{'launches':>10}{'replays':>9}")
    for arm in ARMS:
        r = res[arm]
        print(f"{arm:<14}{r['median_us']:>11.1f}{r['mean_us']:>10.1f}{r['torch_ops']:>11.1f}"
              f"{r['triton_launches']:>10.1f}{r['graph_replays']:>9.1f}")
    print(f"logits equal bit for bit: {res['logits_equal']}; buckets: {res['modes']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.mixer_host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens of each run (at most 1024: a bucket's)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs an arm (default 20)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the synthetic model (default 2)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    if not 2 <= args.tokens <= 1024 or args.runs < 1 or args.layers < 1:
        ap.error("--tokens must be 2-1024 (a run a bucket takes), --runs and --layers at least 1")
    if not torch.cuda.is_available():
        ap.error("needs CUDA: it times the host's launches of the GPU engine (run it on the GPU box)")
    return print_and_save(run(args.tokens, args.runs, args.layers), _table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
