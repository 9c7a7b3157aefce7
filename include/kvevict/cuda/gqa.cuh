// CUDA overload of <kvevict/gqa.hpp> (gqa_reduce). Same semantics, checks and messages as the host;
// bit-identical results (the same gqa_combine / gqa_finish in the same head order; NaN results of
// sum/mean may differ in payload, docs/cuda.md). No workspace, no host synchronisation.
//
// One thread per (KV head, column), grid-stride; in place (out = the first H_kv rows of in) one
// thread per column walks the KV heads in ascending order, as the host does, so that row h is
// written only after every group reading it was reduced.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/gqa.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

namespace kvevict {
namespace detail {

__global__ void __launch_bounds__(256) gqa_reduce_kernel(const float* in, index_t is0, index_t is1, float* out,
                                                         index_t os0, index_t os1, index_t hkv, index_t g, index_t T,
                                                         gqa_op op, bool in_place) {
  const index_t heads = in_place ? 1 : hkv;  // in place: one item per column covers every head
  const index_t items = heads * T, stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t it = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    const index_t t = it % T, h0 = in_place ? 0 : it / T, h1 = in_place ? hkv : h0 + 1;
    for (index_t h = h0; h < h1; ++h) {
      const float* col = in + (h * g) * is0 + t * is1;
      float acc = col[0];
      for (index_t j = 1; j < g; ++j) acc = gqa_combine(op, acc, col[j * is0]);
      out[h * os0 + t * os1] = gqa_finish(op, acc, g);
    }
  }
}

}  // namespace detail

/// gqa_reduce on the GPU (device pointers in the views). See the host overload.
inline status gqa_reduce(cuda_t be, matrix_view<const float> in, matrix_view<float> out, gqa_op op) {
  constexpr const char* fn = "gqa_reduce(cuda)";
  bool in_place = false;
  KVEVICT_TRY(detail::check_gqa_reduce(fn, in, out, op, in_place));
  KVEVICT_TRY(detail::check_device_alignment(fn, "in", in.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "out", out.data_handle()));
  const index_t hq = in.extent(0), hkv = out.extent(0), T = in.extent(1);
  if (hkv == 0 || T == 0) return {};
  const index_t items = (in_place ? 1 : hkv) * T;
  detail::gqa_reduce_kernel<<<detail::grid_for((items + 255) / 256), 256, 0, detail::stream_of(be)>>>(
      in.data_handle(), in.stride(0), in.stride(1), out.data_handle(), out.stride(0), out.stride(1), hkv, hq / hkv, T, op,
      in_place);
  return detail::cuda_status(cudaGetLastError(), fn);
}

}  // namespace kvevict
