// Compaction vs memcpy of the same bytes (the bandwidth bound), seq and par.
#include <kvevict/compact.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

using namespace kvevict;

namespace {
struct compact_case {
  index_t heads = 8, tokens, dim = 128, keep;
  std::vector<float> src, dst;
  std::vector<pos_t> kept;
  compact_case(index_t t, index_t k) : tokens(t), keep(k) {
    src.assign(heads * tokens * dim, 1.f);
    dst.assign(heads * keep * dim, 0.f);
    std::mt19937_64 g(7);
    for (index_t h = 0; h < heads; ++h) {
      std::vector<pos_t> all(tokens);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), g);
      std::sort(all.begin(), all.begin() + keep);
      kept.insert(kept.end(), all.begin(), all.begin() + keep);
    }
  }
};

template <class Backend>
void BM_compact(benchmark::State& state, Backend be) {
  compact_case c(state.range(0), state.range(1));
  auto src = *make_kv_view(c.src.data(), c.heads, c.tokens, c.dim, kv_layout::token_major);
  auto kept = *make_matrix_view(c.kept.data(), c.heads, c.keep);
  auto dst = *make_kv_view(c.dst.data(), c.heads, c.keep, c.dim);
  for (auto _ : state) {
    if (!compact(be, src, kept, dst).ok()) state.SkipWithError("compact failed");
    benchmark::DoNotOptimize(c.dst.data());
  }
  state.SetBytesProcessed(state.iterations() * c.heads * c.keep * c.dim * 4 * 2);
}

void BM_memcpy_bound(benchmark::State& state) {
  compact_case c(state.range(0), state.range(1));
  const std::size_t bytes = c.dst.size() * sizeof(float);
  for (auto _ : state) {
    std::memcpy(c.dst.data(), c.src.data(), bytes);
    benchmark::DoNotOptimize(c.dst.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes) * 2);
}
}  // namespace

BENCHMARK_CAPTURE(BM_compact, seq, seq)->Args({4096, 1024})->Args({32768, 2048});
BENCHMARK_CAPTURE(BM_compact, par, par)->Args({4096, 1024})->Args({32768, 2048});
BENCHMARK(BM_memcpy_bound)->Args({4096, 1024})->Args({32768, 2048});
BENCHMARK_MAIN();
