// The CUDA compaction gathers and the decode-time append as ops over the SIMT context
// (detail/block/simt.hpp, simt_bodies.hpp) and their launch sequences, written once for both
// launchers: the CUDA overloads of kvevict/cuda/compact.cuh call them with cuda_launcher, the tests
// with simt_launcher (the host SIMT executor). Not API.
//
// Rows are copied by groups of `lanes` threads (detail/block/compact_block.hpp: copy units chosen on
// the host from the addresses, strides and row size; one row per group). The in-place compaction
// (compact_block.hpp's tiles: validation, reset of the ordering state, tiled copy with its decoupled
// look-back over a ring of flags) is three ops launched by inplace_launch; the paged compaction
// (cuda/paged.cuh) reuses the reset and copy (inplace_copy_launch) after its own validation.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/compact_block.hpp>
#include <kvevict/detail/block/select_ops.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>

#include <cstdint>

namespace kvevict::detail {

inline constexpr int compact_op_threads = 256;

/// Blocks per head for per-head grids: about `target` blocks in all, at most `most` per head.
inline index_t parts_per_head(index_t heads, index_t target = 4096, index_t most = 1024) {
  const index_t h = heads > 0 ? heads : 1;
  const index_t p = (target + h - 1) / h;
  return p < 1 ? 1 : p > most ? most : p;
}

/// Dense gather: groups of `lanes` threads, one kept row per group, grid-stride over the H x k rows.
template <class T, int Unit>
struct compact_dense_op {
  static constexpr int threads = compact_op_threads;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, kv_view<const T> src, matrix_view<const pos_t> kept,
                                       kv_view<T> dst, int lanes, simt_bad bad) {
    const row_copy<T, Unit> rc{src.extent(2), src.stride(2), dst.stride(2)};
    const index_t rows = kept.extent(0) * kept.extent(1), groups = threads / lanes;
    const int lane = static_cast<int>(c.thread()) % lanes;
    for (index_t r = c.block() * groups + c.thread() / lanes; r < rows; r += c.grid_dim() * groups)
      if (!gather_dense_row(src, kept, dst, rc, r, lane, lanes) && lane == 0) bad.add(c, 1);
  }
};

/// Ragged gathers: per head (`parts` blocks each, grid-stride over H x parts) validate the head's
/// offsets, then one row per group of lanes. ToCache: the destination is a ragged_cache (lens[h] set).
template <class T, int Unit, bool ToCache>
struct compact_ragged_op {
  static constexpr int threads = compact_op_threads;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, kv_view<const T> src, ragged_positions kept, T* dst,
                                       const std::int32_t* dst_cu, std::int32_t* lens, index_t row_stride,
                                       index_t parts, int lanes, simt_bad bad) {
    const row_copy<T, Unit> rc{src.extent(2), src.stride(2), 1};
    const index_t H = kept.heads, groups = threads / lanes, tid = c.thread();
    const int lane = static_cast<int>(tid) % lanes;
    for (index_t vb = c.block(); vb < H * parts; vb += c.grid_dim()) {
      const index_t h = vb / parts, part = vb % parts;
      const ragged_head hd = ToCache ? ragged_cache_head(kept.cu, dst_cu, kept.pos != nullptr, dst != nullptr, h, H)
                                     : ragged_view_head(kept.cu, dst_cu, kept.pos != nullptr, dst != nullptr, h, H);
      if (!hd.ok) {
        if (part == 0 && tid == 0) bad.add(c, 1);
        continue;
      }
      if (ToCache && part == 0 && tid == 0) lens[h] = static_cast<std::int32_t>(hd.count);
      for (index_t j = part * groups + tid / lanes; j < hd.count; j += parts * groups)
        if (!gather_ragged_row(src, kept.pos, hd, h, j, dst, row_stride, rc, lane, lanes) && lane == 0) bad.add(c, 1);
    }
  }
};

/// Append: per head (`parts` blocks each), rows i -> rows lens[h] + i; with update_lens (one block
/// per head) the block then raises lens[h] itself, after a barrier (every thread has read it).
template <class T, int Unit>
struct append_op {
  static constexpr int threads = compact_op_threads;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, ragged_cache<T> cache, kv_view<const T> rows, index_t parts,
                                       int lanes, bool update_lens, simt_bad bad) {
    const row_copy<T, Unit> rc{rows.extent(2), rows.stride(2), 1};
    const index_t H = cache.heads, n = rows.extent(1), groups = threads / lanes, tid = c.thread();
    const int lane = static_cast<int>(tid) % lanes;
    for (index_t vb = c.block(); vb < H * parts; vb += c.grid_dim()) {
      const index_t h = vb / parts, part = vb % parts;
      index_t first = 0;
      if (!append_head_ok(cache.cu_capacity, cache.lens, h, H, n, cache.data != nullptr, first)) {
        if (part == 0 && tid == 0) bad.add(c, 1);
        continue;
      }
      for (index_t i = part * groups + tid / lanes; i < n; i += parts * groups)
        append_row(cache, rows, h, i, first, rc, lane, lanes);
      if (update_lens) {
        c.sync();  // every thread has read lens[h]
        if (tid == 0) cache.lens[h] += static_cast<std::int32_t>(n);  // later items: other heads
      }
    }
  }
};

/// Append with several blocks per head: lens[h] += n afterwards, for the heads that were copied.
template <class T>
struct append_lens_op {
  static constexpr int threads = 256;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, ragged_cache<T> cache, index_t n) {
    const index_t stride = c.grid_dim() * c.block_dim();
    for (index_t h = c.block() * c.block_dim() + c.thread(); h < cache.heads; h += stride) {
      index_t first = 0;
      if (append_head_ok(cache.cu_capacity, cache.lens, h, cache.heads, n, cache.data != nullptr, first))
        cache.lens[h] += static_cast<std::int32_t>(n);
    }
  }
};

// ---- in place ------------------------------------------------------------------------------------

/// The validation ops (in place here, paged in paged_ops.hpp): block b (grid-stride over `items`)
/// validates item b, Check::run(blk, b, args...) returning its problems (block-uniform; it ends with
/// a barrier or reads nothing shared), and thread 0 adds them (at most 2^30 per item) to bad.
template <class Check>
struct validate_op {
  static constexpr int threads = compact_op_threads;
  struct shared {
    ucount scan[threads / 32];
  };
  template <class Ctx, class... A>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, index_t items, simt_bad bad, A... args) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    for (index_t b = c.block(); b < items; b += c.grid_dim()) {
      const index_t n = Check::run(blk, b, args...);
      if (c.thread() == 0) bad.add(c, static_cast<int>(n < (1 << 30) ? n : (1 << 30)));
    }
  }
};

/// In place, step 1: head h's arguments and positions (head_rows[h] = its list length, or -1).
struct inplace_check {
  template <class Block, class Heads>
  KVEVICT_HOST_DEVICE static index_t run(Block& blk, index_t h, Heads heads, index_t* head_rows) {
    return inplace_validate(blk, heads, h, head_rows);
  }
};

/// Step 2: the copy's ordering state (tickets, prefixes, flags) zeroed, grid-stride.
struct inplace_reset_op {
  static constexpr int threads = 256;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, inplace_sync s, index_t H) {
    const index_t stride = c.grid_dim() * c.block_dim();
    for (index_t i = c.block() * c.block_dim() + c.thread(); i < H * s.ring_size; i += stride) {
      s.ring[i] = 0;
      if (i < H) s.ticket[i] = s.prefix[i] = 0;
    }
  }
};

/// Warp 0 (the whole warp) of tile t: waits until every tile in [prefix, t) of head h has read,
/// then raises the prefix to t (a fence, then an atomic max: the release of what it observed).
/// Lane 0 reads the prefix and broadcasts it: lanes reading it one by one could see different
/// values (another tile raising it in between) and leave a tile of [prefix, t) unchecked (the host
/// executor, which interleaves the lanes' loads, found that on the earlier per-lane loads).
template <class Ctx>
KVEVICT_HOST_DEVICE void inplace_look_back(Ctx& c, const inplace_sync& s, index_t h, index_t t) {
  const unsigned* ring = s.ring + h * s.ring_size;
  for (;;) {
    const unsigned p0 = c.lane() == 0 ? c.ld_acquire(s.prefix + h) : 0u;
    const index_t p = c.shfl(p0, 0);
    bool all = true;
    for (index_t b = p + c.lane(); b < t; b += 32) all = all && inplace_has_read(c.ld_acquire(ring + b % s.ring_size), b);
    if (c.all(all)) break;
    c.pause();
  }
  if (c.lane() == 0) {
    c.fence();
    c.atomic_max(s.prefix + h, static_cast<unsigned>(t));
  }
}

/// Thread 0 of tile t: publishes "tile t of head h has read" once its slot is free.
template <class Ctx>
KVEVICT_HOST_DEVICE void inplace_publish(Ctx& c, const inplace_sync& s, index_t h, index_t t) {
  while (!inplace_can_publish(c.ld_acquire(s.prefix + h), t, s.ring_size)) c.pause();
  c.fence();
  c.st_release(s.ring + h * s.ring_size + t % s.ring_size, static_cast<unsigned>(t + 1));
}

/// Step 3: `parts` blocks per valid head (grid-stride over H x parts) take its tiles in order
/// (ticket); a tile stages its rows, publishes, looks back, writes; a one-row tile (rows too wide
/// to stage) looks back, copies, then publishes. Ordered = false drops the publish and the
/// look-back (only for the tests, which show that the result is then corrupted).
template <class T, int Unit, class Heads, bool Ordered = true>
struct inplace_copy_op {
  static constexpr int threads = compact_op_threads;
  struct shared {
    alignas(16) unsigned char stage[inplace_stage_bytes];
    unsigned tile;
  };
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, Heads heads, row_copy<T, Unit> rc, index_t tile_rows,
                                       index_t parts, const index_t* head_rows, inplace_sync sync) {
    simt_block<Ctx, threads> blk{c, nullptr};  // each() and size() only
    const index_t H = heads.heads(), tid = c.thread();
    for (index_t vb = c.block(); vb < H * parts; vb += c.grid_dim()) {
      const index_t h = vb / parts, n = head_rows[h];
      if (n < 0) continue;
      for (;;) {
        if (tid == 0) c.st(&sh.tile, c.atomic_add(sync.ticket + h, 1u));
        c.sync();
        const index_t t = c.ld(&sh.tile);
        if (!inplace_tile_read(blk, heads, rc, h, n, t, tile_rows, sh.stage)) break;
        c.sync();  // the tile's reads are done
        if constexpr (Ordered) {
          if (tile_rows > 0 && tid == 0) inplace_publish(c, sync, h, t);
          if (c.warp() == 0) inplace_look_back(c, sync, h, t);
        }
        c.sync();
        inplace_tile_write(blk, heads, rc, h, n, t, tile_rows, sh.stage);
        c.sync();
        if constexpr (Ordered)
          if (tile_rows == 0 && tid == 0) inplace_publish(c, sync, h, t);  // read during the copy
      }
      c.sync();  // every thread has read the last ticket
    }
  }
};

// ---- launch sequences (after the host-side checks) ----------------------------------------------------

/// Dense gather (rows, dim > 0).
template <class L, class T>
void compact_dense_launch(L& l, const kv_view<const T>& src, const matrix_view<const pos_t>& kept, const kv_view<T>& dst,
                          simt_bad bad, index_t cap = index_t(1) << 20) {
  const index_t rows = kept.extent(0) * kept.extent(1), dim = src.extent(2);
  const bool contiguous = src.stride(2) == 1 && dst.stride(2) == 1;
  with_unit(unit_for<T>(contiguous, view_bits(src) | view_bits(dst), dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const int lanes = copy_lanes(row_copy<T, U>{dim, 1, 1}.units());
    const index_t groups = compact_op_threads / lanes;
    l.template run<compact_dense_op<T, U>>(simt_shape{simt_grid((rows + groups - 1) / groups, cap), compact_op_threads},
                                           src, kept, dst, lanes, bad);
  });
}

/// Ragged gathers (H > 0): into a ragged_view (dst_cu = its cu_lens) or a ragged_cache (ToCache:
/// dst_cu = its cu_capacity, lens set). `parts` blocks per head (0: parts_per_head).
template <bool ToCache, class L, class T>
void compact_ragged_launch(L& l, const kv_view<const T>& src, const ragged_positions& kept, T* dst,
                           const std::int32_t* dst_cu, std::int32_t* lens, index_t row_stride, simt_bad bad,
                           index_t parts = 0, index_t cap = index_t(1) << 20) {
  const index_t H = kept.heads, dim = src.extent(2);
  const std::uint64_t bits = view_bits(src) | addr_bits(dst) | static_cast<std::uint64_t>(row_stride) * sizeof(T);
  if (parts <= 0) parts = parts_per_head(H);
  with_unit(dim == 0 ? 16 : unit_for<T>(src.stride(2) == 1, bits, dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const int lanes = copy_lanes(row_copy<T, U>{dim, 1, 1}.units());
    l.template run<compact_ragged_op<T, U, ToCache>>(simt_shape{simt_grid(H * parts, cap), compact_op_threads}, src,
                                                     kept, dst, dst_cu, lens, row_stride, parts, lanes, bad);
  });
}

/// Append (H, n > 0): one block per head for small appends (lens raised in the kernel), else
/// parts_per_head(H, 2048, 256) blocks per head and a second kernel for lens (`parts` > 0 forces a
/// count).
template <class L, class T>
void append_launch(L& l, const ragged_cache<T>& cache, const kv_view<const T>& rows, simt_bad bad, index_t parts = 0,
                   index_t cap = index_t(1) << 20) {
  const index_t H = cache.heads, n = rows.extent(1), dim = cache.dim;
  if (parts <= 0) {
    const bool big = n * dim * static_cast<index_t>(sizeof(T)) >= (index_t(1) << 18);
    parts = big ? parts_per_head(H, 2048, 256) : 1;
  }
  const std::uint64_t bits =
      view_bits(rows) | addr_bits(cache.data) | static_cast<std::uint64_t>(cache.row_stride) * sizeof(T);
  with_unit(dim == 0 ? 16 : unit_for<T>(rows.stride(2) == 1, bits, dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const int lanes = copy_lanes(row_copy<T, U>{dim, 1, 1}.units());
    l.template run<append_op<T, U>>(simt_shape{simt_grid(H * parts, cap), compact_op_threads}, cache, rows, parts,
                                    lanes, parts == 1, bad);
  });
  if (parts > 1) l.template run<append_lens_op<T>>(simt_shape{simt_grid((H + 255) / 256, cap), 256}, cache, n);
}

/// The in-place copy of valid heads (head_rows from a validation): the ordering state reset, then
/// the tiles. Rows of `dim` elements of T, contiguous or with element stride `elem_stride`; `bits`
/// the OR of the addresses and byte strides (the copy unit). Tests may force the tile rows (>= 0;
/// 0: one-row tiles copied directly), the blocks per head (`parts` > 0), a grid cap and the order.
template <class T, bool Ordered = true, class L, class Heads>
void inplace_copy_launch(L& l, const Heads& heads, bool contiguous, std::uint64_t bits, index_t dim,
                         index_t elem_stride, const index_t* head_rows, const inplace_sync& sync,
                         index_t tile_rows = -1, index_t parts = 0, index_t cap = index_t(1) << 20) {
  const index_t H = heads.heads();
  if (H == 0) return;
  l.template run<inplace_reset_op>(simt_shape{simt_grid((H * sync.ring_size + 255) / 256, cap), 256}, sync, H);
  if (parts <= 0) parts = parts_per_head(H, 1024, inplace_max_parts);
  with_unit(unit_for<T>(contiguous, bits, dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const row_copy<T, U> rc{dim, elem_stride, elem_stride};
    const index_t tr = tile_rows >= 0 ? tile_rows : inplace_tile_rows(rc.units(), rc.unit_bytes());
    l.template run<inplace_copy_op<T, U, Heads, Ordered>>(simt_shape{simt_grid(H * parts, cap), compact_op_threads},
                                                          heads, rc, tr, parts, head_rows, sync);
  });
}

/// In place on dense or ragged heads (H > 0): validation, then inplace_copy_launch.
template <class T, bool Ordered = true, class L, class Heads>
void inplace_launch(L& l, const Heads& heads, bool contiguous, std::uint64_t bits, index_t dim, index_t elem_stride,
                    index_t* head_rows, const inplace_sync& sync, simt_bad bad, index_t tile_rows = -1,
                    index_t parts = 0, index_t cap = index_t(1) << 20) {
  l.template run<validate_op<inplace_check>>(simt_shape{simt_grid(heads.heads(), cap), compact_op_threads},
                                             heads.heads(), bad, heads, head_rows);
  inplace_copy_launch<T, Ordered>(l, heads, contiguous, bits, dim, elem_stride, head_rows, sync, tile_rows, parts, cap);
}

}  // namespace kvevict::detail
