// XLA FFI handler of engram_lookup on CUDA, kept apart from the prefetch and
// cached-lookup handlers: decode the call, resolve the table for this device,
// launch the framework-free gather from kernels/ on XLA's stream, and turn
// any CUDA error into an ffi::Error.
#include <cuda_runtime.h>

#include "cuda_adapter.h"
#include "cuda_handlers.h"
#include "handler_guard.h"
#include "kernels/gather.cuh"
#include "lookup_adapter.h"

namespace engram {
namespace {

ffi::Error LookupCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                          ffi::ResultBuffer<ffi::BF16> out, int64_t table_key, int64_t dim, int64_t max_ctas) {
  GatherParams params;
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, out, GpuCanRead, "CUDA", &params);
      err.failure()) {
    return err;
  }
  if (cudaError_t err = LaunchGather(params, CudaMaxCtas(max_ctas), stream); err != cudaSuccess) {
    return CudaError("lookup launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupCuda, engram::NoThrow<engram::LookupCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows: ids.shape + (dim,)
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas"));                    // grid size; <= 0: every SM
