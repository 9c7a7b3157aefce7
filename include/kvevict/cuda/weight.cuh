// CUDA overload of <kvevict/weight.hpp> (weight_by_value_norm) and the value-norm maximum shared
// with the fused post-processing. Same semantics, checks and messages as the host; results are
// bit-identical (each norm is value_l1_accumulate over the row in order k = 0..d-1, staged through
// shared memory in pieces; the head maximum is exact whatever the order, NaN aside).
//
// Unlike the host overload it takes a workspace (two-phase): head_max reduces the norms of every
// value token of a head across CTAs, H_kv x (ceil(T / 256) + 1) floats (per_token needs none).
// lengths live in device memory: a head whose length is outside [0, T] is left unwritten and counted
// once in *bad_rows (a device int, if non-null).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/detail/block/postprocess_device.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/weight.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {
namespace detail {

KVEVICT_HOST_DEVICE inline index_t value_norm_tiles(index_t tokens) { return (tokens + stage_rows - 1) / stage_rows; }

/// CTA item (KV head h, tile of stage_rows value tokens): the max (max_nan, from 0) of the tile's
/// norms among the head's first lengths[h] tokens -> partial[h * tiles + tile]. Heads with a bad
/// length are skipped (their consumer skips them too).
template <class VE>
__global__ void __launch_bounds__(stage_rows) value_norm_max_partial_kernel(const pp_values<VE> vals,
                                                                           const std::int32_t* lengths, float* partial,
                                                                           index_t hkv, index_t tiles) {
  __shared__ float sm[stage_rows * stage_ld];
  __shared__ float red[stage_rows];
  const int tid = static_cast<int>(threadIdx.x);
  for (index_t item = blockIdx.x; item < hkv * tiles; item += gridDim.x) {
    const index_t h = item / tiles, tile = item % tiles, t0 = tile * stage_rows;
    index_t len = 0;
    if (!device_row_length(lengths, h, vals.tv, len, nullptr, false)) continue;
    const int n = len - t0 <= 0 ? 0 : len - t0 < stage_rows ? static_cast<int>(len - t0) : stage_rows;
    const float s = staged_row_reduce(vals.v + h * vals.vs0 + t0 * vals.vs1, vals.vs1, vals.vs2, n, vals.d, sm,
                                      [](float acc, const float* x, int k) { return value_l1_accumulate(acc, x, k, 1); });
    __syncthreads();  // the previous item's readers of red are done
    red[tid] = tid < n ? s : 0.0f;  // 0: the identity of max_nan over norms (>= 0 or NaN)
    for (int off = stage_rows / 2; off > 0; off /= 2) {
      __syncthreads();
      if (tid < off) red[tid] = max_nan(red[tid], red[tid + off]);
    }
    if (tid == 0) partial[h * tiles + tile] = red[0];
  }
}

/// One warp per KV head: factors[h] = max_nan over the head's partial maxima (lane-strided, then a
/// shuffle tree).
__global__ void __launch_bounds__(256) value_norm_max_final_kernel(const float* partial, index_t hkv, index_t tiles,
                                                                   float* factors) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const index_t warps = static_cast<index_t>(gridDim.x) * (blockDim.x / 32);
  for (index_t h = static_cast<index_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; h < hkv; h += warps) {
    float m = 0.0f;
    for (index_t k = lane; k < tiles; k += 32) m = max_nan(m, partial[h * tiles + k]);
    for (int off = 16; off > 0; off /= 2) m = max_nan(m, __shfl_down_sync(0xffffffffu, m, off));
    if (lane == 0) factors[h] = m;
  }
}

/// Launches the head maxima of value norms into factors[hkv] (partial: hkv x tiles floats).
template <class VE>
status value_norm_max_launch(const char* fn, cuda_t be, const pp_values<VE>& vals, const std::int32_t* lengths,
                             index_t hkv, float* partial, float* factors) {
  const index_t tiles = value_norm_tiles(vals.tv);
  if (hkv == 0) return {};
  if (tiles > 0) {
    value_norm_max_partial_kernel<VE><<<grid_for(hkv * tiles), stage_rows, 0, stream_of(be)>>>(vals, lengths, partial,
                                                                                               hkv, tiles);
    KVEVICT_TRY(cuda_status(cudaGetLastError(), fn));
  }
  value_norm_max_final_kernel<<<grid_for((hkv + 7) / 8), 256, 0, stream_of(be)>>>(partial, hkv, tiles, factors);
  return cuda_status(cudaGetLastError(), fn);
}

/// per_token: CTA item (KV head, tile of stage_rows tokens), the norms staged, then every row of the
/// head's group scaled.
template <class VE>
__global__ void __launch_bounds__(stage_rows) weight_per_token_kernel(float* s, index_t s0, index_t s1, index_t cols,
                                                                     index_t group, const pp_values<VE> vals,
                                                                     const std::int32_t* lengths, index_t hkv, int* bad) {
  __shared__ float sm[stage_rows * stage_ld];
  const int tid = static_cast<int>(threadIdx.x);
  const index_t tiles = value_norm_tiles(cols);
  for (index_t item = blockIdx.x; item < hkv * tiles; item += gridDim.x) {
    const index_t h = item / tiles, t0 = (item % tiles) * stage_rows;
    index_t len = 0;
    if (!device_row_length(lengths, h, vals.tv, len, bad, t0 == 0 && tid == 0)) continue;
    const index_t n = cols < len ? cols : len;
    if (t0 >= n) continue;
    const int m = n - t0 < stage_rows ? static_cast<int>(n - t0) : stage_rows;
    const float norm = staged_row_reduce(vals.v + h * vals.vs0 + t0 * vals.vs1, vals.vs1, vals.vs2, m, vals.d, sm,
                                         [](float acc, const float* x, int k) { return value_l1_accumulate(acc, x, k, 1); });
    if (tid < m)
      for (index_t r = h * group; r < (h + 1) * group; ++r) {
        float& v = s[r * s0 + (t0 + tid) * s1];
        v = mul_rn(v, norm);
      }
  }
}

/// head_max: one thread per score, times its head's factor.
__global__ void __launch_bounds__(256) weight_head_max_kernel(float* s, index_t s0, index_t s1, index_t rows,
                                                              index_t cols, index_t group, const float* factors,
                                                              const std::int32_t* lengths, index_t tv, int* bad) {
  const index_t items = rows * cols, stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t it = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    const index_t r = it / cols, t = it % cols, h = r / group;
    index_t len = 0;
    if (!device_row_length(lengths, h, tv, len, bad, t == 0 && r == h * group) || t >= len) continue;
    float& v = s[r * s0 + t * s1];
    v = mul_rn(v, factors[h]);
  }
}

}  // namespace detail

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
  if (head_max && !detail::checked_mul(hkv, detail::value_norm_tiles(values.extent(1)), partial_floats))
    return status::error(errc::size_overflow, "%s: the workspace size overflows", fn);
  detail::workspace_carver carver(ws);
  float* const partial = carver.take<float>(static_cast<std::size_t>(partial_floats));
  float* const factors = carver.take<float>(static_cast<std::size_t>(head_max ? hkv : 0));
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query() || rows == 0 || cols == 0) return {};
  const detail::pp_values<VE> vals{values.data_handle(), values.stride(0), values.stride(1), values.stride(2),
                                   values.extent(1), values.extent(2)};
  const index_t group = rows / hkv;
  if (!head_max) {
    const index_t items = hkv * detail::value_norm_tiles(cols);
    detail::weight_per_token_kernel<VE><<<detail::grid_for(items), detail::stage_rows, 0, detail::stream_of(be)>>>(
        scores.data_handle(), scores.stride(0), scores.stride(1), cols, group, vals, lengths, hkv, bad_rows);
    return detail::cuda_status(cudaGetLastError(), fn);
  }
  KVEVICT_TRY(detail::value_norm_max_launch(fn, be, vals, lengths, hkv, partial, factors));
  detail::weight_head_max_kernel<<<detail::grid_for((rows * cols + 255) / 256), 256, 0, detail::stream_of(be)>>>(
      scores.data_handle(), scores.stride(0), scores.stride(1), rows, cols, group, factors, lengths, values.extent(1),
      bad_rows);
  return detail::cuda_status(cudaGetLastError(), fn);
}

}  // namespace kvevict
