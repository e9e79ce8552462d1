// XLA FFI handler for the CPU platform of engram_cached_lookup: validate,
// take the table and cache leases, run the framework-free CPU lookup from kernels/.
#include "dedup_adapter.h"
#include "dedup_handlers.h"
#include "handler_guard.h"
#include "kernels/dedup_cpu.h"
#include "kernels/gather_cpu.h"
#include "prefetch_adapter.h"

namespace engram {
namespace {

// The cache lease of one CPU lookup, returned however the handler leaves.
struct CpuCacheLease {
  CacheLease lease;
  ~CpuCacheLease() { ReleaseCache(&lease, nullptr); }
};

ffi::Error CachedLookupCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                               ffi::ResultBuffer<ffi::U8> workspace, int64_t table_key, int64_t dim, int64_t max_ctas,
                               int64_t order, int64_t cache_key) {
  const CachedLookupCall call =
      MakeCachedLookupCall(device_ordinal, table_key, dim, max_ctas, order, cache_key, workspace);
  DedupGatherParams params;
  TableLease table_lease;  // declared first: outlives the cache lease and the reads
  CpuCacheLease cache;
  if (ffi::Error err = PrepareCachedLookup(call, ids, out, CpuCanRead, "CPU", &params, &cache.lease, &table_lease);
      err.failure()) {
    return err;
  }
  if (!LookupCpu(params, CpuLookupThreads())) {
    return ffi::Error::Internal("engram_jax cached lookup: workspace too small");
  }
  return ffi::Error::Success();
}

// The CPU has no stream to overlap with: start looks up at once, done hands
// the rows back (its output aliases the rows operand, so it moves nothing).
ffi::Error CachedLookupStartCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                                    ffi::ResultBuffer<ffi::U8> workspace, int64_t table_key, int64_t dim,
                                    int64_t max_ctas, int64_t order, int64_t cache_key, int64_t /*slot*/) {
  return CachedLookupCpuImpl(device_ordinal, ids, out, workspace, table_key, dim, max_ctas, order, cache_key);
}

ffi::Error CachedLookupDoneCpuImpl(ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::S32> ids,
                                   ffi::Buffer<ffi::U8> /*workspace*/, ffi::ResultBuffer<ffi::BF16> out,
                                   int64_t /*slot*/) {
  return HandBackRowsCpu(rows, ids, out);
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupCpu, engram::NoThrow<engram::CachedLookupCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()           // which device's table and cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows: ids.shape + (dim,)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace for the sort
                                  .Attr<int64_t>("table_key")               // registry key of the table
                                  .Attr<int64_t>("dim")                     // values per row
                                  .Attr<int64_t>("max_ctas")                // CUDA grid size; the CPU ignores it
                                  .Attr<int64_t>("order")                   // VisitOrder: plain, sorted, dedup
                                  .Attr<int64_t>("cache_key"));             // hot-row cache key, 0: none

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupStartCpu, engram::NoThrow<engram::CachedLookupStartCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()           // which device's table and cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows: ids.shape + (dim,)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace for the sort
                                  .Attr<int64_t>("table_key")               // registry key of the table
                                  .Attr<int64_t>("dim")                     // values per row
                                  .Attr<int64_t>("max_ctas")                // CUDA grid size; ignored here
                                  .Attr<int64_t>("order")                   // VisitOrder: plain, sorted, dedup
                                  .Attr<int64_t>("cache_key")               // hot-row cache key, 0: none
                                  .Attr<int64_t>("slot"));                  // start/done pairing; unused here

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupDoneCpu, engram::NoThrow<engram::CachedLookupDoneCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows written by start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids, kept alive until here
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace, kept alive until here
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // the rows (aliases operand 0)
                                  .Attr<int64_t>("slot"));                  // start/done pairing; unused here
