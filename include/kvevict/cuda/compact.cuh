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
#include <kvevict/cuda/block.cuh>
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
using compact_block_t = cuda_block<compact_threads>;

// ---- kernels ------------------------------------------------------------------------------------------
// The gathers and the append are the ops of detail/block/compact_ops.hpp (launched by
// compact_dense_launch, compact_ragged_launch and append_launch, written once for the GPU and the
// host executor); the in-place kernels below are not converted yet.

/// The body of the validation kernels (the in-place compaction's here, the paged one's in
/// paged.cuh): block b (grid-stride) validates item b of `items`, validate(blk, b) returning its
/// problems, and thread 0 adds them (at most 2^30) to bad.
template <class Validate>
__device__ inline void validate_items(index_t items, bad_counter bad, Validate validate) {
  __shared__ typename compact_block_t::temp_storage tmp;
  compact_block_t blk{tmp};
  for (index_t b = blockIdx.x; b < items; b += gridDim.x) {
    const index_t n = validate(blk, b);
    if (threadIdx.x == 0) bad.add(static_cast<int>(n < 1 << 30 ? n : 1 << 30));
    __syncthreads();
  }
}

/// In place, step 1: block h (grid-stride) validates head h's arguments and positions.
template <class Heads>
__global__ void __launch_bounds__(compact_threads)
    inplace_validate_kernel(Heads heads, index_t* head_rows, bad_counter bad) {
  validate_items(heads.heads(), bad,
                 [&](compact_block_t& blk, index_t h) { return inplace_validate(blk, heads, h, head_rows); });
}

/// Per-head state of the in-place copy (workspace, zeroed): ticket, prefix, ring of flags.
struct inplace_sync {
  unsigned* ticket;  ///< [H]
  unsigned* prefix;  ///< [H] every tile below has read
  unsigned* ring;    ///< [H][inplace_ring]
};

__device__ inline unsigned load_acquire(unsigned* p) {
  return cuda::atomic_ref<unsigned, cuda::thread_scope_device>(*p).load(cuda::memory_order_acquire);
}

/// Warp 0 (the whole warp): waits until every tile in [prefix, c) of head h has read, then raises
/// the prefix to c.
__device__ inline void inplace_look_back(const inplace_sync& s, index_t h, index_t c) {
  unsigned* ring = s.ring + h * inplace_ring;
  const int lane = static_cast<int>(threadIdx.x);
  for (;;) {
    const index_t p = load_acquire(&s.prefix[h]);
    bool all = true;
    for (index_t b = p + lane; b < c; b += 32) all = all && inplace_has_read(load_acquire(&ring[b % inplace_ring]), b);
    if (__all_sync(0xffffffffu, all)) break;
    __nanosleep(64);
  }
  if (lane == 0)
    cuda::atomic_ref<unsigned, cuda::thread_scope_device>(s.prefix[h])
        .fetch_max(static_cast<unsigned>(c), cuda::memory_order_acq_rel);
}

/// Thread 0: publishes "tile c of head h has read" once its slot is free.
__device__ inline void inplace_publish(const inplace_sync& s, index_t h, index_t c) {
  while (!inplace_can_publish(load_acquire(&s.prefix[h]), c)) __nanosleep(64);
  __threadfence();
  cuda::atomic_ref<unsigned, cuda::thread_scope_device>(s.ring[h * inplace_ring + c % inplace_ring])
      .store(static_cast<unsigned>(c + 1), cuda::memory_order_release);
}

/// In place, step 2: `parts` blocks per valid head take its tiles in order (ticket); a tile
/// stages its reads, publishes them, looks back until the tiles before it have read, writes
/// (compact_block.hpp). Shared memory: 32 KiB staging.
template <class T, int Unit, class Heads>
__global__ void __launch_bounds__(compact_threads)
    inplace_copy_kernel(Heads heads, row_copy<T, Unit> rc, index_t tile_rows, index_t parts, const index_t* head_rows,
                        inplace_sync sync) {
  __shared__ typename compact_block_t::temp_storage tmp;
  __shared__ alignas(16) unsigned char stage[inplace_stage_bytes];
  __shared__ unsigned tile;
  compact_block_t blk{tmp};
  const index_t H = heads.heads();
  for (index_t vb = blockIdx.x; vb < H * parts; vb += gridDim.x) {
    const index_t h = vb / parts, n = head_rows[h];
    if (n < 0) continue;
    for (;;) {
      if (threadIdx.x == 0) tile = atomicAdd(&sync.ticket[h], 1u);
      __syncthreads();
      const index_t c = tile;
      if (!inplace_tile_read(blk, heads, rc, h, n, c, tile_rows, stage)) break;
      __syncthreads();  // the tile's reads are done
      if (tile_rows > 0 && threadIdx.x == 0) inplace_publish(sync, h, c);
      if (threadIdx.x < 32) inplace_look_back(sync, h, c);
      __syncthreads();
      inplace_tile_write(blk, heads, rc, h, n, c, tile_rows, stage);
      __syncthreads();
      if (tile_rows == 0 && threadIdx.x == 0) inplace_publish(sync, h, c);  // read during the copy
    }
    __syncthreads();
  }
}

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

/// In place: workspace (per head: rows to move or -1, tile ticket, read prefix, ring of read flags:
/// 8 + 4 x 514 B), validation kernel, tiled copy kernel. `touched` are the host-known ranges the call reads or writes.
template <class T, class Heads>
status launch_inplace(cuda_t be, const char* fn, workspace& ws, const Heads& heads, bool contiguous,
                      std::uint64_t bits, index_t dim, index_t elem_stride, int* bad_positions,
                      const byte_range (&touched)[2]) {
  const index_t H = heads.heads();
  const auto h = static_cast<std::size_t>(H);
  workspace_carver carver(ws);
  index_t* head_rows = carver.take<index_t>(h);
  unsigned* counters = carver.take<unsigned>(h * (2 + static_cast<std::size_t>(inplace_ring)));
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  const auto w0 = reinterpret_cast<std::uintptr_t>(ws.data);
  const byte_range wsr{w0, w0 + carver.used()};
  const char* const names[] = {"the cache", "kept"};
  for (int i = 0; i < 2; ++i)
    if (wsr.intersects(touched[i]))
      return status::error(errc::overlap, "%s: the workspace and %s overlap in memory", fn, names[i]);
  if (H == 0) return {};
  const cudaStream_t st = stream_of(be);
  KVEVICT_TRY(cuda_status(
      cudaMemsetAsync(counters, 0, h * (2 + static_cast<std::size_t>(inplace_ring)) * sizeof(unsigned), st), fn));
  const bad_counter bad{bad_positions, nullptr};
  inplace_validate_kernel<Heads><<<grid_blocks(H), compact_threads, 0, st>>>(heads, head_rows, bad);
  KVEVICT_TRY(launch_status(fn));
  return with_unit(unit_for<T>(contiguous, bits, dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const row_copy<T, U> rc{dim, elem_stride, elem_stride};
    const index_t tile_rows = inplace_tile_rows(rc.units(), rc.unit_bytes());
    const index_t parts = parts_per_head(H, 1024, inplace_max_parts);
    const inplace_sync sync{counters, counters + H, counters + 2 * H};
    inplace_copy_kernel<T, U, Heads><<<grid_blocks(H * parts), compact_threads, 0, st>>>(heads, rc, tile_rows, parts,
                                                                                       head_rows, sync);
    return launch_status(fn);
  });
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
