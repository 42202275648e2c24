// Float64 decode attention on the fp64 tensor cores (mma.sync m8n8k4 .f64): one new query per sequence
// against its KV-cache row, the "invariant" numerics of kernels/attention.py.
//
// Why the bits are those of the PyTorch reference (``attention.invariant_attention_reference``):
//   * q.k: BF16 x BF16 products are exact in float64 and so are their sums over D (for any realistic range),
//     so the scores do not depend on the order the mma sums them in; each score is then scaled by one
//     float64 multiply, as the reference does;
//   * the softmax and P.V sums carry ~30 more bits than the fp32 -> BF16 result keeps, so their order (mma
//     groups of four keys, warps merged by log-sum-exp) does not reach the rounded output;
//   * the output is rounded float64 -> fp32 -> BF16, both to nearest even: torch's ``.to(bfloat16)``.
// Work split: a CTA per (sequence, KV head x row group of up to 8 query heads, split of the keys). The row group
// is the mma's M side (query heads of the KV head, padded to 8 with zero rows), keys its N side in tiles of 8.
// The CTA's W warps take chunks of 8 x kTiles keys round robin, each streaming its chunks through its own
// shared-memory ring (cp.async) with its own online softmax; at the end the warps are merged in warp order
// through shared memory (then the output, or the split's partial for ``_triton_attention.merge_splits_kernel``).
// Fragments (PTX m8n8k4 .f64: A row-major, lane l holds A[l / 4][l % 4]; B column-major, B[l % 4][l / 4];
// C/D, C[l / 4][2 (l % 4) + i]). With g = l / 4 and c = l % 4 (the sums over D and over keys may take any order,
// so each side's layout is chosen for 16-byte, conflict-free reads):
//   * q.k: step 8u + e's A is q[row g][dim 8 (4u + c) + e] (kept in registers), B is K[key g of the tile][the
//     same dim], so lane (g, c) reads 16-byte pieces 4u + c of one key; the C of a key tile holds the scores of
//     keys 2c, 2c + 1 for row g;
//   * P.V: those two scores' weights are already the A operands of two k4 steps (keys 8t + 2c + parity), so B
//     is V[that key][dim 64 (n / 8) + 8g + n % 8] for output tile n: lane (g, c) reads 16-byte pieces 8u + g of
//     one value row; the C of output tile n holds row g's dims 64 (n / 8) + 8 (2c + i) + n % 8.
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda_common.cuh"

namespace minite_attention {

using minite_cuda::cp_async_commit;
using minite_cuda::cp_async_wait;

constexpr int kMaxWarps = 8;
constexpr int kRows = 8;  // query heads per row group (the mma's M)
// Key tiles of 8 per chunk, q.k chains per key tile, ring slots per warp. H200, CUDA-graph medians, every variant
// bitwise the reference (docs/KERNELS_NOTES.md): among (1, 8, 3|4), (2, 4, 2|3), (2, 8, 3), (4, 2|4, 2), (2, 4, 2)
// was the best at 64 keys and more (Qwen3-30B-A3B and the small model's shapes), within 1.2 us of it at 1-33.
constexpr int kTiles = 2, kSplit = 4, kDepth = 2;

struct Params {
  const uint16_t* q;        // [B, Hq, D] BF16 bits (any batch / head strides, dims contiguous)
  const uint16_t* k;        // [slots, Hkv, S, D]
  const uint16_t* v;
  const int* slot_ids;      // [B]
  const int* seq_lens;      // [B], keys 0 .. len - 1
  double* part_acc;         // [B, Hq, splits, D] (splits > 1)
  double* part_ml;          // [B, Hq, splits, 2]
  uint16_t* out;            // [B, Hq, D] BF16 bits, contiguous
  int64_t sq_b, sq_h, sk_slot, sk_head, sk_seq, sv_slot, sv_head, sv_seq;  // strides in elements
  double scale;
  int n_q_heads, rep, groups, splits, pdl;
};

__device__ __forceinline__ void dmma(double& d0, double& d1, double a, double b) {  // not volatile: free to schedule
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+d"(d0), "+d"(d1)
               : "d"(a), "d"(b));
}

// BF16 element e (0..7) of a 16-byte load, exactly as float64
__device__ __forceinline__ double bf16_at(const uint4& w, int e) {
  const uint32_t word = e < 2 ? w.x : e < 4 ? w.y : e < 6 ? w.z : w.w;
  return static_cast<double>(__uint_as_float((e & 1) ? (word & 0xFFFF0000u) : (word << 16)));
}

__device__ __forceinline__ uint4 load16(const uint16_t* p, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

// 16 bytes global -> shared, zero-filled where !ok (no read then)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ uint4 lds16(const unsigned char* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ uint16_t to_bf16_bits(double x) {
  // float64 -> fp32 -> BF16, each to nearest even (NaN stays NaN): torch's two roundings
  const float f = static_cast<float>(x);
  const uint32_t bits = __float_as_uint(f);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// Online softmax of row g over a chunk's scores (s: the q.k sums, two chains per key tile; keys past hi: -inf,
// weight 0): the running max and sum, the keys' weights pw, the old accumulators' rescale (returned).
template <int TILES, int SPLIT>
__device__ __forceinline__ double softmax_chunk(const double (&s)[TILES][SPLIT][2], int start, int hi, int c,
                                                double scale, double& m_run, double& den, double (&pw)[TILES][2]) {
  double mx = -INFINITY;
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int key = start + 8 * t + 2 * c + i;
      double dot = s[t][0][i];  // the chains' sums, each exact: so is their total, in any order
#pragma unroll
      for (int k = 1; k < SPLIT; ++k) dot += s[t][k][i];
      pw[t][i] = key < hi ? dot * scale : -INFINITY;
      mx = fmax(mx, pw[t][i]);
    }
  mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const double m_new = fmax(m_run, mx);
  const double m_ref = m_new == -INFINITY ? 0.0 : m_new;
  const double alpha = exp(m_run - m_ref);
  double rs = 0.0;
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      pw[t][i] = exp(pw[t][i] - m_ref);
      rs += pw[t][i];
    }
  rs += __shfl_xor_sync(0xffffffffu, rs, 1);
  rs += __shfl_xor_sync(0xffffffffu, rs, 2);
  den = den * alpha + rs;
  m_run = m_new;
  return alpha;
}

// Merge the warps (log-sum-exp, warp order) and write the output or the split's partial.
// Output tile t, column col (0..7) is dim 64 (t / 8) + 8 col + t % 8: a lane's value dims are whole 16-byte
// pieces (8u + g), read conflict-free from shared memory.
template <int D>
__device__ __forceinline__ void merge_warps(const Params& p, double* smem, const double (&acc)[D / 8][2], double m_run,
                                            double den, int b, int kvh, int row0, int rows) {
  constexpr int NT = D / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  double* sm_acc = smem;  // [W][NT][2][32]: the warps' C fragments as held
  double* sm_m = smem + n_warps * NT * 64;
  double* sm_den = sm_m + n_warps * kRows;
  double* sm_w = sm_den + n_warps * kRows;
  __syncthreads();  // the rings share this memory
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    sm_acc[((warp * NT + t) * 2 + 0) * 32 + lane] = acc[t][0];
    sm_acc[((warp * NT + t) * 2 + 1) * 32 + lane] = acc[t][1];
  }
  if (c == 0) {
    sm_m[warp * kRows + g] = m_run;
    sm_den[warp * kRows + g] = den;
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < kRows) {  // per row: the max over warps, each warp's weight, the sum
    const int r = threadIdx.x;
    double m_all = -INFINITY;
    for (int w = 0; w < n_warps; ++w) m_all = fmax(m_all, sm_m[w * kRows + r]);
    const double m_ref = m_all == -INFINITY ? 0.0 : m_all;
    double f[kMaxWarps];
#pragma unroll
    for (int w = 0; w < kMaxWarps; ++w)  // independent: the exps overlap
      if (w < n_warps) f[w] = exp(sm_m[w * kRows + r] - m_ref);  // a warp without keys: m = -inf -> 0
    double total = 0.0;
#pragma unroll
    for (int w = 0; w < kMaxWarps; ++w)
      if (w < n_warps) {
        sm_w[w * kRows + r] = f[w];
        total += f[w] * sm_den[w * kRows + r];
      }
    sm_den[r] = total;  // warp 0's slot, read no more
    sm_m[r] = m_all;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D;
    const int t = 8 * (d / 64) + d % 8, col = d % 64 / 8;
    const int src = (t * 2 + (col & 1)) * 32 + r * 4 + (col >> 1);
    double o = 0.0;
    for (int w = 0; w < n_warps; ++w) o += sm_w[w * kRows + r] * sm_acc[w * NT * 64 + src];
    const int64_t row = static_cast<int64_t>(b) * p.n_q_heads + kvh * p.rep + row0 + r;
    if (p.splits == 1) {
      const double total = sm_den[r];
      p.out[row * D + d] = to_bf16_bits(o / (total > 0.0 ? total : 1.0));  // no key: acc = 0 -> 0
    } else {
      const int64_t part = row * p.splits + blockIdx.z;
      p.part_acc[part * D + d] = o;
      if (d == 0) {
        p.part_ml[part * 2] = sm_m[r];
        p.part_ml[part * 2 + 1] = sm_den[r];
      }
    }
  }
}

// Each warp streams its chunks (8 TILES keys, every W-th chunk of the split) through a ring of DEPTH shared-memory
// slots with cp.async, DEPTH - 1 chunks ahead of the one it computes. q.k runs SPLIT chains per key tile (a
// dependent fp64 mma takes ~188 cycles on the H200: short chains keep it fed), added at the end.
template <int D>
__global__ void __launch_bounds__(kMaxWarps * 32) decode_f64_mma_kernel(const Params p) {
  constexpr int QJ = D / 4;   // k4 steps of q.k (dims per lane)
  constexpr int NT = D / 8;   // output tiles of 8 dims (P.V's N side)
  constexpr int VU = NT / 8;  // 16-byte pieces of a lane's value dims
  constexpr int TILES = kTiles, SPLIT = kSplit, DEPTH = kDepth;
  constexpr int CH = 8 * TILES;
  constexpr int ROW_BYTES = 2 * D;
  constexpr int SLOT_BYTES = 2 * CH * ROW_BYTES;  // the chunk's K rows, then its V rows
  static_assert(DEPTH >= 2 && 8 % SPLIT == 0, "a ring of two or more slots; SPLIT divides a piece's 8 dims");
  if (p.pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (p.pdl == 1) asm volatile("griddepcontrol.launch_dependents;");
  }
  extern __shared__ double smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int b = blockIdx.x;
  const int kvh = blockIdx.y / p.groups, row0 = blockIdx.y % p.groups * kRows;
  const int rows = min(kRows, p.rep - row0);
  const int64_t slot = p.slot_ids[b];
  const int n = p.seq_lens[b];
  const int per = ((n + p.splits - 1) / p.splits + CH - 1) / CH * CH;
  const int lo = blockIdx.z * per, hi = min(lo + per, n);
  const uint16_t* kb = p.k + slot * p.sk_slot + kvh * p.sk_head;
  const uint16_t* vb = p.v + slot * p.sv_slot + kvh * p.sv_head;
  const unsigned char* ring = reinterpret_cast<const unsigned char*>(smem) + warp * DEPTH * SLOT_BYTES;
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  // chunk i's K / V rows into ring slot i % DEPTH: row r's 16-byte piece u at r ROW_BYTES + 16 (u ^ swizzle(r)),
  // K rows swizzled by (r & 1) << 2, V rows by ((r >> 1) & 3) << 1, so that the reads below are conflict-free.
  // Keys past hi: zeros (no read). Every lane commits one group per chunk, so wait_group counts chunks.
  auto stage = [&](int start, int i) {
    const uint32_t dst = ring_s + (i % DEPTH) * SLOT_BYTES;
    constexpr int PIECES = CH * ROW_BYTES / 16;  // of K (and of V)
#pragma unroll
    for (int it = 0; it < PIECES / 32; ++it) {
      const int idx = it * 32 + lane, r = idx / (ROW_BYTES / 16), u = idx % (ROW_BYTES / 16);
      const int key = start + r;
      const bool ok = key < hi;
      const int64_t kk = ok ? key : 0;
      cp_async16(dst + r * ROW_BYTES + 16 * (u ^ ((r & 1) << 2)), kb + kk * p.sk_seq + 8 * u, ok);
      cp_async16(dst + CH * ROW_BYTES + r * ROW_BYTES + 16 * (u ^ (((r >> 1) & 3) << 1)), vb + kk * p.sv_seq + 8 * u,
                 ok);
    }
    cp_async_commit();
  };
  const int first = lo + warp * CH, stride = n_warps * CH;
#pragma unroll
  for (int i = 0; i < DEPTH - 1; ++i) stage(first + i * stride, i);

  double qa[QJ];  // A operands of q.k: row g (zero past the group); step 8u + e is dim 8 (4u + c) + e
  {
    const uint16_t* qrow = p.q + b * p.sq_b + static_cast<int64_t>(kvh * p.rep + row0 + min(g, rows - 1)) * p.sq_h;
#pragma unroll
    for (int u = 0; u < QJ / 8; ++u) {
      const uint4 w = load16(qrow + 8 * (4 * u + c), g < rows);
#pragma unroll
      for (int e = 0; e < 8; ++e) qa[8 * u + e] = bf16_at(w, e);
    }
  }
  double m_run = -INFINITY, den = 0.0;  // row g's running max and sum (the same in the row's four lanes)
  double acc[NT][2];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = 0.0;

  int i = 0;
  for (int start = first; start < hi; start += stride, ++i) {
    stage(start + (DEPTH - 1) * stride, i + DEPTH - 1);
    cp_async_wait<DEPTH - 1>();  // this lane's copies of chunk i landed
    __syncwarp();                // and every lane's
    const unsigned char* ks = ring + (i % DEPTH) * SLOT_BYTES;
    const unsigned char* vs = ks + CH * ROW_BYTES;
    double s[TILES][SPLIT][2];
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
      for (int k = 0; k < SPLIT; ++k) s[t][k][0] = s[t][k][1] = 0.0;
#pragma unroll
    for (int u = 0; u < QJ / 8; ++u) {
      uint4 w[TILES];
#pragma unroll
      for (int t = 0; t < TILES; ++t) {
        const int r = 8 * t + g;
        w[t] = lds16(ks + r * ROW_BYTES + 16 * ((4 * u + c) ^ ((r & 1) << 2)));
      }
#pragma unroll
      for (int e = 0; e < 8; ++e)  // every chain once before any twice
#pragma unroll
        for (int t = 0; t < TILES; ++t) dmma(s[t][e % SPLIT][0], s[t][e % SPLIT][1], qa[8 * u + e], bf16_at(w[t], e));
    }
    double pw[TILES][2];
    const double alpha = softmax_chunk<TILES, SPLIT>(s, start, hi, c, p.scale, m_run, den, pw);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      acc[t][0] *= alpha;
      acc[t][1] *= alpha;
    }
    // P.V: k4 steps of keys 8 t + 2c + parity; output tile 8u + e takes the lane's value piece u, element e
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
      for (int par = 0; par < 2; ++par) {
        const int r = 8 * t + 2 * c + par;
#pragma unroll
        for (int u = 0; u < VU; ++u) {
          const uint4 w = lds16(vs + r * ROW_BYTES + 16 * ((8 * u + g) ^ (((r >> 1) & 3) << 1)));
#pragma unroll
          for (int e = 0; e < 8; ++e) dmma(acc[8 * u + e][0], acc[8 * u + e][1], pw[t][par], bf16_at(w, e));
        }
      }
    __syncwarp();  // the slot is refilled next
  }
  cp_async_wait<0>();
  merge_warps<D>(p, smem, acc, m_run, den, b, kvh, row0, rows);
}

// Shared memory of a launch: the warps' rings, or the merge's accumulators where larger (the same memory).
template <int D>
size_t smem_bytes(int warps) {
  const size_t merge = sizeof(double) * (static_cast<size_t>(warps) * (D / 8) * 64 + 3 * warps * kRows);
  const size_t ring = static_cast<size_t>(warps) * kDepth * 2 * 8 * kTiles * 2 * D;
  return merge > ring ? merge : ring;
}

template <int D>
int launch_one(const Params& p, int batch, int warps, cudaStream_t stream) {
  return minite_cuda::launch<decode_f64_mma_kernel<D>>(p, dim3(batch, p.n_q_heads / p.rep * p.groups, p.splits),
                                                      dim3(warps * 32), smem_bytes<D>(warps), p.pdl != 0, stream);
}

}  // namespace minite_attention

// Entry point (pointers and the stream as integers). -1: a shape or config the build does not take.
int64_t decode_attention_launch(int64_t q, int64_t k, int64_t v, int64_t slot_ids, int64_t seq_lens,
                                int64_t part_acc, int64_t part_ml, int64_t out, int64_t batch, int64_t n_q_heads,
                                int64_t rep, int64_t d, int64_t sq_b, int64_t sq_h, int64_t sk_slot,
                                int64_t sk_head, int64_t sk_seq, int64_t sv_slot, int64_t sv_head, int64_t sv_seq,
                                double scale, int64_t splits, int64_t warps, int64_t pdl, int64_t stream) {
  using namespace minite_attention;
  if (batch < 1 || rep < 1 || n_q_heads % rep || splits < 1 || warps < 1 || warps > kMaxWarps || pdl < 0 ||
      pdl > 2)
    return -1;
  Params p;
  p.q = reinterpret_cast<const uint16_t*>(q);
  p.k = reinterpret_cast<const uint16_t*>(k);
  p.v = reinterpret_cast<const uint16_t*>(v);
  p.slot_ids = reinterpret_cast<const int*>(slot_ids);
  p.seq_lens = reinterpret_cast<const int*>(seq_lens);
  p.part_acc = reinterpret_cast<double*>(part_acc);
  p.part_ml = reinterpret_cast<double*>(part_ml);
  p.out = reinterpret_cast<uint16_t*>(out);
  p.sq_b = sq_b;
  p.sq_h = sq_h;
  p.sk_slot = sk_slot;
  p.sk_head = sk_head;
  p.sk_seq = sk_seq;
  p.sv_slot = sv_slot;
  p.sv_head = sv_head;
  p.sv_seq = sv_seq;
  p.scale = scale;
  p.n_q_heads = static_cast<int>(n_q_heads);
  p.rep = static_cast<int>(rep);
  p.groups = static_cast<int>((rep + kRows - 1) / kRows);
  p.splits = static_cast<int>(splits);
  p.pdl = static_cast<int>(pdl);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int b = static_cast<int>(batch), w = static_cast<int>(warps);
  if (d == 64) return launch_one<64>(p, b, w, s);
  if (d == 128) return launch_one<128>(p, b, w, s);
  return -1;
}
