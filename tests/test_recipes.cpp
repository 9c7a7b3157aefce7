// Recipes against a naive reference written for clarity: materialised attention in double,
// explicit pooling / GQA / weighting / protection loops, and selection by a full sort.
#include "support.hpp"

#include <kvevict/compact.hpp>
#include <kvevict/host_isa.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/recipes.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {

// q [hq][w][d], v and bk head-major; k token-major [T][hkv][d] (the library sees it through strides).
struct problem {
  index_t hq, hkv, T, d, w;  // w: query rows
  std::vector<float> q, k, v, bk;  // bk: external block keys (may be empty)
  const float* key(index_t h, index_t t) const { return k.data() + (t * hkv + h) * d; }
};

problem make_problem(std::mt19937_64& g, index_t hq, index_t hkv, index_t T, index_t d, index_t w, bool block) {
  problem p{hq, hkv, T, d, w, {}, {}, {}, {}};
  p.q = kvtest::random_floats(g, static_cast<std::size_t>(hq * w * d), -2.f, 2.f);
  p.k = kvtest::random_floats(g, static_cast<std::size_t>(hkv * T * d), -2.f, 2.f);
  p.v = kvtest::random_floats(g, static_cast<std::size_t>(hkv * T * d), -1.f, 1.f);
  if (block) p.bk = kvtest::random_floats(g, static_cast<std::size_t>(hkv * w * d), -2.f, 2.f);
  return p;
}

double dot(const float* a, const float* b, index_t d) {
  double s = 0;
  for (index_t i = 0; i < d; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// Per-query-head raw scores [hq][T] of a recipe, in double, by materialising every attention row.
std::vector<double> naive_raw(const recipe& r, const problem& p) {
  const index_t g = p.hq / p.hkv, T = p.T, d = p.d, w = p.w;
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> out(static_cast<std::size_t>(p.hq * T), 0.0);
  for (index_t h = 0; h < p.hq; ++h) {
    const index_t kvh = h / g;
    std::vector<std::vector<double>> rows;  // probability of each prompt column, per query row
    for (index_t i = 0; i < w; ++i) {
      const float* qi = p.q.data() + (h * w + i) * d;
      // visible keys: (prompt column or -1 for a block key, logit)
      std::vector<std::pair<index_t, double>> vis;
      if (r.kind == recipe_kind::h2o) {
        for (index_t j = 0; j <= i; ++j) vis.push_back({j, dot(qi, p.key(kvh, j), d) * scale});
      } else if (r.kind == recipe_kind::tova) {
        for (index_t j = 0; j < T; ++j) vis.push_back({j, dot(qi, p.key(kvh, j), d) * scale});
      } else if (r.source == query_source::prompt_window) {
        for (index_t j = 0; j <= T - w + i; ++j) vis.push_back({j, dot(qi, p.key(kvh, j), d) * scale});
      } else {
        for (index_t j = 0; j < T; ++j) vis.push_back({j, dot(qi, p.key(kvh, j), d) * scale});
        if (!p.bk.empty())
          for (index_t j = 0; j <= i; ++j) vis.push_back({-1, dot(qi, p.bk.data() + (kvh * w + j) * d, d) * scale});
      }
      double m = -INFINITY, s = 0;
      for (auto& e : vis) m = std::max(m, e.second);
      for (auto& e : vis) s += std::exp(e.second - m);
      std::vector<double> prob(static_cast<std::size_t>(T), 0.0);
      for (auto& e : vis)
        if (e.first >= 0) prob[e.first] = std::exp(e.second - m) / s;
      rows.push_back(prob);
    }
    for (index_t j = 0; j < T; ++j) {
      double sum = 0, n_seen = 0;
      for (index_t i = 0; i < w; ++i) sum += rows[i][j];
      for (index_t i = 0; i < w; ++i) n_seen += (r.kind == recipe_kind::h2o ? (j <= i) : 1);
      double val = 0;
      switch (r.score.reduce) {
        case score_reduce::sum: val = sum; break;
        case score_reduce::mean: val = sum / double(w); break;
        case score_reduce::mean_visible: val = sum / n_seen; break;
        case score_reduce::mean_plus_variance: {
          const double mean = sum / double(w);
          double var = 0;
          for (index_t i = 0; i < w; ++i) var += (rows[i][j] - mean) * (rows[i][j] - mean);
          var = w > 1 ? var / double(w - 1) : 0.0;
          val = mean + double(r.score.gamma) * var;
          break;
        }
      }
      out[h * T + j] = val;
    }
  }
  return out;
}

// Pool the first `len` columns of each row (max: ignore padding; avg: zero padding / kernel).
std::vector<double> naive_pool(const std::vector<double>& in, index_t rows, index_t T, index_t len, pool_kind kind,
                               index_t kernel) {
  std::vector<double> out = in;
  const index_t rad = kernel / 2;
  for (index_t r = 0; r < rows; ++r)
    for (index_t t = 0; t < len; ++t) {
      if (kind == pool_kind::none) continue;
      double acc = kind == pool_kind::max ? -INFINITY : 0.0;
      for (index_t u = t - rad; u <= t + rad; ++u) {
        if (u < 0 || u >= len) continue;
        acc = kind == pool_kind::max ? std::max(acc, in[r * T + u]) : acc + in[r * T + u];
      }
      out[r * T + t] = kind == pool_kind::max ? acc : acc / double(kernel);
    }
  return out;
}

std::vector<double> naive_gqa(const std::vector<double>& in, index_t hq, index_t hkv, index_t T, gqa_op op) {
  const index_t g = hq / hkv;
  std::vector<double> out(static_cast<std::size_t>(hkv * T));
  for (index_t h = 0; h < hkv; ++h)
    for (index_t t = 0; t < T; ++t) {
      double acc = op == gqa_op::max ? -INFINITY : 0.0;
      for (index_t j = 0; j < g; ++j) {
        const double x = in[(h * g + j) * T + t];
        acc = op == gqa_op::max ? std::max(acc, x) : acc + x;
      }
      out[h * T + t] = op == gqa_op::mean ? acc / double(g) : acc;
    }
  return out;
}

// The whole recipe, naively: final [hkv][T] scores (protected positions = +inf).
std::vector<double> naive_recipe(const recipe& r, const problem& p) {
  const index_t T = p.T, d = p.d;
  std::vector<double> s(static_cast<std::size_t>(p.hkv * T));
  if (r.kind == recipe_kind::knorm) {
    for (index_t h = 0; h < p.hkv; ++h)
      for (index_t t = 0; t < T; ++t) s[h * T + t] = -std::sqrt(dot(p.key(h, t), p.key(h, t), d));
  } else if (r.kind == recipe_kind::streaming_llm) {
    for (index_t h = 0; h < p.hkv; ++h)
      for (index_t t = 0; t < T; ++t) s[h * T + t] = double(t);
  } else {
    const auto raw = naive_raw(r, p);
    const index_t pooled = (r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova &&
                            r.source == query_source::prompt_window)
                               ? T - p.w
                               : T;
    if (r.order == gqa_order::pool_first)
      s = naive_gqa(naive_pool(raw, p.hq, T, pooled, r.pool, r.kernel), p.hq, p.hkv, T, r.gqa);
    else
      s = naive_pool(naive_gqa(raw, p.hq, p.hkv, T, r.gqa), p.hkv, T, pooled, r.pool, r.kernel);
    if (r.weight_values)
      for (index_t h = 0; h < p.hkv; ++h) {
        double head_max = 0;
        std::vector<double> l1(static_cast<std::size_t>(T));
        for (index_t t = 0; t < T; ++t) {
          for (index_t e = 0; e < d; ++e) l1[t] += std::fabs(double(p.v[(h * T + t) * d + e]));
          head_max = std::max(head_max, l1[t]);
        }
        for (index_t t = 0; t < T; ++t) s[h * T + t] *= r.weight == value_weight::per_token ? l1[t] : head_max;
      }
  }
  for (index_t h = 0; h < p.hkv; ++h)
    for (index_t t = 0; t < T; ++t)
      if (t < r.n_sink || t >= T - r.n_recent) s[h * T + t] = INFINITY;
  return s;
}

// Selection by a full sort (score descending, position ascending), then positions ascending.
std::vector<pos_t> naive_select(const std::vector<float>& scores, index_t T, index_t h, index_t k) {
  std::vector<pos_t> idx(static_cast<std::size_t>(T));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](pos_t a, pos_t b) { return scores[h * T + a] > scores[h * T + b]; });
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

template <class Backend>
std::vector<float> run_scores(Backend be, const recipe& r, const problem& p) {
  auto q = value_of(make_kv_view<const float>(p.q.data(), p.hq, p.w, p.d));
  auto k = value_of(make_kv_view<const float>(p.k.data(), p.hkv, p.T, p.d, kv_layout::token_major));
  auto v = value_of(make_kv_view<const float>(p.v.data(), p.hkv, p.T, p.d));
  kv_view<const float> bk{};
  if (!p.bk.empty()) bk = value_of(make_kv_view<const float>(p.bk.data(), p.hkv, p.w, p.d));
  std::vector<float> out(static_cast<std::size_t>(p.hkv * p.T), -7.f);
  auto s = value_of(make_matrix_view(out.data(), p.hkv, p.T));
  workspace ws;
  REQUIRE(recipe_scores(be, ws, r, q, k, v, s, bk).ok());
  const auto predicted = recipe_scores_workspace_bytes(be, r, p.hq, p.w, p.hkv, p.T, p.d, p.bk.empty() ? 0 : p.w);
  REQUIRE(predicted.ok());
  CHECK(*predicted == ws.bytes);
  std::vector<unsigned char> buf;
  ws = kvtest::shifted_workspace(buf, ws.bytes);
  const status st = recipe_scores(be, ws, r, q, k, v, s, bk);
  REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
  return out;
}

recipe with_source(recipe r, query_source src) {
  r.source = src;
  if (src == query_source::external_block) r.n_recent = 0;
  return r;
}

}  // namespace

TEST_CASE("recipes: every recipe's scores match the naive reference; selection matches a full sort") {
  std::vector<recipe> recipes = {recipe::snapkv(), recipe::h2o(),  recipe::tova(), recipe::streaming_llm(),
                                 recipe::knorm(),  recipe::vatp(), recipe::lava(), recipe::cake()};
  // variations nobody published: reduce before pooling, sum reduction, external blocks with and
  // without their own keys, avg pooling with a valid-count divisor, sinks with a window
  recipe snap_rtp = recipe::snapkv();
  snap_rtp.order = gqa_order::gqa_first;
  snap_rtp.gqa = gqa_op::sum;
  snap_rtp.n_sink = 3;
  recipes.push_back(snap_rtp);
  recipes.push_back(with_source(recipe::snapkv(), query_source::external_block));
  recipes.push_back(with_source(recipe::lava(), query_source::external_block));
  recipe h2o_norm = recipe::h2o();
  h2o_norm.score.reduce = score_reduce::mean_visible;
  recipes.push_back(h2o_norm);

  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    auto g = kvtest::rng(seed);
    const index_t hkv = kvtest::uniform_int(g, 1, 3), group = kvtest::uniform_int(g, 1, 4);
    const index_t T = kvtest::uniform_int(g, 40, 140), d = kvtest::uniform_int(g, 2, 24);
    for (std::size_t ri = 0; ri < recipes.size(); ++ri) {
      recipe r = recipes[ri];
      const bool external = uses_attention(r.kind) && r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova &&
                            r.source == query_source::external_block;
      index_t w = r.window;
      if (r.kind == recipe_kind::h2o) w = T;
      if (r.kind == recipe_kind::tova) w = 1;
      if (external) w = kvtest::uniform_int(g, 1, 9);
      if (!uses_attention(r.kind)) w = 1;
      const bool block = external && (seed % 2 == 0);
      if (r.source == query_source::prompt_window && recipe_kind::snapkv == r.kind && seed % 3 == 0) {
        r.window = 8;  // a window other than the default
        w = 8;
        r.n_recent = 8;
      }
      const problem p = make_problem(g, hkv * group, hkv, T, d, w, block);
      CAPTURE(seed);
      CAPTURE(ri);
      const std::string name = recipe_name(r.kind);
      CAPTURE(name);
      const auto got = run_scores(seq, r, p);
      const auto got_par = run_scores(par, r, p);
      REQUIRE(std::memcmp(got.data(), got_par.data(), got.size() * sizeof(float)) == 0);
      const auto ref = naive_recipe(r, p);
      double max_ref = 0;
      for (double x : ref)
        if (std::isfinite(x)) max_ref = std::max(max_ref, std::fabs(x));
      for (std::size_t i = 0; i < ref.size(); ++i) {
        if (std::isinf(ref[i])) {
          REQUIRE(got[i] == std::numeric_limits<float>::infinity());
        } else {
          INFO("column ", i % static_cast<std::size_t>(T), " ref ", ref[i], " got ", got[i]);
          REQUIRE(std::fabs(double(got[i]) - ref[i]) <= 2e-5 * max_ref + 1e-6 * std::fabs(ref[i]) + 1e-12);
        }
      }
      // selection at several budgets: equal to a full sort of the same scores; invariants
      const index_t protected_n = protected_count(T, r.n_sink, r.n_recent);
      for (index_t budget : {protected_n, (protected_n + T) / 2, T}) {
        std::vector<pos_t> kept(static_cast<std::size_t>(hkv * budget));
        auto kv = value_of(make_matrix_view(kept.data(), hkv, budget));
        const auto sv = value_of(make_matrix_view<const float>(got.data(), hkv, T));
        workspace ws;
        REQUIRE(recipe_select(seq, ws, r, sv, kv).ok());  // size query
        CHECK(ws.bytes == select_topk_workspace_bytes(seq, T));
        std::vector<unsigned char> buf(ws.bytes);
        ws.data = buf.data();
        REQUIRE(recipe_select(seq, ws, r, sv, kv).ok());
        std::vector<pos_t> kept_par(kept.size());
        std::vector<unsigned char> buf_par(select_topk_workspace_bytes(par, T));
        workspace ws_par{buf_par.data(), buf_par.size()};
        REQUIRE(recipe_select(par, ws_par, r, sv, value_of(make_matrix_view(kept_par.data(), hkv, budget))).ok());
        REQUIRE(kept == kept_par);
        for (index_t h = 0; h < hkv; ++h) {
          const auto ref_kept = naive_select(got, T, h, budget);
          REQUIRE(std::equal(ref_kept.begin(), ref_kept.end(), kept.begin() + h * budget));
          // protected tokens are kept
          for (index_t t = 0; t < T; ++t)
            if (t < r.n_sink || t >= T - r.n_recent)
              REQUIRE(std::binary_search(kept.begin() + h * budget, kept.begin() + (h + 1) * budget, pos_t(t)));
        }
      }
    }
  }
}

TEST_CASE("recipes: per-head budgets in ragged form") {
  auto g = kvtest::rng(99);
  const problem p = make_problem(g, 4, 2, 64, 8, 32, false);
  const auto scores = run_scores(seq, recipe::snapkv(), p);
  const std::int32_t cu[] = {0, 40, 40 + 33};
  std::vector<pos_t> pos(73);
  workspace ws;
  REQUIRE(recipe_select(seq, ws, recipe::snapkv(), value_of(make_matrix_view<const float>(scores.data(), 2, 64)),
                        ragged_positions_out{pos.data(), cu, 2})
              .ok());
  std::vector<unsigned char> buf(ws.bytes);
  ws.data = buf.data();
  REQUIRE(recipe_select(seq, ws, recipe::snapkv(), value_of(make_matrix_view<const float>(scores.data(), 2, 64)),
                        ragged_positions_out{pos.data(), cu, 2})
              .ok());
  const auto h0 = naive_select(scores, 64, 0, 40), h1 = naive_select(scores, 64, 1, 33);
  CHECK(std::equal(h0.begin(), h0.end(), pos.begin()));
  CHECK(std::equal(h1.begin(), h1.end(), pos.begin() + 40));
  // 31 < the 32 protected window tokens
  const std::int32_t small[] = {0, 40, 71};
  require_error(recipe_select(seq, ws, recipe::snapkv(), value_of(make_matrix_view<const float>(scores.data(), 2, 64)),
                              ragged_positions_out{pos.data(), small, 2}),
                errc::invalid_argument, "budget 31 is below the 32 protected tokens");
}

TEST_CASE("recipes: names round-trip, defaults are the documented ones") {
  for (recipe_kind k : {recipe_kind::streaming_llm, recipe_kind::h2o, recipe_kind::tova, recipe_kind::snapkv,
                        recipe_kind::knorm, recipe_kind::vatp, recipe_kind::lava, recipe_kind::cake})
    CHECK(value_of(recipe_from_name(recipe_name(k))).kind == k);
  require_error(recipe_from_name("snapk").error(), errc::invalid_argument, "unknown recipe 'snapk'");
  const recipe s = recipe::snapkv();
  CHECK(s.window == 32);
  CHECK(s.kernel == 7);
  CHECK(s.pool == pool_kind::max);
  CHECK(s.gqa == gqa_op::mean);
  CHECK(recipe::streaming_llm().n_sink == 4);
  CHECK(recipe::lava().gqa == gqa_op::max);
  CHECK(recipe::cake().score.gamma == 200.0f);
}

TEST_CASE("recipes: recipe_queries are the rows each recipe reads from the prompt's queries") {
  const index_t H = 2, P = 10, D = 3;
  std::vector<float> q(H * P * D, 1.0f);
  const auto all = value_of(make_kv_view<const float>(q.data(), H, P, D));
  for (const recipe& r : {recipe::streaming_llm(), recipe::h2o(), recipe::tova(), recipe::snapkv(), recipe::knorm(),
                          recipe::vatp(), recipe::lava(), recipe::cake()}) {
    recipe w = r;
    w.window = 4;
    const auto rows = value_of(recipe_queries(w, all));
    const index_t want = uses_window(r.kind) ? 4 : r.kind == recipe_kind::h2o ? P : r.kind == recipe_kind::tova ? 1 : 0;
    CHECK(uses_window(r.kind) == (uses_attention(r.kind) && r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova));
    REQUIRE(rows.extent(1) == want);
    if (want > 0) {
      CHECK(rows.extent(0) == H);
      CHECK(&rows(1, want - 1, 2) == &all(1, P - 1, 2));  // the prompt's last query is the block's last
    }
  }
  recipe longer = recipe::snapkv();
  longer.window = P + 1;
  require_error(recipe_queries(longer, all).error(), errc::out_of_range, "token_range");
}

TEST_CASE("recipes: bad input gives specific errors") {
  auto g = kvtest::rng(5);
  const problem p = make_problem(g, 4, 2, 20, 4, 32, false);
  auto q = value_of(make_kv_view<const float>(p.q.data(), 4, 32, 4));
  auto k = value_of(make_kv_view<const float>(p.k.data(), 2, 20, 4));
  auto v = value_of(make_kv_view<const float>(p.v.data(), 2, 20, 4));
  std::vector<float> out(40);
  auto s = value_of(make_matrix_view(out.data(), 2, 20));
  workspace ws;
  require_error(recipe_scores(seq, ws, recipe::snapkv(), q, k, v, s), errc::invalid_argument,
                "window 32 is longer than the 20 prompt tokens");
  recipe r = recipe::snapkv();
  r.window = 8;
  require_error(recipe_scores(seq, ws, r, q, k, v, s), errc::shape_mismatch, "window is 8 but queries hold 32 rows");
  r.kernel = 4;
  require_error(recipe_scores(seq, ws, r, q, k, v, s), errc::invalid_argument, "kernel 4 must be odd");
  auto q3 = value_of(make_kv_view<const float>(p.q.data(), 3, 8, 4));
  r = recipe::snapkv();
  r.window = 8;
  require_error(recipe_scores(seq, ws, r, q3, k, v, s), errc::shape_mismatch, "3 query heads are not a multiple of 2");
  auto s_wrong = value_of(make_matrix_view(out.data(), 2, 19));
  require_error(recipe_scores(seq, ws, r, q, k, v, s_wrong), errc::shape_mismatch, "scores is [2][19]");
  auto v_wrong = value_of(make_kv_view<const float>(p.v.data(), 1, 20, 4));
  require_error(recipe_scores(seq, ws, recipe::vatp(), q, k, v_wrong, s), errc::shape_mismatch, "vatp weights by values");
  recipe bad = recipe::snapkv();
  bad.n_sink = -1;
  require_error(recipe_scores(seq, ws, bad, q, k, v, s), errc::invalid_argument, "n_sink (-1)");
  // budgets: below the protected window, above the prompt
  std::vector<pos_t> kept(2 * 21);
  auto sv = value_of(make_matrix_view<const float>(out.data(), 2, 20));
  std::vector<unsigned char> buf(select_topk_workspace_bytes(seq, 20));
  workspace sws{buf.data(), buf.size()};
  recipe r8 = recipe::snapkv();
  r8.n_recent = 8;
  require_error(recipe_select(seq, sws, r8, sv, value_of(make_matrix_view(kept.data(), 2, 7))), errc::invalid_argument,
                "budget 7 is below the 8 protected tokens");
  require_error(recipe_select(seq, sws, recipe::knorm(), sv, value_of(make_matrix_view(kept.data(), 2, 21))),
                errc::invalid_argument, "k = 21 is larger than row 0's length 20");
}

TEST_CASE("host_isa: the limit is clamped, active is min(supported, limit), and no copy changes a bit") {
  const host_isa supported = host_isa_supported();
  MESSAGE("host kernel copies on this machine: up to " << std::string(host_isa_name(supported)));
  CHECK(host_isa_limit() == host_isa::avx512);  // the default caps nothing
  CHECK(host_isa_active() == supported);
  {
    const host_isa_limit_guard low(host_isa::baseline);
    CHECK(host_isa_limit() == host_isa::baseline);
    CHECK(host_isa_active() == host_isa::baseline);
    set_host_isa_limit(static_cast<host_isa>(-3));  // out-of-range values are clamped into the enum
    CHECK(host_isa_limit() == host_isa::baseline);
    set_host_isa_limit(static_cast<host_isa>(9));
    CHECK(host_isa_limit() == host_isa::avx512);
    CHECK(host_isa_active() == supported);
  }
  CHECK(host_isa_limit() == host_isa::avx512);  // (the guard restored it)
  CHECK(std::string(host_isa_name(host_isa::avx2)) == "avx2");
  CHECK(std::string(host_isa_name(static_cast<host_isa>(7))) == "unknown");

  // every recipe's scores and a compaction of fp16 rows, under every limit the CPU allows: the same
  // bits (scores of the pooling, GQA, value-norm, entropy and window-score kernels; the gather's copy)
  const std::vector<recipe> recipes = {recipe::snapkv(), recipe::h2o(), recipe::tova(), recipe::vatp(),
                                       recipe::lava(), recipe::cake(), recipe::knorm()};
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    auto g = kvtest::rng(100 + seed);
    const index_t hkv = kvtest::uniform_int(g, 1, 3), group = kvtest::uniform_int(g, 1, 4);
    const index_t T = kvtest::uniform_int(g, 300, 900), d = 16 * kvtest::uniform_int(g, 1, 8);
    for (const recipe& r : recipes) {
      CAPTURE(recipe_name(r.kind));
      const index_t w = r.kind == recipe_kind::h2o ? T : r.kind == recipe_kind::tova ? 1
                        : uses_attention(r.kind)  ? r.window : 1;
      auto rg = kvtest::rng(seed * 31 + static_cast<std::uint64_t>(r.kind));
      const problem p = make_problem(rg, hkv * group, hkv, T, d, w, false);
      std::vector<std::vector<float>> outs;
      for (int level = 0; level <= static_cast<int>(supported); ++level) {
        const host_isa_limit_guard limit(kvtest::isa_level(level));
        outs.push_back(run_scores(par_t{2}, r, p));
      }
      for (std::size_t i = 1; i < outs.size(); ++i)
        CHECK(std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)) == 0);
    }
    // compaction: fp16 rows of 16 * 8..128 bytes (multiples of 32: the AVX2 copy's rows)
    const index_t k = T / 3;
    std::vector<float16> src(static_cast<std::size_t>(hkv * T * d));
    for (auto& x : src) x = to_float16(static_cast<float>(kvtest::uniform_int(g, -500, 500)) / 64.f);
    std::vector<pos_t> kept;
    for (index_t h = 0; h < hkv; ++h) {
      std::vector<pos_t> all(static_cast<std::size_t>(T));
      std::iota(all.begin(), all.end(), pos_t{0});
      std::shuffle(all.begin(), all.end(), g);
      all.resize(static_cast<std::size_t>(k));
      std::sort(all.begin(), all.end());
      kept.insert(kept.end(), all.begin(), all.end());
    }
    std::vector<std::vector<float16>> dsts;
    for (int level = 0; level <= static_cast<int>(supported); ++level) {
      const host_isa_limit_guard limit(kvtest::isa_level(level));
      dsts.emplace_back(static_cast<std::size_t>(hkv * k * d), float16{});
      REQUIRE(compact(seq, value_of(make_kv_view<const float16>(src.data(), hkv, T, d)),
                      value_of(make_matrix_view<const pos_t>(kept.data(), hkv, k)),
                      value_of(make_kv_view(dsts.back().data(), hkv, k, d)))
                  .ok());
    }
    for (std::size_t i = 1; i < dsts.size(); ++i)
      CHECK(std::memcmp(dsts[0].data(), dsts[i].data(), dsts[0].size() * sizeof(float16)) == 0);
  }
}
