// kvevict/view.hpp: non-owning views over KV caches, scores and index lists.
//
// Dense caches are `cuda::std::mdspan`s with `layout_stride` whose *logical* order is always
// [head][token][dim]; the memory order is whatever the engine uses. Both
//   head-major  [H][T][D]   (strides T*D, D, 1)
//   token-major [T][H][D]   (strides D, H*D, 1)
// are viewed without copies, as is any padded layout with positive, non-overlapping strides.
//
// Ragged caches (heads holding different numbers of tokens, after AdaKV/LAVa eviction) are a
// flat head-major row buffer plus offsets `cu_lens[H+1]` (int32, the flash-attention varlen
// ABI): head h owns rows [cu_lens[h], cu_lens[h+1]).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/status.hpp>

#include <cuda/std/array>
#include <cuda/std/mdspan>

#include <cstddef>
#include <type_traits>

namespace kvevict {

template <class T, std::size_t Rank>
using strided_view = cuda::std::mdspan<T, cuda::std::dextents<index_t, Rank>, cuda::std::layout_stride>;

/// Dense KV tensor, logical order [head][token][dim].
template <class T>
using kv_view = strided_view<T, 3>;
/// A matrix: [row][column], e.g. scores [kv_head][token] or kept positions [kv_head][k].
template <class T>
using matrix_view = strided_view<T, 2>;
/// A vector with a stride.
template <class T>
using vector_view = strided_view<T, 1>;

enum class kv_layout {
  head_major,   ///< memory [head][token][dim]
  token_major,  ///< memory [token][head][dim] (llama.cpp, vLLM-style per-token rows)
};

namespace detail {
/// a * b, or false if it overflows index_t or either operand is negative.
constexpr bool checked_mul(index_t a, index_t b, index_t& out) noexcept {
  if (a < 0 || b < 0) return false;
  if (a != 0 && b > INT64_MAX / a) return false;
  out = a * b;
  return true;
}
constexpr bool checked_add(index_t a, index_t b, index_t& out) noexcept {
  if (a < 0 || b < 0 || a > INT64_MAX - b) return false;
  out = a + b;
  return true;
}

/// Checks extents/strides the way layout_stride requires (non-negative extents, positive strides,
/// representable span, unique mapping) and returns a specific error instead of asserting.
template <std::size_t Rank>
status check_extents_strides(const char* what, const index_t (&ext)[Rank], const index_t (&str)[Rank],
                             std::size_t elem_size, const void* data) {
  index_t span = 1;  // required span size in elements (0 if any extent is 0)
  bool empty = false;
  for (std::size_t i = 0; i < Rank; ++i) {
    if (ext[i] < 0)
      return status::error(errc::invalid_argument, "%s: extent %zu is negative (%lld)", what, i,
                           static_cast<long long>(ext[i]));
    if (str[i] <= 0)
      return status::error(errc::invalid_argument, "%s: stride %zu must be positive (got %lld)", what, i,
                           static_cast<long long>(str[i]));
    if (ext[i] == 0) empty = true;
  }
  if (!empty) {
    for (std::size_t i = 0; i < Rank; ++i) {
      index_t term = 0;
      if (!checked_mul(ext[i] - 1, str[i], term) || !checked_add(span, term, span))
        return status::error(errc::size_overflow, "%s: extents x strides overflow a 64-bit index", what);
    }
    index_t bytes = 0;
    if (!checked_mul(span, static_cast<index_t>(elem_size), bytes))
      return status::error(errc::size_overflow, "%s: the view spans more than 2^63 bytes", what);
    if (data == nullptr)
      return status::error(errc::null_pointer, "%s: data is null but the view has %lld elements", what,
                           static_cast<long long>(span));
    // unique mapping (the sufficient condition layout_stride asserts): ignoring dimensions of
    // extent 1, sorted by stride, each stride must step over the whole previous dimension.
    // Rank 1 is always unique (and GCC's -Warray-bounds misreads the loops below for it).
    if constexpr (Rank > 1) {
    std::size_t order[Rank];
    std::size_t n = 0;
    for (std::size_t i = 0; i < Rank; ++i)
      if (ext[i] > 1) order[n++] = i;
    for (std::size_t i = 1; i < n; ++i)
      for (std::size_t j = i; j > 0 && str[order[j]] < str[order[j - 1]]; --j) {
        const std::size_t t = order[j];
        order[j] = order[j - 1];
        order[j - 1] = t;
      }
    for (std::size_t i = 1; i < n; ++i) {
      const index_t prev = str[order[i - 1]] * ext[order[i - 1]];  // fits: bounded by span above
      if (str[order[i]] < prev)
        return status::error(errc::overlap, "%s: strides make distinct elements alias (dimension %zu overlaps %zu)",
                             what, order[i], order[i - 1]);
    }
    }
  }
  return {};
}

template <class T, std::size_t Rank>
result<strided_view<T, Rank>> make_strided(const char* what, T* data, const index_t (&ext)[Rank],
                                           const index_t (&str)[Rank]) {
  KVEVICT_TRY(check_extents_strides(what, ext, str, sizeof(T), data));
  cuda::std::array<index_t, Rank> e{}, s{};
  for (std::size_t i = 0; i < Rank; ++i) {
    e[i] = ext[i];
    s[i] = str[i];
  }
  using exts = cuda::std::dextents<index_t, Rank>;
  return strided_view<T, Rank>(data, typename cuda::std::layout_stride::template mapping<exts>(exts(e), s));
}
}  // namespace detail

/// View a contiguous cache of `heads` x `tokens` x `dim` in the given memory layout.
template <class T>
result<kv_view<T>> make_kv_view(T* data, index_t heads, index_t tokens, index_t dim,
                                kv_layout layout = kv_layout::head_major) {
  index_t ext[3] = {heads, tokens, dim};
  index_t str[3] = {0, 0, 1};
  if (layout == kv_layout::head_major) {
    str[1] = dim;
    if (!detail::checked_mul(tokens, dim, str[0]))
      return status::error(errc::size_overflow, "make_kv_view: tokens x dim overflows");
  } else {
    str[0] = dim;
    if (!detail::checked_mul(heads, dim, str[1]))
      return status::error(errc::size_overflow, "make_kv_view: heads x dim overflows");
  }
  // zero-sized dimensions make strides zero; any positive stride is equivalent then
  for (index_t& s : str)
    if (s <= 0 && heads >= 0 && tokens >= 0 && dim >= 0) s = 1;
  return detail::make_strided<T, 3>("make_kv_view", data, ext, str);
}

/// View any strided [head][token][dim] cache: element (h, t, d) is at
/// data[h*head_stride + t*token_stride + d*dim_stride] (strides in elements, all positive).
template <class T>
result<kv_view<T>> make_kv_view(T* data, index_t heads, index_t tokens, index_t dim, index_t head_stride,
                                index_t token_stride, index_t dim_stride = 1) {
  const index_t ext[3] = {heads, tokens, dim};
  const index_t str[3] = {head_stride, token_stride, dim_stride};
  return detail::make_strided<T, 3>("make_kv_view", data, ext, str);
}

/// Tokens [first, first + n) of every head of `v`, without a copy (same strides). Errors: a range
/// outside [0, v.extent(1)] (out_of_range).
template <class T>
result<kv_view<T>> token_range(kv_view<T> v, index_t first, index_t n) {
  if (first < 0 || n < 0 || first > v.extent(1) - n)
    return status::error(errc::out_of_range, "token_range: tokens [%lld, %lld + %lld) of a view of %lld tokens",
                         static_cast<long long>(first), static_cast<long long>(first), static_cast<long long>(n),
                         static_cast<long long>(v.extent(1)));
  return make_kv_view(v.data_handle() + first * v.stride(1), v.extent(0), n, v.extent(2), v.stride(0), v.stride(1),
                      v.stride(2));
}

/// View a row-major matrix with `row_stride` elements between rows (default: `cols`).
template <class T>
result<matrix_view<T>> make_matrix_view(T* data, index_t rows, index_t cols, index_t row_stride = -1) {
  const index_t rs = row_stride < 0 ? (cols > 0 ? cols : 1) : row_stride;
  const index_t ext[2] = {rows, cols};
  const index_t str[2] = {rs, 1};
  return detail::make_strided<T, 2>("make_matrix_view", data, ext, str);
}

/// A ragged, head-major cache: head h holds rows [cu_lens[h], cu_lens[h+1]) of `data`, each row
/// `dim` elements, consecutive rows `row_stride` elements apart (>= dim). Offsets are int32.
template <class T>
struct ragged_view {
  T* data = nullptr;
  const std::int32_t* cu_lens = nullptr;  ///< H+1 non-decreasing offsets, cu_lens[0] == 0
  index_t heads = 0;
  index_t dim = 0;
  index_t row_stride = 0;

  KVEVICT_HOST_DEVICE index_t length(index_t h) const { return cu_lens[h + 1] - cu_lens[h]; }
  KVEVICT_HOST_DEVICE index_t total_rows() const { return heads > 0 ? cu_lens[heads] : 0; }
  KVEVICT_HOST_DEVICE T* row(index_t h, index_t j) const { return data + (cu_lens[h] + j) * row_stride; }
};

/// A ragged cache with preallocated room per head, for decode-time appends without reallocation:
/// head h owns rows [cu_capacity[h], cu_capacity[h+1]) and currently holds `lens[h]` of them.
template <class T>
struct ragged_cache {
  T* data = nullptr;
  const std::int32_t* cu_capacity = nullptr;  ///< H+1 non-decreasing offsets, cu_capacity[0] == 0
  std::int32_t* lens = nullptr;               ///< H current lengths, 0 <= lens[h] <= capacity(h)
  index_t heads = 0;
  index_t dim = 0;
  index_t row_stride = 0;

  KVEVICT_HOST_DEVICE index_t capacity(index_t h) const { return cu_capacity[h + 1] - cu_capacity[h]; }
  KVEVICT_HOST_DEVICE T* row(index_t h, index_t j) const { return data + (cu_capacity[h] + j) * row_stride; }
};

/// Per-head lists of token positions in one flat buffer: head h's list is pos[cu[h] .. cu[h+1]).
/// Used for kept sets of different sizes per head. `P` is `const pos_t` for inputs
/// (`ragged_positions`) and `pos_t` for outputs a stage fills (`ragged_positions_out`).
template <class P>
struct basic_ragged_positions {
  P* pos = nullptr;
  const std::int32_t* cu = nullptr;  ///< H+1 offsets
  index_t heads = 0;

  basic_ragged_positions() = default;
  KVEVICT_HOST_DEVICE basic_ragged_positions(P* p, const std::int32_t* c, index_t h) : pos(p), cu(c), heads(h) {}
  /// An output list (pos_t) is readable as an input list (const pos_t).
  template <class Q, std::enable_if_t<std::is_same_v<const Q, P> && !std::is_same_v<Q, P>, int> = 0>
  KVEVICT_HOST_DEVICE basic_ragged_positions(const basic_ragged_positions<Q>& o)  // NOLINT(google-explicit-constructor)
      : pos(o.pos), cu(o.cu), heads(o.heads) {}

  KVEVICT_HOST_DEVICE index_t length(index_t h) const { return cu[h + 1] - cu[h]; }
  /// All heads' positions together (0 without heads, when `cu` may be null).
  KVEVICT_HOST_DEVICE index_t total() const { return heads > 0 ? cu[heads] : 0; }
};
using ragged_positions = basic_ragged_positions<const pos_t>;
using ragged_positions_out = basic_ragged_positions<pos_t>;

}  // namespace kvevict
