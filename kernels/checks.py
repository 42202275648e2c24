"""Correctness checks shared by the bench (GPU, before timing) and the GPU tests: each returns a list of
(name, ok, detail) and never raises on a wrong answer (the caller decides)."""
from __future__ import annotations

import itertools

import torch

from minite import nvfp4 as ref

from .gemm import grouped_nvfp4_gemm, nvfp4_gemm, prepare_weight, stack_experts
from .quantize import (
    MAX_KP,
    dequantize,
    operand,
    quantize,
    quantize_dequantize,
    quantize_rms_norm,
    quantize_silu_mul,
    quantize_weight_groups,
)
from .weights import decode_f16, decode_layout

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as an integer tensor of the same width (so -0.0 != +0.0 and NaN == NaN of the same payload)."""
    return t.contiguous().view(_INT_OF[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ in their bits (shapes and dtypes must match)."""
    return int((bits(a) != bits(b)).sum())


def same_nvfp4(q, r) -> bool:
    """Codes, block scales and global scales bit for bit (and the global scale's shape)."""
    return (same_bits(q.codes, r.codes) and same_bits(q.scales, r.scales)
            and same_bits(q.global_scale, r.global_scale))


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-300))


def spread_input(m: int, k: int, device, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Random rows over 12 decades, a zero block, a tiny block next to an outlier (subnormal E4M3 scales)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 6, m)[:, None]
    if k >= 48:
        x[:, :16] = 0
        x[:, 16:32] *= 1e-6
        x[:, 32] = 1e3 * x[:, 32].abs().clamp_min(1)
    return x.to(device=device, dtype=dtype)


def check_quantize(device, backend=None, shapes=((67, 2048), (5, 784))):
    res = []
    for (m, k), dtype in itertools.product(shapes, (torch.float32, torch.bfloat16)):
        x = spread_input(m, k, device, dtype, seed=m + k)
        for scaling, rounding, rht in itertools.product(("tensor", "row", "static"), ("nearest", "stochastic"),
                                                        (False, True)):
            kw = dict(scaling=scaling, rounding=rounding, rht=rht, amax=3.5 if scaling == "static" else None)
            g1 = torch.Generator(device="cpu").manual_seed(7)
            g2 = torch.Generator(device="cpu").manual_seed(7)
            q = quantize(x, generator=g1, backend=backend, **kw)
            r = ref.quantize(x, generator=g2, **kw)
            ok = same_nvfp4(q, r)
            res.append((f"quantize {m}x{k} {str(dtype)[6:]} {scaling} {rounding} rht={rht}", ok,
                        "bit-exact" if ok else f"{int((q.codes != r.codes).sum())} code bytes differ"))
            if not rht and rounding == "nearest" and scaling != "static":
                res.extend(_check_dequantize(q, backend, f"{m}x{k} {scaling}"))
    # rows wider than one program (MoE wgrad operands): column-chunked programs, tensor scaling
    x = spread_input(3, MAX_KP + 112, device, torch.bfloat16, seed=5)
    for rounding, rht in itertools.product(("nearest", "stochastic"), (False, True)):
        q = quantize(x, rounding=rounding, rht=rht, generator=torch.Generator().manual_seed(3), backend=backend)
        r = ref.quantize(x, rounding=rounding, rht=rht, generator=torch.Generator().manual_seed(3))
        ok = same_nvfp4(q, r)
        res.append((f"quantize 3x{MAX_KP + 112} (column chunks) {rounding} rht={rht}", ok,
                    "bit-exact" if ok else f"{int((q.codes != r.codes).sum())} code bytes differ"))
    return res


def expert_gather(counts, device) -> torch.Tensor:
    """The MoE wgrad operands' gather: each expert's sorted tokens padded to a multiple of 16 (-1 = zero)."""
    src, start = [], 0
    for c in counts:
        src += list(range(start, start + c)) + [-1] * ((-c) % 16)
        start += c
    return torch.tensor(src, dtype=torch.int32, device=device)


def _fused_case(name, x, backend, width=None, gather=None, codes=True, **kw):
    """quantize and quantize_dequantize on (x, width, gather) vs the reference on the built operand."""
    out = []
    g = torch.Generator().manual_seed(7)
    r = ref.quantize(operand(x, width, gather), generator=g, **kw)
    if codes:
        q = quantize(x, generator=torch.Generator().manual_seed(7), backend=backend, width=width, gather=gather, **kw)
        ok = same_nvfp4(q, r)
        out.append((f"{name} codes", ok, "bit-exact" if ok else f"{bits_differ(q.codes, r.codes)} code bytes, "
                    f"{bits_differ(q.scales, r.scales)} scales differ"))
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        d = quantize_dequantize(x, dtype, generator=torch.Generator().manual_seed(7), backend=backend,
                                width=width, gather=gather, **kw)
        want = ref.dequantize(r).to(dtype)
        ok = same_bits(d, want)
        out.append((f"{name} {label} values", ok,
                    "bit-exact" if ok else f"{bits_differ(d, want)} values differ in bits"))
    return out


def check_silu_mul_quantizers(device, backend=None, rows=517, inter=768):
    """``quantize_silu_mul`` (SiLU * up inside the cast pass) vs the reference quantizer on
    ``fused_ops.silu_mul_reference``'s values, bit for bit: the expert down projection's input, both modes,
    per-row and static scales with formulas "te" and "vllm", and tensor scaling (the two-call fallback)."""
    from .fused_ops import silu_mul_reference
    h = spread_input(rows, 2 * inter, device, torch.bfloat16, seed=25)  # a gate_up output: gate | up halves
    gate, up = h.chunk(2, dim=-1)
    res = []
    for mode, formula, kw in (("hf", "te", dict(scaling="row")), ("vllm", "te", dict(scaling="row")),
                              ("hf", "te", dict(scaling="static", amax=3.0)),
                              ("vllm", "vllm", dict(scaling="static", global_encode_scale=700.0)),
                              ("hf", "vllm", dict(scaling="row")), ("hf", "te", dict(scaling="tensor"))):
        q = quantize_silu_mul(gate, up, mode, formula=formula, backend=backend, **kw)
        r = ref.quantize(silu_mul_reference(gate, up, mode), formula=formula, **kw)
        ok = same_nvfp4(q, r)
        res.append((f"silu_mul {mode} {formula} {kw['scaling']} {rows}x{inter}", ok, "bit-exact" if ok else
                    f"{bits_differ(q.codes, r.codes)} code bytes, {bits_differ(q.scales, r.scales)} scales differ"))
    return res


def check_rms_norm_quantizers(device, backend=None, rows=517, hidden=2048, eps=1e-6):
    """``quantize_rms_norm`` (the norm's last pass is the cast) vs ``fused_ops.rms_norm_reference`` and the
    reference quantizer, bit for bit: the norm's output, the residual sum and the codes; both modes, with and
    without a residual, per-row and static scales with formulas "te" and "vllm", tensor scaling (the two-call
    fallback), and fewer rows than a mean call takes (``fused_ops.MEAN_MIN_ROWS``). With ``f16=True`` the same
    bits, and where the cast is the norm's pass, its fp16 GEMM form is ``decode_f16`` of its codes, bit for bit
    (also for a row holding a NaN, whatever codes the cast gives it)."""
    from .fused_ops import rms_norm_reference
    x = spread_input(rows, hidden, device, torch.bfloat16, seed=26)
    residual = spread_input(rows, hidden, device, torch.bfloat16, seed=27)
    weight = spread_input(1, hidden, device, torch.bfloat16, seed=28)[0].abs() + 0.5
    res = []
    for mode, with_res, formula, kw in (
            ("hf", False, "te", dict(scaling="row")), ("hf", True, "te", dict(scaling="row")),
            ("vllm", False, "te", dict(scaling="row")), ("vllm", True, "te", dict(scaling="row")),
            ("hf", True, "te", dict(scaling="static", amax=3.0)),
            ("vllm", False, "vllm", dict(scaling="static", global_encode_scale=700.0)),
            ("hf", True, "te", dict(scaling="tensor"))):
        for n in (rows, 5):
            r = residual[:n] if with_res else None
            out = quantize_rms_norm(x[:n], weight, eps, mode, r, formula=formula, backend=backend, **kw)
            want = rms_norm_reference(x[:n], weight, eps, mode, r)
            want = (want,) if r is None else want
            q = ref.quantize(want[0], formula=formula, **kw)
            ok = same_nvfp4(out[-1], q) and all(same_bits(a, b) for a, b in zip(out[:-1], want, strict=True))
            name = f"rms_norm {mode} residual={with_res} {formula} {kw['scaling']} {n}x{hidden}"
            res.append((name, ok, "bit-exact" if ok else f"{bits_differ(out[0], want[0])} values, "
                        f"{bits_differ(out[-1].codes, q.codes)} code bytes differ"))
            got = quantize_rms_norm(x[:n], weight, eps, mode, r, formula=formula, backend=backend, f16=True, **kw)
            f16 = getattr(got[-1], "f16", None)
            ok = (same_nvfp4(got[-1], q) and all(same_bits(a, b) for a, b in zip(got[:-1], want, strict=True))
                  and (f16 is None or same_bits(f16, decode_f16(got[-1]))))
            res.append((name + " f16" + (" (two calls: no fp16 form)" if f16 is None else ""), ok,
                        "bit-exact" if ok else "differs"))
    bad = x[:5].clone()
    bad[1, 3] = float("nan")
    got = quantize_rms_norm(bad, weight, eps, "hf", None, backend=backend, check=False, f16=True, scaling="row")
    ok = got[-1].f16 is not None and same_bits(got[-1].f16, decode_f16(got[-1]))
    res.append((f"rms_norm f16 form of a NaN row 5x{hidden}", ok, "bit-exact" if ok else "differs"))
    return res


def check_fused_quantizers(device, backend=None, tokens=4133, hidden=2048, experts=16, inter=768):
    """Every fused quantizer bit-exact vs minite.nvfp4 on learner-like operands: the dgrad operand (rows),
    the wgrad operands (transposed views, tokens padded or gathered per expert, RHT + SR), forward
    activations (row / tensor scaling), wide rows, and the 16x16 weight cast with per-group amax."""
    res = []
    dy = spread_input(tokens, hidden, device, torch.bfloat16, seed=21)
    m16 = -(-tokens // 16) * 16
    res += _fused_case(f"dgrad dy {tokens}x{hidden} SR", dy, backend, rounding="stochastic")
    res += _fused_case(f"act {tokens}x{hidden} row", dy, backend, scaling="row")
    res += _fused_case(f"act {tokens}x{hidden} tensor", dy, backend, codes=False)
    for rounding, rht in (("stochastic", True), ("nearest", True), ("stochastic", False)):
        res += _fused_case(f"wgrad dy^T {hidden}x{m16} {rounding} rht={rht}", dy.t(), backend, width=m16,
                           rounding=rounding, rht=rht)
    f32 = dy[:1000].float()
    res += _fused_case("wgrad fp32 x^T rht", f32.t(), backend, width=-(-f32.shape[0] // 16) * 16, rht=True)
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 2 * tokens // experts, (experts,), generator=gen)
    counts[1::4] = 0                                          # empty experts
    x = spread_input(int(counts.sum()), inter, device, torch.bfloat16, seed=22)
    gather = expert_gather(counts.tolist(), device)
    for rounding in ("stochastic", "nearest"):
        res += _fused_case(f"wgrad experts x^T {inter}x{gather.numel()} gathered {rounding} rht", x.t(),
                           backend, gather=gather, rounding=rounding, rht=True)
    wide = spread_input(3, MAX_KP + 1040, device, torch.bfloat16, seed=23)
    res += _fused_case(f"row scaling 3x{MAX_KP + 1040} (amax pass)", wide, backend, scaling="row", rht=True)
    w = spread_input(4 * 2 * inter, hidden, device, torch.bfloat16, seed=24) * 1e-3
    for groups, tile in ((8, (16, 16)), (1, (16, 16)), (8, (1, 16))):
        codes, scales, sdec, dq = quantize_weight_groups(w, groups, tile, backend=backend)
        want = [ref.quantize(p, tile=tile) for p in w.chunk(groups)]
        ok = (same_bits(codes, torch.cat([p.codes for p in want]))
              and same_bits(scales, torch.cat([p.scales for p in want]))
              and same_bits(sdec, torch.stack([p.global_scale for p in want]))
              and same_bits(dq, torch.cat([ref.dequantize(p) for p in want]).bfloat16()))
        res.append((f"weights {tuple(w.shape)} {groups} groups {tile[0]}x{tile[1]}", ok,
                    "bit-exact" if ok else "codes / scales / S_dec / values differ"))
    return (res + check_silu_mul_quantizers(device, backend, inter=inter)
            + check_rms_norm_quantizers(device, backend, hidden=hidden))


def _check_dequantize(t, backend, label):
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        want = ref.dequantize(t).to(dtype)
        got = dequantize(t, dtype, backend=backend)
        ok = same_bits(got, want)
        out.append((f"dequantize {label} -> {str(dtype)[6:]}", ok, "bit-exact" if ok else
                    f"{bits_differ(got, want)} values differ in their bits"))
    return out


def check_gemm(device, backend=None, shapes=((300, 520, 2064), (1, 64, 128), (17, 4096, 2048))):
    res = []
    for m, n, k in shapes:
        a = quantize(spread_input(m, k, device, seed=1), scaling="row")
        w = quantize(torch.randn(n, k, device=device) * 0.02)
        r = ref.nvfp4_matmul_reference(a, w)
        bias = torch.randn(n, device=device)
        o = nvfp4_gemm(a, w, out_dtype=torch.float32, backend=backend)
        e = rel_err(o, r)
        res.append((f"gemm {m}x{n}x{k} fp32 vs reference", e < 1e-5, f"rel err {e:.2e}"))
        a = quantize(torch.randn(m, k, device=device), scaling="row")  # fp16 output must not overflow
        r = ref.nvfp4_matmul_reference(a, w)
        for dt in (torch.bfloat16, torch.float16):
            o = nvfp4_gemm(a, w, out_dtype=dt, bias=bias, backend=backend)
            e = rel_err(o, r + bias)
            res.append((f"gemm {m}x{n}x{k} {str(dt)[6:]}+bias", e < 1e-2 and o.dtype == dt, f"rel err {e:.2e}"))
    return res


def check_batch_invariance(device, backend=None, m_big=16384, n=1024, k=2048):
    """A row computed alone (M=1), inside small/medium batches, and inside M=m_big: bitwise equal; two
    runs bitwise equal."""
    res = []
    a = quantize(torch.randn(m_big, k, device=device), scaling="row")
    w = quantize(torch.randn(n, k, device=device))
    pw = decode_layout(prepare_weight(w, backend=backend), backend=backend)
    for dt in (torch.float32, torch.bfloat16):
        full = nvfp4_gemm(a, w, out_dtype=dt, backend=backend)
        again = nvfp4_gemm(a, w, out_dtype=dt, backend=backend)
        res.append((f"determinism M={m_big} {str(dt)[6:]}", torch.equal(full, again), "two runs"))
        bad = []
        for lo, size in ((0, 1), (5, 1), (m_big - 1, 1), (0, 16), (100, 64), (3, 1000), (0, 4096)):
            if lo + size > m_big:
                continue
            sub = ref.NVFP4Tensor(a.codes[lo:lo + size], a.scales[lo:lo + size], a.global_scale[lo:lo + size])
            part = nvfp4_gemm(sub, w, out_dtype=dt, backend=backend)
            if not torch.equal(part, full[lo:lo + size]):
                bad.append(f"rows {lo}:{lo + size}")
        res.append((f"batch invariance M in 1..{m_big} {str(dt)[6:]}", not bad, ", ".join(bad) or "bitwise equal"))
        # the prepared forms a sampler reads (fp16 copy at 17-64 rows, fragment-order codes at <= 16, the copy
        # above): the same rows
        bad = []
        for lo, size in ((0, 1), (9, 16), (0, 17), (7, 33), (100, 64), (3, 65), (0, 4096)):
            if lo + size > m_big:
                continue
            sub = ref.NVFP4Tensor(a.codes[lo:lo + size], a.scales[lo:lo + size], a.global_scale[lo:lo + size])
            if not torch.equal(nvfp4_gemm(sub, pw, out_dtype=dt, backend=backend), full[lo:lo + size]):
                bad.append(f"rows {lo}:{lo + size}")
        res.append((f"prepared weight M in 1..4096 {str(dt)[6:]}", not bad, ", ".join(bad) or "bitwise equal"))
    return res


def check_grouped(device, backend=None, e=8, n=256, k=512):
    counts = [0, 3, 130, 0, 1, 64, 17, 0][:e]
    offs = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int64, device=device)
    m = int(offs[-1])
    a = quantize(torch.randn(m, k, device=device), scaling="row")
    ws = [quantize(torch.randn(n, k, device=device), scaling="row" if i % 2 else "tensor") for i in range(e)]
    res = []
    ws = [ref.NVFP4Tensor(w.codes, w.scales, w.row_global_scale().contiguous()) for w in ws]
    out = grouped_nvfp4_gemm(a, stack_experts(ws), offs, out_dtype=torch.float32, backend=backend)
    worst, same = 0.0, True
    for i in range(e):
        lo, hi = int(offs[i]), int(offs[i + 1])
        if hi == lo:
            continue
        sub = ref.NVFP4Tensor(a.codes[lo:hi], a.scales[lo:hi], a.global_scale[lo:hi])
        worst = max(worst, rel_err(out[lo:hi], ref.nvfp4_matmul_reference(sub, ws[i])))
        same &= torch.equal(out[lo:hi], nvfp4_gemm(sub, ws[i], out_dtype=torch.float32, backend=backend))
    res.append((f"grouped E={e} (empty groups) vs reference", worst < 1e-5, f"worst rel err {worst:.2e}"))
    res.append(("grouped rows == dense rows (bitwise)", same, "informative: same K order, other tiles"))
    return res


def run_all(device, backend=None) -> list[str]:
    lines = []
    for fn in (check_quantize, check_fused_quantizers, check_gemm, check_batch_invariance, check_grouped):
        try:
            res = fn(device, backend)
        except Exception as exc:  # a crash is a failed check, not a lost run
            res = [(fn.__name__, False, f"raised {type(exc).__name__}: {str(exc)[:300]}")]
        for name, ok, detail in res:
            line = f"- {'PASS' if ok else 'FAIL'} {name}: {detail}"
            lines.append(line)
            print(line, flush=True)
    return lines
