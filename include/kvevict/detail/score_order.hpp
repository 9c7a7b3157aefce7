// The total order of scores used by every "max" in kvevict (GQA max, max pooling). It is the
// selection order of docs/conventions.md refined into a total order on the 2^32 bit patterns, so
// that a max is associative and commutative, returns one of its inputs bit for bit, and does not
// depend on the evaluation order (sequential, blocked, parallel, GPU):
//   NaN < -inf < negative finite < -0.0 < +0.0 < positive finite < +inf
// NaNs are below everything (as in selection). Among themselves they follow a fixed rule (from the
// key below): NaNs with the sign bit clear rank below those with it set; within one sign, by
// payload (sign clear: larger payload higher; sign set: smaller payload higher). -0.0 is placed
// below +0.0 only to make the max unique; selection treats the two as equal.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/numeric.hpp>

#include <cstdint>

namespace kvevict::detail {

/// Order-preserving bijection float bits -> uint32: a ranks above b iff score_key(a) > score_key(b).
/// The usual sign twiddle (which orders -NaN < -inf < ... < +inf < +NaN) rotated by 2^23 - 1 so
/// that the positive NaNs wrap around below everything. Branch-free.
KVEVICT_HOST_DEVICE inline std::uint32_t score_key(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t mask = static_cast<std::uint32_t>(static_cast<std::int32_t>(u) >> 31);  // ones if sign set
  return (u ^ (mask | 0x80000000u)) + 0x007fffffu;
}
/// The float whose score_key is k.
KVEVICT_HOST_DEVICE inline float score_from_key(std::uint32_t k) noexcept {
  const std::uint32_t t = k - 0x007fffffu;
  return bits_float((t & 0x80000000u) ? (t ^ 0x80000000u) : ~t);
}

/// True if a ranks strictly above b in the total score order.
KVEVICT_HOST_DEVICE inline bool score_greater(float a, float b) noexcept { return score_key(a) > score_key(b); }

/// The larger of a and b in the total score order (NaN only if both are NaN).
KVEVICT_HOST_DEVICE inline float score_max(float a, float b) noexcept { return score_greater(b, a) ? b : a; }

}  // namespace kvevict::detail
