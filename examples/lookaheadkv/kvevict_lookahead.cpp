// kvevict-lookahead: train LookaheadKV modules for a runner model and evaluate them (docs/lookaheadkv.md).
//
//   kvevict-lookahead train --out models/lookahead/stories260K-n16.bin      the shipped module
//   kvevict-lookahead eval --module models/lookahead/stories260K-n16.bin --json report.json
//   kvevict-lookahead eval --module ... --ablation                           + Table 5 analogue
//   kvevict-lookahead info --module models/lookahead/stories260K-n16.bin
//
// Every error is one line on stderr and exit status 1 (2 for command-line syntax errors).
#include <runner/kv_cache.hpp>
#include <lookaheadkv/data.hpp>
#include <lookaheadkv/eval.hpp>
#include <lookaheadkv/module.hpp>
#include <lookaheadkv/scores.hpp>
#include <lookaheadkv/train.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>

#include "cli.hpp"
#include "io.hpp"
#include "main.hpp"
#include "shipped_models.hpp"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>


namespace {

using kvevict::index_t;
using kvevict::status;

int fail(const std::string& message) { return kvevict::program::fail("kvevict-lookahead", message); }
int fail(const status& st) { return fail(st.message()); }
// A file's format errors name the file (open errors already do).
int fail_file(const std::string& path, const status& st) {
  if (st.code() == kvevict::errc::io_error) return fail(st);
  return fail(path + ": " + st.message());
}

struct clock_since {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

void progress_line(const char* what, index_t done, index_t total, const clock_since& t) {
  const index_t step = std::max<index_t>(1, total / 20);
  if (done != total && done % step != 0) return;
  std::fprintf(stderr, "\r%s %lld/%lld (%.0f s)%s", what, static_cast<long long>(done), static_cast<long long>(total),
               t.seconds(), done == total ? "\n" : "");
  std::fflush(stderr);
}

// ---- options -------------------------------------------------------------------------------

struct common_options {
  std::string model = kvevict::program::shipped_model("stories260K.bin");
  int threads = 0;
  index_t response = 64;
};

struct train_cli {
  std::string out;
  kvrun::lookahead_config cfg;
  std::string placement = "all";
  index_t train_pairs = 1536, val_pairs = 32;
  /// Given prompts instead of model-generated pairs (both or neither): token ids, one prompt a line
  /// (e.g. the testbed's, `testbed.py lookahead`); each pair's response is the model's greedy one.
  std::string prompts, val_prompts;
  kvrun::train_options opt;
};

struct eval_cli {
  std::string module = kvevict::program::shipped_model("lookahead/stories260K-n16.bin");
  std::string json;
  index_t test_pairs = 128;
  std::vector<index_t> budgets{16, 32, 64, 128};
  index_t window = 32;
  index_t timing_pairs = 8, timing_reps = 15;
  int timing_threads = 1;
  bool ablation = false;
  std::vector<index_t> ablation_n{4, 8, 16, 32};
  std::vector<std::string> ablation_placements{"emb", "qv", "all"};
  index_t ablation_steps = 300, ablation_train_pairs = 1536;
  kvrun::train_options ablation_opt;
};

void add_train_options(CLI::App* app, train_cli& t) {
  app->add_option("--n-lookahead", t.cfg.n_lookahead, "lookahead tokens")->check(kvevict::program::integer<index_t>())->capture_default_str();
  app->add_option("--rank", t.cfg.rank, "LoRA rank r")->check(kvevict::program::integer<index_t>())->capture_default_str();
  app->add_option("--alpha", t.cfg.alpha, "LoRA alpha (scale alpha / r)")->capture_default_str();
  app->add_option("--placement", t.placement, "LoRA targets: all, qv, emb (embeddings only) or a '+' list of q,k,v,o,w1,w2,w3")
      ->capture_default_str();
  app->add_option("--train-pairs", t.train_pairs, "training pairs (seeds 1..N)")->check(kvevict::program::integer<index_t>())->capture_default_str();
  app->add_option("--val-pairs", t.val_pairs, "validation pairs for the periodic held-out loss")->check(kvevict::program::integer<index_t>())->capture_default_str();
  app->add_option("--steps", t.opt.steps, "Adam steps")->check(kvevict::program::integer<index_t>())->capture_default_str();
  app->add_option("--batch", t.opt.batch, "samples per step")->check(kvevict::program::integer<index_t>())->capture_default_str();
  app->add_option("--lr", t.opt.lr, "peak learning rate (cosine schedule to 0)")->capture_default_str();
  app->add_option("--warmup", t.opt.warmup, "fraction of steps with linear warmup")->capture_default_str();
  app->add_option("--beta1", t.opt.beta1, "Adam beta1")->capture_default_str();
  app->add_option("--beta2", t.opt.beta2, "Adam beta2")->capture_default_str();
  app->add_option("--clip", t.opt.clip, "global gradient-norm clipping (0: off)")->capture_default_str();
  app->add_option("--seed", t.opt.seed, "seed of the initialisation and the sample order")->check(kvevict::program::integer<std::uint64_t>())->capture_default_str();
  app->add_option("--log-every", t.opt.log_every, "print the running loss every N steps")->check(kvevict::program::integer<index_t>())->capture_default_str();
  app->add_option("--validate-every", t.opt.validate_every, "validation loss every N steps (0: at the end)")
      ->check(kvevict::program::integer<index_t>())->capture_default_str();
  app->add_option("--prompts", t.prompts,
                  "training prompts instead of model-generated pairs: token ids (BOS first), one prompt a line; "
                  "responses greedy (--response tokens); with --val-prompts");
  app->add_option("--val-prompts", t.val_prompts, "validation prompts (the file format of --prompts)");
}

// ---- shared steps ----------------------------------------------------------------------------

status make_split(const kvrun::model& m, const common_options& c, std::uint64_t base, index_t n, const char* what,
                  std::vector<kvrun::text_pair>& out) {
  clock_since t;
  kvrun::pair_options po;
  po.response = c.response;
  const std::string label = std::string("generating ") + what + " pairs";
  return kvrun::make_pairs(m, po, base, base + static_cast<std::uint64_t>(n), out, c.threads,
                           [&](index_t d, index_t total) { progress_line(label.c_str(), d, total, t); });
}

// Pairs of a split and their prepared samples (prompt KV + ground truth), in one pass.
status make_samples(const kvrun::model& m, const common_options& c, std::uint64_t base, index_t n, const char* what,
                    std::vector<kvrun::lookahead_sample>& out) {
  clock_since t;
  kvrun::pair_options po;
  po.response = c.response;
  std::vector<kvrun::text_pair> pairs;
  const std::string label = std::string("generating ") + what + " pairs and samples";
  return kvrun::make_training_samples(m, po, base, base + static_cast<std::uint64_t>(n), pairs, out, c.threads,
                                      [&](index_t d, index_t total) { progress_line(label.c_str(), d, total, t); });
}

// The training and validation samples: from --prompts / --val-prompts when given, else model-generated
// pairs of the training and validation seed ranges.
status training_data(const kvrun::model& m, const common_options& c, const train_cli& t,
                     std::vector<kvrun::lookahead_sample>& train, std::vector<kvrun::lookahead_sample>& val) {
  if (t.prompts.empty()) {
    KVEVICT_TRY(make_samples(m, c, kvrun::train_seed_base, t.train_pairs, "training", train));
    return make_samples(m, c, kvrun::validation_seed_base, t.val_pairs, "validation", val);
  }
  // both files read and checked before any work
  std::vector<std::vector<int>> prompts[2];
  const std::string* paths[2] = {&t.prompts, &t.val_prompts};
  for (int i = 0; i < 2; ++i) {
    KVEVICT_TRY(kvevict::io::read_token_lines(*paths[i], i == 0 ? "--prompts" : "--val-prompts", prompts[i]));
    if (auto st = kvrun::check_prompts(m.cfg(), prompts[i], c.response); !st.ok())
      return status::error(st.code(), "%s: %s", paths[i]->c_str(), st.message());
  }
  std::vector<kvrun::lookahead_sample>* outs[2] = {&train, &val};
  for (int i = 0; i < 2; ++i) {
    std::vector<kvrun::text_pair> pairs;
    clock_since tm;
    const std::string label = std::string("samples from ") + (i == 0 ? "training" : "validation") + " prompts";
    KVEVICT_TRY(kvrun::samples_from_prompts(m, prompts[i], c.response, pairs, *outs[i], c.threads,
                                            [&](index_t d, index_t total) { progress_line(label.c_str(), d, total, tm); }));
  }
  return {};
}

status train_one(const kvrun::model& m, const kvrun::frozen_model<float>& fm, const kvrun::lookahead_config& cfg,
                 const kvrun::train_options& opt, const std::vector<kvrun::lookahead_sample>& train,
                 const std::vector<kvrun::lookahead_sample>& val, kvrun::lookahead_module& mod, double& seconds,
                 double& final_train, double& final_val, bool verbose) {
  KVEVICT_TRY(mod.init(m, cfg, opt.seed));
  double initial_val = std::nan("");
  if (!val.empty()) KVEVICT_TRY(kvrun::mean_loss(fm, mod, val, opt.threads, initial_val));
  if (verbose)
    std::fprintf(stderr, "module: %lld lookahead tokens, LoRA rank %lld alpha %g on %s, %lld parameters; validation loss at init %.5f\n",
                 static_cast<long long>(cfg.n_lookahead), static_cast<long long>(cfg.rank), static_cast<double>(cfg.alpha),
                 kvrun::placement_name(cfg.placement).c_str(), static_cast<long long>(mod.param_count()), initial_val);
  clock_since t;
  final_train = final_val = std::nan("");
  KVEVICT_TRY(kvrun::train_module(fm, train, val, opt, mod, [&](const kvrun::train_progress& p) {
    final_train = p.train_loss;
    if (!std::isnan(p.val_loss)) final_val = p.val_loss;
    if (!verbose) return;
    if (std::isnan(p.val_loss))
      std::fprintf(stderr, "step %5lld/%lld  lr %.2e  train loss %.5f  (%.0f s)\n", static_cast<long long>(p.step),
                   static_cast<long long>(p.steps), p.lr, p.train_loss, p.seconds);
    else
      std::fprintf(stderr, "step %5lld/%lld  lr %.2e  train loss %.5f  validation loss %.5f  (%.0f s)\n",
                   static_cast<long long>(p.step), static_cast<long long>(p.steps), p.lr, p.train_loss, p.val_loss,
                   p.seconds);
  }));
  seconds = t.seconds();
  return {};
}

// ---- JSON ----------------------------------------------------------------------------------

std::string num(double v) {
  if (std::isnan(v) || std::isinf(v)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}
std::string quote(const std::string& s) {
  std::string r = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') r += '\\';
    r += ch;
  }
  return r + "\"";
}
std::string summary_json(const kvrun::summary& s) {
  return "{\"mean\": " + num(s.mean) + ", \"sem\": " + num(s.sem) + ", \"n\": " + std::to_string(s.n) + "}";
}

// ---- checks before any work (docs/conventions.md, "Programs") ---------------------------------

std::string range_error(const char* option, double v, const char* range) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s %g is outside %s", option, v, range);
  return buf;
}

// The training options' ranges and meanings, and the output path (before minutes of training).
std::string check_train(const common_options& c, const train_cli& t, bool needs_out) {
  const auto& o = t.opt;
  if (t.train_pairs < 1) return "--train-pairs must be >= 1, got " + std::to_string(t.train_pairs);
  if (t.val_pairs < 1) return "--val-pairs must be >= 1, got " + std::to_string(t.val_pairs);
  if (o.steps < 1) return "--steps must be >= 1, got " + std::to_string(o.steps);
  if (o.batch < 1) return "--batch must be >= 1, got " + std::to_string(o.batch);
  if (o.log_every < 1) return "--log-every must be >= 1, got " + std::to_string(o.log_every);
  if (t.prompts.empty() != t.val_prompts.empty()) return "--prompts and --val-prompts go together";
  if (o.validate_every < 0) return "--validate-every must be >= 0, got " + std::to_string(o.validate_every);
  if (!(std::isfinite(o.lr) && o.lr > 0)) return range_error("--lr", o.lr, "(0, inf)");
  if (!(o.warmup >= 0 && o.warmup <= 1)) return range_error("--warmup", o.warmup, "[0, 1]");
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return range_error("--beta1", o.beta1, "[0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return range_error("--beta2", o.beta2, "[0, 1)");
  if (!(std::isfinite(o.clip) && o.clip >= 0)) return range_error("--clip", o.clip, "[0, inf) (0: off)");
  if (const status st = kvrun::lookahead_module::check_shape({1, 1, 1, 1, 1, 1}, t.cfg); !st.ok())
    return std::string("--n-lookahead, --rank or --alpha: ") + st.message();
  if (needs_out) {
    if (t.out.empty()) return "train: --out is required";
    if (const status st = kvevict::io::check_paths({{"--model", c.model}, {"--prompts", t.prompts}, {"--val-prompts", t.val_prompts}},
                                                   {{"--out", t.out}});
        !st.ok())
      return st.message();
  }
  return {};
}

// The evaluation options' ranges and meanings, and the JSON output path.
std::string check_eval(const common_options& c, const eval_cli& e) {
  if (e.test_pairs < 1) return "--test-pairs must be >= 1, got " + std::to_string(e.test_pairs);
  if (e.window < 1) return "--window must be >= 1, got " + std::to_string(e.window);
  if (e.timing_pairs < 1) return "--timing-pairs must be >= 1, got " + std::to_string(e.timing_pairs);
  if (e.timing_reps < 1) return "--timing-reps must be >= 1, got " + std::to_string(e.timing_reps);
  if (e.timing_threads < 0) return "--timing-threads must be >= 0, got " + std::to_string(e.timing_threads);
  if (e.budgets.empty()) return "--budgets: give at least one budget";
  if (e.ablation) {
    for (index_t n : e.ablation_n)
      if (n < 1) return "--ablation-n: " + std::to_string(n) + " is not >= 1";
    if (e.ablation_steps < 1) return "--ablation-steps must be >= 1, got " + std::to_string(e.ablation_steps);
    if (e.ablation_train_pairs < 1)
      return "--ablation-train-pairs must be >= 1, got " + std::to_string(e.ablation_train_pairs);
  }
  if (const status st = kvevict::io::check_paths({{"--model", c.model}, {"--module", e.module}}, {{"--json", e.json}});
      !st.ok())
    return st.message();
  return {};
}

// ---- commands -------------------------------------------------------------------------------

int cmd_train(const common_options& c, train_cli& t) {
  if (t.out.empty()) return fail("train: --out is required");
  if (auto st = kvrun::parse_placement(t.placement, t.cfg.placement); !st.ok()) return fail(st);
  t.opt.threads = c.threads;
  clock_since total;
  kvrun::model m;
  if (auto st = kvrun::model::load_file(c.model, m); !st.ok()) return fail_file(c.model, st);
  std::vector<kvrun::lookahead_sample> train, val;
  if (auto st = training_data(m, c, t, train, val); !st.ok()) return fail(st);
  std::fprintf(stderr, "data ready in %.1f s\n", total.seconds());
  kvrun::frozen_model<float> fm;
  fm.from(m);
  kvrun::lookahead_module mod;
  double secs = 0, tr = 0, va = 0;
  if (auto st = train_one(m, fm, t.cfg, t.opt, train, val, mod, secs, tr, va, true); !st.ok()) return fail(st);
  if (auto st = kvrun::save_module(mod, t.out); !st.ok()) return fail(st);
  std::printf("trained %s: %lld steps x batch %lld in %.1f s (%.1f s in all, %d threads); final train loss %.5f, "
              "validation loss %.5f\n",
              t.out.c_str(), static_cast<long long>(t.opt.steps), static_cast<long long>(t.opt.batch), secs,
              total.seconds(),
              kvrun::thread_count(c.threads),
              tr, va);
  return 0;
}

// One training per learning rate on the same data; prints the final training and validation losses.
int cmd_sweep(const common_options& c, train_cli& t, const std::vector<double>& lrs) {
  if (auto st = kvrun::parse_placement(t.placement, t.cfg.placement); !st.ok()) return fail(st);
  t.opt.threads = c.threads;
  kvrun::model m;
  if (auto st = kvrun::model::load_file(c.model, m); !st.ok()) return fail_file(c.model, st);
  std::vector<kvrun::lookahead_sample> train, val;
  if (auto st = training_data(m, c, t, train, val); !st.ok()) return fail(st);
  kvrun::frozen_model<float> fm;
  fm.from(m);
  std::printf("%-10s %-8s %-10s %-12s %-12s\n", "lr", "steps", "seconds", "train loss", "validation");
  for (double lr : lrs) {
    kvrun::train_options o = t.opt;
    o.lr = lr;
    o.validate_every = 0;
    o.log_every = std::max<index_t>(1, std::min<index_t>(50, o.steps));  // the final train loss: the last 50 steps
    kvrun::lookahead_module mod;
    double secs = 0, tr = 0, va = 0;
    if (auto st = train_one(m, fm, t.cfg, o, train, val, mod, secs, tr, va, false); !st.ok()) return fail(st);
    std::printf("%-10.2e %-8lld %-10.1f %-12.5f %-12.5f\n", lr, static_cast<long long>(o.steps), secs, tr, va);
    std::fflush(stdout);
  }
  return 0;
}

int cmd_info(const std::string& path) {
  kvrun::lookahead_module mod;
  if (auto st = kvrun::load_module(path, mod); !st.ok()) return fail_file(path, st);
  const auto& d = mod.dims();
  std::printf("%s: lookahead module v%u for dim %d, %d layers, %d/%d heads, hidden %d, vocab %d; %lld lookahead "
              "tokens, LoRA rank %lld alpha %g on %s; %lld parameters\n",
              path.c_str(), kvrun::lookahead_version, d.dim, d.n_layers, d.n_heads, d.n_kv_heads, d.hidden_dim,
              d.vocab_size, static_cast<long long>(mod.n_lookahead()), static_cast<long long>(mod.rank()),
              static_cast<double>(mod.alpha()), kvrun::placement_name(mod.placement()).c_str(),
              static_cast<long long>(mod.param_count()));
  return 0;
}

int cmd_eval(const common_options& c, eval_cli& e) {
  clock_since total;
  kvrun::model m;
  if (auto st = kvrun::model::load_file(c.model, m); !st.ok()) return fail_file(c.model, st);
  kvrun::lookahead_module main_mod;
  if (auto st = kvrun::load_module(e.module, main_mod); !st.ok()) return fail_file(e.module, st);
  if (auto st = main_mod.check_model(m.cfg()); !st.ok()) return fail_file(e.module, st);
  for (index_t k : e.budgets)
    if (k < 2 || k >= m.cfg().seq_len) return fail("--budgets: " + std::to_string(k) + " is outside [2, seq_len)");

  std::vector<kvrun::text_pair> test;
  if (auto st = make_split(m, c, kvrun::test_seed_base, e.test_pairs, "held-out", test); !st.ok()) return fail(st);

  // methods: oracle, snapkv, the module, then the ablation's modules
  std::vector<std::string> names{"oracle", "snapkv", "lookaheadkv"};
  std::vector<const kvrun::lookahead_module*> modules{&main_mod};
  std::vector<kvrun::lookahead_module> abl;
  std::vector<std::string> abl_desc;
  std::vector<double> abl_secs, abl_train, abl_val;
  if (e.ablation) {
    std::vector<kvrun::lookahead_sample> train, val;
    if (auto st = make_samples(m, c, kvrun::train_seed_base, e.ablation_train_pairs, "training", train); !st.ok())
      return fail(st);
    if (auto st = make_samples(m, c, kvrun::validation_seed_base, 32, "validation", val); !st.ok()) return fail(st);
    kvrun::frozen_model<float> fm;
    fm.from(m);
    e.ablation_opt.steps = e.ablation_steps;
    e.ablation_opt.threads = c.threads;
    e.ablation_opt.log_every = std::max<index_t>(1, std::min<index_t>(50, e.ablation_steps));
    e.ablation_opt.validate_every = 0;
    abl.reserve(e.ablation_n.size() * e.ablation_placements.size());
    for (const std::string& pl : e.ablation_placements)
      for (index_t n : e.ablation_n) {
        kvrun::lookahead_config cfg;
        cfg.n_lookahead = n;
        if (auto st = kvrun::parse_placement(pl, cfg.placement); !st.ok()) return fail(st);
        abl.emplace_back();
        double s = 0, tr = 0, va = 0;
        if (auto st = train_one(m, fm, cfg, e.ablation_opt, train, val, abl.back(), s, tr, va, false); !st.ok())
          return fail(st);
        const std::string name = "lkv-n" + std::to_string(n) + "-" + kvrun::placement_name(cfg.placement);
        std::fprintf(stderr, "ablation %s: %lld steps in %.1f s, train loss %.5f, validation loss %.5f\n", name.c_str(),
                     static_cast<long long>(e.ablation_steps), s, tr, va);
        abl_desc.push_back(name);
        abl_secs.push_back(s);
        abl_train.push_back(tr);
        abl_val.push_back(va);
      }
    for (std::size_t i = 0; i < abl.size(); ++i) {
      names.push_back(abl_desc[i]);
      modules.push_back(&abl[i]);
    }
  }

  kvrun::eval_options o;
  o.budgets = e.budgets;
  o.window = e.window;
  std::vector<kvrun::pair_result> res;
  {
    clock_since t;
    if (auto st = kvrun::evaluate_pairs(m, modules, o, test, res, c.threads,
                                        [&](index_t d, index_t n) { progress_line("evaluating held-out pairs", d, n, t); });
        !st.ok())
      return fail(st);
  }
  // timing on the longest prompts
  std::vector<kvrun::text_pair> timed = test;
  std::stable_sort(timed.begin(), timed.end(),
                   [](const kvrun::text_pair& a, const kvrun::text_pair& b) { return a.prompt.size() > b.prompt.size(); });
  timed.resize(static_cast<std::size_t>(std::min<index_t>(e.timing_pairs, static_cast<index_t>(timed.size()))));
  kvrun::timing_result tim;
  if (auto st = kvrun::time_prefill(m, main_mod, o, timed, e.timing_reps, e.timing_threads, tim); !st.ok()) return fail(st);
  // the ablation modules' prefill overhead: fewer rounds (the grid's last column)
  std::vector<kvrun::timing_result> abl_tim(abl.size());
  for (std::size_t i = 0; i < abl.size(); ++i) {
    const std::vector<kvrun::text_pair> few(timed.begin(), timed.begin() + std::min<std::ptrdiff_t>(4, static_cast<std::ptrdiff_t>(timed.size())));
    if (auto st = kvrun::time_prefill(m, abl[i], o, few, std::max<index_t>(3, e.timing_reps / 3), e.timing_threads, abl_tim[i]);
        !st.ok())
      return fail(st);
  }

  // ---- summaries
  const std::size_t M = names.size(), NB = e.budgets.size();
  auto column = [&](std::size_t meth, std::size_t b, int kind, int rule) {
    std::vector<double> v;
    for (const auto& r : res) {
      const std::size_t i = meth * NB + b;
      v.push_back(kind == 0 ? r.recall[i] : kind == 1 ? r.kept_recall[rule][i] : r.kl[rule][i]);
    }
    return v;
  };
  auto paired = [&](std::size_t a, std::size_t b_meth, std::size_t b, int kind, int rule) {
    auto x = column(a, b, kind, rule), y = column(b_meth, b, kind, rule);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] -= y[i];
    return kvrun::summarize(x);
  };
  index_t minP = 1 << 30, maxP = 0;
  double meanP = 0;
  for (const auto& p : test) {
    const auto P = static_cast<index_t>(p.prompt.size());
    minP = std::min(minP, P), maxP = std::max(maxP, P), meanP += static_cast<double>(P);
  }
  meanP /= static_cast<double>(std::max<std::size_t>(1, test.size()));

  std::printf("LookaheadKV vs SnapKV on %s: %zu held-out pairs (seeds %llu..%llu), prompts %lld..%lld tokens (mean %.0f), "
              "responses %lld tokens\n",
              c.model.c_str(), test.size(), static_cast<unsigned long long>(kvrun::test_seed_base),
              static_cast<unsigned long long>(kvrun::test_seed_base + test.size() - 1), static_cast<long long>(minP),
              static_cast<long long>(maxP), meanP, static_cast<long long>(c.response));
  std::printf("module %s: %lld lookahead tokens, rank %lld, alpha %g, %s; SnapKV window min(%lld, P/2); max pool %lld, GQA mean\n",
              e.module.c_str(), static_cast<long long>(main_mod.n_lookahead()), static_cast<long long>(main_mod.rank()),
              static_cast<double>(main_mod.alpha()), kvrun::placement_name(main_mod.placement()).c_str(),
              static_cast<long long>(e.window), static_cast<long long>(o.pooling.kernel));
  auto table = [&](const char* title, int kind, int rule, bool lower_better) {
    std::printf("\n%s\n%-22s", title, "method");
    for (index_t k : e.budgets) std::printf("  %14s", ("k=" + std::to_string(k)).c_str());
    std::printf("\n");
    for (std::size_t meth = 0; meth < M; ++meth) {
      std::printf("%-22s", names[meth].c_str());
      for (std::size_t b = 0; b < NB; ++b) {
        const auto s = kvrun::summarize(column(meth, b, kind, rule));
        std::printf("  %7.4f±%-6.4f", s.mean, std::isnan(s.sem) ? 0.0 : s.sem);
      }
      std::printf("\n");
    }
    std::printf("%-22s", "lookaheadkv - snapkv");
    for (std::size_t b = 0; b < NB; ++b) {
      const auto s = paired(2, 1, b, kind, rule);
      std::printf("  %+7.4f±%-6.4f", s.mean, std::isnan(s.sem) ? 0.0 : s.sem);
    }
    std::printf("   (%s is better; ± = standard error over pairs)\n", lower_better ? "negative" : "positive");
  };
  table("recall@k of the oracle's top k (ranking only, nothing protected)", 0, 0, false);
  table("KL(full || evicted) per response token, last min(w, k/2) prompt tokens kept", 2, 0, true);
  table("KL(full || evicted) per response token, plain top-k", 2, 1, true);
  table("kept-set recall, last min(w, k/2) prompt tokens kept", 1, 0, false);
  // each method evicting as published: LookaheadKV keeps no suffix window (plain top-k), SnapKV
  // keeps its window (KVCache-Factory)
  auto as_published = [&](std::size_t b) {
    auto x = column(2, b, 2, 1), y = column(1, b, 2, 0);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] -= y[i];
    return kvrun::summarize(x);
  };
  std::printf("\nKL as published (LookaheadKV plain top-k vs SnapKV with its window kept)\n%-22s", "method");
  for (index_t k : e.budgets) std::printf("  %14s", ("k=" + std::to_string(k)).c_str());
  std::printf("\n%-22s", "snapkv (window)");
  for (std::size_t b = 0; b < NB; ++b) std::printf("  %14.4f", kvrun::summarize(column(1, b, 2, 0)).mean);
  std::printf("\n%-22s", "lookaheadkv (top-k)");
  for (std::size_t b = 0; b < NB; ++b) std::printf("  %14.4f", kvrun::summarize(column(2, b, 2, 1)).mean);
  std::printf("\n%-22s", "difference");
  for (std::size_t b = 0; b < NB; ++b) {
    const auto d = as_published(b);
    std::printf("  %+7.4f±%-6.4f", d.mean, std::isnan(d.sem) ? 0.0 : d.sem);
  }
  std::printf("\n%-22s", "relative");
  for (std::size_t b = 0; b < NB; ++b)
    std::printf("  %13.1f%%", 100.0 * as_published(b).mean / kvrun::summarize(column(1, b, 2, 0)).mean);
  std::printf("\n");
  std::printf("\nprefill cost (%lld rounds over the %zu longest prompts, %d thread%s, load average %.2f at the end):\n"
              "  medians:  prefill alone %.3f ms; + LookaheadKV scores %.3f ms; + SnapKV scores %.3f ms\n"
              "  overhead (median of per-round ratios): LookaheadKV %+.1f%%, SnapKV %+.1f%%\n"
              "  scoring alone (medians): LookaheadKV %.3f ms (%.1f%% of the prefill), SnapKV %.3f ms (%.1f%%)\n",
              static_cast<long long>(tim.runs), timed.size(), e.timing_threads, e.timing_threads == 1 ? "" : "s",
              tim.load_average, tim.prefill_ms, tim.lookahead_ms, tim.snapkv_ms, 100.0 * (tim.lookahead_ratio - 1.0),
              100.0 * (tim.snapkv_ratio - 1.0), tim.lookahead_score_ms, 100.0 * tim.lookahead_score_ms / tim.prefill_ms,
              tim.snapkv_score_ms, 100.0 * tim.snapkv_score_ms / tim.prefill_ms);
  if (!abl.empty()) {
    // Table 5 analogue: placements x lookahead sizes
    auto find = [&](const std::string& name) {
      for (std::size_t i = 3; i < names.size(); ++i)
        if (names[i] == name) return i;
      return std::size_t(0);
    };
    for (std::size_t b = 0; b < NB; ++b) {
      std::printf("\nablation at k=%lld (%lld steps each): recall@k / KL plain top-k / KL window kept / scoring time in %% of the prefill\n%-6s",
                  static_cast<long long>(e.budgets[b]), static_cast<long long>(e.ablation_steps), "");
      for (index_t n : e.ablation_n) std::printf("  %-34s", ("n=" + std::to_string(n)).c_str());
      std::printf("\n");
      for (const std::string& pl : e.ablation_placements) {
        unsigned bits = 0;
        (void)kvrun::parse_placement(pl, bits);
        std::printf("%-6s", kvrun::placement_name(bits).c_str());
        for (index_t n : e.ablation_n) {
          const std::size_t meth = find("lkv-n" + std::to_string(n) + "-" + kvrun::placement_name(bits));
          const auto& tt = abl_tim[meth - 3];
          char cell[64];
          std::snprintf(cell, sizeof cell, "%.4f / %.4f / %.4f / %+.1f%%", kvrun::summarize(column(meth, b, 0, 0)).mean,
                        kvrun::summarize(column(meth, b, 2, 1)).mean, kvrun::summarize(column(meth, b, 2, 0)).mean,
                        100.0 * tt.lookahead_score_ms / tt.prefill_ms);
          std::printf("  %-34s", cell);
        }
        std::printf("\n");
      }
    }
  }
  std::printf("total time %.1f s\n", total.seconds());

  if (!e.json.empty()) {
    std::ostringstream js;
    // the input files by their path in the source tree (kvevict::program::recorded_path), as report.json names them
    js << "{\n  \"model\": " << quote(kvevict::program::recorded_path(c.model)) << ",\n  \"module\": "
       << quote(kvevict::program::recorded_path(e.module)) << ",\n";
    js << "  \"module_config\": {\"n_lookahead\": " << main_mod.n_lookahead() << ", \"rank\": " << main_mod.rank()
       << ", \"alpha\": " << num(main_mod.alpha()) << ", \"placement\": " << quote(kvrun::placement_name(main_mod.placement()))
       << "},\n";
    js << "  \"pairs\": {\"count\": " << test.size() << ", \"seed_first\": " << kvrun::test_seed_base
       << ", \"prompt_min\": " << minP << ", \"prompt_max\": " << maxP << ", \"prompt_mean\": " << num(meanP)
       << ", \"response\": " << c.response << "},\n";
    js << "  \"snapkv_window\": " << e.window << ", \"pool_kernel\": " << o.pooling.kernel << ",\n  \"budgets\": [";
    for (std::size_t b = 0; b < NB; ++b) js << (b ? ", " : "") << e.budgets[b];
    js << "],\n  \"methods\": {\n";
    const char* metric_names[5] = {"recall", "kept_recall_window", "kept_recall_topk", "kl_window", "kl_topk"};
    const int kinds[5] = {0, 1, 1, 2, 2}, rules[5] = {0, 0, 1, 0, 1};
    for (std::size_t meth = 0; meth < M; ++meth) {
      js << "    " << quote(names[meth]) << ": {";
      for (int q = 0; q < 5; ++q) {
        js << (q ? ", " : "") << quote(metric_names[q]) << ": [";
        for (std::size_t b = 0; b < NB; ++b) js << (b ? ", " : "") << summary_json(kvrun::summarize(column(meth, b, kinds[q], rules[q])));
        js << "]";
      }
      js << "}" << (meth + 1 < M ? "," : "") << "\n";
    }
    js << "  },\n  \"lookaheadkv_minus_snapkv\": {";
    for (int q = 0; q < 5; ++q) {
      js << (q ? ", " : "") << quote(metric_names[q]) << ": [";
      for (std::size_t b = 0; b < NB; ++b) js << (b ? ", " : "") << summary_json(paired(2, 1, b, kinds[q], rules[q]));
      js << "]";
    }
    js << "},\n  \"kl_as_published_lookaheadkv_topk_minus_snapkv_window\": [";
    for (std::size_t b = 0; b < NB; ++b) js << (b ? ", " : "") << summary_json(as_published(b));
    js << "],\n  \"timing\": {\"runs\": " << tim.runs << ", \"pairs\": " << timed.size() << ", \"threads\": " << e.timing_threads
       << ", \"prefill_ms\": " << num(tim.prefill_ms) << ", \"prefill_lookaheadkv_ms\": " << num(tim.lookahead_ms)
       << ", \"prefill_snapkv_ms\": " << num(tim.snapkv_ms) << ", \"lookaheadkv_scoring_ms\": " << num(tim.lookahead_score_ms)
       << ", \"snapkv_scoring_ms\": " << num(tim.snapkv_score_ms) << ", \"lookaheadkv_ratio\": " << num(tim.lookahead_ratio)
       << ", \"snapkv_ratio\": " << num(tim.snapkv_ratio) << ", \"load_average\": " << num(tim.load_average) << "},\n";
    js << "  \"ablation\": [";
    for (std::size_t i = 0; i < abl.size(); ++i)
      js << (i ? ", " : "") << "{\"name\": " << quote(abl_desc[i]) << ", \"n_lookahead\": " << abl[i].n_lookahead()
         << ", \"placement\": " << quote(kvrun::placement_name(abl[i].placement())) << ", \"steps\": " << e.ablation_steps
         << ", \"train_seconds\": " << num(abl_secs[i]) << ", \"final_train_loss\": " << num(abl_train[i])
         << ", \"final_validation_loss\": " << num(abl_val[i]) << ", \"prefill_ms\": " << num(abl_tim[i].prefill_ms)
         << ", \"prefill_lookaheadkv_ms\": " << num(abl_tim[i].lookahead_ms)
         << ", \"lookaheadkv_scoring_ms\": " << num(abl_tim[i].lookahead_score_ms)
         << ", \"lookaheadkv_ratio\": " << num(abl_tim[i].lookahead_ratio) << ", \"timing_runs\": " << abl_tim[i].runs
         << "}";
    js << "],\n  \"per_pair\": [";
    for (std::size_t i = 0; i < res.size(); ++i) {
      js << (i ? ",\n    " : "\n    ") << "{\"seed\": " << test[i].seed << ", \"P\": " << res[i].P << ", \"recall\": [";
      for (std::size_t j = 0; j < res[i].recall.size(); ++j) js << (j ? ", " : "") << num(res[i].recall[j]);
      js << "], \"kl_window\": [";
      for (std::size_t j = 0; j < res[i].kl[0].size(); ++j) js << (j ? ", " : "") << num(res[i].kl[0][j]);
      js << "], \"kl_topk\": [";
      for (std::size_t j = 0; j < res[i].kl[1].size(); ++j) js << (j ? ", " : "") << num(res[i].kl[1][j]);
      js << "]}";
    }
    js << "\n  ],\n  \"per_pair_layout\": \"[method][budget] in the order of methods and budgets above\",\n"
       << "  \"total_seconds\": " << num(total.seconds()) << "\n}\n";
    kvevict::io::output_transaction out;
    if (auto st = out.stage(e.json, js.str()); !st.ok()) return fail(st);
    if (auto st = out.commit(); !st.ok()) return fail(st);
    std::printf("wrote %s\n", e.json.c_str());
  }
  return 0;
}

int run(int argc, char** argv) {
  CLI::App app{"kvevict-lookahead: train and evaluate LookaheadKV modules for a llama2.c model", "kvevict-lookahead"};
  app.require_subcommand(1);
  common_options c;
  app.add_option("--model", c.model, "llama2.c checkpoint")->capture_default_str();
  app.add_option("--threads", c.threads, "OpenMP threads (0 = OMP_NUM_THREADS or all cores)")->check(kvevict::program::integer<int>())->capture_default_str();
  app.add_option("--response", c.response, "response tokens per pair (greedy)")->check(kvevict::program::integer<index_t>())->capture_default_str();

  train_cli t;
  auto* train = app.add_subcommand("train", "train a module on model-generated pairs and save it");
  train->add_option("--out", t.out, "module file to write")->required();
  add_train_options(train, t);

  eval_cli e;
  auto* eval = app.add_subcommand("eval", "held-out recall@k, KL and prefill cost of a module vs SnapKV and the oracle");
  eval->add_option("--module", e.module, "trained module")->capture_default_str();
  eval->add_option("--json", e.json, "write every number to this JSON file");
  eval->add_option("--test-pairs", e.test_pairs, "held-out pairs")->check(kvevict::program::integer<index_t>())->capture_default_str();
  eval->add_option("--budgets", e.budgets, "KV budgets per head")->delimiter(',')->check(kvevict::program::integer<index_t>())->capture_default_str();
  eval->add_option("--window", e.window, "SnapKV observation window (min(window, P/2))")->check(kvevict::program::integer<index_t>())->capture_default_str();
  eval->add_option("--timing-pairs", e.timing_pairs, "longest prompts timed")->check(kvevict::program::integer<index_t>())->capture_default_str();
  eval->add_option("--timing-reps", e.timing_reps, "timed rounds per prompt")->check(kvevict::program::integer<index_t>())->capture_default_str();
  eval->add_option("--timing-threads", e.timing_threads, "threads of the timed prefills")->check(kvevict::program::integer<int>())->capture_default_str();
  eval->add_flag("--ablation", e.ablation, "also train and evaluate the n_lookahead x placement grid (Table 5)");
  eval->add_option("--ablation-n", e.ablation_n, "lookahead sizes of the ablation")->delimiter(',')->check(kvevict::program::integer<index_t>())->capture_default_str();
  eval->add_option("--ablation-placements", e.ablation_placements, "placements of the ablation")
      ->delimiter(',')
      ->capture_default_str();
  eval->add_option("--ablation-steps", e.ablation_steps, "training steps per ablation module")->check(kvevict::program::integer<index_t>())->capture_default_str();
  eval->add_option("--ablation-train-pairs", e.ablation_train_pairs, "training pairs of the ablation")->check(kvevict::program::integer<index_t>())->capture_default_str();

  train_cli sw;
  std::vector<double> lrs{2e-3, 5e-3, 1e-2};
  auto* sweep = app.add_subcommand("sweep", "train one module per learning rate on the same data (validation losses)");
  add_train_options(sweep, sw);
  sweep->add_option("--lrs", lrs, "learning rates")->delimiter(',')->capture_default_str();

  std::string info_module;
  auto* info = app.add_subcommand("info", "print a module file's header");
  info->add_option("--module", info_module, "module file")->required();

  if (const int code = kvevict::program::parse_or_exit(app, argc, argv, "kvevict-lookahead"); code >= 0) return code;
  if (c.threads < 0) return fail("--threads must be >= 0, got " + std::to_string(c.threads));
  if (c.response < 2) return fail("--response must be >= 2, got " + std::to_string(c.response));
  // every option of the subcommand is checked before any work (outputs included)
  std::string bad;
  if (*train) bad = check_train(c, t, true);
  if (*sweep) {
    bad = check_train(c, sw, false);
    for (double lr : lrs)
      if (bad.empty() && !(std::isfinite(lr) && lr > 0)) bad = range_error("--lrs:", lr, "(0, inf)");
  }
  if (*eval) bad = check_eval(c, e);
  if (!bad.empty()) return fail(bad);
  if (*train) return cmd_train(c, t);
  if (*eval) return cmd_eval(c, e);
  if (*sweep) return cmd_sweep(c, sw, lrs);
  return cmd_info(info_module);
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::program::guarded_main("kvevict-lookahead", [&] { return run(argc, argv); });
}
