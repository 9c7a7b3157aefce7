// A minimal engine-side use of kvevict: view a token-major cache and compact two heads.
#include <kvevict/compact.hpp>

#include <cstdio>
#include <vector>

int main() {
  const int heads = 2, tokens = 5, dim = 3;
  std::vector<float> cache(heads * tokens * dim);
  for (std::size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<float>(i);
  auto src = kvevict::make_kv_view(cache.data(), heads, tokens, dim, kvevict::kv_layout::token_major);
  const std::vector<kvevict::pos_t> kept = {1, 4, 0, 2};
  auto kept_view = kvevict::make_matrix_view(kept.data(), heads, 2);
  std::vector<float> out(heads * 2 * dim);
  auto dst = kvevict::make_kv_view(out.data(), heads, 2, dim);
  if (!src || !kept_view || !dst) return 1;
  const kvevict::status st = kvevict::compact(kvevict::seq, *src, *kept_view, *dst);
  if (!st) {
    std::fprintf(stderr, "%s\n", st.message());
    return 1;
  }
  // token-major element (t, h, d) sits at (t*heads + h)*dim + d
  const float expect = static_cast<float>((4 * heads + 0) * dim + 1);  // head 0, kept token 4, dim 1
  if (out[1 * dim + 1] != expect) return 2;
  std::printf("consumer ok\n");
  return 0;
}
