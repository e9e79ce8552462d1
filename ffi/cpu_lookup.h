// The CPU lookups behind the lookup, cached-lookup and lookup_done handlers:
// resolve the table (and the cache) under leases, so close() waits for them,
// then run the framework-free gathers from kernels/ on a few threads.
#pragma once

#include <vector>

#include "dedup_adapter.h"
#include "kernels/dedup_cpu.h"
#include "kernels/gather_cpu.h"
#include "lookup_adapter.h"

namespace engram {

inline ffi::Error RunLookupCpu(int32_t device_ordinal, int64_t table_key, int64_t dim, ffi::Buffer<ffi::S32> ids,
                               ffi::ResultBuffer<ffi::BF16> out) {
  GatherParams params;
  TableLease lease;
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, out, CpuCanRead, "CPU", &params, &lease);
      err.failure()) {
    return err;
  }
  GatherCpu(params, CpuLookupThreads());
  return ffi::Error::Success();
}

// The cache lease of one CPU lookup, returned however the handler leaves.
struct CpuCacheLease {
  CacheLease lease;
  ~CpuCacheLease() { ReleaseCache(&lease, nullptr); }
};

// `call.workspace` may be null: the sort's scratch then comes from the heap.
inline ffi::Error RunCachedLookupCpu(CachedLookupCall call, ffi::Buffer<ffi::S32> ids,
                                     ffi::ResultBuffer<ffi::BF16> out) {
  std::vector<uint8_t> scratch;
  if (call.workspace == nullptr && ValidVisitOrder(call.order)) {
    scratch.resize(static_cast<size_t>(
        LookupWorkspaceBytes(static_cast<int64_t>(ids.element_count()), static_cast<VisitOrder>(call.order))));
    call.workspace = scratch.data();
    call.workspace_bytes = static_cast<int64_t>(scratch.size());
  }
  DedupGatherParams params;
  TableLease table_lease;  // declared first: outlives the cache lease and the reads
  CpuCacheLease cache;
  if (ffi::Error err = PrepareCachedLookup(call, ids, out, CpuCanRead, "CPU", &params, &cache.lease, &table_lease);
      err.failure()) {
    return err;
  }
  if (!LookupCpu(params, CpuLookupThreads())) {
    return ffi::Error::Internal("engram_jax cached lookup: workspace too small");
  }
  return ffi::Error::Success();
}

}  // namespace engram
