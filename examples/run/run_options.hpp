// kvevict-run's command line (docs/runner.md): the options, their parsing, and every check that
// needs no file (docs/conventions.md, "Programs": every number validated before any work). A
// function of its own so that the fuzzer (fuzz/fuzz_run_options.cpp) exercises exactly what the
// program runs.
#pragma once

#include "cli.hpp"
#include "shipped_models.hpp"

#include <runner/evict.hpp>

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace kvrun {

struct run_options {
  std::string model = kvevict::program::shipped_model("stories260K.bin");
  std::string tokenizer = kvevict::program::shipped_model("tok512.bin");
  std::string prompt = "Once upon a time";
  int steps = 256;
  float temperature = 0.0f;
  float topp = 0.9f;
  std::uint64_t seed = 42;
  int threads = 0;
  bool ids = false;
  bool stats = false;
  index_t page_size = 16;  ///< tokens per page of the paged KV cache (kv_cache.hpp)
  index_t batch = 1;       ///< sequences decoded as one batch (batch.hpp)
  std::vector<std::string> batch_prompts;  ///< the batch's prompts after --prompt (cycled)
  index_t batch_slots = 0;  ///< --batch: sequences running at once (0: all)
  bool batch_bench = false; ///< --batch: time the batched forward against the forwards one after another
  int tp = 0, pp = 0;  ///< sharded over MPI ranks (sharded/sharded.hpp): tensor / pipeline parallel, 0 = not
  // eviction
  std::string recipe = "full";
  std::string allocator;
  std::string driver = "postfill";
  evict_options evict;
  index_t calibration = 8;
  std::string head_mask;      ///< duo, prulong: the trained head-mask TSV ("": the shipped one)
  double head_sparsity = -1;  ///< duo, prulong: fraction of streaming heads (-1: the file's own)
  std::string lookahead_module = kvevict::program::shipped_model("lookahead/stories260K-n16.bin");
  // report
  bool report = false;
  std::string out_dir = ".";
  index_t prompts = 128;  ///< enough to separate the methods (docs/report.md: ~20 min on 2 cores)
  std::vector<index_t> budgets{16, 32, 64, 128};
  std::vector<std::string> recipes, drivers;
  bool all_drivers = false;
  // the footprint protocol (docs/report.md, "Critical KV footprint")
  bool footprint = false;
  std::vector<double> fractions{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98};
  // which of the defaults the command line changed (the report and the footprint sweep pick their own)
  bool budgets_given = false, laq_steps_given = false, draft_tokens_given = false;
};

/// Parses and checks kvevict-run's command line. Returns -1 to go on (`o` filled, o.evict.recipe
/// parsed); otherwise the exit status, with `message` the help text (0), an error line without
/// the program's name (1), or a command-line syntax error (2).
inline int parse_run_options(int argc, const char* const* argv, run_options& o, std::string& message) {
  const auto err = [&](const std::string& m) {
    message = m;
    return 1;
  };
  const auto err_st = [&](const char* prefix, const status& st) { return err(std::string(prefix) + st.message()); };
  CLI::App app{"kvevict-run: generate text with the kvevict reference runner (llama2.c checkpoints)", "kvevict-run"};
  // an integer option: its text checked as a whole number of its type, its default in --help
  const auto integer = [&app](const char* name, auto& value, const char* help) {
    return app.add_option(name, value, help)
        ->check(kvevict::program::integer<std::remove_reference_t<decltype(value)>>())
        ->capture_default_str();
  };
  app.add_option("--model", o.model, "llama2.c checkpoint")->capture_default_str();
  app.add_option("--tokenizer", o.tokenizer, "llama2.c tokenizer (vocabulary size must match the model)")
      ->capture_default_str();
  app.add_option("--prompt", o.prompt, "prompt text (BOS and a dummy-prefix space are added)")->capture_default_str();
  integer("--steps", o.steps, "positions to run, prompt included (run.c's -n); 1..seq_len");
  app.add_option("--temperature", o.temperature, "0 = greedy; > 0 samples softmax(logits / temperature)")
      ->capture_default_str();
  app.add_option("--topp", o.topp, "top-p (nucleus) threshold when sampling; 0 or 1 = plain sampling")
      ->capture_default_str();
  integer("--seed", o.seed, "xorshift seed for sampling (nonzero; run.c's -s)");
  integer("--threads", o.threads, "OpenMP threads for long blocks (0 = OMP_NUM_THREADS or all cores)");
  app.add_flag("--ids", o.ids, "print the token ids of prompt (with BOS) and output on one line instead of text");
  app.add_flag("--stats", o.stats, "print prefill and decode speed (and the eviction's cost, footprint and pages) on stderr");
  integer("--page-size", o.page_size, "tokens per page of the paged KV cache");
  integer("--batch", o.batch, "sequences run as one batch with continuous decoding (prompts: --prompt, --batch-prompt ..., cycled); with --report: prompts per batch of each thread");
  app.add_option("--batch-prompt", o.batch_prompts, "--batch: further prompts (repeatable)");
  integer("--batch-slots", o.batch_slots, "--batch: sequences running at once, a new one joining when one leaves (0 = all)");
  app.add_flag("--batch-bench", o.batch_bench,
               "--batch: run the batch with one batched forward per step and with its forwards one after another "
               "(3 times each, alternating), check both give the same tokens, print tokens/s of each on stderr");
  integer("--tp", o.tp,
          "tensor parallelism over MPI ranks (mpirun -np P kvevict-run --tp P; also with --report; docs/distributed.md)");
  integer("--pp", o.pp, "pipeline parallelism over MPI ranks (mpirun -np P kvevict-run --pp P; docs/distributed.md)");
  // eviction (docs/runner.md, "Eviction")
  auto* recipe_opt = app.add_option("--recipe", o.recipe,
                                    "eviction method: full (no eviction), streaming_llm, h2o, tova, snapkv, pyramidkv, "
                                    "knorm, vatp, adakv, cake, lava, duo-heuristic, duo, prulong, laq, laq++, lookaheadkv, oracle")
                         ->capture_default_str();
  std::vector<CLI::Option*> evict_opts;
  evict_opts.push_back(integer("--budget", o.evict.budget, "tokens kept per KV head, protected ones included"));
  evict_opts.push_back(app.add_option("--allocator", o.allocator,
                                      "uniform, pyramid, adakv, lava, cake or duo (default: the recipe's)"));
  evict_opts.push_back(app.add_option("--driver", o.driver, "postfill, layerwise, chunked-naive, chunked-patched or decode")
                           ->capture_default_str());
  evict_opts.push_back(integer("--window", o.evict.window,
                               "observation window; the recent tokens window recipes, H2O and LAQ keep"));
  evict_opts.push_back(integer("--sinks", o.evict.sinks,
                               "first tokens always kept (-1: the recipe's: 4 for streaming_llm, duo, prulong, "
                               "duo-heuristic, else 0)"));
  evict_opts.push_back(integer("--chunk", o.evict.chunk, "chunked drivers: tokens per chunk"));
  evict_opts.push_back(integer("--evict-every", o.evict.evict_every, "decode driver: evict every N decoded tokens"));
  auto* laq_steps_opt = integer("--laq-steps", o.evict.laq_steps, "laq, laq++: pseudo-decoded tokens");
  evict_opts.push_back(laq_steps_opt);
  auto* draft_tokens_opt = integer("--draft-tokens", o.evict.draft_tokens, "speckv: draft tokens");
  evict_opts.push_back(draft_tokens_opt);
  evict_opts.push_back(integer("--draft-layers", o.evict.draft_layers,
                               "speckv: the draft model is the first N layers with the output head"));
  evict_opts.push_back(app.add_option("--chunk-fraction", o.evict.chunk_fraction,
                                      "chunked drivers: evict this fraction of each head's rows after every chunk "
                                      "(-1: down to the budget)")
                           ->capture_default_str());
  evict_opts.push_back(integer("--duo-recent", o.evict.duo_recent, "duo, prulong, duo-heuristic: recent tokens of a streaming head"));
  evict_opts.push_back(integer("--calibration", o.calibration, "duo-heuristic: calibration texts (training split)"));
  auto* head_mask_opt = app.add_option("--head-mask", o.head_mask,
                                       "duo, prulong: trained head-mask TSV (default: models/duo/stories260K.tsv, "
                                       "models/prulong/stories260K-s50.tsv)");
  auto* head_sparsity_opt = app.add_option("--head-sparsity", o.head_sparsity,
                                           "duo, prulong: fraction of streaming heads, the mask's top heads kept "
                                           "(default: the mask's own, values >= 0.5)");
  auto* lookahead_opt =
      app.add_option("--lookahead-module", o.lookahead_module,
                     "lookaheadkv (and --report): the trained LookaheadKV module (docs/lookaheadkv.md)")
          ->capture_default_str();
  // the quality report (docs/report.md)
  app.add_flag("--report", o.report, "run the quality report: table on stdout, report.json and report.svg in --out-dir");
  app.add_flag("--footprint", o.footprint,
               "run the footprint protocol: critical KV footprints (table on stdout; footprint.json, .md, .svg in "
               "--out-dir)");
  std::vector<CLI::Option*> report_opts;
  report_opts.push_back(app.add_option("--out-dir", o.out_dir, "report: directory for report.json and report.svg")
                            ->capture_default_str());
  report_opts.push_back(integer("--prompts", o.prompts, "report: test prompts"));
  auto* budgets_opt = app.add_option("--budgets", o.budgets, "report: budgets, comma-separated (--footprint: its sweep)")
                          ->delimiter(',')
                          ->check(kvevict::program::integer<index_t>())->capture_default_str();
  report_opts.push_back(budgets_opt);
  auto* fractions_opt = app.add_option("--fractions", o.fractions,
                                       "footprint: the chunked drivers' per-chunk eviction fractions, comma-separated")
                            ->delimiter(',')
                            ->capture_default_str();
  report_opts.push_back(app.add_option("--recipes", o.recipes, "report: only these recipes (comma-separated)")->delimiter(','));
  report_opts.push_back(app.add_option("--drivers", o.drivers, "report: only these drivers (comma-separated)")->delimiter(','));
  report_opts.push_back(app.add_flag("--all-drivers", o.all_drivers,
                                     "report: every supported recipe x driver pair, not the default matrix"));
  if (const int code = kvevict::program::parse_command_line(app, argc, argv, message); code >= 0) return code;

  o.budgets_given = budgets_opt->count() > 0;
  o.laq_steps_given = laq_steps_opt->count() > 0;
  o.draft_tokens_given = draft_tokens_opt->count() > 0;
  if (!(o.temperature >= 0.0f) || !std::isfinite(o.temperature))
    return err("--temperature must be finite and >= 0, got " + std::to_string(o.temperature));
  if (!(o.topp >= 0.0f && o.topp <= 1.0f)) return err("--topp must be in [0, 1], got " + std::to_string(o.topp));
  if (o.seed == 0) return err("--seed must be nonzero (the xorshift generator never leaves state 0)");
  if (o.threads < 0) return err("--threads must be >= 0, got " + std::to_string(o.threads));
  if (o.page_size < 1 || o.page_size > 4096) return err("--page-size must be in [1, 4096], got " + std::to_string(o.page_size));
  if (o.batch < 1 || o.batch > 64) return err("--batch must be in [1, 64], got " + std::to_string(o.batch));
  if (o.batch_slots < 0 || o.batch_slots > o.batch)
    return err("--batch-slots must be in [0, --batch " + std::to_string(o.batch) + "], got " + std::to_string(o.batch_slots));
  if ((o.batch_slots > 0 || o.batch_bench) && o.batch < 2) return err("--batch-slots and --batch-bench need --batch >= 2");
  if (o.tp < 0 || o.pp < 0) return err("--tp and --pp must be >= 0 (0: not sharded)");
  if ((o.tp > 0 || o.pp > 0) && o.batch > 1) return err("--batch runs in one process: it cannot be combined with --tp / --pp");
  if ((o.tp > 0 || o.pp > 0) && o.footprint)
    return err("--footprint runs in one process: it cannot be combined with --tp / --pp (--report can)");
  // every count is checked here, before any file is read or any work starts (docs/conventions.md)
  if (o.calibration < 1) return err("--calibration must be >= 1, got " + std::to_string(o.calibration));
  if (o.prompts < 1) return err("--prompts must be >= 1, got " + std::to_string(o.prompts));
  if (auto st = check_evict_counts(o.evict, nullptr); !st.ok()) return err(st.message());
  for (const double f : o.fractions)
    if (!(f > 0.0 && f < 1.0)) return err("--fractions: " + std::to_string(f) + " is outside (0, 1)");
  if (o.report && o.footprint) return err("--report and --footprint are two runs: give one");
  if (!o.footprint && fractions_opt->count() > 0) return err("--fractions needs --footprint");

  // eviction options only with an eviction recipe; report options only with --report
  method method = method::full;
  if (auto st = parse_method(o.recipe, method); !st.ok()) return err_st("--recipe: ", st);
  const bool sweep = o.report || o.footprint;
  if (!sweep && method == method::full)
    for (const CLI::Option* opt : evict_opts)
      if (opt->count() > 0) return err(opt->get_name() + " needs --recipe (without it the cache is not evicted)");
  if (sweep && recipe_opt->count() > 0)
    return err(std::string(o.report ? "--report" : "--footprint") + " runs every recipe: use --recipes to choose some");
  if (!sweep)
    for (const CLI::Option* opt : report_opts)
      if (opt->count() > 0) return err(opt->get_name() + " needs --report");
  if (!sweep && method != method::lookaheadkv && lookahead_opt->count() > 0)
    return err("--lookahead-module needs --recipe lookaheadkv or --report");
  if (method != method::duo && method != method::prulong)
    for (const CLI::Option* opt : {head_mask_opt, head_sparsity_opt})
      if (opt->count() > 0) return err(opt->get_name() + " needs --recipe duo or prulong");
  if (head_sparsity_opt->count() > 0 && !(o.head_sparsity >= 0.0 && o.head_sparsity <= 1.0))
    return err("--head-sparsity must be in [0, 1], got " + std::to_string(o.head_sparsity));
  if (o.head_mask.empty())
    o.head_mask = kvevict::program::shipped_model(method == method::prulong ? "prulong/stories260K-s50.tsv" : "duo/stories260K.tsv");
  o.evict.recipe = method;
  if (!o.allocator.empty()) {
    budget_scheme a;
    if (auto st = parse_allocator(o.allocator, a); !st.ok()) return err_st("--allocator: ", st);
    o.evict.alloc = a;
  }
  if (auto st = parse_driver(o.driver, o.evict.driver); !st.ok()) return err_st("--driver: ", st);
  return -1;
}

}  // namespace kvrun
