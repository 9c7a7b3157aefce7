// kvevict/train/prulong.hpp: the math of PruLong (Bhaskar et al., "Cache me if you can", §4 and
// appendix B) and the head-mask files of DuoAttention / PruLong.
//
// Each KV head (layer i, head j) has a gate z in [0, 1]: 1 = retrieval head (full KV cache),
// 0 = streaming head (sink + recent window only). Training learns log_alpha per head through the
// hard-concrete relaxation (Louizos et al. 2018) with l = -0.1, r = 1.1, beta = 2/3, and a
// Lagrangian that drives the expected sparsity s (fraction of streaming heads) to a target t:
//
//   hard_concrete_sample(log_alpha, u)        z = clamp(sigmoid((logit(u) + log_alpha)/beta)(r-l)+l, 0, 1)
//   hard_concrete_expected_l0(log_alpha)      P(z > 0) = sigmoid(log_alpha - beta log(-l/r))
//   prulong_expected_sparsity(log_alpha, &s)  s = 1 - mean P(z > 0)    (+ ds/dlog_alpha)
//   prulong_lagrangian(log_alpha, t, l1, l2)  L = l1 (s-t) + l2 (s-t)^2 (+ every gradient)
//   prulong_topk_mask(log_alpha, k, mask)     the final masks: the k largest log_alpha are retrieval
//   parse/read/write_head_mask_tsv, binarize_head_mask   the TSV files (layers x KV heads)
//
// All of this is small (one value per KV head) and runs on the calling thread; the per-head math
// is in KVEVICT_HOST_DEVICE functions a CUDA training loop can call per element.
// docs/prulong.md has the formulas, defaults and deviations from the paper and public code.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/real_math.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <string>
#include <system_error>
#include <type_traits>

namespace kvevict {

/// Hard-concrete stretch interval (l, r) and temperature beta (Louizos et al. 2018; PruLong).
template <class T>
struct hard_concrete_params {
  T l = T(-0.1);
  T r = T(1.1);
  T beta = T(2) / T(3);
};

namespace detail {

/// Overflow-free logistic function: 1/(1+e^-x) for x >= 0, e^x/(1+e^x) otherwise; +-inf give 1/0.
template <class T>
KVEVICT_HOST_DEVICE inline T sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + exp_t(-x));
  const T e = exp_t(x);
  return e / (T(1) + e);
}

/// The pre-clamp value g = sigmoid((log u - log(1-u) + log_alpha)/beta) (r - l) + l, and s.
template <class T>
KVEVICT_HOST_DEVICE inline T hard_concrete_stretched(T log_alpha, T u, const hard_concrete_params<T>& p, T* s_out) {
  const T s = sigmoid((log_t(u) - log_t(T(1) - u) + log_alpha) / p.beta);
  if (s_out) *s_out = s;
  return s * (p.r - p.l) + p.l;
}

}  // namespace detail

/// One hard-concrete sample for a caller-provided uniform u in [0, 1] (deterministic given u):
///   z = min(1, max(0, sigmoid((log u - log(1 - u) + log_alpha) / beta) * (r - l) + l)).
/// u = 0 gives z = 0 and u = 1 gives z = 1. The paper draws u from (1e-6, 1 - 1e-6).
template <class T>
KVEVICT_HOST_DEVICE inline T hard_concrete_sample(T log_alpha, T u, const hard_concrete_params<T>& p = {}) {
  const T g = detail::hard_concrete_stretched(log_alpha, u, p, static_cast<T*>(nullptr));
  return g < T(0) ? T(0) : (g > T(1) ? T(1) : g);
}

/// dz/dlog_alpha of hard_concrete_sample: (r - l) s (1 - s) / beta where 0 < g < 1, else 0
/// (the clamp is flat; at g exactly 0 or 1 the gradient is 0, as PyTorch's hardtanh).
template <class T>
KVEVICT_HOST_DEVICE inline T hard_concrete_sample_grad(T log_alpha, T u, const hard_concrete_params<T>& p = {}) {
  T s = T(0);
  const T g = detail::hard_concrete_stretched(log_alpha, u, p, &s);
  if (!(g > T(0) && g < T(1))) return T(0);
  return (p.r - p.l) * s * (T(1) - s) / p.beta;
}

/// The deterministic (test-time) gate of Louizos et al.: min(1, max(0, sigmoid(log_alpha)(r - l) + l)).
/// (PruLong's own code uses a different, CoFi-style soft mask; see docs/prulong.md. Final PruLong
/// masks come from prulong_topk_mask, not from this gate.)
template <class T>
KVEVICT_HOST_DEVICE inline T hard_concrete_deterministic(T log_alpha, const hard_concrete_params<T>& p = {}) {
  const T g = detail::sigmoid(log_alpha) * (p.r - p.l) + p.l;
  return g < T(0) ? T(0) : (g > T(1) ? T(1) : g);
}

/// Expected L0 of one gate, P(z > 0) = sigmoid(log_alpha - beta * log(-l / r)) (closed form).
template <class T>
KVEVICT_HOST_DEVICE inline T hard_concrete_expected_l0(T log_alpha, const hard_concrete_params<T>& p = {}) {
  return detail::sigmoid(log_alpha - p.beta * detail::log_t(-p.l / p.r));
}

/// d P(z > 0) / d log_alpha = P (1 - P).
template <class T>
KVEVICT_HOST_DEVICE inline T hard_concrete_expected_l0_grad(T log_alpha, const hard_concrete_params<T>& p = {}) {
  const T e = hard_concrete_expected_l0(log_alpha, p);
  return e * (T(1) - e);
}

/// The Lagrangian penalty and its partial derivatives at sparsity s and target t.
struct prulong_penalty {
  double value = 0;          ///< lambda1 (s - t) + lambda2 (s - t)^2
  double grad_sparsity = 0;  ///< lambda1 + 2 lambda2 (s - t)
  double grad_lambda1 = 0;   ///< s - t
  double grad_lambda2 = 0;   ///< (s - t)^2
};

KVEVICT_HOST_DEVICE inline prulong_penalty prulong_penalty_at(double s, double t, double lambda1, double lambda2) {
  const double d = s - t;
  return {lambda1 * d + lambda2 * d * d, lambda1 + 2.0 * lambda2 * d, d, d * d};
}

/// Everything one Lagrangian step needs. Descent on log_alpha (grad_log_alpha), *ascent* on the
/// multipliers: lambda_k += lr * grad_lambda_k (the paper's max over lambda1, lambda2).
struct prulong_lagrangian_result {
  double sparsity = 0;       ///< s: expected fraction of streaming heads
  double target = 0;         ///< t
  prulong_penalty penalty;   ///< value and partial derivatives
};

struct prulong_grad_options {
  /// false: grad_log_alpha = gradient; true: grad_log_alpha += gradient (add to the LM loss's).
  bool accumulate = false;
};

namespace detail {

template <class T>
status check_log_alpha(const char* fn, const matrix_view<const T>& la, bool allow_inf) {
  KVEVICT_TRY(check_view(fn, "log_alpha", la));
  for (index_t i = 0; i < la.extent(0); ++i)
    for (index_t j = 0; j < la.extent(1); ++j) {
      const T v = la(i, j);
      if (v != v || (!allow_inf && v - v != T(0)))
        return status::error(errc::invalid_argument, "%s: log_alpha[%lld][%lld] is %g (must be %s)", fn,
                             static_cast<long long>(i), static_cast<long long>(j), static_cast<double>(v),
                             allow_inf ? "a number" : "finite");
    }
  return {};
}

template <class T>
status check_same_shape(const char* fn, const char* name, index_t rows, index_t cols, const matrix_view<T>& v) {
  if (v.extent(0) != rows || v.extent(1) != cols)
    return status::error(errc::shape_mismatch, "%s: %s is [%lld][%lld] but log_alpha is [%lld][%lld]", fn, name,
                         static_cast<long long>(v.extent(0)), static_cast<long long>(v.extent(1)),
                         static_cast<long long>(rows), static_cast<long long>(cols));
  return {};
}

template <class T>
status check_params(const char* fn, const hard_concrete_params<T>& p) {
  if (!(p.l < T(0)) || !(p.r > T(1)) || !(p.beta > T(0)) || p.l - p.l != T(0) || p.r - p.r != T(0) ||
      p.beta - p.beta != T(0))
    return status::error(errc::invalid_argument, "%s: hard-concrete parameters need l < 0, r > 1, beta > 0 (got %g, %g, %g)",
                         fn, static_cast<double>(p.l), static_cast<double>(p.r), static_cast<double>(p.beta));
  return {};
}

template <class T, class U>
status check_output(const char* fn, const char* name, const matrix_view<T>& out, const matrix_view<U>& in) {
  KVEVICT_TRY(check_view(fn, name, out));
  if (range_of(out).intersects(range_of(in)))
    return status::error(errc::overlap, "%s: %s overlaps log_alpha in memory", fn, name);
  return {};
}

/// The penalty functions' checks: log_alpha [L][H] not empty; grad (extent 0: not wanted) a valid
/// [L][H] output apart from log_alpha.
template <class T, class U>
status check_penalty_args(const char* fn, const char* grad_name, const matrix_view<U>& la, const matrix_view<T>& grad) {
  const index_t L = la.extent(0), H = la.extent(1);
  if (L * H == 0) return status::error(errc::invalid_argument, "%s: log_alpha is empty ([%lld][%lld])", fn,
                                       static_cast<long long>(L), static_cast<long long>(H));
  if (grad.extent(0) == 0) return {};
  KVEVICT_TRY(check_output(fn, grad_name, grad, la));
  return check_same_shape(fn, grad_name, L, H, grad);
}

}  // namespace detail

/// Batch hard-concrete sampling over a [layers][kv_heads] matrix: z = hard_concrete_sample(log_alpha, u)
/// and, when dz has rows, dz = dz/dlog_alpha. u must lie in [0, 1]; log_alpha must be finite.
/// Errors: invalid views, shape mismatches, NaN/inf log_alpha, u outside [0, 1] or NaN, bad params,
/// outputs overlapping inputs. Nothing is written on error.
template <class LA, class U, class T>
status prulong_sample_gates(matrix_view<LA> log_alpha_in, matrix_view<U> u_in, matrix_view<T> z, matrix_view<T> dz = {},
                            const hard_concrete_params<T>& p = {}) {
  static_assert(std::is_same_v<std::remove_const_t<LA>, T> && std::is_same_v<std::remove_const_t<U>, T> &&
                    std::is_floating_point_v<T>,
                "prulong_sample_gates: log_alpha, u and z must have the same floating-point type");
  constexpr const char* fn = "prulong_sample_gates";
  const matrix_view<const T> la = log_alpha_in, u = u_in;
  KVEVICT_TRY(detail::check_log_alpha(fn, la, false));
  KVEVICT_TRY(detail::check_params(fn, p));
  KVEVICT_TRY(detail::check_view(fn, "u", u));
  const index_t L = la.extent(0), H = la.extent(1);
  KVEVICT_TRY(detail::check_same_shape(fn, "u", L, H, u));
  KVEVICT_TRY(detail::check_output(fn, "z", z, la));
  KVEVICT_TRY(detail::check_same_shape(fn, "z", L, H, z));
  if (detail::range_of(z).intersects(detail::range_of(u)))
    return status::error(errc::overlap, "%s: z overlaps u in memory", fn);
  const bool want_dz = dz.extent(0) != 0;
  if (want_dz) {
    KVEVICT_TRY(detail::check_output(fn, "dz", dz, la));
    KVEVICT_TRY(detail::check_same_shape(fn, "dz", L, H, dz));
    if (detail::range_of(dz).intersects(detail::range_of(u)) || detail::range_of(dz).intersects(detail::range_of(z)))
      return status::error(errc::overlap, "%s: dz overlaps u or z in memory", fn);
  }
  for (index_t i = 0; i < L; ++i)
    for (index_t j = 0; j < H; ++j)
      if (!(u(i, j) >= T(0) && u(i, j) <= T(1)))
        return status::error(errc::invalid_argument, "%s: u[%lld][%lld] = %g is outside [0, 1]", fn,
                             static_cast<long long>(i), static_cast<long long>(j), static_cast<double>(u(i, j)));
  for (index_t i = 0; i < L; ++i)
    for (index_t j = 0; j < H; ++j) {
      z(i, j) = hard_concrete_sample(la(i, j), u(i, j), p);
      if (want_dz) dz(i, j) = hard_concrete_sample_grad(la(i, j), u(i, j), p);
    }
  return {};
}

/// Batch deterministic gates (hard_concrete_deterministic) over [layers][kv_heads]. log_alpha may
/// hold +-inf (gates 1 / 0) but not NaN.
template <class LA, class T>
status prulong_deterministic_gates(matrix_view<LA> log_alpha_in, matrix_view<T> z, const hard_concrete_params<T>& p = {}) {
  static_assert(std::is_same_v<std::remove_const_t<LA>, T> && std::is_floating_point_v<T>,
                "prulong_deterministic_gates: log_alpha and z must have the same floating-point type");
  constexpr const char* fn = "prulong_deterministic_gates";
  const matrix_view<const T> la = log_alpha_in;
  KVEVICT_TRY(detail::check_log_alpha(fn, la, true));
  KVEVICT_TRY(detail::check_params(fn, p));
  KVEVICT_TRY(detail::check_output(fn, "z", z, la));
  KVEVICT_TRY(detail::check_same_shape(fn, "z", la.extent(0), la.extent(1), z));
  for (index_t i = 0; i < la.extent(0); ++i)
    for (index_t j = 0; j < la.extent(1); ++j) z(i, j) = hard_concrete_deterministic(la(i, j), p);
  return {};
}

/// Expected sparsity (PruLong appendix B): the expected fraction of streaming heads,
///   s = 1 - (1 / (L H)) sum_{i,j} P(z_ij > 0),   P(z > 0) = sigmoid(log_alpha - beta log(-l/r))
/// over the [layers][kv_heads] log_alpha (one gate per KV head: a GQA group shares its gate, so
/// this equals the per-query-head mean PruLong's code takes). Summed in double, row-major order.
/// grad (when it has rows) receives ds/dlog_alpha_ij = -P (1 - P) / (L H). Errors: invalid views,
/// empty log_alpha, non-finite log_alpha, null s, bad params, grad shape or overlap.
template <class LA, class T = std::remove_const_t<LA>>
status prulong_expected_sparsity(matrix_view<LA> log_alpha_in, double* s,
                                 matrix_view<std::remove_const_t<LA>> grad = {},
                                 const hard_concrete_params<std::remove_const_t<LA>>& p = {}) {
  static_assert(std::is_floating_point_v<T>, "prulong_expected_sparsity: log_alpha must be floating point");
  constexpr const char* fn = "prulong_expected_sparsity";
  const matrix_view<const T> la = log_alpha_in;
  KVEVICT_TRY(detail::check_log_alpha(fn, la, false));
  KVEVICT_TRY(detail::check_params(fn, p));
  if (s == nullptr) return status::error(errc::null_pointer, "%s: s is null", fn);
  const index_t L = la.extent(0), H = la.extent(1), M = L * H;
  KVEVICT_TRY(detail::check_penalty_args(fn, "grad", la, grad));
  const bool want = grad.extent(0) != 0;
  double kept = 0.0;
  for (index_t i = 0; i < L; ++i)
    for (index_t j = 0; j < H; ++j) {
      kept += static_cast<double>(hard_concrete_expected_l0(la(i, j), p));
      if (want) grad(i, j) = static_cast<T>(-static_cast<double>(hard_concrete_expected_l0_grad(la(i, j), p)) /
                                            static_cast<double>(M));
    }
  *s = 1.0 - kept / static_cast<double>(M);
  return {};
}

/// The PruLong Lagrangian (Eq. 2/3): L_reg = lambda1 (s - t) + lambda2 (s - t)^2 with s the
/// expected sparsity above. Fills `out` (s, t, value, dL/ds, dL/dlambda1 = s - t,
/// dL/dlambda2 = (s - t)^2) and, when grad_log_alpha has rows, dL/dlog_alpha_ij =
/// (lambda1 + 2 lambda2 (s - t)) * ds/dlog_alpha_ij (overwritten, or added with opts.accumulate).
/// The multipliers start at 0 and take gradient *ascent* steps; log_alpha takes descent steps.
/// Errors: as prulong_expected_sparsity, plus t outside [0, 1] and non-finite lambdas.
template <class LA, class T = std::remove_const_t<LA>>
status prulong_lagrangian(matrix_view<LA> log_alpha_in, double target, double lambda1, double lambda2,
                          prulong_lagrangian_result* out, matrix_view<std::remove_const_t<LA>> grad_log_alpha = {},
                          prulong_grad_options opts = {}, const hard_concrete_params<std::remove_const_t<LA>>& p = {}) {
  static_assert(std::is_floating_point_v<T>, "prulong_lagrangian: log_alpha must be floating point");
  constexpr const char* fn = "prulong_lagrangian";
  const matrix_view<const T> la = log_alpha_in;
  if (out == nullptr) return status::error(errc::null_pointer, "%s: out is null", fn);
  if (!(target >= 0.0 && target <= 1.0))
    return status::error(errc::invalid_argument, "%s: target sparsity %g is outside [0, 1]", fn, target);
  if (!(lambda1 - lambda1 == 0.0) || !(lambda2 - lambda2 == 0.0))
    return status::error(errc::invalid_argument, "%s: lambda1 = %g and lambda2 = %g must be finite", fn, lambda1,
                         lambda2);
  KVEVICT_TRY(detail::check_log_alpha(fn, la, false));
  KVEVICT_TRY(detail::check_params(fn, p));
  const index_t L = la.extent(0), H = la.extent(1), M = L * H;
  KVEVICT_TRY(detail::check_penalty_args(fn, "grad_log_alpha", la, grad_log_alpha));
  const bool want = grad_log_alpha.extent(0) != 0;
  double s = 0.0;
  KVEVICT_TRY(prulong_expected_sparsity(la, &s, matrix_view<T>{}, p));
  const prulong_penalty pen = prulong_penalty_at(s, target, lambda1, lambda2);
  if (want)
    for (index_t i = 0; i < L; ++i)
      for (index_t j = 0; j < H; ++j) {
        const double ds = -static_cast<double>(hard_concrete_expected_l0_grad(la(i, j), p)) / static_cast<double>(M);
        const T g = static_cast<T>(pen.grad_sparsity * ds);
        if (opts.accumulate) grad_log_alpha(i, j) += g;
        else grad_log_alpha(i, j) = g;
      }
  out->sparsity = s;
  out->target = target;
  out->penalty = pen;
  return {};
}

/// Number of retrieval heads for a head sparsity: floor(heads * (1 - sparsity) + 1e-9), as
/// PruLong's int(M * (1 - sparsity)) but robust to representation error (10 heads at 0.9 keep 1,
/// where int(10 * (1 - 0.9)) = int(0.9999999999999998) = 0). Errors: heads < 0, sparsity outside [0, 1].
inline result<index_t> prulong_retrieval_heads(index_t heads, double sparsity) {
  if (heads < 0)
    return status::error(errc::invalid_argument, "prulong_retrieval_heads: heads is negative (%lld)",
                         static_cast<long long>(heads));
  if (!(sparsity >= 0.0 && sparsity <= 1.0))
    return status::error(errc::invalid_argument, "prulong_retrieval_heads: sparsity %g is outside [0, 1]", sparsity);
  const double k = std::floor(static_cast<double>(heads) * (1.0 - sparsity) + 1e-9);
  return k > static_cast<double>(heads) ? heads : static_cast<index_t>(k);
}

/// PruLong's final discretisation (appendix B): the k largest log_alpha become retrieval heads
/// (mask 1 = full KV cache) and the rest streaming heads (mask 0 = sink + recent window).
/// Ties: equal log_alpha -> the lower flattened index layer * H + head wins (-0.0 == +0.0);
/// +inf ranks above every finite value, -inf below. Exactly k ones are written. M is any
/// arithmetic type (std::uint8_t, int, float...). O((L H)^2) comparisons, no allocation.
/// Errors: invalid views, NaN log_alpha, k outside [0, L H], mask shape or overlap.
template <class LA, class M>
status prulong_topk_mask(matrix_view<LA> log_alpha_in, index_t k, matrix_view<M> mask) {
  static_assert(std::is_arithmetic_v<M>, "prulong_topk_mask: the mask type must be arithmetic");
  using T = std::remove_const_t<LA>;
  static_assert(std::is_floating_point_v<T>, "prulong_topk_mask: log_alpha must be floating point");
  constexpr const char* fn = "prulong_topk_mask";
  const matrix_view<const T> la = log_alpha_in;
  KVEVICT_TRY(detail::check_log_alpha(fn, la, true));
  const index_t L = la.extent(0), H = la.extent(1), total = L * H;
  if (k < 0 || k > total)
    return status::error(errc::invalid_argument, "%s: k = %lld is outside [0, %lld] heads", fn, static_cast<long long>(k),
                         static_cast<long long>(total));
  KVEVICT_TRY(detail::check_output(fn, "mask", mask, la));
  KVEVICT_TRY(detail::check_same_shape(fn, "mask", L, H, mask));
  for (index_t a = 0; a < total; ++a) {
    const T va = la(a / H, a % H);
    index_t rank = 0;  // heads that beat a
    for (index_t b = 0; b < total && rank < k; ++b) {
      const T vb = la(b / H, b % H);
      if (vb > va || (vb == va && b < a)) ++rank;
    }
    mask(a / H, a % H) = rank < k ? M(1) : M(0);
  }
  return {};
}

/// Binarise head-mask values (e.g. read from a TSV file): mask = value >= threshold ? 1 : 0, the
/// rule of DuoAttention's sparsify_attention_heads. Errors: invalid views, NaN values, non-finite
/// threshold, shape mismatch, overlap.
template <class V, class M>
status binarize_head_mask(matrix_view<V> values_in, double threshold, matrix_view<M> mask) {
  static_assert(std::is_arithmetic_v<M>, "binarize_head_mask: the mask type must be arithmetic");
  using T = std::remove_const_t<V>;
  constexpr const char* fn = "binarize_head_mask";
  const matrix_view<const T> v = values_in;
  KVEVICT_TRY(detail::check_view(fn, "values", v));
  if (!(threshold - threshold == 0.0))
    return status::error(errc::invalid_argument, "%s: threshold is not finite (%g)", fn, threshold);
  KVEVICT_TRY(detail::check_view(fn, "mask", mask));
  if (mask.extent(0) != v.extent(0) || mask.extent(1) != v.extent(1))
    return status::error(errc::shape_mismatch, "%s: mask is [%lld][%lld] but values are [%lld][%lld]", fn,
                         static_cast<long long>(mask.extent(0)), static_cast<long long>(mask.extent(1)),
                         static_cast<long long>(v.extent(0)), static_cast<long long>(v.extent(1)));
  if (detail::range_of(mask).intersects(detail::range_of(v)))
    return status::error(errc::overlap, "%s: mask overlaps values in memory", fn);
  for (index_t i = 0; i < v.extent(0); ++i)
    for (index_t j = 0; j < v.extent(1); ++j)
      if (static_cast<double>(v(i, j)) != static_cast<double>(v(i, j)))
        return status::error(errc::invalid_argument, "%s: values[%lld][%lld] is NaN", fn, static_cast<long long>(i),
                             static_cast<long long>(j));
  for (index_t i = 0; i < v.extent(0); ++i)
    for (index_t j = 0; j < v.extent(1); ++j) mask(i, j) = static_cast<double>(v(i, j)) >= threshold ? M(1) : M(0);
  return {};
}

// ---------------------------------------------------------------------------------------------
// Head-mask TSV files: DuoAttention's full_attention_heads.tsv and PruLong's masks*.tsv. One line
// per layer, one value per KV head separated by single tabs, each value in [0, 1] (1 = retrieval /
// full attention). A final newline is optional, "\r\n" line ends are accepted, spaces around a value
// are ignored, trailing blank lines are ignored; anything else that deviates is an error.

/// What to do with values outside [0, 1]. strict (default): an error. clip: clamp finite values
/// to [0, 1] as DuoAttention's loader (np.clip) does: its published patterns hold values such as
/// -9.6e-05 that only parse in this mode. NaN and +-inf are errors in both modes.
enum class head_mask_range { strict, clip };

struct head_mask_tsv_options {
  head_mask_range range = head_mask_range::strict;
};

namespace detail {

inline bool is_blank_line(const char* b, const char* e) {
  for (; b < e; ++b)
    if (*b != ' ' && *b != '\r') return false;
  return true;
}

/// Walks the TSV text; calls put(layer, head, value) for every value when `put` is non-null.
/// Returns the shape in *layers / *heads. Validates everything (numbers, range, rectangular).
template <class Put>
status walk_tsv(const char* fn, const char* text, std::size_t len, const head_mask_tsv_options& opts, index_t* layers,
                index_t* heads, Put&& put) {
  if (opts.range != head_mask_range::strict && opts.range != head_mask_range::clip)
    return status::error(errc::invalid_argument, "%s: unknown range option %d", fn, static_cast<int>(opts.range));
  if (text == nullptr && len > 0) return status::error(errc::null_pointer, "%s: text is null", fn);
  const char* p = text;
  const char* end = text + len;
  // ignore trailing blank lines
  const char* last = end;
  while (last > p) {
    const char* line_begin = last;
    while (line_begin > p && line_begin[-1] != '\n') --line_begin;
    if (!is_blank_line(line_begin, last)) break;
    last = line_begin > p ? line_begin - 1 : line_begin;  // drop the blank line and its '\n'
  }
  if (last == p) return status::error(errc::format_error, "%s: the head mask is empty (no layers)", fn);
  index_t layer = 0, width = -1;
  while (p < last) {
    const char* eol = static_cast<const char*>(std::memchr(p, '\n', static_cast<std::size_t>(last - p)));
    if (eol == nullptr) eol = last;
    const char* le = eol;
    if (le > p && le[-1] == '\r') --le;
    if (is_blank_line(p, le))
      return status::error(errc::format_error, "%s: line %lld is empty", fn, static_cast<long long>(layer + 1));
    index_t field = 0;
    const char* f = p;
    while (true) {
      const char* fe = static_cast<const char*>(std::memchr(f, '\t', static_cast<std::size_t>(le - f)));
      if (fe == nullptr) fe = le;
      const char* a = f;
      const char* b = fe;
      while (a < b && *a == ' ') ++a;
      while (b > a && b[-1] == ' ') --b;
      if (a == b)
        return status::error(errc::format_error, "%s: line %lld, value %lld is empty", fn,
                             static_cast<long long>(layer + 1), static_cast<long long>(field + 1));
      const char* num = a;
      if (*num == '+' && b - num > 1 && num[1] != '-' && num[1] != '+') ++num;  // from_chars rejects a leading '+'
      double v = 0.0;
      const auto res = std::from_chars(num, b, v, std::chars_format::general);
      if (res.ec != std::errc() || res.ptr != b) {
        // out-of-range magnitudes are numbers too, but far outside [0, 1]
        const bool huge = res.ec == std::errc::result_out_of_range && res.ptr == b;
        return status::error(huge ? errc::invalid_argument : errc::format_error,
                             "%s: line %lld, value %lld: \"%.*s\" is %s", fn, static_cast<long long>(layer + 1),
                             static_cast<long long>(field + 1), static_cast<int>(b - a > 40 ? 40 : b - a), a,
                             huge ? "outside [0, 1]" : "not a number");
      }
      if (v != v || v - v != 0.0)
        return status::error(errc::invalid_argument, "%s: line %lld, value %lld: \"%.*s\" is not finite", fn,
                             static_cast<long long>(layer + 1), static_cast<long long>(field + 1),
                             static_cast<int>(b - a > 40 ? 40 : b - a), a);
      if (v < 0.0 || v > 1.0) {
        if (opts.range == head_mask_range::strict)
          return status::error(errc::invalid_argument,
                               "%s: line %lld, value %lld: %g is outside [0, 1] (head_mask_range::clip accepts it)", fn,
                               static_cast<long long>(layer + 1), static_cast<long long>(field + 1), v);
        v = v < 0.0 ? 0.0 : 1.0;
      }
      if (width >= 0 && field >= width)
        return status::error(errc::shape_mismatch, "%s: line %lld has more than %lld values (line 1 has %lld)", fn,
                             static_cast<long long>(layer + 1), static_cast<long long>(width),
                             static_cast<long long>(width));
      put(layer, field, v);
      ++field;
      if (fe == le) break;
      f = fe + 1;
    }
    if (width < 0) width = field;
    else if (field != width)
      return status::error(errc::shape_mismatch, "%s: line %lld has %lld values but line 1 has %lld", fn,
                           static_cast<long long>(layer + 1), static_cast<long long>(field),
                           static_cast<long long>(width));
    ++layer;
    p = eol < last ? eol + 1 : last;
  }
  *layers = layer;
  *heads = width;
  return {};
}

}  // namespace detail

/// Shape of a head-mask TSV text: layers = lines, heads = values per line. Validates the whole text
/// exactly as parse_head_mask_tsv. Errors: format_error (empty text, empty line or value, not a
/// number), invalid_argument (value outside [0, 1] in strict mode, NaN/inf), shape_mismatch (ragged lines).
inline status head_mask_tsv_shape(const char* text, std::size_t len, index_t* layers, index_t* heads,
                                  const head_mask_tsv_options& opts = {}) {
  if (layers == nullptr || heads == nullptr)
    return status::error(errc::null_pointer, "head_mask_tsv_shape: layers or heads is null");
  return detail::walk_tsv("head_mask_tsv_shape", text, len, opts, layers, heads, [](index_t, index_t, double) {});
}

/// Parse a head-mask TSV text into values [layers][kv_heads] (the caller states the shape it
/// expects: the model's). The text is validated completely before anything is written. Errors: as
/// head_mask_tsv_shape, plus shape_mismatch when the file's shape is not the view's.
template <class T>
status parse_head_mask_tsv(const char* text, std::size_t len, matrix_view<T> values, const head_mask_tsv_options& opts = {}) {
  static_assert(std::is_floating_point_v<T>, "parse_head_mask_tsv: values must be floating point");
  constexpr const char* fn = "parse_head_mask_tsv";
  KVEVICT_TRY(detail::check_view(fn, "values", values));
  index_t L = 0, H = 0;
  KVEVICT_TRY(detail::walk_tsv(fn, text, len, opts, &L, &H, [](index_t, index_t, double) {}));
  if (L != values.extent(0) || H != values.extent(1))
    return status::error(errc::shape_mismatch, "%s: the file has %lld layers x %lld heads but %lld x %lld are expected",
                         fn, static_cast<long long>(L), static_cast<long long>(H),
                         static_cast<long long>(values.extent(0)), static_cast<long long>(values.extent(1)));
  return detail::walk_tsv(fn, text, len, opts, &L, &H,
                          [&](index_t i, index_t j, double v) { values(i, j) = static_cast<T>(v); });
}

/// Read a head-mask TSV file (see parse_head_mask_tsv). Errors: io_error when the file cannot be
/// opened or read, then as parse_head_mask_tsv (messages name the path).
template <class T>
status read_head_mask_tsv(const char* path, matrix_view<T> values, const head_mask_tsv_options& opts = {}) {
  if (path == nullptr) return status::error(errc::null_pointer, "read_head_mask_tsv: path is null");
  // a regular file of bounded size only: a FIFO would block the open, /dev/zero never ends
  std::error_code ec;
  const auto kind = std::filesystem::status(path, ec).type();
  if (kind != std::filesystem::file_type::not_found && kind != std::filesystem::file_type::regular)
    return status::error(errc::io_error, "read_head_mask_tsv: %s is not a regular file", path);
  constexpr std::size_t max_bytes = std::size_t(64) << 20;  // a mask of [layers][heads] values is tiny
  std::FILE* f = std::fopen(path, "rb");
  if (f == nullptr) return status::error(errc::io_error, "read_head_mask_tsv: cannot open %s", path);
  std::string text;
  char buf[4096];
  std::size_t got = 0;
  while (text.size() <= max_bytes && (got = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, got);
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  if (bad) return status::error(errc::io_error, "read_head_mask_tsv: error reading %s", path);
  if (text.size() > max_bytes)
    return status::error(errc::io_error, "read_head_mask_tsv: %s is larger than %zu bytes", path, max_bytes);
  status st = parse_head_mask_tsv(text.data(), text.size(), values, opts);
  if (!st.ok()) return status::error(st.code(), "%s (file %s)", st.message(), path);
  return st;
}

/// Format values [layers][kv_heads] as TSV text (appended to out): values printed with %.9g
/// (exact round trip of a float; 0 and 1 print as "0" and "1"), tabs between heads, '\n' after
/// each layer. Errors: invalid view, empty shape, values outside [0, 1] or NaN.
template <class V>
status format_head_mask_tsv(matrix_view<V> values_in, std::string& out) {
  using T = std::remove_const_t<V>;
  static_assert(std::is_arithmetic_v<T>, "format_head_mask_tsv: values must be arithmetic");
  constexpr const char* fn = "format_head_mask_tsv";
  const matrix_view<const T> v = values_in;
  KVEVICT_TRY(detail::check_view(fn, "values", v));
  if (v.extent(0) < 1 || v.extent(1) < 1)
    return status::error(errc::invalid_argument, "%s: a head mask needs at least one layer and one head ([%lld][%lld])",
                         fn, static_cast<long long>(v.extent(0)), static_cast<long long>(v.extent(1)));
  for (index_t i = 0; i < v.extent(0); ++i)
    for (index_t j = 0; j < v.extent(1); ++j) {
      const double x = static_cast<double>(v(i, j));
      if (!(x >= 0.0 && x <= 1.0))
        return status::error(errc::invalid_argument, "%s: values[%lld][%lld] = %g is outside [0, 1]", fn,
                             static_cast<long long>(i), static_cast<long long>(j), x);
    }
  char num[32];
  for (index_t i = 0; i < v.extent(0); ++i) {
    for (index_t j = 0; j < v.extent(1); ++j) {
      const int n = std::snprintf(num, sizeof num, "%.9g", static_cast<double>(v(i, j)));
      if (j > 0) out.push_back('\t');
      out.append(num, static_cast<std::size_t>(n));
    }
    out.push_back('\n');
  }
  return {};
}

/// Write values [layers][kv_heads] to a TSV file (format_head_mask_tsv). Nothing is created when
/// the values are invalid. Errors: as format_head_mask_tsv, io_error when the file cannot be written.
template <class V>
status write_head_mask_tsv(const char* path, matrix_view<V> values) {
  if (path == nullptr) return status::error(errc::null_pointer, "write_head_mask_tsv: path is null");
  std::string text;
  KVEVICT_TRY(format_head_mask_tsv(values, text));
  // written next to the destination, renamed into place only when complete: a failed write
  // (a full disk) leaves the previous file untouched and no partial file
  const std::string tmp = std::string(path) + ".kvevict-tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return status::error(errc::io_error, "write_head_mask_tsv: cannot open %s for writing", path);
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  std::error_code ec;
  if (ok && closed) std::filesystem::rename(tmp, path, ec);
  if (!ok || !closed || ec) {
    std::filesystem::remove(tmp, ec);
    return status::error(errc::io_error, "write_head_mask_tsv: error writing %s", path);
  }
  return {};
}

}  // namespace kvevict
