"""engine/bench/gpu_extend.sh end to end on this machine: the GPU box's python replaced by a stand-in that answers
each bench process with a recorded `bench model` JSON (a box's), so the script's flow — the steps' status lines,
the extend lines, the table over every process and the box cache it leaves — is checked without a GPU. The real
extend_table runs on the files the stand-in wrote."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.engine.box_util import run_script, stand_in, stand_in_box

STAND_IN = stand_in("gpu_extend.sh", "engine.bench.extend_table",
                    '  *"-m engine.bench.profile_decode"*) echo "$args" >> "$CALLS.profile"; echo "profile" ;;')


@pytest.fixture()
def box(tmp_path):
    return stand_in_box(tmp_path, STAND_IN)


def _run(box, **extra: str) -> tuple[Path, str]:
    """Run the script in the box's checkout -> (its OUT, the summary it wrote)."""
    done = run_script(box, "gpu_extend.sh", **extra)
    assert done.returncode == 0, done.stderr[-2000:]
    return box[0] / "out", (box[0] / "out" / "summary.txt").read_text()


def test_every_process_reaches_the_table_with_its_status(box):
    out, summary = _run(box, RUNS="3", ARGS="--cpu-join host")
    assert "build_native (kept) rc=0" in summary
    for i in (1, 2, 3):
        assert f"run{i} rc=0" in summary
        assert f"run{i}: extend_256 " in summary
        assert json.loads((out / f"run{i}.json").read_text())["rows"]
    assert "run4" not in summary
    assert "profile rc=0" in summary
    calls = (out.parent / "calls.txt").read_text().splitlines()
    assert len(calls) == 3 and all("--router-zipf 1.0" in c and c.endswith("--cpu-join host --json " +
                                                                             str(out / f"run{i}.json"))
                                   for i, c in enumerate(calls, 1))
    table = json.loads((out / "table.json").read_text())
    assert [row["name"] for row in table["rows"]] == ["run1", "run2", "run3"]
    assert table["past"] == 3  # the recorded process ran at 3.59x
    assert "3 of 3" in summary  # the table's count, appended to the summary
    assert (out / "box-cache.tgz").is_file()


def test_zipf_empty_routes_uniformly_and_a_value_is_passed_on(box):
    out, _ = _run(box, RUNS="1", ZIPF="")
    calls = (out.parent / "calls.txt").read_text().splitlines()
    assert len(calls) == 1 and "--router-zipf" not in calls[0] and "--moe-slots 37.5%" in calls[0]
    (out.parent / "calls.txt").unlink()
    out, _ = _run(box, RUNS="1", ZIPF="0.8", PROFILE_ARGS="--extend-runs 8")
    assert "--router-zipf 0.8 " in (out.parent / "calls.txt").read_text()
    profiles = (out.parent / "calls.txt.profile").read_text().splitlines()
    assert "--router-zipf" not in profiles[0] and "--router-zipf 0.8 " in profiles[1]
    assert "--extend-runs 8" not in profiles[0] and "--extend 256 --extend-runs 8 --json" in profiles[1]


def test_a_deadline_too_short_for_a_process_runs_none_and_writes_no_table(box):
    out, summary = _run(box, DEADLINE="50")
    assert "build_native (kept) rc=0" in summary and "run1" not in summary and "profile" not in summary
    assert not (out / "table.json").exists()


def test_a_failed_process_is_named_and_the_table_covers_the_others(box):
    out, summary = _run(box, RUNS="3", FAIL_RUN="2")
    assert "run1 rc=0" in summary and "run2 rc=3" in summary and "run3 rc=0" in summary
    assert "CUDA error" in (out / "run2.log").read_text()
    assert [row["name"] for row in json.loads((out / "table.json").read_text())["rows"]] == ["run1", "run3"]
    assert "2 of 2" in summary


def test_old_native_alternates_the_builds_and_tables_each_arm(box):
    """OLD_NATIVE=FILE: odd processes run the native build in FILE (a box-cache.tgz), even ones this tree's, which
    native/ holds again after each old run and at the end; each arm gets its table."""
    tmp = box[0]
    native = tmp / "repo" / "native"
    native.mkdir()
    so = "_cpu_experts.cpython-312-x86_64-linux-gnu.so"
    (native / so).write_text("new\n")
    old = tmp / "old" / "native"
    old.mkdir(parents=True)
    (old / so).write_text("old\n")
    subprocess.run(["tar", "czf", str(tmp / "old.tgz"), "-C", str(tmp / "old"), "native"], check=True)
    out, summary = _run(box, RUNS="3", OLD_NATIVE=str(tmp / "old.tgz"))
    assert (tmp / "calls.txt.native").read_text().split() == ["old", "new", "old"]
    assert (native / so).read_text() == "new\n"
    assert "old1 rc=0" in summary and "run2 rc=0" in summary and "old3 rc=0" in summary
    assert [row["name"] for row in json.loads((out / "table.json").read_text())["rows"]] == ["run2"]
    assert [row["name"] for row in json.loads((out / "old_table.json").read_text())["rows"]] == ["old1", "old3"]
    assert "old native:" in summary


def test_old_tree_runs_the_odd_processes_from_that_tree_with_this_trees_native_build(box):
    """OLD_TREE=DIR (an earlier commit's engine/, carried): odd processes run from a copy of it, with this tree's
    native build beside it, even ones from this checkout; each arm gets its table, and the profile runs this tree.
    A DIR without engine/ stops the call, saying so."""
    tmp = box[0]
    native = tmp / "repo" / "native"
    native.mkdir()
    (native / "_cpu_experts.cpython-312-x86_64-linux-gnu.so").write_text("new\n")
    (tmp / "old" / "engine").mkdir(parents=True)
    out, summary = _run(box, RUNS="3", OLD_TREE=str(tmp / "old"))
    cwd = (tmp / "calls.txt.cwd").read_text().split()
    assert cwd[1] == str(tmp / "repo") and cwd[0] == cwd[2] != cwd[1]
    assert (tmp / "calls.txt.native").read_text().split() == ["new"] * 3
    assert "old1 rc=0" in summary and "run2 rc=0" in summary and "old3 rc=0" in summary
    assert [row["name"] for row in json.loads((out / "old_table.json").read_text())["rows"]] == ["old1", "old3"]
    assert "old tree:" in summary and "profile rc=0" in summary
    (tmp / "bare").mkdir()
    done = run_script(box, "gpu_extend.sh", OLD_TREE=str(tmp / "bare"))
    assert done.returncode == 2 and "holds no engine/" in (tmp / "out" / "summary.txt").read_text()


def test_old_rev_runs_the_odd_processes_from_that_commits_engine(box):
    """OLD=REV: the old processes run `git archive REV engine` of the checkout's .git; a REV it lacks stops the call,
    saying to carry the tree instead."""
    tmp = box[0]
    repo = tmp / "repo"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "engine"], check=True)
    subprocess.run(git + ["commit", "-qm", "old"], check=True)
    out, summary = _run(box, RUNS="2", OLD="HEAD")
    cwd = (tmp / "calls.txt.cwd").read_text().split()
    assert cwd[1] == str(repo) and cwd[0] != cwd[1] and Path(cwd[0], "engine").exists()
    assert "old1 rc=0" in summary and "run2 rc=0" in summary and "old tree:" in summary
    done = run_script(box, "gpu_extend.sh", OLD="no-such-rev")
    assert done.returncode == 2 and "is not in this checkout's .git" in (tmp / "out" / "summary.txt").read_text()


def test_an_old_native_file_without_a_build_stops_the_call(box):
    tmp = box[0]
    (tmp / "empty").mkdir()
    subprocess.run(["tar", "czf", str(tmp / "empty.tgz"), "-C", str(tmp / "empty"), "."], check=True)
    done = run_script(box, "gpu_extend.sh", OLD_NATIVE=str(tmp / "empty.tgz"))
    assert done.returncode == 2 and "holds no native build" in (tmp / "out" / "summary.txt").read_text()
