// Arbitrary bytes -> the checkpoint loader (in memory). A rejected input must come back as a
// status; an accepted one must load without allocating more than its size justifies (the
// loader checks the header against the size before allocating) and run a two-token forward
// pass without crashing, whatever its weights are (NaN and infinities included).
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvrun::model m;
  if (!kvrun::model::load(data, size, m).ok()) return 0;
  const kvrun::config& c = m.cfg();
  const kvevict::index_t n = std::min(2, c.seq_len);
  kvrun::runner r;
  kvrun::kv_cache cache;
  if (!r.init(m, {n, n, 1}).ok() || !cache.init(c, n).ok()) std::abort();
  const int ids[2] = {0, c.vocab_size - 1};
  if (!r.forward(cache, kvrun::tokens(ids, n), kvrun::logits_mode::all).ok()) std::abort();
  if (r.logits_rows() != n || cache.next_position() != n) std::abort();
  return 0;
}
