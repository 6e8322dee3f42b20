"""The one common-prefix helper (radix tree edges, the proxy's diff, sessions and renderer)."""
from hypothesis import given, settings
from hypothesis import strategies as st

import random

from engine.common_prefix import common_prefix_len, id_array


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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=40), st.lists(st.integers(0, 2), max_size=40))
def test_common_prefix_of_id_arrays_equals_that_of_the_sequences(a, b):
    assert common_prefix_len(id_array(a), id_array(tuple(b))) == common_prefix_len(a, b)


def test_common_prefix_of_long_id_arrays():
    """Prompts as sessions hold them: long, sharing a long template prefix, large ids."""
    rng = random.Random()
    shared = [rng.randrange(200_000) for _ in range(rng.randrange(5000, 9000))]
    for tail in range(20):
        a = shared + [rng.randrange(200_000) for _ in range(rng.randrange(0, 300))]
        b = shared[:len(shared) - tail] + [rng.randrange(200_000) for _ in range(rng.randrange(0, 300))]
        assert common_prefix_len(id_array(tuple(a)), id_array(b)) == common_prefix_len(a, b)
