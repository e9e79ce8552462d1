// ENGRAM_HD marks a function that the CPU code and the CUDA kernels share
// verbatim (the row decode, the cache probe, the n-gram hash): inlined on the
// host, and __host__ __device__ __forceinline__ under nvcc.
#pragma once

#if defined(__CUDACC__)
#define ENGRAM_HD __host__ __device__ __forceinline__
#else
#define ENGRAM_HD inline
#endif
