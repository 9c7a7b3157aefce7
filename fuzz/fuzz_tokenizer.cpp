// Two targets in one, chosen by the first byte:
//  even: the rest is a tokenizer file (after 2 bytes giving the vocabulary size, 1..1024) ->
//        tokenizer::load; an accepted vocabulary then encodes a few texts and decodes every token.
//  odd:  the rest is text (at most 4096 bytes) -> encode with the real tok512 vocabulary; every id
//        must be in range and decoding must give the text back byte for byte.
#include <runner/tokenizer.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

const kvrun::tokenizer& tok512() {
  static const kvrun::tokenizer t = [] {
    // models/ next to this file's directory (fuzz/)
    const std::string here = __FILE__;
    const std::string path = here.substr(0, here.rfind("/fuzz/")) + "/models/tok512.bin";
    kvrun::tokenizer loaded;
    if (!kvrun::tokenizer::load_file(path, 512, loaded).ok()) std::abort();
    return loaded;
  }();
  return t;
}

std::string decode_all(const kvrun::tokenizer& t, const std::vector<int>& ids) {
  std::string s;
  for (std::size_t i = 1; i < ids.size(); ++i) {
    const auto piece = t.decode(ids[i - 1], ids[i]);
    if (!piece.ok()) std::abort();
    s.append(piece->data(), piece->size());
  }
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const bool text_mode = (data[0] & 1) != 0;
  std::vector<int> ids;
  if (text_mode) {
    if (size - 1 > 4096) return 0;
    const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
    const kvrun::tokenizer& t = tok512();
    if (!t.encode(text, true, false, ids).ok()) std::abort();
    for (const int id : ids)
      if (id < 0 || id >= t.vocab_size()) std::abort();
    if (decode_all(t, ids) != text) std::abort();
    return 0;
  }
  if (size < 3) return 0;
  const int vocab = 1 + ((data[1] | (data[2] << 8)) % 1024);
  kvrun::tokenizer t;
  if (!kvrun::tokenizer::load(data + 3, size - 3, vocab, t).ok()) return 0;
  if (t.vocab_size() != vocab) std::abort();
  for (const char* text : {"", "a", "Once upon a time", "\xC3\xA9\xFF\x80 x"}) {
    const kvevict::status st = t.encode(text, true, true, ids);  // may fail: no " " or no byte fallback
    if (st.ok())
      for (const int id : ids)
        if (id < 0 || id >= vocab) std::abort();
  }
  for (int id = 0; id < vocab; ++id)
    if (!t.decode(id == 0 ? 1 : id - 1, id).ok()) std::abort();
  return 0;
}
