// The CUDA work of engram_cached_lookup as one call on any stream, for the
// handlers that launch it: the synchronous handler (XLA's stream) and a
// prefetch start (a side stream). Only in builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cuda_runtime.h>

#include "dedup_adapter.h"

namespace engram {

// Validates, takes the cache lease, queues sort + gather on `stream`, and
// fences the cache buffer set it read against a refresh. The workspace must
// stay alive until the work on `stream` is done (an output of the call).
ffi::Error RunCachedLookupCuda(cudaStream_t stream, const CachedLookupCall& call, ffi::Buffer<ffi::S32> ids,
                               ffi::ResultBuffer<ffi::BF16> out);

}  // namespace engram
