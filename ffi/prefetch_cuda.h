// The CUDA half of the prefetch adapter (prefetch_adapter.h holds the checks
// shared with the CPU): the one body of both CUDA done handlers, lookup_done
// and cached_lookup_done. Only compiled into builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_adapter.h"
#include "kernels/prefetch_stream.cuh"
#include "prefetch_adapter.h"

namespace engram {

// Makes XLA's `stream` wait for the start recorded under `slot`, then hands
// the rows back: the output aliases the rows operand, so they are copied only
// if XLA ever hands a separate buffer. `what` names the handler in errors.
inline ffi::Error WaitForPrefetchCuda(const std::string& what, cudaStream_t stream, int32_t device_ordinal,
                                      ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::S32> ids,
                                      ffi::ResultBuffer<ffi::BF16> out, int64_t slot) {
  if (ffi::Error err = CheckDoneBuffers(rows, ids, out); err.failure()) return err;
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(device_ordinal, &dev); err != cudaSuccess) {
    return CudaError(what + ": side stream setup", err);
  }
  if (cudaError_t err = WaitPrefetch(*dev, stream, slot); err != cudaSuccess) {
    return CudaError(what + " wait", err);
  }
  if (out->untyped_data() != rows.untyped_data() && rows.size_bytes() > 0) {
    if (cudaError_t err = cudaMemcpyAsync(out->untyped_data(), rows.untyped_data(), rows.size_bytes(),
                                          cudaMemcpyDeviceToDevice, stream);
        err != cudaSuccess) {
      return CudaError(what + " copy", err);
    }
  }
  return ffi::Error::Success();
}

}  // namespace engram
