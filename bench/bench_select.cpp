// Top-k selection: kvevict's radix select (seq, par) vs std::nth_element + sorting the kept
// positions (the same output) and vs std::partial_sort + sorting the kept positions, on random
// scores. The baselines use the same order (score descending, lower position first on ties) and
// run per row, seq on one thread and par with one OpenMP thread per row, like kvevict.
//
//   build/release/bench/bench_select --benchmark_min_time=1
// Args: {rows, tokens, k, distribution (0 = uniform [0, 1), 1 = attention-like exp(N(0, 2)))}.
#include <kvevict/select.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

using namespace kvevict;

namespace {

struct select_case {
  index_t rows, tokens, k;
  std::vector<float> scores;
  std::vector<pos_t> kept;
  explicit select_case(const benchmark::State& state)
      : rows(state.range(0)), tokens(state.range(1)), k(state.range(2)) {
    scores.resize(static_cast<std::size_t>(rows * tokens));
    kept.assign(static_cast<std::size_t>(rows * k), 0);
    std::mt19937_64 g(42);
    if (state.range(3) == 0) {
      std::uniform_real_distribution<float> u(0.f, 1.f);
      for (auto& x : scores) x = u(g);
    } else {
      std::normal_distribution<float> n(0.f, 2.f);
      for (auto& x : scores) x = std::exp(n(g));
    }
  }
  void set_counters(benchmark::State& state) const {
    state.SetItemsProcessed(state.iterations() * rows * tokens);
    state.counters["rows"] = static_cast<double>(rows);
  }
};

template <class Backend>
void BM_kvevict(benchmark::State& state, Backend be) {
  select_case c(state);
  auto scores = *make_matrix_view(static_cast<const float*>(c.scores.data()), c.rows, c.tokens);
  auto kept = *make_matrix_view(c.kept.data(), c.rows, c.k);
  workspace ws;
  if (!select_topk(be, ws, scores, nullptr, kept).ok()) state.SkipWithError("query failed");
  std::vector<unsigned char> mem(ws.bytes);
  ws.data = mem.data();
  for (auto _ : state) {
    if (!select_topk(be, ws, scores, nullptr, kept).ok()) state.SkipWithError("select_topk failed");
    benchmark::DoNotOptimize(c.kept.data());
    benchmark::ClobberMemory();
  }
  c.set_counters(state);
}

// One row with a standard algorithm: order the positions so the best k come first, then sort them.
enum class baseline { nth_element, partial_sort };

void std_row(baseline b, const float* s, index_t n, index_t k, pos_t* idx, pos_t* out) {
  std::iota(idx, idx + n, 0);
  auto better = [s](pos_t a, pos_t c) { return s[a] > s[c] || (s[a] == s[c] && a < c); };
  if (b == baseline::nth_element) {
    if (k < n) std::nth_element(idx, idx + k, idx + n, better);
  } else {
    std::partial_sort(idx, idx + k, idx + n, better);
  }
  std::sort(idx, idx + k);
  std::copy(idx, idx + k, out);
}

void BM_std(benchmark::State& state, baseline b, bool parallel) {
  select_case c(state);
  const int threads = parallel ? std::max(1, omp_get_max_threads()) : 1;
  std::vector<pos_t> idx(static_cast<std::size_t>(threads * c.tokens));
  for (auto _ : state) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (index_t r = 0; r < c.rows; ++r)
      std_row(b, c.scores.data() + r * c.tokens, c.tokens, c.k, idx.data() + omp_get_thread_num() * c.tokens,
              c.kept.data() + r * c.k);
    benchmark::DoNotOptimize(c.kept.data());
    benchmark::ClobberMemory();
  }
  c.set_counters(state);
}

// Layer-wise selection (AdaKV-style, floor = 20% of the mean budget per row) vs nth_element over the
// flattened layer (score descending, then row, then position) + sorting each row's positions.
template <class Backend>
void BM_flat_kvevict(benchmark::State& state, Backend be) {
  select_case c(state);
  auto scores = *make_matrix_view(static_cast<const float*>(c.scores.data()), c.rows, c.tokens);
  std::vector<std::int32_t> floors(static_cast<std::size_t>(c.rows), static_cast<std::int32_t>(c.k / 5));
  std::vector<std::int32_t> cu(static_cast<std::size_t>(c.rows + 1));
  const index_t total = c.rows * c.k;
  workspace ws;
  if (!select_topk_flat(be, ws, scores, nullptr, total, floors.data(), cu.data(), c.kept.data()).ok())
    state.SkipWithError("query failed");
  std::vector<unsigned char> mem(ws.bytes);
  ws.data = mem.data();
  for (auto _ : state) {
    if (!select_topk_flat(be, ws, scores, nullptr, total, floors.data(), cu.data(), c.kept.data()).ok())
      state.SkipWithError("select_topk_flat failed");
    benchmark::DoNotOptimize(c.kept.data());
    benchmark::ClobberMemory();
  }
  c.set_counters(state);
}

void BM_flat_nth_element(benchmark::State& state) {
  select_case c(state);
  const index_t n = c.rows * c.tokens, total = c.rows * c.k;
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
  std::vector<std::int32_t> cu(static_cast<std::size_t>(c.rows + 1));
  const float* s = c.scores.data();
  for (auto _ : state) {  // no floors here: the flat baseline is the unconstrained layer top-k
    std::iota(idx.begin(), idx.end(), 0);
    std::nth_element(idx.begin(), idx.begin() + total, idx.end(),
                     [s](std::int64_t a, std::int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
    std::sort(idx.begin(), idx.begin() + total);  // row-major index order = (row, position) ascending
    std::fill(cu.begin(), cu.end(), 0);
    for (index_t i = 0; i < total; ++i) {
      ++cu[static_cast<std::size_t>(idx[i] / c.tokens + 1)];
      c.kept[static_cast<std::size_t>(i)] = static_cast<pos_t>(idx[i] % c.tokens);
    }
    for (index_t r = 0; r < c.rows; ++r) cu[r + 1] += cu[r];
    benchmark::DoNotOptimize(c.kept.data());
    benchmark::ClobberMemory();
  }
  c.set_counters(state);
}

void shapes(benchmark::internal::Benchmark* b) {
  b->Args({8, 32768, 2048, 0})->Args({32, 131072, 4096, 0})->Args({8, 32768, 2048, 1})->Args({32, 131072, 4096, 1});
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

}  // namespace

BENCHMARK_CAPTURE(BM_kvevict, seq, seq)->Apply(shapes);
BENCHMARK_CAPTURE(BM_std, nth_element_sort_seq, baseline::nth_element, false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_std, partial_sort_seq, baseline::partial_sort, false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_kvevict, par, par)->Apply(shapes);
BENCHMARK_CAPTURE(BM_std, nth_element_sort_par, baseline::nth_element, true)->Apply(shapes);
BENCHMARK_CAPTURE(BM_std, partial_sort_par, baseline::partial_sort, true)->Apply(shapes);
BENCHMARK_CAPTURE(BM_flat_kvevict, seq, seq)->Args({32, 32768, 2048, 0})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_flat_kvevict, par, par)->Args({32, 32768, 2048, 0})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_flat_nth_element)->Args({32, 32768, 2048, 0})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_MAIN();
