// XLA FFI handler of the packed-record decode on CUDA (engram_decode_records):
// the records a packed exchange delivered, decoded on XLA's stream by the
// gathers' own tiles and DecodeEight (kernels/gather.cuh), so the rows equal
// the unsharded lookup's bit for bit.
#include <cuda_runtime.h>

#include "handlers/cuda_errors.h"
#include "handlers/decode_args.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "kernels/gather.cuh"

namespace engram {
namespace {

ffi::Error DecodeRecordsCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> records, ffi::ResultBuffer<ffi::BF16> rows,
                                 int64_t dim) {
  int64_t num_rows = 0;
  if (ffi::Error err = PrepareDecode(records, rows, dim, &num_rows); err.failure()) return err;
  if (cudaError_t err = LaunchDecodeRecords(records.typed_data(), num_rows, dim,
                                            reinterpret_cast<uint16_t*>(rows->typed_data()), stream);
      err != cudaSuccess) {
    return CudaError("decode_records launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

// Not marked command-buffer compatible: like the lookups, it leaves XLA's graphs
// (the full-grid query on its first run is not known to be capture safe).
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramDecodeRecordsCuda, engram::NoThrow<engram::DecodeRecordsCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()          // packed records [..., dim * 33 / 32]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows [..., dim]
                                  .Attr<int64_t>("dim"));                         // values per row
