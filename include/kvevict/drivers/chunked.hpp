// kvevict/drivers/chunked.hpp: eviction during chunked prefill, naive and patched ("Cache Me If
// You Can" §3, docs/drivers.md).
//
//   chunked_driver d;
//   d.init(cfg, memory, chunked_driver::state_bytes(cfg).value(), &recorder /*optional*/);
//   for each chunk [s, e) of the prompt (contiguous, from 0 to N):
//     d.begin_chunk(s, e);
//     engine: forward the chunk; if d.patch().count > 0, also forward the prompt tokens at
//             positions [patch.first, patch.first + count) as extra queries AFTER the chunk (their
//             KV is dropped afterwards); collect per layer the query block d.query_rows() rows:
//               naive               the chunk's last min(w, e - s) queries
//               patched, not final  the patch's queries (and its keys, for block_keys)
//               final chunk         the chunk's last w queries
//     for l in 0..L-1: d.add_layer(be, ws, l, layer_kv_l, queries_l [, patch_keys_l]);
//     d.decide(be, ws);                       // the lava allocator decides here
//     for l: compact layer l with d.kept(l)    // rows of its current cache (kept so far + chunk)
//
// Per layer, the driver scores the layer's CURRENT cache (what it kept from earlier chunks plus the
// new chunk) with the query block and evicts down to the budget or p% of the evictable rows.
#pragma once

#include <kvevict/distributed.hpp>
#include <kvevict/drivers/detail/driver_skeleton.hpp>
#include <kvevict/drivers/detail/stages.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kvevict {

/// Which queries score a chunk (footprint paper §3).
enum class chunk_queries : int {
  /// Each chunk is scored by its own last w queries, as if it were the end of the prompt.
  naive = 0,
  /// The true last w prompt tokens are appended to every non-final chunk as extra queries (their
  /// KV is dropped); the final chunk's last w tokens are those tokens.
  patched = 1,
};

/// How much a chunk evicts.
enum class chunk_target : int {
  /// Down to the allocation's budgets (a head / layer / model holding less keeps everything).
  budget = 0,
  /// floor(p x evictable) of the rows of each head (per_head) / layer (flattened) / model (lava),
  /// evictable = rows - protected rows: the footprint paper's "evict p% at each pre-filling step".
  fraction = 1,
};

struct chunked_config : model_sharding {
  model_shape model;
  /// N: the prompt length (the patch is [N - w, N)).
  index_t tokens = 0;
  /// C: the most rows a head holds when the driver scores it (what it kept plus the largest chunk);
  /// sizes the state and the workspace.
  index_t capacity = 0;
  /// Window recipes (snapkv, vatp, lava, cake; source prompt_window, window w = rec.window), Knorm
  /// or StreamingLLM. H2O and TOVA are not supported here (use the decode driver or post-fill).
  recipe rec = recipe::snapkv();
  chunk_queries queries = chunk_queries::patched;
  chunk_target target = chunk_target::budget;
  double fraction = 0.5;  ///< p in [0, 1] for chunk_target::fraction
  /// per_head, flattened, adakv (budget target only) or lava; cake is not supported here.
  allocation alloc;
  // Sharding (the base model_sharding: tp, pp, first_layer, model_layers), for this driver:
  // Tensor parallelism (docs/distributed.md): this rank's driver holds model.kv_heads of the
  // layer's model.kv_heads x tp.size() KV heads (head_shard), every rank running the same calls
  // with the same chunks. per_head needs no communicator. flattened / adakv: every rank passes the
  // same budget sum per layer (its block of the [L][H x P] budgets); a layer's target is computed
  // from every rank's rows (one agreement per layer and chunk) and selected across the ranks
  // (sharded select_topk_flat / adakv_budgets), exactly as one process would. lava: alloc.total
  // is the model's total over every rank's heads; the entropies, the layers' rows and the
  // selection run across the ranks. A call failing on one rank before its collectives fails on
  // every rank. Empty: one process.
  // Pipeline parallelism (docs/distributed.md): this stage's driver holds model.layers layers, the
  // model's [first_layer, first_layer + model.layers) of model_layers (e.g. layer_shard), every
  // stage running the same chunks. Only lava communicates: each chunk's decide() agrees on the
  // chunk and gathers every stage's entropies and protected / evictable rows
  // (gather_layer_values; 3 gathers per chunk), then shares the model's target as one process
  // does (alloc.total: the whole model's). Per-layer allocators need no communicator. With tp too
  // (a grid): the rows gathered over pp, then summed over tp. Every stage must call decide() for
  // every chunk, also after an add_layer error (it then fails on every stage). Empty: one process.
  /// Paged layers (paged_layer_kv): the most pages their pools have (the workspace holds a bitmap
  /// of them for the block-table checks); 0 = ragged layers (layer_kv) only.
  index_t pool_pages = 0;
};

/// Extra query positions the engine appends after a chunk (patched mode, non-final chunks).
struct patch_block {
  pos_t first = 0;    ///< first position (N - w)
  index_t count = 0;  ///< number of tokens (w), 0 = no patch
};

/// Chunked prefill eviction (see the file comment and docs/drivers.md).
///
/// Protection per chunk (the recipe's {n_sink, n_recent}): naive and final chunks protect the
/// first n_sink and last n_recent rows of each head; a non-final patched chunk protects only the
/// sinks, because the prompt's recent window is the patch, whose KV is not in the cache. Knorm and
/// StreamingLLM read no queries: both modes score them alike (naive).
/// Recording: a chunk [s, e) evicts at step e.
class chunked_driver : public detail::prefill_driver_skeleton<chunked_driver, chunked_config>,
                       private detail::layer_store {
  friend class detail::driver_skeleton<chunked_driver, chunked_config>;
  friend class detail::prefill_driver_skeleton<chunked_driver, chunked_config>;

 public:
  static constexpr const char* name = "chunked_driver";

  // state_bytes(cfg), workspace_bytes(be): detail::driver_skeleton; add_layer / add_layer_scores
  // below (their own signatures) go through detail::prefill_driver_skeleton.

  // init(cfg, memory, bytes, recorder): detail::driver_skeleton, ending in attach() below.
  // init's errors: model shape; tokens outside [1, INT32_MAX]; capacity outside [1, INT32_MAX / H];
  // an invalid recipe, H2O / TOVA (unsupported), an external_block source, a window longer than
  // the prompt or the capacity; unknown mode, target or allocator; the cake allocator
  // (unsupported); fraction outside [0, 1]; adakv with the fraction target; budgets not [L][H],
  // per-head budgets (or layer budgets per head) below n_sink + n_recent; lava total negative
  // or below L H (n_sink + n_recent); recorder shape; memory null or too small.

  /// Starts the chunk of prompt positions [begin, end). Errors (nothing changes): not initialised;
  /// the previous chunk unfinished (layers missing, or decide() not run for lava); begin not the
  /// previous chunk's end (0 for the first chunk): chunks must be contiguous; an empty chunk or one
  /// past the prompt; a chunk longer than the capacity; patched attention recipes: a non-final
  /// chunk ending inside the last w prompt tokens (the final chunk must contain the whole window).
  status begin_chunk(index_t begin, index_t end) {
    constexpr const char* fn = "chunked_driver::begin_chunk";
    if (!ok_) return status::error(errc::invalid_argument, "%s: the driver is not initialised (init)", fn);
    const index_t L = cfg_.model.layers, N = cfg_.tokens;
    if (open_ && (next_ < L || !decided_))
      return status::error(errc::invalid_argument,
                           "%s: chunk [%lld, %lld) is unfinished (%lld of %lld layers added%s)", fn,
                           static_cast<long long>(begin_), static_cast<long long>(end_), static_cast<long long>(next_),
                           static_cast<long long>(L), next_ == L ? ", decide() not run" : "");
    if (begin != end_)
      return status::error(errc::invalid_argument,
                           "%s: chunk [%lld, %lld) does not start where the previous one ended (%lld): chunks must be "
                           "contiguous",
                           fn, static_cast<long long>(begin), static_cast<long long>(end), static_cast<long long>(end_));
    if (end <= begin || end > N)
      return status::error(errc::invalid_argument, "%s: chunk [%lld, %lld) is empty or past the %lld-token prompt", fn,
                           static_cast<long long>(begin), static_cast<long long>(end), static_cast<long long>(N));
    const index_t w = cfg_.rec.window;
    if (patched() && end < N && end > N - w)
      return status::error(errc::invalid_argument,
                           "%s: patched: chunk [%lld, %lld) ends inside the last %lld prompt tokens [%lld, %lld); the "
                           "final chunk must contain the whole window (end this chunk at or before %lld, or at %lld)",
                           fn, static_cast<long long>(begin), static_cast<long long>(end), static_cast<long long>(w),
                           static_cast<long long>(N - w), static_cast<long long>(N), static_cast<long long>(N - w),
                           static_cast<long long>(N));
    if (end - begin > cfg_.capacity)
      return status::error(errc::capacity_exceeded, "%s: chunk [%lld, %lld) has %lld tokens, more than the capacity %lld",
                           fn, static_cast<long long>(begin), static_cast<long long>(end),
                           static_cast<long long>(end - begin), static_cast<long long>(cfg_.capacity));
    begin_ = begin;
    end_ = end;
    next_ = 0;
    decided_ = cfg_.alloc.kind != allocator::lava;
    open_ = true;
    for (index_t l = 0; l < L; ++l) ready_[l] = 0;
    return {};
  }

  /// Positions the engine appends after the current chunk as extra queries (their token ids are
  /// the prompt's at those positions; their KV is not kept): [N - w, N) for a non-final chunk in
  /// patched mode with an attention recipe, nothing otherwise.
  patch_block patch() const noexcept {
    if (!open_ || !patched() || final_chunk()) return {};
    return {static_cast<pos_t>(cfg_.tokens - cfg_.rec.window), cfg_.rec.window};
  }
  /// Rows of the query block add_layer expects for the current chunk (0: none).
  index_t query_rows() const noexcept {
    if (!open_ || !attention_) return 0;
    if (cfg_.queries == chunk_queries::naive)
      return end_ - begin_ < cfg_.rec.window ? end_ - begin_ : cfg_.rec.window;
    return cfg_.rec.window;  // patched: the patch, or the final chunk's last w tokens
  }
  bool final_chunk() const noexcept { return open_ && end_ == cfg_.tokens; }
  index_t chunk_begin() const noexcept { return begin_; }
  index_t chunk_end() const noexcept { return end_; }
  /// Chunks fully decided so far.
  index_t chunks_done() const noexcept { return chunks_; }

  /// Layer `layer` (in order within the chunk) processed the chunk. kv: its cache, every head
  /// holding the rows it kept after the previous chunk (kept(layer), compacted) followed by the
  /// chunk's rows at positions [s, e); queries: [H_q][query_rows()][d] as the file comment says;
  /// patch_keys: the patch's keys [H][w][d] (patched non-final chunks; optional, an empty view
  /// scores without them). Per-layer allocators select here (ready(layer) afterwards).
  /// Errors (nothing changes): no chunk begun; layer out of order or past L; the layer's layout,
  /// positions (ascending, < e); a head whose row count is not its previous kept count plus the
  /// chunk ("was it compacted with kept(l)?"), or whose last rows are not the chunk; more rows
  /// than the capacity; queries or patch keys of the wrong shape; workspace too small or
  /// overlapping the state; the recorder's errors.
  template <class Backend, class KV, class Q>
  status add_layer(Backend be, workspace& ws, index_t layer, const KV& kv, kv_view<Q> queries,
                   kv_view<const detail::layer_element_t<KV>> patch_keys = {}) {
    return prefill_driver_skeleton::add_layer(be, ws, layer, kv, queries, patch_keys);
  }

  /// add_layer with scores an engine or a trained scorer computed for the layer's current cache
  /// instead of the query block: scores [H][>= rows of a head] (row h: head h's rows, the first
  /// kv.keys.lens[h] columns, in the cache's order), higher = keep. The driver copies them and
  /// protects what the chunk protects (chunk_protection()), so recipe_scores' output with the
  /// chunk's recipe gives exactly add_layer's result. Workspace: add_layer's.
  /// Errors (nothing changes): add_layer's, except the query ones; scores of the wrong shape or NaN.
  template <class Backend, class KV, typename = detail::layer_element_t<KV>>
  status add_layer_scores(Backend be, workspace& ws, index_t layer, const KV& kv, matrix_view<const float> scores) {
    return prefill_driver_skeleton::add_layer_scores(be, ws, layer, kv, scores);
  }

  /// The recipe the current chunk is scored with: naive / final chunks as a prompt window of the
  /// chunk's last query_rows() rows, patched non-final chunks as an external block (the patch)
  /// with only the sinks protected. What an engine scoring the chunk itself reproduces.
  recipe chunk_recipe() const {
    recipe r = cfg_.rec;
    if (patch_active()) {
      r.source = query_source::external_block;
      r.n_recent = 0;
    } else if (attention_) {
      r.window = query_rows();
    }
    return r;
  }
  /// The protected tokens of the current chunk's heads (chunk_recipe()'s {n_sink, n_recent}).
  protection chunk_protection() const { return detail::recipe_protection(chunk_recipe()); }

  /// After the chunk's last layer: the lava allocator shares the model's target (budget mode:
  /// min(total, rows held); fraction: rows held - floor(p x evictable rows)) by the layers'
  /// entropies (apportion with each layer's evictable rows as its cap) and selects every layer;
  /// per-layer allocators have nothing left to do. Errors: not initialised; no chunk; layers
  /// missing; called twice for a chunk; workspace too small; the recorder's errors.
  template <class Backend>
  status decide(Backend be, workspace& ws) { return decide_call(be, ws, next_, scope().text); }

 private:
  /// decide() after detail::prefill_driver_skeleton::decide_call's opening (the call opened, every
  /// layer of the chunk added; st: the status so far).
  template <class Backend>
  status decide_layers(const char* fn, Backend be, workspace& ws, detail::call_scratch& w, status st) {
    const index_t L = cfg_.model.layers, H = cfg_.model.kv_heads;
    if (st.ok() && !open_) st = status::error(errc::invalid_argument, "%s: no chunk was begun (begin_chunk)", fn);
    if (st.ok() && !lava()) return {};
    if (st.ok() && decided_)
      st = status::error(errc::invalid_argument, "%s: chunk [%lld, %lld) was already decided", fn,
                         static_cast<long long>(begin_), static_cast<long long>(end_));
    if (st.ok()) st = check_ws(fn, ws);
    const bool tp = ok_ && lava() && sharded();
    if (tp) {  // every rank agrees first (a rank failing here fails them all)
      detail::config_line config;
      config.print("lava total %lld, chunk [%lld, %lld), %lld layers x %lld heads per rank",
                   static_cast<long long>(cfg_.alloc.total), static_cast<long long>(begin_),
                   static_cast<long long>(end_), static_cast<long long>(L), static_cast<long long>(H));
      comm_ref c = cfg_.tp;
      st = detail::agree(c, fn, st, config, nullptr, 0);
    }
    const bool pp = ok_ && lava() && pipelined(cfg_);
    const detail::stage_span stage{cfg_.pp, cfg_.first_layer, L, model_layers(cfg_)};
    if (pp) {  // the stages agree on the chunk and the model (a stage failing here fails them all)
      detail::config_line config;
      config.print("lava total %lld, chunk [%lld, %lld), %lld model layers x %lld heads", static_cast<long long>(cfg_.alloc.total),
                   static_cast<long long>(begin_), static_cast<long long>(end_),
                   static_cast<long long>(stage.model_layers), static_cast<long long>(H));
      st = stage.agree(fn, st, config);
    }
    KVEVICT_TRY(st);
    // the model's layers: this driver's, or every stage's gathered (pipeline: this stage's at f)
    const index_t ML = stage.model_layers, f = stage.first;
    index_t prot_sum = 0, held = 0;
    held_.protected_totals(L, chunk_protection(), w.caps + f, w.totals + f, &prot_sum, &held);
    detail::held_layers whole = held_;  // with the weights of all ML layers
    if (pp) {
      detail::stage_span::scratch g;
      KVEVICT_TRY(stage.carve(name, w.sel, H, g));
      KVEVICT_TRY(stage.gather(held_.weight, g.weights, g));
      KVEVICT_TRY(stage.gather_rows(w.caps, w.totals, g));
      whole.weight = g.weights;
      detail::held_layers::row_sums(ML, w.caps, w.totals, &prot_sum, &held);
    }
    // the layers' protected and evictable rows over every rank's heads
    if (tp) KVEVICT_TRY(detail::held_layers::sum_over_ranks(cfg_.tp, ML, w.caps, w.totals, &prot_sum, &held));
    index_t keep = cfg_.target == chunk_target::budget ? (cfg_.alloc.total < held ? cfg_.alloc.total : held)
                                                       : held - evict_count(held - prot_sum);
    if (keep < prot_sum) keep = prot_sum;  // not reached: init checks total >= L H (n_sink + n_recent)
    KVEVICT_TRY(whole.share_lava_totals(ML, keep - prot_sum, w.caps, w.shares, w.totals));
    for (index_t l = 0; l < L; ++l) {
      KVEVICT_TRY(select_held(be, w, allocator::lava, cfg_.tp, tp, l, w.totals[f + l],
                              kept_pos_ + l * H * cfg_.capacity, rec_, end_));
      commit(l);
    }
    decided_ = true;
    ++chunks_;
    return {};
  }

 public:

  /// Is layer l's kept list for the current chunk available?
  bool ready(index_t layer) const noexcept { return ok_ && layer >= 0 && layer < cfg_.model.layers && ready_[layer]; }
  /// The rows layer l keeps after the current chunk, per head ascending, as indices into the
  /// rows of the cache given to add_layer (kept so far + the chunk). Empty until ready(l).
  ragged_positions kept(index_t layer) const noexcept { return ready(layer) ? kept(layer, true) : ragged_positions{}; }
  /// Rows head h of layer l holds after the last decision (what the next chunk builds on).
  index_t held(index_t layer, index_t head) const noexcept {
    return ok_ && layer >= 0 && layer < cfg_.model.layers && head >= 0 && head < cfg_.model.kv_heads
               ? expect_[layer * cfg_.model.kv_heads + head]
               : 0;
  }
  /// Rows layer l holds after the last decision, over all its heads.
  index_t layer_total(index_t layer) const noexcept {
    index_t s = 0;
    for (index_t h = 0; h < cfg_.model.kv_heads; ++h) s += held(layer, h);
    return s;
  }
  /// lava: layer l's entropy in the current chunk.
  double layer_weight(index_t layer) const noexcept {
    return ok_ && layer >= 0 && layer < cfg_.model.layers ? held_.weight[layer] : 0.0;
  }

 private:
  /// init's last step (detail::driver_skeleton::init, after the configuration, recorder and memory
  /// checks): the state pieces placed at m.base and reset.
  status attach(const char* /*fn*/, const chunked_config& cfg, const detail::state_memory& m) {
    const plan_t p = plan(cfg);
    cfg_.alloc.budgets = {};
    const index_t L = cfg.model.layers, H = cfg.model.kv_heads;
    const bool matrix = has_matrix(cfg.alloc.kind) && cfg.target == chunk_target::budget;
    bind_store(m.base, p, L, H, cfg.capacity,
               [&](index_t l, index_t h) { return matrix ? cfg.alloc.budgets(l, h) : 0; });
    expect_ = reinterpret_cast<std::int32_t*>(m.base + p.expect);
    for (index_t i = 0; i < L * H; ++i) expect_[i] = 0;
    attention_ = uses_attention(cfg.rec.kind);
    begin_ = end_ = 0;
    next_ = L;  // "the previous chunk is complete"
    decided_ = true;
    open_ = false;
    chunks_ = 0;
    return {};
  }

  struct plan_t : store_plan {
    std::size_t expect = 0;
  };
  /// How add_layer's and decide()'s errors name the pass: " of chunk [s, e)".
  struct scope_text {
    char text[64];
  };
  scope_text scope() const {
    scope_text s;
    std::snprintf(s.text, sizeof s.text, " of chunk [%lld, %lld)", static_cast<long long>(begin_),
                  static_cast<long long>(end_));
    return s;
  }
  bool lava() const noexcept { return cfg_.alloc.kind == allocator::lava; }
  bool patched() const noexcept { return cfg_.queries == chunk_queries::patched && attention_; }
  bool patch_active() const noexcept { return patched() && !final_chunk(); }

  index_t evict_count(index_t evictable) const {
    if (evictable <= 0) return 0;
    const auto e = static_cast<index_t>(std::floor(cfg_.fraction * static_cast<double>(evictable)));
    return e < 0 ? 0 : (e > evictable ? evictable : e);
  }

  /// Where layer l's scores go: the state (lava keeps them until decide) or the workspace.
  float* scores_of(index_t layer, const detail::call_scratch& w) const {
    return lava() ? held_.layer_scores(layer) : w.scores;
  }

  // the hooks of prefill_driver_skeleton's add_layer_queries / add_layer_given_scores
  index_t query_rows_now() const { return query_rows(); }
  bool block_keys_now() const { return patch_active(); }
  recipe score_recipe() const { return chunk_recipe(); }
  index_t score_columns() const { return cfg_.capacity; }
  status check_call_rest(const char* fn, const workspace& ws, index_t, const std::int32_t*, double) const {
    return check_ws(fn, ws);
  }

  /// add_layer's and add_layer_scores' checks: a chunk begun, the layer in order, its layout, its
  /// rows (what it kept after the previous chunk, then the chunk's rows).
  template <class KV>
  status check_layer_call(const char* fn, index_t layer, const KV& kv, bool) const {
    const index_t H = cfg_.model.kv_heads;
    const std::int32_t* lens = detail::layer_lens(kv);
    if (!open_) return status::error(errc::invalid_argument, "%s: no chunk was begun (begin_chunk)", fn);
    KVEVICT_TRY(check_order(fn, layer, next_, cfg_.model.layers, scope().text));
    const index_t n = end_ - begin_;
    detail::row_rules rr;
    rr.tokens = end_;
    rr.capacity = cfg_.capacity;
    rr.tail = n;
    rr.tail_what = "the chunk's tokens";
    KVEVICT_TRY(detail::check_layer_layout(fn, layer, kv, H, cfg_.model.head_dim));
    for (index_t h = 0; h < H; ++h)
      if (lens[h] != expect_[layer * H + h] + n)
        return status::error(errc::shape_mismatch,
                             "%s: layer %lld head %lld holds %d rows; after the previous chunk it kept %d and the "
                             "chunk adds %lld, so it should hold %lld (was it compacted with kept(%lld)?)",
                             fn, static_cast<long long>(layer), static_cast<long long>(h), lens[h],
                             expect_[layer * H + h], static_cast<long long>(n),
                             static_cast<long long>(expect_[layer * H + h] + n), static_cast<long long>(layer));
    return detail::check_layer_rows(fn, layer, kv, rr);
  }

  /// A scored layer (scores: scores_of(layer), protected): lava keeps it until decide(); per-layer
  /// allocators count what each head / the layer keeps, select, record and answer.
  template <class Backend, class KV>
  status add_scored(Backend be, detail::call_scratch& w, index_t layer, const KV& kv, const float* scores, double) {
    const index_t L = cfg_.model.layers, H = cfg_.model.kv_heads, C = cfg_.capacity;
    const auto sv = detail::rows_view<const float>(scores, H, C, C);
    const std::int32_t* lens = detail::layer_lens(kv);
    const protection prot = chunk_protection();
    if (lava()) {
      double e = 0.0;
      KVEVICT_TRY(detail::driver_layer_entropy(be, w.sel, cfg_.tp, sharded(), &in_collective_, sv, lens, prot,
                                               cfg_.alloc.lava_norm, &e));
      held_.store(layer, kv, e);
      next_ = layer + 1;
      return {};
    }
    index_t total = 0;
    for (index_t h = 0; h < H; ++h) {
      const index_t W = protected_count(lens[h], prot.n_sink, prot.n_recent);
      w.counts[h] = static_cast<std::int32_t>(cfg_.target == chunk_target::budget
                                                  ? (budgets_[layer * H + h] < lens[h] ? budgets_[layer * H + h] : lens[h])
                                                  : lens[h] - evict_count(lens[h] - W));
      total += budgets_[layer * H + h];
    }
    if (cfg_.alloc.kind != allocator::per_head) {
      index_t held = 0, W = 0;
      for (index_t h = 0; h < H; ++h) {
        held += lens[h];
        W += protected_count(lens[h], prot.n_sink, prot.n_recent);
      }
      total = cfg_.target == chunk_target::budget ? (total < held ? total : held) : held - evict_count(held - W);
    }
    adakv_options ao;
    ao.alpha = cfg_.alloc.adakv_alpha;
    ao.floor = cfg_.alloc.floor_rule;
    ao.prot = prot;
    if (sharded()) {
      KVEVICT_TRY(select_sharded(be, w, layer, sv, lens, ao));
    } else {
      KVEVICT_TRY(detail::select_layer(be, w.sel, cfg_.alloc.kind, sv, lens, w.counts, total, ao,
                                       kept_cu_ + layer * (H + 1), kept_pos_ + layer * H * C));
    }
    KVEVICT_TRY(detail::record_dropped(rec_, layer, kv, kept(layer, true), end_, w.evicted, w.evicted_cu));
    commit(layer);
    next_ = layer + 1;
    if (next_ == L) ++chunks_;
    return {};
  }

  /// Layers selected across the tensor-parallel ranks.
  bool sharded() const noexcept {
    return cfg_.tp.size() > 1 && (cfg_.alloc.kind == allocator::flattened || cfg_.alloc.kind == allocator::adakv ||
                                  cfg_.alloc.kind == allocator::lava);
  }
  /// Tensor-parallel ranks (1 without a communicator).
  static index_t tp_ranks(const chunked_config& c) { return c.tp.size() > 1 ? c.tp.size() : 1; }
  /// The model's layers (this driver holds model.layers of them).
  static index_t model_layers(const chunked_config& c) { return c.model_layers > 0 ? c.model_layers : c.model.layers; }
  /// lava over pipeline stages: decide() gathers every stage's layer statistics.
  static bool pipelined(const chunked_config& c) { return c.pp.size() > 1 && c.alloc.kind == allocator::lava; }

  /// flattened / adakv across the ranks: the ranks agree on the chunk, the layer and their budget
  /// sum and sum their rows and protected rows; the layer's target is computed from those, as one
  /// process computes it from all its heads; then the sharded selection (or every row kept).
  template <class Backend>
  status select_sharded(Backend be, detail::call_scratch& w, index_t layer, const matrix_view<const float>& sv,
                        const std::int32_t* lens, const adakv_options& ao) {
    constexpr const char* fn = "chunked_driver::add_layer";
    const index_t H = cfg_.model.kv_heads;
    index_t budget = 0;
    std::int64_t sums[2] = {};  // rows, protected rows
    for (index_t h = 0; h < H; ++h) {
      budget += budgets_[layer * H + h];
      sums[0] += lens[h];
      sums[1] += protected_count(lens[h], ao.prot.n_sink, ao.prot.n_recent);
    }
    detail::config_line config;
    config.print("%s chunk [%lld, %lld) layer %lld, %s %.17g, budget sum %lld per rank, %lld heads per rank",
                 allocator_name(cfg_.alloc.kind), static_cast<long long>(begin_), static_cast<long long>(end_),
                 static_cast<long long>(layer), cfg_.target == chunk_target::budget ? "budget" : "fraction",
                 cfg_.target == chunk_target::budget ? 0.0 : cfg_.fraction, static_cast<long long>(budget),
                 static_cast<long long>(H));
    in_collective_ = true;
    comm_ref c = cfg_.tp;
    KVEVICT_TRY(detail::agree(c, fn, status{}, config, sums, 2));
    const index_t held = sums[0], P = c.size();
    const index_t total = cfg_.target == chunk_target::budget ? std::min(budget * P, held)
                                                              : held - evict_count(held - sums[1]);
    std::int32_t* cu = kept_cu_ + layer * (H + 1);
    pos_t* pos = kept_pos_ + layer * H * cfg_.capacity;
    if (total == held) {  // every rank keeps everything (all of them know)
      detail::keep_all_rows(lens, H, cu, pos);
      return {};
    }
    if (cfg_.alloc.kind == allocator::adakv) return adakv_budgets(be, w.sel, c, sv, lens, budget / H, ao, cu, pos);
    return select_topk_flat(be, w.sel, c, sv, lens, total, nullptr, cu, pos);
  }

  /// Tensor parallelism: a call that failed on this rank before its layer's first collective
  /// still joins it, so the other ranks return the same error instead of waiting.
  status joined(const char* fn, const workspace& ws, const status& st, index_t /*layer*/, double /*weight*/) {
    if (ws.is_query() || st.ok() || !ok_ || !sharded() || in_collective_) return st;
    return detail::join_failed_call(cfg_.tp, fn, st, lava() ? 0 : 2);
  }

  void commit(index_t layer) {
    const index_t H = cfg_.model.kv_heads;
    const std::int32_t* cu = kept_cu_ + layer * (H + 1);
    for (index_t h = 0; h < H; ++h) expect_[layer * H + h] = cu[h + 1] - cu[h];
    ready_[layer] = 1;
  }

  static status validate(const char* fn, const chunked_config& c) {
    KVEVICT_TRY(detail::check_model(fn, c.model));
    const index_t L = c.model.layers, H = c.model.kv_heads;
    if (c.tokens <= 0 || c.tokens > INT32_MAX)
      return status::error(errc::invalid_argument, "%s: tokens = %lld is outside [1, %d]", fn,
                           static_cast<long long>(c.tokens), INT32_MAX);
    KVEVICT_TRY(detail::check_capacity(fn, "capacity", c.capacity, H));
    KVEVICT_TRY(detail::check_recipe(fn, c.rec));
    KVEVICT_TRY(detail::check_supported(fn, c.rec.kind == recipe_kind::h2o || c.rec.kind == recipe_kind::tova,
                                        recipe_name(c.rec.kind),
                                        "scores with every / the last prompt query; chunked prefill supports window "
                                        "recipes, knorm and streaming_llm (use the decode or post-fill driver)"));
    if (uses_attention(c.rec.kind)) {
      if (c.rec.source != query_source::prompt_window)
        return status::error(errc::invalid_argument,
                             "%s: the chunked driver chooses the queries; the recipe's source must be prompt_window", fn);
      if (c.rec.window > c.tokens || c.rec.window > c.capacity)
        return status::error(errc::invalid_argument, "%s: the window %lld is longer than the prompt (%lld) or the "
                             "capacity (%lld)", fn, static_cast<long long>(c.rec.window),
                             static_cast<long long>(c.tokens), static_cast<long long>(c.capacity));
    }
    if (c.queries != chunk_queries::naive && c.queries != chunk_queries::patched)
      return status::error(errc::invalid_argument, "%s: unknown chunk_queries value %d", fn, static_cast<int>(c.queries));
    if (c.target != chunk_target::budget && c.target != chunk_target::fraction)
      return status::error(errc::invalid_argument, "%s: unknown chunk_target value %d", fn, static_cast<int>(c.target));
    KVEVICT_TRY(detail::check_allocation_options(fn, c.alloc));
    KVEVICT_TRY(detail::check_pool_pages(fn, c.pool_pages));
    KVEVICT_TRY(detail::stage_span::check(fn, c.pp, c.first_layer, L, c.model_layers < 0 ? c.model_layers : model_layers(c)));
    KVEVICT_TRY(detail::check_supported(fn, c.alloc.kind == allocator::cake, "the cake allocator",
                                        "needs per-layer preferences of the whole prompt; use per_head budgets "
                                        "(cake_budgets) or the post-fill / cascade drivers"));
    if (c.target == chunk_target::fraction) {
      if (!(c.fraction >= 0.0 && c.fraction <= 1.0))
        return status::error(errc::invalid_argument, "%s: fraction = %g is outside [0, 1]", fn, c.fraction);
      return detail::check_supported(fn, c.alloc.kind == allocator::adakv, "adakv",
                                     "shares a per-head budget B_l; use the budget target (or flattened with a "
                                     "fraction)");
    }
    const index_t min_head = c.rec.n_sink + c.rec.n_recent;
    if (has_matrix(c.alloc.kind)) return detail::check_budget_matrix(fn, c.alloc, c.model, min_head, -1);
    index_t floor_total = 0;
    if (!detail::checked_mul(model_layers(c) * H * tp_ranks(c), min_head, floor_total) || c.alloc.total < floor_total)
      return status::error(errc::invalid_argument,
                           "%s: lava total %lld is below the %lld protected tokens (n_sink + n_recent per head)", fn,
                           static_cast<long long>(c.alloc.total), static_cast<long long>(floor_total));
    return {};
  }

  static plan_t plan(const chunked_config& c) {
    plan_t p;
    const index_t L = c.model.layers, H = c.model.kv_heads;
    p.take_store(L, H, c.capacity, L * H * c.capacity, c.alloc.kind == allocator::lava);
    p.expect = p.layout.take(static_cast<std::size_t>(L * H) * sizeof(std::int32_t));
    return p;
  }

  template <class Backend>
  status carve(Backend be, workspace& ws, detail::call_scratch& w) const {
    detail::call_scratch_shape s = scratch_shape(cfg_.capacity);
    s.scores = !lava();
    // the largest of the two scoring shapes: a prompt window of w rows, an external block of w rows
    KVEVICT_TRY(fit_score_slots(be, cfg_.rec, cfg_.rec.window, false, s));
    if (cfg_.queries == chunk_queries::patched && attention_) {
      recipe ext = cfg_.rec;
      ext.source = query_source::external_block;
      ext.n_recent = 0;
      KVEVICT_TRY(fit_score_slots(be, ext, cfg_.rec.window, true, s));
    }
    s.sel = detail::driver_select_bytes(be, sharded(), cfg_.alloc.kind, cfg_.alloc.kind, s.H, s.C, cfg_.tp.size());
    if (pipelined(cfg_)) {  // decide()'s gathers, before its selections
      const detail::stage_span stage{cfg_.pp, cfg_.first_layer, cfg_.model.layers, model_layers(cfg_)};
      const auto bytes = stage.workspace_bytes(name, cfg_.model.kv_heads);
      if (!bytes) return bytes.error();
      s.sel = std::max(s.sel, *bytes);
    }
    s.layers = model_layers(cfg_);
    s.pool_pages = cfg_.pool_pages;
    return detail::carve_call_scratch(name, ws, s, w);
  }

  ragged_positions kept(index_t layer, bool) const noexcept {
    const index_t H = cfg_.model.kv_heads;
    return {kept_pos_ + layer * H * cfg_.capacity, kept_cu_ + layer * (H + 1), H};
  }

  std::int32_t* expect_ = nullptr;
  bool attention_ = false;
  index_t begin_ = 0, end_ = 0, next_ = 0, chunks_ = 0;
  bool decided_ = true, open_ = false;
  bool in_collective_ = false;  // this call reached its layer's first collective
};

}  // namespace kvevict
