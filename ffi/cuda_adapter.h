// Shared by every CUDA FFI handler: a CUDA error as an ffi::Error, and the
// int64 max_ctas attribute as the int grid cap the launchers take, decided in
// one place. Only compiled into builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace engram {

namespace ffi = xla::ffi;

inline ffi::Error CudaError(const std::string& what, cudaError_t err) {
  return ffi::Error::Internal("engram_jax " + what + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// <= 0 asks for the full grid (0 to the launchers); a cap past INT_MAX is no
// cap at all (INT_MAX: the launchers never use more CTAs than there are tiles).
inline int CudaMaxCtas(int64_t max_ctas) {
  if (max_ctas <= 0) return 0;
  return max_ctas > INT_MAX ? INT_MAX : static_cast<int>(max_ctas);
}

}  // namespace engram
