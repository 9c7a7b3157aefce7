// kvevict/score.hpp: attention-based token scores (the first stage of every attention recipe) and
// key-norm scores. docs/score.md has the formulas, defaults and deviations per recipe.
//
//   attention_scores(be, ws, queries, prefix_keys, block_keys, out, opt)   the general stage
//   window_scores(be, ws, window_queries, keys, out, opt)   SnapKV family: the block is the last w prompt tokens
//   h2o_scores(be, ws, queries, keys, out, normalised)      H2O: the block is the whole prompt
//   tova_scores(be, ws, last_query, keys, out)              TOVA: the block is the last token
//   key_norm_scores(be, keys, out)                          Knorm: -||k||_2
//   position_scores(be, out)                                StreamingLLM: the position t
//   split_window(keys, w)                                   [:, :T-w] and [:, T-w:] views, no copies
//
// A *block* is w post-RoPE query rows [H_q][w][d]: the last w prompt tokens (SnapKV, PyramidKV,
// AdaKV, CAKE, LAVa, VATP windows), or an external block placed after the prompt (LookaheadKV
// lookahead tokens, LAQ pseudo queries, a draft model's queries for SpecKV, the real response for
// ground truth). Row i attends to the P prefix keys and, when the block's own keys are given, to
// block keys 0..i (causal inside the block). The softmax runs in fp32 over the whole visible row;
// the result keeps the prefix columns [H_q][P] or all visible columns [H_q][P + w], each column
// reduced over the w rows. Output is per query head: GQA reduction is its own stage.
//
// Ground truth (LookaheadKV Eq. 1) is attention_scores with the real response's queries as the
// block, the prompt keys as prefix, the response keys as block keys, reduce = mean, out [H_q][P].
//
// Host backends here (seq, par); no call allocates: scratch comes from the workspace (two-phase).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/host/score_host.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>
#include <kvevict/score_types.hpp>
#include <kvevict/detail/base/score_checks.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace kvevict {

namespace detail {
KVEVICT_SCORE_ABI_BEGIN

/// Sizes of the per-thread scratch of one attention_scores call (floats, each piece a multiple of
/// 16 floats so every piece starts 64-byte aligned relative to the slot).
struct score_plan {
  int threads = 1;
  index_t heads_per_task = 1, tasks_per_kv = 1, tasks = 0;
  index_t rows = 0;  ///< rows of the block buffer (<= score_rows, a multiple of every profile's mr)
  index_t ld = 0;    ///< logits buffer row stride
  index_t pld = 0;   ///< panel buffer row stride, 0 = none (the logits buffer is written in place)
  index_t nchunks = 0;  ///< softmax-statistics chunks per row
  index_t q_floats = 0, k_floats = 0, buf_floats = 0, pbuf_floats = 0, cmax_floats = 0, acc_floats = 0;
  index_t slot_floats = 0;
  bool welford = false;
};

inline status make_score_plan(const char* fn, const score_shape& sh, int threads, const score_options& opt,
                              score_plan& pl) {
  pl.threads = threads < 1 ? 1 : threads;
  pl.welford = opt.reduce == score_reduce::mean_plus_variance;
  if (sh.hq == 0 || sh.out_cols == 0) return {};  // nothing to compute
  // split each GQA group over several tasks only when there are fewer KV heads than threads;
  // results do not depend on the split (see detail/host/score_host.hpp)
  index_t want = (pl.threads + sh.hkv - 1) / sh.hkv;
  if (want > sh.group) want = sh.group;
  if (want < 1) want = 1;
  pl.heads_per_task = (sh.group + want - 1) / want;
  pl.tasks_per_kv = (sh.group + pl.heads_per_task - 1) / pl.heads_per_task;
  pl.tasks = sh.hkv * pl.tasks_per_kv;
  index_t task_rows = 0;
  if (!checked_mul(pl.heads_per_task, sh.w, task_rows))
    return status::error(errc::size_overflow, "%s: heads x w overflows", fn);
  pl.rows = round_up(task_rows < score_rows ? task_rows : score_rows, 8);
  // panels start every score_chunk columns and the micro-kernel writes whole nr-wide tiles, so a
  // row may be written up to nr - 1 columns past `cols`
  pl.ld = round_up(sh.cols + score_max_nr, 16);
  pl.nchunks = (sh.cols + score_chunk - 1) / score_chunk;
  const auto a16 = [](index_t x) { return round_up(x, 16); };
  bool ok = true;
  index_t t = 0;
  ok = ok && checked_mul(pl.rows, sh.d, t) && checked_mul(t, score_max_qrep, t);
  pl.q_floats = a16(t);
  ok = ok && checked_mul(score_max_key_tile + score_max_nr, sh.d, t);  // packed tile + widening scratch
  pl.k_floats = a16(t);
  ok = ok && checked_mul(pl.rows, pl.ld, t);
  pl.buf_floats = a16(t);
  if (ok && t > score_stream_min_bytes().load(std::memory_order_relaxed) / static_cast<index_t>(sizeof(float))) {
    pl.pld = round_up(score_chunk + score_max_nr, 16);
    ok = checked_mul(pl.rows, pl.pld, t);
    pl.pbuf_floats = a16(t);
  }
  ok = ok && checked_mul(pl.rows, pl.nchunks, t);
  pl.cmax_floats = a16(t);
  ok = ok && checked_mul(pl.heads_per_task, sh.out_cols, t) && checked_mul(t, pl.welford ? 2 : 1, t);
  pl.acc_floats = a16(t);
  ok = ok && checked_add(pl.q_floats, pl.k_floats, t) && checked_add(t, pl.buf_floats, t) &&
       checked_add(t, pl.pbuf_floats, t) && checked_add(t, pl.cmax_floats, t) && checked_add(t, pl.acc_floats, t);
  pl.slot_floats = t;
  ok = ok && checked_mul(t, pl.threads, t) && checked_mul(t, static_cast<index_t>(sizeof(float)), t);
  if (!ok) return status::error(errc::size_overflow, "%s: the scratch size overflows a 64-bit index", fn);
  return {};
}

/// The host's scratch: one slot of slot_floats floats per thread (the layout of both phases).
/// `end`: the bytes from ws.data to the end of the scratch (what must not overlap the inputs).
inline status carve_score_host(const char* fn, workspace& ws, const score_plan& pl, float*& scratch,
                               std::size_t& end) {
  workspace_carver carver(ws);
  scratch = carver.take<float>(static_cast<std::size_t>(pl.slot_floats * pl.threads));
  end = carver.used();
  return carver.finish(fn);
}

/// attention_scores' workspace for a checked shape on a backend, what the size query from sizes
/// (attention_scores_workspace_bytes) carves: the host backends' plan here, the CUDA backend's in
/// the specialisation in <kvevict/cuda/score.cuh>. `name`: the size query's name in messages.
template <class Backend>
struct score_workspace {
  static_assert(is_host_backend_v<Backend>,
                "attention_scores_workspace_bytes: host backends here; the CUDA one needs <kvevict/cuda/score.cuh>");
  static constexpr const char* name = "attention_scores_workspace_bytes";
  static status carve(const char* fn, Backend be, const score_shape& sh, const score_options& opt, workspace& ws) {
    score_plan pl;
    KVEVICT_TRY(make_score_plan(fn, sh, thread_count(be), opt, pl));
    float* scratch = nullptr;
    std::size_t end = 0;
    return carve_score_host(fn, ws, pl, scratch, end);
  }
};

template <class Backend, class QE, class KS>
void attention_scores_run(Backend be, const score_shape& sh, const score_plan& pl, float* scratch,
                          const kv_view<const QE>& q, const KS& prefix, const KS& block, const matrix_view<float>& out,
                          const score_options& opt);

template <class Backend, class QE, class KE>
status attention_scores_impl(const char* fn, Backend be, workspace& ws, const kv_view<const QE>& q,
                             const kv_view<const KE>& prefix, const kv_view<const KE>& block,
                             const matrix_view<float>& out, const score_options& opt) {
  static_assert(is_host_backend_v<Backend>,
                "attention_scores: host backends (seq, par, on(ex)) here; the CUDA overload is in <kvevict/cuda/score.cuh>");
  score_shape sh;
  KVEVICT_TRY(check_attention_scores(fn, q, prefix, block, out, opt, sh));
  score_plan pl;
  KVEVICT_TRY(make_score_plan(fn, sh, thread_count(be), opt, pl));
  float* scratch = nullptr;
  std::size_t scratch_end = 0;
  KVEVICT_TRY(carve_score_host(fn, ws, pl, scratch, scratch_end));
  const byte_range touched[] = {range_of(out), range_of(q), range_of(prefix), range_of(block)};
  KVEVICT_TRY(check_scratch_disjoint(fn, ws.is_query() ? nullptr : ws.data, scratch_end, touched,
                                     {"out", "queries", "prefix_keys", "block_keys"}));
  if (ws.is_query() || pl.tasks == 0) return {};
  attention_scores_run(be, sh, pl, scratch, q, prefix, block, out, opt);
  return {};
}

/// The work of attention_scores on validated inputs, over any key source KS (a kv_view, or the
/// paged keys of detail/host/paged_keys.hpp): the same kernels, so the same bits.
template <class Backend, class QE, class KS>
void attention_scores_run(Backend be, const score_shape& sh, const score_plan& pl, float* scratch,
                          const kv_view<const QE>& q, const KS& prefix, const KS& block, const matrix_view<float>& out,
                          const score_options& opt) {
  const index_t w = sh.w, p = sh.p, d = sh.d, oc = sh.out_cols;
  const host_isa isa = host_isa_now();
  float* const odata = out.data_handle();
  const index_t os0 = out.stride(0), os1 = out.stride(1);
  score_parallel(be, pl.tasks, pl.threads, [&](index_t task, int slot) {
    float* const qpack = scratch + static_cast<index_t>(slot) * pl.slot_floats;
    float* const kpack = qpack + pl.q_floats;
    float* const buf = kpack + pl.k_floats;
    float* const pbuf = pl.pld > 0 ? buf + pl.buf_floats : nullptr;
    float* const cmax = buf + pl.buf_floats + pl.pbuf_floats;
    float* const acc = cmax + pl.cmax_floats;
    const index_t g = task / pl.tasks_per_kv, sub = task % pl.tasks_per_kv;
    const index_t first = sub * pl.heads_per_task;
    const index_t nh = sh.group - first < pl.heads_per_task ? sh.group - first : pl.heads_per_task;
    const index_t head0 = g * sh.group + first;
    float* const m2 = acc + nh * oc;
    for (index_t t = 0; t < nh * oc * (pl.welford ? 2 : 1); ++t) acc[t] = 0.0f;
    const index_t rows_total = nh * w;
    for (index_t row0 = 0; row0 < rows_total; row0 += pl.rows) {
      const index_t nrows = rows_total - row0 < pl.rows ? rows_total - row0 : pl.rows;
      // the block's widest row: the last one, unless the block spans two query heads
      const index_t last = row0 + nrows - 1;
      const index_t imax = last / w != row0 / w ? w - 1 : last % w;
      const index_t cols = sh.has_block ? p + imax + 1 : p;
      float* const tmp = kpack + score_max_key_tile * d;  // widening scratch, nr x d floats
      index_t vis[score_rows];
      softmax_stats st[score_rows];
      for (index_t r = 0; r < nrows; ++r) vis[r] = sh.has_block ? p + (row0 + r) % w + 1 : p;
      score_block_softmax_dispatch(isa, opt.fused_multiply_add, buf, pl.ld, pbuf, pl.pld, qpack, kpack, tmp, q, head0, w,
                                   row0, nrows, prefix, block, g, p, cols, sh.scale, vis, cmax, pl.nchunks, st);
      for (index_t r = 0; r < nrows; ++r) {
        const index_t flat = row0 + r, hh = flat / w, i = flat % w;
        const float* row = buf + r * pl.ld;
        const float* cm = cmax + r * pl.nchunks;
        const index_t nvis = vis[r] < oc ? vis[r] : oc;
        if (pl.welford)
          score_row_welford(isa, row, nvis, oc, cm, st[r], 1.0f / static_cast<float>(i + 1), acc + hh * oc, m2 + hh * oc);
        else
          score_row_add(isa, row, nvis, cm, st[r], acc + hh * oc);
      }
    }
    for (index_t hh = 0; hh < nh; ++hh) {
      float* o = odata + (head0 + hh) * os0;
      const float* a = acc + hh * oc;
      const float* v = m2 + hh * oc;
      for (index_t j = 0; j < oc; ++j) {
        const index_t seen = j < p ? w : w - (j - p);
        o[j * os1] = score_finalize(opt.reduce, a[j], pl.welford ? v[j] : 0.0f, w, seen, opt.gamma, opt.variance);
      }
    }
  });
}

template <class T>
result<window_split<T>> split_window_impl(const char* fn, kv_view<T> keys, index_t w) {
  KVEVICT_TRY(check_view(fn, "keys", keys));
  const index_t tokens = keys.extent(1);
  if (w < 0 || w > tokens)
    return status::error(errc::invalid_argument, "%s: window w = %lld is outside [0, %lld] tokens", fn,
                         static_cast<long long>(w), static_cast<long long>(tokens));
  using exts = cuda::std::dextents<index_t, 3>;
  const cuda::std::array<index_t, 3> str{keys.stride(0), keys.stride(1), keys.stride(2)};
  const index_t h = keys.extent(0), d = keys.extent(2);
  T* const base = keys.data_handle();
  T* const wbase = w == 0 || h == 0 || d == 0 ? base : base + (tokens - w) * keys.stride(1);
  window_split<T> s;
  s.prefix = kv_view<T>(base, cuda::std::layout_stride::mapping<exts>(exts(h, tokens - w, d), str));
  s.window = kv_view<T>(wbase, cuda::std::layout_stride::mapping<exts>(exts(h, w, d), str));
  return s;
}

KVEVICT_SCORE_ABI_END
}  // namespace detail

/// Attention of a block of w query rows over P prefix keys (and the block's own keys, causally),
/// reduced per column over the rows.
///
///   queries     [H_q][w][d]   post-RoPE queries of the block (float, float16 or bfloat16)
///   prefix_keys [H_kv][P][d]  keys every row sees
///   block_keys  [H_kv][w][d]  the block's own keys (row i sees 0..i), or a view with 0 tokens = none
///   out         [H_q][P]      prefix columns, or [H_q][P + w] all visible columns (needs block keys)
///
/// logit_ij = scale * (q_i . k_j), scale = opt.scale or 1/sqrt(d); p_ij = softmax over row i's
/// visible columns in fp32 (max-subtracted, so large logits do not overflow); out[h][j] = the
/// reduction of p_ij over i (opt.reduce: mean by default, sum, mean_visible, mean_plus_variance).
/// Query head q uses KV head q / (H_q / H_kv). Inputs are converted to fp32; all arithmetic is fp32.
///
/// NaN/inf: a NaN logit (from a NaN or an inf x 0 in q or k) makes that row's probabilities NaN,
/// so every column the row sees becomes NaN in its head's output (a NaN key therefore poisons all
/// heads of its GQA group); a +inf logit does the same (inf - inf); -inf logits count as masked,
/// and a row whose visible logits are all -inf is NaN (as PyTorch's softmax). Selection ranks NaN last.
///
/// Errors (nothing is written): invalid views; w = 0; no KV heads; H_q not a multiple of H_kv;
/// d = 0 or head dims that differ; block_keys with other than H_kv heads or w tokens; out not
/// [H_q][P] or [H_q][P + w]; out overlapping an input; bad options (unknown enum, scale or gamma
/// negative or not finite); workspace smaller than queried or not float-aligned; sizes overflowing.
///
/// Workspace: per thread, a [min(128, heads x w) rows][P + w + 32] fp32 logits buffer (and a
/// [rows][1056] panel buffer when that exceeds 8 MiB), packed query and key tiles and the per-head
/// column accumulators (x2 for mean_plus_variance): linear in P and
/// bounded independently of w. seq and par return identical bits for any thread count, and so do
/// the SSE2/AVX2/AVX-512 kernels chosen at run time (docs/score.md).
template <class Backend, class Q, class K>
status attention_scores(Backend be, workspace& ws, kv_view<Q> queries, kv_view<K> prefix_keys, kv_view<K> block_keys,
                        matrix_view<float> out, const score_options& opt = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "attention_scores: elements must be float, float16 or bfloat16");
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  return detail::attention_scores_impl<Backend, QE, KE>("attention_scores", be, ws, kv_view<const QE>(queries),
                                                        kv_view<const KE>(prefix_keys), kv_view<const KE>(block_keys),
                                                        out, opt);
}

/// Workspace bytes attention_scores needs on backend `be` for a block of `w` queries in
/// `query_heads` heads over `prefix_len` prefix keys in `kv_heads` heads of dimension `dim`, with
/// or without the block's own keys, writing `out_cols` columns (prefix_len, or prefix_len + w with
/// block keys): what its size query reports, without views (for composite stages and engines
/// that size one arena per shape). Errors: the shape errors of attention_scores.
template <class Backend>
result<std::size_t> attention_scores_workspace_bytes(Backend be, index_t query_heads, index_t kv_heads, index_t w,
                                                    index_t prefix_len, index_t dim, bool block_keys,
                                                    index_t out_cols, const score_options& opt = {}) {
  constexpr const char* fn = detail::score_workspace<Backend>::name;
  detail::score_shape sh;
  KVEVICT_TRY(detail::score_shape_from_sizes(fn, query_heads, kv_heads, w, prefix_len, dim, block_keys, out_cols, opt,
                                             sh));
  workspace q;
  KVEVICT_TRY(detail::score_workspace<Backend>::carve(fn, be, sh, opt, q));
  return q.bytes;
}

/// prefix = keys[:, :T-w], window = keys[:, T-w:] as strided views of the same memory (no copies).
/// Errors: invalid view; w outside [0, T].
template <class T>
result<window_split<T>> split_window(kv_view<T> keys, index_t w) {
  return detail::split_window_impl("split_window", keys, w);
}

namespace detail {
KVEVICT_SCORE_ABI_BEGIN

/// The attention_scores call a wrapper (window, H2O, TOVA) stands for: its block, keys and options.
/// The prepare_* functions make the wrappers' own checks; every backend runs them.
template <class QE, class KE>
struct score_call {
  kv_view<const QE> queries;
  kv_view<const KE> prefix, block;
  score_options opt;
};

template <class QE, class KE>
result<score_call<QE, KE>> prepare_window_scores(const char* fn, const kv_view<const QE>& window_queries,
                                                 const kv_view<const KE>& keys, const score_options& opt) {
  KVEVICT_TRY(check_view(fn, "window_queries", window_queries));
  const auto split = split_window_impl(fn, keys, window_queries.extent(1));
  if (!split) return split.error();
  return score_call<QE, KE>{window_queries, split->prefix, split->window, opt};
}

template <class QE, class KE>
result<score_call<QE, KE>> prepare_h2o_scores(const char* fn, const kv_view<const QE>& queries,
                                              const kv_view<const KE>& keys, const matrix_view<float>& out,
                                              bool normalised, float scale) {
  KVEVICT_TRY(check_view(fn, "keys", keys));
  KVEVICT_TRY(check_view(fn, "out", out));
  if (out.extent(1) != keys.extent(1))
    return status::error(errc::shape_mismatch, "%s: out has %lld columns, expected T = %lld (one per prompt token)", fn,
                         static_cast<long long>(out.extent(1)), static_cast<long long>(keys.extent(1)));
  const auto split = split_window_impl(fn, keys, keys.extent(1));
  if (!split) return split.error();
  score_options opt;
  opt.reduce = normalised ? score_reduce::mean_visible : score_reduce::sum;
  opt.scale = scale;
  return score_call<QE, KE>{queries, split->prefix, split->window, opt};
}

template <class QE, class KE>
result<score_call<QE, KE>> prepare_tova_scores(const char* fn, const kv_view<const QE>& last_query,
                                               const kv_view<const KE>& keys, float scale) {
  KVEVICT_TRY(check_view(fn, "last_query", last_query));
  if (last_query.extent(1) != 1)
    return status::error(errc::shape_mismatch, "%s: last_query holds %lld tokens, expected 1", fn,
                         static_cast<long long>(last_query.extent(1)));
  const auto split = split_window_impl(fn, keys, 1);
  if (!split) return split.error();
  score_options opt;
  opt.reduce = score_reduce::sum;  // one row: sum = mean
  opt.scale = scale;
  return score_call<QE, KE>{last_query, split->prefix, split->window, opt};
}

/// The host wrappers' (window, H2O, TOVA) path: `prepare(queries, keys)` (a prepare_* function
/// given read-only views) makes the wrapper's checks and returns its attention_scores call, which
/// runs here.
template <class Backend, class Q, class K, class Prepare>
status run_score_wrapper(const char* fn, Backend be, workspace& ws, kv_view<Q> queries, kv_view<K> keys,
                         const matrix_view<float>& out, Prepare prepare) {
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  const auto c = prepare(kv_view<const QE>(queries), kv_view<const KE>(keys));
  if (!c) return c.error();
  return attention_scores_impl<Backend, QE, KE>(fn, be, ws, c->queries, c->prefix, c->block, out, c->opt);
}

KVEVICT_SCORE_ABI_END
}  // namespace detail

/// SnapKV family (SnapKV, PyramidKV, AdaKV, CAKE, LAVa, VATP windows; chunked eviction's window):
/// the block is the last w prompt tokens. window_queries [H_q][w][d] are those tokens' queries,
/// keys [H_kv][T][d] all prompt keys (T >= w); the last w keys are the block's own keys.
/// out [H_q][T - w] (prefix columns, what SnapKV ranks) or [H_q][T] (window columns too).
/// Errors: those of attention_scores and split_window (w > T).
template <class Backend, class Q, class K>
status window_scores(Backend be, workspace& ws, kv_view<Q> window_queries, kv_view<K> keys, matrix_view<float> out,
                     const score_options& opt = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "window_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "window_scores";
  return detail::run_score_wrapper(fn, be, ws, window_queries, keys, out, [&](const auto& q, const auto& k) {
    return detail::prepare_window_scores(fn, q, k, opt);
  });
}

/// H2O: every prompt query over every prompt key, causal. queries [H_q][T][d], keys [H_kv][T][d],
/// out [H_q][T]. normalised = false: sum over the queries (H2O's accumulated attention, as
/// KVCache-Factory); true: divided by the number of queries that see each key (T - j for key j,
/// kvpress's ObservedAttentionPress). Cost O(T^2 d) per head; workspace linear in T.
/// Errors: those of attention_scores; out not [H_q][T].
template <class Backend, class Q, class K>
status h2o_scores(Backend be, workspace& ws, kv_view<Q> queries, kv_view<K> keys, matrix_view<float> out,
                  bool normalised = false, float scale = 0.0f) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "h2o_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "h2o_scores";
  return detail::run_score_wrapper(fn, be, ws, queries, keys, out, [&](const auto& q, const auto& k) {
    return detail::prepare_h2o_scores(fn, q, k, out, normalised, scale);
  });
}

/// TOVA: the attention of the last token. last_query [H_q][1][d] is the last prompt (or newest
/// decoded) token's query; keys [H_kv][T][d] all keys, the last being that token's own.
/// out [H_q][T - 1] (earlier tokens) or [H_q][T] (the last token's self-attention too).
/// Errors: those of window_scores.
template <class Backend, class Q, class K>
status tova_scores(Backend be, workspace& ws, kv_view<Q> last_query, kv_view<K> keys, matrix_view<float> out,
                   float scale = 0.0f) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "tova_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "tova_scores";
  return detail::run_score_wrapper(fn, be, ws, last_query, keys, out, [&](const auto& q, const auto& k) {
    return detail::prepare_tova_scores(fn, q, k, scale);
  });
}

namespace detail {
// key_sq_accumulate / key_norm_score (one key row's -||k||_2): detail/base/stage_math.hpp.

/// key_norm_scores' inputs, checked the same way on every backend (the element type at compile
/// time, the views, out's shape and overlap): the keys as a read-only view.
template <class K>
result<kv_view<const std::remove_const_t<K>>> key_norm_inputs(const char* fn, const kv_view<K>& keys_in,
                                                              const matrix_view<float>& out) {
  static_assert(is_kv_element_v<K>, "key_norm_scores: elements must be float, float16 or bfloat16");
  const kv_view<const std::remove_const_t<K>> keys = keys_in;
  KVEVICT_TRY(check_view(fn, "keys", keys));
  KVEVICT_TRY(check_view(fn, "out", out));
  if (out.extent(0) != keys.extent(0) || out.extent(1) != keys.extent(1))
    return status::error(errc::shape_mismatch, "%s: out is [%lld][%lld] but keys are [%lld][%lld][*]", fn,
                         static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)),
                         static_cast<long long>(keys.extent(0)), static_cast<long long>(keys.extent(1)));
  if (range_of(out).intersects(range_of(keys)))
    return status::error(errc::overlap, "%s: out overlaps keys in memory", fn);
  return keys;
}

/// The checks of position_scores, shared by every backend: a valid view of at most 2^24 columns
/// (every position exact in fp32).
inline status check_position_scores(const char* fn, const matrix_view<float>& out) {
  KVEVICT_TRY(check_view(fn, "out", out));
  if (out.extent(1) > (index_t(1) << 24))
    return status::error(errc::invalid_argument, "%s: positions are exact in fp32 only up to 2^24 tokens (got %lld)",
                         fn, static_cast<long long>(out.extent(1)));
  return {};
}
}  // namespace detail

/// Knorm: out[h][t] = -||keys[h][t]||_2 (low-norm keys draw attention, so they score high; as
/// kvpress's KnormPress). keys [H_kv][T][d] any element type, out [H_kv][T]. No workspace.
/// NaN in a key gives NaN. Errors: invalid views; out not [H_kv][T]; out overlapping keys.
template <class Backend, class K>
status key_norm_scores(Backend be, kv_view<K> keys_in, matrix_view<float> out) {
  const auto checked = detail::key_norm_inputs("key_norm_scores", keys_in, out);
  if (!checked) return checked.error();
  const auto& keys = *checked;
  const index_t tokens = keys.extent(1), d = keys.extent(2);
  detail::parallel_for(be, keys.extent(0) * tokens, [&](index_t i) {
    const index_t h = i / tokens, t = i % tokens;
    out.data_handle()[h * out.stride(0) + t * out.stride(1)] =
        detail::key_norm_score(detail::kv_row(keys, h, t), d, keys.stride(2));
  });
  return {};
}

/// StreamingLLM's recency score: out[h][t] = t, so that after the sinks the most recent tokens rank
/// highest. out [R][T], T <= 2^24 (exact in fp32). No workspace. Errors: invalid view; T > 2^24
/// (invalid_argument).
template <class Backend>
status position_scores(Backend be, matrix_view<float> out) {
  KVEVICT_TRY(detail::check_position_scores("position_scores", out));
  const index_t tokens = out.extent(1);
  detail::parallel_for(be, out.extent(0), [&](index_t h) {
    for (index_t t = 0; t < tokens; ++t) out.data_handle()[h * out.stride(0) + t * out.stride(1)] = static_cast<float>(t);
  });
  return {};
}

}  // namespace kvevict
