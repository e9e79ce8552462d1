// lookup_start's call sites as the binding sees them: the XLA FFI type of
// their state, for type_registrations(), and how many are alive. Plain C++, so
// the binding compiles without nvcc; defined in prefetch_site.cu, CUDA builds only.
#pragma once

#include <cstdint>
#include <string>

namespace engram {

// The XLA_FFI_TypeId and XLA_FFI_TypeInfo of start's call-site state, for
// jax.ffi.register_ffi_type.
void* PrefetchSiteTypeId();
void* PrefetchSiteTypeInfo();
struct PrefetchSiteCounts {
  int64_t live = 0;         // alive now
  int64_t retired = 0;      // destroyed, their release queued and not yet run
  int64_t destroyed = 0;    // destroyed since the process started
  int64_t leaked = 0;       // destroyed, but a CUDA call of their release failed: number and memory kept
  std::string leak_reason;  // the newest leak's failing call and its error
};
PrefetchSiteCounts CountPrefetchSites();
// Tests: queue a kernel that keeps device `device`'s side stream busy for
// `microseconds`. Returns a cudaError_t (0: queued).
int StallSideStream(int device, int64_t microseconds);

}  // namespace engram
