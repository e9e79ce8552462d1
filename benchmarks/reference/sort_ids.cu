// sort_ids: the library's two ways of sorting a batch's ids by table row
// (ffi/kernels/dedup.cuh: chunks sorted in shared memory and merged by rank,
// or CUB's device radix sort), timed side by side on the same batches, with
// every call's output of the one compared bit for bit with the other's and the
// first batch's with std::stable_sort on the host.
//
// Build:  nvcc -O3 -arch=sm_90 -I ffi -o sort_ids benchmarks/reference/sort_ids.cu
// Env:    SORT_IDS_COUNTS  batch sizes, comma-separated (default 2^10 .. 2^15)
//         SORT_IDS_ROWS    table rows (default 2^26: a 32 GiB bf16 table of 256 values)
//         SORT_IDS_BATCHES fresh batches per size, each sorted once per pass (default 64)
// Prints one JSON object per line per (size, id distribution, sort): median
// microseconds per call over 7 passes, each pass the batches back to back.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dedup.cuh"

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

namespace {

std::vector<int64_t> EnvList(const char* name, std::vector<int64_t> fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  std::vector<int64_t> out;
  for (const char* s = v; *s;) {
    out.push_back(std::strtoll(s, const_cast<char**>(&s), 10));
    if (*s == ',') ++s;
  }
  return out;
}

// Zipf-like ids (a Pareto rank with exponent 1.1, scattered over the table by
// an odd multiplier) or uniform ones; one in 64 is -1, an id no table holds.
std::vector<int32_t> MakeIds(std::mt19937_64& rng, int64_t n, int64_t rows, bool zipf) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) {
    int64_t row = static_cast<int64_t>(rng() % static_cast<uint64_t>(rows));
    if (zipf) {
      const double rank = std::floor(std::pow(1.0 - unit(rng), -1.0 / 0.1)) - 1.0;
      row = static_cast<int64_t>((static_cast<uint64_t>(std::min(rank, 1e15)) * 0x9E3779B97F4A7C15ull) %
                                 static_cast<uint64_t>(rows));
    }
    id = rng() % 64 == 0 ? -1 : static_cast<int32_t>(row);
  }
  return ids;
}

}  // namespace

int main() {
  const std::vector<int64_t> counts = EnvList("SORT_IDS_COUNTS", {1024, 2048, 4096, 8192, 16384, 32768});
  const int64_t rows = EnvList("SORT_IDS_ROWS", {int64_t{1} << 26})[0];
  const int batches = static_cast<int>(EnvList("SORT_IDS_BATCHES", {64})[0]);
  const int passes = 7;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::mt19937_64 rng(7);
  for (const int64_t n : counts) {
    if (n > engram::kSmallSortMaxIds) {
      fprintf(stderr, "sort_ids: %lld ids is over the chunk sort's %lld\n", static_cast<long long>(n),
              static_cast<long long>(engram::kSmallSortMaxIds));
      return 2;
    }
    for (const bool zipf : {true, false}) {
      std::vector<std::vector<int32_t>> host_ids;
      int32_t* ids = nullptr;
      CHECK(cudaMalloc(&ids, sizeof(int32_t) * n * batches));
      for (int b = 0; b < batches; ++b) {
        host_ids.push_back(MakeIds(rng, n, rows, zipf));
        CHECK(cudaMemcpy(ids + b * n, host_ids.back().data(), sizeof(int32_t) * n, cudaMemcpyHostToDevice));
      }
      // One workspace per batch, so that the two sorts' outputs of every batch stay to be compared.
      const int64_t bytes = engram::LookupWorkspaceBytes(n, engram::VisitOrder::kSorted);
      uint8_t* workspace = nullptr;
      CHECK(cudaMalloc(&workspace, bytes * batches * 2));
      auto params = [&](int b, int sort) {
        engram::DedupGatherParams p;
        p.gather.ids = ids + b * n;
        p.gather.num_ids = n;
        p.gather.row_start = 0;
        p.gather.num_rows = rows;
        p.order = engram::VisitOrder::kSorted;
        p.workspace = workspace + (static_cast<int64_t>(sort) * batches + b) * bytes;
        p.workspace_bytes = bytes;
        return p;
      };
      // sort 0: chunks and merge; sort 1: CUB. Both sorts' arrays, per batch.
      std::vector<int> which(static_cast<size_t>(batches), 0);
      auto run = [&](int sort, int b) {
        const engram::DedupGatherParams p = params(b, sort);
        engram::SortBuffers buffers;
        if (!engram::SplitSortWorkspace(p, &buffers)) exit(3);
        if (sort == 0) {
          CHECK(engram::SortIdsByChunks(p, buffers, stream, {}, {}));
        } else {
          CHECK(engram::SortIdsByRadix(p, buffers, stream, {}, {}, &which[static_cast<size_t>(b)]));
        }
      };
      for (int sort = 0; sort < 2; ++sort) {
        std::vector<float> per_call;
        for (int pass = 0; pass <= passes; ++pass) {  // pass 0 warms up
          CHECK(cudaEventRecord(start, stream));
          for (int b = 0; b < batches; ++b) run(sort, b);
          CHECK(cudaEventRecord(stop, stream));
          CHECK(cudaEventSynchronize(stop));
          float ms = 0;
          CHECK(cudaEventElapsedTime(&ms, start, stop));
          if (pass > 0) per_call.push_back(1000.0f * ms / batches);
        }
        std::sort(per_call.begin(), per_call.end());
        // Every batch's output of the two sorts, compared; the first batch's against the host's stable sort.
        int64_t mismatched = 0;
        if (sort == 1) {
          std::vector<uint32_t> keys[2];
          std::vector<int32_t> positions[2];
          for (int b = 0; b < batches; ++b) {
            for (int s = 0; s < 2; ++s) {
              const engram::DedupGatherParams p = params(b, s);
              engram::SortBuffers buffers;
              engram::SplitSortWorkspace(p, &buffers);
              const int w = s == 0 ? 0 : which[static_cast<size_t>(b)];
              keys[s].resize(static_cast<size_t>(n));
              positions[s].resize(static_cast<size_t>(n));
              CHECK(cudaMemcpy(keys[s].data(), buffers.keys[w], 4 * n, cudaMemcpyDeviceToHost));
              CHECK(cudaMemcpy(positions[s].data(), buffers.positions[w], 4 * n, cudaMemcpyDeviceToHost));
            }
            for (int64_t i = 0; i < n; ++i) {
              mismatched += keys[0][i] != keys[1][i] || positions[0][i] != positions[1][i];
            }
            if (b == 0) {
              std::vector<std::pair<uint32_t, int32_t>> host(static_cast<size_t>(n));
              for (int64_t i = 0; i < n; ++i) {
                const int64_t id = host_ids[0][static_cast<size_t>(i)];
                host[i] = {static_cast<uint32_t>(id >= 0 && id < rows ? id : rows), static_cast<int32_t>(i)};
              }
              std::stable_sort(host.begin(), host.end(),
                               [](const auto& x, const auto& y) { return x.first < y.first; });
              for (int64_t i = 0; i < n; ++i) {
                mismatched += host[i].first != keys[0][i] || host[i].second != positions[0][i];
              }
            }
          }
        }
        printf(
            "{\"ids\": %lld, \"rows\": %lld, \"distribution\": \"%s\", \"sort\": \"%s\", "
            "\"us_per_call\": %.3f, \"us_min\": %.3f, \"batches\": %d, \"passes\": %d%s}\n",
            static_cast<long long>(n), static_cast<long long>(rows), zipf ? "zipf" : "uniform",
            sort == 0 ? "chunks" : "cub", per_call[per_call.size() / 2], per_call[0], batches, passes,
            sort == 1 ? (std::string(", \"entries_mismatched\": ") + std::to_string(mismatched) +
                         ", \"entries_compared\": " + std::to_string(n * (batches + 1)))
                            .c_str()
                      : "");
        fflush(stdout);
      }
      CHECK(cudaFree(workspace));
      CHECK(cudaFree(ids));
    }
  }
  return 0;
}
