// The CUDA side of trainable tables: the lookup (a warp per row copies its
// values out of host-mapped or device memory) and the update (ids sorted by
// row with their positions by dedup.cuh's radix sort; then a warp per distinct
// row, 256 values at a time, 8 consecutive ones per lane in 16-byte words,
// loads the row's values and state, sums the row's gradients in
// train_rows.h's chunked order while those loads cross PCIe, updates them
// with train_rows.h's math and stores them back in place; a row seen more
// than kLongRun times is left to a CTA of its own, whose warps sum the run's
// chunks side by side).
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

// -- a tile of 256 values: 8 consecutive ones per lane ----------------------------
//
// Both update kernels sum a row's gradients kWarpTile values at a time, lane
// l holding values 8l .. 8l + 7 of the tile: 16 (bfloat16) or 32 (float32)
// bytes, one or two 16-byte words of each gradient row; the short-run kernel
// also loads and stores the row's values and state so. One value per lane and
// access would take 4 (float32) or 8 (bfloat16) times as many accesses for
// the same bytes.

constexpr int kWarpTile = 256;
constexpr int kLaneValues = kWarpTile / 32;  // lane l: values 8l .. 8l + 7 of the tile
constexpr int kLongBatch = 8;                // entries whose gradients a lane loads before adding any: long runs
constexpr int kShortBatch = 4;               // the same for short runs (fewer registers: see UpdateRowsKernel)
static_assert(kGradChunk == 64, "a chunk's positions are two per lane");
static_assert(kLaneValues == 8, "a wide load is 8 bfloat16 or 2 x 4 float32 values");

// 8 consecutive bfloat16 or float32 values at the 16-byte aligned `src` as
// float32: one or two 16-byte loads.
static __device__ __forceinline__ void LoadWide8(const void* src, bool bf16, float (&out)[kLaneValues]) {
  if (bf16) {
    const uint4 w = *static_cast<const uint4*>(src);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = BitsToFloat(words[k] << 16);
      out[2 * k + 1] = BitsToFloat(words[k] & 0xFFFF0000u);
    }
  } else {
    const float4 a = static_cast<const float4*>(src)[0];
    const float4 b = static_cast<const float4*>(src)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  }
}

// Values [col, col + 8) of gradient row `pos` as float32, those from `end`
// on 0: one or two 16-byte loads when `wide` (dim % 8 == 0, so end - col is
// 8; grads 16-byte aligned), else one value at a time.
static __device__ __forceinline__ void LoadGrad8(const UpdateParams& p, int64_t pos, int64_t col, int64_t end,
                                                 bool wide, float (&out)[kLaneValues]) {
  const int64_t index = pos * p.t.dim + col;
  if (wide) {
    LoadWide8(static_cast<const uint8_t*>(p.grads) + index * (p.grads_bf16 ? 2 : 4), p.grads_bf16, out);
  } else {
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) out[k] = col + k < end ? LoadGrad(p.grads, p.grads_bf16, index + k) : 0.0f;
  }
}

// Values [col, col + 8) of the float32 or bfloat16 array at `base` (a row's
// values, Adagrad's accumulators, one of lazy Adam's moments) as float32,
// those from `end` on 0: one or two 16-byte loads when `wide` (base 16-byte
// aligned and dim % 8 == 0, so a lane's values are all in or all out), else
// one value at a time, none past `end`.
static __device__ __forceinline__ void LoadValues8(const uint8_t* base, RowFormat format, int64_t col, int64_t end,
                                                   bool wide, float (&out)[kLaneValues]) {
  if (wide && col < end) {
    LoadWide8(base + col * ValueBytes(format), format == RowFormat::kBf16, out);
  } else {
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) out[k] = col + k < end ? LoadValue(base, format, col + k) : 0.0f;
  }
}

// The store of LoadValues8: values [col, min(col + 8, end)) of `in` (rounded
// to bfloat16 as StoreValue rounds), nothing from `end` on.
static __device__ __forceinline__ void StoreValues8(uint8_t* base, RowFormat format, int64_t col, int64_t end,
                                                    bool wide, const float (&in)[kLaneValues]) {
  if (wide && col < end && format == RowFormat::kBf16) {
    uint32_t words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      words[k] =
          static_cast<uint32_t>(FloatToBf16(in[2 * k])) | (static_cast<uint32_t>(FloatToBf16(in[2 * k + 1])) << 16);
    }
    *reinterpret_cast<uint4*>(base + 2 * col) = make_uint4(words[0], words[1], words[2], words[3]);
  } else if (wide && col < end) {
    float4* dst = reinterpret_cast<float4*>(base + 4 * col);
    dst[0] = make_float4(in[0], in[1], in[2], in[3]);
    dst[1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) {
      if (col + k < end) StoreValue(base, format, col + k, in[k]);
    }
  }
}

// Lane l's sums of values [col, col + 8) over the chunk of sorted entries
// [lo, hi), each in position order from +0.0; lanes whose values lie past
// the tile (col >= tile_end) load nothing. The loads of kBatch entries are
// issued before their additions, in order, so a warp keeps several rows of
// gradients in flight.
template <int kBatch>
static __device__ __forceinline__ void ChunkSums(const UpdateParams& p, const int32_t* positions, int64_t lo,
                                                 int64_t hi, int64_t col, int64_t tile_end, bool wide, int lane,
                                                 float (&sums)[kLaneValues]) {
  const int32_t first_half = lo + lane < hi ? positions[lo + lane] : 0;
  const int32_t second_half = lo + 32 + lane < hi ? positions[lo + 32 + lane] : 0;
  const bool mine = col < tile_end;
  const int64_t count = hi - lo;
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) sums[k] = 0.0f;
  for (int64_t i0 = 0; i0 < count; i0 += kBatch) {
    float values[kBatch][kLaneValues];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = i0 + b;
      const int32_t pos = __shfl_sync(0xFFFFFFFFu, i < 32 ? first_half : second_half, static_cast<int>(i & 31));
      if (mine && i < count) LoadGrad8(p, pos, col, tile_end, wide, values[b]);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (!mine || i0 + b >= count) continue;
#pragma unroll
      for (int k = 0; k < kLaneValues; ++k) sums[k] = FAdd(sums[k], values[b][k]);
    }
  }
}

// Lane l's summed gradient of values [col, col + 8) over the run of sorted
// entries [first, last), in train_rows.h's chunked order: each chunk of
// kGradChunk entries summed in position order from +0.0, the chunk sums
// added in order from +0.0; 0 from `end` on. Every lane of the warp must
// call it with the same run (ChunkSums shuffles the run's positions).
static __device__ __forceinline__ void RunSums(const UpdateParams& p, const int32_t* positions, int64_t first,
                                               int64_t last, int64_t col, int64_t end, bool wide, int lane,
                                               float (&total)[kLaneValues]) {
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) total[k] = 0.0f;
  for (int64_t lo = first; lo < last; lo += kGradChunk) {
    float sums[kLaneValues];
    ChunkSums<kShortBatch>(p, positions, lo, min(lo + kGradChunk, last), col, end, wide, lane, sums);
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) total[k] = FAdd(total[k], sums[k]);
  }
}

// -- short runs: a warp per row --------------------------------------------------
//
// Warp w takes sorted entries w, w + warps, ...; the warp whose entry starts a
// run of a held row updates that row, unless the run is long: then it lists
// the run for UpdateLongRunsKernel. A pinned table's record is a PCIe round
// trip away (1-2 us), and a store to it may alias any later load, so the
// compiler keeps a load after an earlier store: per tile of kWarpTile values,
// each lane issues every load of its part of the record first (values and
// state, and row-wise Adagrad's accumulator), then sums the run's gradients
// (in HBM) under their latency, then does the math and the stores. A row of
// up to kWarpTile values costs one round trip plus its writes.
//
// Row-wise Adagrad's sum of squares takes value j in lane j % 32 (train_rows.h's
// order): each tile's summed gradients go through a per-warp shared-memory
// tile of kWarpTile floats (transpose: lane l writes values 8l .. 8l + 7 and
// reads l, l + 32, ...). A row of up to kWarpTile values keeps its values and
// summed gradient in registers for the apply; a wider one (up to 16384 values:
// 64 KiB a warp, past any shared memory) sums its run again in the apply pass,
// where the re-sum's HBM reads run under the PCIe latency of the values' loads.
//
// Registers: a lane holds up to 4 x 8 floats (values, two state arrays, the
// summed gradient) across the gradient sum, plus kShortBatch x 8 gradients in
// flight. With kLongBatch's 8 the kernel took 173 registers (nvcc 13, sm_90:
// one CTA of 8 warps per SM); with 4 and two CTAs per SM asked of ptxas it
// takes 127 and spills nothing: 16 warps per SM, each with a row's loads in
// flight, far more bytes than PCIe's bandwidth-delay product (~100 KB).
constexpr int kUpdateRowsCtasPerSm = 2;

static __global__ void __launch_bounds__(kTrainThreads, kUpdateRowsCtasPerSm)
    UpdateRowsKernel(UpdateParams p, const uint32_t* keys, const int32_t* positions, LongRuns runs) {
  extern __shared__ float transposes[];  // row-wise Adagrad: [kTrainWarps][kWarpTile]
  const TrainableView& t = p.t;
  const int lane = threadIdx.x & 31;
  const int64_t n = p.num_ids;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kTrainWarps;
  const float lr = *p.lr;
  // Record stride and state offset are multiples of 16 by layout, lazy Adam's
  // second moment starts dim * 2 or 4 bytes (a multiple of 16) after the first.
  const bool wide = t.dim % 8 == 0 && reinterpret_cast<uintptr_t>(t.table) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.grads) % 16 == 0;
  const bool one_tile = t.dim <= kWarpTile;
  const int64_t moment_bytes = t.dim * ValueBytes(t.moment_format);
  float* transpose = transposes + (threadIdx.x / 32) * kWarpTile;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(kTrainWarps) + threadIdx.x / 32; e < n; e += warps) {
    const uint32_t key = keys[e];
    // Both exits below are the whole warp's: key, e and last are the same in every lane.
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
    uint8_t* state = record + t.state_offset;
    float values[kLaneValues];
    float g[kLaneValues];
    if (t.optimizer == RowOptimizerKind::kRowAdagrad) {
      // Every lane loads the accumulator (one word: one transaction for the
      // warp) with the values, before the gradient sums and the fold's
      // shuffles, which all lanes reach before lane 0 stores it. When wide the
      // table, so the accumulator, is 16-byte aligned: one 4-byte load, where
      // LoadValue's memcpy of unknown alignment compiles to 4 byte loads.
      float acc = wide ? *reinterpret_cast<const float*>(state) : LoadValue(state, RowFormat::kF32, 0);
      if (one_tile) LoadValues8(record, t.format, kLaneValues * lane, t.dim, wide, values);
      float partial = 0.0f;  // lane l: values l, l + 32, ... in order, as train_rows.h's lanes
      for (int64_t tile = 0; tile < t.dim; tile += kWarpTile) {
        const int64_t end = min(tile + static_cast<int64_t>(kWarpTile), t.dim);
        RunSums(p, positions, e, last, tile + kLaneValues * lane, end, wide, lane, g);
#pragma unroll
        for (int k = 0; k < kLaneValues; ++k) transpose[kLaneValues * lane + k] = g[k];
        __syncwarp();
#pragma unroll
        for (int m = 0; m < kLaneValues; ++m) {
          const int64_t j = tile + 32 * m + lane;
          if (j < t.dim) {
            const float x = transpose[32 * m + lane];
            partial = FAdd(partial, FMul(x, x));
          }
        }
        __syncwarp();  // read before the next tile's (or row's) writes
      }
      // The halving fold of FoldLanes: lane l + half's partial joins lane l's
      // (float addition commutes, so every lane ends with lane 0's sum).
      for (int half = 16; half >= 1; half /= 2) partial = FAdd(partial, __shfl_xor_sync(0xFFFFFFFFu, partial, half));
      const float multiplier = RowAdagradMultiplier(&acc, partial, t.dim, lr, p.scalars);
      for (int64_t tile = 0; tile < t.dim; tile += kWarpTile) {
        const int64_t end = min(tile + static_cast<int64_t>(kWarpTile), t.dim);
        const int64_t col = tile + kLaneValues * lane;
        if (!one_tile) {
          LoadValues8(record, t.format, col, end, wide, values);
          RunSums(p, positions, e, last, col, end, wide, lane, g);
        }
#pragma unroll
        for (int k = 0; k < kLaneValues; ++k) values[k] = RowAdagradValue(values[k], g[k], multiplier);
        StoreValues8(record, t.format, col, end, wide, values);
      }
      if (lane == 0 && wide) {
        *reinterpret_cast<float*>(state) = acc;
      } else if (lane == 0) {
        StoreValue(state, RowFormat::kF32, 0, acc);
      }
    } else {
      const bool adagrad = t.optimizer == RowOptimizerKind::kAdagrad;
      const bool adam = t.optimizer == RowOptimizerKind::kLazyAdam;
      for (int64_t tile = 0; tile < t.dim; tile += kWarpTile) {
        const int64_t end = min(tile + static_cast<int64_t>(kWarpTile), t.dim);
        const int64_t col = tile + kLaneValues * lane;
        float s0[kLaneValues] = {};  // Adagrad's accumulators, or lazy Adam's m
        float s1[kLaneValues] = {};  // lazy Adam's v
        LoadValues8(record, t.format, col, end, wide, values);
        if (adagrad) LoadValues8(state, RowFormat::kF32, col, end, wide, s0);
        if (adam) {
          LoadValues8(state, t.moment_format, col, end, wide, s0);
          LoadValues8(state + moment_bytes, t.moment_format, col, end, wide, s1);
        }
        RunSums(p, positions, e, last, col, end, wide, lane, g);
#pragma unroll
        for (int k = 0; k < kLaneValues; ++k) {
          values[k] = OptimizeValue(t.optimizer, t.moment_format, values[k], g[k], &s0[k], &s1[k], lr, p.scalars);
        }
        StoreValues8(record, t.format, col, end, wide, values);
        if (adagrad) StoreValues8(state, RowFormat::kF32, col, end, wide, s0);
        if (adam) {
          StoreValues8(state, t.moment_format, col, end, wide, s0);
          StoreValues8(state + moment_bytes, t.moment_format, col, end, wide, s1);
        }
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
constexpr int kLongTile = kWarpTile;  // values of the row summed per pass over the run
static_assert(kLongTile <= kLongThreads, "a thread per value of a tile folds the chunk sums");

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
          ChunkSums<kLongBatch>(p, positions, lo, min(lo + kGradChunk, last), col, tile_end, wide, lane, sums);
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
// one CTA per long run, the row kernels on at most `max_ctas` CTAs (<= 0: as
// many as the batch fills; a background update leaves the model its SMs). The
// sort runs on CUB's own grid. p.workspace holds UpdateWorkspaceBytes(num_ids)
// bytes: the sort's, then the long runs' counters and list. Never synchronises.
static inline cudaError_t LaunchUpdate(const UpdateParams& p, cudaStream_t stream, int max_ctas = 0) {
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
  const bool row_wise = p.t.optimizer == RowOptimizerKind::kRowAdagrad;
  const size_t transpose_bytes = row_wise ? sizeof(float) * kTrainWarps * kWarpTile : 0;
  int row_ctas = TrainGrid(n);
  if (max_ctas > 0 && row_ctas > max_ctas) row_ctas = max_ctas;
  UpdateRowsKernel<<<row_ctas, kTrainThreads, transpose_bytes, stream>>>(p, keys, positions, runs);
  err = cudaGetLastError();
  if (err != cudaSuccess || runs.capacity == 0) return err;
  // As many CTAs as fit on the GPU at once take the listed runs in turn; the
  // list's length is known only on the device, so CTAs past it return at once.
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
  int ctas = static_cast<int>(runs.capacity < resident ? runs.capacity : resident);
  if (max_ctas > 0 && ctas > max_ctas) ctas = max_ctas;
  UpdateLongRunsKernel<<<ctas, kLongThreads, shared_bytes, stream>>>(p, keys, positions, runs);
  return cudaGetLastError();
}

}  // namespace engram
