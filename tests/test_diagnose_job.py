"""The diagnose CLI job: the documented files and keys, and no stale attribution left from an earlier run."""
import json
import logging

from minite.cli import main

KEYS = {"k1", "k3", "chi2", "token_mult_prob_error", "max_abs_dp", "mean_abs_dp", "pearson_p",
        "frac_dlogp_gt_0.1", "n_tokens"}


def test_diagnose_without_attribution_clears_stale_attribution(tmp_path, caplog):
    out = tmp_path / "diag"
    out.mkdir()
    for name in ("attribution.csv", "attribution_subsets.csv", "attribution_waterfall.png"):
        (out / name).write_text("stale, from an older run\n")
    rc = main(["diagnose", "--arm", "minite_nvfp4", "--model", "tiny", "--device", "cpu", "--prompts", "2",
               "--max-new-tokens", "3", "--attribution", "off", "--out", str(out)])
    assert rc == 0
    record = json.loads((out / "mismatch.json").read_text())
    assert KEYS <= set(record) and record["n_tokens"] > 0
    assert record["k3"] == 0.0  # the aligned arm: identical ops in both engines on CPU
    assert (out / "layers.csv").stat().st_size > 0
    assert not any((out / n).exists() for n in ("attribution.csv", "attribution_subsets.csv",
                                                "attribution_waterfall.png"))
    assert not list(out.glob("*.png")) and not list(out.glob("*.pdf"))   # figures are the pipeline's
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "RANDOM INIT" in warned[0].getMessage()  # no --checkpoint: said loudly
    assert record["settings"]["task"]["kind"] == "arithmetic"             # the default task's prompts
