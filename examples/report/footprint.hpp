// report/footprint.hpp: the "Cache Me If You Can" footprint protocol on the reference runner
// (`kvevict-run --footprint`, docs/report.md "Critical KV footprint").
//
// Per curve (method x driver) a sweep: budgets for the post-fill, layer-wise and decode drivers,
// the per-chunk eviction fraction p for the chunked drivers (the paper's "evict p% of input KVs at
// each pre-filling step"). Every point runs on the same held-out prompts as the report
// (report.hpp's evaluate_batch) and gives its mean KV footprint (kvevict::measure_kv_usage over the
// prompt and the response) and a performance whose full-cache value is defined:
//   top1       teacher-forced top-1 agreement with the full cache's greedy response (full = 1);
//   agreement  greedy tokens before the first divergence / response length (full = 1);
// with KL reported next to them. The critical footprint at F (0.9) is kvevict::critical_footprint
// of the curve's (footprint, mean performance) points with linear interpolation (the paper's
// Table 2; "< x" / "> x" when the smallest point already meets the threshold / no point does).
// Its standard error is a bootstrap over the prompts (the whole curve resampled, 200 times, a fixed
// seed). Naive against patched chunking is also compared point by point, paired per prompt.
#pragma once

#include <report/report.hpp>
#include <report/svg.hpp>
#include <report/tables.hpp>

#include <kvevict/metrics/footprint.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace kvrun {

/// One performance-vs-footprint curve.
struct footprint_curve {
  method recipe = method::snapkv;
  driver_kind driver = driver_kind::postfill;
  bool by_fraction = false;  ///< sweep the per-chunk fraction (chunked drivers) instead of the budget
  /// Head-type methods: sweep the fraction of streaming heads (footprint_options::head_sparsities)
  /// instead of the budget (duo, prulong: their trained masks; duo-heuristic: its calibration).
  bool by_head_sparsity = false;
};

struct footprint_options {
  report_options report;  ///< prompts, pairs, module, threads, progress, the eviction options
  std::vector<index_t> budgets{8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256};
  std::vector<double> fractions{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98};
  /// The head-sparsity sweep (PruLong ships masks at 25, 50 and 75 %).
  std::vector<double> head_sparsities{0.25, 0.5, 0.75};
  std::vector<method> recipes;       ///< empty: the default curves' methods
  std::vector<driver_kind> drivers;  ///< empty: the default curves' drivers
  double fraction_of_full = 0.9;     ///< F
  int bootstrap = 200;               ///< resamples of the prompts for the critical footprints' errors
};

/// A curve's critical footprint for one performance metric.
struct critical_point {
  kvevict::critical_footprint_result at;  ///< on the mean curve
  double se = 0.0;                        ///< bootstrap standard error over the prompts
};

struct curve_result {
  footprint_curve curve;
  std::vector<std::size_t> rows;  ///< indices into report.rows, in sweep order
  critical_point top1, agreement;
};

struct footprint_result {
  footprint_options options;
  report_result report;
  std::vector<curve_result> curves;
};

/// The default curves: every post-fill method the runner wires but the oracle (budget sweep); the
/// decode-time classics at decode time (budget sweep); SnapKV and LAVa chunked, naive and patched
/// (fraction sweep). PyramidKV chunked (the paper's main chunked method) is left out: with a
/// per-chunk fraction every head evicts p of its own rows, so the pyramid's budget shape has no
/// effect and its curve is SnapKV's (a first 64-prompt run gave identical numbers). `lookahead`: include lookaheadkv.
inline std::vector<footprint_curve> default_footprint_curves(bool lookahead) {
  std::vector<footprint_curve> out;
  for (const method m : {method::streaming_llm, method::h2o, method::tova, method::snapkv, method::pyramidkv,
                         method::adakv, method::cake, method::lava, method::duo_heuristic, method::laq, method::speckv,
                         method::lookaheadkv})
    if (m != method::lookaheadkv || lookahead) out.push_back({m, driver_kind::postfill, false});
  for (const method m : {method::streaming_llm, method::h2o, method::tova, method::snapkv})
    out.push_back({m, driver_kind::decode, false});
  for (const method m : {method::snapkv, method::lava})
    for (const driver_kind d : {driver_kind::chunked_naive, driver_kind::chunked_patched}) out.push_back({m, d, true});
  // PruLong vs DuoAttention (trained) vs the heuristic by fraction of streaming heads, post-fill and
  // chunked (streaming heads stream from the first chunk on)
  for (const driver_kind d : {driver_kind::postfill, driver_kind::chunked_naive})
    for (const method m : {method::duo_heuristic, method::duo, method::prulong}) out.push_back({m, d, false, true});
  return out;
}

/// The curves of a run: with recipes / drivers given, every supported (method, driver) pair among
/// them (chunked drivers by fraction, unless the method refuses a fraction: then by budget);
/// otherwise the default curves. Errors: no curve matches.
inline status footprint_curves(const config& c, const footprint_options& o, std::vector<footprint_curve>& out) {
  out.clear();
  const bool lookahead = o.report.lookahead != nullptr;
  if (o.recipes.empty() && o.drivers.empty()) {
    out = default_footprint_curves(lookahead);
    return {};
  }
  for (const named<method>& mn : method_names) {
    const method m = mn.value;
    if (m == method::full || (m == method::lookaheadkv && !lookahead)) continue;
    if (!o.recipes.empty() && std::find(o.recipes.begin(), o.recipes.end(), m) == o.recipes.end()) continue;
    for (const named<driver_kind>& dn : driver_names) {
      const driver_kind d = dn.value;
      if (!o.drivers.empty() && std::find(o.drivers.begin(), o.drivers.end(), d) == o.drivers.end()) continue;
      evict_options e = o.report.base;
      e.recipe = m;
      e.driver = d;
      e.budget = 64;
      e.alloc.reset();
      if (uses_head_types(m)) {  // trained masks: by head sparsity only; the heuristic: by budget too
        if (!check_evict_options(c, e).ok()) continue;
        if (m == method::duo_heuristic) out.push_back({m, d, false});
        out.push_back({m, d, false, true});
        continue;
      }
      const bool chunked = d == driver_kind::chunked_naive || d == driver_kind::chunked_patched;
      if (chunked) e.chunk_fraction = 0.5;
      if (check_evict_options(c, e).ok()) {
        out.push_back({m, d, chunked});
        continue;
      }
      e.chunk_fraction = -1.0;
      if (chunked && check_evict_options(c, e).ok()) out.push_back({m, d, false});
    }
  }
  if (out.empty())
    return status::error(errc::invalid_argument, "footprint: no supported (recipe, driver) pair in --recipes / --drivers");
  if (o.recipes.size() > 0 && std::find(o.recipes.begin(), o.recipes.end(), method::lookaheadkv) != o.recipes.end() &&
      !lookahead)
    return status::error(errc::invalid_argument, "footprint: lookaheadkv needs a trained lookahead module (--lookahead-module)");
  return {};
}

namespace detail {

// xorshift64*: the bootstrap's resampling, deterministic.
struct bootstrap_rng {
  std::uint64_t s;
  std::uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
};

template <class Get>
status critical_of(const report_result& r, const std::vector<std::size_t>& rows, const std::vector<std::size_t>& take,
                   double F, Get get, kvevict::critical_footprint_result& out) {
  std::vector<kvevict::curve_point> pts;
  for (const std::size_t ri : rows) {
    const config_result& c = r.rows[ri];
    double f = 0.0, p = 0.0;
    for (const std::size_t i : take) {
      f += c.prompts[i].footprint;
      p += get(c.prompts[i]);
    }
    pts.push_back({f / static_cast<double>(take.size()), p / static_cast<double>(take.size())});
  }
  kvevict::critical_footprint_options co;
  co.fraction = F;
  return kvevict::critical_footprint(pts.data(), static_cast<index_t>(pts.size()), 1.0, out, co);
}

template <class Get>
status critical_with_error(const report_result& r, const std::vector<std::size_t>& rows, const footprint_options& o,
                           Get get, critical_point& out) {
  const std::size_t n = r.prompt_lengths.size();
  std::vector<std::size_t> all(n);
  for (std::size_t i = 0; i < n; ++i) all[i] = i;
  KVEVICT_TRY(critical_of(r, rows, all, o.fraction_of_full, get, out.at));
  if (o.bootstrap < 2 || n < 2) return {};
  bootstrap_rng rng{0x9e3779b97f4a7c15ull};
  double sum = 0.0, sum2 = 0.0;
  std::vector<std::size_t> take(n);
  for (int b = 0; b < o.bootstrap; ++b) {
    for (std::size_t i = 0; i < n; ++i) take[i] = static_cast<std::size_t>(rng.next() % n);
    kvevict::critical_footprint_result x;
    KVEVICT_TRY(critical_of(r, rows, take, o.fraction_of_full, get, x));
    sum += x.footprint;
    sum2 += x.footprint * x.footprint;
  }
  const double m = sum / o.bootstrap;
  out.se = std::sqrt(std::max(0.0, (sum2 / o.bootstrap - m * m) * o.bootstrap / (o.bootstrap - 1.0)));
  return {};
}

inline double top1_of(const prompt_result& p) { return p.top1; }

}  // namespace detail

/// Runs the sweep and computes the critical footprints. Errors: invalid options (a budget below a
/// method's protected tokens, a fraction outside (0, 1)), every error of run_report.
inline status run_footprint(const model& mdl, const footprint_options& o, footprint_result& out) {
  const config& c = mdl.cfg();
  std::vector<footprint_curve> curves;
  KVEVICT_TRY(footprint_curves(c, o, curves));
  if (o.budgets.empty()) return status::error(errc::invalid_argument, "footprint: no budget given");
  for (const double f : o.fractions)
    if (!(f > 0.0 && f < 1.0)) return status::error(errc::invalid_argument, "footprint: fraction %g is outside (0, 1)", f);
  if (!(o.fraction_of_full > 0.0 && o.fraction_of_full <= 1.0))
    return status::error(errc::invalid_argument, "footprint: F = %g is outside (0, 1]", o.fraction_of_full);
  report_options ro = o.report;
  ro.configs.clear();
  ro.head_sparsities = o.head_sparsities;
  std::vector<std::vector<report_config>> per_curve;
  for (const footprint_curve& fc : curves) {
    per_curve.emplace_back();
    if (fc.by_head_sparsity) {
      for (const double hs : o.head_sparsities) per_curve.back().push_back({fc.recipe, fc.driver, 0, -1.0, hs});
    } else if (fc.by_fraction) {
      for (const double f : o.fractions) per_curve.back().push_back({fc.recipe, fc.driver, 64, f});
    } else {
      for (const index_t b : o.budgets) {
        evict_options e = ro.base;
        e.recipe = fc.recipe;
        e.driver = fc.driver;
        e.budget = b;
        e.alloc.reset();
        if (b < protected_tokens(e)) continue;  // below what the method protects: not a point of its curve
        per_curve.back().push_back({fc.recipe, fc.driver, b, -1.0});
      }
    }
    ro.configs.insert(ro.configs.end(), per_curve.back().begin(), per_curve.back().end());
  }
  out = footprint_result{};
  out.options = o;
  out.options.report.progress = {};
  KVEVICT_TRY(run_report(mdl, ro, out.report));
  // rows: full, then the configs in order
  std::size_t at = 1;
  for (std::size_t k = 0; k < curves.size(); ++k) {
    curve_result cr;
    cr.curve = curves[k];
    for (std::size_t i = 0; i < per_curve[k].size(); ++i) cr.rows.push_back(at++);
    if (!cr.rows.empty()) {
      KVEVICT_TRY(detail::critical_with_error(out.report, cr.rows, o, detail::top1_of, cr.top1));
      const double m = static_cast<double>(out.report.response);
      KVEVICT_TRY(detail::critical_with_error(
          out.report, cr.rows, o, [m](const prompt_result& p) { return static_cast<double>(p.agreement) / m; },
          cr.agreement));
    }
    out.curves.push_back(std::move(cr));
  }
  return {};
}

namespace detail {

inline std::string curve_label(const footprint_curve& c) {
  std::string s = method_name(c.recipe);
  if (c.driver != driver_kind::postfill) s += std::string(" / ") + driver_name(c.driver);
  if (c.by_head_sparsity && c.recipe == method::duo_heuristic) s += " (by s)";
  return s;
}

inline const char* sweep_name(const footprint_curve& c) {
  return c.by_head_sparsity ? "head_sparsity" : c.by_fraction ? "chunk_fraction" : "budget";
}

inline std::string critical_text(const critical_point& c, bool with_se) {
  char b[64];
  const double pct = 100.0 * c.at.footprint;
  switch (c.at.kind) {
    case kvevict::critical_kind::at_or_below_min: std::snprintf(b, sizeof b, "< %.1f", pct); break;
    case kvevict::critical_kind::above_max: std::snprintf(b, sizeof b, "> %.1f", pct); break;
    default:
      if (with_se) std::snprintf(b, sizeof b, "%.1f ± %.1f", pct, 100.0 * c.se);
      else std::snprintf(b, sizeof b, "%.1f", pct);
  }
  return b;
}

}  // namespace detail

/// Table 2's analogue and the curves' points, as Markdown.
inline std::string footprint_markdown(const footprint_result& r) {
  const report_result& rr = r.report;
  std::string s = "# Critical KV footprint (the footprint paper's protocol) on stories260K\n\n";
  char b[1600];
  std::snprintf(b, sizeof b,
                "%zu held-out prompts (test seeds %llu..%llu, %lld..%lld tokens), response %lld tokens; chunk %lld "
                "tokens, window %lld. %s. Performance: teacher-forced top-1 agreement with the full cache (full = 1) "
                "and greedy agreement / %lld (full = 1). Critical footprint: the smallest KV footprint (%%) at which "
                "the mean performance reaches F = %.0f%% of the full cache's, linearly interpolated between sweep points "
                "(kvevict::critical_footprint, first reach); ± a bootstrap standard error over the prompts (%d "
                "resamples; an interpolated value's error only). \"< x\": the smallest point already meets it; \"> x\": no "
                "point does.\n\n",
                rr.prompt_lengths.size(), static_cast<unsigned long long>(rr.seeds.front()),
                static_cast<unsigned long long>(rr.seeds.back()),
                static_cast<long long>(*std::min_element(rr.prompt_lengths.begin(), rr.prompt_lengths.end())),
                static_cast<long long>(*std::max_element(rr.prompt_lengths.begin(), rr.prompt_lengths.end())),
                static_cast<long long>(rr.response), static_cast<long long>(rr.options.base.chunk),
                static_cast<long long>(rr.options.base.window), report_counts(rr).c_str(),
                static_cast<long long>(rr.response), 100.0 * r.options.fraction_of_full, r.options.bootstrap);
  s += b;
  s += "| method / driver | sweep | critical footprint, top-1 (%) | critical footprint, greedy agreement (%) | "
       "footprint range (%) |\n| --- | --- | ---: | ---: | ---: |\n";
  for (const curve_result& c : r.curves) {
    if (c.rows.empty()) continue;
    double lo = 1.0, hi = 0.0;
    for (const std::size_t i : c.rows) {
      lo = std::min(lo, rr.rows[i].footprint);
      hi = std::max(hi, rr.rows[i].footprint);
    }
    std::snprintf(b, sizeof b, "| %s | %s | %s | %s | %.1f – %.1f |\n", detail::curve_label(c.curve).c_str(),
                  c.curve.by_head_sparsity ? "streaming heads s" : c.curve.by_fraction ? "p per chunk" : "budget",
                  detail::critical_text(c.top1, true).c_str(),
                  detail::critical_text(c.agreement, true).c_str(), 100.0 * lo, 100.0 * hi);
    s += b;
  }

  // naive against patched, paired per prompt at each fraction
  bool header = false;
  for (const curve_result& a : r.curves) {
    if (a.curve.driver != driver_kind::chunked_naive || !a.curve.by_fraction) continue;
    for (const curve_result& p : r.curves) {
      if (p.curve.driver != driver_kind::chunked_patched || p.curve.recipe != a.curve.recipe || !p.curve.by_fraction ||
          p.rows.size() != a.rows.size())
        continue;
      if (!header) {
        s += "\n## Patched − naive chunking, paired per prompt at each per-chunk fraction p\n\n"
             "Δ top-1 ± standard error (`*` p < 0.05, two-sided, normal approximation, uncorrected) and Δ footprint.\n\n"
             "| method | p | Δ top-1 | Δ footprint (%) |\n| --- | ---: | ---: | ---: |\n";
        header = true;
      }
      for (std::size_t k = 0; k < a.rows.size(); ++k) {
        const config_result &na = rr.rows[a.rows[k]], &pa = rr.rows[p.rows[k]];
        const paired_difference d = detail::paired(pa, na, [](const prompt_result& x) { return x.top1; });
        std::snprintf(b, sizeof b, "| %s | %.2f | %+.3f ± %.3f%s | %+.1f |\n", method_name(a.curve.recipe), na.cfg.fraction,
                      d.mean, d.sem, two_sided_p(d) < 0.05 ? " *" : "", 100.0 * (pa.footprint - na.footprint));
        s += b;
      }
    }
  }

  s += "\n## The curves' points\n\nfootprint (%) / peak KV (%) / top-1 ± se / KL ± se / greedy agreement\n\n"
       "| method / driver | point | footprint | peak | top-1 | KL | agreement |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  for (const curve_result& c : r.curves)
    for (const std::size_t i : c.rows) {
      const config_result& x = rr.rows[i];
      char pt[32];
      if (x.cfg.head_sparsity >= 0.0) std::snprintf(pt, sizeof pt, "s = %.2f", x.cfg.head_sparsity);
      else if (x.cfg.fraction >= 0.0) std::snprintf(pt, sizeof pt, "p = %.2f", x.cfg.fraction);
      else std::snprintf(pt, sizeof pt, "B = %lld", static_cast<long long>(x.cfg.budget));
      std::snprintf(b, sizeof b, "| %s | %s | %.1f | %.1f | %.3f ± %.3f | %.4f ± %.4f | %.1f |\n",
                    detail::curve_label(c.curve).c_str(), pt, 100.0 * x.footprint, 100.0 * x.peak, x.top1, x.top1_sem,
                    x.kl, x.kl_sem, x.agreement);
      s += b;
    }
  return s;
}

/// Every number of the sweep: the options, the critical footprints, every point's means and
/// standard errors, and every prompt's top-1, KL, agreement and footprint (for the bootstrap).
inline std::string footprint_json(const footprint_result& r, const std::string& model_name, const std::string& command) {
  using detail::json_number;
  using detail::json_string;
  const report_result& rr = r.report;
  std::string s = "{\n  \"command\": ";
  json_string(s, command);
  s += ",\n  \"model\": ";
  json_string(s, model_name);
  s += ",\n  \"prompts\": {\"split\": \"test\", \"seeds\": ";
  detail::json_array(s, rr.seeds, [&](std::uint64_t v) { s += std::to_string(v); });
  s += ", \"lengths\": ";
  detail::json_array(s, rr.prompt_lengths, [&](index_t v) { s += std::to_string(v); });
  s += ", \"response\": " + std::to_string(rr.response) + "},\n  \"options\": {\"F\": ";
  json_number(s, r.options.fraction_of_full);
  s += ", \"bootstrap\": " + std::to_string(r.options.bootstrap) + ", \"chunk\": " + std::to_string(rr.options.base.chunk) +
       ", \"window\": " + std::to_string(rr.options.base.window) + ", \"laq_steps\": " +
       std::to_string(rr.options.base.laq_steps) + ", \"draft_tokens\": " + std::to_string(rr.options.base.draft_tokens) +
       ", \"draft_layers\": " + std::to_string(rr.options.base.draft_layers) + ", \"n_lookahead\": " +
       (rr.options.lookahead != nullptr ? std::to_string(rr.options.lookahead->n_lookahead()) : std::string("null")) +
       ", \"threads\": " + std::to_string(rr.threads) + "},\n  \"seconds\": ";
  json_number(s, rr.seconds);
  s += ",\n  \"curves\": [\n";
  auto crit = [&](const critical_point& c) {
    s += "{\"footprint\": ";
    json_number(s, c.at.footprint);
    s += ", \"kind\": ";
    json_string(s, c.at.kind == kvevict::critical_kind::interpolated      ? "interpolated"
                   : c.at.kind == kvevict::critical_kind::at_or_below_min ? "at_or_below_min"
                                                                          : "above_max");
    s += ", \"bootstrap_se\": ";
    json_number(s, c.se);
    s += "}";
  };
  for (std::size_t k = 0; k < r.curves.size(); ++k) {
    const curve_result& c = r.curves[k];
    s += "    {\"recipe\": ";
    json_string(s, method_name(c.curve.recipe));
    s += ", \"driver\": ";
    json_string(s, driver_name(c.curve.driver));
    s += ", \"sweep\": ";
    json_string(s, detail::sweep_name(c.curve));
    s += ", \"critical\": {\"top1\": ";
    crit(c.top1);
    s += ", \"agreement\": ";
    crit(c.agreement);
    s += "},\n     \"points\": [";
    for (std::size_t j = 0; j < c.rows.size(); ++j) {
      const config_result& x = rr.rows[c.rows[j]];
      s += j > 0 ? ",\n       " : "\n       ";
      s += "{\"budget\": " + std::to_string(x.cfg.budget) + ", \"chunk_fraction\": ";
      json_number(s, x.cfg.fraction);
      if (x.cfg.head_sparsity >= 0.0) {
        s += ", \"head_sparsity\": ";
        json_number(s, x.cfg.head_sparsity);
      }
      const std::pair<const char*, double> f[] = {{"footprint", x.footprint}, {"peak", x.peak},   {"top1", x.top1},
                                                  {"top1_sem", x.top1_sem}, {"kl", x.kl},         {"kl_sem", x.kl_sem},
                                                  {"agreement", x.agreement}, {"agreement_sem", x.agreement_sem}};
      for (const auto& [name, v] : f) {
        s += ", ";
        json_string(s, name);
        s += ": ";
        json_number(s, v);
      }
      s += ",\n        \"per_prompt\": {";
      auto field = [&](const char* name, auto get) {
        json_string(s, name);
        s += ": ";
        detail::json_array(s, x.prompts, [&](const prompt_result& p) { json_number(s, static_cast<double>(get(p))); });
      };
      field("top1", [](const prompt_result& p) { return p.top1; });
      s += ", ";
      field("kl", [](const prompt_result& p) { return p.kl; });
      s += ", ";
      field("agreement", [](const prompt_result& p) { return p.agreement; });
      s += ", ";
      field("footprint", [](const prompt_result& p) { return p.footprint; });
      s += "}}";
    }
    s += "]}";
    s += k + 1 < r.curves.size() ? ",\n" : "\n";
  }
  s += "  ]\n}\n";
  return s;
}

/// Performance (top-1) against KV footprint, one line per curve, F and full marked.
inline std::string footprint_svg(const footprint_result& r, const std::string& model_name) {
  using namespace detail;
  const report_result& rr = r.report;
  const double W = 1100, H = 640;
  const svg_panel p{80, 70, 700, 480, 0.0, 1.0, 0.0, 1.05};
  std::string s;
  char b[600];
  std::snprintf(b, sizeof b,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                "font-family=\"Helvetica, Arial, sans-serif\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                W, H, W, H);
  s += b;
  std::snprintf(b, sizeof b, "Performance vs KV footprint on %s (%zu test prompts, %lld-token responses)", model_name.c_str(),
                rr.prompt_lengths.size(), static_cast<long long>(rr.response));
  svg_text(s, W / 2, 28, "middle", 16, b, " font-weight=\"bold\"");
  for (int k = 0; k <= 10; ++k) {
    const double x = k / 10.0;
    svg_line(s, p.px(x), p.y0, p.px(x), p.y0 + p.h, "#eeeeee", 1);
    std::snprintf(b, sizeof b, "%d", k * 10);
    svg_text(s, p.px(x), p.y0 + p.h + 18, "middle", 12, b);
  }
  for (int k = 0; k <= 5; ++k) {
    const double y = k / 5.0;
    svg_line(s, p.x0, p.py(y), p.x0 + p.w, p.py(y), "#dddddd", 1);
    std::snprintf(b, sizeof b, "%.1f", y);
    svg_text(s, p.x0 - 8, p.py(y) + 4, "end", 12, b);
  }
  std::snprintf(b, sizeof b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333333\"/>\n",
                p.x0, p.y0, p.w, p.h);
  s += b;
  svg_line(s, p.x0, p.py(1.0), p.x0 + p.w, p.py(1.0), "#888888", 1.2, "5,4");
  svg_line(s, p.x0, p.py(r.options.fraction_of_full), p.x0 + p.w, p.py(r.options.fraction_of_full), "#d62728", 1.2, "5,4");
  std::snprintf(b, sizeof b, "%.0f%% of full", 100.0 * r.options.fraction_of_full);
  svg_text(s, p.x0 + 6, p.py(r.options.fraction_of_full) - 5, "start", 11, b, " fill=\"#d62728\"");
  svg_text(s, p.x0 + p.w / 2, p.y0 + p.h + 40, "middle", 13, "KV footprint (%, prompt and response; 100 = full cache)");
  std::snprintf(b, sizeof b, " transform=\"rotate(-90 %.1f %.1f)\"", p.x0 - 50, p.y0 + p.h / 2);
  svg_text(s, p.x0 - 50, p.y0 + p.h / 2, "middle", 13, "teacher-forced top-1 agreement with the full cache", b);
  double ly = 70;
  svg_text(s, 810, ly - 14, "start", 13, "method / driver", " font-weight=\"bold\"");
  for (const curve_result& c : r.curves) {
    if (c.rows.empty()) continue;
    std::vector<std::pair<double, double>> pts;
    for (const std::size_t i : c.rows) pts.push_back({rr.rows[i].footprint, rr.rows[i].top1});
    std::sort(pts.begin(), pts.end());
    std::string line;
    for (const auto& [x, y] : pts) {
      std::snprintf(b, sizeof b, "%.1f,%.1f ", p.px(x), p.py(std::min(y, p.ymax)));
      line += b;
    }
    const char* dash = driver_dash(c.curve.driver);
    std::snprintf(b, sizeof b, "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\"%s%s%s/>\n",
                  line.c_str(), method_colour(c.curve.recipe), dash ? " stroke-dasharray=\"" : "", dash ? dash : "",
                  dash ? "\"" : "");
    s += b;
    for (const auto& [x, y] : pts) {
      std::snprintf(b, sizeof b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n", p.px(x), p.py(std::min(y, p.ymax)),
                    method_colour(c.curve.recipe));
      s += b;
    }
    svg_line(s, 810, ly, 842, ly, method_colour(c.curve.recipe), 2, dash);
    svg_text(s, 848, ly + 4, "start", 12, curve_label(c.curve) + "  (" + critical_text(c.top1, false) + ")");
    ly += 17;
  }
  svg_text(s, 810, ly + 10, "start", 11, "in brackets: critical footprint (%) at F");
  s += "</svg>\n";
  return s;
}

}  // namespace kvrun
