// kvevict/drivers/post_fill.hpp: one-shot eviction after the prefill (docs/drivers.md).
//
//   post_fill_driver d;
//   d.init(cfg, memory, post_fill_driver::state_bytes(cfg).value(), &recorder /*optional*/);
//   for l in 0..L-1:  d.add_layer(be, ws, l, layer_kv_l, queries_l [, block_keys_l] [, cake_preference_l]);
//   d.decide(be, ws);                                   // all-layer allocators decide here
//   for l:  compact the engine's layer l with d.kept(l)  // rows of its current cache, ascending
//
// Per-layer allocators (per_head, flattened, adakv) decide inside add_layer: d.ready(l) is true as
// soon as add_layer(l) returns, so an engine may compact layer l before scoring layer l + 1.
// All-layer allocators (lava, cake) need every layer first: their scores, row positions and
// weights are kept in the driver's state until decide().
#pragma once

#include <kvevict/distributed.hpp>
#include <kvevict/drivers/detail/driver_skeleton.hpp>
#include <kvevict/drivers/detail/stages.hpp>

namespace kvevict {

struct post_fill_config : model_sharding {
  model_shape model;
  /// P: the tokens prefilled (the prompt). Every position is < P; a head holds at most P rows.
  index_t tokens = 0;
  /// Rows of the query block for external_block recipes (lookahead tokens, LAQ pseudo queries, a
  /// draft's queries...); 0 otherwise (derived: the window, 1 for TOVA, P for H2O, none for Knorm
  /// and StreamingLLM).
  index_t query_rows = 0;
  recipe rec = recipe::snapkv();
  allocation alloc;
  // Sharding (the base model_sharding: tp, pp, first_layer, model_layers), for this driver:
  // Tensor parallelism (docs/distributed.md): this rank's driver holds model.kv_heads of the
  // layer's model.kv_heads x tp.size() KV heads (head_shard), every rank running the same calls.
  // flattened layers keep tp.size() x this rank's budget sum, adakv layers B x all heads, selected
  // across the ranks exactly as one process would (per_head needs no communicator). lava and cake:
  // alloc.total is the model's total over every rank's heads (L x tp.size() x kv_heads x ...);
  // lava's entropies (lava_layer_entropy, sharded), its layer totals and its flattened selection
  // run across the ranks; cake's preferences (add_layer's weight) must be the same on every rank
  // (the sharded cake_window_preference gives every rank the layer's), its per-head budgets then
  // need no communicator. Empty: one process.
  // Pipeline parallelism (docs/distributed.md): this stage's driver holds model.layers layers, the
  // model's layers [first_layer, first_layer + model.layers) of model_layers (the stages' ranges
  // tile [0, model_layers), e.g. layer_shard), every stage of `pp` running the same calls. Only
  // lava and cake communicate: decide() gathers every stage's layer statistics (lava: entropies,
  // protected and evictable rows; cake: preferences) with gather_layer_values and computes the
  // model's budgets as one process does; per-layer allocators (budgets: this stage's rows) need no
  // communicator. alloc.total is the model's total over all model_layers. Every stage must call
  // decide(), also after one of its add_layer calls failed (decide() then fails on every stage).
  // With tp too (a grid of stages x head shards): `pp` connects the ranks holding the same heads
  // (one per stage), `tp` the ranks of this stage; lava's rows are gathered over `pp`, then summed
  // over `tp`. Empty: one process.
  /// Paged layers (paged_layer_kv): the most pages their pools have (the workspace holds a bitmap
  /// of them for the block-table checks); 0 = ragged layers (layer_kv) only.
  index_t pool_pages = 0;
};

namespace detail {

/// The query block a recipe reads over a cache holding a whole prompt of `tokens` tokens, and what
/// the layer's last rows must be.
inline status prompt_queries(const char* fn, const recipe& r, index_t tokens, index_t given, index_t* rows,
                             bool* block_keys, row_rules* rr) {
  *block_keys = false;
  index_t need = 0;
  switch (r.kind) {
    case recipe_kind::knorm:
    case recipe_kind::streaming_llm: need = 0; break;
    case recipe_kind::h2o:
      need = tokens;
      rr->whole = true;
      break;
    case recipe_kind::tova:
      need = 1;
      rr->tail = 1;
      rr->tail_what = "the last prompt token (TOVA's query)";
      break;
    default:
      if (r.source == query_source::external_block) return detail::external_block_queries(fn, given, rows, block_keys);
      if (r.window > tokens)
        return status::error(errc::invalid_argument, "%s: the recipe's window %lld is longer than the %lld tokens", fn,
                             static_cast<long long>(r.window), static_cast<long long>(tokens));
      need = r.window;
      rr->tail = r.window;
      rr->tail_what = "the observation window's tokens";
  }
  if (given != 0 && given != need)
    return status::error(errc::invalid_argument, "%s: query_rows = %lld but %s reads %lld query rows here", fn,
                         static_cast<long long>(given), recipe_name(r.kind), static_cast<long long>(need));
  *rows = need;
  return {};
}

}  // namespace detail

/// One-shot (post-fill) eviction, see the file comment and docs/drivers.md.
///
/// Budgets (the recipe's {n_sink, n_recent} are the protected tokens; W_h = protected_count of head
/// h's rows):
///   per_head    head (l, h) keeps budgets(l, h), in [W_h, rows of the head]
///   flattened   layer l keeps sum_h budgets(l, h), in [sum W_h, rows of the layer]
///   adakv       layer l keeps B_l H with AdaKV's floors (adakv_budgets), B_l = row sum / H
///   lava        the model keeps `total`: layer l keeps sum_h W_h + apportion(total - sum W, e, caps)_l,
///               e_l = lava_layer_entropy of its scores, caps_l = its evictable rows (for heads of
///               equal length this is lava_layer_budgets exactly); flattened within the layer
///   cake        every head must hold the whole prompt; per-head budgets cake_budgets(preferences,
///               total / (L H), P) (the preferences are add_layer's `weight`)
/// Recording: the rows a layer drops are marked evicted at step P (the prompt length).
///
/// add_layer(be, ws, layer, kv, queries [, block_keys] [, weight]): layer `layer` (layers in order
/// 0..L-1) was prefilled: kv is its cache (every head's rows, positions < P), queries the recipe's
/// query block [H_q][rows][d] (the last w prompt tokens' queries for window recipes, every prompt
/// query for H2O, the last one for TOVA, the external block for external_block recipes, an empty
/// view for Knorm / StreamingLLM), block_keys the external block's own keys [H][rows][d] or an
/// empty view, weight the layer's CAKE preference (cake allocator only;
/// cake_preference(cake_layer_stats(window attention))). add_layer_scores(be, ws, layer, kv,
/// scores [, weight]): the same with the engine's scores (no query rows needed in the cache).
/// Per-layer allocators select there (ready(layer) afterwards); lava / cake keep the scores.
/// Workspace: two-phase (a query, ws.data == nullptr, only sets ws.bytes: workspace_bytes(be)).
/// Errors (nothing changes): not initialised; layer out of order or past L; already decided; the
/// layer's layout (heads, dim, offsets, lens, null pointers), key and value row counts that differ,
/// more than P rows in a head, positions not ascending or outside [0, P); the window's rows (or
/// TOVA's last token, or H2O's whole prompt) missing from a head; queries or block keys of the
/// wrong shape; scores of the wrong shape or NaN; a cake preference NaN, infinite or negative;
/// budgets above a head's rows or below its protected tokens; scores a lava entropy refuses;
/// workspace too small or overlapping the state; the recorder's errors (a row already evicted).
class post_fill_driver : public detail::prefill_driver_skeleton<post_fill_driver, post_fill_config>,
                         private detail::layer_store {
  friend class detail::driver_skeleton<post_fill_driver, post_fill_config>;
  friend class detail::prefill_driver_skeleton<post_fill_driver, post_fill_config>;

 public:
  static constexpr const char* name = "post_fill_driver";

  // state_bytes(cfg), workspace_bytes(be): detail::driver_skeleton. add_layer, add_layer_scores
  // (documented above): detail::prefill_driver_skeleton; with a tensor-parallel communicator a call
  // failing on one rank fails on every rank.

  // init(cfg, memory, bytes, recorder): detail::driver_skeleton, ending in attach() below.
  // Binds the driver to `memory` (>= state_bytes(cfg), any alignment), copies the budgets and
  // resets it. The recorder (optional; layers x kv_heads, capacity >= P) must outlive the driver.
  // Errors: zero layers / heads, query heads not a multiple of KV heads, head_dim <= 0, tokens
  // outside [1, INT32_MAX / H]; an invalid recipe; query_rows missing for or given to a recipe
  // that does not take it; a window longer than the prompt; unknown allocator; per_head budgets
  // below the protected tokens or above the prompt, layer totals below the protected tokens
  // (flattened, adakv) or not a multiple of H (adakv); budgets not [L][H]; lava / cake total
  // negative or above L H P, cake total not a multiple of L H or its per-head budget below the
  // protected tokens; adakv alpha outside [0, 1]; first_layer / model_layers not
  // holding this driver's layers (or a stage without a pp communicator); recorder shape; memory
  // null or too small.

  /// After every layer was added: the all-layer allocators compute the budgets and select every
  /// layer (ready(l) afterwards); the per-layer ones have nothing left to do. Workspace: as
  /// add_layer's. Errors: not initialised; layers missing; called twice; lava: total below the
  /// layers' protected rows or above their rows; cake: the allocator's errors (cake_budgets);
  /// workspace too small; the recorder's errors.
  template <class Backend>
  status decide(Backend be, workspace& ws) { return decide_call(be, ws, added_, ""); }

 private:
  /// decide() after detail::prefill_driver_skeleton::decide_call's opening (the call opened, every
  /// layer added; st: the status so far).
  template <class Backend>
  status decide_layers(const char* fn, Backend be, workspace& ws, detail::call_scratch& w, status st) {
    const index_t L = cfg_.model.layers, H = cfg_.model.kv_heads;
    if (st.ok() && decided_)
      st = status::error(errc::invalid_argument, "%s: decide() already ran; init() the driver again", fn);
    if (st.ok()) st = check_ws(fn, ws);
    // tensor / pipeline parallelism, lava / cake: every rank agrees first (a rank failing here
    // fails them all)
    if (ok_ && all_layer_ && cfg_.tp.size() > 1) st = agree_layer_weights(fn, st);
    if (ok_ && all_layer_ && pipelined(cfg_)) st = agree_stages(fn, st);
    KVEVICT_TRY(st);
    if (!all_layer_) {
      decided_ = true;
      return {};
    }
    const protection prot = detail::recipe_protection(cfg_.rec);
    // the model's layers: this driver's (one stage) or every stage's, gathered (pipeline)
    const index_t ML = model_layers(cfg_), f = cfg_.first_layer;
    const detail::stage_span stage = stage_of(cfg_);
    detail::stage_span::scratch g;
    if (pipelined(cfg_)) KVEVICT_TRY(stage.carve(name, w.sel, H, g));
    detail::held_layers whole = held_;  // with the weights of all ML layers
    if (pipelined(cfg_)) {
      KVEVICT_TRY(stage.gather(held_.weight, g.weights, g));
      whole.weight = g.weights;
    }
    if (cfg_.alloc.kind == allocator::lava) {
      // layer totals: protected rows + apportion(total - protected, entropies, evictable rows)
      index_t prot_sum = 0, rows = 0;
      held_.protected_totals(L, prot, w.caps + f, w.totals + f, &prot_sum, &rows);
      if (pipelined(cfg_)) {  // every stage's protected and evictable rows
        KVEVICT_TRY(stage.gather_rows(w.caps, w.totals, g));
        detail::held_layers::row_sums(ML, w.caps, w.totals, &prot_sum, &rows);
      }
      if (sharded(cfg_))  // the model's layers' protected and evictable rows over every rank's heads
        KVEVICT_TRY(detail::held_layers::sum_over_ranks(cfg_.tp, ML, w.caps, w.totals, &prot_sum, &rows));
      if (cfg_.alloc.total < prot_sum || cfg_.alloc.total > rows)
        return status::error(errc::invalid_argument,
                             "%s: lava total %lld is outside [%lld, %lld] (the layers' protected rows, their rows)", fn,
                             static_cast<long long>(cfg_.alloc.total), static_cast<long long>(prot_sum),
                             static_cast<long long>(rows));
      KVEVICT_TRY(whole.share_lava_totals(ML, cfg_.alloc.total - prot_sum, w.caps, w.shares, w.totals));
    } else {  // cake: every head holds the whole prompt (checked by add_layer)
      std::int32_t* out = pipelined(cfg_) ? g.budgets : budgets_;  // pipeline: the model's [ML][H], then mine
      KVEVICT_TRY(cake_budgets(whole.weight, cfg_.alloc.total / (ML * H * tp_ranks(cfg_)), cfg_.tokens, prot,
                               detail::rows_view(out, ML, H, H)));
      if (out != budgets_) std::copy(out + f * H, out + (f + L) * H, budgets_);
    }
    const bool lava = cfg_.alloc.kind == allocator::lava;
    for (index_t l = 0; l < L; ++l) {
      KVEVICT_TRY(select_held(be, w, lava ? allocator::lava : allocator::per_head, cfg_.tp, sharded(cfg_), l,
                              lava ? w.totals[f + l] : 0, kept_pos_ + kept_off_[l], rec_, cfg_.tokens));
      ready_[l] = 1;
    }
    decided_ = true;
    return {};
  }

 public:

  /// Is layer l's kept list available? (per-layer allocators: after add_layer(l); lava, cake:
  /// after decide()).
  bool ready(index_t layer) const noexcept { return ok_ && layer >= 0 && layer < cfg_.model.layers && ready_[layer]; }
  /// The rows layer l keeps, per head ascending (indices into the rows of the cache given to
  /// add_layer): compact_layer(be, keys_l, values_l, positions_l, kept(l)). Empty until ready(l).
  ragged_positions kept(index_t layer) const noexcept { return ready(layer) ? kept(layer, true) : ragged_positions{}; }
  /// Tokens layer l keeps over all its heads (0 until ready).
  index_t layer_total(index_t layer) const noexcept {
    return ready(layer) ? kept_cu_[layer * (cfg_.model.kv_heads + 1) + cfg_.model.kv_heads] : 0;
  }
  /// lava: layer l's normalised entropy; cake: its preference; others 0.
  double layer_weight(index_t layer) const noexcept {
    return ok_ && layer >= 0 && layer < added_ ? held_.weight[layer] : 0.0;
  }
  index_t layers_added() const noexcept { return added_; }
  bool decided() const noexcept { return decided_; }

 private:
  /// init's last step (detail::driver_skeleton::init, after the configuration, recorder and memory
  /// checks): the state pieces placed at m.base and reset.
  status attach(const char* /*fn*/, const post_fill_config& cfg, const detail::state_memory& m) {
    const plan_t p = plan(cfg);
    cfg_.alloc.budgets = {};
    const index_t L = cfg.model.layers, H = cfg.model.kv_heads;
    bind_store(m.base, p, L, H, cfg.tokens,
               [&](index_t l, index_t h) { return has_matrix(cfg.alloc.kind) ? cfg.alloc.budgets(l, h) : 0; });
    kept_off_ = reinterpret_cast<index_t*>(m.base + p.kept_off);
    for (index_t l = 0; l <= L; ++l) kept_off_[l] = p.kept_off_values(cfg, l);
    all_layer_ = p.all_layer;
    query_rows_ = p.query_rows;
    block_keys_ = p.block_keys;
    rules_ = p.rules;
    added_ = 0;
    decided_ = false;
    return {};
  }

  struct plan_t : store_plan {
    std::size_t kept_off = 0;
    bool all_layer = false, block_keys = false;
    index_t query_rows = 0;
    detail::row_rules rules;
    // kept storage per layer: what the allocator can keep there at most
    index_t kept_off_values(const post_fill_config& c, index_t l) const {
      const index_t H = c.model.kv_heads, C = c.tokens;
      index_t off = 0;
      for (index_t j = 0; j < l; ++j) {
        index_t cap = H * C;
        if (has_matrix(c.alloc.kind) && !sharded(c)) {
          index_t s = 0;
          for (index_t h = 0; h < H; ++h) s += c.alloc.budgets(j, h);
          cap = s;
        }
        off += cap;
      }
      return off;
    }
  };

  /// Layers selected across the tensor-parallel ranks (a rank may then keep up to all its rows).
  static bool sharded(const post_fill_config& c) {
    return c.tp.size() > 1 &&
           (c.alloc.kind == allocator::flattened || c.alloc.kind == allocator::adakv || c.alloc.kind == allocator::lava);
  }
  /// Tensor-parallel ranks (1 without a communicator): the model has tp_ranks x kv_heads heads.
  static index_t tp_ranks(const post_fill_config& c) { return c.tp.size() > 1 ? c.tp.size() : 1; }
  /// The model's layers (this driver holds model.layers of them).
  static index_t model_layers(const post_fill_config& c) {
    return c.model_layers > 0 ? c.model_layers : c.model.layers;
  }
  /// All-layer allocators over pipeline stages: decide() gathers every stage's layer statistics.
  static bool pipelined(const post_fill_config& c) {
    return c.pp.size() > 1 && (c.alloc.kind == allocator::lava || c.alloc.kind == allocator::cake);
  }

  static detail::stage_span stage_of(const post_fill_config& c) {
    return {c.pp, c.first_layer, c.model.layers, model_layers(c)};
  }
  /// Pipeline parallelism, decide() of lava / cake: the stages agree on the allocator, the total and
  /// the model's shape, or every stage fails (a stage whose add_layer failed fails them all).
  status agree_stages(const char* fn, const status& local) const {
    detail::config_line config;
    config.print("%s total %lld, %lld model layers x %lld heads, %lld tokens", allocator_name(cfg_.alloc.kind),
                 static_cast<long long>(cfg_.alloc.total), static_cast<long long>(model_layers(cfg_)),
                 static_cast<long long>(cfg_.model.kv_heads), static_cast<long long>(cfg_.tokens));
    return stage_of(cfg_).agree(fn, local, config);
  }
  /// Collective calls of a sharded layer: lava's entropy agrees on no sums, the selections on two.
  int agree_sums() const { return cfg_.alloc.kind == allocator::lava ? 0 : 2; }

  static status validate(const char* fn, const post_fill_config& c) {
    KVEVICT_TRY(detail::check_model(fn, c.model));
    const index_t L = c.model.layers, H = c.model.kv_heads;
    KVEVICT_TRY(detail::check_capacity(fn, "tokens", c.tokens, H));
    KVEVICT_TRY(detail::check_recipe(fn, c.rec));
    KVEVICT_TRY(detail::check_allocation_options(fn, c.alloc));
    const index_t ML = model_layers(c);
    KVEVICT_TRY(detail::stage_span::check(fn, c.pp, c.first_layer, L, c.model_layers < 0 ? c.model_layers : ML));
    KVEVICT_TRY(detail::check_pool_pages(fn, c.pool_pages));
    index_t rows = 0;
    bool bk = false;
    detail::row_rules rr;
    KVEVICT_TRY(detail::prompt_queries(fn, c.rec, c.tokens, c.query_rows, &rows, &bk, &rr));
    const index_t W = protected_count(c.tokens, c.rec.n_sink, c.rec.n_recent);
    if (has_matrix(c.alloc.kind)) return detail::check_budget_matrix(fn, c.alloc, c.model, W, c.tokens);
    index_t top = 0;
    const index_t LH = ML * H * tp_ranks(c);  // every rank's heads
    if (!detail::checked_mul(LH, c.tokens, top) || c.alloc.total < 0 || c.alloc.total > top)
      return status::error(errc::invalid_argument, "%s: %s total %lld is outside [0, %lld] (L H P)", fn,
                           allocator_name(c.alloc.kind), static_cast<long long>(c.alloc.total),
                           static_cast<long long>(top));
    if (c.alloc.kind == allocator::cake) {
      if (c.alloc.total % LH != 0)
        return status::error(errc::invalid_argument,
                             "%s: cake total %lld is not a multiple of the %lld heads of the model (CAKE reshapes a "
                             "per-head budget)",
                             fn, static_cast<long long>(c.alloc.total), static_cast<long long>(LH));
      KVEVICT_TRY(check_budget(fn, c.alloc.total / LH, c.tokens, c.rec.n_sink, c.rec.n_recent));
    }
    return {};
  }

  static plan_t plan(const post_fill_config& c) {
    plan_t p;
    p.all_layer = !has_matrix(c.alloc.kind);
    (void)detail::prompt_queries("", c.rec, c.tokens, c.query_rows, &p.query_rows, &p.block_keys, &p.rules);
    p.rules.tokens = c.tokens;
    p.rules.capacity = c.tokens;
    if (c.alloc.kind == allocator::cake) p.rules.whole = true;  // cake_budgets shares one prompt length
    p.take_store(c.model.layers, c.model.kv_heads, c.tokens, p.kept_off_values(c, c.model.layers), p.all_layer);
    p.kept_off = p.layout.take(static_cast<std::size_t>(c.model.layers + 1) * sizeof(index_t));
    return p;
  }

  template <class Backend>
  status carve(Backend be, workspace& ws, detail::call_scratch& w) const {
    detail::call_scratch_shape s = scratch_shape(cfg_.tokens);
    s.scores = !all_layer_;
    KVEVICT_TRY(fit_score_slots(be, cfg_.rec, query_rows_, block_keys_, s));
    s.sel = detail::driver_select_bytes(be, sharded(cfg_), cfg_.alloc.kind, all_layer_ ? allocator::lava : cfg_.alloc.kind,
                                        s.H, s.C, cfg_.tp.size());
    if (pipelined(cfg_)) {  // decide()'s gathers, before its selections
      const auto bytes = stage_of(cfg_).workspace_bytes(name, cfg_.model.kv_heads);
      if (!bytes) return bytes.error();
      s.sel = std::max(s.sel, *bytes);
    }
    s.layers = model_layers(cfg_);
    s.pool_pages = cfg_.pool_pages;
    return detail::carve_call_scratch(name, ws, s, w);
  }

  /// Where layer l's scores go: the state (all-layer allocators keep them) or the workspace.
  float* scores_of(index_t layer, const detail::call_scratch& w) const {
    return all_layer_ ? held_.layer_scores(layer) : w.scores;
  }

  // the hooks of prefill_driver_skeleton's add_layer_queries / add_layer_given_scores
  index_t query_rows_now() const { return query_rows_; }
  bool block_keys_now() const { return block_keys_; }
  const recipe& score_recipe() const { return cfg_.rec; }
  index_t score_columns() const { return cfg_.tokens; }

  /// The call and the layer: not decided, in order, its layout and rows (the query path: the
  /// query rows must be in it; the scores path: only cake needs every head to hold the prompt).
  template <class KV>
  status check_layer_call(const char* fn, index_t layer, const KV& kv, bool by_scores) const {
    if (decided_) return status::error(errc::invalid_argument, "%s: decide() already ran; init() the driver again", fn);
    KVEVICT_TRY(check_order(fn, layer, added_, cfg_.model.layers));
    detail::row_rules rr = rules_;
    if (by_scores) {
      rr = {};
      rr.tokens = rr.capacity = cfg_.tokens;
      rr.whole = cfg_.alloc.kind == allocator::cake;
    }
    return detail::check_layer(fn, layer, kv, cfg_.model.kv_heads, cfg_.model.head_dim, rr);
  }

  /// The workspace, the cake preference and (per-layer allocators) the layer's budget.
  status check_call_rest(const char* fn, const workspace& ws, index_t l, const std::int32_t* lens,
                         double weight) const {
    KVEVICT_TRY(check_ws(fn, ws));
    if (cfg_.alloc.kind == allocator::cake) KVEVICT_TRY(detail::check_layer_weight(fn, l, weight, "CAKE preference"));
    return all_layer_ ? status{} : check_budget_fits(fn, l, lens);
  }

  /// A scored layer (scores: scores_of(layer), protected): all-layer allocators keep it until
  /// decide(); per-layer ones select, record and answer.
  template <class Backend, class KV>
  status add_scored(Backend be, detail::call_scratch& w, index_t layer, const KV& kv, const float* scores,
                    double weight) {
    const index_t H = cfg_.model.kv_heads, C = cfg_.tokens;
    const auto sv = detail::rows_view<const float>(scores, H, C, C);
    const std::int32_t* lens = detail::layer_lens(kv);
    if (all_layer_) {
      double e = weight;
      if (cfg_.alloc.kind == allocator::lava)
        KVEVICT_TRY(detail::driver_layer_entropy(be, w.sel, cfg_.tp, sharded(cfg_), &in_collective_, sv, lens,
                                                 detail::recipe_protection(cfg_.rec), cfg_.alloc.lava_norm, &e));
      held_.store(layer, kv, e);
      added_ = layer + 1;
      return {};
    }
    for (index_t h = 0; h < H; ++h) held_.lens[layer * H + h] = lens[h];
    KVEVICT_TRY(select_one(be, w, layer, sv, lens));
    KVEVICT_TRY(detail::record_dropped(rec_, layer, kv, kept(layer, true), cfg_.tokens, w.evicted, w.evicted_cu));
    ready_[layer] = 1;
    added_ = layer + 1;
    return {};
  }

  /// Per-layer allocators: the layer's budget against what it holds.
  status check_budget_fits(const char* fn, index_t l, const std::int32_t* lens) const {
    const index_t H = cfg_.model.kv_heads;
    index_t sum = 0, held = 0, prot = 0;
    for (index_t h = 0; h < H; ++h) {
      const index_t b = budgets_[l * H + h], W = protected_count(lens[h], cfg_.rec.n_sink, cfg_.rec.n_recent);
      sum += b;
      held += lens[h];
      prot += W;
      if (cfg_.alloc.kind == allocator::per_head && (b > lens[h] || b < W))
        return status::error(errc::invalid_argument,
                             "%s: budgets[%lld][%lld] = %lld is outside [%lld, %d] (the head's protected tokens, its rows)",
                             fn, static_cast<long long>(l), static_cast<long long>(h), static_cast<long long>(b),
                             static_cast<long long>(W), lens[h]);
    }
    if (cfg_.alloc.kind != allocator::per_head && (sum > held || sum < prot))
      return status::error(errc::invalid_argument,
                           "%s: layer %lld keeps %lld tokens, outside [%lld, %lld] (its protected tokens, its rows)", fn,
                           static_cast<long long>(l), static_cast<long long>(sum), static_cast<long long>(prot),
                           static_cast<long long>(held));
    return {};
  }

  template <class Backend>
  status select_one(Backend be, detail::call_scratch& w, index_t l, const matrix_view<const float>& sv, const std::int32_t* lens) {
    const index_t H = cfg_.model.kv_heads;
    index_t total = 0;
    for (index_t h = 0; h < H; ++h) total += budgets_[l * H + h];
    adakv_options ao;
    ao.alpha = cfg_.alloc.adakv_alpha;
    ao.floor = cfg_.alloc.floor_rule;
    ao.prot = detail::recipe_protection(cfg_.rec);
    if (sharded(cfg_)) {  // every rank joins the selection (no keep-everything shortcut: it is local)
      in_collective_ = true;
      comm_ref tp = cfg_.tp;
      if (cfg_.alloc.kind == allocator::adakv)
        return adakv_budgets(be, w.sel, tp, sv, lens, total / H, ao, kept_cu_ + l * (H + 1), kept_pos_ + kept_off_[l]);
      return select_topk_flat(be, w.sel, tp, sv, lens, total * tp.size(), nullptr, kept_cu_ + l * (H + 1),
                              kept_pos_ + kept_off_[l]);
    }
    return detail::select_layer(be, w.sel, cfg_.alloc.kind, sv, lens, budgets_ + l * H, total, ao,
                                kept_cu_ + l * (H + 1), kept_pos_ + kept_off_[l]);
  }

  /// Tensor parallelism, decide() of lava / cake: the ranks agree on the total, the shapes and the
  /// layer weights (lava's entropies are the same on every rank by construction; cake's preferences
  /// are the engine's, which must give every rank the same ones), or every rank fails.
  status agree_layer_weights(const char* fn, const status& local) const {
    const index_t L = cfg_.model.layers;
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the weights' bytes
    for (index_t l = 0; local.ok() && l < added_; ++l) {
      unsigned char b[sizeof(double)];
      std::memcpy(b, &held_.weight[l], sizeof b);
      for (unsigned char x : b) h = (h ^ x) * 1099511628211ull;
    }
    detail::config_line config;
    config.print("%s total %lld, %lld layers x %lld heads per rank, layer weights hash %016llx",
                 allocator_name(cfg_.alloc.kind), static_cast<long long>(cfg_.alloc.total),
                 static_cast<long long>(L), static_cast<long long>(cfg_.model.kv_heads),
                 static_cast<unsigned long long>(h));
    comm_ref tp = cfg_.tp;
    return detail::agree(tp, fn, local, config, nullptr, 0);
  }

  /// Tensor parallelism: a call that failed on this rank before its layer's selection still joins
  /// the selection's agreement, so the other ranks return the same error instead of waiting. cake
  /// (no collective of its own in add_layer): every layer's call agrees on its status and its
  /// preference, which every rank must pass the same.
  status joined(const char* fn, const workspace& ws, const status& st, index_t layer, double weight) {
    if (ws.is_query() || cfg_.tp.size() <= 1) return st;
    if (cfg_.alloc.kind == allocator::cake) {
      detail::config_line config;
      config.print("cake layer %lld, preference %.17g", static_cast<long long>(layer), weight);
      comm_ref tp = cfg_.tp;
      return detail::agree(tp, fn, st, config, nullptr, 0);
    }
    if (st.ok() || !sharded(cfg_) || in_collective_) return st;
    return detail::join_failed_call(cfg_.tp, fn, st, agree_sums());
  }

  ragged_positions kept(index_t layer, bool) const noexcept {
    const index_t H = cfg_.model.kv_heads;
    return {kept_pos_ + kept_off_[layer], kept_cu_ + layer * (H + 1), H};
  }

  index_t* kept_off_ = nullptr;
  detail::row_rules rules_{};
  index_t query_rows_ = 0;
  bool block_keys_ = false;
  bool all_layer_ = false;
  index_t added_ = 0;
  bool decided_ = false;
  bool in_collective_ = false;  // this call reached its layer's sharded selection
};

}  // namespace kvevict
