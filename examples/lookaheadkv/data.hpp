// lookaheadkv/data.hpp: model-generated (prompt X, response Y) pairs, LookaheadKV's training
// data (§4.1: "truncate the text at random positions to obtain X, and use the target model to
// complete the sequence to obtain Y", greedy), built from the model alone.
//
//   std::vector<kvrun::text_pair> pairs;
//   kvrun::make_pairs(model, {}, kvrun::test_seed_base, kvrun::test_seed_base + 128, pairs);
//
// Pair `seed` is a function of the seed alone (not of the range or the thread count):
//   1. its prompt length P: with probability `short_fraction` uniform in [min_prompt, long_min),
//      otherwise uniform in [long_min, max_prompt] (max_prompt = seq_len - response by default,
//      long_min = max_prompt - 128): most prompts fill the context minus the response;
//   2. X = BOS, then P - 1 tokens sampled from the model (temperature 1, top-p 0.9: run.c's
//      defaults) with the full cache. A sampled BOS ends a story and is kept: the next story
//      follows, as in the stories the model was trained on. X therefore ends at an arbitrary point
//      of a story (the paper's random truncation);
//   3. Y = the next `response` tokens decoded greedily with the full cache (BOS included if the
//      model emits it; generation goes on after it).
// The splits are disjoint seed ranges: training [train_seed_base, ...), validation (the
// periodic held-out loss printed during training) [validation_seed_base, ...) and test (the
// quality report; training never sees it) [test_seed_base, ...).
#pragma once

#include <lookaheadkv/module.hpp>
#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/workers.hpp>

#include <kvevict/status.hpp>

#include <cstdint>
#include <functional>
#include <vector>


namespace kvrun {

inline constexpr std::uint64_t train_seed_base = 1;
inline constexpr std::uint64_t validation_seed_base = 1000000;
inline constexpr std::uint64_t test_seed_base = 2000000;

struct pair_options {
  index_t response = 64;        ///< |Y|, greedy
  index_t max_prompt = 0;       ///< longest X (0: seq_len - response)
  index_t long_min = 0;         ///< shortest "long" X (0: max_prompt - 128, at least min_prompt)
  index_t min_prompt = 64;      ///< shortest X
  double short_fraction = 0.25; ///< share of prompts drawn from [min_prompt, long_min)
  float temperature = 1.0f;     ///< sampling of X (run.c's defaults)
  float topp = 0.9f;
};

/// One training / evaluation example: X starts with BOS; |Y| = pair_options::response.
struct text_pair {
  std::uint64_t seed = 0;
  std::vector<int> prompt;
  std::vector<int> response;
};

namespace detail {

inline status resolve_pair_options(const config& c, pair_options& o) {
  if (o.response < 1 || o.response >= c.seq_len)
    return status::error(errc::invalid_argument, "pairs: response length %lld is outside [1, %d)",
                         static_cast<long long>(o.response), c.seq_len);
  if (o.max_prompt == 0) o.max_prompt = c.seq_len - o.response;
  if (o.long_min == 0) o.long_min = std::max(o.min_prompt, o.max_prompt - 128);
  if (o.min_prompt < 2 || o.min_prompt > o.long_min || o.long_min > o.max_prompt || o.max_prompt + o.response > c.seq_len)
    return status::error(errc::invalid_argument,
                         "pairs: prompt lengths need 2 <= min_prompt (%lld) <= long_min (%lld) <= max_prompt (%lld) "
                         "and max_prompt + response (%lld) <= seq_len (%d)",
                         static_cast<long long>(o.min_prompt), static_cast<long long>(o.long_min),
                         static_cast<long long>(o.max_prompt), static_cast<long long>(o.response), c.seq_len);
  if (!(o.short_fraction >= 0.0 && o.short_fraction <= 1.0))
    return status::error(errc::invalid_argument, "pairs: short_fraction %g is outside [0, 1]", o.short_fraction);
  return {};
}

/// Pair `seed` with a runner and cache of its own (see the file comment). Afterwards the cache
/// holds X and the first |Y| - 1 response tokens; `prompt_end` (if not null) receives a checkpoint
/// taken right after X, to roll back to.
inline status make_pair(runner& run, kv_cache& cache, const pair_options& o, std::uint64_t seed, text_pair& out,
                        cache_checkpoint* prompt_end = nullptr) {
  const config& c = run.get_model().cfg();
  splitmix64 g{derive_seed(seed, 0x5eed)};
  const bool is_short = o.long_min > o.min_prompt && g.uniform() < o.short_fraction;
  const index_t P = is_short ? g.between(o.min_prompt, o.long_min - 1) : g.between(o.long_min, o.max_prompt);
  sampler s;
  KVEVICT_TRY(s.init(c.vocab_size, o.temperature, o.topp, derive_seed(seed, 1) | 1u));
  out.seed = seed;
  out.prompt.assign(1, bos_token);
  out.response.clear();
  cache.clear();
  KVEVICT_TRY(run.decode(cache, bos_token));
  while (static_cast<index_t>(out.prompt.size()) < P) {
    const int t = s.sample(run.logits(0));
    out.prompt.push_back(t);
    KVEVICT_TRY(run.decode(cache, t));
  }
  if (prompt_end != nullptr) *prompt_end = cache.save();
  while (static_cast<index_t>(out.response.size()) < o.response) {
    const int t = sampler::argmax(run.logits(0), c.vocab_size);
    out.response.push_back(t);
    if (static_cast<index_t>(out.response.size()) < o.response) KVEVICT_TRY(run.decode(cache, t));
  }
  return {};
}

}  // namespace detail

/// Pairs for seeds [seed_begin, seed_end), in seed order, generated on `threads` OpenMP threads
/// (0: all) with one runner and cache each; the result does not depend on the thread count.
/// `progress(done, total)` is called from the calling thread now and then (may be empty).
/// Errors: invalid options (lengths that do not fit the context), then the runner's.
inline status make_pairs(const model& m, pair_options o, std::uint64_t seed_begin, std::uint64_t seed_end,
                         std::vector<text_pair>& out, int threads = 0,
                         const std::function<void(index_t, index_t)>& progress = {}) {
  KVEVICT_TRY(detail::resolve_pair_options(m.cfg(), o));
  const index_t n = seed_end > seed_begin ? static_cast<index_t>(seed_end - seed_begin) : 0;
  std::vector<text_pair> pairs(static_cast<std::size_t>(n));
  std::vector<runner_worker> workers(static_cast<std::size_t>(thread_count(threads)));
  for (runner_worker& w : workers) KVEVICT_TRY(w.init(m, {1, 0, 1}));
  KVEVICT_TRY(for_each_item(
      workers, n,
      [&](runner_worker& w, index_t i) {
        return detail::make_pair(w.run, w.cache, o, seed_begin + static_cast<std::uint64_t>(i),
                                 pairs[static_cast<std::size_t>(i)]);
      },
      [&](index_t d, int t) {
        if (t == 0 && progress) progress(d, n);
      }));
  if (progress) progress(n, n);
  out = std::move(pairs);
  return {};
}

/// Training texts (the Duo calibration's): `count` pairs of the training seed range
/// [train_seed_base, +count) (prompt followed by its greedy response), generated with options `po`.
inline status training_texts(const model& m, const pair_options& po, index_t count, std::vector<std::vector<int>>& texts,
                             int threads = 0) {
  std::vector<text_pair> pairs;
  KVEVICT_TRY(make_pairs(m, po, train_seed_base, train_seed_base + static_cast<std::uint64_t>(count), pairs, threads));
  texts.clear();
  for (const text_pair& p : pairs) {
    std::vector<int> t = p.prompt;
    t.insert(t.end(), p.response.begin(), p.response.end());
    texts.push_back(std::move(t));
  }
  return {};
}

}  // namespace kvrun
