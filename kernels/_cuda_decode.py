"""The decode-regime NVFP4 GEMM (few token rows: dense M <= 64, grouped with few rows per expert) as a CUDA
kernel (``decode_gemm.cu``), built on first use with ``torch.utils.cpp_extension.load_inline``.

Why CUDA here: at M <= 16 the whole cost is streaming the packed weight and one fp16 -> fp32 mma chain per
16 weight rows. Triton 3.6 puts an in-loop decoded tile through shared memory with one 16-bit store per
element before the dot (bank-conflicted, ~1.4 us per 128-wide K step); the CUDA kernel decodes straight into
the mma.sync fragment registers (see the .cu header). It feeds the same fp16 values to the same mma in the
same K order as the Triton kernels, so a first-use probe (``gemm``) can prove it bit-equal to them; without
nvcc, on a GPU older than sm_80, or when the build fails, callers get ``None`` from ``module()`` and use
the Triton path (a warning says why, once). ``_decode_twin`` mirrors its fragment layout on CPU for tests.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import _backend, _cuda_build

SOURCE = Path(__file__).with_name("decode_gemm.cu")
STEP_K = 128         # K per step (the kernels' BK)
SLOT_BYTES = 16 * 80 + 16 * 8  # one warp's ring slot: 16 rows of codes (pitch 80) + 16 x 8 scale bytes
FRAG_SLOT_BYTES = 1024 + 16 * 8  # the same for fragment-order codes: the step's 1 KB as stored (``Slot``)
ROWS_PER_WARP = 16   # weight rows per warp (the mma's M)
TOKENS_PER_TILE = 8  # tokens per n8 tile (the mma's N); a CTA takes NT of them
MAX_EXPERTS = 4096   # the per-CTA tile scan lives in shared memory (4 bytes per expert)
_DECL = """
int64_t decode_gemm_launch(int64_t a_codes, int64_t a_scales, int64_t ga, int64_t w_codes, int64_t w_scales,
                           int64_t gw, int64_t bias, int64_t out, int64_t M, int64_t N, int64_t K, int64_t ga_row,
                           int64_t gw_row, int64_t out_kind, int64_t nt, int64_t depth, int64_t warps, int64_t seg,
                           int64_t chunk_log2, int64_t lanes, int64_t row_groups, int64_t grid_y, int64_t offsets,
                           int64_t offsets64,
                           int64_t n_experts, int64_t w_estride_c, int64_t w_estride_s, int64_t gw_estride,
                           int64_t frag, int64_t a_rows, int64_t a_rows64, int64_t balanced, int64_t pdl,
                           int64_t stream);
"""
_OUT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
DEPTHS = (4, 8, 16)     # cp.async ring depths compiled in (the ring runs D - 3 steps ahead of the decode)
FRAG_DEPTHS = (4, 8)    # ring depths compiled in for weight codes in fragment order (``weights.fragment_order``)
TILES = (1, 2, 4)       # n8 token tiles per CTA compiled in
LANES = (1, 2, 4, 8)    # warps sharing a row group's K chunks (chunked contract only)
ROW_GROUPS = tuple(range(1, 17))  # row groups of 16 weight rows a warp runs one after another per token tile
# Programmatic dependent launch (``Params::pdl``, where ``_backend.pdl_on``): 2 = wait for the previous kernel,
# let the next one start only as each CTA ends; 1 (let it start at once) measured slower: its programs take
# SM resources beside the decode CTAs (docs/KERNELS_NOTES.md, "Programmatic dependent launch, measured again")
PDL_MODE = 2


def enabled() -> bool:
    """False when MINITE_KERNELS_CUDA=0 (then the Triton kernels serve every M)."""
    return _cuda_build.enabled()


@functools.cache
def module(cap: tuple[int, int]):
    """The built extension for a device of compute capability ``cap``, or None (reason warned once)."""
    return _cuda_build.load("minite_decode_gemm", SOURCE, _DECL, ["decode_gemm_launch"], cap, (8, 0),
                            "decode GEMM", "mma.sync m16n8k16")


def supports(k: int, n: int, a, w_codes: torch.Tensor, w_scales: torch.Tensor) -> bool:
    """Operands the kernel takes: K in whole 128-wide steps, N in whole 16-row warps, rows densely packed
    (codes K/2 bytes apart, scales K/16), code bases 16-byte aligned (cp.async and 16-byte token loads),
    weight scales 8-byte and token scales 2-byte aligned. Anything else: the Triton kernels (same bits)."""
    def rows_packed(t, width):
        return t.dim() >= 2 and t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) == width)
    return (k % STEP_K == 0 and n % ROWS_PER_WARP == 0
            and rows_packed(a.codes, k // 2) and rows_packed(a.scales, k // 16)
            and rows_packed(w_codes, k // 2) and rows_packed(w_scales, k // 16)
            and a.codes.data_ptr() % 16 == 0 and w_codes.data_ptr() % 16 == 0
            and w_scales.data_ptr() % 8 == 0 and a.scales.data_ptr() % 2 == 0)


def units_per_thread(nt: int) -> int:
    """Token units a thread holds in registers for the next segment (``TokenBudget`` in the kernel)."""
    return 2 if nt >= 4 else 4


def lanes_for(cfg: dict, nsteps: int, chunk_steps: int) -> int:
    """Chunk lanes the kernel runs: the config's C, at most the number of K chunks (no idle lanes), a power of
    two; 1 without chunks."""
    if not chunk_steps:
        return 1
    nchunks = -(-nsteps // chunk_steps)
    lanes = cfg.get("C", 1)
    while lanes > 1 and lanes > nchunks:
        lanes //= 2
    return lanes


def row_groups_for(cfg: dict, nsteps: int, seg: int, chunk_steps: int) -> int:
    """Row groups a warp runs in sequence per token tile: the config's RG under one chain over K with all of
    K's token fragments resident (the ring and the register pipeline run on into the next row group), else 1."""
    return cfg.get("RG", 1) if not chunk_steps and seg >= nsteps else 1


def smem_bytes(cfg: dict, nsteps: int, seg: int, chunk_steps: int, lanes: int, n_experts: int = 0,
               frag: bool = False) -> int:
    """Dynamic shared memory of a launch (``Layout`` in the kernel): the warps' rings (slots of row-major or
    fragment-order codes), one or two token buffers, the chunk sums (chunk lanes only), the grouped tile list."""
    nt, depth, warps = cfg["NT"], cfg["D"], cfg["W"]
    nchunks = -(-nsteps // chunk_steps) if chunk_steps else 1
    ring = warps * depth * (FRAG_SLOT_BYTES if frag else SLOT_BYTES)
    tokens = (2 if seg < nsteps else 1) * seg * nt * 2048
    sums = nchunks * (warps // lanes) * 32 * 16 * nt if lanes > 1 else 0
    return ring + tokens + sums + (4 * (n_experts + 1) if n_experts else 0)


def segment(cfg: dict, nsteps: int, chunk_steps: int, lanes: int, smem_limit: int = 1 << 30,
            n_experts: int = 0, frag: bool = False) -> int:
    """K steps per token-fragment segment: all of K when its token units fit the registers the kernel keeps
    for them (then no barrier in the main loop), else the config's SEG (0: as many as fit); with chunks a
    whole number of rounds (lanes x chunk); then smaller ones until the launch fits ``smem_limit`` bytes.
    Raises ValueError when none does."""
    nt, warps = cfg["NT"], cfg["W"]
    cap = units_per_thread(nt) * warps // nt  # steps whose units (32 nt each) fit the CTA's registers
    unit = lanes * chunk_steps if chunk_steps else 1
    first = nsteps if nsteps <= cap else min(cfg.get("SEG", 0) or cap, cap) // unit * unit
    for seg in [first] + [i * unit for i in range((first - 1) // unit, 0, -1)]:
        if seg > 0 and smem_bytes(cfg, nsteps, seg, chunk_steps, lanes, n_experts, frag) <= smem_limit:
            return seg
    raise ValueError(f"CUDA decode GEMM config {cfg}: no token segment fits (K = {nsteps * STEP_K}"
                     + (f", rounds of {lanes} chunks of {chunk_steps} steps" if chunk_steps else "")
                     + f", {smem_limit} bytes of shared memory)")


@functools.cache
def smem_limit(device_index: int) -> int:
    """Dynamic shared memory a block may opt into on this GPU."""
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 232448)


def _check(cfg: dict) -> tuple[int, int, int]:
    nt, depth, warps = cfg["NT"], cfg["D"], cfg["W"]
    lanes = cfg.get("C", 1)
    if (nt not in TILES or depth not in DEPTHS or warps not in (1, 2, 4, 8) or lanes not in LANES
            or warps % lanes or units_per_thread(nt) * warps < nt or cfg.get("RG", 1) not in ROW_GROUPS
            or cfg.get("BAL", 0) not in (0, 1)):
        raise ValueError(f"bad CUDA decode GEMM config {cfg}")
    return nt, depth, warps


def chunk_log2(chunk_steps: int) -> int:
    """log2 of the K chunk in 128-wide steps (a power of two), -1 without chunks."""
    if not chunk_steps:
        return -1
    if chunk_steps & (chunk_steps - 1):
        raise ValueError(f"the CUDA decode GEMM takes K chunks of a power of two steps, not {chunk_steps}")
    return chunk_steps.bit_length() - 1


def plan(cfg: dict, k: int, chunk: int, device_index: int, n_experts: int = 0,
         frag: bool = False) -> tuple[int, int, int]:
    """(chunk lanes, K steps per token segment, row groups per warp) of a launch on this GPU."""
    nsteps, chunk_steps = k // STEP_K, chunk // STEP_K
    lanes = lanes_for(cfg, nsteps, chunk_steps)
    seg = segment(cfg, nsteps, chunk_steps, lanes, smem_limit(device_index), n_experts, frag)
    return lanes, seg, row_groups_for(cfg, nsteps, seg, chunk_steps)


def _call(mod, a, w_codes, w_scales, ga, gw, bias, out, m, n, k, cfg, grid_y, chunk, shape, offsets=None,
          strides=(0, 0, 0), frag=False, rows=None, balanced=False):
    nt, depth, warps = _check(cfg)
    lanes, seg, rg = shape
    offs, offs64, n_experts = 0, 0, 0
    if offsets is not None:
        offs, offs64, n_experts = offsets.data_ptr(), int(offsets.dtype == torch.int64), offsets.numel() - 1
    rc = mod.decode_gemm_launch(
        a.codes.data_ptr(), a.scales.data_ptr(), ga.data_ptr(), w_codes.data_ptr(), w_scales.data_ptr(),
        gw.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k, int(ga.numel() > 1),
        int(gw.dim() >= (2 if offsets is not None else 1)), _OUT_KIND[out.dtype], nt, depth, warps, seg,
        chunk_log2(chunk // STEP_K), lanes, rg, grid_y, offs, offs64, n_experts, *strides, int(frag),
        0 if rows is None else rows.data_ptr(), int(rows is not None and rows.dtype == torch.int64),
        int(balanced), PDL_MODE if _backend.pdl_on(out.device) else 0,
        torch.cuda.current_stream(out.device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"CUDA decode GEMM launch failed (code {rc}) for config {cfg}")
    return out


def dense(mod, a, w, out, bias, cfg: dict, chunk: int = 0, frag: torch.Tensor | None = None) -> torch.Tensor:
    """out[M, N] = a @ w.T (a, w NVFP4; ``out`` preallocated). Grid: weight-row groups x token tiles. ``chunk``:
    the K-chunk contract's chunk (0: one chain over K). ``frag``: w's codes in fragment order (read instead of
    ``w.codes`` where the ring depth has a fragment-order build; same bits)."""
    m, k = a.shape
    n = w.shape[0]
    ga, gw = a.global_scale.contiguous(), w.global_scale.contiguous()
    b32 = None if bias is None else bias.to(torch.float32).contiguous()
    grid_y = -(-m // (TOKENS_PER_TILE * cfg["NT"]))
    use = frag is not None and cfg["D"] in FRAG_DEPTHS
    shape = plan(cfg, k, chunk, out.device.index, frag=use)
    return _call(mod, a, frag if use else w.codes, w.scales, ga, gw, b32, out, m, n, k, cfg, grid_y, chunk, shape,
                 frag=use)


def grouped(mod, a, ex, out, offsets: torch.Tensor, cfg: dict, chunk: int = 0,
            rows: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped form, one launch: each CTA scans ``offsets`` (int32 or int64 [E + 1], on the device) into tiles
    of 8 NT rows and loops over them with stride gridDim.y (at most ``CTAS`` CTAs in all); with ``BAL`` (row
    groups in sequence, fragment-order codes) at most ``CTAS`` CTAs run one wave: where the routing makes more
    tiles than gridDim.y, they share the (tile, row group) pairs out evenly (``cta_range`` in the kernel).
    Reads ``ex.frag``
    (fragment-order codes) where present and the ring depth has a fragment-order build. ``rows`` (int32 /
    int64 [M], contiguous, on the device): the problem's row i is a's row rows[i], read in place."""
    m, k = a.shape if rows is None else (rows.numel(), a.shape[1])
    e, n, _ = ex.shape
    if offsets.dtype not in (torch.int32, torch.int64) or e > MAX_EXPERTS:
        raise ValueError(f"CUDA decode GEMM: offsets int32/int64 and at most {MAX_EXPERTS} experts")
    ga, gw = a.global_scale.contiguous(), ex.global_scale.contiguous()
    tile_rows = TOKENS_PER_TILE * cfg["NT"]
    bound = min(m, -(-m // tile_rows) + e)  # tiles that can hold rows
    frag = ex.frag is not None and cfg["D"] in FRAG_DEPTHS  # same bits either way
    shape = plan(cfg, k, chunk, out.device.index, e, frag)
    lanes, _, rg = shape
    groups_x = -(-(n // ROWS_PER_WARP) // (cfg["W"] // lanes * rg))
    balanced = bool(cfg.get("BAL", 0) and frag and rg > 1)
    if balanced:  # never above CTAS: one wave
        grid_y = max(1, min(bound, cfg["CTAS"] // groups_x))
    else:
        grid_y = max(1, min(bound, -(-cfg.get("CTAS", 4 * 132) // groups_x)))
    codes = ex.frag if frag else ex.codes
    strides = (codes.stride(0), ex.scales.stride(0), gw.stride(0))
    return _call(mod, a, codes, ex.scales, ga, gw, None, out, m, n, k, cfg, grid_y, chunk, shape,
                 offsets.contiguous(), strides, frag, rows, balanced)
