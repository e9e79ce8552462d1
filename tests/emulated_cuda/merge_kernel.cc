// merge_chunks.cuh's MergeChunksKernel run on the host through cuda_host.h:
// chunks of 2048 (key, position) pairs, each stably sorted as SortChunksKernel
// leaves them, merged, against std::stable_sort of the whole batch: one to
// sixteen chunks, a partial last one, keys all distinct, all equal, few, or
// placed so that a search takes all its steps.
// Built and run by tests/test_update_kernels_emulated.py; prints a summary line.
#include <algorithm>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "cuda_host.h"
#include "kernels/merge_chunks.cuh"

using namespace engram;

int main() {
  int cases = 0, failures = 0;
  std::mt19937_64 rng(5);
  for (const int64_t n : {int64_t{2}, int64_t{2048}, int64_t{2049}, int64_t{4096}, int64_t{5000}, kSmallSortMaxIds - 1,
                          kSmallSortMaxIds}) {
    // distinct 0: each chunk's first key is 0 and the rest 1 or 2 by chunk, so a search
    // for 1 in an even chunk halves down to its first entry and must take it (12 steps).
    for (const uint32_t distinct : {0u, 1u, 3u, 700u, 1u << 26}) {
      std::vector<std::pair<uint32_t, int32_t>> entries(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t edge = i % kSortChunk == 0 ? 0u : 1u + static_cast<uint32_t>(i / kSortChunk + 1) % 2u;
        entries[i] = {distinct == 0 ? edge : static_cast<uint32_t>(rng() % distinct), static_cast<int32_t>(i)};
      }
      const auto by_key = [](const auto& a, const auto& b) { return a.first < b.first; };
      std::vector<std::pair<uint32_t, int32_t>> expected = entries;
      std::stable_sort(expected.begin(), expected.end(), by_key);
      for (int64_t c = 0; c < n; c += kSortChunk) {
        std::stable_sort(entries.begin() + c, entries.begin() + std::min(n, c + kSortChunk), by_key);
      }
      std::vector<uint32_t> chunk_keys(static_cast<size_t>(n)), keys(static_cast<size_t>(n), 0xFFFFFFFFu);
      std::vector<int32_t> chunk_positions(static_cast<size_t>(n)), positions(static_cast<size_t>(n), -1);
      for (int64_t i = 0; i < n; ++i) chunk_keys[i] = entries[i].first, chunk_positions[i] = entries[i].second;
      HostLaunch(
          static_cast<int>((n + kMergeThreads - 1) / kMergeThreads),
          [&] { MergeChunksKernel(chunk_keys.data(), chunk_positions.data(), n, keys.data(), positions.data()); },
          kMergeThreads);
      ++cases;
      for (int64_t i = 0; i < n; ++i) {
        if (keys[i] != expected[i].first || positions[i] != expected[i].second) {
          std::printf("differs: ids %lld distinct %u entry %lld: (%u, %d) for (%u, %d)\n", static_cast<long long>(n),
                      distinct, static_cast<long long>(i), keys[i], positions[i], expected[i].first,
                      expected[i].second);
          ++failures;
          break;
        }
      }
    }
  }
  std::printf("cases %d failures %d\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
