"""`killick bench model`'s printed report: one line a row (decode, prefill, extend) with what each measured
against its bound, each batch against batch 1, then each timed extend's expert traffic, how the bucketed graphs
ran and the hybrid split."""
from __future__ import annotations


def print_buckets(res: dict) -> None:
    if res.get("decode_buckets"):
        print("decode steps by batch size: " + ", ".join(f"{b} {m}" for b, m in res["decode_buckets"].items()))
    for name, modes in res.get("prompt_buckets", {}).items():  # (JSON keys are strings)
        print(f"a prompt's {name} by token bucket: " + ", ".join(f"{b} {m}" for b, m in modes.items()))


def print_split(res: dict) -> None:
    if "graph_cpu" in res:
        g = res["graph_cpu"]
        print(f"hybrid decode, CPU share inside the graph: share {g['share']:.2f} at the end (best by batch size "
              f"{g.get('best', {})} from {g.get('start', {})}, {g.get('moves', 0)} moves; shares kept "
              f"for the next start {g.get('settled', {})}), the device waited "
              f"for the CPU in {g['waited_steps']} of {g['steps']} steps; {g['pairs']} pairs in {g['layers_run']} "
              f"layer runs, {g['busy_s'] * 1e3:.1f} ms busy, {g['skipped']} torn reads retried")
    if "split" not in res:
        return
    sp = res["split"]
    rates = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sp["rates"].items())
    ratios = ", ".join(f"{n}+ tokens {r:.2f}" for n, r in sorted(sp.get("touch_ratio", {}).items()))
    touched = f"; a prompt's experts touched / predicted: {ratios}" if ratios else ""
    tail = sp.get("tail")
    lag = (f"; a prompt's last routed layer counts its fills {tail['lag_ms']:+.1f} ms late ({tail['samples']} "
           f"measured, the last {tail['last_ms']:+.1f} ms)") if tail and tail["samples"] else ""
    print(f"hybrid split over the run: choices {sp['arms']} ({sp['explored']} explorations); rates GB/s: {rates}"
          + touched + lag)


def _numa(res: dict) -> str:
    """Where the pool's pages and the GPU sit, for the header line, where the host has more than one NUMA node."""
    if res.get("numa_nodes", 0) < 2:
        return ""
    shares = ", ".join(f"node {node} {share:.0%}" for node, share in res.get("pool_by_node", {}).items())
    gpus = ", ".join(str(n) for n in res.get("gpu_numa_nodes", [])) or "unknown"
    return f" ({shares or 'nodes unknown'}; GPU on node {gpus})"


def print_table(res: dict) -> None:
    cached = (f", experts {res['variant']} {res['slots']} {res['slot_policy']} slots ({res['experts_on_gpu']}, "
              f"as llama.cpp {res['placement']}), decode {res['decode_path']}, CPU experts {res['cpu_experts']}, "
              f"pool {res.get('pool_huge', 0):.0%} in huge pages{_numa(res)}, "
              f"prefill stream {res.get('prefill_stream', 'auto')}, "
              f"prefetch {res.get('prefetch', 'off')}, lookahead {res.get('lookahead', 'off')}, "
              f"B_P {res['bp_gbs']:.1f} GB/s, host read {res.get('host_read_gbs', 0):.1f} GB/s"
              + (f" ({res['read_beside_copy_gbs']:.1f} beside copies to the device at "
                 f"{res['copy_beside_read_gbs']:.1f})" if "read_beside_copy_gbs" in res else "")
              ) if "bp_gbs" in res else ""
    overlap = ", decode steps overlapped" if res.get("overlap") else ", decode steps one at a time"
    if res.get("temperature"):
        overlap += f", decode sampled at temperature {res['temperature']}"
    if res.get("seam_topk"):
        overlap += ", 2-16 tokens routed in the add+norm+router launch"
    if res.get("cpu_join"):
        overlap += f", a prompt's CPU experts joined on the {res['cpu_join']}"
    if res.get("prompt_rule"):
        overlap += f", a prompt's DeltaNet rule {res['prompt_rule']}" + (" (fla-core not installed)" if
                                                                       res["prompt_rule"] == "torch" else "")
    if res.get("rule_tiles"):
        overlap += ", DeltaNet decode rule in tiles " + ",".join(map(str, res["rule_tiles"]))
    if res.get("skinny_tiles"):
        overlap += ", decode projections in tiles " + " ".join(
            f"{k}={','.join(map(str, v))}" for k, v in res["skinny_tiles"].items())
    print(f"bench model — {res['what']}; {res['model']}, {res['dtype']}, {res['path']} path{overlap}, "
          f"{res['device']}, prompts of {res.get('prompts', 'random ids')}, HBM copy {res['hbm_copy_gbs']:.0f} GB/s"
          f"{cached}, commit {res['commit']}")
    print(f"{'row':<16}{'tok/s':>12}{'ms/step':>10}{'bound tok/s':>13}{'of bound':>10}  note")
    for r in res["rows"]:
        note = ""
        if r["name"].startswith("prefill"):
            note = f"{r['seconds']:.3f} s"
            if len(r.get("runs_s", ())) > 1:
                note += f" (median of {', '.join(f'{x:.3f}' for x in r['runs_s'])})"
            if "stream_bound_s" in r:
                note += f"; pool once at B_P {r['stream_bound_s']:.3f} s ({r['of_stream_bound']:.2f} of it)"
        if r["name"].startswith("extend"):
            note = f"TTFT {r['ttft_ms']:.1f} ms"
            if len(r.get("runs_ms", ())) > 1:
                note += f" (median of {', '.join(f'{x:.1f}' for x in r['runs_ms'])})"
            note += f", {r['reused_tokens']} tokens reused"
            if r.get("idle_ms"):  # --extend-idle-ms: the agent's tool time, which the idle refresh uses
                note += f", arrived {r['idle_ms']:.0f} ms after the prompt ({r['idle_refreshed']} experts refreshed)"
            if "stream_bound_s" in r:  # issue 17 asks an extend to be 3x faster than streaming every expert
                note += f"; {r['of_stream_bound']:.2f}x faster than the pool once at B_P ({r['stream_bound_s']:.3f} s)"
            if "dram_bound_s" in r:  # its misses read once from host DRAM: the floor of any split
                note += f"; its misses at the host's read rate {r['dram_bound_s'] * 1e3:.1f} ms " \
                        f"({r['of_dram_bound']:.2f} of it)"
                if "both_bound_s" in r:  # the cores' reads and the copy engine's together: the floor
                    note += f", at the cores' and the copies' rates together {r['both_bound_s'] * 1e3:.1f} ms " \
                            f"({r['of_both_bound']:.2f} of it)"
        if "pool_passes" in r:
            note += f"{'; ' if note else ''}{r['pool_passes']:.2f} pools moved, hit rate " \
                    f"{r['experts']['hits'] / max(1, r['experts']['hits'] + r['experts']['misses']):.2f}"
            if not r["name"].startswith("decode"):
                note += ", layers streamed" if r["streamed_forwards"] else ", routed experts only"
        if "decode_runner_ms" in r:
            note += f"{'; ' if note else ''}engine thread: step {r['decode_step_ms']:.3f} ms, runner " \
                    f"{r['decode_runner_ms']:.3f} ms"
        if "fill_bound_tok_s" in r:
            note += f"; its PCIe bytes alone at B_P {r['fill_bound_tok_s']:.1f} tok/s ({r['of_fill_bound']:.2f} of it)"
        if r.get("experts", {}).get("guesses"):
            ex = r["experts"]  # --moe-prefetch on: wrong guesses' bytes are traffic beyond the PCIe bytes above
            note += f"; prefetched {ex['guesses']} guesses, {ex['guesses_right'] / ex['guesses']:.2f} right"
        if r.get("experts", {}).get("ahead"):
            ex = r["experts"]  # --moe-lookahead: copies of the next layer's likely misses, and how many it read
            note += f"; {ex['fills']} fills, {ex['cpu_runs']} on the CPU, {ex['ahead']} copied ahead " \
                    f"({ex['ahead_used']} read)"
        print(f"{r['name']:<16}{r['tok_s']:>12.1f}{r.get('ms_per_step', float('nan')):>10.3f}"
              f"{r.get('bound_tok_s', float('nan')):>13.1f}{r.get('of_bound', float('nan')):>10.2f}  {note}")
    print_batch_scaling(res)
    print_extend_runs(res)
    print_buckets(res)
    print_split(res)


def batch_scaling(rows: list[dict], hbm_rate: float = float("nan")) -> dict:
    """Each larger batch's decode rate over batch 1's: measured; at the bound (N x batch 1's step bytes over batch
    N's: the ratio when both steps read their bytes at one rate); and at most beside the batch 1 that ran (batch
    N's step taking batch 1's time plus its extra bytes at hbm_rate, bytes/s). Batching pays by what a step's
    weights are shared over; a batch's experts and state grow with it (issue 20's b8 >= 5x b1 line). extra_rate:
    the rate batch N's extra bytes ran at (its extra bytes over its extra time)."""
    decode = {r["name"]: r for r in rows if r["name"].startswith("decode_b")}
    one = decode.get("decode_b1")
    if one is None:
        return {}
    out = {}
    t1, bytes1 = one["ms_per_step"] / 1e3, one["step_bytes"]["total"]
    for name, r in decode.items():
        b = int(name.removeprefix("decode_b"))
        if b > 1:
            extra, extra_s = r["step_bytes"]["total"] - bytes1, r["ms_per_step"] / 1e3 - t1
            out[b] = {"measured": r["tok_s"] / one["tok_s"], "at_bound": b * bytes1 / r["step_bytes"]["total"],
                      "beside_b1": b * t1 / (t1 + extra / hbm_rate), "extra_bytes": extra,
                      "extra_rate": extra / extra_s if extra_s > 0 else float("inf")}
    return out


def print_batch_scaling(res: dict) -> None:
    scaling = res.get("batch_scaling") or {}
    parts = []
    for b, s in scaling.items():  # (JSON keys are strings)
        part = f"b{b} {s['measured']:.2f}x ({s['at_bound']:.2f}x with both at their bound"
        if s["beside_b1"] == s["beside_b1"]:  # (nan without an HBM rate: off CUDA)
            part += f"; {s['beside_b1']:.2f}x at most beside this b1: its {s['extra_bytes'] / 1e9:.2f} GB more a " \
                    f"step at the HBM copy rate, where they ran at {s['extra_rate'] / 1e12:.2f} TB/s"
        parts.append(part + ")")
    if parts:
        print("decode rate over batch 1's: " + ", ".join(parts))


def print_extend_runs(res: dict) -> None:
    """One line per timed extend (when there are several) with what its expert cache did: extends of one process
    spread (H200 box: 76-117 ms on the same prefix), and this says whether explorations or fills went with it."""
    for r in res["rows"]:
        runs = r.get("extend_runs") or []
        if len(runs) < 2 or "fills" not in runs[0]:
            continue
        parts = []
        for run in runs:
            part = f"{run['ms']:.1f} ms: {run['fills']} fills ({run['ahead']} ahead, {run['ahead_used']} read), " \
                   f"{run['cpu_runs']} on the CPU" + (f" at {run['cpu_gbs']:.1f} GB/s" if "cpu_gbs" in run else "")
            if "arms" in run:
                part += f", split/fill/cpu {'/'.join(str(run['arms'].get(a, 0)) for a in ('split', 'fill', 'cpu'))}" \
                        f" ({run['explored']} explored)"
            parts.append(part)
        print(f"{r['name']} runs: " + "; ".join(parts))
