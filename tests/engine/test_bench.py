"""The benchmarks: bench bw writes the profile model loading reads (keyed on machine and format), bench
decode's smoke run, and both through `killick bench`."""
import json

import pytest
import torch

from engine.bench import bw as bench_bw
from engine.bench import decode as bench_decode
from engine.experts.profile import load_profile, profile_path
from engine.experts.synthetic import get_shape
from engine.synth import synth_config


def test_bench_bw_profile_is_keyed_on_machine_and_format(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert bench_bw.main(["--small", "--threads", "1", "--experts", "4", "--stream-mib", "8"]) == 0
    layout = get_shape("qwen3.6-35b-a3b", scale_down=True).layout
    prof = load_profile(layout, torch.float32, 1)
    assert prof and prof["bh"] > 0 and prof["bp"] is None and prof["stream_read"] > 0
    assert load_profile(layout, torch.float32, 2) is None  # other thread count
    assert load_profile(layout, torch.bfloat16, 1) is None  # other format
    path = profile_path(prof["key"])
    other = dict(prof, key=dict(prof["key"], gpu="NVIDIA H200"))  # copied from another machine
    path.write_text(json.dumps(other))
    assert load_profile(layout, torch.float32, 1) is None


def test_settled_cpu_shares_are_kept_per_machine_and_model_shape(tmp_path, monkeypatch):
    """profile.ShareMemory: a hybrid decode's settled CPU share per batch size, written for the next process
    under its key (machine, format, threads, layers, slots, model); another key's file, a broken one or out-of-range
    shares read as nothing; a batch size without its own share starts at the nearest one searching in this
    process, else the nearest settled one, else the default; an unwritable cache keeps the share in memory
    and says why."""
    from engine.experts.profile import ShareMemory, share_key, share_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    layout = get_shape("qwen3.6-35b-a3b", scale_down=True).layout
    key = share_key(layout, torch.bfloat16, 8, 40, 3840)
    mem = ShareMemory(key)
    assert mem.shares == {} and mem.start(1, {}, 0.47) == 0.47
    assert mem.settle(1, 0.71) and mem.settle(4, 0.62)
    again = ShareMemory(key)
    assert again.shares == {1: 0.71, 4: 0.62}
    assert again.start(1, {8: 0.5}, 0.47) == 0.71  # its own
    assert again.start(8, {2: 0.55}, 0.47) == 0.55  # the nearest searching here
    assert again.start(8, {}, 0.47) == 0.62  # the nearest settled
    assert ShareMemory(share_key(layout, torch.bfloat16, 8, 40, 2560)).shares == {}  # other slots
    assert ShareMemory(share_key(layout, torch.bfloat16, 14, 40, 3840)).shares == {}  # other threads
    assert ShareMemory(share_key(layout, torch.bfloat16, 8, 40, 3840, "router 1.5e3")).shares == {}  # model
    path = share_path(key)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(dict(doc, key=dict(key, gpu="NVIDIA H200"))))  # copied from another machine
    assert ShareMemory(key).shares == {}
    path.write_text(json.dumps({"key": key, "shares": {"1": 7.0, "2": 0.4}}))
    assert ShareMemory(key).shares == {2: 0.4}
    path.write_text("{not json")
    assert ShareMemory(key).shares == {}
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # the cache directory cannot be made
    mem = ShareMemory(key)
    assert not mem.settle(1, 0.6) and mem.shares == {1: 0.6} and "file" in mem.error
    assert not ShareMemory(None).settle(1, 0.6)  # nothing kept without a key (a fixed share)


def test_bench_decode_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_decode.main(["--small", "--threads", "1", "--steps", "2", "--warmup", "1",
                              "--prefill-tokens", "64", "--slots", "60%", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["rows"]}
    assert set(rows) >= {"decode offload t1", "decode cpu t1", "decode hybrid t1", "decode fused (all resident)"}
    assert rows["decode fused (all resident)"]["hit_rate"] == 1.0
    assert rows["decode cpu t1"]["fills_per_tok"] == 0 and rows["decode offload t1"]["cpu_per_tok"] == 0
    arms = rows["decode hybrid t1"]["arms"]  # hybrid's split choices in the timed steps
    assert set(arms) == {"split", "fill", "cpu", "explored"} and rows["decode offload t1"]["arms"] is None
    assert sum(arms[a] for a in ("split", "fill", "cpu")) <= 2 * res["shape"]["layers"]
    assert rows["prefill 64 stream"]["streamed"] and not rows["prefill 64 on-demand"]["streamed"]
    costs = res["routing_us_per_layer"]
    assert costs["host"] > 0 and costs["backend"] > 0 and not res["failed"]  # not an exception's repr
    assert "tok/s" in capsys.readouterr().out


def test_killick_bench_bw_command(tmp_path, monkeypatch, capsys):
    from proxy.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["bench", "bw", "--small", "--threads", "1", "--experts", "2", "--stream-mib", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["key"]["gpu"] in ("cpu-only", torch.cuda.get_device_name()
                                                                if torch.cuda.is_available() else "")
    assert main(["bench", "decode", "--small", "--routing", "nope"]) == 2  # a user error: one line, exit 2


def test_the_runtime_imports_no_benchmark():
    """Benchmarks live in engine/bench/; nothing else under engine/ may import them."""
    import ast
    from pathlib import Path

    import engine

    root = Path(engine.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == "bench":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [(str(path), n) for n in names if n == "engine.bench" or n.startswith("engine.bench.")]
    assert found == []


def test_bench_model_reports_expert_traffic_per_row(tmp_path, capsys, monkeypatch):
    """`bench model` on the whole engine with an expert cache: each row says how many pools' worth of experts
    it moved; layer-major, a prompt of four steps' tokens streams the pool about once, chunk by chunk four
    times; the placement pairs with llama.cpp's -ncmoe run of the same expert share."""
    from engine.bench import model as bench_model
    from engine.bench import traffic

    # what the cores read beside copies to the device (CUDA alone measures it: tests/gpu/test_experts_cuda.py)
    monkeypatch.setattr(traffic, "read_beside_copy", lambda pool: traffic.BesideCopy(30e9, 20e9))
    passes = {}
    for prefill in (None, 64):
        out = tmp_path / f"m{prefill}.json"
        argv = ["--synthetic", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1", "--steps", "4",
                "--warmup", "2", "--prompt", "8", "--prefill", "256", "--extend", "16", "--max-step-tokens", "64",
                "--moe-backend", "offload", "--moe-slots", "50%", "--prefill-runs", "2", "--json", str(out)]
        # (the chunked run decodes sampled, as an agent's requests do: the same counters a step)
        assert bench_model.main(argv + (["--max-prefill-tokens", str(prefill), "--temperature", "1"]
                                        if prefill else [])) == 0
        res = json.loads(out.read_text())
        assert res["temperature"] == (1.0 if prefill else 0.0)
        assert res["variant"] == "offload" and res["placement"] == "ncmoe2" and res["bp_gbs"] > 0
        assert res["decode_path"] in ("mapped", "host") and res["cpu_experts"].split()[0] in ("native", "torch")
        rows = {r["name"]: r for r in res["rows"]}
        assert set(rows) == {"decode_b1", "prefill_256", "extend_16"}
        assert all(r["placement"] == "ncmoe2" and "pool_passes" in r for r in rows.values())
        passes[prefill] = rows["prefill_256"]["pool_passes"]  # of the last timed prompt alone
        runs = rows["prefill_256"]["runs_s"]
        assert len(runs) == 2 and rows["prefill_256"]["seconds"] == pytest.approx(sum(runs) / 2)
        # decode's counters cover exactly the timed steps (probed on the engine thread): one token a step,
        # top-k lookups in every MoE layer, and its fills against B_P from those bytes
        dec, cfg = rows["decode_b1"], synth_config(size="tiny")
        text = cfg.get("text_config", cfg)
        lookups = dec["experts"]["hits"] + dec["experts"]["misses"]
        assert lookups == 4 * text["num_hidden_layers"] * text["num_experts_per_tok"]
        assert 0 < dec["decode_runner_ms"] <= dec["decode_step_ms"]  # the engine thread's split of a step
        moved = dec["experts"]["bytes_moved"] + dec["experts"]["bytes_read"]  # fills and in-place reads
        assert dec["fill_bytes_per_step"] == pytest.approx(moved / 4)
        if dec["fill_bytes_per_step"]:
            assert dec["fill_bound_tok_s"] == pytest.approx(res["bp_gbs"] * 1e9 / dec["fill_bytes_per_step"])
        ext = rows["extend_16"]  # against streaming the pool once at B_P, as the prefill
        assert ext["of_stream_bound"] == pytest.approx(ext["stream_bound_s"] * 1e3 / ext["ttft_ms"])
        assert ext["stream_bound_s"] == pytest.approx(rows["prefill_256"]["stream_bound_s"])
        # and against its misses read once from host DRAM at the read rate measured in the same process
        miss_bytes = (ext["experts"]["fills"] + ext["experts"]["cpu_runs"]) * res["pool_bytes"] / (
            text["num_hidden_layers"] * text["num_experts"])
        assert res["host_read_gbs"] == ext["host_read_gbs"] > 0
        assert ext["dram_bound_s"] == pytest.approx(miss_bytes / (ext["host_read_gbs"] * 1e9))
        assert ext["of_dram_bound"] == pytest.approx(ext["dram_bound_s"] * 1e3 / ext["ttft_ms"])
        assert res["read_beside_copy_gbs"] == 30 and res["copy_beside_read_gbs"] == 20
        # where the pool's pages sit among the host's NUMA nodes (the whole pool, where the kernel says)
        assert res["numa_nodes"] >= 0 and isinstance(res["gpu_numa_nodes"], list)
        assert res["pool_by_node"] == {} or sum(res["pool_by_node"].values()) == pytest.approx(1.0)
        assert ext["both_bound_s"] == pytest.approx(miss_bytes / 50e9)  # the cores and the copy engine at once
    assert passes[None] < 1.5 and passes[64] > 3.5
    printed = capsys.readouterr().out
    assert "pools moved" in printed and "x faster than the pool once at B_P" in printed
    assert "its misses at the host's read rate" in printed and "the copies' rates together" in printed
    assert "(30.0 beside copies to the device at 20.0)" in printed
    # the streaming choice says itself per prompt: on streams every prompt, off none (the routed experts alone)
    streamed = {}
    for mode in ("auto", "on", "off"):
        out = tmp_path / f"stream-{mode}.json"
        assert bench_model.main(argv[:-1] + [str(out), "--prefill-stream", mode, "--batches", "1"]) == 0
        res = json.loads(out.read_text())
        assert res["prefill_stream"] == mode
        rows = {r["name"]: r for r in res["rows"]}
        streamed[mode] = rows["prefill_256"]["streamed_forwards"], rows["extend_16"]["streamed_forwards"]
        assert rows["decode_b1"]["streamed_forwards"] == 0
    assert streamed["off"] == (0, 0) and min(streamed["on"]) >= 1
    assert "routed experts only" in capsys.readouterr().out


def test_bench_model_says_what_each_extend_did(tmp_path, capsys):
    """Several timed extends of one process: each run's TTFT with its fills, CPU runs and copies ahead and, with
    hybrid, the split's choices and explorations in that extend, and over the run the experts its prompts'
    calls touched against the heat's prediction; the last run's counters are the row's. An extend as long as the
    prompt: the warm-up extends too fit the context the run sizes for one."""
    from engine.bench import model as bench_model
    from engine.experts import lookahead

    out = tmp_path / "ext.json"
    assert bench_model.main(["--synthetic", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1",
                             "--steps", "2", "--warmup", "1", "--prompt", "8", "--prefill", "64", "--extend", "64",
                             "--extend-runs", "3", "--moe-backend", "hybrid", "--moe-slots", "50%",
                             "--prefill-stream", "off", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    ext = next(r for r in res["rows"] if r["name"] == "extend_64")
    runs = ext["extend_runs"]
    assert [r["ms"] for r in runs] == pytest.approx(ext["runs_ms"]) and len(runs) == 3
    assert {k: runs[-1][k] for k in ("fills", "cpu_runs", "ahead")} == \
        {k: ext["experts"][k] for k in ("fills", "cpu_runs", "ahead")}
    for r in runs:  # every routed layer call with misses chose one arm; explorations are some of them
        assert set(r["arms"]) == {"split", "fill", "cpu"} and 0 <= r["explored"] <= sum(r["arms"].values())
        assert r["fills"] + r["cpu_runs"] > 0 and sum(r["arms"].values()) > 0
        # the CPU jobs' read rate: their experts' bytes over the seconds they ran, where any ran
        assert ("cpu_gbs" in r) == (r["cpu_runs"] > 0) and r.get("cpu_gbs", 1.0) > 0
    assert sum(sum(r["arms"].values()) for r in runs) <= sum(res["split"]["arms"].values())
    printed = capsys.readouterr().out.splitlines()
    line = next(x for x in printed if x.startswith("extend_64 runs: "))
    assert line.count(" ms: ") == 3 and "split/fill/cpu" in line and "explored" in line
    assert line.count(" GB/s") == sum("cpu_gbs" in r for r in runs)
    lo, hi = lookahead.TOUCH_RANGE  # (the 8-token prompt: tiny's experts, top 2 of 8, not near-certain)
    assert res["split"]["touch_ratio"] and all(lo <= r <= hi for r in res["split"]["touch_ratio"].values())
    assert any(x.startswith("hybrid split over") and "touched / predicted: 8+ tokens" in x for x in printed)


def test_bench_model_runs_the_rule_in_the_tiles_and_the_routing_asked_for(tmp_path, capsys):
    """--rule-tiles NORM,BLOCK_V,WARPS, --skinny-tiles, --seam-topk and --cpu-join host: the run says which (JSON
    and header) and leaves the defaults as they were; a bad value is one usage line naming the form."""
    from engine.bench import model as bench_model
    from engine.experts import cpu_jobs
    from engine.kernels.deltanet_triton import RuleTiles, rule_tiles
    from engine.kernels.linear_triton import SKINNY_TILES, skinny_tiles
    from engine.models import fast

    out = tmp_path / "tiles.json"
    assert bench_model.main(["--synthetic", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1",
                             "--steps", "2", "--warmup", "1", "--prompt", "8", "--prefill", "0",
                             "--rule-tiles", "last,16,2", "--seam-topk", "--cpu-join", "host",
                             "--skinny-tiles", "narrow=32,64,4,2/head=16,128,2,6",
                             "--moe-backend", "hybrid", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rule_tiles"] == ["last", 16, 2] and res["seam_topk"] is True and res["cpu_join"] == "host"
    assert res["skinny_tiles"] == {"narrow": [32, 64, 4, 2], "head": [16, 128, 2, 6]}
    printed = capsys.readouterr().out
    assert "DeltaNet decode rule in tiles last,16,2" in printed and "routed in the add+norm+router launch" in printed
    assert "decode projections in tiles narrow=32,64,4,2 head=16,128,2,6" in printed
    assert "a prompt's CPU experts joined on the host" in printed
    assert rule_tiles(128) == RuleTiles("fused", 128, 8) and fast.SEAM_TOPK is False
    assert cpu_jobs.JOIN_ON_DEVICE is True
    assert skinny_tiles(37) == SKINNY_TILES["narrow"] and skinny_tiles(248320) == SKINNY_TILES["head"]
    for bad in ("after,16,2", "last,16", "last,x,2"):
        with pytest.raises(SystemExit) as exit_:
            bench_model.main(["--synthetic", "tiny", "--device", "cpu", "--rule-tiles", bad])
        assert exit_.value.code == 2 and "expected NORM,BLOCK_V,WARPS" in capsys.readouterr().err
    for bad in ("vocab=32,128,4,4", "head=32,128,4", "head=32,128,4,0", "head=1,2,3,4/head=1,2,3,4"):
        with pytest.raises(SystemExit) as exit_:
            bench_model.main(["--synthetic", "tiny", "--device", "cpu", "--skinny-tiles", bad])
        assert exit_.value.code == 2 and "expected CLASS=BN,BK,WARPS,STAGES" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, says", [
    ("--layers", "0", "must be at least 1, got 0"), ("--prompt", "0", "must be at least 1, got 0"),
    ("--prefill", "-5", "must be at least 0, got -5"), ("--extend", "0", "must be at least 1, got 0"),
    ("--extend-runs", "0", "must be at least 1, got 0"), ("--batches", "1,x", "expected comma-separated counts"),
    ("--router-zipf", "-1", "expected a number above 0"), ("--temperature", "-1", "expected a number of 0 or more"),
    ("--extend-idle-ms", "x", "expected a number of 0 or more"), ("--cpu-share", "1.5", "expected a share from 0 to 1"),
    ("--max-step-tokens", "0", "must be at least 1, got 0")])
def test_bench_model_names_a_bad_value_in_one_usage_line(capsys, flag, value, says):
    """Each was a traceback from inside the build or the run (or, for --max-step-tokens 0, silently the default)."""
    from engine.bench import model as bench_model

    with pytest.raises(SystemExit) as exit_:
        bench_model.main(["--synthetic", "tiny", "--device", "cpu", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err


@pytest.mark.parametrize("bench, flag, value, says", [
    ("decode", "--slots", "abc", "takes a count of at least 1 or a share"),
    ("decode", "--warm-prefill", "-3", "must be at least 0, got -3"),
    ("routing", "--tokens", "0", "must be at least 1, got 0"), ("routing", "--layers", "0", "must be at least 1")])
def test_expert_benches_name_a_bad_value_in_one_usage_line(capsys, bench, flag, value, says):
    """bench decode's --slots and --warm-prefill, bench routing's --tokens and --layers: tracebacks or a numpy error
    from deep inside before ("need at least one array to stack"), or a negative prompt taken as none."""
    from engine.bench import routing as bench_routing

    main = {"decode": bench_decode.main, "routing": bench_routing.main}[bench]
    with pytest.raises(SystemExit) as exit_:
        main([flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: " in (err := capsys.readouterr().err) and says in err


def test_bench_model_refuses_a_decode_window_it_cannot_time(capsys):
    """--warmup 0 timed from the first token (the prompt's) and printed a negative rate; the parser says so."""
    from engine.bench import model as bench_model

    for flag in ("--warmup", "--steps"):
        with pytest.raises(SystemExit) as exit_:
            bench_model.main(["--synthetic", "tiny", "--device", "cpu", flag, "0"])
        assert exit_.value.code == 2
        assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_profile_decode_runs_a_prompts_cpu_experts_on_the_workers_serve_would(monkeypatch, capsys, tmp_path):
    """profile_decode sets the CPU expert runner up as serve and bench model do (--expert-threads,
    --prompt-expert-threads; else engine/build.py's defaults), not at torch's thread count, so its extend's layer
    log is the served extend's; --router-zipf skews the synthetic routers as bench model's does; each timed
    extend's wall is kept in run order."""
    from engine import synth
    from engine.bench import profile_decode
    from engine.experts import cpu_runner

    for name in ("_threads", "_prompt_threads", "_tile_tokens"):
        monkeypatch.setattr(cpu_runner, name, [None])
    skewed, skew = [], synth._skew_routers
    monkeypatch.setattr(synth, "_skew_routers", lambda t, cfg, a, seed: skewed.append(a) or skew(t, cfg, a, seed))
    out = tmp_path / "p.json"
    assert profile_decode.main(["--device", "cpu", "--synthetic", "tiny", "--layers", "2", "--moe-backend", "hybrid",
                                "--moe-slots", "50%", "--router-zipf", "1.0", "--prefill", "64", "--extend", "32",
                                "--extend-runs", "2", "--steps", "2", "--expert-threads", "1",
                                "--prompt-expert-threads", "2", "--json", str(out)]) == 0
    assert cpu_runner.expert_threads() == 1 and cpu_runner.prompt_threads() == 2
    assert skewed == [1.0]
    ext = json.loads(out.read_text())["extend"]
    assert ext["tokens"] == 32 and len(ext["walls_ms"]) == len(ext["layer_calls_runs"]) == 2
    assert len(ext["copy_calls_runs"]) == 2 and all(n >= 0 for n in ext["copy_calls_runs"])
    assert len(ext["forward_at_runs"]) == 2
    text = capsys.readouterr().out
    assert text.count("its first MoE layer call began") == 2
    assert "extend 32 tokens after a cached 64" in text
    # the walls in run order, each beside its extend's layer calls
    for k, wall in enumerate(ext["walls_ms"], 1):
        assert f"timed extend {k} of 2 ({wall:.1f} ms): its MoE layer calls" in text
    assert f"median of {ext['walls_ms'][0]:.1f}, {ext['walls_ms'][1]:.1f}, in run order" in text
    # each timed extend sampled for the engine thread's stalls, its collections counted
    assert len(ext["stalls_runs"]) == 2 and all(r["samples"] > 0 for r in ext["stalls_runs"])
    assert text.count("engine thread still for 1.5 ms or more") == 2 and "garbage collections:" in text
    for n in ext["copy_calls_runs"]:
        assert f"copies issued to the slots: {n} (one a run" in text


def test_a_synthetic_size_no_bench_knows_is_one_usage_line(capsys):
    """--synthetic names a size of engine/synth.py (whole-model benches) or of experts/synthetic.py's SHAPES
    (expert benches); another name was a traceback from deep inside the build."""
    from engine.bench import model as bench_model
    from engine.bench import profile_decode
    from engine.experts.synthetic import SHAPES
    from engine.flags import EXPERT_SHAPES, SYNTH_SIZES
    from engine.synth import SIZES

    assert EXPERT_SHAPES == tuple(SHAPES) and SYNTH_SIZES == SIZES
    for main in (bench_model.main, profile_decode.main, bench_bw.main, bench_decode.main):
        with pytest.raises(SystemExit) as exit_:
            main(["--synthetic", "nope"])
        assert exit_.value.code == 2
        assert "argument --synthetic: invalid choice: 'nope'" in capsys.readouterr().err


def test_profile_decode_sums_the_extends_device_work_by_kernel():
    """Every stream's kernels and copies by name, most time first; host ops and events without a span left out."""
    from types import SimpleNamespace as NS

    from engine.bench.prof_events import device_work_by_kernel

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(start, end, name, device=cuda):
        return NS(time_range=NS(start=start, end=end), name=name, device_type=device)

    events = [ev(0, 500, "_expert_up_kernel"), ev(600, 700, "_expert_up_kernel"), ev(0, 2000, "Memcpy HtoD"),
              ev(0, 9000, "aten::mm", cpu), ev(800, 1200, "_wait_flag_kernel"), NS(time_range=None, name="x")]
    assert device_work_by_kernel(NS(events=lambda: events)) == [("Memcpy HtoD", 1, 2.0), ("_expert_up_kernel", 2, 0.6),
                                                          ("_wait_flag_kernel", 1, 0.4)]
    assert device_work_by_kernel(NS(events=lambda: events), top=1) == [("Memcpy HtoD", 1, 2.0)]


def test_profile_decode_counts_overlapping_spans_once():
    from engine.bench.prof_events import union_us

    assert union_us([]) == 0.0
    assert union_us([(20, 25), (0, 10), (5, 15), (6, 7)]) == 20.0  # [0, 15) and [20, 25)
    copies, kernels = [(0, 30), (60, 90)], [(25, 40), (85, 100)]
    assert union_us(copies) + union_us(kernels) - union_us(copies + kernels) == 10.0  # ran at once


def test_profile_decode_extend_gaps_name_the_engine_threads_ops_inside_them():
    """The extend's compute stream (the one with the most kernel time, not copies): gaps of GAP_US or more between its
    kernels, in time order, each with the top-level ops of the thread with the most of them, clipped to the gap,
    and the rest of the gap as Python time; a nested op and another stream's or thread's work are not counted."""
    from types import SimpleNamespace as NS

    import torch

    from engine.bench.prof_events import GAP_US, compute_gaps

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(start, end, name, device=cpu, stream=None, thread=1, parent=None):
        return NS(time_range=NS(start=start, end=end), name=name, device_type=device, device_resource_id=stream,
                  thread=thread, cpu_parent=parent)

    top = ev(1000, 1300, "aten::linear")
    events = [ev(0, 1000, "k0", cuda, 7), ev(1050, 1060, "k1", cuda, 7),  # 50 us: launch spacing
              ev(1060 + GAP_US + 400, 3000, "k2", cuda, 7), ev(0, 2900, "Memcpy HtoD", cuda, 9),  # busier, copies
              top, ev(1010, 1200, "aten::mm", parent=top),  # nested: inside its parent's time already
              ev(1300, 1400, "aten::add"), ev(1400, 1450, "fla::chunk"), ev(1500, 1700, "aten::zeros", thread=2),
              ev(2000, 2100, "other thread", thread=2), ev(5, 6, "no span", cuda, 7)]
    events[-1].time_range = None
    gaps = compute_gaps(NS(events=lambda: events))
    assert gaps["stream"] == 7 and gaps["busy_ms"] == (1000 + 10 + 3000 - 1560) / 1e3
    assert gaps["streams"] == {"7": gaps["busy_ms"], "9": 2.9}
    (gap,) = gaps["gaps"]
    assert gap["start_ms"] == 1.06 and gap["ms"] == (GAP_US + 400) / 1e3 == gaps["idle_ms"]
    ops = dict(gap["ops"])
    assert ops == {"aten::linear": 0.24, "aten::add": 0.1, "fla::chunk": 0.05,
                   "(no torch op: Python)": (GAP_US + 400 - 240 - 100 - 50) / 1e3}
    assert gap["ops"][0][0] == "aten::linear"  # the largest first
    assert compute_gaps(NS(events=lambda: [top]))["gaps"] == []  # no device work: nothing to say


def test_profile_decode_places_the_copy_stream_in_the_extends_device_work():
    """The stream with the most host-to-device copy time: its first copy's start from the first device work of any
    stream, its last copy's end before the last device work's end, its busy time (overlaps once) and its gaps of
    GAP_US or more between copies, the longest first; another stream's copies, device-to-host copies, host events
    and spanless events do not count; no such copy: None."""
    from types import SimpleNamespace as NS

    from engine.bench.prof_events import GAP_US, copy_timeline
    from engine.bench.profile_decode import _copy_line

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(start, end, name, stream=9, device=cuda):
        return NS(time_range=NS(start=start, end=end), name=name, device_type=device, device_resource_id=stream)

    events = [ev(0, 400, "k0", 7), ev(1000, 3000, "Memcpy HtoD (Pinned -> Device)"),
              ev(2500, 3050, "Memcpy HtoD (Pinned -> Device)"),  # overlaps the one before: no gap
              ev(3050 + GAP_US - 1, 4000, "Memcpy HtoD (Pinned -> Device)"),  # shorter than GAP_US: spacing
              ev(4000 + 2 * GAP_US, 5000, "Memcpy HtoD (Pinned -> Device)"),
              ev(5000 + 5 * GAP_US, 6000, "Memcpy HtoD (Pinned -> Device)"),
              ev(0, 200, "Memcpy HtoD (Pinned -> Device)", 11),  # a smaller copy stream
              ev(6000, 7500, "Memcpy DtoH (Device -> Pinned)", 7), ev(7500, 8000, "k1", 7),
              ev(0, 9000, "aten::copy_", None, cpu), NS(time_range=None, name="x", device_type=cuda)]
    c = copy_timeline(NS(events=lambda: events))
    assert c["stream"] == 9 and c["first_ms"] == 1.0 and c["ends_before_ms"] == 2.0 and c["span_ms"] == 8.0
    assert c["gaps"] == [(5.0, 5 * GAP_US / 1e3), (4.0, 2 * GAP_US / 1e3)]
    assert c["idle_ms"] == 7 * GAP_US / 1e3
    assert c["busy_ms"] == (3050 - 1000 + 4000 - 3050 - GAP_US + 1 + 1000 - 2 * GAP_US + 1000 - 5 * GAP_US) / 1e3
    line = _copy_line(c)
    assert line.startswith("copy stream 9: its first copy began 1.00 ms") and "last ended 2.00 ms before" in line
    assert f"in 2 gaps of {GAP_US} us or more (the longest: {5 * GAP_US / 1e3:.2f} at 5.00" in line
    assert copy_timeline(NS(events=lambda: events[:1] + events[-4:])) is None


def test_profile_decode_prints_an_extends_layer_calls(capsys):
    """One row a MoE layer call: when it started (from the first call), its plan, its copy calls, and its times; a
    call that read no routing back or ran nothing on the CPU shows '-' there, as an entry whose copies were not
    counted does."""
    from engine.bench.profile_decode import _print_calls
    from engine.experts.stats import LayerCall

    calls = [LayerCall(0, "unread", -1, 0, 0, 0, 115, 84, 2.84, 10.0, -1.0, -1.0, 0.0, 0.0, 3.0, copies=12),
             LayerCall(1, "routed", 115, 141, 0, 141, 113, 0, 2.47, 10.00541, 0.29, 1.55, 10.45, 7.86, 12.63, 0.9,
                       12.1, 2.2, 3.4),
             LayerCall(2, "routed", 120, 100, 10, 90, 0, 0, 2.47, 10.020, 4.0, 5.0, 8.0, 3.0, 9.5, 4.5, 9.0,
                       tail_ms=1.25)]
    _print_calls(calls, "the last timed extend")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines.pop() == ("the last routed layer (2): its fills landed +1.25 ms after its CPU job's end (negative: "
                           "the device waited for the job; hybrid.TailClock)")
    # jobs at 5.41 + 1.55 = 6.96 for 10.45 ms and 20 + 5 = 25 for 8: 25 + 8 - 6.96 = 26.04 ms, idle 7.59
    assert lines[-1] == ("the CPU's 2 jobs ran 18.45 ms of the 26.04 from the first's start to the last's end "
                         "(idle between them 7.59 ms); 228 experts copied ahead, 10 filled, 231 run on the CPU")
    assert lines[0].startswith("the last timed extend: its MoE layer calls")
    assert lines[1].split() == ["layer", "kind", "start", "hits", "misses", "fills", "cpu", "ahead", "copies",
                                "behind", "handoff", "routed", "planned", "cpu", "at", "cpu", "run", "waited", "ran",
                                "queued", "woke", "end"]
    assert lines[2].split() == ["0", "unread", "0.00", "-1", "0", "0", "0", "115", "12", "84", "2.84", "-", "-",
                                "-", "-", "-", "-", "-", "-", "3.00"]
    assert lines[3].split() == ["1", "routed", "5.41", "115", "141", "0", "141", "113", "-", "0", "2.47", "0.29",
                                "0.90", "1.55", "10.45", "7.86", "2.20", "3.40", "12.10", "12.63"]


def test_profile_decode_says_where_an_extends_start_and_end_go():
    """From the forward's start: its first MoE layer call and its CPU's first job; before the extend's end (its
    result on the host): the CPU's last job's end and the last layer call's return."""
    from engine.bench.profile_decode import _ends
    from engine.experts.stats import LayerCall

    calls = [LayerCall(0, "unread", -1, 0, 0, 0, 115, 84, 2.84, 10.004, -1.0, -1.0, 0.0, 0.0, 3.0),
             LayerCall(1, "joined", 115, 141, 0, 141, 113, 0, 2.47, 10.009, 0.29, 1.5, 10.0, 0.0, 2.0),
             LayerCall(2, "joined", 120, 100, 10, 90, 0, 0, 2.47, 10.020, 4.0, 5.0, 8.0, 0.0, 1.0),
             LayerCall(3, "unread", -1, 0, 0, 0, 0, 0, 2.47, 10.032, -1.0, -1.0, 0.0, 0.0, 1.0)]
    # the first job at 9 + 1.5 ms, the last ends at 20 + 5 + 8 = 33 ms, the last call returns at 32 + 1 = 33 ms
    assert _ends(calls, 10.0, 40.0) == ("its first MoE layer call began 4.00 ms into the forward, its first CPU job "
                                       "10.50 ms; its last CPU job ended 7.00 ms and its last returned 7.00 ms "
                                       "before the extend's end")
    assert _ends(calls[:1], 10.0, 8.0) == ("its first MoE layer call began 4.00 ms into the forward, its last "
                                          "returned 1.00 ms before the extend's end; no CPU job")


def test_spy_top_counts_each_thread_self_and_inclusive_frames():
    from engine.bench.spy_top import tables

    lines = ["thread (0x1): engine;run (a.py:1);step (a.py:2);f (a.py:3) 5\n",
             "thread (0x1): engine;run (a.py:1);step (a.py:2) 3\n",
             "thread (0x2): loop;select (s.py:9) 2\n",
             "thread (0x1): engine;run (a.py:1);g (a.py:4);g (a.py:4) 1\n",
             "not a sample line\n"]
    (t1, n1, own1, incl1), (t2, n2, own2, incl2) = tables(lines)
    assert (t1, n1, t2, n2) == ("engine", 9, "loop", 2)
    assert own1 == {"f (a.py:3)": 5, "step (a.py:2)": 3, "g (a.py:4)": 1}
    assert incl1["run (a.py:1)"] == 9 and incl1["step (a.py:2)"] == 8 and incl1["g (a.py:4)"] == 1  # once a sample
    assert own2 == {"select (s.py:9)": 2}


def test_bench_model_text_prompts_are_the_serve_benchs_text_cut_to_length(tmp_path):
    """--text-prompts: the words `engine.bench.serve` sends, tokenized by the checkpoint's tokenizer and cut to
    exactly n ids, the same for a seed; a directory without a tokenizer is named in the error."""
    from tokenizers import Tokenizer

    from engine.bench.model import Prompts
    from engine.bench.serve import prompt_text

    draw = Prompts.of_text(1000, "fixtures/tokenizer")
    a, b = draw(300, 4), draw(300, 5)
    assert len(a) == len(b) == 300 and a != b and draw(300, 4) == a
    whole = Tokenizer.from_file("fixtures/tokenizer/tokenizer.json").encode(prompt_text(400, 4)).ids
    assert whole[:300] == a
    assert len(Prompts(1000)(17, 1)) == 17 and max(Prompts(1000)(64, 1)) < 1000
    with pytest.raises(ValueError, match="no tokenizer.json in"):
        Prompts.of_text(1000, str(tmp_path))


def test_a_sync_counts_at_the_engine_line_that_made_it():
    """SyncSites counts each synchronizing call torch reports at the innermost engine frame outside engine/bench
    (else the innermost frame); other warnings are dropped; on a machine without CUDA it counts nothing."""
    import traceback

    from engine.bench.syncs import SyncSites, engine_site

    F = traceback.FrameSummary
    stack = [F("/r/engine/bench/profile_decode.py", 240, "once"), F("/r/engine/experts/offload.py", 310, "forward"),
             F("/r/engine/experts/compute.py", 44, "of"), F("/usr/lib/torch/_tensor.py", 9, "to")]
    assert engine_site(stack) == "experts/compute.py:44 of"
    assert engine_site(stack[:1]) == "bench/profile_decode.py:240 once"  # only the bench: its frame
    assert engine_site([F("C:\\r\\engine\\experts\\lru.py", 5, "tick")]) == "experts/lru.py:5 tick"
    with SyncSites() as syncs:
        torch.zeros(4).sum().item()
    if not torch.cuda.is_available():
        assert syncs.sites() == []
    for message in ("called a synchronizing CUDA operation", "something else") * 2:
        syncs.saw(message, UserWarning, "x.py", 1)
    ((site, n),) = syncs.sites()
    assert n == 2 and site.startswith("engine/test_bench.py:")  # no engine frame: the innermost, this test


def test_decode_bound_counts_the_experts_a_batch_routes_to_under_its_routing():
    """step_bytes: a layer's distinct experts are sum_e 1 - (1 - p_e)^batch; uniform p_e = K/E by default. One
    token reads K experts under any law; a batch of 8 reads fewer under a Zipf router than under uniform routing
    (#20's batch-8 line is measured against the bound of the routing that ran)."""
    from engine.bench.model import step_bytes
    from engine.config import config_from_dict
    from engine.experts.zipf import zipf_popularity
    from engine.synth import synth_config

    cfg = config_from_dict(synth_config("qwen3_5_moe", "qwen3.6-35b-a3b", layers=8))
    E, K = cfg.num_experts, cfg.top_k
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2 * len(cfg.moe_layers)
    zipf = zipf_popularity(E, K, 1.0)
    for b in (1, 8):
        uniform = step_bytes(cfg, 2, b, 100)
        assert uniform["experts"] == pytest.approx(E * (1 - (1 - K / E) ** b) * per_expert)
        skewed = step_bytes(cfg, 2, b, 100, zipf)
        assert skewed["experts"] == pytest.approx(float((1 - (1 - zipf) ** b).sum()) * per_expert)
        assert skewed["weights"] == uniform["weights"] and skewed["kv"] == uniform["kv"]
    assert step_bytes(cfg, 2, 1, 100, zipf)["experts"] == pytest.approx(K * per_expert)
    assert step_bytes(cfg, 2, 8, 100, zipf)["experts"] < 0.8 * step_bytes(cfg, 2, 8, 100)["experts"]
    # each sequence's DeltaNet state is read and written: [Hv, dk, dv] fp32 and a [C, K - 1] conv window a layer
    linear = sum(1 for t in cfg.layer_types if t != "full_attention")
    one = 2 * linear * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)
    for b in (1, 8):
        need = step_bytes(cfg, 2, b, 100)
        assert linear == 6 and need["state"] == b * one
        assert need["total"] == sum(v for k, v in need.items() if k != "total")


def test_batch_scaling_sets_each_batch_against_batch_one_measured_and_at_the_bound(capsys):
    """bench model's decode rows by batch: N x b1's step bytes over bN's is what bN / b1 would be with both steps at
    their bound; with b1 as measured, bN / b1 is at most N t1 / (t1 + bN's extra bytes at the HBM rate) (issue 20's
    b8 >= 5x b1 line set against what the bytes allow); no b1 row, nothing to set against."""
    from engine.bench.model import step_bytes
    from engine.bench.report import batch_scaling, print_batch_scaling
    from engine.config import config_from_dict
    from engine.synth import synth_config

    cfg = config_from_dict(synth_config("qwen3_5_moe", "qwen3.6-35b-a3b", layers=8))
    rows = [{"name": f"decode_b{b}", "tok_s": t, "ms_per_step": b * 1e3 / t, "step_bytes": step_bytes(cfg, 2, b, 100)}
            for b, t in ((1, 300.0), (4, 700.0), (8, 1200.0))] + [{"name": "prefill_64", "tok_s": 9.0}]
    rate = 4e12
    scaling = batch_scaling(rows, rate)
    assert list(scaling) == [4, 8]
    assert scaling[8]["measured"] == pytest.approx(4.0) and scaling[4]["measured"] == pytest.approx(7 / 3)
    one, eight = rows[0]["step_bytes"]["total"], rows[2]["step_bytes"]["total"]
    assert scaling[8]["at_bound"] == pytest.approx(8 * one / eight)
    assert 1 < scaling[4]["at_bound"] < scaling[8]["at_bound"] < 8  # a batch's experts and state grow with it
    assert scaling[8]["extra_bytes"] == eight - one
    t1, t8 = 1 / 300, 8 / 1200
    assert scaling[8]["extra_rate"] == pytest.approx((eight - one) / (t8 - t1))
    assert scaling[8]["beside_b1"] == pytest.approx(8 * t1 / (t1 + (eight - one) / rate))
    # b8 at its ceiling beside this b1: its extra bytes at the rate, so the measured ratio meets the ceiling
    at_rate = dict(rows[2], ms_per_step=(t1 + (eight - one) / rate) * 1e3, tok_s=8 / (t1 + (eight - one) / rate))
    ceiling = batch_scaling([rows[0], at_rate], rate)[8]
    assert ceiling["measured"] == pytest.approx(ceiling["beside_b1"]) and ceiling["extra_rate"] == pytest.approx(rate)
    assert batch_scaling(rows[1:], rate) == {}
    print_batch_scaling({"batch_scaling": {str(b): s for b, s in scaling.items()}})  # as the JSON holds it
    printed = capsys.readouterr().out
    assert printed.startswith("decode rate over batch 1's: b4 2.33x (") and ", b8 4.00x (" in printed
    assert "at most beside this b1" in printed and "TB/s" in printed
    print_batch_scaling({"batch_scaling": batch_scaling(rows)})  # no HBM rate (CPU): no ceiling
    assert "with both at their bound)" in capsys.readouterr().out
    print_batch_scaling({"batch_scaling": {}})
    assert capsys.readouterr().out == ""


def test_tiles_rule_sweep_times_every_candidate_over_every_layers_state(monkeypatch):
    """bench tiles' rule sweep (Triton's interpreter here, small widths): each batch times the fused rule in each
    warp count and the split one in each slice narrower than the head, with the norm in its own launch or in each
    head's last program, each replay stepping every copy's state once, the default marked, and rates them by the
    state bytes read and written."""
    pytest.importorskip("triton")
    import engine.bench.tiles as tiles

    monkeypatch.setattr(tiles, "HK", 2)
    monkeypatch.setattr(tiles, "HV", 4)
    monkeypatch.setattr(tiles, "DH", 32)
    monkeypatch.setattr(tiles, "DELTANET_C", 2 * 2 * 32 + 4 * 32)
    monkeypatch.setattr(tiles, "DELTANET_P", 2 * 2 * 32 + 2 * 4 * 32 + 2 * 4)
    def one_replay(fn):
        fn()
        return 6.0  # us for all copies

    monkeypatch.setattr(tiles, "graph_us", one_replay)
    rows = tiles.sweep_rule([1, 3], copies=2, device="cpu")
    whats = ["fused v32 w4", "fused v32 w8 (default)", "fused v32 w16", "launch v16 w2", "launch v16 w4",
             "launch v16 w8", "last v16 w2", "last v16 w4", "last v16 w8"]
    assert [(r["batch"], r["what"]) for r in rows] == [(b, w) for b in (1, 3) for w in whats]
    assert all(r["us"] == 3.0 for r in rows)  # per copy
    assert rows[len(whats)]["tbs"] == pytest.approx(2 * 3 * 4 * 32 * 32 * 4 / 3.0 / 1e6)


def test_tiles_picks_each_width_class_by_a_steps_worth_of_its_projections():
    """bench tiles' best_by_class: a class's candidates are summed over its projections weighed by how often a
    decode step calls each (30 DeltaNet in for 10 q|k|v), beside the engine's own tiles' sum; cuBLAS and the
    router (not a skinny call in the step) do not count."""
    from engine.bench.tiles import best_by_class
    from engine.kernels.linear_triton import SKINNY_TILES

    own, other = list(SKINNY_TILES["wide"]), [64, 64, 4, 6]

    def row(name, n, tiles, us, batch=1):
        return dict(kind="projection", name=name, n=n, k=2048, batch=batch, tiles=tiles, us=us)

    rows = [row("deltanet in", 12352, own, 10.0), row("deltanet in", 12352, other, 12.0),
            row("attn q|k|v", 9216, own, 10.0), row("attn q|k|v", 9216, other, 5.0),
            row("deltanet in", 12352, "cublas", 1.0), row("router", 257, other, 0.1),
            row("lm_head", 248320, own, 300.0), row("lm_head", 248320, other, 280.0),
            row("lm_head", 248320, own, 1.0, batch=8)]
    best = best_by_class(rows, 1)
    # other is faster summed alone (12 + 5 against 10 + 10), slower over a step (30 x 12 + 10 x 5 = 410 against 400)
    assert best["wide"] == (tuple(own), 400.0, 400.0)
    assert best["head"] == (tuple(other), 280.0, 300.0) and "narrow" not in best


def test_bench_model_header_names_the_prompt_rule(capsys):
    """The header says which DeltaNet rule a prompt ran: without fla-core a CUDA box runs the torch rule, ~1.5 ms
    of host time a DeltaNet layer of an extend, and its rows say little of the engine with fla."""
    from engine.bench.report import print_table

    res = {"what": "whole engine", "model": "synthetic", "dtype": "bfloat16", "path": "fast", "device": "GPU",
           "hbm_copy_gbs": 1.0, "commit": "abc", "rows": []}
    for rule, said in (("torch", "a prompt's DeltaNet rule torch (fla-core not installed)"),
                       ("fla-core", "a prompt's DeltaNet rule fla-core,")):
        print_table({**res, "prompt_rule": rule})
        assert said in capsys.readouterr().out
    print_table({**res, "path": "eager", "prompt_rule": None})
    assert "DeltaNet rule" not in capsys.readouterr().out


def test_numa_placement_names_the_pools_nodes_and_the_gpus(tmp_path, capsys):
    """The header says where the pool's pages and the GPU sit where the host has several NUMA nodes: a pool on
    the node away from the GPU reads slower by its fills and its CPU runs alike."""
    from engine.bench.report import print_table
    from engine.bench.traffic import numa_placement

    for node in ("node0", "node1", "possible"):
        (tmp_path / "devices/system/node" / node).mkdir(parents=True)
    for dev, vendor, cls, node in (("0000:17:00.0", "0x10de", "0x030200", "1"),  # an NVIDIA GPU
                                   ("0000:17:00.1", "0x10de", "0x040300", "1"),  # its audio function
                                   ("0000:03:00.0", "0x8086", "0x020000", "0"),  # a NIC
                                   ("0000:65:00.0", "0x10de", "0x030200", "-1")):  # a GPU sysfs gives no node
        d = tmp_path / "bus/pci/devices" / dev
        d.mkdir(parents=True)
        for name, value in (("vendor", vendor), ("class", cls), ("numa_node", node)):
            (d / name).write_text(value + "\n")

    class Pool:
        def bytes_by_node(self):
            return {1: 3 << 30, 0: 1 << 30}

    placed = numa_placement(Pool(), root=str(tmp_path))
    assert placed == {"numa_nodes": 2, "gpu_numa_nodes": [1, -1], "pool_by_node": {0: 0.25, 1: 0.75}}
    res = {"what": "whole engine", "model": "synthetic", "dtype": "bfloat16", "path": "fast", "device": "GPU",
           "hbm_copy_gbs": 1.0, "commit": "abc", "rows": [], "variant": "hybrid", "slots": 96, "slot_policy": "lru",
           "experts_on_gpu": "37.5%", "placement": "ncmoe5", "decode_path": "mapped", "cpu_experts": "native",
           "pool_huge": 1.0, "bp_gbs": 50.0, "host_read_gbs": 100.0}
    print_table({**res, **placed})
    assert "pool 100% in huge pages (node 0 25%, node 1 75%; GPU on node 1, -1)," in capsys.readouterr().out
    print_table({**res, **numa_placement(Pool(), root=str(tmp_path / "none"))})  # one node or none: said nothing
    assert "in huge pages, prefill stream" in capsys.readouterr().out
