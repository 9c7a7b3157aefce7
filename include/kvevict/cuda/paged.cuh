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

#include <kvevict/cuda/block.cuh>
#include <kvevict/cuda/compact.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/detail/block/paged_block.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>

namespace kvevict {
namespace detail {

/// Step 1: count every listed page (grid-stride); a listed count outside [0, pool pages] is one
/// problem (nothing is marked).
__global__ void __launch_bounds__(compact_threads)
    paged_mark_kernel(page_table table, index_t pool_pages, std::uint32_t* marks, bad_counter bad) {
  const index_t listed = table.indptr[table.lists];
  if (listed < 0 || listed > pool_pages) {
    if (blockIdx.x == 0 && threadIdx.x == 0) bad.add(1);
    return;
  }
  const auto count = [](std::uint32_t* m) { atomicAdd(m, 1u); };
  int n = 0;
  for (index_t i = index_t(blockIdx.x) * compact_threads + threadIdx.x; i < listed;
       i += index_t(gridDim.x) * compact_threads)
    n += paged_mark_page(table, i, pool_pages, marks, count);
  bad.add(n);
}

/// Step 2: block r (grid-stride) validates row r.
template <class T>
__global__ void __launch_bounds__(compact_threads)
    paged_validate_kernel(paged_inplace_heads<T> heads, const std::uint32_t* marks, bad_counter bad) {
  validate_items(heads.heads(), bad,
                 [&](compact_block_t& blk, index_t r) { return paged_validate_row(blk, heads, r, marks); });
}

/// Step 3: one block decides (all or nothing) and writes the lengths and freed pages.
template <class T>
__global__ void __launch_bounds__(compact_threads)
    paged_finish_kernel(paged_inplace_heads<T> heads, const int* problems, paged_compaction_out out,
                        index_t* head_rows, bad_counter bad) {
  __shared__ typename compact_block_t::temp_storage tmp;
  compact_block_t blk{tmp};
  const index_t added = paged_finish(blk, heads, *problems, out, head_rows);
  if (threadIdx.x == 0) bad.add(static_cast<int>(added));
}

/// Knorm: block r (grid-stride) scores row r's tokens; a row its table does not describe (bad
/// offsets, last page, page ids, or more tokens than out's columns) is skipped and counted.
template <class T>
__global__ void __launch_bounds__(compact_threads)
    paged_key_norm_kernel(paged_layer<T> layer, matrix_view<float> out, bad_counter bad) {
  for (index_t r = blockIdx.x; r < layer.rows(); r += gridDim.x) {
    const index_t n = paged_readable_row(layer, r, out.extent(1));
    if (n < 0) {
      if (threadIdx.x == 0) bad.add(1);
      continue;
    }
    for (index_t j = threadIdx.x; j < n; j += compact_threads)
      out.data_handle()[r * out.stride(0) + j * out.stride(1)] = key_norm_score(layer.key(r, j), layer.keys.dim, 1);
  }
}

/// Value weighting: block r (grid-stride) weights row r's `group` score rows; head_max reduces the
/// threads' maxima in shared memory first. Rows the table does not describe are skipped, counted.
template <class T>
__global__ void __launch_bounds__(compact_threads)
    paged_weight_kernel(paged_layer<T> layer, matrix_view<float> scores, index_t group, bool head_max,
                        bad_counter bad) {
  __shared__ float part[compact_threads];
  for (index_t r = blockIdx.x; r < layer.rows(); r += gridDim.x) {
    const index_t n = paged_readable_row(layer, r, scores.extent(1));
    if (n < 0) {
      if (threadIdx.x == 0) bad.add(1);
      continue;
    }
    float row_max = 0.0f;
    if (head_max) {
      part[threadIdx.x] = paged_value_max_part(layer, r, n, static_cast<int>(threadIdx.x), compact_threads);
      __syncthreads();
      for (int i = 0; i < compact_threads; ++i) row_max = max_nan(row_max, part[i]);
      __syncthreads();
    }
    paged_weight_part(layer, r, n, group, scores.data_handle(), scores.stride(0), scores.stride(1), head_max, row_max,
                      static_cast<int>(threadIdx.x), compact_threads);
  }
}

/// The in-place tiles over one pool's rows (the sync counters zeroed first).
template <class T>
status launch_paged_copy(cudaStream_t st, const char* fn, const paged_inplace_heads<T>& heads, const index_t* head_rows,
                         unsigned* counters) {
  const index_t R = heads.heads();
  const auto r = static_cast<std::size_t>(R);
  KVEVICT_TRY(cuda_status(cudaMemsetAsync(counters, 0, r * (2 + static_cast<std::size_t>(inplace_ring)) * sizeof(unsigned), st), fn));
  const page_pool<T>& p = heads.pool;
  const std::uint64_t bits = addr_bits(p.data) | static_cast<std::uint64_t>(p.page_stride) * sizeof(T) |
                             static_cast<std::uint64_t>(p.token_stride) * sizeof(T) |
                             static_cast<std::uint64_t>(p.head_stride) * sizeof(T);
  return with_unit(unit_for<T>(true, bits, p.dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const row_copy<T, U> rc{p.dim, 1, 1};
    const index_t tile_rows = inplace_tile_rows(rc.units(), rc.unit_bytes());
    const index_t parts = parts_per_head(R, 1024, inplace_max_parts);
    const inplace_sync sync{counters, counters + R, counters + 2 * R};
    inplace_copy_kernel<T, U, paged_inplace_heads<T>>
        <<<grid_blocks(R * parts), compact_threads, 0, st>>>(heads, rc, tile_rows, parts, head_rows, sync);
    return launch_status(fn);
  });
}

}  // namespace detail

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
  std::uint32_t* marks = c.take<std::uint32_t>(static_cast<std::size_t>(P));
  int* problems = c.take<int>(1);
  index_t* head_rows = c.take<index_t>(r);
  unsigned* counters = c.take<unsigned>(r * (2 + static_cast<std::size_t>(detail::inplace_ring)));
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
  const cudaStream_t st = detail::stream_of(be);
  KVEVICT_TRY(detail::cuda_status(cudaMemsetAsync(marks, 0, static_cast<std::size_t>(P) * sizeof(std::uint32_t), st), fn));
  KVEVICT_TRY(detail::cuda_status(cudaMemsetAsync(problems, 0, sizeof(int), st), fn));
  const detail::bad_counter count{bad, problems};
  const detail::paged_inplace_heads<T> kh{layer.keys, layer.table, kept, layer.kv_heads, layer.lists};
  const detail::paged_inplace_heads<T> vh{layer.values, layer.table, kept, layer.kv_heads, layer.lists};
  detail::paged_mark_kernel<<<detail::grid_blocks((P + detail::compact_threads - 1) / detail::compact_threads),
                              detail::compact_threads, 0, st>>>(layer.table, P, marks, count);
  KVEVICT_TRY(detail::launch_status(fn));
  detail::paged_validate_kernel<T><<<detail::grid_blocks(R), detail::compact_threads, 0, st>>>(kh, marks, count);
  KVEVICT_TRY(detail::launch_status(fn));
  detail::paged_finish_kernel<T><<<1, detail::compact_threads, 0, st>>>(kh, problems, out, head_rows, count);
  KVEVICT_TRY(detail::launch_status(fn));
  if (R == 0) return {};
  KVEVICT_TRY(detail::launch_paged_copy(st, fn, kh, head_rows, counters));
  return detail::launch_paged_copy(st, fn, vh, head_rows, counters);
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
  detail::paged_key_norm_kernel<T><<<detail::grid_blocks(layer.rows()), detail::compact_threads, 0,
                                     detail::stream_of(be)>>>(layer, out, detail::bad_counter{bad, nullptr});
  return detail::launch_status(fn);
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
  detail::paged_weight_kernel<T><<<detail::grid_blocks(R), detail::compact_threads, 0, detail::stream_of(be)>>>(
      layer, scores, scores.extent(0) / R, mode == value_weight::head_max, detail::bad_counter{bad, nullptr});
  return detail::launch_status(fn);
}

}  // namespace kvevict
