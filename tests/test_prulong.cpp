// Tests of kvevict/train/prulong.hpp: hard-concrete gates (range, closed-form expected L0 against the
// empirical frequency, gradients against central finite differences in double), the expected
// sparsity and the Lagrangian (gradients by finite differences, a descent/ascent run that reaches
// the target), the top-k discretisation (exactly k, ties, infinities) and the TSV head-mask files.
#include "support.hpp"

#include <kvevict/train/prulong.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {

template <class T>
struct mat {
  index_t rows = 0, cols = 0;
  std::vector<T> buf;
  matrix_view<T> v;
  mat(index_t r, index_t c, index_t pad = 0) : rows(r), cols(c) {
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, r * (c + pad))), T(7));
    v = value_of(make_matrix_view(buf.data(), r, c, c + pad > 0 ? c + pad : 1));
  }
  mat(const mat& o) : rows(o.rows), cols(o.cols), buf(o.buf), v(buf.data(), o.v.mapping()) {}
  T& operator()(index_t i, index_t j) { return v(i, j); }
  T operator()(index_t i, index_t j) const { return v(i, j); }
};

bool close(double a, double b, double rtol, double atol) {
  return std::fabs(a - b) <= atol + rtol * std::max(std::fabs(a), std::fabs(b));
}

double ref_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double ref_sample(double la, double u, double l = -0.1, double r = 1.1, double beta = 2.0 / 3.0) {
  const double s = ref_sigmoid((std::log(u) - std::log(1 - u) + la) / beta);
  return std::min(1.0, std::max(0.0, s * (r - l) + l));
}

// A private scratch directory, removed with everything in it at the end of the scope.
struct tmp_dir {
  std::filesystem::path dir;
  tmp_dir() : dir(std::filesystem::temp_directory_path() / ("kvevict_test_prulong_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(dir);
  }
  ~tmp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::string path(const char* name) const { return (dir / name).string(); }
};

}  // namespace

TEST_CASE("hard concrete: samples lie in [0, 1], match the formula, and are deterministic given u") {
  auto g = kvtest::rng(1);
  std::uniform_real_distribution<double> la_d(-8, 8), u_d(0, 1);
  int zeros = 0, ones = 0, inside = 0;
  for (int i = 0; i < 20000; ++i) {
    const double la = la_d(g), u = u_d(g);
    const double z = hard_concrete_sample(la, u);
    REQUIRE(z >= 0.0);
    REQUIRE(z <= 1.0);
    REQUIRE(close(z, ref_sample(la, u), 1e-12, 1e-14));
    REQUIRE(z == hard_concrete_sample(la, u));
    const float zf = hard_concrete_sample(static_cast<float>(la), static_cast<float>(u));
    REQUIRE(zf >= 0.f);
    REQUIRE(zf <= 1.f);
    REQUIRE(close(zf, ref_sample(double(static_cast<float>(la)), double(static_cast<float>(u))), 1e-4, 1e-5));
    zeros += z == 0.0;
    ones += z == 1.0;
    inside += z > 0.0 && z < 1.0;
  }
  // the stretch puts real mass on the endpoints: all three kinds occur
  CHECK(zeros > 1000);
  CHECK(ones > 1000);
  CHECK(inside > 1000);
  // u at the ends of [0, 1], and extreme log_alpha
  CHECK(hard_concrete_sample(0.0, 0.0) == 0.0);
  CHECK(hard_concrete_sample(0.0, 1.0) == 1.0);
  CHECK(hard_concrete_sample(0.0f, 0.0f) == 0.0f);
  CHECK(hard_concrete_sample(0.0f, 1.0f) == 1.0f);
  CHECK(hard_concrete_sample(1000.0, 0.5) == 1.0);
  CHECK(hard_concrete_sample(-1000.0, 0.5) == 0.0);
  CHECK(hard_concrete_sample_grad(0.0, 0.0) == 0.0);
  CHECK(hard_concrete_sample_grad(1000.0f, 0.5f) == 0.0f);
}

TEST_CASE("hard concrete: the empirical frequency of z > 0 matches the closed-form expected L0") {
  auto g = kvtest::rng(2);
  std::uniform_real_distribution<double> u_d(1e-6, 1 - 1e-6);  // the paper's truncation
  const int samples = 200000;
  for (const hard_concrete_params<double> p :
       {hard_concrete_params<double>{}, hard_concrete_params<double>{-0.2, 1.3, 0.5}}) {
    for (double la : {-4.0, -1.5, -0.3, 0.0, 0.7, 2.0, 4.5}) {
      int nonzero = 0;
      for (int i = 0; i < samples; ++i) nonzero += hard_concrete_sample(la, u_d(g), p) > 0.0;
      const double emp = double(nonzero) / samples, want = hard_concrete_expected_l0(la, p);
      const double sigma = std::sqrt(want * (1 - want) / samples);
      INFO("log_alpha ", la, " empirical ", emp, " closed form ", want);
      CHECK(std::fabs(emp - want) <= 5 * sigma + 1e-9);
      // and the closed form itself: sigmoid(log_alpha - beta log(-l/r))
      CHECK(close(want, ref_sigmoid(la - p.beta * std::log(-p.l / p.r)), 1e-14, 1e-16));
    }
  }
  MESSAGE("P(z > 0) at log_alpha = 0 with PruLong's parameters: ", hard_concrete_expected_l0(0.0),
          " (the initial log_alpha = 4.5 of PruLong's code gives ", hard_concrete_expected_l0(4.5), ")");
}

TEST_CASE("hard concrete: gradients of z and of the expected L0 match central finite differences") {
  auto g = kvtest::rng(3);
  std::uniform_real_distribution<double> la_d(-6, 6), u_d(1e-6, 1 - 1e-6);
  int checked = 0;
  const double h = 1e-6;
  for (int i = 0; i < 5000; ++i) {
    const double la = la_d(g), u = u_d(g);
    // stay away from the clamp corners, where z is not differentiable
    const double g_lo = ref_sample(la - 2 * h, u, -0.1, 1.1), g_hi = ref_sample(la + 2 * h, u, -0.1, 1.1);
    const bool flat = (g_lo == 0.0 && g_hi == 0.0) || (g_lo == 1.0 && g_hi == 1.0);
    const bool smooth = g_lo > 0.0 && g_hi < 1.0;
    if (!flat && !smooth) continue;
    const double fd = (hard_concrete_sample(la + h, u) - hard_concrete_sample(la - h, u)) / (2 * h);
    REQUIRE(close(hard_concrete_sample_grad(la, u), fd, 1e-6, 1e-9));
    if (flat) REQUIRE(hard_concrete_sample_grad(la, u) == 0.0);
    const double fd_l0 = (hard_concrete_expected_l0(la + h) - hard_concrete_expected_l0(la - h)) / (2 * h);
    REQUIRE(close(hard_concrete_expected_l0_grad(la), fd_l0, 1e-7, 1e-10));
    ++checked;
  }
  MESSAGE("hard-concrete gradient points checked: ", checked);
  CHECK(checked > 4000);
}

TEST_CASE("hard concrete: the deterministic gate") {
  for (double la : {-10.0, -3.0, -0.5, 0.0, 0.5, 2.0, 3.0, 10.0}) {
    const double want = std::min(1.0, std::max(0.0, ref_sigmoid(la) * 1.2 - 0.1));
    CHECK(close(hard_concrete_deterministic(la), want, 1e-14, 1e-16));
  }
  CHECK(hard_concrete_deterministic(INFINITY) == 1.0);
  CHECK(hard_concrete_deterministic(-INFINITY) == 0.0);
  CHECK(hard_concrete_deterministic(0.0) == doctest::Approx(0.5));
  mat<double> la(2, 3), z(2, 3);
  const double vals[6] = {-INFINITY, -1, 0, 1, 5, INFINITY};
  for (int i = 0; i < 6; ++i) la(i / 3, i % 3) = vals[i];
  REQUIRE(prulong_deterministic_gates(la.v, z.v).ok());
  for (int i = 0; i < 6; ++i) CHECK(z(i / 3, i % 3) == hard_concrete_deterministic(vals[i]));
}

TEST_CASE("prulong_sample_gates: batch samples and gradients, errors") {
  auto g = kvtest::rng(4);
  mat<float> la(5, 4, 2), u(5, 4), z(5, 4), dz(5, 4, 1);
  std::uniform_real_distribution<float> d(-3, 3), ud(0, 1);
  for (index_t i = 0; i < 5; ++i)
    for (index_t j = 0; j < 4; ++j) la(i, j) = d(g), u(i, j) = ud(g);
  u(0, 0) = 0.f;
  u(4, 3) = 1.f;
  REQUIRE(prulong_sample_gates(la.v, u.v, z.v, dz.v).ok());
  for (index_t i = 0; i < 5; ++i)
    for (index_t j = 0; j < 4; ++j) {
      CHECK(z(i, j) == hard_concrete_sample(la(i, j), u(i, j)));
      CHECK(dz(i, j) == hard_concrete_sample_grad(la(i, j), u(i, j)));
    }
  CHECK(z(0, 0) == 0.f);
  CHECK(z(4, 3) == 1.f);
  REQUIRE(prulong_sample_gates(la.v, u.v, z.v).ok());  // dz optional

  const char* fn = "prulong_sample_gates";
  mat<float> bad_u = u, bad_la = la, small(5, 3);
  bad_u(2, 1) = 1.5f;
  require_error(prulong_sample_gates(la.v, bad_u.v, z.v), errc::invalid_argument, "u[2][1] = 1.5 is outside [0, 1]");
  bad_u(2, 1) = NAN;
  require_error(prulong_sample_gates(la.v, bad_u.v, z.v), errc::invalid_argument, "u[2][1] = nan");
  bad_la(1, 1) = INFINITY;
  require_error(prulong_sample_gates(bad_la.v, u.v, z.v), errc::invalid_argument, "log_alpha[1][1] is inf (must be finite)");
  bad_la(1, 1) = NAN;
  require_error(prulong_sample_gates(bad_la.v, u.v, z.v), errc::invalid_argument, "log_alpha[1][1] is nan");
  require_error(prulong_sample_gates(la.v, small.v, z.v), errc::shape_mismatch, "u is [5][3]");
  require_error(prulong_sample_gates(la.v, u.v, small.v), errc::shape_mismatch, "z is [5][3]");
  require_error(prulong_sample_gates(la.v, u.v, z.v, small.v), errc::shape_mismatch, "dz is [5][3]");
  require_error(prulong_sample_gates(la.v, u.v, la.v), errc::overlap, "z overlaps log_alpha");
  require_error(prulong_sample_gates(la.v, u.v, u.v), errc::overlap, "z overlaps u");
  require_error(prulong_sample_gates(la.v, u.v, z.v, z.v), errc::overlap, "dz overlaps u or z");
  require_error(prulong_sample_gates(la.v, u.v, z.v, dz.v, hard_concrete_params<float>{0.1f, 1.1f, 0.5f}),
                errc::invalid_argument, "need l < 0, r > 1, beta > 0");
  require_error(prulong_sample_gates(la.v, u.v, z.v, dz.v, hard_concrete_params<float>{-0.1f, 1.1f, 0.f}),
                errc::invalid_argument, "beta > 0");
  mat<float> z_nan(2, 2);
  mat<float> la_nan(2, 2);
  la_nan(0, 0) = NAN;
  require_error(prulong_deterministic_gates(la_nan.v, z_nan.v), errc::invalid_argument, "log_alpha[0][0] is nan");
  require_error(prulong_deterministic_gates(la.v, small.v), errc::shape_mismatch, "z is [5][3]");
  (void)fn;
}

TEST_CASE("expected sparsity and the Lagrangian: values and every gradient by finite differences") {
  for (std::uint64_t seed = 10; seed < 40; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t L = kvtest::uniform_int(g, 1, 6), H = kvtest::uniform_int(g, 1, 8);
    mat<double> la(L, H, seed % 2);
    std::uniform_real_distribution<double> d(-5, 6);
    for (index_t i = 0; i < L; ++i)
      for (index_t j = 0; j < H; ++j) la(i, j) = d(g);
    double s = -1;
    mat<double> ds(L, H);
    REQUIRE(prulong_expected_sparsity(la.v, &s, ds.v).ok());
    double kept = 0;
    for (index_t i = 0; i < L; ++i)
      for (index_t j = 0; j < H; ++j) kept += hard_concrete_expected_l0(la(i, j));
    CHECK(close(s, 1 - kept / double(L * H), 1e-14, 1e-15));
    CHECK(s >= 0.0);
    CHECK(s <= 1.0);

    const double t = std::uniform_real_distribution<double>(0, 1)(g);
    const double l1 = std::uniform_real_distribution<double>(-2, 2)(g), l2 = std::uniform_real_distribution<double>(0, 3)(g);
    prulong_lagrangian_result res;
    mat<double> grad(L, H);
    REQUIRE(prulong_lagrangian(la.v, t, l1, l2, &res, grad.v).ok());
    CHECK(res.sparsity == s);
    CHECK(res.target == t);
    CHECK(close(res.penalty.value, l1 * (s - t) + l2 * (s - t) * (s - t), 1e-14, 1e-15));
    auto reg = [&](double a1, double a2) {
      prulong_lagrangian_result r2;
      REQUIRE(prulong_lagrangian(la.v, t, a1, a2, &r2).ok());
      return r2.penalty.value;
    };
    const double h = 1e-6;
    CHECK(close(res.penalty.grad_lambda1, (reg(l1 + h, l2) - reg(l1 - h, l2)) / (2 * h), 1e-7, 1e-10));
    CHECK(close(res.penalty.grad_lambda2, (reg(l1, l2 + h) - reg(l1, l2 - h)) / (2 * h), 1e-7, 1e-10));
    for (index_t i = 0; i < L; ++i)
      for (index_t j = 0; j < H; ++j) {
        const double keep = la(i, j);
        double up, dn, s_up, s_dn;
        la(i, j) = keep + h;
        up = reg(l1, l2);
        REQUIRE(prulong_expected_sparsity(la.v, &s_up).ok());
        la(i, j) = keep - h;
        dn = reg(l1, l2);
        REQUIRE(prulong_expected_sparsity(la.v, &s_dn).ok());
        la(i, j) = keep;
        REQUIRE(close(grad(i, j), (up - dn) / (2 * h), 1e-6, 1e-9));  // FD rounding floor ~1e-10
        REQUIRE(close(ds(i, j), (s_up - s_dn) / (2 * h), 1e-6, 1e-9));
      }
    // accumulate adds to what is there
    mat<double> acc = grad;
    REQUIRE(prulong_lagrangian(la.v, t, l1, l2, &res, acc.v, prulong_grad_options{true}).ok());
    for (index_t i = 0; i < L; ++i)
      for (index_t j = 0; j < H; ++j) REQUIRE(acc(i, j) == 2 * grad(i, j));
  }
}

TEST_CASE("the min-max game: descent on log_alpha and ascent on the multipliers reach the target sparsity") {
  // Only the penalty (no language-model loss): plain gradient steps as the paper describes
  // (learning rate 1 for log_alpha and for the lambdas is the paper's; smaller steps here, no Adam).
  const index_t L = 5, H = 4;
  mat<double> la(L, H), grad(L, H);
  auto g = kvtest::rng(77);
  for (auto& v : la.buf) v = 4.5 + std::normal_distribution<double>(0, 0.01)(g);  // PruLong's init
  for (double target : {0.3, 0.7}) {
    double l1 = 0, l2 = 0;
    prulong_lagrangian_result res;
    for (int step = 0; step < 4000; ++step) {
      REQUIRE(prulong_lagrangian(la.v, target, l1, l2, &res, grad.v).ok());
      for (index_t i = 0; i < L; ++i)
        for (index_t j = 0; j < H; ++j) la(i, j) -= 0.5 * grad(i, j) * double(L * H);
      l1 += 0.05 * res.penalty.grad_lambda1;
      l2 += 0.05 * res.penalty.grad_lambda2;
    }
    MESSAGE("target ", target, " reached ", res.sparsity, " (lambda1 ", l1, ", lambda2 ", l2, ")");
    CHECK(std::fabs(res.sparsity - target) < 0.02);
  }
}

TEST_CASE("prulong_topk_mask: exactly k retrieval heads, ties to the lower (layer, head), infinities") {
  auto naive = [](const std::vector<double>& v, index_t k) {
    std::vector<index_t> idx(v.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](index_t a, index_t b) { return v[a] > v[b]; });
    std::vector<int> m(v.size(), 0);
    for (index_t i = 0; i < k; ++i) m[idx[i]] = 1;
    return m;
  };
  for (std::uint64_t seed = 50; seed < 150; ++seed) {
    CAPTURE(seed);
    auto g = kvtest::rng(seed);
    const index_t L = kvtest::uniform_int(g, 1, 7), H = kvtest::uniform_int(g, 1, 9), M = L * H;
    mat<double> la(L, H, seed % 3);
    std::vector<double> flat;
    const int palette = static_cast<int>(kvtest::uniform_int(g, 1, 5));  // few distinct values: many ties
    for (index_t i = 0; i < L; ++i)
      for (index_t j = 0; j < H; ++j) {
        double v = double(kvtest::uniform_int(g, 0, palette)) - 2.0;
        if (seed % 4 == 0 && kvtest::uniform_int(g, 0, 6) == 0) v = kvtest::uniform_int(g, 0, 1) ? INFINITY : -INFINITY;
        if (v == 0.0 && kvtest::uniform_int(g, 0, 1)) v = -0.0;
        la(i, j) = v;
        flat.push_back(v);
      }
    for (index_t k : {index_t(0), index_t(1), kvtest::uniform_int(g, 0, M), M}) {
      mat<std::uint8_t> mask(L, H, 1);
      REQUIRE(prulong_topk_mask(la.v, k, mask.v).ok());
      const auto want = naive(flat, k);
      index_t ones = 0;
      for (index_t i = 0; i < L; ++i)
        for (index_t j = 0; j < H; ++j) {
          REQUIRE(int(mask(i, j)) == want[i * H + j]);
          ones += mask(i, j);
        }
      REQUIRE(ones == k);
      mat<float> maskf(L, H);
      REQUIRE(prulong_topk_mask(la.v, k, maskf.v).ok());
      for (index_t i = 0; i < L; ++i)
        for (index_t j = 0; j < H; ++j) REQUIRE(maskf(i, j) == float(mask(i, j)));
    }
  }
  // all equal: the first k in (layer, head) order
  mat<float> eq(3, 4);
  for (auto& v : eq.buf) v = 1.5f;
  mat<int> m(3, 4);
  REQUIRE(prulong_topk_mask(eq.v, 5, m.v).ok());
  for (int i = 0; i < 12; ++i) CHECK(m(i / 4, i % 4) == (i < 5 ? 1 : 0));
  // errors
  require_error(prulong_topk_mask(eq.v, 13, m.v), errc::invalid_argument, "k = 13 is outside [0, 12]");
  require_error(prulong_topk_mask(eq.v, -1, m.v), errc::invalid_argument, "k = -1");
  mat<int> m_bad(4, 3);
  require_error(prulong_topk_mask(eq.v, 2, m_bad.v), errc::shape_mismatch, "mask is [4][3] but log_alpha is [3][4]");
  eq(2, 1) = NAN;
  require_error(prulong_topk_mask(eq.v, 2, m.v), errc::invalid_argument, "log_alpha[2][1] is nan");
  mat<float> self(2, 2);
  require_error(prulong_topk_mask(self.v, 1, self.v), errc::overlap, "mask overlaps log_alpha");
}

TEST_CASE("prulong_retrieval_heads: k from a sparsity") {
  CHECK(value_of(prulong_retrieval_heads(10, 0.9)) == 1);  // int(10 * (1 - 0.9)) would be 0
  CHECK(value_of(prulong_retrieval_heads(40, 0.7)) == 12);
  CHECK(value_of(prulong_retrieval_heads(20, 0.5)) == 10);
  CHECK(value_of(prulong_retrieval_heads(20, 0.53)) == 9);
  CHECK(value_of(prulong_retrieval_heads(5, 0.0)) == 5);
  CHECK(value_of(prulong_retrieval_heads(5, 1.0)) == 0);
  CHECK(value_of(prulong_retrieval_heads(0, 0.5)) == 0);
  for (index_t M = 1; M <= 1024; M = M * 2 + 1)
    for (int t = 0; t <= 10; ++t) {
      const index_t k = value_of(prulong_retrieval_heads(M, t / 10.0));
      CHECK(k >= 0);
      CHECK(k <= M);
      CHECK(std::fabs(double(k) - double(M) * (1 - t / 10.0)) < 1.0);
    }
  require_error(prulong_retrieval_heads(-1, 0.5).error(), errc::invalid_argument, "heads is negative");
  require_error(prulong_retrieval_heads(4, 1.5).error(), errc::invalid_argument, "sparsity 1.5 is outside [0, 1]");
  require_error(prulong_retrieval_heads(4, NAN).error(), errc::invalid_argument, "outside [0, 1]");
}

TEST_CASE("sparsity and Lagrangian: every documented error") {
  mat<double> la(2, 3), grad(2, 3), bad(3, 2), empty(0, 3);
  for (auto& v : la.buf) v = 1.0;
  double s = 0;
  prulong_lagrangian_result res;
  require_error(prulong_expected_sparsity(la.v, nullptr), errc::null_pointer, "s is null");
  require_error(prulong_expected_sparsity(empty.v, &s), errc::invalid_argument, "log_alpha is empty");
  require_error(prulong_expected_sparsity(la.v, &s, bad.v), errc::shape_mismatch, "grad is [3][2]");
  require_error(prulong_expected_sparsity(la.v, &s, la.v), errc::overlap, "grad overlaps log_alpha");
  mat<double> inf = la;
  inf(1, 2) = -INFINITY;
  require_error(prulong_expected_sparsity(inf.v, &s), errc::invalid_argument, "log_alpha[1][2] is -inf");
  require_error(prulong_expected_sparsity(la.v, &s, grad.v, hard_concrete_params<double>{-0.1, 0.9, 2.0 / 3}),
                errc::invalid_argument, "r > 1");
  require_error(prulong_lagrangian(la.v, 0.5, 0, 0, nullptr), errc::null_pointer, "out is null");
  require_error(prulong_lagrangian(la.v, 1.5, 0, 0, &res), errc::invalid_argument, "target sparsity 1.5");
  require_error(prulong_lagrangian(la.v, -0.1, 0, 0, &res), errc::invalid_argument, "target sparsity -0.1");
  require_error(prulong_lagrangian(la.v, 0.5, NAN, 0, &res), errc::invalid_argument, "must be finite");
  require_error(prulong_lagrangian(la.v, 0.5, 0, INFINITY, &res), errc::invalid_argument, "must be finite");
  require_error(prulong_lagrangian(la.v, 0.5, 0, 0, &res, bad.v), errc::shape_mismatch, "grad_log_alpha is [3][2]");
  require_error(prulong_lagrangian(inf.v, 0.5, 0, 0, &res), errc::invalid_argument, "log_alpha[1][2]");
  require_error(prulong_lagrangian(empty.v, 0.5, 0, 0, &res), errc::invalid_argument, "log_alpha is empty");
}

// ------------------------------------------------------------------------------------------------
// TSV head masks

namespace {

status parse(const std::string& text, mat<float>& out, head_mask_tsv_options o = {}) {
  return parse_head_mask_tsv(text.data(), text.size(), out.v, o);
}

}  // namespace

TEST_CASE("head-mask TSV: round trips, DuoAttention/PruLong spellings, tolerated whitespace") {
  auto g = kvtest::rng(5);
  const tmp_dir tmp;
  for (int trial = 0; trial < 30; ++trial) {
    const index_t L = kvtest::uniform_int(g, 1, 8), H = kvtest::uniform_int(g, 1, 9);
    mat<float> v(L, H, trial % 2);
    std::uniform_real_distribution<float> d(0, 1);
    for (index_t i = 0; i < L; ++i)
      for (index_t j = 0; j < H; ++j) v(i, j) = trial % 3 == 0 ? float(kvtest::uniform_int(g, 0, 1)) : d(g);
    std::string text;
    REQUIRE(format_head_mask_tsv(v.v, text).ok());
    index_t l = 0, h = 0;
    REQUIRE(head_mask_tsv_shape(text.data(), text.size(), &l, &h).ok());
    CHECK(l == L);
    CHECK(h == H);
    mat<float> back(L, H);
    REQUIRE(parse(text, back).ok());
    for (index_t i = 0; i < L; ++i)
      for (index_t j = 0; j < H; ++j) REQUIRE(back(i, j) == v(i, j));  // %.9g round-trips floats exactly
    // through a file
    const std::string path = tmp.path("mask.tsv");
    REQUIRE(write_head_mask_tsv(path.c_str(), v.v).ok());
    mat<float> from_file(L, H);
    REQUIRE(read_head_mask_tsv(path.c_str(), from_file.v).ok());
    CHECK(from_file.buf == back.buf);
  }
  // binary masks print as 0 / 1
  mat<std::uint8_t> bin(2, 3);
  const std::uint8_t bits[6] = {1, 0, 1, 0, 0, 1};
  for (int i = 0; i < 6; ++i) bin(i / 3, i % 3) = bits[i];
  std::string text;
  REQUIRE(format_head_mask_tsv(bin.v, text).ok());
  CHECK(text == "1\t0\t1\n0\t0\t1\n");

  // DuoAttention's np.savetxt spelling (%.18e) with tiny negative values (as in its published
  // patterns): rejected by default, clipped to [0, 1] on request
  const std::string duo =
      "-9.000000000000000000e-05\t1.000000000000000000e+00\t5.500000000000000000e-01\n"
      "1.000000000000000000e+00\t1.000100000000000000e+00\t2.000000000000000000e-04\n";
  mat<float> dm(2, 3);
  require_error(parse(duo, dm), errc::invalid_argument, "line 1, value 1: -9e-05 is outside [0, 1]");
  REQUIRE(parse(duo, dm, head_mask_tsv_options{head_mask_range::clip}).ok());
  CHECK(dm(0, 0) == 0.f);
  CHECK(dm(0, 1) == 1.f);
  CHECK(dm(0, 2) == 0.55f);
  CHECK(dm(1, 1) == 1.f);
  CHECK(dm(1, 2) == 2e-4f);
  // PruLong's csv writer spelling (1.0 / 0.0), CRLF, no final newline, trailing blank lines, spaces, '+'
  mat<float> pm(2, 2);
  REQUIRE(parse("1.0\t0.0\r\n0.0\t1.0", pm).ok());
  CHECK(pm.buf == std::vector<float>{1, 0, 0, 1});
  REQUIRE(parse("1\t0\n0\t1\n\n  \n\r\n", pm).ok());
  REQUIRE(parse(" 1 \t 0.25\n+0.5\t1e-1\n", pm).ok());
  CHECK(pm.buf == std::vector<float>{1, 0.25f, 0.5f, 0.1f});
  // binarise: >= threshold is a retrieval head
  mat<int> b(2, 2);
  REQUIRE(binarize_head_mask(pm.v, 0.5, b.v).ok());
  CHECK(b.buf == std::vector<int>{1, 0, 1, 0});
  REQUIRE(binarize_head_mask(pm.v, 0.25, b.v).ok());
  CHECK(b.buf == std::vector<int>{1, 1, 1, 0});
  REQUIRE(binarize_head_mask(pm.v, 0.0, b.v).ok());
  CHECK(b.buf == std::vector<int>{1, 1, 1, 1});
}

TEST_CASE("head-mask TSV: every documented error") {
  mat<float> m(2, 3);
  require_error(parse("", m), errc::format_error, "empty (no layers)");
  require_error(parse("\n\n \r\n", m), errc::format_error, "empty (no layers)");
  require_error(parse("1\t0\t1\n\n0\t0\t1\n", m), errc::format_error, "line 2 is empty");
  require_error(parse("1\t\t1\n0\t0\t1\n", m), errc::format_error, "line 1, value 2 is empty");
  require_error(parse("1\t0\t1\t\n0\t0\t1\n", m), errc::format_error, "line 1, value 4 is empty");
  require_error(parse("1\t0\t1\n0\tabc\t1\n", m), errc::format_error, "line 2, value 2: \"abc\" is not a number");
  require_error(parse("1\t0\t1\n0\t0.5x\t1\n", m), errc::format_error, "\"0.5x\" is not a number");
  require_error(parse("1\t0\t1\n0\t0 5\t1\n", m), errc::format_error, "\"0 5\" is not a number");
  require_error(parse("1,0,1\n0,0,1\n", m), errc::format_error, "\"1,0,1\" is not a number");
  require_error(parse("1\t0\t0x1\n0\t0\t1\n", m), errc::format_error, "\"0x1\" is not a number");
  require_error(parse("1\t0\tnan\n0\t0\t1\n", m), errc::invalid_argument, "\"nan\" is not finite");
  require_error(parse("1\t0\t-inf\n0\t0\t1\n", m), errc::invalid_argument, "\"-inf\" is not finite");
  require_error(parse("1\t0\t1e999\n0\t0\t1\n", m), errc::invalid_argument, "\"1e999\" is outside [0, 1]");
  require_error(parse("1\t0\t1.5\n0\t0\t1\n", m), errc::invalid_argument, "line 1, value 3: 1.5 is outside [0, 1]");
  require_error(parse("1\t0\t1\n0\t-0.5\t1\n", m), errc::invalid_argument, "-0.5 is outside");
  require_error(parse("1\t0\tnan\n0\t0\t1\n", m, head_mask_tsv_options{head_mask_range::clip}), errc::invalid_argument,
                "not finite");
  require_error(parse("1\t0\t1\n0\t1\n", m), errc::shape_mismatch, "line 2 has 2 values but line 1 has 3");
  require_error(parse("1\t0\t1\n0\t1\t1\t0\n", m), errc::shape_mismatch, "line 2 has more than 3 values");
  require_error(parse("1\t0\t1\n", m), errc::shape_mismatch, "the file has 1 layers x 3 heads but 2 x 3 are expected");
  require_error(parse("1\t0\n1\t0\n", m), errc::shape_mismatch, "2 layers x 2 heads but 2 x 3");
  require_error(parse("1\t0\t1\n0\t0\t1\n", m, head_mask_tsv_options{static_cast<head_mask_range>(4)}),
                errc::invalid_argument, "unknown range option");
  require_error(parse_head_mask_tsv(nullptr, 3, m.v), errc::null_pointer, "text is null");
  index_t l = 0;
  require_error(head_mask_tsv_shape("1", 1, &l, nullptr), errc::null_pointer, "layers or heads is null");
  // nothing is written when the text is bad
  mat<float> untouched(2, 3);
  std::fill(untouched.buf.begin(), untouched.buf.end(), 0.125f);
  require_error(parse("1\t0\t1\n0\t0\tbad\n", untouched), errc::format_error, "not a number");
  for (float v : untouched.buf) CHECK(v == 0.125f);
  // files
  require_error(read_head_mask_tsv("/nonexistent/kvevict/masks.tsv", m.v), errc::io_error,
                "cannot open /nonexistent/kvevict/masks.tsv");
  require_error(read_head_mask_tsv<float>(nullptr, m.v), errc::null_pointer, "path is null");
  {
    const tmp_dir tmp;
    const std::string path = tmp.path("bad.tsv");
    std::FILE* f = std::fopen(path.c_str(), "wb");
    REQUIRE(f != nullptr);
    std::fputs("1\t0\t1\n0\tx\t1\n", f);
    std::fclose(f);
    require_error(read_head_mask_tsv(path.c_str(), m.v), errc::format_error, "(file ");
  }
  mat<float> v(2, 2);
  v(0, 0) = 1.5f;
  v(0, 1) = v(1, 0) = v(1, 1) = 0.f;
  std::string out;
  require_error(format_head_mask_tsv(v.v, out), errc::invalid_argument, "values[0][0] = 1.5 is outside [0, 1]");
  v(0, 0) = NAN;
  require_error(format_head_mask_tsv(v.v, out), errc::invalid_argument, "values[0][0] = nan");
  mat<float> none(0, 2);
  require_error(format_head_mask_tsv(none.v, out), errc::invalid_argument, "at least one layer and one head");
  v(0, 0) = 1.f;
  require_error(write_head_mask_tsv("/nonexistent/kvevict/out.tsv", v.v), errc::io_error, "cannot open");
  require_error(write_head_mask_tsv<float>(nullptr, v.v), errc::null_pointer, "path is null");
  // binarize
  mat<int> b(2, 2), b_bad(2, 3);
  require_error(binarize_head_mask(v.v, NAN, b.v), errc::invalid_argument, "threshold is not finite");
  require_error(binarize_head_mask(v.v, 0.5, b_bad.v), errc::shape_mismatch, "mask is [2][3] but values are [2][2]");
  mat<float> vn = v;
  vn(1, 1) = NAN;
  require_error(binarize_head_mask(vn.v, 0.5, b.v), errc::invalid_argument, "values[1][1] is NaN");
  require_error(binarize_head_mask(v.v, 0.5, v.v), errc::overlap, "mask overlaps values");
}

TEST_CASE("head-mask TSV files: only bounded regular files are read; writes replace the file whole") {
  const tmp_dir tmp;
  mat<float> m(2, 2);
  // a FIFO would block the open and /dev/zero never ends: both refused before reading
  const std::string fifo = tmp.path("masks.fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  require_error(read_head_mask_tsv(fifo.c_str(), m.v), errc::io_error, "is not a regular file");
  require_error(read_head_mask_tsv("/dev/zero", m.v), errc::io_error, "/dev/zero is not a regular file");
  require_error(read_head_mask_tsv(tmp.dir.string().c_str(), m.v), errc::io_error, "is not a regular file");
  // a write that succeeds leaves no temporary file; one into a missing directory writes nothing
  const std::string path = tmp.path("masks.tsv");
  std::fill(m.buf.begin(), m.buf.end(), 1.0f);
  REQUIRE(write_head_mask_tsv(path.c_str(), m.v).ok());
  CHECK(!std::filesystem::exists(path + ".kvevict-tmp"));
  mat<float> back(2, 2);
  REQUIRE(read_head_mask_tsv(path.c_str(), back.v).ok());
  CHECK(back.v(1, 1) == 1.0f);
}
