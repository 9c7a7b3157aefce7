// kvevict/drivers/detail/paged_rows.hpp: a paged layer as the drivers read it (internal): one
// sequence's rows of a paged_layer_kv, validated once per call, and recipe_scores over one row
// read through its page list (the same stages as on a dense copy of the row, so the same bits).
#pragma once

#include <kvevict/drivers/layer_kv.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/score.hpp>

#include <cstdint>
#include <cstdio>

namespace kvevict {
namespace detail {

/// One sequence's rows of a validated paged layer: `layer` has that sequence alone (sequences =
/// 1, its lists re-based into the driver's scratch), so row h is KV head h; lens[h] its tokens.
template <class T>
struct paged_rows {
  paged_layer<const T> layer;
  page_pool<const pos_t> positions;
  const std::int32_t* lens = nullptr;
};

/// The scratch open_layer needs for a paged layer: a bitmap of pool_pages pages, the re-based
/// offsets [H + 1] and the lengths [H].
struct paged_rows_scratch {
  std::uint64_t* bitmap = nullptr;
  index_t pool_pages = 0;
  std::int32_t* indptr = nullptr;
  std::int32_t* lens = nullptr;
};

/// A driver config's pool_pages: in [0, INT32_MAX] (page ids are int32).
inline status check_pool_pages(const char* fn, index_t pool_pages) {
  if (pool_pages < 0 || pool_pages > INT32_MAX)
    return status::error(errc::invalid_argument, "%s: pool_pages = %lld is outside [0, %d]", fn,
                         static_cast<long long>(pool_pages), INT32_MAX);
  return {};
}

/// Validates sequence kv.sequence's rows of a paged layer for a driver of H KV heads of dim d and
/// views them as paged_rows (no copies of keys, values or positions). Checked: the pools (valid,
/// alike, at most pool_pages pages), the table's list count, the sequence index, heads and dims,
/// the position pool (dim 1, the keys' pages, page size and heads), the sequence's lists (offsets
/// monotone, page ids inside the pool, no page twice, last_page_len in [1, page_size]).
template <class T>
status open_paged_rows(const char* fn, const paged_rows_scratch& s, const paged_layer_kv<T>& kv, index_t H, index_t d,
                       paged_rows<T>& out) {
  const paged_layer<const T>& L = kv.layer;
  KVEVICT_TRY(check_paged_shape(fn, L));
  if (L.keys.pages > s.pool_pages)
    return status::error(errc::capacity_exceeded,
                         "%s: the page pools have %lld pages but the driver was set up for %lld (its config's "
                         "pool_pages; 0 = ragged layers only)",
                         fn, static_cast<long long>(L.keys.pages), static_cast<long long>(s.pool_pages));
  if (L.kv_heads != H)
    return status::error(errc::shape_mismatch, "%s: the paged layer has %lld KV heads, the driver was set up for %lld",
                         fn, static_cast<long long>(L.kv_heads), static_cast<long long>(H));
  if (L.keys.dim != d || L.values.dim != d)
    return status::error(errc::shape_mismatch,
                         "%s: the paged layer's keys / values have head dim %lld / %lld, the driver was set up for %lld",
                         fn, static_cast<long long>(L.keys.dim), static_cast<long long>(L.values.dim),
                         static_cast<long long>(d));
  if (kv.sequence < 0 || kv.sequence >= L.sequences)
    return status::error(errc::out_of_range, "%s: sequence %lld is outside the layer's [0, %lld)", fn,
                         static_cast<long long>(kv.sequence), static_cast<long long>(L.sequences));
  KVEVICT_TRY(check_page_pool(fn, "positions", kv.positions));
  if (kv.positions.dim != 1 || kv.positions.pages != L.keys.pages || kv.positions.page_size != L.keys.page_size ||
      kv.positions.heads != L.keys.heads)
    return status::error(errc::shape_mismatch,
                         "%s: the position pool has %lld pages of %lld tokens x %lld heads x dim %lld, the keys %lld x "
                         "%lld x %lld (dim 1 needed)",
                         fn, static_cast<long long>(kv.positions.pages), static_cast<long long>(kv.positions.page_size),
                         static_cast<long long>(kv.positions.heads), static_cast<long long>(kv.positions.dim),
                         static_cast<long long>(L.keys.pages), static_cast<long long>(L.keys.page_size),
                         static_cast<long long>(L.keys.heads));
  // the sequence's lists, re-based so that check_page_table reads them as a table of their own
  const page_table& t = L.table;
  const bool per_head = L.lists == page_lists::per_head;
  const index_t first = per_head ? kv.sequence * H : kv.sequence, n = per_head ? H : 1;
  if (t.indptr == nullptr) return status::error(errc::null_pointer, "%s: table.indptr is null", fn);
  if (t.indptr[0] != 0)
    return status::error(errc::invalid_argument, "%s: table.indptr[0] must be 0 (got %d)", fn, t.indptr[0]);
  for (index_t i = 0; i <= first + n - 1; ++i)
    if (t.indptr[i + 1] < t.indptr[i])
      return status::error(errc::invalid_argument, "%s: table.indptr is not monotone: list %lld has %d -> %d", fn,
                           static_cast<long long>(i), t.indptr[i], t.indptr[i + 1]);
  const std::int32_t base = t.indptr[first];
  for (index_t i = 0; i <= n; ++i) s.indptr[i] = t.indptr[first + i] - base;
  const page_table sub{s.indptr, t.indices == nullptr ? nullptr : t.indices + base,
                       t.last_page_len == nullptr ? nullptr : t.last_page_len + first, n};
  char what[160];
  std::snprintf(what, sizeof what, "%s (sequence %lld's lists, counted from its first)", fn,
                static_cast<long long>(kv.sequence));
  KVEVICT_TRY(check_page_table(what, sub, L.keys.pages, L.keys.page_size, s.bitmap));
  out.layer = paged_layer<const T>{L.keys, L.values, sub, 1, H, L.lists};
  out.positions = kv.positions;
  for (index_t h = 0; h < H; ++h) s.lens[h] = static_cast<std::int32_t>(out.layer.length(h));
  out.lens = s.lens;
  return {};
}

/// open_paged_rows checked the layout already.
template <class T>
status check_layer_layout(const char*, index_t, const paged_rows<T>&, index_t, index_t) {
  return {};
}

/// What a driver call reads a layer as: a layer_kv as itself, a paged_layer_kv as paged_rows.
template <class KV>
struct layer_reader;
template <class T>
struct layer_reader<layer_kv<T>> {
  using element = T;
  using type = layer_kv<T>;
};
template <class T>
struct layer_reader<paged_layer_kv<T>> {
  using element = T;
  using type = paged_rows<T>;
};
/// The element type of a layer a driver accepts (substitution fails for anything else).
template <class KV>
using layer_element_t = typename layer_reader<KV>::element;

template <class T>
status open_layer(const char*, const paged_rows_scratch&, const layer_kv<T>& kv, index_t, index_t, layer_kv<T>& out) {
  out = kv;
  return {};
}
template <class T>
status open_layer(const char* fn, const paged_rows_scratch& s, const paged_layer_kv<T>& kv, index_t H, index_t d,
                  paged_rows<T>& out) {
  return open_paged_rows(fn, s, kv, H, d, out);
}

// ---- recipe_scores over one row of a paged layer ----------------------------------------------

/// One head's block keys [1][rows][d] (rows contiguous) as a key source of the score kernels: a
/// single page holding every row.
template <class K>
paged_key_source<K> block_key_source(const kv_view<const K>& k) {
  static const std::int32_t page0 = 0;
  return {k.data_handle(), &page0, k.extent(1) > 0 ? k.extent(1) : 1, 0, k.stride(1), 0};
}

/// Workspace bytes of paged_row_recipe_scores for a row of up to n tokens: recipe_scores' pieces
/// for one KV head, then n floats of value norms for the weighted recipes.
template <class Backend>
result<std::size_t> paged_row_recipe_bytes(Backend be, const recipe& r, index_t g, index_t rows, index_t n,
                                           index_t d, index_t block_rows) {
  constexpr const char* fn = "paged_row_recipe_bytes";
  if (!uses_attention(r.kind)) return std::size_t{0};
  recipe_block b;
  KVEVICT_TRY(recipe_block_shape(fn, r, rows, n, block_rows, b));
  const auto inner = attention_scores_workspace_bytes(be, g, 1, b.w, b.prefix, d, b.block_keys, b.out_cols, r.score);
  if (!inner) return inner.error();
  const auto post = postprocess_scores_workspace_bytes(be, g, 1, n, n, recipe_postprocess(r, b));
  if (!post) return post.error();
  workspace q;
  workspace_carver c(q);
  (void)c.take<float>(static_cast<std::size_t>(g * n));
  (void)c.take<unsigned char>(*post);
  (void)c.take<unsigned char>(*inner);
  (void)c.take<float>(r.weight_values ? static_cast<std::size_t>(n) : 0);
  KVEVICT_TRY(c.finish(fn));
  return q.bytes;
}

/// recipe_scores for row `row` of a validated paged layer: queries [g][rows][d] (the row's query
/// heads), block_keys [1][rows][d] or an empty view, scores [1][n] (n = the row's tokens). The
/// same stages as recipe_scores over a dense copy of the row's keys and values: the attention by
/// the same kernels over the page list (attention_scores_run), the post-processing by
/// postprocess_scores, value weighting from the rows' L1 norms (value_l1_norm of each value row,
/// handed to postprocess_scores as values of dim 1: the norm of a one-element row is itself), so
/// the scores are bit-identical. The recipe's shape rules are checked (recipe_block_shape); the
/// layer and the query block are the caller's (the drivers check them).
template <class Backend, class QE, class T, class KE>
status paged_row_recipe_scores(Backend be, workspace& ws, const recipe& r, const kv_view<const QE>& q,
                               const paged_layer<const T>& L, index_t row, const kv_view<const KE>& block_keys,
                               const matrix_view<float>& scores) {
  static_assert(std::is_same_v<KE, T>, "paged_row_recipe_scores: block keys of the cache's element type");
  constexpr const char* fn = "recipe_scores (paged layer)";
  const index_t n = L.length(row), d = L.keys.dim;
  if (!uses_attention(r.kind)) {
    if (ws.is_query()) {
      ws.bytes = 0;
      return {};
    }
    if (r.kind == recipe_kind::knorm) {
      for (index_t j = 0; j < n; ++j) scores(0, j) = key_norm_score(L.key(row, j), d, 1);
    } else {
      KVEVICT_TRY(position_scores(be, scores));
    }
    return protect(be, scores, r.n_sink, r.n_recent);
  }
  const index_t g = q.extent(0);
  const bool external = r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova &&
                        r.source == query_source::external_block;
  const index_t block_rows = external ? block_keys.extent(1) : 0;
  recipe_block b;
  KVEVICT_TRY(recipe_block_shape(fn, r, q.extent(1), n, block_rows, b));
  if (block_rows > 0 && d > 1 && block_keys.stride(2) != 1)
    return status::error(errc::invalid_argument,
                         "%s: block keys read with a paged layer need contiguous rows (dim stride %lld)", fn,
                         static_cast<long long>(block_keys.stride(2)));
  score_shape sh;
  score_plan pl;
  KVEVICT_TRY(paged_score_plan(fn, g, b.w, b.prefix, d, b.block_keys, b.out_cols, thread_count(be), r.score, sh, pl));
  const auto inner_bytes =
      attention_scores_workspace_bytes(be, g, 1, b.w, b.prefix, d, b.block_keys, b.out_cols, r.score);
  if (!inner_bytes) return inner_bytes.error();
  const postprocess_options post = recipe_postprocess(r, b);
  const auto post_bytes = postprocess_scores_workspace_bytes(be, g, 1, n, n, post);
  if (!post_bytes) return post_bytes.error();
  workspace_carver carver(ws);
  float* raw = carver.take<float>(static_cast<std::size_t>(g * n));
  workspace post_ws{carver.take<unsigned char>(*post_bytes), *post_bytes};
  float* scratch = carver.take<float>(*inner_bytes / sizeof(float));
  float* norms = carver.take<float>(r.weight_values ? static_cast<std::size_t>(n) : 0);
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};

  // 1. attention scores of the g query heads into raw [g][n]: the row's last w tokens are the
  //    block (SnapKV family, H2O, TOVA), or the whole row is the prefix of an external block
  const auto out = *make_matrix_view(raw, g, b.out_cols, n);
  if (pl.tasks > 0) {
    if (!external)
      attention_scores_run(be, sh, pl, scratch, q, paged_keys_of(L, row, 0), paged_keys_of(L, row, n - b.w), out,
                           r.score);
    else if (b.block_keys)
      attention_scores_run(be, sh, pl, scratch, q, paged_keys_of(L, row, 0), block_key_source(block_keys), out, r.score);
    else
      attention_scores_run(be, sh, pl, scratch, q, paged_keys_of(L, row, 0), paged_keys_of(L, row, 0), out, r.score);
  }
  // 2. pool / GQA reduce, weight, protect
  const matrix_view<const float> per_head = *make_matrix_view<const float>(raw, g, n);
  if (!r.weight_values) return postprocess_scores(be, post_ws, per_head, scores, post);
  for (index_t j = 0; j < n; ++j) norms[j] = value_l1_norm(L.value(row, j), L.values.dim, 1);
  using exts = cuda::std::dextents<index_t, 3>;
  const kv_view<const float> norm_rows(norms, cuda::std::layout_stride::mapping<exts>(
                                                  exts(1, n, 1), cuda::std::array<index_t, 3>{n > 0 ? n : 1, 1, 1}));
  return postprocess_scores(be, post_ws, per_head, scores, norm_rows, post);
}

}  // namespace detail
}  // namespace kvevict
