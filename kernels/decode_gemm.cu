// NVFP4 W4A4 GEMM for few token rows (decode): out[m, n] = sum_k a[m, k] * w[n, k], both operands NVFP4.
//
// Same arithmetic as the Triton kernels (kernels/_triton_gemm.py), so rows are bit-equal to theirs:
//   * every element decoded exactly to fp16: e2m1 * 2^-14 (bits (sign << 15) | (mag << 9)) times its E4M3
//     block scale (bits (e4m3 & 0x7F) << 7 = s * 2^-8, times 256): exact products, no rounding;
//   * K in 128-wide steps; each step = its 64 even-K elements (low nibbles) as four k16 pieces, then its 64
//     odd-K ones (high nibbles): eight fp16 -> fp32 mma.m16n8k16 chained on one accumulator;
//   * position i of piece p is element 16p + i of the step's evens (odds): the layout Triton's dot feeds;
//   * K order, one of two contracts (the same in every path, chosen by one switch, ``gemm.k_chunk``):
//     - one chain: the accumulator runs from K = 0 to K, step after step (chunk_log2 < 0);
//     - fixed K chunks of 2^chunk_log2 steps: each chunk accumulated from zero, the chunk sums then added
//       one after another in chunk order, from 0.0f, in fp32 (the Triton kernels' ``acc = acc + part``);
//   * epilogue ((acc * 2^28) * ga) * gw (+ bias, fused into the last multiply, as Triton does), then the cast.
// Work split: a CTA holds R = W / C row groups of 16 weight rows (the mma's M side; tokens are its N side, 8 per
// n8 tile, NT tiles per CTA), or R x RG when each warp runs RG row groups one after another (rows 16 (x0 + i R),
// i < RG; with fragment-order codes its RG consecutive row groups, rows 16 (x0 + i), whose codes are then one
// contiguous stream: the ring's producer advances by one fixed step): its ring and register pipeline run on
// from one row group's last K step into the next one's first, and the token fragments stay in shared memory,
// so a tile's fixed costs (ring fill, token decode, barriers) are paid once per RG row groups (short K, few
// tokens per expert). Without chunks C = 1: one warp per row group runs the whole chain. With chunks
// the C warps of a row group take chunks c, c + C, c + 2C, ... (more warps per row: all SMs busy at M = 1)
// and leave each chunk sum in shared memory; after one barrier the group's first warp adds them in chunk
// order (C = 1: the warp adds them as it goes, same order). Deterministic, and no chunk depends on M.
// Data flow per warp:
//   * the weight's packed bytes, in their original [N, K/2] layout, reach shared memory through cp.async
//     (each lane copies 16 B of one row per step: coalesced, no registers held in flight) into a D-slot ring
//     private to the warp; each lane gathers the 2-byte pairs its mma fragment needs (row pitch padded: no
//     bank conflicts), decodes them in registers (byte_perm + 2 shifts + 1 lop3 per fp16 pair, one hmul2 by
//     the scale) and issues mma;
//   * software pipeline: step j's eight mma run on fragments decoded during step j - 1, while the warp decodes
//     step j + 1 (independent of the accumulator chain) and the ring streams step j + D - 1;
//   * the token fragments are decoded once per CTA per segment of steps into shared memory (all of K when it
//     fits: then no barrier in the main loop) and read back with conflict-free 16-byte loads;
//   * the epilogue's scales and bias are loaded before the main loop (off the tail's critical path).
// Weight codes in fragment order (FRAG, ``weights.fragment_order``): stored per 16-row group and K step as the
// 1 KB a warp's step reads, lane l's 32 bytes being the eight words it gathers (at 16 l and 512 + 16 l,
// conflict-free 16-byte loads): one contiguous read per step and two shared loads per lane instead of 16
// two-byte ones and 8 byte_perms. Each word's eight elements are stored where its four fp16x2 pairs take
// the fewest ALU-pipe operations to leave (``frag_evens01`` ..). The fragments, hence the bits, are those of
// the row-major codes.
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_common.cuh"

namespace minite_decode {

using minite_cuda::cp_async_commit;
using minite_cuda::cp_async_wait;

constexpr int kStepBytes = 64;               // codes of one row per 128-wide K step
constexpr int kRowPitch = 80;                // shared-memory pitch of one row's step (64 + 16: conflict-free)
constexpr int kTileStepWords = 8 * 32 * 2;   // u32 words of one n8 token tile's fragments per K step (2 KB)
constexpr int kFragHalf = 16 * 32;           // fragment order: the lanes' first 16 bytes, then their second

// One warp's ring slot (one K step): 16 rows of codes, then their 16 x 8 scale bytes. Row-major codes sit at a
// padded pitch (conflict-free two-byte gathers); a fragment-order step is its 1 KB as stored (16-byte loads,
// conflict-free without padding): 1152 bytes instead of 1408, so a grouped gate_up CTA (K = 2048, 4 warps,
// 8 steps) fits three times in an SM's shared memory.
template <bool FRAG>
struct Slot {
  static constexpr int kScales = FRAG ? 2 * kFragHalf : 16 * kRowPitch;  // offset of the scale bytes
  static constexpr int kBytes = kScales + 16 * 8;
};

struct Params {
  const uint8_t* a_codes;   // [M, K/2]
  const uint8_t* a_scales;  // [M, K/16] e4m3 bytes
  const float* ga;          // [M] or [1]
  const uint8_t* w_codes;   // [(E,) N, K/2]
  const uint8_t* w_scales;  // [(E,) N, K/16]
  const float* gw;          // [(E,) N] or [(E,)] / [1]
  const float* bias;        // [N] fp32 or null
  void* out;                // [M, N] bf16 / fp16 / fp32
  int M, N, K;
  int ga_row, gw_row, out_kind;  // out_kind: 0 bf16, 1 fp16, 2 fp32
  int seg;                       // K steps per token-fragment segment (K / 128: all of K at once)
  int chunk_log2;                // log2 of the K chunk in 128-wide steps; -1: one chain over all of K
  int lanes;                     // C: warps per row group (chunk lanes); 1 without chunks
  int row_groups;                // RG: row groups a warp runs one after another per token tile (one chain and
                                 // all of K's token fragments in shared memory; else 1)
  // grouped: expert e owns rows offsets[e] .. offsets[e + 1] (int32 or int64), cut into tiles of 8 NT rows;
  // every CTA lists the tiles itself (a scan of the offsets): one launch, no host sync, no schedule kernels
  const void* offsets;
  int offsets64, E;
  int64_t w_estride_c, w_estride_s, gw_estride;
  int frag;  // weight codes in fragment order (``weights.fragment_order``); ring depths 4 and 8 only
  // grouped: row m of the sorted problem is token row a_rows[m] of a (int32 or int64), or m itself (null):
  // the rows routed to experts read in place, without a gathered copy of a
  const void* a_rows;
  int a_rows64;
  // grouped row-group streams (STREAM below): the CTAs share the (tile, row group) pairs out evenly, whatever
  // the number of tiles the routing makes (see ``cta_range``); else, and while the tiles fit the grid's y, the
  // grid's x picks a row block, its y the tiles
  int balanced;
  int pdl;  // programmatic dependent launch: 0 off; 1 wait, next kernel may start at once; 2 wait, it may start
            // as each CTA ends (``_cuda_decode.PDL_MODE``)
};

// (only grouped launches take a_rows: the dense builds index their rows directly, with no branch in their
// token loads, whose loads then issue back to back)
template <bool GROUPED>
__device__ __forceinline__ int64_t a_row(const Params& p, int m) {
  if (!GROUPED || p.a_rows == nullptr) return m;
  return p.a_rows64 ? static_cast<const int64_t*>(p.a_rows)[m] : static_cast<const int*>(p.a_rows)[m];
}

// token units (row, step, piece: 16 code bytes + 2 scale bytes) a thread holds in registers while the next
// segment's fragments are fetched; the launcher sizes segments so that a segment's units fit
template <int NT>
struct TokenBudget {
  static constexpr int kUnitsPerThread = NT >= 4 ? 2 : 4;
};

// Decoding, four code bytes at a time. A word x holds bytes B0..B3; each byte is an even-K element (low
// nibble) and the next odd-K element (high nibble), sign in the nibble's top bit. An fp16 e2m1 * 2^-14 has
// bits (sign << 15) | (mag << 9): a zero low byte and a high byte (sign << 7) | (mag << 1).
__device__ __forceinline__ uint32_t low_nibbles(uint32_t x) {   // high bytes of the four even-K elements
  return ((x << 4) & 0x80808080u) | ((x << 1) & 0x0E0E0E0Eu);
}
__device__ __forceinline__ uint32_t high_nibbles(uint32_t x) {  // high bytes of the four odd-K elements
  return (x & 0x80808080u) | ((x >> 3) & 0x0E0E0E0Eu);
}
// fp16x2 {B0, B1} / {B2, B3} of such high bytes
__device__ __forceinline__ uint32_t pair01(uint32_t h) { return __byte_perm(h, 0u, 0x1404); }
__device__ __forceinline__ uint32_t pair23(uint32_t h) { return __byte_perm(h, 0u, 0x3424); }
// A fragment-order word (``weights.fragment_order``) holds the same eight elements with each fp16x2 pair's bits
// where a mask, a shift and a mask, or a mask, a multiply and a mask leave them: per 16-bit half (half 0 the
// pair's first element, half 1 its second), mag << 9 | sign << 15 of the evens {B0, B1} (in place), mag << 6 |
// sign << 12 of the evens {B2, B3} (a shift by 3), mag | sign << 14 of the odds {B0, B1} and mag << 3 |
// sign << 13 of the odds {B2, B3}. An odd pair's own bits, masked, times 2^a + 2^b, are its magnitudes shifted
// by a plus its signs shifted by b: the two copies share no bit (no carry), so the sum is their OR. 6 LOP3 and 3
// IMAD for the four pairs (in SASS), where bytes in fp16 high-byte form took 8 LOP3 / SHF / PRMT and 1 IMAD:
// the integer (ALU) pipe, the loop's busiest, does 16 fewer operations per K step and the FMA pipe 16 more.
constexpr uint32_t kPairBits = 0x8E008E00u;  // sign << 15 | mag << 9 in both halves
__device__ __forceinline__ uint32_t frag_evens01(uint32_t y) { return y & kPairBits; }
__device__ __forceinline__ uint32_t frag_evens23(uint32_t y) { return (y << 3) & kPairBits; }
__device__ __forceinline__ uint32_t frag_odds01(uint32_t y) { return ((y & 0x40074007u) * 0x202u) & kPairBits; }
__device__ __forceinline__ uint32_t frag_odds23(uint32_t y) { return ((y & 0x20382038u) * 0x44u) & kPairBits; }
// the word a lane decodes: the code bytes of positions 2t, 2t+1 (lo16) and 2t+8, 2t+9 (hi16) of a piece
__device__ __forceinline__ uint32_t join16(uint32_t lo16, uint32_t hi16) { return __byte_perm(lo16, hi16, 0x5410); }

// four E4M3 scale bytes -> fp16x2 {s0, s1} and {s2, s3}, exact (sm_89+ converts an e4m3 pair in one
// instruction, which reads either 16-bit half of its register: no byte moves; a NaN scale byte stays NaN, where
// the Triton path's bit trick (e << 7) * 256 gives 480 for 0x7F)
__device__ __forceinline__ void scale_pairs(uint32_t w, __half2& lo, __half2& hi) {
  uint32_t l, h;
  asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(l), "=r"(h) : "r"(w));
  lo = *reinterpret_cast<__half2*>(&l);
  hi = *reinterpret_cast<__half2*>(&h);
}

__device__ __forceinline__ uint32_t scaled(uint32_t pair_bits, __half s) {  // exact: fp16 product of exact values
  __half2 v = __hmul2(*reinterpret_cast<__half2*>(&pair_bits), __half2half2(s));
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// What a lane gathers from its warp's ring for one step: for each piece, the word join16(positions 2t..,
// 2t+8..) of rows g and g + 8, and the 8 scale bytes of rows g and g + 8.
struct StepWords {
  uint32_t x[4][2];
  uint2 sc[2];
};

__device__ __forceinline__ void gather(const uint8_t* slot, int g, int t, StepWords& d) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* row = slot + (g + 8 * r) * kRowPitch + 2 * t;
#pragma unroll
    for (int pc = 0; pc < 4; ++pc)
      d.x[pc][r] = join16(*reinterpret_cast<const uint16_t*>(row + 16 * pc),
                          *reinterpret_cast<const uint16_t*>(row + 16 * pc + 8));
    d.sc[r] = *reinterpret_cast<const uint2*>(slot + Slot<false>::kScales + (g + 8 * r) * 8);
  }
}

// The same words from a fragment-order slot: x[0][0], x[0][1], x[1][0], x[1][1] | x[2][0] .. x[3][1]
__device__ __forceinline__ void gather_frag(const uint8_t* slot, int g, int lane, StepWords& d) {
  const uint4 lo = *reinterpret_cast<const uint4*>(slot + 16 * lane);
  const uint4 hi = *reinterpret_cast<const uint4*>(slot + kFragHalf + 16 * lane);
  d.x[0][0] = lo.x, d.x[0][1] = lo.y, d.x[1][0] = lo.z, d.x[1][1] = lo.w;
  d.x[2][0] = hi.x, d.x[2][1] = hi.y, d.x[3][0] = hi.z, d.x[3][1] = hi.w;
#pragma unroll
  for (int r = 0; r < 2; ++r) d.sc[r] = *reinterpret_cast<const uint2*>(slot + Slot<true>::kScales + (g + 8 * r) * 8);
}

template <bool FRAG>
__device__ __forceinline__ void gather_step(const uint8_t* slot, int g, int t, int lane, StepWords& d) {
  if (FRAG) gather_frag(slot, g, lane, d);
  else gather(slot, g, t, d);
}

// A fragments of one step: [piece 0..3 evens, 4..7 odds][mma register]
template <bool FRAG>
__device__ __forceinline__ void decode_step(const StepWords& w, uint32_t (&a)[8][4]) {
  __half2 sc[2][4];  // [row g | g + 8][blocks {0, 1}, {2, 3}, {4, 5}, {6, 7}]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    scale_pairs(w.sc[r].x, sc[r][0], sc[r][1]);
    scale_pairs(w.sc[r].y, sc[r][2], sc[r][3]);
  }
#pragma unroll
  for (int pc = 0; pc < 4; ++pc) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // scales of blocks 2pc (positions 2t..) and 2pc + 1 (positions 2t+8..): one pair
      const __half s_a = __low2half(sc[r][pc]), s_b = __high2half(sc[r][pc]);
      const uint32_t x = w.x[pc][r];
      if (FRAG) {
        a[pc][r] = scaled(frag_evens01(x), s_a);   // row g + 8 r, positions 2t, 2t+1
        a[pc][2 + r] = scaled(frag_evens23(x), s_b);  // row g + 8 r, positions 2t+8, 2t+9
        a[4 + pc][r] = scaled(frag_odds01(x), s_a);
        a[4 + pc][2 + r] = scaled(frag_odds23(x), s_b);
      } else {
        const uint32_t lo = low_nibbles(x), hi = high_nibbles(x);
        a[pc][r] = scaled(pair01(lo), s_a);
        a[pc][2 + r] = scaled(pair23(lo), s_b);
        a[4 + pc][r] = scaled(pair01(hi), s_a);
        a[4 + pc][2 + r] = scaled(pair23(hi), s_b);
      }
    }
  }
}

// Token fragments of one segment in shared memory, as u32 words:
//   [step in segment][n8 tile j][piece pair q = P / 2][lane][4]  with word (P % 2) * 2 + r,
// P = piece (0..3 evens, 4..7 odds), r = fragment register (0: positions 2t, 2t+1; 1: positions 2t+8, 2t+9).
template <int NT>
__device__ __forceinline__ int b_index(int sl, int j, int piece, int lane, int r) {
  return ((((sl * NT + j) * 4 + (piece >> 1)) * 32 + lane) << 2) + ((piece & 1) << 1) + r;
}

// One unit of token decoding: token row m (of the tile), step sl (of the segment), piece p: 16 code bytes and
// the two scale bytes of blocks 2p, 2p+1 -> the evens piece p and odds piece p fragments of the 4 lanes t.
struct TokenUnit {
  uint4 codes;
  uint32_t sc;
};

template <int NT, bool GROUPED>
__device__ __forceinline__ void load_tokens(TokenUnit& u, const Params& p, int unit, int m0, int m_end,
                                            int s_begin, int s_end) {
  const int piece = unit & 3;
  const int m = (unit >> 2) % (8 * NT);
  const int sl = (unit >> 2) / (8 * NT);
  const int row = m0 + m, s = s_begin + sl;
  if (row < m_end && s < s_end) {
    const size_t kh = p.K >> 1, ks = p.K >> 4;
    const int64_t ar = a_row<GROUPED>(p, row);
    u.codes = *reinterpret_cast<const uint4*>(p.a_codes + ar * kh + s * kStepBytes + 16 * piece);
    u.sc = *reinterpret_cast<const uint16_t*>(p.a_scales + ar * ks + s * 8 + 2 * piece);
  } else {
    u.codes = make_uint4(0, 0, 0, 0);
    u.sc = 0;
  }
}

template <int NT>
__device__ __forceinline__ void store_tokens(const TokenUnit& u, uint32_t* buf, int unit) {
  const int piece = unit & 3;
  const int m = (unit >> 2) % (8 * NT);
  const int sl = (unit >> 2) / (8 * NT);
  const int j = m >> 3, g = m & 7;
  __half2 pair, unused;
  scale_pairs(u.sc, pair, unused);  // u.sc: blocks 2p (byte 0), 2p+1 (byte 1)
  const __half s_a = __low2half(pair), s_b = __high2half(pair);
  const uint32_t w[4] = {u.codes.x, u.codes.y, u.codes.z, u.codes.w};
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    // u16 t of the chunk: positions 2t, 2t+1 (block 2p); u16 4 + t: positions 2t+8, 2t+9 (block 2p+1)
    const uint32_t x = join16((w[t >> 1] >> ((t & 1) * 16)) & 0xFFFFu, (w[2 + (t >> 1)] >> ((t & 1) * 16)) & 0xFFFFu);
    const uint32_t lo = low_nibbles(x), hi = high_nibbles(x);
    const int lane = g * 4 + t;
    *reinterpret_cast<uint2*>(buf + b_index<NT>(sl, j, piece, lane, 0)) =
        make_uint2(scaled(pair01(lo), s_a), scaled(pair23(lo), s_b));
    *reinterpret_cast<uint2*>(buf + b_index<NT>(sl, j, 4 + piece, lane, 0)) =
        make_uint2(scaled(pair01(hi), s_a), scaled(pair23(hi), s_b));
  }
}

__device__ __forceinline__ int64_t offset_at(const Params& p, int e) {
  return p.offsets64 ? static_cast<const int64_t*>(p.offsets)[e] : static_cast<const int*>(p.offsets)[e];
}

template <int NT>
__device__ __forceinline__ int tiles_of(const Params& p, int e) {
  if (e >= p.E) return 0;
  const int64_t rows = offset_at(p, e + 1) - offset_at(p, e);
  return rows > 0 ? static_cast<int>((rows + 8 * NT - 1) / (8 * NT)) : 0;
}

// tile_start[e] = tiles of experts 0 .. e-1 (exclusive scan, one warp, 32 experts a round); tile_start[E] = all.
// The first kPre rounds' offsets are loaded up front, all in flight at once (one memory latency, not one each).
template <int NT>
__device__ void scan_tiles(const Params& p, int* tile_start, int lane) {
  constexpr int kPre = 8;
  int pre[kPre];
#pragma unroll
  for (int r = 0; r < kPre; ++r) pre[r] = tiles_of<NT>(p, 32 * r + lane);
  int carry = 0;
  auto round = [&](int e, int tiles) {
    int incl = tiles;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
      if (lane >= d) incl += v;
    }
    if (e < p.E) tile_start[e] = carry + incl - tiles;
    carry += __shfl_sync(0xFFFFFFFFu, incl, 31);
  };
#pragma unroll
  for (int r = 0; r < kPre; ++r)
    if (32 * r < p.E) round(32 * r + lane, pre[r]);
  for (int e0 = 32 * kPre; e0 < p.E; e0 += 32) round(e0 + lane, tiles_of<NT>(p, e0 + lane));
  if (lane == 0) tile_start[p.E] = carry;
}

// the expert owning tile t: the e with tile_start[e] <= t < tile_start[e + 1]
__device__ __forceinline__ int expert_of(const int* tile_start, int n_experts, int t) {
  int lo = 0, hi = n_experts;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (tile_start[mid + 1] <= t) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ T cast_out(float x);
template <>
__device__ __forceinline__ float cast_out<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half cast_out<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 cast_out<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__device__ __forceinline__ void store_out(const Params& p, int m, int n, float v) {
  reinterpret_cast<T*>(p.out)[static_cast<size_t>(m) * p.N + n] = cast_out<T>(v);
}

// ((acc * 2^28) * ga) * gw, or fma(acc * 2^28 * ga, gw, bias) with a bias: the Triton epilogue's operations
// in its order, as its compiler emits them (it contracts the last multiply and the bias add into one fma)
__device__ __forceinline__ float epilogue(float acc, float ga, float gw, bool has_bias, float bias) {
  float o = __fmul_rn(acc, 268435456.0f);
  o = __fmul_rn(o, ga);
  return has_bias ? __fmaf_rn(o, gw, bias) : __fmul_rn(o, gw);
}

// Shared memory of a CTA (the launcher computes the same sizes):
//   ring [W][D][Slot<FRAG>::kBytes] | tokens [nbuf][seg][NT][kTileStepWords] u32 | chunk sums [nchunks][R][32][4 NT]
//   f32 (C > 1 only) | grouped tile list [E + 1] int
struct Layout {
  int ring, tokens, sums, tiles;  // byte offsets
  int buf_words;                  // u32 words of one token buffer
};

template <int NT, int D, bool FRAG>
__host__ __device__ inline Layout layout(int warps, int nsteps, int seg, int nchunks, int lanes) {
  Layout l;
  l.ring = 0;
  l.tokens = warps * D * Slot<FRAG>::kBytes;
  l.buf_words = seg * NT * kTileStepWords;
  const int nbuf = seg < nsteps ? 2 : 1;
  l.sums = l.tokens + nbuf * l.buf_words * 4;
  l.tiles = l.sums + (lanes > 1 ? nchunks * (warps / lanes) * 32 * 4 * NT * 4 : 0);
  return l;
}

// Programmatic dependent launch: wait until the previous kernel in the stream has finished and its writes are
// visible; with ``trigger`` also let the next kernel's CTAs start as SMs free up (else the kernel does so as its
// CTAs end). Every CTA passes here once before it exits, so this kernel's end still implies the end of every
// kernel before it.
__device__ __forceinline__ void pdl_wait(bool& waited, bool trigger = true) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (trigger) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  waited = true;
}

// Balanced grouped launches, when the routing made more tiles than the grid has rows of CTAs (n_tiles >
// gridDim.y; else every CTA runs the plain grid's schedule): the pairs (tile t, row group r) in the order t G + r
// are shared out to the grid's P CTAs as ranges [u, u_end) of the same number of pairs, a multiple of R, which
// may span two tiles: each CTA costs a fraction of a row block more, not a second wave.
__device__ __forceinline__ void cta_range(int n_tiles, int G, int R, int& u, int& u_end) {
  const int P = gridDim.x * gridDim.y, c = blockIdx.y * gridDim.x + blockIdx.x;
  const int total = n_tiles * G, each = (total + P * R - 1) / (P * R) * R;
  u = min(total, c * each);
  u_end = min(total, u + each);
}

// grid: x = groups of R x RG row groups (16 weight rows each), y = token tiles (looped with stride gridDim.y);
// block: 32 W threads (W = R * C). ROWS: RG may be above 1. FRAG: weight codes in fragment order.
// The grouped decode default (one token tile, row groups in sequence, fragment-order codes) is held to 168
// registers (sm_90 ptxas, no spills) so that three 4-warp CTAs fit an SM: three warps per scheduler
template <int NT, bool GROUPED, bool ROWS, bool FRAG>
struct Occupancy {
  static constexpr bool kThree = NT == 1 && GROUPED && ROWS && FRAG;
  static constexpr int kThreads = kThree ? 128 : 256, kBlocks = kThree ? 3 : 1;
};

template <int NT, int D, bool GROUPED, bool ROWS, bool FRAG>
__global__ void __launch_bounds__(Occupancy<NT, GROUPED, ROWS, FRAG>::kThreads,
                                  Occupancy<NT, GROUPED, ROWS, FRAG>::kBlocks) decode_gemm_kernel(const Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kUnits = TokenBudget<NT>::kUnitsPerThread;
  const int W = blockDim.x >> 5;
  const int C = p.lanes, R = W / C;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rg = warp / C, c = warp - rg * C;
  const int nsteps = p.K >> 7;
  const size_t kh = p.K >> 1, ks = p.K >> 4;
  const bool chunked = p.chunk_log2 >= 0;
  // without chunks: one "chunk" of 2^20 steps (more than any K), one lane: the step arithmetic below is the same
  const int lcs = chunked ? p.chunk_log2 : 20;
  const int cs = 1 << lcs;
  const int nchunks = (nsteps + cs - 1) >> lcs;
  // my chunks: c, c + C, ...; my steps: theirs in order (only the last chunk of K may be short)
  const int my_chunks = c < nchunks ? (nchunks - 1 - c) / C + 1 : 0;
  const int my_last = c + (my_chunks - 1) * C;
  const int jump = (C - 1) << lcs;  // from the end of one of my chunks to the start of my next one
  // my row groups: x0 + i R for i < nrg (RG of them, fewer at the end of N), or x0 + i (STREAM; balanced: set
  // per piece of the CTA's range below); without chunks my steps are nrg runs of all of K, one per row group,
  // in that order (J counts them all) (ROWS false: RG = 1 at compile time, the plain kernel's registers)
  constexpr bool STREAM = ROWS && FRAG;  // row groups run one chain each (no chunks): see the header
  const int row_groups = ROWS ? p.row_groups : 1;
  int x0 = blockIdx.x * R * row_groups + (STREAM ? rg * row_groups : rg);
  const int left = (p.N >> 4) - x0;
  bool active = left > 0;
  int nrg = ROWS && active ? min(row_groups, STREAM ? left : (left + R - 1) / R) : 1;  // idle warps shadow the
                                                                                       // last row group, store nothing
  const int row_pitch = STREAM ? 16 : R * 16;  // rows from one of my row groups to the next
  const int steps_per_rg = my_chunks == 0 ? 0 : min(my_chunks << lcs, (my_chunks - 1) * cs + nsteps - (my_last << lcs));
  const Layout L = layout<NT, D, FRAG>(W, nsteps, p.seg, nchunks, C);
  constexpr int kSlot = Slot<FRAG>::kBytes;
  uint8_t* ring = smem + L.ring + warp * D * kSlot;
  uint32_t* tokens = reinterpret_cast<uint32_t*>(smem + L.tokens);
  float4* sums = reinterpret_cast<float4*>(smem + L.sums);
  const int units = p.seg * 8 * NT * 4;  // token-decoding units per segment
  // where this lane's copies of a step land in a ring slot: 16 code bytes of rows g and g + 8, 4 scale bytes
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  // this lane's two 16-byte copies of a step: rows g and g + 8 (row-major), or its own 32 bytes (FRAG)
  const uint32_t dst_c = FRAG ? 16 * lane : g * kRowPitch + 16 * t, dst_s = Slot<FRAG>::kScales + 4 * lane;
  const uint32_t dst_c8 = FRAG ? dst_c + kFragHalf : dst_c + 8 * kRowPitch;
  // bytes from one K step to the next: 64 of each row (row-major), the warp's whole 1 KB step (FRAG)
  constexpr int kCodeStep = FRAG ? 16 * kStepBytes : kStepBytes;

  int* tile_start = reinterpret_cast<int*>(smem + L.tiles);
  // PDL: nothing the previous kernel may write is read (nor anything written) before its writes are visible.
  // Grouped: the tiles come from the expert offsets, so wait first; dense: the ring's first D - 1 weight steps
  // (the weight is no kernel's output) stream in while the previous kernel finishes, then wait
  bool waited = !p.pdl;
  if (GROUPED && !waited) pdl_wait(waited, p.pdl == 1);
  if (GROUPED) {
    if (warp == 0) scan_tiles<NT>(p, tile_start, lane);
    __syncthreads();
  }
  const int n_tiles = GROUPED ? tile_start[p.E] : (p.M + 8 * NT - 1) / (8 * NT);
  const int G = p.N >> 4;  // row groups of a tile
  // more tiles than rows of CTAs: share the (tile, row group) pairs out evenly, no second wave
  const bool balanced = GROUPED && STREAM && p.balanced && n_tiles > static_cast<int>(gridDim.y);
  int u = 0, u_end = 0;  // balanced: my pairs, tile-major
  if (balanced) cta_range(n_tiles, G, R, u, u_end);
  for (int next = blockIdx.y;;) {
    int tile;
    if (balanced) {  // my next piece: the rest of my range inside one tile, cut into R runs of consecutive groups
      if (u >= u_end) break;
      tile = u / G;
      const int g0 = u - tile * G, len = min(u_end - u, G - g0), q = (len + R - 1) / R;
      const int mine = min(q, len - rg * q);
      x0 = g0 + rg * q;
      active = mine > 0;
      nrg = active ? mine : 1;
      u += len;
    } else {
      if (next >= n_tiles) break;
      tile = next;
      next += gridDim.y;
    }
    const int row0 = active ? x0 * 16 : p.N - 16;
    const int J = nrg * steps_per_rg;
    int m0, m_end;
    const uint8_t* wc = p.w_codes;
    const uint8_t* ws = p.w_scales;
    const float* gw = p.gw;
    if (GROUPED) {
      const int e = expert_of(tile_start, p.E, tile);
      m0 = static_cast<int>(offset_at(p, e)) + (tile - tile_start[e]) * 8 * NT;
      m_end = min(static_cast<int>(offset_at(p, e + 1)), m0 + 8 * NT);
      wc += e * p.w_estride_c;
      ws += e * p.w_estride_s;
      gw += e * p.gw_estride;
    } else {
      m0 = tile * 8 * NT;
      m_end = min(p.M, m0 + 8 * NT);
    }
    // K step 0 of my first row group (row groups start 16 kh code bytes apart in either layout)
    const uint8_t* src_c = wc + static_cast<size_t>(row0) * kh + (FRAG ? 16 * lane : g * kh + 16 * t);
    const uint8_t* src_s = ws + static_cast<size_t>(row0 + (lane >> 1)) * ks + 4 * (lane & 1);
    const size_t c8 = FRAG ? kFragHalf : 8 * kh;
    const bool has_bias = p.bias != nullptr;
    // the ring's producer: my step ji (K step si of row group ri) -> slot ji % D, one commit group per call;
    // past my last step the copies read nothing (source size 0; the cursor runs on beyond the weight, never
    // dereferenced, as CUTLASS's zero-fill copies do). Then the cursor moves to my next
    // step: the next K step, my next chunk, or K step 0 of my next row group (running pointers: cur_c / cur_s
    // at K step si of row group ri, rg_c / rg_s at its step 0). STREAM: my row groups are consecutive, so
    // the codes of my steps follow each other in memory and only the scales' pointer jumps after step K.
    int ji = 0, si = c << lcs, ri = 0;
    const uint8_t* rg_c = src_c;
    const uint8_t* rg_s = src_s;
    const uint8_t* cur_c = src_c + static_cast<size_t>(si) * kCodeStep;
    const uint8_t* cur_s = src_s + static_cast<size_t>(si) * 8;
    auto issue_next = [&]() {
      const bool live = ji < J;
      const uint32_t n16 = live ? 16 : 0, n4 = live ? 4 : 0;
      const uint8_t* sc = cur_c;
      const uint8_t* ss = cur_s;
      const uint32_t slot = ring_s + (ji & (D - 1)) * kSlot;
      asm volatile(
          "cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
          "cp.async.cg.shared.global [%3], [%4], 16, %2;\n"
          "cp.async.ca.shared.global [%5], [%6], 4, %7;\n"
          "cp.async.commit_group;\n" ::"r"(slot + dst_c), "l"(sc), "r"(n16), "r"(slot + dst_c8), "l"(sc + c8),
          "r"(slot + dst_s), "l"(ss), "r"(n4));
      ++ji;
      if (STREAM) {  // the next code step follows in memory; the scales jump to the next 16 rows after K
        const bool wrap = ++si == nsteps;
        si = wrap ? 0 : si;
        cur_c += kCodeStep, cur_s += wrap ? static_cast<size_t>(15 * ks + 8) : 8;
      } else if (si + 1 == nsteps && ri + 1 < nrg) {  // K step 0 of my next row group
        ++ri, si = 0;
        rg_c += static_cast<size_t>(row_pitch) * kh, rg_s += static_cast<size_t>(row_pitch) * ks;
        cur_c = rg_c, cur_s = rg_s;
      } else {
        const int d = ((si + 1) & (cs - 1)) == 0 ? jump + 1 : 1;
        si += d, cur_c += d * kCodeStep, cur_s += d * 8;
      }
    };

    __syncthreads();  // the previous tile's readers of the ring, the token buffers and the chunk sums are done
#pragma unroll 1
    for (int j = 0; j < D - 1; ++j) issue_next();
    if (!waited) pdl_wait(waited, p.pdl == 1);
    float ga_m[NT][2];
#pragma unroll
    for (int jt = 0; jt < NT; ++jt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + 8 * jt + 2 * t + h;
        ga_m[jt][h] = m < m_end ? p.ga[p.ga_row ? a_row<GROUPED>(p, m) : 0] : 0.0f;
      }

    // token segment 0, then the next segments' units in registers while a segment computes
    TokenUnit tu[kUnits];
    int seg_s0 = 0, seg_buf = 0;  // the current segment's first K step, its buffer
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int u = threadIdx.x + i * blockDim.x;
      if (u < units) load_tokens<NT, GROUPED>(tu[i], p, u, m0, m_end, 0, min(p.seg, nsteps));
    }
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int u = threadIdx.x + i * blockDim.x;
      if (u < units) store_tokens<NT>(tu[i], tokens, u);
    }
    __syncthreads();

    // the next segment: units into registers (at its predecessor's start), into the other buffer (at its end)
    auto fetch_next = [&]() {
      const int s1 = seg_s0 + p.seg;
#pragma unroll
      for (int i = 0; i < kUnits; ++i) {
        const int u = threadIdx.x + i * blockDim.x;
        if (u < units) load_tokens<NT, GROUPED>(tu[i], p, u, m0, m_end, s1, min(s1 + p.seg, nsteps));
      }
    };
    // (warps reach a switch from different places, their runs or the tail below: a non-aligned barrier)
    auto switch_segment = [&]() {
      uint32_t* next = tokens + (seg_buf ^ 1) * L.buf_words;
#pragma unroll
      for (int i = 0; i < kUnits; ++i) {
        const int u = threadIdx.x + i * blockDim.x;
        if (u < units) store_tokens<NT>(tu[i], next, u);
      }
      asm volatile("barrier.sync 0;\n" ::: "memory");
      seg_s0 += p.seg;
      seg_buf ^= 1;
      if (seg_s0 + p.seg < nsteps) fetch_next();
    };
    if (p.seg < nsteps) fetch_next();

    float part[NT][4], total[NT][4];

    // register pipeline: fragments of my step j (a), words of step j + 1 (w), gathered a step before they
    // are decoded, so the decode of step j + 1 has its inputs when step j's mma chain starts
    uint32_t a0[8][4], a1[8][4];
    StepWords w0, w1;
    {
      cp_async_wait<D - 3>();  // my steps 0 and 1 landed (this lane's copies) ...
      __syncwarp();            // ... for every lane
      gather_step<FRAG>(ring, g, t, lane, w1);
      decode_step<FRAG>(w1, a0);
      gather_step<FRAG>(ring + kSlot, g, t, lane, w0);
    }

    // my step j, K step with token fragments at b: refill the slot of step j - 1 with step j + D - 1, gather
    // step j + 2, and decode step j + 1 while step j's mma chain runs on the fragments decoded one step ago
    // (the slot refilled was gathered two steps ago, before the last __syncwarp: no lane still reads it)
    auto step = [&](const uint32_t (&a)[8][4], uint32_t (&a_next)[8][4], const StepWords& w, StepWords& w_next,
                    const uint32_t* b, int j) {
      issue_next();
      cp_async_wait<D - 3>();  // my steps <= j + 2 landed (this lane's copies) ...
      __syncwarp();            // ... for every lane
      // stale (unused) past my last step
      gather_step<FRAG>(ring + ((j + 2) & (D - 1)) * kSlot, g, t, lane, w_next);
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // 0: the evens pieces, 1: the odds pieces
#pragma unroll
        for (int q = 0; q < 2; ++q) {  // pieces (2q, 2q + 1) of each n8 tile: one conflict-free 16-byte load
          uint4 bq[NT];
#pragma unroll
          for (int jt = 0; jt < NT; ++jt)
            bq[jt] = *reinterpret_cast<const uint4*>(b + b_index<NT>(0, jt, half * 4 + 2 * q, 0, 0));
#pragma unroll
          for (int jt = 0; jt < NT; ++jt) {
            mma16816(part[jt], a[half * 4 + 2 * q], bq[jt].x, bq[jt].y);
            mma16816(part[jt], a[half * 4 + 2 * q + 1], bq[jt].z, bq[jt].w);
          }
        }
      }
      decode_step<FRAG>(w, a_next);
    };

    int j = 0;
#pragma unroll 1
    for (int i = 0; i < nrg; ++i) {  // my row groups (one with chunks or token segments)
      // epilogue operands now: their loads overlap the main loop instead of ending the row group
      const int n_a = row0 + i * row_pitch + g, n_b = n_a + 8;
      const float gw_a = gw[p.gw_row ? n_a : 0], gw_b = gw[p.gw_row ? n_b : 0];
      const float bias_a = has_bias ? p.bias[n_a] : 0.0f, bias_b = has_bias ? p.bias[n_b] : 0.0f;
#pragma unroll
      for (int jt = 0; jt < NT; ++jt)
#pragma unroll
        for (int r = 0; r < 4; ++r) part[jt][r] = total[jt][r] = 0.0f;

      // runs of consecutive K steps: my chunks (with chunks), or the token segments (one chain)
      for (int run = 0;; ++run) {
        int s0, s1;
        if (chunked) {
          if (run >= my_chunks) break;
          s0 = (c + run * C) << lcs;
          s1 = min(s0 + cs, nsteps);
          while (s0 >= seg_s0 + p.seg) switch_segment();  // my chunk of the next round is in the next segment
#pragma unroll
          for (int jt = 0; jt < NT; ++jt)
#pragma unroll
            for (int r = 0; r < 4; ++r) part[jt][r] = 0.0f;
        } else {
          s0 = seg_s0;
          if (s0 >= nsteps) break;
          s1 = min(s0 + p.seg, nsteps);
        }
        const uint32_t* b = tokens + seg_buf * L.buf_words + (s0 - seg_s0) * NT * kTileStepWords + 4 * lane;
        int s = s0;
        for (; s + 1 < s1; s += 2, j += 2, b += 2 * NT * kTileStepWords) {
          step(a0, a1, w0, w1, b, j);
          step(a1, a0, w1, w0, b + NT * kTileStepWords, j + 1);
        }
        if (s < s1) {  // an odd run: one step, then the pipeline registers back in place
          step(a0, a1, w0, w1, b, j);
          ++j;
#pragma unroll
          for (int pc = 0; pc < 8; ++pc)
#pragma unroll
            for (int r = 0; r < 4; ++r) a0[pc][r] = a1[pc][r];
          w0 = w1;
        }
        if (chunked) {  // the chunk's sum: into the running total (one lane) or shared memory (C lanes)
          if (C == 1) {
#pragma unroll
            for (int jt = 0; jt < NT; ++jt)
#pragma unroll
              for (int r = 0; r < 4; ++r) total[jt][r] = __fadd_rn(total[jt][r], part[jt][r]);
          } else {
            const int q = s0 >> lcs;
#pragma unroll
            for (int jt = 0; jt < NT; ++jt)
              sums[((q * R + rg) * 32 + lane) * NT + jt] =
                  make_float4(part[jt][0], part[jt][1], part[jt][2], part[jt][3]);
          }
        } else {
          if (s1 >= nsteps) break;
          switch_segment();
        }
      }
      // a warp whose chunks ended before the last segment still takes part in every switch
      while (seg_s0 + p.seg < nsteps) switch_segment();

      if (!chunked) {
#pragma unroll
        for (int jt = 0; jt < NT; ++jt)
#pragma unroll
          for (int r = 0; r < 4; ++r) total[jt][r] = part[jt][r];
      } else if (C > 1) {
        __syncthreads();  // every chunk sum of the tile is in shared memory
        if (c == 0) {
          for (int q = 0; q < nchunks; ++q) {
#pragma unroll
            for (int jt = 0; jt < NT; ++jt) {
              const float4 v = sums[((q * R + rg) * 32 + lane) * NT + jt];
              total[jt][0] = __fadd_rn(total[jt][0], v.x);
              total[jt][1] = __fadd_rn(total[jt][1], v.y);
              total[jt][2] = __fadd_rn(total[jt][2], v.z);
              total[jt][3] = __fadd_rn(total[jt][3], v.w);
            }
          }
        }
      }

      if (active && c == 0) {
        // total[jt]: c0, c1 = (weight row g, tokens 8jt + 2t, +1); c2, c3 = (weight row g + 8, same tokens)
#pragma unroll
        for (int jt = 0; jt < NT; ++jt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int m = m0 + 8 * jt + 2 * t + (r & 1);
            if (m >= m_end) continue;
            const int n = r < 2 ? n_a : n_b;
            const float v = epilogue(total[jt][r], ga_m[jt][r & 1], r < 2 ? gw_a : gw_b, has_bias,
                                     r < 2 ? bias_a : bias_b);
            if (p.out_kind == 0) store_out<__nv_bfloat16>(p, m, n, v);
            else if (p.out_kind == 1) store_out<__half>(p, m, n, v);
            else store_out<float>(p, m, n, v);
          }
        }
      }
    }
    cp_async_wait<0>();
  }
  if (!waited) pdl_wait(waited, p.pdl == 1);  // a CTA without a tile still waits before it exits
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.pdl == 2) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Host side: one instantiation per (token tiles of 8 per CTA, ring depth, grouped, row groups in sequence,
// fragment-order codes); returns a cudaError_t.
template <int NT, int D, bool GROUPED, bool ROWS, bool FRAG>
int launch_one(const Params& p, int warps, int grid_x, int grid_y, cudaStream_t stream) {
  const int nsteps = p.K / 128;
  const int nchunks = p.chunk_log2 >= 0 ? (nsteps + (1 << p.chunk_log2) - 1) >> p.chunk_log2 : 1;
  const Layout l = layout<NT, D, FRAG>(warps, nsteps, p.seg, nchunks, p.lanes);
  const size_t smem = static_cast<size_t>(l.tiles) + (GROUPED ? 4 * static_cast<size_t>(p.E + 1) : 0);
  // every segment's token units fit the registers the kernel keeps for them
  if (p.seg * 32 * NT > TokenBudget<NT>::kUnitsPerThread * 32 * warps) return -1;
  if (warps * 32 > Occupancy<NT, GROUPED, ROWS, FRAG>::kThreads) return -1;  // more threads than it was built for
  return minite_cuda::launch<decode_gemm_kernel<NT, D, GROUPED, ROWS, FRAG>>(p, dim3(grid_x, grid_y), dim3(warps * 32),
                                                                        smem, p.pdl != 0, stream);
}

template <int NT, bool GROUPED, bool ROWS>
int launch_depth(const Params& p, int depth, int warps, int grid_x, int grid_y, cudaStream_t stream) {
  if (p.frag) {
    if (depth == 4) return launch_one<NT, 4, GROUPED, ROWS, true>(p, warps, grid_x, grid_y, stream);
    if (depth == 8) return launch_one<NT, 8, GROUPED, ROWS, true>(p, warps, grid_x, grid_y, stream);
    return -1;
  }
  if (depth == 4) return launch_one<NT, 4, GROUPED, ROWS, false>(p, warps, grid_x, grid_y, stream);
  if (depth == 8) return launch_one<NT, 8, GROUPED, ROWS, false>(p, warps, grid_x, grid_y, stream);
  if (depth == 16) return launch_one<NT, 16, GROUPED, ROWS, false>(p, warps, grid_x, grid_y, stream);
  return -1;
}

template <int NT, bool GROUPED>
int launch_rows(const Params& p, int depth, int warps, int grid_x, int grid_y, cudaStream_t stream) {
  return p.row_groups > 1 ? launch_depth<NT, GROUPED, true>(p, depth, warps, grid_x, grid_y, stream)
                          : launch_depth<NT, GROUPED, false>(p, depth, warps, grid_x, grid_y, stream);
}

template <bool GROUPED>
int launch_tiles(const Params& p, int nt, int depth, int warps, int grid_x, int grid_y, cudaStream_t stream) {
  if (nt == 1) return launch_rows<1, GROUPED>(p, depth, warps, grid_x, grid_y, stream);
  if (nt == 2) return launch_rows<2, GROUPED>(p, depth, warps, grid_x, grid_y, stream);
  if (nt == 4) return launch_rows<4, GROUPED>(p, depth, warps, grid_x, grid_y, stream);
  return -1;
}

}  // namespace minite_decode

// Entry point (pointers and the stream as integers, so the binding needs no tensor types). -1: bad config.
int64_t decode_gemm_launch(int64_t a_codes, int64_t a_scales, int64_t ga, int64_t w_codes, int64_t w_scales,
                           int64_t gw, int64_t bias, int64_t out, int64_t M, int64_t N, int64_t K, int64_t ga_row,
                           int64_t gw_row, int64_t out_kind, int64_t nt, int64_t depth, int64_t warps, int64_t seg,
                           int64_t chunk_log2, int64_t lanes, int64_t row_groups, int64_t grid_y, int64_t offsets,
                           int64_t offsets64,
                           int64_t n_experts, int64_t w_estride_c, int64_t w_estride_s, int64_t gw_estride,
                           int64_t frag, int64_t a_rows, int64_t a_rows64, int64_t balanced, int64_t pdl,
                           int64_t stream) {
  using namespace minite_decode;
  Params p;
  p.a_codes = reinterpret_cast<const uint8_t*>(a_codes);
  p.a_scales = reinterpret_cast<const uint8_t*>(a_scales);
  p.ga = reinterpret_cast<const float*>(ga);
  p.w_codes = reinterpret_cast<const uint8_t*>(w_codes);
  p.w_scales = reinterpret_cast<const uint8_t*>(w_scales);
  p.gw = reinterpret_cast<const float*>(gw);
  p.bias = reinterpret_cast<const float*>(bias);
  p.out = reinterpret_cast<void*>(out);
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.ga_row = static_cast<int>(ga_row);
  p.gw_row = static_cast<int>(gw_row);
  p.out_kind = static_cast<int>(out_kind);
  p.seg = static_cast<int>(seg);
  p.chunk_log2 = static_cast<int>(chunk_log2);
  p.lanes = static_cast<int>(lanes);
  p.row_groups = static_cast<int>(row_groups);
  p.offsets = reinterpret_cast<const void*>(offsets);
  p.offsets64 = static_cast<int>(offsets64);
  p.E = static_cast<int>(n_experts);
  p.w_estride_c = w_estride_c;
  p.w_estride_s = w_estride_s;
  p.gw_estride = gw_estride;
  p.frag = static_cast<int>(frag);
  p.a_rows = reinterpret_cast<const void*>(a_rows);
  p.a_rows64 = static_cast<int>(a_rows64);
  p.balanced = static_cast<int>(balanced);
  p.pdl = static_cast<int>(pdl);
  const int64_t nsteps = K / 128;
  if (warps < 1 || warps > 8 || (warps & (warps - 1)) || lanes < 1 || warps % lanes || (lanes & (lanes - 1)) ||
      chunk_log2 < -1 || chunk_log2 > 10 || (chunk_log2 < 0 && lanes != 1) || seg < 1 || N % 16 || nsteps < 1 ||
      (a_rows != 0 && offsets == 0) || (balanced && (offsets == 0 || !frag || row_groups < 2)))
    return -1;
  // segments hold whole rounds of chunks (C chunks of 2^chunk_log2 steps), or all of K
  if (chunk_log2 >= 0 && seg < nsteps && seg % (lanes << chunk_log2)) return -1;
  // row groups in sequence: one chain over K, all of K's token fragments resident
  if (row_groups < 1 || (row_groups > 1 && (chunk_log2 >= 0 || seg < nsteps))) return -1;
  const int rows_per_cta = 16 * static_cast<int>(warps / lanes * row_groups);
  const int grid_x = static_cast<int>((N + rows_per_cta - 1) / rows_per_cta);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const bool grouped = offsets != 0;
  return grouped ? launch_tiles<true>(p, nt, depth, warps, grid_x, grid_y, s)
                 : launch_tiles<false>(p, nt, depth, warps, grid_x, grid_y, s);
}
