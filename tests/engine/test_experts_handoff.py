"""HandoffClock: the CPU's idle time per routed prompt layer call, from the device's gaps and the host's time."""
import random

import pytest

from engine.experts.handoff import HANDOFF_ALPHA, HandoffClock


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

    def event(self):
        return FakeEvent(self, self.queued)


def test_gaps_between_consecutive_moe_layers_count_with_the_hosts_time():
    dev = FakeDevice()
    clock = HandoffClock(dev.event)
    clock.begin()
    rng = random.Random()
    want = 0.0
    for row in range(6):
        gap = rng.uniform(0.001, 0.004)
        if row:
            dev.queued += gap  # the attention and the router between the MoE layers
        clock.enter(row)
        dev.now = dev.queued  # the routing's read-back waited for everything before the layer's experts
        dev.queued += 0.010  # the layer's experts
        clock.read_gaps()
        host = rng.uniform(0.0005, 0.001)
        clock.observe(host)
        sample = host + (gap if row else 0.0)
        w = max(HANDOFF_ALPHA, 1.0 / (row + 1))
        want = (1 - w) * want + w * sample
        assert clock.seconds == pytest.approx(want)
        clock.exit(row)


def test_no_gap_across_a_skipped_layer_a_new_forward_or_without_events():
    dev = FakeDevice()
    clock = HandoffClock(dev.event)
    clock.begin()
    clock.enter(0)
    clock.exit(0)
    dev.queued = dev.now = 0.5
    clock.enter(2)  # row 1 ran without this clock (wholly resident): its device time is not CPU idle time
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
    clock = HandoffClock(dev.event)
    clock.enter(0)
    clock.exit(0)
    dev.queued = 0.003
    clock.enter(1)
    clock.read_gaps()  # the device has not reached the gap's end yet
    clock.observe(0.0)
    assert clock.seconds == 0.0
    dev.now = 1.0
    clock.read_gaps()
    clock.observe(0.0)
    assert clock.seconds == pytest.approx((1 - 0.5) * 0.0 + 0.5 * 0.003)  # second sample: weight 1/2
