// XLA FFI handlers of the asynchronous lookup on CUDA (lookup_start /
// lookup_done, every visiting order, the hot-row cache, rows or packed
// records, and the rows of a trainable table in its dtype), and the
// instantiation handler that gives each compiled start its call site.
#include <cuda_runtime.h>

#include <string>

#include "handlers/cuda_errors.h"
#include "handlers/lookup_args.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "handlers/train_args.h"
#include "kernels/dedup.cuh"
#include "kernels/staging.cuh"
#include "kernels/train.cuh"
#include "runtime/capture_count.h"
#include "runtime/prefetch_device.cuh"
#include "runtime/prefetch_site.h"
#include "runtime/stream_capture.h"

// Why the asynchronous lookup is safe: work that outlives a call touches only
// memory the library owns. XLA promises a custom call's operands and results
// only for the duration of the call (it may give each consumer of a value its
// own buffer and reuse the start's at once), so:
// - start, on XLA's stream, copies the ids into its site's staging and writes
//   the site's descriptor and the ticket (its only result, an XLA value); only
//   then does it fork the gather, which reads the staged ids and writes the
//   staged rows (or, for a packed exchange, packed records: bytes all the same)
//   on the side stream;
// - done, on XLA's stream, waits for the slot's gather and copies the rows of
//   the site its ticket names into its own result (FinishKernel); the ticket
//   carries the start's generation, so rows that a later start of the site
//   rewrote come back as NaN, never as another call's rows;
// - the next start of a site first waits for the slot's release event (recorded
//   after each done's copy) and for the site's own last gather, so it rewrites
//   the staging only once it is read, or once nothing writes it any more (a
//   start whose handle was dropped).
// Graph capture: start is not capturable (its gather outlives the call); done
// is, as an external event-wait node, a kernel node and an external event-record
// node. vmap, scan and while loops: a site is one instruction, run once per
// iteration on one stream, its done inside the same iteration. Several call
// sites share the in-order side stream; their slots keep their waits apart.
// Several devices: staging, descriptors and events are per device. A table
// closed meanwhile: close() synchronises the devices before the memory goes.

namespace engram {
namespace {

// No exception may cross the FFI boundary (NoThrow covers handlers returning ffi::Error).
xla::ffi::ErrorOr<std::unique_ptr<PrefetchSite>> SiteInstantiate() noexcept {
  try {
    return PrefetchSite::Create();
  } catch (...) {
    return xla::ffi::Unexpected(xla::ffi::Error(xla::ffi::ErrorCode::kResourceExhausted,
                                                "engram_jax lookup_start / apply_gradients_start: no call-site state"));
  }
}

ffi::Error LookupStartCudaImpl(cudaStream_t stream, int32_t device_ordinal, PrefetchSite* site,
                               ffi::Buffer<ffi::S32> ids, ffi::RemainingArgs /*after*/,
                               ffi::ResultBuffer<ffi::U32> ticket, int64_t table_key, int64_t dim, int64_t max_ctas,
                               int64_t order, int64_t cache_key, int64_t slot, int64_t records) {
  const int64_t num_ids = static_cast<int64_t>(ids.element_count());
  const int64_t ticket_words = static_cast<int64_t>(ticket->element_count());
  if (ffi::Error err = CheckTicket(ticket_words, "lookup_start"); err.failure()) return err;
  if (ffi::Error err = CheckOutputKind(records); err.failure()) return err;
  const bool trainable = IsTrainableOutput(records);
  if (site == nullptr) return ffi::Error::Internal("engram_jax lookup_start: XLA gave the call no call-site state");
  // The sizes below are computed before the full checks (which need the staging).
  if (!ValidVisitOrder(order) || dim <= 0 || dim > kMaxDim || num_ids > INT32_MAX) {
    return ffi::Error::InvalidArgument("engram_jax lookup_start: order must be 0-2, dim in 1.." +
                                       std::to_string(kMaxDim) + " and at most 2**31 - 1 ids per call");
  }
  bool capturing = false;
  if (cudaError_t err = IsCapturing(stream, &capturing); err != cudaSuccess) {
    return CudaError("lookup_start: capture status", err);
  }
  if (capturing) {
    return ffi::Error::Internal(
        "engram_jax lookup_start cannot be recorded into a CUDA graph (its gather "
        "outlives the call); XLA should have run it between its graphs");
  }
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(device_ordinal, &dev); err != cudaSuccess) {
    return CudaError("lookup_start: side stream setup", err);
  }
  // A trainable table's rows are copied as stored (train.cuh), in its dtype; no sort, no cache.
  const TrainableCall train_call{device_ordinal, table_key, dim, TrainableFormatOf(records), -1, 0};
  TrainableView view;
  if (trainable) {
    bool writer = true;
    if (ffi::Error err = PrepareTrainable(train_call, GpuCanRead, "CUDA", &view, &writer); err.failure()) return err;
  }
  const int64_t row_bytes = trainable ? dim * ValueBytes(static_cast<RowFormat>(train_call.format))
                                      : (records ? PackedRecordBytes(dim) : dim * 2);
  const int64_t rows_bytes = num_ids * row_bytes;
  const int64_t workspace_bytes = trainable ? 0 : LookupWorkspaceBytes(num_ids, static_cast<VisitOrder>(order));
  SiteStaging* staging = nullptr;
  if (cudaError_t err =
          site->Reserve(*dev, device_ordinal, stream, slot, num_ids * 4, rows_bytes, workspace_bytes, &staging);
      err != cudaSuccess) {
    return StagingError("lookup_start: staging", err, num_ids * 4 + rows_bytes + workspace_bytes);
  }
  const CachedLookupCall call = MakeCachedLookupCall(device_ordinal, table_key, dim, max_ctas, order, cache_key,
                                                     staging->workspace, staging->workspace_bytes);
  LookupOutput staged;
  if (records) {
    staged.records = reinterpret_cast<uint8_t*>(staging->rows);
  } else {
    staged.rows = staging->rows;
  }
  DedupGatherParams params;
  CacheLease lease;
  if (!trainable) {
    if (ffi::Error err = PrepareCachedGather(call, staging->ids, num_ids, staged, GpuCanRead, "CUDA", &params, &lease);
        err.failure()) {
      ReleaseCache(&lease, nullptr);
      return err;
    }
  }

  StageArgs stage{ids.typed_data(), staging->ids,       num_ids,        ticket->typed_data(),
                  ticket_words,     dev->descriptors(), site->number(), {}};
  stage.descriptor.rows = reinterpret_cast<uint64_t>(staging->rows);
  stage.descriptor.bytes = static_cast<uint64_t>(rows_bytes);
  stage.descriptor.generation = PrefetchSite::NextGeneration();
  cudaError_t err = cudaSuccess;
  {
    // Restage only once the site's staging is free: its last rows copied out by a
    // done, and its own last gather finished (a start whose handle was dropped).
    std::lock_guard<std::mutex> lock(dev->mutex());
    err = cudaStreamWaitEvent(stream, dev->released(slot), cudaEventWaitDefault);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, staging->last_gather, cudaEventWaitDefault);
  }
  if (err == cudaSuccess) err = LaunchStage(stage, stream);
  if (err != cudaSuccess) {
    ReleaseCache(&lease, nullptr);
    return CudaError("lookup_start: staging the ids", err);
  }

  std::string fence_error;
  err = ForkPrefetch(*dev, stream, slot, staging->last_gather, [&](cudaStream_t side) {
    if (trainable) {
      return LaunchTrainableGather(view, staging->ids, num_ids, reinterpret_cast<uint8_t*>(staging->rows), side,
                                   CudaMaxCtas(max_ctas));
    }
    const cudaError_t launched = LaunchDedupLookup(params, CudaMaxCtas(max_ctas), side);
    // The fence goes on the stream even after a failed launch: whatever was queued before it is covered.
    fence_error = ReleaseCache(&lease, side);
    return launched;
  });
  ReleaseCache(&lease, nullptr);  // still held only if the fork failed before the launch
  if (err != cudaSuccess) return CudaError("lookup_start launch", err);
  if (!fence_error.empty()) return ffi::Error::Internal("engram_jax lookup_start: " + fence_error);
  return ffi::Error::Success();
}

ffi::Error LookupDoneCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::U32> ticket,
                              ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out, int64_t /*table_key*/,
                              int64_t dim, int64_t /*order*/, int64_t /*cache_key*/, int64_t slot, int64_t records) {
  if (ffi::Error err = CheckTicket(static_cast<int64_t>(ticket.element_count()), "lookup_done"); err.failure())
    return err;
  if (ffi::Error err = CheckOutputKind(records); err.failure()) return err;
  if (IsTrainableOutput(records)) {
    const TrainableCall call{device_ordinal, 0, dim, TrainableFormatOf(records), -1, 0};
    if (ffi::Error err = CheckTrainableRows(ids, *out, call); err.failure()) return err;
  } else {
    LookupOutput output;
    if (ffi::Error err = CheckOutput(ids, *out, dim, records == 1, &output); err.failure()) return err;
  }
  bool capturing = false;
  if (cudaError_t err = IsCapturing(stream, &capturing); err != cudaSuccess) {
    return CudaError("lookup_done: capture status", err);
  }
  if (capturing) CaptureCounter(CapturedCall::kLookupDone).fetch_add(1, std::memory_order_relaxed);
  PrefetchDevice* dev = nullptr;
  if (cudaError_t err = GetPrefetchDevice(device_ordinal, &dev); err != cudaSuccess) {
    return CudaError("lookup_done: side stream setup", err);
  }
  cudaError_t err = WaitPrefetch(*dev, stream, slot, capturing);
  if (err == cudaSuccess) {
    err = LaunchFinish(ticket.typed_data(), dev->descriptors(), kMaxPrefetchSites, out->untyped_data(),
                       static_cast<int64_t>(out->size_bytes()), records == 1 ? kPoisonRecordWord : kPoisonPair,
                       dev->finish_ctas(), stream);
  }
  if (err == cudaSuccess) err = ReleasePrefetch(*dev, stream, slot, capturing);
  if (err != cudaSuccess) return CudaError("lookup_done", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

// Both starts' call sites (lookup_start, apply_gradients_start) are made here.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramSiteInstantiateCuda, engram::SiteInstantiate, xla::ffi::Ffi::BindInstantiate());

// Not command-buffer compatible: its gather outlives the call, which a captured
// graph would have to join inside itself, so XLA runs it between its graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupStartCuda, engram::NoThrow<engram::LookupStartCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: the fork point
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // which device's table and cache
                                  .Ctx<xla::ffi::State<engram::PrefetchSite>>()   // this call site's staging
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: global row numbers
                                  .RemainingArgs()                                // after: values it waits for
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()         // ticket: names site and start
                                  .Attr<int64_t>("table_key")                     // registry key of the table
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("max_ctas")                      // grid size; <= 0: every SM
                                  .Attr<int64_t>("order")                         // VisitOrder
                                  .Attr<int64_t>("cache_key")                     // hot-row cache key, 0: none
                                  .Attr<int64_t>("slot")                          // completion event of the site
                                  .Attr<int64_t>("records"));                     // what it gathers (train_args.h)

// Command-buffer compatible: captured, its wait is an external event-wait node
// that each graph launch resolves to the gather the start before it forked
// (runtime/prefetch_device.cuh), so the layers after it need not leave the graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramLookupDoneCuda, engram::NoThrow<engram::LookupDoneCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: waits here
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // whose events and descriptors
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // ticket from start
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids: only their shape here
                                  .Ret<xla::ffi::AnyBuffer>()                     // rows or packed records (records=1)
                                  .Attr<int64_t>("table_key")                     // the CPU's done reads these
                                  .Attr<int64_t>("dim")                           // values per row
                                  .Attr<int64_t>("order")                         // VisitOrder
                                  .Attr<int64_t>("cache_key")                     // hot-row cache key, 0: none
                                  .Attr<int64_t>("slot")                          // completion event to wait on
                                  .Attr<int64_t>("records"),                      // what it returns (train_args.h)
                              {xla::ffi::Traits::kCmdBufferCompatible});
