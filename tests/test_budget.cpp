#include "support.hpp"

#include <kvevict/budget.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/train/prulong.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>
#include <kvevict/weight.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::uniform_int;
using kvtest::value_of;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();
const float qnan = std::numeric_limits<float>::quiet_NaN();

// ---- naive references, written for clarity -----------------------------------------------------

// The selection order of docs/conventions.md: NaN below everything, otherwise IEEE order, equal
// scores -> lower (head, position).
bool ranks_before(float a, index_t ra, index_t pa, float b, index_t rb, index_t pb) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  if (ra != rb) return ra < rb;
  return pa < pb;
}

// Row r's best k of its first n scores, ascending positions.
std::vector<pos_t> naive_topk(const std::vector<float>& row, index_t n, index_t k) {
  std::vector<pos_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](pos_t i, pos_t j) { return ranks_before(row[i], 0, i, row[j], 0, j); });
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

// AdaKV / LAVa, naively: each head's best floors[h] first, then a full sort of every other
// (score, head, position) entry of the layer, take what is left of `total`.
std::vector<std::vector<pos_t>> naive_flat(const std::vector<std::vector<float>>& rows, const std::vector<index_t>& len,
                                           index_t total, const std::vector<index_t>& floors) {
  const std::size_t R = rows.size();
  std::vector<std::vector<bool>> taken(R);
  index_t left = total;
  for (std::size_t r = 0; r < R; ++r) {
    taken[r].assign(static_cast<std::size_t>(len[r]), false);
    const index_t f = floors.empty() ? 0 : floors[r];
    for (pos_t p : naive_topk(rows[r], len[r], f)) taken[r][static_cast<std::size_t>(p)] = true;
    left -= f;
  }
  struct entry {
    float s;
    index_t r;
    pos_t p;
  };
  std::vector<entry> rest;
  for (std::size_t r = 0; r < R; ++r)
    for (pos_t p = 0; p < len[r]; ++p)
      if (!taken[r][static_cast<std::size_t>(p)]) rest.push_back({rows[r][static_cast<std::size_t>(p)], index_t(r), p});
  std::sort(rest.begin(), rest.end(), [](const entry& a, const entry& b) { return ranks_before(a.s, a.r, a.p, b.s, b.r, b.p); });
  for (index_t i = 0; i < left; ++i) taken[static_cast<std::size_t>(rest[static_cast<std::size_t>(i)].r)][static_cast<std::size_t>(rest[static_cast<std::size_t>(i)].p)] = true;
  std::vector<std::vector<pos_t>> kept(R);
  for (std::size_t r = 0; r < R; ++r)
    for (pos_t p = 0; p < len[r]; ++p)
      if (taken[r][static_cast<std::size_t>(p)]) kept[r].push_back(p);
  return kept;
}

// KVCache-Factory's PyramidKVCluster.update_kv capacity, transcribed line by line (n_sink = 0):
// the per-head budget of layer `layer` (window included) for a prompt of q_len tokens.
index_t kvcf_pyramid(index_t max_capacity_prompt, index_t window_size, index_t beta, index_t num_hidden_layers,
                     index_t layer_idx, index_t q_len) {
  index_t min_num = (max_capacity_prompt - window_size) / beta;
  index_t max_num = (max_capacity_prompt - window_size) * 2 - min_num;
  if (max_num >= q_len - window_size) {
    max_num = q_len - window_size;
    min_num = (max_capacity_prompt - window_size) * 2 - max_num;
  }
  const index_t steps = (max_num - min_num) / (num_hidden_layers - 1);
  const index_t capacity = max_num - layer_idx * steps;
  if (q_len < max_capacity_prompt) return q_len;                                 // no compression
  if (q_len < (max_capacity_prompt - window_size) * 2) return max_capacity_prompt;  // SnapKV's budget
  return capacity + window_size;                                                   // past + window
}

// Water-filling + largest remainder, spelled out with long doubles and a sort (the definition of
// docs/budget.md). Used to check apportion's shares are floor/ceil of these quotas.
std::vector<long double> naive_quotas(index_t target, const std::vector<double>& w, const std::vector<index_t>& caps) {
  const std::size_t n = w.size();
  std::vector<bool> capped(n, false);
  std::vector<long double> q(n, 0.0L);
  for (std::size_t i = 0; i < n; ++i)
    if (caps[i] == 0) capped[i] = true;
  while (true) {
    long double R = static_cast<long double>(target), W = 0.0L;
    std::size_t active = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (capped[i]) R -= static_cast<long double>(caps[i]);
      else {
        W += w[i];
        ++active;
      }
    }
    bool again = false;
    for (std::size_t i = 0; i < n; ++i) {
      if (capped[i]) {
        q[i] = static_cast<long double>(caps[i]);
        continue;
      }
      q[i] = W > 0 ? R * w[i] / W : R / static_cast<long double>(active);
      if (q[i] >= static_cast<long double>(caps[i])) {
        capped[i] = true;
        again = true;
      }
    }
    if (!again) return q;
  }
}

template <class T>
matrix_view<T> mat(std::vector<T>& v, index_t rows, index_t cols) {
  return value_of(make_matrix_view(v.data(), rows, cols));
}
template <class T>
matrix_view<const T> cmat(const std::vector<T>& v, index_t rows, index_t cols) {
  return value_of(make_matrix_view(v.data(), rows, cols));
}

// Random scores with ties and special values, then protect(prot) so that they carry the protection.
std::vector<float> random_scores(std::mt19937_64& g, index_t R, index_t T, int kind) {
  std::vector<float> s(static_cast<std::size_t>(R * T));
  for (auto& x : s) {
    switch (kind % 4) {
      case 0: x = static_cast<float>(uniform_int(g, 0, 1000000)) * 1e-6f; break;
      case 1: x = static_cast<float>(uniform_int(g, 0, 3)); break;  // heavy ties
      case 2: x = std::exp(static_cast<float>(uniform_int(g, -4000, 4000)) * 1e-3f); break;
      default: {
        const auto u = uniform_int(g, 0, 40);
        x = u == 0 ? qnan : (u == 1 ? -inf : (u == 2 ? -0.0f : static_cast<float>(uniform_int(g, -5, 5))));
      }
    }
  }
  return s;
}

void protect_scores(std::vector<float>& s, index_t R, index_t T, const protection& p, const std::int32_t* lengths = nullptr) {
  REQUIRE(protect(seq, mat(s, R, T), p.n_sink, p.n_recent, lengths).ok());
}

workspace alloc_ws(std::vector<unsigned char>& buf, std::size_t bytes) {
  return kvtest::shifted_workspace(buf, bytes);
}

}  // namespace

// ================================================================================================
TEST_CASE("budget_offsets: budgets to select_topk's ragged cu, both forms, and their errors") {
  const std::vector<std::int32_t> b = {3, 0, 5, 1};
  std::vector<std::int32_t> cu(5, -7);
  REQUIRE(budget_offsets(b.data(), 4, cu.data()).ok());
  CHECK(cu == std::vector<std::int32_t>{0, 3, 3, 8, 9});
  const std::vector<std::int32_t> m = {1, 2, 3, 4, 5, 6};  // [2][3]
  REQUIRE(budget_offsets(cmat(m, 2, 3), 1, cu.data()).ok());
  CHECK(std::vector<std::int32_t>(cu.begin(), cu.begin() + 4) == std::vector<std::int32_t>{0, 4, 9, 15});
  REQUIRE(budget_offsets(nullptr, 0, cu.data()).ok());
  CHECK(cu[0] == 0);

  const std::vector<std::int32_t> neg = {1, -1};
  require_error(budget_offsets(neg.data(), 2, cu.data()), errc::invalid_argument, "budgets[1] = -1 is negative");
  const std::vector<std::int32_t> big = {INT32_MAX, 1};
  require_error(budget_offsets(big.data(), 2, cu.data()), errc::size_overflow, "int32 offsets");
  require_error(budget_offsets(b.data(), -1, cu.data()), errc::invalid_argument, "negative");
  require_error(budget_offsets(b.data(), 4, nullptr), errc::null_pointer, "cu is null");
  require_error(budget_offsets(nullptr, 2, cu.data()), errc::null_pointer, "budgets is null");
  std::vector<std::int32_t> same = {1, 2, 3, 4, 5};
  require_error(budget_offsets(same.data(), 4, same.data()), errc::overlap, "overlap");
  require_error(budget_offsets(cmat(m, 2, 3), 2, cu.data()), errc::out_of_range, "layer 2 is outside [0, 2)");
  const std::vector<std::int32_t> mneg = {1, 2, -3};
  require_error(budget_offsets(cmat(mneg, 1, 3), 0, cu.data()), errc::invalid_argument, "budgets[0][2] = -3");
}

TEST_CASE("apportion: exact totals, caps, floor/ceil of the water-filled quotas, ties to the lower index") {
  std::vector<index_t> out(4);
  // ties: equal weights, remainders equal -> lower indices first
  std::vector<double> w3 = {1, 1, 1};
  std::vector<index_t> c3 = {100, 100, 100};
  REQUIRE(apportion(4, w3.data(), c3.data(), 3, out.data()).ok());
  CHECK(std::vector<index_t>(out.begin(), out.begin() + 3) == std::vector<index_t>{2, 1, 1});
  std::vector<double> w4 = {1, 1, 1, 1};
  REQUIRE(apportion(2, w4.data(), nullptr, 4, out.data()).ok());
  CHECK(out == std::vector<index_t>{1, 1, 0, 0});
  // largest remainder: quotas 10 * (0.45, 0.35, 0.2) = 4.5, 3.5, 2 -> 5, 3, 2? no: floors 4,3,2 -> 1 left -> 0.5 vs 0.5 tie -> index 0
  std::vector<double> w = {0.45, 0.35, 0.2};
  REQUIRE(apportion(10, w.data(), nullptr, 3, out.data()).ok());
  CHECK(std::vector<index_t>(out.begin(), out.begin() + 3) == std::vector<index_t>{5, 3, 2});
  // water-filling: layer 0 wants 8.3 but holds 2; the other 8 are shared 4 / 4
  std::vector<double> wf = {10, 1, 1};
  std::vector<index_t> cf = {2, 100, 100};
  REQUIRE(apportion(10, wf.data(), cf.data(), 3, out.data()).ok());
  CHECK(std::vector<index_t>(out.begin(), out.begin() + 3) == std::vector<index_t>{2, 4, 4});
  // all-zero weights share equally
  std::vector<double> z = {0, 0, 0};
  REQUIRE(apportion(7, z.data(), nullptr, 3, out.data()).ok());
  CHECK(std::vector<index_t>(out.begin(), out.begin() + 3) == std::vector<index_t>{3, 2, 2});
  // zero weight next to positive ones gets nothing
  std::vector<double> zp = {0, 2, 1};
  REQUIRE(apportion(6, zp.data(), nullptr, 3, out.data()).ok());
  CHECK(std::vector<index_t>(out.begin(), out.begin() + 3) == std::vector<index_t>{0, 4, 2});

  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t n = uniform_int(g, 1, 12);
    std::vector<double> wt(static_cast<std::size_t>(n));
    std::vector<index_t> caps(static_cast<std::size_t>(n));
    index_t cap_sum = 0;
    for (index_t i = 0; i < n; ++i) {
      const auto k = uniform_int(g, 0, 9);
      wt[static_cast<std::size_t>(i)] = k == 0 ? 0.0 : (k == 1 ? 1.0 : static_cast<double>(uniform_int(g, 1, 1000000)) * 1e-4);
      caps[static_cast<std::size_t>(i)] = uniform_int(g, 0, 3) == 0 ? uniform_int(g, 0, 5) : uniform_int(g, 0, 5000);
      cap_sum += caps[static_cast<std::size_t>(i)];
    }
    const index_t target = uniform_int(g, 0, cap_sum);
    std::vector<index_t> x(static_cast<std::size_t>(n), -9);
    REQUIRE(apportion(target, wt.data(), caps.data(), n, x.data()).ok());
    const auto q = naive_quotas(target, wt, caps);
    index_t sum = 0;
    for (index_t i = 0; i < n; ++i) {
      const auto xi = x[static_cast<std::size_t>(i)];
      const long double qi = q[static_cast<std::size_t>(i)];
      CAPTURE(i);
      CHECK(xi >= 0);
      CHECK(xi <= caps[static_cast<std::size_t>(i)]);
      CHECK(static_cast<long double>(xi) >= std::floor(qi - 1e-9L));
      CHECK(static_cast<long double>(xi) <= std::ceil(qi + 1e-9L));
      sum += xi;
    }
    CHECK(sum == target);
  }

  std::vector<double> bad = {1, qnan};
  require_error(apportion(3, bad.data(), nullptr, 2, out.data()), errc::invalid_argument, "weights[1] = nan");
  std::vector<double> badneg = {1, -1};
  require_error(apportion(3, badneg.data(), nullptr, 2, out.data()), errc::invalid_argument, "weights[1] = -1");
  std::vector<double> binf = {inf};
  require_error(apportion(3, binf.data(), nullptr, 1, out.data()), errc::invalid_argument, "finite");
  std::vector<index_t> small = {1, 1};
  require_error(apportion(3, w4.data(), small.data(), 2, out.data()), errc::invalid_argument, "above the 2 tokens");
  std::vector<index_t> negcap = {1, -1};
  require_error(apportion(0, w4.data(), negcap.data(), 2, out.data()), errc::invalid_argument, "caps[1] = -1");
  require_error(apportion(-1, w4.data(), nullptr, 2, out.data()), errc::invalid_argument, "target -1 is negative");
  require_error(apportion(1, w4.data(), nullptr, 0, out.data()), errc::invalid_argument, "nothing to share");
  require_error(apportion(1, nullptr, nullptr, 2, out.data()), errc::null_pointer, "weights is null");
  require_error(apportion(1, w4.data(), nullptr, 2, nullptr), errc::null_pointer, "out is null");
}

// ================================================================================================
TEST_CASE("uniform_budgets: exact totals, remainder to the first heads, errors") {
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t L = uniform_int(g, 1, 6), H = uniform_int(g, 1, 5), N = uniform_int(g, 1, 300);
    const protection p{uniform_int(g, 0, 4), uniform_int(g, 0, 8)};
    const index_t W = protected_count(N, p.n_sink, p.n_recent);
    const index_t total = uniform_int(g, W * L * H, N * L * H);
    std::vector<std::int32_t> out(static_cast<std::size_t>(L * H), -1);
    REQUIRE(uniform_budgets(total, N, p, mat(out, L, H)).ok());
    index_t sum = 0;
    const index_t base = total / (L * H), extra = total % (L * H);
    for (index_t i = 0; i < L * H; ++i) {
      CHECK(out[static_cast<std::size_t>(i)] == base + (i < extra ? 1 : 0));
      CHECK(out[static_cast<std::size_t>(i)] >= W);
      CHECK(out[static_cast<std::size_t>(i)] <= N);
      sum += out[static_cast<std::size_t>(i)];
    }
    CHECK(sum == total);
  }
  std::vector<std::int32_t> out(8, -1);
  const protection p{4, 16};
  require_error(uniform_budgets(4 * 19, 100, p, mat(out, 2, 4)), errc::invalid_argument,
                "budget 9 is below the 20 protected tokens");
  CHECK(out[0] == -1);  // nothing written
  require_error(uniform_budgets(8 * 101, 100, p, mat(out, 2, 4)), errc::invalid_argument, "budget 101 is above the prompt");
  require_error(uniform_budgets(8 * 100 + 1, 100, p, mat(out, 2, 4)), errc::invalid_argument, "above the prompt");
  require_error(uniform_budgets(-8, 100, p, mat(out, 2, 4)), errc::invalid_argument, "total budget -8 is negative");
  require_error(uniform_budgets(8, 100, p, mat(out, 0, 4)), errc::invalid_argument, "0 layers");
  require_error(uniform_budgets(8, 100, p, mat(out, 2, 0)), errc::invalid_argument, "0 KV heads");
  require_error(uniform_budgets(8, 0, p, mat(out, 2, 4)), errc::invalid_argument, "prompt_length = 0");
  require_error(uniform_budgets(8, 100, protection{-1, 0}, mat(out, 2, 4)), errc::invalid_argument, "n_sink = -1");
}

// ================================================================================================
TEST_CASE("pyramid_budgets: KVCache-Factory's formula against its transcription; exact rounding is exact") {
  for (std::uint64_t seed = 1; seed <= 600; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t L = uniform_int(g, 1, 40), H = uniform_int(g, 1, 4);
    const index_t w = uniform_int(g, 0, 40), N = uniform_int(g, std::max<index_t>(1, w), 3000);
    const index_t beta = seed % 3 == 0 ? 20 : uniform_int(g, 1, 30);
    const index_t B = uniform_int(g, std::min(N, w), seed % 5 == 0 ? N + 50 : N);
    pyramid_options opt;
    opt.beta = beta;
    opt.prot = {0, w};
    std::vector<std::int32_t> out(static_cast<std::size_t>(L * H), -1);
    CAPTURE(L);
    CAPTURE(N);
    CAPTURE(B);
    CAPTURE(w);
    CAPTURE(beta);
    // KVCache-Factory, bit for bit (for L >= 2: it divides by L - 1)
    opt.rounding = pyramid_rounding::kvcache_factory;
    REQUIRE(pyramid_budgets(B, N, opt, mat(out, L, H)).ok());
    const index_t W = protected_count(N, 0, w);
    for (index_t l = 0; l < L; ++l)
      for (index_t h = 0; h < H; ++h) {
        const index_t expect = L >= 2 ? kvcf_pyramid(B, W, beta, L, l, N) : (N < B ? N : B);
        CHECK(out[static_cast<std::size_t>(l * H + h)] == expect);
      }
    // exact
    opt.rounding = pyramid_rounding::exact;
    const status st = pyramid_budgets(B, N, opt, mat(out, L, H));
    if (B > N) {
      require_error(st, errc::invalid_argument, "above the prompt");
      continue;
    }
    REQUIRE(st.ok());
    index_t sum = 0;
    const index_t P = B - W;
    index_t mn = P / beta, mx = 2 * P - mn;
    if (mx >= N - W) {
      mx = N - W;
      mn = 2 * P - mx;
    }
    for (index_t l = 0; l < L; ++l) {
      const std::int32_t b = out[static_cast<std::size_t>(l * H)];
      for (index_t h = 0; h < H; ++h) CHECK(out[static_cast<std::size_t>(l * H + h)] == b);
      CHECK(b >= W);
      CHECK(b <= N);
      if (l > 0) CHECK(b <= out[static_cast<std::size_t>((l - 1) * H)]);  // non-increasing
      if (N >= 2 * P && L > 1) {
        const double q = static_cast<double>(W) + static_cast<double>(mx) -
                         static_cast<double>(l) * static_cast<double>(mx - mn) / static_cast<double>(L - 1);
        CHECK(static_cast<double>(b) >= std::floor(q - 1e-9));
        CHECK(static_cast<double>(b) <= std::ceil(q + 1e-9));
      } else {
        CHECK(b == B);
      }
      sum += static_cast<index_t>(b) * H;
    }
    CHECK(sum == B * H * L);
  }
}

TEST_CASE("pyramid_budgets: how far KVCache-Factory's integer steps are from B x H x L (printed)") {
  struct example {
    index_t B, w, L, N;
  };
  for (const example e : {example{128, 32, 32, 8192}, example{256, 32, 32, 8192}, example{1024, 64, 32, 32768},
                          example{128, 8, 28, 4096}, example{96, 32, 80, 16384}}) {
    pyramid_options opt;
    opt.prot = {0, e.w};
    std::vector<std::int32_t> kvcf(static_cast<std::size_t>(e.L)), exact(static_cast<std::size_t>(e.L));
    opt.rounding = pyramid_rounding::kvcache_factory;
    REQUIRE(pyramid_budgets(e.B, e.N, opt, mat(kvcf, e.L, 1)).ok());
    opt.rounding = pyramid_rounding::exact;
    REQUIRE(pyramid_budgets(e.B, e.N, opt, mat(exact, e.L, 1)).ok());
    const index_t s_kvcf = std::accumulate(kvcf.begin(), kvcf.end(), index_t(0));
    const index_t s_exact = std::accumulate(exact.begin(), exact.end(), index_t(0));
    CHECK(s_exact == e.B * e.L);
    CHECK(s_kvcf >= e.B * e.L);
    CHECK(s_kvcf - e.B * e.L < e.L * (e.L - 1) / 2 + 1);
    std::printf("pyramid B=%lld w=%lld L=%lld N=%lld: per head, requested %lld, exact %lld, KVCache-Factory %lld "
                "(+%.1f%%), layers %d..%d vs %d..%d\n",
                static_cast<long long>(e.B), static_cast<long long>(e.w), static_cast<long long>(e.L),
                static_cast<long long>(e.N), static_cast<long long>(e.B * e.L), static_cast<long long>(s_exact),
                static_cast<long long>(s_kvcf), 100.0 * static_cast<double>(s_kvcf - e.B * e.L) / static_cast<double>(e.B * e.L),
                kvcf.front(), kvcf.back(), exact.front(), exact.back());
  }
}

TEST_CASE("pyramid_budgets: regimes and errors") {
  std::vector<std::int32_t> out(4 * 2, -1);
  pyramid_options opt;
  opt.prot = {0, 8};
  // N < 2 P: uniform B
  REQUIRE(pyramid_budgets(64, 100, opt, mat(out, 4, 2)).ok());
  for (auto b : out) CHECK(b == 64);
  // one layer keeps B
  REQUIRE(pyramid_budgets(64, 1000, opt, mat(out, 1, 2)).ok());
  CHECK(out[0] == 64);
  // kvcache_factory with a prompt shorter than B keeps it all
  opt.rounding = pyramid_rounding::kvcache_factory;
  REQUIRE(pyramid_budgets(64, 40, opt, mat(out, 4, 2)).ok());
  for (auto b : out) CHECK(b == 40);
  opt.rounding = pyramid_rounding::exact;
  std::fill(out.begin(), out.end(), -1);
  require_error(pyramid_budgets(64, 40, opt, mat(out, 4, 2)), errc::invalid_argument, "budget 64 is above the prompt");
  CHECK(out[0] == -1);
  require_error(pyramid_budgets(7, 400, opt, mat(out, 4, 2)), errc::invalid_argument, "budget 7 is below the 8 protected");
  require_error(pyramid_budgets(-1, 400, opt, mat(out, 4, 2)), errc::invalid_argument, "budget -1 is negative");
  require_error(pyramid_budgets(64, 400, opt, mat(out, 0, 2)), errc::invalid_argument, "0 layers");
  require_error(pyramid_budgets(64, 400, opt, mat(out, 4, 0)), errc::invalid_argument, "0 KV heads");
  opt.beta = 0;
  require_error(pyramid_budgets(64, 400, opt, mat(out, 4, 2)), errc::invalid_argument, "beta = 0");
  opt.beta = 20;
  opt.rounding = static_cast<pyramid_rounding>(7);
  require_error(pyramid_budgets(64, 400, opt, mat(out, 4, 2)), errc::invalid_argument, "unknown pyramid_rounding");
}

// ================================================================================================
namespace {

template <class Backend>
void adakv_matches_reference(Backend be, std::uint64_t seed0) {
  for (std::uint64_t seed = seed0; seed < seed0 + 150; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t H = uniform_int(g, 1, 8), T = uniform_int(g, 1, 200);
    const protection p{uniform_int(g, 0, 3), uniform_int(g, 0, 12)};
    const bool ragged = seed % 3 == 0;
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(H), static_cast<std::int32_t>(T));
    if (ragged)
      for (auto& l : lengths) l = static_cast<std::int32_t>(uniform_int(g, 0, T));
    auto s = random_scores(g, H, T, static_cast<int>(seed));
    protect_scores(s, H, T, p, ragged ? lengths.data() : nullptr);
    index_t sum_len = 0, max_prot = 0;
    for (index_t h = 0; h < H; ++h) {
      sum_len += lengths[static_cast<std::size_t>(h)];
      max_prot = std::max(max_prot, protected_count(lengths[static_cast<std::size_t>(h)], p.n_sink, p.n_recent));
    }
    if (max_prot > sum_len / H) continue;  // no valid budget
    const index_t B = uniform_int(g, max_prot, sum_len / H);
    adakv_options opt;
    opt.prot = p;
    opt.alpha = seed % 4 == 0 ? 0.0 : (seed % 4 == 1 ? 1.0 : static_cast<double>(uniform_int(g, 0, 100)) / 100.0);
    opt.floor = seed % 2 == 0 ? adakv_floor::budget : adakv_floor::evictable;
    CAPTURE(H);
    CAPTURE(T);
    CAPTURE(B);
    CAPTURE(opt.alpha);
    workspace ws;
    std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1), -1);
    std::vector<pos_t> pos(static_cast<std::size_t>(B * H) + 1, -1);
    const std::int32_t* lp = ragged ? lengths.data() : nullptr;
    REQUIRE(adakv_budgets(be, ws, cmat(s, H, T), lp, B, opt, cu.data(), pos.data()).ok());
    std::vector<unsigned char> buf;
    workspace w2 = alloc_ws(buf, ws.bytes);
    REQUIRE(adakv_budgets(be, w2, cmat(s, H, T), lp, B, opt, cu.data(), pos.data()).ok());

    std::vector<std::vector<float>> rows(static_cast<std::size_t>(H));
    std::vector<index_t> len(static_cast<std::size_t>(H));
    std::vector<index_t> floors(static_cast<std::size_t>(H));
    for (index_t h = 0; h < H; ++h) {
      rows[static_cast<std::size_t>(h)].assign(s.begin() + h * T, s.begin() + (h + 1) * T);
      len[static_cast<std::size_t>(h)] = lengths[static_cast<std::size_t>(h)];
      const index_t W = protected_count(len[static_cast<std::size_t>(h)], p.n_sink, p.n_recent);
      // the floor rule, spelled out
      index_t f = opt.floor == adakv_floor::budget
                      ? static_cast<index_t>(std::floor(opt.alpha * static_cast<double>(B) + 1e-9))
                      : W + static_cast<index_t>(std::floor(opt.alpha * static_cast<double>(B - W) + 1e-9));
      f = std::min({f, B, len[static_cast<std::size_t>(h)]});
      floors[static_cast<std::size_t>(h)] = f;
    }
    const auto ref = naive_flat(rows, len, B * H, floors);
    CHECK(cu[static_cast<std::size_t>(H)] == B * H);  // exact total
    for (index_t h = 0; h < H; ++h) {
      CAPTURE(h);
      const auto& r = ref[static_cast<std::size_t>(h)];
      const index_t c = cu[static_cast<std::size_t>(h + 1)] - cu[static_cast<std::size_t>(h)];
      CHECK(c >= floors[static_cast<std::size_t>(h)]);  // floor respected
      CHECK(c >= protected_count(len[static_cast<std::size_t>(h)], p.n_sink, p.n_recent));
      REQUIRE(static_cast<std::size_t>(c) == r.size());
      CHECK(std::equal(r.begin(), r.end(), pos.begin() + cu[static_cast<std::size_t>(h)]));
      // kept outscore dropped (ties by position)
      std::vector<bool> kept(static_cast<std::size_t>(len[static_cast<std::size_t>(h)]), false);
      for (pos_t q : r) kept[static_cast<std::size_t>(q)] = true;
      for (index_t a = 0; a < len[static_cast<std::size_t>(h)]; ++a)
        for (index_t b = 0; b < len[static_cast<std::size_t>(h)]; ++b)
          if (kept[static_cast<std::size_t>(a)] && !kept[static_cast<std::size_t>(b)])
            CHECK(ranks_before(rows[static_cast<std::size_t>(h)][static_cast<std::size_t>(a)], 0, a,
                               rows[static_cast<std::size_t>(h)][static_cast<std::size_t>(b)], 0, b));
    }
    // counts only
    std::vector<std::int32_t> cu2(static_cast<std::size_t>(H + 1), -1);
    REQUIRE(adakv_budgets(be, w2, cmat(s, H, T), lp, B, opt, cu2.data(), nullptr).ok());
    CHECK(cu2 == cu);
  }
}

}  // namespace

TEST_CASE("adakv_budgets: matches the naive full sort over (score, head, position) with floors, seq and par") {
  adakv_matches_reference(seq, 1);
  adakv_matches_reference(par_t{3}, 1000);
}

TEST_CASE("adakv_budgets: errors") {
  const index_t H = 3, T = 20;
  auto g = kvtest::rng(5);
  auto s = random_scores(g, H, T, 0);
  const protection p{2, 4};
  protect_scores(s, H, T, p);
  adakv_options opt;
  opt.prot = p;
  std::vector<std::int32_t> cu(H + 1, -1);
  std::vector<pos_t> pos(100, -1);
  std::vector<unsigned char> buf;
  workspace q;
  REQUIRE(adakv_budgets(seq, q, cmat(s, H, T), nullptr, 10, opt, cu.data(), pos.data()).ok());
  workspace ws = alloc_ws(buf, q.bytes);
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 5, opt, cu.data(), pos.data()), errc::invalid_argument,
                "budget 5 is below the 6 protected tokens of head 0");
  CHECK(cu[0] == -1);
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, -1, opt, cu.data(), pos.data()), errc::invalid_argument,
                "budget -1 is negative");
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 21, opt, cu.data(), pos.data()), errc::invalid_argument,
                "above the prompt");
  require_error(adakv_budgets(seq, ws, cmat(s, 0, T), nullptr, 0, opt, cu.data(), pos.data()), errc::invalid_argument,
                "0 heads");
  adakv_options o2 = opt;
  o2.alpha = 1.5;
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 10, o2, cu.data(), pos.data()), errc::invalid_argument,
                "alpha = 1.5");
  o2.alpha = std::nan("");
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 10, o2, cu.data(), pos.data()), errc::invalid_argument,
                "alpha = nan");
  o2 = opt;
  o2.floor = static_cast<adakv_floor>(9);
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 10, o2, cu.data(), pos.data()), errc::invalid_argument,
                "unknown adakv_floor");
  o2 = opt;
  o2.prot.n_recent = 5;  // scores protect 4 recent tokens, not 5
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 10, o2, cu.data(), pos.data()), errc::invalid_argument,
                "run protect()");
  auto s2 = s;
  s2[7] = inf;
  require_error(adakv_budgets(seq, ws, cmat(s2, H, T), nullptr, 10, opt, cu.data(), pos.data()), errc::invalid_argument,
                "+inf outside the protected positions");
  const std::vector<std::int32_t> badlen = {20, 21, 3};
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), badlen.data(), 10, opt, cu.data(), pos.data()), errc::out_of_range,
                "outside [0, 20]");
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 10, opt, nullptr, pos.data()), errc::null_pointer,
                "kept_cu is null");
  workspace small = ws;
  small.bytes = q.bytes - 1;
  require_error(adakv_budgets(seq, small, cmat(s, H, T), nullptr, 10, opt, cu.data(), pos.data()),
                errc::workspace_too_small, "adakv_budgets: workspace has");
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 10, opt, cu.data(),
                              reinterpret_cast<pos_t*>(buf.data())),
                errc::overlap, "overlap");
  require_error(adakv_budgets(seq, ws, cmat(s, H, T), nullptr, 10, opt, cu.data(), reinterpret_cast<pos_t*>(s.data())),
                errc::overlap, "overlap");
}

// ================================================================================================
TEST_CASE("lava_layer_entropy: Eq. 7-8 over the unprotected entries, both normalisations, seq == par") {
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t H = seed % 10 == 0 ? uniform_int(g, 60, 150) : uniform_int(g, 1, 6), T = uniform_int(g, 1, 120);
    const protection p{uniform_int(g, 0, 3), uniform_int(g, 0, 10)};
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(H), static_cast<std::int32_t>(T));
    const bool ragged = seed % 2 == 0;
    if (ragged)
      for (auto& l : lengths) l = static_cast<std::int32_t>(uniform_int(g, 0, T));
    std::vector<float> s(static_cast<std::size_t>(H * T));
    for (auto& x : s) x = uniform_int(g, 0, 5) == 0 ? 0.0f : static_cast<float>(uniform_int(g, 1, 100000)) * 1e-5f;
    protect_scores(s, H, T, p, ragged ? lengths.data() : nullptr);
    // naive: collect the entries, normalise, entropy in long double
    std::vector<long double> e;
    for (index_t h = 0; h < H; ++h) {
      const index_t len = lengths[static_cast<std::size_t>(h)];
      for (index_t t = 0; t < len; ++t)
        if (t >= p.n_sink && t < len - p.n_recent) e.push_back(s[static_cast<std::size_t>(h * T + t)]);
    }
    long double S = 0, ent = 0;
    for (auto v : e) S += v;
    for (auto v : e)
      if (v > 0) ent -= (v / S) * std::log(v / S);
    for (const entropy_norm norm : {entropy_norm::log_count, entropy_norm::count}) {
      lava_entropy_options opt;
      opt.prot = p;
      opt.norm = norm;
      double got = -1;
      REQUIRE(lava_layer_entropy(seq, cmat(s, H, T), ragged ? lengths.data() : nullptr, opt, &got).ok());
      double got_par = -2;
      REQUIRE(lava_layer_entropy(par_t{3}, cmat(s, H, T), ragged ? lengths.data() : nullptr, opt, &got_par).ok());
      CHECK(std::memcmp(&got, &got_par, sizeof got) == 0);  // identical bits
      long double expect = 0;
      const auto M = static_cast<long double>(e.size());
      if (!e.empty() && S > 0 && !(norm == entropy_norm::log_count && e.size() <= 1))
        expect = norm == entropy_norm::log_count ? ent / std::log(M) : ent / M;
      CHECK(std::fabs(static_cast<long double>(got) - expect) <= 1e-12L * (1 + expect));
      if (norm == entropy_norm::log_count) {
        CHECK(got >= 0.0);
        CHECK(got <= 1.0 + 1e-12);
      }
    }
  }
  // uniform scores: normalised entropy 1 (log_count)
  std::vector<float> u(3 * 10, 0.25f);
  double e = 0;
  REQUIRE(lava_layer_entropy(seq, cmat(u, 3, 10), nullptr, {}, &e).ok());
  CHECK(e == doctest::Approx(1.0).epsilon(1e-12));
  // one dominant entry: 0
  std::vector<float> d(3 * 10, 0.0f);
  d[4] = 2.0f;
  REQUIRE(lava_layer_entropy(seq, cmat(d, 3, 10), nullptr, {}, &e).ok());
  CHECK(e == 0.0);
  std::vector<float> zeros(3 * 10, 0.0f);
  REQUIRE(lava_layer_entropy(seq, cmat(zeros, 3, 10), nullptr, {}, &e).ok());
  CHECK(e == 0.0);

  auto bad = u;
  bad[5] = qnan;
  require_error(lava_layer_entropy(seq, cmat(bad, 3, 10), nullptr, {}, &e), errc::invalid_argument, "scores[0][5] = nan");
  bad[5] = -1.0f;
  require_error(lava_layer_entropy(seq, cmat(bad, 3, 10), nullptr, {}, &e), errc::invalid_argument, "scores[0][5] = -1");
  bad[5] = inf;
  require_error(lava_layer_entropy(seq, cmat(bad, 3, 10), nullptr, {}, &e), errc::invalid_argument, "scores[0][5] = inf");
  lava_entropy_options prot_opt;
  prot_opt.prot = {0, 5};
  REQUIRE(lava_layer_entropy(seq, cmat(bad, 3, 10), nullptr, prot_opt, &e).ok());  // position 5 protected: ignored
  require_error(lava_layer_entropy(seq, cmat(u, 0, 10), nullptr, {}, &e), errc::invalid_argument, "0 heads");
  require_error(lava_layer_entropy(seq, cmat(u, 3, 10), nullptr, {}, nullptr), errc::null_pointer, "entropy is null");
  const std::vector<std::int32_t> badlen = {1, 11, 2};
  require_error(lava_layer_entropy(seq, cmat(u, 3, 10), badlen.data(), {}, &e), errc::out_of_range, "lengths[1] = 11");
  lava_entropy_options bn;
  bn.norm = static_cast<entropy_norm>(3);
  require_error(lava_layer_entropy(seq, cmat(u, 3, 10), nullptr, bn, &e), errc::invalid_argument, "unknown entropy_norm");
}

TEST_CASE("lava_layer_budgets: exact, proportional to the entropies within the rounding rule, capped") {
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t L = uniform_int(g, 1, 32), H = uniform_int(g, 1, 8), N = uniform_int(g, 1, 2000);
    const protection p{uniform_int(g, 0, 4), uniform_int(g, 0, 32)};
    const index_t W = protected_count(N, p.n_sink, p.n_recent);
    const index_t total = uniform_int(g, L * H * W, L * H * N);
    std::vector<double> e(static_cast<std::size_t>(L));
    for (auto& x : e) x = seed % 7 == 0 ? 0.0 : static_cast<double>(uniform_int(g, 0, 1000000)) * 1e-6;
    std::vector<index_t> out(static_cast<std::size_t>(L), -1);
    REQUIRE(lava_layer_budgets(e.data(), L, H, N, p, total, out.data()).ok());
    const auto q = naive_quotas(total - L * H * W, e, std::vector<index_t>(static_cast<std::size_t>(L), H * (N - W)));
    index_t sum = 0;
    for (index_t l = 0; l < L; ++l) {
      const index_t share = out[static_cast<std::size_t>(l)] - H * W;
      CHECK(share >= 0);
      CHECK(share <= H * (N - W));
      CHECK(static_cast<long double>(share) >= std::floor(q[static_cast<std::size_t>(l)] - 1e-9L));
      CHECK(static_cast<long double>(share) <= std::ceil(q[static_cast<std::size_t>(l)] + 1e-9L));
      sum += out[static_cast<std::size_t>(l)];
    }
    CHECK(sum == total);
  }
  std::vector<double> e = {0.5, qnan, 0.2};
  std::vector<index_t> out(3, -1);
  require_error(lava_layer_budgets(e.data(), 3, 2, 100, {}, 300, out.data()), errc::invalid_argument,
                "entropy of layer 1 is nan");
  CHECK(out[0] == -1);
  e[1] = -0.1;
  require_error(lava_layer_budgets(e.data(), 3, 2, 100, {}, 300, out.data()), errc::invalid_argument,
                "entropy of layer 1 is -0.1");
  e[1] = 0.1;
  require_error(lava_layer_budgets(e.data(), 3, 2, 100, protection{0, 10}, 59, out.data()), errc::invalid_argument,
                "total budget 59 is below the 60 protected tokens");
  require_error(lava_layer_budgets(e.data(), 3, 2, 100, {}, 601, out.data()), errc::invalid_argument, "above the prompt");
  require_error(lava_layer_budgets(e.data(), 3, 2, 100, {}, -1, out.data()), errc::invalid_argument, "negative");
  require_error(lava_layer_budgets(e.data(), 0, 2, 100, {}, 0, out.data()), errc::invalid_argument, "0 layers");
  require_error(lava_layer_budgets(e.data(), 3, 0, 100, {}, 0, out.data()), errc::invalid_argument, "0 KV heads");
  require_error(lava_layer_budgets(nullptr, 3, 2, 100, {}, 30, out.data()), errc::null_pointer, "entropy is null");
  require_error(lava_layer_budgets(e.data(), 3, 2, 100, {}, 30, nullptr), errc::null_pointer, "layer_totals is null");
}

// ================================================================================================
namespace {

// Cascading against the definition: after every step, each layer holds exactly what selecting its
// current budget directly from its ORIGINAL scores gives.
template <class Backend>
void cascade_matches_reselection(Backend be, cascade_split split, std::uint64_t seed0, int trials, double* worst_dev) {
  for (std::uint64_t seed = seed0; seed < seed0 + static_cast<std::uint64_t>(trials); ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    cascade_config cfg;
    cfg.layers = uniform_int(g, 1, 9);
    cfg.heads = uniform_int(g, 1, 5);
    cfg.prompt_length = uniform_int(g, 1, 90);
    cfg.prot = {uniform_int(g, 0, 2), uniform_int(g, 0, 6)};
    cfg.split = split;
    const index_t L = cfg.layers, H = cfg.heads, N = cfg.prompt_length;
    const index_t W = protected_count(N, cfg.prot.n_sink, cfg.prot.n_recent);
    if (split == cascade_split::flattened) cfg.total = uniform_int(g, L * H * W, L * H * N);
    else cfg.total = H * uniform_int(g, L * W, L * N);
    CAPTURE(L);
    CAPTURE(H);
    CAPTURE(N);
    CAPTURE(cfg.total);
    const std::size_t bytes = value_of(layer_cascade::state_bytes(cfg));
    std::vector<unsigned char> mem(bytes);
    layer_cascade c;
    REQUIRE(c.init(cfg, mem.data(), bytes).ok());

    std::vector<std::vector<float>> scores(static_cast<std::size_t>(L));
    std::vector<double> weights(static_cast<std::size_t>(L));
    std::vector<index_t> prev_total(static_cast<std::size_t>(L), 0);
    std::vector<std::vector<pos_t>> prev_pos(static_cast<std::size_t>(L));
    std::vector<std::int32_t> prev_cu;
    const index_t E = split == cascade_split::flattened ? cfg.total - L * H * W : cfg.total / H - L * W;
    std::vector<unsigned char> wsbuf;
    for (index_t m = 0; m < L; ++m) {
      CAPTURE(m);
      auto& s = scores[static_cast<std::size_t>(m)];
      s = random_scores(g, H, N, static_cast<int>(seed + static_cast<std::uint64_t>(m)) % 3);  // no NaN: entropy
      protect_scores(s, H, N, cfg.prot);
      if (split == cascade_split::flattened) {
        lava_entropy_options eo;
        eo.prot = cfg.prot;
        REQUIRE(lava_layer_entropy(seq, cmat(s, H, N), nullptr, eo, &weights[static_cast<std::size_t>(m)]).ok());
      } else {
        weights[static_cast<std::size_t>(m)] = uniform_int(g, 0, 6) == 0 ? 0.0 : static_cast<double>(uniform_int(g, 1, 1000));
      }
      workspace q;
      REQUIRE(c.add_layer(be, q, m, cmat(s, H, N), weights[static_cast<std::size_t>(m)]).ok());
      CHECK(c.layers_added() == m);  // a query changes nothing
      workspace ws = alloc_ws(wsbuf, q.bytes);
      REQUIRE(c.add_layer(be, ws, m, cmat(s, H, N), weights[static_cast<std::size_t>(m)]).ok());
      REQUIRE(c.layers_added() == m + 1);
      // step total: min(E, held caps) + the protected tokens of the layers so far
      index_t caps = 0;
      for (index_t j = 0; j < m; ++j)
        caps += split == cascade_split::flattened ? prev_total[static_cast<std::size_t>(j)] - H * W
                                                  : prev_total[static_cast<std::size_t>(j)] / H - W;
      caps += split == cascade_split::flattened ? H * (N - W) : N - W;
      const index_t unit = split == cascade_split::flattened ? 1 : H;
      CHECK(c.held_total() == (std::min(E, caps) + (m + 1) * W * (split == cascade_split::flattened ? H : 1)) * unit);
      for (index_t j = 0; j <= m; ++j) {
        CAPTURE(j);
        const index_t tot = c.layer_total(j);
        if (j < m) CHECK(tot <= prev_total[static_cast<std::size_t>(j)]);  // never grows back
        CHECK(tot >= H * W);
        const ragged_positions held = c.positions(j);
        const ragged_positions kept = c.kept(j);
        const float* hs = c.held_scores(j);
        const auto& orig = scores[static_cast<std::size_t>(j)];
        // the definition: select the current budget from the original scores
        std::vector<std::vector<pos_t>> ref;
        if (split == cascade_split::flattened) {
          std::vector<std::vector<float>> rows(static_cast<std::size_t>(H));
          for (index_t h = 0; h < H; ++h) rows[static_cast<std::size_t>(h)].assign(orig.begin() + h * N, orig.begin() + (h + 1) * N);
          ref = naive_flat(rows, std::vector<index_t>(static_cast<std::size_t>(H), N), tot, {});
        } else {
          REQUIRE(tot % H == 0);
          for (index_t h = 0; h < H; ++h)
            ref.push_back(naive_topk(std::vector<float>(orig.begin() + h * N, orig.begin() + (h + 1) * N), N, tot / H));
        }
        for (index_t h = 0; h < H; ++h) {
          CAPTURE(h);
          const auto& r = ref[static_cast<std::size_t>(h)];
          REQUIRE(static_cast<std::size_t>(held.length(h)) == r.size());
          CHECK(std::equal(r.begin(), r.end(), held.pos + held.cu[h]));
          for (index_t i = 0; i < held.length(h); ++i)
            CHECK(std::memcmp(&hs[held.cu[h] + i], &orig[static_cast<std::size_t>(h * N + held.pos[held.cu[h] + i])],
                              sizeof(float)) == 0);
          // kept: prompt positions for the new layer, indices into the previous rows otherwise
          REQUIRE(kept.length(h) == held.length(h));
          for (index_t i = 0; i < kept.length(h); ++i) {
            const pos_t k = kept.pos[kept.cu[h] + i];
            if (j == m) CHECK(k == held.pos[held.cu[h] + i]);
            else {
              const auto& pp = prev_pos[static_cast<std::size_t>(j)];
              const std::size_t at = static_cast<std::size_t>(prev_cu[static_cast<std::size_t>(j * (H + 1) + h)] + k);
              REQUIRE(at < pp.size());
              CHECK(pp[at] == held.pos[held.cu[h] + i]);
            }
          }
        }
        if (j < m && !c.changed(j)) CHECK(tot == prev_total[static_cast<std::size_t>(j)]);
      }
      // remember this step
      prev_cu.assign(static_cast<std::size_t>(L * (H + 1)), 0);
      for (index_t j = 0; j <= m; ++j) {
        prev_total[static_cast<std::size_t>(j)] = c.layer_total(j);
        const ragged_positions held = c.positions(j);
        prev_pos[static_cast<std::size_t>(j)].assign(held.pos, held.pos + held.cu[H]);
        for (index_t h = 0; h <= H; ++h) prev_cu[static_cast<std::size_t>(j * (H + 1) + h)] = held.cu[h];
      }
    }
    CHECK(c.held_total() == cfg.total);  // exact at the end
    // deviation of the final budgets from the one-shot allocation over all layers (printed)
    std::vector<index_t> oneshot(static_cast<std::size_t>(L));
    if (split == cascade_split::flattened) {
      REQUIRE(lava_layer_budgets(weights.data(), L, H, N, cfg.prot, cfg.total, oneshot.data()).ok());
    } else {
      std::vector<std::int32_t> b(static_cast<std::size_t>(L * H));
      REQUIRE(cake_budgets(weights.data(), cfg.total / (H * L), N, cfg.prot, mat(b, L, H)).ok());
      for (index_t l = 0; l < L; ++l) oneshot[static_cast<std::size_t>(l)] = b[static_cast<std::size_t>(l * H)] * H;
    }
    for (index_t l = 0; l < L; ++l) {
      const double dev = std::fabs(static_cast<double>(c.layer_total(l) - oneshot[static_cast<std::size_t>(l)])) /
                         static_cast<double>(split == cascade_split::flattened ? 1 : H);
      *worst_dev = std::max(*worst_dev, dev);
    }
  }
}

}  // namespace

TEST_CASE("layer_cascade: cascading equals re-selecting each layer's budget from its original scores (LAVa, CAKE)") {
  double dev_flat = 0, dev_head = 0;
  cascade_matches_reselection(seq, cascade_split::flattened, 1, 120, &dev_flat);
  cascade_matches_reselection(par_t{2}, cascade_split::flattened, 5000, 40, &dev_flat);
  cascade_matches_reselection(seq, cascade_split::per_head, 9000, 120, &dev_head);
  cascade_matches_reselection(par_t{3}, cascade_split::per_head, 12000, 40, &dev_head);
  std::printf("layer_cascade: largest |final cascade budget - one-shot budget| of a layer: %.0f tokens (LAVa, layer "
              "total), %.0f tokens per head (CAKE)\n",
              dev_flat, dev_head);
}

TEST_CASE("layer_cascade: a worked example and the memory bound") {
  // 3 layers, 2 heads, 10 tokens, 2 recent protected; 48 tokens in all (8 per head on average)
  cascade_config cfg;
  cfg.layers = 3;
  cfg.heads = 2;
  cfg.prompt_length = 10;
  cfg.prot = {0, 2};
  cfg.total = 48;
  const std::size_t bytes = value_of(layer_cascade::state_bytes(cfg));
  std::vector<unsigned char> mem(bytes + 3);
  layer_cascade c;
  REQUIRE(c.init(cfg, mem.data() + 3, bytes).ok());  // any alignment
  std::vector<unsigned char> wsbuf;
  std::vector<float> s(20);
  for (index_t l = 0; l < 3; ++l) {
    for (int i = 0; i < 20; ++i) s[static_cast<std::size_t>(i)] = static_cast<float>((i * 7 + l * 3) % 11);
    protect_scores(s, 2, 10, cfg.prot);
    workspace q;
    REQUIRE(c.add_layer(seq, q, l, cmat(s, 2, 10), 1.0).ok());
    workspace ws = alloc_ws(wsbuf, q.bytes);
    REQUIRE(c.add_layer(seq, ws, l, cmat(s, 2, 10), 1.0).ok());
    CHECK(c.held_total() <= cfg.total);
  }
  // equal weights: the 48 - 12 = 36 evictable tokens split 12 / 12 / 12
  for (index_t l = 0; l < 3; ++l) CHECK(c.layer_total(l) == 16);
  // layers 0 and 1 kept everything at their own steps (16 + 16 evictable tokens <= 36); the third
  // step shares the 36 evictable tokens 12 / 12 / 12, so layers 0 and 1 shrank (changed)
  CHECK(c.changed(0));
  CHECK(c.changed(1));
  CHECK(c.changed(2));
  CHECK(c.kept(3).heads == 0);  // not a layer
  CHECK(c.positions(-1).heads == 0);
  CHECK(c.held_scores(7) == nullptr);
  CHECK(c.layer_total(9) == 0);
  CHECK(c.weight(1) == 1.0);
}

TEST_CASE("layer_cascade: errors") {
  cascade_config cfg;
  cfg.layers = 2;
  cfg.heads = 2;
  cfg.prompt_length = 10;
  cfg.prot = {1, 2};
  cfg.total = 20;
  const std::size_t bytes = value_of(layer_cascade::state_bytes(cfg));
  std::vector<unsigned char> mem(bytes);
  layer_cascade c;
  std::vector<float> s(20, 0.5f);
  protect_scores(s, 2, 10, cfg.prot);
  workspace q;
  require_error(c.add_layer(seq, q, 0, cmat(s, 2, 10), 1.0), errc::invalid_argument, "not initialised");

  auto bad = cfg;
  bad.layers = 0;
  require_error(layer_cascade::state_bytes(bad).error(), errc::invalid_argument, "0 layers");
  bad = cfg;
  bad.heads = 0;
  require_error(c.init(bad, mem.data(), bytes), errc::invalid_argument, "0 KV heads");
  bad = cfg;
  bad.total = 11;
  require_error(c.init(bad, mem.data(), bytes), errc::invalid_argument, "total budget 11 is below the 12 protected");
  bad.total = 41;
  require_error(c.init(bad, mem.data(), bytes), errc::invalid_argument, "above the prompt");
  bad.total = -1;
  require_error(c.init(bad, mem.data(), bytes), errc::invalid_argument, "negative");
  bad = cfg;
  bad.split = cascade_split::per_head;
  bad.total = 21;
  require_error(c.init(bad, mem.data(), bytes), errc::invalid_argument, "not a multiple of the 2 heads");
  bad = cfg;
  bad.split = static_cast<cascade_split>(4);
  require_error(c.init(bad, mem.data(), bytes), errc::invalid_argument, "unknown cascade_split");
  bad = cfg;
  bad.prompt_length = 0;
  require_error(c.init(bad, mem.data(), bytes), errc::invalid_argument, "prompt_length = 0");
  bad = cfg;
  bad.heads = 1 << 20;
  bad.prompt_length = 1 << 12;
  require_error(c.init(bad, mem.data(), bytes), errc::invalid_argument, "int32 offsets");
  require_error(c.init(cfg, nullptr, bytes), errc::null_pointer, "memory is null");
  require_error(c.init(cfg, mem.data(), bytes - 1), errc::workspace_too_small, "state_bytes");

  REQUIRE(c.init(cfg, mem.data(), bytes).ok());
  REQUIRE(c.add_layer(seq, q, 0, cmat(s, 2, 10), 1.0).ok());
  std::vector<unsigned char> wsbuf;
  workspace ws = alloc_ws(wsbuf, q.bytes);
  require_error(c.add_layer(seq, ws, 1, cmat(s, 2, 10), 1.0), errc::invalid_argument, "layer 1 given, expected layer 0");
  require_error(c.add_layer(seq, ws, 0, cmat(s, 2, 10), std::nan("")), errc::invalid_argument,
                "weight (entropy / preference) of layer 0 is nan");
  require_error(c.add_layer(seq, ws, 0, cmat(s, 2, 10), -1.0), errc::invalid_argument, "is -1");
  require_error(c.add_layer(seq, ws, 0, cmat(s, 2, 10), inf), errc::invalid_argument, "is inf");
  require_error(c.add_layer(seq, ws, 0, cmat(s, 1, 10), 1.0), errc::shape_mismatch, "expected [2 heads][10 tokens]");
  auto unprot = s;
  unprot[9] = 0.1f;
  require_error(c.add_layer(seq, ws, 0, cmat(unprot, 2, 10), 1.0), errc::invalid_argument, "run protect()");
  workspace small = ws;
  small.bytes = q.bytes - 1;
  require_error(c.add_layer(seq, small, 0, cmat(s, 2, 10), 1.0), errc::workspace_too_small, "workspace has");
  workspace inside;
  inside.data = mem.data();
  inside.bytes = q.bytes;
  require_error(c.add_layer(seq, inside, 0, cmat(s, 2, 10), 1.0), errc::overlap, "the cascade's memory");
  CHECK(c.layers_added() == 0);  // nothing happened
  REQUIRE(c.add_layer(seq, ws, 0, cmat(s, 2, 10), 1.0).ok());
  REQUIRE(c.add_layer(seq, ws, 1, cmat(s, 2, 10), 1.0).ok());
  require_error(c.add_layer(seq, ws, 2, cmat(s, 2, 10), 1.0), errc::invalid_argument,
                "layer 2 given, but all 2 layers were added already");
}

// ================================================================================================
namespace {

// Softmax rows: random attention probabilities [R][w][C] with zeros.
std::vector<float> random_attention(std::mt19937_64& g, index_t R, index_t w, index_t C) {
  std::vector<float> a(static_cast<std::size_t>(R * w * C));
  for (index_t r = 0; r < R; ++r)
    for (index_t i = 0; i < w; ++i) {
      double sum = 0;
      for (index_t j = 0; j < C; ++j) {
        const double e = uniform_int(g, 0, 4) == 0 ? 0.0 : std::exp(static_cast<double>(uniform_int(g, -3000, 3000)) * 1e-3);
        a[static_cast<std::size_t>((r * w + i) * C + j)] = static_cast<float>(e);
        sum += e;
      }
      sum += 1.0;  // the window columns take the rest
      for (index_t j = 0; j < C; ++j) a[static_cast<std::size_t>((r * w + i) * C + j)] = static_cast<float>(a[static_cast<std::size_t>((r * w + i) * C + j)] / sum);
    }
  return a;
}

}  // namespace

TEST_CASE("cake_layer_stats / cake_preference: against the naive sums; seq == par bit for bit") {
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t R = uniform_int(g, 1, 140), w = uniform_int(g, 1, 9), C = uniform_int(g, 0, 50);
    const auto a = random_attention(g, R, w, C);
    // a token-major copy ([w][R][C] in memory): any strides
    std::vector<float> tm(a.size());
    for (index_t r = 0; r < R; ++r)
      for (index_t i = 0; i < w; ++i)
        for (index_t j = 0; j < C; ++j) tm[static_cast<std::size_t>((i * R + r) * C + j)] = a[static_cast<std::size_t>((r * w + i) * C + j)];
    for (const variance_estimator ve : {variance_estimator::unbiased, variance_estimator::biased}) {
      long double H = 0, V = 0;
      for (index_t r = 0; r < R; ++r) {
        for (index_t i = 0; i < w; ++i)
          for (index_t j = 0; j < C; ++j) {
            const long double p = a[static_cast<std::size_t>((r * w + i) * C + j)];
            if (p > 0) H -= p * std::log(p);
          }
        for (index_t j = 0; j < C; ++j) {
          long double mean = 0;
          for (index_t i = 0; i < w; ++i) mean += a[static_cast<std::size_t>((r * w + i) * C + j)];
          mean /= static_cast<long double>(w);
          long double m2 = 0;
          for (index_t i = 0; i < w; ++i) {
            const long double d = a[static_cast<std::size_t>((r * w + i) * C + j)] - mean;
            m2 += d * d;
          }
          if (ve == variance_estimator::biased) V += m2 / static_cast<long double>(w);
          else if (w > 1) V += m2 / static_cast<long double>(w - 1);
        }
      }
      cake_stats s1, s2, s3;
      const auto view = value_of(make_kv_view(static_cast<const float*>(a.data()), R, w, C));
      const auto tview = value_of(make_kv_view(static_cast<const float*>(tm.data()), R, w, C, std::max<index_t>(C, 1),
                                                  R * std::max<index_t>(C, 1), 1));
      REQUIRE(cake_layer_stats(seq, view, &s1, ve).ok());
      REQUIRE(cake_layer_stats(par_t{3}, view, &s2, ve).ok());
      REQUIRE(cake_layer_stats(par_t{2}, tview, &s3, ve).ok());
      CHECK(std::memcmp(&s1, &s2, sizeof s1) == 0);
      CHECK(std::memcmp(&s1, &s3, sizeof s1) == 0);
      CHECK(std::fabs(static_cast<long double>(s1.entropy) - H) <= 1e-12L * (1 + H));
      CHECK(std::fabs(static_cast<long double>(s1.variance) - V) <= 1e-9L * (1e-12L + V));
      double p = 0;
      cake_options o;
      o.tau1 = 0.5;
      o.tau2 = 2.0;
      REQUIRE(cake_preference(s1, o, &p).ok());
      CHECK(p == doctest::Approx(std::pow(s1.entropy, 2.0) * std::sqrt(s1.variance)).epsilon(1e-14));
    }
  }
  std::vector<float> a(2 * 3 * 4, 0.1f);
  auto v = value_of(make_kv_view(static_cast<const float*>(a.data()), 2, 3, 4));
  cake_stats st;
  a[13] = 1.5f;
  require_error(cake_layer_stats(seq, v, &st), errc::invalid_argument, "attention[1][0][1] = 1.5 is not a probability");
  a[13] = -0.1f;
  require_error(cake_layer_stats(seq, v, &st), errc::invalid_argument, "= -0.1 is not a probability");
  a[13] = qnan;
  require_error(cake_layer_stats(par, v, &st), errc::invalid_argument, "= nan is not a probability");
  require_error(cake_layer_stats(seq, v, nullptr), errc::null_pointer, "out is null");
  require_error(cake_layer_stats(seq, v, &st, static_cast<variance_estimator>(5)), errc::invalid_argument,
                "unknown variance_estimator");
  double p = 0;
  require_error(cake_preference({1.0, 1.0}, {0.0, 1.0}, &p), errc::invalid_argument, "tau1 = 0");
  require_error(cake_preference({1.0, 1.0}, {1.0, inf}, &p), errc::invalid_argument, "tau2 = inf");
  require_error(cake_preference({std::nan(""), 1.0}, {}, &p), errc::invalid_argument, "entropy = nan");
  require_error(cake_preference({1.0, -2.0}, {}, &p), errc::invalid_argument, "variance = -2");
  require_error(cake_preference({1e300, 1.0}, {0.1, 1.0}, &p), errc::invalid_argument, "overflows");
  require_error(cake_preference({1.0, 1.0}, {}, nullptr), errc::null_pointer, "pref is null");
}

namespace {

// The documented definitions of the entropy kernels (detail/host/entropy_host.hpp), written out
// scalar: 8 lanes, entry k to lane k mod 8, lanes combined ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
double model_lanes(const double* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

cake_stats model_cake(const std::vector<float>& a, index_t R, index_t w, index_t C, variance_estimator ve) {
  cake_stats out;
  const index_t dn = ve == variance_estimator::biased ? w : w - 1;
  for (index_t r = 0; r < R; ++r) {
    double ent[8] = {}, var[8] = {};
    for (index_t j0 = 0; j0 < C; j0 += detail::cake_block) {
      const index_t j1 = std::min(C, j0 + detail::cake_block);
      for (index_t i = 0; i < w; ++i)
        for (index_t j = j0; j < j1; ++j) {
          const float p = a[static_cast<std::size_t>((r * w + i) * C + j)];
          if (p > 0.0f) ent[j % 8] -= static_cast<double>(p) * detail::entropy_log(p);
        }
      if (dn > 0)
        for (index_t j = j0; j < j1; ++j) {
          double mean = 0;
          for (index_t i = 0; i < w; ++i) mean += static_cast<double>(a[static_cast<std::size_t>((r * w + i) * C + j)]);
          mean /= static_cast<double>(w);
          double m2 = 0;
          for (index_t i = 0; i < w; ++i) {
            const double d = static_cast<double>(a[static_cast<std::size_t>((r * w + i) * C + j)]) - mean;
            m2 += d * d;
          }
          var[j % 8] += m2 / static_cast<double>(dn);
        }
    }
    out.entropy += model_lanes(ent);
    out.variance += model_lanes(var);
  }
  return out;
}

double model_lava(const std::vector<float>& s, index_t H, index_t T, const protection& p) {
  double S = 0;
  index_t M = 0;
  for (index_t h = 0; h < H; ++h) {
    index_t b = 0, e = 0;
    detail::lava_range(T, p, &b, &e);
    double l[8] = {};
    for (index_t t = b; t < e; ++t) l[(t - b) % 8] += static_cast<double>(s[static_cast<std::size_t>(h * T + t)]);
    S += model_lanes(l);
    M += e - b;
  }
  if (M <= 1 || !(S > 0.0)) return 0.0;
  const double inv_s = 1.0 / S, log_s = detail::entropy_log(S);
  double acc = 0;
  for (index_t h = 0; h < H; ++h) {
    index_t b = 0, e = 0;
    detail::lava_range(T, p, &b, &e);
    double l[8] = {};
    for (index_t t = b; t < e; ++t) {
      const float v = s[static_cast<std::size_t>(h * T + t)];
      if (v > 0.0f) l[(t - b) % 8] += (static_cast<double>(v) * inv_s) * (detail::entropy_log(v) - log_s);
    }
    acc += model_lanes(l);
  }
  return acc < 0.0 ? -acc / std::log(static_cast<double>(M)) : 0.0;
}

}  // namespace

TEST_CASE("entropy kernels: entropy_log within 2 ulp of log; cake_layer_stats and lava_layer_entropy equal their "
          "documented scalar definitions on every ISA copy, seq and par") {
  // the logarithm over floats of every binade (subnormals included) and doubles
  auto g = kvtest::rng(77);
  std::uniform_int_distribution<std::uint32_t> bits(1u, 0x7f7fffffu);
  long double worst = 0;
  for (int k = 0; k < 200000; ++k) {
    const float x = detail::bits_float(k < 64 ? static_cast<std::uint32_t>(k + 1) : bits(g));
    const long double ref = std::log(static_cast<long double>(x));
    const double got = detail::entropy_log(x);
    const long double ulp = std::ldexp(1.0L, std::ilogb(static_cast<double>(ref)) - 52);
    worst = std::max(worst, std::fabs(static_cast<long double>(got) - ref) / ulp);
    const double xd = static_cast<double>(x) * 1.2345678901234567e5;
    const long double refd = std::log(static_cast<long double>(xd));
    const long double ulpd = std::ldexp(1.0L, std::ilogb(static_cast<double>(refd)) - 52);
    worst = std::max(worst, std::fabs(static_cast<long double>(detail::entropy_log(xd)) - refd) / ulpd);
  }
  CHECK(worst <= 2.0L);
  CHECK(detail::entropy_log(1.0f) == 0.0);
  CHECK(detail::entropy_log(1.0) == 0.0);
  // the kernels: random shapes crossing the 256-column blocks and the 8-lane tails, zeros, -0 and
  // subnormal probabilities; every profile the CPU has (the override picks a lower one)
  const int best = static_cast<int>(host_isa_supported());
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    CAPTURE(seed);
    auto r = kvtest::rng(seed);
    const index_t R = uniform_int(r, 1, 5), w = uniform_int(r, 1, 7), C = uniform_int(r, 0, 700);
    auto a = random_attention(r, R, w, C);
    for (std::size_t k = 0; k < a.size(); k += 7) a[k] = k % 3 == 0 ? 0.0f : k % 3 == 1 ? -0.0f : 1e-41f;
    const index_t H = uniform_int(r, 1, 5), T = uniform_int(r, 0, 900);
    std::vector<float> s(static_cast<std::size_t>(H * T));
    for (auto& x : s) x = uniform_int(r, 0, 4) == 0 ? 0.0f : static_cast<float>(uniform_int(r, 1, 1000000)) * 1e-3f;
    if (!s.empty()) s[0] = 3e-42f;
    const protection pr{uniform_int(r, 0, 4), uniform_int(r, 0, 20)};
    protect_scores(s, H, T, pr, nullptr);
    lava_entropy_options lo;
    lo.prot = pr;
    const auto view = value_of(make_kv_view(static_cast<const float*>(a.data()), R, w, C));
    for (const variance_estimator ve : {variance_estimator::unbiased, variance_estimator::biased}) {
      const cake_stats want = model_cake(a, R, w, C, ve);
      for (int isa = 0; isa <= best; ++isa) {
        CAPTURE(isa);
        const host_isa_limit_guard limit(kvtest::isa_level(isa));
        cake_stats got, got_par;
        REQUIRE(cake_layer_stats(seq, view, &got, ve).ok());
        REQUIRE(cake_layer_stats(par_t{2}, view, &got_par, ve).ok());
        CHECK(std::memcmp(&got.entropy, &want.entropy, sizeof(double)) == 0);
        CHECK(std::memcmp(&got.variance, &want.variance, sizeof(double)) == 0);
        CHECK(std::memcmp(&got, &got_par, sizeof got) == 0);
        double e = -1, e_par = -2;
        REQUIRE(lava_layer_entropy(seq, cmat(s, H, T), nullptr, lo, &e).ok());
        REQUIRE(lava_layer_entropy(par_t{2}, cmat(s, H, T), nullptr, lo, &e_par).ok());
        const double we = model_lava(s, H, T, pr);
        CHECK(std::memcmp(&e, &we, sizeof e) == 0);
        CHECK(std::memcmp(&e, &e_par, sizeof e) == 0);
      }
    }
  }
}

#if KVEVICT_HOST_X86_DISPATCH
namespace {
namespace ev = detail::entropy_vec;
/// The (m, e) of 8 chains of floats by the AVX-512F split (getmant / getexp) and by the generic one.
__attribute__((target("avx512f,avx2"))) void split_avx512(const float* x, double* m, double* e) {
  ev::vd8 v[ev::chains], mm[ev::chains], ee[ev::chains];
  __mmask16 bad = 0;
  ev::split_chains_avx512<false>(x, v, mm, ee, bad);
  std::memcpy(m, mm, sizeof mm);
  std::memcpy(e, ee, sizeof ee);
}
void split_generic(const float* x, double* m, double* e) {
  ev::vd8 v[ev::chains], mm[ev::chains], ee[ev::chains];
  ev::vi8 bad{};
  ev::split_chains<false>(x, v, mm, ee, bad);
  std::memcpy(m, mm, sizeof mm);
  std::memcpy(e, ee, sizeof ee);
}
}  // namespace

TEST_CASE("entropy kernels: the AVX-512F split (getmant / getexp) gives entropy_log(float)'s m and e: every float "
          "of [0.5, 1), every 3rd subnormal, every binade, +-0") {
  if (host_isa_supported() != host_isa::avx512) return;  // (no AVX-512F here: nothing to compare)
  constexpr int n = 8 * ev::chains;
  std::vector<std::uint32_t> bits;
  for (std::uint32_t m = 0; m < 0x800000u; ++m) bits.push_back(0x3f000000u | m);        // [0.5, 1): CAKE's and LAVa's p
  for (std::uint32_t m = 1; m < 0x800000u; m += 3) bits.push_back(m);                   // subnormals
  for (std::uint32_t ex = 1; ex < 255; ++ex)
    for (std::uint32_t m : {0u, 1u, 0x3504f2u, 0x3504f3u, 0x3504f4u, 0x400000u, 0x7ffffeu, 0x7fffffu})
      bits.push_back(ex << 23 | m);                                                    // binades, sqrt(2)'s split
  bits.push_back(0u);
  bits.push_back(0x80000000u);
  while (bits.size() % n != 0) bits.push_back(0x3f800000u);
  float x[n];
  double m1[n], e1[n], m2[n], e2[n];
  std::size_t wrong = 0, first = 0;
  for (std::size_t k = 0; k < bits.size(); k += n) {
    for (int l = 0; l < n; ++l) x[l] = detail::bits_float(bits[k + static_cast<std::size_t>(l)]);
    split_avx512(x, m1, e1);
    split_generic(x, m2, e2);
    for (int l = 0; l < n; ++l) {
      const double want = detail::entropy_log(x[l] > 0.0f ? x[l] : 1.0f);
      const double got = detail::entropy_log_reduced(m1[l], e1[l]);
      if (std::memcmp(&m1[l], &m2[l], sizeof(double)) != 0 || std::memcmp(&e1[l], &e2[l], sizeof(double)) != 0 ||
          std::memcmp(&got, &want, sizeof got) != 0)
        if (wrong++ == 0) first = k + static_cast<std::size_t>(l);
    }
  }
  CAPTURE(bits[first]);
  CHECK(wrong == 0);
}
#endif

TEST_CASE("cake_budgets: exact B x H x L, proportional to the preferences within the rounding rule, errors") {
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t L = uniform_int(g, 1, 40), H = uniform_int(g, 1, 8), N = uniform_int(g, 1, 4000);
    const protection p{uniform_int(g, 0, 4), uniform_int(g, 0, 64)};
    const index_t W = protected_count(N, p.n_sink, p.n_recent);
    const index_t B = uniform_int(g, W, N);
    std::vector<double> pref(static_cast<std::size_t>(L));
    for (auto& x : pref) x = static_cast<double>(uniform_int(g, 0, 100000)) * 1e-2;
    std::vector<std::int32_t> out(static_cast<std::size_t>(L * H), -1);
    REQUIRE(cake_budgets(pref.data(), B, N, p, mat(out, L, H)).ok());
    const auto q = naive_quotas(L * (B - W), pref, std::vector<index_t>(static_cast<std::size_t>(L), N - W));
    index_t sum = 0;
    for (index_t l = 0; l < L; ++l) {
      const auto b = out[static_cast<std::size_t>(l * H)];
      for (index_t h = 0; h < H; ++h) CHECK(out[static_cast<std::size_t>(l * H + h)] == b);
      CHECK(b >= W);
      CHECK(b <= N);
      CHECK(static_cast<long double>(b - W) >= std::floor(q[static_cast<std::size_t>(l)] - 1e-9L));
      CHECK(static_cast<long double>(b - W) <= std::ceil(q[static_cast<std::size_t>(l)] + 1e-9L));
      sum += b * H;
    }
    CHECK(sum == B * H * L);
  }
  std::vector<double> pref = {1, 2, qnan};
  std::vector<std::int32_t> out(6, -1);
  require_error(cake_budgets(pref.data(), 50, 100, {}, mat(out, 3, 2)), errc::invalid_argument,
                "preference of layer 2 is nan");
  CHECK(out[0] == -1);
  pref[2] = 3;
  require_error(cake_budgets(pref.data(), 101, 100, {}, mat(out, 3, 2)), errc::invalid_argument, "above the prompt");
  require_error(cake_budgets(pref.data(), 9, 100, protection{4, 6}, mat(out, 3, 2)), errc::invalid_argument,
                "below the 10 protected");
  require_error(cake_budgets(pref.data(), -2, 100, {}, mat(out, 3, 2)), errc::invalid_argument, "negative");
  require_error(cake_budgets(pref.data(), 50, 100, {}, mat(out, 0, 2)), errc::invalid_argument, "0 layers");
  require_error(cake_budgets(pref.data(), 50, 100, {}, mat(out, 3, 0)), errc::invalid_argument, "0 KV heads");
  require_error(cake_budgets(nullptr, 50, 100, {}, mat(out, 3, 2)), errc::null_pointer, "preference is null");
}

// ================================================================================================
TEST_CASE("duo_budgets: retrieval heads keep the prompt (or a budget), streaming heads exactly sink + recent") {
  for (std::uint64_t seed = 1; seed <= 100; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t L = uniform_int(g, 1, 6), H = uniform_int(g, 1, 5), N = uniform_int(g, 1, 300);
    duo_options opt;
    opt.streaming = {uniform_int(g, 0, 8), uniform_int(g, 0, 40)};
    const index_t S = protected_count(N, opt.streaming.n_sink, opt.streaming.n_recent);
    if (seed % 2 == 0) opt.retrieval_budget = uniform_int(g, S, N);
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(L * H));
    for (auto& m : mask) m = static_cast<std::uint8_t>(uniform_int(g, 0, 1));
    std::vector<std::int32_t> out(static_cast<std::size_t>(L * H), -1);
    index_t total = -1;
    REQUIRE(duo_budgets(cmat(mask, L, H), N, opt, mat(out, L, H), &total).ok());
    index_t sum = 0;
    for (std::size_t i = 0; i < mask.size(); ++i) {
      CHECK(out[i] == (mask[i] ? (opt.retrieval_budget < 0 ? N : opt.retrieval_budget) : S));
      sum += out[i];
    }
    CHECK(sum == total);
    // streaming positions are exactly the first n_sink and the last n_recent
    std::vector<pos_t> sp(static_cast<std::size_t>(S) + 1, -1);
    REQUIRE(value_of(streaming_positions(N, opt.streaming, sp.data())) == S);
    std::vector<pos_t> expect;
    for (index_t t = 0; t < N; ++t)
      if (t < opt.streaming.n_sink || t >= N - opt.streaming.n_recent) expect.push_back(static_cast<pos_t>(t));
    CHECK(std::equal(expect.begin(), expect.end(), sp.begin()));
    CHECK(expect.size() == static_cast<std::size_t>(S));
    // composition: protected scores + duo budgets -> select_topk keeps exactly those on streaming heads
    auto s = random_scores(g, L * H, N, 0);
    protect_scores(s, L * H, N, opt.streaming);
    std::vector<std::int32_t> cu(static_cast<std::size_t>(L * H + 1));
    REQUIRE(budget_offsets(out.data(), L * H, cu.data()).ok());
    std::vector<pos_t> kept(static_cast<std::size_t>(cu.back()) + 1);
    workspace q;
    REQUIRE(select_topk(seq, q, cmat(s, L * H, N), nullptr, ragged_positions_out{kept.data(), cu.data(), L * H}).ok());
    std::vector<unsigned char> buf;
    workspace ws = alloc_ws(buf, q.bytes);
    REQUIRE(select_topk(seq, ws, cmat(s, L * H, N), nullptr, ragged_positions_out{kept.data(), cu.data(), L * H}).ok());
    for (std::size_t i = 0; i < mask.size(); ++i)
      if (!mask[i]) CHECK(std::equal(expect.begin(), expect.end(), kept.begin() + cu[i]));
  }
}

TEST_CASE("duo_budgets: float and PruLong masks, total-budget mapping, errors") {
  // PruLong's top-k mask from log alphas, then budgets; the mapping from a total
  const index_t L = 4, H = 2, N = 1000;
  duo_options opt;
  opt.streaming = {16, 64};
  std::vector<float> la = {3, -1, 0.5f, 2, -4, 1, 0, 5};
  for (index_t total = L * H * 80; total <= L * H * N; total += 777) {
    CAPTURE(total);
    const index_t k = value_of(duo_retrieval_heads(total, L, H, N, opt));
    CHECK(k * N + (L * H - k) * 80 <= total);
    if (k < L * H) CHECK((k + 1) * N + (L * H - k - 1) * 80 > total);
    std::vector<float> mask(static_cast<std::size_t>(L * H));
    REQUIRE(prulong_topk_mask(cmat(la, L, H), k, mat(mask, L, H)).ok());
    std::vector<std::int32_t> out(static_cast<std::size_t>(L * H));
    index_t got = 0;
    REQUIRE(duo_budgets(cmat(mask, L, H), N, opt, mat(out, L, H), &got).ok());
    CHECK(got == k * N + (L * H - k) * 80);
    CHECK(got <= total);
  }
  CHECK(value_of(duo_retrieval_heads(L * H * N + 5, L, H, N, opt)) == L * H);

  std::vector<float> mask(8, 1.0f), mask_bad = mask;
  std::vector<std::int32_t> out(8, -1);
  require_error(duo_budgets(cmat(mask, 4, 2), N, opt, mat(out, 2, 4)), errc::shape_mismatch,
                "mask is [4][2] but the budgets are [2 layers][4 heads]");
  mask_bad[3] = 1.5f;
  require_error(duo_budgets(cmat(mask_bad, 4, 2), N, opt, mat(out, 4, 2)), errc::invalid_argument,
                "mask[1][1] = 1.5 is outside [0, 1]");
  mask_bad[3] = -0.25f;
  require_error(duo_budgets(cmat(mask_bad, 4, 2), N, opt, mat(out, 4, 2)), errc::invalid_argument, "outside [0, 1]");
  mask_bad[3] = qnan;
  require_error(duo_budgets(cmat(mask_bad, 4, 2), N, opt, mat(out, 4, 2)), errc::invalid_argument, "outside [0, 1]");
  mask_bad[3] = 0.5f;
  require_error(duo_budgets(cmat(mask_bad, 4, 2), N, opt, mat(out, 4, 2)), errc::invalid_argument,
                "neither 0 (streaming) nor 1 (retrieval)");
  CHECK(out[0] == -1);
  require_error(duo_budgets(cmat(mask, 0, 2), N, opt, mat(out, 0, 2)), errc::invalid_argument, "0 layers");
  require_error(duo_budgets(cmat(mask, 4, 0), N, opt, mat(out, 4, 0)), errc::invalid_argument, "0 KV heads");
  duo_options o2 = opt;
  o2.retrieval_budget = 50;
  require_error(duo_budgets(cmat(mask, 4, 2), N, o2, mat(out, 4, 2)), errc::invalid_argument,
                "budget 50 is below the 80 protected");
  o2.retrieval_budget = N + 1;
  require_error(duo_budgets(cmat(mask, 4, 2), N, o2, mat(out, 4, 2)), errc::invalid_argument, "above the prompt");
  o2.retrieval_budget = -3;
  require_error(duo_budgets(cmat(mask, 4, 2), N, o2, mat(out, 4, 2)), errc::invalid_argument, "budget -3 is negative");
  require_error(duo_budgets(cmat(mask, 4, 2), 0, opt, mat(out, 4, 2)), errc::invalid_argument, "prompt_length = 0");
  require_error(duo_budgets(cmat(mask, 4, 2), N, duo_options{{-1, 0}, -1}, mat(out, 4, 2)), errc::invalid_argument,
                "n_sink = -1");
  require_error(duo_retrieval_heads(L * H * 80 - 1, L, H, N, opt).error(), errc::invalid_argument,
                "below the 640 tokens of 8 streaming heads");
  require_error(duo_retrieval_heads(-1, L, H, N, opt).error(), errc::invalid_argument, "negative");
  require_error(duo_retrieval_heads(100, 0, H, N, opt).error(), errc::invalid_argument, "0 layers");
  require_error(streaming_positions(N, opt.streaming, nullptr).error(), errc::null_pointer, "out is null");
  require_error(streaming_positions(0, opt.streaming, nullptr).error(), errc::invalid_argument, "prompt_length = 0");
}

// ================================================================================================
// docs/budget.md's examples, compiled and run.
TEST_CASE("docs example: SnapKV scores + AdaKV budgets, then compact into a ragged cache") {
  auto g = kvtest::rng(77);
  const index_t Hq = 4, Hkv = 2, T = 64, d = 8, w = 8, B = 20;
  const auto qv = kvtest::random_floats(g, static_cast<std::size_t>(Hq * w * d));
  const auto kv = kvtest::random_floats(g, static_cast<std::size_t>(Hkv * T * d));
  const auto vv = kvtest::random_floats(g, static_cast<std::size_t>(Hkv * T * d));
  const auto queries = value_of(make_kv_view(qv.data(), Hq, w, d));  // the last w prompt tokens' queries
  const auto keys = value_of(make_kv_view(kv.data(), Hkv, T, d));
  const auto values = value_of(make_kv_view(vv.data(), Hkv, T, d));

  std::vector<float> sq(static_cast<std::size_t>(Hq * T)), s(static_cast<std::size_t>(Hkv * T)),
      sp(static_cast<std::size_t>(Hkv * T));
  std::vector<unsigned char> buf;
  workspace ws;
  // 1. window scores over every column (the window's own columns too, so they can be protected)
  REQUIRE(window_scores(seq, ws, queries, keys, mat(sq, Hq, T)).ok());
  ws = alloc_ws(buf, ws.bytes);
  REQUIRE(window_scores(seq, ws, queries, keys, mat(sq, Hq, T)).ok());
  // 2. one selection per KV head, 3. pooling, 4. the window is always kept
  REQUIRE(gqa_reduce(seq, cmat(sq, Hq, T), mat(s, Hkv, T), gqa_op::mean).ok());
  REQUIRE(pool1d(seq, cmat(s, Hkv, T), mat(sp, Hkv, T), pool_kind::max, 7).ok());
  REQUIRE(protect(seq, mat(sp, Hkv, T), 0, w).ok());
  // 5. AdaKV: B x Hkv tokens for the layer, floors of 0.2 B per head
  adakv_options opt;
  opt.prot = {0, w};
  std::vector<std::int32_t> cu(static_cast<std::size_t>(Hkv + 1));
  std::vector<pos_t> pos(static_cast<std::size_t>(B * Hkv));
  workspace ws2;
  REQUIRE(adakv_budgets(seq, ws2, cmat(sp, Hkv, T), nullptr, B, opt, cu.data(), pos.data()).ok());
  std::vector<unsigned char> buf2;
  ws2 = alloc_ws(buf2, ws2.bytes);
  REQUIRE(adakv_budgets(seq, ws2, cmat(sp, Hkv, T), nullptr, B, opt, cu.data(), pos.data()).ok());
  // 6. gather the kept rows into a ragged cache (K shown; V is the same call)
  std::vector<float> kc(static_cast<std::size_t>(B * Hkv * d));
  ragged_view<float> kout{kc.data(), cu.data(), Hkv, d, d};
  REQUIRE(compact(seq, keys, ragged_positions{pos.data(), cu.data(), Hkv}, kout).ok());
  (void)values;
  CHECK(cu[Hkv] == B * Hkv);
  for (index_t h = 0; h < Hkv; ++h) {
    CHECK(cu[h + 1] - cu[h] >= static_cast<std::int32_t>(std::floor(0.2 * B)));
    for (index_t t = T - w; t < T; ++t)  // the window is kept
      CHECK(std::find(pos.begin() + cu[h], pos.begin() + cu[h + 1], static_cast<pos_t>(t)) != pos.begin() + cu[h + 1]);
  }
}

TEST_CASE("docs example: LAVa end to end, one layer at a time, with cascading") {
  auto g = kvtest::rng(78);
  const index_t L = 3, Hq = 4, Hkv = 2, T = 48, d = 8, w = 6, B = 16;
  cascade_config cfg;
  cfg.layers = L;
  cfg.heads = Hkv;
  cfg.prompt_length = T;
  cfg.prot = {0, w};
  cfg.total = B * Hkv * L;
  cfg.split = cascade_split::flattened;
  std::vector<unsigned char> mem(value_of(layer_cascade::state_bytes(cfg)));
  layer_cascade cascade;
  REQUIRE(cascade.init(cfg, mem.data(), mem.size()).ok());

  // the engine's ragged caches (keys only here), sized for the prompt
  std::vector<std::vector<float>> cache(L, std::vector<float>(static_cast<std::size_t>(Hkv * T * d)));
  std::vector<std::vector<std::int32_t>> cap_cu(L), lens(L, std::vector<std::int32_t>(Hkv));
  std::vector<std::vector<float>> prompt_keys(L);
  std::vector<unsigned char> wsbuf, wsbuf2;
  for (index_t l = 0; l < L; ++l) {
    // prefill layer l (the engine): queries of the window, keys, values
    const auto qv = kvtest::random_floats(g, static_cast<std::size_t>(Hq * w * d));
    prompt_keys[static_cast<std::size_t>(l)] = kvtest::random_floats(g, static_cast<std::size_t>(Hkv * T * d));
    const auto vv = kvtest::random_floats(g, static_cast<std::size_t>(Hkv * T * d));
    const auto queries = value_of(make_kv_view(qv.data(), Hq, w, d));
    const auto keys = value_of(make_kv_view(prompt_keys[static_cast<std::size_t>(l)].data(), Hkv, T, d));
    const auto values = value_of(make_kv_view(vv.data(), Hkv, T, d));
    // LAVa scores: window scores -> GQA max -> pool -> head-max value weighting -> protect
    std::vector<float> sq(static_cast<std::size_t>(Hq * T)), s(static_cast<std::size_t>(Hkv * T)),
        sp(static_cast<std::size_t>(Hkv * T));
    workspace ws;
    REQUIRE(window_scores(seq, ws, queries, keys, mat(sq, Hq, T)).ok());
    ws = alloc_ws(wsbuf, ws.bytes);
    REQUIRE(window_scores(seq, ws, queries, keys, mat(sq, Hq, T)).ok());
    REQUIRE(gqa_reduce(seq, cmat(sq, Hq, T), mat(s, Hkv, T), gqa_op::max).ok());
    REQUIRE(pool1d(seq, cmat(s, Hkv, T), mat(sp, Hkv, T), pool_kind::max, 7).ok());
    REQUIRE(weight_by_value_norm(seq, mat(sp, Hkv, T), values, value_weight::head_max).ok());
    REQUIRE(protect(seq, mat(sp, Hkv, T), 0, w).ok());
    // the layer's entropy, then the cascade step
    double e = 0;
    lava_entropy_options eo;
    eo.prot = cfg.prot;
    REQUIRE(lava_layer_entropy(seq, cmat(sp, Hkv, T), nullptr, eo, &e).ok());
    workspace cws;
    REQUIRE(cascade.add_layer(seq, cws, l, cmat(sp, Hkv, T), e).ok());
    cws = alloc_ws(wsbuf2, cws.bytes);
    REQUIRE(cascade.add_layer(seq, cws, l, cmat(sp, Hkv, T), e).ok());
    // layer l: its kept prompt positions into its ragged cache (capacity: the whole prompt per head)
    auto& cc = cap_cu[static_cast<std::size_t>(l)];
    cc.resize(static_cast<std::size_t>(Hkv + 1));
    for (index_t h = 0; h <= Hkv; ++h) cc[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * T);
    ragged_cache<float> rc{cache[static_cast<std::size_t>(l)].data(), cc.data(), lens[static_cast<std::size_t>(l)].data(),
                           Hkv, d, d};
    REQUIRE(compact(seq, keys, cascade.kept(l), rc).ok());
    // lower layers that shrank: compact their caches in place with the kept row indices
    for (index_t j = 0; j < l; ++j)
      if (cascade.changed(j)) {
        ragged_cache<float> rj{cache[static_cast<std::size_t>(j)].data(), cap_cu[static_cast<std::size_t>(j)].data(),
                               lens[static_cast<std::size_t>(j)].data(), Hkv, d, d};
        REQUIRE(compact_inplace(seq, rj, cascade.kept(j)).ok());
      }
  }
  // every cache row is the prompt key at the position the cascade says the layer holds
  index_t total = 0;
  for (index_t l = 0; l < L; ++l) {
    const ragged_positions held = cascade.positions(l);
    for (index_t h = 0; h < Hkv; ++h) {
      REQUIRE(lens[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)] == held.length(h));
      total += held.length(h);
      for (index_t i = 0; i < held.length(h); ++i)
        for (index_t k = 0; k < d; ++k)
          CHECK(cache[static_cast<std::size_t>(l)][static_cast<std::size_t>((h * T + i) * d + k)] ==
                prompt_keys[static_cast<std::size_t>(l)][static_cast<std::size_t>((h * T + held.pos[held.cu[h] + i]) * d + k)]);
    }
  }
  CHECK(total == cfg.total);
}

TEST_CASE("adakv_budgets: a workspace at any base alignment gives bit-identical results (seq, par)") {
  auto g = kvtest::rng(2127);
  const index_t H = 4, T = 300, B = 40;
  const auto s = kvtest::random_floats(g, static_cast<std::size_t>(H * T));
  std::vector<std::int32_t> lens = {300, 120, 41, 250};
  const auto run = [&](auto be) {
    std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1), -1);
    std::vector<pos_t> pos(static_cast<std::size_t>(B * H), -1);
    kvtest::check_workspace_shifts(
        [&](workspace& ws) {
          return adakv_budgets(be, ws, value_of(make_matrix_view(s.data(), H, T)), lens.data(), B, adakv_options{},
                               cu.data(), pos.data());
        },
        [&] { return kvtest::bytes_of(cu, pos); });
    return kvtest::bytes_of(cu, pos);
  };
  CHECK(run(seq) == run(par_t{3}));
}

// =================================================================================================
// Named budget schemes -> allocations (budget/allocation.hpp)

TEST_CASE("budget: allocation_from_name gives each scheme's allocator and budgets") {
  const index_t L = 3, H = 2, P = 40;
  const protection prot{2, 4};
  for (const budget_scheme s : all_budget_schemes) {
    CAPTURE(budget_scheme_name(s));
    REQUIRE(value_of(budget_scheme_from_name(budget_scheme_name(s))) == s);
    for (const index_t B : {index_t{6}, index_t{17}, index_t{40}, index_t{90}}) {
      CAPTURE(B);
      const index_t Bc = std::min(B, P);
      std::vector<std::int32_t> got(static_cast<std::size_t>(L * H), -1), want(got.size(), -1);
      const auto gv = value_of(make_matrix_view(got.data(), L, H));
      const auto wv = value_of(make_matrix_view(want.data(), L, H));
      std::vector<std::uint8_t> mask{1, 0, 0, 0, 0, 1};
      allocation_request req;
      req.budget = B;
      req.prompt = P;
      req.prot = prot;
      req.retrieval = value_of(make_matrix_view<const std::uint8_t>(mask.data(), L, H));
      allocation a;
      index_t kept = -1;
      REQUIRE(allocation_from_name(budget_scheme_name(s), req, gv, &a, &kept).ok());
      index_t want_kept = Bc * L * H;
      switch (s) {
        case budget_scheme::uniform:
        case budget_scheme::adakv:
          CHECK(a.kind == (s == budget_scheme::adakv ? allocator::adakv : allocator::per_head));
          REQUIRE(uniform_budgets(Bc * L * H, P, prot, wv).ok());
          break;
        case budget_scheme::pyramid: {
          CHECK(a.kind == allocator::per_head);
          pyramid_options po;
          po.prot = prot;
          REQUIRE(pyramid_budgets(Bc, P, po, wv).ok());
          break;
        }
        case budget_scheme::lava:
        case budget_scheme::cake:
          CHECK(a.kind == (s == budget_scheme::lava ? allocator::lava : allocator::cake));
          CHECK(a.total == Bc * L * H);
          CHECK(a.budgets.data_handle() == nullptr);
          break;
        case budget_scheme::duo: {
          CHECK(a.kind == allocator::per_head);
          duo_options dopt;
          dopt.streaming = prot;
          REQUIRE(duo_budgets(req.retrieval, P, dopt, wv, &want_kept).ok());
          break;
        }
      }
      CHECK(got == want);
      CHECK(kept == want_kept);
      if (a.kind != allocator::lava && a.kind != allocator::cake) CHECK(a.budgets.data_handle() == got.data());
    }
  }
  // errors: out unchanged
  std::vector<std::int32_t> b(static_cast<std::size_t>(L * H));
  const auto bv = value_of(make_matrix_view(b.data(), L, H));
  allocation a;
  a.total = 123;
  allocation_request req;
  req.budget = 10;
  req.prompt = P;
  req.prot = prot;
  require_error(allocation_from_name("pyramidkv", req, bv, &a), errc::invalid_argument, "unknown budget scheme 'pyramidkv'");
  require_error(allocation_from_name("duo", req, bv, &a), errc::shape_mismatch, "duo needs the [3][2] retrieval-head mask");
  req.budget = 4;  // below the 6 protected tokens
  require_error(allocation_from_name("uniform", req, bv, &a), errc::invalid_argument, "protected");
  req.budget = -1;
  require_error(make_allocation(budget_scheme::lava, req, bv, &a), errc::invalid_argument, "budget -1 per head");
  req.budget = 10;
  require_error(make_allocation(static_cast<budget_scheme>(9), req, bv, &a), errc::invalid_argument,
                "unknown budget_scheme value 9");
  require_error(make_allocation(budget_scheme::uniform, req, bv, nullptr), errc::null_pointer, "out is null");
  CHECK(a.total == 123);
  CHECK(a.kind == allocator::per_head);
}

TEST_CASE("max_head_rows: a head's own budget (per_head), its layer's total (flattened, adakv), 0 without a matrix") {
  std::vector<std::int32_t> b{3, 5, 7, 2, 1, 1};
  allocation a;
  a.budgets = value_of(make_matrix_view<const std::int32_t>(b.data(), 3, 2));
  a.kind = allocator::per_head;
  CHECK(max_head_rows(a) == 7);
  a.kind = allocator::flattened;
  CHECK(max_head_rows(a) == 9);
  a.kind = allocator::adakv;
  CHECK(max_head_rows(a) == 9);
  a.kind = allocator::lava;
  a.budgets = {};
  a.total = 60;
  CHECK(max_head_rows(a) == 0);
}

TEST_CASE("cake_window_preference: the window rows' softmax over the prefix, then CAKE's statistics, bit for bit") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t hkv = uniform_int(g, 1, 3), hq = hkv * uniform_int(g, 1, 3), d = 2 * uniform_int(g, 1, 4);
    const index_t w = uniform_int(g, 1, 6), P = w + uniform_int(g, 1, 30);
    const auto q = kvtest::random_floats(g, static_cast<std::size_t>(hq * w * d), -2.f, 2.f);
    const auto k = kvtest::random_floats(g, static_cast<std::size_t>(hkv * P * d), -2.f, 2.f);
    const auto qv = value_of(make_kv_view(q.data(), hq, w, d));
    const auto kv = value_of(make_kv_view(k.data(), hkv, P, d));
    // the reference: each row's logits stored, exponentiated in place, the prefix normalised
    const index_t prefix = P - w, group = hq / hkv;
    std::vector<float> att(static_cast<std::size_t>(hq * w * prefix)), row(static_cast<std::size_t>(P));
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (index_t h = 0; h < hq; ++h)
      for (index_t i = 0; i < w; ++i) {
        const index_t visible = prefix + i + 1;
        float mx = -INFINITY, sum = 0.0f;
        for (index_t j = 0; j < visible; ++j) {
          float s = 0.0f;
          for (index_t x = 0; x < d; ++x) s += qv(h, i, x) * kv(h / group, j, x);
          row[static_cast<std::size_t>(j)] = s * scale;
          mx = std::max(mx, row[static_cast<std::size_t>(j)]);
        }
        for (index_t j = 0; j < visible; ++j) sum += (row[static_cast<std::size_t>(j)] = std::exp(row[static_cast<std::size_t>(j)] - mx));
        for (index_t j = 0; j < prefix; ++j) att[static_cast<std::size_t>((h * w + i) * prefix + j)] = row[static_cast<std::size_t>(j)] / sum;
      }
    cake_stats st;
    REQUIRE(cake_layer_stats(seq, value_of(make_kv_view(static_cast<const float*>(att.data()), hq, w, prefix)), &st).ok());
    double want = 0.0, got = -1.0, got_par = -1.0;
    REQUIRE(cake_preference(st, {}, &want).ok());
    workspace query;
    REQUIRE(cake_window_preference(seq, query, qv, kv, {}, &got).ok());
    CHECK(query.bytes >= att.size() * sizeof(float));
    std::vector<unsigned char> mem;
    for (int shift = 0; shift < 4; ++shift) {
      workspace ws = kvtest::shifted_workspace(mem, query.bytes);
      REQUIRE(cake_window_preference(seq, ws, qv, kv, {}, &got).ok());
      REQUIRE(cake_window_preference(par_t{2}, ws, qv, kv, {}, &got_par).ok());
      CHECK(got == want);
      CHECK(got_par == want);
    }
  }
  std::vector<float> q(2 * 3 * 4, 0.5f), k(1 * 3 * 4, 0.25f), small(4);
  const auto qv = value_of(make_kv_view(static_cast<const float*>(q.data()), 2, 3, 4));
  const auto kv = value_of(make_kv_view(static_cast<const float*>(k.data()), 1, 3, 4));
  std::vector<unsigned char> mem(4096);
  workspace ws{mem.data(), mem.size()};
  double p = 0.0;
  require_error(cake_window_preference(seq, ws, qv, kv, {}, &p), errc::invalid_argument, "leaves no prefix");
  require_error(cake_window_preference(seq, ws, value_of(make_kv_view(static_cast<const float*>(q.data()), 3, 2, 4)),
                                       value_of(make_kv_view(static_cast<const float*>(k.data()), 2, 1, 6)), {}, &p),
                errc::shape_mismatch, "queries [3][2][4] over keys [2][1][6]");
  const auto q1 = value_of(make_kv_view(static_cast<const float*>(q.data()), 2, 1, 4));
  require_error(cake_window_preference(seq, ws, q1, kv, {}, nullptr), errc::null_pointer, "pref is null");
  workspace tiny{mem.data(), 8};
  require_error(cake_window_preference(seq, tiny, q1, kv, {}, &p), errc::workspace_too_small, "cake_window_preference");
  std::vector<float> big(1024, 0.25f);  // keys [1][3][32] at its start, the workspace over them
  const auto qb = value_of(make_kv_view(static_cast<const float*>(big.data()) + 512, 2, 1, 32));
  const auto kb = value_of(make_kv_view(static_cast<const float*>(big.data()), 1, 3, 32));
  workspace over{big.data(), 400};
  require_error(cake_window_preference(seq, over, qb, kb, {}, &p), errc::overlap, "the workspace and keys overlap");
}
