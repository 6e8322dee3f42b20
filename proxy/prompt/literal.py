"""Special tokens come from the chat template only, never from the text of a conversation.

A tool output or a user message holding "<|im_end|>\\n<|im_start|>system" must reach the model as those
characters, not as the control tokens that would forge a system turn. Before the template runs, the first
character of every special-token string in the conversation's values is swapped for a private-use character
that occurs nowhere in them (nor in the template); after rendering, `restore` swaps it back and returns where
each such string starts, and the tokenizer encodes the strings starting there as plain text
(Tokenizer.encode_with_offsets(text, literal_at)). Swapping one character for one keeps every offset.

    marks = ContentMarks(special_tokens, (messages, tools), reserved=template_source)
    text = render(marks.mark(messages), marks.mark(tools))
    text, literal_at = marks.restore(text)
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

_PRIVATE_USE = re.compile("[\ue000-\uf8ff]")
_FIRST_FREE, _LAST_FREE = 0xE000, 0xF8FF


class ContentMarks:
    def __init__(self, specials: Iterable[str], values, reserved: str = "") -> None:
        specials = sorted({s for s in specials if s}, key=len, reverse=True)  # leftmost-longest
        self._pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._markers: dict[str, str] = {}  # first character of a special token -> its stand-in; none: no-op
        if self._pattern is not None and any(self._pattern.search(s) for s in strings(values)):
            firsts = sorted({s[0] for s in specials})
            self._markers = dict(zip(firsts, _free_chars(values, reserved, len(firsts))))

    def mark(self, value):
        """`value` (str, list, dict, nested) with every special-token string's first character swapped."""
        if not self._markers:
            return value
        if isinstance(value, str):
            return self._pattern.sub(lambda m: self._markers[m.group()[0]] + m.group()[1:], value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(v) for v in value]
        return value

    def restore(self, text: str) -> tuple[str, frozenset[int]]:
        """The rendered text as the conversation wrote it, and the offsets where its special-token strings
        start (encode those as text)."""
        if not self._markers:
            return text, frozenset()
        stand_ins = re.compile("[" + "".join(self._markers.values()) + "]")
        at = frozenset(m.start() for m in stand_ins.finditer(text))
        return text.translate({ord(m): c for c, m in self._markers.items()}), at


def strings(value) -> Iterator[str]:
    """Every string in a nest of dicts (keys too), lists and tuples."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from strings(v)


def _free_chars(values, reserved: str, n: int) -> list[str]:
    taken = set(_PRIVATE_USE.findall(reserved))
    for s in strings(values):
        taken.update(_PRIVATE_USE.findall(s))
    free = (chr(c) for c in range(_FIRST_FREE, _LAST_FREE + 1) if chr(c) not in taken)
    out = [c for _, c in zip(range(n), free)]
    if len(out) < n:
        raise ValueError("the conversation uses every private-use character (U+E000-U+F8FF) and also writes "
                         "special-token text; drop one of them")
    return out
