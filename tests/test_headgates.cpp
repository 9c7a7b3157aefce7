// PruLong / DuoAttention head-gate training (examples/headgates/*.hpp): the streaming columns, the
// gated model with open gates against the runner, and the exact gradients of both objectives
// through the whole frozen stories260K model (gates, log_alpha, the Lagrange multipliers) against
// central finite differences in double; a short training run moving the gates as intended.
#include "support.hpp"
#include "support/shipped.hpp"

#include <headgates/gated.hpp>
#include <headgates/train.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

using namespace kvrun;

namespace {

void require_ok(const status& st) { REQUIRE_MESSAGE(st.ok(), std::string(st.message())); }

// a short model-generated text of the training split (its first n tokens)
std::vector<int> text(index_t n) {
  std::vector<gate_sample> s;
  require_ok(make_gate_samples(kvtest::shipped_model(), 1, 1, s));
  REQUIRE(static_cast<index_t>(s[0].tokens.size()) >= n);
  return {s[0].tokens.begin(), s[0].tokens.begin() + n};
}

// Central differences (h = 1e-5) of objective(log_alpha, lambda1, lambda2, nullptr...) in every
// log_alpha (relative 1e-5) and in both multipliers (absolute 1e-8) against the analytic gradients
// grad, dl1, dl2; returns the worst relative error over log_alpha, fd1 / fd2 the multipliers'.
template <class Objective>
double check_central_differences(Objective& objective, const std::vector<double>& la, double l1, double l2,
                                 const std::vector<double>& grad, double dl1, double dl2, double& fd1, double& fd2) {
  const double h = 1e-5;
  auto f = [&](const std::vector<double>& a, double lam1, double lam2) { return objective(a, lam1, lam2, nullptr, nullptr, nullptr); };
  double worst = 0;
  for (std::size_t i = 0; i < la.size(); ++i) {
    std::vector<double> p = la, q = la;
    p[i] += h;
    q[i] -= h;
    const double fd = (f(p, l1, l2) - f(q, l1, l2)) / (2 * h);
    const double err = std::fabs(fd - grad[i]) / std::max(1e-3, std::fabs(fd));
    worst = std::max(worst, err);
    CHECK_MESSAGE(err < 1e-5, "log_alpha ", i, ": analytic ", grad[i], " vs central difference ", fd);
  }
  fd1 = (f(la, l1 + h, l2) - f(la, l1 - h, l2)) / (2 * h);
  fd2 = (f(la, l1, l2 + h) - f(la, l1, l2 - h)) / (2 * h);
  CHECK(std::fabs(fd1 - dl1) < 1e-8);
  CHECK(std::fabs(fd2 - dl2) < 1e-8);
  return worst;
}

}  // namespace

TEST_CASE("streaming columns: the sinks then the recent window, the row itself included") {
  const streaming_window w{2, 3};
  for (index_t i = 0; i < 12; ++i) {
    const gates::row_columns rc = gates::streaming_columns(i, w);
    std::vector<index_t> want;
    for (index_t j = 0; j <= i; ++j)
      if (j < w.sink || j > i - w.recent) want.push_back(j);
    REQUIRE(rc.count == static_cast<index_t>(want.size()));
    CHECK(rc.count <= w.sink + w.recent);
    for (index_t c = 0; c < rc.count; ++c) CHECK(rc.col(c) == want[static_cast<std::size_t>(c)]);
    const gates::row_columns f = gates::full_columns(i);
    REQUIRE(f.count == i + 1);
    for (index_t c = 0; c <= i; ++c) CHECK(f.col(c) == c);
  }
}

TEST_CASE("gated model: open gates compute the runner's model (next-token loss from the runner's logits)") {
  const model& m = kvtest::shipped_model();
  const config& c = m.cfg();
  const std::vector<int> t = text(40);
  gated_lm<float> lm;
  lm.from(m);
  gated_backprop<float> bp;
  require_ok(bp.init(lm, 40, {2, 3}));
  const std::vector<float> ones(static_cast<std::size_t>(c.n_layers * c.n_kv_heads), 1.0f);
  require_ok(bp.forward(lm, t.data(), 40, ones.data()));
  double loss = 0;
  require_ok(bp.next_token_loss(lm, t.data(), &loss, false));
  runner run;
  require_ok(run.init(m, {0, 0, 1}));
  kv_cache cache;
  require_ok(cache.init(c));
  require_ok(run.forward(cache, tokens(t), logits_mode::all));
  double ref = 0;
  for (index_t i = 0; i + 1 < 40; ++i) {
    const float* lg = run.logits(i);
    double mx = lg[0], sum = 0;
    for (int v = 1; v < c.vocab_size; ++v) mx = std::max(mx, double(lg[v]));
    for (int v = 0; v < c.vocab_size; ++v) sum += std::exp(double(lg[v]) - mx);
    ref += std::log(sum) + mx - lg[t[static_cast<std::size_t>(i + 1)]];
  }
  ref /= 39;
  std::printf("gated model, open gates: next-token loss %.6f, runner %.6f\n", loss, ref);
  CHECK(std::fabs(loss - ref) < 1e-4);
  // closed gates differ (the window 2 + 3 is shorter than the text)
  const std::vector<float> zeros(ones.size(), 0.0f);
  require_ok(bp.forward(lm, t.data(), 40, zeros.data()));
  double closed = 0;
  require_ok(bp.next_token_loss(lm, t.data(), &closed, false));
  CHECK(std::fabs(closed - loss) > 1e-3);
}

TEST_CASE("PruLong: d(next-token loss + Lagrangian)/d(log_alpha, lambda1, lambda2) through the whole model = central differences") {
  const model& m = kvtest::shipped_model();
  const config& c = m.cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads, n = 24;
  const auto LH = static_cast<std::size_t>(L * H);
  const std::vector<int> t = text(n);
  gated_lm<double> lm;
  lm.from(m);
  gated_backprop<double> bp;
  require_ok(bp.init(lm, n, {2, 3}));
  auto g = kvtest::rng(16);
  std::uniform_real_distribution<double> la_d(-0.5, 0.5), u_d(0.4, 0.6);  // every gate strictly inside (0, 1)
  std::vector<double> la(LH), u(LH), z, dz, dzl;
  for (std::size_t i = 0; i < LH; ++i) la[i] = la_d(g), u[i] = u_d(g);
  const double target = 0.4, l1 = 0.7, l2 = 1.3;
  // the trainer's objective: the sample's loss plus the Lagrangian at the same log_alpha
  auto objective = [&](const std::vector<double>& a, double lam1, double lam2, std::vector<double>* grad, double* dl1,
                       double* dl2) {
    double loss = 0;
    if (grad) grad->assign(LH, 0.0);
    require_ok(prulong_sample_loss(bp, lm, t, a.data(), u.data(), &loss, grad ? grad->data() : nullptr, z, dz, dzl));
    kvevict::prulong_lagrangian_result r;
    kvevict::prulong_grad_options acc{true};
    require_ok(kvevict::prulong_lagrangian(lkv::mat<const double>(a.data(), L, H, H), target, lam1, lam2, &r,
                                                   grad ? lkv::mat<double>(grad->data(), L, H, H) : kvevict::matrix_view<double>{},
                                                   acc));
    if (dl1) *dl1 = r.penalty.grad_lambda1;
    if (dl2) *dl2 = r.penalty.grad_lambda2;
    return loss + r.penalty.value;
  };
  std::vector<double> grad;
  double dl1 = 0, dl2 = 0;
  objective(la, l1, l2, &grad, &dl1, &dl2);
  double fd1 = 0, fd2 = 0;
  const double worst = check_central_differences(objective, la, l1, l2, grad, dl1, dl2, fd1, fd2);
  std::printf("PruLong gradient check (%zu log_alpha, %lld tokens): worst relative error %.2e; lambda1 %.3e vs %.3e, lambda2 %.3e vs %.3e\n",
              LH, static_cast<long long>(n), worst, dl1, fd1, dl2, fd2);
}

TEST_CASE("PruLong, sampled-gate constraint: d(batch loss + Lagrangian of 1 - mean z)/d(log_alpha, lambdas) = central differences") {
  // the trainer's --constrain sampled objective over a batch of two texts, each with its own uniforms:
  // mean next-token loss + lambda1 (s - t) + lambda2 (s - t)^2, s = 1 - mean z of both samples' gates
  const model& m = kvtest::shipped_model();
  const config& c = m.cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads, n = 20;
  const auto LH = static_cast<std::size_t>(L * H);
  std::vector<gate_sample> texts;
  require_ok(make_gate_samples(m, 2, 1, texts));
  gated_lm<double> lm;
  lm.from(m);
  gated_backprop<double> bp;
  require_ok(bp.init(lm, n, {2, 3}));
  auto g = kvtest::rng(61);
  std::uniform_real_distribution<double> la_d(-0.5, 0.5), u_d(0.4, 0.6);
  std::vector<double> la(LH);
  std::vector<std::vector<double>> u(2, std::vector<double>(LH)), z(2), dz(2), dzl(2);
  for (std::size_t i = 0; i < LH; ++i) la[i] = la_d(g), u[0][i] = u_d(g), u[1][i] = u_d(g);
  la[3] = 4.0, la[11] = -4.0;  // gates clamped at 1 and at 0 in both samples (dz = 0, away from the kinks)
  const std::vector<const std::vector<double>*> zs{&z[0], &z[1]}, dzs{&dz[0], &dz[1]};
  const double target = 0.3, l1 = -0.9, l2 = 2.1;
  auto objective = [&](const std::vector<double>& a, double lam1, double lam2, std::vector<double>* grad, double* dl1,
                       double* dl2) {
    double mean = 0;
    if (grad) grad->assign(LH, 0.0);
    std::vector<double> gs(LH, 0.0), gp(LH);
    for (std::size_t b = 0; b < 2; ++b) {
      std::vector<int> t(texts[b].tokens.begin(), texts[b].tokens.begin() + n);
      double loss = 0;
      std::fill(gs.begin(), gs.end(), 0.0);
      require_ok(prulong_sample_loss(bp, lm, t, a.data(), u[b].data(), &loss, grad ? gs.data() : nullptr, z[b], dz[b], dzl[b]));
      mean += loss / 2;
      if (grad)
        for (std::size_t i = 0; i < LH; ++i) (*grad)[i] += gs[i] / 2;
    }
    const kvevict::prulong_penalty pen = prulong_sampled_penalty(zs, dzs, LH, target, lam1, lam2, gp.data());
    if (grad)
      for (std::size_t i = 0; i < LH; ++i) (*grad)[i] += gp[i];
    if (dl1) *dl1 = pen.grad_lambda1;
    if (dl2) *dl2 = pen.grad_lambda2;
    return mean + pen.value;
  };
  std::vector<double> grad;
  double dl1 = 0, dl2 = 0;
  objective(la, l1, l2, &grad, &dl1, &dl2);
  CHECK(z[0][3] == 1.0);
  CHECK(z[1][11] == 0.0);
  CHECK(grad[3] == 0.0);  // a clamped gate carries no gradient, neither from the loss nor the constraint
  CHECK(grad[11] == 0.0);
  double fd1 = 0, fd2 = 0;
  const double worst = check_central_differences(objective, la, l1, l2, grad, dl1, dl2, fd1, fd2);
  double zmean = 0;
  for (std::size_t b = 0; b < 2; ++b)
    for (std::size_t i = 0; i < LH; ++i) zmean += z[b][i] / static_cast<double>(2 * LH);
  CHECK(dl1 == doctest::Approx(1.0 - zmean - target).epsilon(1e-12));
  std::printf("PruLong sampled-constraint gradient check (2 x %zu gates, %lld tokens): worst relative error %.2e; lambda1 %.3e vs "
              "%.3e, lambda2 %.3e vs %.3e\n",
              LH, static_cast<long long>(n), worst, dl1, fd1, dl2, fd2);
}

TEST_CASE("DuoAttention: d(distillation loss)/d(alpha) through the whole model = central differences") {
  const model& m = kvtest::shipped_model();
  const config& c = m.cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads, n = 24, from = 10;
  const auto LH = static_cast<std::size_t>(L * H);
  const std::vector<int> t = text(n);
  gated_lm<double> lm;
  lm.from(m);
  gated_backprop<double> bp;
  require_ok(bp.init(lm, n, {2, 3}));
  const std::vector<double> ones(LH, 1.0);
  require_ok(bp.forward(lm, t.data(), n, ones.data()));
  const std::vector<double> target(bp.hidden(), bp.hidden() + n * c.dim);
  auto g = kvtest::rng(17);
  std::uniform_real_distribution<double> a_d(0.2, 0.8);
  std::vector<double> alpha(LH);
  for (double& a : alpha) a = a_d(g);
  auto loss_at = [&](const std::vector<double>& a, std::vector<double>* grad) {
    double loss = 0;
    if (grad) grad->assign(LH, 0.0);
    require_ok(duo_sample_loss(bp, lm, t, target.data(), from, a.data(), &loss, grad ? grad->data() : nullptr));
    return loss;
  };
  std::vector<double> grad;
  const double at_alpha = loss_at(alpha, &grad);
  CHECK(at_alpha > 0);
  CHECK(loss_at(ones, nullptr) == 0.0);  // the full model reproduces its own hidden states
  const double h = 1e-5;
  double worst = 0;
  for (std::size_t i = 0; i < LH; ++i) {
    std::vector<double> p = alpha, q = alpha;
    p[i] += h;
    q[i] -= h;
    const double fd = (loss_at(p, nullptr) - loss_at(q, nullptr)) / (2 * h);
    const double err = std::fabs(fd - grad[i]) / std::max(1e-6, std::fabs(fd));
    worst = std::max(worst, err);
    CHECK_MESSAGE(err < 1e-5, "alpha ", i, ": analytic ", grad[i], " vs central difference ", fd);
  }
  std::printf("DuoAttention gradient check (%zu alpha, %lld tokens): worst relative error %.2e\n", LH,
              static_cast<long long>(n), worst);
}

TEST_CASE("gate training: a short run moves PruLong's sparsity towards its target and lowers Duo's gates") {
  const model& m = kvtest::shipped_model();
  gated_lm<float> lm;
  lm.from(m);
  std::vector<gate_sample> samples;
  require_ok(make_gate_samples(m, 2, 2, samples));
  for (gate_sample& s : samples) {  // short texts keep the test fast
    s.tokens.resize(48);
    s.response_from = 32;
  }
  gate_train_options o;
  o.steps = 12;
  o.batch = 2;
  o.threads = 2;
  prulong_train_options p;
  p.target = 0.5;
  p.lr = p.lr_lambda = 1.0;  // Table 5's rates: the gates move within the few steps of a test
  p.lambda_rule = lambda_update::adam;  // the multipliers' Adam ascent (the shipped default, plain ascent, is slower)
  prulong_result r;
  require_ok(train_prulong(lm, samples, o, p, r));
  std::printf("PruLong, 12 steps: expected sparsity %.3f (target 0.5), lambda1 %.3f, lambda2 %.3f\n", r.sparsity, r.lambda1, r.lambda2);
  CHECK(r.sparsity > 0.05);  // from 0.002 at the initialisation
  // every step measured: the expected and the achieved (deterministic gate < 0.5) sparsity
  REQUIRE(r.history.size() == 12);
  CHECK(r.history.back().expected == doctest::Approx(r.sparsity).epsilon(1e-12));
  CHECK(r.history.back().achieved == prulong_closed_sparsity(r.log_alpha));
  CHECK(r.history.back().below_half == prulong_achieved_sparsity(r.log_alpha));
  CHECK(r.history.back().target == doctest::Approx(0.5));
  index_t below = 0, closed = 0;
  for (double a : r.log_alpha) {
    below += a < 0.0 ? 1 : 0;                     // deterministic gate < 0.5 <=> log_alpha < 0
    closed += a < (2.0 / 3.0) * std::log(0.1 / 1.1) ? 1 : 0;  // P(z > 0) < 1/2 <=> log_alpha < beta log(-l / r)
  }
  CHECK(r.below_half == static_cast<double>(below) / 20.0);
  CHECK(r.achieved == static_cast<double>(closed) / 20.0);
  double ones = 0;
  for (float v : r.mask) ones += v;
  CHECK(ones == 10.0);  // the top-k discretisation at 50 % of 20 heads
  // the same seed gives the same gates with one thread
  gate_train_options o1 = o;
  o1.threads = 1;
  prulong_result r1;
  require_ok(train_prulong(lm, samples, o1, p, r1));
  CHECK(r1.log_alpha == r.log_alpha);

  require_ok(duo_targets(lm, samples, 2));
  duo_train_options d;
  d.reg = 0.5;
  duo_result dr;
  require_ok(train_duo(lm, samples, o, d, dr));
  double mean = 0;
  for (double a : dr.alpha) {
    CHECK(a >= 0.0);
    CHECK(a <= 1.0);
    mean += a / static_cast<double>(dr.alpha.size());
  }
  std::printf("Duo, 12 steps: mean alpha %.3f\n", mean);
  CHECK(mean < 1.0);
}
