// XLA FFI handlers for CUDA. Thin adapters: decode the call, resolve the
// table for this device, launch the framework-free gather from kernels/ on
// XLA's stream, and turn any CUDA error into an ffi::Error.
#include <cuda_runtime.h>

#include <string>

#include "cuda_handlers.h"
#include "kernels/gather.cuh"
#include "lookup_adapter.h"

namespace engram {
namespace {

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("engram_jax ") + what + ": " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

ffi::Error LookupCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                          ffi::ResultBuffer<ffi::BF16> out, int64_t table_key, int64_t dim, int64_t max_ctas) {
  GatherParams params;
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, out, GpuCanRead, "CUDA", &params);
      err.failure()) {
    return err;
  }
  if (cudaError_t err = LaunchGather(params, static_cast<int>(max_ctas), stream); err != cudaSuccess) {
    return CudaError("lookup launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace

}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupCuda, engram::LookupCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows: ids.shape + (dim,)
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas"));                    // grid size; <= 0: every SM

// ---------------------------------------------------------------------------
// lookup_start / lookup_done (asynchronous prefetch). start forks the gather
// onto the device's shared side stream (after the ids are ready on XLA's stream)
// and records the call site's slot event; done makes XLA's stream wait on it.
// They were written when gather.cuh's kernel could be compiled into one
// translation unit only (it is static now).
//
// Command buffers (CUDA graphs): neither is marked compatible. A captured fork
// would have to be joined inside the same capture (start would wait for its
// own gather), and a captured done would wait on an event recorded outside the
// graph; XLA runs both as ordinary thunks between its graphs.
#include "kernels/prefetch_stream.cuh"
#include "prefetch_adapter.h"
#include "prefetch_handlers.h"

namespace engram {
namespace {

ffi::Error LookupStartCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                               ffi::ResultBuffer<ffi::BF16> rows, int64_t table_key, int64_t dim, int64_t max_ctas,
                               int64_t slot) {
  GatherParams params;
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, rows, GpuCanRead, "CUDA", &params);
      err.failure()) {
    return err;
  }
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(stream, &dev); err != cudaSuccess) {
    return CudaError("lookup_start: side stream setup", err);
  }
  if (cudaError_t err = EnqueuePrefetch(*dev, params, static_cast<int>(max_ctas), stream, slot); err != cudaSuccess) {
    return CudaError("lookup_start launch", err);
  }
  return ffi::Error::Success();
}

ffi::Error LookupDoneCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::S32> ids,
                              ffi::ResultBuffer<ffi::BF16> out, int64_t slot) {
  if (ffi::Error err = CheckDoneBuffers(rows, ids, out); err.failure()) return err;
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(stream, &dev); err != cudaSuccess) {
    return CudaError("lookup_done: side stream setup", err);
  }
  if (cudaError_t err = WaitPrefetch(*dev, stream, slot); err != cudaSuccess) {
    return CudaError("lookup_done wait", err);
  }
  // The output aliases the rows operand; copy only if XLA ever hands a separate buffer.
  if (out->untyped_data() != rows.untyped_data() && rows.size_bytes() > 0) {
    if (cudaError_t err = cudaMemcpyAsync(out->untyped_data(), rows.untyped_data(), rows.size_bytes(),
                                          cudaMemcpyDeviceToDevice, stream);
        err != cudaSuccess) {
      return CudaError("lookup_done copy", err);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupStartCuda, engram::LookupStartCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: the fork point
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table entry
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows, written on the side stream
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas")                      // grid size; <= 0: every SM
                                  .Attr<int64_t>("slot"));                        // completion event of this site

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupDoneCuda, engram::LookupDoneCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: waits here
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows written by start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids, kept alive until here
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // the rows (aliases operand 0)
                                  .Attr<int64_t>("slot"));                        // completion event to wait on
// Neither start nor done is command-buffer compatible: a captured done would
// wait on an event recorded outside the graph, and XLA traces command buffers
// before any start has run (creating the side stream under capture fails).
// XLA runs both as ordinary steps between its graphs.

// ---------------------------------------------------------------------------
// engram_cached_lookup: the lookup with visiting order, deduplication and the
// HBM hot-row cache (kernels/dedup.cuh). Here because gather.cuh's GatherKernel
// may be compiled into one translation unit only. Not marked command-buffer
// compatible on purpose: it resolves the table and the cache's active buffer
// set each time it runs, so a cache refresh takes effect without recompiling.
#include "dedup_cuda.h"
#include "dedup_handlers.h"
#include "kernels/dedup.cuh"

namespace engram {

namespace {

ffi::Error CachedLookupCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::U8> workspace,
                                int64_t table_key, int64_t dim, int64_t max_ctas, int64_t order, int64_t cache_key) {
  CachedLookupCall call;
  call.device_ordinal = device_ordinal;
  call.table_key = table_key;
  call.dim = dim;
  call.max_ctas = max_ctas;
  call.order = order;
  call.cache_key = cache_key;
  call.workspace = workspace->typed_data();
  call.workspace_bytes = static_cast<int64_t>(workspace->element_count());
  return RunCachedLookupCuda(stream, call, ids, out);
}

}  // namespace

ffi::Error RunCachedLookupCuda(cudaStream_t stream, const CachedLookupCall& call, ffi::Buffer<ffi::S32> ids,
                               ffi::ResultBuffer<ffi::BF16> out) {
  DedupGatherParams params;
  CacheLease lease;
  if (ffi::Error err = PrepareCachedLookup(call, ids, out, GpuCanRead, "CUDA", &params, &lease); err.failure()) {
    ReleaseCache(&lease, nullptr);
    return err;
  }
  const cudaError_t launched = LaunchDedupLookup(params, static_cast<int>(call.max_ctas), stream);
  // The fence goes on the stream even after a failed launch: whatever was queued before it is covered.
  const std::string fence_error = ReleaseCache(&lease, stream);
  if (launched != cudaSuccess) {
    return ffi::Error::Internal(std::string("engram_jax cached lookup launch: ") + cudaGetErrorName(launched) + ": " +
                                cudaGetErrorString(launched));
  }
  if (!fence_error.empty()) return ffi::Error::Internal("engram_jax cached lookup: " + fence_error);
  return ffi::Error::Success();
}

}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupCuda, engram::CachedLookupCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table and cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows: ids.shape + (dim,)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()          // workspace for the sort
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas")                      // grid size; <= 0: every SM
                                  .Attr<int64_t>("order")                         // VisitOrder: plain, sorted, dedup
                                  .Attr<int64_t>("cache_key"));                   // hot-row cache key, 0: none

// engram_cached_lookup_start / _done: the same work forked onto the prefetch
// side stream (kernels/prefetch_stream.cuh), so it overlaps with the model;
// done waits for it on XLA's stream and keeps ids and workspace alive until then.
namespace engram {
namespace {

ffi::Error CachedLookupStartCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> ids,
                                     ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::U8> workspace,
                                     int64_t table_key, int64_t dim, int64_t max_ctas, int64_t order, int64_t cache_key,
                                     int64_t slot) {
  CachedLookupCall call;
  call.device_ordinal = device_ordinal;
  call.table_key = table_key;
  call.dim = dim;
  call.max_ctas = max_ctas;
  call.order = order;
  call.cache_key = cache_key;
  call.workspace = workspace->typed_data();
  call.workspace_bytes = static_cast<int64_t>(workspace->element_count());
  bool capturing = false;
  if (cudaError_t err = IsCapturing(stream, &capturing); err != cudaSuccess) {
    return CudaError("cached lookup_start: capture status", err);
  }
  if (capturing) return RunCachedLookupCuda(stream, call, ids, out);
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(stream, &dev); err != cudaSuccess) {
    return CudaError("cached lookup_start: side stream setup", err);
  }
  std::lock_guard<std::mutex> lock(dev->mutex());
  if (cudaError_t err = cudaEventRecord(dev->fork(), stream); err != cudaSuccess) {
    return CudaError("cached lookup_start: fork", err);
  }
  if (cudaError_t err = cudaStreamWaitEvent(dev->side(), dev->fork(), cudaEventWaitDefault); err != cudaSuccess) {
    return CudaError("cached lookup_start: fork", err);
  }
  if (ffi::Error err = RunCachedLookupCuda(dev->side(), call, ids, out); err.failure()) return err;
  if (cudaError_t err = cudaEventRecord(dev->done(slot), dev->side()); err != cudaSuccess) {
    return CudaError("cached lookup_start: completion event", err);
  }
  return ffi::Error::Success();
}

ffi::Error CachedLookupDoneCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> rows, ffi::Buffer<ffi::S32> ids,
                                    ffi::Buffer<ffi::U8> /*workspace*/, ffi::ResultBuffer<ffi::BF16> out,
                                    int64_t slot) {
  if (ffi::Error err = CheckDoneBuffers(rows, ids, out); err.failure()) return err;
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(stream, &dev); err != cudaSuccess) {
    return CudaError("cached lookup_done: side stream setup", err);
  }
  if (cudaError_t err = WaitPrefetch(*dev, stream, slot); err != cudaSuccess) {
    return CudaError("cached lookup_done wait", err);
  }
  if (out->untyped_data() != rows.untyped_data() && rows.size_bytes() > 0) {
    if (cudaError_t err = cudaMemcpyAsync(out->untyped_data(), rows.untyped_data(), rows.size_bytes(),
                                          cudaMemcpyDeviceToDevice, stream);
        err != cudaSuccess) {
      return CudaError("cached lookup_done copy", err);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupStartCuda, engram::CachedLookupStartCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: the fork point
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table and cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows, written on the side stream
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()          // workspace for the sort
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas")                      // grid size; <= 0: every SM
                                  .Attr<int64_t>("order")                         // VisitOrder: plain, sorted, dedup
                                  .Attr<int64_t>("cache_key")                     // hot-row cache key, 0: none
                                  .Attr<int64_t>("slot"));                        // completion event of this site

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramCachedLookupDoneCuda, engram::CachedLookupDoneCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: waits here
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()        // rows written by start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids, kept alive until here
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()          // workspace, kept alive until here
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // the rows (aliases operand 0)
                                  .Attr<int64_t>("slot"));                        // completion event to wait on
// Neither start nor done is command-buffer compatible: a captured done would
// wait on an event recorded outside the graph, and XLA traces command buffers
// before any start has run (creating the side stream under capture fails).
// XLA runs both as ordinary steps between its graphs.
