// rawupdate: the ceiling a row update of a host table is measured against.
//
// A row update on the GPU reads each distinct row's record (values and optimizer
// state) from pinned host memory over PCIe and writes it back. This program does
// only that, with the simplest fast kernels (rawgather's, or a warp per row as
// the library's update moves a record): 16-byte loads, one record per row, a
// persistent grid, each 32-bit word incremented by one and
// stored back, rows visited in table order (the library's update sorts its ids).
// No gradients, no optimizer math, no bounds checks.
//
// Build:  nvcc -O3 -arch=sm_90 -o rawupdate rawupdate.cu
// Env:    RAWUPDATE_BYTES   table footprint in bytes        (default 1 GiB)
//         RAWUPDATE_STRIDE  bytes per row record           (default 528: 256 bf16 values
//                                                           + row-wise Adagrad state, padded)
//         RAWUPDATE_ROWS    distinct rows per call, comma-separated (default 1048576)
//         RAWUPDATE_CALLS   timed calls per row count      (default 8)
//         RAWUPDATE_CTAS    CTAs of 256 threads            (default 132*16)
//         RAWUPDATE_KERNEL  flat: thread i moves word i of the call's rows (default);
//                           warp: a warp per row, every load of the row issued before
//                           its stores, as the library's update moves a record. With
//                           528-byte records flat warps straddle rows; which is faster
//                           is measured, not assumed: the benchmark runs both.
// Prints one JSON object per line per row count. Ids: fresh uniform distinct rows
// every call (drawn on the host, sorted). After timing, every row of the last call
// is compared on the host with what its words must hold: the fill's value plus the
// number of calls that updated the row (rows_mismatched in its line).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

__global__ void update_rows(uint4* __restrict__ table, const int64_t* __restrict__ ids, int64_t n, int lanes) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  for (; i < n * lanes; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t at = ids[i / lanes] * lanes + i % lanes;
    uint4 v = table[at];
    v.x += 1u;
    v.y += 1u;
    v.z += 1u;
    v.w += 1u;
    table[at] = v;
  }
}

// One warp per row: lane l holds words l, l + 32, ... of the record (up to
// kWordsPerLane of them), all loaded before any is stored.
constexpr int kWordsPerLane = 4;

__global__ void update_rows_by_warp(uint4* __restrict__ table, const int64_t* __restrict__ ids, int64_t n, int lanes) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32; r < n; r += warps) {
    uint4* row = table + ids[r] * lanes;
    uint4 v[kWordsPerLane];
#pragma unroll
    for (int k = 0; k < kWordsPerLane; ++k) {
      if (lane + 32 * k < lanes) v[k] = row[lane + 32 * k];
    }
#pragma unroll
    for (int k = 0; k < kWordsPerLane; ++k) {
      if (lane + 32 * k < lanes) {
        v[k].x += 1u;
        v[k].y += 1u;
        v[k].z += 1u;
        v[k].w += 1u;
        row[lane + 32 * k] = v[k];
      }
    }
  }
}

// Word k (32-bit) of the table starts as a hash of k: rows differ, and every page is
// written (faulted in) before timing.
static uint32_t initial_word(uint64_t k) {
  uint64_t z = k * 0x9E3779B97F4A7C15ull + 1;
  return (uint32_t)(z ^ (z >> 29));
}

static void fill(uint32_t* words, size_t n) {
  unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < nt; ++t)
    ts.emplace_back([=] {
      size_t lo = n / nt * t, hi = t + 1 == nt ? n : n / nt * (t + 1);
      for (size_t k = lo; k < hi; ++k) words[k] = initial_word(k);
    });
  for (auto& t : ts) t.join();
}

// `n` distinct uniform rows of `rows`, ascending.
static std::vector<int64_t> draw_distinct(std::mt19937_64& rng, int64_t n, int64_t rows) {
  std::uniform_int_distribution<int64_t> pick(0, rows - 1);
  std::vector<int64_t> ids;
  while ((int64_t)ids.size() < n) {
    const int64_t want = n + n / 64 + 16 - (int64_t)ids.size();
    for (int64_t k = 0; k < want; ++k) ids.push_back(pick(rng));
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  }
  // A uniform subset of n of them (the first n after a partial shuffle), ascending.
  for (int64_t k = 0; k < n; ++k) {
    std::uniform_int_distribution<int64_t> at(k, (int64_t)ids.size() - 1);
    std::swap(ids[k], ids[at(rng)]);
  }
  ids.resize(n);
  std::sort(ids.begin(), ids.end());
  return ids;
}

static float median_ms(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  const size_t bytes = getenv("RAWUPDATE_BYTES") ? strtoull(getenv("RAWUPDATE_BYTES"), nullptr, 10) : (1ull << 30);
  const int stride = getenv("RAWUPDATE_STRIDE") ? atoi(getenv("RAWUPDATE_STRIDE")) : 528;
  const int calls = getenv("RAWUPDATE_CALLS") ? atoi(getenv("RAWUPDATE_CALLS")) : 8;
  const int ctas = getenv("RAWUPDATE_CTAS") ? atoi(getenv("RAWUPDATE_CTAS")) : 132 * 16;
  const std::string kernel = getenv("RAWUPDATE_KERNEL") ? getenv("RAWUPDATE_KERNEL") : "flat";
  std::vector<int64_t> counts_to_run;
  {
    std::string list = getenv("RAWUPDATE_ROWS") ? getenv("RAWUPDATE_ROWS") : "1048576";
    size_t at = 0;
    while (at < list.size()) {
      size_t comma = list.find(',', at);
      if (comma == std::string::npos) comma = list.size();
      counts_to_run.push_back(atoll(list.substr(at, comma - at).c_str()));
      at = comma + 1;
    }
  }
  if (stride % 16 != 0 || stride < 16 || calls < 1) {
    fprintf(stderr, "RAWUPDATE_STRIDE must be a positive multiple of 16, RAWUPDATE_CALLS >= 1\n");
    return 2;
  }
  const int lanes = stride / 16;
  if ((kernel != "flat" && kernel != "warp") || (kernel == "warp" && lanes > 32 * kWordsPerLane)) {
    fprintf(stderr, "RAWUPDATE_KERNEL must be flat or warp (warp: RAWUPDATE_STRIDE <= %d)\n", 32 * kWordsPerLane * 16);
    return 2;
  }
  const int64_t rows = (int64_t)(bytes / stride);
  for (int64_t n : counts_to_run) {
    if (n < 1 || n > rows) {
      fprintf(stderr, "RAWUPDATE_ROWS entries must be in [1, %lld]\n", (long long)rows);
      return 2;
    }
  }

  CHECK(cudaSetDevice(0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  uint8_t* host = nullptr;
  const size_t table_bytes = (size_t)rows * stride;
  CHECK(cudaHostAlloc((void**)&host, table_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  uint32_t* words = reinterpret_cast<uint32_t*>(host);
  fill(words, table_bytes / 4);
  uint4* table = nullptr;
  CHECK(cudaHostGetDevicePointer((void**)&table, host, 0));

  const int64_t max_n = *std::max_element(counts_to_run.begin(), counts_to_run.end());
  int64_t* ids_dev = nullptr;
  CHECK(cudaMalloc(&ids_dev, max_n * sizeof(int64_t)));
  std::vector<uint32_t> updates(rows, 0);  // calls that updated each row, for the check
  std::mt19937_64 rng(12345);

  for (int64_t n : counts_to_run) {
    std::vector<float> ms;
    std::vector<int64_t> ids;
    for (int c = 0; c <= calls; ++c) {  // call 0 warms up, untimed
      ids = draw_distinct(rng, n, rows);
      CHECK(cudaMemcpy(ids_dev, ids.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice));
      CHECK(cudaEventRecord(a));
      if (kernel == "warp") {
        update_rows_by_warp<<<ctas, 256>>>(table, ids_dev, n, lanes);
      } else {
        update_rows<<<ctas, 256>>>(table, ids_dev, n, lanes);
      }
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float m = 0.0f;
      CHECK(cudaEventElapsedTime(&m, a, b));
      if (c) ms.push_back(m);
      for (int64_t r : ids) ++updates[r];
    }
    int64_t wrong = 0;
    const int64_t words_per_row = stride / 4;
    for (int64_t r : ids) {
      bool same = true;
      for (int64_t w = 0; w < words_per_row && same; ++w) {
        const uint64_t k = (uint64_t)r * words_per_row + w;
        same = words[k] == initial_word(k) + updates[r];
      }
      wrong += !same;
    }
    const float med = median_ms(ms);
    printf(
        "{\"what\": \"update_sorted\", \"kernel\": \"%s\", \"footprint_bytes\": %zu, \"rows\": %lld, "
        "\"row_stride\": %d, \"ms\": %.4f, \"mrows_per_s\": %.2f, \"gb_per_s_each_way\": %.2f, "
        "\"rows_compared\": %lld, \"rows_mismatched\": %lld}\n",
        kernel.c_str(), table_bytes, (long long)n, stride, med, n / (med * 1e3), n * (double)stride / (med * 1e6),
        (long long)n, (long long)wrong);
    fflush(stdout);
  }
  CHECK(cudaFree(ids_dev));
  CHECK(cudaFreeHost(host));
  return 0;
}
