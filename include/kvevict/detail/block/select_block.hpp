// The CUDA selection kernels' algorithms, written once for a Block of cooperating threads
// (detail/block/block.hpp) and compiled both for the GPU (kvevict/cuda/select.cuh, where a block is a
// CUDA thread block) and for the host (tests/test_select_device_logic.cpp, with the emulator of
// detail/block/host_block.hpp). Every per-key and per-digit decision is a function of
// detail/base/radix.hpp, the same functions the host backends use, so the GPU keeps exactly the tokens
// the host keeps. Not API.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/block.hpp>
#include <kvevict/detail/base/radix.hpp>
#include <kvevict/workspace.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace kvevict::detail {


inline constexpr int select_block_threads = 256;  ///< threads of every selection block on the GPU
inline constexpr int emit_items = 8;               ///< consecutive keys per thread in an emit tile
inline constexpr int key_cache_keys = 8192;        ///< rows up to this long are held in shared memory

KVEVICT_HOST_DEVICE constexpr index_t imin(index_t a, index_t b) noexcept { return a < b ? a : b; }
KVEVICT_HOST_DEVICE constexpr index_t imax(index_t a, index_t b) noexcept { return a < b ? b : a; }

/// Shared-memory index of key i in a padded key array: one spare word every 32 keys, so that both
/// the striped accesses (thread t reads key base + t) and the blocked ones of the emit (thread t
/// reads keys base + 8t .. base + 8t + 7, base a multiple of 32) hit 32 different banks.
KVEVICT_HOST_DEVICE constexpr index_t smem_pad(index_t i) noexcept { return i + (i >> 5); }
/// Words of a padded array holding n keys.
KVEVICT_HOST_DEVICE constexpr index_t smem_padded_size(index_t n) noexcept { return n + (n + 31) / 32; }

/// Shared memory of the one-block and per-chunk selection kernels (a plain aggregate: CUDA cannot
/// construct __shared__ objects). 8 KiB histogram + 33 KiB key cache/staging + 24 B = 42008 B.
struct select_smem {
  std::uint32_t hist[radix_bins];
  union {
    std::uint32_t keys[smem_padded_size(key_cache_keys)];  ///< cached row, or an emit tile
    ucount merged[radix_bins];                              ///< the flattened selection's layer histogram
  };
  std::uint32_t bucket;  // the chosen bucket of the last block_choose
  std::int32_t flag;     // a block-wide flag (the last chunk of a row, in the multi-block passes)
  index_t above, count;
};

// ---- keys -------------------------------------------------------------------------------------

/// Keys of a row of scores in memory: key i = score_key(data[i * stride]).
struct score_keys {
  const float* data;
  index_t stride;
  KVEVICT_HOST_DEVICE std::uint32_t operator()(index_t i) const noexcept { return score_key(data[i * stride]); }
  KVEVICT_HOST_DEVICE const void* addr(index_t i) const noexcept { return data + i * stride; }
  static constexpr std::size_t bytes = sizeof(float);
};
/// Keys of a row held in a padded shared-memory array, key i of the row at keys[smem_pad(i - first)].
struct cached_keys {
  const std::uint32_t* keys;
  index_t first;
  KVEVICT_HOST_DEVICE std::uint32_t operator()(index_t i) const noexcept { return keys[smem_pad(i - first)]; }
  KVEVICT_HOST_DEVICE const void* addr(index_t i) const noexcept { return keys + smem_pad(i - first); }
  static constexpr std::size_t bytes = sizeof(std::uint32_t);
};

/// Key i of `keys`, its plain read announced to the block (Block::plain_read: shared-memory keys are
/// race-checked on the host SIMT executor).
template <class Block, class Keys>
KVEVICT_HOST_DEVICE std::uint32_t block_key(const Block& blk, const Keys& keys, index_t i) {
  blk.plain_read(keys.addr(i), Keys::bytes);
  return keys(i);
}

/// Where a row's kept positions go: position of slot j at data[j * stride].
struct pos_out {
  pos_t* data;
  index_t stride;
  KVEVICT_HOST_DEVICE void operator()(index_t slot, index_t pos) const noexcept {
    data[slot * stride] = static_cast<pos_t>(pos);
  }
};

// ---- the state of one row ---------------------------------------------------------------------

/// row_state::mode
enum : int {
  row_bad = 0,     ///< device-resident arguments of the row are invalid: nothing is written
  row_skip = 1,    ///< k == 0: nothing to keep
  row_all = 2,     ///< k == n: every position kept
  row_select = 3,  ///< 0 < k < n: radix select, then the ordered emit
};

/// Selection of one row: the threshold found so far and what is left to do. Trivially copyable,
/// no default member initialisers (it lives in registers, shared memory or the workspace).
struct row_state {
  radix_threshold t;  ///< keys above t are kept, and the first t.ties tied keys in position order
  index_t n;          ///< the row's candidates: positions [0, n)
  index_t k;          ///< tokens kept
  index_t tied;       ///< keys of the row tied with t (the chosen bucket's count in the last pass run)
  int mode;
  int done;  ///< the threshold is final (always for modes other than row_select)
};

/// Initial state of a row of n candidates keeping k (ok = the device-resident arguments are valid).
KVEVICT_HOST_DEVICE inline row_state row_begin(index_t n, index_t k, bool ok) noexcept {
  row_state s;
  s.t.mask = 0;
  s.t.prefix = 0;
  s.t.ties = k;
  s.n = n;
  s.k = k;
  s.tied = n;
  s.mode = !ok ? row_bad : k == 0 ? row_skip : k == n ? row_all : row_select;
  s.done = s.mode == row_select ? 0 : 1;
  return s;
}

/// A state whose threshold is already known: keep the keys > key and the first `ties` keys == key
/// (the flattened selection's final emit). `tied` = keys == key in the row.
KVEVICT_HOST_DEVICE inline row_state row_given(index_t n, index_t k, std::uint32_t key, index_t ties,
                                               index_t tied) noexcept {
  row_state s = row_begin(n, k, true);
  s.t = radix_full_threshold(key, ties);
  s.tied = tied;
  s.done = 1;
  return s;
}

/// After pass `pass` chose bucket b: narrow the threshold (as the host's row_threshold does).
KVEVICT_HOST_DEVICE inline void row_narrow(row_state& s, int pass, const radix_bucket& b, bool full_key) noexcept {
  s.tied = b.count;
  s.done = radix_narrow(s.t, pass, b, s.t.ties, full_key) ? 1 : 0;
}

/// Bins of pass p's histogram.
KVEVICT_HOST_DEVICE constexpr int radix_pass_bins(int pass) noexcept { return 1 << radix_width(pass); }

// ---- device-resident arguments ------------------------------------------------------------------
// Lengths, ragged budgets (offsets) and floors live in device memory: the kernels check them per
// row and turn a bad row into row_bad (nothing written, counted) instead of reading or writing out
// of bounds.

/// A row length must lie in [0, T].
KVEVICT_HOST_DEVICE constexpr bool row_length_ok(index_t n, index_t T) noexcept { return n >= 0 && n <= T; }

/// Row r of a ragged output list with offsets cu[R + 1] (device memory): its positions go to
/// pos[cu[r] .. cu[r + 1]), which must lie inside [0, cu[R]) (the list's declared size) and, when
/// the caller stated the capacity of pos (capacity >= 0), cu[R] <= capacity; cu[0] must be 0 and a
/// null pos is allowed only for an empty row. Sets k = the row's budget. A list whose offsets
/// decrease somewhere is caught by the rows around the decrease; the other rows still write inside
/// [0, cu[R]).
KVEVICT_HOST_DEVICE inline bool ragged_row_ok(const std::int32_t* cu, index_t r, index_t R, index_t capacity,
                                              bool has_pos, index_t& k) noexcept {
  const index_t a = cu[r], b = cu[r + 1], end = cu[R];
  const bool ok = cu[0] == 0 && a >= 0 && a <= b && b <= end && (capacity < 0 || end <= capacity) && (has_pos || a == b);
  k = ok ? b - a : 0;
  return ok;
}

// ---- row descriptions (kernel parameters) ---------------------------------------------------------
// state(r): the row's initial state (row_bad when its device-resident arguments are invalid);
// out(r): where its kept positions go.

/// Dense output [R][k]: every row keeps k; lengths null = every row is T long.
struct dense_rows {
  const std::int32_t* lengths;
  index_t T, k;
  pos_t* kept;
  index_t s0, s1;  ///< kept's strides
  KVEVICT_HOST_DEVICE row_state state(index_t r) const {
    const index_t n = lengths != nullptr ? index_t(lengths[r]) : T;
    const bool ok = row_length_ok(n, T) && k <= n;
    return row_begin(ok ? n : 0, k, ok);
  }
  KVEVICT_HOST_DEVICE pos_out out(index_t r) const { return {kept + r * s0, s1}; }
};

/// Ragged output: row r keeps cu[r+1] - cu[r] into pos[cu[r] ..] (see ragged_row_ok).
struct ragged_rows {
  const std::int32_t* lengths;
  index_t T;
  const std::int32_t* cu;
  pos_t* pos;
  index_t R, capacity;
  KVEVICT_HOST_DEVICE row_state state(index_t r) const {
    const index_t n = lengths != nullptr ? index_t(lengths[r]) : T;
    index_t k = 0;
    const bool ok = ragged_row_ok(cu, r, R, capacity, pos != nullptr, k) && row_length_ok(n, T) && k <= n;
    return row_begin(ok ? n : 0, ok ? k : 0, ok);
  }
  KVEVICT_HOST_DEVICE pos_out out(index_t r) const { return {pos + cu[r], 1}; }
};

/// The floors of the flattened selection: thresholds on the whole key, nothing emitted.
struct floor_rows {
  const std::int32_t* lengths;
  index_t T;
  const std::int32_t* floors;
  KVEVICT_HOST_DEVICE row_state state(index_t r) const {
    const index_t n = lengths != nullptr ? index_t(lengths[r]) : T, f = floors[r];
    const bool ok = row_length_ok(n, T) && f >= 0 && f <= n;
    return row_begin(ok ? n : 0, ok ? f : 0, ok);
  }
  KVEVICT_HOST_DEVICE pos_out out(index_t) const { return {nullptr, 0}; }
};

// ---- the ordered emit rule ----------------------------------------------------------------------
// In position order, a key is kept if it is above the threshold, or tied with it and fewer than
// `ties` tied keys precede it (radix_keep, applied sequentially, is this rule). With the counts of
// the keys before it, packed as (above << 32) | tied, every key decides independently: kept or not,
// and its output slot = above_before + min(tied_before, ties). A block-wide exclusive sum of the
// packed flags gives every thread its "before"; chunks of a row add the totals of the chunks before
// them. Counts within a row stay below 2^31, so the halves never carry into each other.

/// (1 << 32) for a key above the threshold, 1 for a tied key, 0 below.
KVEVICT_HOST_DEVICE inline ucount emit_flag(std::uint32_t key, const radix_threshold& t) noexcept {
  const int c = radix_compare(key, t);
  return c > 0 ? (ucount(1) << 32) : c == 0 ? ucount(1) : ucount(0);
}
/// Kept keys among those counted in `packed`.
KVEVICT_HOST_DEVICE inline index_t emit_count(ucount packed, index_t ties) noexcept {
  return static_cast<index_t>(packed >> 32) + imin(static_cast<index_t>(packed & 0xffffffffu), ties);
}
/// Whether the key with flag `flag`, preceded by keys whose packed counts are `before`, is kept;
/// `slot` receives its output index (meaningful only when kept).
KVEVICT_HOST_DEVICE inline bool emit_keep(ucount before, ucount flag, index_t ties, index_t& slot) noexcept {
  const index_t tied_before = static_cast<index_t>(before & 0xffffffffu);
  slot = static_cast<index_t>(before >> 32) + imin(tied_before, ties);
  return (flag >> 32) != 0 || (flag != 0 && tied_before < ties);
}

// ---- block-wide building blocks -----------------------------------------------------------------

template <class Block, class U>
KVEVICT_HOST_DEVICE void block_fill(Block& blk, U* p, index_t n, U value) {
  blk.each([&](int tid) {
    for (index_t i = tid; i < n; i += blk.size()) {
      blk.plain_write(p + i, sizeof(U));
      p[i] = value;
    }
  });
}

/// hist[digit(key, pass)] += 1 for every key of [begin, end) with counts(key) (striped: thread t
/// reads keys begin + t, begin + t + size, ...).
template <class Block, class Keys, class Pred>
KVEVICT_HOST_DEVICE void block_histogram(Block& blk, const Keys& keys, index_t begin, index_t end, const Pred& counts,
                                         int pass, std::uint32_t* hist) {
  blk.each([&](int tid) {
    for (index_t i = begin + tid; i < end; i += blk.size()) {
      const std::uint32_t key = block_key(blk, keys, i);
      if (counts(key)) blk.atomic_add(&hist[radix_digit(key, pass)], 1u);
    }
  });
}

/// The bucket holding the k-th best candidate of a histogram of `bins` bins, chosen in parallel:
/// thread t owns a run of bins, the highest run going to thread 0; an exclusive sum over the runs'
/// totals gives each thread the candidates above its run, and the one thread whose run holds the
/// k-th candidate (radix_bucket_holds) stores it in sm. `load(b)` reads bin b. Same result as
/// radix_choose_bucket. 1 <= k <= the histogram's total.
template <class Block, class Load>
KVEVICT_HOST_DEVICE radix_bucket block_choose(Block& blk, const Load& load, int bins, index_t k, select_smem& sm) {
  const int per = (bins + blk.size() - 1) / blk.size();
  blk.exclusive_sum(
      [&](int tid) {
        const int hi = bins - tid * per, lo = hi - per > 0 ? hi - per : 0;
        ucount s = 0;
        for (int b = hi - 1; b >= lo; --b) s += static_cast<ucount>(load(b));
        return s;
      },
      [&](int tid, ucount, ucount prefix, ucount) {
        const int hi = bins - tid * per, lo = hi - per > 0 ? hi - per : 0;
        index_t above = static_cast<index_t>(prefix);
        for (int b = hi - 1; b >= lo; --b) {
          const index_t c = static_cast<index_t>(load(b));
          if (radix_bucket_holds(static_cast<std::uint32_t>(b), above, c, k)) {
            blk.plain_write(&sm.bucket, sizeof(sm.bucket));
            blk.plain_write(&sm.above, sizeof(sm.above));
            blk.plain_write(&sm.count, sizeof(sm.count));
            sm.bucket = static_cast<std::uint32_t>(b);
            sm.above = above;
            sm.count = c;
          }
          above += c;
        }
      });
  blk.plain_read(&sm.bucket, sizeof(sm.bucket));  // every thread (uniform), after the sum's barrier
  blk.plain_read(&sm.above, sizeof(sm.above));
  blk.plain_read(&sm.count, sizeof(sm.count));
  radix_bucket r;
  r.bucket = sm.bucket;
  r.above = sm.above;
  r.count = sm.count;
  return r;
}

/// Block-wide sum of v(tid) (uniform result).
template <class Block, class V>
KVEVICT_HOST_DEVICE ucount block_sum(Block& blk, const V& v) {
  ucount result = 0;
  blk.exclusive_sum(v, [&](int, ucount, ucount, ucount total) { result = total; });
  return result;
}

/// Packed (above, tied) counts of the keys of [begin, end) against t (uniform result).
template <class Block, class Keys>
KVEVICT_HOST_DEVICE ucount block_count(Block& blk, const Keys& keys, index_t begin, index_t end,
                                       const radix_threshold& t) {
  return block_sum(blk, [&](int tid) {
    ucount s = 0;
    for (index_t i = begin + tid; i < end; i += blk.size()) s += emit_flag(block_key(blk, keys, i), t);
    return s;
  });
}

/// The ordered emit over positions [begin, end): writes out(slot, position) for every kept key, in
/// tiles of size x emit_items keys (thread t takes 8 consecutive keys of the tile; one exclusive
/// sum of the packed flags per tile). `running` = packed counts of the row's keys before `begin`.
/// Stops once `limit` positions are out (slots >= limit are never written). With `stage` non-null
/// the tile's keys are first copied there (coalesced reads, padded layout); otherwise keys() is
/// read in the blocked order directly (keys already in shared memory).
template <class Block, class Keys, class Out>
KVEVICT_HOST_DEVICE void block_emit(Block& blk, const Keys& keys, index_t begin, index_t end, const radix_threshold& t,
                                    index_t ties, const Out& out, index_t limit, ucount running,
                                    std::uint32_t* stage) {
  const index_t tile = index_t(blk.size()) * emit_items;
  for (index_t base = begin; base < end; base += tile) {
    if (emit_count(running, ties) >= limit) break;
    const index_t n = imin(tile, end - base);
    if (stage != nullptr) {
      blk.each([&](int tid) {
        for (index_t i = tid; i < n; i += blk.size()) {
          const std::uint32_t key = block_key(blk, keys, base + i);
          blk.plain_write(stage + smem_pad(i), sizeof(std::uint32_t));
          stage[smem_pad(i)] = key;
        }
      });
      blk.sync();
    }
    const auto key_at = [&](index_t i) {
      if (stage == nullptr) return block_key(blk, keys, base + i);
      blk.plain_read(stage + smem_pad(i), sizeof(std::uint32_t));
      return stage[smem_pad(i)];
    };
    ucount tile_total = 0;
    blk.exclusive_sum(
        [&](int tid) {
          ucount s = 0;
          for (index_t j = 0; j < emit_items; ++j) {
            const index_t i = index_t(tid) * emit_items + j;
            if (i < n) s += emit_flag(key_at(i), t);
          }
          return s;
        },
        [&](int tid, ucount, ucount prefix, ucount total) {
          ucount before = running + prefix;
          for (index_t j = 0; j < emit_items; ++j) {
            const index_t i = index_t(tid) * emit_items + j;
            if (i >= n) break;
            const ucount f = emit_flag(key_at(i), t);
            index_t slot = 0;
            if (emit_keep(before, f, ties, slot) && slot < limit) out(slot, base + i);
            before += f;
          }
          tile_total = total;
        });
    running += tile_total;
  }
}

/// Every position of [begin, end) kept: out(position, position).
template <class Block, class Out>
KVEVICT_HOST_DEVICE void block_emit_all(Block& blk, index_t begin, index_t end, const Out& out) {
  blk.each([&](int tid) {
    for (index_t i = begin + tid; i < end; i += blk.size()) out(i, i);
  });
}

// ---- one block per row ----------------------------------------------------------------------------

/// Radix passes of one row by one block: histograms in shared memory, bucket choice, narrowing,
/// until the threshold is decided. Returns the final state.
template <class Block, class Keys>
KVEVICT_HOST_DEVICE row_state block_threshold(Block& blk, const Keys& keys, row_state s, bool full_key,
                                              select_smem& sm) {
  for (int pass = 0; pass < radix_passes && !s.done; ++pass) {
    const int bins = radix_pass_bins(pass);
    block_fill(blk, sm.hist, bins, 0u);
    blk.sync();
    const radix_threshold t = s.t;
    block_histogram(blk, keys, 0, s.n, [t](std::uint32_t key) { return radix_tied(key, t); }, pass, sm.hist);
    blk.sync();
    const radix_bucket b = block_choose(
        blk,
        [&](int bin) {
          blk.plain_read(&sm.hist[bin], sizeof(std::uint32_t));
          return sm.hist[bin];
        },
        bins, s.t.ties, sm);
    row_narrow(s, pass, b, full_key);
  }
  return s;
}

/// Top-k of one row by one block. Rows of at most key_cache_keys keys are read from memory once
/// into shared memory (sm.keys); longer rows are re-read for every pass and the emit. With
/// `emit`, the kept positions go to out in ascending order; the final state is returned (the
/// flattened selection keeps it: floors). `scores` gives the row's keys from memory.
template <class Block, class Out>
KVEVICT_HOST_DEVICE row_state block_select_row(Block& blk, const score_keys& scores, row_state s, bool full_key,
                                               bool emit, const Out& out, select_smem& sm) {
  if (s.mode == row_all && emit) block_emit_all(blk, 0, s.n, out);
  if (s.mode != row_select) return s;
  if (s.n <= key_cache_keys) {
    blk.each([&](int tid) {
      for (index_t i = tid; i < s.n; i += blk.size()) {
        blk.plain_write(&sm.keys[smem_pad(i)], sizeof(std::uint32_t));
        sm.keys[smem_pad(i)] = scores(i);
      }
    });
    blk.sync();
    const cached_keys keys{sm.keys, 0};
    s = block_threshold(blk, keys, s, full_key, sm);
    if (emit) block_emit(blk, keys, 0, s.n, s.t, s.t.ties, out, s.k, 0, nullptr);
  } else {
    s = block_threshold(blk, scores, s, full_key, sm);
    if (emit) block_emit(blk, scores, 0, s.n, s.t, s.t.ties, out, s.k, 0, sm.keys);
  }
  return s;
}

// ---- several blocks per row (long rows) -------------------------------------------------------------
// The row is cut into chunks of `chunk` positions, one block per (row, chunk). Every pass: each
// chunk's block histograms its keys tied with the row's threshold in shared memory and adds the
// non-zero bins to the row's histogram in global memory (atomics: integer sums, the order does
// not matter); the block that finishes last (a ticket per row and pass) chooses the bucket from the
// global histogram and stores the narrowed state. Then each chunk counts its (above, tied) keys,
// and the emit of chunk c starts from the sum of the counts of chunks < c. The functions below are
// the per-block parts; the tickets and kernel boundaries are in kvevict/cuda/select.cuh.

/// Chunk c of a row of n positions: [c * chunk, min(n, (c + 1) * chunk)) (empty past the end).
KVEVICT_HOST_DEVICE inline void chunk_range(index_t n, index_t chunk, index_t c, index_t& begin, index_t& end) noexcept {
  begin = imin(n, c * chunk);
  end = imin(n, begin + chunk);
}

/// One chunk's part of a pass: histogram of [begin, end)'s keys tied with s.t, added to row_hist.
template <class Block, class Keys>
KVEVICT_HOST_DEVICE void chunk_histogram(Block& blk, const Keys& keys, index_t begin, index_t end, const row_state& s,
                                         int pass, select_smem& sm, std::uint32_t* row_hist) {
  const int bins = radix_pass_bins(pass);
  block_fill(blk, sm.hist, bins, 0u);
  blk.sync();
  const radix_threshold t = s.t;
  block_histogram(blk, keys, begin, end, [t](std::uint32_t key) { return radix_tied(key, t); }, pass, sm.hist);
  blk.sync();
  blk.each([&](int tid) {
    for (int b = tid; b < bins; b += blk.size()) {
      blk.plain_read(&sm.hist[b], sizeof(std::uint32_t));
      if (sm.hist[b] != 0) blk.atomic_add(&row_hist[b], sm.hist[b]);
    }
  });
}

/// The last chunk's block of a pass: bucket choice from the row's merged histogram (read with
/// load(bin)), narrowing. Returns the new state.
template <class Block, class Load>
KVEVICT_HOST_DEVICE row_state chunk_finish_pass(Block& blk, const Load& load, row_state s, int pass, bool full_key,
                                                select_smem& sm) {
  const radix_bucket b = block_choose(blk, load, radix_pass_bins(pass), s.t.ties, sm);
  row_narrow(s, pass, b, full_key);
  return s;
}

/// The emit of one chunk, `before` = the packed counts of the chunks before it.
template <class Block, class Keys, class Out>
KVEVICT_HOST_DEVICE void chunk_emit(Block& blk, const Keys& keys, index_t begin, index_t end, const row_state& s,
                                    ucount before, const Out& out, select_smem& sm) {
  if (s.mode == row_all) block_emit_all(blk, begin, end, out);
  if (s.mode != row_select) return;
  block_emit(blk, keys, begin, end, s.t, s.t.ties, out, s.k, before, sm.keys);
}

// ---- the flattened (layer-wise) selection -----------------------------------------------------
// Same steps as the host's select_flat (detail/host/select_host.hpp), with the same per-row quantities:
// floors as full-key thresholds (one row_state per row, from the selection above), then three
// passes over the remaining entries of the layer with one histogram per row and their sum, then
// per-row counts (the layer's tied entries go to the lowest rows first) and one emit per row.

/// flat_dev_row::mode
enum : int { flat_mode_none = 0, flat_mode_whole = 1, flat_mode_key = 2 };

/// Per-row state of the flattened selection (plain aggregate: lives in the workspace).
struct flat_dev_row {
  int mode;                  ///< no floor, the whole row is the floor, or a floor threshold
  int bad;                   ///< row length or floor out of range
  std::uint32_t floor_key;   ///< flat_mode_key: the floor keeps keys > floor_key ...
  std::uint32_t emit_key;    ///< final: keys > emit_key and the first emit_ties == emit_key
  index_t n, floor;
  index_t floor_ties;        ///< ... and the first floor_ties keys == floor_key
  index_t floor_tied;        ///< keys == floor_key in the row
  index_t rem_above;         ///< remaining keys above the layer threshold
  index_t rem_tied;          ///< remaining keys equal to the layer threshold
  index_t count;             ///< tokens kept
  index_t emit_ties, emit_tied;
};

/// Layer-wide state (workspace). Sums and the bad-row count are accumulated with atomics.
struct flat_dev_layer {
  ucount sum_len, sum_floor;
  int bad_rows;  ///< rows whose length or floor is out of range
  int pad_;
  radix_threshold g[radix_passes + 1];  ///< the layer threshold before pass p; g[radix_passes] final
  std::uint32_t bucket[radix_passes];   ///< the bucket chosen by pass p
};

/// A row of the flattened selection from its length, floor and (flat_mode_key) floor threshold.
KVEVICT_HOST_DEVICE inline flat_dev_row flat_row_from(index_t n, index_t floor, bool ok, const row_state& floor_state) noexcept {
  flat_dev_row f{};
  f.bad = ok ? 0 : 1;
  f.n = ok ? n : 0;
  f.floor = ok ? floor : 0;
  f.mode = f.floor == 0 ? flat_mode_none : f.floor == f.n ? flat_mode_whole : flat_mode_key;
  if (f.mode == flat_mode_key) {
    f.floor_key = floor_state.t.prefix;
    f.floor_ties = floor_state.t.ties;
    f.floor_tied = floor_state.tied;
  }
  return f;
}

/// Remaining entries of a row are its keys below this limit (2^32: every key), plus
/// flat_floor_extra keys equal to floor_key.
KVEVICT_HOST_DEVICE inline ucount flat_limit(const flat_dev_row& f) noexcept {
  return f.mode == flat_mode_none ? (ucount(1) << 32) : f.mode == flat_mode_whole ? ucount(0) : ucount(f.floor_key);
}
KVEVICT_HOST_DEVICE inline index_t flat_floor_extra(const flat_dev_row& f) noexcept {
  return f.mode == flat_mode_key ? f.floor_tied - f.floor_ties : 0;
}

/// Whether the layer's arguments are consistent (every row valid, sum(floors) <= total <= sum of
/// lengths), and the entries left after the floors.
KVEVICT_HOST_DEVICE inline bool flat_layer_ok(const flat_dev_layer& L, index_t total, index_t& extra) noexcept {
  extra = total - static_cast<index_t>(L.sum_floor);
  return L.bad_rows == 0 && static_cast<ucount>(total) <= L.sum_len && L.sum_floor <= static_cast<ucount>(total);
}

/// One chunk of one row, layer pass p: histogram of its remaining keys tied with g, added to the
/// row's histogram and to the layer's.
template <class Block, class Keys>
KVEVICT_HOST_DEVICE void flat_chunk_histogram(Block& blk, const Keys& keys, index_t begin, index_t end,
                                              const flat_dev_row& f, const radix_threshold& g, int pass, select_smem& sm,
                                              std::uint32_t* row_hist, ucount* layer_hist) {
  const int bins = radix_pass_bins(pass);
  block_fill(blk, sm.hist, bins, 0u);
  blk.sync();
  const ucount limit = flat_limit(f);
  if (limit != 0) {
    const radix_threshold t = g;
    block_histogram(blk, keys, begin, end,
                    [t, limit](std::uint32_t key) { return ucount(key) < limit && radix_tied(key, t); }, pass, sm.hist);
  }
  blk.sync();
  blk.each([&](int tid) {
    for (int b = tid; b < bins; b += blk.size()) {
      blk.plain_read(&sm.hist[b], sizeof(std::uint32_t));
      if (sm.hist[b] != 0) {
        blk.atomic_add(&row_hist[b], sm.hist[b]);
        blk.atomic_add(&layer_hist[b], static_cast<ucount>(sm.hist[b]));
      }
    }
  });
}

/// The last block of layer pass p, whose threshold so far is g: the layer histogram (load(b)) plus
/// the floor-tied entries the floors did not take, counted arithmetically; bucket choice; thread 0
/// stores g[p], g[p + 1] and bucket[p]. The merged histogram lives in sm.merged.
template <class Block, class Load>
KVEVICT_HOST_DEVICE void flat_finish_pass(Block& blk, const Load& load, const flat_dev_row* rows, index_t R, int pass,
                                          const radix_threshold& g, flat_dev_layer& L, select_smem& sm) {
  const int bins = radix_pass_bins(pass);
  ucount* merged = sm.merged;
  blk.each([&](int tid) {
    for (int b = tid; b < bins; b += blk.size()) {
      const ucount v = static_cast<ucount>(load(b));
      blk.plain_write(merged + b, sizeof(ucount));
      merged[b] = v;
    }
  });
  blk.sync();
  blk.each([&](int tid) {
    for (index_t r = tid; r < R; r += blk.size()) {
      const index_t extra = flat_floor_extra(rows[r]);
      if (extra > 0 && radix_tied(rows[r].floor_key, g))
        blk.atomic_add(&merged[radix_digit(rows[r].floor_key, pass)], static_cast<ucount>(extra));
    }
  });
  blk.sync();
  const radix_bucket b = block_choose(
      blk,
      [&](int bin) {
        blk.plain_read(merged + bin, sizeof(ucount));
        return merged[bin];
      },
      bins, g.ties, sm);
  radix_threshold next = g;
  radix_narrow(next, pass, b, g.ties, true);
  blk.each([&](int tid) {
    if (tid == 0) {
      L.g[pass] = g;
      L.g[pass + 1] = next;
      L.bucket[pass] = b.bucket;
    }
  });
}

/// After the three layer passes: row r's remaining keys above the layer threshold and equal to it,
/// from its three histograms (hist(p, bin)) and the floor-tied entries.
template <class Block, class Hist>
KVEVICT_HOST_DEVICE void flat_row_totals(Block& blk, const Hist& hist, const flat_dev_layer& L, flat_dev_row& f) {
  const index_t extra = flat_floor_extra(f);
  index_t above = 0;
  for (int p = 0; p < radix_passes; ++p) {
    const int bins = radix_pass_bins(p);
    const int first = static_cast<int>(L.bucket[p]) + 1;
    above += static_cast<index_t>(block_sum(blk, [&](int tid) {
      ucount s = 0;
      for (int b = first + tid; b < bins; b += blk.size()) s += hist(p, b);
      return s;
    }));
    if (extra > 0 && radix_tied(f.floor_key, L.g[p]) && radix_digit(f.floor_key, p) > L.bucket[p]) above += extra;
  }
  index_t tied = static_cast<index_t>(hist(radix_passes - 1, static_cast<int>(L.bucket[radix_passes - 1])));
  if (extra > 0 && f.floor_key == L.g[radix_passes].prefix) tied += extra;
  blk.each([&](int tid) {
    if (tid == 0) {
      f.rem_above = above;
      f.rem_tied = tied;
    }
  });
}

/// Final count and emit threshold of a row, given the layer's tied entries taken by the rows
/// before it (host: step 3 of select_flat).
KVEVICT_HOST_DEVICE inline void flat_row_count(flat_dev_row& f, bool layer_pass, const radix_threshold& g,
                                               index_t ties_before) noexcept {
  const index_t rem_above = layer_pass ? f.rem_above : 0, rem_tied = layer_pass ? f.rem_tied : 0;
  const index_t left = layer_pass ? g.ties - ties_before : 0;
  const index_t take = imax(0, imin(rem_tied, left));
  const index_t gained = rem_above + take;
  f.count = f.floor + gained;
  if (gained > 0) {
    const bool at_floor = f.mode == flat_mode_key && f.floor_key == g.prefix;
    const index_t floor_above = f.mode != flat_mode_key ? 0 : at_floor ? f.floor - f.floor_ties : f.floor;
    f.emit_key = g.prefix;
    f.emit_ties = f.count - (rem_above + floor_above);
    f.emit_tied = rem_tied + (at_floor ? f.floor_ties : 0);
  } else {
    f.emit_key = f.floor_key;
    f.emit_ties = f.floor_ties;
    f.emit_tied = f.floor_tied;
  }
}

/// Counts of every row and the offsets cu[R + 1], by one block (rows in tiles of size()): an
/// exclusive sum of rem_tied hands the layer's tied entries to the lowest rows, a second one of
/// the counts gives the offsets. With !ok (device-detected bad arguments) every count is 0.
template <class Block>
KVEVICT_HOST_DEVICE void flat_counts(Block& blk, flat_dev_row* rows, index_t R, bool ok, bool layer_pass,
                                     const radix_threshold& g, std::int32_t* cu) {
  blk.each([&](int tid) {
    if (tid == 0) cu[0] = 0;
  });
  ucount tied_run = 0, count_run = 0;
  for (index_t base = 0; base < R; base += blk.size()) {
    ucount tile_tied = 0, tile_count = 0;
    blk.exclusive_sum(
        [&](int tid) {
          const index_t r = base + tid;
          return r < R && layer_pass ? static_cast<ucount>(rows[r].rem_tied) : ucount(0);
        },
        [&](int tid, ucount, ucount prefix, ucount total) {
          const index_t r = base + tid;
          if (r < R && ok) flat_row_count(rows[r], layer_pass, g, static_cast<index_t>(tied_run + prefix));
          if (r < R && !ok) rows[r].count = 0;  // nothing is emitted
          tile_tied = total;
        });
    blk.exclusive_sum(
        [&](int tid) {
          const index_t r = base + tid;
          return r < R && ok ? static_cast<ucount>(rows[r].count) : ucount(0);
        },
        [&](int tid, ucount own, ucount prefix, ucount total) {
          const index_t r = base + tid;
          if (r < R) cu[r + 1] = static_cast<std::int32_t>(count_run + prefix + own);
          tile_count = total;
        });
    tied_run += tile_tied;
    count_run += tile_count;
  }
}

/// The row_state of a row's final emit in the flattened selection.
KVEVICT_HOST_DEVICE inline row_state flat_emit_state(const flat_dev_row& f) noexcept {
  if (f.count == f.n || f.count == 0) return row_begin(f.n, f.count, true);
  return row_given(f.n, f.count, f.emit_key, f.emit_ties, f.emit_tied);
}

// ---- how a call runs, and its workspace -----------------------------------------------------------

/// How the CUDA selection runs a call. A function of R and T only (and the options), so the
/// workspace size is too.
struct select_plan {
  bool multi;      ///< several blocks per row
  index_t chunk;   ///< positions per chunk (a multiple of the emit tile)
  index_t chunks;  ///< chunks per row (1 for one block per row)
};

inline constexpr index_t multi_min_columns = 32768;  ///< auto: multi-block only for rows this long ...
inline constexpr index_t multi_max_rows = 128;       ///< ... and fewer rows than this (not enough to fill a GPU)
inline constexpr index_t multi_target_blocks = 512;  ///< blocks aimed at in a multi-block pass (~4 per SM)
inline constexpr index_t multi_min_chunk = 8192;     ///< smallest chunk worth a block

/// Chunks of T positions for R rows: about multi_target_blocks blocks in all, chunks of at least
/// multi_min_chunk positions, rounded up to whole emit tiles.
inline select_plan plan_chunks(index_t R, index_t T) noexcept {
  const index_t tile = index_t(select_block_threads) * emit_items;
  select_plan p{true, tile, 1};
  if (T <= 0) return p;
  const index_t want = imax(1, (multi_target_blocks + imax(R, 1) - 1) / imax(R, 1));
  const index_t most = imax(1, (T + multi_min_chunk - 1) / multi_min_chunk);
  const index_t c = imin(want, most);
  p.chunk = ((T + c - 1) / c + tile - 1) / tile * tile;
  p.chunks = (T + p.chunk - 1) / p.chunk;
  return p;
}

/// algo: 0 = automatic (multi-block iff T >= multi_min_columns and R < multi_max_rows),
/// 1 = one block per row, 2 = several blocks per row.
inline select_plan plan_select(index_t R, index_t T, int algo) noexcept {
  const bool multi = algo == 2 || (algo == 0 && T >= multi_min_columns && R < multi_max_rows);
  if (!multi) return select_plan{false, T, 1};
  return plan_chunks(R, T);
}

/// Device workspace of select_topk(cuda): pointers into the caller's buffer (null on a query).
/// [zero_begin, zero_begin + zero_bytes) must be zeroed before the kernels run.
struct select_dev_ws {
  int* counter = nullptr;            ///< rows skipped (counted when the caller asks to synchronise)
  std::uint32_t* hist = nullptr;     ///< multi: [radix_passes][R][radix_bins] row histograms
  unsigned* tickets = nullptr;       ///< multi: [radix_passes][R] chunks done
  row_state* states = nullptr;       ///< multi (and the flattened selection's floors): [R]
  ucount* counts = nullptr;          ///< multi: [R][chunks] packed counts per chunk
  void* zero_begin = nullptr;
  std::size_t zero_bytes = 0;
};

namespace select_ws_detail {
inline void* at(const workspace& ws, std::size_t offset) noexcept {
  return ws.is_query() ? nullptr : static_cast<unsigned char*>(ws.data) + offset;
}
}  // namespace select_ws_detail

/// Layout: counter, then (multi) histograms and tickets: the zeroed part; then states and counts.
/// `states` is carved for multi plans, or always when `with_states`.
inline select_dev_ws carve_select_dev_ws(workspace_carver& c, const workspace& ws, index_t R, const select_plan& p,
                                         bool with_states) noexcept {
  select_dev_ws w;
  const auto r = static_cast<std::size_t>(R);
  w.counter = c.take<int>(1);
  const std::size_t zero_from = c.used() - sizeof(int);
  if (p.multi) {
    w.hist = c.take<std::uint32_t>(static_cast<std::size_t>(radix_passes) * r * radix_bins);
    w.tickets = c.take<unsigned>(static_cast<std::size_t>(radix_passes) * r);
  }
  w.zero_begin = select_ws_detail::at(ws, zero_from);
  w.zero_bytes = c.used() - zero_from;
  if (p.multi || with_states) w.states = c.take<row_state>(r);
  if (p.multi) w.counts = c.take<ucount>(r * static_cast<std::size_t>(p.chunks));
  return w;
}

/// Device workspace of select_topk_flat(cuda).
struct flat_dev_ws {
  select_dev_ws sel;                      ///< counter, the floors' states (and multi-block scratch)
  flat_dev_layer* layer = nullptr;            ///< zeroed
  std::uint32_t* row_hist = nullptr;      ///< [radix_passes][R][radix_bins], zeroed
  ucount* layer_hist = nullptr;           ///< [radix_passes][radix_bins], zeroed
  unsigned long long* tickets = nullptr;  ///< [radix_passes], zeroed
  flat_dev_row* rows = nullptr;               ///< [R]
  select_plan layer_plan{};               ///< chunks of the layer passes
};

/// Layout: counter, layer state, row and layer histograms, tickets, (multi) the floors'
/// histograms and tickets: the zeroed part; then states, rows, (multi) chunk counts.
inline flat_dev_ws carve_flat_dev_ws(workspace_carver& c, const workspace& ws, index_t R, index_t T,
                                     const select_plan& p) noexcept {
  flat_dev_ws w;
  const auto r = static_cast<std::size_t>(R);
  w.layer_plan = plan_chunks(R, T);
  w.sel.counter = c.take<int>(1);
  const std::size_t zero_from = c.used() - sizeof(int);
  w.layer = c.take<flat_dev_layer>(1);
  w.row_hist = c.take<std::uint32_t>(static_cast<std::size_t>(radix_passes) * r * radix_bins);
  w.layer_hist = c.take<ucount>(static_cast<std::size_t>(radix_passes) * radix_bins);
  w.tickets = c.take<unsigned long long>(radix_passes);
  if (p.multi) {
    w.sel.hist = c.take<std::uint32_t>(static_cast<std::size_t>(radix_passes) * r * radix_bins);
    w.sel.tickets = c.take<unsigned>(static_cast<std::size_t>(radix_passes) * r);
  }
  w.sel.zero_begin = select_ws_detail::at(ws, zero_from);
  w.sel.zero_bytes = c.used() - zero_from;
  w.sel.states = c.take<row_state>(r);
  w.rows = c.take<flat_dev_row>(r);
  if (p.multi) w.sel.counts = c.take<ucount>(r * static_cast<std::size_t>(p.chunks));
  return w;
}

/// The flattened selection's final emit: thresholds given by the layer passes.
struct flat_emit_rows {
  const flat_dev_row* rows;
  const std::int32_t* cu;
  pos_t* pos;
  KVEVICT_HOST_DEVICE row_state state(index_t r) const { return flat_emit_state(rows[r]); }
  KVEVICT_HOST_DEVICE pos_out out(index_t r) const { return {pos + cu[r], 1}; }
};

/// A row description whose states were stored by the multi-block passes (rows that place their
/// own keys, keys(scores, r) and count(scores), keep doing so).
template <class Rows>
struct stored_rows {
  Rows rows;
  const row_state* states;
  KVEVICT_HOST_DEVICE row_state state(index_t r) const { return states[r]; }
  KVEVICT_HOST_DEVICE pos_out out(index_t r) const { return rows.out(r); }
  template <class S, class R = Rows>
  KVEVICT_HOST_DEVICE auto keys(const S& scores, index_t r) const -> decltype(std::declval<const R&>().keys(scores, r)) {
    return rows.keys(scores, r);
  }
  template <class S, class R = Rows>
  KVEVICT_HOST_DEVICE auto count(const S& scores) const -> decltype(std::declval<const R&>().count(scores)) {
    return rows.count(scores);
  }
};

// ---- kernel bodies ----------------------------------------------------------------------------------
// What one block does for one work item; the kernels (kvevict/cuda/select.cuh) add only the
// grid-stride loops, the tickets, fences and barriers between items. The host emulation test
// runs the same functions with the items in random order.

/// Row r by one block (select_one_block_kernel). Returns the final state (row_bad: skipped).
template <class Block, class Rows>
KVEVICT_HOST_DEVICE row_state one_block_row(Block& blk, const score_keys& keys, const Rows& rows, index_t r,
                                            bool full_key, bool emit, row_state* states, select_smem& sm) {
  const row_state s = block_select_row(blk, keys, rows.state(r), full_key, emit, rows.out(r), sm);
  if (states != nullptr) blk.each([&](int tid) {
      if (tid == 0) states[r] = s;
    });
  return s;
}

/// The state of row r at the start of a multi-block pass.
template <class Rows>
KVEVICT_HOST_DEVICE row_state multi_state(const Rows& rows, const select_dev_ws& w, index_t r, int pass) {
  return pass == 0 ? rows.state(r) : w.states[r];
}

/// Chunk c of row r, pass `pass`: histogram into the row's global histogram. Returns true when
/// the block worked on the row (it then takes the row's ticket; the last one calls
/// multi_pass_finish). A row with nothing to search takes no ticket; in pass 0 its chunk 0 stores
/// its state and reports a bad row in `bad_row`.
template <class Block, class Rows>
KVEVICT_HOST_DEVICE bool multi_pass_chunk(Block& blk, const score_keys& keys, const Rows& rows, const select_dev_ws& w,
                                          const select_plan& plan, index_t R, index_t r, index_t c, int pass,
                                          select_smem& sm, bool& bad_row) {
  const row_state s = multi_state(rows, w, r, pass);
  bad_row = false;
  if (s.done) {
    if (pass == 0 && c == 0) {
      blk.each([&](int tid) {
        if (tid == 0) w.states[r] = s;
      });
      bad_row = s.mode == row_bad;
    }
    return false;
  }
  index_t begin = 0, end = 0;
  chunk_range(s.n, plan.chunk, c, begin, end);
  chunk_histogram(blk, keys, begin, end, s, pass, sm, w.hist + (index_t(pass) * R + r) * radix_bins);
  return true;
}

/// The last chunk of row r in pass `pass`: bucket choice from the merged histogram (load(bin)),
/// the new state stored.
template <class Block, class Rows, class Load>
KVEVICT_HOST_DEVICE void multi_pass_finish(Block& blk, const Load& load, const Rows& rows, const select_dev_ws& w,
                                           index_t r, int pass, bool full_key, select_smem& sm) {
  const row_state s = chunk_finish_pass(blk, load, multi_state(rows, w, r, pass), pass, full_key, sm);
  blk.each([&](int tid) {
    if (tid == 0) w.states[r] = s;
  });
}

/// Chunk c of row r: its packed (above, tied) counts into w.counts.
template <class Block, class Rows>
KVEVICT_HOST_DEVICE void multi_count_chunk(Block& blk, const score_keys& keys, const Rows& rows, const select_dev_ws& w,
                                           const select_plan& plan, index_t r, index_t c) {
  const row_state s = rows.state(r);
  if (s.mode != row_select) return;
  index_t begin = 0, end = 0;
  chunk_range(s.n, plan.chunk, c, begin, end);
  const ucount n = block_count(blk, keys, begin, end, s.t);
  blk.each([&](int tid) {
    if (tid == 0) w.counts[r * plan.chunks + c] = n;
  });
}

/// Chunk c of row r: the ordered emit, after the counts of chunks 0 .. c-1.
template <class Block, class Rows>
KVEVICT_HOST_DEVICE void multi_emit_chunk(Block& blk, const score_keys& keys, const Rows& rows, const select_dev_ws& w,
                                          const select_plan& plan, index_t r, index_t c, select_smem& sm) {
  const row_state s = rows.state(r);
  if (s.mode != row_select && s.mode != row_all) return;
  ucount before = 0;
  if (s.mode == row_select) {
    const ucount* counts = w.counts + r * plan.chunks;
    before = block_sum(blk, [&](int tid) {
      ucount v = 0;
      for (index_t i = tid; i < c; i += blk.size()) v += counts[i];
      return v;
    });
  }
  index_t begin = 0, end = 0;
  chunk_range(s.n, plan.chunk, c, begin, end);
  chunk_emit(blk, keys, begin, end, s, before, rows.out(r), sm);
}

/// Row r of the flattened selection from its (device-resident) length and floor and, for floors
/// strictly inside the row, its floor threshold; bad = 1 when the length or floor is out of range.
KVEVICT_HOST_DEVICE inline flat_dev_row flat_row_at(const std::int32_t* lengths, index_t T, const std::int32_t* floors,
                                                    const row_state* floor_states, index_t r) {
  const index_t n = lengths != nullptr ? index_t(lengths[r]) : T, f = floors != nullptr ? index_t(floors[r]) : 0;
  const bool ok = row_length_ok(n, T) && f >= 0 && f <= n;
  const bool has_floor = floors != nullptr && ok && f > 0 && f < n;
  return flat_row_from(n, f, ok, has_floor ? floor_states[r] : row_begin(0, 0, true));
}

/// The layer threshold at the start of pass `pass` (false: nothing to do, the arguments are bad or
/// the floors take everything).
KVEVICT_HOST_DEVICE inline bool flat_pass_threshold(const flat_dev_layer& L, index_t total, int pass,
                                                    radix_threshold& g) {
  index_t extra = 0;
  if (!flat_layer_ok(L, total, extra) || extra == 0) return false;
  if (pass == 0) {
    g.mask = 0;
    g.prefix = 0;
    g.ties = extra;
  } else {
    g = L.g[pass];
  }
  return true;
}

/// Chunk c of row r, layer pass `pass` (every item takes the pass's ticket afterwards).
template <class Block>
KVEVICT_HOST_DEVICE void flat_layer_chunk(Block& blk, const score_keys& keys, const flat_dev_ws& w, index_t R, index_t r,
                                          index_t c, const radix_threshold& g, int pass, select_smem& sm) {
  const flat_dev_row f = w.rows[r];
  index_t begin = 0, end = 0;
  chunk_range(f.n, w.layer_plan.chunk, c, begin, end);
  flat_chunk_histogram(blk, keys, begin, end, f, g, pass, sm, w.row_hist + (index_t(pass) * R + r) * radix_bins,
                       w.layer_hist + index_t(pass) * radix_bins);
}

/// Row totals from the row's three histograms (plain reads: written by earlier kernels).
template <class Block>
KVEVICT_HOST_DEVICE void flat_row_totals_of(Block& blk, const flat_dev_ws& w, index_t R, index_t r) {
  const std::uint32_t* h = w.row_hist;
  flat_row_totals(blk, [h, r, R](int p, int b) { return h[(index_t(p) * R + r) * radix_bins + b]; }, *w.layer,
                  w.rows[r]);
}

/// The one-block counts step: counts, offsets; returns the number to report as bad (0 if fine).
template <class Block>
KVEVICT_HOST_DEVICE int flat_counts_of(Block& blk, const flat_dev_ws& w, index_t R, index_t total, std::int32_t* cu) {
  index_t extra = 0;
  const bool ok = flat_layer_ok(*w.layer, total, extra);
  const bool layer_pass = ok && extra > 0;
  radix_threshold g;
  g.mask = 0;
  g.prefix = 0;
  g.ties = 0;
  if (layer_pass) g = w.layer->g[radix_passes];
  flat_counts(blk, w.rows, R, ok, layer_pass, g, cu);
  return ok ? 0 : w.layer->bad_rows > 0 ? w.layer->bad_rows : 1;
}

}  // namespace kvevict::detail
