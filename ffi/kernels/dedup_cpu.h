// The CPU lookup with the row-rate levers: entries sorted by row (std::sort of
// (row, position) pairs in the caller's workspace), each distinct row decoded
// once and copied to its other positions, hits read from the cache's copy. The
// plain gather's GatherRowsCpu decodes (or copies, for packed records) every
// row, so the bits are the same.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cache_index.h"
#include "kernels/dedup_params.h"
#include "kernels/gather_cpu.h"

namespace engram {

// Table-local row `local` (kNoRow: zeros) into output row `dst` (decoded, or
// its packed record), from the cache when it holds the row.
inline void FetchOneCpu(const DedupGatherParams& p, int64_t local, uint8_t* dst) {
  GatherParams one = p.gather;
  int32_t index = 0;
  one.row_start = 0;
  one.ids = &index;
  one.num_ids = 1;
  if (one.records != nullptr) {
    one.records = dst;
  } else {
    one.out = reinterpret_cast<uint16_t*>(dst);
  }
  const int64_t slot = local == kNoRow ? -1 : CacheSlot(p.cache, local);
  if (local == kNoRow) {
    index = -1;
  } else if (slot >= 0) {
    one.table = p.cache.records;
    one.num_rows = p.cache.count;
    index = static_cast<int32_t>(slot);
  } else {
    index = static_cast<int32_t>(local);
  }
  GatherRowsCpu(one, 0, 1);
}

// Entries [begin, end) of the sorted (row << 32 | position) pairs; a run of
// equal rows is decoded once when `dedup`, by the chunk its first entry is in.
inline void GatherSortedCpu(const DedupGatherParams& p, const uint64_t* pairs, int64_t n, int64_t begin, int64_t end,
                            bool dedup) {
  const int64_t out_bytes = OutRowBytes(p.gather);
  const int64_t none = p.gather.num_rows;  // the sort key of ids the table does not hold
  if (dedup) {
    while (begin < end && begin > 0 && (pairs[begin] >> 32) == (pairs[begin - 1] >> 32)) ++begin;
  }
  int64_t i = begin;
  while (i < end) {
    const int64_t row = static_cast<int64_t>(pairs[i] >> 32);
    uint8_t* first = OutRow(p.gather, static_cast<int64_t>(pairs[i] & 0xFFFFFFFFu));
    FetchOneCpu(p, row == none ? kNoRow : row, first);
    int64_t j = i + 1;
    if (dedup) {
      for (; j < n && (pairs[j] >> 32) == static_cast<uint64_t>(row); ++j) {
        std::memcpy(OutRow(p.gather, static_cast<int64_t>(pairs[j] & 0xFFFFFFFFu)), first, out_bytes);
      }
    }
    i = j;
  }
}

inline void GatherCachedCpu(const DedupGatherParams& p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    FetchOneCpu(p, LocalRow(p.gather, p.gather.ids[i]), OutRow(p.gather, i));
  }
}

// Returns false when the workspace is too small (handlers/lookup_args.h checks
// it first).
inline bool LookupCpu(const DedupGatherParams& p, int max_threads) {
  const int64_t n = p.gather.num_ids;
  if (n == 0) return true;
  DequantTable();
  if (p.order == VisitOrder::kPlain) {
    if (p.cache.count == 0) {
      GatherCpu(p.gather, max_threads);
    } else {
      ParallelChunks(n, max_threads, [&p](int64_t lo, int64_t hi) { GatherCachedCpu(p, lo, hi); });
    }
    return true;
  }
  if (p.workspace_bytes < n * static_cast<int64_t>(sizeof(uint64_t))) return false;
  uint64_t* pairs = reinterpret_cast<uint64_t*>(p.workspace);
  const int64_t none = p.gather.num_rows;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = LocalRow(p.gather, p.gather.ids[i]);
    const uint64_t key = static_cast<uint64_t>(local == kNoRow ? none : local);
    pairs[i] = (key << 32) | static_cast<uint64_t>(i);
  }
  std::sort(pairs, pairs + n);
  const bool dedup = p.order == VisitOrder::kDedup;
  ParallelChunks(n, max_threads,
                 [&p, pairs, n, dedup](int64_t lo, int64_t hi) { GatherSortedCpu(p, pairs, n, lo, hi, dedup); });
  return true;
}

}  // namespace engram
