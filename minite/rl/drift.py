"""Drift alarm and reward-collapse detector for long RL runs (all state is a plain dict: checkpointable).

Drift alarm — one-sided CUSUM (Page 1954) on the log of the per-step mismatch (k3 by default):

    x_t   = log(max(k3_t, floor))
    warm-up (first ``warmup`` steps): collect x; baseline mu0 = median, sigma0 = max(1.4826 * MAD, sigma_floor)
    z_t   = (x_t - mu0) / sigma0
    slack = kappa + 2 * 1.2533 / sqrt(warmup)    (kappa, plus two standard errors of the baseline median)
    S_t   = max(0, S_{t-1} + z_t - slack)        (shifts smaller than the slack, in sigmas, are ignored)
    alarm at the first t with S_t > h

Why log and a robust baseline: k3 is a mean of positive per-token terms whose scale spans decades between
arms; in log space the step-to-step noise is roughly symmetric, and median/MAD ignore a single bad warm-up
batch. The textbook design (kappa = 0.5, h = 5) assumes a known baseline; estimated from a short warm-up it
false-alarms often (simulated: ~1 in 3 stationary 500-step series with warmup 20), hence the defaults
kappa = 1, h = 8, warmup = 20 and the baseline-error term in the slack: on Gaussian log-noise the simulated
false-alarm rate is ~3% per 500 stationary steps at warmup 20 (<1% at warmup 30), and a trend of
+0.05/step in log k3 (k3 x e every 20 steps) is caught 5-35 steps after it starts (tests/test_rl_drift.py).
A single spike of height < h + slack sigmas does not fire. The floor keeps exact-zero mismatch finite.

Further metrics (``DriftWatch``, the RL config's ``metrics.watch``: metric -> log floor): the same CUSUM, with
the ``drift`` section's warm-up / kappa / h / sigma_floor, runs on each named per-step metric (e.g. grad_norm,
max_abs_dlogp, router_disagree, response_len_mean), each with its own floor: a metric that is often exactly 0
(router_disagree on short batches) needs a floor at its resolution, or its first non-zero value would read as
a shift of many decades. Steps where a metric was not measured are skipped.

Reward collapse: EWMA of the per-step reward (``alpha``), its running peak after warm-up; collapse at the
first step where the peak is at least ``min_peak`` and the EWMA has fallen below ``frac`` x peak.
``lead = collapse_step - alarm_step`` (positive: the alarm fired that many steps before the collapse).
"""
from __future__ import annotations

import math
import statistics


class DriftAlarm:
    def __init__(self, warmup: int = 20, kappa: float = 1.0, h: float = 8.0, floor: float = 1e-12,
                 sigma_floor: float = 0.05):
        if warmup < 3:
            raise ValueError(f"drift alarm warmup must be >= 3 steps, got {warmup}")
        self.warmup, self.kappa, self.h = int(warmup), float(kappa), float(h)
        self.floor, self.sigma_floor = float(floor), float(sigma_floor)
        self.baseline: list[float] = []
        self.mu0 = self.sigma0 = None
        self.S = 0.0
        self.alarm_step: int | None = None

    def update(self, step: int, value: float) -> dict:
        """Feed one step's mismatch value; returns the alarm's per-step record (for the JSONL)."""
        if value is None or not math.isfinite(value):
            raise ValueError(f"drift alarm got a non-finite mismatch value at step {step}: {value!r}")
        x = math.log(max(value, self.floor))
        z = None
        if self.mu0 is None:
            self.baseline.append(x)
            if len(self.baseline) == self.warmup:
                self.mu0 = statistics.median(self.baseline)
                mad = statistics.median(abs(b - self.mu0) for b in self.baseline)
                self.sigma0 = max(1.4826 * mad, self.sigma_floor)
        else:
            z = (x - self.mu0) / self.sigma0
            self.S = max(0.0, self.S + z - self.slack)
            if self.alarm_step is None and self.S > self.h:
                self.alarm_step = int(step)
        return {"log_mismatch": x, "z": z, "cusum": self.S, "alarm": self.alarm_step is not None}

    @property
    def slack(self) -> float:
        return self.kappa + 2 * 1.2533 / math.sqrt(self.warmup)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("warmup", "kappa", "h", "floor", "sigma_floor", "baseline",
                                               "mu0", "sigma0", "S", "alarm_step")}

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, list(v) if k == "baseline" else v)


class DriftWatch:
    """One ``DriftAlarm`` per watched metric (module docstring); plain-dict state for checkpoints."""

    def __init__(self, watch: dict[str, float], warmup: int = 20, kappa: float = 1.0, h: float = 8.0,
                 floor: float = 1e-12, sigma_floor: float = 0.05):
        del floor                                   # each metric brings its own
        self.alarms = {m: DriftAlarm(warmup, kappa, h, float(f), sigma_floor) for m, f in (watch or {}).items()}

    def update(self, step: int, record: dict) -> dict:
        """Feed the watched metrics of one step's record; returns {"watch": {metric: {"cusum", "alarm"}}}."""
        out = {}
        for metric, alarm in self.alarms.items():
            value = record.get(metric)
            if value is not None:
                r = alarm.update(step, float(value))
                out[metric] = {"cusum": r["cusum"], "alarm": r["alarm"]}
        return {"watch": out} if out else {}

    def alarm_steps(self) -> dict[str, int | None]:
        return {m: a.alarm_step for m, a in self.alarms.items()}

    def state_dict(self) -> dict:
        return {m: a.state_dict() for m, a in self.alarms.items()}

    def load_state_dict(self, d: dict) -> None:
        """Restore the metrics a checkpoint holds (one from before a metric was watched starts it afresh)."""
        for m, state in (d or {}).items():
            if m in self.alarms:
                self.alarms[m].load_state_dict(state)


class CollapseDetector:
    def __init__(self, alpha: float = 0.1, frac: float = 0.5, min_peak: float = 0.05, warmup: int = 10):
        if not 0 < alpha <= 1 or not 0 < frac < 1:
            raise ValueError(f"collapse detector needs 0 < alpha <= 1 and 0 < frac < 1 (got {alpha}, {frac})")
        self.alpha, self.frac, self.min_peak, self.warmup = float(alpha), float(frac), float(min_peak), int(warmup)
        self.ewma: float | None = None
        self.peak = 0.0
        self.n = 0
        self.collapse_step: int | None = None

    def update(self, step: int, reward: float) -> dict:
        self.n += 1
        self.ewma = reward if self.ewma is None else self.alpha * reward + (1 - self.alpha) * self.ewma
        if self.n >= self.warmup:
            self.peak = max(self.peak, self.ewma)
            if (self.collapse_step is None and self.peak >= self.min_peak
                    and self.ewma < self.frac * self.peak):
                self.collapse_step = int(step)
        return {"reward_ewma": self.ewma, "reward_peak": self.peak, "collapsed": self.collapse_step is not None}

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("alpha", "frac", "min_peak", "warmup", "ewma", "peak", "n",
                                               "collapse_step")}

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)


def lead_steps(alarm_step: int | None, collapse_step: int | None) -> int | None:
    """Steps by which the alarm preceded the collapse (None unless both happened)."""
    if alarm_step is None or collapse_step is None:
        return None
    return collapse_step - alarm_step
