// CUDA gather for the background: CTAs of one warp with at most 32 registers a
// thread and under 10 KiB of shared memory, so that one fits on an SM beside a
// GEMM CTA that takes the rest of it. The model's largest GEMMs on an H200 run
// one 384-thread CTA of 168 registers and 213-221 KB of shared memory per SM,
// all 132 at once: a wide gather CTA (kernels/gather.cuh) on an SM holds that
// GEMM CTA back until the gather ends. No XLA types.
#pragma once

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cache_index.h"
#include "kernels/gather.cuh"

namespace engram {

constexpr int kSlimThreads = 32;

// What a row of a stage copies and where it goes.
struct SlimRow {
  const uint4* src;  // its record (table or cache); null: no row, zeros
  int64_t out;       // output row
};

// Shared memory of a pipeline stage, records and SlimRows (16 rows of dim 256);
// two stages, 9 KiB: beside a 221,420-byte GEMM CTA, with the 1 KiB the SM
// reserves per CTA, 0.8 KB of the SM's 228 KiB are left.
constexpr int kSlimStageBytes = 16 * (272 + sizeof(SlimRow));

__host__ __device__ inline int SlimStageRows(int64_t stride) {
  const int64_t rows = kSlimStageBytes / (stride + static_cast<int64_t>(sizeof(SlimRow)));
  return rows < 1 ? 1 : static_cast<int>(rows);
}

inline size_t SlimSharedBytes(int64_t dim) {
  const int64_t stride = RowStride(dim);
  return 2 * static_cast<size_t>(SlimStageRows(stride)) * (stride + sizeof(SlimRow));
}

// A stage's rows for Output::Store: row r decodes its own record into its out row.
struct SlimStageMap {
  const SlimRow* rows;
  __device__ __forceinline__ int Record(int r) const { return r; }
  __device__ __forceinline__ int64_t Out(int r) const { return rows[r].out; }
};

// Stage `s` of tile `t`: each row's source (and, kCache, a probe of the cache,
// whose hits are read from HBM), then its record copied asynchronously into
// shared memory (cp.async: no registers hold the loads, so a warp keeps a whole
// stage in flight); one commit group per stage.
template <bool kSorted, bool kCache>
__device__ __forceinline__ void IssueSlimStage(const GatherParams& p, const CacheView& cache, const uint32_t* keys,
                                               const int32_t* positions, const TileShape& shape, int stage_rows,
                                               int64_t t, uint4* records, SlimRow* info) {
  const int64_t first = t * stage_rows;
  const int rows = RowsOfTile(p.num_ids, first, stage_rows);
  for (int r = threadIdx.x; r < rows; r += kSlimThreads) {
    int64_t key, out;
    if constexpr (kSorted) {
      key = keys[first + r];
      out = positions[first + r];
    } else {
      const int64_t local = static_cast<int64_t>(p.ids[first + r]) - p.row_start;
      key = (local >= 0 && local < p.num_rows) ? local : p.num_rows;
      out = first + r;
    }
    const uint4* src = nullptr;
    if (key < p.num_rows) {
      src = reinterpret_cast<const uint4*>(p.table) + key * shape.lanes;
      if constexpr (kCache) {
        const int64_t slot = CacheSlot(cache, key);
        if (slot >= 0) src = reinterpret_cast<const uint4*>(cache.records + slot * shape.stride);
      }
    }
    info[r] = {src, out};
  }
  __syncwarp();
  const int words = rows * shape.lanes;
  for (int j = threadIdx.x; j < words; j += kSlimThreads) {
    const int r = j / shape.lanes;
    const uint4* src = info[r].src;
    if (src != nullptr) {
      __pipeline_memcpy_async(records + j, src + (j - r * shape.lanes), 16);
    } else {
      records[j] = make_uint4(0, 0, 0, 0);
    }
  }
  __pipeline_commit();
}

// CTA b walks tiles b, b + gridDim.x, ... of SlimStageRows rows, copying the
// next tile into one stage while it decodes the other. kSorted: entries come as
// sorted (key, position) pairs (kernels/dedup.cuh's sort). Output: DecodeRows
// or CopyRecords (gather.cuh), so the bits are the wide gathers'.
template <bool kSorted, bool kCache, typename Output>
static __global__ void __maxnreg__(32)
    SlimGatherKernel(GatherParams p, CacheView cache, const uint32_t* keys, const int32_t* positions) {
  const TileShape shape = TileShapeOf(p.dim);
  const int stage_rows = SlimStageRows(shape.stride);
  const int stage_words = stage_rows * shape.lanes;
  extern __shared__ uint4 slim_shared[];
  SlimRow* info = reinterpret_cast<SlimRow*>(slim_shared + 2 * stage_words);
  const int64_t num_tiles = (p.num_ids + stage_rows - 1) / stage_rows;
  int64_t t = blockIdx.x;
  if (t >= num_tiles) return;
  int s = 0;
  IssueSlimStage<kSorted, kCache>(p, cache, keys, positions, shape, stage_rows, t, slim_shared, info);
  for (; t < num_tiles; t += gridDim.x) {
    const int64_t next = t + gridDim.x;
    if (next < num_tiles) {
      IssueSlimStage<kSorted, kCache>(p, cache, keys, positions, shape, stage_rows, next,
                                      slim_shared + (s ^ 1) * stage_words, info + (s ^ 1) * stage_rows);
    } else {
      __pipeline_commit();  // an empty group: the wait below always leaves the newest one
    }
    __pipeline_wait_prior(1);  // this stage's copies have landed
    __syncwarp();
    Output::Store(RowsOfTile(p.num_ids, t * stage_rows, stage_rows), shape, p,
                  reinterpret_cast<const uint8_t*>(slim_shared + s * stage_words), SlimStageMap{info + s * stage_rows});
    __syncwarp();  // the stage is read before the next issue overwrites it
    s ^= 1;
  }
}

// `max_ctas` one-warp CTAs (<= 0: one per SM), no more than there are tiles.
// The kernel asks for the largest shared-memory carveout: an SM holds a GEMM's
// 221 KB CTA and a slim one together only in that configuration.
template <bool kSorted, bool kCache, typename Output>
static inline cudaError_t LaunchSlimGather(const GatherParams& p, const CacheView& cache, const uint32_t* keys,
                                           const int32_t* positions, int max_ctas, cudaStream_t stream) {
  if (p.num_ids == 0) return cudaSuccess;
  const auto kernel = SlimGatherKernel<kSorted, kCache, Output>;
  int ctas = max_ctas;
  if (ctas <= 0) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&ctas, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
  }
  const int64_t stage_rows = SlimStageRows(RowStride(p.dim));
  const int64_t tiles = (p.num_ids + stage_rows - 1) / stage_rows;
  if (tiles < ctas) ctas = static_cast<int>(tiles);
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return err;
  kernel<<<ctas, kSlimThreads, SlimSharedBytes(p.dim), stream>>>(p, cache, keys, positions);
  return cudaGetLastError();
}

}  // namespace engram
