// runner/evict.hpp: the published eviction methods on the reference runner, through kvevict's
// recipes, budget allocators and drivers (docs/runner.md, "Eviction"). The methods' names, options,
// recipes and checks are the catalogue (methods/catalogue.hpp); here: the captured blocks, the
// scorers' interfaces, allocations and the driver plumbing the evictor (evictor.hpp) uses.
//
//   kvrun::evict_options o;                       // recipe, budget, allocator, driver, window, ...
//   o.recipe = kvrun::method::snapkv;  o.budget = 32;
//   kvrun::evictor ev;  KVEVICT_TRY(ev.init(model, o));
//   KVEVICT_TRY(ev.prefill(run, cache, prompt, &recorder));   // prefill + eviction (any driver)
//   int tok = kvrun::sampler::argmax(ev.next_logits(), vocab);
//   KVEVICT_TRY(ev.decode(run, cache, tok));                  // decode (+ decode-time eviction)
//
// What an engine author reads here: how each driver is fed from the runner's forward hooks.
//   postfill      prefill everything, then post_fill_driver: add_layer per layer with the queries
//                 the recipe reads (captured by the prefill's after_layer hook), decide, compact.
//   layerwise     inside the prefill's after_layer hook: cascade_driver (LAVa / CAKE cascading:
//                 the new layer and every lower layer whose budget shrank are compacted) or, for
//                 per-layer allocators, post_fill_driver layer by layer (same kept sets as postfill,
//                 lower memory peak).
//   chunked-*     the prompt in chunks: forward a chunk, (patched: forward_extra the prompt's last w
//                 tokens at their true positions, keeping their queries and keys), add_layer per
//                 layer, decide, compact; the next chunk attends over what was kept.
//   decode        plain prefill; then after every decoded token decode_driver::step per layer
//                 (H2O accumulates attention every step) and a compaction when it evicts.
// LAQ / LAQ++ (a query_source: methods/laq.hpp), SpecKV (methods/speckv.hpp's draft response) and
// the response oracle are post-fill methods with an external query block; LookaheadKV is post-fill
// with a prompt_scorer's scores (lookaheadkv/scores.hpp: the trained module's).
#pragma once

#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/workers.hpp>

#include <methods/catalogue.hpp>

#include <kvevict/budget.hpp>
#include <kvevict/driver.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/train/prulong.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvrun {

// ---------------------------------------------------------------------------------------------
// Captured blocks

/// The post-RoPE queries and keys of one block of `rows` rows at every layer, copied by a forward
/// hook: queries [L][H_q][rows][d], keys [L][H_kv][rows][d]. The views it hands out are what the
/// drivers and the recipes read.
class block_capture {
 public:
  void reset(const config& c, index_t rows) {
    layers_ = c.n_layers;
    hq_ = c.n_heads;
    hkv_ = c.n_kv_heads;
    d_ = c.head_size();
    rows_ = rows;
    q_.assign(static_cast<std::size_t>(layers_ * hq_ * rows * d_), 0.0f);
    k_.assign(static_cast<std::size_t>(layers_ * hkv_ * rows * d_), 0.0f);
  }
  index_t rows() const { return rows_; }

  /// Copies the event's block rows [first, first + n) into rows [at, at + n).
  status store(const layer_event& ev, index_t at, index_t first = 0, index_t n = -1) {
    if (n < 0) n = ev.rows - first;
    if (at < 0 || first < 0 || at + n > rows_ || first + n > ev.rows || ev.layer >= layers_)
      return status::error(errc::out_of_range, "block_capture: rows [%lld, %lld) of a %lld-row capture",
                           static_cast<long long>(at), static_cast<long long>(at + n), static_cast<long long>(rows_));
    put(ev.layer, at, *kvevict::token_range(ev.queries, first, n), *kvevict::token_range(ev.keys, first, n));
    return {};
  }
  /// Copies the rows of q [H_q][n][d] and k [H_kv][n][d] (or empty) into rows [at, at + n) of
  /// layer l (in range: the caller's to check).
  void put(int l, index_t at, kvevict::kv_view<const float> q, kvevict::kv_view<const float> k = {}) {
    for (index_t h = 0; h < q.extent(0); ++h)
      for (index_t i = 0; i < q.extent(1); ++i)
        for (index_t x = 0; x < d_; ++x) query_row(l, h, at + i)[x] = q(h, i, x);
    for (index_t h = 0; h < k.extent(0); ++h)
      for (index_t i = 0; i < k.extent(1); ++i)
        for (index_t x = 0; x < d_; ++x) key_row(l, h, at + i)[x] = k(h, i, x);
  }
  /// A hook storing every block row at rows [at, ...).
  forward_hooks hooks(index_t at = 0) {
    forward_hooks h;
    h.after_layer = [this, at](const layer_event& ev) { return store(ev, at); };
    return h;
  }

  float* query_row(int l, index_t h, index_t t) { return q_.data() + ((l * hq_ + h) * rows_ + t) * d_; }
  float* key_row(int l, index_t h, index_t t) { return k_.data() + ((l * hkv_ + h) * rows_ + t) * d_; }
  /// Rows [first, first + n) of layer l: [H_q][n][d] and [H_kv][n][d].
  kvevict::kv_view<const float> queries(int l, index_t first, index_t n) const {
    return *kvevict::make_kv_view<const float>(q_.data() + (l * hq_ * rows_ + first) * d_, hq_, n, d_, rows_ * d_, d_);
  }
  kvevict::kv_view<const float> keys(int l, index_t first, index_t n) const {
    return *kvevict::make_kv_view<const float>(k_.data() + (l * hkv_ * rows_ + first) * d_, hkv_, n, d_, rows_ * d_, d_);
  }

 private:
  index_t layers_ = 0, hq_ = 0, hkv_ = 0, d_ = 0, rows_ = 0;
  std::vector<float> q_, k_;
};

/// Layer l (a layer of the cache) of the runner's cache as the drivers read it: its paged view
/// (kv_cache::paged), every page read through the block table, nothing copied.
inline kvevict::paged_layer_kv<float> layer_view(kv_cache& c, int l) { return *c.paged(l); }

/// Scores a method computes outside the recipes for a prefilled, not yet evicted prompt (method
/// lookaheadkv: examples/lookaheadkv/scores.hpp's lookahead_scorer, a trained module's estimate).
/// score() may run extra blocks on the cache but leaves it as it was; scores(l) is then layer l's
/// [H_kv][P], higher = keep.
class prompt_scorer {
 public:
  virtual ~prompt_scorer() = default;
  virtual status score(runner& run, kv_cache& cache) = 0;
  virtual kvevict::matrix_view<const float> scores(int l) const = 0;
};

/// A query block a method computes for a prefilled, not yet evicted prompt (methods laq and laq++:
/// methods/laq.hpp's laq_queries, the pseudo-decoded queries). compute() gets the prompt's
/// captured queries (every row) and the prefill's last-row logits; it may run extra tokens on a
/// copy of `cache` but leaves `cache` as it was; block() is then its queries and their own keys,
/// which the evictor scores over the prompt as an external block.
class query_source {
 public:
  virtual ~query_source() = default;
  virtual status compute(runner& run, const kv_cache& cache, const block_capture& prompt_q, const float* prefill_logits,
                         const evict_options& o) = 0;
  virtual const block_capture& block() const = 0;
};

// ---------------------------------------------------------------------------------------------
// Budgets

/// One allocation for a prompt of P tokens: the driver's kvevict::allocation and the storage of
/// its [L][H] budget matrix.
struct allocation_plan {
  kvevict::allocation alloc;
  std::vector<std::int32_t> budgets;  ///< [L][H] (per_head, adakv); empty for lava / cake
  index_t retrieval_heads = -1;       ///< duo: heads that keep the whole prompt
  std::vector<std::uint8_t> retrieval;  ///< duo: [L][H], 1 = retrieval head, 0 = streaming head
  index_t total = 0;                  ///< tokens the model keeps after the eviction (all heads, layers)
};

/// Duo head types: a ranking per (layer, KV head) -- the calibration's "globalness"
/// (methods/duo_calibration.hpp) or a trained head-mask file's values (DuoAttention's alpha, PruLong's
/// mask) -- whose top heads become retrieval heads: `retrieval` of them when >= 0 (a trained
/// mask's own count, or the count of a chosen sparsity), else as many as the budget affords.
struct duo_heads {
  std::vector<double> global;  ///< [L][H_kv]
  index_t retrieval = -1;
};

/// The allocation of scheme `a` for per-head budget B (clamped to P: a budget of at least the
/// prompt keeps everything) over a P-token prompt with protection `prot`: kvevict::make_allocation
/// (docs/budget.md), duo with the `duo_retrieval_heads(B H L)` most global heads of the calibration
/// as retrieval heads (prulong_topk_mask).
inline status plan_allocation(const config& c, budget_scheme a, index_t budget, index_t P, kvevict::protection prot,
                              const duo_heads* duo, allocation_plan& out) {
  const index_t L = c.n_layers, H = c.n_kv_heads, B = std::min(budget, P);
  out = allocation_plan{};
  out.budgets.assign(static_cast<std::size_t>(L * H), 0);
  kvevict::allocation_request req;
  req.budget = budget;
  req.prompt = P;
  req.prot = prot;
  std::vector<std::uint8_t> mask;
  if (a == budget_scheme::duo) {
    if (duo == nullptr || static_cast<index_t>(duo->global.size()) != L * H)
      return status::error(errc::invalid_argument, "duo: the head types need a calibration (duo_calibration.hpp)");
    kvevict::duo_options dopt;
    dopt.streaming = prot;
    const auto by_budget = kvevict::duo_retrieval_heads(B * H * L, L, H, P, dopt);
    if (!by_budget) return by_budget.error();
    const index_t k = duo->retrieval >= 0 ? std::min(duo->retrieval, L * H) : *by_budget;  // a mask's count wins
    mask.assign(static_cast<std::size_t>(L * H), 0);
    const auto mview = *kvevict::make_matrix_view(mask.data(), L, H);
    KVEVICT_TRY(kvevict::prulong_topk_mask(*kvevict::make_matrix_view(duo->global.data(), L, H), k, mview));
    req.retrieval = mview;
    out.retrieval_heads = k;
  }
  KVEVICT_TRY(kvevict::make_allocation(a, req, *kvevict::make_matrix_view(out.budgets.data(), L, H), &out.alloc, &out.total));
  out.retrieval = std::move(mask);
  if (a == budget_scheme::lava || a == budget_scheme::cake) out.budgets.clear();  // a total, no matrix
  return {};
}

// ---------------------------------------------------------------------------------------------
// Driver plumbing

inline kvevict::model_shape shape_of(const config& c) {
  return {c.n_layers, c.n_kv_heads, c.n_heads, c.head_size()};
}

/// The chunked driver's configuration for a P-token prompt under `o` (--driver chunked-naive /
/// chunked-patched, --chunk-fraction), without its allocation (the caller's).
inline kvevict::chunked_config chunked_config_of(const evict_options& o, const kvevict::recipe& rec,
                                                 kvevict::model_shape shape, index_t P) {
  kvevict::chunked_config cc;
  cc.model = shape;
  cc.tokens = P;
  cc.capacity = P;
  cc.rec = rec;
  cc.queries = o.driver == driver_kind::chunked_patched ? kvevict::chunk_queries::patched : kvevict::chunk_queries::naive;
  cc.target = o.chunk_fraction >= 0.0 ? kvevict::chunk_target::fraction : kvevict::chunk_target::budget;
  if (o.chunk_fraction >= 0.0) cc.fraction = o.chunk_fraction;
  return cc;
}

/// Layer l's queries for the chunked driver (and the patch block's keys): the patch block's when the
/// chunk has one, else the chunk's last `rows` queries (none when rows is 0).
inline void chunk_queries_of(const block_capture& patch_q, const block_capture& chunk_q, kvevict::patch_block patch,
                             index_t rows, int l, kvevict::kv_view<const float>& q, kvevict::kv_view<const float>& pk) {
  if (patch.count > 0) {
    q = patch_q.queries(l, 0, patch.count);
    pk = patch_q.keys(l, 0, patch.count);
  } else if (rows > 0) {
    q = chunk_q.queries(l, 0, rows);
  }
}

/// Layer l's queries for a decode_driver step under `rec`: the new token's (h2o, tova), the last
/// `window` tokens' (window recipes), none (knorm, streaming_llm).
inline kvevict::kv_view<const float> decode_queries_of(const kvevict::recipe& rec, const block_capture& step_q,
                                                       const block_capture& recent_q, int l, index_t window) {
  switch (rec.kind) {
    case kvevict::recipe_kind::h2o:
    case kvevict::recipe_kind::tova: return step_q.queries(l, 0, 1);
    case kvevict::recipe_kind::knorm:
    case kvevict::recipe_kind::streaming_llm: return {};
    default: return recent_q.queries(l, 0, window);
  }
}

/// A driver's state memory and workspace, kept between calls (they only grow: grown()).
struct driver_scratch {
  std::vector<unsigned char> state, ws;
};

/// init()s driver `d` with `cfg` (recording into `rec`, may be null) on state memory from `s`, and
/// hands out its workspace, sized by the driver's own query.
template <class Driver, class Config>
status init_driver(Driver& d, driver_scratch& s, const Config& cfg, kvevict::eviction_recorder* rec,
                   kvevict::workspace& ws) {
  const auto bytes = Driver::state_bytes(cfg);
  if (!bytes) return bytes.error();
  KVEVICT_TRY(d.init(cfg, grown(s.state, *bytes), *bytes, rec));
  const auto wb = d.workspace_bytes(kvevict::seq);
  if (!wb) return wb.error();
  ws = {grown(s.ws, *wb), s.ws.size()};
  return {};
}

/// What post_fill_decide hands the driver for layer l.
struct layer_inputs {
  kvevict::paged_layer_kv<float> paged;        ///< the layer's rows: the runner's paged cache (or a view of some of its rows)
  kvevict::layer_kv<float> kv;                 ///< or a ragged cache (examples/sharded/), when paged is empty
  kvevict::kv_view<const float> queries;       ///< the recipe's query block
  kvevict::kv_view<const float> block_keys;    ///< an external block's own keys, or empty
  double weight = 0.0;                         ///< cake: the layer's preference
  /// Scores computed elsewhere ([H_kv][>= rows], e.g. a prompt_scorer's): given, the driver takes
  /// them (add_layer_scores) and the queries are not read.
  kvevict::matrix_view<const float> scores{};
};

/// Post-fill eviction with kvevict::post_fill_driver: init, add_layer for every layer with
/// inputs(l, in), decide. The kept rows are then d.kept(l) (see compact_kept). Nothing is compacted
/// here. The driver records the dropped rows at step cfg.tokens into `rec` (may be null).
template <class Inputs>
status post_fill_decide(kvevict::post_fill_driver& d, driver_scratch& s, const kvevict::post_fill_config& cfg,
                        Inputs&& inputs, kvevict::eviction_recorder* rec) {
  kvevict::workspace ws;
  KVEVICT_TRY(init_driver(d, s, cfg, rec, ws));
  for (int l = 0; l < static_cast<int>(cfg.model.layers); ++l) {
    layer_inputs in;
    KVEVICT_TRY(inputs(l, in));
    const auto add = [&](const auto& kv) {
      if (in.scores.data_handle() != nullptr) return d.add_layer_scores(kvevict::seq, ws, l, kv, in.scores, in.weight);
      return d.add_layer(kvevict::seq, ws, l, kv, in.queries, in.block_keys, in.weight);
    };
    KVEVICT_TRY(in.paged.layer.keys.data != nullptr ? add(in.paged) : add(in.kv));
  }
  return d.decide(kvevict::seq, ws);
}

/// Compacts every layer of `cache` with the driver's kept rows.
template <class Driver>
status compact_kept(kv_cache& cache, const Driver& d) {
  for (int l = 0; l < cache.layers(); ++l) KVEVICT_TRY(cache.compact(l, d.kept(l)));
  return {};
}

// ---------------------------------------------------------------------------------------------
// Timing

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace kvrun
