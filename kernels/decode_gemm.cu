// NVFP4 W4A4 GEMM for few token rows (decode): out[m, n] = sum_k a[m, k] * w[n, k], both operands NVFP4.
//
// Same arithmetic as the Triton kernels (kernels/_triton_gemm.py), so rows are bit-equal to theirs:
//   * every element decoded exactly to fp16: e2m1 * 2^-14 (bits (sign << 15) | (mag << 9)) times its E4M3
//     block scale (bits (e4m3 & 0x7F) << 7 = s * 2^-8, times 256): exact products, no rounding;
//   * K in 128-wide steps; each step = its 64 even-K elements (low nibbles) as four k16 pieces, then its 64
//     odd-K ones (high nibbles): eight fp16 -> fp32 mma.m16n8k16 chained on one accumulator, from K = 0 up;
//   * position i of piece p is element 16p + i of the step's evens (odds): the layout Triton's dot feeds;
//   * epilogue ((acc * 2^28) * ga) * gw (+ bias, fused into the last multiply, as Triton does), then the cast.
// Data flow per warp (16 weight rows of the mma's M side; tokens are its N side, 8 per n8 tile):
//   * the weight's packed bytes, in their original [N, K/2] layout, reach shared memory through cp.async
//     (each lane copies 16 B of one row per step: coalesced, no registers held in flight); each lane then
//     gathers the 2-byte pairs its mma fragment needs (row pitch padded: no bank conflicts), decodes them
//     in registers (byte_perm + 2 shifts + 1 lop3 per fp16 pair, one hmul2 by the scale) and issues mma;
//   * the token fragments are decoded once per CTA per segment of steps into shared memory (double
//     buffered, one __syncthreads per segment) and read back with conflict-free 16-byte loads.
// No split of K: a row's K order is the one above whatever M is, so batch invariance holds by construction
// (and the first-use probe checks bit equality with the Triton path on the GPU).
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace minite_decode {

constexpr int kStepBytes = 64;               // codes of one row per 128-wide K step
constexpr int kRowPitch = 80;                // shared-memory pitch of one row's step (64 + 16: conflict-free)
constexpr int kSlotBytes = 16 * kRowPitch + 16 * 8;  // one warp's step: 16 rows of codes + 16 x 8 scale bytes

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
  int seg;                       // K steps per token-fragment segment
  // grouped: expert e owns rows offsets[e] .. offsets[e + 1] (int32 or int64), cut into tiles of 8 NT rows;
  // every CTA lists the tiles itself (a scan of the offsets): one launch, no host sync, no schedule kernels
  const void* offsets;
  int offsets64, E;
  int64_t w_estride_c, w_estride_s, gw_estride;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

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
// the word a lane decodes: the code bytes of positions 2t, 2t+1 (lo16) and 2t+8, 2t+9 (hi16) of a piece
__device__ __forceinline__ uint32_t join16(uint32_t lo16, uint32_t hi16) { return __byte_perm(lo16, hi16, 0x5410); }

// four E4M3 scale bytes -> fp16x2 {s0, s2} and {s1, s3}: bits (e & 0x7F) << 7 = s * 2^-8, times 256: exact
__device__ __forceinline__ void scale_pairs(uint32_t w, __half2& even, __half2& odd) {
  uint32_t e = (w & 0x007F007Fu) << 7, o = (w & 0x7F007F00u) >> 1;
  const __half2 k256 = __floats2half2_rn(256.0f, 256.0f);
  even = __hmul2(*reinterpret_cast<__half2*>(&e), k256);
  odd = __hmul2(*reinterpret_cast<__half2*>(&o), k256);
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

template <int NT>
__device__ __forceinline__ void load_tokens(TokenUnit& u, const Params& p, int unit, int m0, int m_end,
                                            int s_begin, int s_end) {
  const int piece = unit & 3;
  const int m = (unit >> 2) % (8 * NT);
  const int sl = (unit >> 2) / (8 * NT);
  const int row = m0 + m, s = s_begin + sl;
  if (row < m_end && s < s_end) {
    const size_t kh = p.K >> 1, ks = p.K >> 4;
    u.codes = *reinterpret_cast<const uint4*>(p.a_codes + row * kh + s * kStepBytes + 16 * piece);
    u.sc = *reinterpret_cast<const uint16_t*>(p.a_scales + row * ks + s * 8 + 2 * piece);
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
  __half2 se, so;
  scale_pairs(u.sc, se, so);  // u.sc: blocks 2p (byte 0), 2p+1 (byte 1)
  const __half s_a = __low2half(se), s_b = __low2half(so);
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

// tile_start[e] = tiles of experts 0 .. e-1 (exclusive scan, one warp, 32 experts a round); tile_start[E] = all
template <int NT>
__device__ void scan_tiles(const Params& p, int* tile_start, int lane) {
  int carry = 0;
  for (int e0 = 0; e0 < p.E; e0 += 32) {
    const int e = e0 + lane;
    int tiles = 0;
    if (e < p.E) {
      const int64_t rows = offset_at(p, e + 1) - offset_at(p, e);
      tiles = rows > 0 ? static_cast<int>((rows + 8 * NT - 1) / (8 * NT)) : 0;
    }
    int incl = tiles;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
      if (lane >= d) incl += v;
    }
    if (e < p.E) tile_start[e] = carry + incl - tiles;
    carry += __shfl_sync(0xFFFFFFFFu, incl, 31);
  }
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
__device__ __forceinline__ float epilogue(float acc, float ga, float gw, const float* bias, int n) {
  float o = __fmul_rn(acc, 268435456.0f);
  o = __fmul_rn(o, ga);
  return bias != nullptr ? __fmaf_rn(o, gw, bias[n]) : __fmul_rn(o, gw);
}

// grid: x = groups of W warps x 16 weight rows, y = token tiles (looped with stride gridDim.y);
// block: 32 W threads; dynamic shared memory: W * D * kSlotBytes + 2 * seg * NT * 2048 (+ 4 (E + 1) grouped).
template <int NT, int D, bool GROUPED>
__global__ void __launch_bounds__(256) decode_gemm_kernel(const Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int W = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int nsteps = p.K / 128;
  const size_t kh = p.K >> 1, ks = p.K >> 4;
  const int row0 = (blockIdx.x * W + warp) * 16;  // this warp's first weight row
  const bool active = row0 < p.N;
  uint8_t* ring = smem + warp * D * kSlotBytes;
  uint32_t* bbuf = reinterpret_cast<uint32_t*>(smem + W * D * kSlotBytes);
  const int bwords = p.seg * NT * 4 * 32 * 4;  // u32 words per token-fragment buffer
  const int units = p.seg * 8 * NT * 4;        // token-decoding units per segment
  constexpr int kMaxUnitsPerThread = 2;        // units <= 2 * 32 W (the launcher picks seg so)

  int* tile_start = reinterpret_cast<int*>(smem + W * D * kSlotBytes + 2 * bwords * 4);
  if (GROUPED) {
    if (warp == 0) scan_tiles<NT>(p, tile_start, lane);
    __syncthreads();
  }
  const int n_tiles = GROUPED ? tile_start[p.E] : (p.M + 8 * NT - 1) / (8 * NT);
  for (int tile = blockIdx.y; tile < n_tiles; tile += gridDim.y) {
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
    const uint8_t* wrow_g = wc + static_cast<size_t>(row0 + g) * kh + 16 * t;
    const uint8_t* wscale = ws + static_cast<size_t>(row0 + (lane & 15)) * ks;

    auto issue = [&](int s) {  // step s of this warp's rows -> ring slot s % D (one commit group per call)
      if (active && s < nsteps) {
        uint8_t* slot = ring + (s % D) * kSlotBytes;
        cp_async16(slot + g * kRowPitch + 16 * t, wrow_g + s * kStepBytes);
        cp_async16(slot + (g + 8) * kRowPitch + 16 * t, wrow_g + 8 * kh + s * kStepBytes);
        if (lane < 16) cp_async8(slot + 16 * kRowPitch + lane * 8, wscale + s * 8);
      }
      cp_async_commit();
    };

    // what a lane gathers from the ring for one step: for each piece, the word join16(positions 2t.., 2t+8..)
    // of rows g and g + 8, and the 8 scale bytes of rows g and g + 8
    struct StepWords {
      uint32_t x[4][2];
      uint2 sc[2];
    };
    auto gather = [&](int s, StepWords& d) {
      const uint8_t* slot = ring + (s % D) * kSlotBytes;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint8_t* row = slot + (g + 8 * r) * kRowPitch + 2 * t;
#pragma unroll
        for (int pc = 0; pc < 4; ++pc)
          d.x[pc][r] = join16(*reinterpret_cast<const uint16_t*>(row + 16 * pc),
                              *reinterpret_cast<const uint16_t*>(row + 16 * pc + 8));
        d.sc[r] = *reinterpret_cast<const uint2*>(slot + 16 * kRowPitch + (g + 8 * r) * 8);
      }
    };

    __syncthreads();  // the previous tile's readers of the ring and the token buffers are done
#pragma unroll
    for (int s = 0; s < D - 1; ++s) issue(s);

    TokenUnit tu[kMaxUnitsPerThread];
    // segment 0's token fragments
#pragma unroll
    for (int i = 0; i < kMaxUnitsPerThread; ++i) {
      const int u = threadIdx.x + i * blockDim.x;
      if (u < units) load_tokens<NT>(tu[i], p, u, m0, m_end, 0, min(p.seg, nsteps));
    }
#pragma unroll
    for (int i = 0; i < kMaxUnitsPerThread; ++i) {
      const int u = threadIdx.x + i * blockDim.x;
      if (u < units) store_tokens<NT>(tu[i], bbuf, u);
    }
    __syncthreads();

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    StepWords cur, nxt;
    cp_async_wait<D - 2>();  // step 0 landed (its lane's copies) ...
    __syncwarp();            // ... for every lane
    if (active) gather(0, cur);

    for (int s0 = 0, seg = 0; s0 < nsteps; s0 += p.seg, ++seg) {
      const int s1 = min(s0 + p.seg, nsteps);
      // next segment's token data: loads in flight while this segment computes
#pragma unroll
      for (int i = 0; i < kMaxUnitsPerThread; ++i) {
        const int u = threadIdx.x + i * blockDim.x;
        if (u < units) load_tokens<NT>(tu[i], p, u, m0, m_end, s1, min(s1 + p.seg, nsteps));
      }
      const uint32_t* bseg = bbuf + (seg & 1) * bwords;
      for (int s = s0; s < s1; ++s) {
        // refill the slot of step s - 1 (gathered one iteration ago) with step s + D - 1, then gather step s + 1
        // while step s computes: its shared-memory loads overlap this step's decode and mma chain
        __syncwarp();
        issue(s + D - 1);
        cp_async_wait<D - 2>();  // steps <= s + 1 landed
        __syncwarp();
        if (!active) continue;
        if (s + 1 < nsteps) gather(s + 1, nxt);
        __half2 se[2][2], so[2][2];  // [row g | g + 8][scale word x | y]: {blocks 0, 2 | 4, 6}, {1, 3 | 5, 7}
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          scale_pairs(cur.sc[r].x, se[r][0], so[r][0]);
          scale_pairs(cur.sc[r].y, se[r][1], so[r][1]);
        }
        const uint32_t* bstep = bseg + (s - s0) * NT * 512;
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // 0: the evens pieces, 1: the odds pieces
          uint4 b[NT];  // pieces (2q, 2q + 1) of each n8 tile: one conflict-free 16-byte load per pair
#pragma unroll
          for (int pc = 0; pc < 4; ++pc) {
            const int piece = half * 4 + pc;
            if ((pc & 1) == 0) {
#pragma unroll
              for (int j = 0; j < NT; ++j)
                b[j] = *reinterpret_cast<const uint4*>(bstep + b_index<NT>(0, j, piece, lane, 0));
            }
            // scales of blocks 2pc (positions 2t..) and 2pc + 1 (positions 2t+8..): byte pc & 1 of the pairs
            const int wsel = pc >> 1;
            uint32_t a[4];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const uint32_t h = half ? high_nibbles(cur.x[pc][r]) : low_nibbles(cur.x[pc][r]);
              const __half s_a = (pc & 1) ? __high2half(se[r][wsel]) : __low2half(se[r][wsel]);
              const __half s_b = (pc & 1) ? __high2half(so[r][wsel]) : __low2half(so[r][wsel]);
              a[r] = scaled(pair01(h), s_a);      // row g + 8 r, positions 2t, 2t+1
              a[2 + r] = scaled(pair23(h), s_b);  // row g + 8 r, positions 2t+8, 2t+9
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              if ((pc & 1) == 0) mma16816(acc[j], a, b[j].x, b[j].y);
              else mma16816(acc[j], a, b[j].z, b[j].w);
            }
          }
        }
        cur = nxt;
      }
      if (s1 < nsteps) {
#pragma unroll
        for (int i = 0; i < kMaxUnitsPerThread; ++i) {
          const int u = threadIdx.x + i * blockDim.x;
          if (u < units) store_tokens<NT>(tu[i], bbuf + ((seg + 1) & 1) * bwords, u);
        }
      }
      __syncthreads();
    }
    cp_async_wait<0>();

    if (active) {
      // acc[j]: c0, c1 = (weight row g, tokens 8j + 2t, +1); c2, c3 = (weight row g + 8, same tokens)
      const int n_a = row0 + g, n_b = row0 + g + 8;
      const float gw_a = gw[p.gw_row ? n_a : 0], gw_b = gw[p.gw_row ? n_b : 0];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int m = m0 + 8 * j + 2 * t + (c & 1);
          if (m >= m_end) continue;
          const int n = c < 2 ? n_a : n_b;
          const float v = epilogue(acc[j][c], p.ga[p.ga_row ? m : 0], c < 2 ? gw_a : gw_b, p.bias, n);
          if (p.out_kind == 0) store_out<__nv_bfloat16>(p, m, n, v);
          else if (p.out_kind == 1) store_out<__half>(p, m, n, v);
          else store_out<float>(p, m, n, v);
        }
      }
    }
  }
}

// Host side: one instantiation per (token tiles of 8 per CTA, ring depth, grouped); returns a cudaError_t.
template <int NT, int D, bool GROUPED>
int launch_one(const Params& p, int warps, int grid_x, int grid_y, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(warps) * D * kSlotBytes + 2 * static_cast<size_t>(p.seg) * NT * 2048 +
                      (GROUPED ? 4 * static_cast<size_t>(p.E + 1) : 0);
  // dynamic shared memory this kernel may use on each device (48 KB without opting in); raised once per size
  // and device, so a launch inside a CUDA graph capture (after a warm-up call) makes no attribute call
  static size_t raised[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return -1;
  if (smem > 48 * 1024 && smem > raised[dev]) {
    cudaError_t err = cudaFuncSetAttribute(decode_gemm_kernel<NT, D, GROUPED>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return static_cast<int>(err);
    raised[dev] = smem;
  }
  decode_gemm_kernel<NT, D, GROUPED><<<dim3(grid_x, grid_y), warps * 32, smem, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <int NT, bool GROUPED>
int launch_depth(const Params& p, int depth, int warps, int grid_x, int grid_y, cudaStream_t stream) {
  if (depth == 4) return launch_one<NT, 4, GROUPED>(p, warps, grid_x, grid_y, stream);
  if (depth == 8) return launch_one<NT, 8, GROUPED>(p, warps, grid_x, grid_y, stream);
  return -1;
}

template <bool GROUPED>
int launch_tiles(const Params& p, int nt, int depth, int warps, int grid_x, int grid_y, cudaStream_t stream) {
  if (nt == 1) return launch_depth<1, GROUPED>(p, depth, warps, grid_x, grid_y, stream);
  if (nt == 2) return launch_depth<2, GROUPED>(p, depth, warps, grid_x, grid_y, stream);
  if (nt == 4) return launch_depth<4, GROUPED>(p, depth, warps, grid_x, grid_y, stream);
  return -1;
}

}  // namespace minite_decode

// Entry point (pointers and the stream as integers, so the binding needs no tensor types). -1: bad config.
int64_t decode_gemm_launch(int64_t a_codes, int64_t a_scales, int64_t ga, int64_t w_codes, int64_t w_scales,
                           int64_t gw, int64_t bias, int64_t out, int64_t M, int64_t N, int64_t K, int64_t ga_row,
                           int64_t gw_row, int64_t out_kind, int64_t nt, int64_t depth, int64_t warps, int64_t seg,
                           int64_t grid_y, int64_t offsets, int64_t offsets64, int64_t n_experts,
                           int64_t w_estride_c, int64_t w_estride_s, int64_t gw_estride, int64_t stream) {
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
  p.offsets = reinterpret_cast<const void*>(offsets);
  p.offsets64 = static_cast<int>(offsets64);
  p.E = static_cast<int>(n_experts);
  p.w_estride_c = w_estride_c;
  p.w_estride_s = w_estride_s;
  p.gw_estride = gw_estride;
  if (seg < 1 || seg * 32 * nt > 2 * 32 * warps || warps < 1 || warps > 8) return -1;
  const int grid_x = static_cast<int>((N / 16 + warps - 1) / warps);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const bool grouped = offsets != 0;
  return grouped ? launch_tiles<true>(p, nt, depth, warps, grid_x, grid_y, s)
                 : launch_tiles<false>(p, nt, depth, warps, grid_x, grid_y, s);
}
