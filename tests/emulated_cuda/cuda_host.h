// What train.cuh's update kernels and merge_chunks.cuh's merge use of CUDA,
// on the host: a warp is 32 lanes, each a ucontext fiber of one thread, that
// meet in every collective (ballot, shuffles, __syncwarp) by handing on to the
// next lane; a collective that some lanes skip aborts the program, where a GPU
// would hang or mix lanes' words. Warps run one after another, CTAs too: no
// __syncthreads.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
inline HostDim3 blockIdx, gridDim;

// The lanes of the warp being run: lane l's fiber, its threadIdx, its posted
// word, the meetings it has reached. The 240 update cases take 9 s with a
// fiber a lane, 36 s with a thread a lane meeting at a std::barrier (two
// cores): a hand-on is a context switch, not a wake-up of 32 threads.
struct HostWarp {
  ucontext_t main, fibers[32];
  HostDim3 thread_idx[32];
  uint64_t slots[32];
  uint64_t meetings[32] = {};
  int lane = 0;  // the lane running now
};
inline HostWarp* host_warp = nullptr;

inline HostDim3& HostThreadIdx() { return host_warp->thread_idx[host_warp->lane]; }
#define threadIdx HostThreadIdx()

inline int HostLane() { return host_warp->lane; }

// Every lane has reached as many meetings as lane 31, or some skipped one.
inline void HostCheckMeetings(const HostWarp& w) {
  for (int l = 0; l < 32; ++l) {
    if (w.meetings[l] != w.meetings[31]) {
      std::fprintf(stderr, "lane %d reached %llu warp collectives, lane 31 %llu: a collective some lanes skipped\n", l,
                   static_cast<unsigned long long>(w.meetings[l]), static_cast<unsigned long long>(w.meetings[31]));
      std::abort();
    }
  }
}

// The running lane hands on to the next: once lane 31 has handed on, every
// lane has reached this meeting, and lane 0 goes on.
inline void HostMeet() {
  HostWarp& w = *host_warp;
  const int from = w.lane;
  ++w.meetings[from];
  if (from == 31) HostCheckMeetings(w);
  w.lane = (from + 1) % 32;
  if (swapcontext(&w.fibers[from], &w.fibers[w.lane]) != 0) {
    std::perror("swapcontext");
    std::abort();
  }
}

// Every lane posts a word and reads lane `src`'s.
inline uint64_t HostExchange(uint64_t word, int src) {
  host_warp->slots[HostLane()] = word;
  HostMeet();
  const uint64_t got = host_warp->slots[src & 31];
  HostMeet();
  return got;
}

inline unsigned __ballot_sync(unsigned /*mask*/, int predicate) {
  host_warp->slots[HostLane()] = predicate != 0;
  HostMeet();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= static_cast<unsigned>(host_warp->slots[l]) << l;
  HostMeet();
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

inline void __syncwarp() { HostMeet(); }
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

// Runs `body` as a kernel on `grid` CTAs of `threads` threads (a multiple of
// 32), warp after warp: 32 fibers play the lanes of each warp in turn, meeting
// between warps; the last lane's fiber ends the launch.
template <class Body>
void HostLaunch(int grid, Body body, int threads = 256) {
  constexpr size_t kStackBytes = 256 << 10;
  HostWarp state;
  std::vector<char> stacks(32 * kStackBytes);
  struct Entry {
    HostWarp* warp;
    Body* body;
    int grid, warps;
  } entry{&state, &body, grid, threads / 32};
  // makecontext passes ints: the entry's address goes as two halves.
  auto run = +[](unsigned low, unsigned high) {
    const Entry& e = *reinterpret_cast<Entry*>((static_cast<uintptr_t>(high) << 32) | low);
    const int lane = e.warp->lane;
    for (int cta = 0; cta < e.grid; ++cta) {
      for (int warp = 0; warp < e.warps; ++warp) {
        e.warp->thread_idx[lane].x = static_cast<unsigned>(32 * warp + lane);
        blockIdx.x = static_cast<unsigned>(cta);
        (*e.body)();
        HostMeet();
      }
    }
    // Every lane has left its last meeting: each ends by handing on, the last to the launch.
    e.warp->lane = lane + 1;
    if (lane == 31) {
      HostCheckMeetings(*e.warp);
      setcontext(&e.warp->main);
    } else {
      setcontext(&e.warp->fibers[lane + 1]);
    }
  };
  const uintptr_t address = reinterpret_cast<uintptr_t>(&entry);
  for (int lane = 0; lane < 32; ++lane) {
    ucontext_t& fiber = state.fibers[lane];
    getcontext(&fiber);
    fiber.uc_stack.ss_sp = stacks.data() + lane * kStackBytes;
    fiber.uc_stack.ss_size = kStackBytes;
    fiber.uc_link = nullptr;
    makecontext(&fiber, reinterpret_cast<void (*)()>(run), 2, static_cast<unsigned>(address & 0xFFFFFFFFu),
                static_cast<unsigned>(address >> 32));
  }
  HostWarp* outer = host_warp;
  host_warp = &state;
  gridDim.x = static_cast<unsigned>(grid);
  state.lane = 0;
  swapcontext(&state.main, &state.fibers[0]);
  host_warp = outer;
}
