// chunked_lava: an engine-side prefill loop with kvevict's chunked, PATCHED eviction driver and
// LAVa budgets (entropy layer budgets, heads competing within a layer).
//
// The "model" is a synthetic state so the example runs anywhere: the query, key and value of
// token p in layer l are deterministic pseudo-random vectors with a little structure (a few
// "heavy hitter" tokens that deeper layers attend to more sharply, so LAVa gives those layers
// less). A real engine replaces `model_state` by its forward pass; everything else is what it
// would write.
//
// Per chunk [s, e) of the prompt:
//   1. drv.begin_chunk(s, e)
//   2. forward the chunk; in patched mode also the prompt's LAST w tokens right after it
//      (drv.patch()), as extra queries whose KV is not kept (the final chunk contains them)
//   3. per layer: drv.add_layer(be, ws, l, cache view, queries, patch keys)
//   4. drv.decide(be, ws)                        (LAVa shares the budget across layers here)
//   5. per layer: compact_layer(keys, values, positions, drv.kept(l))
#include <kvevict/driver.hpp>
#include <kvevict/metrics.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

using namespace kvevict;

namespace {

constexpr index_t L = 4;        // layers
constexpr index_t H = 2;        // KV heads per layer
constexpr index_t Hq = 8;       // query heads (GQA groups of 4)
constexpr index_t D = 32;       // head dim
constexpr index_t N = 512;      // prompt tokens
constexpr index_t CHUNK = 128;  // prefill chunk
constexpr index_t W = 16;       // observation window (the last W prompt tokens score)
constexpr index_t BUDGET = 48;  // tokens per head on average, at the end of the prefill

// ---- the synthetic model: q/k/v of (layer, position) -------------------------------------------
// Random vectors, plus structure that makes layers differ: every 29th token is a "heavy hitter"
// whose key leans towards a direction every query shares, more strongly in deeper layers. Deep
// layers attend to few tokens (low entropy: LAVa gives them less), layer 0 to everything.
float noise(index_t a, index_t b, index_t c) {  // splitmix64 -> [-1, 1)
  const auto u = [](index_t x) { return static_cast<std::uint64_t>(x); };
  std::uint64_t z = u(a) * 0x9E3779B97F4A7C15ull + u(b) * 0xBF58476D1CE4E5B9ull + u(c) * 0x94D049BB133111EBull + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0);
}
struct model_state {
  static float shared(index_t l, index_t h, index_t e) { return noise(99, 1 + l, h * D + e); }
  static bool heavy(pos_t p) { return p % 29 == 0; }
  static float strength(index_t l) { return 1.5f * static_cast<float>(l * l); }
  // queries [Hq][n][D] of positions `pos` in layer l (post-RoPE in a real engine)
  void queries(index_t l, const std::vector<pos_t>& pos, std::vector<float>& out) const {
    const auto n = static_cast<index_t>(pos.size());
    out.resize(static_cast<std::size_t>(Hq * n * D));
    for (index_t h = 0; h < Hq; ++h)
      for (index_t i = 0; i < n; ++i)
        for (index_t e = 0; e < D; ++e)
          out[static_cast<std::size_t>((h * n + i) * D + e)] =
              noise(1 + l, 1000 + pos[i], h * D + e) + shared(l, h / (Hq / H), e);
  }
  // keys (which = 0) or values (which = 1) [H][n][D]
  void kv(int which, index_t l, const std::vector<pos_t>& pos, std::vector<float>& out) const {
    const auto n = static_cast<index_t>(pos.size());
    out.resize(static_cast<std::size_t>(H * n * D));
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < n; ++i)
        for (index_t e = 0; e < D; ++e) {
          float x = noise(10 * which + 2 + l, 1000 + pos[i], h * D + e);
          if (which == 0 && heavy(pos[i])) x += strength(l) * shared(l, h, e);
          out[static_cast<std::size_t>((h * n + i) * D + e)] = x;
        }
  }
};

// ---- the engine's KV cache of one layer: ragged rows with room, and each row's position ------
struct layer_cache {
  std::vector<float> keys, values;    // [H][capacity][D]
  std::vector<pos_t> positions;       // [H][capacity]
  std::vector<std::int32_t> cu, lens, tmp_lens;
  explicit layer_cache(index_t capacity)
      : keys(static_cast<std::size_t>(H * capacity * D)), values(keys.size()),
        positions(static_cast<std::size_t>(H * capacity)), lens(H, 0), tmp_lens(H, 0) {
    for (index_t h = 0; h <= H; ++h) cu.push_back(static_cast<std::int32_t>(h * capacity));
  }
  ragged_cache<float> k() { return {keys.data(), cu.data(), lens.data(), H, D, D}; }
  ragged_cache<float> v() { return {values.data(), cu.data(), lens.data(), H, D, D}; }
  ragged_cache<pos_t> p() { return {positions.data(), cu.data(), lens.data(), H, 1, 1}; }
  layer_kv<float> view() { return make_layer_kv(k(), v(), positions.data()); }

  // the forward pass appends the chunk's keys / values ([H][n][D]) and positions to every head
  status append_chunk(const std::vector<float>& kc, const std::vector<float>& vc, const std::vector<pos_t>& pos) {
    const auto n = static_cast<index_t>(pos.size());
    std::vector<pos_t> pr(static_cast<std::size_t>(H * n));
    for (index_t h = 0; h < H; ++h) std::copy(pos.begin(), pos.end(), pr.begin() + h * n);
    auto kview = make_kv_view(kc.data(), H, n, D);
    auto vview = make_kv_view(vc.data(), H, n, D);
    auto pview = make_kv_view(pr.data(), H, n, 1);
    KVEVICT_TRY(append(seq, with(k(), tmp_lens), *kview));  // keys and values read the lengths
    KVEVICT_TRY(append(seq, with(v(), tmp_lens), *vview));  // before the last append moves them
    return append(seq, p(), *pview);
  }
  // keeps the rows a driver lists (ascending row indices per head): keys, values and positions
  status compact(ragged_positions kept) { return compact_layer(seq, k(), v(), p(), kept); }
  template <class T>
  ragged_cache<T> with(ragged_cache<T> c, std::vector<std::int32_t>& scratch) {
    std::copy(lens.begin(), lens.end(), scratch.begin());
    c.lens = scratch.data();
    return c;
  }
};

long long ll(index_t x) { return static_cast<long long>(x); }

int fail(const status& st) {
  std::fprintf(stderr, "error: %s\n", st.message());
  return 1;
}

}  // namespace

int main() {
  const auto be = kvevict::par;
  const index_t total = BUDGET * H * L;              // the model keeps this many tokens
  const index_t capacity = std::min(N, total + CHUNK);  // a head never holds more than the total + a chunk

  // 1. the driver: LAVa scores (window W, GQA max, max-pool 7, value-norm weights), patched
  //    chunking, LAVa's entropy layer budgets down to `total` tokens at every chunk
  chunked_config cfg;
  cfg.model = {L, H, Hq, D};
  cfg.tokens = N;
  cfg.capacity = capacity;
  cfg.rec = recipe::lava();
  cfg.rec.window = W;
  cfg.rec.n_recent = W;
  cfg.rec.n_sink = 4;  // attention sinks: patched chunks protect only these (the window is the patch)
  cfg.queries = chunk_queries::patched;
  cfg.target = chunk_target::budget;
  cfg.alloc.kind = allocator::lava;
  cfg.alloc.total = total;
  auto state_bytes = chunked_driver::state_bytes(cfg);
  if (!state_bytes) return fail(state_bytes.error());
  std::vector<unsigned char> state(*state_bytes);

  std::vector<pos_t> schedule(static_cast<std::size_t>(L * H * N));  // eviction schedule, for the metrics
  auto recorder = make_eviction_recorder(schedule.data(), L, H, N);
  if (!recorder) return fail(recorder.error());
  eviction_recorder rec = *recorder;

  chunked_driver drv;
  if (status st = drv.init(cfg, state.data(), state.size(), &rec); !st) return fail(st);
  auto ws_bytes = drv.workspace_bytes(be);  // two-phase: the size depends on the shapes only
  if (!ws_bytes) return fail(ws_bytes.error());
  std::vector<unsigned char> scratch(*ws_bytes);
  workspace ws{scratch.data(), scratch.size()};

  model_state model;
  std::vector<layer_cache> cache(static_cast<std::size_t>(L), layer_cache(capacity));
  std::vector<float> q, k, v, patch_k;
  std::vector<unsigned char> usage_scratch;  // measure_kv_usage's workspace, sized by its own query
  const auto measure = [&](const auto& to_measure, kv_usage& usage) -> status {
    workspace query;
    KVEVICT_TRY(measure_kv_usage(query, to_measure, usage));
    if (usage_scratch.size() < query.bytes) usage_scratch.resize(query.bytes);
    workspace mws{usage_scratch.data(), usage_scratch.size()};
    return measure_kv_usage(mws, to_measure, usage);
  };
  std::printf("chunked patched LAVa: %lld layers x %lld KV heads (%lld query heads), prompt %lld, chunk %lld, "
              "window %lld, budget %lld tokens (%lld per head)\n\n",
              ll(L), ll(H), ll(Hq), ll(N), ll(CHUNK), ll(W), ll(total), ll(BUDGET));

  for (index_t s = 0; s < N;) {
    index_t e = std::min(N, s + CHUNK);
    if (e < N && e > N - W) e = N;  // patched: the final chunk must contain the whole window
    if (status st = drv.begin_chunk(s, e); !st) return fail(st);
    const patch_block patch = drv.patch();  // [N - W, N) on every chunk but the last
    std::vector<pos_t> chunk_pos, query_pos;
    for (index_t p = s; p < e; ++p) chunk_pos.push_back(static_cast<pos_t>(p));
    if (patch.count > 0)
      for (index_t i = 0; i < patch.count; ++i) query_pos.push_back(static_cast<pos_t>(patch.first + i));
    else
      for (index_t p = e - drv.query_rows(); p < e; ++p) query_pos.push_back(static_cast<pos_t>(p));
    const auto qn = static_cast<index_t>(query_pos.size());

    for (index_t l = 0; l < L; ++l) {
      auto& c = cache[static_cast<std::size_t>(l)];
      // the engine's forward for layer l: the chunk's K/V enter the cache; the patch tokens run
      // after the chunk (attending to the cache and to themselves) and give their queries and keys
      model.kv(0, l, chunk_pos, k);
      model.kv(1, l, chunk_pos, v);
      if (status st = c.append_chunk(k, v, chunk_pos); !st) return fail(st);
      model.queries(l, query_pos, q);
      kv_view<const float> patch_keys{};
      if (patch.count > 0) {
        model.kv(0, l, query_pos, patch_k);
        patch_keys = *make_kv_view<const float>(patch_k.data(), H, qn, D);
      }
      const auto queries = make_kv_view<const float>(q.data(), Hq, qn, D);
      if (status st = drv.add_layer(be, ws, l, c.view(), *queries, patch_keys); !st) return fail(st);
    }
    if (status st = drv.decide(be, ws); !st) return fail(st);  // LAVa: budgets across layers

    std::printf("chunk [%3lld, %3lld)", ll(s), ll(e));
    if (patch.count > 0)
      std::printf("  + patch [%d, %lld) as extra queries\n", patch.first, ll(patch.first + patch.count));
    else
      std::printf("  final: its last %lld tokens score\n", ll(qn));
    index_t held = 0;
    for (index_t l = 0; l < L; ++l) {
      const ragged_positions kept = drv.kept(l);  // rows of the layer's cache, ascending per head
      auto& c = cache[static_cast<std::size_t>(l)];
      std::printf("  layer %lld  entropy %.4f  keeps %3lld of %3lld rows:", ll(l), drv.layer_weight(l), ll(kept.cu[H]),
                  ll(c.lens[0] + c.lens[1]));
      for (index_t h = 0; h < H; ++h) std::printf("  head %lld %3lld", ll(h), ll(kept.length(h)));
      std::printf("\n");
      if (status st = c.compact(kept); !st) return fail(st);
      held += kept.cu[H];
    }
    // KV footprint and peak over the tokens processed so far (each key counts from its creation
    // to its eviction, normalised to full causal attention)
    kv_usage usage;
    auto sched = rec.schedule(e);
    if (!sched) return fail(sched.error());
    if (status st = measure(*sched, usage); !st) return fail(st);
    std::printf("  cache now %lld rows; KV footprint so far %.1f%%, peak KV %.1f%%\n\n", ll(held),
                100.0 * usage.footprint(), 100.0 * usage.peak_kv());
    s = e;
  }

  kv_usage usage;
  if (status st = measure(*rec.schedule(N), usage); !st) return fail(st);
  std::printf("prefill of %lld tokens: KV footprint %.1f%% and peak KV %.1f%% of full attention\n",
              ll(N), 100.0 * usage.footprint(), 100.0 * usage.peak_kv());
  std::printf("(post-fill eviction keeps the whole prompt until the end: footprint 100%%, peak 100%%)\n");
  return 0;
}
