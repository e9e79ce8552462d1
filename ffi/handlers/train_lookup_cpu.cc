// XLA FFI handler of engram_train_lookup on the CPU platform: the rows of a
// trainable table in its own dtype (float32 or bfloat16), zeros for ids it does
// not hold, copied under a lease so close() waits for the read
// (RunTrainableLookupCpu, which the CPU lookup_done of a trainable table runs too).
#include "handlers/train_lookup_cpu.h"

#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "handlers/train_args.h"
#include "kernels/train_cpu.h"

namespace engram {
namespace {

ffi::Error TrainLookupCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::RemainingArgs /*after*/,
                              ffi::Result<ffi::AnyBuffer> rows, int64_t table_key, int64_t dim, int64_t format) {
  return RunTrainableLookupCpu(TrainableCall{device_ordinal, table_key, dim, format, -1, 0}, ids, *rows);
}

}  // namespace

ffi::Error RunTrainableLookupCpu(const TrainableCall& call, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer rows) {
  if (ffi::Error err = CheckTrainableRows(ids, rows, call); err.failure()) return err;
  TrainableView view;
  bool writer = true;
  TableLease lease;
  if (ffi::Error err = PrepareTrainable(call, CpuCanRead, "CPU", &view, &writer, &lease); err.failure()) return err;
  GatherTrainableCpu(view, ids.typed_data(), static_cast<int64_t>(ids.element_count()),
                     static_cast<uint8_t*>(rows.untyped_data()), CpuLookupThreads());
  return ffi::Error::Success();
}

}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramTrainLookupCpu, engram::NoThrow<engram::TrainLookupCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()          // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids: global row numbers
                                  .RemainingArgs()                         // after: values it waits for; not read
                                  .Ret<xla::ffi::AnyBuffer>()              // rows: ids.shape + (dim,), table dtype
                                  .Attr<int64_t>("table_key")              // registry key of the table
                                  .Attr<int64_t>("dim")                    // values per row
                                  .Attr<int64_t>("format"));               // RowFormat of the rows
