"""The CUDA kernels' build: a build killed mid-way (torch's lock file left behind) does not make the next build
wait forever, a live build is waited for, not broken into; a shared header is part of the source text built."""
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from minite.kernels import _cuda_build

pytest.importorskip("fcntl")

HOLDER = """
import sys, time
from pathlib import Path
from minite.kernels._cuda_build import build_guard
with build_guard(Path(sys.argv[1])) as d:
    (d / "lock").touch()          # what torch's FileBaton creates while it builds
    print("building", flush=True)
    sys.stdin.readline()          # builds until told to stop (or killed)
    (d / "lock").unlink()
"""


def _holder(build_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(build_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "building"
    return proc


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    proc = _holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (tmp_path / "lock").exists()
    with pytest.warns(RuntimeWarning, match="interrupted"), _cuda_build.build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_build_is_waited_for(tmp_path):
    proc = _holder(tmp_path)
    entered = threading.Event()

    def second_build():
        with _cuda_build.build_guard(tmp_path):
            entered.set()

    waiter = threading.Thread(target=second_build)
    waiter.start()
    try:
        time.sleep(0.5)
        assert not entered.is_set() and (tmp_path / "lock").exists()   # the live build's lock is kept
    finally:
        proc.communicate("done\n", timeout=30)
    waiter.join(timeout=30)
    assert entered.is_set() and not (tmp_path / "lock").exists()


def test_a_local_header_is_pasted_into_the_source_built(tmp_path):
    (tmp_path / "common.cuh").write_text("// shared v1\nint shared();\n")
    src = tmp_path / "k.cu"
    src.write_text('#include <cstdint>\n#include "common.cuh"\nint k();\n')
    text = _cuda_build.source_text(src)
    assert text == "#include <cstdint>\n// shared v1\nint shared();\n\nint k();\n"
    (tmp_path / "common.cuh").write_text("// shared v2\nint shared();\n")
    assert _cuda_build.source_text(src) != text  # a header change changes what load_inline hashes: a rebuild


@pytest.mark.parametrize("name", ["decode_gemm.cu", "decode_attention.cu"])
def test_the_kernel_sources_built_hold_the_shared_header(name):
    text = _cuda_build.source_text(Path(_cuda_build.__file__).with_name(name))
    assert '#include "' not in text and "namespace minite_cuda" in text and "minite_cuda::launch<" in text
