"""The fused quantizer kernels (minite.kernels.quantize: strided / padded / gathered operands, in-kernel RHT,
the dequantized output, the 16x16 weight cast with per-group amax) against minite.nvfp4, bit for bit, under
the Triton interpreter; the same checks on the GPU (``-m gpu``)."""
from __future__ import annotations

import ast
import importlib
import inspect
import itertools

import pytest
import torch
from minite.kernels import (
    checks,
    fused_ops,
    quantize,
    quantize_dequantize,
    quantize_rms_norm,
    quantize_silu_mul,
    quantize_weight_groups,
)
from minite.kernels.checks import check_fused_quantizers, same_bits, same_nvfp4, spread_input

from minite import nvfp4 as ref

qmod = importlib.import_module("minite.kernels.quantize")


def _gen(seed=11):
    return torch.Generator().manual_seed(seed)


def _both(x, width=None, gather=None, **kw):
    """(kernel, reference) NVFP4Tensors and (kernel, reference) BF16 dequantized values for the same call; the
    fp32 dequantized values are checked here."""
    q = quantize(x, generator=_gen(), backend="triton", width=width, gather=gather, **kw)
    r = ref.quantize(qmod.operand(x, width, gather), generator=_gen(), **kw)
    d = quantize_dequantize(x, torch.bfloat16, generator=_gen(), backend="triton", width=width, gather=gather, **kw)
    d32 = quantize_dequantize(x, torch.float32, generator=_gen(), backend="triton", width=width, gather=gather, **kw)
    assert same_bits(d32, ref.dequantize(r))
    return q, r, d, ref.dequantize(r).to(torch.bfloat16)


# the transposed wgrad operands run the plane kernels (``_quantize_planes``) for the passes named here and the
# 3D kernels for the others: every combination gives the reference's bits
PLANE_PASSES = ((), ("amax",), ("cast",), ("amax", "cast"))


MODES = list(itertools.product(("tensor", "row", "static"), ("nearest", "stochastic"), (False, True)))


@pytest.mark.parametrize("scaling,rounding,rht", MODES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("plane_passes", PLANE_PASSES)
def test_transposed_view_padded_tokens(scaling, rounding, rht, dtype, plane_passes, monkeypatch):
    """The wgrad operand: x [M tokens, N] read as x.t() with the token dim zero-padded to 16 — no copies."""
    monkeypatch.setattr(qmod, "PLANE_PASSES", plane_passes)
    x = spread_input(37, 24, "cpu", dtype, seed=2)          # 37 tokens: pads to 48; 24 features (odd tiles)
    x[:, 3] = 0.0                                            # a zero row of the operand (amax 0 for row scaling)
    kw = dict(scaling=scaling, rounding=rounding, rht=rht, amax=5.0 if scaling == "static" else None)
    q, r, d, dr = _both(x.t(), width=48, **kw)
    assert same_nvfp4(q, r) and same_bits(d, dr)


@pytest.mark.parametrize("rounding,rht", list(itertools.product(("nearest", "stochastic"), (False, True))))
@pytest.mark.parametrize("plane_passes", PLANE_PASSES)
def test_gathered_expert_segments(rounding, rht, plane_passes, monkeypatch):
    """MoE wgrad: each expert's tokens padded to 16, gathered from the sorted rows (-1 = zero token)."""
    monkeypatch.setattr(qmod, "PLANE_PASSES", plane_passes)
    x = spread_input(45, 32, "cpu", torch.bfloat16, seed=3)
    counts = [3, 0, 17, 25]                                   # an empty expert; segments 16, 0, 32, 32
    src, start = [], 0
    for c in counts:
        src += list(range(start, start + c)) + [-1] * ((-c) % 16)
        start += c
    gather = torch.tensor(src, dtype=torch.int32)
    q, r, d, dr = _both(x.t(), gather=gather, rounding=rounding, rht=rht)
    assert same_nvfp4(q, r) and same_bits(d, dr)
    with pytest.raises(ValueError, match="gather indexes"):
        quantize(x.t(), gather=torch.tensor([0] * 15 + [45]), backend="triton")


@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (67, 400), (2, 4112), (130, 16)])
@pytest.mark.parametrize("rht", (False, True))
def test_odd_shapes_rowwise(shape, rht):
    x = spread_input(*shape, "cpu", torch.bfloat16, seed=sum(shape))
    for scaling, rounding in (("tensor", "stochastic"), ("row", "nearest")):
        q, r, d, dr = _both(x, scaling=scaling, rounding=rounding, rht=rht)
        assert same_nvfp4(q, r) and same_bits(d, dr), (scaling, rounding)


def test_wide_rows_and_row_scaling_beyond_one_program(monkeypatch):
    """Row scaling on rows wider than MAX_KP: a per-row amax pass, then column programs (was: the reference)."""
    monkeypatch.setattr(qmod, "MAX_KP", 256)
    monkeypatch.setattr(qmod, "CHUNK_KP", 128)
    x = spread_input(5, 1040, "cpu", torch.bfloat16, seed=4)
    x[2, 700] = 40.0
    for rounding, rht in (("stochastic", True), ("nearest", False)):
        q, r, d, dr = _both(x, scaling="row", rounding=rounding, rht=rht)
        assert same_nvfp4(q, r) and same_bits(d, dr)


def test_zero_tensor_subnormal_scales_and_fp16():
    z = torch.zeros(32, 64, dtype=torch.bfloat16)                    # amax 0: S_enc = 1, codes 0
    for kw in (dict(), dict(rht=True), dict(scaling="row"), dict(tile=(16, 16))):
        q, r, d, dr = _both(z, **kw)
        assert same_nvfp4(q, r) and same_bits(d, dr), kw
    x = spread_input(16, 64, "cpu", torch.float16, seed=6).clamp(-2e3, 2e3)  # the RHT stays finite in fp16
    x[:, 16:32] = 1e-4 * torch.sign(x[:, 16:32])                     # tiny next to an outlier: scales < 2**-6
    for kw in (dict(rht=True), dict(rounding="stochastic"), dict(scaling="row", rht=True)):
        q, r, d, dr = _both(x, **kw)
        assert same_nvfp4(q, r) and same_bits(d, dr), kw
        assert (r.scales.view(torch.uint8) < 8).any()                 # subnormal e4m3 scales were exercised


@pytest.mark.parametrize("scaling", ("tensor", "row", "static"))
def test_nan_inf_raise_in_every_mode_and_the_generator_is_left_as_the_reference_leaves_it(scaling):
    x = torch.randn(4, 64)
    x[2, 40] = float("nan")
    kw = dict(scaling=scaling, amax=1.0 if scaling == "static" else None, rounding="stochastic")
    for bad, width in ((x, None), (x.t(), 16)):
        g = _gen(3)
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize(bad, generator=g, backend="triton", width=width, **kw)
        assert torch.equal(g.get_state(), _gen(3).get_state())
    big = torch.full((1, 16), 3e38)                                  # finite input, the RHT overflows
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(big, rht=True, backend="triton", **kw)
    wide = torch.randn(2, 48)
    wide[1, 47] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_dequantize(wide, backend="triton", **kw)


def test_16x16_tiles_and_weight_groups(monkeypatch):
    w = spread_input(96, 80, "cpu", torch.bfloat16, seed=8)
    q, r, d, dr = _both(w, tile=(16, 16))
    assert same_nvfp4(q, r) and same_bits(d, dr)
    for groups in (1, 2, 6):                                          # experts x shards: 96, 48, 16 rows each
        codes, scales, sdec, dq = quantize_weight_groups(w, groups, backend="triton")
        want = [ref.quantize(p, tile=(16, 16)) for p in w.chunk(groups)]
        assert same_bits(codes, torch.cat([p.codes for p in want]))
        assert same_bits(scales, torch.cat([p.scales for p in want]))
        assert same_bits(sdec, torch.stack([p.global_scale for p in want]))
        assert same_bits(dq, torch.cat([ref.dequantize(p) for p in want]).bfloat16())
        cpu = quantize_weight_groups(w, groups, backend="torch")      # the vectorised PyTorch path
        assert all(same_bits(a, b) for a, b in zip(cpu, (codes, scales, sdec, dq), strict=True))
    monkeypatch.setattr(qmod, "TILE16_TILE", (4096, 64, 8))           # 64-row tiles straddle 48-row groups
    codes, _, sdec, _ = quantize_weight_groups(w, 2, backend="triton")
    assert same_bits(sdec, torch.stack([ref.quantize(p, tile=(16, 16)).global_scale for p in w.chunk(2)]))
    one = quantize_weight_groups(w[:, :32], 6, tile=(1, 16), backend="triton")
    want = [ref.quantize(p) for p in w[:, :32].chunk(6)]
    assert same_bits(one[0], torch.cat([p.codes for p in want]))
    with pytest.raises(ValueError, match="groups"):
        quantize_weight_groups(w, 5)
    bad = w.clone()
    bad[50, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_weight_groups(bad, 2, backend="triton")


def test_bad_operand_arguments():
    x = torch.randn(8, 32)
    with pytest.raises(ValueError, match="width=24 is narrower"):
        quantize(x, width=24, backend="triton")
    with pytest.raises(ValueError, match="K % 16"):
        quantize(x, width=40, backend="triton")
    with pytest.raises(ValueError, match="not both"):
        quantize(x, width=32, gather=torch.arange(32), backend="triton")
    with pytest.raises(ValueError, match="out_dtype"):
        quantize_dequantize(x, torch.float16)
    # formulas the kernels do not cover run the reference on the same operand
    q = quantize(x.t(), formula="vllm", width=16, backend="triton")
    assert same_nvfp4(q, ref.quantize(qmod.operand(x.t(), 16), formula="vllm"))


def _jit_functions():
    """The quantizer modules' @triton.jit functions (JITFunction, or the interpreter's wrapper: both keep
    ``.fn``)."""
    for name in ("minite.kernels._quantize_kernels", "minite.kernels._quantize_planes"):
        mod = importlib.import_module(name)
        for obj in vars(mod).values():
            if inspect.isfunction(getattr(obj, "fn", None)) and obj.fn.__module__ == mod.__name__:
                yield obj


def test_kernels_never_negate_a_float_with_unary_minus():
    """Triton 3.6 (the H200's) lowers ``-x`` to ``0 - x``: +0.0 where the reference has -0.0. The
    interpreter of a newer Triton negates properly, so only this source check catches it; signs are bits."""
    fns = list(_jit_functions())
    assert {"_cast_kernel", "_amax_kernel", "_dequant_kernel", "_rht16", "amax_planes_kernel",
            "cast_planes_kernel"} <= {f.fn.__name__ for f in fns}
    for fn in fns:
        for node in ast.walk(ast.parse(inspect.getsource(fn.fn))):
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                assert isinstance(node.operand, ast.Constant), (fn.fn.__name__, ast.unparse(node))


def test_silu_mul_inside_the_cast_is_the_reference():
    """quantize_silu_mul under the interpreter: the reference quantizer's bits on silu_mul_reference's values
    (both modes; row / static scales, formulas te / vllm; the tensor-scaling fallback), and one launch less:
    the fused path never calls silu_mul."""
    res = checks.check_silu_mul_quantizers(torch.device("cpu"), backend="triton", rows=37, inter=96)
    assert all(ok for _, ok, _ in res), [r for r in res if not r[1]]


def test_silu_mul_cast_does_not_materialise_the_product(monkeypatch):
    from minite.kernels import fused_ops
    calls = []
    monkeypatch.setattr(fused_ops, "silu_mul", lambda *a, **k: calls.append(1))
    h = spread_input(5, 64, "cpu", torch.bfloat16, seed=3)
    quantize_silu_mul(*h.chunk(2, dim=-1), "hf", scaling="row", backend="triton")
    assert not calls


def test_rms_norm_inside_the_cast_is_the_reference():
    """quantize_rms_norm under the interpreter: rms_norm_reference's output and residual sum, and the reference
    quantizer's bits on that output (both modes; row / static scales, formulas te / vllm; the tensor-scaling
    fallback; 5 rows, below a mean call's minimum)."""
    res = checks.check_rms_norm_quantizers(torch.device("cpu"), backend="triton", rows=37, hidden=96)
    assert all(ok for _, ok, _ in res), [r for r in res if not r[1]]


def test_rms_norm_cast_with_its_mean_is_the_emulated_reference(monkeypatch):
    """With the mean in the pass (forced on here, the interpreter; on the GPU where torch's order is proven) the
    cast takes the norm's mean itself (no square pass), and every output equals the reference with torch's
    CUDA mean order (``row_mean_emulated``): both modes, with and without a residual, both formulas."""
    monkeypatch.setattr(fused_ops, "mean_in_pass", lambda n, device: n % 128 == 0)
    monkeypatch.setattr(fused_ops, "row_mean", lambda t: fused_ops.row_mean_emulated(
        t.reshape(-1, t.shape[-1])).reshape(*t.shape[:-1], 1))
    square_means, square_mean = [], fused_ops.square_mean
    monkeypatch.setattr(fused_ops, "square_mean", lambda *a: square_means.append(1) or square_mean(*a))
    res = checks.check_rms_norm_quantizers(torch.device("cpu"), backend="triton", rows=19, hidden=256)
    assert len(res) == 29 and all(ok for _, ok, _ in res), [r for r in res if not r[1]]
    # an fp16 form written by the 5 fused cases x 2 row counts and the NaN row ("vllm" with a residual and
    # tensor scaling take two calls)
    assert sum("f16" in name and "two calls" not in name for name, _, _ in res) == 11
    # 7 cases x 2 row counts, with and without the fp16 form, and the NaN row; only the 2 static-scaling casts
    # (their norm's prologue) take the square pass: the fused row-scaling ones and the two-call fallbacks
    # (``rms_norm``, one pass) do not
    assert len(square_means) == 8


@pytest.mark.parametrize("mode,residual", [("hf", True), ("hf", False), ("vllm", False)])
def test_rms_norm_cast_takes_the_experts_combine(monkeypatch, mode, residual):
    """Given the experts' ``RoutedRows`` (the mean in the pass and the one-pass combine forced on, the
    interpreter) the cast writes their combine and normalises it in its one launch: every output bitwise
    ``quantize_rms_norm`` of the combine itself; anything the cast does not take ("vllm" with a residual)
    gets the combine first."""
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "triton")
    monkeypatch.setattr(fused_ops, "mean_in_pass", lambda n, device: n % 128 == 0)
    monkeypatch.setattr(fused_ops, "combine_in_one_pass", lambda y, w, mode: True)
    g = torch.Generator().manual_seed(5)
    t, k, n = 6, 4, 256
    ids = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(t)])
    perm, _, _, inv = fused_ops.sort_by_expert_reference(ids, 16, inverse=True)
    y = spread_input(t * k, n, "cpu", torch.bfloat16, seed=6)
    w = torch.rand(t, k, generator=g).to(torch.bfloat16 if mode == "hf" else torch.float32)
    combined = fused_ops.combine_experts_emulated(y, inv, w, mode).view(t, 1, n)
    routed = fused_ops.RoutedRows(y, perm, inv, w, mode, (t, 1, n))
    weight = spread_input(1, n, "cpu", torch.bfloat16, seed=7)[0].abs() + 0.5
    r = spread_input(t, n, "cpu", torch.bfloat16, seed=8).view(t, 1, n) if residual else None
    values = []
    monkeypatch.setattr(fused_ops.RoutedRows, "value", lambda self: values.append(1) or combined)
    got = quantize_rms_norm(routed, weight, 1e-6, mode, r, scaling="row")
    assert not values  # taken in the cast
    want = quantize_rms_norm(combined, weight, 1e-6, mode, r, scaling="row")
    for a, b in zip(got[:-1], want[:-1], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert same_nvfp4(got[-1], want[-1])
    rv = spread_input(t, n, "cpu", torch.bfloat16, seed=9).view(t, 1, n)
    quantize_rms_norm(routed._replace(mode="vllm"), weight, 1e-6, "vllm", rv, scaling="row")
    assert values  # not fused: the combine taken first


def test_rms_norm_cast_has_no_separate_norm_tail(monkeypatch):
    """Where the cast takes the norm (row scaling, "hf" with a residual), neither the norm's own last pass
    nor a second quantize runs; a "vllm" residual (its last pass rounds the residual too) takes the two calls."""
    from minite.kernels import fused_ops
    x, r = spread_input(5, 64, "cpu", torch.bfloat16, seed=3), spread_input(5, 64, "cpu", torch.bfloat16, seed=4)
    w = torch.ones(64, dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(fused_ops, "rms_norm", lambda *a, **k: calls.append("norm") or (x, r))
    monkeypatch.setattr(qmod, "quantize", lambda *a, **k: calls.append("quantize"))
    quantize_rms_norm(x, w, 1e-6, "hf", r, scaling="row", backend="triton")
    assert not calls
    quantize_rms_norm(x, w, 1e-6, "vllm", r, scaling="row", backend="triton")
    assert calls == ["norm", "quantize"]


@pytest.mark.gpu
def test_gpu_fused_quantizers_bit_exact():
    res = check_fused_quantizers(torch.device("cuda"))
    assert all(ok for _, ok, _ in res), [r for r in res if not r[1]]


def test_weight_along_n_for_dgrad_is_one_more_cast_of_the_transposed_view():
    """W^T (dgrad's second operand, blocks along N) from the same 16x16 tiles: quantize(w.t()) reads the
    weight in place; its scales are W's tile scales transposed and its S_dec is W's."""
    w = spread_input(48, 64, "cpu", torch.bfloat16, seed=9)
    q, r, d, dr = _both(w.t(), tile=(16, 16))
    assert same_nvfp4(q, r) and same_bits(d, dr)
    qw = ref.quantize(w, tile=(16, 16))
    tiles = qw.scales.view(torch.uint8)[::16]                              # [N/16, K/16]: one row per tile
    assert torch.equal(q.scales.view(torch.uint8)[::16], tiles.t())
    assert same_bits(q.global_scale, qw.global_scale)
    assert same_bits(ref.dequantize(q), ref.dequantize(qw).t().contiguous())  # the same values, transposed
