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

// `count` values at `base` in `format` as float32, and back (rounded as
// StoreValue rounds): a loop per format, so each compiles to vector code.
inline void LoadValuesCpu(const uint8_t* base, RowFormat format, int64_t count, float* out) {
  if (format == RowFormat::kF32) {
    std::memcpy(out, base, static_cast<size_t>(4 * count));
    return;
  }
  for (int64_t j = 0; j < count; ++j) out[j] = LoadValue(base, RowFormat::kBf16, j);
}

inline void StoreValuesCpu(uint8_t* base, RowFormat format, int64_t count, const float* in) {
  if (format == RowFormat::kF32) {
    std::memcpy(base, in, static_cast<size_t>(4 * count));
    return;
  }
  for (int64_t j = 0; j < count; ++j) StoreValue(base, RowFormat::kBf16, j, in[j]);
}

// acc[j] += gradient row `row`'s value j, for j < dim, in float32.
template <bool kBf16>
inline void AddGradientRowCpu(const void* grads, int64_t row, int64_t dim, float* acc) {
  const int64_t base = row * dim;
  for (int64_t j = 0; j < dim; ++j) acc[j] = FAdd(acc[j], LoadGrad(grads, kBf16, base + j));
}

// The run's summed gradient into `g` ([dim]), in train_rows.h's chunked order
// (value by value the additions of the CUDA kernels' ChunkSums, FoldChunks and
// RunTotal), each entry's gradient row read once, front to back (`chunk` is
// [dim] scratch; a pair's low half is the entry's batch position).
inline void RunGradientRowCpu(const UpdateParams& p, const uint64_t* pairs, int64_t first, int64_t last, float* g,
                              float* chunk) {
  const int64_t dim = p.t.dim;
  std::fill(g, g + dim, 0.0f);
  for (int64_t start = first; start < last; start += kGradChunk) {
    const int64_t end = last - start < kGradChunk ? last : start + kGradChunk;
    std::fill(chunk, chunk + dim, 0.0f);
    for (int64_t e = start; e < end; ++e) {
      const int64_t position = static_cast<int64_t>(pairs[e] & 0xFFFFFFFFu);
      if (p.grads_bf16) {
        AddGradientRowCpu<true>(p.grads, position, dim, chunk);
      } else {
        AddGradientRowCpu<false>(p.grads, position, dim, chunk);
      }
    }
    for (int64_t j = 0; j < dim; ++j) g[j] = FAdd(g[j], chunk[j]);
  }
}

// Floats of scratch one thread's UpdateRowCpu takes: the summed gradient, a
// chunk's sum, the row's values and two state arrays.
inline int64_t UpdateRowScratch(int64_t dim) { return 5 * dim; }

// One distinct row (table-local `row`) from the run of sorted entries [first,
// last), with `scratch` (UpdateRowScratch floats): the row's record loaded as
// float32 arrays, each optimizer's math in a loop of its own over them (the
// values' order of operations is train_rows.h's, value by value), stored back.
inline void UpdateRowCpu(const UpdateParams& p, const uint64_t* pairs, int64_t first, int64_t last, int64_t row,
                         float lr, float* scratch) {
  const TrainableView& t = p.t;
  const int64_t dim = t.dim;
  float* g = scratch;
  float* values = scratch + 2 * dim;
  float* s0 = scratch + 3 * dim;
  float* s1 = scratch + 4 * dim;
  RunGradientRowCpu(p, pairs, first, last, g, scratch + dim);
  uint8_t* record = t.table + row * t.stride;
  uint8_t* state = record + t.state_offset;
  LoadValuesCpu(record, t.format, dim, values);
  switch (t.optimizer) {
    case RowOptimizerKind::kRowAdagrad: {
      float lanes[kRowLanes] = {};  // value j into lane j % kRowLanes, 32 values a pass (a vector loop)
      for (int64_t j0 = 0; j0 < dim; j0 += kRowLanes) {
        const int64_t count = std::min<int64_t>(kRowLanes, dim - j0);
        for (int64_t l = 0; l < count; ++l) lanes[l] = FAdd(lanes[l], FMul(g[j0 + l], g[j0 + l]));
      }
      float acc = LoadValue(state, RowFormat::kF32, 0);
      const float multiplier = RowAdagradMultiplier(&acc, FoldLanes(lanes), dim, lr, p.scalars);
      for (int64_t j = 0; j < dim; ++j) values[j] = RowAdagradValue(values[j], g[j], multiplier);
      StoreValue(state, RowFormat::kF32, 0, acc);
      break;
    }
    case RowOptimizerKind::kAdagrad:
      LoadValuesCpu(state, RowFormat::kF32, dim, s0);
      for (int64_t j = 0; j < dim; ++j) values[j] = AdagradValue(values[j], g[j], &s0[j], lr, p.scalars);
      StoreValuesCpu(state, RowFormat::kF32, dim, s0);
      break;
    case RowOptimizerKind::kLazyAdam: {
      uint8_t* v_base = state + dim * ValueBytes(t.moment_format);
      LoadValuesCpu(state, t.moment_format, dim, s0);
      LoadValuesCpu(v_base, t.moment_format, dim, s1);
      for (int64_t j = 0; j < dim; ++j) {
        values[j] = LazyAdamValue(values[j], g[j], &s0[j], &s1[j], lr, t.moment_format, p.scalars);
      }
      StoreValuesCpu(state, t.moment_format, dim, s0);
      StoreValuesCpu(v_base, t.moment_format, dim, s1);
      break;
    }
    case RowOptimizerKind::kSgd:
      for (int64_t j = 0; j < dim; ++j) values[j] = SgdValue(values[j], g[j], lr);
      break;
  }
  StoreValuesCpu(record, t.format, dim, values);
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
  // Each chunk's scratch, allocated here, before anything is written (a
  // std::bad_alloc leaves the table as it was).
  const int64_t per_chunk = UpdateRowScratch(p.t.dim);
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
