"""Markdown summary of a kernels.csv run: the four target ratios, then the tables."""
from __future__ import annotations

import math
import re

import pandas as pd


def _geo(xs):
    xs = [x for x in xs if x == x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def ratios(df: pd.DataFrame, ours: str = "ours") -> list[tuple[str, float, float, float, str]]:
    """(what, geomean, min, max, target) of per-shape speed ratios ours / baseline (same shape, same M)."""
    dense = df[df.kernel == "gemm"].pivot_table(index=["shape", "M"], columns="provider", values="median_ms")
    out = []

    def add(what, sel, base, target):
        if base not in dense or ours not in dense:
            return
        r = (dense.loc[sel, base] / dense.loc[sel, ours]).dropna()
        if len(r):
            out.append((what, _geo(r), r.min(), r.max(), target, len(r)))
    ms = dense.index.get_level_values("M")
    add(f"{ours} vs cuBLAS bf16, M >= 4096", ms >= 4096, "cublas_bf16", ">= 0.90")
    add(f"{ours} vs cuBLAS bf16, M <= 16 (decode)", ms <= 16, "cublas_bf16", ">= 2.0")
    add(f"{ours} vs naive emulation, M <= 1024", ms <= 1024, "naive_emulation", ">= 2.0")
    add(f"{ours} vs naive emulation, M >= 4096", ms >= 4096, "naive_emulation", ">= 1.1")
    g = df[df.kernel == "grouped_gemm"].pivot_table(index=["shape"], columns="provider", values="median_ms")
    if "grouped_mm_bf16" in g and ours in g:
        for what, tokens, target in (("<= 64 tokens (decode)", lambda t: t <= 64, ">= 2.0"),
                                     ("16384 tokens", lambda t: t == 16384, ">= 0.85")):
            sel = [s for s in g.index if tokens(_tokens(s))]
            r = (g.loc[sel, "grouped_mm_bf16"] / g.loc[sel, ours]).dropna()
            if len(r):
                out.append((f"{ours} vs torch._grouped_mm bf16, 128 experts top-8, {what}", _geo(r), r.min(),
                            r.max(), target, len(r)))
    return out


def ours_providers(df: pd.DataFrame) -> list[str]:
    """ours, ours_prepared, then their twins under the K-chunk contract (``kernel-bench --k-chunk``) if timed."""
    kc = sorted(p for p in set(df.provider) if re.fullmatch(r"ours(_prepared)?_kc\d+", p))
    return ["ours", "ours_prepared"] + kc


def _tokens(shape: str) -> int:
    """Token count of a grouped shape label ``<name>_E<e>top<k>_T<tokens>``."""
    return int(shape.rsplit("_T", 1)[1])


def _config_column(d: pd.DataFrame, index: list[str]) -> pd.Series | None:
    """The kernel config ``ours`` ran at each point (rows written before the column existed have none)."""
    if "config" not in d:
        return None
    ours = d[d.provider == "ours"].set_index(index)["config"]
    return ours[~ours.index.duplicated()]


def _speed_table(d: pd.DataFrame, baseline: str, label: str) -> str:
    """Per (shape, M): microseconds and GB/s of the baseline and of ours (packed, prepared), ours' speed vs
    the baseline, and the kernel config ours ran."""
    if not len(d):
        return ""
    t = d.pivot_table(index=["shape", "M"], columns="provider", values=["median_ms", "gbps"])
    out = pd.DataFrame(index=t.index)
    for p in [baseline] + ours_providers(d):
        if ("median_ms", p) in t:
            out[f"{p} us"] = (t["median_ms", p] * 1e3).round(2)
            out[f"{p} GB/s"] = t["gbps", p].round(0)
    if f"{baseline} us" in out and "ours us" in out:
        out[f"ours speed vs {label}"] = (out[f"{baseline} us"] / out["ours us"]).round(2)
    config = _config_column(d, ["shape", "M"])
    if config is not None:
        out["ours config"] = config.reindex(out.index)
    return out.to_markdown()


def decode_table(df: pd.DataFrame) -> str:
    """Dense M <= 64 against cuBLAS bf16 (``_speed_table``)."""
    d = df[(df.kernel == "gemm") & (df.M <= 64) & df.provider.isin(["cublas_bf16"] + ours_providers(df))]
    return _speed_table(d, "cublas_bf16", "cuBLAS")


def grouped_decode_table(df: pd.DataFrame) -> str:
    """Grouped GEMMs of <= 64 tokens against torch._grouped_mm bf16 (``_speed_table``)."""
    g = df[df.kernel == "grouped_gemm"]
    return _speed_table(g[g["shape"].map(_tokens) <= 64], "grouped_mm_bf16", "grouped_mm")


def summary(df: pd.DataFrame, prov: dict, check_lines: list[str], timer_kind: str,
            configs: dict | None = None) -> str:
    lines = ["# NVFP4 kernels on " + prov["device"], "",
             f"- sha: `{prov['sha']}`", f"- device: {prov['device']}", f"- command: `{prov['command']}`",
             f"- date: {prov['date']}", f"- torch: {prov['torch']}", f"- timing: medians of {timer_kind}, "
             "inputs rotated over copies > 2x L2 (60 MB)", "",
             "## Target ratios (speed = baseline time / our time; geomean over the shapes, min..max)", "",
             "| ratio | geomean | min | max | target | points |", "|---|---|---|---|---|---|"]
    for what, gm, lo, hi, tgt, npts in [r for p in ours_providers(df) for r in ratios(df, p)]:
        lines.append(f"| {what} | {gm:.2f} | {lo:.2f} | {hi:.2f} | {tgt} | {npts} |")
    lines += ["", "## Checks (this run, before timing)", ""] + (check_lines or ["- skipped"])
    if configs is not None:
        lines += ["", "GEMM configs probed bit-equal to the safe config on this GPU (used by M bucket when true): "
                  + (", ".join(f"`{k}`: {v}" for k, v in configs.items()) or "none probed")]
    dec = decode_table(df)
    if dec:
        lines += ["", "## Decode regime, dense M <= 64 (us, GB/s of the bytes moved, speed vs cuBLAS bf16)", "", dec]
    gdec = grouped_decode_table(df)
    if gdec:
        lines += ["", "## Decode regime, grouped (128 experts, top-8, <= 64 tokens)", "", gdec]
    main = df[(df.kernel == "gemm") & ~df.provider.str.contains(":")]
    dense = main.pivot_table(index=["shape", "N", "K", "M"], columns="provider", values="tflops")
    lines += ["", "## Dense GEMM, TFLOP/s", "", dense.round(1).to_markdown()]
    sweep = df[(df.kernel == "gemm") & df.provider.str.contains(":")]
    if len(sweep):
        t = sweep.pivot_table(index="provider", columns=["shape", "M"], values="tflops")
        lines += ["", "## Tile-config sweep of ours (variant:BMxBN w=warps s=stages), TFLOP/s", "",
                  t.round(1).to_markdown()]
    qz = df[df.kernel == "quantize"]
    if len(qz):
        lines += ["", "## Activation quantizer (row scaling, RNE, bf16 in), GB/s", "",
                  qz.pivot_table(index=["M", "K"], columns="provider", values="gbps").round(0).to_markdown()]
    grp = df[df.kernel == "grouped_gemm"].pivot_table(index=["shape", "M", "N", "K"], columns="provider",
                                                       values="tflops")
    if len(grp):
        lines += ["", "## Grouped GEMM (MoE), TFLOP/s", "", grp.round(1).to_markdown()]
    return "\n".join(lines) + "\n"
