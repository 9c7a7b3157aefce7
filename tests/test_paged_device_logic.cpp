// The CUDA paged kernels run on the host: the launch sequences of detail/block/paged_ops.hpp (the
// ones cuda/paged.cuh launches: reset, mark, validate, finish, then the in-place tiles of
// compact_ops.hpp over the key and value pools; Knorm; value weighting) on the SIMT executor
// (fibers, interleaved resident blocks, small grids, small flag rings): identical pools, outputs and
// scores to the seq forms on random layouts, and all or nothing on bad device data (nothing written,
// the problems counted). Also the batched selection's offsets (batch_offsets_launch) and the varlen
// batched selection (offsets, then the selection ops over detail::varlen_rows), and the flattened
// batched selection (offsets, then one block per sequence: detail::batch_flat_launch).
#include "paged_fixture.hpp"

#include <kvevict/batch.hpp>
#include <kvevict/detail/block/batch_block.hpp>
#include <kvevict/detail/block/paged_block.hpp>
#include <kvevict/detail/block/paged_ops.hpp>
#include <kvevict/detail/block/select_ops.hpp>
#include <kvevict/detail/block/simt.hpp>
#include <kvevict/paged.hpp>

#include <cstring>
#include <limits>

using namespace kvevict;
using kvtest::paged_fixture;
using outputs = kvtest::paged_outputs;
using kvtest::random_kept;
using flat = kvtest::flat_kept;
using kvtest::flatten;

namespace {

/// Runs a launch sequence on the SIMT executor (random seed, 1 to 4 resident blocks, grids capped at
/// 3 blocks half the time); returns the problems counted.
template <class Launch>
index_t on_executor(std::mt19937_64& g, Launch&& launch) {
  detail::simt_executor ex(g(), 0);
  ex.resident(1 + static_cast<index_t>(g() % 4));
  detail::simt_launcher<detail::simt_executor> l{ex};
  int bad = 0;
  launch(l, &bad, g() % 2 == 0 ? index_t(3) : index_t(1) << 20);
  REQUIRE_MESSAGE(l.ok, ex.error());
  return bad;
}

/// compact_paged(cuda): detail::paged_compact_launch with tiles of `tile_rows` rows (-1: the
/// kernel's choice, 0: rows copied directly), 1 to 3 blocks per row and a ring of 8 flags. The
/// workspace state starts as garbage (the reset ops zero it).
index_t emulate(std::mt19937_64& g, paged_layer<float> L, ragged_positions kept, paged_compaction_out out,
                index_t tile_rows) {
  const index_t P = L.keys.pages, R = L.rows(), ring = 8;
  if (R == 0 && L.table.lists == 0) return 0;  // the launcher returns before launching
  const auto rs = static_cast<std::size_t>(std::max<index_t>(R, 1));
  std::vector<std::uint32_t> marks(static_cast<std::size_t>(std::max<index_t>(P, 1)), 77u);
  std::vector<index_t> head_rows(rs, -5);
  std::vector<unsigned> ticket(rs, 9u), prefix(rs, 9u), flags(rs * static_cast<std::size_t>(ring), 9u);
  int problems = 55;
  const detail::paged_compact_state st{marks.data(), &problems, head_rows.data(),
                                       detail::inplace_sync{ticket.data(), prefix.data(), flags.data(), ring}};
  const index_t parts = kvtest::uniform_int(g, 1, 3);
  return on_executor(g, [&](auto& l, int* bad, index_t cap) {
    detail::paged_compact_launch(l, L, kept, out, st, bad, tile_rows, parts, cap);
  });
}

}  // namespace

TEST_CASE("paged compaction device logic == compact_paged(seq) on random layouts") {
  auto g = kvtest::rng(1321);
  for (const index_t ps : {index_t(1), index_t(16), index_t(64)})
    for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head})
      for (const index_t tiles : {index_t(-1), index_t(0), index_t(1), index_t(3)}) {
        CAPTURE(ps);
        CAPTURE(tiles);
        paged_fixture a = kvtest::make_paged_fixture(g, 3, 2, 8, ps, lists,
                                                     tiles % 2 ? page_layout::nhd : page_layout::hnd, 3 * ps + 5);
        paged_fixture b = a;
        const flat k = flatten(random_kept(g, a));
        const ragged_positions kv{k.pos.data(), k.cu.data(), a.rows()};
        outputs oa = kvtest::room_for(a), ob = kvtest::room_for(b);
        workspace q;
        REQUIRE(compact_paged(seq, q, a.layer(), kv, oa.out(a.pages)).ok());
        std::vector<unsigned char> mem(q.bytes);
        workspace ws{mem.data(), q.bytes};
        REQUIRE(compact_paged(seq, ws, a.layer(), kv, oa.out(a.pages)).ok());
        CHECK(emulate(g, b.layer(), kv, ob.out(b.pages), tiles) == 0);
        kvtest::check_same_compaction(a, oa, b, ob);
      }
}

TEST_CASE("paged compaction device logic: bad device data moves nothing and is counted") {
  auto g = kvtest::rng(1322);
  paged_fixture base = kvtest::make_paged_fixture(g, 3, 2, 4, 4, page_lists::per_head, page_layout::nhd, 13, 3, 5);
  const flat k0 = flatten(random_kept(g, base));
  auto expect_nothing = [&](auto mutate, index_t capacity) {
    paged_fixture f = base;
    flat k = k0;
    mutate(f, k);
    outputs o = kvtest::room_for(f);
    const auto kp = f.kpool, vp = f.vpool;
    CHECK(emulate(g, f.layer(), ragged_positions{k.pos.data(), k.cu.data(), f.rows()}, o.out(capacity), -1) > 0);
    CHECK(f.kpool == kp);
    CHECK(f.vpool == vp);
    CHECK(o.lengths == kvtest::room_for(f).lengths);
    CHECK(o.freed == kvtest::room_for(f).freed);
    CHECK(o.count == -7);
  };
  const index_t cap = base.pages;
  expect_nothing([](paged_fixture& f, flat&) { f.indices[0] = static_cast<std::int32_t>(f.pages); }, cap);
  expect_nothing([](paged_fixture& f, flat&) { f.indices[1] = f.indices[0]; }, cap);
  expect_nothing([](paged_fixture& f, flat&) { f.last[2] = 0; }, cap);
  expect_nothing([](paged_fixture& f, flat&) { f.last[2] = static_cast<std::int32_t>(f.page_size + 1); }, cap);
  expect_nothing([](paged_fixture& f, flat&) { f.indptr[1] = f.indptr[2] + 1; }, cap);
  expect_nothing(
      [](paged_fixture&, flat& k) {
        for (std::size_t r = 0; r + 1 < k.cu.size(); ++r)
          if (k.cu[r + 1] - k.cu[r] >= 2) {
            std::swap(k.pos[static_cast<std::size_t>(k.cu[r])], k.pos[static_cast<std::size_t>(k.cu[r] + 1)]);
            return;
          }
      },
      cap);
  expect_nothing([](paged_fixture&, flat&) {}, 0);  // the freed pages do not fit
  // per-sequence lists whose heads keep different counts
  paged_fixture ps = kvtest::make_paged_fixture(g, 2, 2, 4, 4, page_lists::per_sequence, page_layout::hnd, 13, 3, 5);
  flat k;
  k.cu = {0, 1, 1, 1, 1};
  k.pos = {0, 0};
  outputs o = kvtest::room_for(ps);
  const auto kp = ps.kpool;
  CHECK(emulate(g, ps.layer(), ragged_positions{k.pos.data(), k.cu.data(), 4}, o.out(ps.pages), -1) > 0);
  CHECK(ps.kpool == kp);
  CHECK(o.count == -7);
}

TEST_CASE("batched selection device logic: the offsets of select_topk_batch, all or nothing") {
  auto g = kvtest::rng(1323);
  for (int trial = 0; trial < 20; ++trial) {
    const index_t S = kvtest::uniform_int(g, 0, 70), H = kvtest::uniform_int(g, 1, 8), T = kvtest::uniform_int(g, 1, 300);
    std::vector<std::int32_t> budgets(static_cast<std::size_t>(S) + 1), lens(static_cast<std::size_t>(S * H) + 1);
    for (auto& b : budgets) b = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, T + 5));
    for (auto& l : lens) l = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, T));
    std::vector<float> scores(static_cast<std::size_t>(std::max<index_t>(S * H * T, 1)));
    std::vector<std::int32_t> host_cu(static_cast<std::size_t>(S * H + 1)), dev_cu(host_cu.size(), -9);
    std::vector<pos_t> pos(static_cast<std::size_t>(S * H * T + 1));
    const auto sv = kvtest::value_of(make_matrix_view<const float>(scores.data(), S * H, T));
    REQUIRE(kvtest::two_phase([&](workspace& ws) {
              return select_topk_batch(seq, ws, batch_padded(sv, S, H, lens.data()), budgets.data(),
                                       batch_budget::per_head, host_cu.data(), pos.data(), static_cast<index_t>(pos.size()));
            }).ok());
    // the launch sequence of select_topk_batch(cuda) (detail::batch_offsets_launch) on the SIMT executor
    const auto offsets = [&](const std::vector<std::int32_t>& b, const std::vector<std::int32_t>& l, index_t capacity) {
      std::fill(dev_cu.begin(), dev_cu.end(), -9);
      int bad = 0;
      detail::simt_executor ex(g());
      detail::simt_launcher<detail::simt_executor> launcher{ex};
      detail::batch_offsets_launch(launcher, b.data(), l.data(), nullptr, S * H, H, T, capacity, dev_cu.data(), &bad);
      REQUIRE_MESSAGE(launcher.ok, ex.error());
      return bad;
    };
    CHECK(offsets(budgets, lens, static_cast<index_t>(pos.size())) == 0);
    CHECK(dev_cu == host_cu);
    // all or nothing: a capacity one short, a negative budget, a length above T
    if (host_cu.back() > 0) {
      CHECK(offsets(budgets, lens, host_cu.back() - 1) == 1);
      CHECK(std::all_of(dev_cu.begin(), dev_cu.end(), [](std::int32_t x) { return x == 0; }));
    }
    if (S > 0) {
      auto bad_budgets = budgets;
      bad_budgets[0] = -1;
      CHECK(offsets(bad_budgets, lens, 1 << 30) == H);
      CHECK(std::all_of(dev_cu.begin(), dev_cu.end(), [](std::int32_t x) { return x == 0; }));
      auto bad_lens = lens;
      bad_lens[0] = static_cast<std::int32_t>(T + 1);
      CHECK(offsets(budgets, bad_lens, 1 << 30) == 1);
    }
  }
}

TEST_CASE("batched selection device logic: varlen rows (cu_seqlens) on the executor == select_topk_batch(seq)") {
  auto g = kvtest::rng(1326);
  for (int trial = 0; trial < 24; ++trial) {
    CAPTURE(trial);
    const index_t S = kvtest::uniform_int(g, 0, 9), H = kvtest::uniform_int(g, 1, 4);
    std::vector<std::int32_t> cu_seqlens(static_cast<std::size_t>(S) + 1, 0), budgets(static_cast<std::size_t>(std::max<index_t>(S, 1)));
    for (index_t s = 0; s < S; ++s) {
      const index_t n = trial % 6 == 5 ? kvtest::uniform_int(g, 300, 700) : kvtest::uniform_int(g, 0, 60);
      cu_seqlens[static_cast<std::size_t>(s) + 1] = cu_seqlens[static_cast<std::size_t>(s)] + static_cast<std::int32_t>(n);
      budgets[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, n + 3));
    }
    const index_t T = cu_seqlens.back() + kvtest::uniform_int(g, 0, 4);  // spare columns past the last sequence
    std::vector<float> scores(static_cast<std::size_t>(std::max<index_t>(H * T, 1)));
    for (auto& x : scores) x = static_cast<float>(kvtest::uniform_int(g, 0, trial % 2 ? 5 : 1000));  // ties
    if (trial % 4 == 3 && H * T > 0) scores[static_cast<std::size_t>(kvtest::uniform_int(g, 0, H * T - 1))] = std::numeric_limits<float>::quiet_NaN();
    const auto sv = kvtest::value_of(make_matrix_view<const float>(scores.data(), H, T));
    const index_t R = S * H, capacity = static_cast<index_t>(H) * (T + 1);
    std::vector<std::int32_t> host_cu(static_cast<std::size_t>(R + 1)), dev_cu(host_cu.size(), -9);
    std::vector<pos_t> host_pos(static_cast<std::size_t>(capacity)), dev_pos(host_pos.size(), -9);
    REQUIRE(kvtest::two_phase([&](workspace& ws) {
              return select_topk_batch(seq, ws, batch_varlen(sv, cu_seqlens.data(), S), budgets.data(),
                                       batch_budget::per_head, host_cu.data(), host_pos.data(), capacity);
            }).ok());
    // select_topk_batch(cuda)'s varlen sequence: the offsets op, then the selection ops over varlen_rows
    const auto run = [&](const std::vector<std::int32_t>& cs, int algo) {
      std::fill(dev_cu.begin(), dev_cu.end(), -9);
      const detail::select_plan plan = detail::plan_select(R, T, algo);
      workspace q;
      detail::workspace_carver c1(q);
      (void)detail::carve_select_dev_ws(c1, q, R, plan, false);
      REQUIRE(c1.finish("test").ok());
      std::vector<unsigned char> mem(q.bytes);
      workspace wsd{mem.data(), q.bytes};
      detail::workspace_carver c2(wsd);
      const detail::select_dev_ws w = detail::carve_select_dev_ws(c2, wsd, R, plan, false);
      REQUIRE(c2.finish("test").ok());
      if (w.zero_bytes > 0) std::memset(w.zero_begin, 0, w.zero_bytes);
      const detail::varlen_rows rows{cs.data(), S, H, T, dev_cu.data(), dev_pos.data(), capacity};
      int bad = 0;
      detail::simt_executor ex(g());
      ex.resident(1 + static_cast<index_t>(g() % 4));
      detail::simt_launcher<detail::simt_executor> l{ex};
      const index_t cap = g() % 2 == 0 ? index_t(3) : index_t(1) << 20;
      detail::batch_offsets_launch(l, budgets.data(), nullptr, cs.data(), R, H, T, capacity, dev_cu.data(), &bad);
      detail::select_rows_launch(l, sv, rows, w, plan, false, true, detail::simt_bad{&bad, nullptr}, cap);
      REQUIRE_MESSAGE(l.ok, ex.error());
      return bad;
    };
    for (const int algo : {1, 2}) {  // one block per row, several blocks per row
      CAPTURE(algo);
      CHECK(run(cu_seqlens, algo) == 0);
      REQUIRE(dev_cu == host_cu);
      for (index_t i = 0; i < host_cu.back(); ++i) REQUIRE(dev_pos[static_cast<std::size_t>(i)] == host_pos[static_cast<std::size_t>(i)]);
    }
    // bad offsets (decreasing, or past the columns): nothing selected, counted
    if (S >= 2 && cu_seqlens[1] > 0) {
      auto bad_cs = cu_seqlens;
      bad_cs[1] = bad_cs[2] + 1;
      CHECK(run(bad_cs, 1) > 0);
      CHECK(std::all_of(dev_cu.begin(), dev_cu.end(), [](std::int32_t x) { return x == 0; }));
      bad_cs = cu_seqlens;
      bad_cs.back() = static_cast<std::int32_t>(T + 1);
      CHECK(run(bad_cs, 2) > 0);
      CHECK(std::all_of(dev_cu.begin(), dev_cu.end(), [](std::int32_t x) { return x == 0; }));
    }
  }
}

TEST_CASE("batched selection device logic: flattened budgets (padded and varlen) on the executor == select_topk_batch(seq)") {
  auto g = kvtest::rng(1327);
  for (int trial = 0; trial < 32; ++trial) {
    CAPTURE(trial);
    const bool varlen = trial % 2 == 1;
    const index_t S = kvtest::uniform_int(g, 0, 7), H = kvtest::uniform_int(g, 1, 4);
    const auto S1 = static_cast<std::size_t>(S);
    std::vector<std::int32_t> cu_seqlens(S1 + 1, 0), budgets(std::max<std::size_t>(S1, 1));
    std::vector<std::int32_t> lens(std::max<std::size_t>(S1 * static_cast<std::size_t>(H), 1));
    index_t T = 0;
    for (index_t s = 0; s < S; ++s) {
      const index_t n = trial % 8 == 7 ? kvtest::uniform_int(g, 300, 600) : kvtest::uniform_int(g, 0, 40);
      cu_seqlens[static_cast<std::size_t>(s) + 1] = cu_seqlens[static_cast<std::size_t>(s)] + static_cast<std::int32_t>(n);
      T = varlen ? cu_seqlens[static_cast<std::size_t>(s) + 1] : std::max(T, n);
      for (index_t h = 0; h < H; ++h) lens[static_cast<std::size_t>(s * H + h)] = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, n));
      // k = 0, k = all, and budgets in between
      const int pick = static_cast<int>(g() % 4);
      budgets[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(pick == 0 ? 0 : pick == 1 ? n + 2 : kvtest::uniform_int(g, 0, n));
    }
    T += kvtest::uniform_int(g, 0, 3);  // spare columns
    const index_t rows_m = varlen ? H : S * H, R = S * H;
    std::vector<float> scores(static_cast<std::size_t>(std::max<index_t>(rows_m * T, 1)));
    for (auto& x : scores) x = static_cast<float>(kvtest::uniform_int(g, 0, trial % 3 == 0 ? 3 : 1000));  // ties
    if (trial % 4 == 3 && rows_m * T > 0)
      for (int i = 0; i < 3; ++i)
        scores[static_cast<std::size_t>(kvtest::uniform_int(g, 0, rows_m * T - 1))] = i == 0 ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
    const auto sv = kvtest::value_of(make_matrix_view<const float>(scores.data(), rows_m, T));
    const batch_rows rows = varlen ? batch_varlen(sv, cu_seqlens.data(), S) : batch_padded(sv, S, H, lens.data());
    const index_t capacity = R * T + 1;  // one spare slot: nothing may be written past the kept entries
    std::vector<std::int32_t> host_cu(static_cast<std::size_t>(R + 1)), dev_cu(host_cu.size(), -9);
    std::vector<pos_t> host_pos(static_cast<std::size_t>(capacity)), dev_pos(host_pos.size(), -9);
    REQUIRE(kvtest::two_phase([&](workspace& ws) {
              return select_topk_batch(seq, ws, rows, budgets.data(), batch_budget::flattened, host_cu.data(),
                                       host_pos.data(), capacity);
            }).ok());
    // select_topk_batch(cuda)'s flattened sequence: the offsets op, then one block per sequence
    const auto run = [&](const std::int32_t* cs, const std::int32_t* ls, const std::vector<std::int32_t>& b, index_t cap_pos) {
      std::fill(dev_cu.begin(), dev_cu.end(), -9);
      std::fill(dev_pos.begin(), dev_pos.end(), -9);
      const detail::batch_keys keys{sv, varlen ? nullptr : ls, varlen ? cs : nullptr, S, H, T};
      return on_executor(g, [&](auto& l, int* bad, index_t cap) {
        detail::batch_flat_launch(l, keys, b.data(), cap_pos, dev_cu.data(), dev_pos.data(), bad, cap);
      });
    };
    CHECK(run(cu_seqlens.data(), lens.data(), budgets, capacity) == 0);
    REQUIRE(dev_cu == host_cu);
    for (index_t i = 0; i < host_cu.back(); ++i)
      REQUIRE(dev_pos[static_cast<std::size_t>(i)] == host_pos[static_cast<std::size_t>(i)]);
    CHECK(dev_pos[static_cast<std::size_t>(host_cu.back())] == -9);  // nothing past the kept entries
    // all or nothing on bad device data: every offset 0, no position written, the problems counted
    const auto nothing = [&] {
      return std::all_of(dev_cu.begin(), dev_cu.end(), [](std::int32_t x) { return x == 0; }) &&
             std::all_of(dev_pos.begin(), dev_pos.end(), [](pos_t x) { return x == -9; });
    };
    if (host_cu.back() > 0) {
      CHECK(run(cu_seqlens.data(), lens.data(), budgets, host_cu.back() - 1) == 1);
      CHECK(nothing());
    }
    if (S > 0) {
      auto bad_budgets = budgets;
      bad_budgets[S1 - 1] = -1;
      CHECK(run(cu_seqlens.data(), lens.data(), bad_budgets, capacity) == H);
      CHECK(nothing());
      auto bad_cs = cu_seqlens;
      auto bad_lens = lens;
      if (varlen) bad_cs.back() = static_cast<std::int32_t>(T + 1);
      else bad_lens[0] = static_cast<std::int32_t>(T + 1);
      CHECK(run(bad_cs.data(), bad_lens.data(), budgets, capacity) > 0);
      CHECK(nothing());
    }
  }
}

TEST_CASE("paged Knorm device logic: the rows a kernel reads, and the same scores as the host") {
  auto g = kvtest::rng(1324);
  for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head}) {
    paged_fixture f = kvtest::make_paged_fixture(g, 4, 2, 8, 16, lists, page_layout::hnd, 70);
    const index_t R = f.rows(), C = 80;
    std::vector<float> host(static_cast<std::size_t>(R * C), 5.f), dev(host);
    REQUIRE(kvtest::two_phase([&](workspace& ws) {
              return paged_key_norm_scores(seq, ws, f.layer(), kvtest::value_of(make_matrix_view(host.data(), R, C)));
            }).ok());
    const paged_layer<float> L = f.layer();
    for (index_t r = 0; r < R; ++r) REQUIRE(detail::paged_readable_row(L, r, C) == f.row_len[static_cast<std::size_t>(r)]);
    const auto dv = kvtest::value_of(make_matrix_view(dev.data(), R, C));
    CHECK(on_executor(g, [&](auto& l, int* bad, index_t cap) { detail::paged_key_norm_launch(l, L, dv, bad, cap); }) == 0);
    CHECK(kvtest::bytes_of(host) == kvtest::bytes_of(dev));
    // rows the table does not describe are skipped and counted, the others scored
    CHECK(detail::paged_readable_row(L, 0, f.row_len[0] > 0 ? f.row_len[0] - 1 : -1) == -1);
    REQUIRE(!f.indices.empty());
    f.indices[0] = static_cast<std::int32_t>(f.pages);
    index_t skipped = 0;
    for (index_t r = 0; r < R; ++r) skipped += detail::paged_readable_row(f.layer(), r, C) < 0 ? 1 : 0;
    CHECK(skipped == (lists == page_lists::per_head ? 1 : 2));  // the rows of the list holding page 0
    std::vector<float> again(dev.size(), 5.f);
    const auto av = kvtest::value_of(make_matrix_view(again.data(), R, C));
    CHECK(on_executor(g, [&](auto& l, int* bad, index_t cap) { detail::paged_key_norm_launch(l, f.layer(), av, bad, cap); }) ==
          skipped);
    const float untouched = 5.f;
    for (index_t r = 0; r < R; ++r) {
      const bool read = detail::paged_readable_row(f.layer(), r, C) >= 0;
      for (index_t j = 0; j < C; ++j) {
        const auto i = static_cast<std::size_t>(r * C + j);
        REQUIRE(std::memcmp(&again[i], read ? &dev[i] : &untouched, sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("paged value-norm device logic: the kernel on the executor gives the host's weights") {
  auto g = kvtest::rng(1325);
  for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head})
    for (const value_weight mode : {value_weight::per_token, value_weight::head_max}) {
      paged_fixture f = kvtest::make_paged_fixture(g, 3, 2, 8, 16, lists, page_layout::nhd, 60);
      const index_t R = f.rows(), group = 2, C = 64;
      std::vector<float> host(static_cast<std::size_t>(R * group * C));
      for (auto& x : host) x = static_cast<float>(kvtest::uniform_int(g, 1, 9));
      if (mode == value_weight::head_max) f.vpool[3] = std::numeric_limits<float>::quiet_NaN();  // NaN wins the max
      std::vector<float> dev = host;
      REQUIRE(kvtest::two_phase([&](workspace& ws) {
                return paged_weight_by_value_norm(seq, ws, kvtest::value_of(make_matrix_view(host.data(), R * group, C)),
                                                  f.layer(), mode);
              }).ok());
      const auto dv = kvtest::value_of(make_matrix_view(dev.data(), R * group, C));
      CHECK(on_executor(g, [&](auto& l, int* bad, index_t cap) {
              detail::paged_weight_launch(l, dv, f.layer(), mode == value_weight::head_max, bad, cap);
            }) == 0);
      CHECK(kvtest::bytes_of(host) == kvtest::bytes_of(dev));
    }
}
