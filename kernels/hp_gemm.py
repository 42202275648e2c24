"""Batch-invariant BF16 GEMM for the high-precision linears on log-prob paths (router, lm_head).

    invariant_gemm(x, w, bias=None, backend=None, config=None, out_dtype=None) -> [M, N] = x @ w.T (+ bias),
        rounded to x's dtype; stored as ``out_dtype`` (float32: the same values, for an fp32 softmax: the router)
    invariant_gemm_parts(x, w, backend=None) -> [S, M, N] fp32 | None: its split-K partial sums, where it
        splits K (the router), for a consumer that adds them itself (the routing kernel)
    sum_parts(parts, dtype, out_dtype=None) -> [M, N]: the sum pass of those parts, invariant_gemm's bits

Row i's bits do not depend on M (or on the run): batch invariance comes from a fixed reduction order, not
from extra precision. Every config does bf16 x bf16 -> fp32 tensor-core dots over the same K steps (BK = 64,
k = 0, 64, 128, ... in order, one fp32 accumulator per output), then adds the bias in fp32 and rounds once.
Split-K is used only for narrow N (the router) and is then a function of (N, K) alone, never of M: the
partial sums of fixed K ranges are added in split order by a second kernel. Tile sizes change with M; a
config other than SAFE_CONFIG is used only after a first-use probe on this GPU gives bitwise the same output
(``_probe.proven``). Memory-bound at decode sizes (M <= 64: the weight is streamed once by thousands of
programs over N), compute-bound at tens of thousands of rows (128x256 tiles).

backend: None / "auto" (Triton for CUDA bf16/fp16 operands, else PyTorch), "triton" (CPU under
TRITON_INTERPRET=1), "torch": the exact path, x.double() @ w.double().T (+ bias), rounded once — exact for
BF16 products and sums of realistic range, so batch invariant too, and what CPU engines run.
"""
from __future__ import annotations

import torch

from . import _backend, _probe

BK = 64  # K step of every config: part of the batch-invariance contract
SAFE_CONFIG = dict(BM=64, BN=64, GROUP_M=8, num_warps=4, num_stages=4)
SMALL_CONFIG = dict(BM=16, BN=64, GROUP_M=1, num_warps=4, num_stages=6)     # M <= 16: stream the weight
# M <= 64 over a wide N (the lm_head): 128 weight rows a program, three stages (three programs an SM). H200,
# CUDA-graph medians of five rounds, 151,936 x 2048 at M = 16 / 32 / 48 / 64: 149.3 / 151.0 / 153.5 / 155.3
# us against 152.0 (SMALL_CONFIG) / 153.0 / 155.4 / 157.3 (SAFE_CONFIG)
DECODE_CONFIG = dict(BM=64, BN=128, GROUP_M=1, num_warps=4, num_stages=3)
DECODE_MIN_N = 32768  # vocabulary-wide: many waves of programs (narrower N keeps more, smaller programs)
MID_CONFIG = dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=4)     # M <= 1024, or narrow N
BIG_CONFIG = dict(BM=128, BN=256, GROUP_M=8, num_warps=8, num_stages=3)     # 144 KB of smem
INTERPRET_CONFIG = dict(BM=16, BN=32, GROUP_M=4, num_warps=4, num_stages=1)
SPLIT_K_MIN_TILES = 32   # below this many 64-wide N tiles, split K (a function of N and K only)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_k(n: int, k: int) -> int:
    """K splits for an [N, K] weight: 1 unless N gives fewer than SPLIT_K_MIN_TILES 64-wide tiles (the router:
    N = 128 -> 8 splits of 256). Never a function of M."""
    tiles = _cdiv(n, 64)
    if tiles >= SPLIT_K_MIN_TILES:
        return 1
    s = 1
    while s * 2 * tiles <= SPLIT_K_MIN_TILES and s * 2 * 4 * BK <= k and s < 16:
        s *= 2
    return s


def _configs(m: int, n: int) -> tuple[dict, ...]:
    """Candidate tile configs for M rows, fastest first (each is probed before use)."""
    if m <= 64 and n >= DECODE_MIN_N:
        return (DECODE_CONFIG, SMALL_CONFIG) if m <= 16 else (DECODE_CONFIG,)
    if m <= 16:
        return (SMALL_CONFIG,)
    if m <= 64:
        return ()
    if m <= 1024 or n <= 512:
        return (MID_CONFIG,)
    return (BIG_CONFIG, MID_CONFIG)


def _launch(x, w, bias, out, cfg: dict, splits: int, round_to_x: bool = False, add_parts: bool = True):
    """The GEMM into ``out`` (split K: partial sums, then the sum pass); add_parts False: return the [S, M, N]
    partial sums, no sum pass (``out`` unused)."""
    from ._triton_hp_gemm import invariant_mm_kernel
    m, k = x.shape
    n = w.shape[0]
    cfg = dict(cfg)
    bm, bn, group = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("GROUP_M")
    k_per = _cdiv(_cdiv(k, splits), BK) * BK  # whole BK steps: every split starts on the same K grid
    part = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else part
    grid = (_cdiv(m, bm) * _cdiv(n, bn), splits)
    invariant_mm_kernel[grid](x, w, bias_arg, part if out is None else out, part, m, n, k, k_per, x.stride(0),
                              x.stride(1), w.stride(0), w.stride(1), HAS_BIAS=has_bias, SPLIT_K=splits, BM=bm,
                              BN=bn, BK=BK, GROUP_M=group, UPCAST_DOT=_backend.interpreter_on(),
                              ROUND_TO_X=round_to_x, **cfg,
                              **_backend.pdl_meta(invariant_mm_kernel, x.device))
    if splits == 1:
        return out
    if not add_parts:
        return part
    return _sum(part, bias, out, x, round_to_x)


def _sum(part, bias, out, x, round_to_x: bool) -> torch.Tensor:
    """out = part[0] + part[1] + ... in split order, + bias, rounded once (to x's dtype with round_to_x)."""
    from ._triton_hp_gemm import split_k_sum_kernel
    splits, m, n = part.shape
    block = 1024
    split_k_sum_kernel[(_cdiv(m * n, block),)](part, part if bias is None else bias, out, x, m, n,
                                                HAS_BIAS=bias is not None, SPLIT_K=splits, BLOCK=block,
                                                ROUND_TO_X=round_to_x, num_warps=4,
                                                **_backend.pdl_meta(split_k_sum_kernel, x.device))
    return out


def _probe_config(cfg: dict, device, dtype) -> bool:
    """cfg vs SAFE_CONFIG on a random [300, 1000] x [384, 1000] problem (K % BK != 0: the masked tail too),
    fp32 output (compares the accumulator bits before the final rounding)."""
    g = torch.Generator(device="cpu").manual_seed(4321)
    x = (torch.randn(300, 1000, generator=g) * 3).to(device=device, dtype=dtype)
    w = torch.randn(384, 1000, generator=g).to(device=device, dtype=dtype)
    got = _launch(x, w, None, torch.empty(300, 384, device=device), cfg, 1)
    want = _launch(x, w, None, torch.empty(300, 384, device=device), SAFE_CONFIG, 1)
    return bool(torch.equal(got, want))


def pick_config(m: int, n: int, device: torch.device, dtype=torch.bfloat16) -> dict:
    if device.type == "cpu":
        return dict(INTERPRET_CONFIG)
    for cfg in _configs(m, n):
        key = "hp_gemm:" + ",".join(f"{k}={v}" for k, v in sorted(cfg.items())) + f":{dtype}"
        if _probe.proven(key, device, lambda c=cfg: _probe_config(c, device, dtype)):
            return dict(cfg)
    return dict(SAFE_CONFIG)


def config_status() -> dict:
    """{config: proven bit-equal to SAFE_CONFIG on this GPU} for the configs probed so far."""
    return _probe.verdicts("hp_gemm:")


def reference_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The exact path: float64 products and sums (exact for BF16 inputs of realistic range), one rounding."""
    y = torch.matmul(x.to(torch.float64), w.to(torch.float64).T)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(x.dtype)


def invariant_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   backend: str | None = None, config: dict | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """See the module docstring. x [M, K], w [N, K] (any strides), bias [N] or None. The Triton path needs x
    and w of one dtype, bf16 or fp16; other dtypes take the exact path. ``config``: benchmarking only.
    ``out_dtype``: None (x's) or float32 (x's values, stored wider)."""
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, x's dtype or float32, not {out_dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [M, K] and w [N, K]; got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.device != w.device or (bias is not None and (bias.shape != (w.shape[0],) or bias.device != w.device)):
        raise ValueError(f"x, w (and bias [{w.shape[0]}]) must share a device")
    if not _triton_operands(x, w, backend):
        return reference_gemm(x, w, bias).to(out_dtype or x.dtype)
    m, n = x.shape[0], w.shape[0]
    wide = out_dtype not in (None, x.dtype)
    out = torch.empty(m, n, dtype=out_dtype if wide else x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg = dict(config) if config else pick_config(m, n, x.device, x.dtype)
    return _launch(x, w, bias, out, cfg, split_k(n, x.shape[1]), round_to_x=wide)


def _triton_operands(x: torch.Tensor, w: torch.Tensor, backend: str | None) -> bool:
    return (_backend.resolve(backend, x.device) == "triton" and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16))


def invariant_gemm_parts(x: torch.Tensor, w: torch.Tensor, backend: str | None = None) -> torch.Tensor | None:
    """The split-K partial sums [S, M, N] (fp32) of ``invariant_gemm(x, w)`` where its Triton path splits K
    (narrow N: the router), else None. Added in split order and rounded to x's dtype (``sum_parts``, or a
    consumer doing the same: the routing kernel) they give invariant_gemm's bits."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.device != w.device:
        raise ValueError(f"expected x [M, K] and w [N, K] on one device; got {tuple(x.shape)}, {tuple(w.shape)}")
    m, n = x.shape[0], w.shape[0]
    splits = split_k(n, x.shape[1])
    if splits == 1 or m == 0 or not _triton_operands(x, w, backend):
        return None
    return _launch(x, w, None, None, pick_config(m, n, x.device, x.dtype), splits, add_parts=False)


def sum_parts(parts: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """parts [S, M, N] fp32 -> their sum in split order, rounded to ``dtype``, stored as ``out_dtype`` (default
    ``dtype``; float32: the same values): invariant_gemm's output for the x of that dtype."""
    out = torch.empty(parts.shape[1:], dtype=out_dtype or dtype, device=parts.device)
    if parts.device.type != "cuda" and not _backend.interpreter_on():  # the same adds and rounding in torch
        acc = parts[0].clone()
        for s in range(1, parts.shape[0]):
            acc += parts[s]
        return out.copy_(acc.to(dtype))
    return _sum(parts, None, out, parts.new_empty(1, dtype=dtype), out_dtype not in (None, dtype))
