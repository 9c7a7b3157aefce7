// kvevict/recipes.hpp: the published eviction recipes as small compositions of stages.
//
//   recipe r = recipe::snapkv();                         // defaults of the paper / public code
//   recipe_scores(be, ws, r, queries, keys, values, scores)   // -> [H_kv][T], higher = keep
//   recipe_select(be, ws, r, scores, budget, kept)            // -> [H_kv][budget] ascending
//
// A recipe is data (which stages, with which parameters), not a class hierarchy: every field is
// public and any combination is valid, so recipes nobody has tried (TOVA queries with LAVa
// weighting, CAKE statistics over lookahead tokens, ...) are one assignment away. Budgets across
// heads and layers (PyramidKV, AdaKV, LAVa, CAKE, DuoAttention) are the budget allocators' job;
// recipe_select also takes per-head budgets in ragged form.
//
// recipe_scores runs, for the attention recipes:
//   score    attention of the recipe's queries over the prompt keys (score.hpp), per query head
//   pool     1-D max/avg over the prompt columns (pool.hpp); with the prompt-window query source
//            only the prefix columns [0, T - w) are pooled, as KVCache-Factory pools
//            attn[..., -w:, :-w] (the window columns keep their raw scores)
//   gqa      mean / max / sum over each group (gqa.hpp), before or after pooling (`order`)
//   weight   value norms (weight.hpp): VATP per token, LAVa per-head max
//   protect  the first n_sink and last n_recent tokens set to +inf (protect.hpp)
// and for the others: Knorm = -||k||_2 (key_norm_scores), StreamingLLM = the token's position
// (so the most recent tokens rank highest after the sinks).
//
// Query sources of the attention recipes (the `queries` argument):
//   prompt_window   [H_q][w][d]: the last w prompt tokens' queries (SnapKV family); their keys are
//                   the last w rows of `keys`, attended causally; w = r.window.
//   external_block  [H_q][n][d]: queries placed after the prompt (LookaheadKV's lookahead tokens,
//                   LAQ's pseudo-decoded tokens, a draft model's queries, the real response for
//                   the ground-truth oracle); `block_keys` [H_kv][n][d] are their own keys
//                   (causal inside the block) or a 0-token view for none.
//   h2o             [H_q][T][d]: every prompt query (causal over the prompt).
//   tova            [H_q][1][d]: the last prompt token's query.
//   none            Knorm and StreamingLLM read no queries (pass an empty view).
// Queries and keys are post-RoPE. Element types float, float16, bfloat16; fp32 arithmetic.
//
// Scratch: recipe_scores needs two [H_q][T] fp32 score buffers, H_q row lengths and the scoring stage's own
// workspace, all from the caller (two-phase protocol; recipe_scores_workspace_size gives the
// size from shapes alone). Nothing allocates.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/checks.hpp>
#include <kvevict/detail/parallel.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/weight.hpp>
#include <kvevict/workspace.hpp>

#include <algorithm>
#include <cstring>
#include <string_view>

namespace kvevict {

/// Which scoring family a recipe belongs to (it fixes how `queries` is read).
enum class recipe_kind {
  streaming_llm,  ///< sinks + most recent tokens (score = position)
  h2o,            ///< accumulated attention of every prompt query
  tova,           ///< attention of the last prompt token
  snapkv,         ///< observation-window attention (also PyramidKV / AdaKV scores)
  knorm,          ///< -||k||_2
  vatp,           ///< window attention x ||v_i||_1
  lava,           ///< window attention x max_k ||v_k||_1, GQA max
  cake,           ///< window mean + gamma * variance
};

enum class query_source {
  prompt_window,   ///< the last `window` prompt tokens (their keys are the last rows of `keys`)
  external_block,  ///< queries placed after the prompt, with optional own keys
};

/// Every parameter of a recipe. Named constructors give the published defaults; each documents
/// where it deviates from the paper or from KVCache-Factory / kvpress, and why.
struct recipe {
  recipe_kind kind = recipe_kind::snapkv;
  query_source source = query_source::prompt_window;  ///< window recipes only
  index_t window = 32;                                ///< observation window w (prompt_window)
  pool_kind pool = pool_kind::max;
  index_t kernel = 7;
  pool_options pool_opts{};
  gqa_op gqa = gqa_op::mean;
  gqa_order order = gqa_order::pool_first;
  index_t n_sink = 0;     ///< first tokens always kept
  index_t n_recent = 32;  ///< last tokens always kept (SnapKV family: the window itself)
  score_options score{};  ///< row reduction (mean, sum, mean_visible, mean + gamma var), scale
  value_weight weight = value_weight::per_token;  ///< used by vatp (per_token) and lava (head_max)

  /// SnapKV (Li et al. 2024) as KVCache-Factory runs it: window 32, mean over the window rows,
  /// max pool 7, GQA mean (pool then reduce), the window always kept. kvpress's SnapKVPress uses
  /// avg pool 5 instead; set pool/kernel for that. PyramidKV and AdaKV use these scores with
  /// their own budgets.
  static recipe snapkv() { return recipe{}; }

  /// StreamingLLM (Xiao et al. 2024): 4 attention sinks + the most recent tokens; the budget
  /// decides how many recent tokens (budget - n_sink). No attention is computed.
  static recipe streaming_llm(index_t sinks = 4) {
    recipe r;
    r.kind = recipe_kind::streaming_llm;
    r.pool = pool_kind::none;
    r.kernel = 1;
    r.n_sink = sinks;
    r.n_recent = 0;
    return r;
  }

  /// H2O (Zhang et al. 2023): attention summed over every prompt query (accumulated attention,
  /// as KVCache-Factory's H2O; score.reduce = mean_visible gives kvpress's normalised variant),
  /// no pooling, GQA mean, the last 32 tokens kept. Deviation: the paper splits the budget 50/50
  /// between heavy hitters and recent tokens; here the recent part is fixed (n_recent), as in
  /// KVCache-Factory, so budgets compare across recipes.
  static recipe h2o() {
    recipe r;
    r.kind = recipe_kind::h2o;
    r.pool = pool_kind::none;
    r.kernel = 1;
    r.score.reduce = score_reduce::sum;
    return r;
  }

  /// TOVA (Oren et al. 2024): the last prompt token's attention, per KV head (GQA mean), no
  /// pooling, nothing protected but what the scores keep (the last token's self-attention is
  /// scored like any other column). Deviation: kvpress's TOVAPress averages over all heads, giving
  /// every head the same kept set; here each KV head selects its own.
  static recipe tova() {
    recipe r;
    r.kind = recipe_kind::tova;
    r.pool = pool_kind::none;
    r.kernel = 1;
    r.n_recent = 0;
    return r;
  }

  /// Knorm (Devoto et al. 2024, kvpress KnormPress): keep the keys of smallest L2 norm; nothing
  /// protected.
  static recipe knorm() {
    recipe r;
    r.kind = recipe_kind::knorm;
    r.pool = pool_kind::none;
    r.kernel = 1;
    r.n_recent = 0;
    return r;
  }

  /// VATP (Guo et al. 2024): SnapKV's window scores x ||v_i||_1. Deviation: VATP was introduced on
  /// top of accumulated attention; DESIGN and LAVa's table use the window scores, pooled as
  /// SnapKV's, weighted after the GQA reduction (one value row per KV head).
  static recipe vatp() {
    recipe r;
    r.kind = recipe_kind::vatp;
    r.weight = value_weight::per_token;
    return r;
  }

  /// LAVa score (Shen et al. 2025, Eq. 6): window attention x max_k ||v_k||_1 of the head, GQA
  /// max (paper §4.3), max pool 7 as SnapKV. The head factor matters only when heads compete
  /// (layer-wise selection: the LAVa allocator); with per-head budgets LAVa ranks like SnapKV
  /// with GQA max.
  static recipe lava() {
    recipe r;
    r.kind = recipe_kind::lava;
    r.gqa = gqa_op::max;
    r.weight = value_weight::head_max;
    return r;
  }

  /// CAKE's eviction indicator (Qin et al. 2025): mean + gamma * variance over the window rows
  /// (gamma 200, unbiased variance as torch.var), avg pool 5 then GQA mean as CAKE's code does
  /// (cake_cache.py), the window kept. CAKE's layer budgets are the allocator's job.
  static recipe cake() {
    recipe r;
    r.kind = recipe_kind::cake;
    r.score.reduce = score_reduce::mean_plus_variance;
    r.score.gamma = 200.0f;
    r.pool = pool_kind::avg;
    r.kernel = 5;
    return r;
  }
};

/// "snapkv", "streaming_llm", ... (the names the tools accept).
constexpr const char* recipe_name(recipe_kind k) noexcept {
  switch (k) {
    case recipe_kind::streaming_llm: return "streaming_llm";
    case recipe_kind::h2o: return "h2o";
    case recipe_kind::tova: return "tova";
    case recipe_kind::snapkv: return "snapkv";
    case recipe_kind::knorm: return "knorm";
    case recipe_kind::vatp: return "vatp";
    case recipe_kind::lava: return "lava";
    case recipe_kind::cake: return "cake";
  }
  return "unknown";
}

/// The recipe with its published defaults for a name (recipe_name), or invalid_argument listing
/// the valid names.
inline result<recipe> recipe_from_name(std::string_view name) {
  const recipe all[] = {recipe::streaming_llm(), recipe::h2o(),  recipe::tova(), recipe::snapkv(),
                        recipe::knorm(),         recipe::vatp(), recipe::lava(), recipe::cake()};
  for (const recipe& r : all)
    if (name == recipe_name(r.kind)) return r;
  return status::error(errc::invalid_argument,
                       "unknown recipe '%.*s' (expected streaming_llm, h2o, tova, snapkv, knorm, vatp, lava or cake)",
                       static_cast<int>(name.size()), name.data());
}

/// True if the recipe computes attention scores (and so reads `queries`).
constexpr bool uses_attention(recipe_kind k) noexcept {
  return k != recipe_kind::streaming_llm && k != recipe_kind::knorm;
}

namespace detail {

inline bool is_window_kind(recipe_kind k) noexcept {
  return k == recipe_kind::snapkv || k == recipe_kind::vatp || k == recipe_kind::lava || k == recipe_kind::cake;
}

inline status check_recipe(const char* fn, const recipe& r) {
  const int k = static_cast<int>(r.kind);
  if (k < 0 || k > static_cast<int>(recipe_kind::cake))
    return status::error(errc::invalid_argument, "%s: unknown recipe_kind value %d", fn, k);
  if (r.source != query_source::prompt_window && r.source != query_source::external_block)
    return status::error(errc::invalid_argument, "%s: unknown query_source value %d", fn, static_cast<int>(r.source));
  if (r.order != gqa_order::pool_first && r.order != gqa_order::gqa_first)
    return status::error(errc::invalid_argument, "%s: unknown gqa_order value %d", fn, static_cast<int>(r.order));
  if (r.gqa != gqa_op::mean && r.gqa != gqa_op::max && r.gqa != gqa_op::sum)
    return status::error(errc::invalid_argument, "%s: unknown gqa_op value %d", fn, static_cast<int>(r.gqa));
  if (r.pool != pool_kind::none && r.pool != pool_kind::max && r.pool != pool_kind::avg)
    return status::error(errc::invalid_argument, "%s: unknown pool_kind value %d", fn, static_cast<int>(r.pool));
  if (r.kernel < 1 || r.kernel % 2 == 0)
    return status::error(errc::invalid_argument, "%s: pooling kernel %lld must be odd and >= 1", fn,
                         static_cast<long long>(r.kernel));
  if (r.n_sink < 0 || r.n_recent < 0)
    return status::error(errc::invalid_argument, "%s: n_sink (%lld) and n_recent (%lld) must be >= 0", fn,
                         static_cast<long long>(r.n_sink), static_cast<long long>(r.n_recent));
  if (is_window_kind(r.kind) && r.source == query_source::prompt_window && r.window < 1)
    return status::error(errc::invalid_argument, "%s: window %lld must be >= 1", fn, static_cast<long long>(r.window));
  return check_score_options(fn, r.score);
}

/// The score stage's query-block shape for a recipe: rows w, and whether the block has keys.
struct recipe_block {
  index_t w = 0;           ///< query rows
  index_t prefix = 0;      ///< prefix keys attended (P)
  bool block_keys = false;
  index_t out_cols = 0;    ///< columns the score stage writes ([H_q][out_cols] inside [H_q][T])
  index_t pooled = 0;      ///< columns pooled (the rest keep their raw scores)
};

inline status recipe_block_shape(const char* fn, const recipe& r, index_t query_rows, index_t tokens,
                                 index_t block_key_rows, recipe_block& b) {
  switch (r.kind) {
    case recipe_kind::h2o:
      if (query_rows != tokens)
        return status::error(errc::shape_mismatch, "%s: h2o needs every prompt query ([H_q][%lld][d]), got %lld rows",
                             fn, static_cast<long long>(tokens), static_cast<long long>(query_rows));
      b = {tokens, 0, true, tokens, tokens};
      return {};
    case recipe_kind::tova:
      if (query_rows != 1 || tokens < 1)
        return status::error(errc::shape_mismatch, "%s: tova needs the last prompt token's query ([H_q][1][d]) and "
                             "at least one key, got %lld rows over %lld tokens", fn,
                             static_cast<long long>(query_rows), static_cast<long long>(tokens));
      b = {1, tokens - 1, true, tokens, tokens};
      return {};
    default: break;
  }
  if (r.source == query_source::prompt_window) {
    if (query_rows != r.window)
      return status::error(errc::shape_mismatch, "%s: the recipe's window is %lld but queries hold %lld rows", fn,
                           static_cast<long long>(r.window), static_cast<long long>(query_rows));
    if (r.window > tokens)
      return status::error(errc::invalid_argument, "%s: window %lld is longer than the %lld prompt tokens", fn,
                           static_cast<long long>(r.window), static_cast<long long>(tokens));
    b = {r.window, tokens - r.window, true, tokens, tokens - r.window};
    return {};
  }
  if (query_rows < 1)
    return status::error(errc::invalid_argument, "%s: the external query block is empty", fn);
  if (block_key_rows != 0 && block_key_rows != query_rows)
    return status::error(errc::shape_mismatch, "%s: block_keys holds %lld tokens but the query block %lld", fn,
                         static_cast<long long>(block_key_rows), static_cast<long long>(query_rows));
  b = {query_rows, tokens, block_key_rows != 0, tokens, tokens};
  return {};
}

}  // namespace detail

/// Workspace bytes recipe_scores needs on backend `be` (what its size query reports), from
/// shapes alone: `query_heads` x `query_rows` queries (see the query sources above), `kv_heads`
/// x `tokens` prompt keys of dimension `dim`, `block_key_rows` own keys of an external block.
template <class Backend>
result<std::size_t> recipe_scores_workspace_size(Backend be, const recipe& r, index_t query_heads,
                                                 index_t query_rows, index_t kv_heads, index_t tokens, index_t dim,
                                                 index_t block_key_rows = 0) {
  constexpr const char* fn = "recipe_scores_workspace_size";
  KVEVICT_TRY(detail::check_recipe(fn, r));
  if (!uses_attention(r.kind)) return std::size_t{0};
  detail::recipe_block b;
  KVEVICT_TRY(detail::recipe_block_shape(fn, r, query_rows, tokens, block_key_rows, b));
  const auto inner =
      attention_scores_workspace_size(be, query_heads, kv_heads, b.w, b.prefix, dim, b.block_keys, b.out_cols, r.score);
  if (!inner) return inner.error();
  workspace q;
  detail::workspace_carver c(q);
  (void)c.take<float>(static_cast<std::size_t>(query_heads * tokens));  // raw per-query-head scores
  (void)c.take<float>(static_cast<std::size_t>(query_heads * tokens));  // pooled / reduced
  (void)c.take<std::int32_t>(static_cast<std::size_t>(query_heads));    // pooled length per row
  (void)c.take<unsigned char>(*inner);
  KVEVICT_TRY(c.finish(fn));
  return q.bytes;
}

/// Final per-KV-head scores of a recipe: scores [H_kv][T] (higher = keep), protected positions
/// at +inf. queries: see the query sources in the file comment; keys and values [H_kv][T][d]
/// (values are read by vatp and lava only and may be an empty view otherwise); block_keys: the
/// external block's own keys or a 0-token view.
/// Errors: the recipe's parameters; shapes (GQA divisibility, query rows for the recipe's
/// source, window longer than the prompt, scores not [H_kv][T], values not [H_kv][T][d] for
/// vatp/lava); the stages' own errors (views, overlap, workspace).
template <class Backend, class Q, class K, class V>
status recipe_scores(Backend be, workspace& ws, const recipe& r, kv_view<Q> queries, kv_view<K> keys,
                     kv_view<V> values, matrix_view<float> scores, kv_view<K> block_keys = {}) {
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  using VE = std::remove_const_t<V>;
  constexpr const char* fn = "recipe_scores";
  KVEVICT_TRY(detail::check_recipe(fn, r));
  KVEVICT_TRY(detail::check_view(fn, "keys", keys));
  KVEVICT_TRY(detail::check_view(fn, "scores", scores));
  const index_t hkv = keys.extent(0), T = keys.extent(1);
  if (scores.extent(0) != hkv || scores.extent(1) != T)
    return status::error(errc::shape_mismatch, "%s: scores is [%lld][%lld] but keys are [%lld][%lld][*]", fn,
                         static_cast<long long>(scores.extent(0)), static_cast<long long>(scores.extent(1)),
                         static_cast<long long>(hkv), static_cast<long long>(T));
  if (detail::range_of(scores).intersects(detail::range_of(keys)))
    return status::error(errc::overlap, "%s: scores overlaps keys in memory", fn);
  const bool weighted = r.kind == recipe_kind::vatp || r.kind == recipe_kind::lava;
  if (weighted) {
    KVEVICT_TRY(detail::check_view(fn, "values", values));
    if (values.extent(0) != hkv || values.extent(1) != T)
      return status::error(errc::shape_mismatch, "%s: %s weights by values, which must be [%lld][%lld][d] (got [%lld][%lld])",
                           fn, recipe_name(r.kind), static_cast<long long>(hkv), static_cast<long long>(T),
                           static_cast<long long>(values.extent(0)), static_cast<long long>(values.extent(1)));
  }

  if (!uses_attention(r.kind)) {
    if (ws.is_query()) {
      ws.bytes = 0;
      return {};
    }
    if (r.kind == recipe_kind::knorm) {
      KVEVICT_TRY(key_norm_scores(be, keys, scores));
    } else {  // streaming_llm: recency is the score (exact in fp32 for T < 2^24)
      if (T > (index_t(1) << 24))
        return status::error(errc::invalid_argument, "%s: streaming_llm scores positions exactly up to 2^24 tokens", fn);
      detail::parallel_for(be, hkv, [&](index_t h) {
        for (index_t t = 0; t < T; ++t) scores(h, t) = static_cast<float>(t);
      });
    }
    return protect(be, scores, r.n_sink, r.n_recent);
  }

  KVEVICT_TRY(detail::check_view(fn, "queries", queries));
  const index_t hq = queries.extent(0);
  if (hkv == 0 || hq % hkv != 0)
    return status::error(errc::shape_mismatch, "%s: %lld query heads are not a multiple of %lld KV heads (GQA)", fn,
                         static_cast<long long>(hq), static_cast<long long>(hkv));
  detail::recipe_block b;
  const index_t block_rows = r.source == query_source::external_block ? block_keys.extent(1) : 0;
  KVEVICT_TRY(detail::recipe_block_shape(fn, r, queries.extent(1), T, block_rows, b));
  const auto inner_bytes =
      attention_scores_workspace_size(be, hq, hkv, b.w, b.prefix, queries.extent(2), b.block_keys, b.out_cols, r.score);
  if (!inner_bytes) return inner_bytes.error();

  detail::workspace_carver carver(ws);
  float* raw = carver.take<float>(static_cast<std::size_t>(hq * T));
  float* tmp = carver.take<float>(static_cast<std::size_t>(hq * T));
  std::int32_t* lens = carver.take<std::int32_t>(static_cast<std::size_t>(hq));
  workspace inner{carver.take<unsigned char>(*inner_bytes), *inner_bytes};
  KVEVICT_TRY(carver.finish(fn));
  const detail::byte_range touched[] = {detail::range_of(scores), detail::range_of(queries), detail::range_of(keys),
                                        detail::range_of(values), detail::range_of(block_keys)};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"scores", "queries", "keys", "values", "block_keys"}));
  if (ws.is_query()) return {};

  const auto raw_all = *make_matrix_view(raw, hq, T);
  const auto tmp_all = *make_matrix_view(tmp, hq, T);
  const kv_view<const QE> q = queries;
  const kv_view<const KE> k = keys;
  // 1. attention scores, per query head, into raw[:, :out_cols]
  {
    const auto out = *make_matrix_view(raw, hq, b.out_cols, T);
    if (r.kind == recipe_kind::h2o || r.kind == recipe_kind::tova || r.source == query_source::prompt_window) {
      const auto split = split_window(k, b.w);
      if (!split) return split.error();
      KVEVICT_TRY(attention_scores(be, inner, q, split->prefix, split->window, out, r.score));
    } else {
      KVEVICT_TRY(attention_scores(be, inner, q, k, kv_view<const KE>(block_keys), out, r.score));
    }
  }
  // 2. pool (prefix columns only for the prompt window) and reduce the GQA groups, in the
  //    recipe's order; columns past the pooled length keep their raw scores
  for (index_t h = 0; h < hq; ++h) lens[h] = static_cast<std::int32_t>(b.pooled);
  auto pool_rows = [&](matrix_view<const float> in, matrix_view<float> out) -> status {
    detail::parallel_for(be, in.extent(0), [&](index_t row) {
      for (index_t t = b.pooled; t < T; ++t) out(row, t) = in(row, t);
    });
    return pool1d(be, in, out, r.pool, r.kernel, lens, r.pool_opts);
  };
  if (r.order == gqa_order::pool_first) {
    KVEVICT_TRY(pool_rows(raw_all, tmp_all));
    KVEVICT_TRY(gqa_reduce(be, tmp_all, scores, r.gqa));
  } else {
    const auto reduced = *make_matrix_view(tmp, hkv, T);
    KVEVICT_TRY(gqa_reduce(be, raw_all, reduced, r.gqa));
    KVEVICT_TRY(pool_rows(reduced, scores));
  }
  // 3. value-norm weighting (VATP, LAVa)
  if (weighted) KVEVICT_TRY(weight_by_value_norm(be, scores, kv_view<const VE>(values), r.weight));
  // 4. protection
  return protect(be, scores, r.n_sink, r.n_recent);
}

/// Dense selection with one budget per head: kept [H_kv][budget] receives each head's `budget`
/// best positions (ascending) from scores [H_kv][T] (as recipe_scores leaves them: protected
/// positions at +inf). The budget counts protected tokens; it must be >= the protected count of
/// the row (n_sink + n_recent, or T) and <= T. Workspace: select_topk's.
template <class Backend>
status recipe_select(Backend be, workspace& ws, const recipe& r, matrix_view<const float> scores,
                     matrix_view<pos_t> kept) {
  constexpr const char* fn = "recipe_select";
  KVEVICT_TRY(detail::check_recipe(fn, r));
  KVEVICT_TRY(detail::check_view(fn, "scores", scores));
  if (!ws.is_query())
    KVEVICT_TRY(check_budget(fn, kept.extent(1), scores.extent(1), r.n_sink, r.n_recent));
  return select_topk(be, ws, scores, nullptr, kept);
}

/// Ragged selection with per-head budgets (from a budget allocator): head h keeps
/// kept.cu[h+1] - kept.cu[h] tokens, each at least its protected count. Workspace: select_topk's.
template <class Backend>
status recipe_select(Backend be, workspace& ws, const recipe& r, matrix_view<const float> scores,
                     ragged_positions_out kept) {
  constexpr const char* fn = "recipe_select";
  KVEVICT_TRY(detail::check_recipe(fn, r));
  KVEVICT_TRY(detail::check_view(fn, "scores", scores));
  if (!ws.is_query()) {
    KVEVICT_TRY(detail::check_offsets(fn, "kept.cu", kept.cu, kept.heads));
    for (index_t h = 0; h < kept.heads; ++h)
      KVEVICT_TRY(check_budget(fn, kept.length(h), scores.extent(1), r.n_sink, r.n_recent));
  }
  return select_topk(be, ws, scores, nullptr, kept);
}

}  // namespace kvevict
