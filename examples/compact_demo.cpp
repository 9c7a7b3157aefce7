// Demo: an engine keeps a token-major KV cache; after prefill it decides which tokens each KV
// head keeps (here: the first 2 "sink" tokens and every token whose key has a large L2 norm),
// packs them into a ragged cache with room for decoding, and appends decode-time tokens.
#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  using namespace kvevict;
  const index_t heads = 4, tokens = 16, dim = 8, decode_room = 4;
  std::vector<float> keys(heads * tokens * dim);
  for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = std::sin(0.37f * static_cast<float>(i));
  auto k = make_kv_view(keys.data(), heads, tokens, dim, kv_layout::token_major);
  if (!k) return std::fprintf(stderr, "%s\n", k.error().message()), 1;

  // which tokens each head keeps: 2 sinks + tokens with ||k|| above the head's mean
  std::vector<pos_t> pos;
  std::vector<std::int32_t> cu{0};
  for (index_t h = 0; h < heads; ++h) {
    std::vector<float> norm(tokens);
    float mean = 0;
    for (index_t t = 0; t < tokens; ++t) {
      for (index_t d = 0; d < dim; ++d) norm[t] += (*k)(h, t, d) * (*k)(h, t, d);
      mean += norm[t] / tokens;
    }
    for (index_t t = 0; t < tokens; ++t)
      if (t < 2 || norm[t] > mean) pos.push_back(static_cast<pos_t>(t));
    cu.push_back(static_cast<std::int32_t>(pos.size()));
  }

  // a ragged cache with room for decode_room more tokens per head
  std::vector<std::int32_t> cu_capacity{0}, lens(heads);
  for (index_t h = 0; h < heads; ++h) cu_capacity.push_back(cu_capacity.back() + (cu[h + 1] - cu[h]) + decode_room);
  std::vector<float> store(cu_capacity.back() * dim);
  ragged_cache<float> cache{store.data(), cu_capacity.data(), lens.data(), heads, dim, dim};
  status st = compact(par, *k, ragged_positions{pos.data(), cu.data(), heads}, cache);
  if (!st) return std::fprintf(stderr, "%s\n", st.message()), 1;

  std::vector<float> step(heads * dim, 1.f);  // one decode token's keys, [head][1][dim]
  for (int s = 0; s < 3; ++s) {
    st = append(seq, cache, *make_kv_view(step.data(), heads, 1, dim));
    if (!st) return std::fprintf(stderr, "%s\n", st.message()), 1;
  }
  for (index_t h = 0; h < heads; ++h) {
    std::printf("head %lld keeps %d of %lld prompt tokens:", static_cast<long long>(h), cu[h + 1] - cu[h],
                static_cast<long long>(tokens));
    for (std::int32_t i = cu[h]; i < cu[h + 1]; ++i) std::printf(" %d", pos[i]);
    std::printf("  -> %d rows after 3 decode steps (capacity %lld)\n", lens[h], static_cast<long long>(cache.capacity(h)));
  }
  // one more append than the room allows is refused with a clear error, and nothing is written
  st = append(seq, cache, *make_kv_view(step.data(), heads, 2, dim));
  std::printf("appending 2 more: %s\n", st.message());
  return st.code() == errc::capacity_exceeded ? 0 : 1;
}
