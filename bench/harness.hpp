// The one harness every kvevict benchmark binary uses (docs/PERFORMANCE.md).
//
// A binary defines `void register_benchmarks()` that calls kvb::add(...) once per (case, impl) and
// ends with KVB_MAIN(register_benchmarks). Each registered benchmark has a structured name
//
//   <stage>/<op>/<impl>/<backend>/<key>=<value>,<key>=<value>,...
//
//   stage    the binary's stage (score, postprocess, select, compact, budget, evict, driver)
//   op       what is measured (window, gqa_mean, dense, flat, ...)
//   impl     kvevict, or the baseline's name (naive, sgemm_qk, nth_element_sort, memcpy, ...)
//   backend  seq (one thread) or par (all OpenMP threads; baselines: the same thread count)
//   params   the shape, in the same order for every impl of a case
//
// which scripts/bench and bench/report.py parse to pair every kvevict measurement with its
// baselines (same stage, op and params, measured in the same run). Every benchmark measures wall
// time (UseRealTime; bench_driver: manual timing of the driver's part, add_manual) in microseconds.
//
// Modes:
//   full (default)   the shapes an engine sees (docs/PERFORMANCE.md lists them)
//   --smoke          (or KVEVICT_BENCH_SMOKE=1) tiny shapes, one iteration each: what CTest runs in
//                    CI (label `bench`) so no benchmark rots; the whole set takes a few seconds.
// In both modes every case checks, once and outside the timing, that kvevict and each baseline
// produce the same result (bit for bit where the semantics are the same, within a stated tolerance
// for floating-point scores); a failed check marks the benchmark as an error and makes the binary
// exit with status 1.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/host_isa.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <benchmark/benchmark.h>

#if defined(_OPENMP)
#  include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace kvb {
using namespace kvevict;

// ------------------------------------------------------------------------------------------------
// mode, failures

inline bool& smoke_flag() {
  static bool s = false;
  return s;
}
/// True in the CI smoke mode: tiny shapes, one iteration per benchmark.
inline bool smoke() { return smoke_flag(); }

inline std::atomic<int>& failure_count() {
  static std::atomic<int> n{0};
  return n;
}

/// Marks the running benchmark as failed (its result is discarded) and the binary's exit status 1.
inline void fail(benchmark::State& state, const std::string& what) {
  ++failure_count();
  std::fprintf(stderr, "kvb: FAILED: %s\n", what.c_str());
  state.SkipWithError(what.c_str());
}

/// False (and fail()) when `st` is an error; the message names `what`.
inline bool ok(benchmark::State& state, const status& st, const char* what) {
  if (st.ok()) return true;
  fail(state, std::string(what) + ": " + st.message());
  return false;
}

/// Threads `par` (and the parallel baselines) run on.
inline int par_threads() {
#if defined(_OPENMP)
  return std::max(1, omp_get_max_threads());
#else
  return 1;
#endif
}

// ------------------------------------------------------------------------------------------------
// names

/// Ordered key=value parameters of a case.
class params {
 public:
  params& add(const std::string& key, long long value) { return add(key, std::to_string(value)); }
  params& add(const std::string& key, const std::string& value) {
    if (!text_.empty()) text_ += ',';
    text_ += key + '=' + value;
    return *this;
  }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

inline const char* kv_type_name(float) { return "fp32"; }
inline const char* kv_type_name(kvevict::float16) { return "fp16"; }
inline const char* kv_type_name(kvevict::bfloat16) { return "bf16"; }

inline const char* backend_name(seq_t) { return "seq"; }
inline const char* backend_name(par_t) { return "par"; }

// ------------------------------------------------------------------------------------------------
// an engine's executor (kvevict::on, docs/backends.md)

/// What an engine's thread pool looks like to kvevict::on: `threads - 1` persistent workers plus
/// the calling thread. A loop is cut into up to 4 chunks per thread that every participant claims
/// from one atomic counter (the state packs the call's generation with the next chunk, so a worker
/// that wakes late cannot claim a later call's chunks with this one's). The caller claims chunks
/// too and waits only for chunks a worker has already claimed: a worker that is not scheduled
/// (a busy machine) never delays the call, the caller just does its share. Workers spin briefly
/// (yielding) after each loop, then sleep on a condition variable. Backend name "exec" (`on(ex)`);
/// "exec1" is the trivial executor that runs every range on the calling thread (an engine that
/// already parallelises over sequences or layers).
class pool_executor {
 public:
  explicit pool_executor(int threads) : n_(std::max(1, threads)) {
    for (int w = 1; w < n_; ++w) workers_.emplace_back([this, w] { work(w); });
  }
  ~pool_executor() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_.store(true);
      state_.fetch_add(std::uint64_t{1} << 32);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int concurrency() const { return n_; }
  void parallel_for(index_t n, task_ref task) {
    if (n_ == 1 || n < 2) return task(0, n, 0);
    task_.store(&task, std::memory_order_relaxed);
    n_items_.store(n, std::memory_order_relaxed);
    chunks_.store(static_cast<std::uint32_t>(std::min<index_t>(n, 4 * n_)), std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    std::uint64_t gen;
    {
      std::lock_guard<std::mutex> l(m_);
      gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
      state_.store(gen << 32, std::memory_order_release);
    }
    cv_.notify_all();
    run_chunks(gen, 0);
    const std::uint32_t chunks = chunks_.load(std::memory_order_relaxed);
    while (done_.load(std::memory_order_acquire) != chunks) std::this_thread::yield();
    // exhausted: a worker still looking at this generation can claim nothing, whatever the next
    // call's chunk count
    state_.store(gen << 32 | 0xffffffffu, std::memory_order_release);
  }

 private:
  /// Claims and runs chunks of call `gen` until none is left.
  void run_chunks(std::uint64_t gen, int w) {
    for (;;) {
      std::uint64_t s = state_.load(std::memory_order_acquire);
      const std::uint32_t chunks = chunks_.load(std::memory_order_relaxed);
      if ((s >> 32) != gen || static_cast<std::uint32_t>(s) >= chunks) return;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      const index_t c = static_cast<std::uint32_t>(s), n = n_items_.load(std::memory_order_relaxed);
      const index_t b = n * c / chunks, e = n * (c + 1) / chunks;
      if (b < e) (*task_.load(std::memory_order_relaxed))(b, e, w);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }
  void work(int w) {
    std::uint64_t seen = 0;
    for (;;) {
      std::uint64_t g = state_.load(std::memory_order_acquire) >> 32;
      for (int spin = 0; spin < 200 && g == seen; ++spin) {
        std::this_thread::yield();
        g = state_.load(std::memory_order_acquire) >> 32;
      }
      if (g == seen) {
        std::unique_lock<std::mutex> l(m_);
        cv_.wait(l, [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen; });
        g = state_.load(std::memory_order_acquire) >> 32;
      }
      seen = g;
      if (stop_.load()) return;
      run_chunks(g, w);
    }
  }
  int n_;
  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<std::uint64_t> state_{0};  // generation << 32 | next chunk
  std::atomic<std::uint32_t> done_{0};
  std::atomic<bool> stop_{false};
  std::atomic<task_ref*> task_{nullptr};
  std::atomic<index_t> n_items_{0};
  std::atomic<std::uint32_t> chunks_{0};
};

/// The executor every "exec" benchmark uses (par_threads() workers, created once).
inline pool_executor& bench_executor() {
  static pool_executor ex(par_threads());
  return ex;
}
/// The trivial executor: every loop on the calling thread ("exec1").
struct inline_executor {
  int concurrency() const { return 1; }
  void parallel_for(index_t n, task_ref task) const { task(0, n, 0); }
};
inline inline_executor& bench_inline_executor() {
  static inline_executor ex;
  return ex;
}
inline const char* backend_name(executor_t<pool_executor>) { return "exec"; }
inline const char* backend_name(executor_t<inline_executor>) { return "exec1"; }

inline std::string bench_name(const std::string& stage, const std::string& op, const std::string& impl,
                              const std::string& backend, const params& p) {
  return stage + '/' + op + '/' + impl + '/' + backend + '/' + p.str();
}

// ------------------------------------------------------------------------------------------------
// registration

using body = std::function<void(benchmark::State&)>;

/// Registers one benchmark (wall time, microseconds; one iteration in smoke mode).
inline benchmark::internal::Benchmark* add(const std::string& name, body fn) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), [fn](benchmark::State& st) { fn(st); });
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
  // the fastest repetition next to the median: on a shared machine interference only adds time
  b->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
  if (smoke()) b->Iterations(1);
  return b;
}

/// As add(), with manual timing: the body times what it measures itself (state.SetIterationTime,
/// seconds) so the untimed work of an iteration (e.g. the forward pass a driver benchmark stands
/// in for) is left out. The name gets Google Benchmark's /manual_time suffix (report.py ignores it).
inline benchmark::internal::Benchmark* add_manual(const std::string& name, body fn) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), [fn](benchmark::State& st) { fn(st); });
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
  b->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
  if (smoke()) b->Iterations(1);
  return b;
}

/// As add(), for benchmarks whose one iteration takes seconds (naive paths): one iteration per
/// repetition and 3 repetitions in the full mode, whatever the command line asks.
inline benchmark::internal::Benchmark* add_slow(const std::string& name, body fn) {
  auto* b = add(name, std::move(fn))->Iterations(1);
  if (!smoke()) b->Repetitions(3);
  return b;
}

/// Registers `fn` a second time as `impl`_avx2 (seq), run with the host kernels limited to their AVX2
/// copies (kvevict/host_isa.hpp): on CPUs that run 512-bit operations as two halves an AVX2 copy can
/// be the faster one. Only where the CPU has the AVX-512F copies (elsewhere it would repeat `fn`).
inline void add_avx2_twin(const std::string& stage, const std::string& op, const std::string& impl,
                          const params& p, body fn) {
  if (host_isa_supported() != host_isa::avx512) return;
  add(bench_name(stage, op, impl + "_avx2", "seq", p), [fn](benchmark::State& st) {
    const host_isa_limit_guard avx2(host_isa::avx2);
    fn(st);
  });
}

// ------------------------------------------------------------------------------------------------
// shapes

/// A model's attention shape: query heads, KV heads, head dim, observation window, layers.
struct model_shape {
  const char* name;
  index_t hq, hkv, dim, window, layers;
  index_t group() const { return hq / hkv; }
};

/// 32 query heads, 8 KV heads, head dim 128, 32 layers (Llama-3-8B, Mistral-7B), w = 32.
inline constexpr model_shape engine_shape{"engine", 32, 8, 128, 32, 32};
/// The reference runner's model (examples/runner, stories260K): 8 query heads, 4 KV heads, d = 8,
/// 5 layers, 512 context.
inline constexpr model_shape runner_shape{"runner", 8, 4, 8, 32, 5};
inline constexpr index_t runner_context = 512;
/// A tiny engine-like shape for the smoke mode.
inline constexpr model_shape smoke_shape{"smoke", 4, 2, 16, 8, 3};

/// (shape, context) pairs every stage runs: the engine shape at 4K, 32K and 128K plus the runner's
/// own shape; in smoke mode a tiny shape and the runner's.
struct shape_context {
  model_shape shape;
  index_t tokens;
};
inline std::vector<shape_context> model_cases() {
  if (smoke()) return {{smoke_shape, 96}, {runner_shape, runner_context}};
  return {{engine_shape, 4096}, {engine_shape, 32768}, {engine_shape, 131072}, {runner_shape, runner_context}};
}

inline params shape_params(const model_shape& s, index_t tokens) {
  params p;
  p.add("shape", s.name).add("hq", s.hq).add("hkv", s.hkv).add("d", s.dim).add("T", tokens);
  return p;
}

/// Per-head budgets swept for a context of `tokens` (128 .. 4096, never above the context).
inline std::vector<index_t> budgets_for(index_t tokens, bool sweep) {
  if (tokens == runner_context) return {64};
  if (smoke()) return {std::min<index_t>(16, tokens)};
  if (!sweep) return {1024};
  std::vector<index_t> b;
  for (index_t k : {128, 1024, 4096})
    if (k < tokens) b.push_back(k);
  return b;
}

// ------------------------------------------------------------------------------------------------
// data (deterministic, generated in parallel chunks, each chunk seeded by its index)

inline std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/// Uniform in [0, 1).
inline float uniform01(std::uint64_t& s) { return static_cast<float>(splitmix64(s) >> 40) * 0x1.0p-24f; }
/// Standard normal (Box-Muller, one value per call).
inline float normal01(std::uint64_t& s) {
  const double u1 = (static_cast<double>(splitmix64(s) >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(splitmix64(s) >> 11) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

/// Fills `n` elements with gen(state) converted to T; chunk c uses seed (seed, c).
template <class T, class Gen>
void fill(T* data, std::size_t n, std::uint64_t seed, Gen gen) {
  constexpr std::size_t chunk = 1 << 16;
  const std::int64_t chunks = static_cast<std::int64_t>((n + chunk - 1) / chunk);
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < chunks; ++c) {
    std::uint64_t s = seed * 0x632BE59BD9B4E019ull + static_cast<std::uint64_t>(c);
    const std::size_t b = static_cast<std::size_t>(c) * chunk, e = std::min(n, b + chunk);
    for (std::size_t i = b; i < e; ++i) {
      const float x = gen(s);
      if constexpr (std::is_same_v<T, float>)
        data[i] = x;
      else if constexpr (std::is_same_v<T, float16>)
        data[i] = to_float16(x);
      else
        data[i] = to_bfloat16(x);
    }
  }
}
template <class T>
void fill_normal(std::vector<T>& v, std::uint64_t seed) {
  fill(v.data(), v.size(), seed, normal01);
}
template <class T>
void fill_uniform(std::vector<T>& v, std::uint64_t seed) {
  fill(v.data(), v.size(), seed, uniform01);
}
/// Attention-like positive scores: exp(N(0, 2)) (heavy-tailed, as real attention column means).
inline void fill_attention_like(std::vector<float>& v, std::uint64_t seed) {
  fill(v.data(), v.size(), seed, [](std::uint64_t& s) { return std::exp(2.0f * normal01(s)); });
}

// ------------------------------------------------------------------------------------------------
// scratch memory and the memcpy bound

/// Owns a workspace's memory (64-byte aligned).
class scratch {
 public:
  workspace& ws() { return ws_; }
  /// Allocates what the last size query reported (plus alignment slack) and points ws at it.
  void allocate() {
    const std::size_t bytes = ws_.bytes;
    mem_.reset(new unsigned char[bytes + 64]);
    auto p = reinterpret_cast<std::uintptr_t>(mem_.get());
    ws_.data = mem_.get() + (64 - p % 64) % 64;
    ws_.bytes = bytes;
  }
  /// Resets to a size query.
  void reset() {
    ws_ = workspace{};
    mem_.reset();
  }

 private:
  workspace ws_;
  std::unique_ptr<unsigned char[]> mem_;
};

/// A 64-byte aligned, zero-initialised buffer of T.
template <class T>
class buffer {
 public:
  buffer() = default;
  explicit buffer(std::size_t n) { resize(n); }
  void resize(std::size_t n) {
    n_ = n;
    mem_.reset(new unsigned char[n * sizeof(T) + 64]);
    auto p = reinterpret_cast<std::uintptr_t>(mem_.get());
    data_ = reinterpret_cast<T*>(mem_.get() + (64 - p % 64) % 64);
    std::memset(static_cast<void*>(data_), 0, n * sizeof(T));
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return n_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }

 private:
  std::unique_ptr<unsigned char[]> mem_;
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

/// The bandwidth bound of a stage that reads `read` and writes `written` bytes: memcpy moving the same
/// traffic ((read + written) / 2 bytes copied), single-threaded for seq, split into one contiguous
/// piece per thread for par. Counters: bytes (the stage's traffic) and the rate.
inline void run_memcpy_bound(benchmark::State& state, std::size_t read, std::size_t written, bool parallel) {
  const std::size_t bytes = std::max<std::size_t>(64, (read + written) / 2);
  buffer<unsigned char> src(bytes), dst(bytes);
  std::memset(src.data(), 1, bytes);
  const int threads = parallel ? par_threads() : 1;
  for (auto _ : state) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; ++t) {
      const std::size_t b = bytes * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
      const std::size_t e = bytes * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
      std::memcpy(dst.data() + b, src.data() + b, e - b);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(read + written));
}

/// Sets the traffic counter of a stage measured against run_memcpy_bound.
inline void set_traffic(benchmark::State& state, std::size_t read, std::size_t written) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(read + written));
}

// ------------------------------------------------------------------------------------------------
// a single-slot cache for the data of one case: benchmarks of one case are registered next to each
// other and run in registration order, so the data is built once per case and the previous case's
// memory is freed before the next one's is built.

template <class Case, class Key>
const Case& cached(const Key& key, const std::function<std::unique_ptr<Case>()>& build) {
  static Key last{};
  static std::unique_ptr<Case> value;
  if (!value || !(last == key)) {
    value.reset();
    value = build();
    last = key;
  }
  return *value;
}

// ------------------------------------------------------------------------------------------------
// main

inline int run_main(int argc, char** argv, void (*register_all)()) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0)
      smoke_flag() = true;
    else
      args.push_back(argv[i]);
  }
  if (const char* e = std::getenv("KVEVICT_BENCH_SMOKE"); e != nullptr && e[0] == '1') smoke_flag() = true;
  int n = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 2;
  benchmark::AddCustomContext("kvevict_mode", smoke() ? "smoke" : "full");
  benchmark::AddCustomContext("kvevict_par_threads", std::to_string(par_threads()));
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (failure_count() > 0) {
    std::fprintf(stderr, "kvb: %d check(s) failed\n", failure_count().load());
    return 1;
  }
  return 0;
}

}  // namespace kvb

#define KVB_MAIN(fn) \
  int main(int argc, char** argv) { return kvb::run_main(argc, argv, fn); }
