// attention_scores (SnapKV window: 32 query heads, 8 KV heads, d = 128, w = 32, fp16 cache) at 4K
// and 32K context, seq and par, default and fused_multiply_add, against
//   - a naive path that materialises the whole [w][T] attention matrix per head (same output), and
//   - when OpenBLAS is found, one cblas_sgemm per KV head computing Q.K^T alone (fp32, keys
//     converted beforehand and not timed): the lower bound any exact scorer must pay once.
// Run single-threaded BLAS for the seq comparison: OPENBLAS_NUM_THREADS=1 ./bench_score
#include <kvevict/score.hpp>

#include <benchmark/benchmark.h>

#if defined(KVEVICT_BENCH_CBLAS)
#  include <cblas.h>
#endif

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using namespace kvevict;

namespace {
constexpr index_t hq = 32, hkv = 8, group = hq / hkv, dim = 128, win = 32;

struct score_case {
  index_t tokens;
  std::vector<float16> q, k;  // queries [hq][win][dim], keys [hkv][tokens][dim] head-major
  std::vector<float> out;
  explicit score_case(index_t t) : tokens(t) {
    std::mt19937_64 g(11);
    std::normal_distribution<float> n(0.f, 1.f);
    q.resize(static_cast<std::size_t>(hq * win * dim));
    k.resize(static_cast<std::size_t>(hkv * t * dim));
    for (auto& x : q) x = to_float16(n(g));
    for (auto& x : k) x = to_float16(n(g));
    out.assign(static_cast<std::size_t>(hq * (t - win)), 0.f);
  }
  kv_view<const float16> queries() const { return *make_kv_view(q.data(), hq, win, dim); }
  kv_view<const float16> keys() const { return *make_kv_view(k.data(), hkv, tokens, dim); }
  matrix_view<float> out_view() { return *make_matrix_view(out.data(), hq, tokens - win); }
};

// The obvious implementation: per query head, the full [w][T] logits matrix, a softmax per row,
// the mean over rows of the prefix columns. fp32, std::exp.
void naive_scores(const score_case& c, std::vector<float>& att, float* out) {
  const index_t t = c.tokens, p = t - win;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  att.resize(static_cast<std::size_t>(win * t));
  for (index_t h = 0; h < hq; ++h) {
    const index_t kvh = h / group;
    for (index_t i = 0; i < win; ++i) {
      const float16* qi = &c.q[static_cast<std::size_t>((h * win + i) * dim)];
      float* row = &att[static_cast<std::size_t>(i * t)];
      const index_t vis = p + i + 1;
      float m = -INFINITY;
      for (index_t j = 0; j < vis; ++j) {
        const float16* kj = &c.k[static_cast<std::size_t>((kvh * t + j) * dim)];
        float s = 0.f;
        for (index_t d = 0; d < dim; ++d) s += to_float(qi[d]) * to_float(kj[d]);
        row[j] = s * scale;
        m = std::max(m, row[j]);
      }
      float sum = 0.f;
      for (index_t j = 0; j < vis; ++j) sum += (row[j] = std::exp(row[j] - m));
      for (index_t j = 0; j < vis; ++j) row[j] /= sum;
      for (index_t j = vis; j < t; ++j) row[j] = 0.f;
    }
    for (index_t j = 0; j < p; ++j) {
      float s = 0.f;
      for (index_t i = 0; i < win; ++i) s += att[static_cast<std::size_t>(i * t + j)];
      out[h * p + j] = s / static_cast<float>(win);
    }
  }
}

template <class Backend>
void BM_attention_scores(benchmark::State& state, Backend be, bool fused) {
  score_case c(state.range(0));
  workspace ws;
  score_options opt;
  opt.fused_multiply_add = fused;
  if (!window_scores(be, ws, c.queries(), c.keys(), c.out_view(), opt).ok()) state.SkipWithError("size query failed");
  std::vector<unsigned char> mem(ws.bytes + 64);
  ws.data = mem.data();
  for (auto _ : state) {
    if (!window_scores(be, ws, c.queries(), c.keys(), c.out_view(), opt).ok()) state.SkipWithError("window_scores failed");
    benchmark::DoNotOptimize(c.out.data());
  }
  state.counters["workspace_MiB"] = static_cast<double>(ws.bytes) / (1 << 20);
  state.counters["GFLOP/s(QK)"] = benchmark::Counter(2.0 * hq * win * static_cast<double>(c.tokens) * dim * 1e-9,
                                                     benchmark::Counter::kIsIterationInvariantRate);
}

void BM_naive_materialising(benchmark::State& state) {
  score_case c(state.range(0));
  std::vector<float> att;
  // the naive path computes the same output (checked once, outside the timing)
  {
    workspace ws;
    std::vector<float> fast(c.out.size());
    auto fv = *make_matrix_view(fast.data(), hq, c.tokens - win);
    (void)window_scores(seq, ws, c.queries(), c.keys(), fv);
    std::vector<unsigned char> mem(ws.bytes + 64);
    ws.data = mem.data();
    (void)window_scores(seq, ws, c.queries(), c.keys(), fv);
    naive_scores(c, att, c.out.data());
    double worst = 0;
    for (std::size_t i = 0; i < fast.size(); ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(fast[i]) - c.out[i]) / (std::fabs(c.out[i]) + 1e-30));
    state.counters["max_rel_diff"] = worst;
  }
  for (auto _ : state) {
    naive_scores(c, att, c.out.data());
    benchmark::DoNotOptimize(c.out.data());
  }
}

#if defined(KVEVICT_BENCH_CBLAS)
// Q.K^T alone: per KV head, C[group*w][T] = Q_g[group*w][d] * K_g[T][d]^T, fp32.
void BM_sgemm_qk(benchmark::State& state) {
  score_case c(state.range(0));
  const index_t t = c.tokens;
  std::vector<float> q(c.q.size()), k(c.k.size()), out(static_cast<std::size_t>(group * win * t));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = to_float(c.q[i]);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = to_float(c.k[i]);
  for (auto _ : state) {
    for (index_t g = 0; g < hkv; ++g)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(group * win), static_cast<int>(t),
                  static_cast<int>(dim), 1.0f, &q[static_cast<std::size_t>(g * group * win * dim)], static_cast<int>(dim),
                  &k[static_cast<std::size_t>(g * t * dim)], static_cast<int>(dim), 0.0f, out.data(), static_cast<int>(t));
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GFLOP/s(QK)"] = benchmark::Counter(2.0 * hq * win * static_cast<double>(t) * dim * 1e-9,
                                                     benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_sgemm_qk)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
#endif
}  // namespace

BENCHMARK_CAPTURE(BM_attention_scores, seq, seq, false)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_attention_scores, par, par, false)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_attention_scores, seq_fused, seq, true)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_attention_scores, par_fused, par, true)
    ->Arg(4096)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_naive_materialising)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
