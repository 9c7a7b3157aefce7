// runner/evictor.hpp: one eviction configuration (evict_options) run on the reference runner:
// prefill with eviction by any driver, then decoding (with decode-time eviction for the decode
// driver). See evict.hpp for the pieces and docs/runner.md ("Eviction") for the semantics.
#pragma once

#include <runner/evict.hpp>
#include <runner/workers.hpp>

#include <cstring>
#include <limits>

namespace kvrun {

class evictor {
 public:
  /// Checks the options against the model (check_evict_options) and binds the evictor to `m`
  /// (which must outlive it). `duo`: the head types of the duo method (methods/duo_calibration.hpp), copied.
  /// `scorer`: the scores of the lookaheadkv method (a lookahead_scorer bound to a trained module
  /// for `m`, lookaheadkv/scores.hpp; must outlive the evictor; ignored by the other methods).
  /// `queries`: the query block of the laq and laq++ methods (methods/laq.hpp's laq_queries; must
  /// outlive the evictor; ignored by the other methods).
  /// Errors: the options', duo without head types, lookaheadkv without a scorer, laq without queries.
  status init(const model& m, const evict_options& o, const duo_heads* duo = nullptr, prompt_scorer* scorer = nullptr,
              query_source* queries = nullptr) {
    KVEVICT_TRY(check_evict_options(m.cfg(), o));
    if (allocator_of(o) == budget_scheme::duo &&
        (duo == nullptr || static_cast<index_t>(duo->global.size()) != index_t(m.cfg().n_layers) * m.cfg().n_kv_heads))
      return status::error(errc::invalid_argument, "--recipe %s needs head types (a calibration pass or a head-mask file)",
                           method_name(o.recipe));
    if (o.recipe == method::lookaheadkv && scorer == nullptr)
      return status::error(errc::invalid_argument, "--recipe lookaheadkv needs a trained lookahead module (--lookahead-module)");
    if ((o.recipe == method::laq || o.recipe == method::laq_pp) && queries == nullptr)
      return status::error(errc::invalid_argument, "--recipe %s needs its pseudo queries (a query_source: methods/laq.hpp)",
                           method_name(o.recipe));
    scorer_ = scorer;
    queries_ = queries;
    model_ = &m;
    o_ = o;
    rec_ = make_recipe(o);
    duo_ = duo != nullptr ? *duo : duo_heads{};
    return {};
  }

  const evict_options& options() const { return o_; }
  const kvevict::recipe& recipe() const { return rec_; }
  /// The allocation of the last prefill (budgets per head, totals, Duo's retrieval heads).
  const allocation_plan& allocation() const { return alloc_; }
  /// The logits of the first generated token after prefill / evict_prefilled (the prefill's last
  /// row; for chunked and layer-wise drivers computed with the evicted cache).
  const float* next_logits() const { return logits_.data(); }
  /// Seconds of the last prefill's forward pass(es), eviction excluded; seconds of eviction work
  /// since then (scoring, allocation, selection, compaction, LAQ's stage 1 and pseudo decoding, the
  /// patched chunks' extra forwards, decode-time steps).
  double prefill_seconds() const { return prefill_s_; }
  double evict_seconds() const { return evict_s_; }

  /// Prefills `prompt` (BOS first) into the empty `cache` with eviction as configured; afterwards
  /// next_logits() holds the logits of the first generated token. `response`: the query block of
  /// the oracle (the true continuation) or of speckv (the draft response, speckv.hpp). `rec` (may be null) receives the schedule
  /// (capacity at least the prompt). Errors: a non-empty cache, an empty prompt, a prompt too short
  /// for the window, the oracle without a response, and the drivers' / runner's errors.
  status prefill(runner& run, kv_cache& cache, const std::vector<int>& prompt, kvevict::eviction_recorder* rec,
                 const std::vector<int>* response = nullptr) {
    KVEVICT_TRY(check_prefill(cache, static_cast<index_t>(prompt.size())));
    if (external_response() && (response == nullptr || response->empty()))
      return status::error(errc::invalid_argument, "%s: the %s is needed as the query block", method_name(o_.recipe),
                           o_.recipe == method::oracle ? "true response" : "draft response (speckv.hpp)");
    const config& c = cfg();
    const index_t P = static_cast<index_t>(prompt.size());
    prefill_s_ = evict_s_ = 0.0;
    const driver_kind d = o_.recipe == method::full ? driver_kind::postfill : o_.driver;
    if (head_types() && d != driver_kind::postfill) return prefill_streaming(run, cache, prompt, rec);
    switch (d) {
      case driver_kind::postfill: {
        prompt_q_.reset(c, P);
        const auto t0 = std::chrono::steady_clock::now();
        KVEVICT_TRY(run.forward(cache, tokens(prompt), logits_mode::last, prompt_q_.hooks()));
        prefill_s_ = seconds_since(t0);
        keep_logits(run);
        const block_capture* resp = nullptr;
        if (external_response()) {
          if (P + static_cast<index_t>(response->size()) > cache.capacity())
            return status::error(errc::invalid_argument, "%s: the prompt and the response do not fit the cache",
                                 method_name(o_.recipe));
          response_q_.reset(c, static_cast<index_t>(response->size()));
          KVEVICT_TRY(run.forward_extra(cache, tokens(*response), logits_mode::none, response_q_.hooks()));
          resp = &response_q_;
        }
        const std::vector<float> first = logits_;
        const double p = prefill_s_;
        KVEVICT_TRY(evict_prefilled(run, cache, prompt_q_, first.data(), rec, resp));
        prefill_s_ = p;
        return {};
      }
      case driver_kind::layerwise: return prefill_layerwise(run, cache, prompt, rec);
      case driver_kind::chunked_naive:
      case driver_kind::chunked_patched: return prefill_chunked(run, cache, prompt, rec);
      case driver_kind::decode: return prefill_decode(run, cache, prompt, rec);
    }
    return {};
  }

  /// The post-fill methods on a cache that already holds the whole prompt, not evicted (the report
  /// shares one prefill between them): prompt_q = the prefill's queries of every prompt row,
  /// prefill_logits its last row's logits, response = the true response's queries and keys
  /// (oracle) or the draft response's (speckv). Only for the postfill driver. prefill_seconds() is left at 0.
  status evict_prefilled(runner& run, kv_cache& cache, const block_capture& prompt_q, const float* prefill_logits,
                         kvevict::eviction_recorder* rec, const block_capture* response = nullptr) {
    const config& c = cfg();
    const index_t P = cache.next_position(), L = c.n_layers, H = c.n_kv_heads;
    if (o_.driver != driver_kind::postfill && o_.recipe != method::full)
      return status::error(errc::invalid_argument, "evict_prefilled: the %s driver runs during the prefill",
                           driver_name(o_.driver));
    for (int l = 0; l < L; ++l)
      for (index_t h = 0; h < H; ++h)
        if (cache.length(l, h) != P)
          return status::error(errc::invalid_argument, "evict_prefilled: the cache is not a whole, unevicted prompt");
    if (prompt_q.rows() != P)
      return status::error(errc::invalid_argument, "evict_prefilled: %lld captured query rows for a %lld-token prompt",
                           static_cast<long long>(prompt_q.rows()), static_cast<long long>(P));
    KVEVICT_TRY(check_prompt_length(P));
    logits_.assign(prefill_logits, prefill_logits + c.vocab_size);
    prefill_s_ = 0.0;
    evict_s_ = 0.0;
    if (o_.recipe == method::full) return {};
    const auto t0 = std::chrono::steady_clock::now();
    kvevict::post_fill_config pc;
    pc.model = shape_of(c);
    pc.tokens = P;
    pc.rec = rec_;
    pc.pool_pages = cache.pool_pages();
    // The query block: the query source's (LAQ's pseudo queries, LAQ++'s union of them with the
    // prompt's window) or the caller's response (oracle, speckv); none: the recipe's rows of the prompt.
    const block_capture* blk = response;
    const bool laq_pp = o_.recipe == method::laq_pp;
    if (o_.recipe == method::laq || laq_pp) {
      KVEVICT_TRY(queries_->compute(run, cache, prompt_q, prefill_logits, o_));
      blk = &queries_->block();
    } else if (!external_response()) {
      blk = nullptr;
    } else if (response == nullptr || response->rows() < 1) {
      return status::error(errc::invalid_argument, "%s: its response is needed as the query block", method_name(o_.recipe));
    }
    if (blk != nullptr) pc.query_rows = blk->rows();
    // LAQ++ scores the prompt's first P - w rows with its union block (a window query attends
    // causally inside the window: laq_pp_scores), the window's columns protected by the recipe
    // (n_recent = w): the driver gets the whole layer through add_layer_scores.
    KVEVICT_TRY(plan(P));
    // LookaheadKV (papers/lookaheadkv.md, Algorithm 2): the scorer's scores [H_kv][P] per layer
    // (lookahead_scorer: the module's lookahead rows run as an extra block, its KV rolled back),
    // the sinks protected (0 unless --sinks), no suffix window (the paper's appendix F); a budget
    // of at least the prompt keeps everything without running the module.
    const bool scored = o_.recipe == method::lookaheadkv;
    if (scored && o_.budget >= P) {
      alloc_.total = cache.total_rows();
      evict_s_ = seconds_since(t0);
      return {};
    }
    if (scored) KVEVICT_TRY(scorer_->score(run, cache));
    if (scored) pc.rec.window = 1;  // no queries are read on the scores path: any prompt fits the window
    pc.alloc = alloc_.alloc;
    const bool cake = alloc_.alloc.kind == kvevict::allocator::cake;
    KVEVICT_TRY(post_fill_decide(
        pf_, scratch_, pc,
        [&](int l, layer_inputs& in) {
          in.paged = layer_view(cache, l);
          if (scored) {
            in.scores = scorer_->scores(l);
          } else if (laq_pp) {
            const status st = laq_pp_scores(cache, l, P, *blk);
            if (!st) return st;
            in.scores = *kvevict::make_matrix_view<const float>(laq_scores_.data(), H, P);
          } else if (blk != nullptr) {
            in.queries = blk->queries(l, 0, blk->rows());
            in.block_keys = blk->keys(l, 0, blk->rows());
          } else {
            const auto q = kvevict::recipe_queries(rec_, prompt_q.queries(l, 0, P));
            if (!q) return q.error();
            in.queries = *q;
          }
          if (cake) return window_preference(prompt_q.queries(l, P - o_.window, o_.window), cache, l, P, in.weight);
          return status{};
        },
        rec));
    KVEVICT_TRY(compact_kept(cache, pf_));
    alloc_.total = cache.total_rows();
    evict_s_ = seconds_since(t0);
    return {};
  }

  /// Decodes `token` on `cache` (runner::decode); with the decode driver, decode_driver::step runs
  /// for every layer afterwards and the layers it evicts are compacted; with head types (duo,
  /// prulong, duo-heuristic) and any driver but postfill, the streaming heads drop what left their
  /// window. The logits are run.logits(0).
  status decode(runner& run, kv_cache& cache, int token) {
    const bool streaming = o_.recipe != method::full && head_types() && o_.driver != driver_kind::postfill;
    if (!streaming && (o_.recipe == method::full || o_.driver != driver_kind::decode)) return run.decode(cache, token);
    const config& c = cfg();
    if (streaming) {  // after a streaming prefill, streaming heads drop the key that left their window, every step
      KVEVICT_TRY(run.decode(cache, token));
      const auto t0 = std::chrono::steady_clock::now();
      for (int l = 0; l < c.n_layers; ++l) KVEVICT_TRY(stream_layer(cache, l, cache.next_position()));
      evict_s_ += seconds_since(t0);
      return {};
    }
    forward_hooks hk;
    hk.after_layer = [&](const layer_event& ev) -> status {
      KVEVICT_TRY(step_q_.store(ev, 0));
      push_recent(ev);
      return {};
    };
    KVEVICT_TRY(run.decode(cache, token, hk));
    const auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < c.n_layers; ++l) {
      const kvevict::kv_view<const float> q = decode_queries_of(rec_, step_q_, recent_q_, l, o_.window);
      KVEVICT_TRY(dd_.step(kvevict::seq, decode_ws_, l, layer_view(cache, l), q));
      if (dd_.evicted(l)) KVEVICT_TRY(cache.compact(l, dd_.kept(l)));
    }
    evict_s_ += seconds_since(t0);
    return {};
  }

 private:
  const model* model_ = nullptr;
  evict_options o_;
  kvevict::recipe rec_;
  duo_heads duo_;
  allocation_plan alloc_;
  std::vector<float> logits_;
  std::vector<unsigned char> pref_scratch_, decode_scratch_;
  double prefill_s_ = 0.0, evict_s_ = 0.0;
  block_capture prompt_q_, response_q_, chunk_q_, patch_q_, step_q_, recent_q_;
  std::vector<float> laq_scores_;
  std::vector<unsigned char> laq_scratch_;
  kvevict::post_fill_driver pf_;
  kvevict::cascade_driver cd_;
  kvevict::chunked_driver ch_;
  kvevict::decode_driver dd_;
  kvevict::streaming_heads_driver sh_;
  driver_scratch scratch_;
  kvevict::workspace decode_ws_;  // the decode driver's (in scratch_.ws)
  prompt_scorer* scorer_ = nullptr;
  query_source* queries_ = nullptr;

  const config& cfg() const { return model_->cfg(); }
  // The methods whose query block is a response the caller runs: the true one (oracle), a draft
  // model's (speckv).
  bool external_response() const { return o_.recipe == method::oracle || o_.recipe == method::speckv; }

  // Duo / PruLong head types with the layer-wise, chunked and decode drivers: streaming heads keep
  // their sinks and recent window at every step (kvevict::streaming_heads_driver), retrieval heads
  // everything; alloc_ (plan_allocation) holds the head types.
  bool head_types() const { return allocator_of(o_) == budget_scheme::duo; }
  // alloc_: the allocation for a sequence of `tokens` (the recipe's protection).
  status plan(index_t tokens) {
    return plan_allocation(cfg(), allocator_of(o_), o_.budget, tokens, {rec_.n_sink, rec_.n_recent}, &duo_, alloc_);
  }
  // capacity: the cache's (the heads grow by the decoded tokens after the prefill).
  status init_streaming_heads(kvevict::eviction_recorder* rec, index_t capacity, index_t pool_pages) {
    const config& c = cfg();
    kvevict::streaming_heads_config sc;
    sc.model = shape_of(c);
    sc.capacity = capacity;
    sc.streaming = {rec_.n_sink, rec_.n_recent};
    sc.retrieval = *kvevict::make_matrix_view<const std::uint8_t>(alloc_.retrieval.data(), c.n_layers, c.n_kv_heads);
    sc.pool_pages = pool_pages;
    const auto bytes = kvevict::streaming_heads_driver::state_bytes(sc);
    if (!bytes) return bytes.error();
    return sh_.init(sc, grown(scratch_.state, *bytes), *bytes, rec);
  }
  status stream_layer(kv_cache& cache, int l, index_t tokens) {
    KVEVICT_TRY(sh_.update(l, layer_view(cache, l), tokens));
    if (sh_.evicted(l)) KVEVICT_TRY(cache.compact(l, sh_.kept(l)));
    return {};
  }

  void keep_logits(const runner& run) { logits_.assign(run.logits(0), run.logits(0) + cfg().vocab_size); }

  status check_prefill(const kv_cache& cache, index_t P) const {
    if (model_ == nullptr) return status::error(errc::invalid_argument, "evictor: not initialised (init)");
    if (cache.next_position() != 0)
      return status::error(errc::invalid_argument, "evictor: the cache is not empty (next position %d)", cache.next_position());
    if (P < 1) return status::error(errc::invalid_argument, "evictor: the prompt has no tokens");
    if (P > cache.capacity())
      return status::error(errc::invalid_argument, "evictor: the prompt (%lld tokens) exceeds the cache (%lld rows)",
                           static_cast<long long>(P), static_cast<long long>(cache.capacity()));
    return check_prompt_length(P);
  }

  // Prompt-length checks of the window recipes (the window must fit; LAQ++ and CAKE need a prefix).
  status check_prompt_length(index_t P) const {
    if (o_.recipe == method::full) return {};
    const bool windowed = o_.recipe != method::lookaheadkv &&
                          (kvevict::uses_window(rec_.kind) || rec_.kind == kvevict::recipe_kind::h2o ||
                           o_.recipe == method::laq || o_.recipe == method::laq_pp || o_.recipe == method::speckv ||
                           allocator_of(o_) == budget_scheme::cake);
    if (windowed && o_.driver != driver_kind::decode && o_.window >= P)
      return status::error(errc::invalid_argument,
                           "the prompt has %lld tokens, not more than --window %lld: %s needs a longer prompt",
                           static_cast<long long>(P), static_cast<long long>(o_.window), method_name(o_.recipe));
    if (o_.driver == driver_kind::decode && kvevict::uses_window(rec_.kind) && o_.window > P)
      return status::error(errc::invalid_argument, "the prompt has %lld tokens, fewer than --window %lld",
                           static_cast<long long>(P), static_cast<long long>(o_.window));
    return {};
  }

  status window_preference(kvevict::kv_view<const float> window_q, const kv_cache& cache, int l, index_t P, double& pref) {
    const auto keys = cache.dense_keys(l, P);
    if (!keys) return keys.error();
    return with_workspace(pref_scratch_, [&](kvevict::workspace& ws) {
      return kvevict::cake_window_preference(kvevict::seq, ws, window_q, *keys, kvevict::cake_options{}, &pref);
    });
  }

  // LAQ++'s scores of layer l into laq_scores_ [H][P] (Eq. 5): the recipe's SnapKV scoring of the
  // prompt's first P - w rows with the union block as an external block with its own keys (the
  // window rows attend causally inside the window, the pseudo rows over it), the window's w
  // columns +inf (the recipe protects them: n_recent = w).
  status laq_pp_scores(const kv_cache& cache, int l, index_t P, const block_capture& blk) {
    const index_t H = cfg().n_kv_heads, w = rec_.n_recent, prefix = P - w;
    const auto keys = cache.dense_keys(l, P);
    if (!keys) return keys.error();
    laq_scores_.assign(static_cast<std::size_t>(H * P), std::numeric_limits<float>::infinity());
    const auto out = *kvevict::make_matrix_view(laq_scores_.data(), H, prefix, P);
    kvevict::recipe r = rec_;
    r.n_recent = 0;  // the prefix's own last rows are not protected
    return with_workspace(laq_scratch_, [&](kvevict::workspace& ws) {
      return kvevict::recipe_scores(kvevict::seq, ws, r, blk.queries(l, 0, blk.rows()), *kvevict::token_range(*keys, 0, prefix),
                                    kvevict::kv_view<const float>{}, out, blk.keys(l, 0, blk.rows()));
    });
  }

  // Layer by layer, inside the prefill: cascade_driver for lava / cake, post_fill_driver one layer
  // at a time for the per-layer allocators.
  status prefill_layerwise(runner& run, kv_cache& cache, const std::vector<int>& prompt, kvevict::eviction_recorder* rec) {
    const config& c = cfg();
    const index_t P = static_cast<index_t>(prompt.size());
    const budget_scheme a = allocator_of(o_);
    const bool cascade = a == budget_scheme::lava || a == budget_scheme::cake;
    KVEVICT_TRY(plan(P));
    kvevict::workspace ws;
    if (cascade) {
      kvevict::cascade_driver_config cc;
      cc.model = shape_of(c);
      cc.tokens = P;
      cc.rec = rec_;
      cc.pool_pages = cache.pool_pages();
      cc.total = alloc_.alloc.total;
      cc.split = a == budget_scheme::lava ? kvevict::cascade_split::flattened : kvevict::cascade_split::per_head;
      cc.weight = a == budget_scheme::lava ? kvevict::weight_source::lava_entropy : kvevict::weight_source::caller;
      KVEVICT_TRY(init_driver(cd_, scratch_, cc, rec, ws));
    } else {
      kvevict::post_fill_config pc;
      pc.model = shape_of(c);
      pc.tokens = P;
      pc.rec = rec_;
      pc.pool_pages = cache.pool_pages();
      pc.alloc = alloc_.alloc;
      KVEVICT_TRY(init_driver(pf_, scratch_, pc, rec, ws));
    }
    double hook_s = 0.0;
    forward_hooks hk;
    hk.after_layer = [&](const layer_event& ev) -> status {
      const auto t0 = std::chrono::steady_clock::now();
      const int l = ev.layer;
      const auto q = kvevict::recipe_queries(rec_, ev.queries);
      if (!q) return q.error();
      if (cascade) {
        double weight = 0.0;
        if (a == budget_scheme::cake) KVEVICT_TRY(window_preference(*kvevict::token_range(ev.queries, P - o_.window, o_.window), cache, l, P, weight));
        KVEVICT_TRY(cd_.add_layer(kvevict::seq, ws, l, layer_view(cache, l), *q, {}, weight));
        KVEVICT_TRY(cache.compact(l, cd_.kept(l)));
        for (int j = 0; j < l; ++j)
          if (cd_.changed(j)) KVEVICT_TRY(cache.compact(j, cd_.kept(j)));
      } else {
        KVEVICT_TRY(pf_.add_layer(kvevict::seq, ws, l, layer_view(cache, l), *q));
        KVEVICT_TRY(cache.compact(l, pf_.kept(l)));
      }
      hook_s += seconds_since(t0);
      return {};
    };
    const auto t0 = std::chrono::steady_clock::now();
    KVEVICT_TRY(run.forward(cache, tokens(prompt), logits_mode::last, hk));
    if (!cascade) KVEVICT_TRY(pf_.decide(kvevict::seq, ws));
    const double total = seconds_since(t0);
    keep_logits(run);
    alloc_.total = cache.total_rows();
    evict_s_ = hook_s;
    prefill_s_ = total - hook_s;
    return {};
  }

  // Chunked prefill: forward a chunk (patched: then the prompt's last w tokens as an extra block),
  // score and evict every layer, compact; the next chunk attends over what was kept.
  status prefill_chunked(runner& run, kv_cache& cache, const std::vector<int>& prompt, kvevict::eviction_recorder* rec) {
    const config& c = cfg();
    const index_t P = static_cast<index_t>(prompt.size()), w = o_.window;
    const bool patched = o_.driver == driver_kind::chunked_patched;
    KVEVICT_TRY(plan(P));
    kvevict::chunked_config cc = chunked_config_of(o_, rec_, shape_of(c), P);
    cc.pool_pages = cache.pool_pages();
    cc.alloc = alloc_.alloc;
    kvevict::workspace ws;
    KVEVICT_TRY(init_driver(ch_, scratch_, cc, rec, ws));
    chunk_q_.reset(c, w);
    patch_q_.reset(c, w);
    std::vector<pos_t> patch_pos;
    index_t rows = 0;
    const auto end = [&](index_t s) {
      const index_t e = std::min(s + o_.chunk, P);
      return patched && e < P && e > P - w ? P : e;  // the final chunk holds the whole window
    };
    const auto begin = [&](index_t s, index_t e, forward_hooks& hk) -> status {
      KVEVICT_TRY(ch_.begin_chunk(s, e));
      const index_t n = e - s;
      rows = ch_.query_rows();
      if (rows > 0 && ch_.patch().count == 0)
        hk.after_layer = [this, n, rows](const layer_event& ev) { return chunk_q_.store(ev, 0, n - rows, rows); };
      return {};
    };
    return forward_chunks(run, cache, prompt, end, begin, [&](index_t, index_t) -> status {
      const kvevict::patch_block patch = ch_.patch();
      if (patch.count > 0) {
        patch_pos.resize(static_cast<std::size_t>(patch.count));
        for (index_t i = 0; i < patch.count; ++i) patch_pos[static_cast<std::size_t>(i)] = static_cast<pos_t>(patch.first + i);
        KVEVICT_TRY(run.forward_extra(cache, tokens(prompt.data() + patch.first, patch.count, patch_pos.data()),
                                      logits_mode::none, patch_q_.hooks()));
      }
      for (int l = 0; l < c.n_layers; ++l) {
        kvevict::kv_view<const float> q, pk;
        chunk_queries_of(patch_q_, chunk_q_, patch, rows, l, q, pk);
        KVEVICT_TRY(ch_.add_layer(kvevict::seq, ws, l, layer_view(cache, l), q, pk));
      }
      KVEVICT_TRY(ch_.decide(kvevict::seq, ws));
      return compact_kept(cache, ch_);
    });
  }

  // Head types (duo, prulong, duo-heuristic) with the layer-wise, chunked and decode drivers: the
  // prompt forwarded in chunks (the chunked drivers' --chunk, else the whole prompt at once), after
  // each the streaming heads drop what left their window; retrieval heads keep everything (naive
  // and patched chunks are the same: nothing is scored). The layer-wise driver's rows are these:
  // evicting layer l inside the forward does not change layer l + 1's input.
  status prefill_streaming(runner& run, kv_cache& cache, const std::vector<int>& prompt, kvevict::eviction_recorder* rec) {
    const index_t P = static_cast<index_t>(prompt.size());
    const bool chunked = o_.driver == driver_kind::chunked_naive || o_.driver == driver_kind::chunked_patched;
    // decode: the allocation of a max(B, P)-token sequence, as prefill_decode's
    const index_t bound = o_.driver == driver_kind::decode ? std::max(o_.budget, P) : P;
    KVEVICT_TRY(plan(bound));
    KVEVICT_TRY(init_streaming_heads(rec, cache.capacity(), cache.pool_pages()));
    return forward_chunks(
        run, cache, prompt, [&](index_t s) { return chunked ? std::min(s + o_.chunk, P) : P; },
        [](index_t, index_t, forward_hooks&) { return status{}; },
        [&](index_t, index_t e) -> status {
          for (int l = 0; l < cfg().n_layers; ++l) KVEVICT_TRY(stream_layer(cache, l, e));
          return {};
        });
  }

  // The chunked prefills' loop: chunks [s, end(s)) forwarded with the hooks begin(s, e, hooks)
  // sets, evict(s, e) after each forward; forwards and eviction timed apart, the rows held counted.
  template <class End, class Begin, class Evict>
  status forward_chunks(runner& run, kv_cache& cache, const std::vector<int>& prompt, End&& end, Begin&& begin,
                        Evict&& evict) {
    const index_t P = static_cast<index_t>(prompt.size());
    double forward_s = 0.0, evict_s = 0.0;
    for (index_t s = 0, e = 0; s < P; s = e) {
      e = end(s);
      forward_hooks hk;
      KVEVICT_TRY(begin(s, e, hk));
      auto t0 = std::chrono::steady_clock::now();
      KVEVICT_TRY(run.forward(cache, tokens(prompt.data() + s, e - s), logits_mode::last, hk));
      forward_s += seconds_since(t0);
      keep_logits(run);
      t0 = std::chrono::steady_clock::now();
      KVEVICT_TRY(evict(s, e));
      evict_s += seconds_since(t0);
    }
    alloc_.total = cache.total_rows();
    prefill_s_ = forward_s;
    evict_s_ = evict_s;
    return {};
  }

  // Decode-time eviction: a plain prefill (the prompt stays whole until the first eviction step),
  // then decode() steps the driver. H2O starts from the prompt's accumulated attention.
  status prefill_decode(runner& run, kv_cache& cache, const std::vector<int>& prompt, kvevict::eviction_recorder* rec) {
    const config& c = cfg();
    const index_t P = static_cast<index_t>(prompt.size()), L = c.n_layers, H = c.n_kv_heads, w = o_.window;
    prompt_q_.reset(c, P);
    auto t0 = std::chrono::steady_clock::now();
    KVEVICT_TRY(run.forward(cache, tokens(prompt), logits_mode::last, prompt_q_.hooks()));
    prefill_s_ = seconds_since(t0);
    keep_logits(run);
    t0 = std::chrono::steady_clock::now();
    // budgets: the cache goes back to B per head; the allocation is made for a sequence of
    // max(B, P) tokens (a prompt shorter than B does not bound it; PyramidKV's shape is computed
    // over the prompt when B < P)
    const index_t bound = std::max(o_.budget, P);
    KVEVICT_TRY(plan(bound));
    kvevict::decode_config dc;
    dc.model = shape_of(c);
    // a head holds at most the prompt, or what it may keep after an eviction, plus the tokens
    // decoded until the next one (with adakv one head may keep its layer's whole share)
    dc.capacity = std::min<index_t>(cache.capacity(), std::max(P, kvevict::max_head_rows(alloc_.alloc)) + o_.evict_every);
    dc.interval = o_.evict_every;
    dc.rec = rec_;
    dc.pool_pages = cache.pool_pages();
    dc.alloc = alloc_.alloc;
    KVEVICT_TRY(init_driver(dd_, scratch_, dc, rec, decode_ws_));
    std::vector<float> initial(rec_.kind == kvevict::recipe_kind::h2o ? static_cast<std::size_t>(H * P) : 0);
    kvevict::recipe hr = rec_;  // H2O: the prompt's accumulated attention, unprotected
    hr.n_sink = hr.n_recent = 0;
    for (int l = 0; l < L; ++l) {
      kvevict::matrix_view<const float> init_scores;
      if (rec_.kind == kvevict::recipe_kind::h2o) {
        const auto keys = cache.dense_keys(l, P);
        if (!keys) return keys.error();
        const auto out = *kvevict::make_matrix_view(initial.data(), H, P);
        KVEVICT_TRY(with_workspace(decode_scratch_, [&](kvevict::workspace& ws) {
          return kvevict::recipe_scores(kvevict::seq, ws, hr, prompt_q_.queries(l, 0, P), *keys,
                                        kvevict::kv_view<const float>{}, out);
        }));
        init_scores = out;
      }
      KVEVICT_TRY(dd_.begin(kvevict::seq, decode_ws_, l, layer_view(cache, l), P, init_scores));
    }
    // the last w queries, for the window recipes' eviction steps
    step_q_.reset(c, 1);
    recent_q_.reset(c, w);
    const index_t have = std::min(w, P);
    for (int l = 0; l < L; ++l) recent_q_.put(l, w - have, prompt_q_.queries(l, P - have, have));
    evict_s_ = seconds_since(t0);
    alloc_.total = cache.total_rows();
    return {};
  }

  // Shifts the window of recent queries by one row and appends the new token's.
  void push_recent(const layer_event& ev) {
    const config& c = cfg();
    const index_t w = o_.window, d = c.head_size();
    for (index_t h = 0; h < c.n_heads; ++h) {
      float* first = recent_q_.query_row(ev.layer, h, 0);
      std::memmove(first, first + d, static_cast<std::size_t>((w - 1) * d) * sizeof(float));
    }
    recent_q_.put(ev.layer, w - 1, ev.queries);
  }
};

}  // namespace kvrun
