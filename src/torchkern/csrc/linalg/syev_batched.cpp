// cusolverDnXsyevBatched through the cuSOLVER that torch loaded (see syev_batched.h).
//
// torch loads cuSOLVER lazily, with its linear-algebra library, under the soname of its CUDA's cuSOLVER; linking
// torchkern against a cuSOLVER of its own could load a second copy from another toolkit. So the symbols are looked
// up at the first call: in the process, else in the already-loaded libcusolver.so.<major> (after one tiny
// torch.linalg.eigh, which makes torch load it, if it has not been loaded yet). A cuSOLVER without the routine
// (before CUDA 12.6.2) leaves syev_batched_available() false and eigh.cu on its other paths.
#include "syev_batched.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/eye.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/linalg_eigh.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/where.h>
#include <c10/cuda/CUDAGuard.h>
#include <cusolverDn.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_map>
#include <vector>

#include "torchkern/checks.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace {

using CreateFn = cusolverStatus_t (*)(cusolverDnHandle_t*);
using SetStreamFn = cusolverStatus_t (*)(cusolverDnHandle_t, cudaStream_t);
using CreateParamsFn = cusolverStatus_t (*)(cusolverDnParams_t*);
using BufferSizeFn = cusolverStatus_t (*)(cusolverDnHandle_t, cusolverDnParams_t, cusolverEigMode_t,
                                          cublasFillMode_t, int64_t, cudaDataType, const void*, int64_t,
                                          cudaDataType, const void*, cudaDataType, size_t*, size_t*, int64_t);
using SolveFn = cusolverStatus_t (*)(cusolverDnHandle_t, cusolverDnParams_t, cusolverEigMode_t, cublasFillMode_t,
                                     int64_t, cudaDataType, void*, int64_t, cudaDataType, void*, cudaDataType, void*,
                                     size_t, void*, size_t, int*, int64_t);

struct Api {
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  BufferSizeFn buffer_size = nullptr;
  SolveFn solve = nullptr;
  cusolverDnParams_t params = nullptr;  // default algorithm choice; read-only once made, shared by every call
};

void* loaded_cusolver() {
  const std::string soname = "libcusolver.so." + std::to_string(CUSOLVER_VER_MAJOR);
  return dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
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
    if (!complete || create_params(&a.params) != CUSOLVER_STATUS_SUCCESS) return Api{};
    return a;
  }();
  return found;
}

// One handle per thread and device (a handle carries its stream, so threads never share one), made on first use.
cusolverDnHandle_t handle_for_current_device() {
  TORCHKERN_OP("eigh");
  thread_local std::unordered_map<int, cusolverDnHandle_t> handles;
  const int device = c10::cuda::current_device();
  auto it = handles.find(device);
  if (it == handles.end()) {
    cusolverDnHandle_t h = nullptr;
    const cusolverStatus_t status = api().create(&h);
    TORCHKERN_CHECK(status == CUSOLVER_STATUS_SUCCESS, "cusolverDnCreate failed with status ",
                    static_cast<int>(status));
    it = handles.emplace(device, h).first;
  }
  return it->second;
}

}  // namespace

bool syev_batched_available() { return api().solve != nullptr; }

std::tuple<at::Tensor, at::Tensor> syev_batched(at::Tensor X) {
  TORCHKERN_OP("eigh");
  const Api& a = api();
  const int64_t B = X.size(0), n = X.size(1);
  const cudaDataType type = X.scalar_type() == at::kDouble ? CUDA_R_64F : CUDA_R_32F;
  // Symmetric and row-major: the column-major matrix cuSOLVER reads is the same one; it overwrites it with the
  // eigenvectors as columns of the column-major matrix, i.e. as rows of V.
  at::Tensor V = X.contiguous();
  at::Tensor w = at::empty({B, n}, X.options());
  at::Tensor info = at::empty({B}, X.options().dtype(at::kInt));
  const cusolverDnHandle_t h = handle_for_current_device();
  a.set_stream(h, current_stream());
  size_t device_bytes = 0, host_bytes = 0;
  cusolverStatus_t status =
      a.buffer_size(h, a.params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, type, V.const_data_ptr(), n,
                    type, w.const_data_ptr(), type, &device_bytes, &host_bytes, B);
  TORCHKERN_CHECK(status == CUSOLVER_STATUS_SUCCESS, "cusolverDnXsyevBatched_bufferSize failed with status ",
                  static_cast<int>(status));
  // device workspace from the caching allocator, ordered on the current stream like every other tensor here
  at::Tensor work = at::empty({static_cast<int64_t>(std::max<size_t>(device_bytes, 1))},
                              X.options().dtype(at::kByte));
  std::vector<char> host_work(std::max<size_t>(host_bytes, 1));
  status = a.solve(h, a.params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, type, V.mutable_data_ptr(), n,
                   type, w.mutable_data_ptr(), type, work.mutable_data_ptr(), device_bytes, host_work.data(),
                   host_bytes, info.mutable_data_ptr<int>(), B);
  TORCHKERN_CHECK(status == CUSOLVER_STATUS_SUCCESS, "cusolverDnXsyevBatched failed with status ",
                  static_cast<int>(status));
  // Sorted again: the routine can leave the copies of a repeated eigenvalue out of order by an ulp (seen on an
  // H200, cuSOLVER 12.0 of CUDA 13.0), and the contract is ascending. The rows of V follow.
  const auto [sorted, order] = at::sort(w, /*dim=*/1);
  V = at::gather(V, 1, order.unsqueeze(2).expand({B, n, n}));
  const at::Tensor failed = at::ne(info, 0);  // not converged: NaN, never a silent wrong answer
  const at::Tensor nan = at::scalar_tensor(NAN, w.options());
  w = at::where(failed.view({B, 1}), nan, sorted);
  V = at::where(failed.view({B, 1, 1}), nan, V.transpose(1, 2));
  return {w, V};
}

}  // namespace torchkern
