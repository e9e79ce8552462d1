// The CPU side of trainable tables: the lookup (each id's row values copied
// out, zeros for ids the table does not hold) and the update (ids sorted with
// their positions, each run of equal ids summed into one gradient in
// train_rows.h's chunked order, each distinct row updated once in place; runs
// split over a few threads, a run never split). The math is train_rows.h's, so the CUDA kernels
// give the same bits. Framework-free.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/gather_cpu.h"
#include "kernels/train_rows.h"

namespace engram {

inline int64_t TrainableLocalRow(const TrainableView& t, int32_t id) {
  const int64_t local = static_cast<int64_t>(id) - t.row_start;
  return (local >= 0 && local < t.num_rows) ? local : kNoRow;
}

// Rows [begin, end) of a lookup: `dim` values in the table's dtype each.
inline void GatherTrainableRowsCpu(const TrainableView& t, const int32_t* ids, int64_t begin, int64_t end,
                                   uint8_t* out) {
  const int64_t row_bytes = t.dim * ValueBytes(t.format);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t local = TrainableLocalRow(t, ids[i]);
    uint8_t* dst = out + i * row_bytes;
    if (local == kNoRow) {
      std::memset(dst, 0, static_cast<size_t>(row_bytes));
    } else {
      std::memcpy(dst, t.table + local * t.stride, static_cast<size_t>(row_bytes));
    }
  }
}

inline void GatherTrainableCpu(const TrainableView& t, const int32_t* ids, int64_t num_ids, uint8_t* out,
                               int max_threads) {
  ParallelChunks(num_ids, max_threads, [&](int64_t lo, int64_t hi) { GatherTrainableRowsCpu(t, ids, lo, hi, out); });
}

// The run's summed gradient into `g` ([dim]), in train_rows.h's chunked order
// (value by value the additions of the CUDA kernels' RunSums and ChunkSums),
// each entry's gradient row read once, front to back (`chunk` is [dim] scratch;
// a pair's low half is the entry's batch position).
inline void RunGradientRowCpu(const UpdateParams& p, const uint64_t* pairs, int64_t first, int64_t last, float* g,
                              float* chunk) {
  const int64_t dim = p.t.dim;
  std::fill(g, g + dim, 0.0f);
  for (int64_t start = first; start < last; start += kGradChunk) {
    const int64_t end = last - start < kGradChunk ? last : start + kGradChunk;
    std::fill(chunk, chunk + dim, 0.0f);
    for (int64_t e = start; e < end; ++e) {
      const int64_t base = static_cast<int64_t>(pairs[e] & 0xFFFFFFFFu) * dim;
      for (int64_t j = 0; j < dim; ++j) chunk[j] = FAdd(chunk[j], LoadGrad(p.grads, p.grads_bf16, base + j));
    }
    for (int64_t j = 0; j < dim; ++j) g[j] = FAdd(g[j], chunk[j]);
  }
}

// One distinct row (table-local `row`) from the run of sorted entries [first,
// last); `scratch` holds 2 * dim floats.
inline void UpdateRowCpu(const UpdateParams& p, const uint64_t* pairs, int64_t first, int64_t last, int64_t row,
                         float lr, float* scratch) {
  const TrainableView& t = p.t;
  float* g = scratch;
  RunGradientRowCpu(p, pairs, first, last, g, scratch + t.dim);
  uint8_t* record = t.table + row * t.stride;
  if (t.optimizer == RowOptimizerKind::kRowAdagrad) {
    float lanes[kRowLanes] = {};
    for (int64_t j = 0; j < t.dim; ++j) lanes[j % kRowLanes] = FAdd(lanes[j % kRowLanes], FMul(g[j], g[j]));
    float acc = LoadValue(record + t.state_offset, RowFormat::kF32, 0);
    const float multiplier = RowAdagradMultiplier(&acc, FoldLanes(lanes), t.dim, lr, p.scalars);
    for (int64_t j = 0; j < t.dim; ++j) {
      StoreValue(record, t.format, j, RowAdagradValue(LoadValue(record, t.format, j), g[j], multiplier));
    }
    StoreValue(record + t.state_offset, RowFormat::kF32, 0, acc);
    return;
  }
  for (int64_t j = 0; j < t.dim; ++j) StoreValue(record, t.format, j, UpdateValue(t, record, j, g[j], lr, p.scalars));
}

// Bytes of scratch UpdateCpu takes (the sorted (row, position) pairs; the
// update's workspace, UpdateWorkspaceBytes, is larger).
inline int64_t UpdateCpuWorkspaceBytes(int64_t num_ids) { return num_ids * static_cast<int64_t>(sizeof(uint64_t)); }

// Returns false when the workspace is too small. Entries whose id the table
// does not hold sort last (key num_rows) and are skipped.
inline bool UpdateCpu(const UpdateParams& p, int max_threads) {
  const int64_t n = p.num_ids;
  if (n == 0) return true;
  if (p.workspace_bytes < UpdateCpuWorkspaceBytes(n)) return false;
  uint64_t* pairs = reinterpret_cast<uint64_t*>(p.workspace);
  const int64_t none = p.t.num_rows;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = TrainableLocalRow(p.t, p.ids[i]);
    const uint64_t key = static_cast<uint64_t>(local == kNoRow ? none : local);
    pairs[i] = (key << 32) | static_cast<uint64_t>(i);
  }
  std::sort(pairs, pairs + n);  // (row, position): equal rows end up in position order
  const float lr = *p.lr;
  // A chunk updates the runs that start in it, so each row is written by one thread.
  // Each chunk's 2 * dim floats of scratch, allocated here, before anything is
  // written (a std::bad_alloc leaves the table as it was).
  const int64_t per_chunk = 2 * p.t.dim;
  std::vector<float> scratch(static_cast<size_t>(ParallelChunkCount(n, max_threads) * per_chunk));
  ParallelIndexedChunks(n, max_threads, [&p, pairs, n, none, lr, &scratch, per_chunk](int c, int64_t lo, int64_t hi) {
    float* own = scratch.data() + c * per_chunk;
    int64_t i = lo;
    while (i < hi && i > 0 && (pairs[i] >> 32) == (pairs[i - 1] >> 32)) ++i;
    while (i < hi) {
      const int64_t row = static_cast<int64_t>(pairs[i] >> 32);
      int64_t j = i + 1;
      while (j < n && static_cast<int64_t>(pairs[j] >> 32) == row) ++j;
      if (row == none) return;  // the ids the table does not hold, all at the end
      UpdateRowCpu(p, pairs, i, j, row, lr, own);
      i = j;
    }
  });
  return true;
}

}  // namespace engram
