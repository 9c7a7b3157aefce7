// CUDA overload of <kvevict/weight.hpp> (weight_by_value_norm) and the value-norm maximum shared
// with the fused post-processing. Same semantics, checks and messages as the host; results are
// bit-identical (each norm is value_l1_accumulate over the row in order k = 0..d-1, staged through
// shared memory in pieces; the head maximum is exact whatever the order, NaN aside).
//
// Unlike the host overload it takes a workspace (two-phase): head_max reduces the norms of every
// value token of a head across CTAs, H_kv x (ceil(T / 256) + 1) floats (per_token needs none).
// lengths live in device memory: a head whose length is outside [0, T] is left unwritten and counted
// once in *bad_rows (a device int, if non-null).
//
// The four kernels are ops of detail/block/simt_bodies.hpp (value_norm_max_partial_op,
// value_norm_max_final_op, weight_per_token_op, weight_head_max_op) launched by detail::weight_launch,
// which the host tests run on the SIMT executor.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/detail/block/postprocess_device.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/weight.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {

/// weight_by_value_norm on the GPU (scores, values and lengths in device memory). See the host overload
/// and the file comment (workspace, device-checked lengths).
template <class V>
status weight_by_value_norm(cuda_t be, workspace& ws, matrix_view<float> scores, kv_view<V> values_in,
                            value_weight mode, const std::int32_t* lengths = nullptr, int* bad_rows = nullptr) {
  static_assert(is_kv_element_v<V>, "weight_by_value_norm: values must be float, float16 or bfloat16");
  using VE = std::remove_const_t<V>;
  constexpr const char* fn = "weight_by_value_norm(cuda)";
  const kv_view<const VE> values = values_in;
  KVEVICT_TRY(detail::check_weight_by_value_norm(fn, scores, values, mode));
  KVEVICT_TRY(detail::check_weight_overlap(fn, scores, values, lengths));
  KVEVICT_TRY(detail::check_device_alignment(fn, "scores", scores.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "values", values.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "lengths", lengths));
  const index_t rows = scores.extent(0), cols = scores.extent(1), hkv = values.extent(0);
  const bool head_max = mode == value_weight::head_max;
  index_t partial_floats = 0;
  if (head_max && !detail::checked_mul(hkv, detail::stage_tiles(values.extent(1)), partial_floats))
    return status::error(errc::size_overflow, "%s: the workspace size overflows", fn);
  detail::workspace_carver carver(ws);
  float* const partial = carver.take<float>(static_cast<std::size_t>(partial_floats));
  float* const factors = carver.take<float>(static_cast<std::size_t>(head_max ? hkv : 0));
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query() || rows == 0 || cols == 0) return {};
  const detail::pp_values<VE> vals{values.data_handle(), values.stride(0), values.stride(1), values.stride(2),
                                   values.extent(1), values.extent(2)};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::weight_launch(l, scores.data_handle(), scores.stride(0), scores.stride(1), rows, cols, vals, hkv, head_max,
                        lengths, bad_rows, partial, factors);
  return l.err;
}

}  // namespace kvevict
