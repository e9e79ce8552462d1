// XLA FFI handlers for the CPU platform. Thin adapters: decode the call,
// resolve the table, run the framework-free gather from kernels/.
#include "cpu_handlers.h"

#include "cpu_lookup.h"
#include "handler_guard.h"
#include "lookup_adapter.h"

namespace engram {
namespace {

ffi::Error LookupCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                         int64_t table_key, int64_t dim, int64_t /*max_ctas*/) {
  return RunLookupCpu(device_ordinal, table_key, dim, ids, out);
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupCpu, engram::NoThrow<engram::LookupCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()           // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows: ids.shape + (dim,)
                                  .Attr<int64_t>("table_key")               // registry key of the table
                                  .Attr<int64_t>("dim")                     // values per row
                                  .Attr<int64_t>("max_ctas"));              // CUDA grid size; the CPU ignores it
