"""minite.report: the aggregation (throughput table, ratios, loaders) and figures, on synthetic result files."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest

from minite.provenance import append_jsonl, write_json
from minite.report import figures, load, tables

ARMS = ["bf16", "naive_te_nvfp4", "minite_nvfp4"]
TPS = {"bf16": 1000.0, "naive_te_nvfp4": 800.0, "minite_nvfp4": 1390.0}


def learner_record(arm, tps, **kw):
    rec = dict(tokens_per_s=tps, step_ms=16 * 64 / tps * 1e3, peak_mem_gb=1.25, model="tiny", layers=2,
               device="cpu (x86_64, 2 cores)", sha="0123456789ab", command=f"python -m minite bench-learner --arm {arm}",
               date="2026-11-29T12:00:00+00:00", step_split_ms={"gemm": 1.0})
    rec.update(kw)
    return rec


@pytest.fixture
def results(tmp_path):
    r = tmp_path / "results" / "cpu"
    for arm in ARMS:
        write_json(r / arm / "learner.json", learner_record(arm, TPS[arm]))
        for step in range(1, 31):
            k3 = {"bf16": 1e-5, "naive_te_nvfp4": 1e-4 * step, "minite_nvfp4": 0.0}[arm]
            append_jsonl(r / arm / "stability.jsonl",
                         {"arm": arm, "step": step, "reward_mean": step / 30, "k3": k3, "max_abs_dp": 10 * k3})
        write_json(r / arm / "stability_summary.json", {"arm": arm, "alarm_step": 12 if "naive" in arm else None})
        pd.DataFrame({"arm": arm, "step": [0, 10, 20, 30], "mean@4": [0.1, 0.2, 0.3, 0.4]}).to_csv(
            r / arm / "evals.csv", index=False)
    return r


def test_table_columns_ratios_and_files(results):
    df = tables.write_throughput_table(results, ARMS)
    assert list(df.columns) == tables.COLUMNS
    assert list(df["arm"]) == ARMS
    m = df.set_index("arm")
    assert m.loc["minite_nvfp4", "ratio_vs_bf16"] == pytest.approx(1.39)
    assert m.loc["minite_nvfp4", "ratio_vs_naive"] == pytest.approx(1390 / 800)
    assert m.loc["bf16", "ratio_vs_bf16"] == 1.0 and m.loc["naive_te_nvfp4", "ratio_vs_naive"] == 1.0
    csv = pd.read_csv(results / "throughput_table.csv")
    assert list(csv.columns) == tables.COLUMNS and len(csv) == 3
    assert csv["tokens_per_s"].tolist() == [TPS[a] for a in ARMS]
    md = (results / "throughput_table.md").read_text()
    for paper in ("33,540", "1.39x", "1.47x"):              # the paper's numbers beside ours
        assert paper in md
    assert "1,390" in md and "1.74x" in md                 # ours (1390 / 800 = 1.7375)
    assert "0123456789ab" in md and "bench-learner --arm minite_nvfp4" in md and "2026-11-29" in md
    tex = (results / "throughput_table.tex").read_text()
    assert "\\toprule" in tex and "naive\\_te\\_nvfp4" in tex and "1.39" in tex


def test_ratios_missing_reference_arm_are_nan(results):
    df = tables.throughput_table(load.load_learner(results, ["minite_nvfp4"]))
    assert math.isnan(df["ratio_vs_bf16"].iloc[0]) and math.isnan(df["ratio_vs_naive"].iloc[0])
    md = tables.to_markdown(df, load.load_learner(results, ["minite_nvfp4"]), "cpu")
    assert "n/a" in md and "nanx" not in md


def test_provenance_block_is_lifted(tmp_path):
    rec = learner_record("bf16", 10.0)
    prov = {k: rec.pop(k) for k in ("sha", "device", "command", "date")}
    write_json(tmp_path / "bf16" / "learner.json", {**rec, "provenance": prov})
    assert load.load_learner(tmp_path, ["bf16"])["bf16"]["sha"] == "0123456789ab"


@pytest.mark.parametrize("bad", [{"tokens_per_s": float("nan")}, {"tokens_per_s": 0.0}, {"step_ms": -1.0}])
def test_bad_learner_numbers_are_rejected(tmp_path, bad):
    write_json(tmp_path / "bf16" / "learner.json", learner_record("bf16", 10.0, **bad))
    with pytest.raises(load.ResultError, match="positive finite"):
        load.load_learner(tmp_path, ["bf16"])


def test_missing_key_and_missing_file(tmp_path):
    rec = learner_record("bf16", 10.0)
    del rec["peak_mem_gb"]
    write_json(tmp_path / "bf16" / "learner.json", rec)
    with pytest.raises(load.ResultError, match="peak_mem_gb"):
        load.load_learner(tmp_path, ["bf16"])
    with pytest.raises(FileNotFoundError, match="minite_nvfp4"):
        load.load_learner(tmp_path, ["minite_nvfp4"])
    with pytest.warns(UserWarning, match="left out"):
        assert load.load_learner(tmp_path, ["minite_nvfp4"], missing="skip") == {}


def test_mixed_model_slices_refuse_ratios(tmp_path):
    write_json(tmp_path / "bf16" / "learner.json", learner_record("bf16", 10.0))
    write_json(tmp_path / "minite_nvfp4" / "learner.json", learner_record("minite_nvfp4", 10.0, layers=4))
    with pytest.raises(load.ResultError, match="different model slices"):
        tables.throughput_table(load.load_learner(tmp_path, ["bf16", "minite_nvfp4"]))


def test_stability_loader_flattens_and_tolerates_torn_last_line(tmp_path):
    p = tmp_path / "bf16" / "stability.jsonl"
    append_jsonl(p, {"step": 1, "mismatch": {"k3": 1e-3, "max_abs_dp": 0.1}, "reward_mean": 0.5})
    append_jsonl(p, {"step": 2, "mismatch": {"k3": 2e-3, "max_abs_dp": 0.2}, "reward_mean": 0.6})
    with open(p, "a") as f:
        f.write('{"step": 3, "mism')                        # a job killed mid-line
    with pytest.warns(UserWarning, match="incomplete"):
        df = load.load_stability(tmp_path, ["bf16"])
    assert df["step"].tolist() == [1, 2] and (df["arm"] == "bf16").all()
    assert load.column(df, "k3") == "mismatch/k3"
    assert load.column(df, ("reward", "reward_mean")) == "reward_mean"
    with pytest.raises(load.ResultError, match="no column"):
        load.column(df, "entropy")


def test_stability_torn_middle_line_is_an_error(tmp_path):
    p = tmp_path / "bf16" / "stability.jsonl"
    p.parent.mkdir(parents=True)
    p.write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(load.ResultError, match=":2"):
        load.load_stability(tmp_path, ["bf16"])


def test_records_of_another_arm_are_an_error(tmp_path):
    append_jsonl(tmp_path / "bf16" / "stability.jsonl", {"arm": "minite_nvfp4", "step": 1})
    with pytest.raises(load.ResultError, match="expected only 'bf16'"):
        load.load_stability(tmp_path, ["bf16"])


def _is_image(path, magic):
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:4] == magic


def test_figures_write_png_and_pdf(results):
    out = results / "figures"
    df = tables.throughput_table(load.load_learner(results, ARMS))
    stab = load.load_stability(results, ARMS)
    figures.throughput_bars(df, out / "throughput")
    figures.drift(stab, out / "drift", load.load_stability_summary(results, ARMS))
    figures.reward_eval(stab, load.load_evals(results, ARMS), out / "reward_eval")
    for stem in ("throughput", "drift", "reward_eval"):
        assert _is_image(out / f"{stem}.png", b"\x89PNG")
        assert _is_image(out / f"{stem}.pdf", b"%PDF")
    assert not list(out.glob(".*.tmp"))                     # atomic writes left no temporaries
    fig = figures.drift(stab)                               # no stem: the open figure, for notebooks
    assert len(fig.axes) == 2 and all(ax.get_yscale() == "log" for ax in fig.axes)


def test_drift_figure_requires_the_metrics(results, tmp_path):
    stab = load.load_stability(results, ARMS).drop(columns="k3")
    with pytest.raises(load.ResultError, match="k3"):
        figures.drift(stab, tmp_path / "drift")


def test_kernel_figure(tmp_path):
    rows = [dict(kernel="gemm", provider=p, shape="q_proj", M=m, N=4096, K=2048, median_ms=1.0, tflops=m * f,
                 device="H200", sha="x") for p, f in (("cublas_bf16", 1.0), ("ours", 2.0)) for m in (1, 16, 4096)]
    figures.kernel_throughput(pd.DataFrame(rows), tmp_path / "kernels")
    assert _is_image(tmp_path / "kernels.png", b"\x89PNG")
    with pytest.raises(load.ResultError, match="needs columns"):
        figures.kernel_throughput(pd.DataFrame({"M": [1]}), tmp_path / "k2")


def test_cli_table_and_figure(results):
    py = [sys.executable, "-m", "minite.report"]
    subprocess.run(py + ["table", "--results", str(results), "--arms", *ARMS], check=True, capture_output=True)
    assert json.loads(pd.read_csv(results / "throughput_table.csv").to_json(orient="records"))[2]["arm"] == ARMS[2]
    bad = subprocess.run(py + ["table", "--results", str(results), "--arms", "bf16", "nope"], capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "nope" in bad.stderr


def _diagnostics(results, arms=ARMS):
    for arm in arms:
        d = results / arm / "diagnostics"
        write_json(d / "mismatch.json", {"k1": 1e-4, "k3": 1e-4, "max_abs_dp": 0.01, "n_tokens": 64})
        pd.DataFrame([{"layer": layer, "op": op, "metric": "rel_err", "value": 0.0 if arm == "minite_nvfp4" else 1e-3}
                      for layer in (0, 1) for op in ("attn_out", "moe_out")]
                     + [{"layer": -1, "op": "logits", "metric": "rel_err", "value": 2e-3}]).to_csv(
            d / "layers.csv", index=False)
    causes = ["weights", "activations"]
    pd.DataFrame([{"cause": c, "order": o, "k3_before": 2e-4 if i == 0 else 1e-4, "k3_after": 1e-4 if i == 0 else 0.0,
                   "delta": 1e-4, "share": 0.5} for o in ("forward", "reverse", "shapley") for i, c in enumerate(causes)]
                 ).to_csv(results / "naive_te_nvfp4" / "diagnostics" / "attribution.csv", index=False)


def test_diagnostics_figures_reuse_the_diagnostics_helpers(results):
    from minite.report import diagnostics
    _diagnostics(results)
    diag = load.load_diagnostics(results, ARMS)
    assert "attribution" in diag["naive_te_nvfp4"] and "attribution" not in diag["bf16"]
    out = results / "figures"
    diagnostics.layers(diag, "minite_nvfp4", out / "layers_minite_nvfp4")
    diagnostics.attribution(diag, out / "attribution")
    assert _is_image(out / "layers_minite_nvfp4.png", b"\x89PNG") and _is_image(out / "attribution.pdf", b"%PDF")
    with pytest.raises(load.ResultError, match="attribution"):
        diagnostics.attribution({a: d for a, d in diag.items() if a != "naive_te_nvfp4"}, out / "none")


@pytest.mark.slow
@pytest.mark.parametrize("nb", ["drift", "throughput", "diagnostics"])
def test_notebooks_execute_on_results(results, nb):
    """Each notebook runs top to bottom on a results directory (papermill, as the pipeline runs it)."""
    import nbformat
    papermill = pytest.importorskip("papermill")
    _diagnostics(results)
    out = results / "notebooks" / f"{nb}.ipynb"
    out.parent.mkdir(parents=True, exist_ok=True)
    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    papermill.execute_notebook(str(repo / "notebooks" / f"{nb}.ipynb"), str(out), kernel_name="python3",
                               parameters={"results_dir": str(results), "arms": ARMS}, progress_bar=False,
                               cwd=str(results))
    cells = nbformat.read(out, 4).cells
    outputs = [o for c in cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2   # it plotted


def test_git_sha_prefers_minite_git_sha(monkeypatch):
    """A copied tree can carry a stale .git: the sha the sender sets must win over git's HEAD."""
    from minite.provenance import git_sha
    monkeypatch.delenv("MINITE_GIT_SHA", raising=False)
    from_git = git_sha()
    assert from_git != "0123abc"
    monkeypatch.setenv("MINITE_GIT_SHA", "0123abc")
    assert git_sha() == "0123abc"
    assert git_sha(short=True) == "0123abc"
