"""kernels.quantize_bench on CPU: the Triton interpreter, tiny sizes, every case checked and called once
(no timing); the GPU run (``python -m minite.kernels.quantize_bench``) times the same cases."""
from __future__ import annotations

import pytest


@pytest.mark.slow
def test_bench_checks_and_calls_every_case_on_cpu(monkeypatch, capsys):
    from minite.kernels import quantize_bench as QB
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "triton")
    rows = QB.run("cpu", tokens=40, experts=3)
    assert [r["check"] for r in rows] == ["PASS"] * len(rows)
    names = " ".join(r["case"] for r in rows)
    for what in ("weights gate_up", "weights down", "act row", "act tensor", "dgrad", "wgrad dy^T SR+RHT",
                 "wgrad x^T RHT", "experts wgrad dy^T", "experts wgrad x^T", "experts act row"):
        assert what in names
    assert "| case | check |" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_bench_checks_pass_at_small_sizes():
    from minite.kernels import quantize_bench as QB
    rows = QB.run("cuda", repeats=1, iters=1, old=False, tokens=1000, experts=8)
    assert all(r["check"] == "PASS" for r in rows), [r for r in rows if r["check"] != "PASS"]
