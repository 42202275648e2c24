"""Triton attention kernels (launches, shapes and references live in ``attention``).

Two numerics:
    fast       bf16 tensor-core dots, fp32 softmax and accumulators (what SDPA / flash attention do).
    invariant  every product and sum in float64, so the bf16 output does not depend on the reduction order
               (``attention.invariant_attention_reference`` states the argument). Triton 3.6 cannot build an
               fp64 ``tl.dot`` on sm_90, so the fp64 "matmuls" are elementwise products reduced in registers.

The fp64 kernels work on a row block (query heads of one KV head in decode, query positions of one head in
prefill) against key blocks, flash style (online softmax, no [T, T] buffer). Layout matters more than FLOPs
there, and Triton picks layouts from the loads, so the code is shaped for it:
    q.k  a [rows, BD, keys] product summed over BD: each thread loads BD contiguous bf16 of one key (16
         bytes), keys spread across threads, so the d sum stays in registers. The query rows are read back
         from a per-program float64 copy (``scratch``) one BD chunk at a time (broadcast loads).
    p.v  one key at a time: the key's p column (``scratch``, written transposed) times its V row, D spread
         across threads; a [rows, keys, D] product would hold the whole p block in every thread.
Each program owns a scratch slot of (rows * D + keys * rows) float64: its query rows, then p^T.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_pdl import pdl_wait
from ._triton_round import round_to


@triton.jit
def _f64(bits):
    """A float64 scalar passed as its int64 bit pattern (Triton passes Python floats as fp32)."""
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def _split_range(n, BN: tl.constexpr):
    """Keys [lo, hi) of this program's split (grid axis 2) of a sequence of n keys: whole BN blocks, as even
    as they go; trailing splits of a short sequence are empty."""
    chunk = tl.cdiv(tl.cdiv(n, tl.num_programs(2)), BN) * BN
    lo = tl.program_id(2) * chunk
    return lo, tl.minimum(lo + chunk, n)


@triton.jit
def _stage_rows_f64(src_rows, row_mask, dst, D: tl.constexpr):
    """Copy the query rows (src_rows [R] pointers to bf16 rows) into dst [R, D] as float64 (exact)."""
    r = tl.arange(0, src_rows.shape[0])[:, None]
    d = tl.arange(0, D)[None, :]
    q = tl.load(src_rows[:, None] + d, mask=row_mask[:, None], other=0.0).to(tl.float64)
    tl.store(dst + r * D + d, q)
    tl.debug_barrier()


@triton.jit
def _scores_f64(q64, k_base, sk_n, keys, key_mask, R: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                STAGES: tl.constexpr):
    """s[r, n] = sum_d q[r, d] k[keys[n], d] in float64; q64 [R, D] float64 in scratch. STAGES: software
    pipelining of the d loop (the next chunks' K loads in flight while one multiplies)."""
    q3 = q64 + tl.arange(0, R)[:, None, None] * D
    dq = tl.arange(0, BD)[None, :, None]
    k3 = k_base + keys[None, None, :].to(tl.int64) * sk_n
    km = key_mask[None, None, :]
    s = tl.zeros([R, keys.shape[0]], tl.float64)
    for d0 in tl.range(0, D, BD, num_stages=STAGES):
        qc = tl.load(q3 + d0 + dq)
        kc = tl.load(k3 + d0 + dq, mask=km, other=0.0).to(tl.float64)
        s += tl.sum(qc * kc, axis=1)
    return s


@triton.jit
def _softmax_step_f64(s, m, denom):
    """Online softmax: new running max and sum, the block's weights p and the rescale of the old ones.
    Rows with no valid key so far keep m = -inf, denom = 0 and get p = 0 (no NaN from -inf - -inf)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    p = tl.exp(s - m_ref[:, None])
    return p, alpha, m_new, denom * alpha + tl.sum(p, axis=1)


@triton.jit
def _add_pv_f64(acc, p, p_t, v_base, sv_n, key0, n_keys, D: tl.constexpr, UNROLL: tl.constexpr,
                MASKED: tl.constexpr):
    """acc[r, :] += sum_j p[r, j] v[key0 + j, :] over the block's first n_keys keys, in float64, key after
    key, in rounds of UNROLL keys whose loads are issued together (a rolled loop waits about one memory
    latency per key). MASKED: every round masked (keys past n_keys load p = v = 0 and add +0.0, which leaves
    acc as it is: acc starts at +0.0 and +0.0 + -0.0 = +0.0); else whole rounds unmasked, then the keys left
    one at a time. The same additions in the same order either way."""
    r = tl.arange(0, p.shape[0])
    tl.store(p_t + tl.arange(0, p.shape[1])[None, :] * p.shape[0] + r[:, None], p)
    tl.debug_barrier()
    dv = tl.arange(0, D)[None, :]
    whole = n_keys if MASKED else n_keys // UNROLL * UNROLL
    for j0 in range(0, whole, UNROLL):
        for u in tl.static_range(UNROLL):
            j = j0 + u
            if MASKED:
                pj = tl.load(p_t + j * p.shape[0] + r[:, None], mask=r[:, None] * 0 + j < n_keys, other=0.0)
                vj = tl.load(v_base + tl.cast(key0 + j, tl.int64) * sv_n + dv, mask=dv * 0 + j < n_keys,
                             other=0.0).to(tl.float64)
            else:
                pj = tl.load(p_t + j * p.shape[0] + r[:, None])
                vj = tl.load(v_base + tl.cast(key0 + j, tl.int64) * sv_n + dv).to(tl.float64)
            acc += pj * vj
    for j in range(whole, n_keys):
        pj = tl.load(p_t + j * p.shape[0] + r[:, None])
        vj = tl.load(v_base + tl.cast(key0 + j, tl.int64) * sv_n + dv).to(tl.float64)
        acc += pj * vj
    tl.debug_barrier()  # the next block rewrites p_t
    return acc


@triton.jit
def decode_f64_kernel(q, k_cache, v_cache, slot_ids, seq_lens, part_acc, part_ml, scratch, out,
                      n_q_heads, rep, groups, rows, sq_b, sq_h, sk_slot, sk_head, sk_seq, sv_slot, sv_head, sv_seq,
                      scale_bits, D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                      DIRECT: tl.constexpr, QK_STAGES: tl.constexpr, PV_UNROLL: tl.constexpr,
                      PV_MASKED: tl.constexpr, PDL: tl.constexpr = False):
    """One (sequence, KV head, head group, split): ``rows`` of the KV head's ``rep`` query heads (group g:
    heads g * rows ..) against keys [lo, hi) of the split. Grid (B, Hkv x groups, splits); DIRECT (one split):
    write the output itself, else a partial for merge_splits. A row's sums do not involve the other rows."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1) // groups
    scale = _f64(scale_bits)
    slot = tl.load(slot_ids + b).to(tl.int64)
    lo, hi = _split_range(tl.load(seq_lens + b), BN)
    hh = tl.program_id(1) % groups * rows + tl.arange(0, BH)
    hmask = (tl.arange(0, BH) < rows) & (hh < rep)
    heads = kvh * rep + hh
    prog = (b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    q64 = scratch + prog.to(tl.int64) * (BH * D + BN * BH)
    _stage_rows_f64(q + b.to(tl.int64) * sq_b + heads * sq_h, hmask, q64, D)
    k_base = k_cache + slot * sk_slot + kvh.to(tl.int64) * sk_head
    v_base = v_cache + slot * sv_slot + kvh.to(tl.int64) * sv_head
    m = tl.full([BH], float("-inf"), tl.float64)
    denom = tl.zeros([BH], tl.float64)
    acc = tl.zeros([BH, D], tl.float64)
    for start in range(lo, hi, BN):
        keys = start + tl.arange(0, BN)
        kmask = keys < hi
        s = _scores_f64(q64, k_base, sk_seq, keys, kmask, BH, D, BD, QK_STAGES)
        s = tl.where(kmask[None, :], s * scale, float("-inf"))
        p, alpha, m, denom = _softmax_step_f64(s, m, denom)
        acc = _add_pv_f64(acc * alpha[:, None], p, q64 + BH * D, v_base, sv_seq, start,
                          tl.minimum(BN, hi - start), D, PV_UNROLL, PV_MASKED)
    _finish_split(acc, m, denom, part_acc, part_ml, out, b, heads, hmask, n_q_heads, D, DIRECT)


@triton.jit
def decode_fast_kernel(q, k_cache, v_cache, slot_ids, seq_lens, part_acc, part_ml, out,
                       n_q_heads, rep, sq_b, sq_h, sk_slot, sk_head, sk_seq, sv_slot, sv_head, sv_seq,
                       scale_log2e, D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, DIRECT: tl.constexpr,
                       UPCAST_DOT: tl.constexpr, PDL: tl.constexpr = False):
    """As decode_f64_kernel with bf16 dots (BH >= 16 rows, the rest masked) and fp32 exp2 softmax.
    UPCAST_DOT (interpreter only): fp32 dot operands; the interpreter's dot multiplies bf16 storage bits."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    slot = tl.load(slot_ids + b).to(tl.int64)
    lo, hi = _split_range(tl.load(seq_lens + b), BN)
    hh = tl.arange(0, BH)
    hmask = hh < rep
    heads = kvh * rep + hh
    d = tl.arange(0, D)
    qt = tl.load(q + b.to(tl.int64) * sq_b + heads[:, None] * sq_h + d[None, :], mask=hmask[:, None], other=0.0)
    if UPCAST_DOT:
        qt = qt.to(tl.float32)
    k_base = k_cache + slot * sk_slot + kvh.to(tl.int64) * sk_head
    v_base = v_cache + slot * sv_slot + kvh.to(tl.int64) * sv_head
    m = tl.full([BH], float("-inf"), tl.float32)
    denom = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    for start in range(lo, hi, BN):
        keys = start + tl.arange(0, BN)
        kmask = keys < hi
        k = tl.load(k_base + keys[:, None].to(tl.int64) * sk_seq + d[None, :], mask=kmask[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.where(kmask[None, :], tl.dot(qt, tl.trans(k)) * scale_log2e, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every block holds a valid key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + keys[:, None].to(tl.int64) * sv_seq + d[None, :], mask=kmask[:, None], other=0.0)
        pv = p.to(v.dtype)
        if UPCAST_DOT:
            v, pv = v.to(tl.float32), pv.to(tl.float32)
        acc = tl.dot(pv, v, acc * alpha[:, None])
        m = m_new
    _finish_split(acc, m, denom, part_acc, part_ml, out, b, heads, hmask, n_q_heads, D, DIRECT)


@triton.jit
def _finish_split(acc, m, denom, part_acc, part_ml, out, b, heads, hmask, n_q_heads, D: tl.constexpr,
                  DIRECT: tl.constexpr):
    """One split: the output itself (DIRECT: a single split), else the partial (unnormalised acc, running
    max, sum) at [b, head, split]."""
    d = tl.arange(0, D)[None, :]
    row = b.to(tl.int64) * n_q_heads + heads
    if DIRECT:
        o = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # no key (empty split): acc = 0 -> 0
        tl.store(out + row[:, None] * D + d, round_to(o, out.dtype.element_ty), mask=hmask[:, None])
    else:
        part = row * tl.num_programs(2) + tl.program_id(2)
        tl.store(part_acc + part[:, None] * D + d, acc, mask=hmask[:, None])
        tl.store(part_ml + part * 2, m, mask=hmask)
        tl.store(part_ml + part * 2 + 1, denom, mask=hmask)


@triton.jit
def merge_splits_kernel(part_acc, part_ml, out, n_q_heads, n_splits, D: tl.constexpr, SPLITS_P2: tl.constexpr,
                        F64: tl.constexpr, PDL: tl.constexpr = False):
    """out[b, h] from the n_splits partials of (b, h), merged by log-sum-exp, splits added in order."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64) * n_q_heads + tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    first = row * n_splits
    mx = tl.max(tl.load(part_ml + (first + s) * 2, mask=s < n_splits, other=float("-inf")), axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    d = tl.arange(0, D)
    o = tl.zeros([D], part_acc.dtype.element_ty)
    total = tl.zeros([], part_acc.dtype.element_ty)
    for sp in range(n_splits):
        m = tl.load(part_ml + (first + sp) * 2)
        w = tl.exp(m - mx) if F64 else tl.exp2(m - mx)  # empty split: m = -inf -> weight 0
        total += w * tl.load(part_ml + (first + sp) * 2 + 1)
        o += w * tl.load(part_acc + (first + sp) * D + d)
    o = o / tl.where(total > 0, total, 1.0)
    tl.store(out + row * D + d, round_to(o, out.dtype.element_ty))


@triton.jit
def prefill_f64_kernel(q, k, v, keep, scratch, out, n_q_heads, rep, tq, tk, n_tiles,
                       sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                       skeep_b, skeep_h, skeep_q, skeep_k, so_b, so_t, so_h, scale_bits,
                       D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                       CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, QK_STAGES: tl.constexpr,
                       PV_UNROLL: tl.constexpr, PV_MASKED: tl.constexpr):
    """Full-sequence float64 attention, persistent: each program walks tiles (b, head, BM query rows) with
    stride num_programs, heaviest (last) row blocks first; its scratch slot is reused tile after tile.
    Query row i sits at key position tk - tq + i (causal: it attends keys 0 .. tk - tq + i)."""
    n_m = tl.cdiv(tq, BM)
    q64 = scratch + tl.program_id(0).to(tl.int64) * (BM * D + BN * BM)
    scale = _f64(scale_bits)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        bh = tile // n_m
        mb = n_m - 1 - tile % n_m
        b = bh // n_q_heads
        h = bh % n_q_heads
        rows = mb * BM + tl.arange(0, BM)
        rmask = rows < tq
        _stage_rows_f64(q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + rows.to(tl.int64) * sq_t, rmask,
                        q64, D)
        k_base = k + b.to(tl.int64) * sk_b + (h // rep).to(tl.int64) * sk_h
        v_base = v + b.to(tl.int64) * sv_b + (h // rep).to(tl.int64) * sv_h
        hi = tk
        if CAUSAL:
            hi = tl.minimum(tk, tk - tq + (mb + 1) * BM)
        m = tl.full([BM], float("-inf"), tl.float64)
        denom = tl.zeros([BM], tl.float64)
        acc = tl.zeros([BM, D], tl.float64)
        for start in range(0, hi, BN):
            keys = start + tl.arange(0, BN)
            kmask = keys < hi
            s = _scores_f64(q64, k_base, sk_t, keys, kmask, BM, D, BD, QK_STAGES)
            ok = kmask[None, :] & rmask[:, None]
            if CAUSAL:
                ok = ok & (keys[None, :] <= (tk - tq + rows)[:, None])
            if HAS_KEEP:
                kp = keep + b.to(tl.int64) * skeep_b + h.to(tl.int64) * skeep_h \
                    + rows[:, None].to(tl.int64) * skeep_q + keys[None, :].to(tl.int64) * skeep_k
                ok = ok & (tl.load(kp, mask=ok, other=0) != 0)
            s = tl.where(ok, s * scale, float("-inf"))
            p, alpha, m, denom = _softmax_step_f64(s, m, denom)
            acc = _add_pv_f64(acc * alpha[:, None], p, q64 + BM * D, v_base, sv_t, start,
                              tl.minimum(BN, hi - start), D, PV_UNROLL, PV_MASKED)
        # no valid key (padding query): acc = 0 -> 0, as the reference
        o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        o_ptr = out + b.to(tl.int64) * so_b + rows[:, None].to(tl.int64) * so_t + h.to(tl.int64) * so_h \
            + tl.arange(0, D)[None, :]
        tl.store(o_ptr, round_to(o, out.dtype.element_ty), mask=rmask[:, None])
        tl.debug_barrier()  # the next tile rewrites the scratch rows
