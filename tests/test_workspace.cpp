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
