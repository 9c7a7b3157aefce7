// libFuzzer target: arbitrary bytes into the .npy reader's in-memory entry point (tools/npy.hpp).
// It must never crash, over-read, leak or allocate more than its input holds; whatever it accepts
// must satisfy the format's invariants and survive a write/read round trip unchanged.
#include <npy.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace kvevict;

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  npy::array a;
  const status st = npy::parse(data, size, "fuzz.npy", a);
  if (!st.ok()) {
    // one specific line: a code, a message naming the input, nothing returned
    require(st.code() == errc::format_error);
    require(std::strncmp(st.message(), "fuzz.npy: ", 10) == 0);
    require(std::strchr(st.message(), '\n') == nullptr);
    require(a.shape.empty() && a.bytes.empty());
    return 0;
  }
  require(a.shape.size() <= npy::max_rank);
  std::int64_t n = 1;
  for (auto d : a.shape) {
    require(d >= 0);
    n *= d;
  }
  require(static_cast<std::uint64_t>(n) * npy::itemsize(a.type) == a.bytes.size());
  require(a.bytes.size() <= size);
  // the data is the tail of the input
  require(a.bytes.empty() || std::memcmp(a.bytes.data(), data + size - a.bytes.size(), a.bytes.size()) == 0);

  // round trip through the writer
  std::vector<unsigned char> file;
  require(npy::serialize(a, file).ok());
  npy::array b;
  require(npy::parse(file.data(), file.size(), "again.npy", b).ok());
  require(b.type == a.type && b.shape == a.shape && b.bytes == a.bytes);

  // views accept exactly the matching dtype and rank
  const auto kv = npy::as_kv_view<float>(a);
  require(kv.ok() == (a.type == npy::dtype::float32 && a.shape.size() == 3));
  if (kv.ok() && kv->size() > 0) {
    volatile float sink = (*kv)(kv->extent(0) - 1, kv->extent(1) - 1, kv->extent(2) - 1);
    (void)sink;
  }
  const auto tm = npy::as_kv_view<const float16>(a, kv_layout::token_major);
  require(tm.ok() == (a.type == npy::dtype::float16 && a.shape.size() == 3));
  const auto m = npy::as_matrix_view<const std::int32_t>(a);
  require(m.ok() == (a.type == npy::dtype::int32 && a.shape.size() == 2));
  if (m.ok() && m->size() > 0) {
    volatile std::int32_t sink = (*m)(m->extent(0) - 1, m->extent(1) - 1);
    (void)sink;
  }
  return 0;
}
