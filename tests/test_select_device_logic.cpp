// The CUDA selection kernels run on the host. The kernels of kvevict/cuda/select.cuh are the ops of
// detail/block/select_ops.hpp (grid-stride loops, tickets, fences and barriers around the
// host-device functions of detail/block/select_block.hpp), launched by launch sequences written once
// for the GPU and the host; here those same sequences run on the SIMT executor (256 fibers per
// block, real barriers, warp shuffles, interleaved blocks, shared-memory race checks on the
// context's accesses) and the results are compared bit for bit with the host select_topk /
// select_topk_flat (seq). Also: the per-digit and per-key pieces one by one under the serial
// host_block at several block sizes (bucket predicate, emit rule, chunked emit, padded shared-memory
// banks), the plans and the workspace formula.
#include <kvevict/detail/block/host_block.hpp>
#include "support.hpp"

#include <kvevict/detail/block/select_block.hpp>
#include <kvevict/detail/block/select_ops.hpp>
#include <kvevict/detail/block/simt.hpp>
#include <kvevict/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

using namespace kvevict;
using kvevict::detail::ucount;
using kvtest::value_of;
using namespace kvtest::floats;

namespace {

using kvevict::detail::host_block;

// ---- scores ---------------------------------------------------------------------------------------

enum class dist { uniform, ties3, all_equal, specials, wide, pooled };
const dist all_dists[] = {dist::uniform, dist::ties3, dist::all_equal, dist::specials, dist::wide, dist::pooled};

float draw(std::mt19937_64& g, dist d, index_t i) {
  switch (d) {
    case dist::uniform: return std::uniform_real_distribution<float>(0.f, 1.f)(g);
    case dist::ties3: return static_cast<float>(kvtest::uniform_int(g, 0, 2));
    case dist::all_equal: return 0.5f;
    case dist::specials: {
      static const float pool[] = {qnan, -qnan, from_bits(0xffc12345u), inf, -inf, 0.f, -0.f, 1.f, -1.f,
                                   std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()};
      const auto k = kvtest::uniform_int(g, 0, 2 * static_cast<std::int64_t>(std::size(pool)));
      return k < static_cast<std::int64_t>(std::size(pool)) ? pool[k] : std::uniform_real_distribution<float>(-2.f, 2.f)(g);
    }
    case dist::wide: return from_bits(static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 0xffffffffLL)));
    case dist::pooled: return static_cast<float>((i / 7) % 50) * 0.01f;  // runs of equal values, like max pooling
  }
  return 0.f;
}

struct scores_t {
  index_t R, T, stride;
  std::vector<float> buf;
  matrix_view<const float> view;
  scores_t(std::mt19937_64& g, index_t r, index_t t, dist d, index_t pad) : R(r), T(t), stride(t + pad) {
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, R * stride)), -5.f);
    for (index_t i = 0; i < R; ++i)
      for (index_t j = 0; j < T; ++j) buf[static_cast<std::size_t>(i * stride + j)] = draw(g, d, j);
    view = value_of(make_matrix_view(static_cast<const float*>(buf.data()), R, T, std::max<index_t>(1, stride)));
  }
  detail::score_keys keys(index_t r) const { return {view.data_handle() + r * view.stride(0), view.stride(1)}; }
};

// ---- the launch sequences of kvevict/cuda/select.cuh, run on the SIMT executor ------------------

/// Runs the CUDA launch sequences (detail/block/select_ops.hpp: the same ops and the same sequence
/// the CUDA overloads launch) on the host SIMT executor: 256 fibers per block, real barriers and
/// warp shuffles, blocks interleaved (the multi-block tickets taken in the schedule's order).
/// `cap` bounds the grids (a small one makes every kernel's grid-stride loop take several items).
struct emulator {
  std::mt19937_64& g;
  index_t cap = index_t(1) << 20;
  std::vector<unsigned char> mem;
  workspace ws;
  int bad = 0;

  /// Two-phase workspace, filled with garbage except the part the launcher zeroes.
  template <class Carve>
  auto carve(Carve&& f) {
    workspace q;
    detail::workspace_carver c1(q);
    (void)f(c1, q);
    REQUIRE(c1.finish("emulator").ok());
    ws = kvtest::shifted_workspace(mem, q.bytes, 0xa5);
    detail::workspace_carver c2(ws);
    auto w = f(c2, ws);
    REQUIRE(c2.finish("emulator").ok());
    return w;
  }
  static void zero(const detail::select_dev_ws& w) {
    if (w.zero_bytes > 0) std::memset(w.zero_begin, 0, w.zero_bytes);
  }
  /// Runs launch(launcher) on a fresh executor; REQUIREs that no race, divergence or deadlock
  /// was reported.
  index_t drop = 0;              ///< the executor's drop_barrier (a deliberately missing barrier)
  std::string* error = nullptr;  ///< set: the executor's report goes here instead of being REQUIREd empty
  template <class Launch>
  void on_executor(Launch&& launch) {
    detail::simt_executor ex(g(), 0);
    ex.resident(1 + static_cast<index_t>(g() % 4));
    ex.preempt_one_in(16);
    ex.drop_barrier(drop);
    detail::simt_launcher<detail::simt_executor> l{ex};
    launch(l);
    if (error != nullptr) {
      *error = ex.error();
      return;
    }
    REQUIRE_MESSAGE(l.ok, ex.error());
  }

  void dense(const scores_t& s, const std::int32_t* lengths, matrix_view<pos_t> kept, int algo) {
    const detail::select_plan plan = detail::plan_select(s.R, s.T, algo);
    const auto w = carve([&](detail::workspace_carver& c, const workspace& wsp) {
      return detail::carve_select_dev_ws(c, wsp, s.R, plan, false);
    });
    zero(w);
    const detail::dense_rows rows{lengths, s.T, kept.extent(1), kept.data_handle(), kept.stride(0), kept.stride(1)};
    on_executor([&](auto& l) { detail::select_rows_launch(l, s.view, rows, w, plan, false, true, {&bad, nullptr}, cap); });
  }
  void ragged(const scores_t& s, const std::int32_t* lengths, ragged_positions_out kept, index_t capacity, int algo) {
    const detail::select_plan plan = detail::plan_select(s.R, s.T, algo);
    const auto w = carve([&](detail::workspace_carver& c, const workspace& wsp) {
      return detail::carve_select_dev_ws(c, wsp, s.R, plan, false);
    });
    zero(w);
    const detail::ragged_rows rows{lengths, s.T, kept.cu, kept.pos, s.R, capacity};
    on_executor([&](auto& l) { detail::select_rows_launch(l, s.view, rows, w, plan, false, true, {&bad, nullptr}, cap); });
  }
  void flat(const scores_t& s, const std::int32_t* lengths, index_t total, const std::int32_t* floors,
            std::int32_t* cu, pos_t* pos, int algo) {
    const index_t R = s.R, T = s.T;
    const detail::select_plan plan = detail::plan_select(R, T, algo);
    const auto w = carve([&](detail::workspace_carver& c, const workspace& wsp) {
      return detail::carve_flat_dev_ws(c, wsp, R, T, plan);
    });
    zero(w.sel);
    on_executor([&](auto& l) {
      detail::select_flat_launch(l, s.view, lengths, total, floors, cu, pos, w, plan, {&bad, nullptr}, cap);
    });
  }
};

// ---- host references --------------------------------------------------------------------------

std::vector<unsigned char> g_host_ws;
template <class F>
void with_ws(F&& f) {
  workspace q;
  REQUIRE(f(q).ok());
  workspace ws = kvtest::shifted_workspace(g_host_ws, q.bytes);
  REQUIRE(f(ws).ok());
}

const int algos[] = {1, 2, 0};  // one block, multi-block, auto
const index_t grid_caps[] = {index_t(1) << 20, 3, 1};  // grids of every size, of 3 blocks, of 1 block

}  // namespace

// ---- the pieces ---------------------------------------------------------------------------------

TEST_CASE("device logic: radix_bucket_holds picks exactly radix_choose_bucket's bucket") {
  auto g = kvtest::rng(1);
  for (int trial = 0; trial < 3000; ++trial) {
    const int bins = trial % 3 == 0 ? 8 : trial % 3 == 1 ? 1024 : 2048;
    std::vector<std::uint32_t> hist(static_cast<std::size_t>(bins), 0);
    const int fill = static_cast<int>(kvtest::uniform_int(g, 1, 6));
    for (auto& h : hist)
      h = kvtest::uniform_int(g, 0, fill) == 0 ? static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 9)) : 0u;
    hist[static_cast<std::size_t>(kvtest::uniform_int(g, 0, bins - 1))] += 1;
    const index_t total = std::accumulate(hist.begin(), hist.end(), index_t(0));
    for (int rep = 0; rep < 8; ++rep) {
      const index_t k = rep == 0 ? 1 : rep == 1 ? total : kvtest::uniform_int(g, 1, total);
      const detail::radix_bucket ref = detail::radix_choose_bucket(hist.data(), bins, k);
      int chosen = 0;
      index_t above = 0;
      for (int b = bins - 1; b >= 0; --b) {
        if (detail::radix_bucket_holds(static_cast<std::uint32_t>(b), above, hist[b], k)) {
          ++chosen;
          CHECK(static_cast<std::uint32_t>(b) == ref.bucket);
          CHECK(above == ref.above);
          CHECK(index_t(hist[b]) == ref.count);
        }
        above += hist[b];
      }
      REQUIRE(chosen == 1);
      // the block-parallel choice (block_choose) over several block sizes
      for (int threads : {256, 33, 1}) {
        host_block blk(threads, g);
        detail::select_smem sm{};
        const detail::radix_bucket b = detail::block_choose(blk, [&](int bin) { return hist[bin]; }, bins, k, sm);
        REQUIRE(b.bucket == ref.bucket);
        REQUIRE(b.above == ref.above);
        REQUIRE(b.count == ref.count);
      }
    }
  }
  CHECK_FALSE(detail::radix_bucket_holds(3u, 0, 5, 0));  // k <= 0: no bucket
}

TEST_CASE("device logic: the ordered emit rule equals the sequential keep rule, for any chunking") {
  auto g = kvtest::rng(2);
  for (int trial = 0; trial < 2000; ++trial) {
    const index_t n = kvtest::uniform_int(g, 0, 300);
    std::vector<std::uint32_t> keys(static_cast<std::size_t>(n));
    for (auto& k : keys) k = static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 5)) << 20 | static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 3));
    detail::radix_threshold t;
    t.mask = trial % 2 ? 0xfff00000u : 0xffffffffu;
    t.prefix = static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 5)) << 20 | (trial % 2 ? 0u : static_cast<std::uint32_t>(kvtest::uniform_int(g, 0, 3)));
    index_t tied = 0;
    for (auto k : keys) tied += detail::radix_tied(k, t) ? 1 : 0;
    t.ties = kvtest::uniform_int(g, 0, tied + 2);
    // sequential reference
    std::vector<index_t> ref;
    index_t ties = t.ties;
    for (index_t i = 0; i < n; ++i)
      if (detail::radix_keep(keys[i], t, ties)) ref.push_back(i);
    // chunked: each chunk starts from the sum of the earlier chunks' packed counts
    std::vector<index_t> got(ref.size(), -1);
    index_t written = 0;
    ucount before = 0;
    for (index_t b = 0; b < n;) {
      const index_t e = std::min(n, b + kvtest::uniform_int(g, 1, 40));
      ucount running = before;
      for (index_t i = b; i < e; ++i) {
        const ucount f = detail::emit_flag(keys[i], t);
        index_t slot = -1;
        if (detail::emit_keep(running, f, t.ties, slot)) {
          REQUIRE(slot >= 0);
          REQUIRE(slot < index_t(got.size()));
          REQUIRE(got[slot] == -1);
          got[slot] = i;
          ++written;
        }
        running += f;
      }
      ucount chunk = 0;
      for (index_t i = b; i < e; ++i) chunk += detail::emit_flag(keys[i], t);
      before += chunk;
      REQUIRE(detail::emit_count(before, t.ties) == written);
      b = e;
    }
    REQUIRE(got == ref);
  }
}

TEST_CASE("device logic: padded shared-memory keys hit 32 distinct banks per warp access") {
  // striped (thread t reads key base + t) and blocked emit reads (thread t reads 8t + j), per warp
  for (index_t base : {index_t(0), index_t(32), index_t(2048), index_t(4096 + 64)}) {
    for (int w = 0; w < 8; ++w) {
      std::vector<int> striped, blocked[detail::emit_items];
      for (int lane = 0; lane < 32; ++lane) {
        const index_t t = w * 32 + lane;
        striped.push_back(static_cast<int>(detail::smem_pad(base + t) % 32));
        for (int j = 0; j < detail::emit_items; ++j)
          blocked[j].push_back(static_cast<int>(detail::smem_pad(base + t * detail::emit_items + j) % 32));
      }
      auto distinct = [](std::vector<int> v) {
        std::sort(v.begin(), v.end());
        return std::unique(v.begin(), v.end()) == v.end();
      };
      CHECK(distinct(striped));
      for (auto& b : blocked) CHECK(distinct(b));
    }
  }
  CHECK(detail::smem_padded_size(detail::key_cache_keys) == 8192 + 256);
  CHECK(detail::smem_pad(detail::key_cache_keys - 1) < detail::smem_padded_size(detail::key_cache_keys));
  CHECK(sizeof(detail::select_smem) <= 42008u);  // docs/cuda.md: 41 KiB + the scan's 2336 B < 48 KiB
}

TEST_CASE("device logic: plans cover every position with bounded grids") {
  const index_t tile = index_t(detail::select_block_threads) * detail::emit_items;
  for (index_t R : {index_t(1), index_t(3), index_t(8), index_t(127), index_t(128), index_t(4096), index_t(65536)}) {
    for (index_t T : {index_t(0), index_t(1), index_t(2047), index_t(32767), index_t(32768), index_t(100000), index_t(1) << 20, index_t(INT32_MAX)}) {
      CAPTURE(R);
      CAPTURE(T);
      const auto a = detail::plan_select(R, T, 0);
      CHECK(a.multi == (T >= 32768 && R < 128));
      CHECK_FALSE(detail::plan_select(R, T, 1).multi);
      const auto m = detail::plan_select(R, T, 2);
      CHECK(m.multi);
      CHECK(m.chunk % tile == 0);
      CHECK(m.chunk * m.chunks >= T);
      CHECK((m.chunks - 1) * m.chunk < std::max<index_t>(T, 1));  // no empty chunk
      CHECK(m.chunks <= std::max<index_t>(1, (512 + R - 1) / R));
      CHECK((m.chunk >= 8192 || m.chunks == 1));
      CHECK(m.chunks * R <= std::max<index_t>(R, 512 + R));
    }
  }
}

TEST_CASE("device logic: ragged offsets in device memory are validated row by row") {
  const std::int32_t good[] = {0, 2, 2, 5};
  index_t k = -1;
  CHECK(detail::ragged_row_ok(good, 0, 3, -1, true, k));
  CHECK(k == 2);
  CHECK(detail::ragged_row_ok(good, 1, 3, -1, false, k));  // empty row: null pos is fine
  CHECK(k == 0);
  CHECK_FALSE(detail::ragged_row_ok(good, 2, 3, -1, false, k));
  CHECK(detail::ragged_row_ok(good, 2, 3, 5, true, k));
  CHECK_FALSE(detail::ragged_row_ok(good, 2, 3, 4, true, k));  // the list outgrows the stated capacity
  const std::int32_t start[] = {1, 2, 3};
  CHECK_FALSE(detail::ragged_row_ok(start, 1, 2, -1, true, k));
  const std::int32_t down[] = {0, 4, 2, 6};
  CHECK(detail::ragged_row_ok(down, 0, 3, -1, true, k));
  CHECK_FALSE(detail::ragged_row_ok(down, 1, 3, -1, true, k));
  CHECK(detail::ragged_row_ok(down, 2, 3, -1, true, k));  // writes [2, 6): still inside [0, cu[R])
  const std::int32_t past[] = {0, 7, 5};
  CHECK_FALSE(detail::ragged_row_ok(past, 0, 2, -1, true, k));  // cu[1] > cu[R]
  const std::int32_t neg[] = {0, -3, 2};
  CHECK_FALSE(detail::ragged_row_ok(neg, 0, 2, -1, true, k));
  CHECK_FALSE(detail::ragged_row_ok(neg, 1, 2, -1, true, k));
  CHECK(detail::row_length_ok(0, 0));
  CHECK_FALSE(detail::row_length_ok(-1, 10));
  CHECK_FALSE(detail::row_length_ok(11, 10));
}

TEST_CASE("device logic: workspace sizes (docs/cuda.md)") {
  for (index_t R : {index_t(0), index_t(1), index_t(5), index_t(300)}) {
    for (index_t T : {index_t(10), index_t(40000)}) {
      for (int algo : {1, 2}) {
        CAPTURE(R);
        CAPTURE(T);
        CAPTURE(algo);
        const auto plan = detail::plan_select(R, T, algo);
        workspace q;
        detail::workspace_carver c(q);
        const auto w = detail::carve_select_dev_ws(c, q, R, plan, false);
        REQUIRE(c.finish("t").ok());
        const std::size_t r = static_cast<std::size_t>(R), C = static_cast<std::size_t>(plan.chunks);
        const std::size_t exact = algo == 1 ? 4 : 4 + 3 * 8192 * r + 12 * r + sizeof(detail::row_state) * r + 8 * C * r;
        const std::size_t pieces = algo == 1 ? 1 : 5;
        CHECK(q.bytes >= exact);
        CHECK(q.bytes <= exact + 64 * pieces);
        CHECK(w.zero_bytes <= q.bytes);
        workspace fq;
        detail::workspace_carver fc(fq);
        (void)detail::carve_flat_dev_ws(fc, fq, R, T, plan);
        REQUIRE(fc.finish("t").ok());
        const std::size_t flat = 4 + sizeof(detail::flat_dev_layer) + 3 * 8192 * r + 3 * 2048 * 8 + 24 +
                                 (algo == 2 ? 3 * 8192 * r + 12 * r + 8 * C * r : 0) +
                                 (sizeof(detail::row_state) + sizeof(detail::flat_dev_row)) * r;
        CHECK(fq.bytes >= flat);
        CHECK(fq.bytes <= flat + 64 * 10);
      }
    }
  }
  CHECK(sizeof(detail::row_state) == 48u);
  CHECK(sizeof(detail::flat_dev_row) == 88u);
}

// ---- whole calls, emulated, against the host backend ---------------------------------------------

TEST_CASE("device logic: dense and ragged top-k, one block and several blocks per row, match select_topk") {
  std::uint64_t seed = 100;
  for (int trial = 0; trial < 60; ++trial, ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const dist d = all_dists[trial % std::size(all_dists)];
    const index_t R = kvtest::uniform_int(g, 0, 5);
    const index_t T = trial % 9 == 0 ? kvtest::uniform_int(g, 8000, 20000) : kvtest::uniform_int(g, 0, 3000);
    scores_t s(g, R, T, d, trial % 3 == 1 ? 3 : 0);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(std::max<index_t>(R, 1)));
    index_t min_len = T;
    for (index_t r = 0; r < R; ++r) {
      lens[r] = static_cast<std::int32_t>(trial % 2 ? T : kvtest::uniform_int(g, 0, T));
      min_len = std::min<index_t>(min_len, lens[r]);
    }
    const int kind = trial % 4;
    const index_t k = kind == 0 ? 0 : kind == 1 ? min_len : kvtest::uniform_int(g, 0, min_len);
    const int algo = algos[trial % 3];
    const index_t cap = grid_caps[(trial / 3) % 3];
    CAPTURE(R);
    CAPTURE(T);
    CAPTURE(k);
    CAPTURE(algo);
    CAPTURE(cap);
    CAPTURE(static_cast<int>(d));

    // dense
    std::vector<pos_t> ref(static_cast<std::size_t>(std::max<index_t>(1, R * k)), -1), got(ref);
    auto ref_view = value_of(make_matrix_view(ref.data(), R, k));
    with_ws([&](workspace& ws) { return select_topk(seq, ws, s.view, lens.data(), ref_view); });
    emulator em{g, cap, {}, {}, 0, 0, nullptr};
    em.dense(s, lens.data(), value_of(make_matrix_view(got.data(), R, k)), algo);
    CHECK(em.bad == 0);
    REQUIRE(got == ref);

    // ragged: per-row budgets
    std::vector<std::int32_t> cu(static_cast<std::size_t>(R + 1), 0);
    for (index_t r = 0; r < R; ++r) {
      const int kk = static_cast<int>(kvtest::uniform_int(g, 0, 3));
      const index_t kr = kk == 0 ? 0 : kk == 1 ? lens[r] : kvtest::uniform_int(g, 0, lens[r]);
      cu[r + 1] = cu[r] + static_cast<std::int32_t>(kr);
    }
    std::vector<pos_t> rref(static_cast<std::size_t>(std::max(1, cu.back())), -1), rgot(rref);
    with_ws([&](workspace& ws) {
      return select_topk(seq, ws, s.view, lens.data(), ragged_positions_out{rref.data(), cu.data(), R});
    });
    emulator er{g, cap, {}, {}, 0};
    er.ragged(s, lens.data(), ragged_positions_out{rgot.data(), cu.data(), R}, trial % 2 ? cu.back() : -1, algo);
    CHECK(er.bad == 0);
    REQUIRE(rgot == rref);
  }
}

TEST_CASE("device logic: bad device-resident arguments skip exactly the bad rows") {
  auto g = kvtest::rng(7);
  const index_t R = 6, T = 500;
  scores_t s(g, R, T, dist::uniform, 0);
  for (int algo : {1, 2}) {
    CAPTURE(algo);
    // dense: rows 1 (too long), 3 (negative) and 4 (shorter than k) are skipped, the others exact
    const std::vector<std::int32_t> lens = {500, 501, 300, -1, 40, 499};
    const index_t k = 50;
    std::vector<pos_t> got(static_cast<std::size_t>(R * k), -7);
    emulator em{g, index_t(1) << 20, {}, {}, 0, 0, nullptr};
    em.dense(s, lens.data(), value_of(make_matrix_view(got.data(), R, k)), algo);
    CHECK(em.bad == 3);
    for (index_t r = 0; r < R; ++r) {
      const bool bad = r == 1 || r == 3 || r == 4;
      std::vector<pos_t> row(got.begin() + r * k, got.begin() + (r + 1) * k);
      if (bad) {
        CHECK(std::all_of(row.begin(), row.end(), [](pos_t p) { return p == -7; }));
      } else {
        std::vector<pos_t> ref(static_cast<std::size_t>(k));
        const std::int32_t one_len[] = {lens[r]};
        const auto one = value_of(make_matrix_view(static_cast<const float*>(s.buf.data()) + r * T, 1, T));
        with_ws([&](workspace& ws) { return select_topk(seq, ws, one, one_len, value_of(make_matrix_view(ref.data(), 1, k))); });
        CHECK(row == ref);
      }
    }
    // ragged: a decreasing offset (row 2), a budget above the length (row 4), capacity too small
    const std::vector<std::int32_t> lens2(static_cast<std::size_t>(R), 100);
    const std::vector<std::int32_t> cu = {0, 10, 30, 20, 40, 200, 220};
    std::vector<pos_t> pos(220, -7);
    emulator er{g, index_t(1) << 20, {}, {}, 0};
    er.ragged(s, lens2.data(), ragged_positions_out{pos.data(), cu.data(), R}, -1, algo);
    CHECK(er.bad == 2);  // row 2: cu[2] = 30 > cu[3] = 20; row 4: 160 positions but 100 long
    CHECK(std::all_of(pos.begin() + 40, pos.begin() + 200, [](pos_t p) { return p == -7; }));  // row 4 skipped
    for (index_t r : {0, 5}) {  // valid rows are exact (rows 1 and 3 write inside [0, cu[R]) too)
      std::vector<pos_t> ref(static_cast<std::size_t>(cu[r + 1] - cu[r]));
      const std::int32_t one_len[] = {100};
      const auto one = value_of(make_matrix_view(static_cast<const float*>(s.buf.data()) + r * T, 1, T));
      with_ws([&](workspace& ws) {
        return select_topk(seq, ws, one, one_len, value_of(make_matrix_view(ref.data(), 1, index_t(ref.size()))));
      });
      CHECK(std::vector<pos_t>(pos.begin() + cu[r], pos.begin() + cu[r + 1]) == ref);
    }
    emulator ec{g, index_t(1) << 20, {}, {}, 0};
    std::vector<pos_t> pos2(220, -7);
    ec.ragged(s, lens2.data(), ragged_positions_out{pos2.data(), cu.data(), R}, 219, algo);
    CHECK(ec.bad == R);  // cu[R] = 220 > capacity: every row refused
    CHECK(std::all_of(pos2.begin(), pos2.end(), [](pos_t p) { return p == -7; }));
  }
}

TEST_CASE("device logic: the flattened selection matches select_topk_flat") {
  std::uint64_t seed = 300;
  for (int trial = 0; trial < 24; ++trial, ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const dist d = all_dists[trial % std::size(all_dists)];
    const index_t R = trial % 7 == 3 ? kvtest::uniform_int(g, 20, 40) : kvtest::uniform_int(g, 0, 7);
    const index_t T = trial % 10 == 0 ? kvtest::uniform_int(g, 9000, 12000) : kvtest::uniform_int(g, 0, 400);
    scores_t s(g, R, T, d, trial % 4 == 1 ? 2 : 0);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(std::max<index_t>(R, 1))), floors(lens.size(), 0);
    index_t sum_len = 0, sum_floor = 0;
    for (index_t r = 0; r < R; ++r) {
      lens[r] = static_cast<std::int32_t>(trial % 3 == 0 ? T : kvtest::uniform_int(g, 0, T));
      const int kind = static_cast<int>(kvtest::uniform_int(g, 0, 4));
      floors[r] = static_cast<std::int32_t>(kind == 0 ? 0 : kind == 1 ? lens[r] : kvtest::uniform_int(g, 0, lens[r] / 2));
      sum_len += lens[r];
      sum_floor += floors[r];
    }
    const bool use_floors = trial % 2 == 0;
    const index_t lo = use_floors ? sum_floor : 0;
    const index_t total = trial % 5 == 1 ? lo : trial % 5 == 2 ? sum_len : kvtest::uniform_int(g, lo, sum_len);
    const int algo = algos[trial % 3];
    const index_t cap = grid_caps[(trial / 3) % 3];
    CAPTURE(R);
    CAPTURE(T);
    CAPTURE(total);
    CAPTURE(algo);
    CAPTURE(cap);
    const std::int32_t* fp = use_floors ? floors.data() : nullptr;
    std::vector<std::int32_t> cu_ref(static_cast<std::size_t>(R + 1), -1), cu_got(cu_ref);
    std::vector<pos_t> ref(static_cast<std::size_t>(std::max<index_t>(1, total)), -1), got(ref);
    with_ws([&](workspace& ws) { return select_topk_flat(seq, ws, s.view, lens.data(), total, fp, cu_ref.data(), ref.data()); });
    emulator em{g, cap, {}, {}, 0, 0, nullptr};
    em.flat(s, lens.data(), total, fp, cu_got.data(), got.data(), algo);
    CHECK(em.bad == 0);
    REQUIRE(cu_got == cu_ref);
    REQUIRE(got == ref);
    // counts only
    std::vector<std::int32_t> cu_only(cu_ref.size(), -1);
    emulator ec{g, cap, {}, {}, 0};
    ec.flat(s, lens.data(), total, fp, cu_only.data(), nullptr, algo);
    REQUIRE(cu_only == cu_ref);
  }
}

TEST_CASE("device logic: the flattened selection refuses inconsistent device arguments as a whole") {
  auto g = kvtest::rng(9);
  scores_t s(g, 3, 50, dist::uniform, 0);
  const std::vector<std::int32_t> lens = {50, 20, 30};
  for (int algo : {1, 2}) {
    std::vector<std::int32_t> cu(4, -1);
    std::vector<pos_t> pos(100, -7);
    emulator e1{g, index_t(1) << 20, {}, {}, 0};
    e1.flat(s, lens.data(), 101, nullptr, cu.data(), pos.data(), algo);  // total > sum of lengths
    CHECK(e1.bad == 1);
    CHECK(cu == std::vector<std::int32_t>{0, 0, 0, 0});
    CHECK(std::all_of(pos.begin(), pos.end(), [](pos_t p) { return p == -7; }));
    const std::vector<std::int32_t> floors = {10, 25, 5};  // row 1's floor exceeds its length
    emulator e2{g, index_t(1) << 20, {}, {}, 0};
    e2.flat(s, lens.data(), 60, floors.data(), cu.data(), pos.data(), algo);
    CHECK(e2.bad == 1);
    CHECK(cu == std::vector<std::int32_t>{0, 0, 0, 0});
    const std::vector<std::int32_t> floors2 = {30, 20, 30};  // sum 80 > total
    emulator e3{g, index_t(1) << 20, {}, {}, 0};
    e3.flat(s, lens.data(), 60, floors2.data(), cu.data(), pos.data(), algo);
    CHECK(e3.bad == 1);
    const std::vector<std::int32_t> bad_lens = {50, -2, 51};
    emulator e4{g, index_t(1) << 20, {}, {}, 0};
    e4.flat(s, bad_lens.data(), 10, nullptr, cu.data(), pos.data(), algo);
    CHECK(e4.bad == 2);
    CHECK(std::all_of(pos.begin(), pos.end(), [](pos_t p) { return p == -7; }));
  }
}

TEST_CASE("device logic: flattened selection over many rows with ties across rows (several row tiles)") {
  auto g = kvtest::rng(11);
  for (int trial = 0; trial < 1; ++trial) {  // more rows than the 256 threads of the counts block
    const index_t R = kvtest::uniform_int(g, 257, 300), T = kvtest::uniform_int(g, 1, 12);
    scores_t s(g, R, T, trial % 2 ? dist::ties3 : dist::all_equal, 0);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R)), floors(lens.size());
    index_t sum_len = 0, sum_floor = 0;
    for (index_t r = 0; r < R; ++r) {
      lens[r] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, T));
      floors[r] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, lens[r] / 3));
      sum_len += lens[r];
      sum_floor += floors[r];
    }
    const bool use_floors = trial % 3 != 0;
    const index_t total = kvtest::uniform_int(g, use_floors ? sum_floor : 0, sum_len);
    const int algo = trial % 2 ? 2 : 1;
    const index_t cap = trial % 4 < 2 ? 2 : 5;
    CAPTURE(trial);
    CAPTURE(R);
    CAPTURE(total);
    const std::int32_t* fp = use_floors ? floors.data() : nullptr;
    std::vector<std::int32_t> cu_ref(static_cast<std::size_t>(R + 1)), cu_got(cu_ref.size(), -1);
    std::vector<pos_t> ref(static_cast<std::size_t>(std::max<index_t>(1, total))), got(ref.size(), -1);
    with_ws([&](workspace& ws) { return select_topk_flat(seq, ws, s.view, lens.data(), total, fp, cu_ref.data(), ref.data()); });
    emulator em{g, cap, {}, {}, 0, 0, nullptr};
    em.flat(s, lens.data(), total, fp, cu_got.data(), got.data(), algo);
    CHECK(em.bad == 0);
    REQUIRE(cu_got == cu_ref);
    REQUIRE(got == ref);
  }
}

namespace {
/// Dense select_topk on the executor (plan `algo`) against seq: every row keeps k.
void check_dense(std::mt19937_64& g, const scores_t& s, const std::vector<std::int32_t>& lens, index_t k, int algo) {
  std::vector<pos_t> ref(static_cast<std::size_t>(s.R * k)), got(ref.size(), -1);
  with_ws([&](workspace& ws) { return select_topk(seq, ws, s.view, lens.data(), value_of(make_matrix_view(ref.data(), s.R, k))); });
  emulator em{g, index_t(1) << 20, {}, {}, 0, 0, nullptr};
  em.dense(s, lens.data(), value_of(make_matrix_view(got.data(), s.R, k)), algo);
  CHECK(em.bad == 0);
  REQUIRE(got == ref);
}
}  // namespace

TEST_CASE("device logic: a 1M-token row, long rows by one block, and 300 short rows") {
  auto g = kvtest::rng(21);
  // a row of 2^20 tokens with heavy ties, several blocks per row (the plan's 128 chunks)
  {
    const index_t T = index_t(1) << 20;
    scores_t s(g, 1, T, dist::uniform, 0);
    for (index_t j = 0; j < T; j += 3) s.buf[static_cast<std::size_t>(j)] = 0.5f;  // heavy ties
    CHECK(detail::plan_select(1, T, 2).chunks == 128);
    check_dense(g, s, {static_cast<std::int32_t>(T - 12345)}, 100000, 2);
  }
  // rows longer than the shared-memory key cache (8192) by one block each: re-read every pass
  {
    scores_t s(g, 2, 30000, dist::ties3, 0);
    check_dense(g, s, {30000, 20001}, 7000, 1);
  }
  // 300 rows of 40 tokens: the flattened counts run over 2 row tiles of 256
  {
    const index_t R = 300, T = 40;
    scores_t s(g, R, T, dist::ties3, 0);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(R), static_cast<std::int32_t>(T)), floors(lens.size(), 2);
    const index_t total = R * 13;
    std::vector<std::int32_t> cu_ref(static_cast<std::size_t>(R + 1)), cu_got(cu_ref.size(), -1);
    std::vector<pos_t> ref(static_cast<std::size_t>(total)), got(ref.size(), -1);
    with_ws([&](workspace& ws) {
      return select_topk_flat(seq, ws, s.view, lens.data(), total, floors.data(), cu_ref.data(), ref.data());
    });
    emulator em{g, index_t(1) << 20, {}, {}, 0, 0, nullptr};
    em.flat(s, lens.data(), total, floors.data(), cu_got.data(), got.data(), 0);
    CHECK(em.bad == 0);
    REQUIRE(cu_got == cu_ref);
    REQUIRE(got == ref);
  }
}

// The selection functions' plain shared-memory accesses (key cache, emit staging, histograms, the
// chosen bucket, the merged layer histogram) are announced to the executor (Block::plain_read /
// plain_write): a barrier of the one-block selection left out is reported as a race between plain
// accesses, for a cached row (keys in shared memory) and a longer one (emit tiles staged).
TEST_CASE("select device logic: a missing barrier around the selection's plain shared-memory accesses is reported") {
  auto g = kvtest::rng(9191);
  for (const index_t T : {index_t(300), index_t(8300)}) {
    CAPTURE(T);
    const scores_t s(g, 1, T, dist::uniform, 0);
    const index_t k = T / 3;
    std::vector<pos_t> kept(static_cast<std::size_t>(k));
    const auto kv = value_of(make_matrix_view(kept.data(), 1, k));
    std::vector<std::int32_t> lengths{static_cast<std::int32_t>(T)};
    emulator em{g, index_t(1) << 20, {}, {}, 0, 0, nullptr};
    std::string error;
    em.error = &error;
    em.dense(s, lengths.data(), kv, 1);
    CHECK(error.empty());
    int plain = 0;
    for (index_t drop = 1; drop <= 8 && plain == 0; ++drop) {
      em.drop = drop;
      em.dense(s, lengths.data(), kv, 1);
      if (error.find("race") != std::string::npos && error.find("plain") != std::string::npos) ++plain;
    }
    CHECK(plain > 0);
  }
}
