// A CUDA error as the ffi::Error a CUDA handler returns, worded the same way by
// every handler: "engram_jax <what>: <error name>: <error string>". Only
// compiled into builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace engram {

namespace ffi = xla::ffi;

inline ffi::Error CudaError(const std::string& what, cudaError_t err) {
  return ffi::Error::Internal("engram_jax " + what + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace engram
