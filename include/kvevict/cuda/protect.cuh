// CUDA overload of <kvevict/protect.hpp> (protect). Same semantics, checks and messages as the host,
// bit-identical results (detail::protect_value per element), except that row lengths live in device
// memory: a row whose length is outside [0, T] is left unwritten and counted once in *bad_rows (a
// device int, if non-null). One thread per element, grid-stride; no host synchronisation. The body
// (detail::protect_body) runs on the host under the SIMT executor in the tests.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

namespace kvevict {
namespace detail {

__global__ void __launch_bounds__(protect_threads) protect_kernel(float* s, index_t s0, index_t s1, index_t R, index_t T,
                                                                  index_t n_sink, index_t n_recent,
                                                                  const std::int32_t* lengths, int* bad) {
  cuda_simt_ctx c;
  protect_body(c, s, s0, s1, R, T, n_sink, n_recent, lengths, bad);
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
  const detail::simt_shape sh = detail::protect_shape(R, T);
  detail::protect_kernel<<<static_cast<unsigned>(sh.grid), static_cast<unsigned>(sh.block), 0, detail::stream_of(be)>>>(
      scores.data_handle(), scores.stride(0), scores.stride(1), R, T, n_sink, n_recent, row_lengths, bad_rows);
  return detail::cuda_status(cudaGetLastError(), fn);
}

}  // namespace kvevict
