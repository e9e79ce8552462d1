// XLA FFI handlers for lookup_start / lookup_done on the CPU platform. The CPU
// has no stream to overlap with, so start gathers at once and done hands the
// rows back (done's output aliases its rows operand, so normally it moves nothing).
#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>

#include "kernels/gather_cpu.h"
#include "lookup_adapter.h"
#include "prefetch_adapter.h"
#include "prefetch_handlers.h"

namespace engram {
namespace {

bool CpuCanRead(MemoryKind kind) { return kind != MemoryKind::kDevice; }

ffi::Error LookupStartCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> rows,
                              int64_t table_key, int64_t dim, int64_t /*max_ctas*/, int64_t /*slot*/) {
  GatherParams params;
  TableLease lease;  // keeps close() waiting until this gather is done
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, rows, CpuCanRead, "CPU", &params, &lease);
      err.failure()) {
    return err;
  }
  const int threads = static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  try {
    GatherCpu(params, threads);
  } catch (const std::system_error& e) {
    return ffi::Error::Internal(std::string("engram_jax lookup_start: could not start CPU threads: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error LookupDoneCpuImpl(ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out,
                             int64_t /*slot*/) {
  if (ffi::Error err = CheckDoneBuffers(rows, ids, out); err.failure()) return err;
  if (out->untyped_data() != rows.untyped_data()) {
    std::memcpy(out->untyped_data(), rows.untyped_data(), rows.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupStartCpu, engram::LookupStartCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()           // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows: ids.shape + (dim,)
                                  .Attr<int64_t>("table_key")               // registry key of the table
                                  .Attr<int64_t>("dim")                     // values per row
                                  .Attr<int64_t>("max_ctas")                // CUDA grid size; ignored here
                                  .Attr<int64_t>("slot"));                  // start/done pairing; unused here

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupDoneCpu, engram::LookupDoneCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // rows written by start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ids, kept alive until here
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // the rows (aliases operand 0)
                                  .Attr<int64_t>("slot"));                  // start/done pairing; unused here
