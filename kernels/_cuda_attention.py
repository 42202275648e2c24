"""The float64 decode attention on the fp64 tensor cores (``decode_attention.cu``: mma.sync m8n8k4 .f64), built
on first use (``_cuda_build``).

Why CUDA here: the "invariant" decode attention does every product and sum in float64, and the Triton kernel
runs them on the float64 FMA pipe, one lane-element at a time (Triton 3.6 builds no float64 ``tl.dot`` on
sm_90). The fp64 tensor cores do a k4 step of 8 x 8 products in one instruction; on the H200 at the FMA pipe's
rate (61 FMA per cycle and SM, measured), so the gain is the instructions not issued, and a dependent mma
takes ~188 cycles: the kernel keeps many short chains in flight. The bits are those of the PyTorch reference for the
reason the Triton kernel's are (the .cu header). Without nvcc, below sm_80, with MINITE_KERNELS_CUDA=0 or when
the build fails, ``module`` returns None and ``attention.decode_attention`` takes the Triton kernel.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import _backend, _cuda_build

SOURCE = Path(__file__).with_name("decode_attention.cu")
HEAD_DIMS = (64, 128)  # head dims compiled in (the q rows live in registers: D / 4 float64 a lane)
ROWS = 8               # query heads of a KV head per CTA (the mma's M; fewer are padded)
CHUNK = 16             # keys a warp takes at a time (``kTiles`` key tiles of 8)
_DECL = """
int64_t decode_attention_launch(int64_t q, int64_t k, int64_t v, int64_t slot_ids, int64_t seq_lens,
                                int64_t part_acc, int64_t part_ml, int64_t out, int64_t batch, int64_t n_q_heads,
                                int64_t rep, int64_t d, int64_t sq_b, int64_t sq_h, int64_t sk_slot,
                                int64_t sk_head, int64_t sk_seq, int64_t sv_slot, int64_t sv_head, int64_t sv_seq,
                                double scale, int64_t splits, int64_t warps, int64_t pdl, int64_t stream);
"""
# PDL (``_backend.pdl_on``): 1 = wait for the previous kernel, then let the next one start at once (the Triton
# kernels' rule); 2 = let it start only as each CTA ends
PDL_MODE = 1


@functools.cache
def module(cap: tuple[int, int]):
    """The built extension for a device of compute capability ``cap``, or None (reason warned once)."""
    return _cuda_build.load("minite_decode_attention", SOURCE, _DECL, ["decode_attention_launch"], cap, (8, 0),
                            "float64 decode attention", "mma.sync m8n8k4 .f64")


def module_for(device: torch.device):
    """``module`` for a CUDA device, None elsewhere or with MINITE_KERNELS_CUDA=0."""
    if device.type != "cuda" or not _cuda_build.enabled():
        return None
    return module(_backend.capability(device))


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Operands the kernel takes: BF16 q and caches, a compiled head dim, 16-byte aligned rows (bases and the
    batch / head / slot / position strides), dims contiguous. Anything else: the Triton kernel (same bits)."""
    ts = (q, k_cache, v_cache)
    return (all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
                and all(s % 8 == 0 for s in t.stride()[:-1]) for t in ts)
            and q.shape[-1] in HEAD_DIMS)


def config(batch: int, kv_heads: int, rep: int, max_len: int, sms: int, splits: int | None = None
           ) -> tuple[int, int]:
    """(splits, warps) of a launch, from shapes only (fixed per captured batch size):
    - splits (unless given): 1, or with fewer CTAs than half the SMs the most (a power of two) that keep the
      CTAs within half the SMs and two chunks of keys per split at ``max_len``;
    - warps: 4 with fewer CTAs than SMs, or with long splits (256 keys and more) whose CTAs fit two per SM;
      else 2.
    H200, CUDA-graph medians (docs/KERNELS_NOTES.md): Qwen3-30B-A3B (8 x 128 rows a KV head) at batch 64 and
    33-96 keys best with 2 warps (4: +0.4-1.8 us), at 300 and 1,024 keys with 4 (8 warps: one CTA an SM);
    at batch 8 with 2 splits of 4 warps; the ``small`` model at batch 256 with 2 (4: +3.7 us)."""
    ctas = batch * kv_heads * -(-rep // ROWS)
    if splits is None:
        splits = 1
        while ctas * splits * 2 <= sms // 2 and max_len >= 2 * CHUNK * splits * 2:
            splits *= 2
    per_split = -(-max_len // splits)
    ctas *= splits
    warps = 4 if ctas < sms or (per_split >= 256 and ctas <= 2 * sms) else 2
    return splits, warps


def launch(mod, q, k_cache, v_cache, slot_ids, seq_lens, part_acc, part_ml, out, scaling: float, splits: int,
           warps: int) -> torch.Tensor:
    """out [B, Hq, D] (splits == 1), else the splits' partials in part_acc / part_ml for
    ``merge_splits_kernel``."""
    b, hq, d = q.shape
    rep = hq // k_cache.shape[1]
    rc = mod.decode_attention_launch(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_ids.data_ptr(), seq_lens.data_ptr(),
        part_acc.data_ptr(), part_ml.data_ptr(), out.data_ptr(), b, hq, rep, d, *q.stride()[:2],
        *k_cache.stride()[:3], *v_cache.stride()[:3], float(scaling), splits, warps,
        PDL_MODE if _backend.pdl_on(q.device) else 0, torch.cuda.current_stream(q.device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"CUDA decode attention launch failed (code {rc}, {warps} warps)")
    return out
