"""NVFP4 quantizers on the GPU, bit-identical to ``minite.nvfp4`` (formulas "te" and "vllm"), and their inverse.

    quantize(x, ...)                 -> NVFP4Tensor          minite.nvfp4.quantize, same signature and bits
    quantize_dequantize(x, dtype)    -> Tensor               dequantize(quantize(x)).to(dtype), one cast pass
    quantize_weight_groups(w, g, tile) -> codes, scales, S_dec [g], BF16 values   (one global amax per group)
    dequantize(t, out_dtype)         -> Tensor               minite.nvfp4.dequantize(t).to(out_dtype)

Passes (kernels in ``_quantize_kernels``): tensor scaling (one amax per tensor or per row group, the
weights' experts x shards) is an amax kernel, then the cast kernel; row scaling is one cast pass when a
program can hold whole rows (K <= MAX_KP), else a per-row amax pass first; static scaling is one pass. The
16-point RHT is computed inside both kernels (never a separate pass). The cast writes the packed codes and
scales, or the dequantized values, or both, in the same pass.

Operands without copies: ``x`` may be any strided 2D view, so the wgrad operands (tokens as the block
dimension) are ``quantize(dy.t(), width=M16)``: quantized like ``ref.quantize(pad(dy).t().contiguous())``
without the pad or the transpose. ``width`` zero-pads the block dimension; ``gather`` (int [W], -1 = zero)
picks its columns — the MoE wgrad operands, every expert's token segment padded to 16, straight from the
sorted activations. ``operand(x, width, gather)`` builds that tensor explicitly (the reference path). Such a
view's contiguous axis is its rows; quantized with formula "te", 1x16 blocks and tensor scaling (the wgrad
operands) its passes run the plane kernels of ``_quantize_planes`` (``PLANE_PASSES``): the same arithmetic
with each 16-block held by one thread, so the RHT and the block amax stay in registers and the codes and
values leave as 8-byte words.

Formula "vllm" (vLLM's activation quantizer) takes the same passes with its own scale arithmetic, every
tile, scaling, rounding and RHT: G from the amax (tensor, row, static ``amax=``) or given (static
``global_encode_scale=``, the sampler's activations: one pass). Anything the kernels do not cover (formula
"modelopt", CPU tensors, backend "torch") runs the reference itself. The stochastic stream is the
reference's counter hash over the operand's element index, seeded by one draw from ``generator``; on an
error the generator is left as the reference would leave it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from minite import nvfp4 as ref

from . import _backend
from .weights import DecodedNVFP4Tensor

try:
    import triton

    from . import _quantize_kernels as K
    from . import _quantize_planes as P
except Exception:  # pragma: no cover - exercised only without triton
    triton = K = P = None

MAX_KP = 32768    # widest row one program holds in registers (row scaling in one pass)
CHUNK_KP = 8192   # column width of one program for wider rows under row scaling
# warps of a row-scaled program holding one row of 2048 padded columns because the rows are few (a decode
# step's). Bits do not depend on it. H200, CUDA-graph medians, 4 -> 8 warps (16): the norm cast of 64 x 2048
# with its residual 5.55 -> 5.11 us (7.76), 64 x 2048 2.45 -> 2.40. At 1024 columns 8 warps made the `small`
# model's decode step (three such casts a layer, 256 rows) 21 us slower: 4 stay there
FEW_ROWS_WARPS = 8
#: tiles of the other modes, (elements per program, widest column tile, num_warps): 16 elements per thread
#: keep the cast at 60-100 registers on sm_90 (sm_90 SASS: ~100 instructions per element with SR and the
#: BF16 output; more elements per thread amortise the per-block scale arithmetic a little more)
ROW_TILE = (4096, 1024, 8)
TILE16_TILE = (4096, 256, 8)
TRANSPOSED_TILE = (64, 64, 8)  # (rows, columns, num_warps) of a transposed view: 64 contiguous rows
#: the passes that run the plane kernels (``_quantize_planes``) where they apply: a transposed view quantized
#: with formula "te", 1x16 blocks and tensor scaling (the wgrad operands); their tile (rows, 16-blocks, warps)
PLANE_PASSES = ("amax", "cast")
PLANES_TILE = (32, 4, 2)

# ------------------------------------------------------------------------------------------- operands
def operand(x: torch.Tensor, width: int | None = None, gather: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor the kernels quantize for (x, width, gather): x itself, x zero-padded on the right to
    ``width`` columns, or x's columns ``gather`` (-1 = a zero column)."""
    if gather is not None:
        g = gather.to(device=x.device, dtype=torch.long)
        out = x.new_zeros(x.shape[0], g.numel())
        keep = g >= 0
        out[:, keep] = x[:, g[keep]]
        return out
    if width is not None and width != x.shape[1]:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))
    return x


def _operand_width(x, width, gather) -> int:
    if gather is not None:
        if width is not None:
            raise ValueError("give width= or gather=, not both")
        if gather.dim() != 1 or gather.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"gather must be a 1D int32/int64 tensor, got {gather.dtype} {tuple(gather.shape)}")
        return gather.numel()
    if width is None:
        return x.shape[1]
    if width < x.shape[1]:
        raise ValueError(f"width={width} is narrower than the input's {x.shape[1]} columns")
    return int(width)


# ------------------------------------------------------------------------------------------ the cast
class _Cast(NamedTuple):
    codes: torch.Tensor | None
    scales: torch.Tensor | None
    sdec_rows: torch.Tensor | None    # [R] (row scaling)
    sdec_groups: torch.Tensor         # [groups]
    dq: torch.Tensor | None


def _layout(k: int) -> tuple[int, int, int, int]:
    """Row scaling's tiles, (ROWS, KP, num_warps, column programs): whole rows (KP >= k) up to MAX_KP, so
    the row amax is taken in the cast pass itself; wider rows in CHUNK_KP-wide programs after an amax pass."""
    kp = max(16, triton.next_power_of_2(k)) if k <= MAX_KP else CHUNK_KP
    rows = max(1, 4096 // kp)
    warps = min(16, max(4, kp // 512))
    return rows, kp, warps, triton.cdiv(k, kp)


@functools.cache
def _programs_to_fill(device_index: int) -> int:
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _fill_gpu(br: int, r: int, col_programs: int, device, least: int) -> int:
    """Rows per program, halved from ``br`` (down to ``least``) while the grid would leave SMs idle: a decode
    step's 64-256 rows in 4-row programs were 16-64 programs on 132 SMs. Each row's (or 16x16 tile's) values,
    amax and codes come from the same operations whatever the rows per program: the bits do not change."""
    if device.type != "cuda":
        return br
    want = _programs_to_fill(device.index if device.index is not None else torch.cuda.current_device())
    while br > least and triton.cdiv(r, br) * col_programs < want:
        br //= 2
    return br


def _tiles(x, cw, tile16, row_scaling):
    """(BR, BC, num_warps, grid) for the operand view x with CW columns."""
    r = x.shape[0]
    if row_scaling:
        br, bc, warps, chunks = _layout(cw)
        br = _fill_gpu(br, r, chunks, x.device, 1)
        if br == 1 and bc == 2048:
            warps = FEW_ROWS_WARPS
        return br, bc, warps, (triton.cdiv(r, br), chunks)
    if x.stride(0) == 1 and x.stride(1) != 1 and r > 1:  # a transposed view: loads coalesce along rows
        br, bc, warps = TRANSPOSED_TILE
    else:
        elems, widest, warps = TILE16_TILE if tile16 else ROW_TILE
        bc = min(max(16, triton.next_power_of_2(cw)), widest)
        br = max(16 if tile16 else 1, elems // bc)
        br = _fill_gpu(br, r, triton.cdiv(cw, bc), x.device, 16 if tile16 else 1)
    return br, bc, warps, (triton.cdiv(r, br), triton.cdiv(cw, bc))


def _draw_seed(generator) -> int:
    g = generator if generator is not None else torch.default_generator
    return int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g, device=g.device).item())


def _cast(x, *, formula="te", tile=(1, 16), scaling="tensor", amax=None, global_encode_scale=None,
          rounding="nearest", rht=False, generator=None, check=True, width=None, gather=None, groups=1,
          codes=True, dq_dtype=None, silu=None, norm=None, norm_residual=None, combine=None) -> _Cast:
    """Formula "te" or "vllm" through the Triton kernels: x any strided 2D view, the operand per (width,
    gather), ``groups`` row groups with their own tensor amax (tensor scaling). ``silu`` (up, mode): the
    operand is SiLU(x) * up (``quantize_silu_mul`` says where this is taken). ``norm`` (var, weight, eps,
    mode, y): the operand is the RMSNorm of x's rows, also stored in y (``quantize_rms_norm``); var None: the
    cast takes the mean itself (rows of 128 J, one per program), of x + residual with ``norm_residual``
    (residual, summed: where the sum goes); ``combine`` (``fused_ops.RoutedRows``, with var None): x's rows
    (contiguous) are first written by the pass itself, the experts' combine. ``dq_dtype`` float32 / bfloat16:
    also the dequantized values; float16 (beside the codes): the GEMM's fp16 form of them (``decode_f16``'s)."""
    r, c = x.shape
    cw = _operand_width(x, width, gather)
    if cw % ref.BLOCK:
        raise ValueError(f"NVFP4 needs the block dimension % 16 == 0; got {cw} (pad it with width=)")
    dev = x.device
    tile16 = tuple(tile) == (16, 16)
    rht_mode = (K.RHT_NONE if not rht else {torch.bfloat16: K.RHT_BF16, torch.float16: K.RHT_F16}
                .get(x.dtype, K.RHT_F32))
    row_amax = scaling == "row" and cw <= MAX_KP
    br, bc, warps, grid = _tiles(x, cw, tile16, scaling == "row")
    norm_j, inv_n = 0, 0.0
    if norm is not None and norm[0] is None:  # the mean in the cast: whole rows, one per program
        from .fused_ops import row_mean_factor
        if not (bc >= cw == c and c % 128 == 0 and x.stride(1) == 1 and gather is None):
            raise ValueError("the cast takes a norm's mean only over whole rows of 128 J unit-stride columns")
        br, norm_j, inv_n, grid = 1, c // 128, row_mean_factor(c), (r, 1)
    if combine is not None and not (norm_j and x.is_contiguous() and combine.y.stride(-1) == 1):
        raise ValueError("the cast takes the experts' combine only with the norm's mean, into contiguous rows")
    planes = (formula == "te" and not tile16 and scaling == "tensor" and x.stride(0) == 1 and x.stride(1) != 1
              and r > 1)
    if planes:
        pbr, nb, pwarps = PLANES_TILE
        pgrid = (triton.cdiv(r, pbr), triton.cdiv(cw // 16, nb))
    gather_t = gather.to(device=dev, dtype=torch.int32).contiguous() if gather is not None else x
    common = (r, c, cw, x.stride(0), x.stride(1))
    if check and gather is not None and gather.numel() and int(gather.max()) >= c:  # a host read: only checked
        raise ValueError(f"gather indexes column {int(gather.max())} of a {c}-column input")

    # --- the amax each row uses: rows_per_group rows share amax[row // rows_per_group]
    vllm, given_g = formula == "vllm", global_encode_scale is not None
    if scaling == "static":  # the amax, or vLLM's G itself
        rpg, n_groups = r, 1
        amax_t = ref._f32(global_encode_scale if given_g else amax, dev).reshape(1)  # as the reference rounds it
        if check and not vllm:  # vLLM's G = recip(inf / 2688) = 0 is finite; the kernel checks G
            ref.check_finite(amax_t, "amax")
    elif row_amax:
        rpg, n_groups, amax_t = 1, r, None
    else:  # tensor scaling (per group), or per-row amax of rows too wide for one program
        rpg, n_groups = (1, r) if scaling == "row" else (r // groups, groups)
        bits = torch.zeros(n_groups, dtype=torch.int32, device=dev)
        if planes and "amax" in PLANE_PASSES:
            P.amax_planes_kernel[pgrid](x, gather_t, bits, *common, rpg, BR=pbr, NB=nb, GATHER=gather is not None,
                                        RHT=rht_mode, TILE_IN_GROUP=rpg % pbr == 0, num_warps=pwarps)
        else:
            K._amax_kernel[grid](x, gather_t, bits, *common, rpg, BR=br, BC=bc, GATHER=gather is not None,
                                 RHT=rht_mode, TILE_IN_GROUP=rpg % br == 0, num_warps=warps,
                                 **_backend.pdl_meta(K._amax_kernel, dev))
        amax_t = bits.view(torch.float32)
        if check and not bool(torch.isfinite(amax_t).all()):
            raise ValueError("NVFP4 quantize: input contains NaN or Inf; refusing to produce codes")

    g = generator if generator is not None else torch.default_generator
    g_state = g.get_state() if (check and rounding == "stochastic") else None
    seed = _draw_seed(generator) if rounding == "stochastic" else 0
    out_codes = torch.empty(r, cw // 2, dtype=torch.uint8, device=dev) if codes else None
    out_scales = torch.empty(r, cw // 16, dtype=torch.float8_e4m3fn, device=dev) if codes else None
    sdec_rows = torch.empty(r, dtype=torch.float32, device=dev) if scaling == "row" else None
    sdec_groups = torch.empty(n_groups, dtype=torch.float32, device=dev)
    if dq_dtype == torch.float16:  # the GEMM's fp16 form (``weights.decode_f16``'s bits, K order, zero padding)
        if not codes or planes:
            raise ValueError("the cast writes the GEMM's fp16 form only beside the codes, in its row-tile kernel")
        kp = -(-cw // 128) * 128
        dq = (torch.empty if kp == cw else torch.zeros)(r, kp, dtype=dq_dtype, device=dev)
    else:
        dq = torch.empty(r, cw, dtype=dq_dtype, device=dev) if dq_dtype is not None else None
    check_here = check and (row_amax or scaling == "static" or vllm)  # else the amax pass has checked
    # NaN/Inf counts per program: the input's, and (vllm) G's
    bad = torch.empty(2 if vllm else 1, grid[0] * grid[1] if check_here else 1, dtype=torch.int32, device=dev)
    dummy = sdec_groups
    if r and cw and planes and "cast" in PLANE_PASSES:  # tensor scaling, "te": checked by the amax pass
        P.cast_planes_kernel[pgrid](
            x, gather_t, amax_t, out_codes.view(torch.int64) if codes else dummy,
            out_scales.view(torch.uint8) if codes else dummy, sdec_groups,
            dq.view(torch.int64) if dq is not None else dummy, *common, rpg, seed, BR=pbr, NB=nb,
            GATHER=gather is not None, RHT=rht_mode, STOCHASTIC=rounding == "stochastic", CODES=codes,
            DQ={None: K.DQ_NONE, torch.float32: K.DQ_F32, torch.bfloat16: K.DQ_BF16}[dq_dtype],
            num_warps=pwarps, enable_fp_fusion=False)
    elif r and cw:
        up = x if silu is None else silu[0]
        var, w, eps, norm_mode, y = norm if norm is not None else (dummy, x, 0.0, None, x)
        res, summed = norm_residual if norm_residual is not None and norm_residual[0] is not None else (x, x)
        comb = ((combine.y, combine.inv, combine.weights.contiguous(), combine.y.stride(0), combine.weights.shape[1])
                if combine is not None else (x, x, x, 0, 0))
        K._cast_kernel[grid](
            x, gather_t, amax_t if amax_t is not None else dummy,
            out_codes if codes else dummy, out_scales.view(torch.uint8) if codes else dummy,
            sdec_rows if sdec_rows is not None else dummy, sdec_groups,
            (dq.view(torch.int16) if dq_dtype == torch.bfloat16 else dq) if dq is not None else dummy, bad, up,
            var if var is not None else dummy, w, y, res, summed, *comb[:3], *common, up.stride(0), res.stride(0),
            comb[3], rpg, seed, eps, inv_n, BR=br, BC=bc, GATHER=gather is not None,
            RHT=rht_mode, TILE16=tile16,
            SILU_MUL=K.SILU_NONE if silu is None else {"hf": K.SILU_HF, "vllm": K.SILU_VLLM}[silu[1]],
            NORM=K.NORM_NONE if norm is None else {"hf": K.NORM_HF, "vllm": K.NORM_VLLM}[norm_mode],
            NORM_J=norm_j, NORM_RES=norm_j != 0 and res is not x, COMBINE_K=comb[4],
            ROW_AMAX=row_amax, STOCHASTIC=rounding == "stochastic", CODES=codes,
            DQ={None: K.DQ_NONE, torch.float32: K.DQ_F32, torch.bfloat16: K.DQ_BF16,
                torch.float16: K.DQ_F16_GEMM}[dq_dtype],
            CHECK=check_here, SDEC_ROWS=sdec_rows is not None,
            FORMULA=K.FORMULA_VLLM if vllm else K.FORMULA_TE, GIVEN_G=given_g, num_warps=warps,
            **_backend.pdl_meta(K._cast_kernel, dev),
            enable_fp_fusion=False)  # no FMA contraction: the reference rounds each op
    flags = bad.any(dim=1).tolist() if check_here else []  # one sync
    if any(flags):
        if g_state is not None:
            g.set_state(g_state)  # the reference raises before it draws
        what = "input" if flags[0] else "global_encode_scale"  # the reference checks the input first
        raise ValueError(f"NVFP4 quantize: {what} contains NaN or Inf; refusing to produce codes")
    return _Cast(out_codes, out_scales, sdec_rows, sdec_groups, dq)


def _kernel_path(x, formula, backend) -> bool:
    return (formula in ("te", "vllm") and K is not None and x.numel() > 0
            and _backend.resolve(backend, x.device) == "triton")


def _validate(x, width, gather, **kw):
    """The reference's argument checks, on the operand's shape (a meta tensor: nothing is built)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"quantize expects a 2D tensor [M, K], got {getattr(x, 'shape', type(x))}")
    shape = (x.shape[0], _operand_width(x, width, gather))
    ref._validate(torch.empty(shape, dtype=x.dtype, device="meta"), **kw)


def _to_nvfp4(cast: _Cast, scaling: str) -> ref.NVFP4Tensor:
    s_dec = cast.sdec_rows if scaling == "row" else cast.sdec_groups.reshape(())
    return ref.NVFP4Tensor(cast.codes, cast.scales, s_dec)


# --------------------------------------------------------------------------------------- entry points
def quantize(x: torch.Tensor, formula: str = "te", tile=(1, 16), scaling: str = "tensor", amax=None,
             global_encode_scale=None, rounding: str = "nearest", rht: bool = False,
             generator: torch.Generator | None = None, check: bool = True, backend: str | None = None,
             width: int | None = None, gather: torch.Tensor | None = None) -> ref.NVFP4Tensor:
    """``minite.nvfp4.quantize(operand(x, width, gather), ...)``, same bits; the Triton kernels for formulas
    "te" and "vllm" (any tile, scaling, rounding, RHT), the reference for "modelopt"."""
    kw = dict(formula=formula, tile=tile, scaling=scaling, amax=amax, global_encode_scale=global_encode_scale,
              rounding=rounding, rht=rht, generator=generator)
    _validate(x, width, gather, **kw)
    if not _kernel_path(x, formula, backend):
        return ref.quantize(operand(x, width, gather), check=check, **kw)
    cast = _cast(x, check=check, width=width, gather=gather, **kw)
    return _to_nvfp4(cast, scaling)


def _producer_kwargs(formula, tile, scaling, amax, global_encode_scale) -> dict:
    """The quantizer arguments of a cast with a fused producer: nearest rounding, no RHT."""
    return dict(formula=formula, tile=tile, scaling=scaling, amax=amax, global_encode_scale=global_encode_scale,
                rounding="nearest", rht=False, generator=None)


def _producer_fits(x, formula, tile, scaling, backend) -> bool:
    """Whether the cast kernel can compute its operand from ``x`` as it loads it (``SILU_MUL``, ``NORM``):
    formula "te" / "vllm" on the Triton path, 1x16 blocks, BF16 / FP16 input, and static scales or per-row
    scales of rows one program holds."""
    return (_kernel_path(x, formula, backend) and tuple(tile) == (1, 16) and x.dtype in (torch.bfloat16, torch.float16)
            and (scaling == "static" or (scaling == "row" and x.shape[-1] <= MAX_KP)))


def quantize_silu_mul(gate: torch.Tensor, up: torch.Tensor, mode: str, formula: str = "te", tile=(1, 16),
                      scaling: str = "tensor", amax=None, global_encode_scale=None, check: bool = True,
                      backend: str | None = None) -> ref.NVFP4Tensor:
    """``quantize(fused_ops.silu_mul(gate, up, mode), ...)`` bit for bit (nearest rounding, no RHT): one cast
    pass that computes SiLU(gate) * up as it loads (no [M, I] intermediate, one launch) where the kernel takes
    it, i.e. formula "te" / "vllm", 1x16 blocks, row scaling of rows one program holds or static scaling,
    gate / up 2D BF16 / FP16 views with contiguous rows (the two halves of a gate_up output); else the two
    calls."""
    from .fused_ops import _check_mode, silu_mul
    _check_mode(mode)
    kw = _producer_kwargs(formula, tile, scaling, amax, global_encode_scale)
    fused = (_producer_fits(gate, formula, tile, scaling, backend) and gate.dim() == 2 and gate.shape == up.shape
             and gate.dtype == up.dtype and gate.stride(1) == 1 and up.stride(1) == 1)
    if not fused:
        return quantize(silu_mul(gate, up, mode, backend=backend), check=check, backend=backend, **kw)
    _validate(gate, None, None, **kw)
    return _to_nvfp4(_cast(gate, check=check, silu=(up, mode), **kw), scaling)


def quantize_rms_norm(x, weight: torch.Tensor, eps: float, mode: str,
                      residual: torch.Tensor | None = None, formula: str = "te", tile=(1, 16),
                      scaling: str = "tensor", amax=None, global_encode_scale=None, check: bool = True,
                      backend: str | None = None, f16: bool = False) -> tuple:
    """(y, codes) or (y, residual + x, codes): ``fused_ops.rms_norm(x, weight, eps, mode, residual)`` and
    ``quantize(y.reshape(-1, H), ...)`` of its result, bit for bit (nearest rounding, no RHT). Where the kernels
    take it, the norm's last pass is the cast (one launch less; it still stores y for the norm's other
    readers): formula "te" / "vllm", 1x16 blocks, row scaling of rows one program holds or static scaling,
    BF16 / FP16 x with the weight in its dtype, and no residual in mode "vllm" (whose last pass also rounds
    the residual); else the two calls. With row scaling of rows of 128 J whose square pass would take the mean
    itself (``fused_ops.mean_in_pass``), the cast takes it too: the whole norm in one launch. ``x`` may be
    ``fused_ops.RoutedRows``: that one launch then also takes the experts' combine (where it is ``fusable``).
    ``f16``: where the cast is that pass, it also writes the codes' fp16 form for a GEMM that reads tokens so
    (``gemm.reads_f16_tokens``): the codes come as a ``DecodedNVFP4Tensor``, and that GEMM skips its own
    ``decode_f16`` pass (the same bits)."""
    from .fused_ops import RoutedRows, _check_mode, mean_in_pass, norm_prologue, norm_rows, rms_norm
    _check_mode(mode)
    kw = _producer_kwargs(formula, tile, scaling, amax, global_encode_scale)
    routed = isinstance(x, RoutedRows)
    fused = (_producer_fits(x.y if routed else x, formula, tile, scaling, backend) and len(x.shape) >= 2
             and weight.dtype == x.dtype and tuple(weight.shape) == tuple(x.shape[-1:])
             and (residual is None or (mode == "hf" and residual.dtype == x.dtype)))
    n = x.shape[-1]
    whole = fused and scaling == "row" and n % 128 == 0 and mean_in_pass(n, x.device)  # the norm in the cast
    if routed and not (whole and x.mode == mode and x.fusable()):
        x, routed = x.value(), False
    if not fused:
        out = rms_norm(x, weight, eps, mode, residual=residual, backend=backend)
        y = out if residual is None else out[0]
        a = quantize(y.reshape(-1, y.shape[-1]), check=check, backend=backend, **kw)
        return (y, a) if residual is None else (y, out[1], a)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if whole:
        combine = None
        if routed:  # the cast writes the combine's rows here first
            combine, x = x, torch.empty(x.shape, device=x.device, dtype=x.dtype)
        x2, res2, summed = norm_rows(x, mode, residual)
        _validate(x2, None, None, **kw)
        cast = _cast(x2, check=check, norm=(None, weight.contiguous(), eps, mode, y), norm_residual=(res2, summed),
                     combine=combine, dq_dtype=torch.float16 if f16 else None, **kw)
    else:
        src, var, summed = norm_prologue(x, mode, residual)
        _validate(src, None, None, **kw)
        cast = _cast(src, check=check, norm=(var, weight.contiguous(), eps, mode, y),
                     dq_dtype=torch.float16 if f16 else None, **kw)
    a = _to_nvfp4(cast, scaling)
    if f16:
        a = DecodedNVFP4Tensor(a.codes, a.scales, a.global_scale, cast.dq)
    return (y, a) if residual is None else (y, summed.view(x.shape), a)


def quantize_dequantize(x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, formula: str = "te",
                        tile=(1, 16), scaling: str = "tensor", amax=None, global_encode_scale=None,
                        rounding: str = "nearest", rht: bool = False, generator: torch.Generator | None = None,
                        check: bool = True, backend: str | None = None, width: int | None = None,
                        gather: torch.Tensor | None = None) -> torch.Tensor:
    """``minite.nvfp4.dequantize(quantize(x, ...)).to(out_dtype)`` (float32 or bfloat16): the values an
    emulated NVFP4 GEMM multiplies, written by the cast pass itself (no codes, no dequantize pass)."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize_dequantize: out_dtype must be float32 or bfloat16, got {out_dtype}")
    kw = dict(formula=formula, tile=tile, scaling=scaling, amax=amax, global_encode_scale=global_encode_scale,
              rounding=rounding, rht=rht, generator=generator)
    _validate(x, width, gather, **kw)
    if not _kernel_path(x, formula, backend):
        return ref.dequantize(ref.quantize(operand(x, width, gather), check=check, **kw)).to(out_dtype)
    return _cast(x, check=check, width=width, gather=gather, codes=False, dq_dtype=out_dtype, **kw).dq


def quantize_weight_groups(w: torch.Tensor, groups: int, tile=(16, 16), dq_dtype=torch.bfloat16,
                           check: bool = True, backend: str | None = None):
    """w [R, K] as ``groups`` row groups (experts x shards), each quantized like ``minite.nvfp4.quantize(
    piece, formula="te", tile=tile, scaling="tensor")`` -> (codes [R, K/2], scales [R, K/16], S_dec
    [groups], dequantized values [R, K] in dq_dtype). Two passes: the group amax, then the cast."""
    r, k = w.shape
    if groups < 1 or r % groups:
        raise ValueError(f"{r} rows do not split into {groups} equal groups")
    if tuple(tile) == (16, 16) and (r // groups) % 16:
        raise ValueError(f"16x16 tiles need rows per group % 16 == 0; got {r // groups}")
    if k % ref.BLOCK:
        raise ValueError(f"NVFP4 needs K % 16 == 0 (one E4M3 scale per 16 elements); got K = {k}")
    if not _kernel_path(w, "te", backend):
        return _weight_groups_torch(w, groups, tile, dq_dtype, check)
    cast = _cast(w, tile=tile, scaling="tensor", check=check, groups=groups, dq_dtype=dq_dtype)
    return cast.codes, cast.scales, cast.sdec_groups, cast.dq


def _weight_groups_torch(w, groups, tile, dq_dtype, check):
    """The same as the kernels in vectorised PyTorch: formula "te" per group of rows (the CPU path)."""
    r, k = w.shape
    x = w.to(torch.float32).view(groups, r // groups, k)
    if check:
        ref.check_finite(x, "weight")
    s_enc, s_dec = ref._te_global(x.abs().amax(dim=(1, 2)))                                   # [G]
    n = r // groups
    if tuple(tile) == (16, 16):
        bamax = x.abs().view(groups, n // 16, 16, k // 16, 16).amax(dim=(2, 4)).repeat_interleave(16, dim=1)
    else:
        bamax = x.abs().view(groups, n, k // 16, 16).amax(dim=-1)
    mult = s_enc * torch.tensor(1.0 / ref.FP4_MAX, dtype=torch.float32, device=w.device)
    s = torch.clamp(torch.clamp(bamax * mult[:, None, None], max=ref.FLT_MAX), -ref.E4M3_MAX, ref.E4M3_MAX)
    s = s.to(torch.float8_e4m3fn)
    enc = torch.clamp(1.0 / (s.to(torch.float32) * s_dec[:, None, None]), max=ref.FLT_MAX)
    v = torch.clamp(x.view(groups, n, k // 16, 16) * enc[..., None], -ref.FP4_MAX, ref.FP4_MAX).view(r, k)
    codes4 = ref._rne_e2m1_magnitude(v.abs()) | ((v < 0).to(torch.uint8) << 3)
    codes, scales = ref.pack_codes(codes4), s.view(r, k // 16)
    dq = None
    if dq_dtype is not None:
        vals = ref.e2m1_decode(codes4).view(groups, n, k // 16, 16)
        dq = ((vals * s.to(torch.float32)[..., None]) * s_dec[:, None, None, None]).view(r, k).to(dq_dtype)
    return codes, scales, s_dec, dq


def dequantize(t: ref.NVFP4Tensor, out_dtype: torch.dtype = torch.float32,
               backend: str | None = None) -> torch.Tensor:
    """``minite.nvfp4.dequantize(t).to(out_dtype)`` bit for bit, in one Triton pass on the GPU (out_dtype
    float32 or bfloat16); CPU tensors (and backend="torch") run the reference."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize: out_dtype must be float32 or bfloat16, got {out_dtype}")
    codes = t.codes
    if K is None or _backend.resolve(backend, codes.device) != "triton" or codes.dim() != 2:
        return ref.dequantize(t).to(out_dtype)
    m, k = t.shape
    g = t.global_scale.to(torch.float32).contiguous()
    y = torch.empty(m, k, dtype=out_dtype, device=codes.device)
    n_blocks = m * (k // ref.BLOCK)
    blk = 128
    if n_blocks:
        K._dequant_kernel[(triton.cdiv(n_blocks, blk),)](
            codes.contiguous(), t.scales.view(torch.uint8).contiguous(), g,
            y.view(torch.int16) if out_dtype == torch.bfloat16 else y, n_blocks, k // ref.BLOCK,
            BLK=blk, ROW_G=g.dim() == 1 and g.numel() > 1, OUT_BF16=out_dtype == torch.bfloat16, num_warps=4)
    return y
