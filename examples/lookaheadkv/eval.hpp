// lookaheadkv/eval.hpp: the quality and cost report of LookaheadKV against SnapKV and the
// oracle on held-out (prompt, response) pairs (what `kvevict-lookahead eval` prints).
//
// Per pair (X, Y), P = |X|, and per method, budget k (only k < P: otherwise nothing is evicted):
//   ranking   [L][H_kv][P], higher = keep:
//               oracle      Eq. 1's ground truth (mean attention of Y's queries over X), GQA mean
//               snapkv      the last w = min(window, P / 2) prompt tokens' queries (window scores
//                           over the prompt, causal inside the window), max pool 7 over the prefix
//                           columns, GQA mean (the library's SnapKV recipe without its protection;
//                           the window columns keep their raw scores)
//               <module>    lookahead_scorer (max pool 7, GQA mean)
//   recall@k  kvevict::recall_at_k(ranking, oracle, k), mean over the L x H_kv rows
//   kept sets per layer and KV head, two rules:
//               window      the last min(w, k / 2) prompt tokens always kept (counted in k; SnapKV
//                           as KVCache-Factory runs it once k >= 2w), the rest the ranking's best
//               topk        the ranking's best k (the paper's LookaheadKV keeps no suffix window)
//   kept recall kvevict::kept_recall_at_k of each kept set against the oracle's top k
//   KL        the cache compacted to the kept set (runner kv_cache::compact), then Y teacher-forced
//             (Y[0 .. m-2] as one block; the prefill's last row predicted Y[0] before eviction):
//             mean over the m - 1 positions of KL(softmax(full) || softmax(evicted)), in double
#pragma once

#include <lookaheadkv/data.hpp>
#include <lookaheadkv/module.hpp>
#include <lookaheadkv/scores.hpp>
#include <lookaheadkv/train.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/workers.hpp>

#include <kvevict/gqa.hpp>
#include <kvevict/metrics/ranking.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace kvrun {

struct eval_options {
  std::vector<index_t> budgets{16, 32, 64, 128};
  index_t window = 32;  ///< SnapKV's observation window (min(window, P / 2) for short prompts)
  kvevict::postprocess_options pooling;  ///< pool / kernel / gqa / order of SnapKV and LookaheadKV (max 7, mean)
};

/// Kept-set rules of the KL and kept-recall columns.
enum class keep_rule { window = 0, topk = 1 };
inline constexpr int keep_rules = 2;

/// One pair's numbers: [method][budget] (NaN where k >= P).
struct pair_result {
  index_t P = 0;
  std::vector<double> recall, kept_recall[keep_rules], kl[keep_rules];
};

/// SnapKV's window for a prompt of P tokens.
inline index_t snapkv_window(const eval_options& o, index_t P) { return std::max<index_t>(1, std::min(o.window, P / 2)); }

/// Everything one thread needs to evaluate pairs: a runner, caches, a scorer per module.
/// SnapKV's ranking with window w: its recipe with the evaluation's pooling and GQA reduction,
/// nothing protected.
inline kvevict::recipe snapkv_ranking(const eval_options& o, index_t w) {
  kvevict::recipe r = kvevict::recipe::snapkv();
  r.window = w;
  r.n_recent = 0;
  r.pool = o.pooling.pool;
  r.kernel = o.pooling.kernel;
  r.gqa = o.pooling.gqa;
  r.order = o.pooling.order;
  return r;
}

class pair_evaluator {
 public:
  /// modules: the LookaheadKV modules to compare (method names follow "oracle", "snapkv").
  status init(const model& m, const std::vector<const lookahead_module*>& modules, const eval_options& o) {
    model_ = &m;
    opts_ = o;
    for (index_t k : o.budgets)
      if (k < 2) return status::error(errc::invalid_argument, "eval: budget %lld must be >= 2", static_cast<long long>(k));
    KVEVICT_TRY(run_.init(m, {0, 0, 1}));
    KVEVICT_TRY(full_.init(m.cfg()));
    scorers_.assign(modules.size(), {});
    for (std::size_t i = 0; i < modules.size(); ++i) KVEVICT_TRY(scorers_[i].init(m, *modules[i], o.pooling));
    const config& c = m.cfg();
    const auto LP = static_cast<std::size_t>(c.n_layers) * static_cast<std::size_t>(c.seq_len);
    gt_.assign(LP * static_cast<std::size_t>(c.n_heads), 0.0f);
    window_q_.assign(LP * static_cast<std::size_t>(c.dim), 0.0f);
    rankings_.assign(methods() * LP * static_cast<std::size_t>(c.n_kv_heads), 0.0f);
    return {};
  }

  std::size_t methods() const { return 2 + scorers_.size(); }

  /// Evaluates one pair (see the file comment). Errors: the runner's and the stages'.
  status evaluate(const text_pair& p, pair_result& out) {
    const config& c = model_->cfg();
    const index_t P = static_cast<index_t>(p.prompt.size()), L = c.n_layers, H = c.n_heads, Hkv = c.n_kv_heads;
    const index_t hs = c.head_size(), m = static_cast<index_t>(p.response.size()), V = c.vocab_size;
    const index_t w = snapkv_window(opts_, P);
    const std::size_t M = methods(), NB = opts_.budgets.size();
    out.P = P;
    out.recall.assign(M * NB, std::numeric_limits<double>::quiet_NaN());
    for (int r = 0; r < keep_rules; ++r) {
      out.kept_recall[r] = out.recall;
      out.kl[r] = out.recall;
    }
    // prefill, keeping the last w queries of every layer for SnapKV
    full_.clear();
    forward_hooks keep_window;
    keep_window.after_layer = [&](const layer_event& ev) -> status {
      for (index_t h = 0; h < H; ++h)
        for (index_t i = 0; i < w; ++i)
          for (index_t e = 0; e < hs; ++e)
            window_q_[static_cast<std::size_t>(((index_t(ev.layer) * H + h) * w + i) * hs + e)] =
                ev.queries(h, P - w + i, e);
      return {};
    };
    KVEVICT_TRY(run_.forward(full_, tokens(p.prompt), logits_mode::none, keep_window));
    // rankings: oracle, snapkv, modules ([L][H_kv][P] each)
    KVEVICT_TRY(ground_truth(run_, full_, p.response, gt_, ws_));
    for (int l = 0; l < L; ++l) {
      auto gt = *kvevict::make_matrix_view<const float>(gt_.data() + index_t(l) * H * P, H, P);
      KVEVICT_TRY(kvevict::gqa_reduce(kvevict::seq, gt, ranking(0, l, P), kvevict::gqa_op::mean));
      const kvevict::recipe r = snapkv_ranking(opts_, w);
      auto q = *kvevict::make_kv_view<const float>(window_q_.data() + index_t(l) * H * w * hs, H, w, hs);
      auto keys = full_.dense_keys(l, P);
      if (!keys) return keys.error();
      KVEVICT_TRY(with_workspace(ws_, [&](kvevict::workspace& ws) {
        return kvevict::recipe_scores(kvevict::seq, ws, r, q, *keys, kvevict::kv_view<const float>{}, ranking(1, l, P));
      }));
    }
    for (std::size_t s = 0; s < scorers_.size(); ++s) {
      KVEVICT_TRY(scorers_[s].score(run_, full_));
      for (int l = 0; l < L; ++l) {
        const auto src = scorers_[s].scores(l);
        auto dst = ranking(2 + s, l, P);
        for (index_t h = 0; h < Hkv; ++h)
          for (index_t t = 0; t < P; ++t) dst(h, t) = src(h, t);
      }
    }
    // full-cache teacher-forced logits
    const index_t rows = m - 1;
    if (rows > 0) {
      KVEVICT_TRY(run_.forward_extra(full_, tokens(p.response.data(), rows), logits_mode::all));
      full_logits_.assign(run_.logits(0), run_.logits(0) + rows * V);
    }
    auto truth = all_layers(0, P);
    for (std::size_t b = 0; b < NB; ++b) {
      const index_t k = opts_.budgets[b];
      if (k >= P) continue;
      const index_t protect_n = std::min(w, k / 2);
      for (std::size_t meth = 0; meth < M; ++meth) {
        double rec = 0;
        KVEVICT_TRY(with_workspace(ws_, [&](kvevict::workspace& ws) {
          return kvevict::recall_at_k(ws, all_layers(meth, P), truth, k, rec);
        }));
        out.recall[meth * NB + b] = rec;
        for (int rule = 0; rule < keep_rules; ++rule) {
          // kept sets of every layer, then the evicted cache and its teacher-forced KL
          kept_.assign(static_cast<std::size_t>(L * Hkv * k), 0);
          for (int l = 0; l < L; ++l) {
            scratch_.assign(static_cast<std::size_t>(Hkv * P), 0.0f);
            auto sc = *kvevict::make_matrix_view(scratch_.data(), Hkv, P);
            const auto src = ranking(meth, l, P);
            for (index_t h = 0; h < Hkv; ++h)
              for (index_t t = 0; t < P; ++t) sc(h, t) = src(h, t);
            if (rule == static_cast<int>(keep_rule::window)) KVEVICT_TRY(kvevict::protect(kvevict::seq, sc, 0, protect_n));
            auto kept = *kvevict::make_matrix_view(kept_.data() + index_t(l) * Hkv * k, Hkv, k);
            KVEVICT_TRY(with_workspace(ws_, [&](kvevict::workspace& ws) {
              return kvevict::select_topk(kvevict::seq, ws, kvevict::matrix_view<const float>(sc), nullptr, kept);
            }));
          }
          double kr = 0;
          auto kept_all = *kvevict::make_matrix_view<const kvevict::pos_t>(kept_.data(), L * Hkv, k);
          KVEVICT_TRY(with_workspace(ws_, [&](kvevict::workspace& ws) {
            return kvevict::kept_recall_at_k(ws, kept_all, truth, k, kr);
          }));
          out.kept_recall[rule][meth * NB + b] = kr;
          if (rows > 0) {
            double kl = 0;
            KVEVICT_TRY(evicted_kl(p, k, rows, kl));
            out.kl[rule][meth * NB + b] = kl;
          }
        }
      }
    }
    return {};
  }

  runner& get_runner() { return run_; }

 private:
  const model* model_ = nullptr;
  eval_options opts_;
  runner run_;
  kv_cache full_, evicted_;
  std::vector<lookahead_scorer> scorers_;
  std::vector<float> gt_, window_q_, rankings_, scratch_, full_logits_;
  std::vector<kvevict::pos_t> kept_;
  std::vector<std::int32_t> cu_;
  std::vector<unsigned char> ws_;

  kvevict::matrix_view<float> ranking(std::size_t meth, int l, index_t P) {
    const config& c = model_->cfg();
    const index_t Hkv = c.n_kv_heads;
    return *kvevict::make_matrix_view(rankings_.data() + (static_cast<index_t>(meth) * c.n_layers + l) * Hkv * P, Hkv, P);
  }
  kvevict::matrix_view<const float> all_layers(std::size_t meth, index_t P) const {
    const config& c = model_->cfg();
    const index_t R = index_t(c.n_layers) * c.n_kv_heads;
    return *kvevict::make_matrix_view<const float>(rankings_.data() + static_cast<index_t>(meth) * R * P, R, P);
  }

  // KL of the teacher-forced response with the cache compacted to kept_ ([L][H_kv][k])
  status evicted_kl(const text_pair& p, index_t k, index_t rows, double& kl) {
    const config& c = model_->cfg();
    const index_t Hkv = c.n_kv_heads, V = c.vocab_size;
    evicted_ = full_;
    cu_.resize(static_cast<std::size_t>(Hkv + 1));
    for (index_t h = 0; h <= Hkv; ++h) cu_[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * k);
    for (int l = 0; l < c.n_layers; ++l)
      KVEVICT_TRY(evicted_.compact(l, kvevict::ragged_positions(kept_.data() + index_t(l) * Hkv * k, cu_.data(), Hkv)));
    KVEVICT_TRY(run_.forward_extra(evicted_, tokens(p.response.data(), rows), logits_mode::all));
    double sum = 0;
    for (index_t i = 0; i < rows; ++i) sum += kl_logits(full_logits_.data() + i * V, run_.logits(i), V);
    kl = sum / static_cast<double>(rows);
    return {};
  }

  // KL(softmax(a) || softmax(b)) in double
  static double kl_logits(const float* a, const float* b, index_t V) {
    double ma = a[0], mb = b[0];
    for (index_t i = 1; i < V; ++i) ma = std::max(ma, double(a[i])), mb = std::max(mb, double(b[i]));
    double za = 0, zb = 0;
    for (index_t i = 0; i < V; ++i) za += std::exp(a[i] - ma), zb += std::exp(b[i] - mb);
    const double la = std::log(za) + ma, lb = std::log(zb) + mb;
    double kl = 0;
    for (index_t i = 0; i < V; ++i) {
      const double lpa = a[i] - la, lpb = b[i] - lb;
      kl += std::exp(lpa) * (lpa - lpb);
    }
    return std::max(0.0, kl);
  }
};

/// Evaluates pairs on `threads` threads (0: all), one evaluator each; results in pair order.
inline status evaluate_pairs(const model& m, const std::vector<const lookahead_module*>& modules, const eval_options& o,
                             const std::vector<text_pair>& pairs, std::vector<pair_result>& out, int threads = 0,
                             const std::function<void(index_t, index_t)>& progress = {}) {
  std::vector<pair_result> res(pairs.size());
  std::vector<pair_evaluator> workers(static_cast<std::size_t>(thread_count(threads)));
  for (pair_evaluator& w : workers) KVEVICT_TRY(w.init(m, modules, o));
  const auto n = static_cast<index_t>(pairs.size());
  KVEVICT_TRY(for_each_item(
      workers, n,
      [&](pair_evaluator& w, index_t i) {
        return w.evaluate(pairs[static_cast<std::size_t>(i)], res[static_cast<std::size_t>(i)]);
      },
      [&](index_t d, int t) {
        if (t == 0 && progress) progress(d, n);
      }));
  if (progress) progress(static_cast<index_t>(pairs.size()), static_cast<index_t>(pairs.size()));
  out = std::move(res);
  return {};
}

/// Mean, standard error and count of the non-NaN values.
struct summary {
  double mean = std::numeric_limits<double>::quiet_NaN(), sem = std::numeric_limits<double>::quiet_NaN();
  index_t n = 0;
};
inline summary summarize(const std::vector<double>& v) {
  summary s;
  double sum = 0, sq = 0;
  for (double x : v)
    if (!std::isnan(x)) sum += x, sq += x * x, ++s.n;
  if (s.n == 0) return s;
  s.mean = sum / static_cast<double>(s.n);
  if (s.n > 1) {
    const double var = std::max(0.0, (sq - static_cast<double>(s.n) * s.mean * s.mean) / static_cast<double>(s.n - 1));
    s.sem = std::sqrt(var / static_cast<double>(s.n));
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Prefill cost (the paper's Table 3 analogue, measured)

struct timing_result {
  index_t runs = 0;          ///< timed rounds (pairs x reps)
  double load_average = -1;  ///< 1-minute load average when the timing ended (-1: unknown)
  // medians over the rounds, in ms
  double prefill_ms = 0;            ///< prefill alone
  double lookahead_ms = 0;          ///< prefill + lookahead_scorer::score
  double snapkv_ms = 0;             ///< prefill with SnapKV's scores computed in the layer hook
  double lookahead_score_ms = 0;    ///< lookahead_scorer::score alone (the extra block + scores)
  double snapkv_score_ms = 0;       ///< the hook's SnapKV scoring alone (summed over the layers)
  // medians of the per-round ratios (each round runs the three variants back to back, so slow
  // drifts of the machine's load cancel)
  double lookahead_ratio = 0;  ///< (prefill + lookahead) / prefill of the same round
  double snapkv_ratio = 0;     ///< (prefill + SnapKV) / prefill of the same round
};

/// The 1-minute load average (Linux /proc/loadavg), or -1.
inline double load_average() {
  double v = -1;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &v) != 1) v = -1;
    std::fclose(f);
  }
  return v;
}

/// For each pair's prompt, `reps` rounds of: prefill alone; prefill + lookahead_scorer::score; prefill
/// with SnapKV's window scores computed in the layer hook (recipe_scores per layer, pooled and
/// reduced as the eval's ranking, as KVCache-Factory scores inside the attention forward). Round 0
/// of each prompt warms up and is not counted. threads: the runner's and the stages'.
inline status time_prefill(const model& m, const lookahead_module& mod, const eval_options& o,
                           const std::vector<text_pair>& pairs, index_t reps, int threads, timing_result& out) {
  runner run;
  kv_cache cache;
  lookahead_scorer scorer;
  KVEVICT_TRY(run.init(m, {0, 0, threads}));
  KVEVICT_TRY(cache.init(m.cfg()));
  KVEVICT_TRY(scorer.init(m, mod, o.pooling));
  const config& c = m.cfg();
  std::vector<float> snap(static_cast<std::size_t>(c.n_layers) * c.n_kv_heads * c.seq_len);
  std::vector<unsigned char> ws;
  std::vector<double> t_pre, t_lkv, t_snap, t_lkv_score, t_snap_score, r_lkv, r_snap;
  using clock = std::chrono::steady_clock;
  auto ms = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  for (const text_pair& p : pairs) {
    const index_t P = static_cast<index_t>(p.prompt.size()), w = snapkv_window(o, P);
    const kvevict::recipe r = snapkv_ranking(o, w);
    double hook_ms = 0;
    forward_hooks snap_hook;
    snap_hook.after_layer = [&](const layer_event& ev) -> status {
      const auto h0 = clock::now();
      const auto& qv = ev.queries;
      auto q = *kvevict::make_kv_view<const float>(qv.data_handle() + (P - w) * qv.stride(1), qv.extent(0), w,
                                                   qv.extent(2), qv.stride(0), qv.stride(1));
      auto keys = cache.dense_keys(ev.layer, P);
      if (!keys) return keys.error();
      auto out_v = *kvevict::make_matrix_view(snap.data() + index_t(ev.layer) * c.n_kv_heads * P, c.n_kv_heads, P);
      const status st = with_workspace(ws, [&](kvevict::workspace& wsp) {
        if (threads > 1)
          return kvevict::recipe_scores(kvevict::par_t{threads}, wsp, r, q, *keys, kvevict::kv_view<const float>{}, out_v);
        return kvevict::recipe_scores(kvevict::seq, wsp, r, q, *keys, kvevict::kv_view<const float>{}, out_v);
      });
      hook_ms += ms(h0, clock::now());
      return st;
    };
    for (index_t rep = 0; rep <= reps; ++rep) {  // round 0 warms up and is not counted
      cache.clear();
      auto a = clock::now();
      KVEVICT_TRY(run.forward(cache, tokens(p.prompt), logits_mode::last));
      const double pre = ms(a, clock::now());
      cache.clear();
      a = clock::now();
      KVEVICT_TRY(run.forward(cache, tokens(p.prompt), logits_mode::last));
      const auto b = clock::now();
      KVEVICT_TRY(scorer.score(run, cache));
      const auto e = clock::now();
      const double lkv = ms(a, e), lkv_score = ms(b, e);
      cache.clear();
      hook_ms = 0;
      a = clock::now();
      KVEVICT_TRY(run.forward(cache, tokens(p.prompt), logits_mode::last, snap_hook));
      const double sn = ms(a, clock::now());
      if (rep == 0) continue;
      t_pre.push_back(pre);
      t_lkv.push_back(lkv);
      t_snap.push_back(sn);
      t_lkv_score.push_back(lkv_score);
      t_snap_score.push_back(hook_ms);
      r_lkv.push_back(lkv / pre);
      r_snap.push_back(sn / pre);
    }
  }
  auto median = [](std::vector<double> v) {
    if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  out.runs = static_cast<index_t>(t_pre.size());
  out.prefill_ms = median(t_pre);
  out.lookahead_ms = median(t_lkv);
  out.snapkv_ms = median(t_snap);
  out.lookahead_score_ms = median(t_lkv_score);
  out.snapkv_score_ms = median(t_snap_score);
  out.lookahead_ratio = median(r_lkv);
  out.snapkv_ratio = median(r_snap);
  out.load_average = load_average();
  return {};
}

}  // namespace kvrun
