"""``--torch-profile CSV``: one more unit of a benchmark's work (bench-learner: an update; bench-sampler: a
generate, CUDA graphs as timed) under torch.profiler, after the timed runs, so the timings stay unprofiled.

The CSV holds the ``top`` ops by self device time (self CPU time on CPU) in long format, plus every
``minite.*`` range (their device_ms: the GPU time of the kernels launched inside). Kernels replayed from CUDA
graphs appear under their own names. A kernel launched with programmatic dependent launch starts while the one
before it still runs and waits inside, so its self device time counts that wait too; ``own_device_ms`` is the
time it adds to the device's timeline (``own_ms``), and those add up to the busy time below. The summary
returned (and stored in the job's JSON) gives the profiled work's wall time and, on the GPU, the time the GPU
was busy (the union of its kernels' intervals, so overlapping kernels count once) and the number of kernels:
wall minus busy is time the GPU waited for the host or between launches (which the profiler itself widens:
read gaps from unprofiled timings)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

PROFILE_COLUMNS = ["arm", "name", "calls", "self_device_ms", "own_device_ms", "device_ms", "self_cpu_ms", "cpu_ms",
                   "sha", "device"]


def busy_ms(intervals) -> float:
    """Length of the union of (start, end) intervals in microseconds (the time at least one runs), in ms."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total / 1e3


def own_ms(spans) -> dict[str, float]:
    """Per name, in ms, the time its (start, end, name) spans (us) add to the timeline: each from its start, or
    from the latest end of the spans that started before it if that is later, to its end (nothing if it ends
    inside them). The sum over names is ``busy_ms`` of the spans."""
    own: dict[str, float] = {}
    reach = None
    for a, b, name in sorted(spans, key=lambda sp: (sp[0], sp[1])):
        start = a if reach is None else max(a, reach)
        own[name] = own.get(name, 0.0) + max(0.0, b - start) / 1e3
        reach = b if reach is None else max(reach, b)
    return own


def write_torch_profile(path, work: Callable[[], object], cuda: bool, meta: dict, top: int = 60,
                        write: bool = True) -> dict:
    """Run ``work()`` once under torch.profiler; write the CSV (module docstring) when ``write`` (a distributed
    job's other ranks profile their share and write nothing). Returns the summary."""
    import pandas as pd
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from minite.provenance import write_csv

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        work()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    summary = {"wall_ms": wall_ms}
    own = {}
    if cuda:
        spans = [(ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                 if ev.device_type == DeviceType.CUDA]
        summary["gpu_busy_ms"] = busy_ms([sp[:2] for sp in spans])
        summary["gpu_kernels"] = len(spans)
        own = own_ms(spans)

    def ms(ev, name):  # torch renamed cuda_* -> device_* (2.4); read whichever exists
        v = getattr(ev, name, None)
        if v is None:
            v = getattr(ev, name.replace("device", "cuda"), 0.0)
        return float(v or 0.0) / 1e3

    rows = [{**meta, "name": ev.key, "calls": ev.count, "self_device_ms": ms(ev, "self_device_time_total"),
             "own_device_ms": own.get(ev.key, 0.0), "device_ms": ms(ev, "device_time_total"),
             "self_cpu_ms": ev.self_cpu_time_total / 1e3,
             "cpu_ms": ev.cpu_time_total / 1e3} for ev in prof.key_averages()]
    df = pd.DataFrame(rows, columns=PROFILE_COLUMNS)
    order = "self_device_ms" if cuda else "self_cpu_ms"
    ranges = df[df["name"].str.startswith("minite.")]
    df = pd.concat([ranges, df.drop(ranges.index).sort_values(order, ascending=False).head(top)])
    if write:
        write_csv(path, df)
    return summary
