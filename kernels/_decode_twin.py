"""CPU twin of ``decode_gemm.cu``: the same gathers, bit operations and fragment indexing, in PyTorch, so
tests without a GPU can check what each lane hands to each mma.

``weight_operand`` / ``token_operand`` rebuild, from the per-lane fragments exactly as the kernel forms them
(PTX ISA layout of mma.m16n8k16 .f16 operands), the [rows, 128] fp16 tile of one K step in the order the
mma consumes it (eight k16 pieces: the evens, then the odds). Tests compare that bitwise with
``weights.decode_f16`` (the order the Triton kernels feed), and ``gemm`` (float64 over those fragments)
with the reference. The bit helpers take int64 tensors holding unsigned 32-bit values.
"""
from __future__ import annotations

import torch

ROW_STEP_BYTES = 64  # codes of one row per 128-wide K step


def low_nibbles(x: torch.Tensor) -> torch.Tensor:
    """fp16 high bytes (sign << 7 | mag << 1) of the four even-K (low-nibble) elements of a word."""
    return ((x << 4) & 0x80808080) | ((x << 1) & 0x0E0E0E0E)


def high_nibbles(x: torch.Tensor) -> torch.Tensor:
    return (x & 0x80808080) | ((x >> 3) & 0x0E0E0E0E)


PAIR_BITS = 0x8E008E00  # sign << 15 | mag << 9 in both 16-bit halves: an fp16x2 of e2m1 * 2^-14 values


def frag_pairs(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four fp16x2 pairs (evens {B0, B1}, evens {B2, B3}, odds {B0, B1}, odds {B2, B3}: what ``pair01`` /
    ``pair23`` of ``low_nibbles`` / ``high_nibbles`` give for the row-major word) of a fragment-order word
    (``weights.fragment_order``), as the FRAG kernel forms them: a mask; a shift and a mask; and for each odd
    pair its bits masked, times 2^9 + 2^1 (2^6 + 2^2), masked (the two shifted copies share no bit)."""
    return (y & PAIR_BITS, (y << 3) & PAIR_BITS, ((y & 0x40074007) * 0x202) & PAIR_BITS,
            ((y & 0x20382038) * 0x44) & PAIR_BITS)


def byte_perm(x: torch.Tensor, y, sel: int) -> torch.Tensor:
    """__byte_perm(x, y, sel): byte i of the result is byte (sel >> 4i) & 7 of {y, x} (x = bytes 0-3)."""
    y = torch.as_tensor(y, dtype=torch.int64)
    out = torch.zeros_like(x)
    for i in range(4):
        src = (sel >> (4 * i)) & 7
        byte = ((x if src < 4 else y) >> (8 * (src & 3))) & 0xFF
        out = out | (byte << (8 * i))
    return out


def pair01(h: torch.Tensor) -> torch.Tensor:
    return byte_perm(h, 0, 0x1404)


def pair23(h: torch.Tensor) -> torch.Tensor:
    return byte_perm(h, 0, 0x3424)


def join16(lo16: torch.Tensor, hi16: torch.Tensor) -> torch.Tensor:
    return byte_perm(lo16, hi16, 0x5410)


def _halves(bits: torch.Tensor) -> torch.Tensor:
    """uint32 fp16x2 bits -> fp16 [..., 2] (low half first, as in the register)."""
    lo = (bits & 0xFFFF).to(torch.int32).to(torch.int16)
    hi = ((bits >> 16) & 0xFFFF).to(torch.int32).to(torch.int16)
    return torch.stack([lo, hi], -1).view(torch.float16)


def scale_pairs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Four E4M3 bytes -> fp16 {s0, s1}, {s2, s3} (the 16-bit halves of the word, as the kernel converts them):
    bits (e & 0x7F) << 7 (= s * 2^-8), times 256 in fp16."""
    k256 = torch.tensor(256.0, dtype=torch.float16)

    def pair(b0, b1):
        return _halves(((b0 & 0x7F) << 7) | ((b1 & 0x7F) << 23)) * k256
    return pair(w, w >> 8), pair(w >> 16, w >> 24)


def scaled(pair_bits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """__hmul2(pair, {s, s}): fp16 [..., 2] (exact products)."""
    return _halves(pair_bits) * s[..., None]


def _u16(buf: torch.Tensor, off) -> torch.Tensor:
    """Little-endian u16 at byte offsets ``off`` of a uint8 buffer (last dim)."""
    b = buf.to(torch.int64)
    return b[..., off] | (b[..., off + 1] << 8)


def _u32(buf: torch.Tensor, off) -> torch.Tensor:
    return _u16(buf, off) | (_u16(buf, off + 2) << 16)


def weight_fragments(codes: torch.Tensor, scales: torch.Tensor, row0: int, step: int,
                     frag: bool = False) -> torch.Tensor:
    """fp16 [8 pieces, 32 lanes, 4 regs, 2] of one warp (rows row0..row0+15) for K step ``step``, as ``gather``
    and the step body form them: the ring slot holds each row's 64 code bytes and 8 scale bytes; lane (g, t)
    joins the u16s at 16 pc + 2t and 16 pc + 8 + 2t of rows g and g + 8 into one word per piece, and reads
    the rows' scale bytes as two words. ``frag``: ``codes`` in fragment order (``weights.fragment_order``),
    the slot being the step's 1 KB, from which ``gather_frag`` reads word (pc, r) at 512 (pc >> 1) + 16 lane
    + 4 (2 (pc & 1) + r), decoded by ``frag_pairs``."""
    kh = codes.shape[-1]
    if frag:
        chunk = codes.reshape(-1)[row0 * kh + step * 16 * ROW_STEP_BYTES:][:16 * ROW_STEP_BYTES]
    else:
        slot = codes[row0:row0 + 16, step * ROW_STEP_BYTES:(step + 1) * ROW_STEP_BYTES]
    sc = scales.view(torch.uint8)[row0:row0 + 16, step * 8:(step + 1) * 8]
    out = torch.empty(8, 32, 4, 2, dtype=torch.float16)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r in range(2):
            pairs = [p for wsel in range(2) for p in scale_pairs(_u32(sc[g + 8 * r], 4 * wsel))]
            for pc in range(4):
                if frag:
                    x = _u32(chunk, 512 * (pc >> 1) + 16 * lane + 4 * (2 * (pc & 1) + r))
                else:
                    row = slot[g + 8 * r]
                    x = join16(_u16(row, 16 * pc + 2 * t), _u16(row, 16 * pc + 8 + 2 * t))
                s_a, s_b = pairs[pc][0], pairs[pc][1]  # blocks 2 pc, 2 pc + 1
                if frag:
                    e01, e23, o01, o23 = frag_pairs(x)
                else:
                    lo, hi = low_nibbles(x), high_nibbles(x)
                    e01, e23, o01, o23 = pair01(lo), pair23(lo), pair01(hi), pair23(hi)
                out[pc, lane, r], out[pc, lane, 2 + r] = scaled(e01, s_a), scaled(e23, s_b)
                out[4 + pc, lane, r], out[4 + pc, lane, 2 + r] = scaled(o01, s_a), scaled(o23, s_b)
    return out


def b_index(sl: int, j: int, piece: int, lane: int, r: int, nt: int) -> int:
    return ((((sl * nt + j) * 4 + (piece >> 1)) * 32 + lane) << 2) + ((piece & 1) << 1) + r


def token_fragments(codes: torch.Tensor, scales: torch.Tensor, m0: int, m_end: int, step: int,
                    nt: int) -> torch.Tensor:
    """fp16 [8 pieces, nt tiles, 32 lanes, 2 regs, 2] read back by the warps, after ``store_tokens`` wrote them
    (units of one row, one piece: 16 code bytes + 2 scale bytes) into the segment buffer (one step here)."""
    buf = torch.zeros(nt * 4 * 32 * 4, 2, dtype=torch.float16)  # u32 words as fp16 pairs
    for m in range(8 * nt):
        row = m0 + m
        for piece in range(4):
            if row < m_end:
                chunk = codes[row, step * ROW_STEP_BYTES + 16 * piece:step * ROW_STEP_BYTES + 16 * piece + 16]
                sc = _u16(scales.view(torch.uint8)[row], step * 8 + 2 * piece)
            else:
                chunk, sc = torch.zeros(16, dtype=torch.uint8), torch.tensor(0)
            pair, _ = scale_pairs(sc)
            s_a, s_b = pair[0], pair[1]  # blocks 2 piece, 2 piece + 1
            j, g = m >> 3, m & 7
            for t in range(4):
                x = join16(_u16(chunk, 2 * t), _u16(chunk, 8 + 2 * t))
                lane = g * 4 + t
                for p, fn in ((piece, low_nibbles), (4 + piece, high_nibbles)):
                    h = fn(x)
                    buf[b_index(0, j, p, lane, 0, nt)] = scaled(pair01(h), s_a)
                    buf[b_index(0, j, p, lane, 1, nt)] = scaled(pair23(h), s_b)
    out = torch.empty(8, nt, 32, 2, 2, dtype=torch.float16)
    for piece in range(8):
        for j in range(nt):
            for lane in range(32):
                quad = b_index(0, j, piece & ~1, lane, 0, nt)  # the 16-byte load of the piece pair
                words = buf[quad:quad + 4]
                out[piece, j, lane] = words[:2] if piece % 2 == 0 else words[2:]
    return out


def weight_operand(frags: torch.Tensor) -> torch.Tensor:
    """[8, 32, 4, 2] A fragments -> fp16 [16 rows, 128]: reg k, half h of lane (g, t) is row g + 8 (k & 1),
    position 2t + h + 8 (k >> 1) of its piece (PTX ISA, mma.m16n8k16, A .f16 row-major)."""
    out = torch.empty(16, 128, dtype=torch.float16)
    for piece in range(8):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for k in range(4):
                for h in range(2):
                    out[g + 8 * (k & 1), 16 * piece + 2 * t + h + 8 * (k >> 1)] = frags[piece, lane, k, h]
    return out


def token_operand(frags: torch.Tensor) -> torch.Tensor:
    """[8, nt, 32, 2, 2] B fragments -> fp16 [8 nt tokens, 128]: reg r, half h of lane (g, t) in tile j is token
    8j + g, position 2t + h + 8r (PTX ISA, mma.m16n8k16, B .f16 column-major)."""
    nt = frags.shape[1]
    out = torch.empty(8 * nt, 128, dtype=torch.float16)
    for piece in range(8):
        for j in range(nt):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for r in range(2):
                    for h in range(2):
                        out[8 * j + g, 16 * piece + 2 * t + h + 8 * r] = frags[piece, j, lane, r, h]
    return out


def gemm(a, w, nt: int = 2) -> torch.Tensor:
    """a @ w.T in float64 from the kernel's fragments (tiles of 16 weight rows x 8 nt tokens), both global
    scales and the 2^28 applied after: the kernel's result up to fp32 rounding (for reference tests)."""
    m, k = a.shape
    n = w.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float64)
    for row0 in range(0, n, 16):
        for m0 in range(0, m, 8 * nt):
            m_end = min(m, m0 + 8 * nt)
            for step in range(k // 128):
                wa = weight_operand(weight_fragments(w.codes, w.scales, row0, step)).double()
                tb = token_operand(token_fragments(a.codes, a.scales, m0, m_end, step, nt)).double()
                acc[m0:m_end, row0:row0 + 16] += (tb @ wa.T)[:m_end - m0]
    ga = a.global_scale.double().reshape(-1, 1) if a.global_scale.dim() else a.global_scale.double()
    gw = w.global_scale.double().reshape(1, -1) if w.global_scale.dim() else w.global_scale.double()
    return acc * 2.0 ** 28 * ga * gw


def grouped_tiles(offsets: list[int], nt: int) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every token tile, as each CTA lists them (``scan_tiles`` + ``expert_of``
    in the kernel): experts cut into tiles of 8 nt rows, in expert order."""
    e_count = len(offsets) - 1
    rows = 8 * nt
    start = [0]
    for e in range(e_count):
        n = offsets[e + 1] - offsets[e]
        start.append(start[-1] + (-(-n // rows) if n > 0 else 0))
    tiles = []
    for t in range(start[-1]):
        lo, hi = 0, e_count
        while lo < hi:
            mid = (lo + hi) >> 1
            if start[mid + 1] <= t:
                lo = mid + 1
            else:
                hi = mid
        m0 = offsets[lo] + (t - start[lo]) * rows
        tiles.append((lo, m0, min(offsets[lo + 1], m0 + rows)))
    return tiles


def my_steps(nsteps: int, lanes: int, chunk_steps: int, c: int) -> list[int]:
    """The K steps warp lane c of a row group runs, in order: chunks c, c + lanes, ... of ``chunk_steps``
    steps (the last chunk of K may be short); without chunks (chunk_steps 0) all of K."""
    if not chunk_steps:
        return list(range(nsteps))
    out = []
    for q in range(c, -(-nsteps // chunk_steps), lanes):
        out += list(range(q * chunk_steps, min((q + 1) * chunk_steps, nsteps)))
    return out


class _Lane:
    """One warp lane c of a row group in the kernel's main loop (its names: ji, si, ri, the ring, the pipeline
    registers a0/a1 and w0/w1, seg_s0 / seg_buf and the segment switches), over ``nrg`` row groups in sequence.
    Steps are (row group, K step) pairs."""

    def __init__(self, nsteps, lanes, chunk_steps, seg, depth, c, nrg=1):
        self.nsteps, self.lanes, self.seg, self.depth, self.c, self.nrg = nsteps, lanes, seg, depth, c, nrg
        self.chunked = chunk_steps > 0
        assert nrg == 1 or (not self.chunked and seg >= nsteps), "row groups in sequence: one chain, all of K"
        self.lcs = (chunk_steps.bit_length() - 1) if self.chunked else 20
        self.cs = 1 << self.lcs
        self.steps = [(i, s) for i in range(nrg) for s in my_steps(nsteps, lanes, chunk_steps, c)]
        self.ring = [None] * depth  # slot -> (my step index, (row group, K step)) of the last copy into it
        self.ji, self.si, self.ri, self.landed = 0, c << self.lcs, 0, -1
        self.seg_s0 = self.seg_buf = self.switches = 0
        self.consumed, self.part, self.chunk_sums, self.sums_per_group = [], [], [], []
        self.regs = {}

    def issue_next(self):
        if self.ji < len(self.steps):
            assert (self.ri, self.si) == self.steps[self.ji], (self.ji, self.ri, self.si, self.steps)
            self.ring[self.ji & (self.depth - 1)] = (self.ji, (self.ri, self.si))
        self.ji += 1
        if self.si + 1 == self.nsteps and self.ri + 1 < self.nrg:
            self.si, self.ri = 0, self.ri + 1
        else:
            self.si += (self.lanes - 1) * self.cs + 1 if ((self.si + 1) & (self.cs - 1)) == 0 else 1

    def wait(self):  # cp.async.wait_group D - 3: all but the newest D - 3 groups landed
        self.landed = self.ji - 1 - (self.depth - 3)

    def gather(self, j):
        if j >= len(self.steps):
            return None  # stale words: decoded, never fed to a chain step
        assert j <= self.landed and self.ring[j & (self.depth - 1)] == (j, self.steps[j]), (j, self.ring)
        return self.steps[j]

    def switch_segment(self):
        self.seg_s0, self.seg_buf, self.switches = self.seg_s0 + self.seg, self.seg_buf ^ 1, self.switches + 1

    def step(self, a, a_next, w, w_next, s, j, i):
        self.issue_next()
        assert self.ji == j + self.depth  # the refill: my step j + D - 1, into the slot of step j - 1
        self.wait()
        self.regs[w_next] = self.gather(j + 2)
        off = s - self.seg_s0
        assert 0 <= off < self.seg and self.seg_buf == self.switches & 1  # buffer seg_buf: segment `switches`
        self.consumed.append(((i, s), self.regs[a], (i, self.switches * self.seg + off)))
        self.part.append(s)
        self.regs[a_next] = self.regs[w]

    def run(self):
        for _ in range(self.depth - 1):
            self.issue_next()
        self.wait()
        self.regs = {"a0": self.gather(0), "w0": self.gather(1)}
        nchunks = -(-self.nsteps // self.cs)
        j = 0
        for i in range(self.nrg):
            self.part, run = [], 0
            while True:
                if self.chunked:
                    if self.c + run * self.lanes >= nchunks:
                        break
                    s0 = (self.c + run * self.lanes) << self.lcs
                    s1 = min(s0 + self.cs, self.nsteps)
                    while s0 >= self.seg_s0 + self.seg:
                        self.switch_segment()
                    self.part = []
                else:
                    s0 = self.seg_s0
                    if s0 >= self.nsteps:
                        break
                    s1 = min(s0 + self.seg, self.nsteps)
                s = s0
                while s + 1 < s1:
                    self.step("a0", "a1", "w0", "w1", s, j, i)
                    self.step("a1", "a0", "w1", "w0", s + 1, j + 1, i)
                    s, j = s + 2, j + 2
                if s < s1:
                    self.step("a0", "a1", "w0", "w1", s, j, i)
                    j += 1
                    self.regs["a0"], self.regs["w0"] = self.regs["a1"], self.regs["w1"]
                if self.chunked:
                    self.chunk_sums.append((s0 >> self.lcs, list(self.part)))
                else:
                    if s1 >= self.nsteps:
                        break
                    self.switch_segment()
                run += 1
            while self.seg_s0 + self.seg < self.nsteps:
                self.switch_segment()
            self.sums_per_group.append(list(self.part))
        return self


def simulate_row_group(nsteps: int, lanes: int, chunk_steps: int, seg: int, depth: int, nrg: int = 1) -> dict:
    """The kernel's main loop for the ``lanes`` warps of one row group (or, with ``nrg`` > 1, one warp's row
    groups in sequence), with the same cursor arithmetic (``issue_next``, the runs, ``switch_segment``, the
    register pipeline and its odd-run copy). Returns, per lane, ((row group, K step), the step whose weight
    words made the fragments, (row group, step) whose token fragments were read) for each step of its mma
    chain, its segment switches (barriers) and the K steps summed into each row group's result; and the chunk
    sums (lists of K steps) in the order the fold adds them. Asserts what the ring relies on as it goes: a
    gathered slot holds the step it should, copied by a group the last cp.async wait covered; a token read
    falls in the segment the current buffer holds."""
    sims = [_Lane(nsteps, lanes, chunk_steps, seg, depth, c, nrg).run() for c in range(lanes)]
    sums = {}
    for sim in sims:
        for q, steps in sim.chunk_sums:
            assert q not in sums
            sums[q] = steps
    fold = [sums[q] for q in sorted(sums)] if chunk_steps else [sims[0].part]
    return dict(lanes=[dict(consumed=x.consumed, switches=x.switches, groups=x.sums_per_group) for x in sims],
                fold=fold)
