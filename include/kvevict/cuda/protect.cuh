// CUDA overload of <kvevict/protect.hpp> (protect). Same semantics, checks and messages as the host,
// bit-identical results (detail::protect_value per element), except that row lengths live in device
// memory: a row whose length is outside [0, T] is left unwritten and counted once in *bad_rows (a
// device int, if non-null). One thread per element, grid-stride; no host synchronisation.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/protect.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

namespace kvevict {
namespace detail {

__global__ void __launch_bounds__(256) protect_kernel(float* s, index_t s0, index_t s1, index_t R, index_t T,
                                                      index_t n_sink, index_t n_recent, const std::int32_t* lengths,
                                                      int* bad) {
  const index_t items = R * T, stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t it = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    const index_t r = it / T, t = it % T;
    index_t L = 0;
    if (!device_row_length(lengths, r, T, L, bad, t == 0) || t >= L) continue;
    float& v = s[r * s0 + t * s1];
    v = protect_value(v, t, protect_sink_end(L, n_sink), protect_recent_begin(L, n_recent));
  }
}

}  // namespace detail

/// protect on the GPU (scores and row_lengths in device memory). See the host overload and above.
inline status protect(cuda_t be, matrix_view<float> scores, index_t n_sink, index_t n_recent,
                      const std::int32_t* row_lengths = nullptr, int* bad_rows = nullptr) {
  constexpr const char* fn = "protect(cuda)";
  KVEVICT_TRY(detail::check_view(fn, "scores", scores));
  KVEVICT_TRY(detail::check_protect_params(fn, n_sink, n_recent));
  KVEVICT_TRY(detail::check_protect_overlap(fn, scores, row_lengths));
  KVEVICT_TRY(detail::check_device_alignment(fn, "scores", scores.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "row_lengths", row_lengths));
  const index_t R = scores.extent(0), T = scores.extent(1);
  if (R == 0 || T == 0) return {};
  detail::protect_kernel<<<detail::grid_for((R * T + 255) / 256), 256, 0, detail::stream_of(be)>>>(
      scores.data_handle(), scores.stride(0), scores.stride(1), R, T, n_sink, n_recent, row_lengths, bad_rows);
  return detail::cuda_status(cudaGetLastError(), fn);
}

}  // namespace kvevict
