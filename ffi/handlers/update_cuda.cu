// XLA FFI handlers of engram_apply_gradients on CUDA: checks the call against
// the trainable table's registry entry, then queues the sort of the ids and the
// update kernel (kernels/train.cuh: why the update runs on the GPU is said
// there), which reads each distinct row and its state from host-mapped memory
// or HBM and writes them back: on XLA's stream, or (apply_gradients_start /
// apply_gradients_done) on the side stream the prefetches use, on few CTAs,
// waited for only at done. No host round trip, no synchronisation; nothing is
// launched unless every check passed.
#include <cuda_runtime.h>

#include "handlers/cuda_errors.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "handlers/train_args.h"
#include "kernels/staging.cuh"
#include "kernels/train.cuh"
#include "runtime/prefetch_device.cuh"
#include "runtime/prefetch_site.h"
#include "runtime/stream_capture.h"

namespace engram {
namespace {

ffi::Error ApplyGradientsCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                  ffi::AnyBuffer grads, ffi::Buffer<ffi::F32> learning_rate,
                                  ffi::RemainingArgs /*after*/, ffi::Result<ffi::Buffer<ffi::U8>> result,
                                  int64_t table_key, int64_t dim, int64_t format, int64_t optimizer,
                                  int64_t moment_format, float eps, float one_minus_b1, float one_minus_b2) {
  UpdateParams params;
  if (ffi::Error err = PrepareUpdateBuffers(ids, grads, learning_rate, result, dim, optimizer, &params);
      err.failure()) {
    return err;
  }
  TrainableCall call{device_ordinal, table_key, dim, format, optimizer, moment_format};
  bool writer = true;
  if (ffi::Error err = PrepareTrainable(call, GpuCanRead, "CUDA", &params.t, &writer); err.failure()) return err;
  params.scalars = OptimizerScalars{eps, one_minus_b1, one_minus_b2};
  // The token is zeroed by the sort's first kernel where an update runs; a
  // memset would add a launch and a gap to every small call.
  if (!writer || params.num_ids == 0) {  // not writer: another device's entry writes this memory
    if (cudaError_t err = cudaMemsetAsync(result->untyped_data(), 0, kUpdateTokenBytes, stream); err != cudaSuccess) {
      return CudaError("apply_gradients token", err);
    }
    return ffi::Error::Success();
  }
  ZeroWords token{reinterpret_cast<uint32_t*>(result->untyped_data()), kUpdateTokenBytes / 4};
  if (cudaError_t err = LaunchUpdate(params, stream, 0, token); err != cudaSuccess) {
    return CudaError("apply_gradients launch", err);
  }
  return ffi::Error::Success();
}

// The background update is safe as lookup_start is (prefetch_cuda.cu): start,
// on XLA's stream, copies the ids, gradients and learning rate into its call
// site's staging and only then forks the sort and update, which read nothing
// else XLA owns, onto the side stream; done makes XLA's stream wait for the
// slot's newest update and records the slot's release, which the site's next
// start waits for before it restages. The table itself is the caller's to
// order: a lookup that must see the new rows takes done's token as `after`.
ffi::Error ApplyGradientsStartCudaImpl(cudaStream_t stream, int32_t device_ordinal, PrefetchSite* site,
                                       ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer grads,
                                       ffi::Buffer<ffi::F32> learning_rate, ffi::RemainingArgs /*after*/,
                                       ffi::ResultBuffer<ffi::U32> ticket, int64_t table_key, int64_t dim,
                                       int64_t format, int64_t optimizer, int64_t moment_format, float eps,
                                       float one_minus_b1, float one_minus_b2, int64_t max_ctas, int64_t slot) {
  UpdateParams params;
  if (ffi::Error err = PrepareUpdateInputs(ids, grads, learning_rate, dim, optimizer, &params); err.failure()) {
    return err;
  }
  const int64_t ticket_words = static_cast<int64_t>(ticket->element_count());
  if (ffi::Error err = CheckTicket(ticket_words, "apply_gradients_start"); err.failure()) return err;
  if (site == nullptr) {
    return ffi::Error::Internal("engram_jax apply_gradients_start: XLA gave the call no call-site state");
  }
  TrainableCall call{device_ordinal, table_key, dim, format, optimizer, moment_format};
  bool writer = true;
  if (ffi::Error err = PrepareTrainable(call, GpuCanRead, "CUDA", &params.t, &writer); err.failure()) return err;
  params.scalars = OptimizerScalars{eps, one_minus_b1, one_minus_b2};
  bool capturing = false;
  if (cudaError_t err = IsCapturing(stream, &capturing); err != cudaSuccess) {
    return CudaError("apply_gradients_start: capture status", err);
  }
  if (capturing) {
    return ffi::Error::Internal(
        "engram_jax apply_gradients_start cannot be recorded into a CUDA graph (its update "
        "outlives the call); XLA should have run it between its graphs");
  }
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(device_ordinal, &dev); err != cudaSuccess) {
    return CudaError("apply_gradients_start: side stream setup", err);
  }
  // Staging: the ids; the gradients, then the learning rate 16-byte aligned after
  // them (the kernel's wide loads need the gradients aligned, as staging is); the
  // sort's and chunk sums' workspace.
  const int64_t n = params.num_ids;
  const int64_t grads_bytes = static_cast<int64_t>(grads.size_bytes());
  const int64_t lr_offset = (grads_bytes + 15) / 16 * 16;
  const int64_t workspace_bytes = UpdateWorkspaceBytes(n, dim);
  SiteStaging* staging = nullptr;
  if (cudaError_t err =
          site->Reserve(*dev, device_ordinal, stream, slot, n * 4, lr_offset + 16, workspace_bytes, &staging);
      err != cudaSuccess) {
    return StagingError("apply_gradients_start: staging", err, n * 4 + lr_offset + 16 + workspace_bytes);
  }
  uint8_t* staged_grads = reinterpret_cast<uint8_t*>(staging->rows);
  StageArgs stage{ids.typed_data(),   staging->ids,   n, ticket->typed_data(), ticket_words,
                  dev->descriptors(), site->number(), {}};
  stage.descriptor.generation = PrefetchSite::NextGeneration();  // no rows for a done to copy: rows stays 0
  stage.scalar = params.lr;
  stage.staged_scalar = reinterpret_cast<float*>(staged_grads + lr_offset);
  cudaError_t err = cudaSuccess;
  {
    // Restage only once the site's last update has read its staging, and its last done released the slot.
    std::lock_guard<std::mutex> lock(dev->mutex());
    err = cudaStreamWaitEvent(stream, dev->released(slot), cudaEventWaitDefault);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, staging->last_gather, cudaEventWaitDefault);
  }
  if (err == cudaSuccess) err = LaunchStage(stage, stream);  // the ids, the learning rate, the ticket
  if (err == cudaSuccess && grads_bytes > 0) {
    err =
        cudaMemcpyAsync(staged_grads, params.grads, static_cast<size_t>(grads_bytes), cudaMemcpyDeviceToDevice, stream);
  }
  if (err != cudaSuccess) return CudaError("apply_gradients_start: staging the inputs", err);
  params.ids = staging->ids;
  params.grads = staged_grads;
  params.lr = stage.staged_scalar;
  params.workspace = staging->workspace;
  params.workspace_bytes = staging->workspace_bytes;
  // Another device's entry that writes this memory: the fork still records the
  // slot's event, so done waits as everywhere, for nothing.
  err = ForkPrefetch(*dev, stream, slot, staging->last_gather, [&](cudaStream_t side) {
    return writer ? LaunchUpdate(params, side, CudaMaxCtas(max_ctas)) : cudaSuccess;
  });
  if (err != cudaSuccess) return CudaError("apply_gradients_start launch", err);
  return ffi::Error::Success();
}

ffi::Error ApplyGradientsDoneCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::U32> ticket,
                                      ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t slot) {
  if (ffi::Error err = CheckTicket(static_cast<int64_t>(ticket.element_count()), "apply_gradients_done");
      err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckUpdateToken(token); err.failure()) return err;
  bool capturing = false;
  if (cudaError_t err = IsCapturing(stream, &capturing); err != cudaSuccess) {
    return CudaError("apply_gradients_done: capture status", err);
  }
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(device_ordinal, &dev); err != cudaSuccess) {
    return CudaError("apply_gradients_done: side stream setup", err);
  }
  cudaError_t err = WaitPrefetch(*dev, stream, slot, capturing);
  if (err == cudaSuccess) err = cudaMemsetAsync(token->untyped_data(), 0, token->size_bytes(), stream);
  if (err == cudaSuccess) err = ReleasePrefetch(*dev, stream, slot, capturing);
  if (err != cudaSuccess) return CudaError("apply_gradients_done", err);
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
                                  .RemainingArgs()                        // after: values it waits for; not read
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()  // token (zeroed), then the workspace
                                  .Attr<int64_t>("table_key")             // registry key of the table
                                  .Attr<int64_t>("dim")                   // values per row
                                  .Attr<int64_t>("format")                // RowFormat of the rows
                                  .Attr<int64_t>("optimizer")             // RowOptimizerKind
                                  .Attr<int64_t>("moment_format")         // RowFormat of the moments
                                  .Attr<float>("eps")                     // the optimizer's epsilon
                                  .Attr<float>("one_minus_b1")            // lazy Adam: 1 - b1
                                  .Attr<float>("one_minus_b2"));          // lazy Adam: 1 - b2

// Not command-buffer compatible: its update outlives the call (as lookup_start's gather).
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramApplyGradientsStartCuda, engram::NoThrow<engram::ApplyGradientsStartCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: the fork point
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table entry
                                  .Ctx<xla::ffi::State<engram::PrefetchSite>>()   // this call site's staging
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Arg<xla::ffi::AnyBuffer>()                     // grads: f32/bf16
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // learning rate, in HBM
                                  .RemainingArgs()                         // after: values it waits for; not read
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()  // ticket: names site and start
                                  .Attr<int64_t>("table_key")              // registry key of the table
                                  .Attr<int64_t>("dim")                    // values per row
                                  .Attr<int64_t>("format")                 // RowFormat of the rows
                                  .Attr<int64_t>("optimizer")              // RowOptimizerKind
                                  .Attr<int64_t>("moment_format")          // RowFormat of the moments
                                  .Attr<float>("eps")                      // the optimizer's epsilon
                                  .Attr<float>("one_minus_b1")             // lazy Adam: 1 - b1
                                  .Attr<float>("one_minus_b2")             // lazy Adam: 1 - b2
                                  .Attr<int64_t>("max_ctas")               // the row kernels' grid; <= 0: any
                                  .Attr<int64_t>("slot"));                 // completion event of the site

// Command-buffer compatible, as lookup_done: captured, its wait is an external
// event-wait node resolved at each graph launch to the update the start before it forked.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramApplyGradientsDoneCuda, engram::NoThrow<engram::ApplyGradientsDoneCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: waits here
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // whose events
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // ticket from start
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // update token: a zero scalar
                                  .Attr<int64_t>("slot"),                         // completion event to wait on
                              {xla::ffi::Traits::kCmdBufferCompatible});
