// Eviction on the reference runner (examples/runner/evict.hpp, evictor.hpp, laq.hpp,
// duo_calibration.hpp): for every method, the kept sets the runner's cache holds equal the
// library's answer (recipe_scores + budget allocator + selection) computed here on the tensors
// captured from the runner; layer-wise, chunked and decode-time eviction against step-by-step
// references built from the same stages; LAQ's two stages and LAQ++'s block; the oracle against a
// naive double-precision ground truth; LookaheadKV's kept sets against the library stages on the
// scorer's scores, and its evicted cache decoding as the full cache compacted by hand; full budgets
// reproducing the full cache's logits; the calibration and CAKE helpers against naive references;
// every documented error.
#include "support.hpp"
#include "support/shipped.hpp"

#include <methods/duo_calibration.hpp>
#include <methods/laq.hpp>
#include <runner/evictor.hpp>
#include <lookaheadkv/data.hpp>
#include <lookaheadkv/module.hpp>
#include <lookaheadkv/scores.hpp>
#include <report/report.hpp>

#include <kvevict/budget.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

using namespace kvrun;
using kvevict::recipe;
using kvtest::require_error;

namespace {

// The lookaheadkv method's scores: a scorer bound to the shipped module (the evictor's prompt_scorer).
lookahead_scorer& the_scorer() {
  static lookahead_scorer s;
  static const bool bound = [] {
    const status st = s.init(kvtest::shipped_model(), kvtest::shipped_module());
    REQUIRE_MESSAGE(st.ok(), st.message());
    return true;
  }();
  (void)bound;
  return s;
}

// Two model-generated test pairs with short prompts (72..200 tokens) and 16-token responses.
const std::vector<text_pair>& the_pairs() {
  static std::vector<text_pair> p = [] {
    pair_options o;
    o.response = 16;
    o.max_prompt = 200;
    o.short_fraction = 0.0;
    std::vector<text_pair> x;
    const status st = make_pairs(kvtest::shipped_model(), o, test_seed_base + 7, test_seed_base + 9, x, 1);
    REQUIRE_MESSAGE(st.ok(), st.message());
    return x;
  }();
  return p;
}

template <class F>
void with_workspace(F&& f) {
  kvevict::workspace q;
  const status s0 = f(q);
  REQUIRE_MESSAGE(s0.ok(), s0.message());
  std::vector<unsigned char> buf(q.bytes + 64);
  kvevict::workspace ws{buf.data(), buf.size()};
  const status s1 = f(ws);
  REQUIRE_MESSAGE(s1.ok(), s1.message());
}

#define REQUIRE_OK(expr)                                   \
  do {                                                     \
    const ::kvevict::status require_ok_st_ = (expr);       \
    REQUIRE_MESSAGE(require_ok_st_.ok(), require_ok_st_.message()); \
  } while (0)

// The full cache of a prompt and its prefill's queries and last logits.
struct prefilled {
  kv_cache cache;
  block_capture q;
  std::vector<float> logits;
};
prefilled prefill_full(runner& run, const std::vector<int>& prompt) {
  const config& c = kvtest::shipped_model().cfg();
  prefilled p;
  REQUIRE_OK(p.cache.init(c));
  p.q.reset(c, static_cast<index_t>(prompt.size()));
  REQUIRE_OK(run.forward(p.cache, tokens(prompt), logits_mode::last, p.q.hooks()));
  p.logits.assign(run.logits(0), run.logits(0) + c.vocab_size);
  return p;
}

runner make_runner() {
  runner r;
  REQUIRE_OK(r.init(kvtest::shipped_model(), {0, 0, 1}));
  return r;
}

using positions = std::vector<std::vector<pos_t>>;  // [layer * H + head] kept positions, ascending

positions held(const kv_cache& c) {
  positions out;
  for (int l = 0; l < c.layers(); ++l)
    for (index_t h = 0; h < c.kv_heads(); ++h) {
      std::vector<pos_t> v;
      for (index_t j = 0; j < c.length(l, h); ++j) v.push_back(c.position(l, h, j));
      out.push_back(v);
    }
  return out;
}

// The recipe of each method, built here from the published constructors (independently of
// kvrun::make_recipe) with window w and the method's sinks.
recipe reference_recipe(method m, index_t w, index_t duo_recent) {
  recipe r;
  switch (m) {
    case method::streaming_llm: return recipe::streaming_llm(4);
    case method::duo_heuristic:
    case method::duo:
    case method::prulong:
      r = recipe::streaming_llm(4);
      r.n_recent = duo_recent;
      return r;
    case method::h2o: r = recipe::h2o(); break;
    case method::tova: return recipe::tova();
    case method::knorm: return recipe::knorm();
    case method::vatp: r = recipe::vatp(); break;
    case method::cake: r = recipe::cake(); break;
    case method::lava: r = recipe::lava(); break;
    default: r = recipe::snapkv();
  }
  r.window = w;
  r.n_recent = w;
  return r;
}

// The query rows a recipe reads from a prompt of P rows.
kvevict::kv_view<const float> reference_queries(const recipe& r, const block_capture& q, int l, index_t P) {
  switch (r.kind) {
    case kvevict::recipe_kind::h2o: return q.queries(l, 0, P);
    case kvevict::recipe_kind::tova: return q.queries(l, P - 1, 1);
    case kvevict::recipe_kind::knorm:
    case kvevict::recipe_kind::streaming_llm: return {};
    default: return q.queries(l, P - r.window, r.window);
  }
}

// scores[l] [H][T] of recipe r over the first T rows of every head of `c`.
std::vector<std::vector<float>> reference_scores(const recipe& r, const kv_cache& c, index_t T,
                                                 const std::function<kvevict::kv_view<const float>(int)>& queries,
                                                 const std::function<kvevict::kv_view<const float>(int)>& block_keys) {
  const config& cf = kvtest::shipped_model().cfg();
  std::vector<std::vector<float>> out;
  for (int l = 0; l < cf.n_layers; ++l) {
    std::vector<float> s(static_cast<std::size_t>(cf.n_kv_heads * T));
    const auto keys = kvtest::value_of(c.dense_keys(l, T));
    const auto values = kvtest::value_of(c.dense_values(l, T));
    const auto sv = *kvevict::make_matrix_view(s.data(), cf.n_kv_heads, T);
    with_workspace([&](kvevict::workspace& ws) {
      return kvevict::recipe_scores(kvevict::seq, ws, r, queries(l), keys, values, sv, block_keys(l));
    });
    out.push_back(std::move(s));
  }
  return out;
}

// Per-head budgets [L][H] -> ragged recipe_select of each layer.
positions select_per_head(const recipe& r, const std::vector<std::vector<float>>& scores, index_t T,
                          const std::vector<std::int32_t>& budgets) {
  const config& c = kvtest::shipped_model().cfg();
  const index_t H = c.n_kv_heads;
  positions out;
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1), 0);
    for (index_t h = 0; h < H; ++h) cu[static_cast<std::size_t>(h + 1)] = cu[static_cast<std::size_t>(h)] + budgets[static_cast<std::size_t>(l * H + h)];
    std::vector<pos_t> pos(static_cast<std::size_t>(cu.back()));
    const auto sv = *kvevict::make_matrix_view<const float>(scores[static_cast<std::size_t>(l)].data(), H, T);
    with_workspace([&](kvevict::workspace& ws) {
      return kvevict::recipe_select(kvevict::seq, ws, r, sv, kvevict::ragged_positions_out{pos.data(), cu.data(), H});
    });
    for (index_t h = 0; h < H; ++h) out.emplace_back(pos.begin() + cu[static_cast<std::size_t>(h)], pos.begin() + cu[static_cast<std::size_t>(h + 1)]);
  }
  return out;
}

// Flattened selection of layer totals (LAVa): select_topk_flat per layer.
positions select_flat(const std::vector<std::vector<float>>& scores, index_t T, const std::vector<index_t>& totals) {
  const config& c = kvtest::shipped_model().cfg();
  const index_t H = c.n_kv_heads;
  positions out;
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1));
    std::vector<pos_t> pos(static_cast<std::size_t>(totals[static_cast<std::size_t>(l)]));
    const auto sv = *kvevict::make_matrix_view<const float>(scores[static_cast<std::size_t>(l)].data(), H, T);
    with_workspace([&](kvevict::workspace& ws) {
      return kvevict::select_topk_flat(kvevict::seq, ws, sv, nullptr, totals[static_cast<std::size_t>(l)], nullptr, cu.data(), pos.data());
    });
    for (index_t h = 0; h < H; ++h) out.emplace_back(pos.begin() + cu[static_cast<std::size_t>(h)], pos.begin() + cu[static_cast<std::size_t>(h + 1)]);
  }
  return out;
}

std::vector<double> layer_entropies(const std::vector<std::vector<float>>& scores, index_t T, kvevict::protection prot) {
  const config& c = kvtest::shipped_model().cfg();
  std::vector<double> e;
  for (int l = 0; l < c.n_layers; ++l) {
    double x = 0.0;
    kvevict::lava_entropy_options eo;
    eo.prot = prot;
    REQUIRE_OK(kvevict::lava_layer_entropy(kvevict::seq, *kvevict::make_matrix_view<const float>(scores[static_cast<std::size_t>(l)].data(), c.n_kv_heads, T), nullptr, eo, &x));
    e.push_back(x);
  }
  return e;
}

// The library's answer of one allocator over per-layer scores of a T-token prompt.
positions library_select(budget_scheme a, const recipe& r, const std::vector<std::vector<float>>& scores, index_t T,
                         index_t B, const std::vector<double>& cake_pref, const duo_heads* duo) {
  const config& c = kvtest::shipped_model().cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads;
  const kvevict::protection prot{r.n_sink, r.n_recent};
  std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(B));
  const auto bview = *kvevict::make_matrix_view(budgets.data(), L, H);
  switch (a) {
    case budget_scheme::uniform: return select_per_head(r, scores, T, budgets);
    case budget_scheme::pyramid: {
      kvevict::pyramid_options po;
      po.prot = prot;
      REQUIRE_OK(kvevict::pyramid_budgets(B, T, po, bview));
      return select_per_head(r, scores, T, budgets);
    }
    case budget_scheme::cake:
      REQUIRE_OK(kvevict::cake_budgets(cake_pref.data(), B, T, prot, bview));
      return select_per_head(r, scores, T, budgets);
    case budget_scheme::duo: {
      kvevict::duo_options dopt;
      dopt.streaming = prot;
      const index_t k = kvtest::value_of(kvevict::duo_retrieval_heads(B * H * L, L, H, T, dopt));
      std::vector<std::uint8_t> mask(static_cast<std::size_t>(L * H));
      REQUIRE_OK(kvevict::prulong_topk_mask(*kvevict::make_matrix_view(duo->global.data(), L, H), k,
                                            *kvevict::make_matrix_view(mask.data(), L, H)));
      REQUIRE_OK(kvevict::duo_budgets(*kvevict::make_matrix_view<const std::uint8_t>(mask.data(), L, H), T, dopt, bview));
      return select_per_head(r, scores, T, budgets);
    }
    case budget_scheme::adakv: {
      positions out;
      for (int l = 0; l < L; ++l) {
        std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1));
        std::vector<pos_t> pos(static_cast<std::size_t>(B * H));
        kvevict::adakv_options ao;
        ao.prot = prot;
        with_workspace([&](kvevict::workspace& ws) {
          return kvevict::adakv_budgets(kvevict::seq, ws, *kvevict::make_matrix_view<const float>(scores[static_cast<std::size_t>(l)].data(), H, T),
                                        nullptr, B, ao, cu.data(), pos.data());
        });
        for (index_t h = 0; h < H; ++h) out.emplace_back(pos.begin() + cu[static_cast<std::size_t>(h)], pos.begin() + cu[static_cast<std::size_t>(h + 1)]);
      }
      return out;
    }
    case budget_scheme::lava: {
      const std::vector<double> e = layer_entropies(scores, T, prot);
      std::vector<index_t> totals(static_cast<std::size_t>(L));
      REQUIRE_OK(kvevict::lava_layer_budgets(e.data(), L, H, T, prot, B * H * L, totals.data()));
      return select_flat(scores, T, totals);
    }
  }
  return {};
}

std::vector<double> cake_preferences(const kv_cache& full, const block_capture& q, index_t P, index_t w) {
  std::vector<double> pref;
  for (int l = 0; l < full.layers(); ++l) {
    double p = 0.0;
    with_workspace([&](kvevict::workspace& ws) {
      return kvevict::cake_window_preference(kvevict::seq, ws, q.queries(l, P - w, w),
                                             kvtest::value_of(full.dense_keys(l, P)), kvevict::cake_options{}, &p);
    });
    pref.push_back(p);
  }
  return pref;
}

duo_heads calibrated_heads() {
  static duo_heads d = [] {
    std::vector<std::vector<int>> texts;
    for (const text_pair& p : the_pairs()) texts.push_back(p.prompt);
    duo_heads x;
    REQUIRE_OK(duo_calibrate(kvtest::shipped_model(), texts, {}, x));
    return x;
  }();
  return d;
}

}  // namespace

TEST_CASE("every post-fill method keeps exactly the library's answer on the runner's tensors") {
  const config& c = kvtest::shipped_model().cfg();
  runner run = make_runner();
  const duo_heads duo = calibrated_heads();
  for (const text_pair& tp : the_pairs()) {
    const index_t P = static_cast<index_t>(tp.prompt.size());
    const prefilled full = prefill_full(run, tp.prompt);
    for (const index_t B : {index_t(16), index_t(40)})
      for (const named<method>& mn : method_names) {
        const method m = mn.value;
        if (m == method::full || m == method::laq || m == method::laq_pp || m == method::lookaheadkv || m == method::oracle ||
            m == method::speckv)
          continue;
        const std::string method_name_ = method_name(m);
      CAPTURE(method_name_);
        CAPTURE(B);
        CAPTURE(P);
        evict_options o;
        o.recipe = m;
        o.budget = B;
        evictor ev;
        REQUIRE_OK(ev.init(kvtest::shipped_model(), o, &duo));
        kv_cache cache;
        REQUIRE_OK(cache.init(c));
        REQUIRE_OK(ev.prefill(run, cache, tp.prompt, nullptr));
        // the first token's logits are the prefill's (post-fill eviction comes after it)
        CHECK(std::equal(full.logits.begin(), full.logits.end(), ev.next_logits()));

        const recipe r = reference_recipe(m, o.window, o.duo_recent);
        const auto scores = reference_scores(
            r, full.cache, P, [&](int l) { return reference_queries(r, full.q, l, P); },
            [](int) { return kvevict::kv_view<const float>{}; });
        const std::vector<double> pref =
            default_allocator(m) == budget_scheme::cake ? cake_preferences(full.cache, full.q, P, o.window) : std::vector<double>{};
        const positions want = library_select(default_allocator(m), r, scores, P, B, pref, &duo);
        CHECK(held(cache) == want);
        index_t total = 0;
        for (const auto& v : want) total += static_cast<index_t>(v.size());
        CHECK(cache.total_rows() == total);
        if (!uses_head_types(m)) CHECK(total == B * c.n_kv_heads * c.n_layers);  // exact totals
      }
  }
}

TEST_CASE("every allocator under SnapKV scores, and the driver's recorder marks the prompt rows dropped at step P") {
  const config& c = kvtest::shipped_model().cfg();
  runner run = make_runner();
  const text_pair& tp = the_pairs()[0];
  const index_t P = static_cast<index_t>(tp.prompt.size()), B = 24;
  const prefilled full = prefill_full(run, tp.prompt);
  for (const budget_scheme a : {budget_scheme::uniform, budget_scheme::pyramid, budget_scheme::adakv,
                                 budget_scheme::lava, budget_scheme::cake}) {
    const std::string allocator_name_ = allocator_name(a);
      CAPTURE(allocator_name_);
    evict_options o;
    o.recipe = method::snapkv;
    o.alloc = a;
    o.budget = B;
    evictor ev;
    REQUIRE_OK(ev.init(kvtest::shipped_model(), o));
    kv_cache cache;
    REQUIRE_OK(cache.init(c));
    std::vector<pos_t> buf(static_cast<std::size_t>(c.n_layers * c.n_kv_heads * P));
    kvevict::eviction_recorder rec = kvtest::value_of(kvevict::make_eviction_recorder(buf.data(), c.n_layers, c.n_kv_heads, P));
    REQUIRE_OK(ev.prefill(run, cache, tp.prompt, &rec));
    const recipe r = reference_recipe(method::snapkv, o.window, o.duo_recent);
    const auto scores = reference_scores(
        r, full.cache, P, [&](int l) { return reference_queries(r, full.q, l, P); },
        [](int) { return kvevict::kv_view<const float>{}; });
    const positions want =
        library_select(a, r, scores, P, B, a == budget_scheme::cake ? cake_preferences(full.cache, full.q, P, o.window) : std::vector<double>{}, nullptr);
    CHECK(held(cache) == want);
    // the schedule: kept keys never evicted, the others at step P
    for (int l = 0; l < c.n_layers; ++l)
      for (index_t h = 0; h < c.n_kv_heads; ++h) {
        const auto& keep = want[static_cast<std::size_t>(l * c.n_kv_heads + h)];
        for (index_t j = 0; j < P; ++j) {
          const bool kept = std::binary_search(keep.begin(), keep.end(), static_cast<pos_t>(j));
          CHECK(buf[static_cast<std::size_t>((l * c.n_kv_heads + h) * P + j)] == (kept ? kvevict::never_evicted : static_cast<pos_t>(P)));
        }
      }
  }
}

TEST_CASE("layer-wise eviction: per-layer allocators keep the post-fill sets; the cascades keep the top entries of their final budgets") {
  const config& c = kvtest::shipped_model().cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads;
  runner run = make_runner();
  for (const text_pair& tp : the_pairs()) {
    const index_t P = static_cast<index_t>(tp.prompt.size()), B = 20;
    const prefilled full = prefill_full(run, tp.prompt);
    for (const method m : {method::snapkv, method::pyramidkv, method::adakv, method::h2o, method::lava, method::cake}) {
      const std::string method_name_ = method_name(m);
      CAPTURE(method_name_);
      evict_options o;
      o.recipe = m;
      o.budget = B;
      o.driver = driver_kind::layerwise;
      evictor lw;
      REQUIRE_OK(lw.init(kvtest::shipped_model(), o));
      kv_cache cache;
      REQUIRE_OK(cache.init(c));
      REQUIRE_OK(lw.prefill(run, cache, tp.prompt, nullptr));
      CHECK(cache.total_rows() == B * H * L);
      if (m != method::lava && m != method::cake) {
        o.driver = driver_kind::postfill;
        evictor pf;
        REQUIRE_OK(pf.init(kvtest::shipped_model(), o));
        kv_cache c2;
        REQUIRE_OK(c2.init(c));
        REQUIRE_OK(pf.prefill(run, c2, tp.prompt, nullptr));
        CHECK(held(cache) == held(c2));
        // evicting each layer before the next one runs changes nothing the prompt computes
        CHECK(std::equal(lw.next_logits(), lw.next_logits() + c.vocab_size, full.logits.begin()));
        continue;
      }
      // cascade: every layer holds its final budget's best entries of its own scores
      const recipe r = reference_recipe(m, o.window, o.duo_recent);
      const auto scores = reference_scores(
          r, full.cache, P, [&](int l) { return reference_queries(r, full.q, l, P); },
          [](int) { return kvevict::kv_view<const float>{}; });
      if (m == method::lava) {
        std::vector<index_t> totals;
        for (int l = 0; l < L; ++l) {
          index_t t = 0;
          for (index_t h = 0; h < H; ++h) t += cache.length(l, h);
          totals.push_back(t);
        }
        CHECK(held(cache) == select_flat(scores, P, totals));
      } else {
        std::vector<std::int32_t> budgets;
        for (int l = 0; l < L; ++l)
          for (index_t h = 0; h < H; ++h) {
            budgets.push_back(static_cast<std::int32_t>(cache.length(l, h)));
            CHECK(cache.length(l, h) == cache.length(l, 0));  // CAKE: equal heads within a layer
          }
        CHECK(held(cache) == select_per_head(r, scores, P, budgets));
      }
    }
  }
}

TEST_CASE("chunked eviction, naive and patched, equals a chunk-by-chunk reference built from the stages") {
  const config& c = kvtest::shipped_model().cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads;
  runner run = make_runner();
  const text_pair& tp = the_pairs()[1];
  const index_t P = static_cast<index_t>(tp.prompt.size()), B = 24, chunk = 40, w = 8;
  for (const bool patched : {false, true}) {
    CAPTURE(patched);
    evict_options o;
    o.recipe = method::snapkv;
    o.budget = B;
    o.chunk = chunk;
    o.window = w;
    o.driver = patched ? driver_kind::chunked_patched : driver_kind::chunked_naive;
    evictor ev;
    REQUIRE_OK(ev.init(kvtest::shipped_model(), o));
    kv_cache got;
    REQUIRE_OK(got.init(c));
    REQUIRE_OK(ev.prefill(run, got, tp.prompt, nullptr));

    // reference: forward each chunk, score the cache (kept rows + the chunk) with the chunk's last
    // w queries (naive, final chunk) or the patch (the prompt's last w tokens at their positions,
    // their own keys, only the sinks protected), keep the B best per head, compact
    kv_cache ref;
    REQUIRE_OK(ref.init(c));
    for (index_t s = 0, e = 0; s < P; s = e) {
      e = std::min(s + chunk, P);
      if (patched && e < P && e > P - w) e = P;
      const index_t n = e - s;
      block_capture cq;
      cq.reset(c, n);
      REQUIRE_OK(run.forward(ref, tokens(tp.prompt.data() + s, n), logits_mode::last, cq.hooks()));
      const bool patch = patched && e < P;
      block_capture pq;
      if (patch) {
        std::vector<pos_t> pos;
        for (index_t i = P - w; i < P; ++i) pos.push_back(static_cast<pos_t>(i));
        pq.reset(c, w);
        REQUIRE_OK(run.forward_extra(ref, tokens(tp.prompt.data() + P - w, w, pos.data()), logits_mode::none, pq.hooks()));
      }
      const index_t len = ref.length(0, 0);
      if (len <= B) continue;
      recipe r = recipe::snapkv();
      r.window = std::min(w, n);
      r.n_recent = w;
      if (patch) {
        r.source = kvevict::query_source::external_block;
        r.n_recent = 0;
      }
      const auto scores = reference_scores(
          r, ref, len, [&](int l) { return patch ? pq.queries(l, 0, w) : cq.queries(l, n - r.window, r.window); },
          [&](int l) { return patch ? pq.keys(l, 0, w) : kvevict::kv_view<const float>{}; });
      for (int l = 0; l < L; ++l) {
        std::vector<pos_t> rows(static_cast<std::size_t>(H * B));
        const auto sv = *kvevict::make_matrix_view<const float>(scores[static_cast<std::size_t>(l)].data(), H, len);
        with_workspace([&](kvevict::workspace& ws) {
          return kvevict::recipe_select(kvevict::seq, ws, r, sv, *kvevict::make_matrix_view(rows.data(), H, B));
        });
        std::vector<std::int32_t> cu;
        for (index_t h = 0; h <= H; ++h) cu.push_back(static_cast<std::int32_t>(h * B));
        REQUIRE_OK(ref.compact(l, kvevict::ragged_positions{rows.data(), cu.data(), H}));
      }
    }
    CHECK(held(got) == held(ref));
    CHECK(got.total_rows() == B * H * L);
  }
}

TEST_CASE("decode-time H2O and SnapKV equal a step-by-step reference built from the stages") {
  const config& c = kvtest::shipped_model().cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads;
  runner run = make_runner();
  const text_pair& tp = the_pairs()[0];
  const index_t P = static_cast<index_t>(tp.prompt.size()), B = 20, w = 8;
  for (const method m : {method::h2o, method::snapkv})
    for (const index_t every : {index_t(1), index_t(3)}) {
      const std::string method_name_ = method_name(m);
      CAPTURE(method_name_);
      CAPTURE(every);
      evict_options o;
      o.recipe = m;
      o.budget = B;
      o.window = w;
      o.evict_every = every;
      o.driver = driver_kind::decode;
      evictor ev;
      REQUIRE_OK(ev.init(kvtest::shipped_model(), o));
      kv_cache got;
      REQUIRE_OK(got.init(c));
      REQUIRE_OK(ev.prefill(run, got, tp.prompt, nullptr));

      // reference: H2O's accumulated attention (the prompt's, then each new token's over the
      // cache it attends), protected and cut to B every `every` steps; SnapKV scores with the
      // last w tokens' queries at each eviction step
      prefilled ref = prefill_full(run, tp.prompt);
      std::vector<std::vector<float>> acc(static_cast<std::size_t>(L * H));
      recipe hr = recipe::h2o();
      hr.n_recent = 0;
      const auto init = reference_scores(
          hr, ref.cache, P, [&](int l) { return ref.q.queries(l, 0, P); }, [](int) { return kvevict::kv_view<const float>{}; });
      for (int l = 0; l < L; ++l)
        for (index_t h = 0; h < H; ++h)
          acc[static_cast<std::size_t>(l * H + h)].assign(init[static_cast<std::size_t>(l)].begin() + h * P,
                                                          init[static_cast<std::size_t>(l)].begin() + (h + 1) * P);
      std::vector<block_capture> recent;  // every processed token's queries, for the window
      block_capture all_q;
      all_q.reset(c, P + static_cast<index_t>(tp.response.size()));
      for (int l = 0; l < L; ++l)
        for (index_t h = 0; h < c.n_heads; ++h)
          for (index_t t = 0; t < P; ++t)
            std::copy(&ref.q.queries(l, t, 1)(h, 0, 0), &ref.q.queries(l, t, 1)(h, 0, 0) + c.head_size(), all_q.query_row(l, h, t));
      for (std::size_t t = 0; t + 1 < tp.response.size(); ++t) {
        const int tok = tp.response[t];
        REQUIRE_OK(ev.decode(run, got, tok));
        block_capture nq;
        nq.reset(c, 1);
        REQUIRE_OK(run.decode(ref.cache, tok, nq.hooks()));
        const index_t pos = P + static_cast<index_t>(t);
        for (int l = 0; l < L; ++l)
          for (index_t h = 0; h < c.n_heads; ++h)
            std::copy(&nq.queries(l, 0, 1)(h, 0, 0), &nq.queries(l, 0, 1)(h, 0, 0) + c.head_size(), all_q.query_row(l, h, pos));
        const index_t len = ref.cache.length(0, 0);
        if (m == method::h2o) {
          recipe tr = recipe::tova();
          const auto add = reference_scores(
              tr, ref.cache, len, [&](int l) { return nq.queries(l, 0, 1); }, [](int) { return kvevict::kv_view<const float>{}; });
          for (int l = 0; l < L; ++l)
            for (index_t h = 0; h < H; ++h) {
              auto& a = acc[static_cast<std::size_t>(l * H + h)];
              a.push_back(0.0f);
              for (index_t j = 0; j < len; ++j) a[static_cast<std::size_t>(j)] += add[static_cast<std::size_t>(l)][static_cast<std::size_t>(h * len + j)];
            }
        }
        if ((static_cast<index_t>(t) + 1) % every != 0 || len <= B) continue;
        std::vector<std::vector<float>> scores;
        recipe r;
        if (m == method::h2o) {
          r = recipe::h2o();
          r.n_recent = w;
          for (int l = 0; l < L; ++l) {
            std::vector<float> s;
            for (index_t h = 0; h < H; ++h) s.insert(s.end(), acc[static_cast<std::size_t>(l * H + h)].begin(), acc[static_cast<std::size_t>(l * H + h)].end());
            REQUIRE_OK(kvevict::protect(kvevict::seq, *kvevict::make_matrix_view(s.data(), H, len), 0, w));
            scores.push_back(std::move(s));
          }
        } else {
          r = reference_recipe(method::snapkv, w, 0);
          scores = reference_scores(
              r, ref.cache, len, [&](int l) { return all_q.queries(l, pos + 1 - w, w); },
              [](int) { return kvevict::kv_view<const float>{}; });
        }
        for (int l = 0; l < L; ++l) {
          std::vector<pos_t> rows(static_cast<std::size_t>(H * B));
          const auto sv = *kvevict::make_matrix_view<const float>(scores[static_cast<std::size_t>(l)].data(), H, len);
          with_workspace([&](kvevict::workspace& ws) {
            return kvevict::recipe_select(kvevict::seq, ws, r, sv, *kvevict::make_matrix_view(rows.data(), H, B));
          });
          std::vector<std::int32_t> cu;
          for (index_t h = 0; h <= H; ++h) cu.push_back(static_cast<std::int32_t>(h * B));
          REQUIRE_OK(ref.cache.compact(l, kvevict::ragged_positions{rows.data(), cu.data(), H}));
          if (m != method::h2o) continue;  // only H2O's accumulated scores follow the cache
          for (index_t h = 0; h < H; ++h) {
            auto& a = acc[static_cast<std::size_t>(l * H + h)];
            std::vector<float> kept;
            for (index_t i = 0; i < B; ++i) kept.push_back(a[static_cast<std::size_t>(rows[static_cast<std::size_t>(h * B + i)])]);
            a = kept;
          }
        }
        CHECK(held(got) == held(ref.cache));
      }
      CHECK(held(got) == held(ref.cache));
    }
}

TEST_CASE("LAQ: stage 1 is SnapKV on a copy plus greedy pseudo decoding; stage 2 is the external-block recipe on its queries") {
  const config& c = kvtest::shipped_model().cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads;
  runner run = make_runner();
  for (const text_pair& tp : the_pairs()) {
    const index_t P = static_cast<index_t>(tp.prompt.size()), B = 24, w = 8, steps = evict_options{}.laq_steps;
    const prefilled full = prefill_full(run, tp.prompt);
    // stage 1 by hand: SnapKV on a copy, then the default count of greedy tokens with their queries and keys
    kv_cache copy = full.cache;
    const recipe snap = reference_recipe(method::snapkv, w, 0);
    const auto s1 = reference_scores(
        snap, full.cache, P, [&](int l) { return reference_queries(snap, full.q, l, P); },
        [](int) { return kvevict::kv_view<const float>{}; });
    const positions keep1 = library_select(budget_scheme::uniform, snap, s1, P, B, {}, nullptr);
    for (int l = 0; l < L; ++l) {
      std::vector<pos_t> rows;
      std::vector<std::int32_t> cu{0};
      for (index_t h = 0; h < H; ++h) {
        for (const pos_t p : keep1[static_cast<std::size_t>(l * H + h)]) rows.push_back(p);
        cu.push_back(static_cast<std::int32_t>(rows.size()));
      }
      REQUIRE_OK(copy.compact(l, kvevict::ragged_positions{rows.data(), cu.data(), H}));
    }
    block_capture pseudo;
    pseudo.reset(c, steps);
    std::vector<int> toks;
    int tok = sampler::argmax(full.logits.data(), c.vocab_size);
    for (index_t i = 0; i < steps; ++i) {
      toks.push_back(tok);
      REQUIRE_OK(run.decode(copy, tok, pseudo.hooks(i)));
      tok = sampler::argmax(run.logits(0), c.vocab_size);
    }

    for (const method m : {method::laq, method::laq_pp})
      for (const budget_scheme a : {budget_scheme::uniform, budget_scheme::pyramid, budget_scheme::adakv, budget_scheme::lava,
                                    budget_scheme::cake}) {
        const std::string method_name_ = method_name(m);
      CAPTURE(method_name_);
        const std::string allocator_name_ = allocator_name(a);
      CAPTURE(allocator_name_);
        evict_options o;
        o.recipe = m;
        o.budget = B;
        o.alloc = a;
        evictor ev;
        laq_queries laq;
        REQUIRE_OK(ev.init(kvtest::shipped_model(), o, nullptr, nullptr, &laq));
        kv_cache cache;
        REQUIRE_OK(cache.init(c));
        REQUIRE_OK(ev.prefill(run, cache, tp.prompt, nullptr));
        CHECK(laq.pseudo_tokens() == toks);
        const std::vector<double> pref = a == budget_scheme::cake ? cake_preferences(full.cache, full.q, P, w) : std::vector<double>{};
        positions want;
        if (m == method::laq) {
          for (int l = 0; l < L; ++l) {  // the captured block is the one stage 2 used
            const auto got_q = laq.block().queries(l, 0, steps), ref_q = pseudo.queries(l, 0, steps);
            for (index_t h = 0; h < c.n_heads; ++h)
              for (index_t i = 0; i < steps; ++i)
                for (index_t x = 0; x < c.head_size(); ++x) REQUIRE(got_q(h, i, x) == ref_q(h, i, x));
          }
          recipe r = recipe::snapkv();
          r.source = kvevict::query_source::external_block;
          r.n_recent = w;
          const auto scores = reference_scores(
              r, full.cache, P, [&](int l) { return pseudo.queries(l, 0, steps); }, [&](int l) { return pseudo.keys(l, 0, steps); });
          want = library_select(a, r, scores, P, B, pref, nullptr);
        } else {
          // LAQ++: the window's and the pseudo tokens' queries as one block over the prefix; the
          // window's columns protected; the allocator over the whole prompt
          block_capture u;
          u.reset(c, w + steps);
          for (int l = 0; l < L; ++l) {
            for (index_t h = 0; h < c.n_heads; ++h)
              for (index_t i = 0; i < w + steps; ++i)
                for (index_t x = 0; x < c.head_size(); ++x)
                  u.query_row(l, h, i)[x] = i < w ? full.q.queries(l, P - w + i, 1)(h, 0, x) : pseudo.queries(l, i - w, 1)(h, 0, x);
            for (index_t h = 0; h < H; ++h)
              for (index_t i = 0; i < w + steps; ++i)
                for (index_t x = 0; x < c.head_size(); ++x)
                  u.key_row(l, h, i)[x] = i < w ? full.cache.key_row(l, h, P - w + i)[x] : pseudo.keys(l, i - w, 1)(h, 0, x);
          }
          recipe r = recipe::snapkv();
          r.source = kvevict::query_source::external_block;
          r.n_recent = 0;
          const auto prefix_scores = reference_scores(
              r, full.cache, P - w, [&](int l) { return u.queries(l, 0, w + steps); }, [&](int l) { return u.keys(l, 0, w + steps); });
          std::vector<std::vector<float>> scores;
          for (int l = 0; l < L; ++l) {
            std::vector<float> s(static_cast<std::size_t>(H * P), INFINITY);
            for (index_t h = 0; h < H; ++h)
              for (index_t j = 0; j < P - w; ++j)
                s[static_cast<std::size_t>(h * P + j)] = prefix_scores[static_cast<std::size_t>(l)][static_cast<std::size_t>(h * (P - w) + j)];
            scores.push_back(std::move(s));
          }
          recipe whole = r;
          whole.n_recent = w;
          want = library_select(a, whole, scores, P, B, pref, nullptr);
        }
        CHECK(held(cache) == want);
        CHECK(cache.total_rows() == B * H * L);
      }
  }
}

TEST_CASE("the oracle's scores are the ground truth of recall (naive double reference); it keeps their top-B (recall 1)") {
  const config& c = kvtest::shipped_model().cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads, d = c.head_size(), g = c.group_size();
  runner run = make_runner();
  const text_pair& tp = the_pairs()[0];
  const index_t P = static_cast<index_t>(tp.prompt.size()), m = static_cast<index_t>(tp.response.size()), B = 20;
  prefilled full = prefill_full(run, tp.prompt);
  detail::report_sequence seq;  // the report's per-prompt state: the full cache and the response's captures
  block_capture& resp = seq.response_q;
  resp.reset(c, m);
  REQUIRE_OK(run.forward_extra(full.cache, tokens(tp.response), logits_mode::none, resp.hooks()));
  seq.full = full.cache;
  detail::report_worker w;
  REQUIRE_OK(detail::ground_truth(c, seq, w));
  // naive: for each query head and response row, softmax over the prompt and the response up to
  // itself (double), the prompt columns averaged over the rows, then over the group
  double worst = 0.0;
  for (int l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < P; ++j) {
        double v = 0.0;
        for (index_t q = h * g; q < (h + 1) * g; ++q)
          for (index_t i = 0; i < m; ++i) {
            std::vector<double> logit;
            for (index_t k = 0; k < P + i + 1; ++k) {
              const float* key = k < P ? full.cache.key_row(l, h, k) : &resp.keys(l, k - P, 1)(h, 0, 0);
              double s = 0.0;
              for (index_t x = 0; x < d; ++x) s += static_cast<double>(resp.queries(l, i, 1)(q, 0, x)) * key[x];
              logit.push_back(s / std::sqrt(static_cast<double>(d)));
            }
            const double mx = *std::max_element(logit.begin(), logit.end());
            double z = 0.0;
            for (const double s : logit) z += std::exp(s - mx);
            v += std::exp(logit[static_cast<std::size_t>(j)] - mx) / z / static_cast<double>(m * g);
          }
        const double got = seq.gt[static_cast<std::size_t>((l * H + h) * P + j)];
        worst = std::max(worst, std::abs(got - v) / std::max(v, 1e-6));
      }
  MESSAGE("ground truth vs naive double: worst relative error " << worst);
  CHECK(worst < 1e-4);

  evict_options o;
  o.recipe = method::oracle;
  o.budget = B;
  evictor ev;
  REQUIRE_OK(ev.init(kvtest::shipped_model(), o));
  kv_cache cache;
  REQUIRE_OK(cache.init(c));
  REQUIRE_OK(ev.prefill(run, cache, tp.prompt, nullptr, &tp.response));
  double recall = 0.0;
  REQUIRE_OK(detail::held_recall(c, cache, seq.gt, P, B, w, recall));
  CHECK(recall == 1.0);
  // and exactly the ground truth's top-B per head
  const recipe r = detail::ground_truth_recipe();
  std::vector<std::vector<float>> gt;
  for (int l = 0; l < L; ++l) gt.emplace_back(seq.gt.begin() + l * H * P, seq.gt.begin() + (l + 1) * H * P);
  CHECK(held(cache) == library_select(budget_scheme::uniform, r, gt, P, B, {}, nullptr));
}

TEST_CASE("LookaheadKV: the scorer's scores on the prefilled prompt, any per-head-score allocator, plain top-k; the lookahead KV dropped") {
  const config& c = kvtest::shipped_model().cfg();
  const index_t L = c.n_layers, H = c.n_kv_heads;
  runner run = make_runner();
  for (const text_pair& tp : the_pairs()) {
    const index_t P = static_cast<index_t>(tp.prompt.size());
    prefilled full = prefill_full(run, tp.prompt);
    // the scores: lookahead_scorer on a copy of the prefilled prompt (the copy is unchanged after it)
    kv_cache scored = full.cache;
    lookahead_scorer scorer;
    REQUIRE_OK(scorer.init(kvtest::shipped_model(), kvtest::shipped_module()));
    REQUIRE_OK(scorer.score(run, scored));
    CHECK(held(scored) == held(full.cache));
    std::vector<std::vector<float>> scores;
    for (int l = 0; l < L; ++l) {
      const auto s = scorer.scores(l);
      std::vector<float> v(static_cast<std::size_t>(H * P));
      for (index_t h = 0; h < H; ++h)
        for (index_t t = 0; t < P; ++t) v[static_cast<std::size_t>(h * P + t)] = s(h, t);
      scores.push_back(std::move(v));
    }
    recipe r = recipe::snapkv();  // nothing protected: LookaheadKV keeps no window
    r.n_recent = 0;
    for (const index_t B : {index_t(16), index_t(40)})
      for (const budget_scheme a : {budget_scheme::uniform, budget_scheme::pyramid, budget_scheme::adakv, budget_scheme::lava}) {
        const std::string allocator_name_ = allocator_name(a);
        CAPTURE(allocator_name_);
        CAPTURE(B);
        CAPTURE(P);
        evict_options o;
        o.recipe = method::lookaheadkv;
        o.budget = B;
        o.alloc = a;
        evictor ev;
        REQUIRE_OK(ev.init(kvtest::shipped_model(), o, nullptr, &the_scorer()));
        kv_cache cache;
        REQUIRE_OK(cache.init(c));
        std::vector<pos_t> buf(static_cast<std::size_t>(L * H * P));
        kvevict::eviction_recorder rec = kvtest::value_of(kvevict::make_eviction_recorder(buf.data(), L, H, P));
        REQUIRE_OK(ev.prefill(run, cache, tp.prompt, &rec));
        CHECK(std::equal(full.logits.begin(), full.logits.end(), ev.next_logits()));
        const positions want = library_select(a, r, scores, P, B, {}, nullptr);
        CHECK(held(cache) == want);
        CHECK(cache.total_rows() == B * H * L);
        CHECK(ev.allocation().total == B * H * L);
        CHECK(cache.next_position() == P);  // the lookahead block's KV is gone
        for (int l = 0; l < L; ++l)
          for (index_t h = 0; h < H; ++h) {
            const auto& keep = want[static_cast<std::size_t>(l * H + h)];
            for (index_t j = 0; j < P; ++j) {
              const bool kept = std::binary_search(keep.begin(), keep.end(), static_cast<pos_t>(j));
              CHECK(buf[static_cast<std::size_t>((l * H + h) * P + j)] == (kept ? kvevict::never_evicted : static_cast<pos_t>(P)));
            }
          }
        if (a != budget_scheme::uniform || B != 16) continue;
        // decoding with the kept cache: bit for bit the full cache compacted by hand to `want`
        kv_cache byhand = full.cache;
        for (int l = 0; l < L; ++l) {
          std::vector<pos_t> rows;
          std::vector<std::int32_t> cu{0};
          for (index_t h = 0; h < H; ++h) {
            for (const pos_t p : want[static_cast<std::size_t>(l * H + h)]) rows.push_back(p);
            cu.push_back(static_cast<std::int32_t>(rows.size()));
          }
          REQUIRE_OK(byhand.compact(l, kvevict::ragged_positions{rows.data(), cu.data(), H}));
        }
        bool same = true;
        for (std::size_t t = 0; t + 1 < tp.response.size(); ++t) {
          REQUIRE_OK(ev.decode(run, cache, tp.response[t]));
          const std::vector<float> got(run.logits(0), run.logits(0) + c.vocab_size);
          REQUIRE_OK(run.decode(byhand, tp.response[t]));
          same = same && std::equal(got.begin(), got.end(), run.logits(0));
        }
        CHECK(same);
      }
  }
}

TEST_CASE("a budget of at least the prompt reproduces the full cache's logits, every method and driver") {
  const config& c = kvtest::shipped_model().cfg();
  runner run = make_runner();
  const text_pair& tp = the_pairs()[1];
  const index_t P = static_cast<index_t>(tp.prompt.size());
  // the full cache's teacher-forced logits
  prefilled full = prefill_full(run, tp.prompt);
  std::vector<std::vector<float>> want{full.logits};
  for (std::size_t t = 0; t + 1 < tp.response.size(); ++t) {
    REQUIRE_OK(run.decode(full.cache, tp.response[t]));
    want.emplace_back(run.logits(0), run.logits(0) + c.vocab_size);
  }
  const duo_heads duo = calibrated_heads();
  int runs = 0;
  for (const named<method>& mn : method_names)
    for (const named<driver_kind>& dn : driver_names) {
      const method m = mn.value;
      const driver_kind d = dn.value;
      evict_options o;
      o.recipe = m;
      o.driver = d;
      o.budget = c.seq_len;
      if (!check_evict_options(c, o).ok()) continue;
      const std::string method_name_ = method_name(m);
      CAPTURE(method_name_);
      const std::string driver_name_ = driver_name(d);
      CAPTURE(driver_name_);
      evictor ev;
      laq_queries laq;
      REQUIRE_OK(ev.init(kvtest::shipped_model(), o, &duo, &the_scorer(), &laq));
      kv_cache cache;
      REQUIRE_OK(cache.init(c));
      REQUIRE_OK(ev.prefill(run, cache, tp.prompt, nullptr, &tp.response));
      CHECK(cache.total_rows() == P * c.n_layers * c.n_kv_heads);
      bool same = std::equal(want[0].begin(), want[0].end(), ev.next_logits());
      for (std::size_t t = 0; t + 1 < tp.response.size(); ++t) {
        REQUIRE_OK(ev.decode(run, cache, tp.response[t]));
        same = same && std::equal(want[t + 1].begin(), want[t + 1].end(), run.logits(0));
      }
      CHECK(same);
      ++runs;
    }
  CHECK(runs == 67);  // the supported (method, driver) pairs (52 before duo, prulong and streaming heads in every driver; speckv)
}

TEST_CASE("trained head types: streaming heads hold their sinks + window after the prefill and every decoded token in the layer-wise, chunked and decode drivers") {
  const config& c = kvtest::shipped_model().cfg();
  runner run = make_runner();
  const text_pair& tp = the_pairs()[0];
  const index_t P = static_cast<index_t>(tp.prompt.size());
  duo_heads heads;
  REQUIRE_OK(head_types_from_file(c, KVEVICT_SOURCE_DIR "/models/prulong/stories260K-s50.tsv", -1.0, heads));
  CHECK(heads.retrieval == 10);
  duo_heads duo75;
  REQUIRE_OK(head_types_from_file(c, KVEVICT_SOURCE_DIR "/models/duo/stories260K.tsv", 0.75, duo75));
  CHECK(duo75.retrieval == 5);
  for (const driver_kind d : {driver_kind::layerwise, driver_kind::chunked_naive, driver_kind::chunked_patched, driver_kind::decode})
    for (const method m : {method::prulong, method::duo}) {
      const std::string name = std::string(method_name(m)) + " / " + driver_name(d);
      CAPTURE(name);
      evict_options o;
      o.recipe = m;
      o.driver = d;
      o.chunk = 32;
      evictor ev;
      REQUIRE_OK(ev.init(kvtest::shipped_model(), o, m == method::prulong ? &heads : &duo75));
      kv_cache cache;
      REQUIRE_OK(cache.init(c));
      REQUIRE_OK(ev.prefill(run, cache, tp.prompt, nullptr));
      const std::vector<std::uint8_t>& mask = ev.allocation().retrieval;
      REQUIRE(mask.size() == static_cast<std::size_t>(c.n_layers * c.n_kv_heads));
      index_t retrieval = 0;
      for (std::uint8_t v : mask) retrieval += v;
      CHECK(retrieval == (m == method::prulong ? 10 : 5));
      for (index_t step = 0; step <= 3; ++step) {
        const index_t tokens = P + step;
        for (int l = 0; l < c.n_layers; ++l)
          for (index_t h = 0; h < c.n_kv_heads; ++h) {
            std::vector<pos_t> want;
            for (index_t p = 0; p < tokens; ++p)
              if (mask[static_cast<std::size_t>(l * c.n_kv_heads + h)] != 0 || p < 4 || p > tokens - 12)
                want.push_back(static_cast<pos_t>(p));
            std::vector<pos_t> have;
            for (index_t j = 0; j < cache.length(l, h); ++j) have.push_back(cache.position(l, h, j));
            CHECK(have == want);
          }
        if (step < 3) REQUIRE_OK(ev.decode(run, cache, tp.response[static_cast<std::size_t>(step)]));
      }
    }
}

TEST_CASE("CAKE's window preference and the duo calibration against naive double references") {
  const config& c = kvtest::shipped_model().cfg();
  const index_t L = c.n_layers, Hq = c.n_heads, H = c.n_kv_heads, d = c.head_size(), g = c.group_size();
  runner run = make_runner();
  const text_pair& tp = the_pairs()[0];
  const index_t P = static_cast<index_t>(tp.prompt.size()), w = 8;
  const prefilled full = prefill_full(run, tp.prompt);
  auto probs = [&](int l, index_t h, index_t i, index_t visible) {  // row i of query head h over `visible` keys
    std::vector<double> p;
    for (index_t k = 0; k < visible; ++k) {
      double s = 0.0;
      for (index_t x = 0; x < d; ++x) s += static_cast<double>(full.q.queries(l, i, 1)(h, 0, x)) * full.cache.key_row(l, h / g, k)[x];
      p.push_back(s / std::sqrt(static_cast<double>(d)));
    }
    const double mx = *std::max_element(p.begin(), p.end());
    double z = 0.0;
    for (double& v : p) z += (v = std::exp(v - mx));
    for (double& v : p) v /= z;
    return p;
  };
  const std::vector<double> pref = cake_preferences(full.cache, full.q, P, w);
  for (int l = 0; l < L; ++l) {
    double ent = 0.0, var = 0.0;
    for (index_t h = 0; h < Hq; ++h) {
      std::vector<std::vector<double>> rows;
      for (index_t i = 0; i < w; ++i) rows.push_back(probs(l, h, P - w + i, P - w + i + 1));
      for (index_t j = 0; j < P - w; ++j) {
        double mean = 0.0, m2 = 0.0;
        for (index_t i = 0; i < w; ++i) {
          const double a = rows[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)];
          if (a > 0.0) ent -= a * std::log(a);
          mean += a / static_cast<double>(w);
        }
        for (index_t i = 0; i < w; ++i) m2 += std::pow(rows[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] - mean, 2);
        var += m2 / static_cast<double>(w - 1);
      }
    }
    CAPTURE(l);
    CHECK(pref[static_cast<std::size_t>(l)] == doctest::Approx(ent * var).epsilon(1e-3));
  }
  // duo: the attention mass outside 4 sinks + 12 recent keys, per KV head
  duo_heads got;
  REQUIRE_OK(duo_calibrate(kvtest::shipped_model(), {tp.prompt}, {}, got));
  for (int l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h) {
      double mass = 0.0;
      for (index_t q = h * g; q < (h + 1) * g; ++q)
        for (index_t i = 16; i < P; ++i) {
          const auto p = probs(l, q, i, i + 1);
          for (index_t j = 4; j <= i - 12; ++j) mass += p[static_cast<std::size_t>(j)];
        }
      mass /= static_cast<double>((P - 16) * g);
      CAPTURE(l);
      CAPTURE(h);
      CHECK(got.global[static_cast<std::size_t>(l * H + h)] == doctest::Approx(mass).epsilon(1e-4));
    }
}

TEST_CASE("eviction options and evictor errors") {
  const config& c = kvtest::shipped_model().cfg();
  auto opts = [](method m) {
    evict_options o;
    o.recipe = m;
    return o;
  };
  evict_options o = opts(method::snapkv);
  o.budget = 4;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--budget 4 is below the 8 tokens snapkv protects");
  o = opts(method::streaming_llm);
  o.budget = 3;
  require_error(check_evict_options(c, o), errc::invalid_argument, "below the 4 tokens streaming_llm protects");
  o = opts(method::snapkv);
  o.budget = 513;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--budget 513 is outside [1, 512]");
  o = opts(method::snapkv);
  o.chunk = 0;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--chunk must be >= 1, got 0");
  o = opts(method::h2o);
  o.evict_every = 0;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--evict-every must be >= 1");
  o = opts(method::snapkv);
  o.window = 0;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--window 0 is outside");
  o = opts(method::laq);
  o.driver = driver_kind::chunked_naive;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--recipe laq needs the whole prompt prefilled first");
  o = opts(method::h2o);
  o.driver = driver_kind::chunked_patched;
  require_error(check_evict_options(c, o), errc::invalid_argument, "h2o is not supported");
  o = opts(method::lava);
  o.driver = driver_kind::decode;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--driver decode does not take --allocator lava");
  o = opts(method::cake);
  o.driver = driver_kind::chunked_naive;
  require_error(check_evict_options(c, o), errc::invalid_argument, "does not take --allocator cake");
  o = opts(method::snapkv);
  o.alloc = budget_scheme::duo;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--allocator duo goes with --recipe duo, prulong or duo-heuristic");
  o = opts(method::duo_heuristic);
  o.budget = 12;
  require_error(check_evict_options(c, o), errc::invalid_argument, "below the 16 tokens duo-heuristic protects");
  for (const driver_kind dk : {driver_kind::layerwise, driver_kind::chunked_naive, driver_kind::chunked_patched, driver_kind::decode}) {
    o = opts(method::lookaheadkv);
    o.driver = dk;
    require_error(check_evict_options(c, o), errc::invalid_argument,
                  "--recipe lookaheadkv needs the whole prompt prefilled first: use --driver postfill");
  }
  o = opts(method::lookaheadkv);
  o.alloc = budget_scheme::cake;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--recipe lookaheadkv does not take --allocator cake");
  o.alloc = budget_scheme::duo;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--allocator duo goes with --recipe duo, prulong or duo-heuristic");
  o = opts(method::lookaheadkv);
  o.sinks = 4;
  o.budget = 3;
  require_error(check_evict_options(c, o), errc::invalid_argument, "--budget 3 is below the 4 tokens lookaheadkv protects");

  method m;
  require_error(parse_method("snapky", m), errc::invalid_argument, "unknown recipe 'snapky' (expected one of: full, streaming_llm");
  budget_scheme a;
  require_error(parse_allocator("even", a), errc::invalid_argument, "unknown allocator 'even'");
  driver_kind d;
  require_error(parse_driver("chunked", d), errc::invalid_argument, "unknown driver 'chunked'");
  CHECK(parse_method("laq++", m).ok());
  CHECK(m == method::laq_pp);

  runner run = make_runner();
  evictor ev;
  kv_cache cache;
  REQUIRE_OK(cache.init(c));
  const std::vector<int> prompt{1, 403, 407, 261, 378};
  require_error(ev.prefill(run, cache, prompt, nullptr), errc::invalid_argument, "evictor: not initialised");
  require_error(ev.init(kvtest::shipped_model(), opts(method::duo_heuristic)), errc::invalid_argument, "--recipe duo-heuristic needs head types");
  REQUIRE_OK(ev.init(kvtest::shipped_model(), opts(method::snapkv)));
  require_error(ev.prefill(run, cache, prompt, nullptr), errc::invalid_argument,
                "the prompt has 5 tokens, not more than --window 8: snapkv needs a longer prompt");
  require_error(ev.prefill(run, cache, {}, nullptr), errc::invalid_argument, "evictor: the prompt has no tokens");
  REQUIRE_OK(run.forward(cache, tokens(prompt)));
  require_error(ev.prefill(run, cache, prompt, nullptr), errc::invalid_argument, "evictor: the cache is not empty (next position 5)");
  cache.clear();
  REQUIRE_OK(ev.init(kvtest::shipped_model(), opts(method::oracle)));
  require_error(ev.prefill(run, cache, the_pairs()[0].prompt, nullptr), errc::invalid_argument,
                "oracle: the true response is needed");
  evict_options ch = opts(method::snapkv);
  ch.driver = driver_kind::chunked_naive;
  REQUIRE_OK(ev.init(kvtest::shipped_model(), ch));
  block_capture q;
  require_error(ev.evict_prefilled(run, cache, q, nullptr, nullptr), errc::invalid_argument,
                "evict_prefilled: the chunked-naive driver runs during the prefill");
  // the streaming method needs no window: a 5-token prompt is fine
  REQUIRE_OK(ev.init(kvtest::shipped_model(), opts(method::streaming_llm)));
  REQUIRE_OK(ev.prefill(run, cache, prompt, nullptr));

  // LookaheadKV: a module is needed and must match the model
  require_error(ev.init(kvtest::shipped_model(), opts(method::laq_pp)), errc::invalid_argument,
                "--recipe laq++ needs its pseudo queries (a query_source: methods/laq.hpp)");
  require_error(ev.init(kvtest::shipped_model(), opts(method::lookaheadkv)), errc::invalid_argument,
                "--recipe lookaheadkv needs a trained lookahead module (--lookahead-module)");
  lookahead_module other;
  config small = c;
  small.dim = 32;
  small.hidden_dim = 64;
  REQUIRE_OK(other.shape(lookahead_dims::of(small), lookahead_config{}));
  lookahead_scorer other_scorer;  // the evictor takes the scorer, which checks its module
  require_error(other_scorer.init(kvtest::shipped_model(), other), errc::shape_mismatch,
                "lookahead module was trained for dim 32 but the model has dim 64");
  // no window: a 5-token prompt is fine, and a budget of at least the prompt keeps it whole
  evict_options lo = opts(method::lookaheadkv);
  lo.budget = 4;
  REQUIRE_OK(ev.init(kvtest::shipped_model(), lo, nullptr, &the_scorer()));
  cache.clear();
  REQUIRE_OK(ev.prefill(run, cache, prompt, nullptr));
  CHECK(cache.total_rows() == 4 * c.n_layers * c.n_kv_heads);
  // the prompt and the 16 lookahead tokens must fit the context
  std::vector<int> long_prompt(500, 403);
  long_prompt[0] = 1;
  cache.clear();
  require_error(ev.prefill(run, cache, long_prompt, nullptr), errc::out_of_range,
                "lookahead_scorer: 500 prompt tokens + 16 lookahead tokens exceed the context of 512");
  CHECK(parse_method("lookaheadkv", m).ok());
  CHECK(m == method::lookaheadkv);
}
