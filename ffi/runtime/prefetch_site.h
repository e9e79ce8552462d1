// The memory an asynchronous lookup works in, owned by its call site (one
// compiled lookup_start instruction, whose XLA FFI state this is): per device
// one staging buffer for the ids its gather reads, the rows it writes and the
// sort's workspace. Only in builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "runtime/prefetch_device.cuh"
#include "xla/ffi/api/ffi.h"

namespace engram {

// One device's staging of a site, sized for the site's static shapes at its
// first run (stream-ordered allocations, so nothing synchronises).
struct SiteStaging {
  void* base = nullptr;
  int32_t* ids = nullptr;
  uint16_t* rows = nullptr;  // bf16 bits
  uint8_t* workspace = nullptr;
  int64_t ids_bytes = 0, rows_bytes = 0, workspace_bytes = 0;
  int64_t slot = 0;                   // the site's slot: its dones record the slot's release event
  cudaEvent_t last_gather = nullptr;  // recorded after each of the site's gathers
};

// Created when XLA instantiates the instruction, destroyed with its executable.
class PrefetchSite {
 public:
  static xla::ffi::TypeId id;  // registered with XLA by name (bindings/module.cc)

  // A site with a number no other live site has, or an error when
  // kMaxPrefetchSites sites are alive (or still being released).
  static xla::ffi::ErrorOr<std::unique_ptr<PrefetchSite>> Create();
  ~PrefetchSite();
  PrefetchSite(const PrefetchSite&) = delete;
  PrefetchSite& operator=(const PrefetchSite&) = delete;

  uint32_t number() const { return number_; }

  // The staging of `device` with room for the given sizes. A new buffer is
  // allocated on `stream` (XLA's, where the start uses it first); one it
  // replaces is freed on the side stream once the slot's last done released it.
  cudaError_t Reserve(PrefetchDevice& dev, int device, cudaStream_t stream, int64_t slot, int64_t ids_bytes,
                      int64_t rows_bytes, int64_t workspace_bytes, SiteStaging** staging);

  // A number no start before it had, for the descriptor and ticket of a start.
  static uint64_t NextGeneration();

 private:
  explicit PrefetchSite(uint32_t number) : number_(number) {}

  const uint32_t number_;
  std::mutex mutex_;  // devices may run the instruction at once
  std::array<std::unique_ptr<SiteStaging>, kMaxPrefetchDevices> devices_{};
};

// A ticket (start's result, done's operand) holds kTicketWords uint32 words, or a
// multiple of them under vmap.
inline xla::ffi::Error CheckTicket(int64_t words, const char* call) {
  if (words < kTicketWords || words % kTicketWords != 0) {
    return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument, std::string("engram_jax ") + call +
                                                                      ": the ticket must hold a multiple of " +
                                                                      std::to_string(kTicketWords) + " uint32 words");
  }
  return xla::ffi::Error::Success();
}

}  // namespace engram
