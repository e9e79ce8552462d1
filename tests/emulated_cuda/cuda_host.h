// What train.cuh's update kernels and merge_chunks.cuh's merge use of CUDA,
// on the host: a warp is 32 std::threads that meet at a std::barrier in every
// collective (ballot, shuffles, __syncwarp), so a collective that some lanes
// skip hangs, as it would on a GPU. Warps run one after another, CTAs too: no __syncthreads.
#pragma once

#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__

struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

struct HostDim3 {
  unsigned x = 0;
};
inline thread_local HostDim3 threadIdx, blockIdx, gridDim;

struct HostWarp {
  std::barrier<> meet{32};
  uint64_t slots[32];
};
inline thread_local HostWarp* host_warp = nullptr;

inline int HostLane() { return static_cast<int>(threadIdx.x & 31); }

// Every lane posts a word and reads lane `src`'s.
inline uint64_t HostExchange(uint64_t word, int src) {
  host_warp->slots[HostLane()] = word;
  host_warp->meet.arrive_and_wait();
  const uint64_t got = host_warp->slots[src & 31];
  host_warp->meet.arrive_and_wait();
  return got;
}

inline unsigned __ballot_sync(unsigned /*mask*/, int predicate) {
  host_warp->slots[HostLane()] = predicate != 0;
  host_warp->meet.arrive_and_wait();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= static_cast<unsigned>(host_warp->slots[l]) << l;
  host_warp->meet.arrive_and_wait();
  return bits;
}

template <class T>
T __shfl_sync(unsigned /*mask*/, T value, int src) {
  static_assert(sizeof(T) <= 8, "a shuffle moves one word");
  uint64_t word = 0;
  std::memcpy(&word, &value, sizeof(T));
  word = HostExchange(word, src);
  T out;
  std::memcpy(&out, &word, sizeof(T));
  return out;
}

template <class T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta) {
  const int src = HostLane() - static_cast<int>(delta);
  return __shfl_sync(mask, value, src < 0 ? HostLane() : src);
}

template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  return __shfl_sync(mask, value, HostLane() ^ lane_mask);
}

inline void __syncwarp() { host_warp->meet.arrive_and_wait(); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
// The lanes of a warp run at once: the add is atomic, as on the GPU.
inline uint32_t atomicAdd(uint32_t* address, uint32_t value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
// Warps run one after another: a fence orders nothing more, an L2 load is a load.
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <class T>
inline T __ldcg(const T* address) {
  return *address;
}
template <class T>
inline T __ldg(const T* address) {
  return *address;
}

namespace engram {
template <class T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
inline T max(T a, T b) {
  return a < b ? b : a;
}
// UpdateKernel's dynamic shared memory: a CTA's 8 warps, one at a time.
inline float transposes[8 * 256];
}  // namespace engram

// Runs `body` as a kernel on `grid` CTAs of 256 threads, warp after warp: 32
// threads play the lanes of each warp in turn, meeting between warps.
template <class Body>
void HostLaunch(int grid, Body body) {
  HostWarp state;
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      host_warp = &state;
      gridDim.x = grid;
      for (int cta = 0; cta < grid; ++cta) {
        for (int warp = 0; warp < 8; ++warp) {
          threadIdx.x = 32 * warp + lane;
          blockIdx.x = cta;
          body();
          state.meet.arrive_and_wait();
        }
      }
    });
  }
  for (auto& thread : lanes) thread.join();
}
