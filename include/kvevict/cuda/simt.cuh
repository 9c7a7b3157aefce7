// The GPU side of the SIMT execution context (detail/block/simt.hpp): every member is the CUDA
// intrinsic. Kernel bodies of detail/block/simt_bodies.hpp run on it through one-line __global__
// wrappers. Not API.
#pragma once

#include <kvevict/config.hpp>

#include <cstdint>

namespace kvevict::detail {

struct cuda_simt_ctx {
  __device__ index_t thread() const { return static_cast<index_t>(threadIdx.x); }
  __device__ index_t block() const { return static_cast<index_t>(blockIdx.x); }
  __device__ index_t block_dim() const { return static_cast<index_t>(blockDim.x); }
  __device__ index_t grid_dim() const { return static_cast<index_t>(gridDim.x); }
  __device__ int lane() const { return static_cast<int>(threadIdx.x % 32); }
  __device__ int warp() const { return static_cast<int>(threadIdx.x / 32); }
  __device__ void sync() const { __syncthreads(); }
  template <class T>
  __device__ T shfl(T v, int src) const { return __shfl_sync(0xffffffffu, v, src); }
  template <class T>
  __device__ T shfl_xor(T v, int mask) const { return __shfl_xor_sync(0xffffffffu, v, mask); }
  template <class T>
  __device__ T shfl_down(T v, int delta) const { return __shfl_down_sync(0xffffffffu, v, delta); }
  __device__ bool any(bool p) const { return __any_sync(0xffffffffu, p) != 0; }
  __device__ bool all(bool p) const { return __all_sync(0xffffffffu, p) != 0; }
  __device__ std::uint32_t ballot(bool p) const { return __ballot_sync(0xffffffffu, p); }
  template <class T>
  __device__ T ld(const T* p) const { return *p; }
  template <class T>
  __device__ void st(T* p, T v) const { *p = v; }
  template <class T>
  __device__ T atomic_add(T* p, T v) const { return atomicAdd(p, v); }
  __device__ void fence() const { __threadfence(); }
};

}  // namespace kvevict::detail
