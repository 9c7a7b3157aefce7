// methods/catalogue.hpp: the eviction methods the reference runner knows (`--recipe`), their
// budget allocators (`--allocator`) and drivers (`--driver`) by name, the options of one eviction
// run, each method's kvevict recipe and defaults, and the option checks (docs/runner.md,
// "Eviction"). The CLI, the report and the evictor (runner/evict.hpp, evictor.hpp) read the
// catalogue; how each driver is fed lives in the runner.
#pragma once

#include <runner/model.hpp>

#include <kvevict/budget.hpp>
#include <kvevict/recipes.hpp>

#include <optional>
#include <string>
#include <string_view>

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

}  // namespace kvrun
