// CUDA overloads of <kvevict/score.hpp>: attention scores of a query block (window, external block,
// H2O, TOVA) and key norms, plus the GQA-reduced form of the attention scores in the same launch
// (attention_scores_gqa, window_scores_gqa). docs/cuda.md has the algorithm, launch shapes,
// memory traffic, costs, numerics and what was validated where.
//
// Same semantics, argument checks (the host's check functions) and error messages as the host
// overloads; views hold device pointers. Launches are asynchronous on the backend's stream; nothing
// synchronises the host or allocates: the two-phase workspace holds each row's softmax statistics.
//
// The attention matrix is never materialised: pass 1 computes each query row's softmax statistics
// (max, sum) tile by tile with the online merge of detail/base/softmax.hpp; pass 2 recomputes the logits
// tile by tile and adds the probabilities into the per-column reduction. One CTA per (KV head, key
// tile) holds the tile's keys in shared memory for every query row of the GQA group.
//
// The kernels are ops (include/kvevict/detail/block/score_ops.hpp) launched by cuda_launcher; the
// host tests run the same bodies and launch sequence on the SIMT executor (score_emulation.hpp).
// Results are deterministic (fixed decomposition and summation order, no atomics); they differ
// from the host backends only by summation order, within the bound of docs/cuda.md. The
// GQA-reduced output equals gqa_reduce of the per-head output bit for bit. paged_window_scores
// runs the same ops with keys read through a paged layer's page lists.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/block/score_device.hpp>
#include <kvevict/detail/block/score_ops.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/score.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <type_traits>

namespace kvevict {
namespace detail {

/// The CUDA attention_scores: per-head output out_h (unless it has 0 rows and out_kv is given) and/or
/// the GQA-reduced out_kv (if kv_requested).
template <class QE, class KE>
status attention_scores_cuda(const char* fn, cuda_t be, workspace& ws, const kv_view<const QE>& q,
                             const kv_view<const KE>& prefix, const kv_view<const KE>& block,
                             const matrix_view<float>& out_h, bool kv_requested, const matrix_view<float>& out_kv,
                             gqa_op op, const score_options& opt) {
  cuda_launcher l{stream_of(be), fn};
  KVEVICT_TRY((attention_scores_launch<QE, KE>(fn, l, ws, q, prefix, block, out_h, kv_requested, out_kv, op, opt,
                                              [fn](const char* name, const auto* ptr) {
                                                return check_device_alignment(fn, name, ptr);
                                              })));
  return l.err;
}

}  // namespace detail

/// attention_scores on the GPU (views hold device pointers). Same semantics, errors and defaults as
/// the host overload; the workspace holds each query row's softmax statistics, 8 bytes x H_q x w x
/// (1 + splits) (docs/cuda.md). Asynchronous on be.stream; no host synchronisation.
template <class Q, class K>
status attention_scores(cuda_t be, workspace& ws, kv_view<Q> queries, kv_view<K> prefix_keys, kv_view<K> block_keys,
                        matrix_view<float> out, const score_options& opt = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "attention_scores: elements must be float, float16 or bfloat16");
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  return detail::attention_scores_cuda<QE, KE>("attention_scores(cuda)", be, ws, kv_view<const QE>(queries),
                                               kv_view<const KE>(prefix_keys), kv_view<const KE>(block_keys), out,
                                               false, {}, gqa_op::mean, opt);
}

/// attention_scores and gqa_reduce in one launch sequence: out_kv [H_kv][P] (or [H_kv][P + w]) is
/// gqa_reduce(per-head scores, op), bit for bit the same as gqa_reduce(seq, ...) applied to what
/// attention_scores(cuda, ...) writes; the per-head scores are also written to out_per_head
/// [H_q][same columns] unless it has 0 rows (the default). Errors: those of attention_scores (for
/// out_kv: KV-head rows), an op outside gqa_op, H_q = 0, out_per_head with other columns than out_kv
/// or overlapping it.
template <class Q, class K>
status attention_scores_gqa(cuda_t be, workspace& ws, kv_view<Q> queries, kv_view<K> prefix_keys,
                            kv_view<K> block_keys, matrix_view<float> out_kv, gqa_op op, const score_options& opt = {},
                            matrix_view<float> out_per_head = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>,
                "attention_scores_gqa: elements must be float, float16 or bfloat16");
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  return detail::attention_scores_cuda<QE, KE>("attention_scores_gqa(cuda)", be, ws, kv_view<const QE>(queries),
                                               kv_view<const KE>(prefix_keys), kv_view<const KE>(block_keys),
                                               out_per_head, true, out_kv, op, opt);
}

namespace detail {
/// The GPU score wrappers' one path (score.hpp's run_score_wrapper on the GPU): `prepare`'s checks
/// and block, then attention_scores_cuda (per-head `out`; with `kv_requested` also the GQA-reduced
/// out_kv by `op`).
template <class Q, class K, class Prepare>
status run_score_wrapper_cuda(const char* fn, cuda_t be, workspace& ws, kv_view<Q> queries, kv_view<K> keys,
                              const matrix_view<float>& out, bool kv_requested, const matrix_view<float>& out_kv,
                              gqa_op op, Prepare prepare) {
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  const auto c = prepare(kv_view<const QE>(queries), kv_view<const KE>(keys));
  if (!c) return c.error();
  return attention_scores_cuda<QE, KE>(fn, be, ws, c->queries, c->prefix, c->block, out, kv_requested, out_kv, op,
                                       c->opt);
}
}  // namespace detail

/// window_scores on the GPU (the SnapKV family's window); see the host overload.
template <class Q, class K>
status window_scores(cuda_t be, workspace& ws, kv_view<Q> window_queries, kv_view<K> keys, matrix_view<float> out,
                     const score_options& opt = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "window_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "window_scores(cuda)";
  return detail::run_score_wrapper_cuda(fn, be, ws, window_queries, keys, out, false, {}, gqa_op::mean,
                                        [&](const auto& q, const auto& k) {
                                          return detail::prepare_window_scores(fn, q, k, opt);
                                        });
}

/// window_scores followed by gqa_reduce, in one launch sequence (see attention_scores_gqa).
template <class Q, class K>
status window_scores_gqa(cuda_t be, workspace& ws, kv_view<Q> window_queries, kv_view<K> keys,
                         matrix_view<float> out_kv, gqa_op op, const score_options& opt = {},
                         matrix_view<float> out_per_head = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>,
                "window_scores_gqa: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "window_scores_gqa(cuda)";
  return detail::run_score_wrapper_cuda(fn, be, ws, window_queries, keys, out_per_head, true, out_kv, op,
                                        [&](const auto& q, const auto& k) {
                                          return detail::prepare_window_scores(fn, q, k, opt);
                                        });
}

/// paged_window_scores on the GPU: the window scores of every row (sequence, KV head) of a paged layer
/// through its page lists (NHD or HND pools, per-sequence or per-(sequence, head) tables), by the same
/// kernels as window_scores, so each row's scores are bit-identical to window_scores(cuda) on a dense
/// copy of the row (docs/paged.md). Queries, out, pools and table are device memory. Host-side errors:
/// the host overload's that do not read the table (the layer's shape, queries not S x a multiple of
/// H_kv heads, dims, w = 0, out rows, bad options), out with fewer than w columns under
/// include_window, out overlapping the queries or pools, a null or misaligned table, workspace too
/// small. The table is device data: a row whose entries are bad (offsets, last page, page ids), that
/// holds fewer than w tokens or needs more than out's columns is skipped (its out rows untouched) and
/// counted into *bad (a device int the caller zeroes; optional). Workspace: 8 B per row plus
/// attention_scores' statistics for the widest row out allows (H_q = rows x group, P = C or C - w).
template <class Q, class T>
status paged_window_scores(cuda_t be, workspace& ws, kv_view<Q> window_queries, paged_layer<T> layer,
                           matrix_view<float> out, bool include_window = false, const score_options& opt = {},
                           int* bad = nullptr) {
  static_assert(is_kv_element_v<std::remove_const_t<Q>> && is_kv_element_v<std::remove_const_t<T>>,
                "paged_window_scores: float, float16 or bfloat16");
  using QE = std::remove_const_t<Q>;
  constexpr const char* fn = "paged_window_scores(cuda)";
  detail::cuda_launcher l{detail::stream_of(be), fn};
  KVEVICT_TRY((detail::paged_window_scores_launch<QE>(
      fn, l, ws, kv_view<const QE>(window_queries), layer, out, include_window, opt,
      [fn](const char* name, const auto* ptr) { return detail::check_device_alignment(fn, name, ptr); },
      detail::simt_bad{bad, nullptr})));
  return l.err;
}

/// h2o_scores on the GPU; see the host overload. Causal tiles are skipped (half the work).
template <class Q, class K>
status h2o_scores(cuda_t be, workspace& ws, kv_view<Q> queries, kv_view<K> keys, matrix_view<float> out,
                  bool normalised = false, float scale = 0.0f) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "h2o_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "h2o_scores(cuda)";
  return detail::run_score_wrapper_cuda(fn, be, ws, queries, keys, out, false, {}, gqa_op::mean,
                                        [&](const auto& q, const auto& k) {
                                          return detail::prepare_h2o_scores(fn, q, k, out, normalised, scale);
                                        });
}

/// tova_scores on the GPU; see the host overload.
template <class Q, class K>
status tova_scores(cuda_t be, workspace& ws, kv_view<Q> last_query, kv_view<K> keys, matrix_view<float> out,
                   float scale = 0.0f) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "tova_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "tova_scores(cuda)";
  return detail::run_score_wrapper_cuda(fn, be, ws, last_query, keys, out, false, {}, gqa_op::mean,
                                        [&](const auto& q, const auto& k) {
                                          return detail::prepare_tova_scores(fn, q, k, scale);
                                        });
}

/// key_norm_scores on the GPU: bit-identical to the host (same per-element sum, correctly rounded
/// sqrt). No workspace.
template <class K>
status key_norm_scores(cuda_t be, kv_view<K> keys_in, matrix_view<float> out) {
  constexpr const char* fn = "key_norm_scores(cuda)";
  const auto checked = detail::key_norm_inputs(fn, keys_in, out);
  if (!checked) return checked.error();
  const auto& keys = *checked;
  KVEVICT_TRY(detail::check_device_alignment(fn, "keys", keys.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "out", out.data_handle()));
  if (keys.extent(0) == 0 || keys.extent(1) == 0) return {};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  l.run<detail::key_norm_op<std::remove_const_t<K>>>(detail::key_norm_shape(keys), keys, out.data_handle(), out.stride(0), out.stride(1));
  return l.err;
}

/// position_scores on the GPU (out in device memory): out[h][t] = t, exact. No workspace.
inline status position_scores(cuda_t be, matrix_view<float> out) {
  constexpr const char* fn = "position_scores(cuda)";
  KVEVICT_TRY(detail::check_position_scores(fn, out));
  KVEVICT_TRY(detail::check_device_alignment(fn, "out", out.data_handle()));
  const index_t R = out.extent(0), T = out.extent(1);
  if (R == 0 || T == 0) return {};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  l.run<detail::position_op>(detail::position_shape(R, T), out.data_handle(), out.stride(0), out.stride(1), R, T);
  return l.err;
}

namespace detail {

/// attention_scores_workspace_bytes on the GPU (score.hpp's size query): its two
/// softmax-statistics buffers.
template <>
struct score_workspace<cuda_t> {
  static constexpr const char* name = "attention_scores_workspace_bytes(cuda)";
  static status carve(const char* fn, cuda_t, const score_shape& sh, const score_options&, workspace& ws) {
    cuda_score_plan pl;
    KVEVICT_TRY(make_cuda_score_plan(fn, sh, pl));
    softmax_stats *part = nullptr, *rowst = nullptr;
    return carve_cuda_score(fn, ws, pl, part, rowst);
  }
};

}  // namespace detail

}  // namespace kvevict
