// XLA FFI handler of engram_apply_gradients on the CPU platform: checks the
// call against the trainable table's registry entry (under a lease, so close()
// waits for it), then sorts the ids, sums each run of equal ids in
// train_rows.h's chunked order and updates each distinct row once in place
// (kernels/train_cpu.h).
// apply_gradients_start runs the same update at once (a CPU has no stream to
// overlap with) and apply_gradients_done only returns the token.
// Nothing is written unless every check passed.
#include <cstring>
#include <vector>

#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "handlers/train_args.h"
#include "kernels/train_cpu.h"

namespace engram {
namespace {

// The update of `params` (inputs and workspace set) on the table `call` names,
// under a lease, so close() waits for it.
ffi::Error RunUpdateCpu(const TrainableCall& call, OptimizerScalars scalars, UpdateParams* params) {
  bool writer = true;
  TableLease lease;
  if (ffi::Error err = PrepareTrainable(call, CpuCanRead, "CPU", &params->t, &writer, &lease); err.failure()) {
    return err;
  }
  params->scalars = scalars;
  if (!writer) return ffi::Error::Success();  // another device's entry writes this memory
  if (!UpdateCpu(*params, CpuLookupThreads())) {
    return ffi::Error::Internal("engram_jax apply_gradients: workspace too small");
  }
  return ffi::Error::Success();
}

ffi::Error ApplyGradientsCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer grads,
                                 ffi::Buffer<ffi::F32> learning_rate, ffi::RemainingArgs /*after*/,
                                 ffi::Result<ffi::Buffer<ffi::U8>> result, int64_t table_key, int64_t dim,
                                 int64_t format, int64_t optimizer, int64_t moment_format, float eps,
                                 float one_minus_b1, float one_minus_b2) {
  UpdateParams params;
  if (ffi::Error err = PrepareUpdateBuffers(ids, grads, learning_rate, result, dim, optimizer, &params);
      err.failure()) {
    return err;
  }
  std::memset(result->untyped_data(), 0, kUpdateTokenBytes);
  return RunUpdateCpu(TrainableCall{device_ordinal, table_key, dim, format, optimizer, moment_format},
                      OptimizerScalars{eps, one_minus_b1, one_minus_b2}, &params);
}

ffi::Error ApplyGradientsStartCpuImpl(int32_t device_ordinal, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer grads,
                                      ffi::Buffer<ffi::F32> learning_rate, ffi::RemainingArgs /*after*/,
                                      ffi::ResultBuffer<ffi::U32> ticket, int64_t table_key, int64_t dim,
                                      int64_t format, int64_t optimizer, int64_t moment_format, float eps,
                                      float one_minus_b1, float one_minus_b2, int64_t /*max_ctas*/, int64_t /*slot*/) {
  UpdateParams params;
  if (ffi::Error err = PrepareUpdateInputs(ids, grads, learning_rate, dim, optimizer, &params); err.failure()) {
    return err;
  }
  std::vector<uint8_t> workspace(static_cast<size_t>(UpdateCpuWorkspaceBytes(params.num_ids)));
  params.workspace = workspace.data();
  params.workspace_bytes = static_cast<int64_t>(workspace.size());
  if (ticket->size_bytes() > 0) std::memset(ticket->untyped_data(), 0, ticket->size_bytes());
  return RunUpdateCpu(TrainableCall{device_ordinal, table_key, dim, format, optimizer, moment_format},
                      OptimizerScalars{eps, one_minus_b1, one_minus_b2}, &params);
}

ffi::Error ApplyGradientsDoneCpuImpl(ffi::Buffer<ffi::U32> /*ticket*/, ffi::Result<ffi::Buffer<ffi::S32>> token,
                                     int64_t /*slot*/) {
  if (ffi::Error err = CheckUpdateToken(token); err.failure()) return err;
  std::memset(token->untyped_data(), 0, token->size_bytes());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramApplyGradientsCpu, engram::NoThrow<engram::ApplyGradientsCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()          // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids: global row numbers
                                  .Arg<xla::ffi::AnyBuffer>()              // grads: ids.shape + (dim,), f32/bf16
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // learning rate (lazy Adam: step size)
                                  .RemainingArgs()                         // after: values it waits for; not read
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // token (zeroed), then the sort's workspace
                                  .Attr<int64_t>("table_key")              // registry key of the table
                                  .Attr<int64_t>("dim")                    // values per row
                                  .Attr<int64_t>("format")                 // RowFormat of the rows
                                  .Attr<int64_t>("optimizer")              // RowOptimizerKind
                                  .Attr<int64_t>("moment_format")          // RowFormat of lazy Adam's moments
                                  .Attr<float>("eps")                      // the optimizer's epsilon
                                  .Attr<float>("one_minus_b1")             // lazy Adam: 1 - b1
                                  .Attr<float>("one_minus_b2"));           // lazy Adam: 1 - b2

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramApplyGradientsStartCpu, engram::NoThrow<engram::ApplyGradientsStartCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()          // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids: global row numbers
                                  .Arg<xla::ffi::AnyBuffer>()              // grads: ids.shape + (dim,), f32/bf16
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // learning rate (lazy Adam: step size)
                                  .RemainingArgs()                         // after: values it waits for; not read
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()  // ticket: zeros on the CPU
                                  .Attr<int64_t>("table_key")              // registry key of the table
                                  .Attr<int64_t>("dim")                    // values per row
                                  .Attr<int64_t>("format")                 // RowFormat of the rows
                                  .Attr<int64_t>("optimizer")              // RowOptimizerKind
                                  .Attr<int64_t>("moment_format")          // RowFormat of lazy Adam's moments
                                  .Attr<float>("eps")                      // the optimizer's epsilon
                                  .Attr<float>("one_minus_b1")             // lazy Adam: 1 - b1
                                  .Attr<float>("one_minus_b2")             // lazy Adam: 1 - b2
                                  .Attr<int64_t>("max_ctas")               // CUDA grid size; ignored here
                                  .Attr<int64_t>("slot"));                 // start/done pairing; unused here

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramApplyGradientsDoneCpu, engram::NoThrow<engram::ApplyGradientsDoneCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // start's ticket; unused here
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // update token: a zero scalar
                                  .Attr<int64_t>("slot"));                 // start/done pairing; unused here
