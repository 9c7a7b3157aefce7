// runner/generate.hpp: llama2.c's sampler and generation loop.
//
// The sampler reproduces run.c's: greedy argmax at temperature 0; otherwise logits / temperature,
// softmax, one xorshift coin per token, and either plain multinomial sampling (topp <= 0 or >= 1)
// or top-p (nucleus) sampling. With the same seed it draws the same tokens as run.c.
#pragma once

#include <runner/kv_cache.hpp>
#include <runner/ops.hpp>
#include <runner/runner.hpp>
#include <runner/tokenizer.hpp>

#include <kvevict/status.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvrun {

class sampler {
 public:
  /// Errors (invalid_argument): vocab_size <= 0; temperature negative or not finite; topp NaN;
  /// seed 0 (xorshift never leaves state 0; run.c replaces 0 by the time of day).
  status init(int vocab_size, float temperature, float topp, std::uint64_t seed) {
    if (vocab_size <= 0)
      return status::error(errc::invalid_argument, "sampler: vocab_size must be positive (got %d)", vocab_size);
    if (!(temperature >= 0.0f) || !std::isfinite(temperature))
      return status::error(errc::invalid_argument, "sampler: temperature must be finite and >= 0 (got %g)",
                           static_cast<double>(temperature));
    if (std::isnan(topp)) return status::error(errc::invalid_argument, "sampler: topp is NaN");
    if (seed == 0) return status::error(errc::invalid_argument, "sampler: seed must be nonzero (xorshift stays at 0)");
    vocab_ = vocab_size;
    temperature_ = temperature;
    topp_ = topp;
    state_ = seed;
    probs_.assign(static_cast<std::size_t>(vocab_size), 0.0f);
    candidates_.assign(static_cast<std::size_t>(vocab_size), {});
    return {};
  }

  float temperature() const { return temperature_; }
  float topp() const { return topp_; }
  std::uint64_t state() const { return state_; }

  /// The next token from `logits` (vocab_size values, not modified).
  int sample(const float* logits) {
    if (temperature_ == 0.0f) return argmax(logits, vocab_);
    for (int i = 0; i < vocab_; ++i) probs_[static_cast<std::size_t>(i)] = logits[i] / temperature_;
    detail::softmax(probs_.data(), vocab_);
    const float coin = random_f32();
    if (topp_ <= 0.0f || topp_ >= 1.0f) return sample_mult(coin);
    return sample_topp(coin);
  }

  /// run.c's xorshift64* step: the high 32 bits of state * 0x2545F4914F6CDD1D.
  std::uint32_t random_u32() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return static_cast<std::uint32_t>((state_ * 0x2545F4914F6CDD1Dull) >> 32);
  }
  /// Uniform in [0, 1): 24 random bits.
  float random_f32() { return static_cast<float>(random_u32() >> 8) / 16777216.0f; }

  /// Index of the largest value, the first one on ties (NaN never wins unless at index 0).
  static int argmax(const float* v, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i)
      if (v[i] > v[best]) best = i;
    return best;
  }

 private:
  struct candidate {
    float prob;
    int index;
  };
  int vocab_ = 0;
  float temperature_ = 0.0f, topp_ = 0.9f;
  std::uint64_t state_ = 0;
  std::vector<float> probs_;
  std::vector<candidate> candidates_;

  int sample_mult(float coin) const {
    float cdf = 0.0f;
    for (int i = 0; i < vocab_; ++i) {
      cdf += probs_[static_cast<std::size_t>(i)];
      if (coin < cdf) return i;
    }
    return vocab_ - 1;  // rounding
  }

  // Nucleus sampling as run.c: candidates with p >= (1 - topp) / (n - 1) sorted by descending
  // probability (stable: equal probabilities keep index order, as glibc's merge-sort qsort does),
  // cut after the first prefix whose sum exceeds topp, then sampled with coin * that sum.
  int sample_topp(float coin) {
    const float cutoff = vocab_ > 1 ? (1.0f - topp_) / static_cast<float>(vocab_ - 1) : 0.0f;
    std::size_t n0 = 0;
    for (int i = 0; i < vocab_; ++i)
      if (probs_[static_cast<std::size_t>(i)] >= cutoff) candidates_[n0++] = {probs_[static_cast<std::size_t>(i)], i};
    // Nothing reaches the cutoff only for topp < 1 / vocab or NaN logits (run.c then reads
    // outside its array): take the most probable token.
    if (n0 == 0) return argmax(probs_.data(), vocab_);
    std::stable_sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(n0),
                     [](const candidate& a, const candidate& b) { return a.prob > b.prob; });
    float cumulative = 0.0f;
    std::size_t last = n0 - 1;
    for (std::size_t i = 0; i < n0; ++i) {
      cumulative += candidates_[i].prob;
      if (cumulative > topp_) {
        last = i;
        break;
      }
    }
    const float r = coin * cumulative;
    float cdf = 0.0f;
    for (std::size_t i = 0; i <= last; ++i) {
      cdf += candidates_[i].prob;
      if (r < cdf) return candidates_[i].index;
    }
    return candidates_[last].index;  // rounding
  }
};

/// One decode step of continue_generation: feeds the token to the cache and leaves its logits in
/// runner::logits(0) (e.g. the evictor's decode, which adds decode-time eviction).
using decode_step = std::function<status(kv_cache&, int)>;

/// Samples from `logits` (null: the last forward's last row) and keeps decoding, run.c's way:
/// each sampled token is appended to `out` and fed back with `decode` (empty: runner::decode),
/// until the cache's next_position() reaches `steps` (a sampled token is still emitted then, but
/// not fed back) or BOS is sampled (not emitted). Errors: invalid_argument for steps above the
/// context or below the tokens already processed; then those of `decode`.
inline status continue_generation(runner& r, kv_cache& cache, sampler& s, index_t steps, std::vector<int>& out,
                                  const float* logits = nullptr, const decode_step& decode = {}) {
  const config& c = r.get_model().cfg();
  if (steps > c.seq_len || steps < cache.next_position())
    return status::error(errc::invalid_argument, "generate: steps %lld is outside [%d tokens processed, seq_len %d]",
                         static_cast<long long>(steps), cache.next_position(), c.seq_len);
  if (logits == nullptr && r.logits_rows() < 1)
    return status::error(errc::invalid_argument, "generate: the last forward computed no logits to sample from");
  if (logits == nullptr) logits = r.logits(r.logits_rows() - 1);
  for (;;) {
    const int next = s.sample(logits);
    if (next == bos_token) break;
    out.push_back(next);
    if (cache.next_position() >= steps) break;
    KVEVICT_TRY(decode ? decode(cache, next) : r.decode(cache, next));
    logits = r.logits(0);
  }
  return {};
}

/// run.c's generation: prefill `prompt` (one block, on an empty cache) and continue_generation up
/// to `steps` positions in all (prompt included, like run.c's -n). `out` receives the generated
/// tokens (not the prompt). Errors, before anything runs: invalid_argument for an empty prompt, a
/// non-empty cache, steps above the context or a prompt longer than `steps`; then those of
/// runner::forward and continue_generation.
inline status generate(runner& r, kv_cache& cache, sampler& s, const std::vector<int>& prompt, index_t steps,
                       std::vector<int>& out) {
  out.clear();
  if (prompt.empty()) return status::error(errc::invalid_argument, "generate: the prompt has no tokens");
  if (steps > r.get_model().cfg().seq_len)
    return status::error(errc::invalid_argument, "generate: steps %lld is above the context (seq_len %d)",
                         static_cast<long long>(steps), r.get_model().cfg().seq_len);
  if (cache.next_position() != 0)
    return status::error(errc::invalid_argument, "generate: the cache is not empty (next position %d)", cache.next_position());
  if (static_cast<index_t>(prompt.size()) > steps)
    return status::error(errc::invalid_argument, "generate: the prompt has %zu tokens, more than steps %lld", prompt.size(),
                         static_cast<long long>(steps));
  KVEVICT_TRY(r.forward(cache, tokens(prompt), logits_mode::last));
  return continue_generation(r, cache, s, steps, out);
}

/// The text of ids[1..] as run.c prints it: each piece decoded after its predecessor, one-byte
/// pieces that are neither printable nor whitespace skipped. Errors: a token outside the vocabulary.
inline status detokenize(const tokenizer& t, const std::vector<int>& ids, std::string& text) {
  text.clear();
  for (std::size_t i = 1; i < ids.size(); ++i) {
    const auto piece = t.decode(ids[i - 1], ids[i]);
    if (!piece.ok()) return piece.error();
    if (printable_piece(*piece)) text.append(piece->data(), piece->size());
  }
  return {};
}

}  // namespace kvrun
