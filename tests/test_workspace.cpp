#include "support.hpp"

#include <kvevict/workspace.hpp>

#include <memory>
#include <vector>

using namespace kvevict;

// A toy stage using the two-phase protocol exactly as real stages do.
static status toy_stage(workspace& ws, std::size_t n, float** a_out, int** b_out) {
  detail::workspace_carver c(ws);
  float* a = c.take<float>(n);
  int* b = c.take<int>(3);
  KVEVICT_TRY(c.finish("toy_stage"));
  if (ws.is_query()) return {};
  *a_out = a;
  *b_out = b;
  return {};
}

TEST_CASE("workspace: query, then run with exactly the queried size") {
  workspace ws;
  float* a = nullptr;
  int* b = nullptr;
  REQUIRE(toy_stage(ws, 10, &a, &b).ok());
  CHECK(ws.bytes >= 10 * sizeof(float) + 3 * sizeof(int));
  CHECK(a == nullptr);  // a query does no work
  std::vector<unsigned char> buf(ws.bytes + 64);
  // align the arena like a real allocator would
  void* p = buf.data();
  std::size_t space = buf.size();
  ws.data = std::align(64, ws.bytes, p, space);
  REQUIRE(toy_stage(ws, 10, &a, &b).ok());
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  CHECK(reinterpret_cast<unsigned char*>(b) >= reinterpret_cast<unsigned char*>(a + 10));
  CHECK(reinterpret_cast<unsigned char*>(b + 3) <= static_cast<unsigned char*>(ws.data) + ws.bytes);
}

TEST_CASE("workspace: too small is a specific error") {
  std::vector<unsigned char> buf(8);
  workspace ws{buf.data(), buf.size()};
  float* a = nullptr;
  int* b = nullptr;
  kvtest::require_error(toy_stage(ws, 10, &a, &b), errc::workspace_too_small, "toy_stage: workspace has 8 bytes");
}

// A layout mixing 1-, 4- and 8-byte types, as the selection's counters, histograms and tickets do.
struct mixed_layout {
  int* counter = nullptr;
  unsigned char* flags = nullptr;
  unsigned long long* tickets = nullptr;
  double* sums = nullptr;
};
static status mixed_stage(workspace& ws, mixed_layout& m) {
  detail::workspace_carver c(ws);
  m.counter = c.take<int>(1);
  m.flags = c.take<unsigned char>(3, 1);  // an unaligned request: the next take realigns
  m.tickets = c.take<unsigned long long>(5, 8);
  m.sums = c.take<double>(7);
  return c.finish("mixed_stage");
}

TEST_CASE("workspace: the carver aligns absolute addresses for any base, within the queried size") {
  workspace q;
  mixed_layout m;
  REQUIRE(mixed_stage(q, m).ok());
  // the worst-case padding to the first 64-byte boundary is part of the answer
  CHECK(q.bytes >= detail::workspace_max_align - 1 + 5 * sizeof(unsigned long long) + 7 * sizeof(double));
  std::vector<unsigned char> arena(q.bytes + 2 * detail::workspace_max_align);
  unsigned char* base = arena.data() + (64 - reinterpret_cast<std::uintptr_t>(arena.data()) % 64) % 64;
  kvtest::carver_alignment_probe probe;
  for (std::size_t shift = 0; shift < detail::workspace_max_align; ++shift) {
    CAPTURE(shift);
    workspace ws{base + shift, q.bytes};
    REQUIRE(mixed_stage(ws, m).ok());
    const auto at = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
    CHECK(at(m.counter) % 64 == 0);
    CHECK(at(m.tickets) % 8 == 0);
    CHECK(at(m.sums) % 64 == 0);
    CHECK(at(m.flags) > at(m.counter));
    CHECK(at(m.tickets) >= at(m.flags) + 3);
    CHECK(at(m.sums + 7) <= at(ws.data) + ws.bytes);
  }
  CHECK(kvtest::carver_alignment_probe::taken() == 4 * 64);
  CHECK(kvtest::carver_alignment_probe::misaligned() == 0);
}

TEST_CASE("workspace: used() counts from ws.data, and a stage taking nothing needs nothing") {
  workspace q;
  detail::workspace_carver none(q);
  REQUIRE(none.finish("none").ok());
  CHECK(q.bytes == 0);
  std::vector<unsigned char> arena(256);
  unsigned char* base = arena.data() + (64 - reinterpret_cast<std::uintptr_t>(arena.data()) % 64) % 64;
  workspace ws{base + 4, 128};
  detail::workspace_carver c(ws);
  int* a = c.take<int>(2);
  CHECK(reinterpret_cast<unsigned char*>(a) == base + 64);  // 60 bytes of padding to the boundary
  CHECK(c.used() == 60 + 2 * sizeof(int));
  CHECK(c.finish("used").ok());
}
