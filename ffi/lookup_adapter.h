// Shared by the CPU and CUDA lookup handlers: turns the FFI call's buffers and
// attributes plus the registry entry into GatherParams, or an ffi::Error
// saying what does not fit. Header-only so each adapter inlines it.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/gather_params.h"
#include "kernels/row_decode.h"
#include "table_registry.h"
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

}  // namespace engram
