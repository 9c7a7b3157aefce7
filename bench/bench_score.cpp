// Window scores (SnapKV's observation window; score.hpp) against
//   naive          the whole [w][T] attention matrix per query head, scalar loops, std::exp
//   sgemm_softmax  (OpenBLAS) per KV head one sgemm materialising the group's [g w][T] logits, then
//                  a masked softmax (std::exp) and the mean over the window rows
//   sgemm_qk       (OpenBLAS) Q.K^T alone: the compute bound of any exact scorer
// seq = one thread (OpenBLAS with 1 thread), par = every OpenMP thread (OpenBLAS with as many).
// The BLAS baselines read fp32 copies of the data (converted outside the timing).
#include <kvevict/score.hpp>

#include "baselines.hpp"
#include "harness.hpp"

#include <map>
#include <tuple>

namespace {
using namespace kvb;

template <class K>
struct score_case {
  model_shape s;
  index_t T;
  std::vector<K> q, k;            // [hq][w][d], [hkv][T][d]
  std::vector<float> q32, k32;    // fp32 copies for the BLAS baselines
  std::vector<float> reference;   // kvevict seq output [hq][T - w]
  std::size_t ws_seq = 0, ws_par = 0;

  score_case(const model_shape& shape, index_t tokens) : s(shape), T(tokens) {
    q.resize(static_cast<std::size_t>(s.hq * s.window * s.dim));
    k.resize(static_cast<std::size_t>(s.hkv * T * s.dim));
    fill_normal(q, 11);
    fill_normal(k, 12);
#if defined(KVEVICT_BENCH_CBLAS)
    q32.resize(q.size());
    k32.resize(k.size());
    for (std::size_t i = 0; i < q.size(); ++i) q32[i] = baseline::widen(q[i]);
    for (std::size_t i = 0; i < k.size(); ++i) k32[i] = baseline::widen(k[i]);
#endif
    reference.resize(static_cast<std::size_t>(s.hq * (T - s.window)));
    scratch sc;
    const auto out = *make_matrix_view(reference.data(), s.hq, T - s.window);
    (void)window_scores(seq, sc.ws(), queries(), keys(), out);
    sc.allocate();
    if (!window_scores(seq, sc.ws(), queries(), keys(), out).ok()) reference.clear();
  }
  kv_view<const K> queries() const { return *make_kv_view(q.data(), s.hq, s.window, s.dim); }
  kv_view<const K> keys() const { return *make_kv_view(k.data(), s.hkv, T, s.dim); }
  double flops() const { return 2.0 * static_cast<double>(s.hq * s.window) * static_cast<double>(T) * static_cast<double>(s.dim); }
};

template <class K>
const score_case<K>& get_case(const model_shape& s, index_t T) {
  return cached<score_case<K>>(std::make_tuple(std::string(s.name), T),
                               [&] { return std::make_unique<score_case<K>>(s, T); });
}

/// Largest |out - reference| / |reference| over every score (reference = kvevict seq).
double max_rel_diff(const std::vector<float>& ref, const float* out) {
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double r = ref[i], d = std::fabs(static_cast<double>(out[i]) - r);
    worst = std::max(worst, d / std::max(std::fabs(r), 1e-30));
  }
  return worst;
}

/// Scores computed by a baseline agree with kvevict's within `tol` relative (different exp and
/// summation order; docs/score.md bounds kvevict's own error).
void check_scores(benchmark::State& st, const std::vector<float>& ref, const float* out, double tol) {
  if (ref.empty()) return fail(st, "reference scores could not be computed");
  const double worst = max_rel_diff(ref, out);
  st.counters["max_rel_diff"] = worst;
  if (!(worst <= tol)) fail(st, "scores differ from kvevict's by " + std::to_string(worst) + " relative");
}

void set_flops(benchmark::State& st, double flops) {
  st.counters["GFLOP/s(QK)"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

template <class K, class Backend>
void run_kvevict(benchmark::State& st, const model_shape& s, index_t T, Backend be, bool fma) {
  const auto& c = get_case<K>(s, T);
  std::vector<float> out(c.reference.size(), 0.f);
  const auto ov = *make_matrix_view(out.data(), s.hq, T - s.window);
  score_options opt;
  opt.fused_multiply_add = fma;
  scratch sc;
  if (!ok(st, window_scores(be, sc.ws(), c.queries(), c.keys(), ov, opt), "window_scores size query")) return;
  sc.allocate();
  for (auto _ : st) {
    if (!ok(st, window_scores(be, sc.ws(), c.queries(), c.keys(), ov, opt), "window_scores")) return;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  st.counters["workspace_MiB"] = static_cast<double>(sc.ws().bytes) / (1 << 20);
  set_flops(st, c.flops());
  // seq and par give identical bits; fused multiply-add differs in the last places
  if (!fma) {
    if (std::memcmp(out.data(), c.reference.data(), out.size() * sizeof(float)) != 0)
      fail(st, "par scores differ from seq scores");
  } else {
    check_scores(st, c.reference, out.data(), 1e-3);
  }
}

template <class K>
void run_naive(benchmark::State& st, const model_shape& s, index_t T) {
  const auto& c = get_case<K>(s, T);
  std::vector<float> out(c.reference.size(), 0.f), att;
  for (auto _ : st) {
    baseline::naive_window_scores(s, T, c.q.data(), c.k.data(), out.data(), att);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_flops(st, c.flops());
  check_scores(st, c.reference, out.data(), 1e-3);
}

#if defined(KVEVICT_BENCH_CBLAS)
template <class K>
void run_sgemm_qk(benchmark::State& st, const model_shape& s, index_t T, int threads) {
  const auto& c = get_case<K>(s, T);
  baseline::blas_threads(threads);
  std::vector<float> logits(static_cast<std::size_t>(s.group() * s.window * T));
  for (auto _ : st) {
    baseline::sgemm_qk(s, T, c.q32.data(), c.k32.data(), logits.data());
    benchmark::DoNotOptimize(logits.data());
    benchmark::ClobberMemory();
  }
  set_flops(st, c.flops());
}

template <class K>
void run_sgemm_softmax(benchmark::State& st, const model_shape& s, index_t T, int threads) {
  const auto& c = get_case<K>(s, T);
  baseline::blas_threads(threads);
  std::vector<float> out(c.reference.size(), 0.f), logits;
  for (auto _ : st) {
    baseline::blas_window_scores(s, T, c.q32.data(), c.k32.data(), out.data(), logits, threads);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_flops(st, c.flops());
  check_scores(st, c.reference, out.data(), 1e-3);
}
#endif

template <class K>
void register_case(const model_shape& s, index_t T) {
  const params p = shape_params(s, T).add("w", s.window).add("kv", kv_type_name(K{}));
  auto name = [&](const char* impl, const char* be) { return bench_name("score", "window", impl, be, p); };
  add(name("kvevict", "seq"), [=](benchmark::State& st) { run_kvevict<K>(st, s, T, seq, false); });
  add(name("kvevict", "par"), [=](benchmark::State& st) { run_kvevict<K>(st, s, T, par, false); });
  add(name("kvevict_fma", "seq"), [=](benchmark::State& st) { run_kvevict<K>(st, s, T, seq, true); });
  add(name("kvevict_fma", "par"), [=](benchmark::State& st) { run_kvevict<K>(st, s, T, par, true); });
  add_avx2_twin("score", "window", "kvevict", p, [=](benchmark::State& st) { run_kvevict<K>(st, s, T, seq, false); });
  add_avx2_twin("score", "window", "kvevict_fma", p, [=](benchmark::State& st) { run_kvevict<K>(st, s, T, seq, true); });
#if defined(KVEVICT_BENCH_CBLAS)
  add(name("sgemm_qk", "seq"), [=](benchmark::State& st) { run_sgemm_qk<K>(st, s, T, 1); });
  add(name("sgemm_qk", "par"), [=](benchmark::State& st) { run_sgemm_qk<K>(st, s, T, par_threads()); });
  add(name("sgemm_softmax", "seq"), [=](benchmark::State& st) { run_sgemm_softmax<K>(st, s, T, 1); });
  add(name("sgemm_softmax", "par"), [=](benchmark::State& st) { run_sgemm_softmax<K>(st, s, T, par_threads()); });
#endif
  // the naive path costs ~0.4 us per (row, key) pair: 12 s at 32K, so not run at 128K
  if (T <= 32768) add_slow(name("naive", "seq"), [=](benchmark::State& st) { run_naive<K>(st, s, T); });
}

void register_benchmarks() {
  for (const auto& mc : model_cases()) {
    register_case<float16>(mc.shape, mc.tokens);
    register_case<float>(mc.shape, mc.tokens);
  }
}
}  // namespace

KVB_MAIN(register_benchmarks)
