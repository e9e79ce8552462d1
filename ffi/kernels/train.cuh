// The CUDA side of trainable tables: the lookup (a warp per row copies its
// values out of host-mapped or device memory) and the update (ids sorted by
// row with their positions by dedup.cuh's sort, then one kernel: the
// full chunks of every run longer than a chunk summed side by side, a warp
// per chunk, into the workspace, and a warp per distinct row, 256 values at a
// time, 8 consecutive ones per lane in 16-byte words, loads the row's values
// and state, sums the row's gradients in train_rows.h's chunked order while
// those loads cross PCIe (a short run's gradients, or a long run's chunk sums
// and last partial chunk), updates them with train_rows.h's math and stores
// them back in place).
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

// Searches of a run's edge in the sorted keys, a warp at a time: 32 probes
// at once cut the interval in which the edge lies 32-fold a round trip, 4
// round trips for 2^20 entries where halving it took 20 (a run's edge is
// sought in every window a hot run crosses: SumWindowChunk).

// One past the last sorted entry of the run that starts at e (keys sorted):
// the warp compares the next 32 keys at once and, if all are the run's,
// searches the rest. All lanes get the same answer.
static __device__ __forceinline__ int64_t RunEnd(const uint32_t* keys, int64_t e, int64_t n, uint32_t key, int lane) {
  const int64_t probe = e + 1 + lane;
  const unsigned same = __ballot_sync(0xFFFFFFFFu, probe < n && keys[probe] == key);
  if (same != 0xFFFFFFFFu) return e + __ffs(~same);  // the first lane whose key differs
  int64_t lo = e + 32, hi = n;                       // keys[lo] is the run's; keys[hi] is not (or hi == n)
  while (hi - lo > 1) {
    // Probes lo + step .. lo + 32 * step reach hi; those in the run are a prefix of the lanes.
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t at = lo + step * (lane + 1);
    const int in_run = __popc(__ballot_sync(0xFFFFFFFFu, at < hi && keys[at] == key));
    lo += step * in_run;
    hi = min(hi, lo + step);  // the first probe past the run, or hi
  }
  return hi;
}

// The first sorted entry of the run that holds entry e (keys sorted, key =
// keys[e]): RunEnd's mirror, the 32 keys before e compared at once, then the
// rest searched. All lanes get the same answer.
static __device__ __forceinline__ int64_t RunStart(const uint32_t* keys, int64_t e, uint32_t key, int lane) {
  const int64_t probe = e - 1 - lane;
  const unsigned same = __ballot_sync(0xFFFFFFFFu, probe >= 0 && keys[probe] == key);
  if (same != 0xFFFFFFFFu) return e - (__ffs(~same) - 1);  // entries e - k .. e - 1 are the run's, e - k - 1 not
  int64_t lo = -1, hi = e - 32;                            // keys[hi] is the run's; keys[lo] is not (or lo == -1)
  while (hi - lo > 1) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t at = hi - step * (lane + 1);
    const int in_run = __popc(__ballot_sync(0xFFFFFFFFu, at > lo && keys[at] == key));
    hi -= step * in_run;
    lo = max(lo, hi - step);  // the first probe before the run, or lo
  }
  return hi;
}

// -- a tile of 256 values: 8 consecutive ones per lane ----------------------------
//
// The update kernel sums a row's gradients kWarpTile values at a time, lane
// l holding values 8l .. 8l + 7 of the tile: 16 (bfloat16) or 32 (float32)
// bytes, one or two 16-byte words of each gradient row, and loads and stores
// the row's values and state so. One value per lane and
// access would take 4 (float32) or 8 (bfloat16) times as many accesses for
// the same bytes.

constexpr int kWarpTile = 256;
constexpr int kLaneValues = kWarpTile / 32;  // lane l: values 8l .. 8l + 7 of the tile
constexpr int kSumBatch = 4;                 // entries whose gradients a lane loads before adding any: see UpdateKernel
static_assert(kGradChunk == 64, "a chunk's positions are two per lane");
static_assert(kLaneValues == 8, "a wide load is 8 bfloat16 or 2 x 4 float32 values");

// 8 consecutive bfloat16 or float32 values at the 16-byte aligned `src` as
// float32: one or two 16-byte loads; kFromL2: past L1 (__ldcg), for words
// another SM's warp wrote during the kernel.
template <bool kFromL2 = false>
static __device__ __forceinline__ void LoadWide8(const void* src, bool bf16, float (&out)[kLaneValues]) {
  if (bf16) {
    const uint4 w = kFromL2 ? __ldcg(static_cast<const uint4*>(src)) : *static_cast<const uint4*>(src);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = BitsToFloat(words[k] << 16);
      out[2 * k + 1] = BitsToFloat(words[k] & 0xFFFF0000u);
    }
  } else {
    const float4* words = static_cast<const float4*>(src);
    const float4 a = kFromL2 ? __ldcg(words) : words[0];
    const float4 b = kFromL2 ? __ldcg(words + 1) : words[1];
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

// -- runs longer than a chunk: their full chunks summed side by side -------------
//
// A run of more than kGradChunk entries has its full chunks (kGradChunk
// entries each, counted from the run's start) summed by as many warps at
// once, a warp per chunk; the last of them to finish adds the run's chunk
// sums in order (FoldChunks), then updates the row as a short run's warp
// does, adding the sum of the run's last, partial chunk. A hot row of a Zipf
// batch (10**5 of 2**20 entries) is spread over the GPU that way, where a
// warp per run would take the whole run alone. All of it runs in the update
// kernel, beside the short runs' rows: as kernels of their own (the chunk
// sums, then a fold, then the rows) the chunk sums of a Zipf batch of 2**14
// ids held back every row's loads for 0.035 ms (H100; benchmarks/README.md,
// "Where a call of 2^14 ids spends its time").
//
// A full chunk starting at sorted entry s writes its sums to slot
// s / kGradChunk of the workspace's chunk sums (dim floats a slot): two full
// chunks are at least kGradChunk entries apart, so no two share a slot, a
// window of kGradChunk entries [w * kGradChunk, (w + 1) * kGradChunk) holds
// the start of at most one, whose slot is w, and a run's full chunks have
// consecutive slots from its first entry's. The fold of a run's chunk sums
// replaces its first slot's. Slots that no full chunk starts in are never
// written nor read.
//
// Which warp is last: each adds to its run's arrival count (at the slot of
// the run's first entry) once its sums are stored, the run's first chunk's
// warp kArrivalsDone - full_chunks + 1, the others 1, so the count reaches
// kArrivalsDone with the last arrival and never before, in whatever order
// they come (a run of one full chunk has one warp, which counts nothing). A
// fence before the add publishes the warp's sums; the last one fences again
// and reads the others' sums from L2 (__ldcg): a warp of its SM may have
// brought a line of them into L1 before they were written.

// The update's workspace after the sort's (UpdateWorkspaceBytes).
struct ChunkWork {
  float* sums = nullptr;         // [num_ids / kGradChunk][dim]: a slot per window
  uint32_t* arrivals = nullptr;  // [num_ids / kGradChunk]: a count per run's first slot; zero before the kernel
};

constexpr uint32_t kArrivalsDone = 1u << 31;  // more than any run's full chunks (num_ids < 2**31)

// Window w's full chunk, if one starts in it: the warp finds the run of each
// of the window's entries (the one holding its first entry by RunStart, the
// others from the window's keys), sums the chunk into slot w and counts its
// arrival. The run's sorted entries [first, last) for the warp whose chunk
// was the run's last summed, else none; all lanes get the same answer.
struct RunSpan {
  int64_t first = -1, last = -1;  // first -1: none
};

static __device__ __forceinline__ RunSpan SumWindowChunk(const UpdateParams& p, const uint32_t* keys,
                                                         const int32_t* positions, const ChunkWork& work, int64_t w,
                                                         bool wide, int lane) {
  const TrainableView& t = p.t;
  const int64_t n = p.num_ids;
  const int64_t base = w * kGradChunk;
  // Lane l holds the keys of entries base + l and base + 32 + l (both < n).
  const uint32_t low = keys[base + lane];
  const uint32_t high = keys[base + 32 + lane];
  const uint32_t before = base > 0 ? keys[base - 1] : ~low;  // differs from entry 0's key
  const uint32_t low_up = __shfl_up_sync(0xFFFFFFFFu, low, 1);
  const uint32_t high_up = __shfl_up_sync(0xFFFFFFFFu, high, 1);
  const uint32_t low_last = __shfl_sync(0xFFFFFFFFu, low, 31);
  const uint64_t starts =
      static_cast<uint64_t>(__ballot_sync(0xFFFFFFFFu, low != (lane == 0 ? before : low_up))) |
      (static_cast<uint64_t>(__ballot_sync(0xFFFFFFFFu, high != (lane == 0 ? low_last : high_up))) << 32);
  // The window's first run may have started in an earlier window (the branch is the warp's).
  const uint32_t base_key = __shfl_sync(0xFFFFFFFFu, low, 0);
  const int64_t base_first = (starts & 1u) ? base : RunStart(keys, base, base_key, lane);
  int64_t chunk = -1;      // the window's full chunk's first entry
  int64_t chunk_run = -1;  // the first entry of that chunk's run
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j = 32 * half + lane;
    const int64_t i = base + j;
    const uint32_t key = half == 0 ? low : high;
    const uint64_t upto = j == 63 ? ~uint64_t{0} : (uint64_t{2} << j) - 1;  // entries base .. i
    const uint64_t run_starts = starts & upto;
    const int64_t first = run_starts != 0 ? base + 63 - __clzll(static_cast<long long>(run_starts)) : base_first;
    bool full = key < static_cast<uint64_t>(t.num_rows) && (i - first) % kGradChunk == 0 && i + kGradChunk <= n &&
                keys[i + kGradChunk - 1] == key;
    // A run of one chunk is its row warp's to sum: the chunk at a run's start counts only if another follows.
    if (full && i == first) full = i + kGradChunk < n && keys[i + kGradChunk] == key;
    const unsigned found = __ballot_sync(0xFFFFFFFFu, full);
    if (found != 0) {
      const int at = __ffs(found) - 1;
      chunk = base + 32 * half + at;
      chunk_run = __shfl_sync(0xFFFFFFFFu, first, at);
    }
  }
  if (chunk < 0) return RunSpan{};
  uint8_t* slot = reinterpret_cast<uint8_t*>(work.sums + w * t.dim);
  for (int64_t tile = 0; tile < t.dim; tile += kWarpTile) {
    const int64_t end = min(tile + static_cast<int64_t>(kWarpTile), t.dim);
    const int64_t col = tile + kLaneValues * lane;
    float sums[kLaneValues];
    ChunkSums<kSumBatch>(p, positions, chunk, chunk + kGradChunk, col, end, wide, lane, sums);
    StoreValues8(slot, RowFormat::kF32, col, end, wide, sums);
  }
  // The run's end is sought by its first chunk's warp (its arrival counts the
  // run's full chunks) and by its last (the row's update needs it), no other.
  const bool run_head = chunk == chunk_run;  // the warp's, as chunk is
  int64_t end = run_head ? RunEnd(keys, chunk, n, keys[chunk], lane) : -1;
  const int64_t full_chunks = run_head ? (end - chunk_run) / kGradChunk : 0;
  if (full_chunks == 1) return RunSpan{chunk_run, end};  // the run's one chunk: no other warp to wait for
  const uint32_t arrival = run_head ? kArrivalsDone + 1 - static_cast<uint32_t>(full_chunks) : uint32_t{1};
  // As a grid barrier orders its CTAs' writes: the lanes meet, then one fences
  // and arrives for all; the last warp's lane 0 fences again before the lanes
  // read the other warps' sums.
  __syncwarp();
  uint32_t arrived = 0;
  if (lane == 0) {
    __threadfence();  // this warp's sums before its arrival
    arrived = atomicAdd(work.arrivals + chunk_run / kGradChunk, arrival);
  }
  arrived = __shfl_sync(0xFFFFFFFFu, arrived, 0);
  if (arrived + arrival != kArrivalsDone) return RunSpan{};
  if (lane == 0) __threadfence();  // the other warps' sums after their arrivals
  __syncwarp();
  if (!run_head) end = RunEnd(keys, chunk, n, keys[chunk], lane);
  return RunSpan{chunk_run, end};
}

// The run's chunk sums (`full_chunks` slots from its first entry's) added in
// order from +0.0 into its first slot, kFoldBatch slots loaded before their
// additions; lane l takes values 8l .. 8l + 7 of each tile, as RunTotal
// reads them back.
constexpr int kFoldBatch = 4;

static __device__ __forceinline__ void FoldChunks(float* sums, int64_t dim, int64_t run_first, int64_t full_chunks,
                                                  bool wide, int lane) {
  float* first_slot = sums + (run_first / kGradChunk) * dim;
  for (int64_t tile = 0; tile < dim; tile += kWarpTile) {
    const int64_t end = min(tile + static_cast<int64_t>(kWarpTile), dim);
    const int64_t col = tile + kLaneValues * lane;
    float total[kLaneValues] = {};
    for (int64_t c0 = 0; c0 < full_chunks; c0 += kFoldBatch) {
      float batch[kFoldBatch][kLaneValues];
#pragma unroll
      for (int b = 0; b < kFoldBatch; ++b) {
        const float* src = first_slot + (c0 + b) * dim + col;
        if (c0 + b >= full_chunks || col >= end) continue;
        if (wide) {
          LoadWide8<true>(src, false, batch[b]);
        } else {
#pragma unroll
          for (int k = 0; k < kLaneValues; ++k) batch[b][k] = col + k < end ? __ldcg(src + k) : 0.0f;
        }
      }
#pragma unroll
      for (int b = 0; b < kFoldBatch; ++b) {
        if (c0 + b >= full_chunks || col >= end) continue;
#pragma unroll
        for (int k = 0; k < kLaneValues; ++k) total[k] = FAdd(total[k], batch[b][k]);
      }
    }
    StoreValues8(reinterpret_cast<uint8_t*>(first_slot), RowFormat::kF32, col, end, wide, total);
  }
}

// Lane l's summed gradient of values [col, col + 8) over the run of sorted
// entries [first, last), in train_rows.h's chunked order: each chunk of
// kGradChunk entries summed in position order from +0.0, the chunk sums
// added in order from +0.0; 0 from `end` on. A run longer than a chunk
// starts from the sum of its full chunks (its first slot, folded by
// FoldChunks when there are two or more); its last, partial chunk, or the
// one chunk of a shorter run, is summed here. Every lane of the warp must
// call it with the same run (ChunkSums shuffles the run's positions).
static __device__ __forceinline__ void RunTotal(const UpdateParams& p, const float* chunk_sums,
                                                const int32_t* positions, int64_t first, int64_t last, int64_t col,
                                                int64_t end, bool wide, int lane, float (&total)[kLaneValues]) {
  int64_t rest = first;  // the entries left to sum here
  if (last - first > kGradChunk) {
    LoadValues8(reinterpret_cast<const uint8_t*>(chunk_sums + (first / kGradChunk) * p.t.dim), RowFormat::kF32, col,
                end, wide, total);
    rest = first + (last - first) / kGradChunk * kGradChunk;
  } else {
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) total[k] = 0.0f;
  }
  if (rest < last) {
    float sums[kLaneValues];
    ChunkSums<kSumBatch>(p, positions, rest, last, col, end, wide, lane, sums);
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) total[k] = FAdd(total[k], sums[k]);
  }
}

// -- a warp per row ---------------------------------------------------------------
//
// After the windows (SumWindowChunk), each warp takes every `warps`-th run
// of the sorted entries (ListRuns' list) and updates the run's row, so
// consecutive warps take consecutive rows, as rawupdate.cu's do. A warp per
// sorted entry, the warps whose entry did not start a run skipping ahead, took
// a Zipf batch's rows (2.9 entries a row) 1.5x a uniform batch's time a row,
// on a pinned table and on an HBM one alike (H100,
// benchmarks/results/train_32g_chunks.json). A pinned table's record is a PCIe
// round trip away (1-2 us), and a store to it may alias any later load, so
// the compiler keeps a load after an earlier store: per tile of kWarpTile
// values, each lane issues every load of its part of the record first (values and
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
// summed gradient) across the gradient sum, plus kSumBatch x 8 gradients in
// flight. With 8 the row kernel took 173 registers (nvcc 13, sm_90: one CTA of
// 8 warps per SM); with 4 and two CTAs per SM asked of ptxas it took 127 and
// spilled nothing: 16 warps per SM, each with a row's loads in flight, far
// more bytes than PCIe's bandwidth-delay product (~100 KB). With the windows'
// chunk sums and folds in the same kernel it takes 128 and spills 72 bytes a
// thread (nvcc 13.0); a fold of 8 slots at a time spilled 1.6 KB, one loop
// over windows and runs together 136 bytes.
constexpr int kUpdateCtasPerSm = 2;

// The row of the run of sorted entries [first, last) updated by the whole
// warp; nothing for the run of ids the table does not hold (sorted last).
static __device__ __forceinline__ void UpdateRun(const UpdateParams& p, const uint32_t* keys, const int32_t* positions,
                                                 const float* chunk_sums, int64_t first, int64_t last, float lr,
                                                 bool wide, float* transpose, int lane) {
  const TrainableView& t = p.t;
  const bool one_tile = t.dim <= kWarpTile;
  const int64_t moment_bytes = t.dim * ValueBytes(t.moment_format);
  const uint32_t key = keys[first];
  if (key >= static_cast<uint64_t>(t.num_rows)) return;
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
      RunTotal(p, chunk_sums, positions, first, last, tile + kLaneValues * lane, end, wide, lane, g);
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
        RunTotal(p, chunk_sums, positions, first, last, col, end, wide, lane, g);
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
      RunTotal(p, chunk_sums, positions, first, last, col, end, wide, lane, g);
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

// Warp w takes items w, w + warps, ...: first the windows of kGradChunk sorted
// entries (SumWindowChunk; the warp that sums a run's last chunk goes on to
// fold the run's chunk sums and update its row), then the runs of ListRuns'
// list, each a row update when it is no longer than a chunk (a longer one is
// its last chunk's warp's). Windows come first so that a hot row's chunks,
// and then its update, start with the kernel, not after the short rows.
static __global__ void __launch_bounds__(kTrainThreads, kUpdateCtasPerSm)
    UpdateKernel(UpdateParams p, const uint32_t* keys, const int32_t* positions, const int32_t* run_starts,
                 const int32_t* run_count, ChunkWork work) {
  extern __shared__ float transposes[];  // row-wise Adagrad: [kTrainWarps][kWarpTile]
  const TrainableView& t = p.t;
  const int lane = threadIdx.x & 31;
  const int64_t n = p.num_ids;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kTrainWarps;
  const float lr = *p.lr;
  // Record stride and state offset are multiples of 16 by layout, lazy Adam's
  // second moment starts dim * 2 or 4 bytes (a multiple of 16) after the first,
  // a chunk sum's slot dim * 4 bytes (a multiple of 32) after the one before.
  const bool wide = t.dim % 8 == 0 && reinterpret_cast<uintptr_t>(t.table) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.grads) % 16 == 0;
  float* transpose = transposes + (threadIdx.x / 32) * kWarpTile;
  const int64_t windows = n / kGradChunk;  // a full chunk starting in a later window would end past n
  const int64_t runs = *run_count;
  int64_t item = blockIdx.x * static_cast<int64_t>(kTrainWarps) + threadIdx.x / 32;
  for (; item < windows; item += warps) {
    const RunSpan span = SumWindowChunk(p, keys, positions, work, item, wide, lane);
    if (span.first < 0) continue;
    const int64_t first = span.first, last = span.last;
    const int64_t full_chunks = (last - first) / kGradChunk;
    if (full_chunks >= 2) FoldChunks(work.sums, t.dim, first, full_chunks, wide, lane);
    UpdateRun(p, keys, positions, work.sums, first, last, lr, wide, transpose, lane);
  }
  for (int64_t r = item - windows; r < runs; r += warps) {
    const int64_t first = run_starts[r];
    const int64_t last = r + 1 < runs ? run_starts[r + 1] : n;
    if (last - first > kGradChunk) continue;  // its last chunk's warp updates it
    UpdateRun(p, keys, positions, work.sums, first, last, lr, wide, transpose, lane);
  }
}

// The whole update on `stream`: the sort (whose first kernel also zeroes the
// arrival counts and `token`, the caller's words to zero once launched), the
// run list, then UpdateKernel on at most `max_ctas` CTAs (<= 0: as many as the
// batch fills; a background update leaves the model its SMs). The sort runs
// on its own grid (dedup.cuh's SortIdsByRow: the library's chunks or CUB's
// sort, by batch size). p.workspace holds UpdateWorkspaceBytes(num_ids, dim)
// bytes: the sort's, then the chunk sums and their arrival counts. Never
// synchronises; with no ids it launches nothing, `token` included.
static inline cudaError_t LaunchUpdate(const UpdateParams& p, cudaStream_t stream, int max_ctas = 0,
                                       ZeroWords token = {}) {
  const int64_t n = p.num_ids;
  if (n == 0) return cudaSuccess;
  if (p.workspace == nullptr || p.workspace_bytes < UpdateWorkspaceBytes(n, p.t.dim)) return cudaErrorInvalidValue;
  const int64_t sort_bytes = LookupWorkspaceBytes(n, VisitOrder::kSorted);
  DedupGatherParams sort;
  sort.gather.ids = p.ids;
  sort.gather.num_ids = n;
  sort.gather.row_start = p.t.row_start;
  sort.gather.num_rows = p.t.num_rows;
  sort.gather.dim = p.t.dim;
  sort.order = VisitOrder::kSorted;
  sort.workspace = p.workspace;
  sort.workspace_bytes = sort_bytes;  // the sort's temporary storage ends where the chunk sums start
  ChunkWork work;
  work.sums = reinterpret_cast<float*>(p.workspace + sort_bytes);
  work.arrivals = reinterpret_cast<uint32_t*>(p.workspace + sort_bytes + ChunkSumsBytes(n, p.t.dim));
  const uint32_t* keys = nullptr;
  const int32_t* positions = nullptr;
  const int32_t* run_starts = nullptr;
  const int32_t* run_count = nullptr;
  // Both sorts are stable and the positions start ascending, so equal rows
  // keep position order: the sums are the CPU's, bit for bit.
  const int64_t windows = n / kGradChunk;
  cudaError_t err = SortIdsByRow(sort, stream, &keys, &positions, ZeroWords{work.arrivals, windows}, token);
  if (err != cudaSuccess) return err;
  err = ListRuns(sort, keys, stream, &run_starts, &run_count);
  if (err != cudaSuccess) return err;
  const bool row_wise = p.t.optimizer == RowOptimizerKind::kRowAdagrad;
  const size_t transpose_bytes = row_wise ? sizeof(float) * kTrainWarps * kWarpTile : 0;
  int ctas = TrainGrid(n + windows);
  if (max_ctas > 0 && ctas > max_ctas) ctas = max_ctas;
  UpdateKernel<<<ctas, kTrainThreads, transpose_bytes, stream>>>(p, keys, positions, run_starts, run_count, work);
  return cudaGetLastError();
}

}  // namespace engram
