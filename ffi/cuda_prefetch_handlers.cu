// XLA FFI handlers of lookup_start / lookup_done (asynchronous prefetch) on
// CUDA, kept apart from the plain lookup: start forks the gather onto the
// device's shared side stream (kernels/prefetch_stream.cuh) after the ids are
// ready on XLA's stream and records the call site's slot event; done waits on it.
#include <cuda_runtime.h>

#include "cuda_adapter.h"
#include "handler_guard.h"
#include "kernels/prefetch_stream.cuh"
#include "lookup_adapter.h"
#include "prefetch_cuda.h"
#include "prefetch_handlers.h"

namespace engram {
namespace {

ffi::Error LookupStartCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                               ffi::ResultBuffer<ffi::BF16> rows, int64_t table_key, int64_t dim, int64_t max_ctas,
                               int64_t slot) {
  GatherParams params;
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, rows, GpuCanRead, "CUDA", &params);
      err.failure()) {
    return err;
  }
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(device_ordinal, &dev); err != cudaSuccess) {
    return CudaError("lookup_start: side stream setup", err);
  }
  if (cudaError_t err = EnqueuePrefetch(*dev, params, CudaMaxCtas(max_ctas), stream, slot); err != cudaSuccess) {
    return CudaError("lookup_start launch", err);
  }
  return ffi::Error::Success();
}

ffi::Error LookupDoneCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::BF16> rows,
                              ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out, int64_t slot) {
  return WaitForPrefetchCuda("lookup_done", stream, device_ordinal, rows, ids, out, slot);
}

}  // namespace
}  // namespace engram

// Start is not command-buffer compatible: its gather outlives the call, which a
// captured graph would have to join inside itself, so XLA runs it between its
// graphs. Done is: captured, its wait is an external event-wait node that each
// graph launch resolves to the gather the start before it forked
// (kernels/prefetch_stream.cuh), so the layers after it need not leave the graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupStartCuda, engram::NoThrow<engram::LookupStartCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: the fork point
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows, written on the side stream
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas")                      // grid size; <= 0: every SM
                                  .Attr<int64_t>("slot"));                        // completion event of this site

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupDoneCuda, engram::NoThrow<engram::LookupDoneCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: waits here
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // whose completion events
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows written by start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids, kept alive until here
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // the rows (aliases operand 0)
                                  .Attr<int64_t>("slot"),                         // completion event to wait on
                              {xla::ffi::Traits::kCmdBufferCompatible});
