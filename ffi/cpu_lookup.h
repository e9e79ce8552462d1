// The CPU gather behind the lookup and lookup_start handlers: resolve the
// table under a lease (so close() waits for it), then run the framework-free
// gather from kernels/gather_cpu.h on a few threads.
#pragma once

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

}  // namespace engram
