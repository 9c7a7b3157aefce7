// pool_row_impl (pool.hpp) cut into independent pieces for parallel hardware: the outputs of one
// "extended block" of the van Herk / Gil-Werman algorithm, computed with exactly the host's operations
// in the host's order, so that any partition of a row into blocks (one GPU thread per block, a CTA
// per tile of outputs) gives the host's bits. Host-device; nothing here is API.
//
// In pool_row_impl's extended coordinates (e = position + r, r = min(kernel / 2, n), k = 2r + 1) the
// row is cut into blocks [b·k, b·k + k). Output i of block b is the suffix of block b from i
// (accumulated right to left) combined with the prefix of block b + 1 up to i + k - 1 (accumulated
// left to right). Both only read inputs of blocks b and b + 1, so the outputs of block b can be
// computed alone: pool_block does that, for the outputs of the block inside a range [lo, hi), reading
// only inputs in [lo - r, hi + r).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/pool_types.hpp>

namespace kvevict::detail {

/// Radius and block length of pooling a row of n positions with `kernel` (pool_row_impl's clamp).
KVEVICT_HOST_DEVICE inline index_t pool_radius(index_t kernel, index_t n) {
  const index_t r_full = kernel / 2;
  return r_full < n ? r_full : n;
}

/// Output i's pooled value from its window's reduction w: Op::finish(w), for avg divided by the
/// window's real positions (avg_divisor::valid) or by the kernel (count_include_pad).
template <class Op>
KVEVICT_HOST_DEVICE inline float pool_output(avg_divisor div, typename Op::value w, index_t i, index_t n,
                                             index_t r_full, float kernel_f) {
  float out = Op::finish(w);
  if constexpr (!Op::is_max) {
    if (div == avg_divisor::valid) {
      const index_t lo = i - r_full < 0 ? 0 : i - r_full;
      const index_t hi = i + r_full > n - 1 ? n - 1 : i + r_full;
      out = out / static_cast<float>(hi - lo + 1);
    } else {
      out = out / kernel_f;  // count_include_pad: always the kernel size
    }
  }
  return out;
}

/// The outputs i in [max(lo, b·k), min(b·k + k, hi)) of a row of n inputs (0 <= lo, hi <= n), with
/// the operations and order of pool_row_impl<Op>:
///   x(p)           input p, called only for p in [0, n) ∩ [lo - r, hi + r)
///   stash          scratch: stash[(e - stash0) * stash_stride] for e in the outputs' range (the
///                  block's suffixes go there, as pool_row_impl keeps them in its output row)
///   emit(i, value) receives each output, in ascending i
template <class Op, class X, class Emit>
KVEVICT_HOST_DEVICE inline void pool_block(avg_divisor div, const X& x, float* stash, index_t stash0,
                                           index_t stash_stride, const Emit& emit, index_t n, index_t kernel,
                                           index_t b, index_t lo, index_t hi) {
  using V = typename Op::value;
  const index_t r_full = kernel / 2;
  const index_t r = pool_radius(kernel, n);
  const index_t k = 2 * r + 1;
  const index_t e0 = b * k;
  const index_t first = e0 > lo ? e0 : lo;
  const index_t last = e0 + k < hi ? e0 + k : hi;  // exclusive
  if (first >= last) return;
  // suffixes of block b, right to left from its last position (pool_row_impl's pass 1)
  {
    V acc{};
    bool have = false;
    for (index_t e = e0 + k - 1; e >= first; --e) {
      const index_t p = e - r;
      if (p >= 0 && p < n) {
        const V v = Op::load(x(p));
        acc = have ? Op::op(v, acc) : v;
        have = true;
      }
      if (e < last) Op::stash(stash + (e - stash0) * stash_stride, have ? acc : V{});
    }
  }
  // prefixes of block b + 1 combined with the suffixes (pool_row_impl's pass 2): output e0 + t uses
  // the prefix up to position (b + 1)·k + t - 1 of the next block
  {
    V acc{};
    bool have = false;
    const index_t block = e0 + k;  // first position of the next block
    const float kernel_f = static_cast<float>(kernel);
    for (index_t i = e0; i < last; ++i) {
      if (i > e0) {
        const index_t p = block + (i - e0) - 1 - r;
        if (p >= 0 && p < n) {
          const V v = Op::load(x(p));
          acc = have ? Op::op(acc, v) : v;
          have = true;
        }
      }
      if (i < first) continue;
      V w = Op::unstash(stash + (i - stash0) * stash_stride);
      if (i > e0 && have) w = block - 1 < r ? acc : Op::op(w, acc);
      emit(i, pool_output<Op>(div, w, i, n, r_full, kernel_f));
    }
  }
}

/// pool_block for any kind but none (max or avg).
template <class X, class Emit>
KVEVICT_HOST_DEVICE inline void pool_block_any(pool_kind kind, avg_divisor div, const X& x, float* stash,
                                               index_t stash0, index_t stash_stride, const Emit& emit, index_t n,
                                               index_t kernel, index_t b, index_t lo, index_t hi) {
  if (kind == pool_kind::max)
    pool_block<pool_max_traits>(div, x, stash, stash0, stash_stride, emit, n, kernel, b, lo, hi);
  else
    pool_block<pool_sum_traits>(div, x, stash, stash0, stash_stride, emit, n, kernel, b, lo, hi);
}

/// The blocks whose outputs meet [lo, hi) (lo < hi): b in [lo / k, (hi - 1) / k].
KVEVICT_HOST_DEVICE inline index_t pool_first_block(index_t kernel, index_t n, index_t lo) {
  return lo / (2 * pool_radius(kernel, n) + 1);
}
KVEVICT_HOST_DEVICE inline index_t pool_last_block(index_t kernel, index_t n, index_t hi) {
  return (hi - 1) / (2 * pool_radius(kernel, n) + 1);
}

}  // namespace kvevict::detail
