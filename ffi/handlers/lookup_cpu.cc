// XLA FFI handlers of the synchronous lookup on the CPU platform: engram_lookup,
// engram_cached_lookup (visiting order, dedup and the hot-row cache) and
// engram_lookup_records (the same, returning packed records for a packed
// exchange). Each decodes the call, takes its leases and runs a framework-free
// gather from kernels/.
#include "handlers/lookup_cpu.h"

#include <vector>

#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "kernels/dedup_cpu.h"
#include "kernels/gather_cpu.h"

namespace engram {

namespace {

// The cache lease of one CPU lookup, returned however the handler leaves.
struct CpuCacheLease {
  CacheLease lease;
  ~CpuCacheLease() { ReleaseCache(&lease, nullptr); }
};

ffi::Error LookupCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                         int64_t table_key, int64_t dim, int64_t /*max_ctas*/) {
  return RunLookupCpu(device_ordinal, table_key, dim, ids, out);
}

// The cached lookup into a checked `out` (rows or packed records).
template <typename Out>
ffi::Error CachedLookupInto(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, const Out& out, bool records,
                            ffi::ResultBuffer<ffi::U8>& workspace, int64_t table_key, int64_t dim, int64_t max_ctas,
                            int64_t order, int64_t cache_key) {
  LookupOutput output;
  if (ffi::Error err = CheckOutput(ids, out, dim, records, &output); err.failure()) return err;
  return RunCachedLookupCpu(
      MakeCachedLookupCall(device_ordinal, table_key, dim, max_ctas, order, cache_key, workspace->typed_data(),
                           static_cast<int64_t>(workspace->element_count())),
      ids, output);
}

ffi::Error CachedLookupCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                               ffi::ResultBuffer<ffi::U8> workspace, int64_t table_key, int64_t dim, int64_t max_ctas,
                               int64_t order, int64_t cache_key) {
  return CachedLookupInto(device_ordinal, ids, *out, false, workspace, table_key, dim, max_ctas, order, cache_key);
}

ffi::Error LookupRecordsCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::U8> out,
                                ffi::ResultBuffer<ffi::U8> workspace, int64_t table_key, int64_t dim, int64_t max_ctas,
                                int64_t order, int64_t cache_key) {
  return CachedLookupInto(device_ordinal, ids, *out, true, workspace, table_key, dim, max_ctas, order, cache_key);
}

}  // namespace

ffi::Error RunLookupCpu(int32_t device_ordinal, int64_t table_key, int64_t dim, ffi::Buffer<ffi::S32> ids,
                        ffi::ResultBuffer<ffi::BF16> out) {
  GatherParams params;
  TableLease lease;
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, out, CpuCanRead, "CPU", &params, &lease);
      err.failure()) {
    return err;
  }
  GatherCpu(params, CpuLookupThreads());
  return ffi::Error::Success();
}

ffi::Error RunCachedLookupCpu(CachedLookupCall call, ffi::Buffer<ffi::S32> ids, LookupOutput out) {
  std::vector<uint8_t> scratch;
  if (call.workspace == nullptr && ValidVisitOrder(call.order)) {
    scratch.resize(static_cast<size_t>(
        LookupWorkspaceBytes(static_cast<int64_t>(ids.element_count()), static_cast<VisitOrder>(call.order))));
    call.workspace = scratch.data();
    call.workspace_bytes = static_cast<int64_t>(scratch.size());
  }
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

}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupCpu, engram::NoThrow<engram::LookupCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()           // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows: ids.shape + (dim,)
                                  .Attr<int64_t>("table_key")               // registry key of the table
                                  .Attr<int64_t>("dim")                     // values per row
                                  .Attr<int64_t>("max_ctas"));              // CUDA grid size; the CPU ignores it

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EngramLookupRecordsCpu, engram::NoThrow<engram::LookupRecordsCpuImpl>,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::DeviceOrdinal>()          // which device's table and cache
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids: global row numbers
        .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // packed records: ids.shape + (dim * 33 / 32,)
        .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace for the sort
        .Attr<int64_t>("table_key")              // registry key of the table
        .Attr<int64_t>("dim")                    // values per row
        .Attr<int64_t>("max_ctas")               // CUDA grid size; the CPU ignores it
        .Attr<int64_t>("order")                  // VisitOrder: plain, sorted, dedup
        .Attr<int64_t>("cache_key"));            // hot-row cache key, 0: none
