// What a lookup with the row-rate levers needs, as plain values: the plain
// gather's parameters, the visiting order, an optional hot-row cache, and a
// caller-provided workspace for the sort. Shared by the CPU and CUDA paths;
// knows nothing of XLA.
#pragma once

#include <cstdint>

#include "kernels/cache_index.h"
#include "kernels/gather_params.h"

namespace engram {

enum class VisitOrder : int32_t {
  kPlain = 0,   // ids in the order given, every entry fetched
  kSorted = 1,  // entries visited in table order, every entry fetched
  kDedup = 2,   // entries visited in table order, each distinct row fetched once
};

inline bool ValidVisitOrder(int64_t order) { return order >= 0 && order <= 2; }

struct DedupGatherParams {
  GatherParams gather;  // table, ids, output: as for the plain lookup
  CacheView cache;      // cache.count == 0: no cache
  VisitOrder order = VisitOrder::kPlain;
  uint8_t* workspace = nullptr;  // LookupWorkspaceBytes(num_ids, order) bytes, any contents
  int64_t workspace_bytes = 0;
};

constexpr int64_t kWorkspaceAlign = 256;
// CUB's onesweep needs a histogram per pass and one lookback row of 256
// counters per tile of at least 256 keys: under 4 bytes per key plus this.
constexpr int64_t kSortTempSlack = 128 << 10;

inline int64_t AlignWorkspace(int64_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Workspace a lookup of `num_ids` ids needs: for a sorted order two key and
// two position arrays (the sort's double buffer) and a bound on the sort's
// own temporary storage (the CUDA path checks CUB's exact figure against it).
// The CPU path uses the first 8 bytes per id of the same buffer.
inline int64_t LookupWorkspaceBytes(int64_t num_ids, VisitOrder order) {
  if (order == VisitOrder::kPlain || num_ids <= 0) return 0;
  const int64_t array = AlignWorkspace(num_ids * 4);
  return 5 * array + kSortTempSlack;
}

// The sort keys: table-local rows, with every id the table does not hold
// mapped to num_rows so those entries sort last and are never read.
inline int SortKeyBits(int64_t num_rows) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= num_rows) ++bits;
  return bits;
}

}  // namespace engram
