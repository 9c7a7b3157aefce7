// Argument validation shared by every entry point: views built by hand (not through the
// make_* factories) get the same checks, so bad input becomes a status, never UB.
#pragma once

#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

namespace kvevict::detail {

template <class T, class Ext>
status check_view(const char* fn, const char* name, const cuda::std::mdspan<T, Ext, cuda::std::layout_stride>& v) {
  constexpr std::size_t Rank = Ext::rank();
  index_t ext[Rank], str[Rank];
  for (std::size_t i = 0; i < Rank; ++i) {
    ext[i] = v.extent(i);
    str[i] = v.stride(i);
  }
  char what[96];
  std::snprintf(what, sizeof what, "%s: %s", fn, name);
  return check_extents_strides(what, ext, str, sizeof(T), v.data_handle());
}

/// Two valid matrix views of the same shape ("fn: a is [..][..] but b is [..][..]" otherwise).
template <class A, class B>
status check_same_shape_views(const char* fn, const char* a_name, const matrix_view<A>& a, const char* b_name,
                              const matrix_view<B>& b) {
  KVEVICT_TRY(check_view(fn, a_name, a));
  KVEVICT_TRY(check_view(fn, b_name, b));
  if (a.extent(0) != b.extent(0) || a.extent(1) != b.extent(1))
    return status::error(errc::shape_mismatch, "%s: %s is [%lld][%lld] but %s is [%lld][%lld]", fn, a_name,
                         static_cast<long long>(a.extent(0)), static_cast<long long>(a.extent(1)), b_name,
                         static_cast<long long>(b.extent(0)), static_cast<long long>(b.extent(1)));
  return {};
}

/// Byte range [begin, end) a view touches (empty range for empty views).
struct byte_range {
  std::uintptr_t begin = 0, end = 0;
  bool intersects(const byte_range& o) const { return begin < o.end && o.begin < end; }
};

template <class T, class Ext>
byte_range range_of(const cuda::std::mdspan<T, Ext, cuda::std::layout_stride>& v) {
  if (v.size() == 0) return {};
  const auto b = reinterpret_cast<std::uintptr_t>(v.data_handle());
  return {b, b + static_cast<std::uintptr_t>(v.mapping().required_span_size()) * sizeof(T)};
}

/// Checks that n int32 lengths in host memory lie in [0, limit]: "fn: name[i] = v is outside [0, limit]".
inline status check_lengths(const char* fn, const char* name, const std::int32_t* lengths, index_t n, index_t limit) {
  if (lengths == nullptr) return {};
  for (index_t i = 0; i < n; ++i)
    if (lengths[i] < 0 || lengths[i] > limit)
      return status::error(errc::out_of_range, "%s: %s[%lld] = %d is outside [0, %lld]", fn, name,
                           static_cast<long long>(i), lengths[i], static_cast<long long>(limit));
  return {};
}

/// Whether n int32 lengths stored at `lengths` (never dereferenced) intersect the byte range r.
inline bool lengths_inside(const std::int32_t* lengths, index_t n, const byte_range& r) {
  if (lengths == nullptr || n <= 0) return false;
  const auto b = reinterpret_cast<std::uintptr_t>(lengths);
  return r.intersects({b, b + static_cast<std::uintptr_t>(n) * sizeof(std::int32_t)});
}

/// check_view on several named views in turn ("x", x, "w", w, ...); the first failure is returned.
inline status check_views(const char*) { return {}; }
template <class V, class... Rest>
status check_views(const char* fn, const char* name, const V& v, const Rest&... rest) {
  KVEVICT_TRY(check_view(fn, name, v));
  return check_views(fn, rest...);
}

/// Offsets [n + 1] of n lists (a varlen batch's cu_seqlens, a page table's indptr; not null): off[0]
/// == 0 and never decreasing, a decrease named by the list's `item` word ("sequence", "list").
/// check_offsets below is the per-head form (count, pointer and end limit checked too).
inline status check_list_offsets(const char* fn, const char* name, const std::int32_t* off, index_t n,
                                 const char* item) {
  if (off[0] != 0) return status::error(errc::invalid_argument, "%s: %s[0] must be 0 (got %d)", fn, name, off[0]);
  for (index_t i = 0; i < n; ++i)
    if (off[i + 1] < off[i])
      return status::error(errc::invalid_argument, "%s: %s is not monotone: %s %lld has %d -> %d", fn, name, item,
                           static_cast<long long>(i), off[i], off[i + 1]);
  return {};
}

/// Checks cu[0] == 0, non-decreasing offsets, and cu[n] <= limit (when limit >= 0).
inline status check_offsets(const char* fn, const char* name, const std::int32_t* cu, index_t n,
                            index_t limit = -1) {
  if (n < 0) return status::error(errc::invalid_argument, "%s: %s has a negative head count (%lld)", fn, name,
                                  static_cast<long long>(n));
  if (cu == nullptr) return status::error(errc::null_pointer, "%s: %s offsets are null", fn, name);
  if (cu[0] != 0) return status::error(errc::invalid_argument, "%s: %s[0] must be 0 (got %d)", fn, name, cu[0]);
  for (index_t h = 0; h < n; ++h)
    if (cu[h + 1] < cu[h])
      return status::error(errc::invalid_argument, "%s: %s decreases at head %lld (%d -> %d)", fn, name,
                           static_cast<long long>(h), cu[h], cu[h + 1]);
  if (limit >= 0 && cu[n] > limit)
    return status::error(errc::out_of_range, "%s: %s ends at %d, past the %lld rows available", fn, name, cu[n],
                         static_cast<long long>(limit));
  return {};
}

}  // namespace kvevict::detail
