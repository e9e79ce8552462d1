// XLA FFI handler for the CPU platform of engram_cached_lookup: validate,
// take the table and cache leases, run the framework-free CPU lookup from kernels/.
#include "cpu_lookup.h"
#include "dedup_handlers.h"
#include "handler_guard.h"

namespace engram {
namespace {

ffi::Error CachedLookupCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                               ffi::ResultBuffer<ffi::U8> workspace, int64_t table_key, int64_t dim, int64_t max_ctas,
                               int64_t order, int64_t cache_key) {
  return RunCachedLookupCpu(
      MakeCachedLookupCall(device_ordinal, table_key, dim, max_ctas, order, cache_key, workspace->typed_data(),
                           static_cast<int64_t>(workspace->element_count())),
      ids, out);
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
