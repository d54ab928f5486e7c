// The block method's sweeps as a loop on the device (eigh_block_method.cu includes this file): the kernel that ends a
// sweep, and launch_sweeps, which repeats the sweeps in a CUDA graph's WHILE node until every matrix has stopped.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "jacobi_tiles.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace eigh {
namespace {  // (one translation unit includes this file)

// Conditional graph nodes (CUDA 12.4): the block method's sweeps loop on the device (launch_sweeps).
#if CUDART_VERSION >= 12040
#define TORCHKERN_DEVICE_LOOP 1
using LoopHandle = cudaGraphConditionalHandle;
#else
using LoopHandle = unsigned long long;
#endif

// Sweep end, one block: a matrix goes on while its off-diagonal norm after the sweep (the sum of its chunks'
// partial sums) exceeds tol ||A||_F. loop[0] counts the sweeps, loop[1] gets the count of matrices that go on;
// with `use_handle` the device loop repeats while one does and fewer than max_sweeps have run.
constexpr int kSweepEndThreads = 256;
__global__ void __launch_bounds__(kSweepEndThreads)
    sweep_end_kernel(const jacobi::tiles::BlockBuffers* __restrict__ buf, int64_t batch, int chunks, int max_sweeps,
                     LoopHandle handle, bool use_handle) {
  int going = 0;
  for (int64_t b = threadIdx.x; b < batch; b += kSweepEndThreads) {
    if (buf->active[b]) {
      double off2 = 0.0;
      for (int c = 0; c < chunks; ++c) off2 += buf->off_partial[b * chunks + c];
      const bool go = off2 > buf->stop2[b];
      buf->active[b] = go;
      going += go;
    }
  }
  __shared__ int scratch[kSweepEndThreads / 32];
  going = block_reduce<kSweepEndThreads>(going, scratch);
  if (threadIdx.x == 0) {
    const int sweeps = ++buf->loop[0];
    buf->loop[1] = going;
#ifdef TORCHKERN_DEVICE_LOOP
    if (use_handle) cudaGraphSetConditional(handle, going > 0 && sweeps < max_sweeps);
#endif
  }
}

// A call's buffers into the device memory its kernels read them from (a launch parameter: no host memory to keep
// alive until a copy runs).
__global__ void set_buffers_kernel(jacobi::tiles::BlockBuffers* dst, const jacobi::tiles::BlockBuffers value) {
  *dst = value;
}

// The block method's sweeps as a loop on the device: a CUDA graph whose WHILE node (a conditional node, CUDA 12.4)
// repeats one sweep while sweep_end_kernel says a matrix goes on, so that the host neither waits for a sweep nor
// learns the count (a host waiting for each sweep would leave the GPU idle while it catches up after the call).
// Instantiating the graph costs milliseconds, so one is kept per (device, stream, B, N), its kernels reading the
// call's buffers from a BlockBuffers struct that each call writes first (the stream orders a call's write after the
// previous call's sweeps); the few least recently used go when more shapes come (destroying one waits for its last
// launch).
constexpr size_t kSweepGraphs = 8;

struct SweepGraph {
  int device;
  cudaStream_t stream;
  int64_t B, N;
  cudaGraphExec_t exec;
  jacobi::tiles::BlockBuffers* buf;  // device memory, from the caching allocator on `stream`
};

// sweep(stream, buf, handle, use_handle) enqueues one sweep reading `buf`. Returns false, having launched nothing,
// where the runtime or the driver has no conditional nodes.
template <class Sweep>
bool launch_sweeps(int64_t B, int64_t N, const jacobi::tiles::BlockBuffers& buffers, cudaStream_t stream,
                   const Sweep& sweep) {
#ifdef TORCHKERN_DEVICE_LOOP
  struct Cache {
    std::mutex mu;
    std::vector<SweepGraph> graphs;  // least recently used first
    bool unsupported = false;
  };
  static auto* cache = new Cache;  // never destroyed: at exit the driver may be gone before it
  const std::lock_guard<std::mutex> lock(cache->mu);  // a call's write and launch stay together
  if (cache->unsupported) return false;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  auto& graphs = cache->graphs;
  auto it = std::find_if(graphs.begin(), graphs.end(), [&](const SweepGraph& g) {
    return g.device == device && g.stream == stream && g.B == B && g.N == N;
  });
  if (it == graphs.end()) {
    struct Owned {  // released on every way out, a capture left open by an exception included
      cudaGraph_t graph = nullptr;
      cudaStream_t capture = nullptr;
      bool capturing = false;
      ~Owned() {
        if (capturing) {
          cudaGraph_t partial = nullptr;
          cudaStreamEndCapture(capture, &partial);
          if (partial != nullptr) cudaGraphDestroy(partial);
        }
        if (graph != nullptr) cudaGraphDestroy(graph);  // the executable graph keeps what it needs
        if (capture != nullptr) cudaStreamDestroy(capture);
      }
    } o;
    LoopHandle handle{};
    cudaGraphNodeParams params{};
    cudaGraphNode_t node = nullptr;
    bool ok = cudaGraphCreate(&o.graph, 0) == cudaSuccess &&
              cudaGraphConditionalHandleCreate(&handle, o.graph, 1, cudaGraphCondAssignDefault) == cudaSuccess;
    if (ok) {
      params.type = cudaGraphNodeTypeConditional;
      params.conditional.handle = handle;
      params.conditional.type = cudaGraphCondTypeWhile;
      params.conditional.size = 1;
#if CUDART_VERSION >= 13000
      ok = cudaGraphAddNode(&node, o.graph, nullptr, nullptr, 0, &params) == cudaSuccess;
#else
      ok = cudaGraphAddNode(&node, o.graph, nullptr, 0, &params) == cudaSuccess;
#endif
    }
    // (allocated before the capture, in which a cudaMalloc is not allowed)
    auto* buf = static_cast<jacobi::tiles::BlockBuffers*>(
        c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(sizeof(jacobi::tiles::BlockBuffers), stream));
    ok = ok && cudaStreamCreateWithFlags(&o.capture, cudaStreamNonBlocking) == cudaSuccess &&
         cudaStreamBeginCaptureToGraph(o.capture, params.conditional.phGraph_out[0], nullptr, nullptr, 0,
                                       cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (!ok) {
      c10::cuda::CUDACachingAllocator::raw_delete(buf);
      (void)cudaGetLastError();  // an unsupported call's error is not the caller's
      cache->unsupported = true;
      return false;
    }
    o.capturing = true;
    try {
      sweep(o.capture, buf, handle, true);
    } catch (...) {
      c10::cuda::CUDACachingAllocator::raw_delete(buf);
      throw;
    }
    cudaGraph_t body = nullptr;
    o.capturing = false;
    cudaGraphExec_t exec = nullptr;
    if (cudaStreamEndCapture(o.capture, &body) != cudaSuccess ||
        cudaGraphInstantiate(&exec, o.graph, 0) != cudaSuccess) {
      c10::cuda::CUDACachingAllocator::raw_delete(buf);
      (void)cudaGetLastError();  // nothing was launched: the host loop takes this call and the next ones
      cache->unsupported = true;
      return false;
    }
    if (graphs.size() == kSweepGraphs) {
      C10_CUDA_CHECK(cudaGraphExecDestroy(graphs.front().exec));
      c10::cuda::CUDACachingAllocator::raw_delete(graphs.front().buf);
      graphs.erase(graphs.begin());
    }
    graphs.push_back({device, stream, B, N, exec, buf});
  } else {
    std::rotate(it, it + 1, graphs.end());  // now the most recently used
  }
  const SweepGraph& g = graphs.back();
  set_buffers_kernel<<<1, 1, 0, stream>>>(g.buf, buffers);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  C10_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
  return true;
#else
  (void)B, (void)N, (void)buffers, (void)stream, (void)sweep;
  return false;
#endif
}

}  // namespace
}  // namespace eigh
}  // namespace torchkern
