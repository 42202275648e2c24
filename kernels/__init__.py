"""minite.kernels: Triton NVFP4 kernels (quantize, nvfp4_gemm, grouped_nvfp4_gemm)."""
