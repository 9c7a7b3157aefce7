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
#include <kvevict/detail/block/compact_block.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict {
namespace detail {

inline constexpr int compact_threads = 256;
using compact_block_t = cuda_block<compact_threads>;

// ---- host: unit and grid choices ------------------------------------------------------------------

/// Blocks per head for per-head grids: about 4096 blocks in all, at most 1024 per head.
inline index_t parts_per_head(index_t heads, index_t target = 4096, index_t most = 1024) {
  const index_t h = heads > 0 ? heads : 1;
  const index_t p = (target + h - 1) / h;
  return p < 1 ? 1 : p > most ? most : p;
}

// ---- kernels ------------------------------------------------------------------------------------------

/// Groups of `lanes` threads, one kept row per group, grid-stride over the H x k rows.
template <class T, int Unit>
__global__ void __launch_bounds__(compact_threads)
    compact_dense_kernel(kv_view<const T> src, matrix_view<const pos_t> kept, kv_view<T> dst, int lanes,
                         bad_counter bad) {
  const row_copy<T, Unit> rc{src.extent(2), src.stride(2), dst.stride(2)};
  const index_t rows = kept.extent(0) * kept.extent(1), groups = compact_threads / lanes;
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  for (index_t r = index_t(blockIdx.x) * groups + threadIdx.x / lanes; r < rows; r += index_t(gridDim.x) * groups)
    if (!gather_dense_row(src, kept, dst, rc, r, lane, lanes) && lane == 0) bad.add(1);
}

/// Per head (`parts` blocks each, grid-stride over H x parts): validate the head's offsets, then
/// one row per group of lanes. ToCache: the destination is a ragged_cache (lens[h] set).
template <class T, int Unit, bool ToCache>
__global__ void __launch_bounds__(compact_threads)
    compact_ragged_kernel(kv_view<const T> src, ragged_positions kept, T* dst, const std::int32_t* dst_cu,
                          std::int32_t* lens, index_t row_stride, index_t parts, int lanes, bad_counter bad) {
  const row_copy<T, Unit> rc{src.extent(2), src.stride(2), 1};
  const index_t H = kept.heads, groups = compact_threads / lanes;
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  for (index_t vb = blockIdx.x; vb < H * parts; vb += gridDim.x) {
    const index_t h = vb / parts, part = vb % parts;
    const ragged_head hd = ToCache ? ragged_cache_head(kept.cu, dst_cu, kept.pos != nullptr, dst != nullptr, h, H)
                                   : ragged_view_head(kept.cu, dst_cu, kept.pos != nullptr, dst != nullptr, h, H);
    if (!hd.ok) {
      if (part == 0 && threadIdx.x == 0) bad.add(1);
      continue;
    }
    if (ToCache && part == 0 && threadIdx.x == 0) lens[h] = static_cast<std::int32_t>(hd.count);
    for (index_t j = part * groups + threadIdx.x / lanes; j < hd.count; j += parts * groups)
      if (!gather_ragged_row(src, kept.pos, hd, h, j, dst, row_stride, rc, lane, lanes) && lane == 0) bad.add(1);
  }
}

/// In place, step 1: block h (grid-stride) validates head h's arguments and positions.
template <class Heads>
__global__ void __launch_bounds__(compact_threads)
    inplace_validate_kernel(Heads heads, index_t* head_rows, bad_counter bad) {
  __shared__ typename compact_block_t::temp_storage tmp;
  compact_block_t blk{tmp};
  for (index_t h = blockIdx.x; h < heads.heads(); h += gridDim.x) {
    const index_t n = inplace_validate(blk, heads, h, head_rows);
    if (threadIdx.x == 0) bad.add(static_cast<int>(n < 1 << 30 ? n : 1 << 30));
    __syncthreads();
  }
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

/// Append: per head (`parts` blocks each), rows i -> rows lens[h] + i; with update_lens (one
/// block per head) the block then raises lens[h] itself.
template <class T, int Unit>
__global__ void __launch_bounds__(compact_threads)
    append_kernel(ragged_cache<T> cache, kv_view<const T> rows, index_t parts, int lanes, bool update_lens,
                  bad_counter bad) {
  const row_copy<T, Unit> rc{rows.extent(2), rows.stride(2), 1};
  const index_t H = cache.heads, n = rows.extent(1), groups = compact_threads / lanes;
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  for (index_t vb = blockIdx.x; vb < H * parts; vb += gridDim.x) {
    const index_t h = vb / parts, part = vb % parts;
    index_t first = 0;
    if (!append_head_ok(cache.cu_capacity, cache.lens, h, H, n, cache.data != nullptr, first)) {
      if (part == 0 && threadIdx.x == 0) bad.add(1);
      continue;
    }
    for (index_t i = part * groups + threadIdx.x / lanes; i < n; i += parts * groups)
      append_row(cache, rows, h, i, first, rc, lane, lanes);
    if (update_lens) {
      __syncthreads();  // every thread has read lens[h]
      if (threadIdx.x == 0) cache.lens[h] += static_cast<std::int32_t>(n);
    }
  }
}

/// Append with several blocks per head: lens[h] += n afterwards, for the heads that were copied.
template <class T>
__global__ void append_lens_kernel(ragged_cache<T> cache, index_t n) {
  for (index_t h = index_t(blockIdx.x) * blockDim.x + threadIdx.x; h < cache.heads; h += index_t(gridDim.x) * blockDim.x) {
    index_t first = 0;
    if (append_head_ok(cache.cu_capacity, cache.lens, h, cache.heads, n, cache.data != nullptr, first))
      cache.lens[h] += static_cast<std::int32_t>(n);
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
  const index_t rows = kept.extent(0) * kept.extent(1), dim = src.extent(2);
  if (rows == 0 || dim == 0) return {};
  const bool contiguous = src.stride(2) == 1 && dst.stride(2) == 1;
  const int unit = detail::unit_for<T>(contiguous, detail::view_bits(src) | detail::view_bits(dst), dim);
  const cudaStream_t st = detail::stream_of(be);
  return detail::with_unit(unit, [&](auto u) {
    constexpr int U = decltype(u)::value;
    const int lanes = detail::copy_lanes(detail::row_copy<T, U>{dim, 1, 1}.units());
    const index_t groups = detail::compact_threads / lanes;
    detail::compact_dense_kernel<T, U><<<detail::grid_blocks((rows + groups - 1) / groups), detail::compact_threads, 0,
                                         st>>>(src, kept, dst, lanes, detail::bad_counter{bad_positions, nullptr});
    return detail::launch_status(fn);
  });
}

namespace detail {
template <class T, bool ToCache>
status launch_ragged_gather(cuda_t be, const char* fn, const kv_view<const T>& src, const ragged_positions& kept,
                            T* dst, const std::int32_t* dst_cu, std::int32_t* lens, index_t row_stride,
                            int* bad_positions) {
  const index_t H = kept.heads, dim = src.extent(2);
  if (H == 0) return {};
  const bool contiguous = src.stride(2) == 1;
  const std::uint64_t bits = view_bits(src) | addr_bits(dst) | static_cast<std::uint64_t>(row_stride) * sizeof(T);
  const cudaStream_t st = stream_of(be);
  const index_t parts = parts_per_head(H);
  return with_unit(dim == 0 ? 16 : unit_for<T>(contiguous, bits, dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const int lanes = copy_lanes(row_copy<T, U>{dim, 1, 1}.units());
    compact_ragged_kernel<T, U, ToCache><<<grid_blocks(H * parts), compact_threads, 0, st>>>(
        src, kept, dst, dst_cu, lens, row_stride, parts, lanes, bad_counter{bad_positions, nullptr});
    return launch_status(fn);
  });
}

/// Host checks shared by the two ragged gathers.
template <class T>
status check_ragged_gather(const char* fn, const kv_view<const T>& src, const ragged_positions& kept, index_t heads,
                           index_t dim, index_t row_stride, const T* dst, const std::int32_t* dst_cu,
                           const char* dst_cu_name) {
  KVEVICT_TRY(check_compact_ragged_shape(fn, src, kept.heads, heads, dim, row_stride));
  if (kept.cu == nullptr) return status::error(errc::null_pointer, "%s: kept.cu offsets are null", fn);
  if (dst_cu == nullptr) return status::error(errc::null_pointer, "%s: %s offsets are null", fn, dst_cu_name);
  KVEVICT_TRY(check_ragged_rows_device<T>(fn, "dst", row_stride));
  const byte_range d = first_row(dst, row_stride);
  if (range_of(src).intersects(d)) return overlap_error(fn, "src", "dst");
  if (positions_range(kept.pos, 1).intersects(d)) return overlap_error(fn, "kept", "dst");
  return {};
}
}  // namespace detail

/// Ragged gather on the GPU: head h's kept rows (kept.pos[kept.cu[h] ..]) packed into dst's rows
/// of head h; dst.cu_lens must equal kept.cu (checked per head on the device). Host-side errors:
/// src view, head counts, head dims, dst row layout, null offsets, overlaps of src or kept.pos
/// with dst's first row (the ragged extents are device data).
template <class S, class T>
status compact(cuda_t be, kv_view<S> src_in, ragged_positions kept, ragged_view<T> dst, int* bad_positions = nullptr) {
  static_assert(std::is_same_v<std::remove_const_t<S>, T>, "compact: src and dst element types differ");
  constexpr const char* fn = "compact(cuda)";
  const kv_view<const T> src = src_in;
  KVEVICT_TRY(detail::check_ragged_gather(fn, src, kept, dst.heads, dst.dim, dst.row_stride,
                                          static_cast<const T*>(dst.data), dst.cu_lens, "dst.cu_lens"));
  return detail::launch_ragged_gather<T, false>(be, fn, src, kept, dst.data, dst.cu_lens, nullptr, dst.row_stride,
                                                bad_positions);
}

/// Dense cache -> ragged cache with capacity on the GPU: head h receives its kept rows at the start
/// of its region and lens[h] = the number kept. A head keeping more rows than its capacity is
/// skipped (lens[h] unchanged) and counted; never reallocates.
template <class S, class T>
status compact(cuda_t be, kv_view<S> src_in, ragged_positions kept, ragged_cache<T> dst, int* bad_positions = nullptr) {
  static_assert(std::is_same_v<std::remove_const_t<S>, T>, "compact: src and dst element types differ");
  constexpr const char* fn = "compact(cuda)";
  const kv_view<const T> src = src_in;
  KVEVICT_TRY(detail::check_ragged_gather(fn, src, kept, dst.heads, dst.dim, dst.row_stride,
                                          static_cast<const T*>(dst.data), dst.cu_capacity, "dst.cu_capacity"));
  if (dst.lens == nullptr && dst.heads > 0) return status::error(errc::null_pointer, "%s: dst.lens is null", fn);
  return detail::launch_ragged_gather<T, true>(be, fn, src, kept, dst.data, dst.cu_capacity, dst.lens,
                                               dst.row_stride, bad_positions);
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
  if (detail::range_of(rows).intersects(detail::first_row(cache.data, cache.row_stride)))
    return detail::overlap_error(fn, "rows", "cache");
  const index_t H = cache.heads, n = rows.extent(1), dim = cache.dim;
  if (H == 0 || n == 0) return {};
  const cudaStream_t st = detail::stream_of(be);
  const bool big = n * dim * static_cast<index_t>(sizeof(T)) >= (index_t(1) << 18);
  const index_t parts = big ? detail::parts_per_head(H, 2048, 256) : 1;
  const std::uint64_t bits = detail::view_bits(rows) | detail::addr_bits(cache.data) |
                             static_cast<std::uint64_t>(cache.row_stride) * sizeof(T);
  const detail::bad_counter bad{bad_heads, nullptr};
  KVEVICT_TRY(detail::with_unit(dim == 0 ? 16 : detail::unit_for<T>(rows.stride(2) == 1, bits, dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const int lanes = detail::copy_lanes(detail::row_copy<T, U>{dim, 1, 1}.units());
    detail::append_kernel<T, U><<<detail::grid_blocks(H * parts), detail::compact_threads, 0, st>>>(cache, rows, parts,
                                                                                                 lanes, parts == 1, bad);
    return detail::launch_status(fn);
  }));
  if (parts == 1) return {};
  detail::append_lens_kernel<T><<<detail::grid_blocks((H + 255) / 256), 256, 0, st>>>(cache, n);
  return detail::launch_status(fn);
}

}  // namespace kvevict
