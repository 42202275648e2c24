"""What a benchmark measured besides its result: the spread of repeated timings, and GPU telemetry
(nvidia-ml-py: mean power, energy, mean SM clock) while it runs.

    timing_summary([12.1, 11.9, 12.4, ...])   # {"n", "median", "q25", "q75", "min", "max", "spread"}
    SPREAD_LIMIT                              # spread above which a timing is too noisy to compare
    copy_bandwidth(device)                    # the device's copy bandwidth, GB/s: timing_summary of repeats

    with GPUTelemetry(device) as tel:
        ... timed work ...
    tel.summary(tokens=n)   # {"mean_power_w", "energy_j", "energy_per_token_j", "mean_sm_clock_mhz", ...}

A background thread samples power and SM clock every ``interval_s``; energy comes from NVML's total-energy
counter (mJ since driver load) read at start and stop, or from integrating the power samples when the GPU
does not expose that counter. On CPU (or without nvidia-ml-py / NVML) everything is a no-op and the summary
says why in ``note``, so callers never need to branch.
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

#: A timing whose interquartile range exceeds this fraction of its median is too noisy to compare: a ratio
#: against it could be off by that much (the throughput table flags such rows).
SPREAD_LIMIT = 0.10


def timing_summary(samples) -> dict:
    """Median and spread of repeated timings (any unit; the result keeps it): n, median, q25 / q75 (the
    interquartile range, linear interpolation as numpy's default), min, max, and spread = IQR / median."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no timings to summarise")
    med = statistics.median(xs)
    q25, _, q75 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (med, med, med)
    return {"n": len(xs), "median": med, "q25": q25, "q75": q75, "min": xs[0], "max": xs[-1],
            "spread": (q75 - q25) / med if med > 0 else float("nan")}


def copy_bandwidth(device, nbytes: int | None = None, iters: int | None = None, repeats: int = 11) -> dict:
    """GB/s of a device-to-device ``copy_`` (bytes read + written): ``timing_summary`` of ``repeats`` timings,
    each of ``iters`` back-to-back copies of ``nbytes`` after one untimed copy. The rollout roofline's
    denominator: on an H200 single timed 1 GiB copies (~0.5 ms each) moved by ~3-4% from run to run, five back
    to back by ~1-2%. CUDA: 1 GiB, 5 copies a timing (CUDA events); CPU: 64 MiB, 1 (the host clock)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    nbytes = nbytes or (1 << 30 if cuda else 1 << 26)
    iters = iters or (5 if cuda else 1)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                dst.copy_(src)
            e1.record()
            e1.synchronize()
            s = e0.elapsed_time(e1) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            s = time.perf_counter() - t0
        samples.append(2 * nbytes * iters / s / 1e9)
    return timing_summary(samples)


def _handle(pynvml, index: int):
    """NVML numbers GPUs physically; find ours by PCI address so CUDA_VISIBLE_DEVICES is honoured."""
    props = torch.cuda.get_device_properties(index)
    try:
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.upper())
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(index)


class GPUTelemetry:
    def __init__(self, device=None, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.note = None
        self._h = self._nvml = None
        dev = torch.device(device) if device is not None else None
        if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
            self.note = "no GPU telemetry: not running on a CUDA device"
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            self._h = _handle(pynvml, index)
            self._nvml = pynvml
        except Exception as e:  # ImportError, NVMLError: telemetry is optional
            self.note = f"no GPU telemetry: nvidia-ml-py/NVML unavailable ({type(e).__name__}: {e})"
            self._h = None
        self._samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = None

    @property
    def active(self) -> bool:
        return self._h is not None

    def _energy_mj(self):
        try:
            return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._h))
        except Exception:
            return None

    def _run(self):
        n = self._nvml
        while not self._stop.is_set():
            try:
                p = n.nvmlDeviceGetPowerUsage(self._h) / 1000.0
                c = float(n.nvmlDeviceGetClockInfo(self._h, n.NVML_CLOCK_SM))
                self._samples.append((time.perf_counter(), p, c))
            except Exception:
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def start(self):
        self._t0 = time.perf_counter()
        if not self.active:
            return
        self._e0 = self._energy_mj()
        self._samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="minite-telemetry", daemon=True)
        self._thread.start()

    def stop(self):
        self._t1 = time.perf_counter()
        if not self.active or self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._e1 = self._energy_mj()

    def summary(self, tokens: int | None = None) -> dict:
        out = {"mean_power_w": None, "energy_j": None, "energy_per_token_j": None, "mean_sm_clock_mhz": None,
               "samples": 0, "duration_s": getattr(self, "_t1", 0.0) - getattr(self, "_t0", 0.0),
               "note": self.note}
        if not self.active or not self._samples:
            if self.active:
                out["note"] = "no telemetry samples (run shorter than the sampling interval?)"
            return out
        powers = [s[1] for s in self._samples]
        out["samples"] = len(powers)
        out["mean_power_w"] = sum(powers) / len(powers)
        out["mean_sm_clock_mhz"] = sum(s[2] for s in self._samples) / len(self._samples)
        if self._e0 is not None and self._e1 is not None and self._e1 >= self._e0:
            out["energy_j"] = (self._e1 - self._e0) / 1000.0
            out["energy_source"] = "nvml total energy counter"
        else:
            out["energy_j"] = out["mean_power_w"] * out["duration_s"]
            out["energy_source"] = "mean sampled power x duration"
        if tokens:
            out["energy_per_token_j"] = out["energy_j"] / tokens
        return out
