// The files shipped in models/, loaded once per test program: the stories260K checkpoint and the
// trained LookaheadKV module (docs/runner.md, docs/lookaheadkv.md). A load failure fails the test
// that asked first, with the loader's message.
#pragma once

#include <lookaheadkv/module.hpp>
#include <runner/model.hpp>

#include <doctest/doctest.h>

#include <string>

namespace kvtest {

/// models/stories260K.bin.
inline const kvrun::model& shipped_model() {
  static const kvrun::model m = [] {
    kvrun::model x;
    const kvevict::status st = kvrun::model::load_file(KVEVICT_SOURCE_DIR "/models/stories260K.bin", x);
    REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    return x;
  }();
  return m;
}

/// models/lookahead/stories260K-n16.bin, the LookaheadKV module trained for shipped_model().
inline const kvrun::lookahead_module& shipped_module() {
  static const kvrun::lookahead_module m = [] {
    kvrun::lookahead_module x;
    const kvevict::status st = kvrun::load_module(KVEVICT_SOURCE_DIR "/models/lookahead/stories260K-n16.bin", x);
    REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
    return x;
  }();
  return m;
}

}  // namespace kvtest
