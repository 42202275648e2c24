"""MoE top-k routing in one pass, bit for bit torch's CUDA ops.

    route(logits, top_k, norm_topk, mode, dtype=None, backend=None) -> (weights [T, k], ids [T, k] int64)
        transformers' Qwen3MoeTopKRouter on router logits [T, E]: fp32 softmax, ``torch.topk`` (sorted, the
        largest first), optionally divided by the top-k sum, then cast to ``dtype`` (default the logits')
        for "hf"; "vllm" keeps the fp32 weights.
    route_parts(parts, logits_dtype, top_k, norm_topk, mode, dtype=None, backend=None) -> the same for the
        logits ``hp_gemm.sum_parts(parts, logits_dtype, torch.float32)`` (the router GEMM's split-K partial
        sums [S, T, E]): the fused kernel adds them itself, one launch instead of two.

Why one pass. torch runs this as five or six launches a layer (softmax, the radix select and the bitonic
sort of ``topk``, the sum, the division, the cast): 19.5 us per layer on an H200 at batch 64 (CUDA graph,
[64, 128] logits, top-8), for a few KB of numbers. The trainer runs those very ops, so the sampler's fused
pass must give their bits, and the weights' ties decide the experts' order, which the combine's sum follows.
Reductions are therefore not re-ordered: the kernel reproduces the order of each torch kernel (read from its
source):
  * softmax over E <= 1024 (``softmax_warp_forward``): a row per warp of W = min(next_pow2(E), 32) lanes,
    lane l holding elements l + W i. The max is exact in any order; lane l sums exp(x - max) over its
    elements in i order from 0.0, then lanes are combined by an xor butterfly (halves: l + l ^ W/2, ...).
    exp is CUDA's expf, the quotient IEEE.
  * ``topk`` (k <= 32): the radix select keeps every value above the k-th largest and, of those equal to
    it, the lowest indices; it writes them in index order, those above first. The bitonic sort of k <= 32
    pairs (``bitonicSortKVInPlace``, 32 slots, the unused ones invalid and sorted last) then orders them by
    value with torch's compare-and-swap network: not stable, so equal values end where that network puts
    them, which the kernel follows swap by swap.
  * the top-k sum (k <= 32, every row count): block.x = last_pow2(k) lanes, lane l adding element l + bx to
    element l, then a shuffle tree over the lanes: halves (offsets decreasing, recent torch) or adjacent
    pairs (offsets increasing, older torch).
Which tree this torch has is not assumed: the first use on a GPU (``_probe.proven``) runs the kernel with
each tree beside torch's ops on rows full of ties and keeps the one that matches bitwise; if neither does
(a torch whose kernels changed), torch's ops run. ``route_emulated`` is the same algorithm in PyTorch (the
kernel's CPU reference); ``route_reference`` is torch's ops (the CPU path and the probe's reference).
NaN logits are outside the contract (torch's topk orders NaN first; the kernel does not).
"""
from __future__ import annotations

import torch

from . import _backend, _probe

MODES = ("hf", "vllm")
MAX_EXPERTS = 1024  # torch's warp softmax (a longer row is another kernel, another order)
MAX_TOP_K = 32      # torch's small bitonic sort (more is a merge sort)
SLOTS = 32          # the bitonic sort's slots
TREES = ("halves", "pairs")


def _check(logits, top_k, mode):
    if mode not in MODES:
        raise ValueError(f"routing numerics {mode!r}: expected one of {MODES}")
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"router logits must be [T, E] with 1 <= top_k <= E; got {tuple(logits.shape)}, "
                         f"top_k={top_k}")


def _out_dtype(logits, mode, dtype):
    return (dtype or logits.dtype) if mode == "hf" else torch.float32


def route_reference(logits, top_k: int, norm_topk: bool, mode: str, dtype=None):
    """torch's ops, as transformers' router calls them."""
    _check(logits, top_k, mode)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(_out_dtype(logits, mode, dtype)), idx


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def bitonic_stages():
    """torch's 32-slot network, in order: (stride, size) per compare-and-swap stage; a pair (p, p + stride)
    (bit ``stride`` of p clear) is put in descending order where bit ``size`` of p is clear (size 0: the
    final merge, every pair descending)."""
    stages = []
    size = 2
    while size < SLOTS:
        stride = size // 2
        while stride > 0:
            stages.append((stride, size))
            stride //= 2
        size *= 2
    stride = SLOTS // 2
    while stride > 0:
        stages.append((stride, 0))
        stride //= 2
    return stages


def route_emulated(logits, top_k: int, norm_topk: bool, mode: str, dtype=None, tree: str = "halves"):
    """The fused kernel's algorithm in PyTorch (module docstring): torch's CUDA orders, emulated."""
    _check(logits, top_k, mode)
    if tree not in TREES:
        raise ValueError(f"tree {tree!r}: expected one of {TREES}")
    t, e = logits.shape
    width = _pow2_at_least(e)
    w = min(width, 32)
    x = torch.full((t, width), float("-inf"), dtype=torch.float32, device=logits.device)
    x[:, :e] = logits.to(torch.float32)
    x = x.view(t, width // w, w)
    mx = x.amax(dim=(1, 2), keepdim=True)
    ex = _backend.kernel_math("exp", x - mx)
    s = torch.zeros(t, w, dtype=torch.float32, device=logits.device)
    for i in range(width // w):
        s = s + ex[:, i]
    total = _backend.shuffle_tree(s[:, :w])  # the xor butterfly: halves
    p = (ex / total[:, None, None]).reshape(t, width)[:, :e]

    # the radix select's choice and write order
    bits = p.view(torch.int32).to(torch.int64)
    ar = torch.arange(e, device=p.device)
    greater = (bits[:, None, :] > bits[:, :, None]).sum(-1)
    equal_before = ((bits[:, None, :] == bits[:, :, None]) & (ar[None, None, :] < ar[None, :, None])).sum(-1)
    sel = greater + equal_before < top_k
    kth = torch.where(greater + equal_before == top_k - 1, bits, -1).amax(-1, keepdim=True)
    above = bits > kth
    n_above = above.sum(-1, keepdim=True)
    pos = torch.where(above, torch.cumsum(above, -1) - 1, n_above + torch.cumsum(sel & ~above, -1) - 1)
    keys = torch.zeros(t, SLOTS, dtype=torch.float32, device=p.device)
    vals = torch.zeros(t, SLOTS, dtype=torch.int64, device=p.device)
    rows = torch.arange(t, device=p.device)[:, None].expand(t, e)
    keys[rows[sel], pos[sel]] = p[sel]
    vals[rows[sel], pos[sel]] = ar.expand(t, e)[sel]
    valid = (torch.arange(SLOTS, device=p.device) < top_k).expand(t, SLOTS).clone()

    slot = torch.arange(SLOTS, device=p.device)
    for stride, size in bitonic_stages():
        lo = slot[(slot & stride) == 0]
        hi = lo + stride
        ka, kb, va, vb = keys[:, lo], keys[:, hi], valid[:, lo], valid[:, hi]
        gt = (torch.isnan(ka) & ~torch.isnan(kb)) | (ka > kb)
        swap = (gt & va) | ~vb
        do = swap == ((lo & size) != 0)
        for arr in (keys, vals, valid):
            a, b = arr[:, lo].clone(), arr[:, hi].clone()
            arr[:, lo] = torch.where(do, b, a)
            arr[:, hi] = torch.where(do, a, b)
    top, idx = keys[:, :top_k], vals[:, :top_k]

    if norm_topk:
        bx = min(_pow2_at_most(top_k), 32)
        padded = torch.zeros(t, 2 * bx, dtype=torch.float32, device=p.device)
        padded[:, :top_k] = top
        lane = padded[:, :bx] + padded[:, bx:]  # element l, plus element l + bx where there is one
        top = top / _backend.shuffle_tree(lane[:, :bx], tree)[:, None]
    return top.to(_out_dtype(logits, mode, dtype)), idx


# ------------------------------------------------------------------------------------------- dispatch
def fused_fits(logits, top_k: int, out_dtype) -> bool:
    """Shapes and dtypes the fused kernel reproduces torch for."""
    return (logits.dim() == 2 and logits.shape[-1] <= MAX_EXPERTS and top_k <= MAX_TOP_K
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and out_dtype in (torch.float32, torch.bfloat16, torch.float16))


def route_fused(logits, top_k: int, norm_topk: bool, out_dtype, tree: str,
                parts_of: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (``_triton_routing``): one program per row. ``parts_of``: ``logits`` are split-K
    partial sums [S, T, E] (contiguous fp32) of logits of that dtype, added by the kernel."""
    from ._triton_routing import _route_kernel

    t, e = logits.shape[-2:]
    x = logits if logits.stride(-1) == 1 and parts_of is None else logits.contiguous()
    parts = x.shape[0] if parts_of is not None else 1
    rd = x.new_empty(1, dtype=parts_of) if parts_of is not None else x
    weights = torch.empty(t, top_k, device=logits.device, dtype=out_dtype)
    ids = torch.empty(t, top_k, device=logits.device, dtype=torch.int64)
    if t:
        width = _pow2_at_least(e)
        w = min(width, 32)
        bx = min(_pow2_at_most(top_k), 32)
        _route_kernel[(t,)](x, x.stride(-2), t * e, rd, weights, ids, e, top_k, W=w, LOG_W=w.bit_length() - 1,
                            IT=width // w, K_SLOTS=SLOTS, LOG_SLOTS=SLOTS.bit_length() - 1, BX=bx,
                            LOG_BX=bx.bit_length() - 1, NORM=norm_topk, HALVES=tree == "halves", PARTS=parts,
                            num_warps=1, enable_fp_fusion=False, **_backend.pdl_meta(_route_kernel, logits.device))
    return weights, ids


def _probe_logits(e: int, device) -> torch.Tensor:
    """Rows full of ties: coarse values (many equal logits, hence equal probabilities at and around the k-th
    largest), BF16 draws (the router's own values), and both mixed."""
    g = torch.Generator(device="cpu").manual_seed(0)
    coarse = torch.randint(-6, 7, (1024, e), generator=g).float() * 0.5
    fine = torch.randn(1024, e, generator=g).bfloat16().float() * 2
    mixed = torch.where(torch.rand(1024, e, generator=g) < 0.5, coarse, fine)
    return torch.cat([coarse, fine, mixed]).to(device)


def _tree(device, e: int, top_k: int, norm_topk: bool, in_dtype, out_dtype) -> str | None:
    """The tree this torch sums the top-k with, as found by the probe (None: neither matches)."""
    for tree in TREES if norm_topk else TREES[:1]:
        def probe(tree=tree):
            logits = _probe_logits(e, device).to(in_dtype)
            want = route_reference(logits, top_k, norm_topk, "hf", out_dtype)
            got = route_fused(logits, top_k, norm_topk, out_dtype, tree)
            return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
        if _probe.proven(("route", tree, e, top_k, norm_topk, in_dtype, out_dtype), device, probe):
            return tree
    return None


def route(logits, top_k: int, norm_topk: bool, mode: str, dtype=None, backend: str | None = None):
    """See the module docstring. CUDA: the fused kernel once the probe has matched it to torch on this GPU
    (else torch's ops); CPU: torch's ops, or with backend="triton" the kernel (halves) under the
    interpreter."""
    _check(logits, top_k, mode)
    out_dtype = _out_dtype(logits, mode, dtype)
    if _backend.resolve(backend, logits.device) != "triton" or not fused_fits(logits, top_k, out_dtype):
        return route_reference(logits, top_k, norm_topk, mode, dtype)
    if logits.device.type != "cuda":
        return route_fused(logits, top_k, norm_topk, out_dtype, "halves")
    tree = _tree(logits.device, logits.shape[-1], top_k, norm_topk, logits.dtype, out_dtype)
    if tree is None:
        return route_reference(logits, top_k, norm_topk, mode, dtype)
    return route_fused(logits, top_k, norm_topk, out_dtype, tree)


def route_parts(parts, logits_dtype, top_k: int, norm_topk: bool, mode: str, dtype=None,
                backend: str | None = None):
    """``route`` of the logits ``hp_gemm.sum_parts(parts, logits_dtype, torch.float32)`` (fp32 holding
    ``logits_dtype`` values: the router's GEMM split K into parts [S, T, E], fp32), bit for bit; where the fused
    kernel runs, it adds the parts itself (one launch fewer a layer)."""
    from .hp_gemm import sum_parts
    if parts.dim() != 3 or parts.dtype != torch.float32:
        raise ValueError(f"expected fp32 split-K partial sums [S, T, E]; got {parts.dtype} {tuple(parts.shape)}")
    out_dtype = (dtype or torch.float32) if mode == "hf" else torch.float32
    tree = "halves"
    fits = fused_fits(parts[0], top_k, out_dtype) and _backend.resolve(backend, parts.device) == "triton"
    if fits and parts.device.type == "cuda":
        tree = _tree(parts.device, parts.shape[-1], top_k, norm_topk, torch.float32, out_dtype)
    if not fits or tree is None:
        return route(sum_parts(parts, logits_dtype, torch.float32), top_k, norm_topk, mode, dtype, backend)
    _check(parts[0], top_k, mode)
    return route_fused(parts, top_k, norm_topk, out_dtype, tree, parts_of=logits_dtype)
