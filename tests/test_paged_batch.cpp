// Batches (kvevict/batch.hpp): one selection for a batch of varlen sequences equals each sequence
// selected alone, padded and varlen layouts agree, seq == par; the whole paged pipeline (Knorm
// through the paged views, batched selection, paged compaction) keeps the rows of the dense one.
#include "paged_fixture.hpp"

#include <kvevict/batch.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>

using namespace kvevict;
using kvtest::two_phase;

namespace {

/// A random batch: S sequences x H heads, lengths in [0, max_len], scores from a few values (ties).
struct batch_case {
  index_t S = 0, H = 0, T = 0;
  std::vector<std::int32_t> seq_len, row_len, budgets, cu;
  std::vector<float> padded, varlen;  // [S*H][T] and [H][total]
};

batch_case make_batch(std::mt19937_64& g, index_t S, index_t H, index_t max_len, int distinct) {
  batch_case b;
  b.S = S, b.H = H;
  b.cu.assign(1, 0);
  for (index_t s = 0; s < S; ++s) {
    b.seq_len.push_back(static_cast<std::int32_t>(kvtest::uniform_int(g, 0, max_len)));
    b.cu.push_back(b.cu.back() + b.seq_len.back());
    b.budgets.push_back(static_cast<std::int32_t>(kvtest::uniform_int(g, 0, max_len + 2)));
    b.T = std::max<index_t>(b.T, b.seq_len.back());
  }
  b.T = std::max<index_t>(b.T, 1);
  b.padded.assign(static_cast<std::size_t>(S * H * b.T), -5.f);
  b.varlen.assign(static_cast<std::size_t>(H * std::max<index_t>(b.cu.back(), 1)), -5.f);
  for (index_t s = 0; s < S; ++s)
    for (index_t h = 0; h < H; ++h) {
      b.row_len.push_back(b.seq_len[static_cast<std::size_t>(s)]);
      for (index_t j = 0; j < b.seq_len[static_cast<std::size_t>(s)]; ++j) {
        const float x = static_cast<float>(kvtest::uniform_int(g, 0, distinct - 1));
        b.padded[static_cast<std::size_t>((s * H + h) * b.T + j)] = x;
        b.varlen[static_cast<std::size_t>(h * std::max<index_t>(b.cu.back(), 1) + b.cu[s] + j)] = x;
      }
    }
  return b;
}

struct kept_lists {
  std::vector<std::int32_t> cu;
  std::vector<pos_t> pos;
  bool operator==(const kept_lists& o) const { return cu == o.cu && pos == o.pos; }
};

template <class Backend>
kept_lists run_batch(Backend be, const batch_case& b, batch_budget kind, bool varlen) {
  kept_lists k;
  k.cu.assign(static_cast<std::size_t>(b.S * b.H + 1), -1);
  k.pos.assign(static_cast<std::size_t>(b.S * b.H * b.T + 1), -1);
  const index_t total = std::max<index_t>(b.cu.back(), 1);
  const batch_rows rows =
      varlen ? batch_varlen(kvtest::value_of(make_matrix_view<const float>(b.varlen.data(), b.H, total)), b.cu.data(), b.S)
             : batch_padded(kvtest::value_of(make_matrix_view<const float>(b.padded.data(), b.S * b.H, b.T)), b.S, b.H,
                            b.row_len.data());
  const status st = two_phase([&](workspace& ws) {
    return select_topk_batch(be, ws, rows, b.budgets.data(), kind, k.cu.data(), k.pos.data(),
                             static_cast<index_t>(k.pos.size()));
  });
  REQUIRE_MESSAGE(st.ok(), st.message());
  k.pos.resize(static_cast<std::size_t>(k.cu.back()));
  return k;
}

/// Each sequence alone, with the single-sequence selections.
kept_lists run_alone(const batch_case& b, batch_budget kind) {
  kept_lists k;
  k.cu.assign(1, 0);
  for (index_t s = 0; s < b.S; ++s) {
    const index_t n = b.seq_len[static_cast<std::size_t>(s)], H = b.H;
    std::vector<float> sc(static_cast<std::size_t>(H * std::max<index_t>(n, 1)));
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < n; ++j)
        sc[static_cast<std::size_t>(h * n + j)] = b.padded[static_cast<std::size_t>((s * H + h) * b.T + j)];
    auto sv = kvtest::value_of(make_matrix_view<const float>(sc.data(), H, n));
    std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1), 0);
    std::vector<pos_t> pos(static_cast<std::size_t>(H * n + 1));
    const index_t bud = b.budgets[static_cast<std::size_t>(s)];
    status st;
    if (kind == batch_budget::per_head) {
      for (index_t h = 0; h < H; ++h) cu[static_cast<std::size_t>(h + 1)] = cu[static_cast<std::size_t>(h)] + static_cast<std::int32_t>(std::min(bud, n));
      st = two_phase([&](workspace& ws) {
        return select_topk(seq, ws, sv, nullptr, ragged_positions_out{pos.data(), cu.data(), H});
      });
    } else {
      st = two_phase([&](workspace& ws) {
        return select_topk_flat(seq, ws, sv, nullptr, std::min(bud * H, H * n), nullptr, cu.data(), pos.data());
      });
    }
    REQUIRE_MESSAGE(st.ok(), st.message());
    const std::int32_t base = k.cu.back();
    for (index_t h = 0; h < H; ++h) k.cu.push_back(base + cu[static_cast<std::size_t>(h + 1)]);
    k.pos.insert(k.pos.end(), pos.begin(), pos.begin() + cu.back());
  }
  return k;
}

}  // namespace

TEST_CASE("select_topk_batch: a batch equals each sequence alone, padded == varlen, seq == par") {
  auto g = kvtest::rng(1311);
  for (const batch_budget kind : {batch_budget::per_head, batch_budget::flattened})
    for (int trial = 0; trial < 12; ++trial) {
      CAPTURE(static_cast<int>(kind));
      CAPTURE(trial);
      const batch_case b = make_batch(g, kvtest::uniform_int(g, 1, 9), kvtest::uniform_int(g, 1, 4),
                                      trial < 6 ? 40 : 3000, trial % 3 == 0 ? 3 : 1000);
      const kept_lists alone = run_alone(b, kind);
      CHECK(run_batch(seq, b, kind, false) == alone);
      CHECK(run_batch(seq, b, kind, true) == alone);
      CHECK(run_batch(par, b, kind, false) == alone);
      CHECK(run_batch(par, b, kind, true) == alone);
    }
}

TEST_CASE("select_topk_batch: bad input fails before anything is written") {
  auto g = kvtest::rng(1312);
  batch_case b = make_batch(g, 4, 2, 20, 50);
  b.seq_len = {5, 7, 0, 9};
  b.cu = {0, 5, 12, 12, 21};
  b.varlen.assign(static_cast<std::size_t>(2 * 21), 1.f);
  std::vector<std::int32_t> cu(9, -1);
  std::vector<pos_t> pos(100, -1);
  auto run = [&](const batch_rows& rows, const std::int32_t* budgets, index_t cap, batch_budget kind = batch_budget::per_head) {
    return two_phase([&](workspace& ws) { return select_topk_batch(seq, ws, rows, budgets, kind, cu.data(), pos.data(), cap); });
  };
  const auto sv = kvtest::value_of(make_matrix_view<const float>(b.varlen.data(), 2, 21));
  std::vector<std::int32_t> bad_cu = {0, 5, 4, 12, 21};
  kvtest::require_error(run(batch_varlen(sv, bad_cu.data(), 4), b.budgets.data(), 100), errc::invalid_argument,
                        "cu_seqlens is not monotone: sequence 1 has 5 -> 4");
  bad_cu = {1, 5, 7, 12, 21};
  kvtest::require_error(run(batch_varlen(sv, bad_cu.data(), 4), b.budgets.data(), 100), errc::invalid_argument,
                        "cu_seqlens[0] must be 0");
  bad_cu = {0, 5, 7, 12, 22};
  kvtest::require_error(run(batch_varlen(sv, bad_cu.data(), 4), b.budgets.data(), 100), errc::out_of_range,
                        "past the 21 score columns");
  std::vector<std::int32_t> budgets = {3, -1, 2, 2};
  kvtest::require_error(run(batch_varlen(sv, b.cu.data(), 4), budgets.data(), 100), errc::invalid_argument,
                        "budgets[1] = -1 is negative");
  budgets = {3, 3, 3, 3};
  kvtest::require_error(run(batch_varlen(sv, b.cu.data(), 4), budgets.data(), 17), errc::capacity_exceeded,
                        "keeps 18 tokens but kept_pos has room for 17");
  kvtest::require_error(run(batch_varlen(sv, b.cu.data(), 4), nullptr, 100), errc::null_pointer, "budgets is null");
  const auto pv = kvtest::value_of(make_matrix_view<const float>(b.varlen.data(), 7, 6));
  kvtest::require_error(run(batch_padded(pv, 4, 2, nullptr), budgets.data(), 100), errc::shape_mismatch,
                        "padded scores have 7 rows, expected 4 sequences x 2 heads");
  const std::int32_t lens[] = {1, 2, 3, 4, 5, 6, 7, 1};
  const auto pv8 = kvtest::value_of(make_matrix_view<const float>(b.varlen.data(), 8, 5));
  kvtest::require_error(run(batch_padded(pv8, 4, 2, lens), budgets.data(), 100), errc::out_of_range, "outside [0, 5]");
  const auto over = kvtest::value_of(make_matrix_view<const float>(reinterpret_cast<const float*>(pos.data()), 2, 21));
  kvtest::require_error(run(batch_varlen(over, b.cu.data(), 4), budgets.data(), 100, batch_budget::flattened),
                        errc::overlap, "overlap");
  CHECK(cu == std::vector<std::int32_t>(9, -1));
  CHECK(pos == std::vector<pos_t>(100, -1));
}

TEST_CASE("paged pipeline: Knorm on paged keys, one batched selection, paged compaction == the dense pipeline") {
  auto g = kvtest::rng(1313);
  for (const index_t ps : {index_t(1), index_t(16), index_t(64)})
    for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head}) {
      CAPTURE(ps);
      kvtest::paged_fixture f = kvtest::make_paged_fixture(g, 6, 2, 8, ps, lists, page_layout::hnd, 3 * ps + 7);
      kvtest::dense_copy dense = kvtest::dense_of(f);
      const index_t R = f.rows();
      index_t T = 1;
      for (auto n : f.row_len) T = std::max<index_t>(T, n);
      std::vector<std::int32_t> budgets;
      for (index_t s = 0; s < f.S; ++s) budgets.push_back(static_cast<std::int32_t>(kvtest::uniform_int(g, 0, 2 * ps + 2)));
      // paged: scores through the paged views, one selection for the batch, compaction of the pool
      std::vector<float> scores(static_cast<std::size_t>(R * T));
      auto sv = kvtest::value_of(make_matrix_view(scores.data(), R, T));
      REQUIRE(two_phase([&](workspace& ws) { return paged_key_norm_scores(seq, ws, f.layer(), sv); }).ok());
      std::vector<std::int32_t> cu(static_cast<std::size_t>(R + 1));
      std::vector<pos_t> pos(static_cast<std::size_t>(R * T + 1));
      const auto kind = lists == page_lists::per_head ? batch_budget::flattened : batch_budget::per_head;
      REQUIRE(two_phase([&](workspace& ws) {
                return select_topk_batch(par, ws, batch_padded(sv, f.S, f.H, f.row_len.data()), budgets.data(), kind,
                                         cu.data(), pos.data(), static_cast<index_t>(pos.size()));
              }).ok());
      std::vector<std::int32_t> lengths(static_cast<std::size_t>(f.list_count())), freed(static_cast<std::size_t>(f.pages));
      std::int32_t count = 0;
      REQUIRE(two_phase([&](workspace& ws) {
                return compact_paged(par, ws, f.layer(), ragged_positions{pos.data(), cu.data(), R},
                                     paged_compaction_out{lengths.data(), freed.data(), f.pages, &count});
              }).ok());
      // dense, one sequence at a time: key_norm_scores, select_topk / select_topk_flat, compact_inplace
      for (index_t s = 0; s < f.S; ++s) {
        const index_t H = f.H, b = budgets[static_cast<std::size_t>(s)];
        std::vector<float> ds;
        std::vector<std::int32_t> rl;
        index_t most = 1, held = 0;
        for (index_t h = 0; h < H; ++h) most = std::max<index_t>(most, f.row_len[static_cast<std::size_t>(s * H + h)]);
        ds.assign(static_cast<std::size_t>(H * most), 0.f);
        std::vector<std::int32_t> kcu(static_cast<std::size_t>(H + 1), 0);
        for (index_t h = 0; h < H; ++h) {
          const index_t r = s * H + h, n = f.row_len[static_cast<std::size_t>(r)];
          rl.push_back(static_cast<std::int32_t>(n));
          held += n;
          kcu[static_cast<std::size_t>(h + 1)] = kcu[static_cast<std::size_t>(h)] + static_cast<std::int32_t>(std::min(b, n));
          if (n == 0) continue;
          auto kv = kvtest::value_of(make_kv_view<const float>(dense.keys.row(r, 0), 1, n, f.d));
          REQUIRE(key_norm_scores(seq, kv, kvtest::value_of(make_matrix_view(ds.data() + h * most, 1, n))).ok());
        }
        auto dv = kvtest::value_of(make_matrix_view<const float>(ds.data(), H, most));
        std::vector<pos_t> kp(static_cast<std::size_t>(H * most + 1));
        if (kind == batch_budget::per_head)
          REQUIRE(two_phase([&](workspace& ws) {
                    return select_topk(seq, ws, dv, rl.data(), ragged_positions_out{kp.data(), kcu.data(), H});
                  }).ok());
        else
          REQUIRE(two_phase([&](workspace& ws) {
                    return select_topk_flat(seq, ws, dv, rl.data(), std::min(b * H, held), nullptr, kcu.data(), kp.data());
                  }).ok());
        for (index_t h = 0; h < H; ++h) {
          const index_t r = s * H + h, n = kcu[static_cast<std::size_t>(h + 1)] - kcu[static_cast<std::size_t>(h)];
          REQUIRE(cu[static_cast<std::size_t>(r + 1)] - cu[static_cast<std::size_t>(r)] == n);
          for (index_t j = 0; j < n; ++j) {
            const pos_t p = kp[static_cast<std::size_t>(kcu[static_cast<std::size_t>(h)] + j)];
            const auto kr = f.key_row(r, j), vr = f.value_row(r, j);
            CHECK(std::equal(kr.begin(), kr.end(), dense.keys.row(r, p)));
            CHECK(std::equal(vr.begin(), vr.end(), dense.values.row(r, p)));
          }
        }
      }
    }
}
