// XLA FFI handler of engram_apply_gradients on CUDA: checks the call against
// the trainable table's registry entry, then queues on XLA's stream the sort of
// the ids and the update kernel (kernels/train.cuh: why the update runs on the
// GPU is said there), which reads each distinct row and its state from
// host-mapped memory or HBM and writes them back. No host round trip, no
// synchronisation; nothing is launched unless every check passed.
#include <cuda_runtime.h>

#include "handlers/cuda_errors.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "handlers/train_args.h"
#include "kernels/train.cuh"

namespace engram {
namespace {

ffi::Error ApplyGradientsCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                  ffi::AnyBuffer grads, ffi::Buffer<ffi::F32> learning_rate,
                                  ffi::RemainingArgs /*after*/, ffi::Result<ffi::Buffer<ffi::S32>> token,
                                  ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t table_key, int64_t dim,
                                  int64_t format, int64_t optimizer, int64_t moment_format, float eps,
                                  float one_minus_b1, float one_minus_b2) {
  UpdateParams params;
  if (ffi::Error err = PrepareUpdateBuffers(ids, grads, learning_rate, token, workspace, dim, optimizer, &params);
      err.failure()) {
    return err;
  }
  TrainableCall call{device_ordinal, table_key, dim, format, optimizer, moment_format};
  bool writer = true;
  if (ffi::Error err = PrepareTrainable(call, GpuCanRead, "CUDA", &params.t, &writer); err.failure()) return err;
  params.scalars = OptimizerScalars{eps, one_minus_b1, one_minus_b2};
  if (cudaError_t err = cudaMemsetAsync(token->untyped_data(), 0, token->size_bytes(), stream); err != cudaSuccess) {
    return CudaError("apply_gradients token", err);
  }
  if (!writer) return ffi::Error::Success();  // another device's entry writes this memory
  if (cudaError_t err = LaunchUpdate(params, stream); err != cudaSuccess) {
    return CudaError("apply_gradients launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

// Not command-buffer compatible: each run resolves the table in the registry
// again, so a closed table is an error rather than a write to freed memory.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramApplyGradientsCuda, engram::NoThrow<engram::ApplyGradientsCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Arg<xla::ffi::AnyBuffer>()                     // grads: f32/bf16
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // learning rate, in HBM
                                  .RemainingArgs()                         // after: values it waits for; not read
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // update token: a zero scalar
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // workspace: the sort, the long runs
                                  .Attr<int64_t>("table_key")              // registry key of the table
                                  .Attr<int64_t>("dim")                    // values per row
                                  .Attr<int64_t>("format")                 // RowFormat of the rows
                                  .Attr<int64_t>("optimizer")              // RowOptimizerKind
                                  .Attr<int64_t>("moment_format")          // RowFormat of the moments
                                  .Attr<float>("eps")                      // the optimizer's epsilon
                                  .Attr<float>("one_minus_b1")             // lazy Adam: 1 - b1
                                  .Attr<float>("one_minus_b2"));           // lazy Adam: 1 - b2
