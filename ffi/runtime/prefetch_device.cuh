// Asynchronous gathers on a side stream: per device, one side stream that every
// prefetch shares (so lookups take turns instead of crowding the SMs), a fork
// event, pools of completion and release events addressed by a slot number, and
// the call-site descriptors tickets name. Made once per device; no XLA types.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>

#include "kernels/staging.cuh"

namespace engram {

// Completion and release events per device. A slot is a number the caller keeps
// constant per call site; slots that share an event (slot % kPrefetchSlots, or
// two call sites traced once and inlined twice) stay correct, because a wait on
// an event's newest record also covers every earlier record of it: every
// completion is recorded on the same in-order side stream, and a release is
// only ever waited for by the next start, whichever came last. Sharing only
// makes a wait longer than it needs to be.
constexpr int kPrefetchSlots = 256;
constexpr int kMaxPrefetchDevices = 64;
// Call sites (compiled lookup_start instructions) alive at once in a process.
constexpr uint32_t kMaxPrefetchSites = 1u << 16;

// Created on first use, never per call; nothing in it synchronises the host.
class PrefetchDevice {
 public:
  cudaStream_t side() const { return side_; }
  cudaEvent_t fork() const { return fork_; }
  // Completes with the newest gather of the slot (recorded on the side stream).
  cudaEvent_t done(int64_t slot) const { return done_[SlotIndex(slot)]; }
  // Completes with the newest done of the slot (recorded on XLA's stream once it
  // has copied its rows out of the site's staging).
  cudaEvent_t released(int64_t slot) const { return released_[SlotIndex(slot)]; }
  // The device's table of call-site descriptors (device memory, zeroed at creation).
  SiteDescriptor* descriptors() const { return descriptors_; }
  int finish_ctas() const { return finish_ctas_; }
  // Serialises record / wait / launch sequences from concurrent host threads, so a
  // wait never pairs with another thread's record of the shared fork event.
  std::mutex& mutex() { return mutex_; }

  // Creates the stream, events and descriptor table on `device`. Stream capture on
  // this thread is relaxed meanwhile, so creating them from inside a captured
  // handler is legal. On failure everything created so far is destroyed again and
  // the first error returned; the capture mode and current device are restored.
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
  std::array<cudaEvent_t, kPrefetchSlots> released_{};
  SiteDescriptor* descriptors_ = nullptr;
  int finish_ctas_ = 0;
  std::mutex mutex_;

  static size_t SlotIndex(int64_t slot) {
    const int64_t i = slot % kPrefetchSlots;
    return static_cast<size_t>(i < 0 ? i + kPrefetchSlots : i);
  }

  // The handles, made on `device`; the caller's current device is put back.
  cudaError_t CreateOn(int device) {
    int previous = 0;
    cudaError_t err = cudaGetDevice(&previous);
    if (err != cudaSuccess) return err;
    if ((err = cudaSetDevice(device)) != cudaSuccess) return err;  // nothing changed yet
    err = cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming);
    for (auto* events : {&done_, &released_}) {
      for (auto& event : *events) {
        if (err != cudaSuccess) break;
        err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
      }
    }
    const size_t table_bytes = sizeof(SiteDescriptor) * kMaxPrefetchSites;
    if (err == cudaSuccess) err = cudaMalloc(&descriptors_, table_bytes);
    if (err == cudaSuccess) err = cudaMemset(descriptors_, 0, table_bytes);
    int sms = 0;
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    finish_ctas_ = 4 * (sms > 0 ? sms : 1);
    const cudaError_t restore = cudaSetDevice(previous);
    return err != cudaSuccess ? err : restore;
  }

  // Destroys every handle made so far, for a failed Init whose error is
  // `first`: every destroy runs and is checked; the first error is returned.
  cudaError_t Destroy(cudaError_t first) {
    const auto keep = [&first](cudaError_t err) {
      if (first == cudaSuccess) first = err;
    };
    for (auto* events : {&done_, &released_}) {
      for (auto& event : *events) {
        if (event != nullptr) keep(cudaEventDestroy(event));
        event = nullptr;
      }
    }
    if (fork_ != nullptr) keep(cudaEventDestroy(fork_));
    fork_ = nullptr;
    if (side_ != nullptr) keep(cudaStreamDestroy(side_));
    side_ = nullptr;
    if (descriptors_ != nullptr) keep(cudaFree(descriptors_));
    descriptors_ = nullptr;
    return first;
  }
};

// The resources of CUDA device `device` (XLA's device ordinal: the handler's
// stream may be capturing, and the stream's own device cannot be asked for then),
// created on first use and kept for the life of the process: never destroyed,
// neither the CUDA handles (destroying them at exit could run after the driver
// has shut down) nor the objects, since a call site XLA destroys at exit, after
// this library's static destructors, still looks its device up here.
// Deliberately inline, not static: its registry must be one per process, shared
// by every translation unit whose handlers fork or wait (start and done may be
// compiled apart).
inline cudaError_t GetPrefetchDevice(int device, PrefetchDevice** out) {
  static std::mutex registry_mutex;
  static auto* devices = new std::array<PrefetchDevice*, kMaxPrefetchDevices>{};
  cudaError_t err = cudaSuccess;
  if (device < 0 || device >= kMaxPrefetchDevices) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(registry_mutex);
  if ((*devices)[device] == nullptr) {
    auto created = std::make_unique<PrefetchDevice>();
    if ((err = created->Init(device)) != cudaSuccess) return err;  // Init cleaned up: a later call retries
    (*devices)[device] = created.release();
  }
  *out = (*devices)[device];
  return cudaSuccess;
}

// Runs launch(side stream) after everything already enqueued on `stream`, without
// holding `stream` back; the slot's completion event and `site_gather` (the call
// site's own) complete with it.
template <typename Launch>
cudaError_t ForkPrefetch(PrefetchDevice& dev, cudaStream_t stream, int64_t slot, cudaEvent_t site_gather,
                         const Launch& launch) {
  std::lock_guard<std::mutex> lock(dev.mutex());
  cudaError_t err = cudaEventRecord(dev.fork(), stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(dev.side(), dev.fork(), cudaEventWaitDefault);
  if (err == cudaSuccess) err = launch(dev.side());
  if (err == cudaSuccess) err = cudaEventRecord(dev.done(slot), dev.side());
  if (err == cudaSuccess) err = cudaEventRecord(site_gather, dev.side());
  return err;
}

// Makes `stream` wait for the newest gather recorded under `slot`.
//
// Under stream capture (XLA recording a command buffer) the wait becomes an
// external event-wait node: each launch of the graph waits for the event's
// newest record at that launch, that is, for the gather the start before it
// forked (start is not capturable, so it always runs before the graph is
// launched). The events live as long as the process, so no graph outlives one.
inline cudaError_t WaitPrefetch(PrefetchDevice& dev, cudaStream_t stream, int64_t slot, bool capturing) {
  std::lock_guard<std::mutex> lock(dev.mutex());
  return cudaStreamWaitEvent(stream, dev.done(slot), capturing ? cudaEventWaitExternal : cudaEventWaitDefault);
}

// Records that the done of `slot` has copied its rows out (an external
// event-record node under capture, so each graph launch records it anew).
inline cudaError_t ReleasePrefetch(PrefetchDevice& dev, cudaStream_t stream, int64_t slot, bool capturing) {
  std::lock_guard<std::mutex> lock(dev.mutex());
  return capturing ? cudaEventRecordWithFlags(dev.released(slot), stream, cudaEventRecordExternal)
                   : cudaEventRecord(dev.released(slot), stream);
}

}  // namespace engram
