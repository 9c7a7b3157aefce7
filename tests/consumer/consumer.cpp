// A CPU-only engine's use of kvevict: SnapKV on one layer of a token-major fp16 cache (score ->
// select -> compact). Built by run_consumer.cmake with and without OpenMP: with it (linked to
// kvevict::openmp) par must really be parallel and give exactly seq's result; without it the
// engine uses seq only (par would not compile: par_without_openmp.cpp).
#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

using namespace kvevict;

namespace {

constexpr index_t hq = 4, hkv = 2, T = 64, D = 8, w = 8, budget = 16;

struct layer {
  std::vector<float16> k, v, q;  // token-major [T][H_kv][D] keys and values, window queries [H_q][w][D]
};

struct evicted {
  std::vector<pos_t> kept = std::vector<pos_t>(hkv * budget);
  std::vector<float16> k = std::vector<float16>(hkv * budget * D), v = std::vector<float16>(hkv * budget * D);
};

template <class Backend>
status evict(Backend be, const layer& in, evicted& out) {
  recipe r = recipe::snapkv();
  r.window = w;
  r.n_recent = w;
  auto keys = make_kv_view(in.k.data(), hkv, T, D, kv_layout::token_major);
  auto vals = make_kv_view(in.v.data(), hkv, T, D, kv_layout::token_major);
  auto q = make_kv_view(in.q.data(), hq, w, D);
  std::vector<float> scores(hkv * T);
  auto s = make_matrix_view(scores.data(), hkv, T);
  auto sel = make_matrix_view(out.kept.data(), hkv, budget);
  if (!keys || !vals || !q || !s || !sel) return status::error(errc::invalid_argument, "consumer: bad shapes");

  std::vector<unsigned char> scratch;
  workspace ws;  // two-phase: the first call only sizes the scratch
  KVEVICT_TRY(recipe_scores(be, ws, r, *q, *keys, *vals, *s));
  scratch.resize(ws.bytes);
  ws.data = scratch.data();
  KVEVICT_TRY(recipe_scores(be, ws, r, *q, *keys, *vals, *s));
  workspace sel_ws;
  KVEVICT_TRY(recipe_select(be, sel_ws, r, matrix_view<const float>(*s), *sel));
  std::vector<unsigned char> sel_scratch(sel_ws.bytes);
  sel_ws.data = sel_scratch.data();
  KVEVICT_TRY(recipe_select(be, sel_ws, r, matrix_view<const float>(*s), *sel));

  auto kept = make_matrix_view<const pos_t>(out.kept.data(), hkv, budget);
  KVEVICT_TRY(compact(be, *keys, *kept, *make_kv_view(out.k.data(), hkv, budget, D)));
  return compact(be, *vals, *kept, *make_kv_view(out.v.data(), hkv, budget, D));
}

#if defined(_OPENMP)
bool same_bits(const std::vector<float16>& a, const std::vector<float16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float16)) == 0;
}
#endif

int fail(const char* what) {
  std::fprintf(stderr, "consumer: %s\n", what);
  return 1;
}

}  // namespace

int main() {
  layer in;
  in.k.resize(T * hkv * D);
  in.v.resize(T * hkv * D);
  in.q.resize(hq * w * D);
  for (std::size_t i = 0; i < in.k.size(); ++i) in.k[i] = to_float16(std::sin(0.11f * static_cast<float>(i * i % 977)));
  for (std::size_t i = 0; i < in.v.size(); ++i) in.v[i] = to_float16(std::cos(0.07f * static_cast<float>(i)));
  for (std::size_t i = 0; i < in.q.size(); ++i) in.q[i] = to_float16(std::sin(0.05f * static_cast<float>(i % 331)));

  evicted ref;
  if (const status st = evict(seq, in, ref); !st) return fail(st.message());
  // SnapKV keeps the observation window: every head's last w kept positions are T-w .. T-1
  for (index_t h = 0; h < hkv; ++h)
    for (index_t j = 0; j < w; ++j)
      if (ref.kept[h * budget + budget - w + j] != T - w + j) return fail("the observation window was not kept");
  // the compacted rows are the cache's rows at the kept positions (token-major: (t, h, d))
  for (index_t h = 0; h < hkv; ++h)
    for (index_t j = 0; j < budget; ++j)
      for (index_t d = 0; d < D; ++d)
        if (std::memcmp(&ref.k[(h * budget + j) * D + d], &in.k[(ref.kept[h * budget + j] * hkv + h) * D + d],
                        sizeof(float16)) != 0)
          return fail("compacted keys differ from the kept cache rows");

#if defined(_OPENMP)
  if (!par_is_parallel()) return fail("compiled with OpenMP but par is not parallel");
  evicted threaded;
  if (const status st = evict(par_t{2}, in, threaded); !st) return fail(st.message());
  if (threaded.kept != ref.kept || !same_bits(threaded.k, ref.k) || !same_bits(threaded.v, ref.v))
    return fail("par (OpenMP, 2 threads) differs from seq");
  std::printf("consumer ok: seq and par (OpenMP) keep the same %lld tokens per head\n", static_cast<long long>(budget));
#else
  if (par_is_parallel()) return fail("compiled without OpenMP but par_is_parallel()");
  std::printf("consumer ok: seq keeps %lld tokens per head (no OpenMP)\n", static_cast<long long>(budget));
#endif
  return 0;
}
