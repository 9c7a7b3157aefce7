// kvevict/drivers/decode.hpp: decode-time eviction back to a budget every `interval` steps
// (docs/drivers.md).
//
//   decode_driver d;
//   d.init(cfg, memory, decode_driver::state_bytes(cfg).value(), &recorder /*optional*/);
//   for l: d.begin(l, layer_kv_l, tokens_so_far);       // after the prefill (and any post-fill eviction)
//   per decoded token, per layer l, after the engine appended the token's row to layer l:
//     d.step(be, ws, l, layer_kv_l, queries_l [, block_keys_l]);
//     if (d.evicted(l)) compact layer l with d.kept(l);
//
// The queries a step needs (queries_l): H2O: the new token's query [H_q][1][d] at EVERY step (its
// attention is accumulated); TOVA: the new token's query on eviction steps; window recipes: the
// last w decoded tokens' queries on eviction steps (their keys are the layer's last w rows);
// external_block recipes: the block on eviction steps; Knorm / StreamingLLM: none.
// d.evicts_next(l) says whether the next step of layer l evicts (so the engine knows when to
// gather queries); on other steps an empty view is accepted.
#pragma once

#include <kvevict/distributed.hpp>
#include <kvevict/drivers/detail/driver_skeleton.hpp>

namespace kvevict {

struct decode_config {
  model_shape model;
  /// C: the most rows a head holds (its budget plus `interval` new rows; for flattened / adakv a
  /// head may hold up to its layer's budget plus `interval`). Sizes the state and the workspace.
  index_t capacity = 0;
  /// Evict every `interval` decode steps (>= 1), counted from begin().
  index_t interval = 1;
  /// Rows of the query block for external_block recipes; 0 otherwise (derived).
  index_t query_rows = 0;
  /// Any recipe: h2o accumulates the attention of every decoded token (the H2O state), tova scores
  /// with the newest token, window recipes with the last w tokens, external_block with a block,
  /// knorm and streaming_llm without queries.
  recipe rec = recipe::h2o();
  /// per_head, flattened or adakv with budgets [L][H] (the cache goes back to them).
  allocation alloc;
  /// Tensor parallelism (docs/distributed.md): this rank's driver holds model.kv_heads of the
  /// layer's model.kv_heads x tp.size() KV heads (head_shard), every rank running the same steps.
  /// per_head needs no communicator. flattened / adakv: every rank passes the same budget sum per
  /// layer (its block of the [L][H x P] budgets); on every step due for an eviction the ranks agree
  /// and sum their rows (one agreement), evict when the layer's rows over all ranks exceed its
  /// budget, and select across the ranks (sharded select_topk_flat / adakv_budgets), exactly as one
  /// process would. Such steps score the layer whether it evicts or not. A step failing on one rank
  /// before that agreement fails on every rank. Empty: one process.
  comm_ref tp;
  /// Paged layers (paged_layer_kv): the most pages their pools have (the workspace holds a bitmap
  /// of them for the block-table checks); 0 = ragged layers (layer_kv) only.
  index_t pool_pages = 0;
};

/// Decode-time eviction (see the file comment and docs/drivers.md).
///
/// H2O state: one float per cached row (the attention it received from the decoded tokens since
/// begin(), plus begin()'s optional initial scores), in the driver's state memory, compacted
/// together with the cache. At an eviction the scores are the accumulated attention, protected
/// with the recipe's {n_sink, n_recent}. Other recipes keep no per-row state.
/// Budgets: per_head: head (l, h) keeps min(rows, budgets(l, h)); flattened: layer l keeps
/// min(rows, sum_h budgets(l, h)), heads compete; adakv: B_l = sum_h budgets(l, h) / H per head with
/// AdaKV's floor when the layer holds more than B_l H. Recording: evictions at step `tokens`
/// (the number of tokens processed, the new token included).
class decode_driver : public detail::driver_skeleton<decode_driver, decode_config> {
  friend class detail::driver_skeleton<decode_driver, decode_config>;

 public:
  static constexpr const char* name = "decode_driver";

  // state_bytes(cfg), workspace_bytes(be), config(): detail::driver_skeleton.

  // init(cfg, memory, bytes, recorder): detail::driver_skeleton, ending in attach() below.
  // init's errors: model shape; capacity outside [1, INT32_MAX / H]; interval < 1; an invalid recipe;
  // query_rows missing for / given to a recipe that does not take it; a window longer than the
  // capacity; allocator not per_head / flattened / adakv; budgets not [L][H], below n_sink +
  // n_recent per head (or per head on average for flattened / adakv), adakv totals not a multiple
  // of H; recorder shape; memory null or too small.

  /// Starts (or restarts) decoding on layer l: kv is its cache after `tokens` tokens (positions
  /// < tokens, at most C rows per head); initial: H2O's starting scores per row ([H][>= rows],
  /// row h's first lens[h] columns; an empty view = 0), ignored by other recipes. The next step's
  /// token is at position `tokens`; evictions happen every `interval` steps from here.
  /// Errors: not initialised; layer outside [0, L); the layer's layout and positions; more rows
  /// than the capacity; tokens outside [0, INT32_MAX); initial of the wrong shape or NaN.
  template <class T>
  status begin(index_t layer, const layer_kv<T>& kv, index_t tokens, matrix_view<const float> initial = {}) {
    constexpr const char* fn = "decode_driver::begin";
    if (!ok_) return status::error(errc::invalid_argument, "%s: the driver is not initialised (init)", fn);
    return begin_rows(fn, layer, kv, tokens, initial);
  }

  /// begin on a paged layer (one sequence of it, paged_layer_kv): the same, with the workspace of
  /// every call (two-phase, workspace_bytes(be)) for the block-table checks.
  template <class Backend, class T>
  status begin(Backend be, workspace& ws, index_t layer, const paged_layer_kv<T>& kv_in, index_t tokens,
               matrix_view<const float> initial = {}) {
    constexpr const char* fn = "decode_driver::begin";
    return detail::on_host(fn, be, [&](auto host) -> status {
      detail::call_scratch w;
      KVEVICT_TRY(open_call(fn, host, ws, w));
      if (ws.is_query()) return {};
      KVEVICT_TRY(check_ws(fn, ws));
      detail::paged_rows<T> kv;
      KVEVICT_TRY(detail::open_layer(fn, w.paged, kv_in, cfg_.model.kv_heads, cfg_.model.head_dim, kv));
      return begin_rows(fn, layer, kv, tokens, initial);
    });
  }

  /// Does the next step of layer l evict? (So the engine knows when to gather window queries.)
  bool evicts_next(index_t layer) const noexcept {
    return ok_ && layer >= 0 && layer < cfg_.model.layers && (flags_[layer] & begun) &&
           (tokens_[layer] + 1 - start_[layer]) % cfg_.interval == 0;
  }

 private:
  template <class KV>
  status begin_rows(const char* fn, index_t layer, const KV& kv, index_t tokens, const matrix_view<const float>& initial) {
    const std::int32_t* lens = detail::layer_lens(kv);
    const index_t H = cfg_.model.kv_heads, C = cfg_.capacity;
    KVEVICT_TRY(check_layer_index(fn, layer));
    KVEVICT_TRY(check_layer_after(fn, layer, kv, tokens, 0));
    if (h2o_ && initial.extent(1) > 0) {
      KVEVICT_TRY(detail::check_view(fn, "initial", initial));
      if (initial.extent(0) != H)
        return status::error(errc::shape_mismatch, "%s: initial has %lld rows, expected one per KV head (%lld)", fn,
                             static_cast<long long>(initial.extent(0)), static_cast<long long>(H));
      for (index_t h = 0; h < H; ++h) {
        if (lens[h] > initial.extent(1))
          return status::error(errc::shape_mismatch, "%s: initial has %lld columns but head %lld holds %d rows", fn,
                               static_cast<long long>(initial.extent(1)), static_cast<long long>(h), lens[h]);
        for (index_t j = 0; j < lens[h]; ++j)
          if (initial(h, j) != initial(h, j))
            return status::error(errc::invalid_argument, "%s: initial[%lld][%lld] is NaN", fn, static_cast<long long>(h),
                                 static_cast<long long>(j));
      }
    }
    for (index_t h = 0; h < H; ++h) {
      held_[layer * H + h] = lens[h];
      if (h2o_)
        for (index_t j = 0; j < lens[h]; ++j)
          acc_[(layer * H + h) * C + j] = initial.extent(1) > 0 ? initial(h, j) : 0.0f;
    }
    tokens_[layer] = start_[layer] = tokens;
    flags_[layer] = begun;
    return {};
  }

 public:

  /// One decoded token went through layer l: kv holds the rows kept so far followed by the new
  /// token's row (position tokens(l)); queries / block_keys as the file comment says. On eviction
  /// steps the driver scores, selects, records and answers with kept(l) (evicted(l) true when a
  /// row is dropped); H2O's accumulators are compacted with the cache.
  /// Errors (nothing changes but evicted(l), which is false after any step): not begun; the
  /// layer's layout; a head not holding its previous rows
  /// plus exactly one new row, or a new row not at position tokens(l); more rows than the
  /// capacity; queries / block keys of the wrong shape (an empty view is accepted when the step
  /// needs none); the window's rows missing; workspace too small or overlapping the state; the
  /// recorder's errors.
  /// kv: a layer_kv, or a paged_layer_kv (one sequence of a paged layer; config.pool_pages
  /// bounds its pools).
  /// On cuda_t (step, step_scores, begin): errc::unsupported (detail::drivers_on_cuda), nothing
  /// changes.
  template <class Backend, class KV, class Q>
  status step(Backend be, workspace& ws, index_t layer, const KV& kv_in, kv_view<Q> queries_in,
              kv_view<const detail::layer_element_t<KV>> block_keys = {}) {
    constexpr const char* fn = "decode_driver::step";
    return detail::on_host(fn, be, [&](auto host) {
      const bool join = sharded() && evicts_next(layer) && !ws.is_query();
      in_collective_ = false;
      return joined(fn, join, step_local(fn, host, ws, layer, kv_in, queries_in, block_keys));
    });
  }

  /// step with scores an engine or a trained scorer computed instead of the queries: scores
  /// [H][>= rows of a head] (row h: head h's rows, the first kv.keys.lens[h] columns, in the
  /// cache's order). H2O: the new token's attention over every row, at every step (the driver
  /// adds it to its sums; recipe_scores of a TOVA recipe without protection gives it); other
  /// recipes: the eviction scores, higher = keep, read only on steps that evict (evicts_next(l)
  /// and the layer above its budget; an empty view is accepted otherwise; tensor-parallel
  /// flattened / adakv: on every step due for an eviction); the driver protects the recipe's
  /// {n_sink, n_recent} on its copy. recipe_scores' output gives exactly step's result.
  /// Workspace: step's.
  /// Errors (nothing changes but evicted(l)): step's, except the query ones; scores of the wrong
  /// shape or NaN.
  template <class Backend, class KV, typename = detail::layer_element_t<KV>>
  status step_scores(Backend be, workspace& ws, index_t layer, const KV& kv_in, matrix_view<const float> scores) {
    constexpr const char* fn = "decode_driver::step_scores";
    return detail::on_host(fn, be, [&](auto host) {
      const bool join = sharded() && evicts_next(layer) && !ws.is_query();
      in_collective_ = false;
      return joined(fn, join, step_scores_local(fn, host, ws, layer, kv_in, scores));
    });
  }

 private:
  template <class Backend, class KV, class Q>
  status step_local(const char* fn, Backend be, workspace& ws, index_t layer, const KV& kv_in, kv_view<Q> queries_in,
                    kv_view<const detail::layer_element_t<KV>> block_keys) {
    using QE = std::remove_const_t<Q>;
    using T = detail::layer_element_t<KV>;
    const kv_view<const QE> queries = queries_in;
    detail::call_scratch w;
    step_clock at;
    typename detail::layer_reader<KV>::type kv;
    KVEVICT_TRY(open_step(fn, be, ws, w, layer, kv_in, at, kv));
    if (ws.is_query()) return {};
    const index_t now = at.now;
    const bool due = at.due;
    // the queries this step reads (steps that read none ignore them)
    const bool scoring = due && !h2o_ && evict_rows_ > 0;
    if (h2o_) KVEVICT_TRY(detail::check_queries(fn, queries, 1, cfg_.model, block_keys, false));
    if (scoring) KVEVICT_TRY(detail::check_queries(fn, queries, evict_rows_, cfg_.model, block_keys, block_keys_));
    if (scoring && evict_tail_ > 0) {
      detail::row_rules rr;
      rr.tokens = now;
      rr.capacity = cfg_.capacity;
      rr.tail = evict_tail_;
      rr.tail_what = evict_tail_ == 1 ? "the newest token (TOVA's query)" : "the window's tokens (the last decoded)";
      KVEVICT_TRY(detail::check_layer_rows(fn, layer, kv, rr));
    }
    KVEVICT_TRY(check_ws(fn, ws));

    const index_t H = cfg_.model.kv_heads, g = cfg_.model.query_heads / H;
    const std::int32_t* lens = detail::layer_lens(kv);
    // sharded: a due step scores before the ranks agree whether the layer evicts
    const bool score = due && (sharded() || over_budget(layer, lens));
    if (h2o_) {  // the new token's attention over every row (its own included), added to the sums
      recipe r = cfg_.rec;
      r.kind = recipe_kind::tova;
      r.n_sink = r.n_recent = 0;
      KVEVICT_TRY(detail::score_layer(be, w.sc, r, kv, g, queries, kv_view<const T>{}, w.scores, cfg_.capacity));
      accumulate(w, layer, lens);
    } else if (score) {
      KVEVICT_TRY(detail::score_layer(be, w.sc, cfg_.rec, kv, g, queries, block_keys, w.scores, cfg_.capacity));
    }
    bool evicting = false;
    KVEVICT_TRY(decide_eviction(fn, layer, lens, due, now, &evicting));
    return finish_step(be, w, layer, kv, now, evicting);
  }

  template <class Backend, class KV>
  status step_scores_local(const char* fn, Backend be, workspace& ws, index_t layer, const KV& kv_in,
                           const matrix_view<const float>& scores) {
    detail::call_scratch w;
    step_clock at;
    typename detail::layer_reader<KV>::type kv;
    KVEVICT_TRY(open_step(fn, be, ws, w, layer, kv_in, at, kv));
    if (ws.is_query()) return {};
    const index_t H = cfg_.model.kv_heads, C = cfg_.capacity;
    const std::int32_t* lens = detail::layer_lens(kv);
    const bool score = at.due && (sharded() || over_budget(layer, lens));
    if (h2o_ || score) KVEVICT_TRY(detail::check_layer_scores(fn, scores, lens, H));
    KVEVICT_TRY(check_ws(fn, ws));
    if (h2o_) {
      for (index_t h = 0; h < H; ++h)
        for (index_t j = 0; j < lens[h]; ++j) w.scores[h * C + j] = scores(h, j);
      accumulate(w, layer, lens);
    } else if (score) {
      KVEVICT_TRY(detail::take_layer_scores(be, scores, lens, H, detail::recipe_protection(cfg_.rec),
                                            w.scores, C));
    }
    bool evicting = false;
    KVEVICT_TRY(decide_eviction(fn, layer, lens, at.due, at.now, &evicting));
    return finish_step(be, w, layer, kv, at.now, evicting);
  }

  /// Layers selected across the tensor-parallel ranks.
  bool sharded() const noexcept {
    return cfg_.tp.size() > 1 && (cfg_.alloc.kind == allocator::flattened || cfg_.alloc.kind == allocator::adakv);
  }

  /// Does this step evict? One process: due and over the budget. Sharded: on a due step the ranks
  /// agree on the layer, the step and their budget sum, and sum their rows (every rank decides the
  /// same: the layer's rows over all ranks above tp.size() x the budget sum).
  status decide_eviction(const char* fn, index_t layer, const std::int32_t* lens, bool due, index_t now,
                         bool* evicting) {
    if (!sharded() || !due) {
      *evicting = due && over_budget(layer, lens);
      return {};
    }
    const index_t H = cfg_.model.kv_heads;
    index_t budget = 0;
    std::int64_t sums[2] = {};  // rows (and a second sum the joined error path mirrors)
    for (index_t h = 0; h < H; ++h) {
      budget += budgets_[layer * H + h];
      sums[0] += lens[h];
    }
    detail::config_line config;
    config.print("%s layer %lld step %lld, budget sum %lld per rank, %lld heads per rank",
                 allocator_name(cfg_.alloc.kind), static_cast<long long>(layer), static_cast<long long>(now),
                 static_cast<long long>(budget), static_cast<long long>(H));
    in_collective_ = true;
    comm_ref c = cfg_.tp;
    KVEVICT_TRY(detail::agree(c, fn, status{}, config, sums, 2));
    *evicting = sums[0] > budget * c.size();
    return {};
  }

  /// Tensor parallelism: a due step that failed on this rank before the ranks' agreement still
  /// joins it, so the other ranks return the same error instead of waiting.
  status joined(const char* fn, bool join, const status& st) {
    if (!join || st.ok() || in_collective_) return st;
    return detail::join_failed_call(cfg_.tp, fn, st, 2);
  }

 public:

  /// Did the last step of layer l drop rows? Then compact the layer with kept(l).
  bool evicted(index_t layer) const noexcept {
    return ok_ && layer >= 0 && layer < cfg_.model.layers && (flags_[layer] & evicted_flag) != 0;
  }
  /// The rows layer l keeps after its last step (indices into the rows given to step), per head
  /// ascending. Empty unless evicted(l).
  ragged_positions kept(index_t layer) const noexcept {
    if (!evicted(layer)) return {};
    const index_t H = cfg_.model.kv_heads;
    return {kept_pos_ + layer * H * cfg_.capacity, kept_cu_ + layer * (H + 1), H};
  }
  /// Tokens layer l has processed (the next token's position).
  index_t tokens(index_t layer) const noexcept {
    return ok_ && layer >= 0 && layer < cfg_.model.layers ? tokens_[layer] : 0;
  }
  /// Rows head h of layer l holds after its last step (after compaction).
  index_t held(index_t layer, index_t head) const noexcept {
    return ok_ && layer >= 0 && layer < cfg_.model.layers && head >= 0 && head < cfg_.model.kv_heads
               ? held_[layer * cfg_.model.kv_heads + head]
               : 0;
  }
  /// H2O: head h's accumulated scores, aligned with its rows (held(l, h) of them); null otherwise.
  const float* accumulated(index_t layer, index_t head) const noexcept {
    return h2o_ && ok_ && layer >= 0 && layer < cfg_.model.layers && head >= 0 && head < cfg_.model.kv_heads
               ? acc_ + (layer * cfg_.model.kv_heads + head) * cfg_.capacity
               : nullptr;
  }

 private:
  /// init's last step (detail::driver_skeleton::init, after the configuration, recorder and memory
  /// checks): the state pieces placed at m.base and reset.
  status attach(const char* /*fn*/, const decode_config& cfg, const detail::state_memory& m) {
    const plan_t p = plan(cfg);
    cfg_.alloc.budgets = {};
    budgets_ = reinterpret_cast<std::int32_t*>(m.base + p.budgets);
    held_ = reinterpret_cast<std::int32_t*>(m.base + p.held);
    tokens_ = reinterpret_cast<index_t*>(m.base + p.tokens);
    start_ = reinterpret_cast<index_t*>(m.base + p.start);
    flags_ = m.base + p.flags;
    kept_pos_ = reinterpret_cast<pos_t*>(m.base + p.kept_pos);
    kept_cu_ = reinterpret_cast<std::int32_t*>(m.base + p.kept_cu);
    acc_ = p.h2o ? reinterpret_cast<float*>(m.base + p.acc) : nullptr;
    const index_t L = cfg.model.layers, H = cfg.model.kv_heads;
    for (index_t l = 0; l < L; ++l) {
      tokens_[l] = start_[l] = 0;
      flags_[l] = 0;
      for (index_t h = 0; h < H; ++h) {
        budgets_[l * H + h] = cfg.alloc.budgets(l, h);
        held_[l * H + h] = 0;
      }
      for (index_t h = 0; h <= H; ++h) kept_cu_[l * (H + 1) + h] = 0;
    }
    h2o_ = p.h2o;
    bool bk = false;
    (void)eviction_queries("", cfg.rec, cfg.query_rows, &evict_rows_, &bk, &evict_tail_);
    block_keys_ = bk;
    return {};
  }

  static constexpr unsigned char begun = 1, evicted_flag = 2;

  struct plan_t {
    detail::mem_plan layout;
    std::size_t budgets = 0, held = 0, tokens = 0, start = 0, flags = 0, kept_pos = 0, kept_cu = 0, acc = 0;
    bool h2o = false;
  };
  /// The query block read at an eviction: rows, block keys, and how many last rows are its own.
  static status eviction_queries(const char* fn, const recipe& r, index_t given, index_t* rows, bool* block_keys,
                                 index_t* tail) {
    *block_keys = false;
    *tail = 0;
    index_t need = 0;
    switch (r.kind) {
      case recipe_kind::knorm:
      case recipe_kind::streaming_llm:
      case recipe_kind::h2o: need = 0; break;  // h2o reads one query per step, not at the eviction
      case recipe_kind::tova:
        need = 1;
        *tail = 1;
        break;
      default:
        if (r.source == query_source::external_block) return detail::external_block_queries(fn, given, rows, block_keys);
        need = r.window;
        *tail = r.window;
    }
    if (given != 0 && given != need)
      return status::error(errc::invalid_argument, "%s: query_rows = %lld but %s reads %lld query rows at an eviction",
                           fn, static_cast<long long>(given), recipe_name(r.kind), static_cast<long long>(need));
    *rows = need;
    return {};
  }

  static status validate(const char* fn, const decode_config& c) {
    KVEVICT_TRY(detail::check_model(fn, c.model));
    KVEVICT_TRY(detail::check_capacity(fn, "capacity", c.capacity, c.model.kv_heads));
    if (c.interval < 1)
      return status::error(errc::invalid_argument, "%s: interval = %lld (must be >= 1)", fn,
                           static_cast<long long>(c.interval));
    KVEVICT_TRY(detail::check_recipe(fn, c.rec));
    index_t rows = 0, tail = 0;
    bool bk = false;
    KVEVICT_TRY(eviction_queries(fn, c.rec, c.query_rows, &rows, &bk, &tail));
    if (tail > c.capacity)
      return status::error(errc::invalid_argument, "%s: the window %lld is longer than the capacity %lld", fn,
                           static_cast<long long>(tail), static_cast<long long>(c.capacity));
    KVEVICT_TRY(detail::check_allocation_options(fn, c.alloc));
    KVEVICT_TRY(detail::check_pool_pages(fn, c.pool_pages));
    KVEVICT_TRY(detail::check_supported(fn, c.alloc.kind == allocator::lava || c.alloc.kind == allocator::cake,
                                        allocator_name(c.alloc.kind),
                                        "allocates across layers from prefill scores; decode eviction takes per_head, "
                                        "flattened or adakv budgets"));
    return detail::check_budget_matrix(fn, c.alloc, c.model, c.rec.n_sink + c.rec.n_recent, -1);
  }

  static plan_t plan(const decode_config& c) {
    plan_t p;
    const auto L = static_cast<std::size_t>(c.model.layers), H = static_cast<std::size_t>(c.model.kv_heads),
               C = static_cast<std::size_t>(c.capacity);
    p.h2o = c.rec.kind == recipe_kind::h2o;
    p.budgets = p.layout.take(L * H * sizeof(std::int32_t));
    p.held = p.layout.take(L * H * sizeof(std::int32_t));
    p.tokens = p.layout.take(L * sizeof(index_t));
    p.start = p.layout.take(L * sizeof(index_t));
    p.flags = p.layout.take(L);
    p.kept_pos = p.layout.take(L * H * C * sizeof(pos_t));
    p.kept_cu = p.layout.take(L * (H + 1) * sizeof(std::int32_t));
    if (p.h2o) p.acc = p.layout.take(L * H * C * sizeof(float));
    return p;
  }

  template <class Backend>
  status carve(Backend be, workspace& ws, detail::call_scratch& w) const {
    detail::call_scratch_shape s = scratch_shape(cfg_.capacity);
    s.acc = h2o_;
    recipe r = cfg_.rec;
    if (h2o_) r.kind = recipe_kind::tova;  // H2O scores each step's token like TOVA
    KVEVICT_TRY(fit_score_slots(be, r, h2o_ ? 1 : evict_rows_, !h2o_ && block_keys_, s));
    s.sel = detail::driver_select_bytes(be, sharded(), cfg_.alloc.kind, cfg_.alloc.kind, s.H, s.C, cfg_.tp.size());
    s.pool_pages = cfg_.pool_pages;
    return detail::carve_call_scratch(name, ws, s, w);
  }

  /// The tokens a step brings its layer to, and whether an eviction is due at it.
  struct step_clock {
    index_t now = 0;
    bool due = false;
  };

  /// step's and step_scores' first steps: initialised, the workspace carved (a size query ends
  /// here), then the layer: begun, its layout, every head holding its previous rows plus the new
  /// token's row at position tokens(l). The previous answer is spent.
  template <class Backend, class KV, class Rows>
  status open_step(const char* fn, Backend be, workspace& ws, detail::call_scratch& w, index_t layer, const KV& kv_in,
                   step_clock& at, Rows& kv) {
    KVEVICT_TRY(open_call(fn, be, ws, w));
    if (ws.is_query()) return {};
    KVEVICT_TRY(detail::open_layer(fn, w.paged, kv_in, cfg_.model.kv_heads, cfg_.model.head_dim, kv));
    return check_step_layer(fn, layer, kv, &at.now, &at.due);
  }

  template <class KV>
  status check_step_layer(const char* fn, index_t layer, const KV& kv, index_t* now, bool* due) {
    const index_t H = cfg_.model.kv_heads;
    KVEVICT_TRY(check_layer_index(fn, layer));
    if (!(flags_[layer] & begun))
      return status::error(errc::invalid_argument, "%s: layer %lld was not begun (begin)", fn,
                           static_cast<long long>(layer));
    flags_[layer] = begun;  // the previous answer is spent, whatever this step gives
    *now = tokens_[layer] + 1;
    if (*now >= INT32_MAX)
      return status::error(errc::invalid_argument, "%s: %lld tokens do not fit int32 positions", fn,
                           static_cast<long long>(*now));
    *due = (*now - start_[layer]) % cfg_.interval == 0;
    detail::row_rules rr;
    rr.tokens = *now;
    rr.capacity = cfg_.capacity;
    rr.tail = 1;
    rr.tail_what = "the new token";
    KVEVICT_TRY(detail::check_layer_layout(fn, layer, kv, H, cfg_.model.head_dim));
    const std::int32_t* lens = detail::layer_lens(kv);
    for (index_t h = 0; h < H; ++h)
      if (lens[h] != held_[layer * H + h] + 1)
        return status::error(errc::shape_mismatch,
                             "%s: layer %lld head %lld holds %d rows; it held %d and a step adds one (was it compacted "
                             "with kept(%lld)?)",
                             fn, static_cast<long long>(layer), static_cast<long long>(h), lens[h],
                             held_[layer * H + h], static_cast<long long>(layer));
    return detail::check_layer_rows(fn, layer, kv, rr);
  }

  /// H2O: the step's sums (w.acc) = the held sums (the new row: 0) + this step's attention (w.scores).
  void accumulate(detail::call_scratch& w, index_t layer, const std::int32_t* lens) const {
    const index_t H = cfg_.model.kv_heads, C = cfg_.capacity;
    for (index_t h = 0; h < H; ++h) {
      const float* a = acc_ + (layer * H + h) * C;
      float* n = w.acc + h * C;
      for (index_t j = 0; j < lens[h]; ++j) n[j] = (j + 1 < lens[h] ? a[j] : 0.0f) + w.scores[h * C + j];
    }
  }

  /// The end of a step: without an eviction the layer's rows (and H2O sums) are committed; with
  /// one, the eviction scores (w.scores, protected; H2O: the sums, protected here) select what
  /// the layer keeps, the dropped rows are recorded and kept(l) answers.
  template <class Backend, class KV>
  status finish_step(Backend be, detail::call_scratch& w, index_t layer, const KV& kv, index_t now, bool evicting) {
    const index_t H = cfg_.model.kv_heads, C = cfg_.capacity;
    const std::int32_t* lens = detail::layer_lens(kv);
    if (!evicting) {
      for (index_t h = 0; h < H; ++h) {
        held_[layer * H + h] = lens[h];
        if (h2o_)
          std::memcpy(acc_ + (layer * H + h) * C, w.acc + h * C, static_cast<std::size_t>(lens[h]) * sizeof(float));
      }
      tokens_[layer] = now;
      return {};
    }
    if (h2o_) {
      for (index_t h = 0; h < H; ++h)
        std::memcpy(w.scores + h * C, w.acc + h * C, static_cast<std::size_t>(lens[h]) * sizeof(float));
      KVEVICT_TRY(protect(be, detail::rows_view(w.scores, H, C, C), cfg_.rec.n_sink, cfg_.rec.n_recent, lens));
    }
    const auto sv = detail::rows_view<const float>(w.scores, H, C, C);
    index_t total = 0;
    for (index_t h = 0; h < H; ++h) {
      const std::int32_t b = budgets_[layer * H + h];
      w.counts[h] = b < lens[h] ? b : lens[h];
      total += b;
    }
    index_t held = 0;
    for (index_t h = 0; h < H; ++h) held += lens[h];
    if (total > held) total = held;
    adakv_options ao;
    ao.alpha = cfg_.alloc.adakv_alpha;
    ao.floor = cfg_.alloc.floor_rule;
    ao.prot = detail::recipe_protection(cfg_.rec);
    std::int32_t* cu = kept_cu_ + layer * (H + 1);
    pos_t* pos = kept_pos_ + layer * H * C;
    if (sharded()) {  // evicting: the layer over all ranks holds more than its budget
      comm_ref c = cfg_.tp;
      const index_t budget = total_budget(layer);
      KVEVICT_TRY(cfg_.alloc.kind == allocator::adakv
                      ? adakv_budgets(be, w.sel, c, sv, lens, budget / H, ao, cu, pos)
                      : select_topk_flat(be, w.sel, c, sv, lens, budget * c.size(), nullptr, cu, pos));
    } else {
      KVEVICT_TRY(detail::select_layer(be, w.sel, cfg_.alloc.kind, sv, lens, w.counts, total, ao, cu, pos));
    }
    const ragged_positions k{pos, cu, H};
    KVEVICT_TRY(detail::record_dropped(rec_, layer, kv, k, now, w.evicted, w.evicted_cu));
    for (index_t h = 0; h < H; ++h) {
      if (h2o_) {  // the accumulators follow the cache
        float* a = acc_ + (layer * H + h) * C;
        for (index_t i = 0; i < k.length(h); ++i) a[i] = w.acc[h * C + pos[cu[h] + i]];
      }
      held_[layer * H + h] = static_cast<std::int32_t>(k.length(h));
    }
    tokens_[layer] = now;
    flags_[layer] = begun | evicted_flag;
    return {};
  }

  /// Layer l's budget sum (this rank's heads).
  index_t total_budget(index_t l) const {
    index_t total = 0;
    for (index_t h = 0; h < cfg_.model.kv_heads; ++h) total += budgets_[l * cfg_.model.kv_heads + h];
    return total;
  }

  /// Does layer l hold more than its allocation lets it keep?
  bool over_budget(index_t l, const std::int32_t* lens) const {
    const index_t H = cfg_.model.kv_heads;
    index_t total = 0, held = 0;
    bool over = false;
    for (index_t h = 0; h < H; ++h) {
      total += budgets_[l * H + h];
      held += lens[h];
      over = over || lens[h] > budgets_[l * H + h];
    }
    return cfg_.alloc.kind == allocator::per_head ? over : held > total;
  }

  std::int32_t* budgets_ = nullptr;
  std::int32_t* held_ = nullptr;
  index_t* tokens_ = nullptr;
  index_t* start_ = nullptr;
  unsigned char* flags_ = nullptr;
  pos_t* kept_pos_ = nullptr;
  std::int32_t* kept_cu_ = nullptr;
  float* acc_ = nullptr;
  index_t evict_rows_ = 0, evict_tail_ = 0;
  bool block_keys_ = false;
  bool h2o_ = false;
  bool in_collective_ = false;  // this step reached the ranks' agreement
};

}  // namespace kvevict
