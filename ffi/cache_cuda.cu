// The CUDA half of the hot-row cache: events that fence a buffer set against
// lookups still reading it, and the private stream refreshes fill on.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>

#include "cache_cuda.h"
#include "cache_registry.h"
#include "kernels/cache.cuh"
#include "kernels/row_decode.h"
#include "table_registry.h"

namespace engram {
namespace {

std::string Message(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

// Makes `ordinal` current for the scope, restoring the caller's device.
class DeviceScope {
 public:
  explicit DeviceScope(int32_t ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    error_ = cudaSetDevice(ordinal);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// One non-blocking stream per device for cache fills, created on first use
// and kept for the life of the process.
std::string PrivateStream(int32_t ordinal, cudaStream_t* stream) {
  static std::mutex mu;
  static auto* streams = new std::map<int32_t, cudaStream_t>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams->find(ordinal);
  if (it != streams->end()) {
    *stream = it->second;
    return "";
  }
  cudaStream_t created = nullptr;
  if (cudaError_t err = cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking); err != cudaSuccess) {
    return Message("cudaStreamCreateWithFlags", err);
  }
  (*streams)[ordinal] = created;
  *stream = created;
  return "";
}

// One CTA per SM: enough loads in flight to keep the link busy (8 CTAs
// already saturate it for random rows), few warps taken from the model.
int CopyCtas(int32_t ordinal) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess || sms <= 0) sms = 32;
  return sms;
}

}  // namespace

std::string RecordGpuFence(std::vector<GpuFence>* fences, void* stream) {
  for (GpuFence& fence : *fences) {
    if (fence.stream == stream) {
      cudaError_t err = cudaEventRecord(static_cast<cudaEvent_t>(fence.event), static_cast<cudaStream_t>(stream));
      return err == cudaSuccess ? "" : Message("cudaEventRecord", err);
    }
  }
  cudaEvent_t event = nullptr;
  if (cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); err != cudaSuccess) {
    return Message("cudaEventCreateWithFlags", err);
  }
  fences->push_back({stream, event});
  cudaError_t err = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? "" : Message("cudaEventRecord", err);
}

std::string WaitGpuFences(const std::vector<GpuFence>& fences) {
  for (const GpuFence& fence : fences) {
    if (cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(fence.event)); err != cudaSuccess) {
      return Message("cudaEventSynchronize", err);
    }
  }
  return "";
}

void DestroyGpuFences(std::vector<GpuFence>* fences) {
  for (GpuFence& fence : *fences) cudaEventDestroy(static_cast<cudaEvent_t>(fence.event));
  fences->clear();
}

std::string FillCacheRecordsCuda(int64_t table_key, int32_t device_ordinal, const int32_t* rows, int64_t count,
                                 uint8_t* dst) {
  const auto table = FindTable(table_key, device_ordinal);
  if (!table) return MissingTableMessage(table_key, device_ordinal);
  if (table->kind == MemoryKind::kHost) {
    return "table " + std::to_string(table_key) + " is in host memory the GPU cannot read (place it as 'pinned')";
  }
  DeviceScope scope(device_ordinal);
  if (scope.error() != cudaSuccess) return Message("cudaSetDevice", scope.error());
  cudaStream_t stream = nullptr;
  if (std::string error = PrivateStream(device_ordinal, &stream); !error.empty()) return error;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(table->base);
  if (cudaError_t err =
          LaunchCopyRecords(base, rows, count, RowStride(table->dim), dst, CopyCtas(device_ordinal), stream);
      err != cudaSuccess) {
    return Message("cache fill launch", err);
  }
  cudaError_t err = cudaStreamSynchronize(stream);
  return err == cudaSuccess ? "" : Message("cache fill", err);
}

std::string UploadCuda(int32_t device_ordinal, void* dst, const void* src, int64_t nbytes) {
  if (nbytes == 0) return "";
  DeviceScope scope(device_ordinal);
  if (scope.error() != cudaSuccess) return Message("cudaSetDevice", scope.error());
  cudaStream_t stream = nullptr;
  if (std::string error = PrivateStream(device_ordinal, &stream); !error.empty()) return error;
  if (cudaError_t err = cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyHostToDevice, stream);
      err != cudaSuccess) {
    return Message("cudaMemcpyAsync", err);
  }
  cudaError_t err = cudaStreamSynchronize(stream);
  return err == cudaSuccess ? "" : Message("cache upload", err);
}

}  // namespace engram
