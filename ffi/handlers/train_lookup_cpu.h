// The CPU lookup of a trainable table behind engram_train_lookup
// (train_lookup_cpu.cc), which the CPU's lookup_done of a trainable table runs
// too (prefetch_cpu.cc): checks the call, takes a lease, copies the rows.
#pragma once

#include <cstdint>

#include "handlers/train_args.h"
#include "xla/ffi/api/ffi.h"

namespace engram {

ffi::Error RunTrainableLookupCpu(const TrainableCall& call, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer rows);

}  // namespace engram
