// Asynchronous gathers on a side stream: per device, one side stream that every
// prefetch shares (so lookups take turns instead of crowding the SMs), one fork
// event, and a fixed pool of completion events addressed by a slot number.
// Created once per device on first use, never per call; no host sync. No XLA types.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>

#include "capture_count.h"
#include "kernels/gather.cuh"
#include "kernels/gather_params.h"
#include "kernels/stream_capture.h"

namespace engram {

// Completion events per device. A slot is a number the caller keeps constant per
// call site; slots that share an event (slot % kPrefetchSlots) stay correct,
// because every event is recorded on the same in-order side stream: a wait on the
// newest record of an event also covers every earlier gather. Sharing only makes
// a wait longer than it needs to be.
constexpr int kPrefetchSlots = 256;
constexpr int kMaxPrefetchDevices = 64;

class PrefetchDevice {
 public:
  cudaStream_t side() const { return side_; }
  cudaEvent_t fork() const { return fork_; }
  cudaEvent_t done(int64_t slot) const {
    const int64_t i = slot % kPrefetchSlots;
    return done_[static_cast<size_t>(i < 0 ? i + kPrefetchSlots : i)];
  }
  // Serialises record / wait / launch sequences from concurrent host threads, so a
  // wait never pairs with another thread's record of the shared fork event.
  std::mutex& mutex() { return mutex_; }

  // Creates the stream and events on `device`. Stream capture on this thread is
  // relaxed meanwhile, so creating them from inside a captured handler is legal.
  // On failure everything created so far is destroyed again and the first
  // error returned; the capture mode and current device are restored either way.
  cudaError_t Init(int device) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t err = cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess) return err;
    err = CreateOn(device);
    if (err != cudaSuccess) err = Destroy(err);  // still relaxed: destroying is legal too
    const cudaError_t restore = cudaThreadExchangeStreamCaptureMode(&mode);
    if (err == cudaSuccess && restore != cudaSuccess) err = Destroy(restore);  // the caller drops this object
    return err;
  }

 private:
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr;
  std::array<cudaEvent_t, kPrefetchSlots> done_{};
  std::mutex mutex_;

  // The handles, made on `device`; the caller's current device is put back.
  cudaError_t CreateOn(int device) {
    int previous = 0;
    cudaError_t err = cudaGetDevice(&previous);
    if (err != cudaSuccess) return err;
    if ((err = cudaSetDevice(device)) != cudaSuccess) return err;  // nothing changed yet
    err = cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming);
    for (auto& event : done_) {
      if (err != cudaSuccess) break;
      err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    }
    const cudaError_t restore = cudaSetDevice(previous);
    return err != cudaSuccess ? err : restore;
  }

  // Destroys every handle made so far, for a failed Init whose error is
  // `first`: every destroy runs and is checked; the first error is returned.
  cudaError_t Destroy(cudaError_t first) {
    const auto keep = [&first](cudaError_t err) {
      if (first == cudaSuccess) first = err;
    };
    for (auto& event : done_) {
      if (event != nullptr) keep(cudaEventDestroy(event));
      event = nullptr;
    }
    if (fork_ != nullptr) keep(cudaEventDestroy(fork_));
    fork_ = nullptr;
    if (side_ != nullptr) keep(cudaStreamDestroy(side_));
    side_ = nullptr;
    return first;
  }
};

// The resources of CUDA device `device` (XLA's device ordinal: the handler's
// stream may be capturing, and the stream's own device cannot be asked for then),
// created on first use and kept for the life of the process (destroying them at
// exit could run after the driver has shut down).
// Deliberately inline, not static: its registry must be one per process, shared
// by every translation unit whose handlers fork or wait (start and done may be
// compiled apart).
inline cudaError_t GetPrefetchDevice(int device, PrefetchDevice** out) {
  static std::mutex registry_mutex;
  static std::array<std::unique_ptr<PrefetchDevice>, kMaxPrefetchDevices> devices;
  cudaError_t err = cudaSuccess;
  if (device < 0 || device >= kMaxPrefetchDevices) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (!devices[device]) {
    auto created = std::make_unique<PrefetchDevice>();
    if ((err = created->Init(device)) != cudaSuccess) return err;  // Init cleaned up: a later call retries
    devices[device] = std::move(created);
  }
  *out = devices[device].get();
  return cudaSuccess;
}

// Starts the gather of `p` so that it runs after everything already enqueued on
// `stream` and without holding `stream` back; `slot`'s event completes with it.
//
// Under stream capture a fork to the side stream would have to be joined back
// inside the same capture (that is, waited for before the captured call returns),
// so there the gather simply becomes a node of the captured graph on `stream`.
// Static because it launches gather.cuh's static kernel.
static inline cudaError_t EnqueuePrefetch(PrefetchDevice& dev, const GatherParams& p, int max_ctas, cudaStream_t stream,
                                          int64_t slot) {
  bool capturing = false;
  cudaError_t err = IsCapturing(stream, &capturing);
  if (err != cudaSuccess) return err;
  if (capturing) return LaunchGather(p, max_ctas, stream);
  std::lock_guard<std::mutex> lock(dev.mutex());
  if ((err = cudaEventRecord(dev.fork(), stream)) != cudaSuccess) return err;
  if ((err = cudaStreamWaitEvent(dev.side(), dev.fork(), cudaEventWaitDefault)) != cudaSuccess) return err;
  if ((err = LaunchGather(p, max_ctas, dev.side())) != cudaSuccess) return err;
  return cudaEventRecord(dev.done(slot), dev.side());
}

// Makes `stream` wait for the newest gather recorded under `slot`.
//
// Under stream capture (XLA recording a command buffer) the wait becomes an
// external event-wait node: each launch of the graph waits for the event's
// newest record at that launch, that is, for the gather the start before it
// forked (start is not capturable, so it always runs before the graph is
// launched). The events live as long as the process, so no graph outlives one.
inline cudaError_t WaitPrefetch(PrefetchDevice& dev, cudaStream_t stream, int64_t slot) {
  bool capturing = false;
  const cudaError_t err = IsCapturing(stream, &capturing);
  if (err != cudaSuccess) return err;
  if (capturing) CaptureCounter(CapturedCall::kLookupDone).fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(dev.mutex());
  return cudaStreamWaitEvent(stream, dev.done(slot), capturing ? cudaEventWaitExternal : cudaEventWaitDefault);
}

}  // namespace engram
