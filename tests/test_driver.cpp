// Drivers against naive references written for clarity: a synthetic engine whose queries, keys
// and values depend only on (layer, position), ragged caches compacted with compact_inplace as
// an engine would, references that materialise each head's rows densely, score them with the
// recipe stage, select by full sorts, compute budgets from the allocators' formulas and simulate
// eviction schedules step by step.
#include "support.hpp"
#include "thread_comm.hpp"

#include <kvevict/driver.hpp>
#include <kvevict/metrics.hpp>

#include <array>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {

// ------------------------------------------------------------------------------------------------
// Synthetic model state: q/k/v of every (layer, position), deterministic, independent of context.

struct synth {
  index_t L = 0, H = 0, Hq = 0, d = 0, N = 0;  // N: positions available (prompt + extra)
  std::vector<float> q, k, v;                 // [L][N][Hq][d], [L][N][H][d], [L][N][H][d]
  const float* query(index_t l, index_t p, index_t h) const { return q.data() + ((l * N + p) * Hq + h) * d; }
  const float* key(index_t l, index_t p, index_t h) const { return k.data() + ((l * N + p) * H + h) * d; }
  const float* value(index_t l, index_t p, index_t h) const { return v.data() + ((l * N + p) * H + h) * d; }
};

synth make_synth(std::uint64_t seed, index_t L, index_t H, index_t Hq, index_t d, index_t N) {
  auto g = kvtest::rng(seed);
  synth s{L, H, Hq, d, N, {}, {}, {}};
  s.q = kvtest::random_floats(g, static_cast<std::size_t>(L * N * Hq * d), -2.f, 2.f);
  s.k = kvtest::random_floats(g, static_cast<std::size_t>(L * N * H * d), -2.f, 2.f);
  s.v = kvtest::random_floats(g, static_cast<std::size_t>(L * N * H * d), -1.f, 1.f);
  // layers of different sharpness, so entropies (LAVa) differ between layers
  for (index_t l = 0; l < L; ++l)
    for (index_t i = 0; i < N * Hq * d; ++i) s.q[static_cast<std::size_t>(l * N * Hq * d + i)] *= 0.5f + 0.6f * float(l);
  return s;
}

/// A tensor-parallel rank's part of s: KV heads [h0, h0 + n) and their query heads.
synth slice_heads(const synth& s, index_t h0, index_t n) {
  const index_t g = s.Hq / s.H;
  synth r{s.L, n, n * g, s.d, s.N, {}, {}, {}};
  for (index_t l = 0; l < s.L; ++l)
    for (index_t p = 0; p < s.N; ++p) {
      r.q.insert(r.q.end(), s.query(l, p, h0 * g), s.query(l, p, (h0 + n) * g));
      r.k.insert(r.k.end(), s.key(l, p, h0), s.key(l, p, h0 + n));
      r.v.insert(r.v.end(), s.value(l, p, h0), s.value(l, p, h0 + n));
    }
  return r;
}

/// A pipeline stage's part of s: layers [l0, l0 + n).
synth slice_layers(const synth& s, index_t l0, index_t n) {
  synth r{n, s.H, s.Hq, s.d, s.N, {}, {}, {}};
  const auto part = [&](const std::vector<float>& v) {
    const auto per = static_cast<index_t>(v.size()) / s.L;
    return std::vector<float>(v.begin() + l0 * per, v.begin() + (l0 + n) * per);
  };
  r.q = part(s.q);
  r.k = part(s.k);
  r.v = part(s.v);
  return r;
}

/// A rank's rows [h0, h0 + n) of a [L][H] budget matrix.
std::vector<std::int32_t> slice_budgets(const std::vector<std::int32_t>& b, index_t L, index_t H, index_t h0, index_t n) {
  std::vector<std::int32_t> r;
  for (index_t l = 0; l < L; ++l) r.insert(r.end(), b.begin() + l * H + h0, b.begin() + l * H + h0 + n);
  return r;
}

/// Queries of `positions` in layer l: [Hq][n][d] head-major.
std::vector<float> gather_queries(const synth& s, index_t l, const std::vector<pos_t>& positions) {
  const auto n = static_cast<index_t>(positions.size());
  std::vector<float> out(static_cast<std::size_t>(std::max<index_t>(1, s.Hq * n * s.d)));
  for (index_t h = 0; h < s.Hq; ++h)
    for (index_t i = 0; i < n; ++i)
      std::copy(s.query(l, positions[i], h), s.query(l, positions[i], h) + s.d, out.begin() + (h * n + i) * s.d);
  return out;
}
/// Keys of `positions` in layer l: [H][n][d].
std::vector<float> gather_keys(const synth& s, index_t l, const std::vector<pos_t>& positions) {
  const auto n = static_cast<index_t>(positions.size());
  std::vector<float> out(static_cast<std::size_t>(std::max<index_t>(1, s.H * n * s.d)));
  for (index_t h = 0; h < s.H; ++h)
    for (index_t i = 0; i < n; ++i)
      std::copy(s.key(l, positions[i], h), s.key(l, positions[i], h) + s.d, out.begin() + (h * n + i) * s.d);
  return out;
}
std::vector<pos_t> range_of(index_t b, index_t e) {
  std::vector<pos_t> r;
  for (index_t p = b; p < e; ++p) r.push_back(static_cast<pos_t>(p));
  return r;
}
kv_view<const float> block_view(const std::vector<float>& buf, index_t heads, index_t n, index_t d) {
  if (n == 0) return {};
  return value_of(make_kv_view<const float>(buf.data(), heads, n, d));
}

// ------------------------------------------------------------------------------------------------
// The engine's cache of one layer: head-major ragged rows with capacity C, original positions.

struct engine_layer {
  index_t H = 0, d = 0, C = 0;
  std::vector<float> keys, values;
  std::vector<pos_t> pos;
  std::vector<std::int32_t> cu, lens, scratch;

  engine_layer(index_t heads, index_t dim, index_t capacity) : H(heads), d(dim), C(capacity) {
    keys.assign(static_cast<std::size_t>(H * C * d), 0.f);
    values.assign(keys.size(), 0.f);
    pos.assign(static_cast<std::size_t>(H * C), -1);
    cu.resize(static_cast<std::size_t>(H + 1));
    for (index_t h = 0; h <= H; ++h) cu[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * C);
    lens.assign(static_cast<std::size_t>(H), 0);
    scratch.assign(static_cast<std::size_t>(H), 0);
  }
  void push(const synth& s, index_t l, index_t h, pos_t p) {
    const index_t j = lens[static_cast<std::size_t>(h)]++;
    REQUIRE(j < C);
    std::copy(s.key(l, p, h), s.key(l, p, h) + d, keys.begin() + (h * C + j) * d);
    std::copy(s.value(l, p, h), s.value(l, p, h) + d, values.begin() + (h * C + j) * d);
    pos[static_cast<std::size_t>(h * C + j)] = p;
  }
  /// Positions [b, e) appended to every head.
  void append(const synth& s, index_t l, index_t b, index_t e) {
    for (index_t h = 0; h < H; ++h)
      for (index_t p = b; p < e; ++p) push(s, l, h, static_cast<pos_t>(p));
  }
  ragged_cache<float> kc() { return {keys.data(), cu.data(), lens.data(), H, d, d}; }
  ragged_cache<float> vc() { return {values.data(), cu.data(), lens.data(), H, d, d}; }
  layer_kv<float> view() { return make_layer_kv(kc(), vc(), pos.data()); }
  std::vector<pos_t> positions(index_t h) const {
    return {pos.begin() + h * C, pos.begin() + h * C + lens[static_cast<std::size_t>(h)]};
  }
  ragged_cache<pos_t> pc() { return {pos.data(), cu.data(), lens.data(), H, 1, 1}; }
  /// What an engine does with a driver's answer: compact keys, values and positions at once.
  void compact(ragged_positions kept) { REQUIRE(compact_layer(seq, kc(), vc(), pc(), kept).ok()); }
  /// The same with three compact_inplace calls (the lengths copied, the caches share them).
  void compact_by_stages(ragged_positions kept) {
    auto with_scratch = [&](auto c) {
      std::copy(lens.begin(), lens.end(), scratch.begin());
      c.lens = scratch.data();
      return c;
    };
    REQUIRE(compact_inplace(seq, with_scratch(kc()), kept).ok());
    REQUIRE(compact_inplace(seq, with_scratch(vc()), kept).ok());
    ragged_cache<pos_t> pc{pos.data(), cu.data(), lens.data(), H, 1, 1};
    REQUIRE(compact_inplace(seq, pc, kept).ok());
  }
};

std::vector<engine_layer> make_layers(index_t L, index_t H, index_t d, index_t C) {
  std::vector<engine_layer> v;
  for (index_t l = 0; l < L; ++l) v.emplace_back(H, d, C);
  return v;
}

/// Kept lists as vectors: [head][i].
std::vector<std::vector<pos_t>> to_lists(ragged_positions k) {
  std::vector<std::vector<pos_t>> out(static_cast<std::size_t>(k.heads));
  for (index_t h = 0; h < k.heads; ++h) out[static_cast<std::size_t>(h)].assign(k.pos + k.cu[h], k.pos + k.cu[h + 1]);
  return out;
}

struct aligned_buf {
  std::vector<unsigned char> b;
  void* get(std::size_t n) {
    b.assign(n + 64, 0);
    return b.data() + (64 - reinterpret_cast<std::uintptr_t>(b.data()) % 64) % 64;
  }
};
template <class Driver, class Backend>
workspace make_ws(const Driver& d, Backend be, aligned_buf& buf) {
  const std::size_t n = value_of(d.workspace_bytes(be));
  return kvtest::shifted_workspace(buf.b, n, 0, true);  // every driver runs on a misaligned workspace
}

// ------------------------------------------------------------------------------------------------
// References

/// The recipe's scores of one head's rows, materialised densely: keys / values of `rows`
/// (positions) copied into contiguous buffers, queries of the group copied, recipe_scores(seq).
std::vector<float> ref_head_scores(const recipe& r, const synth& s, index_t l, index_t h, const std::vector<pos_t>& rows,
                                   const std::vector<float>& qblock, index_t qrows, const std::vector<float>* block_keys) {
  const auto n = static_cast<index_t>(rows.size());
  const index_t g = s.Hq / s.H, d = s.d;
  std::vector<float> k(static_cast<std::size_t>(std::max<index_t>(1, n * d))), v(k.size());
  for (index_t i = 0; i < n; ++i) {
    std::copy(s.key(l, rows[i], h), s.key(l, rows[i], h) + d, k.begin() + i * d);
    std::copy(s.value(l, rows[i], h), s.value(l, rows[i], h) + d, v.begin() + i * d);
  }
  std::vector<float> qg(static_cast<std::size_t>(std::max<index_t>(1, g * qrows * d)));
  for (index_t j = 0; j < g * qrows * d; ++j) qg[j] = qblock[(h * g) * qrows * d + j];
  std::vector<float> bk;
  kv_view<const float> bkv{};
  if (block_keys != nullptr && !block_keys->empty()) {
    bk.assign(block_keys->begin() + h * qrows * d, block_keys->begin() + (h + 1) * qrows * d);
    bkv = value_of(make_kv_view<const float>(bk.data(), 1, qrows, d));
  }
  std::vector<float> out(static_cast<std::size_t>(std::max<index_t>(1, n)));
  if (n == 0) return {};
  const auto kq = uses_attention(r.kind) ? value_of(make_kv_view<const float>(qg.data(), g, qrows, d)) : kv_view<const float>{};
  const auto kk = value_of(make_kv_view<const float>(k.data(), 1, n, d));
  const auto vv = value_of(make_kv_view<const float>(v.data(), 1, n, d));
  const auto sv = value_of(make_matrix_view(out.data(), 1, n));
  workspace ws;
  REQUIRE(recipe_scores(seq, ws, r, kq, kk, vv, sv, bkv).ok());
  std::vector<unsigned char> buf;
  ws = kvtest::shifted_workspace(buf, ws.bytes);
  const status st = recipe_scores(seq, ws, r, kq, kk, vv, sv, bkv);
  REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
  out.resize(static_cast<std::size_t>(n));
  return out;
}

/// What an engine or a trained scorer hands to add_layer_scores / step_scores: recipe r's scores
/// of every head's rows of `lay`, [H][C] (row h: its first lens[h] columns).
std::vector<float> layer_scores(const recipe& r, const synth& s, index_t l, const engine_layer& lay,
                                const std::vector<float>& qblock, index_t qrows, const std::vector<float>* block_keys) {
  std::vector<float> out(static_cast<std::size_t>(lay.H * lay.C), 0.f);
  for (index_t h = 0; h < lay.H; ++h) {
    const auto sc = ref_head_scores(r, s, l, h, lay.positions(h), qblock, qrows, block_keys);
    std::copy(sc.begin(), sc.end(), out.begin() + h * lay.C);
  }
  return out;
}

matrix_view<const float> scores_view(const std::vector<float>& sc, index_t H, index_t C) {
  return value_of(make_matrix_view<const float>(sc.data(), H, C));
}

/// Selection order of the library: higher first, ties to the lower (head, row).
struct entry {
  float score;
  index_t head, row;
};
bool better(const entry& a, const entry& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.head != b.head) return a.head < b.head;
  return a.row < b.row;
}
/// Top-k rows of one head by a full sort, returned ascending.
std::vector<pos_t> ref_topk(const std::vector<float>& sc, index_t k) {
  std::vector<entry> e;
  for (std::size_t i = 0; i < sc.size(); ++i) e.push_back({sc[i], 0, static_cast<index_t>(i)});
  std::sort(e.begin(), e.end(), better);
  std::vector<pos_t> out;
  for (index_t i = 0; i < k; ++i) out.push_back(static_cast<pos_t>(e[i].row));
  std::sort(out.begin(), out.end());
  return out;
}
/// Flattened: each head first keeps its top floors[h] rows, then the best `total - sum(floors)`
/// remaining (head, row) entries of the layer jointly. Rows ascending per head.
std::vector<std::vector<pos_t>> ref_flat(const std::vector<std::vector<float>>& sc, index_t total,
                                         const std::vector<index_t>& floors = {}) {
  const auto H = static_cast<index_t>(sc.size());
  std::vector<std::vector<pos_t>> out(sc.size());
  std::vector<entry> rest;
  index_t left = total;
  for (index_t h = 0; h < H; ++h) {
    std::vector<entry> e;
    for (std::size_t i = 0; i < sc[h].size(); ++i) e.push_back({sc[h][i], h, static_cast<index_t>(i)});
    std::sort(e.begin(), e.end(), better);
    const index_t f = floors.empty() ? 0 : floors[h];
    for (index_t i = 0; i < static_cast<index_t>(e.size()); ++i) {
      if (i < f) out[h].push_back(static_cast<pos_t>(e[i].row));
      else rest.push_back(e[i]);
    }
    left -= f;
  }
  std::sort(rest.begin(), rest.end(), better);
  for (index_t i = 0; i < left; ++i) out[rest[i].head].push_back(static_cast<pos_t>(rest[i].row));
  for (auto& o : out) std::sort(o.begin(), o.end());
  return out;
}

/// Rows -> original positions.
std::vector<pos_t> rows_to_positions(const std::vector<pos_t>& rows_held, const std::vector<pos_t>& kept_rows) {
  std::vector<pos_t> out;
  for (pos_t r : kept_rows) out.push_back(rows_held[static_cast<std::size_t>(r)]);
  return out;
}

/// The recorder's schedule of (layer, head) as evicted_at per position (-1 = never).
[[maybe_unused]] std::vector<pos_t> recorded(const eviction_recorder& rec, index_t l, index_t h, index_t n) {
  std::vector<pos_t> out;
  for (index_t j = 0; j < n; ++j) {
    const pos_t e = rec.storage()(l, h, j);
    out.push_back(e == never_evicted ? -1 : e);
  }
  return out;
}

/// Naive footprint of a set of evicted_at rows (-1 = never) over n tokens: resident keys summed
/// over query positions, and the peak of their total.
struct naive_usage {
  std::int64_t resident = 0, peak = 0;
};
[[maybe_unused]] naive_usage naive_kv_usage(const std::vector<std::vector<pos_t>>& rows, index_t n) {
  naive_usage u;
  for (index_t i = 0; i < n; ++i) {
    std::int64_t now = 0;
    for (const auto& r : rows)
      for (index_t j = 0; j <= i; ++j)
        if (r[j] < 0 || i < r[j]) ++now;
    u.resident += now;
    u.peak = std::max(u.peak, now);
  }
  return u;
}

recipe small_window(recipe r, index_t w) {
  r.window = w;
  r.n_recent = w;
  return r;
}

}  // namespace

// =================================================================================================
// Views

TEST_CASE("drivers: ragged_from_dense views head-major caches without copying") {
  std::vector<float> buf(3 * 10 * 4);
  std::iota(buf.begin(), buf.end(), 0.f);
  std::int32_t cu[4], lens[3];
  // padded capacity: 3 heads x 7 tokens inside rows of 10 per head
  auto dense = value_of(make_kv_view<const float>(buf.data(), 3, 7, 4, 40, 4));
  auto rc = value_of(ragged_from_dense(dense, cu, lens));
  CHECK(rc.data == buf.data());
  CHECK(cu[0] == 0);
  CHECK(cu[1] == 10);
  CHECK(cu[3] == 30);
  CHECK(lens[2] == 7);
  for (index_t h = 0; h < 3; ++h)
    for (index_t t = 0; t < 7; ++t)
      for (index_t e = 0; e < 4; ++e) CHECK(rc.row(h, t)[e] == dense(h, t, e));
  // one head: capacity = T
  auto one = value_of(make_kv_view<const float>(buf.data(), 1, 5, 4));
  auto r1 = value_of(ragged_from_dense(one, cu, lens));
  CHECK(cu[1] == 5);
  CHECK(r1.row_stride == 4);
  // token-major is not a ragged cache
  auto tm = value_of(make_kv_view<const float>(buf.data(), 3, 7, 4, kv_layout::token_major));
  require_error(ragged_from_dense(tm, cu, lens).error(), errc::invalid_argument, "is not a multiple >= 7 tokens");
  auto strided_dim = value_of(make_kv_view<const float>(buf.data(), 2, 3, 4, 60, 20, 2));
  require_error(ragged_from_dense(strided_dim, cu, lens).error(), errc::invalid_argument, "rows must be contiguous");
  require_error(ragged_from_dense(dense, nullptr, lens).error(), errc::null_pointer, "cu_capacity is null");
  require_error(ragged_from_dense(dense, cu, nullptr).error(), errc::null_pointer, "lens is null");
  std::int32_t* inside = reinterpret_cast<std::int32_t*>(buf.data());
  require_error(ragged_from_dense(dense, inside, lens).error(), errc::overlap, "overlap");
}

TEST_CASE("drivers: make_layer_kv from a positions cache checks its layout") {
  engine_layer e(2, 4, 8);
  ragged_cache<pos_t> pc{e.pos.data(), e.cu.data(), e.lens.data(), 2, 1, 1};
  auto lk = value_of(make_layer_kv(e.kc(), e.vc(), pc));
  CHECK(lk.positions == e.pos.data());
  CHECK(lk.keys.data == e.keys.data());
  ragged_cache<pos_t> wide{e.pos.data(), e.cu.data(), e.lens.data(), 2, 2, 2};
  require_error(make_layer_kv(e.kc(), e.vc(), wide).error(), errc::shape_mismatch, "dim 1 and row stride 1");
  std::vector<std::int32_t> other_cu = {0, 4, 16};
  ragged_cache<pos_t> shifted{e.pos.data(), other_cu.data(), e.lens.data(), 2, 1, 1};
  require_error(make_layer_kv(e.kc(), e.vc(), shifted).error(), errc::shape_mismatch, "positions.cu_capacity[1] = 4");
  ragged_cache<pos_t> three{e.pos.data(), e.cu.data(), e.lens.data(), 3, 1, 1};
  require_error(make_layer_kv(e.kc(), e.vc(), three).error(), errc::shape_mismatch, "positions have 3 heads");
}

// =================================================================================================
// Post-fill

namespace {

struct pf_setup {
  synth s;
  index_t P = 0, ext = 0;  // prompt length, external block rows (positions [P, P + ext))
  bool ragged = false;
  bool block_keys = false;
};

/// The query block of a recipe after the prefill of P tokens (positions), and its rows.
std::vector<pos_t> pf_query_positions(const recipe& r, index_t P, index_t ext) {
  switch (r.kind) {
    case recipe_kind::knorm:
    case recipe_kind::streaming_llm: return {};
    case recipe_kind::h2o: return range_of(0, P);
    case recipe_kind::tova: return range_of(P - 1, P);
    default: return r.source == query_source::external_block ? range_of(P, P + ext) : range_of(P - r.window, P);
  }
}

/// Fills every layer with the prompt: dense (all positions) or ragged (each head drops a random
/// 30% of the positions before the last `tail` ones).
std::vector<engine_layer> pf_layers(const pf_setup& u, index_t tail, std::uint64_t seed) {
  auto layers = make_layers(u.s.L, u.s.H, u.s.d, u.P);
  auto g = kvtest::rng(seed);
  for (index_t l = 0; l < u.s.L; ++l)
    for (index_t h = 0; h < u.s.H; ++h)
      for (index_t p = 0; p < u.P; ++p)
        if (!u.ragged || p >= u.P - tail || kvtest::uniform_int(g, 0, 9) >= 3)
          layers[static_cast<std::size_t>(l)].push(u.s, l, h, static_cast<pos_t>(p));
  return layers;
}

/// Runs the post-fill driver; returns the kept positions [layer][head] and compacts the layers.
template <class Backend>
std::vector<std::vector<std::vector<pos_t>>> run_post_fill(Backend be, const post_fill_config& cfg, const pf_setup& u,
                                                           std::vector<engine_layer>& layers,
                                                           const std::vector<double>& weights,
                                                           eviction_recorder* rec = nullptr, bool by_scores = false) {
  std::vector<unsigned char> mem(value_of(post_fill_driver::state_bytes(cfg)));
  post_fill_driver d;
  REQUIRE(d.init(cfg, mem.data(), mem.size(), rec).ok());
  aligned_buf wb;
  workspace ws = make_ws(d, be, wb);
  workspace q;  // the two-phase query reports the same size
  REQUIRE(d.add_layer(be, q, 0, layers[0].view(), kv_view<const float>{}).ok());
  CHECK(q.bytes == ws.bytes);
  const auto qpos = pf_query_positions(cfg.rec, u.P, u.ext);
  const auto qr = static_cast<index_t>(qpos.size());
  for (index_t l = 0; l < u.s.L; ++l) {
    const auto qb = gather_queries(u.s, l, qpos);
    const auto bk = u.block_keys ? gather_keys(u.s, l, qpos) : std::vector<float>{};
    const double wl = weights.empty() ? 0.0 : weights[static_cast<std::size_t>(l)];
    const auto& lay = layers[static_cast<std::size_t>(l)];
    // by_scores: the engine scores with the recipe itself and hands the scores over
    const auto sc = by_scores ? layer_scores(cfg.rec, u.s, l, lay, qb, qr, &bk) : std::vector<float>{};
    const status st = by_scores ? d.add_layer_scores(be, ws, l, layers[static_cast<std::size_t>(l)].view(),
                                                     scores_view(sc, u.s.H, lay.C), wl)
                                : d.add_layer(be, ws, l, layers[static_cast<std::size_t>(l)].view(),
                                              block_view(qb, u.s.Hq, qr, u.s.d),
                                              u.block_keys ? block_view(bk, u.s.H, qr, u.s.d) : kv_view<const float>{}, wl);
    REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    const bool per_layer = cfg.alloc.kind != allocator::lava && cfg.alloc.kind != allocator::cake;
    CHECK(d.ready(l) == per_layer);
  }
  const status st = d.decide(be, ws);
  REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
  std::vector<std::vector<std::vector<pos_t>>> out;
  for (index_t l = 0; l < u.s.L; ++l) {
    REQUIRE(d.ready(l));
    auto& e = layers[static_cast<std::size_t>(l)];
    std::vector<std::vector<pos_t>> per;
    const auto k = d.kept(l);
    for (index_t h = 0; h < u.s.H; ++h)
      per.push_back(rows_to_positions(e.positions(h), to_lists(k)[static_cast<std::size_t>(h)]));
    e.compact(k);
    for (index_t h = 0; h < u.s.H; ++h) CHECK(e.positions(h) == per[static_cast<std::size_t>(h)]);
    out.push_back(per);
  }
  return out;
}

/// The post-fill reference: every layer's heads scored densely, budgets from the allocator's
/// formula, selection by full sorts.
std::vector<std::vector<std::vector<pos_t>>> ref_post_fill(const post_fill_config& cfg, const pf_setup& u,
                                                           const std::vector<engine_layer>& layers,
                                                           const std::vector<double>& weights) {
  const index_t L = u.s.L, H = u.s.H;
  const recipe& r = cfg.rec;
  const auto qpos = pf_query_positions(r, u.P, u.ext);
  const auto qr = static_cast<index_t>(qpos.size());
  std::vector<std::vector<std::vector<float>>> sc(static_cast<std::size_t>(L));
  std::vector<std::vector<std::vector<pos_t>>> held(static_cast<std::size_t>(L));
  for (index_t l = 0; l < L; ++l) {
    const auto qb = gather_queries(u.s, l, qpos);
    const auto bk = u.block_keys ? gather_keys(u.s, l, qpos) : std::vector<float>{};
    for (index_t h = 0; h < H; ++h) {
      held[l].push_back(layers[static_cast<std::size_t>(l)].positions(h));
      sc[l].push_back(ref_head_scores(r, u.s, l, h, held[l][h], qb, qr, &bk));
    }
  }
  const auto W = [&](index_t n) { return protected_count(n, r.n_sink, r.n_recent); };
  std::vector<std::vector<std::vector<pos_t>>> rows(static_cast<std::size_t>(L));
  if (cfg.alloc.kind == allocator::lava) {
    std::vector<double> e(static_cast<std::size_t>(L));
    std::vector<index_t> caps, share(static_cast<std::size_t>(L));
    index_t prot = 0;
    for (index_t l = 0; l < L; ++l) {
      // the entropy of the layer's scores as lava_layer_entropy defines it (tested in test_budget)
      std::vector<float> m(static_cast<std::size_t>(H * u.P), 0.f);
      std::vector<std::int32_t> lens;
      index_t wl = 0, nl = 0;
      for (index_t h = 0; h < H; ++h) {
        std::copy(sc[l][h].begin(), sc[l][h].end(), m.begin() + h * u.P);
        lens.push_back(static_cast<std::int32_t>(sc[l][h].size()));
        wl += W(lens.back());
        nl += lens.back();
      }
      lava_entropy_options eo;
      eo.prot = {r.n_sink, r.n_recent};
      REQUIRE(lava_layer_entropy(seq, value_of(make_matrix_view<const float>(m.data(), H, u.P)), lens.data(), eo,
                                 &e[static_cast<std::size_t>(l)])
                  .ok());
      caps.push_back(nl - wl);
      prot += wl;
    }
    REQUIRE(apportion(cfg.alloc.total - prot, e.data(), caps.data(), L, share.data()).ok());
    for (index_t l = 0; l < L; ++l) {
      index_t wl = 0;
      for (index_t h = 0; h < H; ++h) wl += W(static_cast<index_t>(sc[l][h].size()));
      rows[l] = ref_flat(sc[l], wl + share[l]);
    }
  } else if (cfg.alloc.kind == allocator::cake) {
    std::vector<std::int32_t> b(static_cast<std::size_t>(L * H));
    REQUIRE(cake_budgets(weights.data(), cfg.alloc.total / (L * H), u.P, {r.n_sink, r.n_recent},
                         value_of(make_matrix_view(b.data(), L, H)))
                .ok());
    for (index_t l = 0; l < L; ++l)
      for (index_t h = 0; h < H; ++h) rows[l].push_back(ref_topk(sc[l][h], b[l * H + h]));
  } else {
    for (index_t l = 0; l < L; ++l) {
      index_t sum = 0;
      for (index_t h = 0; h < H; ++h) sum += cfg.alloc.budgets(l, h);
      if (cfg.alloc.kind == allocator::per_head) {
        for (index_t h = 0; h < H; ++h) rows[l].push_back(ref_topk(sc[l][h], cfg.alloc.budgets(l, h)));
      } else if (cfg.alloc.kind == allocator::flattened) {
        rows[l] = ref_flat(sc[l], sum);
      } else {  // adakv: floors first, then the layer's best
        std::vector<index_t> floors;
        for (index_t h = 0; h < H; ++h) {
          const auto n = static_cast<index_t>(sc[l][h].size());
          floors.push_back(adakv_head_floor(sum / H, n, W(n), cfg.alloc.adakv_alpha, cfg.alloc.floor_rule));
        }
        rows[l] = ref_flat(sc[l], sum, floors);
      }
    }
  }
  std::vector<std::vector<std::vector<pos_t>>> out(static_cast<std::size_t>(L));
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h) out[l].push_back(rows_to_positions(held[l][h], rows[l][h]));
  return out;
}

}  // namespace

TEST_CASE("drivers: post-fill with per-layer allocators matches the reference (recipes, GQA, ragged caches)") {
  std::vector<recipe> recipes = {small_window(recipe::snapkv(), 6), recipe::h2o(), recipe::tova(),
                                 recipe::knorm(), recipe::streaming_llm(2), small_window(recipe::lava(), 5),
                                 small_window(recipe::vatp(), 4), small_window(recipe::cake(), 4)};
  recipe ext = recipe::snapkv();
  ext.source = query_source::external_block;
  ext.n_recent = 0;
  ext.n_sink = 2;
  recipes.push_back(ext);
  recipes[1].n_recent = 4;
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 4; ++seed)
    for (std::size_t ri = 0; ri < recipes.size(); ++ri)
      for (allocator kind : {allocator::per_head, allocator::flattened, allocator::adakv}) {
        auto g = kvtest::rng(seed * 131 + ri * 7 + static_cast<std::uint64_t>(kind));
        const recipe r = recipes[ri];
        pf_setup u;
        const index_t L = kvtest::uniform_int(g, 1, 3), H = kvtest::uniform_int(g, 1, 3);
        const index_t Hq = H * kvtest::uniform_int(g, 1, 3), d = kvtest::uniform_int(g, 2, 9);
        u.P = kvtest::uniform_int(g, 24, 60);
        u.ext = 5;
        u.s = make_synth(seed * 1000 + ri, L, H, Hq, d, u.P + u.ext);
        u.ragged = r.kind != recipe_kind::h2o && seed % 2 == 0;
        u.block_keys = r.source == query_source::external_block && seed % 2 == 1;
        const index_t tail = r.kind == recipe_kind::tova ? 1 : (uses_attention(r.kind) && r.source == query_source::prompt_window ? r.window : 0);
        auto layers = pf_layers(u, tail, seed);
        index_t min_len = u.P;
        for (auto& e : layers)
          for (index_t h = 0; h < H; ++h) min_len = std::min<index_t>(min_len, e.lens[static_cast<std::size_t>(h)]);
        const index_t W = protected_count(min_len, r.n_sink, r.n_recent);
        const index_t B = kvtest::uniform_int(g, W, min_len);
        std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(B));
        if (kind == allocator::per_head)  // a different budget per head, within what every head holds
          for (auto& b : budgets) b = static_cast<std::int32_t>(kvtest::uniform_int(g, W, min_len));
        post_fill_config cfg;
        cfg.model = {L, H, Hq, d};
        cfg.tokens = u.P;
        cfg.rec = r;
        cfg.query_rows = r.source == query_source::external_block && uses_attention(r.kind) && r.kind != recipe_kind::h2o &&
                                 r.kind != recipe_kind::tova
                             ? u.ext
                             : 0;
        cfg.alloc.kind = kind;
        cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
        cfg.alloc.adakv_alpha = seed % 2 ? 0.2 : 0.5;
        cfg.alloc.floor_rule = seed % 3 ? adakv_floor::budget : adakv_floor::evictable;
        CAPTURE(seed);
        CAPTURE(ri);
        CAPTURE(static_cast<int>(kind));
        const auto ref = ref_post_fill(cfg, u, layers, {});
        auto layers_par = layers, layers_sc = layers;
        const auto got = run_post_fill(seq, cfg, u, layers, {});
        const auto got_par = run_post_fill(par, cfg, u, layers_par, {});
        REQUIRE(got == ref);
        REQUIRE(got_par == got);
        // add_layer_scores fed recipe_scores' output == add_layer
        REQUIRE(run_post_fill(seq, cfg, u, layers_sc, {}, nullptr, true) == got);
        ++cases;
      }
  CHECK(cases == 4 * 9 * 3);
}

TEST_CASE("drivers: post-fill across tensor-parallel ranks keeps the single-process rows (flattened, adakv, lava, cake)") {
  for (std::uint64_t seed = 1; seed <= 6; ++seed)
    for (allocator kind : {allocator::flattened, allocator::adakv, allocator::lava, allocator::cake})
      for (int ranks : {2, 3}) {
        auto g = kvtest::rng(seed * 17 + static_cast<std::uint64_t>(kind) * 5 + static_cast<std::uint64_t>(ranks));
        const index_t L = kvtest::uniform_int(g, 1, 3), Hl = kvtest::uniform_int(g, 1, 2), H = Hl * ranks;
        const index_t d = 4, P = kvtest::uniform_int(g, 20, 40), w = 4;
        const recipe r = small_window(recipe::snapkv(), w);
        const synth s = make_synth(seed, L, H, H, d, P);
        const index_t B = kvtest::uniform_int(g, w, P);
        std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(B));
        post_fill_config cfg;
        cfg.model = {L, H, H, d};
        cfg.tokens = P;
        cfg.rec = r;
        cfg.alloc.kind = kind;
        const bool all_layer = kind == allocator::lava || kind == allocator::cake;
        if (all_layer) cfg.alloc.total = L * H * B;  // the model's total over every rank's heads
        else cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
        std::vector<double> prefs(static_cast<std::size_t>(L));  // cake: the layers' preferences
        for (double& p : prefs) p = 0.01 * static_cast<double>(kvtest::uniform_int(g, 0, 200));
        // every layer's scores, computed once: the single-process driver and the ranks get the same
        std::vector<std::vector<float>> scores;
        for (index_t l = 0; l < L; ++l) {
          engine_layer e(H, d, P);
          e.append(s, l, 0, P);
          scores.push_back(layer_scores(r, s, l, e, gather_queries(s, l, range_of(P - w, P)), w, nullptr));
        }
        // bad_rank >= 0: that rank's scores hold a NaN in the last layer (every rank must fail)
        const auto run = [&](post_fill_driver& drv, const post_fill_config& c, index_t first, int bad_rank, int rank)
            -> status {
          const index_t n = c.model.kv_heads;
          aligned_buf wb;
          workspace ws = make_ws(drv, seq, wb);
          for (index_t l = 0; l < L; ++l) {
            engine_layer e(n, d, P);
            e.append(s, l, 0, P);
            std::vector<float> mine(scores[static_cast<std::size_t>(l)].begin() + first * P,
                                    scores[static_cast<std::size_t>(l)].begin() + (first + n) * P);
            if (rank == bad_rank && l == L - 1) mine[1] = std::numeric_limits<float>::quiet_NaN();
            KVEVICT_TRY(drv.add_layer_scores(seq, ws, l, e.view(), scores_view(mine, n, P), prefs[static_cast<std::size_t>(l)]));
          }
          return drv.decide(seq, ws);
        };
        std::vector<unsigned char> mem(value_of(post_fill_driver::state_bytes(cfg)));
        post_fill_driver one;
        REQUIRE(one.init(cfg, mem.data(), mem.size()).ok());
        REQUIRE(run(one, cfg, 0, -1, 0).ok());
        for (int bad_rank : {-1, ranks - 1}) {
          std::vector<std::string> errors(static_cast<std::size_t>(ranks));
          std::vector<std::vector<std::vector<std::vector<pos_t>>>> kept(static_cast<std::size_t>(ranks));
          kvtest::thread_world::run(ranks, [&](kvtest::thread_comm& c) {
            const auto me = static_cast<std::size_t>(c.rank());
            post_fill_config rc = cfg;
            rc.model.kv_heads = rc.model.query_heads = Hl;
            if (!all_layer)
              rc.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data() + Hl * c.rank(), L, Hl, H));
            rc.tp = comm_ref(c);
            post_fill_driver drv;
            std::vector<unsigned char> rm(post_fill_driver::state_bytes(rc).value());
            status st = drv.init(rc, rm.data(), rm.size());
            if (st.ok()) st = run(drv, rc, Hl * c.rank(), bad_rank, c.rank());
            errors[me] = st.ok() ? "" : st.message();
            if (st.ok())
              for (index_t l = 0; l < L; ++l) kept[me].push_back(to_lists(drv.kept(l)));
          });
          for (int rk = 0; rk < ranks; ++rk) {
            CAPTURE(seed);
            CAPTURE(static_cast<int>(kind));
            CAPTURE(rk);
            const auto me = static_cast<std::size_t>(rk);
            if (bad_rank >= 0) {  // the same error everywhere, naming the rank (or lava: the head) with the NaN
              if (kind != allocator::lava)
                CHECK(errors[me].find("rank " + std::to_string(bad_rank) + " of " + std::to_string(ranks)) !=
                      std::string::npos);
              CHECK(errors[me].find("NaN") != std::string::npos);
              CHECK(errors[me] == errors[0]);
              continue;
            }
            REQUIRE(errors[me] == "");
            for (index_t l = 0; l < L; ++l) {
              const auto all = to_lists(one.kept(l));
              const std::vector<std::vector<pos_t>> part(all.begin() + Hl * rk, all.begin() + Hl * (rk + 1));
              CHECK(kept[me][static_cast<std::size_t>(l)] == part);
            }
          }
        }
      }
}

TEST_CASE("drivers: post-fill across pipeline stages keeps the single-process rows (lava, cake, adakv)") {
  // every stage holds layer_shard(L, P, r) of the model; lava (ragged heads) and cake gather the
  // layers' statistics in decide(); adakv needs no communicator (per-layer budgets)
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 8; ++seed)
    for (allocator kind : {allocator::lava, allocator::cake, allocator::adakv})
      for (int stages : {2, 3}) {
        auto g = kvtest::rng(seed * 31 + static_cast<std::uint64_t>(kind) * 7 + static_cast<std::uint64_t>(stages));
        pf_setup u;
        const index_t L = kvtest::uniform_int(g, stages, 5), H = kvtest::uniform_int(g, 1, 3), d = 4, w = 4;
        u.P = kvtest::uniform_int(g, 20, 40);
        u.ragged = kind != allocator::cake && seed % 2 == 1;  // cake needs every head to hold the prompt
        u.s = make_synth(seed, L, H, H, d, u.P);
        const recipe r = small_window(kind == allocator::cake ? recipe::cake() : recipe::lava(), w);
        const auto layers = pf_layers(u, w, seed);
        const index_t B = kvtest::uniform_int(g, w, u.P / 2);
        std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(B));
        post_fill_config cfg;
        cfg.model = {L, H, H, d};
        cfg.tokens = u.P;
        cfg.rec = r;
        cfg.alloc.kind = kind;
        if (kind == allocator::adakv) cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
        else cfg.alloc.total = L * H * B;
        std::vector<double> prefs(static_cast<std::size_t>(L));  // cake: the layers' preferences
        for (double& p : prefs) p = 0.01 * static_cast<double>(kvtest::uniform_int(g, 0, 200));
        const auto qpos = range_of(u.P - w, u.P);
        // one stage's (or one process's) driver over layers [first, first + n)
        const auto run = [&](post_fill_driver& drv, index_t first, index_t n, bool nan) -> status {
          aligned_buf wb;
          workspace ws = make_ws(drv, seq, wb);
          status st;
          for (index_t l = first; st.ok() && l < first + n; ++l) {
            const auto qb = gather_queries(u.s, l, qpos);
            auto lay = layers[static_cast<std::size_t>(l)];
            double pref = prefs[static_cast<std::size_t>(l)];
            if (nan && l == first + n - 1) {  // a NaN key (lava's entropy refuses it), a NaN preference (cake)
              lay.keys[0] = std::numeric_limits<float>::quiet_NaN();
              pref = std::numeric_limits<double>::quiet_NaN();
            }
            st = drv.add_layer(seq, ws, l - first, lay.view(), block_view(qb, H, w, d), kv_view<const float>{}, pref);
          }
          const status dec = drv.decide(seq, ws);  // every stage decides, also after a failure
          return st.ok() ? dec : st;
        };
        std::vector<unsigned char> mem(value_of(post_fill_driver::state_bytes(cfg)));
        post_fill_driver one;
        REQUIRE(one.init(cfg, mem.data(), mem.size()).ok());
        REQUIRE(run(one, 0, L, false).ok());
        for (int bad : {-1, stages - 1}) {
          if (bad >= 0 && kind == allocator::adakv) continue;  // no communication: each stage on its own
          std::vector<std::string> errors(static_cast<std::size_t>(stages)), decided(errors.size());
          std::vector<std::vector<std::vector<std::vector<pos_t>>>> kept(errors.size());
          std::vector<std::uint64_t> bytes(errors.size()), calls(errors.size());
          kvtest::thread_world::run(stages, [&](kvtest::thread_comm& c) {
            const auto me = static_cast<std::size_t>(c.rank());
            const shard_range mine = value_of(layer_shard(L, stages, c.rank()));
            post_fill_config rc = cfg;
            rc.model.layers = mine.count;
            rc.first_layer = mine.first;
            rc.model_layers = L;
            counting_comm<kvtest::thread_comm> cc(c);
            rc.pp = comm_ref(cc);
            if (kind == allocator::adakv)
              rc.alloc.budgets =
                  value_of(make_matrix_view<const std::int32_t>(budgets.data() + mine.first * H, mine.count, H));
            post_fill_driver drv;
            std::vector<unsigned char> rm(post_fill_driver::state_bytes(rc).value());
            status st = drv.init(rc, rm.data(), rm.size());
            if (st.ok()) st = run(drv, mine.first, mine.count, c.rank() == bad);
            errors[me] = st.ok() ? "" : st.message();
            decided[me] = drv.decided() ? "yes" : "no";
            bytes[me] = cc.bytes();
            calls[me] = cc.calls();
            if (st.ok())
              for (index_t l = 0; l < mine.count; ++l) kept[me].push_back(to_lists(drv.kept(l)));
          });
          for (int rk = 0; rk < stages; ++rk) {
            CAPTURE(seed);
            CAPTURE(static_cast<int>(kind));
            CAPTURE(rk);
            const auto me = static_cast<std::size_t>(rk);
            if (bad >= 0) {  // the bad stage fails in add_layer, every other in decide, naming the stage
              CHECK(decided[me] == "no");
              if (rk != bad)
                CHECK(errors[me].find("rank " + std::to_string(bad) + " of " + std::to_string(stages)) !=
                      std::string::npos);
              CHECK(errors[me] != "");
              continue;
            }
            REQUIRE(errors[me] == "");
            const shard_range mine = value_of(layer_shard(L, stages, rk));
            for (index_t l = 0; l < mine.count; ++l) CHECK(kept[me][static_cast<std::size_t>(l)] == to_lists(one.kept(mine.first + l)));
            // the agreement (72 bytes), then gathers of L values (an agreement + an allreduce of 2L
            // doubles each): lava's entropies, protected and evictable rows; cake's preferences
            const auto gather = static_cast<std::uint64_t>(72 + 16 * L);
            const std::uint64_t want = kind == allocator::lava ? 72 + 3 * gather : kind == allocator::cake ? 72 + gather : 0;
            CHECK(bytes[me] == want);
            CHECK(calls[me] == (kind == allocator::lava ? 7u : kind == allocator::cake ? 3u : 0u));
          }
          ++cases;
        }
      }
  CHECK(cases == 8 * 2 * 5);
}

TEST_CASE("drivers: post-fill and chunked stage configuration errors") {
  post_fill_config cfg;
  cfg.model = {2, 2, 2, 4};
  cfg.tokens = 16;
  cfg.rec = small_window(recipe::lava(), 4);
  cfg.alloc.kind = allocator::lava;
  cfg.alloc.total = 40;
  cfg.first_layer = 1;  // no pp: one process holds every layer
  require_error(post_fill_driver::state_bytes(cfg).error(), errc::invalid_argument,
                "layers [1, 3) of a model of 2 layers");
  cfg.first_layer = 0;
  cfg.model_layers = 4;
  require_error(post_fill_driver::state_bytes(cfg).error(), errc::invalid_argument,
                "layers [0, 2) of a model of 4 layers (a stage needs a pp communicator");
  kvtest::thread_world::run(2, [&](kvtest::thread_comm& c) {
    post_fill_config rc = cfg;
    rc.pp = comm_ref(c);
    rc.first_layer = 3;  // past the model
    CHECK(post_fill_driver::state_bytes(rc).error().code() == errc::invalid_argument);
    rc.first_layer = 2;
    CHECK(post_fill_driver::state_bytes(rc).ok());
    rc.tp = comm_ref(c);  // tensor and pipeline parallelism together (a grid; test_distributed runs it)
    CHECK(post_fill_driver::state_bytes(rc).ok());
  });
  // the chunked driver's stages: the same checks
  chunked_config cc;
  cc.model = {2, 2, 2, 4};
  cc.tokens = cc.capacity = 16;
  cc.rec = small_window(recipe::lava(), 4);
  cc.alloc.kind = allocator::lava;
  cc.alloc.total = 40;
  cc.first_layer = 1;
  require_error(chunked_driver::state_bytes(cc).error(), errc::invalid_argument, "layers [1, 3) of a model of 2 layers");
  cc.first_layer = 0;
  cc.model_layers = 4;
  require_error(chunked_driver::state_bytes(cc).error(), errc::invalid_argument,
                "layers [0, 2) of a model of 4 layers (a stage needs a pp communicator");
  kvtest::thread_world::run(2, [&](kvtest::thread_comm& c) {
    chunked_config rc = cc;
    rc.pp = comm_ref(c);
    rc.first_layer = 3;
    CHECK(chunked_driver::state_bytes(rc).error().code() == errc::invalid_argument);
    rc.first_layer = 2;
    CHECK(chunked_driver::state_bytes(rc).ok());
    rc.alloc.total = 4 * 2 * 4 - 1;  // below the model's protected rows (4 layers x 2 heads x 4)
    require_error(chunked_driver::state_bytes(rc).error(), errc::invalid_argument, "below the 32 protected tokens");
  });
}

TEST_CASE("drivers: post-fill with uniform budgets and SnapKV equals recipe_scores + recipe_select per layer") {
  for (std::uint64_t seed = 11; seed <= 14; ++seed) {
    auto g = kvtest::rng(seed);
    const index_t L = 3, H = kvtest::uniform_int(g, 1, 4), Hq = H * kvtest::uniform_int(g, 1, 4), d = 16, P = 80;
    const synth s = make_synth(seed, L, H, Hq, d, P);
    const recipe r = small_window(recipe::snapkv(), 8);
    const index_t B = kvtest::uniform_int(g, 8, P);
    std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H));
    REQUIRE(uniform_budgets(B * L * H, P, {r.n_sink, r.n_recent}, value_of(make_matrix_view(budgets.data(), L, H))).ok());
    post_fill_config cfg;
    cfg.model = {L, H, Hq, d};
    cfg.tokens = P;
    cfg.rec = r;
    cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
    std::vector<unsigned char> mem(value_of(post_fill_driver::state_bytes(cfg)));
    post_fill_driver drv;
    REQUIRE(drv.init(cfg, mem.data(), mem.size()).ok());
    aligned_buf wb;
    workspace ws = make_ws(drv, seq, wb);
    for (index_t l = 0; l < L; ++l) {
      // the engine's dense layer [H][P][d] (head-major), viewed as a ragged cache
      std::vector<float> kd(static_cast<std::size_t>(H * P * d)), vd(kd.size());
      std::vector<pos_t> pos(static_cast<std::size_t>(H * P));
      for (index_t h = 0; h < H; ++h)
        for (index_t p = 0; p < P; ++p) {
          std::copy(s.key(l, p, h), s.key(l, p, h) + d, kd.begin() + (h * P + p) * d);
          std::copy(s.value(l, p, h), s.value(l, p, h) + d, vd.begin() + (h * P + p) * d);
          pos[static_cast<std::size_t>(h * P + p)] = static_cast<pos_t>(p);
        }
      const auto kdv = value_of(make_kv_view<const float>(kd.data(), H, P, d));
      const auto vdv = value_of(make_kv_view<const float>(vd.data(), H, P, d));
      std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1)), lens(static_cast<std::size_t>(H));
      const auto kv = make_layer_kv(value_of(ragged_from_dense(kdv, cu.data(), lens.data())),
                                    value_of(ragged_from_dense(vdv, cu.data(), lens.data())), pos.data());
      const auto qb = gather_queries(s, l, range_of(P - 8, P));
      const auto qv = value_of(make_kv_view<const float>(qb.data(), Hq, 8, d));
      REQUIRE(drv.add_layer(seq, ws, l, kv, qv).ok());
      // by hand: the stages on the dense layer
      std::vector<float> sc(static_cast<std::size_t>(H * P));
      workspace rws;
      const auto sv = value_of(make_matrix_view(sc.data(), H, P));
      REQUIRE(recipe_scores(seq, rws, r, qv, kdv, vdv, sv).ok());
      std::vector<unsigned char> rb(rws.bytes);
      rws.data = rb.data();
      REQUIRE(recipe_scores(seq, rws, r, qv, kdv, vdv, sv).ok());
      std::vector<std::int32_t> kcu(static_cast<std::size_t>(H + 1));
      REQUIRE(budget_offsets(cfg.alloc.budgets, l, kcu.data()).ok());
      std::vector<pos_t> kpos(static_cast<std::size_t>(kcu.back()));
      std::vector<unsigned char> sb(select_topk_workspace_bytes(seq, P));
      workspace sws{sb.data(), sb.size()};
      REQUIRE(recipe_select(seq, sws, r, value_of(make_matrix_view<const float>(sc.data(), H, P)),
                            ragged_positions_out{kpos.data(), kcu.data(), H})
                  .ok());
      CHECK(to_lists(drv.kept(l)) == to_lists(ragged_positions{kpos.data(), kcu.data(), H}));
    }
  }
}

TEST_CASE("drivers: post-fill with LAVa and CAKE budgets (all layers) matches the reference") {
  for (std::uint64_t seed = 21; seed <= 28; ++seed) {
    auto g = kvtest::rng(seed);
    pf_setup u;
    const index_t L = kvtest::uniform_int(g, 2, 4), H = kvtest::uniform_int(g, 1, 3), Hq = H * kvtest::uniform_int(g, 1, 2);
    const index_t d = 8;
    u.P = kvtest::uniform_int(g, 30, 64);
    const bool lava_kind = seed % 2 == 1;
    u.ragged = lava_kind && seed % 4 == 1;  // cake needs every head to hold the whole prompt
    u.s = make_synth(seed, L, H, Hq, d, u.P);
    const recipe r = lava_kind ? small_window(recipe::lava(), 6) : small_window(recipe::cake(), 6);
    auto layers = pf_layers(u, r.window, seed);
    post_fill_config cfg;
    cfg.model = {L, H, Hq, d};
    cfg.tokens = u.P;
    cfg.rec = r;
    cfg.alloc.kind = lava_kind ? allocator::lava : allocator::cake;
    std::vector<double> prefs;
    if (lava_kind) {
      index_t rows = 0;
      for (auto& e : layers)
        for (auto n : e.lens) rows += n;
      cfg.alloc.total = kvtest::uniform_int(g, L * H * 6, rows);
    } else {
      cfg.alloc.total = L * H * kvtest::uniform_int(g, 6, u.P);
      for (index_t l = 0; l < L; ++l) prefs.push_back(double(kvtest::uniform_int(g, 1, 100)) / 7.0);
    }
    CAPTURE(seed);
    const auto ref = ref_post_fill(cfg, u, layers, prefs);
    auto layers_par = layers, layers_sc = layers;
    const auto got = run_post_fill(seq, cfg, u, layers, prefs);
    REQUIRE(got == ref);
    REQUIRE(run_post_fill(par, cfg, u, layers_par, prefs) == got);
    REQUIRE(run_post_fill(seq, cfg, u, layers_sc, prefs, nullptr, true) == got);  // add_layer_scores
    index_t kept = 0;
    for (auto& lay : got)
      for (auto& hd : lay) kept += static_cast<index_t>(hd.size());
    CHECK(kept == cfg.alloc.total);  // exact model total
  }
  // dense prompt: the layer totals are lava_layer_budgets' exactly
  {
    pf_setup u;
    u.P = 48;
    u.s = make_synth(77, 4, 2, 4, 8, u.P);
    auto layers = pf_layers(u, 6, 77);
    post_fill_config cfg;
    cfg.model = {4, 2, 4, 8};
    cfg.tokens = u.P;
    cfg.rec = small_window(recipe::lava(), 6);
    cfg.alloc.kind = allocator::lava;
    cfg.alloc.total = 4 * 2 * 20;
    std::vector<unsigned char> mem(value_of(post_fill_driver::state_bytes(cfg)));
    post_fill_driver d;
    REQUIRE(d.init(cfg, mem.data(), mem.size()).ok());
    aligned_buf wb;
    workspace ws = make_ws(d, seq, wb);
    for (index_t l = 0; l < 4; ++l) {
      const auto qb = gather_queries(u.s, l, range_of(u.P - 6, u.P));
      REQUIRE(d.add_layer(seq, ws, l, layers[static_cast<std::size_t>(l)].view(), block_view(qb, 4, 6, 8)).ok());
    }
    REQUIRE(d.decide(seq, ws).ok());
    std::vector<double> e;
    for (index_t l = 0; l < 4; ++l) e.push_back(d.layer_weight(l));
    std::vector<index_t> totals(4);
    REQUIRE(lava_layer_budgets(e.data(), 4, 2, u.P, {0, 6}, cfg.alloc.total, totals.data()).ok());
    for (index_t l = 0; l < 4; ++l) CHECK(d.layer_total(l) == totals[static_cast<std::size_t>(l)]);
    CHECK(e[0] > e[3]);  // the sharper layers are more certain
  }
}

TEST_CASE("drivers: post-fill footprint equals the metrics closed form; full budgets give 100%") {
  const index_t L = 2, H = 2, Hq = 4, d = 8, P = 50, G = 13, N = P + G, B = 20;
  pf_setup u;
  u.P = P;
  u.s = make_synth(5, L, H, Hq, d, P);
  for (index_t budget : {B, P}) {
    auto layers = pf_layers(u, 8, 5);
    std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(budget));
    post_fill_config cfg;
    cfg.model = {L, H, Hq, d};
    cfg.tokens = P;
    cfg.rec = small_window(recipe::snapkv(), 8);
    cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
    std::vector<pos_t> store(static_cast<std::size_t>(L * H * N));
    auto rec = value_of(make_eviction_recorder(store.data(), L, H, N));
    run_post_fill(seq, cfg, u, layers, {}, &rec);
    // the G decode tokens are never evicted: the recorder already says so
    std::vector<std::int64_t> tmp(static_cast<std::size_t>(N) + 8);  // + 64 B: the carver's base padding
    workspace mws{tmp.data(), tmp.size() * sizeof(std::int64_t)};
    kv_usage usage;
    REQUIRE(measure_kv_usage(mws, value_of(rec.schedule(N)), usage).ok());
    const std::int64_t per_row = P * (P + 1) / 2 + G * budget + G * (G + 1) / 2;
    CHECK(usage.resident == per_row * L * H);
    CHECK(usage.footprint() == doctest::Approx(1.0 - 2.0 * double(G * (P - budget)) / double(N * (N + 1))));
    CHECK(usage.peak == std::max(P, budget + G) * L * H);
    if (budget == P) CHECK(usage.footprint() == 1.0);
  }
}

// =================================================================================================
// Layer-by-layer cascading

TEST_CASE("drivers: cascading equals layer_cascade used by hand; the engine's caches follow; peak bounded") {
  for (std::uint64_t seed = 31; seed <= 38; ++seed) {
    auto g = kvtest::rng(seed);
    const index_t L = kvtest::uniform_int(g, 2, 5), H = kvtest::uniform_int(g, 1, 3), Hq = H * kvtest::uniform_int(g, 1, 3);
    const index_t d = 8, N = kvtest::uniform_int(g, 24, 56), w = 5;
    const synth s = make_synth(seed, L, H, Hq, d, N);
    const bool lava_split = seed % 2 == 1;
    const recipe r = lava_split ? small_window(recipe::lava(), w) : small_window(recipe::cake(), w);
    cascade_driver_config cfg;
    cfg.model = {L, H, Hq, d};
    cfg.tokens = N;
    cfg.rec = r;
    cfg.split = lava_split ? cascade_split::flattened : cascade_split::per_head;
    cfg.weight = lava_split ? weight_source::lava_entropy : weight_source::caller;
    cfg.total = lava_split ? kvtest::uniform_int(g, L * H * w, L * H * N) : H * kvtest::uniform_int(g, L * w, L * N);
    std::vector<double> prefs;
    for (index_t l = 0; l < L; ++l) prefs.push_back(double(kvtest::uniform_int(g, 1, 50)));
    CAPTURE(seed);
    // the driver, over an engine that compacts what it is told
    std::vector<unsigned char> mem(value_of(cascade_driver::state_bytes(cfg)));
    std::vector<pos_t> store(static_cast<std::size_t>(L * H * N));
    auto rec = value_of(make_eviction_recorder(store.data(), L, H, N));
    cascade_driver drv;
    REQUIRE(drv.init(cfg, mem.data(), mem.size(), &rec).ok());
    aligned_buf wb;
    workspace ws = make_ws(drv, seq, wb);
    // a second driver fed the engine's own scores (add_layer_scores)
    std::vector<unsigned char> mem_sc(mem.size());
    cascade_driver drv_sc;
    REQUIRE(drv_sc.init(cfg, mem_sc.data(), mem_sc.size()).ok());
    aligned_buf wb_sc;
    workspace ws_sc = make_ws(drv_sc, seq, wb_sc);
    // by hand: the same stages and a layer_cascade of its own
    cascade_config cc{L, H, N, {r.n_sink, r.n_recent}, cfg.total, cfg.split};
    std::vector<unsigned char> cmem(value_of(layer_cascade::state_bytes(cc)));
    layer_cascade hand;
    REQUIRE(hand.init(cc, cmem.data(), cmem.size()).ok());
    auto layers = make_layers(L, H, d, N);
    index_t peak = 0;
    for (index_t l = 0; l < L; ++l) {
      auto& e = layers[static_cast<std::size_t>(l)];
      e.append(s, l, 0, N);
      const auto qb = gather_queries(s, l, range_of(N - w, N));
      const auto qv = block_view(qb, Hq, w, d);
      REQUIRE(drv.add_layer(seq, ws, l, e.view(), qv, kv_view<const float>{}, prefs[static_cast<std::size_t>(l)]).ok());
      std::vector<float> sc(static_cast<std::size_t>(H * N));
      std::vector<std::vector<float>> per;
      for (index_t h = 0; h < H; ++h) {
        per.push_back(ref_head_scores(r, s, l, h, range_of(0, N), qb, w, nullptr));
        std::copy(per.back().begin(), per.back().end(), sc.begin() + h * N);
      }
      const auto sv = value_of(make_matrix_view<const float>(sc.data(), H, N));
      REQUIRE(drv_sc.add_layer_scores(seq, ws_sc, l, e.view(), sv, prefs[static_cast<std::size_t>(l)]).ok());
      CHECK(drv_sc.layer_weight(l) == drv.layer_weight(l));
      for (index_t j = 0; j <= l; ++j) {
        CHECK(drv_sc.changed(j) == drv.changed(j));
        CHECK(to_lists(drv_sc.kept(j)) == to_lists(drv.kept(j)));
      }
      double weight = prefs[static_cast<std::size_t>(l)];
      if (lava_split) {
        lava_entropy_options eo;
        eo.prot = {r.n_sink, r.n_recent};
        REQUIRE(lava_layer_entropy(seq, sv, nullptr, eo, &weight).ok());
      }
      peak = std::max(peak, hand.held_total() + H * N);
      workspace hq;
      REQUIRE(hand.add_layer(seq, hq, l, sv, weight).ok());
      std::vector<unsigned char> hb(hq.bytes);
      hq.data = hb.data();
      REQUIRE(hand.add_layer(seq, hq, l, sv, weight).ok());
      for (index_t j = 0; j <= l; ++j) {
        CHECK(drv.changed(j) == hand.changed(j));
        CHECK(to_lists(drv.kept(j)) == to_lists(hand.kept(j)));
        CHECK(to_lists(drv.positions(j)) == to_lists(hand.positions(j)));
        if (drv.changed(j)) layers[static_cast<std::size_t>(j)].compact(drv.kept(j));
        const auto pj = to_lists(drv.positions(j));
        for (index_t h = 0; h < H; ++h) CHECK(layers[static_cast<std::size_t>(j)].positions(h) == pj[static_cast<std::size_t>(h)]);
      }
      CHECK(drv.held_rows() == hand.held_total());
      CHECK(drv.peak_rows() == peak);
      CHECK(drv.peak_rows() <= cfg.total + H * N);
    }
    CHECK(drv.held_rows() == cfg.total);
    // recorder: a key is evicted at step N iff its layer no longer holds it
    for (index_t l = 0; l < L; ++l) {
      const auto pl = to_lists(drv.positions(l));
      for (index_t h = 0; h < H; ++h)
        for (index_t p = 0; p < N; ++p) {
          const bool held = std::binary_search(pl[h].begin(), pl[h].end(), static_cast<pos_t>(p));
          CHECK(rec.storage()(l, h, p) == (held ? never_evicted : static_cast<pos_t>(N)));
        }
    }
    // layer l prefilled into a fresh engine cache and handed to `into`
    const auto prefill = [&](cascade_driver& into, auto be, workspace& into_ws, index_t l) {
      engine_layer e(H, d, N);
      e.append(s, l, 0, N);
      const auto qb = gather_queries(s, l, range_of(N - w, N));
      return into.add_layer(be, into_ws, l, e.view(), block_view(qb, Hq, w, d), kv_view<const float>{},
                            prefs[static_cast<std::size_t>(l)]);
    };
    // par: the same answers
    std::vector<unsigned char> mem2(mem.size());
    cascade_driver drv2;
    REQUIRE(drv2.init(cfg, mem2.data(), mem2.size()).ok());
    aligned_buf wb2;
    workspace ws2 = make_ws(drv2, par, wb2);
    for (index_t l = 0; l < L; ++l) REQUIRE(prefill(drv2, par, ws2, l).ok());
    for (index_t l = 0; l < L; ++l) CHECK(to_lists(drv2.positions(l)) == to_lists(drv.positions(l)));
    // pipeline parallelism: two stages, each adding the other's layers by their weights only
    for (int stage = 0; stage < 2; ++stage) {
      const index_t a = stage == 0 ? 0 : L / 2, b = stage == 0 ? L / 2 : L;
      std::vector<unsigned char> pm(mem.size());
      cascade_driver ps;
      REQUIRE(ps.init(cfg, pm.data(), pm.size()).ok());
      aligned_buf pb;
      workspace pws = make_ws(ps, seq, pb);
      for (index_t l = 0; l < L; ++l) {
        if (l < a || l >= b) {
          REQUIRE(ps.add_remote_layer(seq, pws, l, drv.layer_weight(l)).ok());
          CHECK(ps.layer_total(l) == 0);
          continue;
        }
        REQUIRE(prefill(ps, seq, pws, l).ok());
      }
      for (index_t l = a; l < b; ++l) CHECK(to_lists(ps.positions(l)) == to_lists(drv.positions(l)));
    }
  }
}

// =================================================================================================
// Chunked prefill

namespace {

struct chunk_case {
  synth s;
  index_t N = 0;
  recipe r;
  chunk_queries mode = chunk_queries::patched;
  chunk_target target = chunk_target::budget;
  double p = 0.5;
  allocator kind = allocator::per_head;
  std::vector<std::int32_t> budgets;  // [L][H]
  index_t total = 0;                  // lava
  bool patch_keys = true;
  std::vector<index_t> bounds;        // chunk boundaries 0 = b0 < b1 < ... = N
  comm_ref tp;                        // tensor parallelism: s holds this rank's heads
  comm_ref pp;                        // pipeline parallelism: s holds this stage's layers
  index_t first_layer = 0, model_layers = 0;
};

chunked_config chunk_cfg(const chunk_case& c) {
  chunked_config cfg;
  cfg.model = {c.s.L, c.s.H, c.s.Hq, c.s.d};
  cfg.tokens = c.N;
  cfg.capacity = c.N;
  cfg.rec = c.r;
  cfg.queries = c.mode;
  cfg.target = c.target;
  cfg.fraction = c.p;
  cfg.alloc.kind = c.kind;
  if (c.kind != allocator::lava) cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(c.budgets.data(), c.s.L, c.s.H));
  cfg.alloc.total = c.total;
  cfg.tp = c.tp;
  cfg.pp = c.pp;
  cfg.first_layer = c.first_layer;
  cfg.model_layers = c.model_layers;
  return cfg;
}

index_t floor_frac(double p, index_t n) { return n <= 0 ? 0 : static_cast<index_t>(std::floor(p * double(n))); }

/// Runs the chunked driver over an engine; returns, per chunk, the kept positions [layer][head].
template <class Backend>
std::vector<std::vector<std::vector<std::vector<pos_t>>>> run_chunked(Backend be, const chunk_case& c,
                                                                     eviction_recorder* rec, bool by_scores = false) {
  const chunked_config cfg = chunk_cfg(c);
  const index_t L = c.s.L, H = c.s.H, w = c.r.window;
  std::vector<unsigned char> mem(value_of(chunked_driver::state_bytes(cfg)));
  chunked_driver d;
  REQUIRE(d.init(cfg, mem.data(), mem.size(), rec).ok());
  aligned_buf wb;
  workspace ws = make_ws(d, be, wb);
  auto layers = make_layers(L, H, c.s.d, c.N);
  std::vector<std::vector<std::vector<std::vector<pos_t>>>> out;
  for (std::size_t ci = 0; ci + 1 < c.bounds.size(); ++ci) {
    const index_t b = c.bounds[ci], e = c.bounds[ci + 1];
    REQUIRE(d.begin_chunk(b, e).ok());
    const patch_block pb = d.patch();
    const bool patched = c.mode == chunk_queries::patched && uses_attention(c.r.kind);
    CHECK(pb.count == (patched && e < c.N ? w : 0));
    const index_t qr = d.query_rows();
    std::vector<pos_t> qpos = pb.count > 0 ? range_of(pb.first, pb.first + pb.count) : range_of(e - qr, e);
    for (index_t l = 0; l < L; ++l) {
      auto& lay = layers[static_cast<std::size_t>(l)];
      lay.append(c.s, l, b, e);
      const auto qb = gather_queries(c.s, l, qpos);
      const auto pk = gather_keys(c.s, l, qpos);
      const bool keys = pb.count > 0 && c.patch_keys;
      const auto sc = by_scores ? layer_scores(d.chunk_recipe(), c.s, l, lay, qb, qr, keys ? &pk : nullptr)
                                : std::vector<float>{};
      const status st = by_scores ? d.add_layer_scores(be, ws, l, lay.view(), scores_view(sc, H, lay.C))
                                  : d.add_layer(be, ws, l, lay.view(), block_view(qb, c.s.Hq, qr, c.s.d),
                                                keys ? block_view(pk, H, qr, c.s.d) : kv_view<const float>{});
      REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    }
    REQUIRE(d.decide(be, ws).ok());
    CHECK(d.chunks_done() == static_cast<index_t>(ci + 1));
    std::vector<std::vector<std::vector<pos_t>>> per;
    for (index_t l = 0; l < L; ++l) {
      REQUIRE(d.ready(l));
      auto& lay = layers[static_cast<std::size_t>(l)];
      const auto k = to_lists(d.kept(l));
      std::vector<std::vector<pos_t>> hp;
      for (index_t h = 0; h < H; ++h) hp.push_back(rows_to_positions(lay.positions(h), k[static_cast<std::size_t>(h)]));
      lay.compact(d.kept(l));
      for (index_t h = 0; h < H; ++h) CHECK(d.held(l, h) == lay.lens[static_cast<std::size_t>(h)]);
      per.push_back(hp);
    }
    out.push_back(per);
  }
  return out;
}

/// The chunked reference: held positions per (layer, head), simulated chunk by chunk.
/// evicted_at[l][h][p] (-1 = never) is filled with the chunk end of every eviction.
std::vector<std::vector<std::vector<std::vector<pos_t>>>> ref_chunked(const chunk_case& c,
                                                                     std::vector<std::vector<std::vector<pos_t>>>& evicted_at) {
  const index_t L = c.s.L, H = c.s.H, N = c.N, w = c.r.window;
  const bool attention = uses_attention(c.r.kind);
  std::vector<std::vector<std::vector<pos_t>>> held(static_cast<std::size_t>(L), std::vector<std::vector<pos_t>>(static_cast<std::size_t>(H)));
  evicted_at.assign(static_cast<std::size_t>(L), std::vector<std::vector<pos_t>>(static_cast<std::size_t>(H), std::vector<pos_t>(static_cast<std::size_t>(N), -1)));
  std::vector<std::vector<std::vector<std::vector<pos_t>>>> out;
  for (std::size_t ci = 0; ci + 1 < c.bounds.size(); ++ci) {
    const index_t b = c.bounds[ci], e = c.bounds[ci + 1], n = e - b;
    const bool patch = c.mode == chunk_queries::patched && attention && e < N;
    recipe r = c.r;
    index_t qr = 0;
    std::vector<pos_t> qpos;
    if (attention) {
      if (patch) {
        r.source = query_source::external_block;
        r.n_recent = 0;
        qr = w;
        qpos = range_of(N - w, N);
      } else {
        qr = c.mode == chunk_queries::naive ? std::min(w, n) : w;
        r.window = qr;
        qpos = range_of(e - qr, e);
      }
    }
    std::vector<std::vector<std::vector<float>>> sc(static_cast<std::size_t>(L));
    std::vector<std::vector<std::vector<pos_t>>> rows(static_cast<std::size_t>(L));
    for (index_t l = 0; l < L; ++l) {
      const auto qb = gather_queries(c.s, l, qpos);
      const auto pk = patch && c.patch_keys ? gather_keys(c.s, l, qpos) : std::vector<float>{};
      for (index_t h = 0; h < H; ++h) {
        for (index_t p = b; p < e; ++p) held[l][h].push_back(static_cast<pos_t>(p));
        sc[l].push_back(ref_head_scores(r, c.s, l, h, held[l][h], qb, qr, &pk));
      }
    }
    const auto W = [&](index_t len) { return protected_count(len, r.n_sink, r.n_recent); };
    if (c.kind == allocator::lava) {
      std::vector<double> e_l;
      std::vector<index_t> caps, share(static_cast<std::size_t>(L));
      index_t prot = 0, all = 0;
      for (index_t l = 0; l < L; ++l) {
        std::vector<float> m(static_cast<std::size_t>(H * N), 0.f);
        std::vector<std::int32_t> lens;
        index_t wl = 0, nl = 0;
        for (index_t h = 0; h < H; ++h) {
          std::copy(sc[l][h].begin(), sc[l][h].end(), m.begin() + h * N);
          lens.push_back(static_cast<std::int32_t>(sc[l][h].size()));
          wl += W(lens.back());
          nl += lens.back();
        }
        double ent = 0;
        lava_entropy_options eo;
        eo.prot = {r.n_sink, r.n_recent};
        REQUIRE(lava_layer_entropy(seq, value_of(make_matrix_view<const float>(m.data(), H, N)), lens.data(), eo, &ent).ok());
        e_l.push_back(ent);
        caps.push_back(nl - wl);
        prot += wl;
        all += nl;
      }
      const index_t keep = c.target == chunk_target::budget ? std::min(c.total, all) : all - floor_frac(c.p, all - prot);
      REQUIRE(apportion(keep - prot, e_l.data(), caps.data(), L, share.data()).ok());
      for (index_t l = 0; l < L; ++l) {
        index_t wl = 0;
        for (index_t h = 0; h < H; ++h) wl += W(static_cast<index_t>(sc[l][h].size()));
        rows[l] = ref_flat(sc[l], wl + share[l]);
      }
    } else {
      for (index_t l = 0; l < L; ++l) {
        index_t held_l = 0, prot_l = 0, budget_l = 0;
        for (index_t h = 0; h < H; ++h) {
          held_l += static_cast<index_t>(sc[l][h].size());
          prot_l += W(static_cast<index_t>(sc[l][h].size()));
          budget_l += c.budgets[static_cast<std::size_t>(l * H + h)];
        }
        if (c.kind == allocator::per_head) {
          for (index_t h = 0; h < H; ++h) {
            const auto len = static_cast<index_t>(sc[l][h].size());
            const index_t k = c.target == chunk_target::budget ? std::min<index_t>(len, c.budgets[static_cast<std::size_t>(l * H + h)])
                                                               : len - floor_frac(c.p, len - W(len));
            rows[l].push_back(ref_topk(sc[l][h], k));
          }
        } else if (c.kind == allocator::flattened) {
          const index_t total = c.target == chunk_target::budget ? std::min(budget_l, held_l)
                                                                 : held_l - floor_frac(c.p, held_l - prot_l);
          rows[l] = ref_flat(sc[l], total);
        } else {  // adakv, budget target
          if (held_l <= budget_l) {
            for (index_t h = 0; h < H; ++h) rows[l].push_back(range_of(0, static_cast<index_t>(sc[l][h].size())));
          } else {
            std::vector<index_t> floors;
            for (index_t h = 0; h < H; ++h) {
              const auto len = static_cast<index_t>(sc[l][h].size());
              floors.push_back(adakv_head_floor(budget_l / H, len, W(len), 0.2, adakv_floor::budget));
            }
            rows[l] = ref_flat(sc[l], budget_l, floors);
          }
        }
      }
    }
    std::vector<std::vector<std::vector<pos_t>>> per(static_cast<std::size_t>(L));
    for (index_t l = 0; l < L; ++l)
      for (index_t h = 0; h < H; ++h) {
        const auto kept = rows_to_positions(held[l][h], rows[l][h]);
        for (pos_t p : held[l][h])
          if (!std::binary_search(kept.begin(), kept.end(), p)) evicted_at[l][h][p] = static_cast<pos_t>(e);
        held[l][h] = kept;
        per[l].push_back(kept);
      }
    out.push_back(per);
  }
  return out;
}

std::vector<index_t> random_bounds(std::mt19937_64& g, index_t N, index_t last_max, index_t chunks) {
  std::vector<index_t> cut;
  for (index_t i = 0; i + 1 < chunks; ++i) cut.push_back(kvtest::uniform_int(g, 1, last_max));
  std::sort(cut.begin(), cut.end());
  cut.erase(std::unique(cut.begin(), cut.end()), cut.end());
  std::vector<index_t> b{0};
  for (index_t x : cut) b.push_back(x);
  b.push_back(N);
  return b;
}

}  // namespace

TEST_CASE("drivers: chunked naive / patched, budget / fraction, every allocator, matches the simulation") {
  int cases = 0;
  for (std::uint64_t seed = 41; seed <= 52; ++seed)
    for (chunk_queries mode : {chunk_queries::naive, chunk_queries::patched})
      for (allocator kind : {allocator::per_head, allocator::flattened, allocator::adakv, allocator::lava}) {
        auto g = kvtest::rng(seed * 17 + static_cast<std::uint64_t>(kind) * 3 + static_cast<std::uint64_t>(mode));
        chunk_case c;
        const index_t L = kvtest::uniform_int(g, 1, 3), H = kvtest::uniform_int(g, 1, 3), Hq = H * kvtest::uniform_int(g, 1, 2);
        const index_t d = kvtest::uniform_int(g, 4, 8);
        c.N = kvtest::uniform_int(g, 30, 70);
        c.s = make_synth(seed, L, H, Hq, d, c.N);
        const int rk = static_cast<int>(seed % 4);
        c.r = rk == 0 ? small_window(recipe::snapkv(), 5)
                      : rk == 1 ? small_window(recipe::lava(), 4)
                                : rk == 2 ? small_window(recipe::cake(), 6) : small_window(recipe::vatp(), 3);
        if (seed % 5 == 0) c.r = recipe::streaming_llm(3);
        if (seed % 7 == 0) c.r.n_sink = 2;
        c.mode = mode;
        c.target = kind != allocator::adakv && seed % 2 == 0 ? chunk_target::fraction : chunk_target::budget;
        c.p = double(kvtest::uniform_int(g, 0, 10)) / 10.0;
        c.kind = kind;
        c.patch_keys = seed % 3 != 0;
        const index_t prot = c.r.n_sink + c.r.n_recent;
        const index_t B = kvtest::uniform_int(g, std::max<index_t>(prot, 1), prot + 20);
        c.budgets.assign(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(B));
        if (kind == allocator::per_head || kind == allocator::flattened)
          for (auto& x : c.budgets) x = static_cast<std::int32_t>(kvtest::uniform_int(g, std::max<index_t>(prot, 1), prot + 20));
        c.total = L * H * B;
        const index_t w = c.r.window;
        const bool patched = mode == chunk_queries::patched && uses_attention(c.r.kind);
        c.bounds = random_bounds(g, c.N, patched ? c.N - w : c.N - 1, kvtest::uniform_int(g, 1, 5));
        CAPTURE(seed);
        CAPTURE(static_cast<int>(mode));
        CAPTURE(static_cast<int>(kind));
        std::vector<std::vector<std::vector<pos_t>>> ref_at;
        const auto ref = ref_chunked(c, ref_at);
        std::vector<pos_t> store(static_cast<std::size_t>(L * H * c.N));
        auto rec = value_of(make_eviction_recorder(store.data(), L, H, c.N));
        const auto got = run_chunked(seq, c, &rec);
        REQUIRE(got == ref);
        REQUIRE(run_chunked(par, c, nullptr) == got);
        REQUIRE(run_chunked(seq, c, nullptr, true) == got);  // add_layer_scores with chunk_recipe()'s scores
        for (index_t l = 0; l < L; ++l)
          for (index_t h = 0; h < H; ++h) CHECK(recorded(rec, l, h, c.N) == ref_at[l][h]);
        // footprint over the prompt: the recorder's schedule against the naive count
        std::vector<std::vector<pos_t>> rows;
        for (auto& lay : ref_at)
          for (auto& hd : lay) rows.push_back(hd);
        const naive_usage nu = naive_kv_usage(rows, c.N);
        std::vector<std::int64_t> tmp(static_cast<std::size_t>(c.N) + 8);  // + 64 B: the carver's base padding
        workspace mws{tmp.data(), tmp.size() * sizeof(std::int64_t)};
        kv_usage usage;
        REQUIRE(measure_kv_usage(mws, value_of(rec.schedule(c.N)), usage).ok());
        CHECK(usage.resident == nu.resident);
        CHECK(usage.peak == nu.peak);
        ++cases;
      }
  CHECK(cases == 12 * 2 * 4);
}

TEST_CASE("drivers: patched chunking with a single chunk equals post-fill eviction") {
  for (std::uint64_t seed = 61; seed <= 66; ++seed) {
    auto g = kvtest::rng(seed);
    const index_t L = 3, H = 2, Hq = 4, d = 8, N = 48, w = 6;
    const synth s = make_synth(seed, L, H, Hq, d, N);
    const bool lava_kind = seed % 2 == 0;
    const recipe r = lava_kind ? small_window(recipe::lava(), w) : small_window(recipe::snapkv(), w);
    std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H));
    REQUIRE(pyramid_budgets(kvtest::uniform_int(g, w, 20), N, {5, {0, w}, pyramid_rounding::exact},
                            value_of(make_matrix_view(budgets.data(), L, H)))
                .ok());
    chunk_case c;
    c.s = s;
    c.N = N;
    c.r = r;
    c.kind = lava_kind ? allocator::lava : allocator::per_head;
    c.budgets = budgets;
    c.total = L * H * 15;
    c.bounds = {0, N};
    const auto chunked = run_chunked(seq, c, nullptr);
    pf_setup u;
    u.s = s;
    u.P = N;
    auto layers = pf_layers(u, w, seed);
    post_fill_config cfg;
    cfg.model = {L, H, Hq, d};
    cfg.tokens = N;
    cfg.rec = r;
    cfg.alloc.kind = c.kind;
    cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
    cfg.alloc.total = c.total;
    CHECK(run_post_fill(seq, cfg, u, layers, {}) == chunked[0]);
  }
}

TEST_CASE("drivers: chunked prefill without eviction has a 100% footprint; with it, less") {
  const index_t L = 2, H = 2, N = 40;
  chunk_case c;
  c.s = make_synth(3, L, H, 2, 4, N);
  c.N = N;
  c.r = small_window(recipe::snapkv(), 4);
  c.target = chunk_target::fraction;
  c.budgets.assign(static_cast<std::size_t>(L * H), 0);  // unused by the fraction target
  c.bounds = {0, 10, 20, 36, 40};
  for (double p : {0.0, 0.5}) {
    c.p = p;
    std::vector<pos_t> store(static_cast<std::size_t>(L * H * N));
    auto rec = value_of(make_eviction_recorder(store.data(), L, H, N));
    run_chunked(seq, c, &rec);
    std::vector<std::int64_t> tmp(static_cast<std::size_t>(N) + 8);  // + 64 B: the carver's base padding
    workspace mws{tmp.data(), tmp.size() * sizeof(std::int64_t)};
    kv_usage usage;
    REQUIRE(measure_kv_usage(mws, value_of(rec.schedule(N)), usage).ok());
    if (p == 0.0) {
      CHECK(usage.footprint() == 1.0);
      CHECK(usage.peak_kv() == 1.0);
    } else {
      CHECK(usage.footprint() < 1.0);
      CHECK(usage.peak_kv() < 1.0);
    }
  }
}

// =================================================================================================
// Decode-time eviction

namespace {

struct decode_case {
  synth s;
  index_t P = 0, G = 0, interval = 1;  // prompt (un-evicted), decoded tokens
  recipe r;
  allocator kind = allocator::per_head;
  std::vector<std::int32_t> budgets;  // [L][H]
  comm_ref tp;                        // tensor parallelism: s holds this rank's heads
};

decode_config decode_cfg(const decode_case& c) {
  decode_config cfg;
  cfg.model = {c.s.L, c.s.H, c.s.Hq, c.s.d};
  cfg.capacity = c.P + c.G;
  cfg.interval = c.interval;
  cfg.rec = c.r;
  cfg.alloc.kind = c.kind;
  cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(c.budgets.data(), c.s.L, c.s.H));
  cfg.tp = c.tp;
  return cfg;
}

/// Positions of the queries a decode step reads (after token t was appended).
std::vector<pos_t> decode_query_positions(const recipe& r, index_t t) {
  switch (r.kind) {
    case recipe_kind::h2o:
    case recipe_kind::tova: return range_of(t, t + 1);
    case recipe_kind::knorm:
    case recipe_kind::streaming_llm: return {};
    default: return range_of(t + 1 - r.window, t + 1);
  }
}

/// Runs the decode driver; returns, per step, the positions every (layer, head) holds afterwards.
template <class Backend>
std::vector<std::vector<std::vector<std::vector<pos_t>>>> run_decode(Backend be, const decode_case& c,
                                                                    eviction_recorder* rec, bool by_scores = false) {
  const decode_config cfg = decode_cfg(c);
  const index_t L = c.s.L, H = c.s.H;
  std::vector<unsigned char> mem(value_of(decode_driver::state_bytes(cfg)));
  decode_driver d;
  REQUIRE(d.init(cfg, mem.data(), mem.size(), rec).ok());
  aligned_buf wb;
  workspace ws = make_ws(d, be, wb);
  auto layers = make_layers(L, H, c.s.d, cfg.capacity);
  for (index_t l = 0; l < L; ++l) {
    layers[static_cast<std::size_t>(l)].append(c.s, l, 0, c.P);
    REQUIRE(d.begin(l, layers[static_cast<std::size_t>(l)].view(), c.P).ok());
  }
  std::vector<std::vector<std::vector<std::vector<pos_t>>>> out;
  for (index_t t = c.P; t < c.P + c.G; ++t) {
    std::vector<std::vector<std::vector<pos_t>>> per;
    for (index_t l = 0; l < L; ++l) {
      auto& lay = layers[static_cast<std::size_t>(l)];
      lay.append(c.s, l, t, t + 1);
      const bool needs = c.r.kind == recipe_kind::h2o || d.evicts_next(l);
      const auto qpos = needs ? decode_query_positions(c.r, t) : std::vector<pos_t>{};
      const auto qb = gather_queries(c.s, l, qpos);
      const auto qr = static_cast<index_t>(qpos.size());
      // by_scores: H2O hands over the new token's attention (a TOVA recipe without protection),
      // the others their eviction scores when the step may evict
      recipe sr = c.r;
      if (c.r.kind == recipe_kind::h2o) {
        sr.kind = recipe_kind::tova;
        sr.n_sink = sr.n_recent = 0;
      }
      const auto sc = by_scores && needs ? layer_scores(sr, c.s, l, lay, qb, qr, nullptr) : std::vector<float>{};
      const status st = by_scores ? d.step_scores(be, ws, l, lay.view(),
                                                  needs ? scores_view(sc, H, lay.C) : matrix_view<const float>{})
                                  : d.step(be, ws, l, lay.view(), block_view(qb, c.s.Hq, qr, c.s.d));
      REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
      CHECK(d.tokens(l) == t + 1);
      if (d.evicted(l)) lay.compact(d.kept(l));
      std::vector<std::vector<pos_t>> hp;
      for (index_t h = 0; h < H; ++h) {
        hp.push_back(lay.positions(h));
        CHECK(d.held(l, h) == lay.lens[static_cast<std::size_t>(h)]);
      }
      per.push_back(hp);
    }
    out.push_back(per);
  }
  return out;
}

/// By hand for the recipes without state: at each eviction step, score the held rows with the
/// recipe (materialised), select by full sorts.
std::vector<std::vector<std::vector<std::vector<pos_t>>>> ref_decode(const decode_case& c) {
  const index_t L = c.s.L, H = c.s.H;
  std::vector<std::vector<std::vector<pos_t>>> held(static_cast<std::size_t>(L));
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h) held[l].push_back(range_of(0, c.P));
  std::vector<std::vector<std::vector<std::vector<pos_t>>>> out;
  for (index_t t = c.P; t < c.P + c.G; ++t) {
    const bool due = (t + 1 - c.P) % c.interval == 0;
    for (index_t l = 0; l < L; ++l) {
      for (index_t h = 0; h < H; ++h) held[l][h].push_back(static_cast<pos_t>(t));
      index_t sum_b = 0, sum_len = 0;
      bool over = false;
      for (index_t h = 0; h < H; ++h) {
        sum_b += c.budgets[static_cast<std::size_t>(l * H + h)];
        sum_len += static_cast<index_t>(held[l][h].size());
        over = over || static_cast<index_t>(held[l][h].size()) > c.budgets[static_cast<std::size_t>(l * H + h)];
      }
      if (!due || (c.kind == allocator::per_head ? !over : sum_len <= sum_b)) continue;
      const auto qpos = decode_query_positions(c.r, t);
      const auto qb = gather_queries(c.s, l, qpos);
      std::vector<std::vector<float>> sc;
      for (index_t h = 0; h < H; ++h)
        sc.push_back(ref_head_scores(c.r, c.s, l, h, held[l][h], qb, static_cast<index_t>(qpos.size()), nullptr));
      std::vector<std::vector<pos_t>> rows;
      if (c.kind == allocator::per_head) {
        for (index_t h = 0; h < H; ++h)
          rows.push_back(ref_topk(sc[h], std::min<index_t>(static_cast<index_t>(sc[h].size()),
                                                           c.budgets[static_cast<std::size_t>(l * H + h)])));
      } else if (c.kind == allocator::flattened) {
        rows = ref_flat(sc, sum_b);
      } else {
        std::vector<index_t> floors;
        for (index_t h = 0; h < H; ++h) {
          const auto n = static_cast<index_t>(sc[h].size());
          floors.push_back(adakv_head_floor(sum_b / H, n, protected_count(n, c.r.n_sink, c.r.n_recent), 0.2,
                                            adakv_floor::budget));
        }
        rows = ref_flat(sc, sum_b, floors);
      }
      for (index_t h = 0; h < H; ++h) held[l][h] = rows_to_positions(held[l][h], rows[h]);
    }
    out.push_back(held);
  }
  return out;
}

}  // namespace

TEST_CASE("drivers: decode-time eviction with TOVA, window recipes, Knorm, StreamingLLM equals scoring by hand") {
  int cases = 0;
  for (std::uint64_t seed = 71; seed <= 78; ++seed)
    for (allocator kind : {allocator::per_head, allocator::flattened, allocator::adakv}) {
      auto g = kvtest::rng(seed * 5 + static_cast<std::uint64_t>(kind));
      decode_case c;
      const index_t L = kvtest::uniform_int(g, 1, 2), H = kvtest::uniform_int(g, 1, 3), Hq = H * kvtest::uniform_int(g, 1, 3);
      c.P = kvtest::uniform_int(g, 8, 24);
      c.G = kvtest::uniform_int(g, 10, 30);
      c.interval = kvtest::uniform_int(g, 1, 4);
      c.s = make_synth(seed, L, H, Hq, 6, c.P + c.G);
      const int rk = static_cast<int>(seed % 4);
      c.r = rk == 0 ? recipe::tova() : rk == 1 ? small_window(recipe::snapkv(), 4) : rk == 2 ? recipe::knorm() : recipe::streaming_llm(2);
      if (rk == 0) c.r.n_sink = 1;
      c.kind = kind;
      const index_t prot = c.r.n_sink + c.r.n_recent;
      const index_t B = kvtest::uniform_int(g, std::max<index_t>(prot, 2), prot + 8);
      c.budgets.assign(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(B));
      if (kind != allocator::adakv)
        for (auto& b : c.budgets) b = static_cast<std::int32_t>(kvtest::uniform_int(g, std::max<index_t>(prot, 2), prot + 8));
      CAPTURE(seed);
      CAPTURE(static_cast<int>(kind));
      const auto got = run_decode(seq, c, nullptr);
      REQUIRE(got == ref_decode(c));
      REQUIRE(run_decode(par, c, nullptr) == got);
      REQUIRE(run_decode(seq, c, nullptr, true) == got);  // step_scores with recipe_scores' output
      ++cases;
    }
  CHECK(cases == 24);
}

TEST_CASE("drivers: decode-time H2O equals a naive accumulated-attention simulation") {
  int compared = 0, skipped = 0;
  for (std::uint64_t seed = 81; seed <= 100; ++seed) {
    auto g = kvtest::rng(seed);
    decode_case c;
    const index_t L = 1, H = kvtest::uniform_int(g, 1, 3), Hq = H * kvtest::uniform_int(g, 1, 3), d = 8;
    c.P = kvtest::uniform_int(g, 6, 16);
    c.G = kvtest::uniform_int(g, 12, 30);
    c.interval = kvtest::uniform_int(g, 1, 3);
    c.s = make_synth(seed, L, H, Hq, d, c.P + c.G);
    c.r = recipe::h2o();
    c.r.n_sink = kvtest::uniform_int(g, 0, 2);
    c.r.n_recent = kvtest::uniform_int(g, 0, 3);
    const index_t B = c.r.n_sink + c.r.n_recent + kvtest::uniform_int(g, 1, 6);
    c.budgets.assign(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(B));
    CAPTURE(seed);
    const auto got = run_decode(seq, c, nullptr);
    REQUIRE(run_decode(par, c, nullptr) == got);
    REQUIRE(run_decode(seq, c, nullptr, true) == got);  // step_scores with each step's attention
    // naive: per head, held positions with their accumulated attention (double), softmax of the new
    // token's query over the held keys, mean over the group's query heads
    const index_t grp = Hq / H;
    const double scale = 1.0 / std::sqrt(double(d));
    bool near_tie = false, same = true;
    std::vector<std::vector<pos_t>> held(static_cast<std::size_t>(H), range_of(0, c.P));
    std::vector<std::vector<double>> acc(static_cast<std::size_t>(H), std::vector<double>(static_cast<std::size_t>(c.P), 0.0));
    for (index_t t = c.P; t < c.P + c.G && !near_tie; ++t) {
      for (index_t h = 0; h < H; ++h) {
        held[h].push_back(static_cast<pos_t>(t));
        acc[h].push_back(0.0);
        const auto n = static_cast<index_t>(held[h].size());
        for (index_t q = h * grp; q < (h + 1) * grp; ++q) {
          std::vector<double> logit(static_cast<std::size_t>(n));
          double m = -INFINITY, z = 0;
          for (index_t j = 0; j < n; ++j) {
            double dot = 0;
            for (index_t e = 0; e < d; ++e) dot += double(c.s.query(0, t, q)[e]) * double(c.s.key(0, held[h][j], h)[e]);
            logit[j] = dot * scale;
            m = std::max(m, logit[j]);
          }
          for (index_t j = 0; j < n; ++j) z += std::exp(logit[j] - m);
          for (index_t j = 0; j < n; ++j) acc[h][j] += std::exp(logit[j] - m) / z / double(grp);
        }
        if ((t + 1 - c.P) % c.interval != 0 || n <= B) continue;
        // protected rows first (sinks, recent), then the best accumulated scores, ties to the lower position
        std::vector<std::pair<double, index_t>> cand;
        std::vector<index_t> keep;
        for (index_t j = 0; j < n; ++j) {
          if (j < c.r.n_sink || j >= n - c.r.n_recent) keep.push_back(j);
          else cand.push_back({acc[h][j], j});
        }
        std::stable_sort(cand.begin(), cand.end(), [](auto& a, auto& b) { return a.first > b.first; });
        const auto take = static_cast<std::size_t>(B) - keep.size();
        if (take < cand.size() && take > 0 && cand[take - 1].first - cand[take].first < 1e-5 * cand[0].first) near_tie = true;
        for (std::size_t i = 0; i < take; ++i) keep.push_back(cand[i].second);
        std::sort(keep.begin(), keep.end());
        std::vector<pos_t> hp;
        std::vector<double> ha;
        for (index_t j : keep) {
          hp.push_back(held[h][j]);
          ha.push_back(acc[h][j]);
        }
        held[h] = hp;
        acc[h] = ha;
      }
      if (!near_tie && got[static_cast<std::size_t>(t - c.P)][0] != held) same = false;
    }
    if (near_tie) {
      ++skipped;
      continue;
    }
    CHECK(same);
    ++compared;
  }
  INFO("compared ", compared, ", skipped for near ties ", skipped);
  CHECK(compared >= 18);
}

TEST_CASE("drivers: a StreamingLLM decode driver from an empty cache matches the metrics closed form") {
  const index_t L = 2, H = 2, N = 60, s = 3, c = 10;
  decode_case dc;
  dc.s = make_synth(9, L, H, 2, 4, N);
  dc.P = 0;
  dc.G = N;
  dc.r = recipe::streaming_llm(s);
  dc.budgets.assign(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(c));
  std::vector<pos_t> store(static_cast<std::size_t>(L * H * N)), closed(store.size());
  auto rec = value_of(make_eviction_recorder(store.data(), L, H, N));
  run_decode(seq, dc, &rec);
  auto ref = value_of(make_eviction_recorder(closed.data(), L, H, N));
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h) REQUIRE(ref.set_streaming(l, h, N, s, c - s + 1).ok());
  // an eviction at step N (after the last query) is the same as never (metrics/footprint.hpp)
  for (std::size_t i = 0; i < store.size(); ++i)
    if ((store[i] >= N ? never_evicted : store[i]) != closed[i]) {
      INFO("entry ", i, " driver ", store[i], " closed form ", closed[i]);
      CHECK(false);
      break;
    }
  std::vector<std::int64_t> tmp(static_cast<std::size_t>(N) + 8);  // + 64 B: the carver's base padding
  workspace mws{tmp.data(), tmp.size() * sizeof(std::int64_t)};
  kv_usage usage;
  REQUIRE(measure_kv_usage(mws, value_of(rec.schedule(N)), usage).ok());
  const index_t cc = c + 1;  // the budget plus the new token each query sees
  CHECK(usage.resident == (cc * (cc + 1) / 2 + (N - cc) * cc) * L * H);
  CHECK(usage.peak == cc * L * H);
  // budgets that never bind: full attention
  dc.budgets.assign(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(N));
  auto rec2 = value_of(make_eviction_recorder(store.data(), L, H, N));
  run_decode(seq, dc, &rec2);
  REQUIRE(measure_kv_usage(mws, value_of(rec2.schedule(N)), usage).ok());
  CHECK(usage.footprint() == 1.0);
}

// =================================================================================================
// Errors

TEST_CASE("drivers: post-fill errors") {
  const index_t L = 2, H = 2, Hq = 4, d = 8, P = 20;
  pf_setup u;
  u.P = P;
  u.s = make_synth(1, L, H, Hq, d, P);
  std::vector<std::int32_t> b(static_cast<std::size_t>(L * H), 10);
  post_fill_config cfg;
  cfg.model = {L, H, Hq, d};
  cfg.tokens = P;
  cfg.rec = small_window(recipe::snapkv(), 8);
  cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(b.data(), L, H));
  auto init_error = [&](post_fill_config c, errc code, const char* needle) {
    require_error(post_fill_driver::state_bytes(c).error(), code, needle);
  };
  {
    post_fill_config c = cfg;
    c.model.layers = 0;
    init_error(c, errc::invalid_argument, "the model has 0 layers");
    c = cfg;
    c.model.kv_heads = 0;
    init_error(c, errc::invalid_argument, "0 KV heads per layer");
    c = cfg;
    c.model.query_heads = 3;
    init_error(c, errc::invalid_argument, "3 query heads are not a positive multiple of 2 KV heads");
    c = cfg;
    c.model.head_dim = 0;
    init_error(c, errc::invalid_argument, "head_dim = 0");
    c = cfg;
    c.tokens = 0;
    init_error(c, errc::invalid_argument, "tokens = 0 is outside [1, ");
    c = cfg;
    c.rec.kernel = 4;
    init_error(c, errc::invalid_argument, "pooling kernel 4 must be odd");
    c = cfg;
    c.rec.source = query_source::external_block;
    init_error(c, errc::invalid_argument, "an external_block recipe needs the block's row count");
    c = cfg;
    c.query_rows = 5;
    init_error(c, errc::invalid_argument, "query_rows = 5 but snapkv reads 8 query rows");
    c = cfg;
    c.rec.window = 32;
    init_error(c, errc::invalid_argument, "the recipe's window 32 is longer than the 20 tokens");
    c = cfg;
    c.alloc.kind = static_cast<allocator>(9);
    init_error(c, errc::invalid_argument, "unknown allocator value 9");
    c = cfg;
    c.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(b.data(), 1, H));
    init_error(c, errc::shape_mismatch, "alloc.budgets is [1][2], expected [2 layers][2 heads]");
    std::vector<std::int32_t> low = {7, 10, 10, 10}, high = {10, 21, 10, 10}, odd = {8, 9, 10, 10};
    c = cfg;
    c.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(low.data(), L, H));
    init_error(c, errc::invalid_argument, "budgets[0][0] = 7 is below the 8 protected tokens");
    c.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(high.data(), L, H));
    init_error(c, errc::invalid_argument, "budgets[0][1] = 21 is above the 20 rows of a head");
    c.alloc.kind = allocator::flattened;
    std::vector<std::int32_t> tiny = {7, 8, 10, 10};
    c.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(tiny.data(), L, H));
    init_error(c, errc::invalid_argument, "layer 0 keeps 15 tokens, below the 16 protected tokens");
    c.alloc.kind = allocator::adakv;
    c.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(odd.data(), L, H));
    init_error(c, errc::invalid_argument, "not a multiple of the 2 heads");
    c.alloc.budgets = cfg.alloc.budgets;
    c.alloc.adakv_alpha = 1.5;
    init_error(c, errc::invalid_argument, "adakv alpha = 1.5 is outside [0, 1]");
    c = cfg;
    c.alloc.kind = allocator::lava;
    c.alloc.total = 999;
    init_error(c, errc::invalid_argument, "lava total 999 is outside [0, 80]");
    c.alloc.kind = allocator::cake;
    c.alloc.total = 42;
    init_error(c, errc::invalid_argument, "cake total 42 is not a multiple of the 4 heads");
    c.alloc.total = 8;
    init_error(c, errc::invalid_argument, "budget 2 is below the 8 protected tokens");
  }
  std::vector<unsigned char> mem(value_of(post_fill_driver::state_bytes(cfg)));
  post_fill_driver drv;
  require_error(drv.init(cfg, nullptr, mem.size()), errc::null_pointer, "memory is null");
  require_error(drv.init(cfg, mem.data(), 10), errc::workspace_too_small, "memory has 10 bytes");
  std::vector<pos_t> store(static_cast<std::size_t>(3 * H * P));
  auto rec_wrong = value_of(make_eviction_recorder(store.data(), 3, H, P));
  require_error(drv.init(cfg, mem.data(), mem.size(), &rec_wrong), errc::shape_mismatch, "the recorder has 3 layers x 2 heads");
  auto rec_short = value_of(make_eviction_recorder(store.data(), L, H, 10));
  require_error(drv.init(cfg, mem.data(), mem.size(), &rec_short), errc::invalid_argument, "holds 10 positions, fewer than the 20 tokens");
  aligned_buf wb;
  workspace ws0;
  require_error(drv.workspace_bytes(seq).error(), errc::invalid_argument, "not initialised");
  auto layers = pf_layers(u, 8, 1);
  const auto qb = gather_queries(u.s, 0, range_of(P - 8, P));
  const auto qv = block_view(qb, Hq, 8, d);
  std::vector<unsigned char> wsb(1 << 20);
  workspace ws{wsb.data(), wsb.size()};
  require_error(drv.add_layer(seq, ws, 0, layers[0].view(), qv), errc::invalid_argument, "not initialised (init)");
  require_error(drv.decide(seq, ws), errc::invalid_argument, "not initialised (init)");
  REQUIRE(drv.init(cfg, mem.data(), mem.size()).ok());
  ws = make_ws(drv, seq, wb);
  require_error(drv.add_layer(seq, ws, 1, layers[1].view(), qv), errc::invalid_argument, "layer 1 given, expected layer 0");
  require_error(drv.decide(seq, ws), errc::invalid_argument, "only 0 of 2 layers were added");
  {  // shapes of the layer
    layer_kv<float> kv = layers[0].view();
    kv.keys.heads = 3;
    require_error(drv.add_layer(seq, ws, 0, kv, qv), errc::shape_mismatch, "the layer's keys have 3 KV heads");
    kv = layers[0].view();
    kv.values.dim = 4;
    require_error(drv.add_layer(seq, ws, 0, kv, qv), errc::shape_mismatch, "the layer's values have head dim 4");
    kv = layers[0].view();
    kv.keys.lens = nullptr;
    require_error(drv.add_layer(seq, ws, 0, kv, qv), errc::null_pointer, "keys.lens is null");
    engine_layer e = layers[0];
    std::vector<std::int32_t> vl = e.lens;
    vl[1] = 19;
    kv = e.view();
    kv.values.lens = vl.data();
    require_error(drv.add_layer(seq, ws, 0, kv, qv), errc::shape_mismatch, "head 1 holds 20 key rows but 19 value rows");
    kv = e.view();
    kv.positions = nullptr;
    require_error(drv.add_layer(seq, ws, 0, kv, qv), errc::null_pointer, "positions are null");
    std::swap(e.pos[3], e.pos[5]);
    require_error(drv.add_layer(seq, ws, 0, e.view(), qv), errc::not_sorted, "row 4 holds position 4 after 5");
    e = layers[0];
    e.pos[2] = 25;
    require_error(drv.add_layer(seq, ws, 0, e.view(), qv), errc::out_of_range, "row 2 holds position 25, outside [0, 20)");
    engine_layer holes(H, d, P);  // the window's rows missing
    for (index_t p = 0; p < P - 1; ++p) holes.push(u.s, 0, 0, static_cast<pos_t>(p));
    holes.append(u.s, 0, 0, 0);
    for (index_t p = 0; p < P; ++p) holes.push(u.s, 0, 1, static_cast<pos_t>(p));
    require_error(drv.add_layer(seq, ws, 0, holes.view(), qv), errc::invalid_argument,
                  "the last 8 rows of layer 0 head 0 must be the observation window's tokens (positions [12, 20))");
    std::vector<std::int32_t> big_cu = {0, 21, 42};
    engine_layer wide(H, d, 21);
    wide.cu = big_cu;
    wide.lens = {21, 0};
    for (index_t j = 0; j < 21; ++j) wide.pos[static_cast<std::size_t>(j)] = static_cast<pos_t>(j);
    require_error(drv.add_layer(seq, ws, 0, wide.view(), qv), errc::capacity_exceeded,
                  "head 0 holds 21 rows, more than the driver's capacity 20");
  }
  const auto q7 = gather_queries(u.s, 0, range_of(P - 7, P));
  require_error(drv.add_layer(seq, ws, 0, layers[0].view(), block_view(q7, Hq, 7, d)), errc::shape_mismatch,
                "queries are [4][7][8], expected [4][8][8]");
  const auto bk = gather_keys(u.s, 0, range_of(P - 8, P));
  require_error(drv.add_layer(seq, ws, 0, layers[0].view(), qv, block_view(bk, H, 8, d)), errc::shape_mismatch,
                "block keys were given but this call takes none");
  workspace small{ws.data, 10};
  require_error(drv.add_layer(seq, small, 0, layers[0].view(), qv), errc::workspace_too_small, "workspace has 10 bytes");
  {  // a workspace inside the driver's state memory
    std::vector<unsigned char> big(mem.size() + ws.bytes + 128);
    post_fill_driver d2;
    REQUIRE(d2.init(cfg, big.data(), mem.size()).ok());
    workspace inside{big.data() + 64, ws.bytes};
    require_error(d2.add_layer(seq, inside, 0, layers[0].view(), qv), errc::overlap, "overlaps the driver's state memory");
  }
  {  // a ragged head holding fewer rows than its budget
    engine_layer e(H, d, P);
    for (index_t p = 12; p < P; ++p) e.push(u.s, 0, 0, static_cast<pos_t>(p));
    e.append(u.s, 0, 0, 0);
    for (index_t p = 0; p < P; ++p) e.push(u.s, 0, 1, static_cast<pos_t>(p));
    require_error(drv.add_layer(seq, ws, 0, e.view(), qv), errc::invalid_argument,
                  "budgets[0][0] = 10 is outside [8, 8] (the head's protected tokens, its rows)");
  }
  // the recorder refuses a row evicted before (an engine that did not compact)
  auto rec = value_of(make_eviction_recorder(store.data(), L, H, P));
  REQUIRE(rec.mark_evicted(0, 0, std::vector<pos_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}.data(), 12, 5).ok() == false);
  REQUIRE(drv.init(cfg, mem.data(), mem.size(), &rec).ok());
  const pos_t early[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  REQUIRE(rec.mark_evicted(0, 0, early, 11, 12).ok());
  const status rst = drv.add_layer(seq, ws, 0, layers[0].view(), qv);
  require_error(rst, errc::invalid_argument, "was already evicted at step 12");
  // order, after the last layer, decide twice
  REQUIRE(drv.init(cfg, mem.data(), mem.size()).ok());
  REQUIRE(drv.add_layer(seq, ws, 0, layers[0].view(), qv).ok());
  REQUIRE(drv.add_layer(seq, ws, 1, layers[1].view(), block_view(gather_queries(u.s, 1, range_of(P - 8, P)), Hq, 8, d)).ok());
  require_error(drv.add_layer(seq, ws, 2, layers[1].view(), qv), errc::invalid_argument, "all 2 layers were added");
  REQUIRE(drv.decide(seq, ws).ok());
  require_error(drv.decide(seq, ws), errc::invalid_argument, "decide() already ran");
  require_error(drv.add_layer(seq, ws, 0, layers[0].view(), qv), errc::invalid_argument, "decide() already ran");
  CHECK(drv.kept(5).heads == 0);
  // all-layer allocators: cake preference NaN, lava entropy of negative (Knorm) scores, lava total above the rows
  post_fill_config cc = cfg;
  cc.alloc.kind = allocator::cake;
  cc.alloc.total = L * H * 10;
  std::vector<unsigned char> mem2(value_of(post_fill_driver::state_bytes(cc)));
  REQUIRE(drv.init(cc, mem2.data(), mem2.size()).ok());
  aligned_buf wb2;
  workspace ws2 = make_ws(drv, seq, wb2);
  require_error(drv.add_layer(seq, ws2, 0, layers[0].view(), qv, kv_view<const float>{}, std::nan("")),
                errc::invalid_argument, "layer 0's CAKE preference is nan");
  {
    engine_layer e(H, d, P);
    for (index_t p = 2; p < P; ++p) e.push(u.s, 0, 0, static_cast<pos_t>(p));
    e.append(u.s, 0, 0, 0);
    for (index_t p = 0; p < P; ++p) e.push(u.s, 0, 1, static_cast<pos_t>(p));
    require_error(drv.add_layer(seq, ws2, 0, e.view(), qv, kv_view<const float>{}, 1.0), errc::shape_mismatch,
                  "it must hold the whole prompt");
  }
  post_fill_config lk = cfg;
  lk.rec = recipe::knorm();
  lk.alloc.kind = allocator::lava;
  lk.alloc.total = 40;
  std::vector<unsigned char> mem3(value_of(post_fill_driver::state_bytes(lk)));
  REQUIRE(drv.init(lk, mem3.data(), mem3.size()).ok());
  aligned_buf wb3;
  workspace ws3 = make_ws(drv, seq, wb3);
  require_error(drv.add_layer(seq, ws3, 0, layers[0].view(), kv_view<const float>{}), errc::invalid_argument,
                "unprotected LAVa scores must be finite and >= 0");
  post_fill_config lr = cfg;
  lr.alloc.kind = allocator::lava;
  lr.alloc.total = 80;
  REQUIRE(drv.init(lr, mem3.data(), mem3.size()).ok());
  ws3 = make_ws(drv, seq, wb3);
  engine_layer part(H, d, P);
  for (index_t p = 4; p < P; ++p) part.push(u.s, 0, 0, static_cast<pos_t>(p));
  for (index_t p = 0; p < P; ++p) part.push(u.s, 0, 1, static_cast<pos_t>(p));
  {
    const status st = drv.add_layer(seq, ws3, 0, part.view(), qv);
    REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
  }
  REQUIRE(drv.add_layer(seq, ws3, 1, layers[1].view(), block_view(gather_queries(u.s, 1, range_of(P - 8, P)), Hq, 8, d)).ok());
  require_error(drv.decide(seq, ws3), errc::invalid_argument, "lava total 80 is outside [32, 76]");
  (void)ws0;
}

TEST_CASE("drivers: cascade errors") {
  const index_t L = 2, H = 2, Hq = 2, d = 4, N = 16;
  const synth s = make_synth(2, L, H, Hq, d, N);
  cascade_driver_config cfg;
  cfg.model = {L, H, Hq, d};
  cfg.tokens = N;
  cfg.rec = small_window(recipe::lava(), 4);
  cfg.total = 40;
  auto bad = [&](cascade_driver_config c, errc code, const char* needle) {
    require_error(cascade_driver::state_bytes(c).error(), code, needle);
  };
  cascade_driver_config c = cfg;
  c.total = 10;
  bad(c, errc::invalid_argument, "total budget 10 is below the 16 protected tokens");
  c = cfg;
  c.split = cascade_split::per_head;
  c.total = 41;
  bad(c, errc::invalid_argument, "not a multiple of the 2 heads");
  c = cfg;
  c.weight = static_cast<weight_source>(5);
  bad(c, errc::invalid_argument, "unknown weight_source value 5");
  c = cfg;
  c.norm = static_cast<entropy_norm>(5);
  bad(c, errc::invalid_argument, "unknown entropy_norm value 5");
  c = cfg;
  c.rec.window = 20;
  bad(c, errc::invalid_argument, "window 20 is longer than the 16 tokens");
  std::vector<unsigned char> mem(value_of(cascade_driver::state_bytes(cfg)));
  cascade_driver drv;
  require_error(drv.init(cfg, mem.data(), 8), errc::workspace_too_small, "memory has 8 bytes");
  engine_layer e(H, d, N);
  e.append(s, 0, 0, N);
  const auto qb = gather_queries(s, 0, range_of(N - 4, N));
  std::vector<unsigned char> wsb(1 << 20);
  workspace ws{wsb.data(), wsb.size()};
  require_error(drv.add_layer(seq, ws, 0, e.view(), block_view(qb, Hq, 4, d)), errc::invalid_argument, "not initialised");
  REQUIRE(drv.init(cfg, mem.data(), mem.size()).ok());
  workspace q;
  REQUIRE(drv.add_layer(seq, q, 1, e.view(), block_view(qb, Hq, 4, d)).ok());  // a size query checks nothing else
  CHECK(q.bytes == value_of(drv.workspace_bytes(seq)));
  require_error(drv.add_layer(seq, ws, 1, e.view(), block_view(qb, Hq, 4, d)), errc::invalid_argument,
                "layer 1 given, expected layer 0");
  engine_layer part(H, d, N);
  part.append(s, 0, 1, N);
  require_error(drv.add_layer(seq, ws, 0, part.view(), block_view(qb, Hq, 4, d)), errc::shape_mismatch,
                "holds 15 rows; it must hold the whole prompt (16 tokens");
  {
    const std::size_t wsn = value_of(drv.workspace_bytes(seq));
    std::vector<unsigned char> big(mem.size() + wsn + 128);
    cascade_driver d2;
    REQUIRE(d2.init(cfg, big.data(), mem.size()).ok());
    workspace inside{big.data() + 64, wsn};
    require_error(d2.add_layer(seq, inside, 0, e.view(), block_view(qb, Hq, 4, d)), errc::overlap, "state memory");
  }
  cascade_driver_config cw = cfg;
  cw.weight = weight_source::caller;
  REQUIRE(drv.init(cw, mem.data(), mem.size()).ok());
  require_error(drv.add_layer(seq, ws, 0, e.view(), block_view(qb, Hq, 4, d), kv_view<const float>{}, -1.0),
                errc::invalid_argument, "layer 0's weight is -1");
  REQUIRE(drv.add_layer(seq, ws, 0, e.view(), block_view(qb, Hq, 4, d), kv_view<const float>{}, 1.0).ok());
  engine_layer e1(H, d, N);
  e1.append(s, 1, 0, N);
  const auto qb1 = gather_queries(s, 1, range_of(N - 4, N));
  REQUIRE(drv.add_layer(seq, ws, 1, e1.view(), block_view(qb1, Hq, 4, d), kv_view<const float>{}, 2.0).ok());
  require_error(drv.add_layer(seq, ws, 2, e1.view(), block_view(qb1, Hq, 4, d), kv_view<const float>{}, 2.0),
                errc::invalid_argument, "all 2 layers were added");
  CHECK(drv.held_rows() == 40);
}

TEST_CASE("drivers: chunked errors") {
  const index_t L = 2, H = 2, Hq = 2, d = 4, N = 40;
  const synth s = make_synth(3, L, H, Hq, d, N);
  std::vector<std::int32_t> b(static_cast<std::size_t>(L * H), 10);
  chunked_config cfg;
  cfg.model = {L, H, Hq, d};
  cfg.tokens = N;
  cfg.capacity = 30;
  cfg.rec = small_window(recipe::snapkv(), 4);
  cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(b.data(), L, H));
  auto bad = [&](chunked_config c, errc code, const char* needle) {
    require_error(chunked_driver::state_bytes(c).error(), code, needle);
  };
  chunked_config c = cfg;
  c.rec = recipe::h2o();
  bad(c, errc::unsupported, "h2o scores with every / the last prompt query");
  c.rec = recipe::tova();
  bad(c, errc::unsupported, "tova scores");
  c = cfg;
  c.rec.source = query_source::external_block;
  bad(c, errc::invalid_argument, "the recipe's source must be prompt_window");
  c = cfg;
  c.rec.window = 31;
  bad(c, errc::invalid_argument, "the window 31 is longer than the prompt (40) or the capacity (30)");
  c = cfg;
  c.capacity = 0;
  bad(c, errc::invalid_argument, "capacity = 0 is outside [1, ");
  c = cfg;
  c.tokens = 0;
  bad(c, errc::invalid_argument, "tokens = 0 is outside [1, ");
  c = cfg;
  c.queries = static_cast<chunk_queries>(3);
  bad(c, errc::invalid_argument, "unknown chunk_queries value 3");
  c = cfg;
  c.target = static_cast<chunk_target>(3);
  bad(c, errc::invalid_argument, "unknown chunk_target value 3");
  c = cfg;
  c.alloc.kind = allocator::cake;
  bad(c, errc::unsupported, "the cake allocator needs per-layer preferences");
  c = cfg;
  c.target = chunk_target::fraction;
  c.fraction = 1.5;
  bad(c, errc::invalid_argument, "fraction = 1.5 is outside [0, 1]");
  c.fraction = 0.5;
  c.alloc.kind = allocator::adakv;
  bad(c, errc::unsupported, "adakv shares a per-head budget B_l");
  c = cfg;
  std::vector<std::int32_t> low = {10, 3, 10, 10};
  c.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(low.data(), L, H));
  bad(c, errc::invalid_argument, "budgets[0][1] = 3 is below the 4 protected tokens");
  c = cfg;
  c.alloc.kind = allocator::lava;
  c.alloc.total = 15;
  bad(c, errc::invalid_argument, "lava total 15 is below the 16 protected tokens");

  std::vector<unsigned char> mem(value_of(chunked_driver::state_bytes(cfg)));
  chunked_driver drv;
  require_error(drv.begin_chunk(0, 10), errc::invalid_argument, "not initialised");
  REQUIRE(drv.init(cfg, mem.data(), mem.size()).ok());
  aligned_buf wb;
  workspace ws = make_ws(drv, seq, wb);
  workspace q;
  REQUIRE(drv.add_layer(seq, q, 0, engine_layer(H, d, 30).view(), kv_view<const float>{}).ok());  // size query
  CHECK(q.bytes == ws.bytes);
  require_error(drv.add_layer(seq, ws, 0, engine_layer(H, d, 30).view(), kv_view<const float>{}), errc::invalid_argument,
                "no chunk was begun");
  require_error(drv.decide(seq, ws), errc::invalid_argument, "no chunk was begun");
  require_error(drv.begin_chunk(1, 10), errc::invalid_argument,
                "chunk [1, 10) does not start where the previous one ended (0): chunks must be contiguous");
  require_error(drv.begin_chunk(0, 0), errc::invalid_argument, "chunk [0, 0) is empty or past the 40-token prompt");
  require_error(drv.begin_chunk(0, 41), errc::invalid_argument, "is empty or past");
  require_error(drv.begin_chunk(0, 31), errc::capacity_exceeded, "chunk [0, 31) has 31 tokens, more than the capacity 30");
  require_error(drv.begin_chunk(0, 38), errc::invalid_argument,
                "patched: chunk [0, 38) ends inside the last 4 prompt tokens [36, 40)");
  REQUIRE(drv.begin_chunk(0, 20).ok());
  CHECK(drv.patch().first == 36);
  CHECK(drv.patch().count == 4);
  CHECK(drv.query_rows() == 4);
  CHECK_FALSE(drv.final_chunk());
  auto layers = make_layers(L, H, d, 40);
  layers[0].append(s, 0, 0, 20);
  layers[1].append(s, 1, 0, 20);
  const auto pq0 = gather_queries(s, 0, range_of(36, 40));
  const auto pk0 = gather_keys(s, 0, range_of(36, 40));
  require_error(drv.add_layer(seq, ws, 1, layers[1].view(), block_view(pq0, Hq, 4, d)), errc::invalid_argument,
                "layer 1 given, expected layer 0");
  require_error(drv.decide(seq, ws), errc::invalid_argument, "only 0 of 2 layers of chunk [0, 20) were added");
  require_error(drv.begin_chunk(20, 30), errc::invalid_argument, "chunk [0, 20) is unfinished (0 of 2 layers added)");
  engine_layer short_layer(H, d, 30);
  short_layer.append(s, 0, 0, 19);
  require_error(drv.add_layer(seq, ws, 0, short_layer.view(), block_view(pq0, Hq, 4, d)), errc::shape_mismatch,
                "holds 19 rows; after the previous chunk it kept 0 and the chunk adds 20, so it should hold 20");
  const auto pk_wrong = gather_keys(s, 0, range_of(35, 40));
  require_error(drv.add_layer(seq, ws, 0, layers[0].view(), block_view(pq0, Hq, 4, d), block_view(pk_wrong, H, 5, d)),
                errc::shape_mismatch, "block_keys are [2][5][4], expected [2][4][4]");
  REQUIRE(drv.add_layer(seq, ws, 0, layers[0].view(), block_view(pq0, Hq, 4, d), block_view(pk0, H, 4, d)).ok());
  const auto pq1 = gather_queries(s, 1, range_of(36, 40));
  REQUIRE(drv.add_layer(seq, ws, 1, layers[1].view(), block_view(pq1, Hq, 4, d)).ok());
  require_error(drv.add_layer(seq, ws, 2, layers[1].view(), block_view(pq1, Hq, 4, d)), errc::invalid_argument,
                "all 2 layers of chunk [0, 20) were added");
  REQUIRE(drv.decide(seq, ws).ok());
  // the engine forgets to compact layer 0
  REQUIRE(drv.begin_chunk(20, 36).ok());
  layers[0].append(s, 0, 20, 36);
  require_error(drv.add_layer(seq, ws, 0, layers[0].view(), block_view(pq0, Hq, 4, d)), errc::shape_mismatch,
                "holds 36 rows; after the previous chunk it kept 10 and the chunk adds 16, so it should hold 26 (was it "
                "compacted with kept(0)?)");
  // the chunk's rows at the wrong positions
  engine_layer shifted(H, d, 30);
  for (index_t h = 0; h < H; ++h)
    for (index_t p = 0; p < 26; ++p) shifted.push(s, 0, h, static_cast<pos_t>(p < 10 ? p : p + 1 > 35 ? 35 : p));
  require_error(drv.add_layer(seq, ws, 0, shifted.view(), block_view(pq0, Hq, 4, d)), errc::invalid_argument,
                "the last 16 rows of layer 0 head 0 must be the chunk's tokens (positions [20, 36))");
  // naive: no patch keys
  chunked_config nc = cfg;
  nc.queries = chunk_queries::naive;
  nc.capacity = 40;
  nc.alloc.kind = allocator::lava;
  nc.alloc.total = 40;
  std::vector<unsigned char> mem2(value_of(chunked_driver::state_bytes(nc)));
  REQUIRE(drv.init(nc, mem2.data(), mem2.size()).ok());
  aligned_buf wb2;
  workspace ws2 = make_ws(drv, seq, wb2);
  REQUIRE(drv.begin_chunk(0, 38).ok());  // naive chunks may end anywhere
  CHECK(drv.patch().count == 0);
  auto nl = make_layers(L, H, d, 38);
  nl[0].append(s, 0, 0, 38);
  nl[1].append(s, 1, 0, 38);
  const auto cq0 = gather_queries(s, 0, range_of(34, 38));
  const auto ck0 = gather_keys(s, 0, range_of(34, 38));
  require_error(drv.add_layer(seq, ws2, 0, nl[0].view(), block_view(cq0, Hq, 4, d), block_view(ck0, H, 4, d)),
                errc::shape_mismatch, "block keys were given but this call takes none");
  REQUIRE(drv.add_layer(seq, ws2, 0, nl[0].view(), block_view(cq0, Hq, 4, d)).ok());
  CHECK_FALSE(drv.ready(0));
  REQUIRE(drv.add_layer(seq, ws2, 1, nl[1].view(), block_view(gather_queries(s, 1, range_of(34, 38)), Hq, 4, d)).ok());
  require_error(drv.begin_chunk(38, 40), errc::invalid_argument, "chunk [0, 38) is unfinished (2 of 2 layers added, decide() not run)");
  REQUIRE(drv.decide(seq, ws2).ok());
  require_error(drv.decide(seq, ws2), errc::invalid_argument, "chunk [0, 38) was already decided");
  CHECK(drv.layer_total(0) + drv.layer_total(1) == 40);
}

TEST_CASE("drivers: decode errors") {
  const index_t L = 2, H = 2, Hq = 2, d = 4, N = 30;
  const synth s = make_synth(4, L, H, Hq, d, N);
  std::vector<std::int32_t> b(static_cast<std::size_t>(L * H), 36);
  decode_config cfg;
  cfg.model = {L, H, Hq, d};
  cfg.capacity = 30;
  cfg.interval = 2;
  cfg.rec = recipe::h2o();
  cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(b.data(), L, H));
  auto bad = [&](decode_config c, errc code, const char* needle) {
    require_error(decode_driver::state_bytes(c).error(), code, needle);
  };
  decode_config c = cfg;
  c.interval = 0;
  bad(c, errc::invalid_argument, "interval = 0 (must be >= 1)");
  c = cfg;
  c.alloc.kind = allocator::lava;
  bad(c, errc::unsupported, "lava allocates across layers");
  c = cfg;
  c.rec = small_window(recipe::snapkv(), 31);
  bad(c, errc::invalid_argument, "the window 31 is longer than the capacity 30");
  c = cfg;
  std::vector<std::int32_t> low = {36, 31, 36, 36};
  c.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(low.data(), L, H));
  bad(c, errc::invalid_argument, "budgets[0][1] = 31 is below the 32 protected tokens");
  c = cfg;
  c.query_rows = 3;
  bad(c, errc::invalid_argument, "query_rows = 3 but h2o reads 0 query rows at an eviction");
  std::vector<unsigned char> mem(value_of(decode_driver::state_bytes(cfg)));
  decode_driver drv;
  engine_layer e(H, d, 30);
  e.append(s, 0, 0, 10);
  require_error(drv.begin(0, e.view(), 10), errc::invalid_argument, "not initialised");
  REQUIRE(drv.init(cfg, mem.data(), mem.size()).ok());
  aligned_buf wb;
  workspace ws = make_ws(drv, seq, wb);
  require_error(drv.begin(2, e.view(), 10), errc::out_of_range, "layer 2 is outside [0, 2)");
  require_error(drv.begin(0, e.view(), -1), errc::invalid_argument, "tokens = -1 is outside");
  require_error(drv.begin(0, e.view(), 9), errc::out_of_range, "holds position 9, outside [0, 9)");
  std::vector<float> init(static_cast<std::size_t>(H * 5));
  require_error(drv.begin(0, e.view(), 10, value_of(make_matrix_view<const float>(init.data(), H, 5))),
                errc::shape_mismatch, "initial has 5 columns but head 0 holds 10 rows");
  std::vector<float> init10(static_cast<std::size_t>(H * 10), 0.f);
  init10[3] = std::nanf("");
  require_error(drv.begin(0, e.view(), 10, value_of(make_matrix_view<const float>(init10.data(), H, 10))),
                errc::invalid_argument, "initial[0][3] is NaN");
  const auto q10 = gather_queries(s, 0, range_of(10, 11));
  e.append(s, 0, 10, 11);
  require_error(drv.step(seq, ws, 0, e.view(), block_view(q10, Hq, 1, d)), errc::invalid_argument, "layer 0 was not begun");
  engine_layer e0(H, d, 30);  // an evicted layer: 5 rows per head
  for (index_t h = 0; h < H; ++h)
    for (pos_t p : {0, 2, 4, 6, 8}) e0.push(s, 0, h, p);
  REQUIRE(drv.begin(0, e0.view(), 10).ok());
  CHECK_FALSE(drv.evicts_next(0));
  engine_layer late = e0;
  for (index_t h = 0; h < H; ++h) late.push(s, 0, h, 9);
  require_error(drv.step(seq, ws, 0, late.view(), block_view(q10, Hq, 1, d)), errc::invalid_argument,
                "the last 1 rows of layer 0 head 0 must be the new token (positions [10, 11))");
  engine_layer future = e0;
  for (index_t h = 0; h < H; ++h) future.push(s, 0, h, 11);
  require_error(drv.step(seq, ws, 0, future.view(), block_view(q10, Hq, 1, d)), errc::out_of_range,
                "holds position 11, outside [0, 11)");
  engine_layer e1(H, d, 30);
  e1.append(s, 0, 0, 10);
  REQUIRE(drv.begin(0, e1.view(), 10).ok());
  e1.append(s, 0, 10, 11);
  require_error(drv.step(seq, ws, 0, e1.view(), kv_view<const float>{}), errc::shape_mismatch,
                "queries are [0][0][0], expected [2][1][4]");
  workspace small{ws.data, 16};
  require_error(drv.step(seq, small, 0, e1.view(), block_view(q10, Hq, 1, d)), errc::workspace_too_small,
                "workspace has 16 bytes");
  REQUIRE(drv.step(seq, ws, 0, e1.view(), block_view(q10, Hq, 1, d)).ok());
  CHECK(drv.tokens(0) == 11);
  CHECK(drv.evicts_next(0));
  CHECK(drv.accumulated(0, 0) != nullptr);
  e1.append(s, 0, 11, 13);
  require_error(drv.step(seq, ws, 0, e1.view(), block_view(q10, Hq, 1, d)), errc::shape_mismatch,
                "head 0 holds 13 rows; it held 11 and a step adds one");
}

// =================================================================================================
// The reference runner's cache (examples/runner): the drivers read kv_cache's paged views (one page
// pool per layer, per-head block tables) as they are

#include <runner/runner.hpp>

TEST_CASE("drivers: chunked patched eviction and decode-time H2O on the runner's kv_cache (stories260K)") {
  kvrun::model m;
  REQUIRE(kvrun::model::load_file(KVEVICT_SOURCE_DIR "/models/stories260K.bin", m).ok());
  const kvrun::config& mc = m.cfg();
  kvrun::runner run;
  REQUIRE(run.init(m).ok());
  kvrun::kv_cache c;
  REQUIRE(c.init(mc).ok());
  const index_t L = mc.n_layers, H = mc.n_kv_heads, Hq = mc.n_heads, d = mc.head_size(), N = 96, w = 8, B = 24;
  std::vector<int> prompt(static_cast<std::size_t>(N));
  prompt[0] = 1;
  for (index_t i = 1; i < N; ++i) prompt[static_cast<std::size_t>(i)] = static_cast<int>(3 + (i * 37) % 500);
  std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H), static_cast<std::int32_t>(B));
  chunked_config cfg;
  cfg.model = {L, H, Hq, d};
  cfg.tokens = N;
  cfg.capacity = B + 32;
  cfg.pool_pages = c.pool_pages();
  cfg.rec = small_window(recipe::snapkv(), w);
  cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
  std::vector<unsigned char> mem(value_of(chunked_driver::state_bytes(cfg)));
  std::vector<pos_t> store(static_cast<std::size_t>(L * H * (N + 8)));
  auto rec = value_of(make_eviction_recorder(store.data(), L, H, N + 8));
  chunked_driver drv;
  REQUIRE(drv.init(cfg, mem.data(), mem.size(), &rec).ok());
  aligned_buf wb;
  workspace ws = make_ws(drv, seq, wb);
  // per layer: the query block (and patch keys) the hooks collect
  std::vector<std::vector<float>> qs(static_cast<std::size_t>(L)), ks(static_cast<std::size_t>(L));
  index_t want = 0;
  kvrun::forward_hooks collect;
  collect.after_layer = [&](const kvrun::layer_event& ev) -> status {
    auto& q = qs[static_cast<std::size_t>(ev.layer)];
    auto& k = ks[static_cast<std::size_t>(ev.layer)];
    q.assign(static_cast<std::size_t>(Hq * want * d), 0.f);
    k.assign(static_cast<std::size_t>(H * want * d), 0.f);
    for (index_t i = 0; i < want; ++i) {
      const index_t row = ev.rows - want + i;  // the block's last `want` rows
      for (index_t h = 0; h < Hq; ++h)
        for (index_t e = 0; e < d; ++e) q[static_cast<std::size_t>((h * want + i) * d + e)] = ev.queries(h, row, e);
      for (index_t h = 0; h < H; ++h)
        for (index_t e = 0; e < d; ++e) k[static_cast<std::size_t>((h * want + i) * d + e)] = ev.keys(h, row, e);
    }
    return {};
  };
  for (index_t s = 0; s < N; s += 32) {
    const index_t e = s + 32;
    REQUIRE(drv.begin_chunk(s, e).ok());
    const patch_block pb = drv.patch();
    want = pb.count > 0 ? 0 : drv.query_rows();
    REQUIRE(run.forward(c, kvrun::tokens(prompt.data() + s, e - s), kvrun::logits_mode::last, collect).ok());
    if (pb.count > 0) {  // the prompt's last w tokens after the chunk, their KV dropped
      std::vector<pos_t> pp;
      for (index_t i = 0; i < pb.count; ++i) pp.push_back(static_cast<pos_t>(pb.first + i));
      want = pb.count;
      REQUIRE(run.forward_extra(c, kvrun::tokens(prompt.data() + pb.first, pb.count, pp.data()), kvrun::logits_mode::none,
                                collect)
                  .ok());
    }
    for (index_t l = 0; l < L; ++l) {
      const auto kv = value_of(c.paged(static_cast<int>(l)));
      const status st = drv.add_layer(seq, ws, l, kv, block_view(qs[static_cast<std::size_t>(l)], Hq, w, d),
                                      pb.count > 0 ? block_view(ks[static_cast<std::size_t>(l)], H, w, d)
                                                   : kv_view<const float>{});
      REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    }
    REQUIRE(drv.decide(seq, ws).ok());
    for (index_t l = 0; l < L; ++l) REQUIRE(c.compact(static_cast<int>(l), drv.kept(l)).ok());
    for (index_t l = 0; l < L; ++l)
      for (index_t h = 0; h < H; ++h) CHECK(c.length(static_cast<int>(l), h) == std::min<index_t>(B, e));
  }
  // the window's tokens are kept (protected), in every head
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < w; ++j) CHECK(c.position(static_cast<int>(l), h, B - w + j) == N - w + j);

  // decode with H2O back to B rows every 4 steps, on the same cache
  decode_config dc;
  dc.model = cfg.model;
  dc.capacity = B + 4;
  dc.interval = 4;
  dc.pool_pages = c.pool_pages();
  dc.rec = recipe::h2o();
  dc.rec.n_recent = 4;
  dc.alloc.budgets = cfg.alloc.budgets;
  std::vector<unsigned char> dmem(value_of(decode_driver::state_bytes(dc)));
  decode_driver dd;
  REQUIRE(dd.init(dc, dmem.data(), dmem.size(), &rec).ok());
  aligned_buf dwb;
  workspace dws = make_ws(dd, seq, dwb);
  for (index_t l = 0; l < L; ++l)
    REQUIRE(dd.begin(seq, dws, l, value_of(c.paged(static_cast<int>(l))), N).ok());
  kvrun::forward_hooks evict;
  evict.after_layer = [&](const kvrun::layer_event& ev) -> status {
    const int l = ev.layer;
    auto kv = c.paged(l);
    if (!kv) return kv.error();
    KVEVICT_TRY(dd.step(seq, dws, l, *kv, ev.queries));  // the new token's query, [Hq][1][d]
    if (dd.evicted(l)) KVEVICT_TRY(c.compact(l, dd.kept(l)));
    return {};
  };
  int tok = 0;
  for (index_t t = 0; t < 8; ++t) {
    const float* lg = run.logits(0);
    tok = static_cast<int>(std::max_element(lg, lg + mc.vocab_size) - lg);
    REQUIRE(run.decode(c, tok, evict).ok());
  }
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < H; ++h) CHECK(c.length(static_cast<int>(l), h) == B);
  std::vector<std::int64_t> tmp(static_cast<std::size_t>(N + 8) + 8);  // + 64 B: the carver's base padding
  workspace mws{tmp.data(), tmp.size() * sizeof(std::int64_t)};
  kv_usage usage;
  REQUIRE(measure_kv_usage(mws, value_of(rec.schedule(N + 8)), usage).ok());
  CHECK(usage.peak == (B + 32) * L * H);  // the cache never holds more than the budget + a chunk
  // resident keys per row: chunk 0 sees 1..32, chunks 1 and 2 see B + 1..32, the decode steps
  // B + 1..4 twice (evicted back to B every 4 steps)
  std::int64_t per_row = 0;
  for (index_t j = 1; j <= 32; ++j) per_row += j + 2 * (B + j);
  for (index_t j = 1; j <= 4; ++j) per_row += 2 * (B + j);
  CHECK(usage.resident == per_row * L * H);
}

// =================================================================================================
// compact_layer and the scores entry points' own errors

TEST_CASE("drivers: compact_layer equals compacting keys, values and positions one by one; errors write nothing") {
  for (std::uint64_t seed = 201; seed <= 212; ++seed) {
    auto g = kvtest::rng(seed);
    const index_t H = kvtest::uniform_int(g, 1, 4), d = kvtest::uniform_int(g, 1, 9), C = kvtest::uniform_int(g, 4, 30);
    const synth s = make_synth(seed, 1, H, H, d, C);
    engine_layer a(H, d, C);
    for (index_t h = 0; h < H; ++h)
      for (index_t p = 0; p < C; ++p)
        if (kvtest::uniform_int(g, 0, 3) > 0) a.push(s, 0, h, static_cast<pos_t>(p));
    // kept: a random ascending subset of every head's rows
    std::vector<std::int32_t> cu{0};
    std::vector<pos_t> kpos;
    for (index_t h = 0; h < H; ++h) {
      for (std::int32_t j = 0; j < a.lens[static_cast<std::size_t>(h)]; ++j)
        if (kvtest::uniform_int(g, 0, 1) == 1) kpos.push_back(j);
      cu.push_back(static_cast<std::int32_t>(kpos.size()));
    }
    kpos.push_back(0);  // never empty storage
    const ragged_positions kept{kpos.data(), cu.data(), H};
    engine_layer b = a;
    a.compact(kept);
    b.compact_by_stages(kept);
    CHECK(a.lens == b.lens);
    for (index_t h = 0; h < H; ++h) {
      CHECK(a.positions(h) == b.positions(h));
      const auto n = static_cast<std::size_t>(a.lens[static_cast<std::size_t>(h)]);
      CHECK(std::equal(a.keys.begin() + h * C * d, a.keys.begin() + h * C * d + n * d, b.keys.begin() + h * C * d));
      CHECK(std::equal(a.values.begin() + h * C * d, a.values.begin() + h * C * d + n * d, b.values.begin() + h * C * d));
    }
  }
  // separate length arrays: all three updated
  const index_t H = 2, d = 3, C = 6;
  const synth s = make_synth(7, 1, H, H, d, C);
  engine_layer e(H, d, C);
  e.append(s, 0, 0, C);
  std::vector<std::int32_t> vl(e.lens), pl(e.lens);
  ragged_cache<float> vc = e.vc();
  vc.lens = vl.data();
  ragged_cache<pos_t> pc = e.pc();
  pc.lens = pl.data();
  std::vector<std::int32_t> cu{0, 2, 3};
  std::vector<pos_t> kp{1, 4, 5};
  const ragged_positions kept{kp.data(), cu.data(), H};
  const engine_layer before = e;
  // errors: nothing is written
  std::vector<pos_t> bad{4, 1, 5};
  require_error(compact_layer(seq, e.kc(), vc, pc, ragged_positions{bad.data(), cu.data(), H}), errc::not_sorted,
                "strictly ascending");
  std::vector<pos_t> past{1, 6, 5};
  require_error(compact_layer(seq, e.kc(), vc, pc, ragged_positions{past.data(), cu.data(), H}), errc::out_of_range,
                "outside [0, 6)");
  require_error(compact_layer(seq, e.kc(), vc, pc, ragged_positions{kp.data(), cu.data(), 1}), errc::shape_mismatch,
                "kept lists 1 heads, the layer has 2");
  vl[1] = 5;
  require_error(compact_layer(seq, e.kc(), vc, pc, kept), errc::shape_mismatch, "head 1 holds 6 key rows, 5 value rows");
  vl[1] = 6;
  ragged_positions inside{e.pos.data(), cu.data(), H};
  require_error(compact_layer(seq, e.kc(), vc, pc, inside), errc::overlap, "kept");
  ragged_cache<pos_t> wide = pc;
  wide.dim = 2;
  CHECK_FALSE(compact_layer(seq, e.kc(), vc, wide, kept).ok());
  CHECK(e.keys == before.keys);
  CHECK(e.values == before.values);
  CHECK(e.pos == before.pos);
  CHECK(e.lens == before.lens);
  REQUIRE(compact_layer(par, e.kc(), vc, pc, kept).ok());
  CHECK(e.lens == std::vector<std::int32_t>{2, 1});
  CHECK(vl == e.lens);
  CHECK(pl == e.lens);
  CHECK(e.positions(0) == std::vector<pos_t>{1, 4});
  CHECK(e.positions(1) == std::vector<pos_t>{5});
  CHECK(std::equal(e.keys.begin(), e.keys.begin() + d, s.key(0, 1, 0)));
  CHECK(std::equal(e.values.begin() + (C + 0) * d, e.values.begin() + (C + 1) * d, s.value(0, 5, 1)));
}

TEST_CASE("drivers: the scores entry points check the scores; they need no queries") {
  const index_t L = 2, H = 2, Hq = 4, d = 8, P = 20;
  const synth s = make_synth(3, L, H, Hq, d, P);
  std::vector<std::int32_t> budgets(static_cast<std::size_t>(L * H), 10);
  post_fill_config cfg;
  cfg.model = {L, H, Hq, d};
  cfg.tokens = P;
  cfg.rec = small_window(recipe::snapkv(), 4);
  cfg.alloc.budgets = value_of(make_matrix_view<const std::int32_t>(budgets.data(), L, H));
  std::vector<unsigned char> mem(value_of(post_fill_driver::state_bytes(cfg)));
  post_fill_driver drv;
  auto layers = make_layers(L, H, d, P);
  for (index_t l = 0; l < L; ++l) layers[static_cast<std::size_t>(l)].append(s, l, 0, P);
  std::vector<float> sc(static_cast<std::size_t>(H * P), 1.0f);
  workspace none;
  require_error(drv.add_layer_scores(seq, none, 0, layers[0].view(), scores_view(sc, H, P)), errc::invalid_argument,
                "not initialised (init)");
  REQUIRE(drv.init(cfg, mem.data(), mem.size()).ok());
  aligned_buf wb;
  workspace ws = make_ws(drv, seq, wb);
  workspace q;  // the same two-phase size as add_layer
  REQUIRE(drv.add_layer_scores(seq, q, 0, layers[0].view(), scores_view(sc, H, P)).ok());
  CHECK(q.bytes == ws.bytes);
  require_error(drv.add_layer_scores(seq, ws, 0, layers[0].view(), scores_view(sc, H, P - 1)), errc::shape_mismatch,
                "scores are [2][19], expected [2 KV heads][at least 20 rows]");
  require_error(drv.add_layer_scores(seq, ws, 0, layers[0].view(), scores_view(sc, 1, P)), errc::shape_mismatch,
                "scores are [1][20]");
  sc[7] = std::nanf("");
  require_error(drv.add_layer_scores(seq, ws, 0, layers[0].view(), scores_view(sc, H, P)), errc::invalid_argument,
                "scores[0][7] is NaN");
  sc[7] = 0.5f;
  require_error(drv.add_layer_scores(seq, ws, 1, layers[1].view(), scores_view(sc, H, P)), errc::invalid_argument,
                "layer 1 given, expected layer 0");
  // accepted without the window's queries; the protected rows are kept whatever the scores say
  for (index_t h = 0; h < H; ++h)
    for (index_t j = 0; j < P; ++j) sc[static_cast<std::size_t>(h * P + j)] = -float(j);
  REQUIRE(drv.add_layer_scores(seq, ws, 0, layers[0].view(), scores_view(sc, H, P)).ok());
  REQUIRE(drv.ready(0));
  const auto k = to_lists(drv.kept(0));
  for (index_t h = 0; h < H; ++h) {
    const auto& kh = k[static_cast<std::size_t>(h)];
    REQUIRE(kh.size() == 10u);
    // the last 4 rows (n_recent = the window) are protected; the other 6 score highest at the
    // lowest positions (the sinks among them)
    std::vector<pos_t> want = range_of(0, 6);
    for (index_t j = P - 4; j < P; ++j) want.push_back(static_cast<pos_t>(j));
    CHECK(cfg.rec.n_sink <= 6);
    CHECK(kh == want);
  }
}

// =================================================================================================
// Chunked and decode drivers across tensor-parallel ranks

namespace {

/// Runs `run` on the whole case (one process) and on `ranks` threads holding their slices of the
/// heads and budgets; per step and layer, the ranks' heads in rank order equal the one process's.
template <class Case, class Run>
void check_tensor_parallel(const Case& c, int ranks, Run run) {
  const auto ref = run(c);
  const index_t L = c.s.L, H = c.s.H, Hl = H / ranks;
  std::vector<std::decay_t<decltype(ref)>> got(static_cast<std::size_t>(ranks));
  kvtest::thread_world::run(ranks, [&](kvtest::thread_comm& comm) {
    Case rc = c;
    rc.s = slice_heads(c.s, Hl * comm.rank(), Hl);
    rc.budgets = slice_budgets(c.budgets, L, H, Hl * comm.rank(), Hl);
    rc.tp = comm_ref(comm);
    got[static_cast<std::size_t>(comm.rank())] = run(rc);
  });
  auto merged = got[0];
  for (std::size_t t = 0; t < merged.size(); ++t)
    for (std::size_t l = 0; l < merged[t].size(); ++l)
      for (int r = 1; r < ranks; ++r) {
        const auto& part = got[static_cast<std::size_t>(r)][t][l];
        merged[t][l].insert(merged[t][l].end(), part.begin(), part.end());
      }
  CHECK(merged == ref);
}

/// As check_tensor_parallel across `stages` pipeline stages (chunk_case: lava), each holding
/// layer_shard's layers: per chunk, the stages' layers in stage order equal the one process's.
template <class Run>
void check_pipeline(const chunk_case& c, int stages, Run run) {
  const auto ref = run(c);
  std::vector<std::decay_t<decltype(ref)>> got(static_cast<std::size_t>(stages));
  kvtest::thread_world::run(stages, [&](kvtest::thread_comm& comm) {
    const shard_range mine = value_of(layer_shard(c.s.L, stages, comm.rank()));
    chunk_case rc = c;
    rc.s = slice_layers(c.s, mine.first, mine.count);
    rc.pp = comm_ref(comm);
    rc.first_layer = mine.first;
    rc.model_layers = c.s.L;
    got[static_cast<std::size_t>(comm.rank())] = run(rc);
  });
  auto merged = got[0];
  for (std::size_t t = 0; t < merged.size(); ++t)
    for (int r = 1; r < stages; ++r) {
      const auto& part = got[static_cast<std::size_t>(r)][t];
      merged[t].insert(merged[t].end(), part.begin(), part.end());
    }
  CHECK(merged == ref);
}

/// Budgets [L][H] whose ranks' blocks are the same random block (every rank's sum per layer is
/// the same, as the sharded flattened / adakv layers require).
std::vector<std::int32_t> rank_budgets(std::mt19937_64& g, index_t L, index_t H, int ranks, index_t lo, index_t hi,
                                       bool vary) {
  const index_t Hl = H / ranks;
  std::vector<std::int32_t> b(static_cast<std::size_t>(L * H));
  const auto B = static_cast<std::int32_t>(kvtest::uniform_int(g, lo, hi));
  for (index_t l = 0; l < L; ++l)
    for (index_t h = 0; h < Hl; ++h) {
      const auto x = vary ? static_cast<std::int32_t>(kvtest::uniform_int(g, lo, hi)) : B;
      for (int r = 0; r < ranks; ++r) b[static_cast<std::size_t>(l * H + r * Hl + h)] = x;
    }
  return b;
}

/// A chunked LAVa case across `stages` pipeline stages: stages to stages + 2 layers, 1-3 KV heads
/// (1 or 2 query heads each), 30-60 tokens in 1-4 random chunks, a random fraction and total.
chunk_case pipeline_lava_case(std::mt19937_64& g, std::uint64_t synth_seed, int stages, const recipe& r,
                              chunk_queries mode, chunk_target target) {
  chunk_case c;
  const index_t L = kvtest::uniform_int(g, stages, stages + 2), H = kvtest::uniform_int(g, 1, 3);
  c.N = kvtest::uniform_int(g, 30, 60);
  c.s = make_synth(synth_seed, L, H, H * kvtest::uniform_int(g, 1, 2), 4, c.N);
  c.r = r;
  c.mode = mode;
  c.target = target;
  c.p = double(kvtest::uniform_int(g, 0, 10)) / 10.0;
  c.kind = allocator::lava;
  const index_t prot = c.r.n_sink + c.r.n_recent;
  c.total = L * H * kvtest::uniform_int(g, std::max<index_t>(prot, 1), prot + 20);
  const bool patched = c.mode == chunk_queries::patched && uses_attention(c.r.kind);
  c.bounds = random_bounds(g, c.N, patched ? c.N - c.r.window : c.N - 1, kvtest::uniform_int(g, 1, 4));
  return c;
}

}  // namespace

TEST_CASE("drivers: chunked across tensor-parallel ranks keeps the single-process rows (flattened, adakv, lava)") {
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 6; ++seed)
    for (allocator kind : {allocator::per_head, allocator::flattened, allocator::adakv, allocator::lava})
      for (int ranks : {2, 3}) {
        auto g = kvtest::rng(seed * 13 + static_cast<std::uint64_t>(kind) * 3 + static_cast<std::uint64_t>(ranks));
        chunk_case c;
        const index_t L = kvtest::uniform_int(g, 1, 3), H = ranks * kvtest::uniform_int(g, 1, 2);
        const index_t Hq = H * kvtest::uniform_int(g, 1, 2), d = 4;
        c.N = kvtest::uniform_int(g, 30, 60);
        c.s = make_synth(seed, L, H, Hq, d, c.N);
        c.r = seed % 3 == 0 ? small_window(recipe::snapkv(), 5) : seed % 3 == 1 ? small_window(recipe::lava(), 4)
                                                                                : recipe::streaming_llm(3);
        c.mode = seed % 2 ? chunk_queries::patched : chunk_queries::naive;
        c.target = kind != allocator::adakv && seed % 4 < 2 ? chunk_target::fraction : chunk_target::budget;
        c.p = double(kvtest::uniform_int(g, 0, 10)) / 10.0;
        c.kind = kind;
        const index_t prot = c.r.n_sink + c.r.n_recent, lo = std::max<index_t>(prot, 1);
        c.budgets = rank_budgets(g, L, H, ranks, lo, prot + 20, kind != allocator::adakv);
        c.total = L * H * kvtest::uniform_int(g, lo, prot + 20);  // lava: the model's, all ranks' heads
        const bool patched = c.mode == chunk_queries::patched && uses_attention(c.r.kind);
        c.bounds = random_bounds(g, c.N, patched ? c.N - c.r.window : c.N - 1, kvtest::uniform_int(g, 1, 4));
        CAPTURE(seed);
        CAPTURE(static_cast<int>(kind));
        CAPTURE(ranks);
        check_tensor_parallel(c, ranks, [](const chunk_case& x) { return run_chunked(seq, x, nullptr); });
        ++cases;
      }
  CHECK(cases == 6 * 4 * 2);
}

TEST_CASE("drivers: chunked lava across pipeline stages keeps the single-process rows (budget and fraction targets)") {
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 8; ++seed)
    for (int stages : {2, 3}) {
      auto g = kvtest::rng(seed * 17 + static_cast<std::uint64_t>(stages));
      const recipe r = seed % 3 == 0 ? small_window(recipe::snapkv(), 5)
                       : seed % 3 == 1 ? small_window(recipe::lava(), 4)
                                       : recipe::streaming_llm(3);
      const chunk_case c = pipeline_lava_case(g, seed + 40, stages, r, seed % 2 ? chunk_queries::patched : chunk_queries::naive,
                                              seed % 4 < 2 ? chunk_target::fraction : chunk_target::budget);
      CAPTURE(seed);
      CAPTURE(stages);
      check_pipeline(c, stages, [](const chunk_case& x) { return run_chunked(seq, x, nullptr); });
      ++cases;
    }
  CHECK(cases == 8 * 2);
}

TEST_CASE("drivers: chunked lava across pipeline stages: a stage failing in add_layer fails every stage in decide, no hang") {
  // one stage's add_layer fails in some chunk (a NaN query: LAVa's entropy refuses the NaN scores;
  // or a query block of the wrong shape); it stops adding layers and decides, as the contract
  // says; every other stage's decide() returns the error naming that stage, no chunk is decided
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 6; ++seed)
    for (int stages : {2, 3}) {
      auto g = kvtest::rng(seed * 19 + static_cast<std::uint64_t>(stages));
      const chunk_case c = pipeline_lava_case(g, seed + 60, stages, seed % 2 ? small_window(recipe::lava(), 4) : small_window(recipe::snapkv(), 5),
                                              seed % 3 ? chunk_queries::patched : chunk_queries::naive,
                                              seed % 4 < 2 ? chunk_target::fraction : chunk_target::budget);
      const index_t L = c.s.L, H = c.s.H;
      const bool patched = c.mode == chunk_queries::patched;
      const index_t chunks = static_cast<index_t>(c.bounds.size()) - 1;
      const int bad = static_cast<int>(kvtest::uniform_int(g, 0, stages - 1));
      const bool nan = seed % 2 == 0;
      // a NaN query reaches the scores only where a row is evictable: a naive first chunk no longer
      // than the window protects every row (its scores are not read), so NaN naive cases poison the
      // final chunk (the whole prompt's rows)
      const index_t bad_chunk = nan && !patched ? chunks - 1 : kvtest::uniform_int(g, 0, chunks - 1);
      std::vector<std::string> added(static_cast<std::size_t>(stages)), decided(added.size());
      std::vector<index_t> done(added.size(), -1);
      kvtest::thread_world::run(stages, [&](kvtest::thread_comm& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        const shard_range mine = value_of(layer_shard(L, stages, comm.rank()));
        chunk_case rc = c;
        rc.s = slice_layers(c.s, mine.first, mine.count);
        rc.pp = comm_ref(comm);
        rc.first_layer = mine.first;
        rc.model_layers = L;
        const chunked_config cfg = chunk_cfg(rc);
        std::vector<unsigned char> mem(value_of(chunked_driver::state_bytes(cfg)));
        chunked_driver d;
        REQUIRE(d.init(cfg, mem.data(), mem.size()).ok());
        aligned_buf wb;
        workspace ws = make_ws(d, seq, wb);
        auto layers = make_layers(mine.count, H, c.s.d, c.N);
        for (index_t ci = 0; ci < chunks; ++ci) {
          const index_t b = c.bounds[static_cast<std::size_t>(ci)], e = c.bounds[static_cast<std::size_t>(ci + 1)];
          REQUIRE(d.begin_chunk(b, e).ok());
          const patch_block pb = d.patch();
          const index_t qr = d.query_rows();
          const auto qpos = pb.count > 0 ? range_of(pb.first, pb.first + pb.count) : range_of(e - qr, e);
          status st;
          for (index_t l = 0; l < mine.count && st.ok(); ++l) {
            auto& lay = layers[static_cast<std::size_t>(l)];
            lay.append(rc.s, l, b, e);
            auto qb = gather_queries(rc.s, l, qpos);
            const bool poison = static_cast<int>(me) == bad && ci == bad_chunk && l == mine.count - 1;
            if (poison && nan) qb[0] = std::numeric_limits<float>::quiet_NaN();
            const index_t rows = poison && !nan ? qr - 1 : qr;  // one row short
            st = d.add_layer(seq, ws, l, lay.view(), block_view(qb, rc.s.Hq, rows, rc.s.d));
          }
          const status dec = d.decide(seq, ws);  // every stage decides, also after a failure
          if (!st.ok() || !dec.ok()) {
            added[me] = st.ok() ? "" : st.message();
            decided[me] = dec.ok() ? "" : dec.message();
            break;
          }
          for (index_t l = 0; l < mine.count; ++l) layers[static_cast<std::size_t>(l)].compact(d.kept(l));
        }
        done[me] = d.chunks_done();
      });
      for (int rk = 0; rk < stages; ++rk) {
        CAPTURE(seed);
        CAPTURE(stages);
        CAPTURE(bad);
        CAPTURE(bad_chunk);
        CAPTURE(rk);
        const auto me = static_cast<std::size_t>(rk);
        CHECK(done[me] == bad_chunk);  // the failing chunk is decided nowhere
        CHECK(decided[me] != "");
        if (rk == bad) {
          CHECK(added[me].find(nan ? "NaN" : "queries") != std::string::npos);
        } else {
          CHECK(added[me] == "");
          CHECK(decided[me].find("rank " + std::to_string(bad) + " of " + std::to_string(stages)) != std::string::npos);
          CHECK(decided[me].find("chunked_driver::decide") != std::string::npos);
        }
      }
      ++cases;
    }
  CHECK(cases == 6 * 2);
}

TEST_CASE("drivers: decode across tensor-parallel ranks keeps the single-process rows (flattened, adakv)") {
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 8; ++seed)
    for (allocator kind : {allocator::per_head, allocator::flattened, allocator::adakv})
      for (int ranks : {2, 3}) {
        auto g = kvtest::rng(seed * 11 + static_cast<std::uint64_t>(kind) * 5 + static_cast<std::uint64_t>(ranks));
        decode_case c;
        const index_t L = kvtest::uniform_int(g, 1, 2), H = ranks * kvtest::uniform_int(g, 1, 2);
        const index_t Hq = H * kvtest::uniform_int(g, 1, 2);
        c.P = kvtest::uniform_int(g, 8, 20);
        c.G = kvtest::uniform_int(g, 10, 24);
        c.interval = kvtest::uniform_int(g, 1, 3);
        c.s = make_synth(seed, L, H, Hq, 4, c.P + c.G);
        const int rk = static_cast<int>(seed % 4);
        c.r = rk == 0 ? recipe::h2o() : rk == 1 ? small_window(recipe::snapkv(), 4) : rk == 2 ? recipe::tova()
                                                                                              : recipe::knorm();
        c.r.n_sink = rk == 0 ? 1 : c.r.n_sink;
        c.kind = kind;
        const index_t prot = c.r.n_sink + c.r.n_recent;
        c.budgets = rank_budgets(g, L, H, ranks, std::max<index_t>(prot, 2), prot + 8, kind != allocator::adakv);
        CAPTURE(seed);
        CAPTURE(static_cast<int>(kind));
        CAPTURE(ranks);
        check_tensor_parallel(c, ranks, [](const decode_case& x) { return run_decode(seq, x, nullptr); });
        check_tensor_parallel(c, ranks, [](const decode_case& x) { return run_decode(seq, x, nullptr, true); });
        ++cases;
      }
  CHECK(cases == 8 * 3 * 2);
}

TEST_CASE("drivers: decode across tensor-parallel ranks sends one agreement per due step, plus the selection when it evicts") {
  // the collectives' payload, pinned (docs/distributed.md): 88 bytes in 1 collective for the
  // agreement of a due step, 41,064 bytes in 6 for a sharded selection
  constexpr std::uint64_t agreement = 88, selection = 41064, agreement_calls = 1, selection_calls = 6;
  int due_steps = 0, evicting = 0;
  for (allocator kind : {allocator::flattened, allocator::adakv})
    for (int ranks : {2, 3}) {
      auto g = kvtest::rng(91 + static_cast<std::uint64_t>(kind) * 7 + static_cast<std::uint64_t>(ranks));
      decode_case c;
      const index_t L = 2, Hl = 2, H = ranks * Hl;
      c.P = 12;
      c.G = 16;
      c.interval = 2;
      c.s = make_synth(static_cast<std::uint64_t>(ranks) + 5, L, H, H, 4, c.P + c.G);
      c.r = small_window(recipe::snapkv(), 4);
      c.kind = kind;
      // budgets above the prompt: the first due steps keep everything, the later ones evict
      c.budgets = rank_budgets(g, L, H, ranks, c.P + 1, c.P + 4, kind != allocator::adakv);
      // per rank, per step and layer: due, evicted, bytes and collectives of the step
      std::vector<std::vector<std::array<std::uint64_t, 4>>> seen(static_cast<std::size_t>(ranks));
      std::vector<std::string> errors(static_cast<std::size_t>(ranks));
      kvtest::thread_world::run(ranks, [&](kvtest::thread_comm& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        decode_case rc = c;
        rc.s = slice_heads(c.s, Hl * comm.rank(), Hl);
        rc.budgets = slice_budgets(c.budgets, L, H, Hl * comm.rank(), Hl);
        counting_comm<kvtest::thread_comm> counted(comm);
        rc.tp = comm_ref(counted);
        const decode_config cfg = decode_cfg(rc);
        std::vector<unsigned char> mem(value_of(decode_driver::state_bytes(cfg)));
        decode_driver d;
        status st = d.init(cfg, mem.data(), mem.size());
        aligned_buf wb;
        workspace ws = make_ws(d, seq, wb);
        auto layers = make_layers(L, Hl, rc.s.d, cfg.capacity);
        for (index_t l = 0; l < L && st.ok(); ++l) {
          layers[static_cast<std::size_t>(l)].append(rc.s, l, 0, c.P);
          st = d.begin(l, layers[static_cast<std::size_t>(l)].view(), c.P);
        }
        for (index_t t = c.P; t < c.P + c.G && st.ok(); ++t)
          for (index_t l = 0; l < L && st.ok(); ++l) {
            auto& lay = layers[static_cast<std::size_t>(l)];
            lay.append(rc.s, l, t, t + 1);
            const bool due = d.evicts_next(l);
            const auto qb = gather_queries(rc.s, l, due ? decode_query_positions(c.r, t) : std::vector<pos_t>{});
            const std::uint64_t b0 = counted.bytes(), c0 = counted.calls();
            st = d.step(seq, ws, l, lay.view(), block_view(qb, Hl, due ? c.r.window : 0, rc.s.d));
            if (st.ok() && d.evicted(l)) lay.compact(d.kept(l));
            seen[me].push_back({due ? 1u : 0u, d.evicted(l) ? 1u : 0u, counted.bytes() - b0, counted.calls() - c0});
          }
        errors[me] = st.ok() ? "" : st.message();
      });
      for (int rk = 0; rk < ranks; ++rk) {
        CAPTURE(static_cast<int>(kind));
        CAPTURE(rk);
        REQUIRE(errors[static_cast<std::size_t>(rk)] == "");
        for (const auto& s : seen[static_cast<std::size_t>(rk)]) {
          CHECK(s[2] == s[0] * agreement + s[1] * selection);
          CHECK(s[3] == s[0] * agreement_calls + s[1] * selection_calls);
          if (rk == 0) {
            due_steps += static_cast<int>(s[0]);
            evicting += static_cast<int>(s[1]);
          }
        }
        CHECK(seen[static_cast<std::size_t>(rk)] == seen[0]);  // every rank the same steps and bytes
      }
    }
  CHECK(evicting > 0);
  CHECK(due_steps > evicting);  // due steps that did not evict sent the agreement only
}

TEST_CASE("drivers: chunked across tensor-parallel ranks sends one agreement per layer and chunk, plus the selection when it evicts") {
  // pinned (docs/distributed.md): 88 bytes in 1 collective per layer and chunk, plus 41,064 bytes
  // in 6 when the layer's target is below its rows over all ranks (flattened, adakv)
  constexpr std::uint64_t agreement = 88, selection = 41064, agreement_calls = 1, selection_calls = 6;
  int evicting = 0, keeping = 0;
  for (allocator kind : {allocator::flattened, allocator::adakv})
    for (int ranks : {2, 3})
      for (std::uint64_t seed = 1; seed <= 2; ++seed) {
        auto g = kvtest::rng(seed * 29 + static_cast<std::uint64_t>(kind) * 7 + static_cast<std::uint64_t>(ranks));
        chunk_case c;
        const index_t L = kvtest::uniform_int(g, 1, 2), Hl = kvtest::uniform_int(g, 1, 2), H = ranks * Hl;
        c.N = 40;
        c.s = make_synth(seed, L, H, H, 4, c.N);
        c.r = small_window(recipe::snapkv(), 4);
        c.mode = seed % 2 ? chunk_queries::patched : chunk_queries::naive;
        c.target = chunk_target::budget;
        c.kind = kind;
        const index_t prot = c.r.n_sink + c.r.n_recent;
        c.budgets = rank_budgets(g, L, H, ranks, prot + 6, prot + 14, kind != allocator::adakv);
        c.bounds = random_bounds(g, c.N, c.mode == chunk_queries::patched ? c.N - c.r.window : c.N - 1,
                                 kvtest::uniform_int(g, 2, 4));
        const auto ref = run_chunked(seq, c, nullptr);
        // the collectives one rank must have run: per chunk and layer an agreement, and a selection
        // when the one process's layer holds fewer rows after the chunk than before its decision
        std::uint64_t want_bytes = 0, want_calls = 0;
        for (std::size_t ci = 0; ci + 1 < c.bounds.size(); ++ci)
          for (index_t l = 0; l < L; ++l) {
            std::size_t before = static_cast<std::size_t>(H * (c.bounds[ci + 1] - c.bounds[ci])), after = 0;
            for (index_t h = 0; h < H; ++h) {
              if (ci > 0) before += ref[ci - 1][static_cast<std::size_t>(l)][static_cast<std::size_t>(h)].size();
              after += ref[ci][static_cast<std::size_t>(l)][static_cast<std::size_t>(h)].size();
            }
            const bool evicts = after < before;
            (evicts ? evicting : keeping) += 1;
            want_bytes += agreement + (evicts ? selection : 0);
            want_calls += agreement_calls + (evicts ? selection_calls : 0);
          }
        std::vector<std::uint64_t> bytes(static_cast<std::size_t>(ranks)), calls(bytes.size());
        kvtest::thread_world::run(ranks, [&](kvtest::thread_comm& comm) {
          chunk_case rc = c;
          rc.s = slice_heads(c.s, Hl * comm.rank(), Hl);
          rc.budgets = slice_budgets(c.budgets, L, H, Hl * comm.rank(), Hl);
          counting_comm<kvtest::thread_comm> counted(comm);
          rc.tp = comm_ref(counted);
          run_chunked(seq, rc, nullptr);
          bytes[static_cast<std::size_t>(comm.rank())] = counted.bytes();
          calls[static_cast<std::size_t>(comm.rank())] = counted.calls();
        });
        for (int rk = 0; rk < ranks; ++rk) {
          CAPTURE(static_cast<int>(kind));
          CAPTURE(ranks);
          CAPTURE(seed);
          CAPTURE(rk);
          CHECK(bytes[static_cast<std::size_t>(rk)] == want_bytes);
          CHECK(calls[static_cast<std::size_t>(rk)] == want_calls);
        }
      }
  CHECK(evicting > 0);
  CHECK(keeping > 0);
}

TEST_CASE("drivers: chunked lava's collectives per chunk across tensor-parallel ranks and pipeline stages, pinned") {
  // pinned (docs/distributed.md), per chunk. Tensor parallel (Hl heads per rank, L layers): per
  // layer the sharded entropy (72 + 64 Hl bytes in 3 collectives); decide(): the agreement (72 in
  // 1), the layers' protected and evictable rows (2 allreduces of 8 L), per layer the sharded
  // selection (41,064 in 6). Pipeline: decide()'s agreement (72 in 1) and three layer gathers
  // (entropies, protected, evictable rows; 72 + 16 L in 2 each: an agreement and an allgather):
  // 288 + 48 L in 7, as post_fill_driver's decide() once per prefill.
  int checked = 0;
  for (int ranks : {2, 3})
    for (bool pipeline : {false, true}) {
      auto g = kvtest::rng(71 + static_cast<std::uint64_t>(ranks) * 3 + (pipeline ? 1u : 0u));
      chunk_case c;
      const index_t L = pipeline ? ranks + 1 : 2, Hl = 2, H = pipeline ? Hl : ranks * Hl;
      c.N = 40;
      c.s = make_synth(static_cast<std::uint64_t>(ranks) + 9, L, H, H, 4, c.N);
      c.r = small_window(recipe::snapkv(), 4);
      c.mode = chunk_queries::patched;
      c.target = chunk_target::budget;
      c.kind = allocator::lava;
      c.total = L * H * 10;
      c.bounds = random_bounds(g, c.N, c.N - c.r.window, 3);
      const auto chunks = static_cast<std::uint64_t>(c.bounds.size() - 1);
      std::vector<std::uint64_t> bytes(static_cast<std::size_t>(ranks)), calls(bytes.size());
      kvtest::thread_world::run(ranks, [&](kvtest::thread_comm& comm) {
        chunk_case rc = c;
        counting_comm<kvtest::thread_comm> counted(comm);
        if (pipeline) {
          const shard_range mine = value_of(layer_shard(L, ranks, comm.rank()));
          rc.s = slice_layers(c.s, mine.first, mine.count);
          rc.pp = comm_ref(counted);
          rc.first_layer = mine.first;
          rc.model_layers = L;
        } else {
          rc.s = slice_heads(c.s, Hl * comm.rank(), Hl);
          rc.tp = comm_ref(counted);
        }
        run_chunked(seq, rc, nullptr);
        bytes[static_cast<std::size_t>(comm.rank())] = counted.bytes();
        calls[static_cast<std::size_t>(comm.rank())] = counted.calls();
      });
      const auto Lu = static_cast<std::uint64_t>(L), Hu = static_cast<std::uint64_t>(Hl);
      const std::uint64_t per_chunk_bytes =
          pipeline ? 72 + 3 * (72 + 16 * Lu) : Lu * (72 + 64 * Hu) + 72 + 2 * 8 * Lu + Lu * 41064;
      const std::uint64_t per_chunk_calls = pipeline ? 1 + 3 * 2 : Lu * 3 + 1 + 2 + Lu * 6;
      for (int rk = 0; rk < ranks; ++rk) {
        CAPTURE(ranks);
        CAPTURE(pipeline);
        CAPTURE(rk);
        CAPTURE(chunks);
        CHECK(bytes[static_cast<std::size_t>(rk)] == chunks * per_chunk_bytes);
        CHECK(calls[static_cast<std::size_t>(rk)] == chunks * per_chunk_calls);
        ++checked;
      }
    }
  CHECK(checked == 2 * 2 + 2 * 3);
}
