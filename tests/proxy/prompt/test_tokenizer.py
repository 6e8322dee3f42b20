import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from proxy.prompt.tokenizer import SHIPPED_DIR, load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


_SHIPPED = load_tokenizer(None)
_LIBRARY = HFTokenizer.from_file(str(SHIPPED_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok():
    return _SHIPPED


def test_shipped_files_fit_the_budget():
    assert (SHIPPED_DIR / "tokenizer.json").stat().st_size <= 2 * 1024 * 1024
    assert (SHIPPED_DIR / "chat_template.jinja").is_file()


def test_special_tokens_are_single_tokens_at_fixed_ids(tok):
    assert tok.vocab_size == 8192
    for i, s in enumerate(SPECIALS):
        assert tok.token_id(s) == 8183 + i
        assert tok.encode(s) == [8183 + i]
        assert tok.encode(f"x{s}y")[1:2] == [8183 + i]  # parsed inside text too
    assert set(tok.special_ids) == set(SPECIALS)
    assert tok.eos_ids == (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>"))


def test_round_trip_unicode_and_code(tok):
    text = ('<|im_start|>user\nZürich → 東京 😀 naïve\tcafé<|im_end|>\n'
            'def f(x: int) -> dict:\n    return {"a": [1, 2.5e-3], "b": None}  # ünïcode\r\n\n\n  ')
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "<|im_start|>" not in tok.decode(ids, skip_special=True)
    assert len(ids) < len(text)  # merges were learned, not just bytes


def test_code_and_json_compress_well(tok):
    code = 'import os\n\ndef main():\n    for name in sorted(os.listdir(path)):\n        print(name)\n'
    call = '{"name": "bash", "arguments": {"command": "ls -la", "timeout": 120}}'
    assert len(tok.encode(code)) <= len(code) / 2.5
    assert len(tok.encode(call)) <= len(call) / 2


def test_incremental_decoder_holds_back_split_utf8(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji's four bytes are several tokens
    dec = tok.incremental_decoder()
    deltas = [dec.push([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_incremental_decoder_streams_mixed_text(tok):
    text = "héllo 世界 😀 <think>\nx = 'ß'\n</think>\n\nok<|im_end|>"
    dec = tok.incremental_decoder()
    deltas = [dec.push([i]) for i in tok.encode(text)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + dec.flush() == text


def test_incremental_decoder_flushes_incomplete_tail(tok):
    ids = tok.encode("a😀")
    dec = tok.incremental_decoder()
    out = dec.push(ids[:-1])
    assert out == "a"
    assert dec.flush().startswith("\ufffd")


def _tiny_tokenizer_json(path):
    vocab = {"[a]": 0, "<|im_start|>": 1}
    t = HFTokenizer(models.WordLevel(vocab, unk_token="[a]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<|im_end|>", "<|endoftext|>"])
    t.save(str(path))


def test_model_dir_tokenizer_and_template_are_used(tmp_path):
    _tiny_tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    tok = load_tokenizer(tmp_path)
    assert tok.path == tmp_path / "tokenizer.json" and tok.vocab_size == 4
    assert tok.chat_template.startswith("{% for m in messages %}")
    assert tok.eos_ids == (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>"))


def test_template_from_tokenizer_config(tmp_path):
    shutil.copy(SHIPPED_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
           "eos_token": {"content": "<|im_end|>"}, "bos_token": None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(tmp_path))
    assert tok.chat_template == "D" and tok.template_path == tmp_path / "tokenizer_config.json"
    assert tok.eos_token == "<|im_end|>" and tok.bos_token is None


def test_dir_without_tokenizer_falls_back_to_shipped(tmp_path):
    tok = load_tokenizer(tmp_path)
    assert tok.path == SHIPPED_DIR / "tokenizer.json"
    assert tok.template_path == SHIPPED_DIR / "chat_template.jinja"


def test_user_errors_name_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text("not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        load_tokenizer(None).token_id("<nope>")


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=0, max_size=40), cuts=st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_incremental_decoder_matches_full_decode(text, cuts):
    tok = _SHIPPED
    ids = tok.encode(text)
    dec = tok.incremental_decoder()
    out, i, k = [], 0, 0
    while i < len(ids):
        n = cuts[k % len(cuts)]
        out.append(dec.push(ids[i:i + n]))
        i, k = i + n, k + 1
    assert "".join(out) + dec.flush() == tok.decode(ids) == text


@settings(max_examples=80, deadline=None)
@given(parts=st.lists(st.one_of(st.sampled_from(SPECIALS + ["\n", " ", "<think", "|>"]), st.text(max_size=12)),
                      max_size=12))
def test_piecewise_encoding_equals_the_library(parts):
    text = "".join(parts)
    enc = _LIBRARY.encode(text, add_special_tokens=False)
    for _ in range(2):  # cold, then from the piece cache
        assert _SHIPPED.encode_with_offsets(text) == (enc.ids, enc.offsets)
        assert _SHIPPED.encode_with_starts(text) == (enc.ids, [a for a, _ in enc.offsets])


def test_piecewise_encoding_with_a_normalizer(tmp_path):
    from tokenizers import normalizers
    lib = HFTokenizer.from_file(str(SHIPPED_DIR / "tokenizer.json"))
    lib.normalizer = normalizers.NFC()  # what real Qwen tokenizers carry
    lib.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    text = "<|im_start|>user\ncafe\u0301 A\u030a<|im_end|>\n<think>\ne\u0301\n</think>"
    enc = lib.encode(text, add_special_tokens=False)
    assert tok.encode_with_offsets(text) == (enc.ids, enc.offsets) == tok.encode_with_offsets(text)
    assert tok._added_re is not None  # the fast path is in use


def test_piecewise_encoding_falls_back_for_stripping_added_tokens(tmp_path):
    from tokenizers import AddedToken
    lib = HFTokenizer.from_file(str(SHIPPED_DIR / "tokenizer.json"))
    lib.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    lib.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok._added_re is None
    assert tok.encode("a  <mask> b") == lib.encode("a  <mask> b", add_special_tokens=False).ids


def test_special_token_text_marked_literal_is_encoded_as_text(tok):
    text = "<|im_start|>user\nsay <|im_end|>\n<|im_start|>system<|im_end|>\n"
    literal = {text.index("<|im_end|>\n<|im_start|>system"), text.index("<|im_start|>system")}
    ids, offsets = tok.encode_with_offsets(text, literal_at=literal)
    assert tok.encode_with_starts(text, literal_at=literal) == (ids, [a for a, _ in offsets])
    specials = [i for i in ids if i in tok.special_ids.values()]
    assert specials == [tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")]  # the template's two only
    assert tok.decode(ids) == text and [text[a:b] for a, b in offsets] == [tok.decode([i]) for i in ids]


def test_literal_special_tokens_in_the_whole_text_fallback(tmp_path):
    from tokenizers import AddedToken
    lib = HFTokenizer.from_file(str(SHIPPED_DIR / "tokenizer.json"))
    lib.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    lib.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    text = "x<|im_end|>y<|im_end|>"
    ids, offsets = tok.encode_with_offsets(text, literal_at={1})
    assert ids.count(tok.token_id("<|im_end|>")) == 1 and tok.decode(ids) == text
    assert tok.encode_with_starts(text, literal_at={1}) == (ids, [a for a, _ in offsets])


def test_piece_cache_is_bounded_by_bytes():
    from proxy.prompt.tokenizer import PieceCache, flat_offsets

    cache = PieceCache(64 * 1024)
    for n in range(200):
        piece = f"{n} " * 200
        cache.put(piece, list(range(200)), flat_offsets([(i, i + 1) for i in range(200)]))
        assert cache.bytes <= cache.budget
    ids, flat = cache.get("199 " * 200)  # kept as given
    assert ids == list(range(200)) and flat.tolist() == [x for i in range(200) for x in (i, i + 1)]
    assert cache.get("0 " * 200) is None  # least recently used out
    huge = "x" * 9000  # over an eighth of the budget: encoded each time, never kept
    ids, flat = cache.put(huge, [1], flat_offsets([(0, 9000)]))
    assert ids == [1] and flat.tolist() == [0, 9000]
    assert cache.get(huge) is None


def test_distinct_large_texts_leave_the_cache_within_budget(tok):
    for n in range(4):
        tok.encode(f"{n} lorem ipsum dolor " * 20_000)
    assert tok._pieces.bytes <= tok._pieces.budget


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(max_size=300), max_size=6), limit=st.integers(1, 60))
def test_tokens_at_least_never_exceeds_the_real_count(texts, limit):
    assert _SHIPPED.tokens_at_least(texts, limit) <= sum(len(_SHIPPED._plain.encode(t)) for t in texts)


def test_tokens_at_least_counts_a_bounded_prefix(tok, monkeypatch):
    counted = []
    real = tok._plain.encode
    monkeypatch.setattr(tok, "_plain", type("Spy", (), {"encode": lambda self, t, **kw: (counted.append(len(t)),
                                                                                          real(t, **kw))[1]})())
    text = "word and more words, " * 100_000  # 2.1 MB of ordinary text
    assert tok.tokens_at_least([text], 4096) >= 4096
    assert sum(counted) <= 2 * 65536  # a prefix, not 2 MB
    assert tok.tokens_at_least(["x" * (tok.max_token_chars * 5000)], 4096) >= 4096  # by characters alone


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.one_of(st.sampled_from([" the", " Engine", "  ", "\n", "\t", " 42", ".", " (x)", " é", "中",
                                                 " it's", " x_y", "🙂", " \n"]), st.text(max_size=8)),
                      min_size=1, max_size=400))
def test_long_text_encoded_in_parallel_chunks_equals_the_library(words):
    """A long piece is encoded in chunks cut at SAFE_CUT, in parallel: ids and offsets as one encode gives."""
    from proxy.prompt.tokenizer import SPLIT_MIN_CHARS, _safe_cuts

    text = "".join(words)
    enc = _LIBRARY.encode(text, add_special_tokens=False)
    assert _SHIPPED.splits
    ids, flat = _SHIPPED._encode_piece(text, min_chars=0, chunk=24)
    assert ids == enc.ids and flat.tolist() == [x for pair in enc.offsets for x in pair]
    long = (text + "x word") * (SPLIT_MIN_CHARS // (len(text) + 6) + 1)
    assert _safe_cuts(long, 2048)  # the public path does split it
    got = _SHIPPED.encode_with_offsets(long)
    want = _LIBRARY.encode(long, add_special_tokens=False)
    assert got == (want.ids, want.offsets)


def test_a_tokenizer_that_merges_across_spaces_is_never_split(tmp_path):
    """A BPE trained without a pre-tokenizer has merges across " word" boundaries: the load-time probe sees
    chunked encoding differ and turns splitting off, so its long texts are encoded whole."""
    from tokenizers import trainers

    from proxy.prompt.tokenizer import SPLIT_PROBE

    lib = HFTokenizer(models.BPE())
    lib.train_from_iterator([SPLIT_PROBE * 50], trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                                   show_progress=False))
    lib.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert not tok.splits
    text = SPLIT_PROBE * 80
    assert tok.encode_with_offsets(text) == (lib.encode(text, add_special_tokens=False).ids,
                                             lib.encode(text, add_special_tokens=False).offsets)
