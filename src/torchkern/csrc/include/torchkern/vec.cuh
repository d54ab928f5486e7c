// Vectorized (16-byte) loads and stores for memory-bound kernels.
#pragma once

#include <cstdint>

namespace torchkern {

// N elements of T moved as one aligned access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements of T per 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

inline bool is_aligned(const void* ptr, int bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* __restrict__ base, int64_t vec_index) {
  return reinterpret_cast<const Vec<T, N>*>(base)[vec_index];
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ base, int64_t vec_index, const Vec<T, N>& value) {
  reinterpret_cast<Vec<T, N>*>(base)[vec_index] = value;
}

// Streaming store (evict-first): for outputs nobody reads back soon.
template <typename T, int N>
__device__ __forceinline__ void store_vec_streaming(T* __restrict__ base, int64_t vec_index, const Vec<T, N>& value) {
  static_assert(sizeof(Vec<T, N>) == 16, "streaming store is for 16-byte vectors");
  const int4 bits = *reinterpret_cast<const int4*>(&value);
  __stcs(reinterpret_cast<int4*>(base) + vec_index, bits);
}

}  // namespace torchkern
