// The CUDA side of trainable tables: the lookup (a warp per row copies its
// values out of host-mapped or device memory) and the update (ids sorted by
// row with their positions by dedup.cuh's radix sort; then a warp per distinct
// row sums the row's gradients in train_rows.h's chunked order, reads the row
// and its state, updates them with train_rows.h's math and writes them back in
// place; a row seen more than kLongRun times is left to a CTA of its own,
// whose warps sum the run's chunks side by side).
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

// The batch position of sorted entry e.
struct SortedPositions {
  const int32_t* positions;
  __device__ __forceinline__ int64_t operator()(int64_t e) const { return positions[e]; }
};

// The runs too long for one warp (more than kLongRun entries): appended by
// UpdateRowsKernel, taken one at a time by UpdateLongRunsKernel's CTAs. All
// three live in the update's workspace (UpdateWorkspaceBytes).
struct LongRuns {
  uint32_t* counters = nullptr;  // [0]: runs listed, [1]: runs taken; zero before the update
  int2* list = nullptr;          // (first, last) sorted entries of each listed run
  int64_t capacity = 0;          // MaxLongRuns(num_ids): no batch lists more
};

// One past the last sorted entry of the run that starts at e (keys sorted):
// the warp compares the next 32 keys at once and, if all are the run's,
// halves the rest. All lanes get the same answer.
static __device__ __forceinline__ int64_t RunEnd(const uint32_t* keys, int64_t e, int64_t n, uint32_t key, int lane) {
  const int64_t probe = e + 1 + lane;
  const unsigned same = __ballot_sync(0xFFFFFFFFu, probe < n && keys[probe] == key);
  if (same != 0xFFFFFFFFu) return e + __ffs(~same);  // the first lane whose key differs
  int64_t lo = e + 32, hi = n;                       // keys[lo] is the run's; keys[hi] is not (or hi == n)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] == key) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return hi;
}

// Warp w takes sorted entries w, w + warps, ...; the warp whose entry starts a
// run of a held row updates that row, lane l taking values l, l + 32, ...,
// unless the run is long: then it lists the run for UpdateLongRunsKernel.
// (Row-wise Adagrad sums a short run twice, once for the squares and once to
// apply: cheaper than keeping dim values per warp anywhere.)
static __global__ void __launch_bounds__(kTrainThreads)
    UpdateRowsKernel(UpdateParams p, const uint32_t* keys, const int32_t* positions, LongRuns runs) {
  const TrainableView& t = p.t;
  const int lane = threadIdx.x & 31;
  const int64_t n = p.num_ids;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kTrainWarps;
  const float lr = *p.lr;
  const SortedPositions position{positions};
  for (int64_t e = blockIdx.x * static_cast<int64_t>(kTrainWarps) + threadIdx.x / 32; e < n; e += warps) {
    const uint32_t key = keys[e];
    if (key >= static_cast<uint64_t>(t.num_rows) || (e > 0 && keys[e - 1] == key)) continue;
    const int64_t last = RunEnd(keys, e, n, key, lane);
    if (last - e > kLongRun) {
      if (lane == 0) {
        const uint32_t slot = atomicAdd(&runs.counters[0], 1u);
        // Runs are disjoint and longer than kLongRun, so slot < capacity always.
        if (slot < runs.capacity) runs.list[slot] = make_int2(static_cast<int>(e), static_cast<int>(last));
      }
      continue;
    }
    uint8_t* record = t.table + static_cast<int64_t>(key) * t.stride;
    if (t.optimizer == RowOptimizerKind::kRowAdagrad) {
      // Read before the fold's shuffles, which every lane must reach before lane 0 can write it back.
      float acc = LoadValue(record + t.state_offset, RowFormat::kF32, 0);
      float partial = 0.0f;  // lane l: values l, l + 32, ... in order, as train_rows.h's lanes
      for (int64_t j = lane; j < t.dim; j += 32) {
        const float g = RunGradient(p, position, e, last, j);
        partial = FAdd(partial, FMul(g, g));
      }
      // The halving fold of FoldLanes: lane l + half's partial joins lane l's
      // (float addition commutes, so every lane ends with lane 0's sum).
      for (int half = 16; half >= 1; half /= 2) partial = FAdd(partial, __shfl_xor_sync(0xFFFFFFFFu, partial, half));
      const float multiplier = RowAdagradMultiplier(&acc, partial, t.dim, lr, p.scalars);
      for (int64_t j = lane; j < t.dim; j += 32) {
        const float g = RunGradient(p, position, e, last, j);
        StoreValue(record, t.format, j, RowAdagradValue(LoadValue(record, t.format, j), g, multiplier));
      }
      if (lane == 0) StoreValue(record + t.state_offset, RowFormat::kF32, 0, acc);
    } else {
      for (int64_t j = lane; j < t.dim; j += 32) {
        const float g = RunGradient(p, position, e, last, j);
        StoreValue(record, t.format, j, UpdateValue(t, record, j, g, lr, p.scalars));
      }
    }
  }
}

// -- long runs: a CTA per run ----------------------------------------------------
//
// Why kLongRun = 256: a warp sums a run of L entries in L dependent steps per
// value. A 2**20 batch gives each of the first kernel's 32,768 warps ~32
// entries, so a run of up to 256 (4 chunks, ~8 warps' share) is a tail that
// the other warps hide; a zipf batch's hottest rows repeat 10**4-10**5 times,
// which one warp would serialise. Much lower, and a CTA of 16 warps would sit
// mostly idle on runs of a few chunks (16 chunks make one round) and more
// rows would wait for the second kernel; much higher, and one warp's run
// would outlast a small batch's whole first kernel. A figure to tune with
// benchmarks/train.py: the bits are the same on either side of it.

constexpr int kLongThreads = 512;
constexpr int kLongWarps = kLongThreads / 32;
constexpr int kLongTile = 256;               // values of the row summed per pass over the run
constexpr int kLaneValues = kLongTile / 32;  // lane l: values 8l .. 8l + 7 of the tile
constexpr int kLongBatch = 8;                // entries whose gradients a lane loads before adding any
static_assert(kLongTile <= kLongThreads, "a thread per value of a tile folds the chunk sums");
static_assert(kGradChunk == 64, "a chunk's positions are two per lane");
static_assert(kLaneValues == 8, "a wide load is 8 bfloat16 or 2 x 4 float32 values");

// Values [col, col + 8) of gradient row `pos` as float32, those from `end`
// on 0: one or two 16-byte loads when `wide` (dim % 8 == 0, so end - col is
// 8; grads 16-byte aligned), else one value at a time.
static __device__ __forceinline__ void LoadGrad8(const UpdateParams& p, int64_t pos, int64_t col, int64_t end,
                                                 bool wide, float (&out)[kLaneValues]) {
  const int64_t index = pos * p.t.dim + col;
  if (wide && p.grads_bf16) {
    const uint4 w = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.grads) + index);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = BitsToFloat(words[k] << 16);
      out[2 * k + 1] = BitsToFloat(words[k] & 0xFFFF0000u);
    }
  } else if (wide) {
    const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.grads) + index);
    const float4 a = src[0];
    const float4 b = src[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) out[k] = col + k < end ? LoadGrad(p.grads, p.grads_bf16, index + k) : 0.0f;
  }
}

// Lane l's sums of values [col, col + 8) over the chunk of sorted entries
// [lo, hi), each in position order from +0.0; lanes whose values lie past
// the tile (col >= tile_end) load nothing. The loads of kLongBatch entries
// are issued before their additions, in order, so a warp keeps several rows
// of gradients in flight.
static __device__ __forceinline__ void ChunkSums(const UpdateParams& p, const int32_t* positions, int64_t lo,
                                                 int64_t hi, int64_t col, int64_t tile_end, bool wide, int lane,
                                                 float (&sums)[kLaneValues]) {
  const int32_t first_half = lo + lane < hi ? positions[lo + lane] : 0;
  const int32_t second_half = lo + 32 + lane < hi ? positions[lo + 32 + lane] : 0;
  const bool mine = col < tile_end;
  const int64_t count = hi - lo;
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) sums[k] = 0.0f;
  for (int64_t i0 = 0; i0 < count; i0 += kLongBatch) {
    float values[kLongBatch][kLaneValues];
#pragma unroll
    for (int b = 0; b < kLongBatch; ++b) {
      const int64_t i = i0 + b;
      const int32_t pos = __shfl_sync(0xFFFFFFFFu, i < 32 ? first_half : second_half, static_cast<int>(i & 31));
      if (mine && i < count) LoadGrad8(p, pos, col, tile_end, wide, values[b]);
    }
#pragma unroll
    for (int b = 0; b < kLongBatch; ++b) {
      if (!mine || i0 + b >= count) continue;
#pragma unroll
      for (int k = 0; k < kLaneValues; ++k) sums[k] = FAdd(sums[k], values[b][k]);
    }
  }
}

// CTA after CTA, each takes the next listed run and updates its row: for each
// tile of kLongTile values, warp w sums chunks w, w + 16, ... (a round of 16
// chunks at a time) into shared memory and thread i adds the round's chunk
// sums of value i, in chunk order, to its total. Element-wise optimizers then
// update the tile's values; row-wise Adagrad keeps the summed row in shared
// memory (dim floats) for its mean of squares, so no run is summed twice.
static __global__ void __launch_bounds__(kLongThreads)
    UpdateLongRunsKernel(UpdateParams p, const uint32_t* keys, const int32_t* positions, LongRuns runs) {
  extern __shared__ float shared[];
  float* partial = shared;                            // [kLongWarps][kLongTile]: one round's chunk sums
  float* row_grad = shared + kLongWarps * kLongTile;  // [dim]: row-wise Adagrad's summed row
  __shared__ uint32_t taken;
  __shared__ float multiplier;
  const TrainableView& t = p.t;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  const float lr = *p.lr;
  const bool row_wise = t.optimizer == RowOptimizerKind::kRowAdagrad;
  const bool wide = t.dim % 8 == 0 && reinterpret_cast<uintptr_t>(p.grads) % 16 == 0;
  const uint32_t listed = min(runs.counters[0], static_cast<uint32_t>(runs.capacity));
  for (;;) {
    if (threadIdx.x == 0) taken = atomicAdd(&runs.counters[1], 1u);
    __syncthreads();
    const uint32_t r = taken;
    if (r >= listed) return;  // the same for every thread of the CTA
    const int64_t first = runs.list[r].x;
    const int64_t last = runs.list[r].y;
    uint8_t* record = t.table + static_cast<int64_t>(keys[first]) * t.stride;
    const int64_t chunks = (last - first + kGradChunk - 1) / kGradChunk;
    for (int64_t tile = 0; tile < t.dim; tile += kLongTile) {
      const int64_t tile_end = min(tile + static_cast<int64_t>(kLongTile), t.dim);
      const int64_t col = tile + kLaneValues * lane;
      float total = 0.0f;  // thread i: value tile + i, for i < tile_end - tile
      for (int64_t round = 0; round < chunks; round += kLongWarps) {
        const int64_t c = round + warp;
        if (c < chunks) {
          const int64_t lo = first + c * kGradChunk;
          float sums[kLaneValues];
          ChunkSums(p, positions, lo, min(lo + kGradChunk, last), col, tile_end, wide, lane, sums);
#pragma unroll
          for (int k = 0; k < kLaneValues; ++k) {
            if (col + k < tile_end) partial[warp * kLongTile + kLaneValues * lane + k] = sums[k];
          }
        }
        __syncthreads();
        if (tile + threadIdx.x < tile_end) {
          const int64_t in_round = min(static_cast<int64_t>(kLongWarps), chunks - round);
          for (int64_t w = 0; w < in_round; ++w) total = FAdd(total, partial[w * kLongTile + threadIdx.x]);
        }
        __syncthreads();  // before the next round overwrites `partial`
      }
      const int64_t j = tile + threadIdx.x;
      if (j < tile_end) {
        if (row_wise) {
          row_grad[j] = total;
        } else {
          StoreValue(record, t.format, j, UpdateValue(t, record, j, total, lr, p.scalars));
        }
      }
    }
    if (row_wise) {
      __syncthreads();
      if (warp == 0) {
        float sum = 0.0f;  // lane l: values l, l + 32, ... in order, as train_rows.h's lanes
        for (int64_t j = lane; j < t.dim; j += 32) sum = FAdd(sum, FMul(row_grad[j], row_grad[j]));
        for (int half = 16; half >= 1; half /= 2) sum = FAdd(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, half));
        if (lane == 0) {
          float acc = LoadValue(record + t.state_offset, RowFormat::kF32, 0);
          multiplier = RowAdagradMultiplier(&acc, sum, t.dim, lr, p.scalars);
          StoreValue(record + t.state_offset, RowFormat::kF32, 0, acc);
        }
      }
      __syncthreads();
      for (int64_t j = threadIdx.x; j < t.dim; j += kLongThreads) {
        StoreValue(record, t.format, j, RowAdagradValue(LoadValue(record, t.format, j), row_grad[j], multiplier));
      }
    }
    __syncthreads();  // before the next run's `taken`, `multiplier` and row_grad
  }
}

// The whole update on `stream`: sort, then one warp per distinct held row and
// one CTA per long run. p.workspace holds UpdateWorkspaceBytes(num_ids) bytes:
// the sort's, then the long runs' counters and list. Never synchronises.
static inline cudaError_t LaunchUpdate(const UpdateParams& p, cudaStream_t stream) {
  const int64_t n = p.num_ids;
  if (n == 0) return cudaSuccess;
  if (p.workspace == nullptr || p.workspace_bytes < UpdateWorkspaceBytes(n)) return cudaErrorInvalidValue;
  const int64_t sort_bytes = LookupWorkspaceBytes(n, VisitOrder::kSorted);
  DedupGatherParams sort;
  sort.gather.ids = p.ids;
  sort.gather.num_ids = n;
  sort.gather.row_start = p.t.row_start;
  sort.gather.num_rows = p.t.num_rows;
  sort.gather.dim = p.t.dim;
  sort.order = VisitOrder::kSorted;
  sort.workspace = p.workspace;
  sort.workspace_bytes = sort_bytes;  // the sort's temporary storage ends where the long runs' part starts
  LongRuns runs;
  runs.capacity = MaxLongRuns(n);
  if (runs.capacity > 0) {
    runs.counters = reinterpret_cast<uint32_t*>(p.workspace + sort_bytes);
    runs.list = reinterpret_cast<int2*>(p.workspace + sort_bytes + kWorkspaceAlign);
    cudaError_t err = cudaMemsetAsync(runs.counters, 0, 2 * sizeof(uint32_t), stream);
    if (err != cudaSuccess) return err;
  }
  const uint32_t* keys = nullptr;
  const int32_t* positions = nullptr;
  // CUB's radix sort is stable and the positions start ascending, so equal
  // rows keep position order: the sums are the CPU's, bit for bit.
  cudaError_t err = SortIdsByRow(sort, stream, &keys, &positions);
  if (err != cudaSuccess) return err;
  UpdateRowsKernel<<<TrainGrid(n), kTrainThreads, 0, stream>>>(p, keys, positions, runs);
  err = cudaGetLastError();
  if (err != cudaSuccess || runs.capacity == 0) return err;
  // As many CTAs as fit on the GPU at once take the listed runs in turn; the
  // list's length is known only on the device, so CTAs past it return at once.
  const bool row_wise = p.t.optimizer == RowOptimizerKind::kRowAdagrad;
  const size_t shared_bytes = sizeof(float) * static_cast<size_t>(kLongWarps * kLongTile + (row_wise ? p.t.dim : 0));
  if (shared_bytes > 48 * 1024) {  // past the default limit a kernel must opt in
    err = cudaFuncSetAttribute(UpdateLongRunsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared_bytes));
    if (err != cudaSuccess) return err;
  }
  int device = 0;
  int sms = 0;
  int per_sm = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, UpdateLongRunsKernel, kLongThreads, shared_bytes);
  if (err != cudaSuccess) return err;
  const int64_t resident = static_cast<int64_t>(sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  const int ctas = static_cast<int>(runs.capacity < resident ? runs.capacity : resident);
  UpdateLongRunsKernel<<<ctas, kLongThreads, shared_bytes, stream>>>(p, keys, positions, runs);
  return cudaGetLastError();
}

}  // namespace engram
