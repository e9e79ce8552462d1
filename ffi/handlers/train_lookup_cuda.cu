// XLA FFI handler of engram_train_lookup on CUDA: the rows of a trainable
// table in its own dtype, copied on XLA's stream from host-mapped memory or HBM
// (kernels/train.cuh), so a lookup after an update on the same stream reads
// the updated rows.
#include <cuda_runtime.h>

#include "handlers/cuda_errors.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "handlers/train_args.h"
#include "kernels/train.cuh"

namespace engram {
namespace {

ffi::Error TrainLookupCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                               ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> rows, int64_t table_key,
                               int64_t dim, int64_t format) {
  TrainableCall call{device_ordinal, table_key, dim, format, -1, 0};
  if (ffi::Error err = CheckTrainableRows(ids, *rows, call); err.failure()) return err;
  TrainableView view;
  bool writer = true;
  if (ffi::Error err = PrepareTrainable(call, GpuCanRead, "CUDA", &view, &writer); err.failure()) return err;
  if (cudaError_t err = LaunchTrainableGather(view, ids.typed_data(), static_cast<int64_t>(ids.element_count()),
                                              static_cast<uint8_t*>(rows->untyped_data()), stream);
      err != cudaSuccess) {
    return CudaError("trainable lookup launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramTrainLookupCuda, engram::NoThrow<engram::TrainLookupCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .RemainingArgs()             // after: values it waits for; not read
                                  .Ret<xla::ffi::AnyBuffer>()  // rows: table dtype
                                  .Attr<int64_t>("table_key")  // registry key of the table
                                  .Attr<int64_t>("dim")        // values per row
                                  .Attr<int64_t>("format"));   // RowFormat of the rows
