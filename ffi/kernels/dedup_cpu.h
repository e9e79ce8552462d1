// The CPU lookup with the row-rate levers: entries sorted by row (std::sort
// of (row, position) pairs in the caller's workspace), each distinct row
// decoded once and copied to its other positions, hits read from the cache's
// copy. Every row is decoded by the plain CPU gather's own GatherRowsCpu, so
// the bits are the plain lookup's by construction.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/cache_index.h"
#include "kernels/dedup_params.h"
#include "kernels/gather_cpu.h"

namespace engram {

// Decodes table-local row `local` (kNoRow: zeros) into `dst`, from the cache
// when it holds the row.
inline void DecodeOneCpu(const DedupGatherParams& p, int64_t local, uint16_t* dst) {
  GatherParams one = p.gather;
  int32_t index = 0;
  one.row_start = 0;
  one.ids = &index;
  one.num_ids = 1;
  one.out = dst;
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

inline int64_t LocalOf(const GatherParams& g, int32_t id) {
  const int64_t local = static_cast<int64_t>(id) - g.row_start;
  return (local >= 0 && local < g.num_rows) ? local : kNoRow;
}

// Entries [begin, end) of the sorted (row << 32 | position) pairs; a run of
// equal rows is decoded once when `dedup`, by the chunk its first entry is in.
inline void GatherSortedCpu(const DedupGatherParams& p, const uint64_t* pairs, int64_t n, int64_t begin, int64_t end,
                            bool dedup) {
  const int64_t dim = p.gather.dim;
  const int64_t none = p.gather.num_rows;  // the sort key of ids the table does not hold
  if (dedup) {
    while (begin < end && begin > 0 && (pairs[begin] >> 32) == (pairs[begin - 1] >> 32)) ++begin;
  }
  int64_t i = begin;
  while (i < end) {
    const int64_t row = static_cast<int64_t>(pairs[i] >> 32);
    uint16_t* first = p.gather.out + static_cast<int64_t>(pairs[i] & 0xFFFFFFFFu) * dim;
    DecodeOneCpu(p, row == none ? kNoRow : row, first);
    int64_t j = i + 1;
    if (dedup) {
      for (; j < n && (pairs[j] >> 32) == static_cast<uint64_t>(row); ++j) {
        std::memcpy(p.gather.out + static_cast<int64_t>(pairs[j] & 0xFFFFFFFFu) * dim, first, dim * sizeof(uint16_t));
      }
    }
    i = j;
  }
}

inline void GatherCachedCpu(const DedupGatherParams& p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    DecodeOneCpu(p, LocalOf(p.gather, p.gather.ids[i]), p.gather.out + i * p.gather.dim);
  }
}

template <typename Fn>
inline void ParallelChunks(int64_t n, int max_threads, Fn fn) {
  const int64_t wanted = (n + kRowsPerCpuThread - 1) / kRowsPerCpuThread;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, max_threads)));
  const int64_t chunk = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    const int64_t lo = std::min(n, t * chunk), hi = std::min(n, lo + chunk);
    pool.emplace_back([&fn, lo, hi] { fn(lo, hi); });
  }
  fn(0, std::min(n, chunk));
  for (auto& t : pool) t.join();
}

// Returns false when the workspace is too small (the adapter checks first).
inline bool LookupCpu(const DedupGatherParams& p, int max_threads) {
  const int64_t n = p.gather.num_ids;
  if (n == 0) return true;
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
    const int64_t local = LocalOf(p.gather, p.gather.ids[i]);
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
