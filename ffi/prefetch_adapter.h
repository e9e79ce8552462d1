// Shared by the CPU and CUDA lookup_done handlers: checks that the handle's
// buffers fit each other (rows = ids.shape + (dim,), out = rows), or returns an
// ffi::Error naming what does not. Header-only.
#pragma once

#include <cstring>

#include "lookup_adapter.h"
#include "xla/ffi/api/ffi.h"

namespace engram {

namespace ffi = xla::ffi;

inline ffi::Error CheckDoneBuffers(ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::S32> ids,
                                   ffi::ResultBuffer<ffi::BF16> out) {
  if (!ExtendsShape(rows.dimensions(), ids.dimensions())) {
    return ffi::Error::InvalidArgument("engram_jax lookup_done: rows must have shape ids.shape + (dim,)");
  }
  const auto out_dims = out->dimensions();
  const auto rows_dims = rows.dimensions();
  bool fits = out_dims.size() == rows_dims.size();
  for (size_t i = 0; fits && i < rows_dims.size(); ++i) fits = out_dims[i] == rows_dims[i];
  if (!fits) return ffi::Error::InvalidArgument("engram_jax lookup_done: output must have the rows' shape");
  return ffi::Error::Success();
}

// done on the CPU: start already gathered, so done only checks the buffers and
// hands the rows back (normally aliased, so nothing moves).
inline ffi::Error HandBackRowsCpu(ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::S32> ids,
                                  ffi::ResultBuffer<ffi::BF16> out) {
  if (ffi::Error err = CheckDoneBuffers(rows, ids, out); err.failure()) return err;
  if (out->untyped_data() != rows.untyped_data()) {
    std::memcpy(out->untyped_data(), rows.untyped_data(), rows.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace engram
