// Arbitrary bytes -> the LookaheadKV module loader (lookaheadkv/module.hpp, in memory). A rejected
// input must come back as a status without allocating for the header's declared dimensions (the
// parameter count is checked against the input's size first: a 52-byte header declaring 2^30
// layers must not allocate gigabytes, which ASan's allocator would report); an accepted one must
// serialize back to exactly the same bytes.
#include <lookaheadkv/module.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvrun::lookahead_module m;
  if (!kvrun::deserialize(data, size, m).ok()) return 0;
  const std::vector<unsigned char> again = kvrun::serialize(m);
  if (again.size() != size || (size > 0 && std::memcmp(again.data(), data, size) != 0)) std::abort();
  return 0;
}
