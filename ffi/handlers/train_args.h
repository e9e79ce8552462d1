// Turning the calls of trainable tables (engram_train_lookup,
// engram_apply_gradients and its start) into kernel parameters, for the CPU and CUDA
// handlers alike: the registry entry must be a trainable table with the
// layout, optimizer and dtypes the call was traced for, and the buffers must
// fit it; otherwise an ffi::Error says what does not, before anything is
// read or written. Header-only.
#pragma once

#include <climits>
#include <cstdint>
#include <string>

#include "handlers/lookup_args.h"
#include "kernels/dedup_params.h"
#include "kernels/train_rows.h"
#include "runtime/table_registry.h"
#include "xla/ffi/api/ffi.h"

namespace engram {

namespace ffi = xla::ffi;

inline ffi::DataType DataTypeOf(RowFormat format) {
  return format == RowFormat::kF32 ? ffi::DataType::F32 : ffi::DataType::BF16;
}

inline const char* FormatName(RowFormat format) {
  switch (format) {
    case RowFormat::kF32:
      return "float32";
    case RowFormat::kBf16:
      return "bfloat16";
    default:
      return "fp8 records";
  }
}

// What the call was traced for, from its attributes.
struct TrainableCall {
  int32_t device_ordinal = 0;
  int64_t table_key = 0;
  int64_t dim = 0;
  int64_t format = 0;      // RowFormat
  int64_t optimizer = -1;  // RowOptimizerKind; -1: any (a lookup)
  int64_t moment_format = 0;
};

// The `records` attribute of lookup_start / lookup_done says what the gather
// returns: 0 bf16 rows and 1 packed records of an fp8 table, or the rows of a
// trainable table in its dtype, 2 float32 and 3 bfloat16 (RowFormat + 1).
inline bool IsTrainableOutput(int64_t records) { return records == 2 || records == 3; }
inline int64_t TrainableFormatOf(int64_t records) { return records - 1; }

inline ffi::Error CheckOutputKind(int64_t records) {
  if (records < 0 || records > 3) {
    return ffi::Error::InvalidArgument(
        "engram_jax lookup_start: records must be 0 (rows) or 1 (packed records) of an fp8 table, "
        "or 2 or 3 (float32 or bfloat16 rows of a trainable table), got " +
        std::to_string(records));
  }
  return ffi::Error::Success();
}

// Resolves the table for `call` (a lease held while the calling thread reads
// it), or says why it cannot be used. `writer` says whether this device's
// entry writes updates.
inline ffi::Error PrepareTrainable(const TrainableCall& call, bool (*allowed)(MemoryKind), const char* backend,
                                   TrainableView* view, bool* writer, TableLease* lease = nullptr) {
  const std::string what = "engram_jax trainable table " + std::to_string(call.table_key) + ": ";
  if (!ValidRowFormat(call.format)) {
    return ffi::Error::InvalidArgument(what + "format must be 1 (float32) or 2 (bfloat16), got " +
                                       std::to_string(call.format));
  }
  const auto entry = FindTable(call.table_key, call.device_ordinal, lease);
  if (!entry) return ffi::Error::InvalidArgument(MissingTableMessage(call.table_key, call.device_ordinal));
  if (entry->format == RowFormat::kFp8Records) {
    return ffi::Error::InvalidArgument(what +
                                       "is an fp8 serving table (EngramTable): only a TrainableTable "
                                       "takes gradients or a trainable lookup");
  }
  if (entry->dim != call.dim || static_cast<int64_t>(entry->format) != call.format) {
    return ffi::Error::InvalidArgument(what + "holds dim " + std::to_string(entry->dim) + " " +
                                       FormatName(entry->format) + " rows, the call was traced for dim " +
                                       std::to_string(call.dim) + " " +
                                       FormatName(static_cast<RowFormat>(call.format)));
  }
  if (call.optimizer >= 0 &&
      (entry->optimizer != call.optimizer || static_cast<int64_t>(entry->moment_format) != call.moment_format)) {
    return ffi::Error::InvalidArgument(what + "its optimizer state (optimizer " + std::to_string(entry->optimizer) +
                                       ") does not match the call's optimizer " + std::to_string(call.optimizer));
  }
  if (!allowed(entry->kind)) {
    return ffi::Error::InvalidArgument(what + "lives in memory the " + backend +
                                       " backend cannot read (place it as 'pinned' to use it from both)");
  }
  view->table = reinterpret_cast<uint8_t*>(entry->base);
  view->row_start = entry->row_start;
  view->num_rows = entry->num_rows;
  view->dim = entry->dim;
  view->stride = entry->stride;
  view->state_offset = entry->state_offset;
  view->format = entry->format;
  view->optimizer = static_cast<RowOptimizerKind>(entry->optimizer);
  view->moment_format = entry->moment_format;
  *writer = entry->writer;
  return ffi::Error::Success();
}

// The rows of a trainable lookup: the table's dtype, ids.shape + (dim,).
inline ffi::Error CheckTrainableRows(ffi::Buffer<ffi::S32> ids, const ffi::AnyBuffer& rows, const TrainableCall& call) {
  if (!ValidRowFormat(call.format) || rows.element_type() != DataTypeOf(static_cast<RowFormat>(call.format)) ||
      !ExtendsShape(rows.dimensions(), ids.dimensions()) || rows.dimensions().back() != call.dim) {
    return ffi::Error::InvalidArgument(
        "engram_jax trainable lookup: rows must be of the table's dtype and shape ids.shape + (dim,)");
  }
  return ffi::Error::Success();
}

// The inputs of an update call (ids, gradients, learning rate, optimizer code),
// checked against each other; the workspace is the caller's.
inline ffi::Error PrepareUpdateInputs(ffi::Buffer<ffi::S32> ids, const ffi::AnyBuffer& grads,
                                      ffi::Buffer<ffi::F32> learning_rate, int64_t dim, int64_t optimizer,
                                      UpdateParams* params) {
  const char* what = "engram_jax apply_gradients: ";
  if (!ValidOptimizer(optimizer)) {
    return ffi::Error::InvalidArgument(std::string(what) + "unknown optimizer " + std::to_string(optimizer));
  }
  const auto gtype = grads.element_type();
  if (gtype != ffi::DataType::F32 && gtype != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument(std::string(what) + "grads must be float32 or bfloat16");
  }
  if (!ExtendsShape(grads.dimensions(), ids.dimensions()) || grads.dimensions().back() != dim) {
    return ffi::Error::InvalidArgument(std::string(what) + "grads must have shape ids.shape + (dim,), dim " +
                                       std::to_string(dim));
  }
  if (learning_rate.dimensions().size() != 0 || learning_rate.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(what) + "learning_rate must be a float32 scalar");
  }
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (n > INT32_MAX) return ffi::Error::InvalidArgument(std::string(what) + "at most 2**31 - 1 ids per call");
  params->ids = ids.typed_data();
  params->num_ids = n;
  params->grads = grads.untyped_data();
  params->grads_bf16 = gtype == ffi::DataType::BF16;
  params->lr = learning_rate.typed_data();
  return ffi::Error::Success();
}

// The update token a call returns: an int32 scalar.
inline ffi::Error CheckUpdateToken(ffi::Result<ffi::Buffer<ffi::S32>>& token) {
  if (token->dimensions().size() != 0) {
    return ffi::Error::InvalidArgument("engram_jax apply_gradients: the update token is an int32 scalar");
  }
  return ffi::Error::Success();
}

// Everything of a synchronous update call but the table: its inputs and its one
// result (kernels/train_rows.h: UpdateResultBytes), whose token the handler
// zeroes and whose rest is the workspace.
inline ffi::Error PrepareUpdateBuffers(ffi::Buffer<ffi::S32> ids, const ffi::AnyBuffer& grads,
                                       ffi::Buffer<ffi::F32> learning_rate, ffi::Result<ffi::Buffer<ffi::U8>>& result,
                                       int64_t dim, int64_t optimizer, UpdateParams* params) {
  if (ffi::Error err = PrepareUpdateInputs(ids, grads, learning_rate, dim, optimizer, params); err.failure()) {
    return err;
  }
  const int64_t needed = UpdateResultBytes(params->num_ids, dim);
  const int64_t bytes = static_cast<int64_t>(result->element_count());
  if (result->dimensions().size() != 1 || bytes < needed) {
    return ffi::Error::InvalidArgument("engram_jax apply_gradients: the result has " + std::to_string(bytes) +
                                       " bytes, " + std::to_string(needed) + " needed (token and workspace)");
  }
  params->workspace = result->typed_data() + kUpdateTokenBytes;
  params->workspace_bytes = bytes - kUpdateTokenBytes;
  return ffi::Error::Success();
}

}  // namespace engram
