"""The `killick` command line: user errors are one line and exit 2; generate and model synth work."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.synth import synth_checkpoint
from proxy.cli.demo import DEFAULT_RECORDING


def killick(*args, env_cache=None, timeout=120):
    env = None
    if env_cache is not None:
        import os

        env = dict(os.environ, KILLICK_CACHE=str(env_cache), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=Path(__file__).resolve().parents[3])


def assert_user_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", seed=3)


def test_missing_model_dir(tmp_path):
    assert_user_error(killick("generate", "--model", str(tmp_path / "nope"), "--prompt", "x"), "nope", "--model")


def test_unsupported_architecture(tmp_path, tiny):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["model_type"] = "llama"
    cfg.pop("architectures", None)
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_user_error(killick("generate", "--model", str(bad), "--prompt", "x", "--raw"), "config.json")


def test_corrupt_safetensors(tmp_path, tiny):
    import shutil

    bad = shutil.copytree(tiny, tmp_path / "corrupt")
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert_user_error(killick("generate", "--model", str(bad), "--prompt", "x", "--raw"), shard.name)


def test_shape_mismatch_names_the_key(tmp_path, tiny):
    import shutil

    bad = shutil.copytree(tiny, tmp_path / "shape")
    cfg = json.loads((bad / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["hidden_size"] = text["hidden_size"] * 2
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_user_error(killick("generate", "--model", str(bad), "--prompt", "x", "--raw"), "weight")


def test_bad_flag_value_is_one_line(tmp_path):
    assert_user_error(killick("generate", "--prompt", "x", "--max-tokens", "0"), "--max-tokens")
    assert_user_error(killick("generate", "--prompt", "", "--raw"), "--prompt is empty")
    recording = str(DEFAULT_RECORDING)
    assert_user_error(killick("replay", recording, "--turns", "0"), "--turns must be at least 1")
    (tmp_path / "file").write_text("x")
    assert_user_error(killick("generate", "--model", str(tmp_path / "file"), "--prompt", "x"), "is a file")


def test_synth_then_generate_prints_a_completion(tmp_path):
    out = killick("model", "synth", str(tmp_path / "m"), "--size", "tiny", "--seed", "1")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "tokenizer.json").is_file() and (tmp_path / "m" / "config.json").is_file()
    gen = killick("generate", "--model", str(tmp_path / "m"), "--prompt", "hello", "--max-tokens", "5")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.strip() != ""
    # a directory that holds files (a real checkpoint, say) is not written over unless asked
    before = (tmp_path / "m" / "config.json").read_bytes()
    assert_user_error(killick("model", "synth", str(tmp_path / "m"), "--seed", "2"), "not empty", "--force")
    assert (tmp_path / "m" / "config.json").read_bytes() == before
    assert killick("model", "synth", str(tmp_path / "m"), "--seed", "2", "--force").returncode == 0


def test_generate_uses_the_demo_model_by_default(tmp_path):
    gen = killick("generate", "--prompt", "def f():", "--max-tokens", "4", env_cache=tmp_path)
    assert gen.returncode == 0, gen.stderr
    from engine.demo import DEMO_NAME

    config = json.loads((tmp_path / DEMO_NAME / "config.json").read_text())
    assert config["text_config"]["max_position_embeddings"] == 262144   # the window serve offers by default


@pytest.mark.parametrize("command", ["serve", "launch", "ctl", "demo", "replay", "generate", "model", "bench"])
def test_every_subcommand_has_help(command, capsys):
    """argparse formats help lazily: a stray % in one option's text only fails when --help runs."""
    from proxy.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser(only=command).parse_args([command, "--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_a_device_or_slots_that_cannot_work_are_refused_before_any_model_loads():
    """--device and --moe-slots are checked where they are parsed: argparse's usage, then one line naming the flag
    and what it takes."""
    import torch

    cases = [("serve", "--device", "tpu"), ("bench", "model", "--device", "gpu0")]
    if not torch.cuda.is_available():
        cases.append(("generate", "--prompt", "x", "--device", "cuda"))
    cases += [("serve", "--moe-slots", "abc"), ("serve", "--moe-slots", "150%"), ("bench", "model", "--moe-slots", "0")]
    for argv in cases:
        result = killick(*argv)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        if "--device" in argv:
            assert "argument --device" in last and ("expected cpu, cuda" in last or "use --device cpu" in last)
        else:
            assert "argument --moe-slots" in last and "a count of at least 1 or a share" in last


def test_a_path_results_cannot_go_to_is_refused_before_the_work(tmp_path):
    """demo, replay and bench write after minutes of work: a path in the way is one line at the start."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    (tmp_path / "empty.jsonl").write_text("")
    recording = str(DEFAULT_RECORDING)
    assert_user_error(killick("demo", "--out", str(blocker)), "--out", "is a file")
    assert_user_error(killick("replay", recording, "--json", str(blocker / "x.json")), "--json", "cannot write")
    assert_user_error(killick("replay", recording, "--plot", str(tmp_path)), "--plot", "is a directory")
    assert_user_error(killick("bench", "routing", "--json", str(tmp_path)), "--json", "is a directory")
    assert_user_error(killick("demo", "--recording", str(tmp_path / "empty.jsonl")), "holds no API requests")


def test_bench_decode_refuses_a_pool_larger_than_the_memory_left():
    """The full shape's 64 GB pool on a smaller machine: one line naming --small, not the OOM killer."""
    from engine.experts.synthetic import get_shape
    from engine.cache.tiers import default_host_budget

    if get_shape("qwen3.6-35b-a3b").pool_bytes <= 0.9 * default_host_budget(1.0):
        pytest.skip("this machine holds the full pool")
    assert_user_error(killick("bench", "decode", "--device", "cpu"), "GB of host RAM", "--small")


@pytest.mark.parametrize("argv", [("bench", "bw", "--rounds", "0"), ("bench", "bw", "--seconds", "-1"),
                                  ("bench", "bw", "--threads", "abc"), ("bench", "decode", "--backends", "nosuch"),
                                  ("bench", "decode", "--threads", "0")])
def test_bench_flags_are_checked_where_they_are_parsed(argv):
    result = killick(*argv)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"argument {argv[2]}" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv", [("--kv", "0"), ("--moe", "-3"), ("--prefix-device-mb", str(1 << 31)),
                                  ("--prefix-host-mb", "0")])
def test_ctl_cache_sizes_are_checked_where_they_are_parsed(argv):
    """Named by the flag the user typed, before any server is asked (it answered with its JSON field's name)."""
    result = killick("ctl", "--server", "http://127.0.0.1:1", "cache", *argv)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"argument {argv[0]}: expected a whole number from 1 to" in result.stderr.strip().splitlines()[-1]
