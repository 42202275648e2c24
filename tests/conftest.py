import os

import pytest
import torch

# Triton kernels run under the interpreter on CPU-only machines (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def paced_minite(tmp_path):
    """A script that runs ``python -m minite ARGS`` with a pause after each RL step's log line (before its
    checkpoint), so a test's kill -9 lands mid-run however fast the steps are on an idle machine."""
    script = tmp_path / "paced_minite.py"
    script.write_text("import sys, time\n"
                      "import minite.rl.stability as stability\n"
                      "stability._after_step = lambda step: time.sleep(1.0)\n"
                      "from minite.cli import main\n"
                      "raise SystemExit(main(sys.argv[1:]))\n")
    return str(script)
