// kvevict/drivers/compact_layer.hpp: applies a driver's answer to one layer of the engine's cache
// (docs/drivers.md).
//
//   compact_layer(be, keys, values, positions, d.kept(l))
//
// Keys, values and the rows' original positions are compacted together, in place: head h keeps
// rows kept.pos[kept.cu[h] ..] (strictly ascending, each below the head's row count, the order
// every driver answers in), packed to the front of its region in that order, and the row count
// becomes the number kept. All three caches are checked before any row moves (all or nothing),
// so their `lens` arrays may be one shared array or three.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/drivers/detail/driver_checks.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {

/// Compacts a layer's keys and values ([H] heads of dim d, any row strides) and its positions
/// (dim 1: the original position of every row) with the kept rows of a driver's answer (kept(l)),
/// in place. Every head of the three caches must hold the same number of rows. Rows past the new
/// lengths keep stale data. O(kept rows x (2 d + 1)); no allocation.
/// Errors (nothing is written): the caches' layouts (heads, dims, offsets, lens outside their
/// capacities, null pointers); positions of dim != 1; heads holding different row counts in the
/// three caches (shape_mismatch); kept with another head count, bad offsets, or positions not
/// strictly ascending or outside a head's rows; kept overlapping a cache (overlap).
template <class Backend, class T>
status compact_layer(Backend be, ragged_cache<T> keys, ragged_cache<T> values, ragged_cache<pos_t> positions,
                     ragged_positions kept) {
  constexpr const char* fn = "compact_layer";
  static_assert(!std::is_const_v<T>, "compact_layer: the caches are written");
  const index_t H = keys.heads;
  KVEVICT_TRY(detail::check_cache_layout(fn, "keys", const_cache(keys), H, keys.dim));
  KVEVICT_TRY(detail::check_cache_layout(fn, "values", const_cache(values), H, keys.dim));
  KVEVICT_TRY(detail::check_cache_layout(fn, "positions", const_cache(positions), H, 1));
  for (index_t h = 0; h < H; ++h)
    if (values.lens[h] != keys.lens[h] || positions.lens[h] != keys.lens[h])
      return status::error(errc::shape_mismatch, "%s: head %lld holds %d key rows, %d value rows and %d positions", fn,
                           static_cast<long long>(h), keys.lens[h], values.lens[h], positions.lens[h]);
  if (kept.heads != H)
    return status::error(errc::shape_mismatch, "%s: kept lists %lld heads, the layer has %lld", fn,
                         static_cast<long long>(kept.heads), static_cast<long long>(H));
  KVEVICT_TRY(detail::check_ragged_positions(fn, kept));
  KVEVICT_TRY(detail::check_kept_ragged(fn, kept, [&](index_t h) { return index_t(keys.lens[h]); }, true));
  const detail::byte_range kr = detail::positions_range(kept.pos, H > 0 ? kept.cu[H] : 0);
  const auto rows_of = [](const auto& c) { return detail::rows_range(c.data, c.cu_capacity[c.heads], c.row_stride); };
  if (kr.intersects(rows_of(keys)) || kr.intersects(rows_of(values)) || kr.intersects(rows_of(positions)))
    return detail::overlap_error(fn, "kept", "the layer's caches");
  detail::parallel_for(be, H, [&](index_t h) {
    const index_t n = kept.length(h);
    for (index_t j = 0; j < n; ++j) {
      const pos_t p = kept.pos[kept.cu[h] + j];
      if (p == j) continue;
      detail::copy_row_host(keys.row(h, j), 1, keys.row(h, p), 1, keys.dim);
      detail::copy_row_host(values.row(h, j), 1, values.row(h, p), 1, values.dim);
      *positions.row(h, j) = *positions.row(h, p);
    }
  });
  // the lengths last: the three arrays may be one
  for (index_t h = 0; h < H; ++h) {
    const auto n = static_cast<std::int32_t>(kept.length(h));
    keys.lens[h] = values.lens[h] = positions.lens[h] = n;
  }
  return {};
}

}  // namespace kvevict
