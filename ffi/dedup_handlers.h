// Symbols of the engram_cached_lookup FFI handlers (the lookup with visiting
// order, deduplication and the hot-row cache), for module.cc's registrations().
// The CUDA one exists only in builds with ENGRAM_HAS_CUDA.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupCuda);  // defined only with ENGRAM_HAS_CUDA
