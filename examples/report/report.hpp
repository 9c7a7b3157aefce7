// report/report.hpp: the quality report of kvevict's eviction methods on the reference runner
// (`kvevict-run --report`, docs/report.md).
//
// Prompts: the pair generator's TEST split (lookaheadkv/data.hpp: model-generated stories cut at a
// random point, the prompt filling the 512-token context minus the response; short prompts off),
// each with the full cache's greedy response of `pairs.response` tokens. For every configuration
// (recipe x driver x budget) and prompt, against the full cache:
//   recall      mean over layers and KV heads of |prompt positions held ∩ top-k(GT)| / k,
//               k = min(budget, P) (kvevict::kept_recall_at_k), averaged over the m - 1 decoded
//               response tokens (the cache each one attends; constant unless eviction runs at
//               decode time), where GT[l][h] = the mean attention of the true response's queries
//               over the prompt (the response as an external block with its own keys, GQA mean:
//               the oracle's scores);
//   kl          mean over the response's m positions of KL(full || evicted) of the next-token
//               distributions, teacher-forced (position 0: the prefill's last row);
//   agreement   greedy tokens generated with the evicted cache before the first one that differs
//               from the full cache's response (computed from the teacher-forced logits: while the
//               tokens agree, greedy generation feeds exactly the teacher-forced inputs);
//   top1        teacher-forced top-1 agreement: the fraction of the m response positions whose
//               argmax equals the full cache's greedy token (1 for the full cache: the footprint
//               protocol's performance, footprint.hpp);
//   footprint, peak   kvevict::measure_kv_usage of the schedule the driver recorded over the
//               P + m - 1 tokens whose queries run (prefill and decode);
//   evict_ms, prefill_ms   medians over the prompts of the eviction work and of the prefill's
//               forward (evictor::evict_seconds / prefill_seconds);
//   overhead    median over the prompts of (prefill_ms + evict_ms) / prefill_ms, both measured on
//               the same prompt by the same thread (post-fill rows share one timed prefill per
//               prompt): the prefill-time cost of a method relative to the prefill alone.
// Every row also carries its paired difference to SnapKV (post-fill, same budget) on the same
// prompts: the mean of the per-prompt differences and its standard error (paired_difference).
// LookaheadKV needs report_options::lookahead (the trained module); without one, "every method"
// leaves it out.
// Prompts run in parallel (one runner per thread, single-threaded forwards), report_options::batch
// of them at a time per thread as one batch on one page pool (evaluate_batch); every number but the
// times is independent of the thread count and of the batch size.
#pragma once

#include <methods/duo_calibration.hpp>
#include <methods/laq.hpp>
#include <methods/speckv.hpp>
#include <batch/scheduler.hpp>
#include <runner/evictor.hpp>
#include <runner/workers.hpp>
#include <lookaheadkv/data.hpp>
#include <lookaheadkv/module.hpp>
#include <lookaheadkv/scores.hpp>

#include "shipped_models.hpp"

#include <kvevict/metrics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>


namespace kvrun {

/// One row of the report: budget 0 = the whole cache (method full).
struct report_config {
  method recipe = method::snapkv;
  driver_kind driver = driver_kind::postfill;
  index_t budget = 0;
  double fraction = -1.0;  ///< chunked drivers: evict_options::chunk_fraction (-1: down to the budget)
  /// Head-type methods (duo-heuristic, duo, prulong) at a fixed fraction of streaming heads: the
  /// top floor(L H (1 - s)) heads of the calibration / trained mask keep the whole cache, the rest
  /// their sinks + recent window, whatever the budget (budget 0 in such a row). -1: not such a row.
  double head_sparsity = -1.0;
};

/// The drivers each method runs with in the default report: every method post-fill; the cascades
/// (LAVa, CAKE) layer by layer; SnapKV and LAVa chunked both ways; the decode-time classics
/// (StreamingLLM, H2O, TOVA, SnapKV) at decode time. Layer-wise eviction with per-layer
/// allocators keeps exactly the post-fill sets, so it is left out (`all_drivers` runs it).
inline bool default_matrix(method m, driver_kind d) {
  switch (d) {
    case driver_kind::postfill: return true;
    case driver_kind::layerwise: return m == method::lava || m == method::cake;
    case driver_kind::chunked_naive:
    case driver_kind::chunked_patched: return m == method::snapkv || m == method::lava;
    case driver_kind::decode:
      return m == method::streaming_llm || m == method::h2o || m == method::tova || m == method::snapkv;
  }
  return false;
}

struct report_options {
  index_t prompts = 128;
  std::vector<index_t> budgets{16, 32, 64, 128};
  std::vector<method> recipes;       ///< empty: every method (full is always the first row)
  std::vector<driver_kind> drivers;  ///< empty: every driver of the matrix
  bool all_drivers = false;          ///< every supported (method, driver) pair, not default_matrix
  evict_options base;                ///< window, sinks, chunk, evict_every, laq_steps, duo_recent
  pair_options pairs = [] {
    pair_options p;
    p.short_fraction = 0.0;  // every prompt fills the context minus the response
    return p;
  }();
  std::uint64_t seed_begin = test_seed_base;
  index_t calibration = 8;  ///< duo calibration texts (training seeds)
  /// The head-type rows (duo-heuristic, duo, prulong at a fraction of streaming heads, compared with
  /// duo-heuristic at the same fraction and driver): post-fill at every fraction here, the
  /// layer-wise, chunked and decode drivers at head_driver_sparsity. Empty: no such rows.
  std::vector<double> head_sparsities{0.25, 0.5, 0.75};
  double head_driver_sparsity = 0.5;
  std::string duo_mask = kvevict::program::shipped_model("duo/stories260K.tsv");  ///< DuoAttention's trained alpha
  /// PruLong's masks: <prulong_masks>-s<percent>.tsv, one per sparsity (kvevict-headgates prulong)
  std::string prulong_masks = kvevict::program::shipped_model("prulong/stories260K");
  /// Run exactly these configurations (after `full`, which is always first) instead of the matrix
  /// built from budgets / recipes / drivers (the footprint sweep, footprint.hpp).
  std::vector<report_config> configs;
  /// The lookaheadkv method's trained module (must outlive the report); null: lookaheadkv is left
  /// out of "every method" and refused when named in `recipes`.
  const lookahead_module* lookahead = nullptr;
  std::string lookahead_path;  ///< recorded in the JSON by kvevict::program::recorded_path
  int threads = 0;          ///< prompts in parallel (0: all cores)
  /// Prompts each thread runs as one batch (>= 1): their full and evicted caches on one page pool
  /// of the thread (kv_pool), the configurations' teacher-forced responses stepped across the batch
  /// one position at a time. Every number equals the unbatched run's.
  index_t batch = 1;
  index_t page_size = 16;   ///< tokens per page of the caches
  std::function<void(const char*)> progress;  ///< one line of progress (may be empty)
};

struct prompt_result {
  double recall = 0.0, kl = 0.0, top1 = 0.0, footprint = 0.0, peak = 0.0, evict_ms = 0.0, prefill_ms = 0.0;
  double overhead = 1.0;  ///< (prefill_ms + evict_ms) / prefill_ms
  index_t agreement = 0;
  index_t kept = 0;  ///< KV rows held after the prefill's eviction (all layers and heads)
};

/// A paired difference over the prompts: mean of (row - reference) per prompt, its standard error
/// (sample standard deviation / sqrt(n)) and z = mean / sem; `valid` = a reference row exists.
struct paired_difference {
  bool valid = false;
  double mean = 0.0, sem = 0.0;
  double z() const { return sem > 0.0 ? mean / sem : (mean == 0.0 ? 0.0 : (mean > 0 ? HUGE_VAL : -HUGE_VAL)); }
};

struct config_result {
  report_config cfg;
  std::vector<prompt_result> prompts;  ///< per prompt, in prompt order
  // over the prompts: means, and medians of the times
  double recall = 0.0, kl = 0.0, agreement = 0.0, top1 = 0.0, footprint = 0.0, peak = 0.0, evict_ms = 0.0,
         prefill_ms = 0.0, kept = 0.0;
  double overhead = 1.0;  ///< median over the prompts of prompt_result::overhead
  // standard errors of the means (sample standard deviation / sqrt(prompts); 0 for one prompt)
  double recall_sem = 0.0, kl_sem = 0.0, agreement_sem = 0.0, top1_sem = 0.0;
  /// Paired differences to SnapKV post-fill at the same budget (row - snapkv) on the same prompts;
  /// head-type rows (head_sparsity >= 0): to duo-heuristic at the same fraction and driver.
  paired_difference d_kl, d_recall, d_agreement, d_top1;
};

struct report_result {
  report_options options;
  std::vector<std::uint64_t> seeds;
  std::vector<index_t> prompt_lengths;
  index_t response = 0;
  duo_heads duo;
  /// Per row: the retrieval heads of a head-type row at a head sparsity (-1 for the other rows).
  std::vector<index_t> head_retrieval;
  /// Per prompt (with speckv rows): the fraction of SpecKV's draft tokens equal to the full cache's
  /// greedy response at the same position (how good the derived draft model is).
  std::vector<double> draft_match;
  std::vector<config_result> rows;
  double seconds = 0.0;
  int threads = 1;
};

/// The configurations of a report, in table order: full first, then per budget the methods in
/// method_names order, each with its drivers in driver_names order. Errors: a configuration the
/// evictor refuses (e.g. a budget below a method's protected tokens), naming it; lookaheadkv named
/// without a module.
inline status report_configs(const config& c, const report_options& o, std::vector<report_config>& out) {
  out.clear();
  out.push_back({method::full, driver_kind::postfill, 0});
  if (!o.configs.empty()) {
    for (const report_config& rc : o.configs) {
      evict_options e = o.base;
      e.recipe = rc.recipe;
      e.driver = rc.driver;
      e.budget = rc.head_sparsity >= 0.0 ? o.base.budget : rc.budget;
      e.chunk_fraction = rc.fraction;
      e.alloc.reset();
      if (rc.recipe == method::full) continue;
      if (rc.head_sparsity >= 0.0 && (!uses_head_types(rc.recipe) || rc.head_sparsity > 1.0))
        return status::error(errc::invalid_argument, "report: %s takes no head sparsity (duo-heuristic, duo, prulong; in [0, 1])",
                             method_name(rc.recipe));
      if (rc.recipe == method::lookaheadkv && o.lookahead == nullptr)
        return status::error(errc::invalid_argument, "report: lookaheadkv needs a trained lookahead module (--lookahead-module)");
      if (const status st = check_evict_options(c, e); !st.ok())
        return status::error(errc::invalid_argument, "report: %s / %s / budget %lld: %s", method_name(rc.recipe),
                             driver_name(rc.driver), static_cast<long long>(rc.budget), st.message());
      out.push_back(rc);
    }
    return {};
  }
  if (o.budgets.empty()) return status::error(errc::invalid_argument, "--budgets: no budget given");
  const bool named_lookahead = std::find(o.recipes.begin(), o.recipes.end(), method::lookaheadkv) != o.recipes.end();
  if (named_lookahead && o.lookahead == nullptr)
    return status::error(errc::invalid_argument, "report: lookaheadkv needs a trained lookahead module (--lookahead-module)");
  for (const index_t b : o.budgets)
    for (const named<method>& mn : method_names) {
      const method m = mn.value;
      if (m == method::full) continue;
      if (m == method::lookaheadkv && o.lookahead == nullptr) continue;
      if (m == method::duo || m == method::prulong) continue;  // trained masks: budget-free rows, below
      if (!o.recipes.empty() && std::find(o.recipes.begin(), o.recipes.end(), m) == o.recipes.end()) continue;
      for (const named<driver_kind>& dn : driver_names) {
        const driver_kind d = dn.value;
        if (!o.drivers.empty() && std::find(o.drivers.begin(), o.drivers.end(), d) == o.drivers.end()) continue;
        evict_options e = o.base;
        e.recipe = m;
        e.driver = d;
        e.budget = b;
        e.alloc.reset();
        const status st = check_evict_options(c, e);
        if (o.all_drivers ? !st.ok() : !default_matrix(m, d)) continue;
        if (!st.ok())
          return status::error(errc::invalid_argument, "report: %s / %s / budget %lld: %s", method_name(m), driver_name(d),
                               static_cast<long long>(b), st.message());
        out.push_back({m, d, b});
      }
    }
  // the head-type methods at fixed fractions of streaming heads, next to each other
  for (const double hs : o.head_sparsities) {
    if (!(hs >= 0.0 && hs <= 1.0)) return status::error(errc::invalid_argument, "report: head sparsity %g is outside [0, 1]", hs);
    for (const method m : {method::duo_heuristic, method::duo, method::prulong}) {
      if (!o.recipes.empty() && std::find(o.recipes.begin(), o.recipes.end(), m) == o.recipes.end()) continue;
      for (const driver_kind d : {driver_kind::postfill, driver_kind::layerwise, driver_kind::chunked_naive, driver_kind::decode}) {
        if (!o.drivers.empty() && std::find(o.drivers.begin(), o.drivers.end(), d) == o.drivers.end()) continue;
        if (d != driver_kind::postfill && hs != o.head_driver_sparsity && !o.all_drivers) continue;
        evict_options e = o.base;
        e.recipe = m;
        e.driver = d;
        e.alloc.reset();
        if (const status st = check_evict_options(c, e); !st.ok())
          return status::error(errc::invalid_argument, "report: %s / %s / head sparsity %g: %s", method_name(m), driver_name(d),
                               hs, st.message());
        out.push_back({m, d, 0, -1.0, hs});
      }
    }
  }
  if (out.size() == 1)
    return status::error(errc::invalid_argument, "report: no configuration matches the --recipes / --drivers given");
  return {};
}

namespace detail {

/// log_softmax of n logits, in double.
inline void log_softmax(const float* logits, index_t n, double* out) {
  double mx = -INFINITY;
  for (index_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0.0;
  for (index_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  for (index_t i = 0; i < n; ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

/// KL(p || q) from log-probabilities.
inline double kl_divergence(const double* logp, const double* logq, index_t n) {
  double kl = 0.0;
  for (index_t i = 0; i < n; ++i)
    if (logp[i] > -INFINITY) kl += std::exp(logp[i]) * (logp[i] - logq[i]);
  return kl;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The evictor options of configuration `rc` (the report's base options with its recipe, driver,
/// budget and chunk fraction).
inline evict_options config_options(const report_options& o, const report_config& rc) {
  evict_options e = o.base;
  e.recipe = rc.recipe;
  e.driver = rc.driver;
  e.budget = rc.budget > 0 ? rc.budget : o.base.budget;
  e.chunk_fraction = rc.fraction;
  e.alloc.reset();
  return e;
}

/// One teacher-forced response position: its `logits` against the full cache's log-probabilities
/// `full_logp` (top-1 and the greedy agreement, which stops at the first differing argmax, into
/// `r`); returns KL(full || evicted). `logq`: [V] scratch.
inline double score_position(const double* full_logp, const float* logits, index_t V, int truth, double* logq,
                             bool& agreeing, prompt_result& r) {
  log_softmax(logits, V, logq);
  const bool same = sampler::argmax(logits, static_cast<int>(V)) == truth;
  if (same) r.top1 += 1.0;
  if (agreeing && same) ++r.agreement;
  else agreeing = false;
  return kl_divergence(full_logp, logq, V);
}

/// A configuration's result on one prompt from its sums over the m response positions (KL, the
/// recalls of the m - 1 decoded positions) and its eviction schedule (footprint and peak).
inline status finish_prompt(double kl, double recall, index_t m, kvevict::eviction_schedule schedule,
                            std::vector<unsigned char>& scratch, prompt_result& r) {
  r.kl = kl / static_cast<double>(m);
  r.top1 /= static_cast<double>(m);
  r.recall = m > 1 ? recall / static_cast<double>(m - 1) : 0.0;
  kvevict::kv_usage usage;
  KVEVICT_TRY(with_workspace(scratch, [&](kvevict::workspace& ws) { return kvevict::measure_kv_usage(ws, schedule, usage); }));
  r.footprint = usage.footprint();
  r.peak = usage.peak_kv();
  return {};
}

/// One prompt's state in a worker: its full and evicted caches, the full cache's captures, logits
/// and ground truth, and the configuration row in progress (its evictor and teacher-forced sums).
struct report_sequence {
  runner* run = nullptr;       // its forwards: the worker's runner, or its batch slot's (gated)
  kv_cache full, cache;
  block_capture prompt_q, response_q;
  evictor ev;
  laq_queries laq;             // the laq and laq++ rows' query blocks
  lookahead_scorer lookahead;  // bound to report_options::lookahead, if any
  std::vector<int> draft;      // the prompt's draft tokens (speckv rows)
  block_capture draft_q;       // their queries and keys under the target model (full cache)
  double draft_match = 0.0;    // the fraction of the draft tokens equal to the full cache's response
  double prefill_ms = 0.0, draft_ms = 0.0;
  std::vector<float> first;              // [V] the full prefill's last logits
  std::vector<float> gt;                 // [L][H][P] ground truth
  std::vector<double> full_logp;         // [m][V]
  std::vector<pos_t> schedule;           // [L][H][N]
  kvevict::eviction_recorder rec;
  // the row in progress
  bool agreeing = true;
  double kl = 0.0, recall = 0.0, step_recall = 0.0;
  index_t k = 0;
};

/// Per-thread state of the report: one runner, and the sequences of the prompts it runs together
/// (report_options::batch of them on a batch_scheduler, their caches on one shared page pool; one
/// without a batch, its caches on their own pools).
struct report_worker {
  runner run;
  kv_pool pool;                // the batch's pages (batch > 1)
  batch_scheduler batch;       // the batch's steps (batch > 1)
  std::vector<std::unique_ptr<report_sequence>> seqs;
  speckv_drafter drafter;      // the speckv rows' draft model
  std::vector<double> logq;    // [V]
  std::vector<unsigned char> ws;
  std::vector<pos_t> kept_pos;
  std::vector<std::int32_t> kept_cu;

  kvevict::workspace workspace_for(std::size_t bytes) {
    if (ws.size() < bytes) ws.resize(bytes);
    return {ws.empty() ? nullptr : ws.data(), ws.size()};
  }
};

/// The oracle recipe (LookaheadKV Eq. 1): the ground truth of recall.
inline kvevict::recipe ground_truth_recipe() {
  evict_options o;
  o.recipe = method::oracle;
  return make_recipe(o);
}

/// s.gt: GT[l] [H_kv][P] for a prompt in s.full (unevicted) and the response's captured queries / keys.
inline status ground_truth(const config& c, report_sequence& s, report_worker& w) {
  const kv_cache& full = s.full;
  const block_capture& response_q = s.response_q;
  const index_t P = full.next_position(), m = response_q.rows(), H = c.n_kv_heads;
  const kvevict::recipe r = ground_truth_recipe();
  s.gt.assign(static_cast<std::size_t>(c.n_layers * H * P), 0.0f);
  const auto need = kvevict::recipe_scores_workspace_bytes(kvevict::seq, r, c.n_heads, m, H, P, c.head_size(), m);
  if (!need) return need.error();
  kvevict::workspace ws = w.workspace_for(*need);
  for (int l = 0; l < c.n_layers; ++l) {
    const auto keys = full.dense_keys(l, P);
    if (!keys) return keys.error();
    const auto out = *kvevict::make_matrix_view(s.gt.data() + l * H * P, H, P);
    KVEVICT_TRY(kvevict::recipe_scores(kvevict::seq, ws, r, response_q.queries(l, 0, m), *keys,
                                       kvevict::kv_view<const float>{}, out, response_q.keys(l, 0, m)));
  }
  return {};
}

/// Recall of the prompt positions `cache` holds against the top-k of GT, mean over layers and heads.
inline status held_recall(const config& c, const kv_cache& cache, const std::vector<float>& gt, index_t P, index_t k,
                          report_worker& w, double& recall) {
  const index_t H = c.n_kv_heads;
  double sum = 0.0;
  for (int l = 0; l < c.n_layers; ++l) {
    w.kept_pos.clear();
    w.kept_cu.assign(static_cast<std::size_t>(H + 1), 0);
    for (index_t h = 0; h < H; ++h) {
      for (index_t j = 0; j < cache.length(l, h); ++j)
        if (cache.position(l, h, j) < P) w.kept_pos.push_back(cache.position(l, h, j));
      w.kept_cu[static_cast<std::size_t>(h + 1)] = static_cast<std::int32_t>(w.kept_pos.size());
    }
    const kvevict::ragged_positions kept{w.kept_pos.data(), w.kept_cu.data(), H};
    const auto truth = *kvevict::make_matrix_view<const float>(gt.data() + l * H * P, H, P);
    kvevict::workspace q;
    double mean = 0.0;
    KVEVICT_TRY(kvevict::kept_recall_at_k(q, kept, truth, k, mean));
    kvevict::workspace ws = w.workspace_for(q.bytes);
    KVEVICT_TRY(kvevict::kept_recall_at_k(ws, kept, truth, k, mean));
    sum += mean;
  }
  recall = sum / static_cast<double>(c.n_layers);
  return {};
}

/// A prompt's full-cache work (shared by every configuration): the prefill (queries captured), the
/// response teacher-forced, the ground truth, SpecKV's draft run by the target as a query block (the
/// same for every budget; its time is added to every speckv row's eviction time).
inline status prepare_prompt(const model& mdl, const report_options& o, bool speckv, const text_pair& tp,
                             report_worker& w, report_sequence& s) {
  const config& c = mdl.cfg();
  const index_t P = static_cast<index_t>(tp.prompt.size()), m = static_cast<index_t>(tp.response.size());
  const index_t V = c.vocab_size;
  s.full.clear();
  s.prompt_q.reset(c, P);
  auto t0 = std::chrono::steady_clock::now();
  runner& run = *s.run;
  KVEVICT_TRY(run.forward(s.full, tokens(tp.prompt), logits_mode::last, s.prompt_q.hooks()));
  s.prefill_ms = seconds_since(t0) * 1e3;
  s.first.assign(run.logits(0), run.logits(0) + V);
  s.full_logp.resize(static_cast<std::size_t>(m * V));
  log_softmax(s.first.data(), V, s.full_logp.data());
  s.response_q.reset(c, m);
  KVEVICT_TRY(run.forward_extra(s.full, tokens(tp.response), logits_mode::all, s.response_q.hooks()));
  for (index_t t = 1; t < m; ++t) log_softmax(run.logits(t - 1), V, s.full_logp.data() + t * V);
  KVEVICT_TRY(ground_truth(c, s, w));
  s.schedule.resize(static_cast<std::size_t>(c.n_layers * c.n_kv_heads * (P + m - 1)));
  s.draft_ms = 0.0;
  if (speckv) {
    KVEVICT_TRY(w.drafter.draft(tp.prompt, o.base.draft_tokens, s.draft));
    index_t same = 0;
    for (std::size_t i = 0; i < s.draft.size() && i < tp.response.size(); ++i) same += s.draft[i] == tp.response[i];
    s.draft_match = static_cast<double>(same) / static_cast<double>(s.draft.size());
    const auto t1 = std::chrono::steady_clock::now();
    s.draft_q.reset(c, static_cast<index_t>(s.draft.size()));
    KVEVICT_TRY(run.forward_extra(s.full, tokens(s.draft), logits_mode::none, s.draft_q.hooks()));
    s.draft_ms = (w.drafter.seconds() + seconds_since(t1)) * 1e3;
  }
  return {};
}

/// Recall's k for a row on a `P`-token prompt: the budget; a head-type row's: the rows it keeps
/// (`kept` over the model's L x H heads) per head on average, rounded; without either, P.
inline index_t recall_k(const report_config& rc, index_t P, index_t kept, index_t L, index_t H) {
  return rc.budget > 0                ? std::min(rc.budget, P)
         : rc.head_sparsity >= 0.0 ? std::clamp<index_t>((kept + L * H / 2) / (L * H), 1, P)
                                   : P;
}

/// Starts row `rc` (configuration ci) on a prepared prompt: its evictor, the prefill with eviction
/// (post-fill: a copy of the full cache evicted), response position 0.
inline status start_row(const model& mdl, const report_options& o, const report_config& rc, const duo_heads& heads,
                        const text_pair& tp, report_worker& w, report_sequence& s, prompt_result& r) {
  const config& c = mdl.cfg();
  const index_t P = static_cast<index_t>(tp.prompt.size()), m = static_cast<index_t>(tp.response.size());
  const index_t L = c.n_layers, H = c.n_kv_heads;
  KVEVICT_TRY(s.ev.init(mdl, config_options(o, rc), &heads, o.lookahead != nullptr ? &s.lookahead : nullptr, &s.laq));
  auto made = kvevict::make_eviction_recorder(s.schedule.data(), L, H, P + m - 1);
  if (!made) return made.error();
  s.rec = *made;
  r = prompt_result{};
  if (rc.driver == driver_kind::postfill) {
    s.cache = s.full;
    KVEVICT_TRY(s.ev.evict_prefilled(*s.run, s.cache, s.prompt_q, s.first.data(), &s.rec,
                                     rc.recipe == method::speckv ? &s.draft_q : &s.response_q));
    r.prefill_ms = s.prefill_ms;
  } else {
    s.cache.clear();
    KVEVICT_TRY(s.ev.prefill(*s.run, s.cache, tp.prompt, &s.rec, &tp.response));
    r.prefill_ms = s.ev.prefill_seconds() * 1e3;
  }
  r.kept = s.cache.total_rows();
  s.k = recall_k(rc, P, r.kept, L, H);
  s.agreeing = true;
  s.kl = s.recall = s.step_recall = 0.0;
  s.kl += score_position(s.full_logp.data(), s.ev.next_logits(), c.vocab_size, tp.response[0], w.logq.data(),
                         s.agreeing, r);
  return {};
}

/// Response position t >= 1 of the row in progress: the recall of the prompt positions the cache
/// holds when response token t - 1 is decoded (it changes only under decode-time eviction), that
/// token's decode, position t's logits scored right after it.
inline status step_row(const config& c, const report_config& rc, const text_pair& tp, index_t t, report_worker& w,
                       report_sequence& s, prompt_result& r) {
  const index_t P = static_cast<index_t>(tp.prompt.size());
  if (t == 1 || rc.driver == driver_kind::decode) KVEVICT_TRY(held_recall(c, s.cache, s.gt, P, s.k, w, s.step_recall));
  s.recall += s.step_recall;
  KVEVICT_TRY(s.ev.decode(*s.run, s.cache, tp.response[static_cast<std::size_t>(t - 1)]));
  s.kl += score_position(s.full_logp.data() + t * c.vocab_size, s.run->logits(0), c.vocab_size,
                         tp.response[static_cast<std::size_t>(t)], w.logq.data(), s.agreeing, r);
  return {};
}

/// Ends the row in progress: the means over the response, the times, the schedule's footprint.
inline status finish_row(const report_config& rc, const text_pair& tp, report_worker& w, report_sequence& s,
                         prompt_result& r) {
  const index_t m = static_cast<index_t>(tp.response.size()), N = static_cast<index_t>(tp.prompt.size()) + m - 1;
  r.evict_ms = s.ev.evict_seconds() * 1e3 + (rc.recipe == method::speckv ? s.draft_ms : 0.0);
  r.overhead = r.prefill_ms > 0.0 ? (r.prefill_ms + r.evict_ms) / r.prefill_ms : 1.0;
  const auto sched = s.rec.schedule(N);
  if (!sched) return sched.error();
  return finish_prompt(s.kl, s.recall, m, *sched, w.ws, r);
}

/// Every configuration on the prompts `tps` (at most w.seqs.size()) run as one batch: per prompt
/// its full-cache work, then per configuration its prefill with eviction and the teacher-forced
/// response one position at a time (its logits scored right after its own forward). Batched
/// (count > 1), each prompt is one sequence of the worker's batch_scheduler (batch/scheduler.hpp):
/// every step is one batched forward of the sequences' next blocks, whatever stage each is at. One
/// prompt alone is the unbatched report (the worker's own runner). Every sequence's numbers equal
/// those of the prompt alone: its computation reads only its own caches and captures, and the
/// batched forward gives each row the single forward's arithmetic.
inline status evaluate_batch(const model& mdl, const report_options& o, const std::vector<report_config>& configs,
                             const std::vector<duo_heads>& heads, const text_pair* tps, index_t count, report_worker& w,
                             std::vector<prompt_result>* out) {
  const config& c = mdl.cfg();
  const bool speckv =
      std::any_of(configs.begin(), configs.end(), [](const report_config& rc) { return rc.recipe == method::speckv; });
  w.logq.resize(static_cast<std::size_t>(c.vocab_size));
  const auto prompt = [&](index_t i, runner& run) -> status {
    report_sequence& s = *w.seqs[static_cast<std::size_t>(i)];
    const text_pair& tp = tps[i];
    s.run = &run;
    KVEVICT_TRY(prepare_prompt(mdl, o, speckv, tp, w, s));
    out[i].assign(configs.size(), prompt_result{});
    for (std::size_t ci = 0; ci < configs.size(); ++ci) {
      KVEVICT_TRY(start_row(mdl, o, configs[ci], heads[ci], tp, w, s, out[i][ci]));
      for (index_t t = 1; t < static_cast<index_t>(tp.response.size()); ++t)
        KVEVICT_TRY(step_row(c, configs[ci], tp, t, w, s, out[i][ci]));
      KVEVICT_TRY(finish_row(configs[ci], tp, w, s, out[i][ci]));
    }
    return {};
  };
  if (count == 1) return prompt(0, w.run);
  return w.batch.run(count, [&](index_t i, index_t, runner& run) { return prompt(i, run); });
}

/// Mean and standard error of the per-prompt differences get(a) - get(b).
template <class Get>
paired_difference paired(const config_result& a, const config_result& b, Get get) {
  paired_difference d;
  const std::size_t n = a.prompts.size();
  if (n == 0 || b.prompts.size() != n) return d;
  d.valid = true;
  for (std::size_t i = 0; i < n; ++i) d.mean += get(a.prompts[i]) - get(b.prompts[i]);
  d.mean /= static_cast<double>(n);
  if (n > 1) {
    double v = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      const double x = get(a.prompts[i]) - get(b.prompts[i]) - d.mean;
      v += x * x;
    }
    d.sem = std::sqrt(v / static_cast<double>(n - 1) / static_cast<double>(n));
  }
  return d;
}

/// Row r's paired differences (KL, recall, greedy agreement, top-1) to row ref.
inline void set_paired(config_result& r, const config_result& ref) {
  r.d_kl = paired(r, ref, [](const prompt_result& p) { return p.kl; });
  r.d_recall = paired(r, ref, [](const prompt_result& p) { return p.recall; });
  r.d_agreement = paired(r, ref, [](const prompt_result& p) { return static_cast<double>(p.agreement); });
  r.d_top1 = paired(r, ref, [](const prompt_result& p) { return p.top1; });
}

/// Every row's paired differences to SnapKV post-fill (down to the budget) at its budget, when the
/// report has that row.
inline void pair_with_snapkv(std::vector<config_result>& rows) {
  for (config_result& r : rows) {
    if (r.cfg.budget <= 0 || r.cfg.fraction >= 0.0) continue;
    const config_result* ref = nullptr;
    for (const config_result& s : rows)
      if (s.cfg.recipe == method::snapkv && s.cfg.driver == driver_kind::postfill && s.cfg.budget == r.cfg.budget &&
          s.cfg.fraction < 0.0)
        ref = &s;
    if (ref != nullptr) set_paired(r, *ref);
  }
}

/// Every head-type row's paired differences to duo-heuristic at the same fraction and driver.
inline void pair_with_heuristic(std::vector<config_result>& rows) {
  for (config_result& r : rows) {
    if (r.cfg.head_sparsity < 0.0 || r.cfg.recipe == method::duo_heuristic) continue;
    const config_result* ref = nullptr;
    for (const config_result& s : rows)
      if (s.cfg.recipe == method::duo_heuristic && s.cfg.driver == r.cfg.driver && s.cfg.head_sparsity == r.cfg.head_sparsity)
        ref = &s;
    if (ref != nullptr) set_paired(r, *ref);
  }
}

/// The head types of every configuration: duo-heuristic's calibration (`calibrated`; at a head
/// sparsity, its top heads), DuoAttention's trained alpha, PruLong's mask of that sparsity (its
/// retrieval heads must number floor(L H (1 - s))). Errors: a mask file's.
inline status config_head_types(const config& c, const report_options& o, const std::vector<report_config>& configs,
                                const duo_heads& calibrated, std::vector<duo_heads>& out) {
  out.assign(configs.size(), duo_heads{});
  const index_t LH = c.n_layers * c.n_kv_heads;
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const report_config& rc = configs[i];
    duo_heads& h = out[i];
    if (rc.recipe == method::duo_heuristic) {
      h = calibrated;
      if (rc.head_sparsity >= 0.0) {
        const auto k = kvevict::prulong_retrieval_heads(LH, rc.head_sparsity);
        if (!k) return k.error();
        h.retrieval = *k;
      }
    } else if (rc.recipe == method::duo) {
      KVEVICT_TRY(head_types_from_file(c, o.duo_mask, rc.head_sparsity, h));
    } else if (rc.recipe == method::prulong) {
      const double s = rc.head_sparsity >= 0.0 ? rc.head_sparsity : 0.5;
      char suffix[32];
      std::snprintf(suffix, sizeof suffix, "-s%02d.tsv", static_cast<int>(std::lround(s * 100)));
      const std::string path = o.prulong_masks + suffix;
      KVEVICT_TRY(head_types_from_file(c, path, s, h));
      index_t ones = 0;
      for (const double v : h.global) ones += v >= 0.5 ? 1 : 0;
      if (ones != h.retrieval)
        return status::error(errc::invalid_argument, "report: %s has %lld retrieval heads, sparsity %g needs %lld", path.c_str(),
                             static_cast<long long>(ones), s, static_cast<long long>(h.retrieval));
    }
  }
  return {};
}

/// The head types of every configuration (config_head_types), duo-heuristic's calibration first if
/// a configuration needs it (`calibrated`, on `threads` threads; progress through o.progress).
inline status report_head_types(const model& mdl, const report_options& o, const std::vector<report_config>& configs,
                                int threads, duo_heads& calibrated, std::vector<duo_heads>& out) {
  if (std::any_of(configs.begin(), configs.end(), [](const report_config& rc) { return rc.recipe == method::duo_heuristic; })) {
    if (o.progress) {
      char line[128];
      std::snprintf(line, sizeof line, "report: duo calibration on %lld training texts", static_cast<long long>(o.calibration));
      o.progress(line);
    }
    std::vector<std::vector<int>> texts;
    KVEVICT_TRY(training_texts(mdl, o.pairs, o.calibration, texts, threads));
    duo_calibration_options dco;
    dco.sinks = o.base.sinks >= 0 ? o.base.sinks : 4;
    dco.recent = o.base.duo_recent;
    KVEVICT_TRY(duo_calibrate(mdl, texts, dco, calibrated));
  }
  return config_head_types(mdl.cfg(), o, configs, calibrated, out);
}

/// The report's prompts and their full-cache responses (make_pairs on `threads` threads), recorded in `out`.
inline status report_prompts(const model& mdl, const report_options& o, int threads, std::vector<text_pair>& pairs,
                             report_result& out) {
  if (o.progress) {
    char line[256];
    std::snprintf(line, sizeof line, "report: generating %lld test prompts (seeds %llu..%llu) and their greedy responses",
                  static_cast<long long>(o.prompts), static_cast<unsigned long long>(o.seed_begin),
                  static_cast<unsigned long long>(o.seed_begin + static_cast<std::uint64_t>(o.prompts) - 1));
    o.progress(line);
  }
  KVEVICT_TRY(make_pairs(mdl, o.pairs, o.seed_begin, o.seed_begin + static_cast<std::uint64_t>(o.prompts), pairs, threads));
  for (const text_pair& p : pairs) {
    out.seeds.push_back(p.seed);
    out.prompt_lengths.push_back(static_cast<index_t>(p.prompt.size()));
  }
  out.response = static_cast<index_t>(pairs.front().response.size());
  return {};
}

/// The report's rows from every prompt's results (results[prompt][config]): means, standard
/// errors, medians of the times, the paired differences, the head-type rows' retrieval heads.
inline void report_rows(const std::vector<report_config>& configs, const std::vector<duo_heads>& heads,
                        const std::vector<std::vector<prompt_result>>& results, report_result& out) {
  const auto n = static_cast<index_t>(results.size());
  for (std::size_t ci = 0; ci < configs.size(); ++ci) {
    config_result cr;
    cr.cfg = configs[ci];
    std::vector<double> ev, pf, ov;
    for (index_t i = 0; i < n; ++i) {
      const prompt_result& r = results[static_cast<std::size_t>(i)][ci];
      cr.prompts.push_back(r);
      cr.recall += r.recall;
      cr.kl += r.kl;
      cr.agreement += static_cast<double>(r.agreement);
      cr.top1 += r.top1;
      cr.footprint += r.footprint;
      cr.peak += r.peak;
      cr.kept += static_cast<double>(r.kept);
      ev.push_back(r.evict_ms);
      pf.push_back(r.prefill_ms);
      ov.push_back(r.overhead);
    }
    const double dn = static_cast<double>(n);
    cr.recall /= dn;
    cr.kl /= dn;
    cr.agreement /= dn;
    cr.top1 /= dn;
    cr.footprint /= dn;
    cr.peak /= dn;
    cr.kept /= dn;
    if (n > 1) {
      double vr = 0.0, vk = 0.0, va = 0.0, vt = 0.0;
      for (const prompt_result& r : cr.prompts) {
        vr += (r.recall - cr.recall) * (r.recall - cr.recall);
        vk += (r.kl - cr.kl) * (r.kl - cr.kl);
        va += (static_cast<double>(r.agreement) - cr.agreement) * (static_cast<double>(r.agreement) - cr.agreement);
        vt += (r.top1 - cr.top1) * (r.top1 - cr.top1);
      }
      const double f = 1.0 / (dn - 1.0) / dn;
      cr.recall_sem = std::sqrt(vr * f);
      cr.kl_sem = std::sqrt(vk * f);
      cr.agreement_sem = std::sqrt(va * f);
      cr.top1_sem = std::sqrt(vt * f);
    }
    cr.evict_ms = median(ev);
    cr.prefill_ms = median(pf);
    cr.overhead = median(ov);
    out.rows.push_back(std::move(cr));
  }
  pair_with_snapkv(out.rows);
  pair_with_heuristic(out.rows);
  for (std::size_t ci = 0; ci < configs.size(); ++ci)
    out.head_retrieval.push_back(configs[ci].head_sparsity >= 0.0 ? heads[ci].retrieval : -1);
}

}  // namespace detail

/// Runs the report (see the file comment). Errors: invalid options, the pair generator's, the
/// calibration's, any configuration's (naming it).
inline status run_report(const model& mdl, const report_options& o, report_result& out) {
  const config& c = mdl.cfg();
  const auto t_start = std::chrono::steady_clock::now();
  if (o.prompts < 1) return status::error(errc::invalid_argument, "--prompts must be >= 1, got %lld", static_cast<long long>(o.prompts));
  if (o.batch < 1 || o.page_size < 1)
    return status::error(errc::invalid_argument, "report: batch %lld and page size %lld must be >= 1",
                         static_cast<long long>(o.batch), static_cast<long long>(o.page_size));
  std::vector<report_config> configs;
  KVEVICT_TRY(report_configs(c, o, configs));
  out = report_result{};
  out.options = o;
  out.options.progress = {};
  const int nt = thread_count(o.threads);
  out.threads = nt;
  char line[256];
  auto say = [&](const char* s) {
    if (o.progress) o.progress(s);
  };

  std::vector<text_pair> pairs;
  KVEVICT_TRY(detail::report_prompts(mdl, o, nt, pairs, out));

  std::vector<duo_heads> heads;
  KVEVICT_TRY(detail::report_head_types(mdl, o, configs, nt, out.duo, heads));

  std::snprintf(line, sizeof line, "report: %zu configurations x %lld prompts on %d threads", configs.size(),
                static_cast<long long>(o.prompts), nt);
  say(line);
  const index_t n = o.prompts;
  std::vector<std::vector<prompt_result>> results(static_cast<std::size_t>(n));
  std::vector<double> draft_match(static_cast<std::size_t>(n), 0.0);
  // batch > 1: each worker runs `batch` prompts at a time, their caches on one page pool
  const index_t batch = std::max<index_t>(1, std::min(o.batch, n)), groups = (n + batch - 1) / batch;
  const index_t head_pages = (c.seq_len + o.page_size - 1) / o.page_size;
  std::vector<detail::report_worker> workers(static_cast<std::size_t>(nt));
  for (detail::report_worker& w : workers) {
    KVEVICT_TRY(w.run.init(mdl, {0, 0, 1}));
    if (batch > 1) KVEVICT_TRY(w.pool.init(c, batch * 2 * c.n_kv_heads * head_pages, o.page_size));
    if (batch > 1) KVEVICT_TRY(w.batch.init(mdl, batch, 1));
    for (index_t i = 0; i < batch; ++i) {
      w.seqs.push_back(std::make_unique<detail::report_sequence>());
      detail::report_sequence& s = *w.seqs.back();
      KVEVICT_TRY(s.full.init(c, 0, o.page_size, batch > 1 ? &w.pool : nullptr));
      KVEVICT_TRY(s.cache.init(c, 0, o.page_size, batch > 1 ? &w.pool : nullptr));
      if (o.lookahead != nullptr) KVEVICT_TRY(s.lookahead.init(mdl, *o.lookahead));
    }
    if (std::any_of(configs.begin(), configs.end(), [](const report_config& rc) { return rc.recipe == method::speckv; }))
      KVEVICT_TRY(w.drafter.init(mdl, o.base.draft_layers));
  }
  KVEVICT_TRY(for_each_item(
      workers, groups,
      [&](detail::report_worker& w, index_t g) {
        const index_t first = g * batch, count = std::min(batch, n - first);
        const status st = detail::evaluate_batch(mdl, o, configs, heads, pairs.data() + first, count, w,
                                                 results.data() + first);
        for (index_t i = 0; i < count; ++i)
          draft_match[static_cast<std::size_t>(first + i)] = w.seqs[static_cast<std::size_t>(i)]->draft_match;
        return st;
      },
      [&](index_t d, int) {
        if (!o.progress) return;
        char msg[160];
        d = std::min(d * batch, n);  // groups done -> prompts done
        std::snprintf(msg, sizeof msg, "report: %lld/%lld prompts (%.0f%%), %.1f s", static_cast<long long>(d),
                      static_cast<long long>(n), 100.0 * static_cast<double>(d) / static_cast<double>(n),
                      seconds_since(t_start));
        o.progress(msg);
      }));

  detail::report_rows(configs, heads, results, out);
  if (std::any_of(configs.begin(), configs.end(), [](const report_config& rc) { return rc.recipe == method::speckv; }))
    out.draft_match = std::move(draft_match);
  out.seconds = seconds_since(t_start);
  return {};
}

// ---------------------------------------------------------------------------------------------
// Output: terminal table, JSON

inline std::string report_table(const report_result& r) {
  std::string s;
  char line[256];
  std::snprintf(line, sizeof line,
                "%lld prompts (%lld..%lld tokens), response %lld tokens; means over prompts, times are medians\n",
                static_cast<long long>(r.prompt_lengths.size()),
                static_cast<long long>(*std::min_element(r.prompt_lengths.begin(), r.prompt_lengths.end())),
                static_cast<long long>(*std::max_element(r.prompt_lengths.begin(), r.prompt_lengths.end())),
                static_cast<long long>(r.response));
  s += line;
  const char* header = "%-7s %-14s %-16s %7s %9s %7s %9s %6s %9s %10s %8s\n";
  std::snprintf(line, sizeof line, header, "budget", "recipe", "driver", "recall", "KL", "agree", "footprint", "peak",
                "evict ms", "prefill ms", "overhead");
  s += line;
  index_t last_budget = -1;
  for (const config_result& c : r.rows) {
    if (c.cfg.budget != last_budget && last_budget != -1) s += "\n";
    last_budget = c.cfg.budget;
    char b[24];
    if (c.cfg.budget > 0) std::snprintf(b, sizeof b, "%lld", static_cast<long long>(c.cfg.budget));
    else if (c.cfg.head_sparsity >= 0.0) std::snprintf(b, sizeof b, "s=%.2f", c.cfg.head_sparsity);
    else std::snprintf(b, sizeof b, "all");
    std::snprintf(line, sizeof line, "%-7s %-14s %-16s %7.3f %9.4f %7.1f %9.3f %6.3f %9.2f %10.2f %7.3fx\n", b,
                  method_name(c.cfg.recipe), driver_name(c.cfg.driver), c.recall, c.kl, c.agreement, c.footprint, c.peak,
                  c.evict_ms, c.prefill_ms, c.overhead);
    s += line;
  }
  std::snprintf(line, sizeof line, "(%.1f s on %d threads)\n", r.seconds, r.threads);
  s += line;
  return s;
}

namespace detail {
inline void json_string(std::string& s, const std::string& v) {
  s += '"';
  for (const char ch : v) {
    if (ch == '"' || ch == '\\') {
      s += '\\';
      s += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char u[8];
      std::snprintf(u, sizeof u, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(ch)));
      s += u;
    } else {
      s += ch;
    }
  }
  s += '"';
}
inline void json_number(std::string& s, double v) {
  char b[40];
  if (!std::isfinite(v)) {
    s += "null";
    return;
  }
  std::snprintf(b, sizeof b, "%.9g", v);
  s += b;
}
template <class T, class F>
void json_array(std::string& s, const std::vector<T>& v, F&& put) {
  s += '[';
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    put(v[i]);
  }
  s += ']';
}
}  // namespace detail

/// Two-sided p-value of a paired difference under the normal approximation (z = mean / sem; with
/// 100+ prompts the t distribution's quantiles are within 1% of the normal's). 1 for no reference,
/// 0 for a nonzero difference without spread (every prompt moved the same way by the same amount).
inline double two_sided_p(const paired_difference& d) {
  if (!d.valid) return 1.0;
  if (d.sem <= 0.0) return d.mean == 0.0 ? 1.0 : 0.0;
  return std::erfc(std::fabs(d.mean / d.sem) / std::sqrt(2.0));
}

/// Every number of the report, with its configuration and seeds. `model_path`, `command`: recorded
/// as given.
inline std::string report_json(const report_result& r, const std::string& model_path, const std::string& command) {
  using detail::json_array;
  using detail::json_number;
  using detail::json_string;
  const report_options& o = r.options;
  std::string s = "{\n";
  auto key = [&](const char* k) {
    s += "  ";
    json_string(s, k);
    s += ": ";
  };
  auto num = [&](double v) { json_number(s, v); };
  auto inum = [&](index_t v) { s += std::to_string(v); };
  key("command");
  json_string(s, command);
  s += ",\n";
  key("model");
  json_string(s, model_path);
  s += ",\n";
  key("prompts");
  s += "{\"split\": \"test\", \"seeds\": ";
  json_array(s, r.seeds, [&](std::uint64_t v) { s += std::to_string(v); });
  s += ", \"lengths\": ";
  json_array(s, r.prompt_lengths, inum);
  s += ", \"response\": " + std::to_string(r.response);
  s += ", \"max_prompt\": " + std::to_string(o.pairs.max_prompt) + ", \"long_min\": " + std::to_string(o.pairs.long_min) +
       ", \"min_prompt\": " + std::to_string(o.pairs.min_prompt) + ", \"short_fraction\": ";
  num(o.pairs.short_fraction);
  s += ", \"temperature\": ";
  num(o.pairs.temperature);
  s += ", \"topp\": ";
  num(o.pairs.topp);
  s += "},\n";
  key("options");
  s += "{\"budgets\": ";
  json_array(s, o.budgets, inum);
  s += ", \"window\": " + std::to_string(o.base.window) + ", \"sinks\": " + std::to_string(o.base.sinks) +
       " , \"chunk\": " + std::to_string(o.base.chunk) + ", \"evict_every\": " + std::to_string(o.base.evict_every) +
       ", \"laq_steps\": " + std::to_string(o.base.laq_steps) + ", \"draft_tokens\": " + std::to_string(o.base.draft_tokens) +
       ", \"draft_layers\": " + std::to_string(o.base.draft_layers) + ", \"duo_recent\": " + std::to_string(o.base.duo_recent) +
       ", \"calibration_texts\": " + std::to_string(o.calibration) + ", \"all_drivers\": " +
       (o.all_drivers ? "true" : "false") + ", \"threads\": " + std::to_string(r.threads) + "},\n";
  key("lookahead_module");
  if (o.lookahead == nullptr) {
    s += "null,\n";
  } else {
    s += "{\"path\": ";
    json_string(s, kvevict::program::recorded_path(o.lookahead_path));
    s += ", \"n_lookahead\": " + std::to_string(o.lookahead->n_lookahead()) + ", \"rank\": " +
         std::to_string(o.lookahead->rank()) + ", \"placement_bits\": " + std::to_string(o.lookahead->placement()) +
         "},\n";
  }
  key("duo_global");
  json_array(s, r.duo.global, num);
  s += ",\n";
  if (!o.head_sparsities.empty()) {
    key("head_masks");
    s += "{\"duo\": ";
    json_string(s, kvevict::program::recorded_path(o.duo_mask));
    s += ", \"prulong\": ";
    json_string(s, kvevict::program::recorded_path(o.prulong_masks) + "-s<percent>.tsv");
    s += ", \"sparsities\": ";
    json_array(s, o.head_sparsities, num);
    s += ", \"drivers_at\": ";
    num(o.head_driver_sparsity);
    s += "},\n";
  }
  key("speckv_draft_match");
  json_array(s, r.draft_match, num);
  s += ",\n";
  key("seconds");
  num(r.seconds);
  s += ",\n";
  key("rows");
  s += "[\n";
  for (std::size_t i = 0; i < r.rows.size(); ++i) {
    const config_result& c = r.rows[i];
    s += "    {\"recipe\": ";
    json_string(s, method_name(c.cfg.recipe));
    s += ", \"driver\": ";
    json_string(s, driver_name(c.cfg.driver));
    s += ", \"allocator\": ";
    {
      evict_options e;
      e.recipe = c.cfg.recipe;
      json_string(s, c.cfg.recipe == method::full ? "none" : allocator_name(allocator_of(e)));
    }
    s += ", \"budget\": ";
    if (c.cfg.budget > 0) inum(c.cfg.budget);
    else s += "null";
    if (c.cfg.fraction >= 0.0) {
      s += ", \"chunk_fraction\": ";
      num(c.cfg.fraction);
    }
    if (c.cfg.head_sparsity >= 0.0) {
      s += ", \"head_sparsity\": ";
      num(c.cfg.head_sparsity);
      s += ", \"retrieval_heads\": ";
      inum(r.head_retrieval.at(i));
    }
    s += ",\n     \"mean\": {\"recall\": ";
    num(c.recall);
    s += ", \"kl\": ";
    num(c.kl);
    s += ", \"agreement\": ";
    num(c.agreement);
    s += ", \"top1\": ";
    num(c.top1);
    s += ", \"footprint\": ";
    num(c.footprint);
    s += ", \"peak\": ";
    num(c.peak);
    s += ", \"kept\": ";
    num(c.kept);
    s += "}, \"sem\": {\"recall\": ";
    num(c.recall_sem);
    s += ", \"kl\": ";
    num(c.kl_sem);
    s += ", \"agreement\": ";
    num(c.agreement_sem);
    s += ", \"top1\": ";
    num(c.top1_sem);
    s += c.cfg.head_sparsity >= 0.0 ? "}, \"vs_duo_heuristic\": " : "}, \"vs_snapkv\": ";
    if (!c.d_kl.valid) {
      s += "null";
    } else {
      s += "{";
      const std::pair<const char*, const paired_difference*> ds[] = {
          {"kl", &c.d_kl}, {"recall", &c.d_recall}, {"agreement", &c.d_agreement}, {"top1", &c.d_top1}};
      for (std::size_t k = 0; k < 4; ++k) {
        s += k > 0 ? ", " : "";
        json_string(s, ds[k].first);
        s += ": {\"mean\": ";
        num(ds[k].second->mean);
        s += ", \"sem\": ";
        num(ds[k].second->sem);
        s += ", \"p\": ";
        num(two_sided_p(*ds[k].second));
        s += "}";
      }
      s += "}";
    }
    s += ", \"median\": {\"evict_ms\": ";
    num(c.evict_ms);
    s += ", \"prefill_ms\": ";
    num(c.prefill_ms);
    s += ", \"overhead\": ";
    num(c.overhead);
    s += "},\n     \"per_prompt\": {";
    auto field = [&](const char* name, auto get) {
      json_string(s, name);
      s += ": ";
      json_array(s, c.prompts, [&](const prompt_result& p) { num(static_cast<double>(get(p))); });
    };
    field("recall", [](const prompt_result& p) { return p.recall; });
    s += ", ";
    field("kl", [](const prompt_result& p) { return p.kl; });
    s += ", ";
    field("agreement", [](const prompt_result& p) { return p.agreement; });
    s += ", ";
    field("top1", [](const prompt_result& p) { return p.top1; });
    s += ", ";
    field("footprint", [](const prompt_result& p) { return p.footprint; });
    s += ", ";
    field("peak", [](const prompt_result& p) { return p.peak; });
    s += ", ";
    field("kept", [](const prompt_result& p) { return p.kept; });
    s += ", ";
    field("evict_ms", [](const prompt_result& p) { return p.evict_ms; });
    s += ", ";
    field("prefill_ms", [](const prompt_result& p) { return p.prefill_ms; });
    s += ", ";
    field("overhead", [](const prompt_result& p) { return p.overhead; });
    s += "}}";
    s += i + 1 < r.rows.size() ? ",\n" : "\n";
  }
  s += "  ]\n}\n";
  return s;
}

}  // namespace kvrun
