// kvevict/drivers/compact_layer.hpp: applies a driver's answer to one layer of the engine's cache
// (docs/drivers.md).
//
//   compact_layer(be, keys, values, positions, d.kept(l))             a ragged (or dense) cache
//   compact_layer(be, ws, paged, position_pool, d.kept(l), freed)    a paged cache (docs/paged.md)
//   compact_layer(be, ws, paged, position_pool, s, d.kept(l), freed) sequence s of a paged batch
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
#include <kvevict/paged.hpp>
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

namespace detail {
/// compact_layer on a paged layer: every row (sequence < 0) or sequence `sequence`'s rows.
template <class Backend, class T>
status compact_paged_layer(Backend be, workspace& ws, paged_layer<T> layer, page_pool<pos_t> positions,
                           index_t sequence, ragged_positions kept, paged_compaction_out out) {
  constexpr const char* fn = "compact_layer";
  static_assert(!std::is_const_v<T>, "compact_layer: the pools are written");
  KVEVICT_TRY(detail::check_page_pool(fn, "positions", positions));
  if (positions.dim != 1 || positions.pages != layer.keys.pages || positions.page_size != layer.keys.page_size ||
      positions.heads != layer.keys.heads)
    return status::error(errc::shape_mismatch,
                         "%s: the position pool has %lld pages of %lld tokens x %lld heads x dim %lld, the keys %lld x "
                         "%lld x %lld (dim 1 needed)",
                         fn, static_cast<long long>(positions.pages), static_cast<long long>(positions.page_size),
                         static_cast<long long>(positions.heads), static_cast<long long>(positions.dim),
                         static_cast<long long>(layer.keys.pages), static_cast<long long>(layer.keys.page_size),
                         static_cast<long long>(layer.keys.heads));
  const bool one = sequence >= 0;
  const index_t R = one ? layer.kv_heads : layer.rows(), r0 = one ? sequence * layer.kv_heads : 0;
  const index_t lists = one ? (layer.lists == page_lists::per_head ? R : 1) : layer.table.lists;
  if (kept.heads == R && kept.cu != nullptr && R >= 0) {  // compact_paged reports other kept shapes
    detail::byte_range tr[3];
    detail::table_ranges(layer.table, tr);
    const detail::byte_range pr = detail::pool_range(positions);
    const detail::byte_range others[] = {detail::pool_range(layer.keys),
                                         detail::pool_range(layer.values),
                                         tr[0],
                                         tr[1],
                                         tr[2],
                                         detail::positions_range(kept.pos, R > 0 ? kept.cu[R] : 0),
                                         detail::ints_range(kept.cu, R + 1),
                                         detail::ints_range(out.lengths, lists),
                                         detail::ints_range(out.freed_pages, out.freed_capacity),
                                         detail::ints_range(out.freed_count, 1)};
    for (const detail::byte_range& o : others)
      if (pr.intersects(o)) return detail::overlap_error(fn, "positions", "the layer's pools, table, kept or outputs");
  }
  KVEVICT_TRY(compact_paged_rows(fn, be, ws, layer, sequence, kept, out));
  if (ws.is_query()) return {};
  // compact_paged validated kept and the table and moved the keys and values: the positions alike
  const index_t ps = positions.page_size;
  detail::parallel_for(be, R, [&](index_t r) {
    const index_t n = kept.length(r), l = layer.list_of(r0 + r), h = layer.head_of(r0 + r);
    const pos_t* k = kept.pos + kept.cu[r];
    for (index_t j = 0; j < n; ++j)
      if (k[j] != j)
        *positions.row(layer.table.page_of(l, j, ps), j % ps, h) = *positions.row(layer.table.page_of(l, k[j], ps), k[j] % ps, h);
  });
  return {};
}
}  // namespace detail

/// The same on a paged layer (paged_types.hpp): keys and values by compact_paged (kept rows to the
/// front of each list, freed pages reported in `out`, the table not written: shrink_page_table),
/// and the rows' original positions, a pool of dim 1 with the keys' pages, page size and heads per
/// page, read through the same table, moved alike. `kept` lists the layer's rows r = s * kv_heads
/// + h (a driver's kept(l) for one sequence: r = h). Workspace: compact_paged's (two-phase).
/// Errors (nothing written): the positions pool invalid, of dim != 1, shaped unlike the keys or
/// overlapping the key / value pools, the table, kept or the outputs; then compact_paged's.
template <class Backend, class T>
status compact_layer(Backend be, workspace& ws, paged_layer<T> layer, page_pool<pos_t> positions, ragged_positions kept,
                     paged_compaction_out out) {
  return detail::compact_paged_layer(be, ws, layer, positions, -1, kept, out);
}

/// The same for sequence `sequence` of a paged batch alone (a driver's kept(l) for that sequence:
/// its kv_heads rows, r = h): its lists are compacted, out.lengths receives their lengths (kv_heads
/// lists with per-head tables, one with per-sequence tables) and out.freed_pages their pages; the
/// other sequences' rows are not touched. The whole table is validated (a page the sequence
/// shares with another is refused before any write). Errors: the same, and a sequence outside
/// [0, sequences).
template <class Backend, class T>
status compact_layer(Backend be, workspace& ws, paged_layer<T> layer, page_pool<pos_t> positions, index_t sequence,
                     ragged_positions kept, paged_compaction_out out) {
  if (sequence < 0)
    return status::error(errc::out_of_range, "compact_layer: sequence %lld is negative", static_cast<long long>(sequence));
  return detail::compact_paged_layer(be, ws, layer, positions, sequence, kept, out);
}

}  // namespace kvevict
