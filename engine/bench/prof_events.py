"""What a torch.profiler run says about the device and the engine thread (profile_decode.py): each stream's busy
time, the compute stream's idle gaps with the host's ops inside them, device work by kernel, host ops by self time.
They read prof.events() or prof.key_averages() alone (union_us a list of spans), so a test hands them its own."""
from __future__ import annotations

from collections import defaultdict

import torch

GAP_US = 100  # compute-stream gaps shorter than this are launch spacing, not the host holding the device up


def compute_gaps(prof) -> dict:
    """The stream with the most kernel time ("compute"; not copies: an extend's copy stream is busier): its busy
    time, and its gaps of GAP_US or more between consecutive kernels or copies in time order, each with the
    top-level torch ops (clipped to the gap) of the thread with the most of them (the engine thread); and each
    stream's busy time, copies included ("streams")."""
    dev, kernel_us, cpu = defaultdict(list), defaultdict(float), defaultdict(list)
    for ev in prof.events():
        if ev.time_range is None:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            dev[ev.device_resource_id].append(span)
            if not ev.name.lower().startswith(("memcpy", "memset")):
                kernel_us[ev.device_resource_id] += span[1] - span[0]
        elif ev.cpu_parent is None:
            cpu[ev.thread].append((*span, ev.name))
    if not dev:
        return {"busy_ms": 0.0, "span_ms": 0.0, "idle_ms": 0.0, "gaps": [], "streams": {}}
    stream = max(dev, key=lambda s: kernel_us.get(s, 0.0))
    spans = sorted(dev[stream])
    thread = max(cpu, key=lambda t: len(cpu[t])) if cpu else None
    ops = sorted(cpu.get(thread, []))
    origin = spans[0][0]
    gaps, reach = [], spans[0][1]
    for a, b in spans[1:]:
        if a - reach >= GAP_US:
            inside = defaultdict(float)
            for oa, ob, name in ops:
                if ob > reach and oa < a:
                    inside[name] += min(ob, a) - max(oa, reach)
            covered = sum(inside.values())
            inside["(no torch op: Python)"] = max(0.0, (a - reach) - covered)
            gaps.append({"start_ms": (reach - origin) / 1e3, "ms": (a - reach) / 1e3,
                         "ops": sorted(((n, us / 1e3) for n, us in inside.items()), key=lambda r: -r[1])})
        reach = max(reach, b)
    busy = union_us(spans)
    return {"stream": stream, "busy_ms": busy / 1e3, "span_ms": (reach - origin) / 1e3,
            "idle_ms": sum(x["ms"] for x in gaps), "gaps": gaps,
            "streams": {str(s): union_us(v) / 1e3 for s, v in dev.items()}}


def copy_timeline(prof) -> dict | None:
    """The copy stream's place in the profiled work (the stream with the most host-to-device copy time): when its
    first copy began and its last one ended, in ms from the first device work of any stream and before the last
    one's end, and its idle gaps of GAP_US or more between them (the longest first). An extend's copies ahead wait
    for slots the layers before free, so this says how long the copy engine, one of the two paths a hybrid extend
    is bound by, sat out its start, its middle and its end. None when the profile holds no such copy."""
    spans, everything = defaultdict(list), []
    for ev in prof.events():
        if ev.time_range is None or ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        everything.append(span)
        if ev.name.lower().startswith("memcpy htod"):
            spans[ev.device_resource_id].append(span)
    if not spans:
        return None
    stream = max(spans, key=lambda s: union_us(spans[s]))
    copies = sorted(spans[stream])
    origin, end = min(a for a, _ in everything), max(b for _, b in everything)
    gaps, reach = [], copies[0][1]
    for a, b in copies[1:]:
        if a - reach >= GAP_US:
            gaps.append(((reach - origin) / 1e3, (a - reach) / 1e3))
        reach = max(reach, b)
    return {"stream": stream, "first_ms": (copies[0][0] - origin) / 1e3, "ends_before_ms": (end - reach) / 1e3,
            "span_ms": (end - origin) / 1e3, "busy_ms": union_us(copies) / 1e3, "idle_ms": sum(ms for _, ms in gaps),
            "gaps": sorted(gaps, key=lambda g: -g[1])}


def device_work_by_kernel(prof, top: int = 20) -> list[tuple[str, int, float]]:
    """A profile's device work by kernel name, copies included: (name, calls, ms), most time first. A CPU job
    joined on the device shows as the kernel that waits for its flag (mailbox_triton.py), busy while the device
    waits."""
    calls, us = defaultdict(int), defaultdict(float)
    for ev in prof.events():
        if ev.time_range is not None and ev.device_type == torch.autograd.DeviceType.CUDA:
            calls[ev.name] += 1
            us[ev.name] += ev.time_range.end - ev.time_range.start
    return [(name, calls[name], us[name] / 1e3) for name in sorted(us, key=lambda n: -us[n])[:top]]


def union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans (microseconds): the time a stream kind was busy at all."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def host_ops(prof) -> list[tuple[str, int, float]]:
    """(torch op, calls, self CPU microseconds) of a profile's host side, the costliest first."""
    return sorted(((e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CPU), key=lambda r: -r[2])
