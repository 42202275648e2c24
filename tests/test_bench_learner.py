"""bench-learner: the JSON it writes, and clear errors with no file on bad input."""
import json

import pytest

from minite.cli import main

KEYS = {"tokens_per_s", "step_ms", "step_ms_all", "step_ms_stats", "step_split_ms", "peak_mem_gb", "telemetry",
        "model", "layers", "arm", "device", "sha", "command", "date", "note", "tokens_per_update", "torch", "triton",
        "gpu_driver"}


# weights quantized per update (one forward): 2 layers x (q/k/v/o + 2 expert tensors), + the router per layer
# for the blanket te.Linear swap (the naive arm keeps it BF16, as Megatron-core does)
@pytest.mark.parametrize("arm, quantized", [("naive_te_nvfp4", 12), ("naive_te_nvfp4_blanket", 14)])
def test_bench_learner_writes_json(tmp_path, arm, quantized):
    out = tmp_path / "learner.json"
    rc = main(["bench-learner", "--arm", arm, "--model", "tiny", "--steps", "2", "--warmup", "0",
               "--tokens-per-update", "64", "--seq-len", "32", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert KEYS <= set(d)
    assert d["arm"] == arm and d["model"] == "tiny" and d["layers"] == 2
    assert d["tokens_per_update"] == 64 and len(d["step_ms_all"]) == 2
    assert d["tokens_per_s"] == pytest.approx(64 / (d["step_ms"] / 1e3))
    stats = d["step_ms_stats"]                                        # the spread of the timed steps
    assert stats["n"] == 2 and stats["median"] == pytest.approx(d["step_ms"])
    assert stats["min"] == min(d["step_ms_all"]) <= stats["q25"] <= stats["q75"] <= stats["max"]
    assert d["step_split_ms"]["optimizer"] > 0 and d["peak_mem_gb"] > 0
    # the split comes from two more updates that time the quantize / GEMM blocks (the timed ones do not)
    assert d["step_split_steps"] == 2 and d["step_split_step_ms"] > 0
    assert d["step_split_ms"]["quantize"] > 0 and d["step_split_ms"]["gemm"] > 0
    assert d["telemetry"]["note"] and "Hopper" in d["note"]
    assert d["weight_quantizations_per_update"] == quantized          # re-quantized every forward


@pytest.mark.parametrize("flag", ["--torch-profile", "--profile"])   # --profile: the old spelling, hidden
def test_bench_learner_profile_csv(tmp_path, flag):
    import pandas as pd
    out, prof = tmp_path / "learner.json", tmp_path / "profile.csv"
    rc = main(["bench-learner", "--arm", "minite_nvfp4", "--model", "tiny", "--steps", "1", "--warmup", "0",
               "--tokens-per-update", "64", "--seq-len", "32", "--device", "cpu", flag, str(prof),
               "--out", str(out)])
    assert rc == 0 and out.is_file()
    assert json.loads(out.read_text())["torch_profile"] == str(prof)      # outside the repository: as given
    df = pd.read_csv(prof)
    assert list(df.columns) == ["arm", "name", "calls", "self_device_ms", "own_device_ms", "device_ms",
                                "self_cpu_ms", "cpu_ms", "sha", "device"]
    ranges = set(df.loc[df["name"].str.startswith("minite."), "name"])
    assert {"minite.quantize.weight", "minite.quantize.act", "minite.quantize.grad", "minite.gemm"} <= ranges
    assert (df["calls"] > 0).all() and df["cpu_ms"].max() > 0 and (df["arm"] == "minite_nvfp4").all()


@pytest.mark.parametrize("args,msg", [(["--arm", "fp3"], "unknown arm"), (["--arm", "bf16", "--model", "gpt5"],
                                      "unknown model"),
                                     (["--arm", "bf16", "--seq-len", "30", "--tokens-per-update", "64"], "multiple")])
def test_bench_learner_bad_input_writes_nothing(tmp_path, capsys, args, msg):
    out = tmp_path / "x.json"
    assert main(["bench-learner", *args, "--out", str(out)]) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()


def test_bench_learner_help_names_torch_profile_only(capsys):
    with pytest.raises(SystemExit):
        main(["bench-learner", "--help"])
    text = capsys.readouterr().out
    assert "--torch-profile CSV" in text and "--profile" not in text.replace("--torch-profile", "")


def test_timing_summary():
    from minite.telemetry import timing_summary
    t = timing_summary([4.0, 1.0, 3.0, 2.0, 100.0])
    assert t == {"n": 5, "median": 3.0, "q25": 2.0, "q75": 4.0, "min": 1.0, "max": 100.0, "spread": 2.0 / 3.0}
    assert timing_summary([5.0])["spread"] == 0.0
    with pytest.raises(ValueError, match="no timings"):
        timing_summary([])


def test_copy_bandwidth_is_the_summary_of_repeated_copies(monkeypatch):
    """Each timing covers ``iters`` copies of ``nbytes`` (read + written): with a host clock that advances 1 s
    per timing, every sample is 2 nbytes iters / 1e9 GB/s."""
    import minite.telemetry as T
    clock = iter(range(100))
    monkeypatch.setattr(T.time, "perf_counter", lambda: float(next(clock)))
    t = T.copy_bandwidth("cpu", nbytes=1000, iters=3, repeats=4)
    assert t["n"] == 4 and t["median"] == t["min"] == t["max"] == 2 * 1000 * 3 / 1e9 and t["spread"] == 0.0
    assert T.copy_bandwidth("cpu", nbytes=1 << 20, repeats=3)["median"] > 0


def test_gpu_busy_time_counts_overlapping_kernels_once():
    from minite.jobs.profiling import busy_ms
    # us: [0, 100) and [50, 150) overlap; [200, 250) apart; [210, 220) inside it
    assert busy_ms([(200, 250), (0, 100), (50, 150), (210, 220)]) == 0.2
    assert busy_ms([]) == 0.0


def test_own_device_time_leaves_out_the_wait_for_the_kernel_before():
    """A kernel launched with programmatic dependent launch starts inside the one before it (waiting there):
    its own time starts where that one ends; one that ends inside another adds nothing; the sum is the busy
    time."""
    from minite.jobs.profiling import busy_ms, own_ms
    # us: gemm [0, 100); cast starts at 80 (waits until 100), ends 130; next gemm starts at 120, ends 300;
    # a short kernel [150, 160) inside it; norm [400, 410) after a gap
    spans = [(120, 300, "gemm"), (0, 100, "gemm"), (80, 130, "cast"), (150, 160, "cast"), (400, 410, "norm")]
    own = own_ms(spans)
    assert own == {"gemm": 0.1 + 0.17, "cast": 0.03, "norm": 0.01}
    assert abs(sum(own.values()) - busy_ms([sp[:2] for sp in spans])) < 1e-12
    assert own_ms([]) == {}


def test_step_kernels_in_launch_order_with_their_own_times():
    """Steps cut at the marker kernel; the most common sequence kept, a tenth trimmed at each end; per position
    the median own time and duration."""
    from minite.jobs.profiling import step_kernels, steps_path
    spans, t = [], 0.0
    for i in range(12):  # marker 2 us, then gemm 10 us, then cast starting 3 us before the gemm ends
        gemm = 10.0 + (i == 5)  # one slow step: the medians ignore it
        spans += [(t, t + 2, "mark"), (t + 2, t + 2 + gemm, "gemm"), (t + gemm - 1, t + gemm + 4, "cast")]
        t += 20.0
    spans += [(t, t + 2, "mark"), (t + 2, t + 5, "other")]  # an odd last step (no next marker: not a step)
    table = step_kernels(spans, "mark")
    assert [r["name"] for r in table] == ["mark", "gemm", "cast"] and table[0]["steps"] == 10
    assert [r["own_us"] for r in table] == [2.0, 10.0, 2.0] and table[2]["duration_us"] == 5.0
    assert step_kernels(spans, "absent") is None
    assert steps_path("a/prof.csv") == "a/prof.steps.csv"
