"""Launchers of ``_triton_gemm_w32.nvfp4_mm_w32_kernel`` (dense and grouped; variants decode32, small, w16w)."""
from __future__ import annotations

import torch

from . import _backend
from .weights import _u8, decode_f16

WORD_VARIANTS = ("decode32", "small", "w16w")


def _scale_view(s: torch.Tensor, words: bool) -> torch.Tensor:
    s = _u8(s)
    return s.view(torch.int32) if words else s


def _words_ok(k: int, *scales: torch.Tensor) -> bool:
    """Scales readable as int32 words: whole words per row (K % 64 == 0) and word-aligned storage."""
    return k % 64 == 0 and all(s.data_ptr() % 4 == 0 for s in scales)


def launch_dense(a, wq, w_f16, out, bias, cfg: dict, k_chunk: int = 0) -> torch.Tensor:
    """a [M, K] NVFP4, wq [N, K] NVFP4 (w_f16: its ``decode_f16`` form, needed by w16w) -> out [M, N];
    ``k_chunk``: the K-chunk contract (0: one chain over K)."""
    from . import _triton_gemm as tg
    from . import _triton_gemm_w32 as tw
    m, k = a.shape
    n = out.shape[1]
    cfg = dict(cfg)
    variant = cfg.pop("variant")
    bm, bn, gm = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("GROUP_M", 1)
    a_codes, a_sc = a.codes.contiguous(), _u8(a.scales)
    w_sc = _u8(wq.scales)
    words = _words_ok(k, a_sc, w_sc)
    ga, gw = a.global_scale.contiguous(), wq.global_scale.contiguous()
    if variant == "w16w":
        w_arg, w_rs = w_f16, w_f16.stride(0)
    else:
        w_arg = wq.codes.contiguous().view(torch.int32)
        w_rs = w_arg.stride(0)
    a_words = a_codes.view(torch.int32)
    if variant == "small":  # tokens pre-decoded (M <= 16 rows: a few KB per K step)
        a_words = decode_f16(a)
    a_s, w_s = _scale_view(a_sc, words), _scale_view(w_sc, words)
    tiles_m = (m + bm - 1) // bm
    grid = (tiles_m * ((n + bn - 1) // bn),)
    tw.nvfp4_mm_w32_kernel[grid](
        a_words, a_s, w_arg, w_s, ga, gw, bias.contiguous() if bias is not None else ga, out, ga, ga, ga,
        m, n, k, tiles_m, a_words.stride(0), w_rs, a_s.stride(0), w_s.stride(0), 0, 0, 0,
        GA_ROW=ga.dim() == 1, GW_ROW=gw.dim() == 1, HAS_BIAS=bias is not None, GROUPED=False,
        BM=bm, BN=bn, BK=tg.BK, GROUP_M=gm, SCALE_WORDS=words, SWAP=variant == "small",
        W_F16=variant == "w16w", A_F16=variant == "small", KC=k_chunk, **cfg,
        **_backend.pdl_meta(tw.nvfp4_mm_w32_kernel, out.device))
    return out


def launch_grouped(a, ex, out, cfg: dict, tiles, k_chunk: int = 0) -> torch.Tensor:
    """Grouped form (decode32, or w16w on ``ex.f16``); ``tiles`` = (tile_expert, tile_row, bound, offs32)."""
    from . import _triton_gemm as tg
    from . import _triton_gemm_w32 as tw
    m, k = a.shape
    n = out.shape[1]
    cfg = dict(cfg)
    variant = cfg.pop("variant")
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    cfg.pop("GROUP_M", None)
    tile_e, tile_r, bound, offs32 = tiles
    a_sc, w_sc = _u8(a.scales), _u8(ex.scales)
    words = _words_ok(k, a_sc, w_sc)
    a_words = a.codes.contiguous().view(torch.int32)
    a_s, w_s = _scale_view(a_sc, words), _scale_view(w_sc, words)
    if variant == "w16w":
        w_arg = ex.f16
        w_rs, w_ec = w_arg.stride(1), w_arg.stride(0)
    else:
        w_arg = ex.codes.contiguous().view(torch.int32)
        w_rs, w_ec = w_arg.stride(1), w_arg.stride(0)
    ga, gw = a.global_scale.contiguous(), ex.global_scale.contiguous()
    tw.nvfp4_mm_w32_kernel[(bound, (n + bn - 1) // bn)](
        a_words, a_s, w_arg, w_s, ga, gw, ga, out, tile_e, tile_r, offs32,
        m, n, k, 0, a_words.stride(0), w_rs, a_s.stride(0), w_s.stride(1), w_ec, w_s.stride(0), gw.stride(0),
        GA_ROW=ga.dim() == 1, GW_ROW=gw.dim() == 2, HAS_BIAS=False, GROUPED=True,
        BM=bm, BN=bn, BK=tg.BK, GROUP_M=1, SCALE_WORDS=words, SWAP=False, W_F16=variant == "w16w", KC=k_chunk,
        **cfg, **_backend.pdl_meta(tw.nvfp4_mm_w32_kernel, out.device))
    return out
