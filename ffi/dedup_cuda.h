// The CUDA work of a lookup with the row-rate levers as one call on any stream,
// for the handlers that launch it: the synchronous handler (XLA's stream) and a
// prefetch start (a side stream). Only in builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cuda_runtime.h>

#include "dedup_adapter.h"

namespace engram {

// Queues sort + gather of prepared `params` on `stream` and fences the cache
// buffer set it reads (the lease, released here) against a refresh. The ids,
// rows and workspace must stay alive until the work on `stream` is done.
ffi::Error LaunchCachedLookupCuda(const DedupGatherParams& params, CacheLease* lease, int max_ctas,
                                  cudaStream_t stream);

}  // namespace engram
