// kvevict/compact.hpp: gather the kept rows of a KV cache (the last stage of every recipe).
//
//   compact(be, src, kept, dst)           dense:  dst[h][j][:] = src[h][kept[h][j]][:]
//   compact(be, src, kept_ragged, dst)    ragged: head h's kept rows packed into a ragged_view
//                                         or into a ragged_cache (which then holds them, with
//                                         room left for decode-time appends)
//   compact_inplace(be, cache, kept)      same gather, overwriting the cache's first rows
//   append(be, cache, rows)               decode-time: add rows to every head of a ragged_cache
//
// Out-of-place gathers accept any positions (duplicates, any order). In-place compaction needs
// each head's positions strictly ascending (what `select` returns): then row j is read from
// position kept[j] >= j before anything overwrites it. Nothing here allocates.
// Element types: any trivially copyable T (float, float16, bfloat16, int8 codes...); rows are copied
// bit-exactly. The CUDA overloads are in <kvevict/cuda/compact.cuh>.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/host/gather_host.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvevict {
namespace detail {

template <class T>
KVEVICT_HOST_DEVICE inline void copy_row(T* dst, index_t dst_stride, const T* src, index_t src_stride,
                                         index_t dim) {
  for (index_t d = 0; d < dim; ++d) dst[d * dst_stride] = src[d * src_stride];
}

template <class T>
inline void copy_row_host(T* dst, index_t dst_stride, const T* src, index_t src_stride, index_t dim) {
  if (dst_stride == 1 && src_stride == 1) {
    if (dst != src) std::memcpy(dst, src, static_cast<std::size_t>(dim) * sizeof(T));
  } else {
    copy_row(dst, dst_stride, src, src_stride, dim);
  }
}

template <class T>
const T* row_ptr(const kv_view<const T>& v, index_t h, index_t t) {
  return v.data_handle() + h * v.stride(0) + t * v.stride(1);
}
template <class T>
T* row_ptr(const kv_view<T>& v, index_t h, index_t t) {
  return v.data_handle() + h * v.stride(0) + t * v.stride(1);
}

/// Bytes of `rows` rows of dim elements of T (the output of one compaction).
template <class T>
std::size_t rows_bytes(index_t rows, index_t dim) {
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(dim) * sizeof(T);
}

/// Kept positions of one dense kept matrix: shape, range and (for in-place) strict ascent.
/// Each head's row is first scanned without branches (a flag folded over the row, vectorisable);
/// only a row that fails is walked again for the first bad position, whose error is returned.
inline status check_kept_matrix(const char* fn, const matrix_view<const pos_t>& kept, index_t tokens,
                                bool ascending) {
  const index_t k = kept.extent(1), ks = kept.stride(1);
  for (index_t h = 0; h < kept.extent(0); ++h) {
    const pos_t* row = kept.data_handle() + h * kept.stride(0);
    // p outside [0, tokens) as one unsigned compare; in-place: p <= the previous position
    const auto limit = static_cast<std::uint64_t>(tokens);
    unsigned bad = 0;
    if (ks == 1) {
      for (index_t j = 0; j < k; ++j)
        bad |= static_cast<unsigned>(static_cast<std::uint64_t>(static_cast<std::int64_t>(row[j])) >= limit);
      if (ascending)
        for (index_t j = 1; j < k; ++j) bad |= static_cast<unsigned>(row[j] <= row[j - 1]);
    } else {
      bad = 1;  // strided positions: the walk below
    }
    if (bad == 0) continue;
    for (index_t j = 0; j < k; ++j) {
      const pos_t p = kept(h, j);
      if (p < 0 || p >= tokens)
        return status::error(errc::out_of_range, "%s: kept[%lld][%lld] = %d is outside [0, %lld) tokens", fn,
                             static_cast<long long>(h), static_cast<long long>(j), p,
                             static_cast<long long>(tokens));
      if (ascending && j > 0 && p <= kept(h, j - 1))
        return status::error(errc::not_sorted,
                             "%s: in-place compaction needs strictly ascending positions; kept[%lld][%lld] = %d "
                             "follows %d",
                             fn, static_cast<long long>(h), static_cast<long long>(j), p, kept(h, j - 1));
    }
  }
  return {};
}

/// Head h's positions of a ragged kept list must lie in [0, tokens(h)) (and ascend if asked).
template <class TokensOf>
status check_kept_ragged(const char* fn, const ragged_positions& kept, TokensOf tokens, bool ascending) {
  for (index_t h = 0; h < kept.heads; ++h) {
    const index_t n = tokens(h);
    for (index_t j = kept.cu[h]; j < kept.cu[h + 1]; ++j) {
      const pos_t p = kept.pos[j];
      if (p < 0 || p >= n)
        return status::error(errc::out_of_range, "%s: kept position %d of head %lld is outside [0, %lld)", fn, p,
                             static_cast<long long>(h), static_cast<long long>(n));
      if (ascending && j > kept.cu[h] && p <= kept.pos[j - 1])
        return status::error(errc::not_sorted,
                             "%s: in-place compaction needs strictly ascending positions; head %lld has %d after %d",
                             fn, static_cast<long long>(h), p, kept.pos[j - 1]);
    }
  }
  return {};
}

inline status check_ragged_positions(const char* fn, const ragged_positions& kept) {
  KVEVICT_TRY(check_offsets(fn, "kept.cu", kept.cu, kept.heads));
  if (kept.pos == nullptr && kept.total() > 0)
    return status::error(errc::null_pointer, "%s: kept.pos is null but %lld positions are listed", fn,
                         static_cast<long long>(kept.total()));
  return {};
}

/// dim >= 0 and row_stride >= max(dim, 1) (no data read).
inline status check_ragged_layout(const char* fn, const char* name, index_t dim, index_t row_stride) {
  if (dim < 0) return status::error(errc::invalid_argument, "%s: %s.dim is negative", fn, name);
  if (row_stride < dim || row_stride <= 0)
    return status::error(errc::invalid_argument, "%s: %s.row_stride (%lld) must be positive and >= dim (%lld)", fn,
                         name, static_cast<long long>(row_stride), static_cast<long long>(dim));
  return {};
}

template <class T>
status check_ragged_rows(const char* fn, const char* name, const T* data, index_t dim, index_t row_stride,
                         index_t rows) {
  KVEVICT_TRY(check_ragged_layout(fn, name, dim, row_stride));
  index_t total = 0;
  if (!checked_mul(rows, row_stride, total) || !checked_mul(total, static_cast<index_t>(sizeof(T)), total))
    return status::error(errc::size_overflow, "%s: %s rows x row_stride overflows", fn, name);
  if (data == nullptr && rows > 0 && dim > 0)
    return status::error(errc::null_pointer, "%s: %s.data is null but it holds %lld rows", fn, name,
                         static_cast<long long>(rows));
  return {};
}

template <class T>
byte_range rows_range(const T* data, index_t rows, index_t row_stride) {
  if (rows <= 0) return {};
  const auto b = reinterpret_cast<std::uintptr_t>(data);
  return {b, b + static_cast<std::uintptr_t>(rows * row_stride) * sizeof(T)};
}
inline byte_range positions_range(const pos_t* p, index_t n) {
  if (n <= 0) return {};
  const auto b = reinterpret_cast<std::uintptr_t>(p);
  return {b, b + static_cast<std::uintptr_t>(n) * sizeof(pos_t)};
}

inline byte_range ints_range(const std::int32_t* p, index_t n) { return p ? positions_range(p, n) : byte_range{}; }

/// A named byte range for the aliasing check of the ragged forms.
struct named_range {
  const char* name;
  byte_range r;
};
/// Everything a call writes (rows, lengths) must be disjoint from everything else it touches:
/// lengths stored inside the rows, or offsets inside the lengths, would be corrupted mid-call.
template <std::size_t W, std::size_t R>
status check_disjoint(const char* fn, const named_range (&written)[W], const named_range (&read)[R]) {
  for (std::size_t i = 0; i < W; ++i) {
    for (std::size_t j = 0; j < i; ++j)
      if (written[i].r.intersects(written[j].r))
        return status::error(errc::overlap, "%s: %s and %s overlap in memory", fn, written[j].name, written[i].name);
    for (std::size_t j = 0; j < R; ++j)
      if (written[i].r.intersects(read[j].r))
        return status::error(errc::overlap, "%s: %s and %s overlap in memory", fn, read[j].name, written[i].name);
  }
  return {};
}

inline status overlap_error(const char* fn, const char* a, const char* b) {
  return status::error(errc::overlap, "%s: %s and %s overlap in memory%s", fn, a, b,
                       " (use compact_inplace to compact a cache onto itself)");
}

/// Shapes of a gather into per-head ragged rows (ragged_view or ragged_cache): src view, head
/// counts, head dims, the destination's row layout. Reads no offsets.
template <class T>
status check_compact_ragged_shape(const char* fn, const kv_view<const T>& src, index_t kept_heads, index_t dst_heads,
                                  index_t dst_dim, index_t dst_row_stride) {
  KVEVICT_TRY(check_view(fn, "src", src));
  if (kept_heads != src.extent(0) || dst_heads != src.extent(0))
    return status::error(errc::shape_mismatch, "%s: head counts differ (src %lld, kept %lld, dst %lld)", fn,
                         static_cast<long long>(src.extent(0)), static_cast<long long>(kept_heads),
                         static_cast<long long>(dst_heads));
  if (dst_dim != src.extent(2))
    return status::error(errc::shape_mismatch, "%s: head dims differ (src %lld, dst %lld)", fn,
                         static_cast<long long>(src.extent(2)), static_cast<long long>(dst_dim));
  return check_ragged_layout(fn, "dst", dst_dim, dst_row_stride);
}

/// In place on a dense cache: views, head counts, kept stored inside the cache.
template <class T>
status check_inplace_dense_shape(const char* fn, const kv_view<T>& cache, const matrix_view<const pos_t>& kept) {
  KVEVICT_TRY(check_view(fn, "cache", cache));
  KVEVICT_TRY(check_view(fn, "kept", kept));
  if (kept.extent(0) != cache.extent(0))
    return status::error(errc::shape_mismatch, "%s: kept has %lld heads, the cache %lld", fn,
                         static_cast<long long>(kept.extent(0)), static_cast<long long>(cache.extent(0)));
  if (range_of(kept).intersects(range_of(cache))) return overlap_error(fn, "kept", "cache");
  return {};
}

/// In place on a ragged cache: head counts, lens present, the cache's row layout.
template <class T>
status check_inplace_ragged_shape(const char* fn, const ragged_cache<T>& cache, const ragged_positions& kept) {
  if (kept.heads != cache.heads)
    return status::error(errc::shape_mismatch, "%s: kept has %lld heads, the cache %lld", fn,
                         static_cast<long long>(kept.heads), static_cast<long long>(cache.heads));
  if (cache.lens == nullptr && cache.heads > 0) return status::error(errc::null_pointer, "%s: cache.lens is null", fn);
  return check_ragged_layout(fn, "cache", cache.dim, cache.row_stride);
}

/// Append: rows view, lens present, rows' heads and dim matching the cache's.
template <class T>
status check_append_shape(const char* fn, const ragged_cache<T>& cache, const kv_view<const T>& rows) {
  KVEVICT_TRY(check_view(fn, "rows", rows));
  if (cache.lens == nullptr && cache.heads > 0) return status::error(errc::null_pointer, "%s: cache.lens is null", fn);
  if (rows.extent(0) != cache.heads || rows.extent(2) != cache.dim)
    return status::error(errc::shape_mismatch, "%s: rows are [%lld][*][%lld] but the cache has %lld heads of dim %lld",
                         fn, static_cast<long long>(rows.extent(0)), static_cast<long long>(rows.extent(2)),
                         static_cast<long long>(cache.heads), static_cast<long long>(cache.dim));
  return {};
}


/// Shape and aliasing checks of the dense gather, shared by every backend (CUDA included: they
/// read only extents and pointers, never device memory).
template <class T>
status check_compact_dense_shapes(const char* fn, const kv_view<const T>& src, const matrix_view<const pos_t>& kept,
                                  const kv_view<T>& dst) {
  KVEVICT_TRY(check_view(fn, "src", src));
  KVEVICT_TRY(check_view(fn, "kept", kept));
  KVEVICT_TRY(check_view(fn, "dst", dst));
  if (kept.extent(0) != src.extent(0) || dst.extent(0) != src.extent(0))
    return status::error(errc::shape_mismatch, "%s: head counts differ (src %lld, kept %lld, dst %lld)", fn,
                         static_cast<long long>(src.extent(0)), static_cast<long long>(kept.extent(0)),
                         static_cast<long long>(dst.extent(0)));
  if (dst.extent(1) != kept.extent(1))
    return status::error(errc::shape_mismatch, "%s: dst holds %lld tokens per head but kept lists %lld", fn,
                         static_cast<long long>(dst.extent(1)), static_cast<long long>(kept.extent(1)));
  if (dst.extent(2) != src.extent(2))
    return status::error(errc::shape_mismatch, "%s: head dims differ (src %lld, dst %lld)", fn,
                         static_cast<long long>(src.extent(2)), static_cast<long long>(dst.extent(2)));
  if (kept.extent(1) > 0 && src.extent(1) == 0 && src.extent(0) > 0)
    return status::error(errc::out_of_range, "%s: kept lists %lld tokens per head of an empty source", fn,
                         static_cast<long long>(kept.extent(1)));
  if (range_of(src).intersects(range_of(dst))) return overlap_error(fn, "src", "dst");
  if (range_of(kept).intersects(range_of(dst))) return overlap_error(fn, "kept", "dst");
  return {};
}

/// Every check of a gather into per-head ragged rows (compact's ragged_view and ragged_cache
/// overloads; Dst is one of the two), in this order, before anything is written: shapes,
/// (ragged_cache) dst.lens present, kept's offsets, dst's offsets (cu_lens / cu_capacity),
/// (ragged_view) dst.cu_lens equal to kept.cu, dst's rows, (ragged_cache) every head's capacity,
/// overlaps, kept's positions inside src.
template <class T, class Dst>
status check_ragged_gather(const char* fn, const kv_view<const T>& src, const ragged_positions& kept, const Dst& dst) {
  constexpr bool cache = std::is_same_v<Dst, ragged_cache<T>>;
  static_assert(cache || std::is_same_v<Dst, ragged_view<T>>, "check_ragged_gather: dst is a ragged view or cache");
  KVEVICT_TRY(check_compact_ragged_shape(fn, src, kept.heads, dst.heads, dst.dim, dst.row_stride));
  const std::int32_t* cu = nullptr;
  const std::int32_t* lens = nullptr;
  const char* cu_name = nullptr;
  if constexpr (cache) {
    if (dst.lens == nullptr && dst.heads > 0) return status::error(errc::null_pointer, "%s: dst.lens is null", fn);
    cu = dst.cu_capacity;
    cu_name = "dst.cu_capacity";
    lens = dst.lens;
  } else {
    cu = dst.cu_lens;
    cu_name = "dst.cu_lens";
  }
  KVEVICT_TRY(check_ragged_positions(fn, kept));
  KVEVICT_TRY(check_offsets(fn, cu_name, cu, dst.heads));
  if constexpr (!cache)
    for (index_t h = 0; h <= dst.heads; ++h)
      if (dst.cu_lens[h] != kept.cu[h])
        return status::error(errc::shape_mismatch, "%s: dst.cu_lens[%lld] = %d but kept.cu[%lld] = %d", fn,
                             static_cast<long long>(h), dst.cu_lens[h], static_cast<long long>(h), kept.cu[h]);
  const index_t rows = dst.heads > 0 ? cu[dst.heads] : 0;
  KVEVICT_TRY(check_ragged_rows(fn, "dst", dst.data, dst.dim, dst.row_stride, rows));
  if constexpr (cache)
    for (index_t h = 0; h < dst.heads; ++h)
      if (kept.length(h) > dst.capacity(h))
        return status::error(errc::capacity_exceeded, "%s: head %lld keeps %lld rows but has capacity for %lld", fn,
                             static_cast<long long>(h), static_cast<long long>(kept.length(h)),
                             static_cast<long long>(dst.capacity(h)));
  const auto dst_range = rows_range(dst.data, rows, dst.row_stride);
  if (range_of(src).intersects(dst_range)) return overlap_error(fn, "src", "dst");
  const auto kept_range = positions_range(kept.pos, kept.total());
  if (kept_range.intersects(dst_range)) return overlap_error(fn, "kept", "dst");
  const named_range written[] = {{"dst", dst_range}, {"dst.lens", ints_range(lens, dst.heads)}};
  const named_range read[] = {{"src", range_of(src)},
                              {"kept", kept_range},
                              {"kept.cu", ints_range(kept.cu, kept.heads + 1)},
                              {cu_name, ints_range(cu, dst.heads + 1)}};
  KVEVICT_TRY(check_disjoint(fn, written, read));
  return check_kept_ragged(fn, kept, [&](index_t) { return src.extent(1); }, false);
}

/// compact's and append's source rows as a read-only view of the destination's element type T
/// (a source of another element type does not compile).
template <class T, class S>
kv_view<const T> source_rows(const kv_view<S>& src) {
  static_assert(std::is_same_v<std::remove_const_t<S>, T>,
                "compact / append: source and destination element types differ");
  return src;
}

}  // namespace detail

/// Dense gather: dst[h][j][:] = src[h][kept[h][j]][:] for every head h and j < kept.extent(1).
/// Errors: invalid views, shape mismatches, positions outside [0, src tokens), src/dst overlap.
template <class Backend, class S, class T>
status compact(Backend be, kv_view<S> src_in, matrix_view<const pos_t> kept, kv_view<T> dst) {
  constexpr const char* fn = "compact";
  const kv_view<const T> src = detail::source_rows<T>(src_in);
  KVEVICT_TRY(detail::check_compact_dense_shapes(fn, src, kept, dst));
  KVEVICT_TRY(detail::check_kept_matrix(fn, kept, src.extent(1), /*ascending=*/false));
  const index_t k = kept.extent(1), dim = src.extent(2);
  if (src.stride(2) == 1 && dst.stride(2) == 1) {
    // contiguous rows: blocks of rows of a head per iteration (detail::gather_block), the source
    // rows prefetched across the blocks of a head, streamed stores for outputs of 8 MiB or more
    // (detail::gather_streams, detail::gather_rows_host)
    const bool stream = detail::gather_streams(detail::rows_bytes<T>(src.extent(0) * k, dim));
    const index_t block = detail::gather_block(stream), blocks = (k + block - 1) / block;
    detail::parallel_for(be, src.extent(0) * blocks, [&](index_t i) {
      const index_t h = i / blocks, j0 = (i % blocks) * block;
      const index_t n = std::min(block, k - j0);
      detail::gather_rows_host(detail::row_ptr(dst, h, j0), dst.stride(1), detail::row_ptr(src, h, 0), src.stride(1),
                               kept.data_handle() + h * kept.stride(0) + j0 * kept.stride(1), kept.stride(1), n,
                               k - j0 - n, dim, false, stream);
    });
    return {};
  }
  detail::parallel_for(be, src.extent(0) * k, [&](index_t i) {
    const index_t h = i / k, j = i % k;
    detail::copy_row_host(detail::row_ptr(dst, h, j), dst.stride(2), detail::row_ptr(src, h, kept(h, j)),
                          src.stride(2), dim);
  });
  return {};
}

/// In place: cache[h][j][:] = cache[h][kept[h][j]][:] for j < k; rows >= k keep stale data.
/// Each head's positions must be strictly ascending. Parallel over heads only.
template <class Backend, class T>
status compact_inplace(Backend be, kv_view<T> cache, matrix_view<const pos_t> kept) {
  constexpr const char* fn = "compact_inplace";
  KVEVICT_TRY(detail::check_inplace_dense_shape(fn, cache, kept));
  KVEVICT_TRY(detail::check_kept_matrix(fn, kept, cache.extent(1), /*ascending=*/true));
  const index_t k = kept.extent(1), dim = cache.extent(2);
  const bool stream = detail::gather_streams(detail::rows_bytes<T>(cache.extent(0) * k, dim));
  detail::parallel_for(be, cache.extent(0), [&](index_t h) {
    if (cache.stride(2) == 1) {
      detail::gather_rows_host(detail::row_ptr(cache, h, 0), cache.stride(1), detail::row_ptr(cache, h, 0),
                               cache.stride(1), kept.data_handle() + h * kept.stride(0), kept.stride(1), k, 0, dim, true,
                               stream);
      return;
    }
    for (index_t j = 0; j < k; ++j) {
      const pos_t p = kept(h, j);
      if (p != j)
        detail::copy_row_host(detail::row_ptr(cache, h, j), cache.stride(2), detail::row_ptr(cache, h, p),
                              cache.stride(2), dim);
    }
  });
  return {};
}

/// Ragged gather: head h's kept rows (kept.pos[kept.cu[h] ..]) packed into dst's rows of head h.
/// dst.cu_lens must equal kept.cu.
template <class Backend, class S, class T>
status compact(Backend be, kv_view<S> src_in, ragged_positions kept, ragged_view<T> dst) {
  const kv_view<const T> src = detail::source_rows<T>(src_in);
  KVEVICT_TRY(detail::check_ragged_gather("compact", src, kept, dst));
  if (src.stride(2) == 1) {
    // blocks of flat rows (detail::gather_block), each cut at head boundaries (detail::gather_rows_host)
    const index_t total = dst.total_rows();
    const bool stream = detail::gather_streams(detail::rows_bytes<T>(total, dst.dim));
    const index_t block = detail::gather_block(stream), blocks = (total + block - 1) / block;
    detail::parallel_for(be, blocks, [&](index_t b) {
      const index_t r0 = b * block, r1 = std::min(total, r0 + block);
      index_t h = std::upper_bound(kept.cu, kept.cu + kept.heads + 1, r0) - kept.cu - 1;
      for (index_t r = r0; r < r1; ++h) {
        const index_t e = std::min<index_t>(r1, kept.cu[h + 1]);
        detail::gather_rows_host(dst.data + r * dst.row_stride, dst.row_stride, detail::row_ptr(src, h, 0),
                                 src.stride(1), kept.pos + r, 1, e - r, kept.cu[h + 1] - e, dst.dim, false, stream);
        r = e;
      }
    });
    return {};
  }
  detail::parallel_for(be, dst.total_rows(), [&](index_t r) {
    // the head of flat row r: the last h with cu[h] <= r
    const index_t h = std::upper_bound(kept.cu, kept.cu + kept.heads + 1, r) - kept.cu - 1;
    detail::copy_row_host(dst.data + r * dst.row_stride, 1, detail::row_ptr(src, h, kept.pos[r]), src.stride(2),
                          dst.dim);
  });
  return {};
}

/// Dense prompt cache -> ragged cache with capacity: head h receives its kept rows and
/// lens[h] = number kept. Fails with capacity_exceeded (writing nothing) if any head lacks room.
template <class Backend, class S, class T>
status compact(Backend be, kv_view<S> src_in, ragged_positions kept, ragged_cache<T> dst) {
  const kv_view<const T> src = detail::source_rows<T>(src_in);
  KVEVICT_TRY(detail::check_ragged_gather("compact", src, kept, dst));
  const bool stream = detail::gather_streams(detail::rows_bytes<T>(kept.total(), dst.dim));
  detail::parallel_for(be, dst.heads, [&](index_t h) {
    const index_t n = kept.length(h);
    if (src.stride(2) == 1)
      detail::gather_rows_host(dst.row(h, 0), dst.row_stride, detail::row_ptr(src, h, 0), src.stride(1),
                               kept.pos + kept.cu[h], 1, n, 0, dst.dim, false, stream);
    else
      for (index_t j = 0; j < n; ++j)
        detail::copy_row_host(dst.row(h, j), 1, detail::row_ptr(src, h, kept.pos[kept.cu[h] + j]), src.stride(2),
                              dst.dim);
    dst.lens[h] = static_cast<std::int32_t>(n);
  });
  return {};
}

/// In place on a ragged cache: head h keeps rows kept.pos[kept.cu[h] ..] (strictly ascending,
/// each < lens[h]), packed to the front of its region; lens[h] becomes the number kept.
template <class Backend, class T>
status compact_inplace(Backend be, ragged_cache<T> cache, ragged_positions kept) {
  constexpr const char* fn = "compact_inplace";
  KVEVICT_TRY(detail::check_inplace_ragged_shape(fn, cache, kept));
  KVEVICT_TRY(detail::check_ragged_positions(fn, kept));
  KVEVICT_TRY(detail::check_offsets(fn, "cache.cu_capacity", cache.cu_capacity, cache.heads));
  const index_t rows = cache.heads > 0 ? cache.cu_capacity[cache.heads] : 0;
  KVEVICT_TRY(detail::check_ragged_rows(fn, "cache", cache.data, cache.dim, cache.row_stride, rows));
  for (index_t h = 0; h < cache.heads; ++h)
    if (cache.lens[h] < 0 || cache.lens[h] > cache.capacity(h))
      return status::error(errc::out_of_range, "%s: cache.lens[%lld] = %d is outside [0, %lld]", fn,
                           static_cast<long long>(h), cache.lens[h], static_cast<long long>(cache.capacity(h)));
  const auto cache_range = detail::rows_range(cache.data, rows, cache.row_stride);
  const auto kept_range = detail::positions_range(kept.pos, kept.total());
  if (kept_range.intersects(cache_range)) return detail::overlap_error(fn, "kept", "cache");
  {
    const detail::named_range written[] = {{"cache", cache_range},
                                           {"cache.lens", detail::ints_range(cache.lens, cache.heads)}};
    const detail::named_range read[] = {{"kept", kept_range},
                                        {"kept.cu", detail::ints_range(kept.cu, kept.heads + 1)},
                                        {"cache.cu_capacity", detail::ints_range(cache.cu_capacity, cache.heads + 1)}};
    KVEVICT_TRY(detail::check_disjoint(fn, written, read));
  }
  KVEVICT_TRY(detail::check_kept_ragged(fn, kept, [&](index_t h) { return index_t(cache.lens[h]); }, true));
  const bool stream = detail::gather_streams(detail::rows_bytes<T>(kept.total(), cache.dim));
  detail::parallel_for(be, cache.heads, [&](index_t h) {
    const index_t n = kept.length(h);
    detail::gather_rows_host(cache.row(h, 0), cache.row_stride, cache.row(h, 0), cache.row_stride, kept.pos + kept.cu[h],
                             1, n, 0, cache.dim, true, stream);
    cache.lens[h] = static_cast<std::int32_t>(n);
  });
  return {};
}

/// Decode-time append: rows[h][i][:] becomes row lens[h] + i of head h, then lens[h] += n.
/// Capacity is checked for every head before anything is written (all or nothing); no allocation.
template <class Backend, class T, class S>
status append(Backend be, ragged_cache<T> cache, kv_view<S> rows_in) {
  constexpr const char* fn = "append";
  const kv_view<const T> rows = detail::source_rows<T>(rows_in);
  KVEVICT_TRY(detail::check_append_shape(fn, cache, rows));
  KVEVICT_TRY(detail::check_offsets(fn, "cache.cu_capacity", cache.cu_capacity, cache.heads));
  const index_t total = cache.heads > 0 ? cache.cu_capacity[cache.heads] : 0;
  KVEVICT_TRY(detail::check_ragged_rows(fn, "cache", cache.data, cache.dim, cache.row_stride, total));
  const index_t n = rows.extent(1);
  for (index_t h = 0; h < cache.heads; ++h) {
    if (cache.lens[h] < 0 || cache.lens[h] > cache.capacity(h))
      return status::error(errc::out_of_range, "%s: cache.lens[%lld] = %d is outside [0, %lld]", fn,
                           static_cast<long long>(h), cache.lens[h], static_cast<long long>(cache.capacity(h)));
    if (cache.lens[h] + n > cache.capacity(h))
      return status::error(errc::capacity_exceeded, "%s: head %lld holds %d of %lld rows; %lld more do not fit", fn,
                           static_cast<long long>(h), cache.lens[h], static_cast<long long>(cache.capacity(h)),
                           static_cast<long long>(n));
  }
  const auto cache_range = detail::rows_range(cache.data, total, cache.row_stride);
  if (detail::range_of(rows).intersects(cache_range)) return detail::overlap_error(fn, "rows", "cache");
  {
    const detail::named_range written[] = {{"cache", cache_range},
                                           {"cache.lens", detail::ints_range(cache.lens, cache.heads)}};
    const detail::named_range read[] = {{"rows", detail::range_of(rows)},
                                        {"cache.cu_capacity", detail::ints_range(cache.cu_capacity, cache.heads + 1)}};
    KVEVICT_TRY(detail::check_disjoint(fn, written, read));
  }
  detail::parallel_for(be, cache.heads, [&](index_t h) {
    for (index_t i = 0; i < n; ++i)
      detail::copy_row_host(cache.row(h, cache.lens[h] + i), 1, detail::row_ptr(rows, h, i), rows.stride(2), cache.dim);
    cache.lens[h] += static_cast<std::int32_t>(n);
  });
  return {};
}

}  // namespace kvevict
