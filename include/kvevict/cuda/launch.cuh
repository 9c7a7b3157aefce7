// Helpers shared by the CUDA launchers of the scoring and post-processing stages: bounded grids for
// grid-stride loops, alignment checks of device pointers, and the device-side guard of per-row lengths
// stored in device memory (which the host cannot read without a synchronisation).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/detail/block/score_device.hpp>
#include <kvevict/status.hpp>
#include <kvevict/weight.hpp>

#include <cstdint>

namespace kvevict::detail {

/// CTAs for a grid-stride loop over `items` work items: min(items, 2^20) (never 0). Every kernel
/// loops `for (item = blockIdx.x; item < items; item += gridDim.x)` with 64-bit items, so any size
/// fits and the results do not depend on the grid.
inline unsigned grid_for(index_t items) {
  constexpr index_t cap = index_t(1) << 20;
  return static_cast<unsigned>(items < 1 ? 1 : items < cap ? items : cap);
}

/// errc::invalid_argument unless p (a device pointer, never dereferenced) is aligned for T.
template <class T>
status check_device_alignment(const char* fn, const char* name, const T* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(T) != 0)
    return status::error(errc::invalid_argument, "%s: %s is not aligned to %zu bytes", fn, name, alignof(T));
  return {};
}

#if defined(__CUDACC__)
/// The length of row `row` from device lengths (or `limit` when there are none). A length outside
/// [0, limit] returns false; if `count`, it is added once to *bad (when bad is non-null).
__device__ inline bool device_row_length(const std::int32_t* lengths, index_t row, index_t limit, index_t& len,
                                         int* bad, bool count) {
  cuda_simt_ctx c;
  return simt_row_length(c, lengths, row, limit, len, bad, count);
}

/// staged_row_reduce on the CUDA context (detail/block/simt_bodies.hpp has the function and the
/// staging geometry: stage_rows, stage_cols, stage_ld).
template <class T, class F>
__device__ float staged_row_reduce(const T* base, index_t rs, index_t es, int nrows, index_t d, float* sm, F f) {
  cuda_simt_ctx c;
  return simt_staged_row_reduce(c, base, rs, es, nrows, d, sm, f);
}

/// The GPU context of the host-device tile routines (detail/block/postprocess_device.hpp): the CTA's
/// threads share each loop, sync() is a barrier, value norms are staged through `stage`
/// (stage_rows x stage_ld floats of shared memory). Needs blockDim.x == stage_rows.
struct cta_ctx {
  float* stage;
  template <class F>
  __device__ void each(index_t n, const F& f) const {
    for (index_t i = threadIdx.x; i < n; i += blockDim.x) f(i);
  }
  __device__ void sync() const { __syncthreads(); }
  template <class VE>
  __device__ void l1_norms(const VE* base, index_t rs, index_t es, index_t n, index_t d, float* norms) const {
    for (index_t t0 = 0; t0 < n; t0 += stage_rows) {
      const int m = n - t0 < stage_rows ? static_cast<int>(n - t0) : stage_rows;
      const float s = staged_row_reduce(base + t0 * rs, rs, es, m, d, stage,
                                        [](float acc, const float* x, int k) { return value_l1_accumulate(acc, x, k, 1); });
      if (static_cast<int>(threadIdx.x) < m) norms[t0 + threadIdx.x] = s;
    }
  }
};
#endif

}  // namespace kvevict::detail
