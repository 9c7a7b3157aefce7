// CUDA overload of <kvevict/paged.hpp>'s compact_paged. Same semantics as the host backends;
// launches are asynchronous on the backend's stream and never synchronise the host.
//
//   compact_paged(cuda_t, ws, layer, kept, out [, bad])   kept rows to the front of each list,
//                                                         freed page ids and lengths reported
//   paged_key_norm_scores(cuda_t, layer, out [, bad])     Knorm through the page lists
//   paged_weight_by_value_norm(cuda_t, scores, layer, mode [, bad])   VATP / LAVa value norms
//
// Every pointer holds device memory (pools, table, kept lists, outputs). Checked on the host before
// any launch: the pools' geometry, the layer's shape, kept's row count, null pointers, alignment
// and the workspace. The table, kept lists and lengths are device data: the kernels check them
// (detail/block/paged_block.hpp) and the call is all or nothing: if any page id is outside the
// pool or listed twice, any list's offsets or last_page_len are bad, any kept list is bad, heads of
// a per-sequence list keep different counts, or the freed pages exceed out.freed_capacity, nothing
// is written (pools, lengths, freed pages, count) and the problems are added to `*bad` (a device
// int the caller zeroes; optional). Workspace: 4 B per pool page + about 2 KiB per row.
#pragma once

#include <kvevict/cuda/compact.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/paged_block.hpp>
#include <kvevict/detail/block/paged_ops.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>

// The kernels are the ops of detail/block/paged_ops.hpp (and the in-place tiles of compact_ops.hpp),
// launched by their launch sequences on cuda_launcher; the host tests run the same sequences on the
// SIMT executor.

namespace kvevict {

/// Paged compaction on the GPU (see the file comment; the host form's semantics). Device pointers
/// throughout; `bad` (optional, device) receives the number of problems found in device data.
/// Host-side errors: the pools' geometry and shape (check_paged_shape), kept with another row
/// count, null pointers, misaligned device arrays, workspace too small or overlapping the first
/// element of the pools.
template <class T>
status compact_paged(cuda_t be, workspace& ws, paged_layer<T> layer, ragged_positions kept, paged_compaction_out out,
                     int* bad = nullptr) {
  static_assert(!std::is_const_v<T>, "compact_paged: the pools are written");
  constexpr const char* fn = "compact_paged(cuda)";
  KVEVICT_TRY(detail::check_paged_shape(fn, layer));
  const index_t R = layer.rows(), P = layer.keys.pages;
  const auto r = static_cast<std::size_t>(R);
  detail::workspace_carver c(ws);
  detail::paged_compact_state state{};
  state.marks = c.take<std::uint32_t>(static_cast<std::size_t>(P));
  state.problems = c.take<int>(1);
  state.head_rows = c.take<index_t>(r);
  state.sync = detail::take_inplace_sync(c, R);
  KVEVICT_TRY(c.finish(fn));
  if (ws.is_query()) return {};
  if (kept.heads != R)
    return status::error(errc::shape_mismatch, "%s: kept lists %lld rows, the layer has %lld (sequences x KV heads)", fn,
                         static_cast<long long>(kept.heads), static_cast<long long>(R));
  if (kept.cu == nullptr) return status::error(errc::null_pointer, "%s: kept.cu offsets are null", fn);
  if (layer.table.indptr == nullptr || (layer.table.lists > 0 && layer.table.last_page_len == nullptr))
    return status::error(errc::null_pointer, "%s: table.indptr or table.last_page_len is null", fn);
  if ((layer.table.lists > 0 && out.lengths == nullptr) || out.freed_count == nullptr ||
      (out.freed_capacity > 0 && out.freed_pages == nullptr))
    return status::error(errc::null_pointer, "%s: out.lengths, out.freed_pages or out.freed_count is null", fn);
  if (out.freed_capacity < 0) return status::error(errc::invalid_argument, "%s: out.freed_capacity is negative", fn);
  KVEVICT_TRY(detail::check_kept_alignment(fn, kept));
  const char* names[] = {"table.indptr", "table.indices", "table.last_page_len", "out.lengths", "out.freed_pages",
                         "out.freed_count"};
  const std::int32_t* arrays[] = {layer.table.indptr, layer.table.indices, layer.table.last_page_len,
                                  out.lengths,        out.freed_pages,     out.freed_count};
  for (int i = 0; i < 6; ++i) KVEVICT_TRY(detail::check_device_alignment(fn, names[i], arrays[i]));
  KVEVICT_TRY(detail::check_device_alignment(fn, "keys.data", layer.keys.data));
  KVEVICT_TRY(detail::check_device_alignment(fn, "values.data", layer.values.data));
  const detail::byte_range first[] = {detail::first_row(layer.keys.data, layer.keys.dim),
                                      detail::first_row(layer.values.data, layer.values.dim)};
  KVEVICT_TRY(c.check_disjoint(fn, first, {"the key pool", "the value pool"}));
  if (R == 0 && layer.table.lists == 0) return {};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::paged_compact_launch(l, layer, kept, out, state, bad);
  return l.err;
}

/// Knorm over a paged layer on the GPU: out[r][j] = -||key of row r, token j||_2 (the same
/// function as the host), out [rows][C] device memory; columns past a row's length untouched.
/// Host-side errors: the layer's shape, out not a valid [rows][*] view or overlapping the first
/// key row, misaligned tables. Device-side: rows whose table entries are bad or hold more than C
/// tokens are skipped and counted into *bad.
template <class T>
status paged_key_norm_scores(cuda_t be, paged_layer<T> layer, matrix_view<float> out, int* bad = nullptr) {
  static_assert(is_kv_element_v<std::remove_const_t<T>>, "paged_key_norm_scores: float, float16 or bfloat16");
  constexpr const char* fn = "paged_key_norm_scores(cuda)";
  KVEVICT_TRY(detail::check_paged_shape(fn, layer));
  KVEVICT_TRY(detail::check_view(fn, "out", out));
  if (out.extent(0) != layer.rows())
    return status::error(errc::shape_mismatch, "%s: out has %lld rows, the layer %lld", fn,
                         static_cast<long long>(out.extent(0)), static_cast<long long>(layer.rows()));
  if (layer.table.indptr == nullptr || (layer.table.lists > 0 && layer.table.last_page_len == nullptr))
    return status::error(errc::null_pointer, "%s: table.indptr or table.last_page_len is null", fn);
  KVEVICT_TRY(detail::check_device_alignment(fn, "table.indptr", layer.table.indptr));
  KVEVICT_TRY(detail::check_device_alignment(fn, "table.indices", layer.table.indices));
  KVEVICT_TRY(detail::check_device_alignment(fn, "table.last_page_len", layer.table.last_page_len));
  if (detail::range_of(out).intersects(detail::first_row(layer.keys.data, layer.keys.dim)))
    return status::error(errc::overlap, "%s: out overlaps the key pool", fn);
  if (layer.rows() == 0) return {};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::paged_key_norm_launch(l, layer, out, bad);
  return l.err;
}

/// VATP (per_token) / LAVa (head_max) value weighting over a paged layer on the GPU, in place on
/// scores [rows x group][C] (device memory), the host form's semantics. Host-side errors: the
/// layer's shape, scores' rows not a multiple of the layer's rows, an unknown mode, misaligned
/// tables, scores overlapping the first value row. Device-side: rows whose table entries are bad
/// (or longer than C) are left as they are and counted into *bad.
template <class T>
status paged_weight_by_value_norm(cuda_t be, matrix_view<float> scores, paged_layer<T> layer, value_weight mode,
                                  int* bad = nullptr) {
  static_assert(is_kv_element_v<std::remove_const_t<T>>, "paged_weight_by_value_norm: float, float16 or bfloat16");
  constexpr const char* fn = "paged_weight_by_value_norm(cuda)";
  KVEVICT_TRY(detail::check_paged_shape(fn, layer));
  KVEVICT_TRY(detail::check_weight_mode(fn, mode));
  KVEVICT_TRY(detail::check_view(fn, "scores", scores));
  const index_t R = layer.rows();
  if (R == 0) return {};
  if (scores.extent(0) == 0 || scores.extent(0) % R != 0)
    return status::error(errc::shape_mismatch, "%s: scores have %lld rows, not a multiple of the layer's %lld rows", fn,
                         static_cast<long long>(scores.extent(0)), static_cast<long long>(R));
  KVEVICT_TRY(detail::check_device_alignment(fn, "table.indptr", layer.table.indptr));
  KVEVICT_TRY(detail::check_device_alignment(fn, "table.indices", layer.table.indices));
  KVEVICT_TRY(detail::check_device_alignment(fn, "table.last_page_len", layer.table.last_page_len));
  if (detail::range_of(scores).intersects(detail::first_row(layer.values.data, layer.values.dim)))
    return status::error(errc::overlap, "%s: scores overlap the value pool", fn);
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::paged_weight_launch(l, scores, layer, mode == value_weight::head_max, bad);
  return l.err;
}

}  // namespace kvevict
