// The CUDA compaction kernels run on the host. The gathers, the append and the in-place compaction
// (validation, reset, tiled copy with its decoupled look-back and ring of flags) are ops of
// detail/block/compact_ops.hpp, whose launch sequences (the ones compact.cuh launches) run here on
// the SIMT executor (fibers, interleaved resident blocks, small grids, small flag rings that wrap);
// without the ordering rule (publish + look-back) the same executor corrupts the cache (checked, so
// the test can see an ordering bug). Everything is compared bit for bit with the host compact /
// compact_inplace / append. Also: the SIMT executor's own tests.
#include "support.hpp"

#include <kvevict/compact.hpp>
#include <kvevict/detail/block/compact_block.hpp>
#include <kvevict/detail/block/compact_ops.hpp>
#include <kvevict/detail/block/simt.hpp>
#include <kvevict/numeric.hpp>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

using namespace kvevict;
using kvtest::value_of;

namespace {

// the unit choice is compact.cuh's own (detail/block/compact_block.hpp)
using detail::unit_for;
using detail::view_bits;
using detail::with_unit;

// ---- caches -------------------------------------------------------------------------------------------

/// A [H][T][D] cache of T in a buffer shifted by `shift` elements (so base addresses and strides
/// take every alignment), head-major or token-major, rows padded by `pad`, elements strided when
/// `estride` > 1.
template <class T>
struct cache_t {
  std::vector<T> buf;
  kv_view<T> view;
  cache_t(std::mt19937_64& g, index_t H, index_t Tn, index_t D, bool token_major, index_t pad, index_t estride,
          index_t shift) {
    const index_t row = D * estride + pad;
    buf.resize(static_cast<std::size_t>(shift + std::max<index_t>(1, H * Tn * row)));
    for (auto& x : buf) {
      const auto v = static_cast<std::uint32_t>(g());
      std::memcpy(&x, &v, std::min(sizeof(T), sizeof v));
    }
    T* base = buf.data() + shift;
    view = token_major ? value_of(make_kv_view(base, H, Tn, D, row, H * row, estride))
                       : value_of(make_kv_view(base, H, Tn, D, std::max<index_t>(1, Tn * row), row, estride));
  }
};

template <class T>
bool same(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

std::vector<pos_t> random_positions(std::mt19937_64& g, index_t Tn, index_t k, bool ascending) {
  std::vector<pos_t> all(static_cast<std::size_t>(Tn));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), g);
  all.resize(static_cast<std::size_t>(k));
  if (ascending) std::sort(all.begin(), all.end());
  return all;
}

// ---- the launch sequences on the executor -------------------------------------------------------------------

/// Runs a launch sequence of detail/block/compact_ops.hpp (the one compact.cuh launches) on the SIMT
/// executor with a random seed, 1 to 4 resident blocks and, when `small_grid`, grids capped at 3
/// blocks (every kernel's grid-stride loop takes several items); returns the rows / heads counted bad.
template <class Launch>
int on_executor(std::mt19937_64& g, bool small_grid, Launch&& launch) {
  detail::simt_executor ex(g(), 0);
  ex.resident(1 + static_cast<index_t>(g() % 4));
  detail::simt_launcher<detail::simt_executor> l{ex};
  int bad = 0;
  launch(l, detail::simt_bad{&bad, nullptr}, small_grid ? index_t(3) : index_t(1) << 20);
  REQUIRE_MESSAGE(l.ok, ex.error());
  return bad;
}

/// compact(cuda) dense gather: detail::compact_dense_launch.
template <class T>
int emulate_dense(std::mt19937_64& g, const kv_view<const T>& src, const matrix_view<const pos_t>& kept,
                  const kv_view<T>& dst) {
  const index_t dim = src.extent(2);
  with_unit(unit_for<T>(src.stride(2) == 1 && dst.stride(2) == 1, view_bits(src) | view_bits(dst), dim), [&](auto u) {
    constexpr int U = decltype(u)::value;
    const detail::row_copy<T, U> rc{dim, src.stride(2), dst.stride(2)};
    if constexpr (U > 0) REQUIRE(rc.units() * U == dim * index_t(sizeof(T)));
  });
  if (kept.extent(0) * kept.extent(1) == 0 || dim == 0) return 0;  // the launcher returns before launching
  return on_executor(g, g() % 2 == 0, [&](auto& l, detail::simt_bad bad, index_t cap) {
    detail::compact_dense_launch(l, src, kept, dst, bad, cap);
  });
}

/// compact(cuda) ragged gathers (ragged_view or ragged_cache destination), 3 blocks per head:
/// detail::compact_ragged_launch.
template <class T, bool ToCache>
int emulate_ragged(std::mt19937_64& g, const kv_view<const T>& src, const ragged_positions& kept, T* dst,
                   const std::int32_t* dst_cu, std::int32_t* lens, index_t row_stride) {
  if (kept.heads == 0) return 0;
  return on_executor(g, g() % 2 == 0, [&](auto& l, detail::simt_bad bad, index_t cap) {
    detail::compact_ragged_launch<ToCache>(l, src, kept, dst, dst_cu, lens, row_stride, bad, 3, cap);
  });
}

/// compact_inplace(cuda): detail::inplace_launch (validation, reset of the ordering state, tiled copy
/// with its look-back) with `parts` blocks per head, tiles of `tile_rows` rows (-1: the kernel's
/// choice, 0: one-row tiles copied directly) and a ring of `ring` flags per head (small rings are
/// reused after a few tiles). The ordering state starts as garbage: the reset op zeroes it.
/// Ordered = false drops the publish and look-back.
template <class T, bool Ordered = true, class Heads>
int emulate_inplace(std::mt19937_64& g, const Heads& heads, bool contiguous, std::uint64_t bits, index_t dim,
                    index_t estride, index_t parts, index_t tile_rows, index_t ring = detail::inplace_ring) {
  const index_t H = heads.heads();
  if (H == 0) return 0;  // the launcher returns before launching
  REQUIRE(ring >= 2 * parts);
  const auto hs = static_cast<std::size_t>(H);
  std::vector<index_t> head_rows(hs, -7);
  std::vector<unsigned> ticket(hs, 99u), prefix(hs, 99u), flags(hs * static_cast<std::size_t>(ring), 99u);
  const detail::inplace_sync sync{ticket.data(), prefix.data(), flags.data(), ring};
  return on_executor(g, g() % 2 == 0, [&](auto& l, detail::simt_bad bad, index_t cap) {
    detail::inplace_launch<T, Ordered>(l, heads, contiguous, bits, dim, estride, head_rows.data(), sync, bad,
                                       tile_rows, parts, cap);
  });
}

/// append(cuda): detail::append_launch with `parts` blocks per head (append_lens_op when parts > 1).
template <class T>
int emulate_append(std::mt19937_64& g, const ragged_cache<T>& cache, const kv_view<const T>& rows, index_t parts) {
  if (cache.heads == 0 || rows.extent(1) == 0) return 0;
  return on_executor(g, g() % 2 == 0, [&](auto& l, detail::simt_bad bad, index_t cap) {
    detail::append_launch(l, cache, rows, bad, parts, cap);
  });
}

}  // namespace

TEST_CASE("compact device logic: copy units and lanes") {
  CHECK(detail::copy_unit_bytes(0) == 16);
  CHECK(detail::copy_unit_bytes(0x1000) == 16);
  CHECK(detail::copy_unit_bytes(0x1008) == 8);
  CHECK(detail::copy_unit_bytes(0x1004) == 4);
  CHECK(detail::copy_unit_bytes(0x1002) == 2);
  CHECK(detail::copy_unit_bytes(0x1001) == 1);
  auto g = kvtest::rng(3);
  for (int i = 0; i < 10000; ++i) {
    const auto a = static_cast<std::uint64_t>(g()), b = static_cast<std::uint64_t>(kvtest::uniform_int(g, 0, 4096));
    const int u = detail::copy_unit_bytes(a | b);
    CHECK(a % static_cast<std::uint64_t>(u) == 0);
    CHECK(b % static_cast<std::uint64_t>(u) == 0);
    CHECK((u == 16 || a % (2u * static_cast<std::uint64_t>(u)) != 0 || b % (2u * static_cast<std::uint64_t>(u)) != 0));
  }
  CHECK(detail::copy_lanes(0) == 1);
  CHECK(detail::copy_lanes(1) == 1);
  CHECK(detail::copy_lanes(8) == 8);
  CHECK(detail::copy_lanes(9) == 16);
  CHECK(detail::copy_lanes(16) == 16);
  CHECK(detail::copy_lanes(1000) == 32);
  CHECK(detail::inplace_tile_rows(16, 16) == 128);  // 256-byte rows: 128 per 32 KiB tile
  CHECK(detail::inplace_tile_rows(4096, 16) == 0);  // 64 KiB rows: copied directly
  CHECK(detail::inplace_can_publish(0, detail::inplace_ring - 1));
  CHECK_FALSE(detail::inplace_can_publish(0, detail::inplace_ring));
  CHECK(detail::inplace_has_read(5, 4));
  CHECK(detail::inplace_has_read(5 + detail::inplace_ring, 4));  // the slot's later tile: tile 4 read long ago
  CHECK_FALSE(detail::inplace_has_read(4, 4));
  CHECK_FALSE(detail::inplace_has_read(0, 0));
  CHECK(detail::inplace_ring >= 2 * detail::inplace_max_parts);
}

TEST_CASE("compact device logic: device-resident offsets and lengths are validated per head") {
  const std::int32_t cu[] = {0, 2, 2, 7};
  index_t b = -1, n = -1;
  CHECK(detail::offsets_span_ok(cu, 2, 3, b, n));
  CHECK(b == 2);
  CHECK(n == 5);
  const std::int32_t bad0[] = {1, 2, 3};
  CHECK_FALSE(detail::offsets_span_ok(bad0, 1, 2, b, n));
  const std::int32_t down[] = {0, 5, 3, 9};
  CHECK_FALSE(detail::offsets_span_ok(down, 1, 3, b, n));
  CHECK(detail::offsets_span_ok(down, 2, 3, b, n));
  const std::int32_t past[] = {0, 9, 4};
  CHECK_FALSE(detail::offsets_span_ok(past, 0, 2, b, n));
  // ragged_view: cu_lens must equal kept.cu at the head's two offsets
  const std::int32_t other[] = {0, 2, 3, 7};
  CHECK(detail::ragged_view_head(cu, cu, true, true, 0, 3).ok);
  CHECK(detail::ragged_view_head(cu, other, true, true, 0, 3).ok);
  CHECK_FALSE(detail::ragged_view_head(cu, other, true, true, 1, 3).ok);
  CHECK_FALSE(detail::ragged_view_head(cu, other, true, true, 2, 3).ok);
  CHECK(detail::ragged_view_head(cu, cu, false, true, 1, 3).ok);  // empty head: null pos is fine
  CHECK_FALSE(detail::ragged_view_head(cu, cu, false, true, 2, 3).ok);
  // ragged_cache: kept count within the head's capacity
  const std::int32_t cap[] = {0, 2, 4, 8};
  CHECK(detail::ragged_cache_head(cu, cap, true, true, 0, 3).ok);
  CHECK_FALSE(detail::ragged_cache_head(cu, cap, true, true, 2, 3).ok);  // 5 rows, capacity 4
  CHECK(detail::ragged_cache_head(cu, cap, true, true, 1, 3).dst_begin == 2);
  // append
  std::int32_t lens[] = {1, 2, 0};
  index_t first = -1;
  CHECK(detail::append_head_ok(cap, lens, 0, 3, 1, true, first));
  CHECK(first == 1);
  CHECK_FALSE(detail::append_head_ok(cap, lens, 0, 3, 2, true, first));
  CHECK_FALSE(detail::append_head_ok(cap, lens, 1, 3, 1, true, first));  // full
  lens[2] = -1;
  CHECK_FALSE(detail::append_head_ok(cap, lens, 2, 3, 0, true, first));
  lens[2] = 5;
  CHECK_FALSE(detail::append_head_ok(cap, lens, 2, 3, 0, true, first));
}

TEST_CASE("compact device logic: dense gather in every unit width matches compact(seq) bit for bit") {
  auto g = kvtest::rng(10);
  for (int trial = 0; trial < 200; ++trial) {
    CAPTURE(trial);
    const index_t H = kvtest::uniform_int(g, 1, 5), Tn = kvtest::uniform_int(g, 1, 60);
    const index_t D = trial % 4 == 0 ? kvtest::uniform_int(g, 1, 9) : 8 * kvtest::uniform_int(g, 1, 24);
    const index_t k = kvtest::uniform_int(g, 0, Tn);
    const index_t estride = trial % 5 == 4 ? 2 : 1, shift = trial % 3 == 0 ? kvtest::uniform_int(g, 0, 7) : 0;
    const index_t pad = trial % 2 ? kvtest::uniform_int(g, 0, 5) : 0;
    cache_t<float16> src(g, H, Tn, D, trial % 2 == 1, pad, estride, shift);
    const auto kept = [&] {
      std::vector<pos_t> v;
      for (index_t h = 0; h < H; ++h) {
        auto p = random_positions(g, Tn, k, trial % 2 == 0);
        v.insert(v.end(), p.begin(), p.end());
      }
      return v;
    }();
    auto kv = value_of(make_matrix_view(kept.data(), H, k));
    std::vector<float16> ref(static_cast<std::size_t>(std::max<index_t>(1, H * k * D))), got(ref.size() + 8);
    REQUIRE(compact(seq, src.view, kv, value_of(make_kv_view(ref.data(), H, k, D))).ok());
    const index_t dshift = trial % 7 == 0 ? 1 : 0;
    const auto dst = value_of(make_kv_view(got.data() + dshift, H, k, D));
    CHECK(emulate_dense<float16>(g, src.view, kv, dst) == 0);
    for (index_t i = 0; i < H * k * D; ++i) REQUIRE(same(got[i + dshift], ref[i]));
  }
  // out-of-range positions: skipped and counted, the other rows copied
  cache_t<float> src(g, 2, 5, 4, false, 0, 1, 0);
  const std::vector<pos_t> kept = {0, 5, -1, 4};
  std::vector<float> got(16, -1.f);
  CHECK(emulate_dense<float>(g, src.view, value_of(make_matrix_view(kept.data(), 2, 2)),
                             value_of(make_kv_view(got.data(), 2, 2, 4))) == 2);
  for (index_t d = 0; d < 4; ++d) {
    CHECK(same(got[d], src.view(0, 0, d)));
    CHECK(got[4 + d] == -1.f);
    CHECK(got[8 + d] == -1.f);
    CHECK(same(got[12 + d], src.view(1, 4, d)));
  }
}

TEST_CASE("compact device logic: ragged gathers match compact(seq), bad heads are skipped") {
  auto g = kvtest::rng(11);
  for (int trial = 0; trial < 80; ++trial) {
    CAPTURE(trial);
    const index_t H = kvtest::uniform_int(g, 1, 6), Tn = kvtest::uniform_int(g, 1, 50), D = kvtest::uniform_int(g, 1, 40);
    cache_t<bfloat16> src(g, H, Tn, D, trial % 2 == 0, trial % 3, trial % 5 == 0 ? 3 : 1, trial % 4);
    std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1), 0), cap(cu);
    std::vector<pos_t> pos;
    for (index_t h = 0; h < H; ++h) {
      const auto p = random_positions(g, Tn, kvtest::uniform_int(g, 0, Tn), trial % 2 == 0);
      pos.insert(pos.end(), p.begin(), p.end());
      cu[h + 1] = cu[h] + static_cast<std::int32_t>(p.size());
      cap[h + 1] = cap[h] + static_cast<std::int32_t>(p.size() + kvtest::uniform_int(g, 0, 3));
    }
    const ragged_positions kept{pos.data(), cu.data(), H};
    const index_t rs = D + (trial % 3 == 0 ? 1 : 0);
    std::vector<bfloat16> ref(static_cast<std::size_t>(std::max(1, cu.back()) * rs)), got(ref.size());
    REQUIRE(compact(seq, src.view, kept, ragged_view<bfloat16>{ref.data(), cu.data(), H, D, rs}).ok());
    CHECK(emulate_ragged<bfloat16, false>(g, src.view, kept, got.data(), cu.data(), nullptr, rs) == 0);
    for (index_t r = 0; r < cu.back(); ++r)
      for (index_t d = 0; d < D; ++d) REQUIRE(same(got[r * rs + d], ref[r * rs + d]));
    // into a ragged_cache with spare capacity
    std::vector<bfloat16> store(static_cast<std::size_t>(std::max(1, cap.back()) * rs)), store_ref(store.size());
    std::vector<std::int32_t> lens(static_cast<std::size_t>(H), -3), lens_ref(lens);
    REQUIRE(compact(seq, src.view, kept, ragged_cache<bfloat16>{store_ref.data(), cap.data(), lens_ref.data(), H, D, rs}).ok());
    CHECK(emulate_ragged<bfloat16, true>(g, src.view, kept, store.data(), cap.data(), lens.data(), rs) == 0);
    REQUIRE(lens == lens_ref);
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < lens[h]; ++j)
        for (index_t d = 0; d < D; ++d)
          REQUIRE(same(store[(cap[h] + j) * rs + d], store_ref[(cap[h] + j) * rs + d]));
  }
  // a head keeping more than its capacity is skipped and keeps its length; cu_lens != kept.cu too
  cache_t<float> src(g, 2, 6, 3, false, 0, 1, 0);
  const std::vector<pos_t> pos = {0, 2, 4, 1, 3};
  const std::int32_t cu[] = {0, 3, 5}, small[] = {0, 2, 6}, other[] = {0, 2, 5};
  std::vector<float> store(18, -1.f);
  std::int32_t lens[] = {7, 7};
  CHECK(emulate_ragged<float, true>(g, src.view, ragged_positions{pos.data(), cu, 2}, store.data(), small, lens, 3) == 1);
  CHECK(lens[0] == 7);
  CHECK(lens[1] == 2);
  CHECK(std::all_of(store.begin(), store.begin() + 6, [](float x) { return x == -1.f; }));
  std::vector<float> flat(15, -1.f);
  CHECK(emulate_ragged<float, false>(g, src.view, ragged_positions{pos.data(), cu, 2}, flat.data(), other, nullptr, 3) == 2);
  CHECK(std::all_of(flat.begin(), flat.end(), [](float x) { return x == -1.f; }));
}

TEST_CASE("compact device logic: in place on the executor matches compact_inplace(seq), the flag ring wraps") {
  auto g = kvtest::rng(12);
  for (int trial = 0; trial < 120; ++trial) {
    CAPTURE(trial);
    // a ring of 4 or 8 flags (the GPU's 512 in the other trials): heads of more tiles reuse its slots
    const index_t ring = trial % 3 == 0 ? detail::inplace_ring : trial % 3 == 1 ? 8 : 4;
    const bool wrap = trial % 10 == 7;  // many one-row tiles through a 4-flag ring
    const index_t H = wrap ? 1 : kvtest::uniform_int(g, 1, 4), Tn = wrap ? 90 : kvtest::uniform_int(g, 1, 80);
    const index_t D = kvtest::uniform_int(g, 1, 24);
    const index_t estride = trial % 6 == 5 ? 2 : 1;
    cache_t<float> a(g, H, Tn, D, trial % 2 == 0, trial % 3, estride, trial % 4);
    cache_t<float> b = a;
    b.view = kv_view<float>(b.buf.data() + (a.view.data_handle() - a.buf.data()), a.view.mapping());
    const index_t k = trial % 5 == 0 || wrap ? std::max<index_t>(0, Tn - trial % 3) : kvtest::uniform_int(g, 0, Tn);
    std::vector<pos_t> kept;
    for (index_t h = 0; h < H; ++h) {
      const auto p = random_positions(g, Tn, k, true);
      kept.insert(kept.end(), p.begin(), p.end());
    }
    const auto kv = value_of(make_matrix_view(static_cast<const pos_t*>(kept.data()), H, k));
    REQUIRE(compact_inplace(seq, a.view, kv).ok());
    const index_t tile_rows = wrap ? 1 : trial % 4 == 0 ? 0 : trial % 4 == 1 ? 1 : trial % 4 == 2 ? 3 : -1;
    const detail::dense_inplace_heads<float> heads{b.view, kv};
    const index_t parts = kvtest::uniform_int(g, 1, ring / 2 < 6 ? ring / 2 : 6);
    CHECK(emulate_inplace<float>(g, heads, b.view.stride(2) == 1, view_bits(b.view), D, b.view.stride(2), parts,
                                 tile_rows, ring) == 0);
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < k; ++j)
        for (index_t d = 0; d < D; ++d) REQUIRE(same(b.view(h, j, d), a.view(h, j, d)));
  }
}

TEST_CASE("compact device logic: without the ordering rule the executor corrupts the cache") {
  // kept = 1, 2, ..., n: every row moves down by one, so each tile reads the row the next tile
  // writes: only the ordering keeps the result right
  auto g = kvtest::rng(13);
  int corrupted = 0;
  for (int trial = 0; trial < 50; ++trial) {
    const index_t Tn = 40, D = 4;
    cache_t<float> a(g, 1, Tn, D, false, 0, 1, 0);
    cache_t<float> b = a;
    b.view = kv_view<float>(b.buf.data(), a.view.mapping());
    std::vector<pos_t> kept(static_cast<std::size_t>(Tn - 1));
    std::iota(kept.begin(), kept.end(), 1);
    const auto kv = value_of(make_matrix_view(static_cast<const pos_t*>(kept.data()), 1, Tn - 1));
    REQUIRE(compact_inplace(seq, a.view, kv).ok());
    const detail::dense_inplace_heads<float> heads{b.view, kv};
    CHECK(emulate_inplace<float, false>(g, heads, true, view_bits(b.view), D, 1, 4, trial % 2 ? 1 : 0) == 0);
    bool differs = false;
    for (index_t j = 0; j < Tn - 1; ++j)
      for (index_t d = 0; d < D; ++d) differs = differs || !same(b.view(0, j, d), a.view(0, j, d));
    corrupted += differs ? 1 : 0;
  }
  CHECK(corrupted > 0);
}

TEST_CASE("compact device logic: in place on a ragged cache, and invalid heads left untouched") {
  auto g = kvtest::rng(14);
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    const index_t H = kvtest::uniform_int(g, 1, 5), D = kvtest::uniform_int(g, 1, 20), rs = D + trial % 2;
    std::vector<std::int32_t> cap(static_cast<std::size_t>(H + 1), 0), lens(static_cast<std::size_t>(H)), cu(cap);
    std::vector<pos_t> pos;
    for (index_t h = 0; h < H; ++h) {
      cap[h + 1] = cap[h] + static_cast<std::int32_t>(kvtest::uniform_int(g, 0, 60));
      lens[h] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, cap[h + 1] - cap[h]));
      const auto p = random_positions(g, lens[h], kvtest::uniform_int(g, 0, lens[h]), true);
      pos.insert(pos.end(), p.begin(), p.end());
      cu[h + 1] = cu[h] + static_cast<std::int32_t>(p.size());
    }
    std::vector<float> store(static_cast<std::size_t>(std::max(1, cap.back()) * rs));
    for (auto& x : store) x = static_cast<float>(g() % 100000);
    auto store_ref = store;
    auto lens_ref = lens;
    const ragged_positions kept{pos.data(), cu.data(), H};
    REQUIRE(compact_inplace(seq, ragged_cache<float>{store_ref.data(), cap.data(), lens_ref.data(), H, D, rs}, kept).ok());
    const ragged_cache<float> rc{store.data(), cap.data(), lens.data(), H, D, rs};
    const detail::ragged_inplace_heads<float> heads{rc, kept};
    const std::uint64_t bits = detail::addr_bits(store.data()) | std::uint64_t(rs) * sizeof(float);
    CHECK(emulate_inplace<float>(g, heads, true, bits, D, 1, kvtest::uniform_int(g, 1, 3), trial % 3 == 0 ? 0 : -1) == 0);
    REQUIRE(lens == lens_ref);
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < lens[h]; ++j)
        for (index_t d = 0; d < D; ++d) REQUIRE(store[(cap[h] + j) * rs + d] == store_ref[(cap[h] + j) * rs + d]);
  }
  // bad heads: an unsorted list (head 0), a position past lens (head 1), a corrupt length (head 2)
  const std::int32_t cap[] = {0, 4, 8, 12, 16};
  std::int32_t lens[] = {4, 2, 9, 4};
  const std::vector<pos_t> pos = {2, 1, 0, 3, 1, 3};
  const std::int32_t cu[] = {0, 2, 4, 5, 6};
  std::vector<float> store(16);
  std::iota(store.begin(), store.end(), 0.f);
  const ragged_cache<float> rc{store.data(), cap, lens, 4, 1, 1};
  const detail::ragged_inplace_heads<float> heads{rc, ragged_positions{pos.data(), cu, 4}};
  CHECK(emulate_inplace<float>(g, heads, true, 0, 1, 1, 2, -1) == 3);
  CHECK(lens[0] == 4);
  CHECK(lens[1] == 2);
  CHECK(lens[2] == 9);
  CHECK(lens[3] == 1);  // head 3 keeps its row 3
  const std::vector<float> expect = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 13, 14, 15};
  CHECK(store == expect);
}

TEST_CASE("compact device logic: decode-time append, one and several blocks per head") {
  auto g = kvtest::rng(15);
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    const index_t H = kvtest::uniform_int(g, 1, 5), D = kvtest::uniform_int(g, 1, 33), n = kvtest::uniform_int(g, 0, 6);
    const index_t rs = D + trial % 3;
    std::vector<std::int32_t> cap(static_cast<std::size_t>(H + 1), 0), lens(static_cast<std::size_t>(H));
    for (index_t h = 0; h < H; ++h) {
      cap[h + 1] = cap[h] + static_cast<std::int32_t>(kvtest::uniform_int(g, n, n + 10));
      lens[h] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, cap[h + 1] - cap[h] - n));
    }
    std::vector<float16> store(static_cast<std::size_t>(std::max(1, cap.back()) * rs));
    for (auto& x : store) x = to_float16(static_cast<float>(g() % 1000));
    auto store_ref = store;
    auto lens_ref = lens;
    cache_t<float16> rows(g, H, n, D, trial % 2 == 0, trial % 2, trial % 4 == 3 ? 2 : 1, trial % 3);
    REQUIRE(append(seq, ragged_cache<float16>{store_ref.data(), cap.data(), lens_ref.data(), H, D, rs}, rows.view).ok());
    const ragged_cache<float16> rc{store.data(), cap.data(), lens.data(), H, D, rs};
    CHECK(emulate_append<float16>(g, rc, rows.view, trial % 2 ? 1 : 3) == 0);
    REQUIRE(lens == lens_ref);
    for (std::size_t i = 0; i < store.size(); ++i) REQUIRE(same(store[i], store_ref[i]));
  }
  // a full head and a corrupt length are skipped; the others appended
  const std::int32_t cap[] = {0, 2, 4, 6};
  std::int32_t lens[] = {2, 0, 7};
  std::vector<float> store(6, -1.f);
  const std::vector<float> fresh = {10.f, 11.f, 12.f};
  for (index_t parts : {1, 2}) {
    std::fill(store.begin(), store.end(), -1.f);
    lens[0] = 2;
    lens[1] = 0;
    lens[2] = 7;
    CHECK(emulate_append<float>(g, ragged_cache<float>{store.data(), cap, lens, 3, 1, 1},
                                value_of(make_kv_view(fresh.data(), 3, 1, 1)), parts) == 2);
    CHECK(lens[0] == 2);
    CHECK(lens[1] == 1);
    CHECK(lens[2] == 7);
    CHECK(store == std::vector<float>{-1.f, -1.f, 11.f, -1.f, -1.f, -1.f});
  }
}

// ---- the SIMT host executor (detail/block/simt.hpp) itself ----------------------------------------

TEST_CASE("simt executor: barriers, shared memory, warp shuffles and votes, several blocks") {
  using detail::simt_executor;
  using detail::simt_thread;
  constexpr index_t threads = 128, blocks = 5;
  auto g = kvtest::rng(2103);
  std::vector<float> x = kvtest::random_floats(g, static_cast<std::size_t>(threads * blocks), -1.f, 1.f);
  std::vector<float> block_sum(blocks), warp_sum(static_cast<std::size_t>(blocks * threads / 32));
  std::vector<std::uint32_t> ballots(warp_sum.size());
  std::vector<int> any_all(warp_sum.size());
  unsigned ticket = 0, last_seen = 0;
  for (std::uint64_t seed = 0; seed < 4; ++seed) {
    simt_executor ex(seed, threads * sizeof(float));
    ticket = 0;
    const bool ok = ex.run(blocks, threads, [&](simt_thread& c) {
      float* sh = ex.shared_as<float>();
      const index_t i = c.block() * c.block_dim() + c.thread();
      const float v = x[static_cast<std::size_t>(i)];
      // warp tree (shfl_down) and a butterfly (shfl_xor): every lane ends with the same sum
      float s = v;
      for (int off = 16; off > 0; off /= 2) s += c.shfl_down(s, off);
      long long b = i % 97;  // integers: the butterfly's order differs per lane, the exact sum does not
      for (int m = 1; m < 32; m *= 2) b += c.shfl_xor(b, m);
      long long exact = 0;
      for (index_t j = i - c.lane(); j < i - c.lane() + 32; ++j) exact += j % 97;
      const float s0 = c.shfl(s, 0);
      const std::uint32_t bal = c.ballot(v > 0);
      const bool any = c.any(v > 0.9f), all = c.all(v > -2.f);
      const index_t wi = i / 32;
      if (c.lane() == 0) {
        warp_sum[static_cast<std::size_t>(wi)] = s0;
        ballots[static_cast<std::size_t>(wi)] = bal;
        any_all[static_cast<std::size_t>(wi)] = (any ? 1 : 0) + (all ? 2 : 0);
      }
      if (b != exact) throw std::runtime_error("the butterfly sum is wrong");
      // block tree reduction in shared memory, a barrier between levels
      c.st(sh + c.thread(), v);
      c.sync();
      for (index_t half = threads / 2; half > 0; half /= 2) {
        float mine = 0.0f;
        if (c.thread() < half) mine = c.ld(sh + c.thread()) + c.ld(sh + c.thread() + half);
        c.sync();
        if (c.thread() < half) c.st(sh + c.thread(), mine);
        c.sync();
      }
      if (c.thread() == 0) {
        block_sum[static_cast<std::size_t>(c.block())] = c.ld(sh);
        c.fence();
        if (c.atomic_add(&ticket, 1u) == blocks - 1) last_seen = ticket;
      }
    });
    REQUIRE_MESSAGE(ok, ex.error());
    CHECK(ex.barriers() == blocks * 15);  // 1 + 2 per level (7 levels) per block
    CHECK(ticket == blocks);
    CHECK(last_seen == blocks);
    for (index_t w = 0; w < blocks * threads / 32; ++w) {
      float s = 0.0f;  // the tree's order: ((x0 + x16) + (x8 + x24)) ... computed the same way serially
      std::vector<float> lanes(x.begin() + w * 32, x.begin() + w * 32 + 32);
      for (int off = 16; off > 0; off /= 2)
        for (int l = 0; l + off < 32; ++l) lanes[static_cast<std::size_t>(l)] += lanes[static_cast<std::size_t>(l + off)];
      s = lanes[0];
      CHECK(warp_sum[static_cast<std::size_t>(w)] == s);
      std::uint32_t bal = 0;
      bool any = false, all = true;
      for (int l = 0; l < 32; ++l) {
        const float v = x[static_cast<std::size_t>(w * 32 + l)];
        if (v > 0) bal |= 1u << l;
        any = any || v > 0.9f;
        all = all && v > -2.f;
      }
      CHECK(ballots[static_cast<std::size_t>(w)] == bal);
      CHECK(any_all[static_cast<std::size_t>(w)] == (any ? 1 : 0) + (all ? 2 : 0));
    }
    for (index_t b = 0; b < blocks; ++b) {
      std::vector<float> v(x.begin() + b * threads, x.begin() + (b + 1) * threads);
      for (index_t half = threads / 2; half > 0; half /= 2)
        for (index_t t = 0; t < half; ++t) v[static_cast<std::size_t>(t)] += v[static_cast<std::size_t>(t + half)];
      CHECK(block_sum[static_cast<std::size_t>(b)] == v[0]);
    }
  }
}

TEST_CASE("simt executor: a missing barrier is a shared-memory race; a divergent barrier and a broken warp are reported") {
  using detail::simt_executor;
  using detail::simt_thread;
  constexpr index_t threads = 64;
  {  // the reduction above without the barriers between its levels
    simt_executor ex(1, threads * sizeof(float));
    const bool ok = ex.run(2, threads, [&](simt_thread& c) {
      float* sh = ex.shared_as<float>();
      c.st(sh + c.thread(), 1.0f);
      c.sync();
      for (index_t half = threads / 2; half > 0; half /= 2)  // no barrier between the levels
        if (c.thread() < half) c.st(sh + c.thread(), c.ld(sh + c.thread()) + c.ld(sh + c.thread() + half));
    });
    CHECK_FALSE(ok);
    CHECK(ex.error().find("shared-memory race") != std::string::npos);
  }
  {  // write-write on one word (two threads store to the same slot in one epoch)
    simt_executor ex(2, 16);
    CHECK_FALSE(ex.run(1, 32, [&](simt_thread& c) { c.st(ex.shared_as<int>() + c.thread() % 4, 1); }));
    CHECK(ex.error().find("write after a write") != std::string::npos);
  }
  {  // atomics on one word do not race with each other
    simt_executor ex(3, 16);
    CHECK(ex.run(1, 64, [&](simt_thread& c) { c.atomic_add(ex.shared_as<unsigned>(), 1u); }));
  }
  {  // a barrier inside a branch that only some threads take
    simt_executor ex(4);
    CHECK_FALSE(ex.run(1, threads, [&](simt_thread& c) {
      if (c.thread() < 40) c.sync();
    }));
    CHECK(ex.error().find("barrier divergence") != std::string::npos);
  }
  {  // a shuffle that some lanes of the warp skip
    simt_executor ex(5);
    CHECK_FALSE(ex.run(1, 32, [&](simt_thread& c) {
      if (c.lane() < 31) (void)c.shfl_xor(1.0f, 1);
    }));
    CHECK(ex.error().find("warp operation") != std::string::npos);
  }
  {  // an exception in a body fails the run and unwinds every other thread
    simt_executor ex(6, 64);
    CHECK_FALSE(ex.run(3, 32, [&](simt_thread& c) {
      std::vector<int> held(100, 1);  // must be freed by the unwinding (the sanitize build checks leaks)
      c.sync();
      if (c.block() == 1 && c.thread() == 7) throw std::runtime_error("boom");
      c.sync();
      held[0] += 1;
    }));
    CHECK(ex.error().find("boom") != std::string::npos);
  }
}

// ---- the executor interleaves blocks: waits between blocks, races through global memory -------------

TEST_CASE("simt executor: blocks interleave; a decoupled look-back over tickets completes, bit-exact") {
  using detail::simt_executor;
  using detail::simt_thread;
  // A chained scan across blocks as the in-place compaction's look-back does it: each block takes a
  // tile by ticket, sums its tile (warp shuffles, shared memory, barriers), then warp 0 waits
  // (ld_acquire + all + pause) until the previous tile published its inclusive prefix, and thread 0
  // publishes its own (st_release). Blocks may wait only on tiles taken earlier, which are resident
  // or done: it must complete whatever the schedule and the number of resident blocks.
  constexpr index_t threads = 64, blocks = 9;
  auto g = kvtest::rng(2104);
  std::vector<long long> x(static_cast<std::size_t>(threads * blocks));
  for (auto& v : x) v = static_cast<long long>(g() % 1000) - 300;
  std::vector<long long> expect(blocks);
  long long run = 0;
  for (index_t b = 0; b < blocks; ++b) {
    for (index_t i = 0; i < threads; ++i) run += x[static_cast<std::size_t>(b * threads + i)];
    expect[static_cast<std::size_t>(b)] = run;
  }
  for (index_t resident : {index_t(1), index_t(2), index_t(4), blocks}) {
    for (std::uint64_t seed = 0; seed < 3; ++seed) {
      simt_executor ex(seed * 31 + static_cast<std::uint64_t>(resident), sizeof(long long) * 2 + sizeof(unsigned) * 2);
      ex.resident(resident);
      unsigned ticket = 0;
      std::vector<unsigned> flag(blocks, 0);
      std::vector<long long> prefix(blocks, 0);
      const bool ok = ex.run(blocks, threads, [&](simt_thread& c) {
        auto* warp_sums = ex.shared_as<long long>();               // [2]
        auto* tile = ex.shared_as<unsigned>(2 * sizeof(long long));  // [1]
        if (c.thread() == 0) c.st(tile, c.atomic_add(&ticket, 1u));
        c.sync();
        const index_t t = c.ld(tile);
        long long v = x[static_cast<std::size_t>(t * threads + c.thread())];
        for (int off = 16; off > 0; off /= 2) v += c.shfl_down(v, off);
        if (c.lane() == 0) c.st(warp_sums + c.warp(), v);
        c.sync();
        if (c.warp() == 0) {
          long long before = 0;
          if (t > 0)
            for (;;) {
              const bool ready = c.ld_acquire(&flag[static_cast<std::size_t>(t - 1)]) != 0;
              if (c.all(ready)) break;
              c.pause();
            }
          if (t > 0) before = prefix[static_cast<std::size_t>(t - 1)];
          if (c.thread() == 0) {
            prefix[static_cast<std::size_t>(t)] = before + c.ld(warp_sums) + c.ld(warp_sums + 1);
            c.fence();
            c.st_release(&flag[static_cast<std::size_t>(t)], 1u);
          }
        }
      });
      REQUIRE_MESSAGE(ok, ex.error());
      CHECK(ex.most_in_flight() == resident);
      CHECK(prefix == expect);
    }
  }
}

TEST_CASE("simt executor: a wait on a block that is not resident is reported, not hung") {
  using detail::simt_executor;
  using detail::simt_thread;
  // Block b waits for block b + 1 by block index (no ticket): with every block resident it works;
  // with one resident block at a time some order makes a block wait for one that cannot start.
  for (index_t resident : {index_t(3), index_t(1)}) {
    simt_executor ex(7, 0);
    ex.resident(resident);
    std::vector<unsigned> flag(3, 0);
    const bool ok = ex.run(3, 32, [&](simt_thread& c) {
      const index_t b = c.block();
      if (b + 1 < c.grid_dim())
        while (!c.all(c.ld_acquire(&flag[static_cast<std::size_t>(b + 1)]) != 0)) c.pause();
      if (c.thread() == 0) c.st_release(&flag[static_cast<std::size_t>(b)], 1u);
    });
    if (resident == 3) {
      CHECK_MESSAGE(ok, ex.error());
    } else {
      CHECK_FALSE(ok);
      CHECK(ex.error().find("deadlock") != std::string::npos);
    }
  }
}

TEST_CASE("simt executor: interleaved blocks expose a lost update through global memory; atomics do not lose any") {
  using detail::simt_executor;
  using detail::simt_thread;
  // Thread 0 of every block increments a global counter by a plain read, fence, write: when blocks
  // interleave at the fence, updates are lost (the race the executor exists to exercise); with
  // atomic_add none is. Blocks run one after another (resident 1) lose none either way.
  constexpr index_t blocks = 16;
  int lost_runs = 0;
  for (std::uint64_t seed = 0; seed < 8; ++seed) {
    for (index_t resident : {index_t(1), index_t(8)}) {
      simt_executor ex(seed, 0);
      ex.resident(resident);
      ex.preempt_one_in(2);
      unsigned plain = 0, atomic = 0;
      REQUIRE(ex.run(blocks, 32, [&](simt_thread& c) {
        if (c.thread() != 0) return;
        const unsigned seen = plain;
        c.fence();
        plain = seen + 1;
        c.atomic_add(&atomic, 1u);
      }));
      CHECK(atomic == blocks);
      if (resident == 1) CHECK(plain == blocks);
      lost_runs += plain != blocks;
    }
  }
  CHECK(lost_runs > 0);
}

TEST_CASE("simt executor: shared memory is per block when blocks interleave") {
  using detail::simt_executor;
  using detail::simt_thread;
  // Every block writes its id to its own shared memory, synchronises (other blocks run meanwhile),
  // and reads it back: a block must never see another block's shared memory.
  simt_executor ex(11, 64 * sizeof(index_t));
  ex.resident(5);
  std::vector<int> wrong(12, 0);
  REQUIRE_MESSAGE(ex.run(12, 64, [&](simt_thread& c) {
    index_t* sh = ex.shared_as<index_t>();
    c.st(sh + c.thread(), c.block() * 1000 + c.thread());
    c.sync();
    const index_t other = (c.thread() + 1) % c.block_dim();
    if (c.ld(sh + other) != c.block() * 1000 + other) wrong[static_cast<std::size_t>(c.block())] = 1;
  }), ex.error());
  CHECK(ex.most_in_flight() == 5);
  CHECK(wrong == std::vector<int>(12, 0));
}

// The in-place staging copies are plain C++ (row_copy::unit: memcpy on the host) announced to the
// executor (Block::plain_write / plain_read): staging a tile with one thread-to-unit mapping and
// writing it back with another (the next thread's units) is a race without a barrier between, and
// reported as one between plain accesses; with the barrier it is correct.
namespace {
struct rotated_block {  // simt_block with thread t doing thread (t + 1) % 256's part
  detail::simt_block<detail::simt_thread, 256> b;
  int size() const { return 256; }
  template <class F>
  void each(F&& f) const {
    f(static_cast<int>((b.c.thread() + 1) % 256));
  }
  void plain_read(const void* p, std::size_t n) const { b.plain_read(p, n); }
  void plain_write(void* p, std::size_t n) const { b.plain_write(p, n); }
};
}  // namespace

TEST_CASE("compact device logic: the in-place staging is race-checked: a missing barrier is reported") {
  constexpr index_t rows = 40, dim = 6;
  for (const bool barrier : {true, false}) {
    CAPTURE(barrier);
    std::vector<float> data(static_cast<std::size_t>((rows + 1) * dim));
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i);
    std::vector<pos_t> kept(static_cast<std::size_t>(rows));
    for (index_t j = 0; j < rows; ++j) kept[static_cast<std::size_t>(j)] = static_cast<pos_t>(j + 1);  // every row moves
    const detail::dense_inplace_head<float> head{data.data(), dim, kept.data(), 1};
    const detail::row_copy<float, 0> rc{dim, 1, 1};
    detail::simt_executor ex(77, detail::inplace_stage_bytes);
    const bool ok = ex.run(1, 256, [&](detail::simt_thread& c) {
      auto* stage = ex.shared_as<unsigned char>();
      detail::simt_block<detail::simt_thread, 256> blk{c, nullptr};
      detail::inplace_stage(blk, head, rc, 0, rows, stage);
      if (barrier) c.sync();
      rotated_block rot{blk};
      detail::inplace_unstage(rot, head, rc, 0, rows, stage);
    });
    if (barrier) {
      REQUIRE_MESSAGE(ok, ex.error());
      for (index_t j = 0; j < rows; ++j)
        for (index_t d = 0; d < dim; ++d)
          CHECK(data[static_cast<std::size_t>(j * dim + d)] == static_cast<float>((j + 1) * dim + d));
    } else {
      CHECK_FALSE(ok);
      INFO(ex.error());
      CHECK(ex.error().find("shared-memory race") != std::string::npos);
      const bool read_after_write = ex.error().find("plain read after a plain write") != std::string::npos;
      CHECK((read_after_write || ex.error().find("plain write after a plain read") != std::string::npos));
    }
  }
}
