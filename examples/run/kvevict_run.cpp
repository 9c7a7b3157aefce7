// kvevict-run: generate a story with the reference runner, as llama2.c's run.c, with the full KV
// cache or with any of kvevict's eviction methods; or run the quality report.
//
//   kvevict-run --prompt "Once upon a time" --steps 256            greedy, prints the text
//   kvevict-run --temperature 1.0 --seed 42 --ids                  sampled, prints token ids
//   kvevict-run --prompt "..." --recipe snapkv --budget 32         the story with an evicted cache
//   kvevict-run --recipe h2o --driver decode --budget 64            decode-time eviction
//   kvevict-run --prompt "..." --recipe lookaheadkv --budget 32    LookaheadKV with the shipped module
//   kvevict-run --report --out-dir docs/report                     the quality report (docs/report.md)
//   kvevict-run --footprint --out-dir docs/report                  the critical-footprint protocol
//
// Every error (bad option, missing or malformed model/tokenizer, prompt too long) is one line on
// stderr and exit status 1 (2 for command-line syntax errors).
#include <lookaheadkv/data.hpp>
#include <lookaheadkv/module.hpp>
#include <lookaheadkv/scores.hpp>
#include <batch/batch.hpp>
#include <methods/duo_calibration.hpp>
#include <methods/laq.hpp>
#include <runner/evictor.hpp>
#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <report/footprint.hpp>
#include <report/report.hpp>
#include <report/svg.hpp>
#include <report/tables.hpp>
#include <run/run_options.hpp>
#include <runner/runner.hpp>
#include <sharded/sharded.hpp>
#include <methods/speckv.hpp>
#include <runner/tokenizer.hpp>

#include "io.hpp"
#include "main.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#if defined(KVEVICT_RUN_MPI)
#  include <kvevict/mpi.hpp>
#endif

namespace {

using options = kvrun::run_options;

int fail(const char* what, const kvevict::status& st) {
  return kvevict::program::fail("kvevict-run", std::string(what) + st.message());
}
// A file's format errors name the file (open errors already do).
int fail_file(const std::string& path, const kvevict::status& st) {
  if (st.code() == kvevict::errc::io_error) return fail("", st);
  return fail((path + ": ").c_str(), st);
}
int fail(const std::string& message) { return kvevict::program::fail("kvevict-run", message); }

// The duo-heuristic method's head types: a calibration pass over `count` model-generated training texts.
kvevict::status calibrate_duo(const kvrun::model& model, const kvrun::evict_options& e, kvevict::index_t count,
                              int threads, kvrun::duo_heads& out) {
  std::vector<std::vector<int>> texts;
  KVEVICT_TRY(kvrun::training_texts(model, kvrun::pair_options{}, count, texts, threads));
  kvrun::duo_calibration_options o;
  o.sinks = kvrun::sinks_of(e);
  o.recent = e.duo_recent;
  return kvrun::duo_calibrate(model, texts, o, out);
}

// Loads --lookahead-module and checks it against the model: one error line naming the file.
bool load_lookahead(const std::string& path, const kvrun::model& model, kvrun::lookahead_module& out) {
  kvevict::status st = kvrun::load_module(path, out);
  if (st.ok()) st = out.check_model(model.cfg());
  if (st.ok()) return true;
  if (st.code() == kvevict::errc::io_error) fail("--lookahead-module: ", st);
  else fail(("--lookahead-module " + path + ": ").c_str(), st);
  return false;
}

// The files a sweep writes into --out-dir.
std::vector<kvevict::io::named_path> out_files(const options& o, std::initializer_list<const char*> names) {
  std::vector<kvevict::io::named_path> files;
  for (const char* n : names) files.push_back({n, o.out_dir + "/" + n});
  return files;
}

// Writes a sweep's files (out_files) with their contents, all or nothing. Returns the exit status.
int write_files(const std::vector<kvevict::io::named_path>& files, const std::vector<std::string>& contents) {
  kvevict::io::output_transaction out;
  for (std::size_t i = 0; i < files.size(); ++i)
    if (auto st = out.stage(files[i].path, contents[i]); !st.ok()) return fail("", st);
  if (auto st = out.commit(); !st.ok()) return fail("", st);
  return 0;
}

// The report's and the footprint sweep's common options: counts, recipes, drivers and the output
// directory checked, the module loaded when a recipe needs it, the outputs checked now (before
// minutes of work; written together at the end). LAQ's pseudo tokens and SpecKV's draft tokens
// default to the module's lookahead tokens (the LookaheadKV paper's equal counts).
// Returns 0 to go on, else the exit status.
int sweep_options(const options& o, const kvrun::model& model, kvrun::lookahead_module& lookahead,
                  kvrun::report_options& r, std::vector<kvrun::method>& recipes, std::vector<kvrun::driver_kind>& drivers,
                  const std::vector<kvevict::io::named_path>& outputs) {
  r.prompts = o.prompts;
  r.base = o.evict;
  r.calibration = o.calibration;
  r.threads = o.threads;
  r.batch = o.batch;  // --batch N: each thread runs N prompts as one batch on one page pool
  r.page_size = o.page_size;
  for (const std::string& name : o.recipes) {
    kvrun::method m;
    if (auto st = kvrun::parse_method(name, m); !st.ok()) return fail("--recipes: ", st);
    recipes.push_back(m);
  }
  for (const std::string& name : o.drivers) {
    kvrun::driver_kind d;
    if (auto st = kvrun::parse_driver(name, d); !st.ok()) return fail("--drivers: ", st);
    drivers.push_back(d);
  }
  for (const kvevict::index_t b : o.budgets)
    if (b < 1 || b > model.cfg().seq_len)
      return fail("--budgets: " + std::to_string(b) + " is outside [1, " + std::to_string(model.cfg().seq_len) + "]");
  if (std::error_code ec; !std::filesystem::is_directory(o.out_dir, ec))
    return fail("--out-dir " + o.out_dir + " is not a directory");
  if (recipes.empty() || std::find(recipes.begin(), recipes.end(), kvrun::method::lookaheadkv) != recipes.end()) {
    if (!load_lookahead(o.lookahead_module, model, lookahead)) return 1;
    r.lookahead = &lookahead;
    r.lookahead_path = o.lookahead_module;
    if (!o.laq_steps_given) r.base.laq_steps = lookahead.n_lookahead();
    if (!o.draft_tokens_given) r.base.draft_tokens = lookahead.n_lookahead();
  }
  r.progress = [](const char* line) { std::fprintf(stderr, "%s\n", line); };
  if (auto st = kvevict::io::check_paths({{"--model", o.model}, {"--lookahead-module", o.lookahead_module}}, outputs);
      !st.ok())
    return fail("--out-dir: ", st);
  return 0;
}

std::string model_name(const std::string& path) {
  std::string name = path;
  if (const auto slash = name.find_last_of('/'); slash != std::string::npos) name = name.substr(slash + 1);
  if (const auto dot = name.rfind(".bin"); dot != std::string::npos && dot + 4 == name.size()) name.resize(dot);
  return name;
}

// kvevict-run --footprint (docs/report.md, "Critical KV footprint"): the sweep, its table, JSON and plot.
int run_footprint(const options& o, const kvrun::model& model, const std::string& command) {
  kvrun::footprint_options f;
  kvrun::lookahead_module lookahead;
  const auto files = out_files(o, {"footprint.json", "footprint.md", "footprint.svg"});
  if (const int code = sweep_options(o, model, lookahead, f.report, f.recipes, f.drivers, files); code != 0) return code;
  if (o.budgets_given) f.budgets = o.budgets;
  f.fractions = o.fractions;
  kvrun::footprint_result result;
  if (auto st = kvrun::run_footprint(model, f, result); !st.ok()) return fail("", st);
  const std::string table = kvrun::footprint_markdown(result), name = model_name(o.model);
  std::fputs(table.c_str(), stdout);
  if (const int code = write_files(files, {kvrun::footprint_json(result, name, command), table,
                                           kvrun::footprint_svg(result, name)});
      code != 0)
    return code;
  std::fprintf(stderr, "footprint: wrote %s, %s and %s (%.1f s)\n", files[0].path.c_str(), files[1].path.c_str(),
               files[2].path.c_str(), result.report.seconds);
  return 0;
}

// The prompt and the generated tokens on stdout: ids (--ids) or text. Returns the exit status.
int print_output(const options& o, const kvrun::tokenizer& tok, const std::vector<int>& prompt,
                 const std::vector<int>& generated) {
  std::vector<int> all = prompt;
  all.insert(all.end(), generated.begin(), generated.end());
  if (o.ids) {
    for (std::size_t i = 0; i < all.size(); ++i) std::printf(i == 0 ? "%d" : " %d", all[i]);
    std::printf("\n");
  } else {
    std::string text;
    if (auto st = kvrun::detokenize(tok, all, text); !st.ok()) return fail("", st);
    std::printf("%s\n", text.c_str());
  }
  return 0;
}

// Encodes `text` (BOS first) into `out` and checks it against the model's context and --steps;
// `name` ("the prompt", "a --batch-prompt") begins the error lines. Returns the exit status.
int encode_prompt(const options& o, const kvrun::tokenizer& tok, const kvrun::config& c, const std::string& text,
                  const std::string& name, std::vector<int>& out) {
  // Each token covers at most longest_piece() bytes (the dummy-prefix space included), so a longer
  // text cannot fit; checked before encoding, whose merge loop is quadratic in the text's length.
  if (text.size() + 1 > static_cast<std::size_t>(c.seq_len - 1) * static_cast<std::size_t>(tok.longest_piece()))
    return fail(name + " of " + std::to_string(text.size()) + " bytes cannot fit in the model's context of " +
                std::to_string(c.seq_len) + " tokens");
  if (auto st = tok.encode(text, /*bos=*/true, /*eos=*/false, out); !st.ok()) return fail("", st);
  if (static_cast<int>(out.size()) > c.seq_len)
    return fail(name + " has " + std::to_string(out.size()) + " tokens, longer than the model's context of " +
                std::to_string(c.seq_len));
  if (static_cast<int>(out.size()) > o.steps)
    return fail(name + " has " + std::to_string(out.size()) + " tokens, more than --steps " + std::to_string(o.steps) +
                " (steps count the prompt too)");
  return 0;
}

#if defined(KVEVICT_RUN_MPI)
// MPI for a sharded run (--tp / --pp): initialised once, finalised at the scope's end.
struct mpi_session {
  mpi_session() {
    int started = 0;
    MPI_Initialized(&started);
    if (started == 0) MPI_Init(nullptr, nullptr);
  }
  ~mpi_session() { MPI_Finalize(); }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
};

kvrun::shard_options shard_options_of(const options& o) {
  return {o.tp > 0 ? o.tp : 1, o.pp > 0 ? o.pp : 1, o.threads > 0 ? o.threads : 1};
}

// The job's communicators (construct after MPI_Init, destroy before MPI_Finalize): MPI_COMM_WORLD
// for --tp or --pp alone; for both, the stage's and the heads' groups split by kvevict::mpi_grid.
// A job of the wrong size keeps MPI_COMM_WORLD alone, for check_sharded's error on every rank.
struct job_comms {
  kvevict::mpi_comm world{MPI_COMM_WORLD};
  kvevict::mpi_grid grid;
  kvrun::shard_comms<kvevict::mpi_comm> groups = kvrun::one_group(world);
  kvevict::status init(const kvrun::shard_options& s) {
    if (s.tp > 1 && s.pp > 1 && world.size() == s.tp * s.pp) {
      KVEVICT_TRY(grid.init(MPI_COMM_WORLD, s.tp, s.pp));
      groups.tp = &grid.tp();
      groups.pp = &grid.pp();
    }
    return {};
  }
};
#endif

// kvevict-run --tp P / --pp P under mpirun (sharded/sharded.hpp): every rank generates the same
// tokens; rank 0 prints them. Without MPI: a clear error.
int run_sharded(const options& o, const kvrun::model& model, const kvrun::tokenizer& tok, const std::vector<int>& prompt,
                const kvrun::duo_heads& duo) {
#if defined(KVEVICT_RUN_MPI)
  const mpi_session mpi;
  job_comms comm;
  kvrun::sampler sampler;
  if (auto st = sampler.init(model.cfg().vocab_size, o.temperature, o.topp, o.seed); !st.ok()) return fail("", st);
  std::vector<int> generated;
  const kvrun::shard_options s = shard_options_of(o);
  auto st = comm.init(s);
  std::vector<int> response;  // the oracle's block: the full cache's continuation (sharded too), same sampler; speckv's: the draft
  if (st.ok() && o.evict.recipe == kvrun::method::oracle) {
    kvrun::sampler s0;
    kvrun::evict_options fo = o.evict;
    fo.recipe = kvrun::method::full;
    st = s0.init(model.cfg().vocab_size, o.temperature, o.topp, o.seed);
    if (st.ok())
      st = kvrun::sharded_generate(model, comm.groups, s, fo, prompt, o.steps,
                                   [&](const float* logits) { return s0.sample(logits); }, response);
    if (st.ok() && response.empty())
      st = kvevict::status::error(kvevict::errc::invalid_argument, "oracle: the full cache generates nothing after this prompt");
  }
  if (st.ok() && o.evict.recipe == kvrun::method::speckv) {  // the draft model (methods/speckv.hpp), whole on every rank
    kvrun::speckv_drafter drafter;
    st = drafter.init(model, o.evict.draft_layers);
    if (st.ok()) st = drafter.draft(prompt, o.evict.draft_tokens, response);
  }
  kvrun::lookahead_module lookahead;  // lookaheadkv's module, loaded on every rank
  if (st.ok() && o.evict.recipe == kvrun::method::lookaheadkv) {
    st = kvrun::load_module(o.lookahead_module, lookahead);  // load_lookahead's checks and message, rank 0 printing
    if (st.ok()) st = lookahead.check_model(model.cfg());
    if (!st.ok())
      st = kvevict::status::error(st.code(), "--lookahead-module%s%s: %s", st.code() == kvevict::errc::io_error ? "" : " ",
                                  st.code() == kvevict::errc::io_error ? "" : o.lookahead_module.c_str(), st.message());
  }
  if (st.ok())
    st = kvrun::sharded_generate(model, comm.groups, s, o.evict, prompt, o.steps,
                                 [&](const float* logits) { return sampler.sample(logits); }, generated, &duo, &response,
                                 &lookahead);
  if (comm.world.rank() != 0) return st.ok() ? 0 : 1;  // one line from rank 0 (every rank has the same status)
  if (!st.ok()) return fail("", st);
  return print_output(o, tok, prompt, generated);
#else
  (void)model, (void)tok, (void)prompt, (void)duo;
  return fail(std::string(o.tp > 0 ? "--tp" : "--pp") +
              " needs MPI: this kvevict-run was built without it (install libopenmpi-dev and reconfigure)");
#endif
}

// kvevict-run --report (docs/report.md): its options checked, the module loaded if needed, the run.
// With --tp / --pp under mpirun: run_sharded_report (sharded/sharded.hpp) on every rank, rank 0
// printing and writing the files (every number but the times equal to the one-process run's).
int run_report(const options& o, const kvrun::model& model, const std::string& command) {
  const bool sharded = o.tp > 0 || o.pp > 0;
#if defined(KVEVICT_RUN_MPI)
  std::optional<mpi_session> mpi;
  std::optional<job_comms> comm;
  if (sharded) {
    mpi.emplace();
    comm.emplace();
  }
  const bool writer = !comm || comm->world.rank() == 0;
#else
  if (sharded) return fail(std::string(o.tp > 0 ? "--tp" : "--pp") +
                           " needs MPI: this kvevict-run was built without it (install libopenmpi-dev and reconfigure)");
  const bool writer = true;
#endif
  kvrun::report_options r;
  kvrun::lookahead_module lookahead;  // every method runs unless --recipes leaves lookaheadkv out
  const auto files = out_files(o, {"report.json", "report.svg", "tables.md"});
  if (const int code = sweep_options(o, model, lookahead, r, r.recipes, r.drivers, files); code != 0) return code;
  r.budgets = o.budgets;
  r.all_drivers = o.all_drivers;
  if (!writer) r.progress = {};
  std::vector<kvrun::report_config> configs;
  if (auto st = kvrun::report_configs(model.cfg(), r, configs); !st.ok()) return writer ? fail("", st) : 1;
  kvrun::report_result result;
#if defined(KVEVICT_RUN_MPI)
  if (comm) {
    auto st = comm->init(shard_options_of(o));
    if (st.ok()) st = kvrun::run_sharded_report(model, comm->groups, shard_options_of(o), r, result);
    if (!writer) return st.ok() ? 0 : 1;  // one message, from rank 0 (every rank has the same status)
    if (!st.ok()) return fail("", st);
  } else
#endif
  if (auto st = kvrun::run_report(model, r, result); !st.ok()) return fail("", st);
  std::fputs(kvrun::report_table(result).c_str(), stdout);
  const std::string name = model_name(o.model);
  if (const int code = write_files(files, {kvrun::report_json(result, name, command), kvrun::report_svg(result, name),
                                           kvrun::report_markdown(result, "Quality report tables: " + name)});
      code != 0)
    return code;
  std::fprintf(stderr, "report: wrote %s, %s and %s\n", files[0].path.c_str(), files[1].path.c_str(),
               files[2].path.c_str());
  return 0;
}

// kvevict-run --batch N: sequence i's prompt is the i-th of --prompt, --batch-prompt ... (cycled),
// all run as one batch (batch.hpp); prints each sequence's output on its own line(s), in order.
// --batch-bench: the batch run batched and one forward at a time, alternating, timed.
int run_batch(const options& o, const kvrun::model& model, const kvrun::tokenizer& tok, const std::vector<int>& first,
              const kvrun::duo_heads* duo, const kvrun::lookahead_module* lookahead) {
  const kvrun::config& c = model.cfg();
  std::vector<std::vector<int>> given{first}, prompts;
  for (const std::string& text : o.batch_prompts) {
    given.emplace_back();
    if (const int code = encode_prompt(o, tok, c, text, "a --batch-prompt", given.back()); code != 0) return code;
  }
  for (kvevict::index_t i = 0; i < o.batch; ++i) prompts.push_back(given[static_cast<std::size_t>(i) % given.size()]);
  const kvevict::index_t slots = o.batch_slots > 0 ? o.batch_slots : o.batch;
  // lookaheadkv's scorers and laq's query sources: one per slot
  std::vector<kvrun::lookahead_scorer> scorers(o.evict.recipe == kvrun::method::lookaheadkv ? static_cast<std::size_t>(slots) : 0);
  std::vector<kvrun::laq_queries> laq(static_cast<std::size_t>(slots));
  kvrun::batch_options bs;
  bs.steps = o.steps;
  bs.page_size = o.page_size;
  bs.temperature = o.temperature;
  bs.topp = o.topp;
  bs.seed = o.seed;
  bs.threads = o.threads;
  bs.evict = o.evict;
  bs.duo = duo;
  bs.slots = slots;
  for (kvrun::lookahead_scorer& s : scorers) {
    if (auto st = s.init(model, *lookahead); !st.ok()) return fail("", st);
    bs.scorers.push_back(&s);
  }
  for (kvrun::laq_queries& q : laq) bs.queries.push_back(&q);
  std::vector<std::vector<int>> out;
  kvrun::batch_stats stats;
  if (o.batch_bench) {  // alternating, best of 3 each; the tokens must not change
    double best[2] = {1e300, 1e300}, fwd[2] = {1e300, 1e300};
    std::vector<std::vector<int>> ref;
    for (int rep = 0; rep < 6; ++rep) {
      bs.batched = rep % 2 == 1;
      const auto t0 = std::chrono::steady_clock::now();
      if (auto st = kvrun::run_batch(model, prompts, bs, out, stats); !st.ok()) return fail("", st);
      const double s = kvrun::seconds_since(t0);
      best[rep % 2] = std::min(best[rep % 2], s);
      fwd[rep % 2] = std::min(fwd[rep % 2], stats.schedule.forward_seconds);
      if (rep == 0) ref = out;
      if (out != ref) return fail("batch bench: the batched forward's tokens differ from the one-at-a-time run's");
    }
    const double rows = static_cast<double>(stats.schedule.rows);
    std::fprintf(stderr,
                 "batch bench: %lld sequences, %lld slots, %lld steps, %lld rows (prompts and decoded tokens); best of 3: "
                 "one forward at a time %.0f tok/s (steps' forwards %.0f tok/s), batched forward %.0f tok/s (%.0f tok/s): "
                 "x%.2f (x%.2f); tokens equal\n",
                 static_cast<long long>(o.batch), static_cast<long long>(slots), static_cast<long long>(stats.steps),
                 static_cast<long long>(stats.schedule.rows), rows / best[0], rows / fwd[0], rows / best[1], rows / fwd[1],
                 best[0] / best[1], fwd[0] / fwd[1]);
  } else if (auto st = kvrun::run_batch(model, prompts, bs, out, stats); !st.ok()) {
    return fail("", st);
  }
  for (std::size_t s = 0; s < prompts.size(); ++s)
    if (const int code = print_output(o, tok, prompts[s], out[s]); code != 0) return code;
  if (o.stats)
    std::fprintf(stderr,
                 "batch: %lld sequences in %lld steps (%lld with a prefill beside decodes, %lld rows in %lld forwards), "
                 "pages: peak %lld held by the batch, %lld freed by eviction, %lld released by finished sequences, "
                 "%lld in use after the batch (%lld tokens per page, %lld in the shared pools)\n",
                 static_cast<long long>(o.batch), static_cast<long long>(stats.steps),
                 static_cast<long long>(stats.mixed_steps), static_cast<long long>(stats.schedule.rows),
                 static_cast<long long>(stats.schedule.forwards), static_cast<long long>(stats.peak_pages),
                 static_cast<long long>(stats.pages_freed), static_cast<long long>(stats.pages_released),
                 static_cast<long long>(stats.pages_left), static_cast<long long>(o.page_size),
                 static_cast<long long>(stats.pool_pages));
  return 0;
}

int run(int argc, char** argv) {
  options o;
  std::string message;
  if (const int code = kvrun::parse_run_options(argc, argv, o, message); code >= 0) {
    if (code == 0) std::fputs(message.c_str(), stdout);  // --help
    else fail(message);
    return code;
  }
  const kvrun::method method = o.evict.recipe;

  kvrun::model model;
  if (auto st = kvrun::model::load_file(o.model, model); !st.ok()) return fail_file(o.model, st);
  const kvrun::config& c = model.cfg();
  const bool sharded = o.tp > 0 || o.pp > 0;
  if (o.report || o.footprint) {
    std::string command = "kvevict-run";
    for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
    return o.report ? run_report(o, model, command) : run_footprint(o, model, command);
  }
  if (auto st = kvrun::check_evict_options(c, o.evict); !st.ok()) return fail("", st);
  kvrun::tokenizer tok;
  if (auto st = kvrun::tokenizer::load_file(o.tokenizer, c.vocab_size, tok); !st.ok()) return fail_file(o.tokenizer, st);
  if (o.steps < 1 || o.steps > c.seq_len)
    return fail("--steps " + std::to_string(o.steps) + " is outside [1, " + std::to_string(c.seq_len) +
                "] (the model's context)");

  std::vector<int> prompt;
  if (const int code = encode_prompt(o, tok, c, o.prompt, "the prompt", prompt); code != 0) return code;
  // the head types of duo, prulong (a mask file) and duo-heuristic (a calibration)
  const bool full = method == kvrun::method::full;
  kvrun::duo_heads duo;
  if (method == kvrun::method::duo || method == kvrun::method::prulong) {
    if (auto st = kvrun::head_types_from_file(c, o.head_mask, o.head_sparsity, duo); !st.ok())
      return fail_file(o.head_mask, st);
  } else if (!full && kvrun::allocator_of(o.evict) == kvrun::budget_scheme::duo) {
    if (auto st = calibrate_duo(model, o.evict, o.calibration, o.threads, duo); !st.ok()) return fail("duo calibration: ", st);
  }
  if (sharded) return run_sharded(o, model, tok, prompt, duo);

  // The full cache is sized for the prompt and the steps; the evicted one for the whole context:
  // LAQ decodes pseudo tokens past the prompt and the oracle runs the response.
  kvrun::runner run;
  kvrun::kv_cache cache;
  kvrun::sampler sampler;
  if (auto st = run.init(model, {full ? static_cast<kvevict::index_t>(prompt.size()) : 0, full ? o.steps : 0, o.threads});
      !st.ok())
    return fail("", st);
  if (auto st = cache.init(c, full ? o.steps : 0, o.page_size); !st.ok()) return fail("", st);
  if (auto st = sampler.init(c.vocab_size, o.temperature, o.topp, o.seed); !st.ok()) return fail("", st);
  kvrun::lookahead_module lookahead;
  kvrun::lookahead_scorer scorer;  // the lookaheadkv method's scores
  kvrun::laq_queries laq;          // the laq and laq++ methods' query blocks
  kvrun::evictor ev;
  std::vector<kvevict::pos_t> schedule;
  kvevict::eviction_recorder recorder;
  std::vector<int> generated;
  const float* logits = nullptr;  // of the first generated token
  kvrun::decode_step decode;      // evicted: the evictor's decode (decode-time eviction)
  double prefill_s = 0.0;
  if (method == kvrun::method::lookaheadkv) {
    if (!load_lookahead(o.lookahead_module, model, lookahead)) return 1;
    if (auto st = scorer.init(model, lookahead); !st.ok()) return fail("", st);
  }
  if (o.batch > 1) return run_batch(o, model, tok, prompt, &duo, &lookahead);  // batch.hpp
  if (full) {
    const auto t0 = std::chrono::steady_clock::now();
    if (auto st = run.forward(cache, kvrun::tokens(prompt)); !st.ok()) return fail("", st);
    prefill_s = kvrun::seconds_since(t0);
  } else {  // prefill with eviction (evictor.hpp)
    if (auto st = ev.init(model, o.evict, &duo, &scorer, &laq); !st.ok()) return fail("", st);
    std::vector<int> response;  // the oracle's block: the full cache's continuation, same sampler
    if (method == kvrun::method::oracle) {
      kvrun::sampler s0;
      if (auto st = s0.init(c.vocab_size, o.temperature, o.topp, o.seed); !st.ok()) return fail("", st);
      if (auto st = kvrun::generate(run, cache, s0, prompt, o.steps, response); !st.ok()) return fail("", st);
      cache.clear();
      if (response.empty()) return fail("oracle: the full cache generates nothing after this prompt");
    }
    if (method == kvrun::method::speckv) {  // the draft model's response (methods/speckv.hpp)
      kvrun::speckv_drafter drafter;
      if (auto st = drafter.init(model, o.evict.draft_layers); !st.ok()) return fail("", st);
      if (auto st = drafter.draft(prompt, o.evict.draft_tokens, response); !st.ok()) return fail("", st);
    }
    schedule.resize(static_cast<std::size_t>(c.n_layers) * static_cast<std::size_t>(c.n_kv_heads) *
                    static_cast<std::size_t>(o.steps));
    const auto made = kvevict::make_eviction_recorder(schedule.data(), c.n_layers, c.n_kv_heads, o.steps);
    if (!made) return fail("", made.error());
    recorder = *made;
    if (auto st = ev.prefill(run, cache, prompt, &recorder, &response); !st.ok()) return fail("", st);
    prefill_s = ev.prefill_seconds();
    logits = ev.next_logits();
    decode = [&](kvrun::kv_cache& kv, int token) { return ev.decode(run, kv, token); };
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (auto st = kvrun::continue_generation(run, cache, sampler, o.steps, generated, logits, decode); !st.ok())
    return fail("", st);
  const double decode_s = kvrun::seconds_since(t1);
  if (o.stats && !full) {
    const kvevict::index_t n = cache.next_position();
    kvevict::kv_usage usage;
    if (auto sched = recorder.schedule(n); sched) {
      std::vector<unsigned char> wsb(static_cast<std::size_t>(n) * sizeof(std::int64_t) + 64);
      kvevict::workspace ws{wsb.data(), wsb.size()};
      (void)kvevict::measure_kv_usage(ws, *sched, usage);
    }
    std::fprintf(stderr,
                 "eviction: %s, %s driver, budget %lld: %lld KV rows held after the prefill (of %lld); %.3f ms of "
                 "eviction; KV footprint %.3f, peak KV %.3f over %lld tokens\n",
                 o.recipe.c_str(), kvrun::driver_name(o.evict.driver), static_cast<long long>(o.evict.budget),
                 static_cast<long long>(ev.allocation().total),
                 static_cast<long long>(prompt.size()) * c.n_layers * c.n_kv_heads, ev.evict_seconds() * 1e3,
                 usage.footprint(), usage.peak_kv(), static_cast<long long>(n));
  }

  if (const int code = print_output(o, tok, prompt, generated); code != 0) return code;
  if (o.stats) {
    const auto decoded = static_cast<double>(cache.next_position()) - static_cast<double>(prompt.size());
    std::fprintf(stderr, "prefill: %zu tokens in %.3f ms (%.0f tok/s); decode: %.0f tokens in %.3f ms (%.0f tok/s); %d threads\n",
                 prompt.size(), prefill_s * 1e3, static_cast<double>(prompt.size()) / prefill_s, decoded, decode_s * 1e3,
                 decoded > 0 ? decoded / decode_s : 0.0, run.threads());
    std::fprintf(stderr, "pages: %lld in use, peak %lld, %lld freed by eviction (%lld tokens per page, %lld in the pools)\n",
                 static_cast<long long>(cache.pages_in_use()), static_cast<long long>(cache.peak_pages()),
                 static_cast<long long>(cache.pages_freed()), static_cast<long long>(cache.page_size()),
                 static_cast<long long>(cache.total_pages()));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::program::guarded_main("kvevict-run", [&] { return run(argc, argv); });
}
