// Whether a stream is being captured into a CUDA graph (XLA recording a
// command buffer): what the handlers that behave differently under capture, or
// count their captures, ask. No XLA types.
#pragma once

#include <cuda_runtime.h>

namespace engram {

inline cudaError_t IsCapturing(cudaStream_t stream, bool* capturing) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  *capturing = status != cudaStreamCaptureStatusNone;
  return err;
}

}  // namespace engram
