// Filling the HBM hot-row cache: raw row records (no decode) copied from the
// host table into cache slots, rows given in table order so the reads visit
// the table in order. Runs on its own stream, so a refresh shares the link
// with lookups but never waits for them or makes them wait. No XLA types.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace engram {

// static: this header may be included by more than one translation unit. A
// row outside [0, num_rows) is never read: its slot gets a record of zeros
// (the cache index never points a lookup at it, rows outside the table are
// never cached).
static __global__ void CopyRecordsKernel(const uint4* table, int64_t num_rows, const int32_t* rows, int64_t count,
                                         int lanes, uint4* dst) {
  const int64_t total = count * lanes;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / lanes;
    const int64_t row = rows[r];
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row >= 0 && row < num_rows) v = __ldcs(table + row * lanes + (i - r * lanes));
    dst[i] = v;
  }
}

// rows: [count] device array of table-local rows, in table order; the table
// holds `num_rows` records of `stride` bytes. Static because it names the
// static kernel.
static inline cudaError_t LaunchCopyRecords(const uint8_t* table, int64_t num_rows, const int32_t* rows, int64_t count,
                                            int64_t stride, uint8_t* dst, int ctas, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int lanes = static_cast<int>(stride / 16);
  const int64_t wanted = (count * lanes + 255) / 256;
  const int blocks = static_cast<int>(wanted < ctas ? wanted : ctas);
  CopyRecordsKernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const uint4*>(table), num_rows, rows, count, lanes,
                                                reinterpret_cast<uint4*>(dst));
  return cudaGetLastError();
}

}  // namespace engram
