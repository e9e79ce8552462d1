// Python bindings of the hot-row cache registry (create, reserve a buffer
// set, publish it, remove), the CUDA fill and upload on a private stream, and
// the workspace size of engram_cached_lookup. Calls that can wait release the
// GIL, so a refresh thread never holds up the thread that runs the model.
#include "bindings/cache_module.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/dedup_params.h"
#include "runtime/cache_registry.h"
#if ENGRAM_HAS_CUDA
#include "runtime/cache_cuda.h"
#endif

namespace nb = nanobind;

namespace engram {
namespace {

void Check(const std::string& error) {
  if (error.empty()) return;
  throw std::runtime_error(error.rfind("engram_jax", 0) == 0 ? error : "engram_jax: " + error);
}

bool AnyMemory(MemoryKind) { return true; }

// Leases taken from Python stand in for a lookup in flight (tests).
std::mutex holds_mu;
std::map<int64_t, CacheLease>& Holds() {
  static auto* holds = new std::map<int64_t, CacheLease>();
  return *holds;
}
std::atomic<int64_t> next_hold{1};

}  // namespace

void BindCache(nb::module_& m) {
  m.def(
      "lookup_workspace_bytes",
      [](int64_t num_ids, int64_t order) {
        if (!ValidVisitOrder(order)) throw nb::value_error("order must be 0, 1 or 2");
        return LookupWorkspaceBytes(num_ids, static_cast<VisitOrder>(order));
      },
      nb::arg("num_ids"), nb::arg("order"));

  m.def(
      "cache_create",
      [](int64_t key, int32_t device_ordinal, int64_t table_key, int64_t dim, int32_t kind) {
        if (kind < 0 || kind > 2) throw nb::value_error("memory kind must be 0, 1 or 2");
        if (static_cast<MemoryKind>(kind) == MemoryKind::kDevice && device_ordinal < 0) {
          throw nb::value_error("a cache in device memory belongs to one GPU: give that device's ordinal");
        }
        Check(CreateCache(key, device_ordinal, table_key, dim, static_cast<MemoryKind>(kind)));
      },
      nb::arg("key"), nb::arg("device_ordinal"), nb::arg("table_key"), nb::arg("dim"), nb::arg("kind"));

  m.def(
      "cache_reserve",
      [](int64_t key, int32_t device_ordinal, int buffer) {
        std::string error;
        {
          nb::gil_scoped_release release;
          error = ReserveCacheBuffer(key, device_ordinal, buffer);
        }
        Check(error);
      },
      nb::arg("key"), nb::arg("device_ordinal"), nb::arg("buffer"));

  m.def(
      "cache_publish",
      [](int64_t key, int32_t device_ordinal, int buffer, uintptr_t records, uintptr_t rows, uintptr_t buckets,
         int64_t count, int64_t num_buckets, int32_t shift) {
        // Slots and the bucket directory are int32 (kernels/cache_index.h).
        if (count < 0 || count > INT32_MAX || num_buckets < 1 || shift < 0 || shift > 31) {
          throw nb::value_error("cache index sizes out of range");
        }
        if (count > 0 && (records == 0 || rows == 0 || buckets == 0)) {
          throw nb::value_error("a cache holding rows needs its records, rows and buckets");
        }
        CacheView view;
        view.records = reinterpret_cast<const uint8_t*>(records);
        view.rows = reinterpret_cast<const int32_t*>(rows);
        view.buckets = reinterpret_cast<const int32_t*>(buckets);
        view.count = count;
        view.num_buckets = num_buckets;
        view.shift = shift;
        Check(PublishCache(key, device_ordinal, buffer, view));
      },
      nb::arg("key"), nb::arg("device_ordinal"), nb::arg("buffer"), nb::arg("records"), nb::arg("rows"),
      nb::arg("buckets"), nb::arg("count"), nb::arg("num_buckets"), nb::arg("shift"));

  m.def("cache_active", &ActiveCacheBuffer, nb::arg("key"), nb::arg("device_ordinal"));

  m.def(
      "cache_remove",
      [](int64_t key) {
        std::string error;
        int removed = 0;
        {
          nb::gil_scoped_release release;
          removed = RemoveCache(key, &error);
        }
        Check(error);  // the cache is gone either way; a GPU fault is reported
        return removed;
      },
      nb::arg("key"));

  m.def(
      "cache_hold",
      [](int64_t key, int32_t device_ordinal, int64_t table_key, int64_t dim) {
        CacheLease lease;
        Check(AcquireCache(key, device_ordinal, table_key, dim, AnyMemory, &lease));
        const int buffer = lease.buffer;
        const int64_t token = next_hold++;
        std::lock_guard<std::mutex> lock(holds_mu);
        Holds()[token] = lease;
        return std::make_pair(token, buffer);
      },
      nb::arg("key"), nb::arg("device_ordinal"), nb::arg("table_key"), nb::arg("dim"),
      "Take a lease on the active buffer set, as a lookup in flight does (for tests).");

  m.def(
      "cache_unhold",
      [](int64_t token) {
        CacheLease lease;
        {
          std::lock_guard<std::mutex> lock(holds_mu);
          auto it = Holds().find(token);
          if (it == Holds().end()) throw nb::value_error("unknown hold");
          lease = it->second;
          Holds().erase(it);
        }
        Check(ReleaseCache(&lease, nullptr));
      },
      nb::arg("token"));

  m.def(
      "cache_fill_cuda",
      [](int64_t table_key, int32_t device_ordinal, uintptr_t rows, int64_t count, uintptr_t dst) {
        if (count < 0 || count > INT32_MAX) throw nb::value_error("cache_fill_cuda: count out of range");
        if (count > 0 && (rows == 0 || dst == 0)) throw nb::value_error("cache_fill_cuda: null rows or destination");
#if ENGRAM_HAS_CUDA
        std::string error;
        {
          nb::gil_scoped_release release;
          error = FillCacheRecordsCuda(table_key, device_ordinal, reinterpret_cast<const int32_t*>(rows), count,
                                       reinterpret_cast<uint8_t*>(dst));
        }
        Check(error);
#else
        (void)table_key, (void)device_ordinal, (void)rows, (void)count, (void)dst;
        throw std::runtime_error("engram_jax was built without CUDA");
#endif
      },
      nb::arg("table_key"), nb::arg("device_ordinal"), nb::arg("rows"), nb::arg("count"), nb::arg("dst"));

  m.def(
      "cache_upload_cuda",
      [](int32_t device_ordinal, uintptr_t dst, nb::ndarray<nb::numpy, nb::c_contig, nb::device::cpu> src) {
        if (dst == 0 && src.nbytes() > 0) throw nb::value_error("cache_upload_cuda: null destination");
#if ENGRAM_HAS_CUDA
        std::string error;
        const void* data = src.data();
        const int64_t nbytes = static_cast<int64_t>(src.nbytes());
        {
          nb::gil_scoped_release release;
          error = UploadCuda(device_ordinal, reinterpret_cast<void*>(dst), data, nbytes);
        }
        Check(error);
#else
        (void)device_ordinal, (void)dst, (void)src;
        throw std::runtime_error("engram_jax was built without CUDA");
#endif
      },
      nb::arg("device_ordinal"), nb::arg("dst"), nb::arg("src"));
}

}  // namespace engram
