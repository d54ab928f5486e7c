// eigh's cuSOLVER batched solver: cusolverDnXsyevBatched (cuSOLVER >= 11.7.1, CUDA 12.6.2), which torch.linalg.eigh
// calls only for n <= 32 (above, it loops over syevd one matrix at a time), between the shared way in and out
// (eigh_prep.h). Q0, when given, is only checked: a direct method gains nothing from a warm start.
//
// The routine comes from the cuSOLVER that torch loaded. torch loads cuSOLVER lazily, with its linear-algebra
// library, under the soname of its CUDA's cuSOLVER; linking torchkern against a cuSOLVER of its own could load a
// second copy from another toolkit. So the symbols are looked up at the first call: in the process, else in the
// already-loaded libcusolver.so.<major> (after one tiny torch.linalg.eigh, which makes torch load it, if it has not
// been loaded yet). A cuSOLVER without the routine (before CUDA 12.6.2) leaves syev_batched_available() false and
// the router on its other solvers.
//
// Nor does it include cuSOLVER's headers: torch's wheels ship the library without them, and a toolkit may lack them
// too (this project's CI toolkit has no cusolverDn.h, cublas_api.h or cusparse.h). The interface used here is a few
// opaque pointers and enums, declared below with the values of cusolver_common.h, cublas_api.h and
// library_types.h.
// Part of linalg's one host translation unit (../ops.cpp includes it): torch's headers are parsed once.
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/eye.h>
#include <ATen/ops/linalg_eigh.h>
#include <c10/cuda/CUDAFunctions.h>
#include <dlfcn.h>

#include <algorithm>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "eigh_prep.h"
#include "eigh_solvers.h"
#include "torchkern/checks.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace eigh {
namespace {

using Status = int;                  // cusolverStatus_t
constexpr Status kSuccess = 0;       // CUSOLVER_STATUS_SUCCESS
using Handle = void*;                // cusolverDnHandle_t
using Params = void*;                // cusolverDnParams_t
constexpr int kEigModeVector = 1;    // cusolverEigMode_t CUSOLVER_EIG_MODE_VECTOR
constexpr int kFillModeLower = 0;    // cublasFillMode_t CUBLAS_FILL_MODE_LOWER
constexpr int kR32F = 0, kR64F = 1;  // cudaDataType CUDA_R_32F, CUDA_R_64F
// The sonames torch's CUDA 13 and CUDA 12 builds load.
constexpr const char* kSonames[] = {"libcusolver.so.12", "libcusolver.so.11"};

using CreateFn = Status (*)(Handle*);
using SetStreamFn = Status (*)(Handle, cudaStream_t);
using CreateParamsFn = Status (*)(Params*);
using BufferSizeFn = Status (*)(Handle, Params, int, int, int64_t, int, const void*, int64_t, int, const void*, int,
                                size_t*, size_t*, int64_t);
using SolveFn = Status (*)(Handle, Params, int, int, int64_t, int, void*, int64_t, int, void*, int, void*, size_t,
                           void*, size_t, int*, int64_t);

struct Api {
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  BufferSizeFn buffer_size = nullptr;
  SolveFn solve = nullptr;
  Params params = nullptr;  // default algorithm choice; read-only once made, shared by every call
};

void* loaded_cusolver() {
  for (const char* soname : kSonames) {
    if (void* lib = dlopen(soname, RTLD_NOW | RTLD_NOLOAD)) return lib;
  }
  return nullptr;
}

void* find_symbol(void* lib, const char* name) {
  if (void* f = dlsym(RTLD_DEFAULT, name)) return f;
  return lib != nullptr ? dlsym(lib, name) : nullptr;
}

const Api& api() {
  static const Api found = [] {
    void* lib = loaded_cusolver();
    if (lib == nullptr) {  // torch has not loaded cuSOLVER yet: one 2 x 2 eigh on the current device makes it
      at::linalg_eigh(at::eye(2, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA)));
      lib = loaded_cusolver();
    }
    Api a;
    a.create = reinterpret_cast<CreateFn>(find_symbol(lib, "cusolverDnCreate"));
    a.set_stream = reinterpret_cast<SetStreamFn>(find_symbol(lib, "cusolverDnSetStream"));
    a.buffer_size = reinterpret_cast<BufferSizeFn>(find_symbol(lib, "cusolverDnXsyevBatched_bufferSize"));
    a.solve = reinterpret_cast<SolveFn>(find_symbol(lib, "cusolverDnXsyevBatched"));
    const auto create_params = reinterpret_cast<CreateParamsFn>(find_symbol(lib, "cusolverDnCreateParams"));
    const bool complete = a.create && a.set_stream && a.buffer_size && a.solve && create_params;
    if (!complete || create_params(&a.params) != kSuccess) return Api{};
    return a;
  }();
  return found;
}

// One handle per thread and device (a handle carries its stream, so threads never share one), made on first use.
Handle handle_for_current_device() {
  TORCHKERN_OP("eigh");
  thread_local std::unordered_map<int, Handle> handles;
  const int device = c10::cuda::current_device();
  auto it = handles.find(device);
  if (it == handles.end()) {
    Handle h = nullptr;
    const Status status = api().create(&h);
    TORCHKERN_CHECK(status == kSuccess, "cusolverDnCreate failed with status ", status);
    it = handles.emplace(device, h).first;
  }
  return it->second;
}

// cuSOLVER's decomposition of X [B, n, n], symmetric, float32 or float64, on the current stream: (w [B, n], the
// eigenvalues as the routine leaves them, V [B, n, n] with the eigenvectors as its rows, info [B] int, nonzero for a
// matrix that did not converge). X, contiguous, is overwritten.
std::tuple<at::Tensor, at::Tensor, at::Tensor> syev_batched(at::Tensor X) {
  TORCHKERN_OP("eigh");
  const Api& a = api();
  const int64_t B = X.size(0), n = X.size(1);
  const int type = X.scalar_type() == at::kDouble ? kR64F : kR32F;
  // Symmetric and row-major: the column-major matrix cuSOLVER reads is the same one; it overwrites it with the
  // eigenvectors as columns of the column-major matrix, i.e. as rows of V.
  at::Tensor V = X.contiguous();
  at::Tensor w = at::empty({B, n}, X.options());
  at::Tensor info = at::empty({B}, X.options().dtype(at::kInt));
  const Handle h = handle_for_current_device();
  a.set_stream(h, current_stream());
  size_t device_bytes = 0, host_bytes = 0;
  Status status = a.buffer_size(h, a.params, kEigModeVector, kFillModeLower, n, type, V.const_data_ptr(), n, type,
                                w.const_data_ptr(), type, &device_bytes, &host_bytes, B);
  TORCHKERN_CHECK(status == kSuccess, "cusolverDnXsyevBatched_bufferSize failed with status ", status);
  // device workspace from the caching allocator, ordered on the current stream like every other tensor here
  at::Tensor work = at::empty({static_cast<int64_t>(std::max<size_t>(device_bytes, 1))},
                              X.options().dtype(at::kByte));
  std::vector<char> host_work(std::max<size_t>(host_bytes, 1));
  status = a.solve(h, a.params, kEigModeVector, kFillModeLower, n, type, V.mutable_data_ptr(), n, type,
                   w.mutable_data_ptr(), type, work.mutable_data_ptr(), device_bytes, host_work.data(), host_bytes,
                   info.mutable_data_ptr<int>(), B);
  TORCHKERN_CHECK(status == kSuccess, "cusolverDnXsyevBatched failed with status ", status);
  return {w, V, info};
}

}  // namespace

bool syev_batched_available() { return api().solve != nullptr; }

// The eigenvalues as the routine leaves them, sorted (finish_sorted); a matrix it reports as not converged comes back
// NaN (never the case for the scaled, symmetrized matrices passed here; the public eigh names it if it ever happens).
Result solve_syev_batched(const at::Tensor& X, const at::Tensor& Q) {
  const Scaled scaled = prep_direct(X, Q, X.scalar_type() == at::kDouble ? at::kDouble : at::kFloat, X.size(1));
  const auto [w_raw, V_rows, info] = syev_batched(scaled.S);
  return finish_sorted(X, scaled, V_rows, w_raw, info);
}

}  // namespace eigh
}  // namespace torchkern
