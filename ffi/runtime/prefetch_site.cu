// Call sites of the asynchronous lookup (prefetch_site.h, prefetch_sites.h):
// numbering, staging buffers per device, and their release once nothing can
// still touch them, without ever blocking the host.
#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "kernels/spin.cuh"
#include "runtime/prefetch_site.h"
#include "runtime/prefetch_sites.h"

namespace engram {

xla::ffi::TypeId PrefetchSite::id = {};

void* PrefetchSiteTypeId() { return &PrefetchSite::id; }

void* PrefetchSiteTypeInfo() {
  static XLA_FFI_TypeInfo info = xla::ffi::MakeTypeInfo<PrefetchSite>();
  return &info;
}

namespace {

// Site numbers index the per-device descriptor tables. A destroyed site's number
// is reused only once the zeroing of its descriptors has run on every device.
struct RetiredSite {
  uint32_t number;
  std::vector<cudaEvent_t> released;  // one per device the site ran on
};

struct SiteNumbers {
  std::mutex mutex;
  std::vector<uint32_t> free;
  std::vector<RetiredSite> retired;
  uint32_t next = 0;
  int64_t destroyed = 0;    // destructors run
  int64_t leaked = 0;       // of those, sites whose release could not be queued
  std::string leak_reason;  // the newest leak's failing call and error
};

// Never destroyed: XLA may destroy an executable, and so run ~PrefetchSite, after
// this library's static destructors at process exit; a plain global would be gone.
SiteNumbers& Numbers() {
  static auto* numbers = new SiteNumbers();
  return *numbers;
}

std::atomic<uint64_t> next_generation{1};

// Frees the numbers of retired sites whose release has run. Caller holds the mutex.
void ReclaimRetiredSites(SiteNumbers& n) {
  auto done = [](const RetiredSite& site) {
    // An error other than "not ready" means the work will never run: nothing waits.
    return std::all_of(site.released.begin(), site.released.end(),
                       [](cudaEvent_t event) { return cudaEventQuery(event) != cudaErrorNotReady; });
  };
  for (auto it = n.retired.begin(); it != n.retired.end();) {
    if (!done(*it)) {
      ++it;
      continue;
    }
    for (cudaEvent_t event : it->released) cudaEventDestroy(event);
    n.free.push_back(it->number);
    it = n.retired.erase(it);
  }
}

constexpr int64_t kStagingAlign = 256;

int64_t Aligned(int64_t bytes) { return (bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

// Queues the release of `base` on the side stream behind the slot's newest done
// (which copied the rows out of it: XLA runs the dones of one device in the
// order of its stream) and behind every gather (the side stream is in order).
// `zero`: also zero the site's descriptor first, so a ticket outliving the site
// reads NaN rows, not freed memory. `failed` (if given) names the call that
// failed. Caller holds dev's mutex.
cudaError_t ReleaseOnSide(PrefetchDevice& dev, int64_t slot, void* base, SiteDescriptor* zero,
                          const char** failed = nullptr) {
  const char* call = "cudaStreamWaitEvent";
  cudaError_t err = cudaStreamWaitEvent(dev.side(), dev.released(slot), cudaEventWaitDefault);
  if (err == cudaSuccess && zero != nullptr) {
    call = "cudaMemsetAsync";
    err = cudaMemsetAsync(zero, 0, sizeof(SiteDescriptor), dev.side());
  }
  if (err == cudaSuccess && base != nullptr) {
    call = "cudaFreeAsync";
    err = cudaFreeAsync(base, dev.side());
  }
  if (err != cudaSuccess && failed != nullptr) *failed = call;
  return err;
}

}  // namespace

xla::ffi::ErrorOr<std::unique_ptr<PrefetchSite>> PrefetchSite::Create() {
  SiteNumbers& n = Numbers();
  std::lock_guard<std::mutex> lock(n.mutex);
  ReclaimRetiredSites(n);
  uint32_t number = 0;
  if (!n.free.empty()) {
    number = n.free.back();
    n.free.pop_back();
  } else if (n.next < kMaxPrefetchSites) {
    number = n.next++;
  } else {
    std::string why = "engram_jax lookup_start: " + std::to_string(kMaxPrefetchSites) +
                      " compiled lookup_start call sites are alive at once; free some compiled functions";
    if (n.leaked > 0) {
      why += " (" + std::to_string(n.leaked) + " destroyed ones could not be released: " + n.leak_reason + ")";
    }
    return xla::ffi::Unexpected(xla::ffi::Error(xla::ffi::ErrorCode::kResourceExhausted, why));
  }
  return std::unique_ptr<PrefetchSite>(new PrefetchSite(number));
}

PrefetchSiteCounts CountPrefetchSites() {
  SiteNumbers& n = Numbers();
  std::lock_guard<std::mutex> lock(n.mutex);
  ReclaimRetiredSites(n);
  PrefetchSiteCounts counts;
  counts.retired = static_cast<int64_t>(n.retired.size());
  counts.live = static_cast<int64_t>(n.next) - static_cast<int64_t>(n.free.size()) - counts.retired - n.leaked;
  counts.destroyed = n.destroyed;
  counts.leaked = n.leaked;
  counts.leak_reason = n.leak_reason;
  return counts;
}

uint64_t PrefetchSite::NextGeneration() { return next_generation.fetch_add(1, std::memory_order_relaxed); }

cudaError_t PrefetchSite::Reserve(PrefetchDevice& dev, int device, cudaStream_t stream, int64_t slot, int64_t ids_bytes,
                                  int64_t rows_bytes, int64_t workspace_bytes, SiteStaging** staging) {
  if (device < 0 || device >= kMaxPrefetchDevices) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(mutex_);
  auto& held = devices_[device];
  if (!held) {
    auto created = std::make_unique<SiteStaging>();
    if (cudaError_t err = cudaEventCreateWithFlags(&created->last_gather, cudaEventDisableTiming); err != cudaSuccess) {
      return err;
    }
    held = std::move(created);
  }
  SiteStaging& s = *held;
  s.slot = slot;
  if (s.base == nullptr || s.ids_bytes < ids_bytes || s.rows_bytes < rows_bytes ||
      s.workspace_bytes < workspace_bytes) {
    const int64_t ids = Aligned(std::max(ids_bytes, s.ids_bytes));
    const int64_t rows = Aligned(std::max(rows_bytes, s.rows_bytes));
    const int64_t workspace = Aligned(std::max(workspace_bytes, s.workspace_bytes));
    void* base = nullptr;
    cudaError_t err = cudaMallocAsync(&base, static_cast<size_t>(ids + rows + workspace), stream);
    if (err != cudaSuccess) return err;
    if (s.base != nullptr) {
      std::lock_guard<std::mutex> dev_lock(dev.mutex());
      err = ReleaseOnSide(dev, slot, s.base, nullptr);
      if (err != cudaSuccess) return err;
    }
    uint8_t* bytes = static_cast<uint8_t*>(base);
    s.base = base;
    s.ids = reinterpret_cast<int32_t*>(bytes);
    s.rows = reinterpret_cast<uint16_t*>(bytes + ids);
    s.workspace = bytes + ids + rows;
    s.ids_bytes = ids;
    s.rows_bytes = rows;
    s.workspace_bytes = workspace;
  }
  *staging = &s;
  return cudaSuccess;
}

// XLA may destroy an executable while work it queued still runs, so nothing here
// waits: each device's release is queued on its side stream, and the number is
// reclaimed once that has run. No error can be reported from a destructor; a
// failing call (at process exit the runtime may be gone) leaves that device's
// memory to the process's end.
PrefetchSite::~PrefetchSite() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool relaxed = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  RetiredSite retired{number_, {}};
  const char* failed = nullptr;  // the first call that failed, if any
  cudaError_t error = cudaSuccess;
  for (int device = 0; device < kMaxPrefetchDevices; ++device) {
    const auto& staging = devices_[device];
    if (!staging) continue;
    PrefetchDevice* dev = nullptr;
    cudaError_t err = cudaSetDevice(device);
    const char* call = "cudaSetDevice";
    if (err == cudaSuccess) {
      call = "the side stream's state";
      err = GetPrefetchDevice(device, &dev);
    }
    cudaEvent_t released = nullptr;
    if (err == cudaSuccess) {
      std::lock_guard<std::mutex> lock(dev->mutex());
      call = "cudaEventCreateWithFlags";
      err = cudaEventCreateWithFlags(&released, cudaEventDisableTiming);
      if (err == cudaSuccess) {
        err = ReleaseOnSide(*dev, staging->slot, staging->base, dev->descriptors() + number_, &call);
      }
      if (err == cudaSuccess) {
        call = "cudaEventRecord";
        err = cudaEventRecord(released, dev->side());
      }
    }
    if (err != cudaSuccess) {
      if (failed == nullptr) {
        failed = call;
        error = err;
      }
      if (released != nullptr) cudaEventDestroy(released);
      continue;
    }
    retired.released.push_back(released);
    cudaEventDestroy(staging->last_gather);  // legal while pending: freed once it completes
  }
  if (previous >= 0) cudaSetDevice(previous);
  if (relaxed) cudaThreadExchangeStreamCaptureMode(&mode);
  SiteNumbers& n = Numbers();
  std::lock_guard<std::mutex> lock(n.mutex);
  ++n.destroyed;
  // A number whose descriptor may not be zeroed is never handed out again.
  if (failed != nullptr) {
    ++n.leaked;
    n.leak_reason = std::string(failed) + ": " + cudaGetErrorName(error);
    return;
  }
  n.retired.push_back(std::move(retired));
}

int StallSideStream(int device, int64_t microseconds) {
  if (microseconds < 0) return static_cast<int>(cudaErrorInvalidValue);
  int previous = -1;
  cudaError_t err = cudaGetDevice(&previous);
  PrefetchDevice* dev = nullptr;
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err == cudaSuccess) err = GetPrefetchDevice(device, &dev);
  if (err == cudaSuccess) {
    std::lock_guard<std::mutex> lock(dev->mutex());
    err = LaunchSpin(static_cast<uint64_t>(microseconds) * 1000, dev->side());
  }
  if (previous >= 0) {
    const cudaError_t restored = cudaSetDevice(previous);
    if (err == cudaSuccess) err = restored;
  }
  return static_cast<int>(err);
}

}  // namespace engram
