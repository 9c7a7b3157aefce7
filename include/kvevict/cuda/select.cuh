// CUDA overloads of <kvevict/select.hpp>: batched radix top-k (dense and ragged outputs) and the
// flattened layer-wise selection, on the GPU, returning exactly the positions the host returns.
//
//   select_topk(kvevict::cuda_t{stream}, ws, scores, row_lengths, kept [, options])
//   select_topk_flat(kvevict::cuda_t{stream}, ws, scores, row_lengths, total, floors, kept_cu, kept_pos [, options])
//
// Every pointer and view holds device memory. Launches are asynchronous on the backend's stream;
// the host is never synchronised unless options.synchronize asks. Scratch comes from the
// workspace (two-phase query, as on the host; the size depends on R, T and options.algo only).
//
// What is checked where (docs/cuda.md, "Selection"):
//   on the host, before any launch: views, shapes, T <= INT32_MAX, dense k <= T, overlaps between
//   the outputs, the inputs and the workspace (a ragged kept.pos's extent is known only when
//   options.pos_capacity gives it), options, workspace size; errors as the host backends report;
//   on the device, per row: row_lengths[r] in [0, T], k_r <= row_lengths[r], ragged offsets
//   (cu[0] == 0, cu[r] <= cu[r+1] <= cu[R], cu[R] <= pos_capacity when given), flattened floors in
//   [0, row_lengths[r]] and sum(floors) <= total <= sum(row_lengths). A bad row is skipped (its
//   positions are not written) and counted: into *options.bad_rows when given, and, with
//   options.synchronize, into the returned status (errc::out_of_range). The flattened selection
//   is all or nothing: any bad row or inconsistent total leaves kept_cu all zeros.
#pragma once

#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/select_block.hpp>
#include <kvevict/detail/block/select_ops.hpp>
#include <kvevict/select.hpp>

namespace kvevict {

/// Which CUDA selection algorithm runs (select_algo::auto_ decides from R and T: several blocks per
/// row when rows are long (T >= 32768) and too few (R < 128) to fill the GPU one block per row).
enum class select_algo : int {
  auto_ = 0,
  one_block = 1,    ///< one thread block per row
  multi_block = 2,  ///< several thread blocks per row (global histograms, ordered chunked emit)
};

struct cuda_select_options {
  select_algo algo = select_algo::auto_;
  /// Device int or null: atomically increased by the number of rows skipped because their
  /// device-resident arguments were invalid (the caller zeroes it).
  int* bad_rows = nullptr;
  /// Wait for the stream before returning; a skipped row then makes the call fail (out_of_range).
  bool synchronize = false;
  /// Ragged outputs: how many positions kept.pos holds (-1: unknown). When given, the host checks
  /// the whole output range for overlaps and the kernels refuse rows if kept.cu[R] exceeds it.
  index_t pos_capacity = -1;
};

namespace detail {

// The kernels are the ops of detail/block/select_ops.hpp (one generic __global__ each,
// cuda/simt.cuh), launched by the launch sequences written there once for the GPU and the host
// executor: select_rows_launch, emit_given_launch, select_flat_launch.

inline status check_select_options(const char* fn, const cuda_select_options& o) {
  const int a = static_cast<int>(o.algo);
  if (a < 0 || a > 2) return status::error(errc::invalid_argument, "%s: options.algo = %d is not a select_algo", fn, a);
  if (o.pos_capacity < -1)
    return status::error(errc::invalid_argument, "%s: options.pos_capacity = %lld (use -1 for unknown)", fn,
                         static_cast<long long>(o.pos_capacity));
  return {};
}

inline status zero_workspace(cudaStream_t st, const char* fn, const select_dev_ws& w) {
  if (w.zero_bytes == 0) return {};
  return cuda_status(cudaMemsetAsync(w.zero_begin, 0, w.zero_bytes, st), fn);
}

/// options.synchronize: wait for the stream and report the rows the kernels skipped.
inline status finish_select(cudaStream_t st, const char* fn, const select_dev_ws& w, const cuda_select_options& o) {
  if (!o.synchronize) return {};
  int bad = 0;
  KVEVICT_TRY(cuda_status(cudaMemcpyAsync(&bad, w.counter, sizeof(int), cudaMemcpyDeviceToHost, st), fn));
  KVEVICT_TRY(cuda_status(cudaStreamSynchronize(st), fn));
  if (bad > 0)
    return status::error(errc::out_of_range,
                         "%s: %d rows had invalid device-resident arguments (row lengths, budgets, offsets or "
                         "floors) and were skipped",
                         fn, bad);
  return {};
}

/// errc::invalid_argument unless every device array the selection kernels read or write is aligned
/// for its type (a misaligned pointer faults on the GPU); null pointers pass.
inline status check_select_alignment(const char* fn, matrix_view<const float> scores, const std::int32_t* row_lengths,
                                     const std::int32_t* floors, const pos_t* positions, const char* positions_name,
                                     const std::int32_t* offsets, const char* offsets_name) {
  KVEVICT_TRY(check_device_alignment(fn, "scores", scores.data_handle()));
  KVEVICT_TRY(check_device_alignment(fn, "row_lengths", row_lengths));
  KVEVICT_TRY(check_device_alignment(fn, "floors", floors));
  KVEVICT_TRY(check_device_alignment(fn, positions_name, positions));
  return check_device_alignment(fn, offsets_name, offsets);
}

/// select_topk(cuda) after the host checks of its arguments: plan, workspace (check_ws(bytes used)
/// checks it against the other arguments), zeroing, select_rows_launch, finish.
template <class Rows, class CheckWs>
status select_topk_rows(cuda_t be, const char* fn, workspace& ws, const matrix_view<const float>& scores,
                        const Rows& rows, const cuda_select_options& o, const CheckWs& check_ws) {
  const index_t R = row_count(scores, rows), T = scores.extent(1);
  const select_plan plan = plan_select(R, T, static_cast<int>(o.algo));
  workspace_carver carver(ws);
  const select_dev_ws w = carve_select_dev_ws(carver, ws, R, plan, false);
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  KVEVICT_TRY(check_ws(carver.used()));
  const cudaStream_t st = stream_of(be);
  if (plan.multi || o.synchronize) KVEVICT_TRY(zero_workspace(st, fn, w));
  cuda_launcher l{st, fn};
  select_rows_launch(l, scores, rows, w, plan, false, true, simt_bad{o.bad_rows, o.synchronize ? w.counter : nullptr});
  KVEVICT_TRY(l.err);
  return finish_select(st, fn, w, o);
}
}  // namespace detail

/// Dense top-k on the GPU: row r of kept ([R][k]) receives, ascending, the positions of the k best
/// scores among its first row_lengths[r] columns (row_lengths: device array or null = T). Same
/// order, ties and result as the host backends. Host-side errors: those of the host form that
/// need no device data (views, shapes, overlaps, T > INT32_MAX, workspace), k > T
/// (invalid_argument), bad options. Device-side: rows with row_lengths[r] outside [0, T] or below
/// k are skipped (docs/cuda.md). Workspace: docs/cuda.md (one block per row: 64 B; multi-block:
/// ~24 KiB per row).
inline status select_topk(cuda_t be, workspace& ws, matrix_view<const float> scores, const std::int32_t* row_lengths,
                          matrix_view<pos_t> kept, const cuda_select_options& options = {}) {
  constexpr const char* fn = "select_topk(cuda)";
  KVEVICT_TRY(detail::check_select_dense(fn, scores, row_lengths, kept));
  KVEVICT_TRY(detail::check_select_options(fn, options));
  KVEVICT_TRY(detail::check_select_alignment(fn, scores, row_lengths, nullptr, kept.data_handle(), "kept", nullptr, ""));
  const index_t R = scores.extent(0), T = scores.extent(1), k = kept.extent(1);
  if (k > T && R > 0)
    return status::error(errc::invalid_argument, "%s: k = %lld is larger than the rows' %lld columns", fn,
                         static_cast<long long>(k), static_cast<long long>(T));
  const detail::dense_rows rows{row_lengths, T, k, kept.data_handle(), kept.stride(0), kept.stride(1)};
  return detail::select_topk_rows(be, fn, ws, scores, rows, options, [&](std::size_t used) {
    return detail::check_select_dense_ws(fn, ws, used, scores, row_lengths, kept);
  });
}

/// Ragged top-k on the GPU: row r keeps kept.cu[r+1] - kept.cu[r] tokens (offsets in device
/// memory), ascending at kept.pos[kept.cu[r] ..]. Host-side errors: views, kept.heads != rows,
/// null kept.cu, overlaps (of kept.pos's first element, or of its whole range when
/// options.pos_capacity is given), workspace, options. Device-side: rows with bad offsets or
/// lengths, or budgets above their length, are skipped (docs/cuda.md).
inline status select_topk(cuda_t be, workspace& ws, matrix_view<const float> scores, const std::int32_t* row_lengths,
                          ragged_positions_out kept, const cuda_select_options& options = {}) {
  constexpr const char* fn = "select_topk(cuda)";
  KVEVICT_TRY(detail::check_select_ragged_heads(fn, scores, kept));
  if (kept.cu == nullptr) return status::error(errc::null_pointer, "%s: kept.cu offsets are null", fn);
  KVEVICT_TRY(detail::check_select_options(fn, options));
  const index_t total = options.pos_capacity;
  KVEVICT_TRY(detail::check_select_ragged_out(fn, scores, row_lengths, kept, total));
  KVEVICT_TRY(detail::check_select_alignment(fn, scores, row_lengths, nullptr, kept.pos, "kept.pos", kept.cu, "kept.cu"));
  const detail::ragged_rows rows{row_lengths, scores.extent(1), kept.cu, kept.pos, scores.extent(0), total};
  return detail::select_topk_rows(be, fn, ws, scores, rows, options, [&](std::size_t used) {
    return detail::check_select_ragged_ws(fn, ws, used, scores, row_lengths, kept, total);
  });
}

/// Flattened (layer-wise) selection on the GPU, the semantics of the host select_topk_flat:
/// kept_cu[R + 1] (device) receives the per-row count offsets and, when kept_pos is not null, the
/// rows' ascending positions (room for `total`). row_lengths and floors are device arrays (or
/// null). Host-side errors: those of the host form that need no device data. Device-side: a
/// length or floor out of range, or total outside [sum(floors), sum(lengths)], makes the whole call
/// a no-op with kept_cu all zeros (counted as the bad rows, or 1 for an inconsistent total).
inline status select_topk_flat(cuda_t be, workspace& ws, matrix_view<const float> scores,
                               const std::int32_t* row_lengths, index_t total, const std::int32_t* floors,
                               std::int32_t* kept_cu, pos_t* kept_pos, const cuda_select_options& options = {}) {
  constexpr const char* fn = "select_topk_flat(cuda)";
  KVEVICT_TRY(detail::check_select_flat(fn, scores, row_lengths, total, floors, kept_cu, kept_pos));
  KVEVICT_TRY(detail::check_select_options(fn, options));
  KVEVICT_TRY(detail::check_select_alignment(fn, scores, row_lengths, floors, kept_pos, "kept_pos", kept_cu, "kept_cu"));
  const index_t R = scores.extent(0), T = scores.extent(1);
  const detail::select_plan plan = detail::plan_select(R, T, static_cast<int>(options.algo));
  detail::workspace_carver carver(ws);
  const detail::flat_dev_ws w = detail::carve_flat_dev_ws(carver, ws, R, T, plan);
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  KVEVICT_TRY(
      detail::check_select_flat_ws(fn, ws, carver.used(), scores, row_lengths, total, floors, kept_cu, kept_pos));
  const cudaStream_t st = detail::stream_of(be);
  KVEVICT_TRY(detail::zero_workspace(st, fn, w.sel));
  const detail::simt_bad bad{options.bad_rows, options.synchronize ? w.sel.counter : nullptr};
  detail::cuda_launcher l{st, fn};
  detail::select_flat_launch(l, scores, row_lengths, total, floors, kept_cu, kept_pos, w, plan, bad);
  KVEVICT_TRY(l.err);
  return detail::finish_select(st, fn, w.sel, options);
}

}  // namespace kvevict
