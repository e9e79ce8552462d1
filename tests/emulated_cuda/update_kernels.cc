// train.cuh's update kernel (UpdateKernel: the hot runs' chunk sums and
// folds, and every row's update) run on the host through cuda_host.h, against
// UpdateCpu (train_cpu.h), the tables compared byte for byte: every optimizer,
// float32 and bfloat16 rows, wide and narrow dims, one and two tiles, runs of
// 1 to 2500 entries.
// Built and run by tests/test_update_kernels_emulated.py; prints a summary line.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "cuda_host.h"
#include "kernels/train_cpu.h"
#include "train_kernels.h"  // train.cuh without its launch functions (the test writes it)

using namespace engram;

namespace {

struct Counts {
  int cases = 0, failures = 0;
  int64_t chunks = 0, runs_done = 0;  // full chunks summed, and runs of two or more whose arrivals all came
};

// A buffer of `bytes` whose data() is 16-byte aligned, as XLA's buffers are.
struct Aligned {
  std::vector<uint8_t> storage;
  uint8_t* data;
  explicit Aligned(size_t bytes) : storage(bytes + 16) {
    data = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) % 16) % 16;
  }
};

void RunCase(uint64_t seed, RowOptimizerKind optimizer, RowFormat format, RowFormat moment_format, int64_t dim,
             bool bf16_grads, int64_t n, int ctas, Counts* counts) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> decades(-3.0f, 3.0f);
  const int64_t rows = 37, row_start = 100;
  const int64_t stride = TrainableStride(format, dim, optimizer, moment_format);
  const int64_t state_offset = StateOffset(format, dim);
  Aligned table(static_cast<size_t>(rows * stride));
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* record = table.data + r * stride;
    for (int64_t j = 0; j < dim; ++j) StoreValue(record, format, j, normal(rng));
    uint8_t* state = record + state_offset;
    if (optimizer == RowOptimizerKind::kRowAdagrad) StoreValue(state, RowFormat::kF32, 0, 0.5f);
    if (optimizer == RowOptimizerKind::kAdagrad) {
      for (int64_t j = 0; j < dim; ++j) StoreValue(state, RowFormat::kF32, j, 0.1f + 0.01f * j);
    }
    if (optimizer == RowOptimizerKind::kLazyAdam) {
      for (int64_t j = 0; j < 2 * dim; ++j) StoreValue(state, moment_format, j, 0.01f * (j % 7));
    }
  }
  // Runs of 1 to 2500 entries of held rows, rows outside the table and -1, shuffled.
  const int lengths[] = {1, 2, 63, 64, 65, 127, 128, 129, 200, 256, 300, 1000, 2500};
  std::vector<int32_t> ids;
  while (static_cast<int64_t>(ids.size()) < n) {
    const int length = lengths[rng() % 13];
    int32_t id = static_cast<int32_t>(row_start - 3 + static_cast<int64_t>(rng() % (rows + 6)));
    if (rng() % 10 == 0) id = -1;
    for (int k = 0; k < length && static_cast<int64_t>(ids.size()) < n; ++k) ids.push_back(id);
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  // Gradients over six decades, whose float32 sums show any other order.
  Aligned grads(static_cast<size_t>(n * dim * 4));
  for (int64_t i = 0; i < n; ++i) {
    const float scale = std::pow(10.0f, decades(rng));
    for (int64_t j = 0; j < dim; ++j) {
      const float v = normal(rng) * scale;
      if (bf16_grads) {
        const uint16_t h = FloatToBf16(v);
        std::memcpy(grads.data + 2 * (i * dim + j), &h, 2);
      } else {
        std::memcpy(grads.data + 4 * (i * dim + j), &v, 4);
      }
    }
  }
  const float lr = 0.03f;
  UpdateParams p;
  p.t = TrainableView{table.data, row_start, rows, dim, stride, state_offset, format, optimizer, moment_format};
  p.ids = ids.data();
  p.num_ids = n;
  p.grads = grads.data;
  p.grads_bf16 = bf16_grads;
  p.lr = &lr;
  p.scalars = OptimizerScalars{1e-6f, 0.1f, 0.001f};

  Aligned reference(static_cast<size_t>(rows * stride));
  std::memcpy(reference.data, table.data, static_cast<size_t>(rows * stride));
  UpdateParams cpu = p;
  cpu.t.table = reference.data;
  std::vector<uint8_t> cpu_workspace(static_cast<size_t>(UpdateCpuWorkspaceBytes(n)));
  cpu.workspace = cpu_workspace.data();
  cpu.workspace_bytes = static_cast<int64_t>(cpu_workspace.size());
  UpdateCpu(cpu, 1);

  // The CUDA path: ids sorted stably by table-local row (those the table does not hold last), the runs listed,
  // then the kernels.
  std::vector<std::pair<uint32_t, int32_t>> sorted(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = static_cast<int64_t>(ids[i]) - row_start;
    sorted[i] = {static_cast<uint32_t>(local >= 0 && local < rows ? local : rows), static_cast<int32_t>(i)};
  }
  std::stable_sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<uint32_t> keys(static_cast<size_t>(n));
  std::vector<int32_t> positions(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) keys[i] = sorted[i].first, positions[i] = sorted[i].second;
  // ListRuns' list: the first entry of every run of equal keys.
  std::vector<int32_t> run_starts;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || keys[i] != keys[i - 1]) run_starts.push_back(static_cast<int32_t>(i));
  }
  const int32_t run_count = static_cast<int32_t>(run_starts.size());
  Aligned sums(static_cast<size_t>(ChunkSumsBytes(n, dim)) + 16);
  std::memset(sums.data, 0xFF, static_cast<size_t>(ChunkSumsBytes(n, dim)));  // NaN: a slot read unwritten shows
  std::vector<uint32_t> arrivals(static_cast<size_t>(n / kGradChunk) + 1, 0);
  ChunkWork work;
  work.sums = reinterpret_cast<float*>(sums.data);
  work.arrivals = arrivals.data();
  HostLaunch(ctas, [&] { UpdateKernel(p, keys.data(), positions.data(), run_starts.data(), &run_count, work); });
  for (int64_t slot = 0; slot < n / kGradChunk; ++slot) {
    counts->chunks += !std::isnan(work.sums[slot * dim]);
    // A run's first slot counts its chunks' arrivals: kArrivalsDone once all came.
    const uint32_t arrived = arrivals[static_cast<size_t>(slot)];
    counts->runs_done += arrived == kArrivalsDone;
    if (arrived != 0 && arrived != kArrivalsDone) {
      std::printf("arrivals: seed %llu slot %lld count %u\n", static_cast<unsigned long long>(seed),
                  static_cast<long long>(slot), arrived);
      ++counts->failures;
    }
  }

  ++counts->cases;
  if (std::memcmp(table.data, reference.data, static_cast<size_t>(rows * stride)) != 0) {
    int64_t at = 0;
    while (table.data[at] == reference.data[at]) ++at;
    std::printf("differs: seed %llu optimizer %d format %d dim %lld ids %lld: row %lld byte %lld\n",
                static_cast<unsigned long long>(seed), static_cast<int>(optimizer), static_cast<int>(format),
                static_cast<long long>(dim), static_cast<long long>(n), static_cast<long long>(at / stride),
                static_cast<long long>(at % stride));
    ++counts->failures;
  }
}

}  // namespace

int main() {
  Counts counts;
  const RowOptimizerKind optimizers[] = {RowOptimizerKind::kSgd, RowOptimizerKind::kAdagrad,
                                         RowOptimizerKind::kRowAdagrad, RowOptimizerKind::kLazyAdam};
  uint64_t seed = 1;
  for (RowOptimizerKind optimizer : optimizers) {
    // 33 and 300: narrow loads; 40, 256, 264: 16-byte ones; 264 and 300: a second, partial tile.
    for (int64_t dim : {33, 40, 256, 264, 300}) {
      for (RowFormat format : {RowFormat::kF32, RowFormat::kBf16}) {
        const RowFormat moment_format = optimizer == RowOptimizerKind::kLazyAdam ? format : RowFormat::kF32;
        for (int64_t n : {1, 64, 129, 700, 2100, 6000}) {
          ++seed;
          RunCase(seed, optimizer, format, moment_format, dim, seed % 2 == 0, n, 1 + static_cast<int>(seed % 3),
                  &counts);
        }
      }
    }
  }
  std::printf("cases %d failures %d chunks %lld runs_done %lld\n", counts.cases, counts.failures,
              static_cast<long long>(counts.chunks), static_cast<long long>(counts.runs_done));
  return counts.failures == 0 ? 0 : 1;
}
