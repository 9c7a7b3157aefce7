// Arbitrary bytes -> kvevict-run's command-line parsing and checks (examples/run/run_options.hpp, the
// same function the program calls), then the eviction options' check against the stories260K
// model's shape. The input is split at NUL bytes into arguments. Whatever the arguments, the
// parser must return an exit status with a one-line message, or accepted options whose every
// number is in range; nothing may throw or crash.
#include <run/run_options.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"kvevict-run"};
  std::string cur;
  for (std::size_t i = 0; i < size && args.size() < 64; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  if (!cur.empty()) args.push_back(cur);
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  kvrun::run_options o;
  std::string message;
  int code = -1;
  try {
    code = kvrun::parse_run_options(static_cast<int>(argv.size()), argv.data(), o, message);
  } catch (...) {
    std::abort();  // the parser reports everything through its status
  }
  if (code >= 0) {
    if (code != 0 && (message.empty() || code > 2)) std::abort();
    return 0;
  }
  // accepted: the numbers the rest of the program relies on are in range
  const auto& e = o.evict;
  if (o.threads < 0 || o.seed == 0 || o.calibration < 1 || o.prompts < 1 || e.window < 1 || e.budget < 1 ||
      e.chunk < 1 || e.evict_every < 1 || e.laq_steps < 1 || e.duo_recent < 0 || e.sinks < -1 ||
      !(o.temperature >= 0.0f) || !(o.topp >= 0.0f && o.topp <= 1.0f))
    std::abort();
  kvrun::config c;  // stories260K's shape
  c.dim = 64;
  c.hidden_dim = 172;
  c.n_layers = 5;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 512;
  c.seq_len = 512;
  (void)kvrun::check_evict_options(c, o.evict);
  return 0;
}
