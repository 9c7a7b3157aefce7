// kvevict/metrics/lava_loss.hpp: LAVa's layer attention output loss (Lemma 1, Eq. 4) and its
// upper bound (Theorem 1, Eq. 5), for one layer and one query (the current, N-th residual stream).
//
//   y   = Cat_h(A_h V_h) W_O                 (full cache)
//   ŷ   = Cat_h(Â_h V_h) W_O,   Â_h = A_h ⊙ I_h / ‖A_h ⊙ I_h‖₁   (kept entries, renormalised)
//   lava_output_loss   = ‖y − ŷ‖_p,  p ∈ {1, 2, ∞}
//   lava_loss_bound    = 2 Ĉ Σ_h V̄_h Σ_i A_h[i] (1 − I_h[i]),
//                        Ĉ = ‖W_Oᵀ‖₁ (induced 1-norm) = max_r Σ_c |W_O[r][c]| (W_O as [H·d][D]),
//                        V̄_h = max_k ‖V_h[k]‖₁
//
// A is the attention of one query: [H_q][N] (N keys per head, a probability row per head; rows are
// divided by their sums first, see below). V is [H_kv][N][d]; query head h reads KV head
// h / (H_q / H_kv) (GQA, consecutive groups). W_O maps the concatenated head outputs (head h owns
// inputs h·d .. h·d+d−1) to the model dimension D. I is a keep mask (nonzero = kept) with one row
// per KV head (the library's one selection per KV head, shared by its query heads) or one per
// query head. Everything is computed in double; the inputs are float (V may be fp16/bf16).
// Host-only evaluation code on the calling thread.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace kvevict {

/// Which vector norm ‖y − ŷ‖_p measures.
enum class lp_norm { l1, l2, linf };

/// Memory layout of the output projection.
enum class wo_layout {
  in_out,  ///< [H·d][D]: y = x · W_O, the paper's notation
  out_in,  ///< [D][H·d]: y = W · x, the weight of a torch nn.Linear / llama2.c's `wo`
};

/// What a head whose kept attention mass ‖A_h ⊙ I_h‖₁ is zero (it keeps nothing, or only keys it
/// gives zero attention) contributes to ŷ.
enum class empty_head {
  zero_output,  ///< Â_h = 0: the head adds nothing to ŷ (default; Theorem 1 still holds)
  error,        ///< invalid_argument
};

struct lava_loss_options {
  lp_norm norm = lp_norm::l1;
  wo_layout layout = wo_layout::in_out;
  empty_head on_empty = empty_head::zero_output;
};

namespace detail::lava_impl {

struct shapes {
  index_t hq = 0, hkv = 0, n = 0, d = 0, dmodel = 0, group = 1;
  bool mask_per_query_head = false;
};

/// Shape checks (everything a size query needs).
template <class T>
status check_shapes(const char* fn, const matrix_view<const float>& att, const kv_view<const T>& v,
                    const matrix_view<const float>& w_o, const matrix_view<const std::uint8_t>& keep,
                    wo_layout layout, shapes& s) {
  KVEVICT_TRY(check_view(fn, "attention", att));
  KVEVICT_TRY(check_view(fn, "values", v));
  KVEVICT_TRY(check_view(fn, "w_o", w_o));
  KVEVICT_TRY(check_view(fn, "keep", keep));
  if (layout != wo_layout::in_out && layout != wo_layout::out_in)
    return status::error(errc::invalid_argument, "%s: unknown w_o layout %d", fn, static_cast<int>(layout));
  s.hq = att.extent(0);
  s.n = att.extent(1);
  s.hkv = v.extent(0);
  s.d = v.extent(2);
  if (s.hq < 1 || s.hkv < 1)
    return status::error(errc::invalid_argument, "%s: there are no heads (%lld query heads, %lld KV heads)", fn,
                         static_cast<long long>(s.hq), static_cast<long long>(s.hkv));
  if (s.n < 1) return status::error(errc::invalid_argument, "%s: the attention rows have no keys", fn);
  if (s.hq % s.hkv != 0)
    return status::error(errc::shape_mismatch, "%s: %lld query heads are not a multiple of %lld KV heads", fn,
                         static_cast<long long>(s.hq), static_cast<long long>(s.hkv));
  s.group = s.hq / s.hkv;
  if (v.extent(1) != s.n)
    return status::error(errc::shape_mismatch, "%s: attention has %lld keys but values %lld tokens", fn,
                         static_cast<long long>(s.n), static_cast<long long>(v.extent(1)));
  const index_t in = s.hq * s.d;
  const index_t w_in = layout == wo_layout::in_out ? w_o.extent(0) : w_o.extent(1);
  s.dmodel = layout == wo_layout::in_out ? w_o.extent(1) : w_o.extent(0);
  if (w_in != in)
    return status::error(errc::shape_mismatch, "%s: w_o takes %lld inputs but %lld heads x %lld dims = %lld (layout %s)",
                         fn, static_cast<long long>(w_in), static_cast<long long>(s.hq), static_cast<long long>(s.d),
                         static_cast<long long>(in), layout == wo_layout::in_out ? "in_out [H*d][D]" : "out_in [D][H*d]");
  if (keep.extent(0) != s.hkv && keep.extent(0) != s.hq)
    return status::error(errc::shape_mismatch, "%s: keep has %lld rows; expected %lld (KV heads) or %lld (query heads)",
                         fn, static_cast<long long>(keep.extent(0)), static_cast<long long>(s.hkv),
                         static_cast<long long>(s.hq));
  if (keep.extent(1) != s.n)
    return status::error(errc::shape_mismatch, "%s: keep has %lld columns but attention %lld keys", fn,
                         static_cast<long long>(keep.extent(1)), static_cast<long long>(s.n));
  s.mask_per_query_head = keep.extent(0) == s.hq && s.hq != s.hkv;
  return {};
}

/// Data checks (after check_shapes): attention finite, >= 0, rows with a positive sum; values and
/// W_O finite.
template <class T>
status check_data(const char* fn, const matrix_view<const float>& att, const kv_view<const T>& v,
                  const matrix_view<const float>& w_o, const shapes& s) {
  for (index_t h = 0; h < s.hq; ++h) {
    double sum = 0;
    for (index_t i = 0; i < s.n; ++i) {
      const float a = att(h, i);
      if (!std::isfinite(a) || a < 0)
        return status::error(errc::invalid_argument, "%s: attention[%lld][%lld] = %g is not a finite, non-negative weight",
                             fn, static_cast<long long>(h), static_cast<long long>(i), static_cast<double>(a));
      sum += a;
    }
    if (!(sum > 0))
      return status::error(errc::invalid_argument, "%s: attention row %lld sums to 0 (it is not a distribution)", fn,
                           static_cast<long long>(h));
  }
  for (index_t h = 0; h < s.hkv; ++h)
    for (index_t i = 0; i < s.n; ++i)
      for (index_t t = 0; t < s.d; ++t)
        if (!std::isfinite(to_float(v(h, i, t))))
          return status::error(errc::invalid_argument, "%s: values[%lld][%lld][%lld] is not finite", fn,
                               static_cast<long long>(h), static_cast<long long>(i), static_cast<long long>(t));
  for (index_t r = 0; r < w_o.extent(0); ++r)
    for (index_t c = 0; c < w_o.extent(1); ++c)
      if (!std::isfinite(w_o(r, c)))
        return status::error(errc::invalid_argument, "%s: w_o[%lld][%lld] is not finite", fn, static_cast<long long>(r),
                             static_cast<long long>(c));
  return {};
}

/// Kept and evicted attention mass of query head h (each summed in position order), so that
/// S = K + E exactly defines the row's normaliser and no difference of near-equal numbers is taken.
struct masses {
  double kept = 0, evicted = 0;
  double total() const { return kept + evicted; }
};

inline masses head_masses(const matrix_view<const float>& att, const matrix_view<const std::uint8_t>& keep,
                          const shapes& s, index_t h) {
  const index_t mr = s.mask_per_query_head ? h : h / s.group;
  masses m;
  for (index_t i = 0; i < s.n; ++i) {
    if (keep(mr, i) != 0) m.kept += att(h, i);
    else m.evicted += att(h, i);
  }
  return m;
}

/// W_O entry for input r (concatenated head dims) and output c.
inline double w_at(const matrix_view<const float>& w_o, wo_layout layout, index_t r, index_t c) {
  return layout == wo_layout::in_out ? w_o(r, c) : w_o(c, r);
}

}  // namespace detail::lava_impl

/// Ĉ = ‖W_Oᵀ‖₁ of Theorem 1: the induced 1-norm of W_Oᵀ, i.e. its largest column absolute sum,
/// i.e. the largest absolute row sum of W_O in the paper's [H·d][D] orientation (one row per
/// input). With layout out_in ([D][H·d]) that is the largest absolute *column* sum of the stored
/// matrix. It is the smallest constant with ‖x W_O‖₁ <= Ĉ ‖x‖₁ for every x.
/// Errors: invalid view, non-finite entry, unknown layout.
inline status lava_wo_norm(matrix_view<const float> w_o, wo_layout layout, double& c_hat) {
  constexpr const char* fn = "lava_wo_norm";
  KVEVICT_TRY(detail::check_view(fn, "w_o", w_o));
  if (layout != wo_layout::in_out && layout != wo_layout::out_in)
    return status::error(errc::invalid_argument, "%s: unknown w_o layout %d", fn, static_cast<int>(layout));
  const index_t in = layout == wo_layout::in_out ? w_o.extent(0) : w_o.extent(1);
  const index_t out = layout == wo_layout::in_out ? w_o.extent(1) : w_o.extent(0);
  double best = 0;
  for (index_t r = 0; r < in; ++r) {
    double sum = 0;
    for (index_t c = 0; c < out; ++c) {
      const double w = detail::lava_impl::w_at(w_o, layout, r, c);
      if (!std::isfinite(w))
        return status::error(errc::invalid_argument, "%s: a w_o entry of input %lld is not finite", fn,
                             static_cast<long long>(r));
      sum += std::fabs(w);
    }
    if (sum > best) best = sum;
  }
  c_hat = best;
  return {};
}

/// Lemma 1 (Eq. 4): ‖y − ŷ‖_p for one layer and one query. Each attention row is first divided by
/// its sum S_h = K_h + E_h (kept + evicted mass), so Â_h[i] = A_h[i] / K_h on kept keys; the
/// coefficient A_h − Â_h is formed directly (−A_h[i]·E_h/(S_h K_h) kept, A_h[i]/S_h evicted), which
/// is exactly 0 with a full mask and never subtracts near-equal numbers.
/// Workspace: H_q·d doubles (two-phase). `loss` is written only on success.
/// Errors: invalid views; shape mismatches (keys, GQA divisibility, W_O inputs != H_q·d, mask rows
/// neither H_kv nor H_q); negative or non-finite attention, a row summing to 0; non-finite values
/// or W_O; an empty head with on_empty = error; unknown enum values; workspace too small.
/// Cost: O(H_q·N·d + H_q·d·D).
template <class S>
status lava_output_loss(workspace& ws, matrix_view<const float> attention, kv_view<S> values_in,
                        matrix_view<const float> w_o, matrix_view<const std::uint8_t> keep, double& loss,
                        lava_loss_options opt = {}) {
  using T = std::remove_const_t<S>;
  static_assert(is_kv_element_v<T>, "lava_output_loss: values must be float, float16 or bfloat16");
  constexpr const char* fn = "lava_output_loss";
  namespace li = detail::lava_impl;
  const kv_view<const T> values = values_in;
  if (opt.norm != lp_norm::l1 && opt.norm != lp_norm::l2 && opt.norm != lp_norm::linf)
    return status::error(errc::invalid_argument, "%s: unknown norm %d", fn, static_cast<int>(opt.norm));
  if (opt.on_empty != empty_head::zero_output && opt.on_empty != empty_head::error)
    return status::error(errc::invalid_argument, "%s: unknown empty-head policy %d", fn, static_cast<int>(opt.on_empty));
  li::shapes s;
  KVEVICT_TRY(li::check_shapes(fn, attention, values, w_o, keep, opt.layout, s));
  detail::workspace_carver carver(ws);
  double* x = carver.take<double>(static_cast<std::size_t>(s.hq * s.d));
  KVEVICT_TRY(carver.finish(fn));
  const auto lb = reinterpret_cast<std::uintptr_t>(&loss);
  const detail::byte_range touched[] = {detail::range_of(attention), detail::range_of(values), detail::range_of(w_o),
                                        detail::range_of(keep), {lb, lb + sizeof(double)}};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"attention", "values", "w_o", "keep", "loss"}));
  if (ws.is_query()) return {};
  KVEVICT_TRY(li::check_data(fn, attention, values, w_o, s));
  for (index_t h = 0; h < s.hq; ++h) {
    const li::masses m = li::head_masses(attention, keep, s, h);
    if (m.kept == 0 && opt.on_empty == empty_head::error)
      return status::error(errc::invalid_argument,
                           "%s: query head %lld keeps no attention mass (||A*I||_1 = 0): A-hat is undefined", fn,
                           static_cast<long long>(h));
  }
  // x = Cat_h (A_h - Â_h) V_h
  for (index_t h = 0; h < s.hq; ++h) {
    const index_t kvh = h / s.group, mr = s.mask_per_query_head ? h : kvh;
    const li::masses m = li::head_masses(attention, keep, s, h);
    const double total = m.total();
    double* xh = x + h * s.d;
    for (index_t t = 0; t < s.d; ++t) xh[t] = 0;
    for (index_t i = 0; i < s.n; ++i) {
      const double a = attention(h, i);
      double coef;
      if (keep(mr, i) == 0) coef = a / total;                               // Â = 0 here
      else coef = m.kept > 0 ? -(a * m.evicted) / (total * m.kept) : 0.0;  // A/S − A/K (empty head: a = 0)
      if (coef == 0) continue;
      for (index_t t = 0; t < s.d; ++t) xh[t] += coef * static_cast<double>(to_float(values(kvh, i, t)));
    }
  }
  // ‖x W_O‖_p, one output coordinate at a time
  double acc = 0;
  const index_t in = s.hq * s.d;
  for (index_t c = 0; c < s.dmodel; ++c) {
    double yc = 0;
    for (index_t r = 0; r < in; ++r) yc += x[r] * li::w_at(w_o, opt.layout, r, c);
    const double m = std::fabs(yc);
    if (opt.norm == lp_norm::l1) acc += m;
    else if (opt.norm == lp_norm::l2) acc += m * m;
    else if (m > acc) acc = m;
  }
  loss = opt.norm == lp_norm::l2 ? std::sqrt(acc) : acc;
  return {};
}

/// Theorem 1 (Eq. 5): 2 Ĉ Σ_h V̄_{kv(h)} Σ_i Ã_h[i] (1 − I[i]) with Ã_h = A_h / S_h (rows divided
/// by their sums as in lava_output_loss, so the evicted mass is E_h / S_h), Ĉ = lava_wo_norm, V̄ =
/// max_k ‖V_kv[k]‖₁. An upper bound of the L1 loss (hence of L2 and L∞) for any mask, empty heads
/// included (the zero_output convention gives ‖A_h − 0‖₁ = 1 <= 2·1). No workspace.
/// Errors: as lava_output_loss (except workspace and the empty-head policy). Cost: O(H_kv·N·d +
/// H_q·N + H_q·d·D).
template <class S>
status lava_loss_bound(matrix_view<const float> attention, kv_view<S> values_in, matrix_view<const float> w_o,
                       matrix_view<const std::uint8_t> keep, double& bound, wo_layout layout = wo_layout::in_out) {
  using T = std::remove_const_t<S>;
  static_assert(is_kv_element_v<T>, "lava_loss_bound: values must be float, float16 or bfloat16");
  constexpr const char* fn = "lava_loss_bound";
  namespace li = detail::lava_impl;
  const kv_view<const T> values = values_in;
  li::shapes s;
  KVEVICT_TRY(li::check_shapes(fn, attention, values, w_o, keep, layout, s));
  KVEVICT_TRY(li::check_data(fn, attention, values, w_o, s));
  double c_hat = 0;
  KVEVICT_TRY(lava_wo_norm(w_o, layout, c_hat));
  double sum = 0;
  for (index_t kvh = 0; kvh < s.hkv; ++kvh) {
    double v_bar = 0;  // max_k ‖V_kvh[k]‖₁
    for (index_t k = 0; k < s.n; ++k) {
      double l1 = 0;
      for (index_t t = 0; t < s.d; ++t) l1 += std::fabs(static_cast<double>(to_float(values(kvh, k, t))));
      if (l1 > v_bar) v_bar = l1;
    }
    for (index_t h = kvh * s.group; h < (kvh + 1) * s.group; ++h) {
      const li::masses m = li::head_masses(attention, keep, s, h);
      sum += v_bar * (m.evicted / m.total());
    }
  }
  bound = 2.0 * c_hat * sum;
  return {};
}

}  // namespace kvevict
