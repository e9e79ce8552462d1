// XLA FFI handlers for CUDA. Thin adapters: decode the call, resolve the
// table for this device, launch the framework-free gather from kernels/ on
// XLA's stream, and turn any CUDA error into an ffi::Error.
#include <cuda_runtime.h>

#include <string>

#include "cuda_handlers.h"
#include "kernels/gather.cuh"
#include "lookup_adapter.h"

namespace engram {
namespace {

bool GpuCanRead(MemoryKind kind) { return kind != MemoryKind::kHost; }

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("engram_jax ") + what + ": " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

ffi::Error LookupCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                          ffi::ResultBuffer<ffi::BF16> out, int64_t table_key, int64_t dim,
                          int64_t max_ctas) {
  GatherParams params;
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, out, GpuCanRead, "CUDA", &params);
      err.failure()) {
    return err;
  }
  if (cudaError_t err = LaunchGather(params, static_cast<int>(max_ctas), stream); err != cudaSuccess) {
    return CudaError("lookup launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace

}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupCuda, engram::LookupCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows: ids.shape + (dim,)
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas"));                    // grid size; <= 0: every SM
