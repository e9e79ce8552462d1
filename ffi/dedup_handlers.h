// Symbols of the engram_cached_lookup FFI handlers (the lookup with visiting
// order, deduplication and the hot-row cache), for module.cc's registrations().
// Its asynchronous form is lookup_start / lookup_done (prefetch_handlers.h).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupCpu);
// Defined only in builds with ENGRAM_HAS_CUDA.
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupCuda);
