"""The llama.cpp peer's launcher and shell script, without llama.cpp: the pre-tokenizer fallback, the argument
checks, and the script's help agreeing with the options it parses."""
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
    assert len(parsed) == 18
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
