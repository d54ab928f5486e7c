// eigh's block method, the host side (the method and its kernels: eigh_block_method.cu): the buffers, the way in and
// out (eigh_prep.h), a warm start's rotation into Q0's basis, and the sweeps, which loop on the device in a CUDA graph
// (launch_sweeps) so that the call returns without waiting for them.
// Part of linalg's one host translation unit (../ops.cpp includes it): torch's headers are parsed once.
#pragma once

#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "eigh_prep.h"
#include "eigh_solvers.h"
#include "launchers.h"
#include "torchkern/launch.h"

#if !defined(TORCHKERN_EIGH_MAX_SWEEPS) || !defined(TORCHKERN_EIGH_BLOCK)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace eigh {
namespace {

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
  BlockBuffers* buf;  // device memory, from the caching allocator on `stream`
};

// Enqueues the sweeps of one call (block_sweep_launch's sweep in a WHILE node) reading `buffers`. Returns false, having
// launched nothing, where the runtime or the driver has no conditional nodes.
bool launch_sweeps(int64_t B, int64_t N, const BlockBuffers& buffers, cudaStream_t stream) {
#if CUDART_VERSION >= 12040  // conditional graph nodes
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
    cudaGraphConditionalHandle handle{};
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
    auto* buf = static_cast<BlockBuffers*>(
        c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(sizeof(BlockBuffers), stream));
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
    const cudaError_t captured = block_sweep_launch({buf, B, static_cast<int>(N), handle, true}, o.capture);
    if (captured != cudaSuccess) {
      c10::cuda::CUDACachingAllocator::raw_delete(buf);
      C10_CUDA_CHECK(captured);
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
  C10_CUDA_CHECK(block_buffers_launch(g.buf, buffers, stream));
  C10_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
  return true;
#else
  (void)B, (void)N, (void)buffers, (void)stream;
  return false;
#endif
}

}  // namespace

// On X (B, n, n) of any float dtype (contiguous), from Q0^T A Q0 with Q (B, n, n; undefined for a cold start). It
// works in float64 on A = 2^-e (X + X^T) / 2 padded to N, with the accumulated rotations W = V^T starting from Q0^T
// (so that they end as (Q0 V')^T: no product on the way out). Float64 results get one orthogonality correction of V.
Result solve_block_method(const at::Tensor& X, const at::Tensor& Q, double tol) {
  const int64_t B = X.size(0), n = X.size(1), b = TORCHKERN_EIGH_BLOCK;
  // N: n padded to whole block pairs, and at least two pairs (the circle method's moves need them)
  const int64_t N = std::max<int64_t>((n + 2 * b - 1) / (2 * b) * (2 * b), 4 * b), nb = N / b, P = nb / 2, G = B * P;
  const auto opt = X.options().dtype(at::kDouble), iopt = X.options().dtype(at::kInt);
  const cudaStream_t stream = current_stream();
  TORCH_CHECK(block_method_fits(), "torchkern.eigh: the block method's subproblems (64 x 64 tiles) need more shared "
              "memory per thread block than this GPU allows");
  // A and the basis W = V^T by position, each with the buffer a round writes (every entry of it).
  at::Tensor W = at::empty({B, N, N}, opt), thr = at::empty({B}, opt), stop2 = at::empty({B}, opt);
  const Scaled scaled = prep_block(X, Q, N, tol, W, thr, stop2);
  const at::Tensor& A = scaled.S;
  at::Tensor A_next = at::empty_like(A), W_next = at::empty_like(W);
  at::Tensor U = at::empty({G, 2 * b, 2 * b}, opt);
  if (Q.defined()) {
    // A <- Q0^T A Q0 on the n x n corner (W holds Q0^T there), the products in float64: float32 ones would
    // follow torch's global TF32 flag (1e-3 accuracy when a training script turns it on), far from the 1e-5
    // residual. The thresholds above are from A's norm, which the rotation keeps.
    at::Tensor corner = A.narrow(1, 0, n).narrow(2, 0, n);
    const at::Tensor Qt = W.narrow(1, 0, n).narrow(2, 0, n);
    const at::Tensor AQ = at::bmm(corner, Qt.transpose(1, 2));
    at::bmm_out(corner, Qt, AQ);
  }
  C10_CUDA_CHECK(block_method_opt_in());  // before a capture, which records launches only
  at::Tensor active = at::ones({B}, iopt);
  at::Tensor off_partial = at::empty({B * (N / kBlockNormRows)}, opt);
  at::Tensor loop = at::zeros({2}, iopt);  // sweeps run, matrices going on (sweep_end_kernel)
  const BlockBuffers buffers{{A.mutable_data_ptr<double>(), A_next.mutable_data_ptr<double>()},
                             {W.mutable_data_ptr<double>(), W_next.mutable_data_ptr<double>()},
                             U.mutable_data_ptr<double>(),
                             thr.const_data_ptr<double>(),
                             stop2.const_data_ptr<double>(),
                             active.mutable_data_ptr<int>(),
                             off_partial.mutable_data_ptr<double>(),
                             loop.mutable_data_ptr<int>()};
  if (!launch_sweeps(B, N, buffers, stream)) {  // no device loop: the host reads the count after each sweep
    at::Tensor buf = at::empty({static_cast<int64_t>(sizeof(buffers))}, X.options().dtype(at::kByte));
    auto* dbuf = reinterpret_cast<BlockBuffers*>(buf.mutable_data_ptr());
    C10_CUDA_CHECK(block_buffers_launch(dbuf, buffers, stream));
    at::Tensor host = at::empty({1}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
    cudaEvent_t event = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    struct EventGuard {
      cudaEvent_t e;
      ~EventGuard() { cudaEventDestroy(e); }
    } event_guard{event};
    for (int s = 0; s < TORCHKERN_EIGH_MAX_SWEEPS; ++s) {
      C10_CUDA_CHECK(block_sweep_launch({dbuf, B, static_cast<int>(N), 0, false}, stream));
      C10_CUDA_CHECK(cudaMemcpyAsync(host.mutable_data_ptr<int>(), loop.const_data_ptr<int>() + 1, sizeof(int),
                                     cudaMemcpyDeviceToHost, stream));
      C10_CUDA_CHECK(cudaEventRecord(event, stream));
      C10_CUDA_CHECK(cudaEventSynchronize(event));
      if (*host.const_data_ptr<int>() == 0) break;
    }
  }
  // The result, in buffers 0: the eigenvalues on A's diagonal, the padding's coordinates (which never rotate: their
  // rows and columns are zero) last.
  auto [w, V] = finish_sorted(X, scaled, W, A.diagonal(0, 1, 2).narrow(1, 0, n));
  // The basis went through hundreds of rounds of products, each adding rounding to V^T V - I (measured: 1e-12 at
  // n = 256, the float64 bar's edge). For float64 results one orthogonality_step squares that error (two products, a
  // few percent of one sweep), leaving the residual as it was (a flagged matrix's NaN stays NaN); rounding to float32
  // adds far more (about 1e-7) than it removes.
  if (X.scalar_type() == at::kDouble) V = orthogonality_step(V);
  return {w, V};
}

}  // namespace eigh
}  // namespace torchkern
