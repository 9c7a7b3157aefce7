// The chunked prefill driver (include/kvevict/drivers/chunked.hpp, docs/drivers.md) over a
// synthetic prompt in the engine shape: the eviction work an engine adds to a chunked prefill.
//
// Per chunk [s, e) the "engine" appends the chunk's K / V rows and positions to every layer's
// ragged cache (NOT timed: that is the forward pass's work, as are the queries, which are
// synthetic), then the timed driver work runs:
//   begin_chunk; per layer add_layer (scores the layer's current cache, kept rows + chunk, with the
//   query block; per-layer allocators select); decide (lava shares the model's budget by the
//   layers' entropies and selects every layer); per layer compact_inplace of K, V and positions
//   with kept(l)
// The benchmark time is that driver work over the whole prompt (manual timing); counters give
// per_chunk_us (time / chunks), chunks, and where the time goes (add_layer_us, decide_us,
// compact_us, per prompt).
//
//   op        the allocator: uniform (per_head, B per head, SnapKV recipe) or lava (LAVa recipe,
//             model total B H L, entropy layer budgets, flattened within a layer)
//   kvevict            chunked_driver, patched (the prompt's last w tokens score every chunk)
//   kvevict_naive      chunked_driver, naive (each chunk scored by its own last w queries)
//   kvevict_post_fill  post_fill_driver on the whole prompt at the same budget (add_layer +
//                      decide + compact_inplace of K, V, positions): what chunking costs extra
// Checks (once per case, outside the timing; smoke mode too): the budgets are exact after every
// chunk (uniform: every head holds min(B, rows); lava: the model holds min(B H L, rows)); par keeps
// the same rows as seq; the patched driver with a single chunk keeps the same rows as the
// post-fill driver (docs/drivers.md's invariant).
#include <kvevict/driver.hpp>

#include "harness.hpp"

#include <chrono>
#include <tuple>

namespace {
using namespace kvb;
using clock_type = std::chrono::steady_clock;
using K = kvevict::float16;
using shape_t = kvb::model_shape;

double since(clock_type::time_point& t) {
  const auto now = clock_type::now();
  const double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

/// One benchmark case: the model (L layers of the shape), prompt, chunk and budget.
struct driver_case {
  shape_t s;
  index_t T = 0, L = 0, chunk = 0, B = 0;
  index_t chunks() const {  // the chunk schedule of chunk_end()
    index_t n = 0;
    for (index_t b = 0; b < T; b = chunk_end(b)) ++n;
    return n;
  }
  /// End of the chunk starting at b: b + chunk, or T when that would end inside the last w tokens
  /// (patched chunking needs the whole window in the final chunk; naive uses the same chunks).
  index_t chunk_end(index_t b) const {
    index_t e = std::min(T, b + chunk);
    if (e < T && e > T - s.window) e = T;
    return e;
  }
  params name_params() const {
    return shape_params(s, T).add("w", s.window).add("L", L).add("chunk", chunk).add("B", B).add("kv", "fp16");
  }
};

/// The synthetic prompt: per layer K, V [H][T][d], the last w tokens' queries [Hq][w][d] and their
/// keys [H][w][d] (the patch keys), and per chunk the chunk's own last-w queries (naive mode; the
/// final chunk's are the last w tokens'). Queries of layer l are scaled by 1 + l / 2 so deeper
/// layers attend more sharply (LAVa's entropies differ across layers).
struct prompt_data {
  std::vector<std::vector<K>> k, v, q_last, patch_k;
  std::vector<std::vector<std::vector<K>>> q_naive;  // [layer][chunk] -> [Hq][w][d]
  explicit prompt_data(const driver_case& c) {
    const shape_t& s = c.s;
    const auto L = static_cast<std::size_t>(c.L);
    const auto kv_n = static_cast<std::size_t>(s.hkv * c.T * s.dim);
    const auto q_n = static_cast<std::size_t>(s.hq * s.window * s.dim);
    k.resize(L);
    v.resize(L);
    q_last.resize(L);
    patch_k.resize(L);
    q_naive.resize(L);
    for (std::size_t l = 0; l < L; ++l) {
      const std::uint64_t seed = 100 * (l + 1);
      const float scale = 1.0f + 0.5f * static_cast<float>(l);
      const auto scaled = [scale](std::uint64_t& st) { return scale * normal01(st); };
      k[l].resize(kv_n);
      v[l].resize(kv_n);
      fill_normal(k[l], seed + 1);
      fill_normal(v[l], seed + 2);
      q_last[l].resize(q_n);
      fill(q_last[l].data(), q_n, seed + 3, scaled);
      patch_k[l].resize(static_cast<std::size_t>(s.hkv * s.window * s.dim));
      for (index_t h = 0; h < s.hkv; ++h)
        std::memcpy(patch_k[l].data() + h * s.window * s.dim, k[l].data() + (h * c.T + c.T - s.window) * s.dim,
                    static_cast<std::size_t>(s.window * s.dim) * sizeof(K));
      const index_t n = c.chunks();
      for (index_t i = 0; i + 1 < n; ++i) {
        std::vector<K> q(q_n);
        fill(q.data(), q_n, seed + 10 + static_cast<std::uint64_t>(i), scaled);
        q_naive[l].push_back(std::move(q));
      }
      q_naive[l].push_back(q_last[l]);
    }
  }
};

const prompt_data& get_prompt(const driver_case& c) {
  return cached<prompt_data>(std::make_tuple(std::string(c.s.name), c.T, c.L, c.chunk),
                             [&] { return std::make_unique<prompt_data>(c); });
}

/// One layer of the engine's cache: ragged K, V and positions with room for `cap` rows per head.
struct engine_layer {
  index_t H = 0, d = 0, cap = 0;
  buffer<K> k, v;
  buffer<pos_t> pos;
  std::vector<std::int32_t> cu, lens, tmp;
  engine_layer(index_t heads, index_t dim, index_t capacity)
      : H(heads), d(dim), cap(capacity), k(static_cast<std::size_t>(heads * capacity * dim)),
        v(k.size()), pos(static_cast<std::size_t>(heads * capacity)), lens(static_cast<std::size_t>(heads), 0),
        tmp(static_cast<std::size_t>(heads), 0) {
    for (index_t h = 0; h <= H; ++h) cu.push_back(static_cast<std::int32_t>(h * cap));
  }
  ragged_cache<K> keys(std::int32_t* l) { return {k.data(), cu.data(), l, H, d, d}; }
  ragged_cache<K> values(std::int32_t* l) { return {v.data(), cu.data(), l, H, d, d}; }
  layer_kv<K> view() { return make_layer_kv(keys(lens.data()), values(lens.data()), pos.data()); }
  /// The forward pass's part (not timed): rows [b, e) of the prompt appended to every head.
  void append_rows(const std::vector<K>& pk, const std::vector<K>& pv, index_t T, index_t b, index_t e) {
    const auto n = static_cast<std::size_t>(e - b);
    for (index_t h = 0; h < H; ++h) {
      const index_t at = cu[static_cast<std::size_t>(h)] + lens[static_cast<std::size_t>(h)];
      std::memcpy(k.data() + at * d, pk.data() + (h * T + b) * d, n * static_cast<std::size_t>(d) * sizeof(K));
      std::memcpy(v.data() + at * d, pv.data() + (h * T + b) * d, n * static_cast<std::size_t>(d) * sizeof(K));
      for (index_t i = 0; i < e - b; ++i) pos[static_cast<std::size_t>(at + i)] = static_cast<pos_t>(b + i);
      lens[static_cast<std::size_t>(h)] += static_cast<std::int32_t>(n);
    }
  }
  /// The engine's compaction with a driver's answer (timed): K and V against a copy of the
  /// lengths, positions last (it updates the real lengths).
  template <class Backend>
  status compact(Backend be, ragged_positions kept) {
    tmp = lens;
    KVEVICT_TRY(compact_inplace(be, keys(tmp.data()), kept));
    tmp = lens;
    KVEVICT_TRY(compact_inplace(be, values(tmp.data()), kept));
    return compact_inplace(be, ragged_cache<pos_t>{pos.data(), cu.data(), lens.data(), H, 1, 1}, kept);
  }
  /// Positions every head holds (ragged, for comparing runs).
  void held(std::vector<std::int32_t>& out_cu, std::vector<pos_t>& out) const {
    for (index_t h = 0; h < H; ++h) {
      out.insert(out.end(), pos.data() + cu[static_cast<std::size_t>(h)],
                 pos.data() + cu[static_cast<std::size_t>(h)] + lens[static_cast<std::size_t>(h)]);
      out_cu.push_back(static_cast<std::int32_t>(out.size()));
    }
  }
};

recipe case_recipe(const shape_t& s, bool lava) {
  recipe r = lava ? recipe::lava() : recipe::snapkv();
  r.window = s.window;
  r.n_recent = s.window;
  r.n_sink = 4;  // patched non-final chunks protect only the sinks (docs/drivers.md)
  return r;
}

/// Per-phase driver time over the timed iterations.
struct phases {
  double add = 0, decide = 0, compact = 0, total = 0;
  index_t chunks = 0, runs = 0;
  void report(benchmark::State& st) const {
    if (runs <= 0) return;
    const double n = static_cast<double>(runs);
    st.counters["add_layer_us"] = add * 1e6 / n;
    st.counters["decide_us"] = decide * 1e6 / n;
    st.counters["compact_us"] = compact * 1e6 / n;
    st.counters["chunks"] = static_cast<double>(chunks) / n;
    st.counters["per_chunk_us"] = total * 1e6 / static_cast<double>(chunks);
  }
};

/// What a run kept: the positions every layer's heads hold at the end.
struct kept_rows {
  std::vector<std::int32_t> cu;
  std::vector<pos_t> pos;
  bool operator==(const kept_rows& o) const { return cu == o.cu && pos == o.pos; }
};

enum class mode { patched, naive, post_fill };

/// A driver and the engine's caches for one case; run() is one whole prefill's eviction work.
struct evictor {
  const driver_case c;
  const prompt_data& data;
  const mode m;
  const bool lava;
  const index_t chunk;  // the chunk size run() uses (c.chunk, or T for the single-chunk check)
  std::vector<std::int32_t> budgets;
  std::vector<unsigned char> state;
  chunked_driver cd;
  post_fill_driver pd;
  scratch ws;
  std::vector<engine_layer> layers;
  phases ph;
  std::string check_error;  // the first budget-exactness failure

  evictor(const driver_case& dc, const prompt_data& pd_, mode md, bool is_lava, index_t chunk_size)
      : c(dc), data(pd_), m(md), lava(is_lava), chunk(chunk_size),
        budgets(static_cast<std::size_t>(dc.L * dc.s.hkv), static_cast<std::int32_t>(dc.B)) {
    const index_t H = c.s.hkv;
    index_t cap = c.T;
    if (m != mode::post_fill) cap = std::min(c.T, (lava ? c.B * H * c.L : c.B) + chunk);
    for (index_t l = 0; l < c.L; ++l) layers.emplace_back(H, c.s.dim, cap);
  }
  index_t total() const { return c.B * c.s.hkv * c.L; }
  allocation alloc() const {
    allocation a;
    a.kind = lava ? allocator::lava : allocator::per_head;
    a.budgets = *make_matrix_view<const std::int32_t>(budgets.data(), c.L, c.s.hkv);
    a.total = total();
    return a;
  }
  kvevict::model_shape model() const { return {c.L, c.s.hkv, c.s.hq, c.s.dim}; }
  kv_view<const K> view_q(const std::vector<K>& q) const {
    return *make_kv_view<const K>(q.data(), c.s.hq, c.s.window, c.s.dim);
  }

  /// Initialises the driver (and sizes the workspace on the first call). Not timed.
  template <class Backend>
  status init(Backend be) {
    if (m == mode::post_fill) {
      post_fill_config cfg;
      cfg.model = model();
      cfg.tokens = c.T;
      cfg.rec = case_recipe(c.s, lava);
      cfg.alloc = alloc();
      auto bytes = post_fill_driver::state_bytes(cfg);
      if (!bytes) return bytes.error();
      state.resize(*bytes);
      KVEVICT_TRY(pd.init(cfg, state.data(), state.size()));
      if (ws.ws().data == nullptr) {
        auto w = pd.workspace_bytes(be);
        if (!w) return w.error();
        ws.ws().bytes = *w;
        ws.allocate();
      }
      return {};
    }
    chunked_config cfg;
    cfg.model = model();
    cfg.tokens = c.T;
    cfg.capacity = layers[0].cap;
    cfg.rec = case_recipe(c.s, lava);
    cfg.queries = m == mode::patched ? chunk_queries::patched : chunk_queries::naive;
    cfg.target = chunk_target::budget;
    cfg.alloc = alloc();
    auto bytes = chunked_driver::state_bytes(cfg);
    if (!bytes) return bytes.error();
    state.resize(*bytes);
    KVEVICT_TRY(cd.init(cfg, state.data(), state.size()));
    if (ws.ws().data == nullptr) {
      auto w = cd.workspace_bytes(be);
      if (!w) return w.error();
      ws.ws().bytes = *w;
      ws.allocate();
    }
    return {};
  }

  /// Checks (not timed) that the layers hold exactly the budget after a decision.
  void check_budgets(index_t rows_before_total, const std::vector<index_t>& rows_before) {
    if (!check_error.empty()) return;
    const index_t H = c.s.hkv;
    index_t held = 0;
    for (index_t l = 0; l < c.L; ++l)
      for (index_t h = 0; h < H; ++h) {
        const index_t n = layers[static_cast<std::size_t>(l)].lens[static_cast<std::size_t>(h)];
        held += n;
        const index_t want = std::min(c.B, rows_before[static_cast<std::size_t>(l * H + h)]);
        if (!lava && n != want)
          check_error = "layer " + std::to_string(l) + " head " + std::to_string(h) + " holds " + std::to_string(n) +
                        " rows, its budget gives " + std::to_string(want);
      }
    if (lava && held != std::min(total(), rows_before_total))
      check_error = "the model holds " + std::to_string(held) + " rows, the lava total gives " +
                    std::to_string(std::min(total(), rows_before_total));
  }

  /// One prefill's eviction work; returns the driver's (timed) seconds.
  template <class Backend>
  status run(Backend be, double& seconds, bool check) {
    KVEVICT_TRY(init(be));
    const index_t H = c.s.hkv;
    std::vector<index_t> before(static_cast<std::size_t>(c.L * H));
    double add = 0, dec = 0, cmp = 0;
    index_t n_chunks = 0;
    if (m == mode::post_fill) {
      for (auto& ly : layers) std::fill(ly.lens.begin(), ly.lens.end(), 0);
      for (index_t l = 0; l < c.L; ++l)
        layers[static_cast<std::size_t>(l)].append_rows(data.k[static_cast<std::size_t>(l)],
                                                       data.v[static_cast<std::size_t>(l)], c.T, 0, c.T);
      auto t = clock_type::now();
      for (index_t l = 0; l < c.L; ++l)
        KVEVICT_TRY(pd.add_layer(be, ws.ws(), l, layers[static_cast<std::size_t>(l)].view(),
                                 view_q(data.q_last[static_cast<std::size_t>(l)])));
      add += since(t);
      KVEVICT_TRY(pd.decide(be, ws.ws()));
      dec += since(t);
      for (index_t l = 0; l < c.L; ++l) KVEVICT_TRY(layers[static_cast<std::size_t>(l)].compact(be, pd.kept(l)));
      cmp += since(t);
      n_chunks = 1;
      if (check) {
        std::fill(before.begin(), before.end(), c.T);
        check_budgets(c.T * H * c.L, before);
      }
    } else {
      for (auto& ly : layers) std::fill(ly.lens.begin(), ly.lens.end(), 0);
      index_t i = 0;
      for (index_t b = 0; b < c.T; ++i) {
        const index_t e = chunk == c.T ? c.T : c.chunk_end(b);
        auto t = clock_type::now();
        KVEVICT_TRY(cd.begin_chunk(b, e));
        add += since(t);
        const bool patch = cd.patch().count > 0;
        index_t rows_total = 0;
        for (index_t l = 0; l < c.L; ++l) {  // the forward pass (not timed)
          auto& ly = layers[static_cast<std::size_t>(l)];
          ly.append_rows(data.k[static_cast<std::size_t>(l)], data.v[static_cast<std::size_t>(l)], c.T, b, e);
          for (index_t h = 0; h < H; ++h) {
            before[static_cast<std::size_t>(l * H + h)] = ly.lens[static_cast<std::size_t>(h)];
            rows_total += ly.lens[static_cast<std::size_t>(h)];
          }
        }
        t = clock_type::now();
        for (index_t l = 0; l < c.L; ++l) {
          const auto ul = static_cast<std::size_t>(l);
          const std::vector<K>& q =
              patch || e == c.T || m == mode::patched ? data.q_last[ul] : data.q_naive[ul][static_cast<std::size_t>(i)];
          kv_view<const K> pk{};
          if (patch) pk = *make_kv_view<const K>(data.patch_k[ul].data(), H, c.s.window, c.s.dim);
          KVEVICT_TRY(cd.add_layer(be, ws.ws(), l, layers[ul].view(), view_q(q), pk));
        }
        add += since(t);
        KVEVICT_TRY(cd.decide(be, ws.ws()));
        dec += since(t);
        for (index_t l = 0; l < c.L; ++l) KVEVICT_TRY(layers[static_cast<std::size_t>(l)].compact(be, cd.kept(l)));
        cmp += since(t);
        if (check) check_budgets(rows_total, before);
        ++n_chunks;
        b = e;
      }
    }
    seconds = add + dec + cmp;
    ph.add += add;
    ph.decide += dec;
    ph.compact += cmp;
    ph.total += seconds;
    ph.chunks += n_chunks;
    ++ph.runs;
    return {};
  }

  kept_rows result() const {
    kept_rows r;
    r.cu.push_back(0);
    for (const auto& ly : layers) ly.held(r.cu, r.pos);
    return r;
  }
};

/// The rows a seq run keeps (the reference of the par runs and the single-chunk check).
kept_rows reference(const driver_case& c, mode m, bool lava, index_t chunk, std::string& error) {
  evictor e(c, get_prompt(c), m, lava, chunk);
  double s = 0;
  if (status st = e.run(seq, s, true); !st) {
    error = st.message();
    return {};
  }
  if (!e.check_error.empty()) error = e.check_error;
  return e.result();
}

template <class Backend>
void run_case(benchmark::State& st, const driver_case& c, mode m, bool lava, Backend be) {
  const prompt_data& data = get_prompt(c);
  evictor e(c, data, m, lava, c.chunk);
  double s = 0;
  if (!ok(st, e.run(be, s, true), "warm-up prefill")) return;  // also checks the budgets
  if (!e.check_error.empty()) return fail(st, "budget not exact: " + e.check_error);
  const kept_rows first = e.result();
  e.ph = phases{};
  for (auto _ : st) {
    if (!ok(st, e.run(be, s, false), "prefill")) return;
    st.SetIterationTime(s);
    benchmark::ClobberMemory();
  }
  e.ph.report(st);
  st.counters["workspace_MiB"] = static_cast<double>(e.ws.ws().bytes) / (1 << 20);
  st.counters["state_MiB"] = static_cast<double>(e.state.size()) / (1 << 20);
  st.counters["kept"] = static_cast<double>(first.pos.size());
  if (!(e.result() == first)) return fail(st, "two runs kept other rows");
  std::string err;
  if (std::is_same_v<Backend, par_t>) {
    const kept_rows ref = reference(c, m, lava, c.chunk, err);
    if (!err.empty()) return fail(st, "seq reference: " + err);
    if (!(ref == first)) return fail(st, "par kept other rows than seq");
  }
  if (m == mode::post_fill && std::is_same_v<Backend, seq_t>) {
    // docs/drivers.md: patched chunking with a single chunk equals post-fill eviction
    const kept_rows one = reference(c, mode::patched, lava, c.T, err);
    if (!err.empty()) return fail(st, "single-chunk patched run: " + err);
    if (!(one == first)) return fail(st, "the single-chunk patched driver kept other rows than post-fill");
  }
}

void reg(const driver_case& c) {
  const params p = c.name_params();
  for (bool lava : {false, true}) {
    const char* op = lava ? "lava" : "uniform";
    for (const auto& [m, impl] : {std::make_pair(mode::patched, "kvevict"), std::make_pair(mode::naive, "kvevict_naive"),
                                  std::make_pair(mode::post_fill, "kvevict_post_fill")}) {
      const mode md = m;
      add_manual(bench_name("driver", op, impl, "seq", p),
                 [=](benchmark::State& st) { run_case(st, c, md, lava, seq); });
      add_manual(bench_name("driver", op, impl, "par", p),
                 [=](benchmark::State& st) { run_case(st, c, md, lava, par); });
    }
  }
}

void register_benchmarks() {
  if (smoke()) {
    reg({smoke_shape, 96, 3, 32, 16});
    return;
  }
  reg({engine_shape, 4096, 4, 1024, 1024});
  reg({engine_shape, 32768, 2, 4096, 1024});
}
}  // namespace

KVB_MAIN(register_benchmarks)
