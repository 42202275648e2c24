// What both CUDA kernels (decode_gemm.cu, decode_attention.cu) share: cp.async group control, and the host side of
// a launch (the dynamic shared memory opt-in, programmatic dependent launch). ``_cuda_build`` pastes this file in
// where a kernel source includes it, so an extension's build hash covers it; nvcc run on a kernel file directly
// (``sm90_compile``) finds it beside the file.
#ifndef MINITE_CUDA_COMMON_CUH
#define MINITE_CUDA_COMMON_CUH
#include <cstddef>
#include <cuda_runtime.h>

namespace minite_cuda {

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Kernel(p) on grid x block with smem bytes of dynamic shared memory. pdl: programmatic stream serialization (the
// kernel may start before the one before it ends; it waits inside, at griddepcontrol.wait). Above 48 KB the
// kernel's limit is raised once per size and device, so a launch inside a CUDA graph capture (after a warm-up
// call) makes no attribute call. Returns a cudaError_t (an error is not left for the next launch's check), or -1
// for a device index the table does not hold.
template <auto Kernel, typename P>
int launch(const P& p, dim3 grid, dim3 block, size_t smem, bool pdl, cudaStream_t stream) {
  static size_t raised[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return -1;
  if (smem > 48 * 1024 && smem > raised[dev]) {
    cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) {
      cudaGetLastError();
      return static_cast<int>(err);
    }
    raised[dev] = smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&cfg, Kernel, p);
  return static_cast<int>(err != cudaSuccess ? err : cudaGetLastError());
}

}  // namespace minite_cuda

#endif  // MINITE_CUDA_COMMON_CUH
