// The CPU gather behind the lookup and lookup_start handlers: resolve the
// table under a lease (so close() waits for it), then run the framework-free
// gather from kernels/gather_cpu.h on a few threads.
#pragma once

#include <algorithm>
#include <string>
#include <system_error>
#include <thread>

#include "kernels/gather_cpu.h"
#include "lookup_adapter.h"

namespace engram {

// `what` names the calling handler in errors.
inline ffi::Error RunLookupCpu(int32_t device_ordinal, int64_t table_key, int64_t dim, ffi::Buffer<ffi::S32> ids,
                               ffi::ResultBuffer<ffi::BF16> out, const char* what) {
  GatherParams params;
  TableLease lease;
  if (ffi::Error err = PrepareLookup(device_ordinal, table_key, dim, ids, out, CpuCanRead, "CPU", &params, &lease);
      err.failure()) {
    return err;
  }
  const int threads = static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  try {
    GatherCpu(params, threads);
  } catch (const std::system_error& e) {
    return ffi::Error::Internal(std::string("engram_jax ") + what + ": could not start CPU threads: " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace engram
