// The hot-row cache registry: entries per (cache key, device), leases taken by
// lookups, and the wait a refresh makes before it rewrites a buffer set.
#include "runtime/cache_registry.h"

#include <cstdint>
#include <exception>
#include <map>
#include <string>
#include <utility>

namespace engram {
namespace {

using Key = std::pair<int64_t, int32_t>;

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

std::map<Key, std::shared_ptr<CacheEntry>>& Registry() {
  static auto* registry = new std::map<Key, std::shared_ptr<CacheEntry>>();
  return *registry;
}

// The entry of exactly this device, or with `any_device` else the key's
// any-device entry (what a lookup reads); null if there is none.
std::shared_ptr<CacheEntry> Find(int64_t key, int32_t device_ordinal, bool any_device) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& registry = Registry();
  auto it = registry.find({key, device_ordinal});
  if (it == registry.end() && any_device) it = registry.find({key, kAnyDevice});
  return it == registry.end() ? nullptr : it->second;
}

std::string Describe(int64_t key, int32_t device_ordinal) {
  return "hot-row cache " + std::to_string(key) + " on device " + std::to_string(device_ordinal);
}

}  // namespace

std::string CreateCache(int64_t key, int32_t device_ordinal, int64_t table_key, int64_t dim, MemoryKind kind) {
  auto entry = std::make_shared<CacheEntry>();
  entry->table_key = table_key;
  entry->dim = dim;
  entry->kind = kind;
  std::lock_guard<std::mutex> lock(RegistryMutex());
  if (!Registry().emplace(Key{key, device_ordinal}, std::move(entry)).second) {
    return Describe(key, device_ordinal) + " already exists";
  }
  return "";
}

std::string AcquireCache(int64_t key, int32_t device_ordinal, int64_t table_key, int64_t dim,
                         bool (*readable)(MemoryKind), CacheLease* lease) {
  *lease = CacheLease{};
  std::shared_ptr<CacheEntry> entry = Find(key, device_ordinal, /*any_device=*/true);
  if (!entry) return "no " + Describe(key, device_ordinal) + " (was it closed?)";
  if (entry->table_key != table_key || entry->dim != dim) {
    return Describe(key, device_ordinal) + " holds rows of table " + std::to_string(entry->table_key) + " (dim " +
           std::to_string(entry->dim) + "), the lookup reads table " + std::to_string(table_key) + " (dim " +
           std::to_string(dim) + ")";
  }
  if (!readable(entry->kind)) {
    return Describe(key, device_ordinal) + " lives in memory this backend cannot read";
  }
  std::lock_guard<std::mutex> lock(entry->mu);
  if (entry->removed || entry->active < 0) return "";  // nothing to read: every row is a miss
  lease->entry = entry;
  lease->buffer = entry->active;
  lease->view = entry->buffers[entry->active].view;
  ++entry->buffers[entry->active].leases;
  return "";
}

std::string ReleaseCache(CacheLease* lease, void* gpu_stream) {
  if (!lease->entry) return "";
  std::string error;
  {
    std::lock_guard<std::mutex> lock(lease->entry->mu);
    CacheBufferState& state = lease->entry->buffers[lease->buffer];
    // The lease is returned even if the fence cannot be recorded (an error or
    // an exception such as std::bad_alloc): else a refresh would wait forever.
    --state.leases;
    if (gpu_stream != nullptr) {
      try {
        error = RecordGpuFence(&state.fences, gpu_stream);
      } catch (const std::exception& e) {
        error = std::string("recording the cache fence: ") + e.what();
      }
    }
  }
  lease->entry->released.notify_all();
  *lease = CacheLease{};
  return error;
}

std::string ReserveCacheBuffer(int64_t key, int32_t device_ordinal, int buffer) {
  if (buffer != 0 && buffer != 1) return "buffer must be 0 or 1";
  const std::shared_ptr<CacheEntry> entry = Find(key, device_ordinal, /*any_device=*/false);
  if (!entry) return "no " + Describe(key, device_ordinal);
  std::vector<GpuFence> fences;
  {
    std::unique_lock<std::mutex> lock(entry->mu);
    CacheBufferState& state = entry->buffers[buffer];
    // The wait lets go of the lock, so whether the set is active (or the cache
    // removed) is decided once it is over, not before.
    entry->released.wait(lock, [&] { return state.leases == 0 || entry->active == buffer || entry->removed; });
    if (entry->removed) return Describe(key, device_ordinal) + " was removed";
    if (entry->active == buffer) return "buffer set " + std::to_string(buffer) + " is the one lookups read";
    // No lease is left and the set is not active, so no new fence can appear.
    fences = state.fences;
    state.view = CacheView{};
  }
  return WaitGpuFences(fences);
}

std::string PublishCache(int64_t key, int32_t device_ordinal, int buffer, const CacheView& view) {
  if (buffer != 0 && buffer != 1) return "buffer must be 0 or 1";
  const std::shared_ptr<CacheEntry> entry = Find(key, device_ordinal, /*any_device=*/false);
  if (!entry) return "no " + Describe(key, device_ordinal);
  {
    std::lock_guard<std::mutex> lock(entry->mu);
    entry->buffers[buffer].view = view;
    entry->active = buffer;
  }
  entry->released.notify_all();  // a reserve of this set waits no longer: it fails
  return "";
}

int ActiveCacheBuffer(int64_t key, int32_t device_ordinal) {
  const std::shared_ptr<CacheEntry> entry = Find(key, device_ordinal, /*any_device=*/false);
  if (!entry) return -2;
  std::lock_guard<std::mutex> lock(entry->mu);
  return entry->active;
}

int RemoveCache(int64_t key, std::string* error) {
  error->clear();
  std::vector<std::pair<Key, std::shared_ptr<CacheEntry>>> removed;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& registry = Registry();
    for (auto it = registry.lower_bound({key, INT32_MIN}); it != registry.end() && it->first.first == key;) {
      removed.emplace_back(it->first, it->second);
      it = registry.erase(it);
    }
  }
  for (auto& item : removed) {
    const Key& where = item.first;
    const std::shared_ptr<CacheEntry>& entry = item.second;
    std::vector<GpuFence> fences;
    {
      std::unique_lock<std::mutex> lock(entry->mu);
      entry->removed = true;
      entry->active = -1;
      entry->released.notify_all();  // a reserve still waiting fails now
      entry->released.wait(lock, [&entry] { return entry->buffers[0].leases == 0 && entry->buffers[1].leases == 0; });
      for (auto& state : entry->buffers) {
        fences.insert(fences.end(), state.fences.begin(), state.fences.end());
        state.fences.clear();
      }
    }
    // The memory is freed after this returns, so the wait is made whatever
    // happened before; the events are destroyed even if it fails.
    std::string failed = WaitGpuFences(fences);
    std::string destroyed = DestroyGpuFences(&fences);
    if (failed.empty()) failed = std::move(destroyed);
    if (error->empty() && !failed.empty()) *error = Describe(where.first, where.second) + ": " + failed;
  }
  return static_cast<int>(removed.size());
}

#if !ENGRAM_HAS_CUDA
std::string RecordGpuFence(std::vector<GpuFence>*, void*) { return "built without CUDA"; }
std::string WaitGpuFences(const std::vector<GpuFence>& fences) { return fences.empty() ? "" : "built without CUDA"; }
std::string DestroyGpuFences(std::vector<GpuFence>* fences) {
  const bool any = !fences->empty();
  fences->clear();
  return any ? "built without CUDA" : "";
}
#endif

}  // namespace engram
