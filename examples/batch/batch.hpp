// batch/batch.hpp: several prompts as one batch with continuous decoding (`kvevict-run --batch N`,
// docs/runner.md, "Batches").
//
// Every sequence has its own KV cache (kv_cache.hpp: per-(layer, KV head) block tables), evictor and
// sampler; they share ONE page pool per layer (kv_pool): every head of every sequence takes its
// pages from the layer's free list, so heads and sequences interleave in the pool, and pages freed
// by eviction or by a finished sequence are taken next by any other. The sequences run on a
// batch_scheduler (scheduler.hpp): at most `slots` at a time, one joining per step while a slot is
// free; each step is ONE batched forward (runner::forward_batch) of every running sequence's next
// block -- a prompt chunk (chunked drivers), a whole prompt (post-fill, layer-wise: evicting inside
// that forward, through their hooks), a patched chunk's window, or one decoded token (decode-time
// eviction after it) -- so one step holds sequences at different stages. A sequence leaves when it
// reaches `steps` positions or samples BOS, and its pages go back to the pool. Each sequence
// samples from its own logits right after its forward, and every row's arithmetic is that of the
// single-sequence forward, so its tokens equal those of its prompt run alone, bit for bit.
#pragma once

#include <runner/evictor.hpp>
#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/runner.hpp>
#include <batch/scheduler.hpp>
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
  /// lookaheadkv's scores and laq's / laq++'s query blocks: one per slot (they hold a sequence's
  /// state across steps)
  std::vector<prompt_scorer*> scorers;
  std::vector<query_source*> queries;
  index_t slots = 0;     ///< sequences running at once (0: all)
  bool batched = true;   ///< false: each step's forwards one after another (the baseline)
};

/// The batch's steps and pages (kv_cache's counters, summed over its sequences).
struct batch_stats {
  schedule_stats schedule;    ///< steps, rows, forwards, the steps' time
  index_t steps = 0;          ///< batch steps run (schedule.steps)
  index_t mixed_steps = 0;    ///< steps in which a sequence prefilled while others decoded
  index_t peak_pages = 0;     ///< most pages the batch held at once (the shared pool's peak)
  index_t pool_pages = 0;     ///< pages in the shared pool (all layers)
  index_t pages_freed = 0;    ///< pages eviction gave back
  index_t pages_released = 0; ///< pages given back by sequences leaving the batch
  index_t pages_left = 0;     ///< pages still taken from the pool after every sequence left (0: none leaked)
};

/// Runs `prompts` (token ids, BOS first, each at most settings.steps tokens) as one batch;
/// out[i] receives sequence i's generated tokens (as continue_generation's `out`). Errors (before
/// any forward): no prompts, an empty prompt or one longer than steps, steps above the context,
/// fewer scorers / query sources than slots for the methods that need them; then those of the
/// evictors, the runner and the sampler.
inline status run_batch(const model& m, const std::vector<std::vector<int>>& prompts, const batch_options& bs,
                        std::vector<std::vector<int>>& out, batch_stats& stats) {
  const config& c = m.cfg();
  const index_t n = static_cast<index_t>(prompts.size());
  if (n < 1) return status::error(errc::invalid_argument, "batch: no prompts");
  if (bs.steps < 1 || bs.steps > c.seq_len)
    return status::error(errc::invalid_argument, "batch: steps %lld is outside [1, seq_len %d]",
                         static_cast<long long>(bs.steps), c.seq_len);
  for (index_t i = 0; i < n; ++i) {
    const auto p = static_cast<index_t>(prompts[static_cast<std::size_t>(i)].size());
    if (p < 1 || p > bs.steps)
      return status::error(errc::invalid_argument, "batch: prompt %lld has %lld tokens (1 to steps %lld)",
                           static_cast<long long>(i), static_cast<long long>(p), static_cast<long long>(bs.steps));
  }
  const index_t slots = bs.slots > 0 ? std::min(bs.slots, n) : n;
  const method r = bs.evict.recipe;
  if (r == method::lookaheadkv && static_cast<index_t>(bs.scorers.size()) < slots)
    return status::error(errc::invalid_argument, "batch: lookaheadkv needs a scorer per slot (%zu for %lld slots)",
                         bs.scorers.size(), static_cast<long long>(slots));
  if ((r == method::laq || r == method::laq_pp) && static_cast<index_t>(bs.queries.size()) < slots)
    return status::error(errc::invalid_argument, "batch: %s needs a query source per slot (%zu for %lld slots)",
                         method_name(r), bs.queries.size(), static_cast<long long>(slots));
  const bool full = r == method::full;
  const index_t capacity = full ? bs.steps : c.seq_len, per_head = (capacity + bs.page_size - 1) / bs.page_size;
  kv_pool pool;  // declared before the sequences: their caches give their pages back to it
  KVEVICT_TRY(pool.init(c, bs.pool_pages > 0 ? bs.pool_pages : slots * c.n_kv_heads * per_head, bs.page_size));
  struct sequence {  // a slot's state, reused by the sequences it runs
    kv_cache cache;
    sampler s;
    evictor ev;
    int pending = 0;  // the last emitted token, fed at the next step
    bool done = false;
  };
  std::vector<std::unique_ptr<sequence>> seqs;
  for (index_t i = 0; i < slots; ++i) {
    seqs.push_back(std::make_unique<sequence>());
    KVEVICT_TRY(seqs.back()->cache.init(c, capacity, bs.page_size, &pool));
  }
  batch_scheduler sched;
  KVEVICT_TRY(sched.init(m, slots, bs.threads, bs.batched));
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
  // sequence i, start to end, on slot k (its forwards wait for the batch's steps)
  const batch_scheduler::body body = [&](index_t i, index_t k, runner& run) -> status {
    sequence& q = *seqs[static_cast<std::size_t>(k)];
    const std::vector<int>& prompt = prompts[static_cast<std::size_t>(i)];
    std::vector<int>& o = out[static_cast<std::size_t>(i)];
    KVEVICT_TRY(q.s.init(c.vocab_size, bs.temperature, bs.topp, bs.seed));
    q.done = false;
    if (full) {
      KVEVICT_TRY(run.forward(q.cache, tokens(prompt)));
      emit(q, o, run.logits(run.logits_rows() - 1));
    } else {
      KVEVICT_TRY(q.ev.init(m, bs.evict, bs.duo, r == method::lookaheadkv ? bs.scorers[static_cast<std::size_t>(k)] : nullptr,
                            r == method::laq || r == method::laq_pp ? bs.queries[static_cast<std::size_t>(k)] : nullptr));
      std::vector<int> response;  // the oracle's (the full cache's continuation) or speckv's draft
      if (r == method::oracle) {
        sampler s0;
        KVEVICT_TRY(s0.init(c.vocab_size, bs.temperature, bs.topp, bs.seed));
        KVEVICT_TRY(generate(run, q.cache, s0, prompt, bs.steps, response));
        q.cache.clear();
        if (response.empty())
          return status::error(errc::invalid_argument, "batch: oracle: the full cache generates nothing after prompt %lld",
                               static_cast<long long>(i));
      } else if (r == method::speckv) {
        speckv_drafter drafter;
        KVEVICT_TRY(drafter.init(m, bs.evict.draft_layers));
        KVEVICT_TRY(drafter.draft(prompt, bs.evict.draft_tokens, response));
      }
      KVEVICT_TRY(q.ev.prefill(run, q.cache, prompt, nullptr, &response));
      emit(q, o, q.ev.next_logits());
    }
    sched.decoding(k);
    while (!q.done) {
      KVEVICT_TRY(full ? run.decode(q.cache, q.pending) : q.ev.decode(run, q.cache, q.pending));
      emit(q, o, run.logits(0));
    }
    // the sequence leaves the batch: its pages are free again
    stats.pages_freed += q.cache.pages_freed();
    stats.pages_released += q.cache.pages_in_use();
    q.cache.clear();
    return status{};
  };
  KVEVICT_TRY(sched.run(n, body));
  stats.schedule = sched.stats();
  stats.steps = stats.schedule.steps;
  stats.mixed_steps = stats.schedule.mixed_steps;
  stats.pages_left = pool.in_use();
  stats.peak_pages = pool.peak();
  stats.pool_pages = index_t(c.n_layers) * pool.pages();
  return {};
}

}  // namespace kvrun
