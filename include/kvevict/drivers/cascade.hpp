// kvevict/drivers/cascade.hpp: layer-by-layer prefill with cascading budgets (LAVa Algorithm 2,
// CAKE's cascading cache management), on top of budget/cascade.hpp's layer_cascade.
//
//   cascade_driver d;
//   d.init(cfg, memory, cascade_driver::state_bytes(cfg).value(), &recorder /*optional*/);
//   for l in 0..L-1:                        // the engine prefills layer l over the whole prompt
//     d.add_layer(be, ws, l, layer_kv_l, queries_l [, block_keys_l] [, cake_preference_l]);
//     compact layer l with d.kept(l)                            // rows = prompt positions
//     for j < l with d.changed(j): compact layer j with d.kept(j)   // rows it holds now
//
// Only the layers prefilled so far hold KV, and after every step they hold at most cfg.total
// tokens, so the memory peak is cfg.total + H N rows (the new layer before its eviction) instead of
// L H N (peak_rows() reports it).
#pragma once

#include <kvevict/drivers/common.hpp>
#include <kvevict/drivers/post_fill.hpp>

namespace kvevict {

/// Where a layer's weight in the cascade comes from.
enum class weight_source : int {
  lava_entropy = 0,  ///< the normalised entropy of its scores, computed by the driver (LAVa)
  caller = 1,        ///< given to add_layer (CAKE: cake_preference(cake_layer_stats(window attention)))
};

struct cascade_driver_config {
  model_shape model;
  /// N: the prompt; every layer is prefilled over all of it before its eviction.
  index_t tokens = 0;
  /// external_block recipes: rows of the query block; otherwise 0 (derived, as post_fill_config).
  index_t query_rows = 0;
  recipe rec = recipe::lava();
  /// Tokens the whole model keeps, protected ones included (layer_cascade's cascade_config::total).
  index_t total = 0;
  /// flattened: LAVa (layer totals, heads compete); per_head: CAKE (equal per-head budgets).
  cascade_split split = cascade_split::flattened;
  weight_source weight = weight_source::lava_entropy;
  entropy_norm norm = entropy_norm::log_count;  ///< lava_entropy: its normalisation
};

/// Layer-by-layer prefill with cascading recompression (see the file comment, docs/drivers.md and
/// layer_cascade in docs/budget.md for the budget rule and its invariant). The driver scores the
/// new layer with the recipe (one recipe_scores call per KV head), computes its weight, and runs
/// layer_cascade::add_layer; kept / changed / positions are the cascade's. Recording: every
/// eviction happens at step N (the prompt is processed at once, layer by layer): after each step
/// the new layer and every layer whose holdings changed are recorded with retain_only.
class cascade_driver {
 public:
  static result<std::size_t> state_bytes(const cascade_driver_config& cfg) {
    KVEVICT_TRY(validate("cascade_driver::state_bytes", cfg));
    return layer_cascade::memory_bytes(cascade_cfg(cfg));
  }

  /// Errors: as post_fill_driver's model / recipe / query errors; the cascade's configuration
  /// errors (total below the protected tokens or above L H N, per_head total not a multiple of H);
  /// unknown weight source or entropy norm; recorder shape; memory null or too small.
  status init(const cascade_driver_config& cfg, void* memory, std::size_t bytes, eviction_recorder* recorder = nullptr) {
    constexpr const char* fn = "cascade_driver::init";
    KVEVICT_TRY(validate(fn, cfg));
    KVEVICT_TRY(detail::check_recorder(fn, recorder, cfg.model, cfg.tokens));
    KVEVICT_TRY(cascade_.init(cascade_cfg(cfg), memory, bytes));
    cfg_ = cfg;
    rec_ = recorder;
    mem_ = {reinterpret_cast<std::uintptr_t>(memory), reinterpret_cast<std::uintptr_t>(memory) + bytes};
    bool bk = false;
    rules_ = {};
    (void)detail::prompt_queries(fn, cfg.rec, cfg.tokens, cfg.query_rows, &query_rows_, &bk, &rules_);
    block_keys_ = bk;
    rules_.tokens = cfg.tokens;
    rules_.capacity = cfg.tokens;
    rules_.whole = true;
    peak_ = 0;
    ok_ = true;
    return {};
  }

  template <class Backend>
  result<std::size_t> workspace_bytes(Backend be) const {
    if (!ok_) return status::error(errc::invalid_argument, "cascade_driver::workspace_bytes: not initialised (init)");
    workspace q;
    ws_layout w;
    KVEVICT_TRY(carve(be, q, w));
    return q.bytes;
  }

  /// Layer `layer` (in order) was prefilled over the whole prompt: kv holds, in every head, rows
  /// 0..N-1 at positions 0..N-1; queries / block_keys as post_fill_driver::add_layer; weight: the
  /// layer's CAKE preference when cfg.weight == caller (ignored otherwise). Afterwards kept(j) /
  /// changed(j) tell the engine what to compact (j <= layer).
  /// Errors (nothing changes): not initialised; layer out of order or past L; a head not holding
  /// the whole prompt; the layer's layout, positions, queries and block keys (as post-fill); a
  /// weight NaN, infinite or negative; unprotected scores the entropy refuses; workspace too small
  /// or overlapping the state; the recorder's errors.
  template <class Backend, class T, class Q>
  status add_layer(Backend be, workspace& ws, index_t layer, const layer_kv<T>& kv, kv_view<Q> queries_in,
                   kv_view<const T> block_keys = {}, double weight = 0.0) {
    constexpr const char* fn = "cascade_driver::add_layer";
    using QE = std::remove_const_t<Q>;
    const kv_view<const QE> queries = queries_in;
    if (!ok_) return status::error(errc::invalid_argument, "%s: the driver is not initialised (init)", fn);
    ws_layout w;
    KVEVICT_TRY(carve(be, ws, w));
    if (ws.is_query()) return {};
    const index_t L = cfg_.model.layers, H = cfg_.model.kv_heads, N = cfg_.tokens;
    const index_t added = cascade_.layers_added();
    if (layer != added || layer >= L)
      return added >= L ? status::error(errc::invalid_argument, "%s: layer %lld given, but all %lld layers were added", fn,
                                        static_cast<long long>(layer), static_cast<long long>(L))
                        : status::error(errc::invalid_argument,
                                        "%s: layer %lld given, expected layer %lld (layers come in order)", fn,
                                        static_cast<long long>(layer), static_cast<long long>(added));
    KVEVICT_TRY(detail::check_layer(fn, layer, kv, H, cfg_.model.head_dim, rules_));
    KVEVICT_TRY(detail::check_queries(fn, queries, query_rows_, cfg_.model, block_keys, block_keys_));
    if (detail::ws_range(ws).intersects(mem_))
      return status::error(errc::overlap, "%s: the workspace overlaps the driver's state memory", fn);
    if (cfg_.weight == weight_source::caller && (!(weight >= 0.0) || weight - weight != 0.0))
      return status::error(errc::invalid_argument, "%s: layer %lld's weight is %g (must be finite and >= 0)", fn,
                           static_cast<long long>(layer), weight);
    KVEVICT_TRY(detail::score_layer(be, w.sc, cfg_.rec, kv, cfg_.model.query_heads / H, queries, block_keys, w.scores, N));
    const auto sv = detail::rows_view<const float>(w.scores, H, N, N);
    double e = weight;
    if (cfg_.weight == weight_source::lava_entropy) {
      lava_entropy_options eo;
      eo.prot = detail::recipe_protection(cfg_.rec);
      eo.norm = cfg_.norm;
      KVEVICT_TRY(lava_layer_entropy(be, sv, nullptr, eo, &e));
    }
    {
      workspace q;
      KVEVICT_TRY(cascade_.add_layer(be, q, layer, sv, e));
      if (q.bytes > w.cascade.bytes)
        return status::error(errc::workspace_too_small, "%s: the cascade needs %zu bytes of workspace, %zu were planned",
                             fn, q.bytes, w.cascade.bytes);
    }
    const index_t before = cascade_.held_total();
    KVEVICT_TRY(cascade_.add_layer(be, w.cascade, layer, sv, e));
    if (before + H * N > peak_) peak_ = before + H * N;
    if (rec_ != nullptr)
      for (index_t j = 0; j <= layer; ++j)
        if (cascade_.changed(j)) KVEVICT_TRY(rec_->retain_only(j, cascade_.positions(j), N));
    return {};
  }

  /// The cascade's answers (budget/cascade.hpp): the new layer's kept rows are prompt positions
  /// (= rows of its un-evicted cache); a lower layer's are rows of what it held before the step.
  bool changed(index_t layer) const noexcept { return ok_ && cascade_.changed(layer); }
  ragged_positions kept(index_t layer) const noexcept { return ok_ ? cascade_.kept(layer) : ragged_positions{}; }
  /// Prompt positions each layer holds now, per head ascending.
  ragged_positions positions(index_t layer) const noexcept { return ok_ ? cascade_.positions(layer) : ragged_positions{}; }
  index_t layer_total(index_t layer) const noexcept { return ok_ ? cascade_.layer_total(layer) : 0; }
  double layer_weight(index_t layer) const noexcept { return ok_ ? cascade_.weight(layer) : 0.0; }
  index_t layers_added() const noexcept { return ok_ ? cascade_.layers_added() : 0; }
  /// Rows every prefilled layer holds now.
  index_t held_rows() const noexcept { return ok_ ? cascade_.held_total() : 0; }
  /// The most rows held at once so far: the lower layers' holdings plus the new layer's H N rows
  /// before its eviction (the layer-wise prefill's memory peak, in rows of KV).
  index_t peak_rows() const noexcept { return peak_; }
  const layer_cascade& cascade() const noexcept { return cascade_; }
  const cascade_driver_config& config() const noexcept { return cfg_; }

 private:
  struct ws_layout {
    float* scores = nullptr;
    detail::score_scratch sc;
    workspace cascade;
  };

  static cascade_config cascade_cfg(const cascade_driver_config& c) {
    cascade_config k;
    k.layers = c.model.layers;
    k.heads = c.model.kv_heads;
    k.prompt_length = c.tokens;
    k.prot = detail::recipe_protection(c.rec);
    k.total = c.total;
    k.split = c.split;
    return k;
  }

  static status validate(const char* fn, const cascade_driver_config& c) {
    KVEVICT_TRY(detail::check_model(fn, c.model));
    KVEVICT_TRY(detail::check_capacity(fn, "tokens", c.tokens, c.model.kv_heads));
    KVEVICT_TRY(detail::check_recipe(fn, c.rec));
    if (c.weight != weight_source::lava_entropy && c.weight != weight_source::caller)
      return status::error(errc::invalid_argument, "%s: unknown weight_source value %d", fn, static_cast<int>(c.weight));
    if (c.norm != entropy_norm::log_count && c.norm != entropy_norm::count)
      return status::error(errc::invalid_argument, "%s: unknown entropy_norm value %d", fn, static_cast<int>(c.norm));
    index_t rows = 0;
    bool bk = false;
    detail::row_rules rr;
    KVEVICT_TRY(detail::prompt_queries(fn, c.rec, c.tokens, c.query_rows, &rows, &bk, &rr));
    const auto m = layer_cascade::memory_bytes(cascade_cfg(c));
    if (!m) return m.error();
    return {};
  }

  template <class Backend>
  status carve(Backend be, workspace& ws, ws_layout& w) const {
    const index_t H = cfg_.model.kv_heads, N = cfg_.tokens;
    int slots = 1;
    const auto slot = detail::score_slot_bytes(be, cfg_.rec, cfg_.model.query_heads / H, query_rows_, N,
                                               cfg_.model.head_dim, block_keys_, H, &slots);
    if (!slot) return slot.error();
    // layer_cascade's workspace: the largest selection of a step (docs/budget.md): flattened,
    // select_topk_flat over [H][N] or select_topk over one row of min(total, H N) scores;
    // per_head, select_topk over [H][N]. add_layer checks it against the cascade's own query.
    std::size_t cq = 0;
    if (cfg_.split == cascade_split::flattened) {
      const index_t row = cfg_.total < H * N ? cfg_.total : H * N;
      cq = detail::select_bytes(be, allocator::flattened, H, N);
      const std::size_t one = select_topk_workspace_bytes(be, row);
      cq = one > cq ? one : cq;
    } else {
      cq = select_topk_workspace_bytes(be, N);
    }
    detail::workspace_carver c(ws);
    w.scores = c.take<float>(static_cast<std::size_t>(H * N));
    detail::carve_score_scratch(c, w.sc, *slot, slots, H);
    w.cascade = workspace{c.take<unsigned char>(cq), cq};
    return c.finish("cascade_driver");
  }

  cascade_driver_config cfg_{};
  layer_cascade cascade_{};
  eviction_recorder* rec_ = nullptr;
  detail::byte_range mem_{};
  detail::row_rules rules_{};
  index_t query_rows_ = 0;
  bool block_keys_ = false;
  index_t peak_ = 0;
  bool ok_ = false;
};

}  // namespace kvevict
