// CUDA overload of <kvevict/gqa.hpp> (gqa_reduce). Same semantics, checks and messages as the host;
// bit-identical results (the same gqa_combine / gqa_finish in the same head order; NaN results of
// sum/mean may differ in payload, docs/cuda.md). No workspace, no host synchronisation.
//
// One thread per (KV head, column), grid-stride; in place one thread per column (the body,
// detail::gqa_reduce_body, runs on the host under the SIMT executor in the tests).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

namespace kvevict {
namespace detail {

__global__ void __launch_bounds__(gqa_threads) gqa_reduce_kernel(const float* in, index_t is0, index_t is1, float* out,
                                                                 index_t os0, index_t os1, index_t hkv, index_t g,
                                                                 index_t T, gqa_op op, bool in_place) {
  cuda_simt_ctx c;
  gqa_reduce_body(c, in, is0, is1, out, os0, os1, hkv, g, T, op, in_place);
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
  const detail::simt_shape sh = detail::gqa_reduce_shape(hkv, T, in_place);
  detail::gqa_reduce_kernel<<<static_cast<unsigned>(sh.grid), static_cast<unsigned>(sh.block), 0, detail::stream_of(be)>>>(
      in.data_handle(), in.stride(0), in.stride(1), out.data_handle(), out.stride(0), out.stride(1), hkv, hq / hkv, T, op,
      in_place);
  return detail::cuda_status(cudaGetLastError(), fn);
}

}  // namespace kvevict
