"""The kernel-vs-read benchmark runs end to end on a small pool and reports what docs/PERF.md quotes."""
import pytest

from engine.bench import cpu as bench_cpu
from engine.experts import cpu_kernels as ck

pytestmark = pytest.mark.skipif(not ck.native_available(), reason="native extension not built")


def test_bench_reports_kernel_read_and_torch(tmp_path, capsys):
    out = tmp_path / "b.json"
    res = bench_cpu.main(["--threads", "1", "--pool-gb", "0.2", "--seconds", "0.05", "--repeats", "2",
                          "--json", str(out)])
    (row,) = res["configs"]["default"]
    assert row["threads"] == 1 and row["isa"] == ck.supported_isas()[0]
    assert len(row["kernel_runs"]) == len(row["read_runs"]) == 2
    assert row["kernel_gbs"] == max(row["kernel_runs"]) > 0 and row["read_gbs"] == max(row["read_runs"]) > 0
    assert row["read_fastest_pass_gbs"] >= row["read_gbs"] * 0.999  # one pass is never below the average
    assert row["ratio"] == pytest.approx(row["kernel_gbs"] / row["read_gbs"]) and row["torch_gbs"] > 0
    assert len(row["read4_runs"]) == 2 and row["ratio4"] == pytest.approx(row["kernel_gbs"] / row["read4_gbs"])
    assert len(row["read_dyn_runs"]) == 2
    assert row["best_read_gbs"] == max(row["read_gbs"], row["read4_gbs"], row["read_dyn_gbs"])
    assert row["ratio_best"] == pytest.approx(row["kernel_gbs"] / row["best_read_gbs"])
    assert row["ratio_best"] <= row["ratio"]
    pairs = [k / r for k, r in zip(row["kernel_runs"], row["read_runs"])]
    assert row["ratio_rounds"] == pytest.approx(sum(pairs) / 2)  # the median of two rounds
    best_pairs = [k / max(r, r4, rd) for k, r, r4, rd in
                  zip(row["kernel_runs"], row["read_runs"], row["read4_runs"], row["read_dyn_runs"])]
    assert row["ratio_best_rounds"] == pytest.approx(sum(best_pairs) / 2)
    assert row["ratio_best_rounds"] <= row["ratio_rounds"] + 1e-12
    where = row["where"]  # the best kernel window's core-time, split by the pool's profile
    shares = [where[k] for k in ("wrapper", "dispatch", "run", "barrier", "tail", "wake")]
    # the shares partition the time (how large "run" is depends on the machine's load: a benchmark's figure)
    assert sum(shares) == pytest.approx(1.0) and all(x >= 0 for x in shares) and where["run"] > 0
    assert where["calls"] > 0
    assert where["gate_up_run"] + where["down_run"] == pytest.approx(where["run"])
    assert where["running_gbs"] >= row["kernel_gbs"]  # the loops alone run at least as fast as whole calls
    printed = capsys.readouterr().out
    assert out.exists() and "kernel GB/s" in printed and "GB/s running" in printed


def test_bench_takes_a_prompts_tokens_per_expert_and_reports_gflops(capsys):
    """--tokens past 4 (a prompt's experts, passes of up to 4 tokens): GFLOP/s = weight GB/s x tokens x 2 / 2
    bytes (bf16), and a token count the bench does not take is one usage error."""
    res = bench_cpu.main(["--threads", "1", "--pool-gb", "0.1", "--seconds", "0.03", "--repeats", "1",
                          "--tokens", "8", "--no-read4", "--no-read-dyn"])
    (row,) = res["configs"]["default"]
    assert row["kernel_gflops"] == pytest.approx(row["kernel_gbs"] * 8) and row["torch_gbs"] > 0
    assert "GFLOP/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_cpu.main(["--tokens", "5"])
