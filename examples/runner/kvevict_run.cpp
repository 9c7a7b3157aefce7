// kvevict-run: generate a story with the reference runner (full KV cache), as llama2.c's run.c.
//
//   kvevict-run --prompt "Once upon a time" --steps 256            greedy, prints the text
//   kvevict-run --temperature 1.0 --seed 42 --ids                  sampled, prints token ids
//
// Every error (bad option, missing or malformed model/tokenizer, prompt too long) is one line on
// stderr and exit status 1 (2 for command-line syntax errors).
#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/tokenizer.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#ifndef KVEVICT_SOURCE_DIR
#  define KVEVICT_SOURCE_DIR "."
#endif

namespace {

struct options {
  std::string model = KVEVICT_SOURCE_DIR "/models/stories260K.bin";
  std::string tokenizer = KVEVICT_SOURCE_DIR "/models/tok512.bin";
  std::string prompt = "Once upon a time";
  int steps = 256;
  float temperature = 0.0f;
  float topp = 0.9f;
  std::uint64_t seed = 42;
  int threads = 0;
  bool ids = false;
  bool stats = false;
};

int fail(const char* what, const kvevict::status& st) {
  std::fprintf(stderr, "kvevict-run: %s%s\n", what, st.message());
  return 1;
}
// A file's format errors name the file (open errors already do).
int fail_file(const std::string& path, const kvevict::status& st) {
  if (st.code() == kvevict::errc::io_error) return fail("", st);
  return fail((path + ": ").c_str(), st);
}
int fail(const std::string& message) {
  std::fprintf(stderr, "kvevict-run: %s\n", message.c_str());
  return 1;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  CLI::App app{"kvevict-run: generate text with the kvevict reference runner (llama2.c checkpoints)", "kvevict-run"};
  app.add_option("--model", o.model, "llama2.c checkpoint")->capture_default_str();
  app.add_option("--tokenizer", o.tokenizer, "llama2.c tokenizer (vocabulary size must match the model)")
      ->capture_default_str();
  app.add_option("--prompt", o.prompt, "prompt text (BOS and a dummy-prefix space are added)")->capture_default_str();
  app.add_option("--steps", o.steps, "positions to run, prompt included (run.c's -n); 1..seq_len")
      ->capture_default_str();
  app.add_option("--temperature", o.temperature, "0 = greedy; > 0 samples softmax(logits / temperature)")
      ->capture_default_str();
  app.add_option("--topp", o.topp, "top-p (nucleus) threshold when sampling; 0 or 1 = plain sampling")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "xorshift seed for sampling (nonzero; run.c's -s)")->capture_default_str();
  app.add_option("--threads", o.threads, "OpenMP threads for long blocks (0 = OMP_NUM_THREADS or all cores)")
      ->capture_default_str();
  app.add_flag("--ids", o.ids, "print the token ids of prompt (with BOS) and output on one line instead of text");
  app.add_flag("--stats", o.stats, "print prefill and decode speed on stderr");
  // Eviction options (recipe, budget, driver, chunk size) will join here.
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "kvevict-run: %s (see --help)\n", e.what());
    return 2;
  }

  if (!(o.temperature >= 0.0f) || !std::isfinite(o.temperature))
    return fail("--temperature must be finite and >= 0, got " + std::to_string(o.temperature));
  if (!(o.topp >= 0.0f && o.topp <= 1.0f)) return fail("--topp must be in [0, 1], got " + std::to_string(o.topp));
  if (o.seed == 0) return fail("--seed must be nonzero (the xorshift generator never leaves state 0)");
  if (o.threads < 0) return fail("--threads must be >= 0, got " + std::to_string(o.threads));

  kvrun::model model;
  if (auto st = kvrun::model::load_file(o.model, model); !st.ok()) return fail_file(o.model, st);
  const kvrun::config& c = model.cfg();
  kvrun::tokenizer tok;
  if (auto st = kvrun::tokenizer::load_file(o.tokenizer, c.vocab_size, tok); !st.ok()) return fail_file(o.tokenizer, st);
  if (o.steps < 1 || o.steps > c.seq_len)
    return fail("--steps " + std::to_string(o.steps) + " is outside [1, " + std::to_string(c.seq_len) +
                "] (the model's context)");

  // Each token covers at most longest_piece() bytes (the dummy-prefix space included), so a longer
  // prompt cannot fit; checked before encoding, whose merge loop is quadratic in the prompt length.
  if (o.prompt.size() + 1 > static_cast<std::size_t>(c.seq_len - 1) * static_cast<std::size_t>(tok.longest_piece()))
    return fail("the prompt of " + std::to_string(o.prompt.size()) + " bytes cannot fit in the model's context of " +
                std::to_string(c.seq_len) + " tokens");
  std::vector<int> prompt;
  if (auto st = tok.encode(o.prompt, /*bos=*/true, /*eos=*/false, prompt); !st.ok()) return fail("", st);
  if (static_cast<int>(prompt.size()) > c.seq_len)
    return fail("the prompt has " + std::to_string(prompt.size()) + " tokens, longer than the model's context of " +
                std::to_string(c.seq_len));
  if (static_cast<int>(prompt.size()) > o.steps)
    return fail("the prompt has " + std::to_string(prompt.size()) + " tokens, more than --steps " +
                std::to_string(o.steps) + " (steps count the prompt too)");

  kvrun::runner run;
  kvrun::kv_cache cache;
  kvrun::sampler sampler;
  if (auto st = run.init(model, {/*max_block=*/static_cast<kvevict::index_t>(prompt.size()), /*max_rows=*/o.steps, o.threads});
      !st.ok())
    return fail("", st);
  if (auto st = cache.init(c, o.steps); !st.ok()) return fail("", st);
  if (auto st = sampler.init(c.vocab_size, o.temperature, o.topp, o.seed); !st.ok()) return fail("", st);

  std::vector<int> generated;
  const auto t0 = std::chrono::steady_clock::now();
  if (auto st = run.forward(cache, kvrun::tokens(prompt)); !st.ok()) return fail("", st);
  const double prefill_s = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  if (auto st = kvrun::continue_generation(run, cache, sampler, o.steps, generated); !st.ok()) return fail("", st);
  const double decode_s = seconds_since(t1);

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
  if (o.stats) {
    const auto decoded = static_cast<double>(cache.next_position()) - static_cast<double>(prompt.size());
    std::fprintf(stderr, "prefill: %zu tokens in %.3f ms (%.0f tok/s); decode: %.0f tokens in %.3f ms (%.0f tok/s); %d threads\n",
                 prompt.size(), prefill_s * 1e3, static_cast<double>(prompt.size()) / prefill_s, decoded, decode_s * 1e3,
                 decoded > 0 ? decoded / decode_s : 0.0, run.threads());
  }
  return 0;
}
