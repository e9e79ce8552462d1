// CUDA lookup with the row-rate levers: ids sorted by table row, each distinct
// row of a tile fetched once (dedup), hits read from the HBM hot-row cache, rows
// scattered back to their positions (decoded, or as packed records). Tiles,
// loads and decode are the plain gather's (gather.cuh), so the bits are the
// same. No XLA types.
#pragma once

#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>

#include <cstdint>
#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

#include "kernels/cache_index.h"
#include "kernels/dedup_params.h"
#include "kernels/gather.cuh"
#include "kernels/merge_chunks.cuh"

namespace engram {

// Per-row bookkeeping after the tile's records in shared memory.
struct TileSlots {
  const uint4* src;  // where the row's record is read from; low bit set: HBM (cache), null: zeros
  int64_t key;       // table-local row, num_rows when the table does not hold the id
  int32_t pos;       // output row
  int32_t lead;      // tile row whose record this row decodes (itself unless a duplicate)
};

// Words the sort's first kernel zeroes on its way (an update's arrival counts
// and its token): a separate memset costs a small update call its own launch
// and the gap after it.
struct ZeroWords {
  uint32_t* words = nullptr;
  int64_t count = 0;
};

// Both ranges zeroed by the whole grid, each thread a word at a time.
static __device__ __forceinline__ void ZeroOnTheWay(ZeroWords zero_a, ZeroWords zero_b) {
  const int64_t start = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = start; i < zero_a.count; i += stride) zero_a.words[i] = 0;
  for (int64_t i = start; i < zero_b.count; i += stride) zero_b.words[i] = 0;
}

// An id's sort key: its table-local row, or num_rows for every id the table
// does not hold, so those sort last and are never read. Both sorts take it
// from here, so their outputs stay the same bits.
static __device__ __forceinline__ uint32_t SortKey(int32_t id, int64_t row_start, int64_t num_rows) {
  const int64_t local = static_cast<int64_t>(id) - row_start;
  return static_cast<uint32_t>((local >= 0 && local < num_rows) ? local : num_rows);
}

// static: this header may be included by more than one translation unit.
static __global__ void MakeSortKeysKernel(const int32_t* ids, int64_t n, int64_t row_start, int64_t num_rows,
                                          uint32_t* keys, int32_t* positions, ZeroWords zero_a, ZeroWords zero_b) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[i] = SortKey(ids[i], row_start, num_rows);
    positions[i] = static_cast<int32_t>(i);
  }
  ZeroOnTheWay(zero_a, zero_b);
}

// A sorted tile's rows: a row's info is its TileSlots; row r decodes its
// lead's record into its own position.
struct SlotTileRows {
  using RowInfo = TileSlots;
  const TileSlots* slots;
  __device__ __forceinline__ SlotTileRows(const RowInfo* tile_slots, int64_t /*first*/) : slots(tile_slots) {}
  __device__ __forceinline__ int64_t Record(int r) const { return slots[r].lead; }
  __device__ __forceinline__ int64_t Out(int r) const { return slots[r].pos; }
};

struct DedupKernelArgs {
  GatherParams g;
  CacheView cache;
  const uint32_t* keys;      // sorted keys (kSorted), else unused: keys come from g.ids
  const int32_t* positions;  // output row of each sorted entry (kSorted)
};

// kSorted: entries come as sorted (key, position) pairs; kDedup: a row equal
// to an earlier row of the same tile decodes that row's record instead of
// loading its own (equal keys are adjacent once sorted, so a run split by a
// tile boundary is loaded once per tile); kCache: probe the cache first.
// tile_rows <= TileRows(stride), chosen as the plain gather chooses it.
// Output: DecodeRows or CopyRecords (gather.cuh).
template <bool kSorted, bool kDedup, bool kCache, typename Output>
static __global__ void __launch_bounds__(kGatherThreads) DedupGatherKernel(DedupKernelArgs a, int tile_rows) {
  const GatherParams& p = a.g;
  const TileShape shape = TileShapeOf(p.dim);
  const uint4* table = reinterpret_cast<const uint4*>(p.table);
  GatherTiles<SlotTileRows, Output>(
      p, shape, tile_rows,
      [&](TileSlots* slots, int64_t first, int rows) {
        for (int r = threadIdx.x; r < rows; r += blockDim.x) {
          if constexpr (kSorted) {
            slots[r].key = a.keys[first + r];
            slots[r].pos = a.positions[first + r];
          } else {
            const int64_t local = static_cast<int64_t>(p.ids[first + r]) - p.row_start;
            slots[r].key = (local >= 0 && local < p.num_rows) ? local : p.num_rows;
            slots[r].pos = static_cast<int32_t>(first + r);
          }
        }
        __syncthreads();

        for (int r = threadIdx.x; r < rows; r += blockDim.x) {
          const int64_t key = slots[r].key;
          int lead = r;
          if constexpr (kDedup) {  // first tile row with this key: the tile's keys ascend
            int lo = 0, hi = r;
            while (lo < hi) {
              const int mid = (lo + hi) >> 1;
              if (slots[mid].key < key) {
                lo = mid + 1;
              } else {
                hi = mid;
              }
            }
            lead = lo;
          }
          slots[r].lead = lead;
          const uint4* src = nullptr;
          if (lead == r && key < p.num_rows) {
            src = table + key * shape.lanes;
            if constexpr (kCache) {
              const int64_t slot = CacheSlot(a.cache, key);
              if (slot >= 0) {
                src = reinterpret_cast<const uint4*>(a.cache.records + slot * shape.stride);
                src = reinterpret_cast<const uint4*>(reinterpret_cast<uintptr_t>(src) | 1u);
              }
            }
          }
          slots[r].src = src;
        }
        __syncthreads();
      },
      [&](const TileSlots* slots, int j, uint4& v) {
        const int r = j / shape.lanes;
        const uintptr_t src = reinterpret_cast<uintptr_t>(slots[r].src);
        if (src & 1u) {
          v = __ldg(reinterpret_cast<const uint4*>(src & ~uintptr_t{1}) + (j - r * shape.lanes));
        } else if (src) {
          v = __ldcs(reinterpret_cast<const uint4*>(src) + (j - r * shape.lanes));
        }
      });
}

// Same grid and tile policy as LaunchGather (PlanGatherGrid): the full grid
// by default, tiles shrunk until a small batch gives every CTA a tile.
template <bool kSorted, bool kDedup, bool kCache, typename Output>
static inline cudaError_t LaunchDedupKernel(const DedupKernelArgs& a, int max_ctas, cudaStream_t stream) {
  const auto kernel = DedupGatherKernel<kSorted, kDedup, kCache, Output>;
  int full = 0;
  if (max_ctas <= 0) {
    static FullGridCache grid_cache;  // one per kernel variant
    const cudaError_t err =
        grid_cache.Get(kernel, a.g.dim, TileSharedBytes<SlotTileRows>(a.g.dim, TileRows(RowStride(a.g.dim))), &full);
    if (err != cudaSuccess) return err;
  }
  const GatherGrid grid = PlanGatherGrid(a.g.num_ids, a.g.dim, max_ctas, full);
  kernel<<<grid.ctas, kGatherThreads, TileSharedBytes<SlotTileRows>(a.g.dim, grid.tile_rows), stream>>>(a,
                                                                                                        grid.tile_rows);
  return cudaGetLastError();
}

// -- small batches: chunks sorted in shared memory (merge_chunks.cuh) ------------

// Chunk blockIdx.x of the ids as (key, position) pairs sorted by key, stably
// (equal keys keep position order), into keys/positions at the chunk's offset.
static __global__ void __launch_bounds__(kChunkSortThreads)
    SortChunksKernel(const int32_t* ids, int64_t n, int64_t row_start, int64_t num_rows, int end_bit, uint32_t* keys,
                     int32_t* positions, ZeroWords zero_a, ZeroWords zero_b) {
  using BlockSort = cub::BlockRadixSort<uint32_t, kChunkSortThreads, kChunkSortItems, int32_t>;
  __shared__ typename BlockSort::TempStorage temp;
  const int64_t base = blockIdx.x * kSortChunk;
  // Past the batch's end: the largest key of end_bit bits, which a stable sort
  // keeps after any real key equal to it (these come last in the chunk).
  const uint32_t padding = end_bit >= 32 ? 0xFFFFFFFFu : (1u << end_bit) - 1u;
  uint32_t thread_keys[kChunkSortItems];
  int32_t thread_positions[kChunkSortItems];
#pragma unroll
  for (int j = 0; j < kChunkSortItems; ++j) {  // blocked: thread t holds entries 8t .. 8t + 7, in position order
    const int64_t i = base + threadIdx.x * kChunkSortItems + j;
    thread_keys[j] = padding;
    thread_positions[j] = static_cast<int32_t>(i);
    if (i < n) thread_keys[j] = SortKey(ids[i], row_start, num_rows);
  }
  BlockSort(temp).SortBlockedToStriped(thread_keys, thread_positions, 0, end_bit);
#pragma unroll
  for (int j = 0; j < kChunkSortItems; ++j) {  // striped: sorted entry j * threads + t, coalesced stores
    const int64_t i = base + j * kChunkSortThreads + threadIdx.x;
    if (i < n) {
      keys[i] = thread_keys[j];
      positions[i] = thread_positions[j];
    }
  }
  ZeroOnTheWay(zero_a, zero_b);
}

// The sort's part of the workspace (layout: keys, keys_alt, positions,
// positions_alt, then CUB's temporary storage): false when it is too small.
struct SortBuffers {
  uint32_t* keys[2];
  int32_t* positions[2];
  void* temp;
  size_t temp_bytes;
};

static inline bool SplitSortWorkspace(const DedupGatherParams& p, SortBuffers* b) {
  const int64_t array = AlignWorkspace(p.gather.num_ids * 4);
  if (p.workspace == nullptr || p.workspace_bytes < 4 * array) return false;
  uint8_t* w = p.workspace;
  b->keys[0] = reinterpret_cast<uint32_t*>(w);
  b->keys[1] = reinterpret_cast<uint32_t*>(w + array);
  b->positions[0] = reinterpret_cast<int32_t*>(w + 2 * array);
  b->positions[1] = reinterpret_cast<int32_t*>(w + 3 * array);
  b->temp = w + 4 * array;
  b->temp_bytes = static_cast<size_t>(p.workspace_bytes - 4 * array);
  return true;
}

// Up to kSmallSortMaxIds ids sorted by SortChunksKernel and MergeChunksKernel
// into b.keys[0] and b.positions[0].
static inline cudaError_t SortIdsByChunks(const DedupGatherParams& p, const SortBuffers& b, cudaStream_t stream,
                                          ZeroWords zero_a, ZeroWords zero_b) {
  const int64_t n = p.gather.num_ids;
  if (n <= 0 || n > kSmallSortMaxIds) return cudaErrorInvalidValue;  // no grid of no chunks
  const int chunks = static_cast<int>((n + kSortChunk - 1) / kSortChunk);
  const int which = chunks == 1 ? 0 : 1;  // one chunk is the whole batch: no merge
  SortChunksKernel<<<chunks, kChunkSortThreads, 0, stream>>>(p.gather.ids, n, p.gather.row_start, p.gather.num_rows,
                                                             SortKeyBits(p.gather.num_rows), b.keys[which],
                                                             b.positions[which], zero_a, zero_b);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || chunks == 1) return err;
  const int blocks = static_cast<int>((n + kMergeThreads - 1) / kMergeThreads);
  MergeChunksKernel<<<blocks, kMergeThreads, 0, stream>>>(b.keys[1], b.positions[1], n, b.keys[0], b.positions[0]);
  return cudaGetLastError();
}

// Any number of ids sorted by CUB's radix sort; `*which` tells which of b's
// arrays hold the result.
static inline cudaError_t SortIdsByRadix(const DedupGatherParams& p, const SortBuffers& b, cudaStream_t stream,
                                         ZeroWords zero_a, ZeroWords zero_b, int* which) {
  const int64_t n = p.gather.num_ids;
  const int blocks = static_cast<int>(n / 256 + 1 < 1024 ? n / 256 + 1 : 1024);
  MakeSortKeysKernel<<<blocks, 256, 0, stream>>>(p.gather.ids, n, p.gather.row_start, p.gather.num_rows, b.keys[0],
                                                 b.positions[0], zero_a, zero_b);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  cub::DoubleBuffer<uint32_t> d_keys(b.keys[0], b.keys[1]);
  cub::DoubleBuffer<int32_t> d_positions(b.positions[0], b.positions[1]);
  const int end_bit = SortKeyBits(p.gather.num_rows);
  size_t temp_bytes = 0;
  err = cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, d_keys, d_positions, static_cast<int>(n), 0, end_bit,
                                        stream);
  if (err != cudaSuccess) return err;
  if (temp_bytes > b.temp_bytes) return cudaErrorMemoryAllocation;
  err =
      cub::DeviceRadixSort::SortPairs(b.temp, temp_bytes, d_keys, d_positions, static_cast<int>(n), 0, end_bit, stream);
  *which = d_keys.selector;
  return err;
}

// CUB's sort of one tile (one kernel; 256 threads x 19 keys by CUB 3.0's
// tuning for sm_80 and later): faster than two or three chunks and their merge.
constexpr int64_t kRadixOneTileIds = 256 * 19;

// Ids turned into table-local sort keys and sorted with their positions
// (visiting rows in table order lets neighbouring rows share address
// translations), inside the workspace (SortBuffers): by chunks where they
// beat CUB's sort, else by CUB. Measured on an H100, microseconds a call
// (benchmarks/sort.py): one chunk 8.4 against CUB's 12.7 (2048 ids), CUB's
// one tile 14.1 against 20.6 (4096), chunks 23-38 against CUB's passes 58-62
// (8192 to 32768). On success `*keys` and `*positions` point at the sorted
// arrays, and the words of `zero_a` and `zero_b` (outside the workspace) are
// zero.
static inline cudaError_t SortIdsByRow(const DedupGatherParams& p, cudaStream_t stream, const uint32_t** keys,
                                       const int32_t** positions, ZeroWords zero_a = {}, ZeroWords zero_b = {}) {
  SortBuffers b;
  if (!SplitSortWorkspace(p, &b)) return cudaErrorInvalidValue;
  const int64_t n = p.gather.num_ids;
  const bool by_chunks = n <= kSortChunk || (n > kRadixOneTileIds && n <= kSmallSortMaxIds);
  int which = 0;
  const cudaError_t err =
      by_chunks ? SortIdsByChunks(p, b, stream, zero_a, zero_b) : SortIdsByRadix(p, b, stream, zero_a, zero_b, &which);
  if (err != cudaSuccess) return err;
  *keys = b.keys[which];
  *positions = b.positions[which];
  return cudaSuccess;
}

// Whether sorted entry e starts a run of equal keys (CUB's selection predicate).
struct StartsRun {
  const uint32_t* keys;
  __device__ bool operator()(int32_t e) const { return e == 0 || keys[e] != keys[e - 1]; }
};

// After SortIdsByRow, the first entry of every run of equal sorted keys, in
// order (`*runs` of them, a count only the device knows), written where the
// sort no longer needs its workspace: the keys' other buffer (room for one
// start per id) and, at the head of CUB's temporary storage, the count, then
// the selection's own temporary storage.
static inline cudaError_t ListRuns(const DedupGatherParams& p, const uint32_t* keys, cudaStream_t stream,
                                   const int32_t** starts, const int32_t** runs) {
  const int64_t n = p.gather.num_ids;
  const int64_t array = AlignWorkspace(n * 4);
  if (p.workspace == nullptr || p.workspace_bytes < 4 * array + kWorkspaceAlign) return cudaErrorInvalidValue;
  uint8_t* w = p.workspace;
  int32_t* out = reinterpret_cast<int32_t*>(reinterpret_cast<const uint8_t*>(keys) == w ? w + array : w);
  int32_t* count = reinterpret_cast<int32_t*>(w + 4 * array);
  void* temp = w + 4 * array + kWorkspaceAlign;
  const size_t temp_available = static_cast<size_t>(p.workspace_bytes - 4 * array - kWorkspaceAlign);
  const thrust::counting_iterator<int32_t> entries(0);
  size_t temp_bytes = 0;
  cudaError_t err = cub::DeviceSelect::If(nullptr, temp_bytes, entries, out, count, n, StartsRun{keys}, stream);
  if (err != cudaSuccess) return err;
  if (temp_bytes > temp_available) return cudaErrorMemoryAllocation;
  err = cub::DeviceSelect::If(temp, temp_bytes, entries, out, count, n, StartsRun{keys}, stream);
  if (err != cudaSuccess) return err;
  *starts = out;
  *runs = count;
  return cudaSuccess;
}

template <typename Output>
static inline cudaError_t LaunchDedupLookupAs(const DedupGatherParams& p, int max_ctas, cudaStream_t stream) {
  const bool cached = p.cache.count > 0;
  DedupKernelArgs a{p.gather, p.cache, nullptr, nullptr};
  if (p.order == VisitOrder::kPlain) {
    if (!cached) return LaunchGather(p.gather, max_ctas, stream);
    return LaunchDedupKernel<false, false, true, Output>(a, max_ctas, stream);
  }
  cudaError_t err = SortIdsByRow(p, stream, &a.keys, &a.positions);
  if (err != cudaSuccess) return err;
  const bool dedup = p.order == VisitOrder::kDedup;
  if (dedup && cached) return LaunchDedupKernel<true, true, true, Output>(a, max_ctas, stream);
  if (dedup) return LaunchDedupKernel<true, true, false, Output>(a, max_ctas, stream);
  if (cached) return LaunchDedupKernel<true, false, true, Output>(a, max_ctas, stream);
  return LaunchDedupKernel<true, false, false, Output>(a, max_ctas, stream);
}

// The whole lookup on `stream`: rows, or packed records when p.gather.records
// is set. Plain order without a cache is the plain gather itself. Launches
// nothing for an empty batch; never synchronises.
static inline cudaError_t LaunchDedupLookup(const DedupGatherParams& p, int max_ctas, cudaStream_t stream) {
  if (p.gather.num_ids == 0) return cudaSuccess;
  if (p.gather.records != nullptr) return LaunchDedupLookupAs<CopyRecords>(p, max_ctas, stream);
  return LaunchDedupLookupAs<DecodeRows>(p, max_ctas, stream);
}

}  // namespace engram
