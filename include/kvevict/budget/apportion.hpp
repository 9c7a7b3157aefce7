// kvevict/budget/apportion.hpp: what every budget allocator shares (docs/budget.md).
//
//   protection                          the sinks and recent window every head keeps (protect())
//   budget_offsets(budgets, H, cu)      per-head budgets -> the cu[H+1] offsets of select_topk's
//                                       ragged form (ragged_positions_out{pos, cu, H})
//   apportion(target, w, caps, n, out)  exact integer shares of `target` proportional to weights,
//                                       capped (water-filling), largest remainder, ties -> lower index
//
// Conventions (docs/conventions.md, "Budgets"): a budget counts every kept token of a head,
// protected ones included; "budget B per head" means B x H_kv per layer and B x H_kv x L per model.
// Allocators are exact: the kept totals equal the requested totals, to the token.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cmath>
#include <cstdint>

namespace kvevict {

/// The tokens a head always keeps: its first n_sink and its last n_recent positions (the `protect`
/// stage gives them +inf scores). A head of length N keeps protected_count(N, n_sink, n_recent) =
/// min(N, n_sink + n_recent) of them; budgets count them.
struct protection {
  index_t n_sink = 0;
  index_t n_recent = 0;
};

namespace detail {

inline status check_protection(const char* fn, const protection& p) {
  if (p.n_sink < 0)
    return status::error(errc::invalid_argument, "%s: n_sink = %lld is negative", fn, static_cast<long long>(p.n_sink));
  if (p.n_recent < 0)
    return status::error(errc::invalid_argument, "%s: n_recent = %lld is negative", fn,
                         static_cast<long long>(p.n_recent));
  return {};
}

inline status check_layers_heads(const char* fn, index_t layers, index_t heads) {
  if (layers <= 0)
    return status::error(errc::invalid_argument, "%s: the model has %lld layers (at least 1 needed)", fn,
                         static_cast<long long>(layers));
  if (heads <= 0)
    return status::error(errc::invalid_argument, "%s: the model has %lld KV heads per layer (at least 1 needed)", fn,
                         static_cast<long long>(heads));
  return {};
}

/// Prompt length in [1, INT32_MAX] (positions and per-head budgets are int32).
inline status check_prompt_length(const char* fn, index_t n) {
  if (n <= 0 || n > INT32_MAX)
    return status::error(errc::invalid_argument, "%s: prompt_length = %lld is outside [1, %d]", fn,
                         static_cast<long long>(n), INT32_MAX);
  return {};
}

/// A per-head budget B for heads of length N protecting `prot`: prot <= B <= N, B >= 0.
inline status check_head_budget(const char* fn, index_t budget, index_t length, const protection& p) {
  if (budget < 0)
    return status::error(errc::invalid_argument, "%s: budget %lld is negative", fn, static_cast<long long>(budget));
  if (budget > length)
    return status::error(errc::invalid_argument, "%s: budget %lld is above the prompt (%lld tokens per head)", fn,
                         static_cast<long long>(budget), static_cast<long long>(length));
  return check_budget(fn, budget, length, p.n_sink, p.n_recent);
}

/// The [L][H] int32 output of an allocator.
inline status check_budget_out(const char* fn, const matrix_view<std::int32_t>& out, index_t* layers, index_t* heads) {
  KVEVICT_TRY(check_view(fn, "budgets", out));
  *layers = out.extent(0);
  *heads = out.extent(1);
  return check_layers_heads(fn, *layers, *heads);
}

/// The inputs every per-prompt allocator takes: its [L][H] output, the prompt length and the
/// protected tokens (checked in that order).
inline status check_allocator_args(const char* fn, const matrix_view<std::int32_t>& out, index_t prompt_length,
                                   const protection& prot, index_t* layers, index_t* heads) {
  KVEVICT_TRY(check_budget_out(fn, out, layers, heads));
  KVEVICT_TRY(check_prompt_length(fn, prompt_length));
  return check_protection(fn, prot);
}

}  // namespace detail

/// Offsets of per-head budgets: cu[0] = 0, cu[h+1] = cu[h] + budgets[h]. {pos, cu, H} is then the
/// ragged_positions_out that select_topk fills (head h keeps budgets[h] tokens) and compact reads.
/// Errors: heads < 0, null pointers (with heads > 0 for budgets), a negative budget, a total above
/// INT32_MAX (the offsets are int32), cu overlapping budgets.
inline status budget_offsets(const std::int32_t* budgets, index_t heads, std::int32_t* cu) {
  constexpr const char* fn = "budget_offsets";
  if (heads < 0)
    return status::error(errc::invalid_argument, "%s: heads = %lld is negative", fn, static_cast<long long>(heads));
  if (cu == nullptr) return status::error(errc::null_pointer, "%s: cu is null", fn);
  if (budgets == nullptr && heads > 0) return status::error(errc::null_pointer, "%s: budgets is null", fn);
  if (heads > 0) {
    const auto b = reinterpret_cast<std::uintptr_t>(budgets), c = reinterpret_cast<std::uintptr_t>(cu);
    const auto bs = static_cast<std::uintptr_t>(heads) * sizeof(std::int32_t);
    if (b < c + bs + sizeof(std::int32_t) && c < b + bs)
      return status::error(errc::overlap, "%s: cu and budgets overlap in memory", fn);
  }
  index_t sum = 0;
  for (index_t h = 0; h < heads; ++h) {
    if (budgets[h] < 0)
      return status::error(errc::invalid_argument, "%s: budgets[%lld] = %d is negative", fn, static_cast<long long>(h),
                           budgets[h]);
    sum += budgets[h];
    if (sum > INT32_MAX)
      return status::error(errc::size_overflow, "%s: the budgets add up to more than %d (int32 offsets)", fn, INT32_MAX);
  }
  cu[0] = 0;
  for (index_t h = 0; h < heads; ++h) cu[h + 1] = cu[h] + budgets[h];
  return {};
}

/// budget_offsets of row `layer` of an [L][H] budget matrix (any strides).
inline status budget_offsets(matrix_view<const std::int32_t> budgets, index_t layer, std::int32_t* cu) {
  constexpr const char* fn = "budget_offsets";
  KVEVICT_TRY(detail::check_view(fn, "budgets", budgets));
  if (layer < 0 || layer >= budgets.extent(0))
    return status::error(errc::out_of_range, "%s: layer %lld is outside [0, %lld)", fn, static_cast<long long>(layer),
                         static_cast<long long>(budgets.extent(0)));
  if (cu == nullptr) return status::error(errc::null_pointer, "%s: cu is null", fn);
  const index_t H = budgets.extent(1);
  const auto c = reinterpret_cast<std::uintptr_t>(cu);
  const detail::byte_range cr{c, c + static_cast<std::uintptr_t>(H + 1) * sizeof(std::int32_t)};
  if (cr.intersects(detail::range_of(budgets)))
    return status::error(errc::overlap, "%s: cu and budgets overlap in memory", fn);
  index_t sum = 0;
  for (index_t h = 0; h < H; ++h) {
    const std::int32_t b = budgets(layer, h);
    if (b < 0)
      return status::error(errc::invalid_argument, "%s: budgets[%lld][%lld] = %d is negative", fn,
                           static_cast<long long>(layer), static_cast<long long>(h), b);
    sum += b;
    if (sum > INT32_MAX)
      return status::error(errc::size_overflow, "%s: layer %lld's budgets add up to more than %d (int32 offsets)", fn,
                           static_cast<long long>(layer), INT32_MAX);
  }
  cu[0] = 0;
  for (index_t h = 0; h < H; ++h) cu[h + 1] = cu[h] + budgets(layer, h);
  return {};
}

namespace detail {

/// The share of item i given the remaining target R, the active weight sum W and the active count:
/// R w_i / W, or R / active when every active weight is 0. Always computed by this expression so
/// that every pass sees the same double.
inline double apportion_quota(index_t R, double w, double W, index_t active) {
  if (W > 0.0) return static_cast<double>(R) * (w / W);
  return static_cast<double>(R) / static_cast<double>(active);
}

/// The apportionment itself; arguments already validated. w(i): weight, cap(i): cap, out.get(i) /
/// out.set(i, v): storage of the shares (index_t or int32: values must fit). While running, an
/// uncapped item holds a negative value (~share once its share is known), a capped one its cap.
template <class Weight, class Cap, class Out>
void apportion_run(index_t target, index_t n, Weight w, Cap cap, Out out) {
  for (index_t i = 0; i < n; ++i) out.set(i, cap(i) > 0 ? -1 : 0);
  // 1. water-filling on the real quotas: cap every item whose quota reaches its cap, repeat.
  index_t R = target, active = 0;
  double W = 0.0;
  while (true) {
    R = target;
    active = 0;
    W = 0.0;
    for (index_t i = 0; i < n; ++i) {
      if (out.get(i) >= 0) R -= out.get(i);
      else {
        ++active;
        W += w(i);
      }
    }
    if (active == 0) return;  // everything capped: sum(caps) == target (validated)
    bool capped = false;
    for (index_t i = 0; i < n; ++i)
      if (out.get(i) < 0 && apportion_quota(R, w(i), W, active) >= static_cast<double>(cap(i))) {
        out.set(i, cap(i));
        capped = true;
      }
    if (!capped) break;
  }
  // 2. largest remainder: floor(q_i) each, and the `left` units to the largest fractional parts,
  //    ties to the lower index. Item i gets one more iff fewer than `left` uncapped items rank above it.
  const auto floor_quota = [&](index_t i, double* frac) {
    const double q = apportion_quota(R, w(i), W, active);
    index_t f = static_cast<index_t>(std::floor(q));
    if (f < 0) f = 0;
    if (f > cap(i) - 1) f = cap(i) - 1;  // q < cap(i); guards against rounding only
    *frac = q - static_cast<double>(f);
    return f;
  };
  index_t left = R;
  for (index_t i = 0; i < n; ++i) {
    double frac = 0.0;
    if (out.get(i) < 0) left -= floor_quota(i, &frac);
  }
  for (index_t i = 0; i < n; ++i) {
    if (out.get(i) >= 0) continue;
    double fi = 0.0;
    const index_t f = floor_quota(i, &fi);
    index_t above = 0;
    for (index_t j = 0; j < n && above < left; ++j) {
      if (out.get(j) >= 0 || j == i) continue;
      double fj = 0.0;
      floor_quota(j, &fj);
      if (fj > fi || (fj == fi && j < i)) ++above;
    }
    out.set(i, ~(above < left ? f + 1 : f));
  }
  for (index_t i = 0; i < n; ++i)
    if (out.get(i) < 0) out.set(i, ~out.get(i));
  // 3. double rounding guards (not reached with exact arithmetic): restore the exact total.
  index_t sum = 0;
  for (index_t i = 0; i < n; ++i) sum += out.get(i);
  for (index_t i = 0; sum < target; i = (i + 1) % n)
    if (out.get(i) < cap(i)) {
      out.set(i, out.get(i) + 1);
      ++sum;
    }
  for (index_t i = n - 1; sum > target; i = (i + n - 1) % n)
    if (out.get(i) > 0) {
      out.set(i, out.get(i) - 1);
      --sum;
    }
}

/// Storage adaptors for apportion_run.
template <class T>
struct array_out {
  T* p;
  index_t get(index_t i) const { return static_cast<index_t>(p[i]); }
  void set(index_t i, index_t v) const { p[i] = static_cast<T>(v); }
};

inline status check_apportion_args(const char* fn, const char* what, index_t target, const double* weights,
                                   const index_t* caps, index_t n) {
  if (n < 0)
    return status::error(errc::invalid_argument, "%s: %lld items is negative", fn, static_cast<long long>(n));
  if (target < 0)
    return status::error(errc::invalid_argument, "%s: target %lld is negative", fn, static_cast<long long>(target));
  if (n > 0 && weights == nullptr) return status::error(errc::null_pointer, "%s: %s is null", fn, what);
  index_t cap_sum = 0;
  bool bounded = caps != nullptr;
  for (index_t i = 0; i < n; ++i) {
    const double w = weights[i];
    if (!(w >= 0.0) || w - w != 0.0)
      return status::error(errc::invalid_argument, "%s: %s[%lld] = %g (must be finite and >= 0)", fn, what,
                           static_cast<long long>(i), w);
    if (caps != nullptr) {
      if (caps[i] < 0)
        return status::error(errc::invalid_argument, "%s: caps[%lld] = %lld is negative", fn,
                             static_cast<long long>(i), static_cast<long long>(caps[i]));
      cap_sum = caps[i] > INT64_MAX - cap_sum ? INT64_MAX : cap_sum + caps[i];
    }
  }
  if (n == 0 && target > 0)
    return status::error(errc::invalid_argument, "%s: nothing to share %lld tokens among", fn,
                         static_cast<long long>(target));
  if (bounded && cap_sum < target)
    return status::error(errc::invalid_argument, "%s: target %lld is above the %lld tokens the caps allow", fn,
                         static_cast<long long>(target), static_cast<long long>(cap_sum));
  return {};
}

}  // namespace detail

/// Exact proportional shares: out[i] >= 0 integers with sum(out) == target, out[i] <= caps[i]
/// (caps null: unbounded), proportional to weights[i] under this rule:
///   1. water-filling: q_i = R w_i / W over the uncapped items (R = target minus the caps of the
///      capped items, W = their weight sum; all-zero weights share equally); every item with
///      q_i >= caps[i] is capped at caps[i] and the quotas recomputed, until none is;
///   2. largest remainder (Hamilton): each uncapped item gets floor(q_i), and the
///      target - sum(floors) units left go one each to the largest fractional parts q_i - floor(q_i),
///      ties to the lower index.
/// Quotas are doubles computed by one fixed expression, so the result is deterministic; each share
/// is floor(q_i) or floor(q_i) + 1 up to the rounding of q_i, and the total is exact whatever the
/// rounding (a final guard restores it). O(n^2) in the worst case; n is a layer count.
/// Errors: n < 0, target < 0, weights/out null, a weight NaN, infinite or negative, a negative cap,
/// sum(caps) < target, n == 0 with target > 0. Nothing is written on error.
inline status apportion(index_t target, const double* weights, const index_t* caps, index_t n, index_t* out) {
  constexpr const char* fn = "apportion";
  KVEVICT_TRY(detail::check_apportion_args(fn, "weights", target, weights, caps, n));
  if (n > 0 && out == nullptr) return status::error(errc::null_pointer, "%s: out is null", fn);
  detail::apportion_run(
      target, n, [weights](index_t i) { return weights[i]; },
      [caps](index_t i) { return caps != nullptr ? caps[i] : INT64_MAX; }, detail::array_out<index_t>{out});
  return {};
}

}  // namespace kvevict
