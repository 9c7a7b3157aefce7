// kvevict/budget/pyramid.hpp: PyramidKV's layer budgets (Cai et al. 2024; LAVa appendix B Eq. 22;
// KVCache-Factory's PyramidKVCluster). docs/budget.md.
//
// With B the per-head budget (KVCache-Factory's max_capacity_prompt, window included), W the
// protected tokens of a head (KVCache-Factory: window_size) and P = B - W the evictable budget:
//   min = P // beta,  max = 2 P - min                       (so (max + min) / 2 = P)
//   if max >= N - W:  max = N - W,  min = 2 P - max           (the top layer cannot exceed the prompt)
//   layer l keeps   max - l (max - min) / (L - 1)   evictable tokens per head, + W
// and KVCache-Factory's short-prompt fallbacks: N < B keeps everything, N < 2 P keeps B everywhere.
#pragma once

#include <kvevict/budget/apportion.hpp>

namespace kvevict {

enum class pyramid_rounding : int {
  /// Default. The linear interpolation is exact (a rational with denominator L - 1) and rounded
  /// by largest remainder (ties to the lower layer): the model keeps exactly B x H x L tokens.
  /// A prompt shorter than B is an error (the budget is above the prompt).
  exact = 0,
  /// KVCache-Factory bit for bit: steps = (max - min) // (L - 1) and layer l keeps max - l steps, so
  /// the model keeps more than B x H x L tokens (up to (L - 1) L / 2 per head more; see
  /// docs/budget.md), and a prompt shorter than B keeps all N tokens of every head.
  kvcache_factory = 1,
};

struct pyramid_options {
  /// Pyramid shape: the bottom layer keeps about 2 P, the top about P / beta. KVCache-Factory's
  /// default 20 (LAVa's experiments try 5, 10, 20). An integer >= 1 (KVCache-Factory divides with //).
  index_t beta = 20;
  /// Protected tokens of every head; KVCache-Factory's window_size is n_recent (it has no sinks).
  protection prot;
  pyramid_rounding rounding = pyramid_rounding::exact;
};

/// PyramidKV per-head budgets: out[l][h] (int32, [L][H]) = the tokens head h of layer l keeps,
/// protected ones included; all heads of a layer are equal (B_{l,h} = B_l / H). `budget` is B per
/// head, `prompt_length` N the prompt's tokens per head. Non-increasing over layers.
///
/// Regimes (both roundings, W = protected_count(N, prot), P = B - W):
///   N < 2 P            every layer keeps B (KVCache-Factory's fallback to SnapKV's uniform budget)
///   otherwise          the pyramid above; L = 1 keeps B (KVCache-Factory divides by L - 1 = 0)
/// exact: the evictable quotas q_l = (max (L-1) - l (max - min)) / (L-1) sum to L P exactly; each
/// layer gets floor(q_l), and the L P - sum(floors) remaining tokens go to the layers with the largest
/// remainders (ties to the lower layer), which keeps the budgets non-increasing.
///
/// Errors (nothing written): invalid `out`; zero layers or heads; prompt_length outside [1,
/// INT32_MAX]; beta < 1; negative n_sink/n_recent or budget; budget below the protected tokens;
/// budget above the prompt (exact rounding only); unknown rounding.
inline status pyramid_budgets(index_t budget, index_t prompt_length, const pyramid_options& opt,
                              matrix_view<std::int32_t> out) {
  constexpr const char* fn = "pyramid_budgets";
  index_t L = 0, H = 0;
  KVEVICT_TRY(detail::check_allocator_args(fn, out, prompt_length, opt.prot, &L, &H));
  if (opt.rounding != pyramid_rounding::exact && opt.rounding != pyramid_rounding::kvcache_factory)
    return status::error(errc::invalid_argument, "%s: unknown pyramid_rounding value %d", fn,
                         static_cast<int>(opt.rounding));
  if (opt.beta < 1)
    return status::error(errc::invalid_argument, "%s: beta = %lld (must be an integer >= 1)", fn,
                         static_cast<long long>(opt.beta));
  if (L > INT32_MAX)
    return status::error(errc::invalid_argument, "%s: %lld layers is more than %d", fn, static_cast<long long>(L),
                         INT32_MAX);
  const index_t N = prompt_length;
  const bool kvcf = opt.rounding == pyramid_rounding::kvcache_factory;
  if (budget < 0)
    return status::error(errc::invalid_argument, "%s: budget %lld is negative", fn, static_cast<long long>(budget));
  if (!kvcf || budget <= N) KVEVICT_TRY(detail::check_head_budget(fn, budget, N, opt.prot));
  else KVEVICT_TRY(check_budget(fn, budget, N, opt.prot.n_sink, opt.prot.n_recent));

  const auto fill = [&](index_t l, index_t b) {
    for (index_t h = 0; h < H; ++h) out(l, h) = static_cast<std::int32_t>(b);
  };
  if (kvcf && N < budget) {  // KVCache-Factory: "q_len < max_capacity_prompt": no compression
    for (index_t l = 0; l < L; ++l) fill(l, N);
    return {};
  }
  const index_t W = protected_count(N, opt.prot.n_sink, opt.prot.n_recent);
  const index_t P = budget - W, A = N - W;  // evictable budget and evictable tokens per head
  if (N < 2 * P || L == 1) {
    for (index_t l = 0; l < L; ++l) fill(l, budget);
    return {};
  }
  index_t mn = P / opt.beta, mx = 2 * P - mn;
  if (mx >= A) {
    mx = A;
    mn = 2 * P - mx;
  }
  if (kvcf) {
    const index_t steps = (mx - mn) / (L - 1);
    for (index_t l = 0; l < L; ++l) fill(l, W + mx - l * steps);
    return {};
  }
  // exact: q_l = num_l / den with num_l = mx (L-1) - l (mx - mn), den = L - 1; sum(q_l) = L P.
  const index_t den = L - 1;
  index_t left = L * P;
  for (index_t l = 0; l < L; ++l) left -= (mx * den - l * (mx - mn)) / den;
  for (index_t l = 0; l < L; ++l) {
    const index_t num = mx * den - l * (mx - mn);
    const index_t q = num / den, r = num % den;
    index_t above = 0;  // layers whose remainder ranks above l's (larger, or equal and lower index)
    for (index_t j = 0; j < L && above < left; ++j) {
      const index_t rj = (mx * den - j * (mx - mn)) % den;
      if (j != l && (rj > r || (rj == r && j < l))) ++above;
    }
    fill(l, W + q + (above < left ? 1 : 0));
  }
  return {};
}

}  // namespace kvevict
