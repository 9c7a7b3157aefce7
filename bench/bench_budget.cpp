// Budget allocators (budget.hpp) of one model (L layers x H_kv heads, prompt T, budget B = 1024
// per head, window w = 32 protected):
//   uniform, pyramid (exact and kvcache_factory rounding), lava_budgets, cake_budgets: O(L H)
//       arithmetic on a few numbers; measured alone (no baseline is meaningful)
//   adakv          adakv_budgets over one layer's protected scores [H][T] (flattened top-k with a
//                  floor of 0.2 B) vs nth_element_flat (baselines.hpp, same output)
//   lava_entropy   lava_layer_entropy of one layer vs naive (two passes, std::log, double) and
//                  the memcpy bound of reading the scores
//   cake_stats     cake_layer_stats of one layer's window attention [H_q][w][T - w] vs naive and
//                  memcpy
//   cascade        layer_cascade (LAVa Algorithm 2, flattened split): init + the L add_layer
//                  steps of a prefill, vs reselect_all: at every step, every layer re-selected
//                  from its original scores with the step's budget (the same kept sets; the
//                  budgets are taken from the cascade, only the selections are timed)
#include <kvevict/budget.hpp>
#include <kvevict/select.hpp>

#include "baselines.hpp"
#include "harness.hpp"

#include <tuple>

namespace {
using namespace kvb;

constexpr index_t head_budget = 1024;

index_t budget_for(index_t T) { return T == runner_context ? 64 : smoke() ? 16 : head_budget; }

// ------------------------------------------------------------------------------------------------
// protected per-layer scores [L][H][T] (attention-like, last w = +inf)

struct layers_case {
  model_shape s;
  index_t T, L;
  std::vector<float> scores;     // [L][H][T]
  std::vector<double> weights;   // per-layer entropies in [0.5, 1)
  layers_case(const model_shape& shape, index_t tokens, index_t layers) : s(shape), T(tokens), L(layers) {
    scores.resize(static_cast<std::size_t>(L * s.hkv * T));
    fill_attention_like(scores, 51);
    for (index_t r = 0; r < L * s.hkv; ++r)
      for (index_t t = T - s.window; t < T; ++t) scores[static_cast<std::size_t>(r * T + t)] = INFINITY;
    std::uint64_t g = 52;
    for (index_t l = 0; l < L; ++l) weights.push_back(0.5 + 0.5 * uniform01(g));
  }
  matrix_view<const float> layer(index_t l) const {
    return *make_matrix_view(scores.data() + l * s.hkv * T, s.hkv, T);
  }
  protection prot() const { return {0, s.window}; }
};

const layers_case& get_layers(const model_shape& s, index_t T, index_t L) {
  return cached<layers_case>(std::make_tuple(std::string(s.name), T, L),
                             [&] { return std::make_unique<layers_case>(s, T, L); });
}

// ------------------------------------------------------------------------------------------------
// O(L H) allocators

void run_small(benchmark::State& st, const model_shape& s, index_t T, const std::string& which) {
  const index_t L = s.layers, H = s.hkv, B = budget_for(T);
  const protection prot{0, s.window};
  std::vector<std::int32_t> out(static_cast<std::size_t>(L * H));
  std::vector<index_t> totals(static_cast<std::size_t>(L));
  std::vector<double> w(static_cast<std::size_t>(L));
  std::uint64_t g = 53;
  for (auto& x : w) x = 0.5 + 0.5 * uniform01(g);
  const auto ov = *make_matrix_view(out.data(), L, H);
  pyramid_options po;
  po.prot = prot;
  if (which == "pyramid_kvcache_factory") po.rounding = pyramid_rounding::kvcache_factory;
  std::int64_t sum = 0;
  for (auto _ : st) {
    status r;
    if (which == "uniform")
      r = uniform_budgets(B * L * H, T, prot, ov);
    else if (which == "pyramid_exact" || which == "pyramid_kvcache_factory")
      r = pyramid_budgets(B, T, po, ov);
    else if (which == "lava_budgets")
      r = lava_layer_budgets(w.data(), L, H, T, prot, B * L * H, totals.data());
    else {  // cake: preferences from statistics, then budgets
      for (index_t l = 0; l < L; ++l) {
        double p = 0;
        r = cake_preference(cake_stats{w[l], w[L - 1 - l]}, cake_options{}, &p);
        w[l] = p;
      }
      if (r.ok()) r = cake_budgets(w.data(), B, T, prot, ov);
    }
    if (!ok(st, r, which.c_str())) return;
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(totals.data());
  }
  // exact totals (the kvcache_factory rounding is documented to keep more)
  if (which == "lava_budgets") {
    for (index_t l = 0; l < L; ++l) sum += totals[l];
  } else {
    for (auto x : out) sum += x;
  }
  if (which != "pyramid_kvcache_factory" && sum != B * L * H) fail(st, which + ": the budgets do not sum to B L H");
}

// ------------------------------------------------------------------------------------------------
// AdaKV (one layer)

template <class Backend>
void run_adakv(benchmark::State& st, const model_shape& s, index_t T, bool kvevict, Backend be) {
  const auto& c = get_layers(s, T, 1);
  const index_t H = s.hkv, B = budget_for(T);
  adakv_options opt;
  opt.prot = c.prot();
  std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1)), ref_cu(cu.size());
  std::vector<pos_t> pos(static_cast<std::size_t>(B * H)), ref_pos(pos.size());
  scratch sc;
  if (!ok(st, adakv_budgets(seq, sc.ws(), c.layer(0), nullptr, B, opt, ref_cu.data(), ref_pos.data()), "size query"))
    return;
  sc.allocate();
  if (!ok(st, adakv_budgets(seq, sc.ws(), c.layer(0), nullptr, B, opt, ref_cu.data(), ref_pos.data()), "adakv_budgets"))
    return;
  sc.reset();
  if (!ok(st, adakv_budgets(be, sc.ws(), c.layer(0), nullptr, B, opt, cu.data(), pos.data()), "size query")) return;
  sc.allocate();
  const std::vector<std::int32_t> floors(static_cast<std::size_t>(H),
                                         static_cast<std::int32_t>(adakv_head_floor(B, T, s.window, opt.alpha, opt.floor)));
  baseline::flat_scratch fs;
  for (auto _ : st) {
    if (kvevict) {
      if (!ok(st, adakv_budgets(be, sc.ws(), c.layer(0), nullptr, B, opt, cu.data(), pos.data()), "adakv_budgets")) return;
    } else {
      baseline::select_flat(c.scores.data(), H, T, B * H, floors.data(), cu.data(), pos.data(), fs);
    }
    benchmark::DoNotOptimize(pos.data());
    benchmark::ClobberMemory();
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations()) * H * T);
  if (cu != ref_cu || pos != ref_pos) fail(st, "adakv: kept sets differ from kvevict seq's");
}

// ------------------------------------------------------------------------------------------------
// LAVa entropy (one layer)

double naive_entropy(const float* s, index_t H, index_t T, index_t w) {
  double sum = 0;
  for (index_t h = 0; h < H; ++h)
    for (index_t t = 0; t < T - w; ++t) sum += s[h * T + t];
  double e = 0;
  for (index_t h = 0; h < H; ++h)
    for (index_t t = 0; t < T - w; ++t) {
      const double p = s[h * T + t] / sum;
      if (p > 0) e -= p * std::log(p);
    }
  const double M = static_cast<double>(H * (T - w));
  return M > 1 ? e / std::log(M) : 0.0;
}

template <class Backend>
void run_entropy(benchmark::State& st, const model_shape& s, index_t T, const std::string& which, Backend be) {
  const auto& c = get_layers(s, T, 1);
  const std::size_t bytes = static_cast<std::size_t>(s.hkv * T) * sizeof(float);
  if (which == "memcpy") return run_memcpy_bound(st, bytes, 0, std::is_same_v<Backend, par_t>);
  lava_entropy_options opt;
  opt.prot = c.prot();
  double e = 0;
  for (auto _ : st) {
    if (which == "kvevict") {
      if (!ok(st, lava_layer_entropy(be, c.layer(0), nullptr, opt, &e), "lava_layer_entropy")) return;
    } else {
      e = naive_entropy(c.scores.data(), s.hkv, T, s.window);
    }
    benchmark::DoNotOptimize(e);
  }
  set_traffic(st, bytes, 0);
  const double ref = naive_entropy(c.scores.data(), s.hkv, T, s.window);
  st.counters["entropy"] = e;
  if (!(std::fabs(e - ref) <= 1e-9 * std::fabs(ref))) fail(st, "entropy differs from the naive double computation");
}

// ------------------------------------------------------------------------------------------------
// CAKE statistics (one layer's window attention)

struct cake_case {
  index_t R, w, C;
  std::vector<float> att;  // [R][w][C], each row a probability distribution
  cake_case(index_t rows, index_t window, index_t cols) : R(rows), w(window), C(cols) {
    att.resize(static_cast<std::size_t>(R * w * C));
    fill_attention_like(att, 61);
    for (index_t r = 0; r < R * w; ++r) {
      double sum = 0;
      for (index_t j = 0; j < C; ++j) sum += att[static_cast<std::size_t>(r * C + j)];
      for (index_t j = 0; j < C; ++j) att[static_cast<std::size_t>(r * C + j)] /= static_cast<float>(sum);
    }
  }
};

cake_stats naive_cake(const cake_case& c) {
  cake_stats out;
  for (index_t r = 0; r < c.R; ++r)
    for (index_t j = 0; j < c.C; ++j) {
      double mean = 0;
      for (index_t i = 0; i < c.w; ++i) {
        const double p = c.att[static_cast<std::size_t>((r * c.w + i) * c.C + j)];
        mean += p;
        if (p > 0) out.entropy -= p * std::log(p);
      }
      mean /= static_cast<double>(c.w);
      double var = 0;
      for (index_t i = 0; i < c.w; ++i) {
        const double dlt = c.att[static_cast<std::size_t>((r * c.w + i) * c.C + j)] - mean;
        var += dlt * dlt;
      }
      out.variance += var / static_cast<double>(c.w - 1);
    }
  return out;
}

template <class Backend>
void run_cake(benchmark::State& st, const model_shape& s, index_t T, const std::string& which, Backend be) {
  const auto& c = cached<cake_case>(std::make_tuple(std::string(s.name), T),
                                    [&] { return std::make_unique<cake_case>(s.hq, s.window, T - s.window); });
  const std::size_t bytes = c.att.size() * sizeof(float);
  if (which == "memcpy") return run_memcpy_bound(st, bytes, 0, std::is_same_v<Backend, par_t>);
  const auto view = *make_kv_view(static_cast<const float*>(c.att.data()), c.R, c.w, c.C);
  cake_stats out;
  for (auto _ : st) {
    if (which == "kvevict") {
      if (!ok(st, cake_layer_stats(be, view, &out), "cake_layer_stats")) return;
    } else {
      out = naive_cake(c);
    }
    benchmark::DoNotOptimize(out);
  }
  set_traffic(st, bytes, 0);
  const cake_stats ref = naive_cake(c);
  if (!(std::fabs(out.entropy - ref.entropy) <= 1e-9 * ref.entropy) ||
      !(std::fabs(out.variance - ref.variance) <= 1e-6 * ref.variance))
    fail(st, "cake statistics differ from the naive double computation");
}

// ------------------------------------------------------------------------------------------------
// the layer cascade over a whole prefill

struct cascade_run {
  cascade_config cfg;
  std::vector<unsigned char> memory;
  layer_cascade c;
  scratch sc;
};

template <class Backend>
status cascade_all(Backend be, const layers_case& lc, cascade_run& r) {
  KVEVICT_TRY(r.c.init(r.cfg, r.memory.data(), r.memory.size()));
  for (index_t l = 0; l < lc.L; ++l) KVEVICT_TRY(r.c.add_layer(be, r.sc.ws(), l, lc.layer(l), lc.weights[l]));
  return {};
}

template <class Backend>
void run_cascade(benchmark::State& st, const model_shape& s, index_t T, bool kvevict, Backend be) {
  const auto& lc = get_layers(s, T, s.layers);
  const index_t L = s.layers, H = s.hkv, B = budget_for(T);
  cascade_run r;
  r.cfg = cascade_config{L, H, T, lc.prot(), B * H * L, cascade_split::flattened};
  const auto bytes = layer_cascade::state_bytes(r.cfg);
  if (!ok(st, bytes.ok() ? status{} : bytes.error(), "state_bytes")) return;
  r.memory.resize(*bytes);
  if (!ok(st, r.c.init(r.cfg, r.memory.data(), r.memory.size()), "init")) return;
  if (!ok(st, r.c.add_layer(be, r.sc.ws(), 0, lc.layer(0), lc.weights[0]), "size query")) return;
  r.sc.allocate();
  // one run outside the timing: every step's layer totals (the baseline's budgets)
  std::vector<index_t> step_totals(static_cast<std::size_t>(L * L), 0);
  if (!ok(st, r.c.init(r.cfg, r.memory.data(), r.memory.size()), "init")) return;
  for (index_t m = 0; m < L; ++m) {
    if (!ok(st, r.c.add_layer(be, r.sc.ws(), m, lc.layer(m), lc.weights[m]), "add_layer")) return;
    for (index_t j = 0; j <= m; ++j) step_totals[static_cast<std::size_t>(m * L + j)] = r.c.layer_total(j);
  }
  // the baseline's state: the last selection of every layer
  std::vector<std::int32_t> cu(static_cast<std::size_t>(L * (H + 1)));
  std::vector<pos_t> pos(static_cast<std::size_t>(L * H * T));
  scratch flat_ws;
  (void)select_topk_flat(be, flat_ws.ws(), lc.layer(0), nullptr, 0, nullptr, cu.data(), pos.data());
  flat_ws.allocate();
  for (auto _ : st) {
    if (kvevict) {
      if (!ok(st, cascade_all(be, lc, r), "cascade")) return;
    } else {
      for (index_t m = 0; m < L; ++m)
        for (index_t j = 0; j <= m; ++j)
          if (!ok(st,
                  select_topk_flat(be, flat_ws.ws(), lc.layer(j), nullptr, step_totals[static_cast<std::size_t>(m * L + j)],
                                   nullptr, cu.data() + j * (H + 1), pos.data() + j * H * T),
                  "select_topk_flat"))
            return;
    }
    benchmark::ClobberMemory();
  }
  st.counters["layers"] = static_cast<double>(L);
  // the final kept sets: the cascade's held positions == direct selection from the original scores
  if (!kvevict) return;
  for (index_t j = 0; j < L; ++j) {
    std::vector<std::int32_t> dcu(static_cast<std::size_t>(H + 1));
    std::vector<pos_t> dpos(static_cast<std::size_t>(H * T));
    if (!ok(st, select_topk_flat(seq, flat_ws.ws(), lc.layer(j), nullptr, r.c.layer_total(j), nullptr, dcu.data(), dpos.data()),
            "select_topk_flat"))
      return;
    const ragged_positions held = r.c.positions(j);
    for (index_t h = 0; h < H; ++h) {
      if (held.length(h) != dcu[h + 1] - dcu[h]) return fail(st, "cascade: a head's final count differs");
      for (index_t i = 0; i < held.length(h); ++i)
        if (held.pos[held.cu[h] + i] != dpos[dcu[h] + i]) return fail(st, "cascade: final kept sets differ");
    }
  }
}

// ------------------------------------------------------------------------------------------------

void register_benchmarks() {
  for (const auto& mc : model_cases()) {
    const model_shape s = mc.shape;
    const index_t T = mc.tokens;
    const params p = shape_params(s, T).add("L", s.layers).add("B", budget_for(T)).add("w", s.window);
    if (T != 131072 || smoke())  // O(L H): one context is enough
      for (const char* which : {"uniform", "pyramid_exact", "pyramid_kvcache_factory", "lava_budgets", "cake_budgets"})
        add(bench_name("budget", which, "kvevict", "seq", p),
            [=](benchmark::State& st) { run_small(st, s, T, which); });
    for (bool kv : {true, false}) {
      const char* impl = kv ? "kvevict" : "nth_element_flat";
      add(bench_name("budget", "adakv", impl, "seq", p), [=](benchmark::State& st) { run_adakv(st, s, T, kv, seq); });
      if (kv) add(bench_name("budget", "adakv", impl, "par", p), [=](benchmark::State& st) { run_adakv(st, s, T, kv, par); });
    }
    for (const char* which : {"kvevict", "naive", "memcpy"}) {
      add(bench_name("budget", "lava_entropy", which, "seq", p),
          [=](benchmark::State& st) { run_entropy(st, s, T, which, seq); });
      if (std::string(which) != "naive")
        add(bench_name("budget", "lava_entropy", which, "par", p),
            [=](benchmark::State& st) { run_entropy(st, s, T, which, par); });
    }
    for (const char* which : {"kvevict", "naive", "memcpy"}) {
      add(bench_name("budget", "cake_stats", which, "seq", p), [=](benchmark::State& st) { run_cake(st, s, T, which, seq); });
      if (std::string(which) != "naive")
        add(bench_name("budget", "cake_stats", which, "par", p),
            [=](benchmark::State& st) { run_cake(st, s, T, which, par); });
    }
    if (T <= 32768)  // the re-selecting baseline is O(L^2 H T)
      for (bool kv : {true, false}) {
        const char* impl = kv ? "kvevict" : "reselect_all";
        add(bench_name("budget", "cascade", impl, "seq", p), [=](benchmark::State& st) { run_cascade(st, s, T, kv, seq); });
        add(bench_name("budget", "cascade", impl, "par", p), [=](benchmark::State& st) { run_cascade(st, s, T, kv, par); });
      }
  }
}
}  // namespace

KVB_MAIN(register_benchmarks)
