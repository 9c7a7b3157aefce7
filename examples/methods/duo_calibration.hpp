// methods/duo_calibration.hpp: DuoAttention-style head types for the runner, from a calibration
// pass over model-generated text (duo_calibrate) or from a trained head-mask file
// (head_types_from_file: DuoAttention's alpha, PruLong's mask).
//
// DuoAttention learns, per KV head, a gate between full attention and a streaming window (sinks +
// recent tokens) by optimisation on synthetic retrieval data; PruLong trains the same gates. Neither
// fits a 260K-parameter story model, so the runner ranks heads by what a streaming head would lose:
//
//   global[l][h] = mean over calibration texts, over the query rows i >= sinks + recent and over the
//                  query heads of KV head h's group, of the attention mass that row puts on the keys
//                  outside the sinks and the recent window, sum_{sinks <= j <= i - recent} p_ij
//
// (p: the full-cache softmax attention of the prefill, fp32). The duo allocator then makes the
// heads with the largest `global` retrieval heads (they keep the whole prompt) and the others
// streaming heads (sinks + recent), with as many retrieval heads as the budget affords
// (kvevict::duo_retrieval_heads, kvevict::prulong_topk_mask, kvevict::duo_budgets). This is a
// calibration by attention statistics, not DuoAttention's optimisation; docs/report.md says so.
//
// Calibration text: any texts; kvevict-run and the report use model-generated (prompt, response)
// pairs of the TRAINING seed range (lookaheadkv/data.hpp, training_texts), disjoint from the
// report's test prompts.
#pragma once

#include <runner/evict.hpp>

#include <kvevict/train/prulong.hpp>

#include <cmath>
#include <string>
#include <vector>

namespace kvrun {

struct duo_calibration_options {
  index_t sinks = 4;    ///< the streaming heads' sinks
  index_t recent = 12;  ///< and recent window (the key of row i itself included)
  int threads = 1;      ///< runner threads for the prefill
};

/// global[l][h] over `texts` (token ids, BOS first, each at most seq_len tokens), see the file
/// comment. Errors: no texts, an empty or too long text, negative sinks / recent, a text with no row
/// past sinks + recent, the runner's errors.
inline status duo_calibrate(const model& m, const std::vector<std::vector<int>>& texts, const duo_calibration_options& o,
                            duo_heads& out) {
  const config& c = m.cfg();
  const index_t L = c.n_layers, Hkv = c.n_kv_heads, Hq = c.n_heads, d = c.head_size(), group = c.group_size();
  if (texts.empty()) return status::error(errc::invalid_argument, "duo calibration: no calibration text");
  if (o.sinks < 0 || o.recent < 0)
    return status::error(errc::invalid_argument, "duo calibration: sinks (%lld) and recent (%lld) must be >= 0",
                         static_cast<long long>(o.sinks), static_cast<long long>(o.recent));
  runner run;
  KVEVICT_TRY(run.init(m, {0, 0, o.threads}));
  kv_cache cache;
  KVEVICT_TRY(cache.init(c));
  block_capture q;
  std::vector<double> sum(static_cast<std::size_t>(L * Hkv), 0.0);
  std::vector<float> row(static_cast<std::size_t>(c.seq_len));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (const std::vector<int>& text : texts) {
    const index_t n = static_cast<index_t>(text.size());
    const index_t first = o.sinks + o.recent;
    if (n < 1 || n > c.seq_len)
      return status::error(errc::invalid_argument, "duo calibration: a text has %lld tokens (1..%d)",
                           static_cast<long long>(n), c.seq_len);
    if (first >= n)
      return status::error(errc::invalid_argument,
                           "duo calibration: a text of %lld tokens has no query row past %lld sinks + %lld recent",
                           static_cast<long long>(n), static_cast<long long>(o.sinks), static_cast<long long>(o.recent));
    cache.clear();
    q.reset(c, n);
    KVEVICT_TRY(run.forward(cache, tokens(text), logits_mode::none, q.hooks()));
    for (int l = 0; l < L; ++l) {
      const auto qs = q.queries(l, 0, n);
      for (index_t h = 0; h < Hq; ++h) {
        const index_t kvh = h / group;
        double mass = 0.0;
        for (index_t i = first; i < n; ++i) {
          float mx = -INFINITY;
          for (index_t j = 0; j <= i; ++j) {
            const float* k = cache.key_row(l, kvh, j);
            float s = 0.0f;
            for (index_t x = 0; x < d; ++x) s += qs(h, i, x) * k[x];
            row[static_cast<std::size_t>(j)] = s * scale;
            mx = std::max(mx, row[static_cast<std::size_t>(j)]);
          }
          float total = 0.0f;
          for (index_t j = 0; j <= i; ++j) total += (row[static_cast<std::size_t>(j)] = std::exp(row[static_cast<std::size_t>(j)] - mx));
          double outside = 0.0;
          for (index_t j = o.sinks; j <= i - o.recent; ++j) outside += static_cast<double>(row[static_cast<std::size_t>(j)] / total);
          mass += outside;
        }
        sum[static_cast<std::size_t>(l * Hkv + kvh)] += mass / static_cast<double>(n - first) / static_cast<double>(group);
      }
    }
  }
  out.global.resize(sum.size());
  for (std::size_t i = 0; i < sum.size(); ++i) out.global[i] = sum[i] / static_cast<double>(texts.size());
  return {};
}

/// The head types of a trained head-mask TSV file (DuoAttention's alpha, PruLong's mask; values
/// clipped to [0, 1] like DuoAttention's loader): its values rank the heads; `sparsity` in [0, 1]
/// makes floor(L H (1 - sparsity)) of them retrieval heads, a negative sparsity the heads >= 0.5
/// (DuoAttention's threshold; a PruLong mask's own ones). Errors: the file's (read_head_mask_tsv,
/// the model's shape), a sparsity above 1.
inline status head_types_from_file(const config& c, const std::string& path, double sparsity, duo_heads& out) {
  const index_t L = c.n_layers, H = c.n_kv_heads;
  if (!(sparsity <= 1.0))
    return status::error(errc::invalid_argument, "--head-sparsity %g is above 1 (a fraction of streaming heads)", sparsity);
  std::vector<double> v(static_cast<std::size_t>(L * H));
  kvevict::head_mask_tsv_options opt;
  opt.range = kvevict::head_mask_range::clip;
  KVEVICT_TRY(kvevict::read_head_mask_tsv(path.c_str(), *kvevict::make_matrix_view(v.data(), L, H), opt));
  index_t k = 0;
  if (sparsity >= 0) {
    const auto r = kvevict::prulong_retrieval_heads(L * H, sparsity);
    if (!r) return r.error();
    k = *r;
  } else {
    for (double x : v) k += x >= 0.5 ? 1 : 0;
  }
  out.global = std::move(v);
  out.retrieval = k;
  return {};
}

}  // namespace kvrun
