// CUDA launcher for the Engram n-gram hash (kernels/ngram_hash.h): one thread
// per output element (token, layer, column), so neighbouring threads share a
// token's window loads and the int32 stores coalesce. No XLA types; the
// launcher returns cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ngram_hash.h"

namespace engram {

constexpr int kHashThreads = 256;
// A grid-stride loop past this many CTAs: any batch fits the grid limits.
constexpr int64_t kMaxHashCtas = 1 << 16;

// static: this header may be included by more than one translation unit.
static __global__ void __launch_bounds__(kHashThreads) NgramHashKernel(NgramHashParams p, int64_t elements) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < elements;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    HashElement(p, e);
  }
}

// Launches nothing for an empty batch. Static because it names the static kernel.
static inline cudaError_t LaunchNgramHash(const NgramHashParams& p, cudaStream_t stream) {
  const int64_t elements = p.num_tokens * p.num_layers * p.num_cols;
  if (elements == 0) return cudaSuccess;
  int64_t ctas = (elements + kHashThreads - 1) / kHashThreads;
  if (ctas > kMaxHashCtas) ctas = kMaxHashCtas;
  NgramHashKernel<<<static_cast<unsigned>(ctas), kHashThreads, 0, stream>>>(p, elements);
  return cudaGetLastError();
}

}  // namespace engram
