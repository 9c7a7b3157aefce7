// kvevict/batch.hpp: one selection for a whole batch of sequences of different lengths
// (docs/paged.md, "Batches").
//
//   batch_padded(scores [S*H][T], S, H, row_lengths)   rows r = s*H + h of a padded matrix (the
//                                                      layout of paged_key_norm_scores' output
//                                                      and of kvpress's [B, H, T] tensors)
//   batch_varlen(scores [H][total], cu_seqlens, S)     flash-attention's varlen layout: sequence s
//                                                      is columns [cu_seqlens[s], cu_seqlens[s+1])
//   select_topk_batch(be, ws, rows, budgets, kind, kept_cu, kept_pos, capacity)
//
// Rows are (sequence, KV head) pairs r = s * H + h, the rows of a paged layer (paged_types.hpp),
// so the answer feeds compact_paged directly. Budgets are per sequence (tokens per KV head):
//   per_head    every head of sequence s keeps min(budgets[s], its length): one batched
//               select_topk over all S*H rows (each row its own length and k)
//   flattened   sequence s keeps min(budgets[s] * H, its tokens over all heads), shared across its
//               heads as select_topk_flat shares a layer's budget (AdaKV without floors, LAVa)
// Same tie rule and order as select_topk: equal scores -> lower position (flattened: lower head,
// then lower position); kept positions ascending per row. A batch gives exactly what each
// sequence gives alone (tested). No allocation; host backends seq and par.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/host/select_host.hpp>
#include <kvevict/select.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>

namespace kvevict {

/// The score rows of a batch: padded (row_lengths, cu_seqlens null) or varlen (cu_seqlens).
struct batch_rows {
  matrix_view<const float> scores;
  const std::int32_t* row_lengths = nullptr;  ///< padded: [S*H] tokens per row (null: every row T)
  const std::int32_t* cu_seqlens = nullptr;   ///< varlen: [S+1] column offsets of the sequences
  index_t sequences = 0;
  index_t kv_heads = 0;
};

inline batch_rows batch_padded(matrix_view<const float> scores, index_t sequences, index_t kv_heads,
                               const std::int32_t* row_lengths) {
  return {scores, row_lengths, nullptr, sequences, kv_heads};
}
inline batch_rows batch_varlen(matrix_view<const float> scores, const std::int32_t* cu_seqlens, index_t sequences) {
  return {scores, nullptr, cu_seqlens, sequences, scores.extent(0)};
}

enum class batch_budget { per_head, flattened };

namespace detail {

/// Row r of a validated batch: its scores and its length.
struct batch_row_access {
  batch_rows b;
  KVEVICT_HOST_DEVICE score_row row(index_t r) const {
    const matrix_view<const float>& s = b.scores;
    if (b.cu_seqlens == nullptr) return {s.data_handle() + r * s.stride(0), s.stride(1)};
    const index_t seq = r / b.kv_heads, h = r % b.kv_heads;
    return {s.data_handle() + h * s.stride(0) + b.cu_seqlens[seq] * s.stride(1), s.stride(1)};
  }
  KVEVICT_HOST_DEVICE index_t length(index_t r) const {
    if (b.cu_seqlens != nullptr) return b.cu_seqlens[r / b.kv_heads + 1] - b.cu_seqlens[r / b.kv_heads];
    return b.row_lengths != nullptr ? index_t(b.row_lengths[r]) : b.scores.extent(1);
  }
};

/// The batch's shape, offsets and lengths (host memory).
inline status check_batch_rows(const char* fn, const batch_rows& b) {
  KVEVICT_TRY(check_select_scores(fn, b.scores));
  if (b.sequences < 0 || b.kv_heads < 0)
    return status::error(errc::invalid_argument, "%s: %lld sequences x %lld KV heads (must be >= 0)", fn,
                         static_cast<long long>(b.sequences), static_cast<long long>(b.kv_heads));
  const index_t T = b.scores.extent(1);
  if (b.cu_seqlens != nullptr) {
    if (b.row_lengths != nullptr)
      return status::error(errc::invalid_argument, "%s: give row_lengths (padded) or cu_seqlens (varlen), not both", fn);
    if (b.scores.extent(0) != b.kv_heads)
      return status::error(errc::shape_mismatch, "%s: varlen scores have %lld rows, expected the %lld KV heads", fn,
                           static_cast<long long>(b.scores.extent(0)), static_cast<long long>(b.kv_heads));
    KVEVICT_TRY(detail::check_list_offsets(fn, "cu_seqlens", b.cu_seqlens, b.sequences, "sequence"));
    if (b.cu_seqlens[b.sequences] > T)
      return status::error(errc::out_of_range, "%s: cu_seqlens ends at %d, past the %lld score columns", fn,
                           b.cu_seqlens[b.sequences], static_cast<long long>(T));
    return {};
  }
  index_t rows = 0;
  if (!checked_mul(b.sequences, b.kv_heads, rows) || b.scores.extent(0) != rows)
    return status::error(errc::shape_mismatch, "%s: padded scores have %lld rows, expected %lld sequences x %lld heads",
                         fn, static_cast<long long>(b.scores.extent(0)), static_cast<long long>(b.sequences),
                         static_cast<long long>(b.kv_heads));
  return check_row_lengths(fn, b.row_lengths, rows, T);
}

inline byte_range batch_inputs_range(const batch_rows& b, int i) {
  const index_t S = b.sequences, R = b.sequences * b.kv_heads;
  switch (i) {
    case 0: return range_of(b.scores);
    case 1: return ints_range(b.row_lengths, R);
    default: return ints_range(b.cu_seqlens, S + 1);
  }
}

}  // namespace detail

/// Workspace bytes of select_topk_batch on backend `be` for scores of `columns` columns and
/// `kv_heads` rows per sequence (the size queries' answer, without views).
template <class Backend>
std::size_t select_topk_batch_workspace_bytes(Backend be, index_t kv_heads, index_t columns, batch_budget kind) {
  workspace q;
  detail::workspace_carver c(q);
  const index_t H = kv_heads < 0 ? 0 : kv_heads, T = columns < 0 ? 0 : columns;
  if (kind == batch_budget::flattened) {
    (void)detail::carve_flat_ws(c, H, T, detail::thread_count(be));
    (void)c.take<std::int32_t>(static_cast<std::size_t>(H + 1));
  } else {
    (void)detail::carve_select_ws(c, T, detail::thread_count(be));
  }
  (void)c.finish("select_topk_batch_workspace_bytes");
  return q.bytes;
}

/// Selects the kept tokens of every (sequence, KV head) row of a batch in one call (see the file
/// comment for the budget kinds). Writes kept_cu[S*H + 1] (row r keeps kept_cu[r+1] - kept_cu[r]
/// tokens) and each row's positions, ascending, at kept_pos[kept_cu[r] ..]; {kept_pos, kept_cu,
/// S*H} is a ragged_positions for compact_paged. kept_capacity: room in kept_pos (at most
/// sum_s min(budgets[s] * H, tokens of s) are written).
/// Errors (nothing written): invalid scores; padded rows != S*H or row_lengths outside [0, T];
/// varlen rows != H, cu_seqlens not starting at 0, not monotone or past T; budgets null or
/// negative; kept_cu null, kept_pos null with positions to write; more kept positions than
/// kept_capacity (capacity_exceeded); outputs overlapping the inputs, each other or the
/// workspace; workspace too small.
template <class Backend>
status select_topk_batch(Backend be, workspace& ws, batch_rows rows, const std::int32_t* budgets, batch_budget kind,
                         std::int32_t* kept_cu, pos_t* kept_pos, index_t kept_capacity) {
  constexpr const char* fn = "select_topk_batch";
  KVEVICT_TRY(detail::check_batch_rows(fn, rows));
  const index_t S = rows.sequences, H = rows.kv_heads, R = S * H, T = rows.scores.extent(1);
  detail::workspace_carver carver(ws);
  detail::flat_ws fws{};
  detail::select_ws sws{};
  std::int32_t* local_cu = nullptr;
  if (kind == batch_budget::flattened) {
    fws = detail::carve_flat_ws(carver, H, T, detail::thread_count(be));
    local_cu = carver.take<std::int32_t>(static_cast<std::size_t>(H + 1));
  } else {
    sws = detail::carve_select_ws(carver, T, detail::thread_count(be));
  }
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  if (kind != batch_budget::per_head && kind != batch_budget::flattened)
    return status::error(errc::invalid_argument, "%s: unknown budget kind", fn);
  if (S > 0 && budgets == nullptr) return status::error(errc::null_pointer, "%s: budgets is null", fn);
  if (kept_cu == nullptr) return status::error(errc::null_pointer, "%s: kept_cu is null", fn);
  if (kept_capacity < 0) return status::error(errc::invalid_argument, "%s: kept_capacity is negative", fn);
  const detail::batch_row_access acc{rows};
  index_t total = 0;
  for (index_t s = 0; s < S; ++s) {
    if (budgets[s] < 0)
      return status::error(errc::invalid_argument, "%s: budgets[%lld] = %d is negative", fn, static_cast<long long>(s),
                           budgets[s]);
    index_t seq_tokens = 0;
    for (index_t h = 0; h < H; ++h) {
      const index_t n = acc.length(s * H + h);
      seq_tokens += n;
      if (kind == batch_budget::per_head) total += budgets[s] < n ? budgets[s] : n;
    }
    if (kind == batch_budget::flattened) total += budgets[s] * H < seq_tokens ? budgets[s] * H : seq_tokens;
  }
  if (total > kept_capacity)
    return status::error(errc::capacity_exceeded, "%s: the batch keeps %lld tokens but kept_pos has room for %lld", fn,
                         static_cast<long long>(total), static_cast<long long>(kept_capacity));
  if (total > INT32_MAX)
    return status::error(errc::size_overflow, "%s: %lld kept tokens do not fit int32 offsets", fn,
                         static_cast<long long>(total));
  if (total > 0 && kept_pos == nullptr) return status::error(errc::null_pointer, "%s: kept_pos is null", fn);
  {
    const detail::byte_range cur = detail::ints_range(kept_cu, R + 1), pr = detail::positions_range(kept_pos, total);
    const detail::byte_range in[] = {detail::batch_inputs_range(rows, 0), detail::batch_inputs_range(rows, 1),
                                     detail::batch_inputs_range(rows, 2), detail::ints_range(budgets, S)};
    const char* const names[] = {"scores", "row_lengths", "cu_seqlens", "budgets"};
    for (int i = 0; i < 4; ++i)
      if (cur.intersects(in[i]) || pr.intersects(in[i]))
        return status::error(errc::overlap, "%s: the kept lists overlap %s in memory", fn, names[i]);
    if (cur.intersects(pr)) return status::error(errc::overlap, "%s: kept_cu and kept_pos overlap in memory", fn);
    const detail::byte_range all[] = {in[0], in[1], in[2], in[3], cur, pr};
    KVEVICT_TRY(carver.check_disjoint(fn, all, {"scores", "row_lengths", "cu_seqlens", "budgets", "kept_cu",
                                                "kept_pos"}));
  }
  if (kind == batch_budget::per_head) {
    kept_cu[0] = 0;
    for (index_t r = 0; r < R; ++r) {
      const index_t b = budgets[r / H], n = acc.length(r);
      kept_cu[r + 1] = static_cast<std::int32_t>(kept_cu[r] + (b < n ? b : n));
    }
    detail::select_rows_of(
        be, R, T, [&](index_t r) { return acc.row(r); }, [&](index_t r) { return acc.length(r); },
        [&](index_t r) { return index_t(kept_cu[r + 1] - kept_cu[r]); },
        [&](index_t r) { return detail::pos_row{kept_pos + kept_cu[r], 1}; }, sws);
    return {};
  }
  // flattened: one flat selection per sequence over its H rows (uniformly strided in both layouts)
  kept_cu[0] = 0;
  for (index_t s = 0; s < S; ++s) {
    const detail::score_row first = acc.row(s * H);
    const index_t cols = rows.cu_seqlens != nullptr ? acc.length(s * H) : T, rs = rows.scores.stride(0);
    using exts = cuda::std::dextents<index_t, 2>;
    const matrix_view<const float> sub(first.data, cuda::std::layout_stride::mapping<exts>(
                                                       exts(H, cols), cuda::std::array<index_t, 2>{rs, first.stride}));
    index_t tokens = 0;
    for (index_t h = 0; h < H; ++h) tokens += acc.length(s * H + h);
    const index_t keep = budgets[s] * H < tokens ? budgets[s] * H : tokens;
    const std::int32_t base = kept_cu[s * H];
    detail::flat_layer_local layer;  // one process holds every head of the sequence
    (void)detail::select_flat(
        be, sub, [&](index_t h) { return acc.length(s * H + h); }, [](index_t) { return index_t(0); }, keep, local_cu,
        kept_pos + base, fws, layer);
    for (index_t h = 0; h < H; ++h) kept_cu[s * H + h + 1] = base + local_cu[h + 1];
  }
  return {};
}

}  // namespace kvevict
