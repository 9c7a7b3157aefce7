// CUDA overload of <kvevict/postprocess.hpp>: GQA reduce + pooling (either order) + value weighting +
// protection in one kernel that reads the per-query-head scores once and writes each KV head's row
// once; bit-identical to the host overload (and so to the chain of the individual stages). Also
// brings in the standalone CUDA stages it is built from.
//
// Launches: with head_max weighting, two small kernels first reduce the value norms of each head
// (weight.cuh); then one CTA per (KV head, tile of 1024 positions) runs detail::pp_run_tile: the
// tile's inputs (1024 + kernel - 1 positions of the GQA-reduced row, or of each query head of the
// group in turn) staged in shared memory, pooled block by block, GQA-finished, weighted (per-token
// norms staged through shared memory) and protected. Kernels wider than 2049 run one thread per
// pooling block instead (detail::pp_run_block; pool_first then keeps its block suffixes in the
// workspace).
//
// row_lengths / value_lengths live in device memory: a KV head whose length is outside its range is
// left unwritten and counted once in *bad_rows (a device int, if non-null).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/gqa.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/pool.cuh>
#include <kvevict/cuda/protect.cuh>
#include <kvevict/cuda/weight.cuh>
#include <kvevict/detail/block/postprocess_device.hpp>
#include <kvevict/detail/block/postprocess_ops.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/status.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {
namespace detail {

/// The GPU's workspace layout (both phases): with head_max weighting the per-tile partial maxima
/// and the per-head factors, with the block path and pool_first over groups a stash row per KV head.
/// Pointers of parts not needed are null.
inline status carve_postprocess_cuda(const char* fn, workspace& ws, index_t hq, index_t hkv, index_t T, index_t tv,
                                     const postprocess_options& opt, float*& partial, float*& factors, float*& stash) {
  const bool head_max = opt.weight_values && opt.weight == value_weight::head_max;
  const bool block_path = pp_choose_variant(opt.pool, opt.kernel) == pp_variant::blocks;
  const index_t g = hkv > 0 ? hq / hkv : 1;
  index_t partial_floats = 0, stash_floats = 0;
  bool ok = true;
  if (head_max) ok = ok && checked_mul(hkv, stage_tiles(tv), partial_floats);
  if (block_path && opt.order == gqa_order::pool_first && g > 1) ok = ok && checked_mul(hkv, T, stash_floats);
  if (!ok) return status::error(errc::size_overflow, "%s: the workspace size overflows", fn);
  workspace_carver carver(ws);
  partial = carver.take<float>(static_cast<std::size_t>(partial_floats));
  factors = carver.take<float>(static_cast<std::size_t>(head_max ? hkv : 0));
  stash = carver.take<float>(static_cast<std::size_t>(stash_floats));
  if (!head_max) partial = factors = nullptr;
  if (stash_floats == 0) stash = nullptr;
  return carver.finish(fn);
}

template <class VE>
status postprocess_scores_cuda(const char* fn, cuda_t be, workspace& ws, const matrix_view<const float>& in,
                               const matrix_view<float>& out, const kv_view<const VE>& values, bool has_values,
                               const postprocess_options& opt, const std::int32_t* row_lengths,
                               const std::int32_t* value_lengths, int* bad_rows) {
  KVEVICT_TRY(check_postprocess(fn, in, out, values, has_values, opt, row_lengths, value_lengths));
  KVEVICT_TRY(check_device_alignment(fn, "in", in.data_handle()));
  KVEVICT_TRY(check_device_alignment(fn, "out", out.data_handle()));
  KVEVICT_TRY(check_device_alignment(fn, "row_lengths", row_lengths));
  if (opt.weight_values) {
    KVEVICT_TRY(check_device_alignment(fn, "values", values.data_handle()));
    KVEVICT_TRY(check_device_alignment(fn, "value_lengths", value_lengths));
  }
  const index_t hkv = out.extent(0), T = in.extent(1);
  float *partial = nullptr, *factors = nullptr, *stash = nullptr;
  KVEVICT_TRY(carve_postprocess_cuda(fn, ws, in.extent(0), hkv, T, opt.weight_values ? values.extent(1) : 0, opt,
                                     partial, factors, stash));
  if (ws.is_query() || hkv == 0 || T == 0) return {};
  const pp_params a = make_pp_params(in, out, opt, row_lengths, value_lengths, factors);
  const pp_values<VE> vals = make_pp_values(values, opt.weight_values);
  cuda_launcher l{stream_of(be), fn};
  postprocess_launch(l, a, vals, partial, factors, stash, bad_rows);
  return l.err;
}

}  // namespace detail

/// postprocess_scores on the GPU (device pointers; lengths in device memory, checked by the kernel,
/// see above). Same semantics, checks and messages as the host overload and bit-identical results.
/// Workspace (two-phase): with head_max weighting H_kv x (ceil(T_v / 256) + 1) floats, with a kernel
/// wider than 2049 and pool_first over groups of several heads H_kv x T floats, otherwise none.
template <class V>
status postprocess_scores(cuda_t be, workspace& ws, matrix_view<const float> in, matrix_view<float> out,
                          kv_view<V> values, const postprocess_options& opt, const std::int32_t* row_lengths = nullptr,
                          const std::int32_t* value_lengths = nullptr, int* bad_rows = nullptr) {
  static_assert(is_kv_element_v<V>, "postprocess_scores: values must be float, float16 or bfloat16");
  using VE = std::remove_const_t<V>;
  return detail::postprocess_scores_cuda<VE>("postprocess_scores(cuda)", be, ws, in, out, kv_view<const VE>(values),
                                             true, opt, row_lengths, value_lengths, bad_rows);
}

/// postprocess_scores_workspace_bytes for the GPU overload (see its workspace above).
inline result<std::size_t> postprocess_scores_workspace_bytes(cuda_t, index_t query_heads, index_t kv_heads,
                                                              index_t tokens, index_t value_tokens,
                                                              const postprocess_options& opt) {
  constexpr const char* fn = "postprocess_scores_workspace_bytes(cuda)";
  if (query_heads < 0 || kv_heads < 0 || tokens < 0 || value_tokens < 0)
    return status::error(errc::invalid_argument, "%s: sizes must be >= 0", fn);
  workspace q;
  float *partial = nullptr, *factors = nullptr, *stash = nullptr;
  KVEVICT_TRY(detail::carve_postprocess_cuda(fn, q, query_heads, kv_heads, tokens, opt.weight_values ? value_tokens : 0,
                                             opt, partial, factors, stash));
  return q.bytes;
}

/// postprocess_scores on the GPU without value weighting (opt.weight_values must be false).
inline status postprocess_scores(cuda_t be, workspace& ws, matrix_view<const float> in, matrix_view<float> out,
                                 const postprocess_options& opt, const std::int32_t* row_lengths = nullptr,
                                 int* bad_rows = nullptr) {
  return detail::postprocess_scores_cuda<float>("postprocess_scores(cuda)", be, ws, in, out, kv_view<const float>{},
                                                false, opt, row_lengths, nullptr, bad_rows);
}

}  // namespace kvevict
