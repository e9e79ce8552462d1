// Turning a lookup call's buffers and attributes into kernel parameters, for
// the CPU and CUDA handlers alike: checks them against each other and the
// table (and hot-row cache) registry, fills GatherParams or DedupGatherParams
// (bf16 rows or packed records out), or returns an ffi::Error saying what does
// not fit. Header-only.
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

// Where a lookup writes: bf16 rows of `dim` values, or (set instead) the
// packed records of a lookup whose rows cross devices before they are decoded.
struct LookupOutput {
  uint16_t* rows = nullptr;
  uint8_t* records = nullptr;
};

// Fills `params` for a gather of `num_ids` ids at `ids` into `out`, or says
// what does not fit. `allowed` says which memory this backend can read;
// `backend` names it in errors. Handlers that read the table on the calling
// thread pass a lease.
inline ffi::Error PrepareGather(int32_t device_ordinal, int64_t table_key, int64_t dim, const int32_t* ids,
                                int64_t num_ids, LookupOutput out, bool (*allowed)(MemoryKind), const char* backend,
                                GatherParams* params, TableLease* lease = nullptr) {
  if (dim <= 0 || dim % kBlockSize != 0 || dim > kMaxDim) {
    return ffi::Error::InvalidArgument("engram_jax lookup: dim must be a positive multiple of 32 up to " +
                                       std::to_string(kMaxDim) + ", got " + std::to_string(dim));
  }
  const auto entry = FindTable(table_key, device_ordinal, lease);
  if (!entry) return ffi::Error::InvalidArgument(MissingTableMessage(table_key, device_ordinal));
  if (entry->format != RowFormat::kFp8Records) {
    return ffi::Error::InvalidArgument("engram_jax lookup: table " + std::to_string(table_key) +
                                       " is a trainable table (float32 or bfloat16 rows): this lookup reads fp8 "
                                       "serving records only");
  }
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
  params->out = out.rows;
  params->records = out.records;
  return ffi::Error::Success();
}

// The output of a lookup that returns rows or, with `records`, packed records,
// checked against its ids as every handler that returns either checks: bf16
// ids.shape + (dim,), or uint8 ids.shape + (PackedRecordBytes(dim),). `Out`
// is an ffi::AnyBuffer or a typed ffi::Buffer; a dim the table does not have
// is PrepareGather's to refuse.
template <typename Out>
inline ffi::Error CheckOutput(ffi::Buffer<ffi::S32> ids, const Out& out, int64_t dim, bool records,
                              LookupOutput* output) {
  const auto out_dims = out.dimensions();
  const int64_t width = records ? PackedRecordBytes(dim) : dim;
  const ffi::DataType dtype = records ? ffi::DataType::U8 : ffi::DataType::BF16;
  if (out.element_type() != dtype || !ExtendsShape(out_dims, ids.dimensions()) || out_dims.back() != width) {
    return ffi::Error::InvalidArgument(
        records ? "engram_jax lookup: packed records must be uint8 of shape ids.shape + (dim + dim / 32,)"
                : "engram_jax lookup: rows must be bf16 of shape ids.shape + (dim,)");
  }
  *output = LookupOutput{};
  if (records) {
    output->records = static_cast<uint8_t*>(out.untyped_data());
  } else {
    output->rows = static_cast<uint16_t*>(out.untyped_data());
  }
  return ffi::Error::Success();
}

// The records attribute of a handler that returns rows (0) or packed records (1).
inline ffi::Error CheckRecordsFlag(int64_t records) {
  if (records != 0 && records != 1) {
    return ffi::Error::InvalidArgument("engram_jax lookup: records must be 0 (rows) or 1 (packed records), got " +
                                       std::to_string(records));
  }
  return ffi::Error::Success();
}

// PrepareGather for the call's own buffers: ids in, rows out.
inline ffi::Error PrepareLookup(int32_t device_ordinal, int64_t table_key, int64_t dim, ffi::Buffer<ffi::S32> ids,
                                ffi::ResultBuffer<ffi::BF16> out, bool (*allowed)(MemoryKind), const char* backend,
                                GatherParams* params, TableLease* lease = nullptr) {
  LookupOutput rows;
  if (ffi::Error err = CheckOutput(ids, *out, dim, false, &rows); err.failure()) return err;
  return PrepareGather(device_ordinal, table_key, dim, ids.typed_data(), static_cast<int64_t>(ids.element_count()),
                       rows, allowed, backend, params, lease);
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
inline ffi::Error PrepareCachedGather(const CachedLookupCall& call, const int32_t* ids, int64_t num_ids,
                                      LookupOutput out, bool (*allowed)(MemoryKind), const char* backend,
                                      DedupGatherParams* params, CacheLease* lease, TableLease* table_lease = nullptr) {
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

// PrepareCachedGather for the call's own buffers: ids in, rows or packed records
// (`out`, checked by CheckOutput) out.
inline ffi::Error PrepareCachedLookup(const CachedLookupCall& call, ffi::Buffer<ffi::S32> ids, LookupOutput out,
                                      bool (*allowed)(MemoryKind), const char* backend, DedupGatherParams* params,
                                      CacheLease* lease, TableLease* table_lease = nullptr) {
  return PrepareCachedGather(call, ids.typed_data(), static_cast<int64_t>(ids.element_count()), out, allowed, backend,
                             params, lease, table_lease);
}

// The int64 max_ctas attribute as the int grid cap the CUDA launchers take:
// <= 0 asks for the full grid (0 to the launchers); a cap past INT_MAX is no
// cap at all (INT_MAX: the launchers never use more CTAs than there are tiles).
inline int CudaMaxCtas(int64_t max_ctas) {
  if (max_ctas <= 0) return 0;
  return max_ctas > INT_MAX ? INT_MAX : static_cast<int>(max_ctas);
}

}  // namespace engram
