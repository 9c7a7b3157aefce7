// The CUDA compaction kernels' logic as host-device functions over a Block (detail/block/block.hpp):
// the ops of detail/block/compact_ops.hpp run them on the GPU (kvevict/cuda/compact.cuh, paged.cuh)
// and on the host SIMT executor (tests/test_compact_device_logic.cpp, test_paged_device_logic.cpp).
// Not API.
//
// Row copies: a row of `dim` elements is copied in units. When both rows are contiguous (element
// stride 1), the unit is the widest of 16, 8, 4, 2, 1 bytes that divides every base address, byte
// stride and the row size (checked at run time on the host: copy_unit_bytes), so aligned rows move
// as 16-byte vectors; otherwise (strided elements) the unit is one element.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/select_block.hpp>
#include <kvevict/view.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvevict::detail {

struct alignas(16) unit16 {
  std::uint32_t w[4];
};
struct alignas(8) unit8 {
  std::uint32_t w[2];
};
template <int Bytes>
struct unit_of;
template <>
struct unit_of<16> {
  using type = unit16;
};
template <>
struct unit_of<8> {
  using type = unit8;
};
template <>
struct unit_of<4> {
  using type = std::uint32_t;
};
template <>
struct unit_of<2> {
  using type = std::uint16_t;
};
template <>
struct unit_of<1> {
  using type = std::uint8_t;
};

/// The widest copy unit (16, 8, 4, 2 or 1 bytes) dividing `bits`, the OR of every base address,
/// byte stride and row size of a copy (lowest set bit, capped at 16).
KVEVICT_HOST_DEVICE constexpr int copy_unit_bytes(std::uint64_t bits) noexcept {
  const std::uint64_t x = bits | 16u;
  return static_cast<int>(x & (~x + 1u));
}

/// The copy unit the launchers choose (and the host emulation with them): the address bits of a
/// pointer, of a view (base and row strides), the unit of rows of `dim` elements of T (0: element by
/// element, because an element stride is not 1), and the call of f with that unit as a constant.
inline std::uint64_t addr_bits(const void* p) { return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)); }

template <class T>
std::uint64_t view_bits(const kv_view<T>& v) {
  return addr_bits(v.data_handle()) | static_cast<std::uint64_t>(v.stride(0)) * sizeof(T) |
         static_cast<std::uint64_t>(v.stride(1)) * sizeof(T);
}

template <class T>
int unit_for(bool contiguous, std::uint64_t bits, index_t dim) {
  if (!contiguous) return 0;
  return copy_unit_bytes(bits | static_cast<std::uint64_t>(dim) * sizeof(T));
}

template <class F>
auto with_unit(int unit, F&& f) -> decltype(f(std::integral_constant<int, 0>{})) {
  switch (unit) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 1: return f(std::integral_constant<int, 1>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

/// Threads cooperating on one row: the smallest power of two >= the row's units, at most 32.
KVEVICT_HOST_DEVICE constexpr int copy_lanes(index_t units) noexcept {
  int l = 1;
  while (l < 32 && l < units) l *= 2;
  return l;
}

/// How rows are copied: Unit bytes at a time (0: element by element, with element strides).
template <class T, int Unit>
struct row_copy {
  index_t dim;       ///< elements per row
  index_t src_step;  ///< element stride of the source rows (Unit == 0)
  index_t dst_step;  ///< element stride of the destination rows (Unit == 0)

  KVEVICT_HOST_DEVICE index_t units() const noexcept {
    if constexpr (Unit == 0) return dim;
    else return dim * index_t(sizeof(T)) / Unit;
  }
  KVEVICT_HOST_DEVICE static constexpr index_t unit_bytes() noexcept { return Unit == 0 ? index_t(sizeof(T)) : Unit; }
  /// Copies unit u of a row (from memory or a staging buffer) to unit u of another.
  KVEVICT_HOST_DEVICE void unit(void* dst, index_t dst_stride, const void* src, index_t src_stride, index_t u) const {
    if constexpr (Unit == 0) {
      static_cast<T*>(dst)[u * dst_stride] = static_cast<const T*>(src)[u * src_stride];
    } else {
      using U = typename unit_of<Unit>::type;
#if KVEVICT_DEVICE_COMPILATION
      static_cast<U*>(dst)[u] = static_cast<const U*>(src)[u];
#else
      std::memcpy(static_cast<unsigned char*>(dst) + u * Unit, static_cast<const unsigned char*>(src) + u * Unit,
                  sizeof(U));
#endif
      (void)dst_stride;
      (void)src_stride;
    }
  }
  /// Row src -> row dst, units lane, lane + lanes, ...
  KVEVICT_HOST_DEVICE void row(T* dst, const T* src, int lane, int lanes) const {
    const index_t n = units();
    for (index_t u = lane; u < n; u += lanes) unit(dst, dst_step, src, src_step, u);
  }
};

// ---- device-resident offsets ---------------------------------------------------------------------

/// Head h's span [begin, begin + count) of an offsets array cu[H + 1] in device memory: valid if
/// cu[0] == 0 and 0 <= cu[h] <= cu[h+1] <= cu[H] (so every valid head stays inside the declared
/// [0, cu[H])).
KVEVICT_HOST_DEVICE inline bool offsets_span_ok(const std::int32_t* cu, index_t h, index_t H, index_t& begin,
                                                index_t& count) noexcept {
  const index_t a = cu[h], b = cu[h + 1];
  const bool ok = cu[0] == 0 && a >= 0 && a <= b && b <= cu[H];
  begin = ok ? a : 0;
  count = ok ? b - a : 0;
  return ok;
}

/// A head of a ragged gather: its kept list, and its destination rows.
struct ragged_head {
  bool ok;
  index_t kept_begin;  ///< first entry of the head's kept positions
  index_t count;       ///< rows to copy
  index_t dst_begin;   ///< first destination row (flat row index)
};

/// Destination a ragged_view with offsets cu_lens that must equal kept.cu (head h checks its two).
KVEVICT_HOST_DEVICE inline ragged_head ragged_view_head(const std::int32_t* kept_cu, const std::int32_t* dst_cu,
                                                        bool has_pos, bool has_data, index_t h, index_t H) noexcept {
  ragged_head r{false, 0, 0, 0};
  index_t b2 = 0, n2 = 0;
  const bool ok = offsets_span_ok(kept_cu, h, H, r.kept_begin, r.count) && offsets_span_ok(dst_cu, h, H, b2, n2) &&
                  b2 == r.kept_begin && n2 == r.count && (has_pos || r.count == 0) && (has_data || r.count == 0);
  r.ok = ok;
  r.dst_begin = b2;
  if (!ok) r.count = 0;
  return r;
}

/// Destination a ragged_cache: head h's kept rows go to the start of its capacity region.
KVEVICT_HOST_DEVICE inline ragged_head ragged_cache_head(const std::int32_t* kept_cu, const std::int32_t* cap_cu,
                                                         bool has_pos, bool has_data, index_t h, index_t H) noexcept {
  ragged_head r{false, 0, 0, 0};
  index_t cap = 0;
  const bool ok = offsets_span_ok(kept_cu, h, H, r.kept_begin, r.count) &&
                  offsets_span_ok(cap_cu, h, H, r.dst_begin, cap) && r.count <= cap && (has_pos || r.count == 0) &&
                  (has_data || r.count == 0);
  r.ok = ok;
  if (!ok) r.count = 0;
  return r;
}

/// Head h of a ragged_cache receiving `n` appended rows: rows lens[h] .. lens[h] + n - 1.
KVEVICT_HOST_DEVICE inline bool append_head_ok(const std::int32_t* cap_cu, const std::int32_t* lens, index_t h,
                                               index_t H, index_t n, bool has_data, index_t& first_row) noexcept {
  index_t begin = 0, cap = 0;
  const index_t len = lens[h];
  const bool ok = offsets_span_ok(cap_cu, h, H, begin, cap) && len >= 0 && len <= cap && n <= cap - len &&
                  (has_data || n == 0);
  first_row = ok ? begin + len : 0;
  return ok;
}

// ---- in-place compaction ----------------------------------------------------------------------------
// Row j of a head becomes row kept[j] (kept strictly ascending, so kept[j] >= j). Row x is read by
// at most one entry j' (kept[j'] = x, so j' <= x) and written by entry x: the copies are safe if
// every entry's read happens before the writes of the entries after it.
//
// The kernel cuts each head's list into tiles of consecutive entries, taken in order from a
// per-head ticket. Tile c stages the rows it reads in shared memory and publishes "tile c has
// read" in a per-head ring of flags (slot c % ring, value c + 1). Before writing, it looks back
// over the flags of tiles P .. c-1, P being a per-head monotone prefix (every tile < P has read),
// until they are all published, then raises P to c (atomic max) and writes its rows. Reads are
// never delayed, writes wait only for the reads of the tiles in flight before them, and no tile
// relays a signal to the next (no chain of round trips): tiles of one head proceed in parallel.
// A slot is reused by tile c only once P > c - ring (nobody looks at the old tile any more); a
// flag value >= b + 1 therefore means "tile b has read". Tiles are taken in order, so every tile
// a waiting tile depends on is already running: no deadlock (the SIMT executor checks random
// interleavings). Rows too wide for the staging buffer form one-row tiles that look back first,
// copy memory to memory (read and write rows differ), then publish. Entries with kept[j] == j are
// skipped (nothing moves).

/// Flags per head in the ring (at least twice the blocks working on one head).
inline constexpr index_t inplace_ring = 512;
/// Most blocks working on one head.
inline constexpr index_t inplace_max_parts = 256;

/// Per-head state of the in-place copy (workspace; reset by inplace_reset_op before each copy):
/// ticket, prefix, ring of `ring_size` flags (inplace_ring on the GPU; the tests pass small rings
/// so that the slots are reused after a few tiles).
struct inplace_sync {
  unsigned* ticket;  ///< [H] next tile to take
  unsigned* prefix;  ///< [H] every tile below has read
  unsigned* ring;    ///< [H][ring_size]
  index_t ring_size = inplace_ring;
};

/// Tile c may publish its flag once the slot's previous tile is no longer looked at.
KVEVICT_HOST_DEVICE constexpr bool inplace_can_publish(index_t prefix, index_t c, index_t ring = inplace_ring) noexcept {
  return prefix + ring > c;
}
/// Flag value of slot b % ring read as "tile b has read".
KVEVICT_HOST_DEVICE constexpr bool inplace_has_read(std::uint32_t flag, index_t b) noexcept {
  return index_t(flag) >= b + 1;
}

/// Bytes of shared memory staging a tile.
inline constexpr index_t inplace_stage_bytes = 32768;

/// Rows of `unit_bytes x units` that fit in the staging buffer (0: too wide, copied directly).
KVEVICT_HOST_DEVICE constexpr index_t inplace_tile_rows(index_t units, index_t unit_bytes) noexcept {
  return units * unit_bytes <= 0 ? 1 : inplace_stage_bytes / (units * unit_bytes);
}

/// A head for in-place compaction: row(j) is its j-th row, pos(j) its j-th kept position.
template <class T>
struct dense_inplace_head {
  T* data;  ///< row 0 of the head
  index_t row_stride;
  const pos_t* kept;
  index_t kept_stride;
  KVEVICT_HOST_DEVICE T* row(index_t j) const { return data + j * row_stride; }
  KVEVICT_HOST_DEVICE index_t pos(index_t j) const { return kept[j * kept_stride]; }
};

/// Tile rows [first, first + count): stage every moving row's units (unit u of tile row t at
/// stage + (t * units + u) * unit_bytes).
template <class Block, class T, int Unit, class Head>
KVEVICT_HOST_DEVICE void inplace_stage(Block& blk, const Head& hd, const row_copy<T, Unit>& rc, index_t first,
                                       index_t count, unsigned char* stage) {
  const index_t units = rc.units(), ub = rc.unit_bytes();
  blk.each([&](int tid) {
    for (index_t i = tid; i < count * units; i += blk.size()) {
      const index_t j = first + i / units, u = i % units, p = hd.pos(j);
      if (p != j) {
        blk.plain_write(stage + i * ub, static_cast<std::size_t>(ub));  // unit u of tile row i / units
        rc.unit(stage + (i - u) * ub, 1, hd.row(p), rc.src_step, u);
      }
    }
  });
}
/// ... and write them to rows first .. first + count - 1.
template <class Block, class T, int Unit, class Head>
KVEVICT_HOST_DEVICE void inplace_unstage(Block& blk, const Head& hd, const row_copy<T, Unit>& rc, index_t first,
                                         index_t count, const unsigned char* stage) {
  const index_t units = rc.units(), ub = rc.unit_bytes();
  blk.each([&](int tid) {
    for (index_t i = tid; i < count * units; i += blk.size()) {
      const index_t j = first + i / units, u = i % units, p = hd.pos(j);
      if (p != j) {
        blk.plain_read(stage + i * ub, static_cast<std::size_t>(ub));
        rc.unit(hd.row(j), rc.dst_step, stage + (i - u) * ub, 1, u);
      }
    }
  });
}
/// A one-row tile copied directly (after its wait).
template <class Block, class T, int Unit, class Head>
KVEVICT_HOST_DEVICE void inplace_direct(Block& blk, const Head& hd, const row_copy<T, Unit>& rc, index_t j) {
  const index_t p = hd.pos(j);
  if (p == j) return;
  blk.each([&](int tid) { rc.row(hd.row(j), hd.row(p), tid, blk.size()); });
}

/// Positions of a head that break the in-place contract (outside [0, tokens), or not strictly
/// after the previous one), counted by the block (uniform result).
template <class Block, class Head>
KVEVICT_HOST_DEVICE index_t inplace_bad_positions(Block& blk, const Head& hd, index_t n, index_t tokens) {
  return static_cast<index_t>(block_sum(blk, [&](int tid) {
    ucount bad = 0;
    for (index_t j = tid; j < n; j += blk.size()) {
      const index_t p = hd.pos(j);
      bad += (p < 0 || p >= tokens || (j > 0 && p <= hd.pos(j - 1))) ? 1u : 0u;
    }
    return bad;
  }));
}

// ---- gathers: one row per group of lanes ----------------------------------------------------------

/// Flat row r (= h * k + j) of a dense gather: dst[h][j] = src[h][kept[h][j]]. False (nothing
/// written) if the position is outside [0, src tokens).
template <class T, int Unit>
KVEVICT_HOST_DEVICE bool gather_dense_row(const kv_view<const T>& src, const matrix_view<const pos_t>& kept,
                                          const kv_view<T>& dst, const row_copy<T, Unit>& rc, index_t r, int lane,
                                          int lanes) {
  const index_t k = kept.extent(1), h = r / k, j = r % k;
  const index_t p = kept.data_handle()[h * kept.stride(0) + j * kept.stride(1)];
  if (p < 0 || p >= src.extent(1)) return false;
  rc.row(dst.data_handle() + h * dst.stride(0) + j * dst.stride(1),
         src.data_handle() + h * src.stride(0) + p * src.stride(1), lane, lanes);
  return true;
}

/// Row j of head h of a ragged gather (head described by hd, validated): to flat row
/// hd.dst_begin + j of the destination. False if the position is outside [0, src tokens).
template <class T, int Unit>
KVEVICT_HOST_DEVICE bool gather_ragged_row(const kv_view<const T>& src, const pos_t* pos, const ragged_head& hd,
                                           index_t h, index_t j, T* dst, index_t row_stride,
                                           const row_copy<T, Unit>& rc, int lane, int lanes) {
  const index_t p = pos[hd.kept_begin + j];
  if (p < 0 || p >= src.extent(1)) return false;
  rc.row(dst + (hd.dst_begin + j) * row_stride, src.data_handle() + h * src.stride(0) + p * src.stride(1), lane,
         lanes);
  return true;
}

/// Row i of head h appended at flat row `first + i` of a ragged cache.
template <class T, int Unit>
KVEVICT_HOST_DEVICE void append_row(const ragged_cache<T>& cache, const kv_view<const T>& rows, index_t h, index_t i,
                                    index_t first, const row_copy<T, Unit>& rc, int lane, int lanes) {
  rc.row(cache.data + (first + i) * cache.row_stride, rows.data_handle() + h * rows.stride(0) + i * rows.stride(1),
         lane, lanes);
}

// ---- in place: heads, validation, tiles -------------------------------------------------------------

/// Heads of a dense cache compacted in place with a [H][k] kept matrix.
template <class T>
struct dense_inplace_heads {
  kv_view<T> cache;
  matrix_view<const pos_t> kept;
  KVEVICT_HOST_DEVICE index_t heads() const { return cache.extent(0); }
  /// The head's list length n and the rows its positions may name; false if its arguments are bad.
  KVEVICT_HOST_DEVICE bool args(index_t, index_t& n, index_t& tokens) const {
    n = kept.extent(1);
    tokens = cache.extent(1);
    return true;
  }
  KVEVICT_HOST_DEVICE dense_inplace_head<T> head(index_t h) const {
    return {cache.data_handle() + h * cache.stride(0), cache.stride(1), kept.data_handle() + h * kept.stride(0),
            kept.stride(1)};
  }
  KVEVICT_HOST_DEVICE void set_length(index_t, index_t) const {}
};

/// Heads of a ragged cache compacted in place with ragged kept lists; lens[h] becomes n.
template <class T>
struct ragged_inplace_heads {
  ragged_cache<T> cache;
  ragged_positions kept;
  KVEVICT_HOST_DEVICE index_t heads() const { return cache.heads; }
  KVEVICT_HOST_DEVICE bool args(index_t h, index_t& n, index_t& tokens) const {
    index_t kb = 0, cb = 0, cap = 0;
    const bool spans = offsets_span_ok(kept.cu, h, cache.heads, kb, n) && offsets_span_ok(cache.cu_capacity, h, cache.heads, cb, cap);
    tokens = spans ? index_t(cache.lens[h]) : 0;
    return spans && tokens >= 0 && tokens <= cap && (kept.pos != nullptr || n == 0) &&
           (cache.data != nullptr || n == 0 || cache.dim == 0);
  }
  KVEVICT_HOST_DEVICE dense_inplace_head<T> head(index_t h) const {
    return {cache.data + index_t(cache.cu_capacity[h]) * cache.row_stride, cache.row_stride, kept.pos + kept.cu[h], 1};
  }
  KVEVICT_HOST_DEVICE void set_length(index_t h, index_t n) const { cache.lens[h] = static_cast<std::int32_t>(n); }
};

/// Validation of head h before anything moves: head_rows[h] = its list length, or -1 (skipped) if
/// its arguments or positions are bad. Returns the number to report (bad positions, or 1).
template <class Block, class Heads>
KVEVICT_HOST_DEVICE index_t inplace_validate(Block& blk, const Heads& heads, index_t h, index_t* head_rows) {
  index_t n = 0, tokens = 0;
  const bool ok = heads.args(h, n, tokens);
  const index_t bad = ok ? inplace_bad_positions(blk, heads.head(h), n, tokens) : 1;
  blk.each([&](int tid) {
    if (tid == 0) head_rows[h] = bad == 0 ? n : -1;
  });
  return bad;
}

/// Tile c of a valid head of n rows, first half: tile 0 sets the head's new length; returns false
/// when the head has no tile c; otherwise stages the tile's rows (tile_rows > 0).
template <class Block, class Heads, class T, int Unit>
KVEVICT_HOST_DEVICE bool inplace_tile_read(Block& blk, const Heads& heads, const row_copy<T, Unit>& rc, index_t h,
                                           index_t n, index_t c, index_t tile_rows, unsigned char* stage) {
  if (c == 0) blk.each([&](int tid) {
      if (tid == 0) heads.set_length(h, n);
    });
  const index_t per = tile_rows > 0 ? tile_rows : 1, first = c * per;
  if (first >= n) return false;
  if (tile_rows > 0) inplace_stage(blk, heads.head(h), rc, first, imin(per, n - first), stage);
  return true;
}

/// Second half, once every tile before c has read (look-back done): a one-row tile copies its row
/// memory to memory (its flag is published afterwards), a staged tile writes its staged rows.
template <class Block, class Heads, class T, int Unit>
KVEVICT_HOST_DEVICE void inplace_tile_write(Block& blk, const Heads& heads, const row_copy<T, Unit>& rc, index_t h,
                                            index_t n, index_t c, index_t tile_rows, const unsigned char* stage) {
  const index_t per = tile_rows > 0 ? tile_rows : 1, first = c * per;
  if (tile_rows == 0) inplace_direct(blk, heads.head(h), rc, first);
  else inplace_unstage(blk, heads.head(h), rc, first, imin(per, n - first), stage);
}

}  // namespace kvevict::detail
