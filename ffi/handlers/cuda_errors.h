// A CUDA error as the ffi::Error a CUDA handler returns, worded the same way by
// every handler: "engram_jax <what>: <error name>: <error string>". Only
// compiled into builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace engram {

namespace ffi = xla::ffi;

inline std::string CudaErrorMessage(const std::string& what, cudaError_t err) {
  return "engram_jax " + what + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

inline ffi::Error CudaError(const std::string& what, cudaError_t err) {
  return ffi::Error::Internal(CudaErrorMessage(what, err));
}

// A call site's staging comes from CUDA's stream-ordered pool, outside XLA's BFC
// pool, which keeps what it once held: where that pool has grown over most of the
// GPU, the site's allocation is what fails, and the error says how to leave room.
inline ffi::Error StagingError(const std::string& what, cudaError_t err, int64_t bytes) {
  std::string message = CudaErrorMessage(what + " (" + std::to_string(bytes) + " bytes)", err);
  if (err == cudaErrorMemoryAllocation) {
    message +=
        "; call sites' staging is allocated outside XLA's memory pool, which may grow to "
        "XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU (0.75 by default): lower it, or drop the "
        "compiled functions of finished call sites, to leave room";
  }
  return ffi::Error::Internal(message);
}

}  // namespace engram
