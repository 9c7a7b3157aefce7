// Parity of the reference runner with llama2.c's run.c on the shipped stories260K model: full
// KV cache, greedy and sampled generation, token for token. The expected ids were produced by
// run.c itself (see docs/runner.md, "Parity"), not by this runner.
#include "support.hpp"
#include "support/shipped.hpp"

#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/tokenizer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

using namespace kvrun;

namespace {

// run.c (karpathy/llama2.c bd182289, gcc -O3), stories260K.bin + tok512.bin, -n 256:
// the prompt's tokens (BOS first) followed by the generated ones.
//   once_greedy:            -t 0 -i "Once upon a time"
//   lily_greedy:            -t 0 -i "Lily and Ben went to the park"
//   once_sampled_t1_seed42: -t 1.0 -p 0.9 -s 42 -i "Once upon a time"
const std::vector<int> once_greedy = {
    1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
    410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266,
    268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415, 426, 13,
    438, 310, 439, 419, 357, 336, 432, 313, 438, 310, 432, 278, 316, 439, 419, 298, 414, 267, 265, 282, 295,
    433, 426, 436, 317, 286, 296, 418, 269, 279, 292, 416, 439, 413, 409, 416, 327, 263, 415, 294, 267, 400,
    426, 338, 336, 432, 313, 442, 391, 267, 337, 335, 364, 420, 268, 388, 432, 398, 359, 280, 303, 439, 413,
    272, 417, 264, 312, 426, 436, 13, 438, 310, 286, 296, 418, 269, 279, 292, 416, 439, 413, 409, 416, 327,
    263, 415, 294, 267, 400, 426, 338, 336, 432, 313, 442, 439, 423, 262, 304, 420, 422, 432, 317, 426, 359,
    279, 292, 416, 439, 413, 409, 416, 327, 263, 415, 294, 267, 400, 426, 436, 13, 438, 310, 279, 292, 416,
    439, 413, 391, 267, 281, 421, 427, 311, 357, 432, 384, 358, 336, 432, 313, 442, 439, 423, 262, 304, 420,
    422, 432, 357, 426, 359, 279, 292, 416, 439, 413, 409, 416, 327, 263, 415, 294, 267, 400, 426, 436, 320,
    285, 357, 336, 432, 313, 455, 289, 439, 413, 263, 304, 420, 422, 432, 317, 426, 410, 448, 411, 280, 303,
    281, 421, 427, 364, 426};
const std::vector<int> lily_greedy = {
    1, 317, 269, 368, 302, 263, 377, 267, 265, 282, 295, 433, 426, 342, 394, 261, 370, 268, 414, 444, 335,
    261, 370, 268, 414, 444, 426, 342, 391, 266, 267, 337, 335, 312, 426, 342, 391, 266, 267, 337, 335, 265,
    268, 414, 444, 426, 342, 391, 266, 267, 337, 335, 265, 268, 414, 444, 426, 13, 436, 438, 347, 433, 432,
    368, 302, 432, 359, 272, 277, 264, 261, 268, 414, 444, 426, 359, 413, 410, 293, 261, 370, 268, 414, 444,
    426, 436, 317, 336, 426, 13, 436, 441, 462, 432, 312, 410, 293, 297, 309, 261, 268, 414, 444, 426, 359,
    413, 410, 293, 261, 268, 414, 444, 426, 359, 413, 410, 293, 261, 268, 414, 444, 426, 359, 413, 410, 293,
    297, 309, 261, 268, 414, 444, 426, 359, 413, 410, 293, 297, 309, 261, 268, 414, 444, 426, 359, 413, 410,
    293, 297, 309, 261, 268, 414, 444, 426, 359, 413, 410, 293, 297, 309, 261, 268, 414, 422, 426, 359, 413,
    410, 293, 297, 309, 261, 268, 414, 422, 426, 359, 413, 410, 293, 297, 309, 261, 268, 414, 422, 426, 359,
    413, 410, 293, 297, 309, 261, 268, 414, 422, 426, 359, 413, 410, 293, 297, 309, 261, 268, 414, 422, 426,
    359, 413, 410, 293, 297, 309, 261, 268, 414, 422, 426, 359, 413, 410, 293, 297, 309, 261, 268, 414, 422,
    426, 359, 413, 410, 293, 297, 309, 261, 268, 414, 422, 426, 359, 413, 410, 293, 297, 309, 261, 268, 414,
    422, 426, 359, 413, 410};
const std::vector<int> once_sampled_t1_seed42 = {
    1, 403, 407, 261, 378, 432, 383, 286, 261, 268, 420, 412, 360, 376, 268, 414, 422, 395, 326, 426, 326,
    401, 396, 267, 337, 335, 345, 267, 422, 419, 269, 284, 412, 354, 268, 421, 414, 340, 419, 426, 385, 328,
    432, 326, 263, 377, 267, 265, 284, 315, 420, 304, 269, 394, 345, 279, 380, 426, 291, 284, 303, 336, 432,
    313, 438, 347, 433, 432, 326, 432, 351, 439, 419, 297, 309, 268, 412, 341, 426, 410, 448, 411, 300, 360,
    267, 337, 335, 312, 426, 436, 13, 434, 288, 272, 411, 421, 413, 399, 393, 426, 346, 282, 417, 340, 266,
    312, 350, 269, 349, 295, 413, 266, 267, 268, 412, 421, 303, 331, 265, 284, 303, 432, 398, 265, 284, 412,
    428, 417, 429, 282, 276, 413, 413, 422, 278, 412, 425, 264, 420, 422, 443, 326, 439, 419, 357, 280, 314,
    411, 410, 408, 419, 292, 411, 269, 336, 432, 313, 448, 327, 432, 326, 443, 359, 272, 277, 264, 284, 422,
    279, 276, 419, 419, 426, 359, 413, 439, 419, 261, 399, 282, 276, 413, 413, 422, 279, 276, 419, 419, 426,
    436, 13, 434, 288, 336, 432, 313, 452, 406, 432, 278, 316, 439, 419, 298, 414, 443, 436, 326, 269, 345,
    279, 276, 314, 298, 377, 421, 422, 308, 277, 428, 415, 413, 261, 430, 408, 312, 432, 269, 366, 268, 309,
    415, 261, 413, 411, 265, 423, 344, 363, 328, 426, 326, 337, 266, 335, 345, 279, 276, 314, 432, 269, 366,
    329, 429, 314, 411, 329};

const tokenizer& tok512() {
  static tokenizer t;
  static const bool loaded = [] {
    const status st = tokenizer::load_file(KVEVICT_SOURCE_DIR "/models/tok512.bin", 512, t);
    REQUIRE_MESSAGE(st.ok(), st.message());
    return true;
  }();
  (void)loaded;
  return t;
}

// Generates like `kvevict-run`: encode, prefill, decode to `steps` positions; returns prompt + output.
std::vector<int> run_like_cli(const std::string& prompt_text, float temperature, std::uint64_t seed, int threads,
                              index_t steps = 256) {
  const model& m = kvtest::shipped_model();
  std::vector<int> prompt;
  REQUIRE(tok512().encode(prompt_text, true, false, prompt).ok());
  runner r;
  REQUIRE(r.init(m, {0, 0, threads}).ok());
  kv_cache cache;
  REQUIRE(cache.init(m.cfg()).ok());
  sampler s;
  REQUIRE(s.init(m.cfg().vocab_size, temperature, 0.9f, seed).ok());
  std::vector<int> out;
  const status st = generate(r, cache, s, prompt, steps, out);
  REQUIRE_MESSAGE(st.ok(), st.message());
  std::vector<int> all = prompt;
  all.insert(all.end(), out.begin(), out.end());
  return all;
}

}  // namespace

TEST_CASE("the shipped model and tokenizer load with the documented shapes") {
  const config& c = kvtest::shipped_model().cfg();
  CHECK(c.dim == 64);
  CHECK(c.hidden_dim == 172);
  CHECK(c.n_layers == 5);
  CHECK(c.n_heads == 8);
  CHECK(c.n_kv_heads == 4);
  CHECK(c.vocab_size == 512);
  CHECK(c.seq_len == 512);
  CHECK(c.shared_classifier);
  CHECK(c.head_size() == 8);
  CHECK(c.group_size() == 2);
  CHECK(tok512().vocab_size() == 512);
  CHECK(tok512().max_token_length() == 7);
}

TEST_CASE("greedy decoding matches run.c token for token") {
  for (const int threads : {1, 2}) {
    CAPTURE(threads);
    CHECK(run_like_cli("Once upon a time", 0.0f, 42, threads) == once_greedy);
    CHECK(run_like_cli("Lily and Ben went to the park", 0.0f, 42, threads) == lily_greedy);
  }
  // the text models/README.md quotes
  std::string text;
  REQUIRE(detokenize(tok512(), once_greedy, text).ok());
  CHECK(text.rfind("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One "
                   "day, she saw a big, red ball. She wanted to play with it, but it was too high.",
                   0) == 0);
}

TEST_CASE("temperature 1.0, top-p 0.9, seed 42 samples run.c's tokens") {
  CHECK(run_like_cli("Once upon a time", 1.0f, 42, 1) == once_sampled_t1_seed42);
  CHECK(run_like_cli("Once upon a time", 1.0f, 42, 2) == once_sampled_t1_seed42);
}

TEST_CASE("fewer steps stop at the same prefix, as run.c's -n does") {
  for (const index_t steps : {5, 6, 40}) {
    CAPTURE(steps);
    const auto got = run_like_cli("Once upon a time", 0.0f, 42, 1, steps);
    REQUIRE(got.size() == static_cast<std::size_t>(steps) + 1);
    CHECK(std::equal(got.begin(), got.end(), once_greedy.begin()));
  }
}

TEST_CASE("the xorshift generator is run.c's") {
  // first values of run.c's random_u32() / random_f32() with rng_seed = 42
  sampler s;
  REQUIRE(s.init(4, 1.0f, 0.9f, 42).ok());
  const std::uint32_t expected[] = {1456360119u, 3359763283u, 3393612768u, 4054632243u, 3283045847u};
  for (const std::uint32_t e : expected) CHECK(s.random_u32() == e);
  REQUIRE(s.init(4, 1.0f, 0.9f, 42).ok());
  CHECK(s.random_f32() == 0.339085221f);
  CHECK(s.random_f32() == 0.782255828f);
  CHECK(s.random_f32() == 0.790136993f);
}

namespace {

// Top-p sampling written for clarity: probabilities in descending order (ties: lower index
// first), the shortest prefix whose running sum exceeds topp (all of them if none does), then
// the first token whose running sum exceeds coin * (that prefix's sum). topp <= 0 or >= 1: all
// tokens in index order, threshold coin.
int naive_sample(std::vector<float> logits, float temperature, float topp, float coin) {
  for (float& l : logits) l /= temperature;
  kvrun::detail::softmax(logits.data(), static_cast<index_t>(logits.size()));
  std::vector<int> order(logits.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  float threshold = coin;
  std::size_t keep = order.size();
  if (topp > 0.0f && topp < 1.0f) {
    const float cutoff = (1.0f - topp) / static_cast<float>(logits.size() - 1);
    std::vector<int> candidates;
    for (const int i : order)
      if (logits[static_cast<std::size_t>(i)] >= cutoff) candidates.push_back(i);
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](int a, int b) { return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)]; });
    if (candidates.empty()) return sampler::argmax(logits.data(), static_cast<int>(logits.size()));  // nothing reaches the cutoff
    order = candidates;
    float sum = 0.0f;
    keep = order.size();
    for (std::size_t i = 0; i < order.size(); ++i) {
      sum += logits[static_cast<std::size_t>(order[i])];
      if (sum > topp) {
        keep = i + 1;
        break;
      }
    }
    threshold = coin * sum;
  }
  float cdf = 0.0f;
  for (std::size_t i = 0; i < keep; ++i) {
    cdf += logits[static_cast<std::size_t>(order[i])];
    if (threshold < cdf) return order[i];
  }
  return order[keep - 1];
}

}  // namespace

TEST_CASE("sampler: greedy is the first maximum and draws no random number") {
  sampler s;
  REQUIRE(s.init(5, 0.0f, 0.9f, 7).ok());
  const float logits[] = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  CHECK(s.sample(logits) == 1);
  CHECK(s.state() == 7);
  const float with_nan[] = {0.5f, std::nanf(""), 3.0f, 1.0f, 3.0f};
  CHECK(s.sample(with_nan) == 2);
}

TEST_CASE("sampler: multinomial and top-p sampling against a naive reference") {
  auto g = kvtest::rng(2024);
  const float topps[] = {0.0f, 1.0f, 0.5f, 0.9f, 0.99f, 0.2f};
  for (int trial = 0; trial < 300; ++trial) {
    const int vocab = static_cast<int>(kvtest::uniform_int(g, 2, 60));
    const float temperature = trial % 3 == 0 ? 0.5f : trial % 3 == 1 ? 1.0f : 1.7f;
    const float topp = topps[trial % 6];
    const auto seed = static_cast<std::uint64_t>(kvtest::uniform_int(g, 1, 1 << 30));
    std::vector<float> logits = kvtest::random_floats(g, static_cast<std::size_t>(vocab), -4.0f, 4.0f);
    if (trial % 5 == 0) logits[1] = logits[0];  // a tie
    CAPTURE(trial);
    sampler s, coin_source;
    REQUIRE(s.init(vocab, temperature, topp, seed).ok());
    REQUIRE(coin_source.init(vocab, temperature, topp, seed).ok());
    for (int draw = 0; draw < 4; ++draw) {
      const float coin = coin_source.random_f32();
      CHECK(s.sample(logits.data()) == naive_sample(logits, temperature, topp, coin));
    }
  }
}

TEST_CASE("sampler: top-p keeps equal probabilities in index order and falls back to argmax") {
  // uniform probabilities: with topp = 0.5 the first half (by index) is the nucleus
  const std::vector<float> flat(10, 0.0f);
  sampler s, coins;
  REQUIRE(s.init(10, 1.0f, 0.5f, 99).ok());
  REQUIRE(coins.init(10, 1.0f, 0.5f, 99).ok());
  for (int draw = 0; draw < 50; ++draw) {
    const float coin = coins.random_f32();
    const int got = s.sample(flat.data());
    CHECK(got < 6);  // the running sum of 0.1s first exceeds 0.5 at the 6th token
    CHECK(got == naive_sample(flat, 1.0f, 0.5f, coin));
  }
  // topp below 1 / vocab with equal logits: no probability reaches the cutoff -> argmax (token 0)
  REQUIRE(s.init(10, 1.0f, 0.01f, 5).ok());
  CHECK(s.sample(flat.data()) == 0);
}

TEST_CASE("sampler: init errors") {
  sampler s;
  kvtest::require_error(s.init(0, 1.0f, 0.9f, 1), errc::invalid_argument, "vocab_size must be positive (got 0)");
  kvtest::require_error(s.init(4, -0.5f, 0.9f, 1), errc::invalid_argument, "temperature must be finite and >= 0");
  kvtest::require_error(s.init(4, std::nanf(""), 0.9f, 1), errc::invalid_argument, "temperature must be finite");
  kvtest::require_error(s.init(4, INFINITY, 0.9f, 1), errc::invalid_argument, "temperature must be finite");
  kvtest::require_error(s.init(4, 1.0f, std::nanf(""), 1), errc::invalid_argument, "topp is NaN");
  kvtest::require_error(s.init(4, 1.0f, 0.9f, 0), errc::invalid_argument, "seed must be nonzero");
}
