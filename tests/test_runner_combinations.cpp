// Every recipe x allocator x driver combination the runner supports (check_evict_options accepts
// it), at every budget from 1 to above the prompt's length, on a tiny prompt: prefill and decode
// must succeed (issue 17: `--recipe adakv --driver decode --budget 32` on a 10-token prompt failed
// because the decode driver's capacity assumed every head stays at the per-head budget). After
// each eviction no head may hold more than the prompt plus the decoded tokens, and every decoded
// step must give finite logits.
#include "support.hpp"
#include "support/shipped.hpp"

#include <batch/batch.hpp>
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

// Continuous batching (batch/batch.hpp): four prompts of different lengths on two slots (a sequence
// joins when one leaves), one batched forward per step, every recipe with every driver it supports
// (its own allocator) and every allocator under snapkv with the layer-wise and chunked-patched
// drivers: each
// sequence's greedy tokens equal its prompt's run alone, bit for bit; some step had a sequence
// prefilling (a chunk, under the chunked drivers) beside a decoding one; the pages freed by
// eviction and released at the end equal the single runs' on pools of the same page size, and
// none is left taken.
TEST_CASE("a batch of sequences at different stages gives each prompt's tokens run alone, every recipe and driver") {
  const model& mdl = kvtest::shipped_model();
  const config& c = mdl.cfg();
  lookahead_module module;
  REQUIRE(load_module(KVEVICT_SOURCE_DIR "/models/lookahead/stories260K-n16.bin", module).ok());
  std::vector<lookahead_scorer> scorers(2);
  for (lookahead_scorer& s : scorers) REQUIRE(s.init(mdl, module).ok());
  std::vector<laq_queries> laq(2);
  duo_heads duo;
  REQUIRE(duo_calibrate(mdl, {encode("Lily and Ben went to the park. They saw a big dog. The dog was friendly and wanted to play.")},
                        {}, duo)
              .ok());
  const std::vector<std::vector<int>> prompts = {
      encode("Lily and Ben went to the park. They saw a big dog. The dog was friendly."),
      encode("Once upon a time there was a big dog"), encode("Tom had a big red truck and a ball"),
      encode("The sun was shining and the birds sang in the tall trees by the river")};
  const index_t steps = 36, page = 5;
  runner run;
  REQUIRE(run.init(mdl, {0, 0, 1}).ok());
  int combos = 0;
  index_t mixed = 0;
  for (const auto& [m, m_name] : method_names)
    for (const auto& [a, a_name] : allocator_names)
      for (const auto& [d, d_name] : driver_names) {
        // every recipe with its own allocator, every allocator under snapkv with the layer-wise (the
        // cascade for lava / cake) and chunked-patched drivers
        const bool sampled = a == default_allocator(m) ||
                             (m == method::snapkv && (d == driver_kind::layerwise || d == driver_kind::chunked_patched));
        evict_options o;
        o.recipe = m;
        o.alloc = a;
        o.driver = d;
        o.budget = 12;
        o.chunk = 5;
        o.laq_steps = 4;
        o.draft_tokens = 4;
        if (!sampled || !check_evict_options(c, o).ok()) continue;
        const std::string name = std::string(m_name) + " / " + a_name + " / " + d_name;
        CAPTURE(name);
        ++combos;
        // each prompt alone (kvevict-run's single path), on a private pool of the batch's page size
        std::vector<std::vector<int>> alone(prompts.size());
        index_t freed = 0, held = 0;
        for (std::size_t i = 0; i < prompts.size(); ++i) {
          kv_cache cache;
          REQUIRE(cache.init(c, m == method::full ? steps : 0, page).ok());
          sampler s;
          REQUIRE(s.init(c.vocab_size, 0.0f, 0.9f, 42).ok());
          evictor ev;
          if (m == method::full) {
            REQUIRE(generate(run, cache, s, prompts[i], steps, alone[i]).ok());
          } else {
            REQUIRE(ev.init(mdl, o, &duo, &scorers[0], &laq[0]).ok());
            std::vector<int> response;
            if (m == method::oracle) {
              sampler s0;
              REQUIRE(s0.init(c.vocab_size, 0.0f, 0.9f, 42).ok());
              REQUIRE(generate(run, cache, s0, prompts[i], steps, response).ok());
              cache.clear();
            } else if (m == method::speckv) {
              speckv_drafter drafter;
              REQUIRE(drafter.init(mdl, o.draft_layers).ok());
              REQUIRE(drafter.draft(prompts[i], o.draft_tokens, response).ok());
            }
            const status st = ev.prefill(run, cache, prompts[i], nullptr, &response);
            REQUIRE_MESSAGE(st.ok(), st.message());
            REQUIRE(continue_generation(run, cache, s, steps, alone[i], ev.next_logits(),
                                        [&](kv_cache& cc, int t) { return ev.decode(run, cc, t); })
                        .ok());
          }
          freed += cache.pages_freed();
          held += cache.pages_in_use();
        }
        batch_options bs;
        bs.steps = steps;
        bs.page_size = page;
        bs.threads = 1;
        bs.evict = o;
        bs.duo = &duo;
        bs.scorers = {&scorers[0], &scorers[1]};
        bs.queries = {&laq[0], &laq[1]};
        bs.slots = 2;
        std::vector<std::vector<int>> out;
        batch_stats stats;
        const status st = run_batch(mdl, prompts, bs, out, stats);
        REQUIRE_MESSAGE(st.ok(), st.message());
        CHECK(out == alone);
        CHECK(stats.mixed_steps >= 1);
        CHECK(stats.schedule.forwards == stats.steps);  // one batched forward per step
        CHECK(stats.pages_freed == freed);
        CHECK(stats.pages_released == held);
        CHECK(stats.pages_left == 0);
        mixed += stats.mixed_steps;
      }
  MESSAGE("batched combinations: " << combos << ", steps mixing a prefill and a decode: " << mixed);
  CHECK(combos > 50);
}
