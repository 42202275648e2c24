"""What the K-chunk contract costs a large-M tile on sm_90, without a GPU (an offline study, not used by minite).

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

    PYTHONPATH=<a triton 3.6 site> python tools/kchunk_tiles.py [--kc 512] [--tiles 128x256,128x128]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/kchunk_tiles.py", description=__doc__.splitlines()[0])
    ap.add_argument("--kc", type=int, default=512, help="chunk width (a multiple of 64)")
    ap.add_argument("--tiles", default="128x256,128x128", help="BMxBN tiles, comma separated (8 warps, 4 stages)")
    args = ap.parse_args(argv)
    if args.kc <= 0 or args.kc % 64:
        ap.error("--kc must be a positive multiple of 64")
    print(f"triton {triton.__version__}, sm_90, BK 64, 8 warps, 4 stages, KC {args.kc}")
    for tile in args.tiles.split(","):
        bm, bn = (int(x) for x in tile.split("x"))
        for form in FORMS:
            k = build(bm, bn, args.kc if form != "chain" else 0, form, 8, 4)
            res = cuobjdump(k.asm["cubin"], "-res-usage")
            sass = cuobjdump(k.asm["cubin"], "-sass")
            ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
            count = {p: sum(o.startswith(p) for o in ops) for p in ("HGMMA", "WARPGROUP.DEPBAR", "FADD", "LDL", "STL")}
            waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
            regs, stack = (re.search(rf"{key}:(\d+)", res).group(1) for key in ("REG", "STACK"))
            print(f"{tile:8s} {form:7s} regs {regs:>3s} stack {stack:>4s} B  smem {k.metadata.shared // 1024} KB  "
                  f"HGMMA {count['HGMMA']}  wgmma waits (keep <= n in flight) {','.join(waits) or '-'}  "
                  f"FADD {count['FADD']}  spill loads {count['LDL']} stores {count['STL']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
