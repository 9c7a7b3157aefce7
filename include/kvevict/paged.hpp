// kvevict/paged.hpp: stages over paged KV caches, in the engines' own layouts, without copies
// (docs/paged.md). Host backends (seq, par); the CUDA compaction, Knorm and value norms are in
// <kvevict/cuda/paged.cuh>.
//
//   make_page_pool(data, pages, page_size, heads, dim, layout)     an NHD / HND pool
//   make_token_major_pool(data, sequences, capacity, heads, dim)    llama.cpp-style [S][T][H][d]
//   last_page_lengths(indptr, lists, lengths, page_size, out)       vLLM-style lengths -> last_page_len
//   validate_paged_layer(ws, layer)                                  the table checks alone
//   compact_paged(be, ws, layer, kept, out)                          kept rows to the front of each
//                                                                    list, freed pages reported
//   shrink_page_table(indptr, indices, last_page_len, lists, page_size, lengths)
//                                                                    the engine's table after it
//   paged_window_scores(be, ws, window_queries, layer, out)         SnapKV-family window scores
//   paged_key_norm_scores(be, ws, layer, out)                        Knorm on paged keys
//   paged_weight_by_value_norm(be, ws, scores, layer, mode)          VATP / LAVa value norms
//
// Rows of a paged layer are (sequence, KV head) pairs r = s * kv_heads + h (paged_types.hpp);
// scores over a paged layer are a matrix [rows][>= the longest row] whose row r's first
// layer.length(r) columns are row r's tokens in list order: select_topk (per-row lengths) or
// select_topk_batch (<kvevict/batch.hpp>) selects them in one call, compact_paged applies it.
// Workspace: a bitmap of the pool's pages (pages / 8 bytes), for the duplicate-page check.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/base/paged_checks.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/host/paged_keys.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/paged_types.hpp>
#include <kvevict/score.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/weight.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {

/// A pool of `pages` pages of `page_size` tokens x `heads` x `dim`, contiguous, in the given layout.
template <class T>
result<page_pool<T>> make_page_pool(T* data, index_t pages, index_t page_size, index_t heads, index_t dim,
                                    page_layout layout = page_layout::nhd) {
  constexpr const char* fn = "make_page_pool";
  if (pages < 0 || page_size < 1 || heads < 0 || dim < 0)
    return status::error(errc::invalid_argument, "%s: %lld pages of %lld tokens x %lld heads x %lld (page_size >= 1, "
                         "the others >= 0)", fn, static_cast<long long>(pages), static_cast<long long>(page_size),
                         static_cast<long long>(heads), static_cast<long long>(dim));
  page_pool<T> p{data, pages, page_size, heads, dim, 0, 0, 0};
  index_t hd = 0, page = 0;
  if (!detail::checked_mul(heads, dim, hd) || !detail::checked_mul(hd, page_size, page))
    return status::error(errc::size_overflow, "%s: a page's elements overflow", fn);
  const index_t d1 = dim > 0 ? dim : 1;
  if (layout == page_layout::nhd) {
    p.head_stride = d1;
    p.token_stride = hd > 0 ? hd : 1;
  } else {
    p.token_stride = d1;
    p.head_stride = page_size * d1;
  }
  p.page_stride = page > 0 ? page : 1;
  KVEVICT_TRY(detail::check_page_pool(fn, "pool", p));
  return p;
}

/// llama.cpp's token-major cache, one [capacity][heads][dim] block per sequence, as an NHD pool
/// with one page per sequence (page s = sequence s; its table: indptr = 0..S, indices = 0..S-1,
/// last_page_len = lengths, 0-length sequences with no page).
template <class T>
result<page_pool<T>> make_token_major_pool(T* data, index_t sequences, index_t capacity, index_t heads, index_t dim) {
  return make_page_pool(data, sequences, capacity, heads, dim, page_layout::nhd);
}

namespace detail {
/// What last_page_lengths and shrink_page_table read: a page size >= 1, CSR offsets, lengths
/// within each list's pages' room.
inline status check_list_lengths(const char* fn, const std::int32_t* indptr, index_t lists,
                                 const std::int32_t* lengths, index_t page_size, const std::int32_t* last_page_len) {
  if (page_size < 1)
    return status::error(errc::invalid_argument, "%s: page_size is %lld (must be >= 1)", fn,
                         static_cast<long long>(page_size));
  KVEVICT_TRY(check_offsets(fn, "indptr", indptr, lists));
  if (lists > 0 && (lengths == nullptr || last_page_len == nullptr))
    return status::error(errc::null_pointer, "%s: lengths or last_page_len is null", fn);
  for (index_t r = 0; r < lists; ++r) {
    const index_t n = indptr[r + 1] - indptr[r], len = lengths[r];
    if (len < 0 || len > n * page_size)
      return status::error(errc::out_of_range, "%s: list %lld's length %lld exceeds its %lld pages of %lld tokens", fn,
                           static_cast<long long>(r), static_cast<long long>(len), static_cast<long long>(n),
                           static_cast<long long>(page_size));
  }
  return {};
}
}  // namespace detail

/// last_page_len from token counts (vLLM keeps seq_lens and block tables): list r holds
/// lengths[r] tokens in its indptr[r+1] - indptr[r] pages. Errors: indptr null, not starting at 0
/// or not monotone; a length negative, above its pages' room ("exceeds its pages") or leaving its
/// last page empty (a list must hold no unused page: every page full except the last).
inline status last_page_lengths(const std::int32_t* indptr, index_t lists, const std::int32_t* lengths,
                                index_t page_size, std::int32_t* last_page_len) {
  constexpr const char* fn = "last_page_lengths";
  KVEVICT_TRY(detail::check_list_lengths(fn, indptr, lists, lengths, page_size, last_page_len));
  for (index_t r = 0; r < lists; ++r) {
    const index_t n = indptr[r + 1] - indptr[r], len = lengths[r];
    if (n > 0 && len <= (n - 1) * page_size)
      return status::error(errc::invalid_argument,
                           "%s: list %lld holds %lld tokens in %lld pages of %lld: its last page would be empty", fn,
                           static_cast<long long>(r), static_cast<long long>(len), static_cast<long long>(n),
                           static_cast<long long>(page_size));
  }
  for (index_t r = 0; r < lists; ++r) {
    const index_t n = indptr[r + 1] - indptr[r];
    last_page_len[r] = static_cast<std::int32_t>(n == 0 ? 0 : lengths[r] - (n - 1) * page_size);
  }
  return {};
}

/// Workspace bytes of validate_paged_layer and compact_paged for pools of `pages` pages.
inline std::size_t paged_workspace_bytes(index_t pages) {
  workspace q;
  detail::workspace_carver c(q);
  (void)c.take<std::uint64_t>(static_cast<std::size_t>(detail::page_bitmap_words(pages)));
  (void)c.finish("paged_workspace_bytes");
  return q.bytes;
}

namespace detail {
/// The first steps of validate_paged_layer and compact_paged: the layer's shape checked
/// (check_paged_shape), then the table check's page bitmap carved from ws (`used`: the bytes the
/// layout touches; on a size query only ws.bytes is set).
template <class T>
status carve_paged_bitmap(const char* fn, workspace& ws, const paged_layer<T>& L, std::uint64_t*& bitmap,
                          std::size_t& used) {
  KVEVICT_TRY(check_paged_shape(fn, L));
  workspace_carver c(ws);
  bitmap = c.take<std::uint64_t>(static_cast<std::size_t>(paged_check_words(L)));
  used = c.needed() > 0 ? c.used() : 0;  // an empty layout touches nothing (not even its padding)
  return c.finish(fn);
}

/// The table's arrays as byte ranges.
inline void table_ranges(const page_table& t, byte_range (&r)[3]) {
  r[0] = ints_range(t.indptr, t.lists + 1);
  r[1] = ints_range(t.indices, t.indptr != nullptr && t.lists >= 0 ? t.indptr[t.lists] : 0);
  r[2] = ints_range(t.last_page_len, t.lists);
}
}  // namespace detail

/// Validates a paged layer (pools, list count, the whole table: see compact_paged's errors)
/// without touching the pools. Two-phase workspace (paged_workspace_bytes).
template <class T>
status validate_paged_layer(workspace& ws, const paged_layer<T>& layer) {
  constexpr const char* fn = "validate_paged_layer";
  std::uint64_t* bitmap = nullptr;
  std::size_t used = 0;
  KVEVICT_TRY(detail::carve_paged_bitmap(fn, ws, layer, bitmap, used));
  if (ws.is_query()) return {};
  detail::byte_range tr[3];
  detail::table_ranges(layer.table, tr);
  KVEVICT_TRY(detail::check_scratch_disjoint(fn, ws.data, used, tr, {"table.indptr", "table.indices",
                                                                    "table.last_page_len"}));
  return detail::check_page_table(fn, layer.table, layer.keys.pages, layer.keys.page_size, bitmap);
}

namespace detail {
/// compact_paged over the layer's rows (sequence < 0) or over sequence `sequence`'s rows alone
/// (kept: its kv_heads rows; out.lengths: its lists; the other lists untouched). The whole table
/// is validated either way (a page shared with another sequence is refused).
template <class Backend, class T>
status compact_paged_rows(const char* fn, Backend be, workspace& ws, const paged_layer<T>& layer, index_t sequence,
                          ragged_positions kept, paged_compaction_out out) {
  static_assert(!std::is_const_v<T>, "compact_paged: the pools are written");
  std::uint64_t* bitmap = nullptr;
  std::size_t used = 0;
  KVEVICT_TRY(detail::carve_paged_bitmap(fn, ws, layer, bitmap, used));
  if (ws.is_query()) return {};
  const page_table& t = layer.table;
  const bool one = sequence >= 0;
  if (one && sequence >= layer.sequences)
    return status::error(errc::out_of_range, "%s: sequence %lld is outside the layer's [0, %lld)", fn,
                         static_cast<long long>(sequence), static_cast<long long>(layer.sequences));
  // the rows [r0, r0 + R) and their lists [l0, l0 + lists)
  const index_t R = one ? layer.kv_heads : layer.rows(), r0 = one ? sequence * layer.kv_heads : 0;
  const index_t l0 = one ? layer.list_of(r0) : 0, ps = layer.keys.page_size;
  const index_t lists = one ? (layer.lists == page_lists::per_head ? R : 1) : t.lists;
  if (kept.heads != R)
    return status::error(errc::shape_mismatch, "%s: kept lists %lld rows, %s %lld (%s)", fn,
                         static_cast<long long>(kept.heads), one ? "the sequence has" : "the layer has",
                         static_cast<long long>(R), one ? "its KV heads" : "sequences x KV heads");
  KVEVICT_TRY(detail::check_ragged_positions(fn, kept));
  if (lists > 0 && out.lengths == nullptr) return status::error(errc::null_pointer, "%s: out.lengths is null", fn);
  if (out.freed_count == nullptr) return status::error(errc::null_pointer, "%s: out.freed_count is null", fn);
  if (out.freed_capacity < 0)
    return status::error(errc::invalid_argument, "%s: out.freed_capacity is negative", fn);
  if (out.freed_capacity > 0 && out.freed_pages == nullptr)
    return status::error(errc::null_pointer, "%s: out.freed_pages is null", fn);
  // every range the call touches, before the table is read
  detail::byte_range tr[3];
  detail::table_ranges(t, tr);
  {
    const detail::named_range written[] = {{"keys", detail::pool_range(layer.keys)},
                                           {"values", detail::pool_range(layer.values)},
                                           {"out.lengths", detail::ints_range(out.lengths, lists)},
                                           {"out.freed_pages", detail::ints_range(out.freed_pages, out.freed_capacity)},
                                           {"out.freed_count", detail::ints_range(out.freed_count, 1)}};
    const detail::named_range read[] = {{"table.indptr", tr[0]},
                                        {"table.indices", tr[1]},
                                        {"table.last_page_len", tr[2]},
                                        {"kept", detail::positions_range(kept.pos, R > 0 ? kept.cu[R] : 0)},
                                        {"kept.cu", detail::ints_range(kept.cu, R + 1)}};
    KVEVICT_TRY(detail::check_disjoint(fn, written, read));
    const detail::byte_range all[] = {written[0].r, written[1].r, written[2].r, written[3].r, written[4].r,
                                      tr[0],        tr[1],        tr[2],        read[3].r,    read[4].r};
    KVEVICT_TRY(detail::check_scratch_disjoint(fn, ws.data, used, all,
                                               {"keys", "values", "out.lengths", "out.freed_pages", "out.freed_count",
                                                "table.indptr", "table.indices", "table.last_page_len", "kept",
                                                "kept.cu"}));
  }
  KVEVICT_TRY(detail::check_page_table(fn, t, layer.keys.pages, ps, bitmap));
  KVEVICT_TRY(detail::check_kept_ragged(fn, kept, [&](index_t r) { return layer.length(r0 + r); }, true));
  // a list's new length: its row's count (per-head), its heads' common count (per-sequence)
  const index_t H = layer.lists == page_lists::per_head ? 1 : layer.kv_heads;
  index_t freed = 0;
  for (index_t l = 0; l < lists; ++l) {
    const index_t n = kept.length(l * H);
    for (index_t h = 1; h < H; ++h)
      if (kept.length(l * H + h) != n)
        return status::error(errc::shape_mismatch,
                             "%s: sequence %lld keeps %lld tokens in head 0 but %lld in head %lld; a per-sequence "
                             "table holds one length per sequence (use per-head tables)",
                             fn, static_cast<long long>(l0 + l), static_cast<long long>(n),
                             static_cast<long long>(kept.length(l * H + h)), static_cast<long long>(h));
    freed += t.pages(l0 + l) - (n + ps - 1) / ps;
  }
  if (freed > out.freed_capacity)
    return status::error(errc::capacity_exceeded, "%s: %lld pages are freed but out.freed_pages has room for %lld", fn,
                         static_cast<long long>(freed), static_cast<long long>(out.freed_capacity));
  const index_t dk = layer.keys.dim, dv = layer.values.dim;
  detail::parallel_for(be, R, [&](index_t r) {
    const index_t n = kept.length(r);
    const pos_t* k = kept.pos + kept.cu[r];
    for (index_t j = 0; j < n; ++j) {
      if (k[j] == j) continue;
      detail::copy_row_host(layer.key(r0 + r, j), 1, layer.key(r0 + r, k[j]), 1, dk);
      detail::copy_row_host(layer.value(r0 + r, j), 1, layer.value(r0 + r, k[j]), 1, dv);
    }
  });
  index_t at = 0;
  for (index_t l = 0; l < lists; ++l) {
    const index_t n = kept.length(l * H);
    for (index_t i = t.indptr[l0 + l] + (n + ps - 1) / ps; i < t.indptr[l0 + l + 1]; ++i)
      out.freed_pages[at++] = t.indices[i];
    out.lengths[l] = static_cast<std::int32_t>(n);
  }
  *out.freed_count = static_cast<std::int32_t>(at);
  return {};
}
}  // namespace detail

/// Paged compaction, in place: row r = (s, h) keeps its tokens kept.pos[kept.cu[r] ..] (strictly
/// ascending, each < layer.length(r): what select returns), moved in that order to the front of
/// its list (token j of a list: page indices[indptr + j / page_size], slot j % page_size), keys
/// and values alike; rows past the new length keep stale data. Each list r then holds n_r tokens
/// in its first ceil(n_r / page_size) pages; out.lengths[r] = n_r and the rest of its pages go to
/// out.freed_pages (lists in order, each list's pages in table order), *out.freed_count = their
/// number. The table is not written: shrink_page_table updates the engine's copy. With
/// per-sequence tables every head of a sequence must keep the same number of tokens.
/// Parallel (par) over rows. O(kept rows x (dk + dv) + listed pages); no allocation.
/// Errors (nothing written, the pools untouched): invalid pools or shapes; a table with indptr
/// not starting at 0 or not monotone, a page id outside the pool, a page listed twice (in one
/// list, or shared by two lists), last_page_len 0 or above the page size (or non-zero for a list
/// without pages); kept with another row count, bad offsets, positions not strictly ascending or
/// outside a row's tokens; heads of a sequence keeping different counts (per-sequence tables);
/// freed pages above out.freed_capacity (capacity_exceeded); null outputs; any output or kept
/// array overlapping the pools, the table or each other; workspace too small.
template <class Backend, class T>
status compact_paged(Backend be, workspace& ws, paged_layer<T> layer, ragged_positions kept,
                     paged_compaction_out out) {
  return detail::compact_paged_rows("compact_paged", be, ws, layer, -1, kept, out);
}

/// The engine's table after compact_paged, in place: list r keeps its first ceil(lengths[r] /
/// page_size) pages (indices moved down so the CSR stays packed), indptr and last_page_len
/// updated. Errors (nothing written): bad indptr, null arrays, a length negative or above its
/// list's room.
inline status shrink_page_table(std::int32_t* indptr, std::int32_t* indices, std::int32_t* last_page_len, index_t lists,
                                index_t page_size, const std::int32_t* lengths) {
  constexpr const char* fn = "shrink_page_table";
  KVEVICT_TRY(detail::check_list_lengths(fn, indptr, lists, lengths, page_size, last_page_len));
  if (indptr[lists] > 0 && indices == nullptr) return status::error(errc::null_pointer, "%s: indices is null", fn);
  std::int32_t at = 0;
  for (index_t r = 0; r < lists; ++r) {
    const std::int32_t begin = indptr[r], n = static_cast<std::int32_t>((lengths[r] + page_size - 1) / page_size);
    for (std::int32_t i = 0; i < n; ++i) indices[at + i] = indices[begin + i];  // at <= begin: moves down
    indptr[r] = at;
    last_page_len[r] = static_cast<std::int32_t>(n == 0 ? 0 : lengths[r] - (n - 1) * page_size);
    at += n;
  }
  indptr[lists] = at;
  return {};
}

namespace detail {
/// Scores over a paged layer: out [rows][>= longest row], not overlapping the pools.
/// (`group` score rows per layer row.)
template <class T>
status check_paged_scores_out(const char* fn, const char* name, const paged_layer<T>& L, const matrix_view<float>& out,
                              index_t group) {
  KVEVICT_TRY(check_view(fn, name, out));
  index_t most = 0;
  for (index_t r = 0; r < L.rows(); ++r) most = L.length(r) > most ? L.length(r) : most;
  if (out.extent(0) != L.rows() * group || out.extent(1) < most)
    return status::error(errc::shape_mismatch, "%s: %s is [%lld][%lld], expected [%lld rows][at least %lld tokens]", fn,
                         name, static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)),
                         static_cast<long long>(L.rows() * group), static_cast<long long>(most));
  if (range_of(out).intersects(pool_range(L.keys)) || range_of(out).intersects(pool_range(L.values)))
    return status::error(errc::overlap, "%s: %s overlaps the page pools", fn, name);
  return {};
}
}  // namespace detail

namespace detail {
/// The score plan of one row's call: g query heads over one KV head, block w (its own keys or
/// not), prefix p, out_cols output columns (attention_scores' shape rules).
inline status paged_score_plan(const char* fn, index_t g, index_t w, index_t p, index_t d, bool has_block,
                               index_t out_cols, int threads, const score_options& opt, score_shape& sh,
                               score_plan& pl) {
  KVEVICT_TRY(score_shape_from_sizes(fn, g, 1, w, p, d, has_block, out_cols, opt, sh));
  sh.scale = opt.scale == 0.0f ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))) : opt.scale;
  return make_score_plan(fn, sh, threads, opt, pl);
}

/// The score plan of one row's window call: the row's last w tokens are the block.
inline status paged_window_plan(const char* fn, index_t g, index_t w, index_t p, index_t d, bool include_window,
                                int threads, const score_options& opt, score_shape& sh, score_plan& pl) {
  return paged_score_plan(fn, g, w, p, d, true, include_window ? p + w : p, threads, opt, sh, pl);
}

template <class Q, class T>
status check_paged_window(const char* fn, const kv_view<const Q>& q, const paged_layer<T>& L,
                          const matrix_view<float>& out, bool include_window, index_t& g) {
  KVEVICT_TRY(check_paged_window_shape(fn, q, L, out, g));
  const index_t H = L.kv_heads, w = q.extent(1);
  if (L.sequences == 0) return {};
  for (index_t r = 0; r < L.rows(); ++r) {
    const index_t n = L.length(r), cols = include_window ? n : n - w;
    if (n < w)
      return status::error(errc::invalid_argument, "%s: row %lld (sequence %lld, head %lld) holds %lld tokens, fewer than "
                           "the window's %lld", fn, static_cast<long long>(r), static_cast<long long>(r / H),
                           static_cast<long long>(r % H), static_cast<long long>(n), static_cast<long long>(w));
    if (cols > out.extent(1))
      return status::error(errc::shape_mismatch, "%s: row %lld needs %lld score columns, out has %lld", fn,
                           static_cast<long long>(r), static_cast<long long>(cols),
                           static_cast<long long>(out.extent(1)));
  }
  const byte_range o = range_of(out);
  if (o.intersects(range_of(q)) || o.intersects(pool_range(L.keys)) || o.intersects(pool_range(L.values)))
    return status::error(errc::overlap, "%s: out overlaps the queries or the page pools", fn);
  return {};
}
}  // namespace detail

/// SnapKV-family window scores over a paged layer, without copies: row r = (s, h) holding n_r
/// tokens is scored with its last w tokens as the block (attention_scores with prefix = tokens
/// [0, n_r - w), block = tokens [n_r - w, n_r), causal inside the block), by the same kernels as
/// window_scores, so the scores are bit-identical to window_scores on a dense copy of the row.
///   window_queries [S * H_q][w][d]   sequence s's query heads at rows s*H_q .. (GQA: query head
///                                    q of a sequence reads KV head q / (H_q / H_kv))
///   out            [S * H_q][C]      row s*H_q + q: columns [0, n_r - w) (prefix, what SnapKV
///                                    ranks), or [0, n_r) with include_window; the rest untouched
/// Every row must hold at least w tokens. Workspace: paged_workspace_bytes plus attention_scores'
/// for the widest row C allows (it depends on C, not on the table). Rows run one after another
/// (par: each row's call is parallel inside). Errors: validate_paged_layer's; query heads not
/// S x a multiple of H_kv, dims differing, w = 0, a row shorter than w, out rows or columns too
/// few, out overlapping the inputs; bad options; workspace too small.
template <class Backend, class Q, class T>
status paged_window_scores(Backend be, workspace& ws, kv_view<Q> window_queries, paged_layer<T> layer,
                           matrix_view<float> out, bool include_window = false, const score_options& opt = {}) {
  static_assert(is_kv_element_v<std::remove_const_t<Q>> && is_kv_element_v<std::remove_const_t<T>>,
                "paged_window_scores: float, float16 or bfloat16");
  using QE = std::remove_const_t<Q>;
  constexpr const char* fn = "paged_window_scores";
  const kv_view<const QE> q = window_queries;
  KVEVICT_TRY(detail::check_paged_shape(fn, layer));
  index_t g = 1;
  KVEVICT_TRY(detail::check_score_options(fn, opt));
  // the scratch of the widest row out allows
  const index_t w = q.extent(1), d = layer.keys.dim, C = out.extent(1);
  const int threads = detail::thread_count(be);
  detail::score_shape sh_max;
  detail::score_plan pl_max;
  const index_t hq = layer.sequences > 0 && layer.kv_heads > 0 ? q.extent(0) / layer.sequences / layer.kv_heads : 1;
  KVEVICT_TRY(detail::paged_window_plan(fn, hq > 0 ? hq : 1, w > 0 ? w : 1, include_window ? (C > w ? C - w : 0) : C,
                                        d > 0 ? d : 1, include_window, threads, opt, sh_max, pl_max));
  detail::workspace_carver c(ws);
  std::uint64_t* bitmap = c.take<std::uint64_t>(static_cast<std::size_t>(detail::paged_check_words(layer)));
  float* scratch = c.take<float>(static_cast<std::size_t>(pl_max.slot_floats * pl_max.threads));
  KVEVICT_TRY(c.finish(fn));
  if (ws.is_query()) return {};
  detail::byte_range tr[3];
  detail::table_ranges(layer.table, tr);
  const detail::byte_range touched[] = {tr[0], tr[1], tr[2], detail::range_of(out), detail::range_of(q),
                                        detail::pool_range(layer.keys)};
  KVEVICT_TRY(c.check_disjoint(fn, touched, {"table.indptr", "table.indices", "table.last_page_len", "out",
                                             "window_queries", "the key pool"}));
  KVEVICT_TRY(detail::check_page_table(fn, layer.table, layer.keys.pages, layer.keys.page_size, bitmap));
  KVEVICT_TRY(detail::check_paged_window(fn, q, layer, out, include_window, g));
  using exts3 = cuda::std::dextents<index_t, 3>;
  using exts2 = cuda::std::dextents<index_t, 2>;
  const cuda::std::array<index_t, 3> qs{q.stride(0), q.stride(1), q.stride(2)};
  const cuda::std::array<index_t, 2> os{out.stride(0), out.stride(1)};
  for (index_t r = 0; r < layer.rows(); ++r) {
    const index_t n = layer.length(r), s = r / layer.kv_heads, h = r % layer.kv_heads;
    const index_t head0 = s * g * layer.kv_heads + h * g;
    detail::score_shape sh;
    detail::score_plan pl;
    KVEVICT_TRY(detail::paged_window_plan(fn, g, w, n - w, d, include_window, threads, opt, sh, pl));
    if (pl.tasks == 0) continue;
    const kv_view<const QE> qr(q.data_handle() + head0 * q.stride(0),
                               cuda::std::layout_stride::mapping<exts3>(exts3(g, w, d), qs));
    const matrix_view<float> orow(out.data_handle() + head0 * out.stride(0),
                                  cuda::std::layout_stride::mapping<exts2>(exts2(g, sh.out_cols), os));
    detail::attention_scores_run(be, sh, pl, scratch, qr, detail::paged_keys_of(layer, r, 0),
                                 detail::paged_keys_of(layer, r, n - w), orow, opt);
  }
  return {};
}

/// Knorm over a paged layer: out[r][j] = -||key of row r, token j||_2 (the same function as
/// key_norm_scores, so the same bits as on a dense cache). Columns past a row's length are not
/// written. Workspace: paged_workspace_bytes (the table is validated first).
/// Errors: validate_paged_layer's; out not [rows][>= longest row] or overlapping the pools.
template <class Backend, class T>
status paged_key_norm_scores(Backend be, workspace& ws, paged_layer<T> layer, matrix_view<float> out) {
  static_assert(is_kv_element_v<std::remove_const_t<T>>, "paged_key_norm_scores: float, float16 or bfloat16");
  constexpr const char* fn = "paged_key_norm_scores";
  KVEVICT_TRY(validate_paged_layer(ws, layer));
  if (ws.is_query()) return {};
  KVEVICT_TRY(detail::check_paged_scores_out(fn, "out", layer, out, 1));
  const index_t d = layer.keys.dim;
  detail::parallel_for(be, layer.rows(), [&](index_t r) {
    const index_t n = layer.length(r);
    for (index_t j = 0; j < n; ++j)
      out.data_handle()[r * out.stride(0) + j * out.stride(1)] = detail::key_norm_score(layer.key(r, j), d, 1);
  });
  return {};
}

/// VATP / LAVa value weighting over a paged layer, in place on scores [rows x group][>= longest
/// row] (group query heads per row, consecutive, as weight_by_value_norm's [H_q][T] per KV head):
/// per_token multiplies column j by ||v_j||_1, head_max by max_j ||v_j||_1 of the row. Same
/// function as weight_by_value_norm. Columns past a row's length are not touched.
/// Errors: validate_paged_layer's; scores' rows not a multiple of the layer's rows, too few
/// columns, overlapping the pools; unknown mode.
template <class Backend, class T>
status paged_weight_by_value_norm(Backend be, workspace& ws, matrix_view<float> scores, paged_layer<T> layer,
                                  value_weight mode) {
  static_assert(is_kv_element_v<std::remove_const_t<T>>, "paged_weight_by_value_norm: float, float16 or bfloat16");
  constexpr const char* fn = "paged_weight_by_value_norm";
  KVEVICT_TRY(validate_paged_layer(ws, layer));
  if (ws.is_query()) return {};
  KVEVICT_TRY(detail::check_weight_mode(fn, mode));
  const index_t R = layer.rows();
  if (R == 0) return {};
  if (scores.extent(0) % R != 0 || scores.extent(0) == 0)
    return status::error(errc::shape_mismatch, "%s: scores have %lld rows, not a multiple of the layer's %lld rows", fn,
                         static_cast<long long>(scores.extent(0)), static_cast<long long>(R));
  const index_t group = scores.extent(0) / R;
  KVEVICT_TRY(detail::check_paged_scores_out(fn, "scores", layer, scores, group));
  const index_t d = layer.values.dim;
  float* const sd = scores.data_handle();
  const index_t s0 = scores.stride(0), s1 = scores.stride(1);
  detail::parallel_for(be, R, [&](index_t r) {
    const index_t n = layer.length(r);
    if (mode == value_weight::head_max) {
      float mx = 0.0f;
      for (index_t j = 0; j < n; ++j) mx = detail::max_nan(mx, detail::value_l1_norm(layer.value(r, j), d, 1));
      for (index_t q = r * group; q < (r + 1) * group; ++q)
        for (index_t j = 0; j < n; ++j) sd[q * s0 + j * s1] *= mx;
    } else {
      for (index_t j = 0; j < n; ++j) {
        const float norm = detail::value_l1_norm(layer.value(r, j), d, 1);
        for (index_t q = r * group; q < (r + 1) * group; ++q) sd[q * s0 + j * s1] *= norm;
      }
    }
  });
  return {};
}

}  // namespace kvevict
