// XLA FFI handler of the packed-record decode on the CPU platform
// (engram_decode_records): the records a packed exchange delivered, decoded by
// the CPU gather's own decode (kernels/gather_cpu.h), so the rows equal the
// unsharded lookup's bit for bit.
#include "handlers/decode_args.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "kernels/gather_cpu.h"

namespace engram {
namespace {

ffi::Error DecodeRecordsCpuImpl(ffi::Buffer<ffi::U8> records, ffi::ResultBuffer<ffi::BF16> rows, int64_t dim) {
  int64_t num_rows = 0;
  if (ffi::Error err = PrepareDecode(records, rows, dim, &num_rows); err.failure()) return err;
  DecodeRecordsCpu(records.typed_data(), num_rows, dim, reinterpret_cast<uint16_t*>(rows->typed_data()),
                   CpuLookupThreads());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramDecodeRecordsCpu, engram::NoThrow<engram::DecodeRecordsCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // packed records [..., dim * 33 / 32]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows [..., dim]
                                  .Attr<int64_t>("dim"));                   // values per row
