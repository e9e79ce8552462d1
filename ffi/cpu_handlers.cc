// XLA FFI handlers for the CPU platform. Thin adapters: decode the call,
// resolve the table, run the framework-free gather from kernels/.
#include "cpu_handlers.h"

#include <algorithm>
#include <system_error>
#include <thread>

#include "kernels/gather_cpu.h"
#include "lookup_adapter.h"

namespace engram {
namespace {

bool CpuCanRead(MemoryKind kind) { return kind != MemoryKind::kDevice; }

ffi::Error LookupCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                         int64_t table_key, int64_t dim, int64_t /*max_ctas*/) {
  GatherParams params;
  TableLease lease;  // keeps close() waiting until this gather is done
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, out, CpuCanRead, "CPU", &params, &lease);
      err.failure()) {
    return err;
  }
  const int threads = static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  try {
    GatherCpu(params, threads);
  } catch (const std::system_error& e) {
    return ffi::Error::Internal(std::string("engram_jax lookup: could not start CPU threads: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupCpu, engram::LookupCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()           // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows: ids.shape + (dim,)
                                  .Attr<int64_t>("table_key")               // registry key of the table
                                  .Attr<int64_t>("dim")                     // values per row
                                  .Attr<int64_t>("max_ctas"));              // CUDA grid size; the CPU ignores it
