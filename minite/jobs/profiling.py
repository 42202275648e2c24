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

import statistics
import time
from collections import Counter
from collections.abc import Callable
from itertools import pairwise

import torch

PROFILE_COLUMNS = ["arm", "name", "calls", "self_device_ms", "own_device_ms", "device_ms", "self_cpu_ms", "cpu_ms",
                   "sha", "device"]
STEP_COLUMNS = ["arm", "position", "name", "own_us", "duration_us", "steps", "sha", "device"]


def busy_ms(intervals) -> float:
    """Length of the union of (start, end) intervals in microseconds (the time at least one runs), in ms: the
    sum of their own times (``_own_each``)."""
    return sum(e[3] for e in _own_each([(a, b, None) for a, b in intervals])) / 1e3


def _own_each(spans) -> list[tuple]:
    """(start, end, name) spans (us) in start order, each with its own time appended: from its start, or from the
    latest end of the spans that started before it if that is later, to its end (0 if it ends inside them)."""
    out, reach = [], None
    for a, b, name in sorted(spans, key=lambda sp: (sp[0], sp[1])):
        start = a if reach is None else max(a, reach)
        out.append((a, b, name, max(0.0, b - start)))
        reach = b if reach is None else max(reach, b)
    return out


def own_ms(spans) -> dict[str, float]:
    """Per name, in ms, the time its (start, end, name) spans (us) add to the timeline (``_own_each``). The sum
    over names is ``busy_ms`` of the spans."""
    own: dict[str, float] = {}
    for _, _, name, us in _own_each(spans):
        own[name] = own.get(name, 0.0) + us / 1e3
    return own


def step_kernels(spans, marker: str, trim: float = 0.1) -> list[dict] | None:
    """The kernels of a repeated step in launch order, from the (start, end, name) spans (us) of many: a step
    starts at each ``marker`` kernel and ends at the next one; the steps with the most common sequence of
    kernel names are kept, less ``trim`` of them at each end (warm-up, the generate's ending). Per position:
    the kernel's name, its median own time (``_own_each``) and median duration, in us. None without such a
    step."""
    ev = _own_each(spans)
    starts = [i for i, e in enumerate(ev) if e[2] == marker]
    steps = [ev[a:b] for a, b in pairwise(starts)]
    if not steps:
        return None
    names = Counter(tuple(e[2] for e in st) for st in steps).most_common(1)[0][0]
    steps = [st for st in steps if tuple(e[2] for e in st) == names]
    cut = int(len(steps) * trim)
    steps = steps[cut:len(steps) - cut] or steps
    return [{"position": j, "name": name, "own_us": statistics.median(st[j][3] for st in steps),
             "duration_us": statistics.median(st[j][1] - st[j][0] for st in steps), "steps": len(steps)}
            for j, name in enumerate(names)]


def steps_path(path) -> str:
    """Where the per-step kernel table of the profile CSV ``path`` goes: ``<stem>.steps.csv`` beside it."""
    p = str(path)
    return (p[:-4] if p.endswith(".csv") else p) + ".steps.csv"


def write_torch_profile(path, work: Callable[[], object], cuda: bool, meta: dict, top: int = 60,
                        write: bool = True, step_marker: str | None = None) -> dict:
    """Run ``work()`` once under torch.profiler; write the CSV (module docstring) when ``write`` (a distributed
    job's other ranks profile their share and write nothing). ``step_marker``: the first kernel of each step of
    a repeated one (a decode step): on the GPU, its kernels in order (``step_kernels``) go to ``steps_path``,
    and the summary gets their count and own time. Returns the summary."""
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
        table = step_kernels(spans, step_marker) if step_marker else None
        if table:
            summary["step_kernels"] = len(table)
            summary["step_own_us"] = sum(r["own_us"] for r in table)
            if write:
                write_csv(steps_path(path), pd.DataFrame([{**meta, **r} for r in table], columns=STEP_COLUMNS))

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
