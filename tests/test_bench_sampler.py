"""bench-sampler on CPU (tiny): the JSON record, how weight bytes are counted, clear errors."""
import json
import logging

import pytest

from minite.cli import main


@pytest.mark.parametrize("arm", ["bf16", "minite_nvfp4"])
def test_bench_sampler_record(tmp_path, arm):
    out = tmp_path / "rollout.json"
    assert main(["bench-sampler", "--arm", arm, "--model", "tiny", "--batch", "3", "--prompt-len", "4",
                 "--new-tokens", "5", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["arm"] == arm and r["batch"] == 3 and r["step_ms"]["n"] == 4 and len(r["step_ms_all"]) == 4
    assert r["decode_tokens_per_s"] > 0 and r["prefill_ms"] > 0 and r["cuda_graphs"] is False
    assert 0 < r["roofline_frac"] and r["copy_bandwidth_gbs"] > 0 and r["sha"] and r["command"]
    assert r["roofline_tokens_per_s"] == pytest.approx(3 / (r["weight_bytes_per_step"] / (r["copy_bandwidth_gbs"]
                                                                                          * 1e9)))
    # tiny: hidden 128, 4 q + 2 kv heads x 32, 8 experts of gate/up 256 x 128 + down 128 x 128, vocab 32
    split, per_weight = r["weight_bytes_split"], (2 if arm == "bf16" else 0.5 + 1 / 16)
    assert split["attention"] == pytest.approx(2 * per_weight * (256 * 128 + 128 * 128), rel=0.05)
    assert split["lm_head"] == 32 * 128 * 2 and split["router"] == 2 * 8 * 128 * 2  # BF16 in every arm
    touched = r["experts_touched_per_step"]
    assert len(touched) == 2 and all(2 <= t <= 8 for t in touched)  # top-2 of 8, 3 rows
    assert split["experts"] == pytest.approx(sum(touched) * per_weight * 3 * 128 * 128, rel=0.05)
    ops = r["ops_per_decode_step"]
    assert len(ops["per_layer"]) == 2 and ops["per_step"] == sum(ops["per_layer"]) + ops["outside_layers"]
    assert "random init" in r["weights"]


def test_bench_sampler_torch_profile(tmp_path):
    """--torch-profile: one more generate under torch.profiler -> a CSV of its ops (long format, the learner's
    columns) and a summary in the JSON; the timed record is still there."""
    import pandas as pd
    out, prof = tmp_path / "rollout.json", tmp_path / "prof.csv"
    assert main(["bench-sampler", "--arm", "minite_nvfp4", "--model", "tiny", "--batch", "2", "--prompt-len", "4",
                 "--new-tokens", "3", "--torch-profile", str(prof), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["torch_profile"] == str(prof) and r["step_ms"]["n"] == 2
    assert r["torch_profile_generate"]["decode_steps"] == 2 and r["torch_profile_generate"]["wall_ms"] > 0
    df = pd.read_csv(prof)
    assert list(df.columns) == ["arm", "name", "calls", "self_device_ms", "own_device_ms", "device_ms",
                                "self_cpu_ms", "cpu_ms", "sha", "device"]
    assert len(df) > 5 and (df["calls"] > 0).all() and df["self_cpu_ms"].max() > 0
    assert (df["arm"] == "minite_nvfp4").all() and (df["sha"] == r["sha"]).all()


def test_bench_sampler_bad_input(tmp_path, caplog):
    out = tmp_path / "x.json"
    assert main(["bench-sampler", "--arm", "bf16", "--model", "tiny", "--new-tokens", "1", "--out", str(out)]) == 2
    assert main(["bench-sampler", "--arm", "nope", "--model", "tiny", "--out", str(out)]) == 2
    assert main(["bench-sampler", "--arm", "bf16", "--model", "tiny", "--prompt-len", "100", "--new-tokens", "64",
                 "--out", str(out)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not out.exists() and len(errors) == 3
    assert "new-tokens" in errors[0] and "nope" in errors[1] and "max_position_embeddings" in errors[2]
