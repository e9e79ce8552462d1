// A custom call shaped as engram_jax's update, with no engram_jax in it: for
// tools/sanitize_minimal.py's no_library_ffi_step*. The update's call is not
// command-buffer compatible, takes the ids and gradients and returns one uint8
// buffer, a 4-byte token its kernel zeroes and then a workspace the kernel writes
// only in part. With it in a step, initcheck (command buffers on) reported XLA's
// copy of jnp.unique's zeros uninitialised; with jax's io_callback in its place,
// not. This call keeps the update's shape and does no update. With the update's
// result size (no_library_ffi_step_sized) it brings on the same 96 reports (H100);
// with a result of 6,148 bytes (no_library_ffi_step), none:
//
//   nvcc -O2 -shared -Xcompiler -fPIC -arch=sm_90 -I"$(python -c 'import jax;
//     print(jax.ffi.include_dir())')" -o libinitcheck_ffi_workspace.so
//     tools/initcheck_ffi_workspace.cu
//
// (sanitize_minimal.py builds it so, into a temporary folder, and registers
// WorkspaceCall as the target "initcheck_workspace_call" for CUDA.)
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTokenBytes = 4;

// The token zeroed and the ids copied after it, as the update's sort writes its keys
// there: the workspace's rest (as long again) is left unwritten.
__global__ void TokenAndIds(const int32_t* ids, int64_t count, uint8_t* result) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i == 0) *reinterpret_cast<int32_t*>(result) = 0;
  if (i < count) reinterpret_cast<int32_t*>(result + kTokenBytes)[i] = ids[i];
}

ffi::Error WorkspaceCallImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer /*grads*/,
                             ffi::RemainingArgs /*update_operands*/, ffi::Result<ffi::Buffer<ffi::U8>> result) {
  int64_t count = static_cast<int64_t>(ids.element_count());
  if (result->size_bytes() < kTokenBytes + 8 * count) {
    return ffi::Error::InvalidArgument("the result must hold the token and 8 bytes an id");
  }
  int blocks = static_cast<int>((count + 255) / 256) + 1;
  TokenAndIds<<<blocks, 256, 0, stream>>>(ids.typed_data(), count, result->typed_data());
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

// No command-buffer trait: XLA runs it outside its graphs, as it runs the update.
XLA_FFI_DEFINE_HANDLER_SYMBOL(WorkspaceCall, WorkspaceCallImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<ffi::Buffer<ffi::S32>>()              // ids, copied after the token
                                  .Arg<ffi::AnyBuffer>()                     // gradients: read by nothing
                                  .RemainingArgs()  // the learning rate and after= rows, or none: read by nothing
                                  .Ret<ffi::Buffer<ffi::U8>>());  // token, then the workspace
