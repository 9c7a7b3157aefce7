// kvevict/budget/allocation.hpp: the allocation rule a driver applies (docs/budget.md).
//
//   allocator, allocator_name   how the tokens a model keeps are shared by its layers and heads
//   allocation                  an allocator with its budgets [L][H] or its model total
//   budget_scheme, budget_scheme_name, budget_scheme_from_name
//                               the named ways a per-head budget B becomes an allocation
//                               (uniform, pyramid, adakv, lava, cake, duo)
//   make_allocation(scheme, request, budgets, &out), allocation_from_name(name, ...)
//
// The budget allocators (uniform, pyramid, adakv, lava, cake, duo) compute the numbers; an
// allocation packages them for the drivers, which only consume it.
#pragma once

#include <kvevict/budget/adakv.hpp>
#include <kvevict/budget/duo.hpp>
#include <kvevict/budget/lava.hpp>
#include <kvevict/budget/pyramid.hpp>
#include <kvevict/budget/uniform.hpp>
#include <kvevict/config.hpp>
#include <kvevict/detail/base/enum_names.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>
#include <string_view>

namespace kvevict {

/// How the tokens a model keeps are shared by its layers and heads (docs/budget.md).
enum class allocator : int {
  /// Head (l, h) keeps budgets(l, h): uniform_budgets, pyramid_budgets, duo_budgets, cake_budgets
  /// computed beforehand, any [L][H] matrix.
  per_head = 0,
  /// Layer l keeps sum_h budgets(l, h) tokens; its heads compete through the flattened selection
  /// (LAVa Algorithm 1; with uniform budgets this is LAVa's "uniform layer budgets" ablation).
  flattened = 1,
  /// Layer l keeps B_l x H tokens, B_l = sum_h budgets(l, h) / H, shared with AdaKV's safeguard
  /// floor (adakv_budgets; Ada-SnapKV with uniform budgets, Ada-PyramidKV with pyramid ones).
  adakv = 2,
  /// All layers: `total` tokens shared by the layers in proportion to the normalised entropy of
  /// their scores (LAVa Eq. 7-8, lava_layer_budgets' rule), flattened within each layer.
  lava = 3,
  /// All layers (post-fill only): per-head budgets total / (L H) reshaped across layers by the
  /// layers' CAKE preferences, which the engine passes to add_layer (cake_budgets).
  cake = 4,
};

/// Short name of an allocator ("per_head", ..., "cake"; "unknown" for values outside the enum).
constexpr const char* allocator_name(allocator a) noexcept {
  constexpr const char* names[] = {"per_head", "flattened", "adakv", "lava", "cake"};
  return detail::enum_name(a, names);
}

/// The allocation rule of a driver. The budget matrix is copied at init (the caller may free it).
struct allocation {
  allocator kind = allocator::per_head;
  /// [L][H] int32 per-head budgets (per_head, flattened, adakv), protected tokens included.
  matrix_view<const std::int32_t> budgets{};
  /// lava, cake: the tokens the whole model keeps, protected ones included ("B per head" = B H L).
  index_t total = 0;
  /// adakv: safeguard fraction and floor rule (adakv_options; the protection is the recipe's).
  double adakv_alpha = 0.2;
  adakv_floor floor_rule = adakv_floor::budget;
  /// lava: entropy normalisation (lava_entropy_options; the protection is the recipe's).
  entropy_norm lava_norm = entropy_norm::log_count;
};
/// The most rows one head can hold after an eviction under `a` (docs/drivers.md, "Capacity"): its
/// own budget with per_head budgets (the largest over the model: PyramidKV's shallow layers get
/// more than B), its whole layer's total with flattened or adakv selection (one head may take its
/// layer's entire share); 0 for lava and cake (no budget matrix). A decode driver's capacity is
/// this plus the rows added between evictions.
inline index_t max_head_rows(const allocation& a) noexcept {
  const auto& b = a.budgets;
  index_t most = 0;
  for (index_t l = 0; l < b.extent(0); ++l) {
    index_t layer = 0;
    for (index_t h = 0; h < b.extent(1); ++h)
      layer = a.kind == allocator::per_head ? (b(l, h) > layer ? index_t(b(l, h)) : layer) : layer + b(l, h);
    most = layer > most ? layer : most;
  }
  return most;
}

namespace detail {

inline status check_allocation_options(const char* fn, const allocation& a) {
  const int k = static_cast<int>(a.kind);
  if (k < 0 || k > static_cast<int>(allocator::cake))
    return status::error(errc::invalid_argument, "%s: unknown allocator value %d", fn, k);
  if (a.kind == allocator::adakv) {
    if (!(a.adakv_alpha >= 0.0 && a.adakv_alpha <= 1.0))
      return status::error(errc::invalid_argument, "%s: adakv alpha = %g is outside [0, 1]", fn, a.adakv_alpha);
    if (a.floor_rule != adakv_floor::budget && a.floor_rule != adakv_floor::evictable)
      return status::error(errc::invalid_argument, "%s: unknown adakv_floor value %d", fn,
                           static_cast<int>(a.floor_rule));
  }
  if (a.kind == allocator::lava && a.lava_norm != entropy_norm::log_count && a.lava_norm != entropy_norm::count)
    return status::error(errc::invalid_argument, "%s: unknown entropy_norm value %d", fn, static_cast<int>(a.lava_norm));
  return {};
}

}  // namespace detail

/// The named budget schemes (what the reference runner's --allocator and the quality report call
/// them): how "budget B per head" over a P-token prompt becomes an allocation (docs/budget.md).
enum class budget_scheme : int {
  uniform = 0,  ///< per_head, uniform_budgets(B H L): every head B
  pyramid = 1,  ///< per_head, pyramid_budgets(B, P): PyramidKV (exact rounding, beta 20)
  adakv = 2,    ///< adakv with every layer at B H (Ada-SnapKV; alpha 0.2, the budget floor)
  lava = 3,     ///< lava, total B H L (entropy layer budgets, flattened within a layer)
  cake = 4,     ///< cake, total B H L (the driver takes each layer's preference)
  duo = 5,      ///< per_head, duo_budgets(retrieval mask): whole prompt or sinks + recent per head
};

constexpr const char* budget_scheme_name(budget_scheme s) noexcept {
  constexpr const char* names[] = {"uniform", "pyramid", "adakv", "lava", "cake", "duo"};
  return detail::enum_name(s, names);
}

inline constexpr budget_scheme all_budget_schemes[] = {budget_scheme::uniform, budget_scheme::pyramid,
                                                       budget_scheme::adakv,   budget_scheme::lava,
                                                       budget_scheme::cake,    budget_scheme::duo};

/// The scheme of a name (budget_scheme_name's). Errors: an unknown name (invalid_argument, the
/// known names listed).
inline result<budget_scheme> budget_scheme_from_name(std::string_view name) {
  for (const budget_scheme s : all_budget_schemes)
    if (name == budget_scheme_name(s)) return s;
  return status::error(errc::invalid_argument,
                       "budget_scheme_from_name: unknown budget scheme '%.*s' (uniform, pyramid, adakv, lava, cake, "
                       "duo)",
                       static_cast<int>(name.size()), name.data());
}

/// What a scheme needs to become an allocation.
struct allocation_request {
  index_t budget = 0;  ///< B, tokens per head protected ones included (clamped to the prompt)
  index_t prompt = 0;  ///< P, the prompt's tokens
  protection prot;     ///< every head's protected tokens (the recipe's {n_sink, n_recent})
  /// duo only: [L][H] head types, 1 = retrieval head (keeps the whole prompt), 0 = streaming. To
  /// aim at B H L tokens: duo_retrieval_heads(B H L, L, H, P, {prot}) heads, chosen from a
  /// calibration (e.g. train/prulong.hpp's prulong_topk_mask of the heads' scores).
  matrix_view<const std::uint8_t> retrieval{};
};

/// The allocation of scheme `s` for `req`, its per-head budgets written to `budgets` ([L][H], the
/// caller's memory, which the allocation views; lava and cake leave it untouched and use a total).
/// *kept (optional) receives the tokens the model keeps: B H L (B clamped to P), duo: what the
/// mask implies. The result is what the drivers' init() take as cfg.alloc.
/// Errors (out unchanged): an unknown scheme; budget negative or prompt < 1; the allocators'
/// errors (a budget below the protected tokens, an invalid view, ...); duo without a mask of
/// budgets' shape.
inline status make_allocation(budget_scheme s, const allocation_request& req, matrix_view<std::int32_t> budgets,
                              allocation* out, index_t* kept = nullptr) {
  constexpr const char* fn = "make_allocation";
  if (out == nullptr) return status::error(errc::null_pointer, "%s: out is null", fn);
  if (req.budget < 0 || req.prompt < 1)
    return status::error(errc::invalid_argument, "%s: budget %lld per head over a %lld-token prompt", fn,
                         static_cast<long long>(req.budget), static_cast<long long>(req.prompt));
  KVEVICT_TRY(detail::check_view(fn, "budgets", budgets));
  const index_t L = budgets.extent(0), H = budgets.extent(1);
  const index_t B = req.budget < req.prompt ? req.budget : req.prompt;
  index_t total = 0;
  if (!detail::checked_mul(B, L * H, total))
    return status::error(errc::size_overflow, "%s: %lld tokens x %lld heads overflow", fn, static_cast<long long>(B),
                         static_cast<long long>(L * H));
  allocation a;
  switch (s) {
    case budget_scheme::uniform:
    case budget_scheme::adakv:
      KVEVICT_TRY(uniform_budgets(total, req.prompt, req.prot, budgets));
      a.kind = s == budget_scheme::adakv ? allocator::adakv : allocator::per_head;
      a.budgets = budgets;
      break;
    case budget_scheme::pyramid: {
      pyramid_options po;
      po.prot = req.prot;
      KVEVICT_TRY(pyramid_budgets(B, req.prompt, po, budgets));
      a.budgets = budgets;
      break;
    }
    case budget_scheme::lava:
    case budget_scheme::cake:
      a.kind = s == budget_scheme::lava ? allocator::lava : allocator::cake;
      a.total = total;
      break;
    case budget_scheme::duo: {
      if (req.retrieval.extent(0) != L || req.retrieval.extent(1) != H)
        return status::error(errc::shape_mismatch,
                             "%s: duo needs the [%lld][%lld] retrieval-head mask (got [%lld][%lld])", fn,
                             static_cast<long long>(L), static_cast<long long>(H),
                             static_cast<long long>(req.retrieval.extent(0)),
                             static_cast<long long>(req.retrieval.extent(1)));
      duo_options dopt;
      dopt.streaming = req.prot;
      KVEVICT_TRY(duo_budgets(req.retrieval, req.prompt, dopt, budgets, &total));
      a.budgets = budgets;
      break;
    }
    default:
      return status::error(errc::invalid_argument, "%s: unknown budget_scheme value %d", fn, static_cast<int>(s));
  }
  *out = a;
  if (kept != nullptr) *kept = total;
  return {};
}

/// make_allocation of the scheme a name gives (budget_scheme_from_name).
inline status allocation_from_name(std::string_view name, const allocation_request& req,
                                   matrix_view<std::int32_t> budgets, allocation* out, index_t* kept = nullptr) {
  const auto s = budget_scheme_from_name(name);
  if (!s) return s.error();
  return make_allocation(*s, req, budgets, out, kept);
}

}  // namespace kvevict
