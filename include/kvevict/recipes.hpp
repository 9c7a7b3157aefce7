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
// recipe_scores is two calls, on every backend (seq, par, and cuda_t with <kvevict/cuda/recipes.cuh>):
//   score         attention of the recipe's queries over the prompt keys (score.hpp), per query
//                 head, into a [H_q][T] scratch
//   postprocess   postprocess_scores (postprocess.hpp) with the recipe's own postprocess_options:
//                 pool / gqa in the recipe's `order`, value weighting (weight_values: VATP per token,
//                 LAVa per-head max), protection of the first n_sink and last n_recent tokens. With
//                 the prompt-window query source only the prefix columns [0, T - w) are pooled, as
//                 KVCache-Factory pools attn[..., -w:, :-w]: recipe_scores sets unpooled_tail = w
//                 (the window columns keep their raw scores, still GQA-reduced, weighted, protected)
// and for the others (no attention: pooling, GQA and weighting do not apply): Knorm = -||k||_2
// (key_norm_scores), StreamingLLM = the token's position (position_scores: the most recent tokens
// rank highest after the sinks), then protect.
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
// Scratch: recipe_scores needs one [H_q][T] fp32 score buffer plus the scoring and post-processing
// stages' own workspaces, all from the caller (two-phase protocol; recipe_scores_workspace_bytes gives
// the size from shapes alone). Nothing allocates.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/enum_names.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <algorithm>
#include <cstring>
#include <string_view>
#include <type_traits>

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

/// Every parameter of a recipe: the post-processing options it inherits (pool, kernel, divisor, gqa,
/// order, weight_values, weight, n_sink, n_recent) and the scoring ones. Named constructors give the
/// published defaults; each documents where it deviates from the paper or from KVCache-Factory /
/// kvpress, and why. unpooled_tail stays 0: recipe_scores derives it from the query source.
struct recipe : postprocess_options {
  recipe_kind kind = recipe_kind::snapkv;
  query_source source = query_source::prompt_window;  ///< window recipes only
  index_t window = 32;                                ///< observation window w (prompt_window)
  score_options score{};  ///< row reduction (mean, sum, mean_visible, mean + gamma var), scale

  /// SnapKV's defaults: postprocess_options' with the last 32 tokens (the window) kept.
  recipe() { n_recent = 32; }

  /// SnapKV (Li et al. 2024) as KVCache-Factory runs it: window 32, mean over the window rows,
  /// max pool 7, GQA mean (pool then reduce), the window always kept. kvpress's SnapKVPress uses
  /// avg pool 5 instead; set pool/kernel for that. PyramidKV and AdaKV use these scores with
  /// their own budgets.
  static recipe snapkv() { return recipe{}; }

  /// StreamingLLM (Xiao et al. 2024): 4 attention sinks + the most recent tokens; the budget
  /// decides how many recent tokens (budget - n_sink). No attention is computed.
  static recipe streaming_llm(index_t sinks = 4) {
    recipe r = unpooled(recipe_kind::streaming_llm);
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
    recipe r = unpooled(recipe_kind::h2o);
    r.score.reduce = score_reduce::sum;
    return r;
  }

  /// TOVA (Oren et al. 2024): the last prompt token's attention, per KV head (GQA mean), no
  /// pooling, nothing protected but what the scores keep (the last token's self-attention is
  /// scored like any other column). Deviation: kvpress's TOVAPress averages over all heads, giving
  /// every head the same kept set; here each KV head selects its own.
  static recipe tova() {
    recipe r = unpooled(recipe_kind::tova);
    r.n_recent = 0;
    return r;
  }

  /// Knorm (Devoto et al. 2024, kvpress KnormPress): keep the keys of smallest L2 norm; nothing
  /// protected.
  static recipe knorm() {
    recipe r = unpooled(recipe_kind::knorm);
    r.n_recent = 0;
    return r;
  }

  /// VATP (Guo et al. 2024): SnapKV's window scores x ||v_i||_1. Deviation: VATP was introduced on
  /// top of accumulated attention; DESIGN and LAVa's table use the window scores, pooled as
  /// SnapKV's, weighted after the GQA reduction (one value row per KV head).
  static recipe vatp() { return value_weighted(recipe_kind::vatp, value_weight::per_token); }

  /// LAVa score (Shen et al. 2025, Eq. 6): window attention x max_k ||v_k||_1 of the head, GQA
  /// max (paper §4.3), max pool 7 as SnapKV. The head factor matters only when heads compete
  /// (layer-wise selection: the LAVa allocator); with per-head budgets LAVa ranks like SnapKV
  /// with GQA max.
  static recipe lava() {
    recipe r = value_weighted(recipe_kind::lava, value_weight::head_max);
    r.gqa = gqa_op::max;
    return r;
  }

  /// CAKE's eviction indicator (Qin et al. 2025): mean + gamma * variance over the window rows
  /// (gamma 200, unbiased variance as torch.var), avg pool 5 then GQA mean as CAKE's code does
  /// (cake_cache.py), the window kept. CAKE's layer budgets are the allocator's job.
  static recipe cake() {
    recipe r = of_kind(recipe_kind::cake);
    r.score.reduce = score_reduce::mean_plus_variance;
    r.score.gamma = 200.0f;
    r.pool = pool_kind::avg;
    r.kernel = 5;
    return r;
  }

 private:
  /// SnapKV's defaults with kind k (the named constructors start from here).
  static recipe of_kind(recipe_kind k) {
    recipe r;
    r.kind = k;
    return r;
  }

  /// A recipe of kind k whose scores are not pooled (kernel 1).
  static recipe unpooled(recipe_kind k) {
    recipe r = of_kind(k);
    r.pool = pool_kind::none;
    r.kernel = 1;
    return r;
  }

  /// A window recipe of kind k (SnapKV's pooling and protection) whose scores are multiplied by
  /// value norms (`w`: VATP's per token, LAVa's per head) after the GQA reduction.
  static recipe value_weighted(recipe_kind k, value_weight w) {
    recipe r = of_kind(k);
    r.weight_values = true;
    r.weight = w;
    return r;
  }
};

/// "snapkv", "streaming_llm", ... (the names the tools accept).
constexpr const char* recipe_name(recipe_kind k) noexcept {
  constexpr const char* names[] = {"streaming_llm", "h2o", "tova", "snapkv", "knorm", "vatp", "lava", "cake"};
  return detail::enum_name(k, names);
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

/// True if the recipe scores with an observation window (SnapKV, VATP, LAVa, CAKE: `window`
/// queries), rather than every prompt query (H2O), the last one (TOVA) or none.
constexpr bool uses_window(recipe_kind k) noexcept {
  return k == recipe_kind::snapkv || k == recipe_kind::vatp || k == recipe_kind::lava || k == recipe_kind::cake;
}

/// The query rows recipe `r` reads (query_source::prompt_window) from `prompt_queries`, the
/// prompt's queries [H_q][P][d] with its last token last: the last r.window rows for the window
/// recipes, every row for H2O, the last row for TOVA, none (an empty view) for Knorm and
/// StreamingLLM. What add_layer's `queries` is when the engine keeps the whole prompt's queries.
/// Errors: fewer than the rows the recipe reads (out_of_range).
template <class T>
result<kv_view<T>> recipe_queries(const recipe& r, kv_view<T> prompt_queries) {
  const index_t n = prompt_queries.extent(1);
  if (uses_window(r.kind)) return token_range(prompt_queries, n - r.window, r.window);
  if (r.kind == recipe_kind::tova) return token_range(prompt_queries, n - 1, 1);
  if (r.kind == recipe_kind::h2o) return prompt_queries;
  return kv_view<T>{};
}

namespace detail {

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
  if (r.unpooled_tail != 0)
    return status::error(errc::invalid_argument,
                         "%s: unpooled_tail %lld is set by recipe_scores from the query source (leave it 0)", fn,
                         static_cast<long long>(r.unpooled_tail));
  if (uses_window(r.kind) && r.source == query_source::prompt_window && r.window < 1)
    return status::error(errc::invalid_argument, "%s: window %lld must be >= 1", fn, static_cast<long long>(r.window));
  return check_score_options(fn, r.score);
}

/// The score stage's query-block shape for a recipe: rows w, and whether the block has keys.
struct recipe_block {
  index_t w = 0;           ///< query rows
  index_t prefix = 0;      ///< prefix keys attended (P)
  bool block_keys = false;
  index_t out_cols = 0;    ///< columns the score stage writes ([H_q][out_cols] inside [H_q][T])
  index_t unpooled_tail = 0;  ///< last columns not pooled (the prompt window's own)
};

inline status recipe_block_shape(const char* fn, const recipe& r, index_t query_rows, index_t tokens,
                                 index_t block_key_rows, recipe_block& b) {
  switch (r.kind) {
    case recipe_kind::h2o:
      if (query_rows != tokens)
        return status::error(errc::shape_mismatch, "%s: h2o needs every prompt query ([H_q][%lld][d]), got %lld rows",
                             fn, static_cast<long long>(tokens), static_cast<long long>(query_rows));
      b = {tokens, 0, true, tokens, 0};
      return {};
    case recipe_kind::tova:
      if (query_rows != 1 || tokens < 1)
        return status::error(errc::shape_mismatch, "%s: tova needs the last prompt token's query ([H_q][1][d]) and "
                             "at least one key, got %lld rows over %lld tokens", fn,
                             static_cast<long long>(query_rows), static_cast<long long>(tokens));
      b = {1, tokens - 1, true, tokens, 0};
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
    b = {r.window, tokens - r.window, true, tokens, r.window};
    return {};
  }
  if (query_rows < 1)
    return status::error(errc::invalid_argument, "%s: the external query block is empty", fn);
  if (block_key_rows != 0 && block_key_rows != query_rows)
    return status::error(errc::shape_mismatch, "%s: block_keys holds %lld tokens but the query block %lld", fn,
                         static_cast<long long>(block_key_rows), static_cast<long long>(query_rows));
  b = {query_rows, tokens, block_key_rows != 0, tokens, 0};
  return {};
}

/// The post-processing recipe_scores runs for a recipe with a query block of shape b.
inline postprocess_options recipe_postprocess(const recipe& r, const recipe_block& b) {
  postprocess_options opt = r;
  opt.unpooled_tail = b.unpooled_tail;
  return opt;
}

}  // namespace detail

/// Workspace bytes recipe_scores needs on backend `be` (what its size query reports), from
/// shapes alone: `query_heads` x `query_rows` queries (see the query sources above), `kv_heads`
/// x `tokens` prompt keys of dimension `dim`, `block_key_rows` own keys of an external block.
template <class Backend>
result<std::size_t> recipe_scores_workspace_bytes(Backend be, const recipe& r, index_t query_heads,
                                                 index_t query_rows, index_t kv_heads, index_t tokens, index_t dim,
                                                 index_t block_key_rows = 0) {
  constexpr const char* fn = "recipe_scores_workspace_bytes";
  KVEVICT_TRY(detail::check_recipe(fn, r));
  if (!uses_attention(r.kind)) return std::size_t{0};
  detail::recipe_block b;
  KVEVICT_TRY(detail::recipe_block_shape(fn, r, query_rows, tokens, block_key_rows, b));
  const auto inner =
      attention_scores_workspace_bytes(be, query_heads, kv_heads, b.w, b.prefix, dim, b.block_keys, b.out_cols, r.score);
  if (!inner) return inner.error();
  const auto post =
      postprocess_scores_workspace_bytes(be, query_heads, kv_heads, tokens, tokens, detail::recipe_postprocess(r, b));
  if (!post) return post.error();
  workspace q;
  detail::workspace_carver c(q);
  (void)c.take<float>(static_cast<std::size_t>(query_heads * tokens));  // per-query-head scores
  (void)c.take<unsigned char>(*post);
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
  if (r.weight_values) {
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
    if (r.kind == recipe_kind::knorm)
      KVEVICT_TRY(key_norm_scores(be, keys, scores));
    else
      KVEVICT_TRY(position_scores(be, scores));
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
      attention_scores_workspace_bytes(be, hq, hkv, b.w, b.prefix, queries.extent(2), b.block_keys, b.out_cols, r.score);
  if (!inner_bytes) return inner_bytes.error();
  const postprocess_options post = detail::recipe_postprocess(r, b);
  const auto post_bytes = postprocess_scores_workspace_bytes(be, hq, hkv, T, T, post);
  if (!post_bytes) return post_bytes.error();

  detail::workspace_carver carver(ws);
  float* raw = carver.take<float>(static_cast<std::size_t>(hq * T));
  workspace post_ws{carver.take<unsigned char>(*post_bytes), *post_bytes};
  workspace inner{carver.take<unsigned char>(*inner_bytes), *inner_bytes};
  KVEVICT_TRY(carver.finish(fn));
  const detail::byte_range touched[] = {detail::range_of(scores), detail::range_of(queries), detail::range_of(keys),
                                        detail::range_of(values), detail::range_of(block_keys)};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"scores", "queries", "keys", "values", "block_keys"}));
  if (ws.is_query()) return {};

  // 1. attention scores, per query head, into raw [H_q][T]
  const kv_view<const QE> q = queries;
  const kv_view<const KE> k = keys;
  const auto out = *make_matrix_view(raw, hq, b.out_cols, T);
  if (r.kind == recipe_kind::h2o || r.kind == recipe_kind::tova || r.source == query_source::prompt_window) {
    const auto split = split_window(k, b.w);
    if (!split) return split.error();
    KVEVICT_TRY(attention_scores(be, inner, q, split->prefix, split->window, out, r.score));
  } else {
    KVEVICT_TRY(attention_scores(be, inner, q, k, kv_view<const KE>(block_keys), out, r.score));
  }
  // 2. pool / GQA reduce, weight, protect
  const matrix_view<const float> per_head = *make_matrix_view<const float>(raw, hq, T);
  if (r.weight_values) return postprocess_scores(be, post_ws, per_head, scores, kv_view<const VE>(values), post);
  return postprocess_scores(be, post_ws, per_head, scores, post);
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
/// On cuda_t kept.cu is device memory and is never read on the host (nothing synchronises):
/// select_topk(cuda) checks the offsets and budget <= T on the device (a bad head is skipped,
/// docs/cuda.md); a budget below the protected count is not detected there (the head then keeps
/// its best protected positions), so a device caller keeps budgets >= n_sink + n_recent itself,
/// as every allocator in budget/ does.
template <class Backend>
status recipe_select(Backend be, workspace& ws, const recipe& r, matrix_view<const float> scores,
                     ragged_positions_out kept) {
  constexpr const char* fn = "recipe_select";
  KVEVICT_TRY(detail::check_recipe(fn, r));
  KVEVICT_TRY(detail::check_view(fn, "scores", scores));
  if (!ws.is_query() && !std::is_same_v<Backend, cuda_t>) {
    KVEVICT_TRY(detail::check_offsets(fn, "kept.cu", kept.cu, kept.heads));
    for (index_t h = 0; h < kept.heads; ++h)
      KVEVICT_TRY(check_budget(fn, kept.length(h), scores.extent(1), r.n_sink, r.n_recent));
  }
  return select_topk(be, ws, scores, nullptr, kept);
}

}  // namespace kvevict
