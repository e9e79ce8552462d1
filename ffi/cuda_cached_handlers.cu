// XLA FFI handlers of engram_cached_lookup on CUDA (visiting order, dedup
// and the HBM hot-row cache, kernels/dedup.cuh) and of its prefetch pair,
// kept apart from the plain lookup and prefetch handlers.
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "cuda_adapter.h"
#include "dedup_adapter.h"
#include "dedup_cuda.h"
#include "dedup_handlers.h"
#include "handler_guard.h"
#include "kernels/dedup.cuh"
#include "kernels/prefetch_stream.cuh"
#include "prefetch_cuda.h"

namespace engram {

ffi::Error RunCachedLookupCuda(cudaStream_t stream, const CachedLookupCall& call, ffi::Buffer<ffi::S32> ids,
                               ffi::ResultBuffer<ffi::BF16> out) {
  DedupGatherParams params;
  CacheLease lease;
  if (ffi::Error err = PrepareCachedLookup(call, ids, out, GpuCanRead, "CUDA", &params, &lease); err.failure()) {
    ReleaseCache(&lease, nullptr);
    return err;
  }
  const cudaError_t launched = LaunchDedupLookup(params, CudaMaxCtas(call.max_ctas), stream);
  // The fence goes on the stream even after a failed launch: whatever was queued before it is covered.
  const std::string fence_error = ReleaseCache(&lease, stream);
  if (launched != cudaSuccess) return CudaError("cached lookup launch", launched);
  if (!fence_error.empty()) return ffi::Error::Internal("engram_jax cached lookup: " + fence_error);
  return ffi::Error::Success();
}

namespace {

ffi::Error CachedLookupCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::U8> workspace,
                                int64_t table_key, int64_t dim, int64_t max_ctas, int64_t order, int64_t cache_key) {
  const CachedLookupCall call =
      MakeCachedLookupCall(device_ordinal, table_key, dim, max_ctas, order, cache_key, workspace);
  return RunCachedLookupCuda(stream, call, ids, out);
}

// The same work forked onto the prefetch side stream, so it overlaps with the
// model; done waits for it on XLA's stream and keeps ids and workspace alive
// until then. Under stream capture it runs on `stream` itself (see
// EnqueuePrefetch for why).
ffi::Error CachedLookupStartCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                     ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::U8> workspace,
                                     int64_t table_key, int64_t dim, int64_t max_ctas, int64_t order, int64_t cache_key,
                                     int64_t slot) {
  const CachedLookupCall call =
      MakeCachedLookupCall(device_ordinal, table_key, dim, max_ctas, order, cache_key, workspace);
  bool capturing = false;
  if (cudaError_t err = IsCapturing(stream, &capturing); err != cudaSuccess) {
    return CudaError("cached lookup_start: capture status", err);
  }
  if (capturing) return RunCachedLookupCuda(stream, call, ids, out);
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(device_ordinal, &dev); err != cudaSuccess) {
    return CudaError("cached lookup_start: side stream setup", err);
  }
  std::lock_guard<std::mutex> lock(dev->mutex());
  if (cudaError_t err = cudaEventRecord(dev->fork(), stream); err != cudaSuccess) {
    return CudaError("cached lookup_start: fork", err);
  }
  if (cudaError_t err = cudaStreamWaitEvent(dev->side(), dev->fork(), cudaEventWaitDefault); err != cudaSuccess) {
    return CudaError("cached lookup_start: fork", err);
  }
  if (ffi::Error err = RunCachedLookupCuda(dev->side(), call, ids, out); err.failure()) return err;
  if (cudaError_t err = cudaEventRecord(dev->done(slot), dev->side()); err != cudaSuccess) {
    return CudaError("cached lookup_start: completion event", err);
  }
  return ffi::Error::Success();
}

ffi::Error CachedLookupDoneCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::BF16> rows,
                                    ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::U8> /*workspace*/,
                                    ffi::ResultBuffer<ffi::BF16> out, int64_t slot) {
  return WaitForPrefetchCuda("cached lookup_done", stream, device_ordinal, rows, ids, out, slot);
}

}  // namespace
}  // namespace engram

// Not marked command-buffer compatible on purpose: each run resolves the
// table and the cache's active buffer set again, so a cache refresh takes
// effect without recompiling.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupCuda, engram::NoThrow<engram::CachedLookupCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table and cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows: ids.shape + (dim,)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()          // workspace for the sort
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas")                      // grid size; <= 0: every SM
                                  .Attr<int64_t>("order")                         // VisitOrder: plain, sorted, dedup
                                  .Attr<int64_t>("cache_key"));                   // hot-row cache key, 0: none

// Start is not command-buffer compatible and done is, for the plain prefetch's
// reasons (cuda_prefetch_handlers.cu).
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupStartCuda, engram::NoThrow<engram::CachedLookupStartCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: the fork point
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table and cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows, written on the side stream
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()          // workspace for the sort
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas")                      // grid size; <= 0: every SM
                                  .Attr<int64_t>("order")                         // VisitOrder: plain, sorted, dedup
                                  .Attr<int64_t>("cache_key")                     // hot-row cache key, 0: none
                                  .Attr<int64_t>("slot"));                        // completion event of this site

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupDoneCuda, engram::NoThrow<engram::CachedLookupDoneCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: waits here
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // whose completion events
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows written by start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids, kept alive until here
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()          // workspace, kept alive until here
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // the rows (aliases operand 0)
                                  .Attr<int64_t>("slot"),                         // completion event to wait on
                              {xla::ffi::Traits::kCmdBufferCompatible});
