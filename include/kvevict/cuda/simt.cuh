// The GPU side of the SIMT execution context (detail/block/simt.hpp): every member is the CUDA
// intrinsic. Kernel bodies of detail/block/simt_bodies.hpp run on it through one-line __global__
// wrappers. Not API.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/status.hpp>

#include <cuda/atomic>

#include <cstddef>
#include <cstdint>
#include <type_traits>

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
  __device__ void plain_read(const void*, std::size_t) const {}
  __device__ void plain_write(void*, std::size_t) const {}
  template <class T>
  __device__ T atomic_add(T* p, T v) const { return atomicAdd(p, v); }
  template <class T>
  __device__ T atomic_max(T* p, T v) const { return atomicMax(p, v); }
  __device__ void fence() const { __threadfence(); }
  template <class T>
  __device__ T ld_acquire(const T* p) const {
    return cuda::atomic_ref<T, cuda::thread_scope_device>(*const_cast<T*>(p)).load(cuda::memory_order_acquire);
  }
  template <class T>
  __device__ void st_release(T* p, T v) const {
    cuda::atomic_ref<T, cuda::thread_scope_device>(*p).store(v, cuda::memory_order_release);
  }
  template <class T>
  __device__ T ld_cg(const T* p) const { return __ldcg(p); }
  __device__ void pause() const { __nanosleep(64); }
};

/// The one __global__ of every op (detail/block/simt_bodies.hpp): its static shared memory, the
/// context, the body.
template <class Op, class... A>
__global__ void __launch_bounds__(Op::threads) simt_kernel(A... a) {
  __shared__ typename Op::shared sh;
  cuda_simt_ctx c;
  Op::body(c, sh, a...);
}

/// The same with a minimum of Op::min_blocks resident blocks per SM (ops that declare it).
template <class Op, class... A>
__global__ void __launch_bounds__(Op::threads, Op::min_blocks) simt_kernel_min(A... a) {
  __shared__ typename Op::shared sh;
  cuda_simt_ctx c;
  Op::body(c, sh, a...);
}

template <class Op, class = void>
struct simt_min_blocks {
  static constexpr int value = 0;
};
template <class Op>
struct simt_min_blocks<Op, std::void_t<decltype(Op::min_blocks)>> {
  static constexpr int value = Op::min_blocks;
};

/// The GPU launcher: each op's kernel on `stream`; stops at the first launch error (err).
struct cuda_launcher {
  cudaStream_t stream;
  const char* fn;
  status err{};
  template <class Op, class Shape, class... A>
  void run(const Shape& sh, A... a) {
    if (!err.ok()) return;
    const auto grid = static_cast<unsigned>(sh.grid), block = static_cast<unsigned>(sh.block);
    if constexpr (simt_min_blocks<Op>::value > 0)
      simt_kernel_min<Op, A...><<<grid, block, 0, stream>>>(a...);
    else
      simt_kernel<Op, A...><<<grid, block, 0, stream>>>(a...);
    err = cuda_status(cudaGetLastError(), fn);
  }
};

}  // namespace kvevict::detail
