// report/tables.hpp: the report's tables as Markdown (docs/report/tables.md): per metric, every
// (recipe, driver) row at every budget with its mean ± standard error over the prompts and its paired
// difference to SnapKV post-fill at the same budget, marked when significant.
//
// Significance: two-sided p of the paired mean difference under the normal approximation
// (two_sided_p); "*" p < 0.05, "**" also p < 0.05 / m with m the comparisons of that table
// (Bonferroni). Rows are not independent (the same prompts, nested budgets), so even "**" is a
// screening mark, not a family-wise guarantee over the whole report.
#pragma once

#include <report/report.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace kvrun {

namespace detail {

inline const char* significance_mark(const paired_difference& d, double bonferroni) {
  const double p = two_sided_p(d);
  return p < bonferroni ? "**" : p < 0.05 ? "*" : "";
}

inline std::string row_label(const report_config& c) {
  std::string s = method_name(c.recipe);
  if (c.driver != driver_kind::postfill) s += std::string(" / ") + driver_name(c.driver);
  if (c.fraction >= 0.0) {
    char b[32];
    std::snprintf(b, sizeof b, " p=%.2f", c.fraction);
    s += b;
  }
  return s;
}

}  // namespace detail

/// The counts every table states: LAQ's pseudo tokens, SpecKV's draft tokens (and draft layers),
/// LookaheadKV's lookahead tokens.
inline std::string report_counts(const report_result& r) {
  char b[320];
  std::snprintf(b, sizeof b,
                "LAQ / LAQ++ pseudo tokens: %lld; SpecKV draft tokens: %lld (draft: the first %lld layers + output "
                "head); LookaheadKV lookahead tokens: %s",
                static_cast<long long>(r.options.base.laq_steps), static_cast<long long>(r.options.base.draft_tokens),
                static_cast<long long>(r.options.base.draft_layers),
                r.options.lookahead != nullptr ? std::to_string(r.options.lookahead->n_lookahead()).c_str() : "(no module)");
  return b;
}

/// The head-type rows (duo-heuristic, duo, prulong at fixed fractions of streaming heads), one table:
/// every metric with its paired difference to duo-heuristic at the same fraction and driver, and the
/// KV footprint / peak. Empty when the report has none.
inline std::string head_rows_markdown(const report_result& r) {
  std::vector<std::size_t> rows;
  for (std::size_t i = 0; i < r.rows.size(); ++i)
    if (r.rows[i].cfg.head_sparsity >= 0.0) rows.push_back(i);
  if (rows.empty()) return {};
  index_t comparisons = 0;
  for (const std::size_t i : rows) comparisons += r.rows[i].d_kl.valid ? 1 : 0;
  const double bonferroni = comparisons > 0 ? 0.05 / static_cast<double>(comparisons) : 0.05;
  char b[1024];
  std::snprintf(b, sizeof b,
                "\n## Head types: DuoAttention and PruLong (trained masks) against the heuristic, by fraction of streaming "
                "heads\n\n"
                "s = fraction of streaming heads: the top floor(20 (1 − s)) heads keep the whole cache, the others %lld "
                "sinks + %lld recent tokens, in every driver (chunked: identical for naive and patched, a head type needs "
                "no scores). duo: DuoAttention's trained alpha; prulong: PruLong's mask trained at s; duo-heuristic: the "
                "attention-mass calibration. Recall's k: the rows a row keeps per head on average. In brackets the paired "
                "difference to duo-heuristic at the same s and driver; `*` p < 0.05, `**` p < 0.05 / m, m = %lld "
                "comparisons per metric (Bonferroni %.2g).\n\n",
                static_cast<long long>(r.options.base.sinks >= 0 ? r.options.base.sinks : 4),
                static_cast<long long>(r.options.base.duo_recent), static_cast<long long>(comparisons), bonferroni);
  std::string s = b;
  s += "| method / driver | s | retrieval heads | KL | top-1 | greedy agreement | recall | footprint / peak |\n"
       "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  for (const std::size_t i : rows) {
    const config_result& c = r.rows[i];
    auto cell = [&](const char* fmt, double mean, double sem, const char* dfmt, const paired_difference& d) {
      std::string x;
      std::snprintf(b, sizeof b, fmt, mean, sem);
      x = b;
      if (d.valid) {
        std::snprintf(b, sizeof b, dfmt, d.mean, d.sem);
        x += std::string(" (") + b + detail::significance_mark(d, bonferroni) + ")";
      } else if (c.cfg.recipe == method::duo_heuristic) {
        x += " (reference)";
      }
      return x;
    };
    std::snprintf(b, sizeof b, "| %s | %.2f | %lld | ", detail::row_label(c.cfg).c_str(), c.cfg.head_sparsity,
                  static_cast<long long>(i < r.head_retrieval.size() ? r.head_retrieval[i] : -1));
    s += b;
    s += cell("%.4f ± %.4f", c.kl, c.kl_sem, "%+.4f ± %.4f", c.d_kl) + " | ";
    s += cell("%.3f ± %.3f", c.top1, c.top1_sem, "%+.3f ± %.3f", c.d_top1) + " | ";
    s += cell("%.1f ± %.1f", c.agreement, c.agreement_sem, "%+.1f ± %.1f", c.d_agreement) + " | ";
    s += cell("%.3f ± %.3f", c.recall, c.recall_sem, "%+.3f ± %.3f", c.d_recall) + " | ";
    std::snprintf(b, sizeof b, "%.3f / %.3f |\n", c.footprint, c.peak);
    s += b;
  }
  return s;
}

/// The Markdown tables (see the file comment). `title`: the first heading.
inline std::string report_markdown(const report_result& r, const std::string& title) {
  std::string s = "# " + title + "\n\n";
  char b[512];
  const index_t n = static_cast<index_t>(r.prompt_lengths.size());
  std::snprintf(b, sizeof b,
                "%lld held-out prompts (test seeds %llu..%llu, %lld..%lld tokens), response %lld tokens. %s.\n\n",
                static_cast<long long>(n), static_cast<unsigned long long>(r.seeds.front()),
                static_cast<unsigned long long>(r.seeds.back()),
                static_cast<long long>(*std::min_element(r.prompt_lengths.begin(), r.prompt_lengths.end())),
                static_cast<long long>(*std::max_element(r.prompt_lengths.begin(), r.prompt_lengths.end())),
                static_cast<long long>(r.response), report_counts(r).c_str());
  s += b;
  if (!r.draft_match.empty()) {
    double mean = 0.0;
    for (const double x : r.draft_match) mean += x;
    mean /= static_cast<double>(r.draft_match.size());
    std::snprintf(b, sizeof b,
                  "SpecKV's draft tokens equal the full cache's greedy response at the same position %.1f%% of the time "
                  "(mean over the prompts).\n\n",
                  100.0 * mean);
    s += b;
  }
  s += "Cells: mean ± standard error over the prompts; in brackets the paired difference to SnapKV post-fill at "
       "the same budget (this row − SnapKV, per prompt) ± its standard error. `*`: two-sided p < 0.05 (normal "
       "approximation of the paired mean); `**`: also p < 0.05 / m, m = the comparisons in that table "
       "(Bonferroni). The rows share prompts and budgets nest, so the marks screen, they do not guarantee.\n";

  std::vector<index_t> budgets;
  for (const config_result& c : r.rows)
    if (c.cfg.budget > 0 && std::find(budgets.begin(), budgets.end(), c.cfg.budget) == budgets.end())
      budgets.push_back(c.cfg.budget);
  // distinct rows (recipe, driver, fraction) in order of appearance
  std::vector<report_config> kinds;
  for (const config_result& c : r.rows) {
    if (c.cfg.budget <= 0) continue;
    bool seen = false;
    for (const report_config& k : kinds)
      seen = seen || (k.recipe == c.cfg.recipe && k.driver == c.cfg.driver && k.fraction == c.cfg.fraction);
    if (!seen) kinds.push_back(c.cfg);
  }
  auto find = [&](const report_config& k, index_t budget) -> const config_result* {
    for (const config_result& c : r.rows)
      if (c.cfg.recipe == k.recipe && c.cfg.driver == k.driver && c.cfg.fraction == k.fraction && c.cfg.budget == budget)
        return &c;
    return nullptr;
  };
  // The budgets' header row, then a row per kind (post-fill ones only if asked): its label and, per
  // budget, cell(result) (ending in " |") or an empty cell where the kind has no result.
  const auto table = [&](bool postfill_only, const auto& cell) {
    for (const index_t B : budgets) s += " B = " + std::to_string(B) + " |";
    s += "\n| --- |";
    for (std::size_t i = 0; i < budgets.size(); ++i) s += " ---: |";
    s += "\n";
    for (const report_config& k : kinds) {
      if (postfill_only && k.driver != driver_kind::postfill) continue;
      s += "| " + detail::row_label(k) + " |";
      for (const index_t B : budgets) {
        const config_result* c = find(k, B);
        s += c == nullptr ? std::string(" |") : cell(*c);
      }
      s += "\n";
    }
  };
  struct metric {
    const char* title;
    const char* fmt;    // mean ± sem
    const char* d_fmt;  // paired difference ± sem
    double config_result::*mean;
    double config_result::*sem;
    paired_difference config_result::*d;
  };
  const metric metrics[] = {
      {"KL(full ‖ evicted), nats, teacher-forced (lower is better)", "%.4f ± %.4f", "%+.4f ± %.4f", &config_result::kl,
       &config_result::kl_sem, &config_result::d_kl},
      {"Teacher-forced top-1 agreement with the full cache (higher is better; full = 1)", "%.3f ± %.3f", "%+.3f ± %.3f",
       &config_result::top1, &config_result::top1_sem, &config_result::d_top1},
      {"Greedy agreement: tokens before the first divergence from the full cache's response (higher is better)",
       "%.1f ± %.1f", "%+.1f ± %.1f", &config_result::agreement, &config_result::agreement_sem,
       &config_result::d_agreement},
      {"Recall of the response's most-attended prompt tokens (higher is better)", "%.3f ± %.3f", "%+.3f ± %.3f",
       &config_result::recall, &config_result::recall_sem, &config_result::d_recall},
  };
  for (const metric& m : metrics) {
    index_t comparisons = 0;
    for (const config_result& c : r.rows)
      if ((c.*m.d).valid && c.cfg.head_sparsity < 0.0 && !(c.cfg.recipe == method::snapkv && c.cfg.driver == driver_kind::postfill))
        ++comparisons;
    const double bonferroni = comparisons > 0 ? 0.05 / static_cast<double>(comparisons) : 0.05;
    std::snprintf(b, sizeof b, "\n## %s\n\nm = %lld comparisons, Bonferroni bound p < %.2g.\n\n| method |", m.title,
                  static_cast<long long>(comparisons), bonferroni);
    s += b;
    table(false, [&](const config_result& c) {
      std::snprintf(b, sizeof b, m.fmt, c.*m.mean, c.*m.sem);
      std::string cell = std::string(" ") + b;
      const paired_difference& d = c.*m.d;
      if (c.cfg.recipe == method::snapkv && c.cfg.driver == driver_kind::postfill) {
        cell += " (reference)";
      } else if (d.valid) {
        std::snprintf(b, sizeof b, m.d_fmt, d.mean, d.sem);
        cell += std::string(" (") + b + detail::significance_mark(d, bonferroni) + ")";
      }
      return cell + " |";
    });
  }

  s += head_rows_markdown(r);

  s += "\n## KV footprint / peak KV (means over the prompts)\n\n| method |";
  table(false, [&](const config_result& c) {
    std::snprintf(b, sizeof b, " %.3f / %.3f |", c.footprint, c.peak);
    return std::string(b);
  });
  s += "\n## Eviction time (median ms) and (prefill + eviction) / prefill (median), post-fill rows\n\n";
  s += "Times are wall-clock on a shared machine: only their order of magnitude and the ratios are comparable.\n\n| method |";
  table(true, [&](const config_result& c) {
    std::snprintf(b, sizeof b, " %.2f (%+.1f%%) |", c.evict_ms, (c.overhead - 1.0) * 100.0);
    return std::string(b);
  });
  return s;
}

}  // namespace kvrun
