// CUDA overloads of <kvevict/compact.hpp>. Same semantics as the host backends; launches are
// asynchronous on the backend's stream and never synchronise the host.
//
//   compact(cuda_t, src, kept [H][k], dst kv_view [, bad])          dense gather
//   compact(cuda_t, src, kept ragged, dst ragged_view [, bad])      ragged gather
//   compact(cuda_t, src, kept ragged, dst ragged_cache [, bad])     into a cache with capacity (sets lens)
//   compact_inplace(cuda_t, ws, cache kv_view, kept [H][k] [, bad]) in place, dense
//   compact_inplace(cuda_t, ws, cache ragged_cache, kept [, bad])   in place, ragged (sets lens)
//   append(cuda_t, cache ragged_cache, rows [, bad])                decode-time append, no reallocation
//
// Every pointer holds device memory. Checked on the host before any launch: everything the host
// backends check that needs no device data (views, shapes, head dims, row layouts, overlaps of
// ranges known on the host, workspace size). Offsets, lengths and positions live in device
// memory: the kernels check them and skip what is invalid, writing nothing out of bounds, and
// add the number of skipped rows (bad positions, or 1 per head with bad offsets or lengths) to
// `*bad` when it is non-null (a device int the caller zeroes). Positions produced by kvevict's
// selection are always valid. Per launcher (docs/cuda.md, "Compaction"):
//   dense gather: a row whose position is outside [0, tokens) is skipped;
//   ragged gathers: a head whose offsets are bad (cu[0] != 0, cu[h] > cu[h+1], past cu[H], a
//     ragged_view's cu_lens differing from kept.cu, a ragged_cache head keeping more than its
//     capacity) is skipped and its lens[h] left unchanged; a bad position skips its row;
//   in place: a head with a bad position (outside [0, tokens or lens[h]), or not strictly
//     ascending) or bad offsets is left entirely untouched (validated before anything moves);
//   append: a head whose lens[h] is outside [0, capacity] or lacks room for the rows is skipped.
// Contiguous rows (element stride 1) are copied in the widest of 16/8/4/2/1-byte units that every
// base address, stride and the row size allow (chosen on the host at run time); strided rows
// element by element.
#pragma once

#include <kvevict/compact.hpp>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/compact_block.hpp>
#include <kvevict/detail/block/compact_ops.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {
namespace detail {

inline constexpr int compact_threads = compact_op_threads;

// The kernels are the ops of detail/block/compact_ops.hpp (gathers, append, in-place validation,
// reset and tiled copy), launched by their launch sequences on cuda_launcher; the host tests run the
// same sequences on the SIMT executor.

// ---- shared launch pieces -----------------------------------------------------------------------------

/// A row stride with which 2^31 rows of T stay addressable in 64 bits (ragged row counts are in
/// device memory, so the host bounds them by the int32 offsets).
template <class T>
status check_ragged_rows_device(const char* fn, const char* name, index_t row_stride) {
  index_t total = 0;
  if (!checked_mul(INT32_MAX, row_stride, total) || !checked_mul(total, static_cast<index_t>(sizeof(T)), total))
    return status::error(errc::size_overflow, "%s: %s.row_stride = %lld is too large for int32 row offsets", fn, name,
                         static_cast<long long>(row_stride));
  return {};
}

/// Overlap of what the host knows of ragged buffers: their first row / element.
template <class T>
byte_range first_row(const T* data, index_t row_stride) {
  return rows_range(data, data != nullptr ? 1 : 0, row_stride);
}

/// errc::invalid_argument unless the ragged positions' device arrays are aligned for their types.
inline status check_kept_alignment(const char* fn, const ragged_positions& kept) {
  KVEVICT_TRY(check_device_alignment(fn, "kept.cu", kept.cu));
  return check_device_alignment(fn, "kept.pos", kept.pos);
}

/// errc::invalid_argument unless a ragged cache's rows, offsets and lengths are aligned for their types.
template <class T>
status check_cache_alignment(const char* fn, const char* name, const ragged_cache<T>& cache) {
  const char* field[3] = {"data", "cu_capacity", "lens"};
  const std::uintptr_t addr[3] = {reinterpret_cast<std::uintptr_t>(cache.data),
                                  reinterpret_cast<std::uintptr_t>(cache.cu_capacity),
                                  reinterpret_cast<std::uintptr_t>(cache.lens)};
  const std::size_t align[3] = {alignof(T), alignof(std::int32_t), alignof(std::int32_t)};
  for (int i = 0; i < 3; ++i)
    if (addr[i] % align[i] != 0)
      return status::error(errc::invalid_argument, "%s: %s.%s is not aligned to %zu bytes", fn, name, field[i], align[i]);
  return {};
}

/// The in-place copy's ordering state in a workspace: per head a ticket, a prefix and a ring of
/// inplace_ring flags (4 x 514 B per head).
inline inplace_sync take_inplace_sync(workspace_carver& carver, index_t heads) {
  const auto h = static_cast<std::size_t>(heads);
  unsigned* counters = carver.take<unsigned>(h * (2 + static_cast<std::size_t>(inplace_ring)));
  return inplace_sync{counters, counters + h, counters + 2 * h, inplace_ring};
}

/// In place: workspace (per head: rows to move or -1, then the ordering state: 8 + 4 x 514 B), then
/// inplace_launch (validation, reset, tiled copy). `touched` are the host-known ranges the call
/// reads or writes.
template <class T, class Heads>
status launch_inplace(cuda_t be, const char* fn, workspace& ws, const Heads& heads, bool contiguous,
                      std::uint64_t bits, index_t dim, index_t elem_stride, int* bad_positions,
                      const byte_range (&touched)[2]) {
  const index_t H = heads.heads();
  workspace_carver carver(ws);
  index_t* head_rows = carver.take<index_t>(static_cast<std::size_t>(H));
  const inplace_sync sync = take_inplace_sync(carver, H);
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  const auto w0 = reinterpret_cast<std::uintptr_t>(ws.data);
  const byte_range wsr{w0, w0 + carver.used()};
  const char* const names[] = {"the cache", "kept"};
  for (int i = 0; i < 2; ++i)
    if (wsr.intersects(touched[i]))
      return status::error(errc::overlap, "%s: the workspace and %s overlap in memory", fn, names[i]);
  if (H == 0) return {};
  cuda_launcher l{stream_of(be), fn};
  inplace_launch<T>(l, heads, contiguous, bits, dim, elem_stride, head_rows, sync, simt_bad{bad_positions, nullptr});
  return l.err;
}

}  // namespace detail

/// Dense gather on the GPU: dst[h][j][:] = src[h][kept[h][j]][:]. Views hold device pointers.
/// Host-side errors: those of the host form except the position range (device data). Rows whose
/// position is outside [0, src tokens) are skipped and counted into *bad_positions.
template <class S, class T>
status compact(cuda_t be, kv_view<S> src_in, matrix_view<const pos_t> kept, kv_view<T> dst,
               int* bad_positions = nullptr) {
  static_assert(std::is_same_v<std::remove_const_t<S>, T>, "compact: src and dst element types differ");
  constexpr const char* fn = "compact(cuda)";
  const kv_view<const T> src = src_in;
  KVEVICT_TRY(detail::check_compact_dense_shapes(fn, src, kept, dst));
  KVEVICT_TRY(detail::check_device_alignment(fn, "src", src.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "kept", kept.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "dst", static_cast<const T*>(dst.data_handle())));
  if (kept.extent(0) * kept.extent(1) == 0 || src.extent(2) == 0) return {};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::compact_dense_launch(l, src, kept, dst, detail::simt_bad{bad_positions, nullptr});
  return l.err;
}

namespace detail {
/// Host checks shared by the two ragged gathers.
template <class T>
status check_ragged_gather(const char* fn, const kv_view<const T>& src, const ragged_positions& kept, index_t heads,
                           index_t dim, index_t row_stride, const T* dst, const std::int32_t* dst_cu,
                           const char* dst_cu_name) {
  KVEVICT_TRY(check_compact_ragged_shape(fn, src, kept.heads, heads, dim, row_stride));
  if (kept.cu == nullptr) return status::error(errc::null_pointer, "%s: kept.cu offsets are null", fn);
  if (dst_cu == nullptr) return status::error(errc::null_pointer, "%s: %s offsets are null", fn, dst_cu_name);
  KVEVICT_TRY(check_ragged_rows_device<T>(fn, "dst", row_stride));
  KVEVICT_TRY(check_device_alignment(fn, "src", src.data_handle()));
  KVEVICT_TRY(check_kept_alignment(fn, kept));
  KVEVICT_TRY(check_device_alignment(fn, "dst.data", dst));
  KVEVICT_TRY(check_device_alignment(fn, dst_cu_name, dst_cu));
  const byte_range d = first_row(dst, row_stride);
  if (range_of(src).intersects(d)) return overlap_error(fn, "src", "dst");
  if (positions_range(kept.pos, 1).intersects(d)) return overlap_error(fn, "kept", "dst");
  return {};
}

/// The ragged gathers' entry: checks (dst_cu named cu_name; with ToCache, lens too), then the launch.
template <bool ToCache, class S, class T>
status compact_ragged(cuda_t be, const kv_view<S>& src_in, const ragged_positions& kept, index_t heads, index_t dim,
                      index_t row_stride, T* data, const std::int32_t* dst_cu, const char* cu_name, std::int32_t* lens,
                      int* bad_positions) {
  static_assert(std::is_same_v<std::remove_const_t<S>, T>, "compact: src and dst element types differ");
  constexpr const char* fn = "compact(cuda)";
  const kv_view<const T> src = src_in;
  KVEVICT_TRY(check_ragged_gather(fn, src, kept, heads, dim, row_stride, static_cast<const T*>(data), dst_cu, cu_name));
  if (ToCache && lens == nullptr && heads > 0) return status::error(errc::null_pointer, "%s: dst.lens is null", fn);
  KVEVICT_TRY(check_device_alignment(fn, "dst.lens", static_cast<const std::int32_t*>(lens)));
  if (kept.heads == 0) return {};
  cuda_launcher l{stream_of(be), fn};
  compact_ragged_launch<ToCache>(l, src, kept, data, dst_cu, lens, row_stride, simt_bad{bad_positions, nullptr});
  return l.err;
}
}  // namespace detail

/// Ragged gather on the GPU: head h's kept rows (kept.pos[kept.cu[h] ..]) packed into dst's rows
/// of head h; dst.cu_lens must equal kept.cu (checked per head on the device). Host-side errors:
/// src view, head counts, head dims, dst row layout, null offsets, overlaps of src or kept.pos
/// with dst's first row (the ragged extents are device data).
template <class S, class T>
status compact(cuda_t be, kv_view<S> src_in, ragged_positions kept, ragged_view<T> dst, int* bad_positions = nullptr) {
  return detail::compact_ragged<false>(be, src_in, kept, dst.heads, dst.dim, dst.row_stride, dst.data, dst.cu_lens,
                                       "dst.cu_lens", nullptr, bad_positions);
}

/// Dense cache -> ragged cache with capacity on the GPU: head h receives its kept rows at the start
/// of its region and lens[h] = the number kept. A head keeping more rows than its capacity is
/// skipped (lens[h] unchanged) and counted; never reallocates.
template <class S, class T>
status compact(cuda_t be, kv_view<S> src_in, ragged_positions kept, ragged_cache<T> dst, int* bad_positions = nullptr) {
  return detail::compact_ragged<true>(be, src_in, kept, dst.heads, dst.dim, dst.row_stride, dst.data, dst.cu_capacity,
                                      "dst.cu_capacity", dst.lens, bad_positions);
}

/// In place on a dense cache on the GPU: cache[h][j] = cache[h][kept[h][j]] for j < k (positions
/// strictly ascending per head). Needs a workspace (2064 B per head: the tiles' ordering state;
/// the host form has none). Host-side errors: those of the host form except the positions. A head
/// with a position outside [0, tokens) or not strictly ascending is left untouched and counted.
template <class T>
status compact_inplace(cuda_t be, workspace& ws, kv_view<T> cache, matrix_view<const pos_t> kept,
                       int* bad_positions = nullptr) {
  constexpr const char* fn = "compact_inplace(cuda)";
  KVEVICT_TRY(detail::check_inplace_dense_shape(fn, cache, kept));
  KVEVICT_TRY(detail::check_device_alignment(fn, "cache", static_cast<const T*>(cache.data_handle())));
  KVEVICT_TRY(detail::check_device_alignment(fn, "kept", kept.data_handle()));
  const bool contiguous = cache.stride(2) == 1;
  const detail::dense_inplace_heads<T> heads{cache, kept};
  const detail::byte_range touched[2] = {detail::range_of(cache), detail::range_of(kept)};
  return detail::launch_inplace<T>(be, fn, ws, heads, contiguous, detail::view_bits(cache), cache.extent(2),
                                   cache.stride(2), bad_positions, touched);
}

/// In place on a ragged cache on the GPU: head h keeps rows kept.pos[kept.cu[h] ..] (strictly
/// ascending, each < lens[h]) packed to the front of its region; lens[h] becomes the number kept.
/// Workspace: 2064 B per head. Invalid heads are left untouched and counted.
template <class T>
status compact_inplace(cuda_t be, workspace& ws, ragged_cache<T> cache, ragged_positions kept,
                       int* bad_positions = nullptr) {
  constexpr const char* fn = "compact_inplace(cuda)";
  KVEVICT_TRY(detail::check_inplace_ragged_shape(fn, cache, kept));
  if (kept.cu == nullptr) return status::error(errc::null_pointer, "%s: kept.cu offsets are null", fn);
  if (cache.cu_capacity == nullptr)
    return status::error(errc::null_pointer, "%s: cache.cu_capacity offsets are null", fn);
  KVEVICT_TRY(detail::check_ragged_rows_device<T>(fn, "cache", cache.row_stride));
  KVEVICT_TRY(detail::check_cache_alignment(fn, "cache", cache));
  KVEVICT_TRY(detail::check_kept_alignment(fn, kept));
  if (detail::positions_range(kept.pos, 1).intersects(detail::first_row(cache.data, cache.row_stride)))
    return detail::overlap_error(fn, "kept", "cache");
  const detail::ragged_inplace_heads<T> heads{cache, kept};
  const std::uint64_t bits =
      detail::addr_bits(cache.data) | static_cast<std::uint64_t>(cache.row_stride) * sizeof(T);
  const detail::byte_range touched[2] = {detail::first_row(cache.data, cache.row_stride),
                                         detail::positions_range(kept.pos, 1)};
  return detail::launch_inplace<T>(be, fn, ws, heads, true, bits, cache.dim, 1, bad_positions, touched);
}

/// The CUDA in-place compaction needs a workspace: call compact_inplace(cuda, ws, cache, kept).
template <class T>
status compact_inplace(cuda_t, kv_view<T>, matrix_view<const pos_t>) = delete;
template <class T>
status compact_inplace(cuda_t, ragged_cache<T>, ragged_positions) = delete;

/// Decode-time append on the GPU: rows[h][i][:] becomes row lens[h] + i of head h, then
/// lens[h] += n; never reallocates (the capacity is preallocated by the engine). A head whose
/// lens[h] is outside [0, capacity] or lacks room is skipped (unchanged) and counted; the others
/// are appended (the host form is all or nothing: it can check every head first).
template <class T, class S>
status append(cuda_t be, ragged_cache<T> cache, kv_view<S> rows_in, int* bad_heads = nullptr) {
  static_assert(std::is_same_v<std::remove_const_t<S>, T>, "append: cache and rows element types differ");
  constexpr const char* fn = "append(cuda)";
  const kv_view<const T> rows = rows_in;
  KVEVICT_TRY(detail::check_append_shape(fn, cache, rows));
  if (cache.cu_capacity == nullptr && cache.heads > 0)
    return status::error(errc::null_pointer, "%s: cache.cu_capacity offsets are null", fn);
  KVEVICT_TRY(detail::check_ragged_layout(fn, "cache", cache.dim, cache.row_stride));
  KVEVICT_TRY(detail::check_ragged_rows_device<T>(fn, "cache", cache.row_stride));
  KVEVICT_TRY(detail::check_cache_alignment(fn, "cache", cache));
  KVEVICT_TRY(detail::check_device_alignment(fn, "rows", rows.data_handle()));
  if (detail::range_of(rows).intersects(detail::first_row(cache.data, cache.row_stride)))
    return detail::overlap_error(fn, "rows", "cache");
  if (cache.heads == 0 || rows.extent(1) == 0) return {};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::append_launch(l, cache, rows, detail::simt_bad{bad_heads, nullptr});
  return l.err;
}

}  // namespace kvevict
