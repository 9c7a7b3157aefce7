// report/svg.hpp: the report's plot, written by hand as SVG: quality vs budget per recipe, two
// panels (mean KL(full || evicted), log scale; mean recall of the ground truth's top-k), the budget
// axis log-scaled, one line per (recipe, driver): colour = recipe, dash pattern = driver.
#pragma once

#include <report/report.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace kvrun {

namespace detail {

struct svg_panel {
  double x0, y0, w, h;                  // plot area in pixels
  double xmin, xmax, ymin, ymax;        // data range (x: log2 budget; y: log10 KL or recall)
  double px(double x) const { return x0 + (x - xmin) / (xmax - xmin) * w; }
  double py(double y) const { return y0 + h - (y - ymin) / (ymax - ymin) * h; }
};

inline void svg_text(std::string& s, double x, double y, const char* anchor, int size, const std::string& text,
                     const char* extra = "") {
  char b[256];
  std::snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" font-size=\"%d\"%s>", x, y, anchor, size, extra);
  s += b;
  for (const char ch : text) {
    if (ch == '<') s += "&lt;";
    else if (ch == '>') s += "&gt;";
    else if (ch == '&') s += "&amp;";
    else s += ch;
  }
  s += "</text>\n";
}

inline void svg_line(std::string& s, double x1, double y1, double x2, double y2, const char* stroke, double width,
                     const char* dash = nullptr) {
  char b[256];
  std::snprintf(b, sizeof b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"%.1f\"%s%s%s/>\n",
                x1, y1, x2, y2, stroke, width, dash ? " stroke-dasharray=\"" : "", dash ? dash : "", dash ? "\"" : "");
  s += b;
}

inline const char* method_colour(method m) {
  switch (m) {
    case method::full: return "#000000";
    case method::streaming_llm: return "#7f7f7f";
    case method::h2o: return "#8c564b";
    case method::tova: return "#bcbd22";
    case method::snapkv: return "#1f77b4";
    case method::pyramidkv: return "#17becf";
    case method::knorm: return "#8c6d31";
    case method::vatp: return "#9467bd";
    case method::adakv: return "#2ca02c";
    case method::cake: return "#ff7f0e";
    case method::lava: return "#d62728";
    case method::duo_heuristic: return "#e377c2";
    case method::duo: return "#c51b8a";
    case method::prulong: return "#7a0177";
    case method::laq: return "#393b79";
    case method::laq_pp: return "#637939";
    case method::speckv: return "#e6550d";
    case method::lookaheadkv: return "#ff1493";
    case method::oracle: return "#000000";
  }
  return "#000000";
}

inline const char* driver_dash(driver_kind d) {
  switch (d) {
    case driver_kind::postfill: return nullptr;
    case driver_kind::layerwise: return "7,3";
    case driver_kind::chunked_naive: return "2,3";
    case driver_kind::chunked_patched: return "7,3,2,3";
    case driver_kind::decode: return "12,4";
  }
  return nullptr;
}

struct svg_series {
  method m;
  driver_kind d;
  std::vector<double> budget, kl, recall;
};

}  // namespace detail

/// The plot as a standalone SVG document.
inline std::string report_svg(const report_result& r, const std::string& model_name) {
  using namespace detail;
  std::vector<svg_series> series;
  double bmin = INFINITY, bmax = -INFINITY, klmin = INFINITY, klmax = -INFINITY;
  for (const config_result& c : r.rows) {
    if (c.cfg.budget <= 0) continue;
    svg_series* sp = nullptr;
    for (svg_series& x : series)
      if (x.m == c.cfg.recipe && x.d == c.cfg.driver) sp = &x;
    if (sp == nullptr) {
      series.push_back({c.cfg.recipe, c.cfg.driver, {}, {}, {}});
      sp = &series.back();
    }
    const double b = static_cast<double>(c.cfg.budget);
    sp->budget.push_back(b);
    sp->kl.push_back(c.kl);
    sp->recall.push_back(c.recall);
    bmin = std::min(bmin, b);
    bmax = std::max(bmax, b);
    if (c.kl > 0.0) {
      klmin = std::min(klmin, c.kl);
      klmax = std::max(klmax, c.kl);
    }
  }
  if (!(klmin <= klmax)) klmin = 1e-3, klmax = 1.0;
  const double lo = std::floor(std::log10(klmin)), hi = std::max(lo + 1.0, std::ceil(std::log10(klmax)));
  const double xl = std::log2(bmin) - 0.3, xh = std::log2(bmax) + 0.3 + (bmin == bmax ? 0.4 : 0.0);
  const double W = 1250, H = 580;
  const svg_panel kl{80, 70, 400, 400, xl, xh, lo, hi};
  const svg_panel rc{560, 70, 400, 400, xl, xh, 0.0, 1.0};

  std::string s;
  char b[512];
  std::snprintf(b, sizeof b,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                "font-family=\"Helvetica, Arial, sans-serif\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                W, H, W, H);
  s += b;
  std::snprintf(b, sizeof b, "KV-cache eviction on %s: %zu test prompts of %lld-%lld tokens, %lld-token greedy responses",
                model_name.c_str(), r.prompt_lengths.size(),
                static_cast<long long>(*std::min_element(r.prompt_lengths.begin(), r.prompt_lengths.end())),
                static_cast<long long>(*std::max_element(r.prompt_lengths.begin(), r.prompt_lengths.end())),
                static_cast<long long>(r.response));
  svg_text(s, W / 2, 28, "middle", 16, b, " font-weight=\"bold\"");

  auto axes = [&](const svg_panel& p, const char* title, const char* ylabel, bool logy) {
    svg_text(s, p.x0 + p.w / 2, p.y0 - 14, "middle", 14, title);
    // grid and y ticks
    if (logy) {
      for (double e = p.ymin; e <= p.ymax + 1e-9; e += 1.0) {
        svg_line(s, p.x0, p.py(e), p.x0 + p.w, p.py(e), "#dddddd", 1);
        std::snprintf(b, sizeof b, "%g", std::pow(10.0, e));
        svg_text(s, p.x0 - 8, p.py(e) + 4, "end", 12, b);
        if (e + 1.0 <= p.ymax + 1e-9)
          for (int k = 2; k <= 9; ++k) {
            const double y = e + std::log10(static_cast<double>(k));
            svg_line(s, p.x0, p.py(y), p.x0 + p.w, p.py(y), "#f1f1f1", 1);
          }
      }
    } else {
      for (int k = 0; k <= 5; ++k) {
        const double y = p.ymin + (p.ymax - p.ymin) * k / 5.0;
        svg_line(s, p.x0, p.py(y), p.x0 + p.w, p.py(y), "#dddddd", 1);
        std::snprintf(b, sizeof b, "%.1f", y);
        svg_text(s, p.x0 - 8, p.py(y) + 4, "end", 12, b);
      }
    }
    for (const index_t bud : r.options.budgets) {
      const double x = p.px(std::log2(static_cast<double>(bud)));
      svg_line(s, x, p.y0, x, p.y0 + p.h, "#eeeeee", 1);
      svg_line(s, x, p.y0 + p.h, x, p.y0 + p.h + 5, "#333333", 1);
      svg_text(s, x, p.y0 + p.h + 20, "middle", 12, std::to_string(bud));
    }
    std::snprintf(b, sizeof b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333333\"/>\n",
                  p.x0, p.y0, p.w, p.h);
    s += b;
    svg_text(s, p.x0 + p.w / 2, p.y0 + p.h + 42, "middle", 13, "budget: tokens kept per KV head (log scale)");
    std::snprintf(b, sizeof b, " transform=\"rotate(-90 %.1f %.1f)\"", p.x0 - 52, p.y0 + p.h / 2);
    svg_text(s, p.x0 - 52, p.y0 + p.h / 2, "middle", 13, ylabel, b);
  };
  axes(kl, "next-token KL(full || evicted), teacher-forced", "mean KL (nats, log scale)", true);
  axes(rc, "recall of the response's most-attended prompt tokens", "mean recall@budget", false);
  svg_line(s, rc.x0, rc.py(1.0), rc.x0 + rc.w, rc.py(1.0), "#000000", 1, "3,3");
  svg_text(s, rc.x0 + rc.w - 4, rc.py(1.0) + 14, "end", 11, "full cache = 1");

  auto polyline = [&](const svg_panel& p, const svg_series& x, const std::vector<double>& ys, bool logy) {
    std::string pts;
    std::string dots;
    for (std::size_t i = 0; i < ys.size(); ++i) {
      double y = ys[i];
      if (logy) y = y > 0.0 ? std::log10(y) : p.ymin;  // KL 0 (nothing evicted) sits on the axis
      y = std::min(std::max(y, p.ymin), p.ymax);
      const double px = p.px(std::log2(x.budget[i])), py = p.py(y);
      std::snprintf(b, sizeof b, "%.1f,%.1f ", px, py);
      pts += b;
      std::snprintf(b, sizeof b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.8\" fill=\"%s\"/>\n", px, py, method_colour(x.m));
      dots += b;
    }
    const char* dash = driver_dash(x.d);
    std::snprintf(b, sizeof b, "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"%.1f\"%s%s%s/>\n",
                  pts.c_str(), method_colour(x.m), x.m == method::oracle || x.m == method::lookaheadkv ? 2.4 : 1.8, dash ? " stroke-dasharray=\"" : "",
                  dash ? dash : "", dash ? "\"" : "");
    s += b;
    s += dots;
  };
  for (const svg_series& x : series) {
    polyline(kl, x, x.kl, true);
    polyline(rc, x, x.recall, false);
  }

  // legend
  double ly = 70;
  svg_text(s, 1000, ly - 14, "start", 13, "recipe / driver", " font-weight=\"bold\"");
  for (const svg_series& x : series) {
    const char* dash = driver_dash(x.d);
    svg_line(s, 1000, ly, 1032, ly, method_colour(x.m), 2, dash);
    std::string label = method_name(x.m);
    if (x.d != driver_kind::postfill) label += std::string(" / ") + driver_name(x.d);
    svg_text(s, 1038, ly + 4, "start", 12, label);
    ly += 17;
  }
  svg_text(s, 1000, ly + 10, "start", 11, "solid: post-fill eviction");
  s += "</svg>\n";
  return s;
}

}  // namespace kvrun
