// The shape and option checks of the attention-score stage, shared by every backend: the host
// stage (score.hpp) and the CUDA launch sequences (detail/block/score_ops.hpp, run by cuda/score.cuh
// and, on the host SIMT executor, by detail/block/score_emulation.hpp). Not API.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/score_types.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cmath>

namespace kvevict::detail {

struct score_shape {
  index_t hq = 0, hkv = 0, group = 1, w = 0, p = 0, d = 0;
  index_t cols = 0;      ///< visible columns: p + (has_block ? w : 0)
  index_t out_cols = 0;  ///< p or p + w
  bool has_block = false;
  float scale = 1.0f;
};

/// The logits' scale: opt.scale, or 1/sqrt(d) rounded to fp32 when it is 0.
inline float score_scale(const score_options& opt, index_t d) {
  return opt.scale == 0.0f ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))) : opt.scale;
}

inline status check_score_options(const char* fn, const score_options& opt) {
  const int r = static_cast<int>(opt.reduce);
  if (r < 0 || r > 3) return status::error(errc::invalid_argument, "%s: unknown score_reduce value %d", fn, r);
  const int v = static_cast<int>(opt.variance);
  if (v < 0 || v > 1) return status::error(errc::invalid_argument, "%s: unknown variance_estimator value %d", fn, v);
  if (!(opt.scale >= 0.0f) || !std::isfinite(opt.scale))
    return status::error(errc::invalid_argument, "%s: scale must be finite and >= 0 (0 = 1/sqrt(d)), got %g", fn,
                         static_cast<double>(opt.scale));
  if (!(opt.gamma >= 0.0f) || !std::isfinite(opt.gamma))
    return status::error(errc::invalid_argument, "%s: gamma must be finite and >= 0, got %g", fn,
                         static_cast<double>(opt.gamma));
  return {};
}

/// The inputs of attention_scores (views, options, shapes): everything but the output, whose column
/// count it leaves in sh.out_cols = 0. Shared by every backend (the CUDA launchers call it too).
template <class QE, class KE>
status check_attention_inputs(const char* fn, const kv_view<const QE>& q, const kv_view<const KE>& prefix,
                              const kv_view<const KE>& block, const score_options& opt, score_shape& sh) {
  KVEVICT_TRY(check_view(fn, "queries", q));
  KVEVICT_TRY(check_view(fn, "prefix_keys", prefix));
  // a block_keys view with 0 tokens (e.g. a default-constructed kv_view) means "none" and is never
  // read, so its other extents and strides do not matter
  if (block.extent(1) != 0) KVEVICT_TRY(check_view(fn, "block_keys", block));
  KVEVICT_TRY(check_score_options(fn, opt));
  sh.hq = q.extent(0);
  sh.w = q.extent(1);
  sh.d = q.extent(2);
  sh.hkv = prefix.extent(0);
  sh.p = prefix.extent(1);
  if (sh.w == 0) return status::error(errc::invalid_argument, "%s: the query block is empty (w = 0)", fn);
  if (sh.hkv == 0) return status::error(errc::invalid_argument, "%s: prefix_keys has no heads", fn);
  if (sh.hq % sh.hkv != 0)
    return status::error(errc::shape_mismatch, "%s: %lld query heads are not a multiple of %lld KV heads (GQA)", fn,
                         static_cast<long long>(sh.hq), static_cast<long long>(sh.hkv));
  sh.group = sh.hq / sh.hkv;
  if (sh.d == 0) return status::error(errc::invalid_argument, "%s: head dim is 0", fn);
  if (prefix.extent(2) != sh.d)
    return status::error(errc::shape_mismatch, "%s: head dims differ (queries %lld, prefix_keys %lld)", fn,
                         static_cast<long long>(sh.d), static_cast<long long>(prefix.extent(2)));
  sh.has_block = block.extent(1) != 0;
  if (sh.has_block) {
    if (block.extent(0) != sh.hkv)
      return status::error(errc::shape_mismatch, "%s: block_keys has %lld heads, prefix_keys %lld", fn,
                           static_cast<long long>(block.extent(0)), static_cast<long long>(sh.hkv));
    if (block.extent(2) != sh.d)
      return status::error(errc::shape_mismatch, "%s: head dims differ (queries %lld, block_keys %lld)", fn,
                           static_cast<long long>(sh.d), static_cast<long long>(block.extent(2)));
    if (block.extent(1) != sh.w)
      return status::error(errc::shape_mismatch,
                           "%s: block_keys holds %lld tokens but the query block has w = %lld rows", fn,
                           static_cast<long long>(block.extent(1)), static_cast<long long>(sh.w));
  }
  if (!checked_add(sh.p, sh.has_block ? sh.w : 0, sh.cols))
    return status::error(errc::size_overflow, "%s: P + w overflows", fn);
  sh.out_cols = 0;
  sh.scale = score_scale(opt, sh.d);
  return {};
}

/// An output of attention_scores named `name` with `rows` rows (H_q per query head, H_kv after a GQA
/// reduction) for the inputs described by sh: P or (with block keys) P + w columns, no overlap with
/// the inputs. Sets sh.out_cols. Shared by every backend.
template <class QE, class KE>
status check_score_output(const char* fn, const char* name, const matrix_view<float>& out, index_t rows,
                          const char* rows_what, const kv_view<const QE>& q, const kv_view<const KE>& prefix,
                          const kv_view<const KE>& block, score_shape& sh) {
  KVEVICT_TRY(check_view(fn, name, out));
  if (out.extent(0) != rows)
    return status::error(errc::shape_mismatch, "%s: %s has %lld rows but there are %lld %s", fn, name,
                         static_cast<long long>(out.extent(0)), static_cast<long long>(rows), rows_what);
  sh.out_cols = out.extent(1);
  if (sh.out_cols != sh.p && !(sh.has_block && sh.out_cols == sh.cols)) {
    if (sh.has_block)
      return status::error(errc::shape_mismatch,
                           "%s: %s has %lld columns; expected P = %lld (prefix columns) or P + w = %lld (all "
                           "visible columns)",
                           fn, name, static_cast<long long>(sh.out_cols), static_cast<long long>(sh.p),
                           static_cast<long long>(sh.cols));
    return status::error(errc::shape_mismatch,
                         "%s: %s has %lld columns; expected P = %lld (no block keys were given, so there are no "
                         "block columns)",
                         fn, name, static_cast<long long>(sh.out_cols), static_cast<long long>(sh.p));
  }
  const auto o = range_of(out);
  if (o.intersects(range_of(q))) return status::error(errc::overlap, "%s: %s overlaps queries in memory", fn, name);
  if (o.intersects(range_of(prefix)))
    return status::error(errc::overlap, "%s: %s overlaps prefix_keys in memory", fn, name);
  if (sh.has_block && o.intersects(range_of(block)))
    return status::error(errc::overlap, "%s: %s overlaps block_keys in memory", fn, name);
  return {};
}

template <class QE, class KE>
status check_attention_scores(const char* fn, const kv_view<const QE>& q, const kv_view<const KE>& prefix,
                              const kv_view<const KE>& block, const matrix_view<float>& out,
                              const score_options& opt, score_shape& sh) {
  KVEVICT_TRY(check_attention_inputs(fn, q, prefix, block, opt, sh));
  return check_score_output(fn, "out", out, sh.hq, "query heads", q, prefix, block, sh);
}

/// The score shape of attention_scores from sizes alone (what its size queries need), with the
/// shape errors of attention_scores.
inline status score_shape_from_sizes(const char* fn, index_t query_heads, index_t kv_heads, index_t w,
                                     index_t prefix_len, index_t dim, bool block_keys, index_t out_cols,
                                     const score_options& opt, score_shape& sh) {
  KVEVICT_TRY(check_score_options(fn, opt));
  if (query_heads < 0 || kv_heads <= 0 || w <= 0 || prefix_len < 0 || dim <= 0 || out_cols < 0)
    return status::error(errc::invalid_argument,
                         "%s: shapes must be positive (query_heads %lld, kv_heads %lld, w %lld, prefix_len %lld, dim "
                         "%lld, out_cols %lld)",
                         fn, static_cast<long long>(query_heads), static_cast<long long>(kv_heads),
                         static_cast<long long>(w), static_cast<long long>(prefix_len), static_cast<long long>(dim),
                         static_cast<long long>(out_cols));
  if (query_heads % kv_heads != 0)
    return status::error(errc::shape_mismatch, "%s: %lld query heads are not a multiple of %lld KV heads (GQA)", fn,
                         static_cast<long long>(query_heads), static_cast<long long>(kv_heads));
  sh.hq = query_heads;
  sh.hkv = kv_heads;
  sh.group = query_heads / kv_heads;
  sh.w = w;
  sh.p = prefix_len;
  sh.d = dim;
  sh.has_block = block_keys;
  if (!checked_add(prefix_len, block_keys ? w : 0, sh.cols))
    return status::error(errc::size_overflow, "%s: P + w overflows", fn);
  if (out_cols != sh.p && !(block_keys && out_cols == sh.cols))
    return status::error(errc::shape_mismatch, "%s: out_cols %lld is neither P = %lld nor P + w = %lld", fn,
                         static_cast<long long>(out_cols), static_cast<long long>(sh.p),
                         static_cast<long long>(sh.cols));
  sh.out_cols = out_cols;
  sh.scale = score_scale(opt, dim);
  return {};
}

}  // namespace kvevict::detail
