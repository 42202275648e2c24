"""Token sampling for the sampler's decode step, beside its PyTorch reference.

    sample_tokens(logits, temperature, uniform, top_p=None, backend=None) -> [B] int64
        logits [B, V] (fp32, or BF16 / FP16 widened as they are read); ``temperature`` (> 0) and ``top_p``
        (None = 1) numbers or 0-dim device tensors; ``uniform`` [B] in [0, 1): each row's one draw. The token
        is where the draw falls in the cumulative distribution of softmax(logits / temperature) over the
        vocabulary (inverse CDF): a row's token depends on its own logits and draw only, never on the batch,
        and nothing is read back to the host (CUDA-graph safe). top_p keeps the smallest set of most likely
        tokens whose probability reaches top_p (the token that crosses it included; ties: lowest id).

Paths. ``sample_tokens_reference`` (PyTorch: softmax, cumsum over V, searchsorted) serves CPU tensors and
every call given a top_p (it sorts). Plain sampling on CUDA runs two passes: one program per (row, block of
BLOCK logits) for the block's max m of z = logits / t and its sum of exp(z - m) (one read of the logits), then
one per row that takes the row's max M of the blocks' maxima, rescales each block's sum to it (s exp(m - M)),
adds them up by a scan over the blocks, finds the block where the running sum crosses draw x total, and looks
inside that block (a cumulative sum of its exp(z - M)). No softmax tensor and no [B, V] cumulative sum (on a 151,936-id
vocabulary the reference's scan alone costs ~0.25 ms per decode step at batch 64), and every SM busy: one
program per row would leave most of the GPU idle at decode batch sizes. The kernels sum in their own fixed
order (scans and trees of fixed shape), so their cumulative values can differ from the reference's in
the last bits: where a draw lands within that rounding of a boundary the two may pick neighbouring tokens.
Both are exact inverse-CDF samplers of the same distribution up to fp32 rounding; the tests check each
kernel token against a float64 CDF.

    sample_tokens_with_log_softmax(logits, temperature, uniform, backend=None) -> ([B], log-softmax)
        ``sample_tokens`` and ``log_softmax_rows`` of the same logits, the same values; on CUDA the token's
        pick and the log-softmax's sum pass share one launch (both need only the sampler's first pass), and
        the statistics come as ``LogSoftmaxParts`` (their last pass left to ``record_tokens``).

    record_tokens(tok, logp, slots, nxt, end, tokens, logprobs, stopped, stop, trash, write_tokens,
                  advance=None, backend=None)
        The decode step's bookkeeping for rows i < B, in one launch on CUDA (about ten small PyTorch ops,
        which ``record_tokens_reference`` runs): col = nxt[i] if nxt[i] < end[slots[i]] else ``trash``;
        tokens[slots[i], col] = tok[i] (``write_tokens``); logprobs[slots[i], col] = logp[i, tok[i]] (logp:
        the [B, V] fp32 log-softmax, or its ``LogSoftmaxRows`` / ``LogSoftmaxParts``, whose logits may be
        BF16 / FP16; parts are finished in the same launch);
        stopped[slots[i]] |= tok[i] == stop; ``advance`` = (ids, pos): ids[i] = tok[i], pos[i] = nxt[i].
        Copies, integer tests and torch's own log-softmax epilogue only, so both paths write the same values.
        Rows sharing a slot (padding rows on the dummy slot) write it in an unspecified order, as index_put does.

    step_inputs(pos, slots, tokens, uniform, max_pos, backend=None, embed=None, ids=None, table=None) -> StepInputs
        A decode step's per-row inputs from the rows' positions and cache slots [B] int64, in one launch on CUDA
        (``step_inputs_reference``: the same as small PyTorch ops): ``slot_ids`` = slots and ``seq_lens`` = pos + 1
        as int32 (the decode attention's), ``nxt`` = min(pos + 1, max_pos) (where the step's token goes), and
        the tables' cells there: ``forced`` = tokens[slots, nxt] (the teacher-forced token when scoring) and
        ``draw`` = uniform[slots, nxt] (the uniform draw that picks a sampled token); with ``embed`` / ``ids`` /
        ``table`` also ``hidden`` = embed[ids] and ``rows`` = table[pos] (the step's embedding and rotary rows:
        no gather launches of their own). Copies only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _backend, log_softmax
from .log_softmax import WIDENED, LogSoftmaxParts, LogSoftmaxRows

BLOCK = 4096      # logits per block: 37 blocks of a 151,936-id vocabulary, one 16 KB read per pass and block
PICK_SUMS_MIN_WARPS = 4  # the fused pick's program holds a block of BLOCK logits: at least 4 warps for it


def sample_tokens_reference(logits: torch.Tensor, temperature, uniform: torch.Tensor, top_p=None) -> torch.Tensor:
    """softmax -> (top_p filter) -> cumulative sum -> the first token whose cumulative probability exceeds
    draw x total (strictly below the total, so the search lands on a token whose probability is not 0)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p is not None:
        sp, si = probs.sort(dim=-1, descending=True, stable=True)
        drop = (sp.cumsum(dim=-1) - sp) >= top_p  # mass before this token already reaches top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp.masked_fill(drop, 0.0))
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(uniform[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


def sample_tokens(logits: torch.Tensor, temperature, uniform: torch.Tensor, top_p=None,
                  backend: str | None = None) -> torch.Tensor:
    """See the module docstring."""
    return sample_tokens_with_max(logits, temperature, uniform, top_p, backend, row_max=False)[0]


def sample_tokens_with_max(logits: torch.Tensor, temperature, uniform: torch.Tensor, top_p=None,
                           backend: str | None = None, row_max: bool = True):
    """``sample_tokens`` and (``row_max``) each row's max of the logits, fp32 [B]: from the kernels' one read
    of the logits on CUDA, else ``amax``; exact either way (a max does not round). The log-softmax statistics
    of the same logits take it instead of a pass of their own (``log_softmax_rows(..., row_max=)``)."""
    if logits.dim() != 2 or uniform.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [B, V] and uniform [B]; got {tuple(logits.shape)}, {tuple(uniform.shape)}")
    if top_p is not None or _backend.resolve(backend, logits.device) != "triton":
        tok = sample_tokens_reference(logits.float(), temperature, uniform, top_p)
        return tok, logits.float().amax(-1) if row_max and logits.shape[1] else None
    return _triton_sample(logits, temperature, uniform, row_max)


def sample_tokens_with_log_softmax(logits: torch.Tensor, temperature, uniform: torch.Tensor,
                                   backend: str | None = None):
    """(``sample_tokens``, ``log_softmax_rows``) of the same logits (no top_p), the same values as the two
    calls. Where both run their Triton kernels, the log-softmax's sum pass and the token's pick, which each
    need only the sampler's first pass, run side by side in one launch (``_pick_sums_kernel``), the sums
    taking the row's max from the first pass's block maxima: one launch and one wait fewer per decode step.
    There the log-softmax comes as ``LogSoftmaxParts`` (the block maxima and the warp sums): ``record_tokens``
    finishes them in its own launch, one launch fewer again; ``.rows()`` gives ``LogSoftmaxRows``."""
    fused = (logits.dim() == 2 and uniform.shape == logits.shape[:1] and logits.shape[0] > 0
             and _backend.resolve(backend, logits.device) == "triton" and log_softmax.covered(logits)
             and (logits.device.type != "cuda" or log_softmax.stats_run(logits, backend)))  # CPU: the interpreter
    if not fused:
        tok, mx = sample_tokens_with_max(logits, temperature, uniform, None, backend)
        return tok, log_softmax.log_softmax_rows(logits, backend, row_max=mx)
    from ._triton_sampling import _pick_sums_kernel

    x, t, u, out, stats = _first_pass(logits, temperature, uniform, True)
    b, v = x.shape
    block_max, block_sum, raw, nb, nb_p2 = stats
    s, k, main, shape = log_softmax.sum_launch(b, v, x.device)
    warp_sums = torch.empty(b, 32, device=x.device, dtype=torch.float32)
    shape["num_warps"] = max(shape["num_warps"], PICK_SUMS_MIN_WARPS)  # the sums' bits do not depend on it
    _pick_sums_kernel[(b, s + 1)](x, x.stride(0), t, block_max, block_sum, raw, u, out, warp_sums, v, nb,
                                  BLOCK=BLOCK, NB_P2=nb_p2, K=k, MAIN=main, **shape,
                                  **_backend.pdl_meta(_pick_sums_kernel, x.device))
    return out, LogSoftmaxParts(logits, raw, warp_sums)


def _first_pass(logits, temperature, uniform, row_max: bool):
    """The sampler's operands (x: logits of a WIDENED dtype, unit column stride; t [1] and u [B] fp32; out [B])
    and its first pass's block statistics (block maxima, sums, raw maxima, their count and its power of two
    at least 2)."""
    from ._triton_sampling import _block_stats_kernel

    b, v = logits.shape
    x = logits if logits.dtype in WIDENED else logits.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = temperature if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
    t = t.to(device=x.device, dtype=torch.float32).reshape(1)
    u = uniform.to(torch.float32).contiguous()
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    nb = -(-v // BLOCK)
    nb_p2 = max(2, log_softmax.pow2_at_least(nb))
    block_max = torch.empty(b, nb, dtype=torch.float32, device=x.device)
    block_sum = torch.empty_like(block_max)
    raw = torch.empty_like(block_max) if row_max else block_max  # a placeholder (and row_max's) when not written
    if b:
        _block_stats_kernel[(b, nb)](x, x.stride(0), t, block_max, block_sum, raw, v, nb, BLOCK=BLOCK,
                                     RAW_MAX=row_max, num_warps=8, **_backend.pdl_meta(_block_stats_kernel, x.device))
    return x, t, u, out, (block_max, block_sum, raw, nb, nb_p2)


def _triton_sample(logits, temperature, uniform, row_max: bool = False):
    from ._triton_sampling import _pick_kernel

    x, t, u, out, (block_max, block_sum, raw, nb, nb_p2) = _first_pass(logits, temperature, uniform, row_max)
    b, v = x.shape
    mx = torch.empty(b, dtype=torch.float32, device=x.device) if row_max else None
    if b:
        _pick_kernel[(b,)](x, x.stride(0), t, block_max, block_sum, raw, mx if row_max else raw, u, out, v, nb,
                           BLOCK=BLOCK, NB_P2=nb_p2, RAW_MAX=row_max, num_warps=8,
                           **_backend.pdl_meta(_pick_kernel, x.device))
    return out, mx


def record_tokens_reference(tok, logp, slots, nxt, end, tokens, logprobs, stopped, stop, trash, write_tokens,
                            advance=None):
    col = torch.where(nxt < end[slots], nxt, trash)
    if write_tokens:
        tokens[slots, col] = tok
    stats = isinstance(logp, (LogSoftmaxRows, LogSoftmaxParts))
    logprobs[slots, col] = logp.at(tok) if stats else logp.gather(-1, tok[:, None]).squeeze(-1)
    stopped[slots] = stopped[slots] | (tok == stop)
    if advance is not None:
        advance[0].copy_(tok)
        advance[1].copy_(nxt)


def record_tokens(tok, logp, slots, nxt, end, tokens, logprobs, stopped, stop, trash: int, write_tokens: bool,
                  advance=None, backend: str | None = None) -> None:
    """See the module docstring."""
    b = tok.shape[0]
    parts = isinstance(logp, LogSoftmaxParts)
    stats = parts or isinstance(logp, LogSoftmaxRows)
    lp = logp.logits if stats else logp
    ints = [tok, slots, nxt, end, tokens, stop] + list(advance or ())
    ok = (_backend.resolve(backend, tok.device) == "triton" and lp.dim() == 2 and lp.shape[0] == b
          and lp.stride(-1) == 1 and logprobs.dtype == torch.float32 and tokens.is_contiguous()
          and (lp.dtype == torch.float32 or (stats and lp.dtype in (torch.bfloat16, torch.float16)))
          and logprobs.is_contiguous() and tokens.stride(0) == logprobs.stride(0) and stopped.dtype == torch.bool
          and all(t.dtype == torch.int64 for t in ints) and all(t.is_contiguous() for t in ints))
    if not ok:
        return record_tokens_reference(tok, logp, slots, nxt, end, tokens, logprobs, stopped, stop, trash,
                                       write_tokens, advance)
    from ._triton_sampling import _record_kernel

    if b:
        ids, pos = advance if advance is not None else (tok, nxt)
        mx, logsum = (logp.part_max, logp.warp_sums) if parts else (logp.mx, logp.logsum) if stats else (lp, lp)
        mp = logp.part_max.numel() // b if parts else 0
        _record_kernel[(b,)](tok, lp, lp.stride(0), mx, logsum, slots, nxt, end, tokens, logprobs, tokens.stride(0),
                             stopped, stop, ids, pos, trash, WRITE_TOKENS=bool(write_tokens),
                             ADVANCE=advance is not None, STATS=stats, MP=mp,
                             MP_P2=log_softmax.pow2_at_least(mp) if parts else 1, num_warps=1,
                             **_backend.pdl_meta(_record_kernel, tok.device))


class StepInputs(NamedTuple):
    slot_ids: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    nxt: torch.Tensor       # [B] int64
    forced: torch.Tensor    # [B] int64
    draw: torch.Tensor      # [B] fp32
    hidden: torch.Tensor | None = None  # [B, H]: embed[ids] (asked with ``embed``)
    rows: torch.Tensor | None = None    # [B, *table.shape[1:]]: table[pos] (asked with ``table``)


def step_inputs_reference(pos, slots, tokens, uniform, max_pos: int, embed=None, ids=None, table=None) -> StepInputs:
    nxt = (pos + 1).clamp_max(max_pos)
    return StepInputs(slots.to(torch.int32), (pos + 1).to(torch.int32), nxt, tokens[slots, nxt], uniform[slots, nxt],
                      None if embed is None else embed[ids], None if table is None else table[pos])


def step_inputs(pos, slots, tokens, uniform, max_pos: int, backend: str | None = None, embed=None, ids=None,
                table=None) -> StepInputs:
    """See the module docstring. ``embed`` [V, H] and ``ids`` [B] (int64): also ``hidden`` = embed[ids] (the
    decode step's embedding); ``table`` [P, ...]: also ``rows`` = table[pos] (its rotary rows): the same launch
    copies them, two launches fewer per step."""
    if (embed is None) != (ids is None):
        raise ValueError("step_inputs: embed and ids come together (the embedding of the step's tokens)")
    b = pos.shape[0]
    ok = (_backend.resolve(backend, pos.device) == "triton" and pos.dtype == slots.dtype == tokens.dtype == torch.int64
          and uniform.dtype == torch.float32 and slots.shape == (b,) and pos.is_contiguous() and slots.is_contiguous()
          and tokens.is_contiguous() and uniform.is_contiguous() and tokens.shape == uniform.shape
          and (embed is None or (embed.dim() == 2 and embed.stride(1) == 1 and ids.shape == (b,)
                                 and ids.dtype == torch.int64 and ids.is_contiguous()))
          and (table is None or table.is_contiguous()))
    if not ok:
        return step_inputs_reference(pos, slots, tokens, uniform, max_pos, embed, ids, table)
    from ._triton_sampling import _step_inputs_kernel

    dev = pos.device
    hidden = torch.empty(b, embed.shape[1], dtype=embed.dtype, device=dev) if embed is not None else None
    rows = torch.empty(b, *table.shape[1:], dtype=table.dtype, device=dev) if table is not None else None
    out = StepInputs(torch.empty(b, dtype=torch.int32, device=dev), torch.empty(b, dtype=torch.int32, device=dev),
                     torch.empty(b, dtype=torch.int64, device=dev), torch.empty(b, dtype=torch.int64, device=dev),
                     torch.empty(b, dtype=torch.float32, device=dev), hidden, rows)
    if b:
        block = 256
        # (pointer, stride and width arguments; pos stands in for an absent tensor, which is never read)
        e_args = (ids, embed, embed.stride(0), hidden, embed.shape[1]) if embed is not None else (pos, pos, 0, pos, 1)
        r = table[0].numel() if table is not None else 1
        t_args = (table, r, rows, r) if table is not None else (pos, 0, pos, 1)
        blocks = -(-b // block) + (b if embed is not None or table is not None else 0)
        _step_inputs_kernel[(blocks,)](pos, slots, tokens, uniform, tokens.stride(0), *out[:5], b, int(max_pos),
                                       *e_args, *t_args, BLOCK=block, HB=log_softmax.pow2_at_least(e_args[4]),
                                       RB=log_softmax.pow2_at_least(r),
                                       EMBED=embed is not None, TABLE=table is not None, num_warps=4,
                                       **_backend.pdl_meta(_step_inputs_kernel, pos.device))
    return out
