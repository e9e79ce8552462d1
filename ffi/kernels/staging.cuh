// The two ends of an asynchronous lookup's staging, as kernels on XLA's stream:
// StageKernel copies the ids (and an update's learning rate) into the call
// site's own buffer and publishes the site's descriptor and the ticket;
// FinishKernel copies the staged rows (or packed records) into done's output
// once the gather is waited for. No XLA types.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace engram {

// What a ticket may read: one entry per live call site in a per-device table.
// A site's entry is rewritten by every start of that site, and zeroed before
// its staging is freed, so a ticket never leads to memory it does not own.
struct SiteDescriptor {
  uint64_t rows = 0;        // address of the staged bf16 rows or packed records; 0: no staging
  uint64_t bytes = 0;       // their size
  uint64_t generation = 0;  // the start that last staged them, process-wide unique
  uint64_t unused = 0;
};

// The ticket is start's output and done's operand, an XLA value: whatever
// buffer XLA gives it, done reads the same four words.
constexpr int kTicketWords = 4;  // uint32: site, 0, generation low, generation high

// What done returns for a ticket whose staging another start rewrote: bf16
// quiet NaNs for rows; for packed records, fp8 NaN bytes and NaN scales, which
// decode to NaN rows.
constexpr uint32_t kPoisonPair = 0x7FC07FC0u;
constexpr uint32_t kPoisonRecordWord = 0xFFFFFFFFu;

struct StageArgs {
  const int32_t* ids;   // XLA's operand, read only inside this kernel
  int32_t* staged_ids;  // the site's copy, read by the gather afterwards
  int64_t num_ids;
  uint32_t* ticket;             // XLA's result
  int64_t ticket_words;         // a multiple of kTicketWords under vmap
  SiteDescriptor* descriptors;  // the device's table
  uint32_t site;
  SiteDescriptor descriptor;  // this start's entry
  // apply_gradients_start's learning rate: XLA's scalar and the site's copy of it
  // (nullptr for a lookup). A kernel copies it rather than a cudaMemcpyAsync of
  // 4 bytes: one launch fewer, and compute-sanitizer's initcheck does not see a
  // copy engine's read of an XLA constant (module memory) as initialising its
  // destination, so every update kernel's read of it was reported.
  const float* scalar = nullptr;
  float* staged_scalar = nullptr;
};

static __global__ void StageKernel(StageArgs a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < a.num_ids; i += stride) a.staged_ids[i] = a.ids[i];
  const uint32_t words[kTicketWords] = {a.site, 0u, static_cast<uint32_t>(a.descriptor.generation),
                                        static_cast<uint32_t>(a.descriptor.generation >> 32)};
  for (int64_t i = first; i < a.ticket_words; i += stride) a.ticket[i] = words[i % kTicketWords];
  if (first == 0) {
    a.descriptors[a.site] = a.descriptor;
    if (a.scalar != nullptr) *a.staged_scalar = *a.scalar;
  }
}

static inline cudaError_t LaunchStage(const StageArgs& a, cudaStream_t stream) {
  const int64_t work = a.num_ids > a.ticket_words ? a.num_ids : a.ticket_words;
  const int64_t wanted = (work + 255) / 256;
  const int blocks = static_cast<int>(wanted < 1 ? 1 : (wanted > 512 ? 512 : wanted));
  StageKernel<<<blocks, 256, 0, stream>>>(a);
  return cudaGetLastError();
}

// Copies the staged bytes of the ticket's site into `out` (16-byte words, then
// any tail: packed records need not fill whole words), or fills `out` with the
// `poison` word when the ticket is not the site's latest start (a handle kept
// past a later start of its call site) or names no staging of this size.
static __global__ void FinishKernel(const uint32_t* ticket, const SiteDescriptor* descriptors, uint32_t num_sites,
                                    uint4* out, int64_t bytes, uint32_t poison_word) {
  __shared__ const uint4* source;
  if (threadIdx.x == 0) {
    const uint32_t site = ticket[0];
    const uint64_t generation = ticket[2] | static_cast<uint64_t>(ticket[3]) << 32;
    source = nullptr;
    if (site < num_sites) {
      const SiteDescriptor d = descriptors[site];
      if (d.rows != 0 && d.generation == generation && d.bytes == static_cast<uint64_t>(bytes)) {
        source = reinterpret_cast<const uint4*>(d.rows);
      }
    }
  }
  __syncthreads();
  const int64_t words = bytes / 16;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const uint4 poison = make_uint4(poison_word, poison_word, poison_word, poison_word);
  for (int64_t i = first; i < words; i += stride) {
    out[i] = source != nullptr ? source[i] : poison;
  }
  if (first < bytes - words * 16) {  // under 16 bytes, each to its own thread
    reinterpret_cast<uint8_t*>(out + words)[first] = source != nullptr
                                                         ? reinterpret_cast<const uint8_t*>(source + words)[first]
                                                         : static_cast<uint8_t>(poison_word >> (8 * (first % 4)));
  }
}

// `ctas`: the device's SM count times a few, enough to run at HBM speed.
static inline cudaError_t LaunchFinish(const uint32_t* ticket, const SiteDescriptor* descriptors, uint32_t num_sites,
                                       void* out, int64_t bytes, uint32_t poison_word, int ctas, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  const int64_t wanted = (bytes / 16 + 255) / 256;
  const int blocks = static_cast<int>(wanted < ctas ? (wanted < 1 ? 1 : wanted) : ctas);
  FinishKernel<<<blocks, 256, 0, stream>>>(ticket, descriptors, num_sites, static_cast<uint4*>(out), bytes,
                                           poison_word);
  return cudaGetLastError();
}

}  // namespace engram
