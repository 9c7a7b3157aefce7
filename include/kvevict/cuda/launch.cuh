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
#endif

}  // namespace kvevict::detail
