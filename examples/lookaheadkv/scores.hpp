// lookaheadkv/scores.hpp: LookaheadKV eviction scores at inference (Algorithm 2).
//
//   kvrun::lookahead_scorer scorer;
//   KVEVICT_TRY(scorer.init(model, module));              // checks the module against the model
//   KVEVICT_TRY(run.forward(cache, kvrun::tokens(prompt), kvrun::logits_mode::last));
//   KVEVICT_TRY(scorer.score(run, cache));                // the lookahead block, then rolled back
//   for (int l = 0; l < layers; ++l) {
//     kvevict::matrix_view<const float> s = scorer.scores(l);   // [H_kv][T], higher = keep
//     // any protect / budget allocator / select_topk, then cache.compact(l, kept)
//   }
//
// score() runs the module's n lookahead embeddings as an extra block after the T prompt rows
// (runner::forward_extra: positions T .. T + n - 1, their KV dropped afterwards, next_position()
// unchanged). The Lookahead LoRA adapters act through the runner's projection hook, on the
// block's rows only (every row of that block is a lookahead row; the prompt is not recomputed, so
// its KV and logits are untouched). At each layer the block's post-RoPE queries and its own keys
// give the estimate with the library's attention_scores (external block with own keys, causal,
// fp32 softmax over prompt + block, mean over the lookahead rows, prompt columns):
// raw_scores(l) [H_q][T]. Then, as the paper (appendix F: the SnapKV settings, no suffix window):
// max pooling with kernel 7 over the prompt columns and the mean over each GQA group, pooled
// before the group reduction as the library's SnapKV recipe (postprocess_scores with the scorer's
// postprocess_options): scores(l) [H_kv][T]. Nothing is
// protected: the caller's protect / budget stages decide (LookaheadKV keeps no suffix window).
//
// The cache must be dense (every head of every layer holding the same T >= 1 rows: a prefilled,
// not yet evicted prompt) with room for n more rows, and T + n <= seq_len. No allocation after
// init() except the workspace's first growth.
#pragma once

#include <lookaheadkv/module.hpp>
#include <runner/evict.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/workers.hpp>

#include <kvevict/postprocess.hpp>
#include <kvevict/train/lookahead.hpp>
#include <kvevict/score.hpp>
#include <kvevict/status.hpp>

#include <vector>

namespace kvrun {

namespace lkv {

/// A [rows][cols] view with arbitrary positive strides (e.g. a transposed matrix).
template <class T>
kvevict::matrix_view<T> strided(T* p, index_t rows, index_t cols, index_t s0, index_t s1) {
  using exts = cuda::std::dextents<index_t, 2>;
  return kvevict::matrix_view<T>(p, cuda::std::layout_stride::mapping<exts>(exts(rows, cols),
                                                                           cuda::std::array<index_t, 2>{s0, s1}));
}

/// The Lookahead LoRA delta of module `m` on a projection event: out[r][o] += (alpha / rank)
/// ((in[r] A) B)[first + o] for the event's rows and its `out` columns, which are columns
/// [first, first + out) of the `whole`-wide projection (one process: 0 and out; a tensor-parallel
/// rank: its heads' columns, examples/sharded/), each the same expression and summation order as
/// kvevict::lora_linear_forward's on its adapter rows. `xa` [rows][rank] and `delta` [rows][out]:
/// scratch. Nothing for a projection the module does not adapt.
inline status add_lora(const lookahead_module& m, const projection_event& ev, index_t first, index_t whole, float* xa_buf,
                       float* delta_buf) {
  if (!m.adapted(ev.which)) return {};
  const index_t r = m.rank(), in = ev.in, out = ev.out, n = ev.rows;
  const float* a = m.params().data() + m.offset(ev.layer, ev.which);
  const float* b = a + in * r;
  auto x = strided<const float>(ev.input, n, in, ev.input_stride, 1);
  auto xa = strided<float>(xa_buf, n, r, r, 1);
  auto delta = strided<float>(delta_buf, n, out, out, 1);
  KVEVICT_TRY(kvevict::linear_forward(kvevict::seq, x, strided<const float>(a, r, in, 1, r), xa));
  KVEVICT_TRY(kvevict::linear_forward(kvevict::seq, kvevict::matrix_view<const float>(xa),
                                      strided<const float>(b + first, out, r, 1, whole), delta));
  const float scale = m.alpha() / static_cast<float>(r);
  for (index_t i = 0; i < n; ++i)
    for (index_t o = 0; o < out; ++o) ev.output[i * ev.output_stride + o] += scale * delta_buf[i * out + o];
  return {};
}

}  // namespace lkv

class lookahead_scorer : public prompt_scorer {
 public:
  /// Binds the scorer to a module for model `m` (both must outlive it) and allocates its buffers
  /// for prompts up to seq_len. Errors: the module was trained for another model (the first
  /// differing dimension is named), invalid pooling options.
  status init(const model& m, const lookahead_module& mod, const kvevict::postprocess_options& o = {}) {
    KVEVICT_TRY(mod.check_model(m.cfg()));
    if (o.kernel < 1 || o.kernel % 2 == 0)
      return status::error(errc::invalid_argument, "lookahead_scorer: pooling kernel %lld must be odd and >= 1",
                           static_cast<long long>(o.kernel));
    if (o.weight_values)
      return status::error(errc::invalid_argument, "lookahead_scorer: value weighting is not part of LookaheadKV's scores");
    model_ = &m;
    mod_ = &mod;
    opts_ = o;
    const config& c = m.cfg();
    const auto TL = static_cast<std::size_t>(c.seq_len) * static_cast<std::size_t>(c.n_layers);
    raw_.assign(TL * static_cast<std::size_t>(c.n_heads), 0.0f);
    scores_.assign(TL * static_cast<std::size_t>(c.n_kv_heads), 0.0f);
    const index_t widest = std::max<index_t>(c.dim, c.hidden_dim);
    xa_.assign(static_cast<std::size_t>(mod.n_lookahead() * mod.rank()), 0.0f);
    delta_.assign(static_cast<std::size_t>(mod.n_lookahead() * widest), 0.0f);
    T_ = 0;
    return {};
  }

  /// Runs the lookahead block on `cache` (a prefilled prompt, see the file comment) and computes
  /// scores(l) and raw_scores(l) for every layer. The cache is unchanged afterwards. The library
  /// stages run on `par` with the runner's thread count (seq with one thread); results are the
  /// same bits either way. Errors: not initialised, the runner's model is not the scorer's, a
  /// ragged or empty cache, then the runner's (no room for the block, positions past the context)
  /// and the stages'.
  status score(runner& run, kv_cache& cache) override {
    if (model_ == nullptr) return status::error(errc::invalid_argument, "lookahead_scorer: not initialised (call init)");
    if (&run.get_model() != model_)
      return status::error(errc::invalid_argument, "lookahead_scorer: the runner runs another model than the scorer's");
    if (run.threads() > 1) return score_on(kvevict::par_t{run.threads()}, run, cache);
    return score_on(kvevict::seq, run, cache);
  }

  /// Prompt rows scored by the last score().
  index_t tokens() const { return T_; }
  /// Layer l's final scores [H_kv][T] (pooled, GQA-reduced; higher = keep) of the last score().
  kvevict::matrix_view<const float> scores(int l) const override {
    const config& c = model_->cfg();
    return *kvevict::make_matrix_view<const float>(scores_.data() + index_t(l) * c.n_kv_heads * T_, c.n_kv_heads, T_);
  }
  /// Layer l's estimate per query head [H_q][T]: attention_scores' output, before pooling.
  kvevict::matrix_view<const float> raw_scores(int l) const {
    const config& c = model_->cfg();
    return *kvevict::make_matrix_view<const float>(raw_.data() + index_t(l) * c.n_heads * T_, c.n_heads, T_);
  }
  const lookahead_module& module() const { return *mod_; }

 private:
  const model* model_ = nullptr;
  const lookahead_module* mod_ = nullptr;
  kvevict::postprocess_options opts_;
  std::vector<float> raw_, scores_, xa_, delta_;
  std::vector<unsigned char> ws_;
  index_t T_ = 0;

  // out[r] += (alpha / rank) (in[r] A) B for the block's rows (lkv::add_lora over every column)
  status add_lora(const projection_event& ev) { return lkv::add_lora(*mod_, ev, 0, ev.out, xa_.data(), delta_.data()); }

  template <class Backend>
  status score_on(Backend be, runner& run, kv_cache& cache) {
    const config& c = model_->cfg();
    const index_t T = cache.length(0, 0), n = mod_->n_lookahead();
    for (int l = 0; l < c.n_layers; ++l)
      for (index_t h = 0; h < c.n_kv_heads; ++h)
        if (cache.length(l, h) != T)
          return status::error(errc::invalid_argument,
                               "lookahead_scorer: the cache is ragged (layer %d head %lld holds %lld rows, layer 0 head 0 "
                               "%lld); score a prefilled prompt before evicting",
                               l, static_cast<long long>(h), static_cast<long long>(cache.length(l, h)),
                               static_cast<long long>(T));
    if (T < 1) return status::error(errc::invalid_argument, "lookahead_scorer: the cache holds no prompt");
    if (T + n > c.seq_len)
      return status::error(errc::out_of_range,
                           "lookahead_scorer: %lld prompt tokens + %lld lookahead tokens exceed the context of %d",
                           static_cast<long long>(T), static_cast<long long>(n), c.seq_len);
    T_ = T;
    const index_t H = c.n_heads, Hkv = c.n_kv_heads;
    forward_hooks hooks;
    hooks.after_projection = [&](const projection_event& ev) { return add_lora(ev); };
    hooks.after_layer = [&](const layer_event& ev) -> status {
      const auto prefix = cache.dense_keys(ev.layer, T);
      if (!prefix) return prefix.error();
      auto raw = *kvevict::make_matrix_view(raw_.data() + index_t(ev.layer) * H * T, H, T);
      KVEVICT_TRY(with_workspace(ws_, [&](kvevict::workspace& ws) {
        return kvevict::attention_scores(be, ws, ev.queries, *prefix, ev.keys, raw);
      }));
      auto out = *kvevict::make_matrix_view(scores_.data() + index_t(ev.layer) * Hkv * T, Hkv, T);
      return with_workspace(ws_, [&](kvevict::workspace& ws) {
        return kvevict::postprocess_scores(be, ws, kvevict::matrix_view<const float>(raw), out, opts_);
      });
    };
    return run.forward_extra(cache, embeddings(mod_->embeddings(), n), logits_mode::none, hooks);
  }
};

}  // namespace kvrun
