// Paged KV caches (kvevict/paged.hpp): views, block-table validation, paged compaction and the
// freed pages, the paged compact_layer (positions too), Knorm and value norms through the paged
// views, against the dense paths.
#include "paged_fixture.hpp"

#include <kvevict/compact.hpp>
#include <kvevict/drivers/compact_layer.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>
#include <kvevict/weight.hpp>

#include <set>

using namespace kvevict;
using kvtest::flat_kept;
using kvtest::flatten;
using kvtest::paged_fixture;
using kvtest::room_for;
using compaction = kvtest::paged_outputs;
using kvtest::random_kept;
using kvtest::two_phase;

namespace {

const index_t page_sizes[] = {1, 16, 64};

}  // namespace

TEST_CASE("paged views: make_page_pool addresses NHD and HND pages like the engines") {
  std::vector<float> pool(3 * 4 * 2 * 5);
  auto nhd = kvtest::value_of(make_page_pool(pool.data(), 3, 4, 2, 5, page_layout::nhd));
  CHECK(nhd.row(2, 3, 1) == pool.data() + ((2 * 4 + 3) * 2 + 1) * 5);
  auto hnd = kvtest::value_of(make_page_pool(pool.data(), 3, 4, 2, 5, page_layout::hnd));
  CHECK(hnd.row(2, 3, 1) == pool.data() + ((2 * 2 + 1) * 4 + 3) * 5);
  auto tm = kvtest::value_of(make_token_major_pool(pool.data(), 3, 4, 2, 5));
  CHECK(tm.row(1, 2, 1) == pool.data() + 1 * 40 + 2 * 10 + 5);  // sequence 1's [T][H][d] block
  kvtest::require_error(make_page_pool(pool.data(), 3, 0, 2, 5).error(), errc::invalid_argument, "page_size");
  kvtest::require_error(make_page_pool<float>(nullptr, 3, 4, 2, 5).error(), errc::null_pointer, "null");
}

TEST_CASE("paged views: a table's lengths and pages") {
  const std::int32_t indptr[] = {0, 2, 2, 5}, indices[] = {4, 0, 1, 2, 3}, last[] = {3, 0, 16};
  const page_table t{indptr, indices, last, 3};
  CHECK(t.length(0, 16) == 19);
  CHECK(t.length(1, 16) == 0);
  CHECK(t.length(2, 16) == 48);
  CHECK(t.page_of(0, 17, 16) == 0);
  CHECK(t.page_of(2, 40, 16) == 3);
  std::int32_t out[3];
  const std::int32_t lengths[] = {19, 0, 48};
  REQUIRE(last_page_lengths(indptr, 3, lengths, 16, out).ok());
  CHECK(std::vector<std::int32_t>(out, out + 3) == std::vector<std::int32_t>{3, 0, 16});
  const std::int32_t too_long[] = {33, 0, 48}, empty_last[] = {16, 0, 48};
  kvtest::require_error(last_page_lengths(indptr, 3, too_long, 16, out), errc::out_of_range, "exceeds its 2 pages");
  kvtest::require_error(last_page_lengths(indptr, 3, empty_last, 16, out), errc::invalid_argument,
                        "last page would be empty");
  const std::int32_t bad_indptr[] = {0, 2, 1, 5};
  kvtest::require_error(last_page_lengths(bad_indptr, 3, lengths, 16, out), errc::invalid_argument, "decreases");
}

TEST_CASE("paged compaction keeps the rows dense compaction keeps, on random layouts") {
  auto g = kvtest::rng(1301);
  for (const index_t ps : page_sizes)
    for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head})
      for (const page_layout layout : {page_layout::nhd, page_layout::hnd})
        for (int trial = 0; trial < 3; ++trial) {
          const index_t S = kvtest::uniform_int(g, 1, 4), H = kvtest::uniform_int(g, 1, 3);
          paged_fixture f = kvtest::make_paged_fixture(g, S, H, 8, ps, lists, layout, 3 * ps + 5);
          CAPTURE(ps);
          CAPTURE(static_cast<int>(lists));
          CAPTURE(static_cast<int>(layout));
          CAPTURE(trial);
          kvtest::dense_copy dense = kvtest::dense_of(f);
          const auto kept = random_kept(g, f);
          const flat_kept fk = flatten(kept);
          const auto pages_before = f.indices;
          const auto indptr_before = f.indptr;
          REQUIRE(compact_inplace(seq, dense.keys, fk.view(f.rows())).ok());
          REQUIRE(compact_inplace(seq, dense.values, fk.view(f.rows())).ok());
          compaction c = room_for(f);
          const status st = two_phase([&](workspace& ws) {
            return compact_paged(seq, ws, f.layer(), fk.view(f.rows()), c.out());
          });
          REQUIRE_MESSAGE(st.ok(), st.message());
          // rows: identical to the dense compaction, bit for bit
          for (index_t r = 0; r < f.rows(); ++r) {
            const index_t n = static_cast<index_t>(kept[static_cast<std::size_t>(r)].size());
            CHECK(c.lengths[static_cast<std::size_t>(f.layer().list_of(r))] == n);
            for (index_t j = 0; j < n; ++j) {
              const auto kr = f.key_row(r, j), vr = f.value_row(r, j);
              CHECK(std::equal(kr.begin(), kr.end(), dense.keys.row(r, j)));
              CHECK(std::equal(vr.begin(), vr.end(), dense.values.row(r, j)));
            }
          }
          // freed pages: exactly each list's pages past ceil(n / page_size), in table order
          std::vector<std::int32_t> expect_freed;
          index_t kept_pages = 0;
          for (index_t l = 0; l < f.list_count(); ++l) {
            const index_t n = c.lengths[static_cast<std::size_t>(l)], need = (n + ps - 1) / ps;
            kept_pages += need;
            for (index_t i = indptr_before[l] + need; i < indptr_before[l + 1]; ++i)
              expect_freed.push_back(pages_before[static_cast<std::size_t>(i)]);
          }
          REQUIRE(c.count == static_cast<std::int32_t>(expect_freed.size()));
          CHECK(std::vector<std::int32_t>(c.freed.begin(), c.freed.begin() + c.count) == expect_freed);
          CHECK(c.freed[static_cast<std::size_t>(c.count)] == -7);  // nothing past the count
          // the engine's table afterwards: kept pages + freed pages = the pages before, once each
          REQUIRE(shrink_page_table(f.indptr.data(), f.indices.data(), f.last.data(), f.list_count(), ps,
                                    c.lengths.data())
                      .ok());
          CHECK(f.indptr.back() == kept_pages);
          std::multiset<std::int32_t> after(f.indices.begin(), f.indices.begin() + f.indptr.back());
          after.insert(c.freed.begin(), c.freed.begin() + c.count);
          CHECK(after == std::multiset<std::int32_t>(pages_before.begin(), pages_before.end()));
          for (index_t l = 0; l < f.list_count(); ++l)
            CHECK(f.layer().table.length(l, ps) == c.lengths[static_cast<std::size_t>(l)]);
          // and the rows read through the shrunk table are still the kept ones
          for (index_t r = 0; r < f.rows(); ++r)
            for (index_t j = 0; j < static_cast<index_t>(kept[static_cast<std::size_t>(r)].size()); ++j) {
              const auto kr = f.key_row(r, j);
              CHECK(std::equal(kr.begin(), kr.end(), dense.keys.row(r, j)));
            }
        }
}

TEST_CASE("paged compaction: seq and par give identical pools and outputs") {
  auto g = kvtest::rng(1302);
  for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head}) {
    paged_fixture a = kvtest::make_paged_fixture(g, 5, 4, 16, 16, lists, page_layout::hnd, 200);
    paged_fixture b = a;
    const flat_kept fk = flatten(random_kept(g, a));
    compaction ca = room_for(a), cb = room_for(b);
    REQUIRE(two_phase([&](workspace& ws) { return compact_paged(seq, ws, a.layer(), fk.view(a.rows()), ca.out()); }).ok());
    REQUIRE(two_phase([&](workspace& ws) { return compact_paged(par, ws, b.layer(), fk.view(b.rows()), cb.out()); }).ok());
    kvtest::check_same_compaction(a, ca, b, cb);
  }
}

TEST_CASE("paged Knorm and value norms read the same rows as the dense stages") {
  auto g = kvtest::rng(1303);
  for (const index_t ps : page_sizes)
    for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head}) {
      paged_fixture f = kvtest::make_paged_fixture(g, 3, 2, 8, ps, lists, page_layout::nhd, 2 * ps + 3);
      kvtest::dense_copy dense = kvtest::dense_of(f);
      index_t T = 1;
      for (auto n : f.row_len) T = std::max<index_t>(T, n);
      const index_t R = f.rows();
      std::vector<float> paged_scores(static_cast<std::size_t>(R * T), 7.0f), dense_scores(paged_scores.size(), 7.0f);
      auto pv = kvtest::value_of(make_matrix_view(paged_scores.data(), R, T));
      REQUIRE(two_phase([&](workspace& ws) { return paged_key_norm_scores(par, ws, f.layer(), pv); }).ok());
      for (index_t r = 0; r < R; ++r) {
        const index_t n = f.row_len[static_cast<std::size_t>(r)];
        if (n == 0) continue;
        auto kv = kvtest::value_of(make_kv_view<const float>(dense.keys.row(r, 0), 1, n, f.d));
        auto out = kvtest::value_of(make_matrix_view(dense_scores.data() + r * T, 1, n));
        REQUIRE(key_norm_scores(seq, kv, out).ok());
      }
      CHECK(kvtest::bytes_of(paged_scores) == kvtest::bytes_of(dense_scores));  // past-length columns untouched too
      for (const value_weight mode : {value_weight::per_token, value_weight::head_max}) {
        const index_t group = 2;
        std::vector<float> ps_(static_cast<std::size_t>(R * group * T)), ds_;
        for (auto& x : ps_) x = static_cast<float>(kvtest::uniform_int(g, 1, 9));
        ds_ = ps_;
        auto sv = kvtest::value_of(make_matrix_view(ps_.data(), R * group, T));
        REQUIRE(two_phase([&](workspace& ws) { return paged_weight_by_value_norm(seq, ws, sv, f.layer(), mode); }).ok());
        for (index_t r = 0; r < R; ++r) {
          const index_t n = f.row_len[static_cast<std::size_t>(r)];
          if (n == 0) continue;
          auto vv = kvtest::value_of(make_kv_view<const float>(dense.values.row(r, 0), 1, n, f.dv));
          auto out = kvtest::value_of(make_matrix_view(ds_.data() + r * group * T, group, n, T));
          REQUIRE(weight_by_value_norm(seq, out, vv, mode).ok());
        }
        CHECK(kvtest::bytes_of(ps_) == kvtest::bytes_of(ds_));
      }
    }
}

TEST_CASE("paged compaction: every bad input fails before any write, the pool untouched") {
  auto g = kvtest::rng(1304);
  paged_fixture base = kvtest::make_paged_fixture(g, 3, 2, 4, 4, page_lists::per_head, page_layout::nhd, 11, 4);
  const auto kept0 = random_kept(g, base);
  auto expect = [&](auto mutate, errc code, const char* needle) {
    INFO("expected: " << std::string(needle));
    paged_fixture f = base;
    flat_kept fk = flatten(kept0);
    compaction c = room_for(f);
    mutate(f, fk, c);
    const auto kpool = f.kpool, vpool = f.vpool;
    const auto lengths = c.lengths, freed = c.freed;
    const std::int32_t count = c.count;
    const status st = two_phase([&](workspace& ws) { return compact_paged(seq, ws, f.layer(), fk.view(f.rows()), c.out()); });
    kvtest::require_error(st, code, needle);
    CHECK(f.kpool == kpool);
    CHECK(f.vpool == vpool);
    CHECK(c.lengths == lengths);
    CHECK(c.freed == freed);
    CHECK(c.count == count);
  };
  // find a list with pages, and two lists with pages
  std::vector<index_t> with_pages;
  for (index_t l = 0; l < base.list_count(); ++l)
    if (base.indptr[l + 1] > base.indptr[l]) with_pages.push_back(l);
  REQUIRE(with_pages.size() >= 2);
  const index_t a = with_pages[0], b = with_pages[1];
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.indices[f.indptr[a]] = static_cast<std::int32_t>(f.pages); },
         errc::out_of_range, "outside the pool");
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.indices[f.indptr[a]] = -1; }, errc::out_of_range,
         "outside the pool");
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.indices[f.indptr[b]] = f.indices[f.indptr[a]]; },
         errc::invalid_argument, "shared by lists");
  index_t two = -1;  // a list of two pages or more
  for (index_t l = 0; l < base.list_count(); ++l)
    if (base.indptr[l + 1] - base.indptr[l] >= 2) two = l;
  REQUIRE(two >= 0);
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.indices[f.indptr[two] + 1] = f.indices[f.indptr[two]]; },
         errc::invalid_argument, "twice");
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.last[a] = 0; }, errc::invalid_argument, "last_page_len is 0");
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.last[a] = static_cast<std::int32_t>(f.page_size + 1); },
         errc::invalid_argument, "outside [1, 4]");
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.indptr[1] = f.indptr[2] + 1; },
         errc::invalid_argument, "not monotone");
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.indptr[0] = 1; }, errc::invalid_argument, "indptr[0]");
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.pages = f.indptr.back() - 1; }, errc::out_of_range,
         "but the pool has");
  expect(
      [&](paged_fixture&, flat_kept& fk, compaction&) {
        // a kept position past its row's tokens ("lengths exceeding the pages")
        for (index_t r = 0; r < base.rows(); ++r)
          if (fk.cu[r + 1] > fk.cu[r]) {
            fk.pos[static_cast<std::size_t>(fk.cu[r + 1] - 1)] = base.row_len[static_cast<std::size_t>(r)];
            return;
          }
      },
      errc::out_of_range, "outside [0,");
  expect(
      [&](paged_fixture&, flat_kept& fk, compaction&) {
        for (index_t r = 0; r < base.rows(); ++r)
          if (fk.cu[r + 1] - fk.cu[r] >= 2) {
            std::swap(fk.pos[static_cast<std::size_t>(fk.cu[r])], fk.pos[static_cast<std::size_t>(fk.cu[r] + 1)]);
            return;
          }
      },
      errc::not_sorted, "strictly ascending");
  expect([&](paged_fixture&, flat_kept&, compaction& c) { c.freed.assign(1, -7); }, errc::capacity_exceeded,
         "pages are freed");
  expect([&](paged_fixture&, flat_kept&, compaction& c) { c.lengths.clear(), c.lengths.shrink_to_fit(); },
         errc::null_pointer, "out.lengths");
  expect([&](paged_fixture& f, flat_kept&, compaction&) { f.kpool.assign(1, 0.f), f.pages = 0; }, errc::out_of_range,
         "but the pool has");
  // outputs inside the pool
  {
    paged_fixture f = base;
    flat_kept fk = flatten(kept0);
    compaction c = room_for(f);
    std::int32_t count = 0;
    paged_compaction_out out{reinterpret_cast<std::int32_t*>(f.kpool.data()), c.freed.data(),
                             static_cast<index_t>(c.freed.size()), &count};
    const auto kpool = f.kpool;
    kvtest::require_error(
        two_phase([&](workspace& ws) { return compact_paged(seq, ws, f.layer(), fk.view(f.rows()), out); }),
        errc::overlap, "overlap");
    CHECK(f.kpool == kpool);
  }
  // layers whose table, sequences or pools disagree
  {
    paged_fixture f = base;
    flat_kept fk = flatten(kept0);
    compaction c = room_for(f);
    paged_layer<float> L = f.layer();
    L.sequences = 2;
    kvtest::require_error(two_phase([&](workspace& ws) { return compact_paged(seq, ws, L, fk.view(4), c.out()); }),
                          errc::shape_mismatch, "the table has 6 lists, 4 (sequences x KV heads) expected");
    L = f.layer();
    L.lists = page_lists::per_sequence;
    kvtest::require_error(two_phase([&](workspace& ws) { return compact_paged(seq, ws, L, fk.view(6), c.out()); }),
                          errc::shape_mismatch, "per-sequence tables need pools of 2 heads per page, got 1");
    L = f.layer();
    L.values.page_size = 2;
    kvtest::require_error(two_phase([&](workspace& ws) { return compact_paged(seq, ws, L, fk.view(6), c.out()); }),
                          errc::shape_mismatch, "the value pool has");
    L = f.layer();
    L.keys.page_stride = 1;
    kvtest::require_error(two_phase([&](workspace& ws) { return compact_paged(seq, ws, L, fk.view(6), c.out()); }),
                          errc::overlap, "alias");
  }
  // kept lists for another number of rows
  {
    paged_fixture f = base;
    flat_kept fk = flatten(kept0);
    compaction c = room_for(f);
    kvtest::require_error(
        two_phase([&](workspace& ws) { return compact_paged(seq, ws, f.layer(), fk.view(f.rows() - 1), c.out()); }),
        errc::shape_mismatch, "kept lists 5 rows");
  }
  // a per-sequence table whose heads keep different counts: 2 sequences x 2 heads, 5 tokens each
  {
    std::vector<float> k(4 * 4 * 2 * 3, 1.f), v(k.size(), 2.f);
    const std::int32_t indptr[] = {0, 2, 4}, indices[] = {3, 1, 0, 2}, last[] = {1, 1};
    paged_layer<float> L;
    L.keys = kvtest::value_of(make_page_pool(k.data(), 4, 4, 2, 3));
    L.values = kvtest::value_of(make_page_pool(v.data(), 4, 4, 2, 3));
    L.table = {indptr, indices, last, 2};
    L.sequences = 2;
    L.kv_heads = 2;
    const pos_t pos[] = {0, 4, 0, 4, 1};
    const std::int32_t cu[] = {0, 2, 4, 5, 5};  // sequence 1: head 0 keeps 1 token, head 1 none
    std::int32_t lengths[2], freed[4], count = -1;
    k[0] = 5.f;
    const auto k0 = k;
    kvtest::require_error(two_phase([&](workspace& ws) {
                            return compact_paged(seq, ws, L, ragged_positions{pos, cu, 4},
                                                 paged_compaction_out{lengths, freed, 4, &count});
                          }),
                          errc::shape_mismatch, "sequence 1 keeps 1 tokens in head 0 but 0 in head 1");
    CHECK(k == k0);
    CHECK(count == -1);
  }
  // validate_paged_layer alone, and its workspace
  {
    paged_fixture f = base;
    f.indices[f.indptr[b]] = f.indices[f.indptr[a]];
    kvtest::require_error(two_phase([&](workspace& ws) { return validate_paged_layer(ws, f.layer()); }),
                          errc::invalid_argument, "shared by lists");
    workspace tiny{f.kpool.data(), 1};
    kvtest::require_error(validate_paged_layer(tiny, base.layer()), errc::workspace_too_small, "");
  }
}

TEST_CASE("paged compaction: a token-major contiguous cache is a pool with one page per sequence") {
  // llama.cpp's [S][capacity][H][d]: sequence s = page s; compaction frees nothing (one page each)
  const index_t S = 3, C = 10, H = 2, d = 4;
  std::vector<float> k(S * C * H * d), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i), v[i] = -static_cast<float>(i);
  const std::int32_t indptr[] = {0, 1, 2, 3}, indices[] = {0, 1, 2}, lens[] = {10, 7, 3};
  std::int32_t last[3];
  REQUIRE(last_page_lengths(indptr, S, lens, C, last).ok());
  paged_layer<float> L;
  L.keys = kvtest::value_of(make_token_major_pool(k.data(), S, C, H, d));
  L.values = kvtest::value_of(make_token_major_pool(v.data(), S, C, H, d));
  L.table = {indptr, indices, last, S};
  L.sequences = S;
  L.kv_heads = H;
  const pos_t pos[] = {1, 4, 9, 1, 4, 9, 0, 6, 0, 6, 2, 2};
  const std::int32_t cu[] = {0, 3, 6, 8, 10, 11, 12};
  std::vector<std::int32_t> lengths(S), freed(4, -1);
  std::int32_t count = -1;
  REQUIRE(two_phase([&](workspace& ws) {
            return compact_paged(seq, ws, L, ragged_positions{pos, cu, S * H},
                                 paged_compaction_out{lengths.data(), freed.data(), 4, &count});
          }).ok());
  CHECK(lengths == std::vector<std::int32_t>{3, 2, 1});
  CHECK(count == 0);
  // sequence 1, head 1, row 1 is its token 6: element (s=1, t=6, h=1, 0) of the original cache
  CHECK(k[((1 * C + 1) * H + 1) * d] == static_cast<float>(((1 * C + 6) * H + 1) * d));
}

TEST_CASE("paged window scores are bit-identical to window_scores on dense copies of the rows") {
  auto g = kvtest::rng(1305);
  for (const index_t ps : page_sizes)
    for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head})
      for (const bool include_window : {false, true}) {
        CAPTURE(ps);
        CAPTURE(include_window);
        const index_t w = 4, G = 2;  // query heads per KV head
        paged_fixture f = kvtest::make_paged_fixture(g, 3, 2, 16, ps, lists, page_layout::nhd, 2 * ps + 9, 3, w);
        kvtest::dense_copy dense = kvtest::dense_of(f);
        const index_t R = f.rows(), Hq = f.H * G;
        index_t C = 1;
        for (auto n : f.row_len) C = std::max<index_t>(C, include_window ? n : n - w);
        const auto qdata = kvtest::random_floats(g, static_cast<std::size_t>(f.S * Hq * w * f.d));
        auto q = kvtest::value_of(make_kv_view<const float>(qdata.data(), f.S * Hq, w, f.d));
        std::vector<float> paged(static_cast<std::size_t>(f.S * Hq * C), 3.f), ref(paged.size(), 3.f);
        auto pv = kvtest::value_of(make_matrix_view(paged.data(), f.S * Hq, C));
        const status st = two_phase([&](workspace& ws) { return paged_window_scores(par, ws, q, f.layer(), pv, include_window); });
        REQUIRE_MESSAGE(st.ok(), st.message());
        for (index_t r = 0; r < R; ++r) {
          const index_t n = f.row_len[static_cast<std::size_t>(r)];
          auto keys = kvtest::value_of(make_kv_view<const float>(dense.keys.row(r, 0), 1, n, f.d));
          auto qr = kvtest::value_of(make_kv_view<const float>(qdata.data() + r * G * w * f.d, G, w, f.d));
          auto out = kvtest::value_of(make_matrix_view(ref.data() + r * G * C, G, include_window ? n : n - w, C));
          REQUIRE(two_phase([&](workspace& ws) { return window_scores(seq, ws, qr, keys, out); }).ok());
        }
        CHECK(kvtest::bytes_of(paged) == kvtest::bytes_of(ref));
      }
}

TEST_CASE("paged window scores: bad input") {
  auto g = kvtest::rng(1306);
  paged_fixture f = kvtest::make_paged_fixture(g, 2, 2, 8, 4, page_lists::per_head, page_layout::hnd, 12, 3, 5);
  std::vector<float> qd(2 * 4 * 3 * 8), out(2 * 4 * 20);
  auto q = kvtest::value_of(make_kv_view<const float>(qd.data(), 8, 3, 8));
  auto ov = kvtest::value_of(make_matrix_view(out.data(), 8, 20));
  auto run = [&](kv_view<const float> qq, matrix_view<float> oo) {
    return two_phase([&](workspace& ws) { return paged_window_scores(seq, ws, qq, f.layer(), oo); });
  };
  // a row shorter than the window
  const index_t shortest = *std::min_element(f.row_len.begin(), f.row_len.end());
  std::vector<float> qlong(static_cast<std::size_t>(8 * (shortest + 1) * 8));
  auto ql = kvtest::value_of(make_kv_view<const float>(qlong.data(), 8, shortest + 1, 8));
  kvtest::require_error(run(ql, ov), errc::invalid_argument,
                        "fewer than the window's " + std::to_string(shortest + 1));
  auto q7 = kvtest::value_of(make_kv_view<const float>(qd.data(), 7, 3, 8));
  kvtest::require_error(run(q7, ov), errc::shape_mismatch, "not sequences (2) x a multiple of 2 KV heads");
  auto qd4 = kvtest::value_of(make_kv_view<const float>(qd.data(), 8, 3, 4));
  kvtest::require_error(run(qd4, ov), errc::shape_mismatch, "queries have dim 4, the keys 8");
  REQUIRE(f.indices.size() >= 2);
  f.indices[0] = f.indices[1];
  kvtest::require_error(run(q, ov), errc::invalid_argument, "page");
}

TEST_CASE("paged compact_layer: keys and values as compact_paged, the positions moved with their rows") {
  auto g = kvtest::rng(1371);
  for (const index_t ps : page_sizes)
    for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head})
      for (const page_layout layout : {page_layout::nhd, page_layout::hnd}) {
        const index_t S = kvtest::uniform_int(g, 1, 4), H = kvtest::uniform_int(g, 1, 3);
        paged_fixture f = kvtest::make_paged_fixture(g, S, H, 8, ps, lists, layout, 3 * ps + 5);
        CAPTURE(ps);
        CAPTURE(static_cast<int>(lists));
        CAPTURE(static_cast<int>(layout));
        paged_fixture ref = f;  // the same layout, compacted by compact_paged
        std::vector<pos_t> ppool(static_cast<std::size_t>(f.pages * ps * f.heads_per_page()), -1);
        const auto pos_pool = kvtest::value_of(make_page_pool(ppool.data(), f.pages, ps, f.heads_per_page(), 1, layout));
        const auto pos_of = [&](index_t r, index_t j) -> pos_t& {
          const auto L = f.layer();
          return *pos_pool.row(L.table.page_of(L.list_of(r), j, ps), j % ps, L.head_of(r));
        };
        for (index_t r = 0; r < f.rows(); ++r)
          for (index_t j = 0; j < f.row_len[static_cast<std::size_t>(r)]; ++j) pos_of(r, j) = static_cast<pos_t>(1000 * r + j);
        const auto kept = random_kept(g, f);
        const flat_kept fk = flatten(kept);
        compaction c = room_for(f), cr = room_for(ref);
        REQUIRE(two_phase([&](workspace& ws) { return compact_paged(seq, ws, ref.layer(), fk.view(f.rows()), cr.out()); })
                    .ok());
        const status st = two_phase([&](workspace& ws) {
          return compact_layer(par, ws, f.layer(), pos_pool, fk.view(f.rows()), c.out());
        });
        REQUIRE_MESSAGE(st.ok(), st.message());
        kvtest::check_same_compaction(f, c, ref, cr);
        for (index_t r = 0; r < f.rows(); ++r)
          for (std::size_t j = 0; j < kept[static_cast<std::size_t>(r)].size(); ++j)
            CHECK(pos_of(r, static_cast<index_t>(j)) == static_cast<pos_t>(1000 * r + kept[static_cast<std::size_t>(r)][j]));
      }
}

TEST_CASE("paged compact_layer: a bad position pool fails before any write") {
  auto g = kvtest::rng(1372);
  paged_fixture f = kvtest::make_paged_fixture(g, 2, 2, 4, 4, page_lists::per_head, page_layout::hnd, 11, 3, 4);
  const auto kept = random_kept(g, f);
  const flat_kept fk = flatten(kept);
  std::vector<pos_t> ppool(static_cast<std::size_t>(f.pages * 4 * 2), 5);
  const paged_fixture before = f;
  const auto before_pos = ppool;
  const auto fails = [&](page_pool<pos_t> p, errc code, const char* what) {
    compaction c = room_for(f);
    std::vector<unsigned char> mem(paged_workspace_bytes(f.pages));
    workspace ws{mem.data(), mem.size()};
    kvtest::require_error(compact_layer(seq, ws, f.layer(), p, fk.view(f.rows()), c.out()), code, what);
    CHECK(f.kpool == before.kpool);
    CHECK(f.vpool == before.vpool);
    CHECK(ppool == before_pos);
    CHECK(c.count == -7);
  };
  fails(kvtest::value_of(make_page_pool(ppool.data(), f.pages, 4, 1, 2, page_layout::hnd)), errc::shape_mismatch,
        "dim 1 needed");
  fails(kvtest::value_of(make_page_pool(ppool.data(), f.pages - 1, 4, 1, 1, page_layout::hnd)), errc::shape_mismatch,
        "the position pool has");
  fails(kvtest::value_of(make_page_pool(ppool.data(), f.pages, 2, 1, 1, page_layout::hnd)), errc::shape_mismatch,
        "the position pool has");
  auto inside_keys = kvtest::value_of(make_page_pool(ppool.data(), f.pages, 4, 1, 1, page_layout::hnd));
  inside_keys.data = reinterpret_cast<pos_t*>(f.kpool.data());
  fails(inside_keys, errc::overlap, "positions");
  fails({nullptr, f.pages, 4, 1, 1, 1, 1, 4}, errc::null_pointer, "positions");
}
