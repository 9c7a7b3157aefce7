#include <kvevict/numeric.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

using namespace kvevict;

// References: the compiler's own IEEE conversions (_Float16 on x86-64 gcc >= 12) and, for bfloat16,
// the definition (upper 16 bits, round to nearest even).
#if defined(__FLT16_MAX__)
TEST_CASE("half <-> float matches the compiler's _Float16 for every half and many floats") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float16 h{static_cast<std::uint16_t>(b)};
    _Float16 ref;
    std::memcpy(&ref, &h.bits, 2);
    const float f = to_float(h);
    const float r = static_cast<float>(ref);
    if (std::isnan(r)) {
      REQUIRE(std::isnan(f));
    } else {
      REQUIRE(std::memcmp(&f, &r, 4) == 0);
      REQUIRE(to_float16(f).bits == h.bits);  // round trip exact
    }
  }
  // floats between halves, ties, subnormal boundaries and overflow, on a fixed stride of bit patterns
  for (std::uint64_t u = 0; u < 0x100000000ull; u += 4099) {
    const auto bits = static_cast<std::uint32_t>(u);
    float f;
    std::memcpy(&f, &bits, 4);
    const _Float16 ref = static_cast<_Float16>(f);
    std::uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    const float16 got = to_float16(f);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(to_float(got)));
    } else {
      INFO("float bits ", bits);
      REQUIRE(got.bits == rb);
    }
  }
}
#endif

TEST_CASE("half: exact tie and overflow cases") {
  CHECK(to_float16(65504.f).bits == 0x7bffu);
  CHECK(to_float16(65519.f).bits == 0x7bffu);
  CHECK(to_float16(65520.f).bits == 0x7c00u);  // halfway to 65536 rounds to even = inf
  CHECK(to_float16(-std::numeric_limits<float>::infinity()).bits == 0xfc00u);
  CHECK(to_float(float16{0x0001u}) == std::ldexp(1.f, -24));  // smallest subnormal
  CHECK(to_float16(std::ldexp(1.f, -25)).bits == 0);          // exactly half of it ties to even (0)
  CHECK(to_float16(std::ldexp(1.5f, -25)).bits == 1);
  CHECK(std::isnan(to_float(to_float16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST_CASE("bfloat16: truncation with round to nearest even") {
  CHECK(to_float(to_bfloat16(1.f)) == 1.f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1)
  CHECK(to_float(to_bfloat16(1.f + std::ldexp(1.f, -8))) == 1.f);
  CHECK(to_float(to_bfloat16(1.f + 3 * std::ldexp(1.f, -8))) == 1.f + std::ldexp(1.f, -6));
  CHECK(std::isnan(to_float(to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(to_float(to_bfloat16(std::numeric_limits<float>::max()))));
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const bfloat16 x{static_cast<std::uint16_t>(b)};
    const float f = to_float(x);
    if (!std::isnan(f)) REQUIRE(to_bfloat16(f).bits == x.bits);
  }
}

TEST_CASE("element names") {
  CHECK(std::string(element_name<float>()) == "float32");
  CHECK(std::string(element_name<const float16>()) == "float16");
  CHECK(std::string(element_name<bfloat16>()) == "bfloat16");
  CHECK(is_kv_element_v<const float>);
  CHECK_FALSE(is_kv_element_v<double>);
}
