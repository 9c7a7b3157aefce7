// kvevict/postprocess.hpp: the score stages between attention scores and selection, fused into one
// call: GQA reduce and pooling (in either order), value-norm weighting, protection.
//
//   postprocess_scores(be, ws, in /*[H_q][T]*/, out /*[H_kv][T]*/, values, opt, row_lengths, value_lengths)
//   postprocess_scores(be, ws, in, out, opt, row_lengths)                  (no value weighting)
//
// For each KV head h, with L = row_lengths[h] (or T), every position t < L of out[h] is
//   order = pool_first:  gqa over the group's query heads of pool(in[q])[t]     (kvpress, LookaheadKV)
//   order = gqa_first:   pool(gqa over the group of in[q])[t]                   (g times less pooling)
// then, if opt.weight_values, times ||v_t||_1 (per_token) or max_k ||v_k||_1 (head_max) of KV head h
// for t < value_lengths[h] (or every t), then protected (sinks and recent window of the row of L).
// Pooling covers the first P = L - opt.unpooled_tail positions (pool() sees a row of P); positions in
// [P, L) skip it and keep the group's reduced scores (the SnapKV family's window columns).
// Positions t >= L are not written. The value of every written position is bit for bit that of the
// chain of the individual stages with the same arguments:
//   pool_first: pool1d(in -> tmp [H_q][T], kind, kernel, pooled lengths P of each query head's KV head),
//               tmp[q][t] = in[q][t] for t in [P, L)
//               gqa_reduce(tmp -> out) ; weight_by_value_norm(out, values, mode, value_lengths) ;
//               protect(out, n_sink, n_recent, row_lengths)
//   gqa_first:  gqa_reduce(in -> tmp [H_kv][T]) ; pool1d(tmp -> out, ..., pooled lengths P),
//               out[h][t] = tmp[h][t] for t in [P, L) ; weight ; protect
// (the chain would also write positions >= L; this call leaves them alone). Pooling `none` is a copy,
// so the order does not matter then. The CUDA overload (<kvevict/cuda/postprocess.cuh>) is one kernel
// that reads the per-query-head scores once and gives the same bits.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/detail/host/post_host.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/weight.hpp>
#include <kvevict/postprocess_types.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvevict {

namespace detail {

/// Every check of postprocess_scores that needs no lengths' values, shared by every backend.
template <class VE>
status check_postprocess(const char* fn, const matrix_view<const float>& in, const matrix_view<float>& out,
                         const kv_view<const VE>& values, bool has_values, const postprocess_options& opt,
                         const std::int32_t* row_lengths, const std::int32_t* value_lengths) {
  KVEVICT_TRY(check_view(fn, "in", in));
  KVEVICT_TRY(check_view(fn, "out", out));
  KVEVICT_TRY(check_gqa_op(fn, opt.gqa));
  if (opt.order != gqa_order::pool_first && opt.order != gqa_order::gqa_first)
    return status::error(errc::invalid_argument, "%s: opt.order = %d is not a gqa_order (pool_first or gqa_first)", fn,
                         static_cast<int>(opt.order));
  pool_options po;
  po.divisor = opt.divisor;
  KVEVICT_TRY(check_pool_params(fn, opt.pool, opt.kernel, po));
  KVEVICT_TRY(check_protect_params(fn, opt.n_sink, opt.n_recent));
  if (opt.unpooled_tail < 0)
    return status::error(errc::invalid_argument, "%s: opt.unpooled_tail = %lld must be >= 0", fn,
                         static_cast<long long>(opt.unpooled_tail));
  KVEVICT_TRY(check_gqa_shapes(fn, in.extent(0), out.extent(0), in.extent(1), out.extent(1)));
  if (range_of(in).intersects(range_of(out)))
    return status::error(errc::overlap, "%s: in and out overlap in memory (use a separate output)", fn);
  if (opt.weight_values) {
    if (!has_values)
      return status::error(errc::invalid_argument, "%s: opt.weight_values is set but no values were given", fn);
    KVEVICT_TRY(check_weight_by_value_norm(fn, out, values, opt.weight));
    if (values.extent(0) != out.extent(0))
      return status::error(errc::shape_mismatch, "%s: values have %lld KV heads but out has %lld rows", fn,
                           static_cast<long long>(values.extent(0)), static_cast<long long>(out.extent(0)));
    KVEVICT_TRY(check_weight_overlap(fn, out, values, value_lengths));
  }
  if (lengths_inside(row_lengths, out.extent(0), range_of(out)))
    return status::error(errc::overlap, "%s: row_lengths lie inside out", fn);
  return {};
}

/// Writes the finished value of position t of a KV head's row: v times the weight factor when
/// weighted, then protected.
KVEVICT_HOST_DEVICE inline float postprocess_finish(float v, index_t t, bool weighted, float factor, index_t sink_end,
                                                    index_t recent_begin) {
  if (weighted) v = mul_rn(v, factor);
  return protect_value(v, t, sink_end, recent_begin);
}

/// The host's scratch: a row of T floats per KV head when pooling (the layout of both phases).
inline status carve_postprocess_host(const char* fn, workspace& ws, index_t hkv, index_t T,
                                     const postprocess_options& opt, float*& tmp) {
  index_t tmp_floats = 0;
  if (opt.pool != pool_kind::none && !checked_mul(hkv, T, tmp_floats))
    return status::error(errc::size_overflow, "%s: the scratch size overflows", fn);
  workspace_carver carver(ws);
  tmp = carver.take<float>(static_cast<std::size_t>(tmp_floats));
  return carver.finish(fn);
}

/// A KV head's value weighting, as the finish applies it: positions [0, end) weighted, by the L1
/// norm of their own value row (per_token: rows vh + t * rs, elements es apart, d of them) or by one
/// factor (head_max); end = 0 when not weighted.
template <class VE>
struct post_weights {
  const VE* vh = nullptr;
  index_t rs = 0, es = 0, d = 0, end = 0;
  bool per_token = false;
  float factor = 0.0f;
  const float* norms = nullptr;  // per_token: the row's norms computed up front (position-indexed), or none
};

/// Positions per chunk of the chunked paths: a multiple of 80 (the k = 5 average pooling kernel's
/// 16 blocks: chunks of 1024 left 6% of their outputs to the slower phase kernel, and fused CAKE
/// 6% behind its chain) and of 16 (vectors); 4 rows of it stay in L1.
constexpr index_t post_chunk = 1040;
/// Finishes the positions [c0, c0 + n) (n <= post_chunk) of a contiguous output row, o pointing at
/// position c0: the GQA mean's division when div_g > 0, the weight, the protection of a row whose
/// sinks end at sink_end and whose recent window begins at recent_begin (post_finish, AVX2 when the
/// CPU has it). Per-token norms are computed only for the weighted positions outside the protected
/// ranges (those are +inf whatever the score), into wbuf (post_chunk floats).
template <class VE>
inline void post_finish_chunk(float* o, index_t c0, index_t n, index_t div_g, index_t sink_end, index_t recent_begin,
                              const post_weights<VE>& wt, float* wbuf) {
  const auto clamp = [](index_t v, index_t lo, index_t hi) { return v < lo ? lo : v > hi ? hi : v; };
  const index_t s = clamp(sink_end - c0, 0, n);
  const index_t r = clamp((recent_begin > sink_end ? recent_begin : sink_end) - c0, s, n);
  const index_t e = clamp(wt.end - c0, s, r);
  const float* w = nullptr;
  if (wt.per_token && e > s && wt.norms != nullptr) {
    w = wt.norms + c0;
  } else if (wt.per_token && e > s) {
    for (index_t p = s; p < e; p += norm_block) {
      const index_t m = e - p < norm_block ? e - p : norm_block;
      value_l1_norms(wt.vh + (c0 + p) * wt.rs, wt.rs, wt.es, m, wt.d, wbuf + p);
    }
    w = wbuf;
  }
  post_finish(o, n, s, e, r, div_g, w, wt.factor);
}

/// Query heads pooled per pass of post_chunked_contiguous: its stack buffer holds post_rows chunks.
constexpr index_t post_rows = 4;

/// The pool_first steps on contiguous rows whose pooled part P takes the host's small-kernel path:
/// for each chunk of positions [c0, c1), pool (or copy, at t >= P) the group's query heads into the
/// rows of `rows` (post_rows x post_chunk floats) and reduce them by gqa_reduce's kernels (gqa_rows:
/// max, or the sum in head order; beyond post_rows heads the next pass starts from the running
/// result, so the order is still 0, 1, ..., g - 1), then the GQA finish, the weight and the
/// protection. Every position gets the same operations in the same order as the whole-row steps, so
/// the same bits.
template <class VE>
inline void post_chunked_contiguous(const postprocess_options& opt, const float* first, index_t is0, float* o,
                                    index_t L, index_t P, index_t g, const post_weights<VE>& wt, float* rows,
                                    float* wbuf) {
  const bool is_max = opt.pool == pool_kind::max;
  const gqa_op combine = opt.gqa == gqa_op::max ? gqa_op::max : gqa_op::sum;  // (the mean divides in the finish)
  const index_t sink_end = protect_sink_end(L, opt.n_sink), recent_begin = protect_recent_begin(L, opt.n_recent);
  const index_t div_g = opt.gqa == gqa_op::mean ? g : 0;
  for (index_t c0 = 0; c0 < L; c0 += post_chunk) {
    const index_t c1 = L - c0 < post_chunk ? L : c0 + post_chunk, m = c1 - c0;
    const index_t pe = P < c0 ? c0 : P < c1 ? P : c1;  // [c0, pe) pooled, [pe, c1) copied
    // the pooling of a whole interior chunk summed over the group in registers (the same bits)
    if (combine == gqa_op::sum && g > 1 && c0 >= opt.kernel / 2 && pe == c1 && c1 <= P - opt.kernel / 2 &&
        pool_fast_group_sum(is_max, first, is0, g, o + c0, opt.kernel, c0, c1)) {
      post_finish_chunk(o + c0, c0, m, div_g, sink_end, recent_begin, wt, wbuf);
      continue;
    }
    for (index_t j = 0; j < g;) {
      // row 0 of a later pass is the result so far; a group of one head is pooled into o directly
      const index_t r0 = j == 0 ? 0 : 1, n = g - j < post_rows - r0 ? g - j : post_rows - r0;
      if (r0 == 1) std::memcpy(rows, o + c0, static_cast<std::size_t>(m) * sizeof(float));
      for (index_t k = 0; k < n; ++k, ++j) {
        const float* x = first + j * is0;
        float* y = g == 1 ? o + c0 : rows + (r0 + k) * post_chunk;
        if (c0 < pe) pool_row_part(is_max, opt.divisor, x, y, P, opt.kernel, c0, pe);
        std::memcpy(y + (pe - c0), x + pe, static_cast<std::size_t>(c1 - pe) * sizeof(float));
      }
      if (g > 1)
        for (index_t t = 0; t < m; t += gqa_chunk)
          gqa_rows(combine, o + c0 + t, rows + t, post_chunk, r0 + n, m - t < gqa_chunk ? m - t : gqa_chunk);
    }
    post_finish_chunk(o + c0, c0, m, div_g, sink_end, recent_begin, wt, wbuf);
  }
}

template <class Backend, class VE>
status postprocess_scores_impl(const char* fn, Backend be, workspace& ws, const matrix_view<const float>& in,
                               const matrix_view<float>& out, const kv_view<const VE>& values, bool has_values,
                               const postprocess_options& opt, const std::int32_t* row_lengths,
                               const std::int32_t* value_lengths) {
  KVEVICT_TRY(check_postprocess(fn, in, out, values, has_values, opt, row_lengths, value_lengths));
  const index_t hkv = out.extent(0), hq = in.extent(0), T = in.extent(1);
  KVEVICT_TRY(check_lengths(fn, "row_lengths", row_lengths, hkv, T));
  if (opt.weight_values) KVEVICT_TRY(check_lengths(fn, "value_lengths", value_lengths, hkv, values.extent(1)));
  const bool pooled = opt.pool != pool_kind::none;
  float* tmp = nullptr;
  KVEVICT_TRY(carve_postprocess_host(fn, ws, hkv, T, opt, tmp));
  const auto ints = [](const std::int32_t* p, index_t n) {
    const auto b = reinterpret_cast<std::uintptr_t>(p);
    return p ? byte_range{b, b + static_cast<std::uintptr_t>(n) * sizeof(std::int32_t)} : byte_range{};
  };
  const byte_range touched[] = {range_of(out), range_of(in), has_values ? range_of(values) : byte_range{},
                                ints(row_lengths, hkv), ints(value_lengths, hkv)};
  // the workspace counts from ws.data (the carver's alignment padding included), as every stage's check does
  const std::size_t scratch_end =
      ws.is_query() || !pooled ? 0
                               : static_cast<std::size_t>(reinterpret_cast<const unsigned char*>(tmp + hkv * T) -
                                                          static_cast<const unsigned char*>(ws.data));
  KVEVICT_TRY(check_scratch_disjoint(fn, ws.is_query() ? nullptr : ws.data, scratch_end, touched,
                                     {"out", "in", "values", "row_lengths", "value_lengths"}));
  if (ws.is_query() || hkv == 0 || T == 0) return {};
  const index_t g = hq / hkv;
  const float* const ip = in.data_handle();
  float* const op = out.data_handle();
  const index_t is0 = in.stride(0), is1 = in.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  parallel_for(be, hkv, [&](index_t h) {
    const index_t L = row_lengths != nullptr ? row_lengths[h] : T;
    const index_t P = pooled_length(L, opt.unpooled_tail);
    float* const o = op + h * os0;
    float* const t = tmp + h * T;  // only when pooled
    float wbuf[post_chunk];
    const float* const first = ip + (h * g) * is0;
    // the head's weighting: the head-max factor needs every norm of the head first
    post_weights<VE> wt;
    if (opt.weight_values) {
      const index_t vlen = value_lengths != nullptr ? value_lengths[h] : values.extent(1);
      wt.vh = values.data_handle() + h * values.stride(0);
      wt.rs = values.stride(1);
      wt.es = values.stride(2);
      wt.d = values.extent(2);
      wt.end = L < vlen ? L : vlen;
      wt.per_token = opt.weight == value_weight::per_token;
      if (!wt.per_token) {
        for (index_t k0 = 0; k0 < vlen; k0 += norm_block) {
          const index_t m = vlen - k0 < norm_block ? vlen - k0 : norm_block;
          value_l1_norms(wt.vh + k0 * wt.rs, wt.rs, wt.es, m, wt.d, wbuf);
          wt.factor = max_nan_fold(wt.factor, wbuf, m);
        }
      }
    }
    const index_t sink_end = protect_sink_end(L, opt.n_sink), recent_begin = protect_recent_begin(L, opt.n_recent);
    // the finish (weight, protection) of a contiguous output row whose GQA is finished, by chunks
    const auto finish_row = [&] {
      for (index_t c0 = 0; c0 < L; c0 += post_chunk)
        post_finish_chunk(o + c0, c0, L - c0 < post_chunk ? L - c0 : post_chunk, 0, sink_end, recent_begin, wt, wbuf);
    };
    if (os1 == 1 && is1 == 1 && !pooled) {
      // contiguous rows, no pooling: each chunk reduced by gqa_reduce's kernels (gqa_rows, the bits
      // of the per-element fold) and finished while in L1
      for (index_t c = 0; c < L; c += gqa_chunk) {
        const index_t n = L - c < gqa_chunk ? L - c : gqa_chunk;
        gqa_rows(opt.gqa, o + c, first + c, is0, g, n);
        post_finish_chunk(o + c, c, n, 0, sink_end, recent_begin, wt, wbuf);
      }
      return;
    }
    if (!pooled || opt.order == gqa_order::gqa_first) {
      // x[p] = gqa over the group of in[.][p], into the output (no pooling) or the scratch row
      float* const x = pooled ? t : o;
      const index_t xs = pooled ? 1 : os1;
      if (xs == 1 && is1 == 1) {
        // contiguous rows: gqa_reduce's kernels (gqa_rows), the bits of the per-element fold
        for (index_t c = 0; c < L; c += gqa_chunk) gqa_rows(opt.gqa, x + c, first + c, is0, g, L - c < gqa_chunk ? L - c : gqa_chunk);
      } else {
        for (index_t p = 0; p < L; ++p) x[p * xs] = first[p * is1];
        for (index_t j = 1; j < g; ++j) {
          const float* row = ip + (h * g + j) * is0;
          for (index_t p = 0; p < L; ++p) x[p * xs] = gqa_combine(opt.gqa, x[p * xs], row[p * is1]);
        }
        for (index_t p = 0; p < L; ++p) x[p * xs] = gqa_finish(opt.gqa, x[p * xs], g);
      }
      if (pooled && os1 == 1 && pool_fast_applies(1, 1, P, opt.kernel)) {
        // contiguous output, small kernel: pool, copy the unpooled tail and finish by chunks in L1
        for (index_t c0 = 0; c0 < L; c0 += post_chunk) {
          const index_t c1 = L - c0 < post_chunk ? L : c0 + post_chunk;
          const index_t pe = P < c0 ? c0 : P < c1 ? P : c1;  // [c0, pe) pooled, [pe, c1) copied
          if (c0 < pe) pool_row_part(opt.pool == pool_kind::max, opt.divisor, t, o + c0, P, opt.kernel, c0, pe);
          for (index_t p = pe; p < c1; ++p) o[p] = t[p];
          post_finish_chunk(o + c0, c0, c1 - c0, 0, sink_end, recent_begin, wt, wbuf);
        }
        return;
      }
      if (pooled) {
        pool_row(opt.pool, opt.divisor, t, 1, o, os1, P, opt.kernel);
        for (index_t p = P; p < L; ++p) o[p * os1] = t[p];
      }
    } else if (os1 == 1 && is1 == 1 && pool_fast_applies(1, 1, P, opt.kernel)) {
      // contiguous rows, small kernel: the same steps by chunks of post_chunk positions, each
      // chunk's pooled rows, sum, weight and protection in L1 (one pass over the output). Per-token
      // norms first, into t (unused on this path): one stream over the values, which read from DRAM
      // took 1.2x as long interleaved with the chunks (docs/PERFORMANCE.md, "Issue 18, round thirteen")
      if (wt.per_token) {
        const index_t e = wt.end < sink_end ? sink_end : wt.end < recent_begin ? wt.end : recent_begin;
        for (index_t p = sink_end; p < e; p += norm_block)
          value_l1_norms(wt.vh + p * wt.rs, wt.rs, wt.es, e - p < norm_block ? e - p : norm_block, wt.d, t + p);
        wt.norms = t;
      }
      float rows[post_rows * post_chunk];
      post_chunked_contiguous(opt, first, is0, o, L, P, g, wt, rows, wbuf);
      return;
    } else if (os1 == 1 && is1 == 1) {
      // contiguous rows: the same steps with vectorisable loops, the GQA finish fused with the
      // weight and the protection (one pass)
      pool_row(opt.pool, opt.divisor, first, 1, o, 1, P, opt.kernel);
      for (index_t p = P; p < L; ++p) o[p] = first[p];
      for (index_t j = 1; j < g; ++j) {
        const float* x = ip + (h * g + j) * is0;
        pool_row(opt.pool, opt.divisor, x, 1, t, 1, P, opt.kernel);
        for (index_t p = P; p < L; ++p) t[p] = x[p];
        post_combine(opt.gqa == gqa_op::max, o, t, L);
      }
      for (index_t c0 = 0; c0 < L; c0 += post_chunk)
        post_finish_chunk(o + c0, c0, L - c0 < post_chunk ? L - c0 : post_chunk, opt.gqa == gqa_op::mean ? g : 0,
                          sink_end, recent_begin, wt, wbuf);
      return;
    } else {
      // pool each query head of the group (its unpooled tail copied) and combine in head order; the
      // output row accumulates
      const auto pool_with_tail = [&](const float* x, float* y, index_t ys) {
        pool_row(opt.pool, opt.divisor, x, is1, y, ys, P, opt.kernel);
        for (index_t p = P; p < L; ++p) y[p * ys] = x[p * is1];
      };
      pool_with_tail(first, o, os1);
      for (index_t j = 1; j < g; ++j) {
        pool_with_tail(ip + (h * g + j) * is0, t, 1);
        for (index_t p = 0; p < L; ++p) o[p * os1] = gqa_combine(opt.gqa, o[p * os1], t[p]);
      }
      for (index_t p = 0; p < L; ++p) o[p * os1] = gqa_finish(opt.gqa, o[p * os1], g);
    }
    if (os1 == 1) return finish_row();
    // strided output: the finish per element
    for (index_t p0 = 0; p0 < L; p0 += norm_block) {
      const index_t m = L - p0 < norm_block ? L - p0 : norm_block;
      const index_t mw = wt.end - p0 < m ? (wt.end > p0 ? wt.end - p0 : 0) : m;
      if (wt.per_token && mw > 0) value_l1_norms(wt.vh + p0 * wt.rs, wt.rs, wt.es, mw, wt.d, wbuf);
      for (index_t k = 0; k < m; ++k) {
        const index_t p = p0 + k;
        const bool weighted = p < wt.end;
        const float f = weighted && wt.per_token ? wbuf[k] : wt.factor;
        o[p * os1] = postprocess_finish(o[p * os1], p, weighted, f, sink_end, recent_begin);
      }
    }
  });
  return {};
}

}  // namespace detail

/// The fused post-processing of per-query-head scores (see the file comment). in [H_q][T], out
/// [H_kv][T] (any strides, not overlapping in), values [H_kv][T_v][d] with T_v >= T (read only when
/// opt.weight_values), row_lengths and value_lengths null or H_kv int32 lengths in [0, T] and
/// [0, T_v]. Workspace: H_kv x T floats when pooling (the host's per-row scratch), else none.
/// Errors (nothing written): invalid views; H_q not a multiple of H_kv, H_q = 0 < H_kv, T differing
/// (shape_mismatch); opt.gqa / opt.order / opt.pool / opt.divisor / opt.weight outside their enums,
/// an even or non-positive kernel, negative n_sink or n_recent (invalid_argument); weighting without
/// values, values with other than H_kv heads or fewer than T tokens; a length out of range
/// (out_of_range); in overlapping out, values overlapping out, lengths inside out (overlap); workspace
/// too small.
template <class Backend, class V>
status postprocess_scores(Backend be, workspace& ws, matrix_view<const float> in, matrix_view<float> out,
                          kv_view<V> values, const postprocess_options& opt, const std::int32_t* row_lengths = nullptr,
                          const std::int32_t* value_lengths = nullptr) {
  static_assert(is_kv_element_v<V>, "postprocess_scores: values must be float, float16 or bfloat16");
  using VE = std::remove_const_t<V>;
  return detail::postprocess_scores_impl<Backend, VE>("postprocess_scores", be, ws, in, out, kv_view<const VE>(values),
                                                      true, opt, row_lengths, value_lengths);
}

/// Workspace bytes postprocess_scores needs on a host backend for `query_heads` x `tokens` scores
/// reduced to `kv_heads` rows, weighted by values of `value_tokens` tokens (what its size query
/// reports, from shapes alone). Errors: negative sizes, overflow.
template <class Backend>
result<std::size_t> postprocess_scores_workspace_bytes(Backend, index_t query_heads, index_t kv_heads, index_t tokens,
                                                       index_t value_tokens, const postprocess_options& opt) {
  constexpr const char* fn = "postprocess_scores_workspace_bytes";
  if (query_heads < 0 || kv_heads < 0 || tokens < 0 || value_tokens < 0)
    return status::error(errc::invalid_argument, "%s: sizes must be >= 0", fn);
  workspace q;
  float* tmp = nullptr;
  KVEVICT_TRY(detail::carve_postprocess_host(fn, q, kv_heads, tokens, opt, tmp));
  return q.bytes;
}

/// postprocess_scores without value weighting (opt.weight_values must be false).
template <class Backend>
status postprocess_scores(Backend be, workspace& ws, matrix_view<const float> in, matrix_view<float> out,
                          const postprocess_options& opt, const std::int32_t* row_lengths = nullptr) {
  return detail::postprocess_scores_impl<Backend, float>("postprocess_scores", be, ws, in, out, kv_view<const float>{},
                                                         false, opt, row_lengths, nullptr);
}

}  // namespace kvevict
