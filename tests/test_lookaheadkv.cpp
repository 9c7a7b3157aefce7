// LookaheadKV on the reference runner (examples/lookaheadkv/*.hpp): every backward piece and
// the whole training chain against central finite differences (double), on a tiny random model
// and on stories260K; the float training forward against the runner; LoRA inactive outside the
// lookahead rows; the module file (round trip and every load error); reproducible training; a
// short training run lowering the loss; the scorer (scores.hpp) against the library's attention_scores.
#include "support.hpp"
#include "support/shipped.hpp"

#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <lookaheadkv/data.hpp>
#include <lookaheadkv/module.hpp>
#include <lookaheadkv/scores.hpp>
#include <lookaheadkv/train.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>

#include <kvevict/gqa.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/score.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

using namespace kvrun;
using kvtest::require_error;

namespace {

// ---------------------------------------------------------------------------------------------
// Models

struct tiny_spec {
  int dim, hidden, layers, heads, kv_heads, vocab, seq_len;
};

// A llama2.c checkpoint with random weights (shared classifier), loaded through the runner.
model make_model(const tiny_spec& s, std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  const index_t d = s.dim, h = s.hidden, L = s.layers, hs = s.dim / s.heads, kvd = hs * s.kv_heads, V = s.vocab;
  const index_t floats = V * d + L * d + L * d * d + 2 * L * kvd * d + L * d * d + L * d + 3 * L * h * d + d +
                         index_t(s.seq_len) * hs;
  std::vector<float> w = kvtest::random_floats(g, static_cast<std::size_t>(floats), -0.4f, 0.4f);
  std::uniform_real_distribution<float> gain(0.6f, 1.4f);
  const index_t rms_att = V * d, rms_ffn = rms_att + L * d + 2 * L * d * d + 2 * L * kvd * d;
  const index_t rms_final = rms_ffn + L * d + 3 * L * h * d;
  for (index_t i = 0; i < L * d; ++i) {
    w[static_cast<std::size_t>(rms_att + i)] = gain(g);
    w[static_cast<std::size_t>(rms_ffn + i)] = gain(g);
  }
  for (index_t i = 0; i < d; ++i) w[static_cast<std::size_t>(rms_final + i)] = gain(g);
  const std::int32_t header[7] = {s.dim, s.hidden, s.layers, s.heads, s.kv_heads, s.vocab, s.seq_len};
  std::vector<unsigned char> bytes(sizeof header + w.size() * sizeof(float));
  std::memcpy(bytes.data(), header, sizeof header);
  std::memcpy(bytes.data() + sizeof header, w.data(), w.size() * sizeof(float));
  model m;
  const status st = model::load(bytes.data(), bytes.size(), m);
  REQUIRE_MESSAGE(st.ok(), st.message());
  return m;
}

const tiny_spec tiny{16, 24, 3, 4, 2, 40, 64};

void require_ok(const status& st) { REQUIRE_MESSAGE(st.ok(), std::string(st.message())); }

text_pair random_pair(const model& m, index_t P, index_t Y, std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  text_pair p;
  p.prompt.push_back(bos_token);
  while (static_cast<index_t>(p.prompt.size()) < P)
    p.prompt.push_back(static_cast<int>(kvtest::uniform_int(g, 3, m.cfg().vocab_size - 1)));
  while (static_cast<index_t>(p.response.size()) < Y)
    p.response.push_back(static_cast<int>(kvtest::uniform_int(g, 3, m.cfg().vocab_size - 1)));
  return p;
}

lookahead_sample sample_of(const model& m, const text_pair& p) {
  runner run;
  kv_cache cache;
  require_ok(run.init(m));
  require_ok(cache.init(m.cfg()));
  std::vector<unsigned char> ws;
  lookahead_sample s;
  require_ok(prepare_sample(run, cache, p, s, ws));
  return s;
}

// A module with every parameter random (B != 0, so every path carries gradient).
template <class T>
basic_lookahead_module<T> random_module(const model& m, const lookahead_config& c, std::uint64_t seed, double scale) {
  basic_lookahead_module<T> mod;
  require_ok(mod.init(m, c, seed));
  auto g = kvtest::rng(seed + 99);
  std::uniform_real_distribution<double> u(-scale, scale);
  const index_t emb = c.n_lookahead * m.cfg().dim;
  for (index_t i = emb; i < mod.param_count(); ++i) mod.params()[static_cast<std::size_t>(i)] = static_cast<T>(u(g));
  return mod;
}

// Central difference of f at x[i] with step h (x restored). Its error is O(h^2) from truncation
// plus ~1e-16 |f| / h from rounding, hence absolute tolerances of ~1e-8 for sums of order 1.
double central(std::function<double()> f, double& xi, double h) {
  const double x0 = xi;
  xi = x0 + h;
  const double fp = f();
  xi = x0 - h;
  const double fm = f();
  xi = x0;
  return (fp - fm) / (2 * h);
}

void check_close(double analytic, double numeric, double rel, double abs_tol, const std::string& what) {
  INFO(what, ": analytic ", analytic, " numeric ", numeric);
  CHECK(std::fabs(analytic - numeric) <= rel * std::max(std::fabs(analytic), std::fabs(numeric)) + abs_tol);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Backward pieces

TEST_CASE("RMSNorm backward matches central differences") {
  auto g = kvtest::rng(1);
  std::uniform_real_distribution<double> u(-1.5, 1.5);
  for (int trial = 0; trial < 20; ++trial) {
    const index_t d = kvtest::uniform_int(g, 1, 12);
    std::vector<double> x(d), w(d), dy(d), y(d), dx(d, 0.0);
    for (index_t j = 0; j < d; ++j) x[j] = u(g), w[j] = u(g), dy[j] = u(g);
    const double r = lkv::rmsnorm_forward(x.data(), w.data(), d, y.data());
    lkv::rmsnorm_backward(x.data(), w.data(), r, dy.data(), d, dx.data(), false);
    auto f = [&] {
      std::vector<double> yy(d);
      lkv::rmsnorm_forward(x.data(), w.data(), d, yy.data());
      double s = 0;
      for (index_t j = 0; j < d; ++j) s += dy[j] * yy[j];
      return s;
    };
    for (index_t j = 0; j < d; ++j) check_close(dx[j], central(f, x[j], 1e-5), 1e-6, 1e-8, "rmsnorm dx");
    // accumulate adds
    std::vector<double> acc(d, 1.0);
    lkv::rmsnorm_backward(x.data(), w.data(), r, dy.data(), d, acc.data(), true);
    for (index_t j = 0; j < d; ++j) CHECK(acc[j] == doctest::Approx(1.0 + dx[j]).epsilon(1e-14));
  }
}

TEST_CASE("RoPE and SwiGLU backward match central differences") {
  auto g = kvtest::rng(2);
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  const index_t hs = 6, width = 18;
  std::vector<double> cs(hs / 2), sn(hs / 2);
  for (index_t i = 0; i < hs / 2; ++i) {
    const double a = u(g) * 3;
    cs[i] = std::cos(a), sn[i] = std::sin(a);
  }
  std::vector<double> v(width), dy(width);
  for (index_t j = 0; j < width; ++j) v[j] = u(g), dy[j] = u(g);
  std::vector<double> dv = dy;
  lkv::rope_backward(dv.data(), width, hs, cs.data(), sn.data());
  auto f = [&] {
    std::vector<double> y = v;
    lkv::rope_forward(y.data(), width, hs, cs.data(), sn.data());
    double s = 0;
    for (index_t j = 0; j < width; ++j) s += dy[j] * y[j];
    return s;
  };
  for (index_t j = 0; j < width; ++j) check_close(dv[j], central(f, v[j], 1e-5), 1e-7, 1e-8, "rope");

  const index_t n = 25;
  std::vector<double> u1(n), u3(n), dout(n), du1(n), du3(n);
  for (index_t i = 0; i < n; ++i) u1[i] = 4 * u(g), u3[i] = u(g), dout[i] = u(g);
  lkv::swiglu_backward(u1.data(), u3.data(), dout.data(), n, du1.data(), du3.data());
  auto fs = [&] {
    std::vector<double> o(n);
    lkv::swiglu_forward(u1.data(), u3.data(), n, o.data());
    double s = 0;
    for (index_t i = 0; i < n; ++i) s += dout[i] * o[i];
    return s;
  };
  for (index_t i = 0; i < n; ++i) {
    check_close(du1[i], central(fs, u1[i], 1e-5), 1e-6, 1e-8, "swiglu du1");
    check_close(du3[i], central(fs, u3[i], 1e-5), 1e-6, 1e-8, "swiglu du3");
  }
}

TEST_CASE("block attention (causal block over fixed prompt KV): both outputs' backward matches central differences") {
  auto g = kvtest::rng(3);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int trial = 0; trial < 16; ++trial) {
    lkv::attention_shape s;
    s.Hkv = kvtest::uniform_int(g, 1, 3);
    s.H = s.Hkv * kvtest::uniform_int(g, 1, 3);
    s.hs = 2 * kvtest::uniform_int(g, 1, 3);
    s.n = kvtest::uniform_int(g, 1, 4);
    s.P = kvtest::uniform_int(g, 1, 6);
    const double peak = trial % 3 == 0 ? 4.0 : 1.0;  // some peaked softmax rows
    auto fill = [&](index_t count, double sc) {
      std::vector<double> v(static_cast<std::size_t>(count));
      for (auto& x : v) x = sc * u(g);
      return v;
    };
    auto q = fill(s.n * s.H * s.hs, peak), kb = fill(s.n * s.Hkv * s.hs, peak), vb = fill(s.n * s.Hkv * s.hs, 1);
    auto kp = fill(s.Hkv * s.P * s.hs, peak), vp = fill(s.Hkv * s.P * s.hs, 1);
    // trial % 4: 0 both outputs, 1 attention output only, 2 estimate only (the last layer), 3 both
    const bool use_out = trial % 4 != 2, use_est = trial % 4 != 1;
    auto dout = fill(s.n * s.H * s.hs, 1), dest = fill(s.H * s.P, 3);
    std::vector<double> probs(static_cast<std::size_t>(s.H * s.n * s.width())), out(dout.size()), est(dest.size());
    lkv::block_attention_forward(s, q.data(), kb.data(), vb.data(), kp.data(), vp.data(), probs.data(), out.data(),
                                 est.data());
    std::vector<double> dq(q.size()), dkb(kb.size()), dvb(vb.size()), row(static_cast<std::size_t>(s.width()));
    lkv::block_attention_backward(s, q.data(), kb.data(), vb.data(), kp.data(), vp.data(), probs.data(),
                                  use_out ? dout.data() : nullptr, use_est ? dest.data() : nullptr, dq.data(),
                                  dkb.data(), dvb.data(), row.data());
    auto f = [&] {
      std::vector<double> pr(probs.size()), o(out.size()), e(est.size());
      lkv::block_attention_forward(s, q.data(), kb.data(), vb.data(), kp.data(), vp.data(), pr.data(), o.data(), e.data());
      double sum = 0;
      if (use_out)
        for (std::size_t i = 0; i < o.size(); ++i) sum += dout[i] * o[i];
      if (use_est)
        for (std::size_t i = 0; i < e.size(); ++i) sum += dest[i] * e[i];
      return sum;
    };
    CAPTURE(trial);
    for (std::size_t i = 0; i < q.size(); ++i) check_close(dq[i], central(f, q[i], 1e-5), 1e-6, 1e-8, "dq");
    for (std::size_t i = 0; i < kb.size(); ++i) check_close(dkb[i], central(f, kb[i], 1e-5), 1e-6, 1e-8, "dk_block");
    for (std::size_t i = 0; i < vb.size(); ++i) check_close(dvb[i], central(f, vb[i], 1e-5), 1e-6, 1e-8, "dv_block");

    // the estimate and its gradient are the library's window scores and their backward
    const index_t group = s.H / s.Hkv;
    std::vector<double> lib_dq(q.size(), 0.0), lib_dk(kb.size(), 0.0), lib_s(static_cast<std::size_t>(s.P));
    std::vector<unsigned char> ws;
    for (index_t h = 0; h < s.H; ++h) {
      const index_t gk = h / group;
      auto qh = lkv::mat<const double>(q.data() + h * s.hs, s.n, s.hs, s.H * s.hs);
      auto kph = lkv::mat<const double>(kp.data() + gk * s.P * s.hs, s.P, s.hs, s.hs);
      auto kbh = lkv::mat<const double>(kb.data() + gk * s.hs, s.n, s.hs, s.Hkv * s.hs);
      require_ok(with_workspace(ws, [&](kvevict::workspace& w) {
        return kvevict::lookahead_window_scores(kvevict::seq, w, qh, kph, kbh, lkv::vec(lib_s.data(), s.P));
      }));
      for (index_t j = 0; j < s.P; ++j)
        CHECK(est[static_cast<std::size_t>(h * s.P + j)] == doctest::Approx(lib_s[static_cast<std::size_t>(j)]).epsilon(1e-13));
      kvevict::lookahead_window_options o;
      o.accumulate = true;
      require_ok(with_workspace(ws, [&](kvevict::workspace& w) {
        return kvevict::lookahead_window_scores_backward(
            kvevict::seq, w, qh, kph, kbh, lkv::vec<const double>(dest.data() + h * s.P, s.P),
            lkv::mat(lib_dq.data() + h * s.hs, s.n, s.hs, s.H * s.hs), lkv::mat(lib_dk.data() + gk * s.hs, s.n, s.hs, s.Hkv * s.hs), o);
      }));
    }
    if (!use_out && use_est) {
      for (std::size_t i = 0; i < q.size(); ++i) CHECK(dq[i] == doctest::Approx(lib_dq[i]).epsilon(1e-12).scale(1e-12));
      for (std::size_t i = 0; i < kb.size(); ++i) CHECK(dkb[i] == doctest::Approx(lib_dk[i]).epsilon(1e-12).scale(1e-12));
      for (double v : dvb) CHECK(v == 0.0);
    }
  }
}

TEST_CASE("frozen linear backward (dx = dy W) matches central differences") {
  auto g = kvtest::rng(4);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const index_t rows = 3, in = 5, out = 4;
  std::vector<double> w(out * in), x(rows * in), dy(rows * out), dx(rows * in);
  for (auto& v : w) v = u(g);
  for (auto& v : x) v = u(g);
  for (auto& v : dy) v = u(g);
  auto wv = *kvevict::make_matrix_view<const double>(w.data(), out, in);
  lkv::linear_backward_input(wv, dy.data(), rows, dx.data(), false);
  auto f = [&] {
    double s = 0;
    for (index_t t = 0; t < rows; ++t)
      for (index_t o = 0; o < out; ++o) {
        double y = 0;
        for (index_t i = 0; i < in; ++i) y += x[t * in + i] * w[o * in + i];
        s += dy[t * out + o] * y;
      }
    return s;
  };
  for (std::size_t i = 0; i < x.size(); ++i) check_close(dx[i], central(f, x[i], 1e-5), 1e-7, 1e-8, "linear dx");
}

// ---------------------------------------------------------------------------------------------
// The whole chain

namespace {

// Checks d loss / d param against central differences for `coords` parameter indices.
void check_chain(const model& m, const lookahead_sample& sf, const basic_lookahead_module<double>& mod0,
                 const std::vector<index_t>& coords, double rel) {
  frozen_model<double> fm;
  fm.from(m);
  const auto s = sf.cast<double>();
  auto mod = mod0;
  lookahead_backprop<double> bp;
  require_ok(bp.init(fm, mod, s.P));
  std::vector<double> grad(static_cast<std::size_t>(mod.param_count()), 0.0);
  double loss = 0;
  require_ok(bp.loss_and_grad(fm, mod, s, &loss, grad.data()));
  CHECK(loss > 0);
  auto f = [&] {
    double l = 0;
    require_ok(bp.loss_and_grad(fm, mod, s, &l, nullptr));
    return l;
  };
  int nonzero = 0;
  for (index_t c : coords) {
    double& p = mod.params()[static_cast<std::size_t>(c)];
    const double h = 1e-5 * std::max(1.0, std::fabs(p));
    const double num = central(f, p, h);
    CAPTURE(c);
    check_close(grad[static_cast<std::size_t>(c)], num, rel, 1e-9, "chain");
    nonzero += std::fabs(grad[static_cast<std::size_t>(c)]) > 1e-7;
  }
  CHECK(nonzero > static_cast<int>(coords.size()) / 2);  // the checked gradients are not trivially 0
}

// Parameter indices: some embedding entries, and a few entries of A and B of every adapter.
std::vector<index_t> chain_coords(const basic_lookahead_module<double>& mod, int per_tensor, std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  std::vector<index_t> c;
  const index_t emb = mod.n_lookahead() * mod.dims().dim;
  for (int i = 0; i < per_tensor * 2; ++i) c.push_back(kvtest::uniform_int(g, 0, emb - 1));
  for (int l = 0; l < mod.dims().n_layers; ++l)
    for (projection p : lora_order) {
      if (!mod.adapted(p)) continue;
      const index_t a = mod.offset(l, p), na = mod.dims().in(p) * mod.rank(), nb = mod.rank() * mod.dims().out(p);
      for (int i = 0; i < per_tensor; ++i) {
        c.push_back(a + kvtest::uniform_int(g, 0, na - 1));
        c.push_back(a + na + kvtest::uniform_int(g, 0, nb - 1));
      }
    }
  return c;
}

}  // namespace

TEST_CASE("whole chain on a tiny random model: gradients of embeddings and every adapter match central differences") {
  const model m = make_model(tiny, 11);
  for (unsigned placement : {lora_all, lora_qv, lora_none}) {
    for (index_t n : {1, 3}) {
      CAPTURE(placement);
      CAPTURE(n);
      const lookahead_sample s = sample_of(m, random_pair(m, 9, 5, 21 + static_cast<std::uint64_t>(n)));
      lookahead_config c;
      c.n_lookahead = n;
      c.rank = 2;
      c.alpha = 3.0f;
      c.placement = placement;
      const auto mod = random_module<double>(m, c, 5 + placement, 0.3);
      check_chain(m, s, mod, chain_coords(mod, 2, 7), 1e-5);
    }
  }
}

TEST_CASE("whole chain on stories260K: a few coordinates of every kind match central differences") {
  const model& m = kvtest::shipped_model();
  const lookahead_sample s = sample_of(m, random_pair(m, 40, 12, 5));
  lookahead_config c;
  c.n_lookahead = 4;
  const auto mod = random_module<double>(m, c, 3, 0.05);
  check_chain(m, s, mod, chain_coords(mod, 1, 9), 1e-5);
}

// ---------------------------------------------------------------------------------------------
// Inference: the runner with the projection hook, against the training forward and the library

namespace {

kvevict::kv_view<const float> heads_view(const float* p, index_t heads, index_t rows, index_t hs, index_t row_stride) {
  return *kvevict::make_kv_view<const float>(p, heads, rows, hs, hs, row_stride);
}

struct small_data {
  std::vector<text_pair> pairs;
  std::vector<lookahead_sample> samples;
};

pair_options small_pairs() {
  pair_options o;
  o.response = 16;
  o.max_prompt = 96;
  o.long_min = 64;
  o.min_prompt = 24;
  return o;
}

const small_data& stories_data() {
  static small_data d;
  static const bool made = [] {
    require_ok(make_training_samples(kvtest::shipped_model(), small_pairs(), 100, 112, d.pairs, d.samples, 2));
    return true;
  }();
  (void)made;
  return d;
}

}  // namespace

TEST_CASE("lookahead_scores: the runner's lookahead rows equal the training forward, and the scores are attention_scores") {
  const model& m = kvtest::shipped_model();
  const config& c = m.cfg();
  const auto& d = stories_data();
  lookahead_config cfg;
  cfg.n_lookahead = 8;
  const auto mod = random_module<float>(m, cfg, 17, 0.05);
  frozen_model<float> fm;
  fm.from(m);
  lookahead_backprop<float> bp;
  require_ok(bp.init(fm, mod, 128));
  lookahead_scorer scorer;
  require_ok(scorer.init(m, mod));
  runner run;
  kv_cache cache;
  require_ok(run.init(m));
  require_ok(cache.init(c));
  std::vector<unsigned char> ws;
  for (std::size_t i = 0; i < 3; ++i) {
    const text_pair& p = d.pairs[i];
    const lookahead_sample& s = d.samples[i];
    const index_t P = s.P, n = cfg.n_lookahead, H = c.n_heads, Hkv = c.n_kv_heads, hs = c.head_size();
    cache.clear();
    require_ok(run.forward(cache, tokens(p.prompt), logits_mode::none));
    require_ok(scorer.score(run, cache));
    CHECK(scorer.tokens() == P);
    double loss = 0;
    require_ok(bp.loss_and_grad(fm, mod, s, &loss, nullptr));
    int identical = 0, total = 0;
    double worst = 0;
    for (int l = 0; l < c.n_layers; ++l) {
      // attention_scores on the training forward's queries and keys, and the sample's prompt keys
      std::vector<float> ref(static_cast<std::size_t>(H * P)), pooled(ref.size()), reduced(static_cast<std::size_t>(Hkv * P));
      auto out = *kvevict::make_matrix_view(ref.data(), H, P);
      require_ok(with_workspace(ws, [&](kvevict::workspace& w) {
        return kvevict::attention_scores(kvevict::seq, w, heads_view(bp.queries(l), H, n, hs, c.dim),
                                         *kvevict::make_kv_view<const float>(s.keys.data() + index_t(l) * Hkv * P * hs, Hkv, P, hs),
                                         heads_view(bp.keys(l), Hkv, n, hs, c.kv_dim()), out);
      }));
      const auto raw = scorer.raw_scores(l);
      for (index_t h = 0; h < H; ++h)
        for (index_t t = 0; t < P; ++t) {
          identical += raw(h, t) == ref[static_cast<std::size_t>(h * P + t)];
          ++total;
          // the training estimate (its own softmax) agrees to float rounding
          const double e = bp.estimates()[(l * H + h) * P + t];
          worst = std::max(worst, std::fabs(e - raw(h, t)) / (std::fabs(e) + 1e-6));
        }
      // scores = max pool 7 then GQA mean of raw
      require_ok(kvevict::pool1d(kvevict::seq, kvevict::matrix_view<const float>(out),
                                 *kvevict::make_matrix_view(pooled.data(), H, P), kvevict::pool_kind::max, 7));
      require_ok(kvevict::gqa_reduce(kvevict::seq, *kvevict::make_matrix_view<const float>(pooled.data(), H, P),
                                     *kvevict::make_matrix_view(reduced.data(), Hkv, P), kvevict::gqa_op::mean));
      const auto sc = scorer.scores(l);
      for (index_t h = 0; h < Hkv; ++h)
        for (index_t t = 0; t < P; ++t) CHECK(sc(h, t) == reduced[static_cast<std::size_t>(h * P + t)]);
    }
    // same queries and keys bit for bit => the same attention_scores bit for bit
    CHECK(identical == total);
    MESSAGE("pair " << i << ": training estimate vs lookahead_scores, max relative difference " << worst);
    CHECK(worst < 1e-4);
  }
}

TEST_CASE("LoRA is inactive outside the lookahead rows: prompt KV and logits are bit-identical with and without the module") {
  const model& m = kvtest::shipped_model();
  const config& c = m.cfg();
  const auto& d = stories_data();
  lookahead_config cfg;
  cfg.n_lookahead = 6;
  const auto mod = random_module<float>(m, cfg, 23, 0.2);
  lookahead_scorer scorer;
  require_ok(scorer.init(m, mod));
  runner run;
  require_ok(run.init(m));
  const text_pair& p = d.pairs[3];
  const index_t P = static_cast<index_t>(p.prompt.size());
  kv_cache plain, scored;
  require_ok(plain.init(c));
  require_ok(scored.init(c));
  require_ok(run.forward(plain, tokens(p.prompt), logits_mode::last));
  require_ok(run.forward(scored, tokens(p.prompt), logits_mode::last));
  require_ok(scorer.score(run, scored));
  CHECK(scored.next_position() == plain.next_position());
  auto same_cache = [&](const kv_cache& a, const kv_cache& b) {
    for (int l = 0; l < c.n_layers; ++l)
      for (index_t h = 0; h < c.n_kv_heads; ++h) {
        REQUIRE(a.length(l, h) == b.length(l, h));
        const auto bytes = static_cast<std::size_t>(c.head_size()) * sizeof(float);  // row by row: pages may lie anywhere
        for (index_t j = 0; j < a.length(l, h); ++j) {
          CHECK(std::memcmp(a.key_row(l, h, j), b.key_row(l, h, j), bytes) == 0);
          CHECK(std::memcmp(a.value_row(l, h, j), b.value_row(l, h, j), bytes) == 0);
        }
      }
  };
  same_cache(plain, scored);
  // the response decoded on both caches: identical logits
  std::vector<float> la, lb;
  require_ok(run.forward(plain, tokens(p.response), logits_mode::all));
  la.assign(run.logits(0), run.logits(0) + static_cast<index_t>(p.response.size()) * c.vocab_size);
  require_ok(run.forward(scored, tokens(p.response), logits_mode::all));
  lb.assign(run.logits(0), run.logits(0) + static_cast<index_t>(p.response.size()) * c.vocab_size);
  CHECK(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0);
  same_cache(plain, scored);

  // one block [prompt ; lookahead] with the adapters on the lookahead rows only: the prompt rows'
  // keys, values and logits are those of a plain prefill, the lookahead rows' are the scorer's
  std::vector<float> rows(static_cast<std::size_t>((P + cfg.n_lookahead) * c.dim));
  for (index_t i = 0; i < P; ++i) std::copy(m.embedding(p.prompt[i]), m.embedding(p.prompt[i]) + c.dim, rows.begin() + i * c.dim);
  std::copy(mod.embeddings(), mod.embeddings() + cfg.n_lookahead * c.dim, rows.begin() + P * c.dim);
  forward_hooks lora_rows;
  lora_rows.after_projection = [&](const projection_event& ev) -> status {
    if (!mod.adapted(ev.which)) return {};
    // delta = (alpha/r)(x A) B with kvevict::lora_linear_forward on rows [P, P + n): the adapter-free
    // rows are recomputed by the same function and must equal the runner's output bit for bit
    const index_t n = ev.rows;
    std::vector<float> y(static_cast<std::size_t>(n * ev.out)), xa(static_cast<std::size_t>(cfg.n_lookahead * mod.rank()));
    frozen_model<float> fm;
    fm.from(m);
    require_ok(kvevict::lora_linear_forward(kvevict::seq, lkv::mat<const float>(ev.input, n, ev.in, ev.input_stride),
                                            fm.weight(ev.layer, ev.which), mod.adapter(ev.layer, ev.which),
                                            kvevict::row_range{P, n}, lkv::mat(xa.data(), cfg.n_lookahead, mod.rank(), mod.rank()),
                                            lkv::mat(y.data(), n, ev.out, ev.out)));
    for (index_t i = 0; i < n; ++i)
      for (index_t o = 0; o < ev.out; ++o) {
        float& dst = ev.output[i * ev.output_stride + o];
        if (i < P) CHECK(dst == y[static_cast<std::size_t>(i * ev.out + o)]);
        dst = y[static_cast<std::size_t>(i * ev.out + o)];
      }
    return {};
  };
  kv_cache joint;
  require_ok(joint.init(c));
  require_ok(run.forward(joint, embeddings(rows.data(), P + cfg.n_lookahead), logits_mode::all, lora_rows));
  for (int l = 0; l < c.n_layers; ++l)
    for (index_t h = 0; h < c.n_kv_heads; ++h) {
      const auto bytes = static_cast<std::size_t>(c.head_size()) * sizeof(float);  // row by row: pages may lie anywhere
      for (index_t j = 0; j < P; ++j) {
        CHECK(std::memcmp(joint.key_row(l, h, j), scored.key_row(l, h, j), bytes) == 0);
        CHECK(std::memcmp(joint.value_row(l, h, j), scored.value_row(l, h, j), bytes) == 0);
      }
    }
}

// ---------------------------------------------------------------------------------------------
// The module file

TEST_CASE("module file: round trip, and every load error") {
  const model& m = kvtest::shipped_model();
  lookahead_config cfg;
  cfg.n_lookahead = 5;
  cfg.rank = 3;
  cfg.alpha = 6.0f;
  cfg.placement = lora_qv | lora_bit(projection::w2);
  const auto mod = random_module<float>(m, cfg, 31, 0.1);
  const auto bytes = serialize(mod);
  REQUIRE(bytes.size() == lookahead_header_bytes + static_cast<std::size_t>(mod.param_count()) * 4);
  lookahead_module back;
  require_ok(deserialize(bytes.data(), bytes.size(), back));
  CHECK(back.n_lookahead() == 5);
  CHECK(back.rank() == 3);
  CHECK(back.alpha() == 6.0f);
  CHECK(back.placement() == cfg.placement);
  CHECK(std::memcmp(back.params().data(), mod.params().data(), mod.params().size() * sizeof(float)) == 0);
  require_ok(back.check_model(m.cfg()));

  const std::string path =
      (std::filesystem::temp_directory_path() / ("kvrun_lookahead_" + std::to_string(std::random_device{}()) + ".bin")).string();
  require_ok(save_module(mod, path));
  lookahead_module from_file;
  require_ok(load_module(path, from_file));
  CHECK(serialize(from_file) == bytes);
  std::filesystem::remove(path);
  require_error(load_module(path, from_file), errc::io_error, "cannot open");
  require_error(save_module(mod, "/nonexistent/dir/m.bin"), errc::io_error, "cannot create");

  auto expect = [&](std::vector<unsigned char> b, const std::string& needle) {
    lookahead_module out = back;
    require_error(deserialize(b.data(), b.size(), out), errc::format_error, needle);
    CHECK(serialize(out) == bytes);  // unchanged on failure
  };
  auto patch_u32 = [&](std::size_t off, std::uint32_t v) {
    auto b = bytes;
    for (int i = 0; i < 4; ++i) b[off + static_cast<std::size_t>(i)] = static_cast<unsigned char>(v >> (8 * i));
    return b;
  };
  expect(std::vector<unsigned char>(bytes.begin(), bytes.begin() + 51), "shorter than the 52-byte header");
  {
    auto b = bytes;
    b[0] = 'X';
    expect(b, "bad magic");
  }
  expect(patch_u32(8, 2), "version 2 is not supported");
  expect(patch_u32(12, 0), "invalid model dims");
  expect(patch_u32(12, 63), "invalid model dims");  // dim not divisible by n_heads
  expect(patch_u32(24, 3), "invalid model dims");   // n_heads 8 not a multiple of 3 kv heads
  expect(patch_u32(36, 0), "n_lookahead 0 is outside");
  expect(patch_u32(40, 0), "rank 0 is outside");
  expect(patch_u32(44, 0x7F800000u), "alpha is not finite");
  expect(patch_u32(48, 0x80u), "unknown placement bits 0x80");
  expect(std::vector<unsigned char>(bytes.begin(), bytes.end() - 4), "truncated by 4 bytes");
  {
    auto b = bytes;
    b.push_back(0);
    expect(b, "trailing 1 bytes");
  }
  expect(patch_u32(48, lora_all), "truncated by");  // more adapters than the file holds
  expect(patch_u32(lookahead_header_bytes + 8, 0x7FC00000u), "parameter 2 is not finite");

  // a module made for another model: the first differing dimension is named
  const model tiny_model = make_model(tiny, 3);
  lookahead_module other;
  require_ok(other.init(tiny_model, cfg, 1));
  require_error(other.check_model(m.cfg()), errc::shape_mismatch, "lookahead module was trained for dim 16 but the model has dim 64");
  lookahead_scorer scorer;
  require_error(scorer.init(m, other), errc::shape_mismatch, "trained for dim 16 but the model has dim 64");
  const auto b2 = patch_u32(16, 4);  // 4 layers instead of 5
  lookahead_module four;
  const auto b2b = std::vector<unsigned char>(b2.begin(), b2.end() - static_cast<std::ptrdiff_t>(
      4 * (mod.param_count() - 5 * 64 - 4 * 3 * (64 + 64 + 64 + 32 + 172 + 64))));
  require_ok(deserialize(b2b.data(), b2b.size(), four));
  require_error(four.check_model(m.cfg()), errc::shape_mismatch, "trained for n_layers 4 but the model has n_layers 5");
  // invalid configurations
  lookahead_module bad;
  lookahead_config z = cfg;
  z.n_lookahead = 0;
  require_error(bad.init(m, z, 1), errc::invalid_argument, "n_lookahead 0");
  z = cfg;
  z.placement = 1u << 9;
  require_error(bad.init(m, z, 1), errc::invalid_argument, "unknown placement bits");
  unsigned bits = 0;
  require_ok(parse_placement("q+v+w2", bits));
  CHECK(bits == (lora_qv | lora_bit(projection::w2)));
  CHECK(placement_name(bits) == "q+v+w2");
  require_error(parse_placement("q+x", bits), errc::invalid_argument, "'x' is not one of");
}

TEST_CASE("lookahead_scorer errors: ragged cache, no room for the block, another model's runner") {
  const model& m = kvtest::shipped_model();
  lookahead_config cfg;
  cfg.n_lookahead = 8;
  lookahead_module mod;
  require_ok(mod.init(m, cfg, 1));
  lookahead_scorer scorer;
  runner run;
  kv_cache cache;
  require_ok(run.init(m));
  require_ok(cache.init(m.cfg()));
  require_error(scorer.score(run, cache), errc::invalid_argument, "not initialised");
  require_ok(scorer.init(m, mod));
  require_error(scorer.score(run, cache), errc::invalid_argument, "holds no prompt");
  std::vector<int> prompt(508, 5);
  prompt[0] = bos_token;
  require_ok(run.forward(cache, tokens(prompt), logits_mode::none));
  require_error(scorer.score(run, cache), errc::out_of_range, "508 prompt tokens + 8 lookahead tokens exceed the context of 512");
  cache.clear();
  prompt.resize(40);
  require_ok(run.forward(cache, tokens(prompt), logits_mode::none));
  const std::int32_t cu[5] = {0, 40, 79, 119, 159};
  std::vector<kvevict::pos_t> keep;
  for (int h = 0; h < 4; ++h)
    for (int t = 0; t < 40; ++t)
      if (!(h == 1 && t == 7)) keep.push_back(t);
  require_ok(cache.compact(2, kvevict::ragged_positions(keep.data(), cu, 4)));
  require_error(scorer.score(run, cache), errc::invalid_argument, "the cache is ragged (layer 2 head 1 holds 39 rows");
  const model other = make_model(tiny, 4);
  runner run2;
  require_ok(run2.init(other));
  require_error(scorer.score(run2, cache), errc::invalid_argument, "another model");
}

// ---------------------------------------------------------------------------------------------
// Data and training

TEST_CASE("pairs: a function of the seed alone; samples from the generation equal a fresh prefill") {
  const model& m = kvtest::shipped_model();
  const auto& d = stories_data();
  std::vector<text_pair> again;
  require_ok(make_pairs(m, small_pairs(), 104, 107, again, 1));
  REQUIRE(again.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(again[i].seed == 104 + i);
    CHECK(again[i].prompt == d.pairs[4 + i].prompt);
    CHECK(again[i].response == d.pairs[4 + i].response);
  }
  for (const auto& p : d.pairs) {
    CHECK(p.prompt.front() == bos_token);
    CHECK(p.prompt.size() >= 24);
    CHECK(p.prompt.size() <= 96);
    CHECK(p.response.size() == 16);
  }
  runner run;
  kv_cache cache;
  require_ok(run.init(m));
  require_ok(cache.init(m.cfg()));
  std::vector<unsigned char> ws;
  for (std::size_t i = 0; i < 2; ++i) {
    lookahead_sample s;
    require_ok(prepare_sample(run, cache, d.pairs[i], s, ws));
    CHECK(s.P == d.samples[i].P);
    CHECK(s.keys == d.samples[i].keys);
    CHECK(s.values == d.samples[i].values);
    CHECK(s.gt == d.samples[i].gt);
  }
  pair_options bad = small_pairs();
  bad.max_prompt = 500;
  require_error(make_pairs(m, bad, 1, 2, again), errc::invalid_argument, "max_prompt + response");
}

TEST_CASE("samples from given prompts: greedy responses and samples equal the generated pairs'; errors before any work") {
  const model& m = kvtest::shipped_model();
  const auto& d = stories_data();
  std::vector<std::vector<int>> prompts;
  for (std::size_t i = 0; i < 3; ++i) prompts.push_back(d.pairs[i].prompt);
  std::vector<text_pair> pairs;
  std::vector<lookahead_sample> samples;
  require_ok(samples_from_prompts(m, prompts, 16, pairs, samples, 2));
  REQUIRE(pairs.size() == 3);
  REQUIRE(samples.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {  // a block prefill gives the bits of the generation's one-token decoding
    CHECK(pairs[i].seed == i);
    CHECK(pairs[i].prompt == d.pairs[i].prompt);
    CHECK(pairs[i].response == d.pairs[i].response);
    CHECK(samples[i].P == d.samples[i].P);
    CHECK(samples[i].keys == d.samples[i].keys);
    CHECK(samples[i].values == d.samples[i].values);
    CHECK(samples[i].gt == d.samples[i].gt);
  }
  require_error(samples_from_prompts(m, {}, 16, pairs, samples), errc::invalid_argument, "none given");
  require_error(samples_from_prompts(m, prompts, 0, pairs, samples), errc::invalid_argument, "response length 0");
  require_error(samples_from_prompts(m, {{bos_token}}, 16, pairs, samples), errc::invalid_argument, "prompt 1: 1 tokens");
  require_error(samples_from_prompts(m, {prompts[0], {5, 6}}, 16, pairs, samples), errc::invalid_argument, "prompt 2");
  require_error(samples_from_prompts(m, {{bos_token, 512}}, 16, pairs, samples), errc::invalid_argument,
                "token 512 is outside the vocabulary");
  require_error(samples_from_prompts(m, {std::vector<int>(500, bos_token)}, 16, pairs, samples), errc::invalid_argument,
                "exceed the context of 512");
  CHECK(pairs.size() == 3);  // an error leaves the outputs as they were
}

TEST_CASE("training: same seed gives the same module bits (any thread count); a short run lowers the loss") {
  const model& m = kvtest::shipped_model();
  const auto& d = stories_data();
  frozen_model<float> fm;
  fm.from(m);
  lookahead_config cfg;
  cfg.n_lookahead = 8;
  train_options o;
  o.steps = 3;
  o.batch = 4;
  o.seed = 7;
  o.log_every = 1;
  auto run_training = [&](int threads) {
    lookahead_module mod;
    require_ok(mod.init(m, cfg, o.seed));
    train_options t = o;
    t.threads = threads;
    int logs = 0;
    require_ok(train_module(fm, d.samples, {}, t, mod, [&](const train_progress& p) {
      ++logs;
      CHECK(p.step == logs);
      CHECK(std::isfinite(p.train_loss));
    }));
    CHECK(logs == 3);
    return mod;
  };
  const auto a = run_training(1), b = run_training(1), c2 = run_training(2);
  lookahead_module init;
  require_ok(init.init(m, cfg, o.seed));
  CHECK(a.params() != init.params());
  CHECK(std::memcmp(a.params().data(), b.params().data(), a.params().size() * sizeof(float)) == 0);
  CHECK(std::memcmp(a.params().data(), c2.params().data(), a.params().size() * sizeof(float)) == 0);

  // a few dozen steps on a handful of pairs lower the training loss
  lookahead_module mod;
  require_ok(mod.init(m, cfg, 3));
  const std::vector<lookahead_sample> few(d.samples.begin(), d.samples.begin() + 6);
  double before = 0, after = 0;
  require_ok(mean_loss(fm, mod, few, 2, before));
  train_options t;
  t.steps = 40;
  t.batch = 6;
  t.log_every = 40;
  require_ok(train_module(fm, few, {}, t, mod));
  require_ok(mean_loss(fm, mod, few, 2, after));
  MESSAGE("training loss on 6 pairs: " << before << " before, " << after << " after 40 steps");
  CHECK(after < 0.7 * before);
  require_error(train_module(fm, {}, {}, t, mod), errc::invalid_argument, "no training samples");
  t.batch = 0;
  require_error(train_module(fm, few, {}, t, mod), errc::invalid_argument, "invalid options");
}

TEST_CASE("learning-rate schedule: linear warmup then cosine to 0") {
  train_options o;
  o.steps = 100;
  o.lr = 1.0;
  o.warmup = 0.02;
  CHECK(lr_at(o, 0) == doctest::Approx(0.5));
  CHECK(lr_at(o, 1) == doctest::Approx(1.0));
  CHECK(lr_at(o, 2) == doctest::Approx(1.0));
  CHECK(lr_at(o, 51) == doctest::Approx(0.5).epsilon(1e-9));
  CHECK(lr_at(o, 99) < 1e-3);
}

TEST_CASE("lookahead_backprop errors: not initialised, prompt + block past the context, inconsistent samples") {
  const model m = make_model(tiny, 12);  // seq_len 64
  frozen_model<double> fm;
  fm.from(m);
  lookahead_config cfg;
  cfg.n_lookahead = 4;
  cfg.rank = 2;
  basic_lookahead_module<double> mod;
  require_ok(mod.init(m, cfg, 1));
  const auto s = sample_of(m, random_pair(m, 20, 4, 1)).cast<double>();
  lookahead_backprop<double> bp;
  double loss = 0;
  require_error(bp.forward(fm, mod, s), errc::invalid_argument, "not initialised");
  require_error(bp.init(fm, mod, 61), errc::invalid_argument, "61 tokens and 4 lookahead tokens do not fit the context of 64");
  require_ok(bp.init(fm, mod, 20));
  auto big = s;
  big.P = 61;
  require_error(bp.forward(fm, mod, big), errc::out_of_range, "61 tokens and 4 lookahead tokens");
  auto bad = s;
  bad.gt.pop_back();
  require_error(bp.loss_and_grad(fm, mod, bad, &loss, nullptr), errc::shape_mismatch, "ground-truth scores");
  lookahead_config other = cfg;
  other.n_lookahead = 5;
  basic_lookahead_module<double> mod5;
  require_ok(mod5.init(m, other, 1));
  require_error(bp.forward(fm, mod5, s), errc::shape_mismatch, "differs from the one init() saw");
  require_ok(bp.loss_and_grad(fm, mod, s, &loss, nullptr));
  CHECK(loss > 0);
  frozen_model<double> fs;
  fs.from(kvtest::shipped_model());
  require_error(bp.init(fs, mod, 20), errc::shape_mismatch, "trained for dim 16 but the model has dim 64");
}
