// kvevict/drivers/cascade_driver.hpp: layer-by-layer prefill with cascading budgets (LAVa Algorithm 2,
// CAKE's cascading cache management), on top of budget/layer_cascade.hpp's layer_cascade.
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

#include <kvevict/drivers/detail/driver_skeleton.hpp>
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
  /// Paged layers (paged_layer_kv): the most pages their pools have (the workspace holds a bitmap
  /// of them for the block-table checks); 0 = ragged layers (layer_kv) only.
  index_t pool_pages = 0;
  /// Tensor parallelism (docs/distributed.md "The cascade"): this rank's driver holds model.kv_heads
  /// of every layer's model.kv_heads x tp.size() KV heads (head_shard), every rank making the same
  /// calls; `total` is the model's over every rank's heads. LAVa's entropies (the sharded
  /// lava_layer_entropy) and the flattened selections of every step run across the ranks; CAKE's
  /// weights (add_layer's) must be the same on every rank (the sharded cake_window_preference).
  /// Each rank's layers then hold exactly its heads' rows of the single-process cascade's. With
  /// pipeline stages too (a grid): `tp` connects this stage's ranks, add_remote_layer as below.
  /// Empty: one process.
  comm_ref tp;
};

/// Layer-by-layer prefill with cascading recompression (see the file comment, docs/drivers.md and
/// layer_cascade in docs/budget.md for the budget rule and its invariant). The driver scores the
/// new layer with the recipe (one recipe_scores call per KV head), computes its weight, and runs
/// layer_cascade::add_layer; kept / changed / positions are the cascade's. Recording: every
/// eviction happens at step N (the prompt is processed at once, layer by layer): after each step
/// the new layer and every layer whose holdings changed are recorded with retain_only.
///
/// add_layer(be, ws, layer, kv, queries [, block_keys] [, weight]) / add_layer_scores(be, ws, layer,
/// kv, scores [, weight]): layer `layer` (in order) was prefilled over the whole prompt: kv holds, in
/// every head, rows 0..N-1 at positions 0..N-1; queries / block_keys as post_fill_driver's, or the
/// engine's scores [H][>= N]; weight: the layer's CAKE preference when cfg.weight == caller (ignored
/// otherwise). Afterwards kept(j) / changed(j) tell the engine what to compact (j <= layer).
/// Errors (nothing changes): not initialised; layer out of order or past L; a head not holding the
/// whole prompt; the layer's layout, positions, queries, block keys or scores (as post-fill); a
/// weight NaN, infinite or negative; unprotected scores the entropy refuses; workspace too small or
/// overlapping the state; the recorder's errors.
class cascade_driver : public detail::prefill_driver_skeleton<cascade_driver, cascade_driver_config> {
  friend class detail::driver_skeleton<cascade_driver, cascade_driver_config>;
  friend class detail::prefill_driver_skeleton<cascade_driver, cascade_driver_config>;

 public:
  static constexpr const char* name = "cascade_driver";

  // state_bytes(cfg) (layer_cascade::state_bytes), workspace_bytes(be), add_layer, add_layer_scores
  // (documented above): detail::prefill_driver_skeleton; with a tensor-parallel communicator a call
  // failing on one rank before the step fails on every rank.

  // init(cfg, memory, bytes, recorder): detail::driver_skeleton, ending in attach() below.
  // init's errors: as post_fill_driver's model / recipe / query errors; the cascade's configuration
  // errors (total below the protected tokens or above L H N, per_head total not a multiple of H);
  // unknown weight source or entropy norm; recorder shape; memory null or too small.

  /// Pipeline parallelism (docs/distributed.md): layer `layer` (in order) is prefilled by another
  /// stage, whose weight (its layer_weight()) reached this one (gather_layer_values). It takes part
  /// in the budget rule and holds nothing here; this stage's layers that shrink are re-selected and
  /// recorded as in add_layer (changed(j) / kept(j) afterwards). A stage holding layers [a, b) adds
  /// [0, a) remotely, its own layers with add_layer, then [b, L) remotely once their weights are
  /// known: its layers end holding what one process holds.
  /// Errors (nothing changes): not initialised; layer out of order or past L; weight NaN, infinite
  /// or negative; workspace too small or overlapping the state; the recorder's errors. With `tp`:
  /// every rank of the stage makes the call with the same weight, and a rank failing before the
  /// step fails every rank (the recorder's errors stay this rank's).
  /// On cuda_t: errc::unsupported (detail::drivers_on_cuda), nothing changes.
  template <class Backend>
  status add_remote_layer(Backend be, workspace& ws, index_t layer, double weight) {
    constexpr const char* fn = "cascade_driver::add_remote_layer";
    return detail::on_host(fn, be, [&](auto host) -> status {
      in_collective_ = false;
      detail::call_scratch w;
      const auto local = [&]() -> status {
        KVEVICT_TRY(open_call(fn, host, ws, w));
        if (ws.is_query()) return {};
        KVEVICT_TRY(check_order(fn, layer, cascade_.layers_added(), cfg_.model.layers));
        KVEVICT_TRY(check_ws(fn, ws));
        return detail::check_layer_weight(fn, layer, weight, "weight");
      };
      const status st = local();
      if (!st.ok() || ws.is_query()) return joined(fn, ws, st, layer, weight);
      if (sharded()) {
        in_collective_ = true;
        comm_ref tp = cfg_.tp;
        KVEVICT_TRY(cascade_.add_remote_layer(host, w.sel, tp, layer, weight));
      } else {
        KVEVICT_TRY(cascade_.add_remote_layer(host, w.sel, layer, weight));
      }
      return record_changed(layer);
    });
  }

  /// The cascade's answers (budget/layer_cascade.hpp): the new layer's kept rows are prompt positions
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

 private:
  /// init's last step (detail::driver_skeleton::init, after the configuration, recorder and memory
  /// checks): the state pieces placed at m.base and reset.
  status attach(const char* fn, const cascade_driver_config& cfg, const detail::state_memory& m) {
    KVEVICT_TRY(cascade_.init(cascade_cfg(cfg), m.memory, m.bytes));
    bool bk = false;
    rules_ = {};
    (void)detail::prompt_queries(fn, cfg.rec, cfg.tokens, cfg.query_rows, &query_rows_, &bk, &rules_);
    block_keys_ = bk;
    rules_.tokens = cfg.tokens;
    rules_.capacity = cfg.tokens;
    rules_.whole = true;
    peak_ = 0;
    return {};
  }

  static cascade_config cascade_cfg(const cascade_driver_config& c) {
    cascade_config k;
    k.layers = c.model.layers;
    k.heads = c.model.kv_heads;
    k.prompt_length = c.tokens;
    k.prot = detail::recipe_protection(c.rec);
    k.total = c.total;
    k.split = c.split;
    k.ranks = c.tp.size() > 1 ? c.tp.size() : 1;
    return k;
  }

  static status validate(const char* fn, const cascade_driver_config& c) {
    KVEVICT_TRY(detail::check_model(fn, c.model));
    KVEVICT_TRY(detail::check_capacity(fn, "tokens", c.tokens, c.model.kv_heads));
    KVEVICT_TRY(detail::check_recipe(fn, c.rec));
    KVEVICT_TRY(detail::check_pool_pages(fn, c.pool_pages));
    if (c.weight != weight_source::lava_entropy && c.weight != weight_source::caller)
      return status::error(errc::invalid_argument, "%s: unknown weight_source value %d", fn, static_cast<int>(c.weight));
    if (c.norm != entropy_norm::log_count && c.norm != entropy_norm::count)
      return status::error(errc::invalid_argument, "%s: unknown entropy_norm value %d", fn, static_cast<int>(c.norm));
    index_t rows = 0;
    bool bk = false;
    detail::row_rules rr;
    KVEVICT_TRY(detail::prompt_queries(fn, c.rec, c.tokens, c.query_rows, &rows, &bk, &rr));
    const auto m = layer_cascade::state_bytes(cascade_cfg(c));
    if (!m) return m.error();
    return {};
  }

  static std::size_t plan_bytes(const cascade_driver_config& c) { return *layer_cascade::state_bytes(cascade_cfg(c)); }

  template <class Backend>
  status carve(Backend be, workspace& ws, detail::call_scratch& w) const {
    detail::call_scratch_shape s = scratch_shape(cfg_.tokens);
    s.recording = false;  // the cascade records with retain_only
    KVEVICT_TRY(fit_score_slots(be, cfg_.rec, query_rows_, block_keys_, s));
    const auto cq = cascade_.workspace_bytes(be);
    if (!cq) return cq.error();
    s.sel = *cq;
    if (sharded() && cfg_.weight == weight_source::lava_entropy)  // the sharded entropy's records
      s.sel = std::max(s.sel, sharded_lava_entropy_workspace_bytes(cfg_.model.kv_heads * cfg_.tp.size()));
    s.pool_pages = cfg_.pool_pages;
    return detail::carve_call_scratch(name, ws, s, w);
  }

  // the hooks of prefill_driver_skeleton's add_layer_queries / add_layer_given_scores
  index_t query_rows_now() const { return query_rows_; }
  bool block_keys_now() const { return block_keys_; }
  const recipe& score_recipe() const { return cfg_.rec; }
  index_t score_columns() const { return cfg_.tokens; }
  float* scores_of(index_t, const detail::call_scratch& w) const { return w.scores; }

  /// In order, the layer's layout, every head holding the whole prompt (and the query path's rows).
  template <class KV>
  status check_layer_call(const char* fn, index_t layer, const KV& kv, bool) const {
    KVEVICT_TRY(check_order(fn, layer, cascade_.layers_added(), cfg_.model.layers));
    return detail::check_layer(fn, layer, kv, cfg_.model.kv_heads, cfg_.model.head_dim, rules_);
  }

  status check_call_rest(const char* fn, const workspace& ws, index_t layer, const std::int32_t*, double weight) const {
    KVEVICT_TRY(check_ws(fn, ws));
    return cfg_.weight == weight_source::caller ? detail::check_layer_weight(fn, layer, weight, "weight") : status{};
  }

  /// A scored layer (scores: w.scores, protected): its weight, the cascade's step, the recording.
  template <class Backend, class KV>
  status add_scored(Backend be, detail::call_scratch& w, index_t layer, const KV&, const float* scores, double weight) {
    const index_t H = cfg_.model.kv_heads, N = cfg_.tokens;
    const auto sv = detail::rows_view<const float>(scores, H, N, N);
    double e = weight;
    if (sharded()) in_collective_ = true;  // from here every rank makes the same collectives
    if (cfg_.weight == weight_source::lava_entropy)
      KVEVICT_TRY(detail::driver_layer_entropy(be, w.sel, cfg_.tp, sharded(), &in_collective_, sv, nullptr,
                                               detail::recipe_protection(cfg_.rec), cfg_.norm, &e));
    const index_t before = cascade_.held_total();
    if (sharded()) {
      comm_ref tp = cfg_.tp;
      KVEVICT_TRY(cascade_.add_layer(be, w.sel, tp, layer, sv, e));
    } else {
      KVEVICT_TRY(cascade_.add_layer(be, w.sel, layer, sv, e));
    }
    if (before + H * N > peak_) peak_ = before + H * N;
    return record_changed(layer);
  }

  /// Records every layer <= `layer` whose holdings the last step changed (retain_only at step N).
  status record_changed(index_t layer) {
    if (rec_ != nullptr)
      for (index_t j = 0; j <= layer; ++j)
        if (cascade_.changed(j)) KVEVICT_TRY(rec_->retain_only(j, cascade_.positions(j), cfg_.tokens));
    return {};
  }

  /// Tensor parallelism: the calls run across the ranks.
  bool sharded() const noexcept { return cfg_.tp.size() > 1; }

  /// Tensor parallelism: a call that failed on this rank before its first collective (the sharded
  /// entropy's or the cascade's agreement, both with no sums) still joins it, so the other ranks
  /// return the same error instead of waiting.
  status joined(const char* fn, const workspace& ws, const status& st, index_t /*layer*/, double /*weight*/) const {
    if (ws.is_query() || st.ok() || !ok_ || !sharded() || in_collective_) return st;
    return detail::join_failed_call(cfg_.tp, fn, st, 0);
  }

  layer_cascade cascade_{};
  bool in_collective_ = false;  // this call reached its first collective
  detail::row_rules rules_{};
  index_t query_rows_ = 0;
  bool block_keys_ = false;
  index_t peak_ = 0;
};

}  // namespace kvevict
