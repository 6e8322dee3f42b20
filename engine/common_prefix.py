"""How far two sequences agree: the one common-prefix helper of the engine and the proxy. Torch-free.

The radix tree matches prompts against its edges with it; the proxy's diff, sessions and renderer compare
prompts (token ids) and rendered text with it.
"""
from __future__ import annotations

from array import array
from typing import Sequence


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of a and b (token id lists, tuples or id_array()s, or text).

    Slices are compared block by block, so the work runs at C speed even for 100k-token prompts.
    """
    if type(a) is not type(b):  # a list slice never equals a tuple slice
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i, step = 0, 4096
    while step:
        while i + step <= n and a[i:i + step] == b[i:i + step]:
            i += step
        step //= 8
    return i


def id_array(ids: Sequence[int]) -> array:
    """Token ids as an int32 array.array (ids itself if it is one), made once per prompt (~0.2 ms for 8k ids):
    common_prefix_len of two such arrays compares machine words (~10-20 us for 8k), where a tuple against a
    list is first copied into two lists (~70 us): what a session scan pays for each of the dozens of earlier
    prompts it checks."""
    return ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
