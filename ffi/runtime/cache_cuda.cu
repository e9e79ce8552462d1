// The CUDA half of the hot-row cache: events that fence a buffer set against
// lookups still reading it, and the private stream refreshes fill on.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "kernels/cache.cuh"
#include "kernels/row_decode.h"
#include "runtime/cache_cuda.h"
#include "runtime/cache_registry.h"
#include "runtime/table_registry.h"

namespace engram {
namespace {

std::string Message(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

// Makes `ordinal` current until Restore(), which puts the caller's device
// back and reports the first error of the switch and the restore.
class DeviceScope {
 public:
  explicit DeviceScope(int32_t ordinal) {
    if ((error_ = cudaGetDevice(&previous_)) != cudaSuccess) {
      what_ = "cudaGetDevice";
      return;
    }
    if ((error_ = cudaSetDevice(ordinal)) != cudaSuccess) {
      what_ = "cudaSetDevice";
      return;  // the current device is unchanged: nothing to restore
    }
    switched_ = true;
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  // Reached without Restore() only while an exception unwinds: that exception
  // is the error being reported, so the restore's own result is not.
  ~DeviceScope() {
    if (switched_) (void)cudaSetDevice(previous_);
  }

  // "" once `ordinal` is current, else why it is not.
  std::string error() const { return error_ == cudaSuccess ? "" : Message(what_, error_); }

  // Restores the caller's device; returns `first` if it is an error (the
  // work's), else the restore's.
  std::string Restore(std::string first) {
    if (!switched_) return first;
    switched_ = false;
    const cudaError_t err = cudaSetDevice(previous_);
    if (first.empty() && err != cudaSuccess) return Message("cudaSetDevice (restoring the caller's device)", err);
    return first;
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t error_ = cudaSuccess;
  const char* what_ = "";
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
std::string CopyCtas(int32_t ordinal, int* ctas) {
  int sms = 0;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal); err != cudaSuccess) {
    return Message("cudaDeviceGetAttribute", err);
  }
  *ctas = sms > 0 ? sms : 32;
  return "";
}

// The fill on the current device, which is `device_ordinal`.
std::string FillOnDevice(const TableEntry& table, int32_t device_ordinal, const int32_t* rows, int64_t count,
                         uint8_t* dst) {
  cudaStream_t stream = nullptr;
  if (std::string error = PrivateStream(device_ordinal, &stream); !error.empty()) return error;
  int ctas = 0;
  if (std::string error = CopyCtas(device_ordinal, &ctas); !error.empty()) return error;
  if (cudaError_t err = LaunchCopyRecords(reinterpret_cast<const uint8_t*>(table.base), table.num_rows, rows, count,
                                          RowStride(table.dim), dst, ctas, stream);
      err != cudaSuccess) {
    return Message("cache fill launch", err);
  }
  const cudaError_t err = cudaStreamSynchronize(stream);
  return err == cudaSuccess ? "" : Message("cache fill", err);
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

std::string DestroyGpuFences(std::vector<GpuFence>* fences) {
  std::string first;  // every event is destroyed even after a failure
  for (GpuFence& fence : *fences) {
    const cudaError_t err = cudaEventDestroy(static_cast<cudaEvent_t>(fence.event));
    if (err != cudaSuccess && first.empty()) first = Message("cudaEventDestroy", err);
  }
  fences->clear();
  return first;
}

std::string FillCacheRecordsCuda(int64_t table_key, int32_t device_ordinal, const int32_t* rows, int64_t count,
                                 uint8_t* dst) {
  // The lease keeps the table registered, so its memory allocated, until the
  // fill has completed: this function waits for the copy before it returns,
  // so a lease taken on the calling thread covers the whole read.
  TableLease lease;
  const auto table = FindTable(table_key, device_ordinal, &lease);
  if (!table) return MissingTableMessage(table_key, device_ordinal);
  if (table->kind == MemoryKind::kHost) {
    return "table " + std::to_string(table_key) + " is in host memory the GPU cannot read (place it as 'pinned')";
  }
  DeviceScope scope(device_ordinal);
  if (std::string error = scope.error(); !error.empty()) return error;
  return scope.Restore(FillOnDevice(*table, device_ordinal, rows, count, dst));
}

std::string UploadCuda(int32_t device_ordinal, void* dst, const void* src, int64_t nbytes) {
  if (nbytes == 0) return "";
  DeviceScope scope(device_ordinal);
  if (std::string error = scope.error(); !error.empty()) return error;
  cudaStream_t stream = nullptr;
  std::string error = PrivateStream(device_ordinal, &stream);
  if (error.empty()) {
    if (cudaError_t err = cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyHostToDevice, stream);
        err != cudaSuccess) {
      error = Message("cudaMemcpyAsync", err);
    } else if ((err = cudaStreamSynchronize(stream)) != cudaSuccess) {
      error = Message("cache upload", err);
    }
  }
  return scope.Restore(std::move(error));
}

}  // namespace engram
