// Turning a lookup call's buffers and attributes into kernel parameters, for
// the CPU and CUDA handlers alike: checks them against each other and the
// table (and hot-row cache) registry, fills GatherParams or DedupGatherParams,
// or returns an ffi::Error saying what does not fit. Header-only.
#pragma once

#include <climits>
#include <cstdint>
#include <string>

#include "kernels/dedup_params.h"
#include "kernels/gather_params.h"
#include "kernels/row_decode.h"
#include "runtime/cache_registry.h"
#include "runtime/table_registry.h"
#include "xla/ffi/api/ffi.h"

namespace engram {

namespace ffi = xla::ffi;

// Whether `rows` is `ids` plus one trailing dimension (any size).
template <typename Dims>
bool ExtendsShape(const Dims& rows, const Dims& ids) {
  if (rows.size() != ids.size() + 1) return false;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (rows[i] != ids[i]) return false;
  }
  return true;
}

// Fills `params` for a gather of `num_ids` ids at `ids` into `out` (bf16 rows of
// `dim` values), or says what does not fit. `allowed` says which memory this
// backend can read; `backend` names it in errors. Handlers that read the table
// on the calling thread pass a lease.
inline ffi::Error PrepareGather(int32_t device_ordinal, int64_t table_key, int64_t dim, const int32_t* ids,
                                int64_t num_ids, uint16_t* out, bool (*allowed)(MemoryKind), const char* backend,
                                GatherParams* params, TableLease* lease = nullptr) {
  if (dim <= 0 || dim % kBlockSize != 0 || dim > kMaxDim) {
    return ffi::Error::InvalidArgument("engram_jax lookup: dim must be a positive multiple of 32 up to " +
                                       std::to_string(kMaxDim) + ", got " + std::to_string(dim));
  }
  const auto entry = FindTable(table_key, device_ordinal, lease);
  if (!entry) return ffi::Error::InvalidArgument(MissingTableMessage(table_key, device_ordinal));
  if (entry->dim != dim) {
    return ffi::Error::InvalidArgument("engram_jax lookup: table " + std::to_string(table_key) + " has dim " +
                                       std::to_string(entry->dim) + ", the call says " + std::to_string(dim));
  }
  if (!allowed(entry->kind)) {
    return ffi::Error::InvalidArgument(std::string("engram_jax lookup: table ") + std::to_string(table_key) +
                                       " lives in memory the " + backend +
                                       " backend cannot read (place it as 'pinned' to use it from both)");
  }
  params->table = reinterpret_cast<const uint8_t*>(entry->base);
  params->row_start = entry->row_start;
  params->num_rows = entry->num_rows;
  params->dim = dim;
  params->ids = ids;
  params->num_ids = num_ids;
  params->out = out;
  return ffi::Error::Success();
}

// Whether `out` has shape ids.shape + (dim,), as every handler that returns rows checks.
inline ffi::Error CheckRowsShape(ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16>& out, int64_t dim) {
  const auto out_dims = out->dimensions();
  if (!ExtendsShape(out_dims, ids.dimensions()) || out_dims.back() != dim) {
    return ffi::Error::InvalidArgument("engram_jax lookup: output must have shape ids.shape + (dim,)");
  }
  return ffi::Error::Success();
}

// PrepareGather for the call's own buffers: ids in, rows out.
inline ffi::Error PrepareLookup(int32_t device_ordinal, int64_t table_key, int64_t dim, ffi::Buffer<ffi::S32> ids,
                                ffi::ResultBuffer<ffi::BF16> out, bool (*allowed)(MemoryKind), const char* backend,
                                GatherParams* params, TableLease* lease = nullptr) {
  if (ffi::Error err = CheckRowsShape(ids, out, dim); err.failure()) return err;
  return PrepareGather(device_ordinal, table_key, dim, ids.typed_data(), static_cast<int64_t>(ids.element_count()),
                       reinterpret_cast<uint16_t*>(out->typed_data()), allowed, backend, params, lease);
}

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

// The int64 max_ctas attribute as the int grid cap the CUDA launchers take:
// <= 0 asks for the full grid (0 to the launchers); a cap past INT_MAX is no
// cap at all (INT_MAX: the launchers never use more CTAs than there are tiles).
inline int CudaMaxCtas(int64_t max_ctas) {
  if (max_ctas <= 0) return 0;
  return max_ctas > INT_MAX ? INT_MAX : static_cast<int>(max_ctas);
}

}  // namespace engram
