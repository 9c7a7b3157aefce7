// LookaheadKV on the reference runner (examples/runner/lookahead_*.hpp): every backward piece and
// the whole training chain against central finite differences (double), on a tiny random model
// and on stories260K; the float training forward against the runner; LoRA inactive outside the
// lookahead rows; the module file (round trip and every load error); reproducible training; a
// short training run lowering the loss; lookahead_scores against the library's attention_scores.
#include "support.hpp"

#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/lookahead_data.hpp>
#include <runner/lookahead_module.hpp>
#include <runner/lookahead_scores.hpp>
#include <runner/lookahead_train.hpp>
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

const model& stories() {
  static model m;
  static const bool loaded = [] {
    const status st = model::load_file(KVEVICT_SOURCE_DIR "/models/stories260K.bin", m);
    REQUIRE_MESSAGE(st.ok(), st.message());
    return true;
  }();
  (void)loaded;
  return m;
}

void require_ok(const status& st) { REQUIRE_MESSAGE(st.ok(), st.message()); }

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

TEST_CASE("block attention (causal block over fixed prompt KV) backward matches central differences") {
  auto g = kvtest::rng(3);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int trial = 0; trial < 12; ++trial) {
    lkv::attention_shape s;
    s.Hkv = kvtest::uniform_int(g, 1, 3);
    s.H = s.Hkv * kvtest::uniform_int(g, 1, 3);
    s.hs = 2 * kvtest::uniform_int(g, 1, 3);
    s.n = kvtest::uniform_int(g, 1, 4);
    s.P = kvtest::uniform_int(g, 0, 6);
    const double peak = trial % 3 == 0 ? 4.0 : 1.0;  // some peaked softmax rows
    auto fill = [&](index_t count, double sc) {
      std::vector<double> v(static_cast<std::size_t>(count));
      for (auto& x : v) x = sc * u(g);
      return v;
    };
    auto q = fill(s.n * s.H * s.hs, peak), kb = fill(s.n * s.Hkv * s.hs, peak), vb = fill(s.n * s.Hkv * s.hs, 1);
    auto kp = fill(s.Hkv * s.P * s.hs, peak), vp = fill(s.Hkv * s.P * s.hs, 1);
    auto dout = fill(s.n * s.H * s.hs, 1);
    std::vector<double> probs(static_cast<std::size_t>(s.H * s.n * s.width())), out(static_cast<std::size_t>(s.n * s.H * s.hs));
    lkv::block_attention_forward(s, q.data(), kb.data(), vb.data(), kp.data(), vp.data(), probs.data(), out.data());
    std::vector<double> dq(q.size()), dkb(kb.size()), dvb(vb.size());
    lkv::block_attention_backward(s, q.data(), kb.data(), vb.data(), kp.data(), vp.data(), probs.data(), dout.data(),
                                  dq.data(), dkb.data(), dvb.data());
    auto f = [&] {
      std::vector<double> pr(probs.size()), o(out.size());
      lkv::block_attention_forward(s, q.data(), kb.data(), vb.data(), kp.data(), vp.data(), pr.data(), o.data());
      double sum = 0;
      for (std::size_t i = 0; i < o.size(); ++i) sum += dout[i] * o[i];
      return sum;
    };
    CAPTURE(trial);
    for (std::size_t i = 0; i < q.size(); ++i) check_close(dq[i], central(f, q[i], 1e-6), 1e-6, 1e-9, "dq");
    for (std::size_t i = 0; i < kb.size(); ++i) check_close(dkb[i], central(f, kb[i], 1e-6), 1e-6, 1e-9, "dk_block");
    for (std::size_t i = 0; i < vb.size(); ++i) check_close(dvb[i], central(f, vb[i], 1e-6), 1e-6, 1e-9, "dv_block");
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
  const model& m = stories();
  const lookahead_sample s = sample_of(m, random_pair(m, 40, 12, 5));
  lookahead_config c;
  c.n_lookahead = 4;
  const auto mod = random_module<double>(m, c, 3, 0.05);
  check_chain(m, s, mod, chain_coords(mod, 1, 9), 1e-5);
}
