"""Public NVFP4 GEMMs: ``nvfp4_gemm`` (a @ w.T) and ``grouped_nvfp4_gemm`` (MoE, one GEMM launch for all experts).

Paths, chosen per call (``_backend.resolve`` + the device's capability):
    Hopper / older CUDA, and CPU with backend="triton" (interpreter): ``_triton_gemm`` (decode to fp16,
        tensor-core dot, fp32 accumulate, one fixed K order: batch invariant); few token rows (decode) on the
        GPU: ``_cuda_decode`` (same values, same mma, same K order; used once a probe proved it bit-equal).
    Blackwell (sm_100/103): ``blackwell`` (torch._scaled_mm on float4_e2m1fn_x2, global scales after).
    CPU (default) or no Triton: ``_torch_gemm`` (exact float64 chunks, batch invariant).
K order (one switch for every Hopper path, ``k_chunk``): one fp32 chain over all of K (default), or fixed K
chunks, each summed from zero, the chunk sums added in chunk order (lets the decode kernel spread one row's K
over several warps: all SMs busy at M = 1). Either way a row's bits do not depend on M. The CPU path is exact
under both (its float64 sums have no rounding to order).
"""
from __future__ import annotations

import os

import torch

from minite.nvfp4 import NVFP4Tensor

from . import _backend, _torch_gemm, blackwell
from .weights import (DecodedNVFP4Tensor, NVFP4Experts, PreparedWeight, _check_tensor, _u8,  # noqa: F401
                      decode_f16, gemm_path, prepare_experts, prepare_weight, stack_experts)

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_common(a, k_w: int, device, out_dtype) -> None:
    _check_tensor(a, "a")
    if a.shape[1] != k_w:
        raise ValueError(f"K mismatch: a is {a.shape}, weights have K = {k_w}")
    if a.device != device:
        raise ValueError(f"a is on {a.device}, weights on {device}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


# ------------------------------------------------------------------------------ the K-chunk contract
K_CHUNK_ENV = "MINITE_KERNELS_K_CHUNK"
_k_chunk: int | None = None  # set_k_chunk() overrides the environment


def _check_k_chunk(kc: int) -> int:
    steps = kc // 128
    if kc < 0 or kc % 128 or (steps & (steps - 1)):
        raise ValueError(f"K chunk must be 0 (one chain over K) or 128 * 2**i, got {kc}")
    return kc


def k_chunk() -> int:
    """The K order every Hopper GEMM path follows: 0 = one fp32 chain over K (the default), else the width of
    the fixed K chunks (a sum per chunk from zero, the chunk sums added in order). From ``set_k_chunk`` or the
    environment variable MINITE_KERNELS_K_CHUNK."""
    if _k_chunk is not None:
        return _k_chunk
    return _check_k_chunk(int(os.environ.get(K_CHUNK_ENV, "0") or 0))


def set_k_chunk(kc: int | None) -> None:
    """Switch the K-order contract of every path at once (None: back to the environment's). Results computed
    under different contracts differ in the last bits; within one they do not depend on M."""
    global _k_chunk
    _k_chunk = None if kc is None else _check_k_chunk(int(kc))


# ----------------------------------------------------------------------------------- Triton launch
# The safe config: the reference every other config is probed against (and the fallback for any config not
# proven bit-equal on this GPU).
SAFE_CONFIG = dict(BM=64, BN=64, GROUP_M=1, num_warps=4, num_stages=4, variant="decode")
# Variants: "decode" (both operands decoded in the loop from bytes: _triton_gemm), "small" (word loads, weight
# tile on the 64-row side of the dot: streams the packed weight), "decode32" (word loads, both decoded),
# "w16w" (weight pre-decoded fp16, A decoded from words), "f16" (both pre-decoded: plain fp16 GEMM), "cuda"
# (the decode-regime CUDA kernel, ``_cuda_decode``: no tiles, NT token tiles of 8 per CTA).
# "small" with 8 warps: two warpgroups split the 16 tokens (wgmma 64x8x16), two warps per scheduler to hide
# the in-loop decode's latency.
SMALL_CONFIG = dict(BM=16, BN=64, GROUP_M=1, num_warps=8, num_stages=4, variant="small")
# 32 weight rows (mma.sync m16n8k16): twice the programs of SMALL_CONFIG, faster where N is narrow
SMALL_ALT_CONFIG = dict(BM=16, BN=32, GROUP_M=1, num_warps=4, num_stages=4, variant="small")
MID_CONFIG = dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=4, variant="f16")
TALL_CONFIG = dict(BM=64, BN=128, GROUP_M=8, num_warps=4, num_stages=4, variant="f16")
BIG_CONFIG = dict(BM=128, BN=256, GROUP_M=8, num_warps=8, num_stages=4, variant="f16")
# Up to CUDA_MAX_M token rows the CUDA decode kernel serves (where it is built and proven): it streams the
# packed weight once per 8 * NT tokens; above, the tensor-core-bound Triton configs win.
CUDA_MAX_M = 64
# From F16_DECODE_MIN_M + 1 to CUDA_MAX_M token rows, a weight of at least F16_DECODE_MIN_N rows that comes with
# its fp16 copy (``prepare_weight``), given tokens that come with their fp16 form (``DecodedNVFP4Tensor``: the
# norm-cast that made their codes wrote it; ``reads_f16_tokens``), is read as that copy by a plain fp16 GEMM
# (``f16_decode_config``): 4x the bytes of the codes, but no decode in the loop, where the CUDA kernel's chains
# are bound by issue on too few warps. H200, CUDA-graph medians, us (KERNELS_NOTES, "The fp16 copy at decode
# rows" and the next section): q/k/v 5120x2048 at M = 64: CUDA kernel 16.7 (a decode profile), copy 10.0 (a
# sweep); o 2048x4096: 14.4 against 13.7, so narrower weights keep the CUDA kernel. Plain codes would need a
# decode pass first (~3.2 us), which loses to the CUDA kernel at most sizes (kernel-bench, prepared q_proj
# 4096x2048 at M = 32: 9.00 against 11.84 with the pass): they keep it. The one point measured the other way
# (square 8192 at M = 64: 58.2 against 41.7) is in KERNELS_NOTES. Same bits (probed like every config).
F16_DECODE_MIN_M = 16
F16_DECODE_MIN_N = 4096
# (kind, device index, config, K chunk) -> bool: bit-equal to the reference config on this GPU under that K order
_verified: dict = {}


DECODE_SCHEDULERS = 4 * 132  # warp schedulers of the H200: one warp chain each is what a dense decode GEMM needs
DECODE_WAVE = 2 * DECODE_SCHEDULERS  # chains resident at once in 8-warp CTAs (one per SM at their registers)


def cuda_config(m: int, n: int = 0) -> dict:
    """CUDA decode kernel config for M token rows (of an [N, K] weight, when N is given). One chain over K: one
    n8 token tile per CTA up to 16 rows (M 9..16: two CTAs share a weight slice through L2, cheaper than a
    second mma chain per warp), 4 warps x 16 weight rows, an 8-step cp.async ring (5 steps ahead of the
    decode), token fragments for all of K when they fit (SEG 0). Above 16 rows without N: two token tiles.
    Above 16 rows with N known, by the chains (a warp's 16 weight rows x a CTA's NT token tiles, one serial
    mma chain over K each): the fewest token tiles per CTA (1, 2, 4) whose chains fit one resident wave of
    8-warp CTAs (``DECODE_WAVE``), else 4; 8 warps, or 4 where the chains are no more than the GPU's warp
    schedulers (then 4-warp CTAs spread over the SMs instead of filling half of them); with 4 tiles a 4-step
    ring. A second wave costs a whole chain's time, padded token tiles cost mma and decode, and fewer tiles
    per chain decode each weight step more often: this picks the measured best at every point below.
    H200 sweeps (CUDA-graph medians of three interleaved rounds, weights rotated past L2, every variant bitwise
    equal to the default), us, former config -> this one:
    - M = 64 (NT 1 / 2 / 4 x W 2 / 4 / 8 x D 4 / 8 x RG 1 / 2): q/k/v 5120x2048 22.4 -> 17.8 (NT 4, 640
      chains; NT 2's 1280 chains take two waves: 23.2), o 2048x4096 17.4 -> 16.1 (NT 1: 1024 chains);
    - M = 48 / 40 / 32 / 24 (NT x W 2 / 4 / 8 x D): q/k/v 17.0 / 17.0 / 13.8 / 13.4 -> 12.2 / 12.1 / 11.8 /
      10.2 (NT 2 W 8, NT 2 W 8, NT 2 W 8, NT 1 W 8; NT 1 at M = 40, 1600 chains: 18.3); o 15.2 / 15.0 / 16.2 /
      16.5 -> 15.2 / 15.0 / 11.8 / 11.7 (NT 1: W 8, W 8, W 4 on 512 chains (W 8: 15.0), W 4).
    K chunks: 8 warps, 4 (M <= 16) or 2 chunk lanes per 16 weight rows."""
    if k_chunk():
        return dict(variant="cuda", NT=1 if m <= 16 else 2, W=8, D=8, SEG=0, C=4 if m <= 16 else 2)
    if m > 16 and n:
        def chains(t):
            return n // 16 * -(-m // (8 * t))
        nt = next((t for t in (1, 2) if chains(t) <= DECODE_WAVE), 4)
        return dict(variant="cuda", NT=nt, W=4 if chains(nt) <= DECODE_SCHEDULERS else 8, D=4 if nt == 4 else 8,
                    SEG=0)
    return dict(variant="cuda", NT=1 if m <= 16 else 2, W=4, D=8, SEG=0)


def f16_decode_config(m: int, n: int) -> dict:
    """The fp16 copy's GEMM config at decode rows (see F16_DECODE_MIN_M): every token in one tile row, 64 weight
    rows a program, a 6-stage pipeline (sweep of BM 32 / 64 x BN 32 / 64 / 128 x 3 / 4 / 6 stages: the best
    for q/k/v at M = 32 and 64)."""
    return dict(BM=64, BN=64, GROUP_M=1, num_warps=4, num_stages=6, variant="f16")


def _configs(m: int, n: int, interpret: bool) -> dict:
    """Triton tile config by (M, N). BK is fixed (``_triton_gemm.BK``) and every variant feeds the same fp16
    values to the same fp16 -> fp32 dot in the same K order, so row bits should not depend on the choice;
    that is not assumed: on first use each config is run beside SAFE_CONFIG on a probe problem and used only
    if the outputs are bitwise equal (else, or if it does not fit the GPU, SAFE_CONFIG serves that M).
    Why these: M <= 16 is memory-bound (stream 4.5 bits/weight, decoded in the loop); above 64 rows the tensor
    cores bound it and in-loop decoding would cost as much ALU time as they take: pre-decode both (f16);
    17-64 rows keep the in-loop decode (SAFE_CONFIG) where the CUDA kernel does not serve them.
    Decoding A in the loop (w16w) measured slower than the f16 pass even at N = 128..512."""
    if interpret:
        return dict(BM=32, BN=32, GROUP_M=4, num_warps=4, num_stages=1, variant="decode")
    if m <= 16:
        return dict(SMALL_CONFIG)
    if m <= 64:
        return dict(SAFE_CONFIG)
    # under K chunks a 128x256 tile would hold a second fp32 tile (the chunk sum): 255 registers and spills on
    # sm_90 (Triton 3.6); 128x128 holds both in 212
    cfg = MID_CONFIG if m <= 1024 or n <= 512 or k_chunk() else BIG_CONFIG
    if -(-m // 128) * -(-n // 128) < 132:  # fewer 128x128 tiles than SMs (router, M=128): halve the rows
        cfg = TALL_CONFIG
    return dict(cfg)


def config_name(c: dict) -> str:
    if c.get("variant") == "cuda":
        lanes = f"c{c['C']}" if c.get("C", 1) > 1 else ""
        rows = f"r{c['RG']}" if c.get("RG", 1) > 1 else ""
        bal = "b" if c.get("BAL", 0) else ""
        return f"cuda:nt{c['NT']}w{c['W']}d{c['D']}s{c.get('SEG', 4)}{lanes}{rows}{bal}"
    return f"{c['variant']}:{c['BM']}x{c['BN']}w{c['num_warps']}s{c['num_stages']}"


def config_status() -> dict:
    """{config name: proven bit-equal to the reference config} for the configs probed so far in this process
    ("grouped-" configs against the grouped decode loop; " kc<n>" under the K-chunk contract)."""
    def name(key):
        kind, _, cfg, kc = key
        label = config_name(dict(cfg)) if kind == "dense" else "grouped-" + config_name(dict(cfg))
        return label + (f" kc{kc}" if kc else "")
    return {name(k): v for k, v in _verified.items()}


def _verify(cfg: dict, device, m: int = 300, n: int = 384, k: int = 1088) -> bool:
    """Probe: cfg vs SAFE_CONFIG on random [m, k] x [n, k] (k % 128 != 0: the masked tail too; k % 64 == 0:
    the int32 scale-word loads too). The CUDA kernel takes whole 128-wide K steps only: k = 2176 for it (17
    steps: token fragments in two segments, and under K chunks of 512 a short last chunk and two rounds of
    chunk lanes), and a 5-row problem beside (one partial token tile)."""
    from minite.kernels.quantize import quantize
    g = torch.Generator(device="cpu").manual_seed(1234)
    if cfg.get("variant") == "cuda":
        k = 2176
    try:
        a = quantize((torch.randn(m, k, generator=g) * 3).to(device), scaling="row")
        w = quantize(torch.randn(n, k, generator=g).to(device), scaling="row")
        ok = True
        for rows in ((slice(0, m), slice(0, 5)) if cfg.get("variant") == "cuda" else (slice(0, m),)):
            sub = NVFP4Tensor(a.codes[rows], a.scales[rows], a.global_scale[rows])
            got = _triton_dense(sub, w, torch.float32, None, cfg)
            ok &= bool(torch.equal(got, _triton_dense(sub, w, torch.float32, None, SAFE_CONFIG)))
        return ok
    except Exception as exc:  # OutOfResources (shared memory) or a compiler failure: do not use it
        import warnings
        warnings.warn(f"minite.kernels: GEMM config {cfg} unusable here ({type(exc).__name__}: "
                      f"{str(exc)[:200]}); using {SAFE_CONFIG}", RuntimeWarning, stacklevel=2)
        return False


def _proven(cfg: dict, device) -> bool:
    key = ("dense", device.index, tuple(sorted(cfg.items())), k_chunk())
    ok = _verified.get(key)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():  # cannot probe inside a graph capture
            return False
        ok = _verified[key] = _verify(cfg, device)
    return ok


def _cuda_module(device):
    """The built CUDA decode kernel for this GPU, or None."""
    from . import _cuda_decode
    if device.type != "cuda" or not _cuda_decode.enabled():
        return None
    return _cuda_decode.module(_backend.capability(device))


def _pick_config(m: int, n: int, device, cuda_ok: bool = False, has_f16: bool = False,
                 tokens_f16: bool = False) -> dict:
    """``cuda_ok``: the CUDA decode kernel is built here and takes these operands (``_cuda_decode.supports``);
    ``has_f16`` / ``tokens_f16``: the weight comes with its fp16 copy / the tokens with their fp16 form."""
    if (has_f16 and tokens_f16 and F16_DECODE_MIN_M < m <= CUDA_MAX_M and n >= F16_DECODE_MIN_N
            and device.type == "cuda" and not k_chunk()):
        cfg = f16_decode_config(m, n)
        if _proven(cfg, device):
            return cfg
    if cuda_ok and m <= CUDA_MAX_M:
        cfg = cuda_config(m, n)
        if _proven(cfg, device):
            return cfg
    cfg = _configs(m, n, device.type == "cpu")
    if device.type == "cpu" or cfg == SAFE_CONFIG:
        return cfg
    cands = (cfg,)
    if cfg == SMALL_CONFIG:  # narrow weights: 32-row programs first (twice the programs: 2048 rows -> 64)
        cands = (SMALL_ALT_CONFIG, SMALL_CONFIG) if n < 4096 else (SMALL_CONFIG, SMALL_ALT_CONFIG)
    for c in cands:
        if _proven(c, device):
            return dict(c)
    return dict(SAFE_CONFIG)


def _dense_choice(a, w, config=None):
    """(config, CUDA module or None, the CUDA kernel takes these operands) for a @ w.T (w: NVFP4Tensor or
    PreparedWeight)."""
    from . import _cuda_decode
    wq = w.w if isinstance(w, PreparedWeight) else w
    has_f16 = isinstance(w, PreparedWeight) and w.f16 is not None
    m, k = a.shape
    n = wq.shape[0]
    mod = _cuda_module(a.device) if config is None or config.get("variant") == "cuda" else None
    cuda_ok = mod is not None and _cuda_decode.supports(k, n, a, wq.codes, wq.scales)
    tokens_f16 = isinstance(a, DecodedNVFP4Tensor) and a.f16 is not None
    cfg = dict(config) if config else _pick_config(m, n, a.device, cuda_ok, has_f16, tokens_f16)
    return cfg, mod, cuda_ok


def config_for(a: NVFP4Tensor, w, backend: str | None = None) -> str:
    """Name of the kernel config ``nvfp4_gemm(a, w)`` runs (benchmark tables); "torch" / "blackwell" for those
    paths. Probes a config on first use, as the GEMM itself would."""
    path = gemm_path(a.device, backend)
    if path != "triton":
        return path
    return config_name(_dense_choice(a, w)[0])


def dense_weight_bytes(w, m: int, tokens_f16: bool = False) -> int:
    """Bytes of ``w`` (NVFP4Tensor or PreparedWeight) that ``nvfp4_gemm`` of m token rows reads here (the tokens
    with their fp16 form where ``tokens_f16``): its fp16 copy where a pre-decoded config serves m, else codes,
    block scales and global scales (benchmarks' byte counts; the fp16 path reads no weight scales but the
    global ones)."""
    wq = w.w if isinstance(w, PreparedWeight) else w
    codes = sum(t.numel() * t.element_size() for t in (wq.codes, wq.scales, wq.global_scale))
    f16 = w.f16 if isinstance(w, PreparedWeight) else None
    # a pre-decoded config reads the copy: every one above CUDA_MAX_M rows, below only for fp16 tokens
    reads_copy = f16 is not None and (m > CUDA_MAX_M or (tokens_f16 and reads_f16_tokens(w, m)))
    if not reads_copy or f16.device.type != "cuda" or gemm_path(f16.device, None) != "triton":
        return codes
    return f16.numel() * f16.element_size() + wq.global_scale.numel() * 4


def reads_f16_tokens(w, m: int) -> bool:
    """Whether ``nvfp4_gemm`` of m token rows with ``w`` (NVFP4Tensor or PreparedWeight) here reads the tokens'
    fp16 form when they come with it (a ``DecodedNVFP4Tensor``): what a cast before it can write for it."""
    wq = w.w if isinstance(w, PreparedWeight) else w
    if wq.device.type != "cuda" or gemm_path(wq.device, None) != "triton" or m == 0:
        return False
    has_f16 = isinstance(w, PreparedWeight) and w.f16 is not None
    return _pick_config(m, wq.shape[0], wq.device, False, has_f16, True).get("variant") == "f16"


def _triton_dense(a, w, out_dtype, bias, config=None) -> torch.Tensor:
    from . import _cuda_decode
    from . import _triton_gemm as tg
    from . import _w32_launch
    prepared = w if isinstance(w, PreparedWeight) else None
    wq = prepared.w if prepared is not None else w
    m, k = a.shape
    n = wq.shape[0]
    dev = a.device
    cfg, mod, cuda_ok = _dense_choice(a, w, config)
    out = torch.empty(m, n, dtype=out_dtype, device=dev)
    if m == 0 or n == 0:
        return out
    variant = cfg.get("variant", "decode")
    if variant == "cuda":
        if not cuda_ok:
            raise ValueError(f"the CUDA decode GEMM is unavailable here or does not take K={k}, N={n}")
        try:
            return _cuda_decode.dense(mod, a, wq, out, bias, cfg, k_chunk(),
                                      prepared.frag if prepared is not None else None)
        except ValueError:  # no token segment of this K fits the GPU's shared memory: the Triton candidates
            if config:
                raise
            cfg = _pick_config(m, n, dev)
            variant = cfg.get("variant", "decode")
    if variant not in ("decode", "w16", "f16") + _w32_launch.WORD_VARIANTS:
        raise ValueError(f"unknown GEMM variant {variant!r}")
    w_f16 = None
    if variant in ("w16", "f16", "w16w"):
        w_f16 = prepared.f16 if prepared is not None and prepared.f16 is not None else decode_f16(wq)
    if variant in _w32_launch.WORD_VARIANTS:
        return _w32_launch.launch_dense(a, wq, w_f16, out, bias, cfg, k_chunk())
    cfg.pop("variant", None)
    a_arg, w_arg = a.codes.contiguous(), (w_f16 if w_f16 is not None else wq.codes.contiguous())
    if variant == "f16":
        a_arg = a.f16 if isinstance(a, DecodedNVFP4Tensor) and a.f16 is not None else decode_f16(a)
    ga, gw = a.global_scale.contiguous(), wq.global_scale.contiguous()
    bm, bn, gm = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("GROUP_M")
    tiles_m = (m + bm - 1) // bm
    grid = (tiles_m * ((n + bn - 1) // bn),)
    dummy = ga
    tg.nvfp4_mm_kernel[grid](
        a_arg, _u8(a.scales), w_arg, _u8(wq.scales), ga, gw,
        bias.contiguous() if bias is not None else dummy, out, dummy, dummy, dummy,
        m, n, k, tiles_m, 0, 0, 0,
        GA_ROW=ga.dim() == 1, GW_ROW=gw.dim() == 1, HAS_BIAS=bias is not None, GROUPED=False,
        BM=bm, BN=bn, BK=tg.BK, GROUP_M=gm, A_F16=variant == "f16", W_F16=variant != "decode", KC=k_chunk(),
        **cfg, **_backend.pdl_meta(tg.nvfp4_mm_kernel, out.device))
    return out


def _grouped_config(interpret: bool, prepared: bool, m: int = 0, e: int = 1, device=None,
                    cuda_ok: bool = False, k: int = 0, n: int = 0) -> dict:
    """Few rows per expert (M <= GROUPED_CUDA_ROWS * E on average: decode) -> the CUDA decode kernel, which
    reads only the packed weights of the experts in use. Else pre-decoded experts -> f16 for every M (A decoded
    by a pass, then a plain fp16 grouped GEMM). Packed experts -> the byte decode loop, or, once M >= 64 rows
    per expert on average, f16 with the experts decoded on this call. For packed experts each non-fallback
    choice only where a probe proved it bit-equal to the grouped decode loop on this GPU (so a row's bits do
    not depend on M). Pre-decoded experts take f16 without that probe: their bits against the packed path
    are checked by the GPU tests and kernel-bench's checks, not at first use on each GPU."""
    if interpret:
        return dict(BM=32, BN=32, num_warps=4, num_stages=1, variant="f16" if prepared else "decode")
    if cuda_ok and m <= GROUPED_CUDA_ROWS * e:
        cfg = grouped_cuda_config(m, e, k, n)
        if _grouped_proven(cfg, device):
            return cfg
    f16 = GROUPED_F16_CHUNKED if k_chunk() else GROUPED_F16_CONFIG
    if prepared:
        return dict(f16)
    if m >= 64 * e and device is not None and _grouped_proven(f16, device):
        return dict(f16)
    return dict(GROUPED_FALLBACK)


GROUPED_F16_CONFIG = dict(BM=128, BN=256, num_warps=8, num_stages=4, variant="f16")
GROUPED_F16_CHUNKED = dict(BM=128, BN=128, num_warps=8, num_stages=4, variant="f16")  # chunk sum tile fits
GROUPED_FALLBACK = dict(BM=64, BN=64, num_warps=4, num_stages=4, variant="decode")
GROUPED_CUDA_ROWS = 32  # rows per expert (average) up to which the CUDA decode kernel serves grouped GEMMs
_grouped_broken: set = set()  # configs that did not build/fit on this GPU (then GROUPED_FALLBACK: same K order)


GROUPED_RESIDENT_CTAS = 264  # 4-warp decode CTAs resident at once on the H200 (2 per SM x 132 SMs)
GROUPED_LISTED_CTAS = 528  # 4 per SM listed, 3 resident (the 168-register row-group build); the others start as
                           # the first ones finish, so the tiles spread more evenly than over 396 resident CTAs
GROUPED_WAVE_CTAS = 396  # one wave of that build: 3 resident CTAs x 132 SMs
GROUPED_MIN_PAIRS = 132  # (tile, row block) pairs at RG 2 below which the rows are too few for row groups


def grouped_cuda_config(m: int, e: int, k: int = 0, n: int = 0) -> dict:
    """Token tiles of 8 NT rows, 4 warps per CTA, an 8-step ring. Each warp runs RG row groups of 16 weight rows
    one after another per tile (the ring and the register pipeline run on from one into the next, the token
    fragments stay resident). Up to K = 2048 (16 steps) a CTA's shared memory (a ring of fragment-order slots,
    all of K's token fragments) fits three times in an SM: RG from 8 and 528 CTAs listed; above, RG from 4 and
    264 CTAs (two per SM). Above 4 rows per expert or 16 steps, RG halves while the (tile, row block) pairs, at
    most min(M, E) tiles x N / (16 x 4 RG) blocks, would not fill 264 CTAs (fewer rows: below). H200 sweep
    (CTAS 264 / 396 / 528 x RG 2 / 4 / 8 x D 4 / 8, top-8 of 128 experts, CUDA-graph medians, every variant
    bitwise equal), us, against the former configs (RG from 4 above 8 steps, 264 CTAs, 396 at short K below 4
    rows per expert): gate_up 1536x2048 at 64 / 16 / 8 tokens
    83.8 -> 75.2 / 57.3 -> 53.9 / 47.6 -> 41.6 (RG 4); down 2048x768 48.5 -> 47.9 / 34.7 -> 34.6 / 27.9 -> 28.9
    (RG 4; RG 8 would take 25.6 there, but its 256 pairs sit where the small model's down 1024x256 must halve).
    Up to 4 rows per expert, where the tiles (at most min(M, E)) x row blocks at RG 8 would overflow one wave of
    396 resident CTAs (down 2048x768 from 16 tokens: 128 x 4 blocks), RG rises to the fewest row groups per warp
    whose blocks fit one wave (RG 11: 3 blocks). H200 sweep at 16 / 32 / 48 / 64 tokens (RG 4, 6, 8, 10, 11, 12,
    16 x CTAS 396 / 528 / 792, fragment-order codes, bitwise equal to the default; CUDA-graph medians of three
    interleaved rounds), us: down RG 8 -> 11 34.8 -> 34.1 / 46.5 -> 44.5 / 48.1 -> 44.6 / 49.5 -> 44.7 (RG 16
    45.8-46.4 above 16 tokens, RG 10: four blocks, 54-62); gate_up stays at RG 8 (74.5-75.8 against RG 12's
    75.9-76.6); CTAS changed nothing.
    With fewer tiles (up to 4 rows per expert and 16 steps), RG halves from 8 while the pairs at half of it fit
    one wave: fewer chains per warp as long as no CTA waits for a second wave. Where RG 2 leaves fewer pairs than
    SMs (GROUPED_MIN_PAIRS), RG 1: the configs below. H200 sweep at 1 / 2 / 4 / 8 / 12 tokens (RG 2, 4, 6, 8,
    11, 16 x CTAS 264 / 528, every variant bitwise equal; CUDA-graph medians of five interleaved rounds), us,
    former rule -> this one: down 2048x768 14.6 -> 10.6 (RG 2) / 19.2 -> 14.9 (RG 4) / 28.5 -> 23.6 (RG 8) at
    2 / 4 / 8 tokens, gate_up 1536x2048 22.0 -> 17.7 (RG 2) at 2 tokens; the other points kept their config
    and were the fastest measured (1 token: 12.6 and 8.7 against RG 2's 13.6 and 9.1).
    In decode (up to 4 rows per expert and 16 steps) at most 396 CTAs run one wave (BAL): the plain grid's
    schedule while the tiles fit its rows, else the CTAs share the (tile, row group) pairs out evenly
    (``cta_range`` in the kernel), so a routing that makes more tiles than min(M, E) (experts above 8 rows)
    costs a fraction of a block, not a second wave. H200, gate_up 1536x2048 at RG 8, 512 routed rows, 128
    experts, CUDA-graph medians of five interleaved rounds, bitwise equal, us, fixed grid -> BAL at 128 / 132 /
    136 / 146 tiles: 76.3 -> 76.4 / 76.1 -> 76.0 / 99.5 -> 82.3 / 98.4 -> 83.6.
    At RG = 1 (one token: 8 rows) the configs from before RG: 4 warps, or for short K (the tile is over before a
    deep ring pays off) 2 warps, a 4-step ring and 2112 CTAs. Under K chunks RG does not apply (one row group
    per tile).
    Where RG falls to 1 with short K and many rows per expert (few, narrow experts: the ``small`` model's 32
    experts, top-4, at 64-256 tokens), NT token tiles share each decoded weight step once the average expert
    fills them: NT = 4 from 32 rows per expert (8 warps, a 4-step ring, RG 4), NT = 2 from 8 (H200 sweep,
    NT 1-4 x RG x W x D x CTAS, all bitwise equal; gate_up 512x1024 at 256 tokens 36.7 -> 22.5 us, down
    1024x256 33.5 -> 15.6 us; at 64 tokens 16.7 -> 10.2 and 14.5 -> 10.1). Where RG > 1 fills the GPU, NT = 1
    stays: Qwen3-30B-A3B's down 2048x768 at 128 tokens (8 rows per expert) took 154.6 us with NT = 2 against
    80.7 with RG = 8."""
    from ._cuda_decode import ROWS_PER_WARP, STEP_K
    short, three = 0 < k <= 8 * STEP_K, 0 < k <= 16 * STEP_K
    tiles, groups = min(m, e), n // ROWS_PER_WARP

    def row_blocks(rg: int) -> int:  # a tile's blocks of 4 warps x RG row groups
        return -(-groups // (4 * rg))

    rg = 8 if three else 4
    if three and m <= 4 * e:  # decode: RG halves while half of it still fits one wave
        while rg > 2 and tiles * row_blocks(rg // 2) <= GROUPED_WAVE_CTAS:
            rg //= 2
        if rg == 2 and tiles * row_blocks(2) < GROUPED_MIN_PAIRS:
            rg = 1
    else:
        while rg > 1 and tiles * row_blocks(rg) < GROUPED_RESIDENT_CTAS:
            rg //= 2
    if rg == 8 and three and m <= 4 * e and tiles * row_blocks(rg) > GROUPED_WAVE_CTAS:
        # the tiles at RG 8 need a second, partial wave: the fewest row groups per warp that fit one wave
        rg = min(16, row_blocks(max(1, GROUPED_WAVE_CTAS // tiles)))
    if rg > 1 and three and m <= 4 * e:  # one wave, kept when the routing makes more tiles than min(M, E)
        return dict(variant="cuda", NT=1, W=4, D=8, SEG=0, RG=rg, BAL=1, CTAS=GROUPED_WAVE_CTAS)
    if rg > 1:
        return dict(variant="cuda", NT=1, W=4, D=8, SEG=0, RG=rg,
                    CTAS=GROUPED_LISTED_CTAS if three else GROUPED_RESIDENT_CTAS)
    if short and m >= 32 * e:
        return dict(variant="cuda", NT=4, W=8, D=4, SEG=0, RG=4, CTAS=2 * GROUPED_RESIDENT_CTAS)
    if short and m >= 8 * e:
        return dict(variant="cuda", NT=2, W=4, D=4, SEG=0, CTAS=GROUPED_RESIDENT_CTAS)
    if short:
        return dict(variant="cuda", NT=1, W=2, D=4, SEG=0, CTAS=2112)
    return dict(variant="cuda", NT=1, W=4, D=8, SEG=0)


def _grouped_proven(cfg: dict, device) -> bool:
    """Probe (once per config and GPU): cfg vs the grouped decode loop on a ragged problem with empty groups
    (K in whole 128-wide steps, which every grouped config takes)."""
    key = ("grouped", device.index, tuple(sorted(cfg.items())), k_chunk())
    if key in _verified:
        return _verified[key]
    if torch.cuda.is_current_stream_capturing():
        return False
    from minite.kernels.quantize import quantize
    g = torch.Generator(device="cpu").manual_seed(4321)
    ok = False
    try:
        counts, n, k = [37, 0, 200, 63, 1, 5], 384, 1152
        offs = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(counts))], device=device)
        a = quantize((torch.randn(offs[-1].item(), k, generator=g) * 3).to(device), scaling="row")
        ex = stack_experts([quantize(torch.randn(n, k, generator=g).to(device)) for _ in counts])
        got = _triton_grouped(a, ex, offs, torch.float32, cfg)
        ok = bool(torch.equal(got, _triton_grouped(a, ex, offs, torch.float32, GROUPED_FALLBACK)))
    except Exception as exc:
        import warnings
        warnings.warn(f"minite.kernels: grouped config {cfg} unusable here ({type(exc).__name__}: {str(exc)[:200]})",
                      RuntimeWarning, stacklevel=2)
    _verified[key] = ok
    return ok


def _tile_schedule(offsets: torch.Tensor, m: int, bm: int):
    """Device-side (no host sync) list of row tiles: expert id (-1 = unused slot) and first row, sized by
    the upper bound cdiv(M, BM) + E, valid tiles first; and the number of valid tiles (int64 [1]). One
    Triton launch (``_triton_schedule``); ``_tile_schedule_torch`` is the same in PyTorch ops."""
    import triton

    from . import _triton_schedule as ts
    e = offsets.numel() - 1
    bound = (m + bm - 1) // bm + e
    dev = offsets.device
    tile_e = torch.empty(bound, dtype=torch.int32, device=dev)
    tile_r = torch.empty(bound, dtype=torch.int32, device=dev)
    n_valid = torch.empty(1, dtype=torch.int64, device=dev)
    bi = 64
    ts.tile_schedule_kernel[(triton.cdiv(bound, bi),)](offsets, tile_e, tile_r, n_valid, e, bound, BM=bm,
                                                       BE=max(16, triton.next_power_of_2(e)), BI=bi,
                                                       **_backend.pdl_meta(ts.tile_schedule_kernel, dev))
    return tile_e, tile_r, bound, n_valid


def _tile_schedule_torch(offsets: torch.Tensor, m: int, bm: int):
    """``_tile_schedule`` in PyTorch ops (its reference)."""
    e = offsets.numel() - 1
    counts = (offsets[1:] - offsets[:-1]).clamp_min(0)
    tiles = (counts + bm - 1) // bm
    ends = torch.cumsum(tiles, 0)
    bound = (m + bm - 1) // bm + e
    idx = torch.arange(bound, device=offsets.device, dtype=ends.dtype)
    expert = torch.searchsorted(ends, idx, right=True)
    valid = expert < e
    expert_c = expert.clamp_max(e - 1)
    first_tile = ends[expert_c] - tiles[expert_c]
    row = offsets[:-1][expert_c] + (idx - first_tile) * bm
    return (torch.where(valid, expert_c, -1).to(torch.int32), row.to(torch.int32), bound,
            ends[-1:].to(torch.int64))


def _grouped_choice(a, ex: NVFP4Experts, config=None, m: int | None = None):
    """(config, CUDA module or None, the CUDA kernel takes these operands) for a grouped GEMM over ``ex`` of
    ``m`` rows (default: a's)."""
    from . import _cuda_decode
    k = a.shape[1]
    m = a.shape[0] if m is None else m
    e, n, _ = ex.shape
    dev = a.device
    mod = _cuda_module(dev) if config is None or config.get("variant") == "cuda" else None
    cuda_ok = mod is not None and _cuda_decode.supports(k, n, a, ex.codes, ex.scales)
    cfg = dict(config) if config else _grouped_config(dev.type == "cpu", ex.f16 is not None, m, e, dev, cuda_ok, k,
                                                      n)
    if tuple(sorted(cfg.items())) in _grouped_broken:
        cfg = dict(GROUPED_FALLBACK)
    return cfg, mod, cuda_ok


def grouped_config_for(a: NVFP4Tensor, ws, backend: str | None = None) -> str:
    """Name of the kernel config ``grouped_nvfp4_gemm(a, ws, ...)`` runs (benchmark tables), as ``config_for``."""
    ex = stack_experts(ws)
    path = gemm_path(a.device, backend)
    if path == "torch":
        return path
    return config_name(_grouped_choice(a, ex)[0])


def _triton_grouped(a, ex: NVFP4Experts, offsets, out_dtype, config=None, k_segments: int = 1,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    from . import _cuda_decode
    from . import _triton_gemm as tg
    from . import _w32_launch
    k = a.shape[1]
    m = a.shape[0] if rows is None else rows.numel()
    e, n, _ = ex.shape
    dev = a.device
    explicit = config is not None  # a caller's config: its failures raise instead of falling back
    if k_segments > 1 and config is None:  # the Triton kernel's segment loop (not the CUDA decode kernel's)
        config = _grouped_config(dev.type == "cpu", ex.f16 is not None, m, e, dev, False, k)
    cfg, mod, cuda_ok = _grouped_choice(a, ex, config, m)
    variant = cfg.get("variant", "decode")
    if k_segments > 1 and variant not in ("decode", "f16"):
        raise ValueError(f"grouped GEMM variant {variant!r} does not take K segments (decode or f16 do)")
    out = torch.empty(m, n, dtype=out_dtype, device=dev)
    if m == 0 or n == 0:
        return out
    if variant == "cuda":
        if not cuda_ok:
            raise ValueError(f"the CUDA decode GEMM is unavailable here or does not take K={k}, N={n}")
        try:
            return _cuda_decode.grouped(mod, a, ex, out, offsets, cfg, k_chunk(), rows)
        except ValueError:  # no token segment of this K fits the GPU's shared memory: the Triton configs
            if explicit:
                raise
            cfg = _grouped_config(False, ex.f16 is not None, m, e, dev, k=k)
            variant = cfg.get("variant", "decode")
    if rows is not None:  # the Triton kernels read a's rows in order: gather them (the same codes and scales)
        a, rows = a.take(rows), None
    if variant in ("f16", "w16w", "w16") and ex.f16 is None:
        ex = prepare_experts(ex, "triton")  # per call (benchmarks / explicit configs): costs a decode pass
    offs32 = offsets.to(torch.int32).contiguous()
    tile_e, tile_r, bound, _ = _tile_schedule(offs32, m, cfg["BM"])
    try:
        if variant in _w32_launch.WORD_VARIANTS:
            return _w32_launch.launch_grouped(a, ex, out, cfg, (tile_e, tile_r, bound, offs32), k_chunk())
        if variant not in ("decode", "w16", "f16"):
            raise ValueError(f"unknown grouped GEMM variant {variant!r}")
        cfg.pop("variant", None)
        bm, bn = cfg.pop("BM"), cfg.pop("BN")
        cfg.pop("GROUP_M", None)
        ga, gw = a.global_scale.contiguous(), ex.global_scale.contiguous()
        a_arg = decode_f16(a) if variant == "f16" else a.codes.contiguous()
        if variant == "decode":
            w_arg, ws_c = ex.codes.contiguous(), ex.codes.contiguous().stride(0)
        else:
            w_arg, ws_c = ex.f16, ex.f16.stride(0)
        scales = _u8(ex.scales)
        tg.nvfp4_mm_kernel[(bound, (n + bn - 1) // bn)](
            a_arg, _u8(a.scales), w_arg, scales, ga, gw, ga, out, tile_e, tile_r, offs32,
            m, n, k, 0, ws_c, scales.stride(0), gw.stride(0),
            GA_ROW=ga.dim() == 1, GW_ROW=gw.dim() == 2 and k_segments == 1, HAS_BIAS=False, GROUPED=True,
            BM=bm, BN=bn, BK=tg.BK, GROUP_M=1, A_F16=variant == "f16", W_F16=variant != "decode", KC=k_chunk(),
            W_KSEG=k_segments, **cfg, **_backend.pdl_meta(tg.nvfp4_mm_kernel, dev))
    except Exception as exc:  # OutOfResources, or a compiler failure on this GPU's Triton
        if explicit or dev.type == "cpu":
            raise
        _grouped_broken.add(tuple(sorted(_grouped_config(False, ex.f16 is not None, m, e, dev, k=k).items())))
        import warnings
        warnings.warn(f"minite.kernels: grouped config {cfg} unusable here ({type(exc).__name__}); using "
                      f"{GROUPED_FALLBACK}", RuntimeWarning, stacklevel=2)
        return _triton_grouped(a, ex, offsets, out_dtype, GROUPED_FALLBACK, k_segments)
    return out


# ---------------------------------------------------------------------------------------- public API
def nvfp4_gemm(a: NVFP4Tensor, w, out_dtype: torch.dtype = torch.bfloat16,
               bias: torch.Tensor | None = None, backend: str | None = None, config: dict | None = None):
    """a @ w.T for NVFP4 a [M, K], w [N, K] -> [M, N] in out_dtype (bf16, fp16 or fp32).

    Block scales are applied exactly, products accumulate in fp32 (exactly in float64 on the torch path),
    both global scales (scalar, or per row: [M] for a, [N] for w) and then ``bias`` [N] in the epilogue.
    Batch invariant and deterministic: row i does not depend on M or on the run. ``config`` (tile sizes)
    is for benchmarking only. ``w`` may be a ``prepare_weight`` result (large-M speed, same bits)."""
    prepared = w if isinstance(w, PreparedWeight) else None
    if prepared is not None:
        w = prepared.w
    _check_tensor(w, "w")
    _check_common(a, w.shape[1], w.device, out_dtype)
    n = w.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.device != w.device):
        raise ValueError(f"bias must be a [{n}] tensor on {w.device}, got {tuple(bias.shape)} on {bias.device}")
    path = gemm_path(a.device, backend)
    if path == "torch":
        return _torch_gemm.gemm(a, w, out_dtype, bias)
    if path == "blackwell":
        return blackwell.gemm(a, w, out_dtype, bias)
    return _triton_dense(a, prepared if prepared is not None else w, out_dtype, bias, config)


def grouped_nvfp4_gemm(a: NVFP4Tensor, ws, offsets: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                       backend: str | None = None, config: dict | None = None, k_segments: int = 1,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """MoE GEMM: rows of a [M, K] sorted by expert; expert e owns rows offsets[e]:offsets[e+1] and
    out[rows] = a[rows] @ ws[e].T. ``ws``: a list of E NVFP4Tensors [N, K] or an ``NVFP4Experts`` (stacked,
    preferred: a list is stacked on every call). ``offsets``: int [E+1], offsets[0] == 0, non-decreasing,
    offsets[E] == M; empty groups allowed. a may carry a per-row global scale [M]. One GEMM launch over every
    expert (the Triton path adds a device-side tile-schedule launch, and its f16 variant a decode pass of a).
    ``k_segments`` S > 1: the experts' global scales are [E, S], one per equal K segment (K / S a multiple
    of 128; a transposed weight whose fused shards kept their own scales: ``backward_gemm``): each segment is
    summed from zero and the segment sums are added in order, each times its scale.
    ``rows`` (int32 / int64 [M'], on a's device): the sorted problem's row i is a's row rows[i] (a then holds
    each token once, the problem M' = T x top-k rows; offsets end at M'): the result is that of
    ``a.take(rows)``, bit for bit; the CUDA decode kernel reads the rows in place, the other paths gather
    them first. Index values are not checked on the GPU (a host read)."""
    ex = stack_experts(ws)
    if ex.codes.dim() != 3 or ex.scales.dim() != 3 or ex.scales.shape[:2] != ex.codes.shape[:2] \
            or ex.scales.shape[2] * 8 != ex.codes.shape[2]:
        raise ValueError(f"stacked experts: codes [E, N, K/2] and scales [E, N, K/16] do not match: "
                         f"{tuple(ex.codes.shape)}, {tuple(ex.scales.shape)}")
    e, n, k = ex.shape
    if k_segments > 1:
        if ex.global_scale.shape != (e, k_segments) or k % (128 * k_segments):
            raise ValueError(f"k_segments={k_segments}: need global_scale [{e}, {k_segments}] and K % "
                             f"{128 * k_segments} == 0; got {tuple(ex.global_scale.shape)}, K = {k}")
    elif ex.global_scale.dtype != torch.float32 or ex.global_scale.shape not in ((e,), (e, n)):
        raise ValueError(f"stacked experts: global_scale must be float32 [{e}] or [{e}, {n}], got "
                         f"{ex.global_scale.dtype} {tuple(ex.global_scale.shape)}")
    _check_common(a, k, ex.codes.device, out_dtype)
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) \
                or rows.device != a.device:
            raise ValueError(f"rows must be an int32/int64 [M'] tensor on {a.device}")
        rows = rows.contiguous()
        if a.device.type == "cpu" and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= a.shape[0]):
            raise ValueError(f"rows index outside a's {a.shape[0]} rows")
    m = a.shape[0] if rows is None else rows.numel()
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() != e + 1 \
            or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be an int32/int64 tensor [E+1] = [{e + 1}]")
    offsets = offsets.to(a.device)
    if a.device.type == "cpu":  # cheap here; on the GPU the check would cost a host sync per call
        o = offsets.tolist()
        if o[0] != 0 or o[-1] != m or any(x > y for x, y in zip(o, o[1:])):
            raise ValueError(f"offsets must start at 0, be non-decreasing and end at M={m}: {o}")
    path = gemm_path(a.device, backend)
    if path == "torch":
        return _torch_gemm.grouped_gemm(a if rows is None else a.take(rows), ex, offsets, out_dtype, k_segments)
    # Blackwell runs the portable decode kernel here too (a per-expert _scaled_mm would need host offsets)
    return _triton_grouped(a, ex, offsets, out_dtype, config, k_segments, rows)
