// kvevict/train/lookahead.hpp: the math of LookaheadKV (Ahn et al., "LookaheadKV: fast and accurate KV
// cache eviction by glimpsing into the future without generation"): Lookahead LoRA, the lookahead
// window scores of one head with their backward pass, and the KL / ListNet training loss with its
// exact gradient. These are building blocks for training and running LookaheadKV; no model code.
//
//   linear_forward(be, x, w, y)                              y = x W^T (llama2.c layout, W [out][in])
//   lora_linear_forward(be, x, w, adapter, rows, xa, y)      + (alpha/r)(x A) B on rows [begin, end)
//   lora_linear_backward(be, ws, x, w, adapter, rows, xa, dy, grad, dx)
//   lora_layer<T>                                            owns A, B, dA, dB and the saved x A
//   lookahead_window_scores(be, ws, q, k_prefix, k_block, s)           s_j = mean_i softmax_i(.)_j
//   lookahead_window_scores_backward(be, ws, q, k_prefix, k_block, ds, dq, dk_block)
//   lookahead_kl_loss(be, ws, gt, est, &loss[, grad_est])    mean_rows KL(norm(gt) || norm(est))
//
// Element type T is float or double everywhere (all arithmetic in T except the loss, which
// accumulates in double). Views are strided (matrix_view / vector_view), so any row-major,
// column-major or padded storage is used without copies. seq and par give bit-identical results:
// every output element is computed by one thread with a fixed summation order (documented per
// function). docs/lookahead.md has the formulas, defaults and deviations.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/base/real_math.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvevict {

/// Paper defaults (LookaheadKV §4.1): 32 lookahead tokens, LoRA rank 8, alpha 32 on every linear layer.
inline constexpr index_t lookahead_default_tokens = 32;
inline constexpr index_t lora_default_rank = 8;
inline constexpr double lora_default_alpha = 32.0;

/// Rows [begin, end) of a sequence: the lookahead tokens, on which the adapter is active.
struct row_range {
  index_t begin = 0;
  index_t end = 0;
  constexpr index_t size() const noexcept { return end - begin; }
};

/// The low-rank adapter of one linear layer, in the math convention of the paper's Eq. 4:
/// delta(x) = (alpha / r) * (x A) B with A [in][r] and B [r][out]. PEFT / nn.Linear storage
/// (lora_A.weight [r][in], lora_B.weight [out][r]) is viewed as A and B by swapping strides
/// (make the view with strides {1, in} and {1, r}); no copy is needed.
template <class T>
struct lora_adapter {
  matrix_view<const T> a;  ///< [in][r]
  matrix_view<const T> b;  ///< [r][out]
  T alpha = T(lora_default_alpha);
};

/// Gradients of an adapter, same shapes as A and B. Backward passes *add* into them.
template <class T>
struct lora_adapter_grad {
  matrix_view<T> da;  ///< [in][r]
  matrix_view<T> db;  ///< [r][out]
};

struct lora_backward_options {
  /// false: dx = gradient (overwrite); true: dx += gradient (e.g. summing the q, k and v projections).
  bool accumulate_dx = false;
};

/// Mean (default, the paper's MeanReduce) or sum of the attention over the query rows.
enum class lookahead_reduce { mean, sum };

struct lookahead_window_options {
  /// Logit scale; 0 means 1/sqrt(d) (the paper's softmax(QK^T / sqrt(d))). Must be finite.
  double scale = 0.0;
  lookahead_reduce reduce = lookahead_reduce::mean;
  /// Backward only. false: dq, dk_block = gradient; true: they accumulate (GQA groups sharing keys).
  bool accumulate = false;
};

/// kl: mean over rows of KL(p || q) (Eq. 5). listnet: mean over rows of the ListNet top-one
/// cross-entropy -sum_j p_j log q_j with phi = identity; it differs from kl by the mean entropy
/// of the targets, a constant, so the gradients are identical.
enum class lookahead_loss_kind { kl, listnet };

struct lookahead_loss_options {
  /// Smoothing: p = (gt/sum(gt) + eps) / (1 + N eps), and the same for q. Applied to both sides,
  /// so the loss is exactly 0 when est == gt, stays finite where est has zeros and is invariant
  /// to scaling either input. eps = 0 gives the paper's exact KL (then est must be > 0 wherever
  /// gt > 0). Must be finite and >= 0.
  double eps = 1e-8;
  lookahead_loss_kind kind = lookahead_loss_kind::kl;
};

namespace detail {

template <class T>
inline constexpr bool is_real_v = std::is_same_v<T, float> || std::is_same_v<T, double>;

/// The training math's element rule, one static_assert per function: T is float or double and
/// every input view's element type (In..., const or not) is T.
template <class T, class... In>
inline constexpr bool real_views_v = is_real_v<T> && (std::is_same_v<std::remove_const_t<In>, T> && ...);

template <class T>
KVEVICT_HOST_DEVICE inline bool finite_t(T x) {
  return x - x == T(0);  // false for NaN and +-inf, without <cmath> classification calls
}

/// sum_{i < n} a[i*sa] * b[i*sb], accumulated in T from 0 with i ascending. The only dot product
/// the LoRA layer uses, so adapter-free rows are bit-identical to linear_forward.
template <class T>
KVEVICT_HOST_DEVICE inline T dot_strided(const T* a, index_t sa, const T* b, index_t sb, index_t n) {
  T acc = T(0);
  for (index_t i = 0; i < n; ++i) acc += a[i * sa] * b[i * sb];
  return acc;
}

template <class T>
KVEVICT_HOST_DEVICE inline const T* row_of(const matrix_view<const T>& v, index_t r) {
  return v.data_handle() + r * v.stride(0);
}
template <class T>
KVEVICT_HOST_DEVICE inline T* row_of(const matrix_view<T>& v, index_t r) {
  return v.data_handle() + r * v.stride(0);
}

template <class T, class U>
bool overlaps(const matrix_view<T>& a, const matrix_view<U>& b) {
  return range_of(a).intersects(range_of(b));
}

inline status shape_error(const char* fn, const char* what, index_t got, index_t want) {
  return status::error(errc::shape_mismatch, "%s: %s is %lld but must be %lld", fn, what, static_cast<long long>(got),
                       static_cast<long long>(want));
}

template <class T>
status check_finite_matrix(const char* fn, const char* name, const matrix_view<const T>& v) {
  for (index_t i = 0; i < v.extent(0); ++i) {
    const T* r = row_of(v, i);
    for (index_t j = 0; j < v.extent(1); ++j)
      if (!finite_t(r[j * v.stride(1)]))
        return status::error(errc::invalid_argument, "%s: %s[%lld][%lld] is not finite (%g)", fn, name,
                             static_cast<long long>(i), static_cast<long long>(j),
                             static_cast<double>(r[j * v.stride(1)]));
  }
  return {};
}

/// Shapes, strides and overlap of the LoRA layer shared by forward and backward.
template <class T>
status check_lora_shapes(const char* fn, const matrix_view<const T>& x, const matrix_view<const T>& w,
                         const lora_adapter<T>& ad, row_range rows) {
  KVEVICT_TRY(check_view(fn, "x", x));
  KVEVICT_TRY(check_view(fn, "w", w));
  KVEVICT_TRY(check_view(fn, "adapter.a", ad.a));
  KVEVICT_TRY(check_view(fn, "adapter.b", ad.b));
  const index_t in = x.extent(1), out = w.extent(0);
  if (w.extent(1) != in) return shape_error(fn, "w.extent(1) (in features)", w.extent(1), in);
  if (ad.a.extent(0) != in) return shape_error(fn, "adapter.a.extent(0) (in features)", ad.a.extent(0), in);
  const index_t r = ad.a.extent(1);
  if (r < 1) return status::error(errc::invalid_argument, "%s: adapter rank must be >= 1 (a has %lld columns)", fn,
                                  static_cast<long long>(r));
  if (ad.b.extent(0) != r) return shape_error(fn, "adapter.b.extent(0) (rank)", ad.b.extent(0), r);
  if (ad.b.extent(1) != out) return shape_error(fn, "adapter.b.extent(1) (out features)", ad.b.extent(1), out);
  if (!finite_t(ad.alpha))
    return status::error(errc::invalid_argument, "%s: adapter.alpha is not finite (%g)", fn,
                         static_cast<double>(ad.alpha));
  if (rows.begin < 0 || rows.end < rows.begin || rows.end > x.extent(0))
    return status::error(errc::out_of_range, "%s: lookahead rows [%lld, %lld) are not inside [0, %lld)", fn,
                         static_cast<long long>(rows.begin), static_cast<long long>(rows.end),
                         static_cast<long long>(x.extent(0)));
  return {};
}

/// One output element of the LoRA layer: the plain dot product, plus (alpha/r) * (xa . B[:, o])
/// when xa_row is given. The plain part is the same expression whether or not the adapter is on.
template <class T>
KVEVICT_HOST_DEVICE inline T lora_output(const T* x_row, index_t x_stride, const T* w_row, index_t w_stride, index_t in,
                                         const T* xa_row, index_t xa_stride, const T* b_col, index_t b_stride,
                                         index_t rank, T scale) {
  const T base = dot_strided(x_row, x_stride, w_row, w_stride, in);
  if (xa_row == nullptr) return base;
  const T delta = dot_strided(xa_row, xa_stride, b_col, b_stride, rank);
  return base + scale * delta;
}

}  // namespace detail

/// Plain linear layer in the llama2.c layout: y[t][o] = sum_i x[t][i] * w[o][i] (W stored
/// [out][in], y = W x per token). Summation: from 0 in T, i ascending (see lora_linear_forward).
/// Shapes: x [n][in], w [out][in], y [n][out]. Errors: invalid views, shape mismatch, y
/// overlapping x or w. Parallel (par) over the n*out outputs.
template <class Backend, class X, class W, class T>
status linear_forward(Backend be, matrix_view<X> x_in, matrix_view<W> w_in, matrix_view<T> y) {
  static_assert(detail::real_views_v<T, X, W>,
                "linear_forward: x, w and y must have the same element type, float or double");
  constexpr const char* fn = "linear_forward";
  const matrix_view<const T> x = x_in, w = w_in;
  KVEVICT_TRY(detail::check_views(fn, "x", x, "w", w, "y", y));
  if (w.extent(1) != x.extent(1)) return detail::shape_error(fn, "w.extent(1) (in features)", w.extent(1), x.extent(1));
  if (y.extent(0) != x.extent(0)) return detail::shape_error(fn, "y.extent(0) (rows)", y.extent(0), x.extent(0));
  if (y.extent(1) != w.extent(0)) return detail::shape_error(fn, "y.extent(1) (out features)", y.extent(1), w.extent(0));
  if (detail::overlaps(y, x) || detail::overlaps(y, w))
    return status::error(errc::overlap, "%s: y overlaps x or w in memory", fn);
  const index_t in = x.extent(1), out = w.extent(0);
  detail::parallel_for(be, x.extent(0) * out, [&](index_t e) {
    const index_t t = e / out, o = e % out;
    y(t, o) = detail::lora_output<T>(detail::row_of(x, t), x.stride(1), detail::row_of(w, o), w.stride(1), in, nullptr,
                                     0, nullptr, 0, 0, T(0));
  });
  return {};
}

/// Lookahead LoRA forward (LookaheadKV Eq. 4), W in the llama2.c layout [out][in]:
///   rows t in [rows.begin, rows.end):  y[t] = x[t] W^T + (alpha / r) * (x[t] A) B
///   all other rows:                    y[t] = x[t] W^T, bit-identical to linear_forward
/// and xa[t - rows.begin] = x[t] A is stored for the backward pass (the caller owns it, as an
/// autograd framework owns saved activations).
/// Summation order of each output element, all in T: base = sum_i x[t][i] w[o][i] (from 0, i
/// ascending); xa[k] = sum_i x[t][i] A[i][k] (i ascending); delta = sum_k xa[k] B[k][o] (k
/// ascending); y = base + (alpha / r) * delta with alpha / r computed once in T.
/// Shapes: x [n][in], w [out][in], adapter.a [in][r] (r >= 1), adapter.b [r][out],
/// xa [rows.size()][r], y [n][out]. Errors: invalid views, shape mismatches, rows outside
/// [0, n), non-finite alpha, y or xa overlapping an input or each other.
template <class Backend, class X, class W, class T>
status lora_linear_forward(Backend be, matrix_view<X> x_in, matrix_view<W> w_in, const lora_adapter<T>& ad,
                           row_range rows, matrix_view<T> xa, matrix_view<T> y) {
  static_assert(detail::real_views_v<T, X, W>,
                "lora_linear_forward: x, w, the adapter and y must have the same element type, float or double");
  constexpr const char* fn = "lora_linear_forward";
  const matrix_view<const T> x = x_in, w = w_in;
  KVEVICT_TRY(detail::check_lora_shapes(fn, x, w, ad, rows));
  KVEVICT_TRY(detail::check_views(fn, "xa", xa, "y", y));
  const index_t n = x.extent(0), in = x.extent(1), out = w.extent(0), r = ad.a.extent(1), m = rows.size();
  if (xa.extent(0) != m) return detail::shape_error(fn, "xa.extent(0) (lookahead rows)", xa.extent(0), m);
  if (xa.extent(1) != r) return detail::shape_error(fn, "xa.extent(1) (rank)", xa.extent(1), r);
  if (y.extent(0) != n) return detail::shape_error(fn, "y.extent(0) (rows)", y.extent(0), n);
  if (y.extent(1) != out) return detail::shape_error(fn, "y.extent(1) (out features)", y.extent(1), out);
  if (detail::overlaps(y, x) || detail::overlaps(y, w) || detail::overlaps(y, ad.a) || detail::overlaps(y, ad.b))
    return status::error(errc::overlap, "%s: y overlaps x, w or the adapter in memory", fn);
  if (detail::overlaps(xa, x) || detail::overlaps(xa, w) || detail::overlaps(xa, ad.a) || detail::overlaps(xa, ad.b) ||
      detail::overlaps(xa, y))
    return status::error(errc::overlap, "%s: xa overlaps x, w, the adapter or y in memory", fn);

  // xa = x[rows] A
  detail::parallel_for(be, m * r, [&](index_t e) {
    const index_t t = e / r, k = e % r;
    xa(t, k) = detail::dot_strided(detail::row_of(x, rows.begin + t), x.stride(1), ad.a.data_handle() + k * ad.a.stride(1),
                                   ad.a.stride(0), in);
  });
  const T scale = ad.alpha / static_cast<T>(r);
  const matrix_view<const T> xac = xa;
  detail::parallel_for(be, n * out, [&](index_t e) {
    const index_t t = e / out, o = e % out;
    const bool on = t >= rows.begin && t < rows.end;
    y(t, o) = detail::lora_output<T>(detail::row_of(x, t), x.stride(1), detail::row_of(w, o), w.stride(1), in,
                                     on ? detail::row_of(xac, t - rows.begin) : nullptr, xac.stride(1),
                                     ad.b.data_handle() + o * ad.b.stride(1), ad.b.stride(0), r, scale);
  });
  return {};
}

/// Backward of lora_linear_forward for the lookahead rows (W frozen). With s = alpha / r,
/// dy [m][out] the gradient of y[rows] and xa the forward's saved x[rows] A:
///   dt = s * dy B^T                      [m][r]   (workspace scratch)
///   grad.db += s * xa^T dy               [r][out]
///   grad.da += x[rows]^T dt              [in][r]
///   dx  (=|+=) dy W + dt A^T             [m][in]  (a dx with 0 rows skips it)
/// Each element sums its terms from 0 in T, over the contracted index ascending (rows for da/db,
/// out features for dt and the dy W part of dx, then rank for the dt A^T part), scales once, and
/// then adds to the destination. Workspace: m * r elements of T (query with ws.data == nullptr).
/// Errors: as the forward, plus dy/xa/grad/dx shapes, outputs overlapping inputs or each other.
template <class Backend, class X, class W, class XA, class DY, class T>
status lora_linear_backward(Backend be, workspace& ws, matrix_view<X> x_in, matrix_view<W> w_in,
                            const lora_adapter<T>& ad, row_range rows, matrix_view<XA> xa_in, matrix_view<DY> dy_in,
                            const lora_adapter_grad<T>& grad, matrix_view<T> dx, lora_backward_options opts = {}) {
  static_assert(detail::real_views_v<T, X, W, XA, DY>,
                "lora_linear_backward: all views must have the same element type, float or double");
  constexpr const char* fn = "lora_linear_backward";
  const matrix_view<const T> x = x_in, w = w_in, xa = xa_in, dy = dy_in;
  KVEVICT_TRY(detail::check_lora_shapes(fn, x, w, ad, rows));
  KVEVICT_TRY(detail::check_views(fn, "xa", xa, "dy", dy, "grad.da", grad.da, "grad.db", grad.db));
  const bool want_dx = dx.extent(0) != 0;  // a default-constructed view means "not needed"
  if (want_dx) KVEVICT_TRY(detail::check_view(fn, "dx", dx));
  const index_t in = x.extent(1), out = w.extent(0), r = ad.a.extent(1), m = rows.size();
  if (xa.extent(0) != m) return detail::shape_error(fn, "xa.extent(0) (lookahead rows)", xa.extent(0), m);
  if (xa.extent(1) != r) return detail::shape_error(fn, "xa.extent(1) (rank)", xa.extent(1), r);
  if (dy.extent(0) != m) return detail::shape_error(fn, "dy.extent(0) (lookahead rows)", dy.extent(0), m);
  if (dy.extent(1) != out) return detail::shape_error(fn, "dy.extent(1) (out features)", dy.extent(1), out);
  if (grad.da.extent(0) != in || grad.da.extent(1) != r)
    return status::error(errc::shape_mismatch, "%s: grad.da is [%lld][%lld] but must be [%lld][%lld] like adapter.a",
                         fn, static_cast<long long>(grad.da.extent(0)), static_cast<long long>(grad.da.extent(1)),
                         static_cast<long long>(in), static_cast<long long>(r));
  if (grad.db.extent(0) != r || grad.db.extent(1) != out)
    return status::error(errc::shape_mismatch, "%s: grad.db is [%lld][%lld] but must be [%lld][%lld] like adapter.b",
                         fn, static_cast<long long>(grad.db.extent(0)), static_cast<long long>(grad.db.extent(1)),
                         static_cast<long long>(r), static_cast<long long>(out));
  if (want_dx && (dx.extent(0) != m || dx.extent(1) != in))
    return status::error(errc::shape_mismatch, "%s: dx is [%lld][%lld] but must be [%lld][%lld] (or have 0 rows)", fn,
                         static_cast<long long>(dx.extent(0)), static_cast<long long>(dx.extent(1)),
                         static_cast<long long>(m), static_cast<long long>(in));
  // outputs must not overlap any input nor each other
  const detail::byte_range outs[3] = {detail::range_of(grad.da), detail::range_of(grad.db), detail::range_of(dx)};
  const char* out_names[3] = {"grad.da", "grad.db", "dx"};
  const detail::byte_range ins[6] = {detail::range_of(x),    detail::range_of(w),  detail::range_of(ad.a),
                                     detail::range_of(ad.b), detail::range_of(xa), detail::range_of(dy)};
  for (int i = 0; i < 3; ++i) {
    for (const auto& rin : ins)
      if (outs[i].intersects(rin))
        return status::error(errc::overlap, "%s: %s overlaps an input (x, w, adapter, xa or dy)", fn, out_names[i]);
    for (int j = 0; j < i; ++j)
      if (outs[i].intersects(outs[j]))
        return status::error(errc::overlap, "%s: %s and %s overlap in memory", fn, out_names[i], out_names[j]);
  }

  detail::workspace_carver carver(ws);
  T* dt = carver.take<T>(static_cast<std::size_t>(m * r));
  if (auto st = carver.finish(fn); !st.ok() || ws.is_query()) return st;
  const detail::byte_range touched[] = {outs[0], outs[1], outs[2], ins[0], ins[1], ins[2], ins[3], ins[4], ins[5]};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"grad.da", "grad.db", "dx", "x", "w", "adapter.a", "adapter.b", "xa", "dy"}));

  if (m == 0) return {};  // no lookahead rows: every gradient term is empty
  const T scale = ad.alpha / static_cast<T>(r);
  // dt[t][k] = s * sum_o dy[t][o] B[k][o]
  detail::parallel_for(be, m * r, [&](index_t e) {
    const index_t t = e / r, k = e % r;
    dt[e] = scale * detail::dot_strided(detail::row_of(dy, t), dy.stride(1), detail::row_of(ad.b, k), ad.b.stride(1), out);
  });
  // db[k][o] += s * sum_t xa[t][k] dy[t][o]
  detail::parallel_for(be, r * out, [&](index_t e) {
    const index_t k = e / out, o = e % out;
    grad.db(k, o) += scale * detail::dot_strided(xa.data_handle() + k * xa.stride(1), xa.stride(0),
                                                 dy.data_handle() + o * dy.stride(1), dy.stride(0), m);
  });
  // da[i][k] += sum_t x[rows.begin + t][i] dt[t][k]
  detail::parallel_for(be, in * r, [&](index_t e) {
    const index_t i = e / r, k = e % r;
    grad.da(i, k) += detail::dot_strided(detail::row_of(x, rows.begin) + i * x.stride(1), x.stride(0), dt + k, r, m);
  });
  if (want_dx) {
    // dx[t][i] = sum_o dy[t][o] w[o][i] + sum_k dt[t][k] A[i][k]
    detail::parallel_for(be, m * in, [&](index_t e) {
      const index_t t = e / in, i = e % in;
      const T g = detail::dot_strided(detail::row_of(dy, t), dy.stride(1), w.data_handle() + i * w.stride(1),
                                      w.stride(0), out) +
                  detail::dot_strided(dt + t * r, index_t(1), detail::row_of(ad.a, i), ad.a.stride(1), r);
      if (opts.accumulate_dx) dx(t, i) += g;
      else dx(t, i) = g;
    });
  }
  return {};
}

/// A Lookahead LoRA adapter that owns its parameters, their gradients and the activation saved by
/// the forward pass: one object per adapted linear layer (q, k, v, o, w1, w2, w3 of every layer).
/// The frozen W stays the caller's. init() allocates (once); forward/backward do not, except that
/// the saved activation grows to the largest lookahead block seen (reserve it with max_rows).
///
///   kvevict::lora_layer<float> q_lora;
///   q_lora.init(dim, dim, 8, 32.f, /*max_rows=*/32, /*seed=*/1);   // A ~ U(+-1/sqrt(in)), B = 0
///   q_lora.forward(be, x, wq, rows, q);                            // saves x[rows] A
///   ... q_lora.backward(be, ws, x, wq, rows, dq_rows, dx_rows);    // dA, dB accumulate
///   optimizer step on q_lora.a() / q_lora.b() with q_lora.da() / q_lora.db(); q_lora.zero_grad();
template <class T = float>
class lora_layer {
  static_assert(detail::is_real_v<T>, "lora_layer: element type must be float or double");

 public:
  /// Shapes and PEFT's initialisation: A uniform in [-1/sqrt(in), 1/sqrt(in)] (kaiming_uniform
  /// with a = sqrt(5), as nn.Linear and PEFT do) from a SplitMix64 stream seeded with `seed`
  /// (identical on every platform), B = 0, so the adapter starts as the identity. Gradients 0.
  /// Errors: in, out or rank < 1, max_rows < 0, non-finite alpha.
  status init(index_t in, index_t out, index_t rank, T alpha = T(lora_default_alpha), index_t max_rows = 0,
              std::uint64_t seed = 0) {
    if (in < 1 || out < 1 || rank < 1)
      return status::error(errc::invalid_argument, "lora_layer::init: in (%lld), out (%lld) and rank (%lld) must be >= 1",
                           static_cast<long long>(in), static_cast<long long>(out), static_cast<long long>(rank));
    if (max_rows < 0)
      return status::error(errc::invalid_argument, "lora_layer::init: max_rows is negative (%lld)",
                           static_cast<long long>(max_rows));
    if (!detail::finite_t(alpha))
      return status::error(errc::invalid_argument, "lora_layer::init: alpha is not finite (%g)", static_cast<double>(alpha));
    index_t na = 0, nb = 0;
    if (!detail::checked_mul(in, rank, na) || !detail::checked_mul(rank, out, nb))
      return status::error(errc::size_overflow, "lora_layer::init: in x rank or rank x out overflows");
    in_ = in;
    out_ = out;
    rank_ = rank;
    alpha_ = alpha;
    a_.assign(static_cast<std::size_t>(na), T(0));
    b_.assign(static_cast<std::size_t>(nb), T(0));
    da_.assign(a_.size(), T(0));
    db_.assign(b_.size(), T(0));
    xa_.assign(static_cast<std::size_t>(max_rows * rank), T(0));
    saved_ = {0, -1};
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    std::uint64_t state = seed;
    for (T& v : a_) {
      // SplitMix64 (Steele, Lea, Flood 2014), 53 bits -> [0, 1) -> [-bound, bound)
      std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      const double u01 = static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
      v = static_cast<T>((2.0 * u01 - 1.0) * bound);
    }
    return {};
  }

  index_t in_features() const noexcept { return in_; }
  index_t out_features() const noexcept { return out_; }
  index_t rank() const noexcept { return rank_; }
  T alpha() const noexcept { return alpha_; }
  /// Trainable parameters (the optimizer updates them in place) and their gradients.
  matrix_view<T> a() noexcept { return view(a_, in_, rank_); }
  matrix_view<T> b() noexcept { return view(b_, rank_, out_); }
  matrix_view<T> da() noexcept { return view(da_, in_, rank_); }
  matrix_view<T> db() noexcept { return view(db_, rank_, out_); }
  lora_adapter<T> adapter() const noexcept { return {cview(a_, in_, rank_), cview(b_, rank_, out_), alpha_}; }
  lora_adapter_grad<T> grad() noexcept { return {da(), db()}; }
  void zero_grad() noexcept {
    for (T& v : da_) v = T(0);
    for (T& v : db_) v = T(0);
  }

  /// lora_linear_forward with this adapter; saves x[rows] A for backward (the saved rows are
  /// remembered: backward must use the same range). Errors: not initialised, then as
  /// lora_linear_forward.
  template <class Backend, class X, class W>
  status forward(Backend be, matrix_view<X> x, matrix_view<W> w, row_range rows, matrix_view<T> y) {
    if (rank_ == 0) return status::error(errc::invalid_argument, "lora_layer::forward: init() was not called");
    saved_ = {0, -1};
    if (rows.begin < 0 || rows.end < rows.begin || rows.end > x.extent(0))  // report before growing anything
      return lora_linear_forward(be, x, w, adapter(), rows, view(xa_, 0, rank_), y);
    const index_t m = rows.size();
    if (static_cast<std::size_t>(m * rank_) > xa_.size()) xa_.resize(static_cast<std::size_t>(m * rank_));
    KVEVICT_TRY(lora_linear_forward(be, x, w, adapter(), rows, view(xa_, m, rank_), y));
    saved_ = rows;
    return {};
  }

  /// lora_linear_backward with the activation saved by the last successful forward (same rows).
  /// dA and dB accumulate; dx as lora_linear_backward (a view with 0 rows skips it).
  /// Errors: no forward saved for these rows, then as lora_linear_backward.
  template <class Backend, class X, class W, class DY>
  status backward(Backend be, workspace& ws, matrix_view<X> x, matrix_view<W> w, row_range rows, matrix_view<DY> dy,
                  matrix_view<T> dx, lora_backward_options opts = {}) {
    if (rank_ == 0) return status::error(errc::invalid_argument, "lora_layer::backward: init() was not called");
    if (saved_.end < saved_.begin || saved_.begin != rows.begin || saved_.end != rows.end)
      return status::error(errc::invalid_argument,
                           "lora_layer::backward: rows [%lld, %lld) were not the last forward's lookahead rows",
                           static_cast<long long>(rows.begin), static_cast<long long>(rows.end));
    return lora_linear_backward(be, ws, x, w, adapter(), rows, cview(xa_, rows.size(), rank_), dy, grad(), dx, opts);
  }

 private:
  static matrix_view<T> view(std::vector<T>& v, index_t r, index_t c) noexcept {
    using exts = cuda::std::dextents<index_t, 2>;
    return matrix_view<T>(v.empty() ? nullptr : v.data(),
                          cuda::std::layout_stride::mapping<exts>(exts(r, c), cuda::std::array<index_t, 2>{c > 0 ? c : 1, 1}));
  }
  static matrix_view<const T> cview(const std::vector<T>& v, index_t r, index_t c) noexcept {
    using exts = cuda::std::dextents<index_t, 2>;
    return matrix_view<const T>(
        v.empty() ? nullptr : v.data(),
        cuda::std::layout_stride::mapping<exts>(exts(r, c), cuda::std::array<index_t, 2>{c > 0 ? c : 1, 1}));
  }

  index_t in_ = 0, out_ = 0, rank_ = 0;
  T alpha_ = T(lora_default_alpha);
  std::vector<T> a_, b_, da_, db_, xa_;
  row_range saved_{0, -1};  ///< rows of the saved activation; end < begin: nothing saved
};

namespace detail {

/// Shapes and values of one head's window-score problem.
template <class T>
status check_window(const char* fn, const matrix_view<const T>& q, const matrix_view<const T>& kp,
                    const matrix_view<const T>& kb, const lookahead_window_options& opts) {
  KVEVICT_TRY(check_view(fn, "q", q));
  KVEVICT_TRY(check_view(fn, "k_prefix", kp));
  KVEVICT_TRY(check_view(fn, "k_block", kb));
  const index_t d = q.extent(1);
  if (kp.extent(1) != d) return shape_error(fn, "k_prefix.extent(1) (head dim)", kp.extent(1), d);
  if (kb.extent(1) != d) return shape_error(fn, "k_block.extent(1) (head dim)", kb.extent(1), d);
  if (kb.extent(0) != q.extent(0)) return shape_error(fn, "k_block.extent(0) (block rows)", kb.extent(0), q.extent(0));
  if (!(opts.scale - opts.scale == 0.0))
    return status::error(errc::invalid_argument, "%s: scale is not finite (%g)", fn, opts.scale);
  if (opts.reduce != lookahead_reduce::mean && opts.reduce != lookahead_reduce::sum)
    return status::error(errc::invalid_argument, "%s: unknown reduce value %d", fn, static_cast<int>(opts.reduce));
  KVEVICT_TRY(check_finite_matrix(fn, "q", q));
  KVEVICT_TRY(check_finite_matrix(fn, "k_prefix", kp));
  KVEVICT_TRY(check_finite_matrix(fn, "k_block", kb));
  return {};
}

template <class T>
T window_scale(const lookahead_window_options& opts, index_t d) {
  if (opts.scale != 0.0) return static_cast<T>(opts.scale);
  return d > 0 ? T(1) / sqrt_t(static_cast<T>(d)) : T(1);
}

/// Row i of the block's attention, stored in probs[0 .. P + n): softmax over the P prefix logits
/// and the causal block logits l <= i (columns P + l, l > i hold 0). In T: logits c * (q_i . k),
/// max subtracted, exp, summed prefix-then-block ascending, divided by the sum.
template <class T>
KVEVICT_HOST_DEVICE inline void window_softmax_row(const T* qi, index_t qs, const T* kp, index_t kp_rs, index_t kp_cs,
                                                   index_t P, const T* kb, index_t kb_rs, index_t kb_cs, index_t i,
                                                   index_t n, index_t d, T c, T* probs) {
  T mx = T(0);
  for (index_t j = 0; j < P + i + 1; ++j) {
    const T* kj = j < P ? kp + j * kp_rs : kb + (j - P) * kb_rs;
    const index_t ks = j < P ? kp_cs : kb_cs;
    const T l = c * dot_strided(qi, qs, kj, ks, d);
    probs[j] = l;
    if (j == 0 || l > mx) mx = l;
  }
  T z = T(0);
  for (index_t j = 0; j < P + i + 1; ++j) {
    probs[j] = exp_t(probs[j] - mx);
    z += probs[j];
  }
  for (index_t j = 0; j < P + i + 1; ++j) probs[j] /= z;
  for (index_t j = P + i + 1; j < P + n; ++j) probs[j] = T(0);
}

template <class Backend, class T>
void window_probs(Backend be, const matrix_view<const T>& q, const matrix_view<const T>& kp,
                  const matrix_view<const T>& kb, T c, T* probs) {
  const index_t n = q.extent(0), P = kp.extent(0), d = q.extent(1), width = P + n;
  parallel_for(be, n, [&](index_t i) {
    window_softmax_row(row_of(q, i), q.stride(1), kp.data_handle(), kp.stride(0), kp.stride(1), P, kb.data_handle(),
                       kb.stride(0), kb.stride(1), i, n, d, c, probs + i * width);
  });
}

}  // namespace detail

/// Lookahead window scores of one head (LookaheadKV §3.1, Algorithm 2 lines 6-8; the SnapKV window
/// score when the block is the prompt's suffix): with n block queries q [n][d], prompt keys
/// k_prefix [P][d] and the block's own keys k_block [n][d] (all post-RoPE),
///   A_i = softmax(c * q_i . [k_prefix ; k_block[0..i]])   (causal inside the block, fp32/T)
///   s[j] = (1/n) sum_i A_i[j]  for prefix columns j < P  (reduce = sum drops the 1/n)
/// c = opts.scale or 1/sqrt(d). s sums rows i ascending, then divides by n; n = 0 gives s = 0.
/// Workspace: n * (P + n) elements of T (the block's attention rows, the paper's appendix C
/// memory O(|X||Y| + |Y|^2)). Errors: invalid views, shape mismatches, non-finite q/k/scale,
/// s overlapping an input, workspace too small. Parallel (par) over rows, then over columns.
template <class Backend, class Q, class KP, class KB, class T>
status lookahead_window_scores(Backend be, workspace& ws, matrix_view<Q> q_in, matrix_view<KP> kp_in,
                               matrix_view<KB> kb_in, vector_view<T> s, const lookahead_window_options& opts = {}) {
  static_assert(detail::real_views_v<T, Q, KP, KB>,
                "lookahead_window_scores: all views must have the same element type, float or double");
  constexpr const char* fn = "lookahead_window_scores";
  const matrix_view<const T> q = q_in, kp = kp_in, kb = kb_in;
  KVEVICT_TRY(detail::check_window(fn, q, kp, kb, opts));
  KVEVICT_TRY(detail::check_view(fn, "s", s));
  const index_t n = q.extent(0), P = kp.extent(0), width = P + n;
  if (s.extent(0) != P) return detail::shape_error(fn, "s.extent(0) (prefix tokens)", s.extent(0), P);
  const auto sr = detail::range_of(s);
  if (sr.intersects(detail::range_of(q)) || sr.intersects(detail::range_of(kp)) || sr.intersects(detail::range_of(kb)))
    return status::error(errc::overlap, "%s: s overlaps q or the keys in memory", fn);
  detail::workspace_carver carver(ws);
  T* probs = carver.take<T>(static_cast<std::size_t>(n * width));
  if (auto st = carver.finish(fn); !st.ok() || ws.is_query()) return st;
  const detail::byte_range touched[] = {sr, detail::range_of(q), detail::range_of(kp), detail::range_of(kb)};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"s", "q", "k_prefix", "k_block"}));

  const T c = detail::window_scale<T>(opts, q.extent(1));
  detail::window_probs(be, q, kp, kb, c, probs);
  const bool mean = opts.reduce == lookahead_reduce::mean;
  detail::parallel_for(be, P, [&](index_t j) {
    T acc = T(0);
    for (index_t i = 0; i < n; ++i) acc += probs[i * width + j];
    s(j) = mean && n > 0 ? acc / static_cast<T>(n) : acc;
  });
  return {};
}

/// Backward of lookahead_window_scores for one head: given ds [P] = dL/ds, returns the gradients
/// of L w.r.t. the block queries (dq [n][d]) and the block's own keys (dk_block [n][d]); the
/// prompt keys are fixed (no gradient). With dA_ij = ds_j / n (mean; ds_j for sum) on prefix
/// columns and 0 on block columns, mu_i = sum_{j<P} A_ij dA_ij, and the softmax backward
/// dz_ij = A_ij (dA_ij - mu_i):
///   dq_i       = c * (sum_{j<P} dz_ij k_prefix_j + sum_{l<=i} dz_{i,P+l} k_block_l)
///   dk_block_l = c * sum_{i>=l} dz_{i,P+l} q_i
/// Summation: mu_i over j ascending; dq over prefix columns then block columns ascending; dk_block
/// over i ascending; each in T from 0, multiplied by c last. opts.accumulate adds into dq and
/// dk_block instead of overwriting (e.g. the query heads of a GQA group share k_block).
/// Workspace: n * (P + n) + 2 * n * d elements of T. Errors: as the forward, plus ds/dq/dk_block
/// shapes and outputs overlapping inputs or each other.
template <class Backend, class Q, class KP, class KB, class DS, class T>
status lookahead_window_scores_backward(Backend be, workspace& ws, matrix_view<Q> q_in, matrix_view<KP> kp_in,
                                        matrix_view<KB> kb_in, vector_view<DS> ds_in, matrix_view<T> dq,
                                        matrix_view<T> dkb, const lookahead_window_options& opts = {}) {
  static_assert(detail::real_views_v<T, Q, KP, KB, DS>,
                "lookahead_window_scores_backward: all views must have the same element type, float or double");
  constexpr const char* fn = "lookahead_window_scores_backward";
  const matrix_view<const T> q = q_in, kp = kp_in, kb = kb_in;
  const vector_view<const T> ds = ds_in;
  KVEVICT_TRY(detail::check_window(fn, q, kp, kb, opts));
  KVEVICT_TRY(detail::check_views(fn, "ds", ds, "dq", dq, "dk_block", dkb));
  const index_t n = q.extent(0), P = kp.extent(0), d = q.extent(1), width = P + n;
  if (ds.extent(0) != P) return detail::shape_error(fn, "ds.extent(0) (prefix tokens)", ds.extent(0), P);
  if (dq.extent(0) != n || dq.extent(1) != d)
    return status::error(errc::shape_mismatch, "%s: dq is [%lld][%lld] but must be [%lld][%lld] like q", fn,
                         static_cast<long long>(dq.extent(0)), static_cast<long long>(dq.extent(1)),
                         static_cast<long long>(n), static_cast<long long>(d));
  if (dkb.extent(0) != n || dkb.extent(1) != d)
    return status::error(errc::shape_mismatch, "%s: dk_block is [%lld][%lld] but must be [%lld][%lld] like k_block", fn,
                         static_cast<long long>(dkb.extent(0)), static_cast<long long>(dkb.extent(1)),
                         static_cast<long long>(n), static_cast<long long>(d));
  for (index_t j = 0; j < P; ++j)
    if (!detail::finite_t(ds(j)))
      return status::error(errc::invalid_argument, "%s: ds[%lld] is not finite (%g)", fn, static_cast<long long>(j),
                           static_cast<double>(ds(j)));
  const detail::byte_range ins[4] = {detail::range_of(q), detail::range_of(kp), detail::range_of(kb),
                                     detail::range_of(ds)};
  for (const auto& rin : ins) {
    if (detail::range_of(dq).intersects(rin)) return status::error(errc::overlap, "%s: dq overlaps an input", fn);
    if (detail::range_of(dkb).intersects(rin)) return status::error(errc::overlap, "%s: dk_block overlaps an input", fn);
  }
  if (detail::overlaps(dq, dkb)) return status::error(errc::overlap, "%s: dq and dk_block overlap in memory", fn);

  detail::workspace_carver carver(ws);
  T* probs = carver.take<T>(static_cast<std::size_t>(n * width));
  T* gq = carver.take<T>(static_cast<std::size_t>(n * d));
  T* gk = carver.take<T>(static_cast<std::size_t>(n * d));
  if (auto st = carver.finish(fn); !st.ok() || ws.is_query()) return st;
  const detail::byte_range touched[] = {detail::range_of(dq), detail::range_of(dkb), ins[0], ins[1], ins[2], ins[3]};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"dq", "dk_block", "q", "k_prefix", "k_block", "ds"}));

  const T c = detail::window_scale<T>(opts, d);
  detail::window_probs(be, q, kp, kb, c, probs);
  const T inv = opts.reduce == lookahead_reduce::mean && n > 0 ? T(1) / static_cast<T>(n) : T(1);
  // probs row i -> dz row i (in place)
  detail::parallel_for(be, n, [&](index_t i) {
    T* a = probs + i * width;
    T mu = T(0);
    for (index_t j = 0; j < P; ++j) mu += a[j] * (ds(j) * inv);
    for (index_t j = 0; j < P; ++j) a[j] = a[j] * (ds(j) * inv - mu);
    for (index_t l = 0; l <= i; ++l) a[P + l] = -a[P + l] * mu;
  });
  // gq[i][:] = sum_j dz_ij k_j  (prefix columns, then block columns l <= i)
  detail::parallel_for(be, n, [&](index_t i) {
    const T* dz = probs + i * width;
    T* g = gq + i * d;
    for (index_t t = 0; t < d; ++t) g[t] = T(0);
    for (index_t j = 0; j < P + i + 1; ++j) {
      const T* kj = j < P ? detail::row_of(kp, j) : detail::row_of(kb, j - P);
      const index_t ks = j < P ? kp.stride(1) : kb.stride(1);
      for (index_t t = 0; t < d; ++t) g[t] += dz[j] * kj[t * ks];
    }
  });
  // gk[l][:] = sum_{i >= l} dz_{i, P + l} q_i
  detail::parallel_for(be, n, [&](index_t l) {
    T* g = gk + l * d;
    for (index_t t = 0; t < d; ++t) g[t] = T(0);
    for (index_t i = l; i < n; ++i) {
      const T dz = probs[i * width + P + l];
      const T* qi = detail::row_of(q, i);
      for (index_t t = 0; t < d; ++t) g[t] += dz * qi[t * q.stride(1)];
    }
  });
  detail::parallel_for(be, n, [&](index_t i) {
    for (index_t t = 0; t < d; ++t) {
      const T a = c * gq[i * d + t], b = c * gk[i * d + t];
      if (opts.accumulate) {
        dq(i, t) += a;
        dkb(i, t) += b;
      } else {
        dq(i, t) = a;
        dkb(i, t) = b;
      }
    }
  });
  return {};
}

namespace detail {

/// Row r of the loss: p = (g/G + eps)/(1 + N eps), q likewise; returns KL(p||q) or -sum p log q.
/// Sums in double with j ascending; terms with p_j == 0 contribute 0.
template <class T>
inline double loss_row(const T* g, index_t gs, const T* e, index_t es, index_t N, double G, double E, double eps,
                       lookahead_loss_kind kind) {
  const double den = 1.0 + static_cast<double>(N) * eps;
  double acc = 0.0;
  for (index_t j = 0; j < N; ++j) {
    const double p = (static_cast<double>(g[j * gs]) / G + eps) / den;
    if (p == 0.0) continue;
    const double q = (static_cast<double>(e[j * es]) / E + eps) / den;
    acc += kind == lookahead_loss_kind::kl ? p * (std::log(p) - std::log(q)) : -p * std::log(q);
  }
  return acc;
}

}  // namespace detail

/// LookaheadKV training loss (Eq. 5, Algorithm 1 lines 16-20) over R = L*H rows of N prompt
/// positions (one row per layer and head, any order; the caller flattens [L][H] into rows):
///   loss = (1/R) sum_r KL(p_r || q_r),  p = norm(gt_r), q = norm(est_r)
/// with norm(s) = (s / sum(s) + eps) / (1 + N eps) (see lookahead_loss_options: eps = 0 is the
/// paper's exact normalisation). kind = listnet returns (1/R) sum_r -sum_j p_j log q_j instead.
/// Gradient w.r.t. the raw estimate (through the normalisation), written to grad_est when it has
/// rows (a view with 0 rows skips it):
///   dloss/dest_rk = (sum_j w_j qhat_j - w_k) / (R * E_r * (1 + N eps)),  w_j = p_j / q_j,
///   qhat = est_r / E_r, E_r = sum(est_r)     (eps = 0: (1 - p_k / q_k) / (R * E_r))
/// Inputs must be finite and >= 0; every gt and est row must have a positive sum; with eps = 0,
/// est must be positive wherever gt is. Sums run in double over j ascending; the row losses are
/// added in row order, so seq and par return the same bits. Workspace: 2 * R doubles.
/// Errors: invalid views, shape mismatch, negative / non-finite / zero-sum inputs, bad eps or
/// kind, null loss, grad_est overlapping an input, workspace too small.
template <class Backend, class GT, class ET, class T>
status lookahead_kl_loss(Backend be, workspace& ws, matrix_view<GT> gt_in, matrix_view<ET> est_in, double* loss,
                         matrix_view<T> grad_est, const lookahead_loss_options& opts = {}) {
  static_assert(detail::real_views_v<T, GT, ET>,
                "lookahead_kl_loss: gt, est and grad_est must have the same element type, float or double");
  constexpr const char* fn = "lookahead_kl_loss";
  const matrix_view<const T> gt = gt_in, est = est_in;
  KVEVICT_TRY(detail::check_views(fn, "gt", gt, "est", est));
  const bool want_grad = grad_est.extent(0) != 0;  // a default-constructed view means "not needed"
  if (want_grad) KVEVICT_TRY(detail::check_view(fn, "grad_est", grad_est));
  if (loss == nullptr) return status::error(errc::null_pointer, "%s: loss is null", fn);
  const index_t R = gt.extent(0), N = gt.extent(1);
  if (est.extent(0) != R || est.extent(1) != N)
    return status::error(errc::shape_mismatch, "%s: est is [%lld][%lld] but gt is [%lld][%lld]", fn,
                         static_cast<long long>(est.extent(0)), static_cast<long long>(est.extent(1)),
                         static_cast<long long>(R), static_cast<long long>(N));
  if (want_grad && (grad_est.extent(0) != R || grad_est.extent(1) != N))
    return status::error(errc::shape_mismatch, "%s: grad_est is [%lld][%lld] but must be [%lld][%lld] (or have 0 rows)",
                         fn, static_cast<long long>(grad_est.extent(0)), static_cast<long long>(grad_est.extent(1)),
                         static_cast<long long>(R), static_cast<long long>(N));
  if (!(opts.eps >= 0.0) || !(opts.eps - opts.eps == 0.0))
    return status::error(errc::invalid_argument, "%s: eps must be finite and >= 0 (got %g)", fn, opts.eps);
  if (opts.kind != lookahead_loss_kind::kl && opts.kind != lookahead_loss_kind::listnet)
    return status::error(errc::invalid_argument, "%s: unknown loss kind %d", fn, static_cast<int>(opts.kind));
  if (detail::range_of(grad_est).intersects(detail::range_of(gt)) ||
      detail::range_of(grad_est).intersects(detail::range_of(est)))
    return status::error(errc::overlap, "%s: grad_est overlaps gt or est in memory", fn);
  if (R == 0) return status::error(errc::invalid_argument, "%s: no rows (the mean over layers and heads is undefined)", fn);

  detail::workspace_carver carver(ws);
  double* sums = carver.take<double>(static_cast<std::size_t>(2 * R));
  if (auto st = carver.finish(fn); !st.ok() || ws.is_query()) return st;
  const auto lb = reinterpret_cast<std::uintptr_t>(loss);
  const detail::byte_range touched[] = {detail::range_of(gt), detail::range_of(est), detail::range_of(grad_est),
                                        {lb, lb + sizeof(double)}};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"gt", "est", "grad_est", "loss"}));

  // validation (sequential: the first offending element is reported), row sums saved
  for (index_t r = 0; r < R; ++r) {
    const T* g = detail::row_of(gt, r);
    const T* e = detail::row_of(est, r);
    double G = 0.0, Es = 0.0;
    for (index_t j = 0; j < N; ++j) {
      const T gv = g[j * gt.stride(1)], ev = e[j * est.stride(1)];
      if (!detail::finite_t(gv) || gv < T(0))
        return status::error(errc::invalid_argument, "%s: gt[%lld][%lld] = %g is not a finite non-negative score", fn,
                             static_cast<long long>(r), static_cast<long long>(j), static_cast<double>(gv));
      if (!detail::finite_t(ev) || ev < T(0))
        return status::error(errc::invalid_argument, "%s: est[%lld][%lld] = %g is not a finite non-negative score", fn,
                             static_cast<long long>(r), static_cast<long long>(j), static_cast<double>(ev));
      G += static_cast<double>(gv);
      Es += static_cast<double>(ev);
    }
    if (!(G > 0.0))
      return status::error(errc::invalid_argument, "%s: gt row %lld sums to 0 (no target distribution)", fn,
                           static_cast<long long>(r));
    if (!(Es > 0.0))
      return status::error(errc::invalid_argument, "%s: est row %lld sums to 0 (cannot be normalised)", fn,
                           static_cast<long long>(r));
    if (opts.eps == 0.0)
      for (index_t j = 0; j < N; ++j)
        if (static_cast<double>(g[j * gt.stride(1)]) / G > 0.0 && !(static_cast<double>(e[j * est.stride(1)]) / Es > 0.0))
          return status::error(errc::invalid_argument,
                               "%s: est[%lld][%lld] is 0 where gt is positive: KL is infinite with eps = 0", fn,
                               static_cast<long long>(r), static_cast<long long>(j));
    sums[2 * r] = G;
    sums[2 * r + 1] = Es;
  }

  const double eps = opts.eps, den = 1.0 + static_cast<double>(N) * eps;
  // each row reads its sums first and finally replaces sums[2r] by its loss (rows are independent)
  detail::parallel_for(be, R, [&](index_t r) {
    const T* g = detail::row_of(gt, r);
    const T* e = detail::row_of(est, r);
    const double G = sums[2 * r], Es = sums[2 * r + 1];
    if (want_grad) {
      double cbar = 0.0;  // sum_j w_j qhat_j
      for (index_t j = 0; j < N; ++j) {
        const double p = (static_cast<double>(g[j * gt.stride(1)]) / G + eps) / den;
        if (p == 0.0) continue;
        const double qh = static_cast<double>(e[j * est.stride(1)]) / Es;
        cbar += p / ((qh + eps) / den) * qh;
      }
      const double k = 1.0 / (static_cast<double>(R) * Es * den);
      T* out = detail::row_of(grad_est, r);
      for (index_t j = 0; j < N; ++j) {
        const double p = (static_cast<double>(g[j * gt.stride(1)]) / G + eps) / den;
        const double w = p == 0.0 ? 0.0 : p / ((static_cast<double>(e[j * est.stride(1)]) / Es + eps) / den);
        out[j * grad_est.stride(1)] = static_cast<T>((cbar - w) * k);
      }
    }
    sums[2 * r] = detail::loss_row(g, gt.stride(1), e, est.stride(1), N, G, Es, eps, opts.kind);
  });
  double total = 0.0;
  for (index_t r = 0; r < R; ++r) total += sums[2 * r];
  *loss = total / static_cast<double>(R);
  return {};
}

/// Loss only (no gradient).
template <class Backend, class GT, class ET>
status lookahead_kl_loss(Backend be, workspace& ws, matrix_view<GT> gt, matrix_view<ET> est, double* loss,
                         const lookahead_loss_options& opts = {}) {
  using T = std::remove_const_t<GT>;
  return lookahead_kl_loss(be, ws, gt, est, loss, matrix_view<T>{}, opts);
}

}  // namespace kvevict
