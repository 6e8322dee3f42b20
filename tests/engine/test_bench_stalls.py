"""engine/bench/stalls.py: where a thread sat still, from its sampled stack, and the collector's pauses."""
from __future__ import annotations

import gc
import threading
import time

import pytest

from engine.bench.stalls import Stall, Stalls, stall_runs


def _sleeper(seconds: float) -> None:
    time.sleep(seconds)  # one native call: the stack stands still


def test_a_thread_waiting_in_one_call_shows_as_a_stall_at_that_line_and_a_collection_is_timed():
    with Stalls(threading.get_ident(), every_s=0.0005) as st:
        sum(range(20000))  # Python running: no stall of 30 ms here
        _sleeper(0.06)
        gc.collect()
    found = st.stalls(min_s=0.03)
    assert found and "_sleeper" in found[0].where[0] and "time.sleep" not in found[0].where[0]
    assert found[0].where[1].endswith("test_a_thread_waiting_in_one_call_shows_as_a_stall_at_that_line_and_a_"
                                      "collection_is_timed")
    assert 0.03 <= found[0].seconds <= 0.5
    assert any(c.generation == 2 and c.seconds >= 0 for c in st.collections)
    assert st._on_gc not in gc.callbacks  # taken out on exit


def test_runs_of_one_stack_are_cut_where_it_changes_and_short_ones_dropped():
    a, b = ("x.py:1 f",), ("y.py:2 g",)
    samples = [(0.000, a), (0.001, a), (0.004, a), (0.005, b), (0.006, a), (0.007, ()), (0.020, ())]
    assert stall_runs(samples, 0.002) == [Stall(0.000, 0.004, a)]  # an empty stack (thread gone) is no stall
    assert stall_runs(samples, 0.0) == [Stall(0.0, 0.004, a), Stall(0.005, 0.0, b), Stall(0.006, 0.0, a)]


def test_a_period_of_zero_is_refused():
    with pytest.raises(ValueError, match="every_s"):
        Stalls(threading.get_ident(), every_s=0)
