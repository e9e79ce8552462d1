// XLA FFI handler for the CPU platform of engram_cached_lookup: validate,
// take the cache lease, run the framework-free CPU lookup from kernels/.
#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

#include "dedup_adapter.h"
#include "dedup_handlers.h"
#include "kernels/dedup_cpu.h"
#include "prefetch_adapter.h"

namespace engram {
namespace {

ffi::Error CachedLookupCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                               ffi::ResultBuffer<ffi::U8> workspace, int64_t table_key, int64_t dim, int64_t max_ctas,
                               int64_t order, int64_t cache_key) {
  CachedLookupCall call;
  call.device_ordinal = device_ordinal;
  call.table_key = table_key;
  call.dim = dim;
  call.max_ctas = max_ctas;
  call.order = order;
  call.cache_key = cache_key;
  call.workspace = workspace->typed_data();
  call.workspace_bytes = static_cast<int64_t>(workspace->element_count());
  DedupGatherParams params;
  CacheLease lease;
  if (ffi::Error err = PrepareCachedLookup(call, ids, out, CpuCanRead, "CPU", &params, &lease); err.failure()) {
    ReleaseCache(&lease, nullptr);
    return err;
  }
  const int threads = static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  std::string failure;
  try {
    if (!LookupCpu(params, threads)) failure = "workspace too small";
  } catch (const std::system_error& e) {
    failure = std::string("could not start CPU threads: ") + e.what();
  }
  ReleaseCache(&lease, nullptr);
  if (!failure.empty()) return ffi::Error::Internal("engram_jax cached lookup: " + failure);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupCpu, engram::CachedLookupCpuImpl,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupStartCpu, engram::CachedLookupStartCpuImpl,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupDoneCpu, engram::CachedLookupDoneCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows written by start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids, kept alive until here
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace, kept alive until here
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // the rows (aliases operand 0)
                                  .Attr<int64_t>("slot"));                  // start/done pairing; unused here
