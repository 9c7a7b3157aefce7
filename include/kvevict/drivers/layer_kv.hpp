// kvevict/drivers/layer_kv.hpp: one layer of the engine's cache as the drivers read it
// (docs/drivers.md).
//
//   layer_kv<T>                    ragged keys, values and the ORIGINAL position of every row
//   paged_layer_kv<T>              the same in a paged cache: one sequence of a paged_layer, with a
//                                  page pool of positions read through the same block table
//   make_layer_kv(keys, values, positions)
//   ragged_from_dense(dense, cu_capacity, lens)   a head-major dense cache viewed as a ragged_cache
//   model_shape                    the layers and heads a driver serves
#pragma once

#include <kvevict/compact.hpp>
#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/paged_types.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {

/// One layer of the engine's KV cache as every driver reads it. Head h holds keys.lens[h] rows,
/// row j at keys.row(h, j) (and values.row(h, j)); positions[keys.cu_capacity[h] + j] is the
/// ORIGINAL token position of that row (the one RoPE used; eviction never changes it), so the
/// positions array is laid out like the rows (dim 1, row stride 1). Rows are in arrival order, so
/// each head's positions are strictly ascending (checked). Values may use other offsets and their
/// own `lens` array but must hold the same number of rows per head (checked).
/// An engine whose cache keeps keys, values and positions as three ragged caches with the same
/// offsets passes make_layer_kv(keys, values, positions).
template <class T>
struct layer_kv {
  ragged_cache<const T> keys;
  ragged_cache<const T> values;
  const pos_t* positions = nullptr;
};

/// One layer of a paged KV cache as the post-fill and decode drivers read it (docs/paged.md,
/// "Drivers on paged layers"): sequence `sequence` of `layer` (its rows r = sequence * kv_heads +
/// h are the driver's KV heads h; per-sequence or per-head block tables, NHD or HND pools) and the
/// ORIGINAL position of every row in `positions`, a pool of dim 1 with the keys' pages, page size
/// and heads per page, read through the same table (compact_layer's paged form moves it alike).
/// Rows are in arrival order (positions strictly ascending per row, checked). The driver's config
/// names the most pages the pools may have (pool_pages): its workspace holds a bitmap of them for
/// the table checks. Nothing is copied: keys and values are read through the page lists.
template <class T>
struct paged_layer_kv {
  paged_layer<const T> layer;
  page_pool<const pos_t> positions;
  index_t sequence = 0;
};

/// A paged_layer_kv from a (possibly writable) paged layer and position pool.
template <class T, class P>
paged_layer_kv<std::remove_const_t<T>> make_paged_layer_kv(const paged_layer<T>& layer, const page_pool<P>& positions,
                                                           index_t sequence = 0) noexcept {
  static_assert(std::is_same_v<std::remove_const_t<P>, pos_t>, "make_paged_layer_kv: positions are pos_t (int32)");
  using E = std::remove_const_t<T>;
  const auto pool = [](const auto& p) {
    using PE = std::remove_const_t<std::remove_pointer_t<decltype(p.data)>>;
    return page_pool<const PE>{p.data, p.pages, p.page_size, p.heads, p.dim, p.page_stride, p.token_stride, p.head_stride};
  };
  return {paged_layer<const E>{pool(layer.keys), pool(layer.values), layer.table, layer.sequences, layer.kv_heads,
                               layer.lists},
          pool(positions), sequence};
}

/// The same cache, read-only.
template <class T>
ragged_cache<const std::remove_const_t<T>> const_cache(const ragged_cache<T>& c) noexcept {
  return {c.data, c.cu_capacity, c.lens, c.heads, c.dim, c.row_stride};
}

/// A layer from its key and value caches and a positions array laid out like the key rows.
template <class T>
layer_kv<std::remove_const_t<T>> make_layer_kv(const ragged_cache<T>& keys, const ragged_cache<T>& values,
                                                const pos_t* positions) noexcept {
  return {const_cache(keys), const_cache(values), positions};
}

/// A layer from key / value caches and a positions cache (dim 1, row stride 1, the keys' offsets:
/// how an engine that stores positions as a third ragged cache holds them). Errors: positions with another head count, dim or
/// row stride than 1, or offsets that differ from the keys' (shape_mismatch); null offsets.
template <class T, class P>
result<layer_kv<std::remove_const_t<T>>> make_layer_kv(const ragged_cache<T>& keys, const ragged_cache<T>& values,
                                                       const ragged_cache<P>& positions) {
  static_assert(std::is_same_v<std::remove_const_t<P>, pos_t>, "make_layer_kv: positions are pos_t (int32)");
  constexpr const char* fn = "make_layer_kv";
  if (positions.heads != keys.heads)
    return status::error(errc::shape_mismatch, "%s: positions have %lld heads, the keys %lld", fn,
                         static_cast<long long>(positions.heads), static_cast<long long>(keys.heads));
  if (positions.dim != 1 || positions.row_stride != 1)
    return status::error(errc::shape_mismatch, "%s: positions must have dim 1 and row stride 1 (got %lld, %lld)", fn,
                         static_cast<long long>(positions.dim), static_cast<long long>(positions.row_stride));
  if (keys.cu_capacity == nullptr || positions.cu_capacity == nullptr)
    return status::error(errc::null_pointer, "%s: cu_capacity offsets are null", fn);
  for (index_t h = 0; h <= keys.heads; ++h)
    if (positions.cu_capacity[h] != keys.cu_capacity[h])
      return status::error(errc::shape_mismatch, "%s: positions.cu_capacity[%lld] = %d but keys.cu_capacity[%lld] = %d",
                           fn, static_cast<long long>(h), positions.cu_capacity[h], static_cast<long long>(h),
                           keys.cu_capacity[h]);
  return layer_kv<std::remove_const_t<T>>{const_cache(keys), const_cache(values), positions.data};
}

/// Views a dense cache [H][T][d] as a ragged_cache without copying: cu_capacity[h] = h C with
/// C = head stride / token stride (>= T; C = T for one head), lens[h] = T. The rows of a head must
/// be contiguous and evenly spaced, i.e. a head-major layout (padded capacity allowed): token-major
/// caches [T][H][d] cannot be ragged caches (use compact() to copy them into one). cu_capacity
/// (H + 1) and lens (H) are the caller's; the result reads the dense memory.
/// Errors: invalid view; dim stride != 1 (with d > 1); token stride < d; head stride not a multiple
/// >= T of the token stride; H C or T above INT32_MAX; null or overlapping cu_capacity / lens.
template <class T>
result<ragged_cache<T>> ragged_from_dense(kv_view<T> dense, std::int32_t* cu_capacity, std::int32_t* lens) {
  constexpr const char* fn = "ragged_from_dense";
  KVEVICT_TRY(detail::check_view(fn, "dense", dense));
  const index_t H = dense.extent(0), Tn = dense.extent(1), D = dense.extent(2);
  if (cu_capacity == nullptr) return status::error(errc::null_pointer, "%s: cu_capacity is null", fn);
  if (lens == nullptr && H > 0) return status::error(errc::null_pointer, "%s: lens is null", fn);
  if (D > 1 && dense.stride(2) != 1)
    return status::error(errc::invalid_argument, "%s: rows must be contiguous (dim stride %lld, expected 1)", fn,
                         static_cast<long long>(dense.stride(2)));
  const index_t rs = dense.stride(1);
  if (rs < D)
    return status::error(errc::invalid_argument, "%s: the token stride %lld is smaller than the head dim %lld", fn,
                         static_cast<long long>(rs), static_cast<long long>(D));
  index_t C = Tn;
  if (H > 1) {
    const index_t hs = dense.stride(0);
    if (hs % rs != 0 || hs / rs < Tn)
      return status::error(errc::invalid_argument,
                           "%s: the head stride %lld is not a multiple >= %lld tokens of the token stride %lld: a "
                           "ragged cache needs each head's rows contiguous (head-major layout; token-major caches "
                           "must be copied with compact)",
                           fn, static_cast<long long>(hs), static_cast<long long>(Tn), static_cast<long long>(rs));
    C = hs / rs;
  }
  index_t rows = 0;
  if (Tn > INT32_MAX || !detail::checked_mul(H, C, rows) || rows > INT32_MAX)
    return status::error(errc::size_overflow, "%s: %lld heads x %lld rows do not fit int32 offsets", fn,
                         static_cast<long long>(H), static_cast<long long>(C));
  const detail::byte_range data = detail::range_of(dense);
  const auto cb = reinterpret_cast<std::uintptr_t>(cu_capacity);
  const auto lb = reinterpret_cast<std::uintptr_t>(lens);
  const detail::byte_range cr{cb, cb + static_cast<std::uintptr_t>(H + 1) * sizeof(std::int32_t)};
  const detail::byte_range lr =
      H > 0 ? detail::byte_range{lb, lb + static_cast<std::uintptr_t>(H) * sizeof(std::int32_t)} : detail::byte_range{};
  if (cr.intersects(data) || lr.intersects(data) || cr.intersects(lr))
    return status::error(errc::overlap, "%s: cu_capacity, lens and the cache overlap in memory", fn);
  for (index_t h = 0; h <= H; ++h) cu_capacity[h] = static_cast<std::int32_t>(h * C);
  for (index_t h = 0; h < H; ++h) lens[h] = static_cast<std::int32_t>(Tn);
  return ragged_cache<T>{dense.data_handle(), cu_capacity, lens, H, D, rs > 0 ? rs : 1};
}

/// The model a driver serves: every layer has kv_heads KV heads and query_heads query heads
/// (GQA: query head q reads KV head q / (query_heads / kv_heads)) of dimension head_dim.
struct model_shape {
  index_t layers = 0;
  index_t kv_heads = 0;
  index_t query_heads = 0;
  index_t head_dim = 0;
};

}  // namespace kvevict
