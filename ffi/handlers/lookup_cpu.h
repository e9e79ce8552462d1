// The CPU lookups behind the engram_lookup, engram_cached_lookup and
// engram_lookup_records handlers (lookup_cpu.cc), which the CPU's lookup_done
// runs too (prefetch_cpu.cc): resolve the table (and the cache) under leases,
// so close() waits for them, then run the framework-free gathers from kernels/
// on a few threads.
#pragma once

#include <cstdint>

#include "handlers/lookup_args.h"
#include "xla/ffi/api/ffi.h"

namespace engram {

ffi::Error RunLookupCpu(int32_t device_ordinal, int64_t table_key, int64_t dim, ffi::Buffer<ffi::S32> ids,
                        ffi::ResultBuffer<ffi::BF16> out);

// `call.workspace` may be null: the sort's scratch then comes from the heap.
// `out`: rows or packed records, checked against the ids (CheckOutput).
ffi::Error RunCachedLookupCpu(CachedLookupCall call, ffi::Buffer<ffi::S32> ids, LookupOutput out);

}  // namespace engram
