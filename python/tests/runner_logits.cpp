// python/tests/runner_logits.cpp: the C++ reference runner's logits, for the parity test of the
// pure-PyTorch model (python/kvevict/reference.py). A test helper, not a tool:
//   kvevict_runner_logits <model> <tokenizer> <prompt> <steps> <out.f32>
// encodes the prompt (BOS + run.c's encoding), prefills it with the logits of every row, then
// decodes greedily until `steps` positions; writes every logits row (prompt rows, then one per
// decoded token) as raw little-endian float32 to out.f32 and prints the ids (prompt, then
// generated) on one line.
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/tokenizer.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {
int fail(const kvevict::status& st) {
  std::fprintf(stderr, "kvevict_runner_logits: %s\n", st.message());
  return 1;
}
int argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: kvevict_runner_logits <model> <tokenizer> <prompt> <steps> <out.f32>\n");
    return 2;
  }
  kvrun::model m;
  if (auto st = kvrun::model::load_file(argv[1], m); !st.ok()) return fail(st);
  const int vocab = m.cfg().vocab_size;
  kvrun::tokenizer tok;
  if (auto st = kvrun::tokenizer::load_file(argv[2], vocab, tok); !st.ok()) return fail(st);
  std::vector<int> ids;
  if (auto st = tok.encode(argv[3], true, false, ids); !st.ok()) return fail(st);
  const long steps = std::strtol(argv[4], nullptr, 10);
  kvrun::runner run;
  if (auto st = run.init(m); !st.ok()) return fail(st);
  kvrun::kv_cache cache;
  if (auto st = cache.init(m.cfg()); !st.ok()) return fail(st);
  std::FILE* out = std::fopen(argv[5], "wb");
  if (out == nullptr) return 1;
  if (auto st = run.forward(cache, kvrun::tokens(ids), kvrun::logits_mode::all); !st.ok()) return fail(st);
  const auto n = static_cast<long>(ids.size());
  std::fwrite(run.logits(0), sizeof(float), static_cast<std::size_t>(n * vocab), out);
  int next = argmax(run.logits(n - 1), vocab);
  for (long pos = n; pos < steps; ++pos) {
    ids.push_back(next);
    if (auto st = run.decode(cache, next); !st.ok()) return fail(st);
    std::fwrite(run.logits(0), sizeof(float), static_cast<std::size_t>(vocab), out);
    next = argmax(run.logits(0), vocab);
  }
  std::fclose(out);
  for (std::size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
  std::printf("\n");
  return 0;
}
