"""mismatch.json says what its numbers mean: the metric definitions travel with the results, and the files
get the mode a plain write would give them."""
import json
import os

from minite.cli import main
from minite.diagnostics.metrics import DEFINITIONS


def test_mismatch_json_carries_the_definitions(tmp_path):
    out = tmp_path / "diag"
    rc = main(["diagnose", "--arm", "bf16", "--model", "tiny", "--device", "cpu", "--prompts", "2",
               "--max-new-tokens", "2", "--attribution", "off", "--out", str(out)])
    assert rc == 0
    record = json.loads((out / "mismatch.json").read_text())
    assert record["definitions"] == json.loads(json.dumps(DEFINITIONS))    # one source, written as is
    assert record["definitions"]["first_divergence"]["threshold"] == record["settings"]["rounding_threshold"]
    metrics = [k for k, v in record.items() if isinstance(v, (int, float)) and k != "wall_s"]
    assert set(metrics) <= set(record["definitions"]), set(metrics) - set(record["definitions"])
    umask = os.umask(0)
    os.umask(umask)
    for name in ("mismatch.json", "layers.csv"):
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~umask      # not mkstemp's 0600
