"""Drift alarm (CUSUM on log k3) and reward-collapse detector on synthetic series."""
import math
import random

import pytest

from minite.rl.drift import CollapseDetector, DriftAlarm, lead_steps


def _series(n, trend_from=None, slope=0.0, seed=0, sigma=0.3, base=1e-4):
    rng = random.Random(seed)
    out = []
    for t in range(1, n + 1):
        x = math.log(base) + rng.gauss(0.0, sigma)
        if trend_from is not None and t > trend_from:
            x += slope * (t - trend_from)
        out.append(math.exp(x))
    return out


def _run(series, **kw):
    a = DriftAlarm(**kw)
    for t, v in enumerate(series, 1):
        a.update(t, v)
    return a


@pytest.mark.parametrize("seed", range(10))
def test_no_alarm_on_stationary_noise(seed):
    assert _run(_series(500, seed=seed), warmup=30).alarm_step is None


def test_single_spike_does_not_fire_but_a_sustained_shift_does():
    s = _series(200, seed=1)
    a = _run(s[:100], warmup=30)
    assert a.alarm_step is None and a.S < 1.0
    height = 0.8 * a.h * a.sigma0               # one bad batch, 6.4 baseline sigmas
    spiked = list(s)
    spiked[100] *= math.exp(height)
    assert _run(spiked, warmup=30).alarm_step is None
    shifted = s[:100] + [v * math.exp(height) for v in s[100:]]
    assert _run(shifted, warmup=30).alarm_step in (101, 102, 103)


@pytest.mark.parametrize("seed", range(5))
def test_alarm_fires_on_upward_trend(seed):
    # log k3 rises by 0.05/step after step 100 (k3 x e^1 after 20 steps): the alarm must fire soon after
    a = _run(_series(300, trend_from=100, slope=0.05, seed=seed), warmup=20)
    assert a.alarm_step is not None and 100 < a.alarm_step <= 140


def test_alarm_ignores_downward_trend_and_handles_zero():
    assert _run(_series(300, trend_from=50, slope=-0.05), warmup=20).alarm_step is None
    a = _run([0.0] * 30 + [1e-6] * 10, warmup=10)   # exact zeros (identical engines), then a jump
    assert a.alarm_step == 31
    with pytest.raises(ValueError):
        DriftAlarm().update(1, float("nan"))


def test_state_roundtrip_continues_identically():
    s = _series(200, trend_from=80, slope=0.05, seed=3)
    full = _run(s, warmup=20)
    a = _run(s[:90], warmup=20)
    b = DriftAlarm()
    b.load_state_dict(a.state_dict())
    for t, v in enumerate(s[90:], 91):
        b.update(t, v)
    assert b.state_dict() == full.state_dict()


def test_collapse_and_lead():
    c = CollapseDetector(alpha=0.5, frac=0.5, min_peak=0.1, warmup=3)
    rewards = [0.2, 0.4, 0.6, 0.6, 0.6, 0.6, 0.3, 0.1, 0.0, 0.0, 0.0]
    for t, r in enumerate(rewards, 1):
        c.update(t, r)
    # EWMA: .2 .3 .45 .525 .5625 .58125 .440625 .2703125 (< .5 * .58125 = .290625 at step 8)
    assert c.peak == pytest.approx(0.58125) and c.collapse_step == 8
    assert lead_steps(5, 8) == 3 and lead_steps(None, 8) is None and lead_steps(5, None) is None
    flat = CollapseDetector(warmup=3)
    for t in range(1, 50):
        flat.update(t, 0.0)                 # never learned: no peak, so no "collapse"
    assert flat.collapse_step is None
