// runner/evict.hpp: the published eviction methods on the reference runner, through kvevict's
// recipes, budget allocators and drivers (docs/runner.md, "Eviction").
//
//   kvrun::evict_options o;                       // recipe, budget, allocator, driver, window, ...
//   o.recipe = kvrun::method::snapkv;  o.budget = 32;
//   kvrun::evictor ev;  KVEVICT_TRY(ev.init(model, o));
//   KVEVICT_TRY(ev.prefill(run, cache, prompt, &recorder));   // prefill + eviction (any driver)
//   int tok = kvrun::sampler::argmax(ev.next_logits(), vocab);
//   KVEVICT_TRY(ev.decode(run, cache, tok));                  // decode (+ decode-time eviction)
//
// What an engine author reads here: how each driver is fed from the runner's forward hooks.
//   postfill      prefill everything, then post_fill_driver: add_layer per layer with the queries
//                 the recipe reads (captured by the prefill's after_layer hook), decide, compact.
//   layerwise     inside the prefill's after_layer hook: cascade_driver (LAVa / CAKE cascading:
//                 the new layer and every lower layer whose budget shrank are compacted) or, for
//                 per-layer allocators, post_fill_driver layer by layer (same kept sets as postfill,
//                 lower memory peak).
//   chunked-*     the prompt in chunks: forward a chunk, (patched: forward_extra the prompt's last w
//                 tokens at their true positions, keeping their queries and keys), add_layer per
//                 layer, decide, compact; the next chunk attends over what was kept.
//   decode        plain prefill; then after every decoded token decode_driver::step per layer
//                 (H2O accumulates attention every step) and a compaction when it evicts.
// LAQ / LAQ++ (a query_source: methods/laq.hpp), SpecKV (methods/speckv.hpp's draft response) and
// the response oracle are post-fill methods with an external query block; LookaheadKV is post-fill
// with a prompt_scorer's scores (lookaheadkv/scores.hpp: the trained module's).
#pragma once

#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/workers.hpp>

#include <kvevict/budget.hpp>
#include <kvevict/driver.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/train/prulong.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvrun {

// ---------------------------------------------------------------------------------------------
// Names

/// The eviction methods the runner wires (`--recipe`). A method is a recipe (kvevict::recipe),
/// a default budget allocator and, for LAQ and the oracle, a query block.
enum class method : int {
  full,           ///< no eviction (the reference)
  streaming_llm,  ///< sinks + recent tokens
  h2o,            ///< accumulated attention
  tova,           ///< the last token's attention
  snapkv,         ///< observation window, uniform budgets
  pyramidkv,      ///< SnapKV scores, PyramidKV budgets
  knorm,          ///< smallest key norms
  vatp,           ///< window attention x value norm
  adakv,          ///< SnapKV scores, AdaKV head budgets
  cake,           ///< CAKE indicator and layer preferences
  lava,           ///< LAVa scores and entropy layer budgets
  duo_heuristic,  ///< Duo head types from an attention-mass calibration (methods/duo_calibration.hpp), not trained
  duo,            ///< DuoAttention: head types from trained gates (a head-mask TSV, kvevict-headgates duo)
  prulong,        ///< PruLong: head types from a trained mask (a head-mask TSV, kvevict-headgates prulong)
  laq,            ///< Lookahead Q-Cache: pseudo-decoded queries (methods/laq.hpp)
  laq_pp,         ///< LAQ++: pseudo queries and the prompt's window
  speckv,         ///< SpecKV: a draft model's response as the query block (methods/speckv.hpp)
  lookaheadkv,    ///< LookaheadKV: a trained lookahead module's scores (a prompt_scorer)
  oracle,         ///< the true response's queries (an upper bound)
};
/// How budgets are shared by layers and heads (`--allocator`): the library's budget schemes
/// (kvevict/budget/allocation.hpp), under their names.
using kvevict::budget_scheme;

/// When eviction runs (`--driver`).
enum class driver_kind : int { postfill, layerwise, chunked_naive, chunked_patched, decode };

/// An option value and its command-line name; the tables list every value, in this order.
template <class E>
struct named {
  E value;
  const char* name;
};
inline constexpr named<method> method_names[] = {
    {method::full, "full"},   {method::streaming_llm, "streaming_llm"}, {method::h2o, "h2o"},
    {method::tova, "tova"},   {method::snapkv, "snapkv"},               {method::pyramidkv, "pyramidkv"},
    {method::knorm, "knorm"}, {method::vatp, "vatp"},                   {method::adakv, "adakv"},
    {method::cake, "cake"},   {method::lava, "lava"},                   {method::duo_heuristic, "duo-heuristic"},
    {method::duo, "duo"},     {method::prulong, "prulong"},
    {method::laq, "laq"},     {method::laq_pp, "laq++"},                {method::speckv, "speckv"},
    {method::lookaheadkv, "lookaheadkv"},                               {method::oracle, "oracle"}};
inline constexpr named<budget_scheme> allocator_names[] = {
    {budget_scheme::uniform, kvevict::budget_scheme_name(budget_scheme::uniform)},
    {budget_scheme::pyramid, kvevict::budget_scheme_name(budget_scheme::pyramid)},
    {budget_scheme::adakv, kvevict::budget_scheme_name(budget_scheme::adakv)},
    {budget_scheme::lava, kvevict::budget_scheme_name(budget_scheme::lava)},
    {budget_scheme::cake, kvevict::budget_scheme_name(budget_scheme::cake)},
    {budget_scheme::duo, kvevict::budget_scheme_name(budget_scheme::duo)}};
inline constexpr named<driver_kind> driver_names[] = {{driver_kind::postfill, "postfill"},
                                                      {driver_kind::layerwise, "layerwise"},
                                                      {driver_kind::chunked_naive, "chunked-naive"},
                                                      {driver_kind::chunked_patched, "chunked-patched"},
                                                      {driver_kind::decode, "decode"}};

namespace detail {
template <class E, std::size_t N>
constexpr const char* name_of(const named<E> (&all)[N], E e) noexcept {
  for (const named<E>& n : all)
    if (n.value == e) return n.name;
  return "unknown";
}
template <class E, std::size_t N>
status parse_name(std::string_view text, const named<E> (&all)[N], const char* what, E& out) {
  std::string names;
  for (const named<E>& n : all) {
    if (text == n.name) {
      out = n.value;
      return {};
    }
    names += names.empty() ? "" : ", ";
    names += n.name;
  }
  return status::error(errc::invalid_argument, "unknown %s '%.*s' (expected one of: %s)", what,
                       static_cast<int>(text.size()), text.data(), names.c_str());
}
}  // namespace detail

constexpr const char* method_name(method m) noexcept { return detail::name_of(method_names, m); }
/// The methods whose head types (retrieval / streaming heads) decide everything: the duo allocator.
constexpr bool uses_head_types(method m) noexcept {
  return m == method::duo_heuristic || m == method::duo || m == method::prulong;
}
constexpr const char* allocator_name(budget_scheme a) noexcept { return detail::name_of(allocator_names, a); }
constexpr const char* driver_name(driver_kind d) noexcept { return detail::name_of(driver_names, d); }

inline status parse_method(std::string_view s, method& out) {
  return detail::parse_name(s, method_names, "recipe", out);
}
inline status parse_allocator(std::string_view s, budget_scheme& out) {
  return detail::parse_name(s, allocator_names, "allocator", out);
}
inline status parse_driver(std::string_view s, driver_kind& out) {
  return detail::parse_name(s, driver_names, "driver", out);
}

// ---------------------------------------------------------------------------------------------
// Options

/// Everything that configures one eviction run. Budgets count protected tokens (docs/budget.md).
struct evict_options {
  method recipe = method::snapkv;
  /// Tokens kept per KV head on average (the papers' "B per head": B x H x L in the model),
  /// protected tokens included. A budget of at least the prompt keeps everything.
  index_t budget = 64;
  std::optional<budget_scheme> alloc;  ///< empty: the method's (default_allocator)
  driver_kind driver = driver_kind::postfill;
  /// Observation window w of the window recipes (SnapKV family, LAQ++'s suffix window), and the
  /// recent tokens every window recipe, H2O and LAQ protect.
  index_t window = 8;
  index_t sinks = -1;        ///< protected first tokens; -1: the method's (4 for streaming_llm and duo, else 0)
  index_t chunk = 64;        ///< chunked drivers: tokens per chunk
  /// Chunked drivers: evict this fraction p of each head's evictable rows after every chunk (the
  /// footprint paper's "evict p% at each pre-filling step"); -1: down to the budget instead.
  double chunk_fraction = -1.0;
  index_t evict_every = 1;   ///< decode driver: evict every N decoded tokens
  /// LAQ: pseudo-decoded tokens; SpecKV: draft tokens. 16 = the shipped LookaheadKV module's
  /// lookahead tokens: the LookaheadKV paper (appendix F) gives LAQ, SpecKV and LookaheadKV the same
  /// count (32 there), so the three are compared at equal counts (LAQ's own paper uses 8).
  index_t laq_steps = 16;
  index_t draft_tokens = 16;
  index_t draft_layers = 2;  ///< SpecKV: the draft model is the first N layers + the output head (methods/speckv.hpp)
  index_t duo_recent = 12;   ///< duo: recent tokens of a streaming head (it keeps sinks + these)
};

/// The allocator a method uses unless told otherwise.
constexpr budget_scheme default_allocator(method m) noexcept {
  switch (m) {
    case method::pyramidkv: return budget_scheme::pyramid;
    case method::adakv: return budget_scheme::adakv;
    case method::cake: return budget_scheme::cake;
    case method::lava: return budget_scheme::lava;
    case method::duo_heuristic:
    case method::duo:
    case method::prulong: return budget_scheme::duo;
    default: return budget_scheme::uniform;
  }
}
inline budget_scheme allocator_of(const evict_options& o) { return o.alloc ? *o.alloc : default_allocator(o.recipe); }
inline index_t sinks_of(const evict_options& o) {
  if (o.sinks >= 0) return o.sinks;
  return o.recipe == method::streaming_llm || uses_head_types(o.recipe) ? 4 : 0;
}

/// The kvevict recipe a method scores with (its protection is the method's).
inline kvevict::recipe make_recipe(const evict_options& o) {
  using kvevict::recipe;
  const index_t s = sinks_of(o), w = o.window;
  recipe r;
  switch (o.recipe) {
    case method::full:
    case method::snapkv:
    case method::pyramidkv:
    case method::adakv: r = recipe::snapkv(); break;
    case method::streaming_llm: r = recipe::streaming_llm(s); break;
    case method::h2o: r = recipe::h2o(); break;
    case method::tova: r = recipe::tova(); break;
    case method::knorm: r = recipe::knorm(); break;
    case method::vatp: r = recipe::vatp(); break;
    case method::cake: r = recipe::cake(); break;
    case method::lava: r = recipe::lava(); break;
    case method::duo_heuristic:
    case method::duo:
    case method::prulong:
      r = recipe::streaming_llm(s);
      r.n_recent = o.duo_recent;
      return r;
    case method::laq:  // SnapKV scoring with the pseudo queries as an external block; the window kept
    case method::laq_pp:  // the union block scores the prompt minus its window (evictor's laq_pp_scores)
    case method::speckv:  // the same with the draft response's queries (as LAQ: a fair pairing)
      r = recipe::snapkv();
      r.source = kvevict::query_source::external_block;
      break;
    case method::lookaheadkv:  // the scores come from lookahead_scorer; only the sinks (0 by default) are protected
      r = recipe::snapkv();
      r.n_sink = s;
      r.n_recent = 0;
      return r;
    case method::oracle:  // LookaheadKV Eq. 1: the response's attention, nothing pooled or protected
      r = recipe::snapkv();
      r.source = kvevict::query_source::external_block;
      r.pool = kvevict::pool_kind::none;
      r.kernel = 1;
      r.n_sink = 0;
      r.n_recent = 0;
      return r;
  }
  r.n_sink = s;
  if (r.kind == kvevict::recipe_kind::streaming_llm || r.kind == kvevict::recipe_kind::tova ||
      r.kind == kvevict::recipe_kind::knorm)
    return r;  // no window: these protect the sinks only (their published defaults)
  r.window = w;
  r.n_recent = w;
  return r;
}

/// Tokens every head keeps whatever the scores (what the budget must at least be).
inline index_t protected_tokens(const evict_options& o) {
  if (o.recipe == method::full) return 0;
  const kvevict::recipe r = make_recipe(o);
  return r.n_sink + r.n_recent;
}

/// The counts' ranges, the command-line parser's (c null: only the lower bounds, before the model
/// is read) and check_evict_options' (the upper bounds from the model c too).
inline status check_evict_counts(const evict_options& o, const config* c) {
  const index_t ctx = c != nullptr ? c->seq_len : -1, layers = c != nullptr ? c->n_layers : -1;
  struct count {
    const char* name;
    index_t value, lo, hi;  // hi < 0: no upper bound
    const char* what;
  };
  const count counts[] = {{"--budget", o.budget, 1, ctx, " (the model's context)"},
                          {"--window", o.window, 1, ctx, ""},
                          {"--sinks", o.sinks, -1, ctx, ""},
                          {"--chunk", o.chunk, 1, -1, ""},
                          {"--evict-every", o.evict_every, 1, -1, ""},
                          {"--laq-steps", o.laq_steps, 1, ctx, ""},
                          {"--draft-tokens", o.draft_tokens, 1, ctx, ""},
                          {"--draft-layers", o.draft_layers, 1, layers, " (the model's layers)"},
                          {"--duo-recent", o.duo_recent, 0, -1, ""}};
  if (o.sinks < -1)  // -1 is "the recipe's", not a count: say so
    return status::error(errc::invalid_argument, "--sinks must be >= 0 (or -1: the recipe's), got %lld",
                         static_cast<long long>(o.sinks));
  for (const count& n : counts) {
    if (n.hi >= 0 && (n.value < n.lo || n.value > n.hi))
      return status::error(errc::invalid_argument, "%s %lld is outside [%lld, %lld]%s", n.name,
                           static_cast<long long>(n.value), static_cast<long long>(n.lo), static_cast<long long>(n.hi),
                           n.what);
    if (n.value < n.lo)
      return status::error(errc::invalid_argument, "%s must be >= %lld, got %lld", n.name, static_cast<long long>(n.lo),
                           static_cast<long long>(n.value));
  }
  if (!(o.chunk_fraction == -1.0 || (o.chunk_fraction >= 0.0 && o.chunk_fraction <= 1.0)))
    return status::error(errc::invalid_argument, "--chunk-fraction must be in [0, 1] or -1, got %f", o.chunk_fraction);
  return {};
}

/// Checks the options against the model, before any prompt is seen (prompt-dependent checks
/// happen in evictor::prefill). The messages name the command-line options.
inline status check_evict_options(const config& c, const evict_options& o) {
  const budget_scheme a = allocator_of(o);
  const driver_kind d = o.driver;
  const char* rn = method_name(o.recipe);
  auto err = [](const char* fmt, auto... args) { return status::error(errc::invalid_argument, fmt, args...); };
  if (o.recipe == method::full) return {};
  KVEVICT_TRY(check_evict_counts(o, &c));
  const index_t prot = protected_tokens(o);
  if (o.budget < prot)
    return err("--budget %lld is below the %lld tokens %s protects (sinks %lld + recent %lld)",
               static_cast<long long>(o.budget), static_cast<long long>(prot), rn,
               static_cast<long long>(sinks_of(o)), static_cast<long long>(prot - sinks_of(o)));
  if ((a == budget_scheme::duo) != uses_head_types(o.recipe))
    return err("--allocator duo goes with --recipe duo, prulong or duo-heuristic (their head types decide every budget)");
  const bool query_block = o.recipe == method::laq || o.recipe == method::laq_pp || o.recipe == method::oracle ||
                           o.recipe == method::lookaheadkv || o.recipe == method::speckv;
  if (query_block && d != driver_kind::postfill)
    return err("--recipe %s needs the whole prompt prefilled first: use --driver postfill", rn);
  if (o.recipe == method::lookaheadkv && (a == budget_scheme::cake || a == budget_scheme::duo))
    return err("--recipe lookaheadkv does not take --allocator %s (uniform, pyramid, adakv or lava: the allocators "
               "that budget from per-head scores)",
               allocator_name(a));
  if (o.recipe == method::laq_pp && a == budget_scheme::duo) return err("--recipe laq++ does not take --allocator duo");
  if (o.recipe == method::knorm && a == budget_scheme::lava)  // lava_layer_entropy needs scores >= 0
    return err("--recipe knorm does not take --allocator lava (LAVa's entropy needs attention-like scores >= 0; "
               "knorm's are negated key norms)");
  switch (d) {
    case driver_kind::postfill: break;
    case driver_kind::layerwise:
      break;
    case driver_kind::chunked_naive:
    case driver_kind::chunked_patched:
      if (o.recipe == method::h2o || o.recipe == method::tova)
        return err("--driver %s scores chunks with an observation window: %s is not supported (use postfill or decode)",
                   driver_name(d), rn);
      if (a == budget_scheme::cake)
        return err("--driver %s does not take --allocator %s (uniform, pyramid, adakv or lava)", driver_name(d),
                   allocator_name(a));
      if (o.chunk_fraction >= 0.0 && a == budget_scheme::adakv)
        return err("--chunk-fraction does not take --allocator adakv (its heads share a layer budget; use the budget)");
      break;
    case driver_kind::decode:
      if (a == budget_scheme::lava || a == budget_scheme::cake)
        return err("--driver decode does not take --allocator %s (uniform, pyramid, adakv or duo)", allocator_name(a));
      break;
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// Captured blocks

/// The post-RoPE queries and keys of one block of `rows` rows at every layer, copied by a forward
/// hook: queries [L][H_q][rows][d], keys [L][H_kv][rows][d]. The views it hands out are what the
/// drivers and the recipes read.
class block_capture {
 public:
  void reset(const config& c, index_t rows) {
    layers_ = c.n_layers;
    hq_ = c.n_heads;
    hkv_ = c.n_kv_heads;
    d_ = c.head_size();
    rows_ = rows;
    q_.assign(static_cast<std::size_t>(layers_ * hq_ * rows * d_), 0.0f);
    k_.assign(static_cast<std::size_t>(layers_ * hkv_ * rows * d_), 0.0f);
  }
  index_t rows() const { return rows_; }

  /// Copies the event's block rows [first, first + n) into rows [at, at + n).
  status store(const layer_event& ev, index_t at, index_t first = 0, index_t n = -1) {
    if (n < 0) n = ev.rows - first;
    if (at < 0 || first < 0 || at + n > rows_ || first + n > ev.rows || ev.layer >= layers_)
      return status::error(errc::out_of_range, "block_capture: rows [%lld, %lld) of a %lld-row capture",
                           static_cast<long long>(at), static_cast<long long>(at + n), static_cast<long long>(rows_));
    put(ev.layer, at, *kvevict::token_range(ev.queries, first, n), *kvevict::token_range(ev.keys, first, n));
    return {};
  }
  /// Copies the rows of q [H_q][n][d] and k [H_kv][n][d] (or empty) into rows [at, at + n) of
  /// layer l (in range: the caller's to check).
  void put(int l, index_t at, kvevict::kv_view<const float> q, kvevict::kv_view<const float> k = {}) {
    for (index_t h = 0; h < q.extent(0); ++h)
      for (index_t i = 0; i < q.extent(1); ++i)
        for (index_t x = 0; x < d_; ++x) query_row(l, h, at + i)[x] = q(h, i, x);
    for (index_t h = 0; h < k.extent(0); ++h)
      for (index_t i = 0; i < k.extent(1); ++i)
        for (index_t x = 0; x < d_; ++x) key_row(l, h, at + i)[x] = k(h, i, x);
  }
  /// A hook storing every block row at rows [at, ...).
  forward_hooks hooks(index_t at = 0) {
    forward_hooks h;
    h.after_layer = [this, at](const layer_event& ev) { return store(ev, at); };
    return h;
  }

  float* query_row(int l, index_t h, index_t t) { return q_.data() + ((l * hq_ + h) * rows_ + t) * d_; }
  float* key_row(int l, index_t h, index_t t) { return k_.data() + ((l * hkv_ + h) * rows_ + t) * d_; }
  /// Rows [first, first + n) of layer l: [H_q][n][d] and [H_kv][n][d].
  kvevict::kv_view<const float> queries(int l, index_t first, index_t n) const {
    return *kvevict::make_kv_view<const float>(q_.data() + (l * hq_ * rows_ + first) * d_, hq_, n, d_, rows_ * d_, d_);
  }
  kvevict::kv_view<const float> keys(int l, index_t first, index_t n) const {
    return *kvevict::make_kv_view<const float>(k_.data() + (l * hkv_ * rows_ + first) * d_, hkv_, n, d_, rows_ * d_, d_);
  }

 private:
  index_t layers_ = 0, hq_ = 0, hkv_ = 0, d_ = 0, rows_ = 0;
  std::vector<float> q_, k_;
};

/// Layer l (a layer of the cache) of the runner's cache as the drivers read it: its paged view
/// (kv_cache::paged), every page read through the block table, nothing copied.
inline kvevict::paged_layer_kv<float> layer_view(kv_cache& c, int l) { return *c.paged(l); }

/// Scores a method computes outside the recipes for a prefilled, not yet evicted prompt (method
/// lookaheadkv: examples/lookaheadkv/scores.hpp's lookahead_scorer, a trained module's estimate).
/// score() may run extra blocks on the cache but leaves it as it was; scores(l) is then layer l's
/// [H_kv][P], higher = keep.
class prompt_scorer {
 public:
  virtual ~prompt_scorer() = default;
  virtual status score(runner& run, kv_cache& cache) = 0;
  virtual kvevict::matrix_view<const float> scores(int l) const = 0;
};

/// A query block a method computes for a prefilled, not yet evicted prompt (methods laq and laq++:
/// methods/laq.hpp's laq_queries, the pseudo-decoded queries). compute() gets the prompt's
/// captured queries (every row) and the prefill's last-row logits; it may run extra tokens on a
/// copy of `cache` but leaves `cache` as it was; block() is then its queries and their own keys,
/// which the evictor scores over the prompt as an external block.
class query_source {
 public:
  virtual ~query_source() = default;
  virtual status compute(runner& run, const kv_cache& cache, const block_capture& prompt_q, const float* prefill_logits,
                         const evict_options& o) = 0;
  virtual const block_capture& block() const = 0;
};

// ---------------------------------------------------------------------------------------------
// Budgets

/// One allocation for a prompt of P tokens: the driver's kvevict::allocation and the storage of
/// its [L][H] budget matrix.
struct allocation_plan {
  kvevict::allocation alloc;
  std::vector<std::int32_t> budgets;  ///< [L][H] (per_head, adakv); empty for lava / cake
  index_t retrieval_heads = -1;       ///< duo: heads that keep the whole prompt
  std::vector<std::uint8_t> retrieval;  ///< duo: [L][H], 1 = retrieval head, 0 = streaming head
  index_t total = 0;                  ///< tokens the model keeps after the eviction (all heads, layers)
};

/// Duo head types: a ranking per (layer, KV head) -- the calibration's "globalness"
/// (methods/duo_calibration.hpp) or a trained head-mask file's values (DuoAttention's alpha, PruLong's
/// mask) -- whose top heads become retrieval heads: `retrieval` of them when >= 0 (a trained
/// mask's own count, or the count of a chosen sparsity), else as many as the budget affords.
struct duo_heads {
  std::vector<double> global;  ///< [L][H_kv]
  index_t retrieval = -1;
};

/// The allocation of scheme `a` for per-head budget B (clamped to P: a budget of at least the
/// prompt keeps everything) over a P-token prompt with protection `prot`: kvevict::make_allocation
/// (docs/budget.md), duo with the `duo_retrieval_heads(B H L)` most global heads of the calibration
/// as retrieval heads (prulong_topk_mask).
inline status plan_allocation(const config& c, budget_scheme a, index_t budget, index_t P, kvevict::protection prot,
                              const duo_heads* duo, allocation_plan& out) {
  const index_t L = c.n_layers, H = c.n_kv_heads, B = std::min(budget, P);
  out = allocation_plan{};
  out.budgets.assign(static_cast<std::size_t>(L * H), 0);
  kvevict::allocation_request req;
  req.budget = budget;
  req.prompt = P;
  req.prot = prot;
  std::vector<std::uint8_t> mask;
  if (a == budget_scheme::duo) {
    if (duo == nullptr || static_cast<index_t>(duo->global.size()) != L * H)
      return status::error(errc::invalid_argument, "duo: the head types need a calibration (duo_calibration.hpp)");
    kvevict::duo_options dopt;
    dopt.streaming = prot;
    const auto by_budget = kvevict::duo_retrieval_heads(B * H * L, L, H, P, dopt);
    if (!by_budget) return by_budget.error();
    const index_t k = duo->retrieval >= 0 ? std::min(duo->retrieval, L * H) : *by_budget;  // a mask's count wins
    mask.assign(static_cast<std::size_t>(L * H), 0);
    const auto mview = *kvevict::make_matrix_view(mask.data(), L, H);
    KVEVICT_TRY(kvevict::prulong_topk_mask(*kvevict::make_matrix_view(duo->global.data(), L, H), k, mview));
    req.retrieval = mview;
    out.retrieval_heads = k;
  }
  KVEVICT_TRY(kvevict::make_allocation(a, req, *kvevict::make_matrix_view(out.budgets.data(), L, H), &out.alloc, &out.total));
  out.retrieval = std::move(mask);
  if (a == budget_scheme::lava || a == budget_scheme::cake) out.budgets.clear();  // a total, no matrix
  return {};
}

// ---------------------------------------------------------------------------------------------
// Driver plumbing

inline kvevict::model_shape shape_of(const config& c) {
  return {c.n_layers, c.n_kv_heads, c.n_heads, c.head_size()};
}

/// The chunked driver's configuration for a P-token prompt under `o` (--driver chunked-naive /
/// chunked-patched, --chunk-fraction), without its allocation (the caller's).
inline kvevict::chunked_config chunked_config_of(const evict_options& o, const kvevict::recipe& rec,
                                                 kvevict::model_shape shape, index_t P) {
  kvevict::chunked_config cc;
  cc.model = shape;
  cc.tokens = P;
  cc.capacity = P;
  cc.rec = rec;
  cc.queries = o.driver == driver_kind::chunked_patched ? kvevict::chunk_queries::patched : kvevict::chunk_queries::naive;
  cc.target = o.chunk_fraction >= 0.0 ? kvevict::chunk_target::fraction : kvevict::chunk_target::budget;
  if (o.chunk_fraction >= 0.0) cc.fraction = o.chunk_fraction;
  return cc;
}

/// Layer l's queries for the chunked driver (and the patch block's keys): the patch block's when the
/// chunk has one, else the chunk's last `rows` queries (none when rows is 0).
inline void chunk_queries_of(const block_capture& patch_q, const block_capture& chunk_q, kvevict::patch_block patch,
                             index_t rows, int l, kvevict::kv_view<const float>& q, kvevict::kv_view<const float>& pk) {
  if (patch.count > 0) {
    q = patch_q.queries(l, 0, patch.count);
    pk = patch_q.keys(l, 0, patch.count);
  } else if (rows > 0) {
    q = chunk_q.queries(l, 0, rows);
  }
}

/// Layer l's queries for a decode_driver step under `rec`: the new token's (h2o, tova), the last
/// `window` tokens' (window recipes), none (knorm, streaming_llm).
inline kvevict::kv_view<const float> decode_queries_of(const kvevict::recipe& rec, const block_capture& step_q,
                                                       const block_capture& recent_q, int l, index_t window) {
  switch (rec.kind) {
    case kvevict::recipe_kind::h2o:
    case kvevict::recipe_kind::tova: return step_q.queries(l, 0, 1);
    case kvevict::recipe_kind::knorm:
    case kvevict::recipe_kind::streaming_llm: return {};
    default: return recent_q.queries(l, 0, window);
  }
}

/// A driver's state memory and workspace, kept between calls (they only grow: grown()).
struct driver_scratch {
  std::vector<unsigned char> state, ws;
};

/// init()s driver `d` with `cfg` (recording into `rec`, may be null) on state memory from `s`, and
/// hands out its workspace, sized by the driver's own query.
template <class Driver, class Config>
status init_driver(Driver& d, driver_scratch& s, const Config& cfg, kvevict::eviction_recorder* rec,
                   kvevict::workspace& ws) {
  const auto bytes = Driver::state_bytes(cfg);
  if (!bytes) return bytes.error();
  KVEVICT_TRY(d.init(cfg, grown(s.state, *bytes), *bytes, rec));
  const auto wb = d.workspace_bytes(kvevict::seq);
  if (!wb) return wb.error();
  ws = {grown(s.ws, *wb), s.ws.size()};
  return {};
}

/// What post_fill_decide hands the driver for layer l.
struct layer_inputs {
  kvevict::paged_layer_kv<float> paged;        ///< the layer's rows: the runner's paged cache (or a view of some of its rows)
  kvevict::layer_kv<float> kv;                 ///< or a ragged cache (examples/sharded/), when paged is empty
  kvevict::kv_view<const float> queries;       ///< the recipe's query block
  kvevict::kv_view<const float> block_keys;    ///< an external block's own keys, or empty
  double weight = 0.0;                         ///< cake: the layer's preference
  /// Scores computed elsewhere ([H_kv][>= rows], e.g. a prompt_scorer's): given, the driver takes
  /// them (add_layer_scores) and the queries are not read.
  kvevict::matrix_view<const float> scores{};
};

/// Post-fill eviction with kvevict::post_fill_driver: init, add_layer for every layer with
/// inputs(l, in), decide. The kept rows are then d.kept(l) (see compact_kept). Nothing is compacted
/// here. The driver records the dropped rows at step cfg.tokens into `rec` (may be null).
template <class Inputs>
status post_fill_decide(kvevict::post_fill_driver& d, driver_scratch& s, const kvevict::post_fill_config& cfg,
                        Inputs&& inputs, kvevict::eviction_recorder* rec) {
  kvevict::workspace ws;
  KVEVICT_TRY(init_driver(d, s, cfg, rec, ws));
  for (int l = 0; l < static_cast<int>(cfg.model.layers); ++l) {
    layer_inputs in;
    KVEVICT_TRY(inputs(l, in));
    const auto add = [&](const auto& kv) {
      if (in.scores.data_handle() != nullptr) return d.add_layer_scores(kvevict::seq, ws, l, kv, in.scores, in.weight);
      return d.add_layer(kvevict::seq, ws, l, kv, in.queries, in.block_keys, in.weight);
    };
    KVEVICT_TRY(in.paged.layer.keys.data != nullptr ? add(in.paged) : add(in.kv));
  }
  return d.decide(kvevict::seq, ws);
}

/// Compacts every layer of `cache` with the driver's kept rows.
template <class Driver>
status compact_kept(kv_cache& cache, const Driver& d) {
  for (int l = 0; l < cache.layers(); ++l) KVEVICT_TRY(cache.compact(l, d.kept(l)));
  return {};
}

// ---------------------------------------------------------------------------------------------
// Timing

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace kvrun
