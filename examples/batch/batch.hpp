// batch/batch.hpp: several prompts as one batch with continuous decoding (`kvevict-run --batch N`,
// docs/runner.md, "Batches").
//
// Every sequence has its own KV cache (kv_cache.hpp: per-(layer, KV head) block tables), evictor and
// sampler; they share the runner and ONE page pool per layer (kv_pool): every head of every sequence
// takes its pages from the layer's free list, so heads and sequences interleave in the pool, and
// pages freed by eviction or by a finished sequence are taken next by any other. Sequence i arrives at step i: in that step it is prefilled (with eviction as configured)
// and samples its first token, while the sequences that arrived before it each decode one token
// (decode-time eviction included), so one step holds sequences at different stages. A sequence
// leaves the batch when it reaches `steps` positions or samples BOS, and its pages go back to the
// pool's free lists. The forwards of a step run one sequence after another (the runner has no batched
// forward), and each sequence samples from its own logits right after its forward, so every
// sequence's tokens equal those of its prompt run alone, bit for bit.
#pragma once

#include <runner/evictor.hpp>
#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/runner.hpp>
#include <methods/speckv.hpp>

#include <kvevict/status.hpp>

#include <algorithm>
#include <memory>
#include <vector>

namespace kvrun {

/// What run_batch needs besides the prompts: the run's settings and the evictors' shared inputs.
struct batch_options {
  index_t steps = 0;      ///< positions per sequence, prompt included
  index_t page_size = 16;
  /// Pages per layer of the shared pool; 0: room for every sequence at its full capacity
  /// (sequences x KV heads x ceil(capacity / page_size)). A smaller pool fails a forward that
  /// lacks pages with capacity_exceeded.
  index_t pool_pages = 0;
  float temperature = 0.0f, topp = 0.9f;
  std::uint64_t seed = 42;
  int threads = 0;
  evict_options evict;               ///< evict.recipe == method::full: no eviction
  const duo_heads* duo = nullptr;    ///< duo methods' head types
  prompt_scorer* scorer = nullptr;   ///< lookaheadkv's scores
  query_source* queries = nullptr;   ///< laq's and laq++'s query blocks (one sequence prefills at a time)
};

/// The batch's pages over its steps (kv_cache's counters, summed over its sequences).
struct batch_stats {
  index_t steps = 0;          ///< batch steps run
  index_t mixed_steps = 0;    ///< steps in which one sequence prefilled while others decoded
  index_t peak_pages = 0;     ///< most pages the batch held at once (the shared pool's peak)
  index_t pool_pages = 0;     ///< pages in the shared pool (all layers)
  index_t pages_freed = 0;    ///< pages eviction gave back
  index_t pages_released = 0; ///< pages given back by sequences leaving the batch
};

/// Runs `prompts` (token ids, BOS first, each at most settings.steps tokens) as one batch;
/// out[i] receives sequence i's generated tokens (as continue_generation's `out`). Errors (before
/// any forward): no prompts, an empty prompt or one longer than steps, steps above the context;
/// then those of the evictors, the runner and the sampler.
inline status run_batch(const model& m, const std::vector<std::vector<int>>& prompts, const batch_options& bs,
                        std::vector<std::vector<int>>& out, batch_stats& stats) {
  const config& c = m.cfg();
  const index_t n = static_cast<index_t>(prompts.size());
  if (n < 1) return status::error(errc::invalid_argument, "batch: no prompts");
  if (bs.steps < 1 || bs.steps > c.seq_len)
    return status::error(errc::invalid_argument, "batch: steps %lld is outside [1, seq_len %d]",
                         static_cast<long long>(bs.steps), c.seq_len);
  index_t longest = 0;
  for (index_t i = 0; i < n; ++i) {
    const auto p = static_cast<index_t>(prompts[static_cast<std::size_t>(i)].size());
    if (p < 1 || p > bs.steps)
      return status::error(errc::invalid_argument, "batch: prompt %lld has %lld tokens (1 to steps %lld)",
                           static_cast<long long>(i), static_cast<long long>(p), static_cast<long long>(bs.steps));
    longest = std::max(longest, p);
  }
  const bool full = bs.evict.recipe == method::full;
  runner run;  // sized as the single-sequence run sizes it (kvevict_run.cpp)
  KVEVICT_TRY(run.init(m, {full ? longest : 0, full ? bs.steps : 0, bs.threads}));

  const index_t capacity = full ? bs.steps : c.seq_len, per_head = (capacity + bs.page_size - 1) / bs.page_size;
  kv_pool pool;  // declared before the sequences: their caches give their pages back to it
  KVEVICT_TRY(pool.init(c, bs.pool_pages > 0 ? bs.pool_pages : n * c.n_kv_heads * per_head, bs.page_size));
  struct sequence {
    kv_cache cache;
    sampler s;
    evictor ev;
    int pending = 0;  // the last emitted token, fed at the next step
    bool done = false;
  };
  std::vector<std::unique_ptr<sequence>> seqs;
  seqs.reserve(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) {
    auto q = std::make_unique<sequence>();
    KVEVICT_TRY(q->cache.init(c, capacity, bs.page_size, &pool));
    KVEVICT_TRY(q->s.init(c.vocab_size, bs.temperature, bs.topp, bs.seed));
    if (!full) KVEVICT_TRY(q->ev.init(m, bs.evict, bs.duo, bs.scorer, bs.queries));
    seqs.push_back(std::move(q));
  }
  out.assign(static_cast<std::size_t>(n), {});
  stats = {};

  // continue_generation's loop body, one token: sample, emit, stop at steps or BOS
  const auto emit = [&](sequence& q, std::vector<int>& o, const float* logits) {
    const int next = q.s.sample(logits);
    if (next == bos_token) {
      q.done = true;
      return;
    }
    o.push_back(next);
    q.done = q.cache.next_position() >= bs.steps;
    q.pending = next;
  };
  const auto start = [&](index_t i) -> status {
    sequence& q = *seqs[static_cast<std::size_t>(i)];
    const std::vector<int>& prompt = prompts[static_cast<std::size_t>(i)];
    if (full) {
      KVEVICT_TRY(run.forward(q.cache, tokens(prompt)));
      emit(q, out[static_cast<std::size_t>(i)], run.logits(run.logits_rows() - 1));
      return {};
    }
    std::vector<int> response;  // the oracle's (the full cache's continuation) or speckv's draft
    if (bs.evict.recipe == method::oracle) {
      sampler s0;
      KVEVICT_TRY(s0.init(c.vocab_size, bs.temperature, bs.topp, bs.seed));
      KVEVICT_TRY(generate(run, q.cache, s0, prompt, bs.steps, response));
      q.cache.clear();
      if (response.empty())
        return status::error(errc::invalid_argument, "batch: oracle: the full cache generates nothing after prompt %lld",
                             static_cast<long long>(i));
    } else if (bs.evict.recipe == method::speckv) {
      speckv_drafter drafter;
      KVEVICT_TRY(drafter.init(m, bs.evict.draft_layers));
      KVEVICT_TRY(drafter.draft(prompt, bs.evict.draft_tokens, response));
    }
    KVEVICT_TRY(q.ev.prefill(run, q.cache, prompt, nullptr, &response));
    emit(q, out[static_cast<std::size_t>(i)], q.ev.next_logits());
    return {};
  };

  index_t arrived = 0;
  for (;;) {
    index_t decoding = 0;
    for (index_t i = 0; i < arrived; ++i) {  // the sequences already in the batch: one token each
      sequence& q = *seqs[static_cast<std::size_t>(i)];
      if (q.done) continue;
      KVEVICT_TRY(full ? run.decode(q.cache, q.pending) : q.ev.decode(run, q.cache, q.pending));
      emit(q, out[static_cast<std::size_t>(i)], run.logits(0));
      ++decoding;
    }
    const bool prefilling = arrived < n;
    if (prefilling) KVEVICT_TRY(start(arrived++));
    if (!prefilling && decoding == 0) break;
    ++stats.steps;
    stats.mixed_steps += prefilling && decoding > 0;
    for (index_t i = 0; i < arrived; ++i) {  // finished sequences leave the batch: their pages are free again
      sequence& q = *seqs[static_cast<std::size_t>(i)];
      if (!q.done || q.cache.next_position() == 0) continue;
      stats.pages_freed += q.cache.pages_freed();
      stats.pages_released += q.cache.pages_in_use();
      q.cache.clear();
    }
  }
  stats.peak_pages = pool.peak();
  stats.pool_pages = index_t(c.n_layers) * pool.pages();
  return {};
}

}  // namespace kvrun
