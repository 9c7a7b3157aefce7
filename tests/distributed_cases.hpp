// The sharded-eviction checks shared by tests/test_distributed.cpp (ranks as threads) and
// tests/mpi/test_mpi_distributed.cpp (ranks as MPI processes). Every rank builds the same random
// layer from the seed, runs the single-process call over all heads, runs the sharded call over its
// own heads, and compares its part. Each check returns "" when this rank's part is identical, else
// what differs.
#pragma once

#include <kvevict/budget/layer_cascade.hpp>
#include <kvevict/distributed.hpp>
#include <kvevict/drivers/cascade_driver.hpp>
#include <kvevict/drivers/compact_layer.hpp>
#include <kvevict/drivers/decode.hpp>
#include <kvevict/drivers/post_fill.hpp>
#include <kvevict/protect.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace kvtest::dist {

using kvevict::index_t;
using kvevict::pos_t;

/// A layer of P x R rows of T scores (row-major), the rows of rank r being [r R, (r + 1) R).
struct layer {
  index_t ranks = 1, rows_per_rank = 1, T = 0;
  std::vector<float> scores;
  std::vector<std::int32_t> lengths;  // empty: every row is T long
  index_t rows() const { return ranks * rows_per_rank; }
  const std::int32_t* lengths_of(index_t first) const { return lengths.empty() ? nullptr : lengths.data() + first; }
  kvevict::matrix_view<const float> view(index_t first, index_t n) const {
    return kvevict::make_matrix_view<const float>(scores.data() + first * T, n, T).value();
  }
};

inline std::int64_t pick(std::mt19937_64& g, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(g);
}

/// kind 0: uniform; 1: ties ({0, 1, 2}); 2: all equal; 3: ties with NaN, +-inf and -0 sprinkled;
/// 4: non-negative (LAVa).
inline layer make_layer(std::mt19937_64& g, index_t ranks, int kind, bool ragged) {
  layer L;
  L.ranks = ranks;
  L.rows_per_rank = pick(g, 1, 4);
  L.T = pick(g, 0, 1) == 0 ? pick(g, 1, 40) : pick(g, 1, 700);
  L.scores.resize(static_cast<std::size_t>(L.rows() * L.T));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), -0.0f, 0.0f};
  for (auto& x : L.scores) {
    switch (kind) {
      case 0: x = u(g); break;
      case 1: x = static_cast<float>(pick(g, 0, 2)); break;
      case 2: x = 0.5f; break;
      case 3: x = pick(g, 0, 9) == 0 ? specials[pick(g, 0, 4)] : static_cast<float>(pick(g, 0, 2)); break;
      default: x = pick(g, 0, 3) == 0 ? 0.0f : std::fabs(u(g)); break;
    }
  }
  if (ragged) {
    L.lengths.resize(static_cast<std::size_t>(L.rows()));
    for (auto& n : L.lengths) n = static_cast<std::int32_t>(pick(g, 0, L.T));
  }
  return L;
}

template <class T>
std::string differs(const char* what, const std::vector<T>& want, const T* got, std::size_t n) {
  if (want.size() == n && (n == 0 || std::memcmp(want.data(), got, n * sizeof(T)) == 0)) return "";
  return std::string(what) + " differs from the single-process call";
}

/// Workspace of a two-phase call, queried then sized exactly.
template <class Call>
kvevict::status with_workspace(Call call) {
  kvevict::workspace q;
  if (auto st = call(q); !st.ok()) return st;
  std::vector<unsigned char> mem(q.bytes);
  kvevict::workspace ws{mem.data(), mem.size()};
  return call(ws);
}

/// The sharded calls' backend: seq for even seeds, par with 2 threads for odd ones (the
/// single-process reference is always seq: the backends must agree). The harnesses lower
/// detail::par_min_elements so that par really runs threads on these small layers.
template <class F>
kvevict::status on_backend(std::uint64_t seed, F call) {
  return seed % 2 == 1 ? with_workspace([&](kvevict::workspace& ws) { return call(kvevict::par_t{2}, ws); })
                       : with_workspace([&](kvevict::workspace& ws) { return call(kvevict::seq, ws); });
}

/// This rank's rows of a single-process result: offsets rebased to 0 and its positions.
struct rows_part {
  std::vector<std::int32_t> cu;
  std::vector<pos_t> pos;
};
inline rows_part part_of(const std::vector<std::int32_t>& cu, const std::vector<pos_t>& pos, index_t first, index_t n,
                         bool positions) {
  rows_part p;
  for (index_t r = 0; r <= n; ++r) p.cu.push_back(cu[static_cast<std::size_t>(first + r)] - cu[static_cast<std::size_t>(first)]);
  if (positions)
    p.pos.assign(pos.begin() + cu[static_cast<std::size_t>(first)], pos.begin() + cu[static_cast<std::size_t>(first + n)]);
  return p;
}

/// Sharded select_topk_flat against select_topk_flat over every row.
template <class Comm>
std::string check_flat(Comm& comm, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const int kind = static_cast<int>(pick(g, 0, 3));
  const layer L = make_layer(g, comm.size(), kind, pick(g, 0, 1) == 1);
  const index_t R = L.rows(), mine = L.rows_per_rank * comm.rank(), n = L.rows_per_rank;
  std::vector<std::int32_t> floors;
  index_t sum_len = 0, sum_floor = 0;
  const bool use_floors = pick(g, 0, 1) == 1;
  for (index_t r = 0; r < R; ++r) {
    const index_t len = L.lengths.empty() ? L.T : L.lengths[static_cast<std::size_t>(r)];
    sum_len += len;
    if (use_floors) floors.push_back(static_cast<std::int32_t>(pick(g, 0, len / 2)));
    if (use_floors) sum_floor += floors.back();
  }
  const index_t total = pick(g, 0, 4) == 0 ? (pick(g, 0, 1) ? sum_floor : sum_len) : pick(g, sum_floor, sum_len);
  const bool positions = pick(g, 0, 4) != 0;
  const std::int32_t* fl_all = use_floors ? floors.data() : nullptr;
  std::vector<std::int32_t> cu(static_cast<std::size_t>(R + 1));
  std::vector<pos_t> pos(static_cast<std::size_t>(total));
  auto st = with_workspace([&](kvevict::workspace& ws) {
    return kvevict::select_topk_flat(kvevict::seq, ws, L.view(0, R), L.lengths_of(0), total, fl_all, cu.data(),
                                     positions ? pos.data() : nullptr);
  });
  if (!st.ok()) return std::string("single-process call failed: ") + st.message();
  const rows_part want = part_of(cu, pos, mine, n, positions);
  std::vector<std::int32_t> got_cu(static_cast<std::size_t>(n + 1));
  std::vector<pos_t> got_pos(static_cast<std::size_t>(total) + 1);
  st = on_backend(seed, [&](auto be, kvevict::workspace& ws) {
    return kvevict::select_topk_flat(be, ws, comm, L.view(mine, n), L.lengths_of(mine), total,
                                     use_floors ? floors.data() + mine : nullptr, got_cu.data(),
                                     positions ? got_pos.data() : nullptr);
  });
  if (!st.ok()) return std::string("sharded call failed: ") + st.message();
  std::string d = differs("kept_cu", want.cu, got_cu.data(), got_cu.size());
  if (d.empty() && positions) d = differs("kept_pos", want.pos, got_pos.data(), static_cast<std::size_t>(got_cu[n]));
  return d;
}

/// Scores protected with prot (+inf at the protected positions of each row's length).
inline void protect_rows(layer& L, const kvevict::protection& prot) {
  for (index_t r = 0; r < L.rows(); ++r) {
    const index_t len = L.lengths.empty() ? L.T : L.lengths[static_cast<std::size_t>(r)];
    for (index_t t = 0; t < len; ++t) {
      float& x = L.scores[static_cast<std::size_t>(r * L.T + t)];
      const bool prot_t = t < prot.n_sink || t >= len - prot.n_recent;
      if (prot_t) x = std::numeric_limits<float>::infinity();
      else if (std::isinf(x) || std::isnan(x)) x = 0.25f;
    }
  }
}

/// Sharded adakv_budgets against adakv_budgets over every head.
template <class Comm>
std::string check_adakv(Comm& comm, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  layer L = make_layer(g, comm.size(), static_cast<int>(pick(g, 0, 3)), false);
  kvevict::adakv_options opt;
  opt.alpha = pick(g, 0, 3) == 0 ? 0.0 : static_cast<double>(pick(g, 0, 10)) / 10.0;
  opt.floor = pick(g, 0, 1) ? kvevict::adakv_floor::evictable : kvevict::adakv_floor::budget;
  opt.prot = {pick(g, 0, 2), pick(g, 0, 3)};
  protect_rows(L, opt.prot);
  const index_t W = kvevict::protected_count(L.T, opt.prot.n_sink, opt.prot.n_recent);
  const index_t B = pick(g, W, L.T), H = L.rows(), mine = L.rows_per_rank * comm.rank(), n = L.rows_per_rank;
  std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1));
  std::vector<pos_t> pos(static_cast<std::size_t>(B * H));
  auto st = with_workspace([&](kvevict::workspace& ws) {
    return kvevict::adakv_budgets(kvevict::seq, ws, L.view(0, H), nullptr, B, opt, cu.data(), pos.data());
  });
  if (!st.ok()) return std::string("single-process call failed: ") + st.message();
  const rows_part want = part_of(cu, pos, mine, n, true);
  std::vector<std::int32_t> got_cu(static_cast<std::size_t>(n + 1));
  std::vector<pos_t> got_pos(static_cast<std::size_t>(B * H) + 1);
  st = on_backend(seed, [&](auto be, kvevict::workspace& ws) {
    return kvevict::adakv_budgets(be, ws, comm, L.view(mine, n), nullptr, B, opt, got_cu.data(),
                                  got_pos.data());
  });
  if (!st.ok()) return std::string("sharded call failed: ") + st.message();
  std::string d = differs("adakv kept_cu", want.cu, got_cu.data(), got_cu.size());
  if (d.empty()) d = differs("adakv kept_pos", want.pos, got_pos.data(), static_cast<std::size_t>(got_cu[n]));
  return d;
}

/// Sharded lava_layer_entropy against lava_layer_entropy over every head, bit for bit.
template <class Comm>
std::string check_lava_entropy(Comm& comm, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const layer L = make_layer(g, comm.size(), 4, pick(g, 0, 1) == 1);
  kvevict::lava_entropy_options opt;
  opt.prot = {pick(g, 0, 2), pick(g, 0, 3)};
  opt.norm = pick(g, 0, 1) ? kvevict::entropy_norm::count : kvevict::entropy_norm::log_count;
  const index_t H = L.rows(), mine = L.rows_per_rank * comm.rank(), n = L.rows_per_rank;
  double want = -1.0, got = -2.0;
  auto st = kvevict::lava_layer_entropy(kvevict::seq, L.view(0, H), L.lengths_of(0), opt, &want);
  if (!st.ok()) return std::string("single-process call failed: ") + st.message();
  st = on_backend(seed, [&](auto be, kvevict::workspace& ws) {
    return kvevict::lava_layer_entropy(be, ws, comm, L.view(mine, n), L.lengths_of(mine), opt, &got);
  });
  if (!st.ok()) return std::string("sharded call failed: ") + st.message();
  return std::memcmp(&want, &got, sizeof(double)) == 0 ? "" : "lava entropy differs from the single-process call";
}

/// Sharded cake_layer_stats against cake_layer_stats over every head, bit for bit.
template <class Comm>
std::string check_cake_stats(Comm& comm, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const index_t per = pick(g, 1, 3), w = pick(g, 1, 6), C = pick(g, 1, 50), R = per * comm.size();
  std::vector<float> a(static_cast<std::size_t>(R * w * C));
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (auto& x : a) x = pick(g, 0, 4) == 0 ? 0.0f : u(g);
  const auto var = pick(g, 0, 1) ? kvevict::variance_estimator::biased : kvevict::variance_estimator::unbiased;
  const auto all = kvevict::make_kv_view<const float>(a.data(), R, w, C).value();
  const auto mine = kvevict::make_kv_view<const float>(a.data() + per * comm.rank() * w * C, per, w, C).value();
  kvevict::cake_stats want, got;
  auto st = kvevict::cake_layer_stats(kvevict::seq, all, &want, var);
  if (!st.ok()) return std::string("single-process call failed: ") + st.message();
  st = on_backend(seed, [&](auto be, kvevict::workspace& ws) {
    return kvevict::cake_layer_stats(be, ws, comm, mine, &got, var);
  });
  if (!st.ok()) return std::string("sharded call failed: ") + st.message();
  if (std::memcmp(&want.entropy, &got.entropy, sizeof(double)) != 0 ||
      std::memcmp(&want.variance, &got.variance, sizeof(double)) != 0)
    return "cake statistics differ from the single-process call";
  return "";
}

/// Head-sharded CAKE window preference: each rank's query and KV heads (GQA groups kept whole)
/// give the single-process preference over all heads, bit for bit.
template <class Comm>
std::string check_cake_window(Comm& comm, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const index_t kv_per = pick(g, 1, 2), group = pick(g, 1, 3), d = pick(g, 1, 8), w = pick(g, 1, 6);
  const index_t P = w + pick(g, 1, 40), Hkv = kv_per * comm.size(), Hq = Hkv * group;
  std::vector<float> q(static_cast<std::size_t>(Hq * w * d)), k(static_cast<std::size_t>(Hkv * P * d));
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  for (auto& x : q) x = u(g);
  for (auto& x : k) x = pick(g, 0, 6) == 0 ? 0.0f : u(g);  // some equal logits
  const index_t qr = kv_per * group;  // this rank's query heads
  const auto q_all = kvevict::make_kv_view<const float>(q.data(), Hq, w, d).value();
  const auto k_all = kvevict::make_kv_view<const float>(k.data(), Hkv, P, d).value();
  const auto q_mine = kvevict::make_kv_view<const float>(q.data() + qr * comm.rank() * w * d, qr, w, d).value();
  const auto k_mine = kvevict::make_kv_view<const float>(k.data() + kv_per * comm.rank() * P * d, kv_per, P, d).value();
  double want = -1.0, got = -2.0;
  auto st = with_workspace([&](kvevict::workspace& ws) {
    return kvevict::cake_window_preference(kvevict::seq, ws, q_all, k_all, kvevict::cake_options{}, &want);
  });
  if (!st.ok()) return std::string("single-process call failed: ") + st.message();
  st = with_workspace([&](kvevict::workspace& ws) {
    return kvevict::cake_window_preference(kvevict::seq, ws, comm, q_mine, k_mine, kvevict::cake_options{}, &got);
  });
  if (!st.ok()) return std::string("sharded call failed: ") + st.message();
  if (std::memcmp(&want, &got, sizeof(double)) != 0) return "cake window preference differs from the single-process call";
  return "";
}

/// post_fill_driver with an all-layer allocator (lava; cake when `cake`) on a sharded model, scores
/// with many ties (cake: the same preferences on every rank). `tp` (may be null: one head shard):
/// each rank's driver holds its heads of every layer; `pp` (may be null: one stage;
/// post_fill_config::pp): each stage holds layer_shard(L, S, stage) of the layers, lava's heads
/// ragged; both: a grid (the tp ranks of a stage, the pp ranks holding the same heads). Either
/// keeps exactly the single-process driver's rows of those heads / layers.
template <class TpComm, class PpComm>
std::string check_post_fill_grid(TpComm* tp, PpComm* pp, std::uint64_t seed, bool cake) {
  using namespace kvevict;
  std::mt19937_64 g(seed);
  const bool pipeline = pp != nullptr;
  const int T = tp != nullptr ? tp->size() : 1, S = pp != nullptr ? pp->size() : 1;
  const index_t L = pipeline ? pick(g, S, S + 4) : pick(g, 1, 4), per = pick(g, 1, 3);
  const index_t H = per * T, d = 2, P = pick(g, 6, 40);
  recipe r = recipe::snapkv();
  r.window = pick(g, 1, 4);
  r.n_sink = pick(g, 0, 2);
  r.n_recent = r.window;
  const index_t W = protected_count(P, r.n_sink, r.n_recent), B = pick(g, W, P);
  std::vector<float> scores(static_cast<std::size_t>(L * H * P));
  for (auto& x : scores) x = static_cast<float>(pick(g, 0, 9));  // many ties
  std::vector<double> prefs(static_cast<std::size_t>(L));
  for (auto& x : prefs) x = 0.25 * static_cast<double>(pick(g, 0, 8));
  std::vector<float> kv(static_cast<std::size_t>(H * P * d), 0.0f);
  std::vector<pos_t> positions(static_cast<std::size_t>(H * P));
  std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1)), lens(static_cast<std::size_t>(H));
  for (index_t h = 0; h <= H; ++h) cu[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * P);
  // every head holds the prompt; pipeline lava: a ragged head holds its last rows (the window in them)
  for (auto& n : lens) n = static_cast<std::int32_t>(P - (pipeline && !cake ? pick(g, 0, P - r.window) : 0));
  index_t rows = 0, prot = 0;  // one layer's rows and protected rows
  for (index_t h = 0; h < H; ++h) {
    const std::int32_t n = lens[static_cast<std::size_t>(h)];
    for (index_t j = 0; j < n; ++j) positions[static_cast<std::size_t>(h * P + j)] = static_cast<pos_t>(P - n + j);
    rows += n;
    prot += protected_count(n, r.n_sink, r.n_recent);
  }
  post_fill_config cfg;
  cfg.model = {L, H, H, d};
  cfg.tokens = P;
  cfg.rec = r;
  cfg.alloc.kind = cake ? allocator::cake : allocator::lava;
  cfg.alloc.total = cake || !pipeline ? L * H * B : pick(g, L * prot, L * rows);
  // a driver over layers [l0, l0 + nl) x heads [h0, h0 + nh); kept[(l - l0) nh + h - h0]
  const auto run = [&](const post_fill_config& c, index_t l0, index_t nl, index_t h0, index_t nh,
                       std::vector<std::vector<pos_t>>& kept) -> status {
    post_fill_driver drv;
    const auto bytes = post_fill_driver::state_bytes(c);
    if (!bytes) return bytes.error();
    std::vector<unsigned char> mem(*bytes);
    KVEVICT_TRY(drv.init(c, mem.data(), mem.size()));
    const auto wb = drv.workspace_bytes(seq);
    if (!wb) return wb.error();
    std::vector<unsigned char> wmem(*wb);
    workspace ws{wmem.data(), wmem.size()};
    const ragged_cache<float> keys{kv.data() + h0 * P * d, cu.data(), lens.data() + h0, nh, d, d};
    const auto layer = make_layer_kv(keys, keys, positions.data() + h0 * P);
    status st;
    for (index_t l = l0; st.ok() && l < l0 + nl; ++l) {
      const auto sv = make_matrix_view<const float>(scores.data() + (l * H + h0) * P, nh, P).value();
      st = drv.add_layer_scores(seq, ws, l - l0, layer, sv, prefs[static_cast<std::size_t>(l)]);
    }
    const status dec = drv.decide(seq, ws);  // every stage decides, also after a failure
    KVEVICT_TRY(st);
    KVEVICT_TRY(dec);
    kept.clear();
    for (index_t l = 0; l < nl; ++l) {
      const ragged_positions k = drv.kept(l);
      for (index_t h = 0; h < nh; ++h) kept.emplace_back(k.pos + k.cu[h], k.pos + k.cu[h + 1]);
    }
    return {};
  };
  std::vector<std::vector<pos_t>> want, got;
  auto st = run(cfg, 0, L, 0, H, want);
  if (!st.ok()) return std::string("single-process driver failed: ") + st.message();
  post_fill_config sc = cfg;
  shard_range layers{0, L}, heads{0, H};
  if (pipeline) {
    layers = layer_shard(L, S, pp->rank()).value();
    sc.model.layers = layers.count;
    sc.first_layer = layers.first;
    sc.model_layers = L;
    sc.pp = comm_ref(*pp);
  }
  if (tp != nullptr) {
    heads = {per * tp->rank(), per};
    sc.model.kv_heads = sc.model.query_heads = per;
    sc.tp = comm_ref(*tp);
  }
  st = run(sc, layers.first, layers.count, heads.first, heads.count, got);
  if (!st.ok()) return std::string("sharded driver failed: ") + st.message();
  for (index_t l = 0; l < layers.count; ++l)
    for (index_t h = 0; h < heads.count; ++h)
      if (got[static_cast<std::size_t>(l * heads.count + h)] !=
          want[static_cast<std::size_t>((layers.first + l) * H + heads.first + h)])
        return "kept rows differ from the single-process driver's";
  return "";
}

/// check_post_fill_grid on one communicator: tensor parallel (`pipeline` false) or pipeline stages.
template <class Comm>
std::string check_post_fill_all_layer(Comm& comm, std::uint64_t seed, bool cake, bool pipeline = false) {
  return pipeline ? check_post_fill_grid<Comm, Comm>(nullptr, &comm, seed, cake)
                  : check_post_fill_grid<Comm, Comm>(&comm, nullptr, seed, cake);
}

/// A driver initialised on its own state memory `mem`, with a workspace `ws` in `wmem` sized for
/// backend `be`.
template <class Driver, class Config, class Backend>
kvevict::status init_driver(Driver& drv, const Config& cfg, Backend be, std::vector<unsigned char>& mem,
                            std::vector<unsigned char>& wmem, kvevict::workspace& ws) {
  const auto bytes = Driver::state_bytes(cfg);
  if (!bytes) return bytes.error();
  mem.assign(*bytes, 0);
  KVEVICT_TRY(drv.init(cfg, mem.data(), mem.size()));
  const auto wb = drv.workspace_bytes(be);
  if (!wb) return wb.error();
  wmem.assign(*wb, 0);
  ws = kvevict::workspace{wmem.data(), wmem.size()};
  return {};
}

/// The decode driver with a tensor-parallel communicator (flattened or adakv, scores with many ties
/// given by step_scores): every step's kept rows of this rank's heads equal the single-process
/// driver's.
template <class Comm>
std::string check_decode_sharded(Comm& comm, std::uint64_t seed, bool adakv) {
  using namespace kvevict;
  std::mt19937_64 g(seed);
  const index_t per = pick(g, 1, 3), H = per * comm.size(), d = 2, P0 = pick(g, 4, 12), G = pick(g, 6, 20);
  const index_t C = P0 + G, interval = pick(g, 1, 3);
  recipe r = recipe::knorm();
  r.n_sink = pick(g, 0, 1);
  r.n_recent = pick(g, 0, 2);
  const index_t lo = std::max<index_t>(r.n_sink + r.n_recent, 1);
  std::vector<std::int32_t> block(static_cast<std::size_t>(per));  // every rank's budgets: the same block
  const auto B = static_cast<std::int32_t>(pick(g, lo, lo + 6));
  for (auto& b : block) b = adakv ? B : static_cast<std::int32_t>(pick(g, lo, lo + 6));
  std::vector<std::int32_t> budgets(static_cast<std::size_t>(H));
  for (index_t h = 0; h < H; ++h) budgets[static_cast<std::size_t>(h)] = block[static_cast<std::size_t>(h % per)];
  std::vector<float> score_of(static_cast<std::size_t>(H * C));  // a row's score: by head and position
  for (auto& x : score_of) x = static_cast<float>(pick(g, 0, 5));
  // a driver over heads [first, first + n): per step, its heads' held positions
  const auto run = [&](index_t first, index_t n, comm_ref tp, std::vector<std::vector<pos_t>>& out) -> status {
    decode_config cfg;
    cfg.model = {1, n, n, d};
    cfg.capacity = C;
    cfg.interval = interval;
    cfg.rec = r;
    cfg.alloc.kind = adakv ? allocator::adakv : allocator::flattened;
    cfg.alloc.budgets = make_matrix_view<const std::int32_t>(budgets.data() + first, 1, n).value();
    cfg.tp = tp;
    decode_driver drv;
    std::vector<unsigned char> mem, wmem;
    workspace ws;
    KVEVICT_TRY(init_driver(drv, cfg, seq, mem, wmem, ws));
    std::vector<float> kv(static_cast<std::size_t>(n * C * d), 0.0f), vals(kv.size(), 0.0f);
    std::vector<float> sc(static_cast<std::size_t>(n * C), 0.0f);
    std::vector<pos_t> pos(static_cast<std::size_t>(n * C));
    std::vector<std::int32_t> cu(static_cast<std::size_t>(n + 1)), lens(static_cast<std::size_t>(n), 0);
    for (index_t h = 0; h <= n; ++h) cu[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * C);
    const auto append = [&](pos_t p) {
      for (index_t h = 0; h < n; ++h) pos[static_cast<std::size_t>(h * C + lens[static_cast<std::size_t>(h)]++)] = p;
    };
    for (index_t p = 0; p < P0; ++p) append(static_cast<pos_t>(p));
    const ragged_cache<float> keys{kv.data(), cu.data(), lens.data(), n, d, d};
    const ragged_cache<float> values{vals.data(), cu.data(), lens.data(), n, d, d};
    const auto layer = make_layer_kv(keys, values, pos.data());
    KVEVICT_TRY(drv.begin(0, layer, P0));
    out.clear();
    for (index_t t = P0; t < C; ++t) {
      append(static_cast<pos_t>(t));
      for (index_t h = 0; h < n; ++h)
        for (index_t j = 0; j < lens[static_cast<std::size_t>(h)]; ++j)
          sc[static_cast<std::size_t>(h * C + j)] =
              score_of[static_cast<std::size_t>((first + h) * C + pos[static_cast<std::size_t>(h * C + j)])];
      KVEVICT_TRY(drv.step_scores(seq, ws, 0, layer, make_matrix_view<const float>(sc.data(), n, C).value()));
      if (drv.evicted(0)) KVEVICT_TRY(compact_layer(seq, keys, values, ragged_cache<pos_t>{pos.data(), cu.data(), lens.data(), n, 1, 1}, drv.kept(0)));
      for (index_t h = 0; h < n; ++h)
        out.emplace_back(pos.begin() + h * C, pos.begin() + h * C + lens[static_cast<std::size_t>(h)]);
    }
    return {};
  };
  std::vector<std::vector<pos_t>> want, got;
  auto st = run(0, H, comm_ref{}, want);
  if (!st.ok()) return std::string("single-process driver failed: ") + st.message();
  st = run(per * comm.rank(), per, comm_ref(comm), got);
  if (!st.ok()) return std::string("sharded driver failed: ") + st.message();
  for (index_t t = 0; t < G; ++t)
    for (index_t h = 0; h < per; ++h)
      if (got[static_cast<std::size_t>(t * per + h)] != want[static_cast<std::size_t>(t * H + per * comm.rank() + h)])
        return "held rows differ from the single-process driver's at step " + std::to_string(t);
  return "";
}

/// Layer-sharded LAVa and CAKE budgets: each stage computes its layers' weights, gathers all of
/// them and allocates; the budgets equal the single-process allocation over all layers.
template <class Comm>
std::string check_layer_budgets(Comm& comm, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const index_t L = pick(g, comm.size(), 3 * comm.size() + 2), H = pick(g, 1, 4), N = pick(g, 8, 200);
  const kvevict::protection prot{pick(g, 0, 2), pick(g, 0, 4)};
  const index_t W = kvevict::protected_count(N, prot.n_sink, prot.n_recent);
  std::vector<double> weights(static_cast<std::size_t>(L));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& x : weights) x = pick(g, 0, 5) == 0 ? 0.0 : u(g);
  const kvevict::shard_range mine = kvevict::layer_shard(L, comm.size(), comm.rank()).value();
  std::vector<double> gathered(static_cast<std::size_t>(L), -1.0);
  auto st = with_workspace([&](kvevict::workspace& ws) {
    return kvevict::gather_layer_values(ws, comm, mine, weights.data() + mine.first, L, gathered.data());
  });
  if (!st.ok()) return std::string("gather failed: ") + st.message();
  if (std::memcmp(weights.data(), gathered.data(), weights.size() * sizeof(double)) != 0)
    return "gathered layer values differ";
  const index_t B = pick(g, W, N), total = pick(g, L * H * W, L * H * N);
  std::vector<index_t> want(static_cast<std::size_t>(L)), got(static_cast<std::size_t>(L));
  st = kvevict::lava_layer_budgets(weights.data(), L, H, N, prot, total, want.data());
  if (st.ok()) st = kvevict::lava_layer_budgets(gathered.data(), L, H, N, prot, total, got.data());
  if (!st.ok()) return std::string("lava_layer_budgets failed: ") + st.message();
  if (want != got) return "lava layer budgets differ";
  std::vector<std::int32_t> cw(static_cast<std::size_t>(L * H)), cg(cw.size());
  st = kvevict::cake_budgets(weights.data(), B, N, prot, kvevict::make_matrix_view(cw.data(), L, H).value());
  if (st.ok()) st = kvevict::cake_budgets(gathered.data(), B, N, prot, kvevict::make_matrix_view(cg.data(), L, H).value());
  if (!st.ok()) return std::string("cake_budgets failed: ") + st.message();
  return cw == cg ? "" : "cake budgets differ";
}

/// Pipeline-parallel cascade: stage s holds layer_shard(L, P, s)'s layers. Before its prefill it
/// gathers the earlier layers' weights (one gather per stage boundary, the later stages
/// contributing nothing), adds them as remote layers, adds its own layers, then gathers every weight
/// and adds the later layers as remote: its layers must hold what the single-process cascade holds.
template <class Comm>
std::string check_pipeline_cascade(Comm& comm, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const int P = comm.size();
  kvevict::cascade_config cfg;
  cfg.layers = pick(g, P, 2 * P + 3);
  cfg.heads = pick(g, 1, 3);
  cfg.prompt_length = pick(g, 4, 60);
  cfg.prot = {pick(g, 0, 1), pick(g, 0, 2)};
  cfg.split = pick(g, 0, 1) ? kvevict::cascade_split::per_head : kvevict::cascade_split::flattened;
  const index_t L = cfg.layers, H = cfg.heads, N = cfg.prompt_length;
  const index_t W = kvevict::protected_count(N, cfg.prot.n_sink, cfg.prot.n_recent);
  cfg.total = pick(g, L * W, L * N) * H;  // a multiple of H (per_head)
  std::vector<layer> layers;
  std::vector<double> weights;
  for (index_t l = 0; l < L; ++l) {
    layer x;
    x.ranks = 1;
    x.rows_per_rank = H;
    x.T = N;
    x.scores.resize(static_cast<std::size_t>(H * N));
    for (auto& v : x.scores) v = static_cast<float>(pick(g, 0, 3 + static_cast<std::int64_t>(l % 3)));
    protect_rows(x, cfg.prot);
    layers.push_back(x);
    weights.push_back(pick(g, 0, 4) == 0 ? 0.0 : static_cast<double>(pick(g, 1, 100)) / 7.0);
  }
  const auto run = [&](kvevict::layer_cascade& c, std::vector<unsigned char>& mem, index_t first, index_t count,
                       const std::vector<double>& w_before, const std::vector<double>& w_after) -> kvevict::status {
    mem.assign(kvevict::layer_cascade::state_bytes(cfg).value(), 0);
    KVEVICT_TRY(c.init(cfg, mem.data(), mem.size()));
    std::vector<unsigned char> wsm(c.workspace_bytes(kvevict::seq).value());
    kvevict::workspace ws{wsm.data(), wsm.size()};
    for (index_t l = 0; l < first; ++l) KVEVICT_TRY(c.add_remote_layer(kvevict::seq, ws, l, w_before[static_cast<std::size_t>(l)]));
    for (index_t l = first; l < first + count; ++l)
      KVEVICT_TRY(c.add_layer(kvevict::seq, ws, l, layers[static_cast<std::size_t>(l)].view(0, H), weights[static_cast<std::size_t>(l)]));
    for (index_t l = first + count; l < L; ++l)
      KVEVICT_TRY(c.add_remote_layer(kvevict::seq, ws, l, w_after[static_cast<std::size_t>(l)]));
    return {};
  };
  kvevict::layer_cascade one, mine;
  std::vector<unsigned char> one_mem, mine_mem;
  auto st = run(one, one_mem, 0, L, weights, weights);
  if (!st.ok()) return std::string("single-process cascade failed: ") + st.message();
  const kvevict::shard_range range = kvevict::layer_shard(L, P, comm.rank()).value();
  // the weights of the layers before each stage, gathered at each stage boundary
  std::vector<double> before(static_cast<std::size_t>(L), -1.0), after(static_cast<std::size_t>(L), -1.0);
  for (int s = 0; s < P; ++s) {
    const index_t a = kvevict::layer_shard(L, P, s).value().first;
    if (a == 0) continue;
    const index_t b = std::min(range.first + range.count, a), e = range.first < a ? range.first : a;
    const kvevict::shard_range part{e, b - e};
    std::vector<double> out(static_cast<std::size_t>(a));
    st = with_workspace([&](kvevict::workspace& ws) {
      return kvevict::gather_layer_values(ws, comm, part, weights.data() + part.first, a, out.data());
    });
    if (!st.ok()) return std::string("prefix gather failed: ") + st.message();
    if (s == comm.rank()) std::copy(out.begin(), out.end(), before.begin());
  }
  st = with_workspace([&](kvevict::workspace& ws) {
    return kvevict::gather_layer_values(ws, comm, range, weights.data() + range.first, L, after.data());
  });
  if (!st.ok()) return std::string("gather failed: ") + st.message();
  st = run(mine, mine_mem, range.first, range.count, before, after);
  if (!st.ok()) return std::string("stage cascade failed: ") + st.message();
  for (index_t l = 0; l < L; ++l) {
    const kvevict::ragged_positions a = one.positions(l), b = mine.positions(l);
    const bool own = l >= range.first && l < range.first + range.count;
    if (!own) {
      if (b.cu[H] != 0) return "a remote layer holds tokens";
      continue;
    }
    for (index_t h = 0; h <= H; ++h)
      if (a.cu[h] != b.cu[h]) return "layer " + std::to_string(l) + ": per-head counts differ";
    if (a.cu[H] > 0 && std::memcmp(a.pos, b.pos, static_cast<std::size_t>(a.cu[H]) * sizeof(pos_t)) != 0)
      return "layer " + std::to_string(l) + ": kept positions differ";
  }
  return "";
}

/// The layer-wise cascade under tensor parallelism: cascade_driver over this rank's `per` of the
/// H = per P heads of every layer (tp = comm), the layers given as scores with many ties; LAVa
/// (flattened, the driver's entropy) or CAKE (per_head, the caller's weight). After every step,
/// every layer's held positions and kept lists (and changed flags) of this rank's heads must equal
/// the single-process driver's over all H heads. `fault` >= 0: rank `fault` passes a bad call at
/// layer `fault_layer` (fault 0: NaN scores; 1: a layer out of order; 2: a different CAKE weight /
/// a different total), and every rank must return the same error there.
struct tp_cascade_case {
  index_t L = 0, per = 0, H = 0, N = 0, d = 2, total = 0;
  kvevict::recipe rec;
  bool cake = false;
  std::vector<float> scores;   // [L][H][N]
  std::vector<double> weight;  // CAKE: [L]
};

inline tp_cascade_case make_tp_cascade(std::mt19937_64& g, int P) {
  tp_cascade_case c;
  c.cake = pick(g, 0, 1) == 1;
  c.L = pick(g, 1, 5);
  c.per = pick(g, 1, 3);
  c.H = c.per * P;
  c.N = pick(g, 4, 40);
  c.rec = kvevict::recipe::knorm();
  c.rec.n_sink = pick(g, 0, 1);
  c.rec.n_recent = pick(g, 0, 2);
  const index_t W = kvevict::protected_count(c.N, c.rec.n_sink, c.rec.n_recent);
  c.total = c.cake ? pick(g, c.L * W, c.L * c.N) * c.H : pick(g, c.L * c.H * W, c.L * c.H * c.N);
  c.scores.resize(static_cast<std::size_t>(c.L * c.H * c.N));
  const int top = static_cast<int>(pick(g, 1, 4));  // few distinct values: ties across heads and ranks
  for (auto& x : c.scores) x = static_cast<float>(pick(g, 0, top));
  for (index_t l = 0; l < c.L; ++l) c.weight.push_back(pick(g, 0, 4) == 0 ? 0.0 : static_cast<double>(pick(g, 1, 50)) / 7.0);
  return c;
}

/// One driver over heads [first, first + n) of the case, layer by layer; after each step `seen`
/// gets, for every layer added, changed and per head its positions and kept list. `fault`: as
/// check_tp_cascade's, applied by this driver (the caller decides which rank).
inline kvevict::status run_tp_cascade(const tp_cascade_case& c, index_t first, index_t n, kvevict::comm_ref tp,
                                      bool par, int fault, index_t fault_layer, std::vector<std::vector<pos_t>>& seen) {
  using namespace kvevict;
  cascade_driver_config cfg;
  cfg.model = {c.L, n, n, c.d};
  cfg.tokens = c.N;
  cfg.rec = c.rec;
  cfg.total = c.total;
  if (fault == 2 && !c.cake) cfg.total += c.total < c.L * c.H * c.N ? 1 : -1;  // still a valid total here
  cfg.split = c.cake ? cascade_split::per_head : cascade_split::flattened;
  cfg.weight = c.cake ? weight_source::caller : weight_source::lava_entropy;
  cfg.tp = tp;
  cascade_driver drv;
  std::vector<unsigned char> mem, wmem;
  workspace ws;
  KVEVICT_TRY(par ? init_driver(drv, cfg, par_t{2}, mem, wmem, ws) : init_driver(drv, cfg, seq, mem, wmem, ws));
  const index_t N = c.N, d = c.d;
  std::vector<float> kv(static_cast<std::size_t>(n * N * d), 0.0f);
  std::vector<pos_t> pos(static_cast<std::size_t>(n * N));
  std::vector<std::int32_t> cu(static_cast<std::size_t>(n + 1)), lens(static_cast<std::size_t>(n), static_cast<std::int32_t>(N));
  for (index_t h = 0; h <= n; ++h) cu[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * N);
  for (index_t h = 0; h < n; ++h)
    for (index_t p = 0; p < N; ++p) pos[static_cast<std::size_t>(h * N + p)] = static_cast<pos_t>(p);
  const ragged_cache<float> keys{kv.data(), cu.data(), lens.data(), n, d, d};
  const auto layer_kv = make_layer_kv(keys, keys, pos.data());
  std::vector<float> sc(static_cast<std::size_t>(n * N));
  seen.clear();
  for (index_t l = 0; l < c.L; ++l) {
    std::copy(c.scores.begin() + (l * c.H + first) * N, c.scores.begin() + (l * c.H + first + n) * N, sc.begin());
    double w = c.weight[static_cast<std::size_t>(l)];
    index_t at = l;
    if (l == fault_layer) {
      if (fault == 0) sc[static_cast<std::size_t>(n * N - 1)] = std::numeric_limits<float>::quiet_NaN();
      if (fault == 1) at = l + 1;
      if (fault == 2 && c.cake) w += 1.0;
    }
    const auto view = make_matrix_view<const float>(sc.data(), n, N).value();
    KVEVICT_TRY(par ? drv.add_layer_scores(par_t{2}, ws, at, layer_kv, view, w)
                    : drv.add_layer_scores(seq, ws, at, layer_kv, view, w));
    for (index_t j = 0; j <= l; ++j) {
      seen.push_back({static_cast<pos_t>(drv.changed(j) ? 1 : 0)});
      const ragged_positions held = drv.positions(j), kept = drv.kept(j);
      for (index_t h = 0; h < n; ++h) {
        seen.emplace_back(held.pos + held.cu[h], held.pos + held.cu[h + 1]);
        seen.emplace_back(kept.pos + kept.cu[h], kept.pos + kept.cu[h + 1]);
      }
    }
  }
  return {};
}

template <class Comm>
std::string check_tp_cascade(Comm& comm, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  const int P = comm.size();
  const tp_cascade_case c = make_tp_cascade(g, P);
  std::vector<std::vector<pos_t>> want, got;
  auto st = run_tp_cascade(c, 0, c.H, kvevict::comm_ref{}, false, -1, -1, want);
  if (!st.ok()) return std::string("single-process cascade failed: ") + st.message();
  st = run_tp_cascade(c, c.per * comm.rank(), c.per, kvevict::comm_ref(comm), seed % 2 == 1, -1, -1, got);
  if (!st.ok()) return std::string("sharded cascade failed: ") + st.message();
  // the single-process entries of this rank's heads: per step, per layer j <= l: changed, then per
  // head held, kept
  std::size_t a = 0, b = 0;
  for (index_t l = 0; l < c.L; ++l)
    for (index_t j = 0; j <= l; ++j) {
      const std::string where = (c.cake ? "cake" : "lava") + std::string(" step ") + std::to_string(l) + ", layer " +
                                std::to_string(j);
      if (want[a++] != got[b++]) return where + ": changed differs";
      for (index_t h = 0; h < c.H; ++h) {
        const bool mine = h >= c.per * comm.rank() && h < c.per * (comm.rank() + 1);
        for (int k = 0; k < 2; ++k, ++a)
          if (mine && want[a] != got[b++])
            return where + ", head " + std::to_string(h) + (k == 0 ? ": held positions differ" : ": kept lists differ");
      }
    }
  return "";
}

/// check_tp_cascade's faults: rank `odd` passes a bad call at a random layer; every rank must fail
/// there with the same error, naming the rank (or the disagreement).
template <class Comm>
std::string check_tp_cascade_error(Comm& comm, std::uint64_t seed, int odd, int fault) {
  std::mt19937_64 g(seed);
  const int P = comm.size();
  tp_cascade_case c = make_tp_cascade(g, P);
  if (fault == 2) c.cake = pick(g, 0, 1) == 1;
  if (c.cake && c.total % c.H != 0) c.total -= c.total % c.H;
  const index_t at = pick(g, 0, c.L - 1);
  std::vector<std::vector<pos_t>> got;
  const bool me = comm.rank() == odd;
  const auto st = run_tp_cascade(c, c.per * comm.rank(), c.per, kvevict::comm_ref(comm), false, me ? fault : -1,
                                 me ? at : -1, got);
  if (st.ok()) return "the sharded cascade accepted a bad call on rank " + std::to_string(odd);
  const std::string msg = st.message();
  const std::string want = fault == 2 ? "disagree" : "rank " + std::to_string(odd) + " of " + std::to_string(P);
  if (msg.find(want) == std::string::npos) return "expected \"" + want + "\", got: " + msg;
  // every step before the fault ran: the error came at the faulty layer, not earlier
  if (fault != 2 || c.cake) {
    std::size_t steps = 0;
    for (index_t l = 0; l < at; ++l) steps += static_cast<std::size_t>((l + 1) * (1 + 2 * c.per));
    if (got.size() != steps) return "the error came at the wrong step: " + msg;
  }
  return "";
}

/// H = 2P + 1 KV heads: head_shard refuses the split on every rank, and ranks that split unevenly
/// anyway (the last one holding 3 heads) get the same disagreement error on every rank.
template <class Comm>
std::string check_uneven_heads(Comm& comm) {
  const int P = comm.size();
  const index_t H = 2 * P + 1, T = 8;
  const auto shard = kvevict::head_shard(H, P, comm.rank());
  const std::string want = std::to_string(H) + " KV heads are not divisible by " + std::to_string(P) + " ranks";
  if (P > 1 && (shard.ok() || std::string(shard.error().message()).find(want) == std::string::npos))
    return "head_shard accepted or misreported an uneven split";
  const index_t n = comm.rank() == P - 1 ? 3 : 2;
  std::vector<float> s(static_cast<std::size_t>(n * T), 1.0f);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(n + 1));
  const auto st = with_workspace([&](kvevict::workspace& ws) {
    return kvevict::select_topk_flat(kvevict::seq, ws, comm, kvevict::make_matrix_view<const float>(s.data(), n, T).value(),
                                     nullptr, 4, nullptr, cu.data(), nullptr);
  });
  if (P == 1) return st.ok() ? "" : std::string("one rank failed: ") + st.message();
  const std::string msg = st.message();
  if (st.ok() || st.code() != kvevict::errc::invalid_argument || msg.find("disagree") == std::string::npos ||
      msg.find("3 rows x 8 columns per rank") == std::string::npos)
    return "unexpected result for an uneven split: " + msg;
  return "";
}

/// Rank `odd` passes a different budget (or, when `bad_lengths`, an invalid length): every rank
/// must fail with the same error, none may hang. Returns "" when this rank saw that error.
template <class Comm>
std::string check_disagreement(Comm& comm, int odd, bool bad_lengths) {
  const index_t n = 2, T = 16;
  std::vector<float> s(static_cast<std::size_t>(n * T), 1.0f);
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(n), static_cast<std::int32_t>(T));
  if (bad_lengths && comm.rank() == odd) lengths[1] = 99;
  const index_t total = !bad_lengths && comm.rank() == odd ? 7 : 6;
  std::vector<std::int32_t> cu(static_cast<std::size_t>(n + 1));
  std::vector<pos_t> pos(static_cast<std::size_t>(n * T));
  const auto st = with_workspace([&](kvevict::workspace& ws) {
    return kvevict::select_topk_flat(kvevict::seq, ws, comm, kvevict::make_matrix_view<const float>(s.data(), n, T).value(),
                                     lengths.data(), total, nullptr, cu.data(), pos.data());
  });
  const std::string msg = st.message();
  if (st.ok()) return "a rank passing an inconsistent configuration was not reported";
  if (bad_lengths) {
    const std::string want = "rank " + std::to_string(odd) + " of " + std::to_string(comm.size());
    if (st.code() != kvevict::errc::out_of_range || msg.find(want) == std::string::npos ||
        msg.find("row_lengths[1] = 99") == std::string::npos)
      return "unexpected error: " + msg;
  } else if (st.code() != kvevict::errc::invalid_argument || msg.find("disagree") == std::string::npos ||
             msg.find("total 7") == std::string::npos) {
    return "unexpected error: " + msg;
  }
  for (const std::int32_t c : cu)
    if (c != 0) return "outputs written despite the error";
  return "";
}

}  // namespace kvtest::dist
