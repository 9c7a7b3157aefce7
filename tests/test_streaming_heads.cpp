// streaming_heads_driver (kvevict/drivers/streaming_heads.hpp): DuoAttention / PruLong head types
// at every step. Random masks and chunk schedules: after every update streaming heads hold exactly
// the sinks and the n_recent - 1 newest rows (the next key completes the window), retrieval heads
// every row; one-token steps record exactly
// eviction_recorder::set_streaming's schedule (so footprint and peak are StreamingLLM's for those
// heads and full attention's for the others); chunked schedules' footprints equal the counted
// residency; every documented error.
#include "support.hpp"

#include <kvevict/drivers/compact_layer.hpp>
#include <kvevict/drivers/streaming_heads.hpp>
#include <kvevict/metrics/footprint.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

using namespace kvevict;
using kvtest::require_error;

namespace {

// one layer of an engine cache: head-major rows of capacity C, keys = values = position
struct layer_cache {
  index_t H = 0, d = 2, C = 0;
  std::vector<float> keys, values;
  std::vector<pos_t> pos;
  std::vector<std::int32_t> cu, lens;
  layer_cache(index_t heads, index_t capacity) : H(heads), C(capacity) {
    keys.assign(static_cast<std::size_t>(H * C * d), 0.f);
    values = keys;
    pos.assign(static_cast<std::size_t>(H * C), -1);
    cu.resize(static_cast<std::size_t>(H + 1));
    for (index_t h = 0; h <= H; ++h) cu[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * C);
    lens.assign(static_cast<std::size_t>(H), 0);
  }
  void append(index_t b, index_t e) {
    for (index_t h = 0; h < H; ++h)
      for (index_t p = b; p < e; ++p) {
        const index_t j = lens[static_cast<std::size_t>(h)]++;
        REQUIRE(j < C);
        for (index_t x = 0; x < d; ++x) keys[static_cast<std::size_t>((h * C + j) * d + x)] = static_cast<float>(p);
        pos[static_cast<std::size_t>(h * C + j)] = static_cast<pos_t>(p);
      }
  }
  ragged_cache<float> kc() { return {keys.data(), cu.data(), lens.data(), H, d, d}; }
  ragged_cache<float> vc() { return {values.data(), cu.data(), lens.data(), H, d, d}; }
  ragged_cache<pos_t> pc() { return {pos.data(), cu.data(), lens.data(), H, 1, 1}; }
  layer_kv<float> view() { return make_layer_kv(kc(), vc(), pos.data()); }
};

struct setup {
  index_t L = 3, H = 4, C = 0;
  protection w{2, 5};
  std::vector<std::uint8_t> mask;
  std::vector<unsigned char> mem;
  streaming_heads_driver d;
};

void init(setup& s, eviction_recorder* rec = nullptr) {
  streaming_heads_config cfg;
  cfg.model = {s.L, s.H, 2 * s.H, 2};
  cfg.capacity = s.C;
  cfg.streaming = s.w;
  cfg.retrieval = *make_matrix_view<const std::uint8_t>(s.mask.data(), s.L, s.H);
  const auto bytes = streaming_heads_driver::state_bytes(cfg);
  REQUIRE(bytes.ok());
  s.mem.assign(*bytes, 0);
  REQUIRE(s.d.init(cfg, s.mem.data(), s.mem.size(), rec).ok());
}

// the positions a head must hold after `tokens` tokens
std::vector<pos_t> expected(bool retrieval, index_t tokens, const protection& w) {
  std::vector<pos_t> r;
  for (index_t p = 0; p < tokens; ++p)
    if (retrieval || p < w.n_sink || p > tokens - w.n_recent) r.push_back(static_cast<pos_t>(p));
  return r;
}

}  // namespace

TEST_CASE("streaming_heads_driver: streaming heads hold exactly sinks + recent after every chunk, retrieval heads everything") {
  auto g = kvtest::rng(1616);
  for (int round = 0; round < 40; ++round) {
    setup s;
    s.w = {kvtest::uniform_int(g, 0, 4), kvtest::uniform_int(g, 1, 9)};
    const index_t N = kvtest::uniform_int(g, 1, 60), chunk_max = kvtest::uniform_int(g, 1, 16);
    s.C = N;
    s.mask.resize(static_cast<std::size_t>(s.L * s.H));
    for (auto& m : s.mask) m = static_cast<std::uint8_t>(kvtest::uniform_int(g, 0, 1));
    std::vector<pos_t> store(static_cast<std::size_t>(s.L * s.H * N));
    auto rec = kvtest::value_of(make_eviction_recorder(store.data(), s.L, s.H, N));
    init(s, &rec);
    std::vector<layer_cache> layers;
    for (index_t l = 0; l < s.L; ++l) layers.emplace_back(s.H, s.C);
    std::int64_t resident = 0;  // counted: rows held while each query ran, summed over queries
    for (index_t b = 0, e = 0; b < N; b = e) {
      e = std::min(N, b + kvtest::uniform_int(g, 1, chunk_max));
      for (index_t l = 0; l < s.L; ++l) {
        layer_cache& c = layers[static_cast<std::size_t>(l)];
        // query p of the chunk sees what the cache held before the chunk plus the chunk's keys <= p
        for (index_t h = 0; h < s.H; ++h)
          for (index_t p = b; p < e; ++p) resident += c.lens[static_cast<std::size_t>(h)] + (p - b + 1);
        c.append(b, e);
        REQUIRE(s.d.update(l, c.view(), e).ok());
        bool drops = false;
        for (index_t h = 0; h < s.H; ++h) drops = drops || s.d.kept(l).length(h) != c.lens[static_cast<std::size_t>(h)];
        CHECK(s.d.evicted(l) == drops);
        if (s.d.evicted(l)) REQUIRE(compact_layer(seq, c.kc(), c.vc(), c.pc(), s.d.kept(l)).ok());
        for (index_t h = 0; h < s.H; ++h) {
          const bool ret = s.mask[static_cast<std::size_t>(l * s.H + h)] != 0;
          CHECK(s.d.retrieval(l, h) == ret);
          const std::vector<pos_t> have(c.pos.begin() + h * s.C, c.pos.begin() + h * s.C + c.lens[static_cast<std::size_t>(h)]);
          CHECK(have == expected(ret, e, s.w));
          if (!ret) CHECK(static_cast<index_t>(have.size()) == std::min(e, s.w.n_sink + s.w.n_recent - 1));
          for (index_t x = 0; x < static_cast<index_t>(have.size()); ++x)  // keys moved with their rows
            CHECK(c.keys[static_cast<std::size_t>((h * s.C + x) * 2)] == static_cast<float>(have[static_cast<std::size_t>(x)]));
        }
      }
    }
    // the recorder's footprint is what the engine held
    std::vector<std::int64_t> tmp(static_cast<std::size_t>(N) + 8);
    workspace mws{tmp.data(), tmp.size() * sizeof(std::int64_t)};
    kv_usage usage;
    REQUIRE(measure_kv_usage(mws, kvtest::value_of(rec.schedule(N)), usage).ok());
    CHECK(usage.resident == resident);
  }
}

TEST_CASE("streaming_heads_driver: one-token steps record StreamingLLM's schedule for streaming heads, none for retrieval heads") {
  setup s;
  const index_t N = 40;
  s.L = 2;
  s.H = 3;
  s.C = N;
  s.w = {3, 6};
  s.mask = {1, 0, 0, 0, 1, 0};
  std::vector<pos_t> store(static_cast<std::size_t>(s.L * s.H * N)), want_store(store.size());
  auto rec = kvtest::value_of(make_eviction_recorder(store.data(), s.L, s.H, N));
  auto want = kvtest::value_of(make_eviction_recorder(want_store.data(), s.L, s.H, N));
  init(s, &rec);
  std::vector<layer_cache> layers;
  for (index_t l = 0; l < s.L; ++l) layers.emplace_back(s.H, s.C);
  for (index_t t = 0; t < N; ++t)
    for (index_t l = 0; l < s.L; ++l) {
      layer_cache& c = layers[static_cast<std::size_t>(l)];
      c.append(t, t + 1);
      REQUIRE(s.d.update(l, c.view(), t + 1).ok());
      if (s.d.evicted(l)) REQUIRE(compact_layer(seq, c.kc(), c.vc(), c.pc(), s.d.kept(l)).ok());
    }
  for (index_t l = 0; l < s.L; ++l)
    for (index_t h = 0; h < s.H; ++h) {
      if (s.mask[static_cast<std::size_t>(l * s.H + h)] != 0) REQUIRE(want.set_full(l, h).ok());
      else REQUIRE(want.set_streaming(l, h, N, s.w.n_sink, s.w.n_recent).ok());
    }
  // the last update's evictions (at step N, after the last query) are never_evicted for set_streaming
  for (std::size_t i = 0; i < store.size(); ++i) {
    const pos_t got = store[i] >= static_cast<pos_t>(N) ? never_evicted : store[i];
    CHECK_MESSAGE(got == want_store[i], "entry ", i);
  }
  std::vector<std::int64_t> tmp(static_cast<std::size_t>(N) + 8);
  workspace mws{tmp.data(), tmp.size() * sizeof(std::int64_t)};
  kv_usage got, ref;
  REQUIRE(measure_kv_usage(mws, kvtest::value_of(rec.schedule(N)), got).ok());
  REQUIRE(measure_kv_usage(mws, kvtest::value_of(want.schedule(N)), ref).ok());
  CHECK(got.resident == ref.resident);
  CHECK(got.peak == ref.peak);
  // 2 retrieval heads of 6 hold everything, 4 streaming heads at most 3 + 6 rows: the peak at the end
  CHECK(got.peak == 2 * N + 4 * 9);
}

TEST_CASE("streaming_heads_driver: errors") {
  setup s;
  s.C = 8;
  s.mask.assign(static_cast<std::size_t>(s.L * s.H), 0);
  streaming_heads_config cfg;
  cfg.model = {s.L, s.H, 2 * s.H, 2};
  cfg.capacity = s.C;
  cfg.streaming = s.w;
  cfg.retrieval = *make_matrix_view<const std::uint8_t>(s.mask.data(), s.L, s.H);
  {
    auto c = cfg;
    c.streaming.n_recent = -1;
    require_error(streaming_heads_driver::state_bytes(c).error(), errc::invalid_argument, "n_recent = -1 >= 1");
  }
  {
    auto c = cfg;
    c.retrieval = *make_matrix_view<const std::uint8_t>(s.mask.data(), s.L - 1, s.H);
    require_error(streaming_heads_driver::state_bytes(c).error(), errc::shape_mismatch, "the retrieval mask is [2][4]");
  }
  {
    s.mask[5] = 2;
    require_error(streaming_heads_driver::state_bytes(cfg).error(), errc::invalid_argument, "retrieval[1][1] = 2 is neither");
    s.mask[5] = 0;
  }
  {
    auto c = cfg;
    c.capacity = 0;
    require_error(streaming_heads_driver::state_bytes(c).error(), errc::invalid_argument, "capacity");
  }
  layer_cache c(s.H, s.C + 1);
  c.append(0, 4);
  streaming_heads_driver fresh;
  require_error(fresh.update(0, c.view(), 4), errc::invalid_argument, "not initialised");
  init(s);
  require_error(s.d.update(3, c.view(), 4), errc::out_of_range, "layer 3 is outside [0, 3)");
  require_error(s.d.update(0, c.view(), 0), errc::invalid_argument, "tokens = 0 is outside");
  CHECK_FALSE(s.d.update(0, c.view(), 3).ok());  // a position >= tokens
  CHECK_FALSE(s.d.evicted(0));
  c.append(4, 9);
  CHECK_FALSE(s.d.update(0, c.view(), 9).ok());  // 9 rows, capacity 8
  std::vector<unsigned char> small(16);
  CHECK_FALSE(s.d.init(cfg, small.data(), small.size()).ok());
  CHECK(s.d.workspace_bytes(seq).value() == 0);
}
