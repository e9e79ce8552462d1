// XLA FFI handler of engram_cached_lookup on CUDA (visiting order, dedup and
// the HBM hot-row cache, kernels/dedup.cuh), and the launch it shares with the
// asynchronous lookup's start (cuda_prefetch_handlers.cu).
#include <cuda_runtime.h>

#include <string>

#include "cuda_adapter.h"
#include "dedup_adapter.h"
#include "dedup_cuda.h"
#include "dedup_handlers.h"
#include "handler_guard.h"
#include "kernels/dedup.cuh"

namespace engram {

ffi::Error LaunchCachedLookupCuda(const DedupGatherParams& params, CacheLease* lease, int max_ctas,
                                  cudaStream_t stream) {
  const cudaError_t launched = LaunchDedupLookup(params, max_ctas, stream);
  // The fence goes on the stream even after a failed launch: whatever was queued before it is covered.
  const std::string fence_error = ReleaseCache(lease, stream);
  if (launched != cudaSuccess) return CudaError("cached lookup launch", launched);
  if (!fence_error.empty()) return ffi::Error::Internal("engram_jax cached lookup: " + fence_error);
  return ffi::Error::Success();
}

namespace {

ffi::Error CachedLookupCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::U8> workspace,
                                int64_t table_key, int64_t dim, int64_t max_ctas, int64_t order, int64_t cache_key) {
  const CachedLookupCall call =
      MakeCachedLookupCall(device_ordinal, table_key, dim, max_ctas, order, cache_key, workspace->typed_data(),
                           static_cast<int64_t>(workspace->element_count()));
  DedupGatherParams params;
  CacheLease lease;
  if (ffi::Error err = PrepareCachedLookup(call, ids, out, GpuCanRead, "CUDA", &params, &lease); err.failure()) {
    ReleaseCache(&lease, nullptr);
    return err;
  }
  return LaunchCachedLookupCuda(params, &lease, CudaMaxCtas(call.max_ctas), stream);
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
