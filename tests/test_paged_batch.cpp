// Batches (kvevict/batch.hpp): one selection for a batch of varlen sequences equals each sequence
// selected alone, padded and varlen layouts agree, seq == par; the whole paged pipeline (Knorm
// through the paged views, batched selection, paged compaction) keeps the rows of the dense one.
#include "paged_fixture.hpp"
#include "thread_comm.hpp"

#include <kvevict/batch.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/drivers/cascade_driver.hpp>
#include <kvevict/drivers/chunked.hpp>
#include <kvevict/drivers/compact_layer.hpp>
#include <kvevict/drivers/decode.hpp>
#include <kvevict/drivers/post_fill.hpp>
#include <kvevict/drivers/streaming_heads.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>

#include <array>
#include <cmath>

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
  REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
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
    REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
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

// ---------------------------------------------------------------------------------------------
// Drivers reading paged layers (paged_layer_kv): the post-fill, decode and chunked drivers give
// exactly the dense drivers' answers on the same rows held in a shuffled page pool.

namespace {

/// One sequence's layer as per-head rows, in arrival order: what both caches are built from.
struct head_rows_set {
  index_t H = 0, d = 0;
  std::vector<std::vector<float>> k, v;
  std::vector<std::vector<pos_t>> pos;
  index_t len(index_t h) const { return static_cast<index_t>(pos[static_cast<std::size_t>(h)].size()); }
  void append(index_t h, const float* kr, const float* vr, pos_t p) {
    auto& K = k[static_cast<std::size_t>(h)];
    auto& V = v[static_cast<std::size_t>(h)];
    K.insert(K.end(), kr, kr + d);
    V.insert(V.end(), vr, vr + d);
    pos[static_cast<std::size_t>(h)].push_back(p);
  }
  /// Every head keeps the rows kept lists (a driver's answer), in order.
  void compact(const ragged_positions& kept) {
    for (index_t h = 0; h < H; ++h) {
      head_rows_set one;
      const auto hs = static_cast<std::size_t>(h);
      std::vector<float> K, V;
      std::vector<pos_t> P;
      for (index_t i = 0; i < kept.length(h); ++i) {
        const auto j = static_cast<std::size_t>(kept.pos[kept.cu[h] + i]);
        K.insert(K.end(), k[hs].begin() + static_cast<std::ptrdiff_t>(j * d), k[hs].begin() + static_cast<std::ptrdiff_t>((j + 1) * d));
        V.insert(V.end(), v[hs].begin() + static_cast<std::ptrdiff_t>(j * d), v[hs].begin() + static_cast<std::ptrdiff_t>((j + 1) * d));
        P.push_back(pos[hs][j]);
      }
      k[hs] = K, v[hs] = V, pos[hs] = P;
    }
  }
};

/// A random layer: head h holds every position of [P - tail, P) and a random subset of the
/// others (all of them when whole), at least `least` rows; keys from `distinct` values when > 0
/// (ties), a NaN key or value element when asked.
head_rows_set random_rows(std::mt19937_64& g, index_t H, index_t d, index_t P, index_t tail, index_t least, bool whole,
                          bool same_length, int distinct, bool nan) {
  head_rows_set r;
  r.H = H, r.d = d;
  r.k.resize(static_cast<std::size_t>(H)), r.v.resize(static_cast<std::size_t>(H)), r.pos.resize(static_cast<std::size_t>(H));
  const index_t shared_n = kvtest::uniform_int(g, std::max(least, tail), P);
  for (index_t h = 0; h < H; ++h) {
    const index_t n = whole ? P : same_length ? shared_n : kvtest::uniform_int(g, std::max(least, tail), P);
    std::vector<pos_t> head(static_cast<std::size_t>(P - tail));
    std::iota(head.begin(), head.end(), 0);
    std::shuffle(head.begin(), head.end(), g);
    head.resize(static_cast<std::size_t>(n - tail));
    for (index_t t = P - tail; t < P; ++t) head.push_back(static_cast<pos_t>(t));
    std::sort(head.begin(), head.end());
    for (pos_t p : head) {
      auto kr = kvtest::random_floats(g, static_cast<std::size_t>(d));
      auto vr = kvtest::random_floats(g, static_cast<std::size_t>(d));
      if (distinct > 0)
        for (auto& x : kr) x = std::round(x * static_cast<float>(distinct)) / static_cast<float>(distinct);
      r.append(h, kr.data(), vr.data(), p);
    }
  }
  if (nan) {
    const index_t h = kvtest::uniform_int(g, 0, H - 1);
    auto& target = kvtest::uniform_int(g, 0, 1) ? r.k[static_cast<std::size_t>(h)] : r.v[static_cast<std::size_t>(h)];
    if (!target.empty()) target[static_cast<std::size_t>(kvtest::uniform_int(g, 0, static_cast<index_t>(target.size()) - 1))] = std::nanf("");
  }
  return r;
}

/// The rows as a dense ragged layer (each head's rows contiguous, room for `room` rows).
struct ragged_layer {
  std::vector<float> k, v;
  std::vector<std::int32_t> cu, lens;
  std::vector<pos_t> pos;
  ragged_layer(const head_rows_set& r, index_t room) {
    const index_t H = r.H, d = r.d;
    k.assign(static_cast<std::size_t>(H * room * d + 1), 0.f);
    v = k;
    pos.assign(static_cast<std::size_t>(H * room + 1), 0);
    for (index_t h = 0; h < H; ++h) {
      cu.push_back(static_cast<std::int32_t>(h * room));
      lens.push_back(static_cast<std::int32_t>(r.len(h)));
      const auto hs = static_cast<std::size_t>(h);
      std::copy(r.k[hs].begin(), r.k[hs].end(), k.begin() + static_cast<std::ptrdiff_t>(h * room * d));
      std::copy(r.v[hs].begin(), r.v[hs].end(), v.begin() + static_cast<std::ptrdiff_t>(h * room * d));
      std::copy(r.pos[hs].begin(), r.pos[hs].end(), pos.begin() + static_cast<std::ptrdiff_t>(h * room));
    }
    cu.push_back(static_cast<std::int32_t>(H * room));
  }
  layer_kv<float> view(const head_rows_set& r) {
    return {{k.data(), cu.data(), lens.data(), r.H, r.d, r.d}, {v.data(), cu.data(), lens.data(), r.H, r.d, r.d},
            pos.data()};
  }
};

/// The rows as sequence `seq` of a batch of S sequences in a shuffled page pool (the other
/// sequences random), per-sequence tables when every head holds as many rows, else per-head.
struct paged_store {
  index_t S = 0, H = 0, d = 0, ps = 0, pages = 0, seq = 0;
  page_lists lists = page_lists::per_head;
  page_layout layout = page_layout::nhd;
  std::vector<float> kpool, vpool;
  std::vector<pos_t> ppool;
  std::vector<std::int32_t> indptr, indices, last;

  paged_layer<float> layer() {
    const index_t hp = lists == page_lists::per_head ? 1 : H;
    return {kvtest::value_of(make_page_pool(kpool.data(), pages, ps, hp, d, layout)),
            kvtest::value_of(make_page_pool(vpool.data(), pages, ps, hp, d, layout)),
            page_table{indptr.data(), indices.data(), last.data(), lists == page_lists::per_head ? S * H : S}, S, H,
            lists};
  }
  page_pool<pos_t> positions() {
    return kvtest::value_of(make_page_pool(ppool.data(), pages, ps, lists == page_lists::per_head ? 1 : H, 1, layout));
  }
  paged_layer_kv<float> view() { return make_paged_layer_kv(layer(), positions(), seq); }
};

paged_store paged_of(std::mt19937_64& g, const head_rows_set& r, index_t ps, bool allow_per_sequence) {
  paged_store p;
  p.H = r.H, p.d = r.d, p.ps = ps;
  p.S = kvtest::uniform_int(g, 1, 3);
  p.seq = kvtest::uniform_int(g, 0, p.S - 1);
  p.layout = kvtest::uniform_int(g, 0, 1) ? page_layout::hnd : page_layout::nhd;
  bool same = true;
  for (index_t h = 1; h < r.H; ++h) same = same && r.len(h) == r.len(0);
  p.lists = allow_per_sequence && same && kvtest::uniform_int(g, 0, 1) ? page_lists::per_sequence : page_lists::per_head;
  const bool per_head = p.lists == page_lists::per_head;
  // every list's length: the sequence's rows, random rows for the others
  const index_t n_lists = per_head ? p.S * p.H : p.S;
  std::vector<index_t> len(static_cast<std::size_t>(n_lists));
  for (index_t s = 0; s < p.S; ++s) {
    const index_t other = kvtest::uniform_int(g, 0, 40);
    for (index_t i = 0; i < (per_head ? p.H : 1); ++i)
      len[static_cast<std::size_t>(per_head ? s * p.H + i : s)] = s == p.seq ? r.len(i) : other;
  }
  index_t need = 0;
  for (index_t n : len) need += (n + ps - 1) / ps;
  p.pages = need + kvtest::uniform_int(g, 0, 3);
  std::vector<std::int32_t> perm(static_cast<std::size_t>(p.pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), g);
  p.indptr.assign(1, 0);
  std::size_t at = 0;
  for (index_t l = 0; l < n_lists; ++l) {
    const index_t n = (len[static_cast<std::size_t>(l)] + ps - 1) / ps;
    for (index_t i = 0; i < n; ++i) p.indices.push_back(perm[at++]);
    p.indptr.push_back(static_cast<std::int32_t>(p.indices.size()));
    p.last.push_back(static_cast<std::int32_t>(n == 0 ? 0 : len[static_cast<std::size_t>(l)] - (n - 1) * ps));
  }
  p.indices.push_back(0);  // never empty
  const index_t hp = per_head ? 1 : p.H;
  p.kpool = kvtest::random_floats(g, static_cast<std::size_t>(p.pages * ps * hp * p.d + 1));
  p.vpool = kvtest::random_floats(g, static_cast<std::size_t>(p.pages * ps * hp * p.d + 1));
  p.ppool.assign(static_cast<std::size_t>(p.pages * ps * hp + 1), 0);
  const auto L = p.layer();
  const auto P = p.positions();
  for (index_t s = 0; s < p.S; ++s)
    for (index_t h = 0; h < p.H; ++h) {
      const index_t row = s * p.H + h, list = L.list_of(row), n = L.length(row);
      for (index_t j = 0; j < n; ++j) {
        pos_t* pp = P.row(L.table.page_of(list, j, ps), j % ps, L.head_of(row));
        if (s != p.seq) {
          *pp = static_cast<pos_t>(j);
          continue;
        }
        const auto hs = static_cast<std::size_t>(h), js = static_cast<std::size_t>(j * p.d);
        std::copy(r.k[hs].begin() + static_cast<std::ptrdiff_t>(js), r.k[hs].begin() + static_cast<std::ptrdiff_t>(js + p.d), L.key(row, j));
        std::copy(r.v[hs].begin() + static_cast<std::ptrdiff_t>(js), r.v[hs].begin() + static_cast<std::ptrdiff_t>(js + p.d), L.value(row, j));
        *pp = r.pos[hs][static_cast<std::size_t>(j)];
      }
    }
  return p;
}

/// A post-fill configuration of L layers x H KV heads (g query heads each) over P tokens.
post_fill_config post_fill_of(index_t L, index_t H, index_t gq, index_t d, index_t P, index_t query_rows, const recipe& r) {
  post_fill_config cfg;
  cfg.model = {L, H, H * gq, d};
  cfg.tokens = P;
  cfg.query_rows = query_rows;
  cfg.rec = r;
  return cfg;
}

/// Layer l's fewest rows in a head, and its rows and protected rows summed into `all` / `prot`.
index_t layer_totals(const head_rows_set& rows, const recipe& r, index_t P, index_t& all, index_t& prot) {
  index_t least = P;
  for (index_t h = 0; h < rows.H; ++h) {
    const index_t n = rows.len(h);
    least = std::min(least, n);
    all += n;
    prot += protected_count(n, r.n_sink, r.n_recent);
  }
  return least;
}

std::vector<std::int32_t> kept_cu_of(const ragged_positions& k) { return {k.cu, k.cu + (k.heads + 1)}; }
std::vector<pos_t> kept_pos_of(const ragged_positions& k) { return {k.pos, k.pos + k.total()}; }

/// A driver call with a workspace of exactly workspace_bytes(be) (misaligned bases included).
template <class Driver, class Backend, class F>
status with_ws(const Driver& d, Backend be, std::vector<unsigned char>& mem, F&& call) {
  const std::size_t bytes = kvtest::value_of(d.workspace_bytes(be));
  workspace ws = kvtest::shifted_workspace(mem, bytes, 0x5a);
  return call(ws);
}

/// The recipes the paged drivers read: every scoring family, a few protections.
recipe random_recipe(std::mt19937_64& g, index_t w, index_t* query_rows, bool* block_keys, bool decode) {
  recipe r;
  *query_rows = 0;
  *block_keys = false;
  switch (kvtest::uniform_int(g, 0, decode ? 6 : 8)) {
    case 0: r = recipe::snapkv(); break;
    case 1: r = recipe::vatp(); break;
    case 2: r = recipe::lava(); break;
    case 3: r = recipe::h2o(); break;
    case 4: r = recipe::tova(); break;
    case 5: r = recipe::knorm(); break;
    case 6: r = recipe::streaming_llm(2); break;
    case 7: r = recipe::cake(); break;
    default:
      r = recipe::snapkv();
      r.source = query_source::external_block;
      *query_rows = w;
      *block_keys = kvtest::uniform_int(g, 0, 1) == 1;
  }
  if (r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova && r.kind != recipe_kind::knorm &&
      r.kind != recipe_kind::streaming_llm) {
    r.window = w;
    r.n_recent = *query_rows > 0 ? kvtest::uniform_int(g, 0, 2) : w;
    r.kernel = 3;
  } else if (r.kind == recipe_kind::h2o) {
    r.n_recent = decode ? w : kvtest::uniform_int(g, 0, 3);
  }
  r.n_sink = kvtest::uniform_int(g, 0, 2);
  return r;
}

/// A one-layer allocation of random per_head / flattened / adakv budgets in [least, least + spread]
/// (adakv: one shared budget); returns the most rows a head holds after an eviction.
index_t random_budgets(std::mt19937_64& g, allocation& a, std::vector<std::int32_t>& budgets, index_t H, index_t least,
                       index_t spread) {
  const auto kinds = std::array<allocator, 3>{allocator::per_head, allocator::flattened, allocator::adakv};
  a.kind = kinds[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 2))];
  budgets.assign(static_cast<std::size_t>(H), 0);
  const auto shared = static_cast<std::int32_t>(kvtest::uniform_int(g, least, least + spread));
  index_t sum = 0, most = 0;
  for (auto& b : budgets) {
    b = a.kind == allocator::adakv ? shared : static_cast<std::int32_t>(kvtest::uniform_int(g, least, least + spread));
    sum += b;
    most = std::max<index_t>(most, b);
  }
  a.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data(), 1, H));
  return a.kind == allocator::per_head ? most : sum;
}

/// A recipe the chunked driver takes: SnapKV, VATP, LAVa (window w, protecting it), Knorm or
/// StreamingLLM.
recipe chunk_recipe_of(std::mt19937_64& g, index_t w) {
  recipe r;
  switch (kvtest::uniform_int(g, 0, 4)) {
    case 0: r = recipe::snapkv(); break;
    case 1: r = recipe::vatp(); break;
    case 2: r = recipe::lava(); break;
    case 3: r = recipe::knorm(); break;
    default: r = recipe::streaming_llm(1);
  }
  if (uses_attention(r.kind)) r.window = r.n_recent = w, r.kernel = 3;
  return r;
}

}  // namespace

TEST_CASE("paged drivers: post_fill_driver on paged layers equals it on the same rows dense") {
  auto g = kvtest::rng(1313);
  for (int trial = 0; trial < 60; ++trial) {
    const index_t H = kvtest::uniform_int(g, 1, 4), gq = kvtest::uniform_int(g, 1, 2), d = 4 * kvtest::uniform_int(g, 1, 4) + kvtest::uniform_int(g, 0, 1) * 2;
    const index_t L = 2, w = kvtest::uniform_int(g, 1, 6), P = kvtest::uniform_int(g, w + 8, 80);
    const index_t ps = std::array<index_t, 4>{1, 3, 16, 64}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 3))];
    index_t query_rows = 0;
    bool bk = false;
    const recipe r = random_recipe(g, w, &query_rows, &bk, false);
    post_fill_config cfg = post_fill_of(L, H, gq, d, P, query_rows, r);
    const bool attention = uses_attention(r.kind);
    const index_t tail = r.kind == recipe_kind::tova ? 1 : attention && query_rows == 0 && r.kind != recipe_kind::h2o ? w : 0;
    const auto kinds = std::array<allocator, 5>{allocator::per_head, allocator::flattened, allocator::adakv,
                                                allocator::lava, allocator::cake};
    cfg.alloc.kind = kinds[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 4))];
    if (cfg.alloc.kind == allocator::lava && r.kind == recipe_kind::knorm)
      cfg.alloc.kind = allocator::flattened;  // LAVa's entropy needs scores >= 0 (Knorm's are -||k||)
    const bool whole = r.kind == recipe_kind::h2o || cfg.alloc.kind == allocator::cake;
    const index_t W = protected_count(P, r.n_sink, r.n_recent);
    const int distinct = kvtest::uniform_int(g, 0, 2) == 0 ? 2 : 0;
    const bool nan = cfg.alloc.kind != allocator::lava && cfg.alloc.kind != allocator::cake &&
                     kvtest::uniform_int(g, 0, 4) == 0;  // the all-layer allocators refuse NaN scores
    std::vector<head_rows_set> rows;
    for (index_t l = 0; l < L; ++l)
      rows.push_back(random_rows(g, H, d, P, tail, W, whole, kvtest::uniform_int(g, 0, 2) == 0, distinct, nan));
    // budgets inside every head's rows
    std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H));
    index_t rows_all = 0, prot_all = 0;
    for (index_t l = 0; l < L; ++l) {
      index_t least = P;
      for (index_t h = 0; h < H; ++h) {
        const index_t n = rows[static_cast<std::size_t>(l)].len(h);
        least = std::min(least, n);
        rows_all += n;
        prot_all += protected_count(n, r.n_sink, r.n_recent);
        budgets[static_cast<std::size_t>(l * H + h)] = static_cast<std::int32_t>(kvtest::uniform_int(g, W, n));
      }
      if (cfg.alloc.kind == allocator::adakv) {
        const auto b = static_cast<std::int32_t>(kvtest::uniform_int(g, W, least));
        for (index_t h = 0; h < H; ++h) budgets[static_cast<std::size_t>(l * H + h)] = b;
      }
    }
    cfg.alloc.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
    if (cfg.alloc.kind == allocator::lava) cfg.alloc.total = kvtest::uniform_int(g, prot_all, rows_all);
    if (cfg.alloc.kind == allocator::cake) cfg.alloc.total = L * H * kvtest::uniform_int(g, W, P);
    std::vector<paged_store> stores;
    index_t most_pages = 0;
    for (index_t l = 0; l < L; ++l) {
      stores.push_back(paged_of(g, rows[static_cast<std::size_t>(l)], ps, true));
      most_pages = std::max(most_pages, stores.back().pages);
    }
    post_fill_config pcfg = cfg;
    pcfg.pool_pages = most_pages + kvtest::uniform_int(g, 0, 70);
    INFO("trial ", trial, " recipe ", std::string(recipe_name(r.kind)), " allocator ", std::string(allocator_name(cfg.alloc.kind)), " H ", H,
         " g ", gq, " d ", d, " P ", P, " w ", w, " page size ", ps);
    std::vector<unsigned char> m1(kvtest::value_of(post_fill_driver::state_bytes(cfg))),
        m2(kvtest::value_of(post_fill_driver::state_bytes(pcfg))), wmem;
    post_fill_driver dense, paged;
    REQUIRE(dense.init(cfg, m1.data(), m1.size()).ok());
    REQUIRE(paged.init(pcfg, m2.data(), m2.size()).ok());
    const index_t qrows = query_rows > 0 ? query_rows : r.kind == recipe_kind::h2o ? P : r.kind == recipe_kind::tova ? 1 : attention ? w : 0;
    const bool on_par = kvtest::uniform_int(g, 0, 1) == 1;
    for (index_t l = 0; l < L; ++l) {
      auto& hr = rows[static_cast<std::size_t>(l)];
      ragged_layer rl(hr, P + 2);
      const auto q = kvtest::random_floats(g, static_cast<std::size_t>(H * gq * std::max<index_t>(qrows, 1) * d));
      const auto qv = qrows > 0 ? kvtest::value_of(make_kv_view<const float>(q.data(), H * gq, qrows, d)) : kv_view<const float>{};
      const auto bkd = kvtest::random_floats(g, static_cast<std::size_t>(H * std::max<index_t>(query_rows, 1) * d));
      const auto bkv = bk ? kvtest::value_of(make_kv_view<const float>(bkd.data(), H, query_rows, d)) : kv_view<const float>{};
      const double pref = cfg.alloc.kind == allocator::cake ? static_cast<double>(kvtest::uniform_int(g, 1, 9)) : 0.0;
      const auto call = [&](post_fill_driver& drv, const auto& kv) {
        if (on_par)
          return with_ws(drv, par_t{2}, wmem, [&](workspace& ws) { return drv.add_layer(par_t{2}, ws, l, kv, qv, bkv, pref); });
        return with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.add_layer(seq, ws, l, kv, qv, bkv, pref); });
      };
      const auto a = call(dense, rl.view(hr));
      REQUIRE_MESSAGE(a.ok(), std::string(a.message()));
      const auto st = call(paged, stores[static_cast<std::size_t>(l)].view());
      REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    }
    if (on_par) {
      REQUIRE(with_ws(dense, par_t{2}, wmem, [&](workspace& ws) { return dense.decide(par_t{2}, ws); }).ok());
      REQUIRE(with_ws(paged, par_t{2}, wmem, [&](workspace& ws) { return paged.decide(par_t{2}, ws); }).ok());
    } else {
      REQUIRE(with_ws(dense, seq, wmem, [&](workspace& ws) { return dense.decide(seq, ws); }).ok());
      REQUIRE(with_ws(paged, seq, wmem, [&](workspace& ws) { return paged.decide(seq, ws); }).ok());
    }
    for (index_t l = 0; l < L; ++l) {
      REQUIRE(paged.ready(l));
      CHECK(kept_cu_of(paged.kept(l)) == kept_cu_of(dense.kept(l)));
      CHECK(kept_pos_of(paged.kept(l)) == kept_pos_of(dense.kept(l)));
    }
  }
}

TEST_CASE("paged drivers: post_fill_driver on paged layers across tensor-parallel ranks keeps one process's rows") {
  // every rank holds its heads' rows in its own page pool; its kept rows must be the one-process
  // dense driver's for those heads (flattened, adakv, lava, cake select across the ranks)
  auto g = kvtest::rng(1414);
  const auto slice = [](const head_rows_set& r, index_t h0, index_t n) {
    head_rows_set s;
    s.H = n, s.d = r.d;
    for (index_t h = h0; h < h0 + n; ++h) {
      s.k.push_back(r.k[static_cast<std::size_t>(h)]);
      s.v.push_back(r.v[static_cast<std::size_t>(h)]);
      s.pos.push_back(r.pos[static_cast<std::size_t>(h)]);
    }
    return s;
  };
  const auto lists = [](const ragged_positions& k, index_t h0, index_t n) {
    std::vector<std::vector<pos_t>> out;
    for (index_t h = h0; h < h0 + n; ++h) out.emplace_back(k.pos + k.cu[h], k.pos + k.cu[h + 1]);
    return out;
  };
  int selected = 0;
  for (int trial = 0; trial < 32; ++trial) {
    const int ranks = 2 + trial % 2;
    const index_t Hl = kvtest::uniform_int(g, 1, 2), H = Hl * ranks, gq = kvtest::uniform_int(g, 1, 2), d = 4;
    const index_t L = 2, w = kvtest::uniform_int(g, 1, 5), P = kvtest::uniform_int(g, w + 8, 48);
    const index_t ps = std::array<index_t, 3>{1, 3, 16}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 2))];
    index_t query_rows = 0;
    bool bk = false;
    const recipe r = random_recipe(g, w, &query_rows, &bk, false);
    post_fill_config cfg = post_fill_of(L, H, gq, d, P, query_rows, r);
    const auto kinds = std::array<allocator, 4>{allocator::flattened, allocator::adakv, allocator::lava, allocator::cake};
    cfg.alloc.kind = kinds[static_cast<std::size_t>((trial / 2) % 4)];
    if (cfg.alloc.kind == allocator::lava && r.kind == recipe_kind::knorm) cfg.alloc.kind = allocator::flattened;
    const bool attention = uses_attention(r.kind), all_layer = cfg.alloc.kind == allocator::lava || cfg.alloc.kind == allocator::cake;
    const index_t tail = r.kind == recipe_kind::tova ? 1 : attention && query_rows == 0 && r.kind != recipe_kind::h2o ? w : 0;
    const bool whole = r.kind == recipe_kind::h2o || cfg.alloc.kind == allocator::cake;
    const index_t W = protected_count(P, r.n_sink, r.n_recent);
    std::vector<head_rows_set> rows;
    for (index_t l = 0; l < L; ++l)
      rows.push_back(random_rows(g, H, d, P, tail, W, whole, kvtest::uniform_int(g, 0, 2) == 0, 2, false));
    // one budget per layer (every rank's block then has the same sum, as the sharded selection requires)
    std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H));
    index_t rows_all = 0, prot_all = 0;
    for (index_t l = 0; l < L; ++l) {
      const index_t least = layer_totals(rows[static_cast<std::size_t>(l)], r, P, rows_all, prot_all);
      const auto b = static_cast<std::int32_t>(kvtest::uniform_int(g, W, least));
      for (index_t h = 0; h < H; ++h) budgets[static_cast<std::size_t>(l * H + h)] = b;
    }
    if (!all_layer) cfg.alloc.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
    if (cfg.alloc.kind == allocator::lava) cfg.alloc.total = kvtest::uniform_int(g, prot_all, rows_all);
    if (cfg.alloc.kind == allocator::cake) cfg.alloc.total = L * H * kvtest::uniform_int(g, W, P);
    const index_t qrows = query_rows > 0 ? query_rows : r.kind == recipe_kind::h2o ? P : r.kind == recipe_kind::tova ? 1 : attention ? w : 0;
    std::vector<std::vector<float>> q, bkd;
    std::vector<double> pref;
    for (index_t l = 0; l < L; ++l) {
      q.push_back(kvtest::random_floats(g, static_cast<std::size_t>(H * gq * std::max<index_t>(qrows, 1) * d)));
      bkd.push_back(kvtest::random_floats(g, static_cast<std::size_t>(H * std::max<index_t>(query_rows, 1) * d)));
      pref.push_back(cfg.alloc.kind == allocator::cake ? static_cast<double>(kvtest::uniform_int(g, 1, 9)) : 0.0);
    }
    // the rank's queries / block keys: its heads' rows of layer l's (heads first: a contiguous block)
    const auto views = [&](index_t l, index_t h0, index_t n, kv_view<const float>& qv, kv_view<const float>& bv) {
      const auto ls = static_cast<std::size_t>(l);
      qv = qrows > 0 ? kvtest::value_of(make_kv_view<const float>(q[ls].data() + h0 * gq * qrows * d, n * gq, qrows, d))
                     : kv_view<const float>{};
      bv = bk ? kvtest::value_of(make_kv_view<const float>(bkd[ls].data() + h0 * query_rows * d, n, query_rows, d))
              : kv_view<const float>{};
    };
    INFO("trial ", trial, " ranks ", ranks, " recipe ", std::string(recipe_name(r.kind)), " allocator ",
         std::string(allocator_name(cfg.alloc.kind)), " H ", H, " g ", gq, " P ", P, " w ", w, " page size ", ps);
    std::vector<unsigned char> m1(kvtest::value_of(post_fill_driver::state_bytes(cfg))), wmem;
    post_fill_driver one;
    REQUIRE(one.init(cfg, m1.data(), m1.size()).ok());
    for (index_t l = 0; l < L; ++l) {
      auto& hr = rows[static_cast<std::size_t>(l)];
      ragged_layer rl(hr, P + 2);
      kv_view<const float> qv, bv;
      views(l, 0, H, qv, bv);
      const auto st = with_ws(one, seq, wmem, [&](workspace& ws) {
        return one.add_layer(seq, ws, l, rl.view(hr), qv, bv, pref[static_cast<std::size_t>(l)]);
      });
      REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    }
    REQUIRE(with_ws(one, seq, wmem, [&](workspace& ws) { return one.decide(seq, ws); }).ok());
    // each rank's paged layers: its heads of the same rows, in a random page pool
    std::vector<std::vector<paged_store>> stores(static_cast<std::size_t>(ranks));
    index_t most_pages = 0;
    for (int rk = 0; rk < ranks; ++rk)
      for (index_t l = 0; l < L; ++l) {
        stores[static_cast<std::size_t>(rk)].push_back(paged_of(g, slice(rows[static_cast<std::size_t>(l)], rk * Hl, Hl), ps, true));
        most_pages = std::max(most_pages, stores[static_cast<std::size_t>(rk)].back().pages);
      }
    std::vector<std::string> errors(static_cast<std::size_t>(ranks));
    std::vector<std::vector<std::vector<std::vector<pos_t>>>> kept(static_cast<std::size_t>(ranks));
    kvtest::thread_world::run(ranks, [&](kvtest::thread_comm& c) {
      const auto me = static_cast<std::size_t>(c.rank());
      post_fill_config rc = cfg;
      rc.model.kv_heads = Hl;
      rc.model.query_heads = Hl * gq;
      rc.pool_pages = most_pages;
      rc.tp = comm_ref(c);
      if (!all_layer)
        rc.alloc.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data() + Hl * c.rank(), L, Hl, H));
      std::vector<unsigned char> mem(post_fill_driver::state_bytes(rc).value()), rw;
      post_fill_driver drv;
      status st = drv.init(rc, mem.data(), mem.size());
      for (index_t l = 0; l < L && st.ok(); ++l) {
        kv_view<const float> qv, bv;
        views(l, Hl * c.rank(), Hl, qv, bv);
        st = with_ws(drv, seq, rw, [&](workspace& ws) {
          return drv.add_layer(seq, ws, l, stores[me][static_cast<std::size_t>(l)].view(), qv, bv, pref[static_cast<std::size_t>(l)]);
        });
      }
      if (st.ok()) st = with_ws(drv, seq, rw, [&](workspace& ws) { return drv.decide(seq, ws); });
      errors[me] = st.ok() ? "" : st.message();
      if (st.ok())
        for (index_t l = 0; l < L; ++l) kept[me].push_back(lists(drv.kept(l), 0, Hl));
    });
    for (int rk = 0; rk < ranks; ++rk) {
      CAPTURE(rk);
      REQUIRE(errors[static_cast<std::size_t>(rk)] == "");
      for (index_t l = 0; l < L; ++l)
        CHECK(kept[static_cast<std::size_t>(rk)][static_cast<std::size_t>(l)] == lists(one.kept(l), rk * Hl, Hl));
    }
    for (index_t l = 0; l < L; ++l) {
      index_t held = 0;
      for (index_t h = 0; h < H; ++h) held += rows[static_cast<std::size_t>(l)].len(h);
      selected += one.kept(l).cu[H] < held ? 1 : 0;
    }
  }
  CHECK(selected > 0);  // some layers really evicted
}

TEST_CASE("paged drivers: decode_driver on paged layers equals it on the same rows dense, step by step") {
  auto g = kvtest::rng(1314);
  for (int trial = 0; trial < 40; ++trial) {
    const index_t H = kvtest::uniform_int(g, 1, 3), gq = kvtest::uniform_int(g, 1, 2), d = 2 * kvtest::uniform_int(g, 2, 8);
    const index_t w = kvtest::uniform_int(g, 1, 4), interval = kvtest::uniform_int(g, 1, 3);
    const index_t ps = std::array<index_t, 4>{1, 3, 16, 64}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 3))];
    index_t query_rows = 0;
    bool bk = false;
    const recipe r = random_recipe(g, w, &query_rows, &bk, true);
    decode_config cfg;
    cfg.model = {1, H, H * gq, d};
    cfg.interval = interval;
    cfg.rec = r;
    const index_t least = r.n_sink + r.n_recent + 1;
    std::vector<std::int32_t> budgets;
    cfg.capacity = random_budgets(g, cfg.alloc, budgets, H, least, 10) + interval;
    const bool h2o = r.kind == recipe_kind::h2o, attention = uses_attention(r.kind);
    const index_t lo = attention && !h2o && r.kind != recipe_kind::tova ? w : 1;  // a window's rows at least
    const index_t P0 = kvtest::uniform_int(g, lo, std::max(lo, least));
    head_rows_set truth = random_rows(g, H, d, P0, P0, 0, true, true, kvtest::uniform_int(g, 0, 2) == 0 ? 2 : 0,
                                      kvtest::uniform_int(g, 0, 5) == 0);
    const int distinct = kvtest::uniform_int(g, 0, 2) == 0 ? 2 : 0;
    decode_config pcfg = cfg;
    pcfg.pool_pages = 3 * H * (cfg.capacity + 64) + 80;  // room for paged_of's other sequences
    INFO("trial ", trial, " recipe ", std::string(recipe_name(r.kind)), " allocator ",
         std::string(allocator_name(cfg.alloc.kind)), " H ", H, " g ", gq, " d ", d, " w ", w, " interval ", interval,
         " page size ", ps);
    std::vector<unsigned char> m1(kvtest::value_of(decode_driver::state_bytes(cfg))),
        m2(kvtest::value_of(decode_driver::state_bytes(pcfg))), wmem;
    decode_driver dense, paged;
    REQUIRE(dense.init(cfg, m1.data(), m1.size()).ok());
    REQUIRE(paged.init(pcfg, m2.data(), m2.size()).ok());
    const bool on_par = kvtest::uniform_int(g, 0, 1) == 1;
    {
      ragged_layer rl(truth, cfg.capacity);
      REQUIRE(dense.begin(0, rl.view(truth), P0).ok());
      auto store = paged_of(g, truth, ps, true);
      const auto st = with_ws(paged, seq, wmem, [&](workspace& ws) { return paged.begin(seq, ws, 0, store.view(), P0); });
      REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    }
    int evictions = 0;
    for (index_t t = P0; t < P0 + 30; ++t) {
      for (index_t h = 0; h < H; ++h) {
        auto kr = kvtest::random_floats(g, static_cast<std::size_t>(d)), vr = kvtest::random_floats(g, static_cast<std::size_t>(d));
        if (distinct > 0)
          for (auto& x : kr) x = std::round(x * 2.f) / 2.f;
        truth.append(h, kr.data(), vr.data(), static_cast<pos_t>(t));
      }
      const index_t qrows = h2o ? 1 : attention && dense.evicts_next(0) ? (r.kind == recipe_kind::tova ? 1 : w) : 0;
      const auto q = kvtest::random_floats(g, static_cast<std::size_t>(H * gq * std::max<index_t>(qrows, 1) * d));
      const auto qv = qrows > 0 ? kvtest::value_of(make_kv_view<const float>(q.data(), H * gq, qrows, d)) : kv_view<const float>{};
      ragged_layer rl(truth, cfg.capacity);
      auto store = paged_of(g, truth, ps, true);
      const auto call = [&](decode_driver& drv, const auto& kv) {
        if (on_par) return with_ws(drv, par_t{2}, wmem, [&](workspace& ws) { return drv.step(par_t{2}, ws, 0, kv, qv); });
        return with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.step(seq, ws, 0, kv, qv); });
      };
      const auto a = call(dense, rl.view(truth));
      REQUIRE_MESSAGE(a.ok(), std::string(a.message()));
      const auto b = call(paged, store.view());
      REQUIRE_MESSAGE(b.ok(), std::string(b.message()));
      REQUIRE(paged.evicted(0) == dense.evicted(0));
      if (dense.evicted(0)) {
        ++evictions;
        CHECK(kept_cu_of(paged.kept(0)) == kept_cu_of(dense.kept(0)));
        CHECK(kept_pos_of(paged.kept(0)) == kept_pos_of(dense.kept(0)));
        truth.compact(dense.kept(0));
      }
      for (index_t h = 0; h < H; ++h) REQUIRE(paged.held(0, h) == dense.held(0, h));
    }
    CHECK(evictions > 0);
  }
}

TEST_CASE("paged drivers: streaming_heads_driver on paged layers equals it on the same rows dense, step by step") {
  auto g = kvtest::rng(1315);
  for (int trial = 0; trial < 40; ++trial) {
    const index_t H = kvtest::uniform_int(g, 1, 4), d = 2 * kvtest::uniform_int(g, 1, 4);
    const index_t ps = std::array<index_t, 4>{1, 3, 16, 64}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 3))];
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(H));
    for (auto& m : mask) m = static_cast<std::uint8_t>(kvtest::uniform_int(g, 0, 1));
    mask[0] = 0;  // one streaming head at least
    streaming_heads_config cfg;
    cfg.model = {1, H, H, d};
    cfg.capacity = 80;
    cfg.streaming = {kvtest::uniform_int(g, 0, 4), kvtest::uniform_int(g, 1, 8)};
    cfg.retrieval = kvtest::value_of(make_matrix_view<const std::uint8_t>(mask.data(), 1, H));
    streaming_heads_config pcfg = cfg;
    pcfg.pool_pages = 3 * H * (cfg.capacity + 64) + 80;  // room for paged_of's other sequences
    INFO("trial ", trial, " H ", H, " page size ", ps, " sinks ", cfg.streaming.n_sink, " recent ", cfg.streaming.n_recent);
    std::vector<unsigned char> m1(kvtest::value_of(streaming_heads_driver::state_bytes(cfg))),
        m2(kvtest::value_of(streaming_heads_driver::state_bytes(pcfg)));
    streaming_heads_driver dense, paged;
    REQUIRE(dense.init(cfg, m1.data(), m1.size()).ok());
    REQUIRE(paged.init(pcfg, m2.data(), m2.size()).ok());
    const index_t P0 = kvtest::uniform_int(g, 1, 30);
    head_rows_set truth = random_rows(g, H, d, P0, P0, 0, true, true, 0, false);
    int evictions = 0;
    for (index_t t = P0; t < P0 + 30; ++t) {
      if (t > P0)
        for (index_t h = 0; h < H; ++h) {
          const auto kr = kvtest::random_floats(g, static_cast<std::size_t>(d)), vr = kvtest::random_floats(g, static_cast<std::size_t>(d));
          truth.append(h, kr.data(), vr.data(), static_cast<pos_t>(t - 1));
        }
      ragged_layer rl(truth, cfg.capacity);
      auto store = paged_of(g, truth, ps, true);
      REQUIRE(dense.update(0, rl.view(truth), t).ok());
      const auto st = paged.update(0, store.view(), t);
      REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
      REQUIRE(paged.evicted(0) == dense.evicted(0));
      CHECK(kept_cu_of(paged.kept(0)) == kept_cu_of(dense.kept(0)));
      CHECK(kept_pos_of(paged.kept(0)) == kept_pos_of(dense.kept(0)));
      if (dense.evicted(0)) {
        ++evictions;
        truth.compact(dense.kept(0));
      }
    }
    CHECK(evictions > 0);
    // a pool larger than the config's pool_pages, and a driver set up for ragged layers only
    auto store = paged_of(g, truth, ps, true);
    auto big = store.view();
    big.layer.keys.pages = big.layer.values.pages = big.positions.pages = pcfg.pool_pages + 1;
    kvtest::require_error(paged.update(0, big, P0 + 30), errc::capacity_exceeded, "driver was set up for");
    CHECK_FALSE(paged.evicted(0));
    kvtest::require_error(dense.update(0, store.view(), P0 + 30), errc::capacity_exceeded, "0 = ragged layers only");
  }
}

TEST_CASE("paged drivers: decode_driver on paged layers across tensor-parallel ranks keeps one process's rows") {
  // one layer decoded step by step; each rank holds its heads' rows in its own page pool (a new
  // random pool every step) and must keep, at every eviction, the dense one-process driver's rows
  auto g = kvtest::rng(1415);
  int evictions = 0;
  for (int trial = 0; trial < 16; ++trial) {
    const int ranks = 2 + trial % 2;
    const index_t Hl = kvtest::uniform_int(g, 1, 2), H = Hl * ranks, gq = kvtest::uniform_int(g, 1, 2), d = 4;
    const index_t w = kvtest::uniform_int(g, 1, 4), interval = kvtest::uniform_int(g, 1, 3), steps = 24;
    const index_t ps = std::array<index_t, 3>{1, 3, 16}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 2))];
    index_t query_rows = 0;
    bool bk = false;
    recipe r = random_recipe(g, w, &query_rows, &bk, true);
    decode_config cfg;
    cfg.model = {1, H, H * gq, d};
    cfg.interval = interval;
    cfg.rec = r;
    cfg.alloc.kind = trial / 2 % 2 == 0 ? allocator::flattened : allocator::adakv;
    const index_t least = r.n_sink + r.n_recent + 1;
    // one budget for every head: every rank's block has the same sum
    std::vector<std::int32_t> budgets(static_cast<std::size_t>(H),
                                      static_cast<std::int32_t>(kvtest::uniform_int(g, least, least + 6)));
    cfg.alloc.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data(), 1, H));
    cfg.capacity = H * budgets[0] + interval;
    const bool h2o = r.kind == recipe_kind::h2o, attention = uses_attention(r.kind);
    const index_t lo = attention && !h2o && r.kind != recipe_kind::tova ? w : 1;
    const index_t P0 = kvtest::uniform_int(g, lo, std::max(lo, least));
    const head_rows_set first = random_rows(g, H, d, P0, P0, 0, true, true, 2, false);
    // every step's new rows [steps][H][d] and queries [steps][H gq][w][d] (the step reads its first rows)
    const auto keys = kvtest::random_floats(g, static_cast<std::size_t>(steps * H * d));
    const auto vals = kvtest::random_floats(g, static_cast<std::size_t>(steps * H * d));
    const auto qs = kvtest::random_floats(g, static_cast<std::size_t>(steps * H * gq * w * d));
    const auto query = [&](index_t step, index_t h0, index_t n, index_t rows) {
      if (rows == 0) return kv_view<const float>{};
      const float* base = qs.data() + step * H * gq * w * d + h0 * gq * w * d;
      return kvtest::value_of(make_kv_view<const float>(base, n * gq, rows, d, w * d, d));
    };
    const auto rows_of = [&](const decode_driver& drv) {
      return h2o ? index_t(1) : attention && drv.evicts_next(0) ? (r.kind == recipe_kind::tova ? 1 : w) : 0;
    };
    INFO("trial ", trial, " ranks ", ranks, " recipe ", std::string(recipe_name(r.kind)), " allocator ",
         std::string(allocator_name(cfg.alloc.kind)), " H ", H, " g ", gq, " w ", w, " interval ", interval, " page size ", ps);
    // the one process, dense: per step whether it evicted and the kept positions of every head
    std::vector<std::vector<std::vector<pos_t>>> want(static_cast<std::size_t>(steps));
    {
      std::vector<unsigned char> mem(kvtest::value_of(decode_driver::state_bytes(cfg))), wmem;
      decode_driver one;
      REQUIRE(one.init(cfg, mem.data(), mem.size()).ok());
      head_rows_set truth = first;
      {
        ragged_layer rl(truth, cfg.capacity);
        REQUIRE(one.begin(0, rl.view(truth), P0).ok());
      }
      for (index_t t = 0; t < steps; ++t) {
        for (index_t h = 0; h < H; ++h)
          truth.append(h, keys.data() + (t * H + h) * d, vals.data() + (t * H + h) * d, static_cast<pos_t>(P0 + t));
        const auto qv = query(t, 0, H, rows_of(one));
        ragged_layer rl(truth, cfg.capacity);
        const auto st = with_ws(one, seq, wmem, [&](workspace& ws) { return one.step(seq, ws, 0, rl.view(truth), qv); });
        REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
        if (one.evicted(0)) {
          ++evictions;
          truth.compact(one.kept(0));
        }
        for (index_t h = 0; h < H; ++h) want[static_cast<std::size_t>(t)].push_back(truth.pos[static_cast<std::size_t>(h)]);
      }
    }
    std::vector<std::string> errors(static_cast<std::size_t>(ranks));
    std::vector<std::vector<std::vector<std::vector<pos_t>>>> got(static_cast<std::size_t>(ranks));
    const auto seed = static_cast<std::uint64_t>(trial) * 31 + 7;
    kvtest::thread_world::run(ranks, [&](kvtest::thread_comm& c) {
      const auto me = static_cast<std::size_t>(c.rank());
      const index_t h0 = Hl * c.rank();
      auto rg = kvtest::rng(seed + me);  // this rank's page layouts
      decode_config rc = cfg;
      rc.model.kv_heads = Hl;
      rc.model.query_heads = Hl * gq;
      rc.alloc.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data() + h0, 1, Hl));
      rc.pool_pages = 3 * Hl * (cfg.capacity + 64) + 80;
      rc.tp = comm_ref(c);
      std::vector<unsigned char> mem(decode_driver::state_bytes(rc).value()), wmem;
      decode_driver drv;
      status st = drv.init(rc, mem.data(), mem.size());
      head_rows_set mine;
      mine.H = Hl, mine.d = d;
      for (index_t h = h0; h < h0 + Hl; ++h) {
        mine.k.push_back(first.k[static_cast<std::size_t>(h)]);
        mine.v.push_back(first.v[static_cast<std::size_t>(h)]);
        mine.pos.push_back(first.pos[static_cast<std::size_t>(h)]);
      }
      if (st.ok()) {
        auto store = paged_of(rg, mine, ps, true);
        st = with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.begin(seq, ws, 0, store.view(), P0); });
      }
      for (index_t t = 0; t < steps && st.ok(); ++t) {
        for (index_t h = 0; h < Hl; ++h)
          mine.append(h, keys.data() + (t * H + h0 + h) * d, vals.data() + (t * H + h0 + h) * d, static_cast<pos_t>(P0 + t));
        const auto qv = query(t, h0, Hl, rows_of(drv));
        auto store = paged_of(rg, mine, ps, true);
        st = with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.step(seq, ws, 0, store.view(), qv); });
        if (st.ok() && drv.evicted(0)) mine.compact(drv.kept(0));
        got[me].push_back(mine.pos);
      }
      errors[me] = st.ok() ? "" : st.message();
    });
    for (int rk = 0; rk < ranks; ++rk) {
      CAPTURE(rk);
      REQUIRE(errors[static_cast<std::size_t>(rk)] == "");
      for (index_t t = 0; t < steps; ++t) {
        const auto& all = want[static_cast<std::size_t>(t)];
        const std::vector<std::vector<pos_t>> part(all.begin() + Hl * rk, all.begin() + Hl * (rk + 1));
        CHECK(got[static_cast<std::size_t>(rk)][static_cast<std::size_t>(t)] == part);
      }
    }
  }
  CHECK(evictions > 0);
}

TEST_CASE("paged drivers: bad paged layers and cuda_t are refused before anything changes") {
  auto g = kvtest::rng(1315);
  const index_t H = 2, d = 4, P = 20, w = 4;
  post_fill_config cfg;
  cfg.model = {1, H, H, d};
  cfg.tokens = P;
  cfg.rec = recipe::snapkv();
  cfg.rec.window = cfg.rec.n_recent = w;
  std::vector<std::int32_t> budgets(static_cast<std::size_t>(H), 8);
  cfg.alloc.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data(), 1, H));
  head_rows_set rows = random_rows(g, H, d, P, w, 8, false, false, 0, false);
  auto store = paged_of(g, rows, 4, false);
  const auto q = kvtest::random_floats(g, static_cast<std::size_t>(H * w * d));
  const auto qv = kvtest::value_of(make_kv_view<const float>(q.data(), H, w, d));
  std::vector<unsigned char> wmem;
  const auto add = [&](const post_fill_config& c, const paged_layer_kv<float>& kv) {
    std::vector<unsigned char> m(kvtest::value_of(post_fill_driver::state_bytes(c)));
    post_fill_driver drv;
    REQUIRE(drv.init(c, m.data(), m.size()).ok());
    const status st = with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.add_layer(seq, ws, 0, kv, qv); });
    CHECK(drv.layers_added() == (st.ok() ? 1 : 0));
    return st;
  };
  post_fill_config pc = cfg;
  pc.pool_pages = store.pages;
  REQUIRE(add(pc, store.view()).ok());
  kvtest::require_error(add(cfg, store.view()), errc::capacity_exceeded, "pool_pages");
  pc.pool_pages = -1;
  kvtest::require_error(post_fill_driver::state_bytes(pc).error(), errc::invalid_argument, "pool_pages");
  pc.pool_pages = store.pages;
  auto kv = store.view();
  kv.sequence = store.S;
  kvtest::require_error(add(pc, kv), errc::out_of_range, "sequence");
  kv = store.view();
  kv.layer.kv_heads = 1;
  kv.layer.table.lists = store.S;
  kvtest::require_error(add(pc, kv), errc::shape_mismatch, "KV heads");
  kv = store.view();
  kv.positions.pages = store.pages - 1;
  kvtest::require_error(add(pc, kv), errc::shape_mismatch, "position pool");
  // the sequence's lists: a page twice, a page outside the pool, a bad last page
  const index_t first = store.seq * H, a = store.indptr[static_cast<std::size_t>(first)];
  REQUIRE(store.indptr[static_cast<std::size_t>(first + 2)] - a >= 2);
  const std::int32_t keep = store.indices[static_cast<std::size_t>(a + 1)];
  store.indices[static_cast<std::size_t>(a + 1)] = store.indices[static_cast<std::size_t>(a)];
  kvtest::require_error(add(pc, store.view()), errc::invalid_argument, "page");
  store.indices[static_cast<std::size_t>(a + 1)] = static_cast<std::int32_t>(store.pages);
  kvtest::require_error(add(pc, store.view()), errc::out_of_range, "outside the pool");
  store.indices[static_cast<std::size_t>(a + 1)] = keep;
  const std::int32_t last = store.last[static_cast<std::size_t>(first)];
  store.last[static_cast<std::size_t>(first)] = static_cast<std::int32_t>(store.ps + 1);
  kvtest::require_error(add(pc, store.view()), errc::invalid_argument, "last_page_len");
  store.last[static_cast<std::size_t>(first)] = last;
  // positions read through the table: out of order
  const auto L = store.layer();
  const auto Pp = store.positions();
  pos_t* p0 = Pp.row(L.table.page_of(first, 0, store.ps), 0, 0);
  const pos_t old = *p0;
  *p0 = static_cast<pos_t>(P - 1);
  kvtest::require_error(add(pc, store.view()), errc::not_sorted, "arrival order");
  *p0 = old;
  REQUIRE(add(pc, store.view()).ok());
  // every driver call on cuda_t: errc::unsupported with the reason, nothing changes
  {
    std::vector<unsigned char> m(kvtest::value_of(post_fill_driver::state_bytes(pc)));
    post_fill_driver drv;
    REQUIRE(drv.init(pc, m.data(), m.size()).ok());
    workspace none;
    const auto kvp = store.view();
    const std::vector<float> sc(static_cast<std::size_t>(H * P));
    const auto sv = kvtest::value_of(make_matrix_view<const float>(sc.data(), H, P));
    const auto refused = [](const status& st, const char* fn) {
      kvtest::require_error(st, errc::unsupported, fn);
      kvtest::require_error(st, errc::unsupported, "host backends");
    };
    refused(drv.add_layer(kvevict::cuda, none, 0, kvp, qv), "post_fill_driver::add_layer");
    refused(drv.add_layer_scores(kvevict::cuda, none, 0, kvp, sv), "post_fill_driver::add_layer_scores");
    refused(drv.decide(kvevict::cuda, none), "post_fill_driver::decide");
    CHECK(drv.layers_added() == 0);
    REQUIRE(with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.add_layer(seq, ws, 0, kvp, qv); }).ok());
    cascade_driver cas;
    refused(cas.add_layer(kvevict::cuda, none, 0, kvp, qv), "cascade_driver::add_layer");
    refused(cas.add_layer_scores(kvevict::cuda, none, 0, kvp, sv), "cascade_driver::add_layer_scores");
    refused(cas.add_remote_layer(kvevict::cuda, none, 0, 1.0), "cascade_driver::add_remote_layer");
    chunked_driver ch;
    refused(ch.add_layer(kvevict::cuda, none, 0, kvp, qv), "chunked_driver::add_layer");
    refused(ch.add_layer_scores(kvevict::cuda, none, 0, kvp, sv), "chunked_driver::add_layer_scores");
    refused(ch.decide(kvevict::cuda, none), "chunked_driver::decide");
    decode_driver dec;
    refused(dec.begin(kvevict::cuda, none, 0, kvp, P), "decode_driver::begin");
    refused(dec.step(kvevict::cuda, none, 0, kvp, qv), "decode_driver::step");
    refused(dec.step_scores(kvevict::cuda, none, 0, kvp, sv), "decode_driver::step_scores");
  }
}

TEST_CASE("paged drivers: chunked_driver on paged layers equals it on the same rows dense, chunk by chunk") {
  auto g = kvtest::rng(1316);
  for (int trial = 0; trial < 30; ++trial) {
    const index_t H = kvtest::uniform_int(g, 1, 3), gq = kvtest::uniform_int(g, 1, 2), d = 2 * kvtest::uniform_int(g, 2, 8);
    const index_t w = kvtest::uniform_int(g, 1, 4), N = kvtest::uniform_int(g, 20, 70), cs = kvtest::uniform_int(g, 4, 16);
    const index_t ps = std::array<index_t, 4>{1, 3, 16, 64}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 3))];
    recipe r = chunk_recipe_of(g, w);
    const bool attention = uses_attention(r.kind);
    chunked_config cfg;
    cfg.model = {1, H, H * gq, d};
    cfg.tokens = N;
    cfg.rec = r;
    cfg.queries = kvtest::uniform_int(g, 0, 1) ? chunk_queries::patched : chunk_queries::naive;
    const index_t least = r.n_sink + r.n_recent + 1;
    std::vector<std::int32_t> budgets;
    cfg.capacity = random_budgets(g, cfg.alloc, budgets, H, least, 12) + cs + w;
    chunked_config pcfg = cfg;
    pcfg.pool_pages = 3 * H * (cfg.capacity + 64) + 80;
    INFO("trial ", trial, " recipe ", std::string(recipe_name(r.kind)), " allocator ",
         std::string(allocator_name(cfg.alloc.kind)), " H ", H, " w ", w, " N ", N, " chunk ", cs, " page size ", ps);
    std::vector<unsigned char> m1(kvtest::value_of(chunked_driver::state_bytes(cfg))),
        m2(kvtest::value_of(chunked_driver::state_bytes(pcfg))), wmem;
    chunked_driver dense, paged;
    REQUIRE(dense.init(cfg, m1.data(), m1.size()).ok());
    REQUIRE(paged.init(pcfg, m2.data(), m2.size()).ok());
    head_rows_set truth;
    truth.H = H, truth.d = d;
    truth.k.resize(static_cast<std::size_t>(H)), truth.v.resize(static_cast<std::size_t>(H)),
        truth.pos.resize(static_cast<std::size_t>(H));
    const bool on_par = kvtest::uniform_int(g, 0, 1) == 1;
    for (index_t s = 0; s < N;) {
      index_t e = std::min(N, s + cs);
      if (cfg.queries == chunk_queries::patched && attention && e < N && e > N - w) e = N;
      REQUIRE(dense.begin_chunk(s, e).ok());
      REQUIRE(paged.begin_chunk(s, e).ok());
      for (index_t t = s; t < e; ++t)
        for (index_t h = 0; h < H; ++h) {
          const auto kr = kvtest::random_floats(g, static_cast<std::size_t>(d)), vr = kvtest::random_floats(g, static_cast<std::size_t>(d));
          truth.append(h, kr.data(), vr.data(), static_cast<pos_t>(t));
        }
      const index_t qrows = dense.query_rows();
      const auto q = kvtest::random_floats(g, static_cast<std::size_t>(H * gq * std::max<index_t>(qrows, 1) * d));
      const auto qv = qrows > 0 ? kvtest::value_of(make_kv_view<const float>(q.data(), H * gq, qrows, d)) : kv_view<const float>{};
      const bool patch = dense.patch().count > 0 && kvtest::uniform_int(g, 0, 1) == 1;
      const auto pk = kvtest::random_floats(g, static_cast<std::size_t>(H * w * d));
      const auto pkv = patch ? kvtest::value_of(make_kv_view<const float>(pk.data(), H, w, d)) : kv_view<const float>{};
      ragged_layer rl(truth, cfg.capacity);
      auto store = paged_of(g, truth, ps, true);
      const auto call = [&](chunked_driver& drv, const auto& kv) {
        if (on_par)
          return with_ws(drv, par_t{2}, wmem, [&](workspace& ws) { return drv.add_layer(par_t{2}, ws, 0, kv, qv, pkv); });
        return with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.add_layer(seq, ws, 0, kv, qv, pkv); });
      };
      const auto a = call(dense, rl.view(truth));
      REQUIRE_MESSAGE(a.ok(), std::string(a.message()));
      const auto b = call(paged, store.view());
      REQUIRE_MESSAGE(b.ok(), std::string(b.message()));
      REQUIRE(with_ws(dense, seq, wmem, [&](workspace& ws) { return dense.decide(seq, ws); }).ok());
      REQUIRE(with_ws(paged, seq, wmem, [&](workspace& ws) { return paged.decide(seq, ws); }).ok());
      CHECK(kept_cu_of(paged.kept(0)) == kept_cu_of(dense.kept(0)));
      CHECK(kept_pos_of(paged.kept(0)) == kept_pos_of(dense.kept(0)));
      truth.compact(dense.kept(0));
      s = e;
    }
  }
}

TEST_CASE("paged drivers: a driver's answer compacts its sequence of a paged batch alone (compact_layer with a sequence)") {
  auto g = kvtest::rng(1317);
  for (int trial = 0; trial < 30; ++trial) {
    const index_t H = kvtest::uniform_int(g, 1, 3), d = 2 * kvtest::uniform_int(g, 2, 6), w = kvtest::uniform_int(g, 1, 4);
    const index_t P = kvtest::uniform_int(g, w + 6, 60);
    const index_t ps = std::array<index_t, 4>{1, 3, 16, 64}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 3))];
    post_fill_config cfg;
    cfg.model = {1, H, H, d};
    cfg.tokens = P;
    cfg.rec = recipe::snapkv();
    cfg.rec.window = cfg.rec.n_recent = w;
    cfg.rec.kernel = 3;
    head_rows_set rows = random_rows(g, H, d, P, w, w + 4, false, kvtest::uniform_int(g, 0, 1) == 1, 0, false);
    std::vector<std::int32_t> budgets;
    random_budgets(g, cfg.alloc, budgets, H, w, 0);
    index_t shortest = P;
    for (index_t h = 0; h < H; ++h) shortest = std::min(shortest, rows.len(h));
    const auto shared = static_cast<std::int32_t>(kvtest::uniform_int(g, w, shortest));
    for (index_t h = 0; h < H; ++h)  // inside every head's rows
      budgets[static_cast<std::size_t>(h)] =
          cfg.alloc.kind == allocator::adakv ? shared : static_cast<std::int32_t>(kvtest::uniform_int(g, w, rows.len(h)));
    // per-sequence tables hold one length per sequence: every head must keep as many rows
    const bool same = cfg.alloc.kind == allocator::per_head && kvtest::uniform_int(g, 0, 1) == 1;
    if (same) std::fill(budgets.begin(), budgets.end(), shared);
    auto store = paged_of(g, rows, ps, same);
    cfg.pool_pages = store.pages;
    INFO("trial ", trial, " allocator ", std::string(allocator_name(cfg.alloc.kind)), " H ", H, " page size ", ps,
         " sequences ", store.S, " lists ", std::string(store.lists == page_lists::per_head ? "per head" : "per sequence"));
    std::vector<unsigned char> m(kvtest::value_of(post_fill_driver::state_bytes(cfg))), wmem;
    post_fill_driver drv;
    REQUIRE(drv.init(cfg, m.data(), m.size()).ok());
    const auto q = kvtest::random_floats(g, static_cast<std::size_t>(H * w * d));
    const auto qv = kvtest::value_of(make_kv_view<const float>(q.data(), H, w, d));
    const auto st = with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.add_layer(seq, ws, 0, store.view(), qv); });
    REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    const ragged_positions kept = drv.kept(0);
    // what must stay: every other sequence's rows; what the sequence's lists free: their tail pages
    const auto L = store.layer();
    const auto Pp = store.positions();
    const auto other_rows = [&] {  // every other sequence's keys and values
      std::vector<float> o;
      for (index_t r = 0; r < L.rows(); ++r)
        if (r / H != store.seq)
          for (index_t j = 0; j < L.length(r); ++j) {
            o.insert(o.end(), L.key(r, j), L.key(r, j) + d);
            o.insert(o.end(), L.value(r, j), L.value(r, j) + d);
          }
      return o;
    };
    const std::vector<float> others = other_rows();
    const index_t first = L.list_of(store.seq * H), n_lists = store.lists == page_lists::per_head ? H : 1;
    std::vector<std::int32_t> want_freed;
    for (index_t l = 0; l < n_lists; ++l) {
      const index_t n = kept.length(l * (store.lists == page_lists::per_head ? 1 : H));
      for (index_t i = store.indptr[static_cast<std::size_t>(first + l)] + (n + ps - 1) / ps;
           i < store.indptr[static_cast<std::size_t>(first + l + 1)]; ++i)
        want_freed.push_back(store.indices[static_cast<std::size_t>(i)]);
    }
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(n_lists), -1), freed(static_cast<std::size_t>(store.pages), -1);
    std::int32_t nfreed = -1;
    const paged_compaction_out out{lengths.data(), freed.data(), store.pages, &nfreed};
    kvtest::require_error(two_phase([&](workspace& ws) { return compact_layer(seq, ws, L, Pp, store.S, kept, out); }),
                          errc::out_of_range, "sequence");
    REQUIRE(nfreed == -1);
    const auto cst = two_phase([&](workspace& ws) { return compact_layer(par_t{2}, ws, L, Pp, store.seq, kept, out); });
    REQUIRE_MESSAGE(cst.ok(), std::string(cst.message()));
    rows.compact(kept);
    REQUIRE(nfreed == static_cast<std::int32_t>(want_freed.size()));
    CHECK(std::vector<std::int32_t>(freed.begin(), freed.begin() + nfreed) == want_freed);
    for (index_t h = 0; h < H; ++h) {
      const index_t r = store.seq * H + h;
      CHECK(lengths[static_cast<std::size_t>(store.lists == page_lists::per_head ? h : 0)] == rows.len(h));
      for (index_t j = 0; j < rows.len(h); ++j) {
        const auto hs = static_cast<std::size_t>(h), js = static_cast<std::size_t>(j * d);
        CHECK(std::equal(L.key(r, j), L.key(r, j) + d, rows.k[hs].begin() + static_cast<std::ptrdiff_t>(js)));
        CHECK(std::equal(L.value(r, j), L.value(r, j) + d, rows.v[hs].begin() + static_cast<std::ptrdiff_t>(js)));
        CHECK(*Pp.row(L.table.page_of(L.list_of(r), j, ps), j % ps, L.head_of(r)) == rows.pos[hs][static_cast<std::size_t>(j)]);
      }
    }
    CHECK(kvtest::bytes_of(other_rows()) == kvtest::bytes_of(others));
  }
}

TEST_CASE("paged drivers: cascade_driver on paged layers equals it on the same rows dense, layer by layer") {
  auto g = kvtest::rng(1318);
  for (int trial = 0; trial < 12; ++trial) {
    const index_t H = kvtest::uniform_int(g, 1, 3), gq = kvtest::uniform_int(g, 1, 2), d = 2 * kvtest::uniform_int(g, 2, 6);
    const index_t L = 3, w = kvtest::uniform_int(g, 1, 4), N = kvtest::uniform_int(g, w + 8, 50);
    const index_t ps = std::array<index_t, 4>{1, 3, 16, 64}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 3))];
    cascade_driver_config cfg;
    cfg.model = {L, H, H * gq, d};
    cfg.tokens = N;
    cfg.rec = kvtest::uniform_int(g, 0, 1) ? recipe::lava() : recipe::snapkv();
    cfg.rec.window = cfg.rec.n_recent = w;
    cfg.rec.kernel = 3;
    cfg.split = kvtest::uniform_int(g, 0, 1) ? cascade_split::flattened : cascade_split::per_head;
    cfg.weight = cfg.split == cascade_split::per_head ? weight_source::caller : weight_source::lava_entropy;
    cfg.total = L * H * kvtest::uniform_int(g, w, N);
    cascade_driver_config pcfg = cfg;
    pcfg.pool_pages = 3 * H * (N + 64) + 80;
    INFO("trial ", trial, " H ", H, " N ", N, " w ", w, " page size ", ps);
    std::vector<unsigned char> m1(kvtest::value_of(cascade_driver::state_bytes(cfg))),
        m2(kvtest::value_of(cascade_driver::state_bytes(pcfg))), wmem;
    cascade_driver dense, paged;
    REQUIRE(dense.init(cfg, m1.data(), m1.size()).ok());
    REQUIRE(paged.init(pcfg, m2.data(), m2.size()).ok());
    for (index_t l = 0; l < L; ++l) {
      head_rows_set rows = random_rows(g, H, d, N, w, N, true, true, kvtest::uniform_int(g, 0, 1) ? 2 : 0, false);
      const auto q = kvtest::random_floats(g, static_cast<std::size_t>(H * gq * w * d));
      const auto qv = kvtest::value_of(make_kv_view<const float>(q.data(), H * gq, w, d));
      const double weight = static_cast<double>(kvtest::uniform_int(g, 1, 9));
      ragged_layer rl(rows, N);
      auto store = paged_of(g, rows, ps, true);
      const auto a = with_ws(dense, seq, wmem, [&](workspace& ws) { return dense.add_layer(seq, ws, l, rl.view(rows), qv, {}, weight); });
      REQUIRE_MESSAGE(a.ok(), std::string(a.message()));
      const auto b = with_ws(paged, seq, wmem, [&](workspace& ws) { return paged.add_layer(seq, ws, l, store.view(), qv, {}, weight); });
      REQUIRE_MESSAGE(b.ok(), std::string(b.message()));
      for (index_t j = 0; j <= l; ++j) {
        REQUIRE(paged.changed(j) == dense.changed(j));
        CHECK(kept_cu_of(paged.kept(j)) == kept_cu_of(dense.kept(j)));
        CHECK(kept_pos_of(paged.kept(j)) == kept_pos_of(dense.kept(j)));
      }
    }
  }
}

TEST_CASE("paged drivers: chunked_driver on paged layers across tensor-parallel ranks and pipeline stages keeps one process's rows") {
  // the one process: the dense chunked driver over every head and layer; the ranks: each holds
  // its heads (tp) or its layers (pp, lava) in its own page pools (a new random layout per chunk),
  // every chunk's kept rows must be the one process's for its heads / layers
  auto g = kvtest::rng(1418);
  int evicted = 0, pipelines = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const bool pipeline = trial % 4 == 3;
    const int ranks = 2 + (trial / 4) % 2;
    const index_t Hl = kvtest::uniform_int(g, 1, 2), H = pipeline ? Hl + 1 : Hl * ranks, gq = kvtest::uniform_int(g, 1, 2);
    const index_t L = pipeline ? kvtest::uniform_int(g, ranks, ranks + 1) : kvtest::uniform_int(g, 1, 2);
    const index_t d = 2 * kvtest::uniform_int(g, 2, 4), w = kvtest::uniform_int(g, 1, 4);
    const index_t N = kvtest::uniform_int(g, 20, 50), cs = kvtest::uniform_int(g, 4, 14);
    const index_t ps = std::array<index_t, 3>{1, 3, 16}[static_cast<std::size_t>(kvtest::uniform_int(g, 0, 2))];
    recipe r = chunk_recipe_of(g, w);
    chunked_config cfg;
    cfg.model = {L, H, H * gq, d};
    cfg.tokens = N;
    cfg.capacity = N;
    cfg.rec = r;
    cfg.queries = kvtest::uniform_int(g, 0, 1) ? chunk_queries::patched : chunk_queries::naive;
    const auto kinds = std::array<allocator, 4>{allocator::per_head, allocator::flattened, allocator::adakv, allocator::lava};
    cfg.alloc.kind = pipeline ? allocator::lava : kinds[static_cast<std::size_t>((trial / 2) % 4)];
    if (cfg.alloc.kind == allocator::lava && r.kind == recipe_kind::knorm) {  // LAVa's entropy needs scores >= 0
      r = recipe::streaming_llm(1);
      cfg.rec = r;
    }
    const bool patched = cfg.queries == chunk_queries::patched && uses_attention(r.kind);
    cfg.target = cfg.alloc.kind != allocator::adakv && kvtest::uniform_int(g, 0, 1) ? chunk_target::fraction : chunk_target::budget;
    cfg.fraction = static_cast<double>(kvtest::uniform_int(g, 0, 10)) / 10.0;
    const index_t least = r.n_sink + r.n_recent + 1;
    // budgets [L][H]: every rank's block the same (the sharded layers need the same sum per rank)
    std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H));
    for (index_t l = 0; l < L; ++l) {
      const auto shared = static_cast<std::int32_t>(kvtest::uniform_int(g, least, least + 12));
      for (index_t h = 0; h < (pipeline ? H : Hl); ++h) {
        const auto b = cfg.alloc.kind == allocator::adakv ? shared : static_cast<std::int32_t>(kvtest::uniform_int(g, least, least + 12));
        for (int rk = 0; rk < (pipeline ? 1 : ranks); ++rk) budgets[static_cast<std::size_t>(l * H + rk * Hl + h)] = b;
      }
    }
    if (cfg.alloc.kind == allocator::lava) cfg.alloc.total = L * H * kvtest::uniform_int(g, least, least + 12);
    else cfg.alloc.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
    // the chunks, every token's key and value [l][t][h][d] (keys from 3 values per dimension on
    // half the trials: ties), every chunk's queries [l][H gq][w][d] and patch keys [l][H][w][d]
    std::vector<index_t> bounds{0};
    while (bounds.back() < N) {
      index_t e = std::min(N, bounds.back() + kvtest::uniform_int(g, 1, cs));
      if (patched && e < N && e > N - w) e = N;
      bounds.push_back(e);
    }
    const index_t chunks = static_cast<index_t>(bounds.size()) - 1;
    const bool ties = kvtest::uniform_int(g, 0, 1) == 1;
    auto keys = kvtest::random_floats(g, static_cast<std::size_t>(L * N * H * d));
    if (ties)
      for (auto& x : keys) x = std::round(x);
    const auto vals = kvtest::random_floats(g, static_cast<std::size_t>(L * N * H * d));
    const auto qs = kvtest::random_floats(g, static_cast<std::size_t>(chunks * L * H * gq * w * d));
    const auto pks = kvtest::random_floats(g, static_cast<std::size_t>(chunks * L * H * w * d));
    std::vector<int> with_patch_keys(static_cast<std::size_t>(chunks));
    for (auto& b : with_patch_keys) b = static_cast<int>(kvtest::uniform_int(g, 0, 1));
    const auto query = [&](index_t c, index_t l, index_t h0, index_t n, index_t rows) {
      if (rows == 0) return kv_view<const float>{};
      const float* base = qs.data() + ((c * L + l) * H + h0) * gq * w * d;
      return kvtest::value_of(make_kv_view<const float>(base, n * gq, rows, d, w * d, d));
    };
    const auto patch_keys = [&](const chunked_driver& drv, index_t c, index_t l, index_t h0, index_t n) {
      if (drv.patch().count == 0 || !with_patch_keys[static_cast<std::size_t>(c)]) return kv_view<const float>{};
      const float* base = pks.data() + ((c * L + l) * H + h0) * w * d;
      return kvtest::value_of(make_kv_view<const float>(base, n, w, d, w * d, d));
    };
    // tokens [s, e) of layer l appended to heads [h0, h0 + n) of `rows`
    const auto append = [&](head_rows_set& rows, index_t l, index_t h0, index_t s, index_t e) {
      for (index_t t = s; t < e; ++t)
        for (index_t h = 0; h < rows.H; ++h) {
          const auto at = static_cast<std::size_t>(((l * N + t) * H + h0 + h) * d);
          rows.append(h, keys.data() + at, vals.data() + at, static_cast<pos_t>(t));
        }
    };
    const auto empty_rows = [&](index_t n) {
      head_rows_set s;
      s.H = n, s.d = d;
      s.k.resize(static_cast<std::size_t>(n)), s.v.resize(static_cast<std::size_t>(n)), s.pos.resize(static_cast<std::size_t>(n));
      return s;
    };
    INFO("trial ", trial, pipeline ? " stages " : " ranks ", ranks, " recipe ", std::string(recipe_name(r.kind)), " allocator ",
         std::string(allocator_name(cfg.alloc.kind)), " ", cfg.queries == chunk_queries::patched ? "patched" : "naive",
         cfg.target == chunk_target::budget ? " budget" : " fraction", " L ", L, " H ", H, " g ", gq, " w ", w, " N ", N,
         " chunks ", chunks, " page size ", ps, ties ? " ties" : "");
    // the one process, dense: per chunk and layer every head's held positions
    std::vector<std::vector<std::vector<std::vector<pos_t>>>> want(static_cast<std::size_t>(chunks));
    {
      std::vector<unsigned char> mem(kvtest::value_of(chunked_driver::state_bytes(cfg))), wmem;
      chunked_driver one;
      REQUIRE(one.init(cfg, mem.data(), mem.size()).ok());
      std::vector<head_rows_set> truth(static_cast<std::size_t>(L), empty_rows(H));
      for (index_t c = 0; c < chunks; ++c) {
        const index_t s = bounds[static_cast<std::size_t>(c)], e = bounds[static_cast<std::size_t>(c + 1)];
        REQUIRE(one.begin_chunk(s, e).ok());
        for (index_t l = 0; l < L; ++l) {
          auto& rows = truth[static_cast<std::size_t>(l)];
          append(rows, l, 0, s, e);
          ragged_layer rl(rows, N);
          const auto st = with_ws(one, seq, wmem, [&](workspace& ws) {
            return one.add_layer(seq, ws, l, rl.view(rows), query(c, l, 0, H, one.query_rows()), patch_keys(one, c, l, 0, H));
          });
          REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
        }
        REQUIRE(with_ws(one, seq, wmem, [&](workspace& ws) { return one.decide(seq, ws); }).ok());
        for (index_t l = 0; l < L; ++l) {
          auto& rows = truth[static_cast<std::size_t>(l)];
          index_t before = 0;
          for (index_t h = 0; h < H; ++h) before += rows.len(h);
          evicted += one.kept(l).cu[H] < before ? 1 : 0;
          rows.compact(one.kept(l));
          want[static_cast<std::size_t>(c)].push_back(rows.pos);
        }
      }
    }
    // the ranks: paged layers in their own pools, a new layout per chunk
    std::vector<std::string> errors(static_cast<std::size_t>(ranks));
    std::vector<std::vector<std::vector<std::vector<std::vector<pos_t>>>>> got(static_cast<std::size_t>(ranks));
    const auto seed = static_cast<std::uint64_t>(trial) * 131 + 5;
    kvtest::thread_world::run(ranks, [&](kvtest::thread_comm& comm) {
      const auto me = static_cast<std::size_t>(comm.rank());
      auto rg = kvtest::rng(seed + me);
      const shard_range mine = pipeline ? kvtest::value_of(layer_shard(L, ranks, comm.rank())) : shard_range{0, L};
      const index_t h0 = pipeline ? 0 : Hl * comm.rank(), Hr = pipeline ? H : Hl;
      chunked_config rc = cfg;
      rc.model.layers = mine.count;
      rc.model.kv_heads = Hr;
      rc.model.query_heads = Hr * gq;
      rc.pool_pages = 3 * Hr * (N + 64) + 80;
      if (pipeline) {
        rc.pp = comm_ref(comm);
        rc.first_layer = mine.first;
        rc.model_layers = L;
      } else {
        rc.tp = comm_ref(comm);
      }
      if (cfg.alloc.kind != allocator::lava)
        rc.alloc.budgets = kvtest::value_of(make_matrix_view<const std::int32_t>(budgets.data() + h0, L, Hr, H));
      std::vector<unsigned char> mem(chunked_driver::state_bytes(rc).value()), wmem;
      chunked_driver drv;
      status st = drv.init(rc, mem.data(), mem.size());
      std::vector<head_rows_set> held(static_cast<std::size_t>(mine.count), empty_rows(Hr));
      for (index_t c = 0; c < chunks && st.ok(); ++c) {
        const index_t s = bounds[static_cast<std::size_t>(c)], e = bounds[static_cast<std::size_t>(c + 1)];
        st = drv.begin_chunk(s, e);
        for (index_t i = 0; i < mine.count && st.ok(); ++i) {
          const index_t l = mine.first + i;
          auto& rows = held[static_cast<std::size_t>(i)];
          append(rows, l, h0, s, e);
          auto store = paged_of(rg, rows, ps, true);
          st = with_ws(drv, seq, wmem, [&](workspace& ws) {
            return drv.add_layer(seq, ws, i, store.view(), query(c, l, h0, Hr, drv.query_rows()), patch_keys(drv, c, l, h0, Hr));
          });
        }
        if (st.ok()) st = with_ws(drv, seq, wmem, [&](workspace& ws) { return drv.decide(seq, ws); });
        if (!st.ok()) break;
        std::vector<std::vector<std::vector<pos_t>>> per;
        for (index_t i = 0; i < mine.count; ++i) {
          held[static_cast<std::size_t>(i)].compact(drv.kept(i));
          per.push_back(held[static_cast<std::size_t>(i)].pos);
        }
        got[me].push_back(per);
      }
      errors[me] = st.ok() ? "" : st.message();
    });
    for (int rk = 0; rk < ranks; ++rk) {
      CAPTURE(rk);
      REQUIRE(errors[static_cast<std::size_t>(rk)] == "");
      const auto& mine = got[static_cast<std::size_t>(rk)];
      REQUIRE(static_cast<index_t>(mine.size()) == chunks);
      const shard_range layers = pipeline ? kvtest::value_of(layer_shard(L, ranks, rk)) : shard_range{0, L};
      for (index_t c = 0; c < chunks; ++c)
        for (index_t i = 0; i < layers.count; ++i) {
          const auto& all = want[static_cast<std::size_t>(c)][static_cast<std::size_t>(layers.first + i)];
          const index_t h0 = pipeline ? 0 : Hl * rk, n = pipeline ? H : Hl;
          const std::vector<std::vector<pos_t>> part(all.begin() + h0, all.begin() + h0 + n);
          CHECK(mine[static_cast<std::size_t>(c)][static_cast<std::size_t>(i)] == part);
        }
    }
    pipelines += pipeline ? 1 : 0;
  }
  CHECK(evicted > 0);
  CHECK(pipelines == 10);
}
