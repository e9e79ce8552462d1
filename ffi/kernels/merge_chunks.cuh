// The small-batch sort's second kernel (its first, SortChunksKernel, is in
// dedup.cuh): chunks of kSortChunk (key, position) pairs, each sorted stably,
// merged into one stable order by each entry's rank. No CUB, no XLA: the
// emulated-kernel tests run it on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace engram {

// -- small batches: chunks sorted in shared memory, then merged by rank ---------
//
// CUB's device sort costs a batch of 2^14 ids a histogram, four passes over
// 26-bit keys and six memsets: 0.05 ms and ten gaps between operations in a
// small update's profile (H200). Up to kSmallSortMaxIds ids, one CTA per
// chunk of kSortChunk ids sorts it in shared memory (cub::BlockRadixSort),
// then a thread per entry finds its rank among the other chunks by binary
// search and stores it there: two kernels, no memset (dedup.cuh's
// SortIdsByRow says where each sort runs). Both sorts are stable over the
// same keys, so their outputs are the same bits.
constexpr int kChunkSortThreads = 256;
constexpr int kChunkSortItems = 8;
constexpr int kLog2SortChunk = 11;
constexpr int64_t kSortChunk = int64_t{1} << kLog2SortChunk;
static_assert(kSortChunk == kChunkSortThreads * kChunkSortItems, "a chunk is one CTA's items");
constexpr int kMaxSortChunks = 16;
constexpr int64_t kSmallSortMaxIds = kSortChunk * kMaxSortChunks;
constexpr int kMergeThreads = 256;

// Entry e of the sorted chunks goes to its rank in the whole batch: its index
// in its chunk, plus, for every other chunk, how many of its entries come
// before it: those with a smaller key, and in an earlier chunk (earlier
// positions) those with an equal key too. The chunks' binary searches run in
// lockstep, so each thread has up to kMaxSortChunks loads in flight.
static __global__ void __launch_bounds__(kMergeThreads)
    MergeChunksKernel(const uint32_t* chunk_keys, const int32_t* chunk_positions, int64_t n, uint32_t* keys,
                      int32_t* positions) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(kMergeThreads) + threadIdx.x;
  if (e >= n) return;
  const int chunk = static_cast<int>(e >> kLog2SortChunk);
  const int chunks = static_cast<int>((n + kSortChunk - 1) >> kLog2SortChunk);
  const uint32_t key = chunk_keys[e];
  int lo[kMaxSortChunks], hi[kMaxSortChunks];
#pragma unroll
  for (int c = 0; c < kMaxSortChunks; ++c) {
    lo[c] = 0;
    const int64_t size = n - c * kSortChunk;
    hi[c] = (c < chunks && c != chunk) ? static_cast<int>(size < kSortChunk ? size : kSortChunk) : 0;
  }
#pragma unroll 1
  for (int step = 0; step <= kLog2SortChunk; ++step) {  // 2048 entries: 12 halvings leave none
#pragma unroll
    for (int c = 0; c < kMaxSortChunks; ++c) {
      if (lo[c] < hi[c]) {
        const int mid = (lo[c] + hi[c]) >> 1;
        const uint32_t probe = __ldg(chunk_keys + c * kSortChunk + mid);
        if (probe < key || (c < chunk && probe == key)) {
          lo[c] = mid + 1;
        } else {
          hi[c] = mid;
        }
      }
    }
  }
  int64_t rank = e - chunk * kSortChunk;
#pragma unroll
  for (int c = 0; c < kMaxSortChunks; ++c) rank += lo[c];
  keys[rank] = key;
  positions[rank] = chunk_positions[e];
}

}  // namespace engram
