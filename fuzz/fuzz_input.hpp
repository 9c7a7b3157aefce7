// What the fuzzers share: reading an input as big-endian fields (zeros past its end) and failing
// loudly (a trap libFuzzer reports with the input).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvfuzz {

struct input {
  const std::uint8_t* p;
  std::size_t n;
  /// The next `bytes` bytes (at most 4) as a big-endian number; zeros once the input is used up.
  std::uint32_t take(int bytes) {
    std::uint32_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      v = v << 8 | (n > 0 ? *p : 0u);
      if (n > 0) ++p, --n;
    }
    return v;
  }
};

inline void require(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace kvfuzz
