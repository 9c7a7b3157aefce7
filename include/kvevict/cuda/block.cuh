// The CUDA side of the block-generic algorithms (detail/block/select_block.hpp, detail/block/compact_block.hpp):
// a thread block as a Block (each / sync / exclusive_sum / atomic_add), the device error counter
// and small launch helpers. Not API; included by kvevict/cuda/select.cuh and compact.cuh.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/detail/block/select_block.hpp>

#include <cub/block/block_scan.cuh>
#include <cuda/atomic>

#include <cstdint>

namespace kvevict::detail {

/// A CUDA thread block of `Threads` threads (blockDim.x must equal Threads).
template <int Threads>
struct cuda_block {
  using scan_t = cub::BlockScan<ucount, Threads>;
  using temp_storage = typename scan_t::TempStorage;

  temp_storage& tmp;

  __device__ static constexpr int size() noexcept { return Threads; }
  template <class F>
  __device__ void each(F&& f) const {
    f(static_cast<int>(threadIdx.x));
  }
  __device__ void sync() const { __syncthreads(); }
  /// Exclusive prefix sum of v(tid) over the block; then(tid, own, prefix, total); barrier.
  template <class V, class Then>
  __device__ void exclusive_sum(const V& v, const Then& then) const {
    const int tid = static_cast<int>(threadIdx.x);
    const ucount own = v(tid);
    ucount prefix = 0, total = 0;
    scan_t(tmp).ExclusiveSum(own, prefix, total);
    then(tid, own, prefix, total);
    __syncthreads();  // the temp storage and anything `then` wrote are reusable / visible
  }
  __device__ void atomic_add(std::uint32_t* p, std::uint32_t v) const { atomicAdd(p, v); }
  __device__ void atomic_add(ucount* p, ucount v) const { atomicAdd(p, v); }
};

/// Where kernels report rows or heads they skipped because device-resident arguments were invalid:
/// the caller's counter and/or the launcher's own (workspace) counter, either may be null.
struct bad_counter {
  int* a = nullptr;
  int* b = nullptr;
  __device__ void add(int n) const {
    if (n == 0) return;
    if (a != nullptr) atomicAdd(a, n);
    if (b != nullptr) atomicAdd(b, n);
  }
};

/// Takes a ticket: returns how many blocks took one before (device-scope, acquire-release: the
/// block that takes the last ticket sees everything the others wrote before taking theirs).
__device__ inline unsigned take_ticket(unsigned* counter) {
  cuda::atomic_ref<unsigned, cuda::thread_scope_device> ref(*counter);
  return ref.fetch_add(1u, cuda::memory_order_acq_rel);
}

/// Grid size for a grid-stride loop over `items` blocks' worth of work (at least 1, at most 2^20:
/// far more than enough blocks to fill any GPU; the loops cover the rest).
inline unsigned grid_blocks(index_t items) {
  constexpr index_t cap = index_t(1) << 20;
  return static_cast<unsigned>(items < 1 ? 1 : items < cap ? items : cap);
}

inline status launch_status(const char* fn) { return cuda_status(cudaGetLastError(), fn); }

}  // namespace kvevict::detail
