"""NVFP4: the 4-bit format, and the quantizers of the engines this suite compares.

Format (NVIDIA NVFP4)
    element  E2M1: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3 (code 8 is "-0").
             Two codes per byte: element 2j in the LOW nibble of byte j, 2j+1 in the HIGH nibble.
    block    16 consecutive elements along K share one FP8 E4M3 scale (``torch.float8_e4m3fn``).
    global   one fp32 *decode* scale S_dec per tensor (shape []) or per row (shape [M]).
    value    x ~= e2m1(code) * float(block_scale) * S_dec

Formulas — which real engine each one reproduces, bit for bit (all arithmetic fp32):

    "te"        Transformer Engine 2.20's NVFP4 quantizer (``custom_recipes/reference_nvfp4.py`` and the
                CUDA cast it mirrors). S_enc = min(2688/amax, FLT_MAX), 1 if amax == 0 or S_enc == 0;
                S_dec = 1/S_enc; s = e4m3(clamp(block_amax * (S_enc * (1/6)), +-448)) [the product
                S_enc*(1/6) formed first]; enc = min(1/(float(s) * S_dec), FLT_MAX);
                code = RNE_e2m1(clamp(x * enc, +-6)). 16x16 tiles take block_amax over the tile.
                (amax == 0 -> S_enc = 1 is the CUDA kernel's rule, ``compute_global_encode_scaling_factor_FP4``;
                the Python reference would give FLT_MAX there. Codes and block scales are the same either way.)
    "vllm"      vLLM 0.33's runtime activation quantizer (``nvfp4_emulation_utils.ref_nvfp4_quant``).
                The engine stores the *encode* global scale G (static activations: G = 1/input_scale,
                input_scale = amax_calib/2688): s = e4m3(clamp(G * (block_amax * (1/6)), +-448));
                enc = recip(float(s) * recip(G)) with vLLM's zero guard recip(0) = 1/1e8;
                code = RNE_e2m1(clamp(x * enc, +-6)). S_dec = recip(G). (vLLM's fused Triton quant-dequant
                kernel, used instead on CUDA, forms enc = G / s; this module follows ``ref_nvfp4_quant``.)
    "modelopt"  NVIDIA ModelOpt 0.47's NVFP4 weight export (the checkpoint vLLM loads):
                weight_scale_2 = amax/2688 (= S_dec); b = block_amax / (6 * weight_scale_2), b = 1 where
                b == 0; s = e4m3(clamp(b, 2**-9, 448)); code = RNE_e2m1(x / (float(s) * weight_scale_2))
                (a true division, not a reciprocal multiply). ModelOpt itself has no 448 clamp on this path
                (b <= ~448 when amax is the tensor's own) and gives NaN scales for an all-zero tensor
                (0/0); here the clamp always applies and an all-zero tensor gets scale 1, codes 0.

RNE_e2m1 ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
A negative value that rounds to zero gets code 8, as TE's cast does (``-0.0`` itself gets code 0).

Options
    tile        (1, 16) along K, or (16, 16) 2D weight tiles (M % 16 == 0; scale repeated on the tile's rows).
    scaling     "tensor": dynamic amax over the whole tensor; "row": one amax (one S_dec) per row, TE's
                row-scaled / per-token recipe; "static": amax given (``amax=``) or, for "vllm", G given
                (``global_encode_scale=``) — inputs beyond it clip.
    rounding    "nearest" (RNE) or "stochastic": each element rounds to one of its two neighbouring grid
                points with probability proportional to closeness (unbiased inside [-6, 6]). The random
                bits are a counter hash of (seed, element index) with the seed drawn from ``generator``, so
                the same generator state gives the same codes here and in the Triton kernel. (TE draws its
                bits from Philox: the distribution matches TE, the stream does not.)
    rht         16-point random Hadamard transform along K before quantizing, as Transformer Engine's NVFP4
                reference does it (``NVFP4QuantizerRef._apply_rht``; TE applies it to the wgrad operands): y =
                x.view(-1, 16) @ (diag(sign) @ H16 / 4), TE's fixed sign vector, computed in the INPUT's dtype -- a
                BF16 input gives BF16 transformed values -- and the global and block amax are taken AFTER the
                transform, from those rounded values. What is bit-defined here: the products x_i * (+-1/4) are
                exact; the 16-term sum is a fixed 4-stage butterfly in float64 (bit 0 of the index first; exact
                while a block spans < 41 binades for BF16 inputs, < 29 for fp32, one fixed rounding order beyond),
                scaled by 1/4, rounded once to fp32, then (BF16 / FP16 inputs) once more to the input dtype,
                round-to-nearest-even each time. TE's reference matmul sums in fp32 (cuBLAS; its CUDA kernel:
                ``wmma ... f32.bf16.bf16.f32``, ``cvt.rn.bf16x2.f32``) in an order it does not define. The two
                agree bit for bit whenever that fp32 sum is exact, which it is in ANY order for a BF16 block whose
                nonzero values span at most 12 binades (each term is a multiple of 2**(e-7) below 2**(E+1); 16 of
                them need E - e + 12 <= 24 bits), and otherwise whenever TE's fp32 rounding error does not reach a
                BF16 rounding boundary of the result. That fails only for blocks that span many binades AND cancel
                (the error scales with the largest term, not the result): 0 of 655k values on Gaussian data, ~1e-5
                of values on log-normal(sigma=3) data, against TE's own op (torch's BF16 matmul); minite then holds
                the correctly rounded value. FP32 inputs stay fp32 (exact sum rounded once; TE's fp32 sum is rarely
                exact, so these agree with TE up to its summation order). Other dtypes are converted to fp32 first.

Constraints: x is 2D [M, K] with K % 16 == 0, any float dtype (converted to fp32 first, the RHT aside);
NaN/Inf input raises (``check=True``), as do a negative/non-finite static ``amax`` and a non-positive
``global_encode_scale``.
torch's own fp32 -> float8_e4m3fn cast is not saturating on every build/device (470 -> NaN), hence the clamps.
Everything here is pure PyTorch and runs on CPU and GPU; ``minite.kernels`` holds the fast versions, which
are tested for bit equality against this module.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "NVFP4Tensor", "quantize", "dequantize", "nvfp4_matmul_reference", "FORMULAS", "E2M1_VALUES",
    "e2m1_decode", "pack_codes", "unpack_codes", "rht16", "rht_dtype", "rht_matrix", "stochastic_uniform",
    "check_finite",
]

FORMULAS = ("te", "vllm", "modelopt")
SCALINGS = ("tensor", "row", "static")
ROUNDINGS = ("nearest", "stochastic")
BLOCK = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
#: code -> value, codes 0..15 (8..15 negative; 8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: TE's fixed RHT sign vector (``get_wgrad_sign_vector``).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@dataclass
class NVFP4Tensor:
    """A quantized 2D tensor [M, K]: packed codes, per-16 E4M3 block scales, fp32 decode global scale."""

    codes: torch.Tensor          # uint8 [M, K // 2]
    scales: torch.Tensor         # float8_e4m3fn [M, K // 16]
    global_scale: torch.Tensor   # float32 [] (per tensor) or [M] (per row): S_dec

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 2)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device) -> "NVFP4Tensor":
        return NVFP4Tensor(self.codes.to(device), self.scales.to(device), self.global_scale.to(device))

    def row_global_scale(self) -> torch.Tensor:
        """S_dec as a float32 [M] vector, whichever form it is stored in."""
        return self.global_scale.expand(self.shape[0]) if self.global_scale.dim() == 0 else self.global_scale

    def rows(self, start: int, stop: int) -> "NVFP4Tensor":
        """Rows ``start:stop`` (views, no copy): codes and block scales sliced, a per-row global scale sliced
        with them, a per-tensor one kept as it is."""
        g = self.global_scale if self.global_scale.dim() == 0 else self.global_scale[start:stop]
        return NVFP4Tensor(self.codes[start:stop], self.scales[start:stop], g)

    def take(self, idx: torch.Tensor) -> "NVFP4Tensor":
        """Rows ``idx`` (an int index tensor; a copy): codes, block scales and a per-row global scale
        gathered, a per-tensor one kept. The codes of ``x[idx]`` when x was quantized per row or with a
        static scale (and with tensor scaling when every row of x is in idx: the same amax)."""
        g = self.global_scale if self.global_scale.dim() == 0 else self.global_scale[idx]
        return NVFP4Tensor(self.codes[idx], self.scales[idx], g)


# ----------------------------------------------------------------------------------------------- helpers
def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise ValueError if x holds NaN or Inf (one reduction; a device sync on GPU)."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"NVFP4 quantize: {what} contains NaN or Inf; refusing to produce codes")


def _f32(v, device) -> torch.Tensor:
    # a Python number becomes a fill on the device (no host-to-device copy: CUDA-graph capturable)
    if isinstance(v, (int, float)):
        return torch.full((), v, dtype=torch.float32, device=device)
    return torch.as_tensor(v, dtype=torch.float32, device=device)


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def e2m1_decode(codes4: torch.Tensor) -> torch.Tensor:
    """Unpacked 4-bit codes (any integer dtype) -> float32 values."""
    return _e2m1_table(codes4.device)[codes4.long()]  # the table made once per device (graph capturable)


def pack_codes(codes4: torch.Tensor) -> torch.Tensor:
    """[M, K] codes 0..15 -> uint8 [M, K/2]; element 2j in the low nibble."""
    c = codes4.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [M, K/2] -> uint8 codes [M, K]."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def _rne_e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """|v| in [0, 6] -> magnitude code 0..7, round to nearest, ties to even code (TE's cast thresholds)."""
    return ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0))


_HASH_C1, _HASH_C2 = 0x7FEB352D, 0x297A2D39  # odd, < 2**31 so int64 products never overflow
_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values < 2**32 (the Triton kernel does the same on
    uint32, where the multiplies wrap)."""
    x = x ^ (x >> 16)
    x = (x * _HASH_C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _HASH_C2) & _M32
    return x ^ (x >> 16)


def stochastic_uniform(seed: int, n_rows: int, n_cols: int, device) -> torch.Tensor:
    """Uniform [0, 1) fp32 on a 24-bit grid for element (i, j), from hash(hash(i*n_cols + j) ^ seed)."""
    idx = torch.arange(n_rows * n_cols, dtype=torch.int64, device=device) & _M32
    h = _hash32(_hash32(idx) ^ (int(seed) & _M32))
    return ((h >> 8).to(torch.float32) * (2.0 ** -24)).view(n_rows, n_cols)


def _sr_e2m1_magnitude(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """|v| in [0, 6] -> code of the lower or upper neighbour; up with probability (a - lo) / (hi - lo)."""
    lo_code = ((a >= 0.5).to(torch.uint8) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0)
               + (a >= 4.0) + (a >= 6.0))
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=a.device)
    lo = grid[lo_code.long()]
    inv_step = torch.where(a < 2.0, 2.0, torch.where(a < 4.0, 1.0, 0.5))  # exact powers of two
    frac = (a - lo) * inv_step  # exact: Sterbenz on (a - lo), power-of-two scaling
    up = (u < frac) & (lo_code < 7)
    return lo_code + up.to(torch.uint8)


def rht_matrix(device=None, dtype=torch.float64) -> torch.Tensor:
    """diag(sign) @ H16 / 4 (orthonormal: M M^T = I)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float64)
    return ((signs[:, None] * h) / 4.0).to(device=device, dtype=dtype)


def _butterfly16(y: torch.Tensor) -> torch.Tensor:
    """H16 @ v for every 16-vector along the last dim of a float64 tensor (unnormalised Sylvester H16): four
    stages a+b / a-b, index bit 0 first — the one order minite.kernels follows too."""
    shape = y.shape
    for h in (1, 2, 4, 8):
        y = y.reshape(-1, BLOCK // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2)
    return y.reshape(shape)


def rht_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the transformed values are rounded to: the input's for BF16 / FP16 (as TE), else fp32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def rht16(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """16-point RHT along the last dim (multiple of 16) in x's precision (module docstring): exact float64
    butterfly of sign-flipped inputs, times 1/4, rounded to fp32, then to BF16 / FP16 for such inputs."""
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float64, device=x.device)
    y = x.to(torch.float32).to(torch.float64).reshape(-1, BLOCK)
    if not inverse:        # x @ (diag(s) H / 4): flip the inputs
        y = y * signs
    y = _butterfly16(y) * 0.25
    if inverse:            # x @ (H diag(s) / 4): flip the outputs
        y = y * signs
    return y.to(torch.float32).to(rht_dtype(x.dtype)).reshape(x.shape)


# ------------------------------------------------------------------------------------------- quantize
def _validate(x, formula, tile, scaling, amax, global_encode_scale, rounding, rht, generator):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"quantize expects a 2D tensor [M, K], got {getattr(x, 'shape', type(x))}")
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating-point tensor, got {x.dtype}")
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"NVFP4 needs K % 16 == 0 (one E4M3 scale per 16 elements); got K = {k}")
    if formula not in FORMULAS:
        raise ValueError(f"unknown formula {formula!r}; expected one of {FORMULAS}")
    try:
        tile = tuple(int(t) for t in tile)
    except TypeError:
        raise ValueError(f"tile must be (1, 16) or (16, 16), got {tile!r}") from None
    if tile not in ((1, 16), (16, 16)):
        raise ValueError(f"tile must be (1, 16) or (16, 16), got {tile}")
    if tuple(tile) == (16, 16) and m % 16:
        raise ValueError(f"16x16 tiles need M % 16 == 0; got M = {m}")
    if scaling not in SCALINGS:
        raise ValueError(f"unknown scaling {scaling!r}; expected one of {SCALINGS}")
    if scaling == "row" and tuple(tile) == (16, 16):
        raise ValueError("row scaling gives each row its own global scale; it cannot share 16x16 tiles")
    if scaling == "static":
        if formula == "vllm":
            if (amax is None) == (global_encode_scale is None):
                raise ValueError('formula "vllm" with static scaling takes exactly one of amax= or '
                                 'global_encode_scale= (G = 2688 / amax, as vLLM stores it)')
        elif amax is None:
            raise ValueError(f'static scaling with formula "{formula}" needs amax=')
    elif amax is not None or global_encode_scale is not None:
        raise ValueError(f'amax= / global_encode_scale= are for scaling="static", not "{scaling}"')
    if global_encode_scale is not None and formula != "vllm":
        raise ValueError('global_encode_scale= is vLLM\'s stored form; use amax= with this formula')
    for name, v, ok in (("amax", amax, lambda t: t >= 0), ("global_encode_scale", global_encode_scale,
                                                           lambda t: t > 0)):
        if v is not None:
            t = torch.as_tensor(v, dtype=torch.float64)
            if t.numel() != 1 or not bool(torch.isfinite(t).all()) or not bool(ok(t).all()):
                raise ValueError(f"static {name} must be one finite number {'>= 0' if name == 'amax' else '> 0'}"
                                 f", got {v!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {ROUNDINGS}")
    if rht and tuple(tile) != (1, 16):
        raise ValueError("RHT is defined along K for 1x16 blocks only")


def _global_amax(x32: torch.Tensor, scaling: str, amax) -> torch.Tensor:
    """fp32 amax: [] for tensor/static, [M] for row."""
    if scaling == "tensor":
        return x32.abs().amax()
    if scaling == "row":
        return x32.abs().amax(dim=1)
    return _f32(amax, x32.device).reshape(())


def _block_amax(x32: torch.Tensor, tile) -> torch.Tensor:
    """[M, K/16] amax of each 1x16 block, or of its 16x16 tile repeated on the tile's rows."""
    m, k = x32.shape
    if tuple(tile) == (1, 16):
        return x32.abs().view(m, k // BLOCK, BLOCK).amax(dim=-1)
    t = x32.abs().view(m // 16, 16, k // BLOCK, BLOCK).amax(dim=(1, 3))
    return t.repeat_interleave(16, dim=0)


def _te_global(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s_enc = torch.clamp(_f32(FP4_MAX * E4M3_MAX, amax.device) / amax, max=FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    return s_enc, 1.0 / s_enc


def _vllm_recip(v: torch.Tensor) -> torch.Tensor:
    # vLLM: 1.0 / (x + (x == 0) * 1e8) — graph-capture-safe zero guard
    return 1.0 / (v + (v == 0).to(torch.float32) * 1e8)


def _col(v: torch.Tensor) -> torch.Tensor:
    """Broadcast a [] or [M] global against [M, K/16] block tensors."""
    return v if v.dim() == 0 else v[:, None]


def quantize(x: torch.Tensor, formula: str = "te", tile=(1, 16), scaling: str = "tensor", amax=None,
             global_encode_scale=None, rounding: str = "nearest", rht: bool = False,
             generator: torch.Generator | None = None, check: bool = True) -> NVFP4Tensor:
    """Quantize a 2D float tensor [M, K] to NVFP4 exactly as ``formula``'s engine does (module docstring)."""
    _validate(x, formula, tile, scaling, amax, global_encode_scale, rounding, rht, generator)
    m, k = x.shape
    if check:
        check_finite(x)
    x32 = x.to(torch.float32)
    if rht:  # in the input's precision (BF16 in, BF16 out), then every amax from the transformed values
        x32 = rht16(x if x.dtype in (torch.bfloat16, torch.float16) else x32).to(torch.float32)
        if check:  # 16 inputs near FLT_MAX can sum past it
            check_finite(x32, "RHT(input)")
    dev = x32.device

    # --- global scale and block scales, per formula
    if formula == "vllm":
        if scaling == "static" and global_encode_scale is not None:
            g = _f32(global_encode_scale, dev).reshape(())
        else:  # as vLLM builds it from a checkpoint: input_scale = amax / 2688, G = 1 / input_scale
            g = _vllm_recip(_global_amax(x32, scaling, amax) / _f32(FP4_MAX * E4M3_MAX, dev))
        if check:
            check_finite(g, "global_encode_scale")
        bamax = _block_amax(x32, tile)
        s = torch.clamp(_col(g) * (bamax * _f32(1.0 / FP4_MAX, dev)), -E4M3_MAX, E4M3_MAX)
        s = s.to(torch.float8_e4m3fn)
        s_dec = _vllm_recip(g)
        enc = _vllm_recip(s.to(torch.float32) * _col(s_dec))
        v = torch.clamp(x32.view(m, k // BLOCK, BLOCK) * enc[..., None], -FP4_MAX, FP4_MAX)
    else:
        gamax = _global_amax(x32, scaling, amax)
        if check:
            check_finite(gamax, "amax")
        bamax = _block_amax(x32, tile)
        if formula == "te":
            s_enc, s_dec = _te_global(gamax)
            mult = s_enc * _f32(1.0 / FP4_MAX, dev)  # S_enc * (1/6), formed first
            s = torch.clamp(torch.clamp(bamax * _col(mult), max=FLT_MAX), -E4M3_MAX, E4M3_MAX)
            s = s.to(torch.float8_e4m3fn)
            enc = torch.clamp(1.0 / (s.to(torch.float32) * _col(s_dec)), max=FLT_MAX)
            v = torch.clamp(x32.view(m, k // BLOCK, BLOCK) * enc[..., None], -FP4_MAX, FP4_MAX)
        else:  # modelopt
            s_dec = gamax / _f32(FP4_MAX * E4M3_MAX, dev)  # weight_scale_2
            b = bamax / (_col(s_dec) * FP4_MAX)
            # ModelOpt's b == 0 -> 1; an all-zero tensor (S_dec == 0, b = 0/0) takes the same path
            b = torch.where((b == 0) | (_col(s_dec) == 0), torch.ones_like(b), b)
            s = torch.clamp(b, 2.0 ** -9, E4M3_MAX).to(torch.float8_e4m3fn)
            denom = s.to(torch.float32) * _col(s_dec)
            v = x32.view(m, k // BLOCK, BLOCK) / denom[..., None]
            # all-zero tensor/row: S_dec = 0 and x = 0, so 0/0; those elements are code 0
            v = torch.clamp(torch.nan_to_num(v, nan=0.0, posinf=FP4_MAX, neginf=-FP4_MAX), -FP4_MAX, FP4_MAX)

    v = v.reshape(m, k)
    a = v.abs()
    if rounding == "nearest":
        mag = _rne_e2m1_magnitude(a)
    else:
        g = generator if generator is not None else torch.default_generator
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g, device=g.device).item())
        mag = _sr_e2m1_magnitude(a, stochastic_uniform(seed, m, k, dev))
    codes4 = mag | ((v < 0).to(torch.uint8) << 3)
    return NVFP4Tensor(pack_codes(codes4), s.contiguous(), s_dec.to(torch.float32).contiguous())


def dequantize(t: NVFP4Tensor) -> torch.Tensor:
    """float32 [M, K] = e2m1(code) * float(scale) * global_scale (the first product is exact)."""
    m, k = t.shape
    vals = e2m1_decode(unpack_codes(t.codes)).view(m, k // BLOCK, BLOCK)
    blk = vals * t.scales.to(torch.float32)[..., None]
    g = t.global_scale.to(torch.float32)
    return (blk * (g if g.dim() == 0 else g[:, None, None])).reshape(m, k)


def nvfp4_matmul_reference(a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
    """float32 a @ b.T, the oracle for every GEMM kernel: block products are exact, the K-sum is float64,
    global scales applied in float64, one rounding to fp32 at the end."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"K mismatch: a is {a.shape}, b is {b.shape}")

    def unscaled(t):
        m, k = t.shape
        vals = e2m1_decode(unpack_codes(t.codes)).view(m, k // BLOCK, BLOCK).to(torch.float64)
        return (vals * t.scales.to(torch.float64)[..., None]).reshape(m, k)

    acc = unscaled(a) @ unscaled(b).T
    ga = a.row_global_scale().to(torch.float64)
    gb = b.row_global_scale().to(torch.float64)
    return (acc * ga[:, None] * gb[None, :]).to(torch.float32)
