"""The one common-prefix helper (radix tree edges, the proxy's diff, sessions and renderer)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.common_prefix import common_prefix_len


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_common_prefix_len_of_text_and_of_mixed_sequences():
    assert common_prefix_len("<think>\n", "<think>\n\n") == 8
    assert common_prefix_len("abc" * 3000 + "x", "abc" * 3000 + "y") == 9000
    assert common_prefix_len((1, 2, 3), [1, 2, 5]) == 2  # a tuple against a list compares values


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=40), st.lists(st.integers(0, 2), max_size=40))
def test_common_prefix_len_matches_the_definition(a, b):
    n = common_prefix_len(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]
