// compute-sanitizer's initcheck and a copy in a CUDA graph, with no engram_jax and
// no XLA: a kernel node fills fresh cudaMalloc memory, a memcpy node copies it, a
// kernel node sums the copy; the graph is launched twice. With XLA's command
// buffers on, initcheck reported the source of such a copy (XLA's copy of a
// jnp.unique fusion's output) uninitialised at the graph's launch, where the same
// copy outside a graph was not reported (test_training.py, H100). If the tool
// checks a memcpy node's source when the graph is launched, before the graph's
// kernel node has written it, the first launch reports and the second does not,
// and the stream (no graph) reports nothing:
//
//   nvcc -O2 -o initcheck_graph_copy tools/initcheck_graph_copy.cu
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy          # the graph
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy stream   # no graph
//
// Not yet run on a GPU.
#include <cuda_runtime.h>

#include <cstdio>

constexpr int kValues = 768;  // 3,072 bytes, the size of the copy initcheck reported

__global__ void Fill(int* values, int value) {
  for (int i = threadIdx.x; i < kValues; i += blockDim.x) values[i] = value;
}

__global__ void Sum(const int* values, int* out) {
  if (threadIdx.x != 0) return;
  int total = 0;
  for (int i = 0; i < kValues; ++i) total += values[i];
  *out = total;
}

static bool Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) std::printf("%s: %s\n", what, cudaGetErrorString(err));
  return err == cudaSuccess;
}

// Fill, copy, sum on `stream`: captured into a graph, or run as they are.
static bool Enqueue(cudaStream_t stream, int* filled, int* copied, int* out, int value) {
  Fill<<<1, 256, 0, stream>>>(filled, value);
  if (!Check(cudaGetLastError(), "fill")) return false;
  if (!Check(cudaMemcpyAsync(copied, filled, kValues * sizeof(int), cudaMemcpyDeviceToDevice, stream), "copy")) {
    return false;
  }
  Sum<<<1, 32, 0, stream>>>(copied, out);
  return Check(cudaGetLastError(), "sum");
}

int main(int argc, char** argv) {
  const bool in_graph = argc < 2;
  int* filled = nullptr;
  int* copied = nullptr;
  int* out = nullptr;
  cudaStream_t stream = nullptr;
  if (!Check(cudaMalloc(&filled, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&copied, kValues * sizeof(int)), "malloc") || !Check(cudaMalloc(&out, sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) {
    return 1;
  }
  bool ok = true;
  for (int launch = 1; launch <= 2 && ok; ++launch) {
    if (in_graph) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      ok = Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture") &&
           Enqueue(stream, filled, copied, out, launch) && Check(cudaStreamEndCapture(stream, &graph), "end capture") &&
           Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate") &&
           Check(cudaGraphLaunch(exec, stream), "launch");
      if (exec != nullptr)
        ok = Check(cudaStreamSynchronize(stream), "sync") && Check(cudaGraphExecDestroy(exec), "exec") && ok;
      if (graph != nullptr) ok = Check(cudaGraphDestroy(graph), "graph") && ok;
    } else {
      ok = Enqueue(stream, filled, copied, out, launch);
    }
    int host = 0;
    ok = ok && Check(cudaMemcpyAsync(&host, out, sizeof(int), cudaMemcpyDeviceToHost, stream), "result") &&
         Check(cudaStreamSynchronize(stream), "sync");
    std::printf("%s, launch %d: sum %d (expected %d)\n", in_graph ? "graph" : "stream", launch, host, launch * kValues);
    ok = ok && host == launch * kValues;
  }
  ok = Check(cudaFree(filled), "free") && Check(cudaFree(copied), "free") && Check(cudaFree(out), "free") && ok;
  return ok ? 0 : 1;
}
