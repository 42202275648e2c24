"""A token's log-prob without the [B, V] log-softmax: each row's max and log-sum in torch's order.

    log_softmax_rows(logits, backend=None, row_max=None) -> torch.Tensor [B, V] | LogSoftmaxRows
        ``torch.log_softmax(logits.float(), -1)`` for logits [B, V] (fp32, or the model's BF16 / FP16 values,
        widened), or, where torch's order is reproduced, its per-row statistics: ``LogSoftmaxRows(logits, mx,
        logsum)``, from which the log-prob of token j is (float(logits[j]) - mx) - logsum, the epilogue of
        torch's kernel (``LogSoftMaxForwardEpilogue``), bit for bit.

Why. The decode step needs the log-prob of one token per row, and the trainer's log-softmax (torch's, over
the same fp32 logits) must give the same bits. torch writes the whole [B, V] result (a 151,936-id vocabulary
at batch 64: 39 MB written and read back; 47 us of an H200 decode step); the statistics need two reads, one
where the sampler already took each row's max from its own read (``sampling.sample_tokens_with_max``). The
trainer's fp32 logits hold BF16 values; the sampler keeps them in BF16 (half the bytes written and read) and
the kernels widen them in registers: the same fp32 values, so the same sums.

torch's order (``cunn_SoftMaxForward``, rows of V >= SMEM_MIN fp32 logits, 16-byte aligned): a block of T =
1024 threads per row; thread t takes the float4 vectors t, t + T, .. of the row's first V - V % 4T elements
(the four in order), then elements V - V % 4T + t, + T, .. one by one, accumulating exp(x - max) in that
order from 0.0 (``ilpReduce`` with ``SumExpFloat``); the block then sums its threads with ``BlockReduce``:
each warp by a shuffle tree (offsets 16 .. 1), then the 32 warp sums by the same tree. The max is exact in
any order; logsum = logf(sum). Shorter rows take other kernels (the warp softmax, the shared-memory one).
That order is read from torch's source, so it is not assumed: the first use on a GPU (``_probe.proven``)
compares whole rows with torch's log-softmax (so logsum itself, at each row's max) and keeps torch's
log-softmax if any bit differs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _backend, _probe

THREADS = 1024    # torch's block for rows of >= 1024 logits (SoftMaxForward_getBlockSize)
ILP = 4           # float4 vectors
SMEM_MIN = 12288  # from here on the row no longer fits torch's shared-memory kernel (48 KB, another order)
WIDENED = (torch.float32, torch.bfloat16, torch.float16)  # logit dtypes the kernels read (as fp32 values)


class LogSoftmaxRows(NamedTuple):
    """torch.log_softmax(logits, -1) as its rows' statistics: logits [B, V], mx [B], logsum [B] (fp32)."""
    logits: torch.Tensor
    mx: torch.Tensor
    logsum: torch.Tensor

    def at(self, tok: torch.Tensor) -> torch.Tensor:
        """Log-probs of tokens tok [B]: (logits[tok] - mx) - logsum, in fp32."""
        return (self.logits.gather(-1, tok[:, None]).squeeze(-1).float() - self.mx) - self.logsum

    def full(self) -> torch.Tensor:
        """The whole [B, V] log-softmax, by torch's epilogue (its max's entry is -logsum itself)."""
        return (self.logits.float() - self.mx[:, None]) - self.logsum[:, None]


class LogSoftmaxParts(NamedTuple):
    """``LogSoftmaxRows`` before the statistics' last pass: logits [B, V], each row's maxima part_max [B, n]
    (fp32; their max is the row's) and its 32 warp sums [B, 32]. ``rows()`` runs that pass (``finish_stats``);
    a kernel that reads the statistics can take it itself (``sampling.record_tokens``: the same helper, the
    same bits, one launch fewer)."""
    logits: torch.Tensor
    part_max: torch.Tensor
    warp_sums: torch.Tensor

    def rows(self) -> LogSoftmaxRows:
        mx = torch.empty(self.warp_sums.shape[0], device=self.logits.device, dtype=torch.float32)
        logsum = torch.empty_like(mx)
        finish_stats(self.part_max, self.warp_sums, mx, logsum)
        return LogSoftmaxRows(self.logits, mx, logsum)

    def at(self, tok: torch.Tensor) -> torch.Tensor:
        return self.rows().at(tok)

    def full(self) -> torch.Tensor:
        return self.rows().full()


def log_softmax_stats_emulated(logits: torch.Tensor) -> LogSoftmaxRows:
    """The statistics in torch's order (module docstring), in PyTorch: the kernel's reference."""
    b, v = logits.shape
    x = logits.to(torch.float32)
    mx = x.amax(-1)
    e = _backend.kernel_math("exp", x - mx[:, None])
    main = v - v % (ILP * THREADS)
    acc = torch.zeros(b, THREADS, dtype=torch.float32, device=x.device)
    vec = e[:, :main].reshape(b, main // (ILP * THREADS), THREADS, ILP)
    for k in range(vec.shape[1]):
        for j in range(ILP):
            acc = acc + vec[:, k, :, j]
    for start in range(main, v, THREADS):
        n = min(THREADS, v - start)
        acc[:, :n] = acc[:, :n] + e[:, start:start + n]
    total = _backend.shuffle_tree(_backend.shuffle_tree(acc.view(b, 32, 32)))
    return LogSoftmaxRows(logits, mx, _backend.kernel_math("log", total))


def parts_per_row(rows: int, device) -> int:
    """S, the programs a row's 1024 threads are spread over (a power of two, 1 .. 32): enough for two programs
    per SM, which one program per row leaves idle at decode batch sizes."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    s = 1
    while s < 32 and rows * s < 2 * sms:
        s *= 2
    return s


class SumLaunch(NamedTuple):
    """The sum pass's launch over rows of V logits: S programs per row (``parts``), the K float4 chunks of the
    row's main part (``main`` elements), and the kernel's shape arguments."""
    parts: int
    k: int
    main: int
    shape: dict


def sum_launch(b: int, v: int, device, parts: int | None = None) -> SumLaunch:
    s = parts or parts_per_row(b, device)
    if s not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"parts must be a power of two in 1 .. 32, got {s}")
    ts = THREADS // s
    main = v - v % (ILP * THREADS)
    shape = dict(TAIL=-(-(v - main) // THREADS), T=THREADS, TS=ts, num_warps=max(1, min(8, ts // 32)))
    return SumLaunch(s, main // (ILP * THREADS), main, shape)


def pow2_at_least(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): a Triton block width."""
    return 1 << max(0, n - 1).bit_length()


def log_softmax_stats(logits: torch.Tensor, parts: int | None = None, row_max: torch.Tensor | None = None
                      ) -> LogSoftmaxRows:
    """The Triton kernels (``_triton_log_softmax``): S = ``parts`` programs per row (default
    ``parts_per_row``) read it twice (max, then the sums), one program per row finishes; the bits do not
    depend on S. ``row_max`` (fp32 [B], each row's max of the logits, which is exact in any order, e.g. from
    the sampler's pass over the same logits): one read, the max pass skipped. ``logits``: of a WIDENED dtype,
    rows of unit stride."""
    from ._triton_log_softmax import _max_part_kernel, _sum_part_kernel

    if logits.dim() != 2 or logits.dtype not in WIDENED or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, V] rows of unit stride in one of {WIDENED}, got {logits.dtype} "
                         f"{tuple(logits.shape)} with strides {logits.stride()}")
    b, v = logits.shape
    dev = logits.device
    mx = torch.empty(b, device=dev, dtype=torch.float32)
    logsum = torch.empty_like(mx)
    if b:
        s, k, main, shape = sum_launch(b, v, dev, parts)
        warp_sums = torch.empty(b, 32, device=dev, dtype=torch.float32)
        if row_max is None:
            part_max = torch.empty(b, s, device=dev, dtype=torch.float32)
            _max_part_kernel[(b, s)](logits, logits.stride(0), part_max, v, k, main, **shape,
                                     **_backend.pdl_meta(_max_part_kernel, dev))
        else:
            if row_max.shape != (b,) or row_max.dtype != torch.float32 or row_max.device != dev:
                raise ValueError(f"row_max must be fp32 [{b}] on {dev}, got {row_max.dtype} "
                                 f"{tuple(row_max.shape)} on {row_max.device}")
            part_max = row_max.contiguous()
        mp = part_max.numel() // b
        _sum_part_kernel[(b, s)](logits, logits.stride(0), part_max, warp_sums, v, k, main, MP=mp, MP_P2=mp,
                                 **shape, **_backend.pdl_meta(_sum_part_kernel, dev))
        finish_stats(part_max, warp_sums, mx, logsum)
    return LogSoftmaxRows(logits, mx, logsum)


def finish_stats(part_max: torch.Tensor, warp_sums: torch.Tensor, mx: torch.Tensor, logsum: torch.Tensor) -> None:
    """The statistics' last pass: each row's max (of its maxima in ``part_max`` [B, n]) and the log of its 32
    warp sums added by the block's tree, into mx / logsum [B]."""
    from ._triton_log_softmax import _finish_kernel

    b = warp_sums.shape[0]
    mp = part_max.numel() // b
    _finish_kernel[(b,)](part_max, warp_sums, mx, logsum, MP=mp, MP_P2=pow2_at_least(mp), num_warps=1,
                         **_backend.pdl_meta(_finish_kernel, mx.device))


def covered(logits: torch.Tensor) -> bool:
    """Rows torch sums in the order above: rows of V >= SMEM_MIN, V % 4 == 0, of unit stride. fp32 rows are
    the ones torch reads, so they must be 16-byte aligned too; BF16 / FP16 rows stand for their fp32 copy,
    a fresh contiguous tensor, aligned whatever they are."""
    if (logits.dim() != 2 or logits.dtype not in WIDENED or logits.stride(-1) != 1
            or logits.shape[1] < SMEM_MIN or logits.shape[1] % ILP):
        return False
    return logits.dtype != torch.float32 or (logits.stride(0) % ILP == 0 and logits.data_ptr() % 16 == 0)


def _probe_ok(v: int, device, dtype: torch.dtype) -> bool:
    def probe():
        g = torch.Generator(device="cpu").manual_seed(v)
        x = (torch.randn(64, v, generator=g) * torch.exp2(torch.randint(-2, 5, (64, 1), generator=g).float()))
        x = x.to(device=device, dtype=dtype)
        return torch.equal(log_softmax_stats(x).full(), torch.log_softmax(x.float(), dim=-1))
    return _probe.proven(("log_softmax_rows", v) if dtype == torch.float32 else ("log_softmax_rows", v, str(dtype)),
                         device, probe)


def log_softmax_rows(logits: torch.Tensor, backend: str | None = None, row_max: torch.Tensor | None = None):
    """See the module docstring: the statistics on CUDA where covered and probed, else the full log-softmax
    (fp32). ``row_max``: each row's max of the logits, if known (``log_softmax_stats``)."""
    if stats_run(logits, backend):
        return log_softmax_stats(logits, row_max=row_max)
    return torch.log_softmax(logits.float(), dim=-1)


def stats_run(logits: torch.Tensor, backend: str | None = None) -> bool:
    """Whether ``log_softmax_rows`` gives these logits' statistics (CUDA, covered, probed) or torch's result."""
    return (logits.device.type == "cuda" and _backend.resolve(backend, logits.device) == "triton"
            and covered(logits) and _probe_ok(logits.shape[1], logits.device, logits.dtype))
