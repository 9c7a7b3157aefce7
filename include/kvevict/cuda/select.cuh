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

#include <kvevict/cuda/block.cuh>
#include <kvevict/detail/block/select_block.hpp>
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

using select_block_t = cuda_block<select_block_threads>;

__device__ inline score_keys row_keys(const matrix_view<const float>& scores, index_t r) {
  return {scores.data_handle() + r * scores.stride(0), scores.stride(1)};
}

// The kernels: grid-stride loops over work items, tickets, fences and barriers around the
// host-device item functions of detail/block/select_block.hpp. Every block has select_block_threads
// (256) threads; shared memory per block: select_smem (42008 B) + the block scan's temporary
// storage (2336 B), 44344 B in all: under the 48 KiB static limit of sm_80 and sm_90.

/// Block r (grid-stride) selects row r: passes in shared memory, ordered emit. With `states`, the
/// final state of each row is stored (the flattened selection's floors).
template <class Rows>
__global__ void __launch_bounds__(select_block_threads, 3)
    select_one_block_kernel(matrix_view<const float> scores, Rows rows, bool full_key, bool emit, row_state* states,
                            bad_counter bad) {
  __shared__ typename select_block_t::temp_storage tmp;
  __shared__ select_smem sm;
  select_block_t blk{tmp};
  const index_t R = scores.extent(0);
  for (index_t r = blockIdx.x; r < R; r += gridDim.x) {
    const row_state s = one_block_row(blk, row_keys(scores, r), rows, r, full_key, emit, states, sm);
    if (s.mode == row_bad && threadIdx.x == 0) bad.add(1);
    __syncthreads();  // shared memory is reused by the next row
  }
}

/// Pass `pass` over every (row, chunk) item: chunk histograms into the row's global histogram;
/// the block that takes a row's last ticket chooses the bucket and stores the row's state.
template <class Rows>
__global__ void __launch_bounds__(select_block_threads, 3)
    select_multi_pass_kernel(matrix_view<const float> scores, Rows rows, select_dev_ws w, select_plan plan, int pass,
                             bool full_key, bad_counter bad) {
  __shared__ typename select_block_t::temp_storage tmp;
  __shared__ select_smem sm;
  select_block_t blk{tmp};
  const index_t R = scores.extent(0), C = plan.chunks;
  for (index_t item = blockIdx.x; item < R * C; item += gridDim.x) {
    const index_t r = item / C, c = item % C;
    bool bad_row = false;
    const bool worked = multi_pass_chunk(blk, row_keys(scores, r), rows, w, plan, R, r, c, pass, sm, bad_row);
    if (bad_row && threadIdx.x == 0) bad.add(1);
    if (worked) {
      __threadfence();  // this block's histogram atomics before its ticket
      __syncthreads();
      if (threadIdx.x == 0) sm.flag = take_ticket(&w.tickets[index_t(pass) * R + r]) == unsigned(C - 1) ? 1 : 0;
      __syncthreads();
      if (sm.flag != 0) {
        __threadfence();
        const std::uint32_t* h = w.hist + (index_t(pass) * R + r) * radix_bins;
        multi_pass_finish(blk, [h](int b) { return __ldcg(h + b); }, rows, w, r, pass, full_key, sm);
      }
    }
    __syncthreads();
  }
}

/// Packed (above, tied) counts of every chunk of the rows still selecting.
template <class Rows>
__global__ void __launch_bounds__(select_block_threads, 3)
    select_multi_count_kernel(matrix_view<const float> scores, Rows rows, select_dev_ws w, select_plan plan) {
  __shared__ typename select_block_t::temp_storage tmp;
  select_block_t blk{tmp};
  const index_t R = scores.extent(0), C = plan.chunks;
  for (index_t item = blockIdx.x; item < R * C; item += gridDim.x)
    multi_count_chunk(blk, row_keys(scores, item / C), rows, w, plan, item / C, item % C);
}

/// The ordered emit of every chunk, from the counts of the chunks before it.
template <class Rows>
__global__ void __launch_bounds__(select_block_threads, 3)
    select_multi_emit_kernel(matrix_view<const float> scores, Rows rows, select_dev_ws w, select_plan plan) {
  __shared__ typename select_block_t::temp_storage tmp;
  __shared__ select_smem sm;
  select_block_t blk{tmp};
  const index_t R = scores.extent(0), C = plan.chunks;
  for (index_t item = blockIdx.x; item < R * C; item += gridDim.x) {
    multi_emit_chunk(blk, row_keys(scores, item / C), rows, w, plan, item / C, item % C, sm);
    __syncthreads();
  }
}

// ---- the flattened selection ----------------------------------------------------------------------

/// Row r's state from its length, floor and floor threshold (one thread per row); bad rows and
/// the layer sums by atomics.
__global__ void flat_rows_kernel(const std::int32_t* lengths, index_t T, const std::int32_t* floors, index_t R,
                                 flat_dev_ws w) {
  for (index_t r = index_t(blockIdx.x) * blockDim.x + threadIdx.x; r < R; r += index_t(gridDim.x) * blockDim.x) {
    const flat_dev_row f = flat_row_at(lengths, T, floors, w.sel.states, r);
    w.rows[r] = f;
    if (f.bad != 0) {
      atomicAdd(&w.layer->bad_rows, 1);
    } else {
      atomicAdd(&w.layer->sum_len, static_cast<ucount>(f.n));
      atomicAdd(&w.layer->sum_floor, static_cast<ucount>(f.floor));
    }
  }
}

/// Layer pass `pass` over every (row, chunk) item; the block with the pass's last ticket chooses
/// the bucket.
__global__ void __launch_bounds__(select_block_threads, 3)
    flat_layer_pass_kernel(matrix_view<const float> scores, flat_dev_ws w, index_t total, int pass) {
  __shared__ typename select_block_t::temp_storage tmp;
  __shared__ select_smem sm;
  select_block_t blk{tmp};
  radix_threshold g;
  if (!flat_pass_threshold(*w.layer, total, pass, g)) return;
  const index_t R = scores.extent(0), C = w.layer_plan.chunks;
  for (index_t item = blockIdx.x; item < R * C; item += gridDim.x) {
    flat_layer_chunk(blk, row_keys(scores, item / C), w, R, item / C, item % C, g, pass, sm);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      cuda::atomic_ref<unsigned long long, cuda::thread_scope_device> ticket(w.tickets[pass]);
      sm.flag =
          ticket.fetch_add(1ull, cuda::memory_order_acq_rel) == static_cast<unsigned long long>(R * C - 1) ? 1 : 0;
    }
    __syncthreads();
    if (sm.flag != 0) {
      __threadfence();
      const ucount* h = w.layer_hist + index_t(pass) * radix_bins;
      flat_finish_pass(blk, [h](int b) { return __ldcg(h + b); }, w.rows, R, pass, g, *w.layer, sm);
    }
    __syncthreads();
  }
}

/// Block r (grid-stride): row r's remaining keys above and equal to the layer threshold.
__global__ void __launch_bounds__(select_block_threads, 3) flat_row_totals_kernel(flat_dev_ws w, index_t R, index_t total) {
  __shared__ typename select_block_t::temp_storage tmp;
  select_block_t blk{tmp};
  radix_threshold g;
  if (!flat_pass_threshold(*w.layer, total, 0, g)) return;
  for (index_t r = blockIdx.x; r < R; r += gridDim.x) {
    flat_row_totals_of(blk, w, R, r);
    __syncthreads();
  }
}

/// One block: every row's count, the offsets kept_cu, the layer's error report.
__global__ void __launch_bounds__(select_block_threads, 3)
    flat_counts_kernel(flat_dev_ws w, index_t R, index_t total, std::int32_t* cu, bad_counter bad) {
  __shared__ typename select_block_t::temp_storage tmp;
  select_block_t blk{tmp};
  const int n = flat_counts_of(blk, w, R, total, cu);
  if (threadIdx.x == 0) bad.add(n);
}

// ---- launch sequences -------------------------------------------------------------------------------

inline status check_select_options(const char* fn, const cuda_select_options& o) {
  const int a = static_cast<int>(o.algo);
  if (a < 0 || a > 2) return status::error(errc::invalid_argument, "%s: options.algo = %d is not a select_algo", fn, a);
  if (o.pos_capacity < -1)
    return status::error(errc::invalid_argument, "%s: options.pos_capacity = %lld (use -1 for unknown)", fn,
                         static_cast<long long>(o.pos_capacity));
  return {};
}

/// Threshold search (and, with `emit`, the ordered emit) of every row described by `rows`.
template <class Rows>
status launch_select_rows(cudaStream_t st, const char* fn, const matrix_view<const float>& scores, const Rows& rows,
                          const select_dev_ws& w, const select_plan& plan, bool full_key, bool emit, bad_counter bad) {
  const index_t R = scores.extent(0);
  if (R == 0) return {};
  constexpr int threads = select_block_threads;
  if (!plan.multi) {
    select_one_block_kernel<Rows><<<grid_blocks(R), threads, 0, st>>>(scores, rows, full_key, emit, w.states, bad);
    return launch_status(fn);
  }
  const unsigned grid = grid_blocks(R * plan.chunks);
  for (int pass = 0; pass < radix_passes; ++pass) {
    select_multi_pass_kernel<Rows><<<grid, threads, 0, st>>>(scores, rows, w, plan, pass, full_key, bad);
    KVEVICT_TRY(launch_status(fn));
  }
  if (!emit) return {};
  const stored_rows<Rows> stored{rows, w.states};
  select_multi_count_kernel<stored_rows<Rows>><<<grid, threads, 0, st>>>(scores, stored, w, plan);
  KVEVICT_TRY(launch_status(fn));
  select_multi_emit_kernel<stored_rows<Rows>><<<grid, threads, 0, st>>>(scores, stored, w, plan);
  return launch_status(fn);
}

/// The emit of rows whose thresholds are given (flattened selection).
template <class Rows>
status launch_emit_given(cudaStream_t st, const char* fn, const matrix_view<const float>& scores, const Rows& rows,
                         const select_dev_ws& w, const select_plan& plan) {
  const index_t R = scores.extent(0);
  if (R == 0) return {};
  constexpr int threads = select_block_threads;
  if (!plan.multi) {
    select_one_block_kernel<Rows><<<grid_blocks(R), threads, 0, st>>>(scores, rows, true, true, nullptr, bad_counter{});
    return launch_status(fn);
  }
  const unsigned grid = grid_blocks(R * plan.chunks);
  select_multi_count_kernel<Rows><<<grid, threads, 0, st>>>(scores, rows, w, plan);
  KVEVICT_TRY(launch_status(fn));
  select_multi_emit_kernel<Rows><<<grid, threads, 0, st>>>(scores, rows, w, plan);
  return launch_status(fn);
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
  const index_t R = scores.extent(0), T = scores.extent(1), k = kept.extent(1);
  if (k > T && R > 0)
    return status::error(errc::invalid_argument, "%s: k = %lld is larger than the rows' %lld columns", fn,
                         static_cast<long long>(k), static_cast<long long>(T));
  const detail::select_plan plan = detail::plan_select(R, T, static_cast<int>(options.algo));
  detail::workspace_carver carver(ws);
  const detail::select_dev_ws w = detail::carve_select_dev_ws(carver, ws, R, plan, false);
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  KVEVICT_TRY(detail::check_select_dense_ws(fn, ws, carver.used(), scores, row_lengths, kept));
  const cudaStream_t st = detail::stream_of(be);
  if (plan.multi || options.synchronize) KVEVICT_TRY(detail::zero_workspace(st, fn, w));
  const detail::dense_rows rows{row_lengths, T, k, kept.data_handle(), kept.stride(0), kept.stride(1)};
  const detail::bad_counter bad{options.bad_rows, options.synchronize ? w.counter : nullptr};
  KVEVICT_TRY(detail::launch_select_rows(st, fn, scores, rows, w, plan, false, true, bad));
  return detail::finish_select(st, fn, w, options);
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
  const index_t R = scores.extent(0), T = scores.extent(1);
  const detail::select_plan plan = detail::plan_select(R, T, static_cast<int>(options.algo));
  detail::workspace_carver carver(ws);
  const detail::select_dev_ws w = detail::carve_select_dev_ws(carver, ws, R, plan, false);
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  KVEVICT_TRY(detail::check_select_ragged_ws(fn, ws, carver.used(), scores, row_lengths, kept, total));
  const cudaStream_t st = detail::stream_of(be);
  if (plan.multi || options.synchronize) KVEVICT_TRY(detail::zero_workspace(st, fn, w));
  const detail::ragged_rows rows{row_lengths, T, kept.cu, kept.pos, R, total};
  const detail::bad_counter bad{options.bad_rows, options.synchronize ? w.counter : nullptr};
  KVEVICT_TRY(detail::launch_select_rows(st, fn, scores, rows, w, plan, false, true, bad));
  return detail::finish_select(st, fn, w, options);
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
  const detail::bad_counter bad{options.bad_rows, options.synchronize ? w.sel.counter : nullptr};
  if (floors != nullptr)
    KVEVICT_TRY(detail::launch_select_rows(st, fn, scores, detail::floor_rows{row_lengths, T, floors}, w.sel, plan,
                                           true, false, detail::bad_counter{}));
  const unsigned row_grid = detail::grid_blocks((R + 255) / 256);
  detail::flat_rows_kernel<<<row_grid, 256, 0, st>>>(row_lengths, T, floors, R, w);
  KVEVICT_TRY(detail::launch_status(fn));
  if (R > 0) {
    const unsigned layer_grid = detail::grid_blocks(R * w.layer_plan.chunks);
    for (int pass = 0; pass < detail::radix_passes; ++pass) {
      detail::flat_layer_pass_kernel<<<layer_grid, detail::select_block_threads, 0, st>>>(scores, w, total, pass);
      KVEVICT_TRY(detail::launch_status(fn));
    }
    detail::flat_row_totals_kernel<<<detail::grid_blocks(R), detail::select_block_threads, 0, st>>>(w, R, total);
    KVEVICT_TRY(detail::launch_status(fn));
  }
  detail::flat_counts_kernel<<<1, detail::select_block_threads, 0, st>>>(w, R, total, kept_cu, bad);
  KVEVICT_TRY(detail::launch_status(fn));
  if (kept_pos != nullptr)
    KVEVICT_TRY(detail::launch_emit_given(st, fn, scores, detail::flat_emit_rows{w.rows, kept_cu, kept_pos}, w.sel,
                                          plan));
  return detail::finish_select(st, fn, w.sel, options);
}

}  // namespace kvevict
