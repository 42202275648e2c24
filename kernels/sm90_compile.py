"""``python -m minite.kernels.sm90_compile``: compile every GEMM config for sm_90 without a GPU (triton's own
ptxas), print registers / shared memory / spills / cp.async and wgmma counts, fail on a config that would not
fit an H200 (227 KB shared memory per block); then, where nvcc is installed, the CUDA decode kernel
(``decode_gemm.cu``, every instantiation: registers and spills from ptxas, and from its SASS the instructions
per K step of the main loop with their mix). Run before spending device time: the decode loop is bound by
its instruction issue (docs/KERNELS_NOTES.md), so the count per step predicts its speed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

SMEM_LIMIT = 232448  # bytes per block on sm_90


def _sig(fn, types: dict, consts: dict):
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else types.get(name, "i32")
    return sig


def compile_one(fn, types, consts, num_warps, num_stages, div16=()):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    # a constexpr left out takes its declared default; left as a runtime argument, its ``if`` would compile
    # every branch (K_GROUPED, W_KSEG and PDL were added after this tool's callers named their constants)
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn, _sig(fn, types, consts), consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _cuobjdump() -> str | None:
    """triton's bundled cuobjdump, else one on PATH, else None."""
    try:
        import triton
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    except ImportError:
        tool = ""
    return tool if os.path.exists(tool) else shutil.which("cuobjdump")


def _opcode(instr: str) -> str:
    """"@!P0 LOP3.LUT R1, ..." -> "LOP3"."""
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0].split(".")[0]


def main_loop(sass: str, hmma_per_step: int) -> tuple[float, dict] | None:
    """(instructions per K step, opcode counts per K step) of a kernel's main loop, from its SASS: the
    smallest loop (a backward branch and the code it jumps over) that issues HMMA; its K steps are its HMMAs
    over ``hmma_per_step``. None when no loop issues HMMA."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [_opcode(t) for a, t in ins if int(m.group(1), 16) <= a <= addr]
        if "HMMA" in body and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        return None
    steps = best.count("HMMA") / hmma_per_step
    ops = {op: best.count(op) / steps for op in sorted(set(best), key=lambda o: -best.count(o))}
    return len(best) / steps, ops


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, spill-store bytes) of a compiled kernel, from ``cuobjdump -res-usage`` (triton's bundled copy
    or one on PATH); (None, None) without one."""
    tool = _cuobjdump()
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, spill = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


def configs():
    from . import gemm as G
    yield "dense", dict(G.SAFE_CONFIG)
    for c in (G.SMALL_CONFIG, G.SMALL_ALT_CONFIG, G.MID_CONFIG, G.TALL_CONFIG, G.BIG_CONFIG):
        yield "dense", dict(c)
    from .bench import SWEEPS, GROUPED_SWEEP
    for cfgs in SWEEPS.values():
        for c in cfgs:
            yield "dense", dict(c)
    yield "grouped", dict(G.GROUPED_F16_CONFIG)
    yield "grouped", dict(G.GROUPED_FALLBACK)
    for c in GROUPED_SWEEP:
        yield "grouped", dict(c)


def nvcc_sm90(source, what: str) -> tuple[str, dict[str, str]] | None:
    """nvcc -cubin of a CUDA source for sm_90: (ptxas -v's report, each function's SASS by mangled name; empty
    without cuobjdump), or None after printing why (no nvcc: "skip", a build error: "FAIL")."""
    from ._cuda_build import arch_flag
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print(f"skip {what}: no nvcc on PATH")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        run = subprocess.run([nvcc, "-O3", arch_flag((9, 0)), "-cubin", "-Xptxas", "-v", "-o", cubin, str(source)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"FAIL {what}: {run.stderr[-1500:]}")
            return None
        tool = _cuobjdump()
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout if tool else ""
    # cuobjdump prints "Function : <name>" before each function's SASS
    return run.stderr, dict(re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S))


def compile_cuda() -> int:
    """nvcc -cubin of the CUDA decode kernel for sm_90; prints each instantiation's registers and spills, and
    (with cuobjdump) its main loop's instructions per K step. Returns the number of failures (0 when nvcc is
    absent: nothing to check)."""
    from . import _cuda_decode
    built = nvcc_sm90(_cuda_decode.SOURCE, "cuda decode kernel")
    if built is None:
        return 0 if shutil.which("nvcc") is None else 1
    report, bodies = built
    name = None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name, spills = m.group(1), 0
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            spills = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            t = re.search(r"ILi(\d+)ELi(\d+)ELb(\d)ELb(\d)ELb(\d)", name)
            label = (f"nt{t.group(1)} d{t.group(2)} {'grouped' if t.group(3) == '1' else 'dense'}"
                     f"{' rows' if t.group(4) == '1' else ''}{' frag' if t.group(5) == '1' else ''}") if t else name
            loop = main_loop(bodies.get(name, ""), 8 * int(t.group(1))) if t else None
            per_step = "" if loop is None else f"  main loop {loop[0]:.1f} instr / K step (" + ", ".join(
                f"{k} {v:g}" for k, v in list(loop[1].items())[:6]) + ")"
            print(f"{'ok  ' if spills == 0 else 'SPIL'} cuda decode {label:27s} regs {m.group(1)} spill bytes "
                  f"{spills}{per_step}")
            name = None
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m minite.kernels.sm90_compile")
    ap.add_argument("--k-chunk", type=int, default=0, help="compile under the K-chunk contract (gemm.k_chunk)")
    ap.add_argument("--only", default="", help="compile only configs whose name contains this")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA decode kernel")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    from . import _triton_gemm as tg
    from . import _triton_gemm_w32 as tw
    seen, bad = set(), 0
    for kind, cfg in configs():
        key = (kind, tuple(sorted(cfg.items())))
        if key in seen:
            continue
        seen.add(key)
        variant = cfg.pop("variant")
        if variant == "cuda":
            continue
        grouped = kind == "grouped"
        name = f"{kind} {variant}:{cfg['BM']}x{cfg['BN']}w{cfg['num_warps']}s{cfg['num_stages']}"
        if args.only not in name:
            continue
        common = dict(GA_ROW=True, GW_ROW=grouped, HAS_BIAS=not grouped, GROUPED=grouped, BM=cfg["BM"],
                      BN=cfg["BN"], BK=tg.BK, GROUP_M=1 if grouped else cfg.get("GROUP_M", 1), KC=args.k_chunk)
        if variant in ("decode32", "small", "w16w"):
            fn = tw.nvfp4_mm_w32_kernel
            wtype = "*fp16" if variant == "w16w" else "*i32"
            types = dict(a_words="*i32", a_scales="*i32", w_words=wtype, w_scales="*i32", ga_ptr="*fp32",
                         gw_ptr="*fp32", bias_ptr="*fp32", out_ptr="*bf16", tile_expert_ptr="*i32",
                         tile_row_ptr="*i32", offsets_ptr="*i32")
            consts = dict(common, SCALE_WORDS=True, SWAP=variant == "small", W_F16=variant == "w16w",
                          A_F16=variant == "small")
            if variant == "small":
                types["a_words"] = "*fp16"
            div = ("a_rs", "w_rs", "K", "N", "w_estride_c")
        else:
            fn = tg.nvfp4_mm_kernel
            at = "*fp16" if variant == "f16" else "*u8"
            wt = "*u8" if variant == "decode" else "*fp16"
            types = dict(a_codes=at, a_scales="*u8", w_codes=wt, w_scales="*u8", ga_ptr="*fp32", gw_ptr="*fp32",
                         bias_ptr="*fp32", out_ptr="*bf16", tile_expert_ptr="*i32", tile_row_ptr="*i32",
                         offsets_ptr="*i32")
            consts = dict(common, A_F16=variant == "f16", W_F16=variant != "decode")
            div = ("K", "N", "w_estride_c")
        div = tuple(n for n in fn.arg_names if n in types and types[n].startswith("*")) + div
        name += f" kc{args.k_chunk}" if args.k_chunk else ""
        try:
            k = compile_one(fn, types, consts, cfg["num_warps"], cfg["num_stages"], div)
        except Exception as exc:
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}")
            bad += 1
            continue
        ptx = k.asm["ptx"]
        smem = k.metadata.shared
        regs, spills = _resources(k.asm["cubin"])
        cp = ptx.count("cp.async.cg") + ptx.count("cp.async.ca")
        cp16 = ptx.count(", 16;") if cp else 0
        tma = ptx.count("cp.async.bulk")
        wg = ptx.count("wgmma.mma_async")
        mma = ptx.count("mma.sync")
        ok = smem <= SMEM_LIMIT
        bad += not ok
        print(f"{'ok  ' if ok else 'SMEM'} {name:34s} smem {smem / 1024:6.1f} KB  cp.async {cp:4d} (16B {cp16:3d}) "
              f"bulk {tma:3d} wgmma {wg:3d} mma.sync {mma:3d} regs {regs} stack {spills}", flush=True)
    if not args.no_cuda:
        bad += compile_cuda()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
