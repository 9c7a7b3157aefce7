// methods/speckv.hpp: SpecKV's draft response (Galim et al. 2025, the LookaheadKV paper's baseline):
// a smaller draft model generates an approximate response greedily; the target model then runs it
// as an external query block over the prompt (evictor.hpp, like the oracle's true response) and its
// attention scores the prompt, SnapKV-style with the window kept (as LAQ's pseudo queries).
//
// No smaller model is shipped with stories260K, so the draft is derived from the target: its first
// `draft_layers` layers (2 of 5 by default) with the final RMSNorm and the output head -- an early
// exit. It shares the target's tokenizer and embedding, costs draft_layers / n_layers of a target
// forward per token, and is run as SpecKV runs its draft: a prefill of the prompt, then one decode
// step per draft token (the cost is counted; the draft's prefill could share the target's first
// layers' KV, which a separate draft model cannot).
#pragma once

#include <runner/evict.hpp>
#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>

#include <chrono>
#include <vector>

namespace kvrun {

class speckv_drafter {
 public:
  /// The draft model: `target`'s first `layers` layers and its output head, single-threaded.
  /// Errors: layers outside [1, n_layers].
  status init(const model& target, index_t layers) {
    if (layers < 1 || layers > target.cfg().n_layers)
      return status::error(errc::invalid_argument, "--draft-layers %lld is outside [1, %d] (the model's layers)",
                           static_cast<long long>(layers), target.cfg().n_layers);
    KVEVICT_TRY(target.first_layers(static_cast<int>(layers), draft_));
    KVEVICT_TRY(run_.init(draft_, {0, 0, 1}));
    return cache_.init(draft_.cfg());
  }
  const model& draft_model() const { return draft_; }

  /// The `n` greedy draft tokens after `prompt` (BOS first): out[0] = argmax of the draft's prefill
  /// logits, then one decode step per token. seconds() = the time it took. Errors: not initialised,
  /// an empty prompt, the prompt and the draft do not fit the context, the runner's.
  status draft(const std::vector<int>& prompt, index_t n, std::vector<int>& out) {
    const config& c = draft_.cfg();
    if (c.n_layers == 0) return status::error(errc::invalid_argument, "speckv_drafter: not initialised (init)");
    const index_t P = static_cast<index_t>(prompt.size());
    if (P < 1) return status::error(errc::invalid_argument, "speckv: the prompt has no tokens");
    if (n < 1 || P + n > c.seq_len)
      return status::error(errc::invalid_argument, "speckv: the prompt (%lld tokens) and %lld draft tokens do not fit "
                           "the context of %d", static_cast<long long>(P), static_cast<long long>(n), c.seq_len);
    const auto t0 = std::chrono::steady_clock::now();
    out.clear();
    cache_.clear();
    KVEVICT_TRY(run_.forward(cache_, tokens(prompt)));
    int tok = sampler::argmax(run_.logits(0), c.vocab_size);
    for (index_t i = 0; i < n; ++i) {
      out.push_back(tok);
      if (i + 1 == n) break;
      KVEVICT_TRY(run_.decode(cache_, tok));
      tok = sampler::argmax(run_.logits(0), c.vocab_size);
    }
    seconds_ = seconds_since(t0);
    return {};
  }
  double seconds() const { return seconds_; }

 private:
  model draft_;
  runner run_;
  kv_cache cache_;
  double seconds_ = 0.0;
};

}  // namespace kvrun
