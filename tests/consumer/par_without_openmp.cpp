// Must not compile: kvevict::par in a translation unit built without OpenMP (run_consumer.cmake
// expects the build to fail with require_openmp's static_assert message).
#include <kvevict/compact.hpp>

#include <vector>

int main() {
  std::vector<float> cache(2 * 4 * 3), out(2 * 2 * 3);
  const std::vector<kvevict::pos_t> kept = {0, 3, 1, 2};
  auto src = kvevict::make_kv_view(cache.data(), 2, 4, 3);
  auto dst = kvevict::make_kv_view(out.data(), 2, 2, 3);
  auto kv = kvevict::make_matrix_view(kept.data(), 2, 2);
  return kvevict::compact(kvevict::par, *src, *kv, *dst).ok() ? 0 : 1;
}
