// kvevict-headgates: train PruLong and DuoAttention head masks for a runner model (docs/prulong.md).
//
//   kvevict-headgates prulong --out-dir models/prulong     one mask per sparsity (25, 50, 75 %)
//   kvevict-headgates duo --out models/duo/stories260K.tsv  DuoAttention's alpha per KV head
//
// Masks are head-mask TSV files (<kvevict/train/prulong.hpp>): one line per layer, one value per KV
// head, 1 = retrieval head (full KV cache), 0 = streaming head (sinks + recent window); Duo's file
// holds the trained alpha in [0, 1] (DuoAttention's full_attention_heads.tsv). Progress goes to
// stderr; every error is one line on stderr and exit status 1 (2 for command-line syntax errors).
#include <headgates/gated.hpp>
#include <headgates/train.hpp>
#include <runner/model.hpp>

#include "cli.hpp"
#include "io.hpp"
#include "main.hpp"
#include "shipped_models.hpp"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <algorithm>
#include <map>
#include <string>
#include <vector>

namespace {

using kvevict::index_t;
using kvevict::status;

int fail(const std::string& message) { return kvevict::program::fail("kvevict-headgates", message); }
int fail(const status& st) { return fail(st.message()); }

struct common_options {
  std::string model = kvevict::program::shipped_model("stories260K.bin");
  int threads = 0;
  index_t texts = 64;
  std::string prompts;   ///< given prompts instead of model-generated texts
  index_t response = 8;  ///< with prompts: greedy response tokens (the distillation's labelled rows)
  kvrun::gate_train_options train;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void print_gates(const char* what, const std::vector<double>& v, index_t L, index_t H) {
  std::fprintf(stderr, "%s (layer x KV head):\n", what);
  for (index_t l = 0; l < L; ++l) {
    std::fprintf(stderr, "  layer %lld:", static_cast<long long>(l));
    for (index_t h = 0; h < H; ++h) std::fprintf(stderr, " %8.3f", v[static_cast<std::size_t>(l * H + h)]);
    std::fprintf(stderr, "\n");
  }
}

status load(const common_options& c, kvrun::model& m, kvrun::gated_lm<float>& lm, std::vector<kvrun::gate_sample>& samples) {
  KVEVICT_TRY(kvrun::model::load_file(c.model, m));
  lm.from(m);
  const auto t0 = std::chrono::steady_clock::now();
  if (!c.prompts.empty()) {
    std::vector<std::vector<int>> prompts;
    KVEVICT_TRY(kvevict::io::read_token_lines(c.prompts, "--prompts", prompts));
    if (auto st = kvrun::check_prompts(m.cfg(), prompts, c.response); !st.ok())
      return status::error(st.code(), "%s: %s", c.prompts.c_str(), st.message());
    KVEVICT_TRY(kvrun::gate_samples_from_prompts(m, prompts, c.response, c.threads, samples));
  } else {
    KVEVICT_TRY(kvrun::make_gate_samples(m, c.texts, c.threads, samples));
  }
  std::size_t tokens = 0;
  for (const auto& s : samples) tokens += s.tokens.size();
  if (!c.prompts.empty())
    std::fprintf(stderr, "%zu training texts (%s with %lld greedy tokens each, %zu tokens) made in %.1f s\n", samples.size(),
                 c.prompts.c_str(), static_cast<long long>(c.response), tokens, seconds_since(t0));
  else
    std::fprintf(stderr, "%lld training texts (seeds %llu..%llu, %zu tokens) generated in %.1f s\n",
                 static_cast<long long>(c.texts), static_cast<unsigned long long>(kvrun::train_seed_base),
                 static_cast<unsigned long long>(kvrun::train_seed_base + static_cast<std::uint64_t>(c.texts) - 1), tokens,
                 seconds_since(t0));
  return {};
}

void log_line(const char* what, const kvrun::gate_progress& p, bool prulong) {
  if (prulong)
    std::fprintf(stderr,
                 "%s step %4lld/%lld  loss %.5f  sparsity: constrained %.3f expected %.3f closed %.3f gate<0.5 %.3f  target %.3f  "
                 "lambda %.3f %.3f  (%.0f s)\n",
                 what, static_cast<long long>(p.step), static_cast<long long>(p.steps), p.loss, p.constrained, p.sparsity,
                 p.achieved, p.below_half,
                 p.target, p.lambda1, p.lambda2, p.seconds);
  else
    std::fprintf(stderr, "%s step %4lld/%lld  loss %.3e  alpha < 0.5: %.3f  mean alpha %.3f  (%.0f s)\n", what,
                 static_cast<long long>(p.step), static_cast<long long>(p.steps), p.loss, p.sparsity, p.target, p.seconds);
}

// The PruLong runs' sparsity (expected, achieved, target) and loss against the step, as SVG: one
// colour per target, two panels.
std::string history_svg(const std::vector<double>& targets, const std::vector<std::vector<kvrun::prulong_step>>& runs) {
  const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  const double W = 900, x0 = 70, w = 620, h = 230, top[2] = {50, 340};
  std::size_t steps = 1;
  double lo = 1e300, hi = -1e300;
  for (const auto& r : runs) {
    steps = std::max(steps, r.size());
    for (const auto& st : r) lo = std::min(lo, st.loss), hi = std::max(hi, st.loss);
  }
  if (!(hi > lo)) hi = lo + 1;
  std::string s;
  char b[512];
  std::snprintf(b, sizeof b,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"640\" font-family=\"Helvetica, Arial, sans-serif\">\n"
                "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                W);
  s += b;
  auto px = [&](double step) { return x0 + step / static_cast<double>(steps) * w; };
  auto text = [&](double x, double y, const char* anchor, const std::string& t, const char* extra = "") {
    std::snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" font-size=\"12\"%s>", x, y, anchor, extra);
    s += b;
    for (const char ch : t) s += ch == '<' ? std::string("&lt;") : ch == '>' ? std::string("&gt;") : ch == '&' ? std::string("&amp;") : std::string(1, ch);
    s += "</text>\n";
  };
  const char* titles[2] = {"sparsity: expected (solid), closed heads P(z>0) < 1/2 (dashed), gate < 0.5 (dash-dot), target (dotted)",
                           "next-token loss of the step's batch (mean of 5 steps)"};
  for (int panel = 0; panel < 2; ++panel) {
    const double y0 = top[panel];
    std::snprintf(b, sizeof b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333\"/>\n", x0,
                  y0, w, h);
    s += b;
    text(x0, y0 - 10, "start", titles[panel], " font-weight=\"bold\"");
    for (int k = 0; k <= 4; ++k) {
      const double v = panel == 0 ? k / 4.0 : lo + (hi - lo) * k / 4.0;
      std::snprintf(b, sizeof b, panel == 0 ? "%.2f" : "%.3f", v);
      text(x0 - 6, y0 + h - h * k / 4.0 + 4, "end", b);
    }
    for (int k = 0; k <= 5; ++k) text(px(static_cast<double>(steps) * k / 5.0), y0 + h + 16, "middle", std::to_string(steps * k / 5));
  }
  text(x0 + w / 2, 625, "middle", "step");
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const char* col = colours[r % 6];
    auto line = [&](int panel, const char* dash, auto get) {
      std::string pts;
      for (std::size_t i = 0; i < runs[r].size(); ++i) {
        const double v = get(i), y0 = top[panel];
        const double y = panel == 0 ? y0 + h - h * v : y0 + h - h * (v - lo) / (hi - lo);
        std::snprintf(b, sizeof b, "%.1f,%.1f ", px(static_cast<double>(i + 1)), y);
        pts += b;
      }
      std::snprintf(b, sizeof b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\"%s points=\"", col, dash);
      s += b + pts + "\"/>\n";
    };
    const auto& hist = runs[r];
    line(0, "", [&](std::size_t i) { return hist[i].expected; });
    line(0, " stroke-dasharray=\"6,3\"", [&](std::size_t i) { return hist[i].achieved; });
    line(0, " stroke-dasharray=\"1,3\"", [&](std::size_t i) { return hist[i].target; });
    line(0, " stroke-dasharray=\"8,3,2,3\" stroke-opacity=\"0.5\"", [&](std::size_t i) { return hist[i].below_half; });
    line(1, "", [&](std::size_t i) {
      double m = 0;
      std::size_t n = 0;
      for (std::size_t j = i >= 4 ? i - 4 : 0; j <= i; ++j) m += hist[j].loss, ++n;
      return m / static_cast<double>(n);
    });
    std::snprintf(b, sizeof b, "t %.2f: expected %.3f, closed %.3f, gate<0.5 %.3f", targets[r],
                  hist.empty() ? 0.0 : hist.back().expected, hist.empty() ? 0.0 : hist.back().achieved, hist.empty() ? 0.0 : hist.back().below_half);
    text(710, 70 + 18.0 * static_cast<double>(r), "start", b, (std::string(" fill=\"") + col + "\"").c_str());
  }
  s += "</svg>\n";
  return s;
}

int cmd_prulong(common_options& c, const std::vector<double>& sparsities, const std::string& out_dir,
                kvrun::prulong_train_options p, const std::string& plot) {
  kvrun::model m;
  kvrun::gated_lm<float> lm;
  std::vector<kvrun::gate_sample> samples;
  if (auto st = load(c, m, lm, samples); !st.ok()) return fail(st);
  const index_t L = m.cfg().n_layers, H = m.cfg().n_kv_heads;
  const std::string stem = std::filesystem::path(c.model).stem().string();
  std::vector<std::vector<kvrun::prulong_step>> histories;
  for (double s : sparsities) {
    p.target = s;
    const auto t0 = std::chrono::steady_clock::now();
    kvrun::prulong_result r;
    char tag[32];
    std::snprintf(tag, sizeof tag, "prulong t=%.2f", s);
    if (auto st = kvrun::train_prulong(lm, samples, c.train, p, r, [&](const kvrun::gate_progress& pr) { log_line(tag, pr, true); });
        !st.ok())
      return fail(st);
    print_gates("log_alpha", r.log_alpha, L, H);
    char name[64];
    std::snprintf(name, sizeof name, "%s-s%02d.tsv", stem.c_str(), static_cast<int>(std::lround(s * 100)));
    const std::string path = (std::filesystem::path(out_dir) / name).string();
    if (auto st = kvevict::write_head_mask_tsv(path.c_str(), kvrun::lkv::mat<const float>(r.mask.data(), L, H, H)); !st.ok())
      return fail(st);
    index_t k = 0;
    for (float v : r.mask) k += v > 0.5f ? 1 : 0;
    std::printf("wrote %s: %lld of %lld heads retrieval (target sparsity %.2f; at the end: expected sparsity %.3f, "
                "closed heads (P(z > 0) < 1/2) %.3f, deterministic gate < 0.5 %.3f), %lld steps x batch %lld in %.1f s\n",
                path.c_str(), static_cast<long long>(k), static_cast<long long>(L * H), s, r.sparsity, r.achieved, r.below_half,
                static_cast<long long>(c.train.steps), static_cast<long long>(c.train.batch), seconds_since(t0));
    std::fflush(stdout);
    histories.push_back(r.history);
  }
  if (!plot.empty()) {
    std::FILE* f = std::fopen(plot.c_str(), "wb");
    const std::string svg = history_svg(sparsities, histories);
    if (f == nullptr || std::fwrite(svg.data(), 1, svg.size(), f) != svg.size() || std::fclose(f) != 0)
      return fail("--plot: cannot write '" + plot + "'");
    std::printf("wrote %s\n", plot.c_str());
  }
  return 0;
}

int cmd_duo(common_options& c, const std::string& out, const kvrun::duo_train_options& p) {
  kvrun::model m;
  kvrun::gated_lm<float> lm;
  std::vector<kvrun::gate_sample> samples;
  if (auto st = load(c, m, lm, samples); !st.ok()) return fail(st);
  const index_t L = m.cfg().n_layers, H = m.cfg().n_kv_heads;
  const auto t0 = std::chrono::steady_clock::now();
  if (auto st = kvrun::duo_targets(lm, samples, c.threads); !st.ok()) return fail(st);
  kvrun::duo_result r;
  if (auto st = kvrun::train_duo(lm, samples, c.train, p, r, [&](const kvrun::gate_progress& pr) { log_line("duo", pr, false); });
      !st.ok())
    return fail(st);
  print_gates("alpha", r.alpha, L, H);
  if (auto st = kvevict::write_head_mask_tsv(out.c_str(), kvrun::lkv::mat<const double>(r.alpha.data(), L, H, H)); !st.ok())
    return fail(st);
  index_t k = 0;
  for (double a : r.alpha) k += a >= 0.5 ? 1 : 0;
  std::printf("wrote %s: alpha per KV head; %lld of %lld heads are retrieval heads at threshold 0.5; %lld steps x batch "
              "%lld in %.1f s\n",
              out.c_str(), static_cast<long long>(k), static_cast<long long>(L * H), static_cast<long long>(c.train.steps),
              static_cast<long long>(c.train.batch), seconds_since(t0));
  return 0;
}

int run(int argc, char** argv) {
  CLI::App app{"kvevict-headgates: train PruLong and DuoAttention head masks for a llama2.c model", "kvevict-headgates"};
  app.require_subcommand(1);
  common_options c;
  using kvevict::program::integer;
  app.add_option("--model", c.model, "llama2.c checkpoint")->capture_default_str();
  app.add_option("--threads", c.threads, "OpenMP threads (0 = OMP_NUM_THREADS or all cores)")->check(integer<int>())->capture_default_str();
  auto* texts = app.add_option("--texts", c.texts, "training texts (model-generated, training seeds 1..N)")
                    ->check(integer<index_t>())->capture_default_str();
  app.add_option("--prompts", c.prompts,
                 "training prompts instead of model-generated texts: token ids (BOS first), one prompt a line; each text is "
                 "the prompt and its greedy --response")
      ->excludes(texts);
  app.add_option("--response", c.response, "with --prompts: greedy tokens after each prompt (the distillation's rows)")
      ->check(integer<index_t>())->capture_default_str();
  app.add_option("--steps", c.train.steps, "optimizer steps")->check(integer<index_t>())->capture_default_str();
  app.add_option("--batch", c.train.batch, "texts per step")->check(integer<index_t>())->capture_default_str();
  app.add_option("--seed", c.train.seed, "seed of the sample order, the initialisation and the gate samples")
      ->check(integer<std::uint64_t>())->capture_default_str();
  app.add_option("--sink", c.train.window.sink, "streaming heads: first tokens kept")->check(integer<index_t>())->capture_default_str();
  app.add_option("--recent", c.train.window.recent, "streaming heads: recent tokens kept (the current one included)")
      ->check(integer<index_t>())->capture_default_str();
  app.add_option("--log-every", c.train.log_every, "progress every N steps")->check(integer<index_t>())->capture_default_str();

  std::vector<double> sparsities{0.25, 0.5, 0.75};
  std::string out_dir;
  kvrun::prulong_train_options pp;
  auto* prulong = app.add_subcommand("prulong", "PruLong: hard-concrete gates, next-token loss, Lagrangian sparsity; one mask per sparsity");
  prulong->add_option("--sparsities", sparsities, "target sparsities (fraction of streaming heads)")->delimiter(',')->capture_default_str();
  prulong->add_option("--out-dir", out_dir, "directory of the masks <model>-s<percent>.tsv")->required();
  std::string plot;
  prulong->add_option("--plot", plot, "SVG of the sparsity (expected, achieved, target) and the loss against the step");
  prulong->add_option("--lr", pp.lr, "Adam learning rate of log_alpha")->capture_default_str();
  prulong->add_option("--lr-lambda", pp.lr_lambda, "rate of the multipliers' ascent (per unit of violation; with --lambda-rule adam: Adam's rate)")
      ->capture_default_str();
  prulong->add_option("--lr-lambda2", pp.lr_lambda2, "rate of lambda2's ascent (per unit of squared violation; ascent only)")
      ->capture_default_str();
  prulong->add_option("--constrain", pp.constrain, "the constrained sparsity: sampled (1 - mean z of the step's gates) or expected-l0")
      ->transform(CLI::CheckedTransformer(std::map<std::string, kvrun::sparsity_measure>{
          {"sampled", kvrun::sparsity_measure::sampled}, {"expected-l0", kvrun::sparsity_measure::expected_l0}}))
      ->capture_default_str();
  prulong->add_option("--lambda-rule", pp.lambda_rule, "multipliers: ascent (plain gradient ascent, constant rate) or adam")
      ->transform(CLI::CheckedTransformer(std::map<std::string, kvrun::lambda_update>{{"ascent", kvrun::lambda_update::ascent},
                                                                                     {"adam", kvrun::lambda_update::adam}}))
      ->capture_default_str();
  prulong->add_option("--final-lr", pp.final_lr, "the log_alpha rate decays linearly to this fraction of its peak")->capture_default_str();
  prulong->add_option("--target-warmup", pp.target_warmup, "fraction of the steps over which the target rises from 0")->capture_default_str();

  std::string duo_out;
  kvrun::duo_train_options dp;
  auto* duo = app.add_subcommand("duo", "DuoAttention: alpha gates, distillation of the final hidden states, L1 penalty");
  duo->add_option("--out", duo_out, "alpha TSV file to write")->required();
  duo->add_option("--lr", dp.lr, "Adam learning rate of alpha")->capture_default_str();
  duo->add_option("--reg", dp.reg, "weight of the L1 penalty (mean alpha)")->capture_default_str();

  if (const int code = kvevict::program::parse_or_exit(app, argc, argv, "kvevict-headgates"); code >= 0) return code;
  if (c.threads < 0) return fail("--threads must be >= 0, got " + std::to_string(c.threads));
  if (c.texts < 1) return fail("--texts must be >= 1, got " + std::to_string(c.texts));
  if (c.response < 1) return fail("--response must be >= 1, got " + std::to_string(c.response));
  if (c.train.steps < 1) return fail("--steps must be >= 1, got " + std::to_string(c.train.steps));
  if (c.train.batch < 1) return fail("--batch must be >= 1, got " + std::to_string(c.train.batch));
  if (c.train.log_every < 1) return fail("--log-every must be >= 1, got " + std::to_string(c.train.log_every));
  if (c.train.window.sink < 0 || c.train.window.recent < 1)
    return fail("--sink must be >= 0 and --recent >= 1, got " + std::to_string(c.train.window.sink) + " and " +
                std::to_string(c.train.window.recent));
  c.train.threads = c.threads;
  std::vector<kvevict::io::named_path> inputs{{"--model", c.model}};
  if (!c.prompts.empty()) inputs.push_back({"--prompts", c.prompts});
  if (*prulong) {
    for (double s : sparsities)
      if (!(s >= 0 && s <= 1)) return fail("--sparsities: " + std::to_string(s) + " is outside [0, 1]");
    if (sparsities.empty()) return fail("--sparsities: give at least one sparsity");
    std::error_code ec;
    if (!std::filesystem::is_directory(out_dir, ec)) return fail("--out-dir: '" + out_dir + "' is not a directory");
    if (auto st = kvevict::io::check_paths(inputs, {}); !st.ok()) return fail(st);
    return cmd_prulong(c, sparsities, out_dir, pp, plot);
  }
  if (auto st = kvevict::io::check_paths(inputs, {{"--out", duo_out}}); !st.ok()) return fail(st);
  return cmd_duo(c, duo_out, dp);
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::program::guarded_main("kvevict-headgates", [&] { return run(argc, argv); });
}
