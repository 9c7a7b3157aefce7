// kvevict/pool.hpp: 1-D pooling of score rows (SnapKV's "clustering" of neighbouring tokens).
//
//   pool1d(be, in /*[R][T]*/, out /*[R][T]*/, kind, kernel, row_lengths = nullptr, options = {})
//
// Stride 1, odd kernel k = 2r + 1 centred on each position, same-size output. For row length L
// (row_lengths[row], or T), position i in [0, L) pools the window [i - r, i + r]; positions
// outside [0, L) are padding:
//   none  out[i] = in[i] (a copy; kernel still validated)
//   max   out[i] = max of the in-range window positions (padding ignored, i.e. -inf padding,
//         like F.max_pool1d(padding=k//2)); the max is taken in the total score order of
//         detail/base/score_order.hpp: NaN ranks below everything, so the result is NaN only if every
//         in-range position of the window is NaN (PyTorch's max_pool1d propagates NaN instead).
//   avg   out[i] = (sum of the in-range window positions) / k: zero padding, divisor = kernel size,
//         like F.avg_pool1d(padding=k//2) with its default count_include_pad=True (what
//         KVCache-Factory's SnapKV/PyramidKV and kvpress use). pool_options::divisor = valid
//         divides by the number of in-range positions instead (count_include_pad=False).
// Positions i >= L of a row are not written (the caller's padding stays as it was).
//
// Complexity: O(L) per row independent of k (van Herk / Gil-Werman): the padded row is cut into
// blocks of k positions; every window is a suffix of one block plus a prefix of the next, both
// precomputed in one pass each. The output row holds the block suffixes between the passes, so no
// scratch memory is needed and nothing allocates.
// Rounding of avg: each window sum is (suffix part) + (prefix part), each part accumulated within
// its block from the split point outwards: a sum of at most k terms, so the error is that of a
// k-term sum (no drift along the row as with a running sum, and an inf or NaN only affects the
// windows that contain it). It can differ in the last bits from a left-to-right sum (PyTorch).
// Every backend runs the same per-row code: seq and par are bit-identical.
//
// In place is not supported: pooling reads every input k times, so in and out must not overlap
// (errc::overlap). Use two score buffers.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/base/score_order.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/pool_types.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/block/pool_block.hpp>
#include <kvevict/detail/host/pool_host.hpp>

#include <algorithm>
#include <cstdint>

namespace kvevict {

namespace detail {

/// One row of max or avg pooling (see the header comment), in O(n) for any kernel.
/// x: n inputs, stride sx; y: n outputs, stride sy (must not overlap x); kernel = 2r + 1 >= 1.
template <class Op>
KVEVICT_HOST_DEVICE inline void pool_row_impl(avg_divisor div, const float* x, index_t sx, float* y, index_t sy,
                                              index_t n, index_t kernel) {
  using V = typename Op::value;
  const index_t r_full = kernel / 2;
  // a radius >= n covers the whole row from every position: clamp it (same windows, less work)
  const index_t r = r_full < n ? r_full : n;
  const index_t k = 2 * r + 1;
  // Extended coordinates: e = position + r, so output i's window is [i, i + k - 1] and the real
  // positions are e in [r, n + r). Blocks are [b*k, (b+1)*k); m tracks e % k without dividing.
  // Pass 1, right to left: y[e] = the suffix of e's block from e (real positions only), for e < n.
  {
    V acc{};
    bool have = false;
    index_t e = n - 1 + r, m = e % k;
    for (; e >= 0; --e, m = m == 0 ? k - 1 : m - 1) {
      if (m == k - 1) have = false;  // e is the last position of its block: a new suffix starts
      const index_t p = e - r;
      if (p >= 0 && p < n) {
        const V v = Op::load(x[p * sx]);
        acc = have ? Op::op(v, acc) : v;
        have = true;
      }
      if (e < n) Op::stash(y + e * sy, have ? acc : V{});
    }
  }
  // Pass 2, left to right: acc = the prefix of b's block up to b = i + k - 1 (real positions only),
  // combined with the suffix of i's block stashed in y[i].
  {
    V acc{};
    bool have = false;
    index_t block = 0;  // first position of b's block
    const float kernel_f = static_cast<float>(kernel);
    for (index_t b = 0, m = 0; b < n + k - 1; ++b, m = m + 1 == k ? 0 : m + 1) {
      if (m == 0) {
        have = false;
        block = b;
      }
      const index_t p = b - r;
      if (p >= 0 && p < n) {
        const V v = Op::load(x[p * sx]);
        acc = have ? Op::op(acc, v) : v;
        have = true;
      }
      const index_t i = b - (k - 1);
      if (i < 0) continue;
      V w = Op::unstash(y + i * sy);  // suffix of i's block: the whole window when i starts a block (m == k - 1)
      if (m != k - 1 && have) w = block - 1 < r ? acc : Op::op(w, acc);  // left part empty iff block - 1 < r
      y[i * sy] = pool_output<Op>(div, w, i, n, r_full, kernel_f);
    }
  }
}

/// in and out: valid views of the same shape.
inline status check_pool1d_views(const char* fn, const matrix_view<const float>& in, const matrix_view<float>& out) {
  return check_same_shape_views(fn, "in", in, "out", out);
}

/// kind and divisor inside their enums, kernel odd and >= 1. Shared by every backend.
inline status check_pool_params(const char* fn, pool_kind kind, index_t kernel, const pool_options& options) {
  if (kind != pool_kind::none && kind != pool_kind::max && kind != pool_kind::avg)
    return status::error(errc::invalid_argument, "%s: kind = %d is not a pool_kind (none, max or avg)", fn,
                         static_cast<int>(kind));
  if (options.divisor != avg_divisor::kernel && options.divisor != avg_divisor::valid)
    return status::error(errc::invalid_argument, "%s: options.divisor = %d is not an avg_divisor (kernel or valid)",
                         fn, static_cast<int>(options.divisor));
  if (kernel < 1)
    return status::error(errc::invalid_argument, "%s: kernel = %lld must be odd and >= 1", fn,
                         static_cast<long long>(kernel));
  if (kernel % 2 == 0)
    return status::error(errc::invalid_argument, "%s: kernel = %lld is even (the window is centred: use an odd size)",
                         fn, static_cast<long long>(kernel));
  return {};
}

/// in and out must not overlap (in place included); row_lengths must not lie inside out.
inline status check_pool1d_overlap(const char* fn, const matrix_view<const float>& in, const matrix_view<float>& out,
                                   const std::int32_t* row_lengths) {
  if (range_of(in).intersects(range_of(out)))
    return status::error(errc::overlap,
                         "%s: in and out overlap in memory (pooling cannot run in place: use a separate output)", fn);
  if (lengths_inside(row_lengths, in.extent(0), range_of(out)))
    return status::error(errc::overlap, "%s: row_lengths lie inside out", fn);
  return {};
}

/// Output i of pool_row_impl<Op> alone, with the same operations in the same order: the suffix of
/// i's block (extended coordinates, right to left) and the prefix of the next block (left to
/// right), padding skipped. O(k); for the few outputs at the ends of a row the fast path leaves.
template <class Op>
KVEVICT_HOST_DEVICE inline float pool_one(avg_divisor div, const float* x, index_t n, index_t kernel, index_t i) {
  using V = typename Op::value;
  const index_t r_full = kernel / 2;
  const index_t r = r_full < n ? r_full : n;
  const index_t k = 2 * r + 1;
  const index_t j = i % k;
  const index_t split = j == 0 ? i + k : i + k - j;  // first extended position of the next block
  V s{}, acc{};
  bool hs = false, hp = false;
  for (index_t e = split - 1; e >= i; --e) {
    const index_t p = e - r;
    if (p >= 0 && p < n) {
      const V v = Op::load(x[p]);
      s = hs ? Op::op(v, s) : v;
      hs = true;
    }
  }
  V w = hs ? s : V{};
  if (j != 0) {
    for (index_t e = split; e < i + k; ++e) {
      const index_t p = e - r;
      if (p >= 0 && p < n) {
        const V v = Op::load(x[p]);
        acc = hp ? Op::op(acc, v) : v;
        hp = true;
      }
    }
    if (hp) w = hs ? Op::op(w, acc) : acc;
  }
  return pool_output<Op>(div, w, i, n, r_full, static_cast<float>(kernel));
}

/// Outputs [lo, hi) of a contiguous row of n positions that pool_fast_applies to (host code), output
/// i into y[i - lo]: the bits of pool_row's output i. The r outputs at each end of the row one by
/// one (pool_one), the interior by pool_host.hpp's kernels.
inline void pool_row_part(bool is_max, avg_divisor div, const float* x, float* y, index_t n, index_t kernel,
                          index_t lo, index_t hi) {
  const index_t r = kernel / 2;
  const auto one = [&](index_t i) {
    return is_max ? pool_one<pool_max_traits>(div, x, n, kernel, i) : pool_one<pool_sum_traits>(div, x, n, kernel, i);
  };
  const index_t a = lo > r ? lo : r, b = hi < n - r ? hi : n - r;  // the interior part
  for (index_t i = lo; i < hi && i < r; ++i) y[i - lo] = one(i);
  if (a < b) pool_fast_interior(is_max, x, y + (a - lo), kernel, a, b);
  for (index_t i = lo > n - r ? lo : n - r; i < hi; ++i) y[i - lo] = one(i);
}

/// One row of pooling of any kind.
KVEVICT_HOST_DEVICE inline void pool_row(pool_kind kind, avg_divisor div, const float* x, index_t sx, float* y,
                                         index_t sy, index_t n, index_t kernel) {
  if (n <= 0) return;
  if (kind == pool_kind::none) {
    for (index_t i = 0; i < n; ++i) y[i * sy] = x[i * sx];
#if !defined(__CUDA_ARCH__)
  } else if (pool_fast_applies(sx, sy, n, kernel)) {
    // small kernels on the host: a direct sliding window with the same bits (detail/host/pool_host.hpp)
    pool_row_part(kind == pool_kind::max, div, x, y, n, kernel, 0, n);
#endif
  } else if (kind == pool_kind::max) {
    pool_row_impl<pool_max_traits>(div, x, sx, y, sy, n, kernel);
  } else {
    pool_row_impl<pool_sum_traits>(div, x, sx, y, sy, n, kernel);
  }
}

}  // namespace detail

/// Pools every row of `in` into `out` (both [R][T], any strides, not overlapping).
/// kernel: odd, >= 1 (checked for every kind; `none` copies). row_lengths: null (every row has T
/// positions) or R int32 lengths in [0, T]; positions >= length are padding and are not written.
/// Errors: invalid views; shapes of in and out differ (shape_mismatch); kind or options.divisor
/// outside their enums, kernel < 1 or even (invalid_argument); a length outside [0, T]
/// (out_of_range); in and out overlapping, in place included, or row_lengths inside out (overlap).
/// Work: O(R * T) for any kernel, no scratch; parallel over rows.
template <class Backend>
status pool1d(Backend be, matrix_view<const float> in, matrix_view<float> out, pool_kind kind, index_t kernel,
              const std::int32_t* row_lengths = nullptr, pool_options options = {}) {
  constexpr const char* fn = "pool1d";
  KVEVICT_TRY(detail::check_pool1d_views(fn, in, out));
  KVEVICT_TRY(detail::check_pool_params(fn, kind, kernel, options));
  const index_t R = in.extent(0), T = in.extent(1);
  KVEVICT_TRY(detail::check_lengths(fn, "row_lengths", row_lengths, R, T));
  KVEVICT_TRY(detail::check_pool1d_overlap(fn, in, out, row_lengths));
  const float* ip = in.data_handle();
  float* op = out.data_handle();
  const index_t is0 = in.stride(0), is1 = in.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  detail::parallel_for(be, R, [&](index_t r) {
    const index_t n = row_lengths != nullptr ? row_lengths[r] : T;
    detail::pool_row(kind, options.divisor, ip + r * is0, is1, op + r * os0, os1, n, kernel);
  });
  return {};
}

}  // namespace kvevict
