// methods/laq.hpp: Lookahead Q-Cache (LAQ, LAQ++), /work/shared/papers/lookahead-q-cache-laq.md §4.
//
//   stage 1 (§4.2)  a cheap eviction of a COPY of the prefilled cache (SnapKV, the same budget, the
//                   paper's "SnapKV as the lookahead method, ensuring consistency in budget"), then
//                   `steps` tokens (the paper's 8) decoded greedily with that evicted copy; each
//                   decode step's post-RoPE queries (and keys) at every layer are the Q-Cache.
//   stage 2 (§4.3)  re-eviction of the FULL prompt KV with the Q-Cache as the observation window
//                   (Eq. 4: an external query block; runner/evictor.hpp runs it through the
//                   post-fill driver with SnapKV's scoring and the prompt's window kept);
//   LAQ++ (Eq. 5)   the observation window is the Q-Cache together with the prompt's last w
//                   queries: laq_union_block builds that block.
// laq_queries is both stages' query_source (runner/evict.hpp), the one the evictor is given:
//
//   kvrun::laq_queries laq;
//   KVEVICT_TRY(ev.init(model, o, nullptr, nullptr, &laq));   // o.recipe laq or laq++
//
// The pseudo tokens' own keys come along: in stage 2 each pseudo query attends over the whole prompt
// and, causally, over the pseudo tokens before it (the attention it had when it was decoded, with the
// full prompt instead of the evicted one), as the response oracle does with the true response.
#pragma once

#include <runner/evict.hpp>

namespace kvrun {

/// LAQ stage 1. `full` holds the whole prompt (P rows in every head, not evicted); prompt_q its
/// prefill's queries (every prompt row); prefill_logits the prefill's last-row logits. `copy`
/// receives the evicted copy (SnapKV, uniform budget o.budget, window o.window, the method's sinks)
/// after the pseudo tokens were appended; pseudo receives the o.laq_steps pseudo tokens' queries
/// and keys (row i = the i-th token), tokens their ids (tokens[0] = argmax of prefill_logits, then
/// argmax of each step's logits). `full` is not changed. Errors: the prompt and the pseudo tokens
/// do not fit the context; the drivers' and the runner's errors.
/// LAQ's stage-1 eviction (§4.2): `o` with SnapKV, the uniform budget o.budget and the method's sinks.
inline evict_options laq_stage1_options(const evict_options& o) {
  evict_options stage1 = o;
  stage1.recipe = method::snapkv;
  stage1.alloc = budget_scheme::uniform;
  stage1.sinks = sinks_of(o);
  return stage1;
}

inline status laq_pseudo_queries(runner& run, const kv_cache& full, const block_capture& prompt_q,
                                 const float* prefill_logits, const evict_options& o, kv_cache& copy,
                                 kvevict::post_fill_driver& d, driver_scratch& s, block_capture& pseudo,
                                 std::vector<int>& tokens) {
  const config& c = run.get_model().cfg();
  const index_t P = full.next_position();
  if (P + o.laq_steps > full.capacity())
    return status::error(errc::invalid_argument,
                         "laq: the prompt (%lld tokens) and %lld pseudo tokens do not fit the cache (%lld rows)",
                         static_cast<long long>(P), static_cast<long long>(o.laq_steps),
                         static_cast<long long>(full.capacity()));
  copy = full;
  const evict_options stage1 = laq_stage1_options(o);
  kvevict::post_fill_config cfg;
  cfg.model = shape_of(c);
  cfg.tokens = P;
  cfg.rec = make_recipe(stage1);
  cfg.pool_pages = copy.pool_pages();
  allocation_plan a;
  KVEVICT_TRY(plan_allocation(c, budget_scheme::uniform, o.budget, P, {cfg.rec.n_sink, cfg.rec.n_recent}, nullptr, a));
  cfg.alloc = a.alloc;
  KVEVICT_TRY(post_fill_decide(
      d, s, cfg,
      [&](int l, layer_inputs& in) {
        in.paged = layer_view(copy, l);
        const auto q = kvevict::recipe_queries(cfg.rec, prompt_q.queries(l, 0, P));
        if (q) in.queries = *q;
        return q ? status{} : q.error();
      },
      nullptr));
  KVEVICT_TRY(compact_kept(copy, d));

  pseudo.reset(c, o.laq_steps);
  tokens.clear();
  int tok = sampler::argmax(prefill_logits, c.vocab_size);
  for (index_t i = 0; i < o.laq_steps; ++i) {
    tokens.push_back(tok);
    KVEVICT_TRY(run.decode(copy, tok, pseudo.hooks(i)));
    tok = sampler::argmax(run.logits(0), c.vocab_size);
  }
  return {};
}

/// LAQ++'s query block (Eq. 5, W ∪ Q): rows [0, w) the prompt's last w queries (prompt_q rows
/// P - w .. P - 1) with their keys (the cache's rows P - w .. P - 1), then the pseudo queries and
/// keys. Scored over the prompt's first P - w rows, the block attends exactly as the two parts
/// did: a window row over the prefix and the window up to itself, a pseudo row over the whole
/// prompt and the pseudo rows up to itself.
inline status laq_union_block(const config& c, const kv_cache& full, index_t P, index_t w, const block_capture& prompt_q,
                              const block_capture& pseudo, block_capture& out) {
  const index_t n = pseudo.rows();
  out.reset(c, w + n);
  for (int l = 0; l < c.n_layers; ++l) {
    const auto keys = full.dense_keys(l, P);
    if (!keys) return keys.error();
    out.put(l, 0, prompt_q.queries(l, P - w, w), *kvevict::token_range(*keys, P - w, w));
    out.put(l, w, pseudo.queries(l, 0, n), pseudo.keys(l, 0, n));
  }
  return {};
}

/// The laq and laq++ methods' query_source: stage 1 on a copy of the cache, then the pseudo
/// queries (laq) or their union with the prompt's window (laq++) as the block.
class laq_queries final : public query_source {
 public:
  status compute(runner& run, const kv_cache& cache, const block_capture& prompt_q, const float* prefill_logits,
                 const evict_options& o) override {
    KVEVICT_TRY(laq_pseudo_queries(run, cache, prompt_q, prefill_logits, o, stage1_, driver_, scratch_, pseudo_, tokens_));
    union_block_ = o.recipe == method::laq_pp;
    if (!union_block_) return {};
    return laq_union_block(run.get_model().cfg(), cache, cache.next_position(), o.window, prompt_q, pseudo_, union_);
  }
  /// The last compute()'s block (laq++: the union block).
  const block_capture& block() const override { return union_block_ ? union_ : pseudo_; }
  /// The pseudo tokens of the last compute().
  const std::vector<int>& pseudo_tokens() const { return tokens_; }

 private:
  kv_cache stage1_;
  kvevict::post_fill_driver driver_;
  driver_scratch scratch_;
  block_capture pseudo_, union_;
  bool union_block_ = false;
  std::vector<int> tokens_;
};

}  // namespace kvrun
