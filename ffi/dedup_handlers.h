// Symbols of the engram_cached_lookup FFI handlers (the lookup with visiting
// order, deduplication and the hot-row cache) and of its prefetch pair
// (start / done), for module.cc's registrations().
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupDoneCpu);
// Defined only in builds with ENGRAM_HAS_CUDA.
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupDoneCuda);
