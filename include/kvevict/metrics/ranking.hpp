// kvevict/metrics/ranking.hpp: how well an importance estimate ranks the tokens, per row
// (one row per KV head, or per query head, as the caller chooses).
//
//   recall_at_k(ws, estimate, truth, k, mean[, per_row])        |top-k(est) ∩ top-k(truth)| / k
//   kept_recall_at_k(ws, kept, truth, k, mean[, per_row])       |kept ∩ top-k(truth)| / k
//   kendall_tau_b(ws, a, b, mean[, per_row])                    Kendall's τ-b (ties handled)
//
// Top-k uses the library's order: higher score first, equal scores -> lower position first,
// -0.0 == +0.0, and NaN below everything (-inf included) -- the order of the select stage, so the
// recall of an estimate is the recall of what select would keep. Ground-truth scores and both
// Kendall inputs must not contain NaN (error). The top-k here is a plain nth_element over an index
// array (clear, O(T) per row on average); the select stage is the fast path for real eviction.
// Metrics run on the calling thread; scratch comes through a kvevict::workspace.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvevict {
namespace detail::metrics_impl {

/// The library's selection order: true when (a at position i) ranks before (b at position j).
inline bool ranks_before(float a, index_t i, float b, index_t j) noexcept {
  const bool an = std::isnan(a), bn = std::isnan(b);
  if (an != bn) return bn;           // a number ranks before NaN
  if (!an && a != b) return a > b;   // higher first (-0.0 == +0.0 falls through)
  return i < j;                      // ties and NaN pairs: lower position first
}

/// Fills idx[0..k) with the top-k positions of row r (any order), using idx[0..T) as scratch.
template <class Row>
void top_k_positions(const Row& row, index_t cols, index_t k, pos_t* idx) {
  for (index_t i = 0; i < cols; ++i) idx[i] = static_cast<pos_t>(i);
  if (k < cols)
    std::nth_element(idx, idx + k, idx + cols,
                     [&](pos_t x, pos_t y) { return ranks_before(row(x), x, row(y), y); });
}

template <class T, class Ext>
status check_not_inside(const char* fn, const double* per_row, index_t rows,
                        const cuda::std::mdspan<T, Ext, cuda::std::layout_stride>& v, const char* name) {
  if (per_row == nullptr) return {};
  const auto b = reinterpret_cast<std::uintptr_t>(per_row);
  const byte_range out{b, b + static_cast<std::uintptr_t>(rows) * sizeof(double)};
  if (out.intersects(range_of(v)))
    return status::error(errc::overlap, "%s: per_row and %s overlap in memory", fn, name);
  return {};
}

inline status check_positions_not_inside(const char* fn, const double* per_row, index_t rows, const pos_t* pos,
                                        index_t count) {
  if (per_row == nullptr || pos == nullptr || count <= 0) return {};
  const auto b = reinterpret_cast<std::uintptr_t>(per_row), p = reinterpret_cast<std::uintptr_t>(pos);
  const byte_range out{b, b + static_cast<std::uintptr_t>(rows) * sizeof(double)};
  if (out.intersects({p, p + static_cast<std::uintptr_t>(count) * sizeof(pos_t)}))
    return status::error(errc::overlap, "%s: per_row and kept overlap in memory", fn);
  return {};
}

template <class T>
status check_no_nan(const char* fn, const char* name, const matrix_view<T>& m) {
  for (index_t r = 0; r < m.extent(0); ++r)
    for (index_t c = 0; c < m.extent(1); ++c)
      if (std::isnan(m(r, c)))
        return status::error(errc::invalid_argument, "%s: %s[%lld][%lld] is NaN", fn, name, static_cast<long long>(r),
                             static_cast<long long>(c));
  return {};
}

inline status check_k(const char* fn, index_t k, index_t cols) {
  if (k < 1 || k > cols)
    return status::error(errc::invalid_argument, "%s: k = %lld is outside [1, %lld] (the row length)", fn,
                         static_cast<long long>(k), static_cast<long long>(cols));
  if (cols > static_cast<index_t>(std::numeric_limits<pos_t>::max()))
    return status::error(errc::invalid_argument, "%s: rows of %lld tokens do not fit in positions", fn,
                         static_cast<long long>(cols));
  return {};
}

/// Shared body of the recalls. Scratch: idx[T] (truth's top-k), mark[T] (1 = in truth's top-k),
/// est[T] (only if `est_scratch`). `validate(mark)` checks the kept lists before anything is
/// written and must leave mark all zero; `hits(r, mark, est)` counts row r's kept positions that
/// are marked 1.
template <class Validate, class Hits>
status recall_rows(const char* fn, workspace& ws, const matrix_view<const float>& truth, index_t k, double& mean,
                   double* per_row, const byte_range& input, const char* input_name, bool est_scratch,
                   Validate validate, Hits hits) {
  const index_t rows = truth.extent(0), cols = truth.extent(1);
  workspace_carver carver(ws);
  pos_t* idx = carver.take<pos_t>(static_cast<std::size_t>(cols));
  unsigned char* mark = carver.take<unsigned char>(static_cast<std::size_t>(cols));
  pos_t* est = carver.take<pos_t>(est_scratch ? static_cast<std::size_t>(cols) : 0);
  KVEVICT_TRY(carver.finish(fn));
  const auto pb = reinterpret_cast<std::uintptr_t>(per_row);
  const byte_range touched[] = {range_of(truth), input,
                                {pb, per_row ? pb + static_cast<std::uintptr_t>(rows) * sizeof(double) : pb}};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"truth", input_name, "per_row"}));
  if (ws.is_query()) return {};
  KVEVICT_TRY(check_no_nan(fn, "truth", truth));
  std::memset(mark, 0, static_cast<std::size_t>(cols));
  KVEVICT_TRY(validate(mark));
  double sum = 0;
  for (index_t r = 0; r < rows; ++r) {
    top_k_positions([&](index_t c) { return truth(r, c); }, cols, k, idx);
    for (index_t i = 0; i < k; ++i) mark[idx[i]] = 1;
    const index_t h = hits(r, mark, est);
    for (index_t i = 0; i < k; ++i) mark[idx[i]] = 0;
    const double rec = static_cast<double>(h) / static_cast<double>(k);
    if (per_row != nullptr) per_row[r] = rec;
    sum += rec;
  }
  mean = sum / static_cast<double>(rows);
  return {};
}

/// Checks kept lists (count(r), at(r, i)): positions in [0, T), no duplicates.
template <class Count, class At>
status check_kept_lists(const char* fn, index_t rows, index_t cols, Count count, At at, unsigned char* mark) {
  for (index_t r = 0; r < rows; ++r) {
    for (index_t i = 0; i < count(r); ++i) {
      const pos_t p = at(r, i);
      if (p < 0 || p >= cols)
        return status::error(errc::out_of_range, "%s: kept position %d of row %lld is outside [0, %lld)", fn, p,
                             static_cast<long long>(r), static_cast<long long>(cols));
      if (mark[p] != 0) {
        for (index_t j = 0; j < i; ++j) mark[at(r, j)] = 0;
        return status::error(errc::invalid_argument, "%s: kept position %d of row %lld is listed twice", fn, p,
                             static_cast<long long>(r));
      }
      mark[p] = 1;
    }
    for (index_t i = 0; i < count(r); ++i) mark[at(r, i)] = 0;
  }
  return {};
}

template <class Count, class At>
status kept_recall_rows(const char* fn, workspace& ws, const matrix_view<const float>& truth, index_t k,
                        double& mean, double* per_row, const byte_range& kept, Count count, At at) {
  return recall_rows(
      fn, ws, truth, k, mean, per_row, kept, "kept", false,
      [&](unsigned char* mark) { return check_kept_lists(fn, truth.extent(0), truth.extent(1), count, at, mark); },
      [&](index_t r, const unsigned char* mark, pos_t*) {
        index_t h = 0;
        for (index_t i = 0; i < count(r); ++i) h += mark[at(r, i)] == 1;
        return h;
      });
}

inline status check_truth_args(const char* fn, const matrix_view<const float>& truth, index_t k, const double* per_row) {
  KVEVICT_TRY(check_view(fn, "truth", truth));
  if (truth.extent(0) < 1) return status::error(errc::invalid_argument, "%s: there are no rows to average", fn);
  KVEVICT_TRY(check_k(fn, k, truth.extent(1)));
  return check_not_inside(fn, per_row, truth.extent(0), truth, "truth");
}

/// Merge sort of perm[0..n) by key ascending (stable), counting the pairs it puts in order:
/// the number of (i < j) with key[perm[i]] > key[perm[j]] strictly. tmp: n entries.
template <class Key>
std::int64_t sort_counting_swaps(index_t* perm, index_t* tmp, index_t n, Key key) {
  std::int64_t swaps = 0;
  index_t* src = perm;
  index_t* dst = tmp;
  for (index_t width = 1; width < n; width *= 2) {
    for (index_t lo = 0; lo < n; lo += 2 * width) {
      const index_t mid = std::min(lo + width, n), hi = std::min(lo + 2 * width, n);
      index_t i = lo, j = mid, o = lo;
      while (i < mid && j < hi) {
        if (key(src[j]) < key(src[i])) {
          swaps += mid - i;  // src[j] jumps over every remaining left element
          dst[o++] = src[j++];
        } else {
          dst[o++] = src[i++];
        }
      }
      while (i < mid) dst[o++] = src[i++];
      while (j < hi) dst[o++] = src[j++];
    }
    std::swap(src, dst);
  }
  if (src != perm) std::copy(src, src + n, perm);
  return swaps;
}

/// Σ over runs of equal keys (in perm order) of t(t-1)/2.
template <class Same>
std::int64_t tied_pairs(const index_t* perm, index_t n, Same same) {
  std::int64_t pairs = 0;
  index_t run = 1;
  for (index_t i = 1; i <= n; ++i) {
    if (i < n && same(perm[i - 1], perm[i])) {
      ++run;
    } else {
      pairs += static_cast<std::int64_t>(run) * (run - 1) / 2;
      run = 1;
    }
  }
  return pairs;
}

}  // namespace detail::metrics_impl

/// recall@k per row r: |top-k(estimate[r]) ∩ top-k(truth[r])| / k, and its mean over the rows.
/// estimate and truth are [R][T] score matrices (higher = more important). estimate may contain
/// NaN (ranked last, as select does); truth may not. per_row: nullptr or R doubles.
/// Workspace: 2T int32 + T bytes (two-phase). Outputs are written only on success.
/// Errors: invalid views, shape mismatch, R = 0, k outside [1, T], NaN in truth, per_row
/// overlapping an input, workspace too small. Cost: O(R·T) on average (nth_element).
inline status recall_at_k(workspace& ws, matrix_view<const float> estimate, matrix_view<const float> truth, index_t k,
                          double& mean, double* per_row = nullptr) {
  constexpr const char* fn = "recall_at_k";
  namespace mi = detail::metrics_impl;
  KVEVICT_TRY(detail::check_same_shape_views(fn, "estimate", estimate, "truth", truth));
  KVEVICT_TRY(mi::check_truth_args(fn, truth, k, per_row));
  KVEVICT_TRY(mi::check_not_inside(fn, per_row, truth.extent(0), estimate, "estimate"));
  const index_t cols = truth.extent(1);
  return mi::recall_rows(
      fn, ws, truth, k, mean, per_row, detail::range_of(estimate), "estimate", true, [](unsigned char*) { return status{}; },
      [&](index_t r, const unsigned char* mark, pos_t* est) {
        mi::top_k_positions([&](index_t c) { return estimate(r, c); }, cols, k, est);
        index_t h = 0;
        for (index_t i = 0; i < k; ++i) h += mark[est[i]] == 1;
        return h;
      });
}

/// Recall of kept sets: per row r, |kept[r] ∩ top-k(truth[r])| / k (kept[r] may hold any number
/// of positions: a budget other than k is fine), and the mean over the rows. kept: ragged lists
/// with kept.heads == R, positions in any order, no duplicates. Workspace: T int32 + T bytes.
/// Errors: as recall_at_k, plus head count mismatch, bad offsets, kept positions outside [0, T),
/// duplicated kept positions.
inline status kept_recall_at_k(workspace& ws, ragged_positions kept, matrix_view<const float> truth, index_t k,
                               double& mean, double* per_row = nullptr) {
  constexpr const char* fn = "kept_recall_at_k";
  namespace mi = detail::metrics_impl;
  KVEVICT_TRY(mi::check_truth_args(fn, truth, k, per_row));
  if (kept.heads != truth.extent(0))
    return status::error(errc::shape_mismatch, "%s: kept has %lld rows, truth %lld", fn, static_cast<long long>(kept.heads),
                         static_cast<long long>(truth.extent(0)));
  KVEVICT_TRY(detail::check_offsets(fn, "kept.cu", kept.cu, kept.heads));
  if (kept.pos == nullptr && kept.total() > 0)
    return status::error(errc::null_pointer, "%s: kept.pos is null but %lld positions are listed", fn,
                         static_cast<long long>(kept.total()));
  KVEVICT_TRY(mi::check_positions_not_inside(fn, per_row, truth.extent(0), kept.pos, kept.total()));
  const auto kb = reinterpret_cast<std::uintptr_t>(kept.pos);
  const auto kept_bytes = static_cast<std::uintptr_t>(kept.total()) * sizeof(pos_t);
  const detail::byte_range kept_range{kb, kept.pos ? kb + kept_bytes : kb};
  return mi::kept_recall_rows(
      fn, ws, truth, k, mean, per_row, kept_range, [&](index_t r) { return kept.length(r); },
      [&](index_t r, index_t i) { return kept.pos[kept.cu[r] + i]; });
}

/// The same with a dense kept matrix [R][k'] (what select returns for a uniform budget).
inline status kept_recall_at_k(workspace& ws, matrix_view<const pos_t> kept, matrix_view<const float> truth, index_t k,
                               double& mean, double* per_row = nullptr) {
  constexpr const char* fn = "kept_recall_at_k";
  namespace mi = detail::metrics_impl;
  KVEVICT_TRY(detail::check_view(fn, "kept", kept));
  KVEVICT_TRY(mi::check_truth_args(fn, truth, k, per_row));
  if (kept.extent(0) != truth.extent(0))
    return status::error(errc::shape_mismatch, "%s: kept has %lld rows, truth %lld", fn,
                         static_cast<long long>(kept.extent(0)), static_cast<long long>(truth.extent(0)));
  KVEVICT_TRY(mi::check_not_inside(fn, per_row, truth.extent(0), kept, "kept"));
  return mi::kept_recall_rows(
      fn, ws, truth, k, mean, per_row, detail::range_of(kept), [&](index_t) { return kept.extent(1); },
      [&](index_t r, index_t i) { return kept(r, i); });
}

/// Kendall's τ-b between rows a[r] and b[r] ([R][n] each), and its mean over the rows:
///   τ_b = (n_c - n_d) / sqrt((n_0 - n_1)(n_0 - n_2)),  n_0 = n(n-1)/2,
/// n_c / n_d the concordant / discordant pairs, n_1 / n_2 the pairs tied in a / in b (-0.0 == +0.0).
/// Knight's O(n log n) algorithm: sort by (a, b), count ties, merge-sort by b counting swaps.
/// Workspace: 2n int64 (two-phase). Errors: invalid views, shape mismatch, R = 0, n < 2, NaN in
/// either input, a row whose a or b is constant (τ-b is 0/0 there: an error, not NaN), per_row
/// overlapping an input, workspace too small. Pair counts are exact integers; τ is their ratio in
/// double (exactly ±1 when a and b order a row identically or in reverse, ties included).
inline status kendall_tau_b(workspace& ws, matrix_view<const float> a, matrix_view<const float> b, double& mean,
                            double* per_row = nullptr) {
  constexpr const char* fn = "kendall_tau_b";
  namespace mi = detail::metrics_impl;
  KVEVICT_TRY(detail::check_same_shape_views(fn, "a", a, "b", b));
  const index_t rows = a.extent(0), n = a.extent(1);
  if (rows < 1) return status::error(errc::invalid_argument, "%s: there are no rows to average", fn);
  if (n < 2)
    return status::error(errc::invalid_argument, "%s: rows of %lld values have no pairs to compare", fn,
                         static_cast<long long>(n));
  if (n > INT64_C(3037000499))  // n(n-1)/2 must fit in int64
    return status::error(errc::size_overflow, "%s: rows of %lld values overflow the pair count", fn,
                         static_cast<long long>(n));
  KVEVICT_TRY(mi::check_not_inside(fn, per_row, rows, a, "a"));
  KVEVICT_TRY(mi::check_not_inside(fn, per_row, rows, b, "b"));
  detail::workspace_carver carver(ws);
  index_t* perm = carver.take<index_t>(static_cast<std::size_t>(n));
  index_t* tmp = carver.take<index_t>(static_cast<std::size_t>(n));
  KVEVICT_TRY(carver.finish(fn));
  const auto pb = reinterpret_cast<std::uintptr_t>(per_row);
  const detail::byte_range touched[] = {detail::range_of(a), detail::range_of(b),
                                        {pb, per_row ? pb + static_cast<std::uintptr_t>(rows) * sizeof(double) : pb}};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"a", "b", "per_row"}));
  if (ws.is_query()) return {};
  KVEVICT_TRY(mi::check_no_nan(fn, "a", a));
  KVEVICT_TRY(mi::check_no_nan(fn, "b", b));
  const std::int64_t n0 = static_cast<std::int64_t>(n) * (n - 1) / 2;
  // every row is checked for constancy before any output is written
  for (index_t r = 0; r < rows; ++r) {
    bool a_const = true, b_const = true;
    for (index_t i = 1; i < n && (a_const || b_const); ++i) {
      a_const = a_const && a(r, i) == a(r, 0);
      b_const = b_const && b(r, i) == b(r, 0);
    }
    if (a_const || b_const)
      return status::error(errc::invalid_argument, "%s: row %lld of %s is constant: tau-b is undefined (0/0)", fn,
                           static_cast<long long>(r), a_const ? "a" : "b");
  }
  double sum = 0;
  for (index_t r = 0; r < rows; ++r) {
    auto x = [&](index_t i) { return a(r, i); };
    auto y = [&](index_t i) { return b(r, i); };
    for (index_t i = 0; i < n; ++i) perm[i] = i;
    std::sort(perm, perm + n, [&](index_t i, index_t j) {
      if (x(i) != x(j)) return x(i) < x(j);
      if (y(i) != y(j)) return y(i) < y(j);
      return i < j;
    });
    const std::int64_t n1 = mi::tied_pairs(perm, n, [&](index_t i, index_t j) { return x(i) == x(j); });
    const std::int64_t n3 = mi::tied_pairs(perm, n, [&](index_t i, index_t j) { return x(i) == x(j) && y(i) == y(j); });
    const std::int64_t swaps = mi::sort_counting_swaps(perm, tmp, n, y);
    const std::int64_t n2 = mi::tied_pairs(perm, n, [&](index_t i, index_t j) { return y(i) == y(j); });
    const std::int64_t s = n0 - n1 - n2 + n3 - 2 * swaps;  // n_c - n_d
    // equal tie counts (always the case when a and b order the row identically): the denominator
    // is exact, so identical and reversed orders give exactly +1 and -1
    const double den = n1 == n2 ? static_cast<double>(n0 - n1)
                                : std::sqrt(static_cast<double>(n0 - n1)) * std::sqrt(static_cast<double>(n0 - n2));
    const double tau = static_cast<double>(s) / den;
    if (per_row != nullptr) per_row[r] = tau;
    sum += tau;
  }
  mean = sum / static_cast<double>(rows);
  return {};
}

}  // namespace kvevict
