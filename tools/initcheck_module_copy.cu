// compute-sanitizer's initcheck and a copy engine's read of module memory, with no
// engram_jax code: a __device__ variable with an initialiser (as XLA keeps its
// constants) copied into cudaMalloc memory, then read by a kernel. On an H200
// (CUDA 13) the cudaMemcpyAsync copy gives one "Uninitialized __global__ memory
// read" of the destination, the same copy by a kernel none:
//
//   nvcc -O2 -o initcheck_module_copy tools/initcheck_module_copy.cu
//   compute-sanitizer --tool initcheck ./initcheck_module_copy memcpy   # 1 error
//   compute-sanitizer --tool initcheck ./initcheck_module_copy kernel   # 0 errors
//   (or: python tools/sanitize.py --minimal --tools initcheck memcpy kernel)
//
// So apply_gradients_start stages its learning rate with a kernel
// (ffi/kernels/staging.cuh).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

__device__ float module_value = 0.1f;

__global__ void Copy(const float* from, float* to) { *to = *from; }
__global__ void Read(const float* from, float* out) { *out = *from * 2.0f; }

static bool Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) std::printf("%s: %s\n", what, cudaGetErrorString(err));
  return err == cudaSuccess;
}

// Module memory to cudaMalloc memory by cudaMemcpyAsync or by a kernel, then read;
// 0 when the read gave the module value's double.
static int CopyAndRead(bool by_kernel) {
  float* source = nullptr;
  float* staged = nullptr;
  float* out = nullptr;
  if (!Check(cudaGetSymbolAddress(reinterpret_cast<void**>(&source), module_value), "symbol") ||
      !Check(cudaMalloc(&staged, sizeof(float)), "malloc") || !Check(cudaMalloc(&out, sizeof(float)), "malloc")) {
    return 1;
  }
  if (by_kernel) {
    Copy<<<1, 1>>>(source, staged);
    if (!Check(cudaGetLastError(), "copy kernel")) return 1;
  } else if (!Check(cudaMemcpyAsync(staged, source, sizeof(float), cudaMemcpyDeviceToDevice, 0), "memcpy")) {
    return 1;
  }
  Read<<<1, 1>>>(staged, out);
  float host = 0.0f;
  if (!Check(cudaGetLastError(), "read kernel") ||
      !Check(cudaMemcpy(&host, out, sizeof(float), cudaMemcpyDeviceToHost), "result")) {
    return 1;
  }
  std::printf("%s copy: %g (expected 0.2)\n", by_kernel ? "kernel" : "cudaMemcpyAsync", host);
  const bool freed = Check(cudaFree(staged), "free") && Check(cudaFree(out), "free");
  return freed && host == 0.1f * 2.0f ? 0 : 1;
}

// Each mode by name; tools/sanitize.py --minimal reads the names from these lines.
struct Mode {
  const char* name;
  int (*run)();
};
static const Mode kModes[] = {
    {"memcpy", [] { return CopyAndRead(false); }},
    {"kernel", [] { return CopyAndRead(true); }},
};

int main(int argc, char** argv) {
  const char* mode = argc == 2 ? argv[1] : "";
  for (const Mode& known : kModes) {
    if (!std::strcmp(mode, known.name)) return known.run();
  }
  std::printf("usage: initcheck_module_copy MODE, one of:");
  for (const Mode& known : kModes) std::printf(" %s", known.name);
  std::printf("\n");
  return 2;
}
