// The total order of scores used by every "max" in kvevict (GQA max, max pooling). It is the
// selection order of docs/conventions.md refined into a total order on bit patterns, so that a
// max is associative and commutative and its result does not depend on the evaluation order
// (sequential, blocked, parallel, GPU):
//   NaN < -inf < negative finite < -0.0 < +0.0 < positive finite < +inf
// NaNs are below everything (as in selection); among themselves they are ordered by their bits.
// -0.0 is placed below +0.0 only to make the max unique; selection treats the two as equal.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/numeric.hpp>

#include <cstdint>

namespace kvevict::detail {

/// Monotonic key of a non-NaN float: a < b (with -0 < +0) iff key(a) < key(b).
KVEVICT_HOST_DEVICE inline std::uint32_t score_key(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

KVEVICT_HOST_DEVICE inline bool score_is_nan(float f) noexcept {
  return (float_bits(f) & 0x7fffffffu) > 0x7f800000u;
}

/// True if a ranks strictly above b in the total score order.
KVEVICT_HOST_DEVICE inline bool score_greater(float a, float b) noexcept {
  const bool an = score_is_nan(a), bn = score_is_nan(b);
  if (an || bn) return an && bn ? float_bits(a) > float_bits(b) : bn;
  return score_key(a) > score_key(b);
}

/// The larger of a and b in the total score order (NaN only if both are NaN).
KVEVICT_HOST_DEVICE inline float score_max(float a, float b) noexcept { return score_greater(b, a) ? b : a; }

}  // namespace kvevict::detail
