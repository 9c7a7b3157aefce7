// The CUDA paged compaction's logic (detail/block/paged_block.hpp: mark, validate, finish, then the
// in-place tiles of compact_block.hpp over paged rows) run on the host under the emulated block:
// identical pools and outputs to compact_paged(seq) on random layouts, and all or nothing on bad
// device data (nothing written, the problems counted). Also the batched selection's offsets
// (detail/block/batch_block.hpp) and the paged Knorm kernel's rows.
#include "paged_fixture.hpp"

#include <kvevict/batch.hpp>
#include <kvevict/detail/block/batch_block.hpp>
#include <kvevict/detail/block/host_block.hpp>
#include <kvevict/detail/block/paged_block.hpp>
#include <kvevict/detail/block/select_ops.hpp>
#include <kvevict/detail/block/simt.hpp>
#include <kvevict/paged.hpp>

using namespace kvevict;
using kvtest::paged_fixture;
using outputs = kvtest::paged_outputs;
using kvtest::random_kept;
using flat = kvtest::flat_kept;
using kvtest::flatten;

namespace {

/// The launcher's kernels in order, one emulated block at a time; tiles of `tile_rows` rows (-1:
/// the kernel's choice, 0: rows copied directly). Returns the problems counted.
index_t emulate(std::mt19937_64& g, paged_layer<float> L, ragged_positions kept, paged_compaction_out out,
                index_t tile_rows_override) {
  const index_t P = L.keys.pages, R = L.rows();
  std::vector<std::uint32_t> marks(static_cast<std::size_t>(std::max<index_t>(P, 1)), 0);
  index_t problems = 0;
  const index_t listed = L.table.indptr[L.table.lists];
  if (listed < 0 || listed > P) ++problems;
  else
    for (index_t i = 0; i < listed; ++i)
      problems += detail::paged_mark_page(L.table, i, P, marks.data(), [](std::uint32_t* m) { ++*m; });
  detail::host_block blk(32, g);
  const detail::paged_inplace_heads<float> kh{L.keys, L.table, kept, L.kv_heads, L.lists};
  const detail::paged_inplace_heads<float> vh{L.values, L.table, kept, L.kv_heads, L.lists};
  for (index_t r = 0; r < R; ++r) problems += detail::paged_validate_row(blk, kh, r, marks.data());
  std::vector<index_t> head_rows(static_cast<std::size_t>(std::max<index_t>(R, 1)), -5);
  problems += detail::paged_finish(blk, kh, problems, out, head_rows.data());
  for (const auto* heads : {&kh, &vh}) {
    const index_t dim = heads->pool.dim;
    detail::with_unit(detail::unit_for<float>(true, detail::addr_bits(heads->pool.data), dim), [&](auto u) {
      constexpr int U = decltype(u)::value;
      const detail::row_copy<float, U> rc{dim, 1, 1};
      const index_t tile_rows =
          tile_rows_override >= 0 ? tile_rows_override : detail::inplace_tile_rows(rc.units(), rc.unit_bytes());
      std::vector<unsigned char> stage(static_cast<std::size_t>(std::max<index_t>(tile_rows, 1) * rc.units() * rc.unit_bytes() + 16));
      for (index_t r = 0; r < R; ++r) {
        const index_t n = head_rows[static_cast<std::size_t>(r)];
        if (n < 0) continue;
        for (index_t c = 0;; ++c) {
          if (!detail::inplace_tile_read(blk, *heads, rc, r, n, c, tile_rows, stage.data())) break;
          detail::inplace_tile_write(blk, *heads, rc, r, n, c, tile_rows, stage.data());
        }
      }
    });
  }
  return problems;
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
      detail::batch_offsets_launch(launcher, b.data(), l.data(), S * H, H, T, capacity, dev_cu.data(), &bad);
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
    for (index_t r = 0; r < R; ++r) {  // the kernel's body, row by row
      const index_t n = detail::paged_readable_row(L, r, C);
      REQUIRE(n == f.row_len[static_cast<std::size_t>(r)]);
      for (index_t j = 0; j < n; ++j) dev[static_cast<std::size_t>(r * C + j)] = detail::key_norm_score(L.key(r, j), f.d, 1);
    }
    CHECK(kvtest::bytes_of(host) == kvtest::bytes_of(dev));
    // rows the table does not describe are skipped
    CHECK(detail::paged_readable_row(L, 0, f.row_len[0] > 0 ? f.row_len[0] - 1 : -1) == -1);
    REQUIRE(!f.indices.empty());
    f.indices[0] = static_cast<std::int32_t>(f.pages);
    index_t skipped = 0;
    for (index_t r = 0; r < R; ++r) skipped += detail::paged_readable_row(f.layer(), r, C) < 0 ? 1 : 0;
    CHECK(skipped == (lists == page_lists::per_head ? 1 : 2));  // the rows of the list holding page 0
  }
}

TEST_CASE("paged value-norm device logic: the kernel's per-thread parts give the host's weights") {
  auto g = kvtest::rng(1325);
  for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head})
    for (const value_weight mode : {value_weight::per_token, value_weight::head_max}) {
      paged_fixture f = kvtest::make_paged_fixture(g, 3, 2, 8, 16, lists, page_layout::nhd, 60);
      const index_t R = f.rows(), group = 2, C = 64, threads = 256;
      std::vector<float> host(static_cast<std::size_t>(R * group * C));
      for (auto& x : host) x = static_cast<float>(kvtest::uniform_int(g, 1, 9));
      std::vector<float> dev = host;
      REQUIRE(kvtest::two_phase([&](workspace& ws) {
                return paged_weight_by_value_norm(seq, ws, kvtest::value_of(make_matrix_view(host.data(), R * group, C)),
                                                  f.layer(), mode);
              }).ok());
      const paged_layer<float> L = f.layer();
      for (index_t r = 0; r < R; ++r) {  // the kernel's block for row r, threads in a random order
        const index_t n = detail::paged_readable_row(L, r, C);
        REQUIRE(n >= 0);
        std::vector<int> order(static_cast<std::size_t>(threads));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), g);
        float row_max = 0.0f;
        if (mode == value_weight::head_max)
          for (int t : order) row_max = detail::max_nan(row_max, detail::paged_value_max_part(L, r, n, t, threads));
        for (int t : order)
          detail::paged_weight_part(L, r, n, group, dev.data(), C, 1, mode == value_weight::head_max, row_max, t, threads);
      }
      CHECK(kvtest::bytes_of(host) == kvtest::bytes_of(dev));
    }
}
