// The two orders of scores, in one place.
//
// Selection order (docs/conventions.md), `score_key`: higher score = better; -0.0 == +0.0; +inf
// above every finite, -inf below; every NaN below everything and equal to every other NaN. Keys
// are many-to-one; select breaks ties by position. Radix selection runs on these keys.
//
// Total order, `total_order_key`: the selection order refined into a bijection on the 2^32 bit
// patterns, used by every "max" (GQA max, max pooling) so that a max is associative and
// commutative, returns one of its inputs bit for bit, and does not depend on evaluation order:
//   NaN < -inf < negative finite < -0.0 < +0.0 < positive finite < +inf
// NaNs with the sign bit clear rank below those with it set; within one sign, by payload (sign
// clear: larger payload higher; sign set: smaller payload higher). -0.0 is below +0.0 only to
// make the max unique.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/numeric.hpp>

#include <cstdint>

namespace kvevict::detail {

inline constexpr std::uint32_t nan_key = 0;  ///< the selection key of every NaN

/// Order-preserving key of a score: a > b in the selection order <=> key(a) > key(b); equal
/// scores (-0 and +0 included, every NaN with every NaN) get equal keys.
KVEVICT_HOST_DEVICE inline std::uint32_t score_key(float x) noexcept {
  std::uint32_t b = float_bits(x);
  b = b == 0x80000000u ? 0u : b;                               // -0 -> +0
  const std::uint32_t neg = 0u - (b >> 31);                    // all ones for negative scores
  const std::uint32_t key = b ^ (neg | 0x80000000u);           // flip all (negative) or the sign bit
  return (b & 0x7fffffffu) > 0x7f800000u ? nan_key : key;      // NaN -> the minimum key
}

/// Order-preserving bijection float bits -> uint32: a ranks above b iff total_order_key(a) > total_order_key(b).
/// The usual sign twiddle (which orders -NaN < -inf < ... < +inf < +NaN) rotated by 2^23 - 1 so
/// that the positive NaNs wrap around below everything. Branch-free.
KVEVICT_HOST_DEVICE inline std::uint32_t total_order_key(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t mask = static_cast<std::uint32_t>(static_cast<std::int32_t>(u) >> 31);  // ones if sign set
  return (u ^ (mask | 0x80000000u)) + 0x007fffffu;
}
/// The float whose total_order_key is k.
KVEVICT_HOST_DEVICE inline float total_order_from_key(std::uint32_t k) noexcept {
  const std::uint32_t t = k - 0x007fffffu;
  return bits_float((t & 0x80000000u) ? (t ^ 0x80000000u) : ~t);
}

/// True if a ranks strictly above b in the total score order.
KVEVICT_HOST_DEVICE inline bool total_order_greater(float a, float b) noexcept { return total_order_key(a) > total_order_key(b); }

/// The larger of a and b in the total score order (NaN only if both are NaN).
KVEVICT_HOST_DEVICE inline float total_order_max(float a, float b) noexcept { return total_order_greater(b, a) ? b : a; }

}  // namespace kvevict::detail
