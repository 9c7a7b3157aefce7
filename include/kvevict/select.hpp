// kvevict/select.hpp: which tokens each KV head keeps (batched top-k, exact and deterministic).
//
//   select_topk(be, ws, scores, lengths, kept)        dense:  every row keeps kept.extent(1) tokens
//   select_topk(be, ws, scores, lengths, kept_ragged) ragged: row r keeps cu[r+1] - cu[r] tokens
//   select_topk_flat(be, ws, scores, lengths, total, floors, cu, pos)
//                                                     layer-wise (AdaKV / LAVa): the `total` best
//                                                     (row, position) entries of all rows jointly,
//                                                     each row first keeping its own top floors[r]
//
// `scores` is [R][T] (one row per KV head, higher = keep); row r's candidates are its first
// lengths[r] columns (all T when `lengths` is null). The order (docs/conventions.md):
//   - higher score first; equal scores -> lower position first; -0.0 == +0.0;
//   - +inf above every finite score, -inf below every finite score;
//   - NaN below everything (-inf included), NaNs among themselves by position;
//   - in select_topk_flat, equal scores in different rows -> lower row first, then lower position.
// Kept positions are written in ascending order per row. The result is unique given the scores,
// so seq, par (any thread count) and cuda return identical positions.
//
// Algorithm: radix select on the order-preserving 32-bit key of each score (11 + 11 + 10 bit
// digits, histogram per pass, candidates filtered into the workspace), then one ascending scan
// per row. See docs/select.md. Scratch comes from a `workspace` (two-phase: a call with
// ws.data == nullptr checks the views and shapes, stores the size in ws.bytes and returns); the
// size depends on R, T and the backend (for par, its thread count: query with the same par_t).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/host/select_host.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>

namespace kvevict {
namespace detail {

inline byte_range array_range(const void* p, index_t count, std::size_t elem) {
  if (p == nullptr || count <= 0) return {};
  const auto b = reinterpret_cast<std::uintptr_t>(p);
  return {b, b + static_cast<std::uintptr_t>(count) * elem};
}

inline status select_overlap(const char* fn, const char* a, const char* b) {
  return status::error(errc::overlap, "%s: %s and %s overlap in memory", fn, a, b);
}

/// Views and shapes of the scores (everything the workspace size depends on).
inline status check_select_scores(const char* fn, const matrix_view<const float>& scores) {
  KVEVICT_TRY(check_view(fn, "scores", scores));
  if (scores.extent(1) > INT32_MAX)
    return status::error(errc::invalid_argument, "%s: scores has %lld columns; positions are int32 (at most %d)", fn,
                         static_cast<long long>(scores.extent(1)), INT32_MAX);
  return {};
}

/// Row lengths in [0, T] (null: every row is T long).
inline status check_row_lengths(const char* fn, const std::int32_t* lengths, index_t rows, index_t columns) {
  if (lengths == nullptr) return {};
  for (index_t r = 0; r < rows; ++r)
    if (lengths[r] < 0 || lengths[r] > columns)
      return status::error(errc::out_of_range, "%s: row_lengths[%lld] = %d is outside [0, %lld] (the score columns)",
                           fn, static_cast<long long>(r), lengths[r], static_cast<long long>(columns));
  return {};
}

/// The workspace must not share memory with what the call reads or writes.
inline status check_ws_overlap(const char* fn, const workspace& ws, std::size_t used, const byte_range* others,
                               const char* const* names, int count) {
  const byte_range w = array_range(ws.data, static_cast<index_t>(used), 1);
  for (int i = 0; i < count; ++i)
    if (w.intersects(others[i])) return select_overlap(fn, "the workspace", names[i]);
  return {};
}

struct lengths_of {
  const std::int32_t* lengths;
  index_t columns;
  index_t operator()(index_t r) const noexcept { return lengths ? index_t(lengths[r]) : columns; }
};

// The checks below read only extents and pointers, never the data: every backend (CUDA included,
// whose data lives in device memory) runs them before anything else.

/// Dense form: the views, kept rows == score rows, kept overlapping scores or row_lengths.
inline status check_select_dense(const char* fn, const matrix_view<const float>& scores,
                                 const std::int32_t* row_lengths, const matrix_view<pos_t>& kept) {
  KVEVICT_TRY(check_select_scores(fn, scores));
  KVEVICT_TRY(check_view(fn, "kept", kept));
  const index_t R = scores.extent(0);
  if (kept.extent(0) != R)
    return status::error(errc::shape_mismatch, "%s: kept has %lld rows but scores has %lld", fn,
                         static_cast<long long>(kept.extent(0)), static_cast<long long>(R));
  const byte_range kept_range = range_of(kept);
  if (kept_range.intersects(range_of(scores))) return select_overlap(fn, "kept", "scores");
  if (kept_range.intersects(array_range(row_lengths, R, sizeof(std::int32_t))))
    return select_overlap(fn, "kept", "row_lengths");
  return {};
}
/// Dense form: the first `used` bytes of the workspace overlapping anything the call touches.
inline status check_select_dense_ws(const char* fn, const workspace& ws, std::size_t used,
                                    const matrix_view<const float>& scores, const std::int32_t* row_lengths,
                                    const matrix_view<pos_t>& kept) {
  const byte_range ranges[] = {range_of(scores), range_of(kept),
                               array_range(row_lengths, scores.extent(0), sizeof(std::int32_t))};
  const char* const names[] = {"scores", "kept", "row_lengths"};
  return check_ws_overlap(fn, ws, used, ranges, names, 3);
}

/// Ragged form: the scores and kept.heads == score rows.
inline status check_select_ragged_heads(const char* fn, const matrix_view<const float>& scores,
                                        const ragged_positions_out& kept) {
  KVEVICT_TRY(check_select_scores(fn, scores));
  if (kept.heads != scores.extent(0))
    return status::error(errc::shape_mismatch, "%s: kept has %lld heads but scores has %lld rows", fn,
                         static_cast<long long>(kept.heads), static_cast<long long>(scores.extent(0)));
  return {};
}
/// Ragged form, given `total` = the positions kept.pos holds (kept.cu[R] on the host; -1 when the
/// offsets are in device memory and unknown: then kept.pos's first element stands for its range).
inline status check_select_ragged_out(const char* fn, const matrix_view<const float>& scores,
                                      const std::int32_t* row_lengths, const ragged_positions_out& kept,
                                      index_t total) {
  const index_t R = scores.extent(0);
  if (kept.pos == nullptr && total > 0)
    return status::error(errc::null_pointer, "%s: kept.pos is null but kept.cu lists %lld positions", fn,
                         static_cast<long long>(total));
  const byte_range pos_range = array_range(kept.pos, total < 0 ? 1 : total, sizeof(pos_t));
  if (pos_range.intersects(range_of(scores))) return select_overlap(fn, "kept.pos", "scores");
  if (pos_range.intersects(array_range(kept.cu, R + 1, sizeof(std::int32_t))))
    return select_overlap(fn, "kept.pos", "kept.cu");
  if (pos_range.intersects(array_range(row_lengths, R, sizeof(std::int32_t))))
    return select_overlap(fn, "kept.pos", "row_lengths");
  return {};
}
inline status check_select_ragged_ws(const char* fn, const workspace& ws, std::size_t used,
                                     const matrix_view<const float>& scores, const std::int32_t* row_lengths,
                                     const ragged_positions_out& kept, index_t total) {
  const index_t R = scores.extent(0);
  const byte_range ranges[] = {range_of(scores), array_range(kept.pos, total < 0 ? 1 : total, sizeof(pos_t)),
                               array_range(kept.cu, R + 1, sizeof(std::int32_t)),
                               array_range(row_lengths, R, sizeof(std::int32_t))};
  const char* const names[] = {"scores", "kept.pos", "kept.cu", "row_lengths"};
  return check_ws_overlap(fn, ws, used, ranges, names, 4);
}

/// Flattened form: views, kept_cu null, total outside [0, INT32_MAX], outputs overlapping the
/// inputs or each other (kept_pos holds `total` positions).
inline status check_select_flat(const char* fn, const matrix_view<const float>& scores,
                                const std::int32_t* row_lengths, index_t total, const std::int32_t* floors,
                                const std::int32_t* kept_cu, const pos_t* kept_pos) {
  KVEVICT_TRY(check_select_scores(fn, scores));
  const index_t R = scores.extent(0);
  if (kept_cu == nullptr) return status::error(errc::null_pointer, "%s: kept_cu is null", fn);
  if (total < 0 || total > INT32_MAX)
    return status::error(errc::invalid_argument, "%s: total = %lld is outside [0, %d]", fn,
                         static_cast<long long>(total), INT32_MAX);
  const byte_range in[] = {range_of(scores), array_range(row_lengths, R, sizeof(std::int32_t)),
                           array_range(floors, R, sizeof(std::int32_t))};
  const char* const in_names[] = {"scores", "row_lengths", "floors"};
  const byte_range cu_range = array_range(kept_cu, R + 1, sizeof(std::int32_t));
  const byte_range pos_range = array_range(kept_pos, total, sizeof(pos_t));
  for (int i = 0; i < 3; ++i) {
    if (cu_range.intersects(in[i])) return select_overlap(fn, "kept_cu", in_names[i]);
    if (pos_range.intersects(in[i])) return select_overlap(fn, "kept_pos", in_names[i]);
  }
  if (pos_range.intersects(cu_range)) return select_overlap(fn, "kept_pos", "kept_cu");
  return {};
}
inline status check_select_flat_ws(const char* fn, const workspace& ws, std::size_t used,
                                   const matrix_view<const float>& scores, const std::int32_t* row_lengths,
                                   index_t total, const std::int32_t* floors, const std::int32_t* kept_cu,
                                   const pos_t* kept_pos) {
  const index_t R = scores.extent(0);
  const byte_range ranges[] = {range_of(scores), array_range(row_lengths, R, sizeof(std::int32_t)),
                               array_range(floors, R, sizeof(std::int32_t)),
                               array_range(kept_cu, R + 1, sizeof(std::int32_t)),
                               array_range(kept_pos, total, sizeof(pos_t))};
  const char* const names[] = {"scores", "row_lengths", "floors", "kept_cu", "kept_pos"};
  return check_ws_overlap(fn, ws, used, ranges, names, 5);
}


/// Flattened form: floors[r] in [0, length of row r]; sums = {sum of the lengths, sum of the floors}.
inline status check_flat_floors(const char* fn, const lengths_of& len, const std::int32_t* floors, index_t rows,
                                index_t* sums) {
  sums[0] = sums[1] = 0;
  for (index_t r = 0; r < rows; ++r) {
    sums[0] += len(r);
    if (floors == nullptr) continue;
    if (floors[r] < 0 || floors[r] > len(r))
      return status::error(errc::out_of_range, "%s: floors[%lld] = %d is outside [0, %lld] (the row's length)", fn,
                           static_cast<long long>(r), floors[r], static_cast<long long>(len(r)));
    sums[1] += floors[r];
  }
  return {};
}
/// Flattened form: sum(floors) <= total <= sum(lengths).
inline status check_flat_total(const char* fn, index_t total, index_t sum_len, index_t sum_floor) {
  if (total > sum_len)
    return status::error(errc::invalid_argument, "%s: total = %lld is larger than the %lld entries of the rows", fn,
                         static_cast<long long>(total), static_cast<long long>(sum_len));
  if (sum_floor > total)
    return status::error(errc::invalid_argument, "%s: the floors add up to %lld, more than total = %lld", fn,
                         static_cast<long long>(sum_floor), static_cast<long long>(total));
  return {};
}
struct floors_of {
  const std::int32_t* floors;
  index_t operator()(index_t r) const noexcept { return floors ? index_t(floors[r]) : index_t(0); }
};

}  // namespace detail

/// Workspace bytes select_topk (dense or ragged) needs on backend `be` for score rows of
/// `columns` columns: what its size query reports, without views (for composite stages and
/// engines that size one arena per shape). Never fails for columns >= 0.
template <class Backend>
std::size_t select_topk_workspace_bytes(Backend be, index_t columns) {
  workspace q;
  detail::workspace_carver carver(q);
  (void)detail::carve_select_ws(carver, columns < 0 ? 0 : columns, detail::thread_count(be));
  (void)carver.finish("select_topk_workspace_bytes");
  return q.bytes;
}

/// Dense top-k: row r of `kept` ([R][k], k = kept.extent(1)) receives, in ascending order, the
/// positions of the k best scores among row r's first row_lengths[r] columns (all T if
/// row_lengths is null). Every row keeps exactly k tokens; k == 0 and k == length are valid.
/// Workspace: sizes per docs/select.md (seq: 8 KiB + 4 B x T; par: that per thread, plus 8 KiB).
/// Errors: invalid views (scores, kept); T > INT32_MAX; kept rows != score rows (shape_mismatch);
/// kept overlapping scores, row_lengths or the workspace (overlap); row_lengths[r] outside [0, T]
/// (out_of_range); k > row_lengths[r] (invalid_argument: a budget larger than the row);
/// workspace smaller than its query (workspace_too_small). Nothing is written on error.
template <class Backend>
status select_topk(Backend be, workspace& ws, matrix_view<const float> scores, const std::int32_t* row_lengths,
                   matrix_view<pos_t> kept) {
  constexpr const char* fn = "select_topk";
  KVEVICT_TRY(detail::check_select_dense(fn, scores, row_lengths, kept));
  const index_t R = scores.extent(0), T = scores.extent(1), k = kept.extent(1);
  detail::workspace_carver carver(ws);
  const detail::select_ws sws = detail::carve_select_ws(carver, T, detail::thread_count(be));
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  KVEVICT_TRY(detail::check_select_dense_ws(fn, ws, carver.used(), scores, row_lengths, kept));
  KVEVICT_TRY(detail::check_row_lengths(fn, row_lengths, R, T));
  const detail::lengths_of len{row_lengths, T};
  for (index_t r = 0; r < R; ++r)
    if (k > len(r))
      return status::error(errc::invalid_argument, "%s: k = %lld is larger than row %lld's length %lld", fn,
                           static_cast<long long>(k), static_cast<long long>(r), static_cast<long long>(len(r)));
  detail::select_rows(be, scores, len, [k](index_t) { return k; },
                      [&](index_t r) { return detail::pos_row{kept.data_handle() + r * kept.stride(0), kept.stride(1)}; },
                      sws);
  return {};
}

/// Ragged top-k: row r keeps k_r = kept.cu[r+1] - kept.cu[r] tokens, written ascending to
/// kept.pos[kept.cu[r] ..]; kept.heads must equal the score rows. Same order, workspace and
/// errors as the dense form, plus: bad offsets (cu[0] != 0 or decreasing: invalid_argument),
/// null cu or null pos with positions to write (null_pointer), k_r > row_lengths[r]
/// (invalid_argument), kept.pos overlapping scores, kept.cu, row_lengths or the workspace.
template <class Backend>
status select_topk(Backend be, workspace& ws, matrix_view<const float> scores, const std::int32_t* row_lengths,
                   ragged_positions_out kept) {
  constexpr const char* fn = "select_topk";
  KVEVICT_TRY(detail::check_select_ragged_heads(fn, scores, kept));
  const index_t R = scores.extent(0), T = scores.extent(1);
  KVEVICT_TRY(detail::check_offsets(fn, "kept.cu", kept.cu, R));
  const index_t total = kept.cu[R];
  KVEVICT_TRY(detail::check_select_ragged_out(fn, scores, row_lengths, kept, total));
  detail::workspace_carver carver(ws);
  const detail::select_ws sws = detail::carve_select_ws(carver, T, detail::thread_count(be));
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  KVEVICT_TRY(detail::check_select_ragged_ws(fn, ws, carver.used(), scores, row_lengths, kept, total));
  KVEVICT_TRY(detail::check_row_lengths(fn, row_lengths, R, T));
  const detail::lengths_of len{row_lengths, T};
  for (index_t r = 0; r < R; ++r)
    if (kept.length(r) > len(r))
      return status::error(errc::invalid_argument, "%s: row %lld keeps %lld tokens but its length is %lld", fn,
                           static_cast<long long>(r), static_cast<long long>(kept.length(r)),
                           static_cast<long long>(len(r)));
  detail::select_rows(be, scores, len, [&](index_t r) { return kept.length(r); },
                      [&](index_t r) { return detail::pos_row{kept.pos + kept.cu[r], 1}; }, sws);
  return {};
}

/// Workspace bytes select_topk_flat needs on backend `be` for `rows` score rows of `columns`
/// columns: what its size query reports, without views. Never fails for rows, columns >= 0.
template <class Backend>
std::size_t select_topk_flat_workspace_bytes(Backend be, index_t rows, index_t columns) {
  workspace q;
  detail::workspace_carver carver(q);
  (void)detail::carve_flat_ws(carver, rows < 0 ? 0 : rows, columns < 0 ? 0 : columns, detail::thread_count(be));
  (void)carver.finish("select_topk_flat_workspace_bytes");
  return q.bytes;
}

/// Flattened (layer-wise) selection, as AdaKV and LAVa allocate head budgets: keeps `total`
/// entries of the layer. Row r first keeps its own best floors[r] tokens (its safeguard floor;
/// floors null = no floor); the remaining total - sum(floors) entries are the best (row, position)
/// entries of all rows jointly, excluding those already kept. Ties between equal scores go to the
/// lower row, then the lower position. Row r's kept set is therefore its own top-count_r.
///
/// Outputs: kept_cu[R + 1] = offsets of the per-row counts (kept_cu[0] = 0, count_r =
/// kept_cu[r+1] - kept_cu[r], kept_cu[R] = total); if kept_pos is not null, row r's kept
/// positions, ascending, at kept_pos[kept_cu[r] ..] (room for `total` positions). A budget
/// allocator that needs only the counts passes kept_pos = nullptr; {kept_pos, kept_cu, R} is a
/// ragged_positions list for compact().
/// Workspace: the dense form's plus 8240 B x R (docs/select.md).
/// Errors: the dense form's view, length and workspace errors; total < 0 or > sum of the row
/// lengths, or > INT32_MAX (invalid_argument); floors[r] outside [0, row_lengths[r]] (out_of_range);
/// sum(floors) > total (invalid_argument); kept_cu null (null_pointer); kept_cu or kept_pos
/// overlapping the inputs, each other or the workspace (overlap).
template <class Backend>
status select_topk_flat(Backend be, workspace& ws, matrix_view<const float> scores, const std::int32_t* row_lengths,
                        index_t total, const std::int32_t* floors, std::int32_t* kept_cu, pos_t* kept_pos) {
  constexpr const char* fn = "select_topk_flat";
  KVEVICT_TRY(detail::check_select_flat(fn, scores, row_lengths, total, floors, kept_cu, kept_pos));
  const index_t R = scores.extent(0), T = scores.extent(1);
  detail::workspace_carver carver(ws);
  const detail::flat_ws fws = detail::carve_flat_ws(carver, R, T, detail::thread_count(be));
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  KVEVICT_TRY(detail::check_select_flat_ws(fn, ws, carver.used(), scores, row_lengths, total, floors, kept_cu, kept_pos));
  KVEVICT_TRY(detail::check_row_lengths(fn, row_lengths, R, T));
  const detail::lengths_of len{row_lengths, T};
  index_t sums[2] = {};  // the rows' lengths and floors
  KVEVICT_TRY(detail::check_flat_floors(fn, len, floors, R, sums));
  KVEVICT_TRY(detail::check_flat_total(fn, total, sums[0], sums[1]));
  detail::flat_layer_local layer;
  (void)detail::select_flat(be, scores, len, detail::floors_of{floors}, total, kept_cu, kept_pos, fws, layer);
  return {};
}

}  // namespace kvevict
