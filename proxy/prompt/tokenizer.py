"""Tokenizer loading, encode/decode and streaming decode. Torch-free: the proxy imports it.

`load_tokenizer(model_dir)` uses the model directory's own `tokenizer.json` and chat template when present
(`chat_template.jinja`, else `chat_template` in `tokenizer_config.json`), and killick's shipped ones
(fixtures/tokenizer/, see train_tokenizer.py there) otherwise. Special tokens written in text are parsed as
the special tokens they name (the chat template relies on it), except where the caller says the text is the
conversation's own (`literal_at`, see proxy/prompt/literal.py): there they are encoded as plain characters.
"""
from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path
from typing import Collection, Iterable

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from engine.demo import SHIPPED_TOKENIZER
from proxy.prompt.encodings import ByteOffsets, PieceCache, RecentTexts, flat_offsets

SHIPPED_DIR = SHIPPED_TOKENIZER
TEMPLATE_FILE = "chat_template.jinja"
# Qwen's end-of-turn and end-of-text: generation stops at either.
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
CHUNK_CACHE_BYTES = 64 * 2**20  # encodings of text pieces between special tokens, remembered up to this size
DENSE_CHARS = 8  # tokens_at_least counts tokens only for text longer than this many characters a token
COUNT_CHUNK = 1 << 16  # characters counted per call
# A piece of text this long or longer is encoded in chunks of about SPLIT_CHARS, in parallel (the tokenizers
# library's thread pool), cut only where a byte-level BPE with a GPT/Qwen-style pre-tokenizer starts a new
# pre-token whatever came before: a single space after a non-space, before an ASCII letter (" word"). Whether
# this tokenizer encodes that way is checked at load on probe text (`_splits_exactly`); if not, it never splits.
# The first render of an 8k-token prompt spent 17 of its 25 ms in one encode call on the dev box.
SPLIT_MIN_CHARS = 8192
SPLIT_CHARS = 2048
SAFE_CUT = re.compile(r"(?<=\S) (?=[A-Za-z])")
SPLIT_PROBE = ("def f(x):\n    return x  +  1  # ok\t\tdone\n\n  The Café naïve 中文 text, 1234 56.7e-3 "
               "it's they'll I'd don't; [a](b) {\"k\": \"v\"}  \r\n  end  ·  émoji 🙂 x  y\n- item one\n"
               "  indented   spaces\tand tabs ... ?! <tag attr='1'>body</tag> A.B C-D e_f g/h 'quoted' z ")


class Tokenizer:
    """A `tokenizers` tokenizer plus the chat template and special tokens that go with it."""

    def __init__(self, hf: _HFTokenizer, chat_template: str, *, path: Path, template_path: Path,
                 bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._tok = hf
        self.chat_template = chat_template
        self.path = path  # the tokenizer.json in use
        self.template_path = template_path  # where chat_template came from
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.special_ids = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        eos = [s for s in EOS_TOKENS if hf.token_to_id(s) is not None]
        if eos_token and eos_token not in eos and hf.token_to_id(eos_token) is not None:
            eos.append(eos_token)
        self.eos_ids: tuple[int, ...] = tuple(hf.token_to_id(s) for s in eos)
        self.specials = tuple(sorted(self.special_ids, key=len, reverse=True))
        self.max_token_chars = max(map(len, [*hf.get_vocab(with_added_tokens=True), "x"]))  # longest token
        self._added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
        self._added_re = _added_token_splitter(hf)
        self._plain = _HFTokenizer.from_str(hf.to_str())  # special-token text in it is just text
        self._plain.encode_special_tokens = True
        self._longest_added = max(map(len, self._added), default=0)
        self._pieces = PieceCache(CHUNK_CACHE_BYTES)
        self._recent = RecentTexts()
        self._nfc = type(hf.normalizer).__name__ == "NFC"  # offsets from ids hold for text already in NFC
        self.byte_offsets = self._offsets_from_ids() if hf.normalizer is None or self._nfc else None
        self.splits = self._splits_exactly()

    def encode(self, text: str) -> list[int]:
        return self._encode(text, ())[0]

    def encode_with_offsets(self, text: str,
                            literal_at: Collection[int] = ()) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and, per token, the (start, end) character span of `text` it came from; a special-token string
        starting at an offset in `literal_at` is encoded as the characters it is.

        tokenizers cuts text at added tokens before anything else and encodes the pieces independently, so
        encoding piece by piece gives exactly its ids; remembering pieces makes re-rendering a long
        conversation every turn cost only its new text.
        """
        ids, flat = self._encode(text, literal_at)
        return ids, list(zip(flat[0::2].tolist(), flat[1::2].tolist()))

    def encode_with_starts(self, text: str, literal_at: Collection[int] = ()) -> tuple[list[int], list[int]]:
        """As encode_with_offsets, with only each token's first character: what a render needs, without a
        tuple a token (building, shifting and caching those took ~5 ms of an 8k-token render on the dev box)."""
        ids, flat = self._encode(text, literal_at)
        return ids, flat[0::2].tolist()

    def _encode(self, text: str, literal_at: Collection[int]) -> tuple[list[int], np.ndarray]:
        """Ids and their offsets flat (int32 [2n]: start, end, start, end, ...)."""
        if self._added_re is None:
            return self._encode_whole(text, literal_at)
        ids, head, cuts, start = self._recent.prefix(text, literal_at, self._longest_added)
        flats = [head]
        for m in self._added_re.finditer(text, start):
            if m.start() in literal_at:
                continue
            self._add_piece(ids, flats, text, start, m.start())
            ids.append(self._added[m.group()])
            cuts.append(m.start())
            flats.append(np.array(m.span(), dtype=np.int32))
            start = m.end()
        self._add_piece(ids, flats, text, start, len(text))
        flat = np.concatenate(flats)
        self._recent.put(text, literal_at, cuts, ids, flat)
        return ids, flat

    def _add_piece(self, ids: list[int], flats: list[np.ndarray], text: str, start: int, end: int) -> None:
        if end <= start:
            return
        piece = text[start:end]
        hit = self._pieces.get(piece)
        if hit is None:
            hit = self._pieces.put(piece, *self._encode_piece(piece))
        piece_ids, flat = hit
        ids += piece_ids
        flats.append(flat + start)  # a new array: the cached one stays relative to its piece

    def _encode_piece(self, piece: str, min_chars: int = SPLIT_MIN_CHARS,
                      chunk: int = SPLIT_CHARS) -> tuple[list[int], np.ndarray]:
        """Ids and flat offsets of text with no added tokens in it: in chunks at safe cuts (_encode_chunks)
        where the tokenizer splits exactly and the piece is long; else in one call. Offsets come from the
        ids (byte_offsets) where they agree with the library's, which then need not track them."""
        cuts = _safe_cuts(piece, chunk) if self.splits and len(piece) >= min_chars else []
        if self.byte_offsets is not None and not (self._nfc and not unicodedata.is_normalized("NFC", piece)):
            bounds = [0, *cuts, len(piece)]
            ids: list[int] = []
            for enc in self._plain.encode_batch_fast([piece[a:b] for a, b in zip(bounds, bounds[1:])],
                                                     add_special_tokens=False):
                ids += enc.ids
            return ids, self.byte_offsets.flat(piece, ids)
        if not cuts:
            enc = self._plain.encode(piece, add_special_tokens=False)
            return enc.ids, flat_offsets(enc.offsets)
        return self._encode_chunks(piece, cuts)

    def _encode_chunks(self, piece: str, cuts: list[int]) -> tuple[list[int], np.ndarray]:
        """Ids and flat offsets of piece cut at `cuts`, the chunks encoded in one batch (in parallel)."""
        bounds = [0, *cuts, len(piece)]
        ids: list[int] = []
        flats: list[np.ndarray] = []
        for a, enc in zip(bounds, self._plain.encode_batch([piece[a:b] for a, b in zip(bounds, bounds[1:])],
                                                            add_special_tokens=False)):
            ids += enc.ids
            flats.append(flat_offsets(enc.offsets, a))
        return ids, np.concatenate(flats)

    def _offsets_from_ids(self) -> ByteOffsets | None:
        """ByteOffsets where the ids alone give the library's offsets on probe text (a byte-level BPE), else None."""
        text = SPLIT_PROBE * 3
        try:
            offsets = ByteOffsets(self._plain.get_vocab(with_added_tokens=True), self._added)
            enc = self._plain.encode(text, add_special_tokens=False)
            fast = self._plain.encode_batch_fast([text], add_special_tokens=False)[0]
            same = fast.ids == enc.ids and np.array_equal(offsets.flat(text, enc.ids), flat_offsets(enc.offsets))
        except Exception:  # noqa: BLE001 - a library without encode_batch_fast: its own offsets
            return None
        return offsets if same else None

    def _splits_exactly(self) -> bool:
        """Whether encoding at SAFE_CUT cuts gives the ids and offsets of encoding whole, on probe text cut
        every few characters (tokenizers whose pre-tokenizer could join across such a cut fail it)."""
        text = SPLIT_PROBE * 3
        cuts = _safe_cuts(text, 16)
        enc = self._plain.encode(text, add_special_tokens=False)
        try:
            ids, flat = self._encode_chunks(text, cuts)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot batch: encode whole
            return False
        return len(cuts) > 10 and ids == enc.ids and np.array_equal(flat, flat_offsets(enc.offsets))

    def _encode_whole(self, text: str, literal_at: Collection[int]) -> tuple[list[int], np.ndarray]:
        """Tokenizers whose added tokens strip spaces or match whole words: the whole text at once (literal
        special-token strings cut out and encoded as text)."""
        ids: list[int] = []
        flats: list[np.ndarray] = []
        start = 0
        for at in sorted(literal_at):
            token = next((s for s in self.specials if text.startswith(s, at)), None)
            if token is None or at < start:
                continue
            for tok, (a, b) in ((self._tok, (start, at)), (self._plain, (at, at + len(token)))):
                enc = tok.encode(text[a:b], add_special_tokens=False)
                ids += enc.ids
                flats.append(flat_offsets(enc.offsets, a))
            start = at + len(token)
        enc = self._tok.encode(text[start:], add_special_tokens=False)
        return ids + enc.ids, np.concatenate([*flats, flat_offsets(enc.offsets, start)])

    def tokens_at_least(self, texts: Iterable[str], limit: int) -> int:
        """A token count that a prompt holding all of `texts` reaches at least, counted no further than limit
        and cheaply: its characters over the longest token's (every token covers at most that many), then,
        for text sparser than DENSE_CHARS a token, the tokens of a prefix, COUNT_CHUNK characters at a time
        (less two tokens a cut, where a word split in two may have encoded longer)."""
        texts = list(texts)
        chars = sum(map(len, texts))
        at_least = chars // self.max_token_chars
        if at_least >= limit or chars <= DENSE_CHARS * limit:
            return at_least
        counted = 0
        for text in texts:
            for a in range(0, len(text), COUNT_CHUNK):
                counted += max(0, len(self._plain.encode(text[a:a + COUNT_CHUNK], add_special_tokens=False)) - 2)
                if counted >= limit:
                    return counted
        return max(at_least, counted)

    def cache_stats(self) -> dict:
        return {"piece_cache_bytes": self._pieces.bytes, "piece_cache_budget": self._pieces.budget,
                "pieces": len(self._pieces)}

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"token {token!r} is not in the vocabulary of {self.path}")
        return i

    def incremental_decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special)


def _safe_cuts(text: str, chunk: int) -> list[int]:
    """Cut positions about `chunk` characters apart, each at a SAFE_CUT match (none where none is near)."""
    cuts, at = [], chunk
    while at < len(text):
        m = SAFE_CUT.search(text, at, min(len(text), at + chunk))
        if m is None:
            at += chunk
            continue
        cuts.append(m.start())
        at = m.start() + chunk
    return cuts


class IncrementalDecoder:
    """Turns a stream of ids into text deltas; never emits half of a multi-byte character.

    A token can end inside a UTF-8 sequence (byte-level BPE), which decodes to U+FFFD. Trailing U+FFFD are
    held back until the ids that complete the character arrive; flush() emits whatever is left at the end.
    Each push decodes only from `_prefix` (the last complete token, kept as context for decoders that treat
    a leading token specially), so streaming costs O(new tokens) per push.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # decode context starts here
        self._emitted = 0  # characters of decode(ids[_prefix:]) already returned

    def push(self, ids) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        stable = text.rstrip("\ufffd")
        delta = stable[self._emitted:]
        self._emitted = max(self._emitted, len(stable))
        if stable == text:  # nothing pending: restart the context at the last token
            self._restart()
        return delta

    def flush(self) -> str:
        """The held-back tail (incomplete characters come out as U+FFFD)."""
        text = self._tok.decode(self._ids[self._prefix:], self._skip)[self._emitted:]
        self._prefix, self._emitted = len(self._ids), 0
        return text

    def _restart(self) -> None:
        last = self._tok.decode(self._ids[-1:], self._skip)
        if "\ufffd" in last:  # a lone fragment of a character is no context
            self._prefix, self._emitted = len(self._ids), 0
        else:
            self._prefix, self._emitted = len(self._ids) - 1, len(last)


def _added_token_splitter(hf: _HFTokenizer) -> re.Pattern | None:
    """A regex splitting text at added tokens the way tokenizers does, or None where piecewise encoding
    might differ: added tokens that strip spaces, match whole words only, or are matched after a normalizer
    (tokens with normalized=False are cut from the raw text first, so a normalizer alone is fine)."""
    added = list(hf.get_added_tokens_decoder().values())
    if not added or any(t.lstrip or t.rstrip or t.single_word for t in added):
        return None
    if hf.normalizer is not None and any(t.normalized for t in added):
        return None
    contents = sorted({t.content for t in added}, key=len, reverse=True)  # leftmost-longest, as tokenizers
    return re.compile("(" + "|".join(map(re.escape, contents)) + ")")


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The model directory's tokenizer and chat template where it has them, the shipped ones otherwise."""
    root = _model_root(model_dir)
    tok_path = root / "tokenizer.json" if root and (root / "tokenizer.json").is_file() \
        else SHIPPED_DIR / "tokenizer.json"
    config = _read_config(root / "tokenizer_config.json") if root else {}
    template, template_path = _find_template(root, config)
    return Tokenizer(_read_tokenizer(tok_path), template, path=tok_path, template_path=template_path,
                     bos_token=_token_str(config.get("bos_token")),
                     eos_token=_token_str(config.get("eos_token")))


def _model_root(model_dir: str | Path | None) -> Path | None:
    if model_dir is None:
        return None
    root = Path(model_dir)
    if not root.is_dir():
        raise ValueError(f"model directory {root} does not exist: pass an existing checkpoint directory")
    return root


def _read_tokenizer(path: Path) -> _HFTokenizer:
    try:
        return _HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{path} is not a valid tokenizer.json ({e}); re-download or regenerate it") from None


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object; fix or remove it")
    return config


def _find_template(root: Path | None, config: dict) -> tuple[str, Path]:
    if root and (root / TEMPLATE_FILE).is_file():
        return (root / TEMPLATE_FILE).read_text(encoding="utf-8"), root / TEMPLATE_FILE
    template = config.get("chat_template")
    if isinstance(template, list):  # HF's named-template form: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template, root / "tokenizer_config.json"
    return (SHIPPED_DIR / TEMPLATE_FILE).read_text(encoding="utf-8"), SHIPPED_DIR / TEMPLATE_FILE


def _token_str(value) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
