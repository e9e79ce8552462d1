// compute-sanitizer's initcheck and copies inside CUDA graphs, with no engram_jax and
// no XLA. With XLA's command buffers on, initcheck reported the source of a copy in
// XLA's graph launch uninitialised (3,072 bytes, test_training.py's step test); the
// same program with command buffers off did not. One mode per run:
//
//   nvcc -O2 -o initcheck_graph_copy tools/initcheck_graph_copy.cu -lcuda
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy graph          # 0 errors
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy stream         # 0 errors
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy graph_memset   # 0 errors
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy graph_child    # 0 errors
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy memset_update  # 0 errors
//   (and memcpy_update, memcpy_update_dst, kernel_update: 0 errors each)
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy branches       # 0 errors
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy region         # 0 errors
//   (and region_head: 0 errors)
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy while_body     # 0 errors
//   compute-sanitizer --tool initcheck ./initcheck_graph_copy while_copy     # 96 errors
//   (source_kernel, source_h2d, source_stream and the after_graph modes: compiled,
//   not yet run on a GPU)
//
// or every mode (or those named) under each tool, built for the GPU at hand, a record
// each: `python tools/sanitize.py --minimal --tools initcheck while_copy while_body`.
//
// while_copy is the false report with no XLA in it: a memcpy node inside a while
// node's body copies what the body's kernel wrote, initcheck reports every 32 bytes
// of the copy's 3,072-byte source uninitialised, and the copy and the sum after the
// loop are right (H100, CUDA 13, compute-sanitizer 2025.3.1).
//
// graph / stream: a kernel fills fresh cudaMalloc memory, a memcpy copies it, a kernel
// sums the copy; captured into a graph launched twice, or on a plain stream.
// graph_memset / graph_child: what the copy reads is written in the graph by a memset
// node (XLA makes a broadcast of zeros a memset), or by a kernel inside a child graph
// node, then copied by a memcpy node, then to the host. All four ran clean (H100,
// CUDA 13): none of these is what initcheck flagged in XLA's graph. Nor are the
// *_update modes (below), which all ran clean too.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

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

// Fill, copy, sum twice (the values 1, then 2): captured into a graph each time, or
// run on `stream` as they are; each launch's sum read on the host and checked.
static bool FillCopySumTwice(const char* mode, cudaStream_t stream, int* filled, int* copied, int* out, bool in_graph) {
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
    std::printf("%s, launch %d: sum %d (expected %d)\n", mode, launch, host, launch * kValues);
    ok = ok && host == launch * kValues;
  }
  return ok;
}

static int GraphOrStream(bool in_graph) {
  int* filled = nullptr;
  int* copied = nullptr;
  int* out = nullptr;
  cudaStream_t stream = nullptr;
  if (!Check(cudaMalloc(&filled, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&copied, kValues * sizeof(int)), "malloc") || !Check(cudaMalloc(&out, sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) {
    return 1;
  }
  bool ok = FillCopySumTwice(in_graph ? "graph" : "stream", stream, filled, copied, out, in_graph);
  ok = Check(cudaFree(filled), "free") && Check(cudaFree(copied), "free") && Check(cudaFree(out), "free") && ok;
  return ok ? 0 : 1;
}

// A graph that writes `filled` (a memset node, or a kernel node inside a child graph),
// copies it to `copied` with a memcpy node; launched once, `copied` read on the host.
static int GraphWrites(bool child) {
  int* filled = nullptr;
  int* copied = nullptr;
  cudaStream_t stream = nullptr;
  if (!Check(cudaMalloc(&filled, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&copied, kValues * sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) {
    return 1;
  }
  cudaGraph_t writes = nullptr, graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t write = nullptr, copy = nullptr;
  bool ok = Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  if (ok && child) {
    Fill<<<1, 256, 0, stream>>>(filled, 0x01010101);
    ok = Check(cudaGetLastError(), "fill");
  } else if (ok) {
    ok = Check(cudaMemsetAsync(filled, 1, kValues * sizeof(int), stream), "memset");
  }
  ok = Check(cudaStreamEndCapture(stream, &writes), "end capture") && ok;
  if (child) {
    ok = ok && Check(cudaGraphCreate(&graph, 0), "graph") &&
         Check(cudaGraphAddChildGraphNode(&write, graph, nullptr, 0, writes), "child node");
  } else {
    graph = writes;  // the memset node alone
    size_t count = 1;
    ok = ok && Check(cudaGraphGetNodes(graph, &write, &count), "nodes");
  }
  ok = ok &&
       Check(cudaGraphAddMemcpyNode1D(&copy, graph, &write, 1, copied, filled, kValues * sizeof(int),
                                      cudaMemcpyDeviceToDevice),
             "memcpy node") &&
       Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate") && Check(cudaGraphLaunch(exec, stream), "launch");
  int host[kValues] = {};
  ok = ok && Check(cudaMemcpyAsync(host, copied, sizeof(host), cudaMemcpyDeviceToHost, stream), "result") &&
       Check(cudaStreamSynchronize(stream), "sync");
  bool equal = true;
  for (int v : host) equal = equal && v == 0x01010101;
  std::printf("%s: copy %s\n", child ? "graph_child" : "graph_memset", equal ? "as written" : "DIFFERS");
  if (exec != nullptr) ok = Check(cudaGraphExecDestroy(exec), "exec") && ok;
  if (child && graph != nullptr) ok = Check(cudaGraphDestroy(graph), "graph") && ok;
  if (writes != nullptr) ok = Check(cudaGraphDestroy(writes), "graph") && ok;
  ok = Check(cudaFree(filled), "free") && Check(cudaFree(copied), "free") && ok;
  return ok && equal ? 0 : 1;
}

// XLA records a command buffer once and, when a later run's buffers sit elsewhere,
// points its nodes at them in the instantiated graph (cuGraphExec*NodeSetParams)
// rather than recording it again. Each mode instantiates a graph whose `update`d node
// names a buffer nothing reads or writes, points it at the real one, then launches:
//   memset_update  memset node (4-byte words, as XLA's) into `filled`, then a memcpy
//                  node copies `filled` to `copied`
//   memcpy_update  a kernel node fills `filled`, the memcpy node's source is `filled`
//   memcpy_update_dst  as memcpy_update, the memcpy node's destination is `copied`,
//                  then a kernel on the stream sums `copied`
//   kernel_update  the kernel node fills `filled`, a memcpy node copies it
// Had initcheck kept a node's first parameters, the first mode would report the
// copy's source, the second the copy's source, the third the sum's reads, the
// fourth nothing (kernels' accesses are seen as they run).
constexpr int kUpdateValue = 3;  // the memset node's 4-byte word and the kernel's value
enum class Updated { kMemset, kMemcpySource, kMemcpyDestination, kKernel };

static bool CheckCu(CUresult err, const char* what) {
  const char* text = nullptr;
  if (err != CUDA_SUCCESS) std::printf("%s: %s\n", what, cuGetErrorString(err, &text) == CUDA_SUCCESS ? text : "?");
  return err == CUDA_SUCCESS;
}

static CUDA_MEMCPY3D CopyParams(const int* source, int* destination) {
  CUDA_MEMCPY3D params{};  // as XLA's UpdateMemcpyD2DNode fills it
  params.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  params.srcDevice = reinterpret_cast<CUdeviceptr>(source);
  params.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  params.dstDevice = reinterpret_cast<CUdeviceptr>(destination);
  params.WidthInBytes = kValues * sizeof(int);
  params.Height = 1;
  params.Depth = 1;
  return params;
}

static CUDA_MEMSET_NODE_PARAMS MemsetParams(int* destination) {
  CUDA_MEMSET_NODE_PARAMS params{};  // as XLA's UpdateMemsetNode fills it
  params.dst = reinterpret_cast<CUdeviceptr>(destination);
  params.elementSize = 4;
  params.height = 1;
  params.value = kUpdateValue;
  params.width = kValues;
  return params;
}

static int GraphUpdated(Updated updated) {
  int* filled = nullptr;
  int* copied = nullptr;
  int* unused = nullptr;  // what the updated node names until it is pointed elsewhere
  int* out = nullptr;
  cudaStream_t stream = nullptr;
  CUcontext context = nullptr;
  if (!Check(cudaMalloc(&filled, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&copied, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&unused, kValues * sizeof(int)), "malloc") || !Check(cudaMalloc(&out, sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream") ||
      !CheckCu(cuCtxGetCurrent(&context), "context")) {
    return 1;
  }
  const bool memset_node = updated == Updated::kMemset;
  int* write_first = (memset_node || updated == Updated::kKernel) ? unused : filled;
  const int* copy_source = updated == Updated::kMemcpySource ? unused : filled;
  int* copy_destination = updated == Updated::kMemcpyDestination ? unused : copied;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t write = nullptr, copy = nullptr;
  bool ok = Check(cudaGraphCreate(&graph, 0), "graph");
  const CUDA_MEMSET_NODE_PARAMS memset_first = MemsetParams(write_first);
  int value = kUpdateValue;
  void* fill_args[] = {&write_first, &value};
  cudaKernelNodeParams fill{};
  fill.func = reinterpret_cast<void*>(Fill);
  fill.gridDim = dim3(1);
  fill.blockDim = dim3(256);
  fill.kernelParams = fill_args;
  if (ok && memset_node) {
    ok = CheckCu(cuGraphAddMemsetNode(&write, graph, nullptr, 0, &memset_first, context), "memset node");
  } else if (ok) {
    ok = Check(cudaGraphAddKernelNode(&write, graph, nullptr, 0, &fill), "kernel node");
  }
  const CUDA_MEMCPY3D copy_first = CopyParams(copy_source, copy_destination);
  ok = ok && CheckCu(cuGraphAddMemcpyNode(&copy, graph, &write, 1, &copy_first, context), "memcpy node") &&
       Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  // Point the node at the real buffer, as XLA does before a launch.
  if (ok && memset_node) {
    const CUDA_MEMSET_NODE_PARAMS params = MemsetParams(filled);
    ok = CheckCu(cuGraphExecMemsetNodeSetParams(exec, write, &params, context), "memset update");
  } else if (ok && updated == Updated::kKernel) {
    void* args[] = {&filled, &value};
    fill.kernelParams = args;
    ok = Check(cudaGraphExecKernelNodeSetParams(exec, write, &fill), "kernel update");
  } else if (ok) {
    const CUDA_MEMCPY3D params = CopyParams(filled, copied);
    ok = CheckCu(cuGraphExecMemcpyNodeSetParams(exec, copy, &params, context), "memcpy update");
  }
  ok = ok && Check(cudaGraphLaunch(exec, stream), "launch");
  Sum<<<1, 32, 0, stream>>>(copied, out);
  ok = ok && Check(cudaGetLastError(), "sum");
  int host = 0;
  ok = ok && Check(cudaMemcpyAsync(&host, out, sizeof(int), cudaMemcpyDeviceToHost, stream), "result") &&
       Check(cudaStreamSynchronize(stream), "sync");
  const int expected = value * kValues;
  std::printf("update: sum %d (expected %d)\n", host, expected);
  if (exec != nullptr) ok = Check(cudaGraphExecDestroy(exec), "exec") && ok;
  if (graph != nullptr) ok = Check(cudaGraphDestroy(graph), "graph") && ok;
  ok = Check(cudaFree(filled), "free") && Check(cudaFree(copied), "free") && Check(cudaFree(unused), "free") &&
       Check(cudaFree(out), "free") && ok;
  return ok && host == expected ? 0 : 1;
}

// XLA records a command buffer as one graph whose nodes run on concurrent branches
// where their buffers allow (the stale step's: a fusion of 4 x 128 threads writes
// 512 zeros, a copy node after it copies them; on another branch a one-CTA reduction
// writes a scalar that a later fusion's every thread reads). Mode `branches` builds
// that shape: `filled` written one value a thread over several CTAs, copied by a
// memcpy node that depends on that kernel alone; `count` written on a branch of its
// own; a kernel joining both reads `count` in every thread and the copy. Launched
// twice on fresh memory, its output read on the host. It ran clean too (H100, CUDA 13,
// compute-sanitizer 2025.3.1: both launches as written, 0 errors), so concurrent
// branches alone are not what initcheck flagged in XLA's graph.
__global__ void FillEach(int* values, int value) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < kValues) values[i] = value;
}

constexpr int kCount = 5;  // the scalar WriteCount writes, which ReadBoth adds

__global__ void WriteCount(int* count) {
  if (threadIdx.x == 0) *count = kCount;
}

__global__ void ReadBoth(const int* copied, const int* count, int* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < kValues) out[i] = copied[i] + *count;
}

static int GraphBranches() {
  constexpr int kThreads = 128;
  constexpr int kCtas = (kValues + kThreads - 1) / kThreads;
  int* filled = nullptr;
  int* copied = nullptr;
  int* count = nullptr;
  int* out = nullptr;
  cudaStream_t stream = nullptr;
  if (!Check(cudaMalloc(&filled, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&copied, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&count, sizeof(int)), "malloc") || !Check(cudaMalloc(&out, kValues * sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) {
    return 1;
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t fill = nullptr, counted = nullptr, copy = nullptr, read = nullptr;
  int value = 1;
  void* fill_args[] = {&filled, &value};
  void* count_args[] = {&count};
  void* read_args[] = {&copied, &count, &out};
  cudaKernelNodeParams fill_params{};
  fill_params.func = reinterpret_cast<void*>(FillEach);
  fill_params.gridDim = dim3(kCtas);
  fill_params.blockDim = dim3(kThreads);
  fill_params.kernelParams = fill_args;
  cudaKernelNodeParams count_params{};
  count_params.func = reinterpret_cast<void*>(WriteCount);
  count_params.gridDim = dim3(1);
  count_params.blockDim = dim3(32);
  count_params.kernelParams = count_args;
  cudaKernelNodeParams read_params = fill_params;
  read_params.func = reinterpret_cast<void*>(ReadBoth);
  read_params.kernelParams = read_args;
  bool ok = Check(cudaGraphCreate(&graph, 0), "graph") &&
            Check(cudaGraphAddKernelNode(&fill, graph, nullptr, 0, &fill_params), "fill node") &&
            Check(cudaGraphAddKernelNode(&counted, graph, nullptr, 0, &count_params), "count node") &&
            Check(cudaGraphAddMemcpyNode1D(&copy, graph, &fill, 1, copied, filled, kValues * sizeof(int),
                                           cudaMemcpyDeviceToDevice),
                  "memcpy node");
  const cudaGraphNode_t joined[] = {copy, counted};
  ok = ok && Check(cudaGraphAddKernelNode(&read, graph, joined, 2, &read_params), "read node") &&
       Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  bool equal = ok;
  for (int launch = 1; launch <= 2 && ok; ++launch) {
    static int host[kValues];
    ok = Check(cudaGraphLaunch(exec, stream), "launch") &&
         Check(cudaMemcpyAsync(host, out, sizeof(host), cudaMemcpyDeviceToHost, stream), "result") &&
         Check(cudaStreamSynchronize(stream), "sync");
    for (int v : host) equal = equal && v == value + kCount;
    std::printf("branches, launch %d: %s\n", launch, equal ? "as written" : "DIFFERS");
  }
  if (exec != nullptr) ok = Check(cudaGraphExecDestroy(exec), "exec") && ok;
  if (graph != nullptr) ok = Check(cudaGraphDestroy(graph), "graph") && ok;
  ok = Check(cudaStreamDestroy(stream), "stream") && Check(cudaFree(filled), "free") &&
       Check(cudaFree(copied), "free") && Check(cudaFree(count), "free") && Check(cudaFree(out), "free") && ok;
  return ok && equal ? 0 : 1;
}

// XLA's buffers are slices of one temporary allocation. In the step programs that
// initcheck flagged (tools/sanitize_minimal.py trainable_step, and
// no_library_ffi_step_sized with no engram_jax), XLA's dump places jnp.unique's zeros
// (3,072 bytes, written by a fusion in the graph, then copied by a memcpy node) at
// offset 51,200 of a 150,048-byte allocation, inside the bytes a custom call's
// 148,752-byte result took before the graph, which its kernel wrote only the first
// 3,076 of. Modes `region` and `region_head` build that with no XLA: one cudaMalloc
// region, a graph whose kernel fills the 768 values at that offset, a memcpy node
// copying them to offset 57,344 (as XLA's copy), a kernel summing the copy; with
// `region_head`, a kernel outside the graph first writes the region's first 3,076
// bytes, as the custom call did. Both ran clean (H100, CUDA 13, compute-sanitizer
// 2025.3.1): that layout alone, without XLA, does not bring the reports on.
constexpr size_t kRegionBytes = 150048;  // XLA's temporary allocation in those programs
constexpr size_t kFilledOffset = 51200;  // jnp.unique's zeros there
constexpr size_t kCopiedOffset = 57344;  // XLA's copy of them
constexpr size_t kHeadBytes = 3076;      // the token and the ids the custom call wrote

__global__ void WriteHead(unsigned char* region) {
  for (size_t i = threadIdx.x; i < kHeadBytes; i += blockDim.x) region[i] = static_cast<unsigned char>(i);
}

static int Region(bool written_head) {
  unsigned char* region = nullptr;
  int* out = nullptr;
  cudaStream_t stream = nullptr;
  if (!Check(cudaMalloc(&region, kRegionBytes), "malloc") || !Check(cudaMalloc(&out, sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) {
    return 1;
  }
  int* filled = reinterpret_cast<int*>(region + kFilledOffset);
  int* copied = reinterpret_cast<int*>(region + kCopiedOffset);
  bool ok = true;
  if (written_head) {
    WriteHead<<<1, 256, 0, stream>>>(region);
    ok = Check(cudaGetLastError(), "head");
  }
  ok = ok && FillCopySumTwice(written_head ? "region_head" : "region", stream, filled, copied, out, true);
  ok = Check(cudaStreamDestroy(stream), "stream") && Check(cudaFree(region), "free") && Check(cudaFree(out), "free") &&
       ok;
  return ok ? 0 : 1;
}

// XLA records a while loop (jnp.isin's searchsorted scan in test_train_example.py's
// exact_split step) as a conditional node of its graph, its body a graph of its own,
// with the body's copies as memcpy nodes. Modes `while_body` and `while_copy` build
// such a loop with no XLA: a while node whose body kernel writes 768 values (1 on the
// first of kIterations passes, one more each pass after, reading the last pass's
// values) and counts the passes down; with `while_copy` a memcpy node in the body
// copies the values after the kernel. After the loop a kernel sums the values (or the
// copy); launched once on fresh memory, the sum read on the host. (The exact_split
// step's reports kept their count with XLA's loops out of its graphs: the loops are
// not their condition; `while_copy` is where the copy-source report shows in CUDA.)
constexpr int kIterations = 3;

__global__ void CountedPass(int* values, int* remaining, cudaGraphConditionalHandle loop) {
  const int left = *remaining;
  for (int i = threadIdx.x; i < kValues; i += blockDim.x) values[i] = left == kIterations ? 1 : values[i] + 1;
  __syncthreads();  // every thread has read `remaining` before it changes
  if (threadIdx.x == 0) {
    *remaining = left - 1;
    cudaGraphSetConditional(loop, left > 1 ? 1u : 0u);
  }
}

static int WhileBody(bool copy_in_body) {
  const char* mode = copy_in_body ? "while_copy" : "while_body";
  int* values = nullptr;
  int* copied = nullptr;
  int* remaining = nullptr;
  int* out = nullptr;
  cudaStream_t stream = nullptr;
  if (!Check(cudaMalloc(&values, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&copied, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&remaining, sizeof(int)), "malloc") || !Check(cudaMalloc(&out, sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) {
    return 1;
  }
  const int passes = kIterations;
  bool ok = Check(cudaMemcpy(remaining, &passes, sizeof(int), cudaMemcpyHostToDevice), "count");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphConditionalHandle loop{};
  cudaGraphNodeParams loop_params{};
  cudaGraphNode_t loop_node = nullptr, pass_node = nullptr, copy_node = nullptr, sum_node = nullptr;
  ok = ok && Check(cudaGraphCreate(&graph, 0), "graph") &&
       Check(cudaGraphConditionalHandleCreate(&loop, graph, 1, cudaGraphCondAssignDefault), "handle");
  if (ok) {
    loop_params.type = cudaGraphNodeTypeConditional;
    loop_params.conditional.handle = loop;
    loop_params.conditional.type = cudaGraphCondTypeWhile;
    loop_params.conditional.size = 1;
    ok = Check(cudaGraphAddNode(&loop_node, graph, nullptr, nullptr, 0, &loop_params), "while node");
  }
  void* pass_args[] = {&values, &remaining, &loop};
  cudaKernelNodeParams pass{};
  pass.func = reinterpret_cast<void*>(CountedPass);
  pass.gridDim = dim3(1);
  pass.blockDim = dim3(256);
  pass.kernelParams = pass_args;
  cudaGraph_t body = ok ? loop_params.conditional.phGraph_out[0] : nullptr;
  ok = ok && Check(cudaGraphAddKernelNode(&pass_node, body, nullptr, 0, &pass), "pass node");
  if (ok && copy_in_body) {
    ok = Check(cudaGraphAddMemcpyNode1D(&copy_node, body, &pass_node, 1, copied, values, kValues * sizeof(int),
                                        cudaMemcpyDeviceToDevice),
               "memcpy node");
  }
  int* summed = copy_in_body ? copied : values;
  void* sum_args[] = {&summed, &out};
  cudaKernelNodeParams sum{};
  sum.func = reinterpret_cast<void*>(Sum);
  sum.gridDim = dim3(1);
  sum.blockDim = dim3(32);
  sum.kernelParams = sum_args;
  ok = ok && Check(cudaGraphAddKernelNode(&sum_node, graph, &loop_node, 1, &sum), "sum node") &&
       Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate") && Check(cudaGraphLaunch(exec, stream), "launch");
  int host = 0;
  ok = ok && Check(cudaMemcpyAsync(&host, out, sizeof(int), cudaMemcpyDeviceToHost, stream), "result") &&
       Check(cudaStreamSynchronize(stream), "sync");
  std::printf("%s: sum %d (expected %d)\n", mode, host, kIterations * kValues);
  ok = ok && host == kIterations * kValues;
  if (exec != nullptr) ok = Check(cudaGraphExecDestroy(exec), "exec") && ok;
  if (graph != nullptr) ok = Check(cudaGraphDestroy(graph), "graph") && ok;
  ok = Check(cudaStreamDestroy(stream), "stream") && Check(cudaFree(values), "free") &&
       Check(cudaFree(copied), "free") && Check(cudaFree(remaining), "free") && Check(cudaFree(out), "free") && ok;
  return ok ? 0 : 1;
}

// In XLA's step graphs the copies' sources are often written before the graph: the
// step's inputs (a host-to-device transfer, or a kernel of the step before) and the
// library's custom calls on another stream. Modes `source_kernel`, `source_h2d` and
// `source_stream` write `filled` before the launch with a kernel on the launch's
// stream, with a host-to-device cudaMemcpyAsync, or with a kernel on another stream
// that the launch's stream waits for by an event; then a graph of a memcpy node
// (`filled` to `copied`) and a kernel node summing `copied` runs once.
enum class Source { kKernel, kHostCopy, kOtherStream };

static int SourceBeforeGraph(Source source, const char* mode) {
  int* filled = nullptr;
  int* copied = nullptr;
  int* out = nullptr;
  cudaStream_t stream = nullptr, other = nullptr;
  cudaEvent_t written = nullptr;
  if (!Check(cudaMalloc(&filled, kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&copied, kValues * sizeof(int)), "malloc") || !Check(cudaMalloc(&out, sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream") ||
      !Check(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), "stream") ||
      !Check(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), "event")) {
    return 1;
  }
  static int host_values[kValues];
  for (int& v : host_values) v = 1;
  bool ok = true;
  if (source == Source::kKernel) {
    Fill<<<1, 256, 0, stream>>>(filled, 1);
    ok = Check(cudaGetLastError(), "fill");
  } else if (source == Source::kHostCopy) {
    ok = Check(cudaMemcpyAsync(filled, host_values, sizeof(host_values), cudaMemcpyHostToDevice, stream), "h2d");
  } else {
    Fill<<<1, 256, 0, other>>>(filled, 1);
    ok = Check(cudaGetLastError(), "fill") && Check(cudaEventRecord(written, other), "record") &&
         Check(cudaStreamWaitEvent(stream, written, 0), "wait");
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ok = ok && Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  if (ok) {
    ok = Check(cudaMemcpyAsync(copied, filled, kValues * sizeof(int), cudaMemcpyDeviceToDevice, stream), "copy");
    Sum<<<1, 32, 0, stream>>>(copied, out);
    ok = Check(cudaGetLastError(), "sum") && ok;
    ok = Check(cudaStreamEndCapture(stream, &graph), "end capture") && ok;
  }
  ok = ok && Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate") &&
       Check(cudaGraphLaunch(exec, stream), "launch");
  int host = 0;
  ok = ok && Check(cudaMemcpyAsync(&host, out, sizeof(int), cudaMemcpyDeviceToHost, stream), "result") &&
       Check(cudaStreamSynchronize(stream), "sync");
  std::printf("%s: sum %d (expected %d)\n", mode, host, kValues);
  ok = ok && host == kValues;
  if (exec != nullptr) ok = Check(cudaGraphExecDestroy(exec), "exec") && ok;
  if (graph != nullptr) ok = Check(cudaGraphDestroy(graph), "graph") && ok;
  ok = Check(cudaEventDestroy(written), "event") && Check(cudaStreamDestroy(stream), "stream") &&
       Check(cudaStreamDestroy(other), "stream") && Check(cudaFree(filled), "free") &&
       Check(cudaFree(copied), "free") && Check(cudaFree(out), "free") && ok;
  return ok ? 0 : 1;
}

// The library's StageKernel reads ids that a fusion in the previous program's graph
// wrote (test_train_example.py's exact_split step: 736 reports, values right). Modes
// `after_graph*` build that with no XLA: a graph of one kernel node writing a buffer,
// then a plain kernel outside any graph summing it. XLA records a program's graph once
// and points its nodes at each run's output buffers before launching it again, and
// does not wait for the device between programs, so each mode launches the graph
// kReruns times back to back, the host waiting only after the last sum:
//   after_graph          the kernel node as captured, every run into the same buffer
//   after_graph_stream   as after_graph, each sum on another stream after an event
//   after_graph_updated  the node pointed at a fresh cudaMalloc buffer each run
//   after_graph_pool     as after_graph_updated, buffers from the stream-ordered pool
//                        (cudaMallocAsync, freed in stream order after their sum, so
//                        the next run may get the same memory), as the library's
//                        staging is
//   after_graph_enabled  as after_graph, the node switched off and on again before
//                        each launch (cudaGraphNodeSetEnabled, with which XLA's
//                        command buffers skip commands), in case the tool stops
//                        watching a node's writes once it has been off
constexpr int kReruns = 3;
enum class After { kSame, kOtherStream, kUpdated, kPool, kReenabled };

static int AfterGraph(After after, const char* mode) {
  const bool fresh = after == After::kUpdated || after == After::kPool;
  int* buffers[kReruns + 1] = {};
  int* sums = nullptr;
  cudaStream_t stream = nullptr, other = nullptr;
  cudaEvent_t written = nullptr;
  if (!Check(cudaMalloc(&buffers[0], kValues * sizeof(int)), "malloc") ||
      !Check(cudaMalloc(&sums, kReruns * sizeof(int)), "malloc") ||
      !Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream") ||
      !Check(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), "stream") ||
      !Check(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), "event")) {
    return 1;
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t write = nullptr;
  int values[kReruns + 1] = {};
  void* fill_args[] = {&buffers[0], &values[0]};
  cudaKernelNodeParams fill{};
  fill.func = reinterpret_cast<void*>(FillEach);
  fill.gridDim = dim3((kValues + 127) / 128);
  fill.blockDim = dim3(128);
  fill.kernelParams = fill_args;
  bool ok = Check(cudaGraphCreate(&graph, 0), "graph") &&
            Check(cudaGraphAddKernelNode(&write, graph, nullptr, 0, &fill), "kernel node") &&
            Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int run = 1; run <= kReruns && ok; ++run) {
    int*& buffer = buffers[fresh ? run : 0];
    if (after == After::kUpdated) ok = Check(cudaMalloc(&buffer, kValues * sizeof(int)), "malloc");
    if (after == After::kPool) ok = Check(cudaMallocAsync(&buffer, kValues * sizeof(int), stream), "malloc async");
    values[run] = run;
    void* args[] = {&buffer, &values[run]};
    fill.kernelParams = args;
    ok = ok && Check(cudaGraphExecKernelNodeSetParams(exec, write, &fill), "kernel update");
    if (ok && after == After::kReenabled) {
      ok = Check(cudaGraphNodeSetEnabled(exec, write, 0), "disable") &&
           Check(cudaGraphNodeSetEnabled(exec, write, 1), "enable");
    }
    ok = ok && Check(cudaGraphLaunch(exec, stream), "launch");
    cudaStream_t reader = after == After::kOtherStream ? other : stream;
    if (ok && reader != stream) {
      ok = Check(cudaEventRecord(written, stream), "record") && Check(cudaStreamWaitEvent(reader, written, 0), "wait");
    }
    if (ok) {
      Sum<<<1, 32, 0, reader>>>(buffer, sums + run - 1);
      ok = Check(cudaGetLastError(), "sum");
    }
    if (ok && reader != stream) {  // the next run's write waits for this sum
      ok = Check(cudaEventRecord(written, reader), "record") && Check(cudaStreamWaitEvent(stream, written, 0), "wait");
    }
    if (ok && after == After::kPool) ok = Check(cudaFreeAsync(buffer, stream), "free async");
  }
  int host[kReruns] = {};
  ok = ok && Check(cudaDeviceSynchronize(), "sync") &&
       Check(cudaMemcpy(host, sums, sizeof(host), cudaMemcpyDeviceToHost), "result");
  for (int run = 1; run <= kReruns; ++run) {
    std::printf("%s, run %d: sum %d (expected %d)\n", mode, run, host[run - 1], run * kValues);
    ok = ok && host[run - 1] == run * kValues;
  }
  if (exec != nullptr) ok = Check(cudaGraphExecDestroy(exec), "exec") && ok;
  if (graph != nullptr) ok = Check(cudaGraphDestroy(graph), "graph") && ok;
  for (int i = 0; i <= (after == After::kUpdated ? kReruns : 0); ++i) ok = Check(cudaFree(buffers[i]), "free") && ok;
  ok = Check(cudaEventDestroy(written), "event") && Check(cudaStreamDestroy(stream), "stream") &&
       Check(cudaStreamDestroy(other), "stream") && Check(cudaFree(sums), "free") && ok;
  return ok ? 0 : 1;
}

// Each mode by name. tools/sanitize.py --minimal reads the names from these lines
// (`{"name", [] {`), one a line, and runs each mode under the tools.
struct Mode {
  const char* name;
  int (*run)();
};
static const Mode kModes[] = {
    {"graph", [] { return GraphOrStream(true); }},
    {"stream", [] { return GraphOrStream(false); }},
    {"graph_memset", [] { return GraphWrites(false); }},
    {"graph_child", [] { return GraphWrites(true); }},
    {"memset_update", [] { return GraphUpdated(Updated::kMemset); }},
    {"memcpy_update", [] { return GraphUpdated(Updated::kMemcpySource); }},
    {"memcpy_update_dst", [] { return GraphUpdated(Updated::kMemcpyDestination); }},
    {"kernel_update", [] { return GraphUpdated(Updated::kKernel); }},
    {"branches", [] { return GraphBranches(); }},
    {"region", [] { return Region(false); }},
    {"region_head", [] { return Region(true); }},
    {"while_body", [] { return WhileBody(false); }},
    {"while_copy", [] { return WhileBody(true); }},
    {"source_kernel", [] { return SourceBeforeGraph(Source::kKernel, "source_kernel"); }},
    {"source_h2d", [] { return SourceBeforeGraph(Source::kHostCopy, "source_h2d"); }},
    {"source_stream", [] { return SourceBeforeGraph(Source::kOtherStream, "source_stream"); }},
    {"after_graph", [] { return AfterGraph(After::kSame, "after_graph"); }},
    {"after_graph_stream", [] { return AfterGraph(After::kOtherStream, "after_graph_stream"); }},
    {"after_graph_updated", [] { return AfterGraph(After::kUpdated, "after_graph_updated"); }},
    {"after_graph_pool", [] { return AfterGraph(After::kPool, "after_graph_pool"); }},
    {"after_graph_enabled", [] { return AfterGraph(After::kReenabled, "after_graph_enabled"); }},
};

int main(int argc, char** argv) {
  const char* mode = argc == 2 ? argv[1] : "";
  for (const Mode& known : kModes) {
    if (!std::strcmp(mode, known.name)) return known.run();
  }
  std::printf("usage: initcheck_graph_copy MODE, one of:");
  for (const Mode& known : kModes) std::printf(" %s", known.name);
  std::printf("\n");
  return 2;
}
