// Shared by the CPU and CUDA handlers of the lookup with the row-rate levers
// (engram_cached_lookup): validates the call on top of the plain lookup's
// checks (lookup_adapter.h), takes a lease on the hot-row cache, and fills
// DedupGatherParams. Header-only so each adapter inlines it.
#pragma once

#include <cstdint>
#include <string>

#include "cache_registry.h"
#include "kernels/dedup_params.h"
#include "lookup_adapter.h"

namespace engram {

// The call's attributes and workspace, as plain values, so a handler with
// other buffer types (a prefetch start, for one) can fill it too.
struct CachedLookupCall {
  int32_t device_ordinal = 0;
  int64_t table_key = 0;
  int64_t dim = 0;
  int64_t max_ctas = 0;
  int64_t order = 0;      // VisitOrder
  int64_t cache_key = 0;  // 0: no cache
  uint8_t* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

inline CachedLookupCall MakeCachedLookupCall(int32_t device_ordinal, int64_t table_key, int64_t dim, int64_t max_ctas,
                                             int64_t order, int64_t cache_key, uint8_t* workspace,
                                             int64_t workspace_bytes) {
  CachedLookupCall call;
  call.device_ordinal = device_ordinal;
  call.table_key = table_key;
  call.dim = dim;
  call.max_ctas = max_ctas;
  call.order = order;
  call.cache_key = cache_key;
  call.workspace = workspace;
  call.workspace_bytes = workspace_bytes;
  return call;
}

// Fills `params` for a lookup of `num_ids` ids at `ids` into `out` and returns
// the cache lease through `lease` (release it with ReleaseCache once the work
// is queued, whatever happens in between). Handlers that read the table on the
// calling thread pass `table_lease`, as for the plain lookup.
inline ffi::Error PrepareCachedGather(const CachedLookupCall& call, const int32_t* ids, int64_t num_ids, uint16_t* out,
                                      bool (*allowed)(MemoryKind), const char* backend, DedupGatherParams* params,
                                      CacheLease* lease, TableLease* table_lease = nullptr) {
  if (!ValidVisitOrder(call.order)) {
    return ffi::Error::InvalidArgument(
        "engram_jax cached lookup: order must be 0 (plain), 1 (sorted) or 2 "
        "(dedup), got " +
        std::to_string(call.order));
  }
  if (call.cache_key < 0) {
    return ffi::Error::InvalidArgument("engram_jax cached lookup: cache_key must be >= 0");
  }
  if (ffi::Error err = PrepareGather(call.device_ordinal, call.table_key, call.dim, ids, num_ids, out, allowed, backend,
                                     &params->gather, table_lease);
      err.failure()) {
    return err;
  }
  params->order = static_cast<VisitOrder>(call.order);
  params->workspace = call.workspace;
  params->workspace_bytes = call.workspace_bytes;
  const int64_t needed = LookupWorkspaceBytes(params->gather.num_ids, params->order);
  if (call.workspace_bytes < needed) {
    return ffi::Error::InvalidArgument("engram_jax cached lookup: workspace has " +
                                       std::to_string(call.workspace_bytes) + " bytes, " + std::to_string(needed) +
                                       " needed");
  }
  if (params->gather.num_ids > INT32_MAX) {
    return ffi::Error::InvalidArgument("engram_jax cached lookup: at most 2**31 - 1 ids per call");
  }
  params->cache = CacheView{};
  if (call.cache_key != 0) {
    const std::string error =
        AcquireCache(call.cache_key, call.device_ordinal, call.table_key, call.dim, allowed, lease);
    if (!error.empty()) return ffi::Error::InvalidArgument("engram_jax cached lookup: " + error);
    params->cache = lease->view;
  }
  return ffi::Error::Success();
}

// PrepareCachedGather for the call's own buffers: ids in, rows out.
inline ffi::Error PrepareCachedLookup(const CachedLookupCall& call, ffi::Buffer<ffi::S32> ids,
                                      ffi::ResultBuffer<ffi::BF16> out, bool (*allowed)(MemoryKind),
                                      const char* backend, DedupGatherParams* params, CacheLease* lease,
                                      TableLease* table_lease = nullptr) {
  if (ffi::Error err = CheckRowsShape(ids, out, call.dim); err.failure()) return err;
  return PrepareCachedGather(call, ids.typed_data(), static_cast<int64_t>(ids.element_count()),
                             reinterpret_cast<uint16_t*>(out->typed_data()), allowed, backend, params, lease,
                             table_lease);
}

}  // namespace engram
