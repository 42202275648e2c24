"""The figure writers produce non-empty png + pdf files from the tidy tables (zeros and all)."""
import pandas as pd
import pytest

from minite.diagnostics import figures
from minite.diagnostics.figures import attribution_waterfall, layer_heatmap, positive_range


def _layers():
    rows = []
    for layer in range(3):
        for op in ("attn_out", "router_logits", "moe_out", "residual"):
            value = 0.0 if layer == 0 else 10.0 ** -layer
            rows.append({"layer": layer, "op": op, "metric": "rel_err", "value": value})
        rows.append({"layer": layer, "op": "topk", "metric": "topk_disagree", "value": 0.1})
    rows.append({"layer": 3, "op": "logits", "metric": "rel_err", "value": 3e-3})
    return pd.DataFrame(rows)


def _attr():
    rows = []
    causes = ["weights", "activations", "gemm", "high_precision", "non_gemm"]
    for order, seq in (("forward", causes), ("reverse", causes[::-1])):
        k3 = 1.0
        for c, d in zip(seq, (0.5, 0.2, 0.1, -0.05, 0.24), strict=True):
            rows.append({"cause": c, "order": order, "k3_before": k3, "k3_after": k3 - d, "delta": d,
                         "share": d / 0.99})
            k3 -= d
    for c, d in zip(causes, (0.4, 0.3, 0.1, 0.09, 0.1), strict=True):
        rows.append({"cause": c, "order": "shapley", "k3_before": 1.0, "k3_after": 0.01, "delta": d,
                     "share": d / 0.99})
    return pd.DataFrame(rows)


def test_heatmap_writes_png_and_pdf(tmp_path):
    paths = layer_heatmap(_layers(), tmp_path / "layers_heatmap")
    assert sorted(p.suffix for p in paths) == [".pdf", ".png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_heatmap_all_zero(tmp_path):
    d = _layers().assign(value=0.0)
    paths = layer_heatmap(d, tmp_path / "zero")
    assert all(p.stat().st_size > 1000 for p in paths)


def test_heatmap_rejects_missing_metric(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        layer_heatmap(_layers(), tmp_path / "x", metric="nope")


def test_waterfall_writes_png_and_pdf(tmp_path):
    paths = attribution_waterfall(_attr(), tmp_path / "attribution_waterfall")
    assert sorted(p.suffix for p in paths) == [".pdf", ".png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def _norm_of(monkeypatch, draw):
    """The colour norm (vmin, vmax) of the heatmap ``draw()`` makes (save_figure intercepted)."""
    seen = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, stem: seen.append(fig.axes[0].collections[0].norm))
    draw()
    return seen[0].vmin, seen[0].vmax


def test_heatmap_shared_colour_scale(tmp_path, monkeypatch):
    small, large = _layers(), _layers().assign(value=lambda d: d["value"] * 100)
    assert positive_range([small]) == (pytest.approx(3e-3), pytest.approx(0.1))   # zeros are not on the scale
    assert positive_range([small.assign(value=0.0)]) is None
    shared = positive_range([small, large])
    assert shared == (pytest.approx(3e-3), pytest.approx(10.0))
    own = _norm_of(monkeypatch, lambda: layer_heatmap(small, tmp_path / "a"))
    assert own == (pytest.approx(3e-3), pytest.approx(0.1))               # by default: its own values
    fixed = _norm_of(monkeypatch, lambda: layer_heatmap(small, tmp_path / "b", vrange=shared))
    assert fixed == shared                                               # given: every arm the same scale
    zero = _norm_of(monkeypatch, lambda: layer_heatmap(small.assign(value=0.0), tmp_path / "c", vrange=shared))
    assert zero == shared                                                # an all-zero arm keeps the scale
