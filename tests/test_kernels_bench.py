"""The bench pipeline (CPU dry run: every provider called once, CSV + summary written) and its CLI job."""
import pandas as pd
from minite.kernels import report

from minite.cli import main


def test_kernel_bench_dry_run_writes_csv_and_summary(tmp_path):
    out = tmp_path / "kernels.csv"
    assert main(["kernel-bench", "--dry-run", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    need = {"kernel", "provider", "M", "N", "K", "median_ms", "tflops", "gbps", "device", "sha", "command", "date"}
    assert need <= set(df.columns)
    assert {"gemm", "grouped_gemm", "quantize"} <= set(df.kernel)
    assert {"cublas_bf16", "naive_emulation", "ours", "ours_prepared"} <= set(df.provider)
    ours = df[df.provider.isin(["ours", "ours_prepared"]) & (df.kernel != "quantize")]
    assert ours.config.notna().all() and (ours.config != "").all()  # the kernel config each point ran
    md = out.with_suffix(".md").read_text()
    assert "sha:" in md and "command:" in md and "dry run" in md
    assert "ours config" in md  # the decode tables name it


def test_ratios_are_speed_ratios():
    rows = []
    for m, base, ours in ((1, 3.0, 1.0), (16, 6.0, 1.0), (4096, 1.0, 2.0)):
        rows += [dict(kernel="gemm", provider="cublas_bf16", shape="s", M=m, median_ms=base),
                 dict(kernel="gemm", provider="ours", shape="s", M=m, median_ms=ours)]
    r = {what: gm for what, gm, *_ in report.ratios(pd.DataFrame(rows))}
    assert abs(r["ours vs cuBLAS bf16, M <= 16 (decode)"] - (3.0 * 6.0) ** 0.5) < 1e-9
    assert abs(r["ours vs cuBLAS bf16, M >= 4096"] - 0.5) < 1e-9


def test_every_provider_takes_as_many_input_copies_as_the_timer_asks(tmp_path, monkeypatch, capsys):
    """The GPU timer rotates over up to 64 input copies (working set > 2x L2) however many a provider made
    (grouped ones make at most 16): copy i must always exist."""
    from minite.kernels import bench

    def rotating_timer(make, nbytes):
        for i in (0, 15, 16, 63):
            make(i)()
        return float("nan")
    monkeypatch.setattr(bench, "_dry_timer", rotating_timer)
    assert main(["kernel-bench", "--dry-run", "--out", str(tmp_path / "k.csv")]) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_k_chunk_twins_are_timed_beside_ours_under_their_contract(tmp_path, monkeypatch):
    """``--k-chunk KC``: every ours provider gets a twin right after it whose calls run under the K-chunk
    contract (and only those: the contract is back to the environment's after each call); the summary gives
    the twins' target ratios too."""
    from minite.kernels import bench
    from minite.kernels import gemm as G
    seen = []
    real = bench.nvfp4_gemm

    def spy(*args, **kwargs):
        seen.append(G.k_chunk())
        return real(*args, **kwargs)
    monkeypatch.setattr(bench, "nvfp4_gemm", spy)
    monkeypatch.delenv(G.K_CHUNK_ENV, raising=False)
    out = tmp_path / "k.csv"
    assert main(["kernel-bench", "--dry-run", "--k-chunk", "512", "--out", str(out)]) == 0
    assert G.k_chunk() == 0
    df = pd.read_csv(out)
    dense = df[df.kernel == "gemm"]
    assert dense[dense.M == 1].provider.tolist() == ["cublas_bf16", "fp8_scaled_mm", "naive_emulation", "ours",
                                                     "ours_kc512", "ours_prepared", "ours_prepared_kc512"]
    assert {"ours_kc512", "ours_prepared_kc512"} <= set(df[df.kernel == "grouped_gemm"].provider)
    assert sorted(set(seen)) == [0, 512] and seen.count(512) == seen.count(0)  # each twin: one call per point
    assert main(["kernel-bench", "--dry-run", "--k-chunk", "96", "--out", str(tmp_path / "bad.csv")]) == 2

    rows = []
    for m, base, ours, kc in ((1, 4.0, 2.0, 1.0), (4096, 1.0, 1.0, 2.0)):
        rows += [dict(kernel="gemm", provider=p, shape="s", M=m, N=8, K=8, median_ms=t, tflops=1.0, gbps=1.0)
                 for p, t in (("cublas_bf16", base), ("ours", ours), ("ours_kc512", kc))]
    md = report.summary(pd.DataFrame(rows), dict(device="d", sha="s", command="c", date="t", torch="x"), [], "t")
    assert "| ours_kc512 vs cuBLAS bf16, M <= 16 (decode) | 4.00 |" in md
    assert "| ours_kc512 vs cuBLAS bf16, M >= 4096 | 0.50 |" in md and "| ours vs cuBLAS bf16, M >= 4096 | 1.00 |" in md


def test_decode_checks_cover_both_contracts_and_the_prepared_weight():
    """The checks kernel-bench runs before timing (here on the exact CPU path): decode rows from the plain and
    the prepared (fragment-order) weight under one chain and, with ``--k-chunk``, under K chunks."""
    import torch
    from minite.kernels import bench
    lines = bench.decode_checks(torch.device("cpu"), 512)
    dense = [ln for ln in lines if "decode batch invariance" in ln or "prepared weight" in ln]
    assert len(dense) == 8 and sum("K chunks of 512" in ln for ln in dense) == 4
    assert all(ln.startswith("- PASS") for ln in lines if ln.startswith("- ") and "configs probed" not in ln)
