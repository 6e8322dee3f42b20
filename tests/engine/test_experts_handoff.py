"""HandoffClock: the CPU's idle time per routed prompt layer call, from the device's gaps and the host's time."""
import random
from statistics import median

import pytest

from engine.experts.handoff import HANDOFF_WINDOW, HOST_STALL_S, HandoffClock


class FakeEvent:
    """A device event at time t (seconds), done once the fake device's clock has passed it."""

    def __init__(self, device, t):
        self.device, self.t = device, t

    def query(self):
        return self.device.now >= self.t

    def elapsed_time(self, later):  # ms, as torch.cuda.Event
        return (later.t - self.t) * 1e3


class FakeDevice:
    def __init__(self):
        self.now, self.queued = 0.0, 0.0  # the device's clock; where its queued work ends
        self.host = 0.0  # the host's clock: still unless a test moves it (a loaded machine's pauses are no stalls)

    def event(self):
        return FakeEvent(self, self.queued)

    def host_now(self):
        return self.host


def test_gaps_between_consecutive_moe_layers_count_with_the_hosts_time():
    """The estimate: the median of the last HANDOFF_WINDOW device gaps plus that of the last host times."""
    dev = FakeDevice()
    clock = HandoffClock(dev.event, dev.host_now)
    clock.begin()
    rng = random.Random()
    gaps, hosts = [], []
    for row in range(3 * HANDOFF_WINDOW):
        gap = rng.uniform(0.001, 0.004)
        if row:
            dev.queued += gap  # the attention and the router between the MoE layers
            gaps.append(gap)
        clock.enter(row)
        dev.now = dev.queued  # the routing's read-back waited for everything before the layer's experts
        dev.queued += 0.010  # the layer's experts
        clock.read_gaps()
        hosts.append(rng.uniform(0.0005, 0.001))
        clock.observe(hosts[-1])
        want = median(hosts[-HANDOFF_WINDOW:]) + (median(gaps[-HANDOFF_WINDOW:]) if gaps else 0.0)
        assert clock.seconds == pytest.approx(want)
        clock.exit(row)


def test_one_long_gap_moves_nothing_and_a_first_one_goes_with_the_next_two():
    """A kernel compiled or a graph captured between two MoE layers makes one gap hundreds of times the others:
    later, the median leaves it out; first, it goes once the shorter gaps are the samples' majority."""
    for first in (True, False):
        dev = FakeDevice()
        clock = HandoffClock(dev.event, dev.host_now)
        clock.begin()
        for row in range(2 * HANDOFF_WINDOW):
            long = row == (1 if first else HANDOFF_WINDOW)
            dev.queued += 0.325 if long else 0.002
            clock.enter(row)
            dev.now = dev.queued
            clock.read_gaps()
            clock.exit(row)
            if row >= (3 if first else 1):
                assert clock.seconds == pytest.approx(0.002)
        assert clock.seconds == pytest.approx(0.002)


def test_no_gap_across_a_skipped_layer_a_new_forward_or_without_events():
    dev = FakeDevice()
    clock = HandoffClock(dev.event, dev.host_now)
    clock.begin()
    clock.enter(0)
    clock.exit(0)
    dev.queued = dev.now = 0.5
    clock.enter(2)  # row 1 ran without this clock: the device time across it is not one gap
    clock.exit(2)
    clock.begin()  # the next forward's first layer
    clock.enter(3)
    clock.read_gaps()
    clock.observe(0.001)
    assert clock.seconds == pytest.approx(0.001)
    cpu = HandoffClock(None)  # a CPU device: the host's time alone
    cpu.enter(0), cpu.exit(0), cpu.enter(1), cpu.read_gaps(), cpu.observe(-1.0)
    assert cpu.seconds == 0.0


def test_a_gap_still_running_is_read_once_done():
    dev = FakeDevice()
    clock = HandoffClock(dev.event, dev.host_now)
    clock.enter(0)
    clock.exit(0)
    dev.queued = 0.003
    clock.enter(1)
    clock.read_gaps()  # the device has not reached the gap's end yet
    clock.observe(0.0)
    assert clock.seconds == 0.0
    dev.now = 1.0
    clock.read_gaps()
    assert clock.seconds == pytest.approx(0.003)
    clock.observe(0.0)
    assert clock.seconds == pytest.approx(0.003)


def test_a_gap_the_host_held_up_is_left_out():
    """Where the host took longer than HOST_STALL_S between two MoE layer calls (kernels compiled or captured in a
    forward's first run at a size), the device waited for it: that gap is no sample, the others are."""
    dev = FakeDevice()
    clock = HandoffClock(dev.event, dev.host_now)
    clock.begin()
    for row in range(HANDOFF_WINDOW):
        stalled = row % 2 == 1
        dev.host += 2 * HOST_STALL_S if stalled else HOST_STALL_S / 10
        dev.queued += 0.030 if stalled else 0.001
        clock.enter(row)
        dev.now = dev.queued
        clock.read_gaps()
        clock.exit(row)
    assert clock.seconds == pytest.approx(0.001)  # four gaps of 1 ms; with the stalled four the median were 15.5
