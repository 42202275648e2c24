import os

import pytest
import torch

# Triton kernels run under the interpreter on CPU-only machines (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_dot_in_fixed_order():
    """The interpreter's tl.dot is numpy's fp32 matmul, whose summation order is the CPU's BLAS kernel's
    (OpenBLAS picks one per CPU model) and can differ between a product and its transpose; the tests compare
    kernel variants (the weight on either side of the dot) bit for bit. Here the dot sums in float64, exact
    for the products these kernels feed it (fp16 x fp16, short K), then rounds once to the accumulator's
    dtype: the same bits on every machine and in either orientation."""
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None:
        return
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype != np.float16 or b.data.dtype != np.float16 or d.data.dtype != np.float32:
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(exact + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _interpreter_dot_in_fixed_order()


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
