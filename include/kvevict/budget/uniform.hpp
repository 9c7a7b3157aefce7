// kvevict/budget/uniform.hpp: the same budget for every head of every layer (SnapKV, H2O, TOVA,
// StreamingLLM, ... LAVa Table 4: B_{l,h} = B / (H L)). docs/budget.md.
#pragma once

#include <kvevict/budget/apportion.hpp>

namespace kvevict {

/// Splits `total` kept tokens (the whole model's, protected ones included) over the L x H heads of
/// `out` ([L][H] int32): every head gets floor(total / (L H)) and the total mod (L H) heads first in
/// (layer, head) order get one more (the largest-remainder rule with all remainders equal: ties to
/// the lower index). "Budget B per head" is total = B L H. The heads' prompts are prompt_length
/// tokens long, of which protected_count(prompt_length, prot) are protected.
/// Errors (nothing written): invalid `out` view; zero layers or heads; prompt_length outside
/// [1, INT32_MAX]; negative n_sink/n_recent; total negative; a head budget below its protected
/// tokens; a head budget above the prompt; L x H overflowing.
inline status uniform_budgets(index_t total, index_t prompt_length, const protection& prot,
                              matrix_view<std::int32_t> out) {
  constexpr const char* fn = "uniform_budgets";
  index_t L = 0, H = 0;
  KVEVICT_TRY(detail::check_allocator_args(fn, out, prompt_length, prot, &L, &H));
  if (total < 0)
    return status::error(errc::invalid_argument, "%s: total budget %lld is negative", fn, static_cast<long long>(total));
  index_t heads = 0;
  if (!detail::checked_mul(L, H, heads))
    return status::error(errc::size_overflow, "%s: %lld layers x %lld heads overflow", fn, static_cast<long long>(L),
                         static_cast<long long>(H));
  const index_t base = total / heads, extra = total % heads;
  KVEVICT_TRY(detail::check_head_budget(fn, base, prompt_length, prot));
  if (extra > 0) KVEVICT_TRY(detail::check_head_budget(fn, base + 1, prompt_length, prot));
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h) out(l, h) = static_cast<std::int32_t>(base + (l * H + h < extra ? 1 : 0));
  return {};
}

}  // namespace kvevict
