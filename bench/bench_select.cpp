// Top-k selection (select.hpp): kvevict's radix select against the standard library doing the same
// job with the same output (ascending positions, ties to the lower position):
//   nth_element_sort    std::nth_element of the positions by score, then sorting the kept k
//   partial_sort        std::partial_sort of the best k, then sorting them by position
//   nth_element_flat    (flattened) each row's floor by nth_element, then nth_element over every
//                       remaining (row, position) entry of the layer, then per-row positions
// seq = one thread; par = every OpenMP thread (baselines: one row per thread, dynamic schedule).
//
// Ops: dense (every row keeps k), ragged (row r keeps its own k_r, from an AdaKV-like spread
// around the mean budget), flat (layer total = rows x k, floor 20% of k per row, as AdaKV).
// Scores: `attn` = exp(N(0, 2)) (attention-like, heavy tailed) or `uniform` in [0, 1).
#include <kvevict/select.hpp>

#include "baselines.hpp"
#include "harness.hpp"

#include <tuple>

namespace {
using namespace kvb;

struct sel_case {
  index_t R, T, k;
  std::string dist;
  std::vector<float> scores;
  std::vector<std::int32_t> cu;      // ragged: per-row budgets as offsets (sum = R k)
  std::vector<std::int32_t> floors;  // flat: 20% of k per row
  sel_case(index_t rows, index_t tokens, index_t budget, const std::string& distribution)
      : R(rows), T(tokens), k(budget), dist(distribution) {
    scores.resize(static_cast<std::size_t>(R * T));
    if (dist == "uniform")
      fill_uniform(scores, 31);
    else
      fill_attention_like(scores, 31);
    // ragged budgets: k * (0.25 .. 1.75), paired so that they sum to R k, each within [0, T]
    cu.assign(static_cast<std::size_t>(R + 1), 0);
    for (index_t r = 0; r < R; ++r) {
      const index_t spread = (r % 2 == 0 ? 1 : -1) * (k * 3 / 4) * ((r / 2) % 4) / 3;
      const index_t kr = (r == R - 1 && R % 2 == 1) ? k : std::clamp<index_t>(k + spread, 0, T);
      cu[static_cast<std::size_t>(r + 1)] = static_cast<std::int32_t>(cu[static_cast<std::size_t>(r)] + kr);
    }
    floors.assign(static_cast<std::size_t>(R), static_cast<std::int32_t>(k / 5));
  }
  matrix_view<const float> view() const { return *make_matrix_view(scores.data(), R, T); }
  index_t ragged_total() const { return cu.back(); }
};

using case_key = std::tuple<index_t, index_t, index_t, std::string>;
const sel_case& get_case(index_t R, index_t T, index_t k, const std::string& dist) {
  return cached<sel_case>(case_key{R, T, k, dist}, [&] { return std::make_unique<sel_case>(R, T, k, dist); });
}

enum class op { dense, ragged, flat };
const char* op_name(op o) { return o == op::dense ? "dense" : o == op::ragged ? "ragged" : "flat"; }

/// Output of one selection: dense [R][k] or ragged (cu, pos).
struct selection {
  std::vector<pos_t> pos;
  std::vector<std::int32_t> cu;
};

template <class Backend>
void run_kvevict(benchmark::State& st, const sel_case& c, op o, Backend be, selection& out) {
  scratch sc;
  out.cu = c.cu;
  const index_t total = o == op::dense ? c.R * c.k : o == op::ragged ? c.ragged_total() : c.R * c.k;
  out.pos.assign(static_cast<std::size_t>(total), 0);
  auto call = [&]() -> status {
    if (o == op::dense) return select_topk(be, sc.ws(), c.view(), nullptr, *make_matrix_view(out.pos.data(), c.R, c.k));
    if (o == op::ragged)
      return select_topk(be, sc.ws(), c.view(), nullptr, ragged_positions_out{out.pos.data(), c.cu.data(), c.R});
    out.cu.assign(static_cast<std::size_t>(c.R + 1), 0);
    return select_topk_flat(be, sc.ws(), c.view(), nullptr, total, c.floors.data(), out.cu.data(), out.pos.data());
  };
  if (!ok(st, call(), "size query")) return;
  sc.allocate();
  for (auto _ : st) {
    if (!ok(st, call(), op_name(o))) return;
    benchmark::DoNotOptimize(out.pos.data());
    benchmark::ClobberMemory();
  }
  st.counters["workspace_KiB"] = static_cast<double>(sc.ws().bytes) / 1024;
}

void run_baseline(benchmark::State& st, const sel_case& c, op o, baseline::select_algo a, int threads, selection& out) {
  std::vector<pos_t> idx;
  baseline::flat_scratch fs;
  out.cu = c.cu;
  const index_t total = o == op::ragged ? c.ragged_total() : c.R * c.k;
  out.pos.assign(static_cast<std::size_t>(total), 0);
  if (o == op::flat) out.cu.assign(static_cast<std::size_t>(c.R + 1), 0);
  for (auto _ : st) {
    if (o == op::dense) {
      baseline::select_rows(
          a, c.scores.data(), c.R, c.T, [&](index_t) { return c.k; },
          [&](index_t r) { return out.pos.data() + r * c.k; }, idx, threads);
    } else if (o == op::ragged) {
      baseline::select_rows(
          a, c.scores.data(), c.R, c.T, [&](index_t r) { return static_cast<index_t>(c.cu[r + 1] - c.cu[r]); },
          [&](index_t r) { return out.pos.data() + c.cu[r]; }, idx, threads);
    } else {
      baseline::select_flat(c.scores.data(), c.R, c.T, total, c.floors.data(), out.cu.data(), out.pos.data(), fs);
    }
    benchmark::DoNotOptimize(out.pos.data());
    benchmark::ClobberMemory();
  }
}

/// The kvevict seq selection (the reference of every check).
selection reference(const sel_case& c, op o) {
  selection out;
  scratch sc;
  out.cu = c.cu;
  const index_t total = o == op::ragged ? c.ragged_total() : c.R * c.k;
  out.pos.assign(static_cast<std::size_t>(total), 0);
  auto call = [&]() -> status {
    if (o == op::dense) return select_topk(seq, sc.ws(), c.view(), nullptr, *make_matrix_view(out.pos.data(), c.R, c.k));
    if (o == op::ragged)
      return select_topk(seq, sc.ws(), c.view(), nullptr, ragged_positions_out{out.pos.data(), c.cu.data(), c.R});
    out.cu.assign(static_cast<std::size_t>(c.R + 1), 0);
    return select_topk_flat(seq, sc.ws(), c.view(), nullptr, total, c.floors.data(), out.cu.data(), out.pos.data());
  };
  (void)call();
  sc.allocate();
  if (!call().ok()) out.pos.clear();
  return out;
}

enum class impl { kvevict, nth_element_sort, partial_sort };
const char* impl_name(impl i) {
  return i == impl::kvevict ? "kvevict" : i == impl::nth_element_sort ? "nth_element_sort" : "partial_sort";
}

template <class Backend>
void run(benchmark::State& st, index_t R, index_t T, index_t k, const std::string& dist, op o, impl which, Backend be) {
  const auto& c = get_case(R, T, k, dist);
  const int threads = std::is_same_v<Backend, par_t> ? par_threads() : 1;
  selection out;
  if (which == impl::kvevict)
    run_kvevict(st, c, o, be, out);
  else
    run_baseline(st, c, o, which == impl::nth_element_sort ? baseline::select_algo::nth_element
                                                           : baseline::select_algo::partial_sort,
                 threads, out);
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations()) * R * T);
  const selection ref = reference(c, o);
  if (ref.pos.empty() && !out.pos.empty()) return fail(st, "no reference");
  if (ref.pos != out.pos || ref.cu != out.cu) fail(st, std::string(impl_name(which)) + " kept other positions than kvevict seq");
}

void reg(op o, index_t R, index_t T, index_t k, const std::string& dist, bool with_partial_sort) {
  const params p = params().add("rows", R).add("T", T).add("k", k).add("scores", dist);
  std::vector<impl> impls = {impl::kvevict, impl::nth_element_sort};
  if (with_partial_sort) impls.push_back(impl::partial_sort);
  for (impl i : impls) {
    // the flattened baseline is single-threaded (one nth_element over the layer)
    add(bench_name("select", op_name(o), impl_name(i), "seq", p),
        [=](benchmark::State& st) { run(st, R, T, k, dist, o, i, seq); });
    if (o != op::flat || i == impl::kvevict)
      add(bench_name("select", op_name(o), impl_name(i), "par", p),
          [=](benchmark::State& st) { run(st, R, T, k, dist, o, i, par); });
  }
}

void register_benchmarks() {
  if (smoke()) {
    reg(op::dense, 4, 512, 64, "attn", true);
    reg(op::dense, 3, 300, 40, "uniform", true);
    reg(op::ragged, 4, 512, 64, "attn", false);
    reg(op::flat, 4, 512, 64, "attn", false);
    return;
  }
  // the targets' shapes (docs/PERFORMANCE.md), both distributions
  for (const char* dist : {"uniform", "attn"}) {
    reg(op::dense, 8, 32768, 2048, dist, true);
    reg(op::dense, 32, 131072, 4096, dist, true);
  }
  // engine shapes: one row per KV head (8), contexts 4K / 32K / 128K, budgets 128 .. 4096
  for (index_t T : {4096, 32768, 131072}) {
    for (index_t k : budgets_for(T, true)) reg(op::dense, 8, T, k, "attn", k <= 1024);
    reg(op::ragged, 8, T, 1024, "attn", false);
    reg(op::flat, 8, T, 1024, "attn", false);
    reg(op::flat, 32, T, 1024, "attn", false);
  }
  // the reference runner's shape: 4 KV heads x 512 tokens, k = 64
  reg(op::dense, 4, runner_context, 64, "attn", true);
  reg(op::ragged, 4, runner_context, 64, "attn", false);
  reg(op::flat, 4, runner_context, 64, "attn", false);
}
}  // namespace

KVB_MAIN(register_benchmarks)
