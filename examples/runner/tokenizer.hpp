// runner/tokenizer.hpp: llama2.c's tokenizer (sentencepiece BPE with byte fallback), with the
// encode/decode semantics of llama2.c's run.c.
//
// File format (native little-endian):
//   int32 max_token_length
//   per token: float32 merge score, int32 byte length, the bytes (no terminator)
// The file does not store the vocabulary size: it must hold exactly the model's vocab_size
// tokens.
#pragma once

#include "io.hpp"

#include <kvevict/status.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace kvrun {

using kvevict::errc;
using kvevict::status;

/// Token ids with a meaning in llama2.c's vocabularies.
inline constexpr int bos_token = 1;  ///< begins a sequence; run.c also stops generating at it
inline constexpr int eos_token = 2;
/// Byte b falls back to token b + byte_token_offset (after <unk>, <s>, </s>).
inline constexpr int byte_token_offset = 3;

class tokenizer {
 public:
  /// Parses a tokenizer held in memory. `vocab_size` is the model's. On failure `out` is unchanged.
  /// Errors: invalid_argument (vocab_size <= 0); format_error: input shorter than the 4-byte header,
  /// max_token_length <= 0, a token record cut short, a negative length or one above
  /// max_token_length, a token containing a NUL byte (run.c's C strings cannot hold one), and a
  /// token count different from `vocab_size`.
  static status load(const void* data, std::size_t size, int vocab_size, tokenizer& out) {
    const auto* p = static_cast<const unsigned char*>(data);
    if (vocab_size <= 0)
      return status::error(errc::invalid_argument, "tokenizer: vocab_size must be positive (got %d)", vocab_size);
    if (size < 4) return status::error(errc::format_error, "tokenizer: %zu bytes is shorter than the 4-byte header", size);
    std::int32_t max_len = 0;
    std::memcpy(&max_len, p, 4);
    if (max_len <= 0)
      return status::error(errc::format_error, "tokenizer: max_token_length must be positive (got %d)", max_len);

    // first pass: validate every record and count them, allocating nothing
    std::size_t off = 4, count = 0, piece_bytes = 0;
    while (off < size) {
      if (size - off < 8)
        return status::error(errc::format_error, "tokenizer: token %zu is cut short at byte %zu (record header needs 8 bytes, %zu left)",
                             count, off, size - off);
      std::int32_t len = 0;
      std::memcpy(&len, p + off + 4, 4);
      if (len < 0 || len > max_len)
        return status::error(errc::format_error, "tokenizer: token %zu has length %d, outside [0, max_token_length %d]",
                             count, len, max_len);
      if (size - off - 8 < static_cast<std::size_t>(len))
        return status::error(errc::format_error, "tokenizer: token %zu (length %d) runs past the end of the input", count,
                             len);
      if (std::memchr(p + off + 8, 0, static_cast<std::size_t>(len)) != nullptr)
        return status::error(errc::format_error, "tokenizer: token %zu contains a NUL byte", count);
      off += 8 + static_cast<std::size_t>(len);
      piece_bytes += static_cast<std::size_t>(len);
      ++count;
    }
    if (count != static_cast<std::size_t>(vocab_size))
      return status::error(errc::format_error, "tokenizer: the input holds %zu tokens but the model's vocabulary has %d", count,
                           vocab_size);

    tokenizer t;
    t.max_token_length_ = max_len;
    t.longest_ = 0;
    t.bytes_.reserve(piece_bytes);
    t.offsets_.reserve(count + 1);
    t.scores_.reserve(count);
    off = 4;
    t.offsets_.push_back(0);
    for (std::size_t i = 0; i < count; ++i) {
      float score = 0;
      std::int32_t len = 0;
      std::memcpy(&score, p + off, 4);
      std::memcpy(&len, p + off + 4, 4);
      t.scores_.push_back(score);
      t.bytes_.append(reinterpret_cast<const char*>(p + off + 8), static_cast<std::size_t>(len));
      t.longest_ = std::max(t.longest_, static_cast<int>(len));
      t.offsets_.push_back(t.bytes_.size());
      off += 8 + static_cast<std::size_t>(len);
    }
    t.sorted_.resize(count);
    for (std::size_t i = 0; i < count; ++i) t.sorted_[i] = static_cast<int>(i);
    std::stable_sort(t.sorted_.begin(), t.sorted_.end(), [&t](int a, int b) { return t.piece(a) < t.piece(b); });
    out = std::move(t);
    return {};
  }

  /// Reads a tokenizer file. Errors: io_error (cannot open or read) and every error of load().
  /// A regular file of at most io::limit::tokenizer_bytes (programs/io.hpp).
  static status load_file(const std::string& path, int vocab_size, tokenizer& out) {
    std::vector<unsigned char> bytes;
    KVEVICT_TRY(kvevict::io::read_file(path, "tokenizer", kvevict::io::limit::tokenizer_bytes, bytes));
    return load(bytes.data(), bytes.size(), vocab_size, out);
  }

  int vocab_size() const { return static_cast<int>(scores_.size()); }
  /// The header's bound on token lengths (every token is at most this long).
  int max_token_length() const { return max_token_length_; }
  /// The length of the longest token (<= max_token_length(), which a file may overstate).
  int longest_piece() const { return longest_; }
  /// The bytes of token `id` (0 <= id < vocab_size()).
  std::string_view piece(int id) const {
    const std::size_t b = offsets_[static_cast<std::size_t>(id)], e = offsets_[static_cast<std::size_t>(id) + 1];
    return std::string_view(bytes_).substr(b, e - b);
  }
  float score(int id) const { return scores_[static_cast<std::size_t>(id)]; }
  /// The id of the token whose bytes are exactly `s` (the lowest id if several are), or -1.
  int lookup(std::string_view s) const {
    const auto it = std::lower_bound(sorted_.begin(), sorted_.end(), s,
                                     [this](int id, std::string_view key) { return piece(id) < key; });
    return it != sorted_.end() && piece(*it) == s ? *it : -1;
  }

  /// Encodes UTF-8 text as run.c's encode() does: optional BOS; a dummy-prefix " " token unless
  /// the text is empty; one token per UTF-8 code point found in the vocabulary (a code point is a
  /// lead byte plus at most 3 continuation bytes), otherwise one byte-fallback token per byte
  /// (byte + 3); then repeatedly merge the adjacent pair whose concatenation is a token with the
  /// highest score (> -1e10; ties -> leftmost pair); optional EOS. The whole view is encoded (a NUL
  /// byte becomes <0x00>; run.c stops at it, its input being a C string).
  /// Errors (invalid_argument): BOS or EOS asked for but outside the vocabulary; the vocabulary has
  /// no " " token for the dummy prefix; a byte has no fallback token (vocabularies of fewer than
  /// 259 tokens). `out` is replaced.
  status encode(std::string_view text, bool bos, bool eos, std::vector<int>& out) const {
    out.clear();
    if ((bos && bos_token >= vocab_size()) || (eos && eos_token >= vocab_size()))
      return status::error(errc::invalid_argument, "tokenizer: encode: %s (token %d) is outside the vocabulary of %d",
                           bos && bos_token >= vocab_size() ? "BOS" : "EOS", bos && bos_token >= vocab_size() ? bos_token : eos_token,
                           vocab_size());
    if (bos) out.push_back(bos_token);
    if (!text.empty()) {
      const int space = lookup(" ");
      if (space < 0) return status::error(errc::invalid_argument, "tokenizer: encode: the vocabulary has no \" \" token for the dummy prefix");
      out.push_back(space);
    }
    std::size_t start = 0;  // first byte of the current code point
    for (std::size_t i = 0; i < text.size(); ++i) {
      if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) start = i;
      const bool continued = i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80;
      if (continued && i + 1 - start < 4) continue;
      const std::string_view cp = text.substr(start, i + 1 - start);
      const int id = lookup(cp);
      if (id >= 0) {
        out.push_back(id);
      } else {
        for (const char c : cp) {
          const int b = static_cast<unsigned char>(c) + byte_token_offset;
          if (b >= vocab_size())
            return status::error(errc::invalid_argument, "tokenizer: encode: byte 0x%02X has no fallback token in a vocabulary of %d",
                                 static_cast<unsigned char>(c), vocab_size());
          out.push_back(b);
        }
      }
      start = i + 1;  // a stray continuation byte starts a new code point (as in run.c)
    }
    merge(out);
    if (eos) out.push_back(eos_token);
    return {};
  }

  /// The text of `token` following `prev`, as run.c's decode(): after BOS a leading space is
  /// dropped; a byte token "<0xHH>" (exactly: '<', '0', 'x', two hex digits, '>') becomes that
  /// byte. Errors: out_of_range for a token outside the vocabulary.
  kvevict::result<std::string_view> decode(int prev, int token) const {
    if (token < 0 || token >= vocab_size())
      return status::error(errc::out_of_range, "tokenizer: decode: token %d is outside [0, %d)", token, vocab_size());
    std::string_view s = piece(token);
    if (prev == bos_token && !s.empty() && s[0] == ' ') s.remove_prefix(1);
    int byte = 0;
    if (parse_byte_token(s, byte)) return std::string_view(byte_chars() + byte, 1);
    return s;
  }

 private:
  int max_token_length_ = 0;
  int longest_ = 0;
  std::string bytes_;                  // all pieces, concatenated
  std::vector<std::size_t> offsets_;   // piece i is bytes_[offsets_[i], offsets_[i+1])
  std::vector<float> scores_;
  std::vector<int> sorted_;            // ids ordered by piece bytes (ties: lower id first)

  /// A table of the 256 byte values, for decoding byte tokens to one-byte views.
  static const char* byte_chars() {
    static const std::array<char, 256> table = [] {
      std::array<char, 256> t{};
      for (int i = 0; i < 256; ++i) t[static_cast<std::size_t>(i)] = static_cast<char>(i);
      return t;
    }();
    return table.data();
  }

  static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }
  static bool parse_byte_token(std::string_view s, int& byte) {
    if (s.size() != 6 || s.substr(0, 3) != "<0x" || s[5] != '>') return false;
    const int hi = hex_value(s[3]), lo = hex_value(s[4]);
    if (hi < 0 || lo < 0) return false;
    byte = hi * 16 + lo;
    return true;
  }

  // Greedy BPE merges over all tokens (BOS included, as in run.c). The merge result of each
  // adjacent pair is cached and only the two pairs next to a merge are looked up again, which
  // gives run.c's result (highest score > -1e10, leftmost on ties) with O(n) lookups instead of
  // run.c's O(n^2).
  void merge(std::vector<int>& tokens) const {
    constexpr float no_merge = -1e10f;
    std::vector<int> pair_id;
    std::string buf;
    buf.reserve(2 * static_cast<std::size_t>(longest_));  // not max_token_length_: a header may overstate it
    auto pair = [&](std::size_t i) {
      buf.assign(piece(tokens[i]));
      buf.append(piece(tokens[i + 1]));
      return lookup(buf);
    };
    if (tokens.size() < 2) return;
    pair_id.resize(tokens.size() - 1);
    for (std::size_t i = 0; i + 1 < tokens.size(); ++i) pair_id[i] = pair(i);
    for (;;) {
      float best = no_merge;
      std::size_t best_i = pair_id.size();
      for (std::size_t i = 0; i < pair_id.size(); ++i)
        if (pair_id[i] >= 0 && score(pair_id[i]) > best) {
          best = score(pair_id[i]);
          best_i = i;
        }
      if (best_i == pair_id.size()) break;
      tokens[best_i] = pair_id[best_i];
      tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_i) + 1);
      pair_id.erase(pair_id.begin() + static_cast<std::ptrdiff_t>(best_i));
      if (best_i > 0) pair_id[best_i - 1] = pair(best_i - 1);
      if (best_i < pair_id.size()) pair_id[best_i] = pair(best_i);
    }
  }
};

/// run.c's safe_printf filter: false for a one-byte piece that is neither printable nor
/// whitespace (control bytes from byte tokens); everything else is printed.
inline bool printable_piece(std::string_view piece) {
  if (piece.empty()) return false;
  if (piece.size() == 1) {
    const unsigned char c = static_cast<unsigned char>(piece[0]);
    return std::isprint(c) || std::isspace(c);
  }
  return true;
}

}  // namespace kvrun
