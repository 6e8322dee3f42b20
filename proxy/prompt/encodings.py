"""What the tokenizer remembers and derives so that a render pays only for its new text.

    PieceCache     encodings of the text pieces between added tokens, bounded by bytes
    RecentTexts    the last rendered texts' encodings: a later turn re-sends its history, so the ids of the text
                   it shares with one of them, up to an added token, are taken as they are
    ByteOffsets    character offsets from the ids alone (byte-level BPE): the library's offsets cost a quarter of
                   an 8k-token encode; used only where a load-time probe shows the two agree

Offsets are kept flat: int32 [start, end, start, end, ...] (flat_offsets). Thread-safe: the proxy renders off its
event loop and the engine thread may encode too.
"""
from __future__ import annotations

import bisect
import sys
import threading
from array import array
from collections import OrderedDict
from itertools import chain
from typing import Collection, NamedTuple

import numpy as np

from engine.common_prefix import common_prefix_len

RECENT_TEXTS = 16  # encodings of whole rendered texts remembered (a few per active session is plenty)
RECENT_BYTES = 64 * 2**20  # and at most about this much of them (a 200k-token prompt holds ~10 MB)
RECENT_MIN_CHARS = 1024  # shorter texts are cheap to encode again: not remembered


class PieceCache:
    """Encodings of text pieces, least recently used first out, bounded by the bytes they hold (ids and
    offsets as 32-bit arrays); a piece over an eighth of the budget is never kept. Thread-safe: the proxy
    renders off its event loop and the engine thread may encode too."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[array, np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, piece: str) -> tuple[list[int], np.ndarray] | None:
        with self._lock:
            hit = self._items.get(piece)
            if hit is None:
                return None
            self._items.move_to_end(piece)
        return hit[0].tolist(), hit[1]

    def put(self, piece: str, ids: list[int], flat: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Keep a piece's ids and flat offsets (flat_offsets); -> the same pair, as `get` gives it."""
        packed = array("i", ids)
        size = sys.getsizeof(piece) + packed.itemsize * len(packed) + flat.nbytes
        if size <= self.budget // 8:
            with self._lock:
                if piece not in self._items:
                    self._items[piece] = (packed, flat, size)
                    self.bytes += size
                while self.bytes > self.budget:
                    self.bytes -= self._items.popitem(last=False)[1][2]
        return ids, flat


def flat_offsets(offsets: list[tuple[int, int]], shift: int = 0) -> np.ndarray:
    """A tokenizers encoding's offsets [(start, end), ...] as int32 [start, end, start, end, ...] + shift."""
    flat = np.fromiter(chain.from_iterable(offsets), dtype=np.int32, count=2 * len(offsets))
    if shift:
        flat += shift
    return flat


class Encoded(NamedTuple):
    """A whole text's encoding, as RecentTexts keeps it (nbytes: its size, the ids' int objects counted)."""

    text: str
    literal_at: tuple[int, ...]  # sorted: offsets of special-token strings encoded as plain text
    cuts: list[int]  # offsets of the added tokens the text was cut at, ascending
    ids: list[int]  # a private copy
    flat: np.ndarray
    nbytes: int


class RecentTexts:
    """The encodings of the last RECENT_TEXTS texts (of RECENT_MIN_CHARS or more, RECENT_BYTES in all), most
    recently used last.

    `prefix(text, literal_at, longest)` -> Head: the ids, offsets and added-token offsets of text[:end] taken
    from the remembered text sharing the longest prefix with `text`, cut at the start of an added token. That is exact
    because the tokenizer cuts text at added tokens first and encodes the pieces between them independently;
    the added tokens found up to the cut are the same in both texts when the shared prefix runs at least
    `longest` (the longest added token's length) past the cut, and the special-token strings encoded as plain
    text before it are the same ones."""

    def __init__(self, size: int = RECENT_TEXTS, budget_bytes: int = RECENT_BYTES) -> None:
        self.size, self.budget, self.bytes = size, budget_bytes, 0
        self._items: OrderedDict[int, Encoded] = OrderedDict()  # keyed by id() of the entry
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def prefix(self, text: str, literal_at: Collection[int], longest: int) -> Head:
        if len(text) < RECENT_MIN_CHARS:
            return _nothing()
        with self._lock:
            entries = list(self._items.values())
        best, shared = None, 0
        for entry in entries:
            n = common_prefix_len(entry.text, text)
            if n > shared:
                best, shared = entry, n
        if best is None:
            return _nothing()
        i = bisect.bisect_right(best.cuts, shared - longest) - 1
        literal = sorted(literal_at)
        while i >= 0 and _literal_upto(literal, best.cuts[i]) != _literal_upto(best.literal_at, best.cuts[i]):
            i -= 1
        if i < 0:
            return _nothing()
        cut = best.cuts[i]
        k = int(np.searchsorted(best.flat[0::2], cut))  # tokens that start before the cut
        with self._lock:
            if id(best) in self._items:
                self._items.move_to_end(id(best))
        return Head(best.ids[:k], best.flat[:2 * k], best.cuts[:i], cut)

    def put(self, text: str, literal_at: Collection[int], cuts: list[int], ids: list[int], flat: np.ndarray) -> None:
        if len(text) < RECENT_MIN_CHARS:
            return
        nbytes = sys.getsizeof(text) + 36 * len(ids) + flat.nbytes
        entry = Encoded(text, tuple(sorted(literal_at)), cuts, list(ids), flat, nbytes)
        with self._lock:
            self._items[id(entry)] = entry
            self.bytes += nbytes
            while self._items and (len(self._items) > self.size or self.bytes > self.budget):
                self.bytes -= self._items.popitem(last=False)[1].nbytes


class Head(NamedTuple):
    """The start of a text's encoding: ids (a new list), flat offsets and added-token offsets of text[:end]."""

    ids: list[int]
    flat: np.ndarray
    cuts: list[int]
    end: int


def _nothing() -> Head:
    return Head([], np.empty(0, dtype=np.int32), [], 0)


def _literal_upto(literal: list[int] | tuple[int, ...], cut: int) -> list[int]:
    """The sorted offsets at or before `cut` (a special-token string there is the cut's own token)."""
    return list(literal[:bisect.bisect_right(literal, cut)])


class ByteOffsets:
    """Character offsets of a byte-level BPE's tokens from their ids: each token covers as many bytes of the
    text's UTF-8 as its vocabulary string has characters (an added token: its content's UTF-8), and a token
    that ends inside a character covers all of it, as the library reports."""

    def __init__(self, vocab: dict[str, int], added: Collection[str]) -> None:
        lengths = np.zeros(max(vocab.values(), default=0) + 1, dtype=np.int64)
        for token, i in vocab.items():
            lengths[i] = len(token.encode("utf-8")) if token in added else len(token)
        self.lengths = lengths

    def flat(self, text: str, ids: list[int]) -> np.ndarray:
        if not ids:
            return np.empty(0, dtype=np.int32)
        ends = np.cumsum(self.lengths[np.asarray(ids, dtype=np.intp)])  # [T] byte offsets
        starts = np.empty_like(ends)
        starts[0], starts[1:] = 0, ends[:-1]
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw) != len(text):  # byte offsets -> the character each byte belongs to
            char_of = np.cumsum((np.frombuffer(raw, dtype=np.uint8) & 0xC0) != 0x80) - 1
            starts, ends = char_of[starts], char_of[ends - 1] + 1
        flat = np.empty(2 * len(ids), dtype=np.int32)
        flat[0::2], flat[1::2] = starts, ends
        return flat
