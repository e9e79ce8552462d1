// XLA FFI handlers for lookup_start / lookup_done on the CPU platform. The CPU
// has no stream to overlap with, so start gathers at once and done hands the
// rows back (done's output aliases its rows operand, so normally it moves nothing).
#include "cpu_lookup.h"
#include "handler_guard.h"
#include "lookup_adapter.h"
#include "prefetch_adapter.h"
#include "prefetch_handlers.h"

namespace engram {
namespace {

ffi::Error LookupStartCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> rows,
                              int64_t table_key, int64_t dim, int64_t /*max_ctas*/, int64_t /*slot*/) {
  return RunLookupCpu(device_ordinal, table_key, dim, ids, rows);
}

ffi::Error LookupDoneCpuImpl(ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                             int64_t /*slot*/) {
  return HandBackRowsCpu(rows, ids, out);
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupStartCpu, engram::NoThrow<engram::LookupStartCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()           // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows: ids.shape + (dim,)
                                  .Attr<int64_t>("table_key")               // registry key of the table
                                  .Attr<int64_t>("dim")                     // values per row
                                  .Attr<int64_t>("max_ctas")                // CUDA grid size; ignored here
                                  .Attr<int64_t>("slot"));                  // start/done pairing; unused here

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupDoneCpu, engram::NoThrow<engram::LookupDoneCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows written by start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids, kept alive until here
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // the rows (aliases operand 0)
                                  .Attr<int64_t>("slot"));                  // start/done pairing; unused here
