#include "support.hpp"

#include <kvevict/compact.hpp>
#include <kvevict/numeric.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {

// A cache with an arbitrary memory layout: logical [H][T][D] over a buffer padded in every stride.
struct layout_case {
  kv_layout layout;
  index_t pad;  // extra elements per row (0: contiguous)
};

template <class T>
struct test_cache {
  std::vector<T> buf;
  kv_view<T> view;
  test_cache(index_t H, index_t Tn, index_t D, layout_case lc, std::mt19937_64& g) {
    const index_t row = D + lc.pad;
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, H * Tn * row)), T{});
    for (auto& x : buf) x = from_float(static_cast<float>(kvtest::uniform_int(g, -1000, 1000)));
    view = lc.layout == kv_layout::head_major ? value_of(make_kv_view(buf.data(), H, Tn, D, Tn * row, row))
                                              : value_of(make_kv_view(buf.data(), H, Tn, D, row, H * row));
  }
  static T from_float(float f) {
    if constexpr (std::is_same_v<T, float16>) return to_float16(f);
    else return f;
  }
};

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// Random kept lists: per head, k positions in [0, T). ascending => sorted, unique.
std::vector<pos_t> random_kept(std::mt19937_64& g, index_t H, index_t Tn, index_t k, bool ascending) {
  std::vector<pos_t> kept(static_cast<std::size_t>(H * k));
  for (index_t h = 0; h < H; ++h) {
    std::vector<pos_t> all(static_cast<std::size_t>(Tn));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), g);
    std::vector<pos_t> pick(all.begin(), all.begin() + k);
    if (ascending) std::sort(pick.begin(), pick.end());
    std::copy(pick.begin(), pick.end(), kept.begin() + h * k);
  }
  return kept;
}

const layout_case layouts[] = {{kv_layout::head_major, 0}, {kv_layout::token_major, 0}, {kv_layout::head_major, 3},
                               {kv_layout::token_major, 5}};

template <class T, class Backend>
void dense_gather_matches_reference(Backend be, std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  for (int trial = 0; trial < 40; ++trial) {
    const index_t H = kvtest::uniform_int(g, 1, 6), Tn = kvtest::uniform_int(g, 1, 70), D = kvtest::uniform_int(g, 1, 9);
    const index_t k = kvtest::uniform_int(g, 0, Tn);
    const layout_case lc = layouts[trial % 4];
    CAPTURE(seed);
    CAPTURE(trial);
    test_cache<T> src(H, Tn, D, lc, g);
    const auto kept = random_kept(g, H, Tn, k, trial % 2 == 0);
    std::vector<T> out(static_cast<std::size_t>(std::max<index_t>(1, H * k * D)));
    auto dst = value_of(make_kv_view(out.data(), H, k, D));
    REQUIRE(compact(be, src.view, value_of(make_matrix_view(kept.data(), H, k)), dst).ok());
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < k; ++j)
        for (index_t d = 0; d < D; ++d) REQUIRE(same_bits(dst(h, j, d), src.view(h, kept[h * k + j], d)));

    // in place on a copy: the first k rows of every head become the gathered rows
    test_cache<T> inplace = src;
    inplace.view = kv_view<T>(inplace.buf.data(), src.view.mapping());
    const auto asc = random_kept(g, H, Tn, k, true);
    REQUIRE(compact_inplace(be, inplace.view, value_of(make_matrix_view(asc.data(), H, k))).ok());
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < k; ++j)
        for (index_t d = 0; d < D; ++d) REQUIRE(same_bits(inplace.view(h, j, d), src.view(h, asc[h * k + j], d)));
  }
}

}  // namespace

TEST_CASE("compact dense: random shapes, layouts, backends and element types match the naive gather") {
  dense_gather_matches_reference<float>(seq, 1);
  dense_gather_matches_reference<float>(par, 2);
  dense_gather_matches_reference<float16>(seq, 3);
  dense_gather_matches_reference<float16>(par, 4);
}

namespace {

/// An engine's executor for on(ex): the calling thread and one std::thread, chunks of 5 taken from
/// the end and interleaved (a partition unlike seq's or par's).
struct two_worker_executor {
  int concurrency() const { return 2; }
  void parallel_for(index_t n, task_ref task) {
    auto run = [&](int worker) {
      const index_t chunk = 5, chunks = (n + chunk - 1) / chunk;
      for (index_t c = chunks - 1 - worker; c >= 0; c -= 2) task(c * chunk, std::min(n, (c + 1) * chunk), worker);
    };
    std::thread other(run, 1);
    run(0);
    other.join();
  }
};

/// Bytes at a chosen offset from a 64-byte boundary (0, 32: aligned to the 32-byte vectors; 16: not),
/// so the streamed stores' aligned path and their fallback both run.
struct offset_bytes {
  std::vector<unsigned char> raw;
  unsigned char* p;
  offset_bytes(std::size_t n, std::size_t offset, unsigned char fill) : raw(n + 64 + offset, fill) {
    const auto a = reinterpret_cast<std::uintptr_t>(raw.data());
    p = raw.data() + ((64 - a % 64) % 64) + offset;
  }
};

/// gather_rows_with(c, ...) against one memcpy per row (out of place, any positions, duplicates) and
/// against one memmove per row in order (in place, ascending positions), for rows of `dim`
/// elements `stride` apart; the positions after the n copied ones (`ahead`) are only prefetched.
/// stream: the non-temporal stores (taken when the destination rows are 32-byte aligned: offset 0
/// or 32 with strides of a multiple of 32 bytes); `offset`: the destination's (and the in-place
/// cache's) distance from a 64-byte boundary.
template <class T>
void gather_copy_matches_memcpy(detail::gather_copy c, index_t dim, index_t stride, std::mt19937_64& g,
                                bool stream = false, std::size_t offset = 0) {
  const index_t rows = kvtest::uniform_int(g, 1, 300);
  const std::size_t row_bytes = static_cast<std::size_t>(dim) * sizeof(T);
  std::vector<unsigned char> src(static_cast<std::size_t>(rows * stride) * sizeof(T));
  for (auto& b : src) b = static_cast<unsigned char>(g());
  const T* s = reinterpret_cast<const T*>(src.data());
  // out of place: n random positions (repeats allowed, runs of consecutive ones from time to time),
  // then `ahead` more of the same source
  const index_t n = kvtest::uniform_int(g, 0, 200), ahead = kvtest::uniform_int(g, 0, 40);
  std::vector<pos_t> pos(static_cast<std::size_t>(n + ahead));  // exactly n + ahead: ASan sees overreads
  for (std::size_t i = 0; i < pos.size(); ++i)
    pos[i] = i > 0 && g() % 3 == 0 ? std::min<pos_t>(pos[i - 1] + 1, static_cast<pos_t>(rows - 1))
                                   : static_cast<pos_t>(kvtest::uniform_int(g, 0, rows - 1));
  const index_t dst_stride = stride + (n % 2);
  const std::size_t out_bytes = static_cast<std::size_t>(std::max<index_t>(1, n * dst_stride)) * sizeof(T);
  offset_bytes got(out_bytes, offset, 0xA5);
  std::vector<unsigned char> want(got.p, got.p + out_bytes);
  detail::gather_rows_with(c, reinterpret_cast<T*>(got.p), dst_stride, s, stride, pos.data(), 1, n, ahead, dim,
                           false, stream);
  for (index_t j = 0; j < n; ++j)
    std::memcpy(want.data() + static_cast<std::size_t>(j * dst_stride) * sizeof(T),
                src.data() + static_cast<std::size_t>(pos[j] * stride) * sizeof(T), row_bytes);
  REQUIRE(std::memcmp(got.p, want.data(), out_bytes) == 0);
  // in place: k ascending positions (runs and rows already in place included), every other one read
  // through a position stride of 2
  std::vector<pos_t> asc;
  for (pos_t p = 0; p < rows; ++p)
    if (g() % 3 != 0) asc.push_back(p);
  const index_t k = static_cast<index_t>(asc.size());
  std::vector<pos_t> strided(static_cast<std::size_t>(2 * k));
  for (index_t j = 0; j < k; ++j) strided[static_cast<std::size_t>(2 * j)] = asc[static_cast<std::size_t>(j)];
  offset_bytes cache(src.size(), offset, 0);
  std::memcpy(cache.p, src.data(), src.size());
  std::vector<unsigned char> ref = src;
  detail::gather_rows_with(c, reinterpret_cast<T*>(cache.p), stride, reinterpret_cast<const T*>(cache.p), stride,
                           strided.data(), 2, k, 0, dim, true, stream);
  for (index_t j = 0; j < k; ++j)
    std::memmove(ref.data() + static_cast<std::size_t>(j * stride) * sizeof(T),
                 ref.data() + static_cast<std::size_t>(asc[static_cast<std::size_t>(j)] * stride) * sizeof(T),
                 row_bytes);
  REQUIRE(std::memcmp(cache.p, ref.data(), src.size()) == 0);
}

}  // namespace

TEST_CASE("compact: every row copy of the host gather (bytes, SSE2, AVX2) gives one memcpy's bytes per row") {
  auto g = kvtest::rng(77);
  int ran = 0;
  for (detail::gather_copy c : {detail::gather_copy::bytes, detail::gather_copy::sse2, detail::gather_copy::avx2}) {
    CAPTURE(static_cast<int>(c));
    // row sizes: the constants of gather_rows_sized (128, 256, 512, 1024 bytes), other multiples of
    // 32 bytes, and sizes no vector copy takes
    for (index_t dim : {1, 3, 8, 16, 24, 32, 40, 64, 72, 128, 256}) {
      CAPTURE(dim);
      if (!detail::gather_copy_available(c, static_cast<std::size_t>(dim) * sizeof(float))) continue;
      for (index_t pad : {0, 1, 8}) gather_copy_matches_memcpy<float>(c, dim, dim + pad, g);
      ++ran;
    }
    for (index_t dim : {5, 16, 48, 64, 128, 256, 512}) {
      CAPTURE(dim);
      if (!detail::gather_copy_available(c, static_cast<std::size_t>(dim) * sizeof(float16))) continue;
      for (index_t pad : {0, 3, 16}) gather_copy_matches_memcpy<float16>(c, dim, dim + pad, g);
      ++ran;
    }
  }
  CHECK(ran >= 18);  // bytes on every size at least
}

TEST_CASE("compact: the host gather's streamed stores (aligned and misaligned destinations) give one memcpy's bytes") {
  // rows and strides of a multiple of 32 bytes take the non-temporal stores at offsets 0 and 32 and
  // the ordinary ones at offset 16; other strides and rows the ordinary ones
  auto g = kvtest::rng(78);
  for (detail::gather_copy c : {detail::gather_copy::bytes, detail::gather_copy::sse2, detail::gather_copy::avx2}) {
    CAPTURE(static_cast<int>(c));
    for (std::size_t offset : {std::size_t{0}, std::size_t{16}, std::size_t{32}})
      for (index_t dim : {8, 16, 24, 64, 128, 256}) {
        CAPTURE(offset);
        CAPTURE(dim);
        if (!detail::gather_copy_available(c, static_cast<std::size_t>(dim) * sizeof(float))) continue;
        for (index_t pad : {0, 8, 16}) gather_copy_matches_memcpy<float>(c, dim, dim + pad, g, true, offset);
        if (detail::gather_copy_available(c, static_cast<std::size_t>(dim) * sizeof(float16)))
          for (index_t pad : {0, 32}) gather_copy_matches_memcpy<float16>(c, dim, dim + pad, g, true, offset);
      }
  }
}

TEST_CASE("compact: outputs beyond the streaming size (non-temporal stores) equal the naive gather") {
  // outputs of at least detail::gather_stream_bytes (8 MiB) through the public calls: random kept rows with
  // runs of consecutive positions, k = 0, 1 and T, 64-byte aligned and misaligned outputs and caches,
  // row sizes the streamed stores take (d = 128 fp16 / fp32) and ones they do not (d = 100, 72 fp16)
  auto g = kvtest::rng(93);
  two_worker_executor ex;
  auto check = [&](auto zero, index_t H, index_t Tn, index_t D, index_t k, std::size_t offset) {
    using T = decltype(zero);
    CAPTURE(D);
    CAPTURE(k);
    CAPTURE(offset);
    // kept: runs of consecutive positions (a run continues with probability 1/2), ascending, distinct
    std::vector<pos_t> kept(static_cast<std::size_t>(H * k));
    for (index_t h = 0; h < H; ++h) {
      std::vector<pos_t> pick;
      std::vector<char> taken(static_cast<std::size_t>(Tn), 0);
      while (static_cast<index_t>(pick.size()) < k) {
        pos_t p = static_cast<pos_t>(kvtest::uniform_int(g, 0, Tn - 1));
        do {
          if (!taken[static_cast<std::size_t>(p)]) {
            taken[static_cast<std::size_t>(p)] = 1;
            pick.push_back(p);
          }
          ++p;
        } while (p < Tn && static_cast<index_t>(pick.size()) < k && g() % 2 == 0);
      }
      std::sort(pick.begin(), pick.end());
      std::copy(pick.begin(), pick.end(), kept.begin() + h * k);
    }
    std::vector<T> src(static_cast<std::size_t>(H * Tn * D));  // random bytes (NaN patterns too: bytes are copied)
    for (std::size_t i = 0; i < src.size() * sizeof(T); i += 8) {
      const std::uint64_t r = g();
      std::memcpy(reinterpret_cast<unsigned char*>(src.data()) + i, &r, std::min<std::size_t>(8, src.size() * sizeof(T) - i));
    }
    const auto src_view = value_of(make_kv_view(static_cast<const T*>(src.data()), H, Tn, D));
    const std::size_t out_bytes = static_cast<std::size_t>(std::max<index_t>(1, H * k * D)) * sizeof(T);
    auto run_all = [&](auto be) {
      offset_bytes out(out_bytes, offset, 0);
      T* o = reinterpret_cast<T*>(out.p);
      REQUIRE(compact(be, src_view, value_of(make_matrix_view(kept.data(), H, k)), value_of(make_kv_view(o, H, k, D)))
                  .ok());
      for (index_t h = 0; h < H; ++h)
        for (index_t j = 0; j < k; ++j)
          REQUIRE(std::memcmp(o + (h * k + j) * D, &src[static_cast<std::size_t>((h * Tn + kept[h * k + j]) * D)],
                              static_cast<std::size_t>(D) * sizeof(T)) == 0);
      // ragged view and ragged cache with the same positions
      std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1)), lens(static_cast<std::size_t>(H), -1);
      for (index_t h = 0; h <= H; ++h) cu[h] = static_cast<std::int32_t>(h * k);
      offset_bytes flat(out_bytes, offset, 0), rc(out_bytes, offset, 0);
      REQUIRE(compact(be, src_view, ragged_positions{kept.data(), cu.data(), H},
                      ragged_view<T>{reinterpret_cast<T*>(flat.p), cu.data(), H, D, D})
                  .ok());
      REQUIRE(std::memcmp(flat.p, out.p, out_bytes) == 0);
      REQUIRE(compact(be, src_view, ragged_positions{kept.data(), cu.data(), H},
                      ragged_cache<T>{reinterpret_cast<T*>(rc.p), cu.data(), lens.data(), H, D, D})
                  .ok());
      REQUIRE(std::memcmp(rc.p, out.p, out_bytes) == 0);
      for (index_t h = 0; h < H; ++h) REQUIRE(lens[static_cast<std::size_t>(h)] == k);
      // in place, dense and ragged (the cache's first k rows of every head become the kept rows)
      offset_bytes cache(src.size() * sizeof(T), offset, 0);
      std::memcpy(cache.p, src.data(), src.size() * sizeof(T));
      T* c = reinterpret_cast<T*>(cache.p);
      REQUIRE(compact_inplace(be, value_of(make_kv_view(c, H, Tn, D)), value_of(make_matrix_view(kept.data(), H, k)))
                  .ok());
      for (index_t h = 0; h < H; ++h)
        REQUIRE(std::memcmp(c + h * Tn * D, o + h * k * D, static_cast<std::size_t>(k * D) * sizeof(T)) == 0);
      std::memcpy(cache.p, src.data(), src.size() * sizeof(T));
      std::vector<std::int32_t> cap(static_cast<std::size_t>(H + 1)), full(static_cast<std::size_t>(H),
                                                                            static_cast<std::int32_t>(Tn));
      for (index_t h = 0; h <= H; ++h) cap[h] = static_cast<std::int32_t>(h * Tn);
      REQUIRE(compact_inplace(be, ragged_cache<T>{c, cap.data(), full.data(), H, D, D},
                              ragged_positions{kept.data(), cu.data(), H})
                  .ok());
      for (index_t h = 0; h < H; ++h) {
        REQUIRE(full[static_cast<std::size_t>(h)] == k);
        REQUIRE(std::memcmp(c + h * Tn * D, o + h * k * D, static_cast<std::size_t>(k * D) * sizeof(T)) == 0);
      }
    };
    run_all(seq);
    run_all(par);
    run_all(on(ex));
  };
  REQUIRE(detail::gather_streams(detail::gather_stream_bytes));
  REQUIRE(!detail::gather_streams(detail::gather_stream_bytes - 1));
  const index_t Tn = 9000;
  for (std::size_t offset : {std::size_t{0}, std::size_t{16}, std::size_t{32}}) {
    // fp32 d = 128: 512-byte rows, 2 heads x 8200 rows = 8.0 MiB (streams), blocks cut inside heads
    check(float{}, 2, Tn, 128, 8200, offset);
    // fp16 d = 128: 256-byte rows, 4 heads x 8200 rows
    check(float16{}, 4, Tn, 128, 8200, offset);
  }
  // k = T: 17000 rows of 512 bytes (8.3 MiB), every row already in place for compact_inplace
  check(float{}, 1, 17000, 128, 17000, 0);
  // rows the streamed stores do not take: 200 bytes (no vector copy), 144 bytes (not a multiple of 32)
  check(float16{}, 6, Tn, 100, 7000, 0);
  check(float16{}, 8, Tn, 72, 7300, 0);
  // below the streaming size: k = 0 and 1
  check(float{}, 2, Tn, 128, 0, 0);
  check(float{}, 2, Tn, 128, 1, 16);
}

TEST_CASE("compact: KV-sized rows over several blocks per head, seq / par / on(ex) equal the naive gather") {
  // d = 128 fp16 and d = 64 / 128 fp32 rows (the sizes the gather copies as constants), k above
  // detail::compact_block so that a head's rows span blocks (each prefetching into the next)
  auto g = kvtest::rng(91);
  two_worker_executor ex;
  auto check = [&](auto zero, index_t H, index_t Tn, index_t D, index_t k) {
    using T = decltype(zero);
    CAPTURE(D);
    CAPTURE(k);
    test_cache<T> src(H, Tn, D, layouts[0], g);
    const auto kept = random_kept(g, H, Tn, k, false);
    const auto asc = random_kept(g, H, Tn, k, true);
    auto run_all = [&](auto be) {
      std::vector<T> out(static_cast<std::size_t>(H * k * D));
      REQUIRE(compact(be, src.view, value_of(make_matrix_view(kept.data(), H, k)),
                      value_of(make_kv_view(out.data(), H, k, D)))
                  .ok());
      for (index_t h = 0; h < H; ++h)
        for (index_t j = 0; j < k; ++j)
          REQUIRE(std::memcmp(&out[static_cast<std::size_t>((h * k + j) * D)], &src.view(h, kept[h * k + j], 0),
                              static_cast<std::size_t>(D) * sizeof(T)) == 0);
      // ragged view with the same positions (blocks cut at head boundaries)
      std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1));
      for (index_t h = 0; h <= H; ++h) cu[h] = static_cast<std::int32_t>(h * k);
      std::vector<T> flat(out.size());
      REQUIRE(compact(be, src.view, ragged_positions{kept.data(), cu.data(), H},
                      ragged_view<T>{flat.data(), cu.data(), H, D, D})
                  .ok());
      REQUIRE(std::memcmp(flat.data(), out.data(), out.size() * sizeof(T)) == 0);
      test_cache<T> cache = src;
      cache.view = kv_view<T>(cache.buf.data(), src.view.mapping());
      REQUIRE(compact_inplace(be, cache.view, value_of(make_matrix_view(asc.data(), H, k))).ok());
      for (index_t h = 0; h < H; ++h)
        for (index_t j = 0; j < k; ++j)
          REQUIRE(std::memcmp(&cache.view(h, j, 0), &src.view(h, asc[h * k + j], 0),
                              static_cast<std::size_t>(D) * sizeof(T)) == 0);
    };
    run_all(seq);
    run_all(par);
    run_all(on(ex));
  };
  check(float16{}, 3, 700, 128, 300);
  check(float{}, 2, 600, 64, 260);
  check(float{}, 2, 400, 128, 129);
}

TEST_CASE("compact ragged: per-head kept counts, into a ragged_view and into a ragged_cache") {
  for (std::uint64_t seed = 10; seed < 30; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t H = kvtest::uniform_int(g, 1, 5), Tn = kvtest::uniform_int(g, 1, 40), D = kvtest::uniform_int(g, 1, 7);
    test_cache<float> src(H, Tn, D, layouts[seed % 4], g);
    std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1), 0);
    std::vector<pos_t> pos;
    for (index_t h = 0; h < H; ++h) {
      const index_t k = kvtest::uniform_int(g, 0, Tn);  // includes empty heads and whole heads
      const auto one = random_kept(g, 1, Tn, k, true);
      pos.insert(pos.end(), one.begin(), one.end());
      cu[h + 1] = cu[h] + static_cast<std::int32_t>(k);
    }
    ragged_positions kept{pos.data(), cu.data(), H};
    const index_t rows = cu.back();

    std::vector<float> flat(static_cast<std::size_t>(std::max<index_t>(1, rows * D)));
    ragged_view<float> rv{flat.data(), cu.data(), H, D, D};
    REQUIRE(compact(seq, src.view, kept, rv).ok());
    std::vector<float> flat_par(flat.size());
    ragged_view<float> rv_par{flat_par.data(), cu.data(), H, D, D};
    REQUIRE(compact(par, src.view, kept, rv_par).ok());
    CHECK(flat == flat_par);

    // ragged cache with 3 spare rows per head, then an append of 2 decode tokens
    std::vector<std::int32_t> cap(static_cast<std::size_t>(H + 1), 0), lens(static_cast<std::size_t>(H), -7);
    for (index_t h = 0; h < H; ++h) cap[h + 1] = cap[h] + (cu[h + 1] - cu[h]) + 3;
    const index_t row_stride = D + 1;
    std::vector<float> store(static_cast<std::size_t>(cap.back() * row_stride), -1.f);
    ragged_cache<float> rc{store.data(), cap.data(), lens.data(), H, D, row_stride};
    REQUIRE(compact(par, src.view, kept, rc).ok());
    for (index_t h = 0; h < H; ++h) {
      REQUIRE(lens[h] == cu[h + 1] - cu[h]);
      for (index_t j = 0; j < lens[h]; ++j)
        for (index_t d = 0; d < D; ++d) {
          REQUIRE(rv.row(h, j)[d] == src.view(h, pos[cu[h] + j], d));
          REQUIRE(rc.row(h, j)[d] == rv.row(h, j)[d]);
        }
    }
    test_cache<float> fresh(H, 2, D, layouts[0], g);
    REQUIRE(append(seq, rc, fresh.view).ok());
    for (index_t h = 0; h < H; ++h) {
      REQUIRE(lens[h] == cu[h + 1] - cu[h] + 2);
      for (index_t i = 0; i < 2; ++i)
        for (index_t d = 0; d < D; ++d) REQUIRE(rc.row(h, cu[h + 1] - cu[h] + i)[d] == fresh.view(h, i, d));
    }
    // a third and fourth append: only one spare row is left, so the second fails and writes nothing
    REQUIRE(append(par, rc, value_of(make_kv_view(fresh.buf.data(), H, 1, D))).ok());
    const auto before = store;
    const auto lens_before = lens;
    require_error(append(par, rc, value_of(make_kv_view(fresh.buf.data(), H, 1, D))), errc::capacity_exceeded,
                  "do not fit");
    CHECK(store == before);
    CHECK(lens == lens_before);

    // in place on the ragged cache: keep every other row of each head
    std::vector<std::int32_t> cu2(static_cast<std::size_t>(H + 1), 0);
    std::vector<pos_t> pos2;
    for (index_t h = 0; h < H; ++h) {
      for (pos_t j = 0; j < lens[h]; j += 2) pos2.push_back(j);
      cu2[h + 1] = static_cast<std::int32_t>(pos2.size());
    }
    const auto snapshot = store;
    const auto old_lens = lens;
    REQUIRE(compact_inplace(par, rc, ragged_positions{pos2.data(), cu2.data(), H}).ok());
    for (index_t h = 0; h < H; ++h) {
      REQUIRE(lens[h] == (old_lens[h] + 1) / 2);
      for (index_t j = 0; j < lens[h]; ++j)
        for (index_t d = 0; d < D; ++d)
          REQUIRE(rc.row(h, j)[d] == snapshot[static_cast<std::size_t>((cap[h] + 2 * j) * row_stride + d)]);
    }
  }
}

TEST_CASE("compact: bad input gives specific errors and writes nothing") {
  std::vector<float> cache(2 * 4 * 3, 1.f), out(2 * 2 * 3, 0.f);
  auto src = value_of(make_kv_view(cache.data(), 2, 4, 3));
  auto dst = value_of(make_kv_view(out.data(), 2, 2, 3));
  std::vector<pos_t> kept = {0, 4, 1, 2};  // 4 is out of range
  auto kv = value_of(make_matrix_view(kept.data(), 2, 2));
  require_error(compact(seq, src, kv, dst), errc::out_of_range, "kept[0][1] = 4 is outside [0, 4)");
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.f; }));
  kept[1] = -1;
  require_error(compact(par, src, kv, dst), errc::out_of_range, "= -1");

  kept = {0, 1, 1, 2};
  auto wrong_dst = value_of(make_kv_view(out.data(), 2, 1, 3));
  require_error(compact(seq, src, kv, wrong_dst), errc::shape_mismatch, "dst holds 1 tokens per head but kept lists 2");
  auto wrong_dim = value_of(make_kv_view(out.data(), 2, 2, 2));
  require_error(compact(seq, src, kv, wrong_dim), errc::shape_mismatch, "head dims differ");
  auto one_head = value_of(make_matrix_view(kept.data(), 1, 2));
  require_error(compact(seq, src, one_head, dst), errc::shape_mismatch, "head counts differ");

  // src and dst sharing memory: refused out of place, allowed (ascending) in place
  auto alias_dst = value_of(make_kv_view(cache.data() + 6, 2, 2, 3));
  require_error(compact(seq, src, kv, alias_dst), errc::overlap, "use compact_inplace");
  std::vector<pos_t> unsorted = {2, 1, 0, 3};
  require_error(compact_inplace(seq, src, value_of(make_matrix_view(unsorted.data(), 2, 2))), errc::not_sorted,
                "strictly ascending");
  std::vector<pos_t> dup = {1, 1, 0, 3};
  require_error(compact_inplace(seq, src, value_of(make_matrix_view(dup.data(), 2, 2))), errc::not_sorted,
                "kept[0][1] = 1 follows 1");

  // kept positions stored inside the destination would be overwritten while being read
  std::vector<float> mixed(64);
  auto dst_m = value_of(make_kv_view(mixed.data(), 2, 2, 3));
  auto kept_in_dst = value_of(make_matrix_view(reinterpret_cast<const pos_t*>(mixed.data()), 2, 2));
  require_error(compact(seq, src, kept_in_dst, dst_m), errc::overlap, "kept and dst");

  // a hand-built view with null data and elements
  using exts = cuda::std::dextents<index_t, 3>;
  kv_view<float> null_src(nullptr, cuda::std::layout_stride::mapping<exts>(exts(2, 4, 3), cuda::std::array<index_t, 3>{12, 3, 1}));
  require_error(compact(seq, null_src, kv, dst), errc::null_pointer, "compact: src: data is null");
}

TEST_CASE("compact ragged: bad offsets, capacity and lengths") {
  std::vector<float> cache(2 * 4 * 2, 1.f), out(16, 0.f);
  auto src = value_of(make_kv_view(cache.data(), 2, 4, 2));
  const std::vector<pos_t> pos = {0, 3, 1};
  const std::int32_t cu[] = {0, 2, 3};
  const std::int32_t other_cu[] = {0, 1, 3};
  ragged_positions kept{pos.data(), cu, 2};
  require_error(compact(seq, src, kept, ragged_view<float>{out.data(), other_cu, 2, 2, 2}), errc::shape_mismatch,
                "dst.cu_lens[1] = 1 but kept.cu[1] = 2");
  require_error(compact(seq, src, kept, ragged_view<float>{out.data(), cu, 2, 2, 1}), errc::invalid_argument,
                "row_stride (1) must be positive and >= dim (2)");
  const std::int32_t bad_cu[] = {0, 2, 1};
  require_error(compact(seq, src, ragged_positions{pos.data(), bad_cu, 2}, ragged_view<float>{out.data(), cu, 2, 2, 2}),
                errc::invalid_argument, "decreases at head 1");

  const std::int32_t small_cap[] = {0, 1, 3};
  std::int32_t lens[2] = {0, 0};
  require_error(compact(seq, src, kept, ragged_cache<float>{out.data(), small_cap, lens, 2, 2, 2}),
                errc::capacity_exceeded, "head 0 keeps 2 rows but has capacity for 1");
  const std::int32_t cap[] = {0, 3, 6};
  ragged_cache<float> rc{out.data(), cap, lens, 2, 2, 2};
  REQUIRE(compact(seq, src, kept, rc).ok());
  lens[1] = 9;  // corrupted length
  require_error(compact_inplace(seq, rc, kept), errc::out_of_range, "cache.lens[1] = 9 is outside [0, 3]");
  lens[1] = 1;
  const std::vector<pos_t> past_len = {0, 1, 1};  // head 1 holds 1 row: position 1 is past its length
  require_error(compact_inplace(seq, rc, ragged_positions{past_len.data(), cu, 2}), errc::out_of_range,
                "kept position 1 of head 1 is outside [0, 1)");
  auto wrong_rows = value_of(make_kv_view(cache.data(), 3, 1, 2));
  require_error(append(seq, rc, wrong_rows), errc::shape_mismatch, "cache has 2 heads");
}

TEST_CASE("compact ragged: offsets or lengths stored inside the rows a call writes are refused, nothing written") {
  // issue 17: compact into a ragged_cache whose lens lay inside dst's rows returned OK and
  // corrupted a kept row. Every int32 array a ragged call reads or writes is checked against what
  // it writes. One buffer holds the rows; the metadata is placed inside it.
  const index_t H = 2, T = 4, D = 2;
  std::vector<float> src_buf(H * T * D);
  std::iota(src_buf.begin(), src_buf.end(), 1.f);
  const auto src = value_of(make_kv_view<const float>(src_buf.data(), H, T, D));
  const std::vector<pos_t> pos = {0, 2, 1, 3};
  const std::int32_t cu[] = {0, 2, 4};
  const ragged_positions kept(pos.data(), cu, H);

  // rows for capacity 3 per head (6 rows x 2 floats) followed by room for metadata in the same buffer
  alignas(8) std::int32_t block[32] = {};
  float* rows = reinterpret_cast<float*>(block);
  std::int32_t capacity[] = {0, 3, 6};
  std::int32_t lens[] = {0, 0};
  const auto untouched = [&] { return std::all_of(block, block + 12, [](std::int32_t x) { return x == 0; }); };

  // lens inside dst's rows (the reported case), and inside src, kept or the offsets
  ragged_cache<float> dst{rows, capacity, block + 5, H, D, D};
  require_error(compact(seq, src, kept, dst), errc::overlap, "dst and dst.lens overlap");
  CHECK(untouched());
  dst.lens = const_cast<std::int32_t*>(cu);
  require_error(compact(seq, src, kept, dst), errc::overlap, "kept.cu and dst.lens overlap");
  dst.lens = reinterpret_cast<std::int32_t*>(src_buf.data());
  require_error(compact(seq, src, kept, dst), errc::overlap, "src and dst.lens overlap");
  dst.lens = const_cast<std::int32_t*>(pos.data());
  require_error(compact(seq, src, kept, dst), errc::overlap, "kept and dst.lens overlap");
  dst.lens = capacity + 1;
  require_error(compact(seq, src, kept, dst), errc::overlap, "dst.cu_capacity and dst.lens overlap");
  // the capacity offsets inside the rows
  std::int32_t* cap_in_rows = block + 8;
  cap_in_rows[0] = 0, cap_in_rows[1] = 3, cap_in_rows[2] = 6;  // 12 floats of rows: block[0, 12)
  ragged_cache<float> dst2{rows, cap_in_rows, lens, H, D, D};
  require_error(compact(seq, src, kept, dst2), errc::overlap, "dst.cu_capacity and dst overlap");
  cap_in_rows[0] = cap_in_rows[1] = cap_in_rows[2] = 0;
  dst.lens = lens;
  REQUIRE(compact(seq, src, kept, dst).ok());  // the same call with separate metadata works
  CHECK(lens[0] == 2);
  CHECK(rows[2] == 5.f);  // head 0 row 1 = src[0][2]

  // into a ragged_view: kept.cu or cu_lens inside the rows
  std::fill(block, block + 32, 0);
  std::int32_t* cu_in_rows = block + 4;
  cu_in_rows[0] = 0, cu_in_rows[1] = 2, cu_in_rows[2] = 4;
  ragged_view<float> view{rows, cu_in_rows, H, D, D};
  require_error(compact(seq, src, ragged_positions(pos.data(), cu_in_rows, H), view), errc::overlap,
                "kept.cu and dst overlap");
  std::int32_t cu_copy[] = {0, 2, 4};
  require_error(compact(seq, src, ragged_positions(pos.data(), cu_copy, H), view), errc::overlap,
                "dst.cu_lens and dst overlap");

  // in place and append: the cache's own lens inside its rows
  std::fill(block, block + 32, 0);
  std::int32_t* lens_in_rows = block + 2;
  lens_in_rows[0] = 2, lens_in_rows[1] = 2;
  std::int32_t cap[] = {0, 3, 6};
  ragged_cache<float> cache{rows, cap, lens_in_rows, H, D, D};
  const pos_t keep_one[] = {1, 0};
  const std::int32_t cu_one[] = {0, 1, 2};
  require_error(compact_inplace(seq, cache, ragged_positions(keep_one, cu_one, H)), errc::overlap,
                "cache and cache.lens overlap");
  const float more[] = {9, 9, 9, 9};
  const auto more_v = value_of(make_kv_view<const float>(more, H, 1, D));
  require_error(append(seq, cache, more_v), errc::overlap, "cache and cache.lens overlap");
  std::int32_t ok_lens[] = {2, 2};
  cache.lens = ok_lens;
  cache.cu_capacity = cu_in_rows;  // offsets inside the rows
  cu_in_rows[0] = 0, cu_in_rows[1] = 3, cu_in_rows[2] = 6;
  require_error(append(seq, cache, more_v), errc::overlap, "cache.cu_capacity and cache overlap");
  require_error(compact_inplace(seq, cache, ragged_positions(keep_one, cu_one, H)), errc::overlap,
                "cache.cu_capacity and cache overlap");
  CHECK(ok_lens[0] == 2);
  CHECK(ok_lens[1] == 2);
}
