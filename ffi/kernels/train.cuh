// The CUDA side of trainable tables: the lookup (a warp per row copies its
// values out of host-mapped or device memory) and the update (ids sorted by
// row with their positions by dedup.cuh's radix sort, then a warp per distinct
// row sums the row's gradients in position order, reads the row and its state,
// updates them with train_rows.h's math and writes them back in place).
// The update runs here, on the GPU, rather than on host threads: the gradients
// are already in HBM, and the kernel reads only the distinct rows and their
// state over PCIe and writes them back, all on XLA's stream. Host threads
// would need the gradients copied to the host and a host callback that the
// step's stream waits on: a synchronisation per step. Framework-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/dedup.cuh"
#include "kernels/train_rows.h"

namespace engram {

constexpr int kTrainThreads = 256;
constexpr int kTrainWarps = kTrainThreads / 32;

// Warp w copies rows w, w + warps, ...: 16-byte words when a row's bytes allow, else 2-byte ones.
template <typename Word>
static __global__ void __launch_bounds__(kTrainThreads)
    TrainableGatherKernel(TrainableView t, const int32_t* ids, int64_t num_ids, uint8_t* out) {
  const int64_t row_bytes = t.dim * ValueBytes(t.format);
  const int64_t words = row_bytes / static_cast<int64_t>(sizeof(Word));
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kTrainWarps;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kTrainWarps) + threadIdx.x / 32; i < num_ids; i += warps) {
    const int64_t local = static_cast<int64_t>(ids[i]) - t.row_start;
    Word* dst = reinterpret_cast<Word*>(out + i * row_bytes);
    if (local < 0 || local >= t.num_rows) {
      for (int64_t w = lane; w < words; w += 32) dst[w] = Word{};
    } else {
      const Word* src = reinterpret_cast<const Word*>(t.table + local * t.stride);
      for (int64_t w = lane; w < words; w += 32) dst[w] = src[w];
    }
  }
}

static inline int TrainGrid(int64_t items) {
  const int64_t wanted = (items + kTrainWarps - 1) / kTrainWarps;
  return static_cast<int>(wanted < 1 ? 1 : (wanted > 4096 ? 4096 : wanted));
}

// Rows of `ids` into `out` ([num_ids, dim] in the table's dtype), on at most
// `max_ctas` CTAs (<= 0: as many as the batch fills). Never synchronises.
static inline cudaError_t LaunchTrainableGather(const TrainableView& t, const int32_t* ids, int64_t num_ids,
                                                uint8_t* out, cudaStream_t stream, int max_ctas = 0) {
  if (num_ids == 0) return cudaSuccess;
  int ctas = TrainGrid(num_ids);
  if (max_ctas > 0 && ctas > max_ctas) ctas = max_ctas;
  const int64_t row_bytes = t.dim * ValueBytes(t.format);
  const bool wide = row_bytes % 16 == 0 && t.stride % 16 == 0 && reinterpret_cast<uintptr_t>(t.table) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (wide) {
    TrainableGatherKernel<uint4><<<ctas, kTrainThreads, 0, stream>>>(t, ids, num_ids, out);
  } else {
    TrainableGatherKernel<uint16_t><<<ctas, kTrainThreads, 0, stream>>>(t, ids, num_ids, out);
  }
  return cudaGetLastError();
}

// Value j of the summed gradient of the run of sorted entries [first, last).
static __device__ __forceinline__ float RunGradientCuda(const UpdateParams& p, const int32_t* positions, int64_t first,
                                                        int64_t last, int64_t j) {
  float g = 0.0f;
  for (int64_t e = first; e < last; ++e) g = FAdd(g, LoadGrad(p.grads, p.grads_bf16, positions[e] * p.t.dim + j));
  return g;
}

// Warp w takes sorted entries w, w + warps, ...; the warp whose entry starts a
// run of a held row updates that row, lane l taking values l, l + 32, ...
static __global__ void __launch_bounds__(kTrainThreads)
    UpdateRowsKernel(UpdateParams p, const uint32_t* keys, const int32_t* positions) {
  const TrainableView& t = p.t;
  const int lane = threadIdx.x & 31;
  const int64_t n = p.num_ids;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kTrainWarps;
  const float lr = *p.lr;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(kTrainWarps) + threadIdx.x / 32; e < n; e += warps) {
    const uint32_t key = keys[e];
    if (key >= static_cast<uint64_t>(t.num_rows) || (e > 0 && keys[e - 1] == key)) continue;
    int64_t last = e + 1;
    while (last < n && keys[last] == key) ++last;
    uint8_t* record = t.table + static_cast<int64_t>(key) * t.stride;
    if (t.optimizer == RowOptimizerKind::kRowAdagrad) {
      // Read before the fold's shuffles, which every lane must reach before lane 0 can write it back.
      float acc = LoadValue(record + t.state_offset, RowFormat::kF32, 0);
      float partial = 0.0f;  // lane l: values l, l + 32, ... in order, as train_rows.h's lanes
      for (int64_t j = lane; j < t.dim; j += 32) {
        const float g = RunGradientCuda(p, positions, e, last, j);
        partial = FAdd(partial, FMul(g, g));
      }
      // The halving fold of FoldLanes: lane l + half's partial joins lane l's
      // (float addition commutes, so every lane ends with lane 0's sum).
      for (int half = 16; half >= 1; half /= 2) partial = FAdd(partial, __shfl_xor_sync(0xFFFFFFFFu, partial, half));
      const float multiplier = RowAdagradMultiplier(&acc, partial, t.dim, lr, p.scalars);
      for (int64_t j = lane; j < t.dim; j += 32) {
        const float g = RunGradientCuda(p, positions, e, last, j);
        StoreValue(record, t.format, j, RowAdagradValue(LoadValue(record, t.format, j), g, multiplier));
      }
      if (lane == 0) StoreValue(record + t.state_offset, RowFormat::kF32, 0, acc);
    } else {
      for (int64_t j = lane; j < t.dim; j += 32) {
        const float g = RunGradientCuda(p, positions, e, last, j);
        StoreValue(record, t.format, j, UpdateValue(t, record, j, g, lr, p.scalars));
      }
    }
  }
}

// The whole update on `stream`: sort, then one warp per distinct held row.
// p.workspace holds LookupWorkspaceBytes(num_ids, kSorted) bytes. Never synchronises.
static inline cudaError_t LaunchUpdate(const UpdateParams& p, cudaStream_t stream) {
  if (p.num_ids == 0) return cudaSuccess;
  DedupGatherParams sort;
  sort.gather.ids = p.ids;
  sort.gather.num_ids = p.num_ids;
  sort.gather.row_start = p.t.row_start;
  sort.gather.num_rows = p.t.num_rows;
  sort.gather.dim = p.t.dim;
  sort.order = VisitOrder::kSorted;
  sort.workspace = p.workspace;
  sort.workspace_bytes = p.workspace_bytes;
  const uint32_t* keys = nullptr;
  const int32_t* positions = nullptr;
  // CUB's radix sort is stable and the positions start ascending, so equal
  // rows keep position order: the sums are the CPU's, bit for bit.
  cudaError_t err = SortIdsByRow(sort, stream, &keys, &positions);
  if (err != cudaSuccess) return err;
  UpdateRowsKernel<<<TrainGrid(p.num_ids), kTrainThreads, 0, stream>>>(p, keys, positions);
  return cudaGetLastError();
}

}  // namespace engram
