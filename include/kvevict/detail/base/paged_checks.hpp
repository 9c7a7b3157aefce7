// Checks of paged layers and their block tables (internal; kvevict/paged.hpp and
// kvevict/cuda/paged.cuh call them). Every check reads host memory only: the CUDA launchers
// validate the geometry here and the device-resident tables in their kernels.
#pragma once

#include <kvevict/detail/base/checks.hpp>
#include <kvevict/paged_types.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>
#include <cstdio>

namespace kvevict::detail {

/// A pool's geometry: non-negative sizes, a page size >= 1, positive strides that never make two
/// elements alias, the span representable, data present.
template <class T>
status check_page_pool(const char* fn, const char* name, const page_pool<T>& p) {
  if (p.page_size < 1)
    return status::error(errc::invalid_argument, "%s: %s.page_size is %lld (must be >= 1)", fn, name,
                         static_cast<long long>(p.page_size));
  const index_t ext[4] = {p.pages, p.page_size, p.heads, p.dim};
  const index_t str[4] = {p.page_stride, p.token_stride, p.head_stride, 1};
  char what[64];
  std::snprintf(what, sizeof what, "%s: %s", fn, name);
  return check_extents_strides<4>(what, ext, str, sizeof(T), p.data);
}

/// Byte range of a pool's elements.
template <class T>
byte_range pool_range(const page_pool<T>& p) {
  if (p.pages <= 0 || p.page_size <= 0 || p.heads <= 0 || p.dim <= 0) return {};
  const index_t span = (p.pages - 1) * p.page_stride + (p.page_size - 1) * p.token_stride +
                       (p.heads - 1) * p.head_stride + p.dim;
  const auto b = reinterpret_cast<std::uintptr_t>(p.data);
  return {b, b + static_cast<std::uintptr_t>(span) * sizeof(T)};
}

/// Words of the page bitmap the table check uses (one bit per page of the pool).
inline index_t page_bitmap_words(index_t pages) { return pages > 0 ? (pages + 63) / 64 : 0; }

/// The list holding page `page` before list `before` (only called to name it in an error).
inline index_t first_list_with(const page_table& t, index_t before, std::int32_t page) {
  for (index_t r = 0; r < before; ++r)
    for (index_t i = t.indptr[r]; i < t.indptr[r + 1]; ++i)
      if (t.indices[i] == page) return r;
  return before;
}

/// A CSR table over a pool of `pages` pages of `page_size` tokens: indptr present, starting at 0
/// and non-decreasing; page ids in [0, pages); no page twice (in one list or in two: two lists
/// would write the same rows); last_page_len in [1, page_size] for lists with pages and 0 for
/// lists without. `bitmap`: page_bitmap_words(pages) words of scratch. O(pages + listed pages).
inline status check_page_table(const char* fn, const page_table& t, index_t pages, index_t page_size,
                               std::uint64_t* bitmap) {
  if (t.lists < 0)
    return status::error(errc::invalid_argument, "%s: the table has a negative list count (%lld)", fn,
                         static_cast<long long>(t.lists));
  if (t.indptr == nullptr) return status::error(errc::null_pointer, "%s: table.indptr is null", fn);
  KVEVICT_TRY(check_list_offsets(fn, "table.indptr", t.indptr, t.lists, "list"));
  const index_t listed = t.indptr[t.lists];
  if (listed > 0 && t.indices == nullptr)
    return status::error(errc::null_pointer, "%s: table.indices is null but %lld pages are listed", fn,
                         static_cast<long long>(listed));
  if (t.lists > 0 && t.last_page_len == nullptr)
    return status::error(errc::null_pointer, "%s: table.last_page_len is null", fn);
  if (listed > pages)
    return status::error(errc::out_of_range, "%s: the table lists %lld pages but the pool has %lld", fn,
                         static_cast<long long>(listed), static_cast<long long>(pages));
  const index_t words = page_bitmap_words(pages);
  for (index_t i = 0; i < words; ++i) bitmap[i] = 0;
  for (index_t r = 0; r < t.lists; ++r) {
    const index_t n = t.pages(r), last = t.last_page_len[r];
    if (n == 0 && last != 0)
      return status::error(errc::invalid_argument, "%s: list %lld has no pages but last_page_len %lld (must be 0)", fn,
                           static_cast<long long>(r), static_cast<long long>(last));
    if (n > 0 && (last < 1 || last > page_size))
      return status::error(errc::invalid_argument, "%s: list %lld's last_page_len is %lld, outside [1, %lld] (the page size)",
                           fn, static_cast<long long>(r), static_cast<long long>(last),
                           static_cast<long long>(page_size));
    for (index_t i = t.indptr[r]; i < t.indptr[r + 1]; ++i) {
      const std::int32_t p = t.indices[i];
      if (p < 0 || p >= pages)
        return status::error(errc::out_of_range, "%s: list %lld names page %d, outside the pool's [0, %lld)", fn,
                             static_cast<long long>(r), p, static_cast<long long>(pages));
      std::uint64_t& w = bitmap[p / 64];
      const std::uint64_t bit = std::uint64_t{1} << (p % 64);
      if ((w & bit) != 0) {
        const index_t other = first_list_with(t, r, p);
        if (other < r)
          return status::error(errc::invalid_argument, "%s: page %d is shared by lists %lld and %lld", fn, p,
                               static_cast<long long>(other), static_cast<long long>(r));
        return status::error(errc::invalid_argument, "%s: list %lld names page %d twice", fn,
                             static_cast<long long>(r), p);
      }
      w |= bit;
    }
  }
  return {};
}

/// A paged layer's shape: pools valid and alike, the list count its sequences and heads imply.
template <class T>
status check_paged_shape(const char* fn, const paged_layer<T>& L) {
  if (L.sequences < 0 || L.kv_heads < 0)
    return status::error(errc::invalid_argument, "%s: %lld sequences x %lld KV heads (must be >= 0)", fn,
                         static_cast<long long>(L.sequences), static_cast<long long>(L.kv_heads));
  if (L.sequences > 0 && L.kv_heads < 1)
    return status::error(errc::invalid_argument, "%s: %lld sequences with no KV heads", fn,
                         static_cast<long long>(L.sequences));
  KVEVICT_TRY(check_page_pool(fn, "keys", L.keys));
  KVEVICT_TRY(check_page_pool(fn, "values", L.values));
  if (L.values.pages != L.keys.pages || L.values.page_size != L.keys.page_size || L.values.heads != L.keys.heads)
    return status::error(errc::shape_mismatch,
                         "%s: the value pool has %lld pages of %lld tokens x %lld heads, the key pool %lld x %lld x %lld",
                         fn, static_cast<long long>(L.values.pages), static_cast<long long>(L.values.page_size),
                         static_cast<long long>(L.values.heads), static_cast<long long>(L.keys.pages),
                         static_cast<long long>(L.keys.page_size), static_cast<long long>(L.keys.heads));
  const bool per_head = L.lists == page_lists::per_head;
  const index_t want_heads = per_head ? 1 : L.kv_heads;
  if (L.keys.heads != want_heads)
    return status::error(errc::shape_mismatch, "%s: %s tables need pools of %lld heads per page, got %lld", fn,
                         per_head ? "per-head" : "per-sequence", static_cast<long long>(want_heads),
                         static_cast<long long>(L.keys.heads));
  index_t lists = L.sequences;
  if (per_head && !checked_mul(L.sequences, L.kv_heads, lists))
    return status::error(errc::size_overflow, "%s: sequences x KV heads overflows", fn);
  if (L.table.lists != lists)
    return status::error(errc::shape_mismatch, "%s: the table has %lld lists, %lld %s expected", fn,
                         static_cast<long long>(L.table.lists), static_cast<long long>(lists),
                         per_head ? "(sequences x KV heads)" : "(one per sequence)");
  if (L.keys.pages > INT32_MAX)
    return status::error(errc::size_overflow, "%s: %lld pages do not fit int32 page ids", fn,
                         static_cast<long long>(L.keys.pages));
  return {};
}

/// Bitmap words the host checks of a paged layer need (its workspace).
template <class T>
index_t paged_check_words(const paged_layer<T>& L) {
  return page_bitmap_words(L.keys.pages > 0 ? L.keys.pages : 0);
}

/// Everything about a paged layer (host memory): shape, then the table.
template <class T>
status check_paged_layer(const char* fn, const paged_layer<T>& L, std::uint64_t* bitmap) {
  KVEVICT_TRY(check_paged_shape(fn, L));
  return check_page_table(fn, L.table, L.keys.pages, L.keys.page_size, bitmap);
}

/// The checks of paged_window_scores that do not read the table (the CUDA overload's too).
template <class Q, class T>
status check_paged_window_shape(const char* fn, const kv_view<const Q>& q, const paged_layer<T>& L,
                                const matrix_view<float>& out, index_t& g) {
  KVEVICT_TRY(check_view(fn, "window_queries", q));
  KVEVICT_TRY(check_view(fn, "out", out));
  const index_t S = L.sequences, H = L.kv_heads, w = q.extent(1);
  if (S == 0) return {};
  if (q.extent(0) % S != 0 || (q.extent(0) / S) % H != 0 || q.extent(0) == 0)
    return status::error(errc::shape_mismatch,
                         "%s: window_queries have %lld heads, not sequences (%lld) x a multiple of %lld KV heads", fn,
                         static_cast<long long>(q.extent(0)), static_cast<long long>(S), static_cast<long long>(H));
  g = q.extent(0) / S / H;
  if (q.extent(2) != L.keys.dim)
    return status::error(errc::shape_mismatch, "%s: queries have dim %lld, the keys %lld", fn,
                         static_cast<long long>(q.extent(2)), static_cast<long long>(L.keys.dim));
  if (w < 1) return status::error(errc::invalid_argument, "%s: the window is empty", fn);
  if (out.extent(0) != q.extent(0))
    return status::error(errc::shape_mismatch, "%s: out has %lld rows, expected one per query head (%lld)", fn,
                         static_cast<long long>(out.extent(0)), static_cast<long long>(q.extent(0)));
  return {};
}

}  // namespace kvevict::detail
