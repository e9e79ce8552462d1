// Symbol of the CUDA engram_lookup handler (cuda_lookup_handlers.cu), for
// module.cc's registrations(); only in builds with ENGRAM_HAS_CUDA. The other
// CUDA handlers are declared beside their CPU twins (prefetch_handlers.h,
// dedup_handlers.h, hash_handlers.h).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupCuda);
