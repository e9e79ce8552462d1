// XLA FFI handlers of the asynchronous lookup on the CPU platform. With no stream
// to overlap with, nothing outlives a call: start only writes its ticket, and
// done runs the cached lookup (lookup_cpu.h: order, cache and rows or packed
// records as its attributes say; a trainable table's rows: train_lookup_cpu.h) on its ids operand, which XLA keeps
// valid for the duration of the call.
#include <cstring>

#include "handlers/lookup_cpu.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "handlers/train_args.h"
#include "handlers/train_lookup_cpu.h"

namespace engram {
namespace {

ffi::Error LookupStartCpuImpl(ffi::Buffer<ffi::S32> /*ids*/, ffi::RemainingArgs /*after*/,
                              ffi::ResultBuffer<ffi::U32> ticket, int64_t /*table_key*/, int64_t /*dim*/,
                              int64_t /*max_ctas*/, int64_t /*order*/, int64_t /*cache_key*/, int64_t /*slot*/,
                              int64_t records) {
  if (ffi::Error err = CheckOutputKind(records); err.failure()) return err;
  if (ticket->size_bytes() > 0) std::memset(ticket->untyped_data(), 0, ticket->size_bytes());
  return ffi::Error::Success();
}

ffi::Error LookupDoneCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::U32> /*ticket*/, ffi::Buffer<ffi::S32> ids,
                             ffi::Result<ffi::AnyBuffer> out, int64_t table_key, int64_t dim, int64_t order,
                             int64_t cache_key, int64_t /*slot*/, int64_t records) {
  if (ffi::Error err = CheckOutputKind(records); err.failure()) return err;
  if (IsTrainableOutput(records)) {
    return RunTrainableLookupCpu(TrainableCall{device_ordinal, table_key, dim, TrainableFormatOf(records), -1, 0}, ids,
                                 *out);
  }
  LookupOutput output;
  if (ffi::Error err = CheckOutput(ids, *out, dim, records == 1, &output); err.failure()) return err;
  return RunCachedLookupCpu(MakeCachedLookupCall(device_ordinal, table_key, dim, 0, order, cache_key, nullptr, 0), ids,
                            output);
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupStartCpu, engram::NoThrow<engram::LookupStartCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids: read by done here
                                  .RemainingArgs()                         // after: values it waits for; not read
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()  // ticket: zeros on the CPU
                                  .Attr<int64_t>("table_key")              // registry key of the table
                                  .Attr<int64_t>("dim")                    // values per row
                                  .Attr<int64_t>("max_ctas")               // CUDA grid size; ignored here
                                  .Attr<int64_t>("order")                  // VisitOrder: plain, sorted, dedup
                                  .Attr<int64_t>("cache_key")              // hot-row cache key, 0: none
                                  .Attr<int64_t>("slot")                   // start/done pairing; unused here
                                  .Attr<int64_t>("records"));              // what done returns (train_args.h)

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupDoneCpu, engram::NoThrow<engram::LookupDoneCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()          // which device's table and cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // start's ticket; unused here
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids: global row numbers
                                  .Ret<xla::ffi::AnyBuffer>()              // rows, packed records or trainable rows
                                  .Attr<int64_t>("table_key")              // registry key of the table
                                  .Attr<int64_t>("dim")                    // values per row
                                  .Attr<int64_t>("order")                  // VisitOrder: plain, sorted, dedup
                                  .Attr<int64_t>("cache_key")              // hot-row cache key, 0: none
                                  .Attr<int64_t>("slot")                   // start/done pairing; unused here
                                  .Attr<int64_t>("records"));              // what it returns (train_args.h)
