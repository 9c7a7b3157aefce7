// The reference runner's tokenizer: run.c's encodings of known prompts, the merge loop against a
// naive run.c-style re-implementation on synthetic vocabularies, round trips, decoding, and every
// loader / encoder error.
#include "support.hpp"

#include <runner/generate.hpp>
#include <runner/tokenizer.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace kvrun;
using kvtest::require_error;

namespace {

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

std::vector<int> encode(const tokenizer& t, const std::string& text, bool bos = true, bool eos = false) {
  std::vector<int> ids;
  const status st = t.encode(text, bos, eos, ids);
  REQUIRE_MESSAGE(st.ok(), st.message());
  return ids;
}

// The bytes of every token after the first, decoded after its predecessor (no printable filter).
std::string decode_all(const tokenizer& t, const std::vector<int>& ids) {
  std::string s;
  for (std::size_t i = 1; i < ids.size(); ++i) {
    const auto piece = t.decode(ids[i - 1], ids[i]);
    REQUIRE(piece.ok());
    s.append(piece->data(), piece->size());
  }
  return s;
}

// A tokenizer file: int32 max_len, then (float score, int32 len, bytes) per token.
struct token_spec {
  float score;
  std::string bytes;
};
std::vector<unsigned char> tokenizer_bytes(std::int32_t max_len, const std::vector<token_spec>& tokens) {
  std::vector<unsigned char> b(4);
  std::memcpy(b.data(), &max_len, 4);
  for (const auto& t : tokens) {
    const auto len = static_cast<std::int32_t>(t.bytes.size());
    const std::size_t off = b.size();
    b.resize(off + 8 + t.bytes.size());
    std::memcpy(b.data() + off, &t.score, 4);
    std::memcpy(b.data() + off + 4, &len, 4);
    std::memcpy(b.data() + off + 8, t.bytes.data(), t.bytes.size());
  }
  return b;
}

// A sentencepiece-like vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then `extra`.
std::vector<token_spec> base_vocab(const std::vector<token_spec>& extra) {
  std::vector<token_spec> v = {{0, "<unk>"}, {0, "\n<s>\n"}, {0, "\n</s>\n"}};
  char buf[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    v.push_back({0, buf});
  }
  v.insert(v.end(), extra.begin(), extra.end());
  return v;
}

tokenizer load_vocab(const std::vector<token_spec>& vocab, std::int32_t max_len = 16) {
  const auto bytes = tokenizer_bytes(max_len, vocab);
  tokenizer t;
  const status st = tokenizer::load(bytes.data(), bytes.size(), static_cast<int>(vocab.size()), t);
  REQUIRE_MESSAGE(st.ok(), st.message());
  return t;
}

// run.c's encoder written naively: linear-search lookup (first match), every pair looked up again
// on every merge iteration.
std::vector<int> naive_encode(const std::vector<token_spec>& vocab, const std::string& text) {
  auto find = [&](const std::string& s) {
    for (std::size_t i = 0; i < vocab.size(); ++i)
      if (vocab[i].bytes == s) return static_cast<int>(i);
    return -1;
  };
  std::vector<int> t = {1};
  if (!text.empty()) t.push_back(find(" "));
  std::string cp;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c & 0xC0) != 0x80) cp.clear();
    cp.push_back(text[i]);
    if (i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80 && cp.size() < 4) continue;
    const int id = find(cp);
    if (id >= 0) {
      t.push_back(id);
    } else {
      for (const char b : cp) t.push_back(static_cast<unsigned char>(b) + 3);
    }
    cp.clear();
  }
  for (;;) {
    float best = -1e10f;
    int best_id = -1;
    std::size_t best_i = 0;
    for (std::size_t i = 0; i + 1 < t.size(); ++i) {
      const int id = find(vocab[static_cast<std::size_t>(t[i])].bytes + vocab[static_cast<std::size_t>(t[i + 1])].bytes);
      if (id != -1 && vocab[static_cast<std::size_t>(id)].score > best) {
        best = vocab[static_cast<std::size_t>(id)].score;
        best_id = id;
        best_i = i;
      }
    }
    if (best_id == -1) break;
    t[best_i] = best_id;
    t.erase(t.begin() + static_cast<long>(best_i) + 1);
  }
  return t;
}

std::string random_text(std::mt19937_64& g, std::size_t max_len, int kind) {
  static const char* words[] = {"the", " cat", "sat", " on", " a", "mat", ". ", "Lily", " and", " Ben", "\n", "!", "café",
                                "日本", "🙂", "naïve", "  ", "<0x41>", "ab", "ba"};
  std::string s;
  const auto n = static_cast<std::size_t>(kvtest::uniform_int(g, 0, static_cast<std::int64_t>(max_len)));
  while (s.size() < n) {
    if (kind == 0) s += words[kvtest::uniform_int(g, 0, 19)];
    else if (kind == 1) s.push_back(static_cast<char>(kvtest::uniform_int(g, 32, 126)));
    else s.push_back(static_cast<char>(kvtest::uniform_int(g, 1, 255)));  // arbitrary bytes, invalid UTF-8 included
  }
  return s;
}

}  // namespace

TEST_CASE("encodings match run.c's on tok512") {
  // run.c (karpathy/llama2.c bd182289) bpe_encode of each prompt, BOS prepended
  struct known {
    const char* text;
    std::vector<int> ids;
  };
  const known cases[] = {
      {"Once upon a time", {1, 403, 407, 261, 378}},
      {"Lily and Ben went to the park", {1, 317, 269, 368, 302, 263, 377, 267, 265, 282, 295, 433}},
      {"Hello, world!", {1, 346, 306, 414, 432, 263, 304, 341, 443}},
      {"The café served crème brûlée.",
       {1, 291, 280, 412, 431, 485, 262, 285, 396, 280, 420, 198, 171, 423, 411, 268, 420, 198, 190, 421, 485, 411, 426}},
      {"日本語 🙂 naïve",
       {1, 410, 233, 154, 168, 233, 159, 175, 235, 173, 161, 410, 243, 162, 156, 133, 297, 412, 198, 178, 360}},
      {"line one\nline two\ttab", {1, 278, 271, 411, 353, 411, 13, 421, 271, 411, 259, 424, 414, 12, 413, 412, 430}},
      {"   leading spaces", {1, 410, 410, 410, 278, 411, 380, 299, 262, 427, 412, 331, 419}},
      {"<0x41> is not a byte", {1, 410, 504, 477, 444, 484, 475, 505, 410, 293, 297, 309, 261, 268, 422, 413, 411}},
      {"a", {1, 261}},
  };
  for (const auto& k : cases) {
    CAPTURE(std::string(k.text));
    CHECK(encode(tok512(), k.text) == k.ids);
  }
  // run.c master's encode(): an empty text gets no dummy prefix; BOS / EOS are optional
  CHECK(encode(tok512(), "") == std::vector<int>{1});
  CHECK(encode(tok512(), "", false).empty());
  CHECK(encode(tok512(), "a", false, true) == std::vector<int>{261, 2});
}

TEST_CASE("the merge loop equals run.c's naive loop on synthetic vocabularies") {
  auto g = kvtest::rng(31);
  const char* alphabet[] = {" ", "a", "b", "c", "é", "日"};
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    // random single characters and random concatenations with random (often tied) scores
    std::vector<token_spec> extra = {{-1000, " "}, {-1000, "a"}, {-1000, "b"}};
    const int pieces = static_cast<int>(kvtest::uniform_int(g, 5, 40));
    for (int p = 0; p < pieces; ++p) {
      std::string s;
      const int len = static_cast<int>(kvtest::uniform_int(g, 1, 4));
      for (int c = 0; c < len; ++c) s += alphabet[kvtest::uniform_int(g, 0, 5)];
      const float score = trial % 3 == 0 ? float(kvtest::uniform_int(g, -3, 3)) : float(kvtest::uniform_int(g, -100, 100)) / 7.0f;
      extra.push_back({score, s});  // duplicates allowed: the lowest id wins a lookup
    }
    const auto vocab = base_vocab(extra);
    const tokenizer t = load_vocab(vocab, 16);
    for (int text_trial = 0; text_trial < 10; ++text_trial) {
      std::string text;
      const int n = static_cast<int>(kvtest::uniform_int(g, 0, 30));
      for (int c = 0; c < n; ++c) text += alphabet[kvtest::uniform_int(g, 0, 5)];
      CAPTURE(text);
      const auto ids = encode(t, text);
      REQUIRE(ids == naive_encode(vocab, text));
      CHECK(decode_all(t, ids) == text);
    }
  }
}

TEST_CASE("merge rules: ties go to the leftmost pair; scores <= -1e10 and NaN never merge") {
  const auto ties = base_vocab({{0, " "}, {0, "a"}, {0, "b"}, {1, "ab"}, {1, "ba"}});
  const tokenizer t = load_vocab(ties);
  const int space = 259, a = 260, b = 261, ab = 262;
  CHECK(encode(t, "aba") == std::vector<int>{1, space, ab, a});
  const auto low = base_vocab({{0, " "}, {0, "a"}, {0, "b"}, {-2e10f, "ab"}, {std::nanf(""), "ba"}});
  const tokenizer u = load_vocab(low);
  CHECK(encode(u, "abab") == std::vector<int>{1, space, a, b, a, b});
  // duplicate pieces: the lowest id is the one looked up
  const auto dup = base_vocab({{0, " "}, {0, "a"}, {5, "aa"}, {9, "aa"}});
  CHECK(load_vocab(dup).lookup("aa") == 261);
  CHECK(encode(load_vocab(dup), "aa") == std::vector<int>{1, 259, 261});
  CHECK(t.lookup("zz") == -1);
}

TEST_CASE("encode/decode round trips on tok512 (text, ASCII, arbitrary bytes)") {
  auto g = kvtest::rng(8);
  for (int trial = 0; trial < 600; ++trial) {
    const std::string text = random_text(g, 60, trial % 3);
    CAPTURE(trial);
    const auto ids = encode(tok512(), text);
    REQUIRE(ids.front() == bos_token);
    for (const int id : ids) REQUIRE((id >= 0 && id < 512));
    CHECK(decode_all(tok512(), ids) == text);
    if (trial % 3 == 1) {
      // printable ASCII: run.c's printing filter drops nothing (it drops the single bytes of
      // byte-fallback tokens that are not printable ASCII, e.g. the UTF-8 bytes of "ï")
      std::string printed;
      REQUIRE(detokenize(tok512(), ids, printed).ok());
      CHECK(printed == text);
    }
  }
  // NUL bytes are encoded as <0x00> (run.c's C-string input would stop there)
  const std::string with_nul("a\0b", 3);
  const auto ids = encode(tok512(), with_nul);
  CHECK(decode_all(tok512(), ids) == with_nul);
}

TEST_CASE("decode: leading space after BOS, byte tokens, printing filter, errors") {
  const tokenizer& t = tok512();
  const int once = 403;  // " Once"
  REQUIRE(t.piece(once) == " Once");
  CHECK(*t.decode(bos_token, once) == "Once");
  CHECK(*t.decode(261, once) == " Once");
  REQUIRE(t.piece(13) == "<0x0A>");
  CHECK(*t.decode(261, 13) == "\n");
  CHECK(*t.decode(261, 3) == std::string(1, '\0'));
  CHECK(*t.decode(261, 258) == std::string(1, '\xFF'));
  CHECK(*t.decode(261, 1) == "\n<s>\n");
  require_error(t.decode(0, 512).error(), errc::out_of_range, "decode: token 512 is outside [0, 512)");
  require_error(t.decode(0, -1).error(), errc::out_of_range, "token -1");
  CHECK(printable_piece("a"));
  CHECK(printable_piece("\n"));
  CHECK(printable_piece(" "));
  CHECK(printable_piece("\x01\x02"));  // longer pieces are printed as they are
  CHECK_FALSE(printable_piece(""));
  CHECK_FALSE(printable_piece(std::string(1, '\x07')));
  CHECK_FALSE(printable_piece(std::string(1, '\0')));
  CHECK_FALSE(printable_piece(std::string(1, '\xC3')));
  // byte tokens must look exactly like <0xHH>
  const auto odd = base_vocab({{0, " "}, {0, "<0x4>"}, {0, "<0x41>x"}, {0, "<0x4g>"}, {0, "<0xa1>"}});
  const tokenizer o = load_vocab(odd);
  CHECK(*o.decode(0, 260) == "<0x4>");
  CHECK(*o.decode(0, 261) == "<0x41>x");
  CHECK(*o.decode(0, 262) == "<0x4g>");
  CHECK(*o.decode(0, 263) == "\xA1");
}

TEST_CASE("tokenizer loader: each malformed input gets its specific error") {
  tokenizer t;
  const auto load = [&](const std::vector<unsigned char>& b, int vocab) { return tokenizer::load(b.data(), b.size(), vocab, t); };
  const std::vector<token_spec> three = {{0, "a"}, {-1, "bc"}, {-2, "d"}};
  REQUIRE(load(tokenizer_bytes(4, three), 3).ok());
  require_error(load(tokenizer_bytes(4, three), 0), errc::invalid_argument, "vocab_size must be positive (got 0)");
  require_error(tokenizer::load(nullptr, 0, 3, t), errc::format_error, "0 bytes is shorter than the 4-byte header");
  require_error(load({1, 0, 0}, 3), errc::format_error, "3 bytes is shorter than the 4-byte header");
  require_error(load(tokenizer_bytes(0, three), 3), errc::format_error, "max_token_length must be positive (got 0)");
  require_error(load(tokenizer_bytes(-5, three), 3), errc::format_error, "max_token_length must be positive (got -5)");
  require_error(load(tokenizer_bytes(1, three), 3), errc::format_error, "token 1 has length 2, outside [0, max_token_length 1]");
  auto b = tokenizer_bytes(4, three);
  // a negative length in token 2's record (bytes 4 + 9 + 10 + 4)
  const std::int32_t negative = -7;
  auto neg = b;
  std::memcpy(neg.data() + 4 + 9 + 10 + 4, &negative, 4);
  require_error(load(neg, 3), errc::format_error, "token 2 has length -7");
  // a length that runs past the end (within max_token_length)
  auto past = b;
  const std::int32_t three_bytes = 3;
  std::memcpy(past.data() + 4 + 9 + 10 + 4, &three_bytes, 4);
  require_error(load(past, 3), errc::format_error, "token 2 (length 3) runs past the end of the input");
  // a record header cut short
  auto cut = b;
  cut.resize(4 + 9 + 10 + 5);
  require_error(load(cut, 3), errc::format_error, "token 2 is cut short at byte 23 (record header needs 8 bytes, 5 left)");
  // a NUL byte inside a token
  require_error(load(tokenizer_bytes(4, {{0, "a"}, {0, std::string("b\0c", 3)}}), 2), errc::format_error,
                "token 1 contains a NUL byte");
  // vocabulary mismatch, both ways
  require_error(load(b, 4), errc::format_error, "the input holds 3 tokens but the model's vocabulary has 4");
  require_error(load(b, 2), errc::format_error, "the input holds 3 tokens but the model's vocabulary has 2");
  // a lying length far beyond the input is rejected before any allocation
  auto lying = b;
  const std::int32_t huge = std::numeric_limits<std::int32_t>::max();
  std::memcpy(lying.data(), &huge, 4);
  std::memcpy(lying.data() + 4 + 4, &huge, 4);
  require_error(load(lying, 3), errc::format_error, "token 0 (length 2147483647) runs past the end of the input");
  // a failed load leaves the output untouched
  REQUIRE(load(b, 3).ok());
  require_error(load(cut, 3), errc::format_error, "cut short");
  CHECK(t.vocab_size() == 3);
  CHECK(t.max_token_length() == 4);
  CHECK(t.longest_piece() == 2);
  CHECK(t.piece(1) == "bc");
  CHECK(t.score(2) == -2.0f);
  // files
  require_error(tokenizer::load_file("/nonexistent/tok.bin", 512, t), errc::io_error,
                "tokenizer: cannot open '/nonexistent/tok.bin': No such file or directory");
  require_error(tokenizer::load_file(KVEVICT_SOURCE_DIR "/models/tok512.bin", 32000, t), errc::format_error,
                "the input holds 512 tokens but the model's vocabulary has 32000");
}

TEST_CASE("an overstated max_token_length costs nothing") {
  // found by fuzz_tokenizer: encode used to reserve 2 x max_token_length bytes
  const tokenizer t = load_vocab({{0, " "}, {0, "a"}, {0, "b"}, {1, " a"}}, 0x40000006);
  CHECK(t.max_token_length() == 0x40000006);
  CHECK(t.longest_piece() == 2);
  CHECK(encode(t, "ab") == std::vector<int>{1, 3, 2});
}

TEST_CASE("encode errors: no dummy-prefix token, no byte fallback") {
  const tokenizer no_space = load_vocab(base_vocab({{0, "a"}}));
  std::vector<int> ids;
  require_error(no_space.encode("a", true, false, ids), errc::invalid_argument, "the vocabulary has no \" \" token");
  CHECK(no_space.encode("", true, false, ids).ok());  // an empty text needs no dummy prefix
  const tokenizer small = load_vocab({{0, "<unk>"}, {0, "<s>"}, {0, "</s>"}, {0, " "}, {0, "a"}});
  CHECK(encode(small, "a") == std::vector<int>{1, 3, 4});
  require_error(small.encode("ab", true, false, ids), errc::invalid_argument,
                "byte 0x62 has no fallback token in a vocabulary of 5");
  const tokenizer one = load_vocab({{0, " "}});
  require_error(one.encode(" ", true, false, ids), errc::invalid_argument, "BOS (token 1) is outside the vocabulary of 1");
  CHECK(encode(one, " ", false) == std::vector<int>{0, 0});
  const tokenizer two = load_vocab({{0, " "}, {0, "a"}});
  require_error(two.encode("a", false, true, ids), errc::invalid_argument, "EOS (token 2) is outside the vocabulary of 2");
  CHECK(encode(two, "a", false) == std::vector<int>{0, 1});
}
