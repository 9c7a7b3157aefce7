// Aliasing between any two arguments of the public entry points that take a workspace (issue 17):
// the scratch a call carves must not share memory with what it reads or writes (scoring,
// postprocess, recipe_scores, LookaheadKV's math, the LAVa loss, Kendall's tau, the recalls, the
// footprint). Each case places the workspace over one argument and expects errc::overlap, with
// that argument untouched. (compact's ragged metadata cases are in test_compact.cpp; select's and
// the budget allocators' in test_select.cpp / test_budget.cpp.)
#include "support.hpp"

#include <kvevict/train/lookahead.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/score.hpp>

#include <algorithm>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {
// A workspace of `bytes` starting at p (an argument's own memory).
workspace over(void* p, std::size_t bytes) { return workspace{p, bytes}; }
}  // namespace

TEST_CASE("aliasing: a workspace over an argument of a scoring stage is refused, nothing written") {
  const index_t hq = 2, hkv = 1, T = 12, w = 4, d = 4;
  auto g = kvtest::rng(3);
  auto q = kvtest::random_floats(g, hq * w * d, -1, 1), k = kvtest::random_floats(g, hkv * T * d, -1, 1);
  std::vector<float> out(static_cast<std::size_t>(hq * T), -7.f);
  const auto qv = value_of(make_kv_view<const float>(q.data(), hq, w, d));
  const auto kv = value_of(make_kv_view<const float>(k.data(), hkv, T, d));
  const auto ov = value_of(make_matrix_view(out.data(), hq, T - w));
  workspace ws;
  REQUIRE(window_scores(seq, ws, qv, kv, ov).ok());
  const std::size_t need = ws.bytes;
  std::vector<unsigned char> big(need + 4096);
  // the scratch over the output, over the queries, over the keys
  std::vector<float> obig(need / 4 + out.size() + 16, -7.f);
  const auto obv = value_of(make_matrix_view(obig.data(), hq, T - w));
  ws = over(obig.data(), need);
  require_error(window_scores(seq, ws, qv, kv, obv), errc::overlap, "window_scores: the workspace and out overlap");
  CHECK(std::all_of(obig.begin(), obig.end(), [](float x) { return x == -7.f; }));
  // (inputs copied to the start of a buffer big enough for the scratch: it overlaps nothing else)
  std::vector<float> qbig(need / 4 + q.size() + 16), kbig(need / 4 + k.size() + 16);
  std::copy(q.begin(), q.end(), qbig.begin());
  std::copy(k.begin(), k.end(), kbig.begin());
  const auto qbv = value_of(make_kv_view<const float>(qbig.data(), hq, w, d));
  const auto kbv = value_of(make_kv_view<const float>(kbig.data(), hkv, T, d));
  ws = over(qbig.data(), need);
  require_error(window_scores(seq, ws, qbv, kv, ov), errc::overlap, "the workspace and queries overlap");
  ws = over(kbig.data(), need);
  require_error(window_scores(seq, ws, qv, kbv, ov), errc::overlap, "the workspace and prefix_keys overlap");
  ws = over(big.data(), big.size());
  REQUIRE(window_scores(seq, ws, qv, kv, ov).ok());

  // postprocess: the scratch over in, out or the lengths
  // 64 spare floats: a workspace over out or in spans the query's answer (the carver's alignment
  // padding included), which may exceed the views themselves
  std::vector<float> in(static_cast<std::size_t>(hq * T) + 64, 1.f), pp(static_cast<std::size_t>(hkv * T) + 64, -7.f);
  const auto inv = value_of(make_matrix_view<const float>(in.data(), hq, T));
  const auto ppv = value_of(make_matrix_view(pp.data(), hkv, T));
  postprocess_options po;
  po.pool = pool_kind::max;
  po.kernel = 3;
  ws = workspace{};
  REQUIRE(postprocess_scores(seq, ws, inv, ppv, po).ok());
  const std::size_t pneed = ws.bytes;
  REQUIRE(pneed > 0);
  ws = over(pp.data(), pneed);
  require_error(postprocess_scores(seq, ws, inv, ppv, po), errc::overlap, "postprocess_scores: the workspace and out overlap");
  CHECK(std::all_of(pp.begin(), pp.end(), [](float x) { return x == -7.f; }));
  ws = over(in.data(), pneed);
  require_error(postprocess_scores(seq, ws, inv, ppv, po), errc::overlap, "the workspace and in overlap");
  std::vector<std::int32_t> lens_buf(pneed / 4 + 16, static_cast<std::int32_t>(T));
  ws = over(lens_buf.data(), pneed);
  require_error(postprocess_scores(seq, ws, inv, ppv, po, lens_buf.data() + 4), errc::overlap,
                "the workspace and row_lengths overlap");

  // recipe_scores: the scratch over the final scores or the keys
  recipe r = recipe::snapkv();
  r.window = w;
  r.n_recent = w;
  std::vector<float> sc(static_cast<std::size_t>(hkv * T), -7.f);
  const auto scv = value_of(make_matrix_view(sc.data(), hkv, T));
  ws = workspace{};
  REQUIRE(recipe_scores(seq, ws, r, qv, kv, kv_view<const float>{}, scv).ok());
  const std::size_t rneed = ws.bytes;
  std::vector<float> host(rneed / 4 + 64, -7.f);
  const auto scv2 = value_of(make_matrix_view(host.data() + 8, hkv, T));
  ws = over(host.data(), rneed);
  require_error(recipe_scores(seq, ws, r, qv, kv, kv_view<const float>{}, scv2), errc::overlap,
                "recipe_scores: the workspace and scores overlap");
  std::vector<float> krbig(rneed / 4 + hkv * T * d + 64);
  std::copy(k.begin(), k.end(), krbig.begin());
  const auto kv2 = value_of(make_kv_view<const float>(krbig.data(), hkv, T, d));
  ws = over(krbig.data(), rneed);
  require_error(recipe_scores(seq, ws, r, qv, kv2, kv_view<const float>{}, scv), errc::overlap,
                "the workspace and keys overlap");
  CHECK(std::all_of(sc.begin(), sc.end(), [](float x) { return x == -7.f; }));
}

TEST_CASE("aliasing: LookaheadKV, LAVa loss and Kendall tau refuse a workspace over an argument") {
  const index_t n = 3, P = 5, d = 4;
  auto g = kvtest::rng(5);
  auto q = kvtest::random_floats(g, n * d, -1, 1), kp = kvtest::random_floats(g, P * d, -1, 1),
       kb = kvtest::random_floats(g, n * d, -1, 1);
  std::vector<float> s(64, -7.f);
  const auto qv = value_of(make_matrix_view<const float>(q.data(), n, d));
  const auto kpv = value_of(make_matrix_view<const float>(kp.data(), P, d));
  const auto kbv = value_of(make_matrix_view<const float>(kb.data(), n, d));
  const index_t ext[1] = {P}, str[1] = {1};
  const auto sv = value_of(detail::make_strided<float, 1>("s", s.data(), ext, str));
  workspace ws;
  REQUIRE(lookahead_window_scores(seq, ws, qv, kpv, kbv, sv).ok());
  const std::size_t need = ws.bytes;
  REQUIRE(need <= s.size() * sizeof(float));
  ws = over(s.data(), need);
  require_error(lookahead_window_scores(seq, ws, qv, kpv, kbv, sv), errc::overlap,
                "lookahead_window_scores: the workspace and s overlap");
  std::vector<float> qbig(need / 4 + n * d + 16);
  std::copy(q.begin(), q.end(), qbig.begin());
  const auto qv2 = value_of(make_matrix_view<const float>(qbig.data(), n, d));
  ws = over(qbig.data(), need);
  require_error(lookahead_window_scores(seq, ws, qv2, kpv, kbv, sv), errc::overlap, "the workspace and q overlap");

  // KL loss: the scratch over the gradient output
  std::vector<float> gt = {0.5f, 0.5f, 0.25f, 0.75f}, est = {0.4f, 0.6f, 0.3f, 0.7f}, grad(16, -7.f);
  const auto gtv = value_of(make_matrix_view<const float>(gt.data(), 2, 2));
  const auto estv = value_of(make_matrix_view<const float>(est.data(), 2, 2));
  const auto gv = value_of(make_matrix_view(grad.data(), 2, 2));
  double loss = -1;
  ws = workspace{};
  REQUIRE(lookahead_kl_loss(seq, ws, gtv, estv, &loss, gv).ok());
  ws = over(grad.data(), ws.bytes);
  require_error(lookahead_kl_loss(seq, ws, gtv, estv, &loss, gv), errc::overlap,
                "lookahead_kl_loss: the workspace and grad_est overlap");
  CHECK(grad[0] == -7.f);

  // Kendall tau-b: the scratch over per_row or an input
  std::vector<float> a = {1, 2, 3, 4, 4, 3, 2, 1};
  const auto av = value_of(make_matrix_view<const float>(a.data(), 2, 4));
  std::vector<double> per(64, -7);
  double mean = 0;
  ws = workspace{};
  REQUIRE(kendall_tau_b(ws, av, av, mean, per.data()).ok());
  const std::size_t kneed = ws.bytes;
  REQUIRE(kneed <= per.size() * sizeof(double));
  ws = over(per.data(), kneed);
  require_error(kendall_tau_b(ws, av, av, mean, per.data()), errc::overlap, "kendall_tau_b: the workspace and per_row overlap");
  CHECK(per[0] == -7);
}

TEST_CASE("aliasing: the recalls and the footprint refuse a workspace over an argument") {
  std::vector<float> truth = {1, 2, 3, 4, 4, 3, 2, 1}, est = {1, 2, 3, 4, 1, 2, 3, 4};
  const auto tv = value_of(make_matrix_view<const float>(truth.data(), 2, 4));
  const auto ev = value_of(make_matrix_view<const float>(est.data(), 2, 4));
  std::vector<double> per(64, -7);
  double mean = 0;
  workspace ws;
  REQUIRE(recall_at_k(ws, ev, tv, 2, mean, per.data()).ok());
  const std::size_t need = ws.bytes;
  REQUIRE(need <= per.size() * sizeof(double));
  ws = over(per.data(), need);
  require_error(recall_at_k(ws, ev, tv, 2, mean, per.data()), errc::overlap, "recall_at_k: the workspace and per_row overlap");
  CHECK(per[0] == -7);
  std::vector<float> tbig(need / 4 + 16);
  std::copy(truth.begin(), truth.end(), tbig.begin());
  const auto tbv = value_of(make_matrix_view<const float>(tbig.data(), 2, 4));
  ws = over(tbig.data(), need);
  require_error(recall_at_k(ws, ev, tbv, 2, mean), errc::overlap, "the workspace and truth overlap");
  // kept lists inside the scratch
  std::vector<pos_t> kbig(need / 4 + 16, 0);
  kbig[0] = 0, kbig[1] = 1, kbig[2] = 2, kbig[3] = 3;
  const auto kv = value_of(make_matrix_view<const pos_t>(kbig.data(), 2, 2));
  ws = workspace{};
  REQUIRE(kept_recall_at_k(ws, kv, tv, 2, mean).ok());
  ws = over(kbig.data(), ws.bytes);
  require_error(kept_recall_at_k(ws, kv, tv, 2, mean), errc::overlap, "kept_recall_at_k: the workspace and kept overlap");

  // the footprint: the scratch over the schedule
  std::vector<pos_t> sched(256, -1);
  const auto rec = make_eviction_recorder(sched.data(), 1, 1, 4);
  REQUIRE(static_cast<bool>(rec));
  const auto sv = value_of(rec->schedule(4));
  kv_usage usage;
  ws = workspace{};
  REQUIRE(measure_kv_usage(ws, sv, usage).ok());
  ws = over(sched.data(), ws.bytes);
  require_error(measure_kv_usage(ws, sv, usage), errc::overlap, "the workspace and the schedule overlap");
}
