// SnapKV on one layer of an engine's cache: score, select, compact, every scratch buffer from a
// two-phase size query. The cache here is synthetic; an engine passes views of its own buffers.
// Built and run as a test; README.md shows this file verbatim (test example.readme_verbatim).
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

using namespace kvevict;

// k_cache, v_cache: the engine's token-major [T][H_kv][D] buffers; window_q: the last w prompt
// tokens' post-RoPE queries [H_q][w][D]. Each KV head keeps `budget` tokens: their positions into
// kept [H_kv][budget] (ascending), their rows into k_out / v_out [H_kv][budget][D].
status snapkv_evict(const float* k_cache, const float* v_cache, const float* window_q, index_t hq, index_t hkv,
                    index_t T, index_t D, index_t w, index_t budget, float* k_out, float* v_out, pos_t* kept,
                    std::vector<unsigned char>& scratch, std::vector<float>& scores) {
  recipe r = recipe::snapkv();  // max pool 7, GQA mean, the window kept
  r.window = w;
  r.n_recent = w;
  auto keys = make_kv_view(k_cache, hkv, T, D, kv_layout::token_major);  // views, no copy
  auto vals = make_kv_view(v_cache, hkv, T, D, kv_layout::token_major);
  auto q = make_kv_view(window_q, hq, w, D);
  scores.resize(static_cast<std::size_t>(hkv * T));
  auto s = make_matrix_view<const float>(scores.data(), hkv, T);
  auto s_out = make_matrix_view(scores.data(), hkv, T);
  auto sel = make_matrix_view(kept, hkv, budget);
  if (!keys || !vals || !q || !s || !s_out || !sel) return status::error(errc::invalid_argument, "snapkv_evict: bad shapes");

  // Each stage runs twice, the CUB way: a size query (ws.data == nullptr), then the work in
  // `scratch` (an engine sizes it once, for its longest prompt).
  auto two_phase = [&](auto&& stage) -> status {
    workspace ws;
    KVEVICT_TRY(stage(ws));
    scratch.resize(std::max(scratch.size(), ws.bytes));
    ws.data = scratch.data();
    return stage(ws);
  };
  KVEVICT_TRY(two_phase([&](workspace& ws) { return recipe_scores(par, ws, r, *q, *keys, *vals, *s_out); }));
  KVEVICT_TRY(two_phase([&](workspace& ws) { return recipe_select(par, ws, r, *s, *sel); }));

  auto kept_c = make_matrix_view<const pos_t>(kept, hkv, budget);
  KVEVICT_TRY(compact(par, *keys, *kept_c, *make_kv_view(k_out, hkv, budget, D)));
  return compact(par, *vals, *kept_c, *make_kv_view(v_out, hkv, budget, D));
}

int main() {
  const index_t hq = 8, hkv = 2, T = 96, D = 16, w = 8, budget = 24;
  std::vector<float> k(T * hkv * D), v(T * hkv * D), q(hq * w * D);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.11f * static_cast<float>(i * i % 977));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::cos(0.07f * static_cast<float>(i));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.05f * static_cast<float>(i % 331));
  std::vector<float> k_out(hkv * budget * D), v_out(hkv * budget * D), scores;
  std::vector<pos_t> kept(hkv * budget);
  std::vector<unsigned char> scratch;

  status st = snapkv_evict(k.data(), v.data(), q.data(), hq, hkv, T, D, w, budget, k_out.data(), v_out.data(),
                           kept.data(), scratch, scores);
  if (!st) return std::fprintf(stderr, "%s\n", st.message()), 1;
  for (index_t h = 0; h < hkv; ++h) {
    std::printf("head %lld keeps %lld of %lld tokens:", static_cast<long long>(h), static_cast<long long>(budget),
                static_cast<long long>(T));
    for (index_t j = 0; j < budget; ++j) std::printf(" %d", kept[h * budget + j]);
    std::printf("\n");
  }
  // a budget below the protected window is refused with a specific status, nothing written:
  // "recipe_select: budget 7 is below the 8 protected tokens (n_sink 0 + n_recent 8 of a row of 96)"
  st = snapkv_evict(k.data(), v.data(), q.data(), hq, hkv, T, D, w, w - 1, k_out.data(), v_out.data(), kept.data(),
                    scratch, scores);
  std::printf("budget %lld: %s\n", static_cast<long long>(w - 1), st.message());
  return st.ok() ? 1 : 0;
}
