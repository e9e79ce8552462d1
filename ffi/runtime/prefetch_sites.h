// lookup_start's call sites as the binding sees them: the XLA FFI type of
// their state, for type_registrations(), and how many are alive. Plain C++, so
// the binding compiles without nvcc; defined in prefetch_site.cu, CUDA builds only.
#pragma once

#include <cstdint>

namespace engram {

// The XLA_FFI_TypeId and XLA_FFI_TypeInfo of start's call-site state, for
// jax.ffi.register_ffi_type.
void* PrefetchSiteTypeId();
void* PrefetchSiteTypeInfo();
// Call sites alive now, and destroyed ones whose number is not reusable yet.
void CountPrefetchSites(int64_t* live, int64_t* retired);
// Tests: queue a kernel that keeps device `device`'s side stream busy for
// `microseconds`. Returns a cudaError_t (0: queued).
int StallSideStream(int device, int64_t microseconds);

}  // namespace engram
