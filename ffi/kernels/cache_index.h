// The hot-row cache's index, shared verbatim by the CPU and CUDA lookups:
// which table-local rows have a copy in the cache, and in which slot. No XLA,
// no CUDA.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"
#include "kernels/row_decode.h"

namespace engram {

// A sorted array of the cached rows (the slot is the position in that array)
// plus a bucket directory over the high bits of the row number, so a probe is
// one directory read and a binary search over a handful of entries: about
// 4.5 bytes of index per cached row, none per uncached row.
struct CacheView {
  const uint8_t* records = nullptr;  // count records, RowStride(dim) bytes each, slot order
  const int32_t* rows = nullptr;     // [count] table-local rows held, strictly increasing
  const int32_t* buckets = nullptr;  // [num_buckets + 1] first slot of each (row >> shift) bucket
  int64_t count = 0;                 // rows held; 0: an empty cache, every probe misses
  int64_t num_buckets = 0;           // covers every row of the table: (num_rows - 1) >> shift < num_buckets
  int32_t shift = 0;
};

// Slot of table-local row `local` in the cache, or -1 when the cache does not
// hold it (or `local` is outside the table: such rows are never cached).
ENGRAM_HD int64_t CacheSlot(const CacheView& c, int64_t local) {
  if (c.count == 0 || local < 0) return -1;
  // 0 <= bucket < num_buckets whatever `local` is (any int32 id, DEAD_ID
  // included, gives a negative or out-of-table local), so both directory
  // reads stay inside its num_buckets + 1 entries.
  const int64_t bucket = local >> c.shift;
  if (bucket >= c.num_buckets) return -1;
  int64_t lo = c.buckets[bucket];
  const int64_t end = c.buckets[bucket + 1];
  int64_t hi = end;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (c.rows[mid] < local) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return (lo < end && c.rows[lo] == local) ? lo : -1;
}

}  // namespace engram
