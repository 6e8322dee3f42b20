"""Run llama.cpp's `convert_hf_to_gguf.py` on a checkpoint whose tokenizer llama.cpp does not know.

    python -m engine.bench.peers.to_gguf --llama-cpp SRC [--pre-tokenizer qwen35] -- MODEL_DIR --outtype bf16 ...

Everything after `--` goes to the converter unchanged. The converter names the BPE pre-tokenizer by hashing
the token ids of a probe string and refuses any hash it has not seen; our checkpoints ship a small BPE
tokenizer of their own (fixtures/tokenizer), so conversion stops there although the vocabulary has no effect on
speed. This launcher loads the converter from the unpacked llama.cpp source and, only when that lookup fails,
answers with `--pre-tokenizer` (the name the released Qwen3.5/3.6 checkpoints get). Nothing of llama.cpp is
copied or edited; a tokenizer the converter knows converts exactly as it would without us.
"""
from __future__ import annotations

import argparse
import logging
import runpy
import sys
from pathlib import Path

log = logging.getLogger("killick.to_gguf")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, sep, rest = _split(argv)
    ap = argparse.ArgumentParser(prog="python -m engine.bench.peers.to_gguf", description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True,
                    help="the unpacked llama.cpp source (holds convert_hf_to_gguf.py, conversion/, gguf-py/)")
    ap.add_argument("--pre-tokenizer", default="qwen35",
                    help="tokenizer.ggml.pre written when the converter does not recognise the tokenizer")
    args = ap.parse_args(ours)
    if not sep or not rest:
        ap.error("give the converter's arguments after `--` (at least the model directory)")
    script = args.llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        ap.error(f"{script} not found: --llama-cpp must be the llama.cpp folder of the unpacked sdist")
    return args, rest


def _split(argv: list[str]) -> tuple[list[str], bool, list[str]]:
    if "--" not in argv:
        return argv, False, []
    i = argv.index("--")
    return argv[:i], True, argv[i + 1:]


def allow_unknown_pre_tokenizer(text_model: type, fallback: str) -> None:
    """Wrap `text_model.get_vocab_base_pre` so an unknown tokenizer hash yields `fallback`."""
    known = text_model.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            log.warning("pre-tokenizer not in this llama.cpp's table; writing %r (speed does not depend on it)",
                        fallback)
            return fallback

    text_model.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str] | None = None) -> None:
    args, converter_argv = parse_args(sys.argv[1:] if argv is None else argv)
    src = args.llama_cpp.resolve()
    # The converter imports its `conversion` package from beside itself and prefers its own gguf-py.
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion import TextModel  # noqa: PLC0415 (importable only once the path is set)

    allow_unknown_pre_tokenizer(TextModel, args.pre_tokenizer)
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *converter_argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
