// kvevict/numeric.hpp: 16-bit storage types for KV caches and the fp32 conversions every stage
// uses (all arithmetic is fp32). `float16` and `bfloat16` are bit-compatible with CUDA's `__half` and
// `__nv_bfloat16`: a pointer to one may be reinterpreted as a pointer to the other.
#pragma once

#include <kvevict/config.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvevict {

struct float16 {
  std::uint16_t bits;
};
struct bfloat16 {
  std::uint16_t bits;
};

namespace detail {
KVEVICT_HOST_DEVICE inline std::uint32_t float_bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
KVEVICT_HOST_DEVICE inline float bits_float(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace detail

/// IEEE binary16 -> binary32, exact (subnormals, infinities and NaN payloads preserved).
KVEVICT_HOST_DEVICE inline float to_float(float16 h) noexcept {
  const std::uint32_t sign = (std::uint32_t(h.bits) & 0x8000u) << 16;
  std::uint32_t exp = (h.bits >> 10) & 0x1fu;
  std::uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0x1f) return detail::bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return detail::bits_float(sign);  // +-0
    // subnormal: normalise
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3ffu;
    return detail::bits_float(sign | (exp << 23) | (mant << 13));
  }
  return detail::bits_float(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

/// binary32 -> binary16, round to nearest even; overflow gives inf, NaN stays NaN.
KVEVICT_HOST_DEVICE inline float16 to_float16(float f) noexcept {
  const std::uint32_t u = detail::float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    const std::uint16_t nan_bit = abs > 0x7f800000u ? 0x200u : 0u;
    return float16{static_cast<std::uint16_t>(sign | 0x7c00u | nan_bit | ((abs >> 13) & 0x3ffu))};
  }
  if (abs >= 0x477ff000u) return float16{static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    if (abs < 0x33000000u) return float16{sign};  // below half the smallest subnormal: +-0
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - exp;  // 14..24 bits dropped
    std::uint32_t out = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (out & 1u))) ++out;
    return float16{static_cast<std::uint16_t>(sign | out)};
  }
  std::uint32_t out = ((abs >> 13) - ((127u - 15u) << 10));
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (out & 1u))) ++out;  // carries into the exponent correctly
  return float16{static_cast<std::uint16_t>(sign | out)};
}

/// bfloat16 -> binary32, exact.
KVEVICT_HOST_DEVICE inline float to_float(bfloat16 b) noexcept {
  return detail::bits_float(std::uint32_t(b.bits) << 16);
}

/// binary32 -> bfloat16, round to nearest even; NaN stays NaN.
KVEVICT_HOST_DEVICE inline bfloat16 to_bfloat16(float f) noexcept {
  const std::uint32_t u = detail::float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return bfloat16{static_cast<std::uint16_t>((u + rounding) >> 16)};
}

KVEVICT_HOST_DEVICE inline float to_float(float f) noexcept { return f; }

/// Element types a KV cache may hold. Stages read them with to_float and compute in fp32.
template <class T>
inline constexpr bool is_kv_element_v =
    std::is_same_v<std::remove_const_t<T>, float> || std::is_same_v<std::remove_const_t<T>, float16> ||
    std::is_same_v<std::remove_const_t<T>, bfloat16>;

/// Name of an element type for messages and files ("float32", "float16", "bfloat16").
template <class T>
constexpr const char* element_name() noexcept {
  using U = std::remove_const_t<T>;
  if constexpr (std::is_same_v<U, float>) return "float32";
  else if constexpr (std::is_same_v<U, float16>) return "float16";
  else if constexpr (std::is_same_v<U, bfloat16>) return "bfloat16";
  else return "unknown";
}

}  // namespace kvevict
