// A kernel that only waits: tests hold a stream busy with it for a set time (the
// side stream of the asynchronous lookup, to show that nothing waits on it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace engram {

__device__ inline uint64_t GlobalNanoseconds() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__global__ void SpinKernel(uint64_t nanoseconds) {
  const uint64_t start = GlobalNanoseconds();
  while (GlobalNanoseconds() - start < nanoseconds) __nanosleep(1000);
}

inline cudaError_t LaunchSpin(uint64_t nanoseconds, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(nanoseconds);
  return cudaGetLastError();
}

}  // namespace engram
