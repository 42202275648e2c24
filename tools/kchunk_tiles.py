"""What the K-chunk contract costs a large-M tile on sm_90 (a study, not used by minite): offline builds, and times.

Builds a plain fp16 GEMM tile (the form of the large-M path over pre-decoded operands, ``A_F16``) with triton's
own ptxas for sm_90 under three K orders, and prints, per tile: registers, stack (spills), shared memory, and
from the SASS the wgmma waits and the fp32 adds of the chunk sums:

* ``chain``: one fp32 chain over all of K (minite's default contract);
* ``nested``: K chunks as minite's Triton kernels write them (``_triton_gemm``: a loop over chunks, each chunk's
  sum from zero in an inner loop, then ``acc + part``);
* ``flat``: the same sums in one loop over K, the chunk's add and its reset under an ``if`` at the chunk's end.

Two accumulator tiles per warpgroup is what the contract asks of a kernel that keeps a whole K range: a
128 x 256 tile over two warpgroups holds 128 fp32 accumulator registers per thread, so two of them do not fit
the 255 registers of sm_90. Results in docs/KERNELS_NOTES.md ("The dense M <= 16 goal on the H200: what bounds it").

    PYTHONPATH=<a triton 3.6 site> python tools/kchunk_tiles.py build [--kc 512] [--tiles 128x256,128x128]
    python tools/kchunk_tiles.py time [--kc 512] [--rounds 3]      # on the H200: TFLOP/s beside cuBLAS BF16

``time`` first checks that the nested and flat forms give the same bits (they add the same sums in the same
order), then times every tile and form in interleaved rounds (CUDA-graph medians, kernel-bench's ``Timer``).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

FORMS = {"chain": 0, "nested": 1, "flat": 2}


@triton.jit
def tile_gemm(a, w, out, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr,
              FORM: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    ap = a + rm[:, None].to(tl.int64) * K + rk[None, :]
    wp = w + rn[:, None].to(tl.int64) * K + rk[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    if FORM == 0:
        for k in range(0, K, BK):
            acc = tl.dot(tl.load(ap + k), tl.trans(tl.load(wp + k)), acc)
    elif FORM == 1:
        for c0 in range(0, K, KC):
            part = tl.zeros((BM, BN), tl.float32)
            for k in range(c0, c0 + KC, BK):
                part = tl.dot(tl.load(ap + k), tl.trans(tl.load(wp + k)), part)
            acc = acc + part
    else:
        part = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            part = tl.dot(tl.load(ap + k), tl.trans(tl.load(wp + k)), part)
            if (k + BK) % KC == 0:
                acc = acc + part
                part = tl.zeros((BM, BN), tl.float32)
    tl.store(out + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(tl.bfloat16))


def build(bm: int, bn: int, kc: int, form: str, warps: int, stages: int):
    sig = dict(a="*fp16", w="*fp16", out="*bf16", N="i32", K="i32", BM="constexpr", BN="constexpr",
               BK="constexpr", KC="constexpr", FORM="constexpr")
    consts = dict(BM=bm, BN=bn, BK=64, KC=kc, FORM=FORMS[form])
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # pointers, N and K: 16-byte aligned
    return triton.compile(ASTSource(tile_gemm, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def launch(a, w, bm: int, bn: int, kc: int, form: str, warps: int = 8, stages: int = 4):
    """a [M, K] @ w[N, K].T -> bf16 [M, N] through one tile form (M, N, K multiples of the tile and of KC)."""
    import torch
    m, k = a.shape
    n = w.shape[0]
    if m % bm or n % bn or k % 64 or (form != "chain" and k % kc):
        raise ValueError(f"M={m}, N={n}, K={k} do not tile by {bm}x{bn}, BK 64, KC {kc}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    tile_gemm[(m // bm, n // bn)](a, w, out, n, k, BM=bm, BN=bn, BK=64, KC=kc if form != "chain" else 0,
                                  FORM=FORMS[form], num_warps=warps, num_stages=stages)
    return out


def _call(a, w, ab, wb, kc: int, form: str, bm: int, bn: int):
    """Timer's make(i): one call of a form (cuBLAS BF16 on the bf16 copies for "cublas")."""
    if form == "cublas":
        return lambda i: lambda: ab @ wb.T
    return lambda i: lambda: launch(a, w, bm, bn, kc, form)


def time_forms(kc: int, tiles: list[tuple[int, int]], rounds: int, rep: float) -> None:
    import statistics

    import torch
    from minite.kernels.bench import Timer
    timer = Timer(graph=True, rep=rep)
    shapes = [("square8192", 4096, 8192, 8192), ("square8192", 16384, 8192, 8192),
              ("q_proj", 16384, 4096, 2048), ("o_proj", 16384, 2048, 4096)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, KC {kc}")
    for name, m, n, k in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", generator=gen).half()
        w = torch.randn(n, k, device="cuda", generator=gen).half()
        nested, flat = (launch(a, w, 128, 128, kc, f) for f in ("nested", "flat"))
        if not torch.equal(nested.view(torch.int16), flat.view(torch.int16)):
            raise SystemExit(f"{name} M={m}: the nested and flat chunk forms differ")
        ab, wb = a.to(torch.bfloat16), w.to(torch.bfloat16)
        runs = [("cublas", 0, 0)] + [(f, bm, bn) for bm, bn in tiles for f in FORMS]
        calls = {r: _call(a, w, ab, wb, kc, *r) for r in runs}
        times: dict = {r: [] for r in runs}
        nbytes = (m * k + n * k + m * n) * 2  # above 2x L2 at every shape here: no copies to rotate
        for rnd in range(rounds):
            for r in runs[rnd % len(runs):] + runs[:rnd % len(runs)]:  # rotated: no form always first
                times[r].append(timer(calls[r], nbytes))
        for (form, bm, bn), ts in times.items():
            med = statistics.median(ts)
            label = "cuBLAS BF16" if form == "cublas" else f"{bm}x{bn} {form}"
            print(f"{name:11s} M={m:5d} N={n:4d} K={k:4d}  {label:16s} {med * 1e3:9.1f} us  "
                  f"{2 * m * n * k / med / 1e9:6.1f} TFLOP/s  (rounds {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} us)",
                  flush=True)


def build_forms(kc: int, tiles: list[tuple[int, int]]) -> None:
    print(f"triton {triton.__version__}, sm_90, BK 64, 8 warps, 4 stages, KC {kc}")
    for bm, bn in tiles:
        for form in FORMS:
            k = build(bm, bn, kc if form != "chain" else 0, form, 8, 4)
            res = cuobjdump(k.asm["cubin"], "-res-usage")
            sass = cuobjdump(k.asm["cubin"], "-sass")
            ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
            count = {p: sum(o.startswith(p) for o in ops) for p in ("HGMMA", "WARPGROUP.DEPBAR", "FADD", "LDL", "STL")}
            waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
            regs, stack = (re.search(rf"{key}:(\d+)", res).group(1) for key in ("REG", "STACK"))
            print(f"{bm}x{bn:<4d} {form:7s} regs {regs:>3s} stack {stack:>4s} B  smem {k.metadata.shared // 1024} KB  "
                  f"HGMMA {count['HGMMA']}  wgmma waits (keep <= n in flight) {','.join(waits) or '-'}  "
                  f"FADD {count['FADD']}  spill loads {count['LDL']} stores {count['STL']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/kchunk_tiles.py", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("build", "time"))
    ap.add_argument("--kc", type=int, default=512, help="chunk width (a multiple of 64)")
    ap.add_argument("--tiles", default="128x256,128x128", help="BMxBN tiles, comma separated (8 warps, 4 stages)")
    ap.add_argument("--rounds", type=int, default=3, help="time: interleaved rounds")
    ap.add_argument("--rep", type=float, default=60.0, help="time: ms of timed repeats per point")
    args = ap.parse_args(argv)
    if args.kc <= 0 or args.kc % 64:
        ap.error("--kc must be a positive multiple of 64")
    try:
        tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    except ValueError:
        ap.error(f"--tiles: BMxBN pairs, got {args.tiles!r}")
    if args.mode == "build":
        build_forms(args.kc, tiles)
    else:
        time_forms(args.kc, tiles, args.rounds, args.rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
