"""The tokenizer's shortcuts (proxy/prompt/encodings.py) against encoding everything again.

A long-lived renderer takes ids from earlier renders (RecentTexts), pieces from its PieceCache and offsets from
the ids (ByteOffsets); the reference renderer's tokenizer keeps nothing and takes the library's offsets. Their
renders of the same turns, over several interleaved sessions that append, replace the tail, drop reasoning and
change the system prompt, must agree token for token.
"""
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from proxy.conversation import Conversation, Message, TextPart, ThinkingPart, ToolCallPart, ToolResultPart
from proxy.prompt.encodings import PieceCache, RecentTexts
from proxy.prompt.render import ChatRenderer
from proxy.prompt.tokenizer import SHIPPED_DIR, load_tokenizer

_FAST = load_tokenizer(None)
_REF = load_tokenizer(None)
_REF._recent, _REF._pieces, _REF.byte_offsets = RecentTexts(size=0), PieceCache(0), None
_LIBRARY = HFTokenizer.from_file(str(SHIPPED_DIR / "tokenizer.json"))

WORDS = st.sampled_from([" the", " engine", "  ", "\n", "\n\n", "\t", " 42", ".", " é", "中文", " it's", "🙂",
                         "<|im_end|>", "<think>", "</tool_call>", "<|im_start|>user", " x_y", "def f():\n    "])
TEXT = st.lists(st.one_of(WORDS, st.text(max_size=6)), max_size=40).map("".join)
# long enough for RecentTexts to keep (RECENT_MIN_CHARS)
LONG = st.builds(lambda words, text: "".join(words) * 150 + text, st.lists(WORDS, min_size=4, max_size=12), TEXT)


def assistant(draw) -> Message:
    parts = [ThinkingPart(draw(TEXT)), TextPart(draw(TEXT))]
    if draw(st.booleans()):
        parts.append(ToolCallPart("bash", '{"cmd": "ls"}', "c1"))
    return Message("assistant", tuple(parts))


def next_turn(draw, messages: list[Message]) -> list[Message]:
    """The next request of a session: mostly a reply and a new message, sometimes an edit further back."""
    edit = draw(st.sampled_from(["append", "append", "tool", "tail", "strip_thinking", "system"]))
    if edit == "tail":
        return messages[:-1] + [Message("user", (TextPart(draw(TEXT)),))]
    if edit == "strip_thinking":
        return [Message(m.role, tuple(p for p in m.parts if not isinstance(p, ThinkingPart)))
                if m.role == "assistant" else m for m in messages]
    if edit == "system":
        return [Message("system", (TextPart(draw(TEXT)),))] + messages[1:]
    new = Message("tool", (ToolResultPart(draw(TEXT), "c1"),)) if edit == "tool" else Message(
        "user", (TextPart(draw(TEXT)),))
    return messages + [assistant(draw), new]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_renders_with_every_shortcut_equal_encoding_everything_again(data):
    fast, ref = ChatRenderer(_FAST), ChatRenderer(_REF)
    sessions = [[Message("system", (TextPart(data.draw(TEXT)),)), Message("user", (TextPart(data.draw(LONG)),))]
                for _ in range(3)]
    for _ in range(12):
        s = data.draw(st.integers(0, len(sessions) - 1))
        conv = Conversation(tuple(sessions[s]), enable_thinking=data.draw(st.booleans()))
        got, want = fast.render(conv), ref.render(conv)
        assert (got.ids, got.token_starts, got.segments) == (want.ids, want.token_starts, want.segments)
        sessions[s] = next_turn(data.draw, sessions[s])


@settings(max_examples=40, deadline=None)
@given(head=LONG, tail=TEXT, edit=TEXT)
def test_texts_sharing_a_prefix_encode_as_the_library_does(head, tail, edit):
    """Special-token strings here are the tokens they name: the library encodes the whole text alike."""
    for text in (head + tail, head + edit, head[:len(head) // 2] + edit + tail, head + tail + edit):
        ids, offsets = _FAST.encode_with_offsets(text)
        want = _LIBRARY.encode(text, add_special_tokens=False)
        assert (ids, offsets) == (want.ids, want.offsets)


def test_a_later_turn_encodes_only_its_new_text():
    tok = load_tokenizer(None)
    first = "<|im_start|>user\n" + "many words of a long pasted file, " * 200 + "<|im_end|>\n<|im_start|>assistant\n"
    tok.encode(first)
    encoded = []
    real = tok._plain.encode_batch_fast
    tok._plain = type("Spy", (), {"encode_batch_fast": lambda self, texts, **kw: (
        encoded.extend(texts), real(texts, **kw))[1]})()
    later = first + "Done.<|im_end|>\n<|im_start|>user\nand now the tests<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(later) == _LIBRARY.encode(later, add_special_tokens=False).ids
    assert 0 < sum(map(len, encoded)) <= len(later) - len(first) + len("assistant\n")


def test_recent_texts_are_bounded_in_count_and_bytes():
    recent = RecentTexts(size=4, budget_bytes=200_000)
    for n in range(10):
        text = f"{n} " * 2000
        recent.put(text, (), [], *_FAST._encode(text, ()))  # ~90 kB each: the bytes bind before the count
        assert len(recent) <= 4 and recent.bytes <= recent.budget
    assert recent.prefix("9 " * 2000, (), 16).end == 0  # no added token to cut at: nothing taken
