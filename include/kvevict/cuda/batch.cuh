// CUDA overload of <kvevict/batch.hpp>'s select_topk_batch, per-head budgets over padded rows
// (rows r = s * H + h of a [S*H][T] score matrix with per-row lengths). Launches are asynchronous
// on the backend's stream and never synchronise the host.
//
//   select_topk_batch(cuda_t, ws, batch_padded(scores, S, H, row_lengths), budgets,
//                     batch_budget::per_head, kept_cu, kept_pos, capacity [, bad])
//
// One block computes the offsets (row r keeps min(budgets[s], its length);
// detail/block/batch_block.hpp), then one batched select_topk(cuda) selects every row. Every array
// is device memory. Device data is checked on the device, all or nothing: a negative budget, a
// length outside [0, T] or more kept tokens than `capacity` leave every offset 0 (nothing is
// selected) and are counted into `*bad` (optional device int the caller zeroes). Not on cuda: the
// varlen layout (cu_seqlens) and flattened budgets (errc::unsupported).
#pragma once

#include <kvevict/batch.hpp>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/select.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/batch_block.hpp>
#include <kvevict/detail/block/select_ops.hpp>

#include <cstdint>

namespace kvevict {

/// The per-head batched selection on the GPU (see the file comment). Host-side errors: another
/// budget kind or the varlen layout (unsupported), invalid scores, padded rows != S*H, null
/// budgets or kept_cu, a negative capacity, misaligned or overlapping arrays, and select_topk's
/// host-side errors, all before anything is launched.
inline status select_topk_batch(cuda_t be, workspace& ws, batch_rows rows, const std::int32_t* budgets,
                                batch_budget kind, std::int32_t* kept_cu, pos_t* kept_pos, index_t kept_capacity,
                                int* bad = nullptr) {
  constexpr const char* fn = "select_topk_batch(cuda)";
  if (kind != batch_budget::per_head || rows.cu_seqlens != nullptr)
    return status::error(errc::unsupported, "%s: only per-head budgets over padded rows run on cuda", fn);
  KVEVICT_TRY(detail::check_select_scores(fn, rows.scores));
  const index_t S = rows.sequences, H = rows.kv_heads, T = rows.scores.extent(1);
  index_t R = 0;
  if (S < 0 || H < 0 || !detail::checked_mul(S, H, R) || rows.scores.extent(0) != R)
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
  const ragged_positions_out kept{kept_pos, kept_cu, R};
  if (detail::ints_range(budgets, S).intersects(detail::ints_range(kept_cu, R + 1)))
    return status::error(errc::overlap, "%s: budgets and kept_cu overlap in memory", fn);
  // the selection's host checks (a size query) before the offsets kernel writes kept_cu
  workspace probe;
  KVEVICT_TRY(select_topk(be, probe, rows.scores, rows.row_lengths, kept, opt));
  if (ws.is_query()) {
    ws.bytes = probe.bytes;
    return {};
  }
  if (ws.bytes < probe.bytes)
    return status::error(errc::workspace_too_small, "%s: workspace has %zu bytes, %zu needed (query the size first)",
                         fn, ws.bytes, probe.bytes);
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::batch_offsets_launch(l, budgets, rows.row_lengths, R, H, T, kept_capacity, kept_cu, bad);
  KVEVICT_TRY(l.err);
  return select_topk(be, ws, rows.scores, rows.row_lengths, kept, opt);
}

}  // namespace kvevict
