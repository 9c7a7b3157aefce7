// kvevict/budget/allocation.hpp: the allocation rule a driver applies (docs/budget.md).
//
//   allocator, allocator_name   how the tokens a model keeps are shared by its layers and heads
//   allocation                  an allocator with its budgets [L][H] or its model total
//
// The budget allocators (uniform, pyramid, adakv, lava, cake, duo) compute the numbers; an
// allocation packages them for the drivers, which only consume it.
#pragma once

#include <kvevict/budget/adakv.hpp>
#include <kvevict/budget/lava.hpp>
#include <kvevict/config.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

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

constexpr const char* allocator_name(allocator a) noexcept {
  switch (a) {
    case allocator::per_head: return "per_head";
    case allocator::flattened: return "flattened";
    case allocator::adakv: return "adakv";
    case allocator::lava: return "lava";
    case allocator::cake: return "cake";
  }
  return "unknown";
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
}  // namespace kvevict
