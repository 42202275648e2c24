// A chain-fed dense decode GEMM (an experiment, not used by minite): per 16 weight rows, P producer warps decode
// the fragment-order weight codes and the tokens of whole K steps into a ring of D shared-memory slots, and one
// consumer warp runs the contract's mma chain on them (pieces 0..7 of each step, step after step, one fp32
// accumulator per n8 token tile): the same fp16 fragments in the same order as kernels/decode_gemm.cu, so the same
// bits. It asks whether moving the decode off the chain's warp makes M <= 16 faster; the answer, with clock64
// traces of where a step's time goes, is in docs/KERNELS_NOTES.md ("A chain-fed dense decode GEMM, measured").
//
// Handoff: one full / empty mbarrier pair per U consecutive steps (a unit); producer pi takes units pi, pi + P, ...
// and holds the raw bytes of its next two steps in registers (loaded two steps ahead). The first two steps'
// weight loads are issued before the barriers are initialised; with PDL the tokens and the global scales are
// read only after griddepcontrol.wait. Built and run by tools/decode_gemm_ws.py, which pastes in the device
// helpers of decode_gemm.cu (up to its host side) before this file.
namespace ws {
using namespace minite_decode;

struct WsParams {
  const uint8_t* a_codes;
  const uint8_t* a_scales;
  const float* ga;
  const uint8_t* w_frag;
  const uint8_t* w_scales;
  const float* gw;
  const float* bias;
  void* out;
  int M, N, K, ga_row, gw_row, out_kind;
  long long* trace;  // CTA 0's per-step clocks, or null
  int pdl;
};

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ long long clk() { long long c; asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory"); return c; }
__device__ __forceinline__ uint4 ld_stream4(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}
__device__ __forceinline__ uint2 ld_stream2(const void* ptr) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}
__device__ __forceinline__ uint4 ld_tok4(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}
__device__ __forceinline__ uint2 ld_tok2(const void* ptr) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}
__device__ __forceinline__ void st_shared4(uint32_t addr, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
__device__ __forceinline__ uint4 ld_shared4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// one K step's raw bytes, as a producer lane loads them (weights: fragment order, see weights.fragment_order)
template <int NT>
struct Raw {
  uint4 lo, hi;   // fragment-order codes: the lane's first and second 16 bytes
  uint2 sc[2];    // scale bytes of rows g, g + 8
  uint4 tc[NT][4];  // the 64 code bytes of token row 8 jt + g
  uint2 ts[NT];     // its 8 scale bytes
};

constexpr int kASlot = 8 * 32 * 16;  // 4 KB: eight pieces x 32 lanes x 4 words
constexpr int kBTile = 4 * 32 * 16;  // 2 KB per n8 tile: four piece pairs x 32 lanes x 4 words

// the wait is decode_gemm.cu's pdl_wait (without its trigger); the trigger comes at the end of each role
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// NT n8 token tiles (one chain each), P producer warps, D ring slots (one K step each), U steps per handoff
// (one full / empty barrier pair per U consecutive steps: the consumer waits once per unit)
template <int NT, int P, int D, int U>
__global__ void __launch_bounds__(32 * (P + 1)) ws_kernel(const WsParams p) {
  static_assert(D % U == 0, "units tile the ring");
  constexpr int NB = D / U;  // barrier pairs
  extern __shared__ __align__(16) uint8_t smem[];
  const long long t_start = clk();
  long long* tr = (p.trace != nullptr && blockIdx.x == 0 && (threadIdx.x & 31) == 0) ? p.trace + (threadIdx.x >> 5) * 64 * 4 : nullptr;
  auto mark = [&](int s, int i) { if (tr != nullptr && s < 64) tr[s * 4 + i] = clk() - t_start; };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int nsteps = p.K >> 7;
  const size_t kh = p.K >> 1, ks = p.K >> 4;
  const int row0 = blockIdx.x * 16;
  const int m0 = blockIdx.y * 8 * NT;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t ring_a = base, ring_b = base + D * kASlot;
  const uint32_t full = ring_b + D * NT * kBTile, empty = full + 8 * NB;

  if (warp > 0) {  // producer pi: units pi, pi + P, ... (own step i: unit (i / U) P + pi, its step i % U)
    const int pi = warp - 1;
    auto step_of = [&](int i) { return ((i / U) * P + pi) * U + i % U; };
    const uint8_t* wc = p.w_frag + static_cast<size_t>(row0) * kh + 16 * lane;
    const uint8_t* ws0 = p.w_scales + static_cast<size_t>(row0 + g) * ks;
    const uint8_t* ws1 = ws0 + 8 * ks;
    const uint8_t* tc[NT];
    const uint8_t* tsp[NT];
    bool live[NT];
#pragma unroll
    for (int jt = 0; jt < NT; ++jt) {
      const int m = m0 + 8 * jt + g;
      live[jt] = m < p.M;
      tc[jt] = p.a_codes + static_cast<size_t>(live[jt] ? m : 0) * kh;
      tsp[jt] = p.a_scales + static_cast<size_t>(live[jt] ? m : 0) * ks;
    }
    auto load_w = [&](Raw<NT>& r, int s) {
      if (s < nsteps) {
        r.lo = ld_stream4(wc + static_cast<size_t>(s) * 1024);
        r.hi = ld_stream4(wc + static_cast<size_t>(s) * 1024 + 512);
        r.sc[0] = ld_stream2(ws0 + s * 8);
        r.sc[1] = ld_stream2(ws1 + s * 8);
      }
    };
    auto load_t = [&](Raw<NT>& r, int s) {
      if (s < nsteps) {
#pragma unroll
        for (int jt = 0; jt < NT; ++jt) {
          if (live[jt]) {
#pragma unroll
            for (int q = 0; q < 4; ++q) r.tc[jt][q] = ld_tok4(tc[jt] + s * 64 + 16 * q);
            r.ts[jt] = ld_tok2(tsp[jt] + s * 8);
          } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) r.tc[jt][q] = make_uint4(0, 0, 0, 0);
            r.ts[jt] = make_uint2(0, 0);
          }
        }
      }
    };
    // the first two own steps' weights stream in before anything else (no barrier, no previous kernel needed)
    Raw<NT> r0, r1;
    load_w(r0, step_of(0));
    load_w(r1, step_of(1));
    if (threadIdx.x == 32) {
      for (int i = 0; i < NB; ++i) {
        mbar_init(full + 8 * i, 32);
        mbar_init(empty + 8 * i, 32);
      }
    }
    __syncthreads();
    bool waited = !p.pdl;
    if (!waited) pdl_wait(waited, false);  // the tokens may be the previous kernel's output
    load_t(r0, step_of(0));
    load_t(r1, step_of(1));
    // where lane t's u16s sit in a 16-byte piece: u16 t (positions 2t, 2t+1) and u16 4 + t (2t+8, 2t+9)
    const uint32_t sel = (t & 1) ? 0x7632u : 0x5410u;
    auto process = [&](const Raw<NT>& r, int s) {
      StepWords w;
      w.x[0][0] = r.lo.x, w.x[0][1] = r.lo.y, w.x[1][0] = r.lo.z, w.x[1][1] = r.lo.w;
      w.x[2][0] = r.hi.x, w.x[2][1] = r.hi.y, w.x[3][0] = r.hi.z, w.x[3][1] = r.hi.w;
      w.sc[0] = r.sc[0], w.sc[1] = r.sc[1];
      uint32_t a[8][4];
      decode_step<true>(w, a);
      mark(s, 0);
      uint32_t b[NT][8][2];
#pragma unroll
      for (int jt = 0; jt < NT; ++jt) {
        __half2 sp[4];
        scale_pairs(r.ts[jt].x, sp[0], sp[1]);
        scale_pairs(r.ts[jt].y, sp[2], sp[3]);
#pragma unroll
        for (int pc = 0; pc < 4; ++pc) {
          const uint4 c = r.tc[jt][pc];
          const uint32_t lo16 = (t & 2) ? c.y : c.x, hi16 = (t & 2) ? c.w : c.z;
          const uint32_t x = __byte_perm(lo16, hi16, sel);
          const uint32_t lo = low_nibbles(x), hi = high_nibbles(x);
          const __half s_a = __low2half(sp[pc]), s_b = __high2half(sp[pc]);
          b[jt][pc][0] = scaled(pair01(lo), s_a);
          b[jt][pc][1] = scaled(pair23(lo), s_b);
          b[jt][4 + pc][0] = scaled(pair01(hi), s_a);
          b[jt][4 + pc][1] = scaled(pair23(hi), s_b);
        }
      }
      const int unit = s / U, bar = unit % NB;
      mark(s, 1);
      if (s % U == 0) mbar_wait(empty + 8 * bar, ((unit / NB) + 1) & 1);  // the unit's slots are free
      mark(s, 2);
      const int slot = s % D;
      const uint32_t sa = ring_a + slot * kASlot + 16 * lane;
#pragma unroll
      for (int pc = 0; pc < 8; ++pc) st_shared4(sa + pc * 512, a[pc][0], a[pc][1], a[pc][2], a[pc][3]);
      const uint32_t sb = ring_b + slot * NT * kBTile + 16 * lane;
#pragma unroll
      for (int jt = 0; jt < NT; ++jt)
#pragma unroll
        for (int q = 0; q < 4; ++q)
          st_shared4(sb + jt * kBTile + q * 512, b[jt][2 * q][0], b[jt][2 * q][1], b[jt][2 * q + 1][0],
                     b[jt][2 * q + 1][1]);
      if (s % U == U - 1 || s + 1 == nsteps) mbar_arrive(full + 8 * bar);  // the unit's last step
      mark(s, 3);
    };
#pragma unroll 1
    for (int i = 0; step_of(i) < nsteps; i += 2) {
      {
        const Raw<NT> cur = r0;
        load_w(r0, step_of(i + 2));
        load_t(r0, step_of(i + 2));
        process(cur, step_of(i));
      }
      if (step_of(i + 1) < nsteps) {
        const Raw<NT> cur = r1;
        load_w(r1, step_of(i + 3));
        load_t(r1, step_of(i + 3));
        process(cur, step_of(i + 1));
      }
    }
    if (p.pdl) grid_launch_dependents();
    return;
  }

  __syncthreads();  // the barriers are initialised (by the first producer)
  // consumer: the chain, pieces 0..7 of every step in order, each n8 tile its own accumulator
  float acc[NT][4];
#pragma unroll
  for (int jt = 0; jt < NT; ++jt)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[jt][r] = 0.0f;
  uint4 A0[8], A1[8], B0[NT][4], B1[NT][4];
  auto fetch = [&](uint4 (&A)[8], uint4 (&B)[NT][4], int s) {
    const int slot = s % D;
    if (s % U == 0) {
      const int unit = s / U;
      mark(s, 0);
      mbar_wait(full + 8 * (unit % NB), (unit / NB) & 1);
      mark(s, 1);
    }
    const uint32_t sa = ring_a + slot * kASlot + 16 * lane;
#pragma unroll
    for (int pc = 0; pc < 8; ++pc) A[pc] = ld_shared4(sa + pc * 512);
    const uint32_t sb = ring_b + slot * NT * kBTile + 16 * lane;
#pragma unroll
    for (int jt = 0; jt < NT; ++jt)
#pragma unroll
      for (int q = 0; q < 4; ++q) B[jt][q] = ld_shared4(sb + jt * kBTile + q * 512);
  };
  auto chain = [&](const uint4 (&A)[8], const uint4 (&B)[NT][4], int pc0) {
#pragma unroll
    for (int pc = pc0; pc < pc0 + 4; ++pc)
#pragma unroll
      for (int jt = 0; jt < NT; ++jt) {
        const uint32_t a[4] = {A[pc].x, A[pc].y, A[pc].z, A[pc].w};
        const uint4 bq = B[jt][pc >> 1];
        if (pc & 1) mma16816(acc[jt], a, bq.z, bq.w);
        else mma16816(acc[jt], a, bq.x, bq.y);
      }
  };
  auto release = [&](int s) {  // after the unit's last step: its slots may be refilled
    if (s % U == U - 1 || s + 1 == nsteps) mbar_arrive(empty + 8 * ((s / U) % NB));
  };
  fetch(A0, B0, 0);
  // epilogue operands now (their loads run under the chain); indices clamped: one load each, no reloads
  bool waited = !p.pdl;
  if (!waited) pdl_wait(waited, false);  // ga may be the previous kernel's output
  const int n_a = row0 + g, n_b = n_a + 8;
  const float gw_a = p.gw[p.gw_row ? n_a : 0], gw_b = p.gw[p.gw_row ? n_b : 0];
  const bool has_bias = p.bias != nullptr;
  const float bias_a = has_bias ? p.bias[n_a] : 0.0f, bias_b = has_bias ? p.bias[n_b] : 0.0f;
  float ga_m[NT][2];
#pragma unroll
  for (int jt = 0; jt < NT; ++jt)
#pragma unroll
    for (int h = 0; h < 2; ++h) ga_m[jt][h] = p.ga[p.ga_row ? min(m0 + 8 * jt + 2 * t + h, p.M - 1) : 0];
#pragma unroll 1
  for (int s = 0; s < nsteps; s += 2) {
    mark(s, 2);
    chain(A0, B0, 0);
    if (s + 1 < nsteps) fetch(A1, B1, s + 1);
    chain(A0, B0, 4);
    release(s);
    if (s + 1 >= nsteps) break;
    mark(s + 1, 2);
    chain(A1, B1, 0);
    if (s + 2 < nsteps) fetch(A0, B0, s + 2);
    chain(A1, B1, 4);
    release(s + 1);
  }
  mark(nsteps < 64 ? nsteps : 63, 3);
#pragma unroll
  for (int jt = 0; jt < NT; ++jt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int m = m0 + 8 * jt + 2 * t + (r & 1);
      if (m >= p.M) continue;
      const int n = r < 2 ? n_a : n_b;
      const float v = epilogue(acc[jt][r], ga_m[jt][r & 1], r < 2 ? gw_a : gw_b, has_bias, r < 2 ? bias_a : bias_b);
      const size_t o = static_cast<size_t>(m) * p.N + n;
      if (p.out_kind == 0) reinterpret_cast<__nv_bfloat16*>(p.out)[o] = __float2bfloat16_rn(v);
      else if (p.out_kind == 1) reinterpret_cast<__half*>(p.out)[o] = __float2half_rn(v);
      else reinterpret_cast<float*>(p.out)[o] = v;
    }
  if (p.pdl) grid_launch_dependents();
}
}  // namespace ws

template <int NT, int P, int U>
int ws_launch_one(const ws::WsParams& p, cudaStream_t stream) {
  constexpr int D = 8;
  const size_t smem = D * (ws::kASlot + NT * ws::kBTile) + 16 * (D / U);
  dim3 grid(p.N / 16, (p.M + 8 * NT - 1) / (8 * NT));
  return minite_cuda::launch<ws::ws_kernel<NT, P, D, U>>(p, grid, dim3(32 * (P + 1)), smem, p.pdl != 0, stream);
}
// variant: 10 * producers + steps per handoff
template <int NT>
int ws_launch_v(const ws::WsParams& p, int v, cudaStream_t s) {
  switch (v) {
    case 21: return ws_launch_one<NT, 2, 1>(p, s);
    case 22: return ws_launch_one<NT, 2, 2>(p, s);
    case 24: return ws_launch_one<NT, 2, 4>(p, s);
    case 31: return ws_launch_one<NT, 3, 1>(p, s);
    case 32: return ws_launch_one<NT, 3, 2>(p, s);
    case 34: return ws_launch_one<NT, 3, 4>(p, s);
  }
  return -1;
}
int64_t ws_gemm_launch(int64_t a_codes, int64_t a_scales, int64_t ga, int64_t w_frag, int64_t w_scales, int64_t gw,
                       int64_t bias, int64_t out, int64_t M, int64_t N, int64_t K, int64_t ga_row, int64_t gw_row,
                       int64_t out_kind, int64_t nt, int64_t variant, int64_t pdl, int64_t trace, int64_t stream) {
  ws::WsParams p;
  p.trace = reinterpret_cast<long long*>(trace);
  p.a_codes = reinterpret_cast<const uint8_t*>(a_codes);
  p.a_scales = reinterpret_cast<const uint8_t*>(a_scales);
  p.ga = reinterpret_cast<const float*>(ga);
  p.w_frag = reinterpret_cast<const uint8_t*>(w_frag);
  p.w_scales = reinterpret_cast<const uint8_t*>(w_scales);
  p.gw = reinterpret_cast<const float*>(gw);
  p.bias = reinterpret_cast<const float*>(bias);
  p.out = reinterpret_cast<void*>(out);
  p.M = M, p.N = N, p.K = K, p.ga_row = ga_row, p.gw_row = gw_row, p.out_kind = out_kind, p.pdl = pdl;
  if (N % 16 || K % 128 || M < 1 || M > 8 * nt) return -1;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (nt == 1) return ws_launch_v<1>(p, variant, s);
  if (nt == 2) return ws_launch_v<2>(p, variant, s);
  return -1;
}
