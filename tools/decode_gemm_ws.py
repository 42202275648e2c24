"""Check, time and trace the chain-fed dense decode GEMM experiment (tools/decode_gemm_ws.cu) on a GPU.

    python tools/decode_gemm_ws.py check            # bits: every variant == nvfp4_gemm (the tree's kernel)
    python tools/decode_gemm_ws.py time [--rounds R] # CUDA-graph medians beside cuBLAS BF16 and nvfp4_gemm
    python tools/decode_gemm_ws.py trace            # clock64 per step of CTA 0 (consumer warp, producers)
    python tools/decode_gemm_ws.py source > f.cu    # the full source, for nvcc / SASS on a machine without a GPU

Variants are 10 x producers + steps per handoff (21 .. 34); ``--pdl`` launches them with programmatic dependent
launch (one `check` with it gave no result within its time limit, not diagnosed: docs/KERNELS_NOTES.md).
Shapes and timing as ``kernel-bench`` (its ``SHAPES`` and ``Timer``, weights rotated past L2)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from minite.kernels import _cuda_build
from minite.kernels.bench import L2_BYTES, SHAPES, Timer, _copies, on_copy
from minite.kernels.gemm import nvfp4_gemm, prepare_weight
from minite.kernels.quantize import quantize
from minite.kernels.weights import decode_layout
from torch.utils import cpp_extension

from minite import nvfp4 as ref

ROOT = Path(__file__).resolve().parents[1]
DECL = """int64_t ws_gemm_launch(int64_t a_codes, int64_t a_scales, int64_t ga, int64_t w_frag, int64_t w_scales,
 int64_t gw, int64_t bias, int64_t out, int64_t M, int64_t N, int64_t K, int64_t ga_row, int64_t gw_row,
 int64_t out_kind, int64_t nt, int64_t variant, int64_t pdl, int64_t trace, int64_t stream);"""
VARIANTS = (21, 31, 22, 32, 24, 34)
MS = (1, 2, 4, 8, 16)


def source() -> str:
    tree = _cuda_build.source_text(ROOT / "kernels" / "decode_gemm.cu")
    device_part = tree[:tree.index("// Host side: one instantiation")] + "}  // namespace minite_decode\n"
    return device_part + (ROOT / "tools" / "decode_gemm_ws.cu").read_text()


def build():
    cap = torch.cuda.get_device_capability()
    return cpp_extension.load_inline(name="decode_gemm_ws", cpp_sources=[DECL], cuda_sources=[source()],
                                     functions=["ws_gemm_launch"],
                                     extra_cuda_cflags=["-O3", _cuda_build.arch_flag(cap)])


def launch(mod, a, pw, out, bias, variant, pdl, trace=None):
    m, k = a.shape
    n = pw.w.shape[0]
    ga, gw = a.global_scale, pw.w.global_scale
    rc = mod.ws_gemm_launch(a.codes.data_ptr(), a.scales.data_ptr(), ga.data_ptr(), pw.frag.data_ptr(),
                            pw.w.scales.data_ptr(), gw.data_ptr(), 0 if bias is None else bias.data_ptr(),
                            out.data_ptr(), m, n, k, int(ga.numel() > 1), int(gw.numel() > 1),
                            {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[out.dtype], 1 if m <= 8 else 2,
                            variant, pdl, 0 if trace is None else trace.data_ptr(),
                            torch.cuda.current_stream().cuda_stream)
    if rc != 0:
        raise RuntimeError(f"launch failed ({rc}) for variant {variant}")
    return out


def weight(n, k, dev):
    w = quantize(torch.randn(n, k, device=dev))
    return w, decode_layout(prepare_weight(w))


def tokens(m, k, dev):
    return quantize(torch.randn(m, k, device=dev), scaling="row")


def check(mod, pdl, dev):
    equal = total = 0
    for name, n, k in [*SHAPES, ("odd", 48, 2176)]:
        _, pw = weight(n, k, dev)
        for m in (*MS, 3, 9, 13):
            a = tokens(m, k, dev)
            for dt, bias in ((torch.bfloat16, None), (torch.float32, torch.randn(n, device=dev))):
                want = nvfp4_gemm(a, pw, out_dtype=dt, bias=bias)
                for v in VARIANTS:
                    got = launch(mod, a, pw, torch.empty(m, n, device=dev, dtype=dt), bias, v, pdl)
                    total += 1
                    if torch.equal(got, want):
                        equal += 1
                    else:
                        print(f"MISMATCH {name} M={m} {dt} variant {v}", flush=True)
    print(f"bits: {equal} of {total} launches equal to nvfp4_gemm", flush=True)
    return equal == total


def time_all(mod, pdl, rounds, rep, dev):
    timer = Timer(graph=True, rep=rep)
    keys = ["cublas_bf16", "nvfp4_gemm", *(f"ws{v}" for v in VARIANTS)]
    res: dict = {}
    for _ in range(rounds):
        for name, n, k in SHAPES:
            w, pw = weight(n, k, dev)
            w16 = ref.dequantize(w).bfloat16()
            for m in MS:
                a = tokens(m, k, dev)
                a16 = ref.dequantize(a).bfloat16()
                nb, nb16 = n * k // 2 + n * k // 16, n * k * 2
                rot, rot16 = (max(1, min(64, math.ceil(2 * L2_BYTES / b))) for b in (nb, nb16))
                sets = [(a, q) for q in _copies(pw, rot)]
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                ms = {"cublas_bf16": timer(on_copy(list(zip(_copies(a16, rot16), _copies(w16, rot16), strict=True)),
                                                   lambda x, y: torch.matmul(x, y.T)), nb16),
                      "nvfp4_gemm": timer(on_copy(sets, nvfp4_gemm), nb)}
                for v in VARIANTS:
                    ms[f"ws{v}"] = timer(on_copy(sets, lambda x, y, v=v, o=out: launch(mod, x, y, o, None, v, pdl)), nb)
                for key in keys:
                    res.setdefault((name, m, key), []).append(ms[key] * 1e3)
    print("us (median of rounds); geomean of cuBLAS / provider over the points")
    logs = {key: [] for key in keys}
    for name, _, _ in SHAPES:
        for m in MS:
            med = {key: sorted(res[(name, m, key)])[len(res[(name, m, key)]) // 2] for key in keys}
            for key in keys:
                logs[key].append(math.log(med["cublas_bf16"] / med[key]))
            print(f"{name:15s} M={m:3d} " + " ".join(f"{key} {med[key]:6.2f}" for key in keys), flush=True)
    for key in keys:
        print(f"geomean cuBLAS / {key}: {math.exp(sum(logs[key]) / len(logs[key])):.3f}x")


def trace(mod, dev):
    for name, n, k in (("k_proj", 512, 2048), ("o_proj", 2048, 4096)):
        _, pw = weight(n, k, dev)
        a = tokens(1, k, dev)
        want = nvfp4_gemm(a, pw)
        for v in VARIANTS:
            producers, unit = divmod(v, 10)
            tr = torch.zeros((1 + producers) * 64 * 4, dtype=torch.int64, device=dev)
            out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
            for i in range(3):  # the last of three, each after a fill that evicts L2
                tr.zero_()
                torch.empty(200 * 2 ** 20, dtype=torch.uint8, device=dev).fill_(i)
                launch(mod, a, pw, out, None, v, 0, tr)
            torch.cuda.synchronize()
            t = tr.view(1 + producers, 64, 4).cpu()
            steps = min(k // 128, 24)
            print(f"\n== {name} M=1 variant {v}: equal {torch.equal(out, want)}; clock64 cycles from CTA 0's start")
            end = int(t[0, min(k // 128, 63), 3])
            print(f"consumer (unit start: wait begins / wait ends; every step: chain starts), end {end}")
            print("  " + " ".join(f"{s}:{int(t[0, s, 0])}/{int(t[0, s, 1])}/{int(t[0, s, 2])}" for s in range(steps)))
            for pi in range(producers):
                mine = [s for s in range(steps) if (s // unit) % producers == pi]
                print(f"producer {pi} (decoded / empty wait begins / ends / stored and arrived)")
                print("  " + " ".join(f"{s}:" + "/".join(str(int(x)) for x in t[1 + pi, s]) for s in mine))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["check", "time", "trace", "source"])
    p.add_argument("--pdl", action="store_true", help="launch with programmatic dependent launch")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rep", type=float, default=25.0, help="ms of timed repeats per point")
    args = p.parse_args()
    if args.what == "source":
        print("#include <cstdint>\n" + source())
        return
    dev = torch.device("cuda")
    mod = build()
    if args.what == "check":
        raise SystemExit(0 if check(mod, int(args.pdl), dev) else 1)
    if args.what == "time":
        time_all(mod, int(args.pdl), args.rounds, args.rep, dev)
    else:
        trace(mod, dev)


if __name__ == "__main__":
    main()
