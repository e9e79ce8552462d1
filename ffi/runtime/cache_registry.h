// Process-wide map from a hot-row cache key to its state on each device: two
// buffer sets (the one lookups read, the one a refresh rewrites) and who may
// still be reading each. Plain C++; the CUDA build supplies the event functions.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cache_index.h"
#include "runtime/table_registry.h"

namespace engram {

// The last read of a buffer set on one CUDA stream: an event recorded after it.
struct GpuFence {
  void* stream = nullptr;  // cudaStream_t
  void* event = nullptr;   // cudaEvent_t
};

struct CacheBufferState {
  CacheView view;
  int leases = 0;                // lookups between acquire and release
  std::vector<GpuFence> fences;  // CUDA lookups that read this set, one per stream
};

// A lookup takes a lease on the active set for as long as it launches work,
// and a CUDA lookup leaves an event on its stream; a refresh rewrites a set
// only after every lease on it is returned and every such event has completed,
// so a lookup in flight never sees a set change under it (no torn or stale
// rows) and no step waits for a refresh.
struct CacheEntry {
  int64_t table_key = 0;  // the table whose rows the cache holds
  int64_t dim = 0;
  MemoryKind kind = MemoryKind::kHost;  // where the buffers live
  std::mutex mu;
  std::condition_variable released;
  int active = -1;  // buffer set lookups read; -1: none published yet
  bool removed = false;
  CacheBufferState buffers[2];
};

// What a lookup reads: the active set's view, held until ReleaseCache.
struct CacheLease {
  std::shared_ptr<CacheEntry> entry;  // null: no cache (none published, or removed)
  int buffer = -1;
  CacheView view;
};

// Each returns "" on success, else a message for the caller's error.
std::string CreateCache(int64_t key, int32_t device_ordinal, int64_t table_key, int64_t dim, MemoryKind kind);
// `readable` says which memory the calling backend can read.
std::string AcquireCache(int64_t key, int32_t device_ordinal, int64_t table_key, int64_t dim,
                         bool (*readable)(MemoryKind), CacheLease* lease);
// gpu_stream: the stream the lookup's work was queued on (null for the CPU).
std::string ReleaseCache(CacheLease* lease, void* gpu_stream);
// Blocks until nothing reads `buffer` any more; fails if it is (or while
// waiting becomes) the active set, or the cache is removed meanwhile.
std::string ReserveCacheBuffer(int64_t key, int32_t device_ordinal, int buffer);
// Makes `buffer` (holding `view`) the set lookups read from now on.
std::string PublishCache(int64_t key, int32_t device_ordinal, int buffer, const CacheView& view);
// Active set of the entry, -1 if none, -2 if there is no such entry.
int ActiveCacheBuffer(int64_t key, int32_t device_ordinal);
// Removes every device's entry of the key once nothing reads it; returns how
// many. `*error` gets the first failure of waiting for or destroying the GPU
// fences ("" if none); every entry is removed and every fence destroyed even so.
int RemoveCache(int64_t key, std::string* error);

// CUDA build: cache_cuda.cu; CPU-only builds: stubs (no CUDA lookup exists to fence).
std::string RecordGpuFence(std::vector<GpuFence>* fences, void* stream);
std::string WaitGpuFences(const std::vector<GpuFence>& fences);
// Destroys every event (even after a failure) and clears the list; returns the first failure.
std::string DestroyGpuFences(std::vector<GpuFence>* fences);

}  // namespace engram
