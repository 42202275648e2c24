"""``python -m minite.kernels.quantize_bench``: check, then time, the fused NVFP4 quantizers at learner sizes.

The sizes are the learner's: the 2-layer Qwen3-30B-A3B slice at 16 x 2048 tokens per update (hidden 2048,
128 experts of gate_up [1536, 2048] and down [2048, 768], top-8: 262,144 routed rows). Each case is one
quantizer call of the trainer (``minite.engines.quant_linear`` / ``experts``):

    weights   16x16 tiles, one amax per expert and shard, codes + scales + BF16 values
    act       forward activations: row scaling -> codes (miniTE), tensor scaling -> BF16 values (naive)
    dgrad     dy [tokens, N], 1x16 along N, stochastic rounding -> BF16 values
    wgrad     dy^T / x^T along the tokens, RHT (+ SR for dy) -> BF16 values; dense: tokens padded to 16;
              experts: every expert's tokens gathered and padded to 16 from the sorted rows

Order of work: the device's copy bandwidth (a 1 GiB ``copy_``), then ``checks.check_fused_quantizers``
(every fused kernel vs minite.nvfp4 on smaller operands), then per case: the fused call checked bit for bit
against the PyTorch reference at the timed size, then timed (median of ``repeats`` CUDA-event timings of
``iters`` calls, with the min and max), beside the pre-fused path (``_quantize_legacy``: separate RHT, amax,
pad / transpose / gather copies, dequantize passes; the old PyTorch weight quantizer). GB/s counts the
bytes a single pass must move (input read once + outputs written); ``% copy`` relates it to the copy rate.
Python launch overhead is inside every number (a few us per call; the cases take 0.1-10 ms).
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minite import nvfp4 as ref
from minite.telemetry import copy_bandwidth

from . import _quantize_legacy as legacy
from .checks import bits_differ, check_fused_quantizers, expert_gather, same_bits, same_nvfp4
from .quantize import _tiles, dequantize, operand, quantize, quantize_dequantize, quantize_weight_groups

TOKENS, HIDDEN, INTER, EXPERTS, TOPK = 32768, 2048, 768, 128, 8


@dataclass
class Case:
    name: str
    new: Callable[[], object]            # the fused call
    old: Callable[[], object] | None     # the pre-fused path of the same trainer step
    check: Callable[[], tuple[bool, str]]
    nbytes: int                          # one pass: input read once + outputs written


def _time(fn, iters: int, repeats: int) -> tuple[float, float, float]:
    """(median, min, max) ms per call over ``repeats`` timings of ``iters`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1) / iters)
    return statistics.median(out), min(out), max(out)


def _nb(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _rand(shape, dev, seed, scale=1.0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=dev) * scale).to(torch.bfloat16)


def _gen():
    return torch.Generator().manual_seed(7)


def _check_values(x, want_kw, got, **operand_kw) -> tuple[bool, str]:
    want = ref.dequantize(ref.quantize(operand(x, **operand_kw), generator=_gen(), **want_kw)).to(got.dtype)
    ok = same_bits(got, want)
    return ok, "bit-exact" if ok else f"{bits_differ(got, want)} values differ in their bits"


def cases(dev, tokens: int = TOKENS, experts: int = EXPERTS, hidden: int = HIDDEN, inter: int = INTER
          ) -> list[Case]:
    out = []
    bf16 = torch.bfloat16
    # --- weights: 16x16, per expert and shard, codes + scales + BF16 values
    for name, n, k, shards in (("gate_up", 2 * inter, hidden, 2), ("down", hidden, inter, 1)):
        w = _rand((experts, n, k), dev, 1, 0.02)

        def new(w=w, shards=shards):
            return quantize_weight_groups(w.view(-1, w.shape[-1]), w.shape[0] * shards)

        def check(w=w, shards=shards, new=new):
            got = new()
            want = quantize_weight_groups(w.view(-1, w.shape[-1]), w.shape[0] * shards, backend="torch")
            ok = all(same_bits(a, b) for a, b in zip(got, want, strict=True))
            return ok, "bit-exact vs the PyTorch path" if ok else "codes / scales / S_dec / values differ"

        out.append(Case(f"weights {name} {experts}x{n}x{k} 16x16", new,
                        lambda w=w, s=shards: legacy.quantize_weight_groups(w, (16, 16), s), check,
                        _nb(w) + w.numel() // 2 + w.numel() // 16 + _nb(w)))
    # --- dense operands [tokens, hidden]
    x = _rand((tokens, hidden), dev, 2)
    dy = _rand((tokens, hidden), dev, 3, 1e-3)
    m16 = -(-tokens // 16) * 16
    codes_b = x.numel() // 2 + x.numel() // 16

    def act_row():
        return quantize(x, scaling="row", check=False)

    def check_act_row():
        ok = same_nvfp4(act_row(), ref.quantize(x, scaling="row"))
        return ok, "bit-exact" if ok else "codes / scales differ"
    out.append(Case(f"act row -> codes [{tokens}, {hidden}]", act_row,
                    lambda: legacy.quantize(x, scaling="row", check=False), check_act_row, _nb(x) + codes_b))
    out.append(Case(f"act tensor -> bf16 [{tokens}, {hidden}]",
                    lambda: quantize_dequantize(x, check=False),
                    lambda: dequantize(legacy.quantize(x, check=False), bf16),
                    lambda: _check_values(x, {}, quantize_dequantize(x, check=False)), 2 * _nb(x)))
    sr = dict(rounding="stochastic")
    out.append(Case(f"dgrad dy SR -> bf16 [{tokens}, {hidden}]",
                    lambda: quantize_dequantize(dy, generator=_gen(), check=False, **sr),
                    lambda: dequantize(legacy.quantize(dy, generator=_gen(), check=False, **sr), bf16),
                    lambda: _check_values(dy, sr, quantize_dequantize(dy, generator=_gen(), check=False, **sr)),
                    2 * _nb(dy)))
    for label, t, kw in (("dy^T SR+RHT", dy, dict(rounding="stochastic", rht=True)),
                         ("x^T RHT", x, dict(rht=True))):
        def new(t=t, kw=kw):
            return quantize_dequantize(t.t(), width=m16, generator=_gen(), check=False, **kw)

        def old(t=t, kw=kw):
            tp = torch.nn.functional.pad(t, (0, 0, 0, m16 - t.shape[0])).t().contiguous()
            return dequantize(legacy.quantize(tp, generator=_gen(), check=False, **kw), bf16)
        out.append(Case(f"wgrad {label} -> bf16 [{hidden}, {m16}]", new, old,
                        lambda t=t, kw=kw, new=new: _check_values(t.t(), kw, new(), width=m16), 2 * _nb(t)))
    # --- MoE operands: rows sorted by expert, wgrad segments gathered and padded to 16
    s = tokens * TOPK
    counts = torch.bincount(torch.randint(0, experts, (s,), generator=torch.Generator().manual_seed(4)),
                            minlength=experts)
    gather = expert_gather(counts.tolist(), dev)
    pcounts = (counts + 15) // 16 * 16
    dest = torch.cat([torch.arange(int(p0), int(p0) + int(c)) for p0, c in
                      zip(torch.cumsum(pcounts, 0) - pcounts, counts, strict=True)]).to(dev)
    for label, n, kw in (("dy^T SR+RHT", hidden, dict(rounding="stochastic", rht=True)),
                         ("x^T RHT", inter, dict(rht=True))):
        t = _rand((s, n), dev, 5 + n)

        def new(t=t, kw=kw):
            return quantize_dequantize(t.t(), gather=gather, generator=_gen(), check=False, **kw)

        def old(t=t, kw=kw):
            tp = t.new_zeros(gather.numel(), t.shape[1]).index_copy_(0, dest, t).t().contiguous()
            return dequantize(legacy.quantize(tp, generator=_gen(), check=False, **kw), bf16)
        out.append(Case(f"experts wgrad {label} -> bf16 [{n}, {gather.numel()}]", new, old,
                        lambda t=t, kw=kw, new=new: _check_values(t.t(), kw, new(), gather=gather), 2 * _nb(t)))
    xe = _rand((s, hidden), dev, 6)
    out.append(Case(f"experts act row -> codes [{s}, {hidden}]", lambda: quantize(xe, scaling="row", check=False),
                    lambda: legacy.quantize(xe, scaling="row", check=False),
                    lambda: (same_nvfp4(quantize(xe, scaling="row", check=False), ref.quantize(xe, scaling="row")),
                             "codes / scales / S_dec"), _nb(xe) + xe.numel() // 2 + xe.numel() // 16))
    return out


def _fmt(row, key) -> str:
    if key + "_ms" not in row:
        return "-"
    return f"{row[key + '_ms']:.3f} ({row[key + '_min']:.3f}-{row[key + '_max']:.3f})"


def run(device: str = "cuda", repeats: int = 7, iters: int = 5, old: bool = True, tokens: int = TOKENS,
        experts: int = EXPERTS) -> list[dict]:
    """Check every fused quantizer bit-exact on the GPU, then time each learner-size case (fused and, with
    ``old``, the pre-fused path). Prints a markdown table; returns its rows. A failed check is reported and
    its case is not timed. On a CPU device (the Triton interpreter, tiny sizes) it checks and calls each
    case once without timing: a smoke test of the bench itself."""
    dev = torch.device(device)
    timed = dev.type == "cuda"
    bw = copy_bandwidth(dev)["median"] if timed else float("nan")
    if timed:
        print(f"device {torch.cuda.get_device_name(dev)}: copy bandwidth {bw:.0f} GB/s", flush=True)
    sizes = {} if timed else dict(tokens=64, hidden=64, experts=4, inter=32)  # the interpreter: tiny
    bad = [r for r in check_fused_quantizers(dev, **sizes) if not r[1]]
    print(f"check_fused_quantizers: {'all PASS' if not bad else f'{len(bad)} FAIL: {bad}'}", flush=True)
    rows = [dict(case="check_fused_quantizers", check="PASS" if not bad else f"FAIL ({len(bad)})")]
    print("| case | check | fused ms (min-max) | GB/s | % copy | old ms (min-max) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for c in cases(dev, tokens, experts, **({} if timed else dict(hidden=64, inter=32))):
        ok, detail = c.check()
        row = dict(case=c.name, check="PASS" if ok else f"FAIL ({detail})", copy_gbs=bw)
        if ok and timed:
            row.update(zip(("fused_ms", "fused_min", "fused_max"), _time(c.new, iters, repeats), strict=True))
            row["gbs"] = c.nbytes / row["fused_ms"] / 1e6
            row["pct_copy"] = 100 * row["gbs"] / bw
            if old and c.old is not None:
                row.update(zip(("old_ms", "old_min", "old_max"), _time(c.old, max(1, iters // 2),
                                                                       max(3, repeats // 2)), strict=True))
                row["speedup"] = row["old_ms"] / row["fused_ms"]
        elif ok:
            c.new()
            if old and c.old is not None:
                c.old()
        rows.append(row)
        speed = f"{row['speedup']:.1f}x" if "speedup" in row else "-"
        print(f"| {c.name} | {row['check']} | {_fmt(row, 'fused')} | {row.get('gbs', float('nan')):.0f} | "
              f"{row.get('pct_copy', float('nan')):.0f} | {_fmt(row, 'old')} | {speed} |", flush=True)
        if timed:
            torch.cuda.empty_cache()
    return rows


def compile_sm90() -> int:
    """Build every quantizer kernel variant the entry points launch for sm_90 with the installed Triton (no
    GPU needed; run it under the device's Triton version), print registers and spills; 1 if any fails."""
    import itertools
    import re
    import subprocess
    import tempfile

    from . import _quantize_kernels as K
    from .sm90_compile import compile_one
    ptxas = None
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except Exception:  # noqa: BLE001 - register counts are informative only
        pass
    bad = 0
    variants = []
    for xdt, layout, rht, sr, out in itertools.product(("*bf16", "*fp32"), ("rows", "T"), (False, True),
                                                        (False, True), ("codes", "dq", "both")):
        rht_mode = (K.RHT_BF16 if xdt == "*bf16" else K.RHT_F32) if rht else K.RHT_NONE
        c = dict(RHT=rht_mode, STOCHASTIC=sr, CODES=out != "dq", DQ=K.DQ_NONE if out == "codes" else
                 (K.DQ_BF16 if out == "dq" else K.DQ_F32), GATHER=layout == "T" and sr, TILE16=False,
                 ROW_AMAX=layout == "rows" and not sr, CHECK=layout == "rows" and not sr, SDEC_ROWS=False)
        c["SDEC_ROWS"] = c["ROW_AMAX"]
        variants.append(("cast", xdt, layout, c))
        if out == "codes" and not sr:
            variants.append(("amax", xdt, layout, dict(RHT=rht_mode, GATHER=layout == "T", TILE_IN_GROUP=not rht)))
    variants.append(("cast", "*bf16", "rows", dict(RHT=0, STOCHASTIC=False, CODES=True, DQ=K.DQ_BF16, GATHER=False,
                                                  TILE16=True, ROW_AMAX=False, CHECK=False, SDEC_ROWS=False)))
    variants.append(("cast", "*fp16", "rows", dict(RHT=K.RHT_F16, STOCHASTIC=True, CODES=True, DQ=0, GATHER=False,
                                                  TILE16=False, ROW_AMAX=True, CHECK=True, SDEC_ROWS=True)))
    for silu in (K.SILU_HF, K.SILU_VLLM):  # the expert down projection's input: SiLU(gate) * up in the cast
        variants.append(("cast", "*bf16", "rows", dict(RHT=0, STOCHASTIC=False, CODES=True, DQ=0, GATHER=False,
                                                      TILE16=False, ROW_AMAX=silu == K.SILU_HF, CHECK=False,
                                                      SDEC_ROWS=silu == K.SILU_HF, SILU_MUL=silu,
                                                      FORMULA=K.FORMULA_TE if silu == K.SILU_HF else K.FORMULA_VLLM,
                                                      GIVEN_G=silu == K.SILU_VLLM)))
    for norm, norm_j, norm_res, comb in ((K.NORM_HF, 0, False, 0), (K.NORM_VLLM, 0, False, 0),
                                         (K.NORM_HF, 32, False, 0), (K.NORM_HF, 32, True, 0),
                                         (K.NORM_VLLM, 32, False, 0), (K.NORM_HF, 32, True, 8)):
        # a linear's input: the RMSNorm's last pass in the cast (NORM_J: the whole norm, its mean included;
        # COMBINE_K: the experts' combine before it, in the same pass)
        variants.append(("cast", "*bf16", "rows", dict(RHT=0, STOCHASTIC=False, CODES=True, DQ=0, GATHER=False,
                                                      TILE16=False, ROW_AMAX=True, CHECK=False, SDEC_ROWS=True,
                                                      NORM=norm, NORM_J=norm_j, NORM_RES=norm_res,
                                                      COMBINE_K=comb)))
    for kind, xdt, layout, c in variants:
        fn = K._cast_kernel if kind == "cast" else K._amax_kernel
        view = (torch.empty(4096, 2048, device="meta").t() if layout == "T"
                else torch.empty(2048, 4096, device="meta"))  # the tiles the entry points pick for it
        br, bc, warps, _ = _tiles(view, 4096, c.get("TILE16", False), c.get("ROW_AMAX", False))
        consts = dict(c, BR=1 if c.get("NORM_J") else br, BC=bc,
                      **({"stride_r": 1} if layout == "T" else {"stride_c": 1}))
        if kind == "cast":
            for key, default in (("SILU_MUL", K.SILU_NONE), ("NORM", K.NORM_NONE), ("FORMULA", K.FORMULA_TE),
                                 ("GIVEN_G", False), ("NORM_J", 0), ("NORM_RES", False), ("COMBINE_K", 0)):
                consts.setdefault(key, default)
        types = dict(x_ptr=xdt, up_ptr=xdt, gather_ptr="*i32", amax_ptr="*fp32" if kind == "cast" else "*i32",
                     codes_ptr="*u8", scales_ptr="*u8", sdec_ptr="*fp32", gsdec_ptr="*fp32",
                     dq_ptr="*i16" if c.get("DQ") == K.DQ_BF16 else "*fp32", bad_ptr="*i32", seed="i32",
                     var_ptr="*fp32", w_ptr=xdt, y_ptr=xdt, res_ptr=xdt, summed_ptr=xdt, eps="fp32", inv_n="fp32",
                     cy_ptr=xdt, cinv_ptr="*i64", cw_ptr=xdt)
        # pointers and the sizes / strides Triton sees as multiples of 16 at learner shapes
        ptrs = tuple(n for n in fn.arg_names if types.get(n, "").startswith("*") or
                     (n in ("C", "CW", "stride_r", "stride_c") and n not in consts))
        name = f"{kind} {xdt[1:]} {layout} " + " ".join(f"{k}={int(v)}" for k, v in c.items() if v)
        try:
            k = compile_one(fn, types, consts, warps, 1, ptrs)
        except Exception as exc:  # noqa: BLE001 - report every failing variant
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            bad += 1
            continue
        regs = spill = "?"
        if ptxas:
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(k.asm["ptx"])
                f.flush()
                log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                     capture_output=True, text=True).stderr
            regs = (re.findall(r"Used (\d+) registers", log) or ["?"])[0]
            spill = (re.findall(r"(\d+) bytes spill stores", log) or ["?"])[0]
        print(f"ok   {name}: regs {regs} spill stores {spill} smem {k.metadata.shared}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-old", action="store_true", help="skip timing the pre-fused path")
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--experts", type=int, default=EXPERTS)
    p.add_argument("--compile-only", action="store_true",
                   help="build every kernel variant for sm_90 (no GPU; unset TRITON_INTERPRET) and stop")
    a = p.parse_args(argv)
    if a.compile_only:
        return compile_sm90()
    rows = run(repeats=a.repeats, iters=a.iters, old=not a.no_old, tokens=a.tokens, experts=a.experts)
    return 0 if all(r["check"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
