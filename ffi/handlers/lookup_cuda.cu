// XLA FFI handlers of the synchronous lookup on CUDA: engram_lookup (the plain
// gather, kernels/gather.cuh), engram_cached_lookup (order, dedup and the HBM
// hot-row cache, kernels/dedup.cuh) and engram_lookup_records (the same,
// returning packed records for a packed exchange). Each decodes the call,
// launches on XLA's stream and turns any CUDA error into an ffi::Error.
#include <cuda_runtime.h>

#include <string>

#include "handlers/cuda_errors.h"
#include "handlers/lookup_args.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "kernels/dedup.cuh"
#include "kernels/gather.cuh"

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

// Queues sort + gather of prepared `params` on `stream` and fences the cache
// buffer set it reads (the lease, released here) against a refresh. The ids,
// rows and workspace must stay alive until the work on `stream` is done.
ffi::Error LaunchCachedLookupCuda(const DedupGatherParams& params, CacheLease* lease, int max_ctas,
                                  cudaStream_t stream) {
  const cudaError_t launched = LaunchDedupLookup(params, max_ctas, stream);
  // The fence goes on the stream even after a failed launch: whatever was queued before it is covered.
  const std::string fence_error = ReleaseCache(lease, stream);
  if (launched != cudaSuccess) return CudaError("cached lookup launch", launched);
  if (!fence_error.empty()) return ffi::Error::Internal("engram_jax cached lookup: " + fence_error);
  return ffi::Error::Success();
}

// The cached lookup into `out` (rows, or packed records with `records`).
template <typename Out>
ffi::Error CachedLookupInto(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, const Out& out,
                            bool records, ffi::ResultBuffer<ffi::U8>& workspace, int64_t table_key, int64_t dim,
                            int64_t max_ctas, int64_t order, int64_t cache_key) {
  LookupOutput output;
  if (ffi::Error err = CheckOutput(ids, out, dim, records, &output); err.failure()) return err;
  const CachedLookupCall call =
      MakeCachedLookupCall(device_ordinal, table_key, dim, max_ctas, order, cache_key, workspace->typed_data(),
                           static_cast<int64_t>(workspace->element_count()));
  DedupGatherParams params;
  CacheLease lease;
  if (ffi::Error err = PrepareCachedLookup(call, ids, output, GpuCanRead, "CUDA", &params, &lease); err.failure()) {
    ReleaseCache(&lease, nullptr);
    return err;
  }
  return LaunchCachedLookupCuda(params, &lease, CudaMaxCtas(call.max_ctas), stream);
}

ffi::Error CachedLookupCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::U8> workspace,
                                int64_t table_key, int64_t dim, int64_t max_ctas, int64_t order, int64_t cache_key) {
  return CachedLookupInto(stream, device_ordinal, ids, *out, false, workspace, table_key, dim, max_ctas, order,
                          cache_key);
}

ffi::Error LookupRecordsCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                 ffi::ResultBuffer<ffi::U8> out, ffi::ResultBuffer<ffi::U8> workspace,
                                 int64_t table_key, int64_t dim, int64_t max_ctas, int64_t order, int64_t cache_key) {
  return CachedLookupInto(stream, device_ordinal, ids, *out, true, workspace, table_key, dim, max_ctas, order,
                          cache_key);
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

// Not command-buffer compatible, for the same reason as engram_cached_lookup.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EngramLookupRecordsCuda, engram::NoThrow<engram::LookupRecordsCudaImpl>,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table and cache
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
        .Ret<xla::ffi::Buffer<xla::ffi::U8>>()          // packed records: ids.shape + (dim * 33 / 32,)
        .Ret<xla::ffi::Buffer<xla::ffi::U8>>()          // workspace for the sort
        .Attr<int64_t>("table_key")                     // registry key of the table
        .Attr<int64_t>("dim")                           // values per row
        .Attr<int64_t>("max_ctas")                      // grid size; <= 0: every SM
        .Attr<int64_t>("order")                         // VisitOrder: plain, sorted, dedup
        .Attr<int64_t>("cache_key"));                   // hot-row cache key, 0: none
