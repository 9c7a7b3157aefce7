// Every recipe x allocator x driver combination the runner supports (check_evict_options accepts
// it), at every budget from 1 to above the prompt's length, on a tiny prompt: prefill and decode
// must succeed (issue 17: `--recipe adakv --driver decode --budget 32` on a 10-token prompt failed
// because the decode driver's capacity assumed every head stays at the per-head budget). After
// each eviction no head may hold more than the prompt plus the decoded tokens, and every decoded
// step must give finite logits.
#include "support.hpp"
#include "support/shipped.hpp"

#include <methods/duo_calibration.hpp>
#include <methods/laq.hpp>
#include <runner/evictor.hpp>
#include <runner/tokenizer.hpp>
#include <lookaheadkv/module.hpp>
#include <lookaheadkv/scores.hpp>

#include <cmath>
#include <string>
#include <vector>

using namespace kvrun;

namespace {

std::vector<int> encode(const char* text) {
  tokenizer tok;
  const status st = tokenizer::load_file(KVEVICT_SOURCE_DIR "/models/tok512.bin", kvtest::shipped_model().cfg().vocab_size, tok);
  REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
  std::vector<int> ids;
  REQUIRE(tok.encode(text, true, false, ids).ok());
  return ids;
}

}  // namespace

TEST_CASE("every supported recipe x allocator x driver runs at every budget from 1 to above the prompt") {
  const config& c = kvtest::shipped_model().cfg();
  lookahead_module module;
  REQUIRE(load_module(KVEVICT_SOURCE_DIR "/models/lookahead/stories260K-n16.bin", module).ok());
  lookahead_scorer scorer;
  REQUIRE(scorer.init(kvtest::shipped_model(), module).ok());
  const std::vector<int> prompt = encode("Once upon a time there was a big dog");
  const index_t P = static_cast<index_t>(prompt.size());
  REQUIRE(P > 8);  // longer than the default window
  const std::vector<int> response = {403, 407, 261, 378};  // the oracle's query block; also decoded
  // duo's head types from a tiny calibration (one text longer than its sinks + recent window)
  duo_heads duo;
  const status cal = duo_calibrate(
      kvtest::shipped_model(), {encode("Lily and Ben went to the park. They saw a big dog. The dog was friendly and wanted to play.")},
      {}, duo);
  REQUIRE_MESSAGE(cal.ok(), cal.message());
  runner run;
  REQUIRE(run.init(kvtest::shipped_model(), {0, 0, 1}).ok());

  int combos = 0, runs = 0;
  for (const auto& [m, m_name] : method_names)
    for (const auto& [a, a_name] : allocator_names)
      for (const auto& [d, d_name] : driver_names) {
        evict_options o;
        o.recipe = m;
        o.alloc = a;
        o.driver = d;
        o.chunk = 4;  // several chunks over the tiny prompt
        bool any = false;
        for (index_t B = 1; B <= P + 2; ++B) {
          o.budget = B;
          if (!check_evict_options(c, o).ok()) continue;  // unsupported, or B below the protection
          any = true;
          const std::string name = std::string(m_name) + " / " + a_name + " / " + d_name +
                                   " / budget " + std::to_string(B);
          CAPTURE(name);
          evictor ev;
          laq_queries laq;
          status st = ev.init(kvtest::shipped_model(), o, &duo, &scorer, &laq);
          REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
          kv_cache cache;
          REQUIRE(cache.init(c).ok());
          st = ev.prefill(run, cache, prompt, nullptr, &response);
          CHECK_MESSAGE(st.ok(), std::string(st.message()));
          if (!st.ok()) continue;
          bool finite = true;
          for (std::size_t t = 0; t < response.size(); ++t) {
            st = ev.decode(run, cache, response[t]);
            CHECK_MESSAGE(st.ok(), std::string(st.message()));
            if (!st.ok()) break;
            for (int v = 0; v < c.vocab_size; ++v) finite = finite && std::isfinite(run.logits(0)[v]);
            for (int l = 0; l < c.n_layers; ++l)
              for (index_t h = 0; h < c.n_kv_heads; ++h)
                CHECK(cache.length(l, h) <= P + static_cast<index_t>(t) + 1);
          }
          CHECK(finite);
          ++runs;
        }
        combos += any;
      }
  MESSAGE("supported combinations: " << combos << ", runs: " << runs);
  CHECK(combos > 100);
}
