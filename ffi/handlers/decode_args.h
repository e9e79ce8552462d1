// Checking a decode call (engram_decode_records): packed records in, bf16 rows
// out, for the CPU and CUDA handlers alike; returns the number of rows, or an
// ffi::Error saying what does not fit. Header-only.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/gather_params.h"
#include "kernels/row_decode.h"
#include "xla/ffi/api/ffi.h"

namespace engram {

namespace ffi = xla::ffi;

// `records` [..., PackedRecordBytes(dim)] and `rows` [..., dim]: the same
// leading axes, at least one axis each.
inline ffi::Error PrepareDecode(ffi::Buffer<ffi::U8> records, ffi::ResultBuffer<ffi::BF16>& rows, int64_t dim,
                                int64_t* num_rows) {
  if (dim <= 0 || dim % kBlockSize != 0 || dim > kMaxDim) {
    return ffi::Error::InvalidArgument("engram_jax decode_records: dim must be a positive multiple of 32 up to " +
                                       std::to_string(kMaxDim) + ", got " + std::to_string(dim));
  }
  const auto in = records.dimensions();
  const auto out = rows->dimensions();
  bool fits = in.size() > 0 && in.size() == out.size() && in.back() == PackedRecordBytes(dim) && out.back() == dim;
  for (size_t i = 0; fits && i + 1 < in.size(); ++i) fits = in[i] == out[i];
  if (!fits) {
    return ffi::Error::InvalidArgument(
        "engram_jax decode_records: records must be [..., dim + dim / 32] uint8 and rows [..., dim] bf16 with the "
        "same leading axes, for dim " +
        std::to_string(dim));
  }
  *num_rows = static_cast<int64_t>(rows->element_count()) / dim;
  return ffi::Error::Success();
}

}  // namespace engram
