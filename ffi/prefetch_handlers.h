// Symbols of the asynchronous lookup's FFI handlers (lookup_start / lookup_done,
// every order and the hot-row cache), for module.cc's registrations(). The CUDA
// ones, with start's instantiation handler and the state type it creates, are
// defined only in builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cstdint>

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupDoneCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupStartInstantiateCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupDoneCuda);

namespace engram {
// The XLA_FFI_TypeId and XLA_FFI_TypeInfo of start's call-site state, for
// jax.ffi.register_ffi_type (CUDA builds only).
void* PrefetchSiteTypeId();
void* PrefetchSiteTypeInfo();
// Call sites alive now, and destroyed ones whose number is not reusable yet.
void CountPrefetchSites(int64_t* live, int64_t* retired);
}  // namespace engram
