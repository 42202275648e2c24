"""minite.report: the aggregation (throughput table, ratios, loaders) and figures, on synthetic result files."""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pandas as pd
import pytest

from minite.provenance import append_jsonl, write_json
from minite.report import figures, load, rounds, tables
from minite.report.load import ResultError

ARMS = ["bf16", "naive_te_nvfp4", "minite_nvfp4"]
TPS = {"bf16": 1000.0, "naive_te_nvfp4": 800.0, "minite_nvfp4": 1390.0}


def learner_record(arm, tps, steps=None, **kw):
    """A learner.json as bench-learner writes it: ``steps`` = the per-step times as multiples of the median
    (default: 10 steps within +-2%, a steady machine)."""
    med = 16 * 64 / tps * 1e3
    rel = steps if steps is not None else [0.98, 0.99, 0.99, 1.0, 1.0, 1.0, 1.0, 1.01, 1.01, 1.02]
    rec = dict(tokens_per_s=tps, step_ms=med, step_ms_all=[med * r for r in rel], peak_mem_gb=1.25, model="tiny",
               layers=2, device="cpu (x86_64, 2 cores)", sha="0123456789ab",
               command=f"python -m minite bench-learner --arm {arm}", date="2026-11-29T12:00:00+00:00",
               torch="2.13.0+cpu", triton="3.9.0", gpu_driver=None, step_split_ms={"gemm": 1.0, "other": 2.0})
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


def test_table_step_split_and_quantization_share():
    split = {"quantize": 12.0, "gemm": 30.0, "other": 50.0, "optimizer": 8.0}
    learner = {"bf16": learner_record("bf16", 1000.0, step_split_ms={"quantize": 0.0, "gemm": None,
                                                                       "other": 90.0, "optimizer": 8.0}),
               # split from --split-steps updates: the share is of their median update
               "naive_te_nvfp4": learner_record("naive_te_nvfp4", 800.0, step_split_ms=split,
                                                step_split_step_ms=120.0),
               # an older record split its timed updates: the share is of step_ms
               "minite_nvfp4": learner_record("minite_nvfp4", 1390.0, step_split_ms=split)}
    df = tables.throughput_table(learner).set_index("arm")
    assert df.loc["naive_te_nvfp4", "quant_share"] == pytest.approx(12.0 / 120.0)
    assert df.loc["minite_nvfp4", "quant_share"] == pytest.approx(12.0 / df.loc["minite_nvfp4", "step_ms"])
    assert df.loc["bf16", "quant_share"] == 0.0 and math.isnan(df.loc["bf16", "split_gemm_ms"])
    md = tables.to_markdown(df.reset_index(), learner, "cpu")
    assert "## Where a learner update goes" in md
    assert "| naive_te_nvfp4 | 12.0 | 30.0 | 50.0 | 8.0 | 120.0 | 10.0% |" in md
    none = {a: learner_record(a, TPS[a], step_split_ms=None) for a in ARMS}   # no split recorded: no section
    df = tables.throughput_table(none)
    assert df["quant_share"].isna().all() and "Where a learner update goes" not in tables.to_markdown(df, none, "cpu")


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
    assert csv["flag"].isna().all() and (csv["n_steps"] == 10).all()         # steady: nothing flagged
    md = (results / "throughput_table.md").read_text()
    for paper in ("33,540", "1.39x", "1.47x"):              # the paper's numbers beside ours
        assert paper in md
    assert "1,390" in md and "1.74x" in md                 # ours (1390 / 800 = 1.7375)
    assert "0123456789ab" in md and "bench-learner --arm minite_nvfp4" in md and "2026-11-29" in md
    assert "| 2.13.0+cpu | 3.9.0 | none |" in md           # torch, triton, GPU driver in the provenance table
    assert not _warned_rows(md) and "Beside the reference" not in md
    tex = (results / "throughput_table.tex").read_text()
    assert "\\toprule" in tex and "naive\\_te\\_nvfp4" in tex and "1.39" in tex


def test_rollout_columns_from_bench_sampler_records(results):
    """rollout.json beside learner.json: decode tokens/s, its ratio to bf16, the roofline fraction and the
    median step go into the table and a rollout section of the markdown; arms without one get NaN. The ratio
    is that of the median steps in the CSV and the markdown alike (tokens/s is tokens over the whole decode
    time, so its own ratio can differ)."""
    decode = {"bf16": 2000.0, "minite_nvfp4": 2500.0}
    for arm, tps in decode.items():
        write_json(results / arm / "rollout.json",
                   {"decode_tokens_per_s": tps * (1.02 if arm == "bf16" else 1.0), "roofline_frac": tps / 10000,
                    "step_ms": {"median": 64e3 / tps, "p10": 0.9 * 64e3 / tps, "p90": 1.1 * 64e3 / tps, "n": 63},
                    "cuda_graphs": True, "model": "tiny", "layers": 2, "batch": 64, "prompt_len": 32,
                    "new_tokens": 64, "device": "cpu", "sha": f"r{arm}"})
    df = tables.write_throughput_table(results, ARMS).set_index("arm")
    assert df.loc["minite_nvfp4", "rollout_sha"] == "rminite_nvfp4"
    assert not isinstance(df.loc["naive_te_nvfp4", "rollout_sha"], str)  # no record: missing
    assert df.loc["minite_nvfp4", "rollout_tokens_per_s"] == 2500.0
    assert df.loc["minite_nvfp4", "rollout_ratio_vs_bf16"] == pytest.approx(1.25)  # medians, not 2500 / 2040
    assert df.loc["bf16", "rollout_roofline_frac"] == pytest.approx(0.2)
    assert df.loc["minite_nvfp4", "rollout_step_ms"] == pytest.approx(25.6)
    assert math.isnan(df.loc["naive_te_nvfp4", "rollout_tokens_per_s"])
    md = (results / "throughput_table.md").read_text()
    assert "## Rollout (decode) throughput" in md
    # the ratio's range pairs opposite percentiles: 1.25 * 0.9 / 1.1 = 1.02, 1.25 * 1.1 / 0.9 = 1.53
    assert "| minite_nvfp4 | 2,500 | 1.25x (1.02-1.53) | 25.600 | 23.040-28.160 | 63 | 25.0% | graphs |" in md
    write_json(results / "bf16" / "rollout.json", {"tokens": 1})
    with pytest.raises(ResultError, match="not a bench-sampler record"):
        tables.write_throughput_table(results, ARMS)


def test_rollout_rows_follow_the_trust_rule(results):
    """A rollout row whose decode steps spread by more than SPREAD_LIMIT is flagged, and its ratio marked; the
    LaTeX table marks untrusted learner ratios too (a dagger), as its comment says."""
    steady, busy = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8] * 5, [8.0, 12.0, 6.0, 14.0, 8.0, 9.0] * 5
    for arm, steps in (("bf16", steady), ("minite_nvfp4", busy)):
        rec = _rollout_record(arm, statistics.median(steps))
        write_json(results / arm / "rollout.json", {**rec, "step_ms_all": steps})
    df = tables.write_throughput_table(results, ARMS).set_index("arm")
    assert df.loc["bf16", "rollout_flag"] == "" and df.loc["minite_nvfp4", "rollout_flag"].startswith("spread")
    md = (results / "throughput_table.md").read_text()
    row = next(ln for ln in md.split("## Rollout")[1].splitlines() if ln.startswith("| minite_nvfp4"))
    assert "⚠" in row.split("|")[3] and row.rstrip(" |").endswith("> 10%")
    flagged = tables.throughput_table(load.load_learner(results, ARMS)).assign(flag=["", "", "busy"])
    tex = tables.to_latex(flagged)
    assert tex.count(r"$^\dagger$") == 2 and "(here: a dagger)" in tex     # minite vs bf16, minite vs naive


def _rollout_record(arm, step_median, k=0, model="tiny"):
    return {"arm": arm, "decode_tokens_per_s": 64e3 / step_median, "roofline_frac": 0.4,
            "step_ms": {"median": step_median, "p10": 0.9 * step_median, "p90": 1.1 * step_median, "n": 63},
            "cuda_graphs": True, "model": model, "layers": 2, "batch": 64, "prompt_len": 32, "new_tokens": 64,
            "device": "cpu", "sha": "abc", "date": f"2026-12-01T10:0{k}:00+00:00"}


def test_rollout_rounds_merge_into_the_median_round_and_pair_the_ratio(results):
    """bench-sampler in rounds: rollout.json is the median round's record (by decode tokens/s) with every
    round's figures; the ratio vs BF16 is the median of the rounds' ratios of median steps, its range theirs."""
    sampler = rounds.BENCHES["sampler"]
    steps = {"bf16": [30.0, 32.0, 28.0], "naive_te_nvfp4": [20.0, 21.0, 22.0], "minite_nvfp4": [15.0, 20.0, 14.0]}
    for arm, per_round in steps.items():
        for k, ms in enumerate(per_round):
            write_json(results / arm / rounds.round_file(k, sampler), _rollout_record(arm, ms, k))
    merged = rounds.write_merged(results, ARMS, 3, sampler)
    rec = json.loads((results / "minite_nvfp4" / "rollout.json").read_text())
    assert rec == merged["minite_nvfp4"] and rec["median_round"] == 0 and rec["step_ms"]["median"] == 15.0
    assert [r["step_ms"]["median"] for r in rec["rounds"]] == [15.0, 20.0, 14.0]
    assert rec["date"] == "2026-12-01T10:00:00+00:00"                    # round 0's own record
    df = tables.write_throughput_table(results, ARMS).set_index("arm")
    # per round bf16 / minite: 2.0, 1.6, 2.0 -> median 2.0, range 1.6-2.0
    assert df.loc["minite_nvfp4", "rollout_ratio_vs_bf16"] == pytest.approx(2.0)
    assert df.loc["minite_nvfp4", "rollout_ratio_vs_bf16_lo"] == pytest.approx(1.6)
    assert df.loc["minite_nvfp4", "rollout_ratio_vs_bf16_hi"] == pytest.approx(2.0)
    assert df.loc["bf16", "rollout_ratio_vs_bf16"] == df.loc["bf16", "rollout_ratio_vs_bf16_lo"] == 1.0
    assert list(df["rollout_rounds"]) == [3, 3, 3]
    md = (results / "throughput_table.md").read_text()
    assert "Measured in 3 rounds, every arm once per round; each row is the arm's median round" in md
    assert "| minite_nvfp4 | 4,267 | 2.00x (1.60-2.00) | 15.000 |" in md
    (results / "naive_te_nvfp4" / "rollout.json").unlink()             # the other arms still pair their rounds
    df = tables.write_throughput_table(results, ARMS).set_index("arm")
    assert df.loc["minite_nvfp4", "rollout_ratio_vs_bf16_lo"] == pytest.approx(1.6)
    assert math.isnan(df.loc["naive_te_nvfp4", "rollout_rounds"])
    (results / "bf16" / rounds.round_file(2, sampler)).unlink()
    with pytest.raises(FileNotFoundError, match="bf16/rollout_rounds/round2"):
        rounds.write_merged(results, ARMS, 3, sampler)
    with pytest.raises(ResultError, match="different arms or model slices"):
        rounds.merge_rounds([_rollout_record("bf16", 1.0), _rollout_record("bf16", 1.0, model="small")], sampler)


def test_rollout_rounds_run_bench_sampler_into_their_own_directory(results, tmp_path, monkeypatch):
    """run_rounds with the sampler bench: the runner gets bench-sampler, the records land in rollout_rounds/
    and the resume copies in .partial/rollout_rounds/, apart from the learner's."""
    fake = tmp_path / "fake_bench.py"
    fake.write_text("import sys, os\nopen(os.environ['RUNS_LOG'], 'a').write(sys.argv[1] + '\\n')\n" + FAKE_BENCH)
    log = tmp_path / "runs.log"
    monkeypatch.setenv("RUNS_LOG", str(log))
    monkeypatch.setattr(rounds, "git_sha", lambda: "abc")
    sampler = rounds.BENCHES["sampler"]
    plan = rounds.parse_plan("bf16:0 minite_nvfp4:0")
    assert rounds.run_rounds(results, plan, [sys.executable, str(fake)], ["--batch", "8"], sampler) == 0
    assert log.read_text().split() == ["bench-sampler", "bf16:0", "bench-sampler", "minite_nvfp4:0"]
    assert (results / "minite_nvfp4" / "rollout_rounds" / "round0.json").is_file()
    assert (rounds.partial_dir(results, sampler) / "bf16" / "round0.json").is_file()
    assert not rounds.partial_dir(results).exists()                      # the learner's copies: untouched
    rounds.drop_partial(results, sampler)
    assert not (results / ".partial").exists()


def test_spread_and_ratio_range_from_the_step_times(tmp_path):
    """tokens/s quartiles from the step-time quartiles; the ratio's range divides opposite quartiles."""
    write_json(tmp_path / "bf16" / "learner.json", learner_record("bf16", 1000.0, steps=[0.9, 1.0, 1.0, 1.0, 1.2]))
    write_json(tmp_path / "minite_nvfp4" / "learner.json",
               learner_record("minite_nvfp4", 2000.0, steps=[0.8, 1.0, 1.0, 1.0, 1.0]))
    df = tables.throughput_table(load.load_learner(tmp_path, ["bf16", "minite_nvfp4"])).set_index("arm")
    b, m = df.loc["bf16"], df.loc["minite_nvfp4"]
    assert b.n_steps == 5 and b.spread == pytest.approx(0.0) and b.flag == ""   # q25 = q75 = median
    assert m.tokens_per_s_q25 == pytest.approx(2000.0) and m.tokens_per_s_q75 == pytest.approx(2000.0)
    assert m.ratio_vs_bf16 == pytest.approx(2.0)
    assert m.ratio_vs_bf16_lo == pytest.approx(2.0) and m.ratio_vs_bf16_hi == pytest.approx(2.0)
    write_json(tmp_path / "bf16" / "learner.json",                          # bf16 quartiles 0.96 / 1.04
               learner_record("bf16", 1000.0, steps=[0.92, 0.96, 1.0, 1.04, 1.08]))
    df = tables.throughput_table(load.load_learner(tmp_path, ["bf16", "minite_nvfp4"])).set_index("arm")
    b, m = df.loc["bf16"], df.loc["minite_nvfp4"]
    assert b.spread == pytest.approx(0.08) and b.flag == ""                 # under the 10% limit: trusted
    assert b.tokens_per_s_q25 == pytest.approx(1000 / 1.04) and b.tokens_per_s_q75 == pytest.approx(1000 / 0.96)
    assert m.ratio_vs_bf16_lo == pytest.approx(2000 / (1000 / 0.96))
    assert m.ratio_vs_bf16_hi == pytest.approx(2000 / (1000 / 1.04))
    assert b.ratio_vs_bf16 == b.ratio_vs_bf16_lo == b.ratio_vs_bf16_hi == 1.0


@pytest.mark.parametrize("steps, flag", [([0.7, 0.9, 1.0, 1.2, 1.5], "spread 30% > 10%"),
                                         ([0.99, 1.0, 1.01], "only 3 timed steps"),
                                         (None, "")])
def test_noisy_rows_are_flagged(results, steps, flag):
    """The trust rule: too few steps or an interquartile range above 10% of the median flags the row, and
    every ratio involving it is marked."""
    write_json(results / "naive_te_nvfp4" / "learner.json", learner_record("naive_te_nvfp4", 800.0, steps=steps))
    df = tables.write_throughput_table(results, ARMS)
    assert df.set_index("arm").loc["naive_te_nvfp4", "flag"] == flag
    assert (df.set_index("arm").drop("naive_te_nvfp4")["flag"] == "").all()
    md = (results / "throughput_table.md").read_text()
    minite_row = next(ln for ln in md.splitlines() if ln.startswith("| minite_nvfp4 |"))
    bf16_row = next(ln for ln in md.splitlines() if ln.startswith("| bf16 |"))
    if flag:
        assert flag in md and "⚠" in minite_row.split("|")[8]             # minite vs naive: untrusted
        assert "⚠" not in minite_row.split("|")[7]                         # minite vs bf16: both steady
        assert "⚠" in bf16_row.split("|")[8]
    else:
        assert not _warned_rows(md)


def _rounds_of(results, arm, tps_per_round, steps_per_round=None):
    """Write an arm's round records (bench-learner records, one per round) under learner_rounds/."""
    for k, tps in enumerate(tps_per_round):
        steps = steps_per_round[k] if steps_per_round else None
        write_json(results / arm / rounds.round_file(k),
                   {**learner_record(arm, tps, steps=steps, date=f"2026-12-01T10:0{k}:00+00:00"), "arm": arm})


def test_rounds_merge_into_the_median_round_and_pair_the_ratios(results):
    """learner.json from rounds: the median round's record (its own step times), tokens/s the median over
    the rounds; each ratio the median of the per-round ratios, with their range; a round spread above 10%
    flags the arm and every ratio with it."""
    _rounds_of(results, "bf16", [1000.0, 900.0, 1100.0])
    _rounds_of(results, "naive_te_nvfp4", [800.0, 810.0, 820.0], [None, [0.9, 1.0, 1.1, 1.0, 1.0], None])
    _rounds_of(results, "minite_nvfp4", [700.0, 800.0, 880.0])
    merged = rounds.write_merged(results, ARMS, 3)
    naive = json.loads((results / "naive_te_nvfp4" / "learner.json").read_text())
    assert naive == merged["naive_te_nvfp4"] and naive["median_round"] == 1 and naive["tokens_per_s"] == 810.0
    assert naive["date"] == "2026-12-01T10:01:00+00:00" and len(naive["step_ms_all"]) == 5  # round 1's own
    assert [r["tokens_per_s"] for r in naive["rounds"]] == [800.0, 810.0, 820.0]
    df = tables.write_throughput_table(results, ARMS).set_index("arm")
    # per round minite / bf16: 0.7, 0.889, 0.8 -> median 0.8 (the ratio of the medians would be 0.8 too, but
    # the range is the rounds': 0.7-0.889), minite / naive: 0.875, 0.988, 1.073
    assert df.loc["minite_nvfp4", "ratio_vs_bf16"] == pytest.approx(0.8)
    assert df.loc["minite_nvfp4", "ratio_vs_bf16_lo"] == pytest.approx(0.7)
    assert df.loc["minite_nvfp4", "ratio_vs_bf16_hi"] == pytest.approx(800 / 900)
    assert df.loc["minite_nvfp4", "ratio_vs_naive"] == pytest.approx(800 / 810)
    assert df.loc["bf16", "ratio_vs_bf16"] == df.loc["bf16", "ratio_vs_bf16_lo"] == 1.0
    assert list(df["n_rounds"]) == [3, 3, 3]
    assert df.loc["naive_te_nvfp4", "round_spread"] == pytest.approx(20 / 810)
    assert df.loc["naive_te_nvfp4", "flag"] == ""
    assert df.loc["bf16", "flag"] == "rounds differ by 20% > 10%"       # (1100 - 900) / 1000
    md = (results / "throughput_table.md").read_text()
    assert "Measured in 3 rounds" in md and "| 3 (2%) |" in md
    minite_row = next(ln for ln in md.splitlines() if ln.startswith("| minite_nvfp4 |"))
    assert "⚠" in minite_row.split("|")[7] and "0.80x (0.70-0.89)" in minite_row
    with pytest.raises(ResultError, match="different arms"):
        rounds.merge_rounds([{**learner_record("bf16", 1.0), "arm": "bf16"}, {**learner_record("x", 1.0), "arm": "x"}])


def test_merge_rounds_writes_nothing_when_a_round_is_missing(results):
    for arm in ARMS:
        _rounds_of(results, arm, [1000.0, 900.0])
    (results / "minite_nvfp4" / rounds.round_file(1)).unlink()               # a round that did not finish
    before = (results / "bf16" / "learner.json").read_text()
    with pytest.raises(FileNotFoundError, match="minite_nvfp4/learner_rounds/round1"):
        rounds.write_merged(results, ARMS, 2)
    assert (results / "bf16" / "learner.json").read_text() == before


FAKE_BENCH = """
import json, os, sys
args = sys.argv[1:]
arm, out = args[args.index("--arm") + 1], args[args.index("--out") + 1]
k = int(out.rsplit("round", 1)[1].split(".")[0])
with open(os.environ["RUNS_LOG"], "a") as f:
    f.write(f"{arm}:{k}\\n")
if os.environ.get("FAIL_AT") == f"{arm}:{k}":
    sys.exit(3)
os.makedirs(os.path.dirname(out), exist_ok=True)
json.dump(dict(arm=arm, tokens_per_s=1000.0 + k, step_ms=10.0, step_ms_all=[10.0], model="tiny", layers=2,
               device="cpu", sha="abc", command=" ".join(sys.argv), date="2026-12-01T00:00:00+00:00",
               torch="2", triton=None, gpu_driver=None, peak_mem_gb=1.0), open(out, "w"))
"""


def test_rounds_job_resumes_the_whole_rounds_an_interrupted_attempt_finished(results, tmp_path, monkeypatch):
    """An attempt that fails in round 1 leaves round 0's runs and round 1's first; the next attempt (snakemake
    has deleted the outputs) restores round 0, runs round 1 again from its first arm, then round 2; the merge
    drops the copies. Other arguments, or a tree with uncommitted changes, keep nothing."""
    fake = tmp_path / "fake_bench.py"
    fake.write_text(FAKE_BENCH)
    log = tmp_path / "runs.log"
    monkeypatch.setenv("RUNS_LOG", str(log))
    monkeypatch.setattr(rounds, "git_sha", lambda: "abc")
    plan = rounds.parse_plan("bf16:0 naive_te_nvfp4:0 minite_nvfp4:0 naive_te_nvfp4:1 minite_nvfp4:1 bf16:1 "
                             "minite_nvfp4:2 bf16:2 naive_te_nvfp4:2")
    runner, args = [sys.executable, str(fake)], ["--steps", "3"]

    def attempt(fail_at=None, args=args):
        log.write_text("")
        monkeypatch.setenv("FAIL_AT", fail_at or "")
        rc = rounds.run_rounds(results, plan, runner, args)
        return rc, log.read_text().split()

    rc, ran = attempt("minite_nvfp4:1")
    assert rc == 3 and ran == ["bf16:0", "naive_te_nvfp4:0", "minite_nvfp4:0", "naive_te_nvfp4:1", "minite_nvfp4:1"]
    for arm in ARMS:                                    # snakemake removes a failed job's outputs
        for f in (results / arm / "learner_rounds").glob("*.json"):
            f.unlink()
    rc, ran = attempt()
    assert rc == 0 and ran == ["naive_te_nvfp4:1", "minite_nvfp4:1", "bf16:1", "minite_nvfp4:2", "bf16:2",
                               "naive_te_nvfp4:2"]
    assert json.loads((results / "bf16" / rounds.round_file(0)).read_text())["tokens_per_s"] == 1000.0  # restored
    rounds.write_merged(results, ARMS, 3)
    rounds.drop_partial(results)
    assert not (results / ".partial").exists()
    # an interrupted attempt, then one with other arguments: nothing kept
    assert attempt("bf16:1")[0] == 3
    assert attempt(args=["--steps", "5"])[1] == [f"{a}:{k}" for a, k in plan]
    # uncommitted changes: no copies are made, so nothing can be kept
    monkeypatch.setattr(rounds, "git_sha", lambda: "abc-dirty")
    assert attempt("bf16:1")[0] == 3 and not rounds.partial_dir(results).exists()
    assert attempt()[1] == [f"{a}:{k}" for a, k in plan]
    with pytest.raises(ResultError, match="ARM:ROUND"):
        rounds.parse_plan("bf16:0 naive")


def test_reference_run_beside_the_new_one(results, tmp_path):
    """The committed reference run of the profile, labelled with its own sha, device and date."""
    ref = tmp_path / "reference" / "cpu"
    for arm in ARMS:
        write_json(ref / arm / "learner.json", learner_record(arm, TPS[arm] / 2, sha="fedcba987654",
                                                             date="2026-10-01T00:00:00+00:00", triton=None))
    tables.write_throughput_table(results, ARMS, reference_dir=ref)
    md = (results / "throughput_table.md").read_text()
    head, ref_part = md.split("## Beside the reference (fedcba987654, cpu (x86_64, 2 cores), 2026-10-01)")
    assert "1,390" in head and "695" in ref_part and "1,390" not in ref_part.split("## Paper")[0]
    assert "this run: 0123456789ab" in head
    csv = pd.read_csv(results / "throughput_table.csv")
    assert csv["tokens_per_s"].tolist() == [TPS[a] for a in ARMS]           # the csv is this run only
    write_json(ref / "bf16" / "learner.json", learner_record("bf16", 1.0, layers=4))
    md = tables.to_markdown(tables.throughput_table(load.load_learner(results, ARMS)), load.load_learner(results, ARMS),
                            "cpu", {"bf16": load.load_learner(ref, ["bf16"])["bf16"]})
    assert "another model slice" in md


def test_old_records_without_step_times_or_versions(tmp_path):
    """Results written before per-step times and versions were recorded still tabulate, and say so."""
    rec = learner_record("bf16", 10.0)
    for key in ("step_ms_all", "triton", "gpu_driver"):
        del rec[key]
    write_json(tmp_path / "bf16" / "learner.json", rec)
    learner = load.load_learner(tmp_path, ["bf16"])
    df = tables.throughput_table(learner)
    assert df["n_steps"].item() == 1 and df["flag"].item() == "only 1 timed steps"
    assert "| not recorded | not recorded |" in tables.to_markdown(df, learner, "cpu")


def _warned_rows(md: str) -> list[str]:
    """The table rows of a throughput markdown that carry the untrusted-ratio mark."""
    return [ln for ln in md.splitlines() if ln.startswith("| ") and "⚠" in ln]


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
    figures.step_split(load.load_learner(results, ARMS), out / "step_split")
    for stem in ("throughput", "drift", "reward_eval", "step_split"):
        assert _is_image(out / f"{stem}.png", b"\x89PNG")
        assert _is_image(out / f"{stem}.pdf", b"%PDF")
        assert (out / f"{stem}.png").stat().st_mode & 0o777 == 0o666 & ~_umask()   # not mkstemp's 0600
    assert not list(out.glob(".*.tmp"))                     # atomic writes left no temporaries
    fig = figures.drift(stab)                               # no stem: the open figure, for notebooks
    assert len(fig.axes) == 2 and all(ax.get_yscale() == "log" for ax in fig.axes)


def _umask():
    import os
    m = os.umask(0)
    os.umask(m)
    return m


def _overlaps(fig, legend, artists) -> list:
    """The artists whose drawn extent intersects the legend's (display coordinates)."""
    fig.canvas.draw()
    box = legend.get_window_extent()
    return [a for a in artists if a.get_window_extent().overlaps(box)]


def test_drift_legend_below_and_zero_floor_labelled_in_every_panel(results):
    fig = figures.drift(load.load_stability(results, ARMS), summaries=load.load_stability_summary(results, ARMS))
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert not _overlaps(fig, fig.legends[0], fig.axes)      # the legend sits outside both panels
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "miniTE NVFP4 (exact 0 at every step)" in labels and "naive TE NVFP4 drift alarm" in labels
    for ax in fig.axes:                                      # minite's zeros: the same words in each panel
        notes = [t.get_text() for t in ax.texts if t.get_text().startswith("exact 0 (drawn at ")]
        assert len(notes) == 1
        floor = float(notes[0].split("drawn at ")[1].rstrip(")"))
        green = ax.lines[5]                                  # minite's smoothed curve: flat at the floor
        assert all(y == pytest.approx(floor, rel=0.5) for y in green.get_ydata())


def test_reward_eval_full_range_error_bars_and_legend(results):
    evals = load.load_evals(results, ARMS)
    fig = figures.reward_eval(load.load_stability(results, ARMS), evals)
    left, right = fig.axes
    assert left.get_ylim() == (0.0, 1.0) and right.get_ylim()[0] == 0.0 and right.get_ylim()[1] >= 1.0
    assert len(fig.legends) == 1 and [t.get_text() for t in fig.legends[0].get_texts()] == [
        "BF16", "naive TE NVFP4", "miniTE NVFP4"]
    assert any("error bars" in t.get_text() for t in right.texts)
    err, what = figures.eval_error(evals, "mean@4")          # no per-prompt scores: the s.e. bound
    assert "sqrt(p(1-p)/n_prompts)" in what or "none" in what
    evals = evals.assign(n_prompts=64)
    err, what = figures.eval_error(evals, "mean@4")
    assert err.iloc[1] == pytest.approx((0.2 * 0.8 / 64) ** 0.5) and "sqrt" in what
    assert figures.eval_error(evals.assign(**{"mean@4_se": 0.01}), "mean@4")[0].eq(0.01).all()
    fig = figures.reward_eval(load.load_stability(results, ARMS), evals)
    caps = [c for c in fig.axes[1].containers]               # one errorbar container per arm
    assert len(caps) == 3


def test_step_split_legend_beside_the_bars(results):
    fig = figures.step_split(load.load_learner(results, ARMS))
    ax = fig.axes[0]
    assert len(ax.patches) == 3 * 2                          # 3 arms x 2 phases
    assert not _overlaps(fig, ax.get_legend(), ax.patches)
    assert figures.step_split({"bf16": {"tokens_per_s": 1.0}}) is None
    nothing = dict.fromkeys(("quantize", "gemm", "other", "optimizer"))        # bench-learner --split-steps 0
    assert figures.step_split({"bf16": {"tokens_per_s": 1.0, "step_split_ms": nothing}}) is None


def test_drift_figure_requires_the_metrics(results, tmp_path):
    stab = load.load_stability(results, ARMS).drop(columns="k3")
    with pytest.raises(load.ResultError, match="k3"):
        figures.drift(stab, tmp_path / "drift")


def test_kernel_figure(tmp_path):
    rows = [dict(kernel="gemm", provider=p, shape="q_proj", M=m, N=4096, K=2048, median_ms=1.0, tflops=m * f,
                 device="H200", sha="x") for p, f in (("cublas_bf16", 1.0), ("ours", 2.0)) for m in (1, 16, 4096)]
    figures.kernel_throughput(pd.DataFrame(rows), tmp_path / "kernels")
    assert _is_image(tmp_path / "kernels.png", b"\x89PNG")
    fig = figures.kernel_throughput(pd.DataFrame(rows))      # log-log: M = 1 is visible beside M = 4096
    assert all(ax.get_yscale() == "log" and ax.get_xscale() == "log" for ax in fig.axes if ax.lines)
    with pytest.raises(load.ResultError, match="needs columns"):
        figures.kernel_throughput(pd.DataFrame({"M": [1]}), tmp_path / "k2")


def test_cli_table_and_figure(results):
    py = [sys.executable, "-m", "minite.report"]
    subprocess.run(py + ["table", "--results", str(results), "--arms", *ARMS], check=True, capture_output=True)
    assert json.loads(pd.read_csv(results / "throughput_table.csv").to_json(orient="records"))[2]["arm"] == ARMS[2]
    bad = subprocess.run(py + ["table", "--results", str(results), "--arms", "bf16", "nope"], capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_cli_bad_input_is_one_line(results, capsys):
    """A missing or torn result file and a missing flag: exit 2, one line naming the file, no traceback."""
    from minite.report.__main__ import main
    assert main(["table", "--results", str(results), "--arms", "bf16", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope/learner.json does not exist" in err and "Traceback" not in err and len(err.splitlines()) == 1
    (results / "bf16" / "learner.json").write_text('{"tokens_per_s": ')
    assert main(["table", "--results", str(results), "--arms", *ARMS]) == 2
    err = capsys.readouterr().err
    assert "bf16/learner.json: corrupt JSON" in err and len(err.splitlines()) == 1
    assert main(["figure", "drift", "--results", str(results), "--arms", "bf16"]) == 2
    assert "--out is required" in capsys.readouterr().err


def _diagnostics(results, arms=ARMS):
    for arm in arms:
        d = results / arm / "diagnostics"
        write_json(d / "mismatch.json", {"k1": 1e-4, "k3": 1e-4, "max_abs_dp": 0.01, "n_tokens": 64})
        pd.DataFrame([{"layer": layer, "op": op, "metric": "rel_err", "value": 0.0 if arm == "minite_nvfp4" else 1e-3}
                      for layer in (0, 1) for op in ("attn_out", "moe_out")]
                     + [{"layer": -1, "op": "logits", "metric": "rel_err", "value": 2e-3}]).to_csv(
            d / "layers.csv", index=False)
    causes = ["weights", "activations"]
    pd.DataFrame([{"cause": c, "order": o, "k3_before": 2e-4 if i == 0 else 1e-4,
                   "k3_after": 1e-4 if i == 0 else 0.0, "delta": 1e-4, "share": 0.5}
                  for o in ("forward", "reverse", "shapley") for i, c in enumerate(causes)]
                 ).to_csv(results / "naive_te_nvfp4" / "diagnostics" / "attribution.csv", index=False)


def test_diagnostics_figures_reuse_the_diagnostics_helpers(results):
    from minite.report import diagnostics
    _diagnostics(results)
    diag = load.load_diagnostics(results, ARMS)
    assert "attribution" in diag["naive_te_nvfp4"] and "attribution" not in diag["bf16"]
    out = results / "figures"
    written = diagnostics.layers(diag, out / "layers")
    assert set(written) == set(ARMS)
    diagnostics.attribution(diag, out / "attribution")
    for arm in ARMS:
        assert _is_image(out / f"layers_{arm}.png", b"\x89PNG")
    assert _is_image(out / "attribution.pdf", b"%PDF")
    with pytest.raises(load.ResultError, match="attribution"):
        diagnostics.attribution({a: d for a, d in diag.items() if a != "naive_te_nvfp4"}, out / "none")
    with pytest.raises(load.ResultError, match="layers.csv"):
        diagnostics.layers({**diag, "bf16": {"mismatch": {}}}, out / "none")


def test_layer_heatmaps_share_one_colour_scale(results, monkeypatch):
    from minite.diagnostics import figures as dfig
    from minite.report import diagnostics
    _diagnostics(results)
    diag = load.load_diagnostics(results, ARMS)
    norms = []
    monkeypatch.setattr(dfig, "save_figure", lambda fig, stem: norms.append(fig.axes[0].collections[0].norm))
    diagnostics.layers(diag, results / "figures" / "layers")
    assert len(norms) == 3 and len({(n.vmin, n.vmax) for n in norms}) == 1
    assert (norms[0].vmin, norms[0].vmax) == (pytest.approx(1e-3), pytest.approx(2e-3))


def test_attribution_title_says_which_tokens():
    from minite.report.diagnostics import attribution_title
    title = attribution_title({"settings": {"prompts": 16}, "attribution_settings": {"prompts": 8}})
    assert "8 prompts" in title and "16 prompts" in title and "not comparable" in title


def test_metric_definitions_from_the_results_or_the_code():
    from minite.diagnostics.metrics import DEFINITIONS
    from minite.report.diagnostics import definitions_table
    t = definitions_table(None, ["k3", "first_divergence"])
    assert list(t.index) == ["k3", "first_divergence"] and t.loc["first_divergence", "threshold"] == 0.0078125
    assert t.loc["k3", "better"] == DEFINITIONS["k3"]["better"]
    own = {"k3": {"formula": "f", "better": "b", "units": "u"}}
    assert definitions_table({"definitions": own}).loc["k3", "formula"] == "f"   # what the file says wins


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
    reference = results.parent / "reference"                 # a reference run beside the new one
    write_json(reference / "bf16" / "learner.json", learner_record("bf16", 500.0, sha="fedcba987654"))
    papermill.execute_notebook(str(repo / "notebooks" / f"{nb}.ipynb"), str(out), kernel_name="python3",
                               parameters={"results_dir": str(results), "reference_dir": str(reference),
                                           "arms": ARMS}, progress_bar=False, cwd=str(results))
    cells = nbformat.read(out, 4).cells
    outputs = [o for c in cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2   # it plotted
    if nb == "throughput":
        md = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
        assert "Beside the reference (fedcba987654" in md


def test_git_sha_prefers_minite_git_sha(monkeypatch):
    """A copied tree can carry a stale .git: the sha the sender sets must win over git's HEAD."""
    from minite.provenance import git_sha
    monkeypatch.delenv("MINITE_GIT_SHA", raising=False)
    from_git = git_sha()
    assert from_git != "0123abc"
    monkeypatch.setenv("MINITE_GIT_SHA", "0123abc")
    assert git_sha() == "0123abc"
    assert git_sha(short=True) == "0123abc"


def test_provenance_versions_and_relative_paths(tmp_path):
    from minite.provenance import REPO_ROOT, provenance, repo_relative
    p = provenance("cpu")
    assert {"torch", "triton", "python", "cuda", "gpu_driver"} <= set(p)
    assert p["gpu_driver"] is None and p["cuda"] is None                # a CPU run has neither
    assert repo_relative(REPO_ROOT / "results" / "cpu" / "x.json") == "results/cpu/x.json"
    assert repo_relative(tmp_path / "x.json") == str(tmp_path / "x.json")   # outside the repository: as given


def test_throughput_figure_adds_the_rollout_panel_when_the_table_has_it(results):
    learner = load.load_learner(results, ARMS)
    rollout = {a: {"decode_tokens_per_s": 1000.0 * (i + 1), "roofline_frac": 0.1 * (i + 1),
                   "step_ms": {"median": 2.0}, "sha": "abc", "device": "cpu"} for i, a in enumerate(ARMS)}
    assert len(figures.throughput_bars(tables.throughput_table(learner)).axes) == 1
    fig = figures.throughput_bars(tables.throughput_table(learner, rollout))
    assert len(fig.axes) == 2 and fig.axes[1].get_title() == "Rollout (decode) throughput"
    labels = [t.get_text() for t in fig.axes[1].texts]
    assert any("of roofline" in t for t in labels) and any("1.00x BF16" in t for t in labels)
