"""``python -m minite.kernels.sm90_compile_rollout``: compile the rollout-path kernels (decode and full-sequence
attention, the batch-invariant BF16 GEMM) for sm_90 without a GPU, as ``sm90_compile`` does for the W4A4
GEMMs, and print registers / spills (``cuobjdump -res-usage`` on the cubin), shared memory and the MMA /
cp.async counts. Fails on a kernel that does not build, does not fit an H200's shared memory, or spills
where it should not (the fp64 attention kernels are register-bound by design: spills there are reported,
and fail only above SPILL_LIMIT bytes). Where nvcc is installed, also the CUDA decode attention
(``decode_attention.cu``, each head dim: registers and spills from ptxas, its fp64 mma count from the SASS;
a spill fails it)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

from .sm90_compile import SMEM_LIMIT, compile_one, nvcc_sm90

SPILL_LIMIT = 256  # stack bytes (spills) a kernel may use (the 16-row GQA group spills a little)

STRIDES = ("sq_b", "sq_h", "sq_t", "sk_slot", "sk_head", "sk_seq", "sv_slot", "sv_head", "sv_seq", "sk_b", "sk_h",
           "sk_t", "sv_b", "sv_h", "sv_t", "so_b", "so_t", "so_h", "skeep_q", "sxm", "swn", "N", "K", "k_per_split")


def kernels():
    """(name, fn, types, consts, num_warps, num_stages) for every kernel and config the launchers use."""
    from . import _triton_attention as ta
    from . import _triton_hp_gemm as th
    from . import attention as A
    from . import hp_gemm as G
    att = dict(q="*bf16", k_cache="*bf16", v_cache="*bf16", slot_ids="*i32", seq_lens="*i32", part_acc="*fp64",
               part_ml="*fp64", scratch="*fp64", out="*bf16", scale_bits="i64", k="*bf16", v="*bf16", keep="*u8",
               scale_log2e="fp32")
    fast = dict(att, part_acc="*fp32", part_ml="*fp32")
    for d in (32, 64, 128):  # tiny, small, Qwen3-30B-A3B
        for bh in (1, 2, 4, 8, 16):
            yield (f"decode_f64 D{d} rows{bh}", ta.decode_f64_kernel, att,
                   dict(D=d, BH=bh, BN=A.F64_BN, BD=A.F64_BD, DIRECT=False, QK_STAGES=A.f64_qk_stages(bh),
                        PV_UNROLL=A.F64_PV["decode"][0], PV_MASKED=A.F64_PV["decode"][1]),
                   A._f64_decode_warps(bh, d), 1)
        yield (f"decode_f64 D{d} rows8 direct", ta.decode_f64_kernel, att,
               dict(D=d, BH=8, BN=A.F64_BN, BD=A.F64_BD, DIRECT=True, QK_STAGES=A.f64_qk_stages(8),
                    PV_UNROLL=A.F64_PV["decode"][0], PV_MASKED=A.F64_PV["decode"][1]),
               A._f64_decode_warps(8, d), 1)
        for bh in (16, 32):
            yield (f"decode_fast D{d} rows{bh}", ta.decode_fast_kernel, fast,
                   dict(D=d, BH=bh, BN=A.FAST_BN, DIRECT=False, UPCAST_DOT=False), 4, 2)
        for causal, keep in ((True, False), (True, True), (False, True)):
            yield (f"prefill_f64 D{d} causal={causal} keep={keep}", ta.prefill_f64_kernel, att,
                   dict(D=d, BM=A.PREFILL_BM, BN=A.F64_BN, BD=A.F64_BD, CAUSAL=causal, HAS_KEEP=keep,
                        QK_STAGES=A.f64_qk_stages(A.PREFILL_BM), PV_UNROLL=A.F64_PV["prefill"][0],
                        PV_MASKED=A.F64_PV["prefill"][1]), 1, 1)
        for f64, t in ((True, att), (False, fast)):
            yield (f"merge_splits D{d} f64={f64}", ta.merge_splits_kernel, t,
                   dict(D=d, SPLITS_P2=64, F64=f64), 1 if d <= 64 else 2, 1)
    mm = dict(x="*bf16", w="*bf16", bias="*bf16", out="*bf16", part="*fp32")
    for name in ("SAFE_CONFIG", "SMALL_CONFIG", "DECODE_CONFIG", "MID_CONFIG", "BIG_CONFIG"):
        cfg = dict(getattr(G, name))
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        for splits in (1, 8):
            yield (f"invariant_mm {name} split_k={splits}", th.invariant_mm_kernel, mm,
                   dict(cfg, HAS_BIAS=False, SPLIT_K=splits, BK=G.BK, UPCAST_DOT=False, sxk=1, swk=1), nw, ns)
    yield "split_k_sum", th.split_k_sum_kernel, mm, dict(HAS_BIAS=True, SPLIT_K=8, BLOCK=1024, ROUND_TO_X=False), 4, 1


def resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes: spills live there) of a cubin, from the cuobjdump that ships with Triton."""
    from triton import knobs
    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, local = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None, int(local.group(1)) if local else None)


def compile_cuda_attention() -> int:
    """nvcc -cubin of ``decode_attention.cu`` for sm_90; one line per instantiation. Returns the failures (0
    without nvcc: nothing to check)."""
    from . import _cuda_attention
    built = nvcc_sm90(_cuda_attention.SOURCE, "cuda decode attention")
    if built is None:
        return 0 if shutil.which("nvcc") is None else 1
    report, bodies = built
    bad = 0
    # ptxas -v prints, per entry: its name, then its spills, then its registers
    for name, spills, regs in re.findall(r"Compiling entry function '(\S+)'.*?(\d+) bytes spill stores.*?"
                                         r"Used (\d+) registers", report, re.S):
        d = re.search(r"ILi(\d+)E", name)
        ok = int(spills) == 0
        bad += not ok
        print(f"{'ok  ' if ok else 'SPIL'} cuda decode attention D{d.group(1) if d else '?'}: regs {regs} spill "
              f"bytes {spills} DMMA {bodies.get(name, '').count('DMMA')}")
    return bad


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    bad = 0
    for name, fn, types, consts, nw, ns in kernels():
        div = tuple(n for n in fn.arg_names if (types.get(n, "").startswith("*") or n in STRIDES) and n not in consts)
        try:
            k = compile_one(fn, types, consts, nw, ns, div)
        except Exception as exc:  # report every failure, then fail
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            bad += 1
            continue
        ptx = k.asm["ptx"]
        regs, local = resource_usage(k.asm["cubin"])
        smem = k.metadata.shared
        ok = smem <= SMEM_LIMIT and (local or 0) <= SPILL_LIMIT
        bad += not ok
        print(f"{'ok  ' if ok else 'BAD '} {name:42s} warps {nw} regs {regs} stack {local} B "
              f"smem {smem / 1024:6.1f} KB "
              f"wgmma {ptx.count('wgmma.mma_async'):3d} mma.sync {ptx.count('mma.sync'):3d} "
              f"cp.async {ptx.count('cp.async.cg') + ptx.count('cp.async.ca'):3d} fma.f64 {ptx.count('fma.rn.f64'):4d}",
              flush=True)
    bad += compile_cuda_attention()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
