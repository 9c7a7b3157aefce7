// Radix-select primitives shared by every backend of `select` (host loops today, CUDA kernels
// later): the order-preserving float -> key map, digit extraction, the bucket choice from a
// histogram, and the final keep rule. Everything here is KVEVICT_HOST_DEVICE, branch-light and
// free of host-only constructs, so a kernel can call it per element or per digit verbatim.
//
// The selection order (docs/conventions.md) as keys: a higher key is a better token.
//   NaN (any payload, either sign)  -> 0                       below everything
//   -inf                            -> 0x007fffff              below every finite
//   negative finite x               -> ~bits(x)                more negative = smaller key
//   -0.0 and +0.0                   -> 0x80000000              equal
//   positive finite x               -> bits(x) | 0x80000000
//   +inf                            -> 0xff800000              above every finite
// Ties between equal keys are broken by position (lower wins) by the final ascending scan, never
// by the key. Subnormals keep their value order (nothing is flushed to zero: only bits are read).
//
// A threshold is a key prefix: `mask` holds the key bits resolved so far (top bits first) and
// `prefix` their value. A key is above the threshold if (key & mask) > prefix, tied if equal.
// Each radix pass resolves one digit: 11 bits, 11 bits, then 10 bits (3 passes for 32 bits).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/score_order.hpp>
#include <kvevict/numeric.hpp>

#include <cstdint>

namespace kvevict::detail {

inline constexpr int radix_bits = 11;                  ///< widest digit
inline constexpr int radix_bins = 1 << radix_bits;     ///< histogram size of every pass (2048)
inline constexpr int radix_passes = 3;                 ///< 11 + 11 + 10 bits

/// Lowest bit of pass p's digit: 21, 10, 0.
KVEVICT_HOST_DEVICE constexpr int radix_shift(int pass) noexcept {
  return 32 - radix_bits * (pass + 1) > 0 ? 32 - radix_bits * (pass + 1) : 0;
}
/// Number of bits of pass p's digit: 11, 11, 10.
KVEVICT_HOST_DEVICE constexpr int radix_width(int pass) noexcept {
  return (pass == 0 ? 32 : radix_shift(pass - 1)) - radix_shift(pass);
}
/// Mask of pass p's digit, in key position.
KVEVICT_HOST_DEVICE constexpr std::uint32_t radix_digit_mask(int pass) noexcept {
  return ((1u << radix_width(pass)) - 1u) << radix_shift(pass);
}
/// Digit of `key` examined by pass p, in [0, 2^radix_width(p)).
KVEVICT_HOST_DEVICE constexpr std::uint32_t radix_digit(std::uint32_t key, int pass) noexcept {
  return (key >> radix_shift(pass)) & ((1u << radix_width(pass)) - 1u);
}

/// The threshold found so far: tokens whose key is above (key & mask > prefix) are kept, and the
/// first `ties` tokens in position order whose key is tied (key & mask == prefix) are kept too.
struct radix_threshold {
  std::uint32_t mask = 0;    ///< key bits resolved so far (0 before the first pass: all tie)
  std::uint32_t prefix = 0;  ///< their value
  index_t ties = 0;          ///< how many tied tokens are still to be kept (in position order)
};

/// True if `key` agrees with the threshold on every resolved bit (a candidate of the next pass).
KVEVICT_HOST_DEVICE constexpr bool radix_tied(std::uint32_t key, const radix_threshold& t) noexcept {
  return (key & t.mask) == t.prefix;
}
/// -1 below, 0 tied, +1 above the threshold.
KVEVICT_HOST_DEVICE constexpr int radix_compare(std::uint32_t key, const radix_threshold& t) noexcept {
  return (key & t.mask) > t.prefix ? 1 : ((key & t.mask) == t.prefix ? 0 : -1);
}

/// Where the k-th best key lies after one pass: bucket `bucket` of the pass's histogram, with
/// `above` keys in higher buckets (all kept) and `count` keys in the bucket itself.
struct radix_bucket {
  std::uint32_t bucket = 0;
  index_t above = 0;
  index_t count = 0;
};

/// Bucket holding the k-th best candidate (1 <= k <= sum of hist): scanning from the highest
/// bucket down, the first b with (candidates in buckets > b) < k <= (candidates in buckets >= b).
/// `Count` is any integer type (uint32 per row, uint64 for a whole layer).
template <class Count>
KVEVICT_HOST_DEVICE inline radix_bucket radix_choose_bucket(const Count* hist, int bins, index_t k) noexcept {
  index_t above = 0;
  for (int b = bins - 1; b > 0; --b) {
    const index_t c = static_cast<index_t>(hist[b]);
    if (above + c >= k) return {static_cast<std::uint32_t>(b), above, c};
    above += c;
  }
  return {0u, above, static_cast<index_t>(hist[0])};
}

/// The bucket choice of radix_choose_bucket as a per-bin predicate, for parallel scans: bin `bin`
/// holds `count` candidates and `above` candidates lie in higher bins. For 1 <= k <= sum of the
/// histogram, exactly one bin satisfies it, the one radix_choose_bucket returns (bin 0 when the
/// bins above it hold fewer than k candidates, whatever its own count). Never true for k <= 0.
KVEVICT_HOST_DEVICE constexpr bool radix_bucket_holds(std::uint32_t bin, index_t above, index_t count,
                                                      index_t k) noexcept {
  return above < k && (bin == 0 || above + count >= k);
}

/// Narrows `t` to the chosen bucket of pass p, where `k` tokens were still to be kept among
/// the tied candidates. Afterwards `t.ties` = k - keys above the bucket (>= 1).
/// Returns true when the selection is decided: the last pass, or (unless `full_key` asks for a
/// threshold on the whole key) every candidate in the bucket is kept, so no tie remains to break.
KVEVICT_HOST_DEVICE inline bool radix_narrow(radix_threshold& t, int pass, const radix_bucket& b, index_t k,
                                             bool full_key) noexcept {
  t.mask |= radix_digit_mask(pass);
  t.prefix |= b.bucket << radix_shift(pass);
  t.ties = k - b.above;
  return pass == radix_passes - 1 || (!full_key && t.ties == b.count);
}

/// The final emit rule, applied in ascending position order: keep every key above the threshold
/// and the first `ties_left` tied keys. Decrements `ties_left` when it keeps a tied key.
KVEVICT_HOST_DEVICE inline bool radix_keep(std::uint32_t key, const radix_threshold& t, index_t& ties_left) noexcept {
  const std::uint32_t m = key & t.mask;
  const bool tie = m == t.prefix && ties_left > 0;
  ties_left -= tie ? 1 : 0;
  return m > t.prefix || tie;
}

/// Threshold that keeps exactly the keys > `key` and the first `ties` keys == `key` (full key).
KVEVICT_HOST_DEVICE constexpr radix_threshold radix_full_threshold(std::uint32_t key, index_t ties) noexcept {
  return {0xffffffffu, key, ties};
}

}  // namespace kvevict::detail
