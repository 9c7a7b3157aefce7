// CUDA overload of <kvevict/batch.hpp>'s select_topk_batch with per-head or flattened budgets, over
// padded rows (rows r = s * H + h of a [S*H][T] score matrix with per-row lengths) or the varlen
// layout (scores [H][total], sequence s = columns [cu_seqlens[s], cu_seqlens[s+1])). Launches are
// asynchronous on the backend's stream and never synchronise the host.
//
//   select_topk_batch(cuda_t, ws, batch_padded(scores, S, H, row_lengths) or
//                     batch_varlen(scores, cu_seqlens, S), budgets, batch_budget::per_head or
//                     batch_budget::flattened, kept_cu, kept_pos, capacity [, bad])
//
// One block computes the offsets (per head: row r keeps min(budgets[s], its length); flattened:
// sequence s keeps min(budgets[s] * H, its tokens); detail/block/batch_block.hpp). Per head, one
// batched selection (select_rows_launch; varlen rows placed by detail::varlen_rows) selects every
// row; flattened, one block per sequence selects over its H rows at once and splits the count over
// its heads (batch_flat_sequence: the host's tie rule, lower head then lower position; no
// workspace). Every array is device memory. Device data is checked on the device, all or nothing:
// a negative budget, a length outside [0, T], bad cu_seqlens (cu_seqlens[0] != 0, decreasing, past
// cu_seqlens[S] or T) or more kept tokens than `capacity` leave every offset 0 (nothing is
// selected) and are counted into `*bad` (optional device int the caller zeroes).
#pragma once

#include <kvevict/batch.hpp>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/select.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/batch_block.hpp>
#include <kvevict/detail/block/select_ops.hpp>

#include <cstdint>

namespace kvevict {

namespace detail {
/// Two-phase workspace after a size probe: a query takes the probe's size (true: return).
inline bool take_probed_size(workspace& ws, const workspace& probe) {
  if (ws.is_query()) ws.bytes = probe.bytes;
  return ws.is_query();
}
inline status check_probed_size(const char* fn, const workspace& ws, const workspace& probe) {
  if (ws.bytes >= probe.bytes) return {};
  return status::error(errc::workspace_too_small, "%s: workspace has %zu bytes, %zu needed (query the size first)", fn,
                       ws.bytes, probe.bytes);
}

/// The host checks of a batch's arrays (after the shared ones): varlen shape, T within int32,
/// alignment, the kept lists overlapping the inputs or each other.
inline status check_batch_arrays(const char* fn, const batch_rows& rows, const std::int32_t* budgets,
                                 const std::int32_t* kept_cu, const pos_t* kept_pos, index_t kept_capacity) {
  const index_t S = rows.sequences, H = rows.kv_heads, R = S * H, T = rows.scores.extent(1);
  const bool varlen = rows.cu_seqlens != nullptr;
  if (varlen && rows.row_lengths != nullptr)
    return status::error(errc::invalid_argument, "%s: give row_lengths (padded) or cu_seqlens (varlen), not both", fn);
  if (varlen && rows.scores.extent(0) != H)
    return status::error(errc::shape_mismatch, "%s: varlen scores have %lld rows, expected the %lld KV heads", fn,
                         static_cast<long long>(rows.scores.extent(0)), static_cast<long long>(H));
  if (T > INT32_MAX)
    return status::error(errc::size_overflow, "%s: %lld score columns do not fit int32 positions", fn,
                         static_cast<long long>(T));
  KVEVICT_TRY(check_select_alignment(fn, rows.scores, rows.row_lengths, nullptr, kept_pos, "kept_pos", kept_cu, "kept_cu"));
  KVEVICT_TRY(check_device_alignment(fn, "cu_seqlens", rows.cu_seqlens));
  const byte_range in[] = {range_of(rows.scores), ints_range(rows.row_lengths, R), ints_range(rows.cu_seqlens, S + 1),
                           ints_range(budgets, S)};
  const byte_range cur = ints_range(kept_cu, R + 1), pr = positions_range(kept_pos, kept_capacity > 0 ? kept_capacity : 1);
  const char* const names[] = {"scores", "row_lengths", "cu_seqlens", "budgets"};
  for (int i = 0; i < 4; ++i)
    if (cur.intersects(in[i]) || pr.intersects(in[i]))
      return status::error(errc::overlap, "%s: the kept lists overlap %s in memory", fn, names[i]);
  if (cur.intersects(pr)) return status::error(errc::overlap, "%s: kept_cu and kept_pos overlap in memory", fn);
  return {};
}

/// The varlen batch's selection (after the shared checks): the host checks of its arrays, then the
/// workspace (two-phase), the offsets op and the selection ops.
inline status select_topk_batch_varlen(cuda_t be, const char* fn, workspace& ws, const batch_rows& rows,
                                       const std::int32_t* budgets, std::int32_t* kept_cu, pos_t* kept_pos,
                                       index_t kept_capacity, const cuda_select_options& opt, int* bad) {
  const index_t S = rows.sequences, H = rows.kv_heads, R = S * H, T = rows.scores.extent(1);
  KVEVICT_TRY(check_batch_arrays(fn, rows, budgets, kept_cu, kept_pos, kept_capacity));
  const byte_range in[] = {range_of(rows.scores), ints_range(rows.cu_seqlens, S + 1), ints_range(budgets, S)};
  const byte_range cur = ints_range(kept_cu, R + 1), pr = positions_range(kept_pos, kept_capacity > 0 ? kept_capacity : 1);
  const varlen_rows vr{rows.cu_seqlens, S, H, T, kept_cu, kept_pos, kept_capacity};
  const auto check_ws = [&](std::size_t used) -> status {
    const auto w0 = reinterpret_cast<std::uintptr_t>(ws.data);
    const byte_range wsr{w0, w0 + used};
    const byte_range all[] = {in[0], in[1], in[2], cur, pr};
    const char* const what[] = {"scores", "cu_seqlens", "budgets", "kept_cu", "kept_pos"};
    for (int i = 0; i < 5; ++i)
      if (wsr.intersects(all[i])) return status::error(errc::overlap, "%s: the workspace and %s overlap in memory", fn, what[i]);
    return {};
  };
  workspace probe;
  KVEVICT_TRY(select_topk_rows(be, fn, probe, rows.scores, vr, opt, check_ws));
  if (take_probed_size(ws, probe)) return {};
  KVEVICT_TRY(check_probed_size(fn, ws, probe));
  KVEVICT_TRY(check_ws(probe.bytes));
  cuda_launcher l{stream_of(be), fn};
  batch_offsets_launch(l, budgets, nullptr, rows.cu_seqlens, R, H, T, kept_capacity, kept_cu, bad);
  KVEVICT_TRY(l.err);
  return select_topk_rows(be, fn, ws, rows.scores, vr, opt, check_ws);
}

/// The flattened batch (after the shared checks): the host checks of its arrays, then the offsets
/// op and one block per sequence (detail::batch_flat_launch). No workspace.
inline status select_topk_batch_flat(cuda_t be, const char* fn, workspace& ws, const batch_rows& rows,
                                     const std::int32_t* budgets, std::int32_t* kept_cu, pos_t* kept_pos,
                                     index_t kept_capacity, int* bad) {
  const index_t S = rows.sequences, H = rows.kv_heads, T = rows.scores.extent(1);
  KVEVICT_TRY(check_batch_arrays(fn, rows, budgets, kept_cu, kept_pos, kept_capacity));
  if (ws.is_query()) {
    ws.bytes = 0;
    return {};
  }
  const batch_keys keys{rows.scores, rows.row_lengths, rows.cu_seqlens, S, H, T};
  cuda_launcher l{stream_of(be), fn};
  batch_flat_launch(l, keys, budgets, kept_pos != nullptr ? kept_capacity : 0, kept_cu, kept_pos, bad);
  return l.err;
}
}  // namespace detail

/// The batched selection on the GPU (see the file comment). Host-side errors: an unknown budget
/// kind, invalid scores, padded rows != S*H or varlen rows != H, row_lengths
/// and cu_seqlens both given, null budgets or kept_cu, a negative capacity, misaligned or
/// overlapping arrays, T > INT32_MAX, and (per head) select_topk's host-side errors, all before
/// anything is launched. Flattened budgets need no workspace (a query answers 0 bytes).
inline status select_topk_batch(cuda_t be, workspace& ws, batch_rows rows, const std::int32_t* budgets,
                                batch_budget kind, std::int32_t* kept_cu, pos_t* kept_pos, index_t kept_capacity,
                                int* bad = nullptr) {
  constexpr const char* fn = "select_topk_batch(cuda)";
  if (kind != batch_budget::per_head && kind != batch_budget::flattened)
    return status::error(errc::invalid_argument, "%s: unknown budget kind", fn);
  KVEVICT_TRY(detail::check_select_scores(fn, rows.scores));
  const index_t S = rows.sequences, H = rows.kv_heads, T = rows.scores.extent(1);
  const bool varlen = rows.cu_seqlens != nullptr;
  index_t R = 0;
  if (S < 0 || H < 0 || !detail::checked_mul(S, H, R) || (!varlen && rows.scores.extent(0) != R))
    return status::error(errc::shape_mismatch, "%s: padded scores have %lld rows, expected %lld sequences x %lld heads",
                         fn, static_cast<long long>(rows.scores.extent(0)), static_cast<long long>(S),
                         static_cast<long long>(H));
  if ((S > 0 && budgets == nullptr) || kept_cu == nullptr)
    return status::error(errc::null_pointer, "%s: budgets or kept_cu is null", fn);
  if (kept_capacity < 0) return status::error(errc::invalid_argument, "%s: kept_capacity is negative", fn);
  KVEVICT_TRY(detail::check_device_alignment(fn, "budgets", budgets));
  cuda_select_options opt;
  opt.pos_capacity = kept_capacity;
  opt.bad_rows = bad;
  if (kind == batch_budget::flattened)
    return detail::select_topk_batch_flat(be, fn, ws, rows, budgets, kept_cu, kept_pos, kept_capacity, bad);
  if (varlen) return detail::select_topk_batch_varlen(be, fn, ws, rows, budgets, kept_cu, kept_pos, kept_capacity, opt, bad);
  const ragged_positions_out kept{kept_pos, kept_cu, R};
  if (detail::ints_range(budgets, S).intersects(detail::ints_range(kept_cu, R + 1)))
    return status::error(errc::overlap, "%s: budgets and kept_cu overlap in memory", fn);
  // the selection's host checks (a size query) before the offsets kernel writes kept_cu
  workspace probe;
  KVEVICT_TRY(select_topk(be, probe, rows.scores, rows.row_lengths, kept, opt));
  if (detail::take_probed_size(ws, probe)) return {};
  KVEVICT_TRY(detail::check_probed_size(fn, ws, probe));
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::batch_offsets_launch(l, budgets, rows.row_lengths, nullptr, R, H, T, kept_capacity, kept_cu, bad);
  KVEVICT_TRY(l.err);
  return select_topk(be, ws, rows.scores, rows.row_lengths, kept, opt);
}

}  // namespace kvevict
