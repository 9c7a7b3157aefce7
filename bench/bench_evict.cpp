// A whole post-fill eviction of one layer, from the window queries and the layer's K and V
// [H_kv][T][d] to the compacted K and V:
//   snapkv   recipe_scores (window 32, avg pool 5 per query head then GQA mean: kvpress's
//            SnapKVPress pooling; window protected) + uniform_budgets + recipe_select (B per head)
//            + compact of K and of V (dense [H_kv][B][d])
//   lava     recipe_scores (recipe::lava: GQA max, max pool 7, head-max value weighting) +
//            lava_layer_entropy + lava_layer_budgets (this layer among L, the others' entropies
//            given) + select_topk_flat (the layer total over its heads) + compact of K and V into
//            ragged caches
// against (snapkv)
//   blas_nth  (OpenBLAS) what an engine author writes in C++: sgemm_softmax scores (bench_score),
//             direct avg pooling, GQA mean, std::nth_element + sort per head, one memcpy per row
//   torch     bench/torch_snapkv.py (PyTorch, kvpress's way): a separate process, merged by
//             scripts/bench under the same names
// Counters: score_us, alloc_us, select_us, compact_us = where the time of one eviction goes.
#include <kvevict/budget.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/select.hpp>

#include "baselines.hpp"
#include "harness.hpp"

#include <chrono>
#include <tuple>

namespace {
using namespace kvb;
using clock_type = std::chrono::steady_clock;

template <class K>
struct layer_case {
  model_shape s;
  index_t T;
  std::vector<K> q, k, v;        // [hq][w][d], [hkv][T][d], [hkv][T][d]
  std::vector<float> q32, k32;   // fp32 copies for the BLAS baseline
  layer_case(const model_shape& shape, index_t tokens) : s(shape), T(tokens) {
    q.resize(static_cast<std::size_t>(s.hq * s.window * s.dim));
    k.resize(static_cast<std::size_t>(s.hkv * T * s.dim));
    v.resize(k.size());
    fill_normal(q, 71);
    fill_normal(k, 72);
    fill_normal(v, 73);
#if defined(KVEVICT_BENCH_CBLAS)
    q32.resize(q.size());
    k32.resize(k.size());
    for (std::size_t i = 0; i < q.size(); ++i) q32[i] = baseline::widen(q[i]);
    for (std::size_t i = 0; i < k.size(); ++i) k32[i] = baseline::widen(k[i]);
#endif
  }
  kv_view<const K> queries() const { return *make_kv_view(q.data(), s.hq, s.window, s.dim); }
  kv_view<const K> keys() const { return *make_kv_view(k.data(), s.hkv, T, s.dim); }
  kv_view<const K> values() const { return *make_kv_view(v.data(), s.hkv, T, s.dim); }
};

template <class K>
const layer_case<K>& get_case(const model_shape& s, index_t T) {
  return cached<layer_case<K>>(std::make_tuple(std::string(s.name), T), [&] { return std::make_unique<layer_case<K>>(s, T); });
}

recipe snapkv_recipe(const model_shape& s) {
  recipe r = recipe::snapkv();
  r.pool = pool_kind::avg;  // kvpress's SnapKVPress: avg_pool1d, kernel 5
  r.kernel = 5;
  r.window = s.window;
  r.n_recent = s.window;
  return r;
}
recipe lava_recipe(const model_shape& s) {
  recipe r = recipe::lava();
  r.window = s.window;
  r.n_recent = s.window;
  return r;
}

/// Per-phase wall time of the timed iterations.
struct phases {
  double score = 0, alloc = 0, select = 0, compact = 0;
  void report(benchmark::State& st) const {
    const double n = static_cast<double>(st.iterations());
    if (n <= 0) return;
    st.counters["score_us"] = score * 1e6 / n;
    st.counters["alloc_us"] = alloc * 1e6 / n;
    st.counters["select_us"] = select * 1e6 / n;
    st.counters["compact_us"] = compact * 1e6 / n;
  }
};
double since(clock_type::time_point& t) {
  const auto now = clock_type::now();
  const double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

/// The result of one eviction: kept positions (ragged: cu, pos) and the compacted K and V.
template <class K>
struct evicted {
  std::vector<std::int32_t> cu;
  std::vector<pos_t> pos;
  std::vector<K> k, v;
  bool operator==(const evicted& o) const {
    return cu == o.cu && pos == o.pos && k.size() == o.k.size() && v.size() == o.v.size() &&
           std::memcmp(k.data(), o.k.data(), k.size() * sizeof(K)) == 0 &&
           std::memcmp(v.data(), o.v.data(), v.size() * sizeof(K)) == 0;
  }
};

// ------------------------------------------------------------------------------------------------
// kvevict

template <class K>
struct kvevict_evictor {
  const layer_case<K>& c;
  const model_shape s;
  const index_t B;
  const bool lava;
  recipe r;
  std::vector<float> scores;         // [hkv][T]
  std::vector<std::int32_t> budgets; // uniform: [1][hkv]
  std::vector<double> entropies;     // lava: [L], this layer is layer 0
  std::vector<index_t> totals;
  std::vector<std::int32_t> lens;    // ragged caches' lengths
  scratch score_ws, select_ws;
  evicted<K> out;
  phases ph;

  kvevict_evictor(const layer_case<K>& lc, index_t budget, bool is_lava)
      : c(lc), s(lc.s), B(budget), lava(is_lava), r(is_lava ? lava_recipe(lc.s) : snapkv_recipe(lc.s)) {
    scores.resize(static_cast<std::size_t>(s.hkv * c.T));
    budgets.resize(static_cast<std::size_t>(s.hkv));
    entropies.assign(static_cast<std::size_t>(s.layers), 0.0);
    std::uint64_t g = 74;
    for (auto& e : entropies) e = 0.5 + 0.5 * uniform01(g);  // the other layers' entropies
    totals.resize(entropies.size());
    lens.resize(static_cast<std::size_t>(s.hkv));
    out.cu.assign(static_cast<std::size_t>(s.hkv + 1), 0);
    // room for the largest layer total lava_layer_budgets can give: every token, or the model's
    // whole budget
    out.pos.resize(static_cast<std::size_t>(lava ? std::min(s.hkv * c.T, B * s.hkv * s.layers) : s.hkv * B));
    out.k.resize(out.pos.size() * static_cast<std::size_t>(s.dim));
    out.v.resize(out.k.size());
  }
  matrix_view<float> scores_view() { return *make_matrix_view(scores.data(), s.hkv, c.T); }

  template <class Backend>
  status prepare(Backend be) {
    KVEVICT_TRY(recipe_scores(be, score_ws.ws(), r, c.queries(), c.keys(), c.values(), scores_view()));
    score_ws.allocate();
    if (lava) {
      KVEVICT_TRY(select_topk_flat(be, select_ws.ws(), matrix_view<const float>(scores_view()), nullptr, 0, nullptr,
                                   out.cu.data(), out.pos.data()));
    } else {
      KVEVICT_TRY(recipe_select(be, select_ws.ws(), r, matrix_view<const float>(scores_view()),
                                *make_matrix_view(out.pos.data(), s.hkv, B)));
    }
    select_ws.allocate();
    return {};
  }

  template <class Backend>
  status run(Backend be) {
    auto t = clock_type::now();
    KVEVICT_TRY(recipe_scores(be, score_ws.ws(), r, c.queries(), c.keys(), c.values(), scores_view()));
    ph.score += since(t);
    const matrix_view<const float> sv = scores_view();
    const protection prot{r.n_sink, r.n_recent};
    if (!lava) {
      KVEVICT_TRY(uniform_budgets(B * s.hkv, c.T, prot, *make_matrix_view(budgets.data(), 1, s.hkv)));
      ph.alloc += since(t);
      KVEVICT_TRY(recipe_select(be, select_ws.ws(), r, sv, *make_matrix_view(out.pos.data(), s.hkv, budgets[0])));
      ph.select += since(t);
      const auto kept = *make_matrix_view(static_cast<const pos_t*>(out.pos.data()), s.hkv, B);
      KVEVICT_TRY(compact(be, c.keys(), kept, *make_kv_view(out.k.data(), s.hkv, B, s.dim)));
      KVEVICT_TRY(compact(be, c.values(), kept, *make_kv_view(out.v.data(), s.hkv, B, s.dim)));
      for (index_t h = 0; h <= s.hkv; ++h) out.cu[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * B);
      ph.compact += since(t);
      return {};
    }
    lava_entropy_options eo;
    eo.prot = prot;
    KVEVICT_TRY(lava_layer_entropy(be, sv, nullptr, eo, &entropies[0]));
    KVEVICT_TRY(lava_layer_budgets(entropies.data(), s.layers, s.hkv, c.T, prot, B * s.hkv * s.layers, totals.data()));
    ph.alloc += since(t);
    KVEVICT_TRY(select_topk_flat(be, select_ws.ws(), sv, nullptr, totals[0], nullptr, out.cu.data(), out.pos.data()));
    ph.select += since(t);
    const ragged_positions kept{out.pos.data(), out.cu.data(), s.hkv};
    KVEVICT_TRY(compact(be, c.keys(), kept, ragged_cache<K>{out.k.data(), out.cu.data(), lens.data(), s.hkv, s.dim, s.dim}));
    KVEVICT_TRY(compact(be, c.values(), kept, ragged_cache<K>{out.v.data(), out.cu.data(), lens.data(), s.hkv, s.dim, s.dim}));
    ph.compact += since(t);
    return {};
  }
};

template <class K>
evicted<K> reference(const layer_case<K>& c, index_t B, bool lava) {
  kvevict_evictor<K> e(c, B, lava);
  if (!e.prepare(seq).ok() || !e.run(seq).ok()) return {};
  return e.out;
}

template <class K, class Backend>
void run_kvevict(benchmark::State& st, const model_shape& s, index_t T, index_t B, bool lava, Backend be) {
  const auto& c = get_case<K>(s, T);
  kvevict_evictor<K> e(c, B, lava);
  if (!ok(st, e.prepare(be), "size queries")) return;
  for (auto _ : st) {
    if (!ok(st, e.run(be), lava ? "lava eviction" : "snapkv eviction")) return;
    benchmark::ClobberMemory();
  }
  e.ph.report(st);
  st.counters["workspace_MiB"] = static_cast<double>(e.score_ws.ws().bytes + e.select_ws.ws().bytes) / (1 << 20);
  st.counters["kept"] = static_cast<double>(e.out.cu.back());
  if (std::is_same_v<Backend, par_t> && !(e.out == reference(c, B, lava))) fail(st, "par evicted other rows than seq");
}

// ------------------------------------------------------------------------------------------------
// the C++ baseline (SnapKV)

#if defined(KVEVICT_BENCH_CBLAS)
template <class K>
void run_blas(benchmark::State& st, const model_shape& s, index_t T, index_t B, int threads) {
  const auto& c = get_case<K>(s, T);
  const index_t P = T - s.window, g = s.group(), d = s.dim;
  baseline::blas_threads(threads);
  std::vector<float> raw(static_cast<std::size_t>(s.hq * P)), pooled(raw.size()), logits;
  std::vector<float> scores(static_cast<std::size_t>(s.hkv * T));
  std::vector<pos_t> idx;
  evicted<K> out;
  out.pos.resize(static_cast<std::size_t>(s.hkv * B));
  out.k.resize(out.pos.size() * static_cast<std::size_t>(d));
  out.v.resize(out.k.size());
  out.cu.resize(static_cast<std::size_t>(s.hkv + 1));
  for (index_t h = 0; h <= s.hkv; ++h) out.cu[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * B);
  phases ph;
  for (auto _ : st) {
    auto t = clock_type::now();
    baseline::blas_window_scores(s, T, c.q32.data(), c.k32.data(), raw.data(), logits, threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (index_t r = 0; r < s.hq; ++r) baseline::avg_pool_row(raw.data() + r * P, pooled.data() + r * P, P, 5);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (index_t h = 0; h < s.hkv; ++h) {
      for (index_t t2 = 0; t2 < P; ++t2) {
        float acc = 0.f;
        for (index_t j = 0; j < g; ++j) acc += pooled[static_cast<std::size_t>((h * g + j) * P + t2)];
        scores[static_cast<std::size_t>(h * T + t2)] = acc / static_cast<float>(g);
      }
      for (index_t t2 = P; t2 < T; ++t2) scores[static_cast<std::size_t>(h * T + t2)] = INFINITY;
    }
    ph.score += since(t);
    baseline::select_rows(
        baseline::select_algo::nth_element, scores.data(), s.hkv, T, [&](index_t) { return B; },
        [&](index_t h) { return out.pos.data() + h * B; }, idx, threads);
    ph.select += since(t);
    baseline::gather_rows(c.k.data(), T, d, out.pos.data(), out.cu.data(), s.hkv, out.k.data(), threads);
    baseline::gather_rows(c.v.data(), T, d, out.pos.data(), out.cu.data(), s.hkv, out.v.data(), threads);
    ph.compact += since(t);
    benchmark::ClobberMemory();
  }
  ph.report(st);
  // the scores differ from kvevict's in the last bits (another exp and summation order), so a
  // near-tie at the budget's edge may go the other way: allow 0.5% of the kept positions
  const evicted<K> ref = reference(c, B, false);
  if (ref.pos.size() != out.pos.size()) return fail(st, "no reference");
  std::size_t differ = 0;
  for (index_t h = 0; h < s.hkv; ++h) {
    const pos_t* a = ref.pos.data() + h * B;
    const pos_t* b = out.pos.data() + h * B;
    std::vector<pos_t> common;
    std::set_intersection(a, a + B, b, b + B, std::back_inserter(common));
    differ += static_cast<std::size_t>(B) - common.size();
  }
  st.counters["kept_mismatch"] = static_cast<double>(differ) / static_cast<double>(ref.pos.size());
  if (differ * 200 > ref.pos.size()) fail(st, "the BLAS baseline kept other tokens than kvevict");
}
#endif

template <class K>
void reg(const model_shape& s, index_t T, index_t B) {
  for (bool lava : {false, true}) {
    const params p = shape_params(s, T).add("w", s.window).add("B", B).add("kv", kv_type_name(K{}));
    const char* op = lava ? "lava" : "snapkv";
    add(bench_name("evict", op, "kvevict", "seq", p), [=](benchmark::State& st) { run_kvevict<K>(st, s, T, B, lava, seq); });
    add(bench_name("evict", op, "kvevict", "par", p), [=](benchmark::State& st) { run_kvevict<K>(st, s, T, B, lava, par); });
#if defined(KVEVICT_BENCH_CBLAS)
    if (!lava) {
      add(bench_name("evict", op, "blas_nth", "seq", p), [=](benchmark::State& st) { run_blas<K>(st, s, T, B, 1); });
      add(bench_name("evict", op, "blas_nth", "par", p),
          [=](benchmark::State& st) { run_blas<K>(st, s, T, B, par_threads()); });
    }
#endif
  }
}

void register_benchmarks() {
  for (const auto& mc : model_cases()) {
    for (index_t B : budgets_for(mc.tokens, mc.tokens == 32768)) {
      reg<float16>(mc.shape, mc.tokens, B);
      reg<float>(mc.shape, mc.tokens, B);
    }
  }
}
}  // namespace

KVB_MAIN(register_benchmarks)
